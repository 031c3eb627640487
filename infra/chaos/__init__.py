"""Chaos engineering on real runs: fault injection, invariants, bad input, experiments (docs/chaos.md)."""
