//! Target canonicalization (`parse_host`, `parse_authority`): the first thing
//! every request pays for, on the usual spellings and the unusual ones.
#![allow(clippy::unwrap_used)]

use criterion::{criterion_group, criterion_main, Criterion};
use egress_config::{parse_authority, parse_host};
use std::hint::black_box;

fn hosts(c: &mut Criterion) {
    let mut g = c.benchmark_group("parse_host");
    for (name, raw) in [
        ("name", "api.example.com"),
        ("name_mixed_case_trailing_dot", "API.Example.COM."),
        (
            "long_name",
            "a-very-long-label-for-testing.sub.region.service.example.co.uk",
        ),
        ("ipv4", "93.184.216.34"),
        ("ipv4_hex_short", "0x7f.1"),
        ("ipv6", "[2001:db8::1]"),
        ("idna", "bücher.example"),
    ] {
        parse_host(raw).unwrap();
        g.bench_function(name, |b| b.iter(|| parse_host(black_box(raw))));
    }
    g.finish();
    c.bench_function("parse_authority/name_port", |b| {
        b.iter(|| parse_authority(black_box("api.example.com:443")))
    });
}

criterion_group!(benches, hosts);
criterion_main!(benches);
