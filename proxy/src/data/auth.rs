//! Per-run proxy authentication (RFC 9110 §11.7.1, Basic scheme RFC 7617):
//! `Proxy-Authorization: Basic base64(run_id:secret)`, compared in constant
//! time against the run's secret.

use crate::deny::DenyReason;
use crate::runs::{Run, Runs};
use base64::Engine;
use http::HeaderMap;
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// The `Proxy-Authenticate` challenge sent with every 407.
pub const CHALLENGE: &str = "Basic realm=\"loom-egress\", charset=\"UTF-8\"";

/// Compared against when a credential names no known run (as long as a real
/// secret: 24 random bytes, hex).
const DUMMY_SECRET: &[u8; 48] = b"000000000000000000000000000000000000000000000000";

/// Result of a failed authentication: the reason and, when the credential
/// named a known run, that run (so the fact can be attributed; the answer
/// to the client is the same either way).
pub struct AuthFailure {
    pub reason: DenyReason,
    pub claimed: Option<Arc<Run>>,
}

/// A connection that arrived on a listener handed over for one run (see
/// `handoff`): only that run's credential is accepted on it.
#[derive(Debug, Clone)]
pub struct BoundRun(pub Arc<str>);

/// Authenticates a request head against the run registry. On a connection
/// bound to a run, a valid credential of any other run is `auth_invalid`,
/// recorded against the bound run (whose sandbox presented it).
pub fn authenticate(runs: &Runs, headers: &HeaderMap, bound: Option<&BoundRun>) -> Result<Arc<Run>, AuthFailure> {
    let run = authenticate_any(runs, headers)?;
    match bound {
        Some(BoundRun(id)) if *id != run.id => Err(AuthFailure {
            reason: DenyReason::AuthInvalid,
            claimed: runs.get(id),
        }),
        _ => Ok(run),
    }
}

fn authenticate_any(runs: &Runs, headers: &HeaderMap) -> Result<Arc<Run>, AuthFailure> {
    let mut values = headers.get_all(http::header::PROXY_AUTHORIZATION).iter();
    let value = match (values.next(), values.next()) {
        (None, _) => {
            return Err(AuthFailure {
                reason: DenyReason::AuthMissing,
                claimed: None,
            })
        }
        (Some(_), Some(_)) => {
            return Err(AuthFailure {
                reason: DenyReason::AuthInvalid,
                claimed: None,
            })
        }
        (Some(v), None) => v.as_bytes(),
    };
    let invalid = || AuthFailure {
        reason: DenyReason::AuthInvalid,
        claimed: None,
    };
    let (scheme, rest) = match value.iter().position(|b| *b == b' ') {
        Some(i) => (&value[..i], &value[i + 1..]),
        None => return Err(invalid()),
    };
    if !scheme.eq_ignore_ascii_case(b"basic") {
        return Err(invalid());
    }
    let rest = rest.trim_ascii();
    // run ids ≤ 128 bytes, secrets 48 bytes: anything much longer is not ours.
    if rest.len() > 512 {
        return Err(invalid());
    }
    let mut buf = [0u8; 384];
    let n = base64::engine::general_purpose::STANDARD
        .decode_slice(rest, &mut buf)
        .map_err(|_| invalid())?;
    let decoded = &buf[..n];
    let colon = decoded.iter().position(|b| *b == b':').ok_or_else(invalid)?;
    check_pair(runs, &decoded[..colon], &decoded[colon + 1..])
}

/// Authenticates a run id and secret given apart (SOCKS5 username and
/// password, RFC 1929), with the same binding rule as [`authenticate`].
pub fn authenticate_pair(
    runs: &Runs,
    user: &[u8],
    secret: &[u8],
    bound: Option<&BoundRun>,
) -> Result<Arc<Run>, AuthFailure> {
    let run = check_pair(runs, user, secret)?;
    match bound {
        Some(BoundRun(id)) if *id != run.id => Err(AuthFailure {
            reason: DenyReason::AuthInvalid,
            claimed: runs.get(id),
        }),
        _ => Ok(run),
    }
}

