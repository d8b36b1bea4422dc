"""Decoding on a Hopper GPU, at serving sizes (skipped without one).

* One new token per row against a 32k-slot cache with per-row lengths (one
  of them 0), bottom-right causal, GQA 32/8, D128, bf16: served by the decode
  arrangement ("sm90_decode"), equal to an f32 einsum; the row without keys
  gives zeros.
* 16 speculative tokens with per-row query lengths, no mask; and a 131k-token
  cache of one row (16 chunks), with sinks and soft-cap.
* 16 and 64 new tokens causal bottom-right (speculative decoding, a short
  chunk of a chunked prefill) against a 32k-slot cache, contiguous and paged
  (pages of 16 and 64): the decode arrangement, equal to an f32 einsum with
  the bottom-right band; lengths 0, shorter than T and with the last T keys
  across a chunk boundary.
* A paged cache (pages of 16 and 64 tokens at shuffled physical positions)
  read through the page table by the kernel ("sm90"), equal to the einsum on
  the same cache laid out contiguously.
* MQA 8/1 and GQA 64/8 at one token (groups of a multiple of 8 query heads,
  which the kernel reads in place, `sm90_decode.reads_query_in_place`), split
  into chunks, contiguous and paged, with per-row lengths.
* Flax NNX cached decoding (`decode=True`) through `fa4_jax.flax`: its cache
  mask runs as key lengths on the decode arrangement, equal to Flax's
  default attention.

bf16 tolerances: one bf16 rounding of P and of each chunk's output, then the
merge in f32; the reference sees the same bf16 inputs.
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


def _inputs(seed, b, t, s, n, kv_heads, d):
  keys = jax.random.split(jax.random.key(seed), 3)
  draw = lambda key, shape, shift=0.0: (shift + jax.random.normal(key, shape)).astype(jnp.bfloat16)
  return (draw(keys[0], (b, t, n, d)), draw(keys[1], (b, s, kv_heads, d)),
          draw(keys[2], (b, s, kv_heads, d), 1.0))


def _check(out, want):
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=2e-2, rtol=2e-2)


def test_one_token_against_a_32k_cache_with_per_row_lengths():
  b, s, n, kv_heads, d = 4, 32768, 32, 8, 128
  q, k, v = _inputs(0, b, 1, s, n, kv_heads, d)
  lengths = jnp.asarray([32768, 17000, 0, 513], jnp.int32)
  options = dict(is_causal=True, causal_alignment="bottom_right", key_value_seq_lengths=lengths)
  assert fa4_jax.which_implementation(q, k, v, **options) == "sm90_decode"
  out = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, **options))(q, k, v)
  visible = np.arange(s)[None, None, None, :] < np.asarray(lengths)[:, None, None, None]
  _check(out, einsum_attention(q, k, v, visible)[0])
  assert np.all(np.asarray(out[2], np.float32) == 0)


def test_sixteen_speculative_tokens_with_query_lengths():
  b, t, s, n, kv_heads, d = 4, 16, 8192, 32, 8, 128
  q, k, v = _inputs(1, b, t, s, n, kv_heads, d)
  q_len, kv_len = jnp.asarray([16, 3, 16, 1], jnp.int32), jnp.asarray([8192, 4000, 16, 100],
                                                                        jnp.int32)
  options = dict(query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
  assert fa4_jax.which_implementation(q, k, v, **options) == "sm90_decode"
  out = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, **options))(q, k, v)
  visible = ((np.arange(t)[None, :, None] < np.asarray(q_len)[:, None, None])
             & (np.arange(s)[None, None, :] < np.asarray(kv_len)[:, None, None]))[:, None]
  _check(out, einsum_attention(q, k, v, visible)[0])


def test_a_131k_cache_in_sixteen_chunks_with_sinks_and_soft_cap():
  b, s, n, kv_heads, d = 1, 131072, 32, 8, 128
  q, k, v = _inputs(2, b, 1, s, n, kv_heads, d)
  sinks = jnp.linspace(-3.0, 3.0, n, dtype=jnp.float32)
  options = dict(sinks=sinks, logits_soft_cap=20.0)
  assert fa4_jax.which_implementation(q, k, v, **options) == "sm90_decode"
  out = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, **options))(q, k, v)
  want, _ = einsum_attention(q, k, v, np.ones((1, 1, 1, s), bool), sinks=sinks, soft_cap=20.0)
  _check(out, want)


@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_cache_through_the_page_table_matches_an_f32_einsum(page_size):
  b, s, n, kv_heads, d = 4, 32768, 32, 8, 128
  q, k, v = _inputs(3, b, 1, s, n, kv_heads, d)
  lengths = np.asarray([32768, 20001, 0, 700])
  pages_per_row = s // page_size
  # Each row's pages at shuffled physical positions of one pool.
  order = np.random.default_rng(4).permutation(b * pages_per_row)
  table = order.reshape(b, pages_per_row).astype(np.int32)
  pool = lambda x: jnp.zeros((b * pages_per_row, page_size, kv_heads, d), x.dtype).at[
      table.reshape(-1)].set(x.reshape(b * pages_per_row, page_size, kv_heads, d))
  key_pages, value_pages = pool(k), pool(v)
  args = (q, key_pages, value_pages, jnp.asarray(table), jnp.asarray(lengths, jnp.int32))
  assert fa4_jax.which_paged_implementation(*args) == "sm90"
  out = jax.jit(fa4_jax.paged_attention)(*args)
  visible = np.arange(s)[None, None, None, :] < lengths[:, None, None, None]
  _check(out, einsum_attention(q, k, v, visible)[0])
  assert np.all(np.asarray(out[2], np.float32) == 0)


@pytest.mark.parametrize("n, kv_heads, d, paged", [(8, 1, 64, False), (64, 8, 128, False),
                                                   (8, 1, 64, True)],
                         ids=["mqa 8/1 d64", "gqa 64/8 d128", "mqa 8/1 d64 paged"])
def test_groups_of_eight_heads_read_in_place_match_an_f32_einsum(n, kv_heads, d, paged):
  from fa4_jax.kernels import sm90_decode
  b, s, page_size = 8, 32768, 64
  q, k, v = _inputs(5, b, 1, s, n, kv_heads, d)
  assert sm90_decode.reads_query_in_place(q.shape, kv_heads)
  lengths = jnp.asarray([32768, 1, 0, 30000, 4096, 513, 32767, 8], jnp.int32)
  visible = np.arange(s)[None, None, None, :] < np.asarray(lengths)[:, None, None, None]
  if paged:
    table = np.random.default_rng(6).permutation(b * s // page_size).reshape(b, -1)
    pool = lambda x: jnp.zeros((b * s // page_size, page_size, kv_heads, d), x.dtype).at[
        table.reshape(-1)].set(x.reshape(-1, page_size, kv_heads, d))
    args = (q, pool(k), pool(v), jnp.asarray(table, jnp.int32), lengths)
    assert fa4_jax.which_paged_implementation(*args) == "sm90"
    out = jax.jit(fa4_jax.paged_attention)(*args)
  else:
    assert fa4_jax.which_implementation(q, k, v, key_value_seq_lengths=lengths) == "sm90_decode"
    out = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, key_value_seq_lengths=lengths))(
        q, k, v)
  _check(out, einsum_attention(q, k, v, visible)[0])
  assert np.all(np.asarray(out[2], np.float32) == 0)


def test_flax_cached_decoding_runs_the_decode_kernel_and_matches_flax():
  """NNX decode=True, GQA 16/4 D128 bf16, a 4096-slot cache: Flax's cache
  mask becomes key lengths (a lax.cond on the mask's values) and the decode
  arrangement serves each step; outputs equal Flax's default attention."""
  nnx = pytest.importorskip("flax.nnx")
  import fa4_jax.flax

  def layer(fn):
    return nnx.MultiHeadAttention(
        num_heads=16, num_kv_heads=4, in_features=512, qkv_features=2048, attention_fn=fn,
        decode=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))

  q = jnp.zeros((4, 1, 16, 128), jnp.bfloat16)
  kv = jnp.zeros((4, 4096, 4, 128), jnp.bfloat16)
  mask = (jnp.arange(4096) < 700)[None, None, None, :]
  assert fa4_jax.flax.which_implementation(q, kv, kv, mask=mask) == "sm90_decode"
  x = jax.random.normal(jax.random.key(3), (4, 6, 512), jnp.bfloat16)
  outputs = []
  for fn in (nnx.dot_product_attention, fa4_jax.flax.attention_fn):
    model = layer(fn)
    model.init_cache((4, 4096, 512), dtype=jnp.bfloat16)
    step = nnx.jit(lambda model, x: model(x, decode=True))
    outputs.append(jnp.concatenate([step(model, x[:, i:i + 1]) for i in range(6)], axis=1))
  # The cache at work: decoding token by token equals the uncached causal call.
  uncached = layer(nnx.dot_product_attention)(x, is_causal=True)
  got, want, whole = (np.asarray(o, np.float32) for o in (*outputs, uncached))
  np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(got, whole, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("t", [16, 64])
@pytest.mark.parametrize("page_size", [None, 16, 64])
def test_causal_new_tokens_in_the_decode_arrangement(t, page_size):
  from fa4_jax import backends, paged
  b, s, n, kv_heads, d = 4, 32768, 32, 8, 128
  q, k, v = _inputs(5, b, t, s, n, kv_heads, d)
  # 16390: the last T keys across 16384, a boundary of every split into 2-16 chunks.
  lengths = np.asarray([32768, 16390, 0, t // 2])
  pos = lengths[:, None] - t + np.arange(t)[None, :]
  j = np.arange(s)[None, None, :]
  visible = ((j < lengths[:, None, None]) & (j <= pos[:, :, None]))[:, None]
  want = einsum_attention(q, k, v, visible)[0]
  if page_size is None:
    options = dict(is_causal=True, causal_alignment="bottom_right",
                   key_value_seq_lengths=jnp.asarray(lengths, jnp.int32))
    assert fa4_jax.which_implementation(q, k, v, **options) == "sm90_decode"
    out = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, **options))(q, k, v)
  else:
    pages_per_row = s // page_size
    order = np.random.default_rng(6).permutation(b * pages_per_row)
    table = order.reshape(b, pages_per_row).astype(np.int32)
    pool = lambda x: jnp.zeros((b * pages_per_row, page_size, kv_heads, d), x.dtype).at[
        table.reshape(-1)].set(x.reshape(b * pages_per_row, page_size, kv_heads, d))
    args = (q, pool(k), pool(v), jnp.asarray(table), jnp.asarray(lengths, jnp.int32))
    assert fa4_jax.which_paged_implementation(*args) == "sm90"
    validated = paged._validated(
        *args, scale=None, is_causal=True, sinks=None, logits_soft_cap=None,
        implementation=None, query_descale=None, key_descale=None, value_descale=None,
        output_dtype=None, value_head_dim=None, score_mod=None, mask_mod=None)
    assert backends.paged_decode_plan(validated) is not None
    out = jax.jit(fa4_jax.paged_attention)(*args)
  _check(out, want)
  assert np.all(np.asarray(out[2], np.float32) == 0)
