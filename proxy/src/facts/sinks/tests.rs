use super::*;
use crate::facts::decisions::{Decision, DecisionLog, Floor, Limits};
use crate::facts::{FactSink, MemorySink};
use egress_config::audit::FileSink;
use egress_config::Decisions;
use std::collections::HashSet;
use std::path::Path;

struct NoDns;
impl Resolve for NoDns {
    fn resolve<'a>(
        &'a self,
        _name: &'a str,
    ) -> futures_util::future::BoxFuture<'a, Result<Vec<std::net::IpAddr>, crate::dns::DnsError>> {
        Box::pin(async { Ok(vec![]) })
    }
}

fn decision(i: usize) -> Decision {
    serde_json::from_value(serde_json::json!({
        "seq": 0, "at": crate::time::rfc3339(SystemTime::now()), "run_id": "r", "tool": "t", "kind": "connect",
        "target": format!("h{i}.example:443"), "host": format!("h{i}.example"), "port": 443, "method": "CONNECT",
        "outcome": "ok", "bytes_up": 1, "bytes_down": 2, "duration_ms": 3, "policy": "sha256:x"
    }))
    .unwrap()
}

fn fact(i: usize) -> crate::facts::Fact {
    crate::facts::denial(crate::facts::NewFact {
        run_id: Some("r"),
        tool: Some("t"),
        reason: "not_allowlisted",
        mode: "enforce",
        target: Some(crate::facts::FactTarget {
            kind: "connect".into(),
            host: format!("evil{i}.example"),
            port: 443,
        }),
        resolved: vec![],
        policy: "sha256:x",
        detail: String::new(),
        run: None,
    })
}

fn file_sink(path: &Path) -> AuditConfig {
    let mut cfg = AuditConfig::default();
    cfg.sinks.insert(
        "local".into(),
        SinkConfig {
            batch_max: 7,
            batch_max_bytes: 1 << 20,
            flush: Duration::from_millis(10),
            timeout: Duration::from_secs(5),
            retry_max: Duration::from_millis(200),
            kind: SinkKind::File(FileSink {
                path: path.to_owned(),
                max_file_bytes: 1 << 30,
                max_files: 2,
            }),
        },
    );
    cfg
}

