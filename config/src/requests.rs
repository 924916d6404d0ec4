//! Method and path rules of an allowlist entry (`methods`, `paths`): which
//! requests a host allows, decided on the request's **normal path**.
//!
//! Normalisation ([`normalise`]) is what every path rule sees and what the
//! proxy then sends, so the origin receives exactly the path that was
//! matched:
//!
//! - percent-escapes of unreserved characters (`A-Z a-z 0-9 - . _ ~`) are
//!   decoded, every other escape is kept (its hex upper-cased);
//! - dot-segments are resolved (`%2e%2e` is `..`); a `..` above the root is
//!   refused;
//! - refused outright, as ambiguous between servers: an encoded `/` or `\`
//!   (`%2f`, `%5c`), a raw `\`, an escape of a control character, escaped
//!   bytes that are not UTF-8 (overlong forms like `%c0%ae`), a bad escape,
//!   a fragment, a dot-segment with a `;` parameter (`..;`), a path that is
//!   not absolute;
//! - everything else is kept: case (matching is case-sensitive), empty
//!   segments (`//`), trailing dots and slashes, `;` parameters.
//!
//! A pattern ([`PathPattern`]) is itself a normal path, where `*` matches
//! within one segment (a segment that is just `*` matches one non-empty
//! segment) and a `**` segment matches any number of whole segments. The
//! query is never matched.

use std::fmt;

/// Why a request path has no normal form (the request is `bad_target`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("the path does not start with '/'")]
    NotAbsolute,
    #[error("a fragment ('#') is not part of a request path")]
    Fragment,
    #[error("a backslash in a path is read differently by different servers")]
    Backslash,
    #[error("an encoded '/' or '\\' in a path is read differently by different servers")]
    EncodedSeparator,
    #[error("a '%' must be followed by two hex digits")]
    BadEscape,
    #[error("an escaped control character")]
    Control,
    #[error("escaped bytes that are not UTF-8 (an overlong form?)")]
    NotUtf8,
    #[error("a dot-segment with a ';' parameter")]
    DotParameter,
    #[error("'..' goes above the root")]
    Escape,
}

/// The normal form of `path` (a request path without its query).
pub fn normalise(path: &str) -> Result<String, PathError> {
    if !path.starts_with('/') {
        return Err(PathError::NotAbsolute);
    }
    if path.contains('#') {
        return Err(PathError::Fragment);
    }
    if path.contains('\\') {
        return Err(PathError::Backslash);
    }
    let decoded = decode_unreserved(path)?;
    let mut out: Vec<&str> = Vec::new();
    let mut segs = decoded[1..].split('/').peekable();
    while let Some(seg) = segs.next() {
        let last = segs.peek().is_none();
        let bare = seg.split(';').next().unwrap_or("");
        match bare {
            "." | ".." if bare.len() != seg.len() => return Err(PathError::DotParameter),
            "." => {}
            ".." => {
                if out.pop().is_none() {
                    return Err(PathError::Escape);
                }
            }
            _ => {
                out.push(seg);
                continue;
            }
        }
        // `/a/b/.` and `/a/b/..` name directories: keep the trailing slash.
        if last {
            out.push("");
        }
    }
    let mut normal = String::with_capacity(decoded.len());
    for seg in &out {
        normal.push('/');
        normal.push_str(seg);
    }
    if normal.is_empty() {
        normal.push('/');
    }
    Ok(normal)
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// Decodes the escapes of unreserved characters; checks the others.
fn decode_unreserved(path: &str) -> Result<String, PathError> {
    if !path.contains('%') {
        return Ok(path.to_string());
    }
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    // Escaped bytes >= 0x80 in a row: they must decode to UTF-8.
    let mut high: Vec<u8> = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'%' {
            check_utf8(&mut high)?;
            let ch = path[i..].chars().next().unwrap_or('\u{fffd}');
            out.push(ch);
            i += ch.len_utf8();
            continue;
        }
        let (Some(h), Some(l)) = (
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) else {
            return Err(PathError::BadEscape);
        };
        let b = h << 4 | l;
        i += 3;
        if b >= 0x80 {
            high.push(b);
        } else {
            check_utf8(&mut high)?;
        }
        match b {
            b'/' | b'\\' => return Err(PathError::EncodedSeparator),
            0..=0x1f | 0x7f => return Err(PathError::Control),
            b if unreserved(b) => out.push(b as char),
            b => {
                out.push('%');
                out.push(
                    char::from_digit((b >> 4) as u32, 16)
                        .unwrap_or('0')
                        .to_ascii_uppercase(),
                );
                out.push(
                    char::from_digit((b & 0xf) as u32, 16)
                        .unwrap_or('0')
                        .to_ascii_uppercase(),
                );
            }
        }
    }
    check_utf8(&mut high)?;
    Ok(out)
}

