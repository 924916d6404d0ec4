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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.stderr.write("usage: loom_runner.py path/to/tool.py[:function] | module[:function]\n")
        sys.exit(2)
    serve_module(sys.argv[1])
