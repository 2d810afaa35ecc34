"""The docs hold together: a short README whose quick start is what CI runs, links that
resolve, and no file naming a Markdown file the repository does not have."""

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_BYTES = 8000

SCANNED = ("kvxfer", "cpu_tests", "tpu_tests", "vllm_tests", "serve_tests", "docs")
"""Folders whose files may not name a missing Markdown file (README.md too)."""

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_MARKDOWN_NAME = re.compile(r"[\w./-]+\.md\b")


def _files(top: Path) -> list[Path]:
    """Files under `top`, skipping hidden folders (.git, .venv*, caches) and build outputs."""
    out = []
    for folder, dirs, names in os.walk(top):
        dirs[:] = sorted(d for d in dirs if not (d.startswith(".") or d == "__pycache__"
                                                  or d.endswith(".egg-info")))
        out += [Path(folder) / n for n in sorted(names)]
    return out


def _markdown_pages() -> list[Path]:
    """README.md, docs/*.md and every README.md under kvxfer/."""
    return [README, *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "kvxfer").rglob("README.md"))]


def _links(text: str) -> list[str]:
    """Targets of inline Markdown links and images, outside code blocks and code spans."""
    prose = _CODE_SPAN.sub("", _FENCE.sub("", text))
    return _LINK.findall(prose)


def _quick_start_commands() -> list[str]:
    """The lines of the first shell block under the README's "Quick start" heading."""
    section = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)\n```", section, re.S)
    assert block, "the README's Quick start has no ```sh block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_is_at_most_8000_bytes():
    size = len(README.read_bytes())
    assert size <= MAX_README_BYTES, f"README.md is {size} bytes; move detail into docs/"


def test_the_readme_has_no_module_map_beyond_its_links():
    rows = [line for line in README.read_text().splitlines() if line.startswith("| `kvxfer")]
    assert rows == [], "the module map lives in docs/architecture.md only"


def test_every_relative_link_in_the_readme_docs_and_folder_readmes_resolves():
    broken = []
    for page in _markdown_pages():
        for target in _links(page.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL (http, https, mailto) or an anchor in the same page
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_the_pages_the_readme_promises_exist():
    for name in ("architecture", "save-plans", "connector", "vllm-and-serving", "observability",
                 "benchmarks", "testing", "wire-protocol", "glossary"):
        assert (ROOT / "docs" / f"{name}.md").is_file(), name
        assert f"(docs/{name}.md)" in README.read_text(), f"the README does not link {name}"


def test_no_file_names_a_markdown_file_that_does_not_exist():
    existing = {p.name for p in _files(ROOT) if p.suffix == ".md"}
    files = [README] + [p for folder in SCANNED for p in _files(ROOT / folder)]
    missing = []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # a binary: a built extension, an image
        for name in sorted(set(_MARKDOWN_NAME.findall(text))):
            relative = name.lstrip("/")
            if ((ROOT / relative).exists() or (path.parent / name).exists()
                    or Path(name).name in existing):
                continue
            missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert missing == []


def test_the_readme_quick_start_holds_the_two_commands_ci_runs():
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    demo, tests = commands
    assert demo.startswith("python3 -m venv .venv") and demo.endswith("kvxfer demo")
    assert tests.startswith("bash scripts/test-deps && ")
    ci = (ROOT / ".ci" / "run").read_text()
    assert any(line.startswith(tests) for line in ci.splitlines()), (
        "the README's test command is not the one .ci/run runs")
    assert any(line.startswith(demo) for line in ci.splitlines()), (
        "the README's demo command is not the one .ci/run runs")
