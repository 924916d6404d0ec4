//! Host-side unix sockets a confined tool must not reach: a world-writable
//! stream listener at a path, one at an abstract name, and a world-writable
//! datagram receiver at a path, each counting what arrives. Created by the
//! test on the host side (the executor's own namespaces); paths are removed on
//! drop.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Where a unix canary listens.
#[derive(Debug, Clone)]
pub enum UnixAddr {
    /// A socket file (mode 0777, like a permissive host service's).
    Path(PathBuf),
    /// An abstract name (without the leading NUL).
    Abstract(String),
}

/// A counting unix socket on the host side.
pub struct UnixCanary {
    pub addr: UnixAddr,
    count: Arc<AtomicUsize>,
}

impl UnixCanary {
    /// A stream listener at `path` (mode 0777), counting accepted connections.
    pub fn stream_at(path: &Path) -> UnixCanary {
        let _ = std::fs::remove_file(path);
        let l = std::os::unix::net::UnixListener::bind(path).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o777)).unwrap();
        Self::serve_stream(l, UnixAddr::Path(path.to_path_buf()))
    }

    /// A stream listener at the abstract name `name`, counting connections.
    pub fn stream_abstract(name: &str) -> UnixCanary {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let l = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
        Self::serve_stream(l, UnixAddr::Abstract(name.to_string()))
    }

    /// An unconnected datagram socket at `path` (mode 0777), counting datagrams.
    pub fn datagram_at(path: &Path) -> UnixCanary {
        let _ = std::fs::remove_file(path);
        let s = std::os::unix::net::UnixDatagram::bind(path).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o777)).unwrap();
        s.set_nonblocking(true).unwrap();
        let s = tokio::net::UnixDatagram::from_std(s).unwrap();
        let count = Arc::new(AtomicUsize::new(0));
        let c = count.clone();
        tokio::spawn(async move {
            let mut b = [0u8; 1024];
            while s.recv(&mut b).await.is_ok() {
                c.fetch_add(1, Ordering::SeqCst);
            }
        });
        UnixCanary {
            addr: UnixAddr::Path(path.to_path_buf()),
            count,
        }
    }

    fn serve_stream(l: std::os::unix::net::UnixListener, addr: UnixAddr) -> UnixCanary {
        l.set_nonblocking(true).unwrap();
        let l = tokio::net::UnixListener::from_std(l).unwrap();
        let count = Arc::new(AtomicUsize::new(0));
        let c = count.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                c.fetch_add(1, Ordering::SeqCst);
                drop(s);
            }
        });
        UnixCanary { addr, count }
    }

    /// Connections accepted (stream) or datagrams received so far.
    pub fn hits(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    /// The path or abstract name, as a tool's input names it.
    pub fn target(&self) -> String {
        match &self.addr {
            UnixAddr::Path(p) => p.display().to_string(),
            UnixAddr::Abstract(n) => n.clone(),
        }
    }
}

impl Drop for UnixCanary {
    fn drop(&mut self) {
        if let UnixAddr::Path(p) = &self.addr {
            let _ = std::fs::remove_file(p);
        }
    }
}
