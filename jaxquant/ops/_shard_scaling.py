"""Per-shard current scaling of a dense layer's input and output gradient.

Per-tensor current scaling takes a tensor's scale from its amax over the whole tensor.
Under data parallelism (FSDP) the rows (tokens) of x [M, K] and dy [M, N] are split over
the devices, so each amax is an all-reduce that every device waits for before its cast,
standing in the compute's path (docs/sharding.md). With `ShardScaling(mesh, axis)` each
device scales its own rows by their own amax: x and dy are quantized shard by shard, one
scale per shard (`scale_inv` [S] for the S shards along `axis`, each device holding its
own), and the GEMMs that take them run shard by shard, inside a `jax.shard_map`, each
shard with its operands' own scales:

    fprop  y_s  = x_s · wᵀ           the rows of shard s
    dgrad  dx_s = dy_s · w
    wgrad  dw   = Σ_s x_sᵀ · dy_s    each shard's product in the kernel's dtype, summed
                                     across the shards

So the values are those of quantizing each shard's rows as a tensor of their own: not the
bits of the one-device step, whose one scale spans every row, and they change with the
number of shards. The weight keeps its one scale, from the amax of the whole weight.
It is offered for per-tensor FP8 with current scaling (`Float8Quantizer`), whose one amax
scales every code: delayed scaling reduces its recorded amaxes after the cast, off the
critical path; MXFP8 and block FP8 take their scales from blocks within a shard; NVFP4's
global amax is not covered.

The shards' products in wgrad are reduce-scattered along the kernel dim that a weight
gather (`WeightGather`) splits over the same axes, else all-reduced.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import jax
from jax.sharding import PartitionSpec as P

from jaxquant.kernels._sharding import axes_size, pspec
from jaxquant.ops._gemm import gemm
from jaxquant.ops._operands import quantize_operand
from jaxquant.ops._weight_gather import WeightGather, entry_axes
from jaxquant.quantizers import Float8Quantizer, Quantizer
from jaxquant.tensor import QuantizedData

# The roles whose rows are the layer's tokens, scaled per shard.
ROW_ROLES = ("input", "grad_output")


@dataclasses.dataclass(frozen=True)
class ShardScaling:
  """The mesh axes that split a dense layer's rows (its tokens: the data-parallel or FSDP
  axes), over whose shards the input and the output gradient are each scaled by their own
  amax instead of the whole tensor's.

  Attributes:
    mesh: the mesh the layer runs on.
    axis: the mesh axis (or axes, major first) splitting the rows of x and dy.
  """

  mesh: jax.sharding.Mesh
  axis: Union[str, tuple[str, ...]] = "fsdp"

  def __post_init__(self):
    names = tuple(getattr(self.mesh, "axis_names", ()))
    if not names:
      raise TypeError(f"ShardScaling.mesh must be a jax.sharding.Mesh, got {self.mesh!r}")
    axes = entry_axes(self.axis)
    if not axes:
      raise ValueError("ShardScaling.axis must name at least one mesh axis, got none")
    for a in axes:
      if a not in names:
        raise ValueError(f"ShardScaling: mesh axis {a!r} is not in the mesh's axes {names}")
    others = {a: n for a, n in self.mesh.shape.items() if a not in axes and n > 1}
    if others:
      raise ValueError(
        f"ShardScaling: the mesh's axes {others} split something other than the rows "
        f"{axes}; a shard-scaled layer runs shard by shard over the whole mesh, which "
        "would gather what they split (tensor parallelism): per-shard scaling is for "
        "meshes whose axes of more than one device all split the rows (data parallelism, "
        "FSDP)"
      )
    object.__setattr__(self, "axis", axes)

  @property
  def shards(self) -> int:
    """How many row shards, each with its own scales."""
    return axes_size(self.mesh, self.axis)


def check_shard_scaling(
  scaling: ShardScaling,
  quantizers: dict[str, Optional[Quantizer]],
  backward: str,
  m: int,
  what: str,
) -> None:
  """Trace-time errors for a call that cannot scale its rows per shard."""
  if not isinstance(scaling, ShardScaling):
    raise TypeError(f"{what}: shard_scaling must be a ShardScaling or None, got {scaling!r}")
  for role in ROW_ROLES:
    if type(quantizers[role]) is not Float8Quantizer:
      raise ValueError(
        f"{what}: shard_scaling scales the {role} per shard, which needs per-tensor FP8 "
        f"with current scaling (Float8Quantizer); the {role}'s quantizer is "
        f"{quantizers[role]!r}"
      )
  if backward != "quantized":
    raise ValueError(
      f"{what}: shard_scaling needs backward='quantized' (the backward GEMMs take the "
      f"shards' codes as they are), got backward={backward!r}"
    )
  if m % scaling.shards:
    raise ValueError(
      f"{what}: shard_scaling splits the rows over mesh axes {scaling.axis} "
      f"({scaling.shards} shards), but the layer has M={m} rows, which do not split evenly"
    )


def _usage_specs(scaling: ShardScaling, usage: str) -> tuple[P, P]:
  """(codes, scale_inv) PartitionSpecs of a row-sharded tensor's usage: the rows are the
  rowwise usage's first dim and the columnwise usage's second; one scale per shard."""
  rows = scaling.axis
  data = pspec(rows, ()) if usage == "rowwise" else pspec((), rows)
  return data, pspec(rows)


def quantize_rows(
  matrix: jax.Array, quantizer: Float8Quantizer, usages, scaling: ShardScaling
) -> dict[str, QuantizedData]:
  """{usage: operand} of a [M, cols] matrix whose row shards are quantized each with its
  own amax: codes as `quantize_operand` stores them, `scale_inv` [S], one per shard."""
  usages = tuple(usages)
  fmt = quantizer.format("rowwise")

  def local(shard):
    operands, _ = quantize_operand(shard, quantizer, usages)
    return [leaf for u in usages for leaf in (operands[u].data, operands[u].scale_inv.reshape(1))]

  leaves = jax.shard_map(
    local,
    mesh=scaling.mesh,
    in_specs=pspec(scaling.axis, ()),
    out_specs=[s for u in usages for s in _usage_specs(scaling, u)],
    # The jaxquant primitives do not track which axes their results vary over.
    check_vma=False,
  )(matrix)
  return {
    u: QuantizedData(leaves[2 * i], leaves[2 * i + 1], None, fmt) for i, u in enumerate(usages)
  }


def _local(operand: QuantizedData, data, scale_inv) -> QuantizedData:
  """One shard's operand: its codes and its one scale, as a per-tensor operand."""
  return QuantizedData(data, scale_inv.reshape(()), None, operand.format)


