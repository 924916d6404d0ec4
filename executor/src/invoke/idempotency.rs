//! Idempotency keys: a repeated key within `IDEMPOTENCY_WINDOW` gets the
//! first invocation's answer (or waits for it), another request with the
//! same key is a conflict. Requests compare by the SHA-256 of their canonical
//! JSON. In a fleet, a key new here is first claimed fleet-wide, so it runs
//! once in the whole fleet.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::error::{ErrorKind, InvocationResult, InvokeError};
use crate::invoke::dispatch::{Answer, Done, InvocationRequest};
use crate::invoke::retained::Kept;
use crate::invoke::Executor;

/// How long a finished invocation's answer is kept for its idempotency key.
pub const IDEMPOTENCY_WINDOW: Duration = Duration::from_secs(600);
/// Keys remembered at most (the oldest finished ones are forgotten first).
const IDEMPOTENCY_MAX: usize = 10_000;
/// The longest idempotency key, in characters (at most 1 KiB).
pub const IDEMPOTENCY_KEY_MAX: usize = 256;
/// How long past its `cold_start_ms + timeout_ms` a fleet claim whose cell
/// never finished it (the cell died) is held before another cell may run
/// the key again: by then the tool has been killed by its own deadline.
const CLAIM_MARGIN: Duration = Duration::from_secs(60);

/// What an idempotency key stands for.
#[derive(Debug)]
pub(super) struct Remembered {
    /// Digest of the request (tool, input, run id, timeout) that used the key.
    pub(super) fingerprint: String,
    /// `None` while the invocation runs, then its answer as kept.
    pub(super) answer: tokio::sync::watch::Receiver<Option<Arc<Kept>>>,
    pub(super) finished: Option<Instant>,
}

/// The SHA-256 of the request (tool, input, run id, timeout), hex: the same
/// in every process, so cells of a fleet compare it, and the same for every
/// client's spelling of one input (see [`canonical`]).
fn fingerprint(req: &InvocationRequest) -> String {
    use sha2::{Digest, Sha256};
    let mut text = String::new();
    // The caller's principal too (when not the control token's): another
    // principal's same request with the same key is a conflict, never the
    // first one's answer.
    let mut parts = serde_json::json!([req.tool, req.input, req.run_id, req.timeout_ms]);
    if let (Some(p), Value::Array(a)) = (&req.principal, &mut parts) {
        a.push(Value::from(p.as_str()));
    }
    canonical(&parts, &mut text);
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `v` as canonical JSON: object keys sorted, and a number with an integral
/// value written as an integer (`3.0` and `3` are one number, as a
/// JavaScript client sends it).
fn canonical(v: &Value, out: &mut String) {
    use std::fmt::Write as _;
    match v {
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < 9.0e15 => {
                let _ = write!(out, "{}", f as i64);
            }
            _ => {
                let _ = write!(out, "{n}");
            }
        },
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{}:", Value::String(k.clone()));
                canonical(&map[k], out);
            }
            out.push('}');
        }
        other => {
            let _ = write!(out, "{other}");
        }
    }
}

/// Forgets a running key whose invocation was dropped before it finished.
struct Unfinished<'a> {
    exec: &'a Executor,
    key: Option<String>,
}

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if let (Some(k), Ok(mut m)) = (self.key.take(), self.exec.idempotency.lock()) {
            if m.get(&k).is_some_and(|r| r.finished.is_none()) {
                m.remove(&k);
            }
        }
    }
}

/// A keyed invocation, claimed or not.
enum Claimed {
    /// It ran here.
    Ran(Box<Done>),
    /// It did not run here: the fleet's answer, and whether it is final (to
    /// be remembered for the key here too).
    Elsewhere(Answer, bool),
}

/// Gives a won fleet claim up if its invocation is dropped before it ends
/// (the caller went away), so a retry may run it, as on one executor.
struct Release {
    claims: Arc<egress_fleet::Claims>,
    key: String,
    id: Option<String>,
}

impl Drop for Release {
    fn drop(&mut self) {
        let (Some(id), Ok(rt)) = (self.id.take(), tokio::runtime::Handle::try_current()) else {
            return;
        };
        let (claims, key) = (self.claims.clone(), std::mem::take(&mut self.key));
        rt.spawn(async move {
            if let Err(e) = claims.release(&key, &id).await {
                tracing::warn!(error = %e, "an abandoned claim could not be released; it expires on its own");
            }
        });
    }
}

