"""The project's own Python kernel client (clients/python) against a
confined session tool's endpoint: argv is the executor's base URL, the
token, the tool and a tool to call that the rules allow and one they
refuse; prints one JSON object: the listed tool names, the allowed call's
text, and the refused call's McpError (code, reason, fact_id)."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "clients", "python"))

from loom_egress import ExecutorClient, McpError  # noqa: E402

base, token, tool, allowed, refused = sys.argv[1:6]
out = {}
with ExecutorClient(base, token=token).mcp_session(tool) as s:
    out["tools"] = sorted(t["name"] for t in s.list_tools())
    r = s.call_tool(allowed, {"timezone": "Etc/UTC"})
    out["text"] = "".join(c.get("text", "") for c in r.get("content", []))
    try:
        s.call_tool(refused, {})
        out["refused"] = None
    except McpError as e:
        out["refused"] = {"code": e.code, "reason": e.reason, "fact_id": e.fact_id}
print(json.dumps(out))
