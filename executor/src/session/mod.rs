//! Session tools (`lifecycle = "session"`): MCP servers on stdio, each
//! child confined exactly like an invocation child and serving one client's
//! session over its own run. A tool's [`Sessions`] keeps `pool.warm`
//! servers started and initialized ahead of any client, opens at most
//! `max_sessions`, and closes a session (its tree killed, its run ended)
//! when the client ends it, it idles or ages out, the server exits or
//! breaks a bound, or the executor stops. One server's stdio is
//! [`conversation`]; the JSON-RPC is read strictly by `egress_api::jsonrpc`.

pub mod conversation;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::kill::KillReason;
use crate::pool::child::{Shared, ToolSpec, Warm};
use conversation::Conversation;
use egress_api::jsonrpc;

/// The MCP revision the executor initializes its servers with and
/// answers clients in: the session-based one (`Mcp-Session-Id`).
pub const REVISION: &str = "2025-11-25";

/// Why a session could not be opened.
#[derive(Debug)]
pub enum OpenError {
    /// `max_sessions` are open.
    Full(usize),
    /// The executor is stopping.
    Closing,
    /// The server did not start or did not answer `initialize`.
    Startup(String),
    /// The proxy did not activate the session's run.
    Proxy(String),
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpenError::Full(n) => write!(f, "the tool has {n} sessions open, its max_sessions: end one first"),
            OpenError::Closing => f.write_str("the executor is shutting down"),
            OpenError::Startup(e) => write!(f, "the server did not start: {e}"),
            OpenError::Proxy(e) => write!(f, "the proxy did not activate the session's run: {e}"),
        }
    }
}

/// A server started and initialized, waiting for a client.
struct Ready {
    child: Warm,
    conv: Arc<Conversation>,
    init: Value,
}

/// One open session.
#[derive(Debug)]
pub struct Session {
    pub id: String,
    pub tool: String,
    pub run_id: String,
    /// The principal that opened it: only it (or admin) may use it.
    pub principal: Option<String>,
    pub conv: Arc<Conversation>,
    /// The server's answer to `initialize` (its `result`).
    pub init: Value,
    last: Mutex<Instant>,
    /// Requests of the client being carried (a session is not idle while
    /// one is, however long the server takes).
    busy: AtomicUsize,
    /// Cancelled by the client's `DELETE`.
    end: CancellationToken,
}

/// A request of the client in flight; the session's idle clock starts
/// again when it drops.
pub struct InUse<'a>(&'a Session);

impl Drop for InUse<'_> {
    fn drop(&mut self) {
        self.0.touch();
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Session {
    /// Marks the session used now (its idle clock starts again).
    pub fn touch(&self) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    /// Marks a request of the client in flight until the guard drops.
    pub fn in_use(&self) -> InUse<'_> {
        self.busy.fetch_add(1, Ordering::AcqRel);
        self.touch();
        InUse(self)
    }

    /// When the session was last used (now, while a request is in flight).
    fn last(&self) -> Instant {
        if self.busy.load(Ordering::Acquire) > 0 {
            return Instant::now();
        }
        *self.last.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Ends the session (the client's `DELETE`); its keeper closes it.
    pub fn end(&self) {
        self.end.cancel();
    }
}

/// One session tool's sessions.
pub struct Sessions {
    pub tool: Arc<ToolSpec>,
    shared: Arc<Shared>,
    open: Mutex<HashMap<String, Arc<Session>>>,
    /// Sessions being opened (counted against `max_sessions`).
    opening: AtomicUsize,
    warm: Mutex<VecDeque<Ready>>,
    starting: AtomicUsize,
    /// Keepers and warm servers alive.
    live: AtomicUsize,
    closing: CancellationToken,
    me: Weak<Sessions>,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions").field("tool", &self.tool.id).finish()
    }
}

/// Counts a session being opened until it is open or failed.
struct Opening<'a>(&'a AtomicUsize);

impl Drop for Opening<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Sessions {
    pub fn new(tool: ToolSpec, shared: Arc<Shared>) -> Arc<Sessions> {
        Arc::new_cyclic(|me| Sessions {
            tool: Arc::new(tool),
            shared,
            open: Mutex::new(HashMap::new()),
            opening: AtomicUsize::new(0),
            warm: Mutex::new(VecDeque::new()),
            starting: AtomicUsize::new(0),
            live: AtomicUsize::new(0),
            closing: CancellationToken::new(),
            me: me.clone(),
        })
    }

