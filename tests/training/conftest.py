"""Fixtures the tests under tests/training share: ``setup``, the delta upload tests' adapter, version, device and
client (tests/training/delta_support.py)."""

from tests.training.delta_support import setup  # noqa: F401  (a fixture: registered for this folder)
