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
  of a row straddling a chunk boundary, pages of 16 shuffled (16-bit and
  float8), sinks and soft-cap, query lengths shorter than T; a query that
  sees no key gets zeros (lse -inf), as the forward kernel gives it.
  Gradients (the sm90 backward from the combined lse) equal the XLA path's.
  The interpreter's cost is mostly a price per interpreted run, so there are
  four runs on caches of 256 keys in two chunks of 128: contiguous with a
  forced split; the public contiguous call with query lengths, and its
  gradients; paged G1 with sinks and soft-cap; float8 pages G4 (the last
  three in the planner's chunks, `short_chunks`).
* The planner's kernels of B8 T16 / T64 S32768 Hq32 Hkv8 D128 lower for
  sm_90 (contiguous, pages of 16 and 64; each T and each layout once) and
  fit SMEM.
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


# Lengths against chunks of 128 keys: the last T keys straddling the
# boundary at 128 (130 with T 5: keys 125..129), 0, shorter than T, the whole
# row. G 4 (GQA packing, rows r // 4 a token); G 1 with these cases: the
# paged test, with pages and the planner's chunks of 512.
def test_forced_split_with_the_last_keys_straddling_a_chunk_boundary(run_interpreted):
  t, n, kv_heads, lengths = 5, 4, 1, (130, 0, 3, 256)
  q, k, v = _inputs(0, len(lengths), t, 256, n, kv_heads, 64)
  lengths = jnp.asarray(lengths, jnp.int32)
  plan = sm90_decode.DecodePlan(splits=2)  # chunks of 128 keys
  out, lse = run_interpreted(lambda q, k, v, n: sm90_decode.forward(
      q, k, v, None, n, score=ScoreFunction(64 ** -0.5), mask=BAND, plan=plan), q, k, v, lengths)
  _check(out, lse, q, k, v, lengths)


def test_chunk_lengths_count_the_rows_keys_from_each_chunks_first_key():
  got = sm90_decode.chunk_lengths(jnp.asarray([130, 0, 3, 512]), 4, 512, 4).reshape(4, 4)
  np.testing.assert_array_equal(got, [[130, 2, 0, 0], [0, 0, 0, 0], [3, 0, 0, 0],
                                      [512, 384, 256, 128]])


def _paged_cache(seed, **shape):
  """test_paged's shuffled paged cache, in bfloat16 (the kernels' dtype)."""
  return paged_cache(seed, dtype=jnp.bfloat16, **shape)


def _gathered(pages, table):
  b, max_pages = table.shape
  _, page_size, kv_heads, d = pages.shape
  return jnp.asarray(np.asarray(pages, np.float32)[np.asarray(table)].reshape(
      b, max_pages * page_size, kv_heads, d))


@pytest.fixture
def short_chunks(monkeypatch):
  """The planner splits caches of 256 keys into two chunks of 128 (its
  chunks hold at least `sm90_decode.MIN_CHUNK` keys, 512): split-K and the
  combine on a cache the interpreter runs quickly."""
  monkeypatch.setattr(sm90_decode, "MIN_CHUNK", 128)


def _planned_chunks(args) -> int:
  """The chunks the paged call `args` is planned in (`paged_decode_plan`)."""
  with fa4_jax.interpret_mode():
    plan = backends.paged_decode_plan(paged._validated(
        *args, scale=None, is_causal=True, sinks=None, logits_soft_cap=None,
        implementation="sm90", query_descale=None, key_descale=None, value_descale=None,
        output_dtype=None, value_head_dim=None, score_mod=None, mask_mod=None))
  return plan.splits


def test_paged_causal_reads_the_shuffled_pages_in_chunks(run_interpreted, short_chunks):
  # G 1 with sinks and soft-cap (G 4 over pages: the float8 test); 129: keys
  # 127, 128 straddle the chunks' 128; 1 is shorter than T, 90 a page's middle.
  args = _paged_cache(2, batch=3, t=2, q_heads=2, kv_heads=2, head_dim=64, page_size=16,
                      max_pages=16, lengths=(129, 1, 90))
  q, kp, vp, table, lengths = args
  options = dict(sinks=jnp.linspace(-1.0, 2.0, 2, dtype=jnp.float32), logits_soft_cap=20.0)
  assert _planned_chunks(args) == 2
  out = run_interpreted(lambda *a: fa4_jax.paged_attention(*a, implementation="sm90", **options),
                        *args)
  _check(out, None, q, _gathered(kp, table), _gathered(vp, table), lengths,
         sinks=options["sinks"], soft_cap=options["logits_soft_cap"])


def test_float8_pages_under_a_16_bit_query(run_interpreted, short_chunks):
  # The kernel widens the float8 pages in SMEM (`sm90_forward`'s float8
  # cache); the band is the same. Reference: the float8 values, widened.
  q, kp, vp, table, lengths = _paged_cache(7, batch=3, t=5, q_heads=4, kv_heads=1, head_dim=64,
                                           page_size=16, max_pages=16, lengths=(130, 4, 250))
  kp, vp = kp.astype(jnp.float8_e4m3fn), vp.astype(jnp.float8_e4m3fn)  # G 4
  args = (q, kp, vp, table, lengths)
  assert _planned_chunks(args) == 2
  out = run_interpreted(lambda *a: fa4_jax.paged_attention(*a, implementation="sm90"), *args)
  _check(out, None, q, _gathered(kp, table), _gathered(vp, table), lengths)


def test_query_lengths_and_gradients_through_the_public_call(run_interpreted, short_chunks):
  """`fa4_jax.attention` in the decode arrangement (G 4, the planner's two
  chunks): row b's valid queries 0 .. q_len - 1 sit at L - q_len + t, the
  rest get zeros; the gradients (the sm90 backward from the combined lse)
  equal the XLA path's."""
  q, k, v = _inputs(4, 3, 5, 256, 4, 1, 64)
  # 130 with 3 queries: keys 127..129 straddle the chunks' 128.
  q_lengths, kv_lengths = jnp.asarray([3, 5, 0], jnp.int32), jnp.asarray([130, 2, 200], jnp.int32)
  options = dict(is_causal=True, causal_alignment="bottom_right", query_seq_lengths=q_lengths,
                 key_value_seq_lengths=kv_lengths)
  with fa4_jax.interpret_mode():
    which = lambda part: fa4_jax.which_implementation(q, k, v, implementation="sm90",
                                                      part=part, **options)
    assert which("forward") == "sm90_decode" and which("backward") == "sm90"
    assert sm90_decode.plan(q.shape, k.shape, BAND, ragged=True).splits == 2
  dout = jax.random.normal(jax.random.key(6), q.shape, jnp.float32)
  call = lambda impl: lambda q, k, v: fa4_jax.attention(q, k, v, implementation=impl,
                                                        **options)

  def forward_and_grads(impl):
    def run(q, k, v):
      out, vjp = jax.vjp(lambda q, k, v: call(impl)(q, k, v).astype(jnp.float32), q, k, v)
      return out, vjp(dout)
    return run

  out, got = run_interpreted(forward_and_grads("sm90"), q, k, v)
  ql, kl = np.asarray(q_lengths), np.asarray(kv_lengths)
  tok, j = np.arange(5)[None, :, None], np.arange(256)[None, None, :]
  visible = ((j < kl[:, None, None]) & (j <= (kl - ql)[:, None, None] + tok)
             & (tok < ql[:, None, None]))[:, None]
  want, _ = einsum_attention(q, k, v, visible)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=2e-2, rtol=2e-2)
  _, want_grads = forward_and_grads("xla")(q, k, v)
  for g, w in zip(got, want_grads):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               atol=5e-2, rtol=5e-2)


