"""HTTP helpers for the demo tools (standard library only).

Every request goes to the proxy named in HTTP_PROXY, which the executor sets
for each child: plain HTTP in absolute form, HTTPS-style tunnels via CONNECT.
A denial comes back as 403/400/407 with X-Egress-Deny-Reason.
"""

import base64
import http.client
import os
import urllib.error
import urllib.parse
import urllib.request


def get(url, timeout=15):
    """GET through HTTP_PROXY; returns {status, deny_reason, error, body}."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return {"url": url, "status": r.status, "body": r.read(2048).decode("utf-8", "replace")}
    except urllib.error.HTTPError as e:
        return {"url": url, "status": e.code,
                "deny_reason": e.headers.get("X-Egress-Deny-Reason"),
                "error": e.headers.get("X-Egress-Error")}
    except OSError as e:
        return {"url": url, "status": None, "error": str(e)}


def get_via_tunnel(host, port, path, timeout=15):
    """GET http://host:port/path inside a CONNECT tunnel opened through the proxy."""
    proxy = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
    cred = "%s:%s" % (urllib.parse.unquote(proxy.username or ""), urllib.parse.unquote(proxy.password or ""))
    auth = {"Proxy-Authorization": "Basic " + base64.b64encode(cred.encode()).decode()}
    conn = http.client.HTTPConnection(proxy.hostname, proxy.port, timeout=timeout)
    target = "%s:%d" % (host, port)
    try:
        conn.set_tunnel(host, port, headers=auth)
        conn.request("GET", path, headers={"Host": target})
        r = conn.getresponse()
        return {"tunnel": target, "status": r.status, "body": r.read(2048).decode("utf-8", "replace")}
    except OSError as e:
        # http.client reports a refused CONNECT as "Tunnel connection failed: 403 ...".
        return {"tunnel": target, "status": None, "error": str(e)}
    finally:
        conn.close()
