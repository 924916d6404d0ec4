//! Per-tool pools of single-use warm children: `pool.warm` ready ahead of
//! demand, never more than `pool.max` alive, handed to waiting invocations in
//! FIFO order (bounded queue, then `busy`), refilled in the background with
//! backoff after failures. One child's life: `child`, `start`, `converse`,
//! and the child protocol it speaks, `protocol`.

pub mod child;
pub mod converse;
pub mod protocol;
pub mod start;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::error::{ErrorKind, InvocationResult, InvokeError};
use crate::kill::KillReason;
use child::{Request, Shared, ToolSpec, Warm};

/// A ready child as the pool holds it: the way to its task. Once handed to
/// an invocation it carries the busy count.
#[derive(Debug)]
struct Handle {
    id: u64,
    tx: mpsc::Sender<Dispatch>,
    busy: Option<Busy>,
    /// The proxy generation the child started under (see `ControlClient::generation`).
    generation: u64,
}

#[derive(Debug)]
struct Dispatch {
    req: Request,
    reply: oneshot::Sender<InvocationResult>,
    /// Held by the child's task until the child is dead.
    busy: Option<Busy>,
}

/// One child counted busy; dropping it (wherever that happens: the child's
/// task when done, a dropped hand-off, a cancelled invocation) frees the slot
/// and lets the pool refill. Never takes the state lock, so it may drop while
/// the lock is held.
#[derive(Debug)]
struct Busy {
    pool: Weak<Pool>,
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.busy.fetch_sub(1, Ordering::AcqRel);
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move { pool.fill() });
            }
        }
    }
}

type Delivery = Result<Handle, InvokeError>;

#[derive(Debug)]
struct Waiter {
    id: u64,
    tx: oneshot::Sender<Delivery>,
}

#[derive(Debug, Default)]
struct State {
    ready: VecDeque<Handle>,
    starting: usize,
    waiters: VecDeque<Waiter>,
    next_waiter: u64,
    /// Consecutive failed starts of warm (unrequested) children.
    failures: u32,
    backoff_until: Option<Instant>,
    closed: bool,
}

/// One tool's pool.
#[derive(Debug)]
pub struct Pool {
    pub tool: Arc<ToolSpec>,
    shared: Arc<Shared>,
    state: Mutex<State>,
    me: Weak<Pool>,
    /// A warm child idle this long is replaced (its run would expire).
    max_idle: Duration,
    /// Children handed to invocations and not yet dead (see `Busy`).
    busy: AtomicUsize,
    /// Child tasks alive (starting, warm, busy, or being cleaned up).
    live: AtomicUsize,
}

/// How long the refill behind an invocation that found more than one ready
/// child waits at most for that invocation's answer.
const REFILL_DELAY: Duration = Duration::from_millis(50);

/// How many times an invocation moves on to another child when the one it
/// was handed died before the invoke reached it.
const HANDOFF_RETRIES: usize = 3;

