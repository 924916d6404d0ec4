//! The data path without sockets to the outside or a DNS server: a fake
//! resolver, a dialer that hands out pre-connected loopback sockets (whose
//! far end the test plays as the origin), and a client on an in-memory
//! duplex. Time is paused, so deadlines and idle timeouts fire exactly when
//! nothing else can happen, whatever the machine's load.

use super::*;
use crate::addrs::SelfAddrs;
use crate::dns::{Dial, Resolve};
use crate::facts::MemorySink;
use crate::metrics::Metrics;
use crate::runs::NewRun;
use crate::state::Parts;
use bytes::Bytes;
use egress_config::Config;
use futures_util::future::BoxFuture;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use std::io;
use std::sync::Mutex;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const SECRET: &str = "0123456789abcdef0123456789abcdef0123456789abcdef";
/// The address the fake resolver answers (a documentation range, exempted
/// by the test config's `allow_ranges`); never dialled for real.
const ORIGIN_IP: &str = "203.0.113.5";

/// Resolves every name to [`ORIGIN_IP`]; dials by handing out the client
/// end of a connected loopback pair, and records what it was asked to dial.
struct FakeNet {
    pending: Mutex<Vec<TcpStream>>,
    dialled: Mutex<Vec<SocketAddr>>,
}

impl Resolve for FakeNet {
    fn resolve<'a>(&'a self, _name: &'a str) -> BoxFuture<'a, Result<Vec<IpAddr>, DnsError>> {
        Box::pin(async { Ok(vec![ORIGIN_IP.parse().unwrap()]) })
    }
}

impl Dial for FakeNet {
    fn dial(&self, addr: SocketAddr) -> BoxFuture<'static, io::Result<TcpStream>> {
        self.dialled.lock().unwrap().push(addr);
        let s = self.pending.lock().unwrap().pop();
        Box::pin(async move { s.ok_or_else(|| io::Error::new(io::ErrorKind::ConnectionRefused, "no origin")) })
    }
}

/// A connected loopback pair made with blocking calls (no timer involved).
fn pair() -> (TcpStream, TcpStream) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    for s in [&a, &b] {
        s.set_nonblocking(true).unwrap();
    }
    (TcpStream::from_std(a).unwrap(), TcpStream::from_std(b).unwrap())
}

struct Proxy {
    sh: Arc<Shared>,
    net: Arc<FakeNet>,
    run: Arc<Run>,
}

impl Proxy {
    /// A proxy whose tool `t` may reach `api.test` on 80 and 443, with one run.
    fn new(tool: &str) -> Proxy {
        let text = format!(
            "[proxy]\nallow_ranges = [\"203.0.113.0/24\"]\ntunnel_idle_timeout_ms = 2000\n[tools.t]\negress = [\"api.test:80\", \"api.test:443\"]\n{tool}\n"
        );
        let cfg = Config::parse(&text, "test").unwrap();
        let net = Arc::new(FakeNet {
            pending: Mutex::new(Vec::new()),
            dialled: Mutex::new(Vec::new()),
        });
        let sh = Shared::new(
            &cfg,
            Parts {
                control_tls: None,
                principals: egress_config::principals::Principals::single("test-control-token-0123456789"),
                envelope: None,
                exporter: None,
                proxy_scheme: "http",
                facts: Arc::new(MemorySink::new(100)),
                decisions: Arc::new(crate::facts::decisions::DecisionLog::off()),
                metrics: Metrics::new(),
                resolver: net.clone(),
                dialer: net.clone(),
                me: SelfAddrs::default(),
                proxy_authority: "127.0.0.1:3128".into(),
                control_token: "t".repeat(32),
                config_path: None,
                tls: None,
                ca: crate::ca::Authority::open(&egress_config::ProxyConfig {
                    facts: ":memory:".into(),
                    ..Default::default()
                })
                .unwrap(),
            },
        );
        let t = cfg.policy.tool("t").unwrap();
        let run = sh
            .runs
            .create(
                NewRun {
                    principal: None,
                    executables: Default::default(),
                    creator: None,
                    id: "r1".into(),
                    tool: Arc::from("t"),
                    labels: Default::default(),
                    owner: None,
                    activate: true,
                    max_slots: t.max_concurrent_fetches,
                    max_waiting: t.max_queued_fetches,
                    max_conns: 8,
                    placeholders: vec![],
                },
                SECRET.into(),
            )
            .unwrap();
        Proxy { sh, net, run }
    }

