"""Setup for the vLLM-driven tests: JAX on CPU with 8 emulated devices, vLLM on its CPU platform.

Environment variables must be set before JAX or vLLM is first imported, hence
at conftest import time.  Run with the vLLM venv:
`.venv-vllm/bin/python -m pytest vllm_tests -q`.
"""

import os
import sys
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
# vLLM chooses its platform from this; "cpu" gives a real platform (device
# type, hybrid KV cache manager support) without any accelerator.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# Stable block hashes across the two engines of a pair and across runs.
os.environ.setdefault("PYTHONHASHSEED", "0")
# Keep vLLM's model-info cache etc. out of the home directory.
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "kvxfer-vllm-cache"))

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny 2-layer Llama-shaped config (4 KV heads, head_dim 32)."""
    from engine import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("model"), num_layers=2)


@pytest.fixture(scope="session")
def hybrid_model_dir(tmp_path_factory):
    """A 4-layer variant for hybrid (full + sliding-window) KV cache groups."""
    from engine import SLIDING_WINDOW, make_model_dir

    return make_model_dir(
        tmp_path_factory.mktemp("hybrid_model"), num_layers=4, sliding_window=SLIDING_WINDOW
    )


@pytest.fixture
def engines():
    """Makes `engine.Engine(**kw)`s; closes them at teardown."""
    from engine import Engine

    made = []

    def make(*args, **kw):
        made.append(Engine(*args, **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()
