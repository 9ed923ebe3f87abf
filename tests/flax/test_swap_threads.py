"""The swap-in under threads: a quantized model's contractions are routed in its own
thread only, whichever thread opened routing first and whether it opened it inside a trace,
and nothing of the swap-in stays on JAX's classes and modules once every model is done."""

import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxquant.flax as jqf
from jaxquant import recipes
from jaxquant.intercept import _interception as interception
from jaxquant.intercept._targets import ContractionTarget

D, FF, BATCH = 64, 128, 32
ITERATIONS = 10
TIMEOUT_S = 120


class MatmulLayer(nn.Module):
  """A model's own GEMM layer: its weight, contracted by `@`."""

  features: int

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.05), (x.shape[-1], self.features))
    return x @ w


class Gate(threading.local):
  """Called while the model's routing is open; in a thread that armed it, runs `inside`."""

  inside = None

  def __call__(self):
    if self.inside is not None:
      self.inside()


class CustomMLP(nn.Module):
  gate: object = None

  @nn.compact
  def __call__(self, x):
    h = jax.nn.relu(MatmulLayer(FF)(x))
    if self.gate is not None:
      self.gate()
    return MatmulLayer(D)(h)


class StockMLP(nn.Module):
  """A stock layer, then the model's own `@`."""

  @nn.compact
  def __call__(self, x):
    return MatmulLayer(D)(jax.nn.relu(nn.Dense(FF, use_bias=False)(x)))


class NnxMLP(nnx.Module):
  def __init__(self, rngs):
    self.wi = nnx.Param(jax.random.normal(rngs.params(), (D, FF)) * 0.05)
    self.wo = nnx.Param(jax.random.normal(rngs.params(), (FF, D)) * 0.05)

  def __call__(self, x):
    return jax.nn.relu(x @ self.wi[...]) @ self.wo[...]


def inputs():
  return jax.random.normal(jax.random.key(1), (BATCH, D), jnp.float32)


def linen_params(model, x):
  return jax.jit(model.init)(jax.random.key(0), x)


def jax_namespaces():
  """JAX's classes and modules the swap-in patches, and every Tracer subclass."""
  tracers, pending = [], [jax.core.Tracer]
  while pending:
    cls = pending.pop()
    tracers.append(cls)
    pending.extend(cls.__subclasses__())
  return (*tracers, type(jnp.zeros(())), jax.Array, jnp, jax.lax)


def vars_of(namespaces):
  return [(namespace, dict(vars(namespace))) for namespace in namespaces]


def run_threads(*workloads, barriers=()):
  """Runs each workload in a thread of its own; re-raises the first failure. A failure
  breaks `barriers`, so that the other threads stop too."""
  failures = []

  def run(workload):
    try:
      workload()
    except BaseException as failure:  # reported to the test's thread
      failures.append(failure)
      for barrier in barriers:
        barrier.abort()

  threads = [threading.Thread(target=run, args=(w,)) for w in workloads]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(TIMEOUT_S)
    assert not thread.is_alive(), "a workload thread hangs"
  if failures:
    raise failures[0]


def test_an_eager_model_is_quantized_while_another_thread_traces_one():
  # Routing opened first inside a trace (the gated model) must still route the concrete
  # arrays' `@` of an eager model in another thread.
  x = inputs()
  model = jqf.quantize_model(CustomMLP(), recipes.fp8_current)
  params = linen_params(model, x)
  expected = model.apply(params, x)
  assert not np.array_equal(expected, CustomMLP().apply(params, x))  # quantized for real
  gate = Gate()
  gated = jqf.quantize_model(CustomMLP(gate), recipes.mxfp8)
  opened, released = threading.Event(), threading.Event()

  def trace():
    def inside():
      opened.set()
      assert released.wait(TIMEOUT_S)

    gate.inside = inside
    return jax.eval_shape(gated.apply, params, x)

  def run_eagerly():
    assert opened.wait(TIMEOUT_S)
    try:
      np.testing.assert_array_equal(model.apply(params, x), expected)
    finally:
      released.set()

  run_threads(trace, run_eagerly)


def test_jax_classes_and_modules_are_left_as_they_were():
  x = inputs()
  model = jqf.quantize_model(CustomMLP(), recipes.fp8_current)
  params = model.init(jax.random.key(0), x)  # routing opened outside any trace only
  namespaces = jax_namespaces()
  before = vars_of(namespaces)
  # Routing opened inside traces (traced only: jit's, grad's, vmap's tracers)...
  jax.make_jaxpr(model.apply)(params, x)
  jax.make_jaxpr(jax.grad(lambda p: model.apply(p, x).sum()))(params)
  jax.make_jaxpr(jax.vmap(model.apply, in_axes=(None, 0)))(params, x[None])
  # ... outside any, and inside a trace while a context opened outside is open.
  nested = jqf.quantize_model(CustomMLP(gate=lambda: jax.make_jaxpr(model.apply)(params, x)), None)
  nested.apply(params, x)
  assert vars_of(namespaces) == before
  assert jax_namespaces() == namespaces
  # Every tracer class takes `@` from Tracer: routing patches it there only.
  tracers = [c for c in namespaces if isinstance(c, type) and issubclass(c, jax.core.Tracer)]
  assert [c for c in tracers if {"__matmul__", "__rmatmul__"} & set(vars(c))] == [jax.core.Tracer]


