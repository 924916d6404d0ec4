//! AWS Signature Version 4: the `Authorization` header of a request to an
//! AWS service (or one that speaks its protocol), the signatures of an
//! `aws-chunked` streaming upload's chunks, and the reading of a header or
//! query string another signer wrote.
//!
//! Pure: no I/O and no clock (the caller passes the time), and no panic on
//! any input. HMAC-SHA256 (RFC 2104) is written here over `sha2`.
//!
//! The canonical request follows botocore's `SigV4Auth` / `S3SigV4Auth`
//! (the vectors of `tests/credentials/sigv4_vectors.py` are its answers),
//! with three choices of this signer's own, each the receiving service's
//! reading of the wire rather than botocore's reading of its own request:
//! - the query is percent-decoded and re-encoded (botocore re-encodes only
//!   parameters it holds decoded, and takes a URL's query as written); a
//!   raw `+` is a literal plus (`%2B`), never a space;
//! - an empty parameter (`a=1&&b=2`) is dropped (botocore signs it as `=`);
//! - an empty S3 path is `/` (botocore signs an empty line; on the wire
//!   the path is never empty).
//!
//! Which headers are signed is the caller's request, not everything it
//! holds: `host`, every `x-amz-*`, `content-type`, `content-md5`, and the
//! names the caller adds (botocore signs every header but a few
//! hop-by-hop ones).

use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

/// The algorithm's name, first word of the header and of the string to sign.
const ALGORITHM: &str = "AWS4-HMAC-SHA256";
/// The string to sign of a streaming upload's chunk starts with this.
const CHUNK_ALGORITHM: &str = "AWS4-HMAC-SHA256-PAYLOAD";
/// The last component of every credential scope.
const TERMINATOR: &str = "aws4_request";
/// Hex SHA-256 of the empty string.
const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
/// 0000-01-01T00:00:00Z and 9999-12-31T23:59:59Z: the times whose year
/// has four digits. A time outside is signed as the nearest one.
const MIN_UNIX: i64 = -62_167_219_200;
const MAX_UNIX: i64 = 253_402_300_799;

/// Keys to sign with.
pub struct Keys<'a> {
    pub access_key_id: &'a str,
    pub secret_access_key: &'a str,
    pub session_token: Option<&'a str>,
}

/// What is signed.
#[derive(Clone, Copy)]
pub struct Request<'a> {
    pub method: &'a str,
    /// The request target's path as sent on the wire (already
    /// percent-encoded by the client), e.g. "/bucket/my%20key".
    pub path: &'a str,
    /// The raw query string without '?', possibly empty.
    pub query: &'a str,
    /// Every header of the request as (name, value), any case, in order;
    /// the signer signs `host`, every `x-amz-*` header, `content-type` and
    /// `content-md5` if present (lower-cased names, values trimmed and
    /// inner runs of white space collapsed, multiple values joined with
    /// ','), plus any extra names in `also_sign`. `X-Amz-Date` (always)
    /// and `X-Amz-Security-Token` (when the keys have a token) are the
    /// signer's own: values of theirs here are ignored. `Authorization` is
    /// never signed.
    pub headers: &'a [(&'a str, &'a str)],
    /// The hex SHA-256 of the payload, or "UNSIGNED-PAYLOAD", or
    /// "STREAMING-AWS4-HMAC-SHA256-PAYLOAD".
    pub payload_hash: &'a str,
    /// More header names to sign, any case.
    pub also_sign: &'a [&'a str],
}

/// Where the signature is valid.
#[derive(Debug, Clone, Copy)]
pub struct Scope<'a> {
    pub region: &'a str,
    pub service: &'a str,
}

/// The headers to set on the request: Authorization, X-Amz-Date, and
/// X-Amz-Security-Token when a session token is given (the caller removes
/// the old ones first; X-Amz-Date and X-Amz-Security-Token are themselves
/// signed: they are in the canonical headers as if present).
pub struct Signed {
    pub authorization: String,
    /// `YYYYMMDD'T'HHMMSS'Z'`.
    pub amz_date: String,
    pub security_token: Option<String>,
    /// The hex signature (the seed of a streaming upload's chunk signatures).
    pub signature: String,
    /// The key derived for the scope and day (signs a streaming upload's chunks).
    pub signing_key: [u8; 32],
    /// `YYYYMMDD/region/service/aws4_request`.
    pub scope: String,
}

