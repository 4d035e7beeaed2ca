"""Create (or refresh) the demo admin account the launcher prints at start-up."""

import secrets
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand

from accounts.models import User
from accounts.roles import Role
from accounts.services import user_create

DEMO_USERNAME = "demo"


class Command(BaseCommand):
    help = "Ensure the demo admin account exists; its password lives in FLEET_DATA_DIR/demo-login.txt (0600)."

    def add_arguments(self, parser):
        parser.add_argument(
            "--existing",
            action="store_true",
            help="change nothing: print the demo login only if that account exists, active, with the password the "
            "data folder keeps (`run --no-demo`: the launcher prints only a login that works)",
        )

    def handle(self, *args, existing=False, **options):
        login_file = Path(settings.DATA_DIR) / "demo-login.txt"
        password = login_file.read_text().strip() if login_file.exists() else ""
        user = User.objects.filter(username=DEMO_USERNAME).first()
        if existing:
            if user is not None and user.is_active and password and user.check_password(password):
                self.stdout.write(f"{DEMO_USERNAME} {password}")
            return
        if user is None:
            password = password or secrets.token_urlsafe(12)
            user_create(username=DEMO_USERNAME, role=Role.ADMIN, password=password)
        elif not password or not user.check_password(password):
            password = secrets.token_urlsafe(12)
            user.set_password(password)
            user.save(update_fields=["password"])
        login_file.parent.mkdir(parents=True, exist_ok=True)
        login_file.touch(mode=0o600)
        login_file.chmod(0o600)
        login_file.write_text(password + "\n")
        self.stdout.write(f"{DEMO_USERNAME} {password}")
