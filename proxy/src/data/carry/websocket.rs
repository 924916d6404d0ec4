//! WebSocket (RFC 6455) on the forward path and inside interception. The
//! opening handshake is an HTTP request decided like any other (run,
//! target, allowlist, methods, paths, credentials: [`policy::upgrade`]
//! tells it from other upgrades, which are `upgrade_not_allowed`); only an
//! allowed one goes to the origin, with its `Upgrade` and `Connection`
//! headers ([`handshake_headers`]) and the credentials written in. The
//! origin's `101` goes back to the tool with its headers as they came
//! (scrubbed of the secret), in one write, and then both upgraded
//! connections are joined.
//!
//! What flows after the handshake is bounded like a tunnel: by the fetch
//! deadline, the idle timeout, the run's end and shutdown, with the slot
//! held and the bytes counted. Its frames pass untouched, unless the
//! handshake carried a credential: then [`relay`] reads the origin's
//! frames ([`frames`]), at most [`MAX_MESSAGE`] bytes a message, and the
//! secret in every message and control frame becomes the placeholder
//! ([`scrub`]), as in a response body. When a credential for the host also
//! sets `rewrite_websocket`, the tool's frames are read too: the
//! placeholder in its text messages becomes the secret, and a binary
//! message (or control frame) carrying a placeholder or a secret is
//! `credential_misuse` ([`policy::websocket_message`]) and closes the
//! connection. So that frames are readable, a handshake that carries a
//! credential offers no extension (`permessage-deflate`).

use crate::data::carry::finish::Finish;
use crate::data::carry::frames::{self, FrameError, Item, Messages};
use crate::data::carry::inject;
use crate::data::carry::relayed::Unreadable;
use crate::data::carry::scrub::Scrub;
use crate::data::decide::fetch;
use crate::data::decide::fetch::Injection;
use crate::data::decide::policy::{self, Denial};
use crate::data::decide::target::Target;
use crate::runs::Run;
use crate::state::Shared;
use bytes::{Buf as _, Bytes, BytesMut};
use egress_config::{Policy, ToolPolicy};
use http::header::{self, HeaderMap, HeaderValue};
use std::io;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};

/// The largest message (and frame) the proxy reads when it reads frames:
/// a longer one closes the connection (`1009`).
pub const MAX_MESSAGE: usize = 1 << 20;

/// The head of a WebSocket handshake on its way to the origin, its
/// hop-by-hop headers already removed: the upgrade asked for again, and
/// no extension offered when the proxy reads the frames.
pub fn handshake_headers(h: &mut HeaderMap, rewrite: bool) {
    h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    if rewrite {
        h.remove(header::SEC_WEBSOCKET_EXTENSIONS);
    }
}

/// Whether the proxy reads the frames of this handshake's connection: it
/// does whenever a credential was written into it, so that the origin's
/// messages are scrubbed of the secret like a response body.
pub fn reads_frames(inj: Option<&Injection>) -> bool {
    inj.is_some_and(|i| !i.creds.is_empty())
}

/// Whether a credential written into this handshake asks for the tool's
/// messages to be rewritten (`rewrite_websocket`).
fn rewrites(inj: &Injection) -> bool {
    inj.creds
        .iter()
        .filter_map(|&c| inj.tool.credentials.get(c))
        .any(|c| c.rewrite_websocket)
}

/// A `101` whose frames the proxy is to read but which negotiated an
/// extension anyway (none was offered; `permessage-deflate` would compress
/// the messages): `Err`, a coding the scrubber cannot read.
pub fn check_accepted(rewrite: bool, h: &HeaderMap) -> Result<(), Unreadable> {
    match h.get(header::SEC_WEBSOCKET_EXTENSIONS).filter(|_| rewrite) {
        Some(v) => Err(Unreadable::Coding {
            header: "sec-websocket-extensions",
            coding: String::from_utf8_lossy(v.as_bytes()).chars().take(64).collect(),
        }),
        None => Ok(()),
    }
}

/// What a connection whose frames are read needs: the scrubber of the
/// origin's messages and, when the tool's are rewritten too, the policy it
/// was decided on, the run's placeholders and the secrets to put for them.
pub struct Rewrite {
    up: ToOrigin,
    scrub: Option<Scrub>,
}

