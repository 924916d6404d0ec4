use super::*;

fn principal(name: &str, scopes: &[&str]) -> Principal {
    let mut s = Scopes {
        grant_max_ttl_ms: 60_000,
        grant_max_uses: 10,
        ..Scopes::default()
    };
    for x in scopes {
        s.add(x).unwrap();
    }
    Principal {
        name: name.into(),
        scopes: s,
        subjects: vec![],
    }
}

#[test]
fn globs_match_as_documented() {
    for (pattern, text, want) in [
        ("*", "anything", true),
        ("*", "", true),
        ("search", "search", true),
        ("search", "search2", false),
        ("search-*", "search-web", true),
        ("search-*", "search-", true),
        ("search-*", "searchweb", false),
        ("*-web", "search-web", true),
        ("a*b*c", "a-x-b-y-c", true),
        ("a*b*c", "a-x-c-y-b", false),
        ("**", "x", true),
        ("", "", true),
        ("", "x", false),
    ] {
        assert_eq!(glob(pattern, text), want, "{pattern:?} ~ {text:?}");
    }
}

/// The table: one principal per row, an action, and the verdict (`Ok` or
/// the refusal's code).
#[test]
fn the_scope_table() {
    let a = principal(
        "kernel-a",
        &[
            "runs:search-*",
            "invoke:search-*",
            "facts:own",
            "decisions:own",
            "grants:search-*",
        ],
    );
    let reader = principal("auditor", &["facts:all", "decisions:all", "policy:read"]);
    let reloader = principal("ops", &["policy:reload", "metrics"]);
    let admin = principal("operator", &["admin"]);
    let control = Principal::control();
    use Action::*;
    let cases: Vec<(&Principal, Action<'_>, Result<(), &str>)> = vec![
        (&a, CreateRun { tool: "search-web" }, Ok(())),
        (&a, CreateRun { tool: "shell" }, Err("scope")),
        (
            &a,
            UseRun {
                tool: "search-web",
                owner: Some("kernel-a"),
            },
            Ok(()),
        ),
        (
            &a,
            UseRun {
                tool: "search-web",
                owner: Some("kernel-b"),
            },
            Err("not_your_run"),
        ),
        (
            &a,
            UseRun {
                tool: "search-web",
                owner: None,
            },
            Err("not_your_run"),
        ),
        (
            &a,
            EndRun {
                tool: "search-web",
                owner: Some("kernel-a"),
            },
            Ok(()),
        ),
        (
            &a,
            EndRun {
                tool: "search-web",
                owner: Some("kernel-b"),
            },
            Err("not_your_run"),
        ),
        // Its own run of a tool it may no longer use (the file changed).
        (
            &a,
            UseRun {
                tool: "shell",
                owner: Some("kernel-a"),
            },
            Err("scope"),
        ),
        (&a, Attribute, Err("scope")),
        (
            &a,
            Grant {
                tool: "search-web",
                owner: Some("kernel-a"),
                ttl_ms: 60_000,
                uses: 10,
            },
            Ok(()),
        ),
        (
            &a,
            Grant {
                tool: "search-web",
                owner: Some("kernel-a"),
                ttl_ms: 60_001,
                uses: 1,
            },
            Err("beyond_scope"),
        ),
        (
            &a,
            Grant {
                tool: "search-web",
                owner: Some("kernel-a"),
                ttl_ms: 1,
                uses: 11,
            },
            Err("beyond_scope"),
        ),
        (
            &a,
            Grant {
                tool: "shell",
                owner: Some("kernel-a"),
                ttl_ms: 1,
                uses: 1,
            },
            Err("scope"),
        ),
        (
            &a,
            Grant {
                tool: "search-web",
                owner: Some("kernel-b"),
                ttl_ms: 1,
                uses: 1,
            },
            Err("not_your_run"),
        ),
        (&a, Invoke { tool: "search-web" }, Ok(())),
        (&a, Invoke { tool: "shell" }, Err("scope")),
        (&a, ReadFacts, Ok(())),
        (&a, ReadDecisions, Ok(())),
        (&a, Learn, Err("scope")),
        (&a, PolicyRead, Err("scope")),
        (&a, PolicyReload, Err("scope")),
        (&a, Metrics, Err("scope")),
        (&a, Owners, Ok(())),
        (&a, ReportExecutor, Err("scope")),
        (&admin, ReportExecutor, Ok(())),
        (
            &a,
            Lease {
                holder: Some("kernel-a"),
            },
            Ok(()),
        ),
        (
            &a,
            Lease {
                holder: Some("kernel-b"),
            },
            Err("not_your_lease"),
        ),
        (&a, Lease { holder: None }, Err("not_your_lease")),
        (
            &admin,
            Lease {
                holder: Some("kernel-b"),
            },
            Ok(()),
        ),
        (&reader, ReadFacts, Ok(())),
        (&reader, Learn, Ok(())),
        (&reader, PolicyRead, Ok(())),
        (&reader, PolicyReload, Err("scope")),
        (&reader, CreateRun { tool: "search-web" }, Err("scope")),
        (&reader, Owners, Err("scope")),
        (
            &reader,
            UseRun {
                tool: "search-web",
                owner: Some("kernel-a"),
            },
            Err("not_your_run"),
        ),
        (&reloader, PolicyReload, Ok(())),
        (&reloader, PolicyRead, Ok(())),
        (&reloader, Metrics, Ok(())),
        (&reloader, ReadFacts, Err("scope")),
        (&reloader, ReadDecisions, Err("scope")),
        (
            &admin,
            EndRun {
                tool: "shell",
                owner: Some("kernel-b"),
            },
            Ok(()),
        ),
        (
            &admin,
            Grant {
                tool: "x",
                owner: None,
                ttl_ms: u64::MAX,
                uses: u32::MAX,
            },
            Ok(()),
        ),
        (&admin, Attribute, Ok(())),
        (&control, Attribute, Ok(())),
        (&control, PolicyReload, Ok(())),
        (
            &control,
            UseRun {
                tool: "t",
                owner: Some("kernel-a"),
            },
            Ok(()),
        ),
    ];
    for (p, action, want) in cases {
        let got = authorize(p, &action).map_err(|r| r.code);
        assert_eq!(got, want, "{} {action:?}", p.name);
    }
}

