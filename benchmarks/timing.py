"""Device time of jitted calls, shared by the benchmarks.

Calls are queued back to back and the device is waited on once per round, so host
dispatch overlaps the previous call's work and only the device's time is counted. Waiting
after every call instead adds the host's round trip to each sample: on the H100 with JAX
0.11 about 0.3 ms, a third of an 8192^3 FP8 GEMM.

Ratios come from `interleaved_seconds`: the baseline and its contenders take turns,
round after round, so that slow drift (temperature, over the seconds of a run) reaches them
alike. Timed one after the other, a contender meets other conditions than its baseline (the
first measurement of a process tends to run lowest; one MLP-step ratio has read 1.20 in one
process and 1.38 in the next). Within its turn each op first runs untimed for a while: the
H100 sets its clocks from the power the running kernels draw, and an FP8 GEMM draws less
than a bf16 one on the same shape, so a turn timed straight after another op's measures
that op's clocks, not its own (20-call turns without warm-up read every 8192^3 ratio to
bf16 5-20 % low). A training run sits in one recipe's steady state, which the warm-up
measures. docs/benchmarks.md says more.
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


def _timed(call: Call, reps: int) -> float:
  """Seconds per op of `reps` back-to-back invocations, one wait at the end."""
  start = time.perf_counter()
  for _ in range(reps):
    out = call()
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / reps / call.count


def _turn_seconds(call: Call, reps: int, warmup_s: float) -> float:
  """One turn: untimed runs for about warmup_s, then at least `reps` timed invocations,
  more where they would take less than warmup_s."""
  per_call, runs = _timed(call, 1) * call.count, 1
  while runs * per_call < warmup_s:
    batch = max(1, int(warmup_s / per_call / 4))
    per_call = _timed(call, batch) * call.count
    runs += batch
  return _timed(call, max(reps, int(warmup_s / per_call)))


def interleaved_seconds(
  calls: Mapping[str, Call], *, reps: int = 20, rounds: int = 8, warmup_s: float = 0.25
) -> dict[str, list[float]]:
  """Per-op device seconds of every call in every round: each round gives the calls a turn
  in order, a warm-up of about warmup_s and then a timed run (`_turn_seconds`)."""
  for call in calls.values():  # compile
    jax.block_until_ready(call())
  samples = {name: [] for name in calls}
  for _ in range(rounds):
    for name, call in calls.items():
      samples[name].append(_turn_seconds(call, reps, warmup_s))
  return samples


def speedup(base: list[float], contender: list[float]) -> tuple[float, float]:
  """(ratio of the median times, lowest ratio of one round): base time over contender's."""
  per_round = [b / c for b, c in zip(base, contender, strict=False)]
  return statistics.median(base) / statistics.median(contender), min(per_round)


def device_seconds(fn, *args, reps: int = 20, rounds: int = 5) -> float:
  """Median over `rounds` of the mean time of `reps` back-to-back calls of fn(*args)."""
  return statistics.median(
    interleaved_seconds({"fn": Call(fn, args)}, reps=reps, rounds=rounds)["fn"]
  )
