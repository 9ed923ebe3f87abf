"""train_lm.py from several seeds at once: one process a seed (or a seed and recipe), spread
over the GPUs, merged.

By default each seed trains in its own `train_lm.py --seeds 1 --seed S` process, every
recipe in turn. With --per-recipe each (seed, recipe) pair is a process of its own, bf16
included, queued seed by seed (bf16 first) so that complete pairs, a recipe and bf16 of its
seed, accumulate first. Processes are pinned to one GPU each with CUDA_VISIBLE_DEVICES
(round robin over --gpus), --per-gpu of them at a time on each. Under --time-budget-s no
process starts that the longest finished one of its recipe says cannot end in time, each
gets the time left as its own budget, and those still running at the end are stopped. The
runs that finished are then merged (merge_runs.py) into the outputs one `--seeds N` run
would have written; a recipe's run whose bf16 did not finish is left out, and said so.

--repeats R trains every seed R times (repeats 1.. are reported as run-to-run spread, not
as seeds). suggested_nvfp4 is analysed once, by the first seed's process, which writes its
policy (suggested_policy.json); every other seed's suggested_nvfp4 process waits for it and
trains that policy, so the merge sees one policy. --suggested-policy FILE skips the analysis
(a second device call, continuing with later seeds, passes the first call's file).

  python examples/train_seeds.py --seeds 6 --gpus 0,1 --out seeds -- \\
      --preset gpu_seeds_long --recipes bf16,nvfp4
  python examples/train_seeds.py --per-recipe --seeds 12 --gpus 0,1,2,3 --per-gpu 2 \\
      --time-budget-s 560 --out pairs -- --preset gpu_seeds --recipes all,suggested_nvfp4

Everything after `--` goes to train_lm.py (not --seed, --seeds, --validation-seed, --out,
--repeat-index or --suggested-policy: this script sets them; every process validates on
the batches --validation-seed draws). Each process's folder (seed_<S>/ or
seed_<S>/<recipe>[_repeat<R>]/, with its train_lm.log) stays under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Optional

import merge_runs
from lm import recipes, report, suggested

TRAIN_LM = pathlib.Path(__file__).resolve().parent / "train_lm.py"
SET_HERE = (
  "--seed",
  "--seeds",
  "--validation-seed",
  "--out",
  "--repeat-index",
  "--suggested-policy",
)
LOG = "train_lm.log"
COMMAND_FILE = "command.txt"  # this script's command line (each run's info has its own)
# Seconds between polls of the running processes, and given a stopped one to exit.
POLL_SECONDS = 1.0
STOP_GRACE_SECONDS = 10.0
# Each process's own --time-budget-s ends this much before the overall one: it then stops
# training and writes its outputs itself.
CHILD_MARGIN_SECONDS = 15.0
# Of the GPU's memory, what the processes sharing it may take together.
SHARED_MEMORY_FRACTION = 0.9


def parse_args(argv: list[str] | None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", type=int, required=True, help="how many seeds")
  parser.add_argument("--seed", type=int, default=0, help="the first seed")
  parser.add_argument(
    "--validation-seed",
    type=int,
    help="the seed that draws sampled validation batches in every process (default: "
    "--seed; a continuation with later seeds passes the first call's)",
  )
  parser.add_argument(
    "--gpus",
    default=None,
    help="comma-separated GPU indices for CUDA_VISIBLE_DEVICES (default: the "
    "device every process sees without it)",
  )
  parser.add_argument("--per-gpu", type=int, default=1, help="trainings at a time on each GPU")
  parser.add_argument(
    "--per-recipe",
    action="store_true",
    help="one process a (seed, recipe) pair instead of one a seed",
  )
  parser.add_argument(
    "--repeats", type=int, default=1, help="train every seed this many times (run-to-run spread)"
  )
  parser.add_argument(
    "--time-budget-s",
    type=float,
    help="start nothing that cannot end within this many seconds of the start, and stop "
    "what still runs then; merge what finished",
  )
  parser.add_argument(
    "--suggested-policy",
    type=pathlib.Path,
    help=f"{recipes.SUGGESTED_RECIPE}: the {suggested.POLICY_FILE} to train (default: "
    "analysed by the first seed's process)",
  )
  parser.add_argument("--out", type=pathlib.Path, required=True, help="the merged output folder")
  parser.add_argument(
    "train_lm_args", nargs=argparse.REMAINDER, help="after --: train_lm.py's arguments"
  )
  args = parser.parse_args(argv)
  rest = args.train_lm_args[1:] if args.train_lm_args[:1] == ["--"] else args.train_lm_args
  for flag in SET_HERE:
    if any(a == flag or a.startswith(flag + "=") for a in rest):
      parser.error(f"{flag} is set by train_seeds.py for each seed, not passed to train_lm.py")
  if min(args.seeds, args.per_gpu, args.repeats) < 1:
    parser.error(
      f"--seeds, --per-gpu and --repeats must be >= 1, got {args.seeds}, {args.per_gpu} "
      f"and {args.repeats}"
    )
  args.train_lm_args = rest
  if args.validation_seed is None:
    args.validation_seed = args.seed
  return args


def split_recipes(train_lm_args: list[str]) -> tuple[list[str], list[str]]:
  """(the recipes train_lm_args name, bf16 first and added if missing; the other arguments)."""
  rest, text = [], "all"
  arguments = iter(train_lm_args)
  for argument in arguments:
    if argument == "--recipes":
      text = next(arguments, "")
    elif argument.startswith("--recipes="):
      text = argument.split("=", 1)[1]
    else:
      rest.append(argument)
  names = []
  for part in text.split(","):  # 'all' may be combined with suggested_nvfp4
    names += recipes.parse_recipe_names(part) if part.strip() else []
  names = list(dict.fromkeys(names))
  return [recipes.PLAIN_RECIPE] + [n for n in names if n != recipes.PLAIN_RECIPE], rest


@dataclasses.dataclass(frozen=True)
class Job:
  """One process: a seed, the recipe it trains (None: all of them) and which repeat."""

  seed: int
  recipe: Optional[str]
  repeat: int = 0

  @property
  def name(self) -> str:
    what = f"seed {self.seed}" + (f" {self.recipe}" if self.recipe else "")
    return what + (f" (repeat {self.repeat})" if self.repeat else "")

  def folder(self, out: pathlib.Path) -> pathlib.Path:
    folder = out / f"seed_{self.seed}"
    if self.recipe is not None:
      folder = folder / self.recipe
    return folder.with_name(folder.name + f"_repeat{self.repeat}") if self.repeat else folder


def jobs_of(seeds: list[int], recipe_names: Optional[list[str]], repeats: int) -> list[Job]:
  """Seed by seed, each seed's recipes in order (bf16 first), each recipe's repeats."""
  return [
    Job(seed, recipe, repeat)
    for seed in seeds
    for recipe in (recipe_names or [None])
    for repeat in range(repeats)
  ]


def _command(job: Job, args, train_lm_args: list[str], policy: Optional[pathlib.Path]):
  # A one-seed run would add the preset's noise band: here the seeds are the yardstick.
  band = [] if any(a.startswith("--noise-band") for a in train_lm_args) else ["--noise-band", "0"]
  command = [
    sys.executable,
    str(TRAIN_LM),
    *train_lm_args,
    *band,
    *(["--recipes", job.recipe] if job.recipe else []),
    "--seeds",
    "1",
    "--seed",
    str(job.seed),
    "--validation-seed",
    str(args.validation_seed),
    "--repeat-index",
    str(job.repeat),
    "--out",
    str(job.folder(args.out)),
    "--overwrite",  # the job's own folder (a job run again replaces its outputs)
  ]
  return command + (["--suggested-policy", str(policy)] if policy is not None else [])


def environment(gpu: Optional[str], per_gpu: int) -> dict:
  """The process's environment: its GPU, and with several processes on one GPU no
  preallocation and a share of the GPU's memory each (unless the caller chose)."""
  env = dict(os.environ)
  if gpu is not None:
    env["CUDA_VISIBLE_DEVICES"] = gpu
  if per_gpu > 1:
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{SHARED_MEMORY_FRACTION / per_gpu:.3f}")
  return env


