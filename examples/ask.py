"""Example kernel helper: a person approves held fetches on the terminal.

A tool with `on_unlisted = "ask"` has each fetch to a name its allowlist
does not list held (no DNS, one of its run's slots taken) for up to
`ask_timeout_ms`, while the proxy announces it on the fact stream. This
script prints each one and asks; "y" grants that one run that one
`name:port` once, anything else leaves it to be denied when its time runs
out (a fact either way).

    export EGRESS_CONTROL_TOKEN=...
    python3 examples/ask.py [--control http://127.0.0.1:3129] [--uses 1]

The tool's config, for instance:

    [tools.research]
    egress         = ["api.search.example:443"]
    on_unlisted    = "ask"
    ask_timeout_ms = 60000
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

from loom_egress import ProxyClient  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--control", default="http://127.0.0.1:3129", help="the proxy's control API")
    ap.add_argument("--uses", type=int, default=1, help="fetches each approval allows")
    args = ap.parse_args()
    token = os.environ.get("EGRESS_CONTROL_TOKEN") or sys.exit("set EGRESS_CONTROL_TOKEN")
    proxy = ProxyClient(args.control, token)
    # Only what is held from now on: start after the newest fact.
    after = 0
    while True:
        page = proxy.facts(after=after, limit=1000)
        after = page["next"]
        if len(page["facts"]) < 1000:
            break

    def decide(fact):
        t = fact["target"]
        print("run %s of tool %s asks for %s:%s" % (fact["run_id"], fact["tool"], t["host"], t["port"]))
        try:
            yes = input("  allow once? [y/N] ").strip().lower() == "y"
        except EOFError:
            return False
        return {"uses": args.uses} if yes else False

    print("waiting for held fetches (Ctrl-C to stop)")
    try:
        proxy.on_pending(decide, after=after)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
