use super::*;
use proptest::prelude::*;
use serde::Deserialize;
use std::time::Duration;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn at(unix: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(unix)
}

const AKID: &str = "AKIDEXAMPLE";
const SECRET: &str = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY";
/// 2015-08-30T12:36:00Z.
const T0: u64 = 1_440_938_160;

fn keys(token: Option<&str>) -> Keys<'_> {
    Keys {
        access_key_id: AKID,
        secret_access_key: SECRET,
        session_token: token,
    }
}

fn request<'a>(path: &'a str, query: &'a str, headers: &'a [(&'a str, &'a str)]) -> Request<'a> {
    Request {
        method: "GET",
        path,
        query,
        headers,
        payload_hash: EMPTY_SHA256,
        also_sign: &[],
    }
}

fn canonical(req: &Request, service: &str, token: Option<&str>) -> String {
    canonical_request(req, service, "20150830T123600Z", token).0
}

// --- HMAC-SHA256 ---

#[test]
fn hmac_sha256_matches_rfc4231_cases_1_to_4() {
    let cases: [(Vec<u8>, Vec<u8>, &str); 4] = [
        (
            vec![0x0b; 20],
            b"Hi There".to_vec(),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7",
        ),
        (
            b"Jefe".to_vec(),
            b"what do ya want for nothing?".to_vec(),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
        ),
        (
            vec![0xaa; 20],
            vec![0xdd; 50],
            "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe",
        ),
        (
            (1..=25).collect(),
            vec![0xcd; 50],
            "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b",
        ),
    ];
    for (i, (key, data, want)) in cases.iter().enumerate() {
        assert_eq!(hex(&hmac_sha256(key, data)), *want, "RFC 4231 test case {}", i + 1);
    }
}

#[test]
fn hmac_sha256_hashes_a_key_longer_than_the_block_rfc4231_cases_6_and_7() {
    let key = [0xaa; 131];
    assert_eq!(
        hex(&hmac_sha256(
            &key,
            b"Test Using Larger Than Block-Size Key - Hash Key First"
        )),
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
    );
    let data = b"This is a test using a larger than block-size key and a larger than block-size data. \
The key needs to be hashed before being used by the HMAC algorithm.";
    assert_eq!(
        hex(&hmac_sha256(&key, data)),
        "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"
    );
    // A key of one block is used as it is, one byte more is hashed (the
    // answers of Python's `hmac` module).
    assert_eq!(
        hex(&hmac_sha256(&[7; 64], b"x")),
        "72eb5e2941defeb37ad65961919eebff581f6ccb397a04d3ae80f705019c2356"
    );
    assert_eq!(
        hex(&hmac_sha256(&[7; 65], b"x")),
        "089d3b040b4df3b1c1a5a61006abce46402a775de368c0303def8bbc5887459f"
    );
}

// --- botocore's answers ---

#[derive(Deserialize)]
struct Vectors {
    generator: String,
    vectors: Vec<Vector>,
}

#[derive(Deserialize)]
struct Vector {
    name: String,
    method: String,
    path: String,
    query: String,
    headers: Vec<(String, String)>,
    payload_hash: String,
    also_sign: Vec<String>,
    access_key_id: String,
    secret_access_key: String,
    session_token: Option<String>,
    region: String,
    service: String,
    unix_time: u64,
    expected: Expected,
}

#[derive(Deserialize)]
struct Expected {
    authorization: String,
    amz_date: String,
    security_token: Option<String>,
    canonical_request: String,
}

