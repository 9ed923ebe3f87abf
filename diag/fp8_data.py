"""Diagnostic (not committed): does the FP8 GEMM's speed depend on the operand values?"""
import statistics, time, subprocess, threading
import jax, jax.numpy as jnp, numpy as np

def time_ms(fn, *args, reps=20, rounds=5):
  jax.block_until_ready(fn(*args)); jax.block_until_ready(fn(*args))
  s = []
  for _ in range(rounds):
    t = time.perf_counter()
    for _ in range(reps): out = fn(*args)
    jax.block_until_ready(out); s.append((time.perf_counter() - t) / reps * 1e3)
  return statistics.median(s)

def clocks():
  out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
  return out

def main():
  dn = (((1,), (1,)), ((), ()))
  M = N = K = 8192
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (M, K), jnp.float32)
  b = jax.random.normal(kb, (N, K), jnp.float32)
  s1 = jax.jit(lambda x, y, s, t: (jax.lax.dot_general(x, y, dn, preferred_element_type=jnp.float32) * (s * t)).astype(jnp.bfloat16))
  bf = jax.jit(lambda x, y: jax.lax.dot_general(x, y, dn))
  one = jnp.float32(1)
  cases = {
    "N(0,1) codes": (a, b),
    "amax->448 codes": (a * (448 / jnp.max(jnp.abs(a))), b * (448 / jnp.max(jnp.abs(b)))),
    "amax->448 x16 (scaled N(0,16))": (a * 16, b * 16),
    "uniform(-448,448)": (jax.random.uniform(ka, (M, K), minval=-448, maxval=448), jax.random.uniform(kb, (N, K), minval=-448, maxval=448)),
    "zeros": (jnp.zeros((M, K)), jnp.zeros((N, K))),
  }
  for name, (x, y) in cases.items():
    x8, y8 = x.astype(jnp.float8_e4m3fn), y.astype(jnp.float8_e4m3fn)
    ms = time_ms(s1, x8, y8, one, one)
    c = clocks()
    msb = time_ms(bf, x.astype(jnp.bfloat16), y.astype(jnp.bfloat16))
    cb = clocks()
    print(f"{name:32s} fp8 {ms:.3f} ms ({2*M*N*K/ms/1e9:.0f} TF/s) [{c}]   bf16 {msb:.3f} ms ({2*M*N*K/msb/1e9:.0f} TF/s) [{cb}]  ratio {msb/ms:.2f}", flush=True)

if __name__ == "__main__":
  main()
