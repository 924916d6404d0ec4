//! The executor's side of the listener hand-off: give the proxy the listening
//! socket created inside a confined child's network namespace, tagged with the
//! child's run id, over the proxy's unix socket (`[executor] proxy_handoff`,
//! the proxy's `[proxy] handoff`). The proxy then accepts there itself and
//! binds every connection to that run; the executor keeps no copy.
//! Wire: `loom-handoff/1 <run_id>\n` with one `SCM_RIGHTS` descriptor;
//! answer `ok\n` or `error <why>\n`.

use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::path::Path;
use std::time::Duration;

use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use tokio::io::{AsyncReadExt, Interest};
use tokio::net::UnixStream;

/// How long one hand-off may take.
const TIMEOUT: Duration = Duration::from_secs(5);

/// Hand `listener` to the proxy for `run_id`. On success the caller drops its
/// copy: the proxy holds the only one and closes it when the run ends.
pub async fn send(path: &Path, run_id: &str, listener: &std::net::TcpListener) -> io::Result<()> {
    match tokio::time::timeout(TIMEOUT, send_inner(path, run_id, listener)).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the proxy did not answer the hand-off",
        )),
    }
}

async fn send_inner(path: &Path, run_id: &str, listener: &std::net::TcpListener) -> io::Result<()> {
    let mut stream = UnixStream::connect(path)
        .await
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    let msg = format!("loom-handoff/1 {run_id}\n");
    loop {
        stream.writable().await?;
        let r = stream.try_io(Interest::WRITABLE, || {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            let fds = [listener.as_fd()];
            control.push(SendAncillaryMessage::ScmRights(&fds));
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
    match answer.trim_end() {
        "ok" => Ok(()),
        other => Err(io::Error::other(format!(
            "the proxy refused the hand-off: {}",
            other.strip_prefix("error ").unwrap_or(other)
        ))),
    }
}
