"""The Blackwell (sm_100) forward kernel, checked without a Blackwell GPU.

* Interpretation: the kernel runs in Pallas' GPU interpreter with the race
  detector on (TMEM, SMEM, barriers, tcgen05 MMAs simulated) and must match
  `jax.nn.dot_product_attention(implementation="xla")` in f32 on the upcast
  inputs, within bf16 tolerance, with no data race; with sinks and soft-cap
  it must match `reference.einsum_attention` (rows past q_lengths: zeros and
  lse -inf; rows that see no key: zeros and lse = sink).
* Cross-lowering: the kernel is lowered for sm_100 on the CPU; the module must
  use tcgen05 MMAs (P read from TMEM), TMEM loads/stores/allocation, and fit
  the shared-memory and tensor-memory budgets.
* The barrier table: every `ForwardBarrierTable` accessor is listed in the row of
  the barrier it arrives on or waits on, and every barrier has both sides.
"""

import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import barrier_tables
import fa4_jax
import reference
from fa4_jax import scores
from fa4_jax.kernels import KernelUnsupported
from fa4_jax.kernels import sm100_forward, sm100_tiles
from fa4_jax.scores import MaskSpec, ScoreFunction, TileRanges

BF16_ATOL = 2e-2
LSE_ATOL = 1e-3


def _inputs(b, t, s, n, nkv, d, dtype, seed=0, key_growth=0.0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (b, t, n, d), jnp.float32)
  k = jax.random.normal(kk, (b, s, nkv, d), jnp.float32)
  if key_growth:
    # Logits that grow along the keys force the running max up block after
    # block, so the correction warpgroup must rescale O.
    k = k * (1.0 + key_growth * jnp.arange(s)[None, :, None, None] / s)
  v = jax.random.normal(kv, (b, s, nkv, d), jnp.float32)
  return q.astype(dtype), k.astype(dtype), v.astype(dtype)


CASES = {
    # name: (B, Tq, Tk, Nq, Nkv, D, causal, window, q_lengths, kv_lengths, dtype)
    "dense_d64": (1, 256, 256, 1, 1, 64, False, None, None, None, jnp.bfloat16),
    "causal_ragged_tails": (1, 200, 300, 1, 1, 64, True, None, None, None, jnp.bfloat16),
    "more_queries_than_keys": (1, 300, 200, 1, 1, 64, False, None, None, None, jnp.bfloat16),
    "causal_two_ctas_skip_blocks": (1, 512, 512, 1, 1, 64, True, None, None, None, jnp.bfloat16),
    "window_left_right": (1, 256, 384, 1, 1, 64, False, (64, 32), None, None, jnp.bfloat16),
    "causal_sliding_window": (1, 384, 384, 1, 1, 64, True, (100, 0), None, None, jnp.bfloat16),
    "seq_lengths": (2, 256, 256, 1, 1, 64, False, None, [100, 256], [256, 77], jnp.bfloat16),
    "rows_that_see_nothing": (2, 256, 256, 1, 1, 64, True, None, [256, 0], [0, 130], jnp.bfloat16),
    "gqa_causal": (1, 128, 256, 4, 2, 64, True, None, None, None, jnp.bfloat16),
    "mqa": (1, 128, 128, 3, 1, 64, False, None, None, None, jnp.bfloat16),
    "head_dim_128_causal": (1, 256, 256, 1, 1, 128, True, None, None, None, jnp.bfloat16),
    "head_dim_256_causal": (1, 128, 192, 1, 1, 256, True, None, None, None, jnp.bfloat16),
    "head_dim_256_ragged": (1, 130, 100, 2, 1, 256, False, None, None, None, jnp.bfloat16),
    "float16": (1, 256, 256, 1, 1, 64, False, None, None, None, jnp.float16),
}


def _check_against_xla(q, k, v, out, lse, *, causal, window, q_lengths, kv_lengths, scale):
  b, t, n, _ = q.shape
  s = k.shape[1]
  qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
  ql = None if q_lengths is None else jnp.asarray(q_lengths, jnp.int32)
  kl = None if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32)
  expected = jax.nn.dot_product_attention(
      qf, kf, vf, scale=scale, is_causal=causal, local_window_size=window,
      query_seq_lengths=ql, key_value_seq_lengths=kl, implementation="xla")
  visible = reference.visible_mask(
      t, s, is_causal=causal, window=window, q_lengths=q_lengths,
      kv_lengths=kv_lengths, batch=b)
  sees = reference.rows_seeing_keys(visible, n)  # [B, T, N, 1]
  # Rows that see no key: jax.nn's value there is arbitrary, ours is zero.
  expected = jnp.where(sees > 0, expected, 0.0)
  _, expected_lse = reference.einsum_attention(q, k, v, visible, scale=scale)
  _assert_out_and_lse(out, lse, expected, expected_lse)