/// The (log, uid) of every whole line the file sink wrote so far (a line
/// being written while this reads is left for the next look).
fn uids(path: &Path) -> Vec<(String, String)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .split_inclusive('\n')
        .filter(|l| l.ends_with('\n'))
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["metadata"]["log_name"].as_str().unwrap().to_owned(),
                v["metadata"]["uid"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = std::time::Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(20), "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fact_and_decision_reaches_a_file_sink_once_and_the_cursors_move() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("events.jsonl");
    let facts: Arc<dyn FactSink> = Arc::new(MemorySink::new(10_000));
    let decisions = Arc::new(DecisionLog::open(
        Decisions::All,
        None,
        Limits {
            max_bytes: 1 << 30,
            retention: Duration::from_secs(3600),
            floor: Floor::default(),
            cell: None,
        },
        Default::default(),
        Arc::default(),
    ));
    for i in 0..30 {
        facts.record(fact(i)).await.unwrap();
        decisions.offer(decision(i));
    }
    let metrics = AuditMetrics::default();
    let source = Source {
        facts: facts.clone(),
        decisions: decisions.clone(),
        version: "test",
        integrity: None,
    };
    start(
        &file_sink(&path),
        Some("cell-a"),
        source,
        Arc::new(NoDns),
        metrics.clone(),
        &|_| None,
    )
    .unwrap();
    until("60 lines", || uids(&path).len() >= 60).await;
    for i in 30..40 {
        facts.record(fact(i)).await.unwrap();
    }
    until("cursor 40", || facts.cursor("sink:local:facts") == 40).await;
    until("cursor 30", || facts.cursor("sink:local:decisions") == 30).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let got = uids(&path);
    assert_eq!(got.len(), 70, "a record was sent twice");
    let distinct: HashSet<&(String, String)> = got.iter().collect();
    assert_eq!(distinct.len(), 70);
    assert_eq!(got.iter().filter(|(l, _)| l == "facts").count(), 40);
    assert_eq!(facts.cursor("sink:local:facts"), 40);
    assert_eq!(facts.cursor("sink:local:decisions"), 30);
    let label = |log| SinkLog {
        sink: "local".into(),
        log,
    };
    assert_eq!(metrics.exported.get_or_create(&label("facts")).get(), 40);
    assert_eq!(metrics.exported.get_or_create(&label("decisions")).get(), 30);
    until("lag 0", || metrics.lag.get_or_create(&label("facts")).get() == 0).await;
    assert!(
        metrics
            .last_success
            .get_or_create(&SinkLabel { sink: "local".into() })
            .get()
            > 0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_sink_counts_its_failures_retries_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // The sink's directory is a file at first: every write fails.
    let blocker = dir.path().join("d");
    std::fs::write(&blocker, b"").unwrap();
    let path = blocker.join("events.jsonl");
    let facts: Arc<dyn FactSink> = Arc::new(MemorySink::new(10_000));
    for i in 0..5 {
        facts.record(fact(i)).await.unwrap();
    }
    let metrics = AuditMetrics::default();
    let source = Source {
        facts: facts.clone(),
        decisions: Arc::new(DecisionLog::off()),
        version: "test",
        integrity: None,
    };
    start(
        &file_sink(&path),
        None,
        source,
        Arc::new(NoDns),
        metrics.clone(),
        &|_| None,
    )
    .unwrap();
    let write = SinkKindLabel {
        sink: "local".into(),
        kind: "write",
    };
    until("failures", || metrics.failures.get_or_create(&write).get() >= 2).await;
    assert_eq!(facts.cursor("sink:local:facts"), 0, "the cursor moved without delivery");
    std::fs::remove_file(&blocker).unwrap();
    until("cursor 5", || facts.cursor("sink:local:facts") == 5).await;
    assert_eq!(uids(&path).len(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_deleted_before_export_are_counted_as_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("events.jsonl");
    let facts: Arc<dyn FactSink> = Arc::new(MemorySink::new(10_000));
    // A decision log of ~10 records: the oldest go beyond its budget.
    let decisions = Arc::new(DecisionLog::open(
        Decisions::All,
        None,
        Limits {
            max_bytes: 5000,
            retention: Duration::from_secs(3600),
            floor: Floor::default(),
            cell: None,
        },
        Default::default(),
        Arc::default(),
    ));
    decisions.offer(decision(0));
    until("head 1", || decisions.head() == 1).await;
    facts.set_cursor("sink:local:decisions", 1).await.unwrap();
    for i in 1..200 {
        decisions.offer(decision(i));
    }
    until("head 200", || decisions.head() == 200).await;
    let metrics = AuditMetrics::default();
    let source = Source {
        facts: facts.clone(),
        decisions: decisions.clone(),
        version: "test",
        integrity: None,
    };
    start(
        &file_sink(&path),
        None,
        source,
        Arc::new(NoDns),
        metrics.clone(),
        &|_| None,
    )
    .unwrap();
    until("cursor 200", || facts.cursor("sink:local:decisions") == 200).await;
    let exported = uids(&path).len() as u64;
    let dropped = metrics
        .dropped
        .get_or_create(&SinkLog {
            sink: "local".into(),
            log: "decisions",
        })
        .get();
    assert!(dropped > 100, "dropped {dropped}");
    assert_eq!(exported + dropped, 199, "each of 2..=200 is exported or counted");
}

#[test]
fn a_missing_headers_variable_or_bad_headers_stop_the_start() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let cfg = egress_config::Config::parse(
            "[audit.sinks.siem]\ntype = \"otlp\"\nendpoint = \"http://127.0.0.1:4318\"\nheaders_env = \"LOOM_T_HEADERS\"\n",
            "f.toml",
        )
        .unwrap();
        let source = Source {
            facts: Arc::new(MemorySink::new(10)),
            decisions: Arc::new(DecisionLog::off()),
            version: "test",
            integrity: None,
        };
        let go = |v: Option<&'static str>| {
            start(&cfg.audit, None, source.clone(), Arc::new(NoDns), AuditMetrics::default(), &move |_| {
                v.map(str::to_owned)
            })
            .map(|_| ())
            .map_err(|e| e.to_string())
        };
        assert!(go(None).unwrap_err().contains("audit.sinks.siem: headers_env: LOOM_T_HEADERS is not set"));
        assert!(go(Some("k")).unwrap_err().contains("no '='"));
        assert!(go(Some("authorization=Bearer x")).is_ok());
    });
}
