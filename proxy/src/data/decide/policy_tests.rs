use super::*;
use crate::runs::RunState;
use egress_config::Config;

fn policy(extra: &str) -> Config {
    let text = format!(
        r#"
[proxy]
allow_ranges = ["127.0.0.2/32"]
[tools.t]
egress = ["api.example:443", "*.cdn.example:443", "10.0.0.1:80", {{ host = "metrics.internal", port = 9090, private = true }}]
{extra}
"#
    );
    Config::parse(&text, "test").unwrap()
}

fn target(kind: Kind, host: &str, port: u16) -> Target {
    Target {
        kind,
        host: egress_config::parse_host(host).unwrap(),
        port,
        path_and_query: None,
    }
}

#[test]
fn run_states() {
    assert_eq!(check_run(RunState::Active), Ok(()));
    assert_eq!(check_run(RunState::Created), Err(DenyReason::RunNotActive));
    assert_eq!(check_run(RunState::Ended), Err(DenyReason::RunEnded));
}

#[test]
fn admission_table() {
    let c = policy("");
    let t = c.policy.tool("t").unwrap();
    let table = [
        ("api.example", 443, Some(None)),
        ("API.example.", 443, Some(None)),
        ("api.example", 80, Some(Some(DenyReason::NotAllowlisted))),
        ("x.cdn.example", 443, Some(None)),
        ("cdn.example", 443, Some(Some(DenyReason::NotAllowlisted))),
        ("evil.example", 443, Some(Some(DenyReason::NotAllowlisted))),
        ("10.0.0.1", 80, Some(None)),
        ("167772161", 80, Some(None)),
        ("10.0.0.2", 80, Some(Some(DenyReason::IpLiteral))),
        ("127.1", 443, Some(Some(DenyReason::IpLiteral))),
        ("[::1]", 443, Some(Some(DenyReason::IpLiteral))),
    ];
    for (host, port, want) in table {
        let got = admit(t, &target(Kind::Connect, host, port), "CONNECT");
        let got = match got {
            Admission::Allow { .. } => Some(None),
            Admission::Deny(d) => Some(Some(d.reason)),
            Admission::Report { .. } => None,
        };
        assert_eq!(got, want, "{host}:{port}");
    }
    assert_eq!(
        admit(t, &target(Kind::Connect, "metrics.internal", 9090), "CONNECT"),
        Admission::Allow { private: true }
    );
}

#[test]
fn report_mode_waives_only_reportable_reasons() {
    let c = policy("mode = \"report\"");
    let t = c.policy.tool("t").unwrap();
    match admit(t, &target(Kind::Http, "evil.example", 80), "GET") {
        Admission::Report { denial, .. } => assert_eq!(denial.reason, DenyReason::NotAllowlisted),
        other => panic!("{other:?}"),
    }
}

#[test]
fn methods_restrict() {
    let c = policy("methods = [\"get\"]");
    let t = c.policy.tool("t").unwrap();
    assert_eq!(
        admit(t, &target(Kind::Http, "api.example", 443), "GET"),
        Admission::Allow { private: false }
    );
    assert!(matches!(
        admit(t, &target(Kind::Http, "api.example", 443), "POST"),
        Admission::Deny(Denial {
            reason: DenyReason::MethodNotAllowed,
            ..
        })
    ));
    assert!(matches!(
        admit(t, &target(Kind::Connect, "api.example", 443), "CONNECT"),
        Admission::Deny(Denial {
            reason: DenyReason::MethodNotAllowed,
            ..
        })
    ));
}

/// Credential hosts (and every host of an `inspect` tool) are intercepted;
/// an intercepted CONNECT is not held to `methods` (its requests are), a
/// blind one still is.
#[test]
fn intercepted_connects_leave_methods_to_their_requests() {
    let cred = "[tools.t.credentials.api]\nhosts = [\"api.example:443\"]\nvalue = \"${secret}\"\nsecret = { env = \"X\" }\nplaceholder_env = \"API\"\n";
    let c = policy(&format!("methods = [\"GET\"]\n{cred}"));
    let t = c.policy.tool("t").unwrap();
    let api = target(Kind::Connect, "api.example", 443);
    let cdn = target(Kind::Connect, "x.cdn.example", 443);
    assert!(intercepts(t, &api) && !intercepts(t, &cdn));
    assert_eq!(admit(t, &api, "CONNECT"), Admission::Allow { private: false });
    assert!(matches!(
        admit(t, &cdn, "CONNECT"),
        Admission::Deny(Denial {
            reason: DenyReason::MethodNotAllowed,
            ..
        })
    ));
    let c = policy("methods = [\"GET\"]\ninspect = true");
    let t = c.policy.tool("t").unwrap();
    assert!(intercepts(t, &cdn));
    assert_eq!(admit(t, &cdn, "CONNECT"), Admission::Allow { private: false });
}

