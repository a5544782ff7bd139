//! The host probe self-test: the kubelet's probes reach an ambient pod only through the host probe SNAT rule (the
//! in-pod rules let the probe address past the proxy, and capture everything else). Nothing else notices when that
//! rule is gone: enrollment succeeds, the pod runs, and then its probes fail. So at start (as soon as a pod is
//! enrolled) and every `PROBE_SELFTEST_INTERVAL`, the agent walks the path itself for one enrolled pod, as the
//! kubelet would, and says what it found in readiness, in `nodeagent_probe_selftest_ok` and in [`last_result`].
//!
//! One test: a TCP listener on an ephemeral port of the pod's IP, created inside the pod's netns (a socket stays in
//! the netns it was created in); a connect to it from the host netns, from a socket owned by the kubelet's uid in
//! nftables mode (the rule matches `meta skuid`) and by the agent's otherwise (the iptables rule matches any local
//! socket); then the accept in the pod, whose peer must be the probe SNAT address. Without the rule the connection
//! comes from the node's address, so the in-pod rules send it to the proxy's inbound port and the listener never
//! sees it: refused, or not accepted in time. Everything runs on throwaway threads with short timeouts, and the
//! sockets close when the test ends.

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use daemon::probes::{Blocker, ProbeState};
use daemon::throttle::Throttle;
use netns::{Netns, NetnsError};
use serde::Serialize;

use crate::cache::{Enrolled, PodCache};
use crate::metrics::Metrics;

/// How long the connect from the host, and then the accept in the pod, may each take (a kubelet probe's default
/// timeout is 1 s; a loaded node gets a little more).
const STEP_TIMEOUT: Duration = Duration::from_secs(2);
/// A failed test is repeated once this much later, possibly on another pod, before it counts: a pod enrolled a
/// moment ago is in the cache just before its IP is in the probe set, and a pod being deleted loses its address.
const CONFIRM_AFTER: Duration = Duration::from_secs(1);
/// While no pod is enrolled, how often the cache is looked at, so the first test runs soon after the first
/// enrollment rather than an interval later.
const NO_POD_POLL: Duration = Duration::from_secs(1);
/// The readiness blocker a failed self-test sets (`/readyz` lists it by this name).
pub const BLOCKER: &str = "probe-selftest";

/// What one self-test concluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The pod saw the connection coming from the probe SNAT address.
    Passed,
    /// It did not (twice in a row): the kubelet's probes of ambient pods fail.
    Failed,
    /// No enrolled pod with a known netns and address: nothing to test, readiness is not held up.
    NoPod,
}

impl Verdict {
    /// The `result` label of `nodeagent_probe_selftest_runs_total`.
    pub fn label(self) -> &'static str {
        match self {
            Verdict::Passed => "ok",
            Verdict::Failed => "fail",
            Verdict::NoPod => "no_pod",
        }
    }
}

/// The outcome of the latest self-test, for `explain` and the admin endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SelfTestResult {
    /// When the test ended.
    pub at: SystemTime,
    /// What it concluded.
    pub verdict: Verdict,
    /// The pod tested (`namespace/name`), when there was one.
    pub pod: Option<String>,
    /// What was seen: the address the pod saw the connection from, or why it never arrived.
    pub detail: String,
}

impl SelfTestResult {
    /// Whether the probe path works (or there was no pod to test it with).
    pub fn ok(&self) -> bool {
        self.verdict != Verdict::Failed
    }
}

/// The latest result: one self-test runs per agent, and `explain` reads it from wherever it is served.
static LAST: Mutex<Option<SelfTestResult>> = Mutex::new(None);

/// The latest self-test's result; `None` before the first test (or when the self-test is off).
pub fn last_result() -> Option<SelfTestResult> {
    LAST.lock().unwrap_or_else(PoisonError::into_inner).clone()
}

