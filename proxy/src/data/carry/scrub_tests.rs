use super::*;
use crate::runs::{NewRun, Placeholder, Runs};
use egress_config::{Config, Secret};
use proptest::prelude::*;
use std::time::Duration;
use tokio::time::Instant;

const SECRET: &str = "sk-LIVE/abc 123";
const PH: &str = "loom-cred-00112233445566778899aabbccddeeff";

/// Tool `t` with credential `api` (`Bearer ${secret}`) loaded, and a run
/// holding its placeholder.
fn world(secret: &str, value: &str) -> (Arc<ToolPolicy>, Arc<Run>) {
    let text = format!(
        "[tools.t]\negress = [\"api.example:443\"]\n[tools.t.credentials.api]\nhosts = [\"api.example:443\"]\nvalue = \"{value}\"\nsecret = {{ env = \"X\" }}\nplaceholder_env = \"API\"\n"
    );
    let mut c = Config::parse(&text, "t").unwrap();
    let p = Arc::make_mut(&mut c.policy);
    Arc::make_mut(p.tools.get_mut("t").unwrap()).credentials[0].secret = Secret::new(secret);
    p.index_secrets();
    let tool = p.tools["t"].clone();
    let runs = Runs::new(10, Duration::from_secs(60));
    let run = runs
        .create(
            NewRun {
                principal: None,
                executables: Default::default(),
                creator: None,
                id: "r".into(),
                tool: Arc::from("t"),
                labels: Default::default(),
                owner: None,
                activate: true,
                max_slots: 1,
                max_waiting: 1,
                max_conns: 1,
                placeholders: vec![Placeholder {
                    credential: "api".into(),
                    value: PH.into(),
                }],
            },
            "x".into(),
        )
        .unwrap();
    (tool, run)
}

fn scrub() -> (Scrub, Arc<Run>, Family<ToolCredential, Counter>) {
    let (tool, run) = world(SECRET, "Bearer ${secret}");
    let family = Family::default();
    (Scrub::new(&tool, &run, &family).unwrap(), run, family)
}

/// Feeds `chunks` through a scrubber; returns each output and the whole.
fn stream(s: &mut Scrub, chunks: &[&[u8]]) -> (Vec<Bytes>, Vec<u8>) {
    let mut outs = vec![];
    for (i, c) in chunks.iter().enumerate() {
        outs.push(s.chunk(Bytes::copy_from_slice(c), i + 1 == chunks.len()));
    }
    let whole = outs.iter().flat_map(|b| b.iter().copied()).collect();
    (outs, whole)
}

#[test]
fn every_form_of_the_secret_becomes_the_placeholder_wherever_chunks_split() {
    let body = format!(
        "{{\"authorization\": \"Bearer {SECRET}\", \"q\": \"k=sk-LIVE/abc%20123\", \"json\": \"sk\\u002DLIVE\\/abc 123\", \"form\": \"sk-LIVE%2fabc+123\", \"html\": \"sk-LIVE&#47;abc&#x20;123\"}}"
    );
    let want = format!(
        "{{\"authorization\": \"Bearer {PH}\", \"q\": \"k={PH}\", \"json\": \"{PH}\", \"form\": \"{PH}\", \"html\": \"{PH}\"}}"
    );
    let b = body.as_bytes();
    for a in 0..b.len() {
        for z in [a, (a + 7).min(b.len()), b.len()] {
            let (mut s, run, family) = scrub();
            let (_, whole) = stream(&mut s, &[&b[..a], &b[a..z], &b[z..]]);
            assert_eq!(String::from_utf8(whole).unwrap(), want, "split at {a}, {z}");
            assert_eq!(run.scrubbed().collect::<Vec<_>>(), [("api", 5)]);
            let counted = family
                .get_or_create(&ToolCredential {
                    tool: "t".into(),
                    credential: "api".into(),
                })
                .get();
            assert_eq!(counted, 5);
        }
    }
}

#[test]
fn a_chunk_that_cannot_begin_a_secret_goes_on_at_once_and_uncopied() {
    let (mut s, _, _) = scrub();
    let event = Bytes::from_static(b"event: tick\ndata: {\"n\": 1}\n\n");
    let out = s.chunk(event.clone(), false);
    assert_eq!(out, event);
    assert_eq!(out.as_ptr(), event.as_ptr(), "passed on without a copy");
    assert!(!s.holding());
}

