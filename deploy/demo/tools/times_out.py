"""Demo tool that times out twice: its fetch outlives the tool's
fetch_timeout_ms (the proxy answers 504, X-Egress-Error: timeout), then the
tool itself outlives timeout_ms and the executor kills it."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo_http  # noqa: E402


def run(input, ctx):
    r = demo_http.get("http://origin.demo.test:8080/slow?ms=5000")
    ctx.emit({"step": "fetch", "status": r["status"], "error": r.get("error")})
    time.sleep(60)   # never returns: the executor's timeout_ms ends it
    return {"status": r["status"]}
