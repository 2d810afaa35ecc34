"""Run with .venv-tpu: `.venv-tpu/bin/python -m pytest tpu-cpu/tests -q`."""

from tpu_cpu import patches

# As in a vLLM process, where the platform plugin applies them before tpu_inference loads.
patches.install()
