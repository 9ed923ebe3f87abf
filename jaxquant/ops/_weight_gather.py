"""The weight all-gathered in its quantized form: FSDP with narrow collectives.

Under FSDP a dense layer's kernel [K, N] is sharded over a mesh axis and all-gathered
before its GEMMs; gathered in bf16, every device then quantizes the whole weight. With
`WeightGather`, each device quantizes its own shard (`shard_cast`: the per-tensor amax is
reduced across the shards first, so the scale is the global one) and the gather moves the
codes and scales: FP8 half the bytes of bf16, NVFP4 about a quarter. The result is, bit for
bit, what quantizing the gathered weight gives.

Block formats (MXFP8, NVFP4, block FP8) block each usage along its own dims. For them
`dense` quantizes the shards of every usage its GEMMs take in the forward pass, gathers
the rowwise one for fprop, and keeps the columnwise one *sharded* as the backward's
residual, gathering it for dgrad: one usage crosses the network per GEMM, and the saved
weight costs a shard per device.

A per-tensor FP8 weight (current or delayed scaling) whose GEMMs take both usages
(backward "quantized") crosses the network once, in one usage (`quantize_gathered_once`):
one scale for the whole tensor makes its columnwise codes its rowwise codes transposed,
so each device quantizes its shard in one usage, the usage is all-gathered, and each
device transposes the gathered codes into the other (XLA's transpose: a one-byte transpose
kernel measured at half its speed, kernels.md). A step then gathers 1 byte a parameter,
half of bf16 FSDP's single gather of the weight. The backward's residual is the gathered
columnwise codes, which dgrad takes as they are: like bf16 FSDP, which keeps its gathered
weight for the backward, the saved weight costs the whole weight per device (1 byte a
parameter, half of bf16's), not a shard. A `jax.checkpoint` policy that drops the
weight's residual (`remat_policy(weights=False)`, ops/_remat.py) saves nothing of the
weight, and the recomputed forward gathers it again. (With only the rowwise usage
quantized, backward "dequantized", the rowwise shard is the residual and is gathered
again, as above.)

A shard is quantized alone only if it holds whole scaling blocks (MXFP8 32, NVFP4 16 or
16x16, block FP8 1x128 or 128x128, along the dims each usage blocks) and no usage rounds
stochastically (one random stream over the whole weight). Otherwise `dense` raises,
or, with `fallback=True`, gathers that weight in high precision and quantizes it after the
gather, as without the option.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxquant.formats import Family
from jaxquant.kernels._sharding import axes_size, pspec
from jaxquant.ops._backend import read_backend
from jaxquant.ops._operands import stored, treats_usages_alike
from jaxquant.ops._quantize import cast_groups
from jaxquant.ops._shard_cast import cast_shard
from jaxquant.quantizers import Quantizer, for_usage, needs_state
from jaxquant.scaling import record_amax
from jaxquant.tensor import USAGES, QuantizedData, Usage

Axes = tuple[str, ...]
_OTHER_USAGE = {"rowwise": "columnwise", "columnwise": "rowwise"}


def entry_axes(entry) -> Axes:
  """The mesh axes of one PartitionSpec entry (None, an axis, or a tuple of axes)."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


