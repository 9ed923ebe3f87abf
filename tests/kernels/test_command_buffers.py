"""The cast, amax, dequantize and MXFP8 values kernels and the per-tensor FP8, block FP8,
grouped and fused-dequantize GEMMs inside XLA's command buffers.

Every target is registered as command-buffer compatible (kernels/_library.py), so XLA
may trace them into a CUDA graph once and replay it. Command buffers are a backend
option read when the GPU backend starts, so the checks run in a fresh process whose
XLA_FLAGS put every fusion and custom call into one: a profile of a call (one of three,
as XLA may run an execution op by op) must show every jaxquant kernel launched from the
command buffer's CUDA graph, and the results of several
calls with fresh inputs (new buffers: the graph is updated and replayed) must equal the
reference's bit for bit (the GEMMs' within their tensor cores' tolerance), and a replayed
call the first call's. The grouped GEMM's group sizes change from call to call: the graph
reads them on the device.

On several GPUs the example's FSDP training steps run under XLA's default command buffers:
the per-tensor GEMMs then take cuBLASLt's workspace, and every trace of a captured GEMM must
launch the same kernels for XLA to update its graph in place. They run as one process and as
two, which must train alike.
"""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from jaxquant import kernels

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import launch_local  # noqa: E402  (needs examples/ on the path)
from lm import report  # noqa: E402

pytestmark = [
  pytest.mark.gpu,
  pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}"),
]

# tests/examples/test_sharded_lm.py's tolerances for a sharded run's losses against another
# run's of the same params and batches: the first loss, then the trained steps' losses.
RTOL = 1e-5
RTOL_TRAINED = 1e-3

FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"

