//! The xDS client of the node proxy: it takes workloads, services and authorization policies from istiod over
//! Delta ADS, as Istio's ztunnel does.
//!
//! * [`wire`]: the protobuf messages (hand-written prost derives, byte-pinned) and the bounded, validating
//!   decoder of one resource;
//! * [`grpc`]: gRPC message framing and status codes, no I/O;
//! * [`resolve`]: istiod's host name resolved as resolv.conf says (the static image has no NSS);
//! * [`channel`]: TLS + HTTP/2 to istiod with its authentication headers, shared with the CA client;
//! * [`ads`]: the Delta ADS stream: subscriptions, ACK/NACK, held versions, reconnect and backoff, readiness;
//! * [`settings`]: ztunnel's environment variables resolved into a channel configuration and a node;
//! * `testing` (feature `testing`): a scripted fake istiod for tests.
//!
//! Every message from the control plane is treated as hostile: sizes are bounded before allocation, each resource
//! is validated before it reaches the consumer, and nothing in the crate panics on input.
//!
//! Everything but [`wire`] and [`grpc`] needs the default `runtime` feature; without it the crate is what the fuzz
//! targets build.

#![warn(missing_docs)]

#[cfg(feature = "runtime")]
pub mod ads;
#[cfg(feature = "runtime")]
pub mod channel;
pub mod grpc;
#[cfg(feature = "runtime")]
pub mod resolve;
#[cfg(feature = "runtime")]
pub mod settings;
#[cfg(feature = "testing")]
pub mod testing;
pub mod wire;
