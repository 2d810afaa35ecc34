"""The package's shape: what importing it loads, and sizes a newcomer can read."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvxfer"
HARNESSES = ("demo", "bench")  # programs built on the library, not the library

MAX_FILE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 600, 300, 80


def _loaded_after(code: str) -> list[str]:
    """Top-level packages among JAX, numpy and NIXL that `code` loads in a fresh interpreter."""
    probe = (f"{code}; import sys; print(sorted({{m.split('.')[0] for m in sys.modules}} & "
             f"{{'jax', 'jaxlib', 'numpy', 'nixl', 'nixl_cu12', 'vllm', 'torch'}}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return eval(out.stdout)  # a printed list of str


@pytest.mark.parametrize("module", ["kvxfer", "kvxfer.connector.scheduler", "kvxfer.connector.config",
                                    "kvxfer.nixl.wire", "kvxfer.plan.slots", "kvxfer.plan.save_plan",
                                    "kvxfer.stats"])
def test_the_scheduler_side_loads_neither_jax_numpy_nor_nixl(module):
    assert _loaded_after(f"import {module}") == []


def test_the_top_level_names_load_their_modules_on_first_use():
    code = "import kvxfer; kvxfer.PrefillScheduler; kvxfer.LoadRequest; kvxfer.TransportConfig"
    assert _loaded_after(code) == []
    assert "jax" in _loaded_after("import kvxfer; kvxfer.DecodeConnector")
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        import kvxfer

        kvxfer.Nothing  # noqa: B018


def _library_files() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if p.relative_to(PACKAGE).parts[0] not in HARNESSES]


def test_no_library_file_class_or_function_is_too_long_to_read_in_one_sitting():
    long = []
    for path in _library_files():
        source = path.read_text()
        name = path.relative_to(PACKAGE.parent)
        if source.count("\n") > MAX_FILE_LINES:
            long.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            limit = (MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
            if limit and node.end_lineno - node.lineno + 1 > limit:
                long.append(f"{name}: {node.name} is {node.end_lineno - node.lineno + 1} lines")
    assert long == []


def test_every_library_module_says_what_it_exports():
    missing = [str(p.relative_to(PACKAGE.parent)) for p in _library_files()
               if p.name != "__init__.py" and "__all__" not in p.read_text()]
    assert missing == []
