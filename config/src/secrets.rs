//! Finding real secrets in bytes, however they are written. A credential's
//! plain values are its secret and, when the credential's value is `Basic
//! <base64>`, the `user:password` it decodes to and that password (a
//! derived value shorter than 8 bytes is not looked for: it would match
//! ordinary text). A value is found whichever way each of its characters is
//! written, each on its own, so any mix of these:
//!
//! - as is;
//! - percent-encoded (RFC 3986 §2.1): each byte of its UTF-8 as `%` and two
//!   hex digits, in either case; a space also as `+` (HTML forms);
//! - JSON-escaped (RFC 8259 §7): `\u` and four hex digits in either case (a
//!   surrogate pair beyond U+FFFF), or `\"` `\\` `\/` `\b` `\f` `\n` `\r`
//!   `\t`;
//! - an HTML or XML character reference: `&#` and at most 7 decimal digits,
//!   or `&#x` (`&#X`) and at most 6 hex digits in either case, then `;`; or
//!   `&amp;` `&lt;` `&gt;` `&quot;` `&apos;` (`&AMP;` `&LT;` `&GT;` `&QUOT;`).
//!
//! That covers what Python's `quote` (which leaves `/`), `quote_plus` and
//! `urlencode`, JavaScript's `encodeURIComponent`, Go's `net/url` and
//! `encoding/json` (`\u003c`), PHP's `json_encode` (`\/`) and template
//! engines' HTML escaping write, and the proxy's own percent-encoding of a
//! request target. Not covered: a value transformed otherwise (base64 or
//! hex of it, a part of it, another letter case, two layers of encoding
//! such as `%252F`, other escape syntaxes such as `\x2f`).
//!
//! The values of many credentials compile into one scan: an Aho-Corasick
//! automaton finds where a spelling may begin (its first characters as
//! they are, or as they are up to the first one escaped and the beginning
//! of that escape), and a walk over the value's characters from there
//! confirms it (leftmost, then longest). One scan per policy (a request head
//! carrying any credential's real value) and one per tool (what its
//! responses are scrubbed of), built when secrets are loaded. The scanner
//! and its decoders stay in one file of some 830 lines (tests aside): each
//! written form is one branch of the same walk.

use crate::credentials::Credential;
use aho_corasick::{packed, AhoCorasick, Input, MatchKind, Span};
use base64::Engine as _;
use std::fmt;
use std::sync::Arc;

/// Derived values shorter than this are not looked for: they would match
/// ordinary text. The secret always is.
const MIN_DERIVED: usize = 8;

/// The most digits of a decimal character reference (`&#1114111;`), and of
/// a hexadecimal one (`&#x10FFFF;`), leading zeros included.
const DEC_DIGITS: usize = 7;
const HEX_DIGITS: usize = 6;

/// Whose secret a value is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub tool: Arc<str>,
    /// Index into the tool's `credentials`.
    pub credential: usize,
    /// The credential's name (facts and metrics name it, never the value).
    pub name: Arc<str>,
}

/// The secrets of a set of credentials, in every spelling. Empty until the
/// secrets are loaded. Its `Debug` shows how many values, never one.
#[derive(Clone, Default)]
pub struct SecretScan {
    /// Finds where a spelling of a value may begin (`None`: every byte
    /// [`SecretScan::first`] allows is tried).
    starts: Option<Starts>,
    /// The values looked for.
    values: Vec<Value>,
    owners: Vec<Owner>,
    /// Which bytes can begin a spelling (a bit per byte value).
    first: [u64; 4],
    /// The longest spelling of any value, in bytes.
    longest: usize,
}

