//! The floor of the tunnel figures: a minimal CONNECT relay written for the
//! benchmark, run like egress-proxy (tokio's multi-threaded runtime, one
//! task per connection, `TCP_NODELAY` both ways). It accepts, reads the
//! head, connects to the `ip:port` it names, answers `200`, and copies both
//! ways until either side closes. No authentication, no policy, no DNS, no
//! facts, no metrics, no deadlines: what is left is the kernel's work and
//! the runtime's, which egress-proxy's cost per tunnel is compared with.
//!
//! `bare-relay LISTEN` (e.g. `127.0.0.1:0`); prints `listening ADDR`.

use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let listen: SocketAddr = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| std::io::Error::other("usage: bare-relay LISTEN_ADDR"))?;
    let l = TcpListener::bind(listen).await?;
    println!("listening {}", l.local_addr()?);
    loop {
        let (s, _) = l.accept().await?;
        tokio::spawn(async move {
            let _ = relay(s).await;
        });
    }
}

async fn relay(mut client: TcpStream) -> std::io::Result<()> {
    client.set_nodelay(true)?;
    let mut head = [0u8; 4096];
    let mut n = 0;
    let end = loop {
        let r = client.read(&mut head[n..]).await?;
        if r == 0 {
            return Ok(());
        }
        n += r;
        if let Some(i) = head[..n].windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if n == head.len() {
            return client.write_all(b"HTTP/1.1 431 Too Large\r\n\r\n").await;
        }
    };
    let line = std::str::from_utf8(&head[..end]).unwrap_or("");
    let dest = match line.split_whitespace().collect::<Vec<_>>()[..] {
        ["CONNECT", authority, ..] => authority.parse::<SocketAddr>().ok(),
        _ => None,
    };
    let Some(dest) = dest else {
        return client.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
    };
    let mut origin = match TcpStream::connect(dest).await {
        Ok(o) => o,
        Err(_) => return client.write_all(b"HTTP/1.1 502 Bad Gateway\r\n\r\n").await,
    };
    origin.set_nodelay(true)?;
    client.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").await?;
    if n > end {
        origin.write_all(&head[end..n]).await?;
    }
    tokio::io::copy_bidirectional(&mut client, &mut origin).await?;
    Ok(())
}
