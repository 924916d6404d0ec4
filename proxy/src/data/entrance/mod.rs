//! The entrances of the data plane: each parses what arrives (a forward or
//! CONNECT request, a request inside interception, an HTTP/2 stream, a
//! WebSocket handshake, SOCKS5, a transparent connection, a sandbox DNS
//! query, a handed-over listener) into the canonical target and request
//! facts, calls [`decide`](super::decide) and carries the answer with `carry`.

pub(crate) mod dns;
pub(crate) mod h2;
pub(crate) mod handoff;
pub(crate) mod http;
pub(crate) mod intercept;
pub(crate) mod socks;
pub(crate) mod transparent;
pub(crate) mod websocket;