#[test]
fn visibility_follows_the_scopes() {
    let a = principal("kernel-a", &["runs:*", "facts:own"]);
    let all = principal("auditor", &["facts:all", "decisions:own"]);
    let admin = principal("operator", &["admin"]);
    for (p, kind, owner, want) in [
        (&a, Record::Run, Some("kernel-a"), true),
        (&a, Record::Run, Some("kernel-b"), false),
        (&a, Record::Run, None, false),
        (&a, Record::Fact, Some("kernel-a"), true),
        (&a, Record::Fact, Some("kernel-b"), false),
        (&a, Record::Fact, None, false),
        (&a, Record::Decision, Some("kernel-a"), false),
        (&all, Record::Fact, Some("kernel-b"), true),
        (&all, Record::Fact, None, true),
        (&all, Record::Decision, Some("auditor"), true),
        (&all, Record::Decision, Some("kernel-a"), false),
        (&admin, Record::Run, Some("kernel-b"), true),
        (&admin, Record::Run, None, true),
    ] {
        assert_eq!(p.sees(kind, owner), want, "{} {kind:?} {owner:?}", p.name);
    }
}

#[test]
fn a_file_parses_and_finds_principals_by_token_and_subject() {
    let text = format!(
        r#"
[principals.kernel-a]
tokens = ["{}"]
scopes = ["runs:search-*", "facts:own"]
grant_max_ttl_ms = 5000

[principals.auditor]
subjects = ["auditor.kernels.example"]
scopes = ["facts:all", "decisions:all"]
"#,
        token_hash("token-of-kernel-a-0123456789")
    );
    let p = Principals::parse(&text).unwrap();
    assert_eq!(p.len(), 2);
    let a = p.by_token("token-of-kernel-a-0123456789").unwrap();
    assert_eq!(&*a.name, "kernel-a");
    assert_eq!(a.scopes.grant_max_ttl_ms, 5000);
    assert_eq!(a.scopes.grant_max_uses, DEFAULT_GRANT_MAX_USES);
    assert!(p.by_token("token-of-kernel-a-012345678").is_none());
    assert_eq!(&*p.by_subject("auditor.kernels.example").unwrap().name, "auditor");
    assert!(p.by_subject("kernel-a").is_none());
    // A certificate's names before a token; a name nobody has falls to the token.
    let token = Some("token-of-kernel-a-0123456789");
    let named = ["nobody.example".to_owned(), "auditor.kernels.example".to_owned()];
    assert_eq!(&*p.find(&named, token).unwrap().name, "auditor");
    assert_eq!(&*p.find(&named[..1], token).unwrap().name, "kernel-a");
    assert!(p.find(&named[..1], None).is_none());
    assert_eq!(&*p.by_name("auditor").unwrap().name, "auditor");
}

#[test]
fn every_problem_of_a_file_is_named() {
    let h = token_hash("t");
    let text = format!(
        r#"
[principals.control]
tokens = ["{h}"]

[principals."bad name"]
tokens = ["sha256:00"]
scopes = ["invoke", "facts:some", "root"]

[principals.empty]
scopes = ["admin"]

[principals.twin]
tokens = ["{h}"]
colour = "red"
"#
    );
    let problems = Principals::parse(&text).unwrap_err();
    let paths: Vec<(&str, &str)> = problems.iter().map(|p| (p.path.as_str(), p.message.as_str())).collect();
    let has = |path: &str, needle: &str| {
        assert!(
            paths.iter().any(|(p, m)| *p == path && m.contains(needle)),
            "no problem at {path} with {needle:?} in {paths:#?}"
        )
    };
    has("principals.control", "not \"control\"");
    has("principals.bad name", "1-128");
    has("principals.bad name.tokens[0]", "64 hex digits");
    has("principals.bad name.scopes[0]", "needs a tool id or glob");
    has("principals.bad name.scopes[1]", "own");
    has("principals.bad name.scopes[2]", "unknown scope");
    has("principals.empty", "at least one of tokens, subjects");
    has("principals.twin.tokens[0]", "another principal");
    has("principals.twin.colour", "unknown key");
}

#[test]
fn a_loose_file_is_refused_and_the_control_token_is_a_principal() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = std::env::temp_dir().join(format!("principals-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("principals.toml");
    std::fs::write(
        &path,
        entry("kernel-a", &token_hash("kernel-a-token-0123456789"), &["runs:*".into()]),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let e = Principals::load(&path, "control-token-0123456789").unwrap_err();
    assert!(e.to_string().contains("0600 or stricter"), "{e}");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let p = Principals::load(&path, "control-token-0123456789").unwrap();
    assert_eq!(&*p.by_token("control-token-0123456789").unwrap().name, CONTROL);
    assert_eq!(&*p.by_token("kernel-a-token-0123456789").unwrap().name, "kernel-a");
    assert!(p.by_token("control-token-0123456789").unwrap().recorded().is_none());
    std::fs::remove_dir_all(&dir).unwrap();
}
