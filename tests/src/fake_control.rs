//! A fake proxy control API on `127.0.0.1:0` for the executor's tests: it
//! answers with the `egress-api` types the real proxy serves (so the
//! executor's client is tested against the same wire format), records every
//! call, and lets a test choose the facts and tools it reports.

use crate::harness::TOKEN;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use egress_api::{
    Bytes, CreateRun, CreatedRun, DenialSummary, EndedRun, ErrorBody, Fact, FactsPage, OwnerReleased, OwnerView,
    PolicyView, RenewOwner, RunView, Slots,
};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// One recorded control call: `what` (`create <id>`, `activate <id>`,
/// `end <id>`, `lease <owner>`, `release <owner>`) and its JSON body.
#[derive(Debug, Clone)]
pub struct Call {
    pub what: String,
    pub body: Value,
}

#[derive(Default)]
pub struct FakeState {
    pub calls: Vec<Call>,
    /// Run id → tool and state (`created`, `active`, `ended`).
    pub runs: HashMap<String, (String, String)>,
    /// Facts reported for every run (its `run_id` filled in).
    pub facts: Vec<Value>,
    pub next: u64,
    /// Tools `GET /v1/policy` lists.
    pub policy_tools: Vec<String>,
    /// The next activations answered with this status instead: (status,
    /// how many more).
    pub refuse_activations: (u16, usize),
}

/// The fake control API.
#[derive(Clone)]
pub struct FakeControl {
    pub addr: SocketAddr,
    pub state: Arc<Mutex<FakeState>>,
    /// Notified on every activation.
    pub activated: Arc<Notify>,
}

type S = (Arc<Mutex<FakeState>>, Arc<Notify>);

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    (status, Json(ErrorBody::new(code, message))).into_response()
}

/// The `401` for a request without the control token.
fn refused(h: &HeaderMap) -> Option<Response> {
    (!egress_api::bearer_matches(h, TOKEN)).then(|| error(StatusCode::UNAUTHORIZED, "unauthorized", "bad token"))
}

fn view(id: &str, tool: &str, state: &str) -> RunView {
    RunView {
        run_id: id.to_owned(),
        tool: tool.to_owned(),
        state: state.to_owned(),
        created_at: "2026-01-01T00:00:00Z".into(),
        expires_at: "2099-01-01T00:00:00Z".into(),
        labels: Default::default(),
        owner: None,
        principal: None,
        executables: Default::default(),
        bound: false,
        slots: Slots { max: 8, in_use: 0 },
        upstream_idle: 0,
        bytes: Bytes { up: 0, down: 0 },
        credential_scrubs: Default::default(),
        ended_at: None,
        end_reason: None,
        cell: None,
        control_url: None,
        grants: vec![],
        budgets: None,
        credentials: vec![],
    }
}

/// A complete fact from the fields a test gives (the rest defaulted).
fn fact(partial: &Value, run_id: &str) -> Fact {
    let mut f = json!({
        "type": "EGRESS_DENIED", "schema": egress_api::FACT_SCHEMA, "seq": 0, "id": "fact-id",
        "at": "2026-01-01T00:00:00Z", "run_id": run_id, "tool": null, "reason": "",
        "mode": "enforce", "target": null, "resolved": [], "policy": "sha256:fake", "detail": "", "count": 1
    });
    if let (Some(base), Some(given)) = (f.as_object_mut(), partial.as_object()) {
        for (k, v) in given {
            base.insert(k.clone(), v.clone());
        }
        base.insert("run_id".into(), json!(run_id));
    }
    serde_json::from_value(f).expect("a test fact has the fields of a fact")
}

fn facts_of(s: &FakeState, run_id: &str) -> Vec<Fact> {
    s.facts.iter().map(|f| fact(f, run_id)).collect()
}

async fn create(State((st, _)): State<S>, h: HeaderMap, Json(body): Json<CreateRun>) -> Response {
    if let Some(r) = refused(&h) {
        return r;
    }
    let mut s = st.lock().unwrap();
    s.next += 1;
    let run_id = body.run_id.clone().unwrap_or_else(|| format!("run-{}", s.next));
    if s.runs.contains_key(&run_id) {
        return error(StatusCode::CONFLICT, "run_exists", "exists");
    }
    s.runs.insert(run_id.clone(), (body.tool.clone(), "created".into()));
    s.calls.push(Call {
        what: format!("create {run_id}"),
        body: serde_json::to_value(&body).unwrap(),
    });
    let created = CreatedRun {
        run: view(&run_id, &body.tool, "created"),
        secret: "s3cret".into(),
        proxy_url: format!("http://{run_id}:s3cret@127.0.0.1:9"),
        env: egress_api::proxy_env(&format!("http://{run_id}:s3cret@127.0.0.1:9")),
    };
    (StatusCode::CREATED, Json(created)).into_response()
}

/// `POST /v1/tools/{tool}/executable_mismatch`: recorded as the call
/// `mismatch <tool>` with its body.
async fn mismatch(
    State((st, _)): State<S>,
    h: HeaderMap,
    UrlPath(tool): UrlPath<String>,
    Json(body): Json<Value>,
) -> Response {
    if let Some(r) = refused(&h) {
        return r;
    }
    st.lock().unwrap().calls.push(Call {
        what: format!("mismatch {tool} {}", body["detail"].as_str().unwrap_or("")),
        body,
    });
    StatusCode::NO_CONTENT.into_response()
}

