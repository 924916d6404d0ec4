//! Transparent egress, the executor's side (`network = "transparent"`): the
//! child's network namespace made so that an unmodified client reaches the
//! proxy without knowing it (routes, an nftables redirect, four sockets
//! handed to the proxy; see `set_up`). The proxy decides; the namespace is
//! the fence, and nothing here decides anything.

use std::collections::HashSet;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsFd as _, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::sys;

/// Port of the in-namespace listeners every redirected TCP connection ends on.
pub const PORT: u16 = 3127;
/// Port of the in-namespace DNS (UDP and TCP, IPv4 and IPv6).
pub const DNS_PORT: u16 = 53;
/// The nftables counter of UDP datagrams dropped in a namespace.
pub const UDP_DROPPED: &str = "udp_dropped";

/// The nftables table of a transparent namespace. `ct status dnat accept`
/// first in the filter chain: the output hook's filter sees a redirected
/// connection with its original (outside) address.
pub const RULESET: &str = "table inet loom {
  counter udp_dropped { }
  chain nat_out {
    type nat hook output priority -100; policy accept;
    udp dport 53 redirect to :53
    tcp dport 53 redirect to :53
    ip daddr != 127.0.0.0/8 meta l4proto tcp redirect to :3127
    ip6 daddr != ::1 meta l4proto tcp redirect to :3127
  }
  chain filter_out {
    type filter hook output priority 0; policy accept;
    ct status dnat accept
    ip daddr != 127.0.0.0/8 meta l4proto udp counter name udp_dropped drop
    ip6 daddr != ::1 meta l4proto udp counter name udp_dropped drop
    ip daddr != 127.0.0.0/8 counter drop
    ip6 daddr != ::1 counter drop
  }
}
";

/// Whether transparent egress works on this host (probed once, when a
/// transparent tool or `doctor` first asks): `nft` is there, and a
/// namespace gets its routes, rules and sockets. `Ok` says what it costs.
pub fn support() -> Result<String, String> {
    static SUPPORT: OnceLock<Result<String, String>> = OnceLock::new();
    SUPPORT
        .get_or_init(|| {
            let nft = nft()?;
            let t0 = std::time::Instant::now();
            let made = sys::new_netns_with(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0), move || {
                set_up(&nft)
            });
            match made {
                Ok(_) => Ok(format!(
                    "nftables redirect in each child's namespace (set up in {:.1} ms here, kept ready in the background)",
                    t0.elapsed().as_secs_f64() * 1e3
                )),
                Err(e) => Err(format!("cannot set up a transparent namespace: {e}")),
            }
        })
        .clone()
}

/// Where `nft` is looked for (the executor's own `PATH` is not trusted to
/// name it, and may be empty under a service manager).
const NFT_PATHS: &[&str] = &["/usr/sbin/nft", "/sbin/nft", "/usr/bin/nft", "/bin/nft"];

/// The `nft` binary, or why transparent egress is unavailable.
pub fn nft() -> Result<PathBuf, String> {
    NFT_PATHS
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or_else(|| {
            format!(
                "no nft binary (looked in {}): install nftables (Debian/Ubuntu: apt-get install nftables)",
                NFT_PATHS.join(", ")
            )
        })
}

/// Sets up the calling thread's (new, empty) network namespace for
/// transparent egress and returns its four sockets, in the hand-off's order.
/// Only on a thread that is inside the namespace and exits after
/// (`sys::new_netns_with`):
///
/// - routes `default dev lo` (IPv4 with source `127.0.0.1`, IPv6 with `::1`),
///   so a connect to any address is routed at all (rtnetlink, [`routes`]);
/// - the nftables table [`RULESET`] (applied by `nft -f -`, spawned from that
///   thread, so it runs in the namespace): DNS to any server (UDP and TCP
///   port 53) is redirected to `127.0.0.1:53`, every other TCP connect to a
///   non-loopback address to port 3127 (`SO_ORIGINAL_DST` keeps where it was
///   going), and every other packet to a non-loopback address is dropped
///   (UDP first, in the named counter [`UDP_DROPPED`]: QUIC, DNS over other
///   ports, anything; read by [`udp_dropped`] once the child is gone);
/// - the four sockets of `egress_api::handoff::TRANSPARENT`, handed to the
///   proxy for the run beside the proxy listener. The DNS pair is bound on
///   `[::]:53` accepting IPv4 too, so a `resolv.conf` that names only IPv6
///   nameservers resolves as well as one naming IPv4 ones.
pub fn set_up(nft: &Path) -> io::Result<[OwnedFd; 4]> {
    routes()?;
    apply(nft, RULESET)?;
    sockets()
}

