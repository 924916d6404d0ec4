//! The listener hand-off's wire, between the executor and the proxy's
//! hand-off socket: one unix stream connection per message. A hand-off is
//! [`MAGIC`] + run id + `\n` carrying exactly one `SCM_RIGHTS` descriptor (a
//! listening TCP socket); a probe is [`PROBE`] with none. The proxy answers
//! [`OK`] or [`ERROR`] + why + `\n`, and closes.

/// Prefix of a hand-off message (the run id and `\n` follow).
pub const MAGIC: &str = "loom-handoff/1 ";
/// The whole probe message: "do you receive hand-offs here?".
pub const PROBE: &str = "loom-handoff-probe/1\n";
/// The answer to a hand-off or probe that was accepted.
pub const OK: &str = "ok\n";
/// Prefix of the answer to one that was refused.
pub const ERROR: &str = "error ";
/// Prefix of a transparent hand-off (the run id and `\n` follow): exactly
/// four `SCM_RIGHTS` descriptors made inside the child's namespace, in this
/// order: the TCP listener on `127.0.0.1:3127` and the one on `[::1]:3127`
/// (where every TCP connection to an outside address is redirected), the
/// UDP socket and the TCP listener on `[::]:53` (taking IPv4 too)
/// (where every DNS query is).
pub const TRANSPARENT: &str = "loom-transparent/1 ";
