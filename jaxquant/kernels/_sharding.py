"""Helpers for the kernels' partitioning: Shardy rules from factor lists, and amax pmax."""

from __future__ import annotations

from typing import Sequence, Union

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

Dim = Union[str, tuple[str, ...]]  # a factor, or a compound of factors (major first)


def rule(
  operands: Sequence[Sequence[Dim]],
  results: Sequence[Sequence[Dim]],
  sizes: dict[str, int],
  **kinds,
) -> tuple[str, dict]:
  """An einsum-like Shardy rule and its keyword arguments.

  `sizes` holds every factor's size; Shardy wants the sizes of exactly the factors that
  appear only inside compounds, so those are picked out here. `kinds` passes through
  (reduction_factors=..., need_replication_factors=...).
  """
  standalone = {d for t in (*operands, *results) for d in t if isinstance(d, str)}
  text = lambda t: " ".join(d if isinstance(d, str) else "(" + " ".join(d) + ")" for d in t)
  string = ", ".join(map(text, operands)) + " -> " + ", ".join(map(text, results))
  compound_only = {
    f: sizes[f]
    for t in (*operands, *results)
    for d in t
    if not isinstance(d, str)
    for f in d
    if f not in standalone
  }
  return string, dict(compound_only, **kinds)


def spec_axes(sharding, rank: int) -> list[tuple[str, ...]]:
  """The mesh axes sharding each of the `rank` dims of an operand."""
  spec = tuple(sharding.spec) + (None,) * rank
  out = []
  for entry in spec[:rank]:
    out.append(
      () if entry is None else tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)
    )
  return out


def axes_size(mesh, axes: Sequence[str]) -> int:
  size = 1
  for a in axes:
    size *= mesh.shape[a]
  return size


def keep_if_whole(mesh, axes: tuple[str, ...], dim: int, multiple: int) -> tuple[str, ...]:
  """`axes` if every shard of a dim of size `dim` holds whole multiples of `multiple`."""
  n = axes_size(mesh, axes)
  return axes if n > 1 and dim % (n * multiple) == 0 else ()


def gemm_row_axes(
  mesh, a_sharding, b_sharding, m: int, n: int, a_multiple: int, b_multiple: int
) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """Mesh axes that keep A's rows (M) and B's rows (N) of a TN GEMM sharded: each only
  where every shard holds whole multiples, and B's dropped when one mesh axis would
  split both output dims."""
  m_axes = keep_if_whole(mesh, spec_axes(a_sharding, 2)[0], m, a_multiple)
  n_axes = keep_if_whole(mesh, spec_axes(b_sharding, 2)[0], n, b_multiple)
  if set(m_axes) & set(n_axes):
    n_axes = ()
  return m_axes, n_axes


def gemm_k_axes(mesh, a_sharding, b_sharding, k: int, multiple: int) -> tuple[str, ...]:
  """Mesh axes a TN GEMM can keep its K split over: those splitting A's K and B's K alike,
  into shards of whole multiples. (They split no output dim: an axis shards one dim of a
  tensor at most.)"""
  a_axes, b_axes = spec_axes(a_sharding, 2)[1], spec_axes(b_sharding, 2)[1]
  if a_axes != b_axes:
    return ()
  return keep_if_whole(mesh, a_axes, k, multiple)


def scaled_gemm_partition(mesh, arg_shapes, result_shape, *, rows_multiple: int, k_multiple: int):
  """(arg specs, result specs, local function) of a TN GEMM of A [M, K] and B [N, K] whose
  other operands are replicated scales: A's and B's rows stay sharded in whole
  `rows_multiple`s, a K split alike in both in whole `k_multiple`s (`split_k_results`
  adds the devices' partial products); anything else is gathered."""
  (m, k), (n, _) = arg_shapes[0].shape, arg_shapes[1].shape
  m_axes, n_axes = gemm_row_axes(
    mesh, arg_shapes[0].sharding, arg_shapes[1].sharding, m, n, rows_multiple, rows_multiple
  )
  k_axes = gemm_k_axes(mesh, arg_shapes[0].sharding, arg_shapes[1].sharding, k, k_multiple)
  arg_specs = [pspec(m_axes, k_axes), pspec(n_axes, k_axes)] + [pspec()] * (len(arg_shapes) - 2)
  return (arg_specs, *split_k_results(mesh, result_shape, k_axes, (m, n), (m_axes, n_axes)))


