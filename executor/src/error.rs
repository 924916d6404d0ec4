//! What a kernel gets back from an invocation: the typed error kinds and the
//! result body of `POST /v1/invocations` (also printed by `run`). Error kinds
//! double as the `outcome` metric label, so the two cannot disagree.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The kind of a failed invocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The child did not reach `ready` (see `phase`).
    Startup,
    /// `timeout_ms` elapsed after dispatch.
    Timeout,
    /// Aborted by the kernel.
    Aborted,
    /// IPC EOF or error, or the child died, before a result.
    Disconnected,
    /// The child broke the protocol (malformed, oversized, out of order).
    Protocol,
    /// The tool reported an error (or a plain tool exited non-zero).
    ToolError,
    /// No child could be had within the pool's bounds.
    Busy,
    /// The proxy's control API failed (creating, activating or ending the run).
    Proxy,
    /// The request names no tool with a `[tools.<id>.process]` section.
    UnknownTool,
    /// The request is malformed.
    BadRequest,
    /// The idempotency key was used before with a different request.
    IdempotencyConflict,
    /// The request's `run_id` names a run the proxy already has.
    RunExists,
    /// Another cell of the fleet is running the invocation with this
    /// idempotency key: `cell` and `control_url` name it, and the same
    /// request sent there waits for its answer.
    InProgress,
    /// The fleet's idempotency store (PostgreSQL) cannot be asked: a keyed
    /// invocation runs nowhere rather than possibly twice.
    IdempotencyUnavailable,
    /// A file the tool's children would run does not hash to its pin in
    /// `expect_sha256` (or a pinned file is not run): no child starts.
    ExecutableMismatch,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 15] = [
        ErrorKind::Startup,
        ErrorKind::Timeout,
        ErrorKind::Aborted,
        ErrorKind::Disconnected,
        ErrorKind::Protocol,
        ErrorKind::ToolError,
        ErrorKind::Busy,
        ErrorKind::Proxy,
        ErrorKind::UnknownTool,
        ErrorKind::BadRequest,
        ErrorKind::IdempotencyConflict,
        ErrorKind::RunExists,
        ErrorKind::InProgress,
        ErrorKind::IdempotencyUnavailable,
        ErrorKind::ExecutableMismatch,
    ];

    /// The metric `outcome` label and the word in the JSON body.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Startup => "startup",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Aborted => "aborted",
            ErrorKind::Disconnected => "disconnected",
            ErrorKind::Protocol => "protocol",
            ErrorKind::ToolError => "tool_error",
            ErrorKind::Busy => "busy",
            ErrorKind::Proxy => "proxy",
            ErrorKind::UnknownTool => "unknown_tool",
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::IdempotencyConflict => "idempotency_conflict",
            ErrorKind::RunExists => "run_exists",
            ErrorKind::InProgress => "in_progress",
            ErrorKind::IdempotencyUnavailable => "idempotency_unavailable",
            ErrorKind::ExecutableMismatch => "executable_mismatch",
        }
    }

    /// The HTTP status `POST /v1/invocations` answers with. What the tool
    /// did (its result, its error, a timeout, an abort, a crash) is `200`
    /// with `ok:false`: the invocation ran. What kept it from running is a
    /// non-2xx: the proxy's control API failing (`502`), no child to be had
    /// (`503`), an unknown tool (`404`), a malformed request (`400`), a
    /// conflict with what was used before or runs elsewhere (`409`), the
    /// fleet's idempotency store unavailable (`503`), a tool whose files do
    /// not match their pins (`503`).
    pub fn http_status(self) -> u16 {
        match self {
            ErrorKind::Proxy => 502,
            ErrorKind::Busy | ErrorKind::IdempotencyUnavailable | ErrorKind::ExecutableMismatch => 503,
            ErrorKind::UnknownTool => 404,
            ErrorKind::BadRequest => 400,
            ErrorKind::IdempotencyConflict | ErrorKind::RunExists | ErrorKind::InProgress => 409,
            _ => 200,
        }
    }
}

/// Startup phase: `spawn` (to `booted`: an environment fault) or `load`
/// (`booted` to `ready`: a tool fault).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Spawn,
    Load,
}

/// A typed invocation error.
#[derive(Debug, Clone, Serialize, Deserialize, thiserror::Error, utoipa::ToSchema)]
#[error("{}{}: {message}", kind.as_str(), phase.map(|p| format!("({})", match p { Phase::Spawn => "spawn", Phase::Load => "load" })).unwrap_or_default())]
pub struct InvokeError {
    pub kind: ErrorKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    pub message: String,
    pub stderr_tail: String,
    /// The proxy refused to activate the child's run: whatever the tool did
    /// with its input, nothing of it left the sandbox, so the pool tries the
    /// invocation again on a fresh child.
    #[serde(skip)]
    pub retry_fresh: bool,
}

