"""Shared test setup, in XLA_FLAGS: they must be set before JAX initialises its
backends, hence here, at collection time.

- Eight fake CPU devices let sharding tests run on any machine.
- The CPU suite is dominated by compiling small, op-heavy graphs (the exact reference
  quantizers), not by running them, so the CPU backend's LLVM optimizations are turned
  off: skipping the expensive passes saves about a sixth of the compile time, optimization
  level 0 a further 13-15 % of each CI run's test time. Quantized bits do not change (the
  bit tests run under it). At level 0 the CPU dot's summation order follows its operands'
  shapes, so a test that compares a sharded step's fp32 losses with one device's compiles
  that step at XLA's default level (tiny_transformers.XLA_DEFAULT_OPT).
  `JAXQUANT_TEST_XLA_OPT=1` keeps XLA's defaults throughout, as the GPU machine's run of
  this suite does.
"""

import os

import pytest

_FLAGS = ["--xla_force_host_platform_device_count=8"]
if os.environ.get("JAXQUANT_TEST_XLA_OPT") != "1":
  _FLAGS += ["--xla_llvm_disable_expensive_passes=true", "--xla_backend_optimization_level=0"]
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", "")] + _FLAGS))


@pytest.fixture
def eight_devices():
  """The first eight devices, or a skip: the sharding tests' meshes need eight (the fake
  CPU devices above give them; a machine with one GPU has one)."""
  import jax  # here, not at the top: XLA_FLAGS must be set before JAX starts

  devices = jax.devices()
  if len(devices) < 8:
    pytest.skip(f"needs 8 devices, {jax.default_backend()} has {len(devices)}")
  return devices[:8]


@pytest.fixture
def cuda_library_stand_in(monkeypatch):
  """Lowering for CUDA on a machine without the CUDA library: its load and its workspace
  queries are stood in for (every kernel's workspace result is then 256 bytes)."""
  from jaxquant.kernels import _library as library

  monkeypatch.setattr(library, "register", lambda targets: None)
  monkeypatch.setattr(library, "workspace_bytes", lambda target, *dims: 256)