fn record(result: &SelfTestResult) {
    *LAST.lock().unwrap_or_else(PoisonError::into_inner) = Some(result.clone());
}

/// Why one pod's test failed.
#[derive(Debug, thiserror::Error)]
pub enum SelfTestError {
    /// The pod's or the host's netns could not be entered.
    #[error("{0}")]
    Netns(#[from] NetnsError),
    /// The listener could not be opened in the pod.
    #[error("listening on {ip} in the pod: {source}")]
    Listen {
        /// The pod IP.
        ip: IpAddr,
        /// What failed.
        source: std::io::Error,
    },
    /// The socket could not be created as the kubelet's uid.
    #[error("connecting as the kubelet's uid {uid}: the thread's filesystem uid stayed {got}")]
    Uid {
        /// The kubelet's uid.
        uid: u32,
        /// The uid the thread kept.
        got: u32,
    },
    /// The connect from the host failed. (Errors name the pod IP, not the listener's ephemeral port, so the same
    /// failure reads the same each time: logged once, one readiness reason.)
    #[error("connecting from the host netns to {ip}: {source} (captured by the in-pod rules: not SNATed to the probe address?)")]
    Connect {
        /// The pod IP.
        ip: IpAddr,
        /// What failed.
        source: std::io::Error,
    },
    /// The connection was made, but not to the listener.
    #[error("the connection to {ip} never reached the listener within {STEP_TIMEOUT:?} (captured by the in-pod rules: not SNATed to the probe address?): {source}")]
    Accept {
        /// The pod IP.
        ip: IpAddr,
        /// What failed.
        source: std::io::Error,
    },
    /// It arrived, from the wrong address.
    #[error("the pod saw the connection from {got}, not from the probe address {want}")]
    WrongSource {
        /// The peer address the pod saw.
        got: IpAddr,
        /// The probe SNAT address.
        want: IpAddr,
    },
}

/// The probe path's settings, from the agent's configuration.
#[derive(Debug, Clone, Copy)]
pub struct ProbePath {
    /// The IPv4 SNAT address the pod must see.
    pub snat_v4: std::net::Ipv4Addr,
    /// The IPv6 one.
    pub snat_v6: std::net::Ipv6Addr,
    /// Whether IPv6 pod addresses are covered by the host probe rule.
    pub ipv6: bool,
    /// The uid whose sockets the host rule SNATs (nftables mode); `None`: any socket, connect as the agent.
    pub uid: Option<u32>,
}

/// The periodic self-test.
#[derive(Debug)]
pub struct SelfTest {
    host: Arc<Netns>,
    cache: PodCache,
    path: ProbePath,
    interval: Duration,
    metrics: Metrics,
    probes: ProbeState,
    blocker: Option<Blocker>,
    throttle: Throttle,
    /// The failure cause last logged, so a failure that persists is logged once.
    logged: Option<String>,
    /// Called after each failed test: asks the drift check to look at the host probe rule now.
    on_failure: Option<OnFailure>,
    /// When a `no_pod` run was last counted.
    no_pod_counted: Option<std::time::Instant>,
}

/// What a failed test sets off (a boxed closure, named for `Debug`).
struct OnFailure(Box<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for OnFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnFailure(..)")
    }
}

/// A pod to test, with its own netns handle.
struct Target {
    uid: String,
    name: String,
    ip: IpAddr,
    netns: Netns,
}

impl SelfTest {
    /// A self-test of the probe path from `host` (the netns the kubelet probes from) to the pods in `cache`, every
    /// `interval`, reporting to `metrics` and `probes`.
    pub fn new(
        host: Netns,
        cache: PodCache,
        path: ProbePath,
        interval: Duration,
        metrics: Metrics,
        probes: ProbeState,
    ) -> Self {
        Self {
            host: Arc::new(host),
            cache,
            path,
            interval,
            metrics,
            probes,
            blocker: None,
            throttle: Throttle::default(),
            logged: None,
            on_failure: None,
            no_pod_counted: None,
        }
    }

