//! What a transparent connection carries, told from its first bytes, which
//! are read until they say it for certain: a TLS ClientHello whole (every
//! record it spans; its server name read by rustls's own parser), an HTTP/1.x
//! request head to its blank line (RFC 9112 §2.2: empty lines before the
//! request line are skipped, as the HTTP server skips them; any token is a
//! method), or something else, told as soon as one byte rules both out.
//! Bytes that could still become either are waited for, within the head
//! read timeout the caller gives and a bound in bytes: a ClientHello of at
//! most [`MAX_HELLO`] bytes, a head of at most the proxy's
//! `max_header_bytes` (a longer one goes to the HTTP server, which refuses
//! it). The bytes read are handed on, to go first to whoever serves the
//! connection. [`Scan`] is the pure part; [`sniff`] reads.

use bytes::{BufMut as _, Bytes, BytesMut};
use std::fmt;
use std::io;
use std::time::Duration;
use tokio::io::AsyncReadExt as _;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// The most bytes a ClientHello may take, its record headers included: one
/// full record. Today's largest (post-quantum key shares, many extensions)
/// take under 2 KiB.
pub const MAX_HELLO: usize = 16 * 1024;

/// The most bytes a TLS record may carry (RFC 8446 §5.1).
const MAX_RECORD: usize = 16 * 1024;

/// Empty-line bytes (CR, LF) skipped before a request line.
const MAX_EMPTY_LINES: usize = 16;

/// The longest method looked for (the registered ones have at most 17
/// characters).
const MAX_METHOD: usize = 32;

/// HTTP/2's connection preface (RFC 9113 §3.4), up to its first line.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n";

/// What the first bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum First {
    /// A whole TLS ClientHello, with its server name if it names one.
    Tls { sni: Option<String> },
    /// An HTTP/1.x request head, whole (or `max_header_bytes` of it).
    Http,
    /// Neither, or not complete in time.
    Unknown(Unknown),
}

/// Why the first bytes are neither TLS nor HTTP the proxy can check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unknown {
    /// Nothing came within the wait (a protocol whose server speaks first).
    Silent(Duration),
    /// The start of a ClientHello or of a request head, not its end, within
    /// the wait (`seen` bytes).
    Incomplete { seen: usize, wait: Duration, tls: bool },
    /// The client closed its side after `seen` bytes, before they said.
    Closed { seen: usize },
    /// Bytes that can begin neither (the first few of them).
    Other(Vec<u8>),
    /// TLS records that do not hold a ClientHello rustls reads.
    NotAHello,
    /// A ClientHello longer than [`MAX_HELLO`].
    HelloTooLarge,
    /// An SSLv2-format hello, which cannot name a server.
    Sslv2Hello,
    /// HTTP/2 with prior knowledge (cleartext), which the proxy does not carry.
    H2PriorKnowledge,
}

impl fmt::Display for Unknown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unknown::Silent(wait) => write!(
                f,
                "sent nothing within {} ms (proxy.header_read_timeout_ms)",
                wait.as_millis()
            ),
            Unknown::Incomplete { seen, wait, tls } => write!(
                f,
                "sent {seen} bytes of {} but not the rest within {} ms (proxy.header_read_timeout_ms)",
                if *tls {
                    "a TLS ClientHello"
                } else {
                    "an HTTP request head"
                },
                wait.as_millis()
            ),
            Unknown::Closed { seen } => write!(
                f,
                "closed after {seen} bytes, before a whole TLS ClientHello or HTTP/1.x request head"
            ),
            Unknown::Other(head) => {
                f.write_str("sent bytes that begin neither a TLS ClientHello nor an HTTP/1.x request (")?;
                for (i, b) in head.iter().enumerate() {
                    if i > 0 {
                        f.write_str(" ")?;
                    }
                    write!(f, "{b:02x}")?;
                }
                f.write_str(")")
            }
            Unknown::NotAHello => f.write_str("sent TLS records that hold no ClientHello the proxy can read"),
            Unknown::HelloTooLarge => write!(f, "sent a TLS ClientHello longer than {MAX_HELLO} bytes"),
            Unknown::Sslv2Hello => f.write_str("sent an SSLv2-format hello, which cannot name a server"),
            Unknown::H2PriorKnowledge => {
                f.write_str("spoke HTTP/2 with prior knowledge (h2c), which is not carried: use HTTP/1.1 or TLS")
            }
        }
    }
}

