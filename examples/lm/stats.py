"""Mean, spread and a 95% confidence interval over seeds, without SciPy.

Every recipe trains from the same seeds, and a seed fixes both the initial parameters and
the data order, so a recipe's gap to bf16 is measured per seed (paired) and the interval
is the paired t-interval of those per-seed gaps: mean +- t(0.975, n - 1) * sd / sqrt(n).
`seeds_needed` turns a measured sd into the number of seeds that interval needs to be as
narrow as a given half-width.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Optional, Sequence

CONFIDENCE = 0.95


def student_t_two_sided_mass(t: float, dof: int) -> float:
  """P(|T| < t) for Student's t with `dof` degrees of freedom (t >= 0).

  The closed forms for integer dof (Abramowitz and Stegun 26.7.3 and 26.7.4), with
  theta = atan(t / sqrt(dof)): sums of powers of cos(theta).
  """
  if dof < 1:
    raise ValueError(f"degrees of freedom must be >= 1, got {dof}")
  theta = math.atan(t / math.sqrt(dof))
  cos2 = math.cos(theta) ** 2
  if dof % 2:  # odd: (2 / pi) (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
    term, total = 1.0, 1.0 if dof > 1 else 0.0
    for k in range(1, (dof - 1) // 2):
      term *= cos2 * (2 * k) / (2 * k + 1)
      total += term
    return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
  term, total = 1.0, 1.0  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
  for k in range(1, dof // 2):
    term *= cos2 * (2 * k - 1) / (2 * k)
    total += term
  return math.sin(theta) * total


def student_t_quantile(confidence: float, dof: int) -> float:
  """t such that P(|T| < t) = confidence (two-sided), by bisection."""
  low, high = 0.0, 1.0
  while student_t_two_sided_mass(high, dof) < confidence:
    high *= 2
  for _ in range(100):
    middle = (low + high) / 2
    if student_t_two_sided_mass(middle, dof) < confidence:
      low = middle
    else:
      high = middle
  return (low + high) / 2


@dataclasses.dataclass(frozen=True)
class Summary:
  """Mean of n values, their sample standard deviation and the 95% t-interval of the mean
  (None for fewer than two values)."""

  n: int
  mean: float
  std: Optional[float]
  interval: Optional[tuple[float, float]]

  @property
  def half_width(self) -> Optional[float]:
    return None if self.interval is None else (self.interval[1] - self.interval[0]) / 2


def summarize(values: Sequence[float]) -> Summary:
  if not values:
    raise ValueError("no values to summarize")
  mean = statistics.fmean(values)
  if len(values) < 2:
    return Summary(len(values), mean, None, None)
  std = statistics.stdev(values)
  half_width = student_t_quantile(CONFIDENCE, len(values) - 1) * std / math.sqrt(len(values))
  return Summary(len(values), mean, std, (mean - half_width, mean + half_width))


def _normal_quantile(confidence: float) -> float:
  """z such that P(|Z| < z) = confidence for a standard normal Z (below every t quantile)."""
  low, high = 0.0, 10.0
  for _ in range(100):
    middle = (low + high) / 2
    if math.erf(middle / math.sqrt(2)) < confidence:
      low = middle
    else:
      high = middle
  return (low + high) / 2


# Beyond this many seeds seeds_needed gives up: the answer would be "impractically many".
MAX_SEEDS = 100_000


def seeds_needed(std: float, half_width: float, confidence: float = CONFIDENCE) -> int:
  """The fewest seeds n >= 2 whose t-interval of the mean, t(confidence, n - 1) std /
  sqrt(n), is at most half_width, for values of sample standard deviation std.

  The quantile depends on n, so n is searched upward from the normal approximation's
  lower bound (t > z, so no smaller n can do)."""
  if std < 0 or half_width <= 0:
    raise ValueError(f"need std >= 0 and half_width > 0, got {std} and {half_width}")
  n = max(2, math.ceil((_normal_quantile(confidence) * std / half_width) ** 2))
  while student_t_quantile(confidence, n - 1) * std / math.sqrt(n) > half_width:
    n += 1
    if n > MAX_SEEDS:
      raise ValueError(f"more than {MAX_SEEDS} seeds for sd {std} and half-width {half_width}")
  return n
