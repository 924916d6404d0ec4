//! The executor's view of the shared config file. `egress-config` reads and
//! validates the whole file and owns every type and default; this module
//! picks what the executor uses (the proxy's control address, facts path and
//! run lifetime, the binding of confined children, `[executor]` and each
//! tool's process section), relative paths made absolute.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use egress_config::executor::{DEFAULT_CHILD_ID, DEFAULT_LANG, DEFAULT_PATH, RESERVED_ENV};
/// `[executor]` (the executor's name for [`egress_config::ExecutorConfig`]).
pub use egress_config::ExecutorConfig as ExecutorSection;
pub use egress_config::{Binding, ConfigError, Isolation, Network, ProcessConfig, Protocol};

/// What the executor reads from the file.
#[derive(Debug, Clone)]
pub struct Config {
    pub file: PathBuf,
    /// Directory of the config file (absolute); relative paths are relative to it.
    pub dir: PathBuf,
    pub control: SocketAddr,
    /// The proxy's home ([`egress_config::ProxyConfig::home`]): where its
    /// control token file is.
    pub home: PathBuf,
    /// `[proxy] max_run_ms`: runs expire this long after creation, so warm
    /// children are recycled before their run could expire.
    pub max_run: Duration,
    /// How confined children reach the proxy: the hand-off socket in force
    /// (also in `executor.proxy_handoff`, which children are started with)
    /// or the relay `[executor] allow_relay` accepts.
    pub binding: Binding,
    pub executor: ExecutorSection,
    /// Every tool id in `[tools]`, with its process section if it has one.
    pub tools: BTreeMap<String, Option<ProcessConfig>>,
    /// `[cell]` (`None`: a machine of its own).
    pub cell: Option<egress_config::CellConfig>,
    /// `[export]`: with `sink = "postgres"` (and a `[cell]`), keyed
    /// invocations are claimed fleet-wide in the same database.
    pub export: egress_config::ExportConfig,
    /// The digest of the file's policy.
    pub policy_digest: String,
    /// `[control] principals_file`: who may use the API (the proxy's too).
    pub principals_file: Option<PathBuf>,
    /// `[control.tls]`: the API's listener and the client of the proxy.
    pub control_tls: Option<egress_config::ControlTls>,
}

impl Config {
    /// Read and validate the file.
    pub fn load(file: &Path) -> Result<Config, ConfigError> {
        let dir = dir_of(file);
        let shared = egress_config::Config::load_relative_to(file, &dir)?;
        Ok(Config::from_shared(file, dir, shared))
    }

    /// Validate `text` as if read from `file`.
    pub fn parse(file: &Path, text: &str) -> Result<Config, ConfigError> {
        let dir = dir_of(file);
        let shared = egress_config::Config::parse_relative_to(text, &file.display().to_string(), &dir)?;
        Ok(Config::from_shared(file, dir, shared))
    }

    /// Reads the file as far as it goes, for `check`: what could be read
    /// (see [`egress_config::Checked`]) and every problem of the whole file.
    pub fn check(file: &Path) -> (Option<Config>, Option<ConfigError>) {
        let dir = dir_of(file);
        let checked = egress_config::Config::check_relative_to(file, &dir);
        let config = checked.config.map(|shared| Config::from_shared(file, dir, shared));
        (config, checked.error)
    }

    fn from_shared(file: &Path, dir: PathBuf, shared: egress_config::Config) -> Config {
        let binding = shared.binding();
        let mut executor = shared.executor;
        // The socket in force, whichever key (or default) gave it: a child
        // is handed off there or fails to start, never relayed without
        // `allow_relay`.
        executor.proxy_handoff = binding.socket().map(Path::to_path_buf);
        Config {
            cell: shared.cell.clone(),
            export: shared.export.clone(),
            policy_digest: shared.policy.digest.clone(),
            principals_file: shared.control.principals_file.clone(),
            control_tls: shared.control.tls.clone(),
            file: file.to_path_buf(),
            dir,
            control: shared.proxy.control,
            home: shared.proxy.home(),
            max_run: shared.proxy.max_run,
            binding,
            executor,
            tools: shared
                .policy
                .tools
                .iter()
                .map(|(id, t)| (id.clone(), t.process.clone()))
                .collect(),
        }
    }

    /// The process config of `tool`: `None` if the file has no such tool,
    /// `Some(None)` if it has no process section.
    pub fn tool(&self, tool: &str) -> Option<&Option<ProcessConfig>> {
        self.tools.get(tool)
    }
}

