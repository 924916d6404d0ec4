//! A raw HTTP/1.1 client for tests: writes exactly the bytes a test gives,
//! reads one response (Content-Length, chunked, or to EOF), and exposes
//! status, headers and body. CONNECT helpers keep the stream for tunnelling.

use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Debug, Clone)]
pub struct RawResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn deny_reason(&self) -> Option<&str> {
        self.header("x-egress-deny-reason")
    }
}

/// Finds the end of a response head in `buf`.
fn head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4)
}

fn parse_head(head: &[u8]) -> (u16, Vec<(String, String)>) {
    let text = String::from_utf8_lossy(head);
    let mut lines = text.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    (status, headers)
}

fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = vec![];
    loop {
        let line_end = b.windows(2).position(|w| w == b"\r\n")?;
        let size = usize::from_str_radix(String::from_utf8_lossy(&b[..line_end]).split(';').next()?.trim(), 16).ok()?;
        b = &b[line_end + 2..];
        if size == 0 {
            return Some(out);
        }
        if b.len() < size + 2 {
            return None;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// One whole response already read (to the connection's end): status,
/// headers, and the body as framed (de-chunked when chunked and whole, cut
/// at `Content-Length`, else every byte after the head); `None` without a
/// head.
pub fn parse(bytes: &[u8]) -> Option<RawResponse> {
    let end = head_end(bytes)?;
    let (status, headers) = parse_head(&bytes[..end]);
    let rest = &bytes[end..];
    let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let body = if get("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        dechunk(rest).unwrap_or_else(|| rest.to_vec())
    } else if let Some(cl) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
        rest[..cl.min(rest.len())].to_vec()
    } else {
        rest.to_vec()
    };
    Some(RawResponse { status, headers, body })
}

/// Reads one response from `s`; for a response to CONNECT (`head_only`), stops after the head.
pub async fn read_response(s: &mut TcpStream, head_only: bool) -> std::io::Result<RawResponse> {
    let mut buf = Vec::with_capacity(4096);
    let mut tmp = [0u8; 8192];
    loop {
        if let Some(end) = head_end(&buf) {
            let (status, headers) = parse_head(&buf[..end]);
            let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
            let body_start = end;
            if head_only || status == 204 || status == 304 {
                return Ok(RawResponse {
                    status,
                    headers,
                    body: buf[body_start..].to_vec(),
                });
            }
            if let Some(cl) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
                while buf.len() < body_start + cl {
                    let n = s.read(&mut tmp).await?;
                    if n == 0 {
                        break;
                    }
                    buf.extend_from_slice(&tmp[..n]);
                }
                let body = buf[body_start..buf.len().min(body_start + cl)].to_vec();
                return Ok(RawResponse { status, headers, body });
            }
            if get("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
                loop {
                    if let Some(body) = dechunk(&buf[body_start..]) {
                        return Ok(RawResponse { status, headers, body });
                    }
                    let n = s.read(&mut tmp).await?;
                    if n == 0 {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "chunked body cut",
                        ));
                    }
                    buf.extend_from_slice(&tmp[..n]);
                }
            }
            loop {
                let n = s.read(&mut tmp).await?;
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&tmp[..n]);
            }
            return Ok(RawResponse {
                status,
                headers,
                body: buf[body_start..].to_vec(),
            });
        }
        let n = s.read(&mut tmp).await?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "connection closed before a response head",
            ));
        }
        buf.extend_from_slice(&tmp[..n]);
    }
}

/// Sends raw bytes on a new connection and reads one response (10 s cap).
pub async fn send(addr: SocketAddr, raw: &[u8]) -> RawResponse {
    send_within(addr, raw, Duration::from_secs(10)).await
}

/// [`send`] with another cap (a control call to a proxy under callgrind
/// on a loaded machine can take longer than 10 s the first time).
pub async fn send_within(addr: SocketAddr, raw: &[u8], cap: Duration) -> RawResponse {
    let fut = async {
        let mut s = TcpStream::connect(addr).await?;
        s.write_all(raw).await?;
        let head_only = raw.starts_with(b"CONNECT ");
        read_response(&mut s, head_only).await
    };
    match tokio::time::timeout(cap, fut).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => panic!("request failed: {e}"),
        Err(_) => panic!("no response within {cap:?}"),
    }
}

/// Opens a CONNECT tunnel: returns the response and the stream.
pub async fn connect(proxy: SocketAddr, target: &str, auth: Option<&str>) -> (RawResponse, TcpStream) {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    let mut req = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n");
    if let Some(a) = auth {
        req.push_str(&format!("Proxy-Authorization: {a}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(10), read_response(&mut s, true))
        .await
        .unwrap()
        .unwrap();
    (r, s)
}

/// Writes `data` into a tunnel and reads back the same number of bytes.
pub async fn echo_through(s: &mut TcpStream, data: &[u8]) -> Vec<u8> {
    s.write_all(data).await.unwrap();
    let mut out = vec![0u8; data.len()];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut out))
        .await
        .unwrap()
        .unwrap();
    out
}

/// Waits until the peer closes `s` (EOF or reset); returns how long it took, capped.
pub async fn wait_closed(s: &mut TcpStream, cap: Duration) -> Option<Duration> {
    let t0 = std::time::Instant::now();
    let mut buf = [0u8; 1024];
    let r = tokio::time::timeout(cap, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    r.ok().map(|_| t0.elapsed())
}
