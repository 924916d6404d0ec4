//! Child processes, one stage per file: `spawner` creates them on a
//! dedicated long-lived thread, `launch` prepares what a child gets (scrubbed
//! environment, program, fds) and starts it, `capture` keeps its output, and
//! `handle` kills its whole tree and reaps it through its pidfd; `fork`
//! keeps a tool's fork server, which forks children instead.

mod capture;
mod fork;
mod handle;
mod launch;
pub mod reaper;
mod spawner;

pub use capture::{Capture, Captured};
pub use fork::ForkServer;
pub use handle::{ExitInfo, Process};
pub use launch::{child_env, child_to_parent, dev_null, launch, parent_to_child, resolve_program, Launch, Launched};
pub use spawner::Spawner;
