module istio-cni-rs/xds/interop/istio-fixtures

go 1.26.0

require (
	google.golang.org/protobuf v1.36.12-0.20260120151049-f2248ac996af
	istio.io/istio v0.0.0-20260827124520-eed52ebb66ad
)

require github.com/golang/protobuf v1.5.4 // indirect
