"""The Hopper backward kernels (fa4_jax/kernels/sm90_backward.py), checked on the CPU.

* Numerics and barrier protocol: the kernels run in Pallas' GPU interpreter
  with race detection, at small shapes. dq, dk, dv must match
  - the XLA backward (fa4_jax.xla_attention.backward) given the same out and
    lse: same formula, so only bf16/fp16 rounding apart;
  - jax.grad of jax.nn.dot_product_attention(implementation="xla") in f32 on
    the upcast inputs: an independent definition of the gradient.
* Segment ids (packed sequences): the same kernels, against the gradient of
  an f32 einsum attention under the explicit boolean mask (jax.nn has no
  segment ids), and the tile ranges the kernels walk, from the helper they
  use.
* Logit soft-capping (`soft_cap=`) and sinks (in the lse): the kernels
  given the f32 reference's out and lse, against its gradients.
* Determinism: two runs give bit-identical gradients.
* Hardware fit: every configuration the heuristic can pick is cross-lowered
  for sm_90 and must fit the shared memory and use wgmma and TMA.
* The barrier tables: every accessor of the dK/dV, head-split and dQ
  kernels' tables is listed in the row of the barrier it touches, on its
  declared side (`barrier_tables`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import barrier_tables
from fa4_jax import scores, xla_attention
from fa4_jax.kernels import KernelUnsupported
from fa4_jax.kernels import sm90_backward, sm90_backward_dkdv, sm90_backward_dq
from fa4_jax.scores import MaskSpec, ScoreFunction, Scores
from fa4_jax.testing import SMEM_LIMIT_BYTES
from reference import KernelCase, einsum_attention, packed_segment_ids, relative_error


@dataclasses.dataclass(frozen=True)
class Case(KernelCase):
  pass  # KernelCase's defaults: 128 queries and keys


def _forward(case: Case, q, k, v, scale):
  """(out, lse) from the XLA forward: what the backward receives."""
  q_len, kv_len = case.lengths()
  return xla_attention.forward(q, k, v, None, None,
                               Scores(mask=case.mask, scale=scale, q_lengths=q_len, kv_lengths=kv_len))


def _kernel_grads(case: Case, run_interpreted, q, k, v, out, lse, dout, scale, config=None,
                  soft_cap=None):
  """The kernels' (dq, dk, dv) of logits with this scale and soft-cap."""
  q_len, kv_len = case.lengths()
  segment_ids = case.segment_ids()

  def fn(q, k, v, out, lse, dout):
    return sm90_backward.backward(q, k, v, out, lse, dout, q_len, kv_len,
                                  score=ScoreFunction(scale, soft_cap), mask=case.mask,
                                  config=config, segment_ids=segment_ids)

  return run_interpreted(fn, q, k, v, out, lse, dout)


def _jax_nn_grads(case: Case, q, k, v, dout, scale):
  """jax.grad of jax.nn.dot_product_attention in f32 on the upcast inputs."""
  q_len, kv_len = case.lengths()

  def attention(q, k, v):
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=case.is_causal, local_window_size=case.window,
        query_seq_lengths=q_len, key_value_seq_lengths=kv_len, implementation="xla")

  f32 = lambda x: x.astype(jnp.float32)
  _, vjp = jax.vjp(attention, f32(q), f32(k), f32(v))
  # Rows that see no key (past the query length, or every key masked) output
  # zeros in fa4_jax and get no gradient; jax.nn averages all keys there
  # instead, so those rows are left out of the comparison.
  return vjp(jnp.where(_rows_seeing_keys(case), f32(dout), 0.0))


def _rows_seeing_keys(case: Case) -> np.ndarray:
  """[B, Tq, 1, 1]: whether each query row sees a key, from the definitions."""
  return case.visible().any(-1)[:, 0, :, None, None]


def _check_case(case: Case, run_interpreted, config=None):
  q, k, v, dout = case.backward_inputs()
  scale = 1.0 / math.sqrt(case.head_dim)
  out, lse = _forward(case, q, k, v, scale)
  grads = _kernel_grads(case, run_interpreted, q, k, v, out, lse, dout, scale, config)
  for g, x in zip(grads, (q, k, v)):
    assert g.shape == x.shape and g.dtype == x.dtype

  q_len, kv_len = case.lengths()
  xla = xla_attention.backward(
      q, k, v, None, None, Scores(mask=case.mask, scale=scale, q_lengths=q_len, kv_lengths=kv_len),
      out, lse, dout)[:3]
  exact = _jax_nn_grads(case, q, k, v, dout, scale)
  for name, got, same_formula, reference in zip(("dq", "dk", "dv"), grads, xla, exact):
    got = np.asarray(got, np.float32)
    # Against the XLA backward: the same computation, rounding apart.
    np.testing.assert_allclose(got, np.asarray(same_formula, np.float32),
                               atol=2e-2, rtol=2e-2, err_msg=name)
    # Against the f32 gradient of jax.nn: bf16 inputs to the GEMMs, so compare
    # the error relative to the gradient's overall size.
    reference = np.asarray(reference)
    rel = relative_error(got, reference)
    assert rel < (2e-2 if case.dtype == "bfloat16" else 5e-3), (name, rel)
  return grads


