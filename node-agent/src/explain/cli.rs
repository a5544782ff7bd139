//! The `explain` subcommand: `node-agent explain NAMESPACE/POD [-o json]`, `node-agent explain --all [-o json]`
//! and `node-agent explain --check-drift`. It runs beside the agent (`kubectl exec` into the istio-cni-node pod)
//! and asks the agent's admin port on 127.0.0.1: the agent holds the state (and checks drift), the subcommand only
//! asks and prints.

use std::ffi::OsString;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use http_body_util::{BodyExt as _, Empty, Limited};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};

use super::render;
use super::report::{Report, Summary};
use crate::admin_api::{DEFAULT_PORT, DRIFT_CHECK_PATH, PODS_PATH, PORT_ENV};

/// How long the agent may take to connect.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long the agent may take to answer (a report reads the pod's netns and the host probe set, each bounded).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);
/// Largest answer read from the agent: `--all` on a node with hundreds of pods is tens of KiB, one report a few.
const MAX_ANSWER: usize = 8 << 20;

/// What the subcommand prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    /// Readable text.
    Text,
    /// The agent's JSON, as is.
    Json,
}

/// `node-agent explain`.
#[derive(Debug, Parser)]
#[command(
    name = "node-agent explain",
    about = "Explains why a pod on this node is or is not in the mesh (asks the node agent running beside it)"
)]
struct Args {
    /// The pod, as NAMESPACE/NAME.
    #[arg(required_unless_present_any = ["all", "check_drift"], conflicts_with = "all")]
    pod: Option<String>,
    /// One line per pod on this node, with its verdict.
    #[arg(long)]
    all: bool,
    /// Asks the agent for a drift check of every pod now, rather than at its next DRIFT_CHECK_INTERVAL (drift is
    /// repaired as at any check); the results show in each pod's report.
    #[arg(long, conflicts_with_all = ["pod", "all", "output"])]
    check_drift: bool,
    /// `text` or `json`.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Text)]
    output: Output,
    /// The agent's admin port, on 127.0.0.1 (the agent's `ADMIN_PORT`).
    #[arg(long, env = PORT_ENV, default_value_t = DEFAULT_PORT)]
    admin_port: u16,
}

/// Why the subcommand fails; its message is what the user reads.
#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error("the pod must be NAMESPACE/NAME, got {0:?}")]
    BadPod(String),
    #[error(
        "the node agent is not reachable on 127.0.0.1:{port} ({reason}); is it running in this pod, and is \
         ADMIN_PORT the same here?"
    )]
    Unreachable { port: u16, reason: String },
    #[error("{0}")]
    Agent(String),
    #[error("the node agent's answer is not a report: {0}")]
    Garbled(String),
}

/// Runs the subcommand with `args` (after `explain`); the exit code is 0 only when the agent answered as asked.
pub fn main(args: &[OsString]) -> ExitCode {
    let argv = std::iter::once(OsString::from("node-agent explain")).chain(args.iter().cloned());
    let args = match Args::try_parse_from(argv) {
        Ok(args) => args,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { ExitCode::from(2) } else { ExitCode::SUCCESS };
        }
    };
    match run(&args) {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("node-agent explain: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<String, CliError> {
    if args.check_drift {
        return check_drift(args.admin_port);
    }
    let path = match &args.pod {
        Some(pod) if !args.all => {
            let (ns, name) = pod
                .split_once('/')
                .filter(|(ns, name)| !ns.is_empty() && !name.is_empty() && !name.contains('/'))
                .ok_or_else(|| CliError::BadPod(pod.clone()))?;
            format!("{PODS_PATH}/{ns}/{name}")
        }
        _ => PODS_PATH.to_string(),
    };
    let body = expect(StatusCode::OK, request(args.admin_port, Method::GET, &path)?)?;
    let parsed = |e: serde_json::Error| CliError::Garbled(e.to_string());
    match (args.output, args.all) {
        (Output::Json, _) => Ok(if body.ends_with('\n') { body } else { format!("{body}\n") }),
        (Output::Text, true) => Ok(render::summaries(&serde_json::from_str::<Vec<Summary>>(&body).map_err(parsed)?)),
        (Output::Text, false) => Ok(render::report(&serde_json::from_str::<Report>(&body).map_err(parsed)?)),
    }
}

/// `--check-drift`: `POST /debug/drift-check`; the agent's word that a check was requested, or its refusal.
fn check_drift(port: u16) -> Result<String, CliError> {
    let body = expect(StatusCode::ACCEPTED, request(port, Method::POST, DRIFT_CHECK_PATH)?)?;
    let said = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["status"].as_str().map(str::to_string))
        .unwrap_or_else(|| body.trim().to_string());
    Ok(format!(
        "{said}: every pod is checked now; `node-agent explain NAMESPACE/POD` shows the result on its \
         \"Drift check\" line\n"
    ))
}

/// The body of an answer with status `want`, else the agent's message (its `{"error": ...}`, or the body).
fn expect(want: StatusCode, (status, body): (StatusCode, String)) -> Result<String, CliError> {
    if status == want {
        return Ok(body);
    }
    let message = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{status}: {}", body.trim()));
    Err(CliError::Agent(message))
}

