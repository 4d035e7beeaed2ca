import secrets

from django.core.management.base import BaseCommand, CommandError

from accounts.models import User
from accounts.roles import Role
from accounts.services import user_create


class Command(BaseCommand):
    help = "Create an operator account with a role; prints a generated password unless one is given."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--role", choices=[r.value for r in Role], default=Role.VIEWER.value)
        parser.add_argument("--email", default="")
        parser.add_argument("--password", help="defaults to a generated one, printed once")

    def handle(self, *args, username, role, email, password, **options):
        if User.objects.filter(username=username).exists():
            raise CommandError(f"user {username!r} exists")
        password = password or secrets.token_urlsafe(12)
        user_create(username=username, role=role, email=email, password=password)
        self.stdout.write(f"created {role} {username!r} with password: {password}")