/// The arguments of `command` that its program is known to read as files
/// (for `check`, which looks for them relative to the tool's `cwd`), as
/// written: the script of an interpreter (`python3 tool.py`, `node
/// tool.mjs`, `sh script.sh`), through `env`'s options and assignments, and
/// the tool a reference runner loads (`loom_runner.py tools/weather.py`, a
/// `file.js:function`). Everything else is text to the program (`sh -c
/// "echo a/b"`, `python3 -c …`, `curl https://…`) and is never named.
pub fn files_named(command: &[String]) -> Vec<String> {
    let mut files = Vec::new();
    let mut rest = command;
    // `env [-i] [-u NAME] [NAME=VALUE]… COMMAND…` runs COMMAND.
    while let Some((prog, args)) = rest.split_first() {
        if program_name(prog) != "env" {
            break;
        }
        let mut i = 0;
        while let Some(a) = args.get(i) {
            match a.as_str() {
                "-u" | "--unset" | "-C" | "--chdir" => i += 2,
                // `-S` splits a string into arguments: text.
                "-S" | "--split-string" => return files,
                "--" => {
                    i += 1;
                    break;
                }
                a if a.starts_with('-') || a.contains('=') => i += 1,
                _ => break,
            }
        }
        rest = args.get(i..).unwrap_or_default();
    }
    let Some((prog, args)) = rest.split_first() else {
        return files;
    };
    let name = program_name(prog);
    let interpreter = Interpreter::of(name);
    let Some(interpreter) = interpreter else {
        return files;
    };
    let mut i = 0;
    while let Some(a) = args.get(i) {
        if a == "--" {
            i += 1;
            break;
        }
        if !a.starts_with('-') || a == "-" {
            break;
        }
        if interpreter.text_options.contains(&a.as_str()) {
            // The program is given as text (`-c`, `-e`, `-m module`).
            return files;
        }
        i += if interpreter.valued_options.contains(&a.as_str()) {
            2
        } else {
            1
        };
    }
    let Some(script) = args.get(i).filter(|s| s.as_str() != "-") else {
        return files;
    };
    files.push(script.clone());
    // A reference runner's one argument is the tool it loads.
    let runner = std::path::Path::new(script).file_name().and_then(|n| n.to_str());
    if let (Some(runner), Some(target)) = (runner, args.get(i + 1)) {
        let (file, _function) = target.rsplit_once(':').unwrap_or((target, ""));
        let is_file = match runner {
            // `module[:function]` or a file.
            egress_config::executor::PYTHON_RUNNER => file.ends_with(".py") || file.contains('/'),
            "loom_runner.js" => true,
            _ => false,
        };
        if is_file && !file.is_empty() {
            files.push(file.to_string());
        }
    }
    files
}

/// The file name of a program (`/usr/bin/python3` → `python3`).
fn program_name(prog: &str) -> &str {
    prog.rsplit('/').next().unwrap_or(prog)
}

/// How an interpreter's command line names its script.
struct Interpreter {
    /// Options after which the program is text, not a file.
    text_options: &'static [&'static str],
    /// Options that take the next argument as their value.
    valued_options: &'static [&'static str],
}

impl Interpreter {
    fn of(name: &str) -> Option<Interpreter> {
        let python = name.starts_with("python") || name.starts_with("pypy");
        if python {
            return Some(Interpreter {
                text_options: &["-c", "-m"],
                valued_options: &["-W", "-X", "--check-hash-based-pycs"],
            });
        }
        match name {
            "node" | "nodejs" => Some(Interpreter {
                text_options: &["-e", "--eval", "-p", "--print"],
                valued_options: &[
                    "-r",
                    "--require",
                    "--import",
                    "--loader",
                    "--input-type",
                    "--conditions",
                    "-C",
                ],
            }),
            "sh" | "bash" | "dash" | "zsh" | "ksh" => Some(Interpreter {
                text_options: &["-c"],
                valued_options: &["-o", "+o", "-O", "+O"],
            }),
            _ => None,
        }
    }
}

