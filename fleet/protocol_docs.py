"""The device protocol's generated documents, written from the code that defines it.

``python -m fleet.protocol_docs`` (re)writes, under ``docs/protocol/``:

- ``schemas/<Model>.json``: JSON Schema (2020-12) of every message and object of ``edge_agent.wire``;
- ``asyncapi.json``: an AsyncAPI 3.0 document of the agent socket (the messages each way, their schemas);
- ``reference.md``: every message's fields (type, bounds, meaning), every code a device can be sent
  (``edge_agent.codes``) and every limit with its setting and default;
- ``vectors/``: test vectors (``fleet.protocol_vectors``): fixed keys, signed objects, delta files.

``--check`` writes nothing and exits 1 naming each file that differs from what the code gives;
``tests/protocol/test_documents.py`` runs it, so the documents cannot drift from the code. Needs no database.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic.json_schema import models_json_schema

from core.bounded_json import MAX_JSON_DEPTH
from edge_agent import protocol, wire
from edge_agent.codes import CODES

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "protocol"
JSON_SCHEMA = "https://json-schema.org/draft/2020-12/schema"


@dataclass(frozen=True)
class Limit:
    name: str
    default: Any
    unit: str
    meaning: str
    setting: str = ""  # the server setting (environment variable) that changes it; empty: fixed by the protocol


# Every limit and default a device meets. tests/protocol/test_documents.py checks each setting's default here
# against fleet/settings.py, and the fixed ones are read from edge_agent.protocol.
LIMITS: tuple[Limit, ...] = (
    Limit("text frame before the hello", protocol.MAX_MESSAGE_BYTES_BEFORE_AUTH, "bytes (UTF-8)", "larger: 4413"),
    Limit("text frame after the hello", protocol.MAX_MESSAGE_BYTES, "bytes (UTF-8)", "larger: 4413"),
    Limit("binary chunk frame", protocol.MAX_BINARY_MESSAGE_BYTES, "bytes", "FPD1 + 2 + header (<= 256) + 512 KiB"),
    Limit(
        "JSON nesting",
        MAX_JSON_DEPTH,
        "levels",
        "arrays and objects, the message itself one; deeper: malformed (4400), REST 400 json_too_deep",
    ),
    Limit("raw bytes in a text delta_chunk", protocol.DELTA_CHUNK_BYTES, "bytes", "before base64url"),
    Limit("hello deadline", protocol.HELLO_TIMEOUT_SECONDS, "seconds", "after the challenge; then 4408"),
    Limit(
        "heartbeat interval",
        30,
        "seconds",
        "sent in welcome; heartbeat every interval ± 10 %",
        "HEARTBEAT_INTERVAL_SECONDS",
    ),
    Limit(
        "heartbeat spacing",
        50,
        "% of the interval",
        "a sooner heartbeat is acknowledged, not recorded",
        "HEARTBEAT_MIN_SPACING_PERCENT",
    ),
    Limit("early heartbeats in a row", 10, "heartbeats", "then close 4429 too_chatty", "HEARTBEAT_EARLY_LIMIT"),
    Limit(
        "offline after silence",
        95,
        "seconds",
        "the server marks a silent device offline",
        "DEVICE_OFFLINE_AFTER_SECONDS",
    ),
    Limit("device token lifetime", 900, "seconds", "REST Device tokens", "DEVICE_TOKEN_TTL_SECONDS"),
    Limit("REST challenge lifetime", 60, "seconds", "a nonce works once, within this time"),
    Limit(
        "delta size", 64 * 1024 * 1024, "bytes", "declared size or bytes sent above it: too_large", "DELTA_MAX_BYTES"
    ),
    Limit("unfinished uploads per device", 4, "uploads", "a fifth begin: too_many_uploads (abort one)"),
    Limit(
        "delta_begin per device", 30, "per minute", "more: too_many_begins with retry_after", "DELTA_BEGINS_PER_MINUTE"
    ),
    Limit(
        "rejected deltas per device",
        20,
        "per hour",
        "then begins are refused: too_many_rejections",
        "DELTA_REJECTIONS_PER_HOUR",
    ),
    Limit(
        "created_at before the server's clock",
        30 * 86400,
        "seconds",
        "older: bad_created_at",
        "DELTA_CREATED_AT_MAX_AGE_SECONDS",
    ),
    Limit(
        "created_at ahead of the server's clock",
        300,
        "seconds",
        "further ahead: bad_created_at",
        "DELTA_CREATED_AT_MAX_AHEAD_SECONDS",
    ),
    Limit("metrics in delta_begin", protocol.MAX_DELTA_METRICS, "entries", "more: malformed_metrics"),
    Limit(
        "delta_result re-sent for",
        7,
        "days",
        "results of deltas received earlier are not re-sent",
        "DELTA_RESULT_RESEND_DAYS",
    ),
    Limit(
        "unfinished upload expiry",
        6 * 3600,
        "seconds",
        "a staged upload no chunk reached is discarded",
        "DELTA_STAGED_EXPIRY_SECONDS",
    ),
    Limit(
        "protocol 1 accepted until",
        "2027-06-30",
        "date (UTC, end of day)",
        "afterwards protocol 2 only",
        "PROTOCOL_1_ACCEPTED_UNTIL",
    ),
)


def _typed(schema: dict) -> dict:
    """A message's ``type`` has a default in the model (so code need not repeat it) but is required on the wire;
    so is a signed object's ``purpose``."""
    for name in ("type", "purpose"):
        if name in schema.get("properties", {}) and "const" in schema["properties"][name]:
            schema["properties"][name].pop("default", None)
            schema["required"] = [name, *(r for r in schema.get("required", []) if r != name)]
    for nested in schema.get("$defs", {}).values():
        _typed(nested)
    return schema


