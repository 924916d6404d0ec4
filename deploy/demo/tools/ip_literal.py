"""Demo tool that tries IP literals in several spellings: every one is denied
(ip_literal) before anything is dialled."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo_http  # noqa: E402


def run(input, ctx):
    targets = [
        "http://169.254.169.254/latest/meta-data/",   # cloud metadata
        "http://172.28.20.10:8080/weather",           # the origin's own address, bypassing its name
        "http://2130706433/",                         # 127.0.0.1 as one decimal number
    ]
    results = [demo_http.get(t) for t in targets]
    for r in results:
        ctx.emit({"target": r["url"], "status": r["status"], "deny_reason": r.get("deny_reason")})
    return {"statuses": [r["status"] for r in results]}
