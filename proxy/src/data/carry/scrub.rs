//! Responses from a credential's hosts, scrubbed of its secret, so a tool
//! never reads back what the proxy wrote for it (an echoing endpoint, TRACE,
//! an error page quoting the key, a redirect copying the query). Every form
//! of the real value (the tool's `SecretScan`: each character as is,
//! percent-encoded, JSON-escaped or an HTML reference, a `Basic` value
//! decoded) is replaced with the run's
//! placeholder in the head (reason phrase, header names and values, so
//! `Location` and `Set-Cookie` too), the body and its trailers.
//!
//! Bodies are scrubbed as a stream: only the bytes at the end of a chunk
//! that could begin a secret wait for the next chunk (fewer than the
//! longest form), so streams such as SSE stay live. The request asks for
//! `identity` and no byte range ([`ask_scrubbable`]); a response whose
//! relayed bytes are anything else ([`relayed`]: another coding, a framing
//! that disagrees with itself, a body where none may be) is refused,
//! never passed unscrubbed.

use crate::data::carry::relayed::{relayed, Relay, Unreadable};
use crate::metrics::ToolCredential;
use crate::runs::Run;
use crate::state::Shared;
use bytes::Bytes;
use egress_config::ToolPolicy;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::Method;
use http_body_util::BodyExt as _;
use hyper::body::{Body, Frame, SizeHint};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::time::Instant;

/// What replaces a secret whose credential the run holds no placeholder
/// for (a run made before the credential was configured).
const WITHHELD: &[u8] = b"loom-cred-withheld";

/// Makes a request to a credential's host ask for a response the proxy can
/// scrub: the whole representation (no `Range`, `If-Range`), in no content
/// coding (`Accept-Encoding: identity`, whatever the client asked for).
pub fn ask_scrubbable(headers: &mut HeaderMap) {
    headers.remove(header::RANGE);
    headers.remove(header::IF_RANGE);
    headers.insert(header::ACCEPT_ENCODING, HeaderValue::from_static("identity"));
}

/// One response's scrubber.
pub struct Scrub {
    tool: Arc<ToolPolicy>,
    run: Arc<Run>,
    /// By credential index of the tool: the run's placeholder and its index.
    with: Vec<(Bytes, Option<usize>)>,
    /// Counters by credential index, made on the first scrub.
    counters: Vec<Option<Counter>>,
    family: Family<ToolCredential, Counter>,
    /// Bytes held back: they could begin a secret the next chunk completes.
    carry: Vec<u8>,
    /// The body's trailers, waiting until the held-back bytes went out.
    trailers: Option<HeaderMap>,
    /// The body has ended (its last bytes are out or in `carry`).
    done: bool,
}

impl Scrub {
    /// A scrubber for a response to `run` from a host of `tool`'s
    /// credentials; `None` when the tool has no loaded secret.
    pub fn new(tool: &Arc<ToolPolicy>, run: &Arc<Run>, family: &Family<ToolCredential, Counter>) -> Option<Scrub> {
        if tool.secrets.is_empty() {
            return None;
        }
        let with = tool
            .credentials
            .iter()
            .map(|c| match run.placeholder(&c.name) {
                Some((i, p)) => (Bytes::copy_from_slice(p.value.as_bytes()), Some(i)),
                None => (Bytes::from_static(WITHHELD), None),
            })
            .collect();
        Some(Scrub {
            tool: tool.clone(),
            run: run.clone(),
            with,
            counters: vec![None; tool.credentials.len()],
            family: family.clone(),
            carry: Vec::new(),
            trailers: None,
            done: false,
        })
    }

    /// Scrubs a response head: the reason phrase, every header name and
    /// value. A body that is relayed ([`Relay::Body`]) may change length:
    /// it loses its `Content-Length` (it goes chunked).
    pub fn head(&mut self, relay: Relay, parts: &mut http::response::Parts) {
        if let Some(r) = parts.extensions.get::<hyper::ext::ReasonPhrase>() {
            // Counted, then dropped: the status's own phrase is written.
            if self.replace_all(r.as_bytes()).is_some() {
                parts.extensions.remove::<hyper::ext::ReasonPhrase>();
            }
        }
        if relay == Relay::Body {
            parts.headers.remove(header::CONTENT_LENGTH);
        }
        self.headers(&mut parts.headers);
    }

