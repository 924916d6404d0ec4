//! `type = "otlp"`: batches of records as one OTLP/HTTP logs request in
//! protobuf (`POST {endpoint}/v1/logs`, `Content-Type:
//! application/x-protobuf`, OTLP specification §OTLP/HTTP). Each log record
//! has the shorthand line as its body, the whole OCSF event as the
//! attribute `ocsf.raw`, the event's time and severity; the resource says
//! `service.name` and the cell. Headers come only from the environment
//! variable the config names. Answers: 2xx delivered (a partial success's
//! rejected records are counted, not resent: OTLP says not to retry them);
//! 429, 502, 503, 504 and other 5xx are retried; any other 4xx is a failure
//! of its own kind, retried with the same backoff (never skipped: that would
//! be a gap) and logged each time.

use super::proto::{
    AnyValue, ExportLogsServiceRequest, ExportLogsServiceResponse, InstrumentationScope, KeyValue, LogRecord, Resource,
    ResourceLogs, ScopeLogs,
};
use super::records::Record;
use super::{net, Delivered, Failure};
use crate::dns::Resolve;
use bytes::Bytes;
use egress_config::audit::OtlpSink;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use prost::Message as _;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// The most of an answer read.
const MAX_ANSWER: usize = 64 * 1024;

pub(super) struct Otlp {
    cfg: OtlpSink,
    headers: Vec<(http::HeaderName, http::HeaderValue)>,
    tls: Option<Arc<rustls::ClientConfig>>,
    resource: Resource,
    timeout: Duration,
    resolver: Arc<dyn Resolve>,
    conn: Option<SendRequest<Full<Bytes>>>,
}

/// OTLP's `SeverityNumber` for an OCSF `severity_id`: Informational INFO
/// (9), Low WARN (13), Medium WARN2 (14), High ERROR (17), Critical
/// ERROR3 (19), Fatal FATAL (21); Unknown and Other UNSPECIFIED (0).
pub fn severity_number(severity_id: u64) -> i32 {
    match severity_id {
        1 => 9,
        2 => 13,
        3 => 14,
        4 => 17,
        5 => 19,
        6 => 21,
        _ => 0,
    }
}

impl Otlp {
    /// `headers` is the text of the variable `headers_env` names.
    pub(super) fn new(
        cfg: &OtlpSink,
        cell: Option<&str>,
        headers: Option<&str>,
        timeout: Duration,
        resolver: Arc<dyn Resolve>,
    ) -> Result<Otlp, String> {
        let mut parsed = vec![];
        if let Some(text) = headers {
            for (k, v) in egress_config::audit::parse_headers(text)? {
                let name = http::HeaderName::from_bytes(k.as_bytes()).map_err(|e| format!("{k}: {e}"))?;
                let value = http::HeaderValue::from_str(&v).map_err(|e| format!("{k}: {e}"))?;
                parsed.push((name, value));
            }
        }
        let tls = if cfg.https {
            Some(net::tls_config(cfg.ca_file.as_deref(), &[b"http/1.1"])?)
        } else {
            None
        };
        let mut attributes = vec![
            KeyValue::string("service.name", cfg.service_name.clone()),
            KeyValue::string("service.version", env!("CARGO_PKG_VERSION")),
        ];
        if let Some(cell) = cell {
            attributes.push(KeyValue::string("service.instance.id", cell));
            attributes.push(KeyValue::string("loom.cell", cell));
        }
        Ok(Otlp {
            cfg: cfg.clone(),
            headers: parsed,
            tls,
            resource: Resource { attributes },
            timeout,
            resolver,
            conn: None,
        })
    }

    /// The request body for `batch`.
    pub(super) fn encode(&self, batch: &[Record]) -> Vec<u8> {
        encode(&self.resource, batch, now_nanos())
    }

    pub(super) async fn send(&mut self, batch: &[Record]) -> Result<Delivered, Failure> {
        let body = self.encode(batch);
        let timeout = self.timeout;
        match tokio::time::timeout(timeout, self.post(body)).await {
            Ok(r) => {
                if r.is_err() {
                    self.conn = None;
                }
                r
            }
            Err(_) => {
                self.conn = None;
                Err(Failure::new(
                    "timeout",
                    format!("the collector did not answer within {} ms", timeout.as_millis()),
                ))
            }
        }
    }