# Each case is small (the interpreter takes seconds per call) and covers
# several features at once to keep the file within a few minutes.
FEATURE_CASES = {
    "dense_bf16": Case(),
    "fp16_causal_head_dim_128_queries_shorter_than_keys_top_left_aligned": Case(
        dtype="float16", is_causal=True, head_dim=128, q_seq=72, kv_seq=200),
    "ragged_tails_two_sided_window_skips_far_tiles": Case(
        window=(40, 20), q_seq=77, kv_seq=330),
    "causal_window_skips_tiles_on_both_sides": Case(
        is_causal=True, window=(64, 0), q_seq=320, kv_seq=320),
    "sequence_lengths_mask_keys_and_drop_rows": Case(
        batch=2, is_causal=True, q_seq=104, kv_seq=136, q_lengths=(70, 104),
        kv_lengths=(136, 0)),
    "gqa_sums_dk_dv_over_the_group_in_the_kernel": Case(
        q_heads=4, kv_heads=2, is_causal=True, q_seq=136, kv_seq=136),
    "mqa_one_kv_head_head_dim_96_is_padded": Case(
        q_heads=3, kv_heads=1, head_dim=96, q_seq=64, kv_seq=136),
    # Above head dim 128 dK + dV do not fit one warpgroup's registers:
    # at 256 the two consumers split the head dim, at 192 two passes.
    "head_dim_256_gqa_causal_ragged_consumers_split_the_head_dim": Case(
        q_heads=4, kv_heads=2, head_dim=256, is_causal=True, q_seq=100, kv_seq=164),
    "head_dim_256_fp16_lengths_window_consumers_split_the_head_dim": Case(
        batch=2, dtype="float16", head_dim=256, window=(70, 30), q_seq=150, kv_seq=210,
        q_lengths=(150, 61), kv_lengths=(190, 210)),
    "head_dim_192_fp16_window_and_key_lengths_in_two_dk_dv_passes": Case(
        batch=2, dtype="float16", head_dim=192, window=(50, 10), q_seq=96, kv_seq=160,
        kv_lengths=(160, 90)),
}


@pytest.mark.parametrize("name", list(FEATURE_CASES))
def test_gradients_match_xla_backward_and_jax_nn_without_races(name, run_interpreted):
  _check_case(FEATURE_CASES[name], run_interpreted)


STATS_PLACEMENTS = {  # where the dK/dV kernel brings in lse and delta
    "loaded_after_the_wait": dict(stats_first=False, fold_stats=False),
    "loaded_before_the_wait": dict(stats_first=True, fold_stats=False),
    "folded_into_the_accumulators": dict(fold_stats=True),
}


def _placement_config(name, placement):
  case = FEATURE_CASES[name]
  config = sm90_backward.choose_config(case.head_dim, case.mask)
  return dataclasses.replace(config, dkv=dataclasses.replace(config.dkv,
                                                             **STATS_PLACEMENTS[placement]))


# Each case with each placement the heuristic does not already pick for it
# (that one runs in test_gradients_match_xla_backward_and_jax_nn_without_races).
PLACEMENT_CASES = [
    (name, placement)
    for name in ["causal_window_skips_tiles_on_both_sides",
                 "sequence_lengths_mask_keys_and_drop_rows",
                 "gqa_sums_dk_dv_over_the_group_in_the_kernel",
                 "head_dim_192_fp16_window_and_key_lengths_in_two_dk_dv_passes"]
    for placement in STATS_PLACEMENTS
    if _placement_config(name, placement) != sm90_backward.choose_config(
        FEATURE_CASES[name].head_dim, FEATURE_CASES[name].mask)]


@pytest.mark.parametrize("name, placement", PLACEMENT_CASES)
def test_lse_and_delta_placements_give_the_same_gradients(name, placement, run_interpreted):
  """The dK/dV kernel subtracts lse2 and delta after the S^T / dP^T wgmmas,
  loading them after the wait or before it (`stats_first`), or starts the
  accumulators at -lse2 / c and -delta (`fold_stats`; rows without keys or
  past their length start at -inf). Two passes at head dim 192: the dV pass
  has no delta and keeps the subtraction."""
  _check_case(FEATURE_CASES[name], run_interpreted, config=_placement_config(name, placement))


@pytest.mark.parametrize("name", ["sequence_lengths_mask_keys_and_drop_rows",
                                  "mqa_one_kv_head_head_dim_96_is_padded"])
def test_delta_from_an_xla_reduction_or_from_the_dq_kernel_gives_the_same_gradients(
    name, run_interpreted):
  """At head dim <= 128 the dQ kernel can compute delta = rowsum(dO * O)
  from its O tiles (`delta_in_dq`, the heuristic's choice for causal masks)
  and hand it to the dK/dV kernel; without it an XLA reduction computes
  delta before both kernels."""
  case = FEATURE_CASES[name]
  config = sm90_backward.choose_config(case.head_dim, case.mask)
  xla_delta = dataclasses.replace(config, delta_in_dq=False)
  in_dq = dataclasses.replace(config, delta_in_dq=True, overlap_kernels=False)
  grads = _check_case(case, run_interpreted, config=xla_delta)
  same = _check_case(case, run_interpreted, config=in_dq)
  for got, want in zip(same, grads):  # one formula, only the summation order may differ
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_lse_and_delta_are_folded_into_the_accumulators_only_for_causal_gqa_at_128(head_dim):
  """Measured (H100, H200): folding removes the causal GQA dK/dV kernel's
  spills and gains 1-2 %; elsewhere (windows included) loading lse and delta
  before the wgmmas costs as much as or more than it saves."""
  folds = lambda mask, group: sm90_backward.choose_config(head_dim, mask, group).dkv.fold_stats
  causal = MaskSpec(right=0)
  assert folds(causal, 4) == (head_dim == 128)
  assert not folds(causal, 1)
  assert not folds(MaskSpec(), 4)
  assert not folds(MaskSpec(left=256, right=0), 1)
  assert not folds(MaskSpec(left=256, right=0), 4)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_soft_cap_folds_delta_under_causal_masks_at_128(head_dim):
  """Measured (H100, H200): under soft-cap (where only delta can be folded)
  folding gains 1.4-3.3 % with causal masks and windows, and removes most of
  the dK/dV kernel's spills; dense calls gain nothing."""
  folds = lambda mask, group: sm90_backward.choose_config(head_dim, mask, group,
                                                          raw_scores=True).dkv.fold_stats
  for mask in (MaskSpec(right=0), MaskSpec(left=256, right=0)):
    for group in (1, 4):
      assert folds(mask, group) == (head_dim == 128)
  assert not folds(MaskSpec(), 1)
  assert not folds(MaskSpec(), 4)


