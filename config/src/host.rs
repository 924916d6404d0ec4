//! Canonical host names and IP literals: the one place that decides what a
//! host string means. Names are IDNA-mapped (UTS #46) to their ASCII form,
//! lower-cased and stripped of one trailing dot; anything that a WHATWG URL
//! parser or `inet_aton` would read as an IPv4 address (`127.1`, `0x7f.1`,
//! `2130706433`, `0177.0.0.1`) or a bracketed IPv6 address is an IP literal.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// A host after canonicalization.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Host {
    /// An ASCII DNS name: lower case, no trailing dot, labels `[a-z0-9_-]`.
    Name(String),
    /// An IP literal, in whatever spelling it arrived.
    Ip(IpAddr),
}

impl Host {
    /// The IP literal, canonicalized (`::ffff:a.b.c.d` becomes `a.b.c.d`).
    pub fn ip(&self) -> Option<IpAddr> {
        match self {
            Host::Ip(ip) => Some(ip.to_canonical()),
            Host::Name(_) => None,
        }
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::Name(n) => f.write_str(n),
            Host::Ip(IpAddr::V4(ip)) => write!(f, "{ip}"),
            Host::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]"),
        }
    }
}

/// Why a host string is not acceptable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    #[error("empty host")]
    Empty,
    #[error("host is longer than 253 characters")]
    TooLong,
    #[error("a label is longer than 63 characters")]
    LabelTooLong,
    #[error("empty label in host name")]
    EmptyLabel,
    #[error("userinfo ('@') is not allowed in a host")]
    Userinfo,
    #[error("percent-encoding is not allowed in a host")]
    PercentEncoding,
    #[error("character {0:?} is not allowed in a host name")]
    InvalidChar(char),
    #[error("brackets are only allowed around an IPv6 address")]
    BadBracket,
    #[error("not a valid internationalized domain name")]
    Idna,
    #[error("host looks numeric but is not a valid IPv4 address")]
    BadNumeric,
}

/// Parses and canonicalizes a host as it appears in a request target or an
/// allowlist entry (IPv6 in brackets).
pub fn parse_host(raw: &str) -> Result<Host, HostError> {
    if raw.is_empty() {
        return Err(HostError::Empty);
    }
    if let Some(inner) = raw.strip_prefix('[') {
        let inner = inner.strip_suffix(']').ok_or(HostError::BadBracket)?;
        return inner
            .parse::<Ipv6Addr>()
            .map(|ip| Host::Ip(IpAddr::V6(ip)))
            .map_err(|_| HostError::BadBracket);
    }
    if raw.contains('@') {
        return Err(HostError::Userinfo);
    }
    if raw.contains('%') {
        return Err(HostError::PercentEncoding);
    }
    if raw.contains(['[', ']']) {
        return Err(HostError::BadBracket);
    }
    // Non-ASCII input goes through UTS #46 mapping first, so full-width digits
    // and ideographic full stops cannot hide an IP literal.
    let mapped;
    let ascii: &str = if raw.is_ascii() {
        raw
    } else {
        mapped = idna::domain_to_ascii(raw).map_err(|_| HostError::Idna)?;
        if mapped.contains('%') {
            return Err(HostError::PercentEncoding);
        }
        &mapped
    };
    let trimmed = ascii.strip_suffix('.').unwrap_or(ascii);
    if trimmed.is_empty() {
        return Err(HostError::EmptyLabel);
    }
    if trimmed.len() > 253 {
        return Err(HostError::TooLong);
    }
    let last = trimmed.rsplit('.').next().unwrap_or(trimmed);
    if is_numeric_label(last) {
        return parse_ipv4_loose(trimmed)
            .map(|ip| Host::Ip(IpAddr::V4(ip)))
            .ok_or(HostError::BadNumeric);
    }
    let mut out = String::with_capacity(trimmed.len());
    for label in trimmed.split('.') {
        if label.is_empty() {
            return Err(HostError::EmptyLabel);
        }
        if label.len() > 63 {
            return Err(HostError::LabelTooLong);
        }
        if !out.is_empty() {
            out.push('.');
        }
        for c in label.chars() {
            match c {
                'a'..='z' | '0'..='9' | '-' | '_' => out.push(c),
                'A'..='Z' => out.push(c.to_ascii_lowercase()),
                other => return Err(HostError::InvalidChar(other)),
            }
        }
    }
    Ok(Host::Name(out))
}

/// WHATWG "ends in a number": all decimal digits, or `0x` followed by hex digits.
fn is_numeric_label(label: &str) -> bool {
    if label.is_empty() {
        return false;
    }
    if label.bytes().all(|b| b.is_ascii_digit()) {
        return true;
    }
    match label.strip_prefix("0x").or_else(|| label.strip_prefix("0X")) {
        Some(hex) => hex.bytes().all(|b| b.is_ascii_hexdigit()),
        None => false,
    }
}

