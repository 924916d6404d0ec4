//! Example Rust tool on the `egress_tool` SDK, used by `examples/egress.toml`
//! (`cargo build -p egress-tool --example hello_tool`). `load` runs before
//! `ready` (no network: the run is not active yet); the handler runs once.
//! A Rust tool that fetches would send its requests through `HTTP_PROXY`,
//! the run's proxy URL, like any other tool.

use serde_json::json;

fn main() -> std::io::Result<()> {
    egress_tool::serve(
        || Ok(std::time::Instant::now()),
        |loaded, inv, emit| {
            let name = inv
                .input
                .get("name")
                .and_then(|v| v.as_str())
                .unwrap_or("world")
                .to_owned();
            emit(json!({"step": "greet", "name": name})).map_err(|e| e.to_string())?;
            Ok(json!({
                "greeting": format!("hello, {name}"),
                "run_id": inv.run_id,
                "has_proxy": std::env::var_os("HTTP_PROXY").is_some(),
                "warm_ms": u64::try_from(loaded.elapsed().as_millis()).unwrap_or(u64::MAX),
                "by": "rust",
            }))
        },
    )
}
