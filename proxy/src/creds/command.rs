//! `secret = { command = [...] }`: a program's output is the value. It runs
//! without a shell, with the proxy's own user, its environment scrubbed to
//! `env_pass`, stdin closed and stderr dropped, in a process group of its
//! own that is killed whole at `timeout_ms`, after `max_bytes` of output,
//! and when it exits (its stray children with it).

use super::{Failure, Fresh, Outcome};
use egress_config::sources::{check_value, chomp, CommandSource};
use std::io::Read as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

/// Runs `c` once (blocking up to its timeout).
pub fn run_command(c: &CommandSource) -> Result<Fresh, Failure> {
    use std::os::unix::process::CommandExt as _;
    let name = &c.argv[0];
    let mut cmd = Command::new(name);
    cmd.args(&c.argv[1..])
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0);
    for k in &c.env_pass {
        if let Some(v) = std::env::var_os(k) {
            cmd.env(k, v);
        }
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| Failure::error(format!("command {name} cannot start: {e}")))?;
    let group = i32::try_from(child.id()).ok().and_then(rustix::process::Pid::from_raw);
    let kill_group = || {
        if let Some(pg) = group {
            let _ = rustix::process::kill_process_group(pg, rustix::process::Signal::KILL);
        }
    };
    let fail = |child: &mut std::process::Child, outcome: Outcome, message: String| {
        kill_group();
        let _ = child.wait();
        Failure { outcome, message }
    };
    let Some(mut stdout) = child.stdout.take() else {
        return Err(fail(&mut child, Outcome::Error, format!("command {name}: no stdout")));
    };
    // The output is read on a thread of its own; this one keeps the clock.
    let max = c.max_bytes;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = Vec::with_capacity(4096.min(max + 1));
        let r = (&mut stdout).take(max as u64 + 1).read_to_end(&mut buf).map(|_| buf);
        let _ = tx.send(r);
    });
    let deadline = Instant::now() + c.timeout;
    let timed_out = |what: &str| {
        format!(
            "command {name} did not {what} within {} ms (timeout_ms); killed",
            c.timeout.as_millis()
        )
    };
    let out = match rx.recv_timeout(c.timeout) {
        Ok(Ok(buf)) if buf.len() > max => {
            return Err(fail(
                &mut child,
                Outcome::Error,
                format!("command {name} printed more than {max} bytes (max_bytes); killed"),
            ))
        }
        Ok(Ok(buf)) => buf,
        Ok(Err(e)) => {
            return Err(fail(
                &mut child,
                Outcome::Error,
                format!("command {name}: reading its output: {e}"),
            ))
        }
        Err(_) => return Err(fail(&mut child, Outcome::Timeout, timed_out("finish"))),
    };
    // Its stdout is closed: wait for the exit, still within the deadline.
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => return Err(fail(&mut child, Outcome::Timeout, timed_out("exit"))),
            Err(e) => return Err(fail(&mut child, Outcome::Error, format!("command {name}: {e}"))),
        }
    };
    kill_group();
    if !status.success() {
        return Err(Failure::error(format!("command {name} failed ({status})")));
    }
    let text = String::from_utf8(out)
        .map_err(|_| Failure::error(format!("command {name} printed something that is not UTF-8")))?;
    parse_output(&text).map_err(|m| Failure::error(format!("command {name}: {m}")))
}

/// A command's output: the value (one trailing newline dropped), or JSON
/// `{ "value": "…", "expires_at": "RFC 3339" | Unix seconds }`.
pub fn parse_output(text: &str) -> Result<Fresh, String> {
    let trimmed = text.trim_start();
    if !trimmed.starts_with('{') {
        return Ok(Fresh::value(check_value(&chomp(text.to_owned()))?));
    }
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Answer {
        value: String,
        #[serde(default)]
        expires_at: Option<serde_json::Value>,
    }
    let a: Answer = serde_json::from_str(trimmed)
        .map_err(|e| format!("printed JSON that is not {{\"value\", \"expires_at\"}}: {e}"))?;
    let expires_at = match a.expires_at {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => Some(expiry(&v)?),
    };
    Ok(Fresh {
        expires_at,
        ..Fresh::value(check_value(&a.value)?)
    })
}

/// `expires_at` as Unix seconds or RFC 3339 text.
fn expiry(v: &serde_json::Value) -> Result<SystemTime, String> {
    let bad = || format!("expires_at {v} is neither Unix seconds nor RFC 3339 text");
    let secs = match v {
        serde_json::Value::Number(n) => n.as_f64().filter(|s| s.is_finite() && *s >= 0.0).ok_or_else(bad)?,
        serde_json::Value::String(s) => {
            let t =
                time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).map_err(|_| bad())?;
            let whole = t.unix_timestamp();
            if whole < 0 {
                return Err(bad());
            }
            whole as f64 + f64::from(t.nanosecond()) / 1e9
        }
        _ => return Err(bad()),
    };
    Ok(SystemTime::UNIX_EPOCH + Duration::from_secs_f64(secs))
}
