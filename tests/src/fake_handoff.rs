//! A fake of the proxy's listener hand-off socket, for the executor's tests
//! that run against the fake control API: it answers every probe and every
//! hand-off `ok` and counts the hand-offs, but has no proxy behind it, so
//! each handed listener is closed at once (a child's connections to its
//! proxy address are refused). It runs as a task of the test's runtime.

use egress_api::handoff::{MAGIC, OK, PROBE};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A fake hand-off socket.
#[derive(Clone)]
pub struct FakeHandoff {
    pub path: PathBuf,
    handed: Arc<AtomicUsize>,
}

impl FakeHandoff {
    /// Binds `path` (0600, its directory created) and serves it on the
    /// current tokio runtime.
    pub fn start(path: &Path) -> FakeHandoff {
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d).unwrap();
        }
        let _ = std::fs::remove_file(path);
        let std_listener = std::os::unix::net::UnixListener::bind(path).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std_listener.set_nonblocking(true).unwrap();
        let handed = Arc::new(AtomicUsize::new(0));
        let count = handed.clone();
        let rt = tokio::runtime::Handle::try_current()
            .expect("the fake hand-off socket is served by the test's tokio runtime");
        rt.spawn(async move {
            let listener = tokio::net::UnixListener::from_std(std_listener).unwrap();
            while let Ok((mut s, _)) = listener.accept().await {
                let count = count.clone();
                tokio::spawn(async move {
                    // A plain read: a descriptor sent along is discarded
                    // (closed) by the kernel.
                    let mut buf = [0u8; 256];
                    let n = s.read(&mut buf).await.unwrap_or(0);
                    let msg = String::from_utf8_lossy(&buf[..n]);
                    if msg.starts_with(MAGIC) {
                        count.fetch_add(1, Ordering::SeqCst);
                    }
                    let answer = if msg == PROBE || msg.starts_with(MAGIC) {
                        OK.to_string()
                    } else {
                        format!("error not a hand-off message: {msg:?}\n")
                    };
                    let _ = s.write_all(answer.as_bytes()).await;
                });
            }
        });
        FakeHandoff {
            path: path.to_path_buf(),
            handed,
        }
    }

    /// Listeners handed over so far.
    pub fn handed(&self) -> usize {
        self.handed.load(Ordering::SeqCst)
    }
}
