//! Principals: who may do what on the control plane. A principals file
//! (`[control] principals_file`, mode 0600 or stricter) names each kernel or
//! operator, the SHA-256 of its tokens, the mTLS subjects it may present and
//! its scopes; [`authorize`] is the one pure function both services (the
//! proxy's control API and the executor's API) ask before they act, and
//! [`Principal::sees`] decides which records a listing shows. The control
//! token is the built-in principal [`CONTROL`], which holds every scope.

use crate::reader::{Problems, Section};
use crate::{ConfigError, Problem};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// The built-in principal of the control token: every scope. A file cannot
/// name a principal so.
pub const CONTROL: &str = "control";

/// The most principals a file holds, and tokens or subjects one principal has.
pub const MAX_PRINCIPALS: usize = 100_000;
pub const MAX_PER_PRINCIPAL: usize = 16;

/// Defaults of a `grants:` scope's bounds.
pub const DEFAULT_GRANT_MAX_TTL_MS: u64 = 600_000;
pub const DEFAULT_GRANT_MAX_USES: u32 = 100;

/// Which records of a kind a principal sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum Visibility {
    #[default]
    None,
    /// Records of runs attributed to the principal.
    Own,
    All,
}

/// Tool ids a scope covers: each pattern is a tool id, or a glob in which
/// `*` stands for any run of characters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToolGlobs(Vec<String>);

impl ToolGlobs {
    pub fn any() -> Self {
        ToolGlobs(vec!["*".into()])
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn matches(&self, tool: &str) -> bool {
        self.0.iter().any(|g| glob(g, tool))
    }

    pub fn patterns(&self) -> &[String] {
        &self.0
    }
}

/// Whether `text` matches `pattern`, where `*` matches any run of
/// characters (also none) and everything else itself.
pub fn glob(pattern: &str, text: &str) -> bool {
    let (p, t) = (pattern.as_bytes(), text.as_bytes());
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, ti));
            pi += 1;
        } else if pi < p.len() && p[pi] == t[ti] {
            pi += 1;
            ti += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&b| b == b'*')
}

/// What a principal may do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scopes {
    /// Tools it may invoke through the executor (and their MCP endpoints).
    pub invoke: ToolGlobs,
    /// Tools whose runs it may create, activate, end and read (its own).
    pub runs: ToolGlobs,
    pub facts: Visibility,
    pub decisions: Visibility,
    /// Tools of the runs it may grant extra reach to, and the bounds.
    pub grants: ToolGlobs,
    pub grant_max_ttl_ms: u64,
    pub grant_max_uses: u32,
    pub policy_read: bool,
    pub policy_reload: bool,
    pub metrics: bool,
    /// Everything, including others' runs and attributing runs to others.
    pub admin: bool,
}

impl Scopes {
    /// Every scope: the control token's.
    pub fn all() -> Self {
        Scopes {
            invoke: ToolGlobs::any(),
            runs: ToolGlobs::any(),
            facts: Visibility::All,
            decisions: Visibility::All,
            grants: ToolGlobs::any(),
            grant_max_ttl_ms: u64::MAX,
            grant_max_uses: u32::MAX,
            policy_read: true,
            policy_reload: true,
            metrics: true,
            admin: true,
        }
    }

