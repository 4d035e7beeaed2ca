"""Base models, adapters and versions: artifacts by hash, exact specs, PEFT in and out."""

import hashlib
import io
import json
import struct
import zipfile

import pytest
import torch
from django.core.files.uploadedfile import SimpleUploadedFile
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from training.models import AdapterVersion, BaseModel, TrainingEvent
from training.registry.blobs import blob_read
from training.registry.services import build_base, version_create_seeded, version_export_peft


@pytest.mark.django_db
def test_adapter_spec_has_peft_names_and_shapes_from_the_base(adapter):
    assert adapter.target_modules == ["conv1", "conv2", "fc1"] and adapter.modules_to_save == ["head"]
    assert adapter.tensor_spec["base_model.model.conv1.lora_A.weight"] == {"shape": [4, 1, 3, 3], "dtype": "F32"}
    assert adapter.tensor_spec["base_model.model.fc1.lora_A.weight"] == {"shape": [4, 128], "dtype": "F32"}
    assert adapter.tensor_spec["base_model.model.conv2.lora_B.weight"] == {"shape": [32, 4, 1, 1], "dtype": "F32"}
    assert adapter.tensor_spec["base_model.model.head.bias"] == {"shape": [10], "dtype": "F32"}


@pytest.mark.django_db
def test_seeded_versions_are_deterministic_numbered_and_stored_by_hash(adapter):
    first = version_create_seeded(adapter=adapter, seed=7)
    again = version_create_seeded(adapter=adapter, seed=7)
    other = version_create_seeded(adapter=adapter, seed=8)
    assert [first.number, again.number, other.number] == [1, 2, 3]
    assert first.blob_sha256 == again.blob_sha256 != other.blob_sha256
    stored = blob_read(first.blob_sha256)  # stored under its own hash: the bytes read back hash to the name
    assert hashlib.sha256(stored).hexdigest() == first.blob_sha256 and len(stored) == first.size
    tensors = load_safetensors(stored)
    assert set(tensors) == set(adapter.tensor_spec)
    assert torch.count_nonzero(tensors["base_model.model.fc1.lora_B.weight"]) == 0  # adapted model == base
    base_head = build_base(adapter.base_model).head.weight
    assert torch.equal(tensors["base_model.model.head.weight"], base_head)
    assert TrainingEvent.objects.filter(kind="version.created").count() == 3


@pytest.mark.django_db
def test_an_exported_version_loads_with_peft_on_the_real_model(adapter):
    peft = pytest.importorskip("peft")
    version = version_create_seeded(adapter=adapter, seed=3)
    tensors = load_safetensors(blob_read(version.blob_sha256))
    # Make B non-zero so loading it visibly changes the model.
    tensors["base_model.model.fc1.lora_B.weight"] = torch.full((64, 4), 0.05)
    from training.registry.services import version_import

    changed = version_import(adapter=adapter, data=save_safetensors(tensors))
    archive = zipfile.ZipFile(io.BytesIO(version_export_peft(changed)))
    assert sorted(archive.namelist()) == ["adapter_config.json", "adapter_model.safetensors"]

    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        archive.extractall(folder)
        base = build_base(adapter.base_model)
        reference = build_base(adapter.base_model)
        model = peft.PeftModel.from_pretrained(base, folder)
        model.eval()
        loaded = dict(model.named_parameters())
        key = "base_model.model.fc1.lora_B.default.weight"
        assert torch.equal(loaded[key], tensors["base_model.model.fc1.lora_B.weight"])
        x = torch.randn(5, 1, 8, 8)
        with torch.no_grad():
            assert not torch.allclose(model(x), reference(x))  # the adapter is really applied
            merged = model.merge_and_unload()
            assert torch.allclose(merged(x), model(x), atol=1e-5)


def _import(client, adapter, data: bytes, config: dict | None = None):
    files = {"adapter_model": SimpleUploadedFile("adapter_model.safetensors", data)}
    if config is not None:
        files["adapter_config"] = SimpleUploadedFile("adapter_config.json", json.dumps(config).encode())
    return client.post(f"/api/v1/adapters/{adapter.pk}/versions/import/", files, format="multipart")


