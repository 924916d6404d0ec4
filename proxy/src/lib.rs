//! Loom Egress proxy: a per-run authenticated HTTP/CONNECT forward proxy
//! that applies a static per-tool allowlist, rejects IP literals, resolves
//! once and dials the pinned address, bounds every fetch by a deadline and
//! per-run concurrency slots, records every denial as a fact before it
//! answers, and exports Prometheus metrics. The decision path is in the README
//! ("How one fetch is decided") and in `fetch.rs`.
#![forbid(unsafe_code)]

pub mod admission;
pub mod api;
pub mod auth;
pub mod body;
pub mod control;
pub mod deny;
pub mod dns;
pub mod facts;
pub mod fetch;
pub mod finish;
pub mod handoff;
pub mod metrics;
pub mod owners;
pub mod policy;
pub mod reload;
pub mod runs;
pub mod server;
pub mod slots;
pub mod sse;
pub mod store;
pub mod target;
pub mod time;
pub mod tls;
pub mod token;
pub mod tunnel;
pub mod upstream;

pub use server::{start, Handle, Options, Shared, StartError};