/// One part of a loose IPv4 address: decimal, `0x` hex or leading-zero octal.
fn parse_ipv4_part(part: &str) -> Option<u64> {
    if part.is_empty() {
        return None;
    }
    let (digits, radix) = if let Some(h) = part.strip_prefix("0x").or_else(|| part.strip_prefix("0X")) {
        (h, 16)
    } else if part.len() > 1 && part.starts_with('0') {
        (&part[1..], 8)
    } else {
        (part, 10)
    };
    if digits.is_empty() {
        return Some(0);
    }
    // Cap length so huge inputs cannot overflow; any value this long is invalid.
    if digits.len() > 12 {
        return None;
    }
    u64::from_str_radix(digits, radix).ok()
}

/// Parses every IPv4 spelling `inet_aton` and the WHATWG URL parser accept:
/// one to four parts, the last filling the remaining bytes.
pub fn parse_ipv4_loose(s: &str) -> Option<Ipv4Addr> {
    let s = s.strip_suffix('.').unwrap_or(s);
    let parts: Vec<&str> = s.split('.').collect();
    if parts.is_empty() || parts.len() > 4 {
        return None;
    }
    let mut nums = [0u64; 4];
    for (i, p) in parts.iter().enumerate() {
        nums[i] = parse_ipv4_part(p)?;
    }
    let n = parts.len();
    let mut value: u64 = 0;
    for (i, num) in nums.iter().take(n - 1).enumerate() {
        if *num > 255 {
            return None;
        }
        value |= num << (8 * (3 - i));
    }
    let last = nums[n - 1];
    let room = 8 * (5 - n as u32);
    if last >= (1u64 << room) {
        return None;
    }
    value |= last;
    u32::try_from(value).ok().map(Ipv4Addr::from)
}

/// Parses a port: decimal digits only, 1..=65535.
pub fn parse_port(raw: &str) -> Option<u16> {
    if raw.is_empty() || raw.len() > 5 || !raw.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    match raw.parse::<u16>() {
        Ok(0) | Err(_) => None,
        Ok(p) => Some(p),
    }
}

/// Splits `host:port` (IPv6 hosts in brackets) into a canonical host and port.
pub fn parse_authority(raw: &str) -> Result<(Host, u16), AuthorityError> {
    let (host, port) = if raw.starts_with('[') {
        let end = raw.find(']').ok_or(AuthorityError::Host(HostError::BadBracket))?;
        let rest = &raw[end + 1..];
        let port = rest.strip_prefix(':').ok_or(AuthorityError::MissingPort)?;
        (&raw[..=end], port)
    } else {
        let (h, p) = raw.rsplit_once(':').ok_or(AuthorityError::MissingPort)?;
        if h.contains(':') {
            return Err(AuthorityError::Host(HostError::InvalidChar(':')));
        }
        (h, p)
    };
    let port = parse_port(port).ok_or(AuthorityError::BadPort)?;
    Ok((parse_host(host).map_err(AuthorityError::Host)?, port))
}

