"""A quantized function among JAX's transformations: the interception happens while it
is traced, so `jit`, `grad`, `value_and_grad`, `vmap`, `checkpoint`, `lax.scan` and sharded
inputs take it as any function, and threads trace it at once."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant
from jaxquant import functional as jqfn

ROWS, D, FF = 32, 64, 128


def mlp(params, x):
  return jax.nn.gelu(x @ params["w_in"]) @ params["w_out"]


@pytest.fixture(scope="module")
def params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w_in": jax.random.normal(k1, (D, FF)) / 8, "w_out": jax.random.normal(k2, (FF, D)) / 11}


def inputs(*shape, seed=1):
  return jax.random.normal(jax.random.key(seed), shape or (ROWS, D))


def loss(fn):
  return lambda params, x: jnp.sum(jnp.square(fn(params, x)))


def test_jit_grad_and_value_and_grad_agree(params):
  qfn, x = jaxquant.quantize(mlp, "fp8_current"), inputs()
  value, grads = jax.jit(jax.value_and_grad(loss(qfn)))(params, x)
  jax.tree.map(np.testing.assert_array_equal, jax.jit(jax.grad(loss(qfn)))(params, x), grads)
  np.testing.assert_array_equal(jax.jit(loss(qfn))(params, x), value)
  assert not np.array_equal(value, loss(mlp)(params, x))  # quantized for real


def test_vmap_over_examples_is_one_gemm_of_all_their_rows(params):
  qfn, x = jaxquant.quantize(mlp, "mxfp8"), inputs(4, ROWS, D)
  batched = jax.jit(jax.vmap(qfn, in_axes=(None, 0)))(params, x)
  rows = jax.jit(qfn)(params, x.reshape(-1, D)).reshape(batched.shape)
  np.testing.assert_array_equal(batched, rows)


def test_checkpoint_changes_nothing(params):
  qfn, x = jaxquant.quantize(mlp, "fp8_current"), inputs()
  grads = jax.jit(jax.grad(loss(jax.checkpoint(qfn))))(params, x)
  jax.tree.map(np.testing.assert_array_equal, grads, jax.jit(jax.grad(loss(qfn)))(params, x))

  def remat_inside(params, x):  # the function's own checkpoint, over a closure of the params
    return jax.checkpoint(lambda x: mlp(params, x))(x)

  inside = jaxquant.quantize(remat_inside, "fp8_current")
  assert [r.role for r in jqfn.swap_report(inside, params, x).quantized] == ["w_in", "w_out"]
  jax.tree.map(np.testing.assert_array_equal, jax.jit(jax.grad(loss(inside)))(params, x), grads)


def test_a_checkpoint_handed_the_params_threads_the_state_through(params):
  """`jax.checkpoint(mlp)(params, x)` inside the function: the params are the checkpointed
  function's own arguments, its delayed-scaling states go in and come back out."""
  x = inputs()

  def step(qfn):
    def loss_fn(params, state):
      out, new_state = qfn.apply(params, x, state=state)
      return jnp.sum(jnp.square(out)), new_state

    return jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))

  remat = jaxquant.quantize(lambda params, x: jax.checkpoint(mlp)(params, x), "fp8_delayed")
  plain = jaxquant.quantize(mlp, "fp8_delayed")
  state = remat.init(params, x)
  assert sorted(state) == ["w_in", "w_out"]
  got, want = step(remat)(params, state), step(plain)(params, state)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  (_, new_state), (_, state_grads) = got
  assert float(state_grads["w_out"]["grad_output"].scaling.amax_history[0]) > 0  # recorded


def test_scan_over_calls_is_each_call(params):
  qfn, xs = jaxquant.quantize(mlp, "fp8_current"), inputs(3, ROWS, D)
  _, scanned = jax.jit(lambda p, xs: jax.lax.scan(lambda c, x: (c, qfn(p, x)), 0, xs))(params, xs)
  for x, out in zip(xs, scanned, strict=True):
    np.testing.assert_array_equal(out, jax.jit(qfn)(params, x))


def test_sharded_rows_give_the_unsharded_output(params, eight_devices):
  """Rows sharded over eight devices: the output bit for bit (each tensor's amax is the
  all-reduced max); the gradients to fp32 rounding (the weight gradient's sum over the
  rows is summed per shard, then across them)."""
  mesh = jax.sharding.Mesh(np.array(eight_devices), ("data",))
  qfn, x = jaxquant.quantize(mlp, "fp8_current"), inputs(8 * ROWS, D)
  sharded_params = jax.device_put(params, NamedSharding(mesh, P()))
  sharded_x = jax.device_put(x, NamedSharding(mesh, P("data")))
  out = jax.jit(qfn)(sharded_params, sharded_x)
  assert out.sharding.spec == P("data")
  np.testing.assert_array_equal(out, jax.jit(qfn)(params, x))
  grad = jax.jit(jax.grad(loss(qfn)))
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max()),
    grad(sharded_params, sharded_x),
    grad(params, x),
  )


def test_threads_tracing_at_once_get_their_own_recipes(params):
  """Two recipes' functions traced and run in two threads at once, each thread gated
  inside its trace until the other is in its own: each gets what it gets alone."""
  x = inputs()
  recipes = ("fp8_current", "mxfp8")
  alone = {r: jax.jit(jaxquant.quantize(mlp, r))(params, x) for r in recipes}
  assert not np.array_equal(*alone.values())
  barrier = threading.Barrier(2, timeout=120)

  def gated(params, x):
    h = x @ params["w_in"]
    barrier.wait()  # both threads inside their routing at once
    return jax.nn.gelu(h) @ params["w_out"]

  results, failures = {}, []

  def run(recipe):
    try:
      for _ in range(2):  # two fresh traces each
        results[recipe] = jax.jit(jaxquant.quantize(gated, recipe))(params, x)
    except BaseException as failure:  # reported to the test's thread
      failures.append(failure)
      barrier.abort()

  threads = [threading.Thread(target=run, args=(r,)) for r in recipes]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(180)
    assert not thread.is_alive()
  assert not failures, failures
  for recipe in recipes:
    np.testing.assert_array_equal(results[recipe], alone[recipe])


def test_jax_is_left_as_it_was(params):
  """The entry points a call routes (contractions, `lax.scan`, `jax.checkpoint`) are JAX's
  own again once it returns."""
  entry_points = lambda: (
    jax.lax.scan,
    jax.checkpoint,
    jax.remat,
    jnp.matmul,
    jnp.einsum.__code__,
    vars(jax.core.Tracer).get("__matmul__"),
  )
  before = entry_points()

  def looped(params, x):  # a scan over a checkpointed block, the params closed over
    body = lambda x, _: (jax.checkpoint(mlp)(params, x), None)
    return jax.lax.scan(body, x, None, length=2)[0]

  qfn = jaxquant.quantize(looped, "fp8_current")
  assert [r.role for r in jqfn.swap_report(qfn, params, inputs()).quantized] == ["w_in", "w_out"]
  jax.jit(qfn)(params, inputs())
  assert entry_points() == before
