"""CPU test setup: JAX on the CPU backend with 8 emulated devices; the `pair` fixture.

The environment must be set before JAX is first imported, which is why this
happens at conftest import time rather than in a fixture.
"""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import tempfile  # noqa: E402

# Agents' names are claimed on the host (`kvxfer.nixl.claims`): this session's own folder, so
# that test runs side by side on one machine, each naming its agents P and D, do not meet.
os.environ.setdefault("KVXFER_AGENT_DIR", tempfile.mkdtemp(prefix="kvxfer-agents-"))

import pytest  # noqa: E402


@pytest.fixture
def pair():
    """Makes in-process P/D connector pairs (`procs.pair.Pair(**kw)`); closes them at teardown."""
    from procs.pair import Pair

    made = []

    def make(**kw):
        made.append(Pair(**kw))
        return made[-1]
    yield make
    for p in made:
        p.close()


@pytest.fixture(params=["numpy", "xla"])
def backend(request, monkeypatch):
    """The test runs on each backend of `kvxfer.device.gather` (`KVXFER_BACKEND`): `numpy`, and `xla`,
    the jitted programs an accelerator runs."""
    monkeypatch.setenv("KVXFER_BACKEND", request.param)
    return request.param
