"""Accelerator tests: they run wherever JAX's default backend is not the CPU (a TPU, a
GPU) and are skipped, each with the reason, where it is."""

import pytest


def accelerator() -> str | None:
    """The platform of JAX's default backend when it is an accelerator, else None."""
    try:
        import jax

        platform = jax.devices()[0].platform
    except Exception:  # no backend at all counts as no accelerator
        return None
    return None if platform == "cpu" else platform


def pytest_collection_modifyitems(config, items):
    if accelerator() is not None:
        return
    skip = pytest.mark.skip(reason="JAX sees no accelerator (its default backend is the CPU)")
    for item in items:
        if "tpu_tests" in str(item.fspath):
            item.add_marker(skip)