impl fmt::Debug for SecretScan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretScan({} values)", self.values.len())
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
        let mut anchors: Vec<(Vec<u8>, Anchor)> = vec![];
        for (tool, i, c) in creds {
            for value in values(c) {
                if s.values.iter().any(|v| *v.raw == *value.as_bytes()) {
                    continue;
                }
                let units: Box<[Unit]> = value.chars().map(Unit::new).collect();
                for b in starts(&units[0]) {
                    s.first[usize::from(b >> 6)] |= 1 << (b & 63);
                }
                anchors.extend(anchors_of(&units));
                s.longest = s.longest.max(units.iter().map(Unit::longest).sum());
                s.values.push(Value::new(&value, units));
                s.owners.push(Owner {
                    tool: tool.clone(),
                    credential: i,
                    name: c.name.clone(),
                });
            }
        }
        anchors.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.back.cmp(&a.1.back)));
        anchors.dedup_by(|a, b| a.0 == b.0);
        if !anchors.is_empty() {
            s.starts = Starts::new(anchors);
        }
        s
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The longest spelling of a value, in bytes.
    pub fn longest(&self) -> usize {
        self.longest
    }

    pub fn owner(&self, pattern: usize) -> &Owner {
        &self.owners[pattern]
    }

    /// The first secret in `hay`, if any.
    pub fn find(&self, hay: &[u8]) -> Option<Found> {
        self.find_from(hay, 0)
    }

    /// Every secret in `hay`, left to right, not overlapping.
    pub fn find_all<'h>(&'h self, hay: &'h [u8]) -> impl Iterator<Item = Found> + 'h {
        let mut at = 0;
        std::iter::from_fn(move || {
            let f = self.find_from(hay, at)?;
            at = f.end;
            Some(f)
        })
    }

    /// The length of the longest end of `hay` that could be the start of a
    /// secret continued by bytes not yet seen (a spelling cut short by the
    /// end of `hay`); 0 when none. A stream scrubber holds these bytes back.
    pub fn pending(&self, hay: &[u8]) -> usize {
        let most = self.longest.saturating_sub(1).min(hay.len());
        for start in hay.len() - most..hay.len() {
            if self.may_start(hay[start]) && self.values.iter().any(|v| v.walk(hay, start).short) {
                return hay.len() - start;
            }
        }
        0
    }

    fn may_start(&self, b: u8) -> bool {
        self.first[usize::from(b >> 6)] & (1 << (b & 63)) != 0
    }

    /// The leftmost secret in `hay` starting at `at` or later (but for
    /// spellings that overlap: one of them).
    fn find_from(&self, hay: &[u8], at: usize) -> Option<Found> {
        if self.values.is_empty() {
            return None;
        }
        let mut next = at;
        while next < hay.len() {
            let (p, end, back) = match &self.starts {
                Some(st) => st.find(hay, next)?,
                None => {
                    let p = next + hay[next..].iter().position(|&b| self.may_start(b))?;
                    (p, p + 1, 0)
                }
            };
            // A start anchor is where a spelling would begin; a run of a
            // value's letters and digits is up to `back` bytes into it.
            for s in p.saturating_sub(back).max(at)..=p {
                if s < p && !self.may_start(hay[s]) {
                    continue;
                }
                if let Some(f) = self.longest_at(hay, s) {
                    return Some(f);
                }
            }
            // On past the anchor, unless another could begin inside it.
            next = match hay[p + 1..end].iter().any(|&b| self.may_start(b)) {
                true => p + 1,
                false => end,
            };
        }
        None
    }

    /// The longest value spelled from `p` (the first of equal ones).
    fn longest_at(&self, hay: &[u8], p: usize) -> Option<Found> {
        let mut best: Option<Found> = None;
        for (i, v) in self.values.iter().enumerate() {
            if let Some(end) = v.walk(hay, p).end {
                if best.is_none_or(|b| end > b.end) {
                    best = Some(Found {
                        start: p,
                        end,
                        pattern: i,
                    });
                }
            }
        }
        best
    }
}

/// An anchor's place in the spellings it stands for: at their start
/// (`back` 0), or a run of letters and digits at most `back` bytes into
/// them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Anchor {
    back: usize,
}

/// Where spellings may be: one anchor by `memmem` (a value's run of letters
/// and digits, when it is the only anchor: the fastest search there is),
/// several in a packed (SIMD, Teddy) searcher when the machine and their
/// number allow it (faster than an automaton whose own prefilter would pick
/// bytes as common as `%` or `\\`), else in an Aho-Corasick automaton.
#[derive(Clone)]
enum Starts {
    One(memchr::memmem::Finder<'static>, Anchor),
    Packed(packed::Searcher, Box<[Anchor]>),
    Automaton(AhoCorasick, Box<[Anchor]>),
}

impl Starts {
    fn new(anchors: Vec<(Vec<u8>, Anchor)>) -> Option<Starts> {
        if let [(one, a)] = &anchors[..] {
            if one.len() >= 2 {
                return Some(Starts::One(memchr::memmem::Finder::new(one).into_owned(), *a));
            }
        }
        let kinds: Box<[Anchor]> = anchors.iter().map(|(_, a)| *a).collect();
        let bytes = anchors.iter().map(|(b, _)| b);
        let packed = packed::Config::new()
            .match_kind(packed::MatchKind::LeftmostFirst)
            .builder()
            .extend(bytes.clone())
            .build()
            .filter(|p| p.minimum_len() >= 2);
        match packed {
            Some(p) => Some(Starts::Packed(p, kinds)),
            None => AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostFirst)
                .build(bytes)
                .ok()
                .map(|ac| Starts::Automaton(ac, kinds)),
        }
    }

    /// The leftmost anchor at `at` or later: where it begins and ends, and
    /// how far into a spelling it may be.
    fn find(&self, hay: &[u8], at: usize) -> Option<(usize, usize, usize)> {
        let (start, end, kind) = match self {
            Starts::One(f, a) => {
                let p = at + f.find(&hay[at..])?;
                return Some((p, p + f.needle().len(), a.back));
            }
            Starts::Packed(p, kinds) => {
                let m = p.find_in(hay, Span::from(at..hay.len()))?;
                (m.start(), m.end(), kinds.get(m.pattern().as_usize()))
            }
            Starts::Automaton(ac, kinds) => {
                let m = ac.find(Input::new(hay).range(at..))?;
                (m.start(), m.end(), kinds.get(m.pattern().as_usize()))
            }
        };
        Some((start, end, kind.map_or(0, |a| a.back)))
    }
}

