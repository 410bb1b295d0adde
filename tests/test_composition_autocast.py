"""The composition matrix (tests/_composition.py): the autocast (Equinox, a user's jax.checkpoint) columns."""

import pathlib
import re

import pytest
from _composition import EXPECTED_ERRORS, FEATURES, GROUPS, PARTS, cells, run_cell


@cells(*GROUPS["autocast"])
def test_cell_traces(feature: str, part: str) -> None:
    run_cell(feature, part, trace=True)


@pytest.mark.slow
@cells(*GROUPS["autocast"])
def test_cell_trains(feature: str, part: str) -> None:
    run_cell(feature, part)


def test_every_column_runs_in_exactly_one_file() -> None:
    runs = [part for group in GROUPS.values() for part in group]
    assert sorted(runs) == sorted(PARTS) and len(runs) == len(set(runs))


def test_the_docs_table_is_this_matrix() -> None:
    lines = (pathlib.Path(__file__).parent.parent / "docs" / "composition.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| feature |"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    header, body = lines[start], lines[start + 2 : end]
    columns = [c.strip().strip("`") for c in header.split("|")[2:-1]]
    rows = {
        line.split("|")[1].strip().strip("`"): [c.strip() for c in line.split("|")[2:-1]] for line in body
    }
    assert columns == list(PARTS)
    assert list(rows) == list(FEATURES)
    for feature, row in rows.items():
        for part, cell in zip(columns, row):
            want = "error" if (feature, part) in EXPECTED_ERRORS else "yes"
            assert re.sub(r"\W", "", cell) == want, (feature, part, cell)
