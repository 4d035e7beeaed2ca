"""The device protocol's conformance suite (conformance/) against a real uvicorn and a real Celery worker on the
test database, with the reference client written from docs/protocol alone and with our own agent's functions;
that conformance/ stands apart from the product; and that the reference client reproduces the test vectors."""

from __future__ import annotations

import ast
import base64
import hashlib
import json
from pathlib import Path

import pytest

from accounts.services import api_token_create
from conformance.__main__ import main
from conformance.client import ReferenceClient, canonical
from conformance.operator import RestOperator
from conformance.suite import run
from tests.asgi_server import asgi_server
from tests.conftest import ROOT
from tests.protocol.agent_client import AgentClient

VECTORS = ROOT / "docs" / "protocol" / "vectors"
ALLOWED_IMPORTS = {"conformance", "cryptography", "websockets", "jsonschema", "rfc8785"}


def _vector(name: str) -> dict:
    return json.loads((VECTORS / name).read_text())


def _vector_client() -> ReferenceClient:
    return ReferenceClient.from_seed(bytes.fromhex(_vector("keys.json")["fleet vector: device"]["seed_hex"]))


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker, tmp_path_factory, shared_blob_root):
    """uvicorn writing blobs where the Celery worker reads them, so the worker verifies what it received."""
    with asgi_server("conformance", tmp_path_factory.mktemp("conformance"), BLOB_ROOT=str(shared_blob_root)) as s:
        yield s


@pytest.mark.e2e
@pytest.mark.parametrize("client_class", [ReferenceClient, AgentClient], ids=["reference", "agent"])
def test_the_conformance_suite_passes_against_a_live_server(
    client_class, server, celery_worker_process, transactional_db, make_user
):
    token = api_token_create(user=make_user("admin"), name="conformance").raw
    lines: list[str] = []
    results = run(server.url, client_class, RestOperator(server.url, token), chunk_size=0, out=lines.append)
    print("\n".join(lines))
    failed = {r.step: str(r) for r in results if r.status != "PASS"}
    assert not failed, "\n".join(failed.values()) + f"\n(server log: {server.log_path})"
    assert len(results) >= 19


def test_conformance_imports_nothing_of_the_product():
    stdlib = set(__import__("sys").stdlib_module_names)
    for path in sorted((ROOT / "conformance").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path.name}: a relative import"
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in stdlib or top in ALLOWED_IMPORTS, f"{path.relative_to(ROOT)} imports {name}"


def test_the_reference_client_reproduces_the_vectors():
    client = _vector_client()
    keys = _vector("keys.json")
    assert client.public_key() == keys["fleet vector: device"]["public_key"]

    hello = _vector("hello.json")
    assert canonical(hello["payload"]).decode() == hello["canonical"]
    built = client.hello(nonce=hello["challenge"]["nonce"], device_id=hello["payload"]["device_id"])
    assert built["signature"] == hello["signature"] == hello["hello"]["signature"]
    assert {k: built[k] for k in ("type", "device_id", "signature", "protocol")} == {
        k: hello["hello"][k] for k in ("type", "device_id", "signature", "protocol")
    }

    token = _vector("token.json")
    assert canonical(token["payload"]).decode() == token["canonical"]
    assert (
        client.token_request(nonce=token["payload"]["nonce"], device_id=token["payload"]["device_id"])
        == (token["request"])
    )

    for case in _vector("canonical.json")["cases"]:
        assert canonical(case["value"]).decode() == case["protocol_2"]

    f32 = next(d for d in _vector("deltas.json")["deltas"] if d["file"] == "delta-f32.safetensors")
    tensors = {
        name: ([len(rows), len(rows[0])], [value for row in rows for value in row])
        for name, rows in f32["decoded_values"].items()
    }
    data = client.build_delta(tensors)
    assert data == (VECTORS / "delta-f32.safetensors").read_bytes()
    assert hashlib.sha256(data).hexdigest() == f32["sha256"] and len(data) == f32["size"]
    envelope = f32["envelope"]
    signed = client.delta_upload(
        data,
        **{k: envelope[k] for k in ("device_id", "adapter", "base_version", "num_samples", "counter", "created_at")},
    )
    assert signed == {"envelope": envelope, "signature": f32["signature"]}
    assert canonical(envelope).decode() == f32["canonical"]
    frame = client.chunk_frame(sha256=f32["sha256"], offset=0, data=data[:64])
    assert frame.hex() == f32["chunk_frame_hex"]

    manifest = _vector("manifest.json")
    assert canonical(manifest["manifest"]).decode() == manifest["canonical"]
    pinned = keys["fleet vector: server 1"]["public_key"]
    assert client.verify_manifest(manifest["envelope"], pinned_key=pinned) == manifest["manifest"]
    tampered = {**manifest["envelope"], "manifest": {**manifest["manifest"], "version": 4}}
    with pytest.raises(Exception, match="bad_signature"):
        client.verify_manifest(tampered, pinned_key=pinned)
    broken = json.loads(json.dumps(manifest["envelope"]))
    broken["key_rotations"][0]["new_signature"] = base64.urlsafe_b64encode(bytes(64)).rstrip(b"=").decode()
    with pytest.raises(Exception, match="bad_key_rotation"):
        client.verify_manifest(broken, pinned_key=pinned)


def test_our_agent_client_reproduces_the_same_vectors():
    """The adapter around our agent is held to the same bytes, so the two parametrizations test the same thing."""
    seed = bytes.fromhex(_vector("keys.json")["fleet vector: device"]["seed_hex"])
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    ours, reference = AgentClient(Ed25519PrivateKey.from_private_bytes(seed)), _vector_client()
    hello = _vector("hello.json")["payload"]
    assert (
        ours.hello(nonce=hello["nonce"], device_id=hello["device_id"])["signature"]
        == (reference.hello(nonce=hello["nonce"], device_id=hello["device_id"])["signature"])
    )
    f32 = next(d for d in _vector("deltas.json")["deltas"] if d["file"] == "delta-f32.safetensors")
    tensors = {
        name: ([len(rows), len(rows[0])], [value for row in rows for value in row])
        for name, rows in f32["decoded_values"].items()
    }
    assert ours.build_delta(tensors) == reference.build_delta(tensors) == Path(VECTORS / f32["file"]).read_bytes()


@pytest.mark.e2e
def test_the_command_line_runs_the_suite_and_exits_1_on_a_failure(
    server, celery_worker_process, transactional_db, make_user, capsys
):
    token = api_token_create(user=make_user("admin"), name="conformance").raw
    code = main(["--server", server.url, "--operator-token", token, "--chunk-size", "2000"])
    out = capsys.readouterr().out
    assert "PASS delta_binary" in out and "PASS delta_text" in out
    assert code == 0, out
    # An operator token the server does not know: the operator's steps fail, and so does the run.
    assert main(["--server", server.url, "--operator-token", "fpm_not-a-token"]) == 1
    assert "FAIL" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--server", server.url, "--operator-token", ""])
