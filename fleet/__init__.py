"""The Django project: settings, URLs, ASGI routing, the Celery app and the embedded dev stack launcher."""
