//! `[tools.<id>.mcp]`: which MCP tools, resources and prompts a confined MCP
//! server may be asked for, and with which arguments. This module reads and
//! bounds the rules and matches a name and its arguments against them
//! (pure); the proxy's decider (`proxy/src/data/decide/mcp.rs`) turns a
//! match into a deny reason and a message.
//!
//! Absent `[tools.<id>.mcp]`: no MCP rules, every call allowed. Present:
//! each of `tools`, `resources`, `prompts` that is absent allows every name
//! of its kind, `[]` allows none; `deny_*` entries win over every allow. A
//! call is allowed when no deny entry matches it and (its allow list is
//! absent, or some allow entry matches its name and all of that entry's
//! argument matchers). Names are compared as written, byte for byte: no
//! case folding, no Unicode normalization.

use crate::reader::{Problems, Section};
use serde_json::{Number, Value};
use std::cmp::Ordering;

/// At most this many entries in one list (`tools`, `deny_tools`, ...).
pub const MAX_ENTRIES: usize = 1024;
/// At most this many argument matchers in one entry.
pub const MAX_ARGS: usize = 64;
/// At most this many segments in one argument path (`a.b.c` has three).
pub const MAX_PATH_SEGMENTS: usize = 16;

/// A name or text pattern: `*` matches any run of characters (none
/// included); every other character, `?` too, matches itself. Without `*`
/// it is an exact name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Glob {
    written: String,
}

impl Glob {
    pub fn new(pattern: &str) -> Glob {
        Glob {
            written: pattern.to_owned(),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.written
    }

    /// Whether `text` matches, in time linear in both lengths (no
    /// backtracking: the pieces between stars are found left to right).
    pub fn matches(&self, text: &str) -> bool {
        let mut pieces = self.written.split('*');
        let first = pieces.next().unwrap_or_default();
        let Some(mut rest) = text.strip_prefix(first) else {
            return false;
        };
        let middle: Vec<&str> = pieces.collect();
        let Some((last, middle)) = middle.split_last() else {
            // No star: exact.
            return rest.is_empty();
        };
        for piece in middle {
            match rest.find(piece) {
                Some(at) => rest = &rest[at + piece.len()..],
                None => return false,
            }
        }
        rest.len() >= last.len() && rest.ends_with(last)
    }
}

/// A number as written in the rules.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Num {
    Int(i64),
    Float(f64),
}

impl Num {
    /// How a JSON number compares with this one (`None`: not comparable).
    fn compare(self, n: &Number) -> Option<Ordering> {
        match self {
            Num::Int(b) => {
                if let Some(v) = n.as_i64() {
                    Some(v.cmp(&b))
                } else if n.as_u64().is_some() {
                    // Above i64::MAX, so above every integer bound.
                    Some(Ordering::Greater)
                } else {
                    n.as_f64()?.partial_cmp(&(b as f64))
                }
            }
            Num::Float(b) => n.as_f64()?.partial_cmp(&b),
        }
    }
}

/// What an argument must be.
#[derive(Debug, Clone, PartialEq)]
pub enum Matcher {
    /// A string argument matching the pattern.
    Text(Glob),
    Bool(bool),
    /// A number equal to this one (`5` and `5.0` are equal).
    Number(Num),
    /// Any of these (scalars only).
    OneOf(Vec<Matcher>),
    /// A number within the bounds, inclusive; at least one is set.
    Range {
        min: Option<Num>,
        max: Option<Num>,
    },
}

impl Matcher {
    pub fn matches(&self, v: &Value) -> bool {
        match (self, v) {
            (Matcher::Text(g), Value::String(s)) => g.matches(s),
            (Matcher::Bool(b), Value::Bool(v)) => b == v,
            (Matcher::Number(b), Value::Number(n)) => b.compare(n) == Some(Ordering::Equal),
            (Matcher::OneOf(ms), v) => ms.iter().any(|m| m.matches(v)),
            (Matcher::Range { min, max }, Value::Number(n)) => {
                min.is_none_or(|b| matches!(b.compare(n), Some(Ordering::Greater | Ordering::Equal)))
                    && max.is_none_or(|b| matches!(b.compare(n), Some(Ordering::Less | Ordering::Equal)))
            }
            _ => false,
        }
    }
}