    fn sessions(&self) -> MutexGuard<'_, HashMap<String, Arc<Session>>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn stock(&self) -> MutexGuard<'_, VecDeque<Ready>> {
        self.warm.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The proxy's control API, which decides the sessions' calls.
    pub fn control(&self) -> &crate::proxy::control::ControlClient {
        &self.shared.control
    }

    /// Sessions open now.
    pub fn count(&self) -> usize {
        self.sessions().len()
    }

    /// Servers alive (open sessions, warm ones, ones starting or closing).
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Acquire) + self.starting.load(Ordering::Acquire)
    }

    /// The open session `id`.
    pub fn get(&self, id: &str) -> Option<Arc<Session>> {
        self.sessions().get(id).cloned()
    }

    /// Starts servers until `pool.warm` are ready or starting (none once
    /// closing), within `max_sessions` servers in all.
    pub fn fill(&self) {
        let p = &self.tool.process;
        loop {
            if self.closing.is_cancelled() {
                return;
            }
            let have = self.stock().len() + self.starting.load(Ordering::Acquire);
            let all = have + self.count() + self.opening.load(Ordering::Acquire);
            if have >= p.warm || all >= p.session.max_sessions + p.warm {
                return;
            }
            self.starting.fetch_add(1, Ordering::AcqRel);
            let Some(me) = self.me.upgrade() else { return };
            tokio::spawn(async move {
                let started = me.start().await;
                match started {
                    Ok(r) if !me.closing.is_cancelled() => {
                        me.live.fetch_add(1, Ordering::AcqRel);
                        me.stock().push_back(r);
                        me.starting.fetch_sub(1, Ordering::AcqRel);
                    }
                    Ok(r) => {
                        me.starting.fetch_sub(1, Ordering::AcqRel);
                        r.child.close(KillReason::Evicted).await;
                    }
                    Err(e) => {
                        me.starting.fetch_sub(1, Ordering::AcqRel);
                        tracing::warn!(tool = %me.tool.id, error = %e, "a warm MCP server did not start");
                        // No retry storm: the next open starts one itself.
                    }
                }
            });
        }
    }

    /// Starts one server and initializes it, within `cold_start_ms`.
    async fn start(&self) -> Result<Ready, String> {
        let mut child =
            Warm::start(&self.shared, &self.tool, None)
                .await
                .map_err(|e| match e.stderr_tail.is_empty() {
                    true => e.message.clone(),
                    false => format!("{} (stderr: {})", e.message, e.stderr_tail),
                })?;
        let Some((stdin, stdout)) = child.take_conversation() else {
            child.close(KillReason::Startup).await;
            return Err("the server has no stdio to speak on".into());
        };
        let s = &self.tool.process.session;
        let conv = Conversation::start(stdin, stdout, s.max_message_bytes, s.max_session_bytes);
        let init = jsonrpc::Message::Request {
            id: Value::from(0),
            method: "initialize".into(),
            params: Some(json!({
                "protocolVersion": REVISION,
                "capabilities": {},
                "clientInfo": {"name": "loom-egress-executor", "version": env!("CARGO_PKG_VERSION")},
            })),
        };
        let within = Duration::from_millis(self.tool.process.cold_start_ms);
        let answer = tokio::select! {
            a = conv.request(&init, within) => a,
            s = child.exited() => Err(format!("the server exited ({s}) before answering initialize")),
        };
        let result = match answer {
            Ok(mut v) => match v.get_mut("result").map(Value::take) {
                Some(r) if r.is_object() => Ok(r),
                _ => Err(format!(
                    "the server refused initialize: {}",
                    v.get("error").map(Value::to_string).unwrap_or_default()
                )),
            },
            Err(e) => Err(format!(
                "no answer to initialize within cold_start_ms = {}: {e}",
                self.tool.process.cold_start_ms
            )),
        };
        let init = match result {
            Ok(r) => r,
            Err(e) => {
                conv.close(e.clone());
                let tail = child.close(KillReason::Startup).await;
                return Err(match tail.is_empty() {
                    true => e,
                    false => format!("{e} (stderr: {tail})"),
                });
            }
        };
        if let Err(e) = conv
            .write(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
            .await
        {
            child.close(KillReason::Startup).await;
            return Err(e);
        }
        Ok(Ready { child, conv, init })
    }

    /// Opens a session for a client (`principal`, to which its run is
    /// attributed): a warm server if one is ready (else one started now),
    /// its run activated, its keeper started.
    pub async fn open(&self, principal: Option<String>) -> Result<Arc<Session>, OpenError> {
        if self.closing.is_cancelled() {
            return Err(OpenError::Closing);
        }
        let max = self.tool.process.session.max_sessions;
        let n = self.opening.fetch_add(1, Ordering::AcqRel);
        let _opening = Opening(&self.opening);
        if self.count() + n >= max {
            return Err(OpenError::Full(max));
        }
        let ready = loop {
            let taken = self.stock().pop_front();
            match taken {
                Some(r) if r.conv.is_closed() => {
                    self.live.fetch_sub(1, Ordering::AcqRel);
                    r.child.close(KillReason::WarmDeath).await;
                }
                Some(r) => {
                    self.live.fetch_sub(1, Ordering::AcqRel);
                    break r;
                }
                None => break self.start().await.map_err(OpenError::Startup)?,
            }
        };
        self.fill();
        let run_id = ready.child.run.run_id.clone();
        if let Err(e) = self.shared.control.activate(&run_id, principal.as_deref()).await {
            ready.conv.close("its run was not activated");
            ready.child.close(KillReason::ProxyError).await;
            return Err(OpenError::Proxy(e.to_string()));
        }
        let session = Arc::new(Session {
            id: uuid::Uuid::new_v4().simple().to_string(),
            tool: self.tool.id.clone(),
            run_id,
            principal,
            conv: ready.conv,
            init: ready.init,
            last: Mutex::new(Instant::now()),
            busy: AtomicUsize::new(0),
            end: CancellationToken::new(),
        });
        self.sessions().insert(session.id.clone(), session.clone());
        self.live.fetch_add(1, Ordering::AcqRel);
        if let Some(me) = self.me.upgrade() {
            tokio::spawn(me.keep(session.clone(), ready.child));
        }
        tracing::info!(tool = %self.tool.id, session = %session.id, run_id = %session.run_id, "MCP session opened");
        Ok(session)
    }

    /// Holds a session's server until the session closes, then closes it:
    /// the tree killed and reaped, the run ended.
    async fn keep(self: Arc<Self>, session: Arc<Session>, mut child: Warm) {
        let limits = self.tool.process.session;
        let idle = Duration::from_millis(limits.idle_ms);
        let max_at = Instant::now() + Duration::from_millis(limits.max_ms);
        let (reason, why) = loop {
            let idle_at = session.last() + idle;
            tokio::select! {
                _ = session.end.cancelled() => break (KillReason::Done, "ended by the client".to_owned()),
                _ = session.conv.closed() => break (KillReason::Protocol, session.conv.why()),
                s = child.exited() => break (KillReason::Disconnected, format!("the server exited ({s})")),
                _ = tokio::time::sleep_until(max_at) => {
                    break (KillReason::Timeout, format!("the session reached session_max_ms = {}", limits.max_ms))
                }
                _ = tokio::time::sleep_until(idle_at) => {
                    if session.last() + idle <= Instant::now() {
                        break (KillReason::Timeout, format!("the session was idle for session_idle_ms = {}", limits.idle_ms));
                    }
                }
                _ = self.closing.cancelled() => break (KillReason::Evicted, "the executor is shutting down".to_owned()),
            }
        };
        session.conv.close(format!("the session is closed: {why}"));
        self.sessions().remove(&session.id);
        let tail = child.close(reason).await;
        self.live.fetch_sub(1, Ordering::AcqRel);
        tracing::info!(
            tool = %self.tool.id, session = %session.id, run_id = %session.run_id, why = %why,
            stderr_tail = %tail, "MCP session closed"
        );
        self.fill();
    }

    /// Stops opening sessions, closes every open one and every warm server.
    pub fn close(&self) {
        self.closing.cancel();
        let warm: Vec<Ready> = self.stock().drain(..).collect();
        for r in warm {
            let Some(me) = self.me.upgrade() else { return };
            tokio::spawn(async move {
                r.conv.close("the executor is shutting down");
                r.child.close(KillReason::Evicted).await;
                me.live.fetch_sub(1, Ordering::AcqRel);
            });
        }
    }
}
