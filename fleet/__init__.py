"""The Django project: settings, URLs, ASGI routing, the Celery app and the embedded dev stack launcher."""

# Load the project's Celery app with Django (Celery's documented Django set-up), so every process, a web server
# that has only served WebSockets included, queues tasks on the configured broker. Without this, a process that
# had not imported ``fleet.celery`` yet sent its tasks through Celery's fallback app, to amqp://localhost.
from fleet.celery import app as celery_app

__all__ = ("celery_app",)