/// One argument matcher: the argument at `path` (object keys, outermost
/// first) must be present and match.
#[derive(Debug, Clone, PartialEq)]
pub struct ArgRule {
    pub path: Vec<String>,
    pub matcher: Matcher,
}

impl ArgRule {
    pub fn matches(&self, args: Option<&Value>) -> bool {
        let mut at = args;
        for key in &self.path {
            at = match at {
                Some(Value::Object(m)) => m.get(key),
                _ => None,
            };
        }
        at.is_some_and(|v| self.matcher.matches(v))
    }
}

/// One entry of a list: a name pattern and the arguments it requires
/// (none: any arguments).
#[derive(Debug, Clone, PartialEq)]
pub struct McpEntry {
    pub name: Glob,
    /// Sorted by path.
    pub args: Vec<ArgRule>,
}

impl McpEntry {
    pub fn matches(&self, name: &str, args: Option<&Value>) -> bool {
        self.name.matches(name) && self.args.iter().all(|a| a.matches(args))
    }
}

/// The rules of one kind (tools, resources or prompts).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct McpList {
    /// `None`: every name allowed (the key is absent); `Some([])`: none.
    pub allow: Option<Vec<McpEntry>>,
    pub deny: Vec<McpEntry>,
}

/// How a name and its arguments fare against one [`McpList`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum McpMatch {
    Allowed,
    /// A deny entry without arguments matches the name.
    NameDenied,
    /// A deny entry with arguments matches the name and the arguments.
    ArgumentsDenied,
    /// No allow entry matches the name.
    NameNotAllowed,
    /// Allow entries match the name, none the arguments.
    ArgumentsNotAllowed,
}

impl McpList {
    pub fn check(&self, name: &str, args: Option<&Value>) -> McpMatch {
        if self.deny.iter().any(|e| e.args.is_empty() && e.name.matches(name)) {
            return McpMatch::NameDenied;
        }
        if self.deny.iter().any(|e| !e.args.is_empty() && e.matches(name, args)) {
            return McpMatch::ArgumentsDenied;
        }
        let Some(allow) = &self.allow else {
            return McpMatch::Allowed;
        };
        let mut named = allow.iter().filter(|e| e.name.matches(name)).peekable();
        if named.peek().is_none() {
            return McpMatch::NameNotAllowed;
        }
        if named.any(|e| e.args.iter().all(|a| a.matches(args))) {
            McpMatch::Allowed
        } else {
            McpMatch::ArgumentsNotAllowed
        }
    }

    /// Whether some call to `name` could be allowed: no deny entry without
    /// arguments matches it, and an allow entry does (or there is no list).
    pub fn may_list(&self, name: &str) -> bool {
        !self.deny.iter().any(|e| e.args.is_empty() && e.name.matches(name))
            && self
                .allow
                .as_ref()
                .is_none_or(|a| a.iter().any(|e| e.name.matches(name)))
    }
}

/// `[tools.<id>.mcp]`, read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct McpRules {
    pub tools: McpList,
    pub resources: McpList,
    pub prompts: McpList,
}

impl McpRules {
    /// The canonical text of the rules, one line per list, for the policy
    /// digest: entries sorted, so their order in the file does not count.
    pub fn canonical(&self) -> String {
        let mut out = String::new();
        for (kind, list) in [
            ("tools", &self.tools),
            ("resources", &self.resources),
            ("prompts", &self.prompts),
        ] {
            let sorted = |v: &[McpEntry]| {
                let mut s: Vec<String> = v.iter().map(|e| format!("{e:?}")).collect();
                s.sort();
                s
            };
            let allow = list.allow.as_deref().map(sorted);
            out.push_str(&format!("mcp {kind} allow={allow:?} deny={:?}\n", sorted(&list.deny)));
        }
        out
    }
}

