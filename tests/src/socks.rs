//! A SOCKS5 client for tests (RFC 1928, username/password of RFC 1929),
//! written byte by byte so tests can also send what real clients never do
//! (other commands, undefined address types, no acceptable method).

use std::net::{IpAddr, SocketAddr};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A destination as SOCKS5 carries it.
#[derive(Debug, Clone)]
pub enum Dest {
    Ip(IpAddr, u16),
    Name(String, u16),
    /// An address type of the given number, with four bytes of address.
    Undefined(u8),
}

/// What the negotiation ended with.
#[derive(Debug)]
pub enum Outcome {
    /// The server chose this method (not username/password).
    Method(u8),
    /// The username/password step answered this (non-zero) status.
    Auth(u8),
    /// The request's reply code (0 = success), with the connection.
    Reply(u8, TcpStream),
    /// The server closed the connection at this step.
    Closed(&'static str),
}

/// Negotiates `cmd` (1 = CONNECT, 2 = BIND, 3 = UDP ASSOCIATE) to `dest`
/// with `user:pass`, or offering only `methods` when given.
pub async fn negotiate(proxy: SocketAddr, auth: (&str, &str), methods: &[u8], cmd: u8, dest: &Dest) -> Outcome {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    let mut hello = vec![5, methods.len() as u8];
    hello.extend_from_slice(methods);
    s.write_all(&hello).await.unwrap();
    let mut b = [0u8; 2];
    if s.read_exact(&mut b).await.is_err() {
        return Outcome::Closed("method");
    }
    if b[1] != 2 {
        return Outcome::Method(b[1]);
    }
    let (user, pass) = auth;
    let mut up = vec![1, user.len() as u8];
    up.extend_from_slice(user.as_bytes());
    up.push(pass.len() as u8);
    up.extend_from_slice(pass.as_bytes());
    s.write_all(&up).await.unwrap();
    if s.read_exact(&mut b).await.is_err() {
        return Outcome::Closed("auth");
    }
    if b[1] != 0 {
        return Outcome::Auth(b[1]);
    }
    let mut req = vec![5, cmd, 0];
    match dest {
        Dest::Ip(IpAddr::V4(ip), port) => {
            req.push(1);
            req.extend_from_slice(&ip.octets());
            req.extend_from_slice(&port.to_be_bytes());
        }
        Dest::Ip(IpAddr::V6(ip), port) => {
            req.push(4);
            req.extend_from_slice(&ip.octets());
            req.extend_from_slice(&port.to_be_bytes());
        }
        Dest::Name(n, port) => {
            req.push(3);
            req.push(n.len() as u8);
            req.extend_from_slice(n.as_bytes());
            req.extend_from_slice(&port.to_be_bytes());
        }
        Dest::Undefined(atyp) => req.extend_from_slice(&[*atyp, 1, 2, 3, 4, 0, 80]),
    }
    s.write_all(&req).await.unwrap();
    let mut reply = [0u8; 10];
    if s.read_exact(&mut reply).await.is_err() {
        return Outcome::Closed("request");
    }
    Outcome::Reply(reply[1], s)
}

/// CONNECT with username/password; the reply code and the connection.
pub async fn connect(proxy: SocketAddr, auth: (&str, &str), dest: &Dest) -> (u8, TcpStream) {
    match negotiate(proxy, auth, &[0, 2], 1, dest).await {
        Outcome::Reply(code, s) => (code, s),
        other => panic!("SOCKS5 negotiation ended early: {other:?}"),
    }
}
