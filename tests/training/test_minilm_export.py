"""The PEFT round trip on a real pretrained transformer: a MiniLM adapter version made by the server,
exported as a PEFT directory, loads with ``peft.PeftModel.from_pretrained`` and gives the same outputs as
the agent's own model carrying that adapter."""

import io
import tempfile
import zipfile

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from edge_agent.families.minilm import tokenize, toy_texts
from edge_agent.lora_layers import apply_adapter
from training.registry.blobs import blob_read
from training.registry.services import (
    adapter_create,
    base_model_create,
    build_base,
    version_create_seeded,
    version_export_peft,
    version_import,
)

pytest.importorskip("transformers")


@pytest.mark.django_db
def test_a_minilm_version_exported_by_the_server_loads_in_peft_with_the_agents_outputs(make_user):
    peft = pytest.importorskip("peft")
    admin = make_user("admin")
    base_model = base_model_create(name="minilm", family="minilm-text", family_config={"seed": 2}, actor=admin)
    adapter = adapter_create(name="minilm-lora", base_model=base_model, rank=8, alpha=16.0, actor=admin)
    assert any("attention.self.query.lora_A" in key for key in adapter.tensor_spec)
    seeded = load_safetensors(blob_read(version_create_seeded(adapter=adapter, seed=5).blob_sha256))
    generator = torch.Generator().manual_seed(0)
    trained = {  # as if devices had trained it: non-zero B everywhere
        key: (torch.randn(value.shape, generator=generator) * 0.05 if ".lora_B." in key else value)
        for key, value in seeded.items()
    }
    version = version_import(adapter=adapter, data=save_safetensors(trained), actor=admin)
    archive = zipfile.ZipFile(io.BytesIO(version_export_peft(version)))

    texts, _ = toy_texts(6, seed=3)
    batch = tokenize(texts, max_length=24)
    agent_model = apply_adapter(
        build_base(base_model),
        {k: v.clone() for k, v in trained.items()},
        rank=adapter.rank,
        alpha=adapter.alpha,
        target_modules=adapter.target_modules,
        modules_to_save=adapter.modules_to_save,
    ).eval()
    plain = build_base(base_model).eval()
    with tempfile.TemporaryDirectory() as folder:
        archive.extractall(folder)
        peft_model = peft.PeftModel.from_pretrained(build_base(base_model), folder).eval()
        with torch.no_grad():
            ours = agent_model(**batch)
            theirs = peft_model(**batch)
            untouched = plain(**batch)
    assert not torch.allclose(ours, untouched, atol=1e-3)  # the adapter really changes the model
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
