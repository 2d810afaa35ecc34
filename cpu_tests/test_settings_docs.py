"""The settings' defaults live once, in the dataclasses; the docs' tables are checked against
them here, so a field added, renamed or given another default without its row fails."""

import dataclasses
import re
from pathlib import Path

import pytest

from kvxfer.connector.config import ConnectorConfig
from kvxfer.nixl.agent import TransportConfig

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _rows(page: str, heading: str) -> list[list[str]]:
    """The cells of each row of the first table after the line starting `heading`."""
    lines = (DOCS / page).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    table = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            table.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif table:
            break
    return [row for row in table[2:]]  # past the header and its rule


def _names(cell: str) -> list[str]:
    return re.findall(r"`([a-z_]+)`", cell)


def _same(doc: str, value: object) -> bool:
    """Whether a default as the docs write it (`auto`, True, true, None, none, 4096) is `value`."""
    doc = doc.strip().strip("`")
    if value is None or isinstance(value, bool):
        return doc.lower() == str(value).lower()
    if isinstance(value, (int, float)):
        try:
            return float(doc) == float(value)
        except ValueError:
            return False
    return doc == str(value)


def _defaults(cls) -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(cls)
            if f.init and f.default is not dataclasses.MISSING}


@pytest.mark.parametrize("cls, heading", [
    (ConnectorConfig, "`ConnectorConfig` holds everything"),
    (TransportConfig, "`TransportConfig` holds the NIXL agent's settings"),
], ids=["ConnectorConfig", "TransportConfig"])
def test_the_connector_pages_settings_table_lists_every_field_with_its_default(cls, heading):
    rows = {_names(row[0])[0]: row[1] for row in _rows("connector.md", heading)}
    assert list(rows) == [f.name for f in dataclasses.fields(cls) if f.init]  # derived: not set
    wrong = {name: (rows[name], value) for name, value in _defaults(cls).items()
             if not _same(rows[name], value)}
    assert wrong == {}


def test_the_vllm_pages_extra_config_table_lists_every_option_with_its_default():
    from kvxfer.vllm.settings import _ADDRESS, _THRESHOLD, Settings, _option_keys

    documented: dict[str, str] = {}
    for row in _rows("vllm-and-serving.md", "`kv_connector_extra_config` keys"):
        names, defaults = _names(row[0]), [d.strip() for d in row[1].split(",")]
        if len(names) == len(defaults):  # `name`'s default is a sentence, not a value
            documented.update(zip(names, defaults))
        else:
            documented.update(dict.fromkeys(names, None))
    connector, transport = _option_keys()
    assert set(documented) == {*_ADDRESS, _THRESHOLD, *connector, *transport}
    defaults = {**_defaults(ConnectorConfig), **_defaults(TransportConfig), **_defaults(Settings)}
    wrong = {key: (documented[key], defaults[key]) for key in documented
             if documented[key] is not None and not _same(documented[key], defaults[key])}
    assert wrong == {}