    /// Scrubs every header name and value of `h` (a head or trailers).
    pub fn headers(&mut self, h: &mut HeaderMap) {
        let scan = &self.tool.secrets;
        let hit = h
            .iter()
            .any(|(k, v)| scan.find(k.as_str().as_bytes()).is_some() || scan.find(v.as_bytes()).is_some());
        if !hit {
            return;
        }
        let old = std::mem::take(h);
        for (k, v) in old.iter() {
            let name = match self.replace_all(k.as_str().as_bytes()) {
                Some(n) => HeaderName::from_bytes(&n).unwrap_or_else(|_| k.clone()),
                None => k.clone(),
            };
            let value = match self.replace_all(v.as_bytes()) {
                Some(n) => HeaderValue::from_bytes(&n).unwrap_or_else(|_| HeaderValue::from_static("")),
                None => v.clone(),
            };
            h.append(name, value);
        }
    }

    /// `hay` with every secret replaced, or `None` when it holds none.
    fn replace_all(&mut self, hay: &[u8]) -> Option<Vec<u8>> {
        let tool = self.tool.clone();
        let mut out: Option<Vec<u8>> = None;
        let mut at = 0;
        for f in tool.secrets.find_all(hay) {
            let o = out.get_or_insert_with(|| Vec::with_capacity(hay.len() + 32));
            o.extend_from_slice(&hay[at..f.start]);
            o.extend_from_slice(&self.replacement(f.pattern));
            at = f.end;
        }
        let mut out = out?;
        out.extend_from_slice(&hay[at..]);
        Some(out)
    }

    /// The next bytes of the body (`data`; `end`: none will follow) as they
    /// may go to the tool. Returns the empty slice while everything waits.
    pub fn chunk(&mut self, data: Bytes, end: bool) -> Bytes {
        let buf = if self.carry.is_empty() {
            data
        } else {
            let mut joined = std::mem::take(&mut self.carry);
            joined.extend_from_slice(&data);
            Bytes::from(joined)
        };
        let tool = self.tool.clone();
        let scan = &tool.secrets;
        // Bytes from `emit` on wait: they could begin a secret.
        let mut emit = if end { buf.len() } else { buf.len() - scan.pending(&buf) };
        let mut out: Option<Vec<u8>> = None;
        let mut at = 0;
        for f in scan.find_all(&buf) {
            if f.start >= emit {
                break;
            }
            // A whole secret that reaches into the held-back end goes now.
            emit = emit.max(f.end);
            let o = out.get_or_insert_with(|| Vec::with_capacity(buf.len() + 32));
            o.extend_from_slice(&buf[at..f.start]);
            o.extend_from_slice(&self.replacement(f.pattern));
            at = f.end;
        }
        if emit < buf.len() {
            self.carry.extend_from_slice(&buf[emit..]);
        }
        match out {
            None => buf.slice(..emit),
            Some(mut o) => {
                o.extend_from_slice(&buf[at..emit]);
                Bytes::from(o)
            }
        }
    }

    /// Whether bytes are held back.
    pub fn holding(&self) -> bool {
        !self.carry.is_empty()
    }

    /// The placeholder for a found pattern, counted.
    fn replacement(&mut self, pattern: usize) -> Bytes {
        let owner = self.tool.secrets.owner(pattern);
        let cred = owner.credential;
        let Some((with, placeholder)) = self.with.get(cred) else {
            return Bytes::from_static(WITHHELD);
        };
        if let Some(i) = placeholder {
            self.run.count_scrubbed(*i, 1);
        }
        let name = owner.name.clone();
        let counter = self.counters[cred].get_or_insert_with(|| {
            self.family.get_or_create_owned(&ToolCredential {
                tool: self.tool.id.to_string(),
                credential: name.to_string(),
            })
        });
        counter.inc();
        with.clone()
    }
}

