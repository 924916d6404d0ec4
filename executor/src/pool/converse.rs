//! A ready child's one invocation, under the timeout clock: `invoke` written
//! with the run's activation beside it, emits collected until `result` or
//! `error` (or the timeout, an abort, the child's exit), then the tree
//! killed and the run ended with its facts read, side by side; what is left
//! to remove waits in `Teardown` until the caller has its answer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;

use crate::config::Protocol;
use crate::error::{ErrorKind, InvocationResult, InvokeError};
use crate::kill::KillReason;
use crate::pool::child::{Request, Shared, Teardown, Warm, PIPE_GRACE};
use crate::pool::protocol::{self, ChildMsg, LineReader, ParentMsg, Read};
use crate::process;
use crate::proxy::control::{ControlClient, ControlError};
use egress_api::Fact;

/// Most emits kept per run (bytes are bounded by `max_run_bytes`).
const MAX_EMITS: usize = 10_000;
/// Facts returned with an invocation: one page of `GET /v1/runs/{id}/facts`
/// at its default limit (the rest stay on the proxy).
const FACTS_KEPT: usize = 100;

fn ms(d: Duration) -> u64 {
    d.as_millis().min(u128::from(u64::MAX)) as u64
}

impl Warm {
    /// Run exactly one invocation on this child, then kill it. The answer is
    /// complete once the tree is dead and the run ended (its facts read with
    /// the same call); the rest (relay, cgroup, scratch directory) is left to
    /// [`Teardown::finish`], after the caller has its answer.
    pub async fn dispatch(mut self, req: Request) -> (InvocationResult, Teardown) {
        let t0 = Instant::now();
        let deadline = tokio::time::Instant::now() + req.timeout;
        let outcome = self.converse(&req, deadline).await;
        let run_id = self.run.run_id.clone();
        // The kill goes out first (`stop` signals the tree on its first
        // poll), then the run's end travels to the proxy while the tree dies:
        // both are on the answer's path, neither waits for the other.
        let shared = self.shared.clone();
        let ((stdout, stderr_tail, exit), (facts, facts_error)) = tokio::join!(
            self.stop(KillReason::after(&outcome)),
            end_run(&shared.control, &run_id)
        );
        let (output, emits, error) = match outcome {
            Ok((output, emits)) => (Some(output), emits, None),
            Err(mut e) => {
                e.stderr_tail = stderr_tail;
                if let Some(m) = exit.as_deref().filter(|x| x.starts_with("memory:")) {
                    e.message = format!("{} ({m})", e.message);
                }
                (None, std::mem::take(&mut self.emits), Some(e))
            }
        };
        let output = match (output, self.tool.process.protocol) {
            (Some(Value::Null), Protocol::Plain) => Some(json!({"exit_code": 0, "stdout": stdout})),
            (o, _) => o,
        };
        self.shared
            .metrics
            .emits
            .get_or_create(&crate::metrics::ToolLabel {
                tool: self.tool.id.clone(),
            })
            .inc_by(emits.len() as u64);
        let result = InvocationResult {
            invocation_id: None,
            ok: error.is_none(),
            tool: self.tool.id.clone(),
            output,
            error,
            emits,
            run_id: Some(run_id),
            facts,
            facts_error,
            stdout,
            exit,
            duration_ms: ms(t0.elapsed()),
            body_dropped: None,
            cell: crate::error::cell().0,
            control_url: crate::error::cell().1,
        };
        (result, Teardown(self))
    }

