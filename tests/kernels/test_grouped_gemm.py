"""The grouped GEMM primitive: its reference lowering against a NumPy oracle, its input
checks, and (on a Hopper GPU) the CUTLASS kernel against the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import BF16_MMA_TOLERANCE, FP8_MMA_TOLERANCE, relative_error

from jaxquant import kernels
from jaxquant.kernels import _grouped as gg

E4M3, E5M2, BF16 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16
PAIRS = [(BF16, BF16), (E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]
on_gpu = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}")


def operands(seed, m, n, k, g, a_dtype, b_dtype):
  ka, kb, kal = jax.random.split(jax.random.key(seed), 3)
  a = (jax.random.normal(ka, (m, k)) * 4).astype(a_dtype)
  b = (jax.random.normal(kb, (g, n, k)) * 4).astype(b_dtype)
  alpha = jax.random.uniform(kal, (g,), jnp.float32, 0.25, 2.0)
  return a, b, alpha


def oracle(a, b, sizes, alpha):
  """Row by row in float64: each group's rows times its matrix, zero rows after."""
  a64, b64 = (
    np.asarray(a.astype(jnp.float32), np.float64),
    np.asarray(b.astype(jnp.float32), np.float64),
  )
  m = a64.shape[0]
  out = np.zeros((m, b64.shape[1]))
  start = 0
  for g, size in enumerate(np.asarray(sizes)):
    rows = int(min(max(size, 0), m - start))
    out[start : start + rows] = a64[start : start + rows] @ b64[g].T * float(alpha[g])
    start += rows
  return out


# (M, N, K, sizes): groups that do not fill a tile, empty groups, rows of no group,
# sizes that overrun M (clipped) and a negative size (treated as empty).
SHAPES = [
  (64, 16, 32, [10, 0, 40]),
  (300, 48, 64, [1, 130, 0, 97]),
  (256, 32, 128, [200, 100]),
  (128, 16, 16, [-5, 64, 64]),
]


@pytest.mark.parametrize("m,n,k,sizes", SHAPES, ids=str)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "x".join(jnp.dtype(d).name for d in p))
def test_reference_lowering_matches_oracle(pair, m, n, k, sizes):
  # On the CPU also where a GPU is present: this is the reference lowering's test.
  a, b, alpha, sizes = jax.device_put(
    (*operands(m + k, m, n, k, len(sizes), *pair), jnp.asarray(sizes, jnp.int32)),
    jax.devices("cpu")[0],
  )
  got = jax.jit(gg.grouped_gemm, static_argnums=4)(a, b, sizes, alpha, jnp.float32)
  want = oracle(a, b, sizes, alpha)
  # fp32 accumulation of exact products: only the summation order differs from float64.
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  assert not np.asarray(got)[int(np.clip(sizes, 0, None).sum()) :].any()


@pytest.mark.parametrize(
  "args,match",
  [
    (((8, 16), BF16, (2, 16, 16), E4M3), "bfloat16 x bfloat16 or an FP8 pair"),
    (((8, 16), E5M2, (2, 16, 16), E5M2), "other than E5M2 x E5M2"),
    (((8, 12), BF16, (2, 16, 12), BF16), "K = 12 must be a multiple of 8"),
    (((8, 24), E4M3, (2, 16, 24), E4M3), "K = 24 must be a multiple of 16"),
    (((8, 16), BF16, (2, 16, 8), BF16), "contraction dims differ"),
    (((8, 16), jnp.float32, (2, 16, 16), jnp.float32), "float32 x float32"),
  ],
)
def test_rejects_bad_input(args, match):
  (ashape, adt, bshape, bdt) = args
  a, b = jnp.zeros(ashape, adt), jnp.zeros(bshape, bdt)
  g = bshape[0]
  with pytest.raises(ValueError, match=match):
    gg.grouped_gemm(a, b, jnp.zeros((g,), jnp.int32), jnp.ones((g,), jnp.float32))