/// Reads `[tools.<id>.mcp]` of the tool section `s`, if present.
pub(crate) fn read(s: &mut Section) -> Option<McpRules> {
    let mut t = s.optional_table("mcp")?;
    let tools = McpList {
        allow: entries(&mut t, "tools", true),
        deny: entries(&mut t, "deny_tools", true).unwrap_or_default(),
    };
    let resources = McpList {
        allow: entries(&mut t, "resources", false),
        deny: entries(&mut t, "deny_resources", false).unwrap_or_default(),
    };
    let prompts = McpList {
        allow: entries(&mut t, "prompts", true),
        deny: entries(&mut t, "deny_prompts", true).unwrap_or_default(),
    };
    t.finish();
    Some(McpRules {
        tools,
        resources,
        prompts,
    })
}

/// The entries of one list, if its key is present.
fn entries(s: &mut Section, key: &'static str, takes_args: bool) -> Option<Vec<McpEntry>> {
    let items = s.list::<toml::Value>(key)?;
    if items.len() > MAX_ENTRIES {
        let at = s.at(key);
        s.problems
            .push(at, format!("has {} entries; at most {MAX_ENTRIES}", items.len()));
    }
    let read = items
        .into_iter()
        .take(MAX_ENTRIES)
        .filter_map(|(at, v)| entry(at, v, takes_args, s.problems))
        .collect();
    Some(read)
}

/// An entry: `"name"` or `{ name = "...", args = { "<path>" = <matcher> } }`.
fn entry(at: String, v: toml::Value, takes_args: bool, p: &mut Problems) -> Option<McpEntry> {
    match v {
        toml::Value::String(n) => Some(McpEntry {
            name: name(&at, &n, p)?,
            args: vec![],
        }),
        toml::Value::Table(_) => {
            let mut t = Section::new(at.clone(), Some(v), p);
            let n: Option<String> = t.required("name", "a name, or a pattern with *");
            let args = if takes_args {
                args(&mut t)
            } else {
                if t.has("args") {
                    let at = t.at("args");
                    t.take("args");
                    t.problems
                        .push(at, "a resource is read by its URI alone: it takes no args");
                }
                vec![]
            };
            t.finish();
            let name = name(&format!("{at}.name"), &n?, p)?;
            Some(McpEntry { name, args })
        }
        other => {
            p.push(
                at,
                format!(
                    r#"must be a name (or a pattern with *) or {{ name = "...", args = {{ "<path>" = <matcher> }} }}, not {}"#,
                    other.type_str()
                ),
            );
            None
        }
    }
}

fn name(at: &str, n: &str, p: &mut Problems) -> Option<Glob> {
    if n.is_empty() {
        p.push(at, "must not be empty");
        return None;
    }
    Some(Glob::new(n))
}