fn ips(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

#[test]
fn vetting_drops_denied_ranges_in_every_form() {
    let c = policy("");
    let r = &c.policy.ranges;
    let me = SelfAddrs(vec!["127.0.0.1:3128".parse().unwrap()]);
    let v = vet(
        &ips(&[
            "93.184.216.34",
            "127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
            "2002:a9fe:a9fe::",
            "2001:0:a9fe::1",
            "::a9fe:a9fe",
            "127.0.0.2",
            "::ffff:127.0.0.2",
            "93.184.216.34",
        ]),
        443,
        r,
        false,
        &me,
        &HostAddrs::default(),
    );
    assert_eq!(v.allowed, ips(&["93.184.216.34", "127.0.0.2"]));
    assert_eq!(v.private.len(), 6);
    let t = target(Kind::Connect, "api.example", 443);
    assert_eq!(v.denial(&t), None);
}

#[test]
fn nothing_left_is_private_address() {
    let c = policy("");
    let v = vet(
        &ips(&["10.1.1.1", "fd00::1"]),
        443,
        &c.policy.ranges,
        false,
        &SelfAddrs::default(),
        &HostAddrs::default(),
    );
    let d = v.denial(&target(Kind::Connect, "api.example", 443)).unwrap();
    assert_eq!(d.reason, DenyReason::PrivateAddress);
    assert!(d.detail.contains("10.1.1.1") && d.detail.contains("fd00::1"));
    // private = true opts the rule into private ranges.
    let v = vet(
        &ips(&["10.1.1.1"]),
        443,
        &c.policy.ranges,
        true,
        &SelfAddrs::default(),
        &HostAddrs::default(),
    );
    assert_eq!(v.allowed, ips(&["10.1.1.1"]));
}

#[test]
fn self_loop_holds_even_when_ranges_allow() {
    let c = policy("");
    let me = SelfAddrs(vec!["127.0.0.2:3128".parse().unwrap(), "0.0.0.0:3129".parse().unwrap()]);
    let v = vet(
        &ips(&["127.0.0.2"]),
        3128,
        &c.policy.ranges,
        true,
        &me,
        &HostAddrs::default(),
    );
    assert_eq!(v.self_loop, ips(&["127.0.0.2"]));
    assert_eq!(
        v.denial(&target(Kind::Connect, "x", 3128)).unwrap().reason,
        DenyReason::SelfLoop
    );
    let v = vet(
        &ips(&["127.0.0.5", "::1", "0.0.0.0"]),
        3129,
        &c.policy.ranges,
        true,
        &me,
        &HostAddrs::default(),
    );
    assert_eq!(v.self_loop.len(), 3);
    let v = vet(
        &ips(&["127.0.0.2"]),
        3130,
        &c.policy.ranges,
        false,
        &me,
        &HostAddrs::default(),
    );
    assert_eq!(v.allowed, ips(&["127.0.0.2"]));
}

#[test]
fn the_hosts_own_addresses_are_denied_unless_allow_ranges_exempt_them() {
    let c = policy("");
    let host = HostAddrs(ips(&["93.184.216.34", "2001:db9::5"]));
    let me = SelfAddrs::default();
    let v = vet(&ips(&["93.184.216.34"]), 8080, &c.policy.ranges, false, &me, &host);
    assert_eq!((v.allowed.len(), v.host.clone()), (0, ips(&["93.184.216.34"])));
    let d = v.denial(&target(Kind::Connect, "api.example", 8080)).unwrap();
    assert_eq!(d.reason, DenyReason::PrivateAddress);
    assert!(d.detail.contains("this host's own interfaces"), "{}", d.detail);
    // IPv4-mapped spelling of a host address, and a host IPv6 address.
    let v = vet(
        &ips(&["::ffff:93.184.216.34", "2001:db9::5"]),
        80,
        &c.policy.ranges,
        false,
        &me,
        &host,
    );
    assert!(v.allowed.is_empty());
    // private = true does not open the host's own addresses; allow_ranges does.
    let v = vet(&ips(&["93.184.216.34"]), 80, &c.policy.ranges, true, &me, &host);
    assert!(v.allowed.is_empty());
    let c = Config::parse("[proxy]\nallow_ranges = [\"93.184.216.0/24\"]\n", "test").unwrap();
    let v = vet(&ips(&["93.184.216.34"]), 80, &c.policy.ranges, false, &me, &host);
    assert_eq!(v.allowed, ips(&["93.184.216.34"]));
    // Other public addresses are untouched.
    let v = vet(
        &ips(&["93.184.216.35"]),
        80,
        &policy("").policy.ranges,
        false,
        &me,
        &host,
    );
    assert_eq!(v.allowed, ips(&["93.184.216.35"]));
}

/// Pieces of a request head, for the credential checks.
struct Pieces<'a>(&'a [&'a str]);

impl Head for Pieces<'_> {
    fn any(&self, f: &mut dyn FnMut(&[u8]) -> bool) -> bool {
        self.0.iter().any(|p| f(p.as_bytes()))
    }
}

const API_SECRET: &str = "api-SECRET/value-1";
const LAB_SECRET: &str = "lab-SECRET-value-2";
const FAR_SECRET: &str = "far-SECRET-value-3";

/// Tool `t` holds `api` for `api.example:443`; tool `u` holds `far` (its
/// credential 0) for `far.example:80` (plaintext forced) and `lab` (1) for
/// `local.example:80` (plaintext to loopback); their secrets loaded.
fn credential_policy(mode: &str) -> Config {
    let mut c = policy(&format!(
        "mode = \"{mode}\"\n\
         [tools.t.credentials.api]\nhosts = [\"api.example:443\"]\nvalue = \"Bearer ${{secret}}\"\nsecret = {{ env = \"X\" }}\nplaceholder_env = \"API\"\n\
         [tools.u]\negress = [\"local.example:80\", \"far.example:80\"]\n\
         [tools.u.credentials.lab]\nhosts = [\"local.example:80\"]\nvalue = \"${{secret}}\"\nsecret = {{ env = \"X\" }}\nplaceholder_env = \"LAB\"\nallow_plaintext = true\n\
         [tools.u.credentials.far]\nhosts = [\"far.example:80\"]\nvalue = \"${{secret}}\"\nsecret = {{ env = \"X\" }}\nplaceholder_env = \"FAR\"\nallow_plaintext = \"force\"\n"
    ));
    let p = std::sync::Arc::make_mut(&mut c.policy);
    for (tool, cred, secret) in [
        ("t", "api", API_SECRET),
        ("u", "lab", LAB_SECRET),
        ("u", "far", FAR_SECRET),
    ] {
        let t = std::sync::Arc::make_mut(p.tools.get_mut(tool).unwrap());
        let c = t.credentials.iter_mut().find(|c| &*c.name == cred).unwrap();
        c.secret = egress_config::Secret::new(secret);
    }
    p.index_secrets();
    c
}

#[test]
fn credentials_go_only_to_their_hosts_and_only_over_verified_tls() {
    use Channel::{Plain, VerifiedTls as Tls};
    use DenyReason::{CredentialMisuse as Misuse, CredentialRequiresTls as NeedsTls};
    let c = credential_policy("enforce");
    let (t, u) = (c.policy.tool("t").unwrap(), c.policy.tool("u").unwrap());
    let ph = |name: &str, v: &str| crate::runs::Placeholder {
        credential: name.into(),
        value: v.into(),
    };
    let run = [ph("api", "loom-cred-a"), ph("gone", "loom-cred-g")];
    let http = |host: &str, port: u16| target(Kind::Http, host, port);
    let connect = |host: &str, port: u16| target(Kind::Connect, host, port);
    let ok = |creds: &[usize], loopback_only: bool| {
        Ok(Inject {
            creds: creds.to_vec(),
            loopback_only,
        })
    };
    let cdn = || http("x.cdn.example", 443);
    let api = || http("api.example", 443);
    // (tool, target, channel, head pieces, want)
    type Row<'a> = (
        &'a ToolPolicy,
        Target,
        Channel,
        &'a [&'a str],
        Result<Inject, DenyReason>,
    );
    let table: Vec<Row> = vec![
        // Placeholders.
        (t, api(), Tls, &[], ok(&[0], false)),
        (t, api(), Tls, &["Bearer loom-cred-a"], ok(&[0], false)),
        (t, cdn(), Plain, &[], ok(&[], false)),
        (t, cdn(), Plain, &["x-key", "loom-cred-a"], Err(Misuse)),
        (t, api(), Tls, &["/q?k=loom-cred-g"], Err(Misuse)),
        (t, connect("x.cdn.example", 443), Plain, &["loom-cred-a"], Err(Misuse)),
        (t, connect("api.example", 443), Plain, &["loom-cred-a"], ok(&[], false)),
        // Real values, in every form and every piece of the head.
        (
            t,
            cdn(),
            Plain,
            &["authorization", "Bearer api-SECRET/value-1"],
            Err(Misuse),
        ),
        (t, cdn(), Plain, &["/leak?k=api-SECRET%2Fvalue-1"], Err(Misuse)),
        (t, cdn(), Plain, &["/leak?k=api-SECRET%2fvalue-1"], Err(Misuse)),
        (t, cdn(), Plain, &["{\"k\":\"api-SECRET\\/value-1\"}"], Err(Misuse)),
        (t, cdn(), Plain, &["x-api-SECRET/value-1"], Err(Misuse)),
        (t, cdn(), Plain, &["api-secret/value-1.cdn.example:443"], ok(&[], false)),
        (
            t,
            connect("x.cdn.example", 443),
            Plain,
            &["api-SECRET/value-1"],
            Err(Misuse),
        ),
        (t, api(), Tls, &["Bearer api-SECRET/value-1"], ok(&[0], false)),
        (t, api(), Tls, &["lab-SECRET-value-2"], Err(Misuse)),
        (u, http("far.example", 80), Plain, &["api-SECRET/value-1"], Err(Misuse)),
        // Cleartext.
        (t, api(), Plain, &[], Err(NeedsTls)),
        (t, http("api.example", 443), Plain, &["loom-cred-a"], Err(NeedsTls)),
        (u, http("local.example", 80), Plain, &[], ok(&[1], true)),
        (u, http("far.example", 80), Plain, &[], ok(&[0], false)),
        (u, http("local.example", 80), Tls, &[], ok(&[1], false)),
    ];
    for (tool, tg, channel, head, want) in table {
        let got = credentials(tool, &c.policy.secrets, &run, &tg, channel, &Pieces(head)).map_err(|d| d.reason);
        assert_eq!(got, want, "{} {tg} {channel:?} {head:?}", tool.id);
    }
    let d = credentials(t, &c.policy.secrets, &run, &cdn(), Plain, &Pieces(&["loom-cred-a"])).unwrap_err();
    assert!(
        d.detail.contains("credential api") && !d.detail.contains("loom-cred"),
        "{}",
        d.detail
    );
    let d = credentials(t, &c.policy.secrets, &[], &cdn(), Plain, &Pieces(&[API_SECRET])).unwrap_err();
    assert!(
        d.detail.contains("real value of credential api of tool t") && !d.detail.contains("SECRET"),
        "{}",
        d.detail
    );
    // Report mode waives neither.
    let r = credential_policy("report");
    let t = r.policy.tool("t").unwrap();
    for (tg, head) in [
        (cdn(), &["loom-cred-a"][..]),
        (cdn(), &[API_SECRET][..]),
        (api(), &[][..]),
    ] {
        let got = credentials(t, &r.policy.secrets, &run, &tg, Plain, &Pieces(head));
        assert!(got.is_err(), "{tg} {head:?}");
        assert!(!got.unwrap_err().reason.reportable());
    }
}

