//! Loom Egress tool SDK: a tool written in Rust speaks the child side of the
//! executor's protocol with it (`booted`, `ready`, one `invoke`, `emit`s,
//! `result`/`error`) over the fds announced in `LOOM_IPC_FDS`. Blocking std
//! I/O, serde_json and libc only: no tokio, no HTTP stack. The message types
//! in [`protocol`] are the ones the executor reads and writes. The wire is
//! described in `docs/protocol.md`.

pub mod protocol;

mod fd;

use std::fs::File;
use std::io::{self, BufRead, BufReader, Write};

use serde_json::Value;

use crate::protocol::{encode, ChildMsg, ParentMsg, IPC_FDS_VAR};

/// The invocation a tool receives.
#[derive(Debug, Clone)]
pub struct Invocation {
    pub run_id: String,
    pub input: Value,
    pub idempotency_key: Option<String>,
}

/// The tool's side of the pipes.
#[derive(Debug)]
pub struct Channel {
    rx: BufReader<File>,
    tx: File,
}

impl Channel {
    /// Adopt the fds named by `LOOM_IPC_FDS` (`3,4`) and send `booted`.
    pub fn connect() -> io::Result<Channel> {
        let spec = std::env::var(IPC_FDS_VAR).map_err(|_| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "LOOM_IPC_FDS is not set: not started by the executor",
            )
        })?;
        let (r, w) = spec
            .split_once(',')
            .and_then(|(r, w)| Some((r.trim().parse().ok()?, w.trim().parse().ok()?)))
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("bad LOOM_IPC_FDS `{spec}`")))?;
        let rx = File::from(fd::adopt_inherited_fd(r)?);
        let tx = File::from(fd::adopt_inherited_fd(w)?);
        let mut ch = Channel {
            rx: BufReader::new(rx),
            tx,
        };
        ch.send(&ChildMsg::Booted)?;
        Ok(ch)
    }

    fn send(&mut self, m: &ChildMsg) -> io::Result<()> {
        self.tx.write_all(&encode(m))
    }

    /// Say the tool is loaded and wait for the one invocation.
    pub fn ready(&mut self) -> io::Result<Invocation> {
        self.send(&ChildMsg::Ready)?;
        let mut line = String::new();
        if self.rx.read_line(&mut line)? == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "executor closed the pipe"));
        }
        match serde_json::from_str::<ParentMsg>(&line) {
            Ok(ParentMsg::Invoke {
                run_id,
                input,
                idempotency_key,
            }) => Ok(Invocation {
                run_id,
                input,
                idempotency_key,
            }),
            Ok(ParentMsg::Abort) => Err(io::Error::new(io::ErrorKind::Interrupted, "aborted")),
            Err(e) => Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string())),
        }
    }

    /// Emit a fact for the current run (before the result).
    pub fn emit(&mut self, fact: Value) -> io::Result<()> {
        self.send(&ChildMsg::Emit { fact })
    }

    /// Finish with a result. Flushes stdout/stderr first: the executor kills
    /// the child as soon as the result arrives.
    pub fn result(mut self, output: Value) -> io::Result<()> {
        flush_stdio();
        self.send(&ChildMsg::Result { output })
    }

    /// Finish with an error (stdout/stderr flushed first).
    pub fn error(mut self, message: impl Into<String>) -> io::Result<()> {
        flush_stdio();
        self.send(&ChildMsg::Error {
            message: message.into(),
        })
    }
}

/// Run a tool: `load` runs before `ready` (load-time code gets no network:
/// its run is not active yet), `handle` runs once for the invocation.
pub fn serve<S, L, H>(load: L, handle: H) -> io::Result<()>
where
    L: FnOnce() -> Result<S, String>,
    H: FnOnce(S, Invocation, &mut dyn FnMut(Value) -> io::Result<()>) -> Result<Value, String>,
{
    let mut ch = Channel::connect()?;
    let state = match load() {
        Ok(s) => s,
        Err(e) => return ch.error(e),
    };
    let inv = ch.ready()?;
    let out = {
        let mut emit = |fact: Value| ch.emit(fact);
        handle(state, inv, &mut emit)
    };
    match out {
        Ok(v) => ch.result(v),
        Err(e) => ch.error(e),
    }
}

fn flush_stdio() {
    let _ = io::stdout().flush();
    let _ = io::stderr().flush();
}