/// The plain values of `c` that are looked for (none when its secret is
/// not loaded): the secret, and when the credential's value is `Basic
/// <base64>`, the `user:password` it decodes to and the password, each of
/// at least [`MIN_DERIVED`] bytes.
pub fn values(c: &Credential) -> Vec<String> {
    let secret = c.secret.expose();
    if secret.is_empty() {
        return vec![];
    }
    let mut out = vec![secret.to_owned()];
    // A live source's earlier values, still valid where they were issued.
    for p in &c.previous {
        if !p.is_empty() && !out.iter().any(|o| o == p.expose()) {
            out.push(p.expose().to_owned());
        }
    }
    // A signing credential's key id and session token go to its hosts in
    // every request (the secret key never does).
    if let Some(sign) = &c.sign {
        for v in [&sign.key_id, &sign.token] {
            if !v.is_empty() && !out.iter().any(|o| o == v.expose()) {
                out.push(v.expose().to_owned());
            }
        }
        return out;
    }
    let rendered = c.rendered();
    let token = rendered
        .get(..6)
        .filter(|p| p.eq_ignore_ascii_case("basic "))
        .map(|_| &rendered[6..]);
    if let Some(decoded) = token.and_then(|t| base64_decode(t.trim())) {
        let password = decoded.split_once(':').map(|(_, p)| p.to_owned());
        for d in [Some(decoded), password].into_iter().flatten() {
            if d.len() >= MIN_DERIVED && !out.contains(&d) {
                out.push(d);
            }
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

/// One character of a value, with its UTF-8 bytes.
#[derive(Clone, Copy)]
struct Unit {
    c: char,
    utf8: [u8; 4],
    len: u8,
}

impl Unit {
    fn new(c: char) -> Unit {
        let mut utf8 = [0; 4];
        let len = c.encode_utf8(&mut utf8).len() as u8;
        Unit { c, utf8, len }
    }

    fn bytes(&self) -> &[u8] {
        &self.utf8[..usize::from(self.len)]
    }

    /// Its longest spelling: `%XX` per byte, `\uXXXX` (twice beyond
    /// U+FFFF), or a character reference of the most digits.
    fn longest(&self) -> usize {
        let json = if u32::from(self.c) > 0xFFFF { 12 } else { 6 };
        (3 * usize::from(self.len)).max(json).max(DEC_DIGITS + 3)
    }
}

/// The JSON short escape of `c` (the letter after the backslash).
fn json_short(c: char) -> Option<u8> {
    Some(match c {
        '"' => b'"',
        '\\' => b'\\',
        '/' => b'/',
        '\u{8}' => b'b',
        '\u{c}' => b'f',
        '\n' => b'n',
        '\r' => b'r',
        '\t' => b't',
        _ => return None,
    })
}

/// The HTML and XML named references looked for: the character, its name,
/// and whether the all-upper-case name is one too (HTML).
const NAMED: [(char, &[u8], bool); 5] = [
    ('&', b"amp", true),
    ('<', b"lt", true),
    ('>', b"gt", true),
    ('"', b"quot", true),
    ('\'', b"apos", false),
];

/// The bytes that can begin a spelling of `u`.
fn starts(u: &Unit) -> impl Iterator<Item = u8> {
    let plus = (u.c == ' ').then_some(b'+');
    [Some(u.utf8[0]), Some(b'%'), Some(b'\\'), Some(b'&'), plus]
        .into_iter()
        .flatten()
}

/// The hex digit `n` (0-15) in each case it has.
fn hex_cases(n: u8) -> impl Iterator<Item = u8> {
    let lower = b"0123456789abcdef"[usize::from(n)];
    let upper = lower.to_ascii_uppercase();
    std::iter::once(lower).chain((upper != lower).then_some(upper))
}

/// How many characters of a value its raw start anchor spans.
const RAW: usize = 4;

/// The shortest run of ASCII letters and digits that anchors its value.
const RUN: usize = 6;

/// Byte strings one of which is in every spelling of the value `units`
/// that the scan finds.
///
/// A value holding a run of at least [`RUN`] ASCII letters and digits is
/// anchored on its longest such run, as it is: no percent-encoder, JSON
/// or HTML escaper writes a letter or digit otherwise, so every spelling a
/// library writes holds it, and so few other bytes do that a `memmem`
/// search for it costs next to nothing. (A spelling that writes one of
/// those letters or digits escaped is not found.)
///
/// Any other value is anchored at its start. A spelling either writes its
/// first [`RAW`] characters as they are (it begins with them), or escapes
/// its first character (it begins with one of [`escape_starts`]), or the
/// first character it escapes is a later one of those: then it begins with
/// the ones before as they are and the first two bytes of an escape of
/// that one. Few anchors (about 15 for an ASCII value), of three bytes or
/// more but for a value beginning with a character JSON escapes short.
fn anchors_of(units: &[Unit]) -> Vec<(Vec<u8>, Anchor)> {
    if let Some((k, n)) = longest_run(units) {
        let run: Vec<u8> = units[k..k + n].iter().map(|u| u.utf8[0]).collect();
        let back = units[..k].iter().map(Unit::longest).sum();
        return vec![(run, Anchor { back })];
    }
    let raw = units.len().min(RAW);
    let prefix = |k: usize| -> Vec<u8> { units[..k].iter().flat_map(|u| u.bytes().to_vec()).collect() };
    let mut out = vec![prefix(raw)];
    out.extend(escape_starts(&units[0]));
    for (k, u) in units.iter().enumerate().take(raw).skip(1) {
        for e in escape_starts(u) {
            out.push([prefix(k), e[..e.len().min(2)].to_vec()].concat());
        }
    }
    out.sort_unstable();
    out.dedup();
    out.into_iter().map(|a| (a, Anchor { back: 0 })).collect()
}

/// The longest run of ASCII letters and digits in `units`, of at least
/// [`RUN`]: where it begins, and its length.
fn longest_run(units: &[Unit]) -> Option<(usize, usize)> {
    let mut best: Option<(usize, usize)> = None;
    let mut k = 0;
    while k < units.len() {
        let n = units[k..].iter().take_while(|u| u.c.is_ascii_alphanumeric()).count();
        if n >= RUN && best.is_none_or(|(_, b)| n > b) {
            best = Some((k, n));
        }
        k += n.max(1);
    }
    best
}

/// The beginnings of every way of writing `u` other than as it is: `%` and
/// its first byte in hex (and, beyond ASCII, that byte as is and the next
/// as is or escaped), `+` for a space, `\u` and its first UTF-16 unit in
/// hex, its JSON short escape, `&#` and its first decimal digit (or `0`),
/// `&#x`, `&#X`, its named reference.
fn escape_starts(u: &Unit) -> Vec<Vec<u8>> {
    let mut out = vec![];
    let b = u.utf8[0];
    for hi in hex_cases(b >> 4) {
        for lo in hex_cases(b & 15) {
            out.push(vec![b'%', hi, lo]);
        }
    }
    if u.len > 1 {
        out.push(vec![b, u.utf8[1]]);
        out.push(vec![b, b'%']);
    }
    if u.c == ' ' {
        out.push(vec![b'+']);
    }
    if let Some(e) = json_short(u.c) {
        out.push(vec![b'\\', e]);
    }
    let mut cu = [0u16; 2];
    let first = u.c.encode_utf16(&mut cu)[0];
    let mut json = vec![b"\\u".to_vec()];
    for shift in [12, 8, 4, 0] {
        let n = ((first >> shift) & 15) as u8;
        json = json
            .into_iter()
            .flat_map(|p| {
                hex_cases(n).map(move |h| {
                    let mut p = p.clone();
                    p.push(h);
                    p
                })
            })
            .collect();
    }
    out.extend(json);
    let dec = u32::from(u.c).to_string().into_bytes();
    out.push(vec![b'&', b'#', dec[0]]);
    out.push(b"&#0".to_vec());
    out.push(b"&#x".to_vec());
    out.push(b"&#X".to_vec());
    if let Some((_, name, upper)) = NAMED.iter().find(|(c, ..)| *c == u.c) {
        out.push([b"&", *name].concat());
        if *upper {
            out.push([b"&".to_vec(), name.to_ascii_uppercase()].concat());
        }
    }
    out
}

/// How bytes read as one spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Read {
    /// They spell it, up to this offset.
    At(usize),
    /// They could, but end too soon to tell.
    Short,
    No,
}

/// The hex digits meaning `nibbles` (either case) at `from`.
fn hex_digits(hay: &[u8], from: usize, nibbles: &[u8]) -> Read {
    for (i, &n) in nibbles.iter().enumerate() {
        match hay.get(from + i) {
            None => return Read::Short,
            Some(&h) if hex_value(h) == Some(n) => {}
            Some(_) => return Read::No,
        }
    }
    Read::At(from + nibbles.len())
}

fn hex_value(h: u8) -> Option<u8> {
    match h {
        b'0'..=b'9' => Some(h - b'0'),
        b'a'..=b'f' => Some(h - b'a' + 10),
        b'A'..=b'F' => Some(h - b'A' + 10),
        _ => None,
    }
}

/// `lit` at `from`.
fn literal(hay: &[u8], from: usize, lit: &[u8]) -> Read {
    for (i, &l) in lit.iter().enumerate() {
        match hay.get(from + i) {
            None => return Read::Short,
            Some(&h) if h == l => {}
            Some(_) => return Read::No,
        }
    }
    Read::At(from + lit.len())
}

/// `%XX` at `q` (a `%`) meaning the byte `b`.
fn percent(hay: &[u8], q: usize, b: u8) -> Read {
    hex_digits(hay, q + 1, &[b >> 4, b & 15])
}

/// A JSON escape at `q` (a backslash) meaning `c`.
fn json(c: char, hay: &[u8], q: usize) -> Read {
    let Some(&e) = hay.get(q + 1) else {
        return Read::Short;
    };
    if json_short(c) == Some(e) {
        return Read::At(q + 2);
    }
    if e != b'u' {
        return Read::No;
    }
    let mut cu = [0u16; 2];
    let mut at = q;
    for (i, &u) in c.encode_utf16(&mut cu).iter().enumerate() {
        if i > 0 {
            match literal(hay, at, b"\\u") {
                Read::At(_) => {}
                other => return other,
            }
        }
        let nibbles = [
            (u >> 12) as u8,
            (u >> 8 & 15) as u8,
            (u >> 4 & 15) as u8,
            (u & 15) as u8,
        ];
        match hex_digits(hay, at + 2, &nibbles) {
            Read::At(e) => at = e,
            other => return other,
        }
    }
    Read::At(at)
}

/// A character reference at `q` (an `&`) meaning `c`.
fn html(c: char, hay: &[u8], q: usize) -> Read {
    let Some(&h) = hay.get(q + 1) else {
        return Read::Short;
    };
    if h == b'#' {
        return numeric(c, hay, q + 2);
    }
    let Some((_, name, upper)) = NAMED.iter().find(|(n, ..)| *n == c) else {
        return Read::No;
    };
    let mut read = Read::No;
    for up in [false, true] {
        if up && !upper {
            continue;
        }
        let mut lit = [*name, b";"].concat();
        if up {
            lit[..name.len()].make_ascii_uppercase();
        }
        match literal(hay, q + 1, &lit) {
            Read::At(e) => return Read::At(e),
            Read::Short => read = Read::Short,
            Read::No => {}
        }
    }
    read
}

/// The digits and `;` of a numeric character reference at `from` (after
/// `&#`) meaning `c`.
fn numeric(c: char, hay: &[u8], from: usize) -> Read {
    let (radix, from, most) = match hay.get(from) {
        None => return Read::Short,
        Some(b'x' | b'X') => (16, from + 1, HEX_DIGITS),
        Some(_) => (10, from, DEC_DIGITS),
    };
    let want = u32::from(c);
    let mut v: u32 = 0;
    for n in 0..=most {
        let Some(&d) = hay.get(from + n) else {
            return Read::Short;
        };
        if d == b';' && n > 0 {
            return if v == want { Read::At(from + n + 1) } else { Read::No };
        }
        let Some(dv) = char::from(d).to_digit(radix).filter(|_| n < most) else {
            return Read::No;
        };
        v = v * radix + dv;
        if v > want {
            return Read::No;
        }
    }
    Read::No
}

/// The ways one character can be read at one offset: the offset after each
/// spelling that matches, and whether one was cut short by the end.
#[derive(Default)]
struct Steps {
    at: [usize; 4],
    n: usize,
    short: bool,
}

impl Steps {
    fn add(&mut self, r: Read) {
        match r {
            Read::At(e) => {
                if self.n < self.at.len() && !self.at[..self.n].contains(&e) {
                    self.at[self.n] = e;
                    self.n += 1;
                }
            }
            Read::Short => self.short = true,
            Read::No => {}
        }
    }
}

/// Every spelling of `u` at `q`.
fn step(u: &Unit, hay: &[u8], q: usize, s: &mut Steps) {
    let Some(&h) = hay.get(q) else {
        s.short = true;
        return;
    };
    if u.len == 1 {
        // An ASCII character: as is (or `+` for a space), and `%XX`; a `%`
        // reads both ways.
        let b = u.utf8[0];
        if h == b || (h == b'+' && b == b' ') {
            s.add(Read::At(q + 1));
        }
        if h == b'%' {
            s.add(percent(hay, q, b));
        }
    } else {
        // Its UTF-8 bytes, each as is or `%XX` (no byte of it is a `%`).
        let mut at = q;
        let mut read = Read::At(q);
        for &b in u.bytes() {
            read = match hay.get(at) {
                None => Read::Short,
                Some(&h) if h == b => Read::At(at + 1),
                Some(b'%') => percent(hay, at, b),
                Some(_) => Read::No,
            };
            match read {
                Read::At(e) => at = e,
                _ => break,
            }
        }
        s.add(read);
    }
    match h {
        b'\\' => s.add(json(u.c, hay, q)),
        b'&' => s.add(html(u.c, hay, q)),
        _ => {}
    }
}

/// A value looked for: its characters, its bytes as they are, and whether
/// it is plain (holds no `%`, `\\` or `&`, which could begin an escape
/// where they stand as themselves).
#[derive(Clone)]
struct Value {
    units: Box<[Unit]>,
    raw: Box<[u8]>,
    plain: bool,
}

impl Value {
    fn new(value: &str, units: Box<[Unit]>) -> Value {
        Value {
            units,
            raw: value.as_bytes().into(),
            plain: !value.bytes().any(|b| matches!(b, b'%' | b'\\' | b'&')),
        }
    }

    /// How the value reads from `p` ([`walk`]). A plain value is first
    /// compared as it is: a spelling departs from that only at a byte that
    /// begins an escape (`%`, `\\`, `&`, `+`), so most starts that are not
    /// the value end here after a few byte comparisons.
    fn walk(&self, hay: &[u8], p: usize) -> Walk {
        if !self.plain {
            return walk(&self.units, hay, p);
        }
        let rest = &hay[p..];
        let same = self.raw.iter().zip(rest).take_while(|(a, b)| a == b).count();
        if same == self.raw.len() {
            return Walk {
                end: Some(p + same),
                short: false,
            };
        }
        let Some(&h) = rest.get(same) else {
            return Walk { end: None, short: true };
        };
        if !matches!(h, b'%' | b'\\' | b'&' | b'+') {
            return Walk {
                end: None,
                short: false,
            };
        }
        // Read on from the character the departure is in.
        let mut at = 0;
        for (k, u) in self.units.iter().enumerate() {
            let len = usize::from(u.len);
            if at + len > same {
                return walk(&self.units[k..], hay, p + at);
            }
            at += len;
        }
        Walk {
            end: None,
            short: false,
        }
    }
}

/// How a value's characters read from one offset: where the longest
/// spelling ends, and whether one was cut short by the end of the bytes.
struct Walk {
    end: Option<usize>,
    short: bool,
}

/// Reads the value `units` from `p`: one offset at a time while each
/// character reads one way (nearly always), every offset reached when one
/// reads several ways.
fn walk(units: &[Unit], hay: &[u8], p: usize) -> Walk {
    let mut at = p;
    let mut short = false;
    for (i, u) in units.iter().enumerate() {
        let mut s = Steps::default();
        step(u, hay, at, &mut s);
        short |= s.short;
        match s.n {
            0 => return Walk { end: None, short },
            1 => at = s.at[0],
            _ => return walk_all(&units[i + 1..], hay, &s.at[..s.n], short),
        }
    }
    Walk { end: Some(at), short }
}

/// [`walk`] on from several offsets at once.
fn walk_all(units: &[Unit], hay: &[u8], from: &[usize], mut short: bool) -> Walk {
    let mut now = from.to_vec();
    let mut next = vec![];
    for u in units {
        next.clear();
        for &q in &now {
            let mut s = Steps::default();
            step(u, hay, q, &mut s);
            short |= s.short;
            for &e in &s.at[..s.n] {
                if !next.contains(&e) {
                    next.push(e);
                }
            }
        }
        if next.is_empty() {
            return Walk { end: None, short };
        }
        std::mem::swap(&mut now, &mut next);
    }
    Walk {
        end: now.iter().copied().max(),
        short,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Secret;
    use proptest::prelude::*;

    fn cred(value: &str, secret: &str) -> Credential {
        let text = format!(
            "[tools.t]\negress = [\"api.example:443\"]\n[tools.t.credentials.c]\nhosts = [\"api.example:443\"]\nvalue = \"{value}\"\nsecret = {{ env = \"X\" }}\nplaceholder_env = \"C\"\n"
        );
        let c = crate::Config::parse(&text, "t").unwrap();
        let mut c = c.policy.tool("t").unwrap().credentials[0].clone();
        c.secret = Secret::new(secret);
        c
    }

    fn scan_of(creds: &[Credential]) -> SecretScan {
        let tool: Arc<str> = Arc::from("t");
        SecretScan::build(creds.iter().enumerate().map(|(i, c)| (&tool, i, c)))
    }

    fn scan(secrets: &[&str]) -> SecretScan {
        let creds: Vec<Credential> = secrets.iter().map(|s| cred("Bearer ${secret}", s)).collect();
        scan_of(&creds)
    }

    /// Where the scan finds a secret in `hay`, as text.
    fn spans(s: &SecretScan, hay: &str) -> Vec<(usize, usize)> {
        s.find_all(hay.as_bytes()).map(|f| (f.start, f.end)).collect()
    }

    const SECRET: &str = "ab c/d\"e+f=g&h<i";

    #[test]
    fn a_secret_is_found_as_each_library_writes_it() {
        let s = scan(&[SECRET]);
        for spelled in [
            SECRET,
            // Python quote (leaves /), quote_plus / urlencode, quote(safe="").
            "ab%20c/d%22e%2Bf%3Dg%26h%3Ci",
            "ab+c%2Fd%22e%2Bf%3Dg%26h%3Ci",
            "ab%20c%2Fd%22e%2Bf%3Dg%26h%3Ci",
            // Lower-case hex, and digits of mixed case.
            "ab%20c%2fd%22e%2bf%3dg%26h%3ci",
            "ab%20c%2fd%22e%2Bf%3dg%26h%3Ci",
            // JSON: minimal (Python json.dumps), with \/ (PHP), Go's
            // \u0026-style, every character as \u00XX in either case.
            "ab c/d\\\"e+f=g&h<i",
            "ab c\\/d\\\"e+f=g&h<i",
            "ab c/d\\u0022e+f=g\\u0026h\\u003ci",
            "\\u0061\\u0062\\u0020\\u0063\\u002F\\u0064\\u0022\\u0065\\u002b\\u0066\\u003D\\u0067\\u0026\\u0068\\u003C\\u0069",
            // HTML: named, decimal, hex, leading zeros, upper-case X.
            "ab c/d&quot;e+f=g&amp;h&lt;i",
            "ab c&#47;d&#34;e&#43;f&#x3d;g&#X26;h&#0000060;i",
            "ab c/d&QUOT;e+f=g&AMP;h&LT;i",
            // Any mix, character by character.
            "a%62+c\\/d&#34;e%2bf\\u003dg&amp;h%3ci",
        ] {
            let hay = format!("x={spelled}&y");
            assert_eq!(spans(&s, &hay), [(2, 2 + spelled.len())], "{spelled}");
            assert_eq!(s.owner(0).credential, 0);
        }
        for near in [
            "ab c/d\"e+f=g&h<j",
            "AB c/d\"e+f=g&h<i",
            // Two layers of encoding.
            "ab%2520c/d\"e+f=g&h<i",
            "ab c%5C%2Fd\"e+f=g&h<i",
            // Not escapes of these characters.
            "ab c\\x2fd\"e+f=g&h<i",
            "ab c\\U002fd\"e+f=g&h<i",
            "ab c&#47d\"e+f=g&h<i",
            "ab c&#00000047;d\"e+f=g&h<i",
            "ab c&sol;d\"e+f=g&h<i",
            // A space as + only: not + as a space's spelling the other way.
            "ab%2Bc/d\"e+f=g&h<i",
        ] {
            assert_eq!(spans(&s, &format!("x={near}&y")), [], "{near}");
        }
    }

    #[test]
    fn a_secret_with_a_run_of_letters_and_digits_is_found_by_it_whatever_surrounds_it() {
        let s = scan(&["sk-live/3f9A7c21e6d4 b058"]);
        for spelled in [
            "sk-live/3f9A7c21e6d4 b058",
            "sk-live%2F3f9A7c21e6d4%20b058",
            "sk\\u002dlive\\/3f9A7c21e6d4+b058",
            "%73%6B-%6c%69%76%65&#x2F;3f9A7c21e6d4&#32;%62%30%35%38",
        ] {
            let hay = format!("x={spelled}&y");
            assert_eq!(spans(&s, &hay), [(2, 2 + spelled.len())], "{spelled}");
        }
        // Its run, escaped, is not looked for (no library escapes letters or digits).
        assert_eq!(spans(&s, "sk-live/3f9%41 7c21e6d4 b058"), []);
        assert_eq!(spans(&s, "sk-live/\\u00333f9A7c21e6d4 b058"), []);
        // A run shorter than 6 anchors nothing: such a value is anchored at its start.
        let short = scan(&["ab-12345-cd"]);
        assert_eq!(
            spans(&short, "\\u0061\\u0062\\u002d\\u0031\\u0032\\u0033\\u0034\\u0035-cd"),
            [(0, 51)]
        );
    }

    #[test]
    fn characters_beyond_ascii_are_found_by_bytes_and_by_code_point() {
        let s = scan(&["pa\u{e9}s-\u{1F511}-key"]);
        for spelled in [
            "pa\u{e9}s-\u{1F511}-key",
            "pa%C3%A9s-%F0%9F%94%91-key",
            "pa\\u00e9s-\\ud83d\\udd11-key",
            "pa&#233;s-&#x1F511;-key",
        ] {
            assert_eq!(
                spans(&s, &format!(" {spelled} ")),
                [(1, 1 + spelled.len())],
                "{spelled}"
            );
        }
        assert_eq!(spans(&s, " pa\\u00e9s-\\ud83d-key "), []);
        // One byte of a character as is, the next percent-encoded.
        let mixed = b" pa\xC3%A9s-\xF0%9F\x94%91-key";
        assert_eq!(s.find(mixed).map(|f| (f.start, f.end)), Some((1, mixed.len())));
    }

    #[test]
    fn a_basic_value_is_looked_for_decoded_too_in_every_spelling() {
        // base64("robot:pa55/w0rd long")
        let c = cred("Basic ${secret}", "cm9ib3Q6cGE1NS93MHJkIGxvbmc=");
        assert_eq!(
            values(&c),
            ["cm9ib3Q6cGE1NS93MHJkIGxvbmc=", "robot:pa55/w0rd long", "pa55/w0rd long"]
        );
        let s = scan_of(&[c]);
        for (hay, want) in [
            ("u=robot%3Apa55/w0rd%20long", (2, 26)),
            ("{\"p\":\"pa55\\/w0rd long\"}", (6, 21)),
            ("pw=pa55%2Fw0rd+long", (3, 19)),
            ("k=cm9ib3Q6cGE1NS93MHJkIGxvbmc%3D", (2, 32)),
        ] {
            assert_eq!(spans(&s, hay), [want], "{hay}");
        }
        // Derived values too short to be told from text are not looked for;
        // not base64, or not a Basic value: nothing decoded.
        assert_eq!(values(&cred("Basic ${secret}", "dTpwdw==")), ["dTpwdw=="]);
        assert_eq!(values(&cred("Basic ${secret}", "not base64!")), ["not base64!"]);
        assert_eq!(
            values(&cred("Bearer ${secret}", "cm9ib3Q6cGE1NS93MHJkIGxvbmc=")),
            ["cm9ib3Q6cGE1NS93MHJkIGxvbmc="]
        );
        assert!(values(&cred("${secret}", "")).is_empty(), "not loaded: nothing");
        assert!(scan_of(&[cred("${secret}", "")]).is_empty());
    }

    #[test]
    fn the_scan_finds_the_leftmost_then_longest_and_names_its_credential() {
        let s = scan(&["first-secret-1", "second secret/2", "first-secret-12"]);
        assert!(!s.is_empty());
        assert_eq!(s.find(b"x first-secret-1 y").map(|f| (f.start, f.end)), Some((2, 16)));
        let f = s.find(b"x first-secret-12").unwrap();
        assert_eq!((f.end, s.owner(f.pattern).credential), (17, 2), "the longest");
        let f = s.find(b"q=second%20secret%2F2").unwrap();
        assert_eq!(s.owner(f.pattern).credential, 1);
        assert_eq!(s.find(b"first-secret-"), None);
        let all: Vec<usize> = s
            .find_all(b"first-secret-1 second+secret/2first-secret-1")
            .map(|f| s.owner(f.pattern).credential)
            .collect();
        assert_eq!(all, [0, 1, 0]);
        assert!(SecretScan::default().find(b"anything").is_none());
        assert_eq!(format!("{s:?}"), "SecretScan(3 values)");
        // A value's own escape character reads both ways.
        let s = scan(&["100%-pure\\key"]);
        for spelled in ["100%-pure\\key", "100%25-pure\\\\key", "100%-pure%5Ckey"] {
            assert_eq!(spans(&s, spelled), [(0, spelled.len())], "{spelled}");
        }
    }

    #[test]
    fn pending_is_the_longest_end_that_could_still_become_a_secret() {
        let s = scan(&["abcdef/secret"]);
        assert_eq!(s.pending(b"xxxxabc"), 3);
        assert_eq!(s.pending(b"xxxxa"), 1);
        assert_eq!(s.pending(b"xxxxq"), 0);
        assert_eq!(s.pending(b"abcdef/secre"), 12);
        for cut in ["abcdef%2", "abcdef\\u00", "abcdef&#4", "abcdef&#x2F", "%6", "\\", "&"] {
            assert_eq!(s.pending(format!("xx {cut}").as_bytes()), cut.len(), "{cut}");
        }
        assert_eq!(s.pending(b"xx abcdef%3"), 0, "not the next character");
        // A whole secret at the end is found, not pending.
        assert_eq!(s.pending(b"abcdef/secret"), 0);
        assert_eq!(s.pending(b""), 0);
        assert_eq!(SecretScan::default().pending(b"abc"), 0);
        assert!(s.longest() >= "abcdef/secret".len() * 10);
    }

    /// One spelling of `c`, the `pick`th of those the scan knows.
    fn spell(c: char, pick: usize, zeros: usize) -> String {
        let mut ways = vec![c.to_string()];
        let mut utf8 = [0; 4];
        let bytes = c.encode_utf8(&mut utf8).as_bytes().to_vec();
        ways.push(bytes.iter().map(|b| format!("%{b:02X}")).collect());
        ways.push(bytes.iter().map(|b| format!("%{b:02x}")).collect());
        if c == ' ' {
            ways.push("+".into());
        }
        let mut cu = [0u16; 2];
        ways.push(c.encode_utf16(&mut cu).iter().map(|u| format!("\\u{u:04X}")).collect());
        ways.push(c.encode_utf16(&mut cu).iter().map(|u| format!("\\u{u:04x}")).collect());
        if let Some(e) = json_short(c) {
            ways.push(format!("\\{}", char::from(e)));
        }
        let digits = format!("{}", u32::from(c));
        ways.push(format!(
            "&#{}{digits};",
            "0".repeat(zeros.min(DEC_DIGITS - digits.len()))
        ));
        let hex = format!("{:x}", u32::from(c));
        ways.push(format!("&#x{}{hex};", "0".repeat(zeros.min(HEX_DIGITS - hex.len()))));
        ways.push(format!("&#X{};", hex.to_ascii_uppercase()));
        if let Some((_, name, _)) = NAMED.iter().find(|(n, ..)| *n == c) {
            ways.push(format!("&{};", String::from_utf8_lossy(name)));
        }
        ways.swap_remove(pick % ways.len())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        /// A secret spelled any way, character by character (but the run of
        /// letters and digits that anchors it, as it is), between text
        /// that cannot begin a spelling, is found exactly; cut short, it is
        /// held back whole (the cut may still spell it another way: a
        /// backslash as is is the beginning of `\\`).
        #[test]
        fn any_mix_of_spellings_is_found_and_its_beginning_held(
            secret in "[a-z0-9 /+=&<>\"'\\\\%é€😀_.~-]{8,24}",
            picks in proptest::collection::vec((0usize..12, 0usize..4), 24),
            before in "[Q-Z]{0,6}",
            after in "[Q-Z]{0,6}",
        ) {
            let s = scan(&[&secret]);
            // The letters and digits of the run that anchors it as they are.
            let units: Vec<Unit> = secret.chars().map(Unit::new).collect();
            let run = longest_run(&units).map_or(0..0, |(k, n)| k..k + n);
            let spelled: String = secret
                .chars()
                .zip(&picks)
                .enumerate()
                .map(|(i, (c, &(p, z)))| if run.contains(&i) { c.to_string() } else { spell(c, p, z) })
                .collect();
            let hay = format!("{before}{spelled}{after}");
            prop_assert_eq!(spans(&s, &hay), vec![(before.len(), before.len() + spelled.len())]);
            let cut = &hay.as_bytes()[..before.len() + spelled.len() - 1];
            prop_assert!(s.find(cut).is_none_or(|f| f.start == before.len()));
            prop_assert_eq!(s.pending(cut), spelled.len() - 1);
            prop_assert!(spelled.len() <= s.longest());
        }
    }
}
