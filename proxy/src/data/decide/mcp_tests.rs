use super::*;
use egress_config::Config;

/// The rules of the issue's example.
const GIT: &str = r#"
tools = ["git_status", "git_diff*", { name = "git_log", args = { "repo_path" = "/srv/repos/*", "max_count" = { min = 1, max = 100 } } },
         { name = "git_show", args = { "format" = ["short", "full"], "color" = false, "options.depth" = { max = 3 } } },
         { name = "git_show", args = { "format" = "raw*" } }]
resources = ["file:///srv/repos/*"]
prompts = ["summarize", { name = "review", args = { "style" = "brief" } }]
deny_tools = ["git_diff_secret", { name = "git_log", args = { "options.force" = true } }]
deny_resources = ["file:///srv/repos/private/*"]
deny_prompts = ["summarize_all"]
"#;

/// Only denials: every other name allowed.
const DENY_ONLY: &str = r#"deny_tools = ["rm*"]"#;

/// Nothing of any kind allowed.
const NONE: &str = "tools = []\nresources = []\nprompts = []";

/// No `[tools.<id>.mcp]` at all.
const ABSENT: &str = "<absent>";

const OK: &str = "allowed";
const TOOL: &str = "mcp_tool_not_allowed";
const ARGS: &str = "mcp_arguments_not_allowed";
const RESOURCE: &str = "mcp_resource_not_allowed";
const PROMPT: &str = "mcp_prompt_not_allowed";