def test_a_dispatcher_set_on_an_inherited_attribute_is_deleted_again():
  class Base:
    def __matmul__(self, other):
      return "base"

  class Sub(Base):
    pass

  before = dict(vars(Sub))
  patch = interception._Patch.apply(ContractionTarget(Sub, "__matmul__", "matmul", "left"))
  assert "__matmul__" in vars(Sub)
  assert Sub() @ Sub() == "base"  # no context open in this thread: the original
  patch.undo()
  assert dict(vars(Sub)) == before


def test_threads_mixing_quantized_plain_eager_and_jitted_models_get_their_own_results():
  x = inputs()
  fp8 = jqf.quantize_model(CustomMLP(), recipes.fp8_current)
  mx = jqf.quantize_model(StockMLP(), recipes.mxfp8)
  params = linen_params(fp8, x)
  stock_params = linen_params(mx, x)
  mx_jit = jax.jit(mx.apply)
  plain_jit = jax.jit(CustomMLP().apply)
  nnx_model = jqf.quantize_model(NnxMLP(nnx.Rngs(0)), recipes.fp8_current)
  nnx_plain = NnxMLP(nnx.Rngs(0))
  gate = Gate()
  gated = {
    r.name: jqf.quantize_model(CustomMLP(gate), r) for r in (recipes.fp8_current, recipes.mxfp8)
  }

  # Each workload: what it computes, compared with its value computed with no other thread.
  workloads = {
    "fp8 eager custom": lambda: fp8.apply(params, x),
    "mxfp8 jitted stock": lambda: mx_jit(stock_params, x),
    "mxfp8 traced stock": lambda: str(jax.make_jaxpr(mx.apply)(stock_params, x)),
    "fp8 report": lambda: str(jqf.swap_report(fp8, params, x)),
    "mxfp8 eager stock": lambda: mx.apply(stock_params, x),
    "plain eager custom": lambda: CustomMLP().apply(params, x),
    "plain jitted custom": lambda: plain_jit(params, x),
    "fp8 eager nnx": lambda: nnx_model(x),
    "plain eager nnx": lambda: nnx_plain(x),
  }
  # A traced model whose trace, with its routing open, waits for the other threads'
  # calls: opened first, inside a trace, it is open during every other call of the round.
  traced = {name: lambda m=m: str(jax.make_jaxpr(m.apply)(params, x)) for name, m in gated.items()}
  expected = {name: compute() for name, compute in {**workloads, **traced}.items()}
  assert not np.array_equal(expected["fp8 eager custom"], expected["plain eager custom"])
  assert not np.array_equal(expected["fp8 eager nnx"], expected["plain eager nnx"])
  names, traced_names = list(workloads), list(traced)
  threads = 5
  start, opened, done = (threading.Barrier(threads, timeout=TIMEOUT_S) for _ in range(3))

  def check(name, got):
    if isinstance(got, str):
      assert got == expected[name], name
    else:
      np.testing.assert_array_equal(got, expected[name], err_msg=name)

  def worker(index):
    def work():
      for iteration in range(ITERATIONS):
        start.wait()
        if index == iteration % threads:  # this round's tracer
          name = traced_names[iteration % len(traced_names)]
          gate.inside = lambda: (opened.wait(), done.wait())
          check(name, traced[name]())
          gate.inside = None
        else:
          opened.wait()
          name = names[(index + iteration * threads) % len(names)]
          check(name, workloads[name]())
          done.wait()

    return work

  run_threads(*(worker(i) for i in range(threads)), barriers=(start, opened, done))


@pytest.mark.parametrize("opened_in_trace", [True, False])
def test_a_dispatcher_called_while_the_last_context_closes_runs_the_original(opened_in_trace):
  # A thread with no context of its own calls the routed `@` over and over while another
  # thread opens and closes routing: every call must give the plain product.
  x = inputs()
  w = jax.random.normal(jax.random.key(2), (D, FF))
  plain = np.asarray(x @ w)
  model = jqf.quantize_model(CustomMLP(), recipes.fp8_current)
  params = linen_params(model, x)
  if opened_in_trace:
    run_model = lambda: jax.make_jaxpr(model.apply)(params, x)
  else:
    run_model = lambda: model.apply(params, x)
  done = threading.Event()

  def open_and_close():
    try:
      for _ in range(ITERATIONS):
        run_model()
    finally:
      done.set()

  def multiply():
    calls = 0
    while not done.is_set() or calls == 0:
      np.testing.assert_array_equal(x @ w, plain)
      calls += 1

  run_threads(open_and_close, multiply)
