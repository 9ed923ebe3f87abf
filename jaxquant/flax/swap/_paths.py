"""How the swap-in names NNX modules, which modules are Linen bridges, and a module's own params.

NNX modules do not know their path, so `quantize_model` gives each module of an NNX model
its path as a static attribute, `PATH_ATTR` (NNX carries it through split / merge, so it
is there inside `nnx.jit`, `nnx.scan` and `nnx.remat` too). A Linen-to-NNX bridge
(Flax's `nnx.bridge.ToNNX`, MaxText's `nnx_wrappers.ToNNX`) turns every attribute but its
own (`to_nnx__*`) into a Linen variable of the module it wraps, so it must be given none:
code bridged through it finds its path from the NNX layer that calls it.
"""

from __future__ import annotations

from typing import Any, Optional

from flax import nnx

PATH_ATTR = "jaxquant_path"
_BRIDGED_MODULE = "to_nnx__module"  # the attribute a bridge keeps its Linen module in


def is_linen_bridge(module: nnx.Module) -> bool:
  """Whether `module` wraps a Linen module for NNX (it must hold no other attribute)."""
  return _BRIDGED_MODULE in vars(module)


def own_params(module: nnx.Module) -> dict[str, Any]:
  """The values of the module's own `nnx.Param`s (not its children's), by attribute name."""
  return {name: v.get_value() for name, v in vars(module).items() if isinstance(v, nnx.Param)}


def module_path(module: nnx.Module) -> Optional[str]:
  """The path `quantize_model` gave `module`, None if it gave none."""
  return vars(module).get(PATH_ATTR)
