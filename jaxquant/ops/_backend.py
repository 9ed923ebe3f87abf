"""The one reader of the backend choice: where the ops may run jaxquant's kernels.

Two environment variables, read each time an op is traced (a jitted function keeps the
choice it was traced with):

- JAXQUANT_BACKEND, or an op's `implementation=` argument, which takes precedence:
  - "auto" (the default): the kernels where they run (`kernels.available()`) and take the
    problem; the reference otherwise.
  - "reference": the pure-JAX reference everywhere (debugging, tests).
  - "kernel": the ops that quantize (casts, amaxes, the delayed-scaling update, dequantize)
    bind the kernel primitives on every platform (CUDA on GPUs, their reference lowering
    elsewhere), an input they do not take an error; the GEMMs choose as "auto" does.
- JAXQUANT_DISABLE_KERNELS: a comma-separated list of kernels, named as `jaxquant.kernels`
  exports them (`KERNELS`), that take the route "reference" gives them while the other
  kernels run as chosen above: to find a kernel at fault in the field, one at a time.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from jaxquant import kernels

BACKENDS = ("auto", "reference", "kernel")
BACKEND_VAR = "JAXQUANT_BACKEND"
DISABLE_VAR = "JAXQUANT_DISABLE_KERNELS"

# The kernels the ops choose to run or not, by their function names in jaxquant.kernels.
KERNELS = (
  "amax",
  "quantize_usages",
  "decode_scale",
  "delayed_scale",
  "dequantize_data",
  "fp8_tensor_gemm",
  "block_fp8_gemm",
  "dequant_gemm",
  "scaled_bf16_gemm",
  "grouped_gemm",
)


@dataclasses.dataclass(frozen=True)
class Backend:
  """The backend choice an op is traced with (static: hashable, read once per call)."""

  choice: str = "auto"  # one of BACKENDS
  disabled: frozenset[str] = frozenset()  # among KERNELS
  available: bool = False  # whether the kernels can run here (`kernels.available()`)

  def allows(self, kernel: str) -> bool:
    """Whether `kernel` may run at all: not the reference backend, not disabled."""
    if kernel not in KERNELS:
      raise ValueError(f"unknown kernel {kernel!r}: one of {KERNELS}")
    return self.choice != "reference" and kernel not in self.disabled

  def runs(self, kernel: str) -> bool:
    """Whether `kernel` runs where an op has a route without it: allowed, and the kernels
    can run here (the GEMMs, the grouped GEMM)."""
    return self.allows(kernel) and self.available

  def binds(self, kernel: str) -> bool:
    """Whether an op that can bind `kernel`'s primitive on any platform binds it: allowed,
    and the kernels can run here or "kernel" asks for the primitives (the casts, amaxes,
    the delayed-scaling update, dequantize)."""
    return self.allows(kernel) and (self.available or self.choice == "kernel")


def _disabled_kernels() -> frozenset[str]:
  value = os.environ.get(DISABLE_VAR, "")
  names = frozenset(name.strip() for name in value.split(",") if name.strip())
  unknown = sorted(names - set(KERNELS))
  if unknown:
    raise ValueError(
      f"{DISABLE_VAR}={value!r}: unknown kernel names {unknown}; valid names: {', '.join(KERNELS)}"
    )
  return names


def read_backend(implementation: Optional[str] = None) -> Backend:
  """The backend choice now: `implementation` if given, else JAXQUANT_BACKEND, else
  "auto"; JAXQUANT_DISABLE_KERNELS; the kernels' availability. Raises ValueError for a
  choice or a kernel name it does not know."""
  choice = implementation or os.environ.get(BACKEND_VAR, "auto") or "auto"
  if choice not in BACKENDS:
    source = "implementation=" if implementation else f"{BACKEND_VAR}="
    raise ValueError(f"{source}{choice!r}: must be one of {BACKENDS}")
  # The reference backend never asks: nothing of the CUDA library's is loaded for it.
  available = choice != "reference" and kernels.available()
  return Backend(choice, _disabled_kernels(), available)