/// Why an authority (`host:port`) is not acceptable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthorityError {
    #[error("missing port (expected host:port)")]
    MissingPort,
    #[error("port must be a decimal number in 1..=65535")]
    BadPort,
    #[error("{0}")]
    Host(HostError),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(s: &str) -> Host {
        Host::Ip(IpAddr::V4(s.parse().unwrap()))
    }

    #[test]
    fn ip_literals_in_every_spelling() {
        let table = [
            ("10.0.0.1", "10.0.0.1"),
            ("127.0.0.1", "127.0.0.1"),
            ("127.1", "127.0.0.1"),
            ("127.0.1", "127.0.0.1"),
            ("2130706433", "127.0.0.1"),
            ("0x7f.1", "127.0.0.1"),
            ("0x7F000001", "127.0.0.1"),
            ("0177.0.0.1", "127.0.0.1"),
            ("0177.0.0.01", "127.0.0.1"),
            ("127.0.0.1.", "127.0.0.1"),
            ("0", "0.0.0.0"),
            ("0x", "0.0.0.0"),
            ("169.254.169.254", "169.254.169.254"),
            ("0xa9fea9fe", "169.254.169.254"),
            ("\u{ff11}\u{ff12}\u{ff17}.0.0.1", "127.0.0.1"),
            ("127\u{3002}0\u{3002}0\u{3002}1", "127.0.0.1"),
        ];
        for (input, want) in table {
            assert_eq!(parse_host(input), Ok(v4(want)), "{input}");
        }
    }

    #[test]
    fn ipv6_literals() {
        for s in [
            "[::1]",
            "[::ffff:7f00:1]",
            "[::ffff:127.0.0.1]",
            "[fe80::1]",
            "[64:ff9b::a00:1]",
        ] {
            assert!(matches!(parse_host(s), Ok(Host::Ip(IpAddr::V6(_)))), "{s}");
        }
        assert_eq!(
            parse_host("[::ffff:7f00:1]").unwrap().ip(),
            Some("127.0.0.1".parse().unwrap())
        );
        assert_eq!(parse_host("[fe80::1%25eth0]"), Err(HostError::BadBracket));
        assert_eq!(parse_host("[example.com]"), Err(HostError::BadBracket));
        assert_eq!(parse_host("::1"), Err(HostError::InvalidChar(':')));
    }

    #[test]
    fn numeric_but_invalid_is_rejected_not_a_name() {
        for s in [
            "256.0.0.1",
            "1.2.3.4.5",
            "1.2.3.256",
            "0x1.0x100000000",
            "09.1.1.1",
            "99999999999999999999",
            "1..2",
        ] {
            assert!(parse_host(s).is_err(), "{s}");
        }
    }

    #[test]
    fn names_are_canonical() {
        let table = [
            ("Example.COM", "example.com"),
            ("example.com.", "example.com"),
            ("a-b_c.example", "a-b_c.example"),
            ("1.2.3.example", "1.2.3.example"),
            ("0xg.example", "0xg.example"),
            ("bücher.example", "xn--bcher-kva.example"),
            ("EXAMPLE\u{3002}com", "example.com"),
        ];
        for (input, want) in table {
            assert_eq!(parse_host(input), Ok(Host::Name(want.into())), "{input}");
        }
    }

    #[test]
    fn bad_names() {
        assert_eq!(parse_host(""), Err(HostError::Empty));
        assert_eq!(parse_host("."), Err(HostError::EmptyLabel));
        assert_eq!(parse_host("example.com.."), Err(HostError::EmptyLabel));
        assert_eq!(parse_host("a..b"), Err(HostError::EmptyLabel));
        assert_eq!(parse_host("user@example.com"), Err(HostError::Userinfo));
        assert_eq!(parse_host("ex%61mple.com"), Err(HostError::PercentEncoding));
        assert_eq!(parse_host("*.example.com"), Err(HostError::InvalidChar('*')));
        assert_eq!(parse_host("exa mple.com"), Err(HostError::InvalidChar(' ')));
        assert_eq!(parse_host("exa\0mple.com"), Err(HostError::InvalidChar('\0')));
        assert_eq!(parse_host(&"a".repeat(64)), Err(HostError::LabelTooLong));
        assert_eq!(parse_host(&"a.".repeat(130)), Err(HostError::TooLong));
    }

    #[test]
    fn authorities() {
        assert_eq!(
            parse_authority("Example.com:443"),
            Ok((Host::Name("example.com".into()), 443))
        );
        assert_eq!(parse_authority("[::1]:80"), Ok((Host::Ip("::1".parse().unwrap()), 80)));
        assert_eq!(parse_authority("example.com"), Err(AuthorityError::MissingPort));
        assert_eq!(parse_authority("example.com:0"), Err(AuthorityError::BadPort));
        assert_eq!(parse_authority("example.com:65536"), Err(AuthorityError::BadPort));
        assert_eq!(parse_authority("example.com:+80"), Err(AuthorityError::BadPort));
        assert_eq!(parse_authority("example.com:"), Err(AuthorityError::BadPort));
        assert_eq!(parse_authority("[::1]"), Err(AuthorityError::MissingPort));
        assert!(parse_authority("::1:80").is_err());
    }

    proptest::proptest! {
        #[test]
        fn parse_host_never_panics_and_is_idempotent(s in "\\PC{0,80}") {
            if let Ok(h) = parse_host(&s) {
                let again = parse_host(&h.to_string());
                match (&h, again) {
                    (Host::Name(_), Ok(h2)) => proptest::prop_assert_eq!(h, h2),
                    (Host::Ip(_), Ok(Host::Ip(_))) => {}
                    (_, other) => proptest::prop_assert!(false, "re-parse of {} gave {:?}", h, other),
                }
            }
        }

        #[test]
        fn dotted_quads_round_trip(a: u8, b: u8, c: u8, d: u8) {
            let ip = Ipv4Addr::new(a, b, c, d);
            proptest::prop_assert_eq!(parse_host(&ip.to_string()), Ok(Host::Ip(IpAddr::V4(ip))));
            proptest::prop_assert_eq!(parse_host(&u32::from(ip).to_string()), Ok(Host::Ip(IpAddr::V4(ip))));
            proptest::prop_assert_eq!(parse_host(&format!("0x{:x}", u32::from(ip))), Ok(Host::Ip(IpAddr::V4(ip))));
        }
    }
}
