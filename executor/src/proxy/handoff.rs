//! The executor's side of the listener hand-off (wire: `egress_api::handoff`):
//! the listening socket created inside a confined child's network namespace,
//! sent with the child's run id over the proxy's hand-off socket, checked
//! first (`socket::vet`); the proxy then accepts there itself and binds every
//! connection to that run, and the executor keeps no copy.

use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use egress_api::handoff::{ERROR, MAGIC, OK, PROBE, TRANSPARENT};
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use tokio::io::{AsyncReadExt, Interest};
use tokio::net::UnixStream;

use crate::proxy::socket;

/// How long one hand-off may take.
const TIMEOUT: Duration = Duration::from_secs(5);

/// Hand `listener` to the proxy for `run_id`. On success the caller drops its
/// copy: the proxy holds the only one and closes it when the run ends.
pub async fn send(path: &Path, run_id: &str, listener: &std::net::TcpListener) -> io::Result<()> {
    exchange(path, &format!("{MAGIC}{run_id}\n"), &[listener.as_fd()]).await
}

/// Hand a transparent tool's four in-namespace sockets to the proxy for
/// `run_id`, in `egress_api::handoff::TRANSPARENT`'s order (the TCP
/// listeners on `127.0.0.1:3127` and `[::1]:3127`, the UDP socket and the
/// TCP listener on `127.0.0.1:53`). As with [`send`], the caller drops its
/// copies after.
pub async fn send_transparent(path: &Path, run_id: &str, fds: &[OwnedFd; 4]) -> io::Result<()> {
    let fds: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
    exchange(path, &format!("{TRANSPARENT}{run_id}\n"), &fds).await
}

/// Ask the proxy whether it receives hand-offs on `path` (no descriptor).
pub async fn probe(path: &Path) -> io::Result<()> {
    exchange(path, PROBE, &[]).await
}

async fn exchange(path: &Path, msg: &str, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    match tokio::time::timeout(TIMEOUT, exchange_inner(path, msg, fds)).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("{}: the proxy did not answer", path.display()),
        )),
    }
}

async fn exchange_inner(path: &Path, msg: &str, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    socket::vet(path).map_err(|e| io::Error::new(e.kind(), e.to_string()))?;
    let mut stream = UnixStream::connect(path)
        .await
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    loop {
        stream.writable().await?;
        let r = stream.try_io(Interest::WRITABLE, || {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
                return Err(io::Error::other("too many descriptors for one hand-off"));
            }
            Ok(rustix::net::sendmsg(
                &stream,
                &[IoSlice::new(msg.as_bytes())],
                &mut control,
                SendFlags::NOSIGNAL,
            )?)
        });
        match r {
            Ok(n) if n == msg.len() => break,
            Ok(_) => return Err(io::Error::other("short hand-off write")),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    let mut answer = Vec::new();
    (&mut stream).take(512).read_to_end(&mut answer).await?;
    let answer = String::from_utf8_lossy(&answer);
    if answer == OK {
        return Ok(());
    }
    Err(io::Error::other(format!(
        "the proxy refused on {}: {}",
        path.display(),
        answer.trim_end().strip_prefix(ERROR).unwrap_or(answer.trim_end())
    )))
}
