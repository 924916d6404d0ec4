//! MCP rule evaluation (`McpList::check`, the pure matcher the proxy's
//! decider calls for every MCP call): a tool's `[tools.<id>.mcp]` of 200
//! allow entries (names, `*` globs, entries with argument matchers on
//! dotted paths) and 20 deny entries; hits, misses and argument checks.
#![allow(clippy::unwrap_used)]

use criterion::{criterion_group, criterion_main, Criterion};
use egress_config::{Config, McpRules};
use serde_json::json;
use std::hint::black_box;

fn rules() -> McpRules {
    let mut tools = vec![];
    for i in 0..100 {
        tools.push(format!("\"tool_{i}\""));
    }
    for i in 0..50 {
        tools.push(format!("\"ns{i}_*\""));
    }
    for i in 0..50 {
        tools.push(format!(
            "{{ name = \"git_{i}\", args = {{ repo_path = \"/srv/repos/*\", max_count = {{ min = 1, max = 100 }}, \"opts.mode\" = [\"a\", \"b\"] }} }}"
        ));
    }
    let deny: Vec<String> = (0..20).map(|i| format!("\"tool_{}\"", i * 5)).collect();
    let text = format!(
        "[tools.t]\negress = []\n[tools.t.mcp]\ntools = [{}]\ndeny_tools = [{}]\n",
        tools.join(", "),
        deny.join(", ")
    );
    let c = Config::parse(&text, "bench.toml").unwrap();
    c.policy.tools["t"].mcp.clone().unwrap()
}

fn checks(c: &mut Criterion) {
    let r = rules();
    let ok_args = json!({"repo_path": "/srv/repos/app", "max_count": 10, "opts": {"mode": "a"}});
    let bad_args = json!({"repo_path": "/etc", "max_count": 10, "opts": {"mode": "a"}});
    let mut g = c.benchmark_group("mcp_check");
    for (name, tool, args) in [
        ("exact_hit", "tool_99", None),
        ("glob_hit", "ns49_fetch", None),
        ("denied", "tool_95", None),
        ("name_miss", "rm", None),
        ("args_hit", "git_49", Some(&ok_args)),
        ("args_miss", "git_49", Some(&bad_args)),
    ] {
        g.bench_function(name, |b| b.iter(|| r.tools.check(black_box(tool), black_box(args))));
    }
    g.finish();
}

criterion_group!(benches, checks);
criterion_main!(benches);
