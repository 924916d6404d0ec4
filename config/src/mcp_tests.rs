use super::*;
use crate::Config;
use serde_json::json;

fn rules(mcp: &str) -> Option<McpRules> {
    let text = format!("[tools.t]\n{mcp}\n");
    let c = Config::parse(&text, "t.toml").unwrap_or_else(|e| panic!("{e}"));
    c.policy.tool("t").unwrap().mcp.clone()
}

/// Every problem of `mcp` (the body of `[tools.t.mcp]`), one per line.
fn problems(mcp: &str) -> String {
    let text = format!("[tools.t.mcp]\n{mcp}\n");
    Config::parse(&text, "bad.toml").unwrap_err().to_string()
}

#[test]
fn absent_is_none_present_reads_every_list() {
    assert_eq!(rules(""), None);
    let r = rules(
        r#"[tools.t.mcp]
tools = ["git_status", "git_*", { name = "git_log", args = { "repo_path" = "/srv/repos/*", "max_count" = { min = 1, max = 100 } } }]
resources = ["file:///srv/repos/*"]
deny_tools = ["git_reset", { name = "git_log", args = { "options.force" = true } }]
deny_prompts = []
"#,
    )
    .unwrap();
    let tools = r.tools.allow.as_ref().unwrap();
    assert_eq!(tools.len(), 3);
    assert_eq!(tools[2].name.as_str(), "git_log");
    // Sorted by path.
    let paths: Vec<&[String]> = tools[2].args.iter().map(|a| a.path.as_slice()).collect();
    assert_eq!(paths, [["max_count".to_owned()], ["repo_path".to_owned()]]);
    assert_eq!(
        tools[2].args[0].matcher,
        Matcher::Range {
            min: Some(Num::Int(1)),
            max: Some(Num::Int(100))
        }
    );
    assert_eq!(r.tools.deny[1].args[0].path, ["options", "force"]);
    assert_eq!(r.resources.allow.as_ref().unwrap().len(), 1);
    assert_eq!(r.prompts.allow, None);
    assert!(r.prompts.deny.is_empty());
    // An empty table is rules that allow everything, not no rules.
    assert_eq!(rules("[tools.t.mcp]\n"), Some(McpRules::default()));
}

#[test]
fn globs_match_any_run_and_nothing_else() {
    let cases = [
        ("git_*", "git_", true),
        ("git_*", "git_status", true),
        ("git_*", "git", false),
        ("*", "", true),
        ("a*b*c", "abc", true),
        ("a*b*c", "a-b-b-c", true),
        ("a*b*c", "a-c-b", false),
        ("*ab", "ab", true),
        ("a*a", "a", false),
        ("a?c", "abc", false),
        ("a?c", "a?c", true),
        ("fetch", "\u{fb01}etch", false),
        ("*etch", "\u{fb01}etch", true),
        ("file:///srv/*", "file:///srv/a/b", true),
        ("Fetch", "fetch", false),
    ];
    for (pattern, text, want) in cases {
        assert_eq!(Glob::new(pattern).matches(text), want, "{pattern:?} ~ {text:?}");
    }
}

#[test]
fn numbers_compare_by_value() {
    let r = Matcher::Range {
        min: Some(Num::Int(1)),
        max: Some(Num::Float(2.5)),
    };
    for (v, want) in [
        (json!(1), true),
        (json!(1.0), true),
        (json!(2.5), true),
        (json!(2.6), false),
        (json!(0), false),
        (json!(u64::MAX), false),
        (json!("2"), false),
    ] {
        assert_eq!(r.matches(&v), want, "{v}");
    }
    assert!(Matcher::Number(Num::Int(5)).matches(&json!(5.0)));
    assert!(!Matcher::Number(Num::Int(-1)).matches(&json!(u64::MAX)));
    let big = Matcher::Range {
        min: Some(Num::Int(i64::MAX)),
        max: None,
    };
    assert!(big.matches(&json!(u64::MAX)));
    assert!(!big.matches(&json!(i64::MAX - 1)));
}

#[test]
fn a_deny_with_args_and_a_name_deny_are_told_apart() {
    let r =
        rules("[tools.t.mcp]\ntools = [\"a*\"]\ndeny_tools = [\"ab\", { name = \"ac\", args = { \"x.y\" = 1 } }]\n")
            .unwrap();
    let t = &r.tools;
    assert_eq!(t.check("ab", None), McpMatch::NameDenied);
    assert_eq!(t.check("ac", Some(&json!({"x": {"y": 1}}))), McpMatch::ArgumentsDenied);
    assert_eq!(t.check("ac", Some(&json!({"x": {"y": 2}}))), McpMatch::Allowed);
    assert_eq!(t.check("b", None), McpMatch::NameNotAllowed);
    assert!(!t.may_list("ab"));
    assert!(t.may_list("ac"));
    assert!(!t.may_list("b"));
}