CHILD = r'''
import functools, glob, gzip, json, os, tempfile
import jax, jax.numpy as jnp, numpy as np
from jaxquant import kernels, ops
from jaxquant.kernels import _gemm_values as gemm_values
from kernel_cases import (BF16_MMA_TOLERANCE, FP8_MMA_TOLERANCE, QUANTIZERS, assert_same_bits,
                          random_input, relative_error)

CPU = jax.devices("cpu")[0]
# Kernel names: ours, cuBLASLt's Hopper GEMMs (the per-tensor FP8 GEMM) and CUTLASS's (the
# grouped GEMM).
OURS = ("jaxquant::", "nvjet", "cutlass::")


# (in graphs, outside graphs): the names of the jaxquant kernels of one profiled call that
# ran from a CUDA graph and that did not (a graph's kernel events carry its id, and the
# command buffer as their HLO op).
def kernels_by_launch(f, args):
  for _ in range(3):  # XLA records the graph over the first executions
    jax.block_until_ready(f("kernel", *args))
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      jax.block_until_ready(f("kernel", *args))
    path, = glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
    events = json.load(gzip.open(path))
  events = events["traceEvents"] if isinstance(events, dict) else events
  ours = [e for e in events
          if e.get("ph") == "X" and any(part in str(e.get("name")) for part in OURS)]
  assert ours, "the trace holds no jaxquant kernel"
  in_graph = lambda e: ("cuda_graph_id" in e.get("args", {})
                        and e["args"].get("hlo_op", "").startswith("command_buffer"))
  return ({e["name"] for e in ours if in_graph(e)},
          sorted({e["name"] for e in ours if not in_graph(e)}))


def check(label, fn, make_args, compare=assert_same_bits, gemm_kernel=None):
  """`gemm_kernel`: part of the name of the GEMM kernel that must run from the graph."""
  f = jax.jit(fn, static_argnums=0)
  first = f("kernel", *make_args(0))  # before XLA records the graph
  # What jaxquant controls is that its targets may be captured: then XLA launches them
  # from the graph. XLA may still run one execution op by op (it did when eight test
  # processes shared the GPU), so one of three profiled calls must have every kernel in
  # the graph; a target XLA cannot capture is outside in all three.
  for _ in range(3):
    inside, outside = kernels_by_launch(f, make_args(0))
    if not outside:
      break
  assert not outside, f"{label}: launched outside a command buffer in 3 calls: {outside}"
  if gemm_kernel:
    assert any(gemm_kernel in name for name in inside), (
      f"{label}: no {gemm_kernel} kernel in {inside}")
  assert_same_bits(f("kernel", *make_args(0)), first, f"{label}: replayed vs first call")
  for seed in range(3):
    args = make_args(seed)
    compare(f("kernel", *args), f("reference", *jax.device_put(args, CPU)), f"{label} seed {seed}")


def quantize(impl, x, key, *, q):
  # A fusion before and after the cast, so the graph holds more than the custom calls.
  qt = ops.quantize(x * 2, q, key=key, implementation=impl)
  return qt, ops.dequantize(qt, "rowwise", jnp.float32, implementation=impl) + 1


def fp8_gemm(impl, x, w, *, x_quantizer="fp8_e4m3", w_quantizer="fp8_e4m3"):
  a, b = (ops.quantize(t, QUANTIZERS[q], ("rowwise",), implementation=impl).rowwise
          for t, q in ((x, x_quantizer), (w, w_quantizer)))
  return ops.gemm(a, b, out_dtype=jnp.float32, implementation=impl) + 1


def within(tolerance):
  def compare(got, want, what):
    error = relative_error(got, np.asarray(want, np.float64))
    assert error <= tolerance, f"{what}: relative error {error:.3g}"
  return compare


def dequant_gemm(impl, x, w):  # MXFP8 x NVFP4, 32 rows: the fused-dequantize kernel
  a = ops.quantize(x, QUANTIZERS["mxfp8_e4m3"], ("rowwise",), implementation=impl).rowwise
  b = ops.quantize(w, QUANTIZERS["nvfp4"], ("rowwise",), implementation=impl).rowwise
  return kernels.dequant_gemm(a, b, out_dtype=jnp.float32) + 1


def grouped_gemm(impl, a, b, sizes, alpha):  # the CPU lowering is the reference
  return kernels.grouped_gemm(a, b, sizes, alpha, out_dtype=jnp.float32) + 1


def grouped_args(dtype):
  def make(seed):  # 512 rows in 4 groups, one of them empty, the last rows in none
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(0, 480, 16), 3))
    sizes = np.diff(np.concatenate([[0], cuts, [480]])).astype(np.int32)
    sizes[seed % 4] = 0
    ka, kb = jax.random.split(jax.random.key(seed))  # magnitudes that E4M3 holds
    a = (jax.random.normal(ka, (512, 256)) * 4).astype(dtype)
    b = (jax.random.normal(kb, (4, 128, 256)) * 4).astype(dtype)
    return a, b, jnp.asarray(sizes), jnp.linspace(0.5, 2.0, 4, dtype=jnp.float32)
  return make


for name in NAMES:
  check(name, functools.partial(quantize, q=QUANTIZERS[name]),
        lambda seed: (random_input(seed, (512, 1024), jnp.bfloat16), jax.random.key(seed)))
  print(name, "ok", flush=True)
gemm_args = lambda seed: (random_input(seed, (256, 512), jnp.bfloat16),
                          random_input(seed + 7, (384, 512), jnp.bfloat16))
check("fp8_tensor_gemm", fp8_gemm, gemm_args, compare=within(FP8_MMA_TOLERANCE),
      gemm_kernel="nvjet")
print("fp8_tensor_gemm ok", flush=True)
for w_blocks in ("block_128x128", "block_1x128"):  # fprop / dgrad and wgrad block shapes
  check(f"block_fp8_gemm {w_blocks}",
        functools.partial(fp8_gemm, x_quantizer="block_1x128", w_quantizer=w_blocks),
        gemm_args, compare=within(FP8_MMA_TOLERANCE), gemm_kernel="nvjet")
  print(f"block_fp8_gemm_{w_blocks} ok", flush=True)
for dtype, tolerance in ((jnp.bfloat16, BF16_MMA_TOLERANCE),
                         (jnp.float8_e4m3fn, FP8_MMA_TOLERANCE)):
  check(f"grouped_gemm {jnp.dtype(dtype).name}", grouped_gemm, grouped_args(dtype),
        compare=within(tolerance), gemm_kernel="cutlass::")
  print(f"grouped_gemm_{jnp.dtype(dtype).name} ok", flush=True)
check("dequant_gemm", dequant_gemm,
      lambda seed: (random_input(seed, (32, 1024), jnp.bfloat16),
                     random_input(seed + 5, (768, 1024), jnp.bfloat16)),
      compare=within(BF16_MMA_TOLERANCE), gemm_kernel="dequant_gemm_kernel")
print("dequant_gemm ok", flush=True)


def mxfp8_values(impl, x):  # the CPU lowering is the reference
  values = gemm_values.mxfp8_values(x * 2, QUANTIZERS["mxfp8_e4m3"], ("rowwise", "columnwise"))
  return {u: v.astype(jnp.float32) + 1 for u, v in values.items()}


check("mxfp8_values", mxfp8_values, lambda seed: (random_input(seed, (512, 1024), jnp.bfloat16),))
print("mxfp8_values ok", flush=True)


def nvfp4_values(impl, x):  # the CPU lowering is the reference
  values = gemm_values.nvfp4_values(x * 2, QUANTIZERS["nvfp4_rht"], ("rowwise", "columnwise"))
  return {u: (v.values.astype(jnp.float32) + 1, v.amax) for u, v in values.items()}


check("nvfp4_values", nvfp4_values, lambda seed: (random_input(seed, (512, 1024), jnp.bfloat16),))
print("nvfp4_values ok", flush=True)
'''

