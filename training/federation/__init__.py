"""The federated pipeline: a delta's intake, verification, rounds, aggregation and its strategies, and the
live events they publish. Builds on the registry; enqueues its Celery work through ``training.dispatch``."""