/// The four sockets, in `egress_api::handoff::TRANSPARENT`'s order.
fn sockets() -> io::Result<[OwnedFd; 4]> {
    let t4 = std::net::TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, PORT))?;
    let t6 = std::net::TcpListener::bind(SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::LOCALHOST, PORT, 0, 0)))
        .map_err(|e| io::Error::new(e.kind(), format!("[::1]:{PORT} (is IPv6 disabled on this host?): {e}")))?;
    let udp = dual_stack(SocketType::DGRAM)?;
    let dns = dual_stack(SocketType::STREAM)?;
    rustix::net::listen(&dns, 128)?;
    Ok([t4.into(), t6.into(), udp, dns])
}

use rustix::net::SocketType;

/// A socket on `[::]:53` that takes IPv4 too (`IPV6_V6ONLY` off, whatever
/// the host's `bindv6only`): the redirect sends IPv4 DNS to `127.0.0.1:53`
/// and IPv6 DNS to `[::1]:53`, both of which it receives. The namespace has
/// only `lo`, so `[::]` is loopback here.
fn dual_stack(ty: SocketType) -> io::Result<OwnedFd> {
    use rustix::net::{AddressFamily, SocketFlags};
    let fd = rustix::net::socket_with(AddressFamily::INET6, ty, SocketFlags::CLOEXEC, None)?;
    rustix::net::sockopt::set_ipv6_v6only(&fd, false)?;
    rustix::net::sockopt::set_socket_reuseaddr(&fd, true)?;
    rustix::net::bind(&fd, &SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, DNS_PORT, 0, 0)).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("[::]:{DNS_PORT} (is IPv6 disabled on this host?): {e}"),
        )
    })?;
    Ok(fd)
}

/// How many UDP datagrams the namespace `ns` dropped (the [`UDP_DROPPED`]
/// counter), read by `nft list counter` run inside it from a short-lived
/// thread. For after the child is gone: the namespace fd keeps it alive.
pub fn udp_dropped(nft: &Path, ns: std::os::fd::BorrowedFd<'_>) -> io::Result<u64> {
    let ns = ns.try_clone_to_owned()?;
    let nft = nft.to_path_buf();
    std::thread::Builder::new()
        .name("loom-netns-read".into())
        .spawn(move || -> io::Result<u64> {
            rustix::thread::move_into_link_name_space(ns.as_fd(), Some(rustix::thread::LinkNameSpaceType::Network))?;
            let out = run_nft(&nft, &["list", "counter", "inet", "loom", UDP_DROPPED], "")?;
            packets(&out).ok_or_else(|| io::Error::other(format!("unexpected `nft list counter` output: {out:.200}")))
        })?
        .join()
        .map_err(|_| io::Error::other("the namespace thread panicked"))?
}

/// The `packets N` of an `nft list counter` answer.
fn packets(listing: &str) -> Option<u64> {
    let mut words = listing.split_whitespace();
    words.find(|w| *w == "packets")?;
    words.next()?.parse().ok()
}

/// Runs `nft -f -` with `rules` (in the calling thread's namespace: a child
/// inherits the forking thread's).
fn apply(nft: &Path, rules: &str) -> io::Result<()> {
    run_nft(nft, &["-f", "-"], rules).map(drop)
}