/// One bodiless request to the agent's admin port on 127.0.0.1: the answer's status and body.
fn request(port: u16, method: Method, path: &str) -> Result<(StatusCode, String), CliError> {
    let unreachable = |reason: String| CliError::Unreachable { port, reason };
    let rt =
        tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| unreachable(e.to_string()))?;
    rt.block_on(async {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr))
            .await
            .map_err(|_| unreachable(format!("no connection within {CONNECT_TIMEOUT:?}")))?
            .map_err(|e| unreachable(e.to_string()))?;
        tokio::time::timeout(ANSWER_TIMEOUT, exchange(stream, method, path))
            .await
            .map_err(|_| unreachable(format!("no answer within {ANSWER_TIMEOUT:?}")))?
            .map_err(unreachable)
    })
}

async fn exchange(stream: tokio::net::TcpStream, method: Method, path: &str) -> Result<(StatusCode, String), String> {
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(conn);
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, "127.0.0.1")
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let response = sender.send_request(request).await.map_err(|e| format!("request: {e}"))?;
    let status = response.status();
    let body =
        Limited::new(response.into_body(), MAX_ANSWER).collect().await.map_err(|e| format!("answer: {e}"))?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    #[test]
    fn the_arguments_are_a_pod_all_or_check_drift() {
        Args::command().debug_assert();
        let args = Args::try_parse_from(["x", "shop/web", "-o", "json"]).unwrap();
        assert_eq!((args.pod.as_deref(), args.output), (Some("shop/web"), Output::Json));
        assert!(Args::try_parse_from(["x", "--all"]).unwrap().all);
        assert!(Args::try_parse_from(["x", "--check-drift"]).unwrap().check_drift);
        assert!(Args::try_parse_from(["x"]).is_err(), "a pod, --all or --check-drift");
        assert!(Args::try_parse_from(["x", "shop/web", "--all"]).is_err());
        assert!(Args::try_parse_from(["x", "shop/web", "--check-drift"]).is_err());
        assert!(Args::try_parse_from(["x", "--all", "--check-drift"]).is_err());
        assert!(Args::try_parse_from(["x", "--check-drift", "-o", "json"]).is_err());
        let bad = Args::try_parse_from(["x", "web", "--admin-port", "1"]).unwrap();
        assert!(matches!(run(&bad), Err(CliError::BadPod(_))));
    }

    #[test]
    fn an_agent_not_listening_is_named_with_its_port() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        for flag in ["--all", "--check-drift"] {
            let args = Args::try_parse_from(["x", flag, "--admin-port", &port.to_string()]).unwrap();
            let error = run(&args).unwrap_err().to_string();
            assert!(error.contains(&format!("not reachable on 127.0.0.1:{port}")), "{flag}: {error}");
        }
    }

    /// An agent that answers one request with `status` and `body`; the request head it read comes back on the join
    /// handle.
    fn agent_answering(status: &str, body: &str) -> (u16, std::thread::JoinHandle<String>) {
        use std::io::{BufRead as _, BufReader, Write as _};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let answer = format!("HTTP/1.1 {status}\r\ncontent-length: {}\r\n\r\n{body}", body.len());
        let handle = std::thread::spawn(move || {
            let (conn, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(&conn);
            let mut head = String::new();
            // Up to the empty line that ends the head (the requests have no body).
            while reader.read_line(&mut head).unwrap() > 2 {}
            (&conn).write_all(answer.as_bytes()).unwrap();
            head
        });
        (port, handle)
    }

    #[test]
    fn the_agent_s_error_message_is_what_the_user_reads() {
        let (port, agent) = agent_answering("404 Not Found", r#"{"error":"pod shop/ghost is not on this node (n1)"}"#);
        let args = Args::try_parse_from(["x", "shop/ghost", "--admin-port", &port.to_string()]).unwrap();
        assert_eq!(run(&args).unwrap_err().to_string(), "pod shop/ghost is not on this node (n1)");
        assert!(agent.join().unwrap().starts_with("GET /debug/pods/shop/ghost HTTP/1.1\r\n"));
    }

    #[test]
    fn check_drift_posts_and_reports_what_the_agent_said() {
        let (port, agent) = agent_answering("202 Accepted", r#"{"status":"drift check requested"}"#);
        let args = Args::try_parse_from(["x", "--check-drift", "--admin-port", &port.to_string()]).unwrap();
        let text = run(&args).unwrap();
        assert!(text.starts_with("drift check requested: "), "{text}");
        assert!(agent.join().unwrap().starts_with(&format!("POST {DRIFT_CHECK_PATH} HTTP/1.1\r\n")));

        let (port, _agent) = agent_answering("404 Not Found", r#"{"error":"drift is not checked on this node agent"}"#);
        let args = Args::try_parse_from(["x", "--check-drift", "--admin-port", &port.to_string()]).unwrap();
        assert_eq!(run(&args).unwrap_err().to_string(), "drift is not checked on this node agent");
    }
}
