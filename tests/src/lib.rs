//! Shared test support for Loom Egress: a fake DNS server on loopback with a
//! query log, loopback origins (HTTP, TCP echo, connection-counting canary,
//! black hole, and one that answers exactly the bytes or HTTP/2 frames a
//! test gives), a proxy harness that starts a real proxy on `127.0.0.1:0`,
//! a raw HTTP/1.1 client and a SOCKS5 one, a tool's side of an
//! intercepted tunnel (HTTP/1.1 or HTTP/2 inside), counting unix-socket canaries,
//! a fast origin (and the tool's TLS and HTTP/2 clients) for byte-budget
//! and slot tests,
//! and a helper that re-runs a test inside a network namespace holding only
//! `lo`, the `websockets` origin of the WebSocket tests, a throwaway PostgreSQL and a
//! fleet's network of namespaces on two bridges; for the executor's tests, a fake control API speaking the real wire
//! types, a fake hand-off socket, process, config and executor helpers, the real proxy beside an executor, and the confined MCP servers' config. One crate
//! of test support for both products. Tests never use the machine's resolver.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod aws;
pub mod credentials;
pub mod dns;
pub mod executor;
pub mod fake_control;
pub mod fake_handoff;
pub mod fleet_net;
pub mod flood;
pub mod h2_origin;
pub mod harness;
pub mod inside;
pub mod mcp;
pub mod netns;
pub mod oauth2;
pub mod openapi;
pub mod origin;
pub mod pki;
pub mod postgres;
pub mod process;
pub mod raw;
pub mod raw_origin;
pub mod socks;
pub mod stack;
pub mod tls_origin;
pub mod unix_canary;
pub mod websocket;

pub use dns::FakeDns;
pub use fake_control::FakeControl;
pub use harness::{TestProxy, TestRun};
pub use raw::{send, RawResponse};
