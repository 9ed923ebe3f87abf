"""The ops: quantized GEMM layers (custom_vjps), quantization, and the GEMM dispatch point.

- `dense`, `grouped_dense`: linear layers whose three GEMMs follow a recipe per role.
- `quantize`, `dequantize`: a tensor to its quantized usages and back, through the CUDA
  kernels where they run and the reference elsewhere (`implementation=`,
  `JAXQUANT_BACKEND`, `JAXQUANT_DISABLE_KERNELS`).
- `gemm`: C = A . B^T over quantized or high-precision operands in their stored layout.
- `WeightGather`: an FSDP weight all-gathered in its quantized form.
- `ShardScaling`: the input and output gradient scaled per row shard (current scaling
  without the amax all-reduce).
- `remat_policy`, `CHECKPOINT_NAMES`: the `jax.checkpoint` policy that keeps the layers'
  quantized residuals (codes and scales, not bf16) and outputs, and the names it reads.
"""

from jaxquant.ops._dense import dense
from jaxquant.ops._gemm import gemm
from jaxquant.ops._grouped_dense import grouped_dense
from jaxquant.ops._quantize import dequantize, quantize
from jaxquant.ops._remat import CHECKPOINT_NAMES, remat_policy
from jaxquant.ops._shard_scaling import ShardScaling
from jaxquant.ops._weight_gather import WeightGather

__all__ = [
  "CHECKPOINT_NAMES",
  "ShardScaling",
  "WeightGather",
  "dense",
  "dequantize",
  "gemm",
  "grouped_dense",
  "quantize",
  "remat_policy",
]
