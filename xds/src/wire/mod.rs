//! Protobuf messages of the xDS conversation with istiod, written by hand with prost derives (no protoc needed).
//!
//! Guarantees: every message's field numbers follow the published definitions (Envoy's
//! `envoy.service.discovery.v3`/`envoy.config.core.v3`, `google.protobuf`, `google.rpc`, Istio's
//! `pkg/workloadapi/workload.proto` and `pkg/workloadapi/security/authorization.proto`); the unit tests pin the wire
//! bytes of each. Enumerations are carried as `i32`, as prost does, and checked by [`resource`] before a resource
//! is handed on, so an unknown value is a per-resource rejection, never a panic. Only the fields istiod sends (or
//! a client sends) are modelled; unknown fields are skipped by prost's decoder.

pub mod envoy;
pub mod resource;
pub mod scan;
pub mod security;
pub mod workload;

pub use envoy::{Any, DeltaDiscoveryRequest, DeltaDiscoveryResponse, ListValue, Node, Resource, Status, Struct, Value};
pub use resource::{decode_resource, DecodedResource, ResourceError, ResourceType};
