//! Run routes: create (the credential is shown only in the answer),
//! inspect, list with filters, activate a warm child's run, and end a run,
//! which answers with its final view, its facts and a summary of its denials.

use crate::control::actions;
use crate::control::caller::Caller;
use crate::control::error::{bad_request, ApiError, ApiResult, AppJson, AppQuery};
use crate::facts::FactQuery;
use crate::runs::{valid_run_id, EndReason, NewRun, Placeholder, Run, RunError, RunWrite};
use crate::state::Shared;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use egress_api::{
    Bytes, CreateGrant, CreateRun, CreatedRun, DenialSummary, EndedRun, ErrorBody, GrantView, RunFilter, RunList,
    RunView, Slots,
};
use egress_config::principals::{Action, Record};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;

pub fn run_view(sh: &Shared, run: &Run) -> RunView {
    let (up, down) = run.bytes();
    let (ended_at, end_reason) = match run.ended() {
        Some((at, why)) => (Some(crate::time::rfc3339(at)), Some(why.as_str().to_owned())),
        // Past its expiry but not yet swept: it is already ended for every fetch.
        None if run.state() == crate::runs::RunState::Ended => {
            (Some(crate::time::rfc3339(run.expires_at)), Some("expired".to_owned()))
        }
        None => (None, None),
    };
    RunView {
        run_id: run.id.to_string(),
        tool: run.tool.to_string(),
        state: run.state().as_str().to_owned(),
        created_at: crate::time::rfc3339(run.created_at),
        expires_at: crate::time::rfc3339(run.expires_at),
        labels: run.labels.clone(),
        owner: run.owner.as_deref().map(str::to_owned),
        principal: run.principal().map(|p| p.to_string()),
        executables: run.executables.clone(),
        bound: run.is_bound(),
        slots: Slots {
            max: run.max_slots,
            in_use: run.max_slots - run.slots.available_permits(),
        },
        upstream_idle: run.upstream.len(),
        bytes: Bytes { up, down },
        credential_scrubs: run.scrubbed().map(|(c, n)| (c.to_owned(), n)).collect(),
        ended_at,
        end_reason,
        cell: sh.cell.as_ref().map(|c| c.id.clone()),
        control_url: sh.cell.as_ref().and_then(|c| c.advertise_control.clone()),
        grants: run.grants.list().iter().map(|g| grant_view(g, None)).collect(),
        budgets: budgets_view(sh, run),
        credentials: credentials_view(sh, &run.tool),
    }
}

/// How each credential of `tool` stands (never its value).
pub fn credentials_view(sh: &Shared, tool: &str) -> Vec<egress_api::CredentialView> {
    let policy = sh.policy.load();
    let Some(t) = policy.tool(tool) else {
        return vec![];
    };
    if t.credentials.is_empty() {
        return vec![];
    }
    let statuses = sh.creds.statuses(Some(tool));
    let now = std::time::SystemTime::now();
    t.credentials
        .iter()
        .map(|c| {
            let s = statuses.iter().find(|s| s.name == c.name);
            let rfc = |t: Option<std::time::SystemTime>| t.map(crate::time::rfc3339);
            egress_api::CredentialView {
                name: c.name.to_string(),
                source: c.source.kind().to_owned(),
                live: s.is_some(),
                available: !c.secret.is_empty() && !c.unavailable(),
                read_at: rfc(s.and_then(|s| s.read_at)),
                age_ms: s
                    .and_then(|s| s.read_at)
                    .and_then(|r| now.duration_since(r).ok())
                    .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                expires_at: rfc(s.and_then(|s| s.read_at.and(s.usable_until))),
                last_refresh: s.and_then(|s| {
                    Some(egress_api::RefreshView {
                        at: crate::time::rfc3339(s.last_attempt?),
                        outcome: s.last_outcome?.as_str().to_owned(),
                        error: s.last_error.clone(),
                    })
                }),
                next_refresh_at: rfc(s.and_then(|s| s.next_at)),
            }
        })
        .collect()
}

fn grant_view(g: &crate::runs::grants::Grant, fact_id: Option<String>) -> GrantView {
    GrantView {
        target: format!("{}:{}", g.host, g.port),
        uses_left: g.uses,
        expires_at: crate::time::rfc3339(g.expires_at),
        fact_id,
    }
}

