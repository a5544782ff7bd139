//! The certificate manager: one certificate per workload identity the node serves, obtained before it is needed
//! and replaced before it expires.
//!
//! Guarantees:
//! * one certificate (and one worker) per identity; [`CertificateManager::register`] counts registrations (the
//!   proxy registers an identity for each local workload that has it) and [`CertificateManager::forget`] drops
//!   the identity, its certificate and its worker when the count reaches zero;
//! * a registered identity is fetched at once (warm-up); [`CertificateManager::certificate`] fetches an unknown
//!   identity on demand (it is then held as if registered once) and waits for the first outcome of a fetch;
//! * a certificate is refreshed at half-life, `not_before + (not_after - not_before) / 2`; one issued already past
//!   its half-life is refreshed after the failure backoff instead, so a CA whose clock lags is not hammered;
//! * a failed fetch is retried after ztunnel's backoff ([`BackoffPolicy`]: 500 ms, then 1 s doubling to 150 s,
//!   ±20 % jitter) and reset by a success; meanwhile a still-valid certificate is kept and handed out, and the
//!   retry comes no later than its expiry, when it is dropped;
//! * at most `max_in_flight` (default 8) fetches run at once, across identities, served by priority
//!   ([`crate::permits`]): a fetch someone waits for ([`CertificateManager::certificate`] without a valid
//!   certificate) first, then first certificates of registered identities, then refreshes and retries;
//! * [`CertificateManager::snapshot`] reports each identity as ztunnel's config dump does: `Initializing`,
//!   `Available`, or `Unavailable: <error>` (e.g. `Unavailable: signing gRPC error (…): request impersonation
//!   authentication failure`), with the held certificate's validity, serial and issuer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use hbone::identity::Identity;
use ring::rand::{SecureRandom, SystemRandom};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::certificate::WorkloadCertificate;
use crate::client::{FetchError, Signer};
use crate::clock::Clock;
use crate::permits::{Permits, Priority};

/// ztunnel's retry delays for a failed fetch.
#[derive(Clone, Debug)]
pub struct BackoffPolicy {
    /// The first retry's delay.
    pub first: Duration,
    /// The second retry's delay, doubled for each further one.
    pub second: Duration,
    /// The largest delay.
    pub max: Duration,
    /// Each delay is multiplied by a random factor in `1 ± jitter`.
    pub jitter: f64,
}

impl Default for BackoffPolicy {
    fn default() -> Self {
        BackoffPolicy {
            first: Duration::from_millis(500),
            second: Duration::from_secs(1),
            max: Duration::from_secs(150),
            jitter: 0.2,
        }
    }
}

impl BackoffPolicy {
    /// The delay before retry number `failures` (1 for the first), before jitter.
    pub fn base_delay(&self, failures: u32) -> Duration {
        match failures {
            0 | 1 => self.first.min(self.max),
            n => {
                let factor = 1u32.checked_shl(n - 2).unwrap_or(u32::MAX);
                self.second.checked_mul(factor).unwrap_or(self.max).min(self.max)
            }
        }
    }

    fn delay(&self, failures: u32, random: &SystemRandom) -> Duration {
        let base = self.base_delay(failures);
        let mut byte = [0u8; 4];
        let unit = match random.fill(&mut byte) {
            Ok(()) => f64::from(u32::from_be_bytes(byte)) / f64::from(u32::MAX),
            Err(_) => 0.5,
        };
        let jitter = self.jitter.clamp(0.0, 1.0);
        base.mul_f64(1.0 - jitter + 2.0 * jitter * unit)
    }
}

/// How the manager runs.
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    /// Most fetches in flight across identities (ztunnel: 8).
    pub max_in_flight: usize,
    /// Retry delays.
    pub backoff: BackoffPolicy,
    /// The wall clock certificates are judged by.
    pub clock: Clock,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        ManagerConfig { max_in_flight: 8, backoff: BackoffPolicy::default(), clock: Clock::System }
    }
}

/// Why [`CertificateManager::certificate`] has no certificate to give.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CertificateError {
    /// The last fetch failed and no valid certificate is held; retries go on.
    #[error("no certificate for {identity}: {error}")]
    Unavailable {
        /// The identity.
        identity: String,
        /// The last fetch's failure.
        error: Arc<FetchError>,
    },
    /// The held certificate has just expired and no fetch has failed yet; the worker is fetching a new one.
    #[error("no certificate for {0}: the held one expired")]
    Expired(String),
    /// The identity was forgotten while waiting.
    #[error("no certificate for {0}: forgotten")]
    Forgotten(String),
}

/// The published state of one identity.
#[derive(Clone, Default)]
struct Slot {
    certificate: Option<Arc<WorkloadCertificate>>,
    error: Option<Arc<FetchError>>,
}

impl Slot {
    fn settled(&self) -> bool {
        self.certificate.is_some() || self.error.is_some()
    }
}

