//! The kernel-facing executor API: idempotency keys that deduplicate (a
//! repeat answers with the first invocation's outcome, or joins it while it
//! runs; another request under the same key is 409), and every bounded
//! metric series present at 0 from the start.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use egress_e2e::executor::*;
use egress_e2e::fake_control::FakeControl;
use egress_e2e::harness::TOKEN;
use egress_executor::{ErrorKind, Executor, InvocationRequest};
use serde_json::{json, Value};

const COUNTING_PY: &str = r#"
import os, sys, time
def run(input, ctx):
    ctx.emit({"started": input.get("n")})
    if "then" in input:
        ctx.emit({"step": 2})
        then = input["then"]
        if then == "hang":
            time.sleep(60)
        if then == "crash":
            sys.stdout.flush()
            os._exit(3)
        if then == "raise":
            raise RuntimeError("tool failed on purpose")
    time.sleep(input.get("sleep", 0))
    return {"pid": os.getpid(), "run_id": ctx.run_id, "n": input.get("n")}
"#;

async fn setup(tag: &str) -> (FakeControl, TempDir, Arc<Executor>) {
    let dir = TempDir::new(tag);
    dir.write("count.py", COUNTING_PY);
    let tools = python_tool(
        "count",
        "count.py",
        "cold_start_ms = 20000\ntimeout_ms = 20000\npool = { warm = 0, max = 4 }\nisolation = \"off\"\n",
    );
    let (control, exec) = beside_fake_control(&dir, false, &tools).await;
    (control, dir, exec)
}

fn req(input: Value, key: &str) -> InvocationRequest {
    InvocationRequest {
        idempotency_key: Some(key.into()),
        ..invocation("count", input)
    }
}

fn activations(c: &FakeControl) -> usize {
    c.calls().iter().filter(|c| c.starts_with("activate")).count()
}

#[tokio::test]
async fn a_repeated_idempotency_key_answers_with_the_first_outcome_and_runs_once() {
    let Some(_) = python() else { return };
    let (control, _dir, exec) = setup("idem").await;
    let first = exec.invoke(req(json!({"n": 1}), "k-1")).await;
    assert!(first.ok, "{first:?}");
    let again = exec.invoke(req(json!({"n": 1}), "k-1")).await;
    assert_eq!(again.output, first.output, "the tool ran twice");
    assert_eq!(again.run_id, first.run_id);
    assert_eq!(activations(&control), 1);
    // The same key with another request is a conflict, and runs nothing.
    let other = exec.invoke(req(json!({"n": 2}), "k-1")).await;
    assert_eq!(
        other.error.as_ref().map(|e| e.kind),
        Some(ErrorKind::IdempotencyConflict),
        "{other:?}"
    );
    assert_eq!(ErrorKind::IdempotencyConflict.http_status(), 409);
    assert_eq!(activations(&control), 1);
    // Another key runs the tool.
    let fresh = exec.invoke(req(json!({"n": 1}), "k-2")).await;
    assert_ne!(fresh.run_id, first.run_id);
    assert_eq!(activations(&control), 2);
}

#[tokio::test]
async fn a_repeat_while_the_first_runs_joins_it() {
    let Some(_) = python() else { return };
    let (control, _dir, exec) = setup("idem-join").await;
    let (e1, e2) = (exec.clone(), exec.clone());
    let a = tokio::spawn(async move { e1.invoke(req(json!({"n": 7, "sleep": 1.0}), "slow")).await });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let b = tokio::spawn(async move { e2.invoke(req(json!({"n": 7, "sleep": 1.0}), "slow")).await });
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    assert!(a.ok && b.ok, "{a:?} {b:?}");
    assert_eq!(a.output, b.output);
    assert_eq!(a.emits, b.emits);
    assert_eq!(activations(&control), 1, "the repeat ran the tool again");
}

#[tokio::test]
async fn every_bounded_executor_series_exists_at_zero() {
    let (_control, _dir, exec) = setup("metrics0").await;
    let m = exec.metrics().encode();
    for series in [
        "executor_kills_total{tool=\"count\",reason=\"timeout\"} 0",
        "executor_kills_total{tool=\"count\",reason=\"proxy_error\"} 0",
        "executor_invocations_total{tool=\"count\",outcome=\"ok\"} 0",
        "executor_invocations_total{tool=\"count\",outcome=\"proxy\"} 0",
        "executor_invocations_total{tool=\"count\",outcome=\"idempotency_conflict\"} 0",
        "executor_invocations_total{tool=\"count\",outcome=\"run_exists\"} 0",
        "executor_pool_ready{tool=\"count\"} 0",
        "executor_children{tool=\"count\",state=\"busy\"} 0",
    ] {
        assert!(m.lines().any(|l| l == series), "{series} missing at start:\n{m}");
    }
    assert_eq!(ErrorKind::Proxy.http_status(), 502, "a proxy failure is not a 200");
}

