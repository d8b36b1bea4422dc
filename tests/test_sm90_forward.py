"""The Hopper forward kernel (fa4_jax/kernels/sm90_forward.py), checked on the CPU.

* Numerics and barrier protocol: the kernel runs in Pallas' GPU interpreter
  with race detection, at small shapes, against jax.nn.dot_product_attention
  (implementation="xla") in f32 on the upcast inputs. Only rows that see at
  least one key are compared; the others must be zeros with lse = -inf.
* Hardware fit: every configuration the heuristic can pick is cross-lowered
  for sm_90 and must fit the shared memory and use wgmma and TMA.
* Segment ids (packed sequences): the same interpreter runs against the
  explicit boolean mask, and the key blocks each tile walks (skipped,
  masked, full) are checked against a brute-force count.
* Sinks and soft-cap (`forward(..., sinks=, soft_cap=)`): the interpreter
  runs against the f32 einsum reference (`reference.einsum_attention`);
  rows that see no key give zeros and lse = sink, rows past q_lengths zeros
  and lse = -inf. Every heuristic configuration lowers with them in the
  same shared memory, and soft-cap's tanh is the device's tanh.approx.
* The barrier table: every `ForwardBarrierTable` accessor is listed in the
  row of the barrier it touches, on its declared side (`barrier_tables`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import barrier_tables
from fa4_jax import scores
from fa4_jax.kernels import KernelUnsupported
from fa4_jax.kernels import sm90_forward, sm90_tiles
from fa4_jax.scores import MaskSpec, ScoreFunction, Scores
from fa4_jax.testing import SMEM_LIMIT_BYTES
from reference import KernelCase, einsum_attention, packed_segment_ids, visible_mask


@dataclasses.dataclass(frozen=True)
class Case(KernelCase):
  q_seq: int = 256
  kv_seq: int = 256


def _inputs(case: Case):
  keys = jax.random.split(jax.random.key(0), 3)
  dtype = jnp.dtype(case.dtype)
  q = jax.random.normal(keys[0], (case.batch, case.q_seq, case.q_heads, case.head_dim), dtype)
  k = jax.random.normal(keys[1], (case.batch, case.kv_seq, case.kv_heads, case.head_dim), dtype)
  # Values with a mean away from 0 make "averaged the wrong keys" visible.
  v = 1.0 + jax.random.normal(keys[2], (case.batch, case.kv_seq, case.kv_heads, case.head_dim), dtype)
  return q, k, v


def _reference(case: Case, q, k, v, scale):
  """(out [B,Tq,N,D], lse [B,N,Tq]) in f32: jax.nn for out, logsumexp for lse."""
  qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
  visible = case.visible()
  if case.q_offset or case.q_segment_ids is not None:  # beyond jax.nn's arguments
    out = jax.nn.dot_product_attention(
        qf, kf, vf, mask=jnp.asarray(visible), scale=scale, implementation="xla")
  else:
    q_len, kv_len = case.lengths()
    out = jax.nn.dot_product_attention(
        qf, kf, vf, scale=scale, is_causal=case.is_causal,
        local_window_size=case.window, query_seq_lengths=q_len,
        key_value_seq_lengths=kv_len, implementation="xla")
  group = case.q_heads // case.kv_heads
  logits = jnp.einsum("bqhd,bkhd->bhqk", qf, jnp.repeat(kf, group, axis=2),
                      precision="highest") * scale
  lse = jax.nn.logsumexp(jnp.where(visible, logits, -jnp.inf), axis=-1)
  return out, lse, visible.any(-1)  # sees_key: [B, 1, Tq]


def _reference_with_options(case: Case, q, k, v, scale, sinks, soft_cap):
  """`_reference` with sinks and soft-cap, from the f32 einsum reference: a
  row that sees no key has lse = sink, one past q_lengths lse = -inf."""
  visible = case.visible()
  out, lse = einsum_attention(q, k, v, visible, scale=scale, sinks=sinks, soft_cap=soft_cap)
  q_len = case.q_seq if case.q_lengths is None else np.asarray(case.q_lengths)[:, None, None]
  lse = jnp.where(np.arange(case.q_seq) < q_len, lse, -jnp.inf)
  return out, lse, visible.any(-1)


def _one_cta_per_tile(config, **changes):
  """`config` on a grid of one CTA per tile: without the persistent grid
  there is no work queue either (the heuristic picks one for short causal
  and packed rows)."""
  return dataclasses.replace(config, persistent=False, work_queue=False, **changes)


def _run_and_compare(case: Case, run_interpreted, scale=None, config=None, *, sinks=None,
                     soft_cap=None):
  q, k, v = _inputs(case)
  scale = 1.0 / math.sqrt(case.head_dim) if scale is None else scale
  q_len, kv_len = case.lengths()
  sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)

  def fn(q, k, v):
    return sm90_forward.forward(q, k, v, q_len, kv_len, score=ScoreFunction(scale, soft_cap),
                                mask=case.mask,
                                config=config, segment_ids=case.segment_ids(), sinks=sinks)

  out, lse = run_interpreted(fn, q, k, v)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert lse.shape == (case.batch, case.q_heads, case.q_seq) and lse.dtype == jnp.float32

  if sinks is None and soft_cap is None:
    ref_out, ref_lse, sees_key = _reference(case, q, k, v, scale)
  else:
    ref_out, ref_lse, sees_key = _reference_with_options(case, q, k, v, scale, sinks, soft_cap)
  rows = np.broadcast_to(sees_key, (case.batch, case.q_heads, case.q_seq))  # [B, N, Tq]
  out = np.asarray(out, np.float32)
  rows_btn = rows.transpose(0, 2, 1)  # [B, Tq, N]
  tol = 2e-2 if case.dtype == "bfloat16" else 4e-3
  np.testing.assert_allclose(out[rows_btn], np.asarray(ref_out)[rows_btn], atol=tol, rtol=tol)
  np.testing.assert_array_equal(out[~rows_btn], 0.0)
  lse = np.asarray(lse)
  np.testing.assert_allclose(lse[rows], np.asarray(ref_lse)[rows], atol=1e-3, rtol=1e-4)
  if sinks is None:
    assert np.all(lse[~rows] == -np.inf)
  else:  # the sink, or -inf past q_lengths (the reference says which)
    np.testing.assert_allclose(lse[~rows], np.asarray(ref_lse)[~rows], rtol=1e-6)


# Each case is small: the interpreter takes seconds per call.
FEATURE_CASES = {
    "dense_bf16": Case(),
    "dense_fp16": Case(dtype="float16"),
    "causal": Case(is_causal=True, head_dim=128),
    "causal_query_shorter_than_keys_is_top_left_aligned": Case(is_causal=True, q_seq=130, kv_seq=300),
    "causal_keys_shorter_than_queries_leaves_rows_without_keys": Case(
        is_causal=True, q_seq=200, kv_seq=70, kv_lengths=(70,)),
    "sequence_lengths_not_multiple_of_block": Case(q_seq=77, kv_seq=190),
    "two_sided_window": Case(window=(40, 20), q_seq=256, kv_seq=384),
    "causal_window_skips_far_tiles": Case(is_causal=True, window=(64, 0), q_seq=384, kv_seq=384),
    "query_offset_shifts_the_diagonal": Case(is_causal=True, q_offset=100, q_seq=128, kv_seq=256),
    "key_value_lengths_mask_keys_and_zero_empty_rows": Case(
        batch=2, kv_lengths=(130, 0), q_seq=128, kv_seq=256),
    "query_lengths_zero_rows_past_the_length": Case(
        batch=2, is_causal=True, q_lengths=(200, 37), kv_lengths=(256, 100)),
    "grouped_query_heads_share_kv_heads": Case(q_heads=4, kv_heads=2, q_seq=128, kv_seq=128),
    "multi_query_one_kv_head": Case(q_heads=3, kv_heads=1, q_seq=128, kv_seq=192, is_causal=True),
    "head_dim_256": Case(head_dim=256, q_seq=128, kv_seq=192, is_causal=True),
    "head_dim_96_is_padded": Case(head_dim=96, q_seq=128, kv_seq=128),
}


@pytest.mark.parametrize("name", list(FEATURE_CASES))
def test_forward_matches_jax_nn_without_races(name, run_interpreted):
  _run_and_compare(FEATURE_CASES[name], run_interpreted)


def test_negative_scale_is_folded_correctly(run_interpreted):
  _run_and_compare(Case(q_seq=128, kv_seq=128, is_causal=True), run_interpreted, scale=-0.3)


def test_large_logits_use_the_stale_max_without_overflow(run_interpreted):
  """A scale that makes logits large and growing across tiles exercises the
  skipped-rescale path (the running max lags by up to the threshold)."""
  _run_and_compare(Case(q_seq=128, kv_seq=384, is_causal=False), run_interpreted, scale=1.5)


PERSISTENT_CASES = {
    "causal_with_lengths": Case(batch=2, q_heads=2, is_causal=True, q_lengths=(256, 90),
                                kv_lengths=(200, 256)),
    # 3 q tiles: the causal pairing adds an empty fourth tile per head.
    "causal_odd_tile_count": Case(q_heads=2, kv_heads=1, is_causal=True, q_seq=300, kv_seq=300),
    "dense_gqa": Case(batch=2, q_heads=4, kv_heads=2, q_seq=200, kv_seq=136),
}


@pytest.mark.parametrize("q_buffers", [1, 2])
@pytest.mark.parametrize("name", list(PERSISTENT_CASES))
def test_persistent_grid_walks_several_tiles_per_cta(name, q_buffers, run_interpreted):
  """Two CTAs for all work items: the K/V ring and the Q buffers carry
  their barrier phases from one tile to the next (with two Q tiles per
  consumer, the next item's Q loads while the current one runs)."""
  case = PERSISTENT_CASES[name]
  config = dataclasses.replace(
      sm90_forward.choose_config(case.head_dim, case.mask), persistent=True, num_sms=2,
      q_buffers=q_buffers)
  _run_and_compare(case, run_interpreted, config=config)


@pytest.mark.parametrize("name", ["query_lengths_zero_rows_past_the_length",
                                  "multi_query_one_kv_head", "causal_window_skips_far_tiles"])
def test_one_cta_per_tile_grid_matches_jax_nn_without_races(name, run_interpreted):
  """The heuristic picks the persistent grid for the short sequences above;
  long sequences get one CTA per (head, q tile, batch), checked here."""
  case = FEATURE_CASES[name]
  config = _one_cta_per_tile(sm90_forward.choose_config(case.head_dim, case.mask, case.kv_seq))
  _run_and_compare(case, run_interpreted, config=config)


@pytest.mark.parametrize("batch,heads,q_tiles,num_sms,paired", [
    (8, 16, 16, 132, True), (3, 5, 7, 8, True), (2, 3, 5, 4, False), (1, 2, 1, 132, True)])
def test_persistent_work_covers_every_tile_once_and_balances_causal_tiles(
    batch, heads, q_tiles, num_sms, paired):
  """Every (batch, head, q tile) is some CTA's work item exactly once (plus,
  for an odd causal tile count, one empty tile per (batch, head) past the
  end); under a causal mask (tile t costs t + 1 blocks) no CTA's load exceeds
  the even share by more than one pair of tiles, nor the worst load of single
  tiles dealt round-robin."""
  work = sm90_forward.PersistentWork(batch, heads, q_tiles, num_sms, paired)
  seen = [work.coords(cta, i) for cta in range(work.num_ctas) for i in range(work.count(cta))]
  seen = [tuple(int(x) for x in item) for item in seen]
  expected = [(b, h, t) for b in range(batch) for h in range(heads) for t in range(work.tile_slots)]
  assert sorted(seen) == expected
  assert work.tile_slots == q_tiles + (q_tiles % 2 if paired else 0)
  if paired:
    cost = lambda t: t + 1 if t < q_tiles else 0
    loads = [sum(cost(int(work.coords(cta, i)[2])) for i in range(work.count(cta)))
             for cta in range(work.num_ctas)]
    ideal = sum(loads) / work.num_ctas
    assert max(loads) <= ideal + q_tiles + 1  # within one pair of the ideal
    # Single tiles dealt round-robin in the same order (heavy first): worse.
    singles = [cost(q_tiles - 1 - (n // heads) % q_tiles) for n in range(batch * heads * q_tiles)]
    round_robin = [sum(singles[cta::work.num_ctas]) for cta in range(work.num_ctas)]
    assert max(loads) <= max(round_robin)


def test_persistent_work_matches_in_kernel_arithmetic():
  """The kernel calls `coords` on int32 scalars: same answers as on ints."""
  work = sm90_forward.PersistentWork(3, 5, 7, 8, True)
  for cta, i in [(0, 0), (3, 1), (7, 4), (5, 5)]:
    traced = jax.jit(lambda c, j: jnp.stack(work.coords(c, j)))(jnp.int32(cta), jnp.int32(i))
    assert [int(x) for x in traced] == [int(x) for x in work.coords(cta, i)]
    assert int(jax.jit(work.count)(jnp.int32(cta))) == work.count(cta)


def test_head_dim_64_walks_many_kv_blocks_through_the_ring(run_interpreted):
  """D = 64 uses 256-key blocks: a long key sequence wraps the 2-slot ring
  several times and ends in a ragged block."""
  _run_and_compare(Case(q_seq=128, kv_seq=1100, is_causal=False), run_interpreted)


def test_key_blocks_of_192_keep_tails_and_the_diagonal_right(run_interpreted):
  """D = 128 can run 192-key blocks (the SMEM ring then fills 227 KiB): a
  block size that divides neither the lengths nor the 128-row CTA tile."""
  case = Case(head_dim=128, is_causal=True, q_seq=300, kv_seq=500)
  config = _one_cta_per_tile(sm90_forward.choose_config(128, case.mask, case.kv_seq),
                             block_kv=192)
  _run_and_compare(case, run_interpreted, config=config)


# Consumers that do not take turns (`pingpong=False`), two or three of them
# (the D = 64 heuristic): each still walks its own rows' blocks and keeps the
# ring protocol.
UNSYNCHRONIZED = [(2, 256), (3, 128)]
# Registers (producer, consumer) that fit the SM for that many consumers.
REGISTERS = {2: (24, 240), 3: (24, 160)}
UNSYNCHRONIZED_CASES = {
    "causal_with_lengths": Case(
        batch=2, is_causal=True, q_lengths=(200, 37), kv_lengths=(256, 100), head_dim=64),
    "gqa_window_ragged": Case(q_heads=4, kv_heads=2, window=(40, 20), q_seq=77, kv_seq=300,
                              head_dim=64),
}


@pytest.mark.parametrize("num_consumers,block_kv", UNSYNCHRONIZED)
@pytest.mark.parametrize("name", list(UNSYNCHRONIZED_CASES))
def test_unsynchronized_consumers_match_jax_nn_without_races(name, num_consumers, block_kv,
                                                              run_interpreted):
  case = UNSYNCHRONIZED_CASES[name]
  config = dataclasses.replace(
      sm90_forward.choose_config(sm90_forward.padded_head_dim(case.head_dim), case.mask),
      pingpong=False, num_consumers=num_consumers, block_kv=block_kv, num_kv_stages=2,
      persistent=False, producer_registers=REGISTERS[num_consumers][0],
      consumer_registers=REGISTERS[num_consumers][1])
  _run_and_compare(case, run_interpreted, config=config)


def test_pingpong_needs_exactly_two_consumers():
  with pytest.raises(ValueError, match="pingpong"):
    sm90_forward.ForwardConfig(block_q=64, block_kv=128, num_kv_stages=2, num_consumers=3)


@pytest.mark.parametrize("entry", ["sm90 forward", "sm90 backward", "sm100 forward",
                                   "sm100 backward"])
def test_a_band_aligned_by_the_lengths_needs_query_lengths(entry):
  """Without them a kernel would align each row by its padded query length:
  wrong, silently (the public API always fills them: `validation._align`)."""
  from fa4_jax.kernels import sm90_backward, sm100_backward, sm100_forward
  from fa4_jax.scores import MaskSpec

  q = jnp.zeros((2, 130, 2, 128), jnp.bfloat16)
  lse = jnp.zeros((2, 2, 130), jnp.float32)
  kv_lengths = jnp.asarray([130, 77], jnp.int32)
  common = dict(score=ScoreFunction(128 ** -0.5), mask=MaskSpec(right=0, offset_from_lengths=True))
  calls = {
      "sm90 forward": lambda: sm90_forward.forward(q, q, q, None, kv_lengths, **common),
      "sm90 backward": lambda: sm90_backward.backward(q, q, q, q, lse, q, None, kv_lengths,
                                                      **common),
      "sm100 forward": lambda: sm100_forward.forward(q, q, q, None, kv_lengths, **common),
      "sm100 backward": lambda: sm100_backward.backward(q, q, q, q, lse, q, None, kv_lengths,
                                                        **common),
  }
  with pytest.raises(ValueError, match=f"{entry}: .*needs q_lengths"):
    calls[entry]()


def test_q_buffers_are_one_or_two():
  with pytest.raises(ValueError, match="q_buffers must be 1 or 2"):
    sm90_forward.ForwardConfig(block_q=64, block_kv=128, num_kv_stages=2, q_buffers=3)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_persistent_heuristic_configs_prefetch_q_where_it_fits(head_dim):
  """Short sequences get the persistent grid with two Q tiles per consumer;
  one CTA per tile keeps one (it has a single work item)."""
  short = sm90_forward.choose_config(head_dim, MaskSpec(), 2048)
  assert short.persistent and short.q_depth == 2
  assert short.smem_bytes(head_dim, 2) <= SMEM_LIMIT_BYTES
  assert sm90_forward.choose_config(head_dim, MaskSpec(), 16384).q_depth == 1


def test_packed_causal_rows_take_the_work_queue_at_any_length():
  """Packed documents are short whatever the row's length, and a tile's cost
  depends on where the documents end: causal calls with segment ids at head
  dims up to 128 take the persistent grid with a work queue and two Q tiles,
  which the keys' ids and the queue's cells still leave room for; dense
  masks, larger head dims and long rows without ids keep the grid their
  length picks."""
  causal = MaskSpec(right=0)
  for head_dim in (64, 128):
    for row in (2048, 16384):
      packed = sm90_forward.choose_config(head_dim, causal, row, segment_ids=True)
      assert packed.persistent and packed.work_queue and packed.q_depth == 2
      assert packed.smem_bytes(head_dim, 2, segment_ids=True) <= (
          SMEM_LIMIT_BYTES - sm90_forward.SMEM_RESERVE_BYTES)
  long_row = sm90_forward.choose_config(128, causal, 16384)
  assert not long_row.persistent
  assert not sm90_forward.choose_config(128, MaskSpec(), 16384, segment_ids=True).persistent
  assert not sm90_forward.choose_config(256, causal, 16384, segment_ids=True).work_queue


def test_short_causal_rows_take_the_work_queue_and_long_ones_one_cta_per_tile():
  """Causal rows whose tiles walk few key blocks (up to S = 4096 at 128-key
  blocks: 16.5 on average) take the persistent grid with a work queue and
  two Q tiles, which beat the static pairs there; longer rows keep one CTA
  per tile, and rows whose queries do not line up with their keys keep the
  pairs the queue was not measured against."""
  causal = MaskSpec(right=0)
  for head_dim in (64, 128):
    for seq in (512, 2048, 4096):
      config = sm90_forward.choose_config(head_dim, causal, seq)
      assert config.persistent and config.work_queue and config.q_depth == 2, (head_dim, seq)
    assert not sm90_forward.choose_config(head_dim, causal, 8192).persistent
  prefill = sm90_forward.choose_config(128, causal, 4096, 1024)
  assert prefill.persistent and not prefill.work_queue
  assert not sm90_forward.choose_config(128, MaskSpec(), 2048).work_queue
  assert not sm90_forward.choose_config(128, MaskSpec(left=255, right=0), 2048).work_queue


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_work_queue_lowers_with_one_atomic_and_vmap_lowers_it_without(head_dim):
  """The packed config lowers for Hopper within its SMEM estimate and takes
  units with a GMEM atomic. Under vmap Pallas adds a grid axis whose CTAs
  would share the one counter, so the vmapped call's kernel has no atomic
  (fixed round-robin shares, the protocol the interpreter tests)."""
  from fa4_jax.testing import cross_lower

  mask = MaskSpec(right=0)
  config = sm90_forward.choose_config(head_dim, mask, 16384, segment_ids=True)
  lowered = _lower(head_dim, mask, config, lengths=True, segment_ids=True)
  _assert_fits_and_uses_hopper_instructions(lowered)
  _assert_smem_within_the_heuristics_estimate(lowered, head_dim, config, segment_ids=True)
  assert lowered.has("atom.relaxed.gpu.global.add")
  if head_dim != 128:
    return  # the vmapped kernel differs only by the grid: one head dim is enough

  q = jax.ShapeDtypeStruct((3, 2, 512, 4, 128), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((3, 2, 512), jnp.int32)
  fn = lambda q, k, v, ids: sm90_forward.forward(q, k, v, None, None, score=ScoreFunction(0.1),
                                                 mask=mask,
                                                  config=config, segment_ids=(ids, ids))[0]
  vmapped = cross_lower(jax.vmap(fn), q, q, q, ids)
  assert vmapped.has("wgmma.mma_async") and not vmapped.has("atom.relaxed.gpu.global.add")


def test_registers_beyond_the_sm_are_refused():
  """Consumers that ask for more registers than the producer gives back wait
  forever in `set_max_registers` (seen on an H100): refused, not run."""
  with pytest.raises(ValueError, match="66560 registers exceeds the 65536"):
    sm90_forward.ForwardConfig(block_q=64, block_kv=128, num_kv_stages=2, num_consumers=3,
                               pingpong=False, producer_registers=40, consumer_registers=160)


# --- segment ids (packed sequences) --------------------------------------------


def _ids(*rows):
  """Segment ids per batch row as the tuples `KernelCase` holds."""
  return tuple(tuple(int(x) for x in row) for row in rows)


def _packed(document_lengths, total):
  return _ids(packed_segment_ids(document_lengths, total))


SEGMENT_CASES = {
    # 100 + 1 + 90 tokens, then padding (its own id) to 256.
    "packed_causal_with_a_one_token_document": Case(
        is_causal=True, q_segment_ids=_packed([100, 1, 90], 256),
        kv_segment_ids=_packed([100, 1, 90], 256)),
    "packing_differs_per_row_with_lengths_and_grouped_heads": Case(
        batch=2, q_heads=4, kv_heads=2, head_dim=128, is_causal=True,
        q_lengths=(256, 150), kv_lengths=(256, 200),
        q_segment_ids=_ids(packed_segment_ids([64, 128, 64], 256),
                           packed_segment_ids([30, 170, 56], 256)),
        kv_segment_ids=_ids(packed_segment_ids([64, 128, 64], 256),
                            packed_segment_ids([30, 170, 56], 256))),
    "window_fp16_queries_and_keys_packed_differently": Case(
        dtype="float16", head_dim=128, window=(40, 20), q_seq=256, kv_seq=384,
        q_segment_ids=_packed([120, 136], 256), kv_segment_ids=_packed([120, 200, 64], 384)),
    # Query ids 0, 1, 2, 0, ... against key ids 0, 1, 0, ...: id 2 meets no
    # key, so every third row sees nothing (zeros, lse -inf).
    "interleaved_ids_leave_rows_without_keys": Case(
        q_seq=130, kv_seq=300, q_segment_ids=_ids(np.arange(130) % 3),
        kv_segment_ids=_ids(np.arange(300) % 2)),
    "cross_attention_head_dim_256": Case(
        head_dim=256, q_seq=96, kv_seq=264, q_segment_ids=_packed([40, 56], 96),
        kv_segment_ids=_packed([100, 164], 264)),
}


@pytest.mark.parametrize("name", list(SEGMENT_CASES))
def test_segment_ids_match_the_explicit_mask_without_races(name, run_interpreted):
  _run_and_compare(SEGMENT_CASES[name], run_interpreted)


def test_segment_ids_in_a_persistent_causal_grid_with_an_empty_tile(run_interpreted):
  """Two CTAs walk 3 causal tiles per head and the empty fourth one the
  pairing adds: its segment ranges and ids are read in bounds, and the ring
  phases carry across items whose ranges the segments narrowed."""
  ids = _packed([150, 100, 50], 300)
  case = Case(q_heads=2, kv_heads=1, head_dim=128, is_causal=True, q_seq=300, kv_seq=300,
              q_segment_ids=ids, kv_segment_ids=ids)
  config = dataclasses.replace(sm90_forward.choose_config(128, case.mask), persistent=True,
                               num_sms=2, q_buffers=2)
  assert sm90_forward.PersistentWork(1, 2, 3, 2, True).tile_slots == 4
  _run_and_compare(case, run_interpreted, config=config)


def test_segment_ids_in_the_static_persistent_grid_of_three_consumers(run_interpreted):
  """Short rows at head dim 64 take the static persistent grid with two Q
  copies and three consumers; over two batch rows of 79 queries the third
  consumer's rows all lie past the length (its segment ranges are the
  padding's empty ones) and the second's partly."""
  case = Case(batch=2, q_heads=2, kv_heads=2, head_dim=64, q_seq=79, kv_seq=63,
              q_segment_ids=_ids(packed_segment_ids([30, 49], 79),
                                 packed_segment_ids([5, 40, 34], 79)),
              kv_segment_ids=_ids(packed_segment_ids([20, 43], 63),
                                  packed_segment_ids([63], 63)))
  config = sm90_forward.choose_config(64, case.mask, 63, 79, segment_ids=True)
  assert (config.persistent, config.work_queue, config.q_buffers,
          config.num_consumers) == (True, False, 2, 3)
  _run_and_compare(case, run_interpreted, config=config)


@pytest.mark.parametrize("q_buffers", [1, 2])
def test_a_work_queue_hands_every_tile_to_some_cta_once(q_buffers, run_interpreted):
  """Persistent grid with a work queue: three CTAs take 2 heads x 3 causal
  tiles x 2 rows one unit at a time (the producer stores each next unit in
  an SMEM cell that the next Q's barrier orders for the consumers, who stop
  at a unit past the end); rows are packed differently, with lengths. (The
  interpreter hands units out round robin; the atomic counter runs in
  tests/test_segments_on_gpu.py, whose packed causal calls take the queue.)"""
  q_ids = _ids(packed_segment_ids([150, 100, 50], 300), packed_segment_ids([20, 280], 300))
  case = Case(batch=2, q_heads=2, kv_heads=1, head_dim=128, is_causal=True, q_seq=300,
              kv_seq=300, q_lengths=(300, 260), q_segment_ids=q_ids, kv_segment_ids=q_ids)
  config = dataclasses.replace(sm90_forward.choose_config(128, case.mask), persistent=True,
                               num_sms=3, q_buffers=q_buffers, work_queue=True)
  _run_and_compare(case, run_interpreted, config=config)


def test_a_work_queue_needs_the_persistent_grid():
  with pytest.raises(ValueError, match="persistent=True"):
    sm90_forward.ForwardConfig(block_q=64, block_kv=128, num_kv_stages=2, work_queue=True)


def test_segment_ids_in_one_cta_per_tile_grid(run_interpreted):
  case = SEGMENT_CASES["packed_causal_with_a_one_token_document"]
  config = _one_cta_per_tile(sm90_forward.choose_config(case.head_dim, case.mask, case.kv_seq))
  _run_and_compare(case, run_interpreted, config=config)


def _walked_blocks(mask, config, q_ids, kv_ids):
  """Per consumer tile, (own lo, hi, full lo, full hi), and per CTA tile the
  producer's (lo, hi): what the kernel computes, from the kernel's helpers."""
  q_seq, kv_seq = len(q_ids), len(kv_ids)
  _, _, ranges = sm90_forward.segment_operands(
      (jnp.asarray([q_ids]), jnp.asarray([kv_ids])), config, mask, q_seq, kv_seq)
  own = []
  for t in range(q_seq // config.block_q):
    segments = scores.TileRanges(*(ranges[0, t, i] for i in range(4)))
    r = sm90_forward.consumer_kv_blocks(mask, config, t * config.block_q, q_seq, kv_seq, segments)
    own.append(r)
  n = config.num_consumers
  cta = [(int(h.lo), int(h.hi)) for h in (scores.hull(own[c:c + n])
                                           for c in range(0, len(own), n))]
  own = [tuple(int(x) for x in (r.lo, r.hi, r.full_lo, r.full_hi)) for r in own]
  return own, cta


@pytest.mark.parametrize("mask", [MaskSpec(), MaskSpec(right=0)])
def test_tiles_walk_only_the_key_blocks_their_documents_meet(mask):
  """Documents of 200, 300 and 524 tokens packed into 1024 (64-row tiles,
  128-key blocks): each tile walks exactly the blocks holding a key one of
  its rows sees, and runs without the element mask exactly the blocks whose
  every pair is visible; the producer loads the span of its consumers'."""
  config = _one_cta_per_tile(sm90_forward.choose_config(128, mask, 8192))
  assert (config.block_q, config.block_kv, config.num_consumers) == (64, 128, 2)
  ids = packed_segment_ids([200, 300, 524], 1024)
  own, cta = _walked_blocks(mask, config, ids, ids)
  seen = visible_mask(1024, 1024, is_causal=mask.right == 0, q_segment_ids=[ids],
                      kv_segment_ids=[ids])[0, 0]
  for t, (lo, hi, full_lo, full_hi) in enumerate(own):
    tile = seen[t * 64:(t + 1) * 64].reshape(64, 8, 128).transpose(1, 0, 2)  # [block, rows, keys]
    some = [j for j in range(8) if tile[j].any()]
    every = [j for j in range(8) if tile[j].all()]
    assert (lo, hi) == (some[0], some[-1] + 1), t
    assert list(range(full_lo, full_hi)) == every, t
  for c, (lo, hi) in enumerate(cta):
    assert (lo, hi) == (min(own[2 * c][0], own[2 * c + 1][0]), max(own[2 * c][1], own[2 * c + 1][1]))
  walked = sum(hi - lo for lo, hi, _, _ in own)
  masked = walked - sum(hi - lo for _, _, lo, hi in own)
  if mask.is_dense:
    # Without segment ids: 16 tiles x 8 blocks, none masked. Packed: tiles
    # inside a document walk its 2, 3 or 5 blocks (1 or 2 masked at its
    # edges), the 2 tiles across a boundary 4 and 7 (all masked).
    assert (walked, masked) == (3 * 2 + 4 + 3 * 3 + 7 + 8 * 5, 3 + 4 + 3 * 2 + 7 + 8)
  else:
    assert walked < sum(t // 2 + 1 for t in range(16))  # causal without segment ids: 72


# --- sinks and soft-cap -------------------------------------------------------

# (case, options, config changes). The heuristic's choices cover both kinds of
# consumers here: D = 128 takes turns on the tensor core (ping-pong), D = 64
# runs three consumers without turns.
OPTION_CASES = {
    "soft_cap_causal_gqa_taking_turns": (
        Case(q_heads=4, kv_heads=2, head_dim=128, is_causal=True, q_seq=128, kv_seq=192),
        dict(scale=0.5, soft_cap=3.0), {}),
    # Rows 0-2 see no key beside rows that do (the window ends 3 keys before
    # the diagonal), batch 1 sees no key at all and its rows from 100 on lie
    # past the query length. Two CTAs walk every item, so a CTA changes
    # heads between items and reads each one's sink.
    "sinks_with_lengths_and_rows_that_see_no_key": (
        Case(batch=2, q_heads=2, window=(20, -3), q_lengths=(256, 100), kv_lengths=(256, 0)),
        dict(sinks=(0.5, -2.0)), dict(persistent=True, num_sms=2)),
    "sinks_and_soft_cap_fp16_one_cta_per_tile": (
        Case(dtype="float16", q_heads=2, is_causal=True, q_seq=128, kv_seq=200),
        dict(scale=0.5, soft_cap=2.0, sinks=(1.0, -1.5)), dict(persistent=False)),
    # Sink +30 holds the running max above most logits, -30 lets them move
    # it; logits of scale 1.5 grow across the blocks (the stale-max path).
    "large_sinks_and_large_logits": (
        Case(q_heads=2, q_seq=128, kv_seq=384), dict(scale=1.5, sinks=(30.0, -30.0)), {}),
    "soft_cap_with_a_negative_scale": (
        Case(q_seq=128, kv_seq=128, is_causal=True), dict(scale=-0.4, soft_cap=2.0), {}),
}


@pytest.mark.parametrize("name", list(OPTION_CASES))
def test_sinks_and_soft_cap_match_the_einsum_reference_without_races(name, run_interpreted):
  case, options, changes = OPTION_CASES[name]
  config = None
  if changes:
    mask, d = case.mask, sm90_forward.padded_head_dim(case.head_dim)
    config = dataclasses.replace(sm90_forward.choose_config(d, mask, case.kv_seq, case.q_seq),
                                 **changes)
  _run_and_compare(case, run_interpreted, config=config, **options)


def test_soft_cap_keeps_a_fixed_max_and_matches_the_einsum_reference(run_interpreted,
                                                                      monkeypatch):
  """bf16 with a cap near the bound (`scores.fixed_max_is_exact`: 60 for 256
  keys, P up to ~2^78): the kernel never runs the running max nor rescales
  O, and still matches the f32 reference, with GQA, sinks on both sides of
  0 (the fixed max is max(sink, 0)) and rows 0-2 that see no key (zeros,
  lse = sink)."""
  case = Case(q_heads=4, kv_heads=2, window=(200, -3), q_seq=128, kv_seq=256)
  assert scores.fixed_max_is_exact(jnp.bfloat16, 60.0, case.kv_seq)

  def refuse(*args, **kwargs):
    raise AssertionError("the fixed-max path must not take a running max or rescale O")

  monkeypatch.setattr(sm90_forward, "online_softmax", refuse)
  monkeypatch.setattr(sm90_forward, "rescale_rows", refuse)
  # scale 4: logits of std ~32 against the cap of 60, t up to ~0.9.
  _run_and_compare(case, run_interpreted, scale=4.0, soft_cap=60.0,
                   sinks=(1.0, -2.0, 45.0, -30.0))


@pytest.mark.parametrize("dtype, soft_cap, kv_seq, fixed", [
    (jnp.bfloat16, 50.0, 8192, True),
    (jnp.float16, 50.0, 8192, False),  # P would overflow fp16
    (jnp.bfloat16, None, 8192, False),  # no soft-cap: the kernel of before
    (jnp.bfloat16, 100.0, 8192, False),  # past the bound
])
def test_forward_builds_the_fixed_max_kernel_where_the_condition_holds(dtype, soft_cap, kv_seq,
                                                                       fixed, monkeypatch):
  built = {}

  class Built(Exception):
    pass

  def capture(**kwargs):
    built.update(kwargs)
    raise Built

  monkeypatch.setattr(sm90_forward, "_build_kernel", capture)
  q = jax.ShapeDtypeStruct((1, 128, 2, 64), dtype)
  kv = jax.ShapeDtypeStruct((1, kv_seq, 2, 64), dtype)
  with pytest.raises(Built):
    jax.eval_shape(lambda q, k, v: sm90_forward.forward(
        q, k, v, None, None, score=ScoreFunction(0.125, soft_cap), mask=MaskSpec()), q, kv, kv)
  assert built["fixed_max"] is fixed


# --- tile ranges -------------------------------------------------------------


def _brute_force_ranges(mask, q_lo, q_hi, q_len, kv_len, block):
  rows = np.arange(q_lo, min(q_hi, q_len))
  seen, full = [], []
  for j in range(0, math.ceil(max(kv_len, 1) / block) + 2):
    keys = np.arange(j * block, (j + 1) * block)
    if rows.size == 0:
      continue
    vis = np.asarray(mask.visible(rows[:, None], keys[None, :])) & (keys[None, :] < kv_len)
    if vis.any():
      seen.append(j)
    if vis.all():
      full.append(j)
  return seen, full


@pytest.mark.parametrize("mask", [
    MaskSpec(), MaskSpec(right=0), MaskSpec(left=50, right=0), MaskSpec(left=7, right=30),
    MaskSpec(left=None, right=-5), MaskSpec(right=0, q_offset=70),
])
def test_tile_ranges_cover_every_visible_block_and_only_full_ones_skip_the_mask(mask):
  block = 16
  for q_lo, q_len, kv_len in itertools.product((0, 16, 48), (20, 64), (0, 33, 64, 80)):
    q_hi = q_lo + 32
    r = scores.kv_tile_ranges(mask, q_lo, q_hi, q_len, kv_len, block)
    lo, hi, full_lo, full_hi = (int(x) for x in (r.lo, r.hi, r.full_lo, r.full_hi))
    seen, full = _brute_force_ranges(mask, q_lo, q_hi, q_len, kv_len, block)
    assert set(seen) <= set(range(lo, hi)), (q_lo, q_len, kv_len)
    assert lo <= full_lo <= full_hi <= hi
    assert set(range(full_lo, full_hi)) <= set(full), (q_lo, q_len, kv_len)


# --- configurations on hardware (cross-lowered) ------------------------------


def _lower(head_dim, mask, config=None, *, lengths=False, dtype=jnp.bfloat16,
           segment_ids=False, sinks=False, soft_cap=None):
  from fa4_jax.testing import cross_lower

  q = jax.ShapeDtypeStruct((2, 1000, 4, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((2, 1100, 2, head_dim), dtype)
  lens = jax.ShapeDtypeStruct((2,), jnp.int32)
  if sinks or soft_cap is not None:
    sink_spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    fn = lambda q, k, v, ql, kl, s: sm90_forward.forward(
        q, k, v, ql, kl, score=ScoreFunction(0.125, soft_cap),
        mask=mask, config=config, sinks=s if sinks else None)
    return cross_lower(fn, q, kv, kv, lens, lens, sink_spec, arch="sm_90")
  if segment_ids:
    ids = (jax.ShapeDtypeStruct((2, 1000), jnp.int32), jax.ShapeDtypeStruct((2, 1100), jnp.int32))
    fn = lambda q, k, v, ql, kl, q_ids, kv_ids: sm90_forward.forward(
        q, k, v, ql, kl, score=ScoreFunction(0.125), mask=mask, config=config,
        segment_ids=(q_ids, kv_ids))
    return cross_lower(fn, q, kv, kv, lens, lens, *ids, arch="sm_90")
  if lengths:
    fn = lambda q, k, v, ql, kl: sm90_forward.forward(
        q, k, v, ql, kl, score=ScoreFunction(0.125), mask=mask, config=config)
    return cross_lower(fn, q, kv, kv, lens, lens, arch="sm_90")
  fn = lambda q, k, v: sm90_forward.forward(q, k, v, None, None, score=ScoreFunction(0.125),
                                            mask=mask, config=config)
  return cross_lower(fn, q, kv, kv, arch="sm_90")


def _assert_fits_and_uses_hopper_instructions(lowered):
  assert len(lowered.smem_bytes) == 1
  assert lowered.max_smem_bytes <= SMEM_LIMIT_BYTES
  assert lowered.has("wgmma.mma_async")
  assert lowered.has("cp.async.bulk.tensor")
  assert lowered.has("mbarrier.try_wait.parity")


# Every (head dim, config) the heuristic picks, named by its tiling.
EVERY_HEURISTIC_CONFIG = pytest.mark.parametrize(
    "head_dim,config", sm90_forward.all_configs(),
    ids=lambda x: str(x) if isinstance(x, int) else
    f"bq{x.block_q}-bkv{x.block_kv}-st{x.num_kv_stages}{'-persistent' if x.persistent else ''}")


def _assert_smem_within_the_heuristics_estimate(lowered, head_dim, config, segment_ids=False):
  """The heuristic sizes SMEM by the estimate plus a reserve for the
  barriers and alignment: the reserve must cover what lowering adds."""
  estimate = config.smem_bytes(head_dim, 2, segment_ids=segment_ids)
  assert estimate <= lowered.max_smem_bytes <= estimate + sm90_forward.SMEM_RESERVE_BYTES


@EVERY_HEURISTIC_CONFIG
def test_every_heuristic_config_fits_shared_memory_and_uses_wgmma_and_tma(head_dim, config):
  for mask in (MaskSpec(), MaskSpec(right=0), MaskSpec(left=256, right=0)):
    for kv_seq in (1024, 8192):
      if sm90_forward.choose_config(head_dim, mask, kv_seq) == config:
        lowered = _lower(head_dim, mask, config)
        _assert_fits_and_uses_hopper_instructions(lowered)
        _assert_smem_within_the_heuristics_estimate(lowered, head_dim, config)
        break


@EVERY_HEURISTIC_CONFIG
def test_every_heuristic_config_with_segment_ids_lowers_for_hopper_within_the_smem_estimate(
    head_dim, config):
  """Segment ids (with lengths) add GMEM operands, element-mask terms and
  a ring of the keys' ids beside K's (4 bytes a key and slot), which the
  estimate counts; the config the heuristic picked without them still fits."""
  for mask in (MaskSpec(), MaskSpec(right=0), MaskSpec(left=256, right=0)):
    for kv_seq in (1024, 8192):
      if sm90_forward.choose_config(head_dim, mask, kv_seq) == config:
        lowered = _lower(head_dim, mask, config, lengths=True, segment_ids=True)
        _assert_fits_and_uses_hopper_instructions(lowered)
        _assert_smem_within_the_heuristics_estimate(lowered, head_dim, config, segment_ids=True)
        break


@EVERY_HEURISTIC_CONFIG
def test_every_heuristic_config_with_sinks_and_soft_cap_lowers_for_hopper_without_more_smem(
    head_dim, config):
  """Sinks (with lengths) add one GMEM operand, soft-cap a multiply and the
  device's fast tanh per element: no shared memory."""
  for mask in sm90_tiles.HEURISTIC_MASKS:
    for kv_seq in (1024, 8192):
      if sm90_forward.choose_config(head_dim, mask, kv_seq) == config:
        lowered = _lower(head_dim, mask, config, sinks=True, soft_cap=30.0)
        _assert_fits_and_uses_hopper_instructions(lowered)
        assert lowered.has("tanh.approx.f32")
        _assert_smem_within_the_heuristics_estimate(lowered, head_dim, config)
        return


def test_sinks_alone_add_no_tanh_and_the_plain_kernel_has_none():
  mask = MaskSpec(right=0)
  assert not _lower(128, mask, sinks=True).has("tanh")
  assert not _lower(128, mask).has("tanh")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_conditional_rescale_branches_on_a_warp_vote(head_dim):
  """`conditional_rescale` puts O's rescale behind a warp-uniform branch
  (vote.sync.any over the rows' alpha != 1); without it there is no vote."""
  mask = MaskSpec(right=0)
  base = _one_cta_per_tile(sm90_forward.choose_config(head_dim, mask, 8192))
  for conditional in (False, True):
    config = dataclasses.replace(base, conditional_rescale=conditional)
    lowered = _lower(head_dim, mask, config)
    _assert_fits_and_uses_hopper_instructions(lowered)
    assert lowered.has("nvvm.vote.sync any") == conditional
    assert lowered.has("scf.if") or not conditional


def test_masked_length_and_window_variant_lowers_for_hopper():
  lowered = _lower(128, MaskSpec(left=100, right=0), lengths=True, dtype=jnp.float16)
  _assert_fits_and_uses_hopper_instructions(lowered)


def test_shared_memory_estimate_is_within_the_budget_for_every_config():
  """Also with segment ids, which the heuristic does not see."""
  for head_dim, config in sm90_forward.all_configs():
    for segment_ids in (False, True):
      assert (config.smem_bytes(head_dim, 2, segment_ids=segment_ids)
              <= SMEM_LIMIT_BYTES - sm90_forward.SMEM_RESERVE_BYTES)


# --- what the kernel refuses ---------------------------------------------------


@pytest.mark.parametrize("q_shape,k_shape,dtype,argument", [
    ((1, 128, 4, 72), (1, 128, 4, 72), jnp.bfloat16, "head_dim"),
    ((1, 128, 4, 512), (1, 128, 4, 512), jnp.bfloat16, "head_dim"),
    ((1, 128, 4, 64), (1, 128, 4, 64), jnp.float32, "dtype"),
    ((1, 128, 4, 64), (1, 128, 3, 64), jnp.bfloat16, "heads"),
    ((1, 128, 4, 64), (2, 128, 4, 64), jnp.bfloat16, "batch"),
])
def test_unsupported_arguments_raise_kernel_unsupported_naming_the_argument(
    q_shape, k_shape, dtype, argument):
  with pytest.raises(KernelUnsupported, match=argument):
    sm90_forward.check_supported(q_shape, k_shape, dtype, MaskSpec())


def test_segment_ids_of_another_length_than_the_sequences_are_refused():
  q = jnp.zeros((2, 128, 1, 64), jnp.bfloat16)
  ids = jnp.zeros((2, 120), jnp.int32)
  with pytest.raises(KernelUnsupported, match="segment_ids"):
    sm90_forward.forward(q, q, q, None, None, score=ScoreFunction(0.125), mask=MaskSpec(),
                         segment_ids=(ids, ids))


@pytest.mark.parametrize("is_causal,seq", [(True, 1000), (False, 1000), (True, 8192)])
def test_kernels_lower_inside_the_sharding_wrapper_forward_and_backward(is_causal, seq):
  """`fa4_jax.attention` runs a backend inside `custom_partitioning`, which
  refuses functions that close over constant arrays: the kernels (persistent
  grid at 1000 tokens, one CTA per tile at 8192) must not create any."""
  from fa4_jax import backends, vjp
  from fa4_jax.testing import cross_lower

  mask = MaskSpec.from_arguments(is_causal, None)
  assert sm90_forward.choose_config(128, mask, seq).persistent == (seq == 1000)
  config = vjp.CoreConfig(backends._kernel_backend("sm90"))
  score_value = Scores(mask=mask, scale=0.125)

  def loss(q, k, v):
    out, _ = vjp.attention_core(q, k, v, None, None, score_value, config)
    return jnp.sum(out.astype(jnp.float32))

  spec = jax.ShapeDtypeStruct((1, seq, 2, 128), jnp.bfloat16)
  lowered = cross_lower(jax.grad(loss, (0, 1, 2)), spec, spec, spec)
  assert len(lowered.modules) >= 3  # forward, dK/dV, dQ
  assert lowered.has("wgmma.mma_async")


# --- The barrier table ---------------------------------------------------------


def test_barrier_table_lists_every_arrive_and_wait(monkeypatch):
  """Every ForwardBarrierTable accessor (the only way the roles touch a
  barrier) appears in the row of the barrier it arrives on or waits on, on
  its declared side, and every barrier has both an arriving and a waiting
  side; the interpreter-only drains are named where they wait."""
  cfg = sm90_forward.choose_config(128, MaskSpec())
  assert cfg.pingpong  # the tensor_core_turn accessors act
  # The table reads the call's config, page size and segment ids (`ForwardStatics`).
  call = types.SimpleNamespace(config=cfg, page_size=16, has_segment_ids=True)
  barrier_tables.check_table(
      sm90_forward.ForwardBarrierTable,
      lambda refs: sm90_forward.ForwardBarrierTable(call, refs), sm90_forward, monkeypatch,
      indent=12, named_only=("drain_kv_rings", "drain_q"))
