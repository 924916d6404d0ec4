//! The reference runners end to end through the executor: a real Node.js
//! tool via `runners/loom_runner.js`, and the Python runner used as a
//! library from the tool's own main. (The Rust helper: `tests/rust_tool.rs`.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_e2e::executor::*;
use egress_executor::{ErrorKind, Phase};
use serde_json::json;

#[tokio::test]
async fn node_tool_through_the_js_runner() {
    let Some(_) = node() else {
        eprintln!("skipped: node is not installed (apt-get install nodejs)");
        return;
    };
    let dir = TempDir::new("node");
    dir.write(
        "weather.js",
        r#"
const loadedAt = Date.now();
module.exports.run = async (input, ctx) => {
  ctx.emit({ step: 'lookup', city: input.city });
  console.log('looking up ' + input.city);
  await new Promise((r) => setTimeout(r, 1));
  return { city: input.city, temp: 21, runId: ctx.runId, proxy: process.env.HTTPS_PROXY };
};
module.exports.fails = () => { throw new RangeError('city unknown'); };
// Far more than a pipe holds: the result must still come after all of it.
module.exports.loud = () => { process.stdout.write('x'.repeat(512 * 1024)); return 'done'; };
"#,
    );
    dir.write("broken.js", "throw new Error('cannot load model');\n");
    dir.write(
        "esm.mjs",
        "export async function run(input) { return { esm: input }; }\n",
    );
    let runner = runners_dir().join("loom_runner.js").display().to_string();
    let tools = format!(
        r#"
[tools.weather]
egress = []
[tools.weather.process]
command = ["node", "{runner}", "weather.js"]
pool = {{ warm = 0, max = 1 }}
[tools.fails]
egress = []
[tools.fails.process]
command = ["node", "{runner}", "weather.js:fails"]
pool = {{ warm = 0, max = 1 }}
[tools.loud]
egress = []
[tools.loud.process]
command = ["node", "{runner}", "weather.js:loud"]
pool = {{ warm = 0, max = 1 }}
[tools.esm]
egress = []
[tools.esm.process]
command = ["node", "{runner}", "esm.mjs"]
pool = {{ warm = 0, max = 1 }}
[tools.broken]
egress = []
[tools.broken.process]
command = ["node", "{runner}", "broken.js"]
pool = {{ warm = 0, max = 1 }}
"#
    );
    let (_control, exec) = beside_fake_control(&dir, true, &tools).await;
    let res = exec.invoke(invocation("weather", json!({"city": "Oslo"}))).await;
    assert!(res.ok, "{res:?}");
    let out = res.output.unwrap();
    assert_eq!(out["city"], json!("Oslo"));
    assert_eq!(out["runId"], json!(res.run_id.unwrap()));
    assert!(out["proxy"].as_str().unwrap().starts_with("http://run-"));
    assert_eq!(res.emits, vec![json!({"step": "lookup", "city": "Oslo"})]);
    assert_eq!(res.stdout, "looking up Oslo\n");

    let res = exec.invoke(invocation("fails", json!(null))).await;
    let e = res.error.unwrap();
    assert_eq!(e.kind, ErrorKind::ToolError);
    assert_eq!(e.message, "RangeError: city unknown");
    assert!(e.stderr_tail.contains("RangeError"), "{e:?}");

    // The runner sends its result only after the tool's output is written.
    let res = exec.invoke(invocation("loud", json!(null))).await;
    assert_eq!(res.output, Some(json!("done")), "{res:?}");
    assert_eq!(res.stdout.len(), 512 * 1024);

    let res = exec.invoke(invocation("esm", json!(7))).await;
    assert_eq!(res.output, Some(json!({"esm": 7})), "{res:?}");

    let res = exec.invoke(invocation("broken", json!(null))).await;
    let e = res.error.unwrap();
    assert_eq!((e.kind, e.phase), (ErrorKind::Startup, Some(Phase::Load)), "{e:?}");
    assert!(e.message.contains("cannot load model"), "{e:?}");
}

