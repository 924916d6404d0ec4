#!/usr/bin/env python3
"""A real OAuth2 authorization server (authlib on Flask) for the proxy's
minted-token tests, and the API its tokens open.

    oauth2_server.py HOST CERT KEY LIFETIME_S

Serves, on HOST:
- over TLS (CERT, KEY): POST /token, the token endpoint: the client
  credentials grant for client `loom` (secret `cs-loom-secret`, HTTP Basic),
  the refresh token grant for the public client `loom-public` (its first
  refresh token `rt-initial`; each refresh rotates it and revokes the old
  one). Tokens live LIFETIME_S seconds.
- in plain HTTP, the API and the test's controls:
  - GET /api/check: 200 when the request's Bearer token is one this server
    issued and not expired, else 401;
  - GET /api/echo: answers the request's Authorization header (a reflecting
    origin);
  - GET /stats: token requests so far, by grant, the refresh tokens
    presented and the access tokens issued, as JSON;
  - POST /down, POST /up: the token endpoint answers 503 while down.
Prints one JSON line {"tls": port, "plain": port} when both listen.
"""

import json
import sys
import threading
import time

from authlib.integrations.flask_oauth2 import AuthorizationServer
from authlib.oauth2.rfc6749 import ClientMixin, TokenMixin, grants
from flask import Flask, jsonify, request
from werkzeug.serving import make_server

HOST, CERT, KEY, LIFETIME = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

lock = threading.Lock()
tokens = {}  # access token -> Token
refresh_tokens = {}  # refresh token -> Token
stats = {"requests": 0, "by_grant": {}, "refresh_tokens_presented": [], "issued": [], "down": False}


class Client(ClientMixin):
    def __init__(self, client_id, secret, grant, auth):
        self.client_id, self.secret, self.grant, self.auth = client_id, secret, grant, auth

    def get_client_id(self):
        return self.client_id

    def get_default_redirect_uri(self):
        return None

    def get_allowed_scope(self, scope):
        return scope or ""

    def check_redirect_uri(self, redirect_uri):
        return False

    def check_client_secret(self, client_secret):
        return self.secret is not None and client_secret == self.secret

    def check_endpoint_auth_method(self, method, endpoint):
        return method == self.auth

    def check_response_type(self, response_type):
        return False

    def check_grant_type(self, grant_type):
        return grant_type in self.grant


CLIENTS = {
    "loom": Client("loom", "cs-loom-secret", ("client_credentials",), "client_secret_basic"),
    "loom-public": Client("loom-public", None, ("refresh_token",), "none"),
}


class Token(TokenMixin):
    def __init__(self, client_id, access, refresh, scope, expires_in):
        self.client_id, self.access, self.refresh, self.scope = client_id, access, refresh, scope
        self.issued = time.time()
        self.expires_in = expires_in
        self.revoked = False

    def check_client(self, client):
        return client.get_client_id() == self.client_id

    def get_scope(self):
        return self.scope

    def get_expires_in(self):
        return self.expires_in

    def is_expired(self):
        return time.time() >= self.issued + self.expires_in

    def is_revoked(self):
        return self.revoked


def save_token(token, req):
    t = Token(
        req.client.get_client_id(),
        token["access_token"],
        token.get("refresh_token"),
        token.get("scope", ""),
        token["expires_in"],
    )
    with lock:
        stats["issued"].append(t.access)
        tokens[t.access] = t
        if t.refresh:
            refresh_tokens[t.refresh] = t


class RefreshTokenGrant(grants.RefreshTokenGrant):
    TOKEN_ENDPOINT_AUTH_METHODS = ["none"]
    INCLUDE_NEW_REFRESH_TOKEN = True

    def authenticate_refresh_token(self, refresh_token):
        with lock:
            stats["refresh_tokens_presented"].append(refresh_token)
            t = refresh_tokens.get(refresh_token)
        if t is not None and not t.revoked:
            return t
        return None

    def authenticate_user(self, refresh_token):
        return {"id": 1}

    def revoke_old_credential(self, refresh_token):
        refresh_token.revoked = True


app = Flask(__name__)
app.config["OAUTH2_TOKEN_EXPIRES_IN"] = {"client_credentials": LIFETIME, "refresh_token": LIFETIME}
app.config["OAUTH2_REFRESH_TOKEN_GENERATOR"] = True
server = AuthorizationServer(app, query_client=CLIENTS.get, save_token=save_token)
server.register_grant(grants.ClientCredentialsGrant)
server.register_grant(RefreshTokenGrant)

# The public client's first refresh token.
_seed = Token("loom-public", "at-seed-unused", "rt-initial", "", LIFETIME)
refresh_tokens["rt-initial"] = _seed


@app.post("/token")
def token():
    with lock:
        stats["requests"] += 1
        g = request.form.get("grant_type", "")
        stats["by_grant"][g] = stats["by_grant"].get(g, 0) + 1
        down = stats["down"]
    if down:
        return "token endpoint down", 503
    return server.create_token_response()


api = Flask("api")


def bearer():
    h = request.headers.get("Authorization", "")
    return h[7:] if h.startswith("Bearer ") else None


@api.get("/api/check")
def check():
    t = bearer()
    with lock:
        tok = tokens.get(t) if t else None
    if tok is None or tok.is_expired() or tok.revoked:
        return "invalid or expired token", 401
    return "ok"


@api.get("/api/echo")
def echo():
    return "authorization: " + request.headers.get("Authorization", "")


@api.get("/stats")
def get_stats():
    with lock:
        return jsonify(stats)


@api.post("/down")
def down():
    with lock:
        stats["down"] = True
    return "down"


@api.post("/up")
def up():
    with lock:
        stats["down"] = False
    return "up"


tls = make_server(HOST, 0, app, threaded=True, ssl_context=(CERT, KEY))
plain = make_server(HOST, 0, api, threaded=True)
for s in (tls, plain):
    threading.Thread(target=s.serve_forever, daemon=True).start()
print(json.dumps({"tls": tls.server_port, "plain": plain.server_port}), flush=True)
threading.Event().wait()
