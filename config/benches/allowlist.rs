//! Allowlist decisions with 10,000 rules (goal: ≤ 1 µs each): exact names,
//! `*.suffix` wildcards and IP literals, hits and misses. The host is already
//! canonical, as the proxy hands it over.
#![allow(clippy::unwrap_used)]

use criterion::{criterion_group, criterion_main, Criterion};
use egress_config::{parse_host, Allowlist, Match, Rule};
use std::hint::black_box;

/// 10,000 rules: 5,000 exact names, 4,000 wildcards, 1,000 IP literals.
fn mixed() -> Allowlist {
    let mut rules = vec![];
    for i in 0..5000 {
        rules.push(Rule::parse_str(&format!("api{i}.tenant{}.example.com:443", i % 97)).unwrap());
    }
    for i in 0..4000 {
        rules.push(Rule::parse_str(&format!("*.svc{i}.example.net:443")).unwrap());
    }
    for i in 0..1000u32 {
        rules.push(Rule::parse_str(&format!("10.{}.{}.{}:8443", i >> 16, (i >> 8) & 255, i & 255)).unwrap());
    }
    Allowlist::new(rules)
}

fn decisions(c: &mut Criterion) {
    let list = mixed();
    assert_eq!(list.rules().len(), 10_000);
    let mut g = c.benchmark_group("allowlist_10k");
    for (name, host, port, allowed) in [
        ("exact_hit", "api4999.tenant52.example.com", 443, true),
        ("exact_wrong_port", "api4999.tenant52.example.com", 80, false),
        ("wildcard_hit", "a.b.svc3999.example.net", 443, true),
        ("name_miss", "cdn.images.unlisted.example.org", 443, false),
        ("deep_name_miss", "a.b.c.d.e.f.g.h.i.j.example.org", 443, false),
        ("ip_hit", "10.0.3.231", 8443, true),
        ("ip_miss", "192.0.2.7", 8443, false),
    ] {
        let h = parse_host(host).unwrap();
        assert_eq!(matches!(list.check(&h, port), Match::Allowed { .. }), allowed, "{name}");
        g.bench_function(name, |b| b.iter(|| list.check(black_box(&h), black_box(port))));
    }
    g.finish();
}

criterion_group!(benches, decisions);
criterion_main!(benches);
