"""The MXFP8 and NVFP4 values primitives (kernels.gemm_values): their reference lowerings
against a NumPy oracle (codes and scales from tests/reference's oracles, their products
rounded to fp32 and then to bf16), one device against eight and vmap, their input checks,
and on a Hopper GPU the kernels bit for bit against the dequantize kernel's values of the
cast kernel's codes."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from kernel_cases import QUANTIZERS, SR_QUANTIZERS, assert_same_bits, edge_input, random_input

from jaxquant import kernels
from jaxquant.kernels._gemm_values import ScaledValues, mxfp8_values, nvfp4_values
from jaxquant.quantizers import MXFP8Quantizer, NVFP4Quantizer

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "reference"))
import numpy_oracle as orc  # noqa: E402
from ref_cases import oracle_usage  # noqa: E402

on_gpu = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}")
USAGES = ("rowwise", "columnwise")
DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


def oracle(x, element: str) -> dict:
  """{usage: bf16 values} from the NumPy MXFP8 oracle: code * 2^(e - 127), exact in
  float64, rounded to fp32 (as the dequantize kernel multiplies) and then to bf16."""
  x32 = np.asarray(jnp.asarray(x, jnp.float32))
  out = {}
  for usage, stored in (("rowwise", x32), ("columnwise", np.ascontiguousarray(x32.T))):
    q = orc.mxfp8(stored, element)
    codes = orc.fp8_decode(q["data"], element).astype(np.float64)
    e = orc.expand(q["scale"].astype(np.int64), (1, 32), stored.shape)
    with np.errstate(all="ignore"):
      values = np.where(e == 0xFF, np.nan, codes * np.exp2(e - 127.0)).astype(np.float32)
    out[usage] = values.astype(ml_dtypes.bfloat16)
  return out


def cpu(x):
  return jax.device_put(x, jax.devices("cpu")[0])


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dt", sorted(DTYPES))
def test_reference_lowering_matches_oracle(element, dt):
  run = jax.jit(lambda x: mxfp8_values(x, MXFP8Quantizer(element), USAGES))
  for name, x in (
    ("random", random_input(3, (96, 160), DTYPES[dt])),
    ("edges", edge_input((64, 128), DTYPES[dt], nan=True, inf=True)),
  ):
    got = run(cpu(x))
    want = oracle(x, element)
    for usage in USAGES:
      assert_same_bits(got[usage], want[usage], f"{name} {element} {dt} {usage}")


def test_one_device_eight_devices_and_vmap(eight_devices):
  x = random_input(5, (256, 512), jnp.bfloat16)
  run = jax.jit(lambda x: mxfp8_values(x, MXFP8Quantizer(), USAGES))
  want = run(cpu(x))
  mesh = Mesh(np.array(eight_devices).reshape(2, 4), ("data", "model"))
  for spec in (P("data", "model"), P(("data", "model"), None), P(None, "model")):
    got = run(jax.device_put(x, NamedSharding(mesh, spec)))
    assert_same_bits(got, want, f"sharded {spec}")
  stacked = jnp.stack([x[:, :256], x[:, 256:]])
  got = jax.vmap(lambda t: mxfp8_values(t, MXFP8Quantizer(), ("rowwise",))["rowwise"])(stacked)
  assert_same_bits(got[1], run(cpu(x[:, 256:]))["rowwise"], "vmap")


def test_rejects_bad_input():
  x = jnp.ones((64, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="casts MXFP8 only, got NVFP4Quantizer"):
    mxfp8_values(x, NVFP4Quantizer(), USAGES)
  with pytest.raises(ValueError, match=r"both dims of the \[64, 48\] matrix divisible by 32"):
    mxfp8_values(x[:, :48], MXFP8Quantizer(), USAGES)
  with pytest.raises(ValueError, match=r"a 2-D matrix, got shape \(2, 32, 64\)"):
    mxfp8_values(x.reshape(2, 32, 64), MXFP8Quantizer(), USAGES)
  with pytest.raises(ValueError, match="takes bfloat16, float16 or float32 input, got int8"):
    mxfp8_values(x.astype(jnp.int8), MXFP8Quantizer(), USAGES)
  with pytest.raises(ValueError, match="usages must be among rowwise, columnwise"):
    mxfp8_values(x, MXFP8Quantizer(), ("both",))


# ---- NVFP4 ----

# Every NVFP4 cast the values kernel takes: 1-D blocks and 16x16 tiles, RHT on the
# columnwise usage, stochastic rounding (per_token is refused).
NVFP4_CASES = {
  name: q
  for name, q in {**QUANTIZERS, **SR_QUANTIZERS}.items()
  if isinstance(q, NVFP4Quantizer) and not q.per_token
}
SR_KEY = jax.random.key(17)


def nvfp4_oracle(x, quantizer: NVFP4Quantizer) -> dict:
  """{usage: (bf16 values, global amax bits)} from the NumPy NVFP4 oracle (tests/reference):
  each E2M1 code's value times its block's E4M3 scale, exact in float64, rounded to fp32
  and then to bf16 (NaN where a NaN global amax made every scale byte the E4M3 NaN)."""
  x_np = np.asarray(x)
  out = {}
  for usage in USAGES:
    q = oracle_usage(x_np, quantizer, usage, key=SR_KEY)
    data = q["data"]
    codes = np.stack([data & 0xF, data >> 4], axis=-1).reshape(data.shape[0], -1)
    magnitudes = orc.E2M1_GRID[codes & 7].astype(np.float64)
    signed = np.where(codes & 8, -magnitudes, magnitudes)
    block = (16, 16) if quantizer.tile_2d else (1, 16)
    scales = orc.expand(orc.fp8_decode(q["scale"], "e4m3").astype(np.float64), block, signed.shape)
    with np.errstate(all="ignore"):
      values = (signed * scales).astype(np.float32)
    out[usage] = (values.astype(ml_dtypes.bfloat16), np.asarray(q["amax"]).reshape(()))
  return out


@pytest.mark.parametrize("name", sorted(NVFP4_CASES))
@pytest.mark.parametrize("dt", sorted(DTYPES))
def test_nvfp4_reference_lowering_matches_oracle(name, dt):
  quantizer = NVFP4_CASES[name]
  run = jax.jit(lambda x: nvfp4_values(x, quantizer, USAGES, key=SR_KEY))
  for case, x in (
    ("random", random_input(3, (96, 160), DTYPES[dt])),
    ("edges", edge_input((64, 128), DTYPES[dt], nan=True, inf=True)),
  ):
    got = run(cpu(x))
    want = nvfp4_oracle(x, quantizer)
    for usage in USAGES:
      values, amax_bits = want[usage]
      assert isinstance(got[usage], ScaledValues)
      assert_same_bits(got[usage].values, values, f"{case} {name} {dt} {usage} values")
      assert_same_bits(
        got[usage].amax.view(jnp.uint32), amax_bits, f"{case} {name} {dt} {usage} amax"
      )


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_16x16"])
def test_nvfp4_one_device_eight_devices_and_vmap(eight_devices, name):
  # Without RHT: the reference RHT's exact-arithmetic host callback does not run in a
  # program sharded over fake CPU devices (docs/sharding.md, "Limits"); test_multi_gpu.py
  # shards the RHT on GPUs.
  quantizer = NVFP4_CASES[name]
  x = random_input(5, (256, 512), jnp.bfloat16)
  run = jax.jit(lambda x: nvfp4_values(x, quantizer, USAGES))
  want = run(cpu(x))
  mesh = Mesh(np.array(eight_devices).reshape(2, 4), ("data", "model"))
  for spec in (P("data", "model"), P(("data", "model"), None), P(None, "model")):
    got = run(jax.device_put(x, NamedSharding(mesh, spec)))
    assert_same_bits(got, want, f"sharded {spec}")
  stacked = jnp.stack([x[:, :256], x[:, 256:]])
  got = jax.vmap(lambda t: nvfp4_values(t, quantizer, ("rowwise",))["rowwise"])(stacked)
  assert_same_bits(jax.tree.map(lambda a: a[1], got), run(cpu(x[:, 256:]))["rowwise"], "vmap")


def test_nvfp4_rejects_bad_input():
  x = jnp.ones((64, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="casts NVFP4 only, got MXFP8Quantizer"):
    nvfp4_values(x, MXFP8Quantizer(), USAGES)
  with pytest.raises(ValueError, match="not per_token rows"):
    nvfp4_values(x, NVFP4Quantizer(per_token=True), USAGES)
  with pytest.raises(ValueError, match=r"both dims of the \[64, 40\] matrix divisible by 16"):
    nvfp4_values(x[:, :40], NVFP4Quantizer(), USAGES)
  with pytest.raises(ValueError, match=r"a 2-D matrix, got shape \(2, 32, 64\)"):
    nvfp4_values(x.reshape(2, 32, 64), NVFP4Quantizer(), USAGES)
  with pytest.raises(ValueError, match="takes bfloat16, float16 or float32 input, got int8"):
    nvfp4_values(x.astype(jnp.int8), NVFP4Quantizer(), USAGES)
  with pytest.raises(ValueError, match="usages must be among rowwise, columnwise"):
    nvfp4_values(x, NVFP4Quantizer(), ("both",))
  with pytest.raises(ValueError, match="rounds stochastically: pass a PRNG key"):
    nvfp4_values(x, NVFP4Quantizer(stochastic_rounding=True), USAGES)


# ---- The kernels (Hopper only) ----


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dt", sorted(DTYPES))
def test_kernel_is_the_dequantized_cast(element, dt):
  """Bit for bit the dequantize kernel's bf16 values of the cast kernel's codes, and the
  reference lowering's, on random and edge inputs (one usage alone too)."""
  quantizer = MXFP8Quantizer(element)
  cast_then_dequantize = jax.jit(
    lambda x: {
      u: kernels.dequantize_data(d, jnp.bfloat16, block_scales_only=True)
      for u, d in kernels.quantize_usages(x, quantizer, USAGES).items()
    }
  )
  values = jax.jit(lambda x: mxfp8_values(x, quantizer, USAGES))
  assert "jaxquant_mxfp8_values" in values.lower(jnp.ones((64, 64), DTYPES[dt])).as_text()
  for name, x in (
    ("random", random_input(11, (1024, 768), DTYPES[dt])),
    ("edges", edge_input((256, 512), DTYPES[dt], nan=True, inf=True)),
  ):
    got = values(x)
    assert_same_bits(got, cast_then_dequantize(x), f"{name} vs cast + dequantize")
    want = jax.jit(lambda x: mxfp8_values(x, quantizer, USAGES))(cpu(x))
    assert_same_bits(got, want, f"{name} vs the reference lowering")
  x = random_input(12, (512, 256), DTYPES[dt])
  for usage in USAGES:
    alone = jax.jit(lambda x, usage=usage: mxfp8_values(x, quantizer, (usage,))[usage])(x)
    assert_same_bits(alone, values(x)[usage], f"{usage} alone")


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("name", sorted(NVFP4_CASES))
@pytest.mark.parametrize("dt", sorted(DTYPES))
def test_nvfp4_kernel_is_the_dequantized_cast(name, dt):
  """Bit for bit the dequantize kernel's block-scaled bf16 values of the cast kernel's
  codes, with the cast's global amaxes, on random and edge inputs (one usage alone too);
  and the reference lowering's where the rounding is not stochastic (the kernels' random
  stream is not the reference's)."""
  quantizer = NVFP4_CASES[name]
  cast_then_dequantize = jax.jit(
    lambda x: {
      u: ScaledValues(kernels.dequantize_data(d, jnp.bfloat16, block_scales_only=True), d.amax)
      for u, d in kernels.quantize_usages(x, quantizer, USAGES, key=SR_KEY).items()
    }
  )
  values = jax.jit(lambda x: nvfp4_values(x, quantizer, USAGES, key=SR_KEY))
  text = values.lower(jnp.ones((64, 64), DTYPES[dt])).as_text()
  assert "jaxquant_nvfp4_values" in text and "jaxquant_nvfp4_cast" not in text
  for case, x in (
    ("random", random_input(11, (1024, 768), DTYPES[dt])),
    ("edges", edge_input((256, 512), DTYPES[dt], nan=True, inf=True)),
  ):
    got = values(x)
    assert_same_bits(got, cast_then_dequantize(x), f"{case} vs cast + dequantize")
    if not quantizer.stochastic_rounding:
      assert_same_bits(got, values(cpu(x)), f"{case} vs the reference lowering")
  x = random_input(12, (512, 256), DTYPES[dt])
  for usage in USAGES:
    alone = jax.jit(lambda x, usage=usage: nvfp4_values(x, quantizer, (usage,), key=SR_KEY)[usage])(
      x
    )
    assert_same_bits(alone, values(x)[usage], f"{usage} alone")
