//! `type = "syslog"`: each record as one RFC 5424 message over TCP, or TLS
//! (RFC 5425), framed by octet counting (RFC 6587 §3.4.1: `LEN SP MSG`).
//! PRI is the configured facility (13, log audit, by default) and a severity
//! from the event's (§6.2.1); TIMESTAMP the event's time; MSGID its log
//! (`facts`, `decisions`); MSG the OCSF event's JSON. Syslog has no
//! acknowledgement: a batch counts as delivered once the kernel took it,
//! and a connection the server closed is noticed before the next write.

use super::records::Record;
use super::{net, Delivered, Failure};
use crate::dns::Resolve;
use egress_config::audit::SyslogSink;
use std::os::fd::AsFd;
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
    /// The open connection, and its TCP socket to look for a close on.
    conn: Option<(Box<dyn Conn>, Option<std::net::TcpStream>)>,
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
        if self.conn.as_ref().is_some_and(|(_, tcp)| closed(tcp)) {
            self.conn = None;
        }
        if self.conn.is_none() {
            self.conn = Some(self.connect().await?);
        }
        let Some((conn, _)) = self.conn.as_mut() else {
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

    async fn connect(&self) -> Result<(Box<dyn Conn>, Option<std::net::TcpStream>), Failure> {
        let ep = &self.cfg.endpoint;
        let tcp = net::dial(&*self.resolver, ep, self.timeout).await?;
        // A second handle on the socket, to look for the server's close.
        let probe = tcp.as_fd().try_clone_to_owned().ok().map(std::net::TcpStream::from);
        match &self.tls {
            Some(tls) => {
                let name = self.cfg.server_name.as_deref().unwrap_or(&ep.host);
                let s = net::tls(tls, name, tcp, self.timeout).await?;
                Ok((Box::new(s), probe))
            }
            None => Ok((Box::new(tcp), probe)),
        }
    }
}

/// Whether the server closed the connection (or sent anything, which a
/// syslog server never does but to close a TLS session).
fn closed(probe: &Option<std::net::TcpStream>) -> bool {
    let Some(s) = probe else { return false };
    let mut buf = [0u8; 1];
    match s.peek(&mut buf) {
        Ok(_) => true,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
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

    #[test]
    fn frames_count_octets_not_characters() {
        let mut out = vec![];
        frame("héllo", &mut out);
        frame("", &mut out);
        assert_eq!(out, b"6 h\xc3\xa9llo0 ");
    }
}
