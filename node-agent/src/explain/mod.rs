//! `node-agent explain`: why a pod is or is not in the mesh, in one answer. The agent builds the report
//! ([`build`]) from what it holds and reads on demand, and serves it as JSON on its localhost admin port
//! ([`crate::admin`]); the `explain` subcommand ([`cli`]) asks for it and prints it ([`render`]) or its JSON.

pub mod build;
pub mod cli;
pub mod listeners;
pub mod render;
pub mod report;
