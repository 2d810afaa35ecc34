"""Run notebooks under a real Jupyter kernel, and tell stored outputs a fresh run would change.

Shared by `test_notebooks.py` (a notebook fails if a cell raises or its stored
outputs are stale) and `scripts/run-notebooks` (which stores fresh outputs),
so both run notebooks the same way.

Outputs are compared after normalisation: stream text and `text/plain` results
exactly (trailing whitespace aside); other MIME types (images, whose bytes
may differ between machines and library versions) by presence; cells tagged
`nondeterministic` (timings, bandwidths) only by the kinds of outputs they have.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
REFRESH = "scripts/run-notebooks"
NONDETERMINISTIC = "nondeterministic"
CELL_TIMEOUT_S = 180

# Every notebook's first code cell; each holds a copy, so that it runs alone on Colab.
INSTALL_CELL = '''\
# Installs kvxfer where it is missing (Colab, a fresh TPU VM); does nothing where it is installed.
import importlib.util
import os
import subprocess
import sys

# 8 emulated devices on a CPU backend (no effect on a TPU); must be set before JAX is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if importlib.util.find_spec("kvxfer") is None:
    # KVXFER_SOURCE: anything pip installs (git+URL@branch, a wheel, a checkout's path).
    source = os.environ.get("KVXFER_SOURCE", "git+https://github.com/kvxfer/kvxfer")  # kvxfer's repo
    tpu = os.path.exists("/dev/accel0") or "COLAB_TPU_ADDR" in os.environ or "TPU_NAME" in os.environ
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, source, *(["jax[tpu]"] if tpu else [])], check=True)
    subprocess.run([*pip, "--no-deps", "nixl-cu12"], check=True)  # its torch dependency is not needed
    importlib.invalidate_caches()'''


def kernel_env(quick: bool = True) -> dict[str, str]:
    """The kernel's environment: CPU JAX with 8 emulated devices, matplotlib's inline backend;
    `quick` sets `KVXFER_NOTEBOOK_QUICK=1`, with which a notebook that sweeps a benchmark
    runs fewer points of each sweep (the same code; what those cells print is not
    compared). Stored outputs come from full runs (`scripts/run-notebooks`)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env.pop("KVXFER_NOTEBOOK_QUICK", None)
    if quick:
        env["KVXFER_NOTEBOOK_QUICK"] = "1"
    env.pop("MPLBACKEND", None)  # unset, ipykernel picks the inline backend: figures become PNGs
    return env


def read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def execute(path: Path, cwd: Path, quick: bool = True) -> nbformat.NotebookNode:
    """The notebook at `path`, run top to bottom in a fresh `python3` kernel (this interpreter).

    Raises `CellExecutionError` if a cell raises.
    """
    nb = read(path)
    client = NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S, coalesce_streams=True,
                            record_timing=False, resources={"metadata": {"path": str(cwd)}})
    client.execute(env=kernel_env(quick))
    return nb


def compared(cell: nbformat.NotebookNode) -> list[str]:
    """A code cell's outputs as the lines that must match: a header per output, then its text."""
    exact = NONDETERMINISTIC not in cell.metadata.get("tags", [])
    lines = []
    for out in cell.outputs:
        if out.output_type == "stream":
            lines.append(f"[{out.name}]")
            text = out.text
        elif out.output_type == "error":
            lines.append("[error]")
            text = f"{out.ename}: {out.evalue}"
        else:
            lines.append(f"[{out.output_type}: {', '.join(sorted(out.data))}]")
            text = out.data.get("text/plain", "")
        if exact:
            lines.extend(line.rstrip() for line in text.rstrip().splitlines())
    return lines


def problems(path: Path, cwd: Path) -> list[str]:
    """What a fresh run of the notebook at `path` finds wrong: a raising cell, or stale outputs."""
    try:
        fresh = execute(path, cwd)
    except CellExecutionError as e:
        return [f"{path}: a cell raised\n" + re.sub(r"\x1b\[[0-9;]*m", "", str(e))]  # no colours
    found = []
    for i, (stored, run) in enumerate(zip(read(path).cells, fresh.cells)):
        if stored.cell_type != "code" or compared(stored) == compared(run):
            continue
        diff = list(difflib.unified_diff(compared(stored), compared(run), "stored", "fresh run",
                                         lineterm="", n=2))
        first_line = stored.source.partition("\n")[0]
        found.append(f"{path}, cell {i} ({first_line!r}): stored outputs are stale\n"
                     + "\n".join(diff[:40] + ["..."] * (len(diff) > 40)))
    if found:
        found.append(f"Refresh the stored outputs: .venv/bin/python {REFRESH} {path}")
    return found
