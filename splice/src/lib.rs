//! Relaying bytes between two TCP sockets inside the kernel: each direction
//! moves them socket → pipe → socket with `splice(2)`, so they never enter
//! user space and no user buffer is held. Used by the proxy's CONNECT
//! tunnels and by the executor's relay of a confined child's connections.
//!
//! A direction may be held to an [`Allowance`]: before each read it asks
//! how many bytes it may take, and asks `splice` for no more (its `len`
//! argument), so a byte budget is kept to the byte, not counted after a
//! pipe-full went through.
#![forbid(unsafe_code)]

use rustix::pipe::{PipeFlags, SpliceFlags};
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::io::Interest;
use tokio::net::TcpStream;

/// A new pipe's capacity (Linux's default): what one `splice` moves at most
/// until the pipe grows.
pub const CHUNK: usize = 64 * 1024;

/// The capacity a pipe is grown to once one read has taken at least half of
/// [`CHUNK`]: a direction that moves bulk data then takes up to 1 MiB per
/// call and per wake-up instead of 60 KiB (a socket's pages rarely fill all
/// 16 slots of a default pipe, so "full" is 60 KiB). It is the default
/// `fs.pipe-max-size`; where the kernel refuses (a lower `pipe-max-size`, or
/// the user's pipe pages above `fs.pipe-user-pages-soft`), the pipe keeps
/// its 64 KiB.
pub const GROWN: usize = 1024 * 1024;

/// Grown pipes in this process at most. Linux counts every pipe's capacity
/// against its user's `fs.pipe-user-pages-soft` (64 MiB by default), and an
/// unprivileged user above it gets 8 KiB pipes from then on: 16 grown pipes
/// (16 MiB) leave room for 768 default ones. A direction that finds none
/// free keeps the default pipe.
pub const MAX_GROWN: usize = 16;

static GROWN_NOW: AtomicUsize = AtomicUsize::new(0);

/// Grown pipes open in this process now.
pub fn grown_pipes() -> usize {
    GROWN_NOW.load(Ordering::Relaxed)
}

/// One of the [`MAX_GROWN`] places, given back when dropped (with the pipe).
struct Grant;

impl Grant {
    fn take() -> Option<Grant> {
        GROWN_NOW
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < MAX_GROWN).then_some(n + 1)
            })
            .ok()
            .map(|_| Grant)
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        GROWN_NOW.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Grows the pipe behind `w` to [`GROWN`] if a place is free and the kernel
/// agrees; returns its capacity and the place it holds.
fn grow(w: &OwnedFd) -> (usize, Option<Grant>) {
    let Some(grant) = Grant::take() else {
        return (CHUNK, None);
    };
    match rustix::pipe::fcntl_setpipe_size(w, GROWN) {
        Ok(capacity) => (capacity, Some(grant)),
        Err(_) => (CHUNK, None),
    }
}

/// What one direction may move, asked before every read from its source.
pub trait Allowance {
    /// Before a read of up to `want` bytes (at least one): how many may be
    /// read now.
    fn take(&self, want: usize) -> Take;
    /// After the read that [`Allowance::take`] granted `granted` for:
    /// `read` bytes were taken from the source (and will be written to the
    /// destination), the rest is given back. Called once per grant.
    fn settle(&self, granted: usize, read: usize);
}

/// An [`Allowance`]'s answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// Read at most this many bytes (at least one).
    Granted(usize),
    /// Nothing now, but maybe in a moment: ask again after yielding.
    Later,
    /// Nothing more, ever: the direction ends with an error.
    Spent,
}

/// No limit: every read may fill the pipe; `moved` is told what each read took.
pub struct Unlimited<F>(pub F);

impl<F: Fn(usize)> Allowance for Unlimited<F> {
    fn take(&self, want: usize) -> Take {
        Take::Granted(want)
    }
    fn settle(&self, _granted: usize, read: usize) {
        if read > 0 {
            (self.0)(read);
        }
    }
}

