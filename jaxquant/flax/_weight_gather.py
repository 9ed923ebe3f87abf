"""`quantize_model(..., weight_gather=ModelWeightGather(...))`: FSDP weights all-gathered in
their quantized form.

`jaxquant.ops.WeightGather` (docs/sharding.md) needs each kernel's PartitionSpec; a model's
layers do not know it (under `jit` a param is a tracer, and Flax unboxes the logical axis
names before `apply`). `ModelWeightGather` holds the specs of the model's params, as the
training loop places them, and gives each swapped layer the `WeightGather` of its kernel:
found by the layer's module path, with the leading axes of a scanned stack dropped, and
carried through the layer's contraction onto the GEMM's 2-D `[K, N]` kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import jax
from jax.sharding import PartitionSpec as P

from jaxquant.ops._weight_gather import WeightGather, entry_axes


@dataclasses.dataclass(frozen=True, eq=False)
class ModelWeightGather:
  """Where a model's params are sharded, and the mesh axis to gather weights over.

  Attributes:
    mesh: the mesh the params live on.
    param_specs: a pytree shaped like the model's params (the "params" collection) with a
      `PartitionSpec` or `NamedSharding` per param, e.g. the `NamedSharding`s a training
      loop places them with, or `nn.logical_to_mesh(nn.get_partition_spec(boxed), rules)`.
    axis: the mesh axis (or axes) weights are all-gathered over (FSDP's).
    fallback: as `WeightGather.fallback`: a kernel whose shards cannot be quantized alone
      is gathered in high precision instead of raising.
  """

  mesh: jax.sharding.Mesh
  param_specs: Any
  axis: Union[str, tuple[str, ...]] = "fsdp"
  fallback: bool = False

  def spec_of(self, param_path: tuple[str, ...], what: str) -> tuple:
    """The PartitionSpec entries of the param at `param_path` (module path, param name)."""
    node = self.param_specs
    for i, key in enumerate(param_path):
      try:
        node = node[key]
      except (KeyError, TypeError, IndexError):
        raise ValueError(
          f"{what}: ModelWeightGather.param_specs has no entry for "
          f"{'/'.join(param_path[: i + 1])!r}; it must be shaped like the model's params "
          "(the 'params' collection itself, not the variables dict)"
        ) from None
    if isinstance(node, jax.sharding.NamedSharding):
      node = node.spec
    if not isinstance(node, P):
      raise TypeError(
        f"{what}: ModelWeightGather.param_specs['{'/'.join(param_path)}'] must be "
        f"a PartitionSpec or NamedSharding, got {type(node).__name__}"
      )
    return tuple(node)

  def kernel_gather(
    self,
    param_path: tuple[str, ...],
    kernel_shape: tuple[int, ...],
    kernel_perm: tuple[int, ...],
    n_contracted: int,
    what: str,
  ) -> WeightGather:
    """The WeightGather of a layer's GEMM kernel: the param at `param_path`, of
    `kernel_shape`, seen by the GEMM as `transpose(kernel, kernel_perm)` reshaped to
    [K = prod(first n_contracted), N = prod(rest)]."""
    entries = self.spec_of(param_path, what)
    ndim = len(kernel_shape)
    entries = entries + (None,) * max(0, ndim - len(entries))
    stacked, entries = entries[: len(entries) - ndim], entries[len(entries) - ndim :]
    if any(entry_axes(e) for e in stacked):
      raise ValueError(
        f"{what}: the param's spec {P(*stacked, *entries)} shards an axis the "
        f"layer does not see (a scanned stack's); its kernel is {kernel_shape}"
      )
    order = tuple(kernel_perm)
    return WeightGather(
      self.mesh,
      P(
        self._merged(order[:n_contracted], entries, kernel_shape, what),
        self._merged(order[n_contracted:], entries, kernel_shape, what),
      ),
      self.axis,
      self.fallback,
    )

  @staticmethod
  def _merged(dims, entries, kernel_shape, what):
    """The spec entry of the GEMM dim that merges kernel `dims` (major to minor): their
    mesh axes in order. A sharded dim after an unsharded one of size > 1 would interleave
    the shards of the merged dim, which no PartitionSpec of it describes."""
    axes, whole_before = [], None
    for d in dims:
      these = entry_axes(entries[d])
      if these and whole_before is not None:
        raise ValueError(
          f"{what}: kernel axis {d} is sharded ({entries[d]}) but axis "
          f"{whole_before} before it in the GEMM's merged dim is not: the GEMM's "
          "[K, N] kernel would hold interleaved shards; shard the outer axis"
        )
      if not these and kernel_shape[d] > 1:
        whole_before = d
      axes += these
    if not axes:
      return None
    return axes[0] if len(axes) == 1 else tuple(axes)
