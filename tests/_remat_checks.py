"""Readings of a backward pass and of its saved residuals that the remat tests share.

What the backward pass runs is read from its own jaxpr: the function `jax.vjp` returns,
traced apart from the forward, its residuals its inputs (`backward_work`). It holds the
recomputed forward where a policy recomputes one, so a policy that recomputes no
quantization and no GEMM leaves exactly the casts and GEMMs of the backward pass without
remat (the output gradient's casts, dgrad and wgrad), and one that recomputes them leaves
more. A cast is an operation whose output has an 8- or 4-bit float dtype or is uint8
(NVFP4's packed pairs), or a cast kernel's primitive (the GEMM-values casts output bf16);
a GEMM a `dot_general` (the reference's) or a GEMM kernel's primitive.
"""

import collections
import contextlib
import io
import math
import re

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np

_NARROW_FLOATS = {
  name
  for name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float4_e2m1fn")
  if hasattr(jnp, name)
}


def _is_narrow(aval) -> bool:
  dtype = getattr(aval, "dtype", None)
  if dtype is None or not isinstance(dtype, np.dtype):
    return False
  return dtype.name in _NARROW_FLOATS or dtype == np.uint8


# jaxquant's kernel primitives (kernels/), each also bound as "<name>_shard" inside a
# partitioned call.
_CAST_KERNELS = ("jaxquant_cast", "jaxquant_mxfp8_values", "jaxquant_nvfp4_values")
_GEMM_KERNEL_SUFFIXES = ("_gemm", "_grouped_wgrad")


def _kernel(name: str) -> str:
  return name.removesuffix("_shard")


def _is_cast(eqn) -> bool:
  return _kernel(eqn.primitive.name) in _CAST_KERNELS or any(
    _is_narrow(v.aval) for v in eqn.outvars
  )


def _is_gemm(eqn) -> bool:
  name = _kernel(eqn.primitive.name)
  return name == "dot_general" or (
    name.startswith("jaxquant_") and name.endswith(_GEMM_KERNEL_SUFFIXES)
  )


def _sub_jaxprs(eqn):
  for param in eqn.params.values():
    for value in param if isinstance(param, (list, tuple)) else (param,):
      if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
      elif isinstance(value, jax.extend.core.Jaxpr):
        yield value


def _count(jaxpr, counts):
  for eqn in jaxpr.eqns:
    inner = list(_sub_jaxprs(eqn))
    if inner:  # a call (jit, checkpoint, custom_vjp): its body's operations count
      for sub in inner:
        _count(sub, counts)
      continue
    counts["gemms"] += _is_gemm(eqn)
    counts["casts"] += _is_cast(eqn)
  return counts


def backward_work(fn, *args) -> dict:
  """{"casts": n, "gemms": n} of the backward pass of `fn(*args)` (a scalar loss)."""
  pullback = jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], *args)
  jaxpr = jax.make_jaxpr(lambda pullback: pullback(jnp.float32(1)))(pullback).jaxpr
  return dict(_count(jaxpr, collections.Counter()))


_LINE = re.compile(r"^(?P<dtype>\w+)\[(?P<shape>[\d, ]*)\]\s+(?P<source>.*)$")
_NAME = re.compile(r"named '(?P<name>[^']+)'")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "u8": 1, "s32": 4, "u32": 4, "pred": 1}


class Residual(collections.namedtuple("Residual", "dtype shape name argument")):
  @property
  def bytes(self) -> int:
    size = 1 if self.dtype.startswith(("f8", "f4")) else _BYTES[self.dtype]
    return size * math.prod(self.shape)


def saved_residuals(fn, *args) -> list[Residual]:
  """What the backward pass of `fn` keeps, from `jax.ad_checkpoint.print_saved_residuals`
  (its public form on every JAX version): dtype, shape, checkpoint name (or None), and
  whether it is one of `fn`'s own arguments (held by the caller anyway). PRNG keys are
  left out: they are not arrays of values."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(fn, *args)
  found = []
  for line in out.getvalue().splitlines():
    match = _LINE.match(line.strip())
    if match is None:
      continue
    shape = tuple(int(d) for d in match.group("shape").split(",") if d.strip())
    name = _NAME.search(match.group("source"))
    found.append(
      Residual(
        match.group("dtype"),
        shape,
        name and name.group("name"),
        "from the argument" in match.group("source"),
      )
    )
  return found


def kept_bytes(residuals: list[Residual]) -> int:
  """Bytes the backward pass keeps besides the function's arguments."""
  return sum(r.bytes for r in residuals if not r.argument)
