//! What carries an answer once it is decided: dialling the vetted addresses
//! ([`upstream`]), plain HTTP ([`forward`], [`body`], with credentials
//! written in by [`inject`] and taken out by [`scrub`]), tunnels
//! ([`tunnel`]), WebSocket connections ([`websocket`], [`frames`]), first bytes ([`sniff`],
//! [`prefixed`]), the answers the proxy writes ([`respond`]) and the end of
//! a fetch ([`finish`]).

pub(crate) mod body;
pub(crate) mod finish;
pub(crate) mod forward;
pub(crate) mod frames;
pub(crate) mod inject;
pub(crate) mod prefixed;
pub(crate) mod relayed;
pub(crate) mod resign;
pub(crate) mod respond;
pub(crate) mod scrub;
pub(crate) mod sniff;
pub(crate) mod tunnel;
pub(crate) mod upstream;
pub(crate) mod websocket;