/// Pids of the executor's own short-lived helper processes (`nft` setting up a
/// transparent namespace), which the reaper's sweep (`process::reaper`)
/// leaves alone. Held across their spawn, so a sweep never sees one that is
/// not listed yet.
static HELPERS: Mutex<Option<HashSet<i32>>> = Mutex::new(None);

/// Runs `spawn` (which starts one helper process and returns it) with the
/// helper list locked, and lists the helper's pid until `wait` is done.
pub fn helper<C, T>(
    spawn: impl FnOnce() -> std::io::Result<C>,
    pid: impl Fn(&C) -> u32,
    wait: impl FnOnce(C) -> std::io::Result<T>,
) -> std::io::Result<T> {
    let child = {
        let mut helpers = HELPERS.lock().unwrap_or_else(|p| p.into_inner());
        let child = spawn()?;
        helpers.get_or_insert_with(HashSet::new).insert(pid(&child) as i32);
        child
    };
    let id = pid(&child) as i32;
    let out = wait(child);
    if let Some(h) = HELPERS.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
        h.remove(&id);
    }
    out
}

/// The helper list, locked: held by the reaper's sweep across its scan, so
/// no helper is spawned meanwhile unlisted.
pub fn helpers() -> MutexGuard<'static, Option<HashSet<i32>>> {
    HELPERS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `nft <args>` with `input` on its stdin in the calling thread's
/// namespace; its stdout, or why it failed.
fn run_nft(nft: &Path, args: &[&str], input: &str) -> io::Result<String> {
    use std::io::Write as _;
    // Listed as the executor's own helper while it runs: the subreaper's
    // sweep kills every other child it did not spawn.
    let out = helper(
        || {
            Command::new(nft)
                .args(args)
                .env_clear()
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| io::Error::new(e.kind(), format!("cannot run {}: {e}", nft.display())))
        },
        |c| c.id(),
        |mut child| {
            // A write error (nft gone early) shows in its status and stderr;
            // it is waited for either way.
            if let Some(mut stdin) = child.stdin.take() {
                let _ = stdin.write_all(input.as_bytes());
            }
            child.wait_with_output()
        },
    )?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let err: String = err.trim().chars().take(400).collect();
    Err(io::Error::other(format!(
        "{} {} failed ({}): {err}",
        nft.display(),
        args.join(" "),
        out.status
    )))
}

/// `RTM_NEWROUTE`, `NLMSG_ERROR` and the flags and attributes used here
/// (linux/rtnetlink.h, linux/netlink.h).
const RTM_NEWROUTE: u16 = 24;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const RTA_OIF: u16 = 4;
const RTA_PREFSRC: u16 = 7;
/// `lo` is interface 1 in every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;

/// The `RTM_NEWROUTE` message for `default dev lo src <src>`.
fn route_message(seq: u32, src: std::net::IpAddr) -> Vec<u8> {
    let (family, scope, src) = match src {
        // RT_SCOPE_LINK, as `ip route add default dev lo` makes it.
        std::net::IpAddr::V4(a) => (libc::AF_INET as u8, 253u8, a.octets().to_vec()),
        std::net::IpAddr::V6(a) => (libc::AF_INET6 as u8, 0u8, a.octets().to_vec()),
    };
    let attrs: [(u16, Vec<u8>); 2] = [(RTA_OIF, LOOPBACK_IFINDEX.to_ne_bytes().to_vec()), (RTA_PREFSRC, src)];
    let mut body = vec![
        family, 0,   /* dst_len */
        0,   /* src_len */
        0,   /* tos */
        254, /* RT_TABLE_MAIN */
        4,   /* RTPROT_STATIC */
        scope, 1, /* RTN_UNICAST */
        0, 0, 0, 0, /* flags */
    ];
    for (ty, v) in attrs {
        let len = 4 + v.len();
        body.extend_from_slice(&(len as u16).to_ne_bytes());
        body.extend_from_slice(&ty.to_ne_bytes());
        body.extend_from_slice(&v);
        body.resize(body.len().next_multiple_of(4), 0);
    }
    let mut m = Vec::with_capacity(16 + body.len());
    m.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
    m.extend_from_slice(&RTM_NEWROUTE.to_ne_bytes());
    m.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK | NLM_F_EXCL | NLM_F_CREATE).to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.extend_from_slice(&body);
    m
}

