"""The composition matrix (tests/_composition.py): nn.scan, MultiSteps, pmap, sharded jit, serialization."""

from _composition import GROUPS, cells, run_cell


@cells(*GROUPS["linen_steps"])
def test_cell(feature: str, part: str) -> None:
    run_cell(feature, part)
