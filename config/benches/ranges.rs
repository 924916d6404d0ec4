//! Range classification of resolved addresses (`RangeTable::classify`):
//! every address a fetch may dial passes through it.
#![allow(clippy::unwrap_used)]

use criterion::{criterion_group, criterion_main, Criterion};
use egress_config::{IpNet, RangeTable, RangeVerdict};
use std::hint::black_box;
use std::net::IpAddr;

fn classify(c: &mut Criterion) {
    let nets = |v: &[&str]| v.iter().map(|n| n.parse::<IpNet>().unwrap()).collect::<Vec<_>>();
    let table = RangeTable::new(
        nets(&["127.0.0.2/32", "10.20.0.0/16"]),
        nets(&["203.0.113.0/24", "198.51.100.0/24", "2001:db8:1::/48"]),
    );
    let mut g = c.benchmark_group("classify");
    for (name, ip, allowed) in [
        ("public_v4", "93.184.216.34", true),
        ("private_v4", "192.168.1.1", false),
        ("operator_denied_v4", "203.0.113.9", false),
        ("allow_ranges_v4", "10.20.1.2", true),
        ("public_v6", "2606:2800:220:1:248:1893:25c8:1946", true),
        ("v4_mapped_v6_loopback", "::ffff:127.0.0.1", false),
    ] {
        let ip: IpAddr = ip.parse().unwrap();
        assert_eq!(table.classify(ip, false) == RangeVerdict::Allowed, allowed, "{name}");
        g.bench_function(name, |b| b.iter(|| table.classify(black_box(ip), false)));
    }
    g.finish();
}

criterion_group!(benches, classify);
criterion_main!(benches);