/// The run's spending against its tool's budgets now (`None`: it has none).
fn budgets_view(sh: &Shared, run: &Run) -> Option<egress_api::BudgetsView> {
    let policy = sh.policy.load();
    let b = policy.tool(&run.tool)?.budgets;
    if b == egress_config::Budgets::default() {
        return None;
    }
    let (requests, bytes) = run.spent.used();
    Some(egress_api::BudgetsView {
        requests: egress_api::Used {
            used: requests,
            limit: b.requests,
        },
        bytes: egress_api::Used {
            used: bytes,
            limit: b.bytes,
        },
        rate: b.rate.map(|r| egress_api::RateView {
            per_second: r.per_second,
            burst: r.burst,
        }),
    })
}

#[utoipa::path(post, path = "/v1/runs", tag = "runs", request_body = CreateRun,
    security(("control_token" = [])),
    responses(
        (status = 201, description = "Created; the secret is shown only here, with the environment the run's child gets for its egress (proxy variables, credential placeholders)", body = CreatedRun),
        (status = 400, description = "bad_request", body = ErrorBody),
        (status = 403, description = "scope: the caller has no runs scope for the tool", body = ErrorBody),
        (status = 404, description = "unknown_tool", body = ErrorBody),
        (status = 409, description = "run_exists, owner_not_leased", body = ErrorBody),
        (status = 429, description = "too_many_runs", body = ErrorBody),
        (status = 503, description = "store_unavailable: the run could not be stored durably", body = ErrorBody),
    ))]
pub(super) async fn create_run(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    AppJson(req): AppJson<CreateRun>,
) -> ApiResult<(StatusCode, Json<CreatedRun>)> {
    caller.may(Action::CreateRun { tool: &req.tool })?;
    let executables = req.executables.unwrap_or_default();
    if !egress_api::rules::valid_executables(&executables) {
        return Err(bad_request(format!(
            "executables: at most {} absolute paths (up to 4096 bytes), each to 64 lowercase hex digits",
            egress_api::rules::MAX_EXECUTABLES
        )));
    }
    let policy = sh.policy.load();
    let tool = policy.tool(&req.tool).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_tool",
            format!("no tool {:?} in the config", req.tool),
        )
    })?;
    let id = match req.run_id {
        Some(id) if valid_run_id(&id) => id,
        Some(_) => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "run_id must be 1-128 characters of A-Z a-z 0-9 - _ . ~",
            ))
        }
        None => uuid::Uuid::new_v4().to_string(),
    };
    let labels = req.labels.unwrap_or_default();
    if labels.len() > egress_api::rules::MAX_LABELS {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("at most {} labels", egress_api::rules::MAX_LABELS),
        ));
    }
    let owner = match req.owner {
        Some(o) if !valid_run_id(&o) => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "owner must be 1-128 characters of A-Z a-z 0-9 - _ . ~",
            ))
        }
        Some(o) if sh.owners.lease(&o).is_none() => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "owner_not_leased",
                format!("owner {o:?} holds no live lease: PUT /v1/owners/{o} first"),
            ))
        }
        o => o.map(|o| Arc::<str>::from(o.as_str())),
    };
    let no_randomness = |e: getrandom::Error| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("no randomness: {e}"),
        )
    };
    let secret = crate::runs::random_hex(24).map_err(no_randomness)?;
    let placeholders = tool
        .credentials
        .iter()
        .map(|c| Placeholder::new(&c.name))
        .collect::<Result<Vec<_>, _>>()
        .map_err(no_randomness)?;
    let run = sh.runs.create_bound(
        NewRun {
            id,
            tool: tool.id.clone(),
            labels,
            owner,
            activate: req.activate.unwrap_or(true),
            max_slots: tool.max_concurrent_fetches,
            max_waiting: tool.max_queued_fetches,
            max_conns: sh.cfg.max_connections_per_run,
            placeholders,
            principal: caller.recorded(),
            creator: caller.recorded(),
            executables,
        },
        secret.clone(),
        req.bound.unwrap_or(false),
    )?;
    if let Err(e) = sh.facts.save_run(RunWrite::Save(run.record())).await {
        sh.runs.end(&run, EndReason::Ended);
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            format!("the run could not be stored durably: {e}"),
        ));
    }
    sh.run_created(&run);
    tracing::info!(target: "egress::runs", run = %run.id, tool = %run.tool, state = run.state().as_str(), bound = run.is_bound(), "run created");
    let proxy_url = format!("{}://{}:{}@{}", sh.proxy_scheme, run.id, secret, sh.proxy_authority);
    let env = child_env(&sh, &proxy_url, &run, tool);
    Ok((
        StatusCode::CREATED,
        Json(CreatedRun {
            run: run_view(&sh, &run),
            secret,
            proxy_url,
            env,
        }),
    ))
}