fn check_utf8(high: &mut Vec<u8>) -> Result<(), PathError> {
    if !high.is_empty() {
        std::str::from_utf8(high).map_err(|_| PathError::NotUtf8)?;
        high.clear();
    }
    Ok(())
}

/// One `paths` pattern, e.g. `/repos/acme/*` or `/v1/**`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathPattern {
    text: String,
    segs: Vec<Seg>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Seg {
    /// A segment, `*` matching any run of characters within it.
    Glob(String),
    /// `**`: any number of whole segments.
    Any,
}

impl PathPattern {
    /// Parses a pattern: a normal path, with `*` within segments and `**`
    /// as whole segments only.
    pub fn parse(text: &str) -> Result<PathPattern, String> {
        if text.contains('?') {
            return Err(format!(
                "{text:?}: a path pattern does not match the query; leave out '?'"
            ));
        }
        let normal = normalise(text).map_err(|e| format!("{text:?}: {e}"))?;
        if normal != text {
            return Err(format!("{text:?} is not a normal path; write it as {normal:?}"));
        }
        let segs = text[1..]
            .split('/')
            .map(|s| match s {
                "**" => Ok(Seg::Any),
                s if s.contains("**") => Err(format!("{text:?}: '**' must be a whole segment")),
                s => Ok(Seg::Glob(s.to_string())),
            })
            .collect::<Result<_, _>>()?;
        Ok(PathPattern {
            text: text.to_string(),
            segs,
        })
    }

    /// Whether every path `other` matches, `self` matches too, as far as
    /// can be told from the patterns: the same pattern, or `self` a literal
    /// prefix ending in `/**` whose segments start `other` as written.
    /// Sound, not complete: `false` may still be a cover.
    pub fn covers(&self, other: &PathPattern) -> bool {
        if self == other {
            return true;
        }
        let Some((Seg::Any, prefix)) = self.segs.split_last() else {
            return false;
        };
        prefix.iter().all(|s| *s != Seg::Any)
            && other.segs.len() >= prefix.len()
            && other.segs[..prefix.len()] == *prefix
    }

    /// Whether the normal path `path` matches.
    pub fn matches(&self, path: &str) -> bool {
        let segs: Vec<&str> = path.strip_prefix('/').unwrap_or(path).split('/').collect();
        match_segs(&self.segs, &segs)
    }
}

impl fmt::Display for PathPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Wildcard matching with backtracking to the last star only: O(pattern ×
/// path) at worst, whatever the number of stars (a tool controls the path).
fn wildcard<P, T>(pat: &[P], s: &[T], star: impl Fn(&P) -> bool, one: impl Fn(&P, &T) -> bool) -> bool {
    let (mut p, mut i) = (0, 0);
    let mut back: Option<(usize, usize)> = None;
    while i < s.len() {
        if p < pat.len() && star(&pat[p]) {
            back = Some((p, i));
            p += 1;
        } else if p < pat.len() && one(&pat[p], &s[i]) {
            p += 1;
            i += 1;
        } else if let Some((bp, bi)) = back {
            p = bp + 1;
            i = bi + 1;
            back = Some((bp, bi + 1));
        } else {
            return false;
        }
    }
    pat[p..].iter().all(star)
}

fn match_segs(pat: &[Seg], path: &[&str]) -> bool {
    wildcard(
        pat,
        path,
        |p| *p == Seg::Any,
        |p, seg| match p {
            Seg::Glob(g) if g == "*" => !seg.is_empty(),
            Seg::Glob(g) => glob(g.as_bytes(), seg.as_bytes()),
            Seg::Any => false,
        },
    )
}

/// `*` matches any run of bytes (within one segment: no `/` reaches here).
fn glob(pat: &[u8], s: &[u8]) -> bool {
    wildcard(pat, s, |c| *c == b'*', |c, b| c == b)
}

/// The `methods` and `paths` of one allowlist entry (`None`: any).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Requests {
    pub methods: Option<Vec<String>>,
    pub paths: Option<Vec<PathPattern>>,
}

