//! The plugin's ambient path: decide from the enablement selectors whether a new pod belongs to the ambient mesh,
//! and if so hand it to the node agent and wait until it is fully enrolled (fail closed otherwise).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use cni::plugin_event::{CmdAdd, CMDADD_PATH, INVALID_POD_STATUS};
use cni::{CniError, ErrorCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use istio_contract::enablement::{never_enrolled, PodFacts, Selectors};
use istio_contract::paths::PLUGIN_EVENT_SOCKET;
use k8s_openapi::api::core::v1::Pod;

use crate::config::PluginConf;
use crate::k8s::ApiServer;

/// How long the agent may take to enroll a pod (netns, rules, proxy ack, annotation).
const AGENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether `pod` is to be enrolled in ambient. The namespace lookup is the detection step: with
/// `enable_ambient_detection_retry` it gets the pod lookup's retry budget, otherwise one attempt. Either way an
/// API error fails ADD (code 11) instead of falling through to the sidecar path as Istio does: falling through
/// would start a pod that may belong to the mesh with no redirection at all.
pub fn is_ambient(conf: &PluginConf, api: &ApiServer, pod: &Pod) -> Result<bool, CniError> {
    let selectors = Selectors::from_json(conf.enablement_selectors.as_ref())
        .map_err(|e| CniError::new(ErrorCode::InvalidConfig, e.to_string()))?;
    let empty = BTreeMap::new();
    let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
    let facts = PodFacts {
        namespace,
        labels: pod.metadata.labels.as_ref().unwrap_or(&empty),
        annotations: pod.metadata.annotations.as_ref().unwrap_or(&empty),
        host_network: pod.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false),
    };
    let excluded: Vec<String> = conf.excluded_namespaces().map(String::from).collect();
    if never_enrolled(&facts, &excluded) {
        return Ok(false);
    }
    if let Some(answer) = selectors.decide_without_namespace(facts.labels) {
        return Ok(answer);
    }
    let attempts = if conf.enable_ambient_detection_retry { api.attempts() } else { 1 };
    let ns = api
        .namespace(namespace, attempts)
        .map_err(|e| CniError::new(ErrorCode::TryAgainLater, format!("ambient detection: {e}")))?;
    Ok(selectors.matches(facts.labels, ns.metadata.labels.as_ref().unwrap_or(&empty)))
}

/// POSTs the pod to the agent's socket and waits for it to be enrolled; any failure is a CNI error carrying the
/// agent's reason.
pub fn hand_over(run_dir: &Path, event: &CmdAdd) -> Result<(), CniError> {
    let socket = run_dir.join(PLUGIN_EVENT_SOCKET);
    let fail = |msg: String| CniError::new(ErrorCode::TryAgainLater, msg);
    let body = serde_json::to_vec(event).map_err(|e| fail(format!("encode event: {e}")))?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| fail(e.to_string()))?;
    let reply = rt.block_on(async {
        tokio::time::timeout(AGENT_TIMEOUT, post(&socket, body))
            .await
            .map_err(|_| format!("node agent at {} did not answer within {AGENT_TIMEOUT:?}", socket.display()))?
    });
    match reply {
        Ok((200, _)) => Ok(()),
        Ok((status, reason)) if status == INVALID_POD_STATUS => Err(CniError::new(
            ErrorCode::InvalidConfig,
            format!("node agent refused pod {}/{} ({status}): {}", event.pod_namespace, event.pod_name, reason.trim()),
        )),
        Ok((status, reason)) => Err(fail(format!(
            "node agent refused pod {}/{} ({status}): {}",
            event.pod_namespace,
            event.pod_name,
            reason.trim()
        ))),
        Err(e) => Err(fail(format!("ambient pod {}/{} not enrolled: {e}", event.pod_namespace, event.pod_name))),
    }
}

async fn post(socket: &Path, body: Vec<u8>) -> Result<(u16, String), String> {
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| format!("cannot reach the node agent at {}: {e}", socket.display()))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .map_err(|e| format!("node agent handshake: {e}"))?;
    tokio::spawn(conn);
    let request = hyper::Request::post(CMDADD_PATH)
        .header("host", "node-agent")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let response = sender.send_request(request).await.map_err(|e| format!("node agent request: {e}"))?;
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.map_err(|e| format!("node agent reply: {e}"))?.to_bytes();
    Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
}