def gemm_rows(a: QuantizedData, b, *, scaling: ShardScaling, out_dtype, fast_accumulation: bool):
  """fprop and dgrad: C [M, n] = A [M, k] · Bᵀ with A's rows quantized per shard
  (`quantize_rows`, rowwise) and B whole; each shard multiplies its rows."""
  b_leaves, b_tree = jax.tree.flatten(b)

  def local(a_data, a_scale_inv, *b_leaves):
    return gemm(
      _local(a, a_data, a_scale_inv),
      jax.tree.unflatten(b_tree, b_leaves),
      out_dtype=out_dtype,
      fast_accumulation=fast_accumulation,
    )

  return jax.shard_map(
    local,
    mesh=scaling.mesh,
    in_specs=(*_usage_specs(scaling, "rowwise"), *[P()] * len(b_leaves)),
    out_specs=pspec(scaling.axis, ()),
    check_vma=False,
  )(a.data, a.scale_inv, *b_leaves)


def _scattered_dim(
  scaling: ShardScaling, gather: Optional[WeightGather], dims: tuple[int, int]
) -> Optional[int]:
  """The dim of the kernel [K, N] that a weight gather splits over exactly the row axes
  (and that splits evenly), where wgrad's products are reduce-scattered; None: none."""
  if gather is None:
    return None
  for d, axes in enumerate(gather.kernel_axes()):
    if axes == scaling.axis and dims[d] % scaling.shards == 0:
      return d
  return None


def gemm_split_rows(
  a: QuantizedData,
  b: QuantizedData,
  *,
  scaling: ShardScaling,
  out_dtype,
  fast_accumulation: bool,
  gather: Optional[WeightGather] = None,
):
  """wgrad: C [m, n] = A · Bᵀ of A [m, M] and B [n, M], both columnwise usages of row-
  sharded tensors (`quantize_rows`): each shard's product over its rows, with its own
  scales, in `out_dtype`, summed across the shards (reduce-scattered along the kernel dim
  `gather` splits over the row axes, else all-reduced)."""
  (m, _), (n, _) = a.data.shape, b.data.shape
  scatter = _scattered_dim(scaling, gather, (m, n))
  axes = scaling.axis

  def local(a_data, a_scale_inv, b_data, b_scale_inv):
    partial = gemm(
      _local(a, a_data, a_scale_inv),
      _local(b, b_data, b_scale_inv),
      out_dtype=out_dtype,
      fast_accumulation=fast_accumulation,
    )
    if scatter is None:
      return jax.lax.psum(partial, axes)
    return jax.lax.psum_scatter(partial, axes, scatter_dimension=scatter, tiled=True)

  column = _usage_specs(scaling, "columnwise")
  out_spec = P() if scatter is None else pspec(*[axes if d == scatter else () for d in range(2)])
  return jax.shard_map(
    local,
    mesh=scaling.mesh,
    in_specs=(*column, *column),
    out_specs=out_spec,
    check_vma=False,
  )(a.data, a.scale_inv, b.data, b.scale_inv)