def test_dk_dv_register_options_need_a_kernel_that_has_them():
  """The head-dim split at 256 has neither option; dv_dk_split's warpgroup
  0 has them (issue #56's candidates), and warpgroup placements and
  registers of its own are the split schemes' alone."""
  for option, others in (("fold_stats", [dict(dk_dv="head_dim_split")]),
                         ("operands_in_registers", [dict(dk_dv="head_dim_split")]),
                         ("k_in_registers", [dict(dk_dv="head_dim_split")]),
                         ("wg1_dv", [dict(), dict(dk_dv="head_dim_split")])):
    for other in others:
      with pytest.raises(ValueError, match=option):
        sm90_backward.DkvConfig(**{option: True}, **other)
  for option in ("fold_stats", "stats_first", "operands_in_registers", "k_in_registers",
                 "wg1_dv"):
    sm90_backward.DkvConfig(dk_dv="dv_dk_split", producer_registers=24, consumer_registers=240,
                            **{option: True})
  with pytest.raises(ValueError, match="wg0_registers"):
    sm90_backward.DkvConfig(wg0_registers=200)
  # A 24-register producer, warpgroup 0 on 256 and warpgroup 1 on 224: 64512.
  sm90_backward.DkvConfig(dk_dv="dv_dk_split", producer_registers=24, consumer_registers=224,
                          wg0_registers=256)
  with pytest.raises(ValueError, match="registers exceeds the 64512"):
    sm90_backward.DkvConfig(dk_dv="dv_dk_split", producer_registers=24, consumer_registers=232,
                            wg0_registers=256)


def test_overlapped_kernels_must_not_read_each_others_outputs():
  """With `delta_in_dq` the dK/dV kernel reads the dQ kernel's delta."""
  with pytest.raises(ValueError, match="overlap_kernels"):
    sm90_backward.BackwardConfig(delta_in_dq=True, overlap_kernels=True)


def test_delta_in_dq_kernel_needs_whole_blocks():
  with pytest.raises(ValueError, match="block_q"):  # 2 x 64 dQ rows, 96-row dK/dV blocks
    sm90_backward.BackwardConfig(sm90_backward.DkvConfig(block_q=96),
                                 sm90_backward.DqConfig(num_consumers=2, block_q=64),
                                 delta_in_dq=True)


@pytest.mark.parametrize("name", ["gqa_sums_dk_dv_over_the_group_in_the_kernel",
                                  "causal_window_skips_tiles_on_both_sides"])
def test_three_dk_dv_consumers_match_xla_backward_without_races(name, run_interpreted):
  """Three dK/dV consumers on 160 registers (the D = 64 choice before
  `stats_first`): each owns 64 of the CTA's 192 keys."""
  case = FEATURE_CASES[name]
  config = sm90_backward.choose_config(case.head_dim, case.mask)
  config = dataclasses.replace(config, dkv=dataclasses.replace(
      config.dkv, num_consumers=3, consumer_registers=160, stats_first=False))
  _check_case(case, run_interpreted, config=config)


@pytest.mark.parametrize("options", [{}, dict(soft_cap=2.0)], ids=["plain", "soft_cap"])
def test_gradients_are_bit_identical_across_runs(options, run_interpreted):
  case = Case(q_heads=2, kv_heads=1, is_causal=True)
  q, k, v, dout = case.backward_inputs()
  scale = 1.0 / math.sqrt(case.head_dim)
  out, lse = _forward(case, q, k, v, scale)
  first = _kernel_grads(case, run_interpreted, q, k, v, out, lse, dout, scale, **options)
  second = _kernel_grads(case, run_interpreted, q, k, v, out, lse, dout, scale, **options)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_three_warpgroups_share_the_registers_they_launch_with():
  """384 threads launch with 168 registers each (a multiple of 8), 64512 in
  all: a 64-register producer and two consumers on 224 (65536) would wait
  forever in `set_max_registers` (seen on an H100); four warpgroups launch
  with 128 each, 65536 in all."""
  with pytest.raises(ValueError, match="65536 registers exceeds the 64512"):
    sm90_backward.DkvConfig(producer_registers=64, consumer_registers=224)
  with pytest.raises(ValueError, match="65536 registers exceeds the 64512"):
    sm90_backward.DqConfig(producer_registers=64, consumer_registers=224)
  sm90_backward.DkvConfig(producer_registers=56, consumer_registers=224)
  sm90_backward.DqConfig(producer_registers=56, consumer_registers=224)


# --- segment ids (packed sequences) ------------------------------------------


def _ids(*runs):
  """One batch row of ids from (id, count) runs, as a KernelCase tuple."""
  return tuple(int(i) for i, n in runs for _ in range(n))