#[tokio::test]
async fn emits_come_back_with_every_outcome_in_order() {
    let Some(_) = python() else { return };
    let (_control, _dir, exec) = setup("emits").await;
    let want = vec![json!({"started": 1}), json!({"step": 2})];
    let call = |then: &str, timeout_ms: Option<u64>| InvocationRequest {
        tool: "count".into(),
        input: json!({"n": 1, "then": then}),
        run_id: None,
        idempotency_key: Some(format!("emits-{then}-{}", timeout_ms.unwrap_or(0))),
        timeout_ms,
        principal: None,
    };
    // Timeout.
    let r = exec.invoke(call("hang", Some(1500))).await;
    assert_eq!(r.error.as_ref().map(|e| e.kind), Some(ErrorKind::Timeout), "{r:?}");
    assert_eq!(r.emits, want, "timeout lost the emits");
    // Crash (the child exits before a result).
    let r = exec.invoke(call("crash", None)).await;
    assert_eq!(r.error.as_ref().map(|e| e.kind), Some(ErrorKind::Disconnected), "{r:?}");
    assert_eq!(r.emits, want, "a crash lost the emits");
    // Tool error.
    let r = exec.invoke(call("raise", None)).await;
    assert_eq!(r.error.as_ref().map(|e| e.kind), Some(ErrorKind::ToolError), "{r:?}");
    assert_eq!(r.emits, want, "a tool error lost the emits");
    // Abort while it hangs.
    let e2 = exec.clone();
    let t = tokio::spawn(async move { e2.invoke(call("hang", None)).await });
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert!(exec.abort("emits-hang-0"));
    let r = t.await.unwrap();
    assert_eq!(r.error.as_ref().map(|e| e.kind), Some(ErrorKind::Aborted), "{r:?}");
    assert_eq!(r.emits, want, "an abort lost the emits");
    let m = exec.metrics().encode();
    assert!(
        m.lines().any(|l| l == "executor_emits_total{tool=\"count\"} 8"),
        "emits not counted:\n{m}"
    );
}

