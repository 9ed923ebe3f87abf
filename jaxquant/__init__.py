"""jaxquant: low-precision (FP8, MXFP8, NVFP4) training for JAX and Flax."""

from jaxquant import recipes, reference, scaling
from jaxquant.formats import Family, Format
from jaxquant.ops import dense
from jaxquant.ops import grouped_dense
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
from jaxquant.scaling import DelayedScalingState
from jaxquant.tensor import QuantizedData, QuantizedTensor

__version__ = "0.1.0"
