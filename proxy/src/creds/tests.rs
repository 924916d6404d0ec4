#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::ca::Authority;
use crate::dns::{Dial, Resolve};
use egress_config::sources::CommandSource;
use egress_config::RangeTable;
use std::time::Duration;

fn command(script: &str, timeout_ms: u64, max_bytes: usize) -> CommandSource {
    CommandSource {
        argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
        timeout: Duration::from_millis(timeout_ms),
        max_bytes,
        env_pass: vec![],
    }
}

#[test]
fn a_command_s_output_is_the_value() {
    let f = run_command(&command("printf 'tok-1\\n'", 5000, 1024)).unwrap();
    assert_eq!(f.value.expose(), "tok-1");
    assert!(f.expires_at.is_none());
    let f = run_command(&command(
        "echo '{\"value\": \"tok-2\", \"expires_at\": \"2030-01-02T03:04:05Z\"}'",
        5000,
        1024,
    ))
    .unwrap();
    assert_eq!(f.value.expose(), "tok-2");
    let at = f
        .expires_at
        .unwrap()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert_eq!(at, 1_893_553_445);
    let f = run_command(&command(
        "echo '{\"value\": \"t\", \"expires_at\": 1893553445}'",
        5000,
        1024,
    ))
    .unwrap();
    assert_eq!(
        f.expires_at
            .unwrap()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_secs(),
        1_893_553_445
    );
}

#[test]
fn a_command_that_hangs_is_killed_at_its_timeout_with_its_children() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("alive");
    let started = std::time::Instant::now();
    // A child in the background that would write later: killed with the group.
    let script = format!("(sleep 2; touch {}) & sleep 30", marker.display());
    let e = run_command(&command(&script, 300, 1024)).unwrap_err();
    assert_eq!(e.outcome, Outcome::Timeout, "{}", e.message);
    assert!(e.message.contains("did not finish within 300 ms"), "{}", e.message);
    assert!(started.elapsed() < Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(2500));
    assert!(!marker.exists(), "the command's background child was killed with it");
}

#[test]
fn a_command_that_prints_too_much_is_cut_with_a_clear_error() {
    let e = run_command(&command("head -c 10000000 /dev/zero | tr '\\0' a", 10_000, 65_536)).unwrap_err();
    assert_eq!(e.outcome, Outcome::Error);
    assert!(
        e.message.contains("printed more than 65536 bytes (max_bytes)"),
        "{}",
        e.message
    );
}

#[test]
fn a_value_with_a_newline_inside_or_a_failing_command_is_refused() {
    for (script, want) in [
        ("printf 'a\\nb\\n'", "control characters"),
        ("printf 'a\\rb'", "control characters"),
        ("printf 'a\\000b'", "control characters"),
        ("printf ''", "is empty"),
        ("echo tok; exit 1", "failed (exit status: 1)"),
        (
            "echo '{\"value\": \"a\", \"other\": 1}'",
            "is not {\"value\", \"expires_at\"}",
        ),
        (
            "echo '{\"value\": \"a\", \"expires_at\": \"soon\"}'",
            "neither Unix seconds nor RFC 3339",
        ),
    ] {
        let e = run_command(&command(script, 5000, 1024)).unwrap_err();
        assert!(e.message.contains(want), "{script}: {}", e.message);
        assert!(!e.message.contains("tok"), "no value in the message: {}", e.message);
    }
}

#[test]
fn a_command_sees_only_the_variables_it_is_given() {
    // SAFETY of the test: the variable is unique to it.
    let mut c = command("printf '%s' \"${HOME:-none}-${LOOM_CREDS_TEST:-unset}\"", 5000, 1024);
    let f = run_command(&c).unwrap();
    assert_eq!(f.value.expose(), "none-unset");
    c.env_pass = vec!["HOME".into()];
    let home = std::env::var("HOME").unwrap_or_else(|_| "none".into());
    assert_eq!(run_command(&c).unwrap().value.expose(), format!("{home}-unset"));
}

fn refresh() -> Refresh {
    Refresh {
        ttl: Duration::from_secs(300),
        failure_ttl: Duration::from_secs(60),
        stale: Duration::ZERO,
        refresh_before: Duration::from_secs(60),
    }
}

use egress_config::sources::Refresh;

