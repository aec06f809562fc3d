"""``pytest tests/sim --seed N`` replays one seed of the simulation."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--seed", type=int, default=None, help="replay one simulation seed (tests/sim)")
    parser.addoption("--burst", action="store_true", default=False,
                     help="with --seed: replay the seed in the burst profile")
    parser.addoption("--sim-seeds", type=int, default=None, help="how many seeds the simulation sweep runs")


@pytest.fixture
def replay_seed(request: pytest.FixtureRequest) -> int | None:
    seed: int | None = request.config.getoption("--seed")
    return seed


@pytest.fixture
def replay_burst(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--burst"))
