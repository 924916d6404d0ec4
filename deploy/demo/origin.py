"""The demo upstream: a small HTTP origin on the outside network (standard
library only). Routes: /weather?city=X, /slow?ms=N (answers after N ms, at
most 10 s), /readyz, anything else says hello."""

import json
import random
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        q = urllib.parse.parse_qs(url.query)
        if url.path == "/readyz":
            body = {"ready": True}
        elif url.path == "/weather":
            city = q.get("city", ["Oslo"])[0]
            body = {"city": city, "temp_c": random.randint(-5, 25), "sky": random.choice(["clear", "rain", "fog"])}
        elif url.path == "/slow":
            ms = min(int(q.get("ms", ["1000"])[0]), 10000)
            time.sleep(ms / 1000)
            body = {"slept_ms": ms}
        else:
            body = {"hello": "from the demo origin", "path": url.path}
        data = (json.dumps(body) + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt, *args):
        pass


if __name__ == "__main__":
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("0.0.0.0", 8080), Handler).serve_forever()
