"""Loom Egress reference runner for Python tools (one file, standard library only).

Speaks the child side of the executor's protocol (docs/protocol.md):
newline-delimited JSON on the fds named in LOOM_IPC_FDS ("3,4": read, write).

Two ways to use it:

    # 1. As a launcher: the tool module defines run(input, ctx).
    command = ["python3", "loom_runner.py", "tools/weather.py"]      # file path
    command = ["python3", "loom_runner.py", "weather:handler"]      # module[:function]

    # 2. As a library, from the tool's own main:
    import loom_runner
    def run(input, ctx):
        ctx.emit({"step": "fetched"})
        return {"temp": 21}
    loom_runner.main(run)

Importing the tool module is the load phase: it runs before `ready`, while the
tool's run is not active yet, so load-time code gets no network. `run` is called
exactly once; its return value (anything JSON-serialisable) is the result, and an
exception becomes an `error` message (traceback on stderr).
"""

# Only what every invocation needs is imported up front: the interpreter's
# start is the cold start, and inspect, traceback and importlib.util alone
# would add about half of it again. They are imported where they are used.
import importlib
import json
import os
import sys

__all__ = ["Context", "main", "serve_module"]


class ProtocolError(Exception):
    """The executor sent something this runner does not understand."""


class _Channel:
    def __init__(self):
        spec = os.environ.get("LOOM_IPC_FDS")
        if not spec:
            raise ProtocolError("LOOM_IPC_FDS is not set: not started by the executor")
        try:
            rfd, wfd = (int(x) for x in spec.split(","))
        except ValueError:
            raise ProtocolError("bad LOOM_IPC_FDS %r" % spec) from None
        self._r = os.fdopen(rfd, "rb", buffering=0)
        self._w = os.fdopen(wfd, "wb", buffering=0)
        self._buf = b""

    def send(self, msg):
        line = json.dumps(msg, separators=(",", ":"), ensure_ascii=False, default=str)
        self._w.write(line.encode("utf-8") + b"\n")

    def recv(self):
        while b"\n" not in self._buf:
            chunk = self._r.read(65536)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)


class Context:
    """What a tool's run() gets besides its input."""

    def __init__(self, channel, msg):
        self._channel = channel
        self.run_id = msg.get("run_id")
        self.idempotency_key = msg.get("idempotency_key")

    def emit(self, fact):
        """Record a fact for this run; it lands before the result."""
        self._channel.send({"t": "emit", "fact": fact})

    def fetch(self, url, method="GET", headers=None, body=None, timeout=30):
        """Fetch `url` through the run's proxy (CONNECT for https,
        absolute-form for http), whatever the tool's libraries do with proxy
        variables. Returns {"status", "headers" (lower-case names), "body"
        (bytes)}; a denial is a normal answer (403, x-egress-deny-reason)."""
        import urllib.error
        import urllib.request

        proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("HTTP_PROXY")
        if not proxy:
            raise RuntimeError("no HTTP_PROXY: not started by the executor")
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({"http": proxy, "https": proxy}))
        if isinstance(body, str):
            body = body.encode("utf-8")
        req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
        try:
            with opener.open(req, timeout=timeout) as r:
                return {"status": r.status, "headers": _lower(r.headers), "body": r.read()}
        except urllib.error.HTTPError as e:
            return {"status": e.code, "headers": _lower(e.headers), "body": e.read()}


def _lower(headers):
    return {k.lower(): v for k, v in headers.items()}


_VARARGS, _VARKEYWORDS = 0x04, 0x08  # CO_VARARGS, CO_VARKEYWORDS


def _parameters(fn):
    """How many parameters inspect.signature(fn) lists, or None: counted from
    the code object of a plain function or bound method (no inspect import),
    else by inspect."""
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    if code is not None and type(func).__name__ == "function" and not hasattr(func, "__wrapped__"):
        flags = code.co_flags
        n = (code.co_argcount + code.co_kwonlyargcount
             + bool(flags & _VARARGS) + bool(flags & _VARKEYWORDS))
        return n - (func is not fn)  # a bound method's self is not listed
    import inspect

    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _call(fn, input, ctx):
    if _parameters(fn) == 1:
        return fn(input)
    return fn(input, ctx)


