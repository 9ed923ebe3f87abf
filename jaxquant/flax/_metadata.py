"""Role metadata on GEMM weights: which role a weight plays and how it is quantized.

- Linen: `QuantizedWeight`, a boxed `AxisMetadata` around the kernel (as `init` returns
  it). It composes with `nn.Partitioned` / `nn.LogicallyPartitioned` in either nesting:
  `nn.get_partition_spec`, `nn.get_sharding`, `nn.unbox` and the axis bookkeeping of
  `nn.scan` / `nn.vmap` see through it to the partitioning box inside.
- NNX: Variable metadata on the kernel `nnx.Param`, keys `quantizer_role` and `quantizer`.

`weight_roles(tree_or_module)` reads them back: every annotated GEMM weight with its role
and quantizer (None: high precision).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
from flax import nnx, struct
from flax.core import meta

from jaxquant.quantizers import Quantizer
from jaxquant.roles import QuantizerRole

ROLE_KEY = "quantizer_role"
QUANTIZER_KEY = "quantizer"


class QuantizedWeight(struct.PyTreeNode, meta.AxisMetadata):
  """A Linen param box: the weight (maybe itself boxed) plus its role and quantizer."""

  value: Any
  role: QuantizerRole = struct.field(pytree_node=False)
  quantizer: Optional[Quantizer] = struct.field(pytree_node=False)

  def unbox(self) -> Any:
    return self.value

  def replace_boxed(self, val: Any) -> "QuantizedWeight":
    return self.replace(value=val)

  # Transforms that add an axis (nn.scan over layers) update the partitioning inside.
  def add_axis(self, index: int, params: dict) -> "QuantizedWeight":
    return self.replace(value=meta.add_axis(self.value, index, params))

  def remove_axis(self, index: int, params: dict) -> "QuantizedWeight":
    return self.replace(value=meta.remove_axis(self.value, index, params))

  # Flax's partition-spec helpers stop at the outermost box: answer for the inner one.
  def get_partition_spec(self) -> jax.sharding.PartitionSpec:
    if isinstance(self.value, meta.Partitioned):
      return self.value.get_partition_spec()
    return jax.sharding.PartitionSpec()

  def get_sharding(self, mesh: jax.sharding.Mesh) -> jax.sharding.Sharding:
    if isinstance(self.value, meta.Partitioned):
      return self.value.get_sharding(mesh)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def annotate_linen_weight(
  module, param_name: str, role: QuantizerRole, quantizer: Optional[Quantizer]
) -> None:
  """Boxes a Linen module's freshly initialised weight with its role (only during init).

  Called after the module created the param the ordinary way, so its initializer, shape
  and any partitioning box are exactly Flax's.
  """
  if not module.is_initializing():
    return
  value = module.get_variable("params", param_name)
  if isinstance(value, QuantizedWeight):
    value = value.value
  module.put_variable("params", param_name, QuantizedWeight(value, role, quantizer))


def nnx_weight_metadata(role: QuantizerRole, quantizer: Optional[Quantizer]) -> dict:
  """The metadata an NNX kernel Param carries (`nnx.Param(value, **metadata)`)."""
  return {ROLE_KEY: role, QUANTIZER_KEY: quantizer}


def _path_str(path) -> str:
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def weight_roles(tree_or_module: Any) -> dict[str, tuple[QuantizerRole, Optional[Quantizer]]]:
  """{param path: (role, quantizer)} for every annotated GEMM weight.

  Takes a Linen variable or param tree as `init` returns it (boxed), or an NNX module.
  """
  if isinstance(tree_or_module, nnx.Module):
    found = {}
    for path, node in nnx.iter_graph(tree_or_module):
      if isinstance(node, nnx.Param) and ROLE_KEY in node.get_metadata():
        metadata = node.get_metadata()
        found["/".join(map(str, path))] = (metadata[ROLE_KEY], metadata[QUANTIZER_KEY])
    return found
  leaves = jax.tree_util.tree_leaves_with_path(
    tree_or_module, is_leaf=lambda x: isinstance(x, QuantizedWeight)
  )
  return {
    _path_str(path): (leaf.role, leaf.quantizer)
    for path, leaf in leaves
    if isinstance(leaf, QuantizedWeight)
  }
