"""Benchmarks behind `kvxfer bench ...`: each module's `run()` returns a JSON-able dict
of figures, with a reference measured in the same run."""

import statistics
import time

import numpy as np


def memcpy_gbps(nbytes: int) -> float:
    """numpy's copy of `nbytes` into another buffer, GB/s: median of 5 after a warm-up."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    rates = []
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)