struct Entry {
    registrations: usize,
    slot: watch::Receiver<Slot>,
    /// Set when someone waits for this identity's certificate: its next request goes first.
    urgent: Arc<watch::Sender<bool>>,
    worker: JoinHandle<()>,
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.worker.abort();
    }
}

/// What the workers share. They hold this, not [`Inner`], so dropping the manager drops the entries, whose
/// `Drop` aborts the workers.
struct Shared {
    signer: Arc<dyn Signer>,
    config: ManagerConfig,
    permits: Arc<Permits>,
    random: SystemRandom,
}

struct Inner {
    shared: Arc<Shared>,
    entries: Mutex<HashMap<Identity, Entry>>,
}

impl std::ops::Deref for Inner {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.shared
    }
}

/// One identity's line in a config dump.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CertificateSnapshot {
    /// The SPIFFE identity.
    pub identity: String,
    /// `Initializing`, `Available` or `Unavailable: <error>`.
    pub state: String,
    /// The held certificate's notBefore (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_before: Option<String>,
    /// The held certificate's notAfter (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_after: Option<String>,
    /// The held certificate's serial number (decimal).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// The held certificate's issuer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub issuer: Option<String>,
    /// The last fetch's failure while a still-valid certificate is held (refresh failing).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

fn rfc3339(at: SystemTime) -> String {
    jiff::Timestamp::try_from(at).map(|t| t.to_string()).unwrap_or_else(|_| format!("{at:?}"))
}

