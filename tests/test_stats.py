"""tools/stats.py: Student's t distribution against its closed forms, far into the tail."""

import math

import pytest

from tools import stats

TS = (0.5, 2, 30, 1000, 3000)


@pytest.mark.parametrize("t", TS)
def test_t_matches_the_cauchy_and_the_two_dof_closed_forms_far_into_the_tail(t):
    """dof 1 is the Cauchy distribution, F(t) = 1/2 + atan(t) / pi; dof 2 has F(t) = 1/2 + t / (2 sqrt(2 + t^2)),
    whose tail 1 - F is 1 / (s (s + t)) with s = sqrt(2 + t^2). At dof 2, t = 3000 the tail is 5.6e-8: the p-value
    of a paired test with 3 seeds whose differences barely vary."""
    s = math.sqrt(2 + t * t)
    assert stats.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
    assert stats.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * s), abs=1e-12)
    # the tails themselves, relative to their size (1 - cdf would round a tail this small to a few digits)
    assert stats.t_sf(t, 1) == pytest.approx(math.atan(1 / t) / math.pi, rel=1e-9)
    assert stats.t_sf(t, 2) == pytest.approx(1 / (s * (s + t)), rel=1e-9)
    assert stats.t_cdf(-t, 2) == pytest.approx(1 / (s * (s + t)), rel=1e-9)  # symmetric


def test_a_t_test_far_in_the_tail_gives_its_small_p():
    """Three paired differences 1 - d, 1, 1 + d with d = sqrt(3) / 1000: their SD is d, so t = 1 / (d / sqrt(3)) =
    1000 on 2 degrees of freedom, and the two-sided p is 2 / (s (s + t)) = 1.0e-6."""
    d = math.sqrt(3) / 1000
    t = 1000
    s = math.sqrt(2 + t * t)
    assert stats.t_test_p([1 - d, 1.0, 1 + d]) == pytest.approx(2 / (s * (s + t)), rel=1e-6)
    assert stats.t_test_p([1 - d, 1.0, 1 + d]) == pytest.approx(1.0e-6, rel=1e-5)


def test_exact_rate_ci_is_clopper_pearson():
    """0 of n and n of n have closed forms (the one-sided 2.5% tails); 3 of 10 is the textbook [0.0667, 0.6525]."""
    assert stats.exact_rate_ci(0, 5) == (0.0, pytest.approx(1 - 0.025 ** (1 / 5), abs=1e-12))
    assert stats.exact_rate_ci(5, 5) == (pytest.approx(0.025 ** (1 / 5), abs=1e-12), 1.0)
    lo, hi = stats.exact_rate_ci(3, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.0667, 0.6525)


def test_rate_difference_ci_is_newcombes_hybrid_score_interval():
    """Newcombe (1998), method 10, his worked examples: 56/70 - 48/80 and 9/10 - 3/10."""
    d, lo, hi = stats.rate_difference_ci(56, 70, 48, 80)
    assert (round(d, 4), round(lo, 4), round(hi, 4)) == (0.2, 0.0524, 0.3339)
    d, lo, hi = stats.rate_difference_ci(9, 10, 3, 10)
    assert (round(d, 4), round(lo, 4), round(hi, 4)) == (0.6, 0.1705, 0.8090)
    d, lo, hi = stats.rate_difference_ci(5, 5, 0, 5)  # no collapse against every run: still an interval, inside [-1, 1]
    assert d == 1.0 and 0.3 < lo < 0.45 and hi == 1.0