def _interleaved(length: int, period: int, ids: int):
  """Non-contiguous ids: runs of `period` positions cycling over `ids` ids."""
  return tuple(int(x) for x in (np.arange(length) // period) % ids)


def _packed(document_lengths, total):
  return tuple(int(x) for x in packed_segment_ids(document_lengths, total))


_PACKED_256 = _packed([150, 20, 1, 85], 256)
SEGMENT_CASES = {
    # Documents of 150, 20, 1 and 85 tokens: blocks inside the first one run
    # without the element mask, blocks of different documents are skipped.
    "packed_documents_causal_with_a_one_token_document": Case(
        is_causal=True, q_seq=256, kv_seq=256, q_segment_ids=(_PACKED_256,),
        kv_segment_ids=(_PACKED_256,)),
    "interleaved_ids_window_and_lengths_two_rows": Case(
        batch=2, window=(40, 20), q_seq=136, kv_seq=136, q_lengths=(136, 100),
        kv_lengths=(120, 136),
        q_segment_ids=(_packed([70, 66], 136), _interleaved(136, 5, 3)),
        kv_segment_ids=(_packed([70, 66], 136), _interleaved(136, 5, 3))),
    # Queries at positions 128..199 of 200 keys; id 7 has no key and ids 2
    # and 3 start at different places: rows that see no key have lse -inf.
    "gqa_fp16_head_dim_128_causal_offset_queries_other_layout_rows_without_keys": Case(
        q_heads=4, kv_heads=2, head_dim=128, dtype="float16", is_causal=True, q_offset=128,
        q_seq=72, kv_seq=200, q_segment_ids=(_ids((2, 30), (7, 12), (3, 30)),),
        kv_segment_ids=(_ids((0, 40), (1, 60), (2, 70), (3, 30)),)),
    "head_dim_256_dense_gqa_packed_consumers_split_the_head_dim": Case(
        q_heads=2, kv_heads=1, head_dim=256, q_seq=136, kv_seq=136,
        q_segment_ids=(_packed([64, 40, 32], 136),),
        kv_segment_ids=(_packed([64, 40, 32], 136),)),
    "head_dim_192_fp16_causal_interleaved_in_two_dk_dv_passes": Case(
        head_dim=192, dtype="float16", is_causal=True, q_seq=96, kv_seq=160,
        q_segment_ids=(_interleaved(96, 24, 2),), kv_segment_ids=(_interleaved(160, 40, 2),)),
}


def _einsum_grads(case: Case, q, k, v, dout, scale, *, sinks=None, soft_cap=None):
  """(out, lse) and the f32 gradient (of q, k, v) of attention under
  `case.visible()`, with `sinks` and `soft_cap` when given; rows that see no
  key output zeros and get no gradient."""
  visible = jnp.asarray(case.visible())
  f32 = lambda x: x.astype(jnp.float32)
  options = dict(scale=scale, sinks=None if sinks is None else jnp.asarray(sinks, jnp.float32),
                 soft_cap=soft_cap)
  attention = lambda q, k, v: einsum_attention(q, k, v, visible, **options)[0]
  (out, lse), = [einsum_attention(f32(q), f32(k), f32(v), visible, **options)]
  _, vjp = jax.vjp(attention, f32(q), f32(k), f32(v))
  return out.astype(q.dtype), lse, vjp(f32(dout))


def _check_einsum_case(case: Case, run_interpreted, config=None, *, scale=None, sinks=None,
                       soft_cap=None):
  """The kernels' gradients, given the f32 reference's out and lse (with
  `sinks`: the lse includes them), against that reference's gradients."""
  q, k, v, dout = case.backward_inputs()
  scale = 1.0 / math.sqrt(case.head_dim) if scale is None else scale
  out, lse, exact = _einsum_grads(case, q, k, v, dout, scale, sinks=sinks, soft_cap=soft_cap)
  grads = _kernel_grads(case, run_interpreted, q, k, v, out, lse, dout, scale, config, soft_cap)
  sees_no_key = ~case.visible().any(-1)[:, 0]  # [B, Tq]
  for name, got, reference in zip(("dq", "dk", "dv"), grads, exact):
    got, reference = np.asarray(got, np.float32), np.asarray(reference)
    assert np.isfinite(got).all(), name
    np.testing.assert_allclose(got, reference, atol=6e-2, rtol=5e-2, err_msg=name)
    rel = relative_error(got, reference)
    assert rel < (2e-2 if case.dtype == "bfloat16" else 5e-3), (name, rel)
  assert not np.asarray(grads[0], np.float32)[sees_no_key].any()  # exactly zero
  return grads


@pytest.mark.parametrize("name", list(SEGMENT_CASES))
def test_segment_ids_gradients_match_the_explicit_mask_without_races(name, run_interpreted):
  _check_einsum_case(SEGMENT_CASES[name], run_interpreted)


def test_segment_ids_with_xla_delta_and_loads_after_the_wait(run_interpreted):
  """The causal case again with the other choices of the heuristic: delta
  from XLA instead of the dQ kernel, lse and delta loaded after the wgmmas;
  and the dQ kernel with two consumers (another CTA tile)."""
  case = SEGMENT_CASES["packed_documents_causal_with_a_one_token_document"]
  config = sm90_backward.choose_config(case.head_dim, case.mask)
  config = dataclasses.replace(
      config, delta_in_dq=False, dkv=dataclasses.replace(config.dkv, stats_first=False),
      dq=dataclasses.replace(config.dq, num_consumers=2, producer_registers=40,
                             consumer_registers=232))
  _check_einsum_case(case, run_interpreted, config=config)


def test_a_work_queue_hands_every_key_tile_to_some_cta_once(run_interpreted):
  """The dK/dV kernel as a persistent grid with a work queue: three CTAs
  take 2 KV heads x 3 key tiles x 2 rows one tile at a time (the producer
  stores each next unit in an SMEM cell the next K/V barrier orders for the
  consumers, who stop at a unit past the end; each consumer releases its
  K/V copy once its dK/dV store has read it). Rows packed differently, with
  lengths, GQA, a one-token document. (The interpreter hands units out round
  robin; the atomic counter runs in tests/test_segments_on_gpu.py.)"""
  rows = (_packed([150, 100, 1, 49], 300), _packed([20, 280], 300))
  case = Case(batch=2, q_heads=4, kv_heads=2, head_dim=64, is_causal=True, q_seq=300,
              kv_seq=300, q_lengths=(300, 260), q_segment_ids=rows, kv_segment_ids=rows)
  config = sm90_backward.choose_config(64, case.mask, 2, segment_ids=True)
  assert config.dkv.work_queue
  config = dataclasses.replace(config, dkv=dataclasses.replace(config.dkv, num_sms=3))
  _check_einsum_case(case, run_interpreted, config=config)


def test_only_packed_causal_rows_at_head_dim_64_take_the_dk_dv_work_queue():
  """Measured: the queue gains at head dim 64 and loses at 128, whose queued
  consumer spills more (choose_config); dense packed rows, windows and calls
  without segment ids keep one CTA per key tile."""
  causal = MaskSpec(right=0)
  queued = lambda *args, **kwargs: sm90_backward.choose_config(*args, **kwargs).dkv.work_queue
  for group in (1, 4):
    assert queued(64, causal, group, segment_ids=True)
    assert not queued(128, causal, group, segment_ids=True)
  assert not queued(64, causal)
  assert not queued(64, MaskSpec(), segment_ids=True)
  assert not queued(64, MaskSpec(left=255, right=0), segment_ids=True)
  with pytest.raises(ValueError, match="work_queue is a choice of the 'fused'"):
    sm90_backward.DkvConfig(dk_dv="two_passes", work_queue=True)


def _walked(operands, band, cta: int, consumer: int | None = None, consumers: int = 1):
  """(lo, hi, full_lo, full_hi): the blocks a CTA (or one of its consumers)
  of a kernel walks: its band ranges intersected with its segment ranges
  from `segment_operands`, as the kernel does (`SegmentRefs`)."""
  if consumer is None:
    segment = np.asarray(operands[2])[0, cta]
  else:
    segment = np.asarray(operands[3])[0, cta * consumers + consumer]
  r = band.intersect(scores.TileRanges(*(jnp.int32(x) for x in segment)))
  return tuple(int(x) for x in (r.lo, r.hi, r.full_lo, r.full_hi))


def test_segment_ids_skip_the_blocks_of_other_documents():
  """Three documents of 192 tokens, no other mask: every dQ CTA (3 x 64 rows)
  walks the three key blocks of its document only (of 9), all without the
  element mask; a dK/dV CTA (2 x 64 keys) walks the query blocks of the
  documents its keys belong to, and each consumer only its own document's,
  unmasked."""
  total, mask = 576, MaskSpec()
  ids = jnp.asarray(packed_segment_ids([192, 192, 192], total))[None]
  config = sm90_backward.choose_config(64, mask)
  assert (config.dq.num_consumers, config.dq.block_q, config.dq.block_kv) == (3, 64, 64)
  assert (config.dkv.num_consumers, config.dkv.block_kv, config.dkv.block_q) == (2, 64, 64)
  dkv, dq = sm90_backward._kernel_segments((ids, ids), config, total, total)
  for cta in range(3):
    band = scores.kv_tile_ranges(mask, cta * 192, (cta + 1) * 192, total, total, 64)
    assert _walked(dq, band, cta) == (3 * cta, 3 * cta + 3) * 2
  # keys [0, 128) doc 0; [128, 256) docs 0 and 1; [256, 384) doc 1; then doc 2
  for cta, blocks in enumerate([(0, 3), (0, 6), (3, 6), (6, 9), (6, 9)]):
    band = scores.q_tile_ranges(mask, cta * 128, (cta + 1) * 128, total, total, 64)
    assert _walked(dkv, band, cta)[:2] == blocks, cta
    for i in range(2):
      k_lo = cta * 128 + i * 64
      own = scores.q_tile_ranges(mask, k_lo, k_lo + 64, total, total, 64)
      got = _walked(dkv, own, cta, i, consumers=2)
      if k_lo >= total:  # the last CTA's second consumer has no keys
        assert got[0] == got[1], got
      else:
        doc = k_lo // 192
        assert got == (3 * doc, 3 * doc + 3) * 2, (cta, i, got)


# --- logit soft-capping and sinks --------------------------------------------
# `soft_cap=`: the kernels recompute P from t = tanh(scale * s / cap) and
# multiply dS by the slope 1 - t^2. Sinks take no kernel argument: the lse
# the backward receives includes them. Both against the f32 einsum reference.


SOFT_CAP_AND_SINK_CASES = {
    "soft_cap_causal_gqa": (
        Case(q_heads=4, kv_heads=2, is_causal=True, q_seq=136, kv_seq=136),
        dict(soft_cap=2.0)),
    # The heuristic folds lse and delta into the accumulators here (causal,
    # GQA, head dim 128); under soft-cap only delta folds.
    "soft_cap_causal_gqa_head_dim_128_folds_only_delta": (
        Case(q_heads=4, kv_heads=2, head_dim=128, is_causal=True, q_seq=136, kv_seq=136),
        dict(soft_cap=2.0)),
    # Under soft-cap the heuristic folds delta at head dim 128 for causal
    # masks, windows included, also without GQA.
    "soft_cap_causal_window_head_dim_128_folds_only_delta": (
        Case(head_dim=128, is_causal=True, window=(40, 0), q_seq=104, kv_seq=104,
             kv_lengths=(70,)),
        dict(soft_cap=2.0)),
    # Keys [0, 30) of batch 0: its rows from 70 on see none (lse = sink);
    # batch 1's rows from 61 on are past the query length (lse = -inf).
    "sinks_and_soft_cap_fp16_head_dim_128_window_lengths_rows_without_keys": (
        Case(batch=2, dtype="float16", head_dim=128, q_heads=2, kv_heads=1, window=(40, 20),
             q_seq=104, kv_seq=136, q_lengths=(104, 61), kv_lengths=(30, 136)),
        dict(sinks=(1.0, -1.5), soft_cap=3.0)),
    "sinks_window_lengths_rows_without_keys": (
        Case(batch=2, q_heads=2, kv_heads=1, window=(40, 20), q_seq=104, kv_seq=136,
             q_lengths=(104, 61), kv_lengths=(30, 136)),
        dict(sinks=(0.5, -2.0))),
    # Logits of std 8 against a cap of 20 (slopes near 0), one sink far above
    # them (P of every key <= e^-10) and one far below.
    "large_sinks_and_logits_at_the_cap": (
        Case(q_heads=2, kv_heads=1, is_causal=True, q_seq=72, kv_seq=136),
        dict(sinks=(30.0, -30.0), soft_cap=20.0, scale=1.0)),
    "head_dim_256_soft_cap_sinks_gqa_consumers_split_the_head_dim": (
        Case(q_heads=2, kv_heads=1, head_dim=256, is_causal=True, q_seq=100, kv_seq=164),
        dict(sinks=(0.0, 2.0), soft_cap=2.0)),
    "head_dim_192_soft_cap_window_key_lengths_in_two_dk_dv_passes": (
        Case(batch=2, head_dim=192, window=(50, 10), q_seq=96, kv_seq=160,
             kv_lengths=(160, 90)),
        dict(soft_cap=2.0)),
}


@pytest.mark.parametrize("name", list(SOFT_CAP_AND_SINK_CASES))
def test_soft_cap_and_sinks_gradients_match_the_f32_reference_without_races(
    name, run_interpreted):
  case, options = SOFT_CAP_AND_SINK_CASES[name]
  _check_einsum_case(case, run_interpreted, **options)


def test_the_backward_kernels_take_soft_cap():
  """The backward module lists the feature a soft-capped call needs
  (`Scores.kernel_features`), which `fa4_jax.backends` checks before it
  passes the call's score function; the sm90 forward's support is its own.
  The score function holds only a positive Python number as its cap."""
  assert Scores(soft_cap=2.0).kernel_features() <= sm90_backward.FEATURES
  for bad in (0.0, -1.0, True, jnp.float32(2.0)):
    with pytest.raises(ValueError, match="soft-cap must be a float > 0"):
      ScoreFunction(0.125, bad)


# --- tile ranges -------------------------------------------------------------


def _brute_force_query_blocks(mask, k_lo, k_hi, q_len, kv_len, block):
  keys = np.arange(k_lo, k_hi)
  seen, full = [], []
  for b in range(0, math.ceil(max(q_len, 1) / block) + 2):
    rows = np.arange(b * block, (b + 1) * block)
    vis = np.asarray(mask.visible(rows[:, None], keys[None, :])) & (keys[None, :] < kv_len)
    vis_live = vis & (rows[:, None] < q_len)
    if vis_live.any():
      seen.append(b)
    if (vis | (rows[:, None] >= q_len)).all():  # rows past q_len need no mask
      full.append(b)
  return seen, full


@pytest.mark.parametrize("mask", [
    MaskSpec(), MaskSpec(right=0), MaskSpec(left=50, right=0), MaskSpec(left=7, right=30),
    MaskSpec(right=-5), MaskSpec(right=0, q_offset=70),
])
def test_query_tile_ranges_cover_every_visible_block_and_only_full_ones_skip_the_mask(mask):
  block = 16
  for k_lo, q_len, kv_len in itertools.product((0, 16, 48), (20, 64, 100), (0, 33, 64, 80)):
    k_hi = k_lo + 32
    r = scores.q_tile_ranges(mask, k_lo, k_hi, q_len, kv_len, block)
    lo, hi, full_lo, full_hi = (int(x) for x in (r.lo, r.hi, r.full_lo, r.full_hi))
    seen, full = _brute_force_query_blocks(mask, k_lo, k_hi, q_len, kv_len, block)
    assert set(seen) <= set(range(lo, hi)), (k_lo, q_len, kv_len)
    assert lo <= full_lo <= full_hi <= hi
    assert set(range(full_lo, full_hi)) <= set(full), (k_lo, q_len, kv_len)


# --- what the kernel accepts --------------------------------------------------


def test_head_dim_above_256_is_refused_with_a_reason():
  with pytest.raises(KernelUnsupported, match="head_dim"):
    sm90_backward.check_supported((1, 128, 1, 272), (1, 128, 1, 272), jnp.bfloat16, MaskSpec())


@pytest.mark.parametrize("head_dim,scheme", [
    (64, "fused"), (128, "fused"), (160, "two_passes"), (192, "two_passes"),
    (256, "head_dim_split")])
def test_dk_dv_scheme_keeps_accumulators_within_a_warpgroups_registers(head_dim, scheme):
  # 64 x head_dim fp32 for dK plus as much for dV fit one warpgroup up to
  # head dim 128; above, the head dim is split across the two consumers where
  # its halves fall on 64-column tiles, else dK and dV take separate passes.
  assert sm90_backward.choose_config(head_dim, MaskSpec()).dkv.dk_dv == scheme


def test_float32_is_refused():
  with pytest.raises(KernelUnsupported, match="dtype"):
    sm90_backward.check_supported((1, 128, 1, 64), (1, 128, 1, 64), jnp.float32, MaskSpec())


# --- configurations on hardware (cross-lowered) ------------------------------


@pytest.mark.parametrize("head_dim,config", sm90_backward.all_configs(),
                         ids=lambda x: str(x) if isinstance(x, int) else "")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_config_fits_smem_and_uses_wgmma_and_tma(head_dim, config, dtype, cross_lower):
  b, t, nq, nkv = 1, 509, 4, 2  # a ragged length: TMA needs 8-row-aligned arrays
  spec = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
  q = spec((b, t, nq, head_dim))
  kv = spec((b, t, nkv, head_dim))
  lse = spec((b, nq, t), jnp.float32)
  lengths = spec((b,), jnp.int32)

  def fn(q, k, v, out, lse, dout, q_len, kv_len):
    return sm90_backward.backward(q, k, v, out, lse, dout, q_len, kv_len,
                                  score=ScoreFunction(0.125), mask=MaskSpec(right=0),
                                  config=config)

  lowered = cross_lower(fn, q, kv, kv, q, lse, q, lengths, lengths)
  # dK/dV (one kernel, or a dK pass and a dV pass) and dQ
  assert len(lowered.smem_bytes) == (3 if config.dkv.dk_dv == "two_passes" else 2)
  assert lowered.max_smem_bytes <= SMEM_LIMIT_BYTES
  assert lowered.has("wgmma.mma_async")
  assert lowered.has("cp.async.bulk.tensor")
  _check_launch_chain(lowered.modules, config.overlap_kernels)


@pytest.mark.parametrize("head_dim,config", sm90_backward.all_configs(),
                         ids=lambda x: str(x) if isinstance(x, int) else "")
def test_every_config_with_segment_ids_fits_smem_and_uses_wgmma_and_tma(
    head_dim, config, cross_lower):
  b, t, s, nq, nkv = 2, 509, 389, 4, 2  # ragged lengths, T != S
  spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
  q = spec((b, t, nq, head_dim))
  kv = spec((b, s, nkv, head_dim))

  def fn(q, k, v, out, lse, dout, q_len, kv_len, q_ids, kv_ids):
    return sm90_backward.backward(q, k, v, out, lse, dout, q_len, kv_len,
                                  score=ScoreFunction(0.125), mask=MaskSpec(right=0),
                                  config=config,
                                  segment_ids=(q_ids, kv_ids))

  lowered = cross_lower(fn, q, kv, kv, q, spec((b, nq, t), jnp.float32), q,
                        spec((b,), jnp.int32), spec((b,), jnp.int32),
                        spec((b, t), jnp.int32), spec((b, s), jnp.int32))
  assert len(lowered.smem_bytes) == (3 if config.dkv.dk_dv == "two_passes" else 2)
  assert lowered.max_smem_bytes <= SMEM_LIMIT_BYTES
  assert lowered.has("wgmma.mma_async")
  assert lowered.has("cp.async.bulk.tensor")
  _check_launch_chain(lowered.modules, config.overlap_kernels)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_dk_dv_work_queue_lowers_with_one_atomic_and_vmap_lowers_it_without(
    head_dim, cross_lower):
  """The queued dK/dV kernel (two K/V copies per consumer and the queue's
  cells beside the segment ids' ring) fits the SMEM and takes units
  with a GMEM atomic. Under vmap Pallas adds a grid axis whose CTAs would
  share the one counter, so the vmapped call's kernel has none (fixed
  round-robin shares, the protocol the interpreter tests)."""
  mask = MaskSpec(right=0)
  # (At 128 the heuristic keeps one CTA per key tile; the queue must still fit.)
  config = sm90_backward.choose_config(head_dim, mask, 4, segment_ids=True)
  config = dataclasses.replace(config, dkv=dataclasses.replace(config.dkv, work_queue=True))
  b, t, nq, nkv = 2, 1024, 8, 2
  spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))

  def fn(q, k, v, out, lse, dout, ids):
    return sm90_backward.backward(q, k, v, out, lse, dout, None, None, score=ScoreFunction(0.125),
                                  mask=mask,
                                  config=config, segment_ids=(ids, ids))

  shapes = lambda *lead: (spec((*lead, b, t, nq, head_dim)), spec((*lead, b, t, nkv, head_dim)),
                          spec((*lead, b, t, nkv, head_dim)), spec((*lead, b, t, nq, head_dim)),
                          spec((*lead, b, nq, t), jnp.float32),
                          spec((*lead, b, t, nq, head_dim)), spec((*lead, b, t), jnp.int32))
  lowered = cross_lower(fn, *shapes())
  assert lowered.max_smem_bytes <= SMEM_LIMIT_BYTES
  assert lowered.has("wgmma.mma_async") and lowered.has("atom.relaxed.gpu.global.add")
  if head_dim != 128:
    return  # the vmapped kernel differs only by the grid: one head dim is enough
  vmapped = cross_lower(jax.vmap(fn), *shapes(3))
  assert vmapped.has("wgmma.mma_async") and not vmapped.has("atom.relaxed.gpu.global.add")