/// What the run's child must be given for its egress: the proxy URL
/// variables, one placeholder per credential under its `placeholder_env`,
/// and, when the proxy may intercept the tool's CONNECTs (credentials,
/// `inspect`, method and path rules), the CA bundle variables.
fn child_env(sh: &Shared, proxy_url: &str, run: &Run, tool: &egress_config::ToolPolicy) -> BTreeMap<String, String> {
    let mut env = egress_api::proxy_env(proxy_url);
    if tool.inspect || !tool.credentials.is_empty() || tool.allowlist.restricts_requests() {
        let ca = sh.ca.load();
        env.extend(egress_api::ca_env(
            &ca.files.bundle.display().to_string(),
            &ca.files.cert.display().to_string(),
        ));
    }
    for p in run.placeholders.iter() {
        if let Some(c) = tool.credentials.iter().find(|c| *c.name == *p.credential) {
            env.insert(c.placeholder_env.clone(), p.value.to_string());
            // A signing credential's tool signs with the placeholder as its
            // secret key too: the proxy signs again with the real one.
            if let Some(sign) = &c.sign {
                env.insert(sign.secret_env.clone(), p.value.to_string());
            }
        }
    }
    env
}

fn find(sh: &Shared, id: &str) -> ApiResult<Arc<Run>> {
    sh.runs.get(id).ok_or_else(|| RunError::NotFound(id.to_owned()).into())
}

/// The run `id`, if the caller may use it (read, activate, speak MCP for).
pub(super) fn find_for(sh: &Shared, caller: &Caller, id: &str) -> ApiResult<Arc<Run>> {
    let run = find(sh, id)?;
    let owner = run.principal();
    caller.may(Action::UseRun {
        tool: &run.tool,
        owner: owner.as_deref().map(String::as_str),
    })?;
    Ok(run)
}

fn store_error(e: crate::facts::FactError) -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", e.to_string())
}

#[utoipa::path(get, path = "/v1/runs/{id}", tag = "runs", security(("control_token" = [])),
    params(("id" = String, Path, description = "Run id")),
    responses(
        (status = 200, description = "The run", body = RunView),
        (status = 403, description = "not_your_run: attributed to another principal; scope", body = ErrorBody),
        (status = 404, description = "run_not_found (never existed, or ended more than five minutes ago)", body = ErrorBody),
    ))]
pub(super) async fn get_run(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<RunView>> {
    let run = find_for(&sh, &caller, &id)?;
    Ok(Json(run_view(&sh, &run)))
}

/// The query of `POST /v1/runs/{id}/activate`.
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ActivateParams {
    /// Attribute the run to this principal from now on (its facts, its
    /// decisions, who may see and end it): the executor names the caller
    /// it activates a warm child's run for. Needs `admin`.
    #[serde(default)]
    #[param(pattern = r"^[A-Za-z0-9._~-]{1,128}$")]
    pub principal: Option<String>,
}

#[utoipa::path(post, path = "/v1/runs/{id}/activate", tag = "runs", security(("control_token" = [])),
    params(("id" = String, Path, description = "Run id"), ActivateParams),
    responses(
        (status = 200, description = "Active (activating an active run is a no-op)", body = RunView),
        (status = 400, description = "bad_request: a query parameter other than principal", body = ErrorBody),
        (status = 403, description = "not_your_run, scope (attributing needs admin)", body = ErrorBody),
        (status = 404, description = "run_not_found; unknown_principal: `principal` names no principal", body = ErrorBody),
        (status = 409, description = "run_ended", body = ErrorBody),
        (status = 503, description = "store_unavailable", body = ErrorBody),
    ))]
