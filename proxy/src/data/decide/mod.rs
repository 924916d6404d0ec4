//! The one decider, the only place a rule lives: the [`fetch::Fetch`]
//! context (each step recorded as a fact before it is answered), the pure
//! [`policy`] functions, the canonical [`target`] and the run credential
//! ([`auth`]). Every entrance calls it.

pub(crate) mod auth;
pub(crate) mod fetch;
pub(crate) mod policy;
pub(crate) mod target;
