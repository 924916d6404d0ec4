//! Loom Egress executor: runs tools as single-use warm children bound to
//! proxy runs, speaks the child protocol, enforces the cold-start and timeout
//! clocks, and guarantees that a killed child leaves no process behind.
//! See `docs/executor.md` for the lifecycle and `docs/protocol.md` for the wire.

pub mod api;
pub mod config;
pub mod confine;
pub mod error;
pub mod invoke;
pub mod kill;
pub mod metrics;
pub mod pool;
pub mod process;
pub mod proxy;
mod sys;

/// The Rust tool SDK, re-exported under its former path.
pub use egress_tool as tool;

pub use config::Config;
pub use error::{ErrorKind, InvocationResult, InvokeError, Phase};
pub use invoke::dispatch::{Answer, InvocationRequest};
pub use invoke::Executor;
pub use sys::release_large_allocations;
