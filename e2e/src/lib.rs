//! Scenarios that run several binaries of the node together live in `tests/`; this crate has no code of its own.
