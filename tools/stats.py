"""Small statistics for the research tools, with no scipy: Student's t distribution, a mean with its 95% t-interval
(also on the logit scale, for accuracies that cannot pass 0 or 1), paired-test power and the minimum detectable
effect, Holm's correction, and Pearson's r. The study and the one-step experiment report every comparison with
these."""

import functools
import math


class ImpossibleInput(ValueError):
    """An input no study can give (a NaN, events beyond runs, one value where an interval needs two): refused in one
    line naming the argument, since any answer would be a number with no meaning (a p of 0, an interval of width 0).
    The tools end on it with exit code 2, as on any bad input (cli.guard)."""


def _values(values, name: str, fewest: int) -> list:
    """`values` as a list, refused when it holds a NaN or infinity or fewer than `fewest` values."""
    values = list(values)
    if len(values) < fewest:
        raise ImpossibleInput(f"{name}: {len(values)} value(s); an interval or a test needs at least {fewest}")
    bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
    if bad is not None:
        raise ImpossibleInput(f"{name}: value {bad} is {values[bad]}, not a finite number")
    return values


def _count(name: str, k, n) -> None:
    """Refuse a count k of events in n runs that no study can give: not whole, negative, or more events than runs."""
    for what, v in (("events", k), ("runs", n)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ImpossibleInput(f"{name}: {what} {v!r} is not a whole number >= 0")
    if k > n:
        raise ImpossibleInput(f"{name}: {k} events in {n} runs; a run has at most one")


def _pvalues(name: str, pvalues) -> list:
    """`pvalues` as a list, refused when one is not a probability (a NaN sorts nowhere and compares false)."""
    pvalues = list(pvalues)
    bad = next((i for i, p in enumerate(pvalues) if not 0 <= p <= 1), None)  # False for a NaN
    if bad is not None:
        raise ImpossibleInput(f"{name}: p-value {bad} is {pvalues[bad]}, not in [0, 1]")
    return pvalues


def t_sf(x, dof):
    """P(T > x) for Student's t with `dof` >= 1 degrees of freedom, to about 1e-11 at any x. With t = sqrt(dof)
    tan(theta) the density over theta in (-pi/2, pi/2) is proportional to cos(theta)^(dof - 1), smooth and bounded, so
    Simpson's rule over [atan(x / sqrt(dof)), pi/2] holds the whole tail however large x is (a grid over t itself
    would have to reach infinity, and a fixed one over [0, x] spreads thin where the density lies when x is large)."""
    if dof < 1:
        raise ValueError(f"t_sf: dof {dof} < 1")
    if x < 0:
        return 1.0 - t_sf(-x, dof)
    lo = math.atan(x / math.sqrt(dof))
    n = 2000 * math.ceil(math.sqrt(max(1, dof / 25)))  # the density's width in theta shrinks as 1 / sqrt(dof)
    h = (math.pi / 2 - lo) / n
    f = [math.cos(lo + i * h) ** (dof - 1) for i in range(n + 1)]
    norm = math.exp(math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2)) / math.sqrt(math.pi)
    return norm * h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))


def t_cdf(x, dof):
    """P(T <= x) for Student's t with `dof` degrees of freedom (t_sf of -x: the tail, by symmetry)."""
    return t_sf(-x, dof)


@functools.lru_cache(maxsize=None)
def t_quantile(p, dof):
    """Student's t quantile (p >= 0.5) by bisection on its CDF; no scipy needed."""
    lo, hi = 0.0, 50.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, dof) < p else (lo, mid)
    return (lo + hi) / 2