@pytest.mark.parametrize("head_dim,config", sm90_backward.all_configs(),
                         ids=lambda x: str(x) if isinstance(x, int) else "")
def test_every_config_with_soft_cap_fits_smem_and_uses_the_fast_tanh(
    head_dim, config, cross_lower):
  """Every kernel of the backward (dK/dV, or its two passes, and dQ)
  recomputes t with tanh.approx.f32 (`approx_math`)."""
  b, t, nq, nkv = 1, 509, 4, 2
  spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
  q, kv = spec((b, t, nq, head_dim)), spec((b, t, nkv, head_dim))

  def fn(q, k, v, out, lse, dout, q_len, kv_len):
    return sm90_backward.backward(q, k, v, out, lse, dout, q_len, kv_len,
                                  score=ScoreFunction(0.125, 30.0), mask=MaskSpec(right=0),
                                  config=config)

  lowered = cross_lower(fn, q, kv, kv, q, spec((b, nq, t), jnp.float32), q,
                        spec((b,), jnp.int32), spec((b,), jnp.int32))
  assert len(lowered.smem_bytes) == (3 if config.dkv.dk_dv == "two_passes" else 2)
  assert lowered.max_smem_bytes <= SMEM_LIMIT_BYTES
  assert lowered.has("wgmma.mma_async")
  assert all("tanh.approx.f32" in module for module in lowered.modules)
  _check_launch_chain(lowered.modules, config.overlap_kernels)