# Every cast family (amax, dequantize and the RHT, 16x16 and per-token variants included).
# Stochastic rounding is left out: its bits are not the reference's (test_kernels_gpu
# checks it statistically).
NAMES = [
  "fp8_e4m3",
  "block_1x128",
  "block_128x128",
  "mxfp8_e4m3",
  "nvfp4",
  "nvfp4_16x16",
  "nvfp4_rht",
  "nvfp4_per_token_rht",
  "hybrid_mxfp8_nvfp4",
]


def test_kernels_replay_from_command_buffers():
  env = dict(
    os.environ,
    XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {FLAGS}".strip(),
    PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
  )
  child = f"NAMES = {NAMES!r}\n{CHILD}"
  run = subprocess.run(
    [sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=600
  )
  assert run.returncode == 0, f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-6000:]}"
  done = NAMES + [
    "fp8_tensor_gemm",
    "block_fp8_gemm_block_128x128",
    "block_fp8_gemm_block_1x128",
    "grouped_gemm_bfloat16",
    "grouped_gemm_float8_e4m3fn",
    "dequant_gemm",
    "mxfp8_values",
    "nvfp4_values",
  ]
  assert run.stdout.split() == [w for name in done for w in (name, "ok")]


def _train_losses(command: list[str], out: pathlib.Path, env: dict[str, str]) -> dict:
  """The recipes' (training, validation) losses of one run of `command` writing to `out`."""
  run = subprocess.run(
    [*command, "--out", str(out)], env=env, capture_output=True, text=True, timeout=600
  )
  assert run.returncode == 0, f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-6000:]}"
  _, results = report.read_curves_json(out / report.CURVES_JSON)
  return {r.recipe: (r.train_losses, r.val_losses) for r in results}


def test_sharded_training_as_one_process_and_as_two(tmp_path):
  """examples/train_lm.py, FSDP over every GPU, deterministic compilation, as one process
  and as a `jax.distributed` job of two (examples/launch_local.py, half the GPUs each).

  While the per-tensor GEMM did not keep the plan it took under stream capture, XLA's update
  of a re-traced graph failed (CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE) within these four steps
  on four H200, as one process and as two. The two runs compute the same program on the
  same mesh; only the order in which NCCL sums across the devices may differ, so their
  losses are compared with tests/examples/test_sharded_lm.py's tolerances: the first
  (the same params' forward on the same batch) to RTOL, the later ones to RTOL_TRAINED."""
  # launch_local's count: it must not start JAX's GPU backend in this process, which would
  # take the memory the training needs.
  gpus = len(launch_local.visible_gpus())
  if gpus < 2 or gpus % 2:
    pytest.skip(f"needs an even number of GPUs, two or more; found {gpus}")
  recipes = ("fp8_delayed", "fp8_current")
  env = dict(
    os.environ,
    XLA_PYTHON_CLIENT_PREALLOCATE="false",
    PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
  )
  # The benchmarks' flag: XLA's Triton GEMM autotuning would take minutes to compile.
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_gpu_enable_triton_gemm=false".strip()
  command = [
    sys.executable,
    str(ROOT / "examples" / "train_lm.py"),
    "--preset",
    "gpu",
    "--recipes",
    ",".join(recipes),
    "--steps",
    "4",
    "--set",
    "eval_every=2",
    "--set",
    "deterministic=true",
    "--mesh",
    f"fsdp={gpus}",
  ]
  launch = [sys.executable, str(ROOT / "examples" / "launch_local.py"), "--processes", "2", "--"]
  one = _train_losses(command, tmp_path / "one_process", env)
  two = _train_losses([*launch, *command], tmp_path / "two_processes", env)
  assert sorted(one) == sorted(two) == sorted(recipes)
  for recipe in recipes:
    (train, val), (train_two, val_two) = one[recipe], two[recipe]
    assert len(train) == len(train_two) == 4 and len(val) == len(val_two) >= 2, recipe
    assert all(math.isfinite(loss) for loss in train + val), (recipe, train, val)
    np.testing.assert_allclose(train_two[0], train[0], rtol=RTOL, err_msg=recipe)
    np.testing.assert_allclose(val_two[0], val[0], rtol=RTOL, err_msg=recipe)
    np.testing.assert_allclose(train_two[1:], train[1:], rtol=RTOL_TRAINED, err_msg=recipe)
    np.testing.assert_allclose(val_two[1:], val[1:], rtol=RTOL_TRAINED, err_msg=recipe)
