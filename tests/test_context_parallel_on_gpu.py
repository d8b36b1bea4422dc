"""Context-parallel attention with sinks and soft-cap, with segment ids, and
with a score_mod and a block mask, on Hopper GPUs (skipped without two).

The CPU tests (test_context_parallel.py, test_segment_ids.py) check the
ring's algebra on host devices through the XLA path, and the ring with ids
through the kernels in the interpreter on one device; here each ring step
runs the sm90 kernels on two GPUs: 4k tokens, GQA 8/2, D128, bf16, causal,
load-balanced. Output and gradients (and, with sinks, one forward-mode
product) against an f32 einsum on the same bf16 inputs.

bf16 tolerances as in test_sinks_soft_cap_on_gpu.py: one bf16 rounding of
P and of the output over sums of thousands of terms.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fa4_jax
from reference import einsum_attention, packed_segment_ids, relative_error, visible_mask

HOPPERS = [d for d in jax.devices() if d.platform == "gpu"
           and str(getattr(d, "compute_capability", "")).startswith("9")]
pytestmark = pytest.mark.skipif(len(HOPPERS) < 2, reason="needs two Hopper GPUs")


def _load_balanced_ring(devices):
  """(mesh, put, restore): a mesh over the first `devices` GPUs, and the
  moves of a [B, T, ...] array into the load-balanced, sequence-sharded
  layout the ring takes, and back."""
  mesh = jax.make_mesh((devices,), ("seq",), devices=HOPPERS[:devices])
  put = lambda x: jax.device_put(fa4_jax.load_balance(x, devices),
                                 NamedSharding(mesh, P(None, "seq")))
  return mesh, put, lambda x: fa4_jax.unload_balance(x, devices)


def _dot_loss(attend, dout):
  """The scalar whose gradients the tests compare: <attend(*args), dout> in f32."""
  return lambda *a: jnp.sum(attend(*a).astype(jnp.float32) * dout.astype(jnp.float32))


def test_ring_with_sinks_and_soft_cap_matches_an_f32_einsum():
  b, t, n, kv_heads, d, cap, devices = 1, 4096, 8, 2, 128, 30.0, 2
  keys = jax.random.split(jax.random.key(0), 6)
  draw = lambda key, heads: jax.random.normal(key, (b, t, heads, d)).astype(jnp.bfloat16)
  q, k, v, dout = draw(keys[0], n), draw(keys[1], kv_heads), draw(keys[2], kv_heads), draw(
      keys[3], n)
  sinks = 2.0 * jax.random.normal(keys[4], (n,), jnp.float32)
  tangent = draw(keys[5], n)
  mesh, put, restore = _load_balanced_ring(devices)

  def ring(q, k, v, s):
    return fa4_jax.context_parallel_attention(q, k, v, mesh=mesh, axis_name="seq",
                                              is_causal=True, sinks=s, logits_soft_cap=cap)

  # An argument of the jitted reference, not a constant XLA would fold.
  visible = jnp.asarray(visible_mask(t, t, is_causal=True))

  def reference(q, k, v, s, visible):
    return einsum_attention(q, k, v, visible, sinks=s, soft_cap=cap)[0]

  out = restore(jax.jit(ring)(put(q), put(k), put(v), sinks))
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.asarray(reference(q, k, v, sinks, visible)), atol=2e-2, rtol=2e-2)

  got = jax.jit(jax.grad(_dot_loss(ring, put(dout)), argnums=(0, 1, 2, 3)))(
      put(q), put(k), put(v), sinks)
  want = jax.jit(jax.grad(_dot_loss(reference, dout), argnums=(0, 1, 2, 3)))(
      q, k, v, sinks, visible)
  for g, w, label in zip(got, want, ["q", "k", "v", "sinks"]):
    g = np.asarray(restore(g) if g.ndim == 4 else g, np.float32)
    w = np.asarray(w)
    assert np.all(np.isfinite(g)), label
    assert relative_error(g, w) < 1e-2, label

  # Forward mode: the tangent ring against the reference's jvp (q's tangent).
  _, got_dot = jax.jit(lambda q, k, v, t: jax.jvp(lambda q: ring(q, k, v, sinks), (q,), (t,)))(
      put(q), put(k), put(v), put(tangent))
  _, want_dot = jax.jvp(lambda q: reference(q, k, v, sinks, visible), (q,), (tangent,))
  assert relative_error(restore(got_dot), want_dot) < 2e-2


def test_ring_with_segment_ids_matches_an_f32_einsum():
  """Packed rows through the ring: each step's kernels mask with the ids of
  the chunk the device holds. Documents cross the load-balanced chunks'
  boundaries (every 1024 tokens), one is a single token, and the padding
  queries carry an id no key has, so they see nothing: zero output, zero
  and finite gradients."""
  b, t, n, kv_heads, d, devices = 2, 4096, 8, 2, 128, 2
  keys = jax.random.split(jax.random.key(1), 4)
  draw = lambda key, heads: jax.random.normal(key, (b, t, heads, d)).astype(jnp.bfloat16)
  q, k, v, dout = draw(keys[0], n), draw(keys[1], kv_heads), draw(keys[2], kv_heads), draw(
      keys[3], n)
  q_ids = np.stack([packed_segment_ids([700, 1400, 1, 999, 800], t),     # 196 padding tokens
                    packed_segment_ids([3000, 1000], t, first_id=10)])  # 96
  padding = q_ids == np.array([[5], [12]])  # the ids packed_segment_ids gives the padding
  kv_ids = np.where(padding, -1, q_ids)  # padding keys: an id no query has
  mesh, put, restore = _load_balanced_ring(devices)

  def ring(q, k, v, q_ids, kv_ids):
    return fa4_jax.context_parallel_attention(q, k, v, mesh=mesh, axis_name="seq",
                                              is_causal=True, query_segment_ids=q_ids,
                                              key_value_segment_ids=kv_ids)

  # An argument of the jitted reference, not a constant XLA would fold.
  visible = jnp.asarray(visible_mask(t, t, is_causal=True, batch=b, q_segment_ids=q_ids,
                                     kv_segment_ids=kv_ids))
  reference = lambda q, k, v, visible: einsum_attention(q, k, v, visible)[0]
  ids = (put(jnp.asarray(q_ids)), put(jnp.asarray(kv_ids)))
  out = np.asarray(restore(jax.jit(ring)(put(q), put(k), put(v), *ids)), np.float32)
  want_out = np.asarray(jax.jit(reference)(q, k, v, visible))
  np.testing.assert_allclose(out, want_out, atol=2e-2, rtol=2e-2)
  assert padding.sum() == 292 and np.all(out[padding] == 0)

  got = jax.jit(jax.grad(lambda q, k, v, dout, *ids: _dot_loss(ring, dout)(q, k, v, *ids),
                         argnums=(0, 1, 2)))(put(q), put(k), put(v), put(dout), *ids)
  want = jax.jit(jax.grad(_dot_loss(reference, dout), argnums=(0, 1, 2)))(q, k, v, visible)
  for g, w, label in zip(got, want, ["q", "k", "v"]):
    g = np.asarray(restore(g), np.float32)
    assert np.all(np.isfinite(g)), label
    assert relative_error(g, w) < 1e-2, label
    assert np.all(g[padding] == 0), label  # padding queries and keys meet nothing


def test_ring_with_alibi_and_a_sliding_window_block_mask_matches_an_f32_einsum():
  """The mods at global positions through the sm90 kernels on every ring
  step: ALiBi (a score_mod over per-head slopes) and a 512-token sliding
  window (a global block mask of 128-tiles, sliced per block pair: chunks
  of 1024 tokens, so many pairs are skipped). Output, the gradients of q,
  k, v and the slopes' (summed over the ring)."""
  b, t, n, kv_heads, d, window, devices = 1, 4096, 8, 2, 128, 512, 2
  keys = jax.random.split(jax.random.key(2), 4)
  draw = lambda key, heads: jax.random.normal(key, (b, t, heads, d)).astype(jnp.bfloat16)
  q, k, v, dout = draw(keys[0], n), draw(keys[1], kv_heads), draw(keys[2], kv_heads), draw(
      keys[3], n)
  slopes = 2.0 ** (-8.0 * jnp.arange(1, n + 1, dtype=jnp.float32) / n)
  sliding = lambda b, h, q_idx, kv_idx: q_idx - kv_idx < window
  block_mask = fa4_jax.create_block_mask(sliding, None, None, t, t)
  mesh, put, restore = _load_balanced_ring(devices)

  def ring(q, k, v, slopes):
    alibi = lambda score, b, h, q_idx, kv_idx: score - slopes[h] * jnp.abs(q_idx - kv_idx)
    return fa4_jax.context_parallel_attention(q, k, v, mesh=mesh, axis_name="seq",
                                              is_causal=True, score_mod=alibi,
                                              block_mask=block_mask, implementation="sm90")

  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  # Arguments of the jitted reference, not constants XLA would fold.
  visible = jnp.asarray((j <= i) & (i - j < window))
  distance = jnp.asarray(np.abs(i - j), jnp.float32)

  def reference(q, k, v, slopes, visible, distance):
    bias = -slopes[None, :, None, None] * distance
    return einsum_attention(q, k, v, visible, bias=bias)[0]

  out = restore(jax.jit(ring)(put(q), put(k), put(v), slopes))
  want = jax.jit(reference)(q, k, v, slopes, visible, distance)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=2e-2,
                             rtol=2e-2)

  got = jax.jit(jax.grad(_dot_loss(ring, put(dout)), argnums=(0, 1, 2, 3)))(
      put(q), put(k), put(v), slopes)
  want = jax.jit(jax.grad(_dot_loss(reference, dout), argnums=(0, 1, 2, 3)))(
      q, k, v, slopes, visible, distance)
  for g, w, label in zip(got, want, ["q", "k", "v", "slopes"]):
    g = np.asarray(restore(g) if g.ndim == 4 else g, np.float32)
    assert np.all(np.isfinite(g)), label
    assert relative_error(g, w) < 2e-2, label
