//! A real Rust tool through the executor, built on the `egress_tool` SDK.
//! This test binary is its own tool: started with `LOOM_IPC_FDS` set it
//! serves one invocation; otherwise it runs the test, pointing the tool's
//! command at itself (hence `harness = false`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::executor::*;
use egress_e2e::fake_control::FakeControl;
use egress_executor::InvocationRequest;
use serde_json::json;

fn main() {
    if std::env::var_os("LOOM_IPC_FDS").is_some() {
        let r = egress_tool::serve(
            || Ok("loaded"),
            |state, inv, emit| {
                emit(json!({"state": state})).map_err(|e| e.to_string())?;
                if inv.input == json!("fail") {
                    return Err("asked to fail".into());
                }
                Ok(json!({"echo": inv.input, "run_id": inv.run_id, "key": inv.idempotency_key}))
            },
        );
        std::process::exit(i32::from(r.is_err()));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(test());
    println!("rust_tool: 1 passed, 0 failed");
}

async fn test() {
    let me = std::env::current_exe().unwrap();
    let control = FakeControl::start().await;
    let dir = TempDir::new("rusttool");
    let cfg = write_config(
        &dir,
        control.addr,
        true,
        &format!(
            "[tools.recho]\negress = []\n[tools.recho.process]\ncommand = [\"{}\"]\npool = {{ warm = 1, max = 1 }}\n",
            me.display()
        ),
    );
    let exec = executor(&cfg);
    exec.warm_up();
    let req = |input, key: &str| InvocationRequest {
        idempotency_key: Some(key.into()),
        ..invocation("recho", input)
    };
    let res = exec.invoke(req(json!([1, 2, 3]), "idem")).await;
    assert!(res.ok, "{res:?}");
    let out = res.output.clone().unwrap();
    assert_eq!(out["echo"], json!([1, 2, 3]));
    assert_eq!(out["run_id"], json!(res.run_id.clone().unwrap()));
    assert_eq!(out["key"], json!("idem"));
    assert_eq!(res.emits, vec![json!({"state": "loaded"})]);
    let res = exec.invoke(req(json!("fail"), "idem-2")).await;
    let e = res.error.unwrap();
    assert_eq!(e.kind, egress_executor::ErrorKind::ToolError);
    assert_eq!(e.message, "asked to fail");
}
