"""Device time of jitted calls, shared by the benchmarks.

Calls are queued back to back and the device is waited on once per round, so host
dispatch overlaps the previous call's work and only the device's time is counted. Waiting
after every call instead adds the host's round trip to each sample: on the H100 with JAX
0.11 about 0.3 ms, a third of an 8192^3 FP8 GEMM (notes/gemm.md).

Ratios come from `interleaved_seconds`: the baseline and its contenders take turns within
every round. Timed one after the other, a contender met other clocks than its baseline
(the H100's power limit moves them over seconds; session 8 saw the first measurement of a
process run lowest, and an MLP-step ratio read 1.20 in one process and 1.38 in the next).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Mapping

import jax


@dataclasses.dataclass(frozen=True)
class Call:
  """One timed invocation: fn(*args), which makes `count` independent calls of the op."""

  fn: Callable
  args: tuple
  count: int = 1

  def __call__(self):
    return self.fn(*self.args)


def batched(fn, arg_sets) -> Call:
  """len(arg_sets) independent calls of fn, each on its own operands (so XLA merges none of
  them), in one jitted call. A GEMM with few rows takes less device time than JAX takes to
  dispatch a call (on the H100 machine every such call measured about 60 us alone, bf16
  `jnp.dot` at 16x8192x8192 included); batching keeps the dispatch out of the figure."""
  many = jax.jit(lambda sets: [fn(*args) for args in sets])
  return Call(many, (list(arg_sets),), len(arg_sets))


def _round_seconds(call: Call, reps: int) -> float:
  start = time.perf_counter()
  for _ in range(reps):
    out = call()
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / reps / call.count


def interleaved_seconds(calls: Mapping[str, Call], *, reps: int = 20,
                        rounds: int = 10) -> dict[str, list[float]]:
  """Per-op device seconds of every call in every round: each round times the calls in turn,
  `reps` back-to-back invocations each, so drift over the run reaches all of them alike."""
  for call in calls.values():  # compile and warm up
    jax.block_until_ready(call())
    jax.block_until_ready(call())
  samples = {name: [] for name in calls}
  for _ in range(rounds):
    for name, call in calls.items():
      samples[name].append(_round_seconds(call, reps))
  return samples


def speedup(base: list[float], contender: list[float]) -> tuple[float, float]:
  """(ratio of the median times, lowest ratio of one round): base time over contender's."""
  per_round = [b / c for b, c in zip(base, contender)]
  return statistics.median(base) / statistics.median(contender), min(per_round)


def device_seconds(fn, *args, reps: int = 20, rounds: int = 5) -> float:
  """Median over `rounds` of the mean time of `reps` back-to-back calls of fn(*args)."""
  return statistics.median(interleaved_seconds({"fn": Call(fn, args)}, reps=reps,
                                               rounds=rounds)["fn"])
