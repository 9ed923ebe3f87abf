"""QuantizedTensor: a tensor quantized for one or both GEMM usages.

Layout contract (NUMERICS.md, "Usages and layouts"): a tensor of logical shape
`[..., K]` is viewed as the matrix `[M, K]` with the leading dims flattened into M.

- `rowwise` data is stored `[M, K]`, its blocks run along K.
- `columnwise` data is stored physically transposed, `[K, M]`, its blocks run along M.

Per family, `QuantizedData` holds (rows × cols is the stored shape):

| family     | data                   | scale_inv                                | amax          |
| ---------- | ---------------------- | ---------------------------------------- | ------------- |
| FP8_TENSOR | f8 [rows, cols]        | fp32 (), = 1 / scale                     | None          |
| FP8_BLOCK  | f8 [rows, cols]        | fp32 [ceil(rows/br), ceil(cols/bc)]      | None          |
| MXFP8      | f8 [rows, cols]        | float8_e8m0fnu [rows, cols/32]           | None          |
| NVFP4      | uint8 [rows, cols/2]   | float8_e4m3fn [rows, cols/16]            | fp32 ()       |
|            | (packed)               | or [rows/16, cols/16] (16x16 tiles)      | or [rows]     |

NVFP4 packs element 2j in the low nibble and 2j+1 in the high nibble of byte j.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import jax
import jax.numpy as jnp

from jaxquant.formats import Format

__all__ = [
  "QuantizedData",
  "QuantizedTensor",
  "Usage",
  "USAGES",
  "check_usages",
]

Usage = Literal["rowwise", "columnwise"]
USAGES: tuple[Usage, ...] = ("rowwise", "columnwise")


def check_usages(usages) -> tuple[Usage, ...]:
  """Normalises a usage or a collection of usages to a sorted tuple, validating names."""
  if isinstance(usages, str):
    usages = (usages,)
  usages = tuple(usages)
  for u in usages:
    if u not in USAGES:
      raise ValueError(f"usage must be one of {USAGES}, got {u!r}")
  if not usages:
    raise ValueError("at least one usage (rowwise or columnwise) is needed")
  return tuple(u for u in USAGES if u in usages)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedData:
  """One usage of a quantized tensor, in its stored layout."""

  data: jax.Array
  scale_inv: Optional[jax.Array]
  amax: Optional[jax.Array]
  format: Format = dataclasses.field(metadata=dict(static=True))

  @property
  def stored_shape(self) -> tuple[int, int]:
    """The [rows, cols] matrix this data stands for (cols unpacked for E2M1)."""
    rows, cols = self.data.shape[-2:]
    return (rows, cols * 2) if self.format.packed else (rows, cols)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
  """A tensor quantized for its rowwise and/or columnwise usage.

  A usage that was not requested, or whose quantizer is `None` (high precision), holds
  `None` in the quantized slot; `hp_rowwise` / `hp_columnwise` then may hold the
  high-precision matrix in that usage's layout when a hybrid asked for it.
  """

  rowwise: Optional[QuantizedData] = None
  columnwise: Optional[QuantizedData] = None
  hp_rowwise: Optional[jax.Array] = None
  hp_columnwise: Optional[jax.Array] = None
  shape: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))
  dtype: jnp.dtype = dataclasses.field(default=jnp.float32, metadata=dict(static=True))

  def usage(self, usage: Usage):
    """The quantized data of a usage, or its high-precision matrix, or None."""
    if usage == "rowwise":
      return self.rowwise if self.rowwise is not None else self.hp_rowwise
    return self.columnwise if self.columnwise is not None else self.hp_columnwise