    /// Adds one scope as the file and `principal add --scope` write it;
    /// `Err` says what is wrong with it.
    pub fn add(&mut self, scope: &str) -> Result<(), String> {
        let (name, arg) = match scope.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (scope, None),
        };
        let tools = |a: Option<&str>| -> Result<String, String> {
            match a {
                Some(g) if !g.is_empty() && g.len() <= 128 && g.bytes().all(|b| b.is_ascii_graphic()) => {
                    Ok(g.to_owned())
                }
                _ => Err(format!("{name}: needs a tool id or glob, as in \"{name}:search-*\"")),
            }
        };
        let visibility = |a: Option<&str>| match a {
            Some("own") => Ok(Visibility::Own),
            Some("all") => Ok(Visibility::All),
            _ => Err(format!("{name}: must be \"{name}:own\" or \"{name}:all\"")),
        };
        match (name, arg) {
            ("invoke", a) => self.invoke.0.push(tools(a)?),
            ("runs", a) => self.runs.0.push(tools(a)?),
            ("grants", a) => self.grants.0.push(tools(a)?),
            ("facts", a) => self.facts = self.facts.max(visibility(a)?),
            ("decisions", a) => self.decisions = self.decisions.max(visibility(a)?),
            ("policy", Some("read")) => self.policy_read = true,
            ("policy", Some("reload")) => self.policy_reload = true,
            ("metrics", None) => self.metrics = true,
            ("admin", None) => self.admin = true,
            _ => {
                return Err(format!(
                    "unknown scope {scope:?} (expected invoke:<tools>, runs:<tools>, grants:<tools>, \
                     facts:own|all, decisions:own|all, policy:read, policy:reload, metrics, admin)"
                ))
            }
        }
        Ok(())
    }
}

/// One principal of the file (or the control token's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub name: Arc<str>,
    pub scopes: Scopes,
    /// mTLS subject names (a certificate's subject CN or a DNS SAN) that
    /// authenticate as this principal.
    pub subjects: Vec<String>,
}

impl Principal {
    /// The control token's principal.
    pub fn control() -> Self {
        Principal {
            name: CONTROL.into(),
            scopes: Scopes::all(),
            subjects: vec![],
        }
    }

    /// The name recorded on runs it creates: none for the control token, so
    /// single-token setups record what they always did.
    pub fn recorded(&self) -> Option<&Arc<str>> {
        (&*self.name != CONTROL).then_some(&self.name)
    }

    /// Whether a record of `kind` attributed to `owner` (a run's principal,
    /// `None` for the control token's runs) is shown to this principal.
    pub fn sees(&self, kind: Record, owner: Option<&str>) -> bool {
        let visibility = match kind {
            Record::Run => {
                if self.scopes.admin {
                    Visibility::All
                } else {
                    Visibility::Own
                }
            }
            Record::Fact => self.scopes.facts,
            Record::Decision => self.scopes.decisions,
        };
        match visibility {
            Visibility::All => true,
            Visibility::Own => owner == Some(&*self.name),
            Visibility::None => false,
        }
    }
}

/// Kinds of records a listing filters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    Run,
    Fact,
    Decision,
}

/// What a caller asks to do. `owner` is the principal a run is attributed
/// to (`None`: the control token's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action<'a> {
    CreateRun {
        tool: &'a str,
    },
    /// Read, activate, or speak MCP for a run.
    UseRun {
        tool: &'a str,
        owner: Option<&'a str>,
    },
    EndRun {
        tool: &'a str,
        owner: Option<&'a str>,
    },
    /// Attribute a run to another principal (the executor, for its caller).
    Attribute,
    Grant {
        tool: &'a str,
        owner: Option<&'a str>,
        ttl_ms: u64,
        uses: u32,
    },
    Invoke {
        tool: &'a str,
    },
    /// Any listing of facts (filtered by [`Principal::sees`]).
    ReadFacts,
    ReadDecisions,
    /// Suggestions and replays, which read every record.
    Learn,
    PolicyRead,
    PolicyReload,
    Metrics,
    /// Owner leases (a kernel's lease for the runs it creates).
    Owners,
    /// Report what the executor refused to start (admin only).
    ReportExecutor,
    /// Renew or release a live owner lease held by `holder` (`None`: the
    /// control token's).
    Lease {
        holder: Option<&'a str>,
    },
}

/// Why an action is refused: a reason code and a message naming the scope
/// that is missing. Answered as `403`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub code: &'static str,
    pub message: String,
}

fn refuse(code: &'static str, message: String) -> Result<(), Refused> {
    Err(Refused { code, message })
}