def _good_tensors(adapter) -> dict:
    return load_safetensors(blob_read(version_create_seeded(adapter=adapter, seed=1).blob_sha256))


@pytest.mark.django_db
def test_import_through_the_api_accepts_a_matching_peft_file(api_client_for, adapter):
    tensors = _good_tensors(adapter)
    config = {"peft_type": "LORA", "r": 4, "target_modules": ["fc1", "conv2", "conv1"]}
    response = _import(api_client_for("operator"), adapter, save_safetensors(tensors), config)
    assert response.status_code == 201, response.content
    assert response.json()["source"] == "import" and response.json()["parent"] == 1


def _header_bomb() -> bytes:
    header = b"{" + b" " * (2 * 1024 * 1024) + b"}"  # a real 2 MB header: parse it and you have lost
    return struct.pack("<Q", len(header)) + header


def _overlapping(adapter) -> bytes:
    data = bytearray(save_safetensors(_good_tensors(adapter)))
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    first, second = [k for k in header if k != "__metadata__"][:2]
    header[first]["data_offsets"] = [0, header[first]["data_offsets"][1] - header[first]["data_offsets"][0]]
    header[second]["data_offsets"] = [4, 4 + header[second]["data_offsets"][1] - header[second]["data_offsets"][0]]
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(data[8 + size :])


@pytest.mark.parametrize(
    ("mutate", "code"),
    [
        (lambda t, a: save_safetensors({k: v for k, v in t.items() if "head" not in k}), "artifact_spec_mismatch"),
        (
            lambda t, a: save_safetensors({**t, "base_model.model.extra.weight": torch.zeros(2)}),
            "artifact_spec_mismatch",
        ),
        (
            lambda t, a: save_safetensors({**t, "base_model.model.fc1.lora_A.weight": torch.zeros(8, 128)}),
            "artifact_spec_mismatch",
        ),
        (
            lambda t, a: save_safetensors({k: v.half() if "head.bias" in k else v for k, v in t.items()}),
            "artifact_spec_mismatch",
        ),
        (
            lambda t, a: save_safetensors({**t, "base_model.model.head.bias": torch.tensor([float("nan")] * 10)}),
            "artifact_not_finite",
        ),
        (
            lambda t, a: save_safetensors({**t, "base_model.model.head.bias": torch.tensor([float("inf")] * 10)}),
            "artifact_not_finite",
        ),
        (lambda t, a: b"definitely not safetensors", "artifact_malformed"),
        (lambda t, a: save_safetensors(t)[:-10], "artifact_malformed"),
        (lambda t, a: _header_bomb(), "artifact_header_too_large"),
        (lambda t, a: _overlapping(a), "artifact_malformed"),
    ],
    ids=["missing", "extra", "shape", "dtype", "nan", "inf", "garbage", "truncated", "header-bomb", "overlap"],
)
@pytest.mark.django_db
def test_bad_imports_are_refused_with_a_clear_code_and_change_nothing(api_client_for, adapter, mutate, code):
    data = mutate(_good_tensors(adapter), adapter)
    before = AdapterVersion.objects.count()
    response = _import(api_client_for("operator"), adapter, data)
    assert response.status_code == 400, response.content
    assert response.json()["error"]["code"] == code, response.json()
    assert response.json()["error"]["message"]
    assert AdapterVersion.objects.count() == before


