"""``manage.py import_base_model PATH``: register your own model as a base model, without code (issue 51).

    manage.py import_base_model sensor.pt2                        # the card beside it: sensor.json
    manage.py import_base_model sensor.pt2 --card card.json --name wearable-cnn
    manage.py import_base_model ./intent-bert                     # a Hugging Face sequence classifier's folder
    manage.py import_base_model intent-bert.zip --max-length 32   # the same, zipped

``PATH`` is a ``.pt2`` saved with ``torch.export.save``, whose card (JSON: the inputs, the task, which output is the
prediction) is described in edge_agent/families/exported.py and the README ("Your own model, without code"); or a
Hugging Face model folder (``config.json``, ``model.safetensors``, the tokenizer's files), as a folder or a zip
(edge_agent/families/huggingface.py). The model is checked as the API checks an upload (``POST
/api/v1/base-models/``) and run; nothing is stored when a check fails. Then the base's modules an adapter can target
are listed.
"""

import io
import json
import re
import zipfile
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from core.errors import Invalid, TooLarge
from training.models import BaseModel
from training.registry.services import base_model_create, build_base, candidate_modules


class Command(BaseCommand):
    help = "Register a .pt2 model (torch.export.save) and its JSON card as a base model adapters can personalize."

    def add_arguments(self, parser):
        parser.add_argument("path", type=Path, help="a .pt2 file, or a Hugging Face model folder or its zip")
        parser.add_argument("--card", type=Path, help="the model's card (default: PATH with the suffix .json)")
        parser.add_argument("--name", help="the base model's name (default: the file's name, as a slug)")
        parser.add_argument("--max-length", type=int, default=64, help="Hugging Face: tokens a text is cut to")

    def handle(self, *args, path, card, name, max_length=64, **options):
        path = Path(path)
        name = name or re.sub(r"[^a-z0-9_-]+", "-", path.stem.lower()).strip("-")[:64] or "model"
        if BaseModel.objects.filter(name=name).exists():
            raise CommandError(f"a base model named {name!r} exists: choose another with --name")
        if path.is_dir() or path.suffix == ".zip":
            self._register(name, "hf-text-classifier", {"max_length": max_length}, _folder_zip(path))
            return
        card = Path(card) if card else path.with_suffix(".json")
        try:
            config = json.loads(card.read_text())
        except FileNotFoundError:
            raise CommandError(f"no card at {card}: write one (see README, 'Your own model') or give --card") from None
        except (OSError, ValueError) as error:
            raise CommandError(f"cannot read the card {card}: {error}") from None
        try:
            size = path.stat().st_size
            self.stdout.write(f"reading {path} ({size:,} bytes)")
            data = path.read_bytes()
        except OSError as error:
            raise CommandError(f"cannot read {path}: {error}") from None
        self.stdout.write("checking the archive and running the model on the card's inputs")
        self._register(name, "exported-program", config, data)

    def _register(self, name: str, family: str, config: dict, data: bytes) -> None:
        try:
            base = base_model_create(name=name, family=family, family_config=config, weights=data)
        except (Invalid, TooLarge) as error:
            raise CommandError(f"{error.code}: {error.message}") from None
        self.stdout.write(
            f"base model {base.name!r}: {base.parameter_count:,} parameters, sha256 {base.weights_sha256[:12]}"
        )
        self.stdout.write("modules an adapter can target (target_modules):")
        for module in candidate_modules(build_base(base)):
            self.stdout.write(
                f"  {module['name']:<32} {module['kind']:<7} {str(module['shape']):<20} {module['parameters']:,}"
            )
        defaults = {
            "exported-program": "every module above but the last, and the last trained in full",
            "hf-text-classifier": "the attention's query and value projections, and the classifier trained in full",
        }[family]
        self.stdout.write(
            f"next: POST /api/v1/adapters/ with base_model {base.name!r} (without target_modules: {defaults})"
        )


def _folder_zip(path: Path) -> bytes:
    """A Hugging Face model folder as the zip the API takes (its files at the top); a ``.zip`` as it is."""
    try:
        if not path.is_dir():
            return path.read_bytes()
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as archive:
            for item in sorted(path.iterdir()):
                if item.is_file() and not item.is_symlink():
                    archive.write(item, item.name)
        return out.getvalue()
    except OSError as error:
        raise CommandError(f"cannot read {path}: {error}") from None
