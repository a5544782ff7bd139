//! The plugin's one Kubernetes API call: GET the pod being created, retried until the API answers.

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};

/// Why the pod could not be fetched.
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    /// The kubeconfig is missing or unusable; install-cni has not (yet) written it.
    #[error("kubeconfig {path}: {reason}")]
    Kubeconfig {
        /// Path that was read.
        path: String,
        /// What was wrong with it.
        reason: String,
    },
    /// Every attempt failed; carries the last API error.
    #[error("get pod {namespace}/{name}: gave up after {attempts} attempts: {last}")]
    Exhausted {
        /// Pod namespace.
        namespace: String,
        /// Pod name.
        name: String,
        /// How many attempts were made.
        attempts: u32,
        /// The last error seen.
        last: String,
    },
}

async fn client(path: &Path, timeout: Duration) -> Result<Client, LookupError> {
    let err = |reason: String| LookupError::Kubeconfig { path: path.display().to_string(), reason };
    let kc = Kubeconfig::read_from(path).map_err(|e| err(e.to_string()))?;
    let mut config =
        Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.map_err(|e| err(e.to_string()))?;
    config.connect_timeout = Some(timeout);
    config.read_timeout = Some(timeout);
    config.write_timeout = Some(timeout);
    Client::try_from(config).map_err(|e| err(e.to_string()))
}

/// Fetches `namespace/name`, trying `attempts` times with `interval` between tries.
pub fn get_pod(
    kubeconfig: &Path,
    namespace: &str,
    name: &str,
    attempts: u32,
    interval: Duration,
) -> Result<Pod, LookupError> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| {
        LookupError::Kubeconfig { path: kubeconfig.display().to_string(), reason: format!("tokio runtime: {e}") }
    })?;
    rt.block_on(async {
        let client = client(kubeconfig, Duration::from_secs(5)).await?;
        let api: Api<Pod> = Api::namespaced(client, namespace);
        let mut last = String::new();
        for attempt in 1..=attempts {
            match api.get(name).await {
                Ok(pod) => return Ok(pod),
                Err(e) => {
                    tracing::warn!(attempt, attempts, error = %e, "pod lookup failed");
                    last = e.to_string();
                }
            }
            if attempt < attempts {
                tokio::time::sleep(interval).await;
            }
        }
        Err(LookupError::Exhausted { namespace: namespace.into(), name: name.into(), attempts, last })
    })
}
