"""Run a command as N processes of one `jax.distributed` job on this host.

  python examples/launch_local.py --processes 2 --cpu-devices-per-process 4 -- \\
      python examples/train_lm.py --preset cpu --recipes bf16,fp8_current --steps 3 \\
      --mesh fsdp=4,tensor=2
  python examples/launch_local.py --processes 2 -- \\
      python examples/train_lm.py --mesh fsdp=8   # 8 GPUs, 4 a process

Each copy of the command gets `--coordinator localhost:PORT --num-processes N
--process-id I` (a free port; lm/distributed.py reads them) and its own devices: with
--cpu-devices-per-process K, K fake CPU devices (JAX_PLATFORMS=cpu and XLA_FLAGS'
--xla_force_host_platform_device_count=K); else an equal share of the GPUs
($CUDA_VISIBLE_DEVICES, or all that nvidia-smi lists) in its CUDA_VISIBLE_DEVICES. The
copies' output comes through line by line, each line prefixed with its process id. The
launcher waits for all; once one fails it stops the rest (they would wait for it in their
next collective) and exits with the first failure's status.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
from typing import IO, Optional

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--processes", type=int, required=True, metavar="N")
  parser.add_argument(
    "--cpu-devices-per-process",
    type=int,
    metavar="K",
    help="run on the CPU, K fake devices a process (default: the GPUs, shared out)",
  )
  parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
  args = parser.parse_args(argv)
  if args.command[:1] == ["--"]:
    args.command = args.command[1:]
  if not args.command:
    parser.error("no command: give it after --")
  if args.processes < 1:
    parser.error(f"--processes {args.processes}: at least 1")
  if args.cpu_devices_per_process is not None and args.cpu_devices_per_process < 1:
    parser.error(f"--cpu-devices-per-process {args.cpu_devices_per_process}: at least 1")
  return args


def free_port() -> int:
  """A TCP port free on this host now (the OS picks it), for the coordinator."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
    probe.bind(("localhost", 0))
    return probe.getsockname()[1]


def visible_gpus() -> list[str]:
  """The GPUs this launcher may hand out: $CUDA_VISIBLE_DEVICES's, else nvidia-smi's."""
  given = os.environ.get("CUDA_VISIBLE_DEVICES")
  if given is not None:
    return [gpu for gpu in given.split(",") if gpu.strip()]
  try:
    listed = subprocess.run(
      ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
      capture_output=True,
      text=True,
      check=True,
    ).stdout
  except (OSError, subprocess.CalledProcessError):
    return []
  return [line.strip() for line in listed.splitlines() if line.strip()]


def cpu_xla_flags(inherited: str, devices: int) -> str:
  """XLA_FLAGS with the fake CPU device count set to `devices` (replacing any given)."""
  kept = [flag for flag in inherited.split() if not flag.startswith(DEVICE_COUNT_FLAG)]
  return " ".join([*kept, f"{DEVICE_COUNT_FLAG}={devices}"])


def process_environments(processes: int, cpu_devices: Optional[int]) -> list[dict[str, str]]:
  """Each process's environment: this one's, with its share of the devices."""
  base = dict(os.environ, PYTHONUNBUFFERED="1")  # lines come through as they are printed
  if cpu_devices is not None:
    flags = cpu_xla_flags(base.get("XLA_FLAGS", ""), cpu_devices)
    return [dict(base, JAX_PLATFORMS="cpu", XLA_FLAGS=flags) for _ in range(processes)]
  gpus = visible_gpus()
  if not gpus or len(gpus) % processes:
    raise SystemExit(
      f"{len(gpus)} GPUs do not split over {processes} processes; on the CPU give "
      "--cpu-devices-per-process"
    )
  share = len(gpus) // processes
  return [
    dict(base, CUDA_VISIBLE_DEVICES=",".join(gpus[i * share : (i + 1) * share]))
    for i in range(processes)
  ]


def forward(stream: IO[str], prefix: str) -> None:
  for line in stream:
    sys.stdout.write(f"{prefix}{line}")
    sys.stdout.flush()


def launch(command: list[str], environments: list[dict[str, str]]) -> int:
  """Runs every process of the job; 0 if all succeed, else the first failure's status."""
  coordinator = f"localhost:{free_port()}"
  n = len(environments)
  running = []
  for process_id, environment in enumerate(environments):
    job_flags = ["--coordinator", coordinator, "--num-processes", str(n)]
    process = subprocess.Popen(
      [*command, *job_flags, "--process-id", str(process_id)],
      env=environment,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    reader = threading.Thread(target=forward, args=(process.stdout, f"[{process_id}] "))
    reader.start()
    running.append((process, reader))
  status = 0
  pending = [process for process, _ in running]
  while pending:
    for process in list(pending):
      try:
        code = process.wait(timeout=0.2)
      except subprocess.TimeoutExpired:
        continue
      pending.remove(process)
      if code and not status:
        status = code
        for other in pending:  # waiting for the failed one in a collective, or soon
          other.terminate()
  for _, reader in running:
    reader.join()
  return status


def main(argv: Optional[list[str]] = None) -> int:
  args = parse_args(argv)
  return launch(args.command, process_environments(args.processes, args.cpu_devices_per_process))


if __name__ == "__main__":
  sys.exit(main())
