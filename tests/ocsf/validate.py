#!/usr/bin/env python3
"""Validates OCSF events (one JSON object a line) against OCSF 1.8.0.

Each event is checked against the JSON Schema of its class (`class_uid`)
with the profiles it names (`metadata.profiles`), as the package
ocsf-json-schema generates it (objects embedded, no unknown attribute
allowed, required attributes, enums, `at_least_one` / `just_one`
constraints, type patterns), with jsonschema's Draft 2020-12 validator.
Also checked, since the JSON Schema cannot say them: `metadata.version` is
1.8.0, `type_uid` is `class_uid` * 100 + `activity_id`, and every profile
named is one the class takes.

Usage: python3 tests/ocsf/validate.py [FILE]   (FILE: JSON lines; stdin
without one). Prints each error with the event's `metadata.uid` (or its
line), exits 1 on any error, 0 with a count when every event is valid.
Produce the events with:

    LOOM_OCSF_DUMP=/tmp/ocsf.jsonl cargo test -p egress-proxy --lib \\
        facts::ocsf::tests::every_record_kind_and_entrance_maps_to_its_class_activity_and_disposition
    python3 tests/ocsf/validate.py /tmp/ocsf.jsonl

Needs tests/ocsf/requirements.txt.
"""

import collections
import json
import sys

import jsonschema
from ocsf_json_schema import OcsfJsonSchema, OcsfJsonSchemaEmbedded, get_ocsf_schema

VERSION = "1.8.0"

# The OCSF 1.9 `attestation` object (profile `record_integrity`), written
# from its published definition (objects/attestation.json: uid,
# authority_uid, chain_uid, fingerprint, prev_event, signatures; at least
# one of fingerprint and signatures), with the fingerprint object as 1.8
# defines it. An event naming `record_integrity` is checked in two parts:
# without the attestation and the profile, as a 1.8.0 event; the
# attestation against this schema.
FINGERPRINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["algorithm_id", "value"],
    "properties": {
        "algorithm": {"type": "string"},
        "algorithm_id": {"type": "integer", "enum": [-1, 0, 1, 2, 3, 4, 5, 6, 7, 99]},
        "value": {"type": "string", "minLength": 1},
    },
}
ATTESTATION = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "uid": {"type": "string"},
        "authority_uid": {"type": "string"},
        "chain_uid": {"type": "string"},
        "fingerprint": FINGERPRINT,
        "prev_event": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"uid": {"type": "string"}, "type_uid": {"type": "integer"}, "fingerprint": FINGERPRINT},
        },
        "signatures": {"type": "array", "items": {"type": "object"}},
    },
    "anyOf": [{"required": ["fingerprint"]}, {"required": ["signatures"]}],
}


class Validator:
    def __init__(self):
        self.raw = get_ocsf_schema(VERSION)
        self.schema = OcsfJsonSchemaEmbedded(OcsfJsonSchema(self.raw))
        self.classes = {c["uid"]: name for name, c in self.raw["classes"].items()}
        self.cache = {}

    def validator(self, name, profiles):
        key = (name, tuple(sorted(profiles)))
        if key not in self.cache:
            schema = self.schema.get_class_schema(name, list(profiles))
            self.cache[key] = jsonschema.Draft202012Validator(schema)
        return self.cache[key]

    def errors(self, event):
        """The problems of one event, as lines of text."""
        if not isinstance(event, dict):
            return ["not a JSON object"]
        class_uid = event.get("class_uid")
        name = self.classes.get(class_uid) if isinstance(class_uid, int) else None
        if name is None:
            return [f"class_uid {class_uid!r} is no class of OCSF {VERSION}"]
        metadata = event.get("metadata") if isinstance(event.get("metadata"), dict) else {}
        profiles = metadata.get("profiles", [])
        if not isinstance(profiles, list) or not all(isinstance(p, str) for p in profiles):
            return [f"metadata.profiles {profiles!r} is not a list of names"]
        out = []
        if "record_integrity" in profiles:
            event = dict(event)
            attestation = event.pop("attestation", None)
            event["metadata"] = dict(metadata, profiles=[p for p in profiles if p != "record_integrity"])
            profiles = event["metadata"]["profiles"]
            if attestation is None:
                out.append("profile record_integrity without an attestation")
            for e in jsonschema.Draft202012Validator(ATTESTATION).iter_errors(attestation or {}):
                where = "/".join(str(p) for p in e.absolute_path)
                out.append(f"attestation/{where}: {e.message}")
        known = set(self.raw["classes"][name].get("profiles") or [])
        for p in profiles:
            if p not in known:
                out.append(f"profile {p!r} is not one of class {name}'s: {sorted(known)}")
        if metadata.get("version") != VERSION:
            out.append(f"metadata.version is {metadata.get('version')!r}, not {VERSION!r}")
        activity = event.get("activity_id")
        if isinstance(activity, int) and event.get("type_uid") != class_uid * 100 + activity:
            out.append(f"type_uid {event.get('type_uid')!r} is not {class_uid} * 100 + {activity}")
        v = self.validator(name, [p for p in profiles if p in known])
        for e in sorted(v.iter_errors(event), key=lambda e: list(e.absolute_path)):
            where = "/".join(str(p) for p in e.absolute_path) or "(event)"
            message = e.message if len(e.message) <= 300 else e.message[:300] + "…"
            out.append(f"{where}: {message}")
        return out


def main(argv):
    if len(argv) > 2:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: validate.py [FILE]", file=sys.stderr)
        return 2
    try:
        source = open(argv[1], encoding="utf-8") if len(argv) == 2 else sys.stdin
    except OSError as e:
        print(f"validate.py: {e}", file=sys.stderr)
        return 2
    checker = Validator()
    classes = collections.Counter()
    events = failed = problems = 0
    with source:
        for n, line in enumerate(source, 1):
            if not line.strip():
                continue
            events += 1
            try:
                event = json.loads(line)
            except json.JSONDecodeError as e:
                failed += 1
                problems += 1
                print(f"line {n}: not JSON: {e}")
                continue
            uid = event.get("metadata", {}).get("uid") if isinstance(event, dict) else None
            label = f"{uid} (line {n})" if uid else f"line {n}"
            errors = checker.errors(event)
            if errors:
                failed += 1
                problems += len(errors)
                for e in errors:
                    print(f"{label}: {e}")
            else:
                classes[event["class_uid"]] += 1
    if events == 0:
        print("no events")
        return 1
    if failed:
        print(f"{failed} of {events} events invalid ({problems} errors)")
        return 1
    by_class = ", ".join(f"{checker.classes[c]} ({c}): {k}" for c, k in sorted(classes.items()))
    print(f"{events} events valid against OCSF {VERSION}: {by_class}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
