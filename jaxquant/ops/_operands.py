"""GEMM operand preparation: which usages each operand needs, and producing them.

Shared by `dense` and `grouped_dense`. Everything here works on one 2-D logical matrix
(NUMERICS.md, "Usages and layouts": x [M, K], w [N, K], dy [M, N]) plus its quantizer,
and knows nothing about custom_vjp or modules. An *operand* is what `ops.gemm` takes:
a `QuantizedData` in its stored layout, or a high-precision matrix in that layout
(the matrix itself for rowwise, its transpose for columnwise).

The three GEMMs of a linear layer and the usage each consumes (`GEMM_OPERANDS`):

| GEMM  | A operand           | B operand          |
| ----- | ------------------- | ------------------ |
| fprop | input rowwise       | weight rowwise     |
| dgrad | grad_output rowwise | weight columnwise  |
| wgrad | input columnwise    | grad_output columnwise |

With `backward="high_precision"` or `"dequantized"` the backward GEMMs take
high-precision operands, so only the rowwise (forward) usages of input and weight are
quantized and grad_output is not quantized at all (`usages_to_quantize`).
"""

from __future__ import annotations

from typing import Mapping, Optional

import jax
import jax.numpy as jnp

from jaxquant import recipes, reference
from jaxquant.formats import Family, Format
from jaxquant.kernels import _gemm_values as gemm_values
from jaxquant.ops._backend import read_backend
from jaxquant.ops._gemm import VALUES, operand_form

# kernels where they run, else the reference
from jaxquant.ops._quantize import cast_groups, quantize_with
from jaxquant.quantizers import (
  BASE_QUANTIZER_TYPES,
  QUANTIZER_TYPES,
  MXFP8Quantizer,
  NVFP4Quantizer,
  Quantizer,
  for_usage,
  needs_key,
  needs_state,
)
from jaxquant.roles import TENSOR_TYPES
from jaxquant.tensor import USAGES, QuantizedData, Usage

# GEMM -> ((A tensor type, A usage), (B tensor type, B usage)).
GEMM_OPERANDS = {
  "fprop": (("input", "rowwise"), ("weight", "rowwise")),
  "dgrad": (("grad_output", "rowwise"), ("weight", "columnwise")),
  "wgrad": (("input", "columnwise"), ("grad_output", "columnwise")),
}


def gemm_matrices(m: int, k: int, n: int) -> dict[str, tuple[int, int]]:
  """The logical [rows, cols] of each tensor type of y [m, n] = x [m, k] . w [n, k]^T."""
  return {"input": (m, k), "weight": (n, k), "grad_output": (m, n)}


# The usages the forward GEMM (fprop) consumes, per tensor type.
FORWARD_USAGES: dict[str, tuple[Usage, ...]] = {
  t: tuple(u for tt, u in GEMM_OPERANDS["fprop"] if tt == t) for t in TENSOR_TYPES
}


def usages_to_quantize(tensor_type: str, backward: str) -> tuple[Usage, ...]:
  """The usages of a role's tensor that its GEMMs consume in quantized form.

  "quantized": every GEMM a tensor feeds (input, weight, grad_output: both usages).
  "high_precision" / "dequantized": only fprop is quantized (input and weight rowwise).
  """
  if backward == "quantized":
    return USAGES
  return FORWARD_USAGES[tensor_type]


def role_key(key: Optional[jax.Array], tensor_type: str) -> Optional[jax.Array]:
  """The stochastic-rounding key of one role: `fold_in(key, index)`, index in TENSOR_TYPES.

  input -> 0, weight -> 1, grad_output -> 2; deterministic, so a test or another op can
  reproduce it. (The reference quantizer then folds in 0 / 1 for the row/column usage.)
  """
  return None if key is None else jax.random.fold_in(key, TENSOR_TYPES.index(tensor_type))


def stored(matrix: jax.Array, usage: Usage) -> jax.Array:
  """A high-precision matrix in a usage's stored layout (columnwise is transposed)."""
  return matrix if usage == "rowwise" else matrix.T


def check_dims(shape: tuple[int, int], quantizer: Optional[Quantizer], usages, what: str) -> None:
  """Trace-time block-divisibility check of a logical [rows, cols] matrix, naming `what`."""
  rows, cols = shape
  for usage in usages:
    q = for_usage(quantizer, usage)
    if q is None:
      continue
    stored_shape = (rows, cols) if usage == "rowwise" else (cols, rows)
    layout = "[rows, cols]" if usage == "rowwise" else "[cols, rows] (transposed)"
    q.format(usage).check_dims(
      *stored_shape,
      what=(
        f"{what}: {usage} usage of the {list(shape)} matrix, stored {layout} = {list(stored_shape)}"
      ),
    )