#[test]
fn signs_every_botocore_vector_exactly() {
    let all: Vectors = serde_json::from_str(include_str!("../../../tests/credentials/sigv4_vectors.json")).unwrap();
    assert!(all.generator.contains("botocore"), "{}", all.generator);
    assert!(all.vectors.len() >= 15, "{} vectors", all.vectors.len());
    let mut failed = Vec::new();
    for v in &all.vectors {
        let headers: Vec<(&str, &str)> = v.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        let also_sign: Vec<&str> = v.also_sign.iter().map(String::as_str).collect();
        let req = Request {
            method: &v.method,
            path: &v.path,
            query: &v.query,
            headers: &headers,
            payload_hash: &v.payload_hash,
            also_sign: &also_sign,
        };
        let keys = Keys {
            access_key_id: &v.access_key_id,
            secret_access_key: &v.secret_access_key,
            session_token: v.session_token.as_deref(),
        };
        let scope = Scope {
            region: &v.region,
            service: &v.service,
        };
        let signed = sign(&req, &keys, &scope, at(v.unix_time));
        let ours = canonical_request(&req, &v.service, &signed.amz_date, v.session_token.as_deref()).0;
        if signed.authorization != v.expected.authorization
            || signed.amz_date != v.expected.amz_date
            || signed.security_token != v.expected.security_token
            || ours != v.expected.canonical_request
        {
            failed.push(format!(
                "{}:\n  ours:     {}\n  botocore: {}\n  our canonical request:\n{ours}\n  botocore's:\n{}",
                v.name, signed.authorization, v.expected.authorization, v.expected.canonical_request
            ));
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} vectors differ:\n{}",
        failed.len(),
        all.vectors.len(),
        failed.join("\n\n")
    );
}

// --- streaming uploads: the documented S3 example ---

#[test]
fn reproduces_the_documented_streaming_put_seed_and_chunk_signatures() {
    let headers = [
        ("Host", "s3.amazonaws.com"),
        ("x-amz-date", "20130524T000000Z"),
        ("x-amz-storage-class", "REDUCED_REDUNDANCY"),
        ("Authorization", "SignatureToBeCalculated"),
        ("x-amz-content-sha256", "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"),
        ("Content-Encoding", "aws-chunked"),
        ("x-amz-decoded-content-length", "66560"),
        ("Content-Length", "66824"),
    ];
    let req = Request {
        method: "PUT",
        path: "/examplebucket/chunkObject.txt",
        query: "",
        headers: &headers,
        payload_hash: "STREAMING-AWS4-HMAC-SHA256-PAYLOAD",
        also_sign: &["Content-Encoding", "Content-Length"],
    };
    let keys = Keys {
        access_key_id: "AKIAIOSFODNN7EXAMPLE",
        secret_access_key: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        session_token: None,
    };
    let scope = Scope {
        region: "us-east-1",
        service: "s3",
    };
    // 2013-05-24T00:00:00Z.
    let signed = sign(&req, &keys, &scope, at(1_369_353_600));
    assert_eq!(signed.amz_date, "20130524T000000Z");
    assert_eq!(signed.scope, "20130524/us-east-1/s3/aws4_request");
    assert_eq!(
        signed.signature,
        "4f232c4386841ef735655705268965c44a0e4690baa4adea153f7db9fa80a0a9"
    );
    assert_eq!(
        signed.authorization,
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, \
         SignedHeaders=content-encoding;content-length;host;x-amz-content-sha256;x-amz-date;\
         x-amz-decoded-content-length;x-amz-storage-class, \
         Signature=4f232c4386841ef735655705268965c44a0e4690baa4adea153f7db9fa80a0a9"
    );

    let payload = vec![b'a'; 66_560];
    let (first, second) = payload.split_at(65_536);
    let want = [
        "ad80c730a21e5b8d04586a2213dd63b9a0e99e0e2307b0ade35a65485a288648",
        "0055627c9e194cb4542bae2aa5492e3c1575bbb81b612b7d234b86a503ef5497",
        "b6c6ea8a5354eaf15b3cb7646744f4275b71ea724fed81ceb9323e279d449df9",
    ];
    let mut previous = signed.signature.clone();
    for (chunk, want) in [first, second, &[][..]].into_iter().zip(want) {
        let sig = chunk_signature(&signed.signing_key, &signed.amz_date, &signed.scope, &previous, chunk);
        assert_eq!(sig, want, "chunk of {} bytes", chunk.len());
        previous = sig;
    }
}

