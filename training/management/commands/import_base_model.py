"""``manage.py import_base_model PATH``: register your own model as a base model, without code (issue 51).

    manage.py import_base_model sensor.pt2                        # the card beside it: sensor.json
    manage.py import_base_model sensor.pt2 --card card.json --name wearable-cnn

``PATH`` is a ``.pt2`` saved with ``torch.export.save``; its card (JSON: the inputs, the task, which output is the
prediction) is described in edge_agent/families/exported.py and the README ("Your own model"). The model is
checked as the API checks an upload (``POST /api/v1/base-models/``): the archive, the card, and a run of the model
on the card's inputs; nothing is stored when a check fails. Then the base's modules an adapter can target are
listed.
"""

import json
import re
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from core.errors import Invalid, TooLarge


class Command(BaseCommand):
    help = "Register a .pt2 model (torch.export.save) and its JSON card as a base model adapters can personalize."

    def add_arguments(self, parser):
        parser.add_argument("path", type=Path, help="the .pt2 file")
        parser.add_argument("--card", type=Path, help="the model's card (default: PATH with the suffix .json)")
        parser.add_argument("--name", help="the base model's name (default: the file's name, as a slug)")

    def handle(self, *args, path, card, name, **options):
        from training.models import BaseModel
        from training.registry.services import base_model_create, build_base, candidate_modules

        path = Path(path)
        card = Path(card) if card else path.with_suffix(".json")
        name = name or re.sub(r"[^a-z0-9_-]+", "-", path.stem.lower()).strip("-")[:64] or "model"
        if BaseModel.objects.filter(name=name).exists():
            raise CommandError(f"a base model named {name!r} exists: choose another with --name")
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
        try:
            base = base_model_create(name=name, family="exported-program", family_config=config, weights=data)
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
        self.stdout.write(
            f"next: POST /api/v1/adapters/ with base_model {base.name!r} (without target_modules: every module "
            "above but the last, and the last trained in full)"
        )
