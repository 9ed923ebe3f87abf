"""An independent fake-quant model of `jaxquant.dense`: quantize -> dequantize, then
plain fp32 jnp matmuls, with the three GEMMs written out by hand."""

import jax
import jax.numpy as jnp

from jaxquant import reference
from jaxquant.quantizers import for_usage, needs_key, needs_state

ROLE_INDEX = {"input": 0, "weight": 1, "grad_output": 2}  # the documented key split


def _hi(a, b):
  return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def fake(matrix, quantizer, usage, tensor_type, key=None, state=None):
  """One usage of a logical 2-D matrix, quantized and dequantized to fp32 (logical layout)."""
  if for_usage(quantizer, usage) is None:
    return matrix.astype(jnp.float32)
  k = jax.random.fold_in(key, ROLE_INDEX[tensor_type]) if needs_key(quantizer) else None
  out = reference.quantize(
    matrix, quantizer, (usage,), key=k, state=state if needs_state(quantizer) else None
  )
  qt = out[0] if needs_state(quantizer) else out
  return reference.dequantize(qt, usage, jnp.float32)


def dense_and_grads(x, kernel, bias, dy, quantizers, backward="quantized", key=None, state=None):
  """(y, dx, dkernel, dbias) of the fake-quant linear layer for cotangent dy."""
  state = state or {}
  m, k = x.size // x.shape[-1], x.shape[-1]
  x2d, w, dy2d = x.reshape(m, k), kernel.T, dy.reshape(m, -1)
  qx, qw, qg = quantizers["input"], quantizers["weight"], quantizers["grad_output"]
  x_r = fake(x2d, qx, "rowwise", "input", key, state.get("input"))
  w_r = fake(w, qw, "rowwise", "weight", key, state.get("weight"))
  y = _hi(x_r, w_r.T)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  if backward == "quantized":
    dy_r = fake(dy2d, qg, "rowwise", "grad_output", key, state.get("grad_output"))
    dy_c = fake(dy2d, qg, "columnwise", "grad_output", key, state.get("grad_output"))
    w_c = fake(w, qw, "columnwise", "weight", key, state.get("weight"))
    x_c = fake(x2d, qx, "columnwise", "input", key, state.get("input"))
  elif backward == "high_precision":
    dy_r = dy_c = dy2d.astype(jnp.float32)
    w_c, x_c = w.astype(jnp.float32), x2d.astype(jnp.float32)
  else:  # dequantized forward values
    dy_r = dy_c = dy2d.astype(jnp.float32)
    w_c, x_c = w_r, x_r
  dx = _hi(dy_r, w_c)
  dkernel = _hi(x_c.T, dy_c)
  dbias = None if bias is None else jnp.sum(dy2d.astype(jnp.float32), axis=0).astype(bias.dtype)
  return (
    y.astype(x.dtype).reshape(*x.shape[:-1], -1),
    dx.astype(x.dtype).reshape(x.shape),
    dkernel.astype(kernel.dtype),
    dbias,
  )


def rel_err(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))