/// Moves bytes from `src` to `dst` through a pipe of its own until `src`
/// reaches EOF, then half-closes `dst` (the other direction goes on).
/// `moved` is told every chunk taken from `src`. See [`one_way_within`].
pub async fn one_way(src: &TcpStream, dst: &TcpStream, moved: impl Fn(usize)) -> io::Result<()> {
    one_way_within(src, dst, &Unlimited(moved)).await
}

/// The error of a direction whose [`Allowance`] is spent.
fn spent() -> io::Error {
    io::Error::other("the allowance of this direction is spent")
}

/// [`one_way`] held to `allow`: each read from `src` asks it first and
/// takes no more than it grants; [`Take::Later`] yields and asks again;
/// [`Take::Spent`] ends the direction with an error. The pipe is drained before
/// `src` is read again, so a full pipe never stalls a read and a would-block
/// always means the socket it names has no data or no room. The pipe is made
/// when `src` first has something to read, so an idle direction holds no
/// descriptors, and grown to [`GROWN`] the first time one read takes half of
/// [`CHUNK`] or more, so a direction of small messages keeps the default pipe.
///
/// Readiness is awaited through the sockets' single-waiter slots
/// (`poll_read_ready` on `src`, `poll_write_ready` on `dst`; in
/// [`both_ways`] each slot has exactly one user). Waiting there replaces
/// whatever waker a previous owner left in the slot: a socket handed over by
/// an HTTP server still holds the waker of the connection task that last
/// read from it, and that waker would keep the finished task's memory (the
/// whole connection state, ~7 KiB in the proxy) allocated for as long as the
/// relay idles.
pub async fn one_way_within(src: &TcpStream, dst: &TcpStream, allow: &impl Allowance) -> io::Result<()> {
    // Declared before the pipe, so that it is given back after the pipe closes.
    let mut _grant = None;
    let mut pipe = None;
    let mut capacity = CHUNK;
    let mut tried = false;
    let flags = SpliceFlags::MOVE | SpliceFlags::NONBLOCK;
    loop {
        let n = loop {
            std::future::poll_fn(|cx| src.poll_read_ready(cx)).await?;
            if pipe.is_none() {
                pipe = Some(rustix::pipe::pipe_with(PipeFlags::NONBLOCK | PipeFlags::CLOEXEC)?);
            }
            let Some((_, pipe_w)) = &pipe else { continue };
            let granted = match allow.take(capacity) {
                Take::Granted(g) => g.clamp(1, capacity),
                Take::Later => {
                    tokio::task::yield_now().await;
                    continue;
                }
                Take::Spent => return Err(spent()),
            };
            let read = src.try_io(Interest::READABLE, || {
                rustix::pipe::splice(src, None, pipe_w, None, granted, flags).map_err(io::Error::from)
            });
            allow.settle(granted, *read.as_ref().unwrap_or(&0));
            match read {
                Ok(n) if !tried && n >= CHUNK / 2 => {
                    tried = true;
                    (capacity, _grant) = grow(pipe_w);
                    break n;
                }
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        };
        if n == 0 {
            return match rustix::net::shutdown(dst, rustix::net::Shutdown::Write) {
                Ok(()) | Err(rustix::io::Errno::NOTCONN) => Ok(()),
                Err(e) => Err(e.into()),
            };
        }
        let Some((pipe_r, _)) = &pipe else { continue };
        let mut left = n;
        while left > 0 {
            std::future::poll_fn(|cx| dst.poll_write_ready(cx)).await?;
            match dst.try_io(Interest::WRITABLE, || {
                rustix::pipe::splice(pipe_r, None, dst, None, left, flags).map_err(io::Error::from)
            }) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(m) => left -= m,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// Both directions until both reached EOF, or the first error.
pub async fn both_ways(a: &TcpStream, b: &TcpStream, a_to_b: impl Fn(usize), b_to_a: impl Fn(usize)) -> io::Result<()> {
    both_ways_within(a, b, &Unlimited(a_to_b), &Unlimited(b_to_a)).await
}

/// [`both_ways`], each direction held to its [`Allowance`].
pub async fn both_ways_within(
    a: &TcpStream,
    b: &TcpStream,
    a_to_b: &impl Allowance,
    b_to_a: &impl Allowance,
) -> io::Result<()> {
    tokio::try_join!(one_way_within(a, b, a_to_b), one_way_within(b, a, b_to_a)).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// Tests run one at a time: they move bulk data, and the count of grown
    /// pipes they look at is the process's.
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (s, _) = l.accept().await.unwrap();
        (c, s)
    }

    /// A waker that counts nothing but its own references.
    struct Stale;
    impl std::task::Wake for Stale {
        fn wake(self: std::sync::Arc<Self>) {}
    }

    #[tokio::test]
    async fn an_idle_relay_drops_the_wakers_a_previous_owner_left() {
        let _one = SERIAL.lock().await;
        let (client, a) = pair().await;
        let (b, server) = pair().await;
        // The previous owner (an HTTP connection's task) waited for more to
        // read on `a` and on `b`, then ended without another byte arriving.
        let stale = std::sync::Arc::new(Stale);
        let waker = std::task::Waker::from(stale.clone());
        let mut cx = std::task::Context::from_waker(&waker);
        for s in [&a, &b] {
            // A fresh socket may start out marked readable; a read that
            // would block clears that, and the next poll parks the waker.
            while s.poll_read_ready(&mut cx).is_ready() {
                assert_eq!(s.try_read(&mut [0u8; 1]).unwrap_err().kind(), io::ErrorKind::WouldBlock);
            }
        }
        drop(waker);
        assert_eq!(
            std::sync::Arc::strong_count(&stale),
            3,
            "both sockets hold the old waker"
        );
        let relay = tokio::spawn(async move { both_ways(&a, &b, |_| {}, |_| {}).await });
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            std::sync::Arc::strong_count(&stale),
            1,
            "an idle relay still holds the previous owner's wakers"
        );
        drop((client, server));
        relay.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn bytes_cross_intact_with_half_close_and_are_counted() {
        let _one = SERIAL.lock().await;
        // client ⇄ (a | relay | b) ⇄ server
        let (mut client, a) = pair().await;
        let (b, mut server) = pair().await;
        let (up, down) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let data: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
        let relay = both_ways(
            &a,
            &b,
            |n| {
                up.fetch_add(n, Ordering::Relaxed);
            },
            |n| {
                down.fetch_add(n, Ordering::Relaxed);
            },
        );
        let sent = data.clone();
        let peers = async move {
            let w = async {
                client.write_all(&sent).await.unwrap();
                client.shutdown().await.unwrap();
                let mut back = vec![];
                client.read_to_end(&mut back).await.unwrap();
                back
            };
            let s = async {
                let mut got = vec![];
                server.read_to_end(&mut got).await.unwrap();
                server.write_all(b"done").await.unwrap();
                server.shutdown().await.unwrap();
                got
            };
            tokio::join!(w, s)
        };
        let (r, (back, got)) = tokio::join!(relay, peers);
        r.unwrap();
        assert!(got == data, "bytes changed on the way");
        assert_eq!(back, b"done");
        assert_eq!(
            (up.load(Ordering::Relaxed), down.load(Ordering::Relaxed)),
            (data.len(), 4)
        );
    }

    /// An allowance of `left` bytes that records the largest read asked for
    /// beyond what it granted (there must be none).
    struct Budget {
        left: AtomicUsize,
        over: AtomicUsize,
        asked: AtomicUsize,
    }

    impl Allowance for Budget {
        fn take(&self, want: usize) -> Take {
            self.asked.store(0, Ordering::Relaxed);
            match self.left.load(Ordering::Relaxed).min(want) {
                0 => Take::Spent,
                g => {
                    self.left.fetch_sub(g, Ordering::Relaxed);
                    self.asked.store(g, Ordering::Relaxed);
                    Take::Granted(g)
                }
            }
        }
        fn settle(&self, granted: usize, read: usize) {
            assert_eq!(granted, self.asked.load(Ordering::Relaxed), "settled another grant");
            self.over.fetch_max(read.saturating_sub(granted), Ordering::Relaxed);
            self.left.fetch_add(granted - read.min(granted), Ordering::Relaxed);
        }
    }

    #[tokio::test]
    async fn a_direction_moves_no_byte_past_its_allowance() {
        let _one = SERIAL.lock().await;
        let (mut client, a) = pair().await;
        let (b, mut server) = pair().await;
        let budget = Budget {
            left: AtomicUsize::new(100_003),
            over: AtomicUsize::new(0),
            asked: AtomicUsize::new(0),
        };
        let allowance = &budget;
        let data = vec![3u8; 64 * 1024];
        let peers = async {
            // The writer writes until the relay's side is gone; the reader
            // counts what crossed until it closes.
            let w = async { while client.write_all(&data).await.is_ok() {} };
            let r = async {
                let mut got = 0usize;
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    match server.read(&mut buf).await {
                        Ok(0) | Err(_) => return got,
                        Ok(n) => got += n,
                    }
                }
            };
            tokio::join!(w, r).1
        };
        // The relay's side closes when it stops, so the reader sees the end.
        let both = async move {
            let r = one_way_within(&a, &b, allowance).await;
            drop((a, b));
            r
        };
        let (r, got) = tokio::join!(both, peers);
        assert!(r.is_err(), "a spent allowance ends the direction");
        assert_eq!(got, 100_003, "exactly the allowance crossed");
        assert_eq!(budget.over.load(Ordering::Relaxed), 0);
        assert_eq!(budget.left.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn a_bulk_direction_grows_its_pipe_and_gives_the_place_back() {
        let _one = SERIAL.lock().await;
        let (mut client, a) = pair().await;
        let (b, mut server) = pair().await;
        let (largest, grown) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let relay = one_way(&a, &b, |n| {
            largest.fetch_max(n, Ordering::Relaxed);
            grown.fetch_max(grown_pipes(), Ordering::Relaxed);
        });
        let data = vec![7u8; 16 << 20];
        let peers = async {
            let w = async {
                client.write_all(&data).await.unwrap();
                client.shutdown().await.unwrap();
            };
            let r = async {
                // Read late, so that the relay finds the socket full.
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                let mut got = vec![];
                server.read_to_end(&mut got).await.unwrap();
                got
            };
            tokio::join!(w, r).1
        };
        let (r, got) = tokio::join!(relay, peers);
        r.unwrap();
        assert!(got == data, "bytes changed on the way");
        assert_eq!(grown.load(Ordering::Relaxed), 1, "the pipe was not grown");
        assert!(
            largest.load(Ordering::Relaxed) > CHUNK,
            "no read took more than a default pipe holds ({} bytes at most)",
            largest.load(Ordering::Relaxed)
        );
        assert_eq!(grown_pipes(), 0, "the place was not given back");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_more_pipes_grow_than_the_limit_and_the_rest_still_relay() {
        let _one = SERIAL.lock().await;
        let n = MAX_GROWN + 4;
        let (go, _) = tokio::sync::broadcast::channel::<()>(1);
        let mut relays = vec![];
        for _ in 0..n {
            let (mut client, a) = pair().await;
            let (b, mut server) = pair().await;
            let mut go = go.subscribe();
            relays.push(tokio::spawn(async move {
                let relay = one_way(&a, &b, |_| {});
                let peers = async {
                    let w = async {
                        client.write_all(&vec![1u8; 4 << 20]).await.unwrap();
                        client.shutdown().await.unwrap();
                    };
                    // Nothing is read until every relay holds what it can.
                    let r = async {
                        let _ = go.recv().await;
                        let mut got = vec![];
                        server.read_to_end(&mut got).await.unwrap();
                        got.len()
                    };
                    tokio::join!(w, r).1
                };
                let (r, got) = tokio::join!(relay, peers);
                r.unwrap();
                got
            }));
        }
        let t0 = std::time::Instant::now();
        while grown_pipes() < MAX_GROWN {
            assert!(t0.elapsed().as_secs() < 10, "only {} pipes grew", grown_pipes());
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        for _ in 0..20 {
            assert!(grown_pipes() <= MAX_GROWN, "{} pipes grew", grown_pipes());
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        go.send(()).unwrap();
        for r in relays {
            assert_eq!(r.await.unwrap(), 4 << 20);
        }
        assert_eq!(grown_pipes(), 0);
    }
}
