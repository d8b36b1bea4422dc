"""`causal_alignment`: where the causal diagonal and windows sit.

Specification:
* "top_left" (the default, jax.nn's): query i sits at position i.
* "bottom_right": each batch row's last valid query (query_seq_lengths, else
  T) is aligned with its last valid key (key_value_seq_lengths, else S):
  query i sits at position i + kv_len - q_len. Forward and gradients equal
  an f32 einsum with that mask built naively, for causal masks and windows,
  with and without lengths, T < S and T > S, GQA, bf16.
* Without lengths the shift is static; with lengths each row has its own
  (chunked prefill against a cache of per-row lengths). The kernels serve
  both: the sm90 forward and backward and the sm100 forward, interpreted
  with race detection, equal the naive mask. A one-token causal query with
  lengths sees every valid key (the decode arrangement serves it), and so
  do causal queries of up to 256 packed rows (T x query heads per KV head).
* Flax: make_attention_fn(is_causal=True, causal_alignment="bottom_right")
  serves a query shorter than the keys (cached decoding).
* A bad value is a ValueError naming the argument; cuDNN (jax.nn) has no
  such argument and says so.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
import fa4_jax.flax
from reference import einsum_attention


def _inputs(seed, b, t, s, n, kv_heads, d, dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(keys[0], (b, t, n, d), dtype),
          jax.random.normal(keys[1], (b, s, kv_heads, d), dtype),
          jax.random.normal(keys[2], (b, s, kv_heads, d), dtype),
          jax.random.normal(keys[3], (b, t, n, d), dtype))


def _bottom_right(b, t, s, q_len, kv_len, left=None, right=0):
  """[B, 1, T, S]: query i at position i + kv_len - q_len sees key j when
  pos - left <= j <= pos + right, j < kv_len and i < q_len."""
  q_len = np.full(b, t) if q_len is None else np.asarray(q_len)
  kv_len = np.full(b, s) if kv_len is None else np.asarray(kv_len)
  visible = np.zeros((b, 1, t, s), bool)
  for r in range(b):
    for i in range(q_len[r]):
      pos = i + kv_len[r] - q_len[r]
      for j in range(kv_len[r]):
        visible[r, 0, i, j] = ((left is None or j >= pos - left)
                               and (right is None or j <= pos + right))
  return visible


@pytest.mark.parametrize("name, t, s, options, band", [
    ("causal T<S", 5, 12, dict(is_causal=True), dict()),
    ("causal T>S", 9, 6, dict(is_causal=True), dict()),
    ("window", 7, 20, dict(local_window_size=(3, 1)), dict(left=3, right=1)),
    ("causal lengths", 6, 14, dict(is_causal=True, query_seq_lengths=(4, 6),
                                   key_value_seq_lengths=(9, 14)), dict()),
    ("causal window kv lengths", 4, 16, dict(is_causal=True, local_window_size=(5, 2),
                                             key_value_seq_lengths=(11, 3)),
     dict(left=5, right=0)),
])
def test_bottom_right_matches_the_mask_built_naively(name, t, s, options, band):
  b, n, kv_heads, d = 2, 4, 2, 8
  q, k, v, dout = _inputs(len(name), b, t, s, n, kv_heads, d)
  visible = _bottom_right(b, t, s, options.get("query_seq_lengths"),
                          options.get("key_value_seq_lengths"), **band)
  lengths = {key: jnp.asarray(x, jnp.int32) for key, x in options.items()
             if key.endswith("lengths")}
  flags = {key: x for key, x in options.items() if not key.endswith("lengths")}
  ours = lambda q, k, v: fa4_jax.attention(q, k, v, causal_alignment="bottom_right", **flags,
                                           **lengths)
  theirs = lambda q, k, v: einsum_attention(q, k, v, visible)[0]
  np.testing.assert_allclose(np.asarray(jax.jit(ours)(q, k, v)), np.asarray(theirs(q, k, v)),
                             atol=2e-5, rtol=2e-5)
  loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v) * dout))
  got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
  want = jax.grad(loss(theirs), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5)


def test_top_left_stays_the_default():
  q, k, v, _ = _inputs(0, 1, 4, 9, 2, 2, 8)
  default = fa4_jax.attention(q, k, v, is_causal=True)
  top_left = fa4_jax.attention(q, k, v, is_causal=True, causal_alignment="top_left")
  want, _ = einsum_attention(q, k, v, np.tril(np.ones((4, 9), bool))[None, None])
  np.testing.assert_allclose(np.asarray(default), np.asarray(want), atol=2e-5)
  np.testing.assert_array_equal(np.asarray(default), np.asarray(top_left))


def test_kernels_serve_static_shifts_and_one_token_decoding():
  with fa4_jax.interpret_mode():
    # 65 tokens x 4 query heads per KV head: more rows than the decode
    # arrangement packs (`tests/test_decode_causal.py`: up to 256 it serves).
    q, k, v, _ = _inputs(1, 2, 65, 256, 8, 2, 64, jnp.bfloat16)
    assert fa4_jax.which_implementation(q, k, v, is_causal=True, causal_alignment="bottom_right",
                                        implementation="sm90") == "sm90"
    assert fa4_jax.which_implementation(q[:, :64], k, v, is_causal=True,
                                        causal_alignment="bottom_right",
                                        implementation="sm90") == "sm90_decode"
    one = q[:, :1]
    lengths = jnp.asarray([200, 17], jnp.int32)
    assert fa4_jax.which_implementation(one, k, v, is_causal=True, key_value_seq_lengths=lengths,
                                        causal_alignment="bottom_right",
                                        implementation="sm90") == "sm90_decode"
    assert fa4_jax.which_implementation(q, k, v, is_causal=True, key_value_seq_lengths=lengths,
                                        causal_alignment="bottom_right",
                                        implementation="sm90") == "sm90"


# Per-row shifts in the kernels: chunked prefill (each row's chunk of
# queries after its own cached prefix) and a sliding window over a ragged
# cache. Row 1's offsets differ from row 0's, and its chunk is shorter.
KERNEL_CASES = {
    "chunked_prefill_causal_gqa": (48, 200, dict(is_causal=True, query_seq_lengths=(48, 23),
                                                 key_value_seq_lengths=(200, 77)), dict()),
    "sliding_window_ragged_cache": (24, 136, dict(is_causal=True, local_window_size=(40, 0),
                                                  key_value_seq_lengths=(136, 50)),
                                    dict(left=40, right=0)),
}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_sm90_kernels_align_each_row_by_its_lengths(name, run_interpreted):
  t, s, options, band = KERNEL_CASES[name]
  _check_kernel(name, t, s, options, band, "sm90", run_interpreted, with_grads=True)


def test_sm100_forward_aligns_each_row_by_its_lengths(run_interpreted):
  t, s, options, band = KERNEL_CASES["chunked_prefill_causal_gqa"]
  _check_kernel("sm100", t, s, options, band, "sm100", run_interpreted, with_grads=False)


def _check_kernel(name, t, s, options, band, implementation, run_interpreted, with_grads):
  b, n, kv_heads, d = 2, 4, 2, 64
  q, k, v, dout = _inputs(len(name), b, t, s, n, kv_heads, d, jnp.bfloat16)
  visible = _bottom_right(b, t, s, options.get("query_seq_lengths"),
                          options.get("key_value_seq_lengths"), **band)
  lengths = {key: jnp.asarray(x, jnp.int32) for key, x in options.items()
             if key.endswith("lengths")}
  flags = {key: x for key, x in options.items() if not key.endswith("lengths")}
  ours = lambda q, k, v: fa4_jax.attention(q, k, v, causal_alignment="bottom_right",
                                           implementation=implementation, **flags, **lengths)
  theirs = lambda q, k, v: einsum_attention(q, k, v, visible)[0]
  loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)
                                            * dout.astype(jnp.float32)))
  both = lambda f: (f(q, k, v), jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v) if with_grads
                    else ())
  got_out, got_grads = run_interpreted(lambda: both(ours))
  want_out, want_grads = both(theirs)
  # bf16 inputs and P: errors of a few bf16 ulps of the largest values.
  np.testing.assert_allclose(np.asarray(got_out, np.float32), np.asarray(want_out),
                             atol=2e-2, rtol=2e-2)
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w),
                               atol=2e-2 * max(1.0, float(jnp.abs(w).max())), rtol=2e-2)


def test_one_token_bottom_right_causal_sees_every_valid_key():
  q, k, v, _ = _inputs(2, 2, 1, 40, 4, 1, 16)
  lengths = jnp.asarray([40, 13], jnp.int32)
  got = fa4_jax.attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths,
                          causal_alignment="bottom_right")
  visible = np.arange(40)[None, None, None, :] < np.asarray(lengths)[:, None, None, None]
  np.testing.assert_allclose(np.asarray(got), np.asarray(einsum_attention(q, k, v, visible)[0]),
                             atol=2e-5)


def test_flax_cached_decoding_with_a_bottom_right_causal_mask():
  q, k, v, _ = _inputs(3, 2, 1, 24, 4, 4, 8)
  causal = fa4_jax.flax.make_attention_fn(is_causal=True, causal_alignment="bottom_right")
  got = causal(q, k, v)
  np.testing.assert_allclose(np.asarray(got), np.asarray(einsum_attention(
      q, k, v, np.ones((1, 1, 1, 24), bool))[0]), atol=2e-5)
  with pytest.raises(ValueError, match="causal_alignment='bottom_right'"):
    fa4_jax.flax.make_attention_fn(is_causal=True)(q, k, v)


def test_bad_alignments_raise_naming_the_argument():
  q, k, v, _ = _inputs(4, 1, 4, 4, 2, 2, 8)
  with pytest.raises(ValueError, match="`causal_alignment` must be one of"):
    fa4_jax.attention(q, k, v, is_causal=True, causal_alignment="bottom")
  with pytest.raises(ValueError, match="`causal_alignment`"):
    fa4_jax.attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                      implementation="cudnn")