async fn activate(State((st, n)): State<S>, h: HeaderMap, UrlPath(id): UrlPath<String>) -> Response {
    if let Some(r) = refused(&h) {
        return r;
    }
    let tool = {
        let mut s = st.lock().unwrap();
        s.calls.push(Call {
            what: format!("activate {id}"),
            body: Value::Null,
        });
        if s.refuse_activations.1 > 0 {
            s.refuse_activations.1 -= 1;
            let status = StatusCode::from_u16(s.refuse_activations.0).unwrap_or(StatusCode::CONFLICT);
            return error(status, "refused", "refused by the test");
        }
        let entry = s.runs.entry(id.clone()).or_default();
        // As the proxy: an ended run is never active again.
        if entry.1 == "ended" {
            return error(StatusCode::CONFLICT, "run_ended", "the run has ended");
        }
        entry.1 = "active".into();
        entry.0.clone()
    };
    n.notify_waiters();
    Json(view(&id, &tool, "active")).into_response()
}

async fn end(State((st, _)): State<S>, h: HeaderMap, UrlPath(id): UrlPath<String>) -> Response {
    if let Some(r) = refused(&h) {
        return r;
    }
    let mut s = st.lock().unwrap();
    s.calls.push(Call {
        what: format!("end {id}"),
        body: Value::Null,
    });
    let entry = s.runs.entry(id.clone()).or_default();
    entry.1 = "ended".into();
    let tool = entry.0.clone();
    let facts = facts_of(&s, &id);
    let ended = EndedRun {
        run: view(&id, &tool, "ended"),
        denials: DenialSummary {
            total: facts.iter().map(|f| f.count).sum(),
            by_reason: Default::default(),
        },
        facts,
        facts_truncated: false,
    };
    Json(ended).into_response()
}

async fn show(State((st, _)): State<S>, h: HeaderMap, UrlPath(id): UrlPath<String>) -> Response {
    if let Some(r) = refused(&h) {
        return r;
    }
    match st.lock().unwrap().runs.get(&id) {
        Some((tool, state)) => Json(view(&id, tool, state)).into_response(),
        None => error(StatusCode::NOT_FOUND, "run_not_found", "no such run"),
    }
}

async fn facts(State((st, _)): State<S>, h: HeaderMap, UrlPath(id): UrlPath<String>) -> Response {
    if let Some(r) = refused(&h) {
        return r;
    }
    let s = st.lock().unwrap();
    let facts = facts_of(&s, &id);
    let next = facts.last().map_or(0, |f| f.seq);
    Json(FactsPage { facts, next }).into_response()
}

async fn policy(State((st, _)): State<S>, h: HeaderMap) -> Response {
    if let Some(r) = refused(&h) {
        return r;
    }
    let tools = st.lock().unwrap().policy_tools.clone();
    Json(PolicyView {
        policy: "sha256:fake".into(),
        tools,
    })
    .into_response()
}

async fn lease(
    State((st, _)): State<S>,
    h: HeaderMap,
    UrlPath(owner): UrlPath<String>,
    Json(body): Json<RenewOwner>,
) -> Response {
    if let Some(r) = refused(&h) {
        return r;
    }
    st.lock().unwrap().calls.push(Call {
        what: format!("lease {owner}"),
        body: serde_json::to_value(&body).unwrap(),
    });
    Json(OwnerView {
        owner,
        lease_ms: body.lease_ms,
        expires_at: "2099-01-01T00:00:00Z".into(),
        live_runs: 0,
    })
    .into_response()
}

async fn release(State((st, _)): State<S>, h: HeaderMap, UrlPath(owner): UrlPath<String>) -> Response {
    if let Some(r) = refused(&h) {
        return r;
    }
    st.lock().unwrap().calls.push(Call {
        what: format!("release {owner}"),
        body: Value::Null,
    });
    Json(OwnerReleased { owner, ended: 0 }).into_response()
}

impl FakeControl {
    pub async fn start() -> FakeControl {
        let state = Arc::new(Mutex::new(FakeState::default()));
        let activated = Arc::new(Notify::new());
        let app = Router::new()
            .route("/v1/runs", post(create))
            .route("/v1/runs/{id}/activate", post(activate))
            .route("/v1/runs/{id}", axum::routing::delete(end).get(show))
            .route("/v1/runs/{id}/facts", get(facts))
            .route("/v1/owners/{owner}", axum::routing::put(lease).delete(release))
            .route("/v1/policy", get(policy))
            .route("/v1/tools/{tool}/executable_mismatch", post(mismatch))
            .with_state((state.clone(), activated.clone()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeControl { addr, state, activated }
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<String> {
        self.state
            .lock()
            .unwrap()
            .calls
            .iter()
            .map(|c| c.what.clone())
            .collect()
    }

    /// The bodies of every `POST /v1/runs`.
    pub fn create_bodies(&self) -> Vec<Value> {
        self.state
            .lock()
            .unwrap()
            .calls
            .iter()
            .filter(|c| c.what.starts_with("create"))
            .map(|c| c.body.clone())
            .collect()
    }

    pub fn run_state(&self, id: &str) -> Option<String> {
        self.state.lock().unwrap().runs.get(id).map(|(_, s)| s.clone())
    }

    pub fn set_policy_tools(&self, tools: &[&str]) {
        self.state.lock().unwrap().policy_tools = tools.iter().map(|t| t.to_string()).collect();
    }

    /// Answers the next `n` activations with `status` (the activation is
    /// recorded as a call, the run stays as it was).
    pub fn refuse_activations(&self, status: u16, n: usize) {
        self.state.lock().unwrap().refuse_activations = (status, n);
    }

    /// Facts every run reports: each a JSON object with some of a fact's
    /// fields (the others defaulted).
    pub fn set_facts(&self, facts: Vec<Value>) {
        self.state.lock().unwrap().facts = facts;
    }
}