    /// Adds an origin connection for the next dial; returns its far end.
    fn origin(&self) -> TcpStream {
        let (near, far) = pair();
        self.net.pending.lock().unwrap().push(near);
        far
    }

    /// A raw client connection to the data path (an in-memory duplex).
    fn connection(&self) -> tokio::io::DuplexStream {
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let sh = self.sh.clone();
        let conn = Arc::new(sh.data_admission.admit(tokio_util::sync::CancellationToken::new()));
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| handle(sh.clone(), req, conn.clone()));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(server_io), svc)
                .with_upgrades()
                .await;
        });
        client_io
    }

    /// An HTTP/1.1 client connection to the data path.
    async fn client(&self) -> SendRequest<Full<Bytes>> {
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(self.connection()))
            .await
            .unwrap();
        tokio::spawn(conn.with_upgrades());
        sender
    }

    fn slots_in_use(&self) -> usize {
        self.run.max_slots - self.run.slots.available_permits()
    }

    /// After a fetch ended: its slot is back and one timeout was counted
    /// in `phase`.
    async fn assert_timed_out(&self, phase: &str) {
        tokio::task::yield_now().await;
        assert_eq!(self.slots_in_use(), 0);
        let series = format!("egress_timeouts_total{{tool=\"t\",phase=\"{phase}\"}} 1");
        assert!(self.sh.metrics.render().contains(&series), "{series}");
    }
}

/// `fut`, or a failed test when it has not finished within a minute of
/// (paused) time: a cut that never comes fails the test instead of
/// hanging it.
async fn within<F: std::future::Future>(fut: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(60), fut)
        .await
        .expect("still waiting after a minute: nothing cut it")
}

