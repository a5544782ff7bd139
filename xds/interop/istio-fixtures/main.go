// Writes Address (workload and service) and Authorization resources, every field set, encoded by Istio's own
// generated Go types (istio.io/istio/pkg/workloadapi{,/security}), into the directory given: the fixtures the Rust
// wire tests decode and re-encode byte for byte (xds/tests/istio_fixtures.rs). Regenerate with ../fixtures.sh.
package main

import (
	"log"
	"os"
	"path/filepath"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/wrapperspb"
	"istio.io/istio/pkg/workloadapi"
	"istio.io/istio/pkg/workloadapi/security"
)

func u32(v uint32) *uint32 { return &v }

func main() {
	dir := os.Args[1]
	ext := []*workloadapi.Extension{{Name: "ext", Config: &anypb.Any{TypeUrl: "type.googleapis.com/x.Y", Value: []byte{1, 2}}}}
	hostGw := &workloadapi.GatewayAddress{
		Destination:   &workloadapi.GatewayAddress_Hostname{Hostname: &workloadapi.NamespacedHostname{Namespace: "istio-system", Hostname: "waypoint.istio-system.svc.cluster.local"}},
		HboneMtlsPort: 15008,
	}
	addrGw := &workloadapi.GatewayAddress{
		Destination:   &workloadapi.GatewayAddress_Address{Address: &workloadapi.NetworkAddress{Network: "net-2", Address: []byte{172, 16, 0, 1}, Length: u32(32)}},
		HboneMtlsPort: 15009,
	}
	workload := &workloadapi.Address{Type: &workloadapi.Address_Workload{Workload: &workloadapi.Workload{
		Uid: "Kubernetes//Pod/default/pod-a", Name: "pod-a", Namespace: "default",
		Addresses: [][]byte{{10, 244, 1, 5}, {0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5}},
		Hostname:  "pod-a.example", Network: "net-1", TunnelProtocol: workloadapi.TunnelProtocol_HBONE,
		TrustDomain: "td.local", ServiceAccount: "sa-a", Waypoint: hostGw, NetworkGateway: addrGw, Node: "node-1",
		CanonicalName: "app-a", CanonicalRevision: "v2", WorkloadType: workloadapi.WorkloadType_POD, WorkloadName: "deploy-a",
		NativeTunnel: true, ApplicationTunnel: &workloadapi.ApplicationTunnel{Protocol: workloadapi.ApplicationTunnel_PROXY, Port: 15088},
		Services: map[string]*workloadapi.PortList{
			"default/svc-a.default.svc.cluster.local": {Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080, AppProtocol: workloadapi.AppProtocol_HTTP2}}},
			"default/svc-b.default.svc.cluster.local": {Ports: []*workloadapi.Port{{ServicePort: 443, TargetPort: 8443}}},
		},
		AuthorizationPolicies: []string{"default/allow-a"}, Status: workloadapi.WorkloadStatus_UNHEALTHY, ClusterId: "c1",
		Locality: &workloadapi.Locality{Region: "r", Zone: "z", Subzone: "s"}, NetworkMode: workloadapi.NetworkMode_HOST_NETWORK,
		Extensions: ext, Capacity: wrapperspb.UInt32(3),
	}}}
	service := &workloadapi.Address{Type: &workloadapi.Address_Service{Service: &workloadapi.Service{
		Name: "svc-a", Namespace: "default", Hostname: "svc-a.default.svc.cluster.local",
		Addresses:       []*workloadapi.NetworkAddress{{Network: "net-1", Address: []byte{10, 96, 0, 10}}},
		Ports:           []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080, AppProtocol: workloadapi.AppProtocol_HTTP11}, {ServicePort: 9090, AppProtocol: workloadapi.AppProtocol_GRPC}},
		SubjectAltNames: []string{"spiffe://td.local/ns/default/sa/sa-a"}, Waypoint: hostGw,
		LoadBalancing: &workloadapi.LoadBalancing{
			RoutingPreference: []workloadapi.LoadBalancing_Scope{workloadapi.LoadBalancing_NETWORK, workloadapi.LoadBalancing_REGION, workloadapi.LoadBalancing_ZONE},
			Mode:              workloadapi.LoadBalancing_FAILOVER, HealthPolicy: workloadapi.LoadBalancing_ALLOW_ALL,
		},
		IpFamilies: workloadapi.IPFamilies_DUAL, Extensions: ext, Canonical: true, IngressUseWaypoint: true,
		WeightedWaypoints: []*workloadapi.WeightedWaypoint{{Destination: addrGw, Weight: 7}},
		Visibility:        workloadapi.Service_NAMESPACE,
	}}}
	str := func(kind int, v string) *security.StringMatch {
		switch kind {
		case 0:
			return &security.StringMatch{MatchType: &security.StringMatch_Exact{Exact: v}}
		case 1:
			return &security.StringMatch{MatchType: &security.StringMatch_Prefix{Prefix: v}}
		case 2:
			return &security.StringMatch{MatchType: &security.StringMatch_Suffix{Suffix: v}}
		}
		return &security.StringMatch{MatchType: &security.StringMatch_Presence{Presence: &emptypb.Empty{}}}
	}
	policy := &security.Authorization{
		Name: "allow-a", Namespace: "default", Scope: security.Scope_WORKLOAD_SELECTOR, Action: security.Action_DENY,
		Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{
			Namespaces: []*security.StringMatch{str(0, "ns-a")}, NotNamespaces: []*security.StringMatch{str(1, "kube-")},
			ServiceAccounts:    []*security.ServiceAccountMatch{{Namespace: "ns-a", ServiceAccount: "sa-a"}},
			NotServiceAccounts: []*security.ServiceAccountMatch{{Namespace: "ns-b", ServiceAccount: "sa-b"}},
			Principals:         []*security.StringMatch{str(2, "/sa/sa-a")}, NotPrincipals: []*security.StringMatch{str(3, "")},
			SourceIps:          []*security.Address{{Address: []byte{10, 0, 0, 0}, Length: 8}},
			NotSourceIps:       []*security.Address{{Address: []byte{10, 1, 0, 0}, Length: 16}},
			DestinationIps:     []*security.Address{{Address: []byte{0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, Length: 64}},
			NotDestinationIps:  []*security.Address{{Address: []byte{192, 168, 0, 1}, Length: 32}},
			DestinationPorts:   []uint32{80, 8080}, NotDestinationPorts: []uint32{22},
			Extensions:         ext,
		}}}}}},
		DryRun: true, Extensions: ext,
	}
	for name, m := range map[string]proto.Message{"address-workload.bin": workload, "address-service.bin": service, "authorization.bin": policy} {
		b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
		if err != nil {
			log.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			log.Fatal(err)
		}
	}
}
