"""Demo tool whose fetch is slow but within every deadline."""

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo_http  # noqa: E402


def run(input, ctx):
    ms = int((input or {}).get("ms", random.randint(800, 2500)))
    r = demo_http.get("http://origin.demo.test:8080/slow?ms=%d" % ms)
    return {"status": r["status"], "ms": ms}
