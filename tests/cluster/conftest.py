"""The end-to-end fixtures (the tiny model's spec, generate()'s reference) for the cluster tests."""

from tests.e2e.conftest import model_spec, reference

__all__ = ["model_spec", "reference"]
