//! What the executor keeps of finished invocations' answers — for
//! `GET /v1/invocations/{id}` and for repeated idempotency keys — bounded in
//! bytes by `[executor] journal_max_mb`: each answer as its exact JSON, or,
//! once its body is dropped, a stub with its outcome, sizes and SHA-256.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::error::{BodyDropped, DropReason, InvocationResult, InvokeError};

/// Longest error message a stub keeps (bytes; cut at a character boundary).
pub const STUB_MESSAGE_MAX: usize = 512;

/// The byte-bounded store of answers. An answer is kept as its exact JSON, so
/// the count is the bytes held, whatever shape the tool gave its output.
/// Over the per-entry cap (a quarter of the budget), or once newer answers
/// need the room (oldest first), the body is dropped: a stub stays with the
/// outcome, the sizes and the SHA-256 of the dropped JSON.
#[derive(Debug)]
pub struct Retained {
    budget: usize,
    entry_cap: usize,
    /// Bytes of bodies kept, across every live [`Kept`].
    used: Arc<AtomicUsize>,
    /// Every answer that may still hold its body, oldest first.
    order: Mutex<Order>,
}

#[derive(Debug, Default)]
struct Order {
    queue: VecDeque<Weak<Kept>>,
    /// Length at which dead entries behind a live one are swept next.
    sweep_at: usize,
}

/// One finished invocation's answer, shared by the journal and the
/// idempotency map; its body is freed (and uncounted) when the last of them
/// lets go, or when it is dropped to make room.
#[derive(Debug)]
pub struct Kept {
    state: Mutex<State>,
    used: Arc<AtomicUsize>,
}

#[derive(Debug)]
struct State {
    /// The answer as first sent, while it is kept.
    json: Option<Bytes>,
    /// The answer without its body, and what a drop reports.
    stub: InvocationResult,
    dropped: BodyDropped,
}

impl Retained {
    /// A store of at most `budget` bytes of bodies, each at most a quarter
    /// of it.
    pub fn new(budget: usize) -> Retained {
        Retained {
            budget,
            entry_cap: budget / 4,
            used: Arc::new(AtomicUsize::new(0)),
            order: Mutex::new(Order::default()),
        }
    }

    /// Bytes of bodies kept now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::SeqCst)
    }

    /// Keeps `result` (its body if it fits), making room by dropping the
    /// oldest bodies first. Also returns the result's JSON, serialized once
    /// for both: the live answer is sent as it is.
    pub fn keep(&self, result: &InvocationResult) -> (Arc<Kept>, Bytes) {
        // A boxed slice: its allocation is exactly its length, which is
        // what is counted.
        let json = serde_json::to_vec(result).unwrap_or_default().into_boxed_slice();
        let dropped = BodyDropped {
            reason: DropReason::JournalFull,
            body_bytes: json.len() as u64,
            sha256: Sha256::digest(&json[..]).iter().map(|b| format!("{b:02x}")).collect(),
            output_bytes: result.output.as_ref().map_or(0, json_len),
            emits: result.emits.len() as u64,
            emits_bytes: json_array_len(&result.emits),
            stdout_bytes: result.stdout.len() as u64,
            facts: result.facts.len() as u64,
        };
        let json = Bytes::from(json);
        let size = json.len();
        let fits = size <= self.entry_cap;
        let kept = Arc::new(Kept {
            state: Mutex::new(State {
                json: fits.then(|| json.clone()),
                stub: stub(result),
                dropped: BodyDropped {
                    reason: if fits {
                        DropReason::JournalFull
                    } else {
                        DropReason::EntryTooLarge
                    },
                    ..dropped
                },
            }),
            used: self.used.clone(),
        });
        if !fits {
            return (kept, json);
        }
        let Ok(mut order) = self.order.lock() else {
            // A poisoned store keeps nothing rather than an uncounted body.
            kept.drop_body();
            return (kept, json);
        };
        self.used.fetch_add(size, Ordering::SeqCst);
        order.queue.push_back(Arc::downgrade(&kept));
        while self.used.load(Ordering::SeqCst) > self.budget {
            let Some(oldest) = order.queue.pop_front() else { break };
            if let Some(k) = oldest.upgrade() {
                k.drop_body();
            }
        }
        // Answers forgotten by everyone leave a dead entry behind: cleared
        // from the front at once, and behind a live one whenever the queue
        // has doubled since the last sweep (amortized constant work).
        while order.queue.front().is_some_and(|w| w.strong_count() == 0) {
            order.queue.pop_front();
        }
        if order.queue.len() > order.sweep_at.max(64) {
            order.queue.retain(|w| w.strong_count() > 0);
            order.sweep_at = 2 * order.queue.len();
        }
        (kept, json)
    }
}

impl Kept {
    /// The answer as it is kept: the whole result while its body is, else
    /// the stub with `body_dropped` set.
    pub fn answer(&self) -> InvocationResult {
        let Ok(s) = self.state.lock() else {
            return poisoned();
        };
        match &s.json {
            Some(json) => serde_json::from_slice(json).unwrap_or_else(|_| s.dropped_stub()),
            None => s.dropped_stub(),
        }
    }

