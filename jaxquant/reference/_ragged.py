"""Ragged (grouped) fp32 matrix products whose memory does not grow with the group count.

`jax.lax.ragged_dot_general` lowers, on CPU (and on GPU without the native ragged
instruction), to a dense product of a `[G, M, K]` masked copy of the ragged operand:
G-fold memory and compute. These products instead walk a static list of
(row tile, group) work items: the rows are cut into tiles of T rows, and a tile is
visited once for each group it overlaps. Because groups are contiguous, there are at
most `ceil(M / T) + G - 1` items, each one `[T, C] x [C, D]` product, so the compute is
`M K N + (G - 1) T K N` and the memory is the operands and the result plus one tile.

Both products take the operands' row layout (`reference.grouped.GroupLayout`); rows of
no group are skipped (their output rows stay zero).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxquant.reference._grouped import GroupLayout

_HIGHEST = jax.lax.Precision.HIGHEST


def default_tile(rows: int, num_groups: int) -> int:
  """Rows per tile: about the mean group size, a power of two in [8, 256], at most rows."""
  mean = max(rows // max(num_groups, 1), 1)
  tile = 1 << max(mean - 1, 1).bit_length()
  return max(1, min(rows, max(8, min(tile, 256))))


def _work_items(layout: GroupLayout, tile: int):
  """(tile start row, first row the tile owns, group, valid) for each work item."""
  rows, num_groups = layout.rows, layout.num_groups
  num_tiles = -(-rows // tile)
  first = jnp.arange(num_tiles, dtype=jnp.int32) * tile
  # The last tile is shifted back to fit; rows before `first` belong to the previous tile.
  start = jnp.minimum(first, rows - tile)
  last = jnp.minimum(first + tile, rows) - 1
  ids = layout.row_gather_ids()
  g_first, g_last = ids[first], ids[last]
  count = g_last - g_first + 1
  ends = jnp.cumsum(count)
  item = jnp.arange(num_tiles + num_groups - 1, dtype=jnp.int32)
  tile_of = jnp.minimum(jnp.searchsorted(ends, item, side="right"), num_tiles - 1)
  group = g_first[tile_of] + item - (ends - count)[tile_of]
  valid = item < ends[-1]
  return start[tile_of], first[tile_of], jnp.clip(group, 0, num_groups - 1), valid


def _row_mask(layout: GroupLayout, start, owned_from, group, valid, tile):
  row = start + jnp.arange(tile, dtype=jnp.int32)
  ids = jax.lax.dynamic_slice(layout.group_ids, (start,), (tile,))
  return valid & (row >= owned_from) & (ids == group)


def ragged_matmul(a: jax.Array, b: jax.Array, layout: GroupLayout, *, tile: int = 0) -> jax.Array:
  """out[m, d] = sum_c a[m, c] * b[group(m), d, c] in fp32 ("TN", like `ops.gemm`).

  a: [rows, C]; b: [G, D, C]. Rows of no group give zero rows.
  """
  rows, _ = a.shape
  num_groups, d, _ = b.shape
  out = jnp.zeros((rows, d), jnp.float32)
  if rows == 0:
    return out
  tile = tile or default_tile(rows, num_groups)

  def step(out, item):
    start, owned_from, group, valid = item
    a_t = jax.lax.dynamic_slice_in_dim(a, start, tile, axis=0)
    b_g = jax.lax.dynamic_index_in_dim(b, group, axis=0, keepdims=False)
    prod = jax.lax.dot_general(
      a_t, b_g, (((1,), (1,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32
    )
    mask = _row_mask(layout, start, owned_from, group, valid, tile)
    old = jax.lax.dynamic_slice_in_dim(out, start, tile, axis=0)
    return jax.lax.dynamic_update_slice_in_dim(
      out, jnp.where(mask[:, None], prod, old), start, axis=0
    ), None

  out, _ = jax.lax.scan(step, out, _work_items(layout, tile))
  return out


def ragged_contract(a: jax.Array, b: jax.Array, layout: GroupLayout, *, tile: int = 0) -> jax.Array:
  """out[g, p, q] = sum over rows m of group g of a[m, p] * b[m, q], in fp32.

  a: [rows, P]; b: [rows, Q]; result [G, P, Q] (empty groups give zeros).
  """
  rows, p = a.shape
  q = b.shape[1]
  num_groups = layout.num_groups
  out = jnp.zeros((num_groups, p, q), jnp.float32)
  if rows == 0:
    return out
  tile = tile or default_tile(rows, num_groups)

  def step(out, item):
    start, owned_from, group, valid = item
    mask = _row_mask(layout, start, owned_from, group, valid, tile)[:, None]
    # Both sides are masked: 0 * inf in another group's row would otherwise give NaN.
    a_t = jnp.where(mask, jax.lax.dynamic_slice_in_dim(a, start, tile, axis=0), 0.0)
    b_t = jnp.where(mask, jax.lax.dynamic_slice_in_dim(b, start, tile, axis=0), 0.0)
    prod = jax.lax.dot_general(
      a_t, b_t, (((0,), (0,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32
    )
    acc = jax.lax.dynamic_index_in_dim(out, group, axis=0, keepdims=True)
    return jax.lax.dynamic_update_slice_in_dim(out, acc + prod[None], group, axis=0), None

  out, _ = jax.lax.scan(step, out, _work_items(layout, tile))
  return out
