"""What a quantized format is: element type, scaling block, scale type and limits.

A `Format` is static metadata (hashable, carried as pytree aux data). It describes one
usage's stored layout: `block` is the scaling block in the *stored* matrix, rows × cols,
so a columnwise MXFP8 operand stored `[K, M]` has block `(1, 32)` like a rowwise one.
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp
import numpy as np

__all__ = [
  "Family",
  "Format",
  "ELEMENT_DTYPES",
  "ELEMENT_MAX",
  "INPUT_DTYPES",
]


class Family(str, enum.Enum):
  FP8_TENSOR = "fp8_tensor"  # one fp32 scale for the whole tensor (current or delayed)
  FP8_BLOCK = "fp8_block"  # DeepSeek-style, fp32 scale per 1x128 block or 128x128 tile
  MXFP8 = "mxfp8"  # OCP microscaling, E8M0 scale per 32 elements
  NVFP4 = "nvfp4"  # E2M1, E4M3 scale per 16 elements (or 16x16 tile), fp32 global amax


# Element types by short name. E2M1 is stored packed, two codes per uint8.
ELEMENT_DTYPES = {
  "e4m3": jnp.float8_e4m3fn,
  "e5m2": jnp.float8_e5m2,
  "e2m1": jnp.float4_e2m1fn,
}
ELEMENT_MAX = {"e4m3": 448.0, "e5m2": 57344.0, "e2m1": 6.0}

# Input dtypes every quantizer accepts.
INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class Format:
  """One usage's storage format.

  Attributes:
    family: which scaling scheme.
    element: "e4m3", "e5m2" or "e2m1".
    block: scaling block in the stored matrix (rows, cols); per-tensor is (0, 0).
    partial_blocks: whether a dim that is not a multiple of the block is allowed
      (only block FP8, whose edge blocks cover the real elements only).
    row_scaled: NVFP4 per-token: one global amax per stored row instead of per tensor.
    pow2_scales: block FP8 only: its fp32 block scales are powers of two (the default),
      which makes each dequantized value exact in bf16 (an FP8 code times a power of two).
      Other families leave it False (MXFP8's E8M0 scales are powers of two by type).
  """

  family: Family
  element: str
  block: tuple[int, int] = (0, 0)
  partial_blocks: bool = False
  row_scaled: bool = False
  pow2_scales: bool = False

  @property
  def fmax(self) -> float:
    return ELEMENT_MAX[self.element]

  @property
  def packed(self) -> bool:
    return self.element == "e2m1"

  @property
  def storage_dtype(self) -> np.dtype:
    return np.dtype(np.uint8) if self.packed else np.dtype(ELEMENT_DTYPES[self.element])

  @property
  def scale_dtype(self) -> np.dtype:
    return {
      Family.FP8_TENSOR: np.dtype(np.float32),
      Family.FP8_BLOCK: np.dtype(np.float32),
      Family.MXFP8: np.dtype(jnp.float8_e8m0fnu),
      Family.NVFP4: np.dtype(jnp.float8_e4m3fn),
    }[self.family]

  def scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
    """Shape of the block-scale array for a stored [rows, cols] matrix."""
    if self.family is Family.FP8_TENSOR:
      return ()
    br, bc = self.block
    return (-(-rows // br), -(-cols // bc))

  def data_shape(self, rows: int, cols: int) -> tuple[int, int]:
    return (rows, cols // 2) if self.packed else (rows, cols)

  def check_dims(self, rows: int, cols: int, what: str) -> None:
    """Raises ValueError if a stored [rows, cols] matrix does not tile into blocks."""
    if self.family is Family.FP8_TENSOR or self.partial_blocks:
      return
    for dim_name, size, block in (("rows", rows, self.block[0]), ("cols", cols, self.block[1])):
      if block > 1 and size % block:
        raise ValueError(
          f"{what}: {self.family.value} needs {dim_name} divisible by its block {block}, got {size}"
        )