def check_role_args(
  tensor_type: str, quantizer, usages, *, key, state, what: str, key_usages=None
) -> None:
  """Errors for a missing key or a missing / unexpected delayed-scaling state. The key is
  checked for `key_usages` (default: `usages`): a caller that checks the backward's usages
  when a backward is traced passes the forward's here."""
  quantized = [u for u in usages if for_usage(quantizer, u) is not None]
  if quantized and needs_state(quantizer) and state is None:
    raise ValueError(
      f"{what}: {quantizer!r} uses delayed scaling: pass state="
      f"{{'{tensor_type}': DelayedScalingState}} (scaling.init_state)"
    )
  check_key(quantizer, usages if key_usages is None else key_usages, key=key, what=what)


def check_key(quantizer, usages, *, key, what: str, backward: bool = False) -> None:
  """Errors for a missing key where a quantized usage among `usages` rounds stochastically
  (`backward`: usages of a backward pass being traced; a forward alone needs no key)."""
  rounds = any(
    for_usage(quantizer, u) is not None and needs_key(for_usage(quantizer, u)) for u in usages
  )
  if rounds and key is None:
    where = " in the backward pass (a forward alone needs no key)" if backward else ""
    raise ValueError(
      f"{what}: {quantizer!r} rounds stochastically{where}: pass a PRNG key as key= "
      "(jaxquant.flax: the 'quant' RNG stream, apply(..., rngs={'quant': key}) in Linen, "
      "rngs=nnx.Rngs(quant=seed) to quantize_model in NNX; jaxquant.quantize: "
      "qfn.apply(..., rng=key))"
    )


# A model's layers quantize operands of the same few shapes: as a nested jit, each
# (quantizer, usages, shape) is traced once, not once per GEMM site (XLA then inlines the
# calls; a sixth less time to trace and compile a train step). The backend choice is read
# outside, so the environment is read at every call, not only at the first trace.
_quantize_once_per_shape = jax.jit(
  quantize_with, static_argnames=("backend", "quantizer", "usages")
)


def quantize_operand(
  matrix: jax.Array,
  quantizer: Optional[Quantizer],
  usages,
  *,
  key: Optional[jax.Array] = None,
  state=None,
):
  """Produces the GEMM operand of each requested usage of a 2-D logical matrix.

  Returns `({usage: operand}, new_state)`. A usage whose quantizer is None (no
  quantizer, or a hybrid's None side) is the high-precision matrix in its stored
  layout and original dtype. `new_state` is `state` with this tensor's amax recorded
  (delayed scaling), else `state` unchanged. `key` is this tensor's own key
  (`role_key`), used only by quantizers that round stochastically.
  """
  if matrix.ndim != 2:
    raise ValueError(f"quantize_operand takes a 2-D matrix, got shape {matrix.shape}")
  usages = tuple(usages)
  quantized = tuple(u for u in usages if for_usage(quantizer, u) is not None)
  operands = {u: stored(matrix, u) for u in usages if u not in quantized}
  if not quantized:
    return operands, state
  # An empty matrix has nothing to cast: the reference gives its empty data and an
  # all-zero tensor's scales, and no cast kernel is launched on it.
  backend = read_backend("reference" if 0 in matrix.shape else None)
  out = _quantize_once_per_shape(
    backend,
    matrix,
    quantizer,
    quantized,
    key=key if needs_key(quantizer) else None,
    state=state if needs_state(quantizer) else None,
  )
  qt, new_state = out if needs_state(quantizer) else (out, state)
  for u in quantized:
    operands[u] = qt.usage(u)
  return operands, new_state


_OTHER_USAGE = {"rowwise": "columnwise", "columnwise": "rowwise"}


def _swapped(usages) -> tuple[Usage, ...]:
  """The usages of a matrix that give `usages` of its transpose (in USAGES order)."""
  return tuple(u for u in USAGES if _OTHER_USAGE[u] in usages)


def treats_usages_alike(quantizer: Optional[Quantizer]) -> bool:
  """One format for both usages and nothing usage-specific (no hybrid, no RHT on the
  columnwise usage, no per-usage SR stream, no per-token rows): then a matrix's columnwise
  usage is, bit for bit, its transpose's rowwise usage, and the other way round."""
  if not isinstance(quantizer, BASE_QUANTIZER_TYPES):
    return False  # high precision, or a hybrid
  if isinstance(quantizer, NVFP4Quantizer) and (
    quantizer.rht or quantizer.stochastic_rounding or quantizer.per_token
  ):
    return False
  return quantizer.format("rowwise") == quantizer.format("columnwise")