pub(super) async fn activate_run(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    AppQuery(q): AppQuery<ActivateParams>,
) -> ApiResult<Json<RunView>> {
    let target = find_for(&sh, &caller, &id)?;
    if let Some(p) = &q.principal {
        caller.may(Action::Attribute)?;
        if sh.principals.load().by_name(p).is_none() {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "unknown_principal",
                format!("principal {p:?} is not in the principals file"),
            ));
        }
        target.attribute((p != egress_config::principals::CONTROL).then_some(p.as_str()));
    }
    let run = sh.activate_run(&id)?;
    // Not waited for: committed with the next run write (the end of a short
    // invocation, whose deletion it then no longer delays) or within
    // RUN_WRITE_DELAY. A crash before then brings the run back inactive,
    // which fails closed. An update: if the run ended meanwhile and its
    // record is gone, it stays gone.
    sh.facts
        .save_run_soon(RunWrite::Update(run.record()))
        .await
        .map_err(store_error)?;
    tracing::info!(target: "egress::runs", run = %run.id, tool = %run.tool, "run activated");
    Ok(Json(run_view(&sh, &run)))
}

fn not_permitted(message: String) -> ApiError {
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "grant_not_permitted", message)
}

/// Allows the run one `name:port` its tool's allowlist does not list (a
/// kernel's "allow once", after asking a person). Refused, whatever the
/// kernel asks, for what the hard rules deny: an IP address, a name that
/// resolves only into denied ranges or to the appliance itself, and a host
/// of another tool's credential. The grant's fact is durable before the
/// answer.
#[utoipa::path(post, path = "/v1/runs/{id}/grants", tag = "runs", request_body = CreateGrant,
    security(("control_token" = [])),
    params(("id" = String, Path, description = "Run id")),
    responses(
        (status = 201, description = "Granted: the run may reach the target for `uses` fetches until `expires_at`", body = GrantView),
        (status = 400, description = "bad_request: the body is not a grant (uses 1-1000000, ttl_ms at least 1)", body = ErrorBody),
        (status = 403, description = "not_your_run, scope, beyond_scope (the caller's grants scope: its tools, max ttl and uses); a CONTROL_ACTION fact records the refusal", body = ErrorBody),
        (status = 404, description = "run_not_found", body = ErrorBody),
        (status = 409, description = "run_ended", body = ErrorBody),
        (status = 422, description = "beyond_envelope: [proxy] envelope does not list the target for the tool (a CONTROL_ACTION fact records it); bad_target: the target is not name:port; grant_not_permitted: an IP address, a name resolving only to denied addresses (or not at all), a host of another tool's credential, or more than 64 live grants", body = ErrorBody),
        (status = 503, description = "facts_unavailable", body = ErrorBody),
    ))]