// --- the canonical request's rules ---

#[test]
fn an_empty_path_is_the_root_for_every_service() {
    for service in ["s3", "iam"] {
        let c = canonical(&request("", "", &[]), service, None);
        assert!(c.starts_with("GET\n/\n\n"), "{service}: {c}");
    }
}

#[test]
fn other_services_normalize_the_path_like_botocore_and_encode_it_again() {
    let cases = [
        ("/", "/"),
        ("//", "/"),
        ("/a/", "/a/"),
        ("/a/..", "/"),
        ("/a/b/..", "/a"),
        ("/a/b/../", "/a/"),
        ("/../../x", "/x"),
        ("/./a/./", "/a/"),
        ("a/b", "a/b"),
        ("..", ""),
        ("/%2E%2E/x", "/%252E%252E/x"),
        ("/a b/%20/~", "/a%20b/%2520/~"),
    ];
    for (path, want) in cases {
        let mut out = String::new();
        canonical_uri(&mut out, path, false);
        assert_eq!(out, want, "{path}");
        // S3 keeps what was sent.
        let mut s3 = String::new();
        canonical_uri(&mut s3, path, true);
        assert_eq!(s3, path);
    }
}

#[test]
fn the_query_is_decoded_then_encoded_strictly_and_sorted() {
    let cases = [
        ("", ""),
        ("a=1&&b=2&", "a=1&b=2"),
        ("b=2&a=3&a=1", "a=1&a=3&b=2"),
        ("flag", "flag="),
        ("=x", "=x"),
        // A raw '+' is a plus, never a space.
        ("q=a+b%20c", "q=a%2Bb%20c"),
        ("q=%2b%2B", "q=%2B%2B"),
        // Unreserved characters are never escaped; everything else is, once.
        ("k=%7E%41-_.~", "k=~A-_.~"),
        ("k=a=b/c?d", "k=a%3Db%2Fc%3Fd"),
        ("k=%", "k=%25"),
        ("k=%4", "k=%254"),
        ("k=%zz", "k=%25zz"),
        ("k=%C3%A9&k=\u{e9}", "k=%C3%A9&k=%C3%A9"),
        // Invalid UTF-8 once decoded is still encoded byte by byte.
        ("k=%FF", "k=%FF"),
        // Sorted on the encoded form: '%' (0x25) before letters.
        ("z=1&%C3%A9=2&A=3", "%C3%A9=2&A=3&z=1"),
    ];
    for (query, want) in cases {
        let mut out = String::new();
        canonical_query(&mut out, query);
        assert_eq!(out, want, "{query}");
    }
}

#[test]
fn signs_only_the_headers_it_should_with_values_trimmed() {
    let headers = [
        ("HOST", "example.com"),
        ("User-Agent", "curl/8"),
        ("Accept", "*/*"),
        ("Authorization", "Bearer old"),
        ("X-Amz-Date", "20000101T000000Z"),
        ("Content-Type", " text/plain ;\t charset=utf-8 "),
        ("x-amz-meta-a", "one"),
        ("X-AMZ-META-A", "  two  three "),
        ("x-amzn-trace-id", "Root=1"),
        ("X-Custom", "x\u{1f}y\u{a0} z"),
    ];
    let req = Request {
        also_sign: &["x-custom"],
        ..request("/", "", &headers)
    };
    let (c, signed) = canonical_request(&req, "s3", "20150830T123600Z", None);
    assert_eq!(signed, "content-type;host;x-amz-date;x-amz-meta-a;x-custom");
    assert!(
        c.contains(
            "content-type:text/plain ; charset=utf-8\nhost:example.com\nx-amz-date:20150830T123600Z\n\
             x-amz-meta-a:one,two three\nx-custom:x y z\n\n"
        ),
        "{c}"
    );
}

