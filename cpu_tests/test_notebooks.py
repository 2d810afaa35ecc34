"""Every notebook in notebooks/ runs top to bottom on CPU JAX.

Code cells are executed in order in a fresh interpreter (shell `!` and `%`
magic lines are skipped: they are install steps for Colab / TPU VMs), so a
notebook that raises, or whose asserts fail, fails here.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def notebook_source(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    code = []
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        lines = "".join(cell["source"]).splitlines()
        code.append("\n".join(ln for ln in lines if not ln.lstrip().startswith(("!", "%"))))
    return "\n\n".join(code)


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no .ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_on_cpu(path, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, "-c", notebook_source(path)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
