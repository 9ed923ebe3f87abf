"""A function's params, by pytree path: the names its roles go by.

The params are the array leaves of the parameter argument (a dict, a list, a dataclass,
an Equinox module: whatever pytree the function takes); each is named by its path, the
keys, indices and attribute names from the root joined by "/" (`params["layers"][3]
["mlp"]["w_in"]` is "layers/3/mlp/w_in"; an Equinox model's `layers[0].weight`,
"layers/0/weight"). Other leaves (an Equinox module's activation function, a string) are
no params, and pass through a traced function untouched (`split_arrays`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np


def _key_name(key: Any) -> str:
  for attribute in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def path_name(path: tuple) -> str:
  """A leaf's pytree path as a role name: "layers/3/mlp/w_in"."""
  return "/".join(_key_name(k) for k in path)


def is_array(leaf: Any) -> bool:
  """Whether a pytree leaf is an array (a param), not a function, string or None."""
  return isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or (
    hasattr(leaf, "shape") and hasattr(leaf, "dtype")
  )


def named_params(tree: Any) -> dict[str, Any]:
  """{path name: leaf} of the array leaves of `tree`."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {path_name(path): leaf for path, leaf in leaves if is_array(leaf)}


def split_arrays(tree: Any) -> tuple[list, Callable[[list], Any]]:
  """(the array leaves of `tree`, a function rebuilding `tree` from new array leaves):
  what a JAX transform that takes arrays only (`jax.eval_shape`, `jax.make_jaxpr`) traces,
  the other leaves held as they are."""
  leaves, treedef = jax.tree.flatten(tree)
  at = [i for i, leaf in enumerate(leaves) if is_array(leaf)]

  def rebuild(arrays: list) -> Any:
    new = list(leaves)
    for i, array in zip(at, arrays, strict=True):
      new[i] = array
    return jax.tree.unflatten(treedef, new)

  return [leaves[i] for i in at], rebuild
