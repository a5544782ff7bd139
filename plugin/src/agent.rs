//! The plugin's requests to the node agent on `<run dir>/pluginevent.sock`: the one-round-trip pod setup
//! (`/podsetup`, the fast path: no API request of the plugin's own) and Istio's `/cmdadd` hand-over (after the
//! plugin looked the pod up in the API itself).

use std::path::Path;
use std::time::Duration;

use cni::plugin_event::{
    CmdAdd, PodSetup, PodSetupAnswer, CMDADD_PATH, INVALID_POD_STATUS, PODSETUP_PATH, UNKNOWN_POD_STATUS,
};
use cni::{CniError, ErrorCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use istio_contract::paths::PLUGIN_EVENT_SOCKET;

/// How long the agent may take to enroll a pod (netns, rules, proxy ack, annotation): the contract's, which the
/// agent's own deadline is shorter than.
const AGENT_TIMEOUT: Duration = cni::plugin_event::PLUGIN_WAIT;
/// Largest answer read from the agent (a pod's facts are a few KiB; annotations are capped at 256 KiB by the API).
const MAX_ANSWER: usize = 1 << 20;

/// Why the fast path did not settle the pod.
#[derive(Debug)]
pub enum SetupError {
    /// The agent cannot answer for this pod (down, no socket, an agent without `/podsetup`, a pod its watch has not
    /// delivered in time, or, for a sidecar-only ADD, no answer in time): the plugin looks the pod up in the API,
    /// as without an agent. The text says why, for the log line.
    Fallback(String),
    /// The agent answered and the ADD fails with this error (a refused pod, a failed enrollment): never a
    /// fallback, which could start an ambient pod unredirected.
    Failed(CniError),
}

/// Asks the agent for `event`'s pod: it enrolls an ambient pod (when `ambient_enabled`) or returns the facts the
/// sidecar decision needs, both from its watch of the node's pods.
pub fn pod_setup(run_dir: &Path, event: &CmdAdd, ambient_enabled: bool) -> Result<PodSetupAnswer, SetupError> {
    let socket = run_dir.join(PLUGIN_EVENT_SOCKET);
    if !socket.exists() {
        return Err(SetupError::Fallback(format!("no node agent socket at {}", socket.display())));
    }
    let setup = PodSetup { event: event.clone(), ambient_enabled };
    let body = serde_json::to_vec(&setup).map_err(|e| SetupError::Fallback(format!("encode pod setup: {e}")))?;
    let pod = format!("{}/{}", event.pod_namespace, event.pod_name);
    match request(&socket, PODSETUP_PATH, body) {
        Ok((200, answer)) => serde_json::from_slice(&answer)
            .map_err(|e| SetupError::Failed(try_again(format!("node agent's pod setup answer for {pod}: {e}")))),
        Ok((UNKNOWN_POD_STATUS, reason)) => Err(SetupError::Fallback(text(&reason))),
        Ok((status, reason)) => Err(SetupError::Failed(refused(&pod, status, &reason))),
        Err(Unreachable::Connect(e)) => Err(SetupError::Fallback(e)),
        // An agent that may be enrolling the pod must not be bypassed; one asked only for the pod's facts may.
        Err(Unreachable::Other(e)) if !ambient_enabled => Err(SetupError::Fallback(e)),
        Err(Unreachable::Other(e)) => {
            Err(SetupError::Failed(try_again(format!("ambient pod {pod} not enrolled: {e}"))))
        }
    }
}

/// POSTs an ambient pod (found in the API by the plugin) to Istio's `/cmdadd` and waits until it is enrolled; any
/// failure is a CNI error carrying the agent's reason.
pub fn hand_over(run_dir: &Path, event: &CmdAdd) -> Result<(), CniError> {
    let socket = run_dir.join(PLUGIN_EVENT_SOCKET);
    let body = serde_json::to_vec(event).map_err(|e| try_again(format!("encode event: {e}")))?;
    let pod = format!("{}/{}", event.pod_namespace, event.pod_name);
    match request(&socket, CMDADD_PATH, body) {
        Ok((200, _)) => Ok(()),
        Ok((status, reason)) => Err(refused(&pod, status, &reason)),
        Err(Unreachable::Connect(e) | Unreachable::Other(e)) => {
            Err(try_again(format!("ambient pod {pod} not enrolled: {e}")))
        }
    }
}

/// The agent's refusal as the ADD's error: 422 (annotations that cannot become rules) is invalid config (7), the
/// rest try-again (11).
fn refused(pod: &str, status: u16, reason: &[u8]) -> CniError {
    let code = if status == INVALID_POD_STATUS { ErrorCode::InvalidConfig } else { ErrorCode::TryAgainLater };
    CniError::new(code, format!("node agent refused pod {pod} ({status}): {}", text(reason)))
}

fn try_again(msg: String) -> CniError {
    CniError::new(ErrorCode::TryAgainLater, msg)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).trim().to_owned()
}

/// Why no answer came.
enum Unreachable {
    /// Nothing listens on the socket: the agent is down.
    Connect(String),
    /// The request or its answer failed, or took longer than [`AGENT_TIMEOUT`].
    Other(String),
}

/// One POST on the agent's socket: status and body.
fn request(socket: &Path, path: &str, body: Vec<u8>) -> Result<(u16, Bytes), Unreachable> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Unreachable::Other(e.to_string()))?;
    rt.block_on(async {
        let stream = tokio::net::UnixStream::connect(socket)
            .await
            .map_err(|e| Unreachable::Connect(format!("cannot reach the node agent at {}: {e}", socket.display())))?;
        tokio::time::timeout(AGENT_TIMEOUT, post(stream, path, body)).await.map_err(|_| {
            Unreachable::Other(format!("node agent at {} did not answer within {AGENT_TIMEOUT:?}", socket.display()))
        })?
    })
}

async fn post(stream: tokio::net::UnixStream, path: &str, body: Vec<u8>) -> Result<(u16, Bytes), Unreachable> {
    let other = Unreachable::Other;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .map_err(|e| other(format!("node agent handshake: {e}")))?;
    tokio::spawn(conn);
    let request = hyper::Request::post(path)
        .header("host", "node-agent")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| other(e.to_string()))?;
    let response = sender.send_request(request).await.map_err(|e| other(format!("node agent request: {e}")))?;
    let status = response.status().as_u16();
    let bytes = Limited::new(response.into_body(), MAX_ANSWER)
        .collect()
        .await
        .map_err(|e| other(format!("node agent reply: {e}")))?
        .to_bytes();
    Ok((status, bytes))
}
