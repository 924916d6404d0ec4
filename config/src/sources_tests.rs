use super::*;
use crate::Config;

fn parse(secret_line: &str) -> Result<Config, String> {
    let text = format!(
        "[tools.t]\negress = [\"api.example:443\"]\n[tools.t.credentials.c]\nhosts = [\"api.example:443\"]\n\
         value = \"Bearer ${{secret}}\"\nplaceholder_env = \"C\"\n{secret_line}\n"
    );
    Config::parse_relative_to(&text, "c.toml", std::path::Path::new("/etc/loom")).map_err(|e| e.to_string())
}

fn source(secret_line: &str) -> SecretSource {
    match parse(secret_line) {
        Ok(c) => c.policy.tool("t").unwrap().credentials[0].source.clone(),
        Err(e) => panic!("{secret_line}: {e}"),
    }
}

fn live(s: SecretSource) -> LiveSource {
    match s {
        SecretSource::Live(l) => (*l).clone(),
        other => panic!("not live: {other:?}"),
    }
}

#[test]
fn a_file_with_a_ttl_is_live_and_one_without_is_static() {
    assert_eq!(
        source("secret = { file = \"s/token\" }"),
        SecretSource::File("/etc/loom/s/token".into())
    );
    let l = live(source(
        "secret = { file = \"s/token\", ttl_ms = 5000, failure_ttl_ms = 700, stale_ms = 9000 }",
    ));
    assert_eq!(l.kind, LiveKind::File("/etc/loom/s/token".into()));
    assert_eq!(l.refresh.ttl, Duration::from_millis(5000));
    assert_eq!(l.refresh.failure_ttl, Duration::from_millis(700));
    assert_eq!(l.refresh.stale, Duration::from_millis(9000));
    let l = live(source("secret = { file = \"/t\", ttl_ms = 5000 }"));
    assert_eq!(l.refresh.failure_ttl, DEFAULT_FAILURE_TTL);
    assert_eq!(l.refresh.stale, DEFAULT_STALE);
    assert_eq!(l.kind.name(), "file");
}

#[test]
fn a_command_runs_without_a_shell_with_its_bounds() {
    let l = live(source(
        "secret = { command = [\"bin/token\", \"--field\", \"a b\"], timeout_ms = 2000, max_bytes = 100, env_pass = [\"HOME\"] }",
    ));
    let LiveKind::Command(c) = &l.kind else { panic!("{l:?}") };
    assert_eq!(
        c.argv,
        ["/etc/loom/bin/token", "--field", "a b"],
        "a relative program is the config's"
    );
    assert_eq!(c.timeout, Duration::from_millis(2000));
    assert_eq!(c.max_bytes, 100);
    assert_eq!(c.env_pass, ["HOME"]);
    assert_eq!(l.refresh.ttl, DEFAULT_TTL);
    let l = live(source("secret = { command = [\"op\", \"read\"] }"));
    let LiveKind::Command(c) = &l.kind else { panic!() };
    assert_eq!(c.argv[0], "op", "a bare name is looked up on PATH");
    assert_eq!((c.timeout, c.max_bytes), (DEFAULT_TIMEOUT, DEFAULT_MAX_BYTES));
}

#[test]
fn every_source_problem_is_reported() {
    for (line, want) in [
        ("secret = { command = [] }", "tools.t.credentials.c.secret.command: must name a program"),
        ("secret = { command = [\"x\"], env_pass = [\"A B\"] }", "secret.env_pass[0]: \"A B\" is not a variable name"),
        ("secret = { command = [\"x\"], timeout_ms = 0 }", "secret.timeout_ms: 0 is out of range"),
        ("secret = { env = \"X\", ttl_ms = 5 }", "are for a file or a command"),
        ("secret = { file = \"f\", stale_ms = 5 }", "secret.ttl_ms: is required"),
        ("secret = { file = \"f\", command = [\"x\"] }", "secret: must be exactly one of"),
        ("secret = { vault = \"x\" }", "secret: must be exactly one of"),
        (
            "secret = { env = \"X\" }\nmint = { oauth2_client_credentials = {} }",
            "has both secret and mint",
        ),
        ("mint = { }", "mint: must be exactly one of"),
        (
            "mint = { oauth2_client_credentials = { client_id = \"a\", client_secret = { env = \"S\" } } }",
            "oauth2_client_credentials.token_url: is required",
        ),
        (
            "mint = { oauth2_client_credentials = { token_url = \"https://a.example/t\", client_id = \"a\" } }",
            "oauth2_client_credentials.client_secret: is required",
        ),
        (
            "mint = { oauth2_client_credentials = { token_url = \"http://auth.example/t\", client_id = \"a\", client_secret = { env = \"S\" } } }",
            "token_url: http://auth.example/t is plain HTTP: a token endpoint must be https://",
        ),
        (
            "mint = { oauth2_client_credentials = { token_url = \"http://10.0.0.1/t\", client_id = \"a\", client_secret = { env = \"S\" }, allow_plaintext = true } }",
            "is not a loopback address",
        ),
        (
            "mint = { oauth2_client_credentials = { token_url = \"https://u:p@a.example/t\", client_id = \"a\", client_secret = { env = \"S\" } } }",
            "carries user information",
        ),
        (
            "mint = { oauth2_client_credentials = { token_url = \"ftp://a.example/t\", client_id = \"a\", client_secret = { env = \"S\" } } }",
            "is not an https:// URL",
        ),
        (
            "mint = { oauth2_refresh_token = { token_url = \"https://a.example/t\", client_id = \"a\" } }",
            "oauth2_refresh_token.refresh_token: is required",
        ),
        (
            "mint = { oauth2_refresh_token = { token_url = \"https://a.example/t\", client_id = \"a\", refresh_token = { file = \"r\" }, audience = \"x\" } }",
            "oauth2_refresh_token.audience: unknown key",
        ),
    ] {
        let e = parse(line).err().unwrap_or_else(|| panic!("{line} parsed"));
        assert!(e.contains(want), "{line}: missing {want:?} in\n{e}");
    }
}

