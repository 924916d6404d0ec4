//! The load generators, one per figure, all on one thread (like `wrk -t1`):
//! keep-alive small requests, CONNECT tunnel bulk, new tunnels, idle tunnels
//! and denials. Every client socket is bound by [`Binder`] to its own source
//! address and port, so churning connections never runs out of ports.

use crate::procfs::{cpu_seconds, open_fds, rss_kib, syn_retransmits};
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// Hands out client source addresses `127.1.0.1`–`127.1.0.254` × a port range
/// below the ephemeral range, round robin: a pair comes back only after
/// ~5 million connections, long after its TIME_WAIT (60 s) has ended.
pub struct Binder {
    next: AtomicU64,
    lo: u16,
    n: u64,
}

impl Binder {
    /// Ports `10000` up to the kernel's ephemeral range (`ip_local_port_range`).
    pub fn new() -> Binder {
        let first_ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|s| s.split_whitespace().next().and_then(|p| p.parse::<u16>().ok()))
            .unwrap_or(32768);
        let (lo, hi) = if first_ephemeral > 12_000 {
            (10_000, first_ephemeral)
        } else {
            (61_000, 65_535)
        };
        Binder {
            next: AtomicU64::new(0),
            lo,
            n: u64::from(hi - lo),
        }
    }

    fn source(&self) -> SocketAddr {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        let ip = Ipv4Addr::new(127, 1, 0, (i % 254 + 1) as u8);
        let port = self.lo + ((i / 254) % self.n) as u16;
        SocketAddr::V4(SocketAddrV4::new(ip, port))
    }

    /// A TCP connection to `to` from the next source address (skipping pairs
    /// still in use).
    pub async fn connect(&self, to: SocketAddr) -> io::Result<TcpStream> {
        let mut last = None;
        for _ in 0..64 {
            let sock = TcpSocket::new_v4()?;
            sock.set_reuseaddr(true)?;
            if let Err(e) = sock.bind(self.source()) {
                last = Some(e);
                continue;
            }
            match sock.connect(to).await {
                Ok(s) => {
                    s.set_nodelay(true)?;
                    return Ok(s);
                }
                Err(e) if e.kind() == io::ErrorKind::AddrNotAvailable || e.kind() == io::ErrorKind::AddrInUse => {
                    last = Some(e)
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no source address")))
    }
}

/// Where a client sends its requests: straight to the origin, or through a
/// forward proxy that knows the origin as `authority`.
#[derive(Clone)]
pub struct Path {
    pub name: String,
    pub addr: SocketAddr,
    /// `None` for the direct path.
    pub proxy: Option<ProxyTarget>,
    /// The process whose CPU time and memory are measured.
    pub pid: Option<u32>,
}

#[derive(Clone)]
pub struct ProxyTarget {
    /// The origin as this proxy is asked for it (`host:port`).
    pub authority: String,
    /// `Proxy-Authorization` value, for egress-proxy.
    pub auth: Option<String>,
}

impl Path {
    /// A GET of `path` on the origin, in origin form (direct) or absolute form.
    pub fn get(&self, origin_host: &str, path: &str) -> Vec<u8> {
        match &self.proxy {
            None => format!("GET {path} HTTP/1.1\r\nHost: {origin_host}\r\n\r\n").into_bytes(),
            Some(p) => format!(
                "GET http://{a}{path} HTTP/1.1\r\nHost: {a}\r\n{}\r\n",
                auth_line(&p.auth),
                a = p.authority
            )
            .into_bytes(),
        }
    }

    fn connect_request(&self) -> Option<Vec<u8>> {
        self.proxy.as_ref().map(|p| {
            format!(
                "CONNECT {a} HTTP/1.1\r\nHost: {a}\r\n{}\r\n",
                auth_line(&p.auth),
                a = p.authority
            )
            .into_bytes()
        })
    }

    /// A connection to the origin: direct, or a tunnel through the proxy.
    pub async fn open(&self, b: &Binder, buf: usize) -> io::Result<Conn> {
        let mut c = Conn::new(b.connect(self.addr).await?, buf);
        if let Some(req) = self.connect_request() {
            c.s.write_all(&req).await?;
            let h = c.head().await?;
            if h.status != 200 {
                return Err(io::Error::other(format!(
                    "{}: CONNECT answered {}",
                    self.name, h.status
                )));
            }
        }
        Ok(c)
    }
}

fn auth_line(auth: &Option<String>) -> String {
    auth.as_ref()
        .map(|a| format!("Proxy-Authorization: {a}\r\n"))
        .unwrap_or_default()
}

/// A response head, as far as a benchmark client needs it.
pub struct Head {
    pub status: u16,
    length: Option<u64>,
    chunked: bool,
    pub close: bool,
}

/// A client connection (TCP, or TLS over it) with its read buffer.
pub struct Conn<S = TcpStream> {
    pub s: S,
    buf: Vec<u8>,
    lo: usize,
    hi: usize,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<S> {
    pub fn new(s: S, cap: usize) -> Conn<S> {
        Conn {
            s,
            buf: vec![0; cap],
            lo: 0,
            hi: 0,
        }
    }

    /// The stream, once nothing read from it is left unconsumed (after a
    /// `CONNECT`'s `200`, before a TLS handshake over the tunnel).
    pub fn into_stream(self) -> io::Result<S> {
        if self.lo != self.hi {
            return Err(io::Error::other("bytes after the CONNECT response"));
        }
        Ok(self.s)
    }

    async fn fill(&mut self) -> io::Result<()> {
        if self.lo == self.hi {
            (self.lo, self.hi) = (0, 0);
        } else if self.hi == self.buf.len() {
            self.buf.copy_within(self.lo..self.hi, 0);
            (self.lo, self.hi) = (0, self.hi - self.lo);
            if self.hi == self.buf.len() {
                self.buf.resize(self.buf.len() * 2, 0);
            }
        }
        let n = self.s.read(&mut self.buf[self.hi..]).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.hi += n;
        Ok(())
    }

    async fn line(&mut self) -> io::Result<Vec<u8>> {
        loop {
            if let Some(p) = find(&self.buf[self.lo..self.hi], b"\r\n") {
                let l = self.buf[self.lo..self.lo + p].to_vec();
                self.lo += p + 2;
                return Ok(l);
            }
            self.fill().await?;
        }
    }

    /// Reads a response head.
    pub async fn head(&mut self) -> io::Result<Head> {
        loop {
            if let Some(p) = find(&self.buf[self.lo..self.hi], b"\r\n\r\n") {
                let head = parse_head(&self.buf[self.lo..self.lo + p])?;
                self.lo += p + 4;
                return Ok(head);
            }
            self.fill().await?;
        }
    }

    async fn skip(&mut self, mut n: u64) -> io::Result<()> {
        while n > 0 {
            if self.lo == self.hi {
                self.fill().await?;
            }
            let take = n.min((self.hi - self.lo) as u64);
            self.lo += take as usize;
            n -= take;
        }
        Ok(())
    }

    /// Reads (and drops) the body of a response with head `h`.
    pub async fn body(&mut self, h: &Head) -> io::Result<u64> {
        if let Some(n) = h.length {
            self.skip(n).await?;
            return Ok(n);
        }
        if h.chunked {
            let mut total = 0;
            loop {
                let l = self.line().await?;
                let hex = String::from_utf8_lossy(&l);
                let size = u64::from_str_radix(hex.split(';').next().unwrap_or("").trim(), 16)
                    .map_err(|_| io::Error::other("bad chunk size"))?;
                if size == 0 {
                    while !self.line().await?.is_empty() {}
                    return Ok(total);
                }
                self.skip(size).await?;
                self.line().await?;
                total += size;
            }
        }
        // Neither length nor chunks: the body ends with the connection.
        let mut total = (self.hi - self.lo) as u64;
        (self.lo, self.hi) = (0, 0);
        loop {
            match self.s.read(&mut self.buf).await? {
                0 => return Ok(total),
                n => total += n as u64,
            }
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn parse_head(raw: &[u8]) -> io::Result<Head> {
    let text = std::str::from_utf8(raw).map_err(|_| io::Error::other("response head is not UTF-8"))?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| io::Error::other(format!("bad status line {status_line:?}")))?;
    let mut head = Head {
        status,
        length: None,
        chunked: false,
        close: status_line.starts_with("HTTP/1.0"),
    };
    for l in lines {
        let Some((k, v)) = l.split_once(':') else { continue };
        let v = v.trim();
        if k.eq_ignore_ascii_case("content-length") {
            head.length = v.parse().ok();
        } else if k.eq_ignore_ascii_case("transfer-encoding") {
            head.chunked = v.to_ascii_lowercase().contains("chunked");
        } else if k.eq_ignore_ascii_case("connection") || k.eq_ignore_ascii_case("proxy-connection") {
            head.close = v.eq_ignore_ascii_case("close");
        }
    }
    Ok(head)
}

/// When clients count: after the warm-up, until the stop.
#[derive(Default)]
pub struct Phase {
    measuring: AtomicBool,
    stop: AtomicBool,
}

impl Phase {
    pub(crate) fn counting(&self) -> bool {
        self.measuring.load(Ordering::Relaxed) && !self.stop.load(Ordering::Relaxed)
    }

    pub(crate) fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
}

/// What one timed window of a load measured.
pub struct Window {
    /// Operations completed per second.
    pub rate: f64,
    /// Latency quantiles of the counted operations, in ms.
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// CPU time of the measured process per operation, in µs.
    pub cpu_us_per_op: Option<f64>,
    pub ops: u64,
    /// Reconnects (keep-alive) or failed operations (everything else).
    pub errors: u64,
    /// SYNs retransmitted on the machine during the window (a stalled connect).
    pub syn_retransmits: Option<u64>,
    /// User-space instructions of the measured process per operation (with
    /// `--callgrind`, see `callgrind.rs`).
    pub instructions_per_op: Option<f64>,
}

pub struct Timing {
    pub warm: Duration,
    pub secs: Duration,
}

/// Runs `clients` loops of `op` for the warm-up and the window, and measures
/// the window: completed operations, their latency, and `pid`'s CPU time.
pub(crate) async fn drive<F, Fut>(clients: usize, t: &Timing, pid: Option<u32>, op: F) -> Window
where
    F: Fn(usize, Arc<Phase>) -> Fut,
    Fut: std::future::Future<Output = (Vec<u32>, u64)> + Send + 'static,
{
    let phase = Arc::new(Phase::default());
    let tasks: Vec<_> = (0..clients).map(|i| tokio::spawn(op(i, phase.clone()))).collect();
    tokio::time::sleep(t.warm).await;
    let counting = crate::callgrind::start(pid);
    let cpu0 = pid.and_then(cpu_seconds);
    let syn0 = syn_retransmits();
    let t0 = Instant::now();
    phase.measuring.store(true, Ordering::Relaxed);
    tokio::time::sleep(t.secs).await;
    phase.stop.store(true, Ordering::Relaxed);
    let elapsed = t0.elapsed().as_secs_f64();
    let cpu1 = pid.and_then(cpu_seconds);
    let instructions = pid.filter(|_| counting).and_then(crate::callgrind::instructions);
    let syn1 = syn_retransmits();
    let mut lat = vec![];
    let mut errors = 0;
    for task in tasks {
        if let Ok(Ok((l, e))) = tokio::time::timeout(Duration::from_secs(30), task).await {
            lat.extend(l);
            errors += e;
        }
    }
    lat.sort_unstable();
    let ops = lat.len() as u64;
    let q = |p: f64| {
        lat.get(((lat.len().max(1) - 1) as f64 * p).round() as usize)
            .map_or(0.0, |us| f64::from(*us) / 1000.0)
    };
    Window {
        rate: ops as f64 / elapsed,
        p50_ms: q(0.5),
        p99_ms: q(0.99),
        cpu_us_per_op: match (cpu0, cpu1) {
            (Some(a), Some(b)) if ops > 0 => Some((b - a) * 1e6 / ops as f64),
            _ => None,
        },
        ops,
        errors,
        syn_retransmits: syn0.zip(syn1).map(|(a, b)| b.saturating_sub(a)),
        instructions_per_op: instructions.filter(|_| ops > 0).map(|i| i as f64 / ops as f64),
    }
}

pub(crate) fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// `conns` keep-alive connections, each sending `req` and reading the
/// response in a loop. A proxy that closes the connection (with or without
/// saying so) costs the client a reconnect, inside the request's latency.
pub async fn keepalive(b: &Arc<Binder>, path: &Path, req: Vec<u8>, conns: usize, t: &Timing) -> Window {
    let req: Arc<[u8]> = req.into();
    drive(conns, t, path.pid, |_, phase| {
        let (b, path, req) = (b.clone(), path.clone(), req.clone());
        async move {
            let mut lat = vec![];
            let mut reconnects = 0;
            let mut conn: Option<Conn> = None;
            while !phase.stopped() {
                let t0 = Instant::now();
                let mut tries = 0;
                let ok = loop {
                    tries += 1;
                    let c = match conn.take() {
                        Some(c) => c,
                        None => match b.connect(path.addr).await {
                            Ok(s) => Conn::new(s, 16 * 1024),
                            Err(_) => break false,
                        },
                    };
                    match exchange(c, &req).await {
                        Ok((c, keep)) => {
                            conn = keep.then_some(c);
                            break true;
                        }
                        Err(_) if tries < 3 => reconnects += 1,
                        Err(_) => break false,
                    }
                };
                if ok && phase.counting() {
                    lat.push(micros(t0.elapsed()));
                } else if !ok {
                    reconnects += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            (lat, reconnects)
        }
    })
    .await
}

/// Sends `req` on `c` and reads a `200` response; the connection, and
/// whether it stays open.
pub(crate) async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    mut c: Conn<S>,
    req: &[u8],
) -> io::Result<(Conn<S>, bool)> {
    c.s.write_all(req).await?;
    let h = c.head().await?;
    if h.status != 200 {
        return Err(io::Error::other(format!("status {}", h.status)));
    }
    c.body(&h).await?;
    Ok((c, !h.close))
}

/// New tunnels to the origin through a proxy, `in_flight` at a time:
/// `CONNECT` → `200` → close.
pub async fn new_tunnels(b: &Arc<Binder>, path: &Path, in_flight: usize, t: &Timing) -> Window {
    drive(in_flight, t, path.pid, |_, phase| {
        let (b, path) = (b.clone(), path.clone());
        async move {
            let mut lat = vec![];
            let mut failed = 0;
            while !phase.stopped() {
                let t0 = Instant::now();
                match path.open(&b, 1024).await {
                    Ok(c) => {
                        drop(c);
                        if phase.counting() {
                            lat.push(micros(t0.elapsed()));
                        }
                    }
                    Err(_) => {
                        failed += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
            (lat, failed)
        }
    })
    .await
}

/// Sequential downloads of `bytes` over one tunnel (or direct connection)
/// each; the median MiB/s and the measured process's CPU seconds per GiB.
pub async fn bulk(b: &Arc<Binder>, path: &Path, req: &[u8], bytes: u64, reps: usize) -> io::Result<(f64, Option<f64>)> {
    let cpu0 = path.pid.and_then(cpu_seconds);
    let mut rates = vec![];
    for _ in 0..reps {
        let mut c = path.open(b, 256 * 1024).await?;
        let t0 = Instant::now();
        c.s.write_all(req).await?;
        let h = c.head().await?;
        let got = c.body(&h).await?;
        if h.status != 200 || got != bytes {
            return Err(io::Error::other(format!("status {}, {got} of {bytes} bytes", h.status)));
        }
        rates.push(bytes as f64 / (1 << 20) as f64 / t0.elapsed().as_secs_f64());
    }
    let cpu1 = path.pid.and_then(cpu_seconds);
    rates.sort_by(f64::total_cmp);
    let gib = (bytes as f64 * reps as f64) / (1u64 << 30) as f64;
    let cpu = match (cpu0, cpu1) {
        (Some(a), Some(b)) => Some((b - a) / gib),
        _ => None,
    };
    Ok((rates[rates.len() / 2], cpu))
}

/// Opens tunnels `in_flight` at a time until `counts` (ascending) are open,
/// leaving them idle, and returns for each count the measured process's RSS
/// growth per tunnel in KiB and descriptors per tunnel (both from before the
/// first one).
pub async fn idle_tunnels(
    b: &Arc<Binder>,
    path: &Path,
    counts: &[usize],
    in_flight: usize,
) -> io::Result<Vec<(usize, f64, f64)>> {
    let pid = path
        .pid
        .ok_or_else(|| io::Error::other("idle tunnels need a process to measure"))?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let base = rss_kib(pid).ok_or_else(|| io::Error::other("no RSS"))?;
    let fds = open_fds(pid).unwrap_or(0);
    let mut held: Vec<Conn> = vec![];
    let mut out = vec![];
    for &n in counts {
        let opened = Arc::new(AtomicUsize::new(held.len()));
        let workers: Vec<_> = (0..in_flight)
            .map(|_| {
                let (b, path, opened) = (b.clone(), path.clone(), opened.clone());
                tokio::spawn(async move {
                    let mut mine = vec![];
                    while opened.fetch_add(1, Ordering::Relaxed) < n {
                        mine.push(path.open(&b, 256).await?);
                    }
                    Ok::<_, io::Error>(mine)
                })
            })
            .collect();
        for w in workers {
            held.extend(w.await.map_err(io::Error::other)??);
        }
        // Let the proxy settle (tasks parked, buffers returned), then measure.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let rss = rss_kib(pid).ok_or_else(|| io::Error::other("no RSS"))?;
        let fd_growth = open_fds(pid).unwrap_or(0).saturating_sub(fds);
        out.push((
            n,
            rss.saturating_sub(base) as f64 / n as f64,
            fd_growth as f64 / n as f64,
        ));
    }
    drop(held);
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok(out)
}

/// Keep-alive clients, each with its own run (`auths[i]`), asking for names
/// the tool does not list, all distinct per client (little folding).
pub async fn denials(b: &Arc<Binder>, proxy: &Path, auths: Vec<String>, t: &Timing) -> Window {
    let auths = Arc::new(auths);
    drive(auths.len(), t, proxy.pid, |c, phase| {
        let (b, addr, auths) = (b.clone(), proxy.addr, auths.clone());
        async move {
            let mut lat = vec![];
            let mut errors = 0;
            let mut conn: Option<Conn> = None;
            let mut i = 0u64;
            while !phase.stopped() {
                let target = format!("c{c}-{}.test", i % 1000);
                i += 1;
                let req = format!(
                    "GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: {}\r\n\r\n",
                    auths[c]
                );
                let t0 = Instant::now();
                let mut c = match conn.take() {
                    Some(c) => c,
                    None => match b.connect(addr).await {
                        Ok(s) => Conn::new(s, 4096),
                        Err(_) => {
                            errors += 1;
                            continue;
                        }
                    },
                };
                let r = async {
                    c.s.write_all(req.as_bytes()).await?;
                    let h = c.head().await?;
                    c.body(&h).await?;
                    Ok::<_, io::Error>(h)
                }
                .await;
                match r {
                    Ok(h) if h.status == 403 => {
                        if phase.counting() {
                            lat.push(micros(t0.elapsed()));
                        }
                        if !h.close {
                            conn = Some(c);
                        }
                    }
                    _ => errors += 1,
                }
            }
            (lat, errors)
        }
    })
    .await
}
