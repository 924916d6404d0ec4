//! Where the executor talks to the proxy: the client of its control API
//! (`control`), whether confined children can be bound to their runs
//! (`binding`), the hand-off of a child's listener (`handoff`) to a socket
//! that passed `socket`'s checks (one way: binding → handoff → socket), the
//! relay that carries its connections instead (`relay`), the run's URL (`url`).

pub mod binding;
pub mod control;
pub mod handoff;
pub mod relay;
pub mod socket;
pub mod url;
