#!/usr/bin/env python3
"""Writes tests/credentials/sigv4_vectors.json: requests signed by botocore's
own SigV4 signers (`SigV4Auth`, `S3SigV4Auth`), the expected answers of the
proxy's signer (proxy/src/creds/sigv4.rs, tested in sigv4_tests.rs).

    python3 tests/credentials/sigv4_vectors.py   # needs botocore

Each vector is signed by botocore at a fixed time (its clock,
`botocore.auth.get_current_datetime`, is patched) and recorded as the proxy
sees the request on the wire: the method, the path and raw query as sent,
every header except the three the signer sets (Authorization, X-Amz-Date,
X-Amz-Security-Token), the payload hash botocore put in its canonical
request, the credentials, scope and time; and botocore's answer: the
Authorization and X-Amz-Date headers it set (with its canonical request and
string to sign, to read a mismatch).

botocore signs every header of a request but a few hop-by-hop ones
(`SIGNED_HEADERS_BLACKLIST`), the proxy's signer only `host`, `x-amz-*`,
`content-type`, `content-md5` and the names a caller adds: so every header
of a vector is one of those, one botocore never signs (`User-Agent`,
`Expect`, ...), or named in the vector's `also_sign`. The script checks it.

Most vectors carry their query in the URL, encoded as botocore encodes it.
A vector with `params` is signed by botocore from the decoded parameters
(its `_canonical_query_string_params`), while the proxy gets `wire_query`,
the same parameters encoded another way (lower-case hex, sub-delimiters
left raw, unreserved characters escaped): the proxy decodes and re-encodes
a query, as the receiving service does.
"""

import datetime
import json
import os
import sys
from unittest import mock
from urllib.parse import urlsplit

import botocore
from botocore.auth import SIGNED_HEADERS_BLACKLIST, S3SigV4Auth, SigV4Auth, _host_from_url
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials

AKID = "AKIDEXAMPLE"
SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"
TOKEN = (
    "IQoJb3JpZ2luX2VjEEXAMPLE//////////wEaCXVzLWVhc3QtMSJHMEUCIQD+example/"
    "token+with/slashes=and+plus=="
)
T0 = datetime.datetime(2015, 8, 30, 12, 36, 0)
LEAP = datetime.datetime(2024, 2, 29, 23, 59, 59)
NEW_YEAR = datetime.datetime(1999, 12, 31, 23, 59, 59)

JSON_BODY = b'{"SecretId":"prod/db/password","VersionStage":"AWSCURRENT"}'
JSON_HEADERS = [
    ("X-Amz-Target", "secretsmanager.GetSecretValue"),
    ("Content-Type", "application/x-amz-json-1.1"),
    ("User-Agent", "aws-cli/2.15.0 Python/3.11.6"),
]

