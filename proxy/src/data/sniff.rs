//! What a transparent connection carries, told from its first bytes, which
//! are only peeked at (they stay in the socket for whoever serves it): a
//! TLS ClientHello (with its server name, read by rustls's own parser), an
//! HTTP/1.x request line, or anything else — including nothing within the
//! wait, as protocols whose server speaks first do. At most 16 KiB are
//! looked at.

use std::io;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// The most bytes looked at (a ClientHello fits).
const MAX: usize = 16 * 1024;

/// HTTP/1.x methods a request line may start with (RFC 9110 §9, RFC 5789).
const METHODS: [&[u8]; 9] = [
    b"GET ",
    b"HEAD ",
    b"POST ",
    b"PUT ",
    b"DELETE ",
    b"OPTIONS ",
    b"PATCH ",
    b"TRACE ",
    b"CONNECT ",
];

/// What the first bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum First {
    /// A TLS ClientHello, with its server name if it names one.
    Tls { sni: Option<String> },
    /// An HTTP/1.x request line.
    Http,
    /// Anything else, or nothing within the wait.
    Other,
}

/// Tells `bytes` apart as far as they go: `None` while more are needed.
pub fn classify(bytes: &[u8]) -> Option<First> {
    let &b0 = bytes.first()?;
    if b0 == 0x16 {
        let mut acceptor = rustls::server::Acceptor::default();
        let mut rd = bytes;
        if acceptor.read_tls(&mut rd).is_err() {
            return Some(First::Other);
        }
        return match acceptor.accept() {
            Ok(Some(accepted)) => Some(First::Tls {
                sni: accepted.client_hello().server_name().map(str::to_owned),
            }),
            Ok(None) if bytes.len() < MAX => None,
            Ok(None) | Err(_) => Some(First::Other),
        };
    }
    for m in METHODS {
        if bytes.starts_with(m) {
            return Some(First::Http);
        }
        if m.starts_with(bytes) {
            // A prefix of a method: wait for the rest.
            return None;
        }
    }
    Some(First::Other)
}

/// Peeks at `s` until its first bytes are told apart, or `wait` passes.
pub async fn sniff(s: &TcpStream, wait: Duration) -> io::Result<First> {
    let until = Instant::now() + wait;
    let mut buf = vec![0u8; MAX];
    let mut seen = 0;
    loop {
        let peeked = tokio::time::timeout_at(until, s.peek(&mut buf)).await;
        let n = match peeked {
            Ok(Ok(0)) => return Ok(First::Other),
            Ok(Ok(n)) => n,
            Ok(Err(e)) => return Err(e),
            Err(_) => return Ok(First::Other),
        };
        if let Some(first) = classify(&buf[..n]) {
            return Ok(first);
        }
        if n == seen {
            // Nothing new yet: the same bytes would be peeked again at once.
            if tokio::time::timeout_at(until, tokio::time::sleep(Duration::from_millis(5)))
                .await
                .is_err()
            {
                return Ok(First::Other);
            }
        }
        seen = n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client_hello(sni: Option<&str>) -> Vec<u8> {
        let cfg =
            rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth();
        let mut cfg = cfg;
        cfg.enable_sni = sni.is_some();
        let name = rustls::pki_types::ServerName::try_from(sni.unwrap_or("x.example").to_owned()).unwrap();
        let mut c = rustls::ClientConnection::new(std::sync::Arc::new(cfg), name).unwrap();
        let mut out = vec![];
        c.write_tls(&mut out).unwrap();
        out
    }

    #[test]
    fn first_bytes_are_told_apart() {
        let hello = client_hello(Some("api.example"));
        assert_eq!(
            classify(&hello),
            Some(First::Tls {
                sni: Some("api.example".into())
            })
        );
        assert_eq!(classify(&client_hello(None)), Some(First::Tls { sni: None }));
        // A ClientHello cut short waits for the rest.
        assert_eq!(classify(&hello[..hello.len() / 2]), None);
        assert_eq!(classify(b"GET / HTTP/1.1\r\n"), Some(First::Http));
        assert_eq!(classify(b"OPTIONS * HTTP/1.1\r\n"), Some(First::Http));
        assert_eq!(classify(b"GE"), None, "a method's beginning waits");
        assert_eq!(classify(b"SSH-2.0-OpenSSH\r\n"), Some(First::Other));
        assert_eq!(classify(b"\x00\x00\x00\x08\x04\xd2\x16\x2f"), Some(First::Other));
        assert_eq!(classify(b"get / HTTP/1.1"), Some(First::Other));
        assert_eq!(classify(b"\x16\x03\x01garbage"), Some(First::Other));
        assert_eq!(classify(b""), None);
    }
}
