"""A 16-bit query on a float8 KV cache in the sm90 kernel, on real hardware
(skipped without a Hopper GPU): decode in the decode arrangement (split-K,
ragged lengths, GQA and MQA), float8 pages (decode and chunked prefill),
at serving sizes, against an f32 einsum on the dequantized cache with the
tolerance argued in tests/test_sm90_fp8_cache.py. The kernel is named
(`implementation="sm90"`); `implementation=None` takes it too since this
file passed on an H100 (2026-12-06).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import backends
from test_sm90_fp8_cache import E4M3, E5M2, assert_close, dequantized_reference, float8_cache

pytestmark = pytest.mark.skipif(backends.device_arch_major() != 9,
                                reason="needs a Hopper GPU")


@pytest.mark.parametrize("b, s, n, kv_heads, d, cache_dtype", [
    (4, 16384, 32, 8, 128, E4M3),
    (16, 8192, 8, 1, 64, E4M3),   # MQA
    (2, 4099, 16, 2, 256, E5M2),  # an odd length, D256
])
def test_float8_cache_decode_at_scale(b, s, n, kv_heads, d, cache_dtype):
  rng = np.random.default_rng(d)
  q = jnp.asarray(rng.normal(size=(b, 1, n, d)), jnp.bfloat16)
  k8, k_descale = float8_cache(rng, (b, s, kv_heads, d), cache_dtype)
  v8, v_descale = float8_cache(rng, (b, s, kv_heads, d), cache_dtype)
  lengths = jnp.asarray(rng.integers(1, s + 1, size=(b,)), jnp.int32)
  kwargs = dict(key_descale=k_descale, value_descale=v_descale, key_value_seq_lengths=lengths,
                implementation="sm90")
  assert fa4_jax.which_implementation(q, k8, v8, **kwargs) == "sm90_decode"
  got = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, **kwargs))(q, k8, v8)
  want, v = dequantized_reference(q, k8, k_descale, v8, v_descale, kv_lengths=lengths)
  assert_close(got, want, v)


@pytest.mark.parametrize("factor", [None, 2], ids=["default", "contiguous_plan_x2"])
@pytest.mark.parametrize("t", [1, 16])
def test_float8_pages_at_scale(t, factor, monkeypatch):
  """`factor`: `sm90_decode.FP8_PAGES_SPLITS_FACTOR` (issue #55), None for
  the default."""
  from fa4_jax.kernels import sm90_decode

  if factor is not None:
    monkeypatch.setattr(sm90_decode, "FP8_PAGES_SPLITS_FACTOR", factor)
    jax.clear_caches()  # no trace of another plan for the same shapes
  rng = np.random.default_rng(t)
  b, n, kv_heads, d, page, max_pages = 8, 32, 8, 128, 64, 64
  pool = b * max_pages
  key_pages, k_descale = float8_cache(rng, (pool, page, kv_heads, d))
  value_pages, v_descale = float8_cache(rng, (pool, page, kv_heads, d))
  table = jnp.asarray(rng.permutation(pool).reshape(b, max_pages), jnp.int32)
  lengths = jnp.asarray(rng.integers(t, max_pages * page + 1, size=(b,)), jnp.int32)
  q = jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.bfloat16)
  kwargs = dict(key_descale=k_descale, value_descale=v_descale, implementation="sm90")
  assert fa4_jax.which_paged_implementation(q, key_pages, value_pages, table, lengths,
                                            **kwargs) == "sm90"
  got = fa4_jax.paged_attention(q, key_pages, value_pages, table, lengths, **kwargs)
  gather = lambda pages: np.asarray(pages, np.float32)[np.asarray(table)].reshape(
      b, max_pages * page, kv_heads, d)
  want, v = dequantized_reference(q, gather(key_pages), k_descale, gather(value_pages),
                                  v_descale, kv_lengths=lengths, bottom_right_causal=True)
  assert_close(got, want, v)
