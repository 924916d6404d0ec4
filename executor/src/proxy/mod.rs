//! Where the executor talks to the proxy: the client of its control API
//! (`control`), whether confined children can be bound to their runs
//! (`binding`), the hand-off of a child's in-namespace listener (`handoff`)
//! to a socket that passed `socket`'s checks, and the relay that carries its
//! connections instead (`relay`). `binding` → `handoff` → `socket`, one way.

pub mod binding;
pub mod control;
pub mod handoff;
pub mod relay;
pub mod socket;
pub mod url;