impl Pool {
    pub fn new(tool: ToolSpec, shared: Arc<Shared>, max_idle: Duration) -> Arc<Pool> {
        Arc::new_cyclic(|me| Pool {
            tool: Arc::new(tool),
            shared,
            state: Mutex::new(State::default()),
            me: me.clone(),
            max_idle,
            busy: AtomicUsize::new(0),
            live: AtomicUsize::new(0),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock means a panic while holding it; the counts are
        // still the best information we have.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Start filling the pool to `pool.warm`.
    pub fn fill(&self) {
        let mut st = self.lock();
        self.ensure(&mut st);
    }

    /// Ready, starting and busy children.
    pub fn counts(&self) -> (usize, usize, usize) {
        let st = self.lock();
        (st.ready.len(), st.starting, self.busy())
    }

    /// Child tasks still alive, including ones cleaning up after a kill.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }

    /// Stop refilling and kill every idle child (busy ones finish their run).
    pub fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        st.ready.clear();
        for w in st.waiters.drain(..) {
            let _ =
                w.tx.send(Err(InvokeError::new(ErrorKind::Busy, "the executor is shutting down")));
        }
        self.publish(&st);
    }

    fn publish(&self, st: &State) {
        self.shared
            .metrics
            .pool_state(&self.tool.id, st.ready.len(), st.starting, self.busy());
    }

    fn busy(&self) -> usize {
        self.busy.load(Ordering::Acquire)
    }

    /// Count one more child busy.
    fn mark_busy(&self) -> Busy {
        self.busy.fetch_add(1, Ordering::AcqRel);
        Busy { pool: self.me.clone() }
    }

    /// Start children until ready + starting covers the warm target plus the
    /// waiters, within `pool.max`. Called with the lock held.
    fn ensure(&self, st: &mut State) {
        if st.closed {
            return;
        }
        let p = &self.tool.process;
        let backing_off = st.backoff_until.is_some_and(|t| t > Instant::now());
        let warm_target = if backing_off { 0 } else { p.warm };
        let want = warm_target + st.waiters.len();
        while st.ready.len() + st.starting < want && st.ready.len() + st.starting + self.busy() < p.max {
            st.starting += 1;
            if let Some(me) = self.me.upgrade() {
                spawn_child(me, None);
            }
        }
        self.publish(st);
    }

    /// Run one invocation on a fresh child. `run_id` (chosen by the kernel)
    /// needs a dedicated cold child bound to that run.
    pub async fn invoke(&self, req: Request, run_id: Option<String>) -> InvocationResult {
        let tool = self.tool.id.clone();
        if let Some(run_id) = run_id {
            return match self.dedicated(run_id, &req).await {
                Ok(h) => self.send(h, req).await,
                Err(e) => InvocationResult::failed(&tool, e),
            };
        }
        let mut last = None;
        for _ in 0..HANDOFF_RETRIES {
            let h = match self.acquire(&req).await {
                Ok(h) => h,
                Err(e) => return InvocationResult::failed(&tool, e),
            };
            match self.try_send(h, req.clone()).await {
                // The proxy refused to activate that child's run (it ended
                // it, or forgot it): none of the child's fetches went out,
                // so a fresh child may serve the invocation.
                Ok(r) if r.error.as_ref().is_some_and(|e| e.retry_fresh) => {
                    tracing::warn!(tool = %tool, error = ?r.error.as_ref().map(|e| &e.message), "activation failed; retrying on a fresh child");
                    last = r.error;
                }
                Ok(r) => return r,
                Err(e) => last = Some(e),
            }
        }
        InvocationResult::failed(
            &tool,
            last.unwrap_or_else(|| InvokeError::new(ErrorKind::Disconnected, "no child")),
        )
    }

    async fn send(&self, h: Handle, req: Request) -> InvocationResult {
        match self.try_send(h, req).await {
            Ok(r) => r,
            Err(e) => InvocationResult::failed(&self.tool.id, e),
        }
    }

    /// Hand `req` to the child behind `h` (which carries its busy count).
    async fn try_send(&self, mut h: Handle, req: Request) -> Result<InvocationResult, InvokeError> {
        let (reply, rx) = oneshot::channel();
        let busy = h.busy.take();
        let sent = h.tx.send(Dispatch { req, reply, busy }).await;
        let r = match sent {
            Ok(()) => rx.await.map_err(|_| ()),
            Err(_) => Err(()),
        };
        r.map_err(|()| {
            InvokeError::new(
                ErrorKind::Disconnected,
                "the child died before the invocation reached it",
            )
        })
    }

    /// A ready child for this invocation: an idle warm one, or the next one
    /// to become ready (FIFO), waiting at most `cold_start_ms + timeout_ms`.
    async fn acquire(&self, req: &Request) -> Result<Handle, InvokeError> {
        let p = &self.tool.process;
        let (id, rx) = {
            let mut st = self.lock();
            if st.closed {
                return Err(InvokeError::new(ErrorKind::Busy, "the executor is shutting down"));
            }
            // Children started before a proxy restart are dropped (their
            // task discards them) and replaced.
            let current = self.shared.control.generation();
            while st.ready.front().is_some_and(|h| h.generation != current) {
                st.ready.pop_front();
            }
            if let Some(mut h) = st.ready.pop_front() {
                h.busy = Some(self.mark_busy());
                if st.ready.is_empty() {
                    self.ensure(&mut st);
                } else {
                    // Not dry: the refill waits for this invocation's answer
                    // (its slot's release refills), or REFILL_DELAY, so that
                    // starting a child does not compete with the dispatch.
                    self.publish(&st);
                    self.refill_after(REFILL_DELAY);
                }
                return Ok(h);
            }
            let total = st.ready.len() + st.starting + self.busy();
            // Waiters beyond the children already starting are the queue.
            if total >= p.max && st.waiters.len() >= st.starting + p.queue {
                return Err(InvokeError::new(
                    ErrorKind::Busy,
                    format!(
                        "all {} children of `{}` are busy and {} invocations already wait",
                        p.max,
                        self.tool.id,
                        st.waiters.len()
                    ),
                ));
            }
            let (tx, rx) = oneshot::channel();
            let id = st.next_waiter;
            st.next_waiter += 1;
            st.waiters.push_back(Waiter { id, tx });
            self.ensure(&mut st);
            (id, rx)
        };
        let wait = Duration::from_millis(p.cold_start_ms.saturating_add(p.timeout_ms));
        let mut rx = rx;
        let gave_up = tokio::select! {
            r = &mut rx => return r.unwrap_or_else(|_| Err(InvokeError::new(ErrorKind::Busy, "the pool closed"))),
            _ = tokio::time::sleep(wait) => InvokeError::new(
                ErrorKind::Busy,
                format!("no child of `{}` became free within {} ms", self.tool.id, wait.as_millis()),
            ),
            _ = req.cancel.cancelled() => InvokeError::new(ErrorKind::Aborted, "aborted by the kernel while queued"),
        };
        let removed = {
            let mut st = self.lock();
            let before = st.waiters.len();
            st.waiters.retain(|w| w.id != id);
            let removed = st.waiters.len() != before;
            self.ensure(&mut st);
            removed
        };
        if removed {
            return Err(gave_up);
        }
        // A child was handed to us just as we gave up: dropping it kills it
        // and frees its slot.
        drop(rx.try_recv());
        Err(gave_up)
    }

    /// A cold child bound to the kernel's `run_id`, used only by this
    /// invocation. Needs a free slot under `pool.max` (an idle warm child
    /// is evicted to make room); otherwise `busy`.
    async fn dedicated(&self, run_id: String, req: &Request) -> Result<Handle, InvokeError> {
        {
            let mut st = self.lock();
            let total = st.ready.len() + st.starting + self.busy();
            if total >= self.tool.process.max && st.ready.pop_front().is_none() {
                return Err(InvokeError::new(
                    ErrorKind::Busy,
                    format!("all {} children of `{}` are busy", self.tool.process.max, self.tool.id),
                ));
            }
            st.starting += 1;
            self.publish(&st);
        }
        let (tx, rx) = oneshot::channel();
        let Some(me) = self.me.upgrade() else {
            return Err(InvokeError::new(ErrorKind::Busy, "the pool closed"));
        };
        spawn_child(me, Some((run_id, tx)));
        tokio::select! {
            r = rx => r.unwrap_or_else(|_| Err(InvokeError::new(ErrorKind::Disconnected, "the child was lost while starting"))),
            _ = req.cancel.cancelled() => Err(InvokeError::new(ErrorKind::Aborted, "aborted by the kernel while starting")),
        }
    }

    /// A child became ready: hand it to the first waiter or keep it warm.
    fn on_ready(&self, mut h: Handle, dedicated: Option<oneshot::Sender<Delivery>>) {
        let mut st = self.lock();
        st.starting = st.starting.saturating_sub(1);
        if let Some(tx) = dedicated {
            h.busy = Some(self.mark_busy());
            // If the invocation is gone, the handle drops here: the child is
            // discarded and its slot freed.
            drop(tx.send(Ok(h)));
            self.ensure(&mut st);
            return;
        }
        st.failures = 0;
        st.backoff_until = None;
        if st.closed {
            self.publish(&st);
            return;
        }
        while let Some(w) = st.waiters.pop_front() {
            h.busy = Some(self.mark_busy());
            match w.tx.send(Ok(h)) {
                Ok(()) => {
                    self.ensure(&mut st);
                    return;
                }
                Err(Ok(mut back)) => {
                    // That waiter gave up; try the next one.
                    back.busy = None;
                    h = back;
                }
                Err(Err(_)) => {
                    self.ensure(&mut st);
                    return;
                }
            }
        }
        st.ready.push_back(h);
        self.ensure(&mut st);
    }

    /// A start failed: fail the first waiter with it, or back off.
    fn on_start_failed(&self, e: InvokeError, dedicated: Option<oneshot::Sender<Delivery>>) {
        let mut st = self.lock();
        st.starting = st.starting.saturating_sub(1);
        if let Some(tx) = dedicated {
            let _ = tx.send(Err(e));
            self.ensure(&mut st);
            return;
        }
        tracing::warn!(tool = %self.tool.id, error = %e, stderr = %e.stderr_tail, "child failed to start");
        let mut e = Some(e);
        while let Some(w) = st.waiters.pop_front() {
            if let Some(err) = e.take() {
                match w.tx.send(Err(err)) {
                    Ok(()) => break,
                    Err(Err(back)) => e = Some(back),
                    Err(Ok(_)) => break,
                }
            }
        }
        self.back_off(&mut st);
        self.ensure(&mut st);
    }

    fn back_off(&self, st: &mut State) {
        st.failures = st.failures.saturating_add(1);
        let delay = Duration::from_millis(100u64.saturating_mul(1 << st.failures.min(9))).min(Duration::from_secs(30));
        st.backoff_until = Some(Instant::now() + delay);
        self.refill_after(delay);
    }

    /// Fill the pool after `delay`.
    fn refill_after(&self, delay: Duration) {
        if let Some(me) = self.me.upgrade() {
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                me.fill();
            });
        }
    }

