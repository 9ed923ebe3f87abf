"""The block FP8 GEMM primitive: its reference lowering against a NumPy oracle, its input
checks, and (on a Hopper GPU) the kernel against the reference, directly and through
`ops.gemm` (on the H100 cuBLASLt's block-scaled GEMM takes these problems; the CUTLASS
kernel is the handler's fallback)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import FP8_MMA_TOLERANCE, relative_error

from jaxquant import kernels, reference
from jaxquant.kernels import _block_gemm as bg
from jaxquant.ops import _gemm as gemm_ops
from jaxquant.quantizers import BlockFloat8Quantizer

on_gpu = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}")
E4M3 = jnp.float8_e4m3fn


def codes_and_scales(seed, m, n, k, b_block_rows):
  rng = np.random.default_rng(seed)
  kb = -(-k // 128)
  a = jnp.asarray(rng.standard_normal((m, k)) * 8, E4M3)
  b = jnp.asarray(rng.standard_normal((n, k)) * 8, E4M3)
  sa = jnp.asarray(np.exp2(rng.integers(-6, 6, (m, kb))), jnp.float32)
  sb = jnp.asarray(np.exp2(rng.integers(-6, 6, (-(-n // b_block_rows), kb))) * 1.5, jnp.float32)
  return a, b, sa, sb


def oracle(a, b, sa, sb, b_block_rows):
  """Element by element: each code times its block's scale, then a float64 product."""
  a64, b64 = (
    np.asarray(a.astype(jnp.float32), np.float64),
    np.asarray(b.astype(jnp.float32), np.float64),
  )
  k, n = a64.shape[1], b64.shape[0]
  ka = np.arange(k) // 128
  va = a64 * np.asarray(sa, np.float64)[:, ka]
  vb = b64 * np.asarray(sb, np.float64)[np.arange(n) // b_block_rows][:, ka]
  return va @ vb.T


# (M, N, K): partial row tiles, a partial last k block (K = 1056), N not a tile multiple.
SHAPES = [(128, 128, 128), (300, 256, 640), (64, 384, 1056), (8, 136, 256)]


@pytest.mark.parametrize("b_block_rows", [128, 1])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_reference_lowering_matches_oracle(m, n, k, b_block_rows):
  args = jax.device_put(codes_and_scales(m + n + k, m, n, k, b_block_rows), jax.devices("cpu")[0])
  got = jax.jit(lambda *a: bg.block_fp8_gemm(*a, b_block_rows=b_block_rows))(*args)
  want = oracle(*args, b_block_rows)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_rejects_bad_input():
  a, b, sa, sb = codes_and_scales(0, 16, 128, 256, 128)
  with pytest.raises(ValueError, match="A must be float8_e4m3fn, got bfloat16"):
    bg.block_fp8_gemm(a.astype(jnp.bfloat16), b, sa, sb, b_block_rows=128)
  with pytest.raises(ValueError, match=r"B's scales must be float32\[1, 2\], got float32\[2, 2\]"):
    bg.block_fp8_gemm(a, b, sa, jnp.ones((2, 2)), b_block_rows=128)
  with pytest.raises(ValueError, match="B's blocks must be 1x128 or 128x128, got 64x128"):
    bg.block_fp8_gemm(a, b, sa, sb, b_block_rows=64)
  with pytest.raises(ValueError, match="K = 24 must be a multiple of 16"):
    bg.block_fp8_gemm(a[:, :24], b[:, :24], sa[:, :1], sb[:, :1], b_block_rows=128)
  with pytest.raises(ValueError, match="N = 10 must be a multiple of 4 for a float32 output"):
    bg.block_fp8_gemm(a, b[:10], sa, sb, b_block_rows=128)
  with pytest.raises(ValueError, match=r"M = 18 must be a multiple of 4 \(A's scales"):
    bg.block_fp8_gemm(a[:2].repeat(9, axis=0), b, sa[:2].repeat(9, axis=0), sb, b_block_rows=128)


@pytest.mark.parametrize("m,kernel_called", [(16, True), (18, False)])
def test_gemm_dispatch_leaves_unaligned_rows_to_the_emulation(monkeypatch, m, kernel_called):
  """ops.gemm asks the kernel only for problems it takes: 18 rows go to the emulation."""
  calls = []
  monkeypatch.setattr(kernels, "available", lambda: True)
  monkeypatch.setattr(
    bg,
    "block_fp8_gemm",
    lambda *a, **kw: (
      calls.append(a[0].shape) or jnp.zeros((a[0].shape[0], a[1].shape[0]), kw["out_dtype"])
    ),
  )
  # Operands and GEMM traced only (jax.eval_shape): the route is chosen from shapes and
  # formats.
  a, b = jax.eval_shape(
    lambda: (
      reference.quantize(
        jnp.zeros((m, 256), jnp.bfloat16), BlockFloat8Quantizer(block="1x128"), ("rowwise",)
      ).rowwise,
      reference.quantize(
        jnp.zeros((128, 256), jnp.bfloat16), BlockFloat8Quantizer(block="128x128"), ("rowwise",)
      ).rowwise,
    )
  )
  select = gemm_ops.select
  monkeypatch.setattr(
    gemm_ops, "select", lambda problem, _, backend: select(problem, "gpu", backend)
  )
  jax.eval_shape(gemm_ops.gemm, a, b)
  assert bool(calls) == kernel_called


# ---- The CUDA kernel (Hopper only) ----


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("b_block_rows", [128, 1])
@pytest.mark.parametrize("m,n,k", SHAPES + [(2048, 1024, 4096)])
def test_kernel_matches_oracle(m, n, k, b_block_rows, out_dtype):
  args = codes_and_scales(7 * m + k, m, n, k, b_block_rows)
  got = jax.jit(lambda *a: bg.block_fp8_gemm(*a, b_block_rows=b_block_rows, out_dtype=out_dtype))(
    *args
  )
  bf16_rounding = 2.0**-9 if out_dtype == jnp.bfloat16 else 0.0
  assert relative_error(got, oracle(*args, b_block_rows)) <= FP8_MMA_TOLERANCE + bf16_rounding


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("b_block", ["128x128", "1x128"])
def test_gemm_dispatch_uses_kernel(b_block):
  """fp8_block operands through ops.gemm: the kernel, within FP8 accumulation of the reference."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((512, 1024)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((768, 1024)), jnp.bfloat16)
  a = reference.quantize(x, BlockFloat8Quantizer(block="1x128"), ("rowwise",)).rowwise
  b = reference.quantize(w, BlockFloat8Quantizer(block=b_block), ("rowwise",)).rowwise
  run = jax.jit(lambda a, b: gemm_ops.gemm(a, b, out_dtype=jnp.float32))
  assert "jaxquant_block_fp8_gemm" in run.lower(a, b).as_text()
  want = np.asarray(jax.jit(lambda a, b: gemm_ops.reference_gemm(a, b))(a, b), np.float64)
  assert relative_error(run(a, b), want) <= FP8_MMA_TOLERANCE


# (A spec, B spec, N, B's block rows, A stays row-sharded, B stays row-sharded): rows stay
# sharded when each shard holds whole 128-row tiles (or 16 rows); a K split in one operand
# or into partial blocks (K = 384 here), a split inside a tile, and one mesh axis on both
# operands' rows are resharded (None: either).
SHARDED_CASES = [
  (("data", None), ("model", None), 512, 128, True, True),
  (("data", None), (None, None), 512, 128, True, None),
  (("data", None), ("model", None), 64, 1, True, True),
  ((None, "model"), (None, None), 512, 128, None, None),
  (("data", None), ("model", None), 384, 128, True, False),
  (("data", None), ("data", None), 512, 128, None, None),
]


def _mesh(devices):
  from jax.sharding import Mesh

  return Mesh(np.array(devices).reshape(2, 4), ("data", "model"))


@pytest.mark.parametrize("a_spec,b_spec,n,b_block_rows,a_kept,b_kept", SHARDED_CASES, ids=str)
def test_sharded_operands_give_the_unsharded_result(
  eight_devices, a_spec, b_spec, n, b_block_rows, a_kept, b_kept
):
  """The same numbers as one device, up to the fp32 summation order (the reference dot's
  blocking follows the shard's shape)."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = _mesh(eight_devices)
  a, b, sa, sb = codes_and_scales(9, 256, n, 384, b_block_rows)
  run = jax.jit(lambda *args: bg.block_fp8_gemm(*args, b_block_rows=b_block_rows))
  want = np.asarray(run(a, b, sa, sb), np.float64)
  shard = lambda x, spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  args = (shard(a, a_spec), shard(b, b_spec), shard(sa, (a_spec[0], None)), sb)
  assert relative_error(run(*args), want) <= 1e-6


@pytest.mark.parametrize("a_spec,b_spec,n,b_block_rows,a_kept,b_kept", SHARDED_CASES, ids=str)
def test_partition_keeps_whole_block_rows_sharded(
  eight_devices, a_spec, b_spec, n, b_block_rows, a_kept, b_kept
):
  """What each device gets: its rows of A and of B when they split into whole blocks, and
  the whole of K (which no case splits into whole blocks alike). (Checked on the
  partitioner itself: on the CPU, XLA may optimise a gather of the reference lowering away,
  which it cannot do around the CUDA kernel.)"""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = _mesh(eight_devices)
  m, k = 256, 384
  kb, nb = -(-k // 128), -(-n // b_block_rows)
  shape = lambda dims, dtype, spec: jax.ShapeDtypeStruct(
    dims, dtype, sharding=NamedSharding(mesh, P(*spec))
  )
  arg_shapes = [
    shape((m, k), E4M3, a_spec),
    shape((n, k), E4M3, b_spec),
    shape((kb, m), jnp.float32, (None, a_spec[0])),
    shape((kb, nb), jnp.float32, (None, None)),
  ]
  config = bg.BlockGemmConfig(b_block_rows=b_block_rows, out_dtype="float32")
  (a_got, b_got, sa_got, sb_got), (out,), _ = bg._partition(config, mesh, arg_shapes, None)
  rows = lambda spec: (tuple(spec) + (None,))[0]
  for what, got, want_spec, kept in (("A", a_got, a_spec, a_kept), ("B", b_got, b_spec, b_kept)):
    assert (tuple(got) + (None, None))[1] is None, f"{what}'s K must be whole"
    if kept is not None:
      assert rows(got) == (want_spec[0] if kept else None), f"{what}: {got}"
  assert rows(tuple(sa_got)[1:]) == rows(a_got) and rows(tuple(sb_got)[1:]) == rows(b_got)
  assert tuple(out) == (rows(a_got), rows(b_got))[: len(tuple(out))]


# (A spec, B spec, B's block rows): K = 1024 split alike into whole 128-deep blocks.
SPLIT_K_CASES = [
  ((None, "data"), (None, "data"), 1),
  ((None, "model"), (None, "model"), 128),
  (("data", "model"), (None, "model"), 1),
]


@pytest.mark.parametrize("a_spec,b_spec,b_block_rows", SPLIT_K_CASES, ids=str)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_split_k_stays_split_and_gives_the_unsharded_result(
  eight_devices, a_spec, b_spec, b_block_rows, out_dtype
):
  """Each device takes its k-blocks of both operands and of their scales; the partial
  products are added (in the output dtype: within a bf16 ulp, normwise, where it is bf16)."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = _mesh(eight_devices)
  m, n, k = 256, 512, 1024
  a, b, sa, sb = codes_and_scales(11, m, n, k, b_block_rows)
  shape = lambda dims, dtype, spec: jax.ShapeDtypeStruct(
    dims, dtype, sharding=NamedSharding(mesh, P(*spec))
  )
  config = bg.BlockGemmConfig(b_block_rows=b_block_rows, out_dtype=jnp.dtype(out_dtype).name)
  # The primitive takes the scales MN-major: [K / 128, M] and [K / 128, N / block rows].
  arg_shapes = [
    shape(a.shape, a.dtype, a_spec),
    shape(b.shape, b.dtype, b_spec),
    shape(sa.T.shape, jnp.float32, (a_spec[1], a_spec[0])),
    shape(sb.T.shape, jnp.float32, (b_spec[1], None)),
  ]
  (a_got, b_got, sa_got, sb_got), _, _ = bg._partition(config, mesh, arg_shapes, None)
  k_of = lambda spec: (tuple(spec) + (None, None))[1]
  assert k_of(a_got) == k_of(b_got) == a_spec[1]
  assert tuple(sa_got)[0] == tuple(sb_got)[0] == a_spec[1]
  run = jax.jit(
    lambda *args: bg.block_fp8_gemm(*args, b_block_rows=b_block_rows, out_dtype=out_dtype)
  )
  want = np.asarray(run(a, b, sa, sb), np.float64)
  shard = lambda x, spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  args = (shard(a, a_spec), shard(b, b_spec), shard(sa, a_spec), shard(sb, (None, b_spec[1])))
  hlo = run.lower(*args).compile().as_text()
  assert "all-gather" not in hlo and "all-reduce" in hlo
  got = np.asarray(run(*args), np.float64)
  assert relative_error(got, want) <= (1e-6 if out_dtype == jnp.float32 else 2.0**-8)
