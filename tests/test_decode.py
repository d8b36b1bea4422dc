"""The decode arrangement of the sm90 kernels (`fa4_jax.kernels.sm90_decode`).

Specification:
* A short query (T x G packed rows <= 256) without a band mask is served by
  the sm90 forward kernel with the query heads of a KV head packed as rows
  and the cache split into chunks; `which_implementation` says
  "sm90_decode". Top-left causal masks, windows, segment ids and long
  queries keep the usual kernel (causal bottom-right is served too:
  `tests/test_decode_causal.py`).
* Splits: the largest power of two that keeps B x Hkv x splits x (query
  tiles of an item) CTAs within one wave of SMs (8 with per-row key
  lengths; fewer CTAs where they read a cache faster), divides S and leaves chunks
  of >= 512 keys (the measured best choices on an H200 for issue #27's rows).
* Grid: where the CTAs of the plan outnumber the CTAs that read a cache
  fastest (shared evenly) or the SMs, and key lengths are equal, they run
  on a persistent grid with two Q tiles per consumer; ragged lengths, short
  chunks and head dims above 128 keep the forward kernel's heuristic.
* Numerics (interpreter with race detection): out and lse equal an f32
  einsum with per-row key lengths (a row with length 0 gets zeros and
  -inf), query lengths, GQA and MQA, sinks, over several chunks; the
  gradients (the sm90 backward, from the combined lse) too.
* The combine of chunks is the softmax of the whole row, in the caller's
  layout (chunks and rows that saw no key included): checked on its own.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax.kernels import sm90_decode
from fa4_jax.scores import MaskSpec, ScoreFunction
from reference import einsum_attention


def _inputs(seed, b, t, s, n, kv_heads, d, dtype=jnp.bfloat16):
  keys = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(keys[0], (b, t, n, d), dtype),
          jax.random.normal(keys[1], (b, s, kv_heads, d), dtype),
          jax.random.normal(keys[2], (b, s, kv_heads, d), dtype) + 1.0,
          jax.random.normal(keys[3], (b, t, n, d), dtype))


@pytest.mark.parametrize("shape, splits, ragged", [
    ((8, 1, 32768, 32, 8), 2, False),
    ((64, 1, 4096, 32, 8), 1, False),
    ((1, 1, 131072, 32, 8), 16, False),
    ((8, 16, 32768, 32, 8), 2, False),
    ((8, 32, 32768, 32, 8), 2, False),  # 128 rows: one query tile
    ((8, 64, 32768, 32, 8), 1, False),  # 256 rows: two query tiles, 128 CTAs
    ((32, 1, 16384, 32, 8), 4, True),
    ((1, 1, 1000, 8, 1), 1, False),  # 1000 = 2 * 500: a chunk of 500 keys is too short
    ((1, 1, 3072, 8, 1), 4, False),  # splits divide S: 8 would give chunks of 384
])
def test_splits_fill_one_wave_of_sms_with_chunks_of_at_least_512_keys(shape, splits, ragged):
  b, t, s, n, kv_heads = shape
  plan = sm90_decode.plan((b, t, n, 128), (b, s, kv_heads, 128), MaskSpec(), ragged=ragged,
                          num_sms=132, streams=132)
  assert plan is not None and plan.splits == splits


@pytest.mark.parametrize("name, b, s, d, ragged, streams, splits, grid", [
    ("512 items on 132 SMs", 64, 4096, 128, False, 132, 1, 132),
    ("256 items", 32, 8192, 128, False, 132, 1, 132),
    ("one wave of 128 items", 8, 32768, 128, False, 132, 2, None),
    ("short chunks keep the heuristic's grid", 128, 2048, 128, False, 132, 1, None),
    ("ragged lengths: the block scheduler balances them", 32, 16384, 128, True, 132, 4, None),
    ("D256: no room for O tiles beside two Q tiles", 64, 4096, 256, False, 132, 1, None),
    ("64 streams: 512 items shared by 64 CTAs", 64, 4096, 128, False, 64, 1, 64),
    ("64 streams: one chunk per row of B8", 8, 32768, 128, False, 64, 1, None),
    ("64 streams: 8 chunks for B1", 1, 131072, 128, False, 64, 8, None),
    ("64 streams, 96 items: one wave of the SMs", 12, 8192, 128, False, 64, 1, None),
    ("64 streams, 200 items: more than the SMs", 25, 8192, 128, False, 64, 1, 132),
])
def test_the_grid_streams_the_cache_with_as_many_ctas_as_read_it_fastest(
    name, b, s, d, ragged, streams, splits, grid):
  """Splits fill `streams` CTAs (132: every SM; 64: an H100 at D >= 128,
  `device_tables.DECODE`); more items than that, shared evenly, or than
  the SMs run on a persistent grid with two Q tiles per consumer."""
  plan = sm90_decode.plan((b, 1, 32, d), (b, s, 8, d), MaskSpec(), ragged=ragged, num_sms=132,
                          streams=streams)
  assert plan.splits == splits
  if grid is None:
    assert plan.config is None  # the forward kernel's heuristic
  else:
    assert plan.config.persistent and plan.config.q_buffers == 2 and plan.config.num_sms == grid


def test_fewer_streams_only_on_the_device_kind_measured_at_d128_up_and_64_rows(
    monkeypatch):
  class Device:
    platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"
  monkeypatch.setattr(sm90_decode, "default_device", lambda: Device)
  assert sm90_decode.streaming_ctas(128, 4, 132) == 64
  assert sm90_decode.streaming_ctas(256, 64, 132) == 64
  assert sm90_decode.streaming_ctas(64, 4, 132) == 132  # D64
  assert sm90_decode.streaming_ctas(128, 128, 132) == 132  # 32 tokens x 4 heads
  Device.device_kind = "NVIDIA H200"  # measured: 128 (fa4_jax/kernels/device_tables.py)
  assert sm90_decode.streaming_ctas(128, 4, 132) == 128
  Device.device_kind = "NVIDIA H20"  # not measured: every SM
  assert sm90_decode.streaming_ctas(128, 4, 132) == 132
  with fa4_jax.gpu_target("sm90"):  # an export names no device kind
    Device.device_kind = "NVIDIA H100 80GB HBM3"
    assert sm90_decode.streaming_ctas(128, 4, 132) == 132


@pytest.mark.parametrize("name, t, n, kv_heads, options", [
    ("causal", 1, 8, 2, dict(is_causal=True)),
    ("window", 1, 8, 2, dict(local_window_size=(100, 0))),
    ("long query", 65, 8, 2, dict()),  # 65 tokens x 4 heads = 260 rows
])
def test_band_masks_and_long_queries_keep_the_usual_kernel(name, t, n, kv_heads, options):
  q, k, v, _ = _inputs(0, 1, t, 1024, n, kv_heads, 64)
  with fa4_jax.interpret_mode():
    assert fa4_jax.which_implementation(q, k, v, implementation="sm90", **options) == "sm90"
    ids = jnp.zeros((1, t), jnp.int32), jnp.zeros((1, 1024), jnp.int32)
    assert fa4_jax.which_implementation(q, k, v, query_segment_ids=ids[0],
                                        key_value_segment_ids=ids[1],
                                        implementation="sm90", **options) == "sm90"


@pytest.mark.parametrize("p", [4, sm90_decode.MAX_UNROLLED_CHUNKS + 4],
                         ids=["merge written out per chunk", "one variadic reduction"])
def test_combining_chunks_is_the_softmax_of_the_whole_row_in_the_callers_layout(p):
  rng = np.random.default_rng(0)
  b, t, g, kv_heads, d, chunk = 2, 2, 3, 2, 5, 7
  rows = t * g  # packed row r = token * g + group member
  logits = rng.normal(size=(b, kv_heads, rows, p * chunk)) * 3
  logits[0, :, :, chunk:3 * chunk] = -np.inf  # chunks that see no key
  logits[1, 0, 0, :] = -np.inf  # a row that sees nothing at all
  values = rng.normal(size=(b, p * chunk, kv_heads, d))
  outs, lses = [], []
  for c in range(p):
    part = logits[..., c * chunk:(c + 1) * chunk]
    lse = np.logaddexp.reduce(part, axis=-1)
    probs = np.where(np.isfinite(lse)[..., None], np.exp(part - np.where(
        np.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    outs.append(np.einsum("bhrs,bshd->brhd", probs, values[:, c * chunk:(c + 1) * chunk]))
    lses.append(lse)
  out = np.stack(outs, 1).reshape(b * p, rows, kv_heads, d)
  lse = np.stack(lses, 1).reshape(b * p, kv_heads, rows)
  merged, merged_lse = sm90_decode.combine(jnp.asarray(out, jnp.float32),
                                           jnp.asarray(lse, jnp.float32), p, t)
  whole_lse = np.logaddexp.reduce(logits, axis=-1)  # [B, Hkv, rows]
  probs = np.where(np.isfinite(whole_lse)[..., None],
                   np.exp(logits - np.where(np.isfinite(whole_lse), whole_lse, 0.0)[..., None]),
                   0.0)
  want = np.einsum("bhrs,bshd->brhd", probs, values)  # packed rows
  # The caller's layout: token t's query head h * g + j is packed row t * g + j of KV head h.
  want = want.reshape(b, t, g, kv_heads, d).transpose(0, 1, 3, 2, 4).reshape(b, t, -1, d)
  want_lse = whole_lse.reshape(b, kv_heads, t, g).transpose(0, 1, 3, 2).reshape(b, -1, t)
  assert merged.shape == (b, t, kv_heads * g, d) and merged_lse.shape == (b, kv_heads * g, t)
  np.testing.assert_allclose(np.asarray(merged), want, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(merged_lse), want_lse, rtol=1e-5)
  assert np.all(np.asarray(merged)[1, 0, 0] == 0) and np.asarray(merged_lse)[1, 0, 0] == -np.inf
  assert not np.any(np.isnan(np.asarray(merged)))


@pytest.mark.parametrize("name, t, n, kv_heads, s, options", [
    ("gqa, key lengths incl. an empty row, 2 chunks", 1, 8, 2, 1024,
     dict(key_value_seq_lengths=(700, 0, 513))),
    ("mqa, 3 tokens, query lengths, sinks", 3, 4, 1, 512,
     dict(query_seq_lengths=(2, 3, 0), key_value_seq_lengths=(200, 512, 9), sinks=True)),
    ("mqa 8/1, one token read in place, 2 chunks", 1, 8, 1, 1024,
     dict(key_value_seq_lengths=(1024, 600, 0))),
    ("gqa 8/2, one token read in place, one chunk", 1, 8, 2, 512,
     dict(key_value_seq_lengths=(512, 0, 100))),
])
def test_decode_matches_an_f32_einsum_without_races(name, t, n, kv_heads, s, options,
                                                    run_interpreted):
  b, d = 3, 64
  q, k, v, _ = _inputs(1, b, t, s, n, kv_heads, d)
  options = dict(options)
  sinks = (jnp.linspace(-2.0, 2.0, n, dtype=jnp.float32) if options.pop("sinks", False)
           else None)
  lengths = {key: jnp.asarray(x, jnp.int32) for key, x in options.items()}
  q_len = options.get("query_seq_lengths", (t,) * b)
  kv_len = options["key_value_seq_lengths"]
  visible = ((np.arange(t)[None, :, None] < np.asarray(q_len)[:, None, None])
             & (np.arange(s)[None, None, :] < np.asarray(kv_len)[:, None, None]))[:, None]
  with fa4_jax.interpret_mode():
    assert fa4_jax.which_implementation(q, k, v, sinks=sinks, implementation="sm90",
                                        **lengths) == "sm90_decode"
  out, lse = run_interpreted(lambda q, k, v: fa4_jax.attention(
      q, k, v, sinks=sinks, return_residual=True, implementation="sm90", **lengths), q, k, v)
  want, want_lse = einsum_attention(q, k, v, visible, sinks=sinks)
  rows_valid = np.arange(t)[None, :] < np.asarray(q_len)[:, None]  # [B, T]
  want_lse = np.where(rows_valid[:, None, :], np.asarray(want_lse), -np.inf)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(np.asarray(lse, np.float32).transpose(0, 2, 1), want_lse,
                             atol=2e-2, rtol=1e-2)


def test_a_persistent_grid_of_two_ctas_walks_every_items_rows_without_races(run_interpreted):
  """6 items (3 rows x 2 KV heads) on 2 CTAs, one token of 4 query heads
  per KV head read in place, lengths incl. an empty row."""
  b, s, n, kv_heads, d = 3, 512, 8, 2, 64
  q, k, v, _ = _inputs(2, b, 1, s, n, kv_heads, d)
  # The grid `choose_config` gives 6 items of long chunks on 2 streams, on short ones.
  config = sm90_decode.choose_config(d, MaskSpec(), 8192, 4, b * kv_heads, num_sms=132, streams=2)
  assert config.persistent and config.num_sms == 2
  plan = sm90_decode.DecodePlan(1, config)
  kv_len = (300, 0, 512)
  out, lse = run_interpreted(lambda q, k, v: sm90_decode.forward(
      q, k, v, None, jnp.asarray(kv_len, jnp.int32), score=ScoreFunction(d ** -0.5),
      mask=MaskSpec(), plan=plan), q, k, v)
  visible = (np.arange(s)[None, None, None, :] < np.asarray(kv_len)[:, None, None, None])
  want, want_lse = einsum_attention(q, k, v, visible)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=2e-2, rtol=1e-2)


def test_gradients_through_the_decode_arrangement_match_an_f32_einsum(run_interpreted):
  b, t, s, n, kv_heads, d = 1, 1, 1024, 4, 1, 64
  q, k, v, dout = _inputs(2, b, t, s, n, kv_heads, d)
  kv_len = jnp.asarray([900], jnp.int32)
  visible = np.arange(s)[None, None, None, :] < 900
  loss = lambda attend: (lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)
                                                 * dout.astype(jnp.float32)))
  ours = lambda q, k, v: fa4_jax.attention(q, k, v, key_value_seq_lengths=kv_len,
                                           implementation="sm90")
  got = run_interpreted(jax.grad(loss(ours), argnums=(0, 1, 2)), q, k, v)
  want = jax.grad(loss(lambda q, k, v: einsum_attention(q, k, v, visible)[0]),
                  argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w),
                               atol=2e-2 * max(1.0, float(jnp.abs(w).max())), rtol=2e-2)


def _ops_on_query_before_the_kernel(q_shape, kv_heads, splits):
  """The primitives applied to q before the Pallas kernel in a decode call."""
  b, t, n, d = q_shape
  q = jax.ShapeDtypeStruct(q_shape, jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, 1024, kv_heads, d), jnp.bfloat16)
  jaxpr = jax.make_jaxpr(lambda q, k, v: sm90_decode.forward(
      q, k, v, None, None, score=ScoreFunction(0.125), mask=MaskSpec(),
      plan=sm90_decode.DecodePlan(splits)))(q, kv, kv).jaxpr
  # The kernel is the first operation that takes both the query and the keys.
  from_q, from_k, ops = {jaxpr.invars[0]}, {jaxpr.invars[1]}, []
  for eqn in jaxpr.eqns:
    operands = [v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)]
    takes_q, takes_k = (any(v in seen for v in operands) for seen in (from_q, from_k))
    if takes_q and takes_k:
      return ops
    if takes_q:
      ops.append(eqn.primitive.name)
      from_q.update(eqn.outvars)
    if takes_k:
      from_k.update(eqn.outvars)
  raise AssertionError("no operation took the query and the keys")


def _ops_on_out_after_the_kernel(q_shape, kv_heads, splits):
  """The primitives applied to the kernel's output on its way to the result."""
  b, t, n, d = q_shape
  q = jax.ShapeDtypeStruct(q_shape, jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, 1024, kv_heads, d), jnp.bfloat16)
  jaxpr = jax.make_jaxpr(lambda q, k, v: sm90_decode.forward(
      q, k, v, None, None, score=ScoreFunction(0.125), mask=MaskSpec(),
      plan=sm90_decode.DecodePlan(splits))[0])(q, kv, kv).jaxpr
  # The kernel's call is the first operation that takes both the query and the keys.
  from_q, from_k = {jaxpr.invars[0]}, {jaxpr.invars[1]}
  for kernel, eqn in enumerate(jaxpr.eqns):
    operands = [v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)]
    takes_q, takes_k = (any(v in seen for v in operands) for seen in (from_q, from_k))
    if takes_q and takes_k:
      break
    (from_q if takes_q else from_k if takes_k else set()).update(eqn.outvars)
  from_out, ops = {jaxpr.eqns[kernel].outvars[0]}, []
  for eqn in jaxpr.eqns[kernel + 1:]:
    if any(v in from_out for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)):
      ops.append(eqn.primitive.name)
      from_out.update(eqn.outvars)
  return ops


