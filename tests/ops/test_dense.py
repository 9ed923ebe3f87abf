"""jaxquant.dense: values and gradients against a fake-quant model, roles, usages, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _dense_fake_quant import dense_and_grads, rel_err

import jaxquant as jq
from jaxquant import recipes, reference, scaling
from jaxquant.ops import _dense_vjp as dense_vjp
from jaxquant.ops import _gemm as gemm_ops
from jaxquant.quantizers import (
  BlockFloat8Quantizer,
  Float8Quantizer,
  HybridQuantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
  needs_state,
)
from jaxquant.roles import QuantizerRole

M0, M1, K, N = 2, 32, 96, 64  # x [2, 32, 96] -> M = 64; every format's blocks fit
TOL = 1e-5  # fp32 accumulation in a different order, relative to the norm


def _factory(table):
  return lambda role: table[role.tensor_type]


HYBRIDS = {
  "mxfp8_row_nvfp4_col": recipes.CustomRecipe(
    _factory(
      {
        "input": HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(rht=True)),
        "weight": HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer()),
        "grad_output": HybridQuantizer(
          MXFP8Quantizer("e5m2"), NVFP4Quantizer(rht=True, stochastic_rounding=True)
        ),
      }
    )
  ),
  "fp8_row_none_col": recipes.CustomRecipe(lambda role: HybridQuantizer(Float8Quantizer(), None)),
  "nvfp4_16x16_w_rht_wgrad": recipes.CustomRecipe(
    _factory(
      {
        "input": NVFP4Quantizer(rht=True),
        "weight": NVFP4Quantizer(tile_2d=True),
        "grad_output": NVFP4Quantizer(rht=True),
      }
    )
  ),
  "nvfp4_per_token": recipes.CustomRecipe(
    _factory(
      {
        "input": NVFP4Quantizer(rht=True, per_token=True),
        "weight": NVFP4Quantizer(tile_2d=True),
        "grad_output": NVFP4Quantizer(rht=True, stochastic_rounding=True, per_token=True),
      }
    )
  ),
}
RECIPES = {**recipes.PRESETS, **HYBRIDS}
STATE_SCALES = {"input": 60.0, "weight": 900.0, "grad_output": 2.0e4}


def _data(dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(ks[0], (M0, M1, K), jnp.float32).astype(dtype)
  kernel = (jax.random.normal(ks[1], (K, N), jnp.float32) / np.sqrt(K)).astype(dtype)
  bias = jax.random.normal(ks[2], (N,), jnp.float32).astype(dtype)
  dy = jax.random.normal(ks[3], (M0, M1, N), jnp.float32).astype(dtype)
  return x, kernel, bias, dy


def _state(quantizers):
  state = {}
  for t, q in quantizers.items():
    if needs_state(q):
      s = scaling.init_state(q)
      state[t] = scaling.DelayedScalingState(s.amax_history, jnp.float32(STATE_SCALES[t]))
  return state or None


def _dense_and_grads(x, kernel, bias, dy, recipe, key, state):
  """y and the gradients of <y, dy> through jq.dense, jitted once."""

  def f(x, kernel, bias):
    out = jq.dense(x, kernel, bias, recipe=recipe, name="layer", key=key, state=state)
    return out[0] if state is not None else out

  y, vjp = jax.vjp(f, x, kernel, bias)
  return (y, *vjp(dy))


_jitted = jax.jit(_dense_and_grads, static_argnums=(4,))


@functools.partial(jax.jit, static_argnums=(4,))
def _both(x, kernel, bias, dy, recipe, key, state):
  """(dense's y and grads, the fake-quant model's) in one program: XLA shares the
  common quantizations, which dominate compile time."""
  got = _dense_and_grads(x, kernel, bias, dy, recipe, key, state)
  want = dense_and_grads(
    x, kernel, bias, dy, recipe.quantizers("linear", "layer"), recipe.backward, key, state
  )
  return got, want


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.slow
def test_matches_fake_quant(name):
  recipe = RECIPES[name]
  x, kernel, bias, dy = _data()
  key = jax.random.key(7)
  quantizers = recipe.quantizers("linear", "layer")
  state = _state(quantizers)
  got, want = _both(x, kernel, bias, dy, recipe, key, state)
  for what, g, w in zip(("y", "dx", "dkernel", "dbias"), got, want, strict=False):
    assert g.dtype == w.dtype and g.shape == w.shape, what
    assert rel_err(g, w) < TOL, (what, rel_err(g, w))


@pytest.mark.parametrize(
  "backward, base",
  [("high_precision", "nvfp4"), ("dequantized", "nvfp4_per_token"), ("dequantized", "fp8_current")],
)
def test_backward_modes(backward, base):
  recipe = recipes.CustomRecipe(RECIPES[base].qfactory, backward=backward)
  x, kernel, bias, dy = _data()
  key = jax.random.key(1)
  got, want = _both(x, kernel, bias, dy, recipe, key, None)
  for what, g, w in zip(("y", "dx", "dkernel", "dbias"), got, want, strict=False):
    assert rel_err(g, w) < TOL, (what, rel_err(g, w))


def test_bf16_recipe_is_jnp_dot_bitwise():
  x, kernel, bias, dy = _data(jnp.bfloat16)
  got = _jitted(x, kernel, bias, dy, recipes.bf16, None, None)

  # Both sides compiled: XLA may order a bf16 dot's accumulation differently when run
  # op by op than when compiled, so an eager reference would not test dense itself.
  @jax.jit
  def plain(x, k, b, dy):
    y, vjp = jax.vjp(lambda x, k, b: jnp.dot(x, k) + b, x, k, b)
    return (y, *vjp(dy))

  for g, w in zip(got, plain(x, kernel, bias, dy), strict=False):
    assert g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_gradients_in_primal_dtypes():
  x, kernel, bias, dy = _data(jnp.bfloat16)
  y, dx, dk, db = _jitted(
    x, kernel.astype(jnp.float32), bias.astype(jnp.float16), dy, recipes.mxfp8, None, None
  )
  assert (y.dtype, dx.dtype, dk.dtype, db.dtype) == (
    jnp.bfloat16,
    jnp.bfloat16,
    jnp.float32,
    jnp.float16,
  )


# Distinct formats per (role, usage), so a GEMM operand's format tells which one it is.
_TAGGED = {
  "input": HybridQuantizer(MXFP8Quantizer("e4m3"), Float8Quantizer("e4m3")),
  "weight": HybridQuantizer(BlockFloat8Quantizer(block="128x128"), NVFP4Quantizer()),
  "grad_output": HybridQuantizer(MXFP8Quantizer("e5m2"), Float8Quantizer("e5m2")),
}
_TAG_OF = {
  (type(q).__name__, q.format(u).element, q.format(u).block): (t, u)
  for t, h in _TAGGED.items()
  for u, q in (("rowwise", h.rowwise), ("columnwise", h.columnwise))
}


def test_roles_and_usages_recorded(monkeypatch):
  seen_roles, gemms = [], []

  def qfactory(role):
    seen_roles.append(role)
    return _TAGGED[role.tensor_type]

  def recording_gemm(a, b, **kw):
    tags = []
    for op in (a, b):
      q_name = {
        "fp8_tensor": "Float8Quantizer",
        "fp8_block": "BlockFloat8Quantizer",
        "mxfp8": "MXFP8Quantizer",
        "nvfp4": "NVFP4Quantizer",
      }[op.format.family.value]
      tags.append(_TAG_OF[(q_name, op.format.element, op.format.block)])
    gemms.append(tuple(tags))
    return gemm_ops.gemm(a, b, **kw)

  monkeypatch.setattr(dense_vjp, "gemm", recording_gemm)
  x, kernel, bias, dy = _data()
  recipe = recipes.CustomRecipe(qfactory)
  jax.eval_shape(lambda *a: _dense_and_grads(*a, recipe, None, None), x, kernel, bias, dy)
  assert sorted((r.module_type, r.tensor_type, r.name) for r in seen_roles) == [
    ("linear", "grad_output", "layer"),
    ("linear", "input", "layer"),
    ("linear", "weight", "layer"),
  ]
  assert gemms == [  # fprop, dgrad, wgrad: operands (role, usage) in A, B order
    (("input", "rowwise"), ("weight", "rowwise")),
    (("grad_output", "rowwise"), ("weight", "columnwise")),
    (("input", "columnwise"), ("grad_output", "columnwise")),  # dw [K, N] = xᵀ · dy
  ]


@jax.jit
def _per_token_errors(x2d, kernel, scales):
  """Row-normalised relative fprop error of per-tensor and per-token NVFP4 inputs."""
  exact = jnp.matmul(x2d, kernel, precision=jax.lax.Precision.HIGHEST)
  errs = {}
  for per_token in (False, True):
    y = jq.dense(x2d, kernel, quantizers={"input": NVFP4Quantizer(per_token=per_token)})
    errs[per_token] = jnp.linalg.norm((y - exact) / scales) / jnp.linalg.norm(exact / scales)
  return errs


def test_per_token_beats_per_tensor_on_outlier_rows():
  x, kernel, _, _ = _data()
  x2d = x.reshape(-1, K)
  # Outlier rows 1e6 times larger: with one per-tensor global scale the ordinary rows'
  # E4M3 block scales underflow to zero; per-token global scales keep them. (Weights stay
  # in high precision so the error is the input's alone.)
  scales = jnp.where(jnp.arange(x2d.shape[0]) % 16 == 0, 1e6, 1.0)[:, None]
  errs = {k: float(v) for k, v in _per_token_errors(x2d * scales, kernel, scales).items()}
  print(
    f"NVFP4 fprop relative error, row-normalised: per-tensor {errs[False]:.4f}, "
    f"per-token {errs[True]:.4f}"
  )
  assert errs[True] < 0.5 * errs[False]


def _trace(fn, *args):
  return jax.eval_shape(fn, *args)


def test_errors_name_the_problem():
  x, kernel, bias, _ = _data()
  with pytest.raises(ValueError, match=r"dense 'l': contraction dims differ"):
    _trace(lambda x, k: jq.dense(x, k, recipe=recipes.mxfp8, name="l"), x, kernel[:64])
  with pytest.raises(ValueError, match=r"kernel must be rank 2"):
    _trace(lambda x, k: jq.dense(x, k, name="l"), x, kernel[None])
  with pytest.raises(ValueError, match=r"bias must have shape"):
    _trace(lambda x, k, b: jq.dense(x, k, b, name="l"), x, kernel, bias[:3])
  # The backward's usages are checked when a backward is traced (forward alone: see
  # test_forward_alone_takes_few_tokens).
  grad = lambda f: jax.grad(lambda x, k: jnp.sum(f(x, k).astype(jnp.float32)), argnums=(0, 1))
  with pytest.raises(
    ValueError, match=r"dense 'l' input: columnwise usage.*divisible by its block 32"
  ):
    _trace(grad(lambda x, k: jq.dense(x, k, recipe=recipes.mxfp8, name="l")), x[:, :24], kernel)
  with pytest.raises(
    ValueError, match=r"dense 'l' grad_output: rowwise usage.*divisible by its block 16"
  ):
    _trace(
      grad(lambda x, k: jq.dense(x, k, quantizers={"grad_output": NVFP4Quantizer()}, name="l")),
      x,
      kernel[:, :40],
    )
  with pytest.raises(
    ValueError, match=r"dense 'l' input: rowwise usage.*divisible by its block 32"
  ):
    _trace(lambda x, k: jq.dense(x, k, recipe=recipes.mxfp8, name="l"), x[..., :48], kernel[:48])
  # nvfp4 rounds its gradients stochastically: a forward alone needs no key, a backward does.
  _trace(lambda x, k: jq.dense(x, k, recipe=recipes.nvfp4, name="l"), x, kernel)
  with pytest.raises(
    ValueError, match=r"dense 'l' grad_output: .*in the backward pass .*pass a PRNG key"
  ):
    _trace(grad(lambda x, k: jq.dense(x, k, recipe=recipes.nvfp4, name="l")), x, kernel)
  with pytest.raises(ValueError, match=r"roles \['grad_output', 'input', 'weight'\] use delayed"):
    _trace(lambda x, k: jq.dense(x, k, recipe=recipes.fp8_delayed, name="l"), x, kernel)
  with pytest.raises(TypeError, match=r"quantizers\['weight'\]"):
    _trace(lambda x, k: jq.dense(x, k, quantizers={"weight": "fp8"}, name="l"), x, kernel)


@pytest.mark.parametrize("recipe", [recipes.mxfp8, recipes.nvfp4], ids=lambda r: r.name)
@pytest.mark.slow
def test_forward_alone_takes_few_tokens(recipe):
  """Inference with 8 tokens: no columnwise blocks along tokens are needed, so none are
  checked (the forward equals the reference emulation of its two rowwise operands)."""
  _, kernel, _, _ = _data()
  x = jax.random.normal(jax.random.key(3), (8, kernel.shape[0]), kernel.dtype)
  got = jax.jit(lambda x, k: jq.dense(x, k, recipe=recipe, name="l", key=jax.random.key(0)))(
    x, kernel
  )
  qs = {t: recipe.qfactory(QuantizerRole("linear", t, "l")) for t in ("input", "weight")}

  @jax.jit  # one compilation, not one per op of the reference emulation
  def emulated(x, kernel):
    a = reference.quantize(x, qs["input"], ("rowwise",)).rowwise
    b = reference.quantize(kernel.T, qs["weight"], ("rowwise",)).rowwise
    return gemm_ops.reference_gemm(a, b, out_dtype=jnp.float32).astype(x.dtype)

  want = emulated(x, kernel)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_placement_errors():
  x, kernel, _, _ = _data()
  with pytest.raises(ValueError, match="per_token NVFP4 is not allowed for the weight role"):
    _trace(
      lambda x, k: jq.dense(x, k, quantizers={"weight": NVFP4Quantizer(per_token=True)}), x, kernel
    )
  with pytest.raises(ValueError, match="RHT on the input columnwise usage but not on grad_output"):
    _trace(
      lambda x, k: jq.dense(
        x, k, quantizers={"input": NVFP4Quantizer(rht=True), "grad_output": MXFP8Quantizer()}
      ),
      x,
      kernel,
    )
  # Fine when the backward GEMMs do not use the columnwise usages at all.
  _trace(
    lambda x, k: jq.dense(
      x, k, quantizers={"input": NVFP4Quantizer(rht=True)}, backward="high_precision"
    ),
    x,
    kernel,
  )
