//! Finding real secrets in bytes. Each credential's secret is looked for in
//! every form in which it leaves or comes back through the proxy: as is,
//! percent-encoded (as the proxy writes it into a request target, in either
//! hex case, and with `+` for spaces as forms encode them), JSON-escaped,
//! and, when the credential's value is `Basic <base64>`, the `user:password`
//! it decodes to and that password. The forms of many credentials compile
//! into one Aho-Corasick automaton (leftmost-longest), built when secrets
//! are loaded: one per policy (a request head carrying any credential's
//! real value) and one per tool (what its responses are scrubbed of).

use crate::credentials::Credential;
use aho_corasick::{AhoCorasick, MatchKind};
use base64::Engine as _;
use std::fmt;
use std::sync::Arc;

/// Derived forms shorter than this are not looked for: they would match
/// ordinary text. The secret as is always is.
const MIN_DERIVED: usize = 8;

/// Whose secret a pattern is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub tool: Arc<str>,
    /// Index into the tool's `credentials`.
    pub credential: usize,
    /// The credential's name (facts and metrics name it, never the value).
    pub name: Arc<str>,
}

/// The secrets of a set of credentials, in all their forms. Empty until the
/// secrets are loaded. Its `Debug` shows how many patterns, never one.
#[derive(Clone, Default)]
pub struct SecretScan {
    ac: Option<AhoCorasick>,
    patterns: Vec<Box<[u8]>>,
    owners: Vec<Owner>,
    /// Which bytes start a pattern (a bit per byte value).
    first: [u64; 4],
    longest: usize,
}

impl fmt::Debug for SecretScan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretScan({} patterns)", self.patterns.len())
    }
}

/// A secret found: where, and whose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    pub start: usize,
    pub end: usize,
    /// Index into [`SecretScan::owner`].
    pub pattern: usize,
}

impl SecretScan {
    /// The scan of `creds`, each with its tool.
    pub fn build<'a>(creds: impl IntoIterator<Item = (&'a Arc<str>, usize, &'a Credential)>) -> SecretScan {
        let mut s = SecretScan::default();
        for (tool, i, c) in creds {
            for form in forms(c) {
                if s.patterns.iter().any(|p| **p == *form) {
                    continue;
                }
                s.first[usize::from(form[0] >> 6)] |= 1 << (form[0] & 63);
                s.longest = s.longest.max(form.len());
                s.patterns.push(form.into_boxed_slice());
                s.owners.push(Owner {
                    tool: tool.clone(),
                    credential: i,
                    name: c.name.clone(),
                });
            }
        }
        if !s.patterns.is_empty() {
            s.ac = AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostLongest)
                .build(&s.patterns)
                .ok();
        }
        s
    }

    pub fn is_empty(&self) -> bool {
        self.ac.is_none()
    }

    /// The longest pattern, in bytes.
    pub fn longest(&self) -> usize {
        self.longest
    }

    pub fn owner(&self, pattern: usize) -> &Owner {
        &self.owners[pattern]
    }

    /// The first secret in `hay`, if any.
    pub fn find(&self, hay: &[u8]) -> Option<Found> {
        let m = self.ac.as_ref()?.find(hay)?;
        Some(Found {
            start: m.start(),
            end: m.end(),
            pattern: m.pattern().as_usize(),
        })
    }

    /// Every secret in `hay`, left to right, not overlapping.
    pub fn find_all<'h>(&'h self, hay: &'h [u8]) -> impl Iterator<Item = Found> + 'h {
        self.ac.iter().flat_map(move |ac| {
            ac.find_iter(hay).map(|m| Found {
                start: m.start(),
                end: m.end(),
                pattern: m.pattern().as_usize(),
            })
        })
    }

    /// The length of the longest end of `hay` that could be the start of a
    /// secret continued by bytes not yet seen (a proper prefix of a
    /// pattern); 0 when none. A stream scrubber holds these bytes back.
    pub fn pending(&self, hay: &[u8]) -> usize {
        let most = self.longest.saturating_sub(1).min(hay.len());
        let from = hay.len() - most;
        for start in from..hay.len() {
            let b = hay[start];
            if self.first[usize::from(b >> 6)] & (1 << (b & 63)) == 0 {
                continue;
            }
            let tail = &hay[start..];
            if self
                .patterns
                .iter()
                .any(|p| p.len() > tail.len() && p.starts_with(tail))
            {
                return tail.len();
            }
        }
        0
    }
}

/// Every form of `c`'s secret that is looked for (none when not loaded).
pub fn forms(c: &Credential) -> Vec<Vec<u8>> {
    let secret = c.secret.expose();
    if secret.is_empty() {
        return vec![];
    }
    let mut out: Vec<Vec<u8>> = vec![secret.as_bytes().to_vec()];
    let mut derived = vec![
        percent_encode(secret, b"0123456789ABCDEF", false),
        percent_encode(secret, b"0123456789abcdef", false),
        percent_encode(secret, b"0123456789ABCDEF", true),
        json_escape(secret),
    ];
    let rendered = c.rendered();
    if let Some(token) = rendered
        .get(..6)
        .filter(|p| p.eq_ignore_ascii_case("basic "))
        .map(|_| &rendered[6..])
    {
        if let Some(decoded) = base64_decode(token.trim()) {
            if let Some((_, password)) = decoded.split_once(':') {
                derived.push(password.to_owned());
            }
            derived.push(decoded);
        }
    }
    for d in derived {
        if d.len() >= MIN_DERIVED && !out.iter().any(|o| *o == d.as_bytes()) {
            out.push(d.into_bytes());
        }
    }
    out
}

