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
    let file = path.display().to_string();
    let text = egress_config::credentials::read_private(path, "the policy envelope (readable only by the operator)")
        .map_err(|message| ConfigError {
            file: file.clone(),
            problems: vec![Problem {
                path: String::new(),
                message,
            }],
        })?;
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
