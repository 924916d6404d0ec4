//! A credential from AWS Secrets Manager through the real proxy: moto in
//! server mode on 127.0.0.2 plays Secrets Manager (`endpoint`, plain HTTP
//! to loopback with `allow_plaintext`), boto3 sets secrets up as an
//! operator would. The real `egress-proxy` binary asks with its own AWS
//! keys, given in its environment as the standard variables, signed with
//! SigV4; its log never shows a value.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::aws::{available, Moto};
use egress_e2e::credentials::{api_credential, world};
use egress_e2e::harness::{all_facts_at, basic, control_call, create_run_at, TOKEN};
use egress_e2e::process::{bin, free_addr, write_config, ProxyProcess};
use egress_e2e::raw::{send, RawResponse};
use serde_json::Value;
use std::time::{Duration, Instant};

#[tokio::test]
async fn a_secret_from_secrets_manager_arrives_follows_rotation_and_fails_closed_after_deletion() {
    if !available() {
        return;
    }
    let moto = Moto::start();
    moto.boto("sm.create_secret(Name='prod/weather', SecretString='{\"api_key\": \"sm-value-1\", \"other\": \"x\"}')");
    let w = world("unused-static").await;
    let api = format!("api.example:{}", w.origin.addr.port());
    let source = format!(
        "{{ aws_secrets_manager = {{ secret_id = \"prod/weather\", region = \"us-east-1\", json_key = \"api_key\", \
         endpoint = \"http://{}/\", allow_plaintext = true }}, ttl_ms = 300, failure_ttl_ms = 100, stale_ms = 1500 }}",
        moto.addr
    );
    let (proxy, control) = (free_addr(), free_addr());
    let rest = format!(
        "allow_ranges = [\"127.0.0.2/32\"]\n[proxy.dns]\nservers = [\"{}\"]\n\n[tools.w]\negress = [\"{api}\"]\n{}allow_plaintext = true\n",
        w.dns.addr,
        api_credential("w", &api, &source)
    );
    let cfg = write_config(w.dir.path(), proxy, control, &rest);
    // The proxy's own AWS keys (moto accepts any), in its environment only.
    let p = ProxyProcess::start_with_env(
        &bin("egress-proxy"),
        &cfg,
        (proxy, control),
        TOKEN,
        &[],
        &[
            ("AWS_ACCESS_KEY_ID", "AKIDPROXYOWNKEY00001"),
            ("AWS_SECRET_ACCESS_KEY", "proxy-own-secret-access-key"),
        ],
    );
    let (run_id, secret) = create_run_at(p.control, "w").await;
    let auth = basic(&run_id, &secret);
    let url = format!("http://{api}/headers");
    let get = || async {
        let req =
            format!("GET {url} HTTP/1.1\r\nHost: {api}\r\nProxy-Authorization: {auth}\r\nConnection: close\r\n\r\n");
        send(p.proxy, req.as_bytes()).await
    };
    let run_view = || async {
        let r: RawResponse = control_call(p.control, "GET", &format!("/v1/runs/{run_id}"), None, Some(TOKEN)).await;
        serde_json::from_slice::<Value>(&r.body).unwrap()
    };
    let token = || {
        let head = w.origin.heads().pop().unwrap_or_default();
        head.lines()
            .find_map(|l| l.strip_prefix("authorization: Bearer "))
            .unwrap_or_default()
            .to_owned()
    };
    // The value arrives (the member json_key names).
    let r = get().await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(token(), "sm-value-1");
    assert!(!r.text().contains("sm-value-1"), "scrubbed from the echo: {}", r.text());
    let view = run_view().await;
    assert_eq!(view["credentials"][0]["source"], "aws_secrets_manager", "{view}");
    assert_eq!(view["credentials"][0]["last_refresh"]["outcome"], "ok", "{view}");

    // Rotated in Secrets Manager: in force within ttl_ms, no reload.
    moto.boto("sm.put_secret_value(SecretId='prod/weather', SecretString='{\"api_key\": \"sm-value-2\"}')");
    let start = Instant::now();
    loop {
        let r = get().await;
        assert_eq!(r.status, 200, "{}", r.text());
        if token() == "sm-value-2" {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "rotation not picked up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Deleted: served stale within ttl + stale, then closed.
    moto.boto("sm.delete_secret(SecretId='prod/weather', ForceDeleteWithoutRecovery=True)");
    let gone = Instant::now();
    let r = get().await;
    assert_eq!(r.status, 200, "served stale: {}", r.text());
    assert_eq!(token(), "sm-value-2");
    loop {
        let r = get().await;
        if r.status == 503 {
            assert_eq!(r.deny_reason(), Some("credential_unavailable"));
            break;
        }
        assert!(gone.elapsed() < Duration::from_secs(6), "still served: {}", r.text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let view = run_view().await;
    let e = view["credentials"][0]["last_refresh"]["error"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        e.contains("(ResourceNotFoundException) for prod/weather"),
        "the error type, never the body: {e}"
    );
    let facts = all_facts_at(p.control).await;
    assert_eq!(
        facts.iter().filter(|f| f["reason"] == "credential_unavailable").count(),
        1
    );
    let log = p.logs();
    assert!(log.contains("credential refresh failed"), "{log}");
    for value in ["sm-value-1", "sm-value-2", "proxy-own-secret-access-key"] {
        assert!(!log.contains(value), "the log shows {value}");
    }
}