fn request(method: &str, uri: &str, body: &'static str) -> Request<Full<Bytes>> {
    let auth = format!("Basic {}", base64_encode(&format!("r1:{SECRET}")));
    Request::builder()
        .method(method)
        .uri(uri)
        .header("host", "api.test")
        .header("proxy-authorization", auth)
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

fn base64_encode(s: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(s)
}

fn header<B>(r: &Response<B>, name: &str) -> String {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

/// Reads an HTTP/1.1 request head from the origin's end.
async fn read_head(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut b = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut b).await.unwrap();
        assert!(n > 0, "the proxy closed before the request head");
        buf.extend_from_slice(&b[..n]);
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// An origin that never answers: the fetch ends at its deadline with
/// `504 timeout` in the `response` phase, and the slot comes back.
#[tokio::test(start_paused = true)]
async fn a_silent_origin_times_out_at_the_deadline_and_frees_the_slot() {
    let p = Proxy::new("fetch_timeout_ms = 1000\nmax_concurrent_fetches = 1");
    let mut origin = p.origin();
    let mut c = p.client().await;
    let t0 = Instant::now();
    let resp = within(c.send_request(request("GET", "http://api.test/x", "")))
        .await
        .unwrap();
    assert_eq!(resp.status(), 504);
    assert_eq!(header(&resp, respond::ERROR_HEADER), "timeout");
    assert_eq!(Instant::now() - t0, Duration::from_millis(1000));
    assert!(read_head(&mut origin).await.starts_with("GET /x HTTP/1.1\r\n"));
    assert_eq!(*p.net.dialled.lock().unwrap(), vec!["203.0.113.5:80".parse().unwrap()]);
    p.assert_timed_out("response").await;
}

/// A response body the origin stops sending is cut at the deadline: the
/// client sees the body fail, the fetch is a timeout, the slot comes back.
#[tokio::test(start_paused = true)]
async fn a_stalled_response_body_is_cut_at_the_deadline() {
    let p = Proxy::new("fetch_timeout_ms = 3000");
    let mut origin = p.origin();
    let mut c = p.client().await;
    let t0 = Instant::now();
    let pending = tokio::spawn(c.send_request(request("GET", "http://api.test/big", "")));
    read_head(&mut origin).await;
    origin
        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nhalf")
        .await
        .unwrap();
    let resp = pending.await.unwrap().unwrap();
    assert_eq!(resp.status(), 200);
    assert!(
        within(resp.into_body().collect()).await.is_err(),
        "the body must not complete"
    );
    assert_eq!(Instant::now() - t0, Duration::from_millis(3000));
    p.assert_timed_out("response").await;
}

/// An upload the client never finishes, into an origin that already
/// answered, is cut at the deadline (phase `upload`).
#[tokio::test(start_paused = true)]
async fn an_endless_upload_is_cut_at_the_deadline() {
    let p = Proxy::new("fetch_timeout_ms = 2000");
    let mut origin = p.origin();
    let (mut rd, mut wr) = tokio::io::split(p.connection());
    let t0 = Instant::now();
    let auth = format!("Basic {}", base64_encode(&format!("r1:{SECRET}")));
    let head = format!(
        "POST http://api.test/up HTTP/1.1\r\nhost: api.test\r\nproxy-authorization: {auth}\r\ncontent-length: 1000000\r\n\r\nstart"
    );
    wr.write_all(head.as_bytes()).await.unwrap();
    read_head(&mut origin).await;
    origin
        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = within(rd.read_to_end(&mut answer)).await;
    assert!(String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 200 OK"));
    assert_eq!(Instant::now() - t0, Duration::from_millis(2000));
    p.assert_timed_out("upload").await;
}

/// A CONNECT tunnel nobody uses is closed after `tunnel_idle_timeout`, and
/// its slot comes back; bytes before that are relayed both ways.
#[tokio::test(start_paused = true)]
async fn an_idle_tunnel_is_closed_after_the_idle_timeout() {
    let p = Proxy::new("fetch_timeout_ms = 60000");
    let mut origin = p.origin();
    let mut c = p.client().await;
    let resp = c.send_request(request("CONNECT", "api.test:443", "")).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut tunnel = TokioIo::new(hyper::upgrade::on(resp).await.unwrap());
    tunnel.write_all(b"ping").await.unwrap();
    let mut b = [0u8; 4];
    origin.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"ping");
    origin.write_all(b"pong").await.unwrap();
    tunnel.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"pong");
    let t0 = Instant::now();
    let mut rest = Vec::new();
    let _ = within(tunnel.read_to_end(&mut rest)).await;
    assert_eq!(Instant::now() - t0, Duration::from_millis(2000));
    assert_eq!(*p.net.dialled.lock().unwrap(), vec!["203.0.113.5:443".parse().unwrap()]);
    tokio::task::yield_now().await;
    assert_eq!(p.slots_in_use(), 0);
}

/// The fake resolver answers a loopback address: the fetch is denied
/// `private_address` before any dial, with a fact.
#[tokio::test(start_paused = true)]
async fn vetting_denies_before_dialling() {
    struct Loopback;
    impl Resolve for Loopback {
        fn resolve<'a>(&'a self, _name: &'a str) -> BoxFuture<'a, Result<Vec<IpAddr>, DnsError>> {
            Box::pin(async { Ok(vec!["127.0.0.1".parse().unwrap()]) })
        }
    }
    let p = Proxy::new("");
    let mut sh = Arc::into_inner(p.sh).unwrap_or_else(|| panic!("shared state still shared"));
    sh.resolver = Arc::new(Loopback);
    let p = Proxy {
        sh: Arc::new(sh),
        net: p.net,
        run: p.run,
    };
    let mut c = p.client().await;
    let resp = c.send_request(request("GET", "http://api.test/", "")).await.unwrap();
    assert_eq!(resp.status(), 403);
    assert_eq!(header(&resp, respond::DENY_HEADER), "private_address");
    assert!(!header(&resp, respond::FACT_HEADER).is_empty());
    assert!(p.net.dialled.lock().unwrap().is_empty());
}

/// A DNS query message for `name` of type `qtype`.
fn dns_query(name: &str, qtype: hickory_proto::rr::RecordType) -> Vec<u8> {
    use hickory_proto::op::{Message, MessageType, OpCode, Query};
    use hickory_proto::rr::Name;
    use std::str::FromStr;
    let mut m = Message::new(0x4242, MessageType::Query, OpCode::Query);
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(Name::from_str(name).unwrap(), qtype));
    m.to_vec().unwrap()
}

