"""A tool of the SigV4 re-signing tests: AWS clients as a tool runs them,
with the run's environment only (HTTPS_PROXY, the CA bundle variables, and
the placeholder as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY).

    s3_tool.py ACTION ENDPOINT

Prints one JSON object: what happened.
"""

import hashlib
import hmac
import json
import os
import sys
import datetime

import boto3
import requests
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.exceptions import ClientError

ACTION, ENDPOINT = sys.argv[1], sys.argv[2]
REGION = "us-east-1"
CA = os.environ.get("AWS_CA_BUNDLE")


def s3(**keys):
    cfg = Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1})
    return boto3.client("s3", endpoint_url=ENDPOINT, region_name=REGION, config=cfg, **keys)


def denial(r):
    return json.loads(r.headers.get("X-Egress-Denial") or "null")


def boto():
    """put_object (boto3's default: unsigned trailer checksums), get_object, head_object."""
    c = s3()
    body = os.urandom(300_000)
    c.put_object(Bucket="bucket", Key="boto/object", Body=body)
    got = c.get_object(Bucket="bucket", Key="boto/object")["Body"].read()
    head = c.head_object(Bucket="bucket", Key="boto/object")
    small = b"hello from a tool"
    c.put_object(Bucket="bucket", Key="boto/small", Body=small, ChecksumAlgorithm="SHA256")
    return {"same": got == body, "length": head["ContentLength"],
            "small": c.get_object(Bucket="bucket", Key="boto/small")["Body"].read().decode()}


def other_key():
    """boto3 with a real-looking key of someone else's."""
    c = s3(aws_access_key_id="AKIAIOSFODNN7EXAMPLE",
           aws_secret_access_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    try:
        c.get_object(Bucket="bucket", Key="boto/object")
        return {"status": 200}
    except ClientError as e:
        r = e.response
        return {"status": r["ResponseMetadata"]["HTTPStatusCode"],
                "reason": r["ResponseMetadata"]["HTTPHeaders"].get("x-egress-denial", "")}


def presigned():
    """Presigned GETs, as boto3 makes them by default (SigV2 for S3) and with SigV4."""
    out = {}
    for version in ("s3", "s3v4"):
        c = boto3.client("s3", endpoint_url=ENDPOINT, region_name=REGION,
                         config=Config(s3={"addressing_style": "path"}, signature_version=version))
        url = c.generate_presigned_url("get_object", Params={"Bucket": "bucket", "Key": "boto/object"})
        r = requests.get(url, verify=CA)
        out[version] = {"status": r.status_code, "denial": denial(r)}
    return out


def unsigned():
    """No signature at all: the proxy signs (and hashes the body)."""
    put = requests.put(ENDPOINT + "/bucket/plain", data=b"plain body", verify=CA)
    get = requests.get(ENDPOINT + "/bucket/plain", verify=CA)
    big = requests.put(ENDPOINT + "/bucket/big", data=b"x" * (2 << 20), verify=CA)
    return {"put": put.status_code, "get": get.status_code, "body": get.text,
            "big": big.status_code, "big_denial": denial(big)}


def echo():
    r = requests.get(ENDPOINT + "/echo/headers", verify=CA)
    return {"status": r.status_code, "text": r.text}


def chunked():
    """A streaming upload whose chunks are signed (STREAMING-AWS4-HMAC-SHA256-PAYLOAD),
    signed with the placeholder keys, 64 KiB chunks."""
    ak, sk = os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
    payload = os.urandom(200_000)
    chunks = [payload[i:i + 65536] for i in range(0, len(payload), 65536)] + [b""]
    sig_len = len(";chunk-signature=") + 64 + 4
    length = sum(len("%x" % len(c)) + sig_len + len(c) for c in chunks)
    url = ENDPOINT + "/bucket/chunked"
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    req = AWSRequest(method="PUT", url=url, headers={
        "Content-Encoding": "aws-chunked",
        "X-Amz-Content-SHA256": "STREAMING-AWS4-HMAC-SHA256-PAYLOAD",
        "X-Amz-Decoded-Content-Length": str(len(payload)),
        "Content-Length": str(length),
        "X-Amz-Date": amz_date,
    })
    req.context["timestamp"] = amz_date
    signer = SigV4Auth(Credentials(ak, sk), "s3", REGION)
    seed = signer.signature(signer.string_to_sign(req, signer.canonical_request(req)), req)
    req.headers["Authorization"] = "AWS4-HMAC-SHA256 Credential=%s, SignedHeaders=%s, Signature=%s" % (
        signer.scope(req), signer.signed_headers(signer.headers_to_sign(req)), seed)
    k = hmac.new(("AWS4" + sk).encode(), amz_date[:8].encode(), hashlib.sha256).digest()
    for part in (REGION, "s3", "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    scope = "%s/%s/s3/aws4_request" % (amz_date[:8], REGION)
    previous, body = seed, b""
    empty = hashlib.sha256(b"").hexdigest()
    for c in chunks:
        sts = "\n".join(["AWS4-HMAC-SHA256-PAYLOAD", amz_date, scope, previous, empty, hashlib.sha256(c).hexdigest()])
        previous = hmac.new(k, sts.encode(), hashlib.sha256).hexdigest()
        body += b"%x;chunk-signature=%s\r\n" % (len(c), previous.encode()) + c + b"\r\n"
    assert len(body) == length
    headers = {k: v for k, v in req.headers.items() if k.lower() != "host"}
    put = requests.put(url, data=body, headers=headers, verify=CA)
    if put.status_code != 200:
        return {"put": put.status_code, "put_text": put.text[:300], "denial": denial(put)}
    got = s3().get_object(Bucket="bucket", Key="chunked")["Body"].read()
    return {"put": put.status_code, "put_text": put.text[:300], "same": got == payload}


print(json.dumps({"boto": boto, "other_key": other_key, "presigned": presigned, "unsigned": unsigned,
                  "echo": echo, "chunked": chunked}[ACTION]()))