#[test]
fn a_token_endpoint_is_fixed_by_the_operator() {
    let l = live(source(
        "mint = { oauth2_client_credentials = { token_url = \"https://auth.example:8443/oauth/token?x=1\", client_id = \"loom\", \
         client_secret = { file = \"cs\" }, scope = \"read write\", audience = \"api\", refresh_before_ms = 1000, failure_ttl_ms = 500 } }",
    ));
    let LiveKind::OAuth2(o) = &l.kind else { panic!() };
    assert_eq!(o.grant, Grant::ClientCredentials);
    assert!(o.token_url.https);
    assert_eq!(o.token_url.host, Host::Name("auth.example".into()));
    assert_eq!(o.token_url.port, 8443);
    assert_eq!(o.token_url.path, "/oauth/token?x=1");
    assert_eq!(o.client_id, "loom");
    assert_eq!(
        o.client_secret.as_deref(),
        Some(&SecretSource::File("/etc/loom/cs".into()))
    );
    assert_eq!(o.scope.as_deref(), Some("read write"));
    assert_eq!(o.audience.as_deref(), Some("api"));
    assert_eq!(l.refresh.refresh_before, Duration::from_millis(1000));
    assert_eq!(l.refresh.failure_ttl, Duration::from_millis(500));
    assert_eq!(l.kind.name(), "oauth2_client_credentials");

    let l = live(source(
        "mint = { oauth2_refresh_token = { token_url = \"http://127.0.0.2:9000/t\", client_id = \"loom\", refresh_token = { file = \"rt\" }, allow_plaintext = true } }",
    ));
    let LiveKind::OAuth2(o) = &l.kind else { panic!() };
    assert!(!o.token_url.https);
    assert_eq!(o.token_url.port, 9000);
    assert_eq!(o.client_secret, None, "a public client");
    assert_eq!(
        o.grant,
        Grant::RefreshToken {
            refresh_token: Box::new(SecretSource::File("/etc/loom/rt".into()))
        }
    );
    let u = token_url("https://[::1]/t").unwrap();
    assert_eq!((u.port, u.path.as_str()), (443, "/t"));
    assert_eq!(token_url("https://a.example").unwrap().path, "/");
}

#[test]
fn values_are_checked_for_what_a_header_cannot_carry() {
    assert!(check_value("tok-123").is_ok());
    for bad in ["", "a\nb", "a\rb", "a\0b", "a\x1bb"] {
        assert!(check_value(bad).is_err(), "{bad:?}");
    }
    assert!(check_value(&"x".repeat(MAX_VALUE_BYTES + 1)).is_err());
    assert_eq!(chomp("v\r\n".into()), "v");
    assert_eq!(chomp("v\n\n".into()), "v\n", "only one newline is dropped");
}

#[test]
fn a_live_source_is_not_loaded_with_the_static_ones() {
    let mut c = parse("mint = { oauth2_client_credentials = { token_url = \"https://a.example/t\", client_id = \"a\", client_secret = { env = \"LOOM_TEST_UNSET\" } } }").unwrap();
    c.load_secrets().unwrap();
    let cred = &c.policy.tool("t").unwrap().credentials[0];
    assert!(cred.secret.is_empty() && cred.usable_until.is_none());
}

#[test]
fn a_secret_from_aws_secrets_manager_is_live_with_its_endpoint() {
    let l = live(source(
        "secret = { aws_secrets_manager = { secret_id = \"prod/weather\", region = \"eu-west-1\", json_key = \"api_key\" }, ttl_ms = 60000 }",
    ));
    let LiveKind::AwsSecretsManager(a) = &l.kind else {
        panic!("{l:?}")
    };
    assert_eq!(a.secret_id, "prod/weather");
    assert_eq!(a.json_key.as_deref(), Some("api_key"));
    assert_eq!(a.endpoint.text, "https://secretsmanager.eu-west-1.amazonaws.com/");
    assert_eq!(
        a.endpoint.host,
        Host::Name("secretsmanager.eu-west-1.amazonaws.com".into())
    );
    assert_eq!(l.refresh.ttl, Duration::from_millis(60000));
    assert_eq!(l.kind.name(), "aws_secrets_manager");
    let l = live(source(
        "secret = { aws_secrets_manager = { secret_id = \"s\", region = \"us-east-1\", endpoint = \"http://127.0.0.2:5000\", allow_plaintext = true } }",
    ));
    let LiveKind::AwsSecretsManager(a) = &l.kind else {
        panic!()
    };
    assert!(!a.endpoint.https);
    for (line, want) in [
        ("secret = { aws_secrets_manager = { region = \"us-east-1\" } }", "aws_secrets_manager.secret_id: is required"),
        ("secret = { aws_secrets_manager = { secret_id = \"s\", region = \"US East\" } }", "is not a region name"),
        (
            "secret = { aws_secrets_manager = { secret_id = \"s\", region = \"us-east-1\", endpoint = \"http://sm.example\" } }",
            "is plain HTTP",
        ),
        (
            "secret = { aws_secrets_manager = { secret_id = \"s\", region = \"us-east-1\" }, env = \"X\" }",
            "secret: must be exactly one of",
        ),
    ] {
        let e = parse(line).err().unwrap_or_else(|| panic!("{line} parsed"));
        assert!(e.contains(want), "{line}: missing {want:?} in\n{e}");
    }
}
