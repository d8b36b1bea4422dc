"""score_mod / mask_mod in the decode arrangement on a Hopper GPU, at serving
sizes (skipped without one).

* One token per row against a 32k-slot cache (GQA 32/8, D128, bf16, per-row
  lengths, one of them 0) with ALiBi: served by the decode arrangement
  ("sm90_decode"), equal to an f32 einsum with the explicit bias; the same
  through pages of 64 at shuffled places ("sm90").
* ALiBi with a decode sliding window as mask_mod (each row's last 4096
  keys: most key blocks EMPTY, skipped), contiguous and paged.
* 8 speculative tokens, causal bottom-right, with a 2-D table lookup
  (table[head, (kv + q) % 16]) over pages of 16.

bf16 tolerance 2e-2: one bf16 rounding of P and of each chunk's output, the
merge in f32; the reference sees the same bf16 inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax.paged import gather_pages
from reference import einsum_attention

ON_HOPPER = (jax.devices()[0].platform == "gpu"
             and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9"))
pytestmark = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")



B, S, HQ, HKV, D = 4, 32768, 32, 8, 128
LENGTHS = (32768, 17000, 0, 4999)


def _slopes():
  return jnp.asarray([2.0 ** (-8.0 * (h + 1) / HQ) for h in range(HQ)], jnp.float32)


def _alibi(slopes):
  return lambda s, b, h, q, kv: s + slopes[h] * (kv - q).astype(jnp.float32)


def _cache(seed, t, page_size=None):
  """(q, k, v) contiguous, or (q, key_pages, value_pages, table) with each
  row's pages at shuffled places."""
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (B, t, HQ, D), jnp.bfloat16)
  if page_size is None:
    k = jax.random.normal(keys[1], (B, S, HKV, D), jnp.bfloat16)
    v = (jax.random.normal(keys[2], (B, S, HKV, D)) + 1.0).astype(jnp.bfloat16)
    return q, k, v
  pages = B * S // page_size
  kp = jax.random.normal(keys[1], (pages, page_size, HKV, D), jnp.bfloat16)
  vp = (jax.random.normal(keys[2], (pages, page_size, HKV, D)) + 1.0).astype(jnp.bfloat16)
  table = jnp.asarray(np.random.default_rng(seed).permutation(pages).reshape(B, -1), jnp.int32)
  return q, kp, vp, table


def _reference(q, k, v, lengths, *, bias_fn, keep_fn=None, causal=False):
  """f32 einsum, one batch row at a time (the bias of a row: [Hq, T, S])."""
  t = q.shape[1]
  h = np.arange(HQ)[:, None, None]
  i, j = np.arange(t)[None, :, None], np.arange(S)[None, None, :]
  outs = []
  for b, n in enumerate(np.asarray(lengths)):
    visible = j < n
    if causal:
      visible = visible & (j <= n - t + i)
    if keep_fn is not None:
      visible = visible & keep_fn(b, h, i, j)
    visible = np.broadcast_to(visible, (HQ, t, S))[None]
    bias = jnp.asarray(np.broadcast_to(bias_fn(h, i, j), (HQ, t, S))[None], jnp.float32)
    outs.append(einsum_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], visible, bias=bias)[0])
  return jnp.concatenate(outs)


def _check(out, want):
  out = np.asarray(out, np.float32)
  assert np.all(np.isfinite(out))
  np.testing.assert_allclose(out, np.asarray(want), atol=2e-2, rtol=2e-2)
  assert np.all(out[2] == 0.0)  # the row of length 0


@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("page_size", [None, 64])
def test_alibi_decode_at_serving_size(page_size, window):
  slopes = _slopes()
  lengths = jnp.asarray(LENGTHS, jnp.int32)
  options = dict(score_mod=_alibi(slopes))
  keep_fn = None
  if window:
    options["mask_mod"] = lambda b, h, i, j: j >= lengths[b] - 4096
    keep_fn = lambda b, h, i, j: j >= LENGTHS[b] - 4096
  bias_fn = lambda h, i, j: np.asarray(slopes)[h] * (j - i)
  if page_size is None:
    q, k, v = _cache(0, 1)
    assert fa4_jax.which_implementation(q, k, v, key_value_seq_lengths=lengths,
                                        **options) == "sm90_decode"
    out = jax.jit(lambda q, k, v, n: fa4_jax.attention(q, k, v, key_value_seq_lengths=n,
                                                       **options))(q, k, v, lengths)
  else:
    q, kp, vp, table = _cache(0, 1, page_size)
    assert fa4_jax.which_paged_implementation(q, kp, vp, table, lengths, **options) == "sm90"
    out = jax.jit(lambda *a: fa4_jax.paged_attention(*a, **options))(q, kp, vp, table, lengths)
    k, v = gather_pages(kp, table), gather_pages(vp, table)
  _check(out, _reference(q, k, v, lengths, bias_fn=bias_fn, keep_fn=keep_fn))


def test_speculative_tokens_with_a_table_lookup_over_pages():
  t, page_size = 8, 16
  lengths = jnp.asarray(LENGTHS, jnp.int32).at[2].set(0)
  table_bias = jnp.asarray(np.random.default_rng(1).normal(size=(HQ, 16)), jnp.float32)
  score_mod = lambda s, b, h, q, kv: s + table_bias[h, (kv + q) % 16]
  q, kp, vp, table = _cache(1, t, page_size)
  assert fa4_jax.which_paged_implementation(q, kp, vp, table, lengths,
                                            score_mod=score_mod) == "sm90"
  out = jax.jit(lambda *a: fa4_jax.paged_attention(*a, score_mod=score_mod))(
      q, kp, vp, table, lengths)
  k, v = gather_pages(kp, table), gather_pages(vp, table)
  bias_fn = lambda h, i, j: np.asarray(table_bias)[h, (j + i) % 16]
  _check(out, _reference(q, k, v, lengths, bias_fn=bias_fn, causal=True))