#[test]
fn cleartext_credentials_go_to_loopback_addresses_only() {
    let tg = target(Kind::Http, "local.example", 80);
    let ips = |v: &[&str]| -> Vec<IpAddr> { v.iter().map(|s| s.parse().unwrap()).collect() };
    assert_eq!(
        loopback_dial(&tg, ips(&["93.184.216.34", "127.0.0.2", "::1", "::ffff:127.0.0.3"])),
        Ok(ips(&["127.0.0.2", "::1", "::ffff:127.0.0.3"]))
    );
    let d = loopback_dial(&tg, ips(&["93.184.216.34", "10.0.0.1"])).unwrap_err();
    assert_eq!(d.reason, DenyReason::CredentialRequiresTls);
}

#[test]
fn only_a_whole_websocket_handshake_is_an_upgrade_carried() {
    use http::header::{HeaderMap, HeaderName, HeaderValue};
    let head = |pairs: &[(&str, &str)]| {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    };
    let ws = [
        ("upgrade", "websocket"),
        ("connection", "keep-alive, Upgrade"),
        ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ("sec-websocket-version", "13"),
    ];
    assert_eq!(upgrade_of("GET", &head(&[])), Upgrade::None);
    assert_eq!(upgrade_of("GET", &head(&ws)), Upgrade::WebSocket);
    let mut shouting = ws;
    shouting[0].1 = "WebSocket";
    assert_eq!(upgrade_of("GET", &head(&shouting)), Upgrade::WebSocket);
    // Not GET, a part missing, another protocol, two protocols.
    assert!(matches!(upgrade_of("POST", &head(&ws)), Upgrade::Other(_)));
    for missing in 2..4 {
        let mut part: Vec<(&str, &str)> = ws.to_vec();
        part.remove(missing);
        assert!(
            matches!(upgrade_of("GET", &head(&part)), Upgrade::Other(_)),
            "{missing}"
        );
    }
    // Without the connection option nothing is asked: a stray hop-by-hop
    // header, stripped.
    assert_eq!(upgrade_of("GET", &head(&[("upgrade", "h2c")])), Upgrade::None);
    let mut no_option: Vec<(&str, &str)> = ws.to_vec();
    no_option.remove(1);
    assert_eq!(upgrade_of("GET", &head(&no_option)), Upgrade::None);
    let h2c = head(&[("upgrade", "h2c"), ("connection", "Upgrade, HTTP2-Settings")]);
    assert_eq!(upgrade_of("GET", &h2c), Upgrade::Other("h2c".into()));
    let both = head(&[("upgrade", "websocket, h2c"), ("connection", "upgrade")]);
    assert!(matches!(upgrade_of("GET", &both), Upgrade::Other(_)));
    // The decision: a WebSocket goes on, any other upgrade is denied.
    let c = policy("");
    let t = c.policy.tool("t").unwrap();
    let api = target(Kind::Http, "api.example", 443);
    assert_eq!(upgrade(t, &api, &Upgrade::None), Ok(false));
    assert_eq!(upgrade(t, &api, &Upgrade::WebSocket), Ok(true));
    let d = upgrade(t, &api, &upgrade_of("GET", &h2c)).unwrap_err();
    assert_eq!(d.reason, DenyReason::UpgradeNotAllowed);
    assert!(d.detail.contains("h2c"), "{}", d.detail);
    assert!(!DenyReason::UpgradeNotAllowed.reportable());
}

