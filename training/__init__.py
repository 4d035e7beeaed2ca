"""Base models, adapters and versions, rollouts, deltas, verification, aggregation, rounds, DP accounting."""
