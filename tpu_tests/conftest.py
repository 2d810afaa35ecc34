"""TPU tests run only where JAX sees TPU devices; elsewhere they are skipped."""

import pytest


def _has_tpu() -> bool:
    try:
        import jax

        return any(d.platform == "tpu" for d in jax.devices())
    except Exception:  # no backend at all counts as no TPU
        return False


def pytest_collection_modifyitems(config, items):
    if _has_tpu():
        return
    skip = pytest.mark.skip(reason="no TPU devices visible to JAX (jax.devices() has no 'tpu')")
    for item in items:
        if "tpu_tests" in str(item.fspath):
            item.add_marker(skip)
