"""The composition matrix (tests/_composition.py): nn.scan, MultiSteps, pmap, sharded jit, serialization."""

import pytest
from _composition import GROUPS, cells, run_cell

pytestmark = pytest.mark.composition


@cells(*GROUPS["linen_steps"])
def test_cell_traces(feature: str, part: str) -> None:
    run_cell(feature, part, trace=True)


@cells(*GROUPS["linen_steps"], tier="train")
def test_cell_trains(feature: str, part: str) -> None:
    run_cell(feature, part)
