"""The "quant" RNG stream: where a stochastically rounding GEMM draws its key.

Linen modules draw from the stream of `apply(..., rngs={"quant": key})`; NNX modules from
an `nnx.Rngs` holding a "quant" stream (a layer's `quant_rngs`, or the `rngs` given to
`quantize_model`). A GEMM whose quantizers round deterministically draws nothing, so the
stream is needed only by recipes that use it.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
from flax import nnx

from jaxquant.quantizers import Quantizer, needs_key

QUANT_RNG = "quant"


def draws_key(quantizers: dict[str, Optional[Quantizer]]) -> bool:
  """Whether any of a GEMM's quantizers rounds stochastically."""
  return any(needs_key(q) for q in quantizers.values())


def linen_key(module: nn.Module, quantizers, what: str) -> Optional[jax.Array]:
  """A Linen module's key for its GEMM's stochastic rounding (None when none rounds so)."""
  if not draws_key(quantizers):
    return None
  if module.is_initializing():
    return jax.random.key(0)  # init needs shapes only; the params stream stays untouched
  if not module.has_rng(QUANT_RNG):
    raise ValueError(
      f"{what}: its recipe rounds stochastically; pass a PRNG key for the "
      f"{QUANT_RNG!r} stream: model.apply(..., rngs={{'{QUANT_RNG}': key}})"
    )
  return module.make_rng(QUANT_RNG)


def nnx_key(rngs: Optional[nnx.Rngs], quantizers, what: str, how_to_pass: Any):
  """An NNX key from `rngs`' "quant" stream (None when no quantizer rounds stochastically);
  `how_to_pass` completes the error raised when `rngs` is None ("pass <how_to_pass>")."""
  if not draws_key(quantizers):
    return None
  if rngs is None:
    raise ValueError(f"{what}: its recipe rounds stochastically; pass {how_to_pass}")
  return rngs[QUANT_RNG]()