#[test]
fn the_session_token_is_the_signers_own() {
    let headers = [("Host", "h"), ("X-Amz-Security-Token", "old")];
    let req = request("/", "", &headers);
    let s = sign(
        &req,
        &keys(Some("new")),
        &Scope {
            region: "r",
            service: "s",
        },
        at(T0),
    );
    assert_eq!(s.security_token.as_deref(), Some("new"));
    assert!(canonical(&req, "s", Some("new")).contains("x-amz-security-token:new\n"));
    // Without a token of its own, the request's header is signed as sent.
    let s = sign(
        &req,
        &keys(None),
        &Scope {
            region: "r",
            service: "s",
        },
        at(T0),
    );
    assert_eq!(s.security_token, None);
    assert!(s
        .authorization
        .contains("SignedHeaders=host;x-amz-date;x-amz-security-token,"));
    assert!(canonical(&req, "s", None).contains("x-amz-security-token:old\n"));
}

#[test]
fn the_method_is_upper_cased() {
    assert!(canonical(&request("/", "", &[]), "s3", None).starts_with("GET\n"));
    let req = Request {
        method: "put",
        ..request("/", "", &[])
    };
    assert!(canonical(&req, "s3", None).starts_with("PUT\n"));
}

#[test]
fn formats_the_date_in_utc_and_keeps_four_digit_years() {
    assert_eq!(amz_date(UNIX_EPOCH), "19700101T000000Z");
    assert_eq!(amz_date(at(T0)), "20150830T123600Z");
    assert_eq!(
        amz_date(at(1_709_251_199) + Duration::from_millis(999)),
        "20240229T235959Z"
    );
    assert_eq!(amz_date(UNIX_EPOCH - Duration::from_millis(1)), "19691231T235959Z");
    assert_eq!(amz_date(UNIX_EPOCH - Duration::from_secs(86_400)), "19691231T000000Z");
    assert_eq!(amz_date(at(u64::MAX / 4)), "99991231T235959Z");
    let signed = sign(
        &request("/", "", &[]),
        &keys(None),
        &Scope {
            region: "r",
            service: "s",
        },
        at(T0),
    );
    assert_eq!(signed.scope, "20150830/r/s/aws4_request");
    assert!(signed.authorization.starts_with(
        "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/r/s/aws4_request, SignedHeaders=x-amz-date, Signature="
    ));
}

#[test]
fn the_signing_key_is_the_documented_chain() {
    // The derivation example of the SigV4 documentation (iam, 20120215).
    let key = signing_key(
        "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
        "20120215",
        "us-east-1",
        "iam",
    );
    assert_eq!(
        key.to_vec(),
        unhex("f4780e2d9f65fa895f9c67b32ce1baf0b0d8a43505a000a1a9e090d414db404d")
    );
}

// --- reading another signer's header and query ---

#[test]
fn parses_the_header_it_writes() {
    let headers = [
        ("Host", "iam.amazonaws.com"),
        ("Content-Type", "application/x-www-form-urlencoded"),
    ];
    let signed = sign(
        &request("/", "Action=ListUsers&Version=2010-05-08", &headers),
        &keys(None),
        &Scope {
            region: "us-east-1",
            service: "iam",
        },
        at(T0),
    );
    let parsed = parse_authorization(&signed.authorization).unwrap();
    assert_eq!(
        parsed,
        Parsed {
            access_key_id: AKID.into(),
            date: "20150830".into(),
            region: "us-east-1".into(),
            service: "iam".into(),
            signed_headers: vec!["content-type".into(), "host".into(), "x-amz-date".into()],
            signature: signed.signature.clone(),
        }
    );
}

const SIG: &str = "5d672d79c15b13162d9279b0855cfba6789a8edb4c82c400e06b5924a6f2b5d7";

