//! Child processes, one stage per file: `spawner` creates them on a
//! long-lived thread, `launch` gives a child its scrubbed environment,
//! program and fds and starts it, `capture` keeps its output, `handle` kills
//! its whole tree and reaps it; `fork` keeps a tool's fork server, which
//! forks children instead, and `reaper` catches descendants that escape;
//! `identity` hashes what a child runs before it starts.

mod capture;
mod fork;
mod handle;
pub mod identity;
mod launch;
pub mod reaper;
mod spawner;

pub use capture::{Capture, Captured};
pub use fork::ForkServer;
pub use handle::{ExitInfo, Process};
pub use launch::{child_env, child_to_parent, dev_null, launch, parent_to_child, resolve_program, Launch, Launched};
pub use spawner::Spawner;