    /// Calls `hook` after each failed test, so the repair of a missing host probe rule need not wait for the next
    /// periodic drift check.
    pub fn on_failure(mut self, hook: impl Fn() + Send + Sync + 'static) -> Self {
        self.on_failure = Some(OnFailure(Box::new(hook)));
        self
    }

    /// Tests now, then every interval (every second while no pod is enrolled), forever.
    pub async fn run(mut self) {
        loop {
            let result = self.once().await;
            let wait = if result.verdict == Verdict::NoPod { self.interval.min(NO_POD_POLL) } else { self.interval };
            self.report(result);
            tokio::time::sleep(wait).await;
        }
    }

    /// One self-test: a failure is confirmed a moment later, with another enrolled pod when there is one, before
    /// it counts. So a pod that went away meanwhile, or one whose own network state drops the test (a pod with
    /// NET_ADMIN can add rules of its own), does not make the node's agent unready: the node's probe path is what
    /// is tested, and it fails for every pod alike.
    async fn once(&self) -> SelfTestResult {
        let first = self.attempt(None).await;
        if first.verdict != Verdict::Failed {
            return first;
        }
        tokio::time::sleep(CONFIRM_AFTER).await;
        self.attempt(first.pod.as_deref()).await
    }

    /// Tests one pod with a netns and an address: any but `avoid` (`namespace/name`) when there is one.
    async fn attempt(&self, avoid: Option<&str>) -> SelfTestResult {
        let finish = |verdict, pod, detail| SelfTestResult { at: SystemTime::now(), verdict, pod, detail };
        let Some(target) = self.pick(avoid) else {
            return finish(Verdict::NoPod, None, "no enrolled pod with a known netns and address".into());
        };
        let (host, path) = (self.host.clone(), self.path);
        let (name, ip) = (target.name.clone(), target.ip);
        let outcome = tokio::task::spawn_blocking(move || check(&host, &target, path)).await;
        match outcome {
            Ok(Ok(peer)) => finish(Verdict::Passed, Some(name), format!("{ip} saw the connection from {peer}")),
            Ok(Err(e)) => finish(Verdict::Failed, Some(name), e.to_string()),
            Err(e) => finish(Verdict::Failed, Some(name), format!("self-test task: {e}")),
        }
    }

    fn pick(&self, avoid: Option<&str>) -> Option<Target> {
        let mut pods = self.cache.pods();
        if let Some(avoid) = avoid {
            // Stable sort: the other pods first, in cache order; the avoided one only if it is the only one.
            pods.sort_by_key(|p| pod_name(p) == avoid);
        }
        pods.into_iter().find_map(|pod| self.target(pod))
    }

    fn target(&self, pod: Enrolled) -> Option<Target> {
        let ips = pod.ips.iter().map(|ip| ip.to_canonical());
        let ip = ips.clone().find(IpAddr::is_ipv4).or_else(|| ips.clone().find(|_| self.path.ipv6))?;
        let fd = pod.netns.as_ref()?.try_clone().ok()?;
        let name = pod_name(&pod);
        let netns = Netns::from_fd(fd, format!("netns of pod {name}")).ok()?;
        Some(Target { uid: pod.uid.into(), name, ip, netns })
    }

