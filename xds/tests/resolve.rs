//! istiod's host name resolved as resolv.conf says, against a tiny DNS server on 127.0.0.1 that answers one name
//! and records every question.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex};

use xds::channel::{Channel, ChannelConfig, ChannelError, Roots};
use xds::resolve::{resolve, NameResolution, ResolveError};
use xds::testing::{FakeIstiod, SERVER_NAME};

const ISTIOD_FQDN: &str = "istiod.istio-system.svc.cluster.local";

/// A DNS server answering `A` for the names it knows, NXDOMAIN for others (NODATA for other types of known names).
struct TinyDns {
    port: u16,
    questions: Arc<Mutex<Vec<(String, u16)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TinyDns {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The question's name (lower case, no trailing dot), type, and where the question section ends.
fn parse_question(query: &[u8]) -> Option<(String, u16, usize)> {
    let mut pos = 12;
    let mut labels = Vec::new();
    loop {
        let len = *query.get(pos)? as usize;
        pos += 1;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8_lossy(query.get(pos..pos + len)?).to_ascii_lowercase());
        pos += len;
    }
    let qtype = u16::from_be_bytes([*query.get(pos)?, *query.get(pos + 1)?]);
    Some((labels.join("."), qtype, pos + 4))
}

fn answer(query: &[u8], known: &[(&str, Ipv4Addr)]) -> Option<(String, u16, Vec<u8>)> {
    let (name, qtype, end) = parse_question(query)?;
    let question = query.get(12..end)?;
    let found = known.iter().find(|(n, _)| *n == name).map(|(_, ip)| *ip);
    let mut out = Vec::new();
    out.extend_from_slice(&query[0..2]); // id
    let rcode = if found.is_some() { 0 } else { 3 }; // NOERROR / NXDOMAIN
    out.extend_from_slice(&[0x81, 0x80 | rcode]); // QR, RD, RA
    let answers: u16 = if found.is_some() && qtype == 1 { 1 } else { 0 };
    out.extend_from_slice(&[0, 1]); // one question
    out.extend_from_slice(&answers.to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(question);
    if let (Some(ip), 1) = (found, answers) {
        out.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 30, 0, 4]); // name ptr, A, IN, TTL 30, len 4
        out.extend_from_slice(&ip.octets());
    }
    Some((name, qtype, out))
}

