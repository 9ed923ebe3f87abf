"""grouped_dense against a per-expert loop of `dense`, plus its memory, sharding and errors.

The oracle pads each expert's rows with zeros to a common multiple of every block (64)
and runs `dense` on each expert (vmapped: one compile). Zero rows never raise an amax
and contribute nothing to any GEMM, so this is exactly the grouped block rule
(reference.grouped: each group zero-padded to its block). Inputs are fp32 so that the
only difference left is the fp32 summation order of the emulated GEMMs.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq
from jaxquant import recipes
from jaxquant.ops._grouped_dense import init_grouped_state
from jaxquant.quantizers import HybridQuantizer, NVFP4Quantizer

M, K, N, PAD = 80, 64, 32, 64
SIZES = np.array([0, 1, 33, 17, 0, 19], np.int32)  # empty, single row, not block multiples
G = len(SIZES)


def _no_sr(q):
  """Stochastic rounding off: its random stream is per tensor, so it is compared in
  distribution elsewhere, not bit for bit against per-expert calls."""
  if isinstance(q, NVFP4Quantizer):
    return dataclasses.replace(q, stochastic_rounding=False)
  if isinstance(q, HybridQuantizer):
    return HybridQuantizer(_no_sr(q.rowwise), _no_sr(q.columnwise))
  return q


def _recipe(name):
  base = recipes.get(name)
  return recipes.CustomRecipe(lambda role: _no_sr(base.qfactory(role)), name=name)


def _data(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((M, K)).astype(np.float32)
  x[: SIZES.sum()] *= np.repeat(np.exp2(np.arange(G) * 2.0), SIZES)[
    :, None
  ]  # distinct group ranges
  w = (rng.standard_normal((G, K, N)) * 0.1).astype(np.float32)
  b = rng.standard_normal((G, N)).astype(np.float32)
  dy = rng.standard_normal((M, N)).astype(np.float32)
  return tuple(jnp.asarray(a, dtype) for a in (x, w, b, dy))


def _pad_groups(a):
  starts = np.concatenate([[0], np.cumsum(SIZES)[:-1]])
  out = np.zeros((G, PAD, a.shape[1]), np.float32)
  for g, (s, n) in enumerate(zip(starts, SIZES, strict=False)):
    out[g, :n] = a[s : s + n]
  return jnp.asarray(out, a.dtype)


def _unpad_groups(a, rows):
  out = np.zeros((rows, a.shape[2]), np.float32)
  s = 0
  for g, n in enumerate(SIZES):
    out[s : s + n] = a[g, :n]
    s += n
  return out


def _run_both(recipe):
  quantizers = recipe.quantizers("grouped_linear", "")

  @jax.jit
  def run(x, w, b, dy, xp, dyp):
    y, vjp = jax.vjp(
      lambda x, w, b: jq.grouped_dense(x, w, jnp.asarray(SIZES), b, recipe=recipe), x, w, b
    )
    expert = lambda x, w, b: jq.ops.dense(x, w, b, quantizers=quantizers)
    yo, vjpo = jax.vjp(jax.vmap(expert), xp, w, b)
    return (y,) + vjp(dy), (yo,) + vjpo(dyp)

  x, w, b, dy = _data()
  return run(x, w, b, dy, _pad_groups(np.asarray(x)), _pad_groups(np.asarray(dy)))


@pytest.mark.parametrize("name", ["bf16", "fp8_current", "mxfp8", "nvfp4", "hybrid"])
@pytest.mark.slow
def test_matches_per_expert_dense(name):
  (y, dx, dw, db), (yo, dxo, dwo, dbo) = _run_both(_recipe(name))
  tol = dict(rtol=2e-5, atol=2e-5 * float(np.abs(np.asarray(yo)).max()))
  np.testing.assert_allclose(y, _unpad_groups(np.asarray(yo), M), **tol)
  np.testing.assert_allclose(dx, _unpad_groups(np.asarray(dxo), M), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(dw, dwo, rtol=2e-5, atol=2e-5 * float(np.abs(np.asarray(dwo)).max()))
  np.testing.assert_allclose(db, dbo, rtol=1e-6, atol=1e-6)
  tail = int(SIZES.sum())
  assert not np.any(np.asarray(y[tail:])) and not np.any(np.asarray(dx[tail:]))
  assert not np.any(np.asarray(dw)[SIZES == 0]) and not np.any(np.asarray(db)[SIZES == 0])


def _temp_bytes(num_groups, rows=2048, k=64, n=64):
  sizes = jnp.full((num_groups,), rows // num_groups, jnp.int32)

  def loss(x, w):
    return jnp.sum(jq.grouped_dense(x, w, sizes, recipe=recipes.bf16) ** 2)

  x = jax.ShapeDtypeStruct((rows, k), jnp.float32)
  w = jax.ShapeDtypeStruct((num_groups, k, n), jnp.float32)
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_temp_memory_does_not_grow_with_groups():
  one, many = _temp_bytes(1), _temp_bytes(64)
  weight_bytes = 64 * 64 * 64 * 4  # the [G, K, N] fp32 kernel and its gradient scale with G
  masked_copy = 64 * 2048 * 64 * 4  # one G-fold masked copy of x, what ragged_dot builds on CPU
  assert many <= one + 4 * weight_bytes, (one, many)
  assert many < masked_copy / 8, (one, many)


def test_jit_with_rows_sharded_over_devices():
  devices = jax.devices()
  if len(devices) < 8:
    pytest.skip("needs 8 (fake CPU) devices; tests/conftest.py sets XLA_FLAGS")
  mesh = jax.sharding.Mesh(np.array(devices[:8]), ("data",))
  x, w, b, dy = _data()
  sizes = jnp.asarray(SIZES)
  xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))

  def loss(x, w, sizes):
    return jnp.sum(jq.grouped_dense(x, w, sizes, recipe=recipes.bf16) * dy)

  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  (v, (dx, dw)), (v0, (dx0, dw0)) = f(xs, w, sizes), f(x, w, sizes)
  np.testing.assert_allclose(v, v0, rtol=1e-5)
  np.testing.assert_allclose(dx, dx0, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, dw0, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", ["bf16", "fp8_current"])
def test_jit_with_experts_sharded_over_devices(name):
  """Expert parallelism's layout: the [G, K, N] kernel sharded over its expert axis (and
  the rows over the same devices); the results are one device's."""
  devices = jax.devices()
  if len(devices) < 2:
    pytest.skip("needs 2 (fake CPU) devices; tests/conftest.py sets XLA_FLAGS")
  mesh = jax.sharding.Mesh(np.array(devices[:2]), ("expert",))
  x, w, b, dy = _data()
  sizes = jnp.asarray(SIZES)
  recipe = recipes.get(name)

  def loss(x, w, b, sizes):
    return jnp.sum(jq.grouped_dense(x, w, sizes, b, recipe=recipe).astype(jnp.float32) * dy)

  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  ws = jax.device_put(w, NamedSharding(mesh, P("expert", None, None)))
  bs = jax.device_put(b, NamedSharding(mesh, P("expert", None)))
  xs = jax.device_put(x, NamedSharding(mesh, P("expert", None)))
  (v, grads), (v0, grads0) = f(xs, ws, bs, sizes), f(x, w, b, sizes)
  np.testing.assert_allclose(v, v0, rtol=1e-5)
  for g, g0 in zip(grads, grads0, strict=True):
    np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-5 * float(np.abs(np.asarray(g0)).max()))