class Scheduler:
  """Runs jobs over slots (one a concurrent training), in queue order as far as each is
  ready, within a time budget. `start(job, slot, time_left)` returns a Popen-like process
  (poll, returncode, pid); tests pass a fake one."""

  def __init__(self, slots: list, start, budget_s: float = float("inf"), clock=time.monotonic):
    self.slots, self.start_process, self.budget_s, self.clock = slots, start, budget_s, clock
    self.started_at = clock()
    self.durations: dict[Optional[str], list[float]] = {}  # finished jobs' wall times by recipe
    self.done: list[Job] = []
    self.failed: list[Job] = []
    self.not_started: list[Job] = []
    self.stopped: list[Job] = []

  def elapsed(self) -> float:
    return self.clock() - self.started_at

  def expected_seconds(self, job: Job) -> float:
    """The longest finished run of the job's recipe (of any, before one of its own has
    finished; 0 before any has)."""
    own = self.durations.get(job.recipe)
    every = [d for ds in self.durations.values() for d in ds]
    return max(own or every or [0.0])

  def run(self, queue: list[Job], ready=lambda job: True, dropped=lambda job: False) -> None:
    """ready(job): whether it may start now; dropped(job): whether it never will (a job it
    depends on failed)."""
    queue = list(queue)
    running: dict[int, tuple[Job, object, float]] = {}
    while queue or running:
      for job in [j for j in queue if dropped(j)]:
        queue.remove(job)
        self.not_started.append(job)
        print(f"{job.name}: not started (what it needs did not finish)", flush=True)
      for slot in range(len(self.slots)):
        if slot in running:
          continue
        left = self.budget_s - self.elapsed()
        fits = [j for j in queue if self.expected_seconds(j) <= left]
        for job in [j for j in queue if j not in fits]:  # would not end in time: never will
          queue.remove(job)
          self.not_started.append(job)
          print(f"{job.name}: not started ({left:.0f} s left)", flush=True)
        job = next((j for j in fits if ready(j)), None)
        if job is None:
          break
        queue.remove(job)
        running[slot] = (job, self.start_process(job, self.slots[slot], left), self.clock())
        where = f"GPU {self.slots[slot]}" if self.slots[slot] is not None else "the default device"
        print(f"{job.name}: started on {where} at {self.elapsed():.0f} s", flush=True)
      if self.elapsed() >= self.budget_s:
        for slot, (job, process, _) in list(running.items()):
          stop(process)
          self.stopped.append(job)
          print(f"{job.name}: stopped at the time budget", flush=True)
          del running[slot]
        self.not_started += queue
        return
      time.sleep(POLL_SECONDS)
      for slot, (job, process, began) in list(running.items()):
        if process.poll() is None:
          continue
        del running[slot]
        if process.returncode == 0:
          self.done.append(job)
          self.durations.setdefault(job.recipe, []).append(self.clock() - began)
          status = "done"
        else:
          self.failed.append(job)
          status = f"FAILED (exit {process.returncode})"
        print(f"{job.name}: {status} after {self.elapsed():.0f} s", flush=True)