def _check_launch_chain(modules, overlapped: bool):
  """Overlapped kernels, in launch order: every one but the last lets the
  next launch early, every one but the first waits for the previous one
  (and is marked for the runtime to launch it programmatically)."""
  for i, module in enumerate(modules):
    releases = "griddepcontrol.launch_dependents" in module
    waits = "griddepcontrol.wait" in module
    assert releases == (overlapped and i < len(modules) - 1), i
    assert waits == (overlapped and i > 0), i
    assert ("mosaic_gpu.uses_pdl" in module) == waits, i


@pytest.mark.parametrize("head_dim", [128, 192])
def test_overlapped_kernels_chain_every_kernel_of_the_backward(head_dim, cross_lower):
  """Two kernels, and three (dK pass, dV pass, dQ) at head dim 192, where
  the heuristic does not overlap them."""
  config = dataclasses.replace(sm90_backward.choose_config(head_dim, MaskSpec()),
                               delta_in_dq=False, overlap_kernels=True)
  spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  q, kv = spec((1, 256, 2, head_dim)), spec((1, 256, 2, head_dim))

  def fn(q, k, v, out, lse, dout):
    return sm90_backward.backward(q, k, v, out, lse, dout, None, None,
                                  score=ScoreFunction(0.125), mask=MaskSpec(), config=config)

  lowered = cross_lower(fn, q, kv, kv, q, spec((1, 2, 256), jnp.float32), q)
  assert len(lowered.modules) == (3 if head_dim == 192 else 2)
  _check_launch_chain(lowered.modules, True)