impl InvokeError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        InvokeError {
            kind,
            phase: None,
            message: message.into(),
            stderr_tail: String::new(),
            retry_fresh: false,
        }
    }

    pub fn startup(phase: Phase, message: impl Into<String>) -> Self {
        InvokeError {
            phase: Some(phase),
            ..InvokeError::new(ErrorKind::Startup, message)
        }
    }
}

/// The body of an invocation's answer. (Deserialized only from the
/// executor's own serialization of it, kept for repeated idempotency keys.)
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct InvocationResult {
    /// The executor's id of this invocation (`GET /v1/invocations/{id}`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub invocation_id: Option<String>,
    pub ok: bool,
    pub tool: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<InvokeError>,
    pub emits: Vec<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    /// The proxy's facts for the run (its denials).
    pub facts: Vec<egress_api::Fact>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub facts_error: Option<String>,
    /// The child's stdout (head, capped).
    pub stdout: String,
    /// How the child ended, when it was reaped (`exit code 0`, `signal 9`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit: Option<String>,
    pub duration_ms: u64,
    /// Present only on an answer given again (a repeated
    /// `idempotency_key`, `GET /v1/invocations/{id}`) whose body the
    /// executor no longer keeps: `ok`, `error` (its message shortened, no
    /// stderr), `run_id`, `exit` and `duration_ms` are the invocation's;
    /// `output`, `emits`, `facts` and `stdout` are empty here, not the
    /// tool's. The tool is never run again for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_dropped: Option<BodyDropped>,
    /// The cell that ran it (`[cell] id`; absent without a cell).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cell: Option<String>,
    /// Where that cell's executor answers for it (`[cell] advertise_executor`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_url: Option<String>,
}

/// This process's cell and the URL kernels reach its executor at, set once
/// at start from `[cell]`; every invocation result carries them.
static CELL: std::sync::OnceLock<(Option<String>, Option<String>)> = std::sync::OnceLock::new();

/// Sets the cell every result names (once, at start).
pub fn set_cell(cell: Option<&egress_config::CellConfig>) {
    let _ = CELL.set((
        cell.map(|c| c.id.clone()),
        cell.and_then(|c| c.advertise_executor.clone()),
    ));
}

/// The cell id and executor URL results carry.
pub fn cell() -> (Option<String>, Option<String>) {
    CELL.get().cloned().unwrap_or_default()
}

/// What is left of an answer whose body was dropped: why, its sizes, and
/// the SHA-256 of the dropped JSON (the whole answer as first sent, which a
/// caller that kept it can compare).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BodyDropped {
    /// `entry_too_large`: the answer alone was over a quarter of
    /// `[executor] journal_max_mb`; `journal_full`: newer answers needed the
    /// room (the oldest bodies go first).
    #[schema(value_type = String)]
    pub reason: DropReason,
    /// Bytes of the dropped JSON answer.
    pub body_bytes: u64,
    /// Lower-case hex SHA-256 of the dropped JSON answer.
    pub sha256: String,
    /// Bytes of `output` as JSON (0: none).
    pub output_bytes: u64,
    /// Number of emits, and their bytes as a JSON array.
    pub emits: u64,
    pub emits_bytes: u64,
    /// Bytes of `stdout`.
    pub stdout_bytes: u64,
    /// Number of facts (the proxy still has them: `GET /v1/runs/{id}/facts`).
    pub facts: u64,
}

/// Why an answer's body was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DropReason {
    EntryTooLarge,
    JournalFull,
}

impl InvocationResult {
    /// A failure before any child was involved.
    pub fn failed(tool: &str, error: InvokeError) -> Self {
        InvocationResult {
            invocation_id: None,
            ok: false,
            tool: tool.to_string(),
            output: None,
            error: Some(error),
            emits: Vec::new(),
            run_id: None,
            facts: Vec::new(),
            facts_error: None,
            stdout: String::new(),
            exit: None,
            duration_ms: 0,
            body_dropped: None,
            cell: cell().0,
            control_url: cell().1,
        }
    }

    /// `ok` or the error kind: the metric outcome label.
    pub fn outcome(&self) -> &'static str {
        match &self.error {
            None => "ok",
            Some(e) => e.kind.as_str(),
        }
    }
}
