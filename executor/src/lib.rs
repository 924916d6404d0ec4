//! Loom Egress executor: runs tools as single-use warm children bound to
//! proxy runs, and MCP servers as session children. One room per stage,
//! imports one way (`tests/arch/imports.py` checks it): `api` → `invoke` →
//! `session` → `pool` → `process` / `proxy` → `confine` →
//! the leaves every stage shares, `metrics` → `kill` → `error`, `config`, and
//! `sys` (all the `unsafe`). `docs/architecture.md` draws it.

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
pub mod session;
mod sys;

/// The Rust tool SDK, re-exported under its former path.
pub use egress_tool as tool;

pub use config::Config;
pub use error::{ErrorKind, InvocationResult, InvokeError, Phase};
pub use invoke::dispatch::{Answer, InvocationRequest};
pub use invoke::Executor;
pub use sys::release_large_allocations;
