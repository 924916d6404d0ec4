//! The entrances of the data plane: each parses what arrives (a forward or
//! CONNECT request, a request inside interception, an HTTP/2 stream, SOCKS5,
//! a transparent connection, a sandbox DNS query, a handed-over listener)
//! into the canonical target and request facts, calls
//! [`decide`](super::decide) and carries the answer with `carry`. A
//! WebSocket comes in as an HTTP request of the forward or intercepting
//! entrance; only how its frames are carried is its own (`carry::websocket`).

pub(crate) mod dns;
pub(crate) mod h2;
pub(crate) mod handoff;
pub(crate) mod http;
pub(crate) mod intercept;
pub(crate) mod mcp;
pub(crate) mod socks;
pub(crate) mod transparent;
