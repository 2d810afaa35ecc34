"""The tree is the architecture: which layer may import which, no cycles, private modules
kept in their folder, and the public face (names, old paths, CLI, extra-config keys) pinned."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvxfer"

BASE = {"errors", "stats"}
ALLOWED = {  # layer -> the layers it may import (besides itself)
    "errors": set(),
    "stats": set(),
    "_moved": set(),
    "plan": BASE,
    "device": BASE | {"plan"},
    "nixl": BASE | {"plan", "device"},
    "connector": BASE | {"plan", "device", "nixl"},
    "vllm": BASE | {"plan", "device", "nixl", "connector"},
    "serve": BASE | {"plan", "nixl"},
    "demo": BASE | {"plan", "device", "nixl", "connector"},
    "bench": BASE | {"plan", "device", "nixl", "connector", "demo"},
    "cli": BASE | {"plan", "device", "nixl", "connector", "serve", "demo", "bench"},
    "__init__": BASE | {"_moved", "plan", "nixl", "connector"},
}
MAX_TOP_MODULES = 6


def _modules(package: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module under `package` (a package by its __init__)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `path` imports anywhere in it (functions and
    TYPE_CHECKING blocks count: a cycle hidden in a function is still a cycle)."""
    root = name.split(".")[0]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in found if m.split(".")[0] == root and m in modules and m != name}


def _layer(name: str) -> str:
    parts = name.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def violations(package: Path, allowed: dict[str, set[str]] = ALLOWED) -> list[str]:
    """Every import that breaks a layer rule, every cycle, every private module imported
    from outside its folder: one line each, naming the modules."""
    modules = _modules(package)
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    bad = []
    for name, deps in sorted(graph.items()):
        layer = _layer(name)
        for dep in sorted(deps):
            other = _layer(dep)
            if other != layer and other not in allowed.get(layer, set()):
                bad.append(f"{name} imports {dep}: layer {layer!r} may not import {other!r}")
            folder, private = dep.rpartition(".")[0], dep.rpartition(".")[2].startswith("_")
            here = name if modules[name].name == "__init__.py" else name.rpartition(".")[0]
            if private and here != folder:
                bad.append(f"{name} imports {dep}: a private module of another folder")
    bad += [f"import cycle: {' -> '.join(c)}" for c in _cycles(graph)]
    return bad


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected set of modules (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group) + [sorted(group)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_import_in_the_package_follows_the_layers():
    assert violations(PACKAGE) == []


def test_the_layer_check_names_a_planted_violation_a_cycle_and_a_private_import(tmp_path):
    pkg = tmp_path / "kvxfer"
    for folder in ("plan", "device"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "plan" / "blocks.py").write_text("from kvxfer.device import layout\n")
    (pkg / "device" / "layout.py").write_text("def f():\n    from kvxfer.plan import blocks\n")
    (pkg / "device" / "_xla.py").write_text("")
    (pkg / "plan" / "slots.py").write_text("import kvxfer.device._xla\n")
    found = violations(pkg)
    assert "kvxfer.plan.blocks imports kvxfer.device.layout: layer 'plan' may not import 'device'" in found
    assert "import cycle: kvxfer.device.layout -> kvxfer.plan.blocks -> kvxfer.device.layout" in found
    assert "kvxfer.plan.slots imports kvxfer.device._xla: a private module of another folder" in found


def test_the_top_of_the_package_holds_few_modules_besides_the_layers():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == {"plan", "device", "nixl", "connector", "vllm", "serve", "bench", "demo"}
    assert all((PACKAGE / f / "README.md").exists() for f in folders)


PUBLIC = ["ConnectorConfig", "CorruptionError", "DecodeConnector", "GroupSpec", "InvalidInputError",
          "KvxferError", "LayoutMismatchError", "LoadRequest", "PeerAddress", "PrefillConnector",
          "PrefillScheduler", "PrefillWorker", "SaveMeta", "ScheduledRequest", "Stats", "StreamParams",
          "Trace", "TransferError", "TransportConfig", "new_stream_id", "prompt_digest"]


def test_the_public_names_stay_where_users_import_them():
    import kvxfer

    assert sorted(kvxfer.__all__) == PUBLIC
    assert all(getattr(kvxfer, n).__name__ == n for n in PUBLIC)
    # vLLM loads the connector as `kv_connector_module_path` "kvxfer.vllm", name "TPUConnector".
    import kvxfer.vllm

    assert "TPUConnector" in kvxfer.vllm.__all__
    tree = ast.parse((PACKAGE / "vllm" / "connector.py").read_text())
    assert "TPUConnector" in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}


def test_the_extra_config_keys_and_the_cli_commands_stay():
    from kvxfer.vllm.settings import _ADDRESS, _option_keys

    assert _ADDRESS == ("host", "port", "name")
    connector, transport = _option_keys()
    assert connector == ["staging_blocks", "kernel_ratio", "verify_fingerprints", "stats", "precompile",
                         "stage_units", "host_pool_bytes", "seal_kv"]
    assert transport == ["handshake_timeout_s", "transfer_timeout_s", "lease_s", "heartbeat_interval_s",
                         "stream_wait_s", "ucx_tls", "num_threads", "progress_wake_us", "etcd_endpoints",
                         "fleet_key_file"]
    out = subprocess.run([sys.executable, "-m", "kvxfer.cli", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "{demo,kvbytes,plan,proxy,bench}" in out


@pytest.mark.parametrize("strict", [True, False])
def test_old_module_paths_give_the_moved_module_with_a_deprecation_warning(strict):
    from kvxfer._moved import MOVED

    flag = ["-W", "error::DeprecationWarning"] if strict else ["-W", "ignore::DeprecationWarning"]
    code = ("import importlib, sys\nfrom kvxfer._moved import MOVED\nout = []\n"
            "for old, new in MOVED.items():\n"
            "    try:\n"
            "        out.append(importlib.import_module(old) is importlib.import_module(new))\n"
            "    except DeprecationWarning as e:\n"
            "        out.append(str(e))\n"
            "    except ModuleNotFoundError as e:  # kvxfer.vllm.metrics needs vLLM\n"
            "        out.append(e.name == 'vllm' or repr(e))\n"
            "print(out)")
    got = eval(subprocess.run([sys.executable, *flag, "-c", code], capture_output=True, text=True,
                              check=True).stdout)
    if strict:
        assert got == [f"{old} is now {new}; the old path goes in the next release"
                       for old, new in MOVED.items()]
    else:
        assert got == [True] * len(MOVED)
