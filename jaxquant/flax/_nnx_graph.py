"""Walks an NNX model's module graph, replacing modules in place (the swap-in swaps its
stock layers this way; the sensitivity analysis wraps the quantized ones)."""

from __future__ import annotations

from typing import Optional

from flax import nnx


def path_str(path) -> str:
  """A graph path as a module path: 'layers/0/mlp'."""
  return "/".join(str(k) for k in path)


def replace_submodules(model: nnx.Module, replace) -> None:
  """Walks every module reachable from `model`, each once, replacing in place.

  `replace(child, path)` is asked once per module (every reference to it gets the same
  answer): a new module to put in its place, the module itself to keep it as it is, or
  None to keep it and walk into its own submodules.
  """
  answers: dict[int, Optional[nnx.Module]] = {}
  walked: set[int] = set()

  def visit(node, path):
    if id(node) in walked:
      return
    walked.add(id(node))
    impl = nnx.graph.get_node_impl(node)
    for key, child in impl.node_dict(node).items():
      if isinstance(child, nnx.Variable) or not nnx.graph.is_node(child):
        continue
      child_path = path + (key,)
      if id(child) not in answers:
        answers[id(child)] = replace(child, child_path)
      new = answers[id(child)]
      if new is None:
        visit(child, child_path)
      elif new is not child:
        if getattr(impl, "set_key", None) is None:
          raise TypeError(
            f"cannot replace the module at {path_str(child_path)!r} inside an "
            f"immutable {type(node).__name__}; use nnx.List / nnx.Dict"
          )
        impl.set_key(node, key, new)

  visit(model, ())
