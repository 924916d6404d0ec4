//! Fleet-wide idempotency with a real PostgreSQL 15: two `egress-executor`
//! processes, cells `cell-a` and `cell-b`, each with its own fake proxy,
//! claim keyed invocations in the same `egress_invocations` table. A tool
//! that appends a line to a counter file proves how often it ran. Skipped
//! loudly without root or PostgreSQL (see `egress_e2e::postgres`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use egress_e2e::executor::*;
use egress_e2e::fake_control::FakeControl;
use egress_e2e::harness::TOKEN;
use egress_e2e::postgres::Postgres;
use egress_e2e::process::{free_addr, KillOnDrop};
use serde_json::{json, Value};

const DSN_ENV: &str = "EGRESS_FLEET_TEST_DSN";

const COUNTER_PY: &str = r#"
import time
def run(input, ctx):
    with open(input["counter"], "a") as f:
        f.write(ctx.run_id + "\n")
    time.sleep(input.get("sleep", 0))
    return {"n": input.get("n"), "run_id": ctx.run_id}
"#;

const BIN: &str = env!("CARGO_BIN_EXE_egress-executor");

/// The counting tool's process: unconfined, up to 4 children, none warm.
const COUNT_PROCESS: &str =
    "cold_start_ms = 20000\ntimeout_ms = 20000\npool = { warm = 0, max = 4 }\nisolation = \"off\"\n";

struct Cell {
    _control: FakeControl,
    _dir: TempDir,
    _process: KillOnDrop,
    addr: SocketAddr,
}