@pytest.mark.django_db
def test_import_with_a_mismatching_peft_config_is_refused(api_client_for, adapter):
    data = save_safetensors(_good_tensors(adapter))
    response = _import(
        api_client_for("operator"), adapter, data, {"peft_type": "LORA", "r": 16, "target_modules": ["fc1"]}
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_config"
    assert "rank is 4" in response.json()["error"]["message"]


@pytest.mark.django_db
def test_roles_for_the_registry(api_client_for, adapter):
    assert (
        api_client_for("viewer").post(f"/api/v1/adapters/{adapter.pk}/versions/seed/", {"seed": 1}).status_code == 403
    )
    response = api_client_for("operator").post(
        f"/api/v1/adapters/{adapter.pk}/versions/seed/", {"seed": 1}, format="json"
    )
    assert response.status_code == 201
    version_id = response.json()["id"]
    assert api_client_for("viewer").get(f"/api/v1/adapter-versions/{version_id}/export/").status_code == 403
    export = api_client_for("operator").get(f"/api/v1/adapter-versions/{version_id}/export/")
    assert export.status_code == 200 and export["Content-Type"] == "application/zip"
    body = {"name": "x", "base_model": "digits-base", "rank": 2, "alpha": 4}
    assert api_client_for("operator").post("/api/v1/adapters/", body, format="json").status_code == 403
    created = api_client_for("admin").post("/api/v1/adapters/", body, format="json")
    assert created.status_code == 201 and created.json()["latest_version"] is None


@pytest.mark.django_db
def test_release_then_revoke_and_no_way_back(api_client_for, adapter):
    version = version_create_seeded(adapter=adapter, seed=1)
    operator = api_client_for("operator")
    assert operator.post(f"/api/v1/adapter-versions/{version.pk}/release/").json()["state"] == "released"
    assert (
        operator.post(f"/api/v1/adapter-versions/{version.pk}/revoke/", {"reason": "bad"}).json()["state"] == "revoked"
    )
    response = operator.post(f"/api/v1/adapter-versions/{version.pk}/release/")
    assert response.status_code == 409 and response.json()["error"]["code"] == "invalid_transition"


@pytest.mark.django_db
def test_an_adapter_created_without_a_shape_gets_the_familys_default(api_client_for, base_model):
    admin = api_client_for("admin")
    created = admin.post("/api/v1/adapters/", {"name": "plain", "base_model": base_model.name}, format="json")
    assert created.status_code == 201, created.json()
    body = created.json()
    assert (body["rank"], body["alpha"]) == (16, 32.0)  # digits-cnn's default_rank and default_alpha
    assert body["target_modules"] == ["conv1", "conv2", "fc1"] and body["modules_to_save"] == ["head"]
    assert body["tensor_spec"]["base_model.model.conv2.lora_A.weight"]["shape"] == [16, 16, 3, 3]
    chosen = {"name": "small", "base_model": base_model.name, "rank": 2, "alpha": 4, "target_modules": ["fc1"]}
    body = admin.post("/api/v1/adapters/", chosen, format="json").json()
    assert (body["rank"], body["alpha"], body["target_modules"]) == (2, 4.0, ["fc1"])


@pytest.mark.django_db
def test_an_adapter_on_a_module_that_is_not_a_layer_is_refused(api_client_for, base_model):
    body = {"name": "bad", "base_model": base_model.name, "rank": 2, "alpha": 4, "target_modules": ["nope"]}
    response = api_client_for("admin").post("/api/v1/adapters/", body, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_adapter"
    assert "'nope'" in response.json()["error"]["message"]


@pytest.mark.django_db
def test_an_adapter_is_created_only_with_aggregation_settings_a_round_can_run(api_client_for, base_model):
    from training.models import Adapter

    admin = api_client_for("admin")
    body = {"name": "agg", "base_model": base_model.name, "rank": 2, "alpha": 4}
    for bad, says in (
        ({"strategy": "magic"}, "unknown strategy"),
        ({"strategy": "krum", "byzantine": "two"}, "byzantine must be"),
        ({"strategy": "multi_krum", "multi_k": 0}, "multi_k must be"),
        ({"strategy": "median", "mixing": "mix"}, "mixing must be"),
        ({"strategy": "fedavg", "mixing": "nnm"}, "mixing applies to the robust strategies"),
        ({"strategy": "trimmed_mean", "trim_ratio": "0.2"}, "trim_ratio must be"),
        ({"strategy": "trimmed_mean", "trim_ratio": 0.5}, "trim_ratio must be"),
        ({"clip_norm": -1}, "clip_norm must be"),
        ({"max_staleness": True}, "max_staleness must be"),
        ({"buffer_size": 2, "min_deltas": 3}, "min_deltas cannot be above buffer_size"),
        ({"nonsense": 1}, "unknown aggregation settings"),
        (["median"], "must be a JSON object"),
    ):
        response = admin.post("/api/v1/adapters/", {**body, "aggregation": bad}, format="json")
        assert response.status_code == 400, (bad, response.content)
        assert says in str(response.json()["error"]), (bad, response.json())
    assert not Adapter.objects.filter(name="agg").exists()
    good = {"strategy": "multi_krum", "byzantine": 2, "trim_ratio": 0.2, "mixing": "nnm"}
    created = admin.post("/api/v1/adapters/", {**body, "aggregation": good}, format="json")
    assert created.status_code == 201 and created.json()["aggregation"] == good


@pytest.mark.django_db
def test_krum_mixes_unless_told_not_to_and_a_round_carries_the_mixing_it_runs(adapter):
    from training.federation.aggregation_settings import validate_aggregation
    from training.federation.rounds import round_open
    from training.registry.services import adapter_set_aggregation, version_create_seeded

    version_create_seeded(adapter=adapter, seed=1)
    runs = {}
    for aggregation in (
        {"strategy": "krum"},  # the strategy's default: mixed
        {"strategy": "krum", "mixing": "none"},  # bare Krum, asked for
        {"strategy": "median"},  # off unless asked for
        {"strategy": "median", "mixing": "nnm"},
        {"strategy": "fedavg", "mixing": "none"},  # "none" is no mixing, which every strategy does
    ):
        adapter_set_aggregation(adapter=adapter, actor=None, aggregation={**aggregation, "auto_rounds": False})
        adapter.refresh_from_db()
        round_ = round_open(adapter=adapter)
        runs[tuple(aggregation.values())] = (round_.strategy, round_.params.get("mixing"))
        round_.delete()
    assert runs == {
        ("krum",): ("krum", "nnm"),
        ("krum", "none"): ("krum", None),
        ("median",): ("median", None),
        ("median", "nnm"): ("median", "nnm"),
        ("fedavg", "none"): ("fedavg", None),
    }
    assert validate_aggregation({"strategy": "fedbuff", "mixing": "none"})
    with pytest.raises(ValueError, match="mixing applies to the robust strategies"):
        validate_aggregation({"strategy": "fedbuff", "mixing": "nnm"})


@pytest.mark.django_db
def test_base_model_with_uploaded_weights_must_match_the_family(api_client_for):
    from edge_agent.families import get_family

    weights = {k: v.contiguous() for k, v in get_family("digits-cnn").build({"seed": 5}).state_dict().items()}
    admin = api_client_for("admin")
    good = SimpleUploadedFile("w.safetensors", save_safetensors(weights))
    response = admin.post(
        "/api/v1/base-models/", {"name": "uploaded", "family": "digits-cnn", "weights": good}, format="multipart"
    )
    assert response.status_code == 201, response.content
    assert response.json()["parameter_count"] == sum(v.numel() for v in weights.values())
    weights.pop("head.bias")
    bad = SimpleUploadedFile("w.safetensors", save_safetensors(weights))
    response = admin.post(
        "/api/v1/base-models/", {"name": "broken", "family": "digits-cnn", "weights": bad}, format="multipart"
    )
    assert response.status_code == 400 and "head.bias" in response.json()["error"]["message"]
    response = admin.post("/api/v1/base-models/", {"name": "odd", "family": "no.such:family"}, format="json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "unknown_family"
    # Not a path at all (the API fuzzer's finds: an empty or relative module was a server error), refused alike.
    for family in (":", ":family", ".relative:family", "os:", "a b:c", "edge_agent.families:x:y", "é:family"):
        response = admin.post("/api/v1/base-models/", {"name": "odd", "family": family}, format="json")
        assert response.status_code == 400, (family, response.content)
        assert response.json()["error"]["code"] == "unknown_family", family
    assert not BaseModel.objects.filter(name="odd").exists()
