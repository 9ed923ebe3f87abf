"""jaxquant.dense under jit, grad, vmap, jax.checkpoint, SR key splitting and a mesh of 8
CPU devices (tests/conftest.py forces 8 host devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq
from jaxquant.quantizers import Float8Quantizer, MXFP8Quantizer, NVFP4Quantizer

B, S, K, N = 8, 8, 64, 32  # M = 64
Q = {"input": MXFP8Quantizer(), "weight": Float8Quantizer(), "grad_output": Float8Quantizer("e5m2")}


def _data():
  ks = jax.random.split(jax.random.key(0), 3)
  return (
    jax.random.normal(ks[0], (B, S, K)),
    jax.random.normal(ks[1], (K, N)) / 8,
    jax.random.normal(ks[2], (N,)),
  )


def _loss(x, kernel, bias):
  y = jq.dense(x, kernel, bias, quantizers=Q, name="t")
  return jnp.sum(jnp.sin(y))


_grad = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)))


def _assert_trees_equal(a, b):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=False):
    np.testing.assert_array_equal(u, v)


@pytest.mark.slow  # over 10 s: run under the newest JAX only
def test_vmap_matches_a_loop():
  x, kernel, bias = _data()
  xs = jnp.stack([x, 2 * x])
  grads = jax.jit(jax.vmap(jax.grad(_loss, argnums=(0, 1, 2)), in_axes=(0, None, None)))(
    xs, kernel, bias
  )
  for i in range(2):  # batched dots may accumulate in another order: fp32 tolerance
    for g, w in zip(grads, _grad(xs[i], kernel, bias), strict=False):
      np.testing.assert_allclose(g[i], w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["save_residuals", "nothing_saveable"])
def test_checkpoint_policies(policy, capsys):
  x, kernel, bias = _data()
  pol = (
    jq.remat_policy() if policy == "save_residuals" else jax.checkpoint_policies.nothing_saveable
  )
  remat = jax.checkpoint(_loss, policy=pol)
  _assert_trees_equal(
    jax.jit(jax.grad(remat, argnums=(0, 1, 2)))(x, kernel, bias), _grad(x, kernel, bias)
  )
  jax.ad_checkpoint.print_saved_residuals(remat, x, kernel, bias)
  saved = capsys.readouterr().out
  if policy == "save_residuals":
    # The quantized columnwise x (MXFP8 data stored [K, M]) and w (FP8 [K, N]) are kept ...
    assert f"f8_e4m3fn[{K},{B * S}]" in saved and f"f8_e4m3fn[{K},{N}]" in saved
    assert all(f"jaxquant.{role}_codes" in saved for role in ("input", "weight"))
  # ... and never the high-precision x.
  assert f"f32[{B * S},{K}]" not in saved and f"f32[{K},{B * S}]" not in saved


def test_stochastic_rounding_keys():
  x, kernel, _ = _data()
  q = {"grad_output": NVFP4Quantizer(stochastic_rounding=True)}

  @jax.jit
  def dkernel(key):
    return jax.grad(lambda k: jnp.sum(jnp.sin(jq.dense(x, k, quantizers=q, key=key))))(kernel)

  a, b, c = dkernel(jax.random.key(1)), dkernel(jax.random.key(1)), dkernel(jax.random.key(2))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


@pytest.mark.parametrize("kernel_spec", [P(), P(None, "d")], ids=["replicated", "sharded_N"])
def test_sharded_matches_unsharded(kernel_spec, eight_devices):
  x, kernel, bias = _data()
  mesh = Mesh(np.array(eight_devices), ("d",))
  shard = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  bias_spec = P("d") if kernel_spec != P() else P()
  got = _grad(shard(x, P("d")), shard(kernel, kernel_spec), shard(bias, bias_spec))
  want = _grad(x, kernel, bias)
  assert got[0].sharding.spec[0] == "d"
  for g, w in zip(got, want, strict=False):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
