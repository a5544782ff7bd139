//! The ADS client against the scripted fake istiod: every wait is bounded by `testing::WAIT`, no fixed sleeps.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use xds::ads::{AdsClient, AdsConfig, Handler, NodeIdentity, Readiness, StreamEnd, Upsert};
use xds::channel::{Channel, ChannelConfig, ChannelError, Roots, Token};
use xds::grpc::Code;
use xds::testing::{resource, FakeIstiod, FakeStream, SERVER_NAME, WAIT};
use xds::wire::resource::{ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL};
use xds::wire::security::Authorization;
use xds::wire::workload::{address, Address, Workload};
use xds::wire::{Any, DecodedResource, DeltaDiscoveryResponse, Resource, ResourceType};

#[derive(Default)]
struct State {
    resources: BTreeMap<(ResourceType, String), DecodedResource>,
    applies: usize,
    refuse: BTreeSet<String>,
}

/// A handler that keeps what it is given. It applies before the client answers, so once the fake has the
/// ACK/NACK of a response, the recorder holds its result: no waiting needed.
#[derive(Clone)]
struct Recorder {
    state: Arc<Mutex<State>>,
}

impl Recorder {
    fn new() -> Self {
        Recorder { state: Arc::default() }
    }

    fn names(&self, ty: ResourceType) -> Vec<String> {
        let s = self.state.lock().unwrap();
        s.resources.keys().filter(|(t, _)| *t == ty).map(|(_, n)| n.clone()).collect()
    }
}

impl Handler for Recorder {
    fn apply(&mut self, ty: ResourceType, upserts: Vec<Upsert>, removals: Vec<String>) -> Vec<(String, String)> {
        let mut s = self.state.lock().unwrap();
        for name in removals {
            s.resources.remove(&(ty, name));
        }
        let mut refused = Vec::new();
        for u in upserts {
            if s.refuse.contains(&u.name) {
                refused.push((u.name, "refused by the consumer".to_owned()));
            } else {
                s.resources.insert((ty, u.name), u.resource);
            }
        }
        s.applies += 1;
        refused
    }
}

fn identity() -> NodeIdentity {
    NodeIdentity {
        instance_ip: Some("10.244.0.7".parse().unwrap()),
        instance_ips: vec!["10.244.0.7".parse().unwrap()],
        pod_name: "ztunnel-x1".into(),
        pod_namespace: "istio-system".into(),
        node_name: "node-a".into(),
        extra_metadata: BTreeMap::new(),
    }
    .with_istio_meta_env([("ISTIO_META_CLUSTER_ID".to_owned(), "Kubernetes".to_owned())])
}

fn channel_config(fake: &FakeIstiod, token: Token) -> ChannelConfig {
    let mut c = ChannelConfig::new(fake.address(), Roots::Pem(fake.ca_pem().as_bytes().to_vec()));
    c.alt_hostname = Some(SERVER_NAME.into());
    c.token = token;
    c.cluster_id = "cluster-1".into();
    c.headers = vec![("x-extra".into(), "extra-value".into())];
    c
}

fn client(fake: &FakeIstiod, token: Token, recorder: &Recorder) -> (AdsClient<Recorder>, Readiness) {
    let channel = Channel::new(channel_config(fake, token)).unwrap();
    let mut config = AdsConfig::new(identity().node());
    config.max_resource_bytes = 1024;
    config.backoff_initial = Duration::from_millis(10);
    AdsClient::new(channel, config, recorder.clone())
}

fn workload(uid: &str) -> Address {
    Address {
        r#type: Some(address::Type::Workload(Workload {
            uid: uid.into(),
            name: uid.into(),
            namespace: "default".into(),
            addresses: vec![vec![10, 244, 0, 9]],
            ..Default::default()
        })),
    }
}

fn wl(uid: &str, version: &str) -> Resource {
    resource(uid, version, ADDRESS_TYPE_URL, &workload(uid))
}

fn policy(ns: &str, name: &str) -> Resource {
    let p = Authorization { name: name.into(), namespace: ns.into(), ..Default::default() };
    resource(&format!("{ns}/{name}"), "", AUTHORIZATION_TYPE_URL, &p)
}

