"""Context-parallel attention with sinks and soft-cap on Hopper GPUs (skipped
without two).

The CPU tests (test_context_parallel.py) check the ring's algebra on host
devices through the XLA path; here each ring step runs the sm90 kernels:
B1 x 4k tokens, GQA 8/2, D128, bf16, causal, load-balanced over 2 GPUs.
Output, the gradients of q, k, v and the sinks, and one forward-mode
product against an f32 einsum on the same bf16 inputs.

bf16 tolerances as in test_sinks_soft_cap_on_gpu.py: one bf16 rounding of
P and of the output over sums of thousands of terms.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fa4_jax
from reference import einsum_attention, relative_error, visible_mask

HOPPERS = [d for d in jax.devices() if d.platform == "gpu"
           and str(getattr(d, "compute_capability", "")).startswith("9")]
pytestmark = pytest.mark.skipif(len(HOPPERS) < 2, reason="needs two Hopper GPUs")


def test_ring_with_sinks_and_soft_cap_matches_an_f32_einsum():
  b, t, n, kv_heads, d, cap, devices = 1, 4096, 8, 2, 128, 30.0, 2
  keys = jax.random.split(jax.random.key(0), 6)
  draw = lambda key, heads: jax.random.normal(key, (b, t, heads, d)).astype(jnp.bfloat16)
  q, k, v, dout = draw(keys[0], n), draw(keys[1], kv_heads), draw(keys[2], kv_heads), draw(
      keys[3], n)
  sinks = 2.0 * jax.random.normal(keys[4], (n,), jnp.float32)
  tangent = draw(keys[5], n)
  mesh = jax.make_mesh((devices,), ("seq",), devices=HOPPERS[:devices])
  put = lambda x: jax.device_put(fa4_jax.load_balance(x, devices),
                                 NamedSharding(mesh, P(None, "seq")))
  restore = lambda x: fa4_jax.unload_balance(x, devices)

  def ring(q, k, v, s):
    return fa4_jax.context_parallel_attention(q, k, v, mesh=mesh, axis_name="seq",
                                              is_causal=True, sinks=s, logits_soft_cap=cap)

  visible = visible_mask(t, t, is_causal=True)

  def reference(q, k, v, s):
    return einsum_attention(q, k, v, visible, sinks=s, soft_cap=cap)[0]

  loss = lambda attend, dout: (lambda *a: jnp.sum(attend(*a).astype(jnp.float32)
                                                  * dout.astype(jnp.float32)))
  out = restore(jax.jit(ring)(put(q), put(k), put(v), sinks))
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.asarray(reference(q, k, v, sinks)), atol=2e-2, rtol=2e-2)

  got = jax.jit(jax.grad(loss(ring, put(dout)), argnums=(0, 1, 2, 3)))(
      put(q), put(k), put(v), sinks)
  want = jax.jit(jax.grad(loss(reference, dout), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
  for g, w, label in zip(got, want, ["q", "k", "v", "sinks"]):
    g = np.asarray(restore(g) if g.ndim == 4 else g, np.float32)
    w = np.asarray(w)
    assert np.all(np.isfinite(g)), label
    assert relative_error(g, w) < 1e-2, label

  # Forward mode: the tangent ring against the reference's jvp (q's tangent).
  _, got_dot = jax.jit(lambda q, k, v, t: jax.jvp(lambda q: ring(q, k, v, sinks), (q,), (t,)))(
      put(q), put(k), put(v), put(tangent))
  _, want_dot = jax.jvp(lambda q: reference(q, k, v, sinks), (q,), (tangent,))
  assert relative_error(restore(got_dot), want_dot) < 2e-2
