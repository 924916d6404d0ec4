//! A trivial Rust tool built on the `egress_tool` SDK: echoes its input,
//! emitting one fact first. Used by the runner tests and the benchmark
//! (`cargo build -p egress-tool --example rust_echo`).

use serde_json::json;

fn main() -> std::io::Result<()> {
    egress_tool::serve(
        || Ok("loaded"),
        |state, inv, emit| {
            emit(json!({"state": state})).map_err(|e| e.to_string())?;
            Ok(json!({"echo": inv.input, "run_id": inv.run_id}))
        },
    )
}
