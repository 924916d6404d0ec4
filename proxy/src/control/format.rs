//! How the record routes write what they read (`?format=`): a fact or a
//! decision record as the store keeps it (`json`, the default), or as its
//! OCSF 1.8.0 event (`ocsf`, mapped by `facts::ocsf`, the same events as
//! `egress-proxy facts export --format ocsf`). A page keeps its `next`
//! whatever the format; a stream keeps its `id:` and `event:`.

use crate::facts::decisions::{Decision, DecisionsPage};
use crate::facts::{ocsf, Fact};
use axum::response::sse::Event;
use egress_api::{FactsPage, OcsfPage, RecordFormat};
use serde::Serialize;

/// The version OCSF events name as the product's (`metadata.product.version`).
pub const PRODUCT_VERSION: &str = env!("CARGO_PKG_VERSION");

/// `200` of the fact pages: `{facts, next}`, or with `format=ocsf`
/// `{events, next}`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum FactsAnswer {
    Records(FactsPage),
    Ocsf(OcsfPage),
}

/// `200` of the decision pages: `{decisions, next}`, or with `format=ocsf`
/// `{events, next}`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum DecisionsAnswer {
    Records(DecisionsPage),
    Ocsf(OcsfPage),
}

/// A page of facts in `format`.
pub fn facts_page(format: RecordFormat, facts: Vec<Fact>, next: u64) -> FactsAnswer {
    match format {
        RecordFormat::Json => FactsAnswer::Records(FactsPage { facts, next }),
        RecordFormat::Ocsf => FactsAnswer::Ocsf(OcsfPage {
            events: facts.iter().map(|f| ocsf::fact_event(f, PRODUCT_VERSION)).collect(),
            next,
        }),
    }
}

/// A page of decision records in `format`.
pub fn decisions_page(format: RecordFormat, decisions: Vec<Decision>, next: u64) -> DecisionsAnswer {
    match format {
        RecordFormat::Json => DecisionsAnswer::Records(DecisionsPage { decisions, next }),
        RecordFormat::Ocsf => DecisionsAnswer::Ocsf(OcsfPage {
            events: decisions
                .iter()
                .map(|d| ocsf::decision_event(d, PRODUCT_VERSION))
                .collect(),
            next,
        }),
    }
}

/// The SSE event name of a fact: `pending` for a fetch held for a grant,
/// else `fact`.
fn fact_name(f: &Fact) -> &'static str {
    if f.kind == egress_api::PENDING_FACT_TYPE {
        "pending"
    } else {
        "fact"
    }
}

fn sse(seq: u64, name: &str, data: Result<String, serde_json::Error>) -> Event {
    Event::default()
        .id(seq.to_string())
        .event(name)
        .data(data.unwrap_or_else(|_| "{}".into()))
}

/// A fact as a stream event: `id: <seq>`, `event: fact|pending`, the fact.
pub fn fact_sse(f: &Fact) -> Event {
    sse(f.seq, fact_name(f), serde_json::to_string(f))
}

/// The same, with the fact's OCSF event as `data:`.
pub fn fact_sse_ocsf(f: &Fact) -> Event {
    sse(
        f.seq,
        fact_name(f),
        serde_json::to_string(&ocsf::fact_event(f, PRODUCT_VERSION)),
    )
}

/// A decision record as a stream event: `id: <seq>`, `event: decision`.
pub fn decision_sse(d: &Decision) -> Event {
    sse(d.seq, "decision", serde_json::to_string(d))
}

/// The same, with the record's OCSF event as `data:`.
pub fn decision_sse_ocsf(d: &Decision) -> Event {
    sse(
        d.seq,
        "decision",
        serde_json::to_string(&ocsf::decision_event(d, PRODUCT_VERSION)),
    )
}

/// How a stream in `format` writes a fact.
pub fn fact_sse_in(format: RecordFormat) -> fn(&Fact) -> Event {
    match format {
        RecordFormat::Json => fact_sse,
        RecordFormat::Ocsf => fact_sse_ocsf,
    }
}

/// How a stream in `format` writes a decision record.
pub fn decision_sse_in(format: RecordFormat) -> fn(&Decision) -> Event {
    match format {
        RecordFormat::Json => decision_sse,
        RecordFormat::Ocsf => decision_sse_ocsf,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fact(seq: u64, kind: &str) -> Fact {
        serde_json::from_value(serde_json::json!({
            "type": kind, "schema": "1.7.0", "seq": seq, "id": format!("id-{seq}"),
            "at": "2026-12-03T08:00:00.000Z", "run_id": "run-1", "tool": "web",
            "reason": "not_allowlisted", "mode": "enforce", "detail": "d",
            "target": {"kind": "http", "host": "evil.example", "port": 80},
            "resolved": [], "count": 1, "policy": "sha256:00"
        }))
        .unwrap()
    }

    #[test]
    fn an_ocsf_page_keeps_the_cursor_and_maps_each_fact_as_the_export_does() {
        let facts = vec![fact(3, "EGRESS_DENIED"), fact(9, "EGRESS_PENDING")];
        let want: Vec<String> = facts
            .iter()
            .map(|f| serde_json::to_string(&ocsf::fact_event(f, env!("CARGO_PKG_VERSION"))).unwrap())
            .collect();
        let FactsAnswer::Ocsf(p) = facts_page(RecordFormat::Ocsf, facts.clone(), 12) else {
            panic!("not an OCSF page");
        };
        assert_eq!(p.next, 12);
        let got: Vec<String> = p.events.iter().map(|e| serde_json::to_string(e).unwrap()).collect();
        assert_eq!(got, want);
        let page = serde_json::to_value(facts_page(RecordFormat::Json, facts, 12)).unwrap();
        assert_eq!(page["next"], 12);
        assert_eq!(page["facts"][1]["seq"], 9);
        assert!(page.get("events").is_none());
    }

    #[test]
    fn the_query_format_is_json_by_default_and_refuses_another() {
        use axum::extract::Query;
        let parse = |q: &str| {
            let uri: axum::http::Uri = format!("/v1/facts?{q}").parse().unwrap();
            Query::<egress_api::Cursor>::try_from_uri(&uri).map(|Query(c)| c.format)
        };
        assert_eq!(parse("after=4").unwrap(), RecordFormat::Json);
        assert_eq!(parse("format=json").unwrap(), RecordFormat::Json);
        assert_eq!(parse("after=4&format=ocsf").unwrap(), RecordFormat::Ocsf);
        for bad in ["format=xml", "format=", "format=OCSF", "format=ocsf&format=json"] {
            let e = parse(bad).unwrap_err();
            assert_eq!(
                e.status(),
                axum::http::StatusCode::BAD_REQUEST,
                "{bad}: {}",
                e.body_text()
            );
        }
    }
}
