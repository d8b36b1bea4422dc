"""fa4_jax in one page: attention on whatever device is here, checked against jax.nn.

    python examples/quickstart.py

On a Hopper or Blackwell GPU the Mosaic GPU kernel serves the call when it
supports the arguments; elsewhere the XLA path does. Either way the output and
gradients are compared with jax.nn.dot_product_attention: its XLA path
everywhere, and on a GPU also its cuDNN path (the usual alternative there).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

import fa4_jax


def main():
  device = jax.devices()[0]
  on_gpu = device.platform == "gpu"
  # A transformer-sized call on a GPU, a smaller one on the CPU.
  batch, seq, heads, kv_heads, head_dim = (4, 4096, 16, 4, 128) if on_gpu else (2, 1024, 8, 2, 64)
  dtype = jnp.bfloat16
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(batch, seq, heads, head_dim)), dtype)
  k = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, head_dim)), dtype)
  v = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, head_dim)), dtype)

  impl = fa4_jax.which_implementation(q, k, v, is_causal=True)
  print(f"device: {device.device_kind} ({device.platform}); fa4_jax implementation: {impl}")
  print(f"shape: batch={batch} seq={seq} heads={heads}/{kv_heads} (GQA) head_dim={head_dim} "
        f"{jnp.dtype(dtype).name}, causal")

  ours = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=True))
  contestants = {"fa4_jax": ours, "jax.nn xla": jax.jit(
      lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"))}
  if on_gpu:
    contestants["jax.nn cudnn"] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn"))
  # The exact answer, for judging both: f32 inputs, f32 arithmetic.
  f32 = lambda x: x.astype(jnp.float32)
  exact = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      f32(q), f32(k), f32(v), is_causal=True))(q, k, v)

  for name, fn in contestants.items():
    try:
      out = jax.block_until_ready(fn(q, k, v))  # compile + warm up
    except Exception as e:  # e.g. cuDNN missing or too old for this GPU
      print(f"  {name:12s} unavailable here: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
      continue
    start = time.perf_counter()
    for _ in range(5):
      out = fn(q, k, v)
    jax.block_until_ready(out)
    ms = (time.perf_counter() - start) / 5 * 1e3
    err = float(jnp.abs(f32(out) - exact).max())
    print(f"  {name:12s} forward {ms:8.2f} ms (wall clock)   max |error| vs f32: {err:.4f}")

  loss = lambda f: jax.jit(jax.grad(lambda q, k, v: jnp.sum(f32(f(q, k, v)) ** 2), (0, 1, 2)))
  g_ours = loss(lambda *a: fa4_jax.attention(*a, is_causal=True))(q, k, v)
  g_theirs = loss(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True,
                                                          implementation="xla"))(q, k, v)
  for name, a, b in zip(("dq", "dk", "dv"), g_ours, g_theirs):
    rel = float(jnp.linalg.norm(f32(a) - f32(b)) / jnp.linalg.norm(f32(b)))
    print(f"  {name}: relative difference to jax.nn's XLA path {rel:.2e}")
    assert rel < 2e-2, f"{name} differs from jax.nn by {rel}"
  print("ok: fa4_jax agrees with jax.nn.dot_product_attention")


if __name__ == "__main__":
  main()
