//! HTTP/2 settings shared by both ends of an HBONE connection (ztunnel's values).

/// Per-stream receive window: 4 MiB.
pub const STREAM_WINDOW: u32 = 4 * 1024 * 1024;
/// Per-connection receive window: 16 MiB.
pub const CONNECTION_WINDOW: u32 = 16 * 1024 * 1024;
/// Largest frame we accept: 1 MiB.
pub const MAX_FRAME_SIZE: u32 = 1024 * 1024;

/// A client builder with the HBONE settings applied.
pub(crate) fn client() -> h2::client::Builder {
    let mut b = h2::client::Builder::new();
    b.initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME_SIZE)
        .enable_push(false);
    b
}

/// A server builder with the HBONE settings applied.
pub(crate) fn server() -> h2::server::Builder {
    let mut b = h2::server::Builder::new();
    b.initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME_SIZE);
    b
}
