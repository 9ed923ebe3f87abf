"""A GEMM's stochastic-rounding key: whether its quantizers draw one, and a grouped GEMM run
without one where only its backward would round.
"""

from __future__ import annotations

from typing import Optional

import jax

from jaxquant.ops._operands import FORWARD_USAGES, check_key
from jaxquant.quantizers import Quantizer, for_usage, needs_key
from jaxquant.tensor import USAGES


def draws_key(quantizers: dict[str, Optional[Quantizer]]) -> bool:
  """Whether any of a GEMM's quantizers rounds stochastically."""
  return any(needs_key(q) for q in quantizers.values())


def _forward_rounds(quantizers) -> bool:
  """Whether a forward pass alone rounds stochastically (a quantizer of a forward usage)."""
  return any(
    q is not None and needs_key(for_usage(q, u))
    for t, q in quantizers.items()
    for u in FORWARD_USAGES[t]
  )


def without_key(gemm, operands, quantizers, what: str):
  """`gemm(operands, key)` given no stochastic-rounding key (no "quant" stream).

  `ops.grouped_dense` asks for the key up front. Where only the backward pass rounds
  stochastically (nvfp4's gradients), a forward alone (evaluation, generation) needs
  none: it runs with a key that no quantizer of its forward reads, and differentiating it
  raises, saying how to pass one. Otherwise `gemm(operands, None)`, which says what is
  missing."""
  if not draws_key(quantizers) or _forward_rounds(quantizers):
    return gemm(operands, None)

  @jax.custom_jvp
  def forward_only(operands):
    return gemm(operands, jax.random.key(0))  # read by the backward's quantizers alone

  @forward_only.defjvp
  def differentiated(primals, tangents):
    t, q = next((t, q) for t, q in quantizers.items() if needs_key(q))
    check_key(q, USAGES, key=None, what=f"{what} {t}", backward=True)  # raises: q rounds

  return forward_only(operands)
