"""The "quant" RNG stream: where a stochastically rounding GEMM draws its key.

Linen modules draw from the stream of `apply(..., rngs={"quant": key})`. NNX modules draw
from an `nnx.Rngs` holding a "quant" stream: a layer's own `quant_rngs`, or the `rngs`
given to `quantize_model`. A GEMM whose quantizers round deterministically draws nothing,
so the stream is needed only by recipes that use it.

NNX keys never mutate a stream from a trace it does not belong to (`jax.checkpoint` over
`nnx.split` / `nnx.merge`, a closure under `nnx.remat`, `nnx.scan` bodies): Flax refuses
that. As Flax forks a stream for its transforms, a quantized model's call draws one key
where the model lives (`call_keys`), and each GEMM inside derives its own from it by
folding in its label (the GEMM's name), how many times that label drew before in this
call, and, for a layer stacked by `nnx.vmap`, its index in the stack (`LayerIndex`). A
layer's own `quant_rngs` is advanced where that trace may; where it may not, its key is
derived from the stream's key and count without advancing it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import zlib
from typing import Any, Optional

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from jaxquant.intercept._keys import draws_key

QUANT_RNG = "quant"


def linen_key(
  module: nn.Module, quantizers, what: str, *, optional: bool = False
) -> Optional[jax.Array]:
  """A Linen module's key for its GEMM's stochastic rounding (None when none rounds so).
  Without a "quant" stream: None where `optional` (`ops.dense`, which asks for the key
  only where it rounds: a forward alone, when its rounding is the gradient's), else an
  error saying how to pass one."""
  if not draws_key(quantizers):
    return None
  if module.is_initializing():
    return jax.random.key(0)  # init needs shapes only; the params stream stays untouched
  if not module.has_rng(QUANT_RNG):
    if optional:
      return None
    raise ValueError(
      f"{what}: its recipe rounds stochastically; pass a PRNG key for the "
      f"{QUANT_RNG!r} stream: model.apply(..., rngs={{'{QUANT_RNG}': key}})"
    )
  return module.make_rng(QUANT_RNG)


class LayerIndex(nnx.Variable):
  """A stacked layer's index in its stack (int32, the stack's shape): `nnx.scan` and
  `nnx.vmap` hand each layer its own, which its keys fold in."""


def layer_index(stacked_dims: tuple[int, ...]) -> LayerIndex:
  """The `LayerIndex` of layers stacked along `stacked_dims` (e.g. (layers,))."""
  count = 1
  for d in stacked_dims:
    count *= d
  return LayerIndex(jnp.arange(count, dtype=jnp.int32).reshape(stacked_dims))


@dataclasses.dataclass
class _CallKeys:
  """One model call's key and how many keys each label drew from it (at trace time)."""

  key: jax.Array
  draws: dict[str, int] = dataclasses.field(default_factory=dict)

  def next_draw(self, label: str) -> int:
    n = self.draws.get(label, 0)
    self.draws[label] = n + 1
    return n


_CALL_KEYS: contextvars.ContextVar[Optional[_CallKeys]] = contextvars.ContextVar(
  "jaxquant_nnx_call_keys", default=None
)


def _draw(stream: nnx.RngStream) -> jax.Array:
  """The stream's next key: advanced where this trace may mutate it, else derived from its
  key and count as they stand (a copy merged inside the trace advances; one outside does not)."""
  try:
    return stream()  # checks that it may before it advances
  except flax.errors.TraceContextError:
    return jax.random.fold_in(stream.key[...], stream.count[...])


@contextlib.contextmanager
def call_keys(rngs: Optional[nnx.Rngs]):
  """Within: NNX GEMMs without their own `quant_rngs` derive their keys from one key drawn
  now from `rngs`' "quant" stream (called where the model lives, so it may advance it).
  Without such a stream, an enclosing call's key, if any, stays in force."""
  try:
    stream = None if rngs is None else rngs[QUANT_RNG]
  except (KeyError, AttributeError):
    stream = None
  if stream is None:
    yield
    return
  token = _CALL_KEYS.set(_CallKeys(_draw(stream)))
  try:
    yield
  finally:
    _CALL_KEYS.reset(token)


def nnx_key(
  rngs: Optional[nnx.Rngs],
  quantizers,
  what: str,
  how_to_pass: Any,
  index: Optional[LayerIndex] = None,
  *,
  optional: bool = False,
) -> Optional[jax.Array]:
  """An NNX GEMM's key (None when no quantizer rounds stochastically): from `rngs`' "quant"
  stream, else from the running model call's key (`call_keys`), folded with `what` (the
  GEMM's label), its draw count in this call and its `index` in a stack of layers. With
  neither: None where `optional` (as `linen_key`), else an error whose "pass
  <how_to_pass>" says how to give one."""
  if not draws_key(quantizers):
    return None
  call = _CALL_KEYS.get()
  if rngs is not None:
    key = _draw(rngs[QUANT_RNG])
  elif call is not None:
    key = call.key
  elif optional:
    return None
  else:
    raise ValueError(f"{what}: its recipe rounds stochastically; pass {how_to_pass}")
  key = jax.random.fold_in(key, zlib.crc32(what.encode()) & 0x7FFFFFFF)
  if call is not None:
    key = jax.random.fold_in(key, call.next_draw(what))
  if index is not None:
    key = jax.random.fold_in(key, index[...])
  return key
