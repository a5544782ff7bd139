//! HTTP/2 settings shared by both ends of an HBONE connection (ztunnel's values), and the server's limits on what
//! one client may make it hold.

/// Per-stream receive window: 4 MiB.
///
/// Reviewed against the memory budget (#33): the windows bound what is in flight on one stream and one connection
/// (throughput needs them across a real network), the budget ([`crate::budget`]) what a pod and the node hold.
/// A pod's default share (16 MiB) is four stream windows, so one bulk transfer never waits on the budget; a
/// connection that fills its pod's share stops being read, so its window is never all held by the proxy.
pub const STREAM_WINDOW: u32 = 4 * 1024 * 1024;
/// Per-connection receive window: 16 MiB.
pub const CONNECTION_WINDOW: u32 = 16 * 1024 * 1024;
/// Largest frame we accept: 1 MiB.
pub const MAX_FRAME_SIZE: u32 = 1024 * 1024;
/// Streams a client may have open at once on one connection (`SETTINGS_MAX_CONCURRENT_STREAMS`), as ztunnel
/// advertises. Streams over it are refused with `RST_STREAM(REFUSED_STREAM)`.
pub const MAX_CONCURRENT_STREAMS: u32 = 100;
/// Largest header list either end accepts (`SETTINGS_MAX_HEADER_LIST_SIZE`): 16 KiB. A CONNECT carries a few
/// short headers (`forwarded`, `baggage`, `traceparent`); a longer list is answered 431 and its stream reset, and
/// a header block too long even to skip ends the connection (GOAWAY).
pub const MAX_HEADER_LIST_SIZE: u32 = 16 * 1024;
/// Streams the client reset while they wait to be accepted by the server, at most at once (h2's default, made
/// explicit): one more ends the connection with GOAWAY(ENHANCE_YOUR_CALM) (the "rapid reset" attack).
pub const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 20;
/// Streams the server may reset because of the client's errors (malformed or oversized requests, streams over
/// the concurrency limit) over one connection's life; one more ends it with GOAWAY(ENHANCE_YOUR_CALM). Above
/// the 900 refusals a client may legitimately cause by opening 1,000 streams before our SETTINGS reached it.
pub const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1024;

/// A client builder with the HBONE settings applied.
pub(crate) fn client() -> h2::client::Builder {
    let mut b = h2::client::Builder::new();
    b.initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME_SIZE)
        .max_header_list_size(MAX_HEADER_LIST_SIZE)
        .max_send_buffer_size(crate::budget::MAX_SEND_BUFFER)
        .enable_push(false);
    b
}

/// A server builder with the HBONE settings and limits applied.
pub(crate) fn server() -> h2::server::Builder {
    let mut b = h2::server::Builder::new();
    b.initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME_SIZE)
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .max_header_list_size(MAX_HEADER_LIST_SIZE)
        .max_send_buffer_size(crate::budget::MAX_SEND_BUFFER)
        .max_pending_accept_reset_streams(MAX_PENDING_ACCEPT_RESET_STREAMS)
        .max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESET_STREAMS));
    b
}