/// What [`Scan::classify`] makes of the bytes so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Known(First),
    /// Undecided until there are at least this many bytes.
    Need(usize),
}

/// Telling the first bytes apart as they come: pure, no I/O. The state
/// only spares searching a head's bytes twice for its end.
#[derive(Debug, Default)]
pub struct Scan {
    /// Bytes of an HTTP head already searched for its end.
    searched: usize,
}

impl Scan {
    /// What `bytes` (every byte so far) are, with a request head bounded by
    /// `max_head` bytes.
    pub fn classify(&mut self, bytes: &[u8], max_head: usize) -> Verdict {
        let Some(&b0) = bytes.first() else {
            return Verdict::Need(1);
        };
        if b0 == 0x16 {
            return hello(bytes);
        }
        // An SSLv2-format hello: a two-byte length with the high bit set,
        // then message type 1 (CLIENT-HELLO).
        if b0 & 0x80 != 0 {
            return match bytes.get(2) {
                None => Verdict::Need(3),
                Some(1) => Verdict::Known(First::Unknown(Unknown::Sslv2Hello)),
                Some(_) => other(bytes),
            };
        }
        self.head(bytes, max_head)
    }

    /// An HTTP/1.x request head: empty lines, a method token and a space,
    /// then everything to the blank line that ends the head.
    fn head(&mut self, bytes: &[u8], max_head: usize) -> Verdict {
        let Some(start) = bytes.iter().position(|b| !matches!(b, b'\r' | b'\n')) else {
            return if bytes.len() > MAX_EMPTY_LINES {
                other(bytes)
            } else {
                Verdict::Need(bytes.len() + 1)
            };
        };
        if start > MAX_EMPTY_LINES {
            return other(bytes);
        }
        let line = &bytes[start..];
        match line.iter().position(|b| !is_tchar(*b)) {
            None if line.len() > MAX_METHOD => return other(bytes),
            None => return Verdict::Need(bytes.len() + 1),
            Some(0) => return other(bytes),
            Some(n) if n > MAX_METHOD || line[n] != b' ' => return other(bytes),
            Some(_) => {}
        }
        if line.starts_with(b"PRI ") {
            if line.starts_with(H2_PREFACE) {
                return Verdict::Known(First::Unknown(Unknown::H2PriorKnowledge));
            }
            if H2_PREFACE.starts_with(line) {
                return Verdict::Need(start + H2_PREFACE.len());
            }
        }
        // The head ends at an empty line; lines end in CRLF or a bare LF
        // (as the HTTP server reads them). Only new bytes are searched.
        let seen = &bytes[self.searched.saturating_sub(2).max(start)..];
        let ended = seen.windows(2).any(|w| w == b"\n\n") || seen.windows(3).any(|w| w == b"\n\r\n");
        self.searched = bytes.len();
        if ended || bytes.len() >= max_head {
            return Verdict::Known(First::Http);
        }
        Verdict::Need(bytes.len() + 1)
    }
}

/// RFC 9110 §5.6.2 `tchar`: what a method token is made of.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn other(bytes: &[u8]) -> Verdict {
    Verdict::Known(First::Unknown(Unknown::Other(bytes[..bytes.len().min(8)].to_vec())))
}

