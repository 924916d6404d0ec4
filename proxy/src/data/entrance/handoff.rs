//! Listener hand-off: the executor passes the listening socket it created
//! inside a confined child's network namespace over a unix socket
//! (`SCM_RIGHTS`), tagged with the child's run id. The proxy accepts on
//! that listener directly (no relay) and binds every connection arriving on
//! it to the run: another run's credential presented there is refused (see
//! `auth::BoundRun`). And the run is bound to it (`Run::bind`, durable
//! before the hand-off is answered, unless its creator declared the binding
//! already): its credential is refused on every other listener and entrance
//! (`credential_elsewhere`), so a leaked credential is useless outside its
//! own sandbox. The listener is closed when the run ends.
//!
//! The socket is `[proxy] handoff`, else `egress-handoff.sock` beside the
//! facts store (the executor derives the same path from the same file). It
//! is an authority (whoever sends on it chooses which run a listener is
//! bound to): it is created 0600, and a sender must be root or the proxy's
//! own user, never a confined child's uid. Wire: `egress_api::handoff`.

use std::io::{self, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};

use egress_api::handoff::{ERROR, MAGIC, OK, PROBE, TRANSPARENT};
use egress_config::{ExecutorConfig, ProxyConfig};

use crate::data::decide::auth::BoundRun;
use crate::runs::RunWrite;
use crate::state::Shared;

/// How long one hand-off may take.
const TIMEOUT: Duration = Duration::from_secs(5);
/// Hand-offs processed at once (each is a few system calls).
const MAX_INFLIGHT: usize = 64;

/// Where the proxy receives hand-offs, and whether the file named it.
pub struct Socket {
    pub path: std::path::PathBuf,
    /// Named by `[proxy] handoff`: failing to bind it fails the start. The
    /// default beside the facts store only warns (a proxy without an
    /// executor still serves); the executor then refuses confined children
    /// rather than relay them.
    pub explicit: bool,
}

/// The hand-off socket of `cfg`. An embedder with its own fact sink has no
/// directory of its own to put the default in, so it gets one only when
/// `[proxy] handoff` names it (as its CA is ephemeral unless `ca_dir` is set).
pub fn socket(cfg: &ProxyConfig, own_sink: bool) -> Option<Socket> {
    match (&cfg.handoff, own_sink) {
        (Some(path), _) => Some(Socket {
            path: path.clone(),
            explicit: true,
        }),
        (None, false) => Some(Socket {
            path: cfg.handoff_socket(),
            explicit: false,
        }),
        (None, true) => None,
    }
}

/// Who may send on the hand-off socket: root, or the proxy's own user when
/// that is not a confined child's uid (`[executor] child_uid`, `child_uid_count`).
#[derive(Debug, Clone)]
pub struct Senders {
    me: u32,
    children: std::ops::Range<u32>,
}

impl Senders {
    pub fn new(exec: &ExecutorConfig) -> Senders {
        Senders::with(rustix::process::geteuid().as_raw(), exec)
    }

    fn with(me: u32, exec: &ExecutorConfig) -> Senders {
        Senders {
            me,
            children: exec.child_uid..exec.child_uid.saturating_add(exec.child_uid_count),
        }
    }

    /// Pure: whether a peer of uid `uid` may hand over listeners.
    pub fn may_send(&self, uid: u32) -> bool {
        uid == 0 || (uid == self.me && !self.children.contains(&uid))
    }

    /// Said at start when only root can send (the proxy runs as a child's uid).
    pub fn only_root(&self) -> bool {
        self.me != 0 && self.children.contains(&self.me)
    }
}

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
pub async fn serve(sh: Arc<Shared>, listener: UnixListener, senders: Senders) {
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
        let senders = senders.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let mut stream = stream;
            let answer = match stream.peer_cred() {
                Ok(c) if senders.may_send(c.uid()) => {
                    match tokio::time::timeout(TIMEOUT, receive(&stream)).await {
                        Ok(Ok(Message::Probe)) => Ok(()),
                        Ok(Ok(Message::Listener(run_id, fd))) => {
                            adopt(&sh, &run_id, fd).await.map_err(|e| e.to_string())
                        }
                        Ok(Ok(Message::Transparent(run_id, fds))) => {
                            adopt_transparent(&sh, &run_id, fds).await.map_err(|e| e.to_string())
                        }
                        Ok(Err(e)) => Err(e.to_string()),
                        Err(_) => Err("timed out".to_string()),
                    }
                }
                Ok(c) => Err(format!("uid {} may not hand over listeners (only root or the proxy's own user, never a confined child's uid)", c.uid())),
                Err(e) => Err(format!("no peer credentials: {e}")),
            };
            let answer = match answer {
                Ok(()) => OK.to_string(),
                Err(e) => format!("{ERROR}{e}\n"),
            };
            if answer != OK {
                tracing::warn!(answer = answer.trim_end(), "listener hand-off refused");
            }
            let _ = stream.write_all(answer.as_bytes()).await;
        });
    }
}