def _awaitable(x):
    if not hasattr(x, "__await__") and type(x).__name__ not in ("generator", "coroutine"):
        return False
    import inspect

    return inspect.isawaitable(x)


def _print_exc():
    import traceback

    traceback.print_exc()


def main(run=None, load=None):
    """Serve one invocation with `run(input, ctx)`; `load()` (optional) runs
    before `ready` and may return the run function. Exits the process."""
    channel = _Channel()
    channel.send({"t": "booted"})
    try:
        if load is not None:
            loaded = load()
            if run is None:
                run = loaded
        if not callable(run):
            raise TypeError("the tool has no callable run(input, ctx)")
    except BaseException as e:  # noqa: BLE001 - every load failure is reported
        _print_exc()
        _flush()
        channel.send({"t": "error", "message": "load failed: %s: %s" % (type(e).__name__, e)})
        os._exit(1)
    channel.send({"t": "ready"})
    msg = channel.recv()
    if msg is None:
        os._exit(0)
    if msg.get("t") != "invoke":
        # `abort` (or anything else) before invoke: nothing to do.
        os._exit(0)
    ctx = Context(channel, msg)
    try:
        output = _call(run, msg.get("input"), ctx)
        if _awaitable(output):
            import asyncio

            output = asyncio.run(_await(output))
        msg, code = {"t": "result", "output": output}, 0
        json.dumps(msg, default=str)
    except BaseException as e:  # noqa: BLE001 - every tool failure is reported
        _print_exc()
        msg, code = {"t": "error", "message": "%s: %s" % (type(e).__name__, e)}, 1
    # The executor kills the child as soon as the result arrives: flush the
    # tool's own output first so none of it is lost.
    _flush()
    channel.send(msg)
    os._exit(code)


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not fail the run
            pass


async def _await(x):
    return await x