def test_rejects_bad_sizes_and_output():
  a, b = jnp.zeros((8, 16), BF16), jnp.zeros((2, 12, 16), BF16)
  with pytest.raises(ValueError, match=r"group_sizes must be int32\[2\]"):
    gg.grouped_gemm(a, b, jnp.zeros((3,), jnp.int32), jnp.ones((2,), jnp.float32))
  with pytest.raises(ValueError, match="N = 12 must be a multiple of 8 for a bfloat16 output"):
    gg.grouped_gemm(a, b, jnp.zeros((2,), jnp.int32), jnp.ones((2,), jnp.float32), BF16)
  with pytest.raises(ValueError, match="output dtype must be bfloat16 or float32"):
    gg.grouped_gemm(a, b, jnp.zeros((2,), jnp.int32), jnp.ones((2,), jnp.float32), jnp.float16)


# ---- The CUDA kernel (Hopper only) ----

# N = 1408 (the G=64 MoE width): 5.5 of the bf16 kernel's 256-wide tiles, a partial last
# tile in N. 300 groups of 15 rows: the setup kernel's scan runs two chunks of 256 groups,
# and group 273 is clipped at m = 4096 in the second (later groups empty).
GPU_SHAPES = SHAPES + [
  (4096, 512, 1024, [1000, 0, 17, 2048, 1000]),
  (8192, 256, 256, [8192]),
  (2048, 1408, 256, [700, 0, 900, 300]),
  (4096, 128, 128, [15] * 300),
]


TOLERANCE = {"bf16": BF16_MMA_TOLERANCE, "fp8": FP8_MMA_TOLERANCE}


def tolerance(pair):
  return TOLERANCE["bf16" if jnp.dtype(pair[0]) == jnp.bfloat16 else "fp8"]


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("m,n,k,sizes", GPU_SHAPES, ids=lambda v: str(v)[:40])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "x".join(jnp.dtype(d).name for d in p))
def test_kernel_matches_reference(pair, m, n, k, sizes):
  a, b, alpha = operands(7 * m + n, m, n, k, len(sizes), *pair)
  sizes = jnp.asarray(sizes, jnp.int32)  # traced under jit: read on the device only
  run = jax.jit(gg.grouped_gemm, static_argnums=4)
  got = np.asarray(run(a, b, sizes, alpha, jnp.float32))
  want = oracle(a, b, sizes, alpha)
  assert relative_error(got, want) <= tolerance(pair)
  used = int(np.clip(np.asarray(sizes), 0, None).sum())
  assert not got[used:].any(), "rows of no group must be zero"
  if n % 8 == 0:
    got_bf16 = np.asarray(run(a, b, sizes, alpha, BF16).astype(jnp.float32))
    # bf16 output: the fp32 result rounded once (at most 2^-9 relative more).
    assert relative_error(got_bf16, want) <= tolerance(pair) + 2.0**-9


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("pair", PAIRS[1:], ids=lambda p: "x".join(jnp.dtype(d).name for d in p))
def test_fp8_kernel_as_accurate_as_cublaslt(pair):
  """One group is a dense GEMM: against XLA's f8 dot (cuBLASLt's FP8 GEMM) on the same data."""
  m, n, k = 2048, 512, 4096
  a, b, alpha = operands(11, m, n, k, 1, *pair)
  want = oracle(a, b, jnp.asarray([m], jnp.int32), jnp.ones((1,)))
  ours = gg.grouped_gemm(a, b, jnp.asarray([m], jnp.int32), jnp.ones((1,), jnp.float32))
  cublaslt = jax.jit(
    lambda a, b: jax.lax.dot_general(
      a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
  )(a, b[0])
  e_ours, e_cublaslt = (
    relative_error(np.asarray(ours), want),
    relative_error(np.asarray(cublaslt), want),
  )
  print(f"relative error: jaxquant grouped {e_ours:.3g}, cuBLASLt {e_cublaslt:.3g}")
  assert e_ours <= max(2 * e_cublaslt, 1e-5)


@pytest.mark.gpu
@on_gpu
def test_kernel_is_repeatable_and_sizes_change_without_recompiling():
  a, b, alpha = operands(3, 1024, 256, 512, 4, E4M3, E4M3)
  traces = []

  @jax.jit
  def run(a, b, sizes, alpha):
    traces.append(sizes)
    return gg.grouped_gemm(a, b, sizes, alpha)

  for sizes in ([256, 256, 256, 256], [0, 1000, 0, 24], [1024, 0, 0, 0]):
    sizes = jnp.asarray(sizes, jnp.int32)
    first, second = run(a, b, sizes, alpha), run(a, b, sizes, alpha)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
    assert relative_error(np.asarray(first), oracle(a, b, sizes, alpha)) <= TOLERANCE["fp8"]
  assert len(traces) == 1, "new group sizes must not retrace (they are read on the device)"


def test_sharded_operands_give_the_unsharded_result(eight_devices):
  """Under a sharded jit the primitive keeps its operands whole (they are gathered), so
  rows sharded over devices give the same numbers as one device."""
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.array(eight_devices).reshape(2, 4), ("data", "model"))
  a, b, alpha = operands(5, 256, 32, 64, 4, BF16, BF16)
  sizes = jnp.asarray([100, 0, 60, 96], jnp.int32)
  run = jax.jit(gg.grouped_gemm, static_argnums=4)
  want = run(a, b, sizes, alpha, jnp.float32)
  got = run(
    jax.device_put(a, NamedSharding(mesh, P("data", None))),
    jax.device_put(b, NamedSharding(mesh, P("model", None, None))),
    sizes,
    alpha,
    jnp.float32,
  )
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ---- The contraction grouping (wgrad) ----


