//! The network namespace of a confined child: only `lo`, with the run's
//! proxy listener on `127.0.0.1:3128` its only exit (for a transparent tool,
//! also the routes, nftables rules and sockets of `transparent`). Namespaces
//! are made ahead by a background thread, one pool for plain ones and one
//! for transparent ones, so a cold start does not wait for the kernel.

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::OwnedFd;
use std::sync::OnceLock;

use crate::confine::transparent;
use crate::sys;

/// Port of the in-namespace proxy listener a confined child sees.
pub const CHILD_PROXY_PORT: u16 = 3128;
/// The address a confined child's proxy variables name.
pub const CHILD_PROXY: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, CHILD_PROXY_PORT);

/// Whether the host gives a child a network namespace of its own (probed
/// once by `confine::host`).
pub fn support() -> Result<String, String> {
    match sys::new_netns(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)) {
        Ok(_) => Ok("own namespace with only lo; the proxy listener is the only exit".to_string()),
        Err(e) => Err(format!("cannot create a network namespace: {e}")),
    }
}

/// Namespaces kept ready, so a cold start does not wait for the kernel to
/// build one (a few ms here): each is fresh, holds only `lo` and its listener,
/// and is used by exactly one child.
const READY_NAMESPACES: usize = 4;

/// A network namespace made for one child: its proxy listener, and for a
/// transparent tool the four sockets of the transparent hand-off.
pub struct Namespace {
    pub ns: OwnedFd,
    pub listener: std::net::TcpListener,
    pub transparent: Option<[OwnedFd; 4]>,
}

/// Ready network namespaces with their proxy listener, refilled by a
/// background thread. One pool for plain namespaces, one for transparent
/// ones (routes, nftables rules and sockets made in advance too).
pub struct NetnsPool {
    ready: std::sync::Mutex<Vec<Namespace>>,
    wanted: std::sync::Condvar,
    transparent: bool,
}

/// The pool of ready namespaces of one kind, started on first use.
pub fn pool(transparent: bool) -> &'static NetnsPool {
    static PLAIN: OnceLock<&'static NetnsPool> = OnceLock::new();
    static TRANSPARENT: OnceLock<&'static NetnsPool> = OnceLock::new();
    let cell = if transparent { &TRANSPARENT } else { &PLAIN };
    cell.get_or_init(|| {
        let pool: &'static NetnsPool = Box::leak(Box::new(NetnsPool {
            ready: std::sync::Mutex::new(Vec::new()),
            wanted: std::sync::Condvar::new(),
            transparent,
        }));
        let spawned = std::thread::Builder::new()
            .name("loom-netns-pool".into())
            .spawn(move || pool.refill());
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the namespace pool thread; namespaces are created per child");
        }
        pool
    })
}

/// A new namespace for a child: plain, or set up for transparent egress.
pub fn new_namespace(transparent: bool) -> io::Result<Namespace> {
    if !transparent {
        let (ns, listener) = sys::new_netns(CHILD_PROXY)?;
        return Ok(Namespace {
            ns,
            listener,
            transparent: None,
        });
    }
    let nft = transparent::nft().map_err(io::Error::other)?;
    let (ns, listener, sockets) = sys::new_netns_with(CHILD_PROXY, move || transparent::set_up(&nft))?;
    Ok(Namespace {
        ns,
        listener,
        transparent: Some(sockets),
    })
}

impl NetnsPool {
    /// A ready namespace, or a new one if none is ready.
    pub fn take(&self) -> io::Result<Namespace> {
        let got = match self.ready.lock() {
            Ok(mut r) => r.pop(),
            Err(_) => None,
        };
        self.wanted.notify_one();
        match got {
            Some(ns) => Ok(ns),
            None => new_namespace(self.transparent),
        }
    }

    fn refill(&self) {
        loop {
            let short = match self.ready.lock() {
                Ok(r) => {
                    let r = self
                        .wanted
                        .wait_while(r, |r| r.len() >= READY_NAMESPACES)
                        .unwrap_or_else(|p| p.into_inner());
                    r.len() < READY_NAMESPACES
                }
                Err(_) => return,
            };
            if !short {
                continue;
            }
            match new_namespace(self.transparent) {
                Ok(ns) => {
                    if let Ok(mut r) = self.ready.lock() {
                        r.push(ns);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, transparent = self.transparent, "cannot prepare a network namespace");
                    std::thread::sleep(std::time::Duration::from_secs(1));
                }
            }
        }
    }
}