/// Certificates for the node's workload identities. Cheap to clone; dropping the last clone stops every worker.
#[derive(Clone)]
pub struct CertificateManager {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for CertificateManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateManager").field("config", &self.inner.config).finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl CertificateManager {
    /// A manager obtaining certificates from `signer` (a [`crate::client::CaClient`] in the proxy). Must be
    /// created inside a tokio runtime's context (workers are spawned on it).
    pub fn new(signer: Arc<dyn Signer>, config: ManagerConfig) -> Self {
        let permits = Permits::new(config.max_in_flight);
        CertificateManager {
            inner: Arc::new(Inner {
                shared: Arc::new(Shared { signer, config, permits, random: SystemRandom::new() }),
                entries: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Registers one more user of `identity`; the first registration starts fetching its certificate.
    pub fn register(&self, identity: &Identity) {
        let mut entries = lock(&self.inner.entries);
        self.entry(&mut entries, identity).registrations += 1;
    }

    /// Drops one registration of `identity`; the last one (or any, for an identity fetched on demand and never
    /// registered) forgets its certificate and stops its worker.
    pub fn forget(&self, identity: &Identity) {
        let mut entries = lock(&self.inner.entries);
        if let Some(entry) = entries.get_mut(identity) {
            entry.registrations = entry.registrations.saturating_sub(1);
            if entry.registrations == 0 {
                entries.remove(identity);
            }
        }
    }

    /// The identities held, sorted.
    pub fn identities(&self) -> Vec<Identity> {
        let mut ids: Vec<Identity> = lock(&self.inner.entries).keys().cloned().collect();
        ids.sort();
        ids
    }

    fn entry<'a>(&self, entries: &'a mut HashMap<Identity, Entry>, identity: &Identity) -> &'a mut Entry {
        entries.entry(identity.clone()).or_insert_with(|| {
            let (tx, rx) = watch::channel(Slot::default());
            let urgent = Arc::new(watch::channel(false).0);
            let worker = tokio::spawn(run_worker(self.inner.shared.clone(), identity.clone(), tx, urgent.clone()));
            Entry { registrations: 0, slot: rx, urgent, worker }
        })
    }

    /// The certificate for `identity`: the held one if valid, else the outcome of the fetch in progress (started
    /// now for an identity not held). Callers bound the wait with their own timeout.
    pub async fn certificate(&self, identity: &Identity) -> Result<Arc<WorkloadCertificate>, CertificateError> {
        let now = self.inner.config.clock.now();
        let mut slot = {
            let mut entries = lock(&self.inner.entries);
            let entry = self.entry(&mut entries, identity);
            let valid = entry.slot.borrow().certificate.as_ref().is_some_and(|c| c.is_valid_at(now));
            if !valid {
                entry.urgent.send_replace(true);
            }
            entry.slot.clone()
        };
        let forgotten = || CertificateError::Forgotten(identity.to_string());
        let settled = slot.wait_for(Slot::settled).await.map_err(|_| forgotten())?.clone();
        let now = self.inner.config.clock.now();
        match (settled.certificate, settled.error) {
            (Some(certificate), _) if certificate.is_valid_at(now) => Ok(certificate),
            (_, Some(error)) => Err(CertificateError::Unavailable { identity: identity.to_string(), error }),
            // Held but expired a moment ago and the worker has not caught up: report it as unavailable.
            (_, None) => Err(CertificateError::Expired(identity.to_string())),
        }
    }

    /// Every identity's state, sorted by identity.
    pub fn snapshot(&self) -> Vec<CertificateSnapshot> {
        let entries = lock(&self.inner.entries);
        let mut out: Vec<CertificateSnapshot> = entries
            .iter()
            .map(|(identity, entry)| {
                let slot = entry.slot.borrow().clone();
                let state = match (&slot.certificate, &slot.error) {
                    (Some(_), _) => "Available".to_owned(),
                    (None, Some(error)) => format!("Unavailable: {error}"),
                    (None, None) => "Initializing".to_owned(),
                };
                let cert = slot.certificate.as_ref();
                CertificateSnapshot {
                    identity: identity.to_string(),
                    state,
                    not_before: cert.map(|c| rfc3339(c.not_before())),
                    not_after: cert.map(|c| rfc3339(c.not_after())),
                    serial: cert.map(|c| c.serial().to_owned()),
                    issuer: cert.map(|c| c.issuer().to_owned()),
                    last_error: cert.and(slot.error.as_ref()).map(|e| e.to_string()),
                }
            })
            .collect();
        out.sort_by(|a, b| a.identity.cmp(&b.identity));
        out
    }
}

/// A permit at `priority`, or at [`Priority::RealTime`] as soon as someone waits for the certificate.
async fn acquire(permits: &Arc<Permits>, priority: Priority, urgent: &watch::Sender<bool>) -> crate::permits::Permit {
    let mut urgent = urgent.subscribe();
    let already = *urgent.borrow();
    if already {
        return permits.acquire(Priority::RealTime).await;
    }
    let became_urgent = async move {
        if urgent.wait_for(|u| *u).await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        permit = permits.acquire(priority) => permit,
        () = became_urgent => permits.acquire(Priority::RealTime).await,
    }
}

async fn run_worker(
    inner: Arc<Shared>,
    identity: Identity,
    slot: watch::Sender<Slot>,
    urgent: Arc<watch::Sender<bool>>,
) {
    let clock = inner.config.clock;
    let mut failures = 0u32;
    let mut issued_once = false;
    loop {
        let priority = if issued_once { Priority::Background } else { Priority::Warmup };
        let result = {
            let _permit = acquire(&inner.permits, priority, &urgent).await;
            urgent.send_replace(false);
            inner.signer.sign(&identity).await
        };
        match result {
            Ok(certificate) => {
                issued_once = true;
                let until_refresh = clock.until(certificate.refresh_at());
                let wait = if until_refresh.is_zero() {
                    // Issued already past half-life (a CA clock behind ours, a lifetime clamped by an expiring
                    // intermediate): refreshing at once would hammer istiod, so back off as after a failure.
                    failures = failures.saturating_add(1);
                    let delay = inner.config.backoff.delay(failures, &inner.random);
                    tracing::warn!(identity = %identity, retry_in = ?delay, "workload certificate issued past its half-life");
                    delay
                } else {
                    failures = 0;
                    until_refresh
                };
                tracing::info!(
                    identity = %identity,
                    serial = certificate.serial(),
                    expires = %rfc3339(certificate.not_after()),
                    "workload certificate issued"
                );
                slot.send_replace(Slot { certificate: Some(Arc::new(certificate)), error: None });
                tokio::time::sleep(wait).await;
            }
            Err(error) => {
                failures = failures.saturating_add(1);
                let delay = inner.config.backoff.delay(failures, &inner.random);
                let now = clock.now();
                let kept = slot.borrow().certificate.clone().filter(|c| c.is_valid_at(now));
                tracing::warn!(identity = %identity, error = %error, retry_in = ?delay, kept = kept.is_some(),
                    "workload certificate fetch failed");
                let wake = match &kept {
                    Some(cert) => delay.min(clock.until(cert.not_after())),
                    None => delay,
                };
                slot.send_replace(Slot { certificate: kept, error: Some(Arc::new(error)) });
                tokio::time::sleep(wake).await;
                let now = clock.now();
                slot.send_if_modified(|s| {
                    if s.certificate.as_ref().is_some_and(|c| !c.is_valid_at(now)) {
                        tracing::warn!(identity = %identity, "workload certificate expired while refresh failed");
                        s.certificate = None;
                        return true;
                    }
                    false
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_follows_ztunnel() {
        let p = BackoffPolicy::default();
        let base: Vec<u64> = (1..=10).map(|n| p.base_delay(n).as_millis() as u64).collect();
        assert_eq!(base, [500, 1000, 2000, 4000, 8000, 16000, 32000, 64000, 128000, 150000]);
        assert_eq!(p.base_delay(200), Duration::from_secs(150));
        let random = SystemRandom::new();
        for n in 1..40 {
            let d = p.delay(n, &random).as_secs_f64();
            let b = p.base_delay(n).as_secs_f64();
            assert!(d >= b * 0.8 - 1e-9 && d <= b * 1.2 + 1e-9, "{d} vs {b}");
        }
    }
}