#[test]
fn parses_variants_of_spacing_and_order() {
    let cred = "Credential=AKIDEXAMPLE/20150830/us-east-1/iam/aws4_request";
    let ok = [
        format!("AWS4-HMAC-SHA256 {cred}, SignedHeaders=host;x-amz-date, Signature={SIG}"),
        format!("AWS4-HMAC-SHA256 {cred},SignedHeaders=host;x-amz-date,Signature={SIG}"),
        format!("  AWS4-HMAC-SHA256\t{cred} ,  SignedHeaders=host;x-amz-date ,\tSignature={SIG}  "),
        format!("AWS4-HMAC-SHA256 Signature={SIG}, SignedHeaders=host;x-amz-date, {cred}"),
    ];
    for h in ok {
        let p = parse_authorization(&h).unwrap_or_else(|| panic!("{h}"));
        assert_eq!(p.service, "iam");
        assert_eq!(p.signed_headers, ["host", "x-amz-date"]);
        assert_eq!(p.signature, SIG);
    }
}

#[test]
fn rejects_what_is_not_a_sigv4_header() {
    let cred = "Credential=AKIDEXAMPLE/20150830/us-east-1/iam/aws4_request";
    let sh = "SignedHeaders=host;x-amz-date";
    let sig = format!("Signature={SIG}");
    let bad = [
        String::new(),
        "garbage".into(),
        "AWS4-HMAC-SHA256".into(),
        "AWS4-HMAC-SHA256 ".into(),
        "Bearer abc".into(),
        format!("AWS AKIDEXAMPLE:{SIG}"),
        // Wrong algorithm, or not a word of its own.
        format!("AWS4-HMAC-SHA1 {cred}, {sh}, {sig}"),
        format!("aws4-hmac-sha256 {cred}, {sh}, {sig}"),
        format!("AWS4-ECDSA-P256-SHA256 {cred}, {sh}, {sig}"),
        format!("AWS4-HMAC-SHA256-PAYLOAD {cred}, {sh}, {sig}"),
        format!("AWS4-HMAC-SHA256{cred}, {sh}, {sig}"),
        // Missing, repeated, unknown or empty parts.
        format!("AWS4-HMAC-SHA256 {sh}, {sig}"),
        format!("AWS4-HMAC-SHA256 {cred}, {sig}"),
        format!("AWS4-HMAC-SHA256 {cred}, {sh}"),
        format!("AWS4-HMAC-SHA256 {cred}, {cred}, {sh}, {sig}"),
        format!("AWS4-HMAC-SHA256 {cred}, {sh}, {sig}, Extra=1"),
        format!("AWS4-HMAC-SHA256 {cred}, {sh}, {sig},"),
        format!("AWS4-HMAC-SHA256 {cred} {sh} {sig}"),
        format!("AWS4-HMAC-SHA256 credential=AKIDEXAMPLE/20150830/us-east-1/iam/aws4_request, {sh}, {sig}"),
        // A bad credential.
        format!("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/iam, {sh}, {sig}"),
        format!("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/iam/aws4_request/x, {sh}, {sig}"),
        format!("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/iam/aws5_request, {sh}, {sig}"),
        format!("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/2015083/us-east-1/iam/aws4_request, {sh}, {sig}"),
        format!("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/2015O830/us-east-1/iam/aws4_request, {sh}, {sig}"),
        format!("AWS4-HMAC-SHA256 Credential=/20150830/us-east-1/iam/aws4_request, {sh}, {sig}"),
        format!("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830//iam/aws4_request, {sh}, {sig}"),
        format!("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1//aws4_request, {sh}, {sig}"),
        format!("AWS4-HMAC-SHA256 Credential=AKID EXAMPLE/20150830/us-east-1/iam/aws4_request, {sh}, {sig}"),
        // Bad signed headers or signature.
        format!("AWS4-HMAC-SHA256 {cred}, SignedHeaders=, {sig}"),
        format!("AWS4-HMAC-SHA256 {cred}, SignedHeaders=host;;x-amz-date, {sig}"),
        format!("AWS4-HMAC-SHA256 {cred}, SignedHeaders=host; x-amz-date, {sig}"),
        format!("AWS4-HMAC-SHA256 {cred}, {sh}, Signature="),
        format!("AWS4-HMAC-SHA256 {cred}, {sh}, Signature={}", &SIG[1..]),
        format!("AWS4-HMAC-SHA256 {cred}, {sh}, Signature={SIG}0"),
        format!("AWS4-HMAC-SHA256 {cred}, {sh}, Signature={}g", &SIG[1..]),
    ];
    for h in bad {
        assert_eq!(parse_authorization(&h), None, "{h}");
    }
}

