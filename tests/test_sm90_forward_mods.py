"""The Hopper forward kernel with programmable scores (`score_mod`,
`mask_mod`, block masks: `sm90_forward.forward(..., mods=)`), on the CPU.

* Numerics and barrier protocol: the kernel runs in Pallas' GPU interpreter
  with race detection, at small and odd shapes, against an independent f32
  reference: `reference.einsum_attention` with the score_mod written out as
  an explicit bias and the mask_mod as an explicit boolean mask (numpy), or
  jax.nn.dot_product_attention(implementation="xla") with them. Rows that
  see no key must give zeros and lse -inf (or the sink). Tolerances: the
  kernel rounds P to the inputs' dtype before P V, so outputs are compared
  at 2e-2 in bf16 (8 mantissa bits) and 4e-3 in fp16 (11), as
  tests/test_sm90_forward.py; the lse is kept in f32 throughout (1e-3).
* Tile skipping: full tiles run without `mask_mod` (a block mask claiming
  FULL where `mask_mod` hides everything gives dense attention), empty
  tiles are never computed (their keys may be NaN) and are not in the lists
  the producer loads from.
* Hardware fit: every configuration the heuristic picks for a call with
  mods is cross-lowered for sm_90 (wgmma, TMA, shared memory).
* The public path: `fa4_jax.attention(..., implementation="sm90")` serves
  mods in interpret mode, and an op the kernel cannot lower is a ValueError
  naming it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import mod_functions, scores
from fa4_jax.kernels import sm90_forward, sm90_tiles
from fa4_jax.scores import BlockMask, MaskSpec, ScoreFunction, Scores
from fa4_jax.testing import SMEM_LIMIT_BYTES
from reference import KernelCase, einsum_attention

# --- the mods, and the same thing written out in numpy for the references -----

NUM_BUCKETS = 32
ALIBI_SLOPES = np.asarray([2.0 ** -(i + 1) for i in range(8)], np.float32)
# A relative-position bias table [heads, buckets] (T5-like): bucket of
# kv - q, clipped to the table.
REL_TABLE = np.asarray(np.random.default_rng(1).normal(size=(8, NUM_BUCKETS)), np.float32)


def _bucket(q, kv):
  return np.clip(kv - q + NUM_BUCKETS // 2, 0, NUM_BUCKETS - 1)


def _alibi(heads):
  slopes = jnp.asarray(ALIBI_SLOPES[:heads])
  fn = lambda s, b, h, q, kv: s + slopes[h] * (kv - q).astype(jnp.float32)
  bias = lambda B, T, S: (ALIBI_SLOPES[:heads, None, None]
                          * (np.arange(S)[None, None, :] - np.arange(T)[None, :, None]))[None]
  return fn, bias


def _relative_table(heads):
  table = jnp.asarray(REL_TABLE[:heads])
  fn = lambda s, b, h, q, kv: s + table[h, jnp.clip(kv - q + NUM_BUCKETS // 2, 0,
                                                     NUM_BUCKETS - 1)]
  bias = lambda B, T, S: REL_TABLE[:heads][:, _bucket(np.arange(T)[:, None],
                                                     np.arange(S)[None, :])][None]
  return fn, bias


def _prefix_lm(prefix_lengths):
  """Each batch row's first prefix_lengths[b] keys are seen by every query;
  the rest causally (a per-batch captured array, read by scalar)."""
  prefix = jnp.asarray(prefix_lengths, jnp.int32)
  fn = lambda b, h, q, kv: (kv < prefix[b]) | (q >= kv)
  keep = lambda B, T, S: ((np.arange(S)[None, None, None, :]
                           < np.asarray(prefix_lengths)[:, None, None, None])
                          | (np.arange(T)[:, None] >= np.arange(S)[None, :])[None, None])
  return fn, keep


def _chunked(chunk):
  fn = lambda b, h, q, kv: (q // chunk) == (kv // chunk)
  keep = lambda B, T, S: ((np.arange(T)[:, None] // chunk)
                          == (np.arange(S)[None, :] // chunk))[None, None]
  return fn, keep


@dataclasses.dataclass(frozen=True)
class Case(KernelCase):
  q_seq: int = 200
  kv_seq: int = 333
  score: str | None = None  # "alibi" | "table"
  keep: str | None = None  # "prefix" | "chunked" | "tree" | "late_rows"
  sinks: bool = False
  soft_cap: float | None = None


def _mods_of(case: Case):
  """(score_mod fn, bias(B, T, S) [1, N, T, S] | None, mask_mod fn, keep(B, T, S)
  [B|1, 1, T, S] | None)."""
  score_fn = bias = mask_fn = keep = None
  if case.score == "alibi":
    score_fn, bias = _alibi(case.q_heads)
  elif case.score == "table":
    score_fn, bias = _relative_table(case.q_heads)
  if case.keep == "prefix":
    mask_fn, keep = _prefix_lm([37, 150][:case.batch] + [0] * max(case.batch - 2, 0))
  elif case.keep == "chunked":
    mask_fn, keep = _chunked(64)
  elif case.keep == "late_rows":  # rows 0..9 see no key at all
    mask_fn = lambda b, h, q, kv: q >= 10
    keep = lambda B, T, S: np.broadcast_to((np.arange(T) >= 10)[:, None], (T, S))[None, None]
  return score_fn, bias, mask_fn, keep


def _scores_value(score_fn, mask_fn, **changes) -> Scores:
  sm, sc = mod_functions.trace(score_fn, "score_mod") if score_fn else (None, ())
  mm, mc = mod_functions.trace(mask_fn, "mask_mod") if mask_fn else (None, ())
  return Scores(score_mod=sm, mask_mod=mm, score_captured=sc, mask_captured=mc, **changes)


def _inputs(case: Case, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  dtype = jnp.dtype(case.dtype)
  q = jax.random.normal(keys[0], (case.batch, case.q_seq, case.q_heads, case.head_dim), dtype)
  k = jax.random.normal(keys[1], (case.batch, case.kv_seq, case.kv_heads, case.head_dim), dtype)
  # Values with a mean away from 0 make "averaged the wrong keys" visible.
  v = 1.0 + jax.random.normal(keys[2], k.shape, dtype)
  return q, k, v


def _compare(case: Case, out, lse, ref_out, ref_lse, visible, *, sinks=None):
  """Rows that see a key against the reference; the others zeros, lse -inf
  (or the sink for rows inside q_lengths)."""
  rows = np.broadcast_to(np.asarray(visible).any(-1), (case.batch, case.q_heads, case.q_seq))
  assert out.shape == (case.batch, case.q_seq, case.q_heads, case.head_dim)
  assert out.dtype == jnp.dtype(case.dtype)
  out = np.asarray(out, np.float32)
  rows_btn = rows.transpose(0, 2, 1)
  tol = 2e-2 if case.dtype == "bfloat16" else 4e-3
  np.testing.assert_allclose(out[rows_btn], np.asarray(ref_out)[rows_btn], atol=tol, rtol=tol)
  np.testing.assert_array_equal(out[~rows_btn], 0.0)
  lse = np.asarray(lse)
  np.testing.assert_allclose(lse[rows], np.asarray(ref_lse)[rows], atol=1e-3, rtol=1e-4)
  if sinks is None:
    assert np.all(lse[~rows] == -np.inf)
  else:
    np.testing.assert_allclose(lse[~rows], np.asarray(ref_lse)[~rows], rtol=1e-6)
  return rows


def _run_and_compare(case: Case, run_interpreted, *, config=None):
  q, k, v = _inputs(case)
  scale = 1.0 / math.sqrt(case.head_dim)
  score_fn, bias, mask_fn, keep = _mods_of(case)
  mods = _scores_value(score_fn, mask_fn)
  q_len, kv_len = case.lengths()
  sinks = (jnp.linspace(-1.0, 2.0, case.q_heads).astype(jnp.float32) if case.sinks else None)

  def fn(q, k, v):
    return sm90_forward.forward(q, k, v, q_len, kv_len, score=ScoreFunction(scale, case.soft_cap),
                                mask=case.mask, config=config, segment_ids=case.segment_ids(),
                                sinks=sinks, mods=mods)

  out, lse = run_interpreted(fn, q, k, v)
  B, T, S = case.batch, case.q_seq, case.kv_seq
  visible = case.visible()  # [B, 1, T, S]: the built-ins
  if keep is not None:
    visible = visible & keep(B, T, S)
  ref_bias = None if bias is None else jnp.asarray(bias(B, T, S), jnp.float32)
  ref_out, ref_lse = einsum_attention(q, k, v, visible, bias=ref_bias, scale=scale, sinks=sinks,
                                      soft_cap=case.soft_cap)
  if case.q_lengths is not None:  # rows past q_lengths: lse -inf, even with a sink
    ref_lse = jnp.where(np.arange(T) < np.asarray(case.q_lengths)[:, None, None], ref_lse,
                        -jnp.inf)
  return _compare(case, out, lse, ref_out, ref_lse, visible, sinks=sinks)


CASES = {
    # ALiBi with causal, GQA, odd lengths (T < S: top-left diagonal).
    "alibi_causal_gqa_odd_lengths": Case(score="alibi", is_causal=True, q_heads=4, kv_heads=2),
    # A per-element index into a captured [H, 32] table (a chain of selects), fp16, D128.
    "relative_position_table_fp16_d128": Case(score="table", q_heads=2, head_dim=128,
                                              dtype="float16", q_seq=130, kv_seq=190),
    # Prefix-LM: a per-batch captured prefix length; D256 (64-key blocks).
    "prefix_lm_per_batch_d256": Case(keep="prefix", batch=2, head_dim=256, q_seq=190,
                                     kv_seq=190),
    # Chunked local attention: off-chunk tiles are empty, so never walked.
    "chunked_local_d128": Case(keep="chunked", head_dim=128, q_seq=256, kv_seq=320),
    # Everything at once: score_mod, mask_mod, a window, lengths, GQA,
    # soft-cap (bf16: the fixed max), sinks.
    "all_options_bf16": Case(score="alibi", keep="prefix", batch=2, window=(64, 64),
                             q_heads=4, kv_heads=2, q_lengths=(200, 111), kv_lengths=(333, 90),
                             sinks=True, soft_cap=20.0),
    # The same in fp16 (a running max), causal and chunked, with the table, at D128.
    "all_options_fp16": Case(score="table", keep="chunked", batch=2, is_causal=True,
                             q_heads=4, kv_heads=2, head_dim=128, dtype="float16",
                             q_lengths=(150, 200), kv_lengths=(200, 333), sinks=True,
                             soft_cap=20.0),
    # Rows 0..9 see no key (mask_mod), and batch row 1 none at all (its
    # key length is 0): zeros and lse -inf.
    "rows_that_see_no_key": Case(score="alibi", keep="late_rows", batch=2, kv_lengths=(333, 0)),
    # Packed documents (segment ids) with ALiBi, causal.
    "segment_ids_with_alibi": Case(
        score="alibi", is_causal=True, q_seq=256, kv_seq=256,
        q_segment_ids=(tuple([0] * 100 + [1] * 90 + [2] * 66),),
        kv_segment_ids=(tuple([0] * 100 + [1] * 90 + [2] * 66),)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_mods_match_the_einsum_reference_without_races(name, run_interpreted):
  _run_and_compare(CASES[name], run_interpreted)


def test_jax_nn_with_an_explicit_bias_and_mask_agrees(run_interpreted):
  """ALiBi and chunked local attention against jax.nn (XLA) with the bias
  and the mask as arrays."""
  case = Case(q_heads=2, head_dim=64, q_seq=192, kv_seq=256)
  q, k, v = _inputs(case, seed=3)
  score_fn, bias = _alibi(2)
  mask_fn, keep = _chunked(96)
  mods = _scores_value(score_fn, mask_fn)
  out, lse = run_interpreted(lambda q, k, v: sm90_forward.forward(
      q, k, v, None, None, score=ScoreFunction(0.125), mask=MaskSpec(), mods=mods), q, k, v)
  f32 = lambda x: x.astype(jnp.float32)
  visible = keep(1, 192, 256)
  ref = jax.nn.dot_product_attention(f32(q), f32(k), f32(v), bias=jnp.asarray(bias(1, 192, 256),
                                                                              jnp.float32),
                                     mask=jnp.asarray(visible), scale=0.125,
                                     implementation="xla")
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=2e-2, rtol=2e-2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", f32(q), f32(k), precision="highest") * 0.125
  ref_lse = jax.nn.logsumexp(jnp.where(visible, logits + bias(1, 192, 256), -jnp.inf), -1)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-3, rtol=1e-4)


def test_a_tree_mask_of_ancestor_bits_for_speculative_decoding(run_interpreted):
  """32 draft tokens in a tree after a 160-token prefix: a token sees the
  prefix and its ancestors (itself included), from a captured int32 [32] of
  ancestor bits indexed per row (a chain of selects)."""
  rng = np.random.default_rng(7)
  parents = np.asarray([-1] + [int(rng.integers(0, i)) for i in range(1, 32)])
  ancestors = np.zeros(32, np.int64)
  for i in range(32):
    ancestors[i] = (1 << i) | (ancestors[parents[i]] if parents[i] >= 0 else 0)
  prefix = 160
  bits = jnp.asarray(ancestors.astype(np.uint32).view(np.int32))

  def tree(b, h, q, kv):
    node = jnp.clip(kv - prefix, 0, 31)
    return (kv < prefix) | (((bits[q] >> node) & 1) == 1)

  case = Case(q_seq=32, kv_seq=prefix + 32, q_heads=2, kv_heads=1)
  q, k, v = _inputs(case, seed=5)
  mods = _scores_value(None, tree)
  out, lse = run_interpreted(lambda q, k, v: sm90_forward.forward(
      q, k, v, None, None, score=ScoreFunction(0.125), mask=MaskSpec(), mods=mods), q, k, v)
  node = np.arange(32)
  draft = ((ancestors[:, None] >> node[None, :]) & 1) == 1
  visible = np.concatenate([np.ones((32, prefix), bool), draft], axis=1)[None, None]
  ref_out, ref_lse = einsum_attention(q, k, v, visible, scale=0.125)
  _compare(case, out, lse, ref_out, ref_lse, visible)


def _random_block_table(nq, nk, seed):
  """int32 [nq * nk] of 0/1: which 128 x 128 tiles a query tile sees (each
  sees at least its diagonal tile)."""
  table = np.random.default_rng(seed).random((nq, nk)) < 0.4
  table[np.arange(nq), np.arange(nq) % nk] = True
  return table


def test_a_random_block_sparse_block_mask_is_reused_through_the_public_path(run_interpreted):
  """create_block_mask once, two calls with it (`implementation="sm90"` in
  interpret mode, the public path): each equals the reference with the
  explicit mask; only the tiles the table lists are walked."""
  nq, nk = 3, 4
  T, S = nq * 128, nk * 128
  table = _random_block_table(nq, nk, seed=2)
  flat = jnp.asarray(table.reshape(-1).astype(np.int32))  # 12 entries, one axis
  block_sparse = lambda b, h, q, kv: flat[(q // 128) * nk + kv // 128] == 1
  block_mask = fa4_jax.create_block_mask(block_sparse, None, None, T, S)
  np.testing.assert_array_equal(np.asarray(block_mask.classes[0, 0]),
                                np.where(table, scores.FULL, scores.EMPTY))
  case = Case(q_seq=T, kv_seq=S, q_heads=2, kv_heads=2, head_dim=128)
  visible = np.kron(table, np.ones((128, 128), bool))[None, None]

  def both_calls(q, k, v, q2):
    call = lambda q: fa4_jax.attention(q, k, v, block_mask=block_mask, scale=0.125,
                                       implementation="sm90")
    return call(q), call(q2)

  q, k, v = _inputs(case, seed=11)
  q2 = _inputs(case, seed=12)[0]
  outs = run_interpreted(both_calls, q, k, v, q2)
  for query, out in zip((q, q2), outs):
    ref, _ = einsum_attention(query, k, v, visible, scale=0.125)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=2e-2,
                               rtol=2e-2)


def test_full_tiles_skip_mask_mod_and_empty_tiles_are_never_walked(run_interpreted):
  """A block mask claiming FULL for tiles where `mask_mod` would hide every
  key: the kernel must not evaluate it there (dense attention over those
  tiles comes out). One tile claimed EMPTY holds NaN keys and values: it must
  be neither computed nor listed for the producer."""
  T, S = 256, 384
  hide_all = lambda b, h, q, kv: q < 0  # would hide everything if evaluated
  mod, captured = mod_functions.trace(hide_all, "mask_mod")
  classes = np.full((1, 1, 2, 3), scores.FULL, np.int8)
  classes[0, 0, 1, 2] = scores.EMPTY  # query tile 1 does not see key tile 2
  block_mask = BlockMask(classes=jnp.asarray(classes), mask_captured=captured, q_len=T,
                         kv_len=S, mask_mod=mod)
  mods = Scores(mask_mod=mod, mask_captured=captured, block_mask=block_mask)
  case = Case(q_seq=T, kv_seq=S, head_dim=128)
  config = sm90_forward.mods_config(sm90_forward.choose_config(128, MaskSpec(), S, T))
  assert (config.block_q_cta, config.block_kv) == (128, 128)  # the block mask's tiles
  counts, order = scores.block_lists(scores.tile_classes(
      mods, 1, 1, T, S, config.block_q_cta, config.block_kv))
  np.testing.assert_array_equal(np.asarray(counts[0, 0]), [[0, 3], [0, 2]])
  assert 2 not in np.asarray(order[0, 0, 1, :2])  # the producer loads order[:2] only

  q, k, v = _inputs(case)
  k = k.at[:, 256:].set(jnp.nan)  # key tile 2: only query tile 0 walks it
  v_nan = v.at[:, 256:].set(jnp.nan)
  # Query tile 0 sees NaN keys too, so split: tile 0 against finite K/V...
  out, lse = run_interpreted(lambda q, k, v: sm90_forward.forward(
      q, k, v, None, None, score=ScoreFunction(0.125), mask=MaskSpec(), mods=mods), q, k, v_nan)
  visible = np.ones((1, 1, T, S), bool)
  visible[..., 128:, 256:] = False
  ref_out, ref_lse = einsum_attention(q, jnp.nan_to_num(k), jnp.nan_to_num(v_nan), visible,
                                      scale=0.125)
  out, lse = np.asarray(out, np.float32), np.asarray(lse)
  # ...query tile 1 (rows 128..255) never touched the NaN tile: finite and right.
  np.testing.assert_allclose(out[:, 128:], np.asarray(ref_out)[:, 128:], atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(lse[..., 128:], np.asarray(ref_lse)[..., 128:], atol=1e-3)
  assert np.isnan(out[:, :128]).all()  # query tile 0 did walk it: FULL, unmasked
  # With finite K/V, query tile 0 is dense over all three tiles: mask_mod,
  # which hides everything, did not run on FULL tiles.
  k_ok = _inputs(case)[1]
  out, _ = run_interpreted(lambda q, k, v: sm90_forward.forward(
      q, k, v, None, None, score=ScoreFunction(0.125), mask=MaskSpec(), mods=mods), q, k_ok, v)
  ref_out, _ = einsum_attention(q, k_ok, v, visible, scale=0.125)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out), atol=2e-2,
                             rtol=2e-2)


def test_the_mods_see_global_batch_and_head_through_the_index_offsets(run_interpreted):
  """A sharded call's offsets (`Scores.index_offsets`) are added to the
  batch and head the mods see."""
  case = Case(batch=1, q_heads=2, kv_heads=2, q_seq=64, kv_seq=96)
  q, k, v = _inputs(case)
  per_head = jnp.asarray([0.0, 0.0, 0.0, 1.0, -1.0], jnp.float32)  # global heads 3, 4
  per_batch = jnp.asarray([5, 5, 40], jnp.int32)  # global batch row 2: 40 keys
  mods = _scores_value(lambda s, b, h, qi, ki: s + per_head[h] * ki.astype(jnp.float32) / 64,
                       lambda b, h, qi, ki: ki < per_batch[b],
                       index_offsets=jnp.asarray([2, 3], jnp.int32))
  out, lse = run_interpreted(lambda q, k, v: sm90_forward.forward(
      q, k, v, None, None, score=ScoreFunction(0.125), mask=MaskSpec(), mods=mods), q, k, v)
  bias = (np.asarray([1.0, -1.0])[:, None, None] * np.arange(96)[None, None, :] / 64)[None]
  visible = np.broadcast_to(np.arange(96) < 40, (64, 96))[None, None]
  ref_out, ref_lse = einsum_attention(q, k, v, visible, bias=jnp.asarray(bias, jnp.float32),
                                      scale=0.125)
  _compare(case, out, lse, ref_out, ref_lse, visible)


def test_public_attention_serves_mods_on_sm90_in_interpret_mode(run_interpreted):
  """`fa4_jax.attention(..., score_mod=, mask_mod=, implementation="sm90")`:
  the sm90 forward serves it (which_implementation says so), equal to the
  XLA path."""
  case = Case(q_heads=4, kv_heads=2, q_seq=130, kv_seq=150)
  q, k, v = _inputs(case)
  score_fn, _ = _alibi(4)
  mask_fn, _ = _chunked(64)
  kwargs = dict(score_mod=score_fn, mask_mod=mask_fn, is_causal=True)
  with fa4_jax.interpret_mode():
    assert fa4_jax.which_implementation(q, k, v, implementation="sm90", **kwargs) == "sm90"
  out = run_interpreted(lambda q, k, v: fa4_jax.attention(q, k, v, implementation="sm90",
                                                          **kwargs), q, k, v)
  ref = fa4_jax.attention(q, k, v, implementation="xla", **kwargs)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("score_mod,op", [
    (lambda s, b, h, q, kv: jnp.sin(s), "sin"),
    (lambda s, b, h, q, kv: jnp.log1p(jnp.abs(s)), "log1p"),
    (lambda s, b, h, q, kv: jnp.fmod(s, 2.0), "rem on floats"),
])
def test_an_op_the_kernel_cannot_lower_is_a_value_error_naming_it(score_mod, op):
  q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
  with fa4_jax.interpret_mode():
    with pytest.raises(ValueError, match=op):
      fa4_jax.attention(q, q, q, score_mod=score_mod, implementation="sm90")
    with pytest.raises(ValueError, match=op):
      sm90_forward.forward(q, q, q, None, None, score=ScoreFunction(1.0), mask=MaskSpec(),
                           mods=_scores_value(score_mod, None))


def test_mods_refuse_a_persistent_config_and_the_heuristic_gives_one_cta_per_tile():
  from fa4_jax.kernels import KernelUnsupported
  q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
  mods = _scores_value(None, lambda b, h, qi, ki: qi >= ki)
  persistent = sm90_forward.choose_config(64, MaskSpec(right=0), 256)
  assert persistent.persistent
  with pytest.raises(KernelUnsupported, match="persistent"):
    sm90_forward.forward(q, q, q, None, None, score=ScoreFunction(1.0), mask=MaskSpec(right=0),
                         config=persistent, mods=mods)
  config = sm90_forward.mods_config(persistent)
  assert not config.persistent and not config.work_queue and config.q_depth == 1


# --- every configuration the heuristic picks with mods, cross-lowered --------------


def _mods_configs():
  seen = {}
  for d in (64, 128, 192, 256):
    for mask in sm90_tiles.HEURISTIC_MASKS:
      for kv_seq in (1024, 8192):
        config = sm90_forward.mods_config(sm90_forward.choose_config(d, mask, kv_seq))
        seen.setdefault((d, config), mask)
  return [(d, config, mask) for (d, config), mask in seen.items()]


@pytest.mark.parametrize(
    "head_dim,config,mask", _mods_configs(),
    ids=lambda x: str(x) if isinstance(x, int) else
    f"bq{x.block_q}x{x.num_consumers}-bkv{x.block_kv}-st{x.num_kv_stages}"
    if isinstance(x, sm90_forward.ForwardConfig) else "")
def test_every_heuristic_config_with_mods_lowers_for_hopper(head_dim, config, mask):
  """ALiBi (a captured [H] read by scalar), a relative-position table (a
  captured [H, 32] read per element) and prefix-LM (a captured [B]), with
  lengths, sinks and soft-cap: one kernel, wgmma and TMA, within the shared
  memory the plain kernel of the config uses (mods take none)."""
  from fa4_jax.testing import cross_lower

  heads = 4
  alibi, _ = _alibi(heads)
  table, _ = _relative_table(heads)
  prefix, _ = _prefix_lm([100, 7])
  mods = _scores_value(lambda s, b, h, q, kv: table(alibi(s, b, h, q, kv), b, h, q, kv), prefix)
  q = jax.ShapeDtypeStruct((2, 1000, heads, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 1100, 2, head_dim), jnp.bfloat16)
  lens = jax.ShapeDtypeStruct((2,), jnp.int32)
  sinks = jax.ShapeDtypeStruct((heads,), jnp.float32)
  fn = lambda q, k, v, ql, kl, s: sm90_forward.forward(
      q, k, v, ql, kl, score=ScoreFunction(0.125, 30.0),
      mask=mask, config=config, sinks=s, mods=mods)
  lowered = cross_lower(fn, q, kv, kv, lens, lens, sinks, arch="sm_90")
  assert len(lowered.smem_bytes) == 1
  assert lowered.max_smem_bytes <= SMEM_LIMIT_BYTES
  assert lowered.has("wgmma.mma_async")
  assert lowered.has("cp.async.bulk.tensor")
  assert lowered.has("mbarrier.try_wait.parity")
  estimate = config.smem_bytes(head_dim, 2)
  assert estimate <= lowered.max_smem_bytes <= estimate + sm90_forward.SMEM_RESERVE_BYTES


@pytest.mark.parametrize("score_fn,mask_fn", [
    (lambda s, b, h, q, kv: s * 0.5 + 1.0, None),  # reads no position
    (lambda s, b, h, q, kv: s + (q % 3).astype(jnp.float32), lambda b, h, q, kv: q >= 0),
], ids=["score only", "rows only"])
def test_mods_that_read_few_positions_lower_forward_and_backward(score_fn, mask_fn):
  """The kernels hand a mod its positions as row and column vectors, traced
  only where the mod reads them: Mosaic GPU finds no layout for an iota
  nothing uses (on an H100 a `score_mod` of the score alone failed to lower
  so, while every mod that read both positions lowered)."""
  from fa4_jax.testing import cross_lower

  q = jax.ShapeDtypeStruct((2, 1000, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 1000, 2, 128), jnp.bfloat16)

  def loss(q, k, v):
    out = fa4_jax.attention(q, k, v, score_mod=score_fn, mask_mod=mask_fn,
                            implementation="sm90")
    return out.astype(jnp.float32).sum()

  lowered = cross_lower(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, arch="sm_90")
  assert len(lowered.modules) >= 3  # the forward, the dK/dV and the dQ kernels
  assert lowered.has("wgmma.mma_async")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_score_mod_alone_on_the_persistent_grid_with_its_work_queue(run_interpreted,
                                                                     monkeypatch, head_dim):
  """`sm90_forward.MODS_ON_THE_PERSISTENT_GRID` (issue #52's candidate, off):
  ALiBi on short causal rows keeps the heuristic's persistent grid and work
  queue (two Q tiles a consumer; three consumers at D64) and matches the
  einsum reference; a mask_mod still gets one CTA per tile."""
  monkeypatch.setattr(sm90_forward, "MODS_ON_THE_PERSISTENT_GRID", True)
  heads, seq = 2, 640
  fn, bias = _alibi(heads)
  mods, mask = _scores_value(fn, None), MaskSpec(right=0)
  config = sm90_forward.choose_config(head_dim, mask, seq, seq)
  assert config.persistent and config.work_queue
  assert sm90_forward.mods_config(config, mods) == config
  with_mask_mod = _scores_value(fn, lambda b, h, q, kv: kv >= 0)
  assert not sm90_forward.mods_config(config, with_mask_mod).persistent
  q, k, v = (jax.random.normal(key, (1, seq, heads, head_dim), jnp.bfloat16)
             for key in jax.random.split(jax.random.key(3), 3))

  def call(q, k, v):
    return sm90_forward.forward(q, k, v, None, None, score=ScoreFunction(head_dim ** -0.5),
                                mask=mask, mods=mods)[0]

  got = np.asarray(run_interpreted(call, q, k, v), np.float32)
  i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
  want, _ = einsum_attention(q, k, v, (j <= i)[None, None], bias=jnp.asarray(bias(1, seq, seq)))
  want = np.asarray(want, np.float32)
  np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


def test_alibi_causal_on_the_persistent_grid_lowers_for_hopper(monkeypatch):
  """`MODS_ON_THE_PERSISTENT_GRID` at the row it is for (ALiBi causal, B2
  S4096 H16 D128: the work queue with two Q tiles a consumer): one kernel
  that keeps the queue (its atomic) and the plain config's SMEM."""
  from fa4_jax.testing import cross_lower

  monkeypatch.setattr(sm90_forward, "MODS_ON_THE_PERSISTENT_GRID", True)
  fn, _ = _alibi(8)
  mods, mask = _scores_value(lambda s, b, h, q, kv: fn(s, b, h % 8, q, kv), None), MaskSpec(right=0)
  config = sm90_forward.choose_config(128, mask, 4096, 4096)
  assert config.persistent and config.work_queue and config.q_buffers == 2
  x = jax.ShapeDtypeStruct((2, 4096, 16, 128), jnp.bfloat16)
  lowered = cross_lower(lambda q, k, v: sm90_forward.forward(
      q, k, v, None, None, score=ScoreFunction(0.125), mask=mask, mods=mods), x, x, x,
      arch="sm_90")
  assert len(lowered.smem_bytes) == 1 and lowered.max_smem_bytes <= SMEM_LIMIT_BYTES
  assert lowered.has("atomicrmw") or lowered.has("atom.")  # the queue's counter
  estimate = config.smem_bytes(128, 2)
  assert estimate <= lowered.max_smem_bytes <= estimate + sm90_forward.SMEM_RESERVE_BYTES
