//! MCP decisions on the control API: what the executor asks the proxy about
//! the messages of a confined MCP session (`POST /v1/runs/{id}/mcp`) and
//! about the entries of a list answer (`POST /v1/runs/{id}/mcp/list`). The
//! proxy is the one decider and the one fact store: it holds the tool's
//! `[tools.<id>.mcp]` rules, commits a fact for every refused call before it
//! answers, and the executor only carries the verdict to its client.
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// The largest number of messages one check may carry (a JSON-RPC batch).
pub const MCP_CHECK_MAX_CALLS: usize = 256;
// `#[schema(max_items = ..)]` of `McpCheck::calls` takes a literal.
const _: () = assert!(MCP_CHECK_MAX_CALLS == 256);

/// The most names one list check may carry.
pub const MCP_LIST_MAX_NAMES: usize = 4096;

/// The longest name (or URI) a list check may carry, in characters.
pub const MCP_NAME_MAX: usize = 2048;

/// `McpList::names`: at most [`MCP_LIST_MAX_NAMES`] strings of at most
/// [`MCP_NAME_MAX`] characters each.
pub fn names_schema() -> utoipa::openapi::schema::Array {
    use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, Type};
    ArrayBuilder::new()
        .items(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .max_length(Some(MCP_NAME_MAX)),
        )
        .max_items(Some(MCP_LIST_MAX_NAMES))
        .description(Some(format!(
            "At most {MCP_LIST_MAX_NAMES} names, each at most {MCP_NAME_MAX} characters."
        )))
        .build()
}

/// `POST /v1/runs/{id}/mcp`: the client→server requests of one JSON-RPC
/// message (one request, or every request of a batch). A batch with one
/// refused call is refused whole.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct McpCheck {
    /// At most [`MCP_CHECK_MAX_CALLS`].
    #[schema(max_items = 256)]
    pub calls: Vec<McpCall>,
}

/// One JSON-RPC request, as the decider needs it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct McpCall {
    /// The JSON-RPC method, e.g. `tools/call`, `resources/read`,
    /// `prompts/get`, `initialize`, `ping`.
    pub method: String,
    /// What the call names: `params.name` for `tools/call` and
    /// `prompts/get`, `params.uri` for `resources/read` and
    /// `resources/subscribe`; absent for other methods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `params.arguments` of `tools/call` and `prompts/get`, as the client
    /// sent it (parsed once by the executor, duplicate keys refused there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<Value>,
}

/// The answer to an [`McpCheck`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct McpVerdict {
    /// `true` when every call may go to the server (in report mode refused
    /// calls are allowed and recorded).
    pub allowed: bool,
    /// One per call, in order.
    pub decisions: Vec<McpDecision>,
}

/// The decision on one call.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct McpDecision {
    pub allowed: bool,
    /// The deny reason (`mcp_tool_not_allowed`, `mcp_arguments_not_allowed`,
    /// `mcp_resource_not_allowed`, `mcp_prompt_not_allowed`,
    /// `mcp_method_not_allowed`) when refused, or when allowed in report mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The fact that records the refusal, committed before this answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fact_id: Option<String>,
    /// A fixed text saying what was refused, safe to show the model (names
    /// the tool and the rule step, never the arguments).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// What a list answer lists.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum McpListKind {
    Tools,
    Resources,
    Prompts,
}

impl McpListKind {
    /// The list a request asks for (`tools/list`, `resources/list`,
    /// `prompts/list`): its kind, the answer's array under `result`, and
    /// each entry's member that names it.
    pub fn of_method(method: &str) -> Option<(McpListKind, &'static str, &'static str)> {
        match method {
            "tools/list" => Some((McpListKind::Tools, "tools", "name")),
            "resources/list" => Some((McpListKind::Resources, "resources", "uri")),
            "prompts/list" => Some((McpListKind::Prompts, "prompts", "name")),
            _ => None,
        }
    }
}

/// `POST /v1/runs/{id}/mcp/list`: the names (tools, prompts) or URIs
/// (resources) of one `*/list` answer, to be filtered to what the rules allow.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct McpList {
    pub kind: McpListKind,
    #[schema(schema_with = names_schema)]
    pub names: Vec<String>,
}

/// One flag per listed name, in order: `true` keeps the entry. An entry is
/// kept when some rule could allow a call to it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct McpListed {
    pub keep: Vec<bool>,
}