impl Cell {
    /// `egress-executor serve` as cell `id`, advertising its listener as
    /// its `control_url`, with the DSN in its environment.
    async fn start(id: &str, dsn: &str) -> Cell {
        let control = FakeControl::start().await;
        let dir = TempDir::new(&format!("fleet-{id}"));
        dir.write("count.py", COUNTER_PY);
        let addr = free_addr();
        let tools = format!(
            r#"
[cell]
id = "{id}"
advertise_executor = "http://{addr}"

[export]
sink = "postgres"
dsn_env = "{DSN_ENV}"

{}"#,
            python_tool("count", "count.py", COUNT_PROCESS)
        );
        let cfg = write_config(&dir, control.addr, false, &tools);
        let text = std::fs::read_to_string(&cfg).unwrap();
        std::fs::write(
            &cfg,
            text.replace("listen = \"127.0.0.1:0\"", &format!("listen = \"{addr}\"")),
        )
        .unwrap();
        let (child, reported) = serve(Path::new(BIN), &cfg, &[(DSN_ENV, dsn)]);
        assert_eq!(reported, addr);
        Cell {
            _control: control,
            _dir: dir,
            _process: KillOnDrop(child),
            addr,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn invoke(&self, body: &Value) -> (u16, Value) {
        let (status, text) = http(self.addr, "POST", "/v1/invocations", Some(body.clone())).await;
        (
            status,
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}")),
        )
    }

    async fn claims(&self, result: &str) -> u64 {
        let line = format!("executor_idempotency_claims_total{{result=\"{result}\"}} ");
        let (_, m) = http(self.addr, "GET", "/metrics", None).await;
        m.lines()
            .find_map(|l| l.strip_prefix(&line))
            .unwrap_or_else(|| panic!("no {line} in\n{m}"))
            .trim()
            .parse()
            .unwrap()
    }
}

/// The Python and (when Node is here) JavaScript kernel clients invoking
/// `req` at `url`, printing the result as JSON.
fn client_scripts(url: &str, req: &Value) -> Vec<Command> {
    let root = egress_e2e::process::repo_root();
    let (tool, input, key) = (&req["tool"], req["input"].to_string(), &req["idempotency_key"]);
    let mut py = Command::new("python3");
    py.arg("-c")
        .arg(format!(
            "import json, sys; sys.path.insert(0, {:?}); from loom_egress import ExecutorClient\n\
             r = ExecutorClient({url:?}, token={TOKEN:?}).invoke({tool}, json.loads(sys.argv[1]), idempotency_key={key})\n\
             print(json.dumps(r))",
            root.join("clients/python").display().to_string()
        ))
        .arg(&input);
    let mut out = vec![py];
    if node().is_some() {
        let mut js = Command::new("node");
        js.args(["--input-type=module", "-e"])
            .arg(format!(
                "import {{ ExecutorClient }} from {:?};\n\
                 const r = await new ExecutorClient({url:?}, {{ token: {TOKEN:?} }}).invoke({tool}, JSON.parse(process.argv[1]), {{ idempotencyKey: {key} }});\n\
                 console.log(JSON.stringify(r));",
                root.join("clients/js/loom-egress.mjs").display().to_string()
            ))
            .arg(&input);
        out.push(js);
    } else {
        eprintln!("SKIPPED: node is missing; only the Python client follows in_progress here");
    }
    for c in &mut out {
        c.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
    }
    out
}

fn runs(counter: &Path) -> usize {
    std::fs::read_to_string(counter).unwrap_or_default().lines().count()
}

/// Two cells on one PostgreSQL (the DSN in the environment, as a cell has it).
async fn fleet(tag: &str) -> Option<(Postgres, Cell, Cell, PathBuf, TempDir)> {
    python()?;
    let pg = Postgres::start()?;
    let (a, b) = (
        Cell::start("cell-a", &pg.dsn()).await,
        Cell::start("cell-b", &pg.dsn()).await,
    );
    let shared = TempDir::new(tag);
    let counter = shared.path().join("runs");
    Some((pg, a, b, counter, shared))
}

fn keyed(key: &str, counter: &Path, n: u64, sleep: f64) -> Value {
    json!({
        "tool": "count",
        "idempotency_key": key,
        "input": {"counter": counter, "n": n, "sleep": sleep},
    })
}

/// A keyed invocation sent to cell-a, retried at cell-b while it runs and
/// after it ended: the tool ran exactly once. While it runs, cell-b answers
/// 409 `in_progress` naming cell-a and its URL, and the same request sent
/// there waits for the answer; after it ended, cell-b answers with
/// cell-a's answer, byte for byte as JSON. Another request under the key is
/// a conflict at cell-b too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_keyed_invocation_runs_once_in_the_fleet_wherever_it_is_retried() {
    let Some((_pg, a, b, counter, _shared)) = fleet("fleet-once").await else {
        return;
    };
    let req = keyed("order-17", &counter, 17, 3.0);
    let first = {
        let (addr, req) = (a.addr, req.clone());
        tokio::spawn(async move { http(addr, "POST", "/v1/invocations", Some(req)).await })
    };
    assert!(
        eventually(Duration::from_secs(20), || runs(&counter) == 1).await,
        "the tool never started at cell-a"
    );
    let (status, busy) = b.invoke(&req).await;
    assert_eq!(status, 409, "{busy}");
    assert_eq!(busy["error"]["kind"], "in_progress", "{busy}");
    assert_eq!(busy["cell"], "cell-a", "{busy}");
    assert_eq!(busy["control_url"], a.url(), "{busy}");
    // The kernel clients, sent to cell-b, follow control_url to cell-a,
    // which joins them to the running invocation.
    let clients: Vec<_> = client_scripts(&b.url(), &req)
        .into_iter()
        .map(|mut c| c.spawn().unwrap())
        .collect();
    let followers = clients.len() as u64;
    let (status, followed) = a.invoke(&req).await;
    let (first_status, first_text) = first.await.unwrap();
    let first: Value = serde_json::from_str(&first_text).unwrap();
    assert_eq!((status, first_status), (200, 200), "{followed} {first}");
    assert_eq!(first["ok"], true, "{first}");
    assert_eq!(first["cell"], "cell-a");
    assert_eq!(followed, first);
    for c in clients {
        let out = c.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let answer: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(answer, first, "a kernel client did not get the owner's answer");
    }
    // After it ended, cell-b gives cell-a's answer.
    let (status, stored) = b.invoke(&req).await;
    assert_eq!(status, 200, "{stored}");
    assert_eq!(stored, first, "cell-b's answer differs from the owner's");
    assert_eq!(runs(&counter), 1, "the tool ran more than once in the fleet");
    // Each client met in_progress at cell-b (or, on a slow machine, the
    // stored answer if cell-a had ended by then).
    let (busy, stored) = (b.claims("in_progress").await, b.claims("done").await);
    assert!(busy >= 1 && busy + stored == followers + 2, "{busy} {stored}");
    assert_eq!((a.claims("won").await, b.claims("won").await), (1, 0));
    // The same key with another request: a conflict at either cell (at
    // cell-b from the fleet's claim, for a key it has never seen).
    let (status, done) = a.invoke(&keyed("order-19", &counter, 19, 0.0)).await;
    assert_eq!(status, 200, "{done}");
    for cell in [&a, &b] {
        let (status, other) = cell.invoke(&keyed("order-19", &counter, 20, 0.0)).await;
        assert_eq!(status, 409, "{other}");
        assert_eq!(other["error"]["kind"], "idempotency_conflict", "{other}");
    }
    assert_eq!(b.claims("conflict").await, 1);
    assert_eq!(runs(&counter), 2);
    // Another key runs at cell-b.
    let (status, fresh) = b.invoke(&keyed("order-18", &counter, 18, 0.0)).await;
    assert_eq!(status, 200, "{fresh}");
    assert_eq!(fresh["cell"], "cell-b");
    assert_eq!(runs(&counter), 3);
}