#[test]
fn websocket_messages_carry_placeholders_in_text_only_and_secrets_to_their_hosts_only() {
    let c = credential_policy("enforce");
    let t = c.policy.tool("t").unwrap();
    let run = [crate::runs::Placeholder {
        credential: "api".into(),
        value: "loom-cred-a".into(),
    }];
    let api = target(Kind::Http, "api.example", 443);
    let cdn = target(Kind::Http, "x.cdn.example", 443);
    let check = |to: &Target, text: bool, p: &str| {
        websocket_message(t, &c.policy.secrets, &run, to, text, p.as_bytes()).map_err(|d| d.reason)
    };
    assert_eq!(check(&api, true, "hello"), Ok(()));
    assert_eq!(check(&api, false, "hello"), Ok(()));
    assert_eq!(check(&api, true, "token loom-cred-a"), Ok(()));
    assert_eq!(check(&api, true, API_SECRET), Ok(()));
    // Binary: neither the placeholder nor the secret.
    assert_eq!(check(&api, false, "x loom-cred-a"), Err(DenyReason::CredentialMisuse));
    assert_eq!(check(&api, false, API_SECRET), Err(DenyReason::CredentialMisuse));
    // Another host: the head's rule.
    assert_eq!(check(&cdn, true, "loom-cred-a"), Err(DenyReason::CredentialMisuse));
    // Another tool's secret, even in text.
    assert_eq!(check(&api, true, LAB_SECRET), Err(DenyReason::CredentialMisuse));
}