    /// The answer's JSON, as [`Kept::answer`] would serialize, without
    /// parsing a kept body again.
    pub fn answer_json(&self) -> Bytes {
        let Ok(s) = self.state.lock() else {
            return Bytes::from(serde_json::to_vec(&poisoned()).unwrap_or_default());
        };
        match &s.json {
            Some(json) => json.clone(),
            None => Bytes::from(serde_json::to_vec(&s.dropped_stub()).unwrap_or_default()),
        }
    }

    /// The HTTP status the answer was given with.
    pub fn status(&self) -> u16 {
        self.state
            .lock()
            .map(|s| s.stub.error.as_ref().map_or(200, |e| e.kind.http_status()))
            .unwrap_or(500)
    }

    /// Whether the body is still kept.
    pub fn has_body(&self) -> bool {
        self.state.lock().map(|s| s.json.is_some()).unwrap_or(false)
    }

    fn drop_body(&self) {
        if let Ok(mut s) = self.state.lock() {
            if let Some(json) = s.json.take() {
                self.used.fetch_sub(json.len(), Ordering::SeqCst);
            }
        }
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        let json = match self.state.get_mut() {
            Ok(s) => s.json.take(),
            Err(p) => p.into_inner().json.take(),
        };
        if let Some(json) = json {
            self.used.fetch_sub(json.len(), Ordering::SeqCst);
        }
    }
}

impl State {
    fn dropped_stub(&self) -> InvocationResult {
        InvocationResult {
            body_dropped: Some(self.dropped.clone()),
            ..self.stub.clone()
        }
    }
}

/// The answer without what the tool made big: output, emits, facts, stdout,
/// stderr, and the error message beyond [`STUB_MESSAGE_MAX`].
fn stub(r: &InvocationResult) -> InvocationResult {
    InvocationResult {
        invocation_id: r.invocation_id.clone(),
        ok: r.ok,
        tool: r.tool.clone(),
        output: None,
        error: r.error.as_ref().map(|e| InvokeError {
            message: shorten(&e.message),
            stderr_tail: String::new(),
            ..e.clone()
        }),
        emits: Vec::new(),
        run_id: r.run_id.clone(),
        facts: Vec::new(),
        facts_error: r.facts_error.as_deref().map(shorten),
        stdout: String::new(),
        exit: r.exit.clone(),
        duration_ms: r.duration_ms,
        body_dropped: None,
        cell: r.cell.clone(),
        control_url: r.control_url.clone(),
    }
}

fn shorten(s: &str) -> String {
    if s.len() <= STUB_MESSAGE_MAX {
        return s.to_string();
    }
    let mut end = STUB_MESSAGE_MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// Bytes of `v` as compact JSON (as it is sent), counted without building
/// it: `Value`'s own `Display`, which writes runs of plain text in one piece.
fn json_len(v: &Value) -> u64 {
    struct Count(u64);
    impl std::fmt::Write for Count {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            self.0 += s.len() as u64;
            Ok(())
        }
    }
    let mut c = Count(0);
    match std::fmt::write(&mut c, format_args!("{v}")) {
        Ok(()) => c.0,
        Err(_) => 0,
    }
}

/// Bytes of a JSON array of `items`: brackets, commas and each item.
fn json_array_len(items: &[Value]) -> u64 {
    2 + items.iter().map(json_len).sum::<u64>() + items.len().saturating_sub(1) as u64
}