def quantize_transposed_operand(
  matrix: jax.Array,
  quantizer: Optional[Quantizer],
  usages,
  *,
  key: Optional[jax.Array] = None,
  state=None,
):
  """`quantize_operand(matrix.T, ...)`, casting `matrix` as it is where the quantizer treats
  both usages alike: the operands are the same bits, and no transposed copy of the matrix
  is made for the cast kernel (XLA materializes a transpose before a custom call; a
  [K, N] kernel's w = kernel.T is a full read and write of the weight)."""
  if not treats_usages_alike(quantizer):
    return quantize_operand(matrix.T, quantizer, usages, key=key, state=state)
  operands, new_state = quantize_operand(matrix, quantizer, _swapped(usages), key=key, state=state)
  return {u: operands[_OTHER_USAGE[u]] for u in usages}, new_state


def _values_format(quantizer: Optional[Quantizer], usage: Usage) -> Optional[Format]:
  """The format a values kernel casts `quantizer`'s usage to (a base quantizer's): MXFP8,
  NVFP4 with per-tensor global amaxes (no per_token), else None."""
  if type(quantizer) is MXFP8Quantizer or (
    type(quantizer) is NVFP4Quantizer and not quantizer.per_token
  ):
    return quantizer.format(usage)
  return None


def takes_gemm_values(
  quantizers: Mapping[str, Optional[Quantizer]], backward: str, m: int, k: int, n: int
) -> bool:
  """Whether a linear layer's operands are cast straight to the bf16 values its GEMMs
  multiply (kernels/_gemm_values.py) instead of to codes and scales: every usage of every
  role MXFP8 or NVFP4 with per-tensor global amaxes (no per_token; hybrids of the two
  too), all three GEMMs quantized, each one's route consuming values (ops.gemm
  `operand_form`: it dequantizes first), the casts the kernels' (the cast kernel not
  disabled), and dims the values kernels take (their dtypes are those `dense` accepts).
  The GEMM inputs are the same bits; what the backward pass keeps is bf16 values instead
  of 8- or 4-bit codes."""
  backend = read_backend()
  if backward != "quantized" or not backend.binds("quantize_usages"):
    return False
  formats = {
    (t, u): _values_format(for_usage(quantizers.get(t), u), u) for t in TENSOR_TYPES for u in USAGES
  }
  if None in formats.values():
    return False
  block = max(
    gemm_values.BLOCK if f.family is Family.MXFP8 else gemm_values.NVFP4_BLOCK
    for f in formats.values()
  )
  if any(d % block for d in (m, k, n)):
    return False
  # (A, B, A rows, B rows, k) of fprop, dgrad and wgrad.
  gemms = (
    (("input", "rowwise"), ("weight", "rowwise"), m, n, k),
    (("grad_output", "rowwise"), ("weight", "columnwise"), m, k, n),
    (("input", "columnwise"), ("grad_output", "columnwise"), k, n, m),
  )
  return all(
    operand_form(formats[a], formats[b], ra, rb, kk, backend) == VALUES
    for a, b, ra, rb, kk in gemms
  )


def gemm_values_operand(
  matrix: jax.Array,
  quantizer: Quantizer,
  usages,
  *,
  key: Optional[jax.Array] = None,
  transposed: bool = False,
) -> dict:
  """{usage: the values the GEMM multiplies} of `matrix`: bf16 values (MXFP8) or
  `ScaledValues` (NVFP4; `key` for stochastic rounding), one cast per distinct base
  quantizer (a hybrid's two usages: two). `transposed`: of matrix.T, each usage cast from
  matrix as it is where its quantizer treats both usages alike, as
  `quantize_transposed_operand` does."""

  def cast(source, base, wanted):
    if isinstance(base, NVFP4Quantizer):
      return gemm_values.nvfp4_values(source, base, wanted, key=key)
    return gemm_values.mxfp8_values(source, base, wanted)

  operands = {}
  for base, group in cast_groups(quantizer, tuple(usages)):
    if not transposed:
      operands.update(cast(matrix, base, group))
    elif not treats_usages_alike(base):
      operands.update(cast(matrix.T, base, group))
    else:
      values = cast(matrix, base, _swapped(group))
      operands.update({u: values[_OTHER_USAGE[u]] for u in group})
  return operands


def dequantized(operand, usage: Usage) -> jax.Array:
  """An operand back to an fp32 logical matrix (for backward="dequantized")."""
  if isinstance(operand, QuantizedData):
    matrix = reference.dequantize_data(operand)
  else:
    matrix = operand.astype(jnp.float32)
  return stored(matrix, usage)


def _is_nvfp4(q, **options) -> bool:
  return isinstance(q, NVFP4Quantizer) and all(getattr(q, k) == v for k, v in options.items())