@dataclasses.dataclass(frozen=True)
class WeightGather:
  """How a dense kernel [K, N] is sharded, and the mesh axis its quantized form is
  all-gathered over.

  Attributes:
    mesh: the mesh the kernel lives on.
    kernel_spec: the kernel's PartitionSpec, e.g. `P("fsdp", None)` (K split, FSDP over
      the contraction dim), `P(None, "fsdp")`, or `P("fsdp", "tensor")`.
    axis: the mesh axis (or axes) to gather over. Axes of `kernel_spec` not named here
      (tensor parallelism) stay sharded in the gathered operands.
    fallback: when a shard cannot be quantized alone (blocks cut by a shard boundary,
      stochastic rounding), gather that weight in high precision and quantize after the
      gather instead of raising.
  """

  mesh: jax.sharding.Mesh
  kernel_spec: P
  axis: Union[str, tuple[str, ...]] = "fsdp"
  fallback: bool = False

  def __post_init__(self):
    names = tuple(getattr(self.mesh, "axis_names", ()))
    if not names:
      raise TypeError(f"WeightGather.mesh must be a jax.sharding.Mesh, got {self.mesh!r}")
    spec = tuple(self.kernel_spec)
    if len(spec) > 2:
      raise ValueError(
        f"WeightGather.kernel_spec {self.kernel_spec} has {len(spec)} entries; "
        "a dense kernel [K, N] has 2"
      )
    object.__setattr__(self, "kernel_spec", P(*spec, *(None,) * (2 - len(spec))))
    object.__setattr__(self, "axis", entry_axes(self.axis))
    used = [a for entry in self.kernel_spec for a in entry_axes(entry)]
    for a in used + list(self.axis):
      if a not in names:
        raise ValueError(f"WeightGather: mesh axis {a!r} is not in the mesh's axes {names}")
    for a in self.axis:
      if a not in used:
        raise ValueError(
          f"WeightGather: the kernel spec {self.kernel_spec} does not shard "
          f"over axis {a!r}: there is nothing to gather over it"
        )
    for dim, entry in zip("KN", self.kernel_spec, strict=False):
      axes = entry_axes(entry)
      if set(axes) & set(self.axis) and not set(axes) <= set(self.axis):
        raise ValueError(
          f"WeightGather: kernel dim {dim} is split over {axes}, mixing "
          f"gathered axes {self.axis} with others; a dim is gathered whole or not"
        )

  def kernel_axes(self) -> tuple[Axes, Axes]:
    """The mesh axes splitting K and N."""
    return tuple(entry_axes(e) for e in self.kernel_spec)

  def stored_axes(self, usage: Usage, *, gathered: bool = False) -> tuple[Axes, Axes]:
    """The mesh axes splitting the rows and cols of the weight w = kernelᵀ [N, K] in a
    usage's stored layout (rowwise [N, K], columnwise [K, N]); `gathered`: after the gather."""
    k_axes, n_axes = self.kernel_axes()
    if gathered:
      k_axes, n_axes = (tuple(a for a in axes if a not in self.axis) for axes in (k_axes, n_axes))
    return (n_axes, k_axes) if usage == "rowwise" else (k_axes, n_axes)