/// `args = { "<dotted.path>" = <matcher>, ... }`, sorted by path.
fn args(t: &mut Section) -> Vec<ArgRule> {
    let at = t.at("args");
    let Some(v) = t.take("args") else {
        return vec![];
    };
    let toml::Value::Table(table) = v else {
        t.problems.push(
            at,
            format!("must be a table of argument paths and matchers, not {}", v.type_str()),
        );
        return vec![];
    };
    if table.is_empty() {
        t.problems
            .push(&at, "must name at least one argument (leave args out to allow any)");
    }
    if table.len() > MAX_ARGS {
        t.problems
            .push(&at, format!("has {} matchers; at most {MAX_ARGS}", table.len()));
    }
    let mut out = vec![];
    for (key, v) in table.into_iter().take(MAX_ARGS) {
        let here = format!("{at}.{key:?}");
        let Some(path) = arg_path(&here, &key, t.problems) else {
            continue;
        };
        if let Some(matcher) = matcher(&here, v, true, t.problems) {
            out.push(ArgRule { path, matcher });
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

/// `a.b.c`: object keys, outermost first.
fn arg_path(at: &str, key: &str, p: &mut Problems) -> Option<Vec<String>> {
    let segments: Vec<String> = key.split('.').map(str::to_owned).collect();
    if segments.iter().any(String::is_empty) {
        p.push(
            at,
            "an argument path is object keys joined by single dots: no empty key, no \"..\", no leading or trailing dot",
        );
        return None;
    }
    if segments.len() > MAX_PATH_SEGMENTS {
        p.push(at, format!("has {} keys; at most {MAX_PATH_SEGMENTS}", segments.len()));
        return None;
    }
    Some(segments)
}

fn number(at: &str, v: &toml::Value, p: &mut Problems) -> Option<Num> {
    match v {
        toml::Value::Integer(i) => Some(Num::Int(*i)),
        toml::Value::Float(f) if f.is_finite() => Some(Num::Float(*f)),
        toml::Value::Float(_) => {
            p.push(at, "must be a finite number");
            None
        }
        other => {
            p.push(at, format!("must be a number, not {}", other.type_str()));
            None
        }
    }
}

/// A matcher: a string (a pattern), a bool or a number (equal), an array
/// of those (one of), or `{ min, max }`.
fn matcher(at: &str, v: toml::Value, top: bool, p: &mut Problems) -> Option<Matcher> {
    match v {
        toml::Value::String(s) => Some(Matcher::Text(Glob::new(&s))),
        toml::Value::Boolean(b) => Some(Matcher::Bool(b)),
        v @ (toml::Value::Integer(_) | toml::Value::Float(_)) => number(at, &v, p).map(Matcher::Number),
        toml::Value::Array(items) if top => {
            if items.is_empty() {
                p.push(at, "must list at least one value");
                return None;
            }
            let ms: Vec<Option<Matcher>> = items
                .into_iter()
                .enumerate()
                .map(|(i, v)| matcher(&format!("{at}[{i}]"), v, false, p))
                .collect();
            ms.into_iter().collect::<Option<Vec<_>>>().map(Matcher::OneOf)
        }
        toml::Value::Table(t) if top => range(at, t, p),
        other => {
            let what = if top {
                "a string, a bool, a number, an array of those, or { min, max }"
            } else {
                "a string, a bool or a number"
            };
            p.push(at, format!("must be {what}, not {}", other.type_str()));
            None
        }
    }
}

/// `{ min, max }`: at least one, `min` not above `max`.
fn range(at: &str, mut t: toml::Table, p: &mut Problems) -> Option<Matcher> {
    let mut ok = true;
    t.retain(|key, _| {
        let known = key == "min" || key == "max";
        if !known {
            p.push(
                format!("{at}.{key}"),
                "unknown key (expected one of: max, min); a nested argument is named by a dotted path \
                 in one quoted key: \"a.b\" = ...",
            );
            ok = false;
        }
        known
    });
    if t.is_empty() {
        p.push(at, "a range needs min, max or both");
        return None;
    }
    let mut r = Section::new(at, Some(toml::Value::Table(t)), p);
    let (min, max) = (r.take("min"), r.take("max"));
    let mut bound = |key: &str, v: Option<toml::Value>| {
        let n = number(&r.at(key), &v?, r.problems);
        ok &= n.is_some();
        n
    };
    let (min, max) = (bound("min", min), bound("max", max));
    r.finish();
    if let (Some(lo), Some(hi)) = (min, max) {
        let above = match (lo, hi) {
            (Num::Int(lo), Num::Int(hi)) => lo > hi,
            (lo, hi) => as_f64(lo) > as_f64(hi),
        };
        if above {
            p.push(at, "min is above max: nothing would match");
            ok = false;
        }
    }
    ok.then_some(Matcher::Range { min, max })
}

fn as_f64(n: Num) -> f64 {
    match n {
        Num::Int(i) => i as f64,
        Num::Float(f) => f,
    }
}

#[cfg(test)]
#[path = "mcp_tests.rs"]
mod tests;