def check_placement(
  quantizers: Mapping[str, Optional[Quantizer]], backward: str, what: str
) -> None:
  """Rejects quantizer options whose scales cannot factor out of the GEMMs that use them.

  Per-token NVFP4 (row-scaled rowwise usage): its row scales factor out of the GEMM's
  output rows only when the tensor is a GEMM's A operand, which for the rowwise usage is
  input (fprop) and grad_output (dgrad). The weight's rowwise usage is fprop's *B*
  operand: its rows are the output columns N, and N is dgrad's contraction dim, so
  per-row weight scales could neither go to the epilogue's row scaling nor be shared
  with the columnwise copy; it is a per-output-channel scheme, not per-token.

  RHT on a columnwise usage rotates the contraction dim of the GEMM that uses it; the
  rotation cancels only when the other operand is rotated the same way (R Rᵀ = I). For
  wgrad that means both grad_output and input columnwise carry RHT, or neither; the
  weight's columnwise usage (dgrad B) must not, as dy rowwise never does.
  """
  w_row = for_usage(quantizers.get("weight"), "rowwise")
  if _is_nvfp4(w_row, per_token=True):
    raise ValueError(
      f"{what}: per_token NVFP4 is not allowed for the weight role: w's rows are fprop's "
      "output columns (B operand) and dgrad's contraction dim, so row scales cannot "
      "factor out of the GEMM output rows; use per_token for input / grad_output"
    )
  if backward != "quantized":
    return
  if _is_nvfp4(for_usage(quantizers.get("weight"), "columnwise"), rht=True):
    raise ValueError(
      f"{what}: RHT on the weight's columnwise usage would rotate dgrad's "
      "contraction dim on one operand only; RHT belongs to wgrad operands"
    )
  rht = {
    t: _is_nvfp4(for_usage(quantizers.get(t), "columnwise"), rht=True)
    for t in ("input", "grad_output")
  }
  if rht["input"] != rht["grad_output"]:
    on, off = ("input", "grad_output") if rht["input"] else ("grad_output", "input")
    raise ValueError(
      f"{what}: RHT on the {on} columnwise usage but not on {off}'s: wgrad "
      "needs both operands rotated by the same R (or neither) to cancel it"
    )


def is_high_precision(quantizers: Mapping[str, Optional[Quantizer]]) -> bool:
  """Whether no usage of any role is quantized (the plain-jnp path)."""
  return all(for_usage(q, u) is None for q in quantizers.values() for u in USAGES)


def backward_residual(operands: Mapping[Usage, object], matrix: jax.Array, backward: str):
  """What the forward saves for the backward GEMM that takes this tensor's columnwise usage.

  "quantized": the columnwise operand itself (quantized; never the high-precision x);
  "high_precision": the high-precision matrix; "dequantized": the rowwise operand, to be
  dequantized in the backward pass (smaller to keep than its fp32 values).
  """
  if backward == "quantized":
    return operands["columnwise"]
  if backward == "high_precision":
    return matrix
  return operands["rowwise"]


def columnwise_operand(residual, backward: str):
  """The columnwise GEMM operand rebuilt from `backward_residual`'s result."""
  if backward == "quantized":
    return residual
  if backward == "high_precision":
    return stored(residual, "columnwise")
  return stored(dequantized(residual, "rowwise"), "columnwise")


def resolve_quantizers(recipe, quantizers, module_type: str, name: str, what: str):
  """({tensor_type: quantizer or None}, the default backward mode, the default GEMMs
  allowed fast accumulation) from a recipe, or from a dict (then "quantized" and none)."""
  if recipe is not None and quantizers is not None:
    raise ValueError(f"{what}: pass recipe= or quantizers=, not both")
  if quantizers is None:
    recipe = recipes.resolve(recipe)
    return recipe.quantizers(module_type, name), recipe.backward, recipe.fast_accumulation
  unknown = set(quantizers) - set(TENSOR_TYPES)
  if unknown:
    raise ValueError(
      f"{what}: quantizers has unknown tensor types {sorted(unknown)}; "
      f"expected keys among {TENSOR_TYPES}"
    )
  for t, q in quantizers.items():
    if q is not None and not isinstance(q, QUANTIZER_TYPES):
      raise TypeError(f"{what}: quantizers[{t!r}] must be a jaxquant quantizer or None, got {q!r}")
  return {t: quantizers.get(t) for t in TENSOR_TYPES}, "quantized", frozenset()


def check_state(quantizers, state, what: str) -> None:
  """State must hold exactly the delayed-scaling roles."""
  stateful = {t for t, q in quantizers.items() if needs_state(q)}
  given = set(state or {})
  if state is not None and given - stateful:
    raise ValueError(
      f"{what}: state has entries {sorted(given - stateful)} whose quantizers "
      "do not use delayed scaling; state holds exactly the delayed roles "
      f"({sorted(stateful) or 'none here'})"
    )
  if stateful - given:
    raise ValueError(
      f"{what}: roles {sorted(stateful - given)} use delayed scaling: pass "
      "state={tensor_type: scaling.init_state(quantizer)} for each"
    )