# --- cross-lowering for Hopper ---------------------------------------------------


# Each T (64 or 256 packed rows) and each layout (contiguous, pages of 16 and 64) once.
@pytest.mark.parametrize("t, page_size", [(16, None), (64, 16), (16, 64)])
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
  r_lens = list(range(0, chunk + t + 1, 3))
  for q_lo in range(0, q_len, rows):
    row = np.arange(q_lo, q_lo + rows)[:, None]
    # Every remaining length at once (one traced call per tile, not one per length).
    seen_all = np.asarray(jax.vmap(lambda r: visible(
        mask, jnp.asarray(row), jnp.asarray(keys[None, :]), r, q_len=jnp.int32(q_len)))(
            jnp.asarray(r_lens, jnp.int32)))
    def ranges(r_len):
      got = kv_tile_ranges(mask, q_lo, q_lo + rows, jnp.int32(q_len), r_len, block)
      return jnp.stack([got.lo, got.hi, got.full_lo, got.full_hi])

    ranges_all = np.asarray(jax.vmap(ranges)(jnp.asarray(r_lens, jnp.int32)))
    for r_len, seen, ranges in zip(r_lens, seen_all, ranges_all):
      want = ((keys[None, :] < min(r_len, chunk))
              & (keys[None, :] <= r_len - t + row // g))
      want &= row < q_len
      np.testing.assert_array_equal(seen & (row < q_len), want)
      lo, hi, full_lo, full_hi = (int(x) for x in ranges)
      blocks = want.reshape(rows, chunk // block, block)
      touched = np.flatnonzero(blocks.any(axis=(0, 2)))
      assert all(lo <= b < hi for b in touched), (r_len, q_lo, lo, hi, touched)
      assert hi <= chunk // block  # never a block past the chunk
      valid = blocks[:min(rows, q_len - q_lo)]
      for b in range(full_lo, full_hi):
        assert valid[:, b].all(), (r_len, q_lo, b)
