//! The plugin's Kubernetes API calls: GET the pod being created (and, for ambient detection, its namespace),
//! retried until the API answers.

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};

/// Why an object could not be fetched.
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
    #[error("get {what}: gave up after {attempts} attempts: {last}")]
    Exhausted {
        /// What was fetched, e.g. `pod shop/web`.
        what: String,
        /// How many attempts were made.
        attempts: u32,
        /// The last error seen.
        last: String,
    },
}

/// A connection to the API server for the length of one plugin invocation.
pub struct ApiServer {
    runtime: tokio::runtime::Runtime,
    client: Client,
    attempts: u32,
    interval: Duration,
}

impl ApiServer {
    /// Reads the kubeconfig and prepares a client; nothing is sent yet.
    pub fn connect(kubeconfig: &Path, attempts: u32, interval: Duration) -> Result<ApiServer, LookupError> {
        let err = |reason: String| LookupError::Kubeconfig { path: kubeconfig.display().to_string(), reason };
        let runtime =
            tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| err(e.to_string()))?;
        let client = runtime.block_on(async {
            let kc = Kubeconfig::read_from(kubeconfig).map_err(|e| err(e.to_string()))?;
            let mut config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(|e| err(e.to_string()))?;
            let timeout = Some(Duration::from_secs(5));
            (config.connect_timeout, config.read_timeout, config.write_timeout) = (timeout, timeout, timeout);
            // Named in the API server's audit log, apart from the node agent (the same service account).
            if let (Ok(name), Ok(value)) =
                ("user-agent".try_into(), concat!("istio-cni/", env!("CARGO_PKG_VERSION")).try_into())
            {
                config.headers.push((name, value));
            }
            Client::try_from(config).map_err(|e| err(e.to_string()))
        })?;
        Ok(ApiServer { runtime, client, attempts: attempts.max(1), interval })
    }

    /// GET the pod, retried.
    pub fn pod(&self, namespace: &str, name: &str) -> Result<Pod, LookupError> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        self.retry(&format!("pod {namespace}/{name}"), self.attempts, || api.get(name))
    }

    /// GET the namespace, tried `attempts` times.
    pub fn namespace(&self, name: &str, attempts: u32) -> Result<Namespace, LookupError> {
        let api: Api<Namespace> = Api::all(self.client.clone());
        self.retry(&format!("namespace {name}"), attempts.max(1), || api.get(name))
    }

    fn retry<T, F, Fut>(&self, what: &str, attempts: u32, mut call: F) -> Result<T, LookupError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, kube::Error>>,
    {
        self.runtime.block_on(async {
            let mut last = String::new();
            for attempt in 1..=attempts {
                match call().await {
                    Ok(obj) => return Ok(obj),
                    Err(e) => {
                        tracing::warn!(attempt, attempts, error = %e, "{what}: lookup failed");
                        last = e.to_string();
                    }
                }
                if attempt < attempts {
                    tokio::time::sleep(self.interval).await;
                }
            }
            Err(LookupError::Exhausted { what: what.to_string(), attempts, last })
        })
    }

    /// The configured attempts for lookups that retry.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }
}
