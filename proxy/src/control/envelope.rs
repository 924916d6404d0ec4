//! The policy envelope (`[proxy] envelope`): a config file, private to the
//! operator, whose tools and ranges bound every policy the proxy may run
//! and every grant it may make. A start, a reload or a grant that reaches
//! beyond it is refused; the refusal carries the diff against it
//! (`egress_config::diff::beyond`).

use egress_config::{Config, ConfigError, Policy, Problem};
use std::path::Path;
use std::sync::Arc;

/// The envelope's policy, read from `path`, which must be mode 0600 or
/// stricter (a kernel that could write it could widen it).
pub fn load(path: &Path) -> Result<Arc<Policy>, ConfigError> {
    use std::os::unix::fs::PermissionsExt as _;
    let file = path.display().to_string();
    let one = |message: String| ConfigError {
        file: file.clone(),
        problems: vec![Problem {
            path: String::new(),
            message,
        }],
    };
    let meta = std::fs::metadata(path).map_err(|e| one(format!("the policy envelope cannot be read: {e}")))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(one(format!(
            "the policy envelope is mode {mode:04o}: it must be 0600 or stricter (readable only by the operator)"
        )));
    }
    let text = std::fs::read_to_string(path).map_err(|e| one(format!("the policy envelope cannot be read: {e}")))?;
    let dir = path.parent().unwrap_or(Path::new(""));
    Ok(Config::parse_relative_to(&text, &file, dir)?.policy)
}

/// `Err` with the report of how `policy` reaches beyond `envelope`.
pub fn check(envelope: &Policy, policy: &Policy) -> Result<(), crate::learn::diff::Report> {
    if egress_config::diff::beyond(envelope, policy).is_empty() {
        return Ok(());
    }
    let mut r = crate::learn::diff::report(envelope, policy, None);
    r.changes
        .retain(|j| j.change.direction == egress_config::diff::Direction::Widens);
    Err(r)
}