def split_k_results(
  mesh,
  result_shape,
  k_axes: tuple[str, ...],
  dims: tuple[int, int],
  out_axes: tuple[tuple[str, ...], tuple[str, ...]],
):
  """The result specs and local function of a GEMM partition whose [M, N] result (`dims`)
  has its rows split over `out_axes` and whose K is split over `k_axes` (none: each
  device's product is its part of the result). The devices' partial products are
  reduce-scattered along a dim the partitioner wants split over exactly those axes (after
  the ones it has) and that they divide, else all-reduced; in the partial products' dtype
  either way, as XLA adds its own partitioned dots' (fp32 partials would double the bytes
  on the network)."""
  if not k_axes:
    return [pspec(*out_axes)], lambda kernel, *shards: kernel(*shards)
  wanted = getattr(
    result_shape[0] if isinstance(result_shape, (list, tuple)) and result_shape else result_shape,
    "sharding",
    None,
  )
  wanted_axes = spec_axes(wanted, 2) if hasattr(wanted, "spec") else [None, None]
  axes, add = list(out_axes), lambda partial: jax.lax.psum(partial, k_axes)
  for d, size in enumerate(dims):
    if (
      wanted_axes[d] == out_axes[d] + k_axes
      and size % (axes_size(mesh, out_axes[d]) * axes_size(mesh, k_axes)) == 0
    ):
      axes[d] = axes[d] + k_axes
      add = lambda partial, d=d: jax.lax.psum_scatter(
        partial, k_axes, scatter_dimension=d, tiled=True
      )
      break
  return [pspec(*axes)], lambda kernel, *shards: [add(kernel(*shards)[0])]


def pspec(*dims: tuple[str, ...]) -> P:
  return P(*[(d if len(d) > 1 else d[0]) if d else None for d in dims])


def kept_whole(num_operands: int):
  """(partition, sharding_rule) of a kernel that runs on whole operands under a sharded
  jit: every operand gathered, its one [rows, cols] result replicated."""

  def partition(config, mesh, arg_shapes, result_shape):
    replicated = pspec()
    return [replicated] * num_operands, [replicated], lambda kernel, *a: kernel(*a)

  def sharding_rule(config, shapes, mesh_size):
    operands = [tuple(f"a{i}_{d}" for d in range(len(s))) for i, s in enumerate(shapes)]
    results = [("r0", "r1")]
    names = tuple(sorted({f for t in operands + results for f in t}))
    return rule(operands, results, {}, need_replication_factors=names)

  return partition, sharding_rule


def elementwise(num_operands: int):
  """(partition, sharding_rule) of an elementwise kernel on scalars or vectors of one
  shape: each device takes its shard of every operand, sharded as the first one."""

  def partition(config, mesh, arg_shapes, result_shape):
    vector = arg_shapes[0].ndim
    spec = pspec(spec_axes(arg_shapes[0].sharding, 1)[0]) if vector else pspec()
    return [spec] * num_operands, [spec], lambda kernel, *a: kernel(*a)

  def sharding_rule(config, shapes, mesh_size):
    dims = ("i",) if shapes[0] else ()
    return rule([dims] * num_operands, [dims], {})

  return partition, sharding_rule


def pmax_amax(amax: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """Max of non-negative (or NaN) amaxes across shards, exact: on the fp32 bit patterns,
  whose integer order is the float order and which keeps NaN (above +inf) and subnormals."""
  if not axes:
    return amax
  bits = jax.lax.bitcast_convert_type(amax, jnp.uint32)
  return jax.lax.bitcast_convert_type(jax.lax.pmax(bits, axes), jnp.float32)


def shard_index(mesh, axes: Sequence[str]) -> jax.Array:
  """This shard's linear index over `axes` (inside a partitioned implementation)."""
  index = jnp.uint32(0)
  for a in axes:
    index = index * jnp.uint32(mesh.shape[a]) + jax.lax.axis_index(a).astype(jnp.uint32)
  return index
