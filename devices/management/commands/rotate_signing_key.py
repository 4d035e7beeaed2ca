"""``manage.py rotate_signing_key``: retire the server's signing key for a new one devices can follow.

    manage.py rotate_signing_key --show                      # the current key and the rotations so far
    manage.py rotate_signing_key                             # key in the data folder: rotate it in place
    manage.py rotate_signing_key --new-key-file /run/secrets/new.pem   # key from SERVER_SIGNING_KEY(_FILE)

The procedure, its order and why it is safe are in the README ("Rotating the server's signing key").
"""

from pathlib import Path

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Rotate the server's Ed25519 signing key: the old key signs the new one into the chain devices follow."

    def add_arguments(self, parser):
        parser.add_argument("--show", action="store_true", help="print the current key and the rotation chain")
        parser.add_argument(
            "--new-key-file",
            type=Path,
            help="where to write the new private key (0600) when the key comes from SERVER_SIGNING_KEY",
        )
        parser.add_argument(
            "--new-key",
            type=Path,
            help="use this private key (PEM or base64url seed file) instead of generating one",
        )

    def handle(self, *args, show, new_key_file, new_key, **options):
        from devices.models import ServerKeyRotation
        from devices.server_key import key_file, load_private_key, rotate_server_key, server_public_key_b64

        if show:
            self.stdout.write(f"current key: {server_public_key_b64()} ({key_file() or 'from SERVER_SIGNING_KEY'})")
            for row in ServerKeyRotation.objects.all():
                self.stdout.write(
                    f"  #{row.seq} {row.created_at:%Y-%m-%d %H:%M} {row.old_public_key} -> {row.new_public_key}"
                )
            return
        try:
            replacement = load_private_key(new_key.read_text()) if new_key else None
            rotation, path = rotate_server_key(replacement, next_key_path=new_key_file)
        except OSError as error:
            raise CommandError(f"cannot read or write a key file: {error}") from None
        except ImproperlyConfigured as error:
            raise CommandError(str(error)) from None
        self.stdout.write(f"rotation #{rotation.seq}: {rotation.old_public_key} -> {rotation.new_public_key}")
        self.stdout.write(f"new private key: {path} (mode 0600)")
        if key_file() is None:
            self.stdout.write(f"next: set SERVER_SIGNING_KEY_FILE={path} (unset SERVER_SIGNING_KEY) for every process")
        self.stdout.write(
            "next: restart every web, worker and beat process; devices move to the new key with the next "
            "manifest they receive (signed by it, carrying the chain)"
        )