#[test]
fn tells_presigned_query_strings() {
    let presigned = [
        "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKID%2F20150830%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Signature=abc",
        "x-amz-signature=abc",
        "a=1&X-AMZ-CREDENTIAL=x",
        "X-Amz-Signature",
        "X%2DAmz%2DSignature=abc",
        "a=1&&X-Amz-Credential=",
        "AWSAccessKeyId=loom-cred-x&Signature=biTg%2BwC0hE%3D&Expires=1796581499",
    ];
    for q in presigned {
        assert!(is_presigned(q), "{q}");
    }
    let plain = [
        "",
        "&",
        "a=X-Amz-Signature",
        "X-Amz-Date=20150830T123600Z&X-Amz-Algorithm=AWS4-HMAC-SHA256",
        "X-Amz-Signatures=1",
        "X-Amz-Signature%3D=1",
        "prefix=X-Amz-Credential",
        "Signature=abc",
        "AWSAccessKeyId=abc",
    ];
    for q in plain {
        assert!(!is_presigned(q), "{q}");
    }
    let keys = [
        (
            "X-Amz-Credential=AKID%2F20150830%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Signature=abc",
            Some("AKID"),
        ),
        ("AWSAccessKeyId=loom-cred-x&Signature=abc", Some("loom-cred-x")),
        ("x-amz-credential=", Some("")),
        ("Signature=abc", None),
    ];
    for (q, want) in keys {
        assert_eq!(presigned_key_id(q).as_deref(), want, "{q}");
    }
}

proptest! {
    #[test]
    fn reading_never_panics(s in "\\PC{0,200}") {
        let _ = parse_authorization(&s);
        let _ = is_presigned(&s);
    }

    #[test]
    fn a_mangled_header_parses_or_not_but_never_panics(
        cut in 0usize..200,
        insert in "[ ,=/;\t]{0,3}",
    ) {
        let h = format!(
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/iam/aws4_request, \
             SignedHeaders=host;x-amz-date, Signature={SIG}"
        );
        let cut = cut.min(h.len());
        let mangled = format!("{}{insert}{}", &h[..cut], &h[cut..]);
        if let Some(p) = parse_authorization(&mangled) {
            prop_assert_eq!(p.date.len(), 8);
            prop_assert_eq!(p.signature.len(), 64);
        }
    }

    #[test]
    fn signing_never_panics_and_round_trips(
        method in "\\PC{0,8}",
        path in "\\PC{0,40}",
        query in "\\PC{0,40}",
        name in "\\PC{0,12}",
        value in "\\PC{0,20}",
        service in "[a-z0-9-]{1,12}",
        region in "[a-z0-9-]{1,12}",
        secs in any::<u64>(),
        token in proptest::option::of("\\PC{0,20}"),
    ) {
        let headers = [(name.as_str(), value.as_str()), ("host", "h")];
        let req = Request { method: &method, path: &path, query: &query, headers: &headers, payload_hash: EMPTY_SHA256, also_sign: &[] };
        let keys = Keys { access_key_id: AKID, secret_access_key: SECRET, session_token: token.as_deref() };
        let scope = Scope { region: &region, service: &service };
        let Some(t) = UNIX_EPOCH.checked_add(Duration::from_secs(secs)) else {
            return Ok(());
        };
        let signed = sign(&req, &keys, &scope, t);
        let parsed = parse_authorization(&signed.authorization).unwrap();
        prop_assert_eq!(parsed.region, region);
        prop_assert_eq!(parsed.service, service);
        prop_assert_eq!(parsed.signature, signed.signature);
        prop_assert_eq!(parsed.date.as_str(), &signed.amz_date[..8]);
        prop_assert!(parsed.signed_headers.iter().any(|h| h == "x-amz-date"));
    }
}
