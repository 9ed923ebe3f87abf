"""Grouped (MoE) quantization: the reference that grouped kernels must reproduce.

## Grouped operands

A grouped GEMM has activations `x[M, K]` whose rows are contiguous per group
(`group_sizes[G]`, group g owns rows `[start_g, start_g + size_g)`, `start_g` the
exclusive prefix sum), one weight per group `W[G, K, N]`, and output gradients `dy[M, N]`
with the same row groups. Rows at or past `sum(group_sizes)` belong to no group: they
are treated as zeros by every quantizer (they never raise an amax) and their outputs
and gradients are zero. Empty groups are allowed.

## Per-tensor scales become per group

Every quantity that NUMERICS.md defines "per tensor" is defined per group here:

- FP8 current scaling: `amax` is taken over the group's rows, so each group has its own
  `scale` and `scale_inv` (`[G]`); the rowwise and columnwise usages share it.
- FP8 delayed scaling: the state holds one `amax_history[L]` and one `scale` per group
  (`[G, L]` and `[G]`); each group records its own amax.
- NVFP4: the global amax `g`, and so `S_enc` and `S_dec`, are per group; the
  columnwise usage takes its own per-group amax (after RHT where RHT applies).
  Per-token NVFP4 keeps one global amax per row, as in NUMERICS.md.
- Weights are quantized expert by expert exactly as `reference.quantize` quantizes a
  `[N, K]` weight (so "per tensor" is "per expert").

## Blocks and group boundaries

Rowwise blocks of x and dy run along K and N, inside one row: grouping does not touch
them. Columnwise blocks run along M, and **no block straddles a group boundary**. The
rule is zero padding: each group's rows are taken as if zero-padded at the group's end
to a multiple of the block length B, and blocks tile each group from its first row.
The last block of a group therefore covers `size_g mod B` real rows (when that is not
0); since padded zeros never raise an amax and quantize to zero, its scale comes from
the real rows only and its padded rows contribute nothing to any GEMM. This makes
every group size legal for every format, also where NUMERICS.md rejects a dim that is
not a multiple of the block for a plain tensor: group g is quantized exactly as
`reference.quantize` quantizes the group's rows zero-padded to a multiple of B.

Number of columnwise blocks per column: `sum_g ceil(size_g / B)`, at most
`M // B + G`. Kernels store scales in that order (group by group, blocks within a
group in row order), unpadded.

**RHT** (NVFP4 columnwise of inputs and output gradients) is the one place where the
padding is visible: the Hadamard transform mixes the 16 rows of a block, so the padded
rows of a group's last block hold non-zero transformed values. The transform is applied
to each group's zero-padded rows in blocks of 16 starting at the group's first row, and
the wgrad GEMM contracts over the padded rows of both operands (an operand without RHT
is zero-padded to the same rows). Storage for RHT'd columnwise data is therefore
`sum_g 16 * ceil(size_g / 16) <= M + 15 G` rows.

**2-D tiles** (128x128 block FP8, 16x16 NVFP4) would span up to 128 rows of several
groups: they are allowed for weights only (each expert's weight is its own tensor).

## Stochastic rounding

The random bits are drawn over the logical `[rows, cols]` matrix of the usage (rows are
the padded rows for RHT'd data), not per group, so a grouped result agrees with a
per-group one in distribution (NUMERICS.md, stochastic rounding), not bit for bit.

The functions here return block-scaled fp32 *values* with the outer (per-group or
per-row) decode scale factored out, which is what the emulated GEMM consumes
(`ops.gemm.reference_gemm`): products of values are summed in fp32 and the outer scales
multiply the sum afterwards.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.quantizers import (
  BlockFloat8Quantizer,
  DelayedFloat8Quantizer,
  Float8Quantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
  Quantizer,
  for_usage,
)
from jaxquant.reference import _elements as elements
from jaxquant.reference import _fp8 as fp8
from jaxquant.reference import _fp32 as fp32
from jaxquant.reference import _hadamard as hadamard
from jaxquant.reference import _mxfp8 as mxfp8
from jaxquant.reference import _nvfp4 as nvfp4
from jaxquant.reference import _scaling as scaling
from jaxquant.reference import quantize as dense_quantize
from jaxquant.reference import split_scales

# SR is NUMERICS.md's one rounding rule; shared, not copied.
from jaxquant.reference._nvfp4 import _encode_stochastic
from jaxquant.tensor import Usage

_ABS = np.uint32(0x7FFFFFFF)
_EXP = np.uint32(0x7F800000)
_QNAN = np.uint32(0x7FC00000)
_FLT_MAX = np.float32(np.finfo(np.float32).max)
_ONE_SIXTH = np.float32(1.0) / np.float32(6.0)
RHT_BLOCK = 16


# ---- Row layouts ----


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupLayout:
  """Which group each row of an [rows, C] operand belongs to.

  `group_ids[r]` is in [0, G]; G marks a row that belongs to no group (past the groups'
  total, or padding after it). `starts` and `sizes` are each group's row range.
  """

  group_ids: jax.Array  # int32 [rows]
  starts: jax.Array  # int32 [G]
  sizes: jax.Array  # int32 [G]

  @property
  def num_groups(self) -> int:
    return self.sizes.shape[0]

  @property
  def rows(self) -> int:
    return self.group_ids.shape[0]

  def row_gather_ids(self) -> jax.Array:
    """group_ids clipped to a valid group, for gathering per-group values per row."""
    return jnp.minimum(self.group_ids, self.num_groups - 1)

  def row_mask(self) -> jax.Array:
    return self.group_ids < self.num_groups


def _exclusive_cumsum(v):
  return jnp.cumsum(v) - v


def group_layout(group_sizes: jax.Array, rows: int) -> GroupLayout:
  """Contiguous groups over `rows` rows (the layout of x, dy and the outputs)."""
  # Sizes are clipped so that groups never reach past `rows` (a traced sum cannot be
  # checked); with valid sizes this changes nothing.
  ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), rows)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  # compare_all: one fused comparison of every row with every group end, not a loop.
  ids = jnp.searchsorted(
    ends, jnp.arange(rows, dtype=jnp.int32), side="right", method="compare_all"
  )
  return GroupLayout(ids.astype(jnp.int32), starts, ends - starts)


def padded_rows(rows: int, num_groups: int, block: int) -> int:
  """Static bound on the rows of a layout whose groups are padded to multiples of `block`."""
  if rows == 0:  # every group is empty: nothing to pad
    return 0
  total = rows + num_groups * (block - 1)
  return -(-total // block) * block


def pad_layout(layout: GroupLayout, block: int) -> GroupLayout:
  """Each group's rows zero-padded to a multiple of `block`, groups back to back."""
  psizes = -(-layout.sizes // block) * block
  pends = jnp.cumsum(psizes)
  rows = padded_rows(layout.rows, layout.num_groups, block)
  ids = jnp.searchsorted(pends, jnp.arange(rows, dtype=jnp.int32), side="right")
  return GroupLayout(ids.astype(jnp.int32), pends - psizes, psizes)


def to_layout(values: jax.Array, src: GroupLayout, dst: GroupLayout) -> jax.Array:
  """Moves each group's rows of `values` from layout `src` to `dst` (zeros elsewhere).

  `dst` groups must be at least as long as `src` groups (a padded layout of `src`).
  """
  if src is dst:
    return values
  g = dst.row_gather_ids()
  local = jnp.arange(dst.rows, dtype=jnp.int32) - dst.starts[g]
  valid = dst.row_mask() & (local < src.sizes[g])
  src_rows = jnp.clip(src.starts[g] + local, 0, src.rows - 1)
  return jnp.where(valid[:, None], jnp.take(values, src_rows, axis=0), 0.0)


# ---- Segment reductions (exact, NaN-propagating like fp32.abs_max) ----


def _canonical_amax(mag_bits):
  return fp32.from_bits(jnp.where(mag_bits > _EXP, _QNAN, mag_bits))


def segment_abs_max(x: jax.Array, segment_ids: jax.Array, num_segments: int) -> jax.Array:
  """max |x| over the rows of each segment (axis 0); empty segments give 0."""
  mag = fp32.bits(x) & _ABS
  return _canonical_amax(jax.ops.segment_max(mag, segment_ids, num_segments))


def group_abs_max(x: jax.Array, layout: GroupLayout) -> jax.Array:
  """The amax of each group's rows: [G]."""
  row_amax = fp32.bits(fp32.abs_max(x, axis=1))
  return _canonical_amax(
    jax.ops.segment_max(row_amax, layout.group_ids, layout.num_groups + 1)[: layout.num_groups]
  )


def column_block_ids(layout: GroupLayout, block: int) -> tuple[jax.Array, int]:
  """Block index of each row for blocks of `block` rows that restart at every group.

  Returns (ids [rows], num_blocks); rows of no group go to the last, ignored, block.
  """
  nblocks = -(-layout.sizes // block)
  bstart = _exclusive_cumsum(nblocks)
  g = layout.row_gather_ids()
  local = jnp.arange(layout.rows, dtype=jnp.int32) - layout.starts[g]
  num_blocks = layout.rows // block + layout.num_groups + 1
  ids = jnp.where(layout.row_mask(), bstart[g] + local // block, num_blocks - 1)
  return ids.astype(jnp.int32), num_blocks


# ---- Grouped values ----


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupedValues:
  """One usage of a grouped operand, ready for the emulated GEMM.

  values: fp32 [rows, C], block scales applied, logical (row-major) layout.
  outer: the decode scale that factors out of the GEMM, or None: one per row ([rows])
    for the rowwise usage (the GEMM's output rows), one per group ([G]) for the
    columnwise usage (applied to each group's wgrad sum).
  layout: the rows' groups (padded for RHT'd data).
  """

  values: jax.Array
  outer: Optional[jax.Array]
  layout: GroupLayout


def _fp8_tensor_values(x, scale_g, layout, element):
  scale = scale_g[layout.row_gather_ids()][:, None]
  values = elements.decode(elements.encode(fp32.mul(x, scale), element), element)
  return values, fp32.div(jnp.float32(1.0), scale_g)


def _block_fp8_columns(x, layout, q: BlockFloat8Quantizer, fmt, input_dtype):
  ids, n = column_block_ids(layout, fmt.block[1])
  scale = fp8.scale_from_amax(
    segment_abs_max(x, ids, n), fmt.fmax, eps=q.eps, pow2=q.pow2_scales, input_dtype=input_dtype
  )
  scale_e = jnp.take(scale, ids, axis=0)
  values = elements.decode(elements.encode(fp32.mul(x, scale_e), fmt.element), fmt.element)
  return fp32.mul(values, jnp.take(fp32.div(jnp.float32(1.0), scale), ids, axis=0))


def _mxfp8_columns(x, layout, fmt):
  ids, n = column_block_ids(layout, fmt.block[1])
  e = jnp.take(mxfp8.scale_exponent(segment_abs_max(x, ids, n), fmt.fmax), ids, axis=0).astype(
    jnp.int32
  )
  codes = elements.encode(fp32.mul(x, fp32.exp2(127 - e)), fmt.element)
  out = fp32.mul(elements.decode(codes, fmt.element), fp32.exp2(jnp.minimum(e, 254) - 127))
  return jnp.where(e == 0xFF, jnp.float32(jnp.nan), out)


def nvfp4_values(x, block_amax, s_enc, s_dec, random_bits=None):
  """NUMERICS.md NVFP4 steps 3-6 elementwise: every argument expanded to x's shape.

  Returns the block-scaled values q * s (S_dec left out).
  """
  scale_codes = elements.encode(
    fp32.mul(block_amax, fp32.mul(s_enc, jnp.float32(_ONE_SIXTH))), "e4m3"
  )
  s = elements.decode(scale_codes, "e4m3")
  enc = jnp.minimum(fp32.div(jnp.float32(1.0), fp32.mul(s, s_dec)), jnp.float32(_FLT_MAX))
  enc = jnp.where(s == 0, jnp.float32(0.0), enc)
  y = fp32.mul(x, enc)
  if random_bits is None:
    codes = elements.encode(y, "e2m1")
  else:
    codes = _encode_stochastic(y, random_bits)
  return fp32.mul(elements.decode(codes, "e2m1"), s)


def _nvfp4_rows(x, layout, q: NVFP4Quantizer, random_bits):
  """Rowwise NVFP4: 1x16 blocks along C; global amax per group (or per row)."""
  amax = fp32.abs_max(x, axis=1) if q.per_token else group_abs_max(x, layout)
  s_enc, s_dec = nvfp4.global_scales(amax)
  if not q.per_token:
    rows = layout.row_gather_ids()
    s_enc_r, s_dec_r = s_enc[rows], s_dec[rows]
  else:
    s_enc_r, s_dec_r = s_enc, s_dec
  rows, cols = x.shape
  block_amax = jnp.repeat(fp32.abs_max(x.reshape(rows, cols // 16, 16), axis=2), 16, axis=1)
  values = nvfp4_values(x, block_amax, s_enc_r[:, None], s_dec_r[:, None], random_bits)
  return values, s_dec


def _nvfp4_columns(x, layout, random_bits):
  """Columnwise NVFP4: 16x1 blocks along M within groups; global amax per group."""
  s_enc, s_dec = nvfp4.global_scales(group_abs_max(x, layout))
  ids, n = column_block_ids(layout, 16)
  block_amax = jnp.take(segment_abs_max(x, ids, n), ids, axis=0)
  rows = layout.row_gather_ids()
  values = nvfp4_values(x, block_amax, s_enc[rows][:, None], s_dec[rows][:, None], random_bits)
  return values, s_dec


def _check_no_tiles(q, usage, what):
  fmt = q.format(usage)
  if fmt.block[0] > 1:
    raise ValueError(
      f"grouped {what}: {q!r} uses {fmt.block[0]}x{fmt.block[1]} tiles, which would span "
      "rows of several groups; 2-D tiles are allowed for grouped weights only"
    )


def quantize_rows(
  x: jax.Array,
  layout: GroupLayout,
  quantizer: Optional[Quantizer],
  usage: Usage,
  *,
  input_dtype,
  what: str = "operand",
  delayed_scale: Optional[jax.Array] = None,
  key: Optional[jax.Array] = None,
):
  """One usage of a grouped activation-like operand `x[rows, C]` (x, dy).

  `x` is fp32 with rows outside every group already zero. Delayed scaling takes the
  per-group scale `[G]`. Returns (GroupedValues, per-group amax [G] or None), the amax
  being what delayed scaling records.
  """
  q = for_usage(quantizer, usage)
  if q is None:
    return GroupedValues(x, None, layout), None
  _check_no_tiles(q, usage, what)
  fmt = q.format(usage)
  rows, cols = x.shape
  if usage == "rowwise":
    fmt.check_dims(rows, cols, what=f"rowwise usage of grouped {what} [{rows}, {cols}]")
  rowwise = usage == "rowwise"
  if isinstance(q, (Float8Quantizer, DelayedFloat8Quantizer)):
    amax = group_abs_max(x, layout)
    if isinstance(q, Float8Quantizer):
      scale = fp8.scale_from_amax(
        amax, fmt.fmax, eps=q.eps, pow2=q.pow2_scales, input_dtype=input_dtype
      )
    else:
      scale = delayed_scale
    values, outer = _fp8_tensor_values(x, scale, layout, fmt.element)
    if rowwise:
      outer = outer[layout.row_gather_ids()]
    recorded = amax if isinstance(q, DelayedFloat8Quantizer) else None
    return GroupedValues(values, outer, layout), recorded
  if isinstance(q, BlockFloat8Quantizer):
    if rowwise:
      values = fp8.dequantize_values(
        fp8.quantize_block(x, fmt, eps=q.eps, pow2=q.pow2_scales, input_dtype=input_dtype)
      )
    else:
      values = _block_fp8_columns(x, layout, q, fmt, input_dtype)
    return GroupedValues(values, None, layout), None
  if isinstance(q, MXFP8Quantizer):
    if rowwise:
      values = mxfp8.dequantize_values(mxfp8.quantize(x, fmt))
    else:
      values = _mxfp8_columns(x, layout, fmt)
    return GroupedValues(values, None, layout), None
  assert isinstance(q, NVFP4Quantizer)
  if rowwise:
    bits = None if not q.stochastic_rounding else nvfp4.random_bits(key, x.shape)
    values, outer = _nvfp4_rows(x, layout, q, bits)
    if not q.per_token:
      outer = outer[layout.row_gather_ids()]
    return GroupedValues(values, outer, layout), None
  if q.rht:
    layout_p = pad_layout(layout, RHT_BLOCK)
    x = hadamard.apply_rht(to_layout(x, layout, layout_p).T, input_dtype).T
    layout = layout_p
  bits = None if not q.stochastic_rounding else nvfp4.random_bits(key, x.shape)
  values, outer = _nvfp4_columns(x, layout, bits)
  return GroupedValues(values, outer, layout), None


def quantize_experts(
  w: jax.Array,
  quantizer: Optional[Quantizer],
  usage: Usage,
  *,
  delayed_scale: Optional[jax.Array] = None,
  key: Optional[jax.Array] = None,
):
  """One usage of per-expert weights `w[G, N, K]` (NUMERICS's w, one per expert).

  Each expert is quantized by `reference.quantize` on its own. Returns
  (values [G, R, C] fp32 in the usage's stored layout, outer [G] or None, amax [G] or None).
  """
  q = for_usage(quantizer, usage)
  if q is None:
    values = w if usage == "rowwise" else jnp.swapaxes(w, 1, 2)
    return values.astype(jnp.float32), None, None
  num_groups = w.shape[0]
  keys = None if key is None else jax.random.split(key, num_groups)
  states = None
  if isinstance(q, DelayedFloat8Quantizer):
    states = scaling.DelayedScalingState(jnp.zeros((num_groups, 1), jnp.float32), delayed_scale)

  def one(w_g, key_g, state_g):
    out = dense_quantize(w_g, q, (usage,), key=key_g, state=state_g)
    qt, new_state = out if state_g is not None else (out, None)
    values, outer = split_scales(qt.usage(usage))
    return values, outer, None if new_state is None else new_state.amax_history[0]

  return jax.vmap(one)(w, keys, states)
