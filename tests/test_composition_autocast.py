"""The composition matrix (tests/_composition.py): the autocast (Equinox, a user's jax.checkpoint) columns."""

import pathlib
import re

import pytest
from _composition import (
    EDGE_TRACES,
    EXPECTED_ERRORS,
    EXPECTED_WARNINGS,
    FEATURES,
    GROUPS,
    KNOWN_BUGS,
    PARTS,
    cells,
    rows,
    run_cell,
)

pytestmark = pytest.mark.composition


@cells(*GROUPS["autocast"])
def test_cell_traces(feature: str, part: str) -> None:
    run_cell(feature, part, trace=True)


@cells(*GROUPS["autocast"], tier="train")
def test_cell_trains(feature: str, part: str) -> None:
    run_cell(feature, part)


@pytest.mark.unit
def test_every_column_runs_in_exactly_one_file() -> None:
    runs = [part for group in GROUPS.values() for part in group]
    assert sorted(runs) == sorted(PARTS) and len(runs) == len(set(runs))


@pytest.mark.unit
def test_the_docs_table_is_this_matrix() -> None:
    """docs/composition.md shows the matrix in tables of some columns each (every row in each), which
    together are PARTS in order; a cell reads yes, error (EXPECTED_ERRORS), warning (EXPECTED_WARNINGS),
    bug (KNOWN_BUGS); a row outside the column's ROWS reads traced (EDGE_TRACES) or "not run"."""
    lines = (pathlib.Path(__file__).parent.parent / "docs" / "composition.md").read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("| feature |")]
    assert starts
    columns: list[str] = []
    for start in starts:
        end = next(i for i in range(start, len(lines) + 1) if i == len(lines) or not lines[i].startswith("|"))
        header, body = lines[start], lines[start + 2 : end]
        table = [c.strip().strip("`") for c in header.split("|")[2:-1]]
        table_rows = {
            line.split("|")[1].strip().strip("`"): [c.strip() for c in line.split("|")[2:-1]] for line in body
        }
        assert list(table_rows) == list(FEATURES), table
        for feature, row in table_rows.items():
            assert len(row) == len(table), (feature, table)
            for part, cell in zip(table, row):
                want = (
                    ("traced" if feature in EDGE_TRACES.get(part, ()) else "notrun")
                    if feature not in rows(part)
                    else "error"
                    if (feature, part) in EXPECTED_ERRORS
                    else "bug"
                    if (feature, part) in KNOWN_BUGS
                    else "warning"
                    if (feature, part) in EXPECTED_WARNINGS
                    else "yes"
                )
                assert re.sub(r"\W", "", cell) == want, (feature, part, cell)
        columns += table
    assert columns == list(PARTS)
