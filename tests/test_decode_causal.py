"""Causal bottom-right in the decode arrangement (issue #54).

Specification:
* The last T tokens of each row (query t at position L - T + t, L the row's
  key length; chunked prefill, speculative decoding) run in the decode
  arrangement of `fa4_jax.kernels.sm90_decode` when T x G packed rows fit
  `sm90_decode.MAX_PACKED_ROWS`: GQA packing (row r = t * G + g holds
  token r // G: `MaskSpec.rows_per_position`) and split-K, each chunk given
  the row's keys from its first key on (`sm90_decode.chunk_lengths`,
  `MaskSpec.key_chunk`) so that the band of every chunk is the row's.
  Contiguous caches through `fa4_jax.attention(is_causal=True,
  causal_alignment="bottom_right")` (with key lengths or without) and paged
  caches through `paged_attention` (causal by default).
* Numerics (interpreter with race detection): out (and lse) equal an f32
  einsum with the explicit bottom-right mask, T in {2, 5}, G in {1, 4},
  ragged lengths (0, shorter than T, a page's middle, full), the last T keys
  of a row straddling a chunk boundary, pages of 16 shuffled, sinks and
  soft-cap, query lengths shorter than T; a query that sees no key gets
  zeros (lse -inf), as the forward kernel gives it. Gradients (the sm90
  backward from the combined lse) equal the XLA path's.
* The planner's kernels of B8 T16 / T64 S32768 Hq32 Hkv8 D128 lower for
  sm_90 (contiguous, pages of 16 and 64) and fit SMEM.
* Selection: `which_implementation` says "sm90_decode" and the paged call
  plans the arrangement for these calls; beyond 256 packed rows, other
  bands (top-left causal, windows) and float8 queries keep the forward kernel.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import backends, paged
from fa4_jax.kernels import sm90_decode, sm90_forward
from fa4_jax.scores import MaskSpec, ScoreFunction
from reference import einsum_attention
from test_paged import _paged_cache as paged_cache

BAND = MaskSpec(right=0, offset_from_lengths=True)


def _bottom_right(t, s, lengths):
  """[B, 1, T, S]: key j < L and j <= L - T + t."""
  lengths = np.asarray(lengths)
  j = np.arange(s)[None, None, :]
  pos = lengths[:, None] - t + np.arange(t)[None, :]
  return ((j < lengths[:, None, None]) & (j <= pos[:, :, None]))[:, None]


def _inputs(seed, b, t, s, n, kv_heads, d):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (b, t, n, d), jnp.bfloat16),
          jax.random.normal(keys[1], (b, s, kv_heads, d), jnp.bfloat16),
          jax.random.normal(keys[2], (b, s, kv_heads, d), jnp.bfloat16) + 1.0)


def _check(out, lse, q, k, v, lengths, tol=2e-2, **reference):
  t, s = q.shape[1], k.shape[1]
  visible = _bottom_right(t, s, lengths)
  want, want_lse = einsum_attention(q, k, v, visible, **reference)
  out = np.asarray(out, np.float32)
  assert np.all(np.isfinite(out))
  np.testing.assert_allclose(out, np.asarray(want), atol=tol, rtol=tol)
  if lse is not None:
    seen = visible[:, 0].any(-1)  # [B, T]
    lse = np.asarray(lse)  # [B, Hq, T]
    assert np.all(lse.transpose(0, 2, 1)[~seen] == -np.inf)
    np.testing.assert_allclose(np.where(seen[:, None], lse, 0.0),
                               np.where(seen[:, None], np.asarray(want_lse), 0.0),
                               atol=tol, rtol=tol)


# Lengths against chunks of 128 keys: 0, shorter than T, the last T keys
# straddling the boundary at 128 (130 with T 5: keys 125..129; 129 with T 2:
# keys 127, 128), inside a chunk, the whole row.
@pytest.mark.parametrize("t, n, kv_heads, lengths", [
    (5, 8, 2, (130, 0, 3, 512)),   # G 4
    (2, 2, 2, (129, 1, 200, 384)),  # G 1
])
def test_forced_split_with_the_last_keys_straddling_a_chunk_boundary(t, n, kv_heads, lengths,
                                                                      run_interpreted):
  q, k, v = _inputs(0, len(lengths), t, 512, n, kv_heads, 64)
  lengths = jnp.asarray(lengths, jnp.int32)
  plan = sm90_decode.DecodePlan(splits=4)  # chunks of 128 keys
  out, lse = run_interpreted(lambda q, k, v, n: sm90_decode.forward(
      q, k, v, None, n, score=ScoreFunction(64 ** -0.5), mask=BAND, plan=plan), q, k, v, lengths)
  _check(out, lse, q, k, v, lengths)


def test_chunk_lengths_count_the_rows_keys_from_each_chunks_first_key():
  got = sm90_decode.chunk_lengths(jnp.asarray([130, 0, 3, 512]), 4, 512, 4).reshape(4, 4)
  np.testing.assert_array_equal(got, [[130, 2, 0, 0], [0, 0, 0, 0], [3, 0, 0, 0],
                                      [512, 384, 256, 128]])


@pytest.mark.parametrize("t, n, kv_heads, lengths", [
    (5, 4, 1, (514, 3, 0, 1024)),   # G 4; 514: keys 509..513 straddle 512
    (2, 2, 2, (513, 1, 700, 40)),   # G 1
])
def test_attention_bottom_right_with_lengths_takes_the_arrangement(t, n, kv_heads, lengths,
                                                                    run_interpreted):
  q, k, v = _inputs(1, len(lengths), t, 1024, n, kv_heads, 64)
  lengths = jnp.asarray(lengths, jnp.int32)
  call = lambda q, k, v, n: fa4_jax.attention(
      q, k, v, is_causal=True, causal_alignment="bottom_right", key_value_seq_lengths=n,
      implementation="sm90")
  with fa4_jax.interpret_mode():
    assert fa4_jax.which_implementation(
        q, k, v, is_causal=True, causal_alignment="bottom_right", key_value_seq_lengths=lengths,
        implementation="sm90") == "sm90_decode"
    assert sm90_decode.plan(q.shape, k.shape, BAND, ragged=True).splits == 2
  out = run_interpreted(call, q, k, v, lengths)
  _check(out, None, q, k, v, lengths)


def _paged_cache(seed, **shape):
  """test_paged's shuffled paged cache, in bfloat16 (the kernels' dtype)."""
  return paged_cache(seed, dtype=jnp.bfloat16, **shape)


def _gathered(pages, table):
  b, max_pages = table.shape
  _, page_size, kv_heads, d = pages.shape
  return jnp.asarray(np.asarray(pages, np.float32)[np.asarray(table)].reshape(
      b, max_pages * page_size, kv_heads, d))


@pytest.mark.parametrize("t, q_heads, kv_heads, lengths, scored", [
    (5, 4, 1, (514, 3, 0, 1000), False),  # G 4; 514: keys 509..513 straddle the chunks' 512
    (2, 2, 2, (513, 1, 250, 1024), True),  # G 1; sinks and soft-cap
])
def test_paged_causal_reads_the_shuffled_pages_in_chunks(t, q_heads, kv_heads, lengths, scored,
                                                         run_interpreted):
  args = _paged_cache(2, batch=len(lengths), t=t, q_heads=q_heads, kv_heads=kv_heads,
                      head_dim=64, page_size=16, max_pages=64, lengths=lengths)
  q, kp, vp, table, lengths = args
  options = {}
  if scored:
    options = dict(sinks=jnp.linspace(-1.0, 2.0, q_heads, dtype=jnp.float32),
                   logits_soft_cap=20.0)
  with fa4_jax.interpret_mode():
    plan = backends.paged_decode_plan(paged._validated(
        *args, scale=None, is_causal=True, sinks=None, logits_soft_cap=None,
        implementation="sm90", query_descale=None, key_descale=None, value_descale=None,
        output_dtype=None, value_head_dim=None, score_mod=None, mask_mod=None))
  assert plan is not None and plan.splits == 2
  out = run_interpreted(lambda *a: fa4_jax.paged_attention(*a, implementation="sm90", **options),
                        *args)
  reference = dict(sinks=options.get("sinks"), soft_cap=options.get("logits_soft_cap"))
  _check(out, None, q, _gathered(kp, table), _gathered(vp, table), lengths, **reference)


def test_query_lengths_shorter_than_t_align_each_rows_last_query(run_interpreted):
  # Row b's valid queries 0 .. q_len - 1 sit at L - q_len + t; the rest get zeros.
  q, k, v = _inputs(4, 3, 5, 1024, 8, 2, 64)
  q_lengths, kv_lengths = jnp.asarray([3, 5, 0], jnp.int32), jnp.asarray([514, 2, 700], jnp.int32)
  with fa4_jax.interpret_mode():
    assert fa4_jax.which_implementation(
        q, k, v, is_causal=True, causal_alignment="bottom_right", query_seq_lengths=q_lengths,
        key_value_seq_lengths=kv_lengths, implementation="sm90") == "sm90_decode"
  out = run_interpreted(lambda q, k, v, a, n: fa4_jax.attention(
      q, k, v, is_causal=True, causal_alignment="bottom_right", query_seq_lengths=a,
      key_value_seq_lengths=n, implementation="sm90"), q, k, v, q_lengths, kv_lengths)
  ql, kl = np.asarray(q_lengths), np.asarray(kv_lengths)
  tok, j = np.arange(5)[None, :, None], np.arange(1024)[None, None, :]
  visible = ((j < kl[:, None, None]) & (j <= (kl - ql)[:, None, None] + tok)
             & (tok < ql[:, None, None]))[:, None]
  want, _ = einsum_attention(q, k, v, visible)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=2e-2, rtol=2e-2)


# --- cross-lowering for Hopper ---------------------------------------------------


@pytest.mark.parametrize("t", [16, 64])
@pytest.mark.parametrize("page_size", [None, 16, 64])
def test_the_planners_causal_kernels_lower_for_hopper(t, page_size, cross_lower):
  b, s, n, kv_heads, d = 8, 32768, 32, 8, 128
  q = jax.ShapeDtypeStruct((b, t, n, d), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
  granule = page_size or 1
  plan = sm90_decode.plan(q.shape, (b, s, kv_heads, d), BAND, ragged=True, granule=granule,
                          num_sms=132, streams=128)
  # The band-free call's config (ragged: the forward heuristic's for the chunk).
  assert plan.config == sm90_decode.band_config(d, s // plan.splits, t * n // kv_heads)
  score = ScoreFunction(d ** -0.5)
  if page_size is None:
    kv = jax.ShapeDtypeStruct((b, s, kv_heads, d), jnp.bfloat16)
    lowered = cross_lower(lambda q, k, v, n: sm90_decode.forward(
        q, k, v, None, n, score=score, mask=BAND, plan=plan)[0], q, kv, kv, lengths)
  else:
    pages = jax.ShapeDtypeStruct((b * s // page_size, page_size, kv_heads, d), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((b, s // page_size), jnp.int32)
    lowered = cross_lower(lambda q, k, v, p, n: sm90_decode.forward(
        q, k, v, None, n, score=score, mask=BAND, plan=plan, page_table=p)[0],
                          q, pages, pages, table, lengths)
  assert len(lowered.modules) == 1
  assert lowered.max_smem_bytes <= sm90_forward.SMEM_LIMIT_BYTES
  for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor"):
    assert lowered.has(instruction)


# --- selection -------------------------------------------------------------------


def test_plans_of_a_band_are_the_band_free_calls():
  for t, ragged, granule in ((16, True, 16), (64, True, 64), (16, False, 1), (4, True, 1)):
    q_shape, k_shape = (8, t, 32, 128), (8, 32768, 8, 128)
    dense = sm90_decode.plan(q_shape, k_shape, MaskSpec(), ragged=ragged, granule=granule,
                             num_sms=132, streams=128)
    band = sm90_decode.plan(q_shape, k_shape, BAND, ragged=ragged, granule=granule,
                            num_sms=132, streams=128)
    assert band.splits == dense.splits
    assert band.config == (dense.config or sm90_decode.band_config(128, 32768 // dense.splits,
                                                                   t * 4))
  # Without lengths the bottom-right band is the static offset S - T.
  assert sm90_decode.plan((8, 16, 32, 128), (8, 32768, 8, 128),
                          MaskSpec(right=0, q_offset=32768 - 16), num_sms=132) is not None


@pytest.mark.parametrize("name, mask, t, s", [
    ("top-left causal", MaskSpec(right=0), 16, 32768),
    ("square causal (self-attention)", MaskSpec(right=0), 16, 16),
    ("static offset, more queries than keys", MaskSpec(right=0, q_offset=-16), 32, 16),
    ("window", MaskSpec(left=256, right=0, offset_from_lengths=True), 16, 32768),
    ("65 tokens x 4 heads", BAND, 65, 32768),
])
def test_other_bands_and_long_queries_plan_nothing(name, mask, t, s):
  assert sm90_decode.plan((8, t, 32, 128), (8, s, 8, 128), mask, num_sms=132) is None


def test_which_implementation_picks_the_arrangement_for_bottom_right_causal():
  q, k, v = _inputs(3, 2, 16, 2048, 32, 8, 128)
  lengths = jnp.asarray([2048, 100], jnp.int32)
  which = lambda q, **o: fa4_jax.which_implementation(q, k, v, implementation="sm90",
                                                      is_causal=True, **o)
  with fa4_jax.interpret_mode():
    assert which(q, causal_alignment="bottom_right", key_value_seq_lengths=lengths) == \
        "sm90_decode"
    assert which(q, causal_alignment="bottom_right") == "sm90_decode"
    assert which(q) == "sm90"  # top-left
    assert which(jnp.concatenate([q] * 5, axis=1), causal_alignment="bottom_right",
                 key_value_seq_lengths=lengths) == "sm90"  # 80 tokens x 4 heads


@pytest.fixture
def hopper(monkeypatch):
  monkeypatch.setattr(backends, "device_arch_major", lambda: 9)


@pytest.mark.parametrize("t, page_size, arrangement", [
    (16, 16, True), (64, 64, True), (4, 128, True), (65, 16, False), (300, 16, False)])
def test_paged_causal_calls_plan_the_arrangement_within_256_rows(t, page_size, arrangement,
                                                                  hopper):
  args = _paged_cache(4, batch=2, t=t, q_heads=8, kv_heads=2, head_dim=64,
                      page_size=page_size, max_pages=4096 // page_size, lengths=(4000, 7))
  assert fa4_jax.which_paged_implementation(*args) == "sm90"
  validated = paged._validated(
      *args, scale=None, is_causal=True, sinks=None, logits_soft_cap=None, implementation=None,
      query_descale=None, key_descale=None, value_descale=None, output_dtype=None,
      value_head_dim=None, score_mod=None, mask_mod=None)
  assert (backends.paged_decode_plan(validated) is not None) == arrangement


def test_gradients_are_the_sm90_backwards_from_the_combined_lse(run_interpreted):
  q, k, v = _inputs(5, 2, 5, 1024, 8, 2, 64)
  lengths = jnp.asarray([514, 3], jnp.int32)
  dout = jax.random.normal(jax.random.key(6), q.shape, jnp.float32)
  loss = lambda impl: lambda q, k, v: jnp.sum(fa4_jax.attention(
      q, k, v, is_causal=True, causal_alignment="bottom_right", key_value_seq_lengths=lengths,
      implementation=impl).astype(jnp.float32) * dout)
  got = run_interpreted(jax.grad(loss("sm90"), argnums=(0, 1, 2)), q, k, v)
  want = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               atol=5e-2, rtol=5e-2)


# --- the band's tile ranges, exhaustively on small sizes --------------------------


@pytest.mark.parametrize("g, t", [(1, 5), (3, 2), (4, 5)])
def test_packed_band_walks_every_visible_block_and_masks_every_partial_one(g, t):
  """For chunks of 256 keys in blocks of 64 and every remaining length R
  (0 .. 256 + T), the blocks `kv_tile_ranges` walks for a tile of 8 packed
  rows hold every key `visible` lets a row see, and its full blocks only
  pairs it lets every row see; `visible` is the row's band in the chunk's
  coordinates (token r // G at R - T + r // G, keys below min(R, 256))."""
  from fa4_jax.scores import kv_tile_ranges, visible

  chunk, block, rows = 256, 64, 8
  mask = sm90_decode.packed_band(g, chunk)
  q_len = t * g
  keys = np.arange(chunk)
  for r_len in range(0, chunk + t + 1, 3):
    for q_lo in range(0, q_len, rows):
      row = np.arange(q_lo, q_lo + rows)[:, None]
      seen = np.asarray(visible(mask, jnp.asarray(row), jnp.asarray(keys[None, :]),
                                jnp.int32(r_len), q_len=jnp.int32(q_len)))
      want = ((keys[None, :] < min(r_len, chunk))
              & (keys[None, :] <= r_len - t + row // g))
      want &= row < q_len
      np.testing.assert_array_equal(seen & (row < q_len), want)
      ranges = kv_tile_ranges(mask, q_lo, q_lo + rows, jnp.int32(q_len), jnp.int32(r_len),
                              block)
      lo, hi, full_lo, full_hi = (int(x) for x in (ranges.lo, ranges.hi, ranges.full_lo,
                                                   ranges.full_hi))
      blocks = want.reshape(rows, chunk // block, block)
      touched = np.flatnonzero(blocks.any(axis=(0, 2)))
      assert all(lo <= b < hi for b in touched), (r_len, q_lo, lo, hi, touched)
      assert hi <= chunk // block  # never a block past the chunk
      valid = blocks[:min(rows, q_len - q_lo)]
      for b in range(full_lo, full_hi):
        assert valid[:, b].all(), (r_len, q_lo, b)


def test_float8_pages_under_a_16_bit_query(run_interpreted):
  # The kernel widens the float8 pages in SMEM (`sm90_forward`'s float8
  # cache); the band is the same. Reference: the float8 values, widened.
  args = _paged_cache(7, batch=3, t=5, q_heads=8, kv_heads=2, head_dim=64, page_size=16,
                      max_pages=64, lengths=(514, 4, 1000))
  q, kp, vp, table, lengths = args
  kp, vp = kp.astype(jnp.float8_e4m3fn), vp.astype(jnp.float8_e4m3fn)
  out = run_interpreted(lambda *a: fa4_jax.paged_attention(*a, implementation="sm90"),
                        q, kp, vp, table, lengths)
  _check(out, None, q, _gathered(kp, table), _gathered(vp, table), lengths)