pub(super) async fn create_grant(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    AppJson(req): AppJson<CreateGrant>,
) -> ApiResult<(StatusCode, Json<GrantView>)> {
    use crate::runs::grants::{Grant, MAX_GRANTS};
    use egress_config::Host;
    if req.uses.is_some_and(|u| !(1..=1_000_000).contains(&u)) {
        return Err(bad_request("uses must be 1-1000000"));
    }
    if req.ttl_ms == Some(0) {
        return Err(bad_request("ttl_ms must be at least 1"));
    }
    let run = find(&sh, &id)?;
    let until_end_ms = run
        .expires_at
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_default()
        .as_millis() as u64;
    let owner = run.principal();
    let asked = Action::Grant {
        tool: &run.tool,
        owner: owner.as_deref().map(String::as_str),
        ttl_ms: req.ttl_ms.unwrap_or(until_end_ms).min(until_end_ms),
        uses: req.uses.unwrap_or(1),
    };
    if let Err(refused) = caller.may(asked) {
        let shown: String = req.target.chars().take(300).collect();
        refuse_grant(
            &sh,
            &caller,
            &run,
            "grant_refused",
            format!("grant of {shown} refused: {}", refused.message()),
        )
        .await?;
        return Err(refused);
    }
    if run.state() == crate::runs::RunState::Ended {
        return Err(RunError::Ended(id).into());
    }
    let shown: String = req.target.chars().take(300).collect();
    let (host, port) = egress_config::parse_authority(&req.target).map_err(|e| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "bad_target",
            format!("target {shown:?} is not name:port: {e}"),
        )
    })?;
    let name = match host {
        Host::Ip(ip) => {
            return Err(not_permitted(format!(
                "{ip}:{port} is an IP address: a grant names a host, and addresses are never granted"
            )))
        }
        Host::Name(n) => n,
    };
    if let Some(envelope) = sh.envelope.load_full() {
        if !egress_config::diff::grant_within(&envelope, &run.tool, &Host::Name(name.clone()), port) {
            let message = format!(
                "{name}:{port} is beyond [proxy] envelope for tool {}: never granted",
                run.tool
            );
            refuse_grant(&sh, &caller, &run, "beyond_envelope", message.clone()).await?;
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "beyond_envelope",
                message,
            ));
        }
    }
    let policy = sh.policy.load_full();
    let foreign = policy.tools.values().filter(|t| *t.id != *run.tool).any(|t| {
        t.credentials.iter().any(|c| {
            c.hosts
                .iter()
                .any(|(h, p)| *p == port && matches!(h, Host::Name(n) if *n == name))
        })
    });
    if foreign {
        return Err(not_permitted(format!(
            "{name}:{port} is a host of another tool's credential: it is never granted"
        )));
    }
    let resolved = sh
        .resolver
        .resolve(&name)
        .await
        .map_err(|e| not_permitted(format!("{name} cannot be resolved now ({e:?}): nothing to grant")))?;
    let vetted =
        crate::data::decide::policy::vet(&resolved, port, &policy.ranges, false, &sh.me, &sh.host_addrs.load());
    if vetted.allowed.is_empty() {
        let denied: Vec<String> = resolved.iter().map(|i| i.to_string()).collect();
        return Err(not_permitted(format!(
            "{name}:{port} resolves only to denied addresses or the appliance itself ({}): never granted",
            denied.join(", ")
        )));
    }
    let uses = req.uses.unwrap_or(1);
    let until_end = run
        .expires_at
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_default();
    let ttl = req.ttl_ms.map_or(until_end, |ms| {
        std::time::Duration::from_millis(ms.max(1)).min(until_end)
    });
    let grant = Grant {
        host: name.clone(),
        port,
        uses,
        expires: std::time::Instant::now() + ttl,
        expires_at: std::time::SystemTime::now() + ttl,
    };
    let fact = egress_api::Fact {
        kind: egress_api::GRANT_FACT_TYPE.to_owned(),
        ..crate::facts::denial(crate::facts::NewFact {
            run_id: Some(&run.id),
            tool: Some(&run.tool),
            reason: "grant",
            mode: "grant",
            target: Some(egress_api::FactTarget {
                kind: "grant".to_owned(),
                host: name.clone(),
                port,
            }),
            resolved: vec![],
            policy: &policy.digest,
            detail: format!(
                "{} granted {name}:{port} to run {} for {uses} use(s), {} ms",
                caller
                    .recorded()
                    .map_or("the kernel".to_owned(), |p| format!("principal {p}")),
                run.id,
                ttl.as_millis()
            ),
            run: Some(&run),
        })
    };
    if !run.grants.add(grant.clone()) {
        return Err(not_permitted(format!(
            "run {id} already holds {MAX_GRANTS} live grants"
        )));
    }
    let recorded = match sh.facts.record(fact).await {
        Ok(r) => r,
        Err(e) => {
            // No grant without its fact.
            run.grants.remove(&name, port);
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "facts_unavailable",
                e.to_string(),
            ));
        }
    };
    sh.metrics.grants(&run.tool, "granted").inc();
    tracing::info!(target: "egress::runs", run = %run.id, tool = %run.tool, grant = %format!("{name}:{port}"), uses, ttl_ms = ttl.as_millis() as u64, "grant made");
    Ok((StatusCode::CREATED, Json(grant_view(&grant, Some(recorded.id)))))
}

/// Records a refused grant as a `CONTROL_ACTION` fact before the answer;
/// `503` when the store cannot (the refusal stands either way).
async fn refuse_grant(sh: &Shared, caller: &Caller, run: &Run, reason: &'static str, detail: String) -> ApiResult<()> {
    let policy = sh.policy.load();
    actions::record(
        sh,
        actions::Action {
            reason,
            principal: caller.recorded().as_deref(),
            run: Some(run),
            tool: None,
            target: None,
            detail,
            policy: &policy.digest,
        },
    )
    .await
    .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "facts_unavailable", e))
}

/// Ends the run and answers with its final view, its facts (up to
/// [`END_FACTS`]) and a summary of its denials, so ending a run and
/// collecting what it was denied is one call.
#[utoipa::path(delete, path = "/v1/runs/{id}", tag = "runs", security(("control_token" = [])),
    params(("id" = String, Path, description = "Run id")),
    responses(
        (status = 200, description = "Ended: every open fetch of the run is severed", body = EndedRun),
        (status = 403, description = "not_your_run: attributed to another principal (admin may end it, and a CONTROL_ACTION fact records that)", body = ErrorBody),
        (status = 404, description = "run_not_found", body = ErrorBody),
        (status = 503, description = "facts_unavailable, store_unavailable", body = ErrorBody),
    ))]
