//! `fake-apiserver`: serves seeded objects over the Kubernetes API and writes a kubeconfig for clients.

use anyhow::Context;
use clap::Parser;
use fake_apiserver::{parse_objects, serve, write_file_atomically, Cluster, Config};
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use tokio::signal::unix::{signal, SignalKind};

/// Parses a Go-style duration (`500ms`, `5s`, `1m30s`).
fn duration(text: &str) -> Result<Duration, String> {
    let invalid = |why: &dyn std::fmt::Display| format!("{text:?} is not a duration such as 5s, 500ms or 1m30s: {why}");
    let signed = jiff::fmt::friendly::SpanParser::new().parse_duration(text.trim()).map_err(|e| invalid(&e))?;
    Duration::try_from(signed).map_err(|_| invalid(&"negative"))
}

/// Command line of the fake apiserver. Without options it is lenient (plain http, any token, no RBAC,
/// instant deletion); `--strict` turns on everything a real kube-apiserver does, and each option below turns
/// on (or tunes) one behaviour.
#[derive(Debug, Parser)]
#[command(
    about = "Fake Kubernetes API server for tests: lenient by default, as strict as kube-apiserver with --strict"
)]
struct Args {
    /// Address to listen on; port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Objects to serve: multi-document YAML, a JSON array or a JSON `List` (RBAC objects included).
    #[arg(long)]
    seed: Option<PathBuf>,
    /// Where to write a kubeconfig pointing at this server (with the CA and an admin token when those apply).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Start from the strict preset: TLS, authentication, RBAC, graceful deletion, strict field selectors,
    /// watch timeout 30s, history of 1000 events / 75s, bookmarks every 60s, unissued versions expire.
    #[arg(long)]
    strict: bool,
    /// Serve https with the fake's own CA [default: plain http].
    #[arg(long)]
    tls: bool,
    /// Extra DNS name or IP address for the serving certificate (repeatable); localhost, 127.0.0.1, ::1,
    /// kubernetes.default.svc names and the listen address are always included.
    #[arg(long = "tls-san", value_name = "NAME")]
    tls_sans: Vec<String>,
    /// Keep the CA (ca.crt, ca.key), serving certificate (apiserver.crt, apiserver.key), token-signing key
    /// (sa.key) and token rotations here, so a restarted server is trusted and accepts old tokens
    /// [default: in memory].
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Require a valid bearer token on API requests (401 otherwise) [default: off, anonymous allowed].
    #[arg(long)]
    authentication: bool,
    /// How long a subject's older tokens keep working after a rotation (POST /fake/tokens/rotate).
    #[arg(long, value_parser = duration, default_value = "90s")]
    token_rotation_grace: Duration,
    /// Enforce the seeded ClusterRoles/Roles and their bindings (403 otherwise) [default: off].
    #[arg(long)]
    rbac: bool,
    /// DELETE sets deletionTimestamp, waits out the grace period (pods: 30s or
    /// terminationGracePeriodSeconds) and finalizers [default: off, deletion is immediate].
    #[arg(long)]
    graceful_deletion: bool,
    /// Accept only the field selectors kube-apiserver supports per kind (400 otherwise) [default: off].
    #[arg(long)]
    strict_field_selectors: bool,
    /// Server-side watch timeout: watches without timeoutSeconds end after a random time in [T, 2T]
    /// [default: none; --strict: 30s].
    #[arg(long, value_parser = duration, value_name = "T")]
    watch_timeout: Option<Duration>,
    /// Interval of bookmarks to watches that ask for them (allowWatchBookmarks=true) [default: 1s; --strict: 60s].
    #[arg(long, value_parser = duration)]
    bookmark_interval: Option<Duration>,
    /// Events kept for watches to resume from; older resourceVersions get 410 [default: 10000; --strict: 1000].
    #[arg(long)]
    history_events: Option<usize>,
    /// Events older than this are compacted away [default: never; --strict: 75s].
    #[arg(long, value_parser = duration)]
    history_age: Option<Duration>,
    /// Versions this server never issued get 410, and versions start at the clock so a restarted server
    /// expires every old one [default: off].
    #[arg(long)]
    expire_unissued_resource_versions: bool,
}

impl Args {
    fn config(&self) -> Config {
        let mut c = if self.strict { Config::strict() } else { Config::default() };
        c.tls |= self.tls;
        c.tls_sans.extend(self.tls_sans.iter().cloned());
        c.state_dir = self.state_dir.clone();
        c.authentication |= self.authentication;
        c.token_rotation_grace = self.token_rotation_grace;
        c.rbac |= self.rbac;
        c.graceful_deletion |= self.graceful_deletion;
        c.strict_field_selectors |= self.strict_field_selectors;
        c.watch.min_timeout = self.watch_timeout.or(c.watch.min_timeout);
        c.watch.bookmark_interval = self.bookmark_interval.unwrap_or(c.watch.bookmark_interval);
        c.watch.history_events = self.history_events.unwrap_or(c.watch.history_events);
        c.watch.history_age = self.history_age.or(c.watch.history_age);
        c.watch.expire_unissued |= self.expire_unissued_resource_versions;
        c
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let listener =
        tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
    let bound = listener.local_addr().context("reading the bound address")?;
    let mut config = args.config();
    if !bound.ip().is_unspecified() {
        config.tls_sans.push(bound.ip().to_string());
    }
    let scheme = if config.tls { "https" } else { "http" };
    let cluster = Cluster::with_config(config).context("setting up the server's keys")?;
    if let Some(path) = &args.seed {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading seed file {}", path.display()))?;
        for obj in parse_objects(&text).with_context(|| format!("parsing seed file {}", path.display()))? {
            cluster.upsert(obj).with_context(|| format!("loading seed file {}", path.display()))?;
        }
    }
    let url = format!("{scheme}://{bound}");
    if let Some(path) = &args.kubeconfig {
        write_file_atomically(path, &cluster.kubeconfig(&url))?;
    }
    let mut stdout = std::io::stdout();
    writeln!(stdout, "listening on {url}").and_then(|()| stdout.flush()).context("writing to stdout")?;
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    serve(listener, cluster, async {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
    .await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_map_onto_the_config() {
        let parse = |argv: &[&str]| Args::try_parse_from([&["fake-apiserver"], argv].concat()).unwrap().config();
        assert_eq!(parse(&[]), Config::default(), "no flags: the lenient server");
        assert_eq!(parse(&["--strict"]), Config::strict());
        let c = parse(&["--tls", "--rbac", "--watch-timeout", "2s", "--history-events", "5", "--tls-san", "x.example"]);
        assert!(c.tls && c.rbac && !c.authentication && !c.graceful_deletion);
        assert_eq!((c.watch.min_timeout, c.watch.history_events), (Some(Duration::from_secs(2)), 5));
        assert_eq!(c.tls_sans, ["x.example"]);
        let s = parse(&["--strict", "--bookmark-interval", "500ms", "--token-rotation-grace", "1s"]);
        assert_eq!(s.watch.bookmark_interval, Duration::from_millis(500));
        assert_eq!(s.token_rotation_grace, Duration::from_secs(1));
        assert!(Args::try_parse_from(["fake-apiserver", "--watch-timeout", "soon"]).is_err());
    }
}