/// The tool's side of a [`Rewrite`].
struct ToOrigin {
    sh: Arc<Shared>,
    policy: Arc<Policy>,
    run: Arc<Run>,
    tool: Arc<ToolPolicy>,
    target: Target,
    /// Whether the tool's frames are read and rewritten; otherwise they go
    /// to the origin as they came.
    rewrite: bool,
    /// (placeholder, secret) of each credential with `rewrite_websocket`.
    pairs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Rewrite {
    /// The frame reading of a handshake that carried `inj`, or `None` when
    /// it carried no credential.
    pub fn new(sh: &Arc<Shared>, run: &Arc<Run>, target: &Target, inj: Option<&Injection>) -> Option<Rewrite> {
        let inj = inj.filter(|i| reads_frames(Some(i)))?;
        let pairs = inj
            .creds
            .iter()
            .filter_map(|&c| inj.tool.credentials.get(c))
            .filter(|c| c.rewrite_websocket)
            .filter_map(|c| {
                let (_, p) = run.placeholder(&c.name)?;
                Some((p.value.as_bytes().to_vec(), c.secret.expose().as_bytes().to_vec()))
            })
            .collect();
        Some(Rewrite {
            up: ToOrigin {
                sh: sh.clone(),
                policy: sh.policy.load_full(),
                run: run.clone(),
                tool: inj.tool.clone(),
                target: target.clone(),
                rewrite: rewrites(inj),
                pairs,
            },
            scrub: Scrub::new(&inj.tool, run, &sh.metrics.credential_scrubs),
        })
    }
}

impl ToOrigin {
    /// A message (or control frame) of the tool, as it goes to the origin
    /// (one frame, masked afresh), or the denial that closes the connection.
    fn frame(&self, opcode: u8, payload: Vec<u8>) -> Result<Vec<u8>, Denial> {
        let text = opcode == frames::TEXT;
        policy::websocket_message(
            &self.tool,
            &self.policy.secrets,
            &self.run.placeholders,
            &self.target,
            text,
            &payload,
        )?;
        let mut payload = payload;
        if text {
            for (ph, secret) in &self.pairs {
                if policy::contains(&payload, ph) {
                    payload = inject::replace(&payload, ph, secret);
                }
            }
        }
        Ok(frames::encode(true, opcode, &payload, Some(mask())))
    }
}

/// A message (or control frame) of the origin, as it goes to the tool,
/// scrubbed of the secret whatever its opcode: a binary message carries a
/// reflected secret as well as a text one.
fn to_tool_frame(scrub: &mut Option<Scrub>, opcode: u8, payload: Vec<u8>) -> Vec<u8> {
    let Some(scrub) = scrub.as_mut() else {
        return frames::encode(true, opcode, &payload, None);
    };
    let mut out = scrub.chunk(Bytes::from(payload), true).to_vec();
    if opcode & 0x8 != 0 && out.len() > frames::MAX_CONTROL {
        // A placeholder longer than the secret made a control frame too
        // long: a close keeps its code only, a ping or pong goes empty.
        out.truncate(if opcode == frames::CLOSE { 2 } else { 0 });
    }
    frames::encode(true, opcode, &out, None)
}

/// A fresh masking key for a frame to the origin (RFC 6455 §5.3).
fn mask() -> [u8; 4] {
    let mut m = [0u8; 4];
    if getrandom::fill(&mut m).is_err() {
        // Masking keeps caches from being poisoned through a browser's
        // frames; it guards nothing here. A clock-derived key will do.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        m = t.to_le_bytes();
    }
    m
}

/// Why a relay that reads frames stopped before both sides ended.
enum Stop {
    Io(io::Error),
    Frame(FrameError),
    Denied(Denial),
}

impl From<io::Error> for Stop {
    fn from(e: io::Error) -> Stop {
        Stop::Io(e)
    }
}

impl From<FrameError> for Stop {
    fn from(e: FrameError) -> Stop {
        Stop::Frame(e)
    }
}

/// A close frame with `code` and `reason` (cut to fit a control frame).
fn close_frame(code: u16, reason: &str, mask: Option<[u8; 4]>) -> Vec<u8> {
    let mut p = code.to_be_bytes().to_vec();
    let mut end = reason.len().min(frames::MAX_CONTROL - 2);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    p.extend_from_slice(&reason.as_bytes()[..end]);
    frames::encode(true, frames::CLOSE, &p, mask)
}

/// Joins the tool's and the origin's upgraded connections until both end
/// or one breaks; reads the origin's frames (and the tool's, when they
/// are rewritten) when `rewrite` is given. When the proxy
/// closes the connection (a denied message: `1008` and its fact; an
/// oversize one: `1009`; a protocol error: `1002`) the outcome goes in
/// `finish`. The bounds (deadline, idle, run end) are the caller's.
pub async fn relay<C, U>(client: C, upstream: U, rewrite: Option<Rewrite>, finish: &Finish) -> io::Result<()>
where
    C: AsyncRead + AsyncWrite + Unpin,
    U: AsyncRead + AsyncWrite + Unpin,
{
    let Some(Rewrite { up, mut scrub }) = rewrite else {
        let (mut c, mut u) = (client, upstream);
        return tokio::io::copy_bidirectional_with_sizes(&mut c, &mut u, 16 * 1024, 16 * 1024)
            .await
            .map(|_| ());
    };
    let (mut cr, mut cw) = tokio::io::split(client);
    let (mut ur, mut uw) = tokio::io::split(upstream);
    let up_side = async {
        if up.rewrite {
            return to_origin(&mut cr, &mut uw, &up).await;
        }
        tokio::io::copy(&mut cr, &mut uw).await?;
        let _ = uw.shutdown().await;
        Ok(())
    };
    let r = tokio::try_join!(up_side, to_tool(&mut ur, &mut cw, &mut scrub));
    let (code, outcome, text) = match r {
        Ok(_) => return Ok(()),
        Err(Stop::Io(e)) => return Err(e),
        Err(Stop::Frame(e)) => match e {
            FrameError::TooBig(_) => (1009, "websocket_too_big", e.to_string()),
            FrameError::Protocol(_) => (1002, "websocket_protocol_error", e.to_string()),
        },
        Err(Stop::Denied(d)) => {
            let reason = d.reason.code();
            let fact = fetch::deny_message(&up.sh, &up.run, &up.target, d).await;
            (1008, reason, format!("egress denied ({reason}), fact {fact}"))
        }
    };
    finish.failed(outcome);
    tracing::info!(
        target: "egress::fetch",
        run = %up.run.id,
        tool = %up.run.tool,
        dest = %up.target,
        code,
        detail = %text,
        "WebSocket closed by the proxy"
    );
    // Both peers are told, as far as they still listen (briefly).
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), async {
        let _ = cw.write_all(&close_frame(code, &text, None)).await;
        let _ = cw.flush().await;
        let _ = uw.write_all(&close_frame(code, "", Some(mask()))).await;
        let _ = uw.flush().await;
    })
    .await;
    Err(io::Error::new(io::ErrorKind::PermissionDenied, text))
}

