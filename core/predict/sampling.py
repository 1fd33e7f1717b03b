"""Drawing calls and estimating a ratio from them: the statistics behind core/predict/estimate.py.

`draw_sample` draws calls systematically along the stored order with chances that grow with
their size; `ratio_estimate` estimates a population's sum(Y) / sum(X) from the draws (Cochran,
Sampling Techniques, 3rd ed.), with a standard error and an interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

Z95 = 1.959963984540054  # the two-sided 95% point of the normal distribution


class SampleError(ValueError):
    """Bad arguments to a draw or an estimate."""



@dataclass(frozen=True)
class Sample:
    """Calls drawn for replay: `hits` are positions in the stored order, sorted, a call once per
    time it was drawn, each with the weight 1 / (its size measure) that undoes its chance of being
    drawn. `population` is the number of calls when every call was equally likely (the finite
    population correction applies), None when calls were drawn by size (with-replacement
    variance, no correction). `exhaustive`: every call is in, once, and the figures are exact."""

    hits: tuple[int, ...]
    weights: tuple[float, ...]
    population: int | None
    exhaustive: bool = False

    @property
    def calls(self) -> list[int]:
        """The distinct calls to replay, in stored order."""
        return sorted(set(self.hits))


def systematic_sample(sizes: Sequence[float], n: int, seed: int | None = 0) -> list[int]:
    """`n` draws over calls with these size measures, systematic: call i covers an interval as long
    as sizes[i] on a line through the calls in stored order, and the draws are n points evenly
    spaced on it, (k + u) * total / n for k < n, u uniform in [0, 1) from `seed` (None: u = 0.5).
    Call i is drawn sizes[i] * n / total times in expectation (at most once while that is <= 1).

    >>> systematic_sample([1] * 10, 4, seed=None)  # equal sizes: every 2.5 calls, from the midpoint
    [1, 3, 6, 8]
    >>> systematic_sample([1, 9, 1, 1], 4, seed=None)  # points at 1.5, 4.5, 7.5, 10.5 of 12
    [1, 1, 1, 2]
    """
    if n < 1:
        raise SampleError(f"the sample needs at least 1 call, got {n}")
    cum = np.cumsum(np.asarray(sizes, dtype=float))
    total = float(cum[-1]) if len(cum) else 0.0
    if total <= 0:
        return []
    u = 0.5 if seed is None else float(np.random.default_rng(seed).random())
    points = (np.arange(n) + u) * (total / n)
    return np.minimum(np.searchsorted(cum, points, side="right"), len(cum) - 1).tolist()


def draw_sample(tokens: Sequence[int], n: int, seed: int | None = 0, power: float = 0.5) -> Sample:
    """A systematic sample of `n` draws over calls with these output lengths, each call's chance
    proportional to tokens ** `power` (0: every call alike; 0.5, the default: the square root of its
    length; 1: its length). All calls, exactly, when n >= their number.

    Why the square root: the ratio estimate's error from call i grows with its length t (a long call
    moves the totals more), and replaying it costs time in proportion to t; the draw probabilities
    that minimise the error for a given replay time are proportional to error / sqrt(cost), that is
    to sqrt(t) (Cochran 9A, optimum probabilities with unequal costs). Drawing every call alike lets
    a few long outputs (one 8,345-token call is 12% of a workload's tokens) swing the estimate.
    """
    if n < 1:
        raise SampleError(f"the sample needs at least 1 call, got {n}")
    if not 0 <= power <= 1:
        raise SampleError(f"the size power must be within [0, 1], got {power}")
    count = len(tokens)
    if n >= count:
        return Sample(tuple(range(count)), (1.0,) * count, count, exhaustive=True)
    sizes = np.asarray(tokens, dtype=float) ** power if power else np.ones(count)
    hits = systematic_sample(sizes, n, seed)
    scale = float(sizes.sum()) / n  # 1 / (a draw's chance of landing on call i) = total / (n sizes[i])
    return Sample(tuple(hits), tuple(scale / float(sizes[i]) for i in hits), count if power == 0 else None)


def allocate(measures: dict[str, float], counts: dict[str, int], n: int) -> dict[str, int]:
    """Draws per stratum, `n` in all: each its share of n by its size measure, but at least
    n / (number of strata) (at least 2), and a stratum of no more calls than that taken whole;
    the shares are spread over what the floors and the whole strata leave (largest remainders).

    >>> allocate({"a": 8.0, "b": 1.0, "c": 1.0}, {"a": 8, "b": 1, "c": 50}, 12)  # b whole, c its floor
    {'a': 7, 'b': 1, 'c': 4}
    """
    floor = max(2, n // max(len(counts), 1))
    out = {key: count for key, count in counts.items() if count <= floor}  # whole
    left = [key for key in counts if key not in out]
    budget = n - sum(out.values())
    while left:
        total = sum(measures[key] for key in left) or 1.0
        shares = {key: max(budget, 0) * measures[key] / total for key in left}
        small = [key for key in left if shares[key] < floor]
        if not small:
            base = {key: int(shares[key]) for key in left}
            extra = max(budget, 0) - sum(base.values())
            for key in sorted(left, key=lambda k: base[k] - shares[k])[:extra]:
                base[key] += 1
            out.update(base)
            break
        for key in small:
            out[key] = floor
            budget -= floor
        left = [key for key in left if key not in small]
    return {key: out[key] for key in counts}


def draw_stratified(tokens: Sequence[int], strata: Sequence[str], n: int, seed: int | None = 0,
                    power: float = 0.5) -> dict[str, Sample]:
    """`draw_sample` within each stratum (a group of calls), positions kept in the whole order,
    `n` draws in all as `allocate` spreads them (more only where 2 per stratum exceed n). So a
    small group is estimated from enough of its own calls, or exactly, rather than from the few
    draws a sample of everything would give it.

    >>> parts = draw_stratified([1, 1, 1, 1, 1, 1, 1, 1, 1, 1], list("aaaaaaaabb"), 4, seed=None, power=0)
    >>> {k: (v.hits, v.exhaustive) for k, v in parts.items()}  # b whole; a the 2 left
    {'a': ((2, 6), False), 'b': ((8, 9), True)}
    """
    if n < 1:
        raise SampleError(f"the sample needs at least 1 call, got {n}")
    if len(strata) != len(tokens):
        raise SampleError(f"{len(strata)} strata for {len(tokens)} calls")
    members: dict[str, list[int]] = {}
    for i, key in enumerate(strata):
        members.setdefault(key, []).append(i)
    if n >= len(tokens):
        draws = {key: len(positions) for key, positions in members.items()}  # every stratum whole
    else:
        sizes = np.asarray(tokens, dtype=float) ** power if power else np.ones(len(tokens))
        draws = allocate({key: float(sizes[p].sum()) for key, p in members.items()},
                         {key: len(p) for key, p in members.items()}, n)
    out = {}
    for key, positions in members.items():
        part = draw_sample([tokens[i] for i in positions], draws[key], seed, power)
        out[key] = Sample(tuple(positions[j] for j in part.hits), part.weights, part.population, part.exhaustive)
    return out


@dataclass(frozen=True)
class RatioEstimate:
    """The ratio estimator r = sum(y) / sum(x) over n sampled units of N, and its standard error.

    `se` is None where it cannot be estimated (fewer than 2 units sampled out of more); 0 where the
    sample is the whole population (r is then the exact ratio). `value` is None with sum(x) = 0.
    """

    value: float | None
    se: float | None
    n: int
    population: int | None
    z: float = Z95

    @property
    def low(self) -> float | None:
        return None if self.value is None or self.se is None else self.value - self.z * self.se

    @property
    def high(self) -> float | None:
        return None if self.value is None or self.se is None else self.value + self.z * self.se


def combined_ratio(strata: Sequence[tuple[Sequence[float], Sequence[float], int | None, bool]],
                   z: float = Z95) -> RatioEstimate:
    """The combined ratio estimator over strata (Cochran 6.11): R = sum of every stratum's estimated
    total of Y / the same of X, each stratum given as (w_i Y_i, w_i X_i, population, exhaustive),
    w_i the draw's expansion weight. Its variance sums the strata's: for a stratum of n draws,
    n / (n - 1) * sum((d_i - mean d)^2) with d_i = w_i (Y_i - R X_i), times 1 - n/N where every
    call was equally likely (population N), nothing where it was taken whole; divided by the
    estimated total of X squared. With one stratum it is `ratio_estimate`.

    >>> e = combined_ratio([([4, 6], [2, 2], 2, True), ([16, 8], [4, 4], 4, False)])  # exact a + drawn b
    >>> round(e.value, 4), round(e.se, 4)  # (10 + 24) / (4 + 8); b: d = 4.67, -3.33 -> 64 * 0.5 / 12^2
    (2.8333, 0.4714)
    """
    parts = [(np.asarray(y, dtype=float), np.asarray(x, dtype=float), population, exhaustive)
             for y, x, population, exhaustive in strata]
    n = sum(len(x) for _, x, _, _ in parts)
    x_total = sum(float(x.sum()) for _, x, _, _ in parts)
    if n == 0 or x_total <= 0:
        return RatioEstimate(None, None, n, None, z)
    r = sum(float(y.sum()) for y, _, _, _ in parts) / x_total
    var = 0.0
    for y, x, population, exhaustive in parts:
        m = len(x)
        if exhaustive or m == 0 or m == population:
            continue
        if m < 2:
            return RatioEstimate(r, None, n, None, z)
        d = y - r * x
        fpc = 1 - m / population if population is not None else 1.0
        var += fpc * m / (m - 1) * float(((d - d.mean()) ** 2).sum())
    return RatioEstimate(r, math.sqrt(var) / x_total, n, None, z)


def ratio_estimate(y: Sequence[float], x: Sequence[float], population: int | None, z: float = Z95) -> RatioEstimate:
    """Estimate a population's sum(Y) / sum(X) from n sampled (y, x) pairs out of `population`.

    Cochran (Sampling Techniques, 3rd ed., 6.9): r = sum(y) / sum(x), and

        se(r)^2 = (1 - n/N) / (n * xbar^2) * sum((y_i - r x_i)^2) / (n - 1)

    with xbar the sample mean of x, and 1 - n/N the finite-population correction. Units drawn with
    unequal chances enter weighted (y_i = w_i Y_i, x_i = w_i X_i, w_i = 1 / chance): the same
    formula, without the correction (population None: draws with replacement, a conservative
    variance for a systematic draw).

    >>> e = ratio_estimate([4, 6, 10], [2, 2, 4], population=6)  # r = 20/8; residuals -1, 1, 0
    >>> e.value, round(e.se, 5), round(e.low, 3), round(e.high, 3)
    (2.5, 0.15309, 2.2, 2.8)
    """
    ys, xs = np.asarray(y, dtype=float), np.asarray(x, dtype=float)
    n = len(xs)
    if len(ys) != n:
        raise SampleError(f"{len(ys)} y values for {n} x values")
    if population is not None and n > population:
        raise SampleError(f"a sample of {n} out of a population of {population}")
    if n == 0 or xs.sum() <= 0:
        return RatioEstimate(None, None, n, population, z)
    r = float(ys.sum() / xs.sum())
    if n == population:
        return RatioEstimate(r, 0.0, n, population, z)
    if n < 2:
        return RatioEstimate(r, None, n, population, z)
    xbar = xs.mean()
    s2 = float(((ys - r * xs) ** 2).sum()) / (n - 1)
    fpc = 1 - n / population if population is not None else 1.0
    var = fpc / (n * xbar * xbar) * s2
    return RatioEstimate(r, math.sqrt(max(var, 0.0)), n, population, z)
