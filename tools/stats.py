"""The statistics the research tools report, on scipy.stats: Student's t, a mean with its 95% t-interval (also on the
logit scale, for accuracies that cannot pass 0 or 1), the paired t-test, its power and the minimum detectable effect,
Fisher's exact test, Clopper-Pearson and Wilson intervals, Pearson's r, Spearman's rho with a permutation p, a
least-squares slope, the AUC with a stratified bootstrap interval. Written here, where scipy has no such function:
Holm's correction, Newcombe's interval of a difference in rates, the exact trend test, the power of Fisher's test,
and the exact sign-flip test (scipy's permutation_test counts a tie within 2e-14 of the observed value, relative, so
flips of accuracy differences whose sums are equal but for the last bits are split; here the tolerance is on the scale
of the differences).

Every function refuses, in one line naming itself and the argument (ImpossibleInput), a NaN or infinite input and an
input too small for what it claims (an interval from one value, a bootstrap from one run of a class).

scipy and numpy are imported inside the functions: their import takes seconds, ten times the rest of a study tool's
start, and a tool's --help or a refused input needs no statistic."""

import functools
import math
import numbers


class ImpossibleInput(ValueError):
    """An input no study can give (a NaN, events beyond runs, one value where an interval needs two): refused in one
    line naming the argument, since any answer would be a number with no meaning (a p of 0, an interval of width 0).
    The tools end on it with exit code 2, as on any bad input (cli.guard)."""


def _values(values, name: str, fewest: int, claim: str = "an interval or a test") -> list:
    """`values` as a list of floats, refused when it holds a NaN or infinity or fewer than `fewest` values."""
    values = list(values)
    if len(values) < fewest:
        raise ImpossibleInput(f"{name}: {len(values)} value(s); {claim} needs at least {fewest}")
    bad = next((i for i, v in enumerate(values) if not _real(v) or not math.isfinite(v)), None)
    if bad is not None:
        raise ImpossibleInput(f"{name}: value {bad} is {_show(values[bad])}, not a finite number")
    return [float(v) for v in values]


def _real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _show(v) -> str:
    """A value as a message shows it: a number as Python prints a float (nan, inf, 0.3), anything else quoted."""
    return str(float(v)) if _real(v) else repr(v)


def _number(name: str, v, ok=lambda v: True, what: str = "a finite number") -> float:
    """One number, refused when it is not finite or not `ok` (then `what` says what it must be)."""
    if not _real(v) or not math.isfinite(v) or not ok(v):
        raise ImpossibleInput(f"{name}: {_show(v)} is not {what}")
    return float(v)


def _whole(name: str, v, fewest: int) -> int:
    """A count of values or runs, refused below `fewest`."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < fewest:
        raise ImpossibleInput(f"{name}: {v!r} is not a whole number >= {fewest}")
    return int(v)


def _level(name: str, v) -> float:
    return _number(name, v, lambda v: 0 < v < 1, "a probability strictly between 0 and 1")


def _count(name: str, k, n) -> None:
    """Refuse a count k of events in n runs that no study can give: not whole, negative, or more events than runs."""
    for what, v in (("events", k), ("runs", n)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise ImpossibleInput(f"{name}: {what} {v!r} is not a whole number >= 0")
    if k > n:
        raise ImpossibleInput(f"{name}: {k} events in {n} runs; a run has at most one")


def _pvalues(name: str, pvalues) -> list:
    """`pvalues` as a list, refused when one is not a probability (a NaN sorts nowhere and compares false)."""
    pvalues = list(pvalues)
    bad = next((i for i, p in enumerate(pvalues) if not _real(p) or not 0 <= p <= 1), None)  # False for a NaN
    if bad is not None:
        raise ImpossibleInput(f"{name}: p-value {bad} is {_show(pvalues[bad])}, not in [0, 1]")
    return pvalues


# --- Student's t: a mean, its interval, the paired test and its power ----------------------------------------------

def _dof(name: str, dof) -> float:
    return _number(f"{name} (dof)", dof, lambda v: v >= 1, "a number of degrees of freedom >= 1")


def t_sf(x, dof):
    """P(T > x) for Student's t with `dof` >= 1 degrees of freedom; the tail itself, exact far out (1 - cdf would
    round a small p away)."""
    import scipy.stats

    return float(scipy.stats.t.sf(_number("t_sf (x)", x), _dof("t_sf", dof)))


def t_cdf(x, dof):
    """P(T <= x) for Student's t with `dof` >= 1 degrees of freedom."""
    import scipy.stats

    return float(scipy.stats.t.cdf(_number("t_cdf (x)", x), _dof("t_cdf", dof)))


