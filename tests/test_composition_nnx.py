"""The composition matrix (tests/_composition.py): the NNX columns."""

import pytest
from _composition import GROUPS, cells, run_cell

pytestmark = pytest.mark.composition


@cells(*GROUPS["nnx"])
def test_cell_traces(feature: str, part: str) -> None:
    run_cell(feature, part, trace=True)


@cells(*GROUPS["nnx"], tier="train")
def test_cell_trains(feature: str, part: str) -> None:
    run_cell(feature, part)
