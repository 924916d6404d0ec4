//! The workspace's feature unifier, kept by `cargo hakari` (never edited by
//! hand: `cargo hakari generate` rewrites its manifest). Every member depends
//! on it, so a shared crate is built with the same features whichever
//! members a command builds, and `cargo build -p X` after a workspace build
//! compiles nothing new. It has no code. tokio and the tool SDK
//! (`egress-tool`) are left out; `.config/hakari.toml` says why.
