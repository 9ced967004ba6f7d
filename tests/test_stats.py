"""tools/stats.py: Student's t distribution against its closed forms, far into the tail; the exact tests and intervals
against known values, for large n too; inputs no study gives refused."""

import math
import re
from fractions import Fraction

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


# --- the edges: inputs no study gives are refused in one line; large n stays exact ---------------------------------

@pytest.mark.parametrize("holm_rule", [stats.holm, stats.holm_adjusted])
@pytest.mark.parametrize("pvalues, bad", [([math.nan, 0.01], "p-value 0 is nan"), ([0.01, 1.5], "p-value 1 is 1.5"),
                                          ([-0.1], "p-value 0 is -0.1")])
def test_holm_and_its_adjusted_p_refuse_alike_a_p_that_is_not_a_probability(holm_rule, pvalues, bad):
    """A NaN sorts nowhere and compares false with alpha, so the step-down would reject it; both functions refuse it
    (and any p outside [0, 1]) with the same one line, so that the verdict and the adjusted p never disagree."""
    with pytest.raises(ValueError, match=f"^{holm_rule.__name__}: {re.escape(bad)}, not in \\[0, 1\\]$"):
        holm_rule(pvalues)
    assert stats.holm([0.01, 1.0, 0.0]) == [True, False, True]  # the ends of [0, 1] are probabilities
    assert stats.holm_adjusted([0.01, 1.0, 0.0]) == [0.02, 1.0, 0.0]


