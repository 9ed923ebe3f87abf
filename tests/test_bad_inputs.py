"""Every edge of the ops and the vocabulary: one row per bad or degenerate input.

A row is (what is passed, the call, and either the exception it raises, matched by type
and message, or the result it gives). Degenerate shapes have results: an empty dim is
an empty output or an empty sum (zeros), forward and backward, for every preset recipe,
as the plain linear layer `x @ kernel + bias` gives them (`_linear_oracle`). Inputs with
no sensible result raise at trace time, naming the argument, the value and the rule.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxquant as jq
from jaxquant import recipes, reference, scaling
from jaxquant.formats import Family, Format
from jaxquant.ops import _gemm as gemm_ops
from jaxquant.ops import _weight_gather as weight_gather
from jaxquant.ops._backend import Backend
from jaxquant.ops._grouped_dense import init_grouped_state
from jaxquant.ops._weight_gather import WeightGather
from jaxquant.quantizers import (
  BlockFloat8Quantizer,
  DelayedFloat8Quantizer,
  Float8Quantizer,
  HybridQuantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
  needs_state,
)
from jaxquant.roles import GROUPED_LINEAR, LINEAR
from jaxquant.tensor import USAGES

PRESETS = ("bf16", "fp8_current", "fp8_delayed", "fp8_block", "mxfp8", "nvfp4", "hybrid")
QUANTIZED = PRESETS[1:]
# Operand values whose products and sums are exact in every format (and in bf16).
X, W, B, DY = 0.5, 0.25, 1.0, 2.0


class Raises(NamedTuple):
  error: type
  match: str


class Row(NamedTuple):
  id: str
  call: Callable[[], object]
  expect: object  # Raises, or a callable checking the call's result


# ---- The linear layer's results on degenerate shapes ----


def _linear_oracle(x, kernel, bias, dy):
  """y, dx, dkernel, dbias of y = x @ kernel + bias in float64 numpy (empty sums are 0)."""
  x, kernel, bias, dy = (np.asarray(a, np.float64) for a in (x, kernel, bias, dy))
  return x @ kernel + bias, dy @ kernel.T, x.T @ dy, dy.sum(0)


def _amax(a) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float32)), initial=0.0))


def _state_for(recipe, module_type, num_groups=None):
  qs = recipe.quantizers(module_type, "l")
  if num_groups is not None:
    return init_grouped_state(qs, num_groups) or None
  return {t: scaling.init_state(q) for t, q in qs.items() if needs_state(q)} or None


def _vjp(op, x, kernel, bias, dy, state):
  """(y, new_state, dx, dkernel, dbias, state cotangent) of one jitted call."""

  @jax.jit
  def run(x, kernel, bias, dy, state):
    def f(x, kernel, bias, state):
      out = op(x, kernel, bias, state)
      return out if state is not None else (out, None)

    (y, new_state), vjp = jax.vjp(f, x, kernel, bias, state)
    zero_state = jax.tree.map(jnp.zeros_like, new_state)
    return (y, new_state, *vjp((dy, zero_state)))

  return run(x, kernel, bias, dy, state)


def _check_linear(got, x, kernel, bias, dy):
  y, _, dx, dkernel, dbias, _ = got
  for name, g, w, like in zip(
    ("y", "dx", "dkernel", "dbias"),
    (y, dx, dkernel, dbias),
    _linear_oracle(x, kernel, bias, dy),
    (x, x, kernel, bias),
    strict=True,
  ):
    assert g.dtype == like.dtype, name
    np.testing.assert_array_equal(np.asarray(g, np.float64), w, err_msg=name)


def _check_delayed_amaxes(got, amaxes):
  """The amaxes a delayed-scaling call recorded: input and weight in its new state,
  grad_output in its state's cotangent."""
  _, new_state, *_, state_ct = got
  recorded = {
    "input": new_state["input"].amax_history[..., 0],
    "weight": new_state["weight"].amax_history[..., 0],
    "grad_output": state_ct["grad_output"].amax_history[..., 0],
  }
  for t, want in amaxes.items():
    np.testing.assert_array_equal(np.asarray(recorded[t]), want, err_msg=t)