    /// The invocation itself, up to (not including) the kill.
    async fn converse(
        &mut self,
        req: &Request,
        deadline: tokio::time::Instant,
    ) -> Result<(Value, Vec<Value>), InvokeError> {
        let timeout_err = || {
            InvokeError::new(
                ErrorKind::Timeout,
                format!("no result within {} ms", req.timeout.as_millis()),
            )
        };
        let aborted = || InvokeError::new(ErrorKind::Aborted, "aborted by the kernel");
        if self.tool.process.protocol == Protocol::Plain {
            return self.converse_plain(req, deadline).await;
        }
        let Some((tx, reader)) = &mut self.ipc else {
            return Err(InvokeError::new(ErrorKind::Disconnected, "no IPC pipe"));
        };
        let emits = &mut self.emits;
        let line = protocol::encode(&ParentMsg::Invoke {
            run_id: self.run.run_id.clone(),
            input: req.input.clone(),
            idempotency_key: req.idempotency_key.clone(),
        });
        // The dispatch is decided: the activation leaves first, so that it
        // is usually at the proxy before the child's first fetch.
        let mut activation = Activation::start(&self.shared, &self.run.run_id, req.principal.as_deref());
        tokio::select! {
            w = tx.write_all(&line) => w.map_err(|e| InvokeError::new(
                ErrorKind::Disconnected, format!("cannot send invoke: {e}")))?,
            _ = tokio::time::sleep_until(deadline) => return Err(timeout_err()),
            _ = req.cancel.cancelled() => return Err(aborted()),
        }
        loop {
            let next = tokio::select! {
                biased;
                e = activation.failed() => return Err(e),
                r = reader.next() => r,
                _ = req.cancel.cancelled() => {
                    // Advisory: the SIGKILL follows at once.
                    let _ = tx.try_write(&protocol::encode(&ParentMsg::Abort));
                    return Err(aborted());
                }
                _ = tokio::time::sleep_until(deadline) => return Err(timeout_err()),
                s = self.process.wait() => {
                    // The leader died. Lines it wrote before dying are still
                    // in the pipe: kill the rest of the tree so every writer
                    // is gone, then read what is left.
                    self.process.kill_tree();
                    let exit = s.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
                    return drain_after_exit(reader, emits, exit).await;
                }
            };
            match handle(next, emits) {
                Step::Continue => {}
                Step::Done(r) => return r,
            }
        }
    }

    async fn converse_plain(
        &mut self,
        req: &Request,
        deadline: tokio::time::Instant,
    ) -> Result<(Value, Vec<Value>), InvokeError> {
        let mut activation = Activation::start(&self.shared, &self.run.run_id, req.principal.as_deref());
        if let Some(mut stdin) = self.stdin.take() {
            let mut bytes = Vec::new();
            if !req.input.is_null() {
                bytes = serde_json::to_vec(&req.input).unwrap_or_default();
                bytes.push(b'\n');
            }
            // Written by a task so a child that never reads stdin cannot
            // block us; the task ends when the pipe closes.
            tokio::spawn(async move {
                let _ = stdin.write_all(&bytes).await;
            });
        }
        let status = tokio::select! {
            biased;
            e = activation.failed() => return Err(e),
            s = self.process.wait() => s,
            _ = tokio::time::sleep_until(deadline) => {
                return Err(InvokeError::new(
                    ErrorKind::Timeout,
                    format!("did not exit within {} ms", req.timeout.as_millis()),
                ))
            }
            _ = req.cancel.cancelled() => return Err(InvokeError::new(ErrorKind::Aborted, "aborted by the kernel")),
        };
        match status {
            Ok(process::ExitInfo::Code(0)) => Ok((Value::Null, Vec::new())),
            Ok(s) => Err(InvokeError::new(ErrorKind::ToolError, format!("exited with {s}"))),
            Err(e) => Err(InvokeError::new(
                ErrorKind::Disconnected,
                format!("lost the child: {e}"),
            )),
        }
    }
}

/// The activation of a dispatched child's run on the proxy. It is sent when
/// the invocation is handed to the child and travels beside it, so its round
/// trip is off the answer's path: the proxy holds the child's fetches until
/// it lands (`[proxy] activation_wait_ms`) instead of denying them. The run
/// turns active only once the executor has committed to this dispatch. A
/// child that answers first does not wait for it: its run is ended next, and
/// an activation arriving after the end is refused, so the run never turns
/// active again.
struct Activation(Option<tokio::task::JoinHandle<Result<(), ControlError>>>);

impl Activation {
    fn start(shared: &Arc<Shared>, run_id: &str, principal: Option<&str>) -> Self {
        let (shared, run_id, principal) = (shared.clone(), run_id.to_owned(), principal.map(str::to_owned));
        Activation(Some(tokio::spawn(async move {
            shared.control.activate(&run_id, principal.as_deref()).await
        })))
    }