@pytest.mark.parametrize("name, q_shape, kv_heads, splits, copies", [
    ("mqa 8/1, 4 chunks", (2, 1, 8, 64), 1, 4, False),
    ("gqa 64/8, 1 chunk", (2, 1, 64, 128), 8, 1, False),
    ("gqa 32/8, 2 chunks", (2, 1, 32, 128), 8, 2, False),
    ("gqa 32/8, 1 chunk", (2, 1, 32, 128), 8, 1, False),
    # Groups of 12: TMA tiles rows by 8, and 12 is neither below 8 nor a multiple.
    ("gqa 24/2", (2, 1, 24, 128), 2, 2, True),
    ("mqa 8/1, 2 tokens", (2, 2, 8, 64), 1, 2, True),
])
def test_one_token_reaches_the_kernel_without_a_copy(name, q_shape, kv_heads, splits, copies):
  ops = _ops_on_query_before_the_kernel(q_shape, kv_heads, splits)
  assert copies == (set(ops) - {"reshape"} != set()), ops


def test_one_token_in_one_chunk_leaves_the_kernel_with_a_reshape_only():
  assert set(_ops_on_out_after_the_kernel((2, 1, 32, 128), 8, 1)) <= {"reshape"}
  assert "transpose" in _ops_on_out_after_the_kernel((2, 2, 32, 128), 8, 1)


