"""`dense`: a linear layer y = x @ kernel + bias with per-role quantized GEMMs.

This module resolves the quantizers (recipe or explicit), validates every argument at
trace time with errors that name the module and role, splits the caller's PRNG key per
role, and hands 2-D matrices to the custom_vjp in `dense_vjp`. With no quantized usage
at all (e.g. the bf16 recipe) it is a plain `jnp.dot` in x's dtype, so its values and
gradients are exactly jnp's. Its output is named `jaxquant.output` either way (remat.py).
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional, Union

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxquant import recipes
from jaxquant.formats import INPUT_DTYPES
from jaxquant.ops import _weight_gather as gathering
from jaxquant.ops._dense_vjp import DenseConfig, dense_2d
from jaxquant.ops._operands import (
  FORWARD_USAGES,
  check_dims,
  check_placement,
  check_role_args,
  check_state,
  gemm_matrices,
  is_high_precision,
  resolve_quantizers,
  role_key,
  takes_gemm_values,
  usages_to_quantize,
)
from jaxquant.ops._remat import OUTPUT_NAME
from jaxquant.ops._shard_scaling import ShardScaling, check_shard_scaling
from jaxquant.quantizers import Quantizer, needs_key
from jaxquant.roles import LINEAR, TENSOR_TYPES


def _check_shapes(x, kernel, bias, what: str) -> None:
  if jnp.ndim(kernel) != 2:
    raise ValueError(
      f"{what}: kernel must be rank 2 [K, N] (Flax layout), got shape {kernel.shape}"
    )
  if jnp.ndim(x) < 1:
    raise ValueError(f"{what}: x must have a last (contraction) dim [..., K], got a scalar")
  if x.shape[-1] != kernel.shape[0]:
    raise ValueError(
      f"{what}: contraction dims differ: x is {x.shape} (K={x.shape[-1]}) but "
      f"kernel is {kernel.shape} (K={kernel.shape[0]}); kernel must be [K, N]"
    )
  if bias is not None and tuple(bias.shape) != (kernel.shape[1],):
    raise ValueError(f"{what}: bias must have shape ({kernel.shape[1]},) = [N], got {bias.shape}")
  for arg, a in (("x", x), ("kernel", kernel)) + ((("bias", bias),) if bias is not None else ()):
    if jnp.dtype(a.dtype) not in INPUT_DTYPES:
      raise TypeError(
        f"{what}: {arg} dtype must be one of bfloat16, float16, float32, got {a.dtype}"
      )


def dense(
  x: jax.Array,
  kernel: jax.Array,
  bias: Optional[jax.Array] = None,
  *,
  recipe: Optional[Union[recipes.CustomRecipe, str]] = None,
  quantizers: Optional[Mapping[str, Optional[Quantizer]]] = None,
  name: str = "",
  module_type: str = LINEAR,
  backward: Optional[str] = None,
  key: Optional[jax.Array] = None,
  state: Optional[Mapping[str, object]] = None,
  weight_gather: Optional[gathering.WeightGather] = None,
  fast_accumulation: Optional[Iterable[str]] = None,
  shard_scaling: Optional[ShardScaling] = None,
):
  """y = x @ kernel + bias with the GEMMs in the formats the recipe picks per role.

  Args:
    x: [..., K] activations, bfloat16 / float16 / float32. The output has x's dtype.
    kernel: [K, N] weights (Flax layout). Its gradient comes back in its own dtype.
      Any of M, K, N may be 0: empty outputs and gradients, or (K = 0) empty sums, zeros.
    bias: optional [N], added in fp32 after the GEMM's output scales.
    recipe: maps each role (module_type, tensor_type, name) to a quantizer, or a preset's
      name (`recipes.resolve`); default the autocast recipe, else bf16. Mutually exclusive
      with `quantizers`.
    quantizers: {tensor_type: quantizer or None} for "input", "weight", "grad_output";
      a missing entry is None (high precision).
    name: the module path, passed to the recipe's roles and used in error messages.
    module_type: the roles' module_type.
    backward: "quantized" | "high_precision" | "dequantized": what the dgrad and wgrad
      GEMMs consume (recipes.BackwardMode); default the recipe's, else "quantized".
    key: one PRNG key for stochastic rounding; role t uses `fold_in(key, i)`, i the
      index of t in ("input", "weight", "grad_output") (operands.role_key).
    state: {tensor_type: DelayedScalingState} for exactly the delayed-scaling roles.
    weight_gather: the kernel is sharded FSDP-style (`WeightGather(mesh, kernel_spec,
      axis)`): each device quantizes its shard and the codes and scales are all-gathered,
      the same bits as gathering the kernel and quantizing it (ops/_weight_gather.py). A
      weight with no quantized usage (bf16) is gathered by XLA as without the option.
    fast_accumulation: the GEMMs among ("fprop", "dgrad", "wgrad") whose per-tensor FP8
      kernel may accumulate in cuBLASLt's fast mode (recipes.CustomRecipe); default the
      recipe's, else none.
    shard_scaling: the rows of x (its tokens) are split over `ShardScaling(mesh, axis)`:
      x and dy, per-tensor FP8 with current scaling, are scaled per shard, each by the
      amax of its own rows, so no device waits on an amax all-reduce before their casts;
      the bits then differ from the unsharded call's (ops/_shard_scaling.py).

  Returns:
    y [..., N], or `(y, new_state)` when `state` is given: new_state records the input
    and weight amaxes. The grad_output amax arrives as the gradient with respect to
    `state["grad_output"]` (fold it in with `scaling.record_grad_amax`).
  """
  what = f"dense {name!r}"
  _check_shapes(x, kernel, bias, what)
  quantizers, default_backward, default_fast = resolve_quantizers(
    recipe, quantizers, module_type, name, what
  )
  backward = default_backward if backward is None else backward
  fast_accumulation = (
    default_fast
    if fast_accumulation is None
    else recipes.check_fast_accumulation(fast_accumulation, what)
  )
  if backward not in recipes.BACKWARD_MODES:
    raise ValueError(f"{what}: backward must be one of {recipes.BACKWARD_MODES}, got {backward!r}")
  m = math.prod(x.shape[:-1])
  if shard_scaling is not None:
    check_shard_scaling(shard_scaling, quantizers, backward, m, what)
  check_state(quantizers, state, what)
  weight_gather = gathering.resolve(
    weight_gather, quantizers["weight"], usages_to_quantize("weight", backward), kernel.shape, what
  )

  if is_high_precision(quantizers):
    y = jnp.dot(x, kernel.astype(x.dtype))
    if bias is not None:
      y = y + bias.astype(x.dtype)
    y = checkpoint_name(y, OUTPUT_NAME)
    return y if state is None else (y, dict(state))

  k, n = kernel.shape
  check_placement(quantizers, backward, what)
  shapes = gemm_matrices(m, k, n)
  keys = {}
  for t in TENSOR_TYPES:
    usages = usages_to_quantize(t, backward)
    # The forward's usages here; the backward's when a backward is traced (dense_vjp).
    check_dims(shapes[t], quantizers[t], FORWARD_USAGES[t], f"{what} {t}")
    # The backward's keys are checked when a backward is traced (dense_vjp): a forward
    # alone (evaluation, generation) runs without one.
    check_role_args(
      t,
      quantizers[t],
      usages,
      key=key,
      state=(state or {}).get(t),
      what=f"{what} {t}",
      key_usages=FORWARD_USAGES[t],
    )
    keys[t] = role_key(key, t) if needs_key(quantizers[t]) else None

  values = weight_gather is None and takes_gemm_values(quantizers, backward, m, k, n)
  cfg = DenseConfig(
    tuple(quantizers.items()),
    backward,
    jnp.dtype(kernel.dtype),
    None if bias is None else jnp.dtype(bias.dtype),
    what,
    weight_gather,
    fast_accumulation,
    values,
    shard_scaling,
  )
  y, new_state = dense_2d(cfg, x.reshape(m, k), kernel, bias, keys, dict(state or {}))
  # Named as the [M, N] matrix the backward's bias gradient sums: named after the reshape,
  # a saved y reaches that sum as [..., N], and XLA folds the reshape into it, a sum over
  # several dims in another order than without remat (other bits).
  y = checkpoint_name(y, OUTPUT_NAME).reshape(*x.shape[:-1], n)
  return y if state is None else (y, new_state)
