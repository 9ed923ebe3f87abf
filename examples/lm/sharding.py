"""`--mesh data=D,fsdp=F,tensor=T`: the example trained on a device mesh.

Three mesh axes, any of them 1: `data` (each device a slice of the batch, whole weights),
`fsdp` (a slice of the batch too, and each weight split along its model dimension,
gathered where a GEMM needs it), `tensor` (the MLP's hidden units, the attention heads and
the vocabulary split: Megatron-style tensor parallelism). The model names every
parameter's axes (lm/model.py); LOGICAL_AXIS_RULES maps those names to mesh axes, and
`Placement` turns them into a `NamedSharding` per parameter. XLA's SPMD partitioner does
the rest: the gathers, reductions and resharding the GEMMs need, jaxquant's quantizers
included, so the numbers are those of one device up to the order of the sums.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lm.model import EMBED, HEADS, LAYERS, MLP, NORM, QKV, TABLE, VOCAB

DATA, FSDP, TENSOR = "data", "fsdp", "tensor"
MESH_AXES = (DATA, FSDP, TENSOR)
BATCH = "batch"  # the logical name of the batch dimension of the training windows

# Logical axis -> mesh axes. The batch splits over data and fsdp. FSDP splits every
# kernel along its model dimension (its input or output side); tensor parallelism splits
# the MLP's hidden dimension (wi by columns, wo by rows: one reduction per MLP), the
# attention's query/key/value columns and output rows, and the head's vocabulary columns.
# The embedding table splits by rows over both: split by columns, its lookup's backward
# would turn the batch-split gradient into a column-split one, which XLA's SPMD
# partitioner does by replicating it (an "involuntary full rematerialization"). Norm
# scales are tiny: replicated. The scanned layers' stacked axis stays whole, as nn.scan
# slices one layer off it per step.
LOGICAL_AXIS_RULES = (
  (BATCH, (DATA, FSDP)),
  (EMBED, FSDP),
  (MLP, TENSOR),
  (QKV, TENSOR),
  (HEADS, TENSOR),
  (VOCAB, TENSOR),
  (TABLE, (FSDP, TENSOR)),
  (NORM, None),
  (LAYERS, None),
)


def parse_mesh(text: str) -> dict[str, int]:
  """'data=2,fsdp=4' -> {'data': 2, 'fsdp': 4, 'tensor': 1}: an axis left out is 1."""
  sizes = {}
  for item in (part.strip() for part in text.split(",")):
    name, _, value = item.partition("=")
    if name not in MESH_AXES or not value:
      raise ValueError(
        f"--mesh {text!r}: {item!r} is not AXIS=SIZE with AXIS one of {', '.join(MESH_AXES)}"
      )
    if name in sizes:
      raise ValueError(f"--mesh {text!r}: axis {name!r} is given twice")
    try:
      sizes[name] = int(value)
    except ValueError:
      raise ValueError(
        f"--mesh {text!r}: the size of {name!r} must be an integer, got {value!r}"
      ) from None
    if sizes[name] < 1:
      raise ValueError(f"--mesh {text!r}: the size of {name!r} must be >= 1, got {sizes[name]}")
  return {name: sizes.get(name, 1) for name in MESH_AXES}


def make_mesh(axis_sizes: dict[str, int], devices: Optional[list] = None) -> Mesh:
  """The (data, fsdp, tensor) mesh over `devices` (default: all of them, every process's
  where the job has several); the sizes' product must be the device count."""
  devices = jax.devices() if devices is None else list(devices)
  shape = tuple(axis_sizes[name] for name in MESH_AXES)
  if math.prod(shape) != len(devices):
    given = " x ".join(f"{name}={size}" for name, size in zip(MESH_AXES, shape, strict=False))
    raise ValueError(
      f"--mesh {given} holds {math.prod(shape)} devices, but there are "
      f"{len(devices)} ({jax.default_backend()}): the sizes' product must be "
      "the device count"
    )
  return jax.make_mesh(
    shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(shape), devices=devices
  )


def describe(mesh: Mesh) -> str:
  return ",".join(f"{name}={size}" for name, size in mesh.shape.items())


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where the train state and the batches live on a mesh.

  Attributes:
    mesh: the (data, fsdp, tensor) mesh.
    params: a NamedSharding per parameter (the unboxed param tree's structure).
    param_shapes: a ShapeDtypeStruct per parameter, for the optimizer state's shardings.
  """

  mesh: Mesh
  params: Any
  param_shapes: Any

  @classmethod
  def for_params(cls, boxed_params: Any, mesh: Mesh) -> "Placement":
    """The placement of a model's parameters, from the logical names its initializers
    gave them: `boxed_params` is its (abstract) init's 'params', boxes kept."""
    specs = nn.logical_to_mesh(nn.get_partition_spec(boxed_params), LOGICAL_AXIS_RULES)
    shapes = nn.unbox(boxed_params)
    _check_divisible(specs, shapes, mesh)
    shardings = jax.tree.map(
      lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P)
    )
    return cls(mesh, shardings, shapes)

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  @property
  def batch(self) -> NamedSharding:
    return batch_sharding(self.mesh)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Windows [batch, seq + 1]: the batch split over data and fsdp."""
  return NamedSharding(mesh, nn.logical_to_mesh_axes((BATCH, None), LOGICAL_AXIS_RULES))


def global_array(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """`host`, the whole array (the same in every process), as one array placed as `sharding`
  says: each process transfers only its own devices' shards, so the mesh may span several
  processes (lm/distributed.py)."""
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def check_batch(batch_size: int, mesh: Mesh) -> None:
  batch_shards = mesh.shape[DATA] * mesh.shape[FSDP]
  if batch_size % batch_shards:
    raise ValueError(
      f"--mesh {describe(mesh)}: the batch of {batch_size} windows does not "
      f"split over data x fsdp = {batch_shards} devices; choose a batch size "
      "(--set batch_size=...) that is a multiple"
    )


def _check_divisible(specs: Any, shapes: Any, mesh: Mesh) -> None:
  """Every sharded parameter dimension splits evenly over its mesh axes."""
  flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
  flat_shapes = jax.tree_util.tree_leaves_with_path(shapes)
  for spec, (path, shape) in zip(flat_specs, flat_shapes, strict=False):
    for dim, (size, entry) in enumerate(zip(shape.shape, tuple(spec), strict=False)):
      axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
      shards = int(np.prod([mesh.shape[a] for a in axes]))
      if size % shards:
        raise ValueError(
          f"--mesh {describe(mesh)}: parameter {jax.tree_util.keystr(path)} "
          f"{shape.shape} has dim {dim} of {size}, which does not split over "
          f"{' x '.join(axes)} = {shards} devices"
        )
