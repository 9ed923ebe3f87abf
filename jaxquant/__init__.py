"""jaxquant: low-precision (FP8, MXFP8, NVFP4) training for JAX and Flax.

Importing `jaxquant` loads the vocabulary alone (formats, quantizers, roles, recipes,
tensors). Everything else loads on first use, so that a program that needs only the
reference never loads the kernels or the CUDA library: the reference and the delayed-
scaling state, the ops (`dense`, `grouped_dense`, `remat_policy`) and the packages above them:
`quantize(fn, recipe)` (`jaxquant.functional`, any JAX function) and `jaxquant.flax`.
"""

import importlib

from jaxquant import recipes
from jaxquant.formats import Family, Format
from jaxquant.quantizers import (
  BlockFloat8Quantizer,
  DelayedFloat8Quantizer,
  Float8Quantizer,
  HybridQuantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
)
from jaxquant.recipes import CustomRecipe, autocast
from jaxquant.roles import QuantizerRole
from jaxquant.tensor import QuantizedData, QuantizedTensor

__version__ = "0.1.0"

# name -> (module, its attribute or None for the module itself), imported on first use.
_LAZY_ATTRIBUTES = {
  "reference": ("jaxquant.reference", None),
  "scaling": ("jaxquant.scaling", None),
  "DelayedScalingState": ("jaxquant.scaling", "DelayedScalingState"),
  "ops": ("jaxquant.ops", None),
  "dense": ("jaxquant.ops", "dense"),
  "grouped_dense": ("jaxquant.ops", "grouped_dense"),
  "remat_policy": ("jaxquant.ops", "remat_policy"),
  "CHECKPOINT_NAMES": ("jaxquant.ops", "CHECKPOINT_NAMES"),
  "kernels": ("jaxquant.kernels", None),
  "functional": ("jaxquant.functional", None),
  "quantize": ("jaxquant.functional", "quantize"),
  "flax": ("jaxquant.flax", None),
  "analysis": ("jaxquant.analysis", None),
}

__all__ = [
  "BlockFloat8Quantizer",
  "CustomRecipe",
  "DelayedFloat8Quantizer",
  "Family",
  "Float8Quantizer",
  "Format",
  "HybridQuantizer",
  "MXFP8Quantizer",
  "NVFP4Quantizer",
  "QuantizedData",
  "QuantizedTensor",
  "QuantizerRole",
  "autocast",
  "recipes",
  *_LAZY_ATTRIBUTES,
]


def __getattr__(name: str):
  if name not in _LAZY_ATTRIBUTES:
    raise AttributeError(f"module 'jaxquant' has no attribute {name!r}")
  module_name, attribute = _LAZY_ATTRIBUTES[name]
  module = importlib.import_module(module_name)
  return module if attribute is None else getattr(module, attribute)


def __dir__():
  return sorted(set(globals()) | set(_LAZY_ATTRIBUTES))
