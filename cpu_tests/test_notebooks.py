"""Every notebook in notebooks/ runs top to bottom in a Jupyter kernel on CPU JAX, and its
stored outputs are what it prints now.

A notebook fails if a cell raises (asserts included) or if a fresh run changes
its stored outputs (see `notebook_exec` for what is compared). Refresh them
with `.venv/bin/python scripts/run-notebooks`.
"""

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output
from notebook_exec import INSTALL_CELL, NONDETERMINISTIC, NOTEBOOKS, REFRESH, problems, read


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no .ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_code_cell_installs_kvxfer_only_where_missing(path):
    first = next(c for c in read(path).cells if c.cell_type == "code")
    assert first.source == INSTALL_CELL, (
        f"{path.name}: the first code cell must be notebook_exec.INSTALL_CELL, verbatim")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_and_its_stored_outputs_are_fresh(path, tmp_path):
    found = problems(path, tmp_path)
    if found:
        pytest.fail("\n\n".join(found), pytrace=False)


def _notebook(tmp_path, *cells):
    path = tmp_path / "check.ipynb"
    nbformat.write(new_notebook(cells=list(cells)), path)
    return path


def test_a_raising_cell_is_reported(tmp_path):
    path = _notebook(tmp_path, new_code_cell("x = 1"), new_code_cell("raise ValueError('boom')"))
    found = problems(path, tmp_path)
    assert len(found) == 1 and str(path) in found[0] and "ValueError: boom" in found[0]


def test_stale_text_is_reported_but_not_a_nondeterministic_cell_or_image_bytes(tmp_path):
    png = {"image/png": "aGVsbG8=", "text/plain": "<Figure size 640x480 with 1 Axes>"}
    stale = new_code_cell('print("fresh")', outputs=[new_output("stream", text="stale\n")])
    timing = new_code_cell("import time; print(time.time())", metadata={"tags": [NONDETERMINISTIC]},
                           outputs=[new_output("stream", text="0.0\n")])
    figure = new_code_cell(
        "import matplotlib.pyplot as plt; plt.plot([1, 2]); plt.show()",
        outputs=[new_output("display_data", data=png)])
    found = problems(_notebook(tmp_path, stale, timing, figure), tmp_path)
    assert len(found) == 2, found
    assert "cell 0" in found[0] and "-stale" in found[0] and "+fresh" in found[0]
    assert REFRESH in found[1]