def _load_target(target):
    """`path/to/tool.py[:fn]` or `package.module[:fn]` → the function."""
    name, _, fn = target.partition(":")
    fn = fn or "run"
    if name.endswith(".py") or os.sep in name:
        path = os.path.abspath(name)
        sys.path.insert(0, os.path.dirname(path))
        modname = os.path.splitext(os.path.basename(path))[0]
        import importlib.util

        spec = importlib.util.spec_from_file_location(modname, path)
        if spec is None or spec.loader is None:
            raise ImportError("cannot load %s" % path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[modname] = module
        spec.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(name)
    try:
        return getattr(module, fn)
    except AttributeError:
        raise AttributeError("%s has no function %r" % (name, fn)) from None


def serve_module(target):
    """Load `target` during the load phase, then serve one invocation."""
    main(load=lambda: _load_target(target))


# ------------------------------------------------------------ the fork server
#
# `loom_runner.py --fork-server` (started by the executor for a tool whose
# process section sets `fork_server = true`) boots this interpreter once and
# then forks one child per warm slot, so each child skips the interpreter's
# start. The server never runs tool code and never reads a child's
# specification: it only forks. Each child reads its own specification (its
# environment, its descriptors, the confinement the executor prepared) from a
# socket of its own, applies the confinement in the order the executor applies
# it before `exec` (docs/executor.md, "Fork server"), and only then loads the
# tool. So nothing one child was given is ever in the memory the next child is
# forked from.
#
# Protocol (SOCK_SEQPACKET, the server's fd 0; fd 3 is a pidfd of the
# executor): the executor sends `F` + `1`/`0` (own PID namespace or not) with
# one descriptor, the child's socket; the server answers `P<pid>` or `E<errno>`.
# The child is created with CLONE_PARENT, so it is the executor's own child
# (reaped, killed and waited for exactly like an exec'd one). On its socket the
# child reads one message (JSON and descriptors) and answers `ok`, or a JSON
# object naming the failed stage and errno, before it loads the tool.

_SYSCALLS = {
    # name: (x86_64, aarch64)
    "clone": (56, 220),
    "setgroups": (116, 159),
    "setresgid": (119, 149),
    "setresuid": (117, 147),
    "seccomp": (317, 277),
    "landlock_add_rule": (445, 445),
    "landlock_restrict_self": (446, 446),
}
_CLONE_NEWNS = 0x00020000
_CLONE_PARENT = 0x00008000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 2, 4, 8, 0x4000, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 1, 4, 38
_SECCOMP_SET_MODE_FILTER = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_LANDLOCK_READ = (1 << 2) | (1 << 3)  # READ_FILE | READ_DIR


class _StageFailed(Exception):
    def __init__(self, stage, errno):
        super().__init__(stage)
        self.stage, self.errno = stage, errno


def _fork_server():
    import ctypes
    import platform
    import socket

    # What every child needs before it loads the tool, imported once here.
    import fcntl  # noqa: F401
    import resource  # noqa: F401
    import select  # noqa: F401
    import signal  # noqa: F401
    import importlib.util  # noqa: F401 - the load phase of a file target

    arch = {"x86_64": 0, "aarch64": 1}.get(platform.machine())
    if arch is None:
        sys.stderr.write("loom fork server: unsupported architecture %s\n" % platform.machine())
        os._exit(3)
    nr = {name: numbers[arch] for name, numbers in _SYSCALLS.items()}
    # PyDLL keeps the interpreter's lock held through the call: the clone
    # below is then exactly what os.fork does around fork(2).
    libc = ctypes.PyDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    api = ctypes.pythonapi
    server = socket.socket(fileno=0)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(server, 16, 1)
        except InterruptedError:
            continue
        if not msg:
            os._exit(0)  # the executor closed its end
        if msg[:1] != b"F" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            server.send(b"E%d" % 22)
            continue
        flags = _CLONE_PARENT | (_CLONE_NEWPID if msg[1:2] == b"1" else 0)
        api.PyOS_BeforeFork()
        zero = ctypes.c_long(0)
        pid = libc.syscall(nr["clone"], ctypes.c_ulong(flags), zero, zero, zero, zero)
        if pid == 0:
            api.PyOS_AfterFork_Child()
            _forked_child(fds[0], libc, nr)  # never returns
        errno = ctypes.get_errno()
        api.PyOS_AfterFork_Parent()
        os.close(fds[0])
        server.send(b"P%d" % pid if pid > 0 else b"E%d" % errno)


def _forked_child(chan_fd, libc, nr):
    import fcntl
    import socket

    chan = None
    try:
        # Above the fds 0-4 the child is about to install.
        high = fcntl.fcntl(chan_fd, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(chan_fd)
        chan = socket.socket(fileno=high)
        msg, fds, _, _ = socket.recv_fds(chan, 1 << 20, 64)
        if not msg:
            os._exit(0)
        spec = json.loads(msg)
        _confine(spec, fds, chan.fileno(), libc, nr)
        chan.send(b"ok")
    except _StageFailed as e:
        _report(chan, {"stage": e.stage, "errno": e.errno})
    except BaseException as e:  # noqa: BLE001 - any failure is reported, never run on
        _report(chan, {"stage": "taking the specification", "errno": 0, "message": repr(e)})
    chan.close()
    # Nothing but fds 0-4 stays open from here on.
    os.closerange(5, 1 << 20)
    sys.argv = spec["argv"]
    serve_module(spec["argv"][-1])
    os._exit(0)


def _report(chan, failure):
    try:
        if chan is not None:
            chan.send(json.dumps(failure).encode())
    finally:
        os._exit(127)


def _confine(spec, fds, chan_fd, libc, nr):
    """The steps the executor's children take between clone and exec, in that
    order, on what the executor prepared (descriptors, rule sets, filters)."""
    import ctypes
    import fcntl
    import resource
    import select
    import signal

    def check(ok, stage):
        if not ok:
            raise _StageFailed(stage, ctypes.get_errno())

    def sys_call(name, *args):
        # syscall(2) reads every argument as a long.
        args = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
        return libc.syscall(nr[name], *args) == 0

    # Every received descriptor and the parent pidfd move above 10 first,
    # so installing fds 0-4 cannot close one still needed.
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in fds]
    parent = fcntl.fcntl(3, fcntl.F_DUPFD_CLOEXEC, 10)
    for fd in fds:
        os.close(fd)
    at = spec["fds"]

    def fd(name):
        i = at.get(name)
        return -1 if i is None else high[i]

    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    if spec["setsid"]:
        try:
            os.setsid()
        except OSError as e:
            raise _StageFailed("creating a session", e.errno) from None
    else:
        os.setpgid(0, 0)
    for target in range(5):
        os.dup2(high[target], target)
    if fd("netns") >= 0:
        check(libc.setns(fd("netns"), _CLONE_NEWNET) == 0, "entering the network namespace")
    if spec["shm"] is not None:
        check(
            libc.unshare(_CLONE_NEWNS) == 0
            and libc.mount(None, b"/", None, ctypes.c_ulong(_MS_REC | _MS_PRIVATE), None) == 0
            and libc.mount(
                b"tmpfs",
                b"/dev/shm",
                b"tmpfs",
                ctypes.c_ulong(_MS_NOSUID | _MS_NODEV | _MS_NOEXEC),
                spec["shm"].encode(),
            )
            == 0,
            "mounting a private /dev/shm",
        )
    for i in at["cgroups"]:
        try:
            os.write(high[i], b"0")
        except OSError as e:
            raise _StageFailed("joining the cgroup", e.errno) from None
    for res, soft, hard in spec["rlimits"]:
        try:
            resource.setrlimit(res, (soft, hard))
        except (OSError, ValueError) as e:
            raise _StageFailed("setting rlimits", getattr(e, "errno", 0) or 0) from None
    if spec["ids"] is not None:
        uid, gid = spec["ids"]
        # Raw system calls, as the executor's children make them.
        check(
            sys_call("setgroups", ctypes.c_size_t(0), None)
            and sys_call("setresgid", gid, gid, gid)
            and sys_call("setresuid", uid, uid, uid),
            "dropping to the child's uid/gid",
        )
        # What exec gives a program run under a new uid: its /proc/self
        # files its own (a forked process would stay undumpable).
        check(libc.prctl(_PR_SET_DUMPABLE, ctypes.c_ulong(1), 0, 0, 0) == 0, "dropping to the child's uid/gid")
    check(libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), 0, 0, 0) == 0, "arming the parent-death signal")
    poller = select.poll()
    poller.register(parent, select.POLLIN)
    if poller.poll(0):
        raise _StageFailed("checking the executor is alive", 0)
    if spec["nnp"]:
        check(libc.prctl(_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), 0, 0, 0) == 0, "setting no_new_privs")
    if fd("landlock") >= 0:
        ruleset = fd("landlock")

        class PathBeneath(ctypes.Structure):
            _pack_ = 1
            _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

        def allow(path, access, required):
            try:
                d = os.open(path, os.O_PATH | os.O_CLOEXEC | os.O_DIRECTORY)
            except OSError as e:
                if required:
                    raise _StageFailed("applying Landlock", e.errno) from None
                return
            rule = PathBeneath(access, d)
            ok = sys_call("landlock_add_rule", ruleset, _LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0)
            os.close(d)
            check(ok or not required, "applying Landlock")

        allow("/proc/self", _LANDLOCK_READ, False)
        if spec["shm_access"]:
            allow("/dev/shm", spec["shm_access"], True)
        check(sys_call("landlock_restrict_self", ruleset, 0), "applying Landlock")

    class SockFilter(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    for program in spec["filters"]:
        code = bytes.fromhex(program)
        prog = SockFilter(len(code) // 8, code)
        check(sys_call("seccomp", _SECCOMP_SET_MODE_FILTER, 0, ctypes.byref(prog)), "installing the seccomp filter")
    if spec["cwd"] is not None:
        try:
            os.chdir(spec["cwd"])
        except OSError as e:
            raise _StageFailed("changing to the working directory", e.errno) from None
    # The tool's whole environment, nothing of the server's.
    os.environ.clear()
    os.environ.update(spec["env"])
    for h in high + [parent]:
        if h != chan_fd:
            os.close(h)


if __name__ == "__main__":
    if sys.argv[1:] == ["--fork-server"]:
        _fork_server()
    if len(sys.argv) != 2:
        sys.stderr.write("usage: loom_runner.py path/to/tool.py[:function] | module[:function]\n")
        sys.exit(2)
    serve_module(sys.argv[1])