/// The file's directory, absolute, so that paths relative to the file stay
/// right for a child that starts in another working directory (`cwd`).
fn dir_of(file: &Path) -> PathBuf {
    let dir = file
        .parent()
        .map(Path::to_path_buf)
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or_else(|| PathBuf::from("."));
    std::path::absolute(&dir).unwrap_or(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The proxy's `env` map and the names a tool's `env` may not set are
    /// two lists in two crates: every proxy variable must be reserved, or a
    /// tool could point its child past the proxy; and every CA variable, or
    /// a tool could point its clients at other roots than the appliance's.
    #[test]
    fn every_proxy_variable_is_reserved() {
        let env = egress_api::proxy_env("http://r:s@127.0.0.1:3128");
        let ca = egress_api::ca_env("/ca/bundle.pem", "/ca/ca.pem");
        for k in env.keys().chain(ca.keys()) {
            assert!(RESERVED_ENV.contains(&k.as_str()), "{k} is not in RESERVED_ENV");
        }
    }

    fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::parse(Path::new("/etc/loom/egress.toml"), s)
    }

    #[test]
    fn defaults_and_relative_paths() {
        let c = parse(
            r#"
[proxy]
listen = "127.0.0.1:3128"
[executor]
scratch_dir = "scratch"
[tools.weather]
egress = ["a.example:443"]
[tools.weather.process]
command = ["python3", "tools/weather.py"]
read_paths = ["data"]
[tools.bare]
egress = []
"#,
        )
        .unwrap();
        assert_eq!(c.control.to_string(), "127.0.0.1:3129");
        assert_eq!(c.home, Path::new("/etc/loom/var"));
        assert_eq!(c.max_run, Duration::from_secs(3600));
        // No key: children are handed off beside the facts store.
        let sock = Path::new("/etc/loom/var/egress-handoff.sock");
        assert_eq!(c.binding.socket(), Some(sock));
        assert_eq!(c.executor.proxy_handoff.as_deref(), Some(sock));
        let relay = parse("[executor]\nallow_relay = true\n").unwrap();
        assert_eq!((relay.binding, relay.executor.proxy_handoff), (Binding::Relay, None));
        assert_eq!(c.executor.scratch_dir, Path::new("/etc/loom/scratch"));
        let p = c.tools["weather"].clone().unwrap();
        assert_eq!(p.cwd, Path::new("/etc/loom"));
        assert_eq!(p.read_paths, [Path::new("/etc/loom/data")]);
        assert!(c.tools["bare"].is_none());
    }

    #[test]
    fn a_relative_file_resolves_against_the_working_directory() {
        let c = Config::parse(Path::new("egress.toml"), "[tools.t.process]\ncommand = [\"x\"]\n").unwrap();
        let here = std::path::absolute(".").unwrap();
        assert_eq!(c.dir, here);
        assert_eq!(c.tools["t"].as_ref().unwrap().cwd, here);
        assert_eq!(c.home, here.join("var"));
    }

    /// `check` looks only for the files a program is known to read: an
    /// interpreter's script, a reference runner's tool; never an argument
    /// that is text to its program.
    #[test]
    fn files_named_are_scripts_and_runner_tools_only() {
        let cases: &[(&[&str], &[&str])] = &[
            (&["sh", "-c", "echo a/b"], &[]),
            (&["/bin/bash", "-e", "-c", "cat /etc/x.py"], &[]),
            (&["sh", "scripts/run.sh", "a/b"], &["scripts/run.sh"]),
            (&["python3", "-c", "print('a/b.py')"], &[]),
            (&["python3", "-m", "pkg.tool", "x/y.py"], &[]),
            (
                &["python3", "-u", "-W", "ignore", "tool.py", "data/in.json"],
                &["tool.py"],
            ),
            (
                &["python3", "../executor/runners/loom_runner.py", "tools/weather.py"],
                &["../executor/runners/loom_runner.py", "tools/weather.py"],
            ),
            (
                &["python3", "r/loom_runner.py", "weather:handler"],
                &["r/loom_runner.py"],
            ),
            (
                &["python3", "r/loom_runner.py", "tools/weather.py:main"],
                &["r/loom_runner.py", "tools/weather.py"],
            ),
            (
                &["node", "r/loom_runner.js", "tools/w.mjs:run"],
                &["r/loom_runner.js", "tools/w.mjs"],
            ),
            (&["node", "-e", "fetch('https://a/b.js')"], &[]),
            (
                &["node", "--require", "x/hook.js", "tools/search.mjs"],
                &["tools/search.mjs"],
            ),
            (
                &["env", "-u", "NODE_USE_ENV_PROXY", "node", "tools/w.mjs"],
                &["tools/w.mjs"],
            ),
            (&["/usr/bin/env", "A=b/c", "python3", "t.py"], &["t.py"]),
            (&["env", "-S", "python3 t.py"], &[]),
            (&["curl", "-sS", "https://api.example/v1/x.js"], &[]),
            (&["./bin/tool", "conf/x.py"], &[]),
            (&["python3"], &[]),
            (&["env"], &[]),
        ];
        for (command, want) in cases {
            let command: Vec<String> = command.iter().map(|s| s.to_string()).collect();
            assert_eq!(files_named(&command), *want, "{command:?}");
        }
    }

    #[test]
    fn the_whole_file_is_validated() {
        // A proxy key's problem is reported beside the executor's.
        let e = parse("[proxy]\nlisten = \"x\"\n[executor]\nlisen = 2\n").unwrap_err();
        let lines: Vec<String> = e.lines().collect();
        assert_eq!(lines.len(), 2, "{e}");
        assert!(lines[0].starts_with("/etc/loom/egress.toml: proxy.listen: "), "{e}");
        assert!(
            lines[1].starts_with("/etc/loom/egress.toml: executor.lisen: unknown key"),
            "{e}"
        );
    }
}
