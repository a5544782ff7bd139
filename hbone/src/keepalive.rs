//! HTTP/2 PING keepalive: a connection whose peer stops answering is dropped instead of hanging forever.

use std::time::Duration;

use h2::{Ping, PingPong};

/// How often to PING and how long to wait for the PONG.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    /// Pause between a PONG and the next PING.
    pub interval: Duration,
    /// How long a PING may go unanswered before the connection is dropped.
    pub timeout: Duration,
}

impl Default for Keepalive {
    /// ztunnel's values: PING every 10 s, give up after 20 s of silence.
    fn default() -> Self {
        Keepalive { interval: Duration::from_secs(10), timeout: Duration::from_secs(20) }
    }
}

/// Pings until the peer fails to answer in time (returns) or the connection is gone (never returns).
pub(crate) async fn until_unresponsive(ping_pong: Option<PingPong>, keepalive: Keepalive) {
    let Some(mut ping_pong) = ping_pong else {
        return std::future::pending().await;
    };
    loop {
        tokio::time::sleep(keepalive.interval).await;
        match tokio::time::timeout(keepalive.timeout, ping_pong.ping(Ping::opaque())).await {
            Ok(Ok(_pong)) => continue,
            // The connection ended; its own future reports why.
            Ok(Err(_)) => return std::future::pending().await,
            Err(_) => return,
        }
    }
}