def mean_ci(values):
    """(mean, [lo, hi]) with a 95% t-interval over the values (one per batch, or per seed); at least 2 of them (one
    value has no spread to make an interval from: callers show its mean alone)."""
    values = _values(values, "mean_ci", 2)
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
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
    0.0 when they are equal and not 0. At least 2 values."""
    values = _values(values, "t_test_p", 2)
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    # the tail itself (1 - cdf would round a small p away), at most 1 (t_sf(0) integrates to 0.5 within rounding)
    return min(1.0, 2 * t_sf(abs(mean) / (sd / math.sqrt(n)), n - 1))


def holm(pvalues, alpha=0.05):
    """Which hypotheses Holm's step-down procedure rejects at family-wise level alpha (a list of booleans). Every p
    must be in [0, 1]: a NaN would be rejected, sorting nowhere and comparing false with alpha (holm_adjusted alike)."""
    pvalues = _pvalues("holm", pvalues)
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    rejected = [False] * len(pvalues)
    for rank, i in enumerate(order):
        if pvalues[i] > alpha / (len(pvalues) - rank):
            break
        rejected[i] = True
    return rejected


def _phi(x):
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def paired_power(delta, sd, n, alpha=0.05):
    """Power of the two-sided paired t-test at level alpha over n pairs when the true mean difference is `delta` and
    the differences' SD is `sd`: P(|T| > t_{1-alpha/2, n-1}) with T noncentral t (noncentrality delta sqrt(n) / sd),
    integrated over the chi distribution of the sample SD (Simpson's rule)."""
    dof = n - 1
    c, ncp = t_quantile(1 - alpha / 2, dof), delta / sd * math.sqrt(n)
    log_k = math.log(2) + dof / 2 * math.log(dof / 2) - math.lgamma(dof / 2)  # density of S = sqrt(chi2_dof / dof)
    top, steps = 6 + 10 / math.sqrt(dof), 1000
    h, total = top / steps, 0.0
    for i in range(steps + 1):
        s = i * h
        density = (math.exp(log_k + (dof - 1) * math.log(s) - dof * s * s / 2) if s > 0
                   else (math.exp(log_k) if dof == 1 else 0.0))
        reject = _phi(-c * s - ncp) + 1 - _phi(c * s - ncp)
        total += (1 if i in (0, steps) else 4 if i % 2 else 2) * density * reject
    return min(1.0, total * h / 3)


def min_detectable(sd, n, power=0.8, alpha=0.05):
    """The smallest true mean difference the two-sided paired t-test over n pairs detects with the given power."""
    lo, hi = 0.0, 100.0 * sd
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if paired_power(mid, sd, n, alpha) < power else (lo, mid)
    return (lo + hi) / 2


def pearson(xs, ys):
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


# --- incidence: counts of runs that collapsed, exact tests -------------------------------------------------------

def _binom_pmfs(n, p):
    """[P(X = k) for k = 0..n], X ~ Binomial(n, p), each from its logarithm (lgamma): math.comb(n, k) * p ** k
    overflows a float once n passes about 1,030, while a probability, at most 1, always fits one."""
    if p <= 0 or p >= 1:
        return [float(k == (0 if p <= 0 else n)) for k in range(n + 1)]
    log_fact = [math.lgamma(k + 1) for k in range(n + 1)]
    log_p, log_q = math.log(p), math.log1p(-p)
    return [math.exp(log_fact[n] - log_fact[k] - log_fact[n - k] + k * log_p + (n - k) * log_q) for k in range(n + 1)]


def _hypergeometric(k, n1, n2, total):
    """P(k of the `total` events fall in the group of n1) when they are spread at random over n1 + n2 runs: a ratio of
    whole numbers, which Python divides exactly rounded however large they are (no overflow: the result is <= 1)."""
    return math.comb(n1, k) * math.comb(n2, total - k) / math.comb(n1 + n2, total)


def fisher_exact(a, n1, b, n2):
    """Two-sided p of Fisher's exact test that a of n1 and b of n2 differ in rate: the probability, given a + b events,
    of every split no more likely than the one seen (R's and scipy's rule, with their 1e-7 relative tolerance)."""
    _count("fisher_exact (a, n1)", a, n1)
    _count("fisher_exact (b, n2)", b, n2)
    total = a + b
    seen = _hypergeometric(a, n1, n2, total)
    splits = range(max(0, total - n2), min(n1, total) + 1)
    return min(1.0, sum(p for p in (_hypergeometric(k, n1, n2, total) for k in splits) if p <= seen * (1 + 1e-7)))


def exact_trend(arms):
    """Two-sided p of the exact (permutation) Cochran-Armitage trend test: arms = [(score, runs, events)], e.g. (beta1,
    5, collapsed). Given the total number of events, spread at random over the runs, the statistic T = sum of the
    events' scores; p = P(|T - E T| >= |T_seen - E T|), computed exactly by convolving the arms' hypergeometric
    counts (no enumeration of runs). The weights are whole numbers, exact however many runs there are, until the
    final divisions."""
    for score, n, k in arms:
        _count(f"exact_trend (arm of score {score})", k, n)
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
    """Clopper-Pearson interval of a rate seen k times in n: the rates p for which k is not in either tail of
    Binomial(n, p) beyond (1 - level) / 2. 0 of 5 gives [0, 1 - 0.025^(1/5)] = [0, 0.522]. Exact for any n (the
    binomial terms in log space, _binom_pmfs)."""
    _count("exact_rate_ci", k, n)
    if n < 1:
        raise ImpossibleInput("exact_rate_ci: 0 runs; a rate needs at least one")

    def at_least(m):  # P(X >= m) as a function of p, rising in p
        return lambda p: sum(_binom_pmfs(n, p)[m:])

    def bisect(f, target):  # f rises in p
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
        return (lo + hi) / 2
    tail = (1 - level) / 2
    lower = 0.0 if k == 0 else bisect(at_least(k), tail)
    upper = 1.0 if k == n else bisect(at_least(k + 1), 1 - tail)  # where P(X <= k) falls to the tail
    return lower, upper


def wilson_ci(k, n, z=1.959963984540054):
    """Wilson's score interval of a rate seen k times in n."""
    _count("wilson_ci", k, n)
    if n < 1:
        raise ImpossibleInput("wilson_ci: 0 runs; a rate needs at least one")
    p, z2 = k / n, z * z
    centre, half = (p + z2 / (2 * n)) / (1 + z2 / n), z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def rate_difference_ci(a, n1, b, n2):
    """a/n1 - b/n2 with Newcombe's hybrid score interval (his method 10, from the two Wilson intervals), which stays
    inside [-1, 1] and does not collapse to a point at 0 of 5 or 5 of 5. Newcombe's example 56/70 - 48/80 gives
    0.200 [0.0524, 0.3339]."""
    p1, p2 = a / n1, b / n2
    (l1, u1), (l2, u2) = wilson_ci(a, n1), wilson_ci(b, n2)
    d = p1 - p2
    return d, d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


def incidence_power(p1, p0, n, alpha=0.05):
    """Power of the two-sided Fisher exact test at level alpha, n runs per arm, when the true rates are p1 and p0."""
    pmf1, pmf0 = _binom_pmfs(n, p1), _binom_pmfs(n, p0)
    return sum(pmf1[a] * pmf0[b] for a, b in _fisher_rejects(n, alpha))


@functools.lru_cache(maxsize=None)
def _fisher_rejects(n, alpha):
    """The outcomes (a, b) of two arms of n runs each that the two-sided Fisher test rejects at level alpha: the same
    for every pair of true rates, so min_detectable_incidence's bisection finds them once."""
    return tuple((a, b) for a in range(n + 1) for b in range(n + 1) if fisher_exact(a, n, b, n) <= alpha)


def min_detectable_incidence(p0, n, power=0.8, alpha=0.05):
    """The smallest rate p1 >= p0 that the two-sided Fisher test over n runs per arm detects with the given power
    against a true rate p0 (None if not even p1 = 1 is); the difference it can detect is p1 - p0."""
    if incidence_power(1.0, p0, n, alpha) < power:
        return None
    lo, hi = p0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if incidence_power(mid, p0, n, alpha) < power else (lo, mid)
    return hi


def rank_correlation_p(xs, ys, permutations=20000, seed=0):
    """Spearman's rho of xs and ys (average ranks for ties) and its two-sided permutation p over `permutations`
    shuffles of ys with a fixed seed (reproducible): rho, p."""
    import random

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    rho = pearson(rx, ry)
    if math.isnan(rho):
        return rho, 1.0
    rng, shuffled, beyond = random.Random(seed), list(ry), 0
    for _ in range(permutations):
        rng.shuffle(shuffled)
        beyond += abs(pearson(rx, shuffled)) >= abs(rho) - 1e-12
    return rho, (beyond + 1) / (permutations + 1)


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


# --- paired differences beyond the t-test, a slope, and how well a number ranks an outcome ---------------------------

def sign_flip_p(diffs):
    """Two-sided exact permutation p of paired differences: the share of the 2^n sign flips whose |mean| is at least
    the observed one (ties counted; the observed signs included, so p >= 2 / 2^n for n nonzero differences). For n
    above 20 the flips are too many to list: ImpossibleInput."""
    n = len(diffs)
    if not 1 <= n <= 20:
        raise ImpossibleInput(f"sign_flip_p: needs 1 to 20 differences, got {n}")
    observed = abs(sum(diffs)) - 1e-12 * max(1.0, max(abs(d) for d in diffs))  # a flip equal to it counts
    hits = sum(abs(sum(d if (mask >> i) & 1 else -d for i, d in enumerate(diffs))) >= observed
               for mask in range(2 ** n))
    return hits / 2 ** n


def slope_ci(xs, ys):
    """The least-squares slope of ys on xs: (slope, [lo, hi] its 95% t-interval with n - 2 degrees of freedom, the
    two-sided p of slope 0). Needs 3 points or more and xs that are not all equal."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if n < 3 or sxx == 0:
        raise ImpossibleInput(f"slope_ci: needs 3 or more points with different x, got {n}")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    se = math.sqrt(residual / (n - 2) / sxx)
    if se == 0:
        return slope, [slope, slope], 1.0 if slope == 0 else 0.0
    half = t_quantile(0.975, n - 2) * se
    return slope, [slope - half, slope + half], min(1.0, 2 * t_sf(abs(slope) / se, n - 2))


def auc(positives, negatives):
    """The area under the ROC curve of a score that should be higher for positives: the share of (positive,
    negative) pairs the score orders right, ties counted half (the Mann-Whitney U over m n)."""
    if not positives or not negatives:
        raise ImpossibleInput("auc: needs at least one positive and one negative")
    right = sum((p > q) + 0.5 * (p == q) for p in positives for q in negatives)
    return right / (len(positives) * len(negatives))


def auc_bootstrap_ci(positives, negatives, resamples=10000, seed=0):
    """A 95% percentile interval of auc() from a stratified bootstrap: positives and negatives resampled separately,
    with replacement, `resamples` times from a fixed seed (so the interval re-derives exactly)."""
    import random
    rng = random.Random(seed)
    draws = sorted(auc(rng.choices(positives, k=len(positives)), rng.choices(negatives, k=len(negatives)))
                   for _ in range(resamples))
    return [draws[int(0.025 * resamples)], draws[int(math.ceil(0.975 * resamples)) - 1]]