/// With PostgreSQL stopped, a keyed invocation answers 503
/// `idempotency_unavailable` and runs nothing, at a cell that has never
/// reached it and at one whose connection broke; an unkeyed one still runs.
/// PostgreSQL back: keyed invocations run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_postgres_a_keyed_invocation_runs_nowhere() {
    let Some((mut pg, a, b, counter, _shared)) = fleet("fleet-unavailable").await else {
        return;
    };
    let (status, ok) = a.invoke(&keyed("before", &counter, 1, 0.0)).await;
    assert_eq!(status, 200, "{ok}");
    assert_eq!(runs(&counter), 1);
    pg.stop();
    for (cell, key) in [(&a, "during-a"), (&b, "during-b")] {
        let (status, refused) = cell.invoke(&keyed(key, &counter, 2, 0.0)).await;
        assert_eq!(status, 503, "{refused}");
        assert_eq!(refused["error"]["kind"], "idempotency_unavailable", "{refused}");
    }
    assert_eq!(runs(&counter), 1, "a keyed invocation ran without its claim");
    assert_eq!((a.claims("unavailable").await, b.claims("unavailable").await), (1, 1));
    let unkeyed = json!({"tool": "count", "input": {"counter": counter, "n": 3}});
    let (status, ran) = b.invoke(&unkeyed).await;
    assert_eq!(status, 200, "{ran}");
    assert_eq!(runs(&counter), 2);
    pg.resume();
    let (status, ok) = b.invoke(&keyed("during-b", &counter, 2, 0.0)).await;
    assert_eq!(status, 200, "{ok}");
    assert_eq!(runs(&counter), 3);
}

/// A keyed invocation dropped before it ends (its caller went away) gives
/// its claim up: as on one executor, a retry runs it again, here at another
/// cell.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_abandoned_claim_is_released_for_a_retry_elsewhere() {
    let Some((_pg, a, b, counter, _shared)) = fleet("fleet-abandoned").await else {
        return;
    };
    let req = keyed("walked-away", &counter, 5, 3.0);
    let gone = {
        let (addr, req) = (a.addr, req.clone());
        tokio::spawn(async move { http(addr, "POST", "/v1/invocations", Some(req)).await })
    };
    assert!(eventually(Duration::from_secs(20), || runs(&counter) == 1).await);
    gone.abort();
    // Until the release lands, cell-b answers in_progress; then it runs it.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    let (mut status, mut last) = b.invoke(&req).await;
    while status == 409 && last["error"]["kind"] == "in_progress" && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
        (status, last) = b.invoke(&req).await;
    }
    assert_eq!(status, 200, "the abandoned claim was never released: {last}");
    assert_eq!(last["cell"], "cell-b");
    assert_eq!(runs(&counter), 2);
}
