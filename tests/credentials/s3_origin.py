"""An S3-style origin that checks AWS Signature Version 4 with botocore's
own signer and the real keys, for the SigV4 re-signing tests and bench.

    s3_origin.py HOST CERT KEY ACCESS_KEY_ID SECRET_ACCESS_KEY REGION LOG [--sts]

Serves HTTPS on HOST (a free port, printed as {"port": N} on the first
line of stdout). Path-style buckets: PUT /bucket/key stores the body, GET
returns it, HEAD answers its length. Every request is checked first:

- `Authorization` must be SigV4 by ACCESS_KEY_ID (else 403
  InvalidAccessKeyId, which, like S3, names the key id it was given);
- its signature must equal the one botocore's `S3SigV4Auth` computes with
  the real keys over the headers it names, at its `X-Amz-Date` (else 403
  SignatureDoesNotMatch);
- a hex `x-amz-content-sha256` must be the body's SHA-256; a
  `STREAMING-AWS4-HMAC-SHA256-PAYLOAD` body's chunk signatures must chain
  from the request's signature under the real key (written here from the
  AWS documentation, independently of the proxy); a
  `STREAMING-UNSIGNED-PAYLOAD-TRAILER` body (boto3's default upload) is
  decoded with its trailer.

With --sts it also runs moto (PyPI, pinned) in this process as STS, on
HOST in plain HTTP (its port printed as "sts_port"), and accepts as well
the temporary keys moto's AssumeRole issued, while they are valid and with
their session token, exactly as AWS does.

Each request appends one JSON line to LOG: method, path, the
`Authorization` and `X-Amz-Security-Token` it carried, and the outcome.
`/__stats` (no signature) answers the counts; GET /echo/… (signed) answers
the request's headers, as a reflecting origin.
"""

import hashlib
import hmac
import json
import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

HOST, CERT, KEY, AK, SK, REGION, LOG = sys.argv[1:8]
STS = "--sts" in sys.argv[8:]
OBJECTS = {}
LOCK = threading.Lock()
STATS = {"requests": 0, "ok": 0, "refused": 0}


def keys_of(key_id):
    """(secret key, session token or None) of a key id this origin accepts."""
    if key_id == AK:
        return SK, None
    if STS:
        import datetime
        from moto.sts.models import sts_backends
        now = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)
        for _, parts in sts_backends.items():
            for _, backend in parts.items():
                for role in backend.assumed_roles:
                    if role.access_key_id == key_id and role.expiration > now:
                        return role.secret_access_key, role.session_token
    return None


def hmac256(key, msg):
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def signing_key(secret, day, region, service):
    k = hmac256(("AWS4" + secret).encode(), day)
    k = hmac256(k, region)
    k = hmac256(k, service)
    return hmac256(k, "aws4_request")


def parse_authorization(value):
    if not value.startswith("AWS4-HMAC-SHA256 "):
        return None
    parts = {}
    for item in value[len("AWS4-HMAC-SHA256 "):].split(","):
        k, _, v = item.strip().partition("=")
        parts[k] = v
    try:
        ak, day, region, service, term = parts["Credential"].split("/")
        return {
            "ak": ak, "day": day, "region": region, "service": service,
            "signed": parts["SignedHeaders"].split(";"), "signature": parts["Signature"],
        }
    except (KeyError, ValueError):
        return None


class Refused(Exception):
    def __init__(self, status, code, message, extra=""):
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra


def decode_signed_chunks(body, auth, amz_date, secret):
    """The payload of a STREAMING-AWS4-HMAC-SHA256-PAYLOAD body, each
    chunk's signature checked against the real key."""
    key = signing_key(secret, auth["day"], auth["region"], auth["service"])
    scope = "%s/%s/%s/aws4_request" % (auth["day"], auth["region"], auth["service"])
    previous, out, i = auth["signature"], b"", 0
    empty = hashlib.sha256(b"").hexdigest()
    while True:
        eol = body.index(b"\r\n", i)
        size_hex, _, ext = body[i:eol].decode().partition(";")
        size = int(size_hex, 16)
        sig = ext.partition("chunk-signature=")[2]
        data = body[eol + 2:eol + 2 + size]
        sts = "\n".join(["AWS4-HMAC-SHA256-PAYLOAD", amz_date, scope, previous, empty,
                         hashlib.sha256(data).hexdigest()])
        want = hmac.new(key, sts.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, sig):
            raise Refused(403, "SignatureDoesNotMatch", "chunk signature at byte %d does not match" % i)
        out += data
        i = eol + 2 + size + 2
        previous = sig
        if size == 0:
            return out


