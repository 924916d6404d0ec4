//! Loom Egress proxy: a per-run authenticated HTTP/CONNECT forward proxy
//! that applies a static per-tool allowlist, rejects IP literals, resolves
//! once and dials the pinned address, bounds every fetch by a deadline and
//! per-run concurrency slots, records every denial as a fact before it
//! answers, and exports Prometheus metrics.
//!
//! The code is laid out by plane (`docs/architecture.md` walks it):
//! - `data/`: the decision path of one fetch (`data::entrance::http`, one function
//!   per step) and what its steps use;
//! - `control/`: the kernels' API (runs, facts, decisions, owners, policy,
//!   SSE, reload, suggestion, replay);
//! - `facts/`: the fact type, the [`FactSink`], the SQLite store and the
//!   decision log (allowed fetches, off the answer path);
//! - `learn/`: what recorded traffic says about a policy (`policy suggest`,
//!   `policy replay`), pure functions over the records;
//! - `runs/`: the run registry, owners' leases, per-run slots and idle
//!   upstream connections;
//! - `state` (the shared state, no listener), `listener` (accept, admission,
//!   optional TLS, graceful close for both listeners), `server` (start and stop),
//!   `deny` (the outcome table), `metrics`, `ca` (the appliance CA of
//!   intercepted CONNECTs).
#![forbid(unsafe_code)]

mod addrs;
mod admission;
mod ca;
mod control;
mod creds;
mod data;
mod deny;
mod dns;
pub mod facts;
pub mod learn;
mod listener;
mod metrics;
mod runs;
mod server;
mod state;
mod time;

pub use ca::{ca_dir, rotate as rotate_ca, CaError};
pub use control::client as control_client;
pub use control::openapi;
pub use control::reload;
pub use control::token::{add_principal, token_path, TokenSource};
pub use creds::describe as describe_secret_source;
pub use facts::{Fact, FactError, FactQuery, FactSink, MemorySink, Recorded};
pub use server::{start, Handle, Options, StartError};
pub use state::Shared;
