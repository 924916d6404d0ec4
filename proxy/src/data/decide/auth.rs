//! Per-run proxy authentication (RFC 9110 §11.7.1, Basic scheme RFC 7617):
//! `Proxy-Authorization: Basic base64(run_id:secret)`, compared in constant
//! time against the run's secret; then the binding rule ([`binding`]): a
//! run bound to the listener handed over for it (its sandbox's) is taken
//! there only, and a handed-over listener takes only its own run.

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

/// Result of a failed authentication: the reason and the run its fact is
/// filed under, if any: the run a wrong secret named (the answer to the
/// client is the same as for an unknown run), the run whose listener took
/// another run's credential, or the run whose bound credential was
/// presented elsewhere.
pub struct AuthFailure {
    pub reason: DenyReason,
    pub claimed: Option<Arc<Run>>,
    /// For `credential_elsewhere` on another run's listener or transparent
    /// socket: that run (its sandbox presented the credential), which gets
    /// a fact of its own.
    pub on: Option<Arc<Run>>,
}

impl AuthFailure {
    fn invalid(claimed: Option<Arc<Run>>) -> AuthFailure {
        AuthFailure {
            reason: DenyReason::AuthInvalid,
            claimed,
            on: None,
        }
    }
}

/// A connection that arrived on a listener handed over for one run (see
/// `handoff`): only that run's credential is accepted on it.
#[derive(Debug, Clone)]
pub struct BoundRun(pub Arc<str>);

/// Where a credential was presented.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presented<'a> {
    /// The proxy's own data listeners (plain or TLS; HTTP or SOCKS5).
    Proxy,
    /// A listener or transparent socket handed over for the run of this id
    /// (inside its sandbox).
    RunListener(&'a str),
}