def _schemas() -> dict[str, dict]:
    """Each model's own JSON Schema document (its nested models under ``$defs``)."""
    out = {}
    for model in _all_models():
        schema = _typed(model.model_json_schema(by_alias=True))
        out[model.__name__] = {"$schema": JSON_SCHEMA, "$id": f"{model.__name__}.json", **schema}
    return out


def _all_models():
    return (*wire.SOCKET_AGENT_MESSAGES, *wire.SOCKET_SERVER_MESSAGES, *wire.SIGNED_OBJECTS, *wire.REST_PAYLOADS,
            *wire.OTHER_OBJECTS)  # fmt: skip


@functools.cache
def components() -> dict[str, dict]:
    return _components()


def _components() -> dict[str, dict]:
    _, defs = models_json_schema(
        [(model, "validation") for model in _all_models()],
        by_alias=True,
        ref_template="#/components/schemas/{model}",
    )
    return {name: _typed(schema) for name, schema in defs["$defs"].items()}


def asyncapi() -> dict:
    """The agent socket as an AsyncAPI 3.0 document, from the server's side: it receives what agents send."""
    messages = {}
    for model in (*wire.SOCKET_AGENT_MESSAGES, *wire.SOCKET_SERVER_MESSAGES):
        doc = (model.__doc__ or "").strip()
        messages[model.__name__] = {
            "name": model.__name__,
            "title": model.model_fields["type"].default
            + (f" ({model.model_fields['command'].annotation.__args__[0]})" if "command" in model.model_fields else ""),
            **({"summary": doc.splitlines()[0]} if doc else {}),
            "contentType": "application/json",
            "payload": {"$ref": f"#/components/schemas/{model.__name__}"},
        }
    messages["DeltaChunkFrame"] = {
        "name": "DeltaChunkFrame",
        "title": "delta chunk (binary frame)",
        "summary": "FPD1, the header's length (2 bytes, big-endian), the ChunkFrameHeader JSON, then the raw bytes",
        "contentType": "application/octet-stream",
        "payload": {"type": "string", "format": "binary", "maxLength": protocol.MAX_BINARY_MESSAGE_BYTES},
    }
    agent_sends = [*(m.__name__ for m in wire.SOCKET_AGENT_MESSAGES), "DeltaChunkFrame"]
    server_sends = [m.__name__ for m in wire.SOCKET_SERVER_MESSAGES]
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "Fleet personalization manager: the device protocol",
            "version": str(protocol.PROTOCOL_VERSION),
            "description": "The agent socket. Generated by `python -m fleet.protocol_docs` from edge_agent/wire.py; "
            "the specification is docs/protocol/README.md.",
        },
        "defaultContentType": "application/json",
        "servers": {
            "fleet": {"host": "localhost:8000", "protocol": "ws", "description": "wss in production (TLS)"},
        },
        "channels": {
            "agent": {
                "address": protocol.AGENT_WS_PATH,
                "servers": [{"$ref": "#/servers/fleet"}],
                "messages": {name: {"$ref": f"#/components/messages/{name}"} for name in messages},
            }
        },
        "operations": {
            "receiveFromAgent": {
                "action": "receive",
                "channel": {"$ref": "#/channels/agent"},
                "summary": "What a device sends after the challenge (the hello first)",
                "messages": [{"$ref": f"#/channels/agent/messages/{name}"} for name in agent_sends],
            },
            "sendToAgent": {
                "action": "send",
                "channel": {"$ref": "#/channels/agent"},
                "summary": "What the server sends (the challenge first)",
                "messages": [{"$ref": f"#/channels/agent/messages/{name}"} for name in server_sends],
            },
        },
        "components": {"messages": messages, "schemas": _components()},
    }


