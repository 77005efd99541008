"""The speed tables of README.md and docs/ are what their results files give (``benchmarks/tables.py``)."""
from __future__ import annotations

import os
import re

import pytest

from benchmarks import tables
from tests.helpers import ROOT


@pytest.mark.parametrize("name", sorted(tables.TABLES))
def test_a_generated_table_is_its_results_files_now(name):
    page, make = tables.TABLES[name]
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    start = f"<!-- generated: {name} -->\n"
    assert start in text, f"{page} has no generated table {name!r}"
    shown = text[text.index(start) + len(start):text.index("<!-- end generated -->", text.index(start))]
    assert shown == make() + "\n", f"{page}'s {name!r} table differs from its results files: python benchmarks/tables.py"
    cited = re.findall(r"`benchmarks/results/([^`]+)` \(dpool (\S+), commit (\w+)", shown)
    assert cited, f"the {name!r} table names no results file"
    for file, version, commit in cited:
        assert os.path.exists(os.path.join(tables.RESULTS, file)) and version != "?" and commit != "?", (file, version)


def test_the_check_fails_on_a_table_edited_by_hand(tmp_path, monkeypatch):
    """``tables.py --check`` reads the pages as they are: a cell changed by hand is found."""
    page = tmp_path / "README.md"
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    monkeypatch.setattr(tables, "ROOT", str(tmp_path))
    page.write_text(text)
    monkeypatch.setattr(tables, "TABLES", {"when-to-use": tables.TABLES["when-to-use"]})
    assert tables.main(["--check"]) == 0
    page.write_text(re.sub(r"\d\.\d\d×", "9.99×", text, count=1))
    assert tables.main(["--check"]) == 1
