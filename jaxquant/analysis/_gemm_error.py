"""The error a role's quantizer puts into the three GEMMs of a layer, on real operands.

Given a layer's captured x [M, K], kernel [K, N] and output gradient dy [M, N], the
quantized layer is `jaxquant.ops.dense` with that one role quantized (the others None):
its forward output y (fprop), and from `jax.vjp` with dy its input gradient dx (dgrad)
and kernel gradient dw (wgrad). The reference is each GEMM in fp32 at full precision on
the same operands. SQNR = 10 log10(sum ref^2 / sum (out - ref)^2) per GEMM, summed over
the layer's calls first (a layer called twice counts both calls' errors).
"""

from __future__ import annotations

import functools
import math
from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp

from jaxquant import ops
from jaxquant.analysis._capture import GemmOperands
from jaxquant.quantizers import Quantizer, needs_key

GEMMS = ("fprop", "dgrad", "wgrad")


def sqnr_db(signal_power: float, noise_power: float) -> float:
  """Signal-to-quantization-noise ratio in dB; inf for an exact result."""
  if noise_power == 0:
    return math.inf
  if signal_power == 0:
    return -math.inf
  return 10 * math.log10(signal_power / noise_power)


@jax.jit
def _reference(x, kernel, dy):
  dot = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
  x, kernel, dy = (a.astype(jnp.float32) for a in (x, kernel, dy))
  return dot(x, kernel), dot(dy, kernel.T), dot(x.T, dy)


@functools.partial(jax.jit, static_argnames=("quantizers", "backward"))
def _powers(x, kernel, dy, key, *, quantizers: tuple, backward: str):
  """[(signal, noise) power of fprop, dgrad, wgrad] with `quantizers` applied."""
  gemm = lambda x, kernel: ops.dense(
    x, kernel, quantizers=dict(quantizers), backward=backward, key=key
  )
  y, vjp = jax.vjp(gemm, x, kernel)
  dx, dw = vjp(dy)
  powers = []
  for out, ref in zip((y, dx, dw), _reference(x, kernel, dy), strict=False):
    powers.append((jnp.sum(jnp.square(ref)), jnp.sum(jnp.square(out.astype(jnp.float32) - ref))))
  return powers


def gemm_sqnr(
  calls: Sequence[GemmOperands], quantizers: Mapping[str, Quantizer], backward: str, key: jax.Array
) -> dict[str, float]:
  """{gemm: SQNR in dB} of the layer's GEMMs with `quantizers` ({tensor_type: quantizer};
  the roles not in it in high precision)."""
  stochastic = any(needs_key(q) for q in quantizers.values())
  quantizers = tuple(sorted(quantizers.items()))
  totals = {g: [0.0, 0.0] for g in GEMMS}
  for index, call in enumerate(calls):
    call_key: Optional[jax.Array] = jax.random.fold_in(key, index) if stochastic else None
    for gemm, (signal, noise) in zip(
      GEMMS,
      _powers(call.x, call.kernel, call.dy, call_key, quantizers=quantizers, backward=backward),
      strict=False,
    ):
      totals[gemm][0] += float(signal)
      totals[gemm][1] += float(noise)
  return {gemm: sqnr_db(*totals[gemm]) for gemm in GEMMS}
