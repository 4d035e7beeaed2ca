"""Rollouts: staged phases, guards and progress, the assignments they make, the signed manifests and their
delivery to devices. Builds on the registry and the federation (a round's result is released as a rollout)."""
