"""Stub of tokamax's grouped matmul v2 (see tokamax/__init__.py): importable, never runnable."""


def gmm_v2(*args, **kwargs):
    raise NotImplementedError("tokamax is stubbed by tpu_cpu (Python 3.11): MoE layers cannot run here")


def calculate_tiling(*args, **kwargs):
    raise NotImplementedError("tokamax is stubbed by tpu_cpu (Python 3.11): MoE layers cannot run here")
