//! The CA client and the certificate manager against the fake istiod CA: istiod's checks, chain validation,
//! refresh, backoff and bounds, as the proxy (and its config dump) would observe them.

use std::sync::Arc;
use std::time::Duration;

use hbone::identity::Identity;
use mesh_ca::chain::{ChainError, Limits};
use mesh_ca::client::{CaClient, FetchError, RequestSettings, Signer};
use mesh_ca::clock::Clock;
use mesh_ca::manager::{CertificateManager, ManagerConfig};
use mesh_ca::testing::{self, Caller, FakeCa, Pod, Tamper};
use mesh_ca::wire::IstioCertificateRequest;
use xds::channel::{ChannelConfig, ChannelError, Roots, Token};
use xds::grpc::Code;

const TD: &str = "cluster.local";
const NODE: &str = "node-1";
const TOKEN: &str = "ztunnel-pod-bound-token";
const SIGNING_UNAUTHENTICATED: &str = "signing gRPC error (The request does not have valid authentication credentials)";

fn id(ns: &str, sa: &str) -> Identity {
    Identity::new(TD, ns, sa).unwrap()
}

fn pod(ns: &str, name: &str, sa: &str, node: &str) -> Pod {
    Pod {
        namespace: ns.into(),
        name: name.into(),
        uid: format!("uid-{name}"),
        service_account: sa.into(),
        node: node.into(),
        failed: false,
    }
}

/// A fresh CA on `clock`, set up by [`with_node`].
fn ca(clock: Clock) -> FakeCa {
    with_node(FakeCa::new(TD, clock))
}

/// `ca` with the node proxy (`istio-system/ztunnel`, trusted) on `NODE` and one workload `default/bookinfo` there.
fn with_node(ca: FakeCa) -> FakeCa {
    ca.add_caller(
        TOKEN,
        Caller {
            namespace: "istio-system".into(),
            service_account: "ztunnel".into(),
            pod_name: "ztunnel-1".into(),
            pod_uid: "uid-ztunnel-1".into(),
        },
    );
    ca.add_pod(pod("istio-system", "ztunnel-1", "ztunnel", NODE));
    ca.add_pod(pod("default", "bookinfo-1", "bookinfo", NODE));
    ca.trust_node_account("istio-system", "ztunnel");
    ca
}

fn settings(clock: Clock) -> RequestSettings {
    RequestSettings { clock, ..RequestSettings::default() }
}

fn client(server: &testing::FakeCaServer, token: &str) -> CaClient {
    let mut config = ChannelConfig::new(server.address(), Roots::Pem(server.tls_root_pem().as_bytes().to_vec()));
    config.alt_hostname = Some(testing::SERVER_NAME.into());
    config.token = Token::Literal(token.into());
    config.cluster_id = "Kubernetes".into();
    CaClient::new(config, RequestSettings::default()).unwrap()
}

fn manager(signer: impl Signer, clock: Clock) -> CertificateManager {
    CertificateManager::new(Arc::new(signer), ManagerConfig { clock, ..ManagerConfig::default() })
}

/// A manager on `ca` asking for certificates of lifetime `ttl`, with `default/bookinfo` registered once.
fn registered_bookinfo(ca: &FakeCa, clock: Clock, ttl: Duration) -> (CertificateManager, Identity) {
    let manager = manager(ca.signer(TOKEN, RequestSettings { ttl, ..settings(clock) }), clock);
    let bookinfo = id("default", "bookinfo");
    manager.register(&bookinfo);
    (manager, bookinfo)
}

fn state_of(manager: &CertificateManager, identity: &Identity) -> String {
    let want = identity.to_string();
    manager.snapshot().into_iter().find(|s| s.identity == want).map(|s| s.state).unwrap_or_default()
}

async fn wait_state(manager: &CertificateManager, identity: &Identity, prefix: &str) -> String {
    wait_state_within(manager, identity, prefix, testing::WAIT).await
}