fn response(type_url: &str, nonce: &str, resources: Vec<Resource>, removed: Vec<&str>) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse {
        type_url: type_url.into(),
        nonce: nonce.into(),
        resources,
        removed_resources: removed.into_iter().map(str::to_owned).collect(),
        ..Default::default()
    }
}

/// Reads the two initial requests of a stream.
async fn initial(stream: &mut FakeStream) -> [xds::wire::DeltaDiscoveryRequest; 2] {
    [stream.request().await, stream.request().await]
}

fn spawn_run(client: AdsClient<Recorder>) -> tokio::sync::oneshot::Sender<()> {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(client.run(async move {
        let _ = stopped.await;
    }));
    stop
}

#[tokio::test]
async fn sends_node_headers_and_both_wildcard_subscriptions() {
    let mut fake = FakeIstiod::start(Some("tok-1")).await;
    let recorder = Recorder::new();
    let (client, _) = client(&fake, Token::Literal("tok-1".into()), &recorder);
    let _stop = spawn_run(client);
    let mut stream = fake.next_stream().await;
    let h = &stream.headers;
    assert_eq!(h["authorization"], "Bearer tok-1");
    assert_eq!(h["clusterid"], "cluster-1");
    assert_eq!(h["x-extra"], "extra-value");
    assert_eq!(h["content-type"], "application/grpc");
    assert_eq!(h["te"], "trailers");
    let [address, authorization] = initial(&mut stream).await;
    assert_eq!(address.type_url, ADDRESS_TYPE_URL);
    assert_eq!(authorization.type_url, AUTHORIZATION_TYPE_URL);
    for r in [&address, &authorization] {
        let node = r.node.as_ref().expect("node on every initial request");
        assert_eq!(node.id, "ztunnel~10.244.0.7~ztunnel-x1.istio-system~istio-system.svc.cluster.local");
        let md = &node.metadata.as_ref().unwrap().fields;
        assert_eq!(md["NAME"].as_str(), Some("ztunnel-x1"));
        assert_eq!(md["NAMESPACE"].as_str(), Some("istio-system"));
        assert_eq!(md["INSTANCE_IPS"].as_str(), Some("10.244.0.7"));
        assert_eq!(md["NODE_NAME"].as_str(), Some("node-a"));
        assert_eq!(md["CLUSTER_ID"].as_str(), Some("Kubernetes"));
        assert!(!md.contains_key("SERVICE_ACCOUNT"));
        // Wildcard: nothing subscribed by name, nothing held yet, not an ACK.
        assert!(r.resource_names_subscribe.is_empty() && r.resource_names_unsubscribe.is_empty());
        assert!(r.initial_resource_versions.is_empty());
        assert!(r.response_nonce.is_empty() && r.error_detail.is_none());
    }
}

#[tokio::test]
async fn acks_echo_the_nonce_and_readiness_waits_for_both_types() {
    let mut fake = FakeIstiod::start(None).await;
    let recorder = Recorder::new();
    let (client, mut readiness) = client(&fake, Token::None, &recorder);
    let _stop = spawn_run(client);
    let mut stream = fake.next_stream().await;
    initial(&mut stream).await;
    stream.send(response(ADDRESS_TYPE_URL, "nonce-1", vec![wl("u1", "v1")], vec![]));
    let ack = stream.request().await;
    assert_eq!(ack.type_url, ADDRESS_TYPE_URL);
    assert_eq!(ack.response_nonce, "nonce-1");
    assert!(ack.error_detail.is_none() && ack.node.is_none());
    assert_eq!(recorder.names(ResourceType::Address), ["u1"]);
    assert!(!readiness.is_ready(), "ready after one type only");
    // An unknown type is ACKed and does not count.
    stream.send(response("type.googleapis.com/some.Other", "nonce-x", vec![], vec![]));
    let ack = stream.request().await;
    assert_eq!((ack.response_nonce.as_str(), ack.error_detail.is_none()), ("nonce-x", true));
    assert!(!readiness.is_ready());
    stream.send(response(AUTHORIZATION_TYPE_URL, "nonce-2", vec![policy("ns", "allow")], vec![]));
    let ack = stream.request().await;
    assert_eq!((ack.type_url.as_str(), ack.response_nonce.as_str()), (AUTHORIZATION_TYPE_URL, "nonce-2"));
    tokio::time::timeout(WAIT, readiness.wait()).await.expect("ready after both types");
    assert_eq!(recorder.names(ResourceType::Authorization), ["ns/allow"]);
}