/// The run `user` names, if `secret` is its secret (compared in constant
/// time; an unknown run costs the same work).
fn check_pair(runs: &Runs, user: &[u8], secret: &[u8]) -> Result<Arc<Run>, AuthFailure> {
    let invalid = || AuthFailure {
        reason: DenyReason::AuthInvalid,
        claimed: None,
    };
    let user = std::str::from_utf8(user).map_err(|_| invalid())?;
    let Some(run) = runs.get(user) else {
        // Same work as for a known run, so timing does not tell whether a
        // guessed run id exists.
        let _ = std::hint::black_box(bool::from(DUMMY_SECRET.ct_eq(secret)));
        return Err(invalid());
    };
    if run.secret_matches(secret) {
        Ok(run)
    } else {
        Err(AuthFailure {
            reason: DenyReason::AuthInvalid,
            claimed: Some(run),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runs::NewRun;
    use base64::engine::general_purpose::STANDARD as B64;
    use http::HeaderValue;
    use std::time::Duration;

    const SECRET: &str = "0123456789abcdef0123456789abcdef0123456789abcdef";

    fn registry() -> Runs {
        let runs = Runs::new(10, Duration::from_secs(60));
        for id in ["r1", "r2"] {
            let new = NewRun {
                id: id.into(),
                tool: Arc::from("t"),
                labels: Default::default(),
                owner: None,
                activate: true,
                max_slots: 1,
                max_waiting: 1,
                max_conns: 1,
                placeholders: vec![],
            };
            runs.create(new, SECRET.into()).unwrap();
        }
        runs
    }

    fn basic(user_pass: &str) -> String {
        format!("Basic {}", B64.encode(user_pass))
    }

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(http::header::PROXY_AUTHORIZATION, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    /// The run a credential authenticates as, or the reason and the run a
    /// failure is attributed to.
    type Want = Result<&'static str, (DenyReason, Option<&'static str>)>;

    /// Every shape of `Proxy-Authorization`: the outcome, and which run a
    /// failure is attributed to.
    #[test]
    fn credentials_table() {
        let runs = registry();
        let good = basic(&format!("r1:{SECRET}"));
        let long = format!("Basic {}", "A".repeat(600));
        let cases: Vec<(Vec<String>, Want)> = vec![
            (vec![], Err((DenyReason::AuthMissing, None))),
            (vec![good.clone()], Ok("r1")),
            (vec![good.replacen("Basic", "bAsIc", 1)], Ok("r1")),
            (
                vec![format!("Basic   {}  ", B64.encode(format!("r1:{SECRET}")))],
                Ok("r1"),
            ),
            (vec![good.clone(), good.clone()], Err((DenyReason::AuthInvalid, None))),
            (vec![basic("r1:wrong")], Err((DenyReason::AuthInvalid, Some("r1")))),
            (
                vec![basic(&format!("r1:{SECRET}x"))],
                Err((DenyReason::AuthInvalid, Some("r1"))),
            ),
            (
                vec![basic(&format!("nope:{SECRET}"))],
                Err((DenyReason::AuthInvalid, None)),
            ),
            (
                vec![basic(&format!("r1{SECRET}"))],
                Err((DenyReason::AuthInvalid, None)),
            ),
            (vec![format!("Bearer {SECRET}")], Err((DenyReason::AuthInvalid, None))),
            (vec!["Basic".into()], Err((DenyReason::AuthInvalid, None))),
            (vec!["Basic !!!not-base64".into()], Err((DenyReason::AuthInvalid, None))),
            (vec![long], Err((DenyReason::AuthInvalid, None))),
        ];
        for (values, want) in cases {
            let refs: Vec<&str> = values.iter().map(String::as_str).collect();
            let got = authenticate(&runs, &headers(&refs), None);
            match (got, want) {
                (Ok(run), Ok(id)) => assert_eq!(&*run.id, id, "{values:?}"),
                (Err(f), Err((reason, claimed))) => {
                    assert_eq!(f.reason, reason, "{values:?}");
                    assert_eq!(f.claimed.as_ref().map(|r| &*r.id), claimed, "{values:?}");
                }
                (Ok(run), Err(_)) => panic!("{values:?} authenticated as {}", run.id),
                (Err(f), Ok(_)) => panic!("{values:?} failed with {:?}", f.reason),
            }
        }
    }

    /// On a listener bound to one run, another run's valid credential is
    /// `auth_invalid`, attributed to the bound run.
    #[test]
    fn a_bound_listener_takes_only_its_own_run() {
        let runs = registry();
        let bound = BoundRun(Arc::from("r1"));
        let h = headers(&[&basic(&format!("r2:{SECRET}"))]);
        let f = authenticate(&runs, &h, Some(&bound)).err().unwrap();
        assert_eq!(f.reason, DenyReason::AuthInvalid);
        assert_eq!(f.claimed.map(|r| r.id.to_string()), Some("r1".into()));
        let own = headers(&[&basic(&format!("r1:{SECRET}"))]);
        assert!(authenticate(&runs, &own, Some(&bound)).is_ok());
    }
}
