//! The MCP decisions, pure: one call of a confined MCP session against its
//! tool's `[tools.<id>.mcp]` rules (matched by `egress_config::mcp`) to a
//! deny reason and a message safe to show the model, which entries of a
//! list answer to keep, and the digest a fact records instead of a call's
//! arguments.
//!
//! Only `tools/call`, `resources/read`, `resources/subscribe` and
//! `prompts/get` are decided; every other method (`initialize`, `ping`,
//! notifications, `*/list`, `completion/complete`, ...) is allowed, as the
//! list answers are filtered by [`keep_listed`]. Methods are compared
//! exactly, as JSON-RPC names them.

use crate::deny::DenyReason;
use egress_api::mcp::{McpCall, McpListKind};
use egress_config::mcp::{McpList, McpMatch, McpRules};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::fmt::Write as _;

/// A refused call: its reason and a fixed text naming what was refused
/// and the rule step (never an argument's value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct McpRefusal {
    pub(crate) reason: DenyReason,
    pub(crate) message: String,
}

/// What a decided method names and is refused with.
struct Kind {
    /// `tool`, `resource`, `prompt`: how the message names it.
    noun: &'static str,
    /// The list keys, for the message.
    allow_key: &'static str,
    deny_key: &'static str,
    not_allowed: DenyReason,
    list: fn(&McpRules) -> &McpList,
}

const TOOLS: Kind = Kind {
    noun: "tool",
    allow_key: "tools",
    deny_key: "deny_tools",
    not_allowed: DenyReason::McpToolNotAllowed,
    list: |r| &r.tools,
};

const RESOURCES: Kind = Kind {
    noun: "resource",
    allow_key: "resources",
    deny_key: "deny_resources",
    not_allowed: DenyReason::McpResourceNotAllowed,
    list: |r| &r.resources,
};

const PROMPTS: Kind = Kind {
    noun: "prompt",
    allow_key: "prompts",
    deny_key: "deny_prompts",
    not_allowed: DenyReason::McpPromptNotAllowed,
    list: |r| &r.prompts,
};

/// The kind a method is decided as; `None`: not decided (allowed).
fn kind_of(method: &str) -> Option<&'static Kind> {
    match method {
        "tools/call" => Some(&TOOLS),
        "resources/read" | "resources/subscribe" => Some(&RESOURCES),
        "prompts/get" => Some(&PROMPTS),
        _ => None,
    }
}

/// The longest name a message quotes, in characters.
const NAME_IN_MESSAGE: usize = 128;

/// `name` quoted (control characters escaped), cut at [`NAME_IN_MESSAGE`].
fn quoted(name: &str) -> String {
    match name.char_indices().nth(NAME_IN_MESSAGE) {
        Some((at, _)) => format!("{:?}...", &name[..at]),
        None => format!("{name:?}"),
    }
}

/// Decides one call. `rules: None` (no `[tools.<id>.mcp]`) allows every call.
pub(crate) fn decide(rules: Option<&McpRules>, call: &McpCall) -> Result<(), McpRefusal> {
    let (Some(rules), Some(kind)) = (rules, kind_of(&call.method)) else {
        return Ok(());
    };
    let Some(name) = call.name.as_deref() else {
        return Err(McpRefusal {
            reason: kind.not_allowed,
            message: format!("MCP {} names no {}: refused", call.method, kind.noun),
        });
    };
    let (noun, q) = (kind.noun, quoted(name));
    let (reason, message) = match (kind.list)(rules).check(name, call.arguments.as_ref()) {
        McpMatch::Allowed => return Ok(()),
        McpMatch::NameDenied => (
            kind.not_allowed,
            format!("MCP {noun} {q} is denied by a {} rule", kind.deny_key),
        ),
        McpMatch::NameNotAllowed => (
            kind.not_allowed,
            format!("MCP {noun} {q} is not allowed: no {} entry names it", kind.allow_key),
        ),
        McpMatch::ArgumentsDenied => (
            DenyReason::McpArgumentsNotAllowed,
            format!("MCP {noun} {q}: these arguments are denied by a {} rule", kind.deny_key),
        ),
        McpMatch::ArgumentsNotAllowed => (
            DenyReason::McpArgumentsNotAllowed,
            format!(
                "MCP {noun} {q}: these arguments are not allowed: no {} entry for it matches them",
                kind.allow_key
            ),
        ),
    };
    Err(McpRefusal { reason, message })
}

/// Whether a `*/list` answer keeps the entry `name` (a tool's or prompt's
/// name, a resource's URI): whether some call to it could be allowed.
pub(crate) fn keep_listed(rules: Option<&McpRules>, kind: McpListKind, name: &str) -> bool {
    let Some(rules) = rules else {
        return true;
    };
    let kind = match kind {
        McpListKind::Tools => &TOOLS,
        McpListKind::Resources => &RESOURCES,
        McpListKind::Prompts => &PROMPTS,
    };
    (kind.list)(rules).may_list(name)
}

/// `sha256:` and the hex digest of the arguments' canonical JSON (object
/// keys sorted by their bytes, no spaces; absent arguments digest as the
/// empty text): what a fact records instead of the arguments.
pub(crate) fn arguments_digest(args: Option<&Value>) -> String {
    let mut text = String::new();
    if let Some(v) = args {
        canonical(v, &mut text);
    }
    let digest = Sha256::digest(text.as_bytes());
    let mut out = String::with_capacity(7 + 64);
    out.push_str("sha256:");
    for b in digest {
        let _ = write!(out, "{b:02x}");
    }
    out
}

fn canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                canonical(&m[k], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(item, out);
            }
            out.push(']');
        }
        // Scalars as serde_json writes them.
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
#[path = "mcp_tests.rs"]
mod tests;
