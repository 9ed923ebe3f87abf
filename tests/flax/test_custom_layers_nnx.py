"""Swap-in of an NNX model whose GEMMs are its own modules (`x @ self.w[...]`, and
`x @ self.w.value`)."""

import custom_layers as cl
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_transformers as tt
from flax import nnx

import jaxquant.flax as jqf
from jaxquant import recipes

STEPS = 20
TRAINED = [recipes.fp8_current_factory, recipes.mxfp8_factory, recipes.nvfp4_factory]


def windows():
  starts = jax.random.randint(jax.random.key(0), (cl.BATCH, 1), 0, cl.VOCAB)
  return (starts + jnp.arange(cl.SEQ + 1)) % cl.VOCAB


def head_in_bf16(factory):
  """The head layer in bf16, by its role in either model: the stock layer's kernel is
  named by the layer ("head"), the custom layer's `w` by its param ("head/w")."""
  heads = ("head", cl.NNX_HEAD_ROLE)
  return recipes.CustomRecipe(
    lambda role: None if role.name in heads else factory(role), name=factory.__name__
  )


def loss_and_grads(model, data):
  loss = lambda m: tt.xent(m(data[:, :-1]), data)
  return nnx.jit(nnx.value_and_grad(loss))(model)


def test_roles_bf16_identity_and_report():
  data = windows()
  seen = []
  model = jqf.quantize_model(
    cl.NnxCustomLM(nnx.Rngs(0)), recipes.CustomRecipe(lambda role: seen.append(role))
  )
  plain = cl.NnxCustomLM(nnx.Rngs(0))
  loss, grads = loss_and_grads(model, data)
  assert len(seen) == 3 * len(cl.NNX_ROLES)
  assert {(r.name, r.tensor_type) for r in seen} == {
    (n, t) for n in cl.NNX_ROLES for t in ("input", "weight", "grad_output")
  }
  plain_loss, plain_grads = loss_and_grads(plain, data)
  assert loss == plain_loss
  jax.tree.map(
    np.testing.assert_array_equal, nnx.state(grads, nnx.Param), nnx.state(plain_grads, nnx.Param)
  )
  report = jqf.swap_report(
    jqf.quantize_model(cl.NnxCustomLM(nnx.Rngs(0)), head_in_bf16(recipes.mxfp8_factory)),
    data[:, :-1],
  )
  assert [r.role for r in report.quantized] == ["wi/w", "wo/w"]
  assert [(r.role, r.call, r.status) for r in report.high_precision] == [
    ("head/w", "matmul 'abc,cd->abd'", "high precision: the recipe maps it to None")
  ]


@pytest.mark.parametrize("factory", TRAINED, ids=lambda f: f.__name__)
@pytest.mark.slow
def test_trains(factory):
  model = jqf.quantize_model(
    cl.NnxCustomLM(nnx.Rngs(0)), head_in_bf16(factory), rngs=nnx.Rngs(quant=1)
  )
  opt = nnx.Optimizer(model, tt.optimizer(), wrt=nnx.Param)
  step = nnx.jit(lambda m, o, d: _step(m, o, d))
  losses = [float(step(model, opt, windows())) for _ in range(STEPS)]
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < 0.8 * losses[0], losses


def _step(model, optimizer, data):
  loss, grads = nnx.value_and_grad(lambda m: tt.xent(m(data[:, :-1]), data))(model)
  optimizer.update(model, grads)
  return loss


# `.value`, deprecated by Flax 0.12 but still in users' models, must reach the GEMM too.
_VALUE_DEPRECATION = pytest.mark.filterwarnings(
  "ignore:'.value' access is now deprecated:DeprecationWarning"
)


@pytest.mark.parametrize(
  "read_value", [False, pytest.param(True, marks=_VALUE_DEPRECATION)], ids=["w[...]", "w.value"]
)
@pytest.mark.slow
def test_fp8_grads_equal_stock_layers(read_value):
  data = windows()
  recipe = head_in_bf16(recipes.fp8_current_factory)
  stock = jqf.quantize_model(cl.NnxCustomLM(nnx.Rngs(0), stock=True), recipe)
  custom = jqf.quantize_model(cl.NnxCustomLM(nnx.Rngs(1), read_value=read_value), recipe)
  for name in cl.NNX_LAYERS:  # the stock layers' weights in the custom modules
    getattr(custom, name).w.set_value(getattr(stock, name).kernel.get_value())
  custom.embed.embedding.set_value(stock.embed.embedding.get_value())
  _, stock_grads = loss_and_grads(stock, data)
  _, custom_grads = loss_and_grads(custom, data)
  for name in cl.NNX_LAYERS:
    np.testing.assert_array_equal(
      getattr(custom_grads, name).w.get_value(), getattr(stock_grads, name).kernel.get_value()
    )
  _, plain_grads = loss_and_grads(cl.NnxCustomLM(nnx.Rngs(1)), data)
  assert not np.array_equal(custom_grads.wi.w.get_value(), plain_grads.wi.w.get_value())


def test_no_reachable_gemm_raises():
  class Scale(nnx.Module):
    def __init__(self):
      self.s = nnx.Param(jnp.ones((64,)))

    def __call__(self, x):
      return jnp.einsum("bd,cd->bc", x * self.s[...], x)

  with pytest.raises(ValueError, match="require_gemm=False"):
    jqf.quantize_model(Scale(), recipes.mxfp8)(jnp.ones((32, 64)))
  jqf.quantize_model(Scale(), recipes.mxfp8, require_gemm=False)(jnp.ones((32, 64)))