def t_quantile(p, dof):
    """Student's t quantile: the x with P(T <= x) = p."""
    import scipy.stats

    return float(scipy.stats.t.ppf(_level("t_quantile (p)", p), _dof("t_quantile", dof)))


def _mean_sd(values) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def mean_ci(values):
    """(mean, [lo, hi]) with a 95% t-interval over the values (one per batch, or per seed); at least 2 of them (one
    value has no spread to make an interval from: callers show its mean alone). Values that do not vary give [mean,
    mean] (scipy's t.interval gives NaN with a scale of 0)."""
    import scipy.stats

    values = _values(values, "mean_ci", 2)
    mean, sd = _mean_sd(values)
    half = scipy.stats.t.ppf(0.975, len(values) - 1) * sd / math.sqrt(len(values))
    return mean, [mean - half, mean + half]


def logit_mean_ci(values, eps=1e-4):
    """(mean, [lo, hi]) for proportions in [0, 1] (accuracies): the plain mean, with the 95% t-interval taken on the
    logit scale and mapped back, so the interval stays inside (0, 1) however skewed the values are (accuracies near
    a ceiling are left-skewed, and a plain t-interval then passes 1). Values are clamped to [eps, 1 - eps] first; at
    least 2 of them, each in [0, 1]."""
    values = _values(values, "logit_mean_ci", 2)
    bad = next((i for i, v in enumerate(values) if not 0 <= v <= 1), None)
    if bad is not None:
        raise ImpossibleInput(f"logit_mean_ci: value {bad} is {values[bad]}, not a proportion in [0, 1]")

    def logit(v):
        v = min(max(v, eps), 1 - eps)
        return math.log(v / (1 - v))

    mean = sum(values) / len(values)
    _, (lo, hi) = mean_ci([logit(v) for v in values])
    return mean, [1 / (1 + math.exp(-lo)), 1 / (1 + math.exp(-hi))]


def t_test_p(values):
    """Two-sided p-value of the one-sample t-test of mean 0 (for paired differences); 1.0 when all are equal to 0,
    0.0 when they are equal and not 0 (scipy's ttest_1samp gives NaN for both). At least 2 values."""
    import scipy.stats

    values = _values(values, "t_test_p", 2)
    mean, sd = _mean_sd(values)
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    return min(1.0, 2 * float(scipy.stats.t.sf(abs(mean) / (sd / math.sqrt(len(values))), len(values) - 1)))


def paired_power(delta, sd, n, alpha=0.05):
    """Power of the two-sided paired t-test at level alpha over n >= 2 pairs when the true mean difference is `delta`
    and the differences' SD is `sd` > 0: P(|T| > t_{1-alpha/2, n-1}) with T noncentral t, noncentrality delta sqrt(n)
    / sd. The far tail P(T < -c) is taken as P(T' > c) with noncentrality -ncp: scipy's nct.cdf(-c) gives NaN there
    for some ncp (at 1 degree of freedom, ncp 15 and 18), where nct.sf does not."""
    import scipy.stats

    delta = _number("paired_power (delta)", delta)
    sd = _number("paired_power (sd)", sd, lambda v: v > 0, "a spread > 0")
    n, alpha = _whole("paired_power (n)", n, 2), _level("paired_power (alpha)", alpha)
    c, ncp = scipy.stats.t.ppf(1 - alpha / 2, n - 1), delta / sd * math.sqrt(n)
    return min(1.0, float(scipy.stats.nct.sf(c, n - 1, ncp) + scipy.stats.nct.sf(c, n - 1, -ncp)))


def min_detectable(sd, n, power=0.8, alpha=0.05):
    """The smallest true mean difference the two-sided paired t-test over n pairs detects with the given power."""
    import scipy.optimize

    sd = _number("min_detectable (sd)", sd, lambda v: v > 0, "a spread > 0")
    n, alpha = _whole("min_detectable (n)", n, 2), _level("min_detectable (alpha)", alpha)
    power = _number("min_detectable (power)", power, lambda v: alpha < v < 1, f"a power between alpha {alpha} and 1")
    top = sd
    while paired_power(top, sd, n, alpha) < power:  # power rises to 1 with the difference: a bracket exists
        top *= 2
    return scipy.optimize.brentq(lambda d: paired_power(d, sd, n, alpha) - power, 0.0, top, xtol=1e-12 * sd)


