"""The quantized linear layer as a custom_vjp over 2-D matrices: three GEMMs.

    fprop  y  = x · wᵀ     gemm(x rowwise,  w rowwise)
    dgrad  dx = dy · w     gemm(dy rowwise, w columnwise)
    wgrad  dw  = xᵀ · dy   gemm(x columnwise, dy columnwise)

x is [M, K], the kernel [K, N] (Flax layout, so w = kernelᵀ is [N, K]), dy [M, N].
The forward pass saves each operand's columnwise residual (`operands.backward_residual`),
its arrays named by role and kind (`remat.tag_residual`: `jaxquant.input_codes`, ...) so
`jax.checkpoint` policies can keep or drop them. Validation and argument handling live in
`dense.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from jaxquant import scaling
from jaxquant.ops._gemm import gemm
from jaxquant.ops._operands import (
  FORWARD_USAGES,
  backward_residual,
  check_dims,
  check_key,
  columnwise_operand,
  gemm_matrices,
  gemm_values_operand,
  quantize_operand,
  quantize_transposed_operand,
  stored,
  usages_to_quantize,
)
from jaxquant.ops._remat import tag_residual
from jaxquant.ops._shard_scaling import ShardScaling, gemm_rows, gemm_split_rows, quantize_rows
from jaxquant.ops._weight_gather import (
  WeightGather,
  gather_operand,
  gathered_usage,
  quantize_gathered_once,
  quantize_shards,
)
from jaxquant.quantizers import Quantizer
from jaxquant.tensor import USAGES


@dataclasses.dataclass(frozen=True)
class DenseConfig:
  """Static (hashable) description of one dense call."""

  quantizers: tuple[tuple[str, Optional[Quantizer]], ...]  # (tensor_type, quantizer) pairs
  backward: str  # recipes.BACKWARD_MODES
  kernel_dtype: jnp.dtype  # gradients come back in the primal dtypes
  bias_dtype: Optional[jnp.dtype]  # None: no bias
  what: str = "dense"  # the call's name in error messages
  # The weight quantized shard by shard and gathered in its quantized form (None: as is).
  weight_gather: Optional[WeightGather] = None
  # The GEMMs ("fprop", "dgrad", "wgrad") allowed FP8 fast accumulation (ops.gemm).
  fast_accumulation: frozenset = frozenset()
  # Operands cast straight to the bf16 values the GEMMs multiply (operands.takes_gemm_values).
  gemm_values: bool = False
  # The input and output gradient scaled per row shard (None: per tensor).
  shard_scaling: Optional[ShardScaling] = None

  def quantizer(self, tensor_type: str) -> Optional[Quantizer]:
    return dict(self.quantizers)[tensor_type]


def _weight_gathered_in_forward(cfg: DenseConfig, usages) -> bool:
  """Whether the weight's quantized usages are all gathered as they are quantized
  (`quantize_gathered_once`: per-tensor FP8 in both usages)."""
  return gathered_usage(cfg.weight_gather, cfg.quantizer("weight"), usages) is not None


def _gather_left(cfg: DenseConfig, *, for_backward: bool) -> Optional[WeightGather]:
  """The gather the weight's operands still need before their GEMMs (None: none)."""
  usages = usages_to_quantize("weight", cfg.backward) if for_backward else FORWARD_USAGES["weight"]
  return None if _weight_gathered_in_forward(cfg, usages) else cfg.weight_gather


def _forward(cfg: DenseConfig, x, kernel, bias, keys, state, *, for_backward: bool):
  """y, the new state and, `for_backward`, the residuals. Without a backward pass to come
  (the primal call: inference, evaluation) only the rowwise usages are quantized: the
  columnwise ones would be a transposed cast per operand that nothing reads."""
  new_state = dict(state)
  matrices = {"input": x, "weight": kernel.T}  # logical x [M, K] and w [N, K]
  operands = {}
  for tensor_type, matrix in matrices.items():
    usages = (
      usages_to_quantize(tensor_type, cfg.backward) if for_backward else FORWARD_USAGES[tensor_type]
    )
    # w = kernel.T: the weight's usages are cast from the kernel itself where they can be.
    quantize_fn, source = (
      (quantize_transposed_operand, kernel)
      if tensor_type == "weight"
      else (quantize_operand, matrix)
    )
    if cfg.gemm_values:  # no state or gather: MXFP8 / NVFP4 have none, takes_gemm_values none
      quantize_fn = lambda source, q, usages, key, state, weight=tensor_type == "weight": (
        gemm_values_operand(source, q, usages, key=key, transposed=weight),
        state,
      )
    elif tensor_type == "input" and cfg.shard_scaling is not None:
      quantize_fn = lambda x, q, usages, key, state: (
        quantize_rows(x, q, usages, cfg.shard_scaling),
        state,
      )
    elif tensor_type == "weight" and cfg.weight_gather is not None:
      # No key: a weight that rounds stochastically is never gathered quantized. A
      # per-tensor FP8 weight comes back gathered in both usages, others as shards.
      gather_fn = (
        quantize_gathered_once if _weight_gathered_in_forward(cfg, usages) else quantize_shards
      )
      quantize_fn = lambda kernel, q, usages, key, state, gather_fn=gather_fn: gather_fn(
        kernel, q, usages, gather=cfg.weight_gather, state=state
      )
    operands[tensor_type], role_state = quantize_fn(
      source,
      cfg.quantizer(tensor_type),
      usages,
      key=keys[tensor_type],
      state=state.get(tensor_type),
    )
    if tensor_type in state:
      new_state[tensor_type] = role_state
  # fp32 sums rounded once to x's dtype, by the GEMM itself where no bias is added first
  # (the same bits; no fp32 [M, N] to write and convert).
  y_dtype = x.dtype if bias is None else jnp.float32
  w_row = gather_operand(
    operands["weight"]["rowwise"], "rowwise", _gather_left(cfg, for_backward=for_backward)
  )
  y = _gemm_rows(cfg)(
    operands["input"]["rowwise"],
    w_row,
    out_dtype=y_dtype,
    fast_accumulation="fprop" in cfg.fast_accumulation,
  )
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  residuals = None
  if for_backward:
    residuals = {
      t: tag_residual(backward_residual(operands[t], m, cfg.backward), t)
      for t, m in matrices.items()
    }
  return y.astype(x.dtype), new_state, residuals