def _assert_out_and_lse(out, lse, expected, expected_lse):
  """bf16 outputs against the reference; lse -inf exactly where the
  reference's is, close elsewhere."""
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected), atol=BF16_ATOL, rtol=BF16_ATOL)
  np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(expected_lse))
  finite = np.isfinite(expected_lse)
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(expected_lse)[finite], atol=LSE_ATOL, rtol=LSE_ATOL)


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreted_kernel_matches_xla_without_races(name, run_interpreted):
  b, t, s, n, nkv, d, causal, window, q_lengths, kv_lengths, dtype = CASES[name]
  q, k, v = _inputs(b, t, s, n, nkv, d, dtype)
  scale = 1.0 / np.sqrt(d)
  mask = MaskSpec.from_arguments(causal, window)
  ql = None if q_lengths is None else jnp.asarray(q_lengths, jnp.int32)
  kl = None if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32)
  out, lse = run_interpreted(
      lambda q, k, v: sm100_forward.forward(q, k, v, ql, kl, score=ScoreFunction(scale), mask=mask),
      q, k, v)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert lse.shape == (b, n, t) and lse.dtype == jnp.float32
  _check_against_xla(q, k, v, out, lse, causal=causal, window=window,
                     q_lengths=q_lengths, kv_lengths=kv_lengths, scale=scale)


def test_growing_logits_take_the_rescale_path(run_interpreted):
  """The row max grows by ~2**265 across the key blocks: without rescaling O
  in TMEM (correction warpgroup) P would overflow f32, so a correct result
  means the rescale path ran (and, with its threshold, stayed exact)."""
  q, k, v = _inputs(1, 256, 512, 1, 1, 64, jnp.bfloat16, seed=3, key_growth=14.0)
  scale = 0.5
  out, lse = run_interpreted(
      lambda q, k, v: sm100_forward.forward(q, k, v, None, None, score=ScoreFunction(scale),
                                            mask=MaskSpec()), q, k, v)
  _check_against_xla(q, k, v, out, lse, causal=False, window=None,
                     q_lengths=None, kv_lengths=None, scale=scale)


# --- Segment ids (packed sequences) ------------------------------------------


@dataclasses.dataclass(frozen=True)
class SegmentCase(reference.KernelCase):
  head_dim: int = 64


def _ids(*rows):
  return tuple(tuple(int(x) for x in r) for r in rows)


