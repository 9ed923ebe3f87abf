"""CUDA kernels against the reference, bit for bit, on the GPU (skipped elsewhere)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import (
  DELAYED,
  QUANTIZERS,
  SR_QUANTIZERS,
  assert_same_bits,
  edge_input,
  random_input,
)

from jaxquant import kernels, reference, scaling
from jaxquant.ops import _delayed_state as delayed_state
from jaxquant.ops import _quantize as ops
from jaxquant.quantizers import DelayedFloat8Quantizer

pytestmark = [
  pytest.mark.gpu,
  pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}"),
]

DTYPES = [jnp.bfloat16, jnp.float32]
# (shape, dtype): K = 1056 and 768 leave partial column tiles; fp32 has other tile widths.
# 16384 x 1056 gives the MXFP8 cast strips of 8 tiles along K on an H100, the last padded
# with 7 tiles past K, and rowwise scale rows of 33 bytes (tile.cuh's strips). 11264 x 1056
# gives the NVFP4 cast (two CTAs an SM) strips of 4 bf16 tiles or 8 fp32 tiles, the last of
# each band with one tile inside K, and rowwise scale rows of 66 bytes.
CASES = [
  ((128, 256), jnp.bfloat16),
  ((256, 1056), jnp.bfloat16),
  ((4096, 1024), jnp.bfloat16),
  ((1024, 768), jnp.float32),
  ((128, 512), jnp.float16),
  ((16384, 1056), jnp.bfloat16),
  ((11264, 1056), jnp.bfloat16),
  ((11264, 1056), jnp.float32),
]


@functools.partial(jax.jit, static_argnames=("quantizer", "implementation"))
def quantize_jit(x, key, *, quantizer, implementation):
  return ops.quantize(x, quantizer, key=key, implementation=implementation)


CPU = jax.devices("cpu")[0]


def on_cpu(tree):
  return jax.device_put(tree, CPU)


def reference_on_cpu(fn, *args):
  """The reference runs on the CPU: XLA:GPU divides with div.full.f32 (up to 1 ulp off,
  openxla/xla#37181), so on the GPU the reference is not NUMERICS.md's IEEE arithmetic."""
  return fn(*on_cpu(args))


def both(x, quantizer, key=None):
  key = jax.random.key(0) if key is None else key
  return (
    quantize_jit(x, key, quantizer=quantizer, implementation="kernel"),
    reference_on_cpu(
      functools.partial(quantize_jit, quantizer=quantizer, implementation="reference"), x, key
    ),
  )


@pytest.mark.parametrize(
  "shape,dtype", CASES, ids=lambda c: str(c) if isinstance(c, tuple) else jnp.dtype(c).name
)
@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_random_inputs_bit_exact(name, shape, dtype):
  for seed in range(2):
    got, want = both(random_input(seed + 100 * shape[0], shape, dtype), QUANTIZERS[name])
    assert_same_bits(got, want, f"{name} {shape} seed {seed}")


# Block FP8 takes any M and K that are multiples of 16 (CASES are whole 128-row tiles):
# rows past M in the last tile band, 1x128 blocks and 128x128 tiles cut at K and at M.
BLOCK_PARTIAL_CASES = [
  ((208, 400), jnp.bfloat16),
  ((144, 272), jnp.float32),
  ((48, 1040), jnp.float16),
]


@pytest.mark.parametrize("usages", [("rowwise", "columnwise"), ("rowwise",)], ids="+".join)
@pytest.mark.parametrize(
  "shape,dtype",
  BLOCK_PARTIAL_CASES,
  ids=lambda c: str(c) if isinstance(c, tuple) else jnp.dtype(c).name,
)
@pytest.mark.parametrize("name", ["block_1x128", "block_128x128", "block_1x128_e5m2_nopow2"])
def test_block_fp8_partial_tiles_bit_exact(name, shape, dtype, usages):
  f = jax.jit(
    lambda x, impl: ops.quantize(x, QUANTIZERS[name], usages, implementation=impl), static_argnums=1
  )
  x = random_input(7 + shape[0], shape, dtype)
  want = reference_on_cpu(lambda x: f(x, "reference"), x)
  assert_same_bits(f(x, "kernel"), want, f"{name} {shape} {usages}")


@pytest.mark.parametrize(
  "dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: jnp.dtype(d).name
)
@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_edge_cases_bit_exact(name, dtype):
  nvfp4 = "nvfp4" in name
  cases = [("inf", dict(nan=False, inf=True)), ("nan", dict(nan=True, inf=False))]
  if not nvfp4:
    cases.append(("nan_and_inf", dict(nan=True, inf=True)))
  for label, kw in cases:
    got, want = both(edge_input((256, 512), dtype, **kw), QUANTIZERS[name])
    assert_same_bits(got, want, f"{name} edge {label}")


@pytest.mark.parametrize("name", ["fp8_e4m3", "mxfp8_e4m3", "nvfp4", "block_1x128"])
def test_empty_tensor(name):
  got, want = both(jnp.zeros((0, 64), jnp.bfloat16), QUANTIZERS[name])
  assert_same_bits(got, want, f"{name} empty")


def test_leading_dims_flattened():
  x = random_input(3, (256, 256), jnp.bfloat16).reshape(4, 64, 256)
  got, want = both(x, QUANTIZERS["mxfp8_e4m3"])
  assert_same_bits(got, want, "mxfp8 3-D input")


@pytest.mark.parametrize(
  "usages", [("rowwise", "columnwise"), ("rowwise",), ("columnwise",)], ids="+".join
)
def test_delayed_scaling_bit_exact(usages):
  """The codes, and the amax the cast observes as it reads (recorded in the state's
  history): every kernel path (the tile cast with and without its rowwise pass, the
  streaming rowwise cast), on fresh random inputs and on inputs with inf and NaN."""
  state = scaling.DelayedScalingState(jnp.zeros((16,), jnp.float32), jnp.float32(3.0))
  f = jax.jit(
    lambda x, s, impl: ops.quantize(x, DELAYED, usages, state=s, implementation=impl),
    static_argnums=2,
  )
  inputs = [
    random_input(5, (512, 1024), jnp.bfloat16),
    random_input(15, (272, 1040), jnp.float32),
    edge_input((256, 512), jnp.bfloat16, nan=False, inf=True),
    edge_input((256, 512), jnp.float16, nan=True, inf=False),
  ]
  for i, x in enumerate(inputs):
    want = reference_on_cpu(lambda x, s: f(x, s, "reference"), x, state)
    got = f(x, state, "kernel")
    assert_same_bits(got, want, f"delayed {usages} input {i}")
    assert float(got[1].amax_history[0]) > 0 or np.isnan(got[1].amax_history[0])


@pytest.mark.parametrize("usage", ["rowwise", "columnwise"])
@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_one_usage_bit_exact(name, usage):
  """One usage alone takes other kernel paths (the FP8 per-tensor rowwise cast streams
  16-byte vectors without staging a tile)."""
  f = jax.jit(
    lambda x, key, impl: ops.quantize(x, QUANTIZERS[name], (usage,), key=key, implementation=impl),
    static_argnums=2,
  )
  inputs = [
    random_input(7, (256, 1056), jnp.bfloat16),
    random_input(8, (1024, 768), jnp.float32),
    random_input(9, (128, 512), jnp.float16),
    edge_input((256, 512), jnp.bfloat16, nan=False, inf=True),
    edge_input((256, 512), jnp.bfloat16, nan=True, inf=False),
  ]
  key = jax.random.key(0)
  for i, x in enumerate(inputs):
    want = reference_on_cpu(lambda x, key: f(x, key, "reference"), x, key)
    assert_same_bits(f(x, key, "kernel"), want, f"{name} {usage} input {i}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("mode", ["tensor", "row", "rht"])
def test_amax_bit_exact(mode, dtype):
  x = edge_input((512, 1024), dtype, nan=False, inf=False)
  f = jax.jit(lambda x: kernels.amax(x, per_row=mode == "row", rht=mode == "rht"))
  xf = on_cpu(x).astype(jnp.float32)
  if mode == "rht":
    want = reference.fp32.abs_max(reference.hadamard.apply_rht(xf.T, x.dtype))
  else:
    want = reference.fp32.abs_max(xf, axis=1 if mode == "row" else None)
  assert_same_bits(f(x), want, f"amax {mode}")


def rht_block_input(dtype, seed: int, *, inf: bool = False) -> jax.Array:
  """[16 * 12, 256] values of `dtype` whose 16-row columnwise RHT blocks are the sums'
  edge cases: per block row, 16 values spanning 20 - p binades (p the dtype's significant
  bits: every signed partial sum exact in fp32) and one binade more (rounded partial sums);
  bf16 magnitudes whose 16-term sums reach fp32's overflow or stay just below it; subnormals
  with normals; all -0, all +0 and mixed zeros, and zeros signed so that every term of one
  output is -0 (the sum starts from term 0: -0, not +0); sums that cancel to exact zeros;
  optionally an infinity in a block."""
  rng = np.random.default_rng(seed)
  bf16 = jnp.dtype(dtype) == jnp.bfloat16
  p = 8 if bf16 else 11
  spread = 20 - p
  top = 122 if bf16 else 15
  cols = 256

  def values(low, high):
    """16 x cols normal values with exponents in [low, high], both ends present in each
    column, random signs and p - 1 random mantissa bits."""
    e = rng.integers(low, high + 1, (16, cols))
    e[rng.integers(0, 16)], e[rng.integers(0, 16)] = low, high
    mantissa = 1 + rng.integers(0, 2 ** (p - 1), (16, cols)) / 2 ** (p - 1)
    sign = rng.choice([-1.0, 1.0], (16, cols))
    return sign * mantissa * np.exp2(e.astype(np.float64))

  e_small = -14 if not bf16 else -40
  blocks = [
    values(e_small, e_small + spread),
    values(e_small, e_small + spread + 1),
    values(-3, -3 + spread),
    values(top - spread, top),
  ]
  if bf16:
    # The top block above (largest exponent 122) sums below fp32's overflow; these may reach it.
    blocks += [values(123 - spread, 123), values(127 - spread, 127)]
    sub = rng.integers(-127, 128, (16, cols)) * 2.0**-133  # bf16 subnormals ...
    sub[::2] = values(-126, -126 + spread - 1)[::2]  # ... with normals
  else:
    sub = rng.integers(-1023, 1024, (16, cols)) * 2.0**-24  # fp16 subnormals ...
    sub[::2] = values(-14, -14 + spread - 6)[::2]
  blocks.append(sub)
  signs = reference.hadamard.rht_signs()  # sign(R[i, j]), [i, j]
  zeros = np.where(rng.random((16, cols)) < 0.5, -0.0, 0.0)
  zeros[:, :32] = -0.0
  zeros[:, 32:64] = 0.0
  # Column 64 + j: x_i = -0 * sign(R[i, j]), so every term of output j is -0.
  zeros[:, 64:80] = np.where(signs > 0, -0.0, 0.0)
  blocks.append(zeros)
  one = np.zeros((16, cols))
  one[rng.integers(0, 16, cols), np.arange(cols)] = values(-5, 5)[0]
  blocks.append(one)
  # x_i = sign(R[i, j0]) c: R maps it to 4c at output j0 and exact zeros elsewhere.
  j0 = rng.integers(0, 16, cols)
  blocks.append(signs[:, j0] * values(-2, 2)[0])
  x = np.concatenate(blocks + [np.zeros((16 * (12 - len(blocks)), cols))])
  if inf:
    x[16 * 2 + 3, 5] = np.inf  # one infinity per block: infinite outputs, no NaN
    x[16 * 2 + 7, 9] = -np.inf
  want = jnp.asarray(x.astype(np.float32), dtype)
  assert np.array_equal(np.asarray(want, np.float32), x.astype(np.float32), equal_nan=True), (
    "every generated value is exact in the dtype"
  )
  return want


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_rht_edge_blocks_bit_exact(dtype):
  """The RHT amax and the RHT cast on rht_block_input's edge-case blocks."""
  amax = jax.jit(lambda x: kernels.amax(x, rht=True))
  for seed in range(3):
    for inf in (False, True):
      x = rht_block_input(dtype, seed, inf=inf)
      what = f"{jnp.dtype(dtype).name} seed {seed} inf {inf}"
      rotated = reference_on_cpu(
        lambda x: reference.hadamard.apply_rht(x.astype(jnp.float32).T, x.dtype), x
      )
      assert_same_bits(amax(x), reference.fp32.abs_max(rotated), f"RHT amax, {what}")
      if not inf:  # an infinite global amax makes every code 0
        got, want = both(x, QUANTIZERS["nvfp4_rht"])
        assert_same_bits(got, want, f"nvfp4 RHT cast, {what}")


def test_tensor_amax_fused_into_its_producer_takes_the_rounded_values():
  """XLA fuses kernels.amax.tensor_amax into the op that produces x (here an fp32 product
  rounded to bf16, one multiply: the same values in any fusion): the amax must be that of
  x's bf16 values, which the cast quantizes, not of the unrounded fp32 products (which
  XLA's excess precision could offer)."""
  from jaxquant.kernels._amax import tensor_amax

  a = random_input(21, (4096, 1024), jnp.float32)
  produce = lambda a: (a * jnp.float32(1.1)).astype(jnp.bfloat16)
  x = np.asarray(jax.jit(produce)(a), np.float32)
  assert np.abs(x).max() != np.abs(np.asarray(a) * np.float32(1.1)).max()  # rounding shows
  got = jax.jit(lambda a: tensor_amax(produce(a)))(a)
  assert_same_bits(got, jnp.float32(np.abs(x).max()), "amax fused into its producer")


@pytest.mark.parametrize("implementation", ["kernel", "reference"])
@pytest.mark.parametrize("name", ["fp8_e4m3", "mxfp8_e4m3", "nvfp4"])
def test_quantize_fused_into_its_producer_takes_the_rounded_values(name, implementation):
  """Quantizing x where XLA can fuse the quantization into the op producing x (an fp32
  product rounded to bf16) gives the codes of x itself, as quantizing the materialized x
  does: the reference reads x's values through `fp32.widen`, not an fp32 convert XLA could
  merge with the producer's rounding."""
  q = QUANTIZERS[name]
  a = random_input(22, (1024, 1024), jnp.float32)
  produce = lambda a: (a * jnp.float32(1.1)).astype(jnp.bfloat16)
  quantize = lambda x: ops.quantize(x, q, implementation=implementation)
  separate = jax.jit(quantize)(jax.jit(produce)(a))
  fused = jax.jit(lambda a: quantize(produce(a)))(a)
  assert_same_bits(fused, separate, f"{name} {implementation}, fused into its producer")


def global_amaxes() -> np.ndarray:
  """NVFP4 global amaxes at NUMERICS.md's edges, then random magnitudes over all of fp32:
  zeros, the least subnormal and the largest finite (S_enc clamped to FLT_MAX, S_dec then
  subnormal), the smallest amax whose S_enc is finite, inf (S_enc 0, so 1), NaN, 2688
  (S_enc 1) and its neighbours."""
  specials = np.float32(
    [
      0.0,
      -0.0,
      1e-45,
      1.1754942e-38,
      1.1754944e-38,
      7.899322e-36,
      7.899323e-36,
      1e-30,
      0.5,
      1.0,
      6.0,
      448.0,
      np.nextafter(np.float32(2688), 0),
      2688.0,
      np.nextafter(np.float32(2688), np.float32(np.inf)),
      1e30,
      3.4028235e38,
      np.inf,
      np.nan,
    ]
  )
  randoms = np.random.default_rng(11).integers(0, 0x7F800000, 4096, dtype=np.uint32)
  return np.concatenate([specials, randoms.view(np.float32)])


def test_nvfp4_decode_scale_bit_exact():
  """S_dec of global amaxes (the NVFP4 GEMMs' outer scales): the kernel against the
  reference's exact divisions, as a vector, a scalar and a sharded-shape slice."""
  amaxes = jnp.asarray(global_amaxes())
  want = reference_on_cpu(lambda a: reference.nvfp4.global_scales(a)[1], amaxes)
  decode = jax.jit(kernels.decode_scale)
  assert_same_bits(decode(amaxes), want, "decode scales")
  for i in (0, 2, 5, 13, 16, len(amaxes) - 1):
    assert_same_bits(decode(amaxes[i]), want[i], f"decode scale of amax {float(amaxes[i])!r}")


@pytest.mark.parametrize("element,margin", [("e4m3", 0), ("e5m2", 0), ("e4m3", 3), ("e5m2", -2)])
def test_delayed_scale_bit_exact(element, margin):
  """Delayed scaling's next scales (fmax / amax / 2^margin, the old scale kept for zero,
  inf and NaN amaxes): the kernel against the reference's exact divisions, on the edge and
  random amaxes of every magnitude, and inside a whole update of stacked states."""
  q = DelayedFloat8Quantizer(element, history_len=4, margin=margin)
  fmax, divisor = float(q.format("rowwise").fmax), scaling.scale_divisor(q)
  amaxes = jnp.asarray(global_amaxes())
  scales = jnp.asarray(np.random.default_rng(12).lognormal(0.0, 5.0, amaxes.size), jnp.float32)
  want = reference_on_cpu(lambda a, s: scaling.next_scale(a, s, fmax, divisor), amaxes, scales)
  kernel = jax.jit(lambda a, s: kernels.delayed_scale(a, s, fmax, divisor))
  assert_same_bits(kernel(amaxes, scales), want, f"next scales {element} margin {margin}")
  assert_same_bits(kernel(amaxes[3], scales[3]), want[3], "a scalar")
  states = scaling.DelayedScalingState(amaxes[:4096].reshape(1024, 4), scales[:1024])
  want = reference_on_cpu(lambda s: scaling.update(s, q), states)
  assert_same_bits(jax.jit(lambda s: delayed_state.update(s, q))(states), want, "update")


@pytest.mark.parametrize("out_dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_dequantize_bit_exact(name, out_dtype):
  x = edge_input((256, 512), jnp.bfloat16, nan="nvfp4" not in name, inf=True)
  qt = reference_on_cpu(
    functools.partial(quantize_jit, quantizer=QUANTIZERS[name], implementation="reference"),
    x,
    jax.random.key(0),
  )
  for usage in ("rowwise", "columnwise"):
    f = jax.jit(
      lambda qt, impl, usage=usage: ops.dequantize(qt, usage, out_dtype, implementation=impl),
      static_argnums=1,
    )
    kernel = f(jax.device_put(qt, jax.devices()[0]), "kernel")
    want = reference_on_cpu(lambda qt, f=f: f(qt, "reference"), qt)
    assert_same_bits(kernel, want, f"dequantize {name} {usage}")
    stored = qt.usage(usage)
    if name.startswith("fp8_"):
      continue  # per-tensor FP8 has no block scales
    # Block scales only: the values a GEMM multiplies (NVFP4 without S_dec).
    g = jax.jit(lambda qd: kernels.dequantize_data(qd, out_dtype, block_scales_only=True))
    want = reference_on_cpu(lambda qd: reference.split_scales(qd)[0].astype(out_dtype), stored)
    assert_same_bits(
      g(jax.device_put(stored, jax.devices()[0])),
      want,
      f"dequantize {name} {usage} block scales only",
    )


@pytest.mark.parametrize("name", sorted(SR_QUANTIZERS))
def test_stochastic_rounding(name):
  q = SR_QUANTIZERS[name]
  x = random_input(11, (256, 512), jnp.bfloat16)
  k1, k2 = jax.random.key(1), jax.random.key(2)
  a = quantize_jit(x, k1, quantizer=q, implementation="kernel")
  # Reproducible per key, different across keys.
  assert_same_bits(a, quantize_jit(x, k1, quantizer=q, implementation="kernel"), "same key")
  b = quantize_jit(x, k2, quantizer=q, implementation="kernel")
  assert not np.array_equal(np.asarray(a.rowwise.data), np.asarray(b.rowwise.data))
  # Scales and global amaxes do not depend on the random bits: bit-exact.
  ref = reference_on_cpu(
    functools.partial(quantize_jit, quantizer=q, implementation="reference"), x, k1
  )
  for usage in ("rowwise", "columnwise"):
    got, want = a.usage(usage), ref.usage(usage)
    assert_same_bits(
      (got.scale_inv, got.amax), (want.scale_inv, want.amax), f"{name} {usage} scales"
    )
  # Same distribution as the reference: the gap between a kernel mean and a reference
  # mean (32 keys each) is no larger than the gap between two reference means, and the
  # rowwise means converge to the input (SR is unbiased).
  keys = jax.random.split(jax.random.key(3), 96)

  @functools.partial(jax.jit, static_argnames="impl")
  def mean_dequant(keys, impl):
    def one(key):
      qt = ops.quantize(x, q, key=key, implementation=impl)
      return jnp.stack(
        [
          ops.dequantize(qt, u, jnp.float32, implementation="reference").reshape(-1)
          for u in ("rowwise", "columnwise")
        ]
      )

    return jax.lax.map(one, keys).mean(axis=0)

  kernel = np.asarray(mean_dequant(keys[:32], "kernel"))
  ref_a = np.asarray(mean_dequant(keys[32:64], "reference"))
  ref_b = np.asarray(mean_dequant(keys[64:], "reference"))
  for i, usage in enumerate(("rowwise", "columnwise")):
    gap = np.abs(kernel[i] - ref_a[i]).mean()
    noise = np.abs(ref_b[i] - ref_a[i]).mean()
    assert gap < 1.2 * noise, f"{name} {usage}: kernel-reference gap {gap} vs noise {noise}"
  exact = np.asarray(x.astype(jnp.float32)).reshape(-1)
  assert abs((kernel[0] - exact).mean()) < 0.05 * np.abs(exact).mean(), "rowwise SR is biased"