def wgrad_operands(seed, p, q, sizes, a_dtype, b_dtype):
  """A [P, L], B [Q, L] in the aligned column layout; the gap columns hold NaN, which the
  kernel must never read."""
  columns = gg.aligned_columns(int(np.clip(sizes, 0, None).sum()), len(sizes))
  ka, kb, kal = jax.random.split(jax.random.key(seed), 3)
  a = jax.random.normal(ka, (p, columns)) * 4
  b = jax.random.normal(kb, (q, columns)) * 4
  owner = np.asarray(gg.aligned_layout(jnp.asarray(sizes, jnp.int32), columns).group_ids)
  gap = jnp.asarray(owner == len(sizes))
  a, b = (jnp.where(gap, jnp.nan, m) for m in (a, b))
  alpha = jax.random.uniform(kal, (len(sizes),), jnp.float32, 0.25, 2.0)
  return a.astype(a_dtype), b.astype(b_dtype), alpha


def wgrad_oracle(a, b, sizes, alpha):
  """Group by group in float64, its columns found by walking the sizes (each start the sum
  of the sizes before it, rounded up to 16)."""
  a64, b64 = (np.asarray(m.astype(jnp.float32), np.float64) for m in (a, b))
  out = np.zeros((len(sizes), a64.shape[0], b64.shape[0]))
  start = 0
  for g, size in enumerate(np.asarray(sizes)):
    size = max(int(size), 0)
    cols = slice(start, start + size)
    if size:
      out[g] = a64[:, cols] @ b64[:, cols].T * float(alpha[g])
    start += -(-size // 16) * 16
  return out


# (P, Q, sizes): empty groups first, last and between, one group holding every row, single
# rows, P and Q not multiples of any tile, 1 to 256 groups.
WGRAD_SHAPES = [
  (24, 40, [0, 5, 33, 0, 17, 0]),
  (64, 16, [300]),
  (40, 24, [1]),
  (16, 32, [3] * 256),
  (32, 48, [0, 0, 0, 70]),
]


@pytest.mark.parametrize("p,q,sizes", WGRAD_SHAPES, ids=lambda v: str(v)[:30])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "x".join(jnp.dtype(d).name for d in p))
def test_wgrad_reference_lowering_matches_oracle(pair, p, q, sizes):
  a, b, alpha = wgrad_operands(p + q, p, q, sizes, *pair)
  a, b, alpha, sizes = jax.device_put(
    (a, b, alpha, jnp.asarray(sizes, jnp.int32)), jax.devices("cpu")[0]
  )
  got = jax.jit(gg.grouped_wgrad, static_argnums=4)(a, b, sizes, alpha, jnp.float32)
  want = wgrad_oracle(a, b, sizes, alpha)
  assert got.shape == want.shape
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  assert not np.asarray(got)[np.asarray(sizes) <= 0].any(), "empty groups must be zero"