/// RFC 3986 §2.3: all but unreserved characters percent-encoded with the
/// `hex` digits given; `plus` writes a space as `+` (HTML forms).
pub fn percent_encode(s: &str, hex: &[u8; 16], plus: bool) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else if plus && b == b' ' {
            out.push('+');
        } else {
            out.push('%');
            out.push(char::from(hex[usize::from(b >> 4)]));
            out.push(char::from(hex[usize::from(b & 15)]));
        }
    }
    out
}

/// The JSON string body of `s` with `/` escaped too (as some servers write it).
fn json_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '/' => out.push_str("\\/"),
            c => out.push(c),
        }
    }
    out
}

fn base64_decode(token: &str) -> Option<String> {
    let engines = [
        base64::engine::general_purpose::STANDARD,
        base64::engine::general_purpose::STANDARD_NO_PAD,
    ];
    engines
        .iter()
        .find_map(|e| e.decode(token).ok())
        .and_then(|b| String::from_utf8(b).ok())
        .filter(|s| !s.chars().any(char::is_control))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Secret;

    fn cred(value: &str, secret: &str) -> Credential {
        let text = format!(
            "[tools.t]\negress = [\"api.example:443\"]\n[tools.t.credentials.c]\nhosts = [\"api.example:443\"]\nvalue = \"{value}\"\nsecret = {{ env = \"X\" }}\nplaceholder_env = \"C\"\n"
        );
        let c = crate::Config::parse(&text, "t").unwrap();
        let mut c = c.policy.tool("t").unwrap().credentials[0].clone();
        c.secret = Secret::new(secret);
        c
    }

    fn strings(c: &Credential) -> Vec<String> {
        forms(c).into_iter().map(|f| String::from_utf8(f).unwrap()).collect()
    }

    #[test]
    fn a_secret_is_looked_for_as_is_and_as_servers_encode_it() {
        let c = cred("Bearer ${secret}", "ab c/d\"e");
        assert_eq!(
            strings(&c),
            [
                "ab c/d\"e",
                "ab%20c%2Fd%22e",
                "ab%20c%2fd%22e",
                "ab+c%2Fd%22e",
                "ab c\\/d\\\"e"
            ]
        );
        // A plain token has one form.
        assert_eq!(strings(&cred("${secret}", "tok-0123456789")), ["tok-0123456789"]);
        // Derived forms too short to be told from text are not looked for.
        assert_eq!(strings(&cred("${secret}", "a/b")), ["a/b"]);
        assert!(forms(&cred("${secret}", "")).is_empty(), "not loaded: nothing");
    }

    #[test]
    fn a_basic_value_is_looked_for_decoded_too() {
        // base64("robot:pa55-w0rd-long")
        let c = cred("Basic ${secret}", "cm9ib3Q6cGE1NS13MHJkLWxvbmc=");
        let f = strings(&c);
        assert!(f.contains(&"robot:pa55-w0rd-long".to_owned()), "{f:?}");
        assert!(f.contains(&"pa55-w0rd-long".to_owned()), "{f:?}");
        assert!(f.contains(&"cm9ib3Q6cGE1NS13MHJkLWxvbmc%3D".to_owned()), "{f:?}");
        // Not base64, or not a Basic value: nothing decoded.
        assert_eq!(
            strings(&cred("Basic ${secret}", "not base64!")),
            ["not base64!", "not%20base64%21", "not+base64%21"]
        );
        assert_eq!(
            strings(&cred("Bearer ${secret}", "cm9ib3Q6cGE1NS13MHJkLWxvbmc=")),
            [
                "cm9ib3Q6cGE1NS13MHJkLWxvbmc=",
                "cm9ib3Q6cGE1NS13MHJkLWxvbmc%3D",
                "cm9ib3Q6cGE1NS13MHJkLWxvbmc%3d"
            ]
        );
    }

    fn scan(secrets: &[&str]) -> SecretScan {
        let tool: Arc<str> = Arc::from("t");
        let creds: Vec<Credential> = secrets.iter().map(|s| cred("Bearer ${secret}", s)).collect();
        SecretScan::build(creds.iter().enumerate().map(|(i, c)| (&tool, i, c)))
    }

    #[test]
    fn the_scan_finds_every_form_and_names_its_credential() {
        let s = scan(&["first-secret-1", "second secret/2"]);
        assert!(!s.is_empty());
        assert_eq!(s.find(b"x first-secret-1 y").map(|f| (f.start, f.end)), Some((2, 16)));
        let f = s.find(b"q=second%20secret%2F2").unwrap();
        assert_eq!(s.owner(f.pattern).credential, 1);
        assert_eq!(s.find(b"first-secret-"), None);
        let all: Vec<usize> = s
            .find_all(b"first-secret-1 second secret/2")
            .map(|f| s.owner(f.pattern).credential)
            .collect();
        assert_eq!(all, [0, 1]);
        assert!(SecretScan::default().find(b"anything").is_none());
        assert_eq!(format!("{s:?}"), "SecretScan(6 patterns)");
    }

    #[test]
    fn pending_is_the_longest_end_that_could_still_become_a_secret() {
        let s = scan(&["abcdef-secret"]);
        assert_eq!(s.pending(b"xxxxabc"), 3);
        assert_eq!(s.pending(b"xxxxa"), 1);
        assert_eq!(s.pending(b"xxxxq"), 0);
        assert_eq!(s.pending(b"abcdef-secre"), 12);
        // A whole secret at the end is found, not pending.
        assert_eq!(s.pending(b"abcdef-secret"), 0);
        assert_eq!(s.pending(b""), 0);
        assert_eq!(SecretScan::default().pending(b"abc"), 0);
    }
}
