"""Quantizes a real tensor with every preset and prints each one's error and bytes.

The tensor is the byte-bigram log-frequency matrix of this Python's standard library
sources (a 256 x 256 heavy-tailed matrix from real text, no download). Each preset's
input-role quantizer is applied for both usages; the report gives the relative error of
each usage after a round trip and the stored bytes (data + scales) against bf16.

    python examples/format_report.py
"""

from __future__ import annotations

import pathlib
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant
from jaxquant.quantizers import for_usage
from jaxquant.roles import QuantizerRole


def bigram_log_counts(max_files: int = 200) -> np.ndarray:
  stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
  counts = np.zeros((256, 256), np.float64)
  for path in sorted(stdlib.glob("*.py"))[:max_files]:
    data = np.frombuffer(path.read_bytes(), np.uint8)
    np.add.at(counts, (data[:-1], data[1:]), 1.0)
  return np.log1p(counts) * np.sign(np.random.default_rng(0).standard_normal(counts.shape))


def stored_bytes(qt: jaxquant.QuantizedTensor) -> int:
  leaves = jax.tree_util.tree_leaves(qt)
  return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)


def main():
  x = jnp.asarray(bigram_log_counts(), jnp.bfloat16)
  ref = x.astype(jnp.float32)
  print(
    f"tensor: stdlib byte-bigram log counts, shape {x.shape}, bf16 bytes (2 usages) "
    f"{2 * x.size * 2}"
  )
  print(
    f"{'preset':<12} {'rowwise rel.err':>16} {'columnwise rel.err':>19} {'bytes':>8} {'vs bf16':>8}"
  )
  for name, recipe in jaxquant.recipes.PRESETS.items():
    q = recipe.quantizer(QuantizerRole("linear", "input", "report"))
    if q is None:
      print(f"{name:<12} {0.0:>16.2e} {0.0:>19.2e} {2 * x.size * 2:>8} {1.0:>8.2f}")
      continue
    state = (
      jaxquant.scaling.init_state(for_usage(q, "rowwise"))
      if jaxquant.quantizers.needs_state(q)
      else None
    )
    out = jaxquant.reference.quantize(x, q, key=jax.random.key(0), state=state)
    qt = out[0] if state is not None else out
    errs = []
    for usage in ("rowwise", "columnwise"):
      deq = jaxquant.reference.dequantize(qt, usage, jnp.float32)
      q_usage = for_usage(q, usage)
      if getattr(q_usage, "rht", False) and usage == "columnwise":
        # RHT data lives in the Hadamard domain; compare against the transformed tensor.
        target = jaxquant.reference.apply_rht(ref.T, jnp.bfloat16).T
      else:
        target = ref
      errs.append(float(jnp.linalg.norm(deq - target) / jnp.linalg.norm(target)))
    nbytes = stored_bytes(qt)
    print(f"{name:<12} {errs[0]:>16.2e} {errs[1]:>19.2e} {nbytes:>8} {nbytes / (4 * x.size):>8.2f}")


if __name__ == "__main__":
  main()
