"""Demo tool that probes beyond its allowlist: hosts it does not list
(denied before any DNS query) and a listed name that resolves into a private
range without `private = true` (denied after resolution)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo_http  # noqa: E402


def run(input, ctx):
    results = [
        demo_http.get("http://origin.demo.test:8080/weather?city=Bergen"),   # allowed
        demo_http.get("http://exfil.example.net/upload"),                   # not_allowlisted
        demo_http.get_via_tunnel("paste.example.org", 443, "/"),            # not_allowlisted (CONNECT)
        demo_http.get("http://internal.demo.test:8080/admin"),              # private_address
    ]
    for r in results:
        ctx.emit({"target": r.get("url") or r.get("tunnel"), "status": r["status"], "deny_reason": r.get("deny_reason")})
    return {"statuses": [r["status"] for r in results]}