def _gemm_rows(cfg: DenseConfig):
  """The GEMM of fprop and dgrad, whose A is the input or the output gradient."""
  if cfg.shard_scaling is None:
    return gemm
  return functools.partial(gemm_rows, scaling=cfg.shard_scaling)


def _gemm_wgrad(cfg: DenseConfig):
  """The GEMM of wgrad, whose K is the rows of the input and the output gradient."""
  if cfg.shard_scaling is None:
    return gemm
  return functools.partial(gemm_split_rows, scaling=cfg.shard_scaling, gather=cfg.weight_gather)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def dense_2d(cfg: DenseConfig, x, kernel, bias, keys, state):
  """(y [M, N] in x's dtype, new_state). `keys` maps each tensor type to its key or None;
  `state` maps the delayed-scaling roles to their DelayedScalingState."""
  y, new_state, _ = _forward(cfg, x, kernel, bias, keys, state, for_backward=False)
  return y, new_state


def _dense_fwd(cfg, x, kernel, bias, keys, state):
  # A backward pass is coming: its usages must tile too (the primal call checked the
  # forward's alone, so that few-token inference is not refused for the columnwise blocks).
  # So must its keys: a quantizer rounding stochastically in the backward alone (the
  # gradient's) took none for a forward.
  for t, shape in gemm_matrices(*x.shape, kernel.shape[1]).items():
    usages = usages_to_quantize(t, cfg.backward)
    check_dims(shape, cfg.quantizer(t), usages, f"{cfg.what} {t}")
    check_key(cfg.quantizer(t), usages, key=keys[t], what=f"{cfg.what} {t}", backward=True)
  y, new_state, residuals = _forward(cfg, x, kernel, bias, keys, state, for_backward=True)
  saved = (residuals, keys["grad_output"], state.get("grad_output"))
  return (y, new_state), saved


def _grad_output_operands(cfg, dy, key, state):
  """dy's operand per usage, and its amax when delayed scaling observed one."""
  usages = usages_to_quantize("grad_output", cfg.backward)
  if not usages:
    return {u: stored(dy, u) for u in USAGES}, None
  if cfg.gemm_values:
    return gemm_values_operand(dy, cfg.quantizer("grad_output"), usages, key=key), None
  if cfg.shard_scaling is not None:  # current scaling: no state
    return quantize_rows(dy, cfg.quantizer("grad_output"), usages, cfg.shard_scaling), None
  # A zeroed history makes slot 0 of the recorded state exactly this tensor's amax.
  probe = (
    None
    if state is None
    else scaling.DelayedScalingState(jnp.zeros_like(state.amax_history), state.scale)
  )
  operands, recorded = quantize_operand(
    dy, cfg.quantizer("grad_output"), usages, key=key, state=probe
  )
  return operands, (None if recorded is None else recorded.amax_history[0])


def _dense_bwd(cfg, saved, cotangents):
  residuals, key, go_state = saved
  dy, state_ct = cotangents  # dy is in y's dtype, which is x's
  dy_ops, amax = _grad_output_operands(cfg, dy, key, go_state)
  # A weight gathered usage by usage leaves its shard (quantize_shards), gathered here
  # for dgrad; one gathered once left its gathered codes.
  w_residual_usage = "columnwise" if cfg.backward == "quantized" else "rowwise"
  w_col = columnwise_operand(
    gather_operand(residuals["weight"], w_residual_usage, _gather_left(cfg, for_backward=True)),
    cfg.backward,
  )
  x_col = columnwise_operand(residuals["input"], cfg.backward)
  dx = _gemm_rows(cfg)(
    dy_ops["rowwise"], w_col, out_dtype=dy.dtype, fast_accumulation="dgrad" in cfg.fast_accumulation
  )
  # The kernel's gradient [K, N] comes out in its own layout (x first): the other order
  # gives dwᵀ, whose transpose XLA can no longer fold into a GEMM kernel's bf16 output.
  dkernel = _gemm_wgrad(cfg)(
    x_col,
    dy_ops["columnwise"],
    out_dtype=cfg.kernel_dtype,
    fast_accumulation="wgrad" in cfg.fast_accumulation,
  )
  dbias = None
  if cfg.bias_dtype is not None:
    dbias = jnp.sum(dy.astype(jnp.float32), axis=0).astype(cfg.bias_dtype)
  # Forward-role states pass their incoming cotangent through (new_state is state plus a
  # recorded amax); grad_output's gets this call's amax folded in by max, so uses of one
  # threaded state combine by max (scaling.fold_grad_amax).
  state_ct = dict(state_ct)
  if amax is not None:
    state_ct["grad_output"] = scaling.fold_grad_amax(state_ct["grad_output"], amax)
  return dx, dkernel, dbias, None, state_ct


dense_2d.defvjp(_dense_fwd, _dense_bwd)