# --- reference.md -------------------------------------------------------------------------------------------


def _type_of(schema: dict | bool) -> str:
    if schema is True or schema == {}:
        return "any"
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return f"[{name}](#{name.lower()})"
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if "anyOf" in schema:
        return " \\| ".join(_type_of(s) for s in schema["anyOf"])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"array of {_type_of(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema:
        keys = schema.get("propertyNames", {})
        return f"object: {_type_of(keys) if keys else 'string'} → {_type_of(schema['additionalProperties'])}"
    return {"number": "number", "integer": "integer", "string": "string", "boolean": "boolean", "null": "null",
            "object": "object"}.get(kind, kind)  # fmt: skip


def _bounds(schema: dict) -> str:
    parts = []
    for sub in [schema, *schema.get("anyOf", [])]:
        for key, word in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<"),
                          ("minLength", "length ≥"), ("maxLength", "length ≤"), ("maxProperties", "entries ≤"),
                          ("pattern", "pattern")):  # fmt: skip
            if key in sub:
                value = f"`{sub[key]}`" if key == "pattern" else sub[key]
                parts.append(f"{word} {value}")
        keys = sub.get("propertyNames", {})
        if "pattern" in keys:
            parts.append(f"names: `{keys['pattern']}`")
    return ", ".join(parts)


def field_rows(schema: dict) -> list[tuple[str, str, str, str, str]]:
    """A model's fields as (name, type, required, bounds, meaning), types written as ``reference.md`` writes them."""
    required = set(schema.get("required", []))
    rows = []
    for name, prop in schema.get("properties", {}).items():
        default = ""
        if name not in required and "default" in prop:
            default = f" (default `{json.dumps(prop['default'])}`)"
        needed = "yes" if name in required else "no" + default
        rows.append((name, _type_of(prop), needed, _bounds(prop), " ".join((prop.get("description") or "").split())))
    return rows


def _fields_table(schema: dict) -> list[str]:
    lines = ["| field | type | required | bounds | meaning |", "| --- | --- | --- | --- | --- |"]
    for name, kind, needed, bounds, meaning in field_rows(schema):
        bounds, meaning = bounds.replace("|", "\\|"), meaning.replace("|", "\\|")
        lines.append(f"| `{name}` | {kind} | {needed} | {bounds} | {meaning} |")
    return lines


def message_groups() -> tuple[tuple[str, tuple], ...]:
    return (
        ("Socket: agent → server", wire.SOCKET_AGENT_MESSAGES),
        ("Socket: server → agent", wire.SOCKET_SERVER_MESSAGES),
        ("Signed objects", wire.SIGNED_OBJECTS),
        ("REST payloads of devices", wire.REST_PAYLOADS),
        ("Other objects", wire.OTHER_OBJECTS),
    )


