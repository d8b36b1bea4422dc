"""float8 inputs: `query_descale`, `key_descale`, `value_descale`, `output_dtype`.

The real value of a float8 operand is the stored one times its descale (a
scalar or one per head), so every result is checked against an f32 einsum
reference (`jax.nn`'s XLA path in float32) on the dequantized inputs. The
kernels take no float8 yet: these calls run on the XLA path, which widens a
block at a time.

Tolerances: the inputs are exact in float32 once dequantized (float8 widens
exactly), so the error is the XLA path's own rounding: P rounded to
bfloat16 for the P.V product (relative 2**-9) and the bfloat16 output
(relative 2**-9), about 1 % of the output's scale together; float32 output
keeps only the first (`FP8_TOL`, `F32_OUT_TOL`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fa4_jax
from fa4_jax.paged import gather_pages

B, T, S, N, K, D = 2, 96, 160, 4, 2, 64
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8_TOL, F32_OUT_TOL = 1e-2, 5e-3
Q_DESCALE = jnp.asarray([0.5, 1.0, 2.0, 0.25])  # per query head
KV_DESCALE = jnp.asarray([0.75, 1.5])  # per key/value head


def fp8_inputs(dtype=E4M3, q_dtype=None, t=T, s=S, seed=0):
  rng = np.random.default_rng(seed)
  make = lambda *shape: jnp.asarray(rng.normal(size=shape) * 2, jnp.float32)
  q, k, v = make(B, t, N, D), make(B, s, K, D), make(B, s, K, D)
  return q.astype(q_dtype or dtype), k.astype(dtype), v.astype(dtype)


def dequantized(x, descale, heads):
  x = x.astype(jnp.float32)
  return x if descale is None else x * jnp.broadcast_to(descale, (heads,))[:, None]


def reference(q, k, v, qd=None, kd=None, vd=None, **kw):
  return jax.nn.dot_product_attention(
      dequantized(q, qd, N), dequantized(k, kd, K), dequantized(v, vd, K),
      implementation="xla", **kw)


def assert_close(got, want, tol=FP8_TOL):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max(), rtol=tol)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("descales", ["per head", "scalar", "none"])
def test_fp8_query_key_value_match_the_dequantized_reference(dtype, descales):
  q, k, v = fp8_inputs(dtype)
  qd, kd, vd = {"per head": (Q_DESCALE, KV_DESCALE, KV_DESCALE[::-1]),
                "scalar": (jnp.float32(0.5), jnp.float32(2.0), jnp.float32(0.25)),
                "none": (None, None, None)}[descales]
  out = fa4_jax.attention(q, k, v, is_causal=True, query_descale=qd, key_descale=kd,
                          value_descale=vd)
  assert out.dtype == jnp.bfloat16 and out.shape == q.shape
  assert_close(out, reference(q, k, v, qd, kd, vd, is_causal=True))


def test_float32_output_is_closer():
  q, k, v = fp8_inputs()
  want = reference(q, k, v, Q_DESCALE, KV_DESCALE, KV_DESCALE)
  out = fa4_jax.attention(q, k, v, query_descale=Q_DESCALE, key_descale=KV_DESCALE,
                          value_descale=KV_DESCALE, output_dtype=jnp.float32)
  assert out.dtype == jnp.float32
  assert_close(out, want, F32_OUT_TOL)


@pytest.mark.parametrize("q_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("t", [1, 5])  # decode, chunked prefill
def test_a_bf16_query_reads_a_float8_kv_cache_with_lengths_bottom_right(q_dtype, t):
  q, k, v = fp8_inputs(q_dtype=q_dtype, t=t)
  lengths = jnp.asarray([S, 77])
  out = fa4_jax.attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                          key_value_seq_lengths=lengths, key_descale=KV_DESCALE,
                          value_descale=0.5)
  assert out.dtype == q_dtype
  position = lengths[:, None] - t + jnp.arange(t)[None]  # each query's place in its row
  mask = jnp.arange(S)[None, None, :] <= position[:, :, None]
  assert_close(out, reference(q, k, v, None, KV_DESCALE, 0.5, mask=mask[:, None]))


def test_fp8_combines_with_segment_ids_sinks_soft_cap_and_a_score_mod():
  q, k, v = fp8_inputs(s=T)
  ids = jnp.asarray(np.repeat([[0, 1, 2], [5, 5, 6]], [30, 30, 36], axis=1))
  sinks = jnp.asarray([0.5, -1.0, 0.0, 2.0])
  slopes = jnp.asarray([0.1, 0.2, 0.3, 0.4])
  alibi = lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j)
  out = fa4_jax.attention(q, k, v, is_causal=True, query_segment_ids=ids,
                          key_value_segment_ids=ids, sinks=sinks, logits_soft_cap=20.0,
                          score_mod=alibi, key_descale=KV_DESCALE, value_descale=KV_DESCALE,
                          query_descale=Q_DESCALE, output_dtype=jnp.float32)
  qf, kf, vf = (dequantized(q, Q_DESCALE, N), dequantized(k, KV_DESCALE, K),
                dequantized(v, KV_DESCALE, K))
  logits = jnp.einsum("btnd,bsnd->bnts", qf, jnp.repeat(kf, N // K, axis=2)) / np.sqrt(D)
  i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
  logits = logits - slopes[:, None, None] * jnp.abs(i - j)
  logits = 20.0 * jnp.tanh(logits / 20.0)
  visible = (j <= i) & (ids[:, :, None] == ids[:, None, :])[:, None]
  logits = jnp.where(visible, logits, -jnp.inf)
  with_sink = jnp.concatenate([logits, jnp.broadcast_to(sinks[:, None, None], (B, N, T, 1))], -1)
  probs = jax.nn.softmax(with_sink, axis=-1)[..., :-1]
  want = jnp.einsum("bnts,bsnd->btnd", probs, jnp.repeat(vf, N // K, axis=2))
  assert_close(out, want, F32_OUT_TOL)


def test_jit_vmap_and_the_residual():
  q, k, v = fp8_inputs()
  call = lambda q, k, v, kd: fa4_jax.attention(q, k, v, key_descale=kd, return_residual=True)
  descales = jnp.stack([KV_DESCALE, 2 * KV_DESCALE])
  out, lse = jax.jit(jax.vmap(call, in_axes=(None, None, None, 0)))(q, k, v, descales)
  assert out.dtype == lse.dtype == jnp.bfloat16 and lse.shape == (2, B, T, N)
  for layer in range(2):
    assert_close(out[layer], reference(q, k, v, None, descales[layer]))


def test_sharded_heads_read_their_own_descales(host_devices):
  mesh = jax.make_mesh((2, 2), ("d", "m"))
  q, k, v = fp8_inputs(seed=3)
  put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  call = jax.jit(lambda q, k, v, qd, kd: fa4_jax.attention(
      q, k, v, is_causal=True, query_descale=qd, key_descale=kd))
  out = call(put(q, "d", None, "m"), put(k, "d", None, "m"), put(v, "d", None, "m"),
             put(Q_DESCALE, "m"), put(KV_DESCALE, "m"))
  assert_close(out, reference(q, k, v, Q_DESCALE, KV_DESCALE, is_causal=True))


def test_paged_float8_pages_through_a_shuffled_table():
  page, pages, max_pages = 16, 24, 8
  rng = np.random.default_rng(5)
  make = lambda *shape: jnp.asarray(rng.normal(size=shape) * 2, jnp.float32)
  q = make(B, 3, N, D).astype(jnp.bfloat16)
  key_pages, value_pages = (make(pages, page, K, D).astype(E4M3) for _ in range(2))
  table = jnp.asarray(rng.permutation(pages)[:B * max_pages].reshape(B, max_pages))
  lengths = jnp.asarray([128, 53])
  out = fa4_jax.paged_attention(q, key_pages, value_pages, table, lengths,
                                key_descale=KV_DESCALE, value_descale=0.5)
  assert fa4_jax.which_paged_implementation(q, key_pages, value_pages, table, lengths) == "xla"
  k, v = gather_pages(key_pages, table), gather_pages(value_pages, table)
  position = lengths[:, None] - 3 + jnp.arange(3)[None]
  mask = jnp.arange(max_pages * page)[None, None, :] <= position[:, :, None]
  assert_close(out, reference(q, k, v, None, KV_DESCALE, 0.5, mask=mask[:, None]))


def test_a_16_bit_query_on_a_float8_cache_runs_the_hopper_kernel():
  q, k, v = fp8_inputs(q_dtype=jnp.bfloat16)
  with fa4_jax.gpu_target("sm90"):
    assert fa4_jax.which_implementation(q, k, v, is_causal=True, implementation="sm90") == "sm90"
    assert fa4_jax.which_implementation(q, k, v, is_causal=True) == "sm90"
  with fa4_jax.interpret_mode(), pytest.raises(ValueError, match="float8"):
    fa4_jax.which_implementation(q, k, v, implementation="sm100")


def test_differentiating_a_float8_call_names_the_way_out():
  q, k, v = fp8_inputs(q_dtype=jnp.bfloat16)
  loss = lambda q: fa4_jax.attention(q, k, v, key_descale=KV_DESCALE).astype(jnp.float32).sum()
  with pytest.raises(ValueError, match="dequantize"):
    jax.grad(loss)(q)


@pytest.mark.parametrize("kwargs, message", [
    (dict(key_descale=jnp.ones(3)), r"`key_descale` must be a scalar or one factor per "
                                    r"key/value head \(shape \(2,\)\)"),
    (dict(query_descale=jnp.ones((N, 1))), "`query_descale` must be a scalar"),
    (dict(value_descale=jnp.ones(K, jnp.int32)), "`value_descale` must be floating point"),
    (dict(output_dtype=jnp.int8), "`output_dtype` must be bfloat16, float16 or float32"),
])
def test_bad_descales_and_output_dtypes_raise(kwargs, message):
  q, k, v = fp8_inputs()
  with pytest.raises(ValueError, match=message):
    fa4_jax.attention(q, k, v, **kwargs)


def test_descales_and_output_dtype_need_float8_operands():
  q, k, v = fp8_inputs(q_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="`query_descale` applies to a float8 `query`"):
    fa4_jax.attention(q, k, v, query_descale=2.0)
  bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  with pytest.raises(ValueError, match="`key_descale` applies to a float8 `key`"):
    fa4_jax.attention(*bf16, key_descale=2.0)
  with pytest.raises(ValueError, match="`output_dtype` applies to calls with float8"):
    fa4_jax.attention(*bf16, output_dtype=jnp.float32)


@pytest.mark.parametrize("dtypes", [(E4M3, jnp.bfloat16, jnp.bfloat16), (E4M3, E5M2, E5M2),
                                    (jnp.float32, E4M3, E4M3), (jnp.bfloat16, E4M3, E5M2)])
def test_mixed_dtypes_outside_the_float8_pairs_raise(dtypes):
  q, k, v = (x.astype(jnp.float32).astype(d) for x, d in zip(fp8_inputs(), dtypes))
  with pytest.raises(ValueError, match="float8 attention takes"):
    fa4_jax.attention(q, k, v)


def test_flax_attention_fn_keeps_a_float8_cache_and_takes_its_descales():
  import fa4_jax.flax
  q, k, v = fp8_inputs(q_dtype=jnp.bfloat16)
  out = fa4_jax.flax.attention_fn(q[None], k[None], v[None], key_descale=KV_DESCALE,
                                  value_descale=KV_DESCALE)  # two leading batch dims
  assert out.shape == (1,) + q.shape[:-1] + (D,) and out.dtype == jnp.bfloat16
  assert_close(out[0], reference(q, k, v, None, KV_DESCALE, KV_DESCALE))