impl<'a> Presented<'a> {
    /// Where a request on a connection `bound` (or not) to a run was presented.
    pub fn on(bound: Option<&'a BoundRun>) -> Presented<'a> {
        match bound {
            Some(BoundRun(id)) => Presented::RunListener(id),
            None => Presented::Proxy,
        }
    }
}

/// The binding rule, for a *valid* credential of run `id` presented `at`
/// (pure): a run's own listener takes it; a bound run's credential is
/// `credential_elsewhere` anywhere else; another run's listener takes no
/// unbound run's credential either (`auth_invalid`, as a wrong one); the
/// proxy's own listeners take unbound runs'.
pub fn binding(id: &str, bound: bool, at: Presented<'_>) -> Result<(), DenyReason> {
    match at {
        Presented::RunListener(own) if own == id => Ok(()),
        _ if bound => Err(DenyReason::CredentialElsewhere),
        Presented::RunListener(_) => Err(DenyReason::AuthInvalid),
        Presented::Proxy => Ok(()),
    }
}

/// [`binding`] for `run`, whose credential was valid, with the failure
/// filed as [`AuthFailure`] says: `credential_elsewhere` under the
/// credential's run (and the listener's run, if another's); `auth_invalid`
/// under the listener's run (whose sandbox presented it).
pub fn check_binding(runs: &Runs, run: Arc<Run>, at: Presented<'_>) -> Result<Arc<Run>, AuthFailure> {
    let listener = || match at {
        Presented::RunListener(id) => runs.get(id),
        Presented::Proxy => None,
    };
    match binding(&run.id, run.is_bound(), at) {
        Ok(()) => Ok(run),
        Err(DenyReason::CredentialElsewhere) => Err(AuthFailure {
            reason: DenyReason::CredentialElsewhere,
            claimed: Some(run),
            on: listener(),
        }),
        Err(reason) => Err(AuthFailure {
            reason,
            claimed: listener(),
            on: None,
        }),
    }
}

/// Authenticates a request head against the run registry, then applies the
/// binding rule for where it was presented ([`check_binding`]).
pub fn authenticate(runs: &Runs, headers: &HeaderMap, at: Presented<'_>) -> Result<Arc<Run>, AuthFailure> {
    let run = authenticate_any(runs, headers)?;
    check_binding(runs, run, at)
}

/// For a request on a run's own transparent socket, which needs no
/// credential (the namespace is the identity): a `Proxy-Authorization` it
/// carries grants nothing (it is stripped before the origin) and is not
/// looked at, unless it is the valid credential of another run bound to
/// its own listener: that is `credential_elsewhere`, as on every listener
/// but that run's. Anything else (this run's own, an unbound run's, a
/// wrong one) leaves the request as it is, as before: only a valid secret
/// gets an answer that differs.
pub fn carried(runs: &Runs, headers: &HeaderMap, run: &Run) -> Result<(), AuthFailure> {
    if !headers.contains_key(http::header::PROXY_AUTHORIZATION) {
        return Ok(());
    }
    match authenticate(runs, headers, Presented::RunListener(&run.id)) {
        Err(f) if f.reason == DenyReason::CredentialElsewhere => Err(f),
        _ => Ok(()),
    }
}

fn authenticate_any(runs: &Runs, headers: &HeaderMap) -> Result<Arc<Run>, AuthFailure> {
    let mut values = headers.get_all(http::header::PROXY_AUTHORIZATION).iter();
    let value = match (values.next(), values.next()) {
        (None, _) => {
            return Err(AuthFailure {
                reason: DenyReason::AuthMissing,
                claimed: None,
                on: None,
            })
        }
        (Some(_), Some(_)) => return Err(AuthFailure::invalid(None)),
        (Some(v), None) => v.as_bytes(),
    };
    let invalid = || AuthFailure::invalid(None);
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
pub fn authenticate_pair(runs: &Runs, user: &[u8], secret: &[u8], at: Presented<'_>) -> Result<Arc<Run>, AuthFailure> {
    let run = check_pair(runs, user, secret)?;
    check_binding(runs, run, at)
}

/// The run `user` names, if `secret` is its secret (compared in constant
/// time; an unknown run costs the same work). The binding rule comes only
/// after: no answer says anything of a run's binding to a wrong secret.
fn check_pair(runs: &Runs, user: &[u8], secret: &[u8]) -> Result<Arc<Run>, AuthFailure> {
    let invalid = || AuthFailure::invalid(None);
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
        Err(AuthFailure::invalid(Some(run)))
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

    /// `r1`, `r2` unbound; `b1`, `b2` bound to their own listeners.
    fn registry() -> Runs {
        let runs = Runs::new(10, Duration::from_secs(60));
        for id in ["r1", "r2", "b1", "b2"] {
            let new = NewRun {
                principal: None,
                executables: Default::default(),
                creator: None,
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
            runs.create_bound(new, SECRET.into(), id.starts_with('b')).unwrap();
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
            let got = authenticate(&runs, &headers(&refs), Presented::Proxy);
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

    /// The binding rule, every case: a run's own listener takes its
    /// credential; a bound run's is refused everywhere else; another run's
    /// listener takes no unbound run's either.
    #[test]
    fn binding_table() {
        use Presented::*;
        for (bound, at, want) in [
            (false, Proxy, Ok(())),
            (false, RunListener("a"), Ok(())),
            (false, RunListener("b"), Err(DenyReason::AuthInvalid)),
            (true, Proxy, Err(DenyReason::CredentialElsewhere)),
            (true, RunListener("a"), Ok(())),
            (true, RunListener("b"), Err(DenyReason::CredentialElsewhere)),
            (true, RunListener("a2"), Err(DenyReason::CredentialElsewhere)),
            (true, RunListener(""), Err(DenyReason::CredentialElsewhere)),
        ] {
            assert_eq!(binding("a", bound, at), want, "bound {bound}, at {at:?}");
        }
    }

    /// A refusal: the reason, the run it is filed under, the other run
    /// whose listener took it.
    type Refused = (DenyReason, &'static str, Option<&'static str>);

    /// Where each credential is presented, by both entrances' parsers (a
    /// header, a SOCKS5 pair): the outcome and the runs its facts go to.
    #[test]
    fn a_bound_credential_works_on_its_own_listener_only() {
        let runs = registry();
        let cases: &[(&str, &str, Presented<'_>, Option<Refused>)] = &[
            // Unbound: anywhere but another run's listener.
            ("r2", SECRET, Presented::Proxy, None),
            ("r1", SECRET, Presented::RunListener("r1"), None),
            (
                "r2",
                SECRET,
                Presented::RunListener("r1"),
                Some((DenyReason::AuthInvalid, "r1", None)),
            ),
            (
                "r2",
                SECRET,
                Presented::RunListener("b1"),
                Some((DenyReason::AuthInvalid, "b1", None)),
            ),
            // Bound: its own listener only; filed under it (and the other listener's run).
            ("b1", SECRET, Presented::RunListener("b1"), None),
            (
                "b1",
                SECRET,
                Presented::Proxy,
                Some((DenyReason::CredentialElsewhere, "b1", None)),
            ),
            (
                "b1",
                SECRET,
                Presented::RunListener("b2"),
                Some((DenyReason::CredentialElsewhere, "b1", Some("b2"))),
            ),
            (
                "b1",
                SECRET,
                Presented::RunListener("r1"),
                Some((DenyReason::CredentialElsewhere, "b1", Some("r1"))),
            ),
            // A wrong secret of a bound run says nothing of its binding.
            (
                "b1",
                "wrong",
                Presented::Proxy,
                Some((DenyReason::AuthInvalid, "b1", None)),
            ),
            (
                "b1",
                "wrong",
                Presented::RunListener("b2"),
                Some((DenyReason::AuthInvalid, "b1", None)),
            ),
            (
                "b1",
                "wrong",
                Presented::RunListener("b1"),
                Some((DenyReason::AuthInvalid, "b1", None)),
            ),
        ];
        for (id, secret, at, want) in cases {
            let by_header = authenticate(&runs, &headers(&[&basic(&format!("{id}:{secret}"))]), *at);
            let by_pair = authenticate_pair(&runs, id.as_bytes(), secret.as_bytes(), *at);
            for got in [by_header, by_pair] {
                let got = got.map(|r| r.id.to_string()).map_err(|f| {
                    (
                        f.reason,
                        f.claimed.map(|r| r.id.to_string()),
                        f.on.map(|r| r.id.to_string()),
                    )
                });
                let want = match want {
                    None => Ok(id.to_string()),
                    Some((reason, claimed, on)) => Err((*reason, Some(claimed.to_string()), on.map(str::to_owned))),
                };
                assert_eq!(got, want, "{id}:{secret} at {at:?}");
            }
        }
    }

    /// A request on a run's transparent socket needs no credential; one it
    /// carries changes nothing, unless it is another bound run's valid one.
    #[test]
    fn a_transparent_request_refuses_only_another_bound_runs_credential() {
        let runs = registry();
        for sock in ["r1", "b2"] {
            let run = runs.get(sock).unwrap();
            assert!(carried(&runs, &HeaderMap::new(), &run).is_ok());
            for cred in [
                format!("{sock}:{SECRET}"),
                format!("r2:{SECRET}"),
                "b1:wrong".to_owned(),
                "nope:x".to_owned(),
            ] {
                assert!(
                    carried(&runs, &headers(&[&basic(&cred)]), &run).is_ok(),
                    "{cred} on {sock}"
                );
            }
            assert!(carried(&runs, &headers(&["Basic !!"]), &run).is_ok());
            let f = carried(&runs, &headers(&[&basic(&format!("b1:{SECRET}"))]), &run)
                .err()
                .unwrap();
            assert_eq!(
                (
                    f.reason,
                    f.claimed.map(|r| r.id.to_string()),
                    f.on.map(|r| r.id.to_string())
                ),
                (DenyReason::CredentialElsewhere, Some("b1".into()), Some(sock.into()))
            );
        }
    }
}