    /// Publishes `result`: metrics, readiness, the log, [`last_result`].
    fn report(&mut self, result: SelfTestResult) {
        use crate::metrics::{SelfTestRun, Unlabelled};
        // With no pod the cache is looked at every second; counted once per interval, as a test would be.
        let counted_no_pod = self.no_pod_counted.is_some_and(|at| at.elapsed() < self.interval);
        if result.verdict != Verdict::NoPod || !counted_no_pod {
            self.metrics.probe_selftest_runs.get_or_create(&SelfTestRun { result: result.verdict.label() }).inc();
        }
        self.no_pod_counted = match result.verdict {
            Verdict::NoPod if !counted_no_pod => Some(std::time::Instant::now()),
            Verdict::NoPod => self.no_pod_counted,
            _ => None,
        };
        let pod = result.pod.as_deref().unwrap_or("?");
        match result.verdict {
            Verdict::Failed => {
                self.metrics.probe_selftest_ok.get_or_create(&Unlabelled).set(0);
                let reason = format!("host probe self-test failed for pod {pod}: {}", result.detail);
                match &self.blocker {
                    Some(blocker) => {
                        blocker.block(reason);
                    }
                    None => self.blocker = Some(self.probes.blocker(BLOCKER, reason)),
                }
                // Once per cause, throttled should it flap; a cause the throttle held back is logged on a later run.
                if self.logged.as_deref() != Some(result.detail.as_str()) {
                    if let Some(held) = self.throttle.hit() {
                        tracing::warn!(
                            pod,
                            cause = %result.detail,
                            held,
                            "host probe self-test failed: the kubelet's probes of ambient pods will fail"
                        );
                        self.logged = Some(result.detail.clone());
                    }
                }
                if let Some(OnFailure(hook)) = &self.on_failure {
                    hook();
                }
            }
            Verdict::Passed | Verdict::NoPod => {
                if result.verdict == Verdict::Passed {
                    self.metrics.probe_selftest_ok.get_or_create(&Unlabelled).set(1);
                } else {
                    // Nothing tested: the gauge says nothing rather than something stale.
                    self.metrics.probe_selftest_ok.remove(&Unlabelled);
                }
                let was_blocking = self.blocker.as_ref().is_some_and(Blocker::clear);
                self.logged = None;
                match result.verdict {
                    Verdict::Passed if was_blocking => tracing::info!(pod, "host probe self-test passes again"),
                    Verdict::Passed => tracing::debug!(pod, detail = %result.detail, "host probe self-test passed"),
                    _ if was_blocking => tracing::info!("host probe self-test: no enrolled pod left to test"),
                    _ => {}
                }
            }
        }
        record(&result);
    }
}

fn pod_name(pod: &Enrolled) -> String {
    format!("{}/{}", pod.info.namespace, pod.info.name)
}

/// One pod's test, blocking (on throwaway threads): returns the address the pod saw the connection from, which is
/// the probe address.
fn check(host: &Netns, target: &Target, path: ProbePath) -> Result<IpAddr, SelfTestError> {
    let ip = target.ip;
    let listener =
        target.netns.run(|| TcpListener::bind((ip, 0)))?.map_err(|source| SelfTestError::Listen { ip, source })?;
    let addr = listener.local_addr().map_err(|source| SelfTestError::Listen { ip, source })?;
    let timeout = nix::sys::time::TimeVal::new(STEP_TIMEOUT.as_secs() as i64, 0);
    // `accept` honours the receive timeout.
    nix::sys::socket::setsockopt(&listener.as_fd(), nix::sys::socket::sockopt::ReceiveTimeout, &timeout)
        .map_err(|e| SelfTestError::Listen { ip, source: e.into() })?;
    // Kept open until the accept, so the connection is still there to be accepted.
    let _client = host.run(|| connect(addr, path.uid))??;
    let (_accepted, peer) = listener.accept().map_err(|source| SelfTestError::Accept { ip, source })?;
    let want = match peer.ip().to_canonical() {
        IpAddr::V4(_) => IpAddr::V4(path.snat_v4),
        IpAddr::V6(_) => IpAddr::V6(path.snat_v6),
    };
    let got = peer.ip().to_canonical();
    tracing::trace!(pod = %target.name, uid = %target.uid, %got, "self-test connection accepted");
    if got != want {
        return Err(SelfTestError::WrongSource { got, want });
    }
    Ok(got)
}