/// TLS handshake records (RFC 8446 §5.1) until the ClientHello they carry
/// is whole (its length is in its first four bytes, which may themselves
/// span records), then the ClientHello read by rustls. Only whole records
/// are looked at, so a record's bytes are walked once more per record.
fn hello(bytes: &[u8]) -> Verdict {
    let not_a_hello = Verdict::Known(First::Unknown(Unknown::NotAHello));
    let mut at = 0;
    // The handshake message's header (type, 24-bit length) and how many
    // handshake bytes the records held so far.
    let mut header = [0u8; 4];
    let mut carried = 0usize;
    loop {
        let Some(record) = bytes.get(at..at + 5) else {
            return Verdict::Need(at + 5);
        };
        let len = usize::from(u16::from_be_bytes([record[3], record[4]]));
        if record[0] != 0x16 || record[1] != 3 || len == 0 || len > MAX_RECORD {
            return not_a_hello;
        }
        let end = at + 5 + len;
        if end > MAX_HELLO {
            return Verdict::Known(First::Unknown(Unknown::HelloTooLarge));
        }
        let Some(payload) = bytes.get(at + 5..end) else {
            return Verdict::Need(end);
        };
        let missing = 4usize.saturating_sub(carried);
        for (i, &b) in payload.iter().take(missing).enumerate() {
            header[carried + i] = b;
        }
        carried += payload.len();
        if carried >= 4 {
            if header[0] != 1 {
                return not_a_hello;
            }
            let whole = 4 + (usize::from(header[1]) << 16 | usize::from(header[2]) << 8 | usize::from(header[3]));
            if carried >= whole {
                return read_hello(&bytes[..end]);
            }
            if whole + 5 > MAX_HELLO {
                return Verdict::Known(First::Unknown(Unknown::HelloTooLarge));
            }
        }
        at = end;
    }
}

/// A whole ClientHello, read by rustls (the parser that would serve it).
fn read_hello(mut records: &[u8]) -> Verdict {
    let not_a_hello = Verdict::Known(First::Unknown(Unknown::NotAHello));
    let mut acceptor = rustls::server::Acceptor::default();
    while !records.is_empty() {
        match acceptor.read_tls(&mut records) {
            Ok(0) | Err(_) => return not_a_hello,
            Ok(_) => {}
        }
    }
    match acceptor.accept() {
        Ok(Some(accepted)) => Verdict::Known(First::Tls {
            sni: accepted.client_hello().server_name().map(str::to_owned),
        }),
        Ok(None) | Err(_) => not_a_hello,
    }
}

/// The first bytes of a connection and what they are.
#[derive(Debug)]
pub struct Sniffed {
    pub first: First,
    /// Every byte read from the connection: they go first to whoever
    /// serves it.
    pub bytes: Bytes,
}

/// Reads `s` until its first bytes are told apart ([`Scan`]), or `until`
/// (the head read timeout) passes, or the client stops sending. Holds at
/// most the larger of [`MAX_HELLO`] and `max_head` bytes; waits only for
/// bytes to arrive (no polling).
pub async fn sniff(s: &mut TcpStream, started: Instant, wait: Duration, max_head: usize) -> io::Result<Sniffed> {
    let bound = MAX_HELLO.max(max_head);
    let mut buf = BytesMut::new();
    let mut scan = Scan::default();
    loop {
        let need = match scan.classify(&buf, max_head) {
            Verdict::Known(first) => return Ok(done(first, buf)),
            // Cannot happen (each branch decides by its own bound), but a
            // connection that held more would be refused, never read on.
            Verdict::Need(_) if buf.len() >= bound => return Ok(done(First::Unknown(Unknown::Other(vec![])), buf)),
            Verdict::Need(n) => n,
        };
        let room = bound - buf.len();
        if buf.capacity() == buf.len() {
            buf.reserve(need.saturating_sub(buf.len()).max(2048).min(room));
        }
        let read = tokio::time::timeout_at(started + wait, s.read_buf(&mut (&mut buf).limit(room))).await;
        match read {
            Ok(Ok(0)) => {
                let seen = buf.len();
                return Ok(done(First::Unknown(Unknown::Closed { seen }), buf));
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) if buf.is_empty() => return Ok(done(First::Unknown(Unknown::Silent(wait)), buf)),
            Err(_) => {
                let (seen, tls) = (buf.len(), buf[0] == 0x16);
                return Ok(done(First::Unknown(Unknown::Incomplete { seen, wait, tls }), buf));
            }
        }
    }
}

