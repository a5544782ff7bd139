// A grpc-go Delta ADS server that plays istiod for one scripted conversation, to check the Rust xds client against
// the real grpc-go stack (HTTP/2 framing, lazy response headers, trailers, TLS/ALPN, metadata, flow control).
// Not part of CI: run through ../run.sh. Writes its CA certificate to -ca, listens on -addr, exits 0 once the
// client has gone through the script, 1 on the first mismatch.
package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"flag"
	"fmt"
	"log"
	"math/big"
	"net"
	"net/netip"
	"os"
	"strings"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/anypb"
)

const (
	addressType = "type.googleapis.com/istio.workload.Address"
	authzType   = "type.googleapis.com/istio.security.Authorization"
	serverName  = "istiod.istio-system.svc"
	workloads   = 3000 // about 300 KB in one response: past HTTP/2's default 64 KiB windows
)

var (
	token  = flag.String("token", "interop-token", "bearer token required")
	caPath = flag.String("ca", "ca.pem", "where to write the CA certificate")
	addr   = flag.String("addr", "127.0.0.1:0", "listen address")
	done   = make(chan error, 1)
	stream = 0
)

// workload encodes istio.workload.Address{workload: Workload{uid=20, name=1, namespace=2, addresses=3,
// tunnel_protocol=5}} by hand (field numbers from Istio's workload.proto).
func workload(uid string, tunnel uint64) []byte {
	var w []byte
	w = protowire.AppendTag(w, 1, protowire.BytesType)
	w = protowire.AppendString(w, uid[strings.LastIndex(uid, "/")+1:])
	w = protowire.AppendTag(w, 2, protowire.BytesType)
	w = protowire.AppendString(w, "default")
	w = protowire.AppendTag(w, 3, protowire.BytesType)
	w = protowire.AppendBytes(w, []byte{10, 0, 0, 1})
	if tunnel != 0 {
		w = protowire.AppendTag(w, 5, protowire.VarintType)
		w = protowire.AppendVarint(w, tunnel)
	}
	w = protowire.AppendTag(w, 20, protowire.BytesType)
	w = protowire.AppendString(w, uid)
	var a []byte
	a = protowire.AppendTag(a, 1, protowire.BytesType)
	return protowire.AppendBytes(a, w)
}

// policy encodes istio.security.Authorization{name=1, namespace=2, scope=3 NAMESPACE}.
func policy(ns, name string) []byte {
	var p []byte
	p = protowire.AppendTag(p, 1, protowire.BytesType)
	p = protowire.AppendString(p, name)
	p = protowire.AppendTag(p, 2, protowire.BytesType)
	p = protowire.AppendString(p, ns)
	p = protowire.AppendTag(p, 3, protowire.VarintType)
	return protowire.AppendVarint(p, 1)
}

func resource(name, version, typeURL string, value []byte) *discovery.Resource {
	return &discovery.Resource{Name: name, Version: version, Resource: &anypb.Any{TypeUrl: typeURL, Value: value}}
}

type server struct {
	discovery.UnimplementedAggregatedDiscoveryServiceServer
}

func expect(ok bool, format string, args ...any) {
	if !ok {
		done <- fmt.Errorf(format, args...)
		select {}
	}
}

