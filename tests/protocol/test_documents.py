"""The protocol's documents stay true: the generated ones match the code, every code the server can send is
documented, every limit's default is the setting's, and the test vectors verify with an independent RFC 8785
implementation and plain Ed25519."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from pathlib import Path

import jsonschema
import pytest
import rfc8785
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from devices.api import serializers as device_serializers
from edge_agent import wire
from edge_agent.codes import CODES
from fleet import protocol_docs
from fleet.protocol_docs import DOCS, LIMITS, ROOT
from training.api.rollout_serializers import AssignmentReportSerializer

VECTORS = DOCS / "vectors"


def _b64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _vector(name: str) -> dict:
    return json.loads((VECTORS / name).read_text())


def test_the_generated_documents_are_what_the_code_gives():
    assert protocol_docs.stale() == [], "run `python -m fleet.protocol_docs` and commit the result"


def test_the_check_command_names_a_stale_file(tmp_path, monkeypatch, capsys):
    copy = tmp_path / "protocol"
    monkeypatch.setattr(protocol_docs, "DOCS", copy)
    monkeypatch.setattr(protocol_docs, "ROOT", tmp_path)
    assert protocol_docs.main([]) == 0
    assert protocol_docs.main(["--check"]) == 0
    (copy / "reference.md").write_text("edited by hand\n")
    (copy / "schemas" / "Gone.json").write_text("{}")
    assert protocol_docs.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "protocol/reference.md" in err and "protocol/schemas/Gone.json" in err


# Where the server and the agent name the codes they send: the first string argument of these.
_CODE_SITES = re.compile(
    r"(?:\bRejection|\bUpload[A-Z]\w*|\bDevice[A-Z]\w*|\bManifestRefused|\bEnrollment[A-Z]\w*)\(\s*\"([a-z_]+)\""
    r"|(?:refuse|Refused)\(\s*CloseCode\.\w+,\s*\"([a-z_]+)\""
    r"|rejection_code=\"([a-z_]+)\""
    r"|Verdict\(\s*Delta\.State\.REJECTED,\s*\"([a-z_]+)\""
    r"|DeviceStatus\.\w+:\s*\(\s*\"([a-z_]+)\""
)


def _codes_in_source() -> set[str]:
    found = set()
    for folder in ("devices", "training", "edge_agent"):
        for path in (ROOT / folder).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            for match in _CODE_SITES.finditer(path.read_text()):
                found.add(next(group for group in match.groups() if group))
    return found


def test_every_code_a_device_can_be_sent_is_documented_with_what_to_do():
    documented = {code.code for code in CODES}
    in_source = _codes_in_source()
    assert len(in_source) > 25, in_source  # the scan itself works
    enrollment = {code for code in in_source if code.startswith(("enrollment_", "invalid_public", "device_key"))}
    assert in_source - enrollment - documented == set()
    # The codes a team once had to discover from the server one by one.
    assert {
        "device_not_active", "unknown_adapter", "wrong_cohort", "unknown_base_version", "stale_base_version",
        "header_too_large", "spec_mismatch", "not_finite", "norm_too_large", "replayed_counter",
        "verification_failed", "hello_timeout", "auth_failed",
    } <= documented  # fmt: skip
    reference = (DOCS / "reference.md").read_text()
    for code in CODES:
        assert code.action in {"retry", "fix", "wait", "give up", "re-enroll", "stop", "upgrade"}
        assert f"| `{code.code}` |" in reference


@pytest.mark.parametrize("limit", [limit for limit in LIMITS if limit.setting], ids=lambda limit: limit.setting)
def test_each_limit_s_documented_default_is_the_setting_s(limit):
    if limit.setting in os.environ:
        pytest.skip(f"{limit.setting} is set in this environment")
    from fleet import settings as project_settings  # the values as the environment made them, before any test

    assert getattr(project_settings, limit.setting) == limit.default


def test_each_message_schema_accepts_its_vector_and_refuses_a_wrong_field():
    hello = _vector("hello.json")
    deltas = _vector("deltas.json")["deltas"]
    cases = [
        ("Challenge", hello["challenge"]),
        ("Hello", hello["hello"]),
        ("HelloPayload", hello["payload"]),
        ("TokenPayload", _vector("token.json")["payload"]),
        ("DeviceTokenRequest", _vector("token.json")["request"]),
        ("ManifestEnvelope", _vector("manifest.json")["envelope"]),
        *(("DeltaBegin", delta["delta_begin"]) for delta in deltas),
        *(("DeltaEnvelope", delta["envelope"]) for delta in deltas),
    ]
    for name, instance in cases:
        schema = json.loads((DOCS / "schemas" / f"{name}.json").read_text())
        jsonschema.Draft202012Validator(schema).validate(instance)
        getattr(wire, name).model_validate(instance)  # the model agrees with its schema
    envelope = json.loads((DOCS / "schemas" / "DeltaEnvelope.json").read_text())
    for wrong in ({"counter": -1}, {"counter": 1.5}, {"size": True}, {"sha256": "ABC"}, {"extra": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft202012Validator(envelope).validate({**deltas[0]["envelope"], **wrong})
        with pytest.raises(ValueError, match="envelope"):
            wire.validated(wire.DeltaEnvelope, {**deltas[0]["envelope"], **wrong}, what="envelope")


def test_every_reference_in_the_asyncapi_document_resolves():
    document = json.loads((DOCS / "asyncapi.json").read_text())
    assert document["asyncapi"] == "3.0.0"

    def refs(node):
        if isinstance(node, dict):
            if "$ref" in node:
                yield node["$ref"]
            for value in node.values():
                yield from refs(value)
        elif isinstance(node, list):
            for value in node:
                yield from refs(value)

    seen = 0
    for ref in refs(document):
        target = document
        for part in ref.removeprefix("#/").split("/"):
            target = target[part]
        seen += 1
    assert seen > 50
    agent_sends = {ref["$ref"].rsplit("/", 1)[1] for ref in document["operations"]["receiveFromAgent"]["messages"]}
    assert {"Hello", "Heartbeat", "Ack", "DeltaBegin", "DeltaChunk", "DeltaAbort", "DeltaChunkFrame"} == agent_sends


def test_the_vectors_verify_with_an_independent_canonical_form_and_plain_ed25519():
    keys = _vector("keys.json")
    for label, key in keys.items():  # the published seeds give the published keys
        private = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(key["seed_hex"]))
        assert hashlib.sha256(label.encode()).hexdigest() == key["seed_hex"]
        assert (
            base64.urlsafe_b64encode(private.public_key().public_bytes_raw()).rstrip(b"=").decode() == key["public_key"]
        )

    def check(signed: dict, payload: dict, signer: str):
        assert rfc8785.dumps(payload) == signed["canonical"].encode()
        public = Ed25519PublicKey.from_public_bytes(_b64(keys[signer]["public_key"]))
        public.verify(_b64(signed["signature"]), signed["canonical"].encode())

    hello = _vector("hello.json")
    check(hello, hello["payload"], "fleet vector: device")
    legacy = hello["protocol_1"]
    Ed25519PublicKey.from_public_bytes(_b64(keys["fleet vector: device"]["public_key"])).verify(
        _b64(legacy["signature"]), legacy["canonical"].encode()
    )
    token = _vector("token.json")
    check(token, token["payload"], "fleet vector: device")
    manifest = _vector("manifest.json")
    check(manifest, manifest["manifest"], "fleet vector: server 2")
    assert manifest["canonical"] != manifest["protocol_1"]["canonical"]  # 8.0 is written 8 in RFC 8785
    link = manifest["envelope"]["key_rotations"][0]
    for signature, signer in (
        (link["signature"], "fleet vector: server 1"),
        (link["new_signature"], "fleet vector: server 2"),
    ):
        Ed25519PublicKey.from_public_bytes(_b64(keys[signer]["public_key"])).verify(
            _b64(signature), rfc8785.dumps(link["statement"])
        )
    for case in _vector("canonical.json")["cases"]:
        assert rfc8785.dumps(case["value"]).decode() == case["protocol_2"]
    for delta in _vector("deltas.json")["deltas"]:
        data = (VECTORS / delta["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == delta["sha256"] == delta["envelope"]["sha256"]
        assert len(data) == delta["size"] == delta["envelope"]["size"]
        check(delta, delta["envelope"], "fleet vector: device")
        frame = bytes.fromhex(delta["chunk_frame_hex"])
        header_size = int.from_bytes(frame[4:6], "big")
        assert frame[:4] == b"FPD1" and frame[6 + header_size :] == data[:64]
        assert json.loads(frame[6 : 6 + header_size]) == {"offset": 0, "sha256": delta["sha256"]}


def test_the_specification_links_what_it_names():
    spec = (DOCS / "README.md").read_text()
    for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", spec):
        assert (DOCS / link).exists() or (ROOT / link).exists(), link
    for name in ("reference.md", "asyncapi.json", "vectors/", "schemas/"):
        assert name in spec
    assert Path(ROOT / "edge_agent" / "PROTOCOL.md").read_text().count("docs/protocol/README.md") >= 1


def test_the_rest_serializers_and_the_protocol_models_describe_the_same_device_payloads():
    """The REST views validate with DRF serializers (the OpenAPI schema comes from them); the protocol's models
    must name the same fields, each required on both sides or on neither."""
    pairs = [
        (device_serializers.EnrollRequestSerializer, wire.EnrollRequest),
        (device_serializers.EnrollResponseSerializer, wire.EnrollResponse),
        (device_serializers.ChallengeRequestSerializer, wire.DeviceChallengeRequest),
        (device_serializers.ChallengeResponseSerializer, wire.DeviceChallenge),
        (device_serializers.TokenRequestSerializer, wire.DeviceTokenRequest),
        (device_serializers.TokenResponseSerializer, wire.DeviceToken),
        (device_serializers.DeviceHeartbeatSerializer, wire.HeartbeatState),
        (device_serializers.HeartbeatPersonalSerializer, wire.Personal),
        (AssignmentReportSerializer, wire.AssignmentReport),
    ]
    for serializer_class, model in pairs:
        fields = serializer_class().fields
        schema = model.model_json_schema(by_alias=True)
        assert set(fields) == set(schema["properties"]), (serializer_class.__name__, model.__name__)
        required = {name for name, field in fields.items() if field.required}
        if serializer_class.__name__.endswith(("Response", "ResponseSerializer")):
            continue  # what the server answers: every field is there
        assert required == set(schema.get("required", [])), (serializer_class.__name__, model.__name__)


@pytest.mark.django_db
def test_the_server_serves_the_protocol_beside_the_rest_api(client):
    served = client.get("/api/protocol/asyncapi.json")
    assert served.status_code == 200 and served["Content-Type"].startswith("application/json")
    assert served.json() == json.loads((DOCS / "asyncapi.json").read_text())
    page = client.get("/api/docs/protocol/")
    assert page.status_code == 200
    html = page.content.decode()
    for name in ("Hello", "DeltaBegin", "DeltaEnvelope", "ManifestEnvelope", "AssignmentReport"):
        assert f'id="{name.lower()}"' in html
    assert '<td data-label="field"><code>counter</code></td>' in html and "9007199254740991" in html  # and bounds
    assert 'href="/api/protocol/asyncapi.json"' in html and 'href="/api/docs/"' in html


@pytest.mark.django_db
def test_the_protocol_page_reads_as_a_dashboard_page_with_plain_types_and_identifiers_that_wrap_whole(
    client, django_user_model
):
    html = client.get("/api/docs/protocol/").content.decode()
    assert "\\|" not in html  # a markdown table's escape is no part of an HTML cell
    assert re.search(r'<td data-label="type"><code>1</code> \| <code>2</code></td>', html)  # "1 | 2"
    assert "<code>device_<wbr>id</code>" in html  # wraps at the underscore if it must, never inside "id"
    assert '<link rel="stylesheet" href="/static/frontend/app.css">' in html and 'class="topbar"' in html
    assert 'aria-label="main"' not in html  # the navigation is for the signed-in
    user = django_user_model.objects.create_user("reader", password="x" * 12)
    client.force_login(user)
    signed_in = client.get("/api/docs/protocol/").content.decode()
    assert 'aria-label="main"' in signed_in and 'href="/api/docs/" aria-current="page"' in signed_in