#[test]
fn digest_counts_the_rules_not_their_order() {
    let digest = |text: &str| Config::parse(text, "t").unwrap().policy.digest.clone();
    let none = digest("[tools.t]\n");
    let a = digest("[tools.t.mcp]\ntools = [\"a\", \"b\"]\n");
    let b = digest("[tools.t.mcp]\ntools = [\"b\", \"a\"]\n");
    let c = digest("[tools.t.mcp]\ntools = [\"a\"]\n");
    let all = digest("[tools.t.mcp]\n");
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_ne!(none, all);
    assert_ne!(all, digest("[tools.t.mcp]\ntools = []\n"));
}

#[test]
fn every_problem_is_named_by_its_key_path() {
    let e = problems(
        r#"tools = [3, { name = "x", args = { "a..b" = 1, ".a" = 1, "r" = { min = 5, max = 1 }, "q" = { min = "1" }, "n" = { }, "o" = { mn = 1, max = 2 }, "d" = [], "e" = [[1]], "f" = [{ min = 1 }] } }, { args = { "a" = 1 } }, { name = "y", color = "red" }, ""]
resources = [{ name = "file:///*", args = { "a" = 1 } }]
deny_prompts = "x"
other = 1
"#,
    );
    for want in [
        "tools.t.mcp.tools[0]: must be a name",
        "tools.t.mcp.tools[1].args.\"a..b\": an argument path is object keys joined by single dots",
        "tools.t.mcp.tools[1].args.\".a\": an argument path",
        "tools.t.mcp.tools[1].args.\"r\": min is above max",
        "tools.t.mcp.tools[1].args.\"q\".min: must be a number, not string",
        "tools.t.mcp.tools[1].args.\"n\": a range needs min, max or both",
        "tools.t.mcp.tools[1].args.\"o\".mn: unknown key (expected one of: max, min)",
        "tools.t.mcp.tools[1].args.\"d\": must list at least one value",
        "tools.t.mcp.tools[1].args.\"e\"[0]: must be a string, a bool or a number, not array",
        "tools.t.mcp.tools[1].args.\"f\"[0]: must be a string, a bool or a number, not table",
        "tools.t.mcp.tools[2].name: is required",
        "tools.t.mcp.tools[3].color: unknown key",
        "tools.t.mcp.tools[4]: must not be empty",
        "tools.t.mcp.resources[0].args: a resource is read by its URI alone",
        "tools.t.mcp.deny_prompts: invalid type",
        "tools.t.mcp.other: unknown key",
    ] {
        assert!(e.contains(want), "missing {want:?} in:\n{e}");
    }
}

#[test]
fn lists_args_and_paths_are_bounded() {
    let many = vec!["\"t\""; MAX_ENTRIES + 1].join(", ");
    let e = problems(&format!("tools = [{many}]\n"));
    assert!(e.contains("tools.t.mcp.tools: has 1025 entries; at most 1024"), "{e}");
    assert_eq!(
        rules(&format!(
            "[tools.t.mcp]\ntools = [{}]\n",
            vec!["\"t\""; MAX_ENTRIES].join(", ")
        ))
        .unwrap()
        .tools
        .allow
        .unwrap()
        .len(),
        MAX_ENTRIES
    );
    let args: Vec<String> = (0..=MAX_ARGS).map(|i| format!("\"a{i}\" = 1")).collect();
    let e = problems(&format!(
        "tools = [{{ name = \"x\", args = {{ {} }} }}]\n",
        args.join(", ")
    ));
    assert!(
        e.contains("tools.t.mcp.tools[0].args: has 65 matchers; at most 64"),
        "{e}"
    );
    let deep = vec!["k"; MAX_PATH_SEGMENTS + 1].join(".");
    let e = problems(&format!(
        "deny_tools = [{{ name = \"x\", args = {{ \"{deep}\" = 1 }} }}]\n"
    ));
    assert!(e.contains("has 17 keys; at most 16"), "{e}");
    let ok = vec!["k"; MAX_PATH_SEGMENTS].join(".");
    assert!(rules(&format!(
        "[tools.t.mcp]\ntools = [{{ name = \"x\", args = {{ \"{ok}\" = 1 }} }}]\n"
    ))
    .is_some());
    let e = problems("tools = [{ name = \"x\", args = {} }]\nprompts = [{ name = \"p\", args = 3 }]\n");
    assert!(
        e.contains("tools.t.mcp.tools[0].args: must name at least one argument"),
        "{e}"
    );
    assert!(e.contains("tools.t.mcp.prompts[0].args: must be a table"), "{e}");
    let e = problems("tools = [{ name = \"x\", args = { \"a\" = nan, \"b\" = { max = inf } } }]\n");
    assert!(e.contains("args.\"a\": must be a finite number"), "{e}");
    assert!(e.contains("args.\"b\".max: must be a finite number"), "{e}");
}