/// One message on the hand-off socket.
enum Message {
    Probe,
    /// A run id and its listener.
    Listener(String, OwnedFd),
    /// A run id and its transparent sockets (see `egress_api::handoff::TRANSPARENT`).
    Transparent(String, [OwnedFd; 4]),
}

/// Reads the one message and its descriptor.
async fn receive(stream: &UnixStream) -> io::Result<Message> {
    let mut buf = [0u8; 256];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(5))];
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
        if text == PROBE {
            return Ok(Message::Probe);
        }
        if let Some(run_id) = text.strip_prefix(TRANSPARENT).and_then(|r| r.strip_suffix('\n')) {
            let fds: [OwnedFd; 4] = fds
                .try_into()
                .map_err(|_| invalid("exactly four descriptors expected"))?;
            return Ok(Message::Transparent(run_id.to_string(), fds));
        }
        let run_id = text
            .strip_prefix(MAGIC)
            .and_then(|r| r.strip_suffix('\n'))
            .ok_or_else(|| invalid("not a hand-off message"))?;
        if fds.len() != 1 {
            return Err(invalid("exactly one descriptor expected"));
        }
        let fd = fds.remove(0);
        return Ok(Message::Listener(run_id.to_string(), fd));
    }
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// The live run a hand-off names, bound to its listener from now on: if
/// its creator did not declare the binding (`bound` at `POST /v1/runs`),
/// its record is rewritten before the hand-off is answered, so that a
/// restart cannot bring it back unbound. A record that cannot be written
/// refuses the hand-off (the run stays bound, with no listener: its
/// credential works nowhere).
async fn bound_run(sh: &Shared, run_id: &str) -> io::Result<Arc<crate::runs::Run>> {
    let run = sh
        .runs
        .get(run_id)
        .ok_or_else(|| invalid("no such run (or it has ended)"))?;
    if run.cancel.is_cancelled() {
        return Err(invalid("the run has ended"));
    }
    if run.bind() {
        tracing::info!(target: "egress::runs", run = %run.id, "run bound to its handed-over listener (not declared at creation)");
        sh.facts
            .save_run(RunWrite::Update(run.record()))
            .await
            .map_err(|e| io::Error::other(format!("the run's binding could not be stored: {e}")))?;
    }
    Ok(run)
}

/// `fd` as a tokio TCP listener, if it is a listening IPv4 or IPv6 TCP socket.
fn tcp_listener(fd: OwnedFd) -> io::Result<tokio::net::TcpListener> {
    if !rustix::net::sockopt::socket_acceptconn(&fd)? {
        return Err(invalid("the descriptor is not a listening socket"));
    }
    let family = rustix::net::sockopt::socket_domain(&fd)?;
    if family != rustix::net::AddressFamily::INET && family != rustix::net::AddressFamily::INET6 {
        return Err(invalid("the descriptor is not a TCP socket"));
    }
    let std_listener = std::net::TcpListener::from(fd);
    std_listener.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(std_listener)
}

/// Checks the descriptor is a listening TCP socket, then serves it for the
/// run until the run ends (or the proxy shuts down).
async fn adopt(sh: &Arc<Shared>, run_id: &str, fd: OwnedFd) -> io::Result<()> {
    let listener = tcp_listener(fd)?;
    let run = bound_run(sh, run_id).await?;
    let sh2 = sh.clone();
    let bound = BoundRun(run.id.clone());
    let admission = run_admission(sh);
    tokio::spawn(async move {
        tokio::select! {
            _ = crate::data::serve(sh2, listener, Some(bound), admission) => {}
            // Dropping the accept loop closes the listener.
            _ = run.cancel.cancelled() => {}
        }
    });
    Ok(())
}

