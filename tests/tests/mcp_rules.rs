//! The proxy's MCP decision routes: `POST /v1/runs/{id}/mcp` decides the
//! calls of one MCP message with the run's tool's `[tools.<id>.mcp]` rules
//! and commits the fact of every refused (or reported) call before it
//! answers: kind `mcp`, the called name, the arguments' digest and never
//! their values; `POST /v1/runs/{id}/mcp/list` filters a list answer. Every
//! answer is checked against the OpenAPI document by the harness.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{sample, TestProxy, TestRun};
use egress_proxy::facts::{Fact, FactError, FactQuery, FactSink, MemorySink, Recorded};
use futures_util::future::BoxFuture;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

const TOOLS: &str = r#"
[tools.files]
egress = []

[tools.files.mcp]
tools = ["read_file", { name = "search", args = { "query" = "weather*" } }]
deny_tools = ["delete_everything"]
resources = ["file:///srv/*"]
prompts = ["summarize"]

[tools.rep]
egress = []
mode = "report"

[tools.rep.mcp]
tools = ["read_file"]

[tools.open]
egress = []
"#;

/// Arguments that carry something secret-looking, which no fact may hold.
const SECRET: &str = "sk-live-SECRET-7f3a9c";

fn secret_args() -> Value {
    json!({ "token": SECRET, "path": "/srv/notes.txt" })
}

/// `sha256:` over the canonical JSON of [`secret_args`] (keys sorted, no
/// spaces): `{"path":"/srv/notes.txt","token":"sk-live-SECRET-7f3a9c"}`.
const SECRET_ARGS_DIGEST: &str = "sha256:29d23337b73ddaab8953ef9767e4e705806074719a2781ba15b47298fa9289ed";

fn tool_call(name: &str, arguments: Value) -> Value {
    json!({ "method": "tools/call", "name": name, "arguments": arguments })
}

async fn check(p: &TestProxy, run: &TestRun, calls: Vec<Value>) -> (u16, Value) {
    p.control(
        "POST",
        &format!("/v1/runs/{}/mcp", run.id),
        Some(json!({ "calls": calls })),
    )
    .await
}

async fn list(p: &TestProxy, run: &TestRun, kind: &str, names: &[&str]) -> (u16, Value) {
    let body = json!({ "kind": kind, "names": names });
    p.control("POST", &format!("/v1/runs/{}/mcp/list", run.id), Some(body))
        .await
}

fn mcp_facts(facts: &[Fact]) -> Vec<&Fact> {
    facts
        .iter()
        .filter(|f| f.target.as_ref().is_some_and(|t| t.kind == "mcp"))
        .collect()
}

#[tokio::test]
async fn allowed_calls_are_answered_without_a_fact() {
    let p = TestProxy::start(TOOLS).await;
    let run = p.run("files").await;
    let (s, v) = check(
        &p,
        &run,
        vec![
            tool_call("read_file", secret_args()),
            tool_call("search", json!({ "query": "weather in Oslo" })),
            json!({ "method": "resources/read", "name": "file:///srv/a.txt" }),
            json!({ "method": "prompts/get", "name": "summarize", "arguments": {} }),
            json!({ "method": "initialize" }),
            json!({ "method": "ping" }),
        ],
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["allowed"], true, "{v}");
    let decisions = v["decisions"].as_array().unwrap();
    assert_eq!(decisions.len(), 6);
    assert!(decisions.iter().all(|d| *d == json!({ "allowed": true })), "{v}");
    // A tool without [tools.<id>.mcp] allows every call.
    let open = p.run("open").await;
    let (s, v) = check(&p, &open, vec![tool_call("delete_everything", json!({}))]).await;
    assert_eq!((s, &v["allowed"]), (200, &json!(true)), "{v}");
    // An empty message is allowed too.
    let (s, v) = check(&p, &run, vec![]).await;
    assert_eq!((s, v), (200, json!({ "allowed": true, "decisions": [] })));
    assert!(p.facts().await.is_empty(), "{:?}", p.facts().await);
}