def _dense_case(name, m, k, n):
  recipe = recipes.get(name)
  x = jnp.full((m, k), X, jnp.bfloat16)
  kernel = jnp.full((k, n), W, jnp.bfloat16)
  bias = jnp.full((n,), B, jnp.bfloat16)
  dy = jnp.full((m, n), DY, jnp.bfloat16)
  state = _state_for(recipe, LINEAR)
  op = lambda x, kernel, bias, state: jq.dense(
    x, kernel, bias, recipe=recipe, name="l", key=jax.random.key(0), state=state
  )
  return (lambda: _vjp(op, x, kernel, bias, dy, state)), (x, kernel, bias, dy, state)


def dense_row(name, m, k, n):
  run, (x, kernel, bias, dy, state) = _dense_case(name, m, k, n)

  def check(got):
    _check_linear(got, x, kernel, bias, dy)
    if state is not None:
      _check_delayed_amaxes(
        got, {"input": _amax(x), "weight": _amax(kernel), "grad_output": _amax(dy)}
      )

  return Row(f"dense {name} [M, K, N] = {[m, k, n]}", run, check)


def _grouped_oracle(x, kernel, bias, dy, sizes):
  """The per-group linear layer: rows past the groups give zeros."""
  m, n = dy.shape
  y, dx = np.zeros((m, n)), np.zeros(x.shape)
  dkernel, dbias = np.zeros(kernel.shape), np.zeros(bias.shape)
  start = 0
  for g, size in enumerate(sizes):
    rows = slice(start, start + size)
    y[rows], dx[rows], dkernel[g], dbias[g] = _linear_oracle(x[rows], kernel[g], bias[g], dy[rows])
    start += size
  return y, dx, dkernel, dbias


def grouped_row(name, m, k, n, sizes):
  recipe = recipes.get(name)
  g = len(sizes)
  x = jnp.full((m, k), X, jnp.bfloat16)
  kernel = jnp.full((g, k, n), W, jnp.bfloat16)
  bias = jnp.full((g, n), B, jnp.bfloat16)
  dy = jnp.full((m, n), DY, jnp.bfloat16)
  state = _state_for(recipe, GROUPED_LINEAR, g)
  group_sizes = np.asarray(sizes, np.int32).reshape(g)
  op = lambda x, kernel, bias, state: jq.grouped_dense(
    x, kernel, group_sizes, bias, recipe=recipe, name="l", key=jax.random.key(0), state=state
  )

  def check(got):
    y, _, dx, dkernel, dbias, _ = got
    want = _grouped_oracle(*(np.asarray(a, np.float64) for a in (x, kernel, bias, dy)), sizes)
    for label, a, w, like in zip(
      ("y", "dx", "dkernel", "dbias"),
      (y, dx, dkernel, dbias),
      want,
      (x, x, kernel, bias),
      strict=True,
    ):
      assert a.dtype == like.dtype, label
      np.testing.assert_array_equal(np.asarray(a, np.float64), w, err_msg=label)
    if state is not None:
      starts = np.cumsum(sizes, dtype=int) - np.asarray(sizes, int)
      spans = list(zip(starts, sizes, strict=True))
      of_rows = lambda a: np.array([_amax(a[s : s + c]) for s, c in spans], np.float32)
      _check_delayed_amaxes(
        got,
        {
          "input": of_rows(x),
          "weight": np.array([_amax(w) for w in kernel], np.float32),
          "grad_output": of_rows(dy),
        },
      )

  what = f"[G, M, K, N] = {[g, m, k, n]}"
  return Row(
    f"grouped_dense {name} {what} sizes {list(sizes)}",
    lambda: _vjp(op, x, kernel, bias, dy, state),
    check,
  )


# ---- reference.quantize of empty tensors ----