def test_bf16_dtypes_and_traced_sizes():
  x, w, b, dy = _data(jnp.bfloat16)
  f = jax.jit(lambda x, w, b, s: jq.grouped_dense(x, w, s, b))
  y = f(x, w, b, jnp.asarray(SIZES))
  assert y.dtype == jnp.bfloat16 and y.shape == (M, N)
  ref = np.concatenate(
    [
      np.asarray(x[s : s + n], np.float32) @ np.asarray(w[g], np.float32)
      + np.asarray(b[g], np.float32)
      for g, (s, n) in enumerate(zip(np.cumsum(SIZES) - SIZES, SIZES, strict=False))
    ]
  )
  np.testing.assert_allclose(np.asarray(y[: len(ref)], np.float32), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
  "args, error, match",
  [
    (dict(sizes=np.array([1, 2], np.int32)), ValueError, "group_sizes must have shape"),
    (dict(sizes=np.ones(G, np.float32)), TypeError, "integer"),
    (dict(sizes=np.full(G, 20, np.int32)), ValueError, "more than the 80 rows"),
    (dict(sizes=np.array([-1, 0, 0, 0, 0, 0], np.int32)), ValueError, ">= 0"),
    (dict(w=np.zeros((K, N), np.float32)), ValueError, "rank 3"),
    (dict(b=np.zeros((N,), np.float32)), ValueError, r"\[G, N\]"),
  ],
)
def test_bad_input_raises(args, error, match):
  x, w, b, _ = _data()
  with pytest.raises(error, match=match):
    jq.grouped_dense(x, args.get("w", w), args.get("sizes", SIZES), args.get("b", b))