/// Signs a request at a time.
pub fn sign(req: &Request, keys: &Keys, scope: &Scope, at: SystemTime) -> Signed {
    let amz_date = amz_date(at);
    let day = amz_date.get(..8).unwrap_or_default();
    let credential_scope = format!("{day}/{}/{}/{TERMINATOR}", scope.region, scope.service);
    let (canonical, signed_headers) = canonical_request(req, scope.service, &amz_date, keys.session_token);
    let string_to_sign = format!(
        "{ALGORITHM}\n{amz_date}\n{credential_scope}\n{}",
        hex(&Sha256::digest(canonical.as_bytes()))
    );
    let signing_key = signing_key(keys.secret_access_key, day, scope.region, scope.service);
    let signature = hex(&hmac_sha256(&signing_key, string_to_sign.as_bytes()));
    let authorization = format!(
        "{ALGORITHM} Credential={}/{credential_scope}, SignedHeaders={signed_headers}, Signature={signature}",
        keys.access_key_id
    );
    Signed {
        authorization,
        amz_date,
        security_token: keys.session_token.map(str::to_owned),
        signature,
        signing_key,
        scope: credential_scope,
    }
}

/// A parsed `Authorization: AWS4-HMAC-SHA256 Credential=..., SignedHeaders=..., Signature=...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    pub access_key_id: String,
    /// `YYYYMMDD`.
    pub date: String,
    pub region: String,
    pub service: String,
    pub signed_headers: Vec<String>,
    /// 64 hex digits.
    pub signature: String,
}

/// Parses an `Authorization: AWS4-HMAC-SHA256 Credential=AKID/20150830/us-east-1/iam/aws4_request,
/// SignedHeaders=..., Signature=...` header's value; None if it is not one.
///
/// The three components are required, once each, in any order, separated
/// by ',' and optional white space; nothing else is allowed. The credential
/// has five non-empty parts, a date of eight digits and `aws4_request`
/// last; the signed headers are non-empty names without white space; the
/// signature is 64 hex digits.
pub fn parse_authorization(h: &str) -> Option<Parsed> {
    let rest = h.trim_matches(is_ows).strip_prefix(ALGORITHM)?;
    // The algorithm is a word of its own.
    if !rest.starts_with(is_ows) {
        return None;
    }
    let (mut credential, mut signed, mut signature) = (None, None, None);
    for part in rest.split(',') {
        let (name, value) = part.trim_matches(is_ows).split_once('=')?;
        let slot = match name {
            "Credential" => &mut credential,
            "SignedHeaders" => &mut signed,
            "Signature" => &mut signature,
            _ => return None,
        };
        if slot.replace(value).is_some() {
            return None;
        }
    }
    let mut cred = credential?.split('/');
    let (access_key_id, date, region, service, terminator) =
        (cred.next()?, cred.next()?, cred.next()?, cred.next()?, cred.next()?);
    if cred.next().is_some()
        || terminator != TERMINATOR
        || date.len() != 8
        || !date.bytes().all(|b| b.is_ascii_digit())
        || [access_key_id, region, service]
            .iter()
            .any(|p| p.is_empty() || p.contains(is_ows))
    {
        return None;
    }
    let signed_headers: Vec<String> = signed?.split(';').map(str::to_owned).collect();
    if signed_headers
        .iter()
        .any(|n| n.is_empty() || n.contains(char::is_whitespace))
    {
        return None;
    }
    let signature = signature?;
    if signature.len() != 64 || !signature.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    Some(Parsed {
        access_key_id: access_key_id.to_owned(),
        date: date.to_owned(),
        region: region.to_owned(),
        service: service.to_owned(),
        signed_headers,
        signature: signature.to_owned(),
    })
}

/// Whether a query string is a presigned URL's: it has a parameter named
/// X-Amz-Signature or X-Amz-Credential (SigV4), or both AWSAccessKeyId and
/// Signature (SigV2, what boto3 presigns S3 URLs with by default); names
/// in any case, percent-decoded.
pub fn is_presigned(query: &str) -> bool {
    let named = |want: &[u8]| {
        query.split('&').any(|p| {
            let name = percent_decode(p.split_once('=').map_or(p, |(n, _)| n));
            name.eq_ignore_ascii_case(want)
        })
    };
    named(b"x-amz-signature") || named(b"x-amz-credential") || (named(b"awsaccesskeyid") && named(b"signature"))
}