#[tokio::test]
async fn nack_names_each_bad_resource_while_the_good_ones_apply() {
    let mut fake = FakeIstiod::start(None).await;
    let recorder = Recorder::new();
    let (client, _) = client(&fake, Token::None, &recorder);
    let _stop = spawn_run(client);
    let mut stream = fake.next_stream().await;
    initial(&mut stream).await;
    let mut bad_enum = workload("u-enum");
    if let Some(address::Type::Workload(w)) = &mut bad_enum.r#type {
        w.tunnel_protocol = 9;
    }
    let oversized = Resource {
        name: "u-big".into(),
        version: "1".into(),
        resource: Some(Any { type_url: ADDRESS_TYPE_URL.into(), value: vec![0; 4096] }),
        aliases: vec![],
    };
    let malformed = Resource {
        name: "u-garbage".into(),
        version: "1".into(),
        resource: Some(Any { type_url: ADDRESS_TYPE_URL.into(), value: vec![0x0a, 0x7f, 0x01] }),
        aliases: vec![],
    };
    let wrong_type = resource("ns/p", "1", AUTHORIZATION_TYPE_URL, &Authorization::default());
    let resources = vec![
        wl("u-good-1", "a"),
        resource("u-enum", "1", ADDRESS_TYPE_URL, &bad_enum),
        oversized,
        malformed,
        wrong_type,
        wl("u-good-2", "b"),
    ];
    stream.send(response(ADDRESS_TYPE_URL, "n1", resources, vec![]));
    let nack = stream.request().await;
    assert_eq!(nack.response_nonce, "n1");
    let detail = nack.error_detail.expect("NACK");
    assert_eq!(detail.code, 0);
    let m = &detail.message;
    assert!(m.contains("u-enum: workload.tunnel_protocol: unknown enum value 9"), "{m}");
    assert!(m.contains("u-big: resource is 4096 bytes, over the 1024 byte limit"), "{m}");
    assert!(m.contains("u-garbage: decode"), "{m}");
    assert!(m.contains("ns/p: type"), "{m}");
    assert!(!m.contains("u-good"), "{m}");
    assert_eq!(m.matches("; ").count(), 3, "{m}");
    assert_eq!(recorder.names(ResourceType::Address), ["u-good-1", "u-good-2"]);
    // The stream goes on: the next response is ACKed.
    stream.send(response(ADDRESS_TYPE_URL, "n2", vec![wl("u3", "c")], vec![]));
    let ack = stream.request().await;
    assert_eq!((ack.response_nonce.as_str(), ack.error_detail.is_none()), ("n2", true));
}

#[tokio::test]
async fn removals_by_name() {
    let mut fake = FakeIstiod::start(None).await;
    let recorder = Recorder::new();
    let (client, _) = client(&fake, Token::None, &recorder);
    let _stop = spawn_run(client);
    let mut stream = fake.next_stream().await;
    initial(&mut stream).await;
    let uid = "Kubernetes//Pod/default/pod-a";
    stream.send(response(ADDRESS_TYPE_URL, "n1", vec![wl(uid, "1"), wl("Kubernetes//Pod/default/pod-b", "1")], vec![]));
    stream.request().await;
    stream.send(response(ADDRESS_TYPE_URL, "n2", vec![], vec![uid, "never-seen"]));
    let ack = stream.request().await;
    assert_eq!((ack.response_nonce.as_str(), ack.error_detail.is_none()), ("n2", true));
    assert_eq!(recorder.names(ResourceType::Address), ["Kubernetes//Pod/default/pod-b"]);
}