def _wgmma_a_operands(module: str) -> tuple[int, int]:
  """(from registers, from SMEM): the A operands of a module's wgmma
  instructions. In the inline PTX the accumulator registers come first, then
  A as a register group `{$..}` or as an SMEM descriptor `$n`."""
  operands = re.findall(r"wgmma\.mma_async[^{]*\{[^}]*\}, (\{|\$)", module)
  return operands.count("{"), operands.count("$")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_head_dim_64_keeps_the_resident_tiles_in_registers_as_wgmma_operands(
    head_dim, cross_lower):
  """At head dim 64 the dK/dV kernel's K and V and the dQ kernel's Q and dO
  are wgmma A operands from registers (every wgmma then reads A from
  registers: P^T, dS^T and dS always do); at 128 they do not fit beside the
  accumulators, and S^T, dP^T, S and dP read both operands from SMEM."""
  spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  q, kv = spec((1, 256, 4, head_dim)), spec((1, 256, 2, head_dim))
  config = sm90_backward.choose_config(head_dim, MaskSpec())
  assert config.dkv.operands_in_registers == config.dq.operands_in_registers == (head_dim == 64)

  def fn(q, k, v, out, lse, dout):
    return sm90_backward.backward(q, k, v, out, lse, dout, None, None,
                                  score=ScoreFunction(0.125), mask=MaskSpec(), config=config)

  lowered = cross_lower(fn, q, kv, kv, q, spec((1, 4, 256), jnp.float32), q)
  assert len(lowered.modules) == 2
  for module in lowered.modules:
    from_registers, from_smem = _wgmma_a_operands(module)
    assert from_registers > 0
    assert (from_smem == 0) == (head_dim == 64), (from_registers, from_smem)


