"""While the swap-in routes a model, JAX's plain-function entry points keep their identity:
code like MaxText's attention, which passes `precision=` only `if einsum is jnp.einsum`
for an `einsum` it stored before, computes what it computes unquantized, and the bf16
recipe lowers to the plain model's HLO."""

import inspect
import re
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.numpy import einsum as einsum_bound_at_import

import jaxquant.flax as jqf
from jaxquant import recipes

B, T, H, D = 2, 8, 2, 32
ENTRY_POINTS = {
  "jnp.einsum": jnp.einsum,
  "lax.dot_general": jax.lax.dot_general,
  "lax.ragged_dot": jax.lax.ragged_dot,
  "lax.ragged_dot_general": jax.lax.ragged_dot_general,
}
HIGHEST = jax.lax.Precision.HIGHEST


def strip_locations(text):
  return re.sub(r"loc\([^)]*\)", "", re.sub(r"#loc\d*( = .*)?", "", text))


def attention(einsum, q, k, v):
  """MaxText's qk and wv products: `precision=` only for jnp.einsum itself."""
  precision = {"precision": HIGHEST} if einsum is jnp.einsum else {}
  scores = einsum("bthd,bshd->bhts", q, k, **precision)
  return einsum("bhts,bshd->bthd", jax.nn.softmax(scores), v, **precision)


class LinenAttention(nn.Module):
  """The einsum is an attribute, bound when the class was defined."""

  einsum: Callable = jnp.einsum

  @nn.compact
  def __call__(self, x):
    w = self.param("qkv", nn.initializers.normal(0.05), (D, 3, H, D // H))
    q, k, v = jnp.unstack(jnp.einsum("btd,dxhe->xbthe", x, w), axis=0)
    return attention(self.einsum, q, k, v)


class NnxAttention(nnx.Module):
  """The einsum is stored when the model is built, before it is quantized."""

  def __init__(self, rngs):
    self.qkv = nnx.Param(jax.random.normal(rngs.params(), (D, 3, H, D // H)) * 0.05)
    self.einsum = jnp.einsum

  def __call__(self, x):
    q, k, v = jnp.unstack(jnp.einsum("btd,dxhe->xbthe", x, self.qkv[...]), axis=0)
    return attention(self.einsum, q, k, v)


def inputs():
  return jax.random.normal(jax.random.key(1), (B, T, D), jnp.float32)


def test_linen_attention_under_bf16_lowers_to_the_plain_hlo():
  x = inputs()
  params = LinenAttention().init(jax.random.key(0), x)
  swapped = jqf.quantize_model(LinenAttention(), recipes.bf16)
  hlo = [
    strip_locations(jax.jit(model.apply).lower(params, x).as_text())
    for model in (LinenAttention(), swapped)
  ]
  assert "HIGHEST" in hlo[0]
  assert hlo[1] == hlo[0]
  np.testing.assert_array_equal(swapped.apply(params, x), LinenAttention().apply(params, x))


def test_nnx_attention_under_bf16_lowers_to_the_plain_hlo():
  x = inputs()
  plain = NnxAttention(nnx.Rngs(0))
  swapped = jqf.quantize_model(NnxAttention(nnx.Rngs(0)), recipes.bf16)
  hlo = [strip_locations(jax.jit(lambda x, m=m: m(x)).lower(x).as_text()) for m in (plain, swapped)]
  assert "HIGHEST" in hlo[0]
  assert hlo[1] == hlo[0]
  np.testing.assert_array_equal(swapped(x), plain(x))


class Probe(nn.Module):
  """Records, while the model runs, whether each entry point is the object bound at import."""

  record: Callable[[dict], None]

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.05), (D, D))
    current = {
      "jnp.einsum": jnp.einsum,
      "lax.dot_general": jax.lax.dot_general,
      "lax.ragged_dot": jax.lax.ragged_dot,
      "lax.ragged_dot_general": jax.lax.ragged_dot_general,
    }
    self.record({name: current[name] is f for name, f in ENTRY_POINTS.items()})
    self.record({f"{name} signature": inspect.signature(f) for name, f in ENTRY_POINTS.items()})
    return x @ w


def test_entry_points_are_the_objects_bound_before_routing():
  x = inputs()
  before = {name: (f.__code__, f.__kwdefaults__, dict(vars(f))) for name, f in ENTRY_POINTS.items()}
  signatures = {f"{name} signature": inspect.signature(f) for name, f in ENTRY_POINTS.items()}
  seen = {}
  model = jqf.quantize_model(Probe(seen.update), recipes.fp8_current)
  model.apply(model.init(jax.random.key(0), x), x)
  assert seen == {**dict.fromkeys(ENTRY_POINTS, True), **signatures}
  # ... and the functions are left as they were.
  for name, f in ENTRY_POINTS.items():
    code, kwdefaults, namespace = before[name]
    assert f.__code__ is code and f.__kwdefaults__ is kwdefaults and vars(f) == namespace


class BoundAtImport(nn.Module):
  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.05), (D, D))
    return einsum_bound_at_import("btd,de->bte", x, w)


def test_a_name_bound_at_import_is_routed():
  x = inputs()
  params = BoundAtImport().init(jax.random.key(0), x)
  model = jqf.quantize_model(BoundAtImport(), recipes.fp8_current)
  assert [r.role for r in jqf.swap_report(model, params, x).quantized] == ["w"]
  assert not np.array_equal(model.apply(params, x), BoundAtImport().apply(params, x))


class Tensordot(nn.Module):
  """jnp.tensordot calls dot_general from JAX's own module: not an entry point."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.05), (D, D))
    return jnp.tensordot(x, w, 1)


def test_contractions_inside_jax_run_as_written():
  x = inputs()
  params = Tensordot().init(jax.random.key(0), x)
  model = jqf.quantize_model(Tensordot(), recipes.fp8_current, require_gemm=False)
  (row,) = jqf.swap_report(model, params, x).rows  # listed, never silently absent
  assert row.role == "w" and row.status.startswith("high precision: not reached by the swap-in")
  np.testing.assert_array_equal(model.apply(params, x), Tensordot().apply(params, x))