@pytest.mark.parametrize("call, message", [
    (lambda: stats.fisher_exact(6, 5, 0, 5), "fisher_exact (a, n1): 6 events in 5 runs; a run has at most one"),
    (lambda: stats.fisher_exact(0, 5, 6, 5), "fisher_exact (b, n2): 6 events in 5 runs; a run has at most one"),
    (lambda: stats.fisher_exact(-1, 5, 0, 5), "fisher_exact (a, n1): events -1 is not a whole number >= 0"),
    (lambda: stats.fisher_exact(1.5, 5, 0, 5), "fisher_exact (a, n1): events 1.5 is not a whole number >= 0"),
    (lambda: stats.exact_rate_ci(6, 5), "exact_rate_ci: 6 events in 5 runs; a run has at most one"),
    (lambda: stats.exact_rate_ci(0, 0), "exact_rate_ci: 0 runs; a rate needs at least one"),
    (lambda: stats.wilson_ci(3, 2), "wilson_ci: 3 events in 2 runs; a run has at most one"),
    (lambda: stats.rate_difference_ci(1, 5, 6, 5), "wilson_ci: 6 events in 5 runs; a run has at most one"),
    (lambda: stats.exact_trend([(0, 5, 0), (1, 5, 7)]), "exact_trend (arm of score 1): 7 events in 5 runs; a run"),
    (lambda: stats.mean_ci([0.3]), "mean_ci: 1 value(s); an interval or a test needs at least 2"),
    (lambda: stats.logit_mean_ci([0.3]), "logit_mean_ci: 1 value(s); an interval or a test needs at least 2"),
    (lambda: stats.t_test_p([0.3]), "t_test_p: 1 value(s); an interval or a test needs at least 2"),
    (lambda: stats.mean_ci([]), "mean_ci: 0 value(s)"),
    (lambda: stats.mean_ci([0.1, math.nan]), "mean_ci: value 1 is nan, not a finite number"),
    (lambda: stats.t_test_p([0.1, math.inf]), "t_test_p: value 1 is inf, not a finite number"),
    (lambda: stats.logit_mean_ci([0.1, 1.2]), "logit_mean_ci: value 1 is 1.2, not a proportion in [0, 1]"),
    # every other function: a NaN or infinity, and an input too small for what it claims
    (lambda: stats.t_sf(math.nan, 3), "t_sf (x): nan is not a finite number"),
    (lambda: stats.t_sf(1.0, 0.5), "t_sf (dof): 0.5 is not a number of degrees of freedom >= 1"),
    (lambda: stats.t_cdf(math.inf, 3), "t_cdf (x): inf is not a finite number"),
    (lambda: stats.t_quantile(1.0, 3), "t_quantile (p): 1.0 is not a probability strictly between 0 and 1"),
    (lambda: stats.t_quantile(0.975, math.nan), "t_quantile (dof): nan is not a number of degrees of freedom >= 1"),
    (lambda: stats.paired_power(math.nan, 1.0, 5), "paired_power (delta): nan is not a finite number"),
    (lambda: stats.paired_power(1.0, 0.0, 5), "paired_power (sd): 0.0 is not a spread > 0"),
    (lambda: stats.paired_power(1.0, 1.0, 1), "paired_power (n): 1 is not a whole number >= 2"),
    (lambda: stats.min_detectable(math.inf, 5), "min_detectable (sd): inf is not a spread > 0"),
    (lambda: stats.min_detectable(1.0, 5, power=0.01), "min_detectable (power): 0.01 is not a power between alpha"),
    (lambda: stats.holm([0.01], alpha=math.nan), "holm (alpha): nan is not a probability strictly between 0 and 1"),
    (lambda: stats.pearson([math.nan, 1, 2], [1, 2, 3]), "pearson (xs): value 0 is nan, not a finite number"),
    (lambda: stats.pearson([1], [2]), "pearson (xs): 1 value(s); a correlation needs at least 2"),
    (lambda: stats.pearson([1, 2], [1, 2, 3]), "pearson: 2 xs and 3 ys; each x needs its y"),
    (lambda: stats.fisher_exact(0, 0, 1, 5), "fisher_exact (a, n1): 0 runs; a rate needs at least one"),
    (lambda: stats.exact_trend([(math.nan, 5, 1), (1, 5, 2)]), "exact_trend (arm 0's score): nan is not a finite"),
    (lambda: stats.exact_trend([(0.5, 5, 1), (1, 0, 0)]), "exact_trend: 2 arm(s) with runs at one score; a trend"),
    (lambda: stats.wilson_ci(1, 5, level=1.5), "wilson_ci (level): 1.5 is not a probability strictly between"),
    (lambda: stats.incidence_power(math.nan, 0.1, 5), "incidence_power (p1): nan is not a rate in [0, 1]"),
    (lambda: stats.incidence_power(0.8, 1.2, 5), "incidence_power (p0): 1.2 is not a rate in [0, 1]"),
    (lambda: stats.incidence_power(0.8, 0.1, 0), "incidence_power (n): 0 is not a whole number >= 1"),
    (lambda: stats.min_detectable_incidence(math.nan, 5), "min_detectable_incidence (p0): nan is not a rate in [0, 1]"),
    (lambda: stats.rank_correlation_p([1, 2, math.inf], [1, 2, 3]), "rank_correlation_p (xs): value 2 is inf, not a"),
    (lambda: stats.rank_correlation_p([1], [1]), "rank_correlation_p (xs): 1 value(s); a correlation needs at least"),
    (lambda: stats.sign_flip_p([math.nan, 0.1, 0.2]), "sign_flip_p: value 0 is nan, not a finite number"),
    (lambda: stats.sign_flip_p([0.1]), "sign_flip_p: 1 value(s); an interval or a test needs at least 2"),
    (lambda: stats.sign_flip_p([0.1] * 21), "sign_flip_p: 21 differences; the exact test lists 2^n flips, at most"),
    (lambda: stats.slope_ci([1, 2, 3], [1, math.nan, 3]), "slope_ci (ys): value 1 is nan, not a finite number"),
    (lambda: stats.slope_ci([1, 2], [1, 2]), "slope_ci (xs): 2 value(s); a slope's interval needs at least 3"),
    (lambda: stats.slope_ci([1, 1, 1], [1, 2, 3]), "slope_ci (xs): all 3 equal; a slope needs different x"),
    (lambda: stats.auc([math.nan], [0.1]), "auc (positives): value 0 is nan, not a finite number"),
    (lambda: stats.auc([0.1], []), "auc (negatives): 0 value(s); an AUC needs at least 1"),
    (lambda: stats.auc_bootstrap_ci([0.004], [0.001]),
     "auc_bootstrap_ci (positives): 1 value(s); a bootstrap interval needs at least 2"),
    (lambda: stats.auc_bootstrap_ci([0.004, 0.005], [0.001, math.nan]),
     "auc_bootstrap_ci (negatives): value 1 is nan, not a finite number"),
])
def test_inputs_no_study_gives_are_refused_in_one_line_naming_the_argument(call, message):
    """6 events in 5 runs gave Fisher's p 0, one value a 95% interval of width 0, a NaN difference a sign-flip p of 0
    and an AUC of 0, one run of each class a bootstrap interval [1, 1]: numbers with no meaning. Each is a ValueError
    (stats.ImpossibleInput) whose one line names the function and the argument."""
    with pytest.raises(stats.ImpossibleInput) as refused:
        call()
    assert isinstance(refused.value, ValueError) and str(refused.value).startswith(message)
    assert "\n" not in str(refused.value)


