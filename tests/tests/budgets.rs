//! Per-run budgets (`max_requests_per_run`, `max_request_rate`,
//! `max_bytes_per_run`): one count per run shared by every entrance and
//! every concurrent tunnel; exceeding one is a `429` with
//! `budget_exhausted` or `rate_limited`, a fact recorded before the answer,
//! and the run view says what is used of what limit. Bytes are counted as
//! they move: the fetch that crosses the byte budget is cut, with every
//! other open fetch of the run, and that is a fact. Report mode waives
//! none of them. Loopback origin on 127.0.0.2, fake DNS.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::harness::{TestProxy, TestRun};
use egress_e2e::origin::{echo_origin, http_origin};
use egress_e2e::raw::{connect, echo_through, wait_closed};
use egress_e2e::socks::{self, Dest};
use serde_json::Value;
use tokio::io::AsyncWriteExt;

async fn world(budget: &str) -> (TestProxy, TestRun, u16) {
    let origin = http_origin("127.0.0.2:0").await;
    let port = origin.addr.port();
    std::mem::forget(origin);
    let tools = format!("[tools.web]\negress = [\"allowed.test:{port}\"]\n{budget}\n");
    let p = TestProxy::start(&tools).await;
    p.dns.set("allowed.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    (p, run, port)
}

async fn view(p: &TestProxy, run: &TestRun) -> Value {
    let (status, v) = p.control("GET", &format!("/v1/runs/{}", run.id), None).await;
    assert_eq!(status, 200, "{v}");
    v
}

/// The run's facts with `reason`.
async fn facts_with(p: &TestProxy, run: &TestRun, reason: &str) -> usize {
    p.facts()
        .await
        .iter()
        .filter(|f| f.run_id.as_deref() == Some(&run.id) && f.reason == reason)
        .count()
}

#[tokio::test]
async fn the_request_budget_is_one_count_across_entrances() {
    let (p, run, port) = world("max_requests_per_run = 4").await;
    let url = format!("http://allowed.test:{port}/");
    // Two plain requests, a CONNECT tunnel kept open and a SOCKS5 one: four.
    for _ in 0..2 {
        assert_eq!(p.get(&run, &url, "").await.status, 200);
    }
    let (r, _tunnel) = connect(p.proxy, &format!("allowed.test:{port}"), Some(&run.auth())).await;
    assert_eq!(r.status, 200);
    let dest = Dest::Name("allowed.test".into(), port);
    let (code, _socks) = socks::connect(p.proxy, (&run.id, &run.secret), &dest).await;
    assert_eq!(code, 0);
    assert_eq!(
        view(&p, &run).await["budgets"]["requests"],
        serde_json::json!({"used": 4, "limit": 4})
    );
    // The fifth, by any entrance: 429 with a fact, nothing reaches the origin.
    let r = p.get(&run, &url, "").await;
    assert_eq!(
        (r.status, r.deny_reason()),
        (429, Some("budget_exhausted")),
        "{}",
        r.text()
    );
    let (r, _) = connect(p.proxy, &format!("allowed.test:{port}"), Some(&run.auth())).await;
    assert_eq!((r.status, r.deny_reason()), (429, Some("budget_exhausted")));
    let (code, _) = socks::connect(p.proxy, (&run.id, &run.secret), &dest).await;
    assert_eq!(code, 2, "SOCKS5: not allowed by ruleset");
    assert_eq!(facts_with(&p, &run, "budget_exhausted").await, 3);
    // Refusals are not spending.
    assert_eq!(view(&p, &run).await["budgets"]["requests"]["used"], 4);
    // Another run of the same tool has its own budget.
    let other = p.run("web").await;
    assert_eq!(p.get(&other, &url, "").await.status, 200);
}

#[tokio::test]
async fn the_rate_allows_its_burst_then_refuses_until_a_token_returns() {
    let (p, run, port) = world("max_request_rate = { per_second = 2, burst = 3 }").await;
    let url = format!("http://allowed.test:{port}/");
    for i in 0..3 {
        assert_eq!(p.get(&run, &url, "").await.status, 200, "request {i} of the burst");
    }
    let r = p.get(&run, &url, "Accept: application/json\r\n").await;
    assert_eq!((r.status, r.deny_reason()), (429, Some("rate_limited")), "{}", r.text());
    let body: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(body["rule"], "budgets");
    assert_eq!(facts_with(&p, &run, "rate_limited").await, 1);
    assert_eq!(
        view(&p, &run).await["budgets"]["rate"],
        serde_json::json!({"per_second": 2, "burst": 3})
    );
    // One token comes back every 500 ms.
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    assert_eq!(p.get(&run, &url, "").await.status, 200);
}

#[tokio::test]
async fn the_byte_budget_cuts_the_fetch_that_crosses_it() {
    let (p, run, port) = world("max_bytes_per_run = 10000").await;
    // 100,000 bytes asked for: the download is cut at the budget, not served whole.
    let r = p
        .get(&run, &format!("http://allowed.test:{port}/bytes?n=100000"), "")
        .await;
    assert!(r.body.len() < 100_000, "{} bytes arrived", r.body.len());
    let v = view(&p, &run).await;
    let used = v["budgets"]["bytes"]["used"].as_u64().unwrap();
    assert!(used >= 10_000, "{v}");
    assert_eq!(v["budgets"]["bytes"]["limit"], 10000);
    // The cut is a fact (recorded off the answer path: wait for it).
    let mut facts = 0;
    for _ in 0..100 {
        facts = facts_with(&p, &run, "budget_exhausted").await;
        if facts > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(facts, 1);
    // And the next fetch is refused.
    let r = p.get(&run, &format!("http://allowed.test:{port}/"), "").await;
    assert_eq!(
        (r.status, r.deny_reason()),
        (429, Some("budget_exhausted")),
        "{}",
        r.text()
    );
    assert_eq!(facts_with(&p, &run, "budget_exhausted").await, 2);
}

#[tokio::test]
async fn concurrent_tunnels_share_one_byte_budget_and_are_cut_together() {
    let (echo, _) = echo_origin("127.0.0.2:0").await;
    let p = TestProxy::start(&format!(
        "[tools.web]\negress = [\"echo.test:{}\"]\nmax_bytes_per_run = 10000\n",
        echo.port()
    ))
    .await;
    p.dns.set("echo.test", &["127.0.0.2"]);
    let run = p.run("web").await;
    let target = format!("echo.test:{}", echo.port());
    let (r, mut a) = p.connect(&run, &target).await;
    assert_eq!(r.status, 200);
    let (r, mut b) = p.connect(&run, &target).await;
    assert_eq!(r.status, 200);
    // 3,000 bytes each way through each: 6,000 per tunnel, under the budget alone.
    let chunk = vec![7u8; 3000];
    assert_eq!(echo_through(&mut a, &chunk).await, chunk);
    // The second tunnel's bytes cross the run's 10,000: both are cut.
    b.write_all(&chunk).await.unwrap();
    let cap = std::time::Duration::from_secs(5);
    assert!(wait_closed(&mut b, cap).await.is_some(), "the crossing tunnel is cut");
    assert!(
        wait_closed(&mut a, cap).await.is_some(),
        "the run's other tunnel is cut too"
    );
    let v = view(&p, &run).await;
    assert!(v["budgets"]["bytes"]["used"].as_u64().unwrap() >= 10_000, "{v}");
    for _ in 0..100 {
        if facts_with(&p, &run, "budget_exhausted").await == 1 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("no budget_exhausted fact for the cut");
}

#[tokio::test]
async fn report_mode_waives_no_budget_and_a_tool_without_one_shows_none() {
    let (p, run, port) = world("mode = \"report\"\nmax_requests_per_run = 1").await;
    let url = format!("http://allowed.test:{port}/");
    assert_eq!(p.get(&run, &url, "").await.status, 200);
    let r = p.get(&run, &url, "").await;
    assert_eq!((r.status, r.deny_reason()), (429, Some("budget_exhausted")));
    let (p, run, _) = world("").await;
    assert!(view(&p, &run).await.get("budgets").is_none());
}
