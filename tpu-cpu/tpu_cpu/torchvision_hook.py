"""Applies `patches.patch_torchvision_register_fake` the moment torchvision is first imported.

Why not from a plugin: vLLM imports transformers' image utilities, and with them torchvision,
while it imports `vllm.config`, before it loads any plugin. The subprocess vLLM runs to inspect a
model's architecture (`python -m vllm.model_executor.models.registry`) does only that, and fails
on torchvision's import without the shim. So this one shim is installed from a `.pth` file
(`tpu_cpu.pth`, written into site-packages by scripts/tpu-inference-env), which Python runs at
start-up in every process of the environment. It costs one `sys.meta_path` entry: nothing is
imported until something imports torchvision, and then only `torch.library`, which torchvision
imports anyway.
"""

from __future__ import annotations

import sys


class TorchvisionHook:
    """A meta-path finder that finds nothing: it patches, removes itself, and lets the import go on."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            from tpu_cpu.patches import patch_torchvision_register_fake

            patch_torchvision_register_fake()
        return None


def install() -> None:
    """Called by `tpu_cpu.pth`; does nothing on a host with libtpu or once torchvision is loaded."""
    from tpu_cpu import active

    if active() and "torchvision" not in sys.modules:
        if not any(isinstance(finder, TorchvisionHook) for finder in sys.meta_path):
            sys.meta_path.insert(0, TorchvisionHook())
