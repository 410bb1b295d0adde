"""The composition matrix (tests/_composition.py): the Linen, Hugging Face, dropout and BatchNorm columns."""

import pytest
from _composition import GROUPS, cells, run_cell


# Hugging Face GPT-2's traces take 2 to 4 s a cell (cold, 2 cores): CI traces its first, nightly the rest.
@cells(*GROUPS["frontends"], slow=("huggingface_gpt2",))
def test_cell_traces(feature: str, part: str) -> None:
    run_cell(feature, part, trace=True)


@pytest.mark.slow
@cells(*GROUPS["frontends"], tier="train")
def test_cell_trains(feature: str, part: str) -> None:
    run_cell(feature, part)