/// Whether `p` may do `a`. Pure; the one place scopes are decided.
pub fn authorize(p: &Principal, a: &Action<'_>) -> Result<(), Refused> {
    let s = &p.scopes;
    if s.admin {
        return Ok(());
    }
    let who = &p.name;
    let own = |owner: Option<&str>| owner == Some(&**who);
    match *a {
        Action::CreateRun { tool } if s.runs.matches(tool) => Ok(()),
        Action::CreateRun { tool } => refuse("scope", format!("{who} has no runs scope for tool {tool:?}")),
        Action::UseRun { tool, owner } | Action::EndRun { tool, owner } if !own(owner) => {
            let verb = if matches!(a, Action::EndRun { .. }) {
                "end"
            } else {
                "use"
            };
            refuse(
                "not_your_run",
                format!("{who} may not {verb} a run of tool {tool:?} it did not create (admin may)"),
            )
        }
        Action::UseRun { tool, .. } | Action::EndRun { tool, .. } => {
            if s.runs.matches(tool) || s.invoke.matches(tool) {
                Ok(())
            } else {
                refuse("scope", format!("{who} has no runs or invoke scope for tool {tool:?}"))
            }
        }
        Action::Attribute => refuse("scope", format!("{who} may not attribute runs to others (admin may)")),
        Action::Grant { tool, owner, .. } if !own(owner) => refuse(
            "not_your_run",
            format!("{who} may not grant to a run of tool {tool:?} it did not create"),
        ),
        Action::Grant { tool, .. } if !s.grants.matches(tool) => {
            refuse("scope", format!("{who} has no grants scope for tool {tool:?}"))
        }
        Action::Grant { ttl_ms, .. } if ttl_ms > s.grant_max_ttl_ms => refuse(
            "beyond_scope",
            format!("{who} may grant for at most {} ms (asked {ttl_ms})", s.grant_max_ttl_ms),
        ),
        Action::Grant { uses, .. } if uses > s.grant_max_uses => refuse(
            "beyond_scope",
            format!("{who} may grant at most {} uses (asked {uses})", s.grant_max_uses),
        ),
        Action::Grant { .. } => Ok(()),
        Action::Invoke { tool } if s.invoke.matches(tool) => Ok(()),
        Action::Invoke { tool } => refuse("scope", format!("{who} has no invoke scope for tool {tool:?}")),
        Action::ReadFacts if s.facts != Visibility::None => Ok(()),
        Action::ReadFacts => refuse("scope", format!("{who} has no facts scope")),
        Action::ReadDecisions if s.decisions != Visibility::None => Ok(()),
        Action::ReadDecisions => refuse("scope", format!("{who} has no decisions scope")),
        Action::Learn if s.facts == Visibility::All && s.decisions == Visibility::All => Ok(()),
        Action::Learn => refuse(
            "scope",
            format!("{who} needs facts:all and decisions:all: suggestions and replays read every record"),
        ),
        Action::PolicyRead if s.policy_read || s.policy_reload => Ok(()),
        Action::PolicyRead => refuse("scope", format!("{who} has no policy:read scope")),
        Action::PolicyReload if s.policy_reload => Ok(()),
        Action::PolicyReload => refuse("scope", format!("{who} has no policy:reload scope")),
        Action::Metrics if s.metrics => Ok(()),
        Action::Metrics => refuse("scope", format!("{who} has no metrics scope")),
        Action::Owners if !s.runs.is_empty() || !s.invoke.is_empty() => Ok(()),
        Action::Owners => refuse(
            "scope",
            format!("{who} has no runs scope (owner leases are for run creators)"),
        ),
        Action::ReportExecutor => refuse("scope", format!("{who} may not report for the executor (admin may)")),
        Action::Lease { holder } if own(holder) => Ok(()),
        Action::Lease { .. } => refuse(
            "not_your_lease",
            format!("{who} may not renew or release an owner lease another principal holds (admin may)"),
        ),
    }
}

/// The SHA-256 of a token, as the file stores it (`sha256:<hex>`).
pub fn token_hash(token: &str) -> String {
    format!("sha256:{}", hex(&Sha256::digest(token.trim().as_bytes())))
}

