//! The journal of invocations: running ones and the last `JOURNAL_MAX`
//! finished ones, as `GET /v1/invocations` lists and pages them and
//! `GET /v1/invocations/{id}` finds one (by invocation id, run id or key);
//! a finished one's answer is kept by `retained`, bounded in bytes.

use std::collections::HashMap;
use std::sync::Arc;

use crate::invoke::retained::Kept;
use crate::invoke::Executor;

/// Finished invocations listed by `GET /v1/invocations` (the oldest go
/// first); their answers' bodies are bounded in bytes by `journal_max_mb`.
pub const JOURNAL_MAX: usize = 1000;

/// One invocation as `GET /v1/invocations` lists it.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct InvocationSummary {
    pub invocation_id: String,
    pub tool: String,
    /// `running` or `done`.
    #[schema(value_type = String)]
    pub state: &'static str,
    /// `ok` or the error kind, once done.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub outcome: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// The principal that invoked it (absent: the control token's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    /// Milliseconds since the Unix epoch.
    pub started_at_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
}

#[derive(Debug, Default)]
pub(super) struct Journal {
    pub(super) running: HashMap<String, InvocationSummary>,
    /// Newest last.
    pub(super) done: std::collections::VecDeque<(InvocationSummary, Arc<Kept>)>,
}

/// What `GET /v1/invocations/{id}` finds.
#[derive(Debug)]
pub enum Found {
    Running(InvocationSummary),
    /// The answer as kept (whole, or its stub once the body was dropped).
    Done(Arc<Kept>),
}

/// Removes a running entry whose invocation was dropped unfinished.
pub(super) struct Journaled<'a> {
    pub(super) exec: &'a Executor,
    pub(super) id: Option<String>,
}

impl Drop for Journaled<'_> {
    fn drop(&mut self) {
        if let (Some(id), Ok(mut j)) = (self.id.take(), self.exec.journal.lock()) {
            j.running.remove(&id);
        }
    }
}

impl Executor {
    /// Running and recently finished invocations, newest first, filtered
    /// (`tool`, `state`, `outcome`) and paged (`after`: the last id of the
    /// previous page).
    pub fn invocations(
        &self,
        tool: Option<&str>,
        state: Option<&str>,
        outcome: Option<&str>,
        after: Option<&str>,
        limit: usize,
        visible: &dyn Fn(Option<&str>) -> bool,
    ) -> (Vec<InvocationSummary>, Option<String>) {
        let Ok(j) = self.journal.lock() else {
            return (vec![], None);
        };
        let mut running: Vec<&InvocationSummary> = j.running.values().collect();
        running.sort_by(|a, b| {
            b.started_at_ms
                .cmp(&a.started_at_ms)
                .then(b.invocation_id.cmp(&a.invocation_id))
        });
        let all = running.into_iter().chain(j.done.iter().rev().map(|(s, _)| s));
        let mut seen_after = after.is_none();
        let mut out = vec![];
        let mut more = false;
        for s in all {
            if !seen_after {
                seen_after = after == Some(s.invocation_id.as_str());
                continue;
            }
            let keep = visible(s.principal.as_deref())
                && tool.is_none_or(|t| s.tool == t)
                && state.is_none_or(|st| s.state == st)
                && outcome.is_none_or(|o| s.outcome == Some(o));
            if keep {
                if out.len() == limit {
                    more = true;
                    break;
                }
                out.push(s.clone());
            }
        }
        let next = if more {
            out.last().map(|s| s.invocation_id.clone())
        } else {
            None
        };
        (out, next)
    }

    /// One invocation by its invocation id, run id or idempotency key,
    /// among those `visible` says are the caller's.
    pub fn invocation(&self, id: &str, visible: &dyn Fn(Option<&str>) -> bool) -> Option<Found> {
        let j = self.journal.lock().ok()?;
        let matches = |s: &InvocationSummary| {
            (s.invocation_id == id || s.run_id.as_deref() == Some(id) || s.idempotency_key.as_deref() == Some(id))
                && visible(s.principal.as_deref())
        };
        if let Some(s) = j.running.values().find(|s| matches(s)) {
            return Some(Found::Running(s.clone()));
        }
        j.done
            .iter()
            .rev()
            .find(|(s, _)| matches(s))
            .map(|(_, k)| Found::Done(k.clone()))
    }
}