def test_the_tools_end_on_an_impossible_input_with_one_line_and_exit_code_2(capsys):
    """cli.guard, as the tools call it: stats' refusal is bad input like any other, not a traceback."""
    from cegppo_utils import cli
    with pytest.raises(SystemExit) as ended:
        cli.guard("study.py", lambda: stats.mean_ci([0.3]), refused=(stats.ImpossibleInput,))
    assert ended.value.code == 2
    assert capsys.readouterr().err == "study.py: error: mean_ci: 1 value(s); an interval or a test needs at least 2\n"
    with pytest.raises(stats.ImpossibleInput):  # only where the tool says so: elsewhere it stays an exception
        cli.guard("study.py", lambda: stats.mean_ci([0.3]))


def test_exact_rate_ci_is_exact_for_large_n():
    """n = 1100 overflowed a float (math.comb(1100, 550) is 1e329). 550 of 1100: the Clopper-Pearson ends are the
    Beta(550, 551) quantile at 0.025 and the Beta(551, 550) quantile at 0.975, 0.47003156913614878 and
    0.52996843086385121 (mpmath's regularized incomplete beta at 40 digits, bisected); symmetric about 1/2. 0 of 1100
    has the closed form [0, 1 - 0.025^(1/1100)]. The tails summed in floating point hold about 1e-13 here."""
    lo, hi = stats.exact_rate_ci(550, 1100)
    assert lo == pytest.approx(0.47003156913614878, abs=1e-12) and hi == pytest.approx(0.52996843086385121, abs=1e-12)
    assert stats.exact_rate_ci(0, 1100) == (0.0, pytest.approx(1 - 0.025 ** (1 / 1100), abs=1e-12))
    assert stats.exact_rate_ci(1100, 1100) == (pytest.approx(0.025 ** (1 / 1100), abs=1e-12), 1.0)
    lo, hi = stats.exact_rate_ci(3, 10)  # the small-n values stand as they were
    assert (round(lo, 4), round(hi, 4)) == (0.0667, 0.6525)


def test_the_binomial_terms_are_exact_past_a_floats_range():
    """incidence_power's and exact_rate_ci's terms, from lgamma: 550 of 1100 at p = 1/2 is comb(1100, 550) / 2^1100
    (a ratio of whole numbers Python divides exactly), and the terms sum to 1. incidence_power over 5 runs per arm
    equals the sum of Fisher's rejection region with exact rational binomial weights."""
    pmf = stats._binom_pmfs(1100, 0.5)
    assert pmf[550] == pytest.approx(math.comb(1100, 550) / 2 ** 1100, rel=1e-11)
    assert sum(pmf) == pytest.approx(1.0, abs=1e-12)
    assert stats._binom_pmfs(3, 0.0) == [1.0, 0.0, 0.0, 0.0] and stats._binom_pmfs(3, 1.0) == [0.0, 0.0, 0.0, 1.0]

    def weight(k, p):
        return Fraction(math.comb(5, k)) * p ** k * (1 - p) ** (5 - k)
    p1, p0 = Fraction(4, 5), Fraction(1, 10)
    exact = sum(weight(a, p1) * weight(b, p0) for a in range(6) for b in range(6) if stats.fisher_exact(a, 5, b, 5)
                <= 0.05)
    assert stats.incidence_power(0.8, 0.1, 5) == pytest.approx(float(exact), rel=1e-12)


def test_fisher_and_the_trend_test_are_exact_for_large_n():
    """Two arms of equal size: the hypergeometric is symmetric, so Fisher's rule (every split no more likely than the
    one seen) and the trend test's (every split as far from the mean) take the same splits: both against that tail
    summed exactly in whole numbers (Fisher's at 550 and 500 of 1100 each). The trend test's weights (products of
    binomial coefficients, past 1e308 for 500 of 1000 beside 40 of 60) were floats, which gave p = 0 there; now they
    are whole numbers."""
    def central_tail(a, b, n):
        total, mean = a + b, Fraction(a + b, 2)
        return float(Fraction(sum(math.comb(n, k) * math.comb(n, total - k) for k in range(total + 1)
                                  if abs(k - mean) >= abs(a - mean)), math.comb(2 * n, total)))
    assert stats.fisher_exact(550, 1100, 500, 1100) == pytest.approx(central_tail(550, 500, 1100), rel=1e-9)
    assert stats.exact_trend([(0, 100, 50), (1, 100, 45)]) == pytest.approx(central_tail(50, 45, 100), rel=1e-9)
    total = 540  # 500 of 1000 and 40 of 60: the events in the second arm, hypergeometric, two-sided about its mean
    tail = {k: Fraction(math.comb(60, k) * math.comb(1000, total - k), math.comb(1060, total)) for k in range(61)}
    mean = sum(k * w for k, w in tail.items())
    expected = float(sum(w for k, w in tail.items() if abs(k - mean) >= abs(40 - mean)))
    assert stats.exact_trend([(0, 1000, 500), (1, 60, 40)]) == pytest.approx(expected, rel=1e-9)