/// The key id of a presigned query: its `X-Amz-Credential`'s part before
/// the first '/', or its `AWSAccessKeyId` (percent-decoded); None without
/// either.
pub fn presigned_key_id(query: &str) -> Option<String> {
    query.split('&').find_map(|p| {
        let (n, v) = p.split_once('=').unwrap_or((p, ""));
        let n = percent_decode(n);
        let v = String::from_utf8_lossy(&percent_decode(v)).into_owned();
        if n.eq_ignore_ascii_case(b"x-amz-credential") {
            Some(v.split('/').next().unwrap_or_default().to_owned())
        } else if n.eq_ignore_ascii_case(b"awsaccesskeyid") {
            Some(v)
        } else {
            None
        }
    })
}

/// The signature of one chunk of an aws-chunked streaming upload
/// (STREAMING-AWS4-HMAC-SHA256-PAYLOAD): the string to sign is
/// "AWS4-HMAC-SHA256-PAYLOAD\n" + amz_date + "\n" + scope + "\n" +
/// previous_signature + "\n" + hex(sha256("")) + "\n" + hex(sha256(chunk_data)).
/// The first chunk's previous signature is the request's (the seed); the
/// last chunk is empty.
pub fn chunk_signature(
    signing_key: &[u8; 32],
    amz_date: &str,
    scope: &str,
    previous_signature: &str,
    chunk_data: &[u8],
) -> String {
    let string_to_sign = format!(
        "{CHUNK_ALGORITHM}\n{amz_date}\n{scope}\n{previous_signature}\n{EMPTY_SHA256}\n{}",
        hex(&Sha256::digest(chunk_data))
    );
    hex(&hmac_sha256(signing_key, string_to_sign.as_bytes()))
}

/// The canonical request and its signed header names (`a;b;c`).
fn canonical_request(req: &Request, service: &str, amz_date: &str, token: Option<&str>) -> (String, String) {
    let mut headers: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let also: Vec<String> = req.also_sign.iter().map(|n| n.to_lowercase()).collect();
    for (name, value) in req.headers {
        let name = name.to_lowercase();
        let ours = name == "x-amz-date" || (token.is_some() && name == "x-amz-security-token");
        let wanted = matches!(name.as_str(), "host" | "content-type" | "content-md5")
            || name.starts_with("x-amz-")
            || also.contains(&name);
        if wanted && !ours && name != "authorization" {
            headers.entry(name).or_default().push(trim_all(value));
        }
    }
    headers.insert("x-amz-date".to_owned(), vec![amz_date.to_owned()]);
    if let Some(token) = token {
        headers.insert("x-amz-security-token".to_owned(), vec![trim_all(token)]);
    }

    let mut out = String::new();
    out.push_str(&req.method.to_uppercase());
    out.push('\n');
    canonical_uri(&mut out, req.path, service == "s3");
    out.push('\n');
    canonical_query(&mut out, req.query);
    out.push('\n');
    for (name, values) in &headers {
        out.push_str(name);
        out.push(':');
        out.push_str(&values.join(","));
        out.push('\n');
    }
    out.push('\n');
    let signed = headers.keys().map(String::as_str).collect::<Vec<_>>().join(";");
    out.push_str(&signed);
    out.push('\n');
    out.push_str(req.payload_hash);
    (out, signed)
}

/// S3: the path as sent. Other services: dot segments and empty segments
/// removed (botocore's `remove_dot_segments`), then every byte but an
/// unreserved one and '/' percent-encoded (a '%' the client sent becomes
/// `%25`: the path is encoded twice).
fn canonical_uri(out: &mut String, path: &str, s3: bool) {
    if path.is_empty() {
        out.push('/');
    } else if s3 {
        out.push_str(path);
    } else {
        let mut kept: Vec<&str> = Vec::new();
        for segment in path.split('/') {
            match segment {
                "" | "." => {}
                ".." => {
                    kept.pop();
                }
                s => kept.push(s),
            }
        }
        let first = if path.starts_with('/') { "/" } else { "" };
        let last = if path.ends_with('/') && !kept.is_empty() {
            "/"
        } else {
            ""
        };
        let normalized = format!("{first}{}{last}", kept.join("/"));
        percent_encode(out, normalized.as_bytes(), true);
    }
}