def holm(pvalues, alpha=0.05):
    """Which hypotheses Holm's step-down procedure rejects at family-wise level alpha (a list of booleans). Every p
    must be in [0, 1]: a NaN would be rejected, sorting nowhere and comparing false with alpha (holm_adjusted alike)."""
    pvalues = _pvalues("holm", pvalues)
    alpha = _level("holm (alpha)", alpha)
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    rejected = [False] * len(pvalues)
    for rank, i in enumerate(order):
        if pvalues[i] > alpha / (len(pvalues) - rank):
            break
        rejected[i] = True
    return rejected


def holm_adjusted(pvalues):
    """Holm's step-down adjusted p-values, in the given order: the k-th smallest p times (m - k + 1), capped at 1 and
    made monotone (never below an adjusted p of a smaller one). A hypothesis is rejected at family-wise level alpha
    exactly where its adjusted p is at most alpha (holm). Every p must be in [0, 1], as for holm."""
    pvalues = _pvalues("holm_adjusted", pvalues)
    m, adjusted, running = len(pvalues), [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda i: pvalues[i])):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def _pairs(name: str, xs, ys, fewest: int, claim: str) -> tuple[list, list]:
    """Two lists of finite numbers of one length, at least `fewest` long."""
    xs, ys = _values(xs, f"{name} (xs)", fewest, claim), _values(ys, f"{name} (ys)", fewest, claim)
    if len(xs) != len(ys):
        raise ImpossibleInput(f"{name}: {len(xs)} xs and {len(ys)} ys; each x needs its y")
    return xs, ys


def pearson(xs, ys):
    """Pearson's r of two lists of one length (at least 2); NaN when either does not vary (no correlation exists)."""
    import scipy.stats

    xs, ys = _pairs("pearson", xs, ys, 2, "a correlation")
    if len(set(xs)) < 2 or len(set(ys)) < 2:
        return math.nan
    return float(scipy.stats.pearsonr(xs, ys).statistic)


# --- incidence: counts of runs that collapsed, exact tests -------------------------------------------------------

def _binom_pmfs(n, p):
    """[P(X = k) for k = 0..n], X ~ Binomial(n, p)."""
    import scipy.stats

    return [float(v) for v in scipy.stats.binom.pmf(range(n + 1), n, p)]


def fisher_exact(a, n1, b, n2):
    """Two-sided p of Fisher's exact test that a of n1 and b of n2 differ in rate: the probability, given a + b events,
    of every split no more likely than the one seen (scipy's rule: R's, with a relative tolerance of 1e-14). Each arm
    needs a run."""
    import scipy.stats

    for what, k, n in (("a, n1", a, n1), ("b, n2", b, n2)):
        _count(f"fisher_exact ({what})", k, n)
        if n < 1:
            raise ImpossibleInput(f"fisher_exact ({what}): 0 runs; a rate needs at least one")
    return float(scipy.stats.fisher_exact([[a, n1 - a], [b, n2 - b]]).pvalue)


def exact_trend(arms):
    """Two-sided p of the exact (permutation) Cochran-Armitage trend test: arms = [(score, runs, events)], e.g. (beta1,
    5, collapsed), at least two different scores. Given the total number of events, spread at random over the runs,
    the statistic T = sum of the events' scores; p = P(|T - E T| >= |T_seen - E T|), computed exactly by convolving the
    arms' hypergeometric counts (no enumeration of runs). The weights are whole numbers, exact however many runs
    there are, until the final divisions. scipy has no such test."""
    arms = list(arms)
    for i, (score, n, k) in enumerate(arms):
        _count(f"exact_trend (arm of score {score})", k, n)
        _number(f"exact_trend (arm {i}'s score)", score)
    if len({score for score, n, _ in arms if n}) < 2:
        raise ImpossibleInput(f"exact_trend: {len(arms)} arm(s) with runs at one score; a trend needs two scores")
    total = sum(k for _, _, k in arms)
    dist = {(0, 0.0): 1}  # (events placed, T) -> product of comb(n_i, k_i), a whole number
    for score, n, _ in arms:
        step = {}
        for (placed, t), w in dist.items():
            for k in range(0, min(n, total - placed) + 1):
                key = (placed + k, round(t + score * k, 9))
                step[key] = step.get(key, 0) + w * math.comb(n, k)
        dist = step
    final = {t: w for (placed, t), w in dist.items() if placed == total}
    norm = sum(final.values())
    mean = sum(t * (w / norm) for t, w in final.items())
    seen = abs(sum(score * k for score, _, k in arms) - mean)
    return min(1.0, sum(w for t, w in final.items() if abs(t - mean) >= seen - 1e-9) / norm)