/// Room made in a read buffer before each read.
const READ_CHUNK: usize = 16 * 1024;

/// The tool's frames to the origin, read, checked and rewritten.
async fn to_origin<R, W>(r: &mut R, w: &mut W, up: &ToOrigin) -> Result<(), Stop>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let mut msgs = Messages::new(MAX_MESSAGE);
    loop {
        while let Some((frame, n)) = frames::parse(&buf, true, MAX_MESSAGE)? {
            buf.advance(n);
            let out = match msgs.push(frame)? {
                None => continue,
                Some(Item::Control(f)) => up.frame(f.opcode, f.payload),
                Some(Item::Message { opcode, payload }) => up.frame(opcode, payload),
            };
            w.write_all(&out.map_err(Stop::Denied)?).await?;
        }
        w.flush().await?;
        buf.reserve(READ_CHUNK);
        if r.read_buf(&mut buf).await? == 0 {
            let _ = w.shutdown().await;
            return Ok(());
        }
    }
}

/// The origin's frames to the tool, read and scrubbed.
async fn to_tool<R, W>(r: &mut R, w: &mut W, scrub: &mut Option<Scrub>) -> Result<(), Stop>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let mut msgs = Messages::new(MAX_MESSAGE);
    loop {
        while let Some((frame, n)) = frames::parse(&buf, false, MAX_MESSAGE)? {
            buf.advance(n);
            let out = match msgs.push(frame)? {
                None => continue,
                Some(Item::Control(f)) => to_tool_frame(scrub, f.opcode, f.payload),
                Some(Item::Message { opcode, payload }) => to_tool_frame(scrub, opcode, payload),
            };
            w.write_all(&out).await?;
        }
        w.flush().await?;
        buf.reserve(READ_CHUNK);
        if r.read_buf(&mut buf).await? == 0 {
            let _ = w.shutdown().await;
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handshake_asks_for_the_upgrade_and_no_extension_when_frames_are_read() {
        let mut h = HeaderMap::new();
        h.insert(
            header::SEC_WEBSOCKET_EXTENSIONS,
            HeaderValue::from_static("permessage-deflate"),
        );
        handshake_headers(&mut h, false);
        assert_eq!(h[header::CONNECTION], "upgrade");
        assert_eq!(h[header::UPGRADE], "websocket");
        assert!(h.contains_key(header::SEC_WEBSOCKET_EXTENSIONS));
        assert_eq!(check_accepted(false, &h), Ok(()));
        assert!(check_accepted(true, &h).is_err());
        handshake_headers(&mut h, true);
        assert!(!h.contains_key(header::SEC_WEBSOCKET_EXTENSIONS));
    }

    #[test]
    fn a_close_frame_fits_a_control_frame_whatever_its_reason() {
        let long = "é".repeat(100);
        for (reason, masked) in [("", None), ("short", Some([1, 2, 3, 4])), (long.as_str(), None)] {
            let wire = close_frame(1008, reason, masked);
            let (f, n) = frames::parse(&wire, masked.is_some(), MAX_MESSAGE).unwrap().unwrap();
            assert_eq!(n, wire.len());
            assert_eq!(f.opcode, frames::CLOSE);
            assert!(f.payload.len() <= frames::MAX_CONTROL);
            assert_eq!(&f.payload[..2], &1008u16.to_be_bytes());
            let text = std::str::from_utf8(&f.payload[2..]).unwrap();
            assert!(reason.starts_with(text), "{text}");
        }
    }

    #[test]
    fn without_a_scrubber_the_origin_s_frames_go_as_they_came() {
        let wire = to_tool_frame(&mut None, frames::TEXT, b"hello".to_vec());
        assert_eq!(wire, frames::encode(true, frames::TEXT, b"hello", None));
    }
}