#[tokio::test]
async fn reconnect_after_a_reset_echoes_held_versions_but_not_rejected_ones() {
    let mut fake = FakeIstiod::start(None).await;
    let recorder = Recorder::new();
    recorder.state.lock().unwrap().refuse.insert("u-refused".into());
    let (client, _) = client(&fake, Token::None, &recorder);
    let _stop = spawn_run(client);
    let mut stream = fake.next_stream().await;
    initial(&mut stream).await;
    let bad = resource("u-bad", "9", ADDRESS_TYPE_URL, &Address::default());
    stream.send(response(
        ADDRESS_TYPE_URL,
        "n1",
        vec![wl("u1", "v1"), wl("u2", "v2"), bad, wl("u-refused", "v3")],
        vec![],
    ));
    let nack = stream.request().await;
    let message = nack.error_detail.expect("NACK").message;
    assert!(message.contains("u-bad: ") && message.contains("u-refused: refused by the consumer"), "{message}");
    stream.send(response(ADDRESS_TYPE_URL, "n2", vec![wl("u1", "v1b")], vec!["u2"]));
    stream.request().await;
    stream.send(response(AUTHORIZATION_TYPE_URL, "n3", vec![policy("ns", "p")], vec![]));
    stream.request().await;
    // Mid-update: a response is on its way when the server resets the stream.
    stream.send(response(ADDRESS_TYPE_URL, "n4", vec![wl("u4", "v4")], vec![]));
    stream.reset();
    let mut second = fake.next_stream().await;
    let [address, authorization] = initial(&mut second).await;
    let held: Vec<(&str, &str)> =
        address.initial_resource_versions.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    // u4 may or may not have been applied before the reset; u2 was removed, u-bad and u-refused never held.
    let expected_without_u4 = vec![("u1", "v1b")];
    let expected_with_u4 = vec![("u1", "v1b"), ("u4", "v4")];
    assert!(held == expected_without_u4 || held == expected_with_u4, "{held:?}");
    assert_eq!(authorization.initial_resource_versions, BTreeMap::from([("ns/p".to_owned(), String::new())]));
    assert!(address.node.is_some() && authorization.node.is_some());
}

#[tokio::test]
async fn backoff_doubles_on_refusals_and_resets_on_connection_age() {
    let mut fake = FakeIstiod::start(None).await;
    let recorder = Recorder::new();
    let channel = Channel::new(channel_config(&fake, Token::None)).unwrap();
    let mut config = AdsConfig::new(identity().node());
    config.backoff_initial = Duration::from_millis(50);
    let (client, _) = AdsClient::new(channel, config, recorder.clone());
    for _ in 0..3 {
        fake.refuse_next(Code::Unauthenticated, "request authenticate failure");
    }
    let _stop = spawn_run(client);
    // The 4th attempt is served, then ended as istiod does at its maximum connection age.
    let mut stream = fake.next_stream().await;
    initial(&mut stream).await;
    stream.send(response(ADDRESS_TYPE_URL, "n1", vec![], vec![]));
    stream.request().await;
    fake.refuse_next(Code::PermissionDenied, "no");
    stream.end(Code::Unavailable, "transport is closing");
    let attempts = fake.wait_attempts(|a| a.len() >= 6).await;
    let gaps: Vec<Duration> = attempts.windows(2).map(|w| w[1].at - w[0].at).collect();
    // 100, 200, 400 ms after the refusals; after "transport is closing" on a working stream: 50 ms; then 100 ms.
    let ms = Duration::from_millis;
    assert!(gaps[0] >= ms(100) && gaps[1] >= ms(200) && gaps[2] >= ms(400), "{gaps:?}");
    assert!(gaps[3] >= ms(50), "{gaps:?}");
    assert!(gaps[4] >= ms(100) && gaps[4] < ms(400), "reset to the initial backoff, then doubling: {gaps:?}");
    assert_eq!(attempts[0].refused.as_ref().map(|r| r.0), Some(Code::Unauthenticated));
    assert_eq!(attempts[4].refused.as_ref().map(|r| r.0), Some(Code::PermissionDenied));
    assert!(attempts[5].refused.is_none());
}

#[tokio::test]
async fn istiod_without_ambient_is_retried_with_doubling_delays() {
    let fake = FakeIstiod::start(None).await;
    fake.set_ambient(false);
    let recorder = Recorder::new();
    let (client, _) = client(&fake, Token::None, &recorder);
    let _stop = spawn_run(client);
    let attempts = fake.wait_attempts(|a| a.len() >= 4).await;
    let refused = attempts[0].refused.clone().unwrap();
    assert_eq!(refused, (Code::Unknown, "ztunnel requires PILOT_ENABLE_AMBIENT=true".to_owned()));
    let gaps: Vec<Duration> = attempts.windows(2).map(|w| w[1].at - w[0].at).collect();
    let ms = Duration::from_millis;
    assert!(gaps[0] >= ms(20) && gaps[1] >= ms(40) && gaps[2] >= ms(80), "not a 10 ms loop: {gaps:?}");
}

