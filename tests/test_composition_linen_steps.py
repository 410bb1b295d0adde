"""The composition matrix (tests/_composition.py): nn.scan, MultiSteps, pmap, sharded jit, serialization."""

import pytest
from _composition import GROUPS, cells, run_cell


@cells(*GROUPS["linen_steps"])
def test_cell_traces(feature: str, part: str) -> None:
    run_cell(feature, part, trace=True)


@pytest.mark.slow
@cells(*GROUPS["linen_steps"], tier="train")
def test_cell_trains(feature: str, part: str) -> None:
    run_cell(feature, part)