def exact_rate_ci(k, n, level=0.95):
    """Clopper-Pearson interval of a rate seen k times in n >= 1: the rates p for which k is not in either tail of
    Binomial(n, p) beyond (1 - level) / 2. 0 of 5 gives [0, 1 - 0.025^(1/5)] = [0, 0.522]."""
    import scipy.stats

    _count("exact_rate_ci", k, n)
    if n < 1:
        raise ImpossibleInput("exact_rate_ci: 0 runs; a rate needs at least one")
    ci = scipy.stats.binomtest(k, n).proportion_ci(_level("exact_rate_ci (level)", level), method="exact")
    return float(ci.low), float(ci.high)


def wilson_ci(k, n, level=0.95):
    """Wilson's score interval of a rate seen k times in n >= 1 (0 and 1 exactly at 0 of n and n of n)."""
    import scipy.stats

    _count("wilson_ci", k, n)
    if n < 1:
        raise ImpossibleInput("wilson_ci: 0 runs; a rate needs at least one")
    ci = scipy.stats.binomtest(k, n).proportion_ci(_level("wilson_ci (level)", level), method="wilson")
    return float(ci.low), float(ci.high)


def rate_difference_ci(a, n1, b, n2):
    """a/n1 - b/n2 with Newcombe's hybrid score interval (his method 10, from the two Wilson intervals), which stays
    inside [-1, 1] and does not collapse to a point at 0 of 5 or 5 of 5. Newcombe's example 56/70 - 48/80 gives
    0.200 [0.0524, 0.3339]. scipy has no such interval."""
    (l1, u1), (l2, u2) = wilson_ci(a, n1), wilson_ci(b, n2)
    p1, p2 = a / n1, b / n2
    d = p1 - p2
    return d, d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


def incidence_power(p1, p0, n, alpha=0.05):
    """Power of the two-sided Fisher exact test at level alpha, n runs per arm, when the true rates are p1 and p0."""
    for what, p in (("p1", p1), ("p0", p0)):
        _number(f"incidence_power ({what})", p, lambda v: 0 <= v <= 1, "a rate in [0, 1]")
    n, alpha = _whole("incidence_power (n)", n, 1), _level("incidence_power (alpha)", alpha)
    pmf1, pmf0 = _binom_pmfs(n, p1), _binom_pmfs(n, p0)
    return sum(pmf1[a] * pmf0[b] for a, b in _fisher_rejects(n, alpha))


@functools.lru_cache(maxsize=None)
def _fisher_rejects(n, alpha):
    """The outcomes (a, b) of two arms of n runs each that the two-sided Fisher test rejects at level alpha: the same
    for every pair of true rates, so min_detectable_incidence's search finds them once."""
    return tuple((a, b) for a in range(n + 1) for b in range(n + 1) if fisher_exact(a, n, b, n) <= alpha)


def min_detectable_incidence(p0, n, power=0.8, alpha=0.05):
    """The smallest rate p1 >= p0 that the two-sided Fisher test over n runs per arm detects with the given power
    against a true rate p0 (None if not even p1 = 1 is); the difference it can detect is p1 - p0."""
    import scipy.optimize

    p0 = _number("min_detectable_incidence (p0)", p0, lambda v: 0 <= v <= 1, "a rate in [0, 1]")
    n, alpha = _whole("min_detectable_incidence (n)", n, 1), _level("min_detectable_incidence (alpha)", alpha)
    power = _number("min_detectable_incidence (power)", power, lambda v: alpha < v < 1,
                    f"a power between alpha {alpha} and 1")
    if incidence_power(1.0, p0, n, alpha) < power:
        return None
    return scipy.optimize.brentq(lambda p1: incidence_power(p1, p0, n, alpha) - power, p0, 1.0, xtol=1e-12)


def rank_correlation_p(xs, ys, permutations=20000, seed=0):
    """Spearman's rho of xs and ys (average ranks for ties; at least 2 pairs) and its two-sided permutation p, the
    share of pairings of ys with xs whose |rho| is at least the one seen: exact over every pairing where there are no
    more than `permutations` of them (7 pairs or fewer at 20,000), else over `permutations` random ones from a fixed
    seed with the seen one counted, (hits + 1) / (permutations + 1). (nan, 1.0) when xs or ys do not vary."""
    import numpy as np
    import scipy.stats

    xs, ys = _pairs("rank_correlation_p", xs, ys, 2, "a correlation")
    permutations = _whole("rank_correlation_p (permutations)", permutations, 1)
    if len(set(xs)) < 2 or len(set(ys)) < 2:
        return math.nan, 1.0
    rho = float(scipy.stats.spearmanr(xs, ys).statistic)
    # |rho| of a pairing is |sum of products of centred ranks| over a constant; the ranks are halves, so those sums
    # are exact and equal pairings tie exactly (scipy's tolerance is relative to the seen value)
    centre = (len(xs) + 1) / 2
    rx, ry = scipy.stats.rankdata(xs) - centre, scipy.stats.rankdata(ys) - centre
    result = scipy.stats.permutation_test((ry,), lambda y, axis: np.abs(np.sum(rx * y, axis=axis)),
                                          permutation_type="pairings", n_resamples=permutations, vectorized=True,
                                          alternative="greater", rng=np.random.default_rng(seed))
    return rho, float(result.pvalue)