fn hex(b: &[u8]) -> String {
    use std::fmt::Write as _;
    b.iter().fold(String::with_capacity(b.len() * 2), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

fn parse_hash(s: &str) -> Option<[u8; 32]> {
    let h = s.strip_prefix("sha256:")?;
    if h.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(h.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Every principal: the control token's and the file's, found by token
/// hash or by mTLS subject.
#[derive(Debug, Clone, Default)]
pub struct Principals {
    list: Vec<Arc<Principal>>,
    by_token: HashMap<[u8; 32], usize>,
    by_subject: HashMap<String, usize>,
    by_name: HashMap<Arc<str>, usize>,
    /// Where the file's principals came from (`None`: single-token mode).
    pub file: Option<std::path::PathBuf>,
}

impl Principals {
    /// Single-token mode: the control token is the one principal.
    pub fn single(control_token: &str) -> Self {
        let mut p = Principals::default();
        p.insert(Principal::control(), &[hash_of(control_token)]);
        p
    }

    fn insert(&mut self, principal: Principal, tokens: &[[u8; 32]]) {
        let i = self.list.len();
        for t in tokens {
            self.by_token.insert(*t, i);
        }
        for s in &principal.subjects {
            self.by_subject.insert(s.clone(), i);
        }
        self.by_name.insert(principal.name.clone(), i);
        self.list.push(Arc::new(principal));
    }

    /// The principal whose token this is. The lookup is by the token's
    /// SHA-256, so its timing says nothing about any stored token.
    pub fn by_token(&self, token: &str) -> Option<&Arc<Principal>> {
        self.by_token.get(&hash_of(token)).map(|&i| &self.list[i])
    }

    /// The principal a verified client certificate's subject names.
    pub fn by_subject(&self, subject: &str) -> Option<&Arc<Principal>> {
        self.by_subject.get(subject).map(|&i| &self.list[i])
    }

    pub fn by_name(&self, name: &str) -> Option<&Arc<Principal>> {
        self.by_name.get(name).map(|&i| &self.list[i])
    }

    /// The principal a request authenticates as: the one a verified client
    /// certificate names (any of its `names`: subject CNs and SANs), else
    /// its bearer token's. The one rule both services apply.
    pub fn find(&self, names: &[String], token: Option<&str>) -> Option<&Arc<Principal>> {
        names
            .iter()
            .find_map(|n| self.by_subject(n))
            .or_else(|| token.and_then(|t| self.by_token(t)))
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Principal>> {
        self.list.iter()
    }

    /// Whether both sets let in the same tokens as the same principals.
    pub fn same_tokens(&self, other: &Principals) -> bool {
        self.by_token.len() == other.by_token.len()
            && self.by_token.iter().all(|(h, &i)| {
                other
                    .by_token
                    .get(h)
                    .is_some_and(|&j| self.list[i].name == other.list[j].name)
            })
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The control token's principal and every principal of `path`, which
    /// must be private (mode 0600 or stricter).
    pub fn load(path: &Path, control_token: &str) -> Result<Self, ConfigError> {
        let file = path.display().to_string();
        let one = |message: String| ConfigError {
            file: file.clone(),
            problems: vec![Problem {
                path: String::new(),
                message,
            }],
        };
        let text = crate::credentials::read_private(path, "a principals file").map_err(one)?;
        let mut p = Principals::parse(&text).map_err(|problems| ConfigError {
            file: file.clone(),
            problems,
        })?;
        p.insert(Principal::control(), &[hash_of(control_token)]);
        p.file = Some(path.to_path_buf());
        Ok(p)
    }

    /// The file's principals (without the control token's), or every problem.
    pub fn parse(text: &str) -> Result<Self, Vec<Problem>> {
        let root: toml::Table = toml::from_str(text).map_err(|e| {
            vec![Problem {
                path: String::new(),
                message: e.to_string().lines().next().unwrap_or_default().to_owned(),
            }]
        })?;
        let mut problems = Problems::default();
        let mut top = Section::new("", Some(toml::Value::Table(root)), &mut problems);
        let entries = top.table("principals").entries();
        top.finish();
        let mut out = Principals::default();
        if entries.len() > MAX_PRINCIPALS {
            problems.push("principals", format!("at most {MAX_PRINCIPALS} principals"));
        }
        for (name, v) in entries {
            let mut s = Section::new(format!("principals.{name}"), Some(v), &mut problems);
            if name == CONTROL || !valid_name(&name) {
                let at = s.path().to_owned();
                s.problems.push(
                    at,
                    format!("a principal's name is 1-128 of A-Z a-z 0-9 - _ . ~, and not {CONTROL:?}"),
                );
            }
            let mut tokens = vec![];
            for (at, t) in s.list::<String>("tokens").unwrap_or_default() {
                match parse_hash(&t) {
                    Some(h) => tokens.push((at, h)),
                    None => s.problems.push(
                        at,
                        "must be \"sha256:\" and 64 hex digits (`egress-proxy principal add` writes it)",
                    ),
                }
            }
            let subjects: Vec<String> = s
                .list::<String>("subjects")
                .unwrap_or_default()
                .into_iter()
                .map(|(_, v)| v)
                .collect();
            if tokens.is_empty() && subjects.is_empty() {
                let at = s.path().to_owned();
                s.problems.push(at, "needs at least one of tokens, subjects");
            }
            if tokens.len() > MAX_PER_PRINCIPAL || subjects.len() > MAX_PER_PRINCIPAL {
                let at = s.path().to_owned();
                s.problems.push(
                    at,
                    format!("at most {MAX_PER_PRINCIPAL} tokens and {MAX_PER_PRINCIPAL} subjects"),
                );
            }
            let mut scopes = Scopes {
                grant_max_ttl_ms: s.int("grant_max_ttl_ms", 1..=86_400_000, DEFAULT_GRANT_MAX_TTL_MS),
                grant_max_uses: s.int("grant_max_uses", 1..=u32::MAX as u64, DEFAULT_GRANT_MAX_USES as u64) as u32,
                ..Scopes::default()
            };
            for (at, scope) in s.list::<String>("scopes").unwrap_or_default() {
                if let Err(e) = scopes.add(&scope) {
                    s.problems.push(at, e);
                }
            }
            for (at, h) in &tokens {
                if out.by_token.contains_key(h) {
                    s.problems
                        .push(at.clone(), "this token hash belongs to another principal too");
                }
            }
            for subject in &subjects {
                if out.by_subject.contains_key(subject) {
                    let at = s.at("subjects");
                    s.problems
                        .push(at, format!("subject {subject:?} belongs to another principal too"));
                }
            }
            s.finish();
            let hashes: Vec<[u8; 32]> = tokens.into_iter().map(|(_, h)| h).collect();
            out.insert(
                Principal {
                    name: name.as_str().into(),
                    scopes,
                    subjects,
                },
                &hashes,
            );
        }
        if problems.0.is_empty() {
            Ok(out)
        } else {
            Err(problems.0)
        }
    }
}

/// A principal's name: 1-128 of `A-Z a-z 0-9 - _ . ~` (as run ids).
fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 128
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~'))
}

fn hash_of(token: &str) -> [u8; 32] {
    Sha256::digest(token.trim().as_bytes()).into()
}

/// The text `principal add` appends to a principals file for a new
/// principal with one token (given as its hash) and `scopes`.
pub fn entry(name: &str, token_hash: &str, scopes: &[String]) -> String {
    let quoted: Vec<String> = scopes.iter().map(|s| format!("{s:?}")).collect();
    format!(
        "\n[principals.{name}]\ntokens = [{token_hash:?}]\nscopes = [{}]\n",
        quoted.join(", ")
    )
}

#[cfg(test)]
#[path = "principals_tests.rs"]
mod tests;
