//! `type = "syslog"`: each record as one RFC 5424 message over TCP, or TLS
//! (RFC 5425), framed by octet counting (RFC 6587 §3.4.1: `LEN SP MSG`).
//! PRI is the configured facility (13, log audit, by default) and a severity
//! from the event's (§6.2.1); TIMESTAMP the event's time; MSGID its log
//! (`facts`, `decisions`); MSG the OCSF event's JSON. Syslog has no
//! acknowledgement: a batch counts as delivered once the kernel took it,
//! and a connection the server closed is noticed (one read that does not
//! wait) before the next write.

use super::records::Record;
use super::{net, Delivered, Failure};
use crate::dns::Resolve;
use egress_config::audit::SyslogSink;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

trait Conn: AsyncRead + AsyncWrite + Unpin + Send + Sync {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + Sync> Conn for T {}

pub(super) struct Syslog {
    cfg: SyslogSink,
    hostname: String,
    tls: Option<Arc<rustls::ClientConfig>>,
    timeout: Duration,
    resolver: Arc<dyn Resolve>,
    conn: Option<Box<dyn Conn>>,
}

/// RFC 5424 severity for an OCSF `severity_id`: Informational 6 (info),
/// Low 5 (notice), Medium 4 (warning), High 3 (err), Critical 2 (crit),
/// Fatal 1 (alert); Unknown and Other 6.
pub fn severity(severity_id: u64) -> u8 {
    match severity_id {
        2 => 5,
        3 => 4,
        4 => 3,
        5 => 2,
        6 => 1,
        _ => 6,
    }
}

/// One RFC 5424 message: `<PRI>1 TIMESTAMP HOSTNAME APP-NAME PROCID MSGID - MSG`.
pub fn message(r: &Record, facility: u8, hostname: &str, app: &str, procid: u32) -> String {
    let pri = u32::from(facility) * 8 + u32::from(severity(r.severity_id()));
    let at = crate::time::rfc3339(UNIX_EPOCH + Duration::from_millis(r.time_ms()));
    format!("<{pri}>1 {at} {hostname} {app} {procid} {} - {}", r.kind.log(), r.json)
}

/// Octet-counting framing (RFC 6587 §3.4.1).
pub fn frame(msg: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(msg.len().to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(msg.as_bytes());
}

impl Syslog {
    pub(super) fn new(
        cfg: &SyslogSink,
        cell: Option<&str>,
        timeout: Duration,
        resolver: Arc<dyn Resolve>,
    ) -> Result<Syslog, String> {
        let tls = if cfg.tls {
            Some(net::tls_config(cfg.ca_file.as_deref(), &[])?)
        } else {
            None
        };
        let hostname = cfg
            .hostname
            .clone()
            .or_else(|| cell.map(str::to_owned))
            .or_else(egress_config::fleet::hostname)
            .filter(|h| !h.is_empty() && h.len() <= 255 && h.bytes().all(|b| (33..=126).contains(&b)))
            .unwrap_or_else(|| "-".into());
        Ok(Syslog {
            cfg: cfg.clone(),
            hostname,
            tls,
            timeout,
            resolver,
            conn: None,
        })
    }

    /// The frames of `batch`, one buffer.
    pub(super) fn encode(&self, batch: &[Record]) -> Vec<u8> {
        let mut out = Vec::with_capacity(batch.iter().map(|r| r.json.len() + 96).sum());
        let pid = std::process::id();
        for r in batch {
            frame(
                &message(r, self.cfg.facility, &self.hostname, &self.cfg.app_name, pid),
                &mut out,
            );
        }
        out
    }

    pub(super) async fn send(&mut self, batch: &[Record]) -> Result<Delivered, Failure> {
        let bytes = self.encode(batch);
        if let Some(c) = self.conn.as_mut() {
            if closed(c) {
                self.conn = None;
            }
        }
        if self.conn.is_none() {
            self.conn = Some(self.connect().await?);
        }
        let Some(conn) = self.conn.as_mut() else {
            return Err(Failure::new("connect", "no connection"));
        };
        let write = async {
            conn.write_all(&bytes).await?;
            conn.flush().await
        };
        match tokio::time::timeout(self.timeout, write).await {
            Ok(Ok(())) => Ok(Delivered { rejected: 0 }),
            Ok(Err(e)) => {
                self.conn = None;
                Err(Failure::new(
                    "write",
                    format!("{}:{}: {e}", self.cfg.endpoint.host, self.cfg.endpoint.port),
                ))
            }
            Err(_) => {
                self.conn = None;
                Err(Failure::new(
                    "timeout",
                    "the syslog server did not take the batch in time",
                ))
            }
        }
    }

    async fn connect(&self) -> Result<Box<dyn Conn>, Failure> {
        let ep = &self.cfg.endpoint;
        let tcp = net::dial(&*self.resolver, ep, self.timeout).await?;
        match &self.tls {
            Some(tls) => {
                let name = self.cfg.server_name.as_deref().unwrap_or(&ep.host);
                Ok(Box::new(net::tls(tls, name, tcp, self.timeout).await?))
            }
            None => Ok(Box::new(tcp)),
        }
    }
}

/// Whether the server closed the connection: one read that does not wait
/// (a syslog server sends nothing, but TLS records such as session tickets,
/// which the read consumes, or its close).
fn closed(conn: &mut Box<dyn Conn>) -> bool {
    use futures_util::FutureExt as _;
    use tokio::io::AsyncReadExt as _;
    let mut buf = [0u8; 512];
    for _ in 0..16 {
        match conn.read(&mut buf).now_or_never() {
            None => return false,
            Some(Ok(0)) | Some(Err(_)) => return true,
            Some(Ok(_)) => continue,
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::super::records::RecordKind;
    use super::*;
    use serde_json::json;

    fn record(kind: RecordKind, severity: u64, text: &str) -> Record {
        let event = json!({"time": 1_700_000_000_123u64, "severity_id": severity, "message": text});
        Record {
            kind,
            seq: 1,
            json: event.to_string(),
            event,
        }
    }

    #[test]
    fn a_message_is_rfc5424_with_pri_from_the_severity() {
        let r = record(RecordKind::Facts, 2, "x");
        let m = message(&r, 13, "cell-a", "loom-egress", 7);
        assert_eq!(
            m,
            format!(
                "<109>1 2023-11-14T22:13:20.123Z cell-a loom-egress 7 facts - {}",
                r.json
            )
        );
        let d = record(RecordKind::Decisions, 1, "y");
        assert!(message(&d, 13, "h", "a", 1).starts_with("<110>1 "), "13*8 + info");
        assert!(
            message(&record(RecordKind::Facts, 3, ""), 4, "h", "a", 1).starts_with("<36>1 "),
            "4*8 + warning"
        );
        assert_eq!(severity(0), 6);
    }

    struct NoDns;
    impl Resolve for NoDns {
        fn resolve<'a>(
            &'a self,
            _name: &'a str,
        ) -> futures_util::future::BoxFuture<'a, Result<Vec<std::net::IpAddr>, crate::dns::DnsError>> {
            Box::pin(async { Ok(vec![]) })
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_the_server_closed_is_replaced_before_the_next_batch() {
        use tokio::io::AsyncReadExt as _;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let cfg = SyslogSink {
            endpoint: egress_config::audit::Endpoint {
                host: "127.0.0.1".into(),
                port: l.local_addr().unwrap().port(),
            },
            tls: false,
            ca_file: None,
            server_name: None,
            app_name: "loom-egress".into(),
            hostname: Some("h".into()),
            facility: 13,
        };
        let mut sink = Syslog::new(&cfg, None, Duration::from_secs(5), Arc::new(NoDns)).unwrap();
        let one = [record(RecordKind::Facts, 2, "one")];
        let want = sink.encode(&one);
        sink.send(&one).await.unwrap();
        let (mut a, _) = l.accept().await.unwrap();
        let mut got = vec![0u8; want.len()];
        a.read_exact(&mut got).await.unwrap();
        assert_eq!(got, want);
        drop(a); // the server goes away
        tokio::time::sleep(Duration::from_millis(100)).await;
        let two = [record(RecordKind::Decisions, 1, "two")];
        sink.send(&two).await.unwrap();
        let (mut b, _) = tokio::time::timeout(Duration::from_secs(5), l.accept())
            .await
            .expect("the sink reconnected")
            .unwrap();
        let want = sink.encode(&two);
        let mut got = vec![0u8; want.len()];
        b.read_exact(&mut got).await.unwrap();
        assert_eq!(got, want, "the second batch went to the new connection");
    }

    #[test]
    fn frames_count_octets_not_characters() {
        let mut out = vec![];
        frame("héllo", &mut out);
        frame("", &mut out);
        assert_eq!(out, b"6 h\xc3\xa9llo0 ");
    }
}