def unshardable_reason(
  gather: WeightGather, quantizer: Optional[Quantizer], usages, kernel_shape: tuple[int, int]
) -> Optional[str]:
  """Why the weight's shards cannot be quantized alone, or None."""
  k, n = kernel_shape
  for dim, size, axes in zip("KN", (k, n), gather.kernel_axes(), strict=False):
    if size % axes_size(gather.mesh, axes):
      return (
        f"kernel dim {dim}={size} does not split evenly over mesh axes {axes} "
        f"({axes_size(gather.mesh, axes)} shards)"
      )
  for usage in usages:
    q = for_usage(quantizer, usage)
    if q is None:
      continue
    if getattr(q, "stochastic_rounding", False):
      return (
        f"the {usage} usage rounds stochastically ({q!r}): its random bits are one "
        "stream over the whole weight, which a shard cannot draw its part of"
      )
    fmt = q.format(usage)
    if fmt.family is Family.FP8_TENSOR:
      continue
    rows, cols = (n, k) if usage == "rowwise" else (k, n)
    for name, size, axes, block in zip(
      ("rows", "cols"), (rows, cols), gather.stored_axes(usage), fmt.block, strict=False
    ):
      shards = axes_size(gather.mesh, axes)
      if shards > 1 and (size // shards) % block:
        return (
          f"the {usage} usage ({fmt.family.value}, block {fmt.block[0]}x{fmt.block[1]}) "
          f"is stored {[rows, cols]}; split over {axes} each shard holds "
          f"{size // shards} {name}, not a multiple of the block's {block}: a shard "
          "must hold whole scaling blocks"
        )
  return None


def resolve(
  gather: Optional[WeightGather],
  quantizer: Optional[Quantizer],
  usages,
  kernel_shape: tuple[int, int],
  what: str,
) -> Optional[WeightGather]:
  """The gather a call applies: `gather`, or None where nothing of the weight is quantized
  or (with `fallback`) its shards cannot be quantized alone; raises otherwise."""
  if gather is None:
    return None
  if not isinstance(gather, WeightGather):
    raise TypeError(f"{what}: weight_gather must be a WeightGather or None, got {gather!r}")
  if all(for_usage(quantizer, u) is None for u in usages):
    return None  # a high-precision weight: XLA gathers it as it would without the option
  if 0 in kernel_shape:
    return None  # an empty weight: no shard to cast, nothing to gather
  reason = unshardable_reason(gather, quantizer, usages, kernel_shape)
  if reason is None:
    return gather
  if gather.fallback:
    return None
  raise ValueError(
    f"{what}: weight_gather over {gather.axis}: {reason}. Shard the weight "
    "so that it does, or pass WeightGather(..., fallback=True) to gather this "
    "weight in high precision and quantize it after the gather"
  )


def _data_specs(gather: WeightGather, usage: Usage, fmt, *, gathered: bool) -> QuantizedData:
  """The PartitionSpecs of one usage's QuantizedData arrays (None for an absent amax)."""
  rows, cols = gather.stored_axes(usage, gathered=gathered)
  data = pspec(rows, cols)
  scale = P() if fmt.family is Family.FP8_TENSOR else data
  amax = None
  if fmt.family is Family.NVFP4:
    amax = pspec(rows) if fmt.row_scaled else P()
  return QuantizedData(data, scale, amax, fmt)


def _leaves(qd: QuantizedData) -> list:
  return [a for a in (qd.data, qd.scale_inv, qd.amax) if a is not None]


def _rebuild(template: QuantizedData, leaves) -> QuantizedData:
  leaves = list(leaves)
  return QuantizedData(
    leaves[0], leaves[1], leaves[2] if template.amax is not None else None, template.format
  )


def quantize_shards(
  kernel: jax.Array,
  quantizer: Optional[Quantizer],
  usages,
  *,
  gather: WeightGather,
  state=None,
  implementation: Optional[str] = None,
):
  """`operands.quantize_transposed_operand(kernel, ...)` with each usage of w = kernelᵀ
  quantized shard by shard: `({usage: operand}, new_state)`, the quantized operands
  sharded as `gather.kernel_spec` shards the weight (`gather_operand` gathers them),
  high-precision ones as the matrix itself."""
  usages = tuple(usages)
  quantized = tuple(u for u in usages if for_usage(quantizer, u) is not None)
  operands = {u: stored(kernel.T, u) for u in usages if u not in quantized}
  if not quantized:
    return operands, state
  reason = unshardable_reason(gather, quantizer, quantized, kernel.shape)
  if reason:
    raise ValueError(f"quantize_shards: {reason}")
  backend = read_backend(implementation)
  k_axes, n_axes = gather.kernel_axes()
  formats = {u: for_usage(quantizer, u).format(u) for u in quantized}

  def cast_all(shard, scale):
    results, recorded = {}, None
    for base, group in cast_groups(quantizer, quantized):
      # The kernel shard [K, N] is the shard of wᵀ: where both usages are alike, its
      # rowwise cast is w's columnwise usage and the other way round (no transposed copy).
      if treats_usages_alike(base):
        out, amax = cast_shard(
          shard,
          base,
          tuple(_OTHER_USAGE[u] for u in group),
          row_axes=k_axes,
          col_axes=n_axes,
          scale=scale,
          backend=backend,
        )
        results.update({_OTHER_USAGE[u]: qd for u, qd in out.items()})
      else:
        out, amax = cast_shard(
          shard.T,
          base,
          group,
          row_axes=n_axes,
          col_axes=k_axes,
          scale=scale,
          backend=backend,
        )
        results.update(out)
      recorded = amax if amax is not None else recorded  # both usages see one tensor amax
    leaves = [leaf for u in quantized for leaf in _leaves(results[u])]
    return leaves + ([recorded] if recorded is not None else [])

  out_specs = [
    s for u in quantized for s in _leaves(_data_specs(gather, u, formats[u], gathered=False))
  ]
  scale = state.scale if needs_state(quantizer) else None
  if scale is not None:
    out_specs.append(P())
  # check_vma=False: the jaxquant primitives do not track which axes their results vary
  # over; the scalar outputs (scales, reduced amaxes) are the same on every shard.
  leaves = jax.shard_map(
    cast_all,
    mesh=gather.mesh,
    in_specs=(gather.kernel_spec, P()),
    out_specs=out_specs,
    check_vma=False,
  )(kernel, scale)
  leaves = iter(leaves)
  for u in quantized:
    template = _data_specs(gather, u, formats[u], gathered=False)
    operands[u] = _rebuild(template, [next(leaves) for _ in _leaves(template)])
  new_state = state
  if scale is not None:
    new_state = record_amax(state, next(leaves))
  return {u: operands[u] for u in usages}, new_state


def _gather_leaf(leaf, spec: P, gather: WeightGather):
  """One array of a usage's operand, inside the `shard_map`, all-gathered along the dims
  `spec` splits over `gather.axis`."""
  # 8-bit codes and scales travel as uint8: XLA:CPU would widen an FP8 all-gather to
  # f16, and bytes are what the collective moves on every backend.
  narrow = leaf.dtype.itemsize == 1
  moved = jax.lax.bitcast_convert_type(leaf, jnp.uint8) if narrow else leaf
  for dim, entry in enumerate(spec):
    axes = tuple(a for a in entry_axes(entry) if a in gather.axis)
    if axes:
      moved = jax.lax.all_gather(moved, axes, axis=dim, tiled=True)
  return jax.lax.bitcast_convert_type(moved, leaf.dtype) if narrow else moved


def gather_operand(operand, usage: Usage, gather: Optional[WeightGather]):
  """A usage's operand from `quantize_shards`, all-gathered over `gather.axis`: its codes
  and scales as they are stored. High-precision operands pass through (XLA gathers them
  where the GEMM needs it)."""
  if gather is None or not isinstance(operand, QuantizedData):
    return operand
  before = _data_specs(gather, usage, operand.format, gathered=False)
  after = _data_specs(gather, usage, operand.format, gathered=True)

  def gather_all(*leaves):
    return [
      _gather_leaf(leaf, spec, gather) for leaf, spec in zip(leaves, _leaves(before), strict=False)
    ]

  leaves = jax.shard_map(
    gather_all,
    mesh=gather.mesh,
    in_specs=tuple(_leaves(before)),
    out_specs=_leaves(after),
    check_vma=False,
  )(*_leaves(operand))
  return _rebuild(operand, leaves)


def gathered_usage(
  gather: Optional[WeightGather], quantizer: Optional[Quantizer], usages
) -> Optional[Usage]:
  """The one usage of a per-tensor FP8 weight that is quantized and gathered when its GEMMs
  take both (`quantize_gathered_once`), or None where each usage is gathered on its own.

  Per-tensor FP8 scales the whole weight by one scale, so one usage's codes transposed
  are the other's; block formats block each usage along its own dims and cannot be
  transposed. The usage gathered is the one whose gathered dim is its stored major (row)
  dim: each device's shard is then one contiguous run of the gathered array, which the
  collective writes in place. Gathered along its minor dim, a usage's shards land as
  strided column blocks: XLA gathers them along a new major dim and copies the whole
  array into place (or lays the result out transposed for its GEMM to copy), a transpose
  on top of the one the other usage needs. With K gathered (`P("fsdp", None)`) that is
  the columnwise usage [K, N], dgrad's, which the backward takes as it is gathered; with
  only N gathered (`P(None, "fsdp")`) the rowwise usage [N, K], fprop's."""
  if gather is None or set(usages) != set(USAGES) or not treats_usages_alike(quantizer):
    return None
  if quantizer.format("rowwise").family is not Family.FP8_TENSOR:
    return None
  k_axes, _ = gather.kernel_axes()
  return "columnwise" if set(k_axes) & set(gather.axis) else "rowwise"


def quantize_gathered_once(
  kernel: jax.Array,
  quantizer: Quantizer,
  usages,
  *,
  gather: WeightGather,
  state=None,
  implementation: Optional[str] = None,
):
  """Both usages of a per-tensor FP8 weight w = kernelᵀ, gathered, from one usage's
  shards: `({usage: operand}, new_state)`, the operands sharded only over the axes of
  `gather.kernel_spec` not gathered.

  The shards are quantized in `gathered_usage` alone (`quantize_shards`), all-gathered,
  and each device transposes the gathered codes into the other usage, under the same
  scale: the bits `quantize_shards` and `gather_operand` give for each usage."""
  usage = gathered_usage(gather, quantizer, usages)
  if usage is None:
    raise ValueError(
      f"quantize_gathered_once: a per-tensor FP8 weight in both usages, got {quantizer!r} "
      f"in {tuple(usages)}"
    )
  other = _OTHER_USAGE[usage]
  shards, new_state = quantize_shards(
    kernel, quantizer, (usage,), gather=gather, state=state, implementation=implementation
  )
  shard = shards[usage]
  before = _data_specs(gather, usage, shard.format, gathered=False)
  after = {u: _data_specs(gather, u, shard.format, gathered=True) for u in (usage, other)}

  def gather_and_transpose(codes, scale_inv):
    codes = _gather_leaf(codes, before.data, gather)
    return codes, codes.T, scale_inv

  codes, transposed, scale_inv = jax.shard_map(
    gather_and_transpose,
    mesh=gather.mesh,
    in_specs=(before.data, before.scale_inv),
    out_specs=(after[usage].data, after[other].data, after[usage].scale_inv),
    check_vma=False,
  )(shard.data, shard.scale_inv)
  operands = {
    usage: QuantizedData(codes, scale_inv, None, shard.format),
    other: QuantizedData(transposed, scale_inv, None, shard.format),
  }
  return {u: operands[u] for u in usages}, new_state