/// [`wait_state`] with a deadline of its own (tokio's clock: virtual in the paused tests).
async fn wait_state_within(manager: &CertificateManager, identity: &Identity, prefix: &str, limit: Duration) -> String {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let state = state_of(manager, identity);
        if state.starts_with(prefix) {
            return state;
        }
        assert!(tokio::time::Instant::now() < deadline, "state stayed {state:?}, expected {prefix:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn impersonation_over_tls_gives_a_verified_certificate_for_the_identity() {
    let ca = ca(Clock::System);
    let server = ca.serve().await;
    let client = client(&server, TOKEN);
    let bookinfo = id("default", "bookinfo");
    let cert = client.fetch(&bookinfo).await.unwrap();
    assert_eq!(cert.identity(), &bookinfo);
    assert_eq!(cert.chain().len(), 2, "leaf and intermediate");
    assert_eq!(cert.roots().len(), 1);
    // istiod back-dates notBefore by 2 minutes.
    assert_eq!(cert.not_after().duration_since(cert.not_before()).unwrap(), Duration::from_secs(86400 + 120));
    assert!(cert.issuer().contains("fake istiod intermediate"), "{}", cert.issuer());
    cert.certified_key().expect("a key rustls can present");
    let (identity, chain, key, issued, expires) = cert.to_workload_cert_parts();
    assert_eq!(
        (identity, chain.as_slice(), issued, expires),
        (bookinfo.clone(), cert.chain(), cert.not_before(), cert.not_after())
    );
    assert_eq!(key, cert.private_key().secret_der());

    let requests = ca.requests();
    assert_eq!(requests.len(), 1);
    let r = &requests[0];
    assert_eq!(r.impersonated.as_deref(), Some("spiffe://cluster.local/ns/default/sa/bookinfo"));
    assert_eq!(r.validity_duration, 86400);
    assert_eq!(r.outcome.as_deref(), Ok("spiffe://cluster.local/ns/default/sa/bookinfo"));
    let headers = r.headers.as_ref().unwrap();
    assert_eq!(headers["authorization"], format!("Bearer {TOKEN}"));
    assert_eq!(headers["clusterid"], "Kubernetes");
    assert_eq!(headers["content-type"], "application/grpc");

    // A second certificate reuses the connection and has a fresh key.
    let again = client.fetch(&bookinfo).await.unwrap();
    assert_ne!(again.serial(), cert.serial());
    assert_ne!(again.private_key().secret_der(), cert.private_key().secret_der());
}

#[tokio::test]
async fn a_closed_connection_is_replaced_without_failing_the_call() {
    let ca = ca(Clock::System);
    let server = ca.serve().await;
    let client = client(&server, TOKEN);
    let bookinfo = id("default", "bookinfo");
    client.fetch(&bookinfo).await.unwrap();
    server.close_connections();
    // Wait (bounded) until the client's connection has seen the close, so the next call finds it dead.
    let deadline = tokio::time::Instant::now() + testing::WAIT;
    while client.connection_is_open().await && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(!client.connection_is_open().await, "the close was not noticed");
    client.fetch(&bookinfo).await.expect("the call is made again on a new connection");
    assert_eq!(ca.requests().len(), 2);
}

#[tokio::test]
async fn an_unknown_token_and_an_untrusted_caller_are_refused_with_istiods_words() {
    let ca = ca(Clock::System);
    ca.add_caller(
        "other-token",
        Caller {
            namespace: "default".into(),
            service_account: "bookinfo".into(),
            pod_name: "bookinfo-1".into(),
            pod_uid: "uid-bookinfo-1".into(),
        },
    );
    let server = ca.serve().await;
    let bookinfo = id("default", "bookinfo");

    let err = client(&server, "nope").fetch(&bookinfo).await.unwrap_err();
    let status = err.status().expect("a gRPC status");
    assert_eq!((status.code, status.message.as_str()), (Code::Unauthenticated, "request authenticate failure"));

    // A workload's own token may not impersonate, even itself.
    let err = client(&server, "other-token").fetch(&bookinfo).await.unwrap_err();
    assert_eq!(err.to_string(), format!("{SIGNING_UNAUTHENTICATED}: request impersonation authentication failure"));
}

#[tokio::test]
async fn impersonation_needs_trusted_accounts_a_matching_caller_pod_and_a_pod_on_the_node() {
    let clock = Clock::System;
    let fetch = |ca: &FakeCa, identity: &Identity| {
        let signer = ca.signer(TOKEN, settings(clock));
        let identity = identity.clone();
        async move { signer.sign(&identity).await }
    };
    let bookinfo = id("default", "bookinfo");
    let impersonation_refused = |r: Result<_, FetchError>| {
        let e = r.unwrap_err();
        let s = e.status().unwrap();
        assert_eq!((s.code, s.message.as_str()), (Code::Unauthenticated, testing::IMPERSONATION_FAILURE));
    };

    // CA_TRUSTED_NODE_ACCOUNTS unset.
    let untrusted = FakeCa::new(TD, clock);
    untrusted.add_caller(
        TOKEN,
        Caller {
            namespace: "istio-system".into(),
            service_account: "ztunnel".into(),
            pod_name: "ztunnel-1".into(),
            pod_uid: "uid-ztunnel-1".into(),
        },
    );
    untrusted.add_pod(pod("istio-system", "ztunnel-1", "ztunnel", NODE));
    untrusted.add_pod(pod("default", "bookinfo-1", "bookinfo", NODE));
    impersonation_refused(fetch(&untrusted, &bookinfo).await);

    let ca = ca(clock);
    fetch(&ca, &bookinfo).await.unwrap();
    // No pod of that identity on the caller's node (one on another node, one failed on this one).
    ca.add_pod(pod("other", "elsewhere", "remote", "node-2"));
    ca.add_pod(Pod { failed: true, ..pod("other", "failed", "remote", NODE) });
    impersonation_refused(fetch(&ca, &id("other", "remote")).await);
    // The caller's pod replaced (UID of the token no longer matches).
    ca.remove_pod("istio-system", "ztunnel-1");
    ca.add_pod(Pod { uid: "uid-new".into(), ..pod("istio-system", "ztunnel-1", "ztunnel", NODE) });
    impersonation_refused(fetch(&ca, &bookinfo).await);
}

#[tokio::test]
async fn the_fakes_refusals_are_istiods() {
    // The exact strings of security/pkg/server/ca/server.go and security/pkg/pki/ca/ca.go.
    assert_eq!(testing::AUTHENTICATE_FAILURE, "request authenticate failure");
    assert_eq!(testing::IMPERSONATION_FAILURE, "request impersonation authentication failure");
    assert_eq!(testing::CSR_SIGNING_ERROR, "CSR signing error");
    assert_eq!(testing::go_duration(Duration::from_secs(100 * 86400)), "2400h0m0s");
    assert_eq!(testing::go_duration(Duration::from_secs(90)), "1m30s");
    assert_eq!(testing::go_duration(Duration::from_secs(7)), "7s");

    let ca = ca(Clock::System);
    let bearer = format!("Bearer {TOKEN}");
    let key = mesh_ca::csr::KeyAndCsr::generate(&id("default", "bookinfo")).unwrap();
    let request = |ttl| {
        IstioCertificateRequest::impersonating(
            key.csr_pem().into(),
            ttl,
            "spiffe://cluster.local/ns/default/sa/bookinfo",
        )
    };
    let err = ca.create_certificate(Some(&bearer), &request(100 * 86400), None).await.unwrap_err();
    assert_eq!(
        err,
        (
            Code::InvalidArgument,
            "CSR signing error (requested TTL 2400h0m0s is greater than the max allowed TTL 2160h0m0s)".to_owned()
        )
    );
    let garbage = IstioCertificateRequest { csr: "not a CSR".into(), ..request(3600) };
    let (code, message) = ca.create_certificate(Some(&bearer), &garbage, None).await.unwrap_err();
    assert_eq!(code, Code::InvalidArgument);
    assert!(message.starts_with("CSR signing error ("), "{message}");
    let unparsable = IstioCertificateRequest::impersonating(key.csr_pem().into(), 3600, "spiffe://bad");
    let (code, message) = ca.create_certificate(Some(&bearer), &unparsable, None).await.unwrap_err();
    assert_eq!((code, message.as_str()), (Code::Unauthenticated, testing::IMPERSONATION_FAILURE));
    let (code, message) = ca.create_certificate(None, &request(3600), None).await.unwrap_err();
    assert_eq!((code, message.as_str()), (Code::Unauthenticated, testing::AUTHENTICATE_FAILURE));

    // TTL 0 or less: istiod's default of 24 h.
    for ttl in [0, -5] {
        let settings = RequestSettings { ttl: Duration::ZERO, ..settings(Clock::System) };
        let bytes = ca.create_certificate(Some(&bearer), &request(ttl), None).await.unwrap();
        let response = mesh_ca::chain::decode_response(&bytes, &Limits::default()).unwrap();
        let chain = mesh_ca::chain::verify_chain(
            &response.cert_chain,
            &id("default", "bookinfo"),
            key.public_key_raw(),
            settings.clock.now(),
            &settings.limits,
        )
        .unwrap();
        assert_eq!(chain.not_after.duration_since(chain.not_before).unwrap(), Duration::from_secs(86400 + 120));
        // istiod's order: leaf, intermediate, root bundle last; each certificate element ends in a newline.
        assert_eq!(response.cert_chain.len(), 3);
        assert!(response.cert_chain.iter().all(|pem| pem.ends_with("-----END CERTIFICATE-----\n")));
        assert_eq!(response.cert_chain[2], ca.root_pem());
    }
}

#[tokio::test(start_paused = true)]
async fn an_identity_without_a_pod_on_the_node_shows_the_signing_error() {
    let clock = Clock::tokio();
    let ca = ca(clock);
    let manager = manager(ca.signer(TOKEN, settings(clock)), clock);
    let remote = id("other", "remote");
    manager.register(&remote);
    let state = wait_state(&manager, &remote, "Unavailable").await;
    assert_eq!(state, format!("Unavailable: {SIGNING_UNAUTHENTICATED}: request impersonation authentication failure"));
    let err = manager.certificate(&remote).await.unwrap_err();
    assert!(err.to_string().contains("request impersonation authentication failure"), "{err}");
    // Once a pod of that identity lands on the node, the retry succeeds.
    ca.add_pod(pod("other", "remote-1", "remote", NODE));
    assert_eq!(wait_state(&manager, &remote, "Available").await, "Available");
    assert!(manager.certificate(&remote).await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_leaf_for_another_identity_is_refused() {
    let clock = Clock::tokio();
    let ca = ca(clock);
    ca.set_tamper(Some(Tamper::San("spiffe://cluster.local/ns/default/sa/admin".into())));
    let manager = manager(ca.signer(TOKEN, settings(clock)), clock);
    let bookinfo = id("default", "bookinfo");
    let err = manager.certificate(&bookinfo).await.unwrap_err();
    assert!(
        err.to_string().contains(
            "invalid CA response: the leaf certificate names [\"spiffe://cluster.local/ns/default/sa/admin\"], not \
             the requested spiffe://cluster.local/ns/default/sa/bookinfo"
        ),
        "{err}"
    );
    assert!(state_of(&manager, &bookinfo).starts_with("Unavailable: invalid CA response: the leaf certificate names"));
}

#[tokio::test(start_paused = true)]
async fn certificates_are_refreshed_at_half_life() {
    let clock = Clock::tokio();
    let ca = ca(clock);
    let ttl = Duration::from_secs(3600);
    let (manager, bookinfo) = registered_bookinfo(&ca, clock, ttl);
    let first = manager.certificate(&bookinfo).await.unwrap();
    let issued = ca.requests()[0].at;
    let wall_at_issue = clock.now() - issued.elapsed();
    // Half-life: not_before + (not_after - not_before) / 2, with istiod's 2-minute back-dating ttl/2 - 1 min.
    let half_life = first.refresh_at().duration_since(wall_at_issue).unwrap();
    assert!(half_life <= ttl / 2 - Duration::from_secs(60) && half_life > ttl / 2 - Duration::from_secs(61));
    let snapshot = manager.snapshot();
    assert_eq!(snapshot.len(), 1);
    assert_eq!(snapshot[0].state, "Available");
    assert_eq!(snapshot[0].serial.as_deref(), Some(first.serial()));

    tokio::time::sleep(half_life - Duration::from_millis(10)).await;
    assert_eq!(ca.requests().len(), 1, "no refresh before half-life");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let requests = ca.requests();
    assert_eq!(requests.len(), 2, "refreshed at half-life");
    let at = requests[1].at - issued;
    assert!(at.abs_diff(half_life) <= Duration::from_millis(2), "refresh after {at:?}, half-life {half_life:?}");
    let second = manager.certificate(&bookinfo).await.unwrap();
    assert_ne!(second.serial(), first.serial());
    assert!(second.not_before() > first.not_before());
}

#[tokio::test(start_paused = true)]
async fn a_failing_refresh_backs_off_and_keeps_the_valid_certificate_until_it_expires() {
    let clock = Clock::tokio();
    let ca = ca(clock);
    let ttl = Duration::from_secs(600);
    let (manager, bookinfo) = registered_bookinfo(&ca, clock, ttl);
    let held = manager.certificate(&bookinfo).await.unwrap();
    let start = ca.requests()[0].at;
    let wall_at_start = clock.now() - start.elapsed();
    let half_life = held.refresh_at().duration_since(wall_at_start).unwrap();
    let expiry = held.not_after().duration_since(wall_at_start).unwrap();

    // istiod starts refusing (the workload's pod is gone from its view).
    ca.remove_pod("default", "bookinfo-1");
    tokio::time::sleep(ttl / 2 + Duration::from_secs(10)).await;
    let snapshot = manager.snapshot().remove(0);
    assert_eq!(snapshot.state, "Available", "the valid certificate is kept");
    assert_eq!(snapshot.serial.as_deref(), Some(held.serial()));
    assert_eq!(
        snapshot.last_error.as_deref(),
        Some(format!("{SIGNING_UNAUTHENTICATED}: request impersonation authentication failure").as_str())
    );
    assert_eq!(manager.certificate(&bookinfo).await.unwrap().serial(), held.serial());

    // Past expiry: dropped, the state names istiod's refusal.
    tokio::time::sleep(ttl / 2).await;
    assert_eq!(
        state_of(&manager, &bookinfo),
        format!("Unavailable: {SIGNING_UNAUTHENTICATED}: request impersonation authentication failure")
    );
    assert!(manager.certificate(&bookinfo).await.is_err());

    // The retries followed ztunnel's backoff: 500 ms, 1 s, 2 s, 4 s, … ±20 %, capped at 150 s, and one at expiry.
    let times: Vec<Duration> = ca.requests().iter().map(|r| r.at - start).collect();
    // Tokio's timers have a 1 ms resolution.
    let close = |a: Duration, b: Duration| a.abs_diff(b) <= Duration::from_millis(2);
    assert!(close(times[1], half_life), "first refresh at half-life: {times:?} vs {half_life:?}");
    let policy = mesh_ca::manager::BackoffPolicy::default();
    for (n, pair) in times[1..].windows(2).enumerate() {
        let gap = pair[1] - pair[0];
        let base = policy.base_delay(n as u32 + 1);
        let at_expiry = close(pair[1], expiry);
        assert!(
            at_expiry || (gap >= base.mul_f64(0.8) && gap <= base.mul_f64(1.2)),
            "retry {} after {gap:?}, base {base:?}: {times:?}",
            n + 1
        );
    }
    assert!(times.iter().any(|t| close(*t, expiry)), "a retry at expiry: {times:?}");
    assert!(times.iter().all(|t| *t <= ttl + Duration::from_secs(10)));

    // istiod accepts again: the next retry (at most 150 s × 1.2 later) restores the certificate.
    ca.add_pod(pod("default", "bookinfo-2", "bookinfo", NODE));
    assert_eq!(wait_state_within(&manager, &bookinfo, "Available", Duration::from_secs(181)).await, "Available");
    assert_ne!(manager.certificate(&bookinfo).await.unwrap().serial(), held.serial());
}

#[tokio::test(start_paused = true)]
async fn an_expired_root_is_refused_and_the_state_says_why() {
    let clock = Clock::tokio();
    let now = clock.now();
    let ca = with_node(FakeCa::with_root_validity(
        TD,
        clock,
        now - Duration::from_secs(86400 * 30),
        now - Duration::from_secs(60),
    ));
    let manager = manager(ca.signer(TOKEN, settings(clock)), clock);
    let bookinfo = id("default", "bookinfo");
    manager.register(&bookinfo);
    let state = wait_state(&manager, &bookinfo, "Unavailable").await;
    assert!(
        state.starts_with("Unavailable: invalid CA response: no usable root in the CA's bundle: root 0 (O=cluster.local, CN=fake istiod root) expired at"),
        "{state}"
    );
}

#[tokio::test(start_paused = true)]
async fn malformed_and_oversized_responses_are_bounded_and_refused() {
    let clock = Clock::tokio();
    let ca = ca(clock);
    let signer = ca.signer(TOKEN, settings(clock));
    let bookinfo = id("default", "bookinfo");
    let limits = Limits::default();
    let response_error = |r: Result<_, FetchError>| match r {
        Err(FetchError::Response(e)) => e,
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("accepted"),
    };
    let pem = ca.root_pem();

    ca.set_tamper(Some(Tamper::Raw(vec![0x0a, 0xff, 0xff, 0xff, 0x0f])));
    assert!(matches!(response_error(signer.sign(&bookinfo).await), ChainError::Decode(_)));
    // Many tiny elements are counted on the wire, before prost builds them.
    ca.set_tamper(Some(Tamper::Raw([0x0a, 0x00].repeat(100_000))));
    assert_eq!(response_error(signer.sign(&bookinfo).await), ChainError::TooManyElements { count: 100_000, max: 16 });
    ca.set_tamper(Some(Tamper::Chain(vec![pem.clone(); 17])));
    assert_eq!(response_error(signer.sign(&bookinfo).await), ChainError::TooManyElements { count: 17, max: 16 });
    ca.set_tamper(Some(Tamper::Chain(vec![pem.clone()])));
    assert_eq!(response_error(signer.sign(&bookinfo).await), ChainError::TooShort(1));
    ca.set_tamper(Some(Tamper::Chain(vec!["x".repeat(limits.max_element_bytes + 1), pem.clone()])));
    assert!(matches!(response_error(signer.sign(&bookinfo).await), ChainError::ElementTooLarge { index: 0, .. }));
    ca.set_tamper(Some(Tamper::Chain(vec![pem.clone(), "y".repeat(limits.max_bundle_bytes + 1)])));
    assert!(matches!(response_error(signer.sign(&bookinfo).await), ChainError::ElementTooLarge { index: 1, .. }));
    ca.set_tamper(Some(Tamper::Chain(vec!["not pem".into(), pem.clone()])));
    assert!(matches!(response_error(signer.sign(&bookinfo).await), ChainError::Pem { index: 0, .. }));
    ca.set_tamper(Some(Tamper::Chain(vec![format!("{pem}{pem}"), pem.clone()])));
    assert!(matches!(response_error(signer.sign(&bookinfo).await), ChainError::Pem { index: 0, .. }));
    ca.set_tamper(Some(Tamper::Chain(vec![pem.clone(), pem.repeat(65)])));
    assert!(matches!(response_error(signer.sign(&bookinfo).await), ChainError::Pem { index: 1, .. }));
    // A well-formed chain whose leaf is not for the request's key (the root as "leaf").
    ca.set_tamper(Some(Tamper::Chain(vec![pem.clone(), pem.clone()])));
    assert_eq!(response_error(signer.sign(&bookinfo).await), ChainError::KeyMismatch);
    ca.set_tamper(None);
    signer.sign(&bookinfo).await.unwrap();
}

#[tokio::test]
async fn an_oversized_response_message_is_refused_by_its_prefix() {
    let ca = ca(Clock::System);
    ca.set_tamper(Some(Tamper::Raw(vec![0x0a; mesh_ca::client::MAX_RESPONSE_BYTES + 1])));
    let server = ca.serve().await;
    let err = client(&server, TOKEN).fetch(&id("default", "bookinfo")).await.unwrap_err();
    assert!(matches!(err, FetchError::Connection(ChannelError::Frame(_))), "{err}");
}

#[tokio::test(start_paused = true)]
async fn at_most_eight_requests_are_in_flight() {
    let clock = Clock::tokio();
    let ca = ca(clock);
    let ids: Vec<Identity> = (0..20).map(|i| id("default", &format!("sa{i}"))).collect();
    for (i, _) in ids.iter().enumerate() {
        ca.add_pod(pod("default", &format!("p{i}"), &format!("sa{i}"), NODE));
    }
    ca.hold(true);
    let manager = manager(ca.signer(TOKEN, settings(clock)), clock);
    for identity in &ids {
        manager.register(identity);
    }
    ca.wait_in_flight(8).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(ca.in_flight(), 8);
    assert!(manager.snapshot().iter().all(|s| s.state == "Initializing"));
    ca.hold(false);
    for identity in &ids {
        manager.certificate(identity).await.unwrap();
    }
    assert_eq!(ca.max_in_flight(), 8);
    assert_eq!(ca.requests().len(), 20);
}

#[tokio::test(start_paused = true)]
async fn registrations_are_counted_and_the_last_forget_stops_refreshes() {
    let clock = Clock::tokio();
    let ca = ca(clock);
    let ttl = Duration::from_secs(600);
    let (manager, bookinfo) = registered_bookinfo(&ca, clock, ttl);
    manager.register(&bookinfo);
    manager.certificate(&bookinfo).await.unwrap();
    assert_eq!(ca.requests().len(), 1, "one certificate per identity");
    manager.forget(&bookinfo);
    assert_eq!(manager.identities(), std::slice::from_ref(&bookinfo));
    manager.forget(&bookinfo);
    assert!(manager.identities().is_empty() && manager.snapshot().is_empty());
    tokio::time::sleep(ttl * 2).await;
    assert_eq!(ca.requests().len(), 1, "no refresh after forget");

    // On demand: an unregistered identity is fetched when asked for, and held until forgotten.
    manager.certificate(&bookinfo).await.unwrap();
    assert_eq!(manager.identities(), std::slice::from_ref(&bookinfo));
    let json = serde_json::to_value(manager.snapshot()).unwrap();
    let entry = &json[0];
    assert_eq!(entry["identity"], "spiffe://cluster.local/ns/default/sa/bookinfo");
    assert_eq!(entry["state"], "Available");
    assert!(entry["notBefore"].is_string() && entry["notAfter"].is_string() && entry["serial"].is_string());
    assert_eq!(entry["issuer"], "O=cluster.local, CN=fake istiod intermediate");
    manager.forget(&bookinfo);
    assert!(manager.identities().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_certificate_someone_waits_for_goes_before_warm_ups() {
    let clock = Clock::tokio();
    let ca = ca(clock);
    for i in 0..20 {
        ca.add_pod(pod("default", &format!("p{i}"), &format!("sa{i}"), NODE));
    }
    ca.hold(true);
    let manager = manager(ca.signer(TOKEN, settings(clock)), clock);
    for i in 0..20 {
        manager.register(&id("default", &format!("sa{i}")));
    }
    ca.wait_in_flight(8).await;
    // sa19 is registered and queued behind 11 warm-ups; a connection now needs it.
    let waiting = tokio::spawn({
        let manager = manager.clone();
        async move { manager.certificate(&id("default", "sa19")).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    ca.hold(false);
    waiting.await.unwrap().unwrap();
    let order: Vec<String> = ca.requests().iter().filter_map(|r| r.impersonated.clone()).collect();
    let position = order.iter().position(|i| i.ends_with("/sa/sa19")).unwrap();
    assert!(position <= 8, "served right after the 8 in flight, not last: {position} in {order:?}");
}

#[tokio::test(start_paused = true)]
async fn a_certificate_issued_past_its_half_life_is_not_refreshed_in_a_loop() {
    let clock = Clock::tokio();
    // istiod's clock is 40 minutes behind: a 1 h certificate arrives with 20 minutes left, past its half-life.
    let lagging = match clock {
        Clock::Tokio { wall, start } => Clock::Tokio { wall: wall - Duration::from_secs(40 * 60), start },
        Clock::System => unreachable!(),
    };
    let ca = ca(lagging);
    let ttl = Duration::from_secs(3600);
    let (manager, bookinfo) = registered_bookinfo(&ca, clock, ttl);
    manager.certificate(&bookinfo).await.unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    // Backoff: 0.5 + 1 + 2 + 4 s (±20 %) fit in 10 s, not thousands of requests.
    let n = ca.requests().len();
    assert!((3..=6).contains(&n), "{n} requests in 10 s");
    assert_eq!(state_of(&manager, &bookinfo), "Available");
}

#[tokio::test(start_paused = true)]
async fn dropping_the_manager_stops_its_workers() {
    let clock = Clock::tokio();
    let ca = ca(clock);
    let ttl = Duration::from_secs(600);
    let (manager, bookinfo) = registered_bookinfo(&ca, clock, ttl);
    let first = manager.certificate(&bookinfo).await.unwrap();
    let clone = manager.clone();
    drop(manager);
    tokio::time::sleep(clock.until(first.refresh_at()) + Duration::from_secs(1)).await;
    assert_eq!(ca.requests().len(), 2, "a clone keeps the workers running (one refresh)");
    drop(clone);
    tokio::time::sleep(ttl * 4).await;
    assert_eq!(ca.requests().len(), 2, "no refresh once the last clone is gone");
}