/// The kernel's answer to one request: `Ok` for an ack, the error it names.
fn ack(answer: &[u8]) -> io::Result<()> {
    let field = |at: usize| answer.get(at..at + 4).and_then(|b| b.try_into().ok());
    let ty = answer.get(4..6).and_then(|b| b.try_into().ok()).map(u16::from_ne_bytes);
    match (ty, field(16).map(i32::from_ne_bytes)) {
        (Some(NLMSG_ERROR), Some(0)) => Ok(()),
        (Some(NLMSG_ERROR), Some(e)) => Err(io::Error::from_raw_os_error(-e)),
        _ => Err(io::Error::other("rtnetlink: unexpected answer")),
    }
}

/// Adds `default dev lo` for IPv4 and IPv6 in the calling thread's namespace.
fn routes() -> io::Result<()> {
    use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType};
    let sock = rustix::net::socket_with(AddressFamily::NETLINK, SocketType::RAW, SocketFlags::CLOEXEC, None)?;
    for (seq, src) in [(1, Ipv4Addr::LOCALHOST.into()), (2, Ipv6Addr::LOCALHOST.into())] {
        let what = if seq == 1 { "IPv4" } else { "IPv6" };
        let msg = route_message(seq, src);
        rustix::net::send(&sock, &msg, SendFlags::empty())?;
        let mut buf = [0u8; 512];
        let (n, _) = rustix::net::recv(&sock, &mut buf, RecvFlags::empty())?;
        ack(&buf[..n.min(buf.len())])
            .map_err(|e| io::Error::new(e.kind(), format!("cannot add the {what} route default dev lo: {e}")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A helper is listed (so a sweep passes it by) from before its spawn
    /// returns until it has been waited for.
    #[test]
    fn a_helper_is_listed_while_it_runs() {
        let listed = |pid: i32| HELPERS.lock().unwrap().as_ref().is_some_and(|h| h.contains(&pid));
        let mut seen = 0;
        let status = helper(
            || std::process::Command::new("true").spawn(),
            |c| c.id(),
            |mut c| {
                seen = c.id() as i32;
                assert!(listed(seen));
                c.wait()
            },
        )
        .unwrap();
        assert!(status.success());
        assert!(!listed(seen));
    }

    #[test]
    fn the_route_message_is_well_formed() {
        let m = route_message(7, Ipv4Addr::LOCALHOST.into());
        // header 16 + rtmsg 12 + RTA_OIF 8 + RTA_PREFSRC 8
        assert_eq!(m.len(), 44);
        assert_eq!(u32::from_ne_bytes(m[0..4].try_into().unwrap()), 44);
        assert_eq!(u16::from_ne_bytes(m[4..6].try_into().unwrap()), RTM_NEWROUTE);
        assert_eq!(m[16], libc::AF_INET as u8);
        assert_eq!(&m[40..44], &[127, 0, 0, 1]);
        let m6 = route_message(8, Ipv6Addr::LOCALHOST.into());
        assert_eq!(m6.len(), 16 + 12 + 8 + 20);
        let mut ok = vec![0u8; 36];
        ok[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        assert!(ack(&ok).is_ok());
        ok[16..20].copy_from_slice(&(-libc::EEXIST).to_ne_bytes());
        assert_eq!(ack(&ok).unwrap_err().raw_os_error(), Some(libc::EEXIST));
        assert!(ack(&[1, 2]).is_err());
    }

    #[test]
    fn the_counter_listing_is_read() {
        let listing = "table inet loom {\n\tcounter udp_dropped {\n\t\tpackets 3 bytes 114\n\t}\n}\n";
        assert_eq!(packets(listing), Some(3));
        assert_eq!(packets("table inet loom {}"), None);
        assert_eq!(packets("packets lots"), None);
    }
}