    async fn connect(&mut self) -> Result<SendRequest<Full<Bytes>>, Failure> {
        let ep = &self.cfg.endpoint;
        let tcp = net::dial(&*self.resolver, ep, self.timeout).await?;
        let handshake = |e: hyper::Error| Failure::new("connect", format!("{}:{}: {e}", ep.host, ep.port));
        let sender = match &self.tls {
            Some(tls) => {
                let s = net::tls(tls, &ep.host, tcp, self.timeout).await?;
                let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
                    .await
                    .map_err(handshake)?;
                tokio::spawn(conn);
                sender
            }
            None => {
                let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
                    .await
                    .map_err(handshake)?;
                tokio::spawn(conn);
                sender
            }
        };
        Ok(sender)
    }

    async fn post(&mut self, body: Vec<u8>) -> Result<Delivered, Failure> {
        let reused = match self.conn.take() {
            Some(mut s) => s.ready().await.is_ok().then_some(s),
            None => None,
        };
        let mut sender = match reused {
            Some(s) => s,
            None => self.connect().await?,
        };
        let ep = &self.cfg.endpoint;
        let authority = if ep.host.contains(':') {
            format!("[{}]:{}", ep.host, ep.port)
        } else {
            format!("{}:{}", ep.host, ep.port)
        };
        let mut req = http::Request::post(self.cfg.path.as_str())
            .header(http::header::HOST, authority)
            .header(http::header::CONTENT_TYPE, "application/x-protobuf")
            .header(
                http::header::USER_AGENT,
                concat!("loom-egress/", env!("CARGO_PKG_VERSION")),
            );
        for (k, v) in &self.headers {
            req = req.header(k, v);
        }
        let req = req
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| Failure::new("write", e.to_string()))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| Failure::new("write", format!("{}:{}: {e}", ep.host, ep.port)))?;
        let status = resp.status();
        let answer = Limited::new(resp.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|_| Failure::new("write", format!("an answer over {MAX_ANSWER} bytes or cut short")))?
            .to_bytes();
        self.conn = Some(sender);
        classify(status, &answer)
    }
}

/// What an answer means.
pub(super) fn classify(status: http::StatusCode, answer: &[u8]) -> Result<Delivered, Failure> {
    let code = status.as_u16();
    let text = || String::from_utf8_lossy(&answer[..answer.len().min(512)]).into_owned();
    match code {
        200..=299 => {
            let rejected = ExportLogsServiceResponse::decode(answer)
                .ok()
                .and_then(|r| r.partial_success)
                .map(|p| (p.rejected_log_records.max(0) as u64, p.error_message))
                .unwrap_or_default();
            if rejected.0 > 0 {
                tracing::warn!(rejected = rejected.0, message = %rejected.1, "the collector rejected log records (not resent)");
            }
            Ok(Delivered { rejected: rejected.0 })
        }
        429 => Err(Failure::new("http_429", format!("{status}: {}", text()))),
        500..=599 => Err(Failure::new("http_5xx", format!("{status}: {}", text()))),
        _ => Err(Failure::new(
            "http_4xx",
            format!(
                "{status} (not retryable by OTLP, retried with backoff; check the endpoint and headers): {}",
                text()
            ),
        )),
    }
}

