"""Small statistics for the research tools, with no scipy: Student's t distribution, a mean with its 95% t-interval
(also on the logit scale, for accuracies that cannot pass 0 or 1), paired-test power and the minimum detectable
effect, Holm's correction, and Pearson's r. The study and the one-step experiment report every comparison with
these."""

import functools
import math


def _t_log_norm(dof):
    return math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)


def t_cdf(x, dof):
    """P(T <= x) for Student's t with `dof` degrees of freedom (Simpson's rule on the density)."""
    if x < 0:
        return 1.0 - t_cdf(-x, dof)
    log_norm, n = _t_log_norm(dof), 2000
    h = x / n
    f = [math.exp(log_norm - (dof + 1) / 2 * math.log1p((i * h) ** 2 / dof)) for i in range(n + 1)]
    return min(1.0, 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2])))


@functools.lru_cache(maxsize=None)
def t_quantile(p, dof):
    """Student's t quantile (p >= 0.5) by bisection on its CDF; no scipy needed."""
    lo, hi = 0.0, 50.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, dof) < p else (lo, mid)
    return (lo + hi) / 2


def mean_ci(values):
    """(mean, [lo, hi]) with a 95% t-interval over the values (one per batch, or per seed)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, [mean, mean]
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    return mean, [mean - half, mean + half]


def logit_mean_ci(values, eps=1e-4):
    """(mean, [lo, hi]) for proportions in [0, 1] (accuracies): the plain mean, with the 95% t-interval taken on the
    logit scale and mapped back, so the interval stays inside (0, 1) however skewed the values are (accuracies near
    a ceiling are left-skewed, and a plain t-interval then passes 1). Values are clamped to [eps, 1 - eps] first."""
    def logit(v):
        v = min(max(v, eps), 1 - eps)
        return math.log(v / (1 - v))

    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, [mean, mean]
    _, (lo, hi) = mean_ci([logit(v) for v in values])
    return mean, [1 / (1 + math.exp(-lo)), 1 / (1 + math.exp(-hi))]


def t_test_p(values):
    """Two-sided p-value of the one-sample t-test of mean 0 (for paired differences); 1.0 when all are equal to 0,
    0.0 when they are equal and not 0."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    return 2 * (1 - t_cdf(abs(mean) / (sd / math.sqrt(n)), n - 1))


def holm(pvalues, alpha=0.05):
    """Which hypotheses Holm's step-down procedure rejects at family-wise level alpha (a list of booleans)."""
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
        density = math.exp(log_k + (dof - 1) * math.log(s) - dof * s * s / 2) if s > 0 else (math.exp(log_k) if dof == 1 else 0.0)
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