#[test]
fn a_transparent_connection_is_relayed_raw_only_where_an_entry_says_tcp() {
    let text = |mode: &str| {
        format!(
            r#"
[tools.t]
network = "transparent"
mode = "{mode}"
egress = ["web.example:443", {{ host = "db.example", port = 5432, protocol = "tcp" }}, {{ host = "*.pg.example", port = 5432, protocol = "tcp" }}]
[tools.t.process]
command = ["x"]
"#
        )
    };
    let c = Config::parse(&text("enforce"), "test").unwrap();
    let t = c.policy.tool("t").unwrap();
    for (host, port, raw) in [
        ("db.example", 5432, true),
        ("a.pg.example", 5432, true),
        ("db.example", 443, false),
        ("web.example", 443, false),
        ("evil.example", 5432, false),
        ("10.0.0.1", 5432, false),
    ] {
        assert_eq!(relays_raw(t, &target(Kind::Connect, host, port)), raw, "{host}:{port}");
    }
    // Anything else is protocol_unknown, saying what the connection did;
    // report mode records it and lets it through.
    let web = target(Kind::Connect, "web.example", 443);
    match unknown_protocol(t, &web, &"sent nothing within 10 ms") {
        Admission::Deny(d) => {
            assert_eq!(d.reason, DenyReason::ProtocolUnknown);
            assert!(
                d.detail
                    .starts_with("the connection to web.example:443 sent nothing within 10 ms: tool t"),
                "{}",
                d.detail
            );
        }
        other => panic!("{other:?}"),
    }
    let c = Config::parse(&text("report"), "test").unwrap();
    assert!(matches!(
        unknown_protocol(c.policy.tool("t").unwrap(), &web, &"x"),
        Admission::Report { denial, .. } if denial.reason == DenyReason::ProtocolUnknown
    ));
}

