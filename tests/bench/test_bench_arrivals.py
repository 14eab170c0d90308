"""Arrival processes: statistics with a fixed seed, exact fixed-rate and burst schedules."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tandem.bench.arrivals import arrival_offsets, resolve_arrival

pytestmark = pytest.mark.timeout(30)


def gaps(offsets: list[float]) -> np.ndarray:
    return np.diff(np.asarray(offsets))


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    assert arrival_offsets(0, 3.0) == []


def test_fixed_rate_is_exact():
    off = arrival_offsets(5, 4.0, "fixed")
    assert off == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_poisson_mean_interval_and_spread():
    off = arrival_offsets(20001, 10.0, "poisson", seed=1)
    g = gaps(off)
    assert off[0] == 0.0 and np.all(g >= 0)
    assert g.mean() == pytest.approx(0.1, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness(burstiness):
    g = gaps(arrival_offsets(20001, 5.0, "gamma", burstiness, seed=2))
    assert g.mean() == pytest.approx(0.2, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_seeded_and_reproducible():
    assert arrival_offsets(50, 3.0, seed=7) == arrival_offsets(50, 3.0, seed=7)
    assert arrival_offsets(50, 3.0, seed=7) != arrival_offsets(50, 3.0, seed=8)
    # gamma with burstiness 1 is the Poisson process
    assert arrival_offsets(50, 3.0, "gamma", 1.0, seed=3) == arrival_offsets(50, 3.0, "poisson", seed=3)


def test_bad_settings():
    for rate in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            arrival_offsets(3, rate)
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, "uniform")
    assert resolve_arrival(None, 1.0) == "poisson"
    assert resolve_arrival(None, 0.5) == "gamma"
    assert resolve_arrival("fixed", 1.0) == "fixed"
    with pytest.raises(ValueError):
        resolve_arrival("poisson", 2.0)
    with pytest.raises(ValueError):
        resolve_arrival(None, 0.0)
