"""`grouped_dense`: one linear layer per group (MoE experts), y[m] = x[m] @ kernel[g(m)].

Rows of x are contiguous per group (`group_sizes`, a device array: nothing here reads it
on the host, so it may be traced). The three GEMMs and their usages are those of
`dense` (ops/_operands.py, GEMM_OPERANDS), per group:

    fprop  y_g   = x_g · w_gᵀ      x rowwise,  w_g rowwise
    dgrad  dx_g  = dy_g · w_g      dy rowwise, w_g columnwise
    wgrad  dw_gᵀ = dy_gᵀ · x_g     dy columnwise, x columnwise

with the per-group scales and the block rule of `reference.grouped` (per-tensor scales
become per group, columnwise blocks never straddle a group boundary: each group is
zero-padded to its block). The operands come from ops/_grouped_operands.py (per-tensor FP8
cast per group straight from the input's dtype; the other formats through
`reference.grouped`), the GEMMs from ops/_grouped_gemm.py: on Hopper all three run on the
CUTLASS grouped kernels (fprop and dgrad grouped by rows, wgrad by its contraction, each
expert's K its rows) for operands they hold exactly, elsewhere on `reference._ragged`'s
fp32 products, in memory that does not grow with G.

Delayed scaling keeps one state per group: `{tensor_type: DelayedScalingState}` with
`amax_history [G, L]` and `scale [G]` (`init_grouped_state`); `jaxquant.flax`'s
`update_quant_state` and the `scaling` functions apply per group through their
leading-axis handling.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Mapping, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxquant import recipes, scaling
from jaxquant.formats import INPUT_DTYPES
from jaxquant.ops import _delayed_state as delayed_state
from jaxquant.ops import _grouped_operands as operands
from jaxquant.ops._grouped_gemm import grouped_contract, grouped_matmul
from jaxquant.ops._operands import (
  check_placement,
  check_role_args,
  check_state,
  is_high_precision,
  resolve_quantizers,
  role_key,
  usages_to_quantize,
)
from jaxquant.ops._remat import OUTPUT_NAME, tag_grouped_residual
from jaxquant.quantizers import DelayedFloat8Quantizer, Quantizer, for_usage, needs_key
from jaxquant.reference import _fp32 as fp32
from jaxquant.reference import _grouped as ref
from jaxquant.roles import GROUPED_LINEAR, TENSOR_TYPES


@dataclasses.dataclass(frozen=True)
class GroupedDenseConfig:
  """Static (hashable) description of one grouped_dense call."""

  quantizers: tuple[tuple[str, Optional[Quantizer]], ...]
  backward: str
  kernel_dtype: jnp.dtype
  bias_dtype: Optional[jnp.dtype]
  tile: int  # rows per work item of reference._ragged (0: automatic)

  def quantizer(self, tensor_type: str) -> Optional[Quantizer]:
    return dict(self.quantizers)[tensor_type]


# ---- Delayed-scaling state, one per group ----


def _delayed_side(q: Quantizer) -> DelayedFloat8Quantizer:
  return next(
    s for u in ("rowwise", "columnwise") if isinstance(s := for_usage(q, u), DelayedFloat8Quantizer)
  )


def init_grouped_state(quantizers: Mapping[str, Optional[Quantizer]], num_groups: int):
  """{tensor_type: DelayedScalingState with amax_history [G, L] and scale [G]} for the
  delayed-scaling roles. Advance it with `update_grouped_state` (or
  `jaxquant.flax.update_quant_state`)."""
  out = {}
  for t, q in quantizers.items():
    if q is not None and any(
      isinstance(for_usage(q, u), DelayedFloat8Quantizer) for u in ("rowwise", "columnwise")
    ):
      one = scaling.init_state(_delayed_side(q))
      out[t] = jax.tree.map(lambda a: jnp.broadcast_to(a, (num_groups,) + a.shape), one)
  return out


def update_grouped_state(state, quantizers: Mapping[str, Optional[Quantizer]], state_grads=None):
  """Once per step: folds in the grad_output amaxes (from `state_grads`), then updates."""
  out = {}
  for t, s in state.items():
    if state_grads is not None and t == "grad_output":
      s = jax.vmap(scaling.record_grad_amax)(s, state_grads[t])
    out[t] = delayed_state.update(s, _delayed_side(quantizers[t]))  # [G, L]: one per group
  return out


def _usage_key(key, usage):
  return None if key is None else jax.random.fold_in(key, 0 if usage == "rowwise" else 1)


def _scale_of(state):
  return None if state is None else state.scale


# ---- The custom_vjp ----


def _forward(cfg, x, kernel, group_sizes, bias, keys, state):
  layout = ref.group_layout(group_sizes, x.shape[0])
  qx, qw = cfg.quantizer("input"), cfg.quantizer("weight")
  new_state = dict(state)
  x_args = dict(what="input", delayed_scale=_scale_of(state.get("input")))
  x_row, x_amax = operands.quantize_rows(
    x, layout, qx, "rowwise", key=_usage_key(keys["input"], "rowwise"), **x_args
  )
  w_row, w_amax = operands.quantize_experts(
    kernel,
    qw,
    "rowwise",
    delayed_scale=_scale_of(state.get("weight")),
    key=_usage_key(keys["weight"], "rowwise"),
  )
  for t, amax in (("input", x_amax), ("weight", w_amax)):
    if amax is not None:
      new_state[t] = scaling.record_amax(state[t], amax)
  if bias is None:
    y = grouped_matmul(x_row, w_row, out_dtype=x.dtype, tile=cfg.tile)
  else:  # added in fp32 after the output scales
    y = grouped_matmul(x_row, w_row, out_dtype=jnp.float32, tile=cfg.tile)
    y = y + bias.astype(jnp.float32)[layout.row_gather_ids()]
    y = jnp.where(layout.row_mask()[:, None], y, 0.0).astype(x.dtype)
  if cfg.backward == "quantized":
    x_res, _ = operands.quantize_rows(
      x, layout, qx, "columnwise", key=_usage_key(keys["input"], "columnwise"), **x_args
    )
  elif cfg.backward == "high_precision":
    x_res, _ = operands.quantize_rows(x, layout, None, "columnwise", what="input")
  else:  # dequantized: the forward's rowwise values with their scales applied
    x_res = operands.scaled_values(x_row)
  x_res = tag_grouped_residual(x_res, "input")
  return y, new_state, x_res


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def grouped_dense_2d(cfg: GroupedDenseConfig, x, kernel, group_sizes, bias, keys, state):
  """(y [M, N] in x's dtype, new_state)."""
  y, new_state, _ = _forward(cfg, x, kernel, group_sizes, bias, keys, state)
  return y, new_state


def _fwd(cfg, x, kernel, group_sizes, bias, keys, state):
  y, new_state, x_res = _forward(cfg, x, kernel, group_sizes, bias, keys, state)
  saved = (x_res, kernel, group_sizes, keys, state.get("weight"), state.get("grad_output"))
  return (y, new_state), saved


def _weight_columnwise(cfg, kernel, w_state, key) -> operands.GroupedOperand:
  """Each expert's w for dgrad, stored [K, N] (the kernel's own layout)."""
  qw = cfg.quantizer("weight")
  if cfg.backward == "quantized":
    w_col, _ = operands.quantize_experts(
      kernel, qw, "columnwise", delayed_scale=_scale_of(w_state), key=_usage_key(key, "columnwise")
    )
    return w_col
  if cfg.backward == "high_precision":
    return operands.quantize_experts(kernel, None, "columnwise")[0]
  w_row, _ = operands.quantize_experts(
    kernel, qw, "rowwise", delayed_scale=_scale_of(w_state), key=_usage_key(key, "rowwise")
  )
  if w_row.group_scale is not None:  # the scale is applied, so the values are no longer codes
    w_row = operands.scaled_values(w_row)
  return dataclasses.replace(w_row, values=jnp.swapaxes(w_row.values, 1, 2))


def _common_rows(a: operands.GroupedOperand, b: operands.GroupedOperand):
  """Both wgrad operands on one row layout (the padded one when either is RHT'd)."""
  if a.layout.rows < b.layout.rows:
    a = dataclasses.replace(a, values=ref.to_layout(a.values, a.layout, b.layout), layout=b.layout)
  elif b.layout.rows < a.layout.rows:
    b = dataclasses.replace(b, values=ref.to_layout(b.values, b.layout, a.layout), layout=a.layout)
  return a, b


def _bwd(cfg, saved, cotangents):
  x_res, kernel, group_sizes, keys, w_state, dy_state = saved
  dy, state_ct = cotangents
  layout = ref.group_layout(group_sizes, dy.shape[0])
  qdy = cfg.quantizer("grad_output") if cfg.backward == "quantized" else None
  dy_key = keys["grad_output"]
  common = dict(what="grad_output", delayed_scale=_scale_of(dy_state))
  dy_row, dy_amax = operands.quantize_rows(
    dy, layout, qdy, "rowwise", key=_usage_key(dy_key, "rowwise"), **common
  )
  dy_col, _ = operands.quantize_rows(
    dy, layout, qdy, "columnwise", key=_usage_key(dy_key, "columnwise"), **common
  )
  w_col = _weight_columnwise(cfg, kernel, w_state, keys["weight"])
  dx = grouped_matmul(dy_row, w_col, out_dtype=dy.dtype, tile=cfg.tile)  # y's dtype, x's
  # [G, K, N]: A (x) then B (dy), each group's scales folded into one factor.
  x_res, dy_col = _common_rows(x_res, dy_col)
  dkernel = grouped_contract(x_res, dy_col, out_dtype=cfg.kernel_dtype, tile=cfg.tile)

  dbias = None
  if cfg.bias_dtype is not None:
    dy32 = jnp.where(layout.row_mask()[:, None], fp32.widen(dy), 0.0)
    dbias = jax.ops.segment_sum(dy32, layout.group_ids, layout.num_groups + 1)[
      : layout.num_groups
    ].astype(cfg.bias_dtype)
  state_ct = dict(state_ct)
  if dy_amax is not None:
    state_ct["grad_output"] = jax.vmap(scaling.fold_grad_amax)(state_ct["grad_output"], dy_amax)
  gs_ct = np.zeros(group_sizes.shape, jax.dtypes.float0)
  return dx, dkernel, gs_ct, dbias, None, state_ct


grouped_dense_2d.defvjp(_fwd, _bwd)


# ---- The public op ----


def _check_args(x, kernel, group_sizes, bias, what):
  if jnp.ndim(kernel) != 3:
    raise ValueError(
      f"{what}: kernel must be rank 3 [G, K, N] (one [K, N] per group), got "
      f"shape {jnp.shape(kernel)}"
    )
  if jnp.ndim(x) != 2:
    raise ValueError(
      f"{what}: x must be rank 2 [M, K] (rows grouped along M), got shape {jnp.shape(x)}"
    )
  num_groups, k, n = kernel.shape
  if x.shape[1] != k:
    raise ValueError(
      f"{what}: contraction dims differ: x is {x.shape} (K={x.shape[1]}) but "
      f"kernel is {kernel.shape} (K={k}); kernel must be [G, K, N]"
    )
  if jnp.shape(group_sizes) != (num_groups,):
    raise ValueError(
      f"{what}: group_sizes must have shape ({num_groups},) = [G] to match "
      f"kernel {kernel.shape}, got {jnp.shape(group_sizes)}"
    )
  if not jnp.issubdtype(jnp.result_type(group_sizes), jnp.integer):
    raise TypeError(
      f"{what}: group_sizes must be an integer array (int32), got {jnp.result_type(group_sizes)}"
    )
  if bias is not None and tuple(bias.shape) != (num_groups, n):
    raise ValueError(
      f"{what}: bias must have shape ({num_groups}, {n}) = [G, N] (one per group), got {bias.shape}"
    )
  for arg, a in (("x", x), ("kernel", kernel)) + ((("bias", bias),) if bias is not None else ()):
    if jnp.dtype(a.dtype) not in INPUT_DTYPES:
      raise TypeError(
        f"{what}: {arg} dtype must be one of bfloat16, float16, float32, got {a.dtype}"
      )
  if not isinstance(group_sizes, jax.core.Tracer):  # known values: check them now
    sizes = np.asarray(group_sizes)
    if (sizes < 0).any():
      raise ValueError(f"{what}: group_sizes must be >= 0, got {sizes.tolist()}")
    if sizes.sum() > x.shape[0]:
      raise ValueError(
        f"{what}: group_sizes sum to {int(sizes.sum())}, more than the {x.shape[0]} rows of x"
      )


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_weight_dims(quantizers, backward, k, n, what):
  """Each expert's w [N, K] must tile into its blocks like a dense weight."""
  for usage in usages_to_quantize("weight", backward):
    q = for_usage(quantizers["weight"], usage)
    if q is not None:
      stored = (n, k) if usage == "rowwise" else (k, n)
      q.format(usage).check_dims(
        *stored,
        what=f"{what} weight: {usage} usage of each "
        f"expert's [N, K] = [{n}, {k}] weight, stored {list(stored)}",
      )


def grouped_dense(
  x: jax.Array,
  kernel: jax.Array,
  group_sizes: jax.Array,
  bias: Optional[jax.Array] = None,
  *,
  recipe: Optional[Union[recipes.CustomRecipe, str]] = None,
  quantizers: Optional[Mapping[str, Optional[Quantizer]]] = None,
  name: str = "",
  backward: Optional[str] = None,
  key: Optional[jax.Array] = None,
  state: Optional[Mapping[str, scaling.DelayedScalingState]] = None,
  tile: int = 0,
):
  """y[m] = x[m] @ kernel[g] + bias[g] for the rows m of group g, quantized per role.

  Args:
    x: [M, K] activations, rows sorted by group: group g owns the `group_sizes[g]` rows
      after those of groups < g. Rows at or past `sum(group_sizes)` give zero outputs
      and zero gradients. The output has x's dtype.
    kernel: [G, K, N], one Flax-layout [K, N] weight per group; its gradient is [G, K, N].
      With no quantized usage (the bf16 recipe) the GEMMs take it in x's dtype, as
      `ops.dense` does.
      Any of G, M, K, N may be 0 (G = 0: no row is in a group, so every output is zero).
    group_sizes: [G] integer device array (may be traced; never read on the host under
      jit), or host values (a list, a numpy array). Empty groups are allowed. Values
      known at trace time are checked (>= 0, sum <= M); traced values are clipped so that
      no group reaches past row M.
    bias: optional [G, N], one bias per group, added in fp32 after the output scales.
    recipe / quantizers / backward / key / name: as `ops.dense`; roles have
      module_type "grouped_linear".
    state: {tensor_type: DelayedScalingState} for exactly the delayed roles, each with a
      leading group axis (`init_grouped_state`).
    tile: rows per work item of the ragged GEMMs (0: about M / G); a tuning knob only.

  Returns:
    y [M, N], or (y, new_state) when `state` is given (per-group input and weight amaxes
    recorded; grad_output's per-group amax arrives as the gradient of `state`).
  """
  what = f"grouped_dense {name!r}"
  if isinstance(group_sizes, (list, tuple)):  # host values, as an array would hold them
    group_sizes = np.asarray(group_sizes) if len(group_sizes) else np.zeros((0,), np.int32)
  _check_args(x, kernel, group_sizes, bias, what)
  if not _is_int(tile) or tile < 0:
    error = ValueError if _is_int(tile) else TypeError
    raise error(f"{what}: tile must be an int >= 0 (0: automatic), got {tile!r}")
  # Grouped GEMMs (CUTLASS) have no fast-accumulation mode: the recipe's choice is moot here.
  quantizers, default_backward, _ = resolve_quantizers(
    recipe, quantizers, GROUPED_LINEAR, name, what
  )
  backward = default_backward if backward is None else backward
  if backward not in recipes.BACKWARD_MODES:
    raise ValueError(f"{what}: backward must be one of {recipes.BACKWARD_MODES}, got {backward!r}")
  check_state(quantizers, state, what)
  check_placement(quantizers, backward, what)
  num_groups, k, n = kernel.shape
  _check_weight_dims(quantizers, backward, k, n, what)
  keys = {}
  for t in TENSOR_TYPES:
    role_state = (state or {}).get(t)
    check_role_args(
      t,
      quantizers[t],
      usages_to_quantize(t, backward),
      key=key,
      state=role_state,
      what=f"{what} {t}",
    )
    if role_state is not None and role_state.scale.shape != (num_groups,):
      raise ValueError(
        f"{what}: state[{t!r}] must hold one scale per group ([{num_groups}]), "
        f"got scale shape {role_state.scale.shape}; use init_grouped_state"
      )
    keys[t] = role_key(key, t) if needs_key(quantizers[t]) else None
  if num_groups == 0:
    # Every row belongs to no group: zero outputs, and zero gradients for x (the kernel,
    # bias and state hold no group, so there is nothing else to compute or record).
    y = jnp.zeros((x.shape[0], n), x.dtype)
    return y if state is None else (y, dict(state))
  if is_high_precision(quantizers):
    # As ops.dense: with no quantized usage the GEMMs run in x's dtype (a bf16 x meets the
    # kernel's bf16 copy on the bf16 tensor cores, not an fp32 kernel off them); the
    # kernel's gradient comes back in its own dtype through the cast.
    kernel = kernel.astype(x.dtype)
  cfg = GroupedDenseConfig(
    tuple(quantizers.items()),
    backward,
    jnp.dtype(kernel.dtype),
    None if bias is None else jnp.dtype(bias.dtype),
    tile,
  )
  y, new_state = grouped_dense_2d(
    cfg, x, kernel, jnp.asarray(group_sizes, jnp.int32), bias, keys, dict(state or {})
  )
  y = checkpoint_name(y, OUTPUT_NAME)
  return y if state is None else (y, new_state)