#[tokio::test]
async fn token_is_re_read_for_every_stream() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("istio-token");
    std::fs::write(&path, "first\n").unwrap();
    let mut fake = FakeIstiod::start(Some("first")).await;
    let recorder = Recorder::new();
    let (client, _) = client(&fake, Token::File(path.clone()), &recorder);
    let _stop = spawn_run(client);
    let mut stream = fake.next_stream().await;
    assert_eq!(stream.headers["authorization"], "Bearer first");
    initial(&mut stream).await;
    std::fs::write(&path, "second").unwrap();
    fake.set_token(Some("second"));
    stream.end(Code::Unavailable, "transport is closing");
    let mut stream = fake.next_stream().await;
    assert_eq!(stream.headers["authorization"], "Bearer second");
    initial(&mut stream).await;
}

#[tokio::test]
async fn istiod_checks_refuse_a_bad_token_and_a_bad_node_id() {
    let fake = FakeIstiod::start(Some("right")).await;
    let recorder = Recorder::new();
    let (mut c, _) = client(&fake, Token::Literal("wrong".into()), &recorder);
    match c.run_stream().await {
        StreamEnd::Status(s) => assert_eq!(s.code, Code::Unauthenticated),
        other => panic!("{other:?}"),
    }
    let channel = Channel::new(channel_config(&fake, Token::Literal("right".into()))).unwrap();
    let mut node = identity().node();
    node.id = "sidecar~10.0.0.1~a.b~b.svc.cluster.local".into();
    let (mut c, _) = AdsClient::new(channel, AdsConfig::new(node), recorder.clone());
    match c.run_stream().await {
        StreamEnd::Status(s) => {
            assert_eq!(s.code, Code::InvalidArgument);
            assert!(s.message.contains("invalid node type"), "{}", s.message);
        }
        other => panic!("{other:?}"),
    }
    assert!(xds::testing::check_node_id("ztunnel~not-an-ip~a.b~b.svc.cluster.local").is_err());
    assert!(xds::testing::check_node_id("ztunnel~10.0.0.1~a.b").is_err());
    assert!(xds::testing::check_node_id(&identity().node_id()).is_ok());
}

#[tokio::test]
async fn the_server_certificate_must_name_the_host_or_the_alt_hostname() {
    let fake = FakeIstiod::start(None).await;
    let recorder = Recorder::new();
    let mut config = channel_config(&fake, Token::None);
    config.alt_hostname = None;
    let (mut c, _) = AdsClient::new(Channel::new(config).unwrap(), AdsConfig::new(identity().node()), recorder.clone());
    match c.run_stream().await {
        StreamEnd::Connect(ChannelError::Connect { source, .. }) => {
            assert!(source.to_string().contains("not valid for name"), "{source}")
        }
        other => panic!("{other:?}"),
    }
    assert!(fake.attempts().is_empty());
    // Another CA's roots: refused too.
    let other = FakeIstiod::start(None).await;
    let mut config = channel_config(&fake, Token::None);
    config.roots = Roots::Pem(other.ca_pem().as_bytes().to_vec());
    let (mut c, _) = AdsClient::new(Channel::new(config).unwrap(), AdsConfig::new(identity().node()), recorder);
    assert!(matches!(c.run_stream().await, StreamEnd::Connect(_)));
}

#[tokio::test]
async fn an_oversized_grpc_message_ends_the_stream_without_panic() {
    let mut fake = FakeIstiod::start(None).await;
    let recorder = Recorder::new();
    let mut config = channel_config(&fake, Token::None);
    config.max_message_bytes = 2048;
    let (mut c, _) = AdsClient::new(Channel::new(config).unwrap(), AdsConfig::new(identity().node()), recorder.clone());
    let run = tokio::spawn(async move { c.run_stream().await });
    let mut stream = fake.next_stream().await;
    initial(&mut stream).await;
    let big: Vec<Resource> = (0..100).map(|i| wl(&format!("uid-{i:04}"), "v")).collect();
    stream.send(response(ADDRESS_TYPE_URL, "n1", big, vec![]));
    match tokio::time::timeout(WAIT, run).await.unwrap().unwrap() {
        StreamEnd::Status(s) => {
            assert_eq!(s.code, Code::Internal);
            assert!(s.message.contains("over the 2048 byte limit"), "{}", s.message);
        }
        other => panic!("{other:?}"),
    }
    assert!(recorder.names(ResourceType::Address).is_empty());
    assert_eq!(recorder.state.lock().unwrap().applies, 0);
}

