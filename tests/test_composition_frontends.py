"""The composition matrix (tests/_composition.py): the Linen, Hugging Face, dropout and BatchNorm columns."""

import pytest
from _composition import GROUPS, cells, run_cell

pytestmark = pytest.mark.composition


# Each Hugging Face GPT-2 cell traces a transformer: CI traces the column's first cell, nightly the rest.
@cells(*GROUPS["frontends"], first_in_ci=("huggingface_gpt2",))
def test_cell_traces(feature: str, part: str) -> None:
    run_cell(feature, part, trace=True)


@cells(*GROUPS["frontends"], tier="train")
def test_cell_trains(feature: str, part: str) -> None:
    run_cell(feature, part)
