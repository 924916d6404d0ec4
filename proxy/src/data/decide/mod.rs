//! The one decider, the only place a rule lives: the [`fetch::Fetch`]
//! context (each step recorded as a fact before it is answered), the pure
//! [`policy`] functions, the canonical [`target`], the run credential
//! ([`auth`]), what a refusal says ([`refusal`]) and the MCP calls of
//! confined MCP sessions ([`mcp`]). Every entrance calls it; it imports no
//! entrance and no carrier.

pub(crate) mod auth;
pub(crate) mod fetch;
pub(crate) mod mcp;
pub(crate) mod mcp_check;
pub(crate) mod policy;
pub(crate) mod refusal;
pub(crate) mod target;
