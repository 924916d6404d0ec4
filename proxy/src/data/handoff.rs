//! Listener hand-off (`[proxy] handoff`): the executor passes the listening
//! socket it created inside a confined child's network namespace over a unix
//! socket (`SCM_RIGHTS`), tagged with the child's run id. The proxy accepts on
//! that listener directly (no relay) and binds every connection arriving on it
//! to the run: another run's credential presented there is `auth_invalid`
//! (see `auth::BoundRun`), so a leaked credential is useless outside its own
//! sandbox. The listener is closed when the run ends.
//!
//! Wire: one unix stream connection per hand-off. The executor sends one
//! message `loom-handoff/1 <run_id>\n` carrying exactly one descriptor; the
//! proxy answers `ok\n` or `error <why>\n` and closes.

use std::io::{self, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};

use crate::data::auth::BoundRun;
use crate::state::Shared;

/// Prefix of a hand-off message.
pub const MAGIC: &str = "loom-handoff/1 ";
/// How long one hand-off may take.
const TIMEOUT: Duration = Duration::from_secs(5);
/// Hand-offs processed at once (each is a few system calls).
const MAX_INFLIGHT: usize = 64;

/// Binds the hand-off socket at `path` (replacing a stale socket, never
/// another kind of file), readable and writable by the proxy's user only.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)?,
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "exists and is not a socket; refusing to replace it",
            ))
        }
        Err(_) => {}
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let l = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(l)
}

/// Accepts hand-offs until shutdown.
pub async fn serve(sh: Arc<Shared>, listener: UnixListener) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_INFLIGHT));
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = sh.shutdown.cancelled() => return,
        };
        let Ok((stream, _)) = accepted else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let sh = sh.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let mut stream = stream;
            let answer = match tokio::time::timeout(TIMEOUT, receive(&stream)).await {
                Ok(Ok((run_id, fd))) => match adopt(&sh, &run_id, fd) {
                    Ok(()) => "ok\n".to_string(),
                    Err(e) => format!("error {e}\n"),
                },
                Ok(Err(e)) => format!("error {e}\n"),
                Err(_) => "error timed out\n".to_string(),
            };
            if answer != "ok\n" {
                tracing::warn!(answer = answer.trim_end(), "listener hand-off refused");
            }
            let _ = stream.write_all(answer.as_bytes()).await;
        });
    }
}

/// Reads the one message and its descriptor.
async fn receive(stream: &UnixStream) -> io::Result<(String, OwnedFd)> {
    let mut buf = [0u8; 256];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    loop {
        stream.readable().await?;
        let r = stream.try_io(Interest::READABLE, || {
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let mut iov = [IoSliceMut::new(&mut buf)];
            let msg = rustix::net::recvmsg(stream, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)?;
            let mut fds: Vec<OwnedFd> = Vec::new();
            for m in control.drain() {
                if let RecvAncillaryMessage::ScmRights(it) = m {
                    fds.extend(it);
                }
            }
            Ok((msg.bytes, fds))
        });
        let (n, mut fds) = match r {
            Ok(v) => v,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        };
        let text = std::str::from_utf8(&buf[..n]).map_err(|_| invalid("message is not UTF-8"))?;
        let run_id = text
            .strip_prefix(MAGIC)
            .and_then(|r| r.strip_suffix('\n'))
            .ok_or_else(|| invalid("not a hand-off message"))?;
        if fds.len() != 1 {
            return Err(invalid("exactly one descriptor expected"));
        }
        let fd = fds.remove(0);
        return Ok((run_id.to_string(), fd));
    }
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// Checks the descriptor is a listening TCP socket, then serves it for the
/// run until the run ends (or the proxy shuts down).
fn adopt(sh: &Arc<Shared>, run_id: &str, fd: OwnedFd) -> io::Result<()> {
    let run = sh
        .runs
        .get(run_id)
        .ok_or_else(|| invalid("no such run (or it has ended)"))?;
    if run.cancel.is_cancelled() {
        return Err(invalid("the run has ended"));
    }
    if !rustix::net::sockopt::socket_acceptconn(&fd)? {
        return Err(invalid("the descriptor is not a listening socket"));
    }
    let family = rustix::net::sockopt::socket_domain(&fd)?;
    if family != rustix::net::AddressFamily::INET && family != rustix::net::AddressFamily::INET6 {
        return Err(invalid("the descriptor is not a TCP socket"));
    }
    let std_listener = std::net::TcpListener::from(fd);
    std_listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(std_listener)?;
    let sh2 = sh.clone();
    let bound = BoundRun(run.id.clone());
    // Its own pending set (one sandbox cannot push out another's pending
    // connections), the proxy's established places.
    let admission = crate::admission::Admission::sharing(
        sh.cfg
            .max_pending_connections
            .min(sh.cfg.max_connections_per_run.max(1) * 2),
        sh.data_admission.established_places(),
        sh.data_admission.evicted_counter(),
    );
    tokio::spawn(async move {
        tokio::select! {
            _ = crate::data::serve(sh2, listener, Some(bound), admission) => {}
            // Dropping the accept loop closes the listener.
            _ = run.cancel.cancelled() => {}
        }
    });
    Ok(())
}