/// A handed-over listener's admission: its own pending set (one sandbox
/// cannot push out another's pending connections), the proxy's
/// established places.
fn run_admission(sh: &Shared) -> Arc<crate::admission::Admission> {
    crate::admission::Admission::sharing(
        sh.cfg
            .max_pending_connections
            .min(sh.cfg.max_connections_per_run.max(1) * 2),
        sh.data_admission.established_places(),
        sh.data_admission.evicted_counter(),
    )
}

/// Checks a transparent hand-off's four sockets (two TCP listeners, a UDP
/// socket, a TCP listener), then serves them for the run until it ends:
/// the transparent entrance on the first two, the sandbox's DNS on the
/// others.
async fn adopt_transparent(sh: &Arc<Shared>, run_id: &str, fds: [OwnedFd; 4]) -> io::Result<()> {
    let [t4, t6, udp, dns_tcp] = fds;
    let t4 = tcp_listener(t4)?;
    let t6 = tcp_listener(t6)?;
    let dns_tcp = tcp_listener(dns_tcp)?;
    if rustix::net::sockopt::socket_type(&udp)? != rustix::net::SocketType::DGRAM {
        return Err(invalid("the third descriptor is not a UDP socket"));
    }
    let udp = std::net::UdpSocket::from(udp);
    udp.set_nonblocking(true)?;
    let udp = tokio::net::UdpSocket::from_std(udp)?;
    let run = bound_run(sh, run_id).await?;
    let admission = run_admission(sh);
    for l in [t4, t6] {
        tokio::spawn(crate::data::entrance::transparent::serve(
            sh.clone(),
            run.clone(),
            l,
            admission.clone(),
        ));
    }
    tokio::spawn(crate::data::entrance::dns::serve_udp(sh.clone(), run.clone(), udp));
    tokio::spawn(crate::data::entrance::dns::serve_tcp(sh.clone(), run, dns_tcp));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The socket's authority: root, or the proxy's own user unless that
    /// is a confined child's uid; nobody else.
    #[test]
    fn only_root_or_the_proxys_own_user_may_send() {
        let exec = ExecutorConfig {
            child_uid: 65534,
            child_uid_count: 4,
            ..ExecutorConfig::default()
        };
        for (me, uid, ok) in [
            (0, 0, true),
            (0, 1000, false),
            (0, 65534, false),
            (10001, 0, true),
            (10001, 10001, true),
            (10001, 10002, false),
            (10001, 65535, false),
            // The proxy runs as a confined child's uid: root alone.
            (65534, 65534, false),
            (65535, 65535, false),
            (65535, 0, true),
            (65538, 65538, true),
        ] {
            let s = Senders::with(me, &exec);
            assert_eq!(s.may_send(uid), ok, "proxy uid {me}, peer uid {uid}");
            assert_eq!(s.only_root(), (65534..65538).contains(&me), "proxy uid {me}");
        }
        // A range at the top of the uid space does not wrap.
        let top = ExecutorConfig {
            child_uid: u32::MAX - 1,
            child_uid_count: 5,
            ..ExecutorConfig::default()
        };
        assert!(!Senders::with(u32::MAX - 1, &top).may_send(u32::MAX - 1));
        assert!(Senders::with(7, &top).may_send(7));
    }

    #[test]
    fn the_default_socket_only_for_the_proxys_own_store() {
        let c = egress_config::Config::parse_relative_to("", "f", std::path::Path::new("/srv/loom")).unwrap();
        let s = socket(&c.proxy, false).unwrap();
        assert_eq!(s.path, std::path::Path::new("/srv/loom/var/egress-handoff.sock"));
        assert!(!s.explicit);
        assert!(socket(&c.proxy, true).is_none());
        let c = egress_config::Config::parse("[proxy]\nhandoff = \"/run/h.sock\"\n", "f").unwrap();
        for own in [false, true] {
            let s = socket(&c.proxy, own).unwrap();
            assert_eq!((s.path.to_str(), s.explicit), (Some("/run/h.sock"), true));
        }
    }
}