_DOCS = reference.packed_segment_ids
SEGMENT_CASES = {
    # Documents packed one after the other: CTA 0 (rows 0-255) is one
    # document (block 0 of its tile 1 needs no mask at all); CTA 1 walks
    # only block 2 (causality alone would walk 0-2), across a boundary.
    "packed_causal": SegmentCase(
        q_seq=384, kv_seq=384, is_causal=True,
        q_segment_ids=_ids(_DOCS([256, 100, 28], 384)),
        kv_segment_ids=_ids(_DOCS([256, 100, 28], 384))),
    # A window, lengths that cut documents, GQA, a packing per batch row;
    # in row 0 only tile 1's ids meet key block 2 (the CTA walks the hull).
    "window_lengths_gqa": SegmentCase(
        batch=2, q_seq=256, kv_seq=384, q_heads=4, kv_heads=2, window=(96, 16),
        q_lengths=(256, 200), kv_lengths=(384, 150),
        q_segment_ids=_ids(_DOCS([60, 140, 56], 256), _DOCS([256], 256)),
        kv_segment_ids=_ids(_DOCS([60, 140, 184], 384), _DOCS([100, 284], 384))),
    # Non-contiguous ids: every block needs the element mask.
    "interleaved_ids": SegmentCase(
        q_seq=256, kv_seq=256,
        q_segment_ids=_ids(np.arange(256) % 3), kv_segment_ids=_ids(np.arange(256) // 2 % 3)),
    # T != S with other layouts: a one-token document, an id the keys lack
    # (rows that see no key: zeros, lse -inf), odd extents.
    "one_token_and_absent_id": SegmentCase(
        q_seq=200, kv_seq=301,
        q_segment_ids=_ids(np.r_[np.zeros(50), [1], np.full(100, 2), np.full(49, 7)]),
        kv_segment_ids=_ids(np.r_[np.zeros(120), [1], np.full(180, 2)])),
    # head_dim 256: one Q tile per CTA and 64-key blocks; the last CTA's
    # ids meet no key at all (it walks nothing); float16.
    "head_dim_256_float16": SegmentCase(
        q_seq=384, kv_seq=256, head_dim=256, dtype="float16", is_causal=True,
        q_segment_ids=_ids(np.r_[_DOCS([70, 100, 86], 256), np.full(128, 9)]),
        kv_segment_ids=_ids(_DOCS([70, 100, 86], 256))),
}


def _run_segment_case(case: SegmentCase, run_interpreted):
  dtype = jnp.dtype(case.dtype)
  q, k, v = _inputs(case.batch, case.q_seq, case.kv_seq, case.q_heads, case.kv_heads,
                    case.head_dim, dtype, seed=7)
  scale = 1.0 / np.sqrt(case.head_dim)
  ql, kl = case.lengths()
  out, lse = run_interpreted(
      lambda q, k, v, ids: sm100_forward.forward(q, k, v, ql, kl, score=ScoreFunction(scale),
                                                 mask=case.mask,
                                                 segment_ids=ids),
      q, k, v, case.segment_ids())
  return (q, k, v), out, lse, scale


@pytest.mark.parametrize("name", sorted(SEGMENT_CASES))
def test_interpreted_kernel_with_segment_ids_matches_the_explicit_mask(name, run_interpreted):
  case = SEGMENT_CASES[name]
  (q, k, v), out, lse, scale = _run_segment_case(case, run_interpreted)
  visible = case.visible()
  expected, expected_lse = reference.einsum_attention(q, k, v, visible, scale=scale)
  _assert_out_and_lse(out, lse, expected, expected_lse)


def _walked_blocks(case: SegmentCase, segments: bool):
  """[B, CTAs] key blocks each CTA walks, from the kernel's own helpers."""
  cfg = sm100_forward.choose_config(case.head_dim, jnp.dtype(case.dtype))
  b, tq, tk = case.batch, case.q_seq, case.kv_seq
  num_ctas = -(-tq // cfg.rows_per_cta)
  row0 = jnp.arange(num_ctas)[None, :] * cfg.rows_per_cta
  q_len = jnp.full((b, 1), tq, jnp.int32)
  kv_len = jnp.full((b, 1), tk, jnp.int32)
  seg_tiles = None
  if segments:
    _, _, ranges = sm100_forward.segment_operands(cfg, case.segment_ids(), b, tq, tk, tq)
    ranges = ranges.reshape(b, num_ctas, cfg.num_q_tiles, 4)
    seg_tiles = [TileRanges(*(ranges[:, :, i, j] for j in range(4)))
                 for i in range(cfg.num_q_tiles)]
  _, steps = sm100_forward.cta_key_blocks(case.mask, cfg, row0, q_len, kv_len, seg_tiles)
  return np.asarray(steps), seg_tiles


def test_segment_ids_skip_key_blocks_no_tile_of_the_cta_meets():
  """Four documents of 256 tokens, causal, head_dim 64 (CTAs of 256 rows,
  128-key blocks): each CTA walks only its own document's two blocks, not
  every block up to the diagonal, and every block of a one-document tile is
  walked without the element mask (its [full_lo, full_hi) is all of it)."""
  ids = _ids(np.repeat(np.arange(4), 256))
  case = SegmentCase(q_seq=1024, kv_seq=1024, is_causal=True,
                     q_segment_ids=ids, kv_segment_ids=ids)
  without, _ = _walked_blocks(case, segments=False)
  with_ids, seg_tiles = _walked_blocks(case, segments=True)
  np.testing.assert_array_equal(without, [[2, 4, 6, 8]])
  np.testing.assert_array_equal(with_ids, [[2, 2, 2, 2]])
  for tile in seg_tiles:
    np.testing.assert_array_equal(tile.full_hi - tile.full_lo, 2)
    np.testing.assert_array_equal(tile.lo, tile.full_lo)


def test_a_cta_whose_ids_meet_no_key_walks_nothing():
  case = SEGMENT_CASES["head_dim_256_float16"]
  steps, _ = _walked_blocks(case, segments=True)
  assert steps[0, -1] == 0 and (steps[0, :-1] > 0).all()


def test_segment_ids_of_the_wrong_shape_are_rejected():
  q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
  ids = jnp.zeros((1, 100), jnp.int32)
  with pytest.raises(KernelUnsupported, match="segment ids"):
    sm100_forward.forward(q, q, q, None, None, score=ScoreFunction(0.1), mask=MaskSpec(),
                          segment_ids=(ids, ids))


@pytest.mark.parametrize("head_dim, causal, window", [
    (64, False, None), (128, True, None), (256, True, (200, 0)),
])
def test_cross_lowers_for_sm100_with_segment_ids(head_dim, causal, window, cross_lower):
  """Every tiling (one per head dim) with segment ids: the id loads in the
  TMEM row layouts lower, and the kernel stays within SMEM."""
  q_spec = jax.ShapeDtypeStruct((2, 300, 4, head_dim), jnp.bfloat16)
  kv_spec = jax.ShapeDtypeStruct((2, 1030, 2, head_dim), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  q_ids = jax.ShapeDtypeStruct((2, 300), jnp.int32)
  kv_ids = jax.ShapeDtypeStruct((2, 1030), jnp.int32)
  mask = MaskSpec.from_arguments(causal, window)
  lowered = cross_lower(
      lambda q, k, v, a, b, x, y: sm100_forward.forward(q, k, v, a, b, score=ScoreFunction(0.1),
                                                        mask=mask,
                                                        segment_ids=(x, y)),
      q_spec, kv_spec, kv_spec, lengths, lengths, q_ids, kv_ids, arch="sm_100")
  assert len(lowered.modules) == 1
  for instruction in ("tcgen05.mma.cta_group::1.kind::f16", "tcgen05.ld", "tcgen05.st"):
    assert lowered.has(instruction), instruction
  assert 0 < lowered.max_smem_bytes <= sm100_tiles.SMEM_BYTES


# --- Attention sinks and logit soft-capping ----------------------------------


@dataclasses.dataclass(frozen=True)
class OptionCase(reference.KernelCase):
  """A call with `sinks` (one per query head) and / or `soft_cap`."""

  q_seq: int = 256
  kv_seq: int = 256
  sinks: tuple[float, ...] | None = None
  soft_cap: float | None = None
  logit_scale: float = 1.0  # multiplies q: large logits
  key_growth: float = 0.0  # see _inputs: forces the rescale path


OPTION_CASES = {
    # Logits up to ~+-20 that the cap squeezes into +-5; two query heads per
    # key/value head; the causal diagonal blocks need the element mask after
    # the tanh.
    "soft_cap_causal_gqa": OptionCase(
        q_heads=2, kv_heads=1, is_causal=True, soft_cap=5.0, logit_scale=3.0),
    # Row 0: rows 0-63 see no key (the window ends 64 keys before the row)
    # inside a CTA that walks blocks, rows from 200 on are past q_len. Row 1:
    # no key at all (kv_len 0: no CTA walks a block), rows from 100 on past
    # q_len. Seen-nothing rows: zeros, lse = sink; past q_len: zeros, -inf.
    "sinks_lengths_and_rows_without_keys": OptionCase(
        batch=2, q_heads=2, window=(256, -64), q_lengths=(200, 100), kv_lengths=(256, 0),
        sinks=(0.5, -2.0)),
    "sinks_and_soft_cap_head_dim_128": OptionCase(
        q_heads=2, kv_heads=1, head_dim=128, is_causal=True, q_lengths=(230,),
        sinks=(1.0, -1.5), soft_cap=8.0, logit_scale=2.0),
    # Sinks of +-30 with large logits: the +30 sink holds the running max
    # through the first key block (43 in log2 units against ~27), then the
    # keys' max overtakes it by ~2**20 (O is rescaled); -30 weighs nothing.
    "large_sinks_and_logits": OptionCase(
        q_heads=2, kv_seq=384, sinks=(30.0, -30.0), logit_scale=4.0, key_growth=4.0),
    # head_dim 256 (one Q tile, 64-key blocks) in float16, both options.
    "head_dim_256_float16": OptionCase(
        q_seq=130, kv_seq=200, q_heads=2, head_dim=256, dtype="float16", is_causal=True,
        sinks=(2.0, -0.5), soft_cap=4.0, logit_scale=2.0),
}


def _expected_with_options(case: OptionCase, q, k, v, scale):
  """The f32 reference; rows at or past q_lengths keep zeros and lse -inf
  (the reference's sink column would give them lse = sink)."""
  sinks = None if case.sinks is None else jnp.asarray(case.sinks, jnp.float32)
  out, lse = reference.einsum_attention(q, k, v, case.visible(), scale=scale, sinks=sinks,
                                        soft_cap=case.soft_cap)
  q_len = case.q_seq if case.q_lengths is None else np.asarray(case.q_lengths)[:, None, None]
  return out, jnp.where(np.arange(case.q_seq)[None, None, :] < q_len, lse, -jnp.inf)


@pytest.mark.parametrize("name", sorted(OPTION_CASES))
def test_interpreted_kernel_with_sinks_and_soft_cap_matches_the_reference(name, run_interpreted):
  _check_option_case(OPTION_CASES[name], run_interpreted)


def test_soft_cap_keeps_a_fixed_max_and_matches_the_reference(run_interpreted, monkeypatch):
  """bf16 with a cap near the bound (`scores.fixed_max_is_exact`: 60 for 256
  keys, P up to ~2^78): the softmax never runs the running max and the
  correction never rescales O, and the kernel still matches the f32
  reference, with GQA, sinks on both sides of 0 (the fixed max is
  max(sink, 0)) and rows 0-63 that see no key (zeros, lse = sink)."""
  case = OptionCase(q_heads=4, kv_heads=2, window=(256, -64), sinks=(1.0, -2.0, 45.0, -30.0),
                    soft_cap=60.0, logit_scale=32.0)  # logits of std ~32
  assert scores.fixed_max_is_exact(jnp.bfloat16, case.soft_cap, case.kv_seq)

  def refuse(*args, **kwargs):
    raise AssertionError("the fixed-max path must not take a running max or rescale O")

  monkeypatch.setattr(scores, "online_softmax", refuse)
  monkeypatch.setattr(sm100_forward, "_rescale_o", refuse)
  _check_option_case(case, run_interpreted)


def _check_option_case(case: OptionCase, run_interpreted):
  q, k, v = _inputs(case.batch, case.q_seq, case.kv_seq, case.q_heads, case.kv_heads,
                    case.head_dim, jnp.float32, seed=11, key_growth=case.key_growth)
  q, k, v = (x.astype(case.dtype) for x in (q * case.logit_scale, k, v))
  scale = 1.0 / np.sqrt(case.head_dim)
  ql, kl = case.lengths()
  options = {}
  if case.sinks is not None:
    options["sinks"] = jnp.asarray(case.sinks, jnp.float32)
  score = ScoreFunction(scale, case.soft_cap)
  out, lse = run_interpreted(
      lambda q, k, v, opts: sm100_forward.forward(q, k, v, ql, kl, score=score, mask=case.mask,
                                                  **opts),
      q, k, v, options)
  expected, expected_lse = _expected_with_options(case, q, k, v, scale)
  _assert_out_and_lse(out, lse, expected, expected_lse)
  if case.sinks is not None:
    # Rows that see no key: zeros and exactly their head's sink (up to the
    # log2 units the kernel keeps).
    sees = np.asarray(case.visible()).any(-1)[:, 0]  # [B, T]
    rows = np.broadcast_to(np.isfinite(expected_lse) & ~sees[:, None, :], lse.shape)
    sink_rows = np.broadcast_to(np.asarray(case.sinks)[None, :, None], lse.shape)
    np.testing.assert_allclose(np.asarray(lse)[rows], sink_rows[rows], rtol=1e-6)
    assert np.all(np.asarray(out, np.float32).transpose(0, 2, 1, 3)[rows] == 0)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cross_lowers_for_sm100_with_sinks_and_soft_cap(head_dim, cross_lower):
  """Every tiling with both options: the sink operand, the row iota of the
  epilogue and the tanh lower, and the soft-cap costs one tanh.approx.f32 per
  score element (block_kv of them per softmax thread and Q tile)."""
  q_spec = jax.ShapeDtypeStruct((2, 300, 4, head_dim), jnp.bfloat16)
  kv_spec = jax.ShapeDtypeStruct((2, 1030, 2, head_dim), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  sinks = jax.ShapeDtypeStruct((4,), jnp.float32)
  mask = MaskSpec.from_arguments(True, None)
  lowered = cross_lower(
      lambda q, k, v, a, b, s: sm100_forward.forward(q, k, v, a, b, score=ScoreFunction(0.1, 30.0),
                                                     mask=mask,
                                                     sinks=s),
      q_spec, kv_spec, kv_spec, lengths, lengths, sinks, arch="sm_100")
  assert len(lowered.modules) == 1
  for instruction in ("tcgen05.mma.cta_group::1.kind::f16", "tcgen05.ld", "tcgen05.st"):
    assert lowered.has(instruction), instruction
  cfg = sm100_forward.choose_config(head_dim, jnp.bfloat16)
  assert lowered.modules[0].count("tanh.approx.f32") == cfg.num_q_tiles * cfg.block_kv
  assert 0 < lowered.max_smem_bytes <= sm100_tiles.SMEM_BYTES


def test_bad_sinks_and_soft_caps_are_rejected():
  q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
  with pytest.raises(KernelUnsupported, match=r"sinks must be \[query heads\] = \(2,\)"):
    sm100_forward.forward(q, q, q, None, None, score=ScoreFunction(0.1), mask=MaskSpec(),
                          sinks=jnp.zeros((3,), jnp.float32))
  for cap in (0.0, -1.0):  # the score function a kernel takes cannot hold them
    with pytest.raises(ValueError, match="soft-cap must be a float > 0"):
      ScoreFunction(0.1, cap)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_tmem_plan_fits_512_columns(head_dim):
  cfg = sm100_forward.choose_config(head_dim, jnp.bfloat16)
  # S_i/P_i share columns; O_i has head_dim columns.
  assert cfg.tmem_columns() == cfg.num_q_tiles * (cfg.block_kv + head_dim)
  assert cfg.tmem_columns() <= sm100_tiles.TMEM_COLUMNS


def test_tmem_budget_is_asserted():
  too_big = sm100_forward.TileConfig(256, jnp.dtype(jnp.bfloat16), block_kv=128,
                                     num_q_tiles=2, num_kv_stages=1)
  with pytest.raises(AssertionError, match="TMEM plan"):
    too_big.check_budgets()


@pytest.mark.parametrize(
    "q_shape, k_shape, dtype, match",
    [
        ((1, 128, 2, 96), (1, 128, 2, 96), jnp.bfloat16, "head_dim"),
        ((1, 128, 2, 64), (1, 128, 2, 64), jnp.float32, "dtype"),
        ((1, 128, 3, 64), (1, 128, 2, 64), jnp.bfloat16, "multiple"),
    ],
)
def test_unsupported_arguments_are_rejected(q_shape, k_shape, dtype, match):
  with pytest.raises(KernelUnsupported, match=match):
    sm100_forward.check_supported(q_shape, k_shape, dtype, MaskSpec())


@pytest.mark.parametrize("head_dim, causal, tq, tk", [
    (64, False, 1024, 1024),
    (128, True, 1024, 1024),
    (256, False, 1024, 1024),
    # Odd extents: tiled TMA needs multiples of 8 rows, which the interpreter
    # does not check; the wrapper pads them.
    (128, True, 130, 301),
])
def test_cross_lowers_for_sm100_with_tcgen05_and_tmem(head_dim, causal, tq, tk, cross_lower):
  q_spec = jax.ShapeDtypeStruct((2, tq, 4, head_dim), jnp.bfloat16)
  kv_spec = jax.ShapeDtypeStruct((2, tk, 2, head_dim), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  mask = MaskSpec.from_arguments(causal, None)
  lowered = cross_lower(
      lambda q, k, v, a, b: sm100_forward.forward(q, k, v, a, b, score=ScoreFunction(0.1),
                                                  mask=mask),
      q_spec, kv_spec, kv_spec, lengths, lengths, arch="sm_100")
  assert len(lowered.modules) == 1
  for instruction in ("tcgen05.mma.cta_group::1.kind::f16", "tcgen05.ld", "tcgen05.st",
                      "tcgen05.alloc", "tcgen05.commit", "cp.async.bulk.tensor",
                      "mbarrier.try_wait.parity"):
    assert lowered.has(instruction), instruction
  # P V reads P from TMEM: the A operand is a TMEM address ("[a]"), not a
  # shared-memory descriptor.
  assert lowered.has("kind::f16 [$0], [a_desc]")
  assert 0 < lowered.max_smem_bytes <= sm100_tiles.SMEM_BYTES
  # One allocation of at most the 512 TMEM columns.
  module = lowered.modules[0]
  assert "%c512_i32" in module.split("tcgen05.alloc")[1][:300]


# --- Compiling for sm_100a --------------------------------------------------
# The stock CPU wheels cannot turn a Mosaic GPU module into PTX (the lowering
# passes live in the CUDA plugin, which compiles for the GPU it finds). On a
# machine with any NVIDIA GPU, `tools/sm100_compile_probe.py` makes the
# driver report compute capability 10.0 and collects the sm_100a PTX, the
# ptxas report and the resources. ptxas alone (CUDA >= 12.8) assembles sm_100a.

_PTXAS = shutil.which("ptxas")


@pytest.mark.skipif(_PTXAS is None, reason="ptxas (CUDA toolkit >= 12.8) is not on PATH")
def test_sm100a_has_no_fused_tmem_load_reduce(tmp_path):
  """Why the softmax computes its row max after the TMEM load instead of with
  `async_load_tmem(reduce="max")`: ptxas rejects `tcgen05.ld.red` on sm_100a
  (it exists on sm_103a), so that form would not compile for B200/GB200."""
  ptx = tmp_path / "red.ptx"
  ptx.write_text(
      ".version 8.8\n.target sm_100a\n.address_size 64\n"
      ".visible .entry k(.param .u32 a) {\n .reg .b32 r<3>;\n .reg .f32 m;\n"
      " ld.param.u32 r0, [a];\n"
      " tcgen05.ld.red.sync.aligned.32x32b.x2.max.NaN.f32 {r1, r2}, m, [r0];\n"
      " tcgen05.wait::ld.sync.aligned;\n ret;\n}\n")
  result = subprocess.run([_PTXAS, "-arch=sm_100a", str(ptx), "-o", str(tmp_path / "red.cubin")],
                          capture_output=True, text=True)
  if "Unsupported .version" in result.stderr or "not defined for" in result.stderr:
    pytest.skip(f"ptxas too old for PTX 8.8 / sm_100a: {result.stderr.strip()[:200]}")
  assert result.returncode != 0
  assert "tcgen05.ld.red" in result.stderr


def _has_cuda_gpu() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


@pytest.mark.skipif(not _has_cuda_gpu(), reason="needs a CUDA GPU (any) with the jax CUDA plugin; "
                    "the plugin compiles Mosaic GPU modules only for a present device")
@pytest.mark.skipif(_PTXAS is None, reason="ptxas is not on PATH")
def test_compile_probe_emits_sm100a_ptx_and_cubin(tmp_path):
  tools = pathlib.Path(__file__).resolve().parents[1] / "tools"
  sys.path.insert(0, str(tools))
  try:
    import sm100_compile_probe
  finally:
    sys.path.remove(str(tools))

  assert sm100_compile_probe.main(str(tmp_path)) == 0
  dump = tmp_path / "mosaic_dump"
  ptx_files = sorted(dump.glob("*.ptx"))
  # One kernel per forward variant, two (dK/dV, dQ) per backward variant.
  assert len(ptx_files) == (len(sm100_compile_probe.VARIANTS)
                            + 2 * len(sm100_compile_probe.BACKWARD_VARIANTS))
  for ptx in ptx_files:
    assert ".target sm_100a" in ptx.read_text()
    cubin = tmp_path / (ptx.stem + ".cubin")
    subprocess.run([_PTXAS, "-arch=sm_100a", str(ptx), "-o", str(cubin)], check=True)
  # Spill stores (bytes) may not grow past what ptxas reported when the
  # kernels were written (H200 host, jax 0.11.2's plugin, 2026-11-26): the
  # forward variants in VARIANTS order, then (dK/dV, dQ) per backward variant.
  ceilings = [0, 52, 0, 120, 0, 52, 52] + [0, 8, 0, 8, 0, 8, 40, 0]
  rows = sm100_compile_probe.report(dump)
  spills = [row["spill_stores"] for row in rows]
  assert len(spills) == len(ceilings)
  assert all(got <= limit for got, limit in zip(spills, ceilings)), list(zip(spills, ceilings))
  # Where those spills sit: local-memory accesses inside a loop larger than
  # an mbarrier spin (tools/sass_loops.py on the SASS). The known ones are
  # in the MMA warp's block loop of the two-Q-tile forward and of dQ, and in
  # the soft-capped dK/dV (benchmarks/results/sm100-register-plans-*.json);
  # none may appear elsewhere, and these may not grow.
  loop_ceilings = [0, 16, 0, 37, 0, 16, 16] + [0, 6, 0, 6, 0, 3, 16, 0]
  if shutil.which("cuobjdump", path=os.pathsep.join(["/usr/local/cuda/bin", os.environ.get("PATH", "")])):
    in_loops = [row["loop_spill_accesses"] for row in rows]
    assert all(got <= limit for got, limit in zip(in_loops, loop_ceilings)), list(
        zip(in_loops, loop_ceilings))


# --- The persistent grid -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PersistentCase(OptionCase):
  """A call on the persistent grid with `num_sms` CTAs: few, so that every
  CTA walks several work items (phases carried across items)."""

  num_sms: int = 2


PERSISTENT_CASES = {
    # Three CTA tiles of 256 rows per (batch, head): paired heavy with light
    # plus one empty tile past the end, 2 x 2 x 4 / 2 = 8 units, 4 per CTA
    # (8 items each). CTA 0 starts with that empty tile, then tiles 2 and
    # 1; batch row 1 has no key (kv_len 0), so each CTA ends with four empty
    # items in a row (zeros, lse = sink). GQA, sinks, soft-cap, lengths.
    "causal_pairs_odd_tiles_gqa_sinks_soft_cap": PersistentCase(
        batch=2, q_seq=640, kv_seq=640, q_heads=2, kv_heads=1, is_causal=True,
        q_lengths=(600, 640), kv_lengths=(640, 0), sinks=(0.5, -1.0), soft_cap=5.0,
        logit_scale=2.0),
    # Dense, 8 units over 2 CTAs: CTA 0 walks (b0, h0, tiles 0, 1), (b1, h0,
    # tiles 0, 1). Batch row 0's tile 1 holds an id no key has and row 1's
    # tile 1 lies past q_len: empty items in the middle and at the end of a
    # walk. Segment ids, lengths, GQA, sinks.
    "dense_segments_lengths_empty_items": PersistentCase(
        batch=2, q_seq=384, kv_seq=300, q_heads=2, kv_heads=1,
        q_lengths=(384, 200), kv_lengths=(300, 150), sinks=(1.0, -0.5),
        q_segment_ids=_ids(np.r_[_DOCS([100, 156], 256), np.full(128, 9)],
                           _DOCS([120, 136], 384)),
        kv_segment_ids=_ids(_DOCS([80, 150, 70], 300), _DOCS([120, 180], 300))),
    # head_dim 256: one Q tile per CTA tile (the other MMA order), 64-key
    # blocks; three tiles of 128 rows paired with an empty fourth; growing
    # logits make the correction rescale O; float16.
    "head_dim_256_causal_float16": PersistentCase(
        q_seq=264, kv_seq=192, q_heads=2, kv_heads=1, head_dim=256, dtype="float16",
        is_causal=True, sinks=(2.0, -0.5), logit_scale=2.0, key_growth=4.0),
}


def _persistent_config(case: PersistentCase):
  cfg = sm100_forward.choose_config(case.head_dim, jnp.dtype(case.dtype))
  return dataclasses.replace(cfg, persistent=True, num_sms=case.num_sms)


@pytest.mark.parametrize("name", sorted(PERSISTENT_CASES))
def test_interpreted_persistent_grid_matches_the_reference(name, run_interpreted):
  case = PERSISTENT_CASES[name]
  cfg = _persistent_config(case)
  work = sm100_forward.persistent_work(cfg, case.mask, case.batch, case.q_heads,
                                       -(-case.q_seq // 8) * 8)
  assert work.num_ctas == case.num_sms and work.count(0) >= 4  # several items per CTA
  q, k, v = _inputs(case.batch, case.q_seq, case.kv_seq, case.q_heads, case.kv_heads,
                    case.head_dim, jnp.float32, seed=5, key_growth=case.key_growth)
  q, k, v = (x.astype(case.dtype) for x in (q * case.logit_scale, k, v))
  scale = 1.0 / np.sqrt(case.head_dim)
  ql, kl = case.lengths()
  options = dict(sinks=jnp.asarray(case.sinks, jnp.float32), segment_ids=case.segment_ids())
  score = ScoreFunction(scale, case.soft_cap)
  out, lse = run_interpreted(
      lambda q, k, v, opts: sm100_forward.forward(q, k, v, ql, kl, score=score, mask=case.mask,
                                                  config=cfg, **opts),
      q, k, v, options)
  expected, expected_lse = _expected_with_options(case, q, k, v, scale)
  _assert_out_and_lse(out, lse, expected, expected_lse)


@pytest.mark.parametrize("head_dim, causal, options", [
    (64, False, False), (128, True, False), (256, True, False), (128, True, True),
])
def test_cross_lowers_persistent_grid_for_sm100(head_dim, causal, options, cross_lower):
  """The persistent configs lower with tcgen05 MMAs and TMEM (no wgmma),
  one TMEM allocation of at most 512 columns, within SMEM; with segment
  ids, sinks and soft-cap too. num_sms 0: a B200's 148 without a GPU."""
  cfg = dataclasses.replace(sm100_forward.choose_config(head_dim, jnp.bfloat16), persistent=True)
  q_spec = jax.ShapeDtypeStruct((2, 1300, 4, head_dim), jnp.bfloat16)
  kv_spec = jax.ShapeDtypeStruct((2, 1030, 2, head_dim), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  extra = ()
  if options:
    extra = (jax.ShapeDtypeStruct((2, 1300), jnp.int32), jax.ShapeDtypeStruct((2, 1030), jnp.int32),
             jax.ShapeDtypeStruct((4,), jnp.float32))
  mask = MaskSpec.from_arguments(causal, None)

  def fn(q, k, v, a, b, *extra):
    kwargs = {}
    if extra:
      kwargs = dict(segment_ids=extra[:2], sinks=extra[2])
    score = ScoreFunction(0.1, 30.0 if extra else None)
    return sm100_forward.forward(q, k, v, a, b, score=score, mask=mask, config=cfg, **kwargs)

  lowered = cross_lower(fn, q_spec, kv_spec, kv_spec, lengths, lengths, *extra, arch="sm_100")
  assert len(lowered.modules) == 1
  for instruction in ("tcgen05.mma.cta_group::1.kind::f16", "tcgen05.ld", "tcgen05.st",
                      "tcgen05.alloc", "cp.async.bulk.tensor", "mbarrier.try_wait.parity"):
    assert lowered.has(instruction), instruction
  assert not lowered.has("wgmma")
  assert 0 < lowered.max_smem_bytes <= sm100_tiles.SMEM_BYTES
  module = lowered.modules[0]
  assert module.count("tcgen05.alloc") == 1
  assert "%c512_i32" in module.split("tcgen05.alloc")[1][:300]


@pytest.mark.parametrize("target_sms, expected", [(None, 148), (100, 100)])
def test_persistent_grid_takes_one_cta_per_sm_of_the_target(target_sms, expected, monkeypatch):
  """num_sms 0: the `gpu_target`'s SM count, a B200's 148 without a GPU."""
  built = {}

  def fake_build(cfg, **kwargs):
    built["cfg"] = cfg
    raise StopIteration

  monkeypatch.setattr(sm100_forward, "_build_kernel", fake_build)
  cfg = dataclasses.replace(sm100_forward.choose_config(128, jnp.bfloat16), persistent=True)
  q = jax.ShapeDtypeStruct((1, 256, 1, 128), jnp.bfloat16)
  call = lambda q: sm100_forward.forward(q, q, q, None, None, score=ScoreFunction(0.1),
                                         mask=MaskSpec(),
                                         config=cfg)
  with pytest.raises(StopIteration):
    if target_sms is None:
      with jax.default_device(jax.devices("cpu")[0]):  # no GPU, even on a GPU host
        jax.eval_shape(call, q)
    else:
      with fa4_jax.gpu_target("sm100", num_sms=target_sms):
        jax.eval_shape(call, q)
  assert built["cfg"].num_sms == expected and built["cfg"].persistent


def test_bad_grid_configs_are_rejected():
  with pytest.raises(ValueError, match="num_sms must be >= 0"):
    dataclasses.replace(sm100_forward.choose_config(64, jnp.bfloat16), num_sms=-1)
  other_tiling = dataclasses.replace(sm100_forward.choose_config(64, jnp.bfloat16), num_kv_stages=2)
  q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
  with pytest.raises(KernelUnsupported, match="config must tile head_dim 64"):
    sm100_forward.forward(q, q, q, None, None, score=ScoreFunction(0.1), mask=MaskSpec(),
                          config=other_tiling)


def test_barrier_table_lists_every_arrive_and_wait(monkeypatch):
  """Every accessor of ForwardBarrierTable (the only way the roles touch a
  barrier) appears in the row of the barrier it arrives on or waits on, and
  every barrier has both an arriving and a waiting side."""
  def make_bars(refs):
    bars = sm100_forward.ForwardBarrierTable(sm100_forward.choose_config(64, jnp.bfloat16), refs)
    bars._interpreting = True  # the interpreter's drains wait too
    return bars

  barrier_tables.check_table(sm100_forward.ForwardBarrierTable, make_bars, sm100_forward,
                             monkeypatch, indent=10, skip=("drain_kv_rings",))  # a pl.loop
