"""What the weight-gather tests (test_quantized_gather.py, test_gather_once.py) share: their
mesh, a bit-for-bit comparison of pytrees, and the all-gathers of compiled HLO."""

import re

import jax
import numpy as np
from jax.sharding import Mesh

_ALL_GATHER = re.compile(r"=\s*(.*?)\s+all-gather(-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def mesh_2x2x2(devices) -> Mesh:
  return Mesh(np.array(devices).reshape(2, 2, 2), ("data", "fsdp", "tensor"))


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same_bits(got, want, what: str) -> None:
  """The same tree of arrays, leaf by leaf the same shape, dtype and bits."""
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
    assert g.shape == w.shape and g.dtype == w.dtype, f"{what} leaf {i}"
    np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"{what} leaf {i}")


def all_gathers(hlo: str) -> list[tuple[str, int]]:
  """(element type, element count) of each result of every all-gather in compiled HLO (an
  `all-gather-start`'s type lists its operands, then its results)."""
  found = []
  for line in hlo.splitlines():
    match = _ALL_GATHER.search(line)
    if not match:
      continue
    shapes = _SHAPE.findall(match.group(1))
    if match.group(2):
      shapes = shapes[len(shapes) // 2 :]
    found += [(t, int(np.prod([int(d) for d in dims.split(",") if d]))) for t, dims in shapes]
  return found
