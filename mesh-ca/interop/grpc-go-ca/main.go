// A grpc-go IstioCertificateService that plays istiod's CA for one request, with Istio's own generated types
// (istio.io/api security/v1alpha1), to check the Rust CA client against the stack and decoder istiod runs on.
// Not part of CI: run through ../run.sh. Writes its TLS root to -ca, its address to stdout, exits 0 once it has
// answered one well-formed request as istiod would, 1 on the first mismatch.
package main

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"flag"
	"fmt"
	"log"
	"math/big"
	"net"
	"net/url"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"
)

const serverName = "istiod.istio-system.svc"

var (
	token    = flag.String("token", "interop-token", "bearer token required")
	identity = flag.String("identity", "spiffe://cluster.local/ns/default/sa/bookinfo", "the identity expected")
	ttl      = flag.Int64("ttl", 43200, "validity_duration expected")
	caPath   = flag.String("ca", "ca.pem", "where to write the TLS root")
	done     = make(chan error, 1)
)

type ca struct {
	pb.UnimplementedIstioCertificateServiceServer
	key  crypto.Signer
	cert *x509.Certificate
	pem  string
}

// newCA makes a self-signed CA; istiod's own self-signed root is RSA 2048 (its default), so the mesh CA is RSA
// and the TLS one ECDSA.
func newCA(cn string, rsaKey bool) *ca {
	var key crypto.Signer
	if rsaKey {
		key, _ = rsa.GenerateKey(rand.Reader, 2048)
	} else {
		key, _ = ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: cn, Organization: []string{"cluster.local"}},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		log.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return &ca{key: key, cert: cert, pem: string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))}
}

func fail(format string, args ...any) error {
	err := fmt.Errorf(format, args...)
	select {
	case done <- err:
	default:
	}
	return status.Error(codes.InvalidArgument, err.Error())
}

func (c *ca) CreateCertificate(ctx context.Context, req *pb.IstioCertificateRequest) (*pb.IstioCertificateResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	if got := md.Get("authorization"); len(got) != 1 || got[0] != "Bearer "+*token {
		return nil, status.Error(codes.Unauthenticated, "request authenticate failure")
	}
	if got := md.Get("clusterid"); len(got) != 1 || got[0] != "Kubernetes" {
		return nil, fail("clusterid %v", got)
	}
	// istiod: crMetadata[security.ImpersonatedIdentity].GetStringValue()
	if got := req.GetMetadata().GetFields()["ImpersonatedIdentity"].GetStringValue(); got != *identity {
		return nil, fail("ImpersonatedIdentity %q", got)
	}
	if req.GetValidityDuration() != *ttl {
		return nil, fail("validity_duration %d", req.GetValidityDuration())
	}
	block, _ := pem.Decode([]byte(req.GetCsr()))
	if block == nil || block.Type != "CERTIFICATE REQUEST" {
		return nil, fail("csr is not a PEM CERTIFICATE REQUEST")
	}
	csr, err := x509.ParseCertificateRequest(block.Bytes)
	if err != nil {
		return nil, fail("csr: %v", err)
	}
	if err := csr.CheckSignature(); err != nil {
		return nil, fail("csr signature: %v", err)
	}
	pub, ok := csr.PublicKey.(*ecdsa.PublicKey)
	if !ok || pub.Curve != elliptic.P256() || csr.SignatureAlgorithm != x509.ECDSAWithSHA256 {
		return nil, fail("csr key %T, algorithm %v", csr.PublicKey, csr.SignatureAlgorithm)
	}
	if len(csr.URIs) != 1 || csr.URIs[0].String() != *identity || len(csr.DNSNames) != 0 || len(csr.Subject.Names) != 0 {
		return nil, fail("csr names: URIs %v DNS %v subject %v", csr.URIs, csr.DNSNames, csr.Subject)
	}
	uri, _ := url.Parse(*identity)
	now := time.Now()
	leaf := &x509.Certificate{
		SerialNumber: big.NewInt(now.UnixNano()), NotBefore: now.Add(-2 * time.Minute),
		NotAfter: now.Add(time.Duration(req.GetValidityDuration()) * time.Second), URIs: []*url.URL{uri},
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, leaf, c.cert, csr.PublicKey, c.key)
	if err != nil {
		return nil, fail("signing: %v", err)
	}
	leafPEM := string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	select {
	case done <- nil:
	default:
	}
	// istiod's shape: each certificate element ends in "\n", the root bundle last.
	return &pb.IstioCertificateResponse{CertChain: []string{leafPEM + "\n", c.pem}}, nil
}

func main() {
	flag.Parse()
	tlsCA := newCA("interop TLS root", false)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2), DNSNames: []string{serverName},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tlsCA.cert, &key.PublicKey, tlsCA.key)
	if err != nil {
		log.Fatal(err)
	}
	if err := os.WriteFile(*caPath, []byte(tlsCA.pem), 0o644); err != nil {
		log.Fatal(err)
	}
	creds := credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	server := grpc.NewServer(grpc.Creds(creds))
	pb.RegisterIstioCertificateServiceServer(server, newCA("interop mesh root", true))
	go server.Serve(lis)
	fmt.Println(lis.Addr().String())
	select {
	case err := <-done:
		// Let the response reach the client before stopping.
		time.Sleep(500 * time.Millisecond)
		if err != nil {
			log.Printf("FAIL: %v", err)
			os.Exit(1)
		}
		log.Printf("PASS: one CreateCertificate answered as istiod would")
	case <-time.After(60 * time.Second):
		log.Printf("FAIL: no request within 60 s")
		os.Exit(1)
	}
}