/// A request head with headers and a query, for the signing checks.
struct Signed<'a> {
    headers: &'a [(&'a str, &'a str)],
    query: Option<&'a str>,
}

impl Head for Signed<'_> {
    fn any(&self, f: &mut dyn FnMut(&[u8]) -> bool) -> bool {
        self.query.is_some_and(|q| f(q.as_bytes())) || self.headers.iter().any(|(_, v)| f(v.as_bytes()))
    }

    fn header(&self, name: &str, f: &mut dyn FnMut(&[u8])) {
        for (_, v) in self.headers.iter().filter(|(n, _)| n.eq_ignore_ascii_case(name)) {
            f(v.as_bytes());
        }
    }

    fn query(&self) -> Option<&str> {
        self.query
    }
}

#[test]
fn a_signing_credential_takes_only_its_placeholder_s_header_signatures() {
    let mut c = policy(
        "[tools.s]\negress = [\"s3.example:443\", \"other.example:443\"]\n\
         [tools.s.credentials.aws]\nhosts = [\"s3.example:443\"]\nplaceholder_env = \"AWS_ACCESS_KEY_ID\"\n\
         sign = { aws_sigv4 = { service = \"s3\", region = \"us-east-1\", access_key_id = { env = \"A\" }, \
         secret_access_key = { env = \"S\" } } }\n",
    );
    let p = std::sync::Arc::make_mut(&mut c.policy);
    {
        let t = std::sync::Arc::make_mut(p.tools.get_mut("s").unwrap());
        let cred = &mut t.credentials[0];
        cred.secret = egress_config::Secret::new("real-secret-access-key");
        let sign = std::sync::Arc::make_mut(cred.sign.as_mut().unwrap());
        sign.key_id = egress_config::Secret::new("AKIDREALKEY000000001");
    }
    p.index_secrets();
    let tool = c.policy.tool("s").unwrap();
    const PH: &str = "loom-cred-00112233445566778899aabbccddeeff";
    let placeholders = [Placeholder {
        credential: "aws".into(),
        value: PH.into(),
    }];
    let v4 = |key: &str| {
        format!("AWS4-HMAC-SHA256 Credential={key}/20261206/us-east-1/s3/aws4_request, SignedHeaders=host;x-amz-date, Signature={}", "a".repeat(64))
    };
    let (mine, other) = (v4(PH), v4("AKIAIOSFODNN7EXAMPLE"));
    let real = v4("AKIDREALKEY000000001");
    let sigv4a =
        format!("AWS4-ECDSA-P256-SHA256 Credential={PH}/20261206/s3/aws4_request, SignedHeaders=host, Signature=ab");
    let (v2_mine, v2_other) = (
        format!("AWS {PH}:c2lnbmF0dXJl"),
        "AWS AKIAIOSFODNN7EXAMPLE:c2ln".to_owned(),
    );
    let v4_query = format!("X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={PH}%2F20261206%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Signature=ab");
    let v2_query = format!("AWSAccessKeyId={PH}&Signature=abc&Expires=1");
    let other_query = "AWSAccessKeyId=AKIAIOSFODNN7EXAMPLE&Signature=abc&Expires=1";
    use DenyReason::{CredentialMisuse as Misuse, SignatureUnsupported as Unsupported};
    let hex = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
    type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, Option<&'a str>, Option<DenyReason>);
    let table: Vec<Case> = vec![
        ("unsigned: the proxy signs", vec![], None, None),
        ("the placeholder's SigV4", vec![("authorization", &mine)], None, None),
        (
            "with a hex payload hash",
            vec![("authorization", &mine), ("x-amz-content-sha256", hex)],
            None,
            None,
        ),
        (
            "UNSIGNED-PAYLOAD",
            vec![("x-amz-content-sha256", "UNSIGNED-PAYLOAD")],
            None,
            None,
        ),
        (
            "unsigned trailer",
            vec![("x-amz-content-sha256", "STREAMING-UNSIGNED-PAYLOAD-TRAILER")],
            None,
            None,
        ),
        (
            "signed chunks",
            vec![("x-amz-content-sha256", "STREAMING-AWS4-HMAC-SHA256-PAYLOAD")],
            None,
            None,
        ),
        ("another key id", vec![("authorization", &other)], None, Some(Misuse)),
        (
            "the real key id itself",
            vec![("authorization", &real)],
            None,
            Some(Misuse),
        ),
        (
            "another scheme",
            vec![("authorization", "Bearer abc")],
            None,
            Some(Misuse),
        ),
        (
            "SigV2 by another key",
            vec![("authorization", &v2_other)],
            None,
            Some(Misuse),
        ),
        (
            "SigV2 by the placeholder",
            vec![("authorization", &v2_mine)],
            None,
            Some(Unsupported),
        ),
        ("SigV4a", vec![("authorization", &sigv4a)], None, Some(Unsupported)),
        (
            "malformed SigV4",
            vec![("authorization", "AWS4-HMAC-SHA256 Credential=x")],
            None,
            Some(Unsupported),
        ),
        (
            "two signatures, one foreign",
            vec![("authorization", &mine), ("authorization", &other)],
            None,
            Some(Misuse),
        ),
        (
            "presigned SigV4 by the placeholder",
            vec![],
            Some(&v4_query),
            Some(Unsupported),
        ),
        (
            "presigned SigV2 by the placeholder",
            vec![],
            Some(&v2_query),
            Some(Unsupported),
        ),
        ("presigned by another key", vec![], Some(other_query), Some(Misuse)),
        (
            "a signed trailer",
            vec![("x-amz-content-sha256", "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER")],
            None,
            Some(Unsupported),
        ),
        (
            "an unknown payload hash",
            vec![("x-amz-content-sha256", "abc")],
            None,
            Some(Unsupported),
        ),
        (
            "two payload hashes",
            vec![("x-amz-content-sha256", hex), ("x-amz-content-sha256", hex)],
            None,
            Some(Unsupported),
        ),
    ];
    let s3 = target(Kind::Http, "s3.example", 443);
    for (what, headers, query, want) in &table {
        let head = Signed { headers, query: *query };
        let got = credentials(tool, &c.policy.secrets, &placeholders, &s3, Channel::VerifiedTls, &head);
        match (want, got) {
            (None, Ok(i)) => assert_eq!(i.creds, vec![0], "{what}"),
            (Some(w), Err(d)) => assert_eq!(d.reason, *w, "{what}: {}", d.detail),
            (w, g) => panic!("{what}: want {w:?}, got {g:?}"),
        }
    }
    // Elsewhere the placeholder is misuse, and the real key id too; over
    // plain HTTP the credential is never written.
    let other_host = target(Kind::Http, "other.example", 443);
    for h in [&mine, &real] {
        let head = Signed {
            headers: &[("authorization", h)],
            query: None,
        };
        let got = credentials(
            tool,
            &c.policy.secrets,
            &placeholders,
            &other_host,
            Channel::VerifiedTls,
            &head,
        );
        assert_eq!(got.unwrap_err().reason, Misuse, "{h}");
    }
    let head = Signed {
        headers: &[],
        query: None,
    };
    let got = credentials(tool, &c.policy.secrets, &placeholders, &s3, Channel::Plain, &head);
    assert_eq!(got.unwrap_err().reason, DenyReason::CredentialRequiresTls);
}