#[test]
fn only_an_end_that_could_begin_a_secret_waits_and_it_goes_at_the_end() {
    let (mut s, _, _) = scrub();
    assert_eq!(s.chunk(Bytes::from_static(b"data: sk-LI"), false), "data: ");
    assert!(s.holding());
    // Not the secret after all: released with the next bytes.
    assert_eq!(s.chunk(Bytes::from_static(b"ON\n\n"), false), "sk-LION\n\n");
    assert_eq!(s.chunk(Bytes::from_static(b"x sk-"), false), "x ");
    assert_eq!(
        s.chunk(Bytes::new(), true),
        "sk-",
        "the end of the body releases the rest"
    );
    assert!(!s.holding());
}

#[test]
fn a_held_back_end_is_bounded_by_the_longest_form() {
    let (mut s, _, _) = scrub();
    let longest = s.tool.secrets.longest();
    // Every byte fed one at a time: never more than the longest spelling
    // less one waits, and every spelling is replaced.
    let text = b"sk-LIVE%2Fabc%20123 sk\\u002dLIVE/abc+123 sk-LIVE&#x2f;abc&#32;123 ".repeat(2);
    let mut out = vec![];
    for &b in text.iter() {
        out.extend_from_slice(&s.chunk(Bytes::copy_from_slice(&[b]), false));
        assert!(s.carry.len() < longest, "{}", s.carry.len());
    }
    out.extend_from_slice(&s.chunk(Bytes::new(), true));
    assert_eq!(String::from_utf8(out).unwrap(), format!("{PH} {PH} {PH} ").repeat(2));
}

#[test]
fn heads_and_trailers_are_scrubbed_and_lose_their_length() {
    let (mut s, _, _) = scrub();
    let resp = http::Response::builder()
        .status(302)
        .header("location", "https://api.example/next?key=sk-LIVE%2Fabc%20123")
        .header("set-cookie", format!("k=Bearer {SECRET}; Path=/"))
        .header("x-sk-live", "kept")
        .header("content-length", "40")
        .extension(hyper::ext::ReasonPhrase::try_from(format!("Found {SECRET}").into_bytes()).unwrap())
        .body(())
        .unwrap();
    let (mut parts, ()) = resp.into_parts();
    s.head(Relay::Body, &mut parts);
    assert_eq!(parts.headers["location"], format!("https://api.example/next?key={PH}"));
    assert_eq!(parts.headers["set-cookie"], format!("k=Bearer {PH}; Path=/"));
    assert_eq!(parts.headers["x-sk-live"], "kept");
    assert!(parts.headers.get("content-length").is_none());
    assert!(parts.extensions.get::<hyper::ext::ReasonPhrase>().is_none());
    // A secret in a header's name.
    let (tool, run) = world("x-sk-live-abc-123", "${secret}");
    let mut s = Scrub::new(&tool, &run, &Family::default()).unwrap();
    let mut h = HeaderMap::new();
    h.insert(
        HeaderName::from_static("x-sk-live-abc-123"),
        HeaderValue::from_static("1"),
    );
    s.headers(&mut h);
    assert_eq!(h.keys().map(|k| k.as_str()).collect::<Vec<_>>(), [PH]);
}

/// A body of `frames`.
fn frames(f: Vec<Frame<Bytes>>) -> impl Body<Data = Bytes, Error = std::convert::Infallible> + Unpin {
    http_body_util::StreamBody::new(futures_util::stream::iter(f.into_iter().map(Ok)))
}

#[tokio::test]
async fn a_body_where_none_may_be_is_read_to_its_end_and_refused_at_its_first_byte() {
    let mut t = HeaderMap::new();
    t.insert("x-echo", HeaderValue::from_static("done"));
    let empty = || Frame::data(Bytes::new());
    let mut ok = frames(vec![empty(), empty(), Frame::trailers(t)]);
    assert_eq!(drain_empty(&mut ok, None).await.unwrap().unwrap()["x-echo"], "done");
    let mut none = frames(vec![empty()]);
    assert_eq!(drain_empty(&mut none, None).await, Ok(None));
    let mut bytes = frames(vec![empty(), Frame::data(Bytes::from_static(SECRET.as_bytes()))]);
    assert_eq!(drain_empty(&mut bytes, None).await, Err(()));
    // A body that never ends stops at the bound: nothing relayed.
    let mut endless = http_body_util::StreamBody::new(futures_util::stream::pending::<
        Result<Frame<Bytes>, std::convert::Infallible>,
    >());
    let soon = Instant::now() + Duration::from_millis(20);
    assert_eq!(drain_empty(&mut endless, Some(soon)).await, Ok(None));
}