def decode_unsigned_chunks(body):
    """The payload of an aws-chunked body with unsigned chunks and trailers."""
    out, i = b"", 0
    while True:
        eol = body.index(b"\r\n", i)
        size = int(body[i:eol].split(b";")[0], 16)
        if size == 0:
            return out
        out += body[eol + 2:eol + 2 + size]
        i = eol + 2 + size + 2


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def body(self):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def check(self, body):
        """The payload, once the request's signature holds."""
        auth = parse_authorization(self.headers.get("Authorization", ""))
        if auth is None:
            raise Refused(403, "AccessDenied", "no SigV4 Authorization")
        known = keys_of(auth["ak"])
        if known is None:
            raise Refused(403, "InvalidAccessKeyId",
                          "The AWS Access Key Id you provided does not exist in our records.",
                          "<AWSAccessKeyId>%s</AWSAccessKeyId>" % auth["ak"])
        secret, want_token = known
        token = self.headers.get("X-Amz-Security-Token")
        if want_token is not None and token != want_token:
            raise Refused(403, "InvalidToken", "The provided token is malformed or otherwise invalid.")
        amz_date = self.headers.get("X-Amz-Date", "")
        url = "https://%s%s" % (self.headers.get("Host"), self.path)
        req = AWSRequest(method=self.command, url=url, data=body)
        for name in auth["signed"]:
            value = self.headers.get(name)
            if value is None:
                raise Refused(403, "AccessDenied", "signed header %s is missing" % name)
            req.headers[name] = value
        req.context["timestamp"] = amz_date
        signer = S3SigV4Auth(Credentials(auth["ak"], secret, token), auth["service"], REGION)
        canonical = signer.canonical_request(req)
        want = signer.signature(signer.string_to_sign(req, canonical), req)
        if auth["region"] != REGION or not hmac.compare_digest(want, auth["signature"]):
            raise Refused(403, "SignatureDoesNotMatch",
                          "The request signature we calculated does not match the signature you provided.")
        content = self.headers.get("x-amz-content-sha256", "")
        if content == "STREAMING-AWS4-HMAC-SHA256-PAYLOAD":
            return decode_signed_chunks(body, auth, amz_date, secret)
        if content == "STREAMING-UNSIGNED-PAYLOAD-TRAILER":
            return decode_unsigned_chunks(body)
        if len(content) == 64 and hashlib.sha256(body).hexdigest() != content:
            raise Refused(400, "XAmzContentSHA256Mismatch", "the body is not the hash it names")
        return body

    def answer(self, status, body=b"", ctype="application/xml", extra=None):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def handle_any(self):
        if self.path == "/__stats":
            with LOCK:
                return self.answer(200, json.dumps(STATS).encode(), "application/json")
        body = self.body()
        entry = {
            "key_id": (parse_authorization(self.headers.get("Authorization", "")) or {}).get("ak", ""),
            "method": self.command,
            "path": self.path,
            "authorization": self.headers.get("Authorization", ""),
            "security_token": self.headers.get("X-Amz-Security-Token", ""),
        }
        try:
            payload = self.check(body)
        except Refused as r:
            entry["outcome"] = r.code
            self.log(entry, ok=False)
            xml = "<Error><Code>%s</Code><Message>%s</Message>%s</Error>" % (r.code, r.message, r.extra)
            return self.answer(r.status, xml.encode())
        except (ValueError, IndexError) as e:
            entry["outcome"] = "MalformedBody"
            self.log(entry, ok=False)
            return self.answer(400, ("<Error><Code>IncompleteBody</Code><Message>%s</Message></Error>" % e).encode())
        entry["outcome"] = "ok"
        self.log(entry, ok=True)
        path = urlsplit(self.path).path
        if path.startswith("/echo/"):
            # A reflecting origin: the signed request's headers, as S3's
            # errors quote the key id and the string to sign.
            return self.answer(200, json.dumps(dict(self.headers.items())).encode(), "application/json")
        etag = '"%s"' % hashlib.md5(payload).hexdigest()
        if self.command == "PUT":
            with LOCK:
                OBJECTS[path] = payload
            return self.answer(200, b"", extra={"ETag": etag})
        with LOCK:
            data = OBJECTS.get(path)
        if data is None:
            return self.answer(404, b"<Error><Code>NoSuchKey</Code><Message>no such key</Message></Error>")
        return self.answer(200, data, "application/octet-stream",
                           {"ETag": '"%s"' % hashlib.md5(data).hexdigest()})

    def log(self, entry, ok):
        with LOCK:
            STATS["requests"] += 1
            STATS["ok" if ok else "refused"] += 1
            with open(LOG, "a") as f:
                f.write(json.dumps(entry) + "\n")

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = handle_any


def main():
    server = ThreadingHTTPServer((HOST, 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(CERT, KEY)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    ports = {"port": server.server_address[1]}
    if STS:
        from moto.server import ThreadedMotoServer
        sts = ThreadedMotoServer(ip_address=HOST, port=0, verbose=False)
        sts.start()
        ports["sts_port"] = sts.get_host_and_port()[1]
    print(json.dumps(ports), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
