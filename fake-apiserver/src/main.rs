//! `fake-apiserver`: serves seeded objects over the Kubernetes API and writes a kubeconfig for clients.

use anyhow::Context;
use clap::Parser;
use fake_apiserver::{kubeconfig_yaml, parse_objects, serve, write_file_atomically, Cluster};
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use tokio::signal::unix::{signal, SignalKind};

/// Command line of the fake apiserver.
#[derive(Debug, Parser)]
#[command(about = "Fake Kubernetes API server for tests (plain HTTP)")]
struct Args {
    /// Address to listen on; port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Objects to serve: multi-document YAML, a JSON array or a JSON `List`.
    #[arg(long)]
    seed: Option<PathBuf>,
    /// Where to write a kubeconfig pointing at this server.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let cluster = Cluster::new();
    if let Some(path) = &args.seed {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading seed file {}", path.display()))?;
        for obj in parse_objects(&text).with_context(|| format!("parsing seed file {}", path.display()))? {
            cluster.upsert(obj).with_context(|| format!("loading seed file {}", path.display()))?;
        }
    }
    let listener =
        tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
    let url = format!("http://{}", listener.local_addr().context("reading the bound address")?);
    if let Some(path) = &args.kubeconfig {
        write_file_atomically(path, &kubeconfig_yaml(&url))?;
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