/// Parameters split on '&' (empty ones dropped), name and value split on
/// the first '=' (none: an empty value), each percent-decoded and encoded
/// again strictly, sorted by encoded name then value.
fn canonical_query(out: &mut String, query: &str) {
    let mut pairs: Vec<(String, String)> = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (name, value) = p.split_once('=').unwrap_or((p, ""));
            let (mut n, mut v) = (String::new(), String::new());
            percent_encode(&mut n, &percent_decode(name), false);
            percent_encode(&mut v, &percent_decode(value), false);
            (n, v)
        })
        .collect();
    pairs.sort();
    for (i, (name, value)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push('&');
        }
        out.push_str(name);
        out.push('=');
        out.push_str(value);
    }
}

/// RFC 3986 percent-encoding of everything but the unreserved characters
/// (and '/' if asked), upper-case hex.
fn percent_encode(out: &mut String, bytes: &[u8], keep_slash: bool) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for &b in bytes {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') || (keep_slash && b == b'/') {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0x0f)]));
        }
    }
}

/// `%XX` (either case) to its byte; anything else, a stray '%' or '+'
/// included, as it is.
fn percent_decode(s: &str) -> Vec<u8> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        let hi = bytes.get(i + 1).and_then(|&c| hex_value(c));
        let lo = bytes.get(i + 2).and_then(|&c| hex_value(c));
        match (b, hi, lo) {
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi << 4) | lo);
                i += 3;
            }
            _ => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

fn hex_value(c: u8) -> Option<u8> {
    char::from(c).to_digit(16).and_then(|d| u8::try_from(d).ok())
}

/// A header value trimmed and its inner runs of white space made one space
/// (botocore's `' '.join(value.split())`: Python's white space, which is
/// Unicode's plus the separators U+001C..U+001F).
fn trim_all(value: &str) -> String {
    value
        .split(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
        .filter(|w| !w.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// HTTP's optional white space.
fn is_ows(c: char) -> bool {
    c == ' ' || c == '\t'
}

/// `kSigning` of the documentation: HMAC chain from "AWS4" + secret over
/// the day, region, service and `aws4_request`.
fn signing_key(secret: &str, day: &str, region: &str, service: &str) -> [u8; 32] {
    let k_secret = format!("AWS4{secret}");
    let k_date = hmac_sha256(k_secret.as_bytes(), day.as_bytes());
    let k_region = hmac_sha256(&k_date, region.as_bytes());
    let k_service = hmac_sha256(&k_region, service.as_bytes());
    hmac_sha256(&k_service, TERMINATOR.as_bytes())
}

/// HMAC (RFC 2104) over SHA-256, block size 64.
fn hmac_sha256(key: &[u8], data: &[u8]) -> [u8; 32] {
    let mut block = [0u8; 64];
    if key.len() > block.len() {
        let digest = Sha256::digest(key);
        block.iter_mut().zip(digest.iter()).for_each(|(b, k)| *b = *k);
    } else {
        block.iter_mut().zip(key).for_each(|(b, k)| *b = *k);
    }
    let inner = Sha256::new()
        .chain_update(block.map(|b| b ^ 0x36))
        .chain_update(data)
        .finalize();
    Sha256::new()
        .chain_update(block.map(|b| b ^ 0x5c))
        .chain_update(inner)
        .finalize()
        .into()
}

/// Lower-case hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(char::from(HEX[usize::from(b >> 4)]));
        s.push(char::from(HEX[usize::from(b & 0x0f)]));
    }
    s
}

/// `YYYYMMDD'T'HHMMSS'Z'` (UTC), whole seconds (a time before 1970 rounds
/// down like one after it).
fn amz_date(at: SystemTime) -> String {
    let secs = match at.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => {
            let d = e.duration();
            let whole = i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
            -whole.saturating_add(i64::from(d.subsec_nanos() > 0))
        }
    };
    let t = time::OffsetDateTime::from_unix_timestamp(secs.clamp(MIN_UNIX, MAX_UNIX))
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    format!(
        "{:04}{:02}{:02}T{:02}{:02}{:02}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

#[cfg(test)]
#[path = "sigv4_tests.rs"]
mod tests;
