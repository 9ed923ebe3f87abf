"""Device time of a jitted call, shared by the benchmarks.

Calls are queued back to back and the device is waited on once per round, so host
dispatch overlaps the previous call's work and only the device's time is counted. Waiting
after every call instead adds the host's round trip to each sample: on the H100 with JAX
0.11 about 0.3 ms, a third of an 8192^3 FP8 GEMM (notes/gemm.md).
"""

from __future__ import annotations

import statistics
import time

import jax


def device_seconds(fn, *args, reps: int = 20, rounds: int = 5) -> float:
  """Median over `rounds` of the mean time of `reps` back-to-back calls of fn(*args)."""
  jax.block_until_ready(fn(*args))  # compile and warm up
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - start) / reps)
  return statistics.median(samples)


def per_call_seconds(fn, arg_sets) -> float:
  """Device time of one fn(*args), from one jitted call that makes len(arg_sets) independent
  calls, each on its own operands (so XLA merges none of them into one), divided by their
  number. A GEMM with few rows takes less device time than JAX takes to dispatch a call
  (on the H100 machine every such call measured about 60 us alone, bf16 `jnp.dot` at
  16x8192x8192 included); batching keeps the dispatch out of the figure."""
  many = jax.jit(lambda sets: [fn(*args) for args in sets])
  return device_seconds(many, list(arg_sets)) / len(arg_sets)
