//! The fleet's one shared data store, PostgreSQL, as both services use it:
//! the connection (DSN from the environment only, TLS through rustls), the
//! schema (the exported facts and the fleet's idempotency claims), and the
//! claims themselves. Never on an egress decision path: the proxy exports
//! facts after committing them locally; the executor claims a keyed
//! invocation before running it.

pub mod claims;
pub mod pg;

pub use claims::{Claim, Claims};
pub use pg::{migration, PgError};