fn now_nanos() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// One `ExportLogsServiceRequest` of `batch`, observed at `observed` (ns).
pub fn encode(resource: &Resource, batch: &[Record], observed: u64) -> Vec<u8> {
    let log_records = batch
        .iter()
        .map(|r| LogRecord {
            time_unix_nano: r.time_ms().saturating_mul(1_000_000),
            observed_time_unix_nano: observed,
            severity_number: severity_number(r.severity_id()),
            severity_text: r
                .event
                .get("severity")
                .and_then(serde_json::Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            body: Some(AnyValue::string(crate::facts::ocsf::shorthand(&r.event))),
            attributes: vec![
                KeyValue::string("ocsf.raw", r.json.clone()),
                KeyValue::string("loom.log", r.kind.log()),
                KeyValue::int("loom.seq", i64::try_from(r.seq).unwrap_or(i64::MAX)),
            ],
            event_name: String::new(),
        })
        .collect();
    ExportLogsServiceRequest {
        resource_logs: vec![ResourceLogs {
            resource: Some(resource.clone()),
            scope_logs: vec![ScopeLogs {
                scope: Some(InstrumentationScope {
                    name: "loom-egress.audit".into(),
                    version: env!("CARGO_PKG_VERSION").into(),
                }),
                log_records,
            }],
        }],
    }
    .encode_to_vec()
}

#[cfg(test)]
mod tests {
    use super::super::proto::{any_value, ExportLogsPartialSuccess};
    use super::super::records::RecordKind;
    use super::*;
    use serde_json::json;

    fn record(seq: u64, severity: u64) -> Record {
        let event = json!({"time": 1_700_000_000_123u64, "severity_id": severity, "severity": "Low",
            "metadata": {"uid": format!("u{seq}"), "log_name": "facts"}, "status_code": "not_allowlisted"});
        Record {
            kind: RecordKind::Facts,
            seq,
            json: event.to_string(),
            event,
        }
    }

    #[test]
    fn a_batch_encodes_as_one_request_that_decodes_back() {
        let resource = Resource {
            attributes: vec![KeyValue::string("service.name", "loom-egress")],
        };
        let bytes = encode(&resource, &[record(1, 2), record(2, 3)], 42);
        let req = ExportLogsServiceRequest::decode(bytes.as_slice()).unwrap();
        let logs = &req.resource_logs[0];
        assert_eq!(logs.resource.as_ref().unwrap().attributes[0].key, "service.name");
        let recs = &logs.scope_logs[0].log_records;
        assert_eq!(recs.len(), 2);
        assert_eq!(recs[0].time_unix_nano, 1_700_000_000_123_000_000);
        assert_eq!(recs[0].observed_time_unix_nano, 42);
        assert_eq!((recs[0].severity_number, recs[1].severity_number), (13, 14));
        assert_eq!(recs[0].severity_text, "Low");
        let raw = recs[1]
            .attributes
            .iter()
            .find(|a| a.key == "ocsf.raw")
            .and_then(|a| a.value.clone())
            .and_then(|v| v.value);
        let Some(any_value::Value::StringValue(raw)) = raw else {
            panic!("no ocsf.raw")
        };
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&raw).unwrap()["metadata"]["uid"],
            "u2"
        );
        // Field numbers as in the .proto: time_unix_nano is field 1, fixed64
        // (tag byte 0x09), severity_number field 2, varint (0x10).
        let one = LogRecord {
            time_unix_nano: 1,
            severity_number: 9,
            ..LogRecord::default()
        }
        .encode_to_vec();
        assert_eq!(one, [0x09, 1, 0, 0, 0, 0, 0, 0, 0, 0x10, 9]);
    }

    #[test]
    fn answers_are_classified_and_a_4xx_is_a_failure_of_its_own() {
        let ok = ExportLogsServiceResponse::default().encode_to_vec();
        assert_eq!(classify(http::StatusCode::OK, &ok).unwrap().rejected, 0);
        let partial = ExportLogsServiceResponse {
            partial_success: Some(ExportLogsPartialSuccess {
                rejected_log_records: 3,
                error_message: "too old".into(),
            }),
        }
        .encode_to_vec();
        assert_eq!(classify(http::StatusCode::OK, &partial).unwrap().rejected, 3);
        assert_eq!(classify(http::StatusCode::OK, b"").unwrap().rejected, 0);
        for (code, kind) in [
            (429, "http_429"),
            (503, "http_5xx"),
            (400, "http_4xx"),
            (401, "http_4xx"),
            (404, "http_4xx"),
        ] {
            let e = classify(http::StatusCode::from_u16(code).unwrap(), b"no").unwrap_err();
            assert_eq!(e.kind, kind, "{code}");
        }
    }
}
