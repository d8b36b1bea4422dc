"""Chunked prefill on a Hopper GPU, at serving sizes (skipped without one).

The queries are the last T tokens of each row's context
(`causal_alignment="bottom_right"` with per-row cache lengths, so every row's
causal band sits at its own offset kv_len - T):

* 1024 new tokens per row after caches of different lengths (8192 slots),
  GQA 32/8, D128, bf16: the sm90 kernels serve it ("sm90"); forward and
  gradients equal an f32 einsum with the band built naively.
* A sliding window (4096 keys) over a ragged cache, 16 tokens per row.
* The same chunked prefill against a paged cache (pages of 64 at shuffled
  physical positions), read through the page table by the forward kernel.

bf16 tolerances: one bf16 rounding of P and of the output (forward), of dS
and of the gradients (backward); the reference sees the same bf16 inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from reference import einsum_attention

ON_HOPPER = (jax.devices()[0].platform == "gpu"
             and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9"))
pytestmark = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def _inputs(seed, b, t, s):
  keys = jax.random.split(jax.random.key(seed), 4)
  draw = lambda key, shape: jax.random.normal(key, shape).astype(jnp.bfloat16)
  return (draw(keys[0], (b, t, HEADS, HEAD_DIM)), draw(keys[1], (b, s, KV_HEADS, HEAD_DIM)),
          draw(keys[2], (b, s, KV_HEADS, HEAD_DIM)), draw(keys[3], (b, t, HEADS, HEAD_DIM)))


def _band(t, s, lengths, window_left=None):
  """[B, 1, T, S]: query i of row b sits at lengths[b] - T + i and sees keys
  j <= it (and >= it - window_left), j < lengths[b]."""
  lengths = np.asarray(lengths)
  pos = (lengths[:, None] - t + np.arange(t)[None, :])[:, None, :, None]
  j = np.arange(s)[None, None, None, :]
  visible = (j <= pos) & (j < lengths[:, None, None, None])
  if window_left is not None:
    visible &= j >= pos - window_left
  return visible


def _close(got, want, scale=1.0):
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want),
                             atol=2e-2 * scale, rtol=2e-2)


def test_chunked_prefill_after_caches_of_different_lengths_forward_and_gradients():
  b, t, s = 2, 1024, 8192
  q, k, v, dout = _inputs(0, b, t, s)
  lengths = jnp.asarray([8192, 3000], jnp.int32)
  options = dict(is_causal=True, causal_alignment="bottom_right", key_value_seq_lengths=lengths)
  assert fa4_jax.which_implementation(q, k, v, **options) == "sm90"
  visible = _band(t, s, lengths)
  loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)
                                            * dout.astype(jnp.float32)))
  ours = lambda q, k, v: fa4_jax.attention(q, k, v, **options)
  theirs = lambda q, k, v: einsum_attention(q, k, v, visible)[0]
  _close(jax.jit(ours)(q, k, v), jax.jit(theirs)(q, k, v))
  got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss(theirs), argnums=(0, 1, 2)))(q, k, v)
  for g, w in zip(got, want):
    _close(g, w, scale=max(1.0, float(jnp.abs(w).max())))


def test_sliding_window_over_a_ragged_cache():
  b, t, s, window = 4, 16, 16384, 4096
  q, k, v, _ = _inputs(1, b, t, s)
  lengths = jnp.asarray([16384, 9000, 16, 5000], jnp.int32)
  options = dict(is_causal=True, local_window_size=(window, 0), causal_alignment="bottom_right",
                 key_value_seq_lengths=lengths)
  assert fa4_jax.which_implementation(q, k, v, **options) == "sm90"
  out = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, **options))(q, k, v)
  _close(out, jax.jit(lambda q, k, v: einsum_attention(
      q, k, v, _band(t, s, lengths, window))[0])(q, k, v))


def test_chunked_prefill_against_a_paged_cache():
  b, t, s, page_size = 2, 512, 8192, 64
  q, k, v, _ = _inputs(2, b, t, s)
  lengths = jnp.asarray([6000, 700], jnp.int32)
  pages = s // page_size
  order = np.random.default_rng(0).permutation(b * pages)  # logical page -> physical
  table = jnp.asarray(order.reshape(b, pages), jnp.int32)
  inverse = jnp.asarray(np.argsort(order))
  to_pages = lambda x: x.reshape(b * pages, page_size, KV_HEADS, HEAD_DIM)[inverse]
  kp, vp = to_pages(k), to_pages(v)
  assert fa4_jax.which_paged_implementation(q, kp, vp, table, lengths) == "sm90"
  out = jax.jit(lambda q, kp, vp: fa4_jax.paged_attention(q, kp, vp, table, lengths))(q, kp, vp)
  _close(out, jax.jit(lambda q, k, v: einsum_attention(q, k, v, _band(t, s, lengths))[0])(q, k, v))
