"""A team's own Hugging Face sequence classifier without code (issue 51): its model folder, zipped, becomes a base
model (built with transformers from the stored config, never from a hub, never with remote code); adapters target its
attention projections by the model's own names; a device trains and personalizes it from texts; the personal adapter
it exports loads with ``PeftModel.from_pretrained`` on the same folder's model and gives the agent's outputs. Every
bad folder is refused with its reason and nothing is stored."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from django.core.files.uploadedfile import SimpleUploadedFile
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file

from edge_agent.api import Agent
from edge_agent.assignments import AdapterStore
from edge_agent.identity import AgentState, load_or_create_key
from edge_agent.runtime import AgentConfig, DeviceRuntime
from tests.hf_support import TEXTS, tiny_bert_zip, zipped
from training.models import Adapter, BaseModel, TrainingEvent
from training.registry.blobs import blob_read
from training.registry.services import version_create_seeded
from training.rollouts.manifests import training_config

pytest.importorskip("transformers")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def bert():
    return tiny_bert_zip()


def _upload(client, name: str, data: bytes | None, config: dict | None = None):
    body = {"name": name, "family": "hf-text-classifier", "family_config": json.dumps(config or {"max_length": 16})}
    if data is not None:
        body["weights"] = SimpleUploadedFile("intent-bert.zip", data)
    return client.post("/api/v1/base-models/", body, format="multipart")


def _install(home, data: bytes, adapter: Adapter, tensors: dict, base: BaseModel) -> None:
    """Version 1 installed as the assignment handler installs it: the zip as the base file, the signed training
    setting (what rollouts/manifests.py puts in a manifest)."""
    store = AdapterStore(home)
    store.base_root.mkdir(parents=True, exist_ok=True)
    store.base_path(base.weights_sha256).write_bytes(data)
    store.root.mkdir(parents=True, exist_ok=True)
    path = store.root / "v1.safetensors"
    save_file(tensors, str(path))
    training = training_config(adapter)
    store.save({"last_seq": 1, "base_model_sha256": base.weights_sha256, "previous": None,
                "current": {"adapter": adapter.name, "version": 1, "sha256": "1" * 64, "path": str(path),
                            "installed_at": time.time(), "training": training}})  # fmt: skip


@pytest.mark.django_db
def test_a_hf_folder_is_personalized_on_a_device_and_its_adapter_loads_with_peft(api_client_for, bert, tmp_path):
    data, folder = bert
    admin = api_client_for("admin")
    response = _upload(admin, "intent-bert", data)
    assert response.status_code == 201, response.content
    base = BaseModel.objects.get(name="intent-bert")
    assert base.family_config == {"task": "sequence-classification", "labels": ["LABEL_0", "LABEL_1", "LABEL_2"],
                                  "max_length": 16}  # fmt: skip
    listed = admin.get(f"/api/v1/base-models/{base.pk}/modules/").json()["modules"]
    assert {"name": "bert.encoder.layer.1.attention.self.value", "kind": "linear", "shape": [32, 32],
            "parameters": 1024} in listed  # fmt: skip
    response = admin.post("/api/v1/adapters/", {"name": "intent-lora", "base_model": "intent-bert"}, format="json")
    assert response.status_code == 201, response.content
    adapter = Adapter.objects.get(name="intent-lora")
    assert adapter.target_modules == [f"bert.encoder.layer.{i}.attention.self.{p}" for i in (0, 1)
                                      for p in ("query", "value")]  # fmt: skip
    assert adapter.modules_to_save == ["classifier"]
    version = version_create_seeded(adapter=adapter, seed=1)

    home = tmp_path / "phone"
    _install(home, data, adapter, load_safetensors(blob_read(version.blob_sha256)), base)
    agent = Agent(home)
    assert agent.schema() == {"text": "text []", "y": "int64 [] in [0, 2]"}
    texts = [t for label in TEXTS for t in TEXTS[label]] * 4
    labels = [label for label in TEXTS for _ in TEXTS[label]] * 4
    assert agent.add_samples({"text": texts, "y": labels}) == len(texts)
    config = AgentConfig(data={"kind": "app"}, power={"kind": "simulated", "level": 100.0, "charging": True},
                         policy={"min_new_samples": 8, "min_battery_percent": 30.0},
                         train={"epochs": 3, "lr": 0.01, "replay_ratio": 0.0})  # fmt: skip
    state = AgentState(server="http://127.0.0.1:9", device_id="00000000-0000-0000-0000-000000000009",
                       server_public_key="", cohort="c", status="active", websocket_path="/ws/agent/",
                       heartbeat_interval=30)  # fmt: skip
    outcome = DeviceRuntime(home=home, state=state, key=load_or_create_key(home), config=config).train_once(force=True)
    assert outcome["status"] == "trained", outcome
    assert agent.status()["personal"]["method"] == "ditto"
    answered = agent.predict({"text": ["my phone crashed today", "rain and snow"]})
    assert len(answered["labels"]) == 2

    out = tmp_path / "export"
    command = [sys.executable, "-m", "edge_agent", "--home", str(home), "export", "--personal", str(out)]
    exported = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    assert json.loads((out / "adapter_config.json").read_text())["peft_type"] == "LORA"
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    peft_model = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(folder), str(out)).eval()
    tokens = AutoTokenizer.from_pretrained(folder)(["my phone crashed today", "rain and snow"], padding="max_length",
                                                   truncation=True, max_length=16, return_tensors="pt")  # fmt: skip
    served, about = agent.served()
    assert about["serving"] == "personal"
    with torch.no_grad():
        ours = served(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        theirs = peft_model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert torch.allclose(torch.softmax(ours, -1), torch.tensor(answered["probabilities"]), atol=1e-5)


def _config(folder, **changes) -> bytes:
    config = json.loads((folder / "config.json").read_text())
    return json.dumps({**config, **changes}).encode()


BAD = {
    "pickle_weights": (lambda d, f: zipped(f, extra={"intent-bert/pytorch_model.bin": b"\x80\x04."}), "pickle"),
    "remote_code_file": (lambda d, f: zipped(f, extra={"intent-bert/modeling_evil.py": b"import os"}), "code"),
    "auto_map": (lambda d, f: zipped(f, drop=("config.json",), extra={
        "intent-bert/config.json": _config(f, auto_map={"AutoModel": "evil.Model"})}), "auto_map"),
    "not_a_classifier": (lambda d, f: zipped(f, drop=("config.json",), extra={
        "intent-bert/config.json": _config(f, architectures=["BertModel"])}), "not a sequence classifier"),
    "wrong_weights": (lambda d, f: zipped(f, drop=("config.json",), extra={
        "intent-bert/config.json": _config(f, hidden_size=48, num_attention_heads=2)}), "do not match"),
    "no_tokenizer": (lambda d, f: zipped(f, drop=("tokenizer.json",)), "no tokenizer"),
    "outside": (lambda d, f: zipped(f, extra={"../evil.txt": b"x"}), "outside its folder"),
    "not_a_zip": (lambda d, f: b"model", "zip archive"),
}  # fmt: skip


@pytest.mark.django_db
@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_hf_folder_is_refused_with_its_reason_and_nothing_is_stored(api_client_for, bert, case):
    make, words = BAD[case]
    events = TrainingEvent.objects.count()
    response = _upload(api_client_for("admin"), "bad", make(*bert))
    assert response.status_code == 400, response.content
    assert words in response.json()["error"]["message"], response.json()
    assert not BaseModel.objects.exists() and TrainingEvent.objects.count() == events


@pytest.mark.django_db
def test_import_base_model_takes_a_hf_folder_or_its_zip(bert, tmp_path):
    import io

    from django.core.management import CommandError, call_command

    data, folder = bert
    out = io.StringIO()
    call_command("import_base_model", str(folder), "--max-length", "24", stdout=out)
    assert "base model 'intent-bert'" in out.getvalue() and "attention.self.query" in out.getvalue(), out.getvalue()
    assert BaseModel.objects.get(name="intent-bert").family_config["max_length"] == 24
    archive = tmp_path / "Intent BERT v2.zip"
    archive.write_bytes(data)
    call_command("import_base_model", str(archive), stdout=io.StringIO())
    assert BaseModel.objects.get(name="intent-bert-v2").family == "hf-text-classifier"
    assert BaseModel.objects.filter(family="hf-text-classifier").count() == 2
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "pytorch_model.bin").write_bytes(b"\x80\x04.")
    with pytest.raises(CommandError, match="artifact_pickle_weights"):
        call_command("import_base_model", str(tmp_path / "broken"), stdout=io.StringIO())
    assert BaseModel.objects.count() == 2
