"""The composition matrix (tests/_composition.py): eager steps, meshes with Auto and Explicit axes,
convolution-only models.

The cells EDGE_TRACES names are traced (an eager column has nothing to trace without running
it); each column's ROWS are trained each column's ROWS (a subset for the eager and mesh columns: an eager step
dispatches every operation on its own, a mesh column's step compiles for 8 devices).
docs/composition.md says which cells run where, and why the subsets stand for their columns.
"""

import pytest
from _composition import EDGE_TRACES, GROUPS, cells, run_cell

pytestmark = pytest.mark.composition


@cells(*(p for p in GROUPS["edges"] if p in EDGE_TRACES), only=EDGE_TRACES)
def test_cell_traces(feature: str, part: str) -> None:
    run_cell(feature, part, trace=True)


@cells(*GROUPS["edges"], tier="train")
def test_cell_trains(feature: str, part: str) -> None:
    run_cell(feature, part)
