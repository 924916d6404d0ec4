//! The secret scan on a response body, as the scrubber runs it on each
//! chunk: every secret found (`find_all`) and the end held back
//! (`pending`), over 1 MiB in 16 KiB chunks. Bodies: printable text in
//! which the secret's first bytes recur (as the `scrub` figure of
//! `bench/run.sh` serves), JSON full of escapes and URLs full of
//! percent-encoding (where a spelling may begin at every `\`, `%` or `&`),
//! for a Bearer token and for a Basic value (three values looked for).
#![allow(clippy::unwrap_used)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use egress_config::{Config, Secret, SecretScan};
use std::hint::black_box;
use std::sync::Arc;

const BEARER: &str = "sk-bench-3f9a7c21e6d4b058";
/// base64("bench-user:pa55/w0rd-3f9a7c21")
const BASIC: &str = "YmVuY2gtdXNlcjpwYTU1L3cwcmQtM2Y5YTdjMjE=";

fn scan(value: &str, secret: &str) -> SecretScan {
    let text = format!(
        "[tools.t]\negress = [\"api.example:443\"]\n[tools.t.credentials.c]\nhosts = [\"api.example:443\"]\nvalue = \"{value}\"\nsecret = {{ env = \"X\" }}\nplaceholder_env = \"C\"\n"
    );
    let mut c = Config::parse(&text, "bench")
        .unwrap()
        .policy
        .tool("t")
        .unwrap()
        .credentials[0]
        .clone();
    c.secret = Secret::new(secret);
    let tool: Arc<str> = Arc::from("t");
    SecretScan::build([(&tool, 0, &c)])
}

/// 1 MiB of printable text where `prefix` recurs about every 300 bytes.
fn text(prefix: &[u8]) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut body = Vec::with_capacity(1 << 20);
    while body.len() < 1 << 20 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if x.is_multiple_of(300) {
            body.extend_from_slice(prefix);
        } else {
            body.push(b' ' + (x % 95) as u8);
        }
    }
    body.truncate(1 << 20);
    body
}

/// 1 MiB of JSON records with escaped strings and percent-encoded URLs.
fn json() -> Vec<u8> {
    let mut body = Vec::with_capacity(1 << 20);
    let mut i = 0u32;
    while body.len() < 1 << 20 {
        body.extend_from_slice(
            format!(
                "{{\"id\":{i},\"name\":\"caf\\u00e9 \\\"{i}\\\"\",\"url\":\"https:\\/\\/api.example\\/v1\\/items?q=a%20{i}&sort=a%2Cb&amp;x\",\"tags\":[\"a\\\\b\",\"&#39;s\"]}}\n"
            )
            .as_bytes(),
        );
        i += 1;
    }
    body.truncate(1 << 20);
    body
}

/// What the scrubber does with each chunk: find every secret, then the end
/// it holds back.
fn scrub_chunks(s: &SecretScan, body: &[u8]) -> usize {
    let mut n = 0;
    for chunk in body.chunks(16 * 1024) {
        n += s.find_all(chunk).count();
        n += s.pending(chunk);
    }
    n
}

fn scans(c: &mut Criterion) {
    let bearer = scan("Bearer ${secret}", BEARER);
    let basic = scan("Basic ${secret}", BASIC);
    let mut g = c.benchmark_group("secret_scan_1mib");
    g.throughput(Throughput::Bytes(1 << 20));
    for (name, s, body) in [
        ("bearer_text", &bearer, text(&BEARER.as_bytes()[..3])),
        ("bearer_json", &bearer, json()),
        ("basic_text", &basic, text(b"pa5")),
        ("basic_json", &basic, json()),
    ] {
        g.bench_function(name, |b| b.iter(|| scrub_chunks(black_box(s), black_box(&body))));
    }
    g.finish();
}

criterion_group!(benches, scans);
criterion_main!(benches);
