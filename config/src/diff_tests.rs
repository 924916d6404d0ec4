//! The `policy diff` table: policy pairs with their exact diffs, the cases
//! that look wider and are not among them, and the coverage rule checked
//! against the allowlists' own matching.

use super::*;
use crate::Config;

fn policy(text: &str) -> Policy {
    match Config::parse(text, "p.toml") {
        Ok(c) => c.policy.as_ref().clone(),
        Err(e) => panic!("{e}\n{text}"),
    }
}

/// The diff's lines for two `[tools.t]` bodies (`""`: no tool t).
fn tool_lines(old: &str, new: &str) -> Vec<String> {
    let t = |body: &str| {
        if body.is_empty() {
            String::new()
        } else {
            format!("[tools.t]\n{body}\n")
        }
    };
    diff(&policy(&t(old)), &policy(&t(new))).iter().map(line).collect()
}

const GH: &str =
    "[tools.t.credentials.gh]\nhosts = [\"api.gh.test:443\"]\nvalue = \"Bearer ${secret}\"\nsecret = { env = \"HOME\" }\nplaceholder_env = \"GH\"\n";

#[test]
fn the_diff_table() {
    let cred = |paths: &str| {
        format!("egress = [{{ host = \"api.gh.test\", port = 443, methods = [\"GET\"], paths = [{paths}] }}]\n{GH}")
    };
    let proc = "[tools.t.process]\ncommand = [\"x\"]\n";
    let cases: Vec<(&str, String, String, Vec<&str>)> = vec![
        ("identical", r#"egress = ["a.test:443"]"#.into(), r#"egress = ["a.test:443"]"#.into(), vec![]),
        ("reordered", r#"egress = ["a.test:443", "*.b.test:80", "192.0.2.1:22"]"#.into(), r#"egress = ["192.0.2.1:22", "*.b.test:80", "a.test:443"]"#.into(), vec![]),
        ("a duplicate entry", r#"egress = ["a.test:443"]"#.into(), r#"egress = ["a.test:443", "a.test:443"]"#.into(), vec![]),
        (
            "an entry split in two",
            r#"egress = [{ host = "a.test", port = 443, methods = ["GET", "POST"], paths = ["/v1/**", "/v2/x"] }]"#.into(),
            r#"egress = [{ host = "a.test", port = 443, methods = ["POST"], paths = ["/v2/x", "/v1/**"] }, { host = "a.test", port = 443, methods = ["GET"], paths = ["/v1/**", "/v2/x"] }]"#.into(),
            vec![],
        ),
        ("a name the wildcard covered", r#"egress = ["*.ex.test:443"]"#.into(), r#"egress = ["*.ex.test:443", "api.ex.test:443"]"#.into(), vec![]),
        ("a narrower wildcard", r#"egress = ["*.ex.test:443"]"#.into(), r#"egress = ["*.a.ex.test:443", "*.ex.test:443"]"#.into(), vec![]),
        ("a host added", r#"egress = ["a.test:443"]"#.into(), r#"egress = ["a.test:443", "b.test:443"]"#.into(), vec!["WIDENS  tool t: host_added b.test:443"]),
        ("a host removed", r#"egress = ["a.test:443", "b.test:443"]"#.into(), r#"egress = ["a.test:443"]"#.into(), vec!["narrows tool t: host_removed b.test:443"]),
        ("a new wildcard", r#"egress = ["a.test:443"]"#.into(), r#"egress = ["a.test:443", "*.b.test:443"]"#.into(), vec!["WIDENS  tool t: wildcard_added *.b.test:443"]),
        ("a wildcard over a listed name", r#"egress = ["api.ex.test:443"]"#.into(), r#"egress = ["*.ex.test:443"]"#.into(), vec!["WIDENS  tool t: wildcard_added *.ex.test:443"]),
        ("a wildcard at a lower label", r#"egress = ["*.api.ex.test:443"]"#.into(), r#"egress = ["*.ex.test:443"]"#.into(), vec!["WIDENS  tool t: wildcard_widened *.ex.test:443 (was *.api.ex.test)"]),
        ("a wildcard at a higher label", r#"egress = ["*.ex.test:443"]"#.into(), r#"egress = ["*.api.ex.test:443"]"#.into(), vec!["narrows tool t: wildcard_narrowed *.ex.test:443 (now *.api.ex.test)"]),
        ("a wildcard replaced by a name", r#"egress = ["*.ex.test:443"]"#.into(), r#"egress = ["a.ex.test:443"]"#.into(), vec!["narrows tool t: wildcard_removed *.ex.test:443"]),
        (
            "names under a new wildcard say nothing more",
            r#"egress = ["z.test:443"]"#.into(),
            r#"egress = ["z.test:443", "*.ex.test:443", "a.ex.test:443", "*.b.ex.test:443"]"#.into(),
            vec!["WIDENS  tool t: wildcard_added *.ex.test:443"],
        ),
        ("a port added", r#"egress = ["a.test:443"]"#.into(), r#"egress = ["a.test:443", "a.test:8443"]"#.into(), vec!["WIDENS  tool t: port_added a.test:8443 (was on 443)"]),
        ("a port removed", r#"egress = ["*.a.test:443", "*.a.test:80"]"#.into(), r#"egress = ["*.a.test:443"]"#.into(), vec!["narrows tool t: port_removed *.a.test:80 (still on 443)"]),
        ("private opened", r#"egress = ["db.test:5432"]"#.into(), r#"egress = [{ host = "db.test", port = 5432, private = true }]"#.into(), vec!["WIDENS  tool t: private_opened db.test:5432"]),
        (
            "a listed name under a private wildcard is no longer private",
            r#"egress = [{ host = "*.ex.test", port = 443, private = true }]"#.into(),
            r#"egress = [{ host = "*.ex.test", port = 443, private = true }, "a.ex.test:443"]"#.into(),
            vec!["narrows tool t: private_closed a.ex.test:443"],
        ),
        ("an address added", r#"egress = []"#.into(), r#"egress = ["192.0.2.7:443"]"#.into(), vec!["WIDENS  tool t: ip_added 192.0.2.7:443"]),
        ("a tool added", String::new(), r#"egress = ["x.test:443"]"#.into(), vec!["WIDENS  tool t: host_added x.test:443", "WIDENS  tool t: tool_added t"]),
        ("a tool removed", r#"egress = ["x.test:443"]"#.into(), String::new(), vec!["narrows tool t: tool_removed t"]),
        ("report mode", "egress = []".into(), "egress = []\nmode = \"report\"".into(), vec!["WIDENS  tool t: mode_report mode"]),
        ("enforce mode", "egress = []\nmode = \"report\"".into(), "egress = []".into(), vec!["narrows tool t: mode_enforce mode"]),
        ("inspect off", "egress = []\ninspect = true".into(), "egress = []".into(), vec!["WIDENS  tool t: inspect_off inspect"]),
        ("ask for unlisted names", "egress = []".into(), "egress = []\non_unlisted = \"ask\"".into(), vec!["WIDENS  tool t: on_unlisted_ask on_unlisted"]),
        (
            "a transparent network",
            format!("egress = []\n{proc}"),
            format!("egress = []\nnetwork = \"transparent\"\n{proc}"),
            vec!["WIDENS  tool t: network_transparent network"],
        ),
        (
            "budgets loosened and lifted",
            "egress = []\nmax_requests_per_run = 100\nmax_bytes_per_run = 1000".into(),
            "egress = []\nmax_requests_per_run = 1000".into(),
            vec![
                "WIDENS  tool t: budget_loosened max_bytes_per_run (1000 -> unlimited)",
                "WIDENS  tool t: budget_loosened max_requests_per_run (100 -> 1000)",
            ],
        ),
        (
            "a rate and slots tightened, a deadline loosened",
            "egress = []\nmax_request_rate = { per_second = 10 }\nfetch_timeout_ms = 10000".into(),
            "egress = []\nmax_request_rate = { per_second = 5, burst = 10 }\nfetch_timeout_ms = 60000\nmax_concurrent_fetches = 2".into(),
            vec![
                "WIDENS  tool t: deadline_loosened fetch_timeout_ms (10000 -> 60000)",
                "narrows tool t: budget_tightened max_request_rate.per_second (10 -> 5)",
                "narrows tool t: slots_tightened max_concurrent_fetches (8 -> 2)",
            ],
        ),
        (
            "the tool's methods",
            "egress = []\nmethods = [\"GET\", \"CONNECT\"]".into(),
            "egress = []\nmethods = [\"CONNECT\", \"POST\", \"GET\"]".into(),
            vec!["WIDENS  tool t: methods_added methods (POST)"],
        ),
        ("methods lifted", "egress = []\nmethods = [\"GET\"]".into(), "egress = []".into(), vec!["WIDENS  tool t: methods_unrestricted methods (was GET)"]),
        (
            "a path on a credentialed host",
            cred("\"/repos/acme/**\""),
            cred("\"/repos/acme/**\", \"/admin\""),
            vec!["WIDENS  tool t: credential_requests_widened api.gh.test:443 (GET /admin)"],
        ),
        ("a path the old pattern covered", cred("\"/repos/**\""), cred("\"/repos/**\", \"/repos/acme/*\""), vec![]),
        (
            "a path narrowed",
            r#"egress = [{ host = "a.test", port = 443, paths = ["/repos/**"] }]"#.into(),
            r#"egress = [{ host = "a.test", port = 443, paths = ["/repos/acme/*"] }]"#.into(),
            vec!["narrows tool t: requests_narrowed a.test:443 (* /repos/**)"],
        ),
        (
            "method and path rules lifted",
            r#"egress = [{ host = "a.test", port = 443, methods = ["GET"] }]"#.into(),
            r#"egress = ["a.test:443"]"#.into(),
            vec!["WIDENS  tool t: requests_unrestricted a.test:443 (any method and path; was GET /**)"],
        ),
        (
            "a credential's hosts widened",
            format!("egress = [\"api.gh.test:443\", \"up.gh.test:443\"]\n{GH}"),
            format!("egress = [\"api.gh.test:443\", \"up.gh.test:443\"]\n{}", GH.replace("hosts = [\"api.gh.test:443\"]", "hosts = [\"api.gh.test:443\", \"up.gh.test:443\"]")),
            vec!["WIDENS  tool t: credential_hosts_widened gh (up.gh.test:443)"],
        ),
        (
            "an MCP deny entry removed",
            "egress = []\n[tools.t.mcp]\ndeny_tools = [\"rm_*\"]".into(),
            "egress = []\n[tools.t.mcp]\ndeny_tools = []".into(),
            vec!["WIDENS  tool t: mcp_deny_removed tools (rm_*)"],
        ),
    ];
    assert!(cases.len() >= 30, "{}", cases.len());
    let mut wrong = vec![];
    for (name, old, new, want) in cases {
        let got = tool_lines(&old, &new);
        if got != want {
            wrong.push(format!("{name}:\n  got  {got:?}\n  want {want:?}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn ranges_opened_and_closed() {
    let p = |proxy: &str| policy(&format!("[proxy]\n{proxy}\n"));
    let lines = |a: &str, b: &str| diff(&p(a), &p(b)).iter().map(line).collect::<Vec<_>>();
    assert_eq!(
        lines("", "allow_ranges = [\"10.0.0.0/8\"]"),
        ["WIDENS  [proxy]: allow_range_added 10.0.0.0/8 (10.0.0.0/8 private-use)"]
    );
    // A range split in two is the same range; a public one opens nothing.
    assert!(lines(
        "allow_ranges = [\"10.0.0.0/8\"]",
        "allow_ranges = [\"10.128.0.0/9\", \"10.0.0.0/9\"]"
    )
    .is_empty());
    assert!(lines("", "allow_ranges = [\"8.8.8.0/24\"]").is_empty());
    assert_eq!(
        lines("deny_ranges = [\"203.0.113.0/24\"]", ""),
        ["WIDENS  [proxy]: deny_range_removed 203.0.113.0/24"]
    );
    assert_eq!(
        lines("allow_ranges = [\"10.0.0.0/8\"]", "allow_ranges = [\"10.1.0.0/16\"]"),
        ["narrows [proxy]: allow_range_removed 10.0.0.0/8 (10.0.0.0/8 private-use)"]
    );
}

#[test]
fn changes_say_which_traffic_they_concern() {
    let old = policy("[tools.t]\negress = [\"a.test:443\"]\n");
    let new = policy("[tools.t]\negress = [\"a.test:443\", \"*.b.test:443\"]\nmode = \"report\"\n");
    let d = diff(&old, &new);
    assert!(widens(&d));
    let host = |s: &str| crate::parse_host(s).unwrap();
    let wild = d.iter().find(|c| c.kind == "wildcard_added").unwrap();
    assert!(wild.concerns("t", &host("x.b.test"), 443, "not_allowlisted"));
    assert!(!wild.concerns("t", &host("b.test"), 443, "not_allowlisted"));
    assert!(!wild.concerns("u", &host("x.b.test"), 443, "not_allowlisted"));
    let mode = d.iter().find(|c| c.kind == "mode_report").unwrap();
    assert!(mode.concerns("t", &host("c.test"), 443, "not_allowlisted"));
    assert!(wild.specificity() > mode.specificity());
    assert!(!widens(&diff(&new, &old)));
}

proptest::proptest! {
    /// `covers` as defined: whenever A covers B, every name or address
    /// (on B's port) B's list admits, A's list admits.
    #[test]
    fn coverage_agrees_with_matching(a in 0usize..40, b in 0usize..40, q in 0usize..40) {
        const HOSTS: [&str; 8] = ["x.test", "*.test", "a.x.test", "*.x.test", "*.a.x.test", "b.a.x.test", "10.0.0.1", "y.test"];
        let rule = |i: usize| Rule::parse(HOSTS[i % 8], [80, 443][i / 8 % 2], false).unwrap();
        let (ra, rb) = (rule(a), rule(b));
        let name = crate::parse_host(HOSTS[q % 8].trim_start_matches("*.")).unwrap();
        let deeper = crate::parse_host(&format!("z.{}", HOSTS[q % 8].trim_start_matches("*."))).unwrap_or(name.clone());
        if ra.covers(&rb) {
            let (la, lb) = (Allowlist::new(vec![ra.clone()]), Allowlist::new(vec![rb.clone()]));
            for h in [&name, &deeper] {
                if lb.check(h, rb.port()) != Match::NotAllowlisted && lb.check(h, rb.port()) != Match::IpLiteral {
                    proptest::prop_assert!(la.check(h, rb.port()) != Match::NotAllowlisted, "{} {} {:?}", ra, rb, h);
                }
            }
        }
    }
}

#[test]
fn the_envelope_bounds_policies_and_grants() {
    let envelope = policy("[tools.t]\negress = [\"*.corp.test:443\", \"api.gh.test:443\"]\n");
    let within = policy("[tools.t]\negress = [\"docs.corp.test:443\"]\n");
    let wider_wildcard = policy("[tools.t]\negress = [\"*.test:443\"]\n");
    let other_port = policy("[tools.t]\negress = [\"docs.corp.test:8443\"]\n");
    let other_tool = policy("[tools.u]\negress = [\"docs.corp.test:443\"]\n");
    let report = policy("[tools.t]\nmode = \"report\"\negress = [\"docs.corp.test:443\"]\n");
    assert!(beyond(&envelope, &within).is_empty());
    assert!(beyond(&envelope, &envelope).is_empty());
    for (what, p) in [
        ("a wider wildcard", &wider_wildcard),
        ("another port", &other_port),
        ("a tool the envelope lacks", &other_tool),
        ("report mode", &report),
    ] {
        let b = beyond(&envelope, p);
        assert!(
            !b.is_empty() && b.iter().all(|c| c.direction == Direction::Widens),
            "{what}: {b:?}"
        );
    }
    let name = |n: &str| crate::parse_host(n).unwrap();
    assert!(grant_within(&envelope, "t", &name("x.corp.test"), 443));
    assert!(grant_within(&envelope, "t", &name("api.gh.test"), 443));
    assert!(!grant_within(&envelope, "t", &name("x.corp.test"), 80));
    assert!(!grant_within(&envelope, "t", &name("evil.test"), 443));
    assert!(!grant_within(&envelope, "u", &name("x.corp.test"), 443));
}
