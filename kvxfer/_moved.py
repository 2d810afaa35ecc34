"""Module paths from before the layered tree, kept working for one release with a warning.

`import kvxfer.scheduler` (and every other old path below) still gives the module at its
new path, and warns with `DeprecationWarning` naming it. Remove in the release after 0.1.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install"]

MOVED = {
    "kvxfer.blocks": "kvxfer.plan.blocks",
    "kvxfer.scheduler": "kvxfer.plan.save_plan",
    "kvxfer.slots": "kvxfer.plan.slots",
    "kvxfer.simulate": "kvxfer.plan.simulate",
    "kvxfer.layout": "kvxfer.device.layout",
    "kvxfer.gather": "kvxfer.device.gather",
    "kvxfer.pieces": "kvxfer.device.pieces",
    "kvxfer.staging": "kvxfer.device.staging",
    "kvxfer.fingerprint": "kvxfer.device.fingerprint",
    "kvxfer.wire": "kvxfer.nixl.wire",
    "kvxfer.multihost": "kvxfer.nixl.agreement",
    "kvxfer.nixl.multihost": "kvxfer.nixl.agreement",
    "kvxfer.vllm_metrics": "kvxfer.vllm.metrics",
    "kvxfer.vllm_settings": "kvxfer.vllm.settings",
    "kvxfer.proxy": "kvxfer.serve.proxy",
}
"""Old module path -> where it lives now."""


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at its new path."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} is now {new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module at the new path has run already."""


def install() -> None:
    """Put the finder on `sys.meta_path` once."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
