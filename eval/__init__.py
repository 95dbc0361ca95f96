"""Evaluation: the harness that scores a model and an artifact through the contract (not built yet)."""