#[tokio::test]
async fn a_refused_tool_is_a_verdict_with_its_fact_and_never_the_arguments() {
    let p = TestProxy::start(TOOLS).await;
    let run = p.run("files").await;
    let (s, v) = check(&p, &run, vec![tool_call("write_file", secret_args())]).await;
    assert_eq!(s, 200, "a refusal is a verdict, not an error: {v}");
    assert_eq!(v["allowed"], false, "{v}");
    let d = &v["decisions"][0];
    assert_eq!(d["allowed"], false);
    assert_eq!(d["reason"], "mcp_tool_not_allowed");
    let message = d["message"].as_str().unwrap();
    assert!(message.contains("write_file"), "{message}");
    let fact_id = d["fact_id"].as_str().unwrap();
    // The fact is there as soon as the answer is.
    let facts = p.facts().await;
    let f = facts.iter().find(|f| f.id == fact_id).expect("the decision's fact");
    assert_eq!(f.reason, "mcp_tool_not_allowed");
    assert_eq!(f.mode, "enforce");
    assert_eq!(f.run_id.as_deref(), Some(run.id.as_str()));
    assert_eq!(f.tool.as_deref(), Some("files"));
    let t = f.target.as_ref().unwrap();
    assert_eq!((t.kind.as_str(), t.host.as_str(), t.port), ("mcp", "write_file", 0));
    assert!(f.detail.contains(SECRET_ARGS_DIGEST), "{}", f.detail);
    assert!(f.detail.contains("tools/call"), "{}", f.detail);
    // The argument values are nowhere: not in the facts, their API or the answer.
    let stored = serde_json::to_string(&facts).unwrap();
    let (_, listed) = p.control("GET", "/v1/facts?after=0", None).await;
    for text in [stored, listed.to_string(), v.to_string()] {
        assert!(!text.contains(SECRET), "{text}");
        assert!(!text.contains("/srv/notes.txt"), "{text}");
    }
    // A deny entry refuses what no allow list would have let through either,
    // and is counted with its reason.
    let (_, v) = check(&p, &run, vec![tool_call("delete_everything", json!({}))]).await;
    assert_eq!(v["decisions"][0]["reason"], "mcp_tool_not_allowed");
    let m = p.metrics().await;
    assert_eq!(
        sample(
            &m,
            "egress_denials_total{tool=\"files\",reason=\"mcp_tool_not_allowed\"}"
        ),
        2.0,
        "{m}"
    );
}