QUANTIZERS = {
  "fp8": Float8Quantizer(),
  "delayed": DelayedFloat8Quantizer(history_len=4),
  "block_1x128": BlockFloat8Quantizer(),
  "block_128x128": BlockFloat8Quantizer(block="128x128"),
  "mxfp8": MXFP8Quantizer(),
  "nvfp4_rht_sr": NVFP4Quantizer(rht=True, stochastic_rounding=True),
  "nvfp4_tile_2d": NVFP4Quantizer(tile_2d=True),
  "nvfp4_per_token": NVFP4Quantizer(per_token=True),
  "hybrid": HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(rht=True)),
}


def quantize_row(label, shape):
  q = QUANTIZERS[label]
  x = jnp.zeros(shape, jnp.bfloat16)
  state = scaling.init_state(q) if needs_state(q) else None

  @jax.jit
  def call():
    out = reference.quantize(x, q, key=jax.random.key(0), state=state)
    qt = out[0] if state is not None else out
    return [reference.dequantize(qt, u) for u in ("rowwise", "columnwise")]

  def check(got):
    for a in got:
      assert a.shape == shape and a.dtype == jnp.bfloat16

  return Row(f"reference.quantize {label} of shape {list(shape)}", call, check)


def ops_quantize_row(label, shape):
  """ops.quantize and ops.dequantize of an empty tensor under the kernel backend: the
  reference's result, no kernel bound to it."""
  q = QUANTIZERS[label]
  x = jnp.zeros(shape, jnp.bfloat16)
  state = scaling.init_state(q) if needs_state(q) else None

  @jax.jit  # one program, not one compilation per op
  def call():
    out = jq.ops.quantize(x, q, key=jax.random.key(0), state=state)
    qt = out[0] if state is not None else out
    return [jq.ops.dequantize(qt, u) for u in ("rowwise", "columnwise")]

  def check(got):
    for a in got:
      assert a.shape == shape and a.dtype == jnp.bfloat16

  return Row(
    f"ops.quantize {label} of shape {list(shape)} JAXQUANT_BACKEND=kernel", ("kernel", call), check
  )


# ---- The GEMM route of empty problems ----

_FORMATS = {
  "fp8": Format(Family.FP8_TENSOR, "e4m3"),
  "block": Format(Family.FP8_BLOCK, "e4m3", (1, 128), partial_blocks=True, pow2_scales=True),
  "mxfp8": Format(Family.MXFP8, "e4m3", (1, 32)),
  "nvfp4": Format(Family.NVFP4, "e2m1", (1, 16)),
}


def route_row(fmt, m, k, n):
  """The route a GPU with the kernels takes for an empty problem: none of them."""
  side = lambda rows: gemm_ops.Side(_FORMATS[fmt].family, _FORMATS[fmt], rows)
  problem = gemm_ops.Problem(side(m), side(n), k, jnp.dtype(jnp.float32))
  call = lambda: gemm_ops.select(problem, "gpu", Backend("auto", available=True))

  def check(route):
    assert route.kernel is None and route.platform is None, route

  return Row(f"gemm route of {fmt} [m, k, n] = {[m, k, n]} on a GPU", call, check)