def test_wgrad_layout_starts_every_group_on_16_columns():
  sizes = jnp.asarray([0, 5, 16, 0, 17, 1], jnp.int32)
  np.testing.assert_array_equal(gg.column_starts(sizes), [0, 0, 16, 32, 32, 64])
  columns = gg.aligned_columns(39, 6)
  assert columns == 144  # 39 rows and 6 x 15 columns of padding at most, rounded up to 16
  ids = np.asarray(gg.aligned_layout(sizes, columns).group_ids)
  want = np.full(columns, 6)
  for g, (s, n) in enumerate(zip([0, 0, 16, 32, 32, 64], [0, 5, 16, 0, 17, 1], strict=True)):
    want[s : s + n] = g
  np.testing.assert_array_equal(ids, want)


@pytest.mark.parametrize(
  "ashape,bshape,sizes,match",
  [
    ((8, 24), (8, 24), 2, "L = 24 must be a multiple of 16"),
    ((8, 32), (8, 16), 2, "contraction dims differ: A has K=32, B has K=16"),
    ((8, 32), (8, 32, 1), 2, r"expects A \[M, K\] and B \[N, K\]"),
  ],
)
def test_wgrad_rejects_bad_input(ashape, bshape, sizes, match):
  a, b = jnp.zeros(ashape, BF16), jnp.zeros(bshape, BF16)
  with pytest.raises(ValueError, match=match):
    gg.grouped_wgrad(a, b, jnp.zeros((sizes,), jnp.int32), jnp.ones((sizes,), jnp.float32))


# The MoE widths (K 2048 / 1408 / 4096, N the same), groups from one row to the whole batch.
WGRAD_GPU_SHAPES = WGRAD_SHAPES + [
  (2048, 1408, [700, 0, 900, 300, 1, 2047]),
  (1408, 2048, [96] * 64),
  (512, 768, [8192]),
  (256, 384, [15] * 300),
]


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("p,q,sizes", WGRAD_GPU_SHAPES, ids=lambda v: str(v)[:40])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "x".join(jnp.dtype(d).name for d in p))
def test_wgrad_kernel_matches_reference(pair, p, q, sizes):
  a, b, alpha = wgrad_operands(5 * p + q, p, q, sizes, *pair)
  sizes = jnp.asarray(sizes, jnp.int32)
  run = jax.jit(gg.grouped_wgrad, static_argnums=4)
  got = np.asarray(run(a, b, sizes, alpha, jnp.float32))
  want = wgrad_oracle(a, b, sizes, alpha)
  assert np.isfinite(got).all(), "a gap column (NaN) was read"
  assert relative_error(got, want) <= tolerance(pair)
  assert not got[np.asarray(sizes) <= 0].any(), "empty groups must be zero"
  if q % 8 == 0:
    got_bf16 = np.asarray(run(a, b, sizes, alpha, BF16).astype(jnp.float32))
    assert relative_error(got_bf16, want) <= tolerance(pair) + 2.0**-9
