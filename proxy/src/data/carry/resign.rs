//! AWS SigV4 re-signing of a request to the host of a signing credential
//! (`sign = { aws_sigv4 }`), inside interception. The decision step
//! ([`policy::credentials`](crate::data::decide::policy::credentials))
//! has already refused every form this module does not sign; here the
//! tool's `Authorization`, `X-Amz-Date` and `X-Amz-Security-Token` are
//! removed and the request is signed with the credential's real keys:
//!
//! - the headers the tool signed (those still present), with `host`, every
//!   `x-amz-*`, `content-type` and `content-md5`;
//! - the payload hash the tool named in `x-amz-content-sha256` (a hex
//!   SHA-256, which the origin checks against the body, or
//!   `UNSIGNED-PAYLOAD` / `STREAMING-UNSIGNED-PAYLOAD-TRAILER`), the body
//!   passing untouched; without one, the body is read whole (at most
//!   `max_body_bytes`) and hashed;
//! - a streaming upload whose chunks are signed
//!   (`STREAMING-AWS4-HMAC-SHA256-PAYLOAD`): each chunk is read whole (at
//!   most `max_body_bytes`) and its signature written again, chained from
//!   the new seed signature. A signature has a fixed length, so the body's
//!   length does not change.

use crate::creds::sigv4::{self, Keys, Request as SignRequest, Scope};
use crate::data::decide::policy::SIGNED_CHUNKS;
use bytes::{Buf, Bytes, BytesMut};
use egress_config::sign::AwsSigV4;
use egress_config::Credential;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::Method;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, SizeHint};
use sha2::{Digest, Sha256};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::SystemTime;
use tokio::time::Instant;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The headers never signed again from the tool's list: the signer's own,
/// and those the proxy or a hop may change.
const NOT_SIGNED: [&str; 7] = [
    "authorization",
    "x-amz-date",
    "x-amz-security-token",
    "connection",
    "transfer-encoding",
    "expect",
    "proxy-authorization",
];

/// Why a request could not be signed after its decision: its body.
#[derive(Debug, thiserror::Error)]
pub enum ResignError {
    #[error("its body is larger than max_body_bytes ({0}) and names no payload hash to sign with; send x-amz-content-sha256 (a hex SHA-256, or UNSIGNED-PAYLOAD where the service takes it)")]
    BodyTooLarge(u64),
    #[error("its body could not be read before the fetch deadline")]
    Timeout,
    #[error("its body could not be read: {0}")]
    Read(String),
}

/// The body as it goes to the origin.
pub enum Resigned<B> {
    /// Untouched.
    Pass(B),
    /// Read whole to hash it.
    Whole(Option<Bytes>),
    /// A streaming upload whose chunks are signed again.
    Chunks(Box<Chunks<B>>),
}

