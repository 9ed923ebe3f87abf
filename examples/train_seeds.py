"""train_lm.py from several seeds at once: one process a seed, spread over the GPUs, merged.

Each seed trains in its own `train_lm.py --seeds 1 --seed S` process, pinned to one GPU
with CUDA_VISIBLE_DEVICES (round robin over --gpus), --per-gpu of them at a time on each;
the runs are then merged (merge_runs.py) into the outputs one `--seeds N` run would have
written. Sharing a GPU (--per-gpu above 1) saves time only where one training leaves much
of the GPU idle.

  python examples/train_seeds.py --seeds 6 --gpus 0,1 --out seeds -- \\
      --preset gpu_seeds_long --recipes bf16,nvfp4

Everything after `--` goes to train_lm.py (not --seed, --seeds, --validation-seed or --out:
this script sets them; every seed's run validates on the batches the first seed draws).
Each seed's folder (seed_<S>/, with its train_lm.log) stays under --out.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

import merge_runs

TRAIN_LM = pathlib.Path(__file__).resolve().parent / "train_lm.py"
SET_HERE = ("--seed", "--seeds", "--validation-seed", "--out")
LOG = "train_lm.log"


def parse_args(argv: list[str] | None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", type=int, required=True, help="how many seeds")
  parser.add_argument("--seed", type=int, default=0, help="the first seed")
  parser.add_argument(
    "--gpus",
    default=None,
    help="comma-separated GPU indices for CUDA_VISIBLE_DEVICES (default: the "
    "device every process sees without it)",
  )
  parser.add_argument("--per-gpu", type=int, default=1, help="trainings at a time on each GPU")
  parser.add_argument("--out", type=pathlib.Path, required=True, help="the merged output folder")
  parser.add_argument(
    "train_lm_args", nargs=argparse.REMAINDER, help="after --: train_lm.py's arguments"
  )
  args = parser.parse_args(argv)
  rest = args.train_lm_args[1:] if args.train_lm_args[:1] == ["--"] else args.train_lm_args
  for flag in SET_HERE:
    if any(a == flag or a.startswith(flag + "=") for a in rest):
      parser.error(f"{flag} is set by train_seeds.py for each seed, not passed to train_lm.py")
  if args.seeds < 1 or args.per_gpu < 1:
    parser.error(f"--seeds and --per-gpu must be >= 1, got {args.seeds} and {args.per_gpu}")
  args.train_lm_args = rest
  return args


def _start(
  seed: int, first_seed: int, gpu: str | None, folder: pathlib.Path, train_lm_args: list[str]
):
  folder.mkdir(parents=True, exist_ok=True)
  env = dict(os.environ)
  if gpu is not None:
    env["CUDA_VISIBLE_DEVICES"] = gpu
  log = open(folder / LOG, "w")
  # Sampled validation batches (eval_batches=N) are drawn by the first seed in every run.
  command = [
    sys.executable,
    str(TRAIN_LM),
    *train_lm_args,
    "--seeds",
    "1",
    "--seed",
    str(seed),
    "--validation-seed",
    str(first_seed),
    "--out",
    str(folder),
  ]
  return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  gpus = args.gpus.split(",") if args.gpus else [None]
  slots = [gpu for gpu in gpus for _ in range(args.per_gpu)]  # one entry a concurrent training
  queue = list(range(args.seed, args.seed + args.seeds))
  folders = {seed: args.out / f"seed_{seed}" for seed in queue}
  running: dict[int, tuple] = {}  # slot index -> (seed, process, log)
  failed = []
  start = time.perf_counter()
  while queue or running:
    for slot in [s for s in range(len(slots)) if s not in running][: len(queue)]:
      seed = queue.pop(0)
      running[slot] = (
        seed,
        *_start(seed, args.seed, slots[slot], folders[seed], args.train_lm_args),
      )
      print(
        f"seed {seed}: started on {'GPU ' + slots[slot] if slots[slot] else 'the default device'}",
        flush=True,
      )
    time.sleep(1)
    for slot, (seed, process, log) in list(running.items()):
      if process.poll() is not None:
        log.close()
        del running[slot]
        status = "done" if process.returncode == 0 else f"FAILED (exit {process.returncode})"
        print(
          f"seed {seed}: {status} after {time.perf_counter() - start:.0f} s "
          f"({folders[seed] / LOG})",
          flush=True,
        )
        if process.returncode != 0:
          failed.append(seed)
  finished = [folders[s] for s in sorted(folders) if s not in failed]
  if finished:
    merge_runs.main([*map(str, finished), "--out", str(args.out)])
  if failed:
    raise SystemExit(
      f"train_seeds.py: seeds {failed} failed; their logs are "
      + ", ".join(str(folders[s] / LOG) for s in failed)
    )


if __name__ == "__main__":
  main()