fn executor_bin(args: &[&str], cfg: &std::path::Path) -> (i32, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_egress-executor"))
        .args(args)
        .arg("--config")
        .arg(cfg)
        .env("EGRESS_CONTROL_TOKEN", TOKEN)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_and_doctor_fail_on_what_would_break_a_tool() {
    let control = FakeControl::start().await;
    let dir = TempDir::new("check");
    dir.write("count.py", COUNTING_PY);
    let runner = python_runner();
    // An argument that is only text to its program (a shell's `-c`) is
    // never taken for a file, however many slashes it has.
    let good = format!(
        "[tools.count]\negress = []\n[tools.count.process]\ncommand = [\"python3\", \"{}\", \"count.py\"]\nisolation = \"off\"\n\
         [tools.shell]\negress = []\n[tools.shell.process]\ncommand = [\"sh\", \"-c\", \"echo a/b\"]\nisolation = \"off\"\n",
        runner.display()
    );
    let cfg = write_config(&dir, control.addr, false, &good);
    let (code, text) = executor_bin(&["check"], &cfg);
    assert_eq!(code, 0, "{text}");
    // A missing runner file, a missing program, a file the proxy rejects: all reported, exit 1.
    let bad = format!(
        "{good}[tools.ghost]\negress = [\"no-port.example\"]\n[tools.ghost.process]\ncommand = [\"no-such-program-xyz\"]\n[tools.lost]\negress = []\n[tools.lost.process]\ncommand = [\"python3\", \"{}\", \"missing.py\"]\n",
        runner.display()
    );
    let bad_dir = TempDir::new("check-bad");
    bad_dir.write("count.py", COUNTING_PY);
    let bad_cfg = write_config(&bad_dir, control.addr, false, &bad);
    let (code, text) = executor_bin(&["check"], &bad_cfg);
    assert_eq!(code, 1, "{text}");
    for needle in ["no-such-program-xyz", "missing.py", "tools.ghost.egress[0]"] {
        assert!(text.contains(needle), "check did not report {needle}:\n{text}");
    }
    // doctor: the proxy does not know a tool this executor serves.
    control.set_policy_tools(&["count", "shell"]);
    let (_, text) = executor_bin(&["doctor"], &cfg);
    assert!(
        text.contains("tools known to the proxy") && !text.contains("not in the proxy's policy"),
        "{text}"
    );
    control.set_policy_tools(&[]);
    let (code, text) = executor_bin(&["doctor"], &cfg);
    assert_ne!(code, 0, "{text}");
    assert!(
        text.contains("not in the proxy's policy") && text.contains("count"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invocations_are_listed_newest_first_filtered_paged_and_found_by_any_id() {
    let Some(_) = python() else { return };
    let (_control, _dir, exec) = setup("journal").await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = egress_executor::api::router(exec.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let ok = exec.invoke(req(json!({"n": 1}), "j-ok")).await;
    assert!(ok.ok);
    let failed = exec.invoke(req(json!({"n": 2, "then": "raise"}), "j-err")).await;
    assert!(!failed.ok);
    let e2 = exec.clone();
    let slow = tokio::spawn(async move { e2.invoke(req(json!({"n": 3, "sleep": 1.5}), "j-slow")).await });
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let (status, body) = http(addr, "GET", "/v1/invocations", None).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let keys: Vec<&str> = v["invocations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["idempotency_key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["j-slow", "j-err", "j-ok"], "{v}");
    assert_eq!(v["invocations"][0]["state"], "running");
    assert_eq!(v["invocations"][1]["outcome"], "tool_error");
    let (_, body) = http(addr, "GET", "/v1/invocations?outcome=ok", None).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["invocations"].as_array().unwrap().len(), 1);
    assert_eq!(v["invocations"][0]["run_id"], json!(ok.run_id));
    // Paging one at a time walks the same list.
    let mut walked = vec![];
    let mut after = String::new();
    loop {
        let (_, body) = http(addr, "GET", &format!("/v1/invocations?limit=1{after}"), None).await;
        let v: Value = serde_json::from_str(&body).unwrap();
        walked.push(v["invocations"][0]["idempotency_key"].as_str().unwrap().to_owned());
        match v["next"].as_str() {
            Some(n) => after = format!("&after={n}"),
            None => break,
        }
    }
    assert_eq!(walked, ["j-slow", "j-err", "j-ok"]);
    // By invocation id, run id or idempotency key.
    for id in [
        ok.invocation_id.clone().unwrap(),
        ok.run_id.clone().unwrap(),
        "j-ok".to_owned(),
    ] {
        let (status, body) = http(addr, "GET", &format!("/v1/invocations/{id}"), None).await;
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["state"], "done");
        assert_eq!(v["result"]["output"], json!(ok.output));
    }
    let (_, body) = http(addr, "GET", "/v1/invocations/j-slow", None).await;
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["state"], "running");
    let (status, _) = http(addr, "GET", "/v1/invocations/nope", None).await;
    assert_eq!(status, 404);
    let (status, _) = http(addr, "GET", "/v1/invocations?state=sleeping", None).await;
    assert_eq!(status, 400);
    assert!(slow.await.unwrap().ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_executor_openapi_document_lists_every_route_and_describes_the_answers() {
    let Some(_) = python() else { return };
    let (_control, _dir, exec) = setup("openapi").await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = egress_executor::api::router(exec.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let (status, body) = http(addr, "GET", "/v1/openapi.json", None).await;
    assert_eq!(status, 200);
    let served: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(served["openapi"], "3.1.0");
    let spec = egress_e2e::openapi::Spec::new(serde_json::to_value(egress_executor::api::openapi()).unwrap());
    assert_eq!(&served, spec.doc());
    let ops: Vec<String> = spec.operations().iter().map(|(m, p)| format!("{m} {p}")).collect();
    assert_eq!(
        ops,
        [
            "GET /healthz",
            "GET /metrics",
            "GET /v1/cell",
            "GET /v1/invocations",
            "POST /v1/invocations",
            "GET /v1/invocations/{id}",
            "POST /v1/invocations/{id}/abort",
            "DELETE /v1/mcp/{tool}",
            "GET /v1/mcp/{tool}",
            "POST /v1/mcp/{tool}",
        ]
    );
    // The cell view: no [cell] here, the pools' capacity, the policy.
    let (status, cell) = http(addr, "GET", "/v1/cell", None).await;
    assert_eq!(status, 200, "{cell}");
    let cell: Value = serde_json::from_str(&cell).unwrap();
    assert!(cell.get("id").is_none(), "{cell}");
    assert!(cell["pool_capacity"].as_u64().unwrap() >= 1, "{cell}");
    assert!(cell["policy"].as_str().unwrap().starts_with("sha256:"), "{cell}");
    assert_eq!(
        (cell["ready"].as_bool(), cell.get("reason")),
        (Some(true), None),
        "{cell}"
    );
    // Real answers match the schemas of their status.
    let body = json!({"tool": "count", "input": {"n": 1}, "idempotency_key": "oa-1"});
    let op = spec.operation("POST", "/v1/invocations").unwrap();
    assert!(op.check_request(&body).is_empty());
    for (b, want) in [
        (body.clone(), 200),
        (json!({"tool": "nope"}), 404),
        (
            json!({"tool": "count", "input": {"n": 2}, "idempotency_key": "oa-1"}),
            409,
        ),
    ] {
        let (status, text) = http(addr, "POST", "/v1/invocations", Some(b)).await;
        assert_eq!(status, want, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let problems = op.check_response(status, &v);
        assert!(problems.is_empty(), "{status}: {problems:?}\n{v}");
    }
    let (status, text) = http(addr, "GET", "/v1/invocations", None).await;
    let problems = spec
        .operation("GET", "/v1/invocations")
        .unwrap()
        .check_response(status, &serde_json::from_str(&text).unwrap());
    assert!(problems.is_empty(), "{problems:?}\n{text}");
    // Shutting down, the cell says it takes no new work.
    exec.shutdown();
    let (_, cell) = http(addr, "GET", "/v1/cell", None).await;
    let cell: Value = serde_json::from_str(&cell).unwrap();
    assert_eq!(
        (cell["ready"].as_bool(), cell["reason"].as_str()),
        (Some(false), Some("shutting_down")),
        "{cell}"
    );
}

/// What the document says of `run_id` and `timeout_ms` is what the executor
/// holds a request to: an id the proxy would refuse is a `400` before the
/// proxy is asked (it was a `502` from the proxy's refusal), an id the proxy
/// already has is `409 run_exists` (it was a `502`), `timeout_ms` 0 is a
/// `400`, and a whole float is an integer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_ids_and_timeouts_are_held_to_the_document() {
    let Some(_) = python() else { return };
    let (control, _dir, exec) = setup("doc-rules").await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = egress_executor::api::router(exec.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let spec = egress_e2e::openapi::Spec::new(serde_json::to_value(egress_executor::api::openapi()).unwrap());
    let op = spec.operation("POST", "/v1/invocations").unwrap();
    let call = |body: Value| async move {
        let (status, text) = http(addr, "POST", "/v1/invocations", Some(body)).await;
        let v: Value = serde_json::from_str(&text).unwrap();
        (status, v)
    };
    for bad in ["a b", "", "é", &"a".repeat(129)] {
        let body = json!({"tool": "count", "input": {"n": 1}, "run_id": bad});
        assert!(!op.check_request(&body).is_empty(), "the document allows {bad:?}");
        let (status, v) = call(body).await;
        assert_eq!(
            (status, v["error"]["kind"].as_str()),
            (400, Some("bad_request")),
            "{bad:?}: {v}"
        );
        assert!(op.check_response(status, &v).is_empty());
    }
    assert!(
        !control.calls().iter().any(|c| c.starts_with("create ")),
        "an invalid id reached the proxy: {:?}",
        control.calls()
    );
    let body = json!({"tool": "count", "input": {"n": 1}, "run_id": "kernel-7", "timeout_ms": 20000.0});
    assert!(op.check_request(&body).is_empty());
    let (status, v) = call(body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["run_id"], "kernel-7");
    let (status, v) = call(json!({"tool": "count", "input": {"n": 2}, "run_id": "kernel-7"})).await;
    assert_eq!((status, v["error"]["kind"].as_str()), (409, Some("run_exists")), "{v}");
    assert!(op.check_response(status, &v).is_empty(), "{v}");
    let body = json!({"tool": "count", "timeout_ms": 0});
    assert!(!op.check_request(&body).is_empty(), "the document allows timeout_ms 0");
    assert_eq!(call(body).await.0, 400);
}