#[tokio::test]
async fn the_sandbox_dns_answers_listed_names_with_synthetic_addresses_and_records_the_others() {
    use crate::data::entrance::dns::answer;
    use hickory_proto::op::{Message, ResponseCode};
    use hickory_proto::rr::{RData, RecordType};
    let p = Proxy::new("");
    let reply = |b: Vec<u8>| Message::from_vec(&b).unwrap();
    let a = reply(
        answer(&p.sh, &p.run, &dns_query("API.test.", RecordType::A))
            .await
            .unwrap(),
    );
    assert_eq!(a.metadata.id, 0x4242);
    assert_eq!(a.metadata.response_code, ResponseCode::NoError);
    let addrs: Vec<_> = a
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect();
    assert_eq!(addrs, ["198.18.0.1".parse::<std::net::Ipv4Addr>().unwrap()]);
    // The same address again; AAAA and TXT answered empty.
    let again = reply(
        answer(&p.sh, &p.run, &dns_query("api.test", RecordType::A))
            .await
            .unwrap(),
    );
    assert_eq!(again.answers.len(), 1);
    for t in [RecordType::AAAA, RecordType::TXT] {
        let r = reply(answer(&p.sh, &p.run, &dns_query("api.test", t)).await.unwrap());
        assert_eq!(
            (r.metadata.response_code, r.answers.len()),
            (ResponseCode::NoError, 0),
            "{t}"
        );
    }
    // A connection to it is to the name.
    let dest = crate::data::entrance::transparent::destination(&p.run, "198.18.0.1:443".parse().unwrap());
    assert_eq!(dest.to_string(), "api.test:443");
    let dest = crate::data::entrance::transparent::destination(&p.run, "198.18.0.9:443".parse().unwrap());
    assert_eq!(dest.to_string(), "198.18.0.9:443", "never handed out: an address");
    // A name no rule lists: NXDOMAIN, recorded first, and never resolved.
    let d = reply(
        answer(&p.sh, &p.run, &dns_query("c2VjcmV0.evil.test", RecordType::TXT))
            .await
            .unwrap(),
    );
    assert_eq!(d.metadata.response_code, ResponseCode::NXDomain);
    let facts =
        p.sh.facts
            .query(crate::facts::FactQuery {
                after: 0,
                limit: 100,
                run_id: None,
            })
            .await
            .unwrap();
    let f = facts.last().unwrap();
    assert_eq!(f.reason, "not_allowlisted");
    let t = f.target.as_ref().unwrap();
    assert_eq!((t.kind.as_str(), t.host.as_str()), ("dns", "c2vjcmv0.evil.test"));
    // Not a query: no answer.
    assert!(answer(&p.sh, &p.run, b"\x00\x01garbage").await.is_none());
}

/// A fetch authenticated on the proxy's own listener for a created run
/// waits for the run's activation; if the run is bound to a handed-over
/// listener meanwhile (a hand-off of a run its creator did not declare
/// bound), the fetch is refused when it resumes (`credential_elsewhere`,
/// with a fact on the run), and nothing is dialled.
#[tokio::test(start_paused = true)]
async fn a_fetch_held_for_its_activation_is_refused_if_the_run_is_bound_meanwhile() {
    let p = Proxy::new("");
    let w =
        p.sh.runs
            .create(
                NewRun {
                    id: "w".into(),
                    principal: None,
                    executables: Default::default(),
                    creator: None,
                    tool: Arc::from("t"),
                    labels: Default::default(),
                    owner: None,
                    activate: false,
                    max_slots: 1,
                    max_waiting: 1,
                    max_conns: 8,
                    placeholders: vec![],
                },
                SECRET.into(),
            )
            .unwrap();
    let mut client = p.client().await;
    let req = Request::builder()
        .uri("http://api.test/")
        .header("host", "api.test")
        .header(
            "proxy-authorization",
            format!("Basic {}", base64_encode(&format!("w:{SECRET}"))),
        )
        .body(Full::new(Bytes::new()))
        .unwrap();
    let answer = tokio::spawn(client.send_request(req));
    // Paused time moves only once every task waits: the fetch is held.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!answer.is_finished());
    assert!(w.bind());
    p.sh.activate_run("w").unwrap();
    let r = within(answer).await.unwrap().unwrap();
    assert_eq!(
        (r.status().as_u16(), header(&r, "x-egress-deny-reason")),
        (407, "credential_elsewhere".to_owned())
    );
    assert!(p.net.dialled.lock().unwrap().is_empty());
    let facts =
        p.sh.facts
            .query(crate::facts::FactQuery {
                after: 0,
                limit: 100,
                run_id: Some("w".into()),
            })
            .await
            .unwrap();
    assert_eq!(facts.len(), 1, "{facts:?}");
    assert_eq!(facts[0].reason, "credential_elsewhere");
}
