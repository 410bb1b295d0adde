"""The composition matrix (tests/_composition.py): the Linen, Hugging Face, dropout and BatchNorm columns."""

from _composition import GROUPS, cells, run_cell


@cells(*GROUPS["frontends"])
def test_cell(feature: str, part: str) -> None:
    run_cell(feature, part)