    /// Resolves only if the activation failed. When the proxy refused it
    /// (the run was ended, or is unknown to it), the run never turned
    /// active, so none of the child's fetches went out, and the pool may
    /// serve the invocation on a fresh child. Any other failure leaves the
    /// outcome unknown (the proxy may have taken the request), so the
    /// invocation fails without a second try.
    async fn failed(&mut self) -> InvokeError {
        let Some(task) = self.0.as_mut() else {
            return std::future::pending().await;
        };
        let outcome = task.await;
        self.0 = None;
        let (message, retry_fresh) = match outcome {
            Ok(Ok(())) => return std::future::pending().await,
            Ok(Err(e)) => {
                let refused = matches!(e, ControlError::Rejected { status: 404 | 409, .. });
                (e.to_string(), refused)
            }
            Err(join) => (join.to_string(), false),
        };
        InvokeError {
            retry_fresh,
            ..InvokeError::new(ErrorKind::Proxy, format!("activating the run: {message}"))
        }
    }
}

enum Step {
    Continue,
    Done(Result<(Value, Vec<Value>), InvokeError>),
}

/// End the run and read its facts: from the answer to the end itself when
/// the proxy includes them, otherwise (an older proxy, or more facts than it
/// includes) with a second call.
async fn end_run(control: &ControlClient, run_id: &str) -> (Vec<Fact>, Option<String>) {
    let ended = match control.end_with_facts(run_id).await {
        Ok(Some(mut facts)) => {
            facts.truncate(FACTS_KEPT);
            return (facts, None);
        }
        Ok(None) => Ok(()),
        Err(e) => Err(e),
    };
    match (control.facts(run_id).await, ended) {
        (Err(e), _) => (Vec::new(), Some(e.to_string())),
        (Ok(f), Err(e)) => (f, Some(format!("ending the run: {e}"))),
        (Ok(f), Ok(())) => (f, None),
    }
}

fn handle(next: Read, emits: &mut Vec<Value>) -> Step {
    let violation = |m: String| Step::Done(Err(InvokeError::new(ErrorKind::Protocol, m)));
    match next {
        Read::Msg(ChildMsg::Emit { fact }) => {
            if emits.len() >= MAX_EMITS {
                return violation(format!("more than {MAX_EMITS} emits in one run"));
            }
            emits.push(fact);
            Step::Continue
        }
        Read::Msg(ChildMsg::Result { output }) => Step::Done(Ok((output, std::mem::take(emits)))),
        Read::Msg(ChildMsg::Error { message }) => Step::Done(Err(InvokeError::new(ErrorKind::ToolError, message))),
        Read::Msg(other) => violation(format!("`{}` after `invoke`", other.kind())),
        Read::Violation(v) => violation(v),
        Read::Eof => Step::Done(Err(InvokeError::new(
            ErrorKind::Disconnected,
            "the child closed its IPC pipe before a result",
        ))),
        Read::Failed(e) => Step::Done(Err(InvokeError::new(
            ErrorKind::Disconnected,
            format!("IPC read failed before a result: {e}"),
        ))),
    }
}

async fn drain_after_exit(
    reader: &mut LineReader<pipe::Receiver>,
    emits: &mut Vec<Value>,
    exit: String,
) -> Result<(Value, Vec<Value>), InvokeError> {
    let drained = tokio::time::timeout(PIPE_GRACE, async {
        loop {
            match handle(reader.next().await, emits) {
                Step::Continue => {}
                Step::Done(r) => return r,
            }
        }
    })
    .await;
    match drained {
        Ok(Err(e)) if e.kind == ErrorKind::Disconnected => Err(InvokeError::new(
            ErrorKind::Disconnected,
            format!("the child exited ({exit}) before a result"),
        )),
        Ok(r) => r,
        Err(_) => Err(InvokeError::new(
            ErrorKind::Disconnected,
            format!("the child exited ({exit}) before a result"),
        )),
    }
}