/// What the method and path rules of a host say of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Verdict {
    PathNotAllowed,
    MethodNotAllowed,
    Allowed,
}

impl Requests {
    /// This entry's verdict on `method` to the normal path `path`.
    pub fn verdict(&self, method: &str, path: &str) -> Verdict {
        if !self.paths.as_ref().is_none_or(|ps| ps.iter().any(|p| p.matches(path))) {
            Verdict::PathNotAllowed
        } else if !self.methods.as_ref().is_none_or(|ms| ms.iter().any(|m| m == method)) {
            Verdict::MethodNotAllowed
        } else {
            Verdict::Allowed
        }
    }
}

impl fmt::Display for Requests {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(ms) = &self.methods {
            write!(f, " methods={}", ms.join(","))?;
        }
        if let Some(ps) = &self.paths {
            let ps: Vec<&str> = ps.iter().map(|p| p.text.as_str()).collect();
            write!(f, " paths={}", ps.join(","))?;
        }
        Ok(())
    }
}

/// The verdict of several entries on one request: any entry allowing it
/// allows it; otherwise `method_not_allowed` when some entry lists the path.
pub fn verdict<'a>(entries: impl IntoIterator<Item = &'a Requests>, method: &str, path: &str) -> Verdict {
    entries
        .into_iter()
        .map(|r| r.verdict(method, path))
        .max()
        .unwrap_or(Verdict::PathNotAllowed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_forms() {
        for (raw, want) in [
            ("/", Ok("/")),
            ("/user", Ok("/user")),
            ("/repos/acme/x", Ok("/repos/acme/x")),
            // Dot-segments, plain and escaped.
            ("/repos/acme/../admin", Ok("/repos/admin")),
            ("/repos/acme/%2e%2e/admin", Ok("/repos/admin")),
            ("/repos/acme/%2E%2E/%2e/admin", Ok("/repos/admin")),
            ("/repos/./acme/x", Ok("/repos/acme/x")),
            ("/repos/acme/x/.", Ok("/repos/acme/x/")),
            ("/repos/acme/x/..", Ok("/repos/acme/")),
            ("/..", Err(PathError::Escape)),
            ("/a/../..", Err(PathError::Escape)),
            ("/%2e%2e/etc", Err(PathError::Escape)),
            // Unreserved escapes decoded, others kept upper-cased.
            ("/%7euser/%41b", Ok("/~user/Ab")),
            ("/a%20b/%3f/%3B", Ok("/a%20b/%3F/%3B")),
            ("/caf%C3%A9", Ok("/caf%C3%A9")),
            // Separators and ambiguity refused.
            ("/repos%2facme", Err(PathError::EncodedSeparator)),
            ("/repos%2Facme", Err(PathError::EncodedSeparator)),
            ("/repos%5cacme", Err(PathError::EncodedSeparator)),
            ("/repos\\acme", Err(PathError::Backslash)),
            ("/%c0%ae%c0%ae/admin", Err(PathError::NotUtf8)),
            ("/%e0%80%ae", Err(PathError::NotUtf8)),
            ("/%c3", Err(PathError::NotUtf8)),
            ("/a%zz", Err(PathError::BadEscape)),
            ("/a%4", Err(PathError::BadEscape)),
            ("/a%00b", Err(PathError::Control)),
            ("/a#frag", Err(PathError::Fragment)),
            ("/repos/acme/..;/admin", Err(PathError::DotParameter)),
            ("/repos/acme/.;x/admin", Err(PathError::DotParameter)),
            ("*", Err(PathError::NotAbsolute)),
            ("repos", Err(PathError::NotAbsolute)),
            // Kept: empty segments, case, trailing dots, parameters.
            ("//repos//acme", Ok("//repos//acme")),
            ("/Repos/ACME", Ok("/Repos/ACME")),
            ("/user.", Ok("/user.")),
            ("/user;v=1", Ok("/user;v=1")),
        ] {
            assert_eq!(normalise(raw).as_deref().map_err(Clone::clone), want, "{raw}");
        }
    }

    #[test]
    fn normal_forms_are_fixed_points() {
        for raw in ["/a/./b/../c/", "/%7e/%2e/x", "//a//b/..", "/a%20b"] {
            let n = normalise(raw).unwrap();
            assert_eq!(normalise(&n).unwrap(), n, "{raw}");
        }
    }

    fn p(s: &str) -> PathPattern {
        PathPattern::parse(s).unwrap()
    }

    #[test]
    fn patterns_match_within_and_across_segments() {
        let one = p("/repos/acme/*");
        assert!(one.matches("/repos/acme/x"));
        assert!(!one.matches("/repos/acme/"), "one * is one non-empty segment");
        assert!(!one.matches("/repos/acme"));
        assert!(!one.matches("/repos/acme/x/y"));
        assert!(!one.matches("/repos/acmex/y"));
        assert!(!one.matches("/Repos/acme/x"), "case-sensitive");
        assert!(!one.matches("/repos//acme/x"), "an empty segment is a segment");
        let deep = p("/repos/acme/**");
        for ok in ["/repos/acme", "/repos/acme/", "/repos/acme/x", "/repos/acme/x/y/z"] {
            assert!(deep.matches(ok), "{ok}");
        }
        for no in ["/repos/acmex", "/repos/other/x", "/repos"] {
            assert!(!deep.matches(no), "{no}");
        }
        let mid = p("/v1/*/items/**");
        assert!(mid.matches("/v1/a/items") && mid.matches("/v1/a/items/b/c"));
        assert!(!mid.matches("/v1/a/b/items"));
        let glob = p("/v*/status");
        assert!(glob.matches("/v2/status") && glob.matches("/v/status"));
        assert!(!glob.matches("/x2/status") && !glob.matches("/v2/x/status"));
        let stars = p("/**/a/**/b/**/c/**");
        assert!(stars.matches("/x/a/y/b/z/c"));
        assert!(!stars.matches("/x/a/y/c/z/b"));
        // A hostile path costs pattern × path steps, not an exponential.
        let long = format!("/{}", vec!["a"; 20_000].join("/"));
        assert!(!stars.matches(&long));
        let g = p("/*a*a*a*a*b");
        assert!(!g.matches(&format!("/{}", "a".repeat(20_000))));
        let exact = p("/user");
        assert!(exact.matches("/user"));
        for no in ["/user/", "/user.", "/User", "/user;x", "/users"] {
            assert!(!exact.matches(no), "{no}");
        }
    }

    #[test]
    fn patterns_must_be_normal() {
        for bad in ["user", "/a/../b", "/%7e", "/a?x=1", "/a/**x", "/a%2fb", "/a#b"] {
            assert!(PathPattern::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn verdicts_union_over_entries() {
        let ro = Requests {
            methods: Some(vec!["GET".into(), "HEAD".into()]),
            paths: Some(vec![p("/repos/acme/**"), p("/user")]),
        };
        let issues = Requests {
            methods: Some(vec!["POST".into()]),
            paths: Some(vec![p("/repos/acme/*/issues")]),
        };
        assert_eq!(ro.verdict("GET", "/user"), Verdict::Allowed);
        assert_eq!(ro.verdict("POST", "/user"), Verdict::MethodNotAllowed);
        assert_eq!(ro.verdict("GET", "/admin"), Verdict::PathNotAllowed);
        let both = [&ro, &issues];
        assert_eq!(verdict(both, "POST", "/repos/acme/x/issues"), Verdict::Allowed);
        assert_eq!(
            verdict(both, "DELETE", "/repos/acme/x/issues"),
            Verdict::MethodNotAllowed
        );
        assert_eq!(verdict(both, "POST", "/orgs"), Verdict::PathNotAllowed);
        let any_path = Requests {
            methods: Some(vec!["GET".into()]),
            paths: None,
        };
        assert_eq!(any_path.verdict("GET", "/anything/at/all"), Verdict::Allowed);
        assert_eq!(any_path.verdict("PUT", "/x"), Verdict::MethodNotAllowed);
    }
}
