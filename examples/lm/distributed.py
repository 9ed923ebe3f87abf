"""Several processes of one job (`jax.distributed`): one a host, a GPU or a group of GPUs.

Every process of an N-process job gets `--coordinator HOST:PORT --num-processes N
--process-id I` (examples/launch_local.py adds them to N copies of a command on this
host). `initialize` joins the job before anything starts JAX's backends; from then on
`jax.devices()` lists every process's devices, a mesh may span them, and each process
feeds only its own devices' shards of every global array (lm/sharding.py's
`global_array`). Every process runs the same program: the same steps, on the same data,
in the same order. Process 0 alone prints and writes the results.

Without the flags the job is one process and `initialize` does nothing. A flag left out
is JAX's to find: the coordinator in $JAX_COORDINATOR_ADDRESS, the rest from a cluster
JAX detects (Slurm, Open MPI, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
from typing import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"


def add_flags(parser: argparse.ArgumentParser) -> None:
  group = parser.add_argument_group("several processes (jax.distributed)")
  group.add_argument(
    "--coordinator",
    metavar="HOST:PORT",
    help=f"process 0's address, where the processes meet (default: ${COORDINATOR_ENV})",
  )
  group.add_argument("--num-processes", type=int, metavar="N", help="processes in the job")
  group.add_argument("--process-id", type=int, metavar="I", help="this one's, 0..N-1")


def check_flags(args: argparse.Namespace) -> None:
  """Raises, naming the flag, where the process flags cannot describe a job (before JAX
  is asked to join one, whose own error names neither)."""
  n, i = args.num_processes, args.process_id
  if n is not None and n < 1:
    raise ValueError(f"--num-processes {n}: a job has at least 1 process")
  if i is not None and i < 0:
    raise ValueError(f"--process-id {i}: process ids are 0..N-1")
  if n is not None and i is not None and i >= n:
    raise ValueError(f"--process-id {i} --num-processes {n}: process ids are 0..{n - 1}")


def initialize(args: argparse.Namespace) -> None:
  """Joins the job's other processes (a no-op with one process). Call it before anything
  uses JAX's devices: the backends start once, with the devices they see then."""
  coordinator = args.coordinator or os.environ.get(COORDINATOR_ENV)
  if coordinator is None and args.num_processes is None and args.process_id is None:
    return
  # The CPU backend's collectives across processes (JAX 0.10 and 0.12 default to gloo
  # already; an older one would run every cross-process collective as a no-op).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=coordinator, num_processes=args.num_processes, process_id=args.process_id
  )


def is_primary() -> bool:
  """Whether this process reports: process 0 of the job (the only one of a one-process job)."""
  return jax.process_index() == 0


@contextlib.contextmanager
def primary_output() -> Iterator[None]:
  """Standard output of process 0 only: the others run the same program and would print
  the same report again."""
  if is_primary():
    yield
    return
  with open(os.devnull, "w") as discarded, contextlib.redirect_stdout(discarded):
    yield


def past(deadline: float) -> bool:
  """Whether time.perf_counter() has passed deadline, as process 0 finds it: every process
  stops at the same step (one that stopped alone would leave the others waiting in the
  next collective)."""
  if math.isinf(deadline):
    return False
  over = time.perf_counter() > deadline
  if jax.process_count() == 1:
    return over
  return bool(multihost_utils.broadcast_one_to_all(np.bool_(over)))
