"""Demo tool that stays inside its allowlist: one plain-HTTP fetch and one
CONNECT tunnel to the demo origin, both allowed."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo_http  # noqa: E402

ORIGIN = "origin.demo.test"


def run(input, ctx):
    city = (input or {}).get("city", "Oslo")
    plain = demo_http.get("http://%s:8080/weather?city=%s" % (ORIGIN, city))
    ctx.emit({"step": "http", "status": plain["status"]})
    tunnel = demo_http.get_via_tunnel(ORIGIN, 8080, "/weather?city=%s" % city)
    ctx.emit({"step": "connect", "status": tunnel["status"]})
    return {"http": plain["status"], "connect": tunnel["status"], "forecast": plain.get("body", "")[:200]}