fn poisoned() -> InvocationResult {
    InvocationResult::failed(
        "",
        InvokeError::new(crate::error::ErrorKind::Aborted, "the kept answer is unavailable"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn answer(id: &str, output_len: usize) -> InvocationResult {
        InvocationResult {
            invocation_id: Some(id.into()),
            ok: true,
            tool: "t".into(),
            output: Some(json!("x".repeat(output_len))),
            error: None,
            emits: vec![json!({"n": 1}), json!([1, 2])],
            run_id: Some(format!("run-{id}")),
            facts: vec![],
            facts_error: None,
            stdout: "out".into(),
            exit: Some("exit code 0".into()),
            duration_ms: 7,
            body_dropped: None,
            cell: None,
            control_url: None,
        }
    }

    fn json_of(r: &InvocationResult) -> Vec<u8> {
        serde_json::to_vec(r).unwrap()
    }

    /// The count is the exact JSON of what is kept, and goes back to zero
    /// when everyone lets go.
    #[test]
    fn counts_the_kept_json_exactly() {
        let store = Retained::new(1 << 20);
        let a = answer("a", 1000);
        let b = answer("b", 2000);
        let (ka, ja) = store.keep(&a);
        assert_eq!(ja, Bytes::from(json_of(&a)));
        assert_eq!(store.used(), json_of(&a).len());
        let (kb, _) = store.keep(&b);
        assert_eq!(store.used(), json_of(&a).len() + json_of(&b).len());
        assert_eq!(ka.answer_json(), Bytes::from(json_of(&a)));
        assert_eq!(
            serde_json::to_value(kb.answer()).unwrap(),
            serde_json::to_value(&b).unwrap()
        );
        let shared = ka.clone();
        drop(ka);
        assert_eq!(store.used(), json_of(&a).len() + json_of(&b).len(), "still held");
        drop(shared);
        assert_eq!(store.used(), json_of(&b).len());
        drop(kb);
        assert_eq!(store.used(), 0);
    }

    /// A tool cannot make the count small: an output of many tiny values
    /// (much bigger in memory than as JSON) is kept as JSON, and counted so.
    #[test]
    fn an_output_of_tiny_values_is_counted_as_its_json() {
        let store = Retained::new(1 << 20);
        let mut r = answer("a", 0);
        r.output = Some(json!(vec![0u8; 50_000]));
        let (k, _) = store.keep(&r);
        assert_eq!(store.used(), json_of(&r).len());
        assert!(store.used() >= 100_000);
        assert!(k.has_body());
    }

    /// Over budget, the oldest bodies go first, until the rest fits; their
    /// stubs keep the outcome, sizes and the digest of the dropped JSON.
    #[test]
    fn evicts_oldest_first_within_the_budget() {
        let one = json_of(&answer("0", 10_000)).len();
        let store = Retained::new(one * 4 + one / 2);
        let kept: Vec<Arc<Kept>> = (0..10).map(|i| store.keep(&answer(&i.to_string(), 10_000)).0).collect();
        let with_body: Vec<bool> = kept.iter().map(|k| k.has_body()).collect();
        assert_eq!(
            with_body,
            [false, false, false, false, false, false, true, true, true, true]
        );
        assert_eq!(store.used(), 4 * one);
        let first = kept[0].answer();
        let d = first.body_dropped.clone().unwrap();
        assert_eq!(d.reason, DropReason::JournalFull);
        assert_eq!(d.body_bytes as usize, one);
        let want: String = Sha256::digest(json_of(&answer("0", 10_000)))
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(d.sha256, want);
        assert_eq!(d.output_bytes, 10_002);
        assert_eq!((d.emits, d.emits_bytes, d.stdout_bytes, d.facts), (2, 15, 3, 0));
        // Sizes as sent: the same as serializing each part.
        let a = answer("0", 10_000);
        assert_eq!(d.output_bytes as usize, serde_json::to_vec(&a.output).unwrap().len());
        assert_eq!(d.emits_bytes as usize, serde_json::to_vec(&a.emits).unwrap().len());
        assert_eq!(json_array_len(&[]), 2);
        let odd = json!({"k": "é\"\n\u{1}", "n": [1.5, null, true]});
        assert_eq!(json_len(&odd) as usize, serde_json::to_vec(&odd).unwrap().len());
        assert_eq!(
            (first.ok, first.invocation_id.as_deref(), first.run_id.as_deref()),
            (true, Some("0"), Some("run-0"))
        );
        assert!(first.output.is_none() && first.emits.is_empty() && first.stdout.is_empty());
        // The same through the JSON a GET sends.
        let v: serde_json::Value = serde_json::from_slice(&kept[0].answer_json()).unwrap();
        assert_eq!(v["body_dropped"]["reason"], json!("journal_full"));
        assert!(v.get("output").is_none());
        // Letting go of a dropped answer changes no count.
        drop(kept);
        assert_eq!(store.used(), 0);
    }

    /// An answer over a quarter of the budget keeps no body at all, and
    /// takes no room from the others.
    #[test]
    fn an_answer_over_the_entry_cap_keeps_only_its_stub() {
        let store = Retained::new(100_000);
        let (small, _) = store.keep(&answer("s", 1_000));
        let used = store.used();
        let mut big = answer("b", 30_000);
        big.ok = false;
        big.error = Some(InvokeError {
            stderr_tail: "e".repeat(10_000),
            ..InvokeError::new(crate::error::ErrorKind::ToolError, "m".repeat(5_000))
        });
        let (k, sent) = store.keep(&big);
        assert_eq!(sent, Bytes::from(json_of(&big)), "the live answer is whole");
        assert_eq!(store.used(), used, "nothing counted for the big one");
        assert!(small.has_body() && !k.has_body());
        let a = k.answer();
        let d = a.body_dropped.clone().unwrap();
        assert_eq!(d.reason, DropReason::EntryTooLarge);
        assert_eq!(d.body_bytes as usize, json_of(&big).len());
        let e = a.error.unwrap();
        assert_eq!(e.kind, crate::error::ErrorKind::ToolError);
        assert!(e.message.len() <= STUB_MESSAGE_MAX + "…".len() && e.stderr_tail.is_empty());
        assert!(!a.ok);
    }

    /// Dead entries do not pile up in the eviction order.
    #[test]
    fn forgotten_answers_leave_no_trace() {
        let store = Retained::new(1 << 20);
        let (long_lived, _) = store.keep(&answer("first", 10));
        for i in 0..1000 {
            drop(store.keep(&answer(&i.to_string(), 10)));
        }
        let order = store.order.lock().unwrap().queue.len();
        assert!(order <= 130, "{order} entries in the order");
        assert_eq!(store.used(), json_of(&answer("first", 10)).len());
        drop(long_lived);
    }
}
