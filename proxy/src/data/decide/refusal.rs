//! What the decider answers when it refuses: a denial recorded as a fact
//! (its reason and detail, the fact's id, the target and tool it quotes,
//! whether the request asked for JSON), or an error that is no policy
//! decision (the fact store unavailable). The decider never builds a
//! response: the carriers render a refusal as HTTP (`carry::respond`), a
//! SOCKS reply or a close frame.

use crate::deny::{DenyReason, FetchError};
use http::header;

/// A refused step.
#[derive(Debug)]
pub enum Refusal {
    /// Refused by a rule, and recorded.
    Denied(Denied),
    /// Not decided: `error` says why (its status and code).
    Failed { error: FetchError, detail: String },
}

/// A denial and the fact that records it.
#[derive(Debug)]
pub struct Denied {
    pub reason: DenyReason,
    /// The human-readable explanation (bounded by the caller).
    pub detail: String,
    /// The `id` of the fact that records it.
    pub fact_id: String,
    /// The target as understood, or the raw one (bounded); `None` withheld.
    pub target: Option<String>,
    /// The run's tool (`None` for authentication failures).
    pub tool: Option<String>,
    /// Whether the request accepts `application/json`.
    pub json: bool,
}

impl Refusal {
    /// The fact store could not record the refusal: `detail` says why.
    pub fn unrecorded(detail: &str) -> Refusal {
        Refusal::Failed {
            error: FetchError::FactsUnavailable,
            detail: detail.to_owned(),
        }
    }

    /// The id of the fact that records it (`None` when there is none).
    pub fn fact_id(&self) -> Option<&str> {
        match self {
            Refusal::Denied(d) => Some(&d.fact_id),
            Refusal::Failed { .. } => None,
        }
    }
}

/// Whether a request's `Accept` names `application/json` (any case, any
/// parameters): the denial is then answered with a JSON body.
pub fn accepts_json(headers: &http::HeaderMap) -> bool {
    headers.get_all(header::ACCEPT).iter().any(|v| {
        v.to_str().is_ok_and(|v| {
            v.split(',')
                .any(|m| m.trim().to_ascii_lowercase().starts_with("application/json"))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header::HeaderValue;

    #[test]
    fn accept_names_json_in_any_case_and_position() {
        let h = |v: &str| {
            let mut m = http::HeaderMap::new();
            m.insert(header::ACCEPT, HeaderValue::from_str(v).unwrap());
            accepts_json(&m)
        };
        assert!(h("application/json"));
        assert!(h("text/html, Application/JSON; q=0.5"));
        assert!(!h("text/html"));
        assert!(!h("application/xml"));
        assert!(!accepts_json(&http::HeaderMap::new()));
    }
}