#[tokio::test]
async fn roots_are_re_read_at_every_connect() {
    let dir = tempfile::tempdir().unwrap();
    let roots = dir.path().join("root-cert.pem");
    let mut fake = FakeIstiod::start(None).await;
    let other = FakeIstiod::start(None).await;
    std::fs::write(&roots, other.ca_pem()).unwrap();
    let mut config = channel_config(&fake, Token::None);
    config.roots = Roots::File(roots.clone());
    let recorder = Recorder::new();
    let (mut c, _) = AdsClient::new(Channel::new(config).unwrap(), AdsConfig::new(identity().node()), recorder);
    assert!(matches!(c.run_stream().await, StreamEnd::Connect(ChannelError::Connect { .. })));
    // istiod's root rotated into the mounted file: the next connect trusts it.
    std::fs::write(&roots, fake.ca_pem()).unwrap();
    let run = tokio::spawn(async move { c.run_stream().await });
    let mut stream = fake.next_stream().await;
    initial(&mut stream).await;
    stream.end(Code::Ok, "");
    assert!(matches!(tokio::time::timeout(WAIT, run).await.unwrap().unwrap(), StreamEnd::Ended { responses: 0 }));
    std::fs::write(&roots, "not a certificate").unwrap();
    let config = channel_config(&fake, Token::None);
    let mut broken = config.clone();
    broken.roots = Roots::File(roots);
    let (mut c, _) = AdsClient::new(Channel::new(broken).unwrap(), AdsConfig::new(identity().node()), Recorder::new());
    assert!(matches!(c.run_stream().await, StreamEnd::Connect(ChannelError::Config(_))));
}

#[tokio::test]
async fn a_stream_ended_ok_is_followed_by_a_new_one_echoing_what_is_held() {
    let mut fake = FakeIstiod::start(None).await;
    let recorder = Recorder::new();
    let (client, mut readiness) = client(&fake, Token::None, &recorder);
    let _stop = spawn_run(client);
    let mut stream = fake.next_stream().await;
    initial(&mut stream).await;
    // A duplicate name in one response: the first is applied, the second rejected.
    stream.send(response(ADDRESS_TYPE_URL, "n1", vec![wl("u1", "1"), wl("u1", "2")], vec![]));
    let nack = stream.request().await;
    assert_eq!(nack.error_detail.unwrap().message, "u1: duplicate name in response");
    stream.send(response(AUTHORIZATION_TYPE_URL, "n2", vec![], vec![]));
    stream.request().await;
    tokio::time::timeout(WAIT, readiness.wait()).await.expect("ready");
    stream.end(Code::Ok, "");
    let mut second = fake.next_stream().await;
    let [address, authorization] = initial(&mut second).await;
    assert_eq!(address.initial_resource_versions, BTreeMap::from([("u1".to_owned(), "1".to_owned())]));
    assert!(authorization.initial_resource_versions.is_empty());
    // Readiness stays once reached.
    assert!(readiness.is_ready());
}