impl Executor {
    /// [`Executor::invoke`], with the answer as it came or as it was kept.
    /// In a fleet, a key new to this executor is first claimed fleet-wide
    /// (see [`Executor::claimed`]).
    pub async fn answer(&self, req: InvocationRequest) -> Answer {
        let Some(key) = req.idempotency_key.clone() else {
            return self.invoke_once(req, None).await.into();
        };
        if key.is_empty() || key.chars().count() > IDEMPOTENCY_KEY_MAX {
            return Answer::failed(
                &req.tool,
                InvokeError::new(
                    ErrorKind::BadRequest,
                    format!("idempotency_key must be 1-{IDEMPOTENCY_KEY_MAX} characters"),
                ),
            );
        }
        let fp = fingerprint(&req);
        let tx = {
            let Ok(mut m) = self.idempotency.lock() else {
                return self.invoke_once(req, None).await.into();
            };
            let now = Instant::now();
            m.retain(|_, r| r.finished.is_none_or(|t| now.duration_since(t) < IDEMPOTENCY_WINDOW));
            match m.get(&key) {
                Some(r) if r.fingerprint != fp => {
                    return Answer::failed(
                        &req.tool,
                        InvokeError::new(
                            ErrorKind::IdempotencyConflict,
                            format!("idempotency_key `{key}` was used with a different request"),
                        ),
                    );
                }
                Some(r) => Err(r.answer.clone()),
                None => {
                    if m.len() >= IDEMPOTENCY_MAX {
                        let oldest = m
                            .iter()
                            .filter_map(|(k, r)| r.finished.map(|t| (t, k.clone())))
                            .min()
                            .map(|(_, k)| k);
                        if let Some(k) = oldest {
                            m.remove(&k);
                        }
                    }
                    let (tx, rx) = tokio::sync::watch::channel(None);
                    m.insert(
                        key.clone(),
                        Remembered {
                            fingerprint: fp.clone(),
                            answer: rx,
                            finished: None,
                        },
                    );
                    Ok(tx)
                }
            }
        };
        match tx {
            Ok(tx) => {
                let mut guard = Unfinished {
                    exec: self,
                    key: Some(key.clone()),
                };
                let (answer, kept, keep) = match self.claimed(req, &key, &fp).await {
                    Claimed::Ran(done) => {
                        let kept = done.kept.clone();
                        ((*done).into(), kept, true)
                    }
                    Claimed::Elsewhere(answer, remember) => {
                        // Waiting retries here get the same answer; only a
                        // final one (the owner's) is remembered.
                        let kept = self.retained.keep(&answer.to_result()).0;
                        (answer, kept, remember)
                    }
                };
                guard.key = None;
                if let Ok(mut m) = self.idempotency.lock() {
                    if keep {
                        if let Some(r) = m.get_mut(&key) {
                            r.finished = Some(Instant::now());
                        }
                    } else {
                        m.remove(&key);
                    }
                }
                let _ = tx.send(Some(kept));
                answer
            }
            Err(mut rx) => match rx.wait_for(Option::is_some).await {
                Ok(answer) => match answer.as_ref() {
                    Some(kept) => Answer::Kept(kept.clone()),
                    None => Answer::failed(&req.tool, InvokeError::new(ErrorKind::Aborted, "no answer")),
                },
                Err(_) => Answer::failed(
                    &req.tool,
                    InvokeError::new(
                        ErrorKind::Aborted,
                        format!("the first invocation with idempotency_key `{key}` was abandoned before it finished; send it again"),
                    ),
                ),
            },
        }
    }