/// Signs `headers` with `cred`'s keys (`sign`), for a request of `method`
/// to `pq`, and returns the body to send: read whole when its hash is
/// needed (`read_by` bounds the read), its chunks signed again when the
/// tool signed them.
pub async fn sign<B>(
    cred: &Credential,
    sign: &AwsSigV4,
    method: &Method,
    headers: &mut HeaderMap,
    pq: &PathAndQuery,
    body: B,
    read_by: Instant,
) -> Result<Resigned<B>, ResignError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    // The tool's signed headers: signed again where they are still present.
    let tool_signed: Vec<String> = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(sigv4::parse_authorization)
        .map(|p| p.signed_headers)
        .unwrap_or_default();
    for h in ["authorization", "x-amz-date", "x-amz-security-token"] {
        headers.remove(h);
    }
    let named = headers
        .get("x-amz-content-sha256")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut body = Some(body);
    let (hash, whole) = match named {
        Some(h) => (h, None),
        None => {
            let whole = match body.take() {
                Some(b) => read_whole(b, sign.max_body_bytes, read_by).await?,
                None => Bytes::new(),
            };
            let hash = hex(&Sha256::digest(&whole));
            // S3 wants the hash it checks in a header of its own.
            if sign.service == "s3" {
                if let Ok(v) = HeaderValue::from_str(&hash) {
                    headers.insert(HeaderName::from_static("x-amz-content-sha256"), v);
                }
            }
            (hash, Some(whole))
        }
    };
    let also: Vec<&str> = tool_signed
        .iter()
        .map(String::as_str)
        .filter(|n| !NOT_SIGNED.contains(n) && headers.contains_key(*n))
        .collect();
    let pairs: Vec<(&str, &str)> = headers
        .iter()
        .filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?)))
        .collect();
    let token = cred_token(sign);
    let keys = Keys {
        access_key_id: sign.key_id.expose(),
        secret_access_key: cred.secret.expose(),
        session_token: token,
    };
    let scope = Scope {
        region: &sign.region,
        service: &sign.service,
    };
    let req = SignRequest {
        method: method.as_str(),
        path: pq.path(),
        query: pq.query().unwrap_or(""),
        headers: &pairs,
        payload_hash: &hash,
        also_sign: &also,
    };
    let signed = sigv4::sign(&req, &keys, &scope, SystemTime::now());
    set(headers, "authorization", &signed.authorization);
    set(headers, "x-amz-date", &signed.amz_date);
    if let Some(t) = &signed.security_token {
        set(headers, "x-amz-security-token", t);
    }
    Ok(match (whole, body) {
        (None, Some(b)) if hash == SIGNED_CHUNKS => Resigned::Chunks(Box::new(Chunks::new(
            b,
            signed,
            usize::try_from(sign.max_body_bytes).unwrap_or(usize::MAX),
        ))),
        (None, Some(b)) => Resigned::Pass(b),
        (whole, _) => Resigned::Whole(whole),
    })
}

fn cred_token(sign: &AwsSigV4) -> Option<&str> {
    Some(sign.token.expose()).filter(|t| !t.is_empty())
}

fn set(headers: &mut HeaderMap, name: &'static str, value: &str) {
    if let Ok(mut v) = HeaderValue::from_str(value) {
        v.set_sensitive(true);
        headers.insert(HeaderName::from_static(name), v);
    }
}

/// The body whole, if it is at most `max` bytes and arrives by `read_by`.
/// A larger one is read on and dropped (up to [`DRAIN_BYTES`], for at most
/// [`DRAIN_TIME`]) before the refusal, so that a client still sending it
/// reads the answer instead of a reset connection.
async fn read_whole<B>(mut body: B, max: u64, read_by: Instant) -> Result<Bytes, ResignError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let max = usize::try_from(max).unwrap_or(usize::MAX);
    let over = usize::try_from(body.size_hint().lower()).unwrap_or(usize::MAX) > max;
    let mut whole = BytesMut::new();
    let read = async {
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| ResignError::Read(e.into().to_string()))?;
            if let Ok(d) = frame.into_data() {
                if whole.len() + d.len() > max {
                    return Err(ResignError::BodyTooLarge(max as u64));
                }
                whole.extend_from_slice(&d);
            }
        }
        Ok(())
    };
    let r = if over {
        Err(ResignError::BodyTooLarge(max as u64))
    } else {
        match tokio::time::timeout_at(read_by, read).await {
            Err(_) => Err(ResignError::Timeout),
            Ok(r) => r,
        }
    };
    if let Err(ResignError::BodyTooLarge(_)) = &r {
        crate::data::carry::body::drain(&mut body, DRAIN_BYTES, DRAIN_TIME).await;
    }
    r.map(|()| whole.freeze())
}

/// What [`read_whole`] reads on of a body too large to hash, at most.
const DRAIN_BYTES: usize = 16 << 20;
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(1);

fn hex(b: &[u8]) -> String {
    use std::fmt::Write;
    b.iter().fold(String::with_capacity(b.len() * 2), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

impl<B> Body for Resigned<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            Resigned::Pass(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
            Resigned::Whole(w) => Poll::Ready(w.take().map(|b| Ok(Frame::data(b)))),
            Resigned::Chunks(c) => Pin::new(&mut **c).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Resigned::Pass(b) => b.is_end_stream(),
            Resigned::Whole(w) => w.is_none(),
            Resigned::Chunks(c) => c.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Resigned::Pass(b) => b.size_hint(),
            Resigned::Whole(w) => SizeHint::with_exact(w.as_ref().map_or(0, |b| b.len() as u64)),
            Resigned::Chunks(c) => c.inner.size_hint(),
        }
    }
}

