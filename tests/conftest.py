"""The suite's tiers, one folder each: tests/unit (no services), tests/integration (a real
PostgreSQL and/or moto's S3 server), tests/acceptance (the `derivd` process itself); see
tests/support/tiers.py. Each test gets its folder's marker, so `-m unit` and `tests/unit`
select the same tests; a test whose fixtures need a higher tier than its folder's fails
before they start. With PYTEST_DERIVD_TIER=unit the service fixtures fail, which proves
that the unit tier needs none.

What the test modules share lives in tests/support, on sys.path (pyproject's
`pythonpath`): the fixture modules registered below, the rest of the `fixtures` package,
`helpers`, `configs`, `imagegen`, `fidelity` and `faulthandlers`. No test module imports
another (tests/unit/test_layout.py); tests/support/place.py places a new one.
"""

from __future__ import annotations

import pytest
from tiers import TIERS, folder_tier, needed_tier

pytest_plugins = [
    "fixtures.services",
    "fixtures.daemon",
    "fixtures.pixels",
    "fixtures.backfill",
]


_BELOW_ITS_TIER = pytest.StashKey[str]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        needed, folder = needed_tier(item), folder_tier(item.path)
        # Outside the tier folders (a module not yet placed): its own tier, and
        # tests/unit/test_layout.py fails until it moves.
        tier = folder or needed
        if TIERS.index(needed) > TIERS.index(tier):
            item.stash[_BELOW_ITS_TIER] = f"this test needs the {needed} tier: tests/{needed}/"
        item.add_marker(getattr(pytest.mark, tier))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before any fixture starts a service the folder promises not to need.
    if _BELOW_ITS_TIER in item.stash:
        pytest.fail(item.stash[_BELOW_ITS_TIER], pytrace=False)