impl TinyDns {
    async fn start(known: Vec<(&'static str, Ipv4Addr)>) -> TinyDns {
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let port = socket.local_addr().unwrap().port();
        let questions = Arc::new(Mutex::new(Vec::new()));
        let seen = questions.clone();
        let task = tokio::spawn(async move {
            let mut buf = [0u8; 1500];
            loop {
                let Ok((n, peer)) = socket.recv_from(&mut buf).await else { continue };
                if let Some((name, qtype, reply)) = answer(&buf[..n], &known) {
                    seen.lock().unwrap().push((name, qtype));
                    let _ = socket.send_to(&reply, peer).await;
                }
            }
        });
        TinyDns { port, questions, task }
    }

    /// The names asked for with type A, in order.
    fn a_questions(&self) -> Vec<String> {
        self.questions.lock().unwrap().iter().filter(|(_, t)| *t == 1).map(|(n, _)| n.clone()).collect()
    }

    /// A resolv.conf in `dir` pointing at this server, with `extra` lines.
    fn settings(&self, dir: &Path, extra: &str) -> NameResolution {
        let path = dir.join("resolv.conf");
        std::fs::write(&path, format!("nameserver 127.0.0.1\n{extra}")).unwrap();
        NameResolution { resolv_conf: path, port: self.port }
    }
}

const KUBERNETES_RESOLV_CONF: &str =
    "search istio-system.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5 timeout:1 attempts:1\n";

#[tokio::test]
async fn a_service_name_is_expanded_with_the_search_domains() {
    let dns = TinyDns::start(vec![(ISTIOD_FQDN, Ipv4Addr::new(127, 0, 0, 7))]).await;
    let dir = tempfile::tempdir().unwrap();
    let settings = dns.settings(dir.path(), KUBERNETES_RESOLV_CONF);
    let addresses = resolve("istiod.istio-system.svc", 15012, &settings).await.unwrap();
    assert_eq!(addresses, ["127.0.0.7:15012".parse::<SocketAddr>().unwrap()]);
    // Fewer dots than ndots: the search domains first, in order, up to the one that answers.
    assert_eq!(
        dns.a_questions(),
        [
            "istiod.istio-system.svc.istio-system.svc.cluster.local",
            "istiod.istio-system.svc.svc.cluster.local",
            ISTIOD_FQDN,
        ]
    );
}

#[tokio::test]
async fn a_name_with_enough_dots_is_tried_as_is_first_and_a_rooted_name_never_expanded() {
    let dns = TinyDns::start(vec![(ISTIOD_FQDN, Ipv4Addr::new(127, 0, 0, 7))]).await;
    let dir = tempfile::tempdir().unwrap();
    let settings = dns.settings(dir.path(), "search cluster.local\noptions ndots:1 timeout:1 attempts:1\n");
    resolve("istiod.istio-system.svc", 15012, &settings).await.unwrap();
    assert_eq!(dns.a_questions(), ["istiod.istio-system.svc", ISTIOD_FQDN]);

    let dns = TinyDns::start(vec![(ISTIOD_FQDN, Ipv4Addr::new(127, 0, 0, 7))]).await;
    let settings = dns.settings(dir.path(), KUBERNETES_RESOLV_CONF);
    let err = resolve("istiod.istio-system.svc.", 15012, &settings).await.unwrap_err();
    assert!(matches!(&err, ResolveError::Lookup { host, .. } if host == "istiod.istio-system.svc."), "{err}");
    assert_eq!(dns.a_questions(), ["istiod.istio-system.svc"]);
}

#[tokio::test]
async fn literal_addresses_bypass_resolution() {
    let settings = NameResolution { resolv_conf: "/nonexistent/resolv.conf".into(), port: 1 };
    assert_eq!(resolve("127.0.0.1", 15012, &settings).await.unwrap(), ["127.0.0.1:15012".parse().unwrap()]);
    assert_eq!(resolve("::1", 15012, &settings).await.unwrap(), ["[::1]:15012".parse().unwrap()]);
    // A name needs the file.
    let err = resolve("istiod", 15012, &settings).await.unwrap_err();
    assert!(matches!(err, ResolveError::Read { .. }), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("resolv.conf");
    std::fs::write(&empty, "search cluster.local\n").unwrap();
    let err = resolve("istiod", 15012, &NameResolution { resolv_conf: empty, port: 1 }).await.unwrap_err();
    assert!(err.to_string().contains("no nameservers"), "{err}");
}

#[tokio::test]
async fn a_non_ascii_name_is_refused_without_a_query() {
    let dns = TinyDns::start(vec![(ISTIOD_FQDN, Ipv4Addr::LOCALHOST)]).await;
    let dir = tempfile::tempdir().unwrap();
    let settings = dns.settings(dir.path(), KUBERNETES_RESOLV_CONF);
    // The IDNA backend is the ASCII-only one (xds/Cargo.toml): istiod's names are ASCII.
    let err = resolve("istiöd.istio-system.svc", 15012, &settings).await.unwrap_err();
    assert!(matches!(&err, ResolveError::Lookup { host, .. } if host == "istiöd.istio-system.svc"), "{err}");
    assert!(dns.a_questions().is_empty());
}

#[tokio::test]
async fn the_channel_reaches_istiod_by_its_service_name() {
    let fake = FakeIstiod::start(None).await;
    let dns = TinyDns::start(vec![(ISTIOD_FQDN, Ipv4Addr::LOCALHOST)]).await;
    let dir = tempfile::tempdir().unwrap();
    let port = fake.address().rsplit(':').next().unwrap().to_owned();
    // The dialled name is the one in the serving certificate: no alternate hostname needed.
    let mut config =
        ChannelConfig::new(format!("https://{SERVER_NAME}:{port}"), Roots::Pem(fake.ca_pem().as_bytes().to_vec()));
    config.resolution = dns.settings(dir.path(), KUBERNETES_RESOLV_CONF);
    let channel = Channel::new(config.clone()).unwrap();
    let connection = channel.connect().await.unwrap();
    // A call reaches the server (which does not serve this method).
    let err = connection.unary::<_, xds::wire::Status>("/test.Nothing/Here", &xds::wire::Status::default()).await;
    assert!(matches!(err, Err(ChannelError::Status(s)) if s.code == xds::grpc::Code::Unimplemented));
    assert!(dns.a_questions().contains(&ISTIOD_FQDN.to_owned()));

    // An unknown name fails the connect, naming the address.
    config.address = format!("https://istiod.elsewhere.svc:{port}");
    let err = Channel::new(config).unwrap().connect().await.err().unwrap();
    assert!(matches!(err, ChannelError::Resolve { .. }), "{err}");
    assert!(err.is_connection_error());
    assert!(err.to_string().contains("istiod.elsewhere.svc"), "{err}");
}