/// The longest chunk header line (`<hex size>;chunk-signature=<64 hex>`).
const MAX_CHUNK_LINE: usize = 256;

/// An `aws-chunked` upload whose chunk signatures are written again, each
/// chained from the one before it, the first from the request's new
/// signature.
pub struct Chunks<B> {
    inner: B,
    /// Read and not yet passed on: at most one chunk and its header.
    buf: BytesMut,
    /// Chunks signed again, ready to pass on as one frame.
    out: BytesMut,
    signing_key: [u8; 32],
    amz_date: String,
    scope: String,
    previous: String,
    max_chunk: usize,
    /// The final (empty) chunk has been written.
    done: bool,
    /// The tool's body has ended.
    ended: bool,
}

/// A malformed or oversized `aws-chunked` upload: the upload is cut.
#[derive(Debug, thiserror::Error)]
#[error("aws-chunked upload: {0}")]
pub struct ChunkError(String);

impl<B> Chunks<B> {
    fn new(inner: B, signed: sigv4::Signed, max_chunk: usize) -> Chunks<B> {
        Chunks {
            inner,
            buf: BytesMut::new(),
            out: BytesMut::new(),
            signing_key: signed.signing_key,
            amz_date: signed.amz_date,
            scope: signed.scope,
            previous: signed.signature,
            max_chunk,
            done: false,
            ended: false,
        }
    }

    /// Takes one whole chunk off `buf` into `out`, signed again; `Ok(false)`
    /// when `buf` holds no whole chunk yet.
    fn next_chunk(&mut self) -> Result<bool, ChunkError> {
        let Some(eol) = self.buf.windows(2).take(MAX_CHUNK_LINE).position(|w| w == b"\r\n") else {
            if self.buf.len() >= MAX_CHUNK_LINE {
                return Err(ChunkError("a chunk header longer than 256 bytes".into()));
            }
            return Ok(false);
        };
        let line =
            std::str::from_utf8(&self.buf[..eol]).map_err(|_| ChunkError("a chunk header that is not text".into()))?;
        let (size_hex, ext) = line
            .split_once(';')
            .ok_or_else(|| ChunkError("a chunk header without chunk-signature".into()))?;
        ext.strip_prefix("chunk-signature=")
            .filter(|s| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| ChunkError("a chunk header whose only extension is not chunk-signature=<64 hex>".into()))?;
        let size = (!size_hex.is_empty() && size_hex.len() <= 16)
            .then(|| usize::from_str_radix(size_hex, 16).ok())
            .flatten()
            .ok_or_else(|| ChunkError(format!("a chunk size {size_hex:?} that is not hex")))?;
        if size > self.max_chunk {
            return Err(ChunkError(format!(
                "a chunk of {size} bytes, over max_body_bytes ({})",
                self.max_chunk
            )));
        }
        let need = eol + 2 + size + 2;
        if self.buf.len() < need {
            return Ok(false);
        }
        if &self.buf[need - 2..need] != b"\r\n" {
            return Err(ChunkError("a chunk not followed by CRLF".into()));
        }
        let digits = size_hex.len();
        let data = &self.buf[eol + 2..eol + 2 + size];
        let signature = sigv4::chunk_signature(&self.signing_key, &self.amz_date, &self.scope, &self.previous, data);
        self.out.reserve(need);
        self.out.extend_from_slice(&self.buf[..digits]);
        self.out.extend_from_slice(b";chunk-signature=");
        self.out.extend_from_slice(signature.as_bytes());
        self.out.extend_from_slice(b"\r\n");
        self.out.extend_from_slice(data);
        self.out.extend_from_slice(b"\r\n");
        self.buf.advance(need);
        self.done = size == 0;
        self.previous = signature;
        Ok(true)
    }
}

