"""The composition matrix (tests/_composition.py): the NNX columns."""

from _composition import GROUPS, cells, run_cell


@cells(*GROUPS["nnx"])
def test_cell(feature: str, part: str) -> None:
    run_cell(feature, part)
