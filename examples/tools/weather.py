"""Example Python tool, run by executor/runners/loom_runner.py.

Module-level code is the load phase (the run is not active yet: no network);
run(input, ctx) is called once. Its only network is HTTP_PROXY, the run's
proxy URL, which urllib honours by itself.

input: {"city": "Oslo", "origin": "http://127.0.0.2:8787", "also_try": "http://evil.example/"}
"""

import json
import urllib.error
import urllib.parse
import urllib.request


def fetch(url):
    """GET through the proxy → (status, JSON body or the denial)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, {
            "deny_reason": e.headers.get("X-Egress-Deny-Reason"),
            "error": e.headers.get("X-Egress-Error"),
            "message": e.read().decode("utf-8", "replace").strip()[:200],
        }


def run(input, ctx):
    city = input.get("city", "Oslo")
    origin = input.get("origin", "http://127.0.0.2:8787")
    ctx.emit({"step": "fetch", "city": city})
    status, body = fetch(origin + "/v1/now?city=" + urllib.parse.quote(city))
    out = {"city": city, "status": status, "weather": body, "by": "python"}
    if input.get("also_try"):
        # Not in this tool's allowlist: the proxy answers 403 before any DNS
        # and records an EGRESS_DENIED fact under this run.
        s, b = fetch(input["also_try"])
        ctx.emit({"step": "also_try", "url": input["also_try"], "status": s})
        out["also_try"] = {"url": input["also_try"], "status": s, "deny_reason": b.get("deny_reason")}
    return out
