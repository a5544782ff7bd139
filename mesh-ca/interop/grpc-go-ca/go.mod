module istio-cni-rs/mesh-ca/interop/grpc-go-ca

go 1.25.0

require (
	google.golang.org/grpc v1.82.0
	google.golang.org/protobuf v1.36.12-0.20260120151049-f2248ac996af
	istio.io/api v1.31.0-rc.0.0.20260824154656-b943409680a7
)

require (
	github.com/golang/protobuf v1.5.4 // indirect
	golang.org/x/net v0.55.0 // indirect
	golang.org/x/sys v0.45.0 // indirect
	golang.org/x/text v0.37.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260427160629-7cedc36a6bc4 // indirect
)