/// Connects to `addr` from the calling thread's netns, as `uid` when given. Runs on a throwaway thread (see
/// [`Netns::run`]): the filesystem uid, which the kernel gives the socket as its owner, is that thread's alone.
fn connect(addr: SocketAddr, uid: Option<u32>) -> Result<TcpStream, SelfTestError> {
    if let Some(uid) = uid {
        use nix::unistd::{setfsuid, Uid};
        setfsuid(Uid::from_raw(uid));
        // `setfsuid` reports the uid before the call, never an error: asking again tells whether it took.
        let got = setfsuid(Uid::from_raw(uid)).as_raw();
        if got != uid {
            return Err(SelfTestError::Uid { uid, got });
        }
    }
    TcpStream::connect_timeout(&addr, STEP_TIMEOUT).map_err(|source| SelfTestError::Connect { ip: addr.ip(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(verdict: Verdict, detail: &str) -> SelfTestResult {
        SelfTestResult { at: SystemTime::now(), verdict, pod: Some("shop/web".into()), detail: detail.into() }
    }

    #[test]
    fn a_failure_blocks_readiness_and_zeroes_the_gauge_until_a_pass_and_no_pod_hides_the_gauge() {
        let probes = ProbeState::new(Arc::default());
        let metrics = probes.with_registry(Metrics::register);
        let path = ProbePath {
            snat_v4: istio_contract::proxy::PROBE_SNAT_V4,
            snat_v6: istio_contract::proxy::PROBE_SNAT_V6,
            ipv6: false,
            uid: None,
        };
        let host = Netns::current().unwrap();
        let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = asked.clone();
        let mut test =
            SelfTest::new(host, PodCache::default(), path, Duration::from_secs(60), metrics.clone(), probes.clone())
                .on_failure(move || {
                    counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                });
        let gauge = || {
            let mut text = String::new();
            probes.with_registry(|r| prometheus_client::encoding::text::encode(&mut text, r)).unwrap();
            text.lines().find_map(|l| l.strip_prefix("nodeagent_probe_selftest_ok ").map(str::to_owned))
        };

        test.report(result(Verdict::NoPod, "no pod"));
        test.report(result(Verdict::NoPod, "no pod"));
        let no_pod = metrics.probe_selftest_runs.get_or_create(&crate::metrics::SelfTestRun { result: "no_pod" }).get();
        assert_eq!(no_pod, 1, "the every-second look at an empty cache counts once per interval");
        assert!(probes.is_ready(), "no pod: readiness not held up");
        assert_eq!(gauge(), None, "no pod: no gauge");

        test.report(result(Verdict::Passed, "saw 169.254.7.127"));
        assert_eq!((probes.is_ready(), gauge().as_deref()), (true, Some("1")));

        test.report(result(Verdict::Failed, "refused"));
        assert_eq!(gauge().as_deref(), Some("0"));
        assert_eq!(asked.load(std::sync::atomic::Ordering::Relaxed), 1, "a failure asks for a drift check");
        let blocking = probes.blocking();
        assert_eq!(blocking.len(), 1, "{blocking:?}");
        assert_eq!(blocking[0].0, BLOCKER);
        assert!(blocking[0].1.contains("shop/web") && blocking[0].1.contains("refused"), "{blocking:?}");
        assert_eq!(last_result().map(|r| r.ok()), Some(false));

        test.report(result(Verdict::Passed, "saw 169.254.7.127"));
        assert_eq!((probes.is_ready(), gauge().as_deref()), (true, Some("1")));
        assert_eq!(last_result().map(|r| (r.ok(), r.verdict)), Some((true, Verdict::Passed)));
        assert_eq!(asked.load(std::sync::atomic::Ordering::Relaxed), 1, "passes ask for nothing");
        let runs = metrics.probe_selftest_runs.get_or_create(&crate::metrics::SelfTestRun { result: "ok" }).get();
        assert_eq!(runs, 2);
    }
}
