"""WSGI entry point, for tools that want one; the product itself is served over ASGI (fleet.asgi)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleet.settings")
application = get_wsgi_application()
