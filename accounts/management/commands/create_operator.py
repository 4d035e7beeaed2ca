import secrets

from django.core.management.base import BaseCommand, CommandError

from accounts.models import User
from accounts.roles import Role
from accounts.services import api_token_create, user_create


class Command(BaseCommand):
    help = (
        "Create an operator account with a role; prints a generated password unless one is given, and with "
        "--api-token an API token for it (the first token for scripts, without the dashboard's login form)."
    )

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--role", choices=[r.value for r in Role], default=Role.VIEWER.value)
        parser.add_argument("--email", default="")
        parser.add_argument("--password", help="defaults to a generated one, printed once")
        parser.add_argument(
            "--api-token",
            nargs="?",
            const="created with the account",
            default=None,
            metavar="NAME",
            help="also create an API token acting with the account's role and print it once "
            "(Authorization: Bearer fpm_...); NAME says what it is for",
        )

    def handle(self, *args, username, role, email, password, api_token, **options):
        if User.objects.filter(username=username).exists():
            raise CommandError(f"user {username!r} exists")
        password = password or secrets.token_urlsafe(12)
        user = user_create(username=username, role=role, email=email, password=password)
        self.stdout.write(f"created {role} {username!r} with password: {password}")
        if api_token is not None:
            issued = api_token_create(user=user, name=api_token[:100])
            self.stdout.write(f"API token (shown once): {issued.raw}")