func (server) DeltaAggregatedResources(s discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesServer) error {
	md, _ := metadata.FromIncomingContext(s.Context())
	if got := md.Get("authorization"); len(got) != 1 || got[0] != "Bearer "+*token {
		return status.Error(codes.Unauthenticated, "request authenticate failure")
	}
	expect(len(md.Get("clusterid")) == 1, "clusterid header: %v", md.Get("clusterid"))
	stream++
	first, err := s.Recv()
	expect(err == nil, "first request: %v", err)
	node := first.GetNode()
	expect(node != nil, "no node in the first request")
	parts := strings.Split(node.GetId(), "~")
	expect(len(parts) == 4 && parts[0] == "ztunnel", "node id %q", node.GetId())
	_, err = netip.ParseAddr(parts[1])
	expect(err == nil, "node id IP %q", parts[1])
	expect(node.GetMetadata().GetFields()["NAMESPACE"].GetStringValue() != "", "metadata %v", node.GetMetadata())
	expect(first.GetTypeUrl() == addressType, "first type %q", first.GetTypeUrl())
	second, err := s.Recv()
	expect(err == nil && second.GetTypeUrl() == authzType, "second request %v %v", second, err)
	log.Printf("stream %d: node %s, held Address versions %d", stream, node.GetId(), len(first.GetInitialResourceVersions()))

	if stream == 1 {
		var rs []*discovery.Resource
		for i := 0; i < workloads; i++ {
			uid := fmt.Sprintf("Kubernetes//Pod/default/pod-%05d", i)
			rs = append(rs, resource(uid, "v1", addressType, workload(uid, 1)))
		}
		rs = append(rs, resource("Kubernetes//Pod/default/bad", "v1", addressType, workload("Kubernetes//Pod/default/bad", 9)))
		expect(s.Send(&discovery.DeltaDiscoveryResponse{TypeUrl: addressType, Nonce: "n1", Resources: rs}) == nil, "send n1")
		nack, err := s.Recv()
		expect(err == nil && nack.GetResponseNonce() == "n1", "answer to n1: %v %v", nack, err)
		expect(nack.GetErrorDetail() != nil && strings.Contains(nack.GetErrorDetail().GetMessage(), "Kubernetes//Pod/default/bad: "),
			"NACK of n1: %v", nack.GetErrorDetail())
		expect(!strings.Contains(nack.GetErrorDetail().GetMessage(), "pod-0"), "good resources NACKed: %v", nack.GetErrorDetail())
		log.Printf("NACK: code %d %q", nack.GetErrorDetail().GetCode(), nack.GetErrorDetail().GetMessage())
		p := resource("ns/p", "", authzType, policy("ns", "p"))
		expect(s.Send(&discovery.DeltaDiscoveryResponse{TypeUrl: authzType, Nonce: "n2", Resources: []*discovery.Resource{p}}) == nil, "send n2")
		ack, err := s.Recv()
		expect(err == nil && ack.GetResponseNonce() == "n2" && ack.GetErrorDetail() == nil, "ACK of n2: %v %v", ack, err)
		// As istiod at --keepaliveMaxServerConnectionAge: the client backs off 10 ms and comes back.
		return status.Error(codes.Unavailable, "transport is closing")
	}

	held := first.GetInitialResourceVersions()
	expect(len(held) == workloads, "held Address versions: %d", len(held))
	expect(held["Kubernetes//Pod/default/pod-00000"] == "v1", "held version of pod-00000: %q", held["Kubernetes//Pod/default/pod-00000"])
	_, bad := held["Kubernetes//Pod/default/bad"]
	expect(!bad, "the NACKed resource was echoed")
	expect(len(second.GetInitialResourceVersions()) == 1, "held Authorization versions: %v", second.GetInitialResourceVersions())
	expect(s.Send(&discovery.DeltaDiscoveryResponse{TypeUrl: addressType, Nonce: "n3",
		RemovedResources: []string{"Kubernetes//Pod/default/pod-00000"}}) == nil, "send n3")
	ack, err := s.Recv()
	expect(err == nil && ack.GetResponseNonce() == "n3" && ack.GetErrorDetail() == nil, "ACK of n3: %v %v", ack, err)
	done <- nil
	select {}
}

func main() {
	flag.Parse()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		log.Fatal(err)
	}
	caTemplate := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "interop CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTemplate, caTemplate, &key.PublicKey, key)
	if err != nil {
		log.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	leafKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	leafTemplate := &x509.Certificate{SerialNumber: big.NewInt(2), DNSNames: []string{serverName},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	leafDER, err := x509.CreateCertificate(rand.Reader, leafTemplate, ca, &leafKey.PublicKey, key)
	if err != nil {
		log.Fatal(err)
	}
	if err := os.WriteFile(*caPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o644); err != nil {
		log.Fatal(err)
	}
	cert := tls.Certificate{Certificate: [][]byte{leafDER}, PrivateKey: leafKey}
	lis, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(lis.Addr().String())
	g := grpc.NewServer(grpc.Creds(credentials.NewServerTLSFromCert(&cert)))
	discovery.RegisterAggregatedDiscoveryServiceServer(g, server{})
	go func() { _ = g.Serve(lis) }()
	select {
	case err := <-done:
		if err != nil {
			log.Printf("INTEROP FAILED: %v", err)
			os.Exit(1)
		}
		log.Printf("INTEROP OK: %d streams", stream)
	case <-time.After(60 * time.Second):
		log.Printf("INTEROP FAILED: timed out after %d streams", stream)
		os.Exit(1)
	}
}