VECTORS = [
    # --- S3: the path as sent, never normalized ---
    dict(
        name="s3 GET object, empty body (signed payload)",
        service="s3",
        method="GET",
        url="https://examplebucket.s3.amazonaws.com/photos/2024/cat.jpg",
    ),
    dict(
        name="s3 PUT object with Content-MD5 over https: UNSIGNED-PAYLOAD",
        service="s3",
        method="PUT",
        url="https://examplebucket.s3.us-west-2.amazonaws.com/reports/q1.csv",
        region="us-west-2",
        headers=[
            ("Content-Type", "text/csv"),
            ("Content-MD5", "1B2M2Y8AsgTpgAmY7PhCfg=="),
            ("x-amz-storage-class", "STANDARD_IA"),
            ("Expect", "100-continue"),
        ],
        body=b"a,b\n1,2\n",
        s3_payload_signing=False,
    ),
    dict(
        name="s3 PUT with a signed body and metadata with messy whitespace and repeats",
        service="s3",
        method="PUT",
        url="https://examplebucket.s3.amazonaws.com/notes/today.txt",
        headers=[
            ("Content-Type", "text/plain;   charset=utf-8"),
            ("X-Amz-Meta-Note", "  first\t\tline   of  text  "),
            ("x-amz-meta-tag", "a"),
            ("X-Amz-Meta-Tag", " b  c "),
            ("x-amz-meta-empty", ""),
        ],
        body=b"hello world\n",
    ),
    dict(
        name="s3 key with spaces and unicode, percent-encoded, kept as sent",
        service="s3",
        method="GET",
        url="https://s3.amazonaws.com/examplebucket/my%20key/%E2%82%AC%20price%2Blist.txt",
    ),
    dict(
        name="s3 dot segments and double slashes are not normalized",
        service="s3",
        method="GET",
        url="https://s3.eu-central-1.amazonaws.com/examplebucket/a//b/./c/../d",
        region="eu-central-1",
    ),
    dict(
        name="s3 ListObjectsV2 query, unsorted, encoded",
        service="s3",
        method="GET",
        url=(
            "https://examplebucket.s3.amazonaws.com/?prefix=photos%2F2024%20summer%2B&"
            "list-type=2&max-keys=10&delimiter=%2F&encoding-type=url"
        ),
    ),
    dict(
        name="s3 sub-resource without '=' and repeated keys sorted by value",
        service="s3",
        method="GET",
        url="https://examplebucket.s3.amazonaws.com/obj?versionId=3&acl&tag=b&tag=a&tag=",
    ),
    dict(
        name="s3 with a session token",
        service="s3",
        method="HEAD",
        url="https://examplebucket.s3.amazonaws.com/private/report.pdf",
        token=TOKEN,
        time=LEAP,
    ),
    dict(
        name="s3 streaming upload with a trailing checksum (STREAMING-UNSIGNED-PAYLOAD-TRAILER)",
        service="s3",
        method="PUT",
        url="https://examplebucket.s3.amazonaws.com/big/object.bin",
        headers=[
            ("Content-Encoding", "aws-chunked"),
            ("x-amz-trailer", "x-amz-checksum-crc32"),
            ("x-amz-decoded-content-length", "66560"),
            ("Content-Length", "66704"),
            ("Transfer-Encoding", "chunked"),
        ],
        also_sign=["content-encoding", "content-length"],
        checksum_trailer=True,
    ),
    dict(
        name="s3 virtual host with a port, extra signed names",
        service="s3",
        method="POST",
        url="https://examplebucket.s3.amazonaws.com:8443/upload?uploads",
        headers=[
            ("Host", "examplebucket.s3.amazonaws.com:8443"),
            ("Content-Type", "application/octet-stream"),
            ("Range", "bytes=0-9"),
            ("Accept", "*/*"),
            ("Connection", "keep-alive"),
        ],
        also_sign=["Range", "ACCEPT"],
        time=NEW_YEAR,
    ),
    # --- other services: the path normalized and encoded once more ---
    dict(
        name="secretsmanager GetSecretValue (JSON, X-Amz-Target)",
        service="secretsmanager",
        method="POST",
        url="https://secretsmanager.us-east-1.amazonaws.com/",
        headers=JSON_HEADERS,
        body=JSON_BODY,
    ),
    dict(
        name="secretsmanager with a session token",
        service="secretsmanager",
        region="eu-west-1",
        method="POST",
        url="https://secretsmanager.eu-west-1.amazonaws.com/",
        headers=JSON_HEADERS,
        body=JSON_BODY,
        token=TOKEN,
    ),
    dict(
        name="sts GetCallerIdentity (query protocol, form body)",
        service="sts",
        method="POST",
        url="https://sts.amazonaws.com/",
        headers=[("Content-Type", "application/x-www-form-urlencoded; charset=utf-8")],
        body=b"Action=GetCallerIdentity&Version=2011-06-15",
    ),
    dict(
        name="iam GET with an empty path and a query",
        service="iam",
        method="GET",
        url="https://iam.amazonaws.com?Action=ListUsers&Version=2010-05-08",
    ),
    dict(
        name="es path with encoded characters is encoded again",
        service="es",
        method="GET",
        url="https://search-domain.us-east-1.es.amazonaws.com/_search/%3Fa=b%20c",
    ),
    dict(
        name="lambda Invoke of a qualified ARN (':' sent encoded)",
        service="lambda",
        method="POST",
        url=(
            "https://lambda.us-east-1.amazonaws.com/2015-03-31/functions/"
            "arn%3Aaws%3Alambda%3Aus-east-1%3A123456789012%3Afunction%3Amy-fn/invocations?Qualifier=prod"
        ),
        headers=[
            ("X-Amz-Invocation-Type", "RequestResponse"),
            ("X-Amz-Client-Context", "eyJjdXN0b20iOnt9fQ=="),
        ],
        body=b'{"key":"value"}',
    ),
    dict(
        name="dot segments and double slashes normalized (non-s3)",
        service="execute-api",
        method="GET",
        url="https://abc123.execute-api.us-east-1.amazonaws.com/prod/./a//b/../c/",
    ),
    dict(
        name="'..' above the root and a trailing '..' (non-s3)",
        service="execute-api",
        method="DELETE",
        url="https://abc123.execute-api.us-east-1.amazonaws.com/../x/y/..",
    ),
    dict(
        name="unicode path sent raw and reserved characters (non-s3)",
        service="execute-api",
        method="GET",
        url="https://abc123.execute-api.us-east-1.amazonaws.com/prod/r\u00e9sum\u00e9/\u00fc+\u20ac!$'()*,;=:@",
    ),
    dict(
        name="query decoded and re-encoded: spaces, '+', '=', unicode, repeats, no '='",
        service="execute-api",
        method="GET",
        url="https://abc123.execute-api.us-east-1.amazonaws.com/prod/items",
        params=[
            ("q", "a b+c=d/\u00e9"),
            ("marker", "~x*y!"),
            ("Empty", ""),
            ("k", "2"),
            ("k", "10"),
            ("z", "last"),
            ("\u00e9", "accent sorts before z once encoded"),
            ("a b", "space in name"),
        ],
        wire_query=(
            "q=a%20b%2bc=d/%c3%a9&marker=%7Ex*y!&Empty&k=2&k=10&z=last&"
            "%C3%A9=accent%20sorts%20before%20z%20once%20encoded&a%20b=space%20in%20%6eame"
        ),
    ),
    dict(
        name="monitoring PUT with UNSIGNED-PAYLOAD (payload signing disabled), extra names",
        service="monitoring",
        method="PUT",
        url="https://monitoring.us-east-1.amazonaws.com/x",
        headers=[
            ("Content-Type", "application/json"),
            ("Content-Length", "2"),
            ("X-Amzn-Trace-Id", "Root=1-5759e988-bd862e3fe1be46a994272793"),
        ],
        also_sign=["content-length"],
        body=b"{}",
        payload_signing=False,
    ),
]