#[tokio::test]
async fn refused_arguments_resources_and_prompts_have_their_reasons() {
    let p = TestProxy::start(TOOLS).await;
    let run = p.run("files").await;
    let (s, v) = check(
        &p,
        &run,
        vec![
            tool_call("search", json!({ "query": "passwords of everyone" })),
            json!({ "method": "resources/read", "name": "file:///etc/shadow" }),
            json!({ "method": "prompts/get", "name": "jailbreak" }),
            json!({ "method": "tools/call" }),
        ],
    )
    .await;
    assert_eq!((s, &v["allowed"]), (200, &json!(false)), "{v}");
    let reasons: Vec<&str> = v["decisions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["reason"].as_str().unwrap())
        .collect();
    assert_eq!(
        reasons,
        [
            "mcp_arguments_not_allowed",
            "mcp_resource_not_allowed",
            "mcp_prompt_not_allowed",
            "mcp_tool_not_allowed"
        ]
    );
    let facts = p.facts().await;
    for d in v["decisions"].as_array().unwrap() {
        let f = facts.iter().find(|f| f.id == d["fact_id"].as_str().unwrap()).unwrap();
        assert_eq!(f.reason, d["reason"].as_str().unwrap());
        assert_eq!(f.target.as_ref().unwrap().kind, "mcp");
    }
    assert!(!serde_json::to_string(&facts).unwrap().contains("passwords of everyone"));
}

#[tokio::test]
async fn one_refused_call_refuses_the_whole_batch_and_every_call_is_decided() {
    let p = TestProxy::start(TOOLS).await;
    let run = p.run("files").await;
    let (s, v) = check(
        &p,
        &run,
        vec![
            tool_call("read_file", json!({ "path": "/srv/a" })),
            tool_call("delete_everything", secret_args()),
            json!({ "method": "ping" }),
        ],
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(v["allowed"], false, "{v}");
    let d = v["decisions"].as_array().unwrap();
    assert_eq!(d.len(), 3);
    assert_eq!(d[0], json!({ "allowed": true }));
    assert_eq!(
        (&d[1]["allowed"], &d[1]["reason"]),
        (&json!(false), &json!("mcp_tool_not_allowed"))
    );
    assert_eq!(d[2], json!({ "allowed": true }));
    let facts = p.facts().await;
    assert_eq!(mcp_facts(&facts).len(), 1, "{facts:?}");
    assert_eq!(facts[0].id, d[1]["fact_id"].as_str().unwrap());
    assert_eq!(facts[0].target.as_ref().unwrap().host, "delete_everything");
}

#[tokio::test]
async fn report_mode_allows_the_call_and_records_what_enforce_would_have_refused() {
    let p = TestProxy::start(TOOLS).await;
    let run = p.run("rep").await;
    let (s, v) = check(
        &p,
        &run,
        vec![
            tool_call("read_file", json!({})),
            tool_call("write_file", secret_args()),
        ],
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(v["allowed"], true, "{v}");
    let d = &v["decisions"][1];
    assert_eq!(d["allowed"], true);
    assert_eq!(d["reason"], "mcp_tool_not_allowed");
    let facts = p.facts().await;
    let f = facts.iter().find(|f| f.id == d["fact_id"].as_str().unwrap()).unwrap();
    assert_eq!((f.mode.as_str(), f.reason.as_str()), ("report", "mcp_tool_not_allowed"));
    assert!(f.detail.contains(SECRET_ARGS_DIGEST), "{}", f.detail);
    assert!(!serde_json::to_string(&facts).unwrap().contains(SECRET));
    assert_eq!(v["decisions"][0], json!({ "allowed": true }));
}

#[tokio::test]
async fn list_answers_keep_only_what_the_rules_could_allow_and_record_nothing() {
    let p = TestProxy::start(TOOLS).await;
    let run = p.run("files").await;
    let (s, v) = list(
        &p,
        &run,
        "tools",
        &["read_file", "search", "write_file", "delete_everything"],
    )
    .await;
    assert_eq!((s, v), (200, json!({ "keep": [true, true, false, false] })));
    let (_, v) = list(&p, &run, "resources", &["file:///srv/a.txt", "file:///etc/passwd"]).await;
    assert_eq!(v, json!({ "keep": [true, false] }));
    let (_, v) = list(&p, &run, "prompts", &["summarize", "jailbreak"]).await;
    assert_eq!(v, json!({ "keep": [true, false] }));
    let (_, v) = list(&p, &run, "tools", &[]).await;
    assert_eq!(v, json!({ "keep": [] }));
    let open = p.run("open").await;
    let (_, v) = list(&p, &open, "tools", &["anything"]).await;
    assert_eq!(v, json!({ "keep": [true] }));
    assert!(p.facts().await.is_empty());
}

#[tokio::test]
async fn unknown_ended_and_oversized_checks_are_clear_errors() {
    let p = TestProxy::start(TOOLS).await;
    let nobody = TestRun {
        id: "no-such-run".into(),
        secret: String::new(),
        url: String::new(),
    };
    let (s, v) = check(&p, &nobody, vec![json!({ "method": "ping" })]).await;
    assert_eq!((s, v["error"]["code"].as_str()), (404, Some("run_not_found")));
    let (s, v) = list(&p, &nobody, "tools", &["a"]).await;
    assert_eq!((s, v["error"]["code"].as_str()), (404, Some("run_not_found")));
    let run = p.run("files").await;
    let too_many: Vec<Value> = (0..=egress_api::mcp::MCP_CHECK_MAX_CALLS)
        .map(|_| json!({ "method": "ping" }))
        .collect();
    let (s, v) = check(&p, &run, too_many).await;
    assert_eq!((s, v["error"]["code"].as_str()), (400, Some("bad_request")), "{v}");
    let names = vec!["a"; egress_api::mcp::MCP_LIST_MAX_NAMES + 1];
    let (s, v) = list(&p, &run, "tools", &names).await;
    assert_eq!((s, v["error"]["code"].as_str()), (400, Some("bad_request")), "{v}");
    let long = "n".repeat(egress_api::mcp::MCP_NAME_MAX + 1);
    let (s, v) = list(&p, &run, "tools", &[&long]).await;
    assert_eq!((s, v["error"]["code"].as_str()), (400, Some("bad_request")), "{v}");
    // The body bound of these routes (16 MiB) is above the 64 KiB of the
    // rest of the API: 80 KiB of arguments are decided.
    let (s, v) = check(
        &p,
        &run,
        vec![tool_call("read_file", json!({ "path": "x".repeat(80 << 10) }))],
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = p
        .control(
            "POST",
            &format!("/v1/runs/{}/mcp", run.id),
            Some(json!({ "calls": [{ "method": "ping", "params": {} }] })),
        )
        .await;
    assert_eq!((s, v["error"]["code"].as_str()), (422, Some("bad_request")), "{v}");
    let r = p
        .control_raw(
            "POST",
            &format!("/v1/runs/{}/mcp", run.id),
            Some(json!({ "calls": [] })),
            None,
        )
        .await;
    assert_eq!(r.status, 401);
    p.end(&run).await;
    let (s, v) = check(&p, &run, vec![tool_call("read_file", json!({}))]).await;
    assert_eq!((s, v["error"]["code"].as_str()), (409, Some("run_ended")));
    let (s, v) = list(&p, &run, "tools", &["read_file"]).await;
    assert_eq!((s, v["error"]["code"].as_str()), (409, Some("run_ended")));
    assert!(p.facts().await.is_empty());
}

/// A sink whose writes wait until the test lets them through, so the
/// test can see the answer wait for its facts and count the writes in
/// flight at once.
struct GatedSink {
    inner: MemorySink,
    gate: tokio::sync::Semaphore,
    waiting: std::sync::atomic::AtomicUsize,
}

impl FactSink for GatedSink {
    fn record(&self, fact: Fact) -> BoxFuture<'_, Result<Recorded, FactError>> {
        Box::pin(async move {
            self.waiting.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.gate.acquire().await.unwrap().forget();
            self.inner.record(fact).await
        })
    }
    fn query(&self, q: FactQuery) -> BoxFuture<'_, Result<Vec<Fact>, FactError>> {
        self.inner.query(q)
    }
    fn subscribe(&self) -> tokio::sync::broadcast::Receiver<Fact> {
        self.inner.subscribe()
    }
}

impl GatedSink {
    /// Waits (10 s at most) until `n` writes wait at the gate.
    async fn wait_for(&self, n: usize) {
        for _ in 0..1000 {
            if self.waiting.load(std::sync::atomic::Ordering::SeqCst) >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{n} fact writes never waited at once");
    }
}

/// A store that cannot record.
struct BrokenSink;

impl FactSink for BrokenSink {
    fn record(&self, _: Fact) -> BoxFuture<'_, Result<Recorded, FactError>> {
        Box::pin(async { Err(FactError::Unavailable("disk full".into())) })
    }
    fn query(&self, _: FactQuery) -> BoxFuture<'_, Result<Vec<Fact>, FactError>> {
        Box::pin(async { Err(FactError::Unavailable("disk full".into())) })
    }
    fn subscribe(&self) -> tokio::sync::broadcast::Receiver<Fact> {
        tokio::sync::broadcast::channel(1).1
    }
}

#[tokio::test]
async fn the_fact_is_committed_before_the_verdict_and_none_means_no_verdict() {
    let sink = Arc::new(GatedSink {
        inner: MemorySink::new(100),
        gate: tokio::sync::Semaphore::new(0),
        waiting: Default::default(),
    });
    let p = Arc::new(TestProxy::start_with("", TOOLS, Some(sink.clone())).await);
    let run = p.run("files").await;
    // Three refused calls: their facts are written together (all three wait
    // at the gate at once), and the verdict waits for them.
    let asked = {
        let (p, run) = (p.clone(), run.clone());
        tokio::spawn(async move {
            check(
                &p,
                &run,
                vec![
                    tool_call("write_file", secret_args()),
                    tool_call("rm", json!({})),
                    tool_call("chmod", json!({})),
                ],
            )
            .await
        })
    };
    sink.wait_for(3).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!asked.is_finished(), "answered before the facts were stored");
    sink.gate.add_permits(3);
    let (s, v) = asked.await.unwrap();
    assert_eq!((s, &v["allowed"]), (200, &json!(false)), "{v}");
    let stored = sink
        .inner
        .query(FactQuery {
            after: 0,
            limit: 10,
            run_id: None,
        })
        .await
        .unwrap();
    assert_eq!(stored.len(), 3, "{stored:?}");
    // Report mode, too, waits for its fact.
    let rep = p.run("rep").await;
    let asked = {
        let (p, rep) = (p.clone(), rep.clone());
        tokio::spawn(async move { check(&p, &rep, vec![tool_call("write_file", json!({}))]).await })
    };
    sink.wait_for(4).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!asked.is_finished(), "answered before the report fact was stored");
    sink.gate.add_permits(1);
    let (_, v) = asked.await.unwrap();
    assert_eq!(v["allowed"], true);

    // No fact, no verdict: 503, in enforce and in report mode; an allowed
    // call needs no fact and is answered.
    let p = TestProxy::start_with("", TOOLS, Some(Arc::new(BrokenSink))).await;
    for tool in ["files", "rep"] {
        let run = p.run(tool).await;
        let (s, v) = check(&p, &run, vec![tool_call("write_file", json!({}))]).await;
        assert_eq!(
            (s, v["error"]["code"].as_str()),
            (503, Some("facts_unavailable")),
            "{v}"
        );
        let (s, v) = check(&p, &run, vec![tool_call("read_file", json!({}))]).await;
        assert_eq!((s, &v["allowed"]), (200, &json!(true)), "{v}");
    }
    let m = p.metrics().await;
    assert!(sample(&m, "egress_fact_write_failures_total") >= 2.0, "{m}");
}

/// An allowed call that names what it calls is in the decision log (with
/// `[proxy] decisions = "all"`): kind `mcp`, the name, the method, never
/// the arguments; a call that names nothing (`ping`) is not.
#[tokio::test]
async fn allowed_calls_are_in_the_decision_log_without_their_arguments() {
    let p = TestProxy::start_with("decisions = \"all\"\n", TOOLS, None).await;
    let run = p.run("files").await;
    let (s, v) = check(
        &p,
        &run,
        vec![tool_call("read_file", secret_args()), json!({ "method": "ping" })],
    )
    .await;
    assert_eq!((s, &v["allowed"]), (200, &json!(true)), "{v}");
    let mut found = vec![];
    for _ in 0..200 {
        let (_, page) = p.control("GET", "/v1/decisions?limit=100", None).await;
        found = page["decisions"].as_array().cloned().unwrap_or_default();
        if !found.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(found.len(), 1, "{found:#?}");
    let d = &found[0];
    assert_eq!(
        (&d["kind"], &d["host"], &d["method"]),
        (&json!("mcp"), &json!("read_file"), &json!("tools/call")),
        "{d}"
    );
    assert_eq!(d["run_id"], json!(run.id));
    assert!(!d.to_string().contains(SECRET), "{d}");
}