def gather_row(k, n):
  """A sharded empty weight is not cast shard by shard: there is nothing to gather."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  gather = WeightGather(mesh, P("fsdp", None), "fsdp")
  call = lambda: weight_gather.resolve(gather, MXFP8Quantizer(), USAGES, (k, n), "dense 'l'")

  def check(got):
    assert got is None, got

  return Row(f"weight_gather of an empty [K, N] = {[k, n]} kernel", call, check)


# ---- Recipes named, and anything else ----

_X = jnp.full((32, 32), X, jnp.bfloat16)
_KERNEL = jnp.full((32, 32), W, jnp.bfloat16)
_KERNELS = jnp.stack([_KERNEL, _KERNEL])
_SIZES = np.array([16, 8], np.int32)


def _traced(fn):
  """The jaxpr of a call: two calls that trace alike compute alike, with nothing compiled."""
  return lambda: str(jax.make_jaxpr(fn)())


def _same_as(want):
  def check(got):
    assert got == _traced(want)()

  return check


def _dense_with_autocast(recipe):
  with recipes.autocast(recipe):
    return jq.dense(_X, _KERNEL)


RECIPE_TYPES = r"a CustomRecipe or a preset name"


# ---- The table ----


def _quantizer_error(make, error, match):
  return (make, Raises(error, match))


# ---- update_quant_state twice in one step ----


def _twice_updated():
  """A fresh fp8_delayed role state (history_len 4) that recorded an amax of 2 in its
  step's forward pass, then updated twice."""
  role = jq.roles.QuantizerRole(LINEAR, "input", "l")
  q = DelayedFloat8Quantizer(history_len=4)
  state = {"l": jq.flax.RoleState(scaling.record_amax(scaling.init_state(q), 2.0), role, q)}
  once = jq.flax.update_quant_state(state)
  return once, jq.flax.update_quant_state(once)


def _check_twice_updated(got):
  # The second update is a step with nothing recorded: the scale holds (448 / 2, the same
  # history max) and the recorded amax moves one slot nearer the end of the history.
  once, twice = (s["l"].scaling for s in got)
  assert float(once.scale) == float(twice.scale) == 224.0
  np.testing.assert_array_equal(once.amax_history, [0, 0, 0, 2])
  np.testing.assert_array_equal(twice.amax_history, [0, 0, 2, 0])


# ---- Delayed-scaling states handed in by the user ----

_DELAYED = DelayedFloat8Quantizer(history_len=4)
_GOOD = scaling.init_state(_DELAYED)
_X_STATE = jnp.ones((8, 32), jnp.bfloat16)
BAD_STATES = {
  "history of two tensors' shape [2, 4]": (
    scaling.DelayedScalingState(jnp.zeros((2, 4), jnp.float32), _GOOD.scale),
    Raises(
      ValueError,
      r"amax_history must be a non-empty float32 vector \[history_len\] \(one tensor's\), "
      r"got float32 of shape \(2, 4\)",
    ),
  ),
  "history of bf16": (
    scaling.DelayedScalingState(jnp.zeros((4,), jnp.bfloat16), _GOOD.scale),
    Raises(ValueError, r"amax_history must be .* got bfloat16 of shape \(4,\)"),
  ),
  "scale vector [2]": (
    scaling.DelayedScalingState(_GOOD.amax_history, jnp.ones((2,), jnp.float32)),
    Raises(ValueError, r"scale must be a float32 scalar, got float32 of shape \(2,\)"),
  ),
  "scale 0": (
    scaling.DelayedScalingState(_GOOD.amax_history, jnp.float32(0)),
    Raises(ValueError, r"scale must be finite and > 0, got 0.0"),
  ),
  "scale NaN": (
    scaling.DelayedScalingState(_GOOD.amax_history, jnp.float32(np.nan)),
    Raises(ValueError, r"scale must be finite and > 0, got nan"),
  ),
  "scale -1": (
    scaling.DelayedScalingState(_GOOD.amax_history, jnp.float32(-1)),
    Raises(ValueError, r"scale must be finite and > 0, got -1.0"),
  ),
  "a dict restored without a target": (
    {"amax_history": _GOOD.amax_history, "scale": _GOOD.scale},
    Raises(TypeError, r"needs a DelayedScalingState, got dict: restore checkpoints with"),
  ),
}