def signable(name, also_sign):
    n = name.lower()
    return (
        n in ("host", "content-type", "content-md5")
        or n.startswith("x-amz-")
        or n in (a.lower() for a in also_sign)
    )


def sign(v):
    service = v["service"]
    region = v.get("region", "us-east-1")
    token = v.get("token")
    at = v.get("time", T0)
    creds = Credentials(AKID, SECRET, token)
    cls = S3SigV4Auth if service == "s3" else SigV4Auth
    auth = cls(creds, service, region)
    req = AWSRequest(method=v["method"], url=v["url"], data=v.get("body", b""))
    for name, value in v.get("headers", []):
        req.headers[name] = value  # appends: repeated names are kept
    if "params" in v:
        req.params = v["params"]
    if v.get("s3_payload_signing") is not None:
        req.context["client_config"] = Config(s3={"payload_signing_enabled": v["s3_payload_signing"]})
    if v.get("payload_signing") is not None:
        req.context["payload_signing_enabled"] = v["payload_signing"]
    if v.get("checksum_trailer"):
        req.context["checksum"] = {"request_algorithm": {"in": "trailer", "name": "x-amz-checksum-crc32"}}

    seen = {}
    canonical_request, string_to_sign = auth.canonical_request, auth.string_to_sign

    def capture_cr(r):
        seen["canonical_request"] = canonical_request(r)
        return seen["canonical_request"]

    def capture_sts(r, cr):
        seen["string_to_sign"] = string_to_sign(r, cr)
        return seen["string_to_sign"]

    auth.canonical_request, auth.string_to_sign = capture_cr, capture_sts
    with mock.patch("botocore.auth.get_current_datetime", return_value=at):
        auth.add_auth(req)

    also_sign = v.get("also_sign", [])
    set_by_signer = ("authorization", "x-amz-date", "x-amz-security-token")
    headers = [[n, val] for n, val in req.headers.items() if n.lower() not in set_by_signer]
    if not any(n.lower() == "host" for n, _ in headers):
        # botocore signs the URL's host when the request has no Host header;
        # on the wire the request has one.
        headers.insert(0, ["Host", _host_from_url(v["url"])])
    for n, _ in headers:
        if not signable(n, also_sign) and n.lower() not in SIGNED_HEADERS_BLACKLIST:
            sys.exit(f"{v['name']}: botocore would sign {n}, the proxy would not (add it to also_sign)")

    parts = urlsplit(v["url"])
    unix = int(at.replace(tzinfo=datetime.timezone.utc).timestamp())
    return {
        "name": v["name"],
        "method": v["method"],
        "path": parts.path,
        "query": v.get("wire_query", parts.query),
        "headers": headers,
        "payload_hash": seen["canonical_request"].rsplit("\n", 1)[1],
        "also_sign": also_sign,
        "access_key_id": AKID,
        "secret_access_key": SECRET,
        "session_token": token,
        "region": region,
        "service": service,
        "unix_time": unix,
        "expected": {
            "authorization": req.headers["Authorization"],
            "amz_date": req.headers["X-Amz-Date"],
            "security_token": req.headers.get("X-Amz-Security-Token"),
            "canonical_request": seen["canonical_request"],
            "string_to_sign": seen["string_to_sign"],
        },
    }


def main():
    out = {
        "generator": f"tests/credentials/sigv4_vectors.py with botocore {botocore.__version__}",
        "vectors": [sign(v) for v in VECTORS],
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sigv4_vectors.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {len(out['vectors'])} vectors to {path}")


if __name__ == "__main__":
    main()