# --- paired differences beyond the t-test, a slope, and how well a number ranks an outcome ---------------------------

def sign_flip_p(diffs):
    """Two-sided exact permutation p of paired differences: the share of the 2^n sign flips whose |mean| is at least
    the observed one (ties counted within 1e-12 of the differences' scale; the observed signs included, so p >= 2 /
    2^n for n nonzero differences). At least 2 differences; above 20 the flips are too many to list."""
    import numpy as np

    diffs = _values(diffs, "sign_flip_p", 2)
    if len(diffs) > 20:
        raise ImpossibleInput(f"sign_flip_p: {len(diffs)} differences; the exact test lists 2^n flips, at most 2^20")
    sums = np.zeros(1)
    for d in diffs:  # every flip's sum, added in the order sum() adds the observed one
        sums = np.concatenate([sums + d, sums - d])
    observed = abs(sum(diffs)) - 1e-12 * max(1.0, max(abs(d) for d in diffs))  # a flip equal to it counts
    return int(np.count_nonzero(np.abs(sums) >= observed)) / len(sums)


def slope_ci(xs, ys):
    """The least-squares slope of ys on xs: (slope, [lo, hi] its 95% t-interval with n - 2 degrees of freedom, the
    two-sided p of slope 0). Needs 3 points or more and xs that are not all equal. Points on a line give [slope,
    slope] and p 0 (1 for a flat line), where scipy's linregress gives NaN or a p of 1e-10."""
    import scipy.stats

    xs, ys = _pairs("slope_ci", xs, ys, 3, "a slope's interval")
    if len(set(xs)) < 2:
        raise ImpossibleInput(f"slope_ci (xs): all {len(xs)} equal; a slope needs different x")
    fit = scipy.stats.linregress(xs, ys)
    slope = float(fit.slope)
    if not fit.stderr > 0:  # 0, or NaN where ys do not vary
        return slope, [slope, slope], 1.0 if slope == 0 else 0.0
    half = scipy.stats.t.ppf(0.975, len(xs) - 2) * fit.stderr
    return slope, [slope - half, slope + half], float(fit.pvalue)


def _auc(positives, negatives, axis=-1):
    """The Mann-Whitney U of positives over negatives (pairs ordered right, ties half) as a share of the pairs."""
    import numpy as np
    import scipy.stats

    u = scipy.stats.mannwhitneyu(positives, negatives, method="asymptotic", axis=axis).statistic
    return u / (np.shape(positives)[axis] * np.shape(negatives)[axis])


def auc(positives, negatives):
    """The area under the ROC curve of a score that should be higher for positives: the share of (positive,
    negative) pairs the score orders right, ties counted half (the Mann-Whitney U over m n). At least one of each."""
    positives = _values(positives, "auc (positives)", 1, "an AUC")
    negatives = _values(negatives, "auc (negatives)", 1, "an AUC")
    return float(_auc(positives, negatives))


def auc_bootstrap_ci(positives, negatives, resamples=10000, seed=0):
    """A 95% percentile interval of auc() from a stratified bootstrap: positives and negatives resampled separately,
    with replacement, `resamples` times from a fixed seed (so the interval re-derives exactly); the interval's ends
    are the 2.5% and 97.5% quantiles of the resampled AUCs, interpolated. At least 2 of each class: one run resampled
    is that run every time, an interval of width 0."""
    import numpy as np
    import scipy.stats

    positives = _values(positives, "auc_bootstrap_ci (positives)", 2, "a bootstrap interval")
    negatives = _values(negatives, "auc_bootstrap_ci (negatives)", 2, "a bootstrap interval")
    resamples = _whole("auc_bootstrap_ci (resamples)", resamples, 1)
    result = scipy.stats.bootstrap((positives, negatives), _auc, n_resamples=resamples, method="percentile",
                                   vectorized=True, rng=np.random.default_rng(seed))
    return [float(result.confidence_interval.low), float(result.confidence_interval.high)]
