//! Deciding the calls of one MCP message, wherever it arrives (the
//! executor's session endpoint asking through the control API, a request to
//! a remote MCP server inside interception): each call against the tool's
//! `[tools.<id>.mcp]` rules in force now (the pure [`mcp`](super::mcp)), the
//! fact of every refused (or, in report mode, reported) call committed
//! before the verdict, never the arguments, only their digest.

use crate::data::decide::mcp::{arguments_digest, decide, McpRefusal};
use crate::facts::{FactTarget, NewFact, Recorded};
use crate::runs::Run;
use crate::state::Shared;
use egress_api::mcp::{McpCall, McpDecision, McpVerdict};
use egress_config::{Mode, Policy, ToolPolicy};
use std::time::Instant;

/// The longest called name a fact's target carries, in characters.
const FACT_NAME_MAX: usize = 256;

/// What a fact's target says of a call: kind `mcp`, the called name (cut
/// at [`FACT_NAME_MAX`] characters, control characters replaced), port 0.
fn fact_target(call: &McpCall) -> FactTarget {
    let host = call
        .name
        .as_deref()
        .unwrap_or("")
        .chars()
        .take(FACT_NAME_MAX)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    FactTarget {
        kind: "mcp".to_owned(),
        host,
        port: 0,
    }
}

/// A fact's detail for a refused call: the method, the arguments' digest
/// and the refusal's message (which names the call, never an argument).
/// The digest comes first, so the 512-byte bound never cuts it.
fn fact_detail(call: &McpCall, refusal: &McpRefusal) -> String {
    let method: String = call.method.chars().take(64).collect();
    format!(
        "{method:?} arguments {}: {}",
        arguments_digest(call.arguments.as_ref()),
        refusal.message
    )
}

/// Commits the fact of one refused call (mode `enforce` or `report`),
/// timed and counted as every fact write is.
async fn record(
    sh: &Shared,
    run: &Run,
    policy: &Policy,
    mode: Mode,
    call: &McpCall,
    refusal: &McpRefusal,
) -> Result<Recorded, String> {
    let fact = crate::facts::denial(NewFact {
        run_id: Some(&*run.id),
        tool: Some(&*run.tool),
        reason: refusal.reason.code(),
        mode: mode.as_str(),
        target: Some(fact_target(call)),
        resolved: vec![],
        policy: &policy.digest,
        detail: fact_detail(call, refusal),
        run: Some(run),
    });
    let t0 = Instant::now();
    let res = sh.facts.record(fact).await;
    sh.metrics.fact_write_duration.observe(t0.elapsed().as_secs_f64());
    res.map_err(|e| {
        sh.metrics.fact_write_failures.inc();
        tracing::error!(error = %e, run = %run.id, "MCP denial fact could not be recorded; the check is refused");
        e.to_string()
    })
}

/// Decides `calls` (a request, or every request of a batch) of `run` with
/// its `tool`'s rules in `policy`. A refused call's fact is committed before
/// the verdict; in report mode the call is allowed and its fact says
/// `report`. One refused call refuses the whole message (`allowed: false`),
/// every call still decided. `Err`: a fact could not be recorded, and
/// nothing may be allowed.
pub(crate) async fn check(
    sh: &Shared,
    run: &Run,
    policy: &Policy,
    tool: &ToolPolicy,
    calls: &[McpCall],
) -> Result<McpVerdict, String> {
    let tm = sh.tool_metrics(Some(&run.tool));
    let decided: Vec<Option<McpRefusal>> = calls.iter().map(|call| decide(tool.mcp.as_ref(), call).err()).collect();
    // Every refused call's fact at once, so a batch shares one commit.
    let writes = calls.iter().zip(&decided).filter_map(|(call, refused)| {
        let refusal = refused.as_ref()?;
        tm.denial(refusal.reason);
        Some(record(sh, run, policy, tool.mode, call, refusal))
    });
    let mut recorded = futures_util::future::join_all(writes).await.into_iter();
    let report = tool.mode == Mode::Report;
    let mut allowed = true;
    let mut decisions = Vec::with_capacity(calls.len());
    for (call, refused) in calls.iter().zip(decided) {
        let Some(refusal) = refused else {
            log_allowed(sh, run, policy, call);
            decisions.push(McpDecision {
                allowed: true,
                reason: None,
                fact_id: None,
                message: None,
            });
            continue;
        };
        let fact = recorded
            .next()
            .ok_or_else(|| "a refused call has no fact write".to_owned())??;
        allowed &= report;
        tracing::info!(
            target: "egress::mcp",
            run = %run.id,
            tool = %run.tool,
            method = %call.method,
            decision = if report { "reported" } else { "denied" },
            reason = refusal.reason.code(),
            fact = %fact.id,
            "MCP call {}",
            if report { "allowed in report mode" } else { "refused" }
        );
        decisions.push(McpDecision {
            allowed: report,
            reason: Some(refusal.reason.code().to_owned()),
            fact_id: Some(fact.id),
            message: Some(refusal.message),
        });
    }
    Ok(McpVerdict { allowed, decisions })
}