fn done(first: First, buf: BytesMut) -> Sniffed {
    Sniffed {
        first,
        bytes: buf.freeze(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEAD: usize = 32 * 1024;

    /// What `bytes` are, from their start.
    fn classify(bytes: &[u8], max_head: usize) -> Verdict {
        Scan::default().classify(bytes, max_head)
    }

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

    /// The same ClientHello cut into records of at most `n` bytes each.
    fn in_records(hello: &[u8], n: usize) -> Vec<u8> {
        let message = &hello[5..];
        let mut out = vec![];
        for chunk in message.chunks(n) {
            out.extend_from_slice(&[0x16, 3, 1]);
            out.extend_from_slice(&(chunk.len() as u16).to_be_bytes());
            out.extend_from_slice(chunk);
        }
        out
    }

    fn known(bytes: &[u8]) -> First {
        match classify(bytes, HEAD) {
            Verdict::Known(f) => f,
            v => panic!("undecided {v:?} for {:?}", String::from_utf8_lossy(bytes)),
        }
    }

    fn unknown(bytes: &[u8]) -> Unknown {
        match known(bytes) {
            First::Unknown(u) => u,
            f => panic!("{f:?} for {:?}", String::from_utf8_lossy(bytes)),
        }
    }

    /// Every prefix of `bytes` shorter than `upto` waits for more; fed
    /// byte by byte through one scan, the answer comes at the last byte.
    fn waits_for_every_byte(bytes: &[u8], upto: usize, want: &First) {
        for n in 0..upto {
            assert!(
                matches!(classify(&bytes[..n], HEAD), Verdict::Need(m) if m > n),
                "{n} of {} bytes decided: {:?}",
                bytes.len(),
                classify(&bytes[..n], HEAD)
            );
        }
        let mut scan = Scan::default();
        for n in 0..bytes.len() {
            if let Verdict::Known(f) = scan.classify(&bytes[..=n], HEAD) {
                assert_eq!(n + 1, upto, "decided at byte {n}");
                assert_eq!(&f, want);
                return;
            }
        }
        panic!("never decided");
    }

    #[test]
    fn a_client_hello_is_waited_for_whole_however_it_comes() {
        let hello = client_hello(Some("api.example"));
        let tls = First::Tls {
            sni: Some("api.example".into()),
        };
        assert_eq!(known(&hello), tls);
        assert_eq!(known(&client_hello(None)), First::Tls { sni: None });
        // Its record header alone, and every byte short of its end, wait.
        waits_for_every_byte(&hello, hello.len(), &tls);
        // Split over many records (down to one byte of handshake each, the
        // header itself spanning records), it is read whole all the same.
        for n in [1, 2, 3, 5, 100] {
            let split = in_records(&hello, n);
            assert_eq!(known(&split), tls, "records of {n}");
            waits_for_every_byte(&split, split.len(), &tls);
        }
        // Bytes after it (early data) do not change what it is.
        let mut more = hello.clone();
        more.extend_from_slice(b"\x17\x03\x03\x00\x01x");
        assert_eq!(known(&more), tls);
    }

    #[test]
    fn tls_records_that_are_no_client_hello_are_refused() {
        let hello = client_hello(Some("api.example"));
        assert_eq!(unknown(b"\x16\x03\x01\x00\x05garbage"), Unknown::NotAHello);
        assert_eq!(unknown(b"\x16\x03\x01\x00\x00"), Unknown::NotAHello, "an empty record");
        assert_eq!(unknown(b"\x16\x02\x00\x00\x01x"), Unknown::NotAHello, "another version");
        // A record of another type before the hello is whole.
        let mut alert = in_records(&hello, 10)[..15].to_vec();
        alert.extend_from_slice(b"\x15\x03\x03\x00\x02\x02\x28");
        assert_eq!(unknown(&alert), Unknown::NotAHello);
        // A handshake message other than a ClientHello.
        let mut server_hello = hello.clone();
        server_hello[5] = 2;
        assert_eq!(unknown(&server_hello), Unknown::NotAHello);
        // Longer than a record, or a record claiming more than 16 KiB.
        assert_eq!(unknown(b"\x16\x03\x01\x40\x01"), Unknown::NotAHello);
        assert_eq!(unknown(b"\x16\x03\x01\x00\x04\x01\x00\x50\x00"), Unknown::HelloTooLarge);
        // A hello that would fit one record, sent in records of one byte
        // each, passes the bound before its end.
        let mut huge = vec![];
        for b in [1u8, 0, 0x10, 0] {
            huge.extend_from_slice(&[0x16, 3, 1, 0, 1, b]);
        }
        while huge.len() <= MAX_HELLO {
            assert!(matches!(classify(&huge, HEAD), Verdict::Need(_)));
            huge.extend_from_slice(&[0x16, 3, 1, 0, 1, 0]);
        }
        assert_eq!(unknown(&huge), Unknown::HelloTooLarge);
        // An SSLv2-format hello names no server: refused, said so.
        assert_eq!(unknown(b"\x80\x2e\x01\x03\x01\x00\x15"), Unknown::Sslv2Hello);
        assert!(matches!(classify(b"\x80\x2e", HEAD), Verdict::Need(3)));
    }

    #[test]
    fn a_request_head_is_waited_for_to_its_blank_line() {
        let get = b"GET / HTTP/1.1\r\nHost: evil.test\r\n\r\n";
        waits_for_every_byte(get, get.len(), &First::Http);
        // A method's beginning, `G` or `GE`, waits.
        assert_eq!(classify(b"G", HEAD), Verdict::Need(2));
        assert_eq!(classify(b"GE", HEAD), Verdict::Need(3));
        for head in [
            &b"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n"[..],
            b"get / HTTP/1.1\r\nHost: a\r\n\r\n",
            b"PROPFIND /d HTTP/1.1\r\nHost: a\r\n\r\n",
            b"\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
            b"GET / HTTP/1.1\nHost: a\n\n",
            b"GET / HTTP/1.0\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a\r\n\r\nbody bytes",
        ] {
            assert_eq!(known(head), First::Http, "{:?}", String::from_utf8_lossy(head));
        }
        // Whatever looks like a request line is waited for as one (the HTTP
        // server refuses what is not HTTP, and nothing is relayed).
        assert!(matches!(classify(b"HELO mail.example\r\n", HEAD), Verdict::Need(_)));
        // A head that does not end within the bound goes to the HTTP server.
        let mut long = b"GET / HTTP/1.1\r\nX: ".to_vec();
        long.resize(100, b'a');
        assert_eq!(classify(&long, 100), Verdict::Known(First::Http));
        assert_eq!(classify(&long[..99], 100), Verdict::Need(100));
    }

    #[test]
    fn bytes_that_begin_neither_are_told_at_once() {
        for (bytes, head) in [
            (&b"SSH-2.0-OpenSSH_9.6\r\n"[..], &b"SSH-2.0-"[..]),
            (b"\x00\x00\x00\x08\x04\xd2\x16\x2f", b"\x00\x00\x00\x08\x04\xd2\x16\x2f"),
            (b"\x00raw", b"\x00raw"),
            (b"GET\t/", b"GET\t/"),
            (b"*1\r\n$4\r\nPING\r\n", b"*1\r\n$4\r\n"),
            (b"\r\n\x00", b"\r\n\x00"),
        ] {
            assert_eq!(
                unknown(bytes),
                Unknown::Other(head.to_vec()),
                "{:?}",
                String::from_utf8_lossy(bytes)
            );
        }
        // A token longer than any method, or endless empty lines.
        assert!(matches!(unknown(&[b'A'; 40]), Unknown::Other(_)));
        assert!(matches!(unknown(&[b'\n'; 20]), Unknown::Other(_)));
        // HTTP/2 with prior knowledge: waited for to its first line, refused.
        let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
        waits_for_every_byte(preface, H2_PREFACE.len(), &First::Unknown(Unknown::H2PriorKnowledge));
        assert_eq!(known(b"PRI /x HTTP/1.1\r\n\r\n"), First::Http, "a method named PRI");
    }

    #[test]
    fn what_is_unknown_is_said_plainly() {
        let wait = Duration::from_millis(500);
        assert_eq!(
            Unknown::Silent(wait).to_string(),
            "sent nothing within 500 ms (proxy.header_read_timeout_ms)"
        );
        assert_eq!(
            Unknown::Incomplete {
                seen: 1,
                wait,
                tls: false
            }
            .to_string(),
            "sent 1 bytes of an HTTP request head but not the rest within 500 ms (proxy.header_read_timeout_ms)"
        );
        assert_eq!(
            Unknown::Other(b"\x00raw".to_vec()).to_string(),
            "sent bytes that begin neither a TLS ClientHello nor an HTTP/1.x request (00 72 61 77)"
        );
    }
}