def stop(process) -> None:
  """SIGTERM to the process's group, SIGKILL if it has not exited STOP_GRACE_SECONDS later."""
  try:
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=STOP_GRACE_SECONDS)
  except subprocess.TimeoutExpired:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
  except ProcessLookupError:
    pass


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  gpus = args.gpus.split(",") if args.gpus else [None]
  slots = [gpu for gpu in gpus for _ in range(args.per_gpu)]  # one entry a concurrent training
  seeds = list(range(args.seed, args.seed + args.seeds))
  recipe_names, train_lm_args = (
    split_recipes(args.train_lm_args) if args.per_recipe else (None, args.train_lm_args)
  )
  jobs = jobs_of(seeds, recipe_names, args.repeats)
  # suggested_nvfp4: one process analyses (unless a policy is given), the others wait for
  # the policy it writes.
  analyser = next((j for j in jobs if j.recipe == recipes.SUGGESTED_RECIPE), None)
  policy = args.suggested_policy
  if policy is None and analyser is not None:
    policy = analyser.folder(args.out) / suggested.POLICY_FILE
  waits = lambda job: (
    job.recipe == recipes.SUGGESTED_RECIPE and job != analyser and args.suggested_policy is None
  )
  logs = []

  def start(job: Job, gpu, time_left: float):
    folder = job.folder(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    own_policy = None if job == analyser and args.suggested_policy is None else policy
    if job.recipe is None and args.suggested_policy is None:
      own_policy = None  # a seed's process analyses for itself, as train_lm.py does
    command = _command(job, args, train_lm_args, own_policy)
    if time_left != float("inf"):
      command += ["--time-budget-s", f"{max(1.0, time_left - CHILD_MARGIN_SECONDS):.0f}"]
    log = open(folder / LOG, "w")
    logs.append(log)
    return subprocess.Popen(
      command,
      stdout=log,
      stderr=subprocess.STDOUT,
      env=environment(gpu, args.per_gpu),
      start_new_session=True,  # its own process group, so that stop() ends all of it
    )

  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / COMMAND_FILE).write_text(
    "python " + " ".join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)]) + "\n"
  )
  scheduler = Scheduler(slots, start, args.time_budget_s or float("inf"))
  analyser_over = lambda: (
    analyser in (scheduler.done + scheduler.failed + scheduler.stopped + scheduler.not_started)
  )
  failed_seeds = lambda: {j.seed for j in scheduler.failed if j.recipe == recipes.PLAIN_RECIPE}
  scheduler.run(
    jobs,
    ready=lambda job: not waits(job) or policy.is_file(),
    dropped=lambda job: (
      (waits(job) and analyser_over() and not policy.is_file())
      or (args.per_recipe and job.repeat == 0 and job.seed in failed_seeds())
    ),
  )
  for log in logs:
    log.close()
  finished = [
    job.folder(args.out)
    for job in jobs
    if (job.folder(args.out) / report.CURVES_JSON).is_file() and job in scheduler.done
  ]
  print(
    f"{len(scheduler.done)} of {len(jobs)} processes done, {len(scheduler.failed)} failed, "
    f"{len(scheduler.stopped)} stopped, {len(scheduler.not_started)} not started, after "
    f"{scheduler.elapsed():.0f} s",
    flush=True,
  )
  if finished:
    merge_runs.main([*map(str, finished), "--out", str(args.out)])
  if scheduler.failed:
    raise SystemExit(
      f"train_seeds.py: {', '.join(j.name for j in scheduler.failed)} failed; their logs are "
      + ", ".join(str(j.folder(args.out) / LOG) for j in scheduler.failed)
    )


if __name__ == "__main__":
  main()