/// (rules, method, name, arguments as JSON ("" for none), the outcome).
#[rustfmt::skip]
const CASES: &[(&str, &str, Option<&str>, &str, &str)] = &[
    // Names: exact and glob.
    (GIT, "tools/call", Some("git_status"), "", OK),
    (GIT, "tools/call", Some("git_status2"), "", TOOL),
    (GIT, "tools/call", Some("GIT_STATUS"), "", TOOL),
    (GIT, "tools/call", Some("git_diff"), "", OK),
    (GIT, "tools/call", Some("git_diff_cached"), "{}", OK),
    (GIT, "tools/call", Some("git_push"), "", TOOL),
    (GIT, "tools/call", None, "", TOOL),
    (GIT, "tools/call", Some(""), "", TOOL),
    // Deny wins over an allow glob.
    (GIT, "tools/call", Some("git_diff_secret"), "", TOOL),
    // Arguments: glob, bounds, present.
    (GIT, "tools/call", Some("git_log"), r#"{"repo_path": "/srv/repos/a", "max_count": 10}"#, OK),
    (GIT, "tools/call", Some("git_log"), r#"{"repo_path": "/srv/repos/", "max_count": 1}"#, OK),
    (GIT, "tools/call", Some("git_log"), r#"{"repo_path": "/etc/passwd", "max_count": 10}"#, ARGS),
    (GIT, "tools/call", Some("git_log"), r#"{"repo_path": "/srv/repos/a", "max_count": 101}"#, ARGS),
    (GIT, "tools/call", Some("git_log"), r#"{"repo_path": "/srv/repos/a", "max_count": 0}"#, ARGS),
    (GIT, "tools/call", Some("git_log"), r#"{"repo_path": "/srv/repos/a", "max_count": 100.0}"#, OK),
    (GIT, "tools/call", Some("git_log"), r#"{"repo_path": "/srv/repos/a", "max_count": "10"}"#, ARGS),
    (GIT, "tools/call", Some("git_log"), r#"{"repo_path": ["/srv/repos/a"], "max_count": 10}"#, ARGS),
    // A missing argument does not match; extra arguments do not matter.
    (GIT, "tools/call", Some("git_log"), r#"{"repo_path": "/srv/repos/a"}"#, ARGS),
    (GIT, "tools/call", Some("git_log"), r#"{"repo_path": "/srv/repos/a", "max_count": 5, "extra": 1}"#, OK),
    (GIT, "tools/call", Some("git_log"), "", ARGS),
    // Non-object arguments where an entry needs them.
    (GIT, "tools/call", Some("git_log"), r#"["/srv/repos/a", 10]"#, ARGS),
    (GIT, "tools/call", Some("git_log"), r#""/srv/repos/a""#, ARGS),
    (GIT, "tools/call", Some("git_log"), "null", ARGS),
    // A deny entry with args: its arguments refused, by a nested path.
    (GIT, "tools/call", Some("git_log"), r#"{"repo_path": "/srv/repos/a", "max_count": 5, "options": {"force": true}}"#, ARGS),
    (GIT, "tools/call", Some("git_log"), r#"{"repo_path": "/srv/repos/a", "max_count": 5, "options": {"force": false}}"#, OK),
    (GIT, "tools/call", Some("git_log"), r#"{"repo_path": "/srv/repos/a", "max_count": 5, "options": {"force": "true"}}"#, OK),
    (GIT, "tools/call", Some("git_log"), r#"{"repo_path": "/srv/repos/a", "max_count": 5, "options.force": true}"#, OK),
    // One of, bool, nested bounds; several entries for one name add up.
    (GIT, "tools/call", Some("git_show"), r#"{"format": "short", "color": false, "options": {"depth": 3}}"#, OK),
    (GIT, "tools/call", Some("git_show"), r#"{"format": "full", "color": false, "options": {"depth": -1.5}}"#, OK),
    (GIT, "tools/call", Some("git_show"), r#"{"format": "long", "color": false, "options": {"depth": 1}}"#, ARGS),
    (GIT, "tools/call", Some("git_show"), r#"{"format": "short", "color": true, "options": {"depth": 1}}"#, ARGS),
    (GIT, "tools/call", Some("git_show"), r#"{"format": "short", "color": false, "options": {"depth": 4}}"#, ARGS),
    (GIT, "tools/call", Some("git_show"), r#"{"format": "short", "color": false, "options": 3}"#, ARGS),
    (GIT, "tools/call", Some("git_show"), r#"{"format": "rawest"}"#, OK),
    // Resources: URIs by glob, deny wins; subscribe as read.
    (GIT, "resources/read", Some("file:///srv/repos/a/README"), "", OK),
    (GIT, "resources/subscribe", Some("file:///srv/repos/a/README"), "", OK),
    (GIT, "resources/read", Some("file:///etc/passwd"), "", RESOURCE),
    (GIT, "resources/read", Some("file:///srv/repos/private/key"), "", RESOURCE),
    (GIT, "resources/subscribe", Some("file:///srv/repos/private/key"), "", RESOURCE),
    (GIT, "resources/read", None, "", RESOURCE),
    // Prompts: names, their arguments, deny.
    (GIT, "prompts/get", Some("summarize"), r#"{"anything": "x"}"#, OK),
    (GIT, "prompts/get", Some("summarize_all"), "", PROMPT),
    (GIT, "prompts/get", Some("translate"), "", PROMPT),
    (GIT, "prompts/get", Some("review"), r#"{"style": "brief"}"#, OK),
    (GIT, "prompts/get", Some("review"), r#"{"style": "long"}"#, ARGS),
    (GIT, "prompts/get", None, "", PROMPT),
    // Methods that are not decided are allowed, whatever they carry.
    (GIT, "initialize", None, r#"{"protocolVersion": "2025-11-25"}"#, OK),
    (GIT, "ping", None, "", OK),
    (GIT, "tools/list", None, "", OK),
    (GIT, "notifications/initialized", None, "", OK),
    (GIT, "completion/complete", Some("git_push"), "", OK),
    (NONE, "resources/unsubscribe", Some("file:///x"), "", OK),
    (NONE, "logging/setLevel", None, "", OK),
    // Methods are compared exactly.
    (NONE, "Tools/Call", Some("x"), "", OK),
    // `[]` allows none; an absent list allows all, deny aside.
    (NONE, "tools/call", Some("git_status"), "", TOOL),
    (NONE, "resources/read", Some("file:///srv/repos/a"), "", RESOURCE),
    (NONE, "prompts/get", Some("summarize"), "", PROMPT),
    (DENY_ONLY, "tools/call", Some("anything"), r#"{"a": 1}"#, OK),
    (DENY_ONLY, "tools/call", Some("rm_rf"), "", TOOL),
    (DENY_ONLY, "resources/read", Some("file:///anything"), "", OK),
    (DENY_ONLY, "prompts/get", Some("any"), "", OK),
    (DENY_ONLY, "tools/call", None, "", TOOL),
    // No rules at all: everything, even a call that names nothing.
    (ABSENT, "tools/call", Some("rm_rf"), "", OK),
    (ABSENT, "tools/call", None, "", OK),
    // No normalization: a ligature is another name.
    ("tools = [\"fetch\"]", "tools/call", Some("fetch"), "", OK),
    ("tools = [\"fetch\"]", "tools/call", Some("\u{fb01}etch"), "", TOOL),
    ("tools = [\"fetch\"]", "tools/call", Some("fetch\u{200b}"), "", TOOL),
    ("deny_tools = [\"fetch\"]", "tools/call", Some("\u{fb01}etch"), "", OK),
    ("tools = [\"caf\u{e9}\"]", "tools/call", Some("cafe\u{301}"), "", TOOL),
    ("tools = [\"\u{1f527}_*\"]", "tools/call", Some("\u{1f527}_fix"), "", OK),
];

fn rules(snippet: &str) -> Option<McpRules> {
    if snippet == ABSENT {
        return None;
    }
    let text = format!("[tools.t]\n[tools.t.mcp]\n{snippet}\n");
    let c = Config::parse(&text, "t.toml").unwrap_or_else(|e| panic!("{e}\n{text}"));
    let t = c.policy.tool("t").unwrap();
    Some(t.mcp.clone().expect("[tools.t.mcp] read"))
}

fn call(method: &str, name: Option<&str>, args: &str) -> McpCall {
    McpCall {
        method: method.to_owned(),
        name: name.map(str::to_owned),
        arguments: (!args.is_empty()).then(|| serde_json::from_str(args).unwrap()),
    }
}

#[test]
fn the_table() {
    assert!(CASES.len() >= 30);
    let mut failed = vec![];
    for (i, &(snippet, method, name, args, want)) in CASES.iter().enumerate() {
        let r = rules(snippet);
        let got = match decide(r.as_ref(), &call(method, name, args)) {
            Ok(()) => OK,
            Err(refusal) => refusal.reason.code(),
        };
        if got != want {
            failed.push(format!("case {i}: {method} {name:?} {args} -> {got}, want {want}"));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

#[test]
fn messages_name_the_call_and_the_step_never_the_arguments() {
    let r = rules(GIT);
    let msg = |method, name, args| decide(r.as_ref(), &call(method, name, args)).unwrap_err().message;
    let secret = r#"{"repo_path": "/srv/repos/a", "max_count": 5, "options": {"force": true, "token": "s3cr3t"}}"#;
    let cases = [
        (
            msg("tools/call", Some("git_push"), ""),
            "MCP tool \"git_push\" is not allowed: no tools entry names it",
        ),
        (
            msg("tools/call", Some("git_diff_secret"), ""),
            "MCP tool \"git_diff_secret\" is denied by a deny_tools rule",
        ),
        (
            msg("tools/call", Some("git_log"), secret),
            "MCP tool \"git_log\": these arguments are denied by a deny_tools rule",
        ),
        (
            msg("tools/call", Some("git_log"), r#"{"repo_path": "/etc/s3cr3t"}"#),
            "MCP tool \"git_log\": these arguments are not allowed: no tools entry for it matches them",
        ),
        (msg("tools/call", None, ""), "MCP tools/call names no tool: refused"),
        (
            msg("resources/read", Some("file:///etc/passwd"), ""),
            "MCP resource \"file:///etc/passwd\" is not allowed: no resources entry names it",
        ),
        (
            msg("prompts/get", Some("summarize_all"), ""),
            "MCP prompt \"summarize_all\" is denied by a deny_prompts rule",
        ),
    ];
    for (got, want) in cases {
        assert_eq!(got, want);
        assert!(!got.contains("s3cr3t"), "{got}");
    }
    // A long or odd name is quoted, escaped and cut.
    let long = format!("x\n{}", "y".repeat(500));
    let m = msg("tools/call", Some(&long), "");
    assert!(
        m.starts_with("MCP tool \"x\\nyyy") && m.contains("...") && m.len() < 250,
        "{m}"
    );
}

#[test]
fn list_answers_keep_what_some_call_could_use() {
    let git = rules(GIT);
    let deny_only = rules(DENY_ONLY);
    let none = rules(NONE);
    let cases: &[(&Option<McpRules>, McpListKind, &str, bool)] = &[
        (&git, McpListKind::Tools, "git_status", true),
        (&git, McpListKind::Tools, "git_diff_staged", true),
        // Allowed with some arguments only: still listed.
        (&git, McpListKind::Tools, "git_log", true),
        (&git, McpListKind::Tools, "git_diff_secret", false),
        (&git, McpListKind::Tools, "git_push", false),
        (&git, McpListKind::Resources, "file:///srv/repos/a", true),
        (&git, McpListKind::Resources, "file:///srv/repos/private/a", false),
        (&git, McpListKind::Resources, "file:///etc/passwd", false),
        (&git, McpListKind::Prompts, "review", true),
        (&git, McpListKind::Prompts, "summarize_all", false),
        (&deny_only, McpListKind::Tools, "ls", true),
        (&deny_only, McpListKind::Tools, "rm", false),
        (&deny_only, McpListKind::Prompts, "p", true),
        (&none, McpListKind::Tools, "ls", false),
        (&none, McpListKind::Resources, "file:///a", false),
        (&None, McpListKind::Tools, "rm", true),
    ];
    for (r, kind, name, want) in cases {
        assert_eq!(keep_listed(r.as_ref(), *kind, name), *want, "{kind:?} {name}");
    }
}

#[test]
fn the_arguments_digest_is_canonical() {
    let v = |s: &str| serde_json::from_str::<Value>(s).unwrap();
    let a = arguments_digest(Some(&v(r#"{"b": 1, "a": {"y": [1, "x"], "x": null}}"#)));
    let b = arguments_digest(Some(&v(r#"{ "a": {"x": null, "y": [1, "x"]}, "b": 1 }"#)));
    assert_eq!(a, b);
    assert!(a.starts_with("sha256:") && a.len() == 7 + 64, "{a}");
    // Array order, values and types count.
    for other in [
        r#"{"b": 1, "a": {"y": ["x", 1], "x": null}}"#,
        r#"{"b": "1", "a": {"y": [1, "x"], "x": null}}"#,
        r#"{"b": 1, "a": {"y": [1, "x"]}}"#,
    ] {
        assert_ne!(a, arguments_digest(Some(&v(other))), "{other}");
    }
    // Absent arguments are the empty text; an empty object is not.
    assert_eq!(
        arguments_digest(None),
        "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
    assert_ne!(arguments_digest(None), arguments_digest(Some(&v("{}"))));
    // The canonical text itself: sorted keys, no spaces, JSON escapes.
    let mut text = String::new();
    canonical(&v("{\"z\": \"\\u00e9\\n\", \"a\": [true, 1.5, -2]}"), &mut text);
    assert_eq!(text, "{\"a\":[true,1.5,-2],\"z\":\"\u{e9}\\n\"}");
}