@pytest.mark.parametrize("name, b, s, n, kv_heads, d, paged, ragged, streams", [
    ("gqa 32/8 d128, 2 chunks", 8, 32768, 32, 8, 128, False, False, 132),
    ("gqa 32/8 d128, 1 chunk, persistent grid of 64 CTAs", 64, 4096, 32, 8, 128, False, False,
     64),
    ("gqa 32/8 d128, ragged, 2 chunks", 64, 4096, 32, 8, 128, False, True, 64),
    ("mqa 8/1 d64, 16 chunks", 8, 32768, 8, 1, 64, False, False, 132),
    ("gqa 32/8 d256, 2 chunks", 8, 32768, 32, 8, 256, False, False, 132),
    ("gqa 32/8 d128, 16 chunks of pages of 16", 8, 32768, 32, 8, 128, True, True, 64),
])
def test_one_token_decode_kernels_lower_for_hopper_with_q_read_in_place(
    name, b, s, n, kv_heads, d, paged, ragged, streams, cross_lower):
  """The heads-major kernel of the heuristic's plan (4 or 8 rows per KV head,
  Q rows shared by the chunks of a sequence, a persistent grid where the
  items outnumber the streams) lowers for sm_90 and fits SMEM."""
  from fa4_jax.kernels import sm90_forward
  q = jax.ShapeDtypeStruct((b, 1, n, d), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
  plan = sm90_decode.plan(q.shape, (b, s, kv_heads, d), MaskSpec(), ragged=ragged,
                          granule=16 if paged else 1, num_sms=132, streams=streams)
  assert (plan.config is not None and plan.config.persistent) == ("persistent" in name)
  assert (plan.splits > 1) == ("chunks" in name)
  assert sm90_decode.reads_query_in_place(q.shape, kv_heads)
  if paged:
    pages = jax.ShapeDtypeStruct((b * s // 16, 16, kv_heads, d), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((b, s // 16), jnp.int32)
    lowered = cross_lower(lambda q, k, v, t, n: sm90_decode.forward(
        q, k, v, None, n, score=ScoreFunction(0.1), mask=MaskSpec(), plan=plan, page_table=t)[0],
                          q, pages, pages, table, lengths)
  else:
    kv = jax.ShapeDtypeStruct((b, s, kv_heads, d), jnp.bfloat16)
    lowered = cross_lower(lambda q, k, v, n: sm90_decode.forward(
        q, k, v, None, n, score=ScoreFunction(0.1), mask=MaskSpec(), plan=plan)[0],
                          q, kv, kv, lengths)
  assert len(lowered.modules) == 1
  assert lowered.max_smem_bytes <= sm90_forward.SMEM_LIMIT_BYTES
  for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor"):
    assert lowered.has(instruction)