    /// Runs a keyed invocation new to this executor, after claiming its key
    /// fleet-wide when this executor is a cell of a fleet. A key the fleet
    /// already knows answers as its owner would: the stored answer once it
    /// ended, `idempotency_conflict` for another request, `in_progress`
    /// (naming the owner) while it runs elsewhere. PostgreSQL unreachable:
    /// `idempotency_unavailable`, and nothing runs.
    async fn claimed(&self, req: InvocationRequest, key: &str, fp: &str) -> Claimed {
        let (Some(claims), Some(pool)) = (self.claims.as_ref(), self.pools.get(&req.tool)) else {
            return Claimed::Ran(Box::new(self.invoke_once(req, None).await));
        };
        let metrics = &self.shared.metrics;
        let id = uuid::Uuid::new_v4().to_string();
        let p = &pool.tool.process;
        let hold = Duration::from_millis(p.cold_start_ms + p.timeout_ms) + CLAIM_MARGIN;
        let fail = |kind, cell: Option<String>, url: Option<String>, message: String| {
            let mut r = InvocationResult::failed(&req.tool, InvokeError::new(kind, message));
            if cell.is_some() {
                (r.cell, r.control_url) = (cell, url);
            }
            Claimed::Elsewhere(Answer::Live(Box::new(r), None), false)
        };
        match claims.claim(key, fp, &id, hold).await {
            Err(e) => {
                metrics.claim("unavailable");
                tracing::warn!(error = %e, "a keyed invocation could not be claimed in the fleet; nothing ran");
                fail(
                    ErrorKind::IdempotencyUnavailable,
                    None,
                    None,
                    format!("the fleet's idempotency store cannot be asked ({e}); nothing ran: send it again later"),
                )
            }
            Ok(egress_fleet::Claim::Conflict { cell }) => {
                metrics.claim("conflict");
                fail(
                    ErrorKind::IdempotencyConflict,
                    None,
                    None,
                    format!("idempotency_key `{key}` was used with a different request (at cell {cell})"),
                )
            }
            Ok(egress_fleet::Claim::Running { cell, control_url }) => {
                metrics.claim("in_progress");
                let message = format!(
                    "idempotency_key `{key}` is running at cell {cell}; send the same request to its control_url for the answer"
                );
                fail(ErrorKind::InProgress, Some(cell), control_url, message)
            }
            Ok(egress_fleet::Claim::Done { status, answer, .. }) => {
                metrics.claim("done");
                Claimed::Elsewhere(Answer::Stored(status, answer.into()), true)
            }
            Ok(egress_fleet::Claim::Won) => {
                metrics.claim("won");
                let mut release = Release {
                    claims: claims.clone(),
                    key: key.to_owned(),
                    id: Some(id.clone()),
                };
                let done = self.invoke_once(req, Some(id.clone())).await;
                release.id = None;
                let (status, json) = (done.kept.status(), done.kept.answer_json());
                let answer = String::from_utf8_lossy(&json).into_owned();
                match claims.finish(key, &id, status, &answer).await {
                    Ok(true) => {}
                    Ok(false) => tracing::warn!(
                        key,
                        "the claim was taken over as abandoned before its answer was stored"
                    ),
                    Err(e) => {
                        tracing::warn!(error = %e, "the answer of a claimed key could not be stored yet; retrying in the background");
                        let (claims, key) = (claims.clone(), key.to_owned());
                        tokio::spawn(async move {
                            let until = Instant::now() + IDEMPOTENCY_WINDOW;
                            while Instant::now() < until {
                                tokio::time::sleep(Duration::from_millis(500)).await;
                                if claims.finish(&key, &id, status, &answer).await.is_ok() {
                                    return;
                                }
                            }
                        });
                    }
                }
                Claimed::Ran(Box::new(done))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(input: &str) -> InvocationRequest {
        serde_json::from_value(serde_json::json!({
            "tool": "t", "input": serde_json::from_str::<Value>(input).unwrap(), "idempotency_key": "k",
        }))
        .unwrap()
    }

    #[test]
    fn one_input_spelled_two_ways_has_one_fingerprint() {
        let same = [
            (
                r#"{"n": 3.0, "a": [1.0, {"y": 1, "x": 2}]}"#,
                r#"{"a": [1, {"x": 2, "y": 1}], "n": 3}"#,
            ),
            (r#"{"big": 12345678.0}"#, r#"{"big": 12345678}"#),
        ];
        for (a, b) in same {
            assert_eq!(fingerprint(&request(a)), fingerprint(&request(b)), "{a} vs {b}");
        }
        let different = [
            (r#"{"n": 3.5}"#, r#"{"n": 3}"#),
            (r#"{"n": "3"}"#, r#"{"n": 3}"#),
            (r#"[1, 2]"#, r#"[2, 1]"#),
            (r#"{"a": null}"#, r#"{}"#),
        ];
        for (a, b) in different {
            assert_ne!(fingerprint(&request(a)), fingerprint(&request(b)), "{a} vs {b}");
        }
    }
}