#[tokio::test]
async fn a_unary_call_reports_a_trailers_only_refusal() {
    let fake = FakeIstiod::start(None).await;
    let channel = Channel::new(channel_config(&fake, Token::None)).unwrap();
    let connection = channel.connect().await.unwrap();
    let request = xds::wire::Status { code: 1, ..Default::default() };
    let result = connection
        .unary::<_, xds::wire::Status>("/istio.v1.auth.IstioCertificateService/CreateCertificate", &request)
        .await;
    match result {
        Err(ChannelError::Status(s)) => {
            assert_eq!(s.code, Code::Unimplemented);
            assert!(s.message.contains("CreateCertificate"), "{}", s.message);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(fake.attempts().len(), 1);
}

/// Runs one stream whose first response is `send`; returns how it ended and what the handler saw.
async fn one_response(config: impl FnOnce(&mut AdsConfig), send: impl FnOnce(&FakeStream)) -> (StreamEnd, usize) {
    let mut fake = FakeIstiod::start(None).await;
    let recorder = Recorder::new();
    let mut ads = AdsConfig::new(identity().node());
    config(&mut ads);
    let (mut c, _) = AdsClient::new(Channel::new(channel_config(&fake, Token::None)).unwrap(), ads, recorder.clone());
    let run = tokio::spawn(async move { c.run_stream().await });
    let mut stream = fake.next_stream().await;
    initial(&mut stream).await;
    send(&stream);
    let end = tokio::time::timeout(WAIT, run).await.unwrap().unwrap();
    let applies = recorder.state.lock().unwrap().applies;
    (end, applies)
}

#[tokio::test]
async fn a_response_over_the_resource_count_limit_is_refused_before_decoding() {
    let resources: Vec<Resource> = (0..4).map(|i| wl(&format!("u{i}"), "v")).collect();
    let (end, applies) = one_response(
        |c| c.max_resources_per_response = 3,
        |s| s.send(response(ADDRESS_TYPE_URL, "n", resources, vec![])),
    )
    .await;
    match end {
        StreamEnd::Status(s) => {
            assert_eq!(s.code, Code::Internal);
            assert!(s.message.contains("4 resources and 0 removals, over the 3 limit"), "{}", s.message);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(applies, 0);
}

#[tokio::test]
async fn a_malformed_response_ends_the_stream_without_panic() {
    for bytes in [vec![0x12, 0x05, 0x00], vec![0x0b], vec![0x22, 0x02, 0xff, 0xfe]] {
        let (end, applies) = one_response(|_| {}, |s| s.send_raw(bytes.clone())).await;
        match end {
            StreamEnd::Status(s) => assert_eq!(s.code, Code::Internal, "{bytes:?}: {}", s.message),
            other => panic!("{bytes:?}: {other:?}"),
        }
        assert_eq!(applies, 0);
    }
}

#[tokio::test]
async fn a_server_that_stops_answering_pings_is_dropped() {
    let mut fake = FakeIstiod::start(None).await;
    let mut config = channel_config(&fake, Token::None);
    config.ping_interval = Duration::from_millis(100);
    config.ping_timeout = Duration::from_millis(200);
    let (mut c, _) = AdsClient::new(Channel::new(config).unwrap(), AdsConfig::new(identity().node()), Recorder::new());
    let run = tokio::spawn(async move { c.run_stream().await });
    let mut stream = fake.next_stream().await;
    initial(&mut stream).await;
    // Pings answered: the stream stays up over several ping periods.
    stream.send(response(ADDRESS_TYPE_URL, "n1", vec![], vec![]));
    stream.request().await;
    fake.freeze();
    let started = std::time::Instant::now();
    match tokio::time::timeout(WAIT, run).await.expect("the client noticed the dead connection").unwrap() {
        StreamEnd::Status(_) => {}
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() >= Duration::from_millis(200), "{:?}", started.elapsed());
}

#[tokio::test]
async fn a_missing_token_file_is_a_connection_error() {
    let fake = FakeIstiod::start(Some("t")).await;
    let config = channel_config(&fake, Token::File("/nonexistent/istio-token".into()));
    let (mut c, _) = AdsClient::new(Channel::new(config).unwrap(), AdsConfig::new(identity().node()), Recorder::new());
    match c.run_stream().await {
        StreamEnd::Connect(ChannelError::Read { what: "token", .. }) => {}
        other => panic!("{other:?}"),
    }
    assert!(fake.attempts().is_empty());
}

#[test]
fn channel_configuration_is_checked_up_front() {
    let pem = || Roots::Pem(Vec::new());
    for bad in ["", "http://istiod:15010", "https://", "https://bad host:1"] {
        assert!(matches!(Channel::new(ChannelConfig::new(bad, pem())), Err(ChannelError::Config(_))), "{bad:?}");
    }
    let mut c = ChannelConfig::new("istiod.istio-system.svc:15012", pem());
    c.headers = vec![("bad header".into(), "v".into())];
    assert!(Channel::new(c).is_err());
    let mut c = ChannelConfig::new("istiod.istio-system.svc:15012", pem());
    c.cluster_id = "a\nb".into();
    assert!(Channel::new(c).is_err());
    assert!(Channel::new(ChannelConfig::new("istiod.istio-system.svc:15012", pem())).is_ok());
    assert!(Channel::new(ChannelConfig::new("https://[fd00::1]:15012", pem())).is_ok());
}