def reference() -> str:
    components = _components()
    out = [
        "# Device protocol reference (generated)",
        "",
        "Generated by `python -m fleet.protocol_docs` from `edge_agent/wire.py`, `edge_agent/codes.py` and",
        "`fleet/protocol_docs.py`; do not edit by hand (`tests/protocol/test_documents.py` fails when it differs).",
        "The specification that explains it is [README.md](README.md). Every model is also a JSON Schema in",
        "[schemas/](schemas/) and the socket an AsyncAPI 3 document, [asyncapi.json](asyncapi.json).",
        "",
        "Numbers: an `integer` is a JSON number without fraction or exponent, within ±(2^53 − 1); `true`/`false`",
        "are never numbers. Transport messages ignore fields they do not define; signed device objects refuse them.",
        "",
    ]
    shown = set()
    for title, models in message_groups():
        out += [f"## {title}", ""]
        for model in models:
            shown.add(model.__name__)
            out += _model_section(model.__name__, components[model.__name__])
    nested = [name for name in components if name not in shown]
    if nested:
        out += ["## Nested objects", ""]
        for name in nested:
            out += _model_section(name, components[name])
    out += ["## Codes", "",
            "What each code means and what a device does about it (retry: the same again with backoff; fix: the",
            "request is wrong; wait: retry_after or the slowest backoff; give up: drop the delta or manifest).", "",
            "| code | how it arrives | meaning | the device should |", "| --- | --- | --- | --- |"]  # fmt: skip
    for code in CODES:
        action = code.action + (f": {code.detail}" if code.detail else "")
        out.append(f"| `{code.code}` | {code.where} | {code.meaning} | {action} |")
    out += ["", "## Limits and defaults", "", "| limit | default | unit | what happens | server setting |",
            "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for limit in LIMITS:
        setting = f"`{limit.setting}`" if limit.setting else "fixed"
        out.append(f"| {limit.name} | {limit.default} | {limit.unit} | {limit.meaning} | {setting} |")
    return "\n".join(out) + "\n"


def _model_section(name: str, schema: dict) -> list[str]:
    lines = [f"### {name}", ""]
    if schema.get("description"):
        lines += [" ".join(schema["description"].split()), ""]
    if schema.get("additionalProperties") is False:
        lines += ["Any field not listed is refused.", ""]
    return lines + _fields_table(schema) + [""]


# --- writing and checking -----------------------------------------------------------------------------------


def _dump(data: Any) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False, sort_keys=False) + "\n"


def documents() -> dict[Path, bytes]:
    """Every generated file, by path, as the code gives it now."""
    from fleet.protocol_vectors import vector_files  # torch and safetensors: only when vectors are written

    files: dict[Path, bytes] = {}
    for name, schema in _schemas().items():
        files[DOCS / "schemas" / f"{name}.json"] = _dump(schema).encode()
    files[DOCS / "asyncapi.json"] = _dump(asyncapi()).encode()
    files[DOCS / "reference.md"] = reference().encode()
    for name, data in vector_files().items():
        files[DOCS / "vectors" / name] = data
    return files


def stale(files: dict[Path, bytes] | None = None) -> list[str]:
    """The generated files that are missing or differ on disk, and files in the generated folders that the code
    no longer makes."""
    files = documents() if files is None else files
    wrong = [
        str(path.relative_to(ROOT)) for path, data in files.items() if not path.exists() or path.read_bytes() != data
    ]
    for folder in (DOCS / "schemas", DOCS / "vectors"):
        if folder.is_dir():
            wrong += [str(path.relative_to(ROOT)) for path in folder.iterdir() if path not in files]
    return sorted(wrong)


def write() -> list[str]:
    files = documents()
    changed = stale(files)
    for folder in (DOCS / "schemas", DOCS / "vectors"):
        if folder.is_dir():
            for path in folder.iterdir():
                if path not in files:
                    path.unlink()
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated file is stale")
    args = parser.parse_args(argv)
    if args.check:
        wrong = stale()
        for path in wrong:
            print(f"stale: {path}", file=sys.stderr)
        if wrong:
            print("run `python -m fleet.protocol_docs` and commit the result", file=sys.stderr)
        return 1 if wrong else 0
    changed = write()
    print(f"{len(changed)} file(s) written under {DOCS.relative_to(ROOT)}" + "".join(f"\n  {p}" for p in changed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