pub(super) async fn end_run(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<EndedRun>> {
    let run = find(&sh, &id)?;
    let owner = run.principal();
    let owner = owner.as_deref().map(String::as_str);
    caller.may(Action::EndRun { tool: &run.tool, owner })?;
    let me = caller.recorded();
    if owner != me.as_deref() && run.creator.as_deref() != me.as_deref() && run.state() != crate::runs::RunState::Ended
    {
        let policy = sh.policy.load();
        actions::record(
            &sh,
            actions::Action {
                reason: "run_ended_by_other",
                principal: me.as_deref(),
                run: Some(&run),
                tool: None,
                target: None,
                detail: format!(
                    "{} ended run {} of {}",
                    caller.name(),
                    run.id,
                    owner.unwrap_or(egress_config::principals::CONTROL)
                ),
                policy: &policy.digest,
            },
        )
        .await
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "facts_unavailable", e))?;
    }
    sh.end_run(&run, EndReason::Ended);
    // The record's deletion goes through the store's writer behind every
    // fact already queued, so the query below sees all of them: it must
    // follow the deletion, not run beside it. A run the store knows has no
    // facts (most runs) skips it.
    let may_have_facts = sh.facts.forget_run(id.clone()).await.map_err(store_error)?;
    let facts = if may_have_facts {
        sh.facts
            .query(FactQuery {
                after: 0,
                limit: END_FACTS + 1,
                run_id: Some(id),
            })
            .await
            .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "facts_unavailable", e.to_string()))?
    } else {
        Vec::new()
    };
    let facts_truncated = facts.len() > END_FACTS;
    let mut facts = facts;
    facts.truncate(END_FACTS);
    let mut by_reason = serde_json::Map::new();
    let mut total = 0u64;
    for f in &facts {
        total += f.count;
        let n = by_reason.get(&f.reason).and_then(Value::as_u64).unwrap_or(0);
        by_reason.insert(f.reason.clone(), Value::from(n + f.count));
    }
    Ok(Json(EndedRun {
        run: run_view(&sh, &run),
        facts,
        facts_truncated,
        denials: DenialSummary { total, by_reason },
    }))
}

/// Facts returned with an ended run (the rest by `GET /v1/runs/{id}/facts`).
pub const END_FACTS: usize = 1000;

/// `GET /v1/runs`: live runs and recently ended ones, by id, filtered and paged.
#[utoipa::path(get, path = "/v1/runs", tag = "runs", security(("control_token" = [])),
    params(RunFilter),
    responses(
        (status = 200, description = "Runs sorted by id", body = RunList),
        (status = 400, description = "bad_request", body = ErrorBody),
    ))]
pub(super) async fn list_runs(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    AppQuery(q): AppQuery<RunFilter>,
) -> ApiResult<Json<RunList>> {
    let f = q;
    if let Some(s) = &f.state {
        if !matches!(s.as_str(), "created" | "active" | "ended") {
            return Err(bad_request("state must be created, active or ended"));
        }
    }
    let label = match &f.label {
        Some(l) => Some(
            l.split_once('=')
                .ok_or_else(|| bad_request("label must be key=value"))?,
        ),
        None => None,
    };
    let limit = f.limit.unwrap_or(100).clamp(1, 1000);
    let mut runs: Vec<Arc<Run>> = sh
        .runs
        .all()
        .into_iter()
        .filter(|r| f.tool.as_deref().is_none_or(|t| *r.tool == *t))
        .filter(|r| f.state.as_deref().is_none_or(|s| r.state().as_str() == s))
        .filter(|r| f.owner.as_deref().is_none_or(|o| r.owner.as_deref() == Some(o)))
        .filter(|r| label.is_none_or(|(k, v)| r.labels.get(k).and_then(Value::as_str) == Some(v)))
        .filter(|r| f.after.as_deref().is_none_or(|a| &*r.id > a))
        .filter(|r| caller.sees(Record::Run, r.principal().as_deref().map(String::as_str)))
        .collect();
    runs.sort_by(|a, b| a.id.cmp(&b.id));
    let more = runs.len() > limit;
    runs.truncate(limit);
    let next = if more {
        runs.last().map(|r| r.id.to_string())
    } else {
        None
    };
    Ok(Json(RunList {
        runs: runs.iter().map(|r| run_view(&sh, r)).collect(),
        next,
    }))
}