def state_rows():
  rows = []
  for label, (state, expect) in BAD_STATES.items():
    rows.append(
      Row(
        f"reference.quantize delayed, {label}",
        lambda state=state: reference.quantize(_X_STATE, _DELAYED, state=state),
        expect,
      )
    )
    rows.append(
      Row(
        f"ops.quantize delayed, {label} JAXQUANT_BACKEND=kernel",
        ("kernel", lambda state=state: jq.ops.quantize(_X_STATE, _DELAYED, state=state)),
        expect,
      )
    )
  # Through the layer op, in a jitted step: the shapes are checked where the scale is traced.
  bad_input = dict(_state_for(recipes.fp8_delayed, LINEAR))
  bad_input["input"] = BAD_STATES["scale vector [2]"][0]
  rows.append(
    Row(
      "dense fp8_delayed, the input's scale a vector [2], jitted",
      lambda: jax.jit(lambda x, w, s: jq.dense(x, w, recipe=recipes.fp8_delayed, state=s))(
        _X_STATE, jnp.ones((32, 16), jnp.bfloat16), bad_input
      ),
      BAD_STATES["scale vector [2]"][1],
    )
  )
  return rows


BAD_OPTIONS = {
  "DelayedFloat8Quantizer(history_len=1.5)": _quantizer_error(
    lambda: DelayedFloat8Quantizer(history_len=1.5),
    TypeError,
    r"DelayedFloat8Quantizer\.history_len must be a positive int, got 1\.5",
  ),
  "DelayedFloat8Quantizer(history_len=True)": _quantizer_error(
    lambda: DelayedFloat8Quantizer(history_len=True),
    TypeError,
    r"DelayedFloat8Quantizer\.history_len must be a positive int, got True",
  ),
  "DelayedFloat8Quantizer(history_len='8')": _quantizer_error(
    lambda: DelayedFloat8Quantizer(history_len="8"),
    TypeError,
    r"DelayedFloat8Quantizer\.history_len must be a positive int, got '8'",
  ),
  "DelayedFloat8Quantizer(margin=True)": _quantizer_error(
    lambda: DelayedFloat8Quantizer(margin=True),
    TypeError,
    r"DelayedFloat8Quantizer\.margin must be an int in \[-149, 127\], got True",
  ),
  "DelayedFloat8Quantizer(amax_algo=['max'])": _quantizer_error(
    lambda: DelayedFloat8Quantizer(amax_algo=["max"]),
    TypeError,
    r"DelayedFloat8Quantizer\.amax_algo must be one of \('max', 'most_recent'\), got \['max'\]",
  ),
  "Float8Quantizer(eps='0')": _quantizer_error(
    lambda: Float8Quantizer(eps="0"),
    TypeError,
    r"Float8Quantizer\.eps must be a finite real number >= 0, got '0'",
  ),
  "Float8Quantizer(eps=inf)": _quantizer_error(
    lambda: Float8Quantizer(eps=float("inf")),
    ValueError,
    r"Float8Quantizer\.eps must be a finite real number >= 0, got inf",
  ),
  "Float8Quantizer(pow2_scales='yes')": _quantizer_error(
    lambda: Float8Quantizer(pow2_scales="yes"),
    TypeError,
    r"Float8Quantizer\.pow2_scales must be a bool, got 'yes'",
  ),
  "Float8Quantizer(element=8)": _quantizer_error(
    lambda: Float8Quantizer(element=8),
    TypeError,
    r"Float8Quantizer\.element must be one of \('e4m3', 'e5m2'\), got 8",
  ),
  "BlockFloat8Quantizer(eps=-1.0)": _quantizer_error(
    lambda: BlockFloat8Quantizer(eps=-1.0),
    ValueError,
    r"BlockFloat8Quantizer\.eps must be a finite real number >= 0, got -1\.0",
  ),
  "BlockFloat8Quantizer(pow2_scales=1)": _quantizer_error(
    lambda: BlockFloat8Quantizer(pow2_scales=1),
    TypeError,
    r"BlockFloat8Quantizer\.pow2_scales must be a bool, got 1",
  ),
  "BlockFloat8Quantizer(block=(1, 128))": _quantizer_error(
    lambda: BlockFloat8Quantizer(block=(1, 128)),
    TypeError,
    r"BlockFloat8Quantizer\.block must be one of \('1x128', '128x128'\), got \(1, 128\)",
  ),
  "MXFP8Quantizer(element=None)": _quantizer_error(
    lambda: MXFP8Quantizer(element=None),
    TypeError,
    r"MXFP8Quantizer\.element must be one of \('e4m3', 'e5m2'\), got None",
  ),
  **{
    f"NVFP4Quantizer({field}=1)": _quantizer_error(
      functools.partial(NVFP4Quantizer, **{field: 1}),
      TypeError,
      rf"NVFP4Quantizer\.{field} must be a bool, got 1",
    )
    for field in ("tile_2d", "rht", "stochastic_rounding", "per_token")
  },
  "CustomRecipe(name=3)": _quantizer_error(
    lambda: recipes.CustomRecipe(recipes.bf16_factory, name=3),
    TypeError,
    r"CustomRecipe\.name must be a str, got 3",
  ),
  "CustomRecipe(fast_accumulation=True)": _quantizer_error(
    lambda: recipes.CustomRecipe(recipes.bf16_factory, fast_accumulation=True),
    TypeError,
    r"CustomRecipe: fast_accumulation takes a collection of GEMM names among "
    r"\('fprop', 'dgrad', 'wgrad'\), got True",
  ),
  "CustomRecipe(fast_accumulation=[['fprop']])": _quantizer_error(
    lambda: recipes.CustomRecipe(recipes.bf16_factory, fast_accumulation=[["fprop"]]),
    TypeError,
    r"CustomRecipe: fast_accumulation takes a collection of GEMM names among .*got \[\['fprop'\]\]",
  ),
  "CustomRecipe(backward=None)": _quantizer_error(
    lambda: recipes.CustomRecipe(recipes.bf16_factory, backward=None),
    TypeError,
    r"CustomRecipe\.backward must be one of \('quantized', 'high_precision', 'dequantized'\), "
    r"got None",
  ),
}