def test_tiles_on_activations_rejected():
  x, w, _, _ = _data()
  r = recipes.CustomRecipe(lambda role: NVFP4Quantizer(tile_2d=True), name="tiles")
  with pytest.raises(ValueError, match="2-D tiles are allowed for grouped weights only"):
    jq.grouped_dense(x, w, SIZES, recipe=r)


def test_delayed_state_is_per_group():
  x, w, _, dy = _data()
  qs = recipes.fp8_delayed.quantizers("grouped_linear", "")
  state = init_grouped_state(qs, G)
  assert state["input"].amax_history.shape == (G, 1024)

  def loss(x, state):
    y, new_state = jq.grouped_dense(x, w, SIZES, recipe=recipes.fp8_delayed, state=state)
    return jnp.sum(y * dy), new_state

  (_, new_state), grads = jax.jit(jax.value_and_grad(loss, argnums=1, has_aux=True))(x, state)
  starts = np.cumsum(SIZES) - SIZES
  expect = [
    np.abs(np.asarray(x[s : s + n])).max() if n else 0.0
    for s, n in zip(starts, SIZES, strict=False)
  ]
  np.testing.assert_array_equal(new_state["input"].amax_history[:, 0], np.float32(expect))
  dy_amax = [
    np.abs(np.asarray(dy[s : s + n])).max() if n else 0.0
    for s, n in zip(starts, SIZES, strict=False)
  ]
  np.testing.assert_array_equal(grads["grad_output"].amax_history[:, 0], np.float32(dy_amax))


@pytest.mark.gpu
@pytest.mark.skipif(not jq.kernels.available(), reason=f"{jq.kernels.unavailable_reason()}")
@pytest.mark.parametrize("name", ["bf16", "fp8_current", "mxfp8", "nvfp4"])
def test_kernel_path_matches_reference(name, monkeypatch):
  """On Hopper, fprop, dgrad and wgrad run on the CUTLASS grouped kernels: the same products
  as the reference, summed in another order."""
  recipe = _recipe(name)
  dtype = jnp.bfloat16 if name == "bf16" else jnp.float32  # bf16 recipe: exact in bf16 only
  rng = np.random.default_rng(1)
  sizes = jnp.asarray([0, 700, 33, 1291, 0, 24], jnp.int32)
  m, k, n, g = 2176, 256, 512, 6
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  w = jnp.asarray(rng.standard_normal((g, k, n)) * 0.1, dtype)
  dy = jnp.asarray(rng.standard_normal((m, n)), dtype)

  def grads(x, w, dy):
    y, vjp = jax.vjp(lambda x, w: jq.grouped_dense(x, w, sizes, recipe=recipe), x, w)
    return (y,) + vjp(dy)

  lowered = jax.jit(grads).lower(x, w, dy).as_text()
  assert lowered.count("jaxquant_grouped_gemm(") >= 2, "fprop and dgrad must use the kernel"
  assert "jaxquant_grouped_wgrad(" in lowered, "wgrad must use the kernel"
  got = jax.jit(grads)(x, w, dy)
  monkeypatch.setenv("JAXQUANT_BACKEND", "reference")
  want = jax.jit(grads)(x, w, dy)
  # Normwise relative error: bf16 results are one rounding apart; FP8 x FP8 runs on FP8
  # tensor cores, whose accumulation is not fp32-exact (tests/kernels/test_grouped_gemm.py).
  tol = {"bf16": 2.0**-8, "fp8_current": 2.0**-12}.get(name, 1e-5)
  for what, a, b in zip(("y", "dx", "dw"), got, want, strict=False):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.linalg.norm(a - b) <= tol * np.linalg.norm(b), what
