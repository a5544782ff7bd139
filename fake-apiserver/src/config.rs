//! How strict a fake server is: every option, its default (today's lenient behaviour) and the strict preset.
//!
//! | option | flag | default | strict ([`Config::strict`]) |
//! |---|---|---|---|
//! | [`Config::tls`] | `--tls` | off: plain http | https with the fake's own CA |
//! | [`Config::tls_sans`] | `--tls-san` | none extra | none extra |
//! | [`Config::state_dir`] | `--state-dir` | none: keys live in memory | none |
//! | [`Config::authentication`] | `--authentication` | off: any or no token | invalid token 401, none anonymous |
//! | [`Config::token_rotation_grace`] | `--token-rotation-grace` | 90s | 90s |
//! | [`Config::rbac`] | `--rbac` | off | enforced (403) |
//! | [`Config::graceful_deletion`] | `--graceful-deletion` | off: DELETE removes at once | grace periods, finalizers |
//! | [`Config::strict_field_selectors`] | `--strict-field-selectors` | off: any dotted path | the real server's fields |
//! | [`WatchConfig::min_timeout`] | `--watch-timeout` | none | 30s, each watch ends in [30s, 60s] |
//! | [`WatchConfig::bookmark_interval`] | `--bookmark-interval` | 1s | 60s |
//! | [`WatchConfig::history_events`] | `--history-events` | 10000 | 1000 |
//! | [`WatchConfig::history_age`] | `--history-age` | none | 75s |
//! | [`WatchConfig::expire_unissued`] | `--expire-unissued-resource-versions` | off | on |
//!
//! The binary's `--strict` starts from [`Config::strict`]; the other flags then change single options.
//! What is always as strict as the real server, whatever the configuration: strategic-merge and JSON patches
//! have their real semantics (unknown patch types get 415, unsupported directives 422), and a paged list's
//! continue token pins its resourceVersion (an expired one gets 410).

use std::path::PathBuf;
use std::time::Duration;

/// Watch and history behaviour; see the module docs for defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct WatchConfig {
    /// Server-side watch timeout: every watch ends after a random duration in `[t, 2t]` (or the client's
    /// `timeoutSeconds`, if shorter). kube-apiserver draws the same way from `--min-request-timeout`, but only for
    /// watches without `timeoutSeconds`; kube clients always send 290s, so the fake caps those too, to make
    /// watches end within a test as they do in production for other reasons (restarts, load balancers).
    /// `None` (default): only the client's `timeoutSeconds` ends a watch.
    pub min_timeout: Option<Duration>,
    /// How often an idle watch that asked for bookmarks (`allowWatchBookmarks=true`) receives one; watches
    /// that did not ask never get one. Default 1s (the real server: about a minute).
    pub bookmark_interval: Duration,
    /// Most events kept for watches to resume from; a watch from an older resourceVersion gets 410 Expired,
    /// as an ERROR event in a 200 stream the way kube-apiserver's watch cache answers. Default 10000.
    pub history_events: usize,
    /// Events older than this are compacted away, as etcd compaction and the watch cache do (the real
    /// server: 5 minutes, about 75 seconds of watch cache). Default `None`: kept until `history_events`.
    pub history_age: Option<Duration>,
    /// A watch or continue token naming a resourceVersion this server never issued (newer than its newest)
    /// gets 410, and the first resourceVersion is taken from the clock, so every version a previous server
    /// handed out (e.g. before a restart on a restored store) is too old here: clients relist. Default off:
    /// versions count from 1 and a future version waits for changes.
    pub expire_unissued: bool,
}

impl Default for WatchConfig {
    fn default() -> Self {
        WatchConfig {
            min_timeout: None,
            bookmark_interval: Duration::from_secs(1),
            history_events: 10_000,
            history_age: None,
            expire_unissued: false,
        }
    }
}

impl WatchConfig {
    /// The real server's shape, with times short enough for tests.
    pub fn strict() -> Self {
        WatchConfig {
            min_timeout: Some(Duration::from_secs(30)),
            bookmark_interval: Duration::from_secs(60),
            history_events: 1_000,
            history_age: Some(Duration::from_secs(75)),
            expire_unissued: true,
        }
    }
}

/// Everything that makes a fake server lenient or strict. `Config::default()` is the lenient server (this
/// crate's tests of single behaviours start from it); [`Config::strict`] behaves like a real kube-apiserver
/// wherever our binaries could tell the difference, and is what the workspace's test clusters run (with
/// test-short watch times: `testbed::mesh::api_config`).
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Serve https with a certificate from the fake's own CA (created in [`Config::state_dir`] or in memory).
    /// Default off: plain http.
    pub tls: bool,
    /// Extra DNS names or IP addresses for the serving certificate. Always included: `localhost`,
    /// `127.0.0.1`, `::1`, `kubernetes`, `kubernetes.default`, `kubernetes.default.svc`,
    /// `kubernetes.default.svc.cluster.local`, and the listen address when it is not a wildcard.
    pub tls_sans: Vec<String>,
    /// Directory keeping the CA (`ca.crt`, `ca.key`), the serving certificate (`apiserver.crt`,
    /// `apiserver.key`), the token-signing key (`sa.key`) and token rotations (`token-rotations.json`): a
    /// server restarted on the same directory is trusted by existing clients and accepts their tokens.
    /// Default `None`: everything is generated in memory for this server only.
    pub state_dir: Option<PathBuf>,
    /// Check bearer tokens as the real server does: an invalid token gets 401, a request without one runs as
    /// `system:anonymous` and RBAC decides. Default off: requests without a valid token run as
    /// `system:anonymous`.
    pub authentication: bool,
    /// After a token rotation, how long the subject's older tokens keep working. Default 90s (longer than
    /// the minute after which kube clients re-read a token file).
    pub token_rotation_grace: Duration,
    /// Enforce the rules of the stored ClusterRoles, ClusterRoleBindings, Roles and RoleBindings for the
    /// request's user (403 otherwise); `system:masters` (the kubeconfig's admin) may do anything. Default off.
    pub rbac: bool,
    /// DELETE sets `deletionTimestamp` and `deletionGracePeriodSeconds` (pods: the request's grace period,
    /// else the pod's `terminationGracePeriodSeconds`, else 30s; other kinds: 0), emits MODIFIED and removes
    /// the object (DELETED) once the grace period ended and no finalizer is left. Default off: DELETE removes
    /// the object at once, finalizers or not.
    pub graceful_deletion: bool,
    /// Accept in `fieldSelector` only the fields the real server supports for each kind (400 otherwise).
    /// Default off: any dotted path.
    pub strict_field_selectors: bool,
    /// Watch timeout, history and bookmarks.
    pub watch: WatchConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            tls: false,
            tls_sans: Vec::new(),
            state_dir: None,
            authentication: false,
            token_rotation_grace: Duration::from_secs(90),
            rbac: false,
            graceful_deletion: false,
            strict_field_selectors: false,
            watch: WatchConfig::default(),
        }
    }
}

impl Config {
    /// Every strict behaviour on: https, tokens, RBAC, graceful deletion, real field selectors, watch
    /// timeouts, compacted history and expiry of versions this server never issued.
    pub fn strict() -> Self {
        Config {
            tls: true,
            authentication: true,
            rbac: true,
            graceful_deletion: true,
            strict_field_selectors: true,
            watch: WatchConfig::strict(),
            ..Config::default()
        }
    }
}
