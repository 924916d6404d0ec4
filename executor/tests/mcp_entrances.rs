//! One table of MCP rule cases (`egress_e2e::mcp::cases`), fed through both
//! places that decide MCP calls: the executor's `/v1/mcp/<tool>` endpoint
//! in front of a confined stdio server (`fixtures/hostile_mcp.py echo`) and
//! a remote MCP server (the official SDK's, behind TLS) through the proxy's
//! interception. Both must come to the same decision for every case, and
//! record the same facts (reason and called name).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::Path;

use egress_e2e::credentials::{api_credential, file_source, write_secret};
use egress_e2e::dns::FakeDns;
use egress_e2e::executor::{python, strongest_isolation, TempDir};
use egress_e2e::harness::{all_facts_at, TestProxy};
use egress_e2e::mcp::{cases, decided, endpoint, post, sdk_server, serve, tls_front, tunnel, CASE_RULES, REMOTE_TOKEN};
use egress_e2e::stack::{proxy_bin, start_stack, Stack};
use serde_json::{json, Value};

fn init() -> Value {
    json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
}

fn request(i: usize, method: &str, params: &Value) -> Value {
    json!({"jsonrpc": "2.0", "id": i + 1, "method": method, "params": params})
}

/// (reason, called name) of each MCP fact.
fn fact_set<'a>(facts: impl Iterator<Item = &'a Value>) -> BTreeSet<(String, String)> {
    facts
        .filter(|f| f["target"]["kind"] == json!("mcp"))
        .map(|f| {
            (
                f["reason"].as_str().unwrap().to_owned(),
                f["target"]["host"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn name_of(params: &Value) -> String {
    params
        .get("name")
        .or(params.get("uri"))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_executor_endpoint_and_interception_decide_every_case_alike() {
    let Some(_) = python() else { return };
    let want: Vec<Option<String>> = cases().iter().map(|c| c.2.map(str::to_owned)).collect();
    let want_facts: BTreeSet<(String, String)> = cases()
        .iter()
        .filter_map(|(_, params, r)| r.map(|r| (r.to_owned(), name_of(params))))
        .collect();

    // The executor's endpoint, a confined stdio server behind it.
    let bin = proxy_bin().expect("the proxy binary (cargo build -p egress-proxy)");
    let dns = FakeDns::start().await;
    let dir = TempDir::new("mcp-table");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hostile_mcp.py");
    let tools = format!(
        "[tools.tbl]\negress = []\n[tools.tbl.mcp]\n{CASE_RULES}\n[tools.tbl.process]\ncommand = [\"python3\", \"{}\", \"echo\"]\nlifecycle = \"session\"\nprotocol = \"mcp-stdio\"\nisolation = \"{}\"\npool = {{ warm = 0, max = 1 }}\n",
        script.display(),
        strongest_isolation()
    );
    let Stack { proxy, exec, control } = start_stack(&bin, &dir, dns.addr, &tools);
    let addr = serve(&exec).await;
    let (s, sid, v) = endpoint(addr, "tbl", "POST", None, Some(init())).await;
    assert_eq!(s, 200, "{v}");
    let sid = sid.unwrap();
    let mut got = Vec::new();
    for (i, (method, params, _)) in cases().iter().enumerate() {
        let (_, _, v) = endpoint(addr, "tbl", "POST", Some(&sid), Some(request(i, method, params))).await;
        assert_eq!(v["id"], json!(i + 1), "{v}");
        got.push(decided(&v));
    }
    assert_eq!(got, want, "the executor's endpoint");
    let facts = all_facts_at(control).await;
    assert_eq!(
        fact_set(facts.iter()),
        want_facts,
        "the executor's endpoint: {facts:#?}"
    );
    exec.shutdown();
    drop(proxy);

    // A remote server through interception, the same rules.
    let (_server, backend) = sdk_server(true);
    let (front, origin_ca) = tls_front(backend).await;
    let tmp = tempfile::tempdir().unwrap();
    let roots = tmp.path().join("roots.pem");
    std::fs::write(&roots, origin_ca).unwrap();
    let secret = tmp.path().join("token");
    write_secret(&secret, REMOTE_TOKEN, 0o600);
    let dns = FakeDns::start().await;
    dns.set("mcp.test", &["127.0.0.2"]);
    let authority = format!("mcp.test:{}", front.port());
    let text = format!(
        "[proxy.interception]\nupstream_ca_file = \"{}\"\n[tools.tbl]\negress = [\"{authority}\"]\ninspect = true\n[tools.tbl.mcp]\n{CASE_RULES}\n{}",
        roots.display(),
        api_credential("tbl", &authority, &file_source(&secret)),
    );
    let p = TestProxy::start_full(dns, "", &text, None).await;
    let run = p.run("tbl").await;
    let mut t = tunnel(&p, &run, &authority).await;
    let (s, sid, v) = post(&mut t, None, serde_json::to_vec(&init()).unwrap()).await;
    assert_eq!(s, 200, "{v}");
    let sid = sid.unwrap();
    let mut got = Vec::new();
    for (i, (method, params, _)) in cases().iter().enumerate() {
        let (_, _, v) = post(
            &mut t,
            Some(&sid),
            serde_json::to_vec(&request(i, method, params)).unwrap(),
        )
        .await;
        assert_eq!(v["id"], json!(i + 1), "{v}");
        got.push(decided(&v));
    }
    assert_eq!(got, want, "interception");
    let facts: Vec<Value> = p
        .facts()
        .await
        .iter()
        .map(|f| serde_json::to_value(f).unwrap())
        .collect();
    assert_eq!(fact_set(facts.iter()), want_facts, "interception: {facts:#?}");
}
