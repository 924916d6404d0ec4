"""A canary on the outside network for the compose test: it counts every TCP
connection to port 9000 and every DNS datagram to port 53, by source
address, and reports them as JSON on port 9001. Tools must reach it never;
the proxy reaches it once (the test's positive control)."""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

lock = threading.Lock()
seen = {"tcp": [], "dns": []}


def tcp():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 9000))
    s.listen(64)
    while True:
        c, peer = s.accept()
        with lock:
            seen["tcp"].append(peer[0])
        c.close()


def dns():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", 53))
    while True:
        _, peer = s.recvfrom(4096)
        with lock:
            seen["dns"].append(peer[0])


class Report(BaseHTTPRequestHandler):
    def do_GET(self):
        with lock:
            data = json.dumps(seen).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


if __name__ == "__main__":
    threading.Thread(target=tcp, daemon=True).start()
    threading.Thread(target=dns, daemon=True).start()
    ThreadingHTTPServer(("0.0.0.0", 9001), Report).serve_forever()