#[test]
fn requests_ask_for_the_whole_body_in_identity() {
    let mut h = HeaderMap::new();
    h.insert(header::ACCEPT_ENCODING, HeaderValue::from_static("gzip, br"));
    h.insert(header::RANGE, HeaderValue::from_static("bytes=3-9"));
    h.insert(header::IF_RANGE, HeaderValue::from_static("\"e\""));
    ask_scrubbable(&mut h);
    assert_eq!(h.len(), 1);
    assert_eq!(h[header::ACCEPT_ENCODING], "identity");
}

#[tokio::test]
async fn the_body_keeps_its_frames_scrubbed_and_its_trailers_last() {
    let (s, _, _) = scrub();
    let mut trailers = HeaderMap::new();
    trailers.insert("x-echo", HeaderValue::from_str(&format!("Bearer {SECRET}")).unwrap());
    let frames: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = vec![
        Ok(Frame::data(Bytes::from_static(b"a sk-LIVE/a"))),
        Ok(Frame::data(Bytes::from_static(b"bc 123 b sk-"))),
        Ok(Frame::trailers(trailers)),
    ];
    let inner = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
    let mut body = Scrubbed::new(inner, Some(s));
    let mut data = vec![];
    let mut got_trailers = None;
    while let Some(f) = body.frame().await {
        let f = f.unwrap();
        assert!(got_trailers.is_none(), "trailers come last");
        match f.into_data() {
            Ok(d) => data.extend_from_slice(&d),
            Err(f) => got_trailers = f.into_trailers().ok(),
        }
    }
    assert_eq!(String::from_utf8(data).unwrap(), format!("a {PH} b sk-"));
    assert_eq!(got_trailers.unwrap()["x-echo"], format!("Bearer {PH}"));
    assert!(body.is_end_stream());
}

#[test]
fn a_body_without_scrubber_is_passed_as_is() {
    let inner = http_body_util::Full::new(Bytes::from_static(b"12345"));
    let body = Scrubbed::new(inner, None);
    assert_eq!(body.size_hint().exact(), Some(5));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// Any body made of secrets, their forms, their beginnings and other
    /// text, split anywhere: the output is the body with every secret
    /// replaced, and holds no secret.
    #[test]
    fn streaming_equals_replacing_the_whole(
        parts in proptest::collection::vec(
            prop_oneof![
                Just(SECRET.to_owned()),
                Just("sk-LIVE%2Fabc%20123".to_owned()),
                Just("sk\\u002dLIVE/abc&#32;123".to_owned()),
                (1..SECRET.len()).prop_map(|n| SECRET[..n].to_owned()),
                (1..19usize).prop_map(|n| "sk-LIVE%2Fabc%20123"[..n].to_owned()),
                "[a-z /%&#;\\\\0-9]{0,12}",
            ],
            0..12,
        ),
        cuts in proptest::collection::vec(0usize..400, 0..8),
    ) {
        let body = parts.concat().into_bytes();
        let (tool, _) = world(SECRET, "Bearer ${secret}");
        let mut want = vec![];
        let mut at = 0;
        for f in tool.secrets.find_all(&body) {
            want.extend_from_slice(&body[at..f.start]);
            want.extend_from_slice(PH.as_bytes());
            at = f.end;
        }
        want.extend_from_slice(&body[at..]);
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(body.len())).collect();
        cuts.sort_unstable();
        let mut chunks: Vec<&[u8]> = vec![];
        let mut from = 0;
        for c in cuts {
            chunks.push(&body[from..c]);
            from = c;
        }
        chunks.push(&body[from..]);
        let (mut s, _, _) = scrub();
        let (_, whole) = stream(&mut s, &chunks);
        prop_assert_eq!(&whole, &want);
        prop_assert!(tool.secrets.find(&whole).is_none());
    }
}
