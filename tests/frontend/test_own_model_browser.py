"""Your own model from the dashboard (issue 51), in a real headless Chromium against the real ASGI server: an admin
uploads a ``.pt2`` and its card, then a Hugging Face folder, on the models page and reads which modules an adapter
can target; a card that does not match the model is refused with its reason and nothing is stored; a viewer sees no
form. Screenshots go to ``tests/artifacts/screenshots/`` (own-model-*.png)."""

from __future__ import annotations

import json

import pytest

from demo.sensor_model import CARD, export_bytes, trained_model
from tests.frontend.conftest import off_loop
from tests.frontend.test_browser import DESKTOP, PASSWORD, Dashboard
from tests.hf_support import tiny_bert_zip
from training.models import BaseModel

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture
def program(tmp_path):
    path = tmp_path / "sensor.pt2"
    path.write_bytes(export_bytes(trained_model(epochs=3)))
    return path


def _base_models():
    return sorted(BaseModel.objects.values_list("name", flat=True))


def test_an_admin_uploads_a_pt2_and_its_card_and_reads_the_modules_adapters_target(
    browser, server_url, transactional_db, make_user, program
):
    make_user("admin", username="ui-admin", password=PASSWORD)
    make_user("viewer", username="ui-viewer", password=PASSWORD)
    ui = Dashboard(browser, server_url, "admin", viewport=DESKTOP)
    ui.visit("/models/")
    form = ui.page.locator("[data-testid=own-model-form]")
    form.locator("input[name=name]").fill("wrist-cnn")
    form.locator("input[name=program]").set_input_files(str(program))
    form.locator("textarea[name=card]").fill(json.dumps({**CARD, "classes": 5}))
    form.locator("button[type=submit]").click()
    ui.page.wait_for_load_state("domcontentloaded")
    error = ui.page.locator("#messages [role=alert]").inner_text()
    assert "[batch, 5]" in error, error  # the model predicts 4 classes: refused, saying so
    assert off_loop(_base_models) == []
    ui.screenshot("own-model-refused-desktop")

    form = ui.page.locator("[data-testid=own-model-form]")
    form.locator("input[name=name]").fill("wrist-cnn")
    form.locator("input[name=program]").set_input_files(str(program))
    form.locator("textarea[name=card]").fill(json.dumps(CARD))
    form.locator("button[type=submit]").click()
    ui.page.wait_for_url(server_url + "/models/")
    message = ui.page.locator("#messages").inner_text()
    assert "Registered wrist-cnn" in message and "target: conv1, conv2, fc, head" in message, message
    assert (
        ui.page.locator("[data-testid=card-wrist-cnn]").inner_text()
        == "window float32 [3, 32] → classification of 4 classes"
    )
    assert off_loop(_base_models) == ["wrist-cnn"]
    ui.screenshot("own-model-registered-desktop")

    bert = program.parent / "intent-bert.zip"  # a Hugging Face text classifier's folder, zipped
    bert.write_bytes(tiny_bert_zip()[0])
    form = ui.page.locator("[data-testid=own-model-form]")
    form.locator("input[name=name]").fill("intent-bert")
    form.locator("select[name=kind]").select_option("hf-text-classifier")
    form.locator("input[name=program]").set_input_files(str(bert))
    form.locator("button[type=submit]").click()
    ui.page.wait_for_url(server_url + "/models/")
    message = ui.page.locator("#messages").inner_text()
    assert "Registered intent-bert" in message and "attention.self.query" in message, message
    assert ui.page.locator("[data-testid=card-intent-bert]").inner_text() == "text → 3 labels, 64 tokens"
    ui.close()

    viewer = Dashboard(browser, server_url, "viewer", viewport=DESKTOP)
    viewer.visit("/models/")
    assert viewer.page.locator("[data-testid=own-model-form]").count() == 0
    assert viewer.page.locator("[data-testid=card-wrist-cnn]").is_visible()
    viewer.close()