/// The scrubber of a response to a request that carried credentials of
/// `injected`, the tool (none for other requests), with its head (as
/// received: before hop-by-hop headers are removed) scrubbed, once
/// [`relayed`] says what of it goes to the tool; `Err` when that is not
/// what the scrubber reads, and nothing of the response may be passed on.
/// A response that may have no body but did not end with its head (an
/// HTTP/2 origin's 204 without `END_STREAM`) has its frames read here, at
/// most until `until`: a byte refuses it, trailers are kept for the tool.
pub async fn response<B>(
    sh: &Shared,
    injected: Option<&Arc<ToolPolicy>>,
    run: &Arc<Run>,
    method: &Method,
    parts: &mut http::response::Parts,
    body: &mut B,
    until: Option<Instant>,
) -> Result<Option<Scrub>, Unreadable>
where
    B: Body<Data = Bytes> + Unpin,
{
    let Some(mut scrub) = injected.and_then(|tool| Scrub::new(tool, run, &sh.metrics.credential_scrubs)) else {
        return Ok(None);
    };
    let relay = relayed(method, parts.status, &parts.headers, body.is_end_stream())?;
    if relay == Relay::MustBeEmpty {
        let mut trailers = drain_empty(body, until).await.map_err(|()| {
            Unreadable::BodyWhereNone(format!(
                "a {} answer to {method} with body bytes",
                parts.status.as_u16()
            ))
        })?;
        if let Some(t) = trailers.as_mut() {
            scrub.headers(t);
        }
        scrub.trailers = trailers;
        scrub.done = true;
    }
    scrub.head(relay, parts);
    Ok(Some(scrub))
}

/// Reads a body that may carry no byte to its end, at most until `until`:
/// its trailers, if any; `Err` at its first byte. A body that fails or
/// outlasts `until` ends there (nothing more of it is relayed).
async fn drain_empty<B>(body: &mut B, until: Option<Instant>) -> Result<Option<HeaderMap>, ()>
where
    B: Body<Data = Bytes> + Unpin,
{
    let read = async {
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { return Ok(None) };
            match frame.into_data() {
                Ok(d) if d.is_empty() => {}
                Ok(_) => return Err(()),
                Err(f) => return Ok(f.into_trailers().ok()),
            }
        }
        Ok(None)
    };
    match until {
        Some(t) => tokio::time::timeout_at(t, read).await.unwrap_or(Ok(None)),
        None => read.await,
    }
}

/// A response body, scrubbed when it comes from a credential's host (the
/// scrubber boxed, so a body that needs none stays small).
pub struct Scrubbed<B> {
    inner: B,
    scrub: Option<Box<Scrub>>,
}

impl<B> Scrubbed<B> {
    pub fn new(inner: B, scrub: Option<Scrub>) -> Scrubbed<B> {
        Scrubbed {
            inner,
            scrub: scrub.map(Box::new),
        }
    }
}

impl<B> Body for Scrubbed<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        let Some(scrub) = this.scrub.as_deref_mut() else {
            return Pin::new(&mut this.inner).poll_frame(cx);
        };
        loop {
            if let Some(t) = scrub.trailers.take() {
                return Poll::Ready(Some(Ok(Frame::trailers(t))));
            }
            if scrub.done {
                return Poll::Ready(None);
            }
            let out = match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        scrub.done = this.inner.is_end_stream();
                        scrub.chunk(data, scrub.done)
                    }
                    Err(frame) => {
                        // Trailers end the body: the held-back bytes go first.
                        scrub.done = true;
                        if let Ok(mut t) = frame.into_trailers() {
                            scrub.headers(&mut t);
                            scrub.trailers = Some(t);
                        }
                        scrub.chunk(Bytes::new(), true)
                    }
                },
                Poll::Ready(None) => {
                    scrub.done = true;
                    scrub.chunk(Bytes::new(), true)
                }
            };
            if !out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(out))));
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.scrub {
            None => self.inner.is_end_stream(),
            Some(s) => s.trailers.is_none() && (s.done || (self.inner.is_end_stream() && !s.holding())),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.scrub {
            None => self.inner.size_hint(),
            // Replacing a secret changes the length.
            Some(_) => SizeHint::default(),
        }
    }
}

#[cfg(test)]
#[path = "scrub_tests.rs"]
mod tests;