impl<B> Body for Chunks<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            while !this.done {
                match this.next_chunk() {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => return Poll::Ready(Some(Err(e.into()))),
                }
            }
            if !this.out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(this.out.split().freeze()))));
            }
            if this.done && !this.buf.is_empty() {
                return Poll::Ready(Some(Err(ChunkError("bytes after the final chunk".into()).into())));
            }
            if this.ended {
                if this.done {
                    return Poll::Ready(None);
                }
                return Poll::Ready(Some(Err(
                    ChunkError("the upload ended before its final chunk".into()).into()
                )));
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                None => this.ended = true,
                Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(d) => this.buf.extend_from_slice(&d),
                    Err(_) => {
                        return Poll::Ready(Some(Err(ChunkError(
                            "trailers in an upload signed without them".into(),
                        )
                        .into())))
                    }
                },
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.out.is_empty() && self.buf.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};

    fn signed() -> sigv4::Signed {
        let keys = Keys {
            access_key_id: "AKID",
            secret_access_key: "secret",
            session_token: None,
        };
        let req = SignRequest {
            method: "PUT",
            path: "/b/k",
            query: "",
            headers: &[("host", "s3.example")],
            payload_hash: SIGNED_CHUNKS,
            also_sign: &[],
        };
        let scope = Scope {
            region: "us-east-1",
            service: "s3",
        };
        sigv4::sign(
            &req,
            &keys,
            &scope,
            SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_765_000_000),
        )
    }

    async fn resign(body: &[u8], max: usize) -> Result<Bytes, String> {
        let c = Chunks::new(Full::new(Bytes::copy_from_slice(body)), signed(), max);
        c.collect().await.map(|c| c.to_bytes()).map_err(|e| e.to_string())
    }

    fn chunk(data: &[u8], sig: &str) -> Vec<u8> {
        let mut v = format!("{:x};chunk-signature={sig}\r\n", data.len()).into_bytes();
        v.extend_from_slice(data);
        v.extend_from_slice(b"\r\n");
        v
    }

    #[tokio::test]
    async fn chunk_signatures_are_chained_from_the_new_seed_and_the_length_kept() {
        let s = signed();
        let tool_sig = "0".repeat(64);
        let mut body = chunk(&[b'a'; 1000], &tool_sig);
        body.extend(chunk(b"tail", &tool_sig));
        body.extend(chunk(b"", &tool_sig));
        let out = resign(&body, 4096).await.unwrap();
        assert_eq!(out.len(), body.len());
        let first = sigv4::chunk_signature(&s.signing_key, &s.amz_date, &s.scope, &s.signature, &[b'a'; 1000]);
        let second = sigv4::chunk_signature(&s.signing_key, &s.amz_date, &s.scope, &first, b"tail");
        let last = sigv4::chunk_signature(&s.signing_key, &s.amz_date, &s.scope, &second, b"");
        let mut want = chunk(&[b'a'; 1000], &first);
        want.extend(chunk(b"tail", &second));
        want.extend(chunk(b"", &last));
        assert_eq!(out, want);
    }

    #[tokio::test]
    async fn a_malformed_oversized_or_truncated_upload_is_cut() {
        let sig = "0".repeat(64);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (chunk(&[0; 5000], &sig), "over max_body_bytes"),
            (b"zz;chunk-signature=00\r\n".to_vec(), "chunk-signature=<64 hex>"),
            (format!("zz;chunk-signature={sig}\r\n").into_bytes(), "not hex"),
            (b"5\r\nhello\r\n".to_vec(), "without chunk-signature"),
            (vec![b'1'; 300], "longer than 256 bytes"),
            (chunk(b"hello", &sig), "ended before its final chunk"),
            (
                [chunk(b"", &sig), b"more".to_vec()].concat(),
                "bytes after the final chunk",
            ),
            (
                format!("5;chunk-signature={sig}\r\nhelloXX").into_bytes(),
                "not followed by CRLF",
            ),
        ];
        for (body, want) in cases {
            let e = resign(&body, 4096).await.unwrap_err();
            assert!(e.contains(want), "{want}: {e}");
        }
    }
}