    /// A warm child became unusable while idle (or grew too old); if still
    /// listed, drop it. Deaths back off the refill, recycling does not.
    fn on_warm_gone(&self, id: u64, died: bool) {
        let mut st = self.lock();
        st.ready.retain(|h| h.id != id);
        if died {
            self.back_off(&mut st);
        }
        self.ensure(&mut st);
    }
}

/// The task that owns one child from start to kill.
/// Counts a child task as live until it ends.
struct Live(Arc<Pool>);

impl Drop for Live {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Start the task of a new child, counted live from now.
fn spawn_child(pool: Arc<Pool>, dedicated: Option<(String, oneshot::Sender<Delivery>)>) {
    pool.live.fetch_add(1, Ordering::AcqRel);
    tokio::spawn(child_task(pool, dedicated));
}

async fn child_task(pool: Arc<Pool>, dedicated: Option<(String, oneshot::Sender<Delivery>)>) {
    let _live = Live(pool.clone());
    let (run_id, dedicated_tx) = match dedicated {
        Some((r, tx)) => (Some(r), Some(tx)),
        None => (None, None),
    };
    let mut warm: Warm = match Warm::start(&pool.shared, &pool.tool, run_id.as_deref()).await {
        Ok(w) => w,
        Err(e) => {
            pool.on_start_failed(e, dedicated_tx);
            return;
        }
    };
    let (tx, mut rx) = mpsc::channel::<Dispatch>(1);
    let id = warm.id;
    let generation = warm.generation;
    pool.on_ready(
        Handle {
            id,
            tx,
            busy: None,
            generation,
        },
        dedicated_tx,
    );
    let unusable = tokio::select! {
        d = rx.recv() => match d {
            Some(Dispatch { req, reply, busy }) => {
                let (result, teardown) = warm.dispatch(req).await;
                // The tree is dead and its run ended: answer, then free the
                // slot (which starts the refill), then tidy up.
                let _ = reply.send(result);
                drop(busy);
                teardown.finish().await;
                return;
            }
            None => {
                // Every handle is gone: evicted, or the pool closed.
                warm.discard(KillReason::Evicted).await;
                return;
            }
        },
        u = warm.watch() => Some(u),
        _ = tokio::time::sleep(pool.max_idle) => None,
    };
    drop(rx);
    match unusable {
        Some(u) => {
            tracing::warn!(tool = %pool.tool.id, pid = warm.pid(), reason = %u.0, "warm child unusable; replacing it");
            warm.discard(KillReason::WarmDeath).await;
            pool.on_warm_gone(id, true);
        }
        None => {
            warm.discard(KillReason::Recycled).await;
            pool.on_warm_gone(id, false);
        }
    }
}