def _rows():
  rows = []
  # Empty dims of the linear layer, forward and backward, every quantized preset (bf16's
  # plain jnp.dot already gives them).
  for name in QUANTIZED:
    rows.append(dense_row(name, 32, 0, 32))
    rows.append(dense_row(name, 32, 32, 0))
  # Under the kernel backend too: the empty operands take no cast kernel.
  for name in ("fp8_current", "nvfp4"):
    row = dense_row(name, 32, 0, 32)
    rows.append(row._replace(id=row.id + " JAXQUANT_BACKEND=kernel", call=("kernel", row.call)))
  for label in QUANTIZERS:
    rows.append(quantize_row(label, (32, 0)))
  rows.append(quantize_row("mxfp8", (0, 0)))
  rows.append(quantize_row("nvfp4_rht_sr", (2, 16, 0)))
  for label in ("fp8", "delayed", "mxfp8", "nvfp4_rht_sr"):
    rows.append(ops_quantize_row(label, (32, 0)))
  # grouped_dense: no rows (M = 0) where a columnwise usage pads groups (RHT), no groups
  # (G = 0), an empty contraction (K = 0).
  for name in ("nvfp4", "hybrid"):
    rows.append(grouped_row(name, 0, 32, 32, [0, 0]))
  for name in PRESETS:
    rows.append(grouped_row(name, 32, 32, 32, []))
  for name in QUANTIZED:
    rows.append(grouped_row(name, 32, 0, 32, [16, 8]))
  # Group sizes as a list: the call an array of them makes.
  for name in ("bf16", "mxfp8"):
    recipe = recipes.get(name)
    grouped = lambda sizes, recipe=recipe: jq.grouped_dense(_X, _KERNELS, sizes, recipe=recipe)
    rows.append(
      Row(
        f"grouped_dense {name} group_sizes=[16, 8]",
        _traced(lambda grouped=grouped: grouped([16, 8])),
        _same_as(lambda grouped=grouped: grouped(_SIZES)),
      )
    )
  rows += [gather_row(0, 32), gather_row(32, 0)]
  for fmt in _FORMATS:
    for m, k, n in ((0, 128, 128), (128, 0, 128), (128, 128, 0)):
      rows.append(route_row(fmt, m, k, n))
  # Recipes by name; anything else is a TypeError naming it.
  rows += [
    Row(
      "recipes.resolve('fp8_current')",
      lambda: recipes.resolve("fp8_current"),
      lambda got: got is recipes.fp8_current or pytest.fail(repr(got)),
    ),
    Row(
      "recipes.resolve('fp9')",
      lambda: recipes.resolve("fp9"),
      Raises(ValueError, r"unknown recipe 'fp9'; presets are \['bf16', "),
    ),
    Row(
      "recipes.resolve(3)",
      lambda: recipes.resolve(3),
      Raises(TypeError, rf"recipe must be {RECIPE_TYPES} \(one of \['bf16', .*\]\), got 3"),
    ),
    Row(
      "recipes.resolve(recipes.fp8_current_factory)",
      lambda: recipes.resolve(recipes.fp8_current_factory),
      Raises(TypeError, rf"recipe must be {RECIPE_TYPES} .*got <function fp8_current_factory"),
    ),
    Row(
      "dense(recipe='fp8_current')",
      _traced(lambda: jq.dense(_X, _KERNEL, recipe="fp8_current")),
      _same_as(lambda: jq.dense(_X, _KERNEL, recipe=recipes.fp8_current)),
    ),
    Row(
      "dense(recipe=3)",
      lambda: jq.dense(_X, _KERNEL, recipe=3),
      Raises(TypeError, rf"recipe must be {RECIPE_TYPES} .*got 3"),
    ),
    Row(
      "grouped_dense(recipe='mxfp8')",
      _traced(lambda: jq.grouped_dense(_X, _KERNELS, _SIZES, recipe="mxfp8")),
      _same_as(lambda: jq.grouped_dense(_X, _KERNELS, _SIZES, recipe=recipes.mxfp8)),
    ),
    Row(
      "autocast('fp8_current')",
      _traced(lambda: _dense_with_autocast("fp8_current")),
      _same_as(lambda: jq.dense(_X, _KERNEL, recipe=recipes.fp8_current)),
    ),
    Row(
      "autocast(3)",
      lambda: _dense_with_autocast(3),
      Raises(TypeError, rf"recipe must be {RECIPE_TYPES} .*got 3"),
    ),
    Row(
      "dense(fast_accumulation=True)",
      lambda: jq.dense(_X, _KERNEL, recipe=recipes.fp8_current, fast_accumulation=True),
      Raises(TypeError, r"dense '': fast_accumulation takes a collection of GEMM names .*got True"),
    ),
    Row(
      "grouped_dense(tile=-1)",
      lambda: jq.grouped_dense(_X, _KERNELS, _SIZES, tile=-1),
      Raises(ValueError, r"grouped_dense '': tile must be an int >= 0 \(0: automatic\), got -1"),
    ),
    Row(
      "grouped_dense(tile=8.0)",
      lambda: jq.grouped_dense(_X, _KERNELS, _SIZES, tile=8.0),
      Raises(TypeError, r"grouped_dense '': tile must be an int >= 0 \(0: automatic\), got 8\.0"),
    ),
    Row(
      "grouped_dense(group_sizes=[1.5, 2])",
      lambda: jq.grouped_dense(_X, _KERNELS, [1.5, 2]),
      Raises(TypeError, r"grouped_dense '': group_sizes must be an integer array.*got float"),
    ),
  ]
  rows += [Row(label, make, expect) for label, (make, expect) in BAD_OPTIONS.items()]
  rows += state_rows()
  rows.append(Row("update_quant_state twice in one step", _twice_updated, _check_twice_updated))
  return rows


ROWS = _rows()


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input(row, monkeypatch):
  call = row.call
  if isinstance(call, tuple):  # (backend, call)
    backend, call = call
    monkeypatch.setenv("JAXQUANT_BACKEND", backend)
  if isinstance(row.expect, Raises):
    with pytest.raises(row.expect.error, match=row.expect.match):
      call()
  else:
    row.expect(call())
