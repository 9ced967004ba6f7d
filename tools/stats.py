"""Small statistics for the research tools, with no scipy: Student's t quantile, a mean with its 95% t-interval,
and Pearson's r. The study and the one-step experiment report every comparison with these intervals."""

import math


def t_quantile(p, dof):
    """Student's t quantile by bisection on its CDF (Simpson's rule on the density); no scipy needed."""
    log_norm = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)

    def cdf(x):  # P(T <= x) for x >= 0
        n = 2000
        h = x / n
        f = [math.exp(log_norm - (dof + 1) / 2 * math.log1p((i * h) ** 2 / dof)) for i in range(n + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 50.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
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


def pearson(xs, ys):
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan
