"""CPU test setup: JAX on the CPU backend with 8 emulated devices.

The environment must be set before JAX is first imported, which is why this
happens at conftest import time rather than in a fixture.
"""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