@pytest.mark.parametrize("head_dim,seq", [(32, 53), (96, 77)])
def test_padded_head_dims_and_ragged_lengths_lower_for_hardware(head_dim, seq, cross_lower):
  """Unaligned shapes are padded before the kernels (to 8 rows and 64
  columns, what TMA and the swizzle need): every operand, O included."""
  spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  q, kv = spec((2, seq, 4, head_dim)), spec((2, seq, 2, head_dim))

  def fn(q, k, v, out, lse, dout):
    return sm90_backward.backward(q, k, v, out, lse, dout, None, None, score=ScoreFunction(0.125),
                                  mask=MaskSpec())

  lowered = cross_lower(fn, q, kv, kv, q, spec((2, 4, seq), jnp.float32), q)
  assert lowered.max_smem_bytes <= SMEM_LIMIT_BYTES


# --- The barrier tables --------------------------------------------------------


def _dkv_pass(queued: bool):
  """A dK/dV pass with segment ids (the widest ring slot), queued or not."""
  cfg = sm90_backward.choose_config(128, MaskSpec()).dkv
  return sm90_backward_dkdv._DkvPass(cfg, MaskSpec(), jnp.bfloat16, 128, 128, ScoreFunction(0.1),
                                     1, ("dk", "dv"), False, True, queued=queued)


@pytest.mark.parametrize("table, plan", [
    ("DkvBarrierTable", lambda: _dkv_pass(queued=True)),  # the queued grid: every barrier
    ("HeadSplitBarrierTable", lambda: _dkv_pass(queued=False)),
    ("DqBarrierTable", lambda: sm90_backward_dq._DqKernel(
        sm90_backward.choose_config(128, MaskSpec()).dq, MaskSpec(), jnp.bfloat16, 128, 128,
        ScoreFunction(0.1), 1, 1, False, True)),
])
def test_barrier_table_lists_every_arrive_and_wait(table, plan, monkeypatch):
  """Every accessor of a backward kernel's barrier table (the only way its
  roles touch a barrier) appears in the row of the barrier it arrives on or
  waits on, on its declared side, and every barrier has both an arriving and
  a waiting side; the interpreter-only drains are named where they wait."""
  module = sm90_backward_dq if table == "DqBarrierTable" else sm90_backward_dkdv
  table_cls = getattr(module, table)
  drains = [m for m in dir(table_cls) if m.startswith("drain_")]
  barrier_tables.check_table(table_cls, lambda refs: table_cls(plan(), refs), module,
                             monkeypatch, indent=12, named_only=drains)