/// An allowed call that names what it calls (`tools/call`, `resources/*`,
/// `prompts/get`) in the decision log, as an allowed fetch is (sampled by
/// `[proxy] decisions`, off the answer path): kind `mcp`, the name as its
/// host, the method; never the arguments.
fn log_allowed(sh: &Shared, run: &Run, policy: &Policy, call: &McpCall) {
    if call.name.as_deref().is_none_or(str::is_empty) || !sh.decisions.sample() {
        return;
    }
    let t = fact_target(call);
    sh.decisions.offer(crate::facts::decisions::Decision {
        seq: 0,
        at: crate::time::rfc3339(std::time::SystemTime::now()),
        run_id: run.id.to_string(),
        tool: run.tool.to_string(),
        principal: run.principal().map(|p| p.to_string()),
        executables: run.executables.clone(),
        kind: "mcp".to_owned(),
        target: format!("mcp {}", t.host),
        host: t.host,
        port: 0,
        method: Some(call.method.chars().take(64).collect()),
        path: None,
        status: None,
        outcome: "ok".to_owned(),
        reported: false,
        bytes_up: 0,
        bytes_down: 0,
        duration_ms: 0,
        policy: policy.digest.clone(),
        resolved: vec![],
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deny::DenyReason;
    use serde_json::json;

    fn call(name: &str, arguments: serde_json::Value) -> McpCall {
        McpCall {
            method: "tools/call".to_owned(),
            name: Some(name.to_owned()),
            arguments: Some(arguments),
        }
    }

    #[test]
    fn a_fact_names_the_call_and_the_digest_never_an_argument() {
        let c = call(
            "write_file",
            json!({"path": "/etc/passwd", "token": "sk-live-SECRET-4242"}),
        );
        let refusal = McpRefusal {
            reason: DenyReason::McpArgumentsNotAllowed,
            message: "MCP tool \"write_file\": these arguments are not allowed".to_owned(),
        };
        let detail = fact_detail(&c, &refusal);
        assert!(detail.starts_with("\"tools/call\" arguments sha256:"), "{detail}");
        assert!(detail.contains(&arguments_digest(c.arguments.as_ref())), "{detail}");
        assert!(detail.contains("write_file"), "{detail}");
        for secret in ["sk-live-SECRET-4242", "/etc/passwd", "token"] {
            assert!(!detail.contains(secret), "{secret} in {detail}");
        }
        let t = fact_target(&c);
        assert_eq!((t.kind.as_str(), t.host.as_str(), t.port), ("mcp", "write_file", 0));
    }

    #[test]
    fn a_fact_target_is_bounded_and_has_no_control_characters() {
        let long = format!("a\nb{}", "é".repeat(1000));
        let t = fact_target(&call(&long, json!({})));
        assert_eq!(t.host.chars().count(), FACT_NAME_MAX);
        assert!(t.host.starts_with("a b"));
        let none = McpCall {
            method: "tools/call".to_owned(),
            name: None,
            arguments: None,
        };
        assert_eq!(fact_target(&none).host, "");
        // The digest survives the detail's bound, whatever the message.
        let refusal = McpRefusal {
            reason: DenyReason::McpToolNotAllowed,
            message: "x".repeat(2000),
        };
        let detail = crate::facts::bounded(fact_detail(&none, &refusal));
        assert!(detail.contains(&arguments_digest(None)), "{detail}");
    }
}