#[tokio::test]
async fn python_runner_as_a_library() {
    let Some(_) = python() else { return };
    let dir = TempDir::new("pylib");
    let runners = runners_dir().display().to_string();
    dir.write(
        "main.py",
        &format!(
            r#"
import sys
sys.path.insert(0, {runners:?})
import loom_runner

async def run(input):
    return {{"doubled": input * 2}}

loom_runner.main(run)
"#
        ),
    );
    let (_control, exec) = beside_fake_control(
        &dir,
        true,
        // Confined by default: the runner's directory must be declared.
        &format!(
            "[tools.lib]\negress = []\n[tools.lib.process]\ncommand = [\"python3\", \"main.py\"]\n\
             read_paths = [{runners:?}]\npool = {{ warm = 0, max = 1 }}\n"
        ),
    )
    .await;
    let res = exec.invoke(invocation("lib", json!(21))).await;
    assert!(res.ok, "{res:?}");
    assert_eq!(res.output.unwrap(), json!({"doubled": 42}));
}

/// The Node runner ends its process after its one invocation instead of
/// waiting to be killed (a pending read on fd 3 once kept it alive).
#[tokio::test]
async fn node_runner_exits_by_itself_after_its_invocation() {
    use std::io::{BufRead, BufReader, Write};
    let Some(_) = node() else {
        eprintln!("skipped: node is not installed (apt-get install nodejs)");
        return;
    };
    let dir = TempDir::new("node-exit");
    dir.write("echo.js", "exports.run = (input) => input;\n");
    let runner = runners_dir().join("loom_runner.js");
    // fd 3 reads what we write to the shell's stdin, fd 4 writes to its stdout.
    let mut child = std::process::Command::new("sh")
        .arg("-c")
        .arg("exec node \"$0\" \"$1\" 3<&0 4>&1 </dev/null >&2")
        .arg(&runner)
        .arg(dir.path().join("echo.js"))
        .env("LOOM_IPC_FDS", "3,4")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), r#"{"t":"booted"}"#);
    assert_eq!(lines.next().unwrap().unwrap(), r#"{"t":"ready"}"#);
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(b"{\"t\":\"invoke\",\"run_id\":\"r1\",\"input\":{\"a\":1},\"idempotency_key\":null}\n")
        .unwrap();
    assert_eq!(lines.next().unwrap().unwrap(), r#"{"t":"result","output":{"a":1}}"#);
    // Our end of fd 3 stays open: only the runner itself can end the process.
    let exited = eventually(std::time::Duration::from_secs(10), || {
        matches!(child.try_wait(), Ok(Some(_)))
    })
    .await;
    if !exited {
        let _ = child.kill();
    }
    let status = child.wait().unwrap();
    drop(stdin);
    assert!(exited, "the Node runner was still running 10 s after its result");
    assert!(status.success(), "{status:?}");
}

/// The Python runner counts a run function's parameters without importing
/// inspect (its import is a third of the interpreter's start): for every
/// shape a tool's `run` can take, the count equals inspect.signature's, and
/// the runner itself imports neither inspect nor traceback before an
/// invocation needs them.
#[test]
fn python_runner_counts_parameters_as_inspect_does_without_importing_it() {
    let Some(python) = python() else { return };
    let script = r#"
import functools, sys
sys.path.insert(0, sys.argv[1])
import loom_runner
assert "inspect" not in sys.modules and "traceback" not in sys.modules, sorted(sys.modules)
def one(input): pass
def two(input, ctx): pass
def default(input, ctx=None): pass
def star(*args): pass
def kw(input, *, ctx): pass
def everything(a, b=1, *c, d, **e): pass
async def coro(input): pass
def gen(input): yield
class Tool:
    def run(self, input): pass
    def run2(self, input, ctx): pass
    @staticmethod
    def static(input): pass
    @classmethod
    def cls(cls, input): pass
    def __call__(self, input): pass
@functools.wraps(two)
def wrapped(*args, **kwargs): pass
shapes = [one, two, default, star, kw, everything, coro, gen, lambda x: x, lambda x, y: x,
          Tool().run, Tool().run2, Tool.static, Tool.cls, Tool(), wrapped,
          functools.partial(two, 1), print, len, dict]
import inspect
for fn in shapes:
    try:
        want = len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        want = None
    got = loom_runner._parameters(fn)
    assert got == want, (fn, got, want)
print("ok", len(shapes))
"#;
    let out = std::process::Command::new(python)
        .arg("-c")
        .arg(script)
        .arg(runners_dir())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.starts_with("ok 20"),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
