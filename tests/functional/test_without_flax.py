"""A plain JAX program quantizes, trains a step and reports without Flax ever imported."""

import json
import pathlib
import subprocess
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_PROGRAM = """
import json, sys
import jax, jax.numpy as jnp
import jaxquant
from jaxquant import functional as jqfn

def mlp(params, x):
  return jax.nn.relu(x @ params["w_in"]) @ params["w_out"]

params = {"w_in": jnp.ones((64, 64)) / 64, "w_out": jnp.ones((64, 64)) / 64}
x = jnp.ones((32, 64))
qfn = jaxquant.quantize(mlp, "fp8_delayed")
state = qfn.init(params, x)
def loss(params, state):
  out, new_state = qfn.apply(params, x, state=state)
  return jnp.sum(out), new_state

grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
(_, new_state), (_, state_grads) = grad(params, state)
state = jqfn.update_quant_state(new_state, state_grads)
rows = jqfn.swap_report(qfn, params, x, state=state).quantized
print(json.dumps({"flax": sorted(m for m in sys.modules if m == "flax" or m.startswith("flax.")),
                  "roles": [r.role for r in rows]}))
"""


def test_quantize_runs_without_flax():
  out = subprocess.run(
    [sys.executable, "-c", _PROGRAM], cwd=_ROOT, capture_output=True, text=True, check=True
  )
  found = json.loads(out.stdout.strip().splitlines()[-1])
  assert found == {"flax": [], "roles": ["w_in", "w_out"]}
