"""The docs' lists of what the code has: docs/configuration.md names every registered model.name and every config in
configs/, and docs/models.md describes every model's file."""

from __future__ import annotations

import re

from flame.models import known_models
from tests.helpers import REPO

CONFIGURATION = (REPO / "docs" / "configuration.md").read_text()


def table_row(text: str, first_cell: str) -> str:
    (row,) = [line for line in text.splitlines() if line.startswith(f"| {first_cell} |")]
    return row


def test_configuration_lists_every_model_name():
    row = table_row(CONFIGURATION, "`model`")
    listed = re.search(r"`name` \(([^)]*)\)", row).group(1)
    assert sorted(re.findall(r"`([^`]+)`", listed)) == known_models()


def test_configuration_lists_every_config():
    section = CONFIGURATION.split("| config |", 1)[1].split("\n\n", 1)[0]   # the table of configs/
    listed = {name for line in section.splitlines() if line.startswith("| `")
              for name in re.findall(r"`([^`]+)`", line.split("|")[1])}
    assert listed == {p.stem for p in (REPO / "configs").glob("*.toml")}


def test_models_doc_describes_every_model():
    text = (REPO / "docs" / "models.md").read_text()
    assert [name for name in known_models() if f"`flame/models/{name}.py`" not in text] == []