def test_the_power_of_a_paired_test_with_two_pairs_is_the_integral_over_its_sd():
    """With 2 pairs (1 degree of freedom) the sample SD over the true one is |Z|, half-normal, and the power is the
    integral of P(|Z' + ncp| > c s) over its density. scipy's nct.cdf far in the lower tail gives NaN at ncp 15 and 18,
    which made the minimum detectable effect at 2 seeds wrong (20.2 points at SD 1.75 read 12.9)."""
    from scipy import integrate
    from scipy import stats as sps
    c = sps.t.ppf(0.975, 1)

    def power(ncp):
        def integrand(s):
            tails = sps.norm.cdf(-c * s - ncp) + sps.norm.sf(c * s - ncp)
            return math.sqrt(2 / math.pi) * math.exp(-s * s / 2) * tails
        return integrate.quad(integrand, 0, 40, limit=200)[0]
    for ncp in (2.0, 15.0, 18.0, 25.0):
        assert stats.paired_power(ncp / math.sqrt(2), 1.0, 2) == pytest.approx(power(ncp), abs=1e-12)
    mde = stats.min_detectable(1.75, 2)
    assert stats.paired_power(mde, 1.75, 2) == pytest.approx(0.8, abs=1e-9) and round(mde, 1) == 20.2
    far = stats.min_detectable(1.0, 2, alpha=0.001)  # 577 SDs: past the 100 SDs a fixed search range stopped at
    assert far > 500 and stats.paired_power(far, 1.0, 2, alpha=0.001) == pytest.approx(0.8, abs=1e-9)


def test_the_sign_flip_p_counts_ties_that_floating_point_splits():
    """Differences of accuracies in steps of 1/800, as floats: flips whose sums are equal in exact arithmetic differ
    in the last bits. Counted against the exact rational sums, the p is 76 / 128; scipy's permutation_test, whose
    tolerance is relative to the observed sum (2e-14 of 0.00375), gives 70 / 128 on the same input."""
    from itertools import product
    accuracy = [(0.8025, 0.8), (0.7, 0.6975), (0.60125, 0.6), (0.6, 0.60125), (0.5, 0.50125), (0.41125, 0.41),
                (0.3, 0.30125)]
    diffs = [a - b for a, b in accuracy]
    exact = [Fraction(a).limit_denominator(800) - Fraction(b).limit_denominator(800) for a, b in accuracy]
    seen = abs(sum(exact))
    hits = sum(abs(sum(s * d for s, d in zip(signs, exact))) >= seen for signs in product((1, -1), repeat=7))
    assert hits == 76 and stats.sign_flip_p(diffs) == hits / 128


def test_rank_correlation_p_is_exact_over_every_pairing_when_they_are_few():
    """5 pairs have 120 pairings, fewer than the 20,000 permutations: the p is the exact share with |rho| at least
    the one seen, 16 / 120 here (counted by hand below); rho is Spearman's, ties averaged."""
    from itertools import permutations
    xs, ys = [1, 2, 3, 4, 5], [2, 1, 4, 3, 5]
    rho, p = stats.rank_correlation_p(xs, ys)
    assert rho == pytest.approx(0.8)  # 1 - 6 * 4 / (5 * 24)
    hits = sum(abs(sum((x - 3) * (y - 3) for x, y in zip(xs, perm))) >= 8 for perm in permutations(ys))
    assert hits == 16 and p == pytest.approx(hits / 120, rel=1e-12)
    assert stats.rank_correlation_p([1, 1, 1], [1, 2, 3]) == (pytest.approx(math.nan, nan_ok=True), 1.0)
    many = stats.rank_correlation_p(list(range(12)), [3, 1, 2, 5, 4, 8, 6, 7, 11, 9, 10, 0], permutations=2000)
    assert many == stats.rank_correlation_p(list(range(12)), [3, 1, 2, 5, 4, 8, 6, 7, 11, 9, 10, 0], permutations=2000)


def test_a_slope_through_points_on_a_line_has_no_spread():
    """scipy's linregress gives NaN for a flat line and p 1e-10 for points on a line; the slope's interval is then
    the slope alone and its p 1 (flat) or 0."""
    assert stats.slope_ci([1, 2, 3], [1, 1, 1]) == (0.0, [0.0, 0.0], 1.0)
    slope, (lo, hi), p = stats.slope_ci([1, 2, 3], [2, 4, 6])
    assert slope == pytest.approx(2.0) and lo == hi == slope and p == 0.0
