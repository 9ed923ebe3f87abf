"""When the CUDA library is loaded, and what `unavailable_reason()` says when it cannot be.

The library runs code when opened (its constructors), so it is opened only once a GPU
platform asks for the kernels; and each way the kernels can be missing (no GPU, a GPU they
do not run on, no library, a library that does not load) is named as such.
"""

from __future__ import annotations

import _ctypes
import functools
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import types

import jax
import pytest

from jaxquant import kernels
from jaxquant.kernels import _library as library
from jaxquant.kernels import _targets as targets

_ROOT = pathlib.Path(__file__).resolve().parents[2]

# Imports jaxquant.flax and runs a quantized dense layer on this machine's platform (under
# the backend JAXQUANT_BACKEND names), then reports whether the library JAXQUANT_FFI_LIBRARY
# names is mapped into the process, and the reason the kernels are unavailable.
_USES_THE_OPS = """
import json, os
import jax, jax.numpy as jnp
import jaxquant as jq
import jaxquant.flax
x, w = jnp.ones((32, 64)), jnp.ones((64, 32))
y = jax.jit(lambda x, w: jq.dense(x, w, recipe="fp8_current"))(x, w)
y.block_until_ready()
maps = open("/proc/self/maps").read()
print(json.dumps({"mapped": os.environ["JAXQUANT_FFI_LIBRARY"] in maps,
                  "reason": jq.kernels.unavailable_reason()}))
"""


@pytest.fixture
def stand_in_library(tmp_path):
  """A loadable shared library at a path no other code maps: a copy of ctypes' own."""
  path = tmp_path / "libstand_in_ffi.so"
  shutil.copy(_ctypes.__file__, path)
  return path


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's case: no GPU in use")
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_a_cpu_run_never_opens_the_library(stand_in_library, backend):
  env = dict(
    os.environ,
    JAXQUANT_FFI_LIBRARY=str(stand_in_library),
    JAXQUANT_BACKEND=backend,
    JAX_PLATFORMS="cpu",
  )
  out = subprocess.run(
    [sys.executable, "-c", _USES_THE_OPS],
    cwd=_ROOT,
    env=env,
    capture_output=True,
    text=True,
    check=True,
  )
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert not result["mapped"]
  assert result["reason"].startswith("no CUDA GPU in use")
  assert "JAXQUANT_FFI_LIBRARY" not in out.stderr  # nothing was loaded, nothing logged


@pytest.fixture
def fresh_load(monkeypatch):
  """The library's load as on a fresh process: its once-only cache empty."""
  monkeypatch.delenv("JAXQUANT_FFI_LIBRARY", raising=False)
  monkeypatch.setattr(library, "_load", functools.cache(library._load.__wrapped__))


def test_an_override_is_logged_once_when_loaded(monkeypatch, fresh_load, stand_in_library, caplog):
  """The GPU path's load, taken here directly: the override is named in one log line, and
  a library without the handlers is refused by name."""
  monkeypatch.setenv("JAXQUANT_FFI_LIBRARY", str(stand_in_library))
  with caplog.at_level(logging.WARNING, logger=library.__name__):
    first = library.register(targets.TARGETS)
    second = library.register(targets.TARGETS)
  assert first == second and "it was built from other sources" in first
  logged = [r.getMessage() for r in caplog.records if str(stand_in_library) in r.getMessage()]
  assert len(logged) == 1 and "JAXQUANT_FFI_LIBRARY" in logged[0]


def test_a_library_not_built_says_how_to_build_it(monkeypatch, fresh_load, tmp_path):
  monkeypatch.setattr(library, "library_path", lambda: tmp_path / library.LIBRARY_NAME)
  error = library.register(targets.TARGETS)
  assert "was not built" in error and "JAXQUANT_BUILD_CUDA=1" in error


def test_a_missing_override_is_named(monkeypatch, fresh_load, tmp_path):
  monkeypatch.setenv("JAXQUANT_FFI_LIBRARY", str(tmp_path / "nowhere.so"))
  assert (
    library.register(targets.TARGETS) == f"JAXQUANT_FFI_LIBRARY={tmp_path}/nowhere.so: no such file"
  )


def test_a_built_library_that_does_not_load_is_told_apart(monkeypatch, fresh_load, tmp_path):
  """A library that exists but cannot be opened (the dynamic loader's words kept: on a
  machine without the CUDA 13 cuBLASLt they name libcublasLt.so.13)."""
  broken = tmp_path / library.LIBRARY_NAME
  broken.write_bytes(b"not a shared library")
  monkeypatch.setattr(library, "library_path", lambda: broken)
  error = library.register(targets.TARGETS)
  assert "is built but could not be loaded" in error and str(broken) in error
  assert "nvidia-cublas" in error


def test_a_gpu_the_kernels_do_not_run_on_is_named(monkeypatch):
  ampere = types.SimpleNamespace(compute_capability="8.0")
  monkeypatch.setattr(jax, "devices", lambda backend=None: [ampere])
  assert "['8.0']" in library.device_reason()


def test_the_device_is_asked_before_the_library_is_loaded(monkeypatch):
  """Off a supported GPU the reason is the device's, and the library is not touched."""
  monkeypatch.setattr(library, "device_reason", lambda: "no CUDA GPU in use (stand-in)")
  monkeypatch.setattr(library, "register", lambda targets: pytest.fail("library loaded"))
  assert targets.unavailable_reason.__wrapped__() == "no CUDA GPU in use (stand-in)"


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's reason")
def test_on_the_cpu_the_reason_is_the_missing_gpu():
  assert kernels.unavailable_reason().startswith("no CUDA GPU in use (JAX's backend here is cpu)")