#[test]
fn a_token_answer_must_be_a_bearer_token() {
    let f = oauth2::token(
        br#"{"access_token":"at-1","token_type":"bearer","expires_in":2}"#,
        &refresh(),
        false,
    )
    .unwrap();
    assert_eq!(f.value.expose(), "at-1");
    let left = f.expires_at.unwrap().duration_since(SystemTime::now()).unwrap();
    assert!(left <= Duration::from_secs(2) && left > Duration::from_secs(1));
    let f = oauth2::token(
        br#"{"access_token":"at-1","token_type":"Bearer","expires_in":"60","refresh_token":"rt-2"}"#,
        &refresh(),
        true,
    )
    .unwrap();
    assert_eq!(f.refresh_token.unwrap().expose(), "rt-2");
    let f = oauth2::token(br#"{"access_token":"at-1","token_type":"Bearer"}"#, &refresh(), false).unwrap();
    let left = f.expires_at.unwrap().duration_since(SystemTime::now()).unwrap();
    assert!(left > Duration::from_secs(290), "without expires_in: ttl_ms");
    for (answer, want) in [
        (
            &br#"{"access_token":"at","token_type":"mac","expires_in":60}"#[..],
            "not Bearer",
        ),
        (
            br#"{"access_token":"at","token_type":"N_A","expires_in":60}"#,
            "not Bearer",
        ),
        (br#"{"access_token":"at","expires_in":60}"#, "no token_type"),
        (br#"{"token_type":"Bearer"}"#, "no access_token"),
        (
            br#"{"access_token":"a\nb","token_type":"Bearer"}"#,
            "control characters",
        ),
        (
            br#"{"access_token":"a","token_type":"Bearer","expires_in":0}"#,
            "expires_in",
        ),
        (
            br#"{"access_token":"a","token_type":"Bearer","expires_in":-5}"#,
            "expires_in",
        ),
        (b"<html>", "not a JSON token answer"),
    ] {
        let e = oauth2::token(answer, &refresh(), false).unwrap_err();
        assert!(e.contains(want), "{}: {e}", String::from_utf8_lossy(answer));
    }
}

#[test]
fn the_proxy_s_aws_keys_come_from_a_profile_of_the_shared_file() {
    let text = "# comment\n[default]\naws_access_key_id = AKIDDEFAULT\naws_secret_access_key = s1\n\n[ci]\naws_access_key_id=AKIDCI\naws_secret_access_key=s2\naws_session_token = t2\n";
    let k = aws::profile_keys(text, "default").unwrap();
    assert_eq!(
        (k.access_key_id.as_str(), k.secret_access_key.as_str()),
        ("AKIDDEFAULT", "s1")
    );
    assert!(k.session_token.is_none());
    let k = aws::profile_keys(text, "ci").unwrap();
    assert_eq!(k.session_token.as_deref(), Some("t2"));
    assert!(aws::profile_keys(text, "other").is_none());
    assert!(
        aws::profile_keys("[x]\naws_access_key_id = A\n", "x").is_none(),
        "no secret key"
    );
}

#[test]
fn a_secrets_manager_answer_gives_its_string_or_one_member() {
    let v = |s: &str| serde_json::from_str::<serde_json::Value>(s).ok();
    let a = v(r#"{"Name":"n","SecretString":"{\"api_key\":\"k-1\",\"n\":3}"}"#);
    assert_eq!(
        aws::secret_value(a.as_ref(), None).unwrap().expose(),
        "{\"api_key\":\"k-1\",\"n\":3}"
    );
    assert_eq!(aws::secret_value(a.as_ref(), Some("api_key")).unwrap().expose(), "k-1");
    for (answer, key, want) in [
        (a.clone(), Some("n"), "not a string"),
        (a.clone(), Some("missing"), "no such member"),
        (v(r#"{"SecretString":"plain"}"#), Some("k"), "is not JSON"),
        (v(r#"{"SecretBinary":"AAEC"}"#), None, "binary"),
        (v(r#"{"SecretString":"a\nb"}"#), None, "control characters"),
        (None, None, "not JSON"),
    ] {
        let e = aws::secret_value(answer.as_ref(), key).unwrap_err();
        assert!(e.contains(want), "{e}");
    }
}

/// An [`Env`] whose resolver answers `addrs` for every name and whose
/// dialer only counts its calls (it never connects).
struct FakeEnv {
    addrs: Vec<std::net::IpAddr>,
    ranges: egress_config::RangeTable,
    dials: std::sync::atomic::AtomicUsize,
    metrics: Metrics,
    ca: Arc<crate::ca::Authority>,
}

impl crate::dns::Resolve for FakeEnv {
    fn resolve<'a>(
        &'a self,
        _name: &'a str,
    ) -> futures_util::future::BoxFuture<'a, Result<Vec<std::net::IpAddr>, crate::dns::DnsError>> {
        Box::pin(async move { Ok(self.addrs.clone()) })
    }
}

impl crate::dns::Dial for FakeEnv {
    fn dial(
        &self,
        _addr: std::net::SocketAddr,
    ) -> futures_util::future::BoxFuture<'static, std::io::Result<tokio::net::TcpStream>> {
        self.dials.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async { Err(std::io::Error::other("the fake dialer connects nowhere")) })
    }
}

impl Env for FakeEnv {
    fn resolver(&self) -> &dyn Resolve {
        self
    }
    fn dialer(&self) -> &dyn Dial {
        self
    }
    fn ranges(&self) -> RangeTable {
        self.ranges.clone()
    }
    fn authority(&self) -> Arc<Authority> {
        self.ca.clone()
    }
    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
    fn apply(&self) {}
}

fn fake_env(addrs: &[&str], allow: &[&str]) -> FakeEnv {
    FakeEnv {
        addrs: addrs.iter().map(|a| a.parse().unwrap()).collect(),
        ranges: RangeTable::new(allow.iter().map(|n| n.parse().unwrap()).collect(), vec![]),
        dials: Default::default(),
        metrics: Metrics::new(),
        ca: Arc::new(Authority::open_in(None, &egress_config::ProxyConfig::default()).unwrap()),
    }
}

#[tokio::test]
async fn a_source_endpoint_is_dialled_only_at_addresses_its_scheme_and_the_ranges_allow() {
    let post = |env: FakeEnv, url: &'static str| async move {
        let u = egress_config::sources::token_url(url).unwrap();
        let r = http::post(&env, &u, vec![], vec![]).await;
        (
            r.err().map(|f| f.message).unwrap_or_default(),
            env.dials.load(std::sync::atomic::Ordering::SeqCst),
        )
    };
    // Plain HTTP to a name that resolves off loopback (allowed by the
    // ranges): never dialled, the cleartext would leave the host.
    let (e, dials) = post(fake_env(&["10.1.2.3"], &["10.0.0.0/8"]), "http://sm.example/").await;
    assert_eq!(dials, 0, "{e}");
    assert!(e.contains("10.1.2.3 (plain HTTP goes only to loopback)"), "{e}");
    // Any scheme to a denied range: never dialled.
    let (e, dials) = post(fake_env(&["169.254.169.254"], &[]), "https://auth.example/token").await;
    assert_eq!(dials, 0, "{e}");
    assert!(e.contains("169.254.169.254 (in 169.254.0.0/16)"), "{e}");
    // Loopback in plain HTTP, and an allowed address over TLS, are dialled.
    let (_, dials) = post(fake_env(&["127.0.0.2"], &["127.0.0.2/32"]), "http://sm.example/").await;
    assert_eq!(dials, 1);
    let (_, dials) = post(fake_env(&["10.1.2.3"], &["10.0.0.0/8"]), "https://sm.example/").await;
    assert_eq!(dials, 1);
}

#[test]
fn an_assume_role_answer_gives_three_values_and_its_expiry() {
    // The shape STS answers (AWS's documentation of AssumeRole).
    let xml = r#"<AssumeRoleResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">
  <AssumeRoleResult>
  <SourceIdentity>DevUser123</SourceIdentity>
    <AssumedRoleUser>
      <Arn>arn:aws:sts::123456789012:assumed-role/demo/John</Arn>
      <AssumedRoleId>ARO123EXAMPLE123:John</AssumedRoleId>
    </AssumedRoleUser>
    <Credentials>
      <SessionToken>
       AQoDYXdzEPT//////////wEXAMPLEtc764bNrC9SAPBSM22wDOk4x4HIZ8j4FZTwdQW
      </SessionToken>
      <SecretAccessKey>
       wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKEY
      </SecretAccessKey>
      <Expiration>2019-11-09T13:34:41Z</Expiration>
      <AccessKeyId>ASIAIOSFODNN7EXAMPLE</AccessKeyId>
    </Credentials>
    <PackedPolicySize>8</PackedPolicySize>
  </AssumeRoleResult>
  <ResponseMetadata><RequestId>c6104cbe-af31-11e0-8154-cbc7ccf896c7</RequestId></ResponseMetadata>
</AssumeRoleResponse>"#;
    let f = aws::assumed_keys(xml).unwrap();
    assert_eq!(f.value.expose(), "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKEY");
    let ids = f.aws.unwrap();
    assert_eq!(ids.key_id.expose(), "ASIAIOSFODNN7EXAMPLE");
    assert!(ids.session_token.expose().starts_with("AQoDYXdzEPT//"));
    let at = f.expires_at.unwrap().duration_since(SystemTime::UNIX_EPOCH).unwrap();
    assert_eq!(at.as_secs(), 1_573_306_481);
    for (bad, want) in [
        ("<x/>", "no Credentials"),
        ("<Credentials><AccessKeyId>A</AccessKeyId></Credentials>", "no Expiration"),
        (
            "<Credentials><Expiration>soon</Expiration><AccessKeyId>A</AccessKeyId></Credentials>",
            "not an RFC 3339 time",
        ),
        (
            "<Credentials><Expiration>2019-11-09T13:34:41Z</Expiration><SecretAccessKey>a\u{7}b</SecretAccessKey></Credentials>",
            "SecretAccessKey",
        ),
    ] {
        let e = aws::assumed_keys(bad).unwrap_err();
        assert!(e.contains(want), "{bad}: {e}");
    }
}
