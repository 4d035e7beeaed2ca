"""The model registry: base models, adapters and their versions, artifacts and their storage, evaluation, and
an adapter's personalization setting. Imports nothing else of ``training`` but its models."""
