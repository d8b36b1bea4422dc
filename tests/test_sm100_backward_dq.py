"""The Blackwell (sm_100) dQ kernel (fa4_jax/kernels/sm100_backward_dq.py), on the CPU.

* Interpretation: the kernel runs in Pallas' GPU interpreter with the race
  detector on (TMEM, SMEM, barriers and tcgen05 MMAs simulated). Its dQ must
  match jax.vjp of an f32 einsum attention under the explicit boolean mask
  (tests/reference.py), given lse2 and delta that `backward_inputs.preprocess`
  makes from that reference's out and lse, as the backward will. Rows that
  see no key get exactly zero, finite gradients.
* Determinism: two runs are bit-identical (every dQ element has one writer).
* Cross-lowering for sm_100: every tiling `choose_config` picks, under every mask
  kind, lowers with tcgen05 MMAs and TMEM loads, without wgmma, within the
  SMEM and TMEM budgets.
* The barrier table: every `DqBarrierTable` accessor is named in its docstring's
  table, and every barrier is both arrived on and waited on.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax.kernels import KernelUnsupported
from fa4_jax.kernels import sm100_backward_dq as dq_kernel
from fa4_jax.kernels.backward_inputs import preprocess
from fa4_jax.scores import MaskSpec, ScoreFunction, cdiv
from fa4_jax.scores import read_tile_ranges as _read_tile_ranges
from fa4_jax.testing import SMEM_LIMIT_BYTES, TMEM_COLUMNS
import barrier_tables
from reference import KernelCase, einsum_attention, packed_segment_ids, relative_error


@dataclasses.dataclass(frozen=True)
class Case(KernelCase):
  soft_cap: float | None = None
  # Bottom-right alignment by the lengths (`MaskSpec.offset_from_lengths`):
  # each batch row's last valid query sits on its last valid key.
  aligned_by_lengths: bool = False

  @property
  def mask(self) -> MaskSpec:
    return dataclasses.replace(super().mask, offset_from_lengths=self.aligned_by_lengths)

  def visible(self) -> np.ndarray:
    if not self.aligned_by_lengths:
      return super().visible()
    rows = []
    for i in range(self.batch):  # one offset per batch row: kv_len - q_len
      q_len = self.q_seq if self.q_lengths is None else self.q_lengths[i]
      kv_len = self.kv_seq if self.kv_lengths is None else self.kv_lengths[i]
      row = dataclasses.replace(self, batch=1, aligned_by_lengths=False,
                                q_offset=self.q_offset + kv_len - q_len,
                                q_lengths=(q_len,), kv_lengths=(kv_len,))
      rows.append(row.visible())
    return np.concatenate(rows)


def _reference(case: Case, q, k, v, dout, scale):
  """(out, lse, dq) of the f32 einsum attention under the explicit mask."""
  f32 = lambda x: x.astype(jnp.float32)
  visible = case.visible()
  attend = lambda q: einsum_attention(q, f32(k), f32(v), visible, scale=scale,
                                      soft_cap=case.soft_cap)
  (out, lse), vjp = jax.vjp(attend, f32(q))
  (dq,) = vjp((f32(dout), jnp.zeros_like(lse)))
  return out, lse, dq


def _kernel_dq(case: Case, q, k, v, dout, out, lse, scale, run, runs: int = 1):
  """The kernel's dQ, its inputs prepared as the sm100 backward will (a
  list of `runs` results when runs > 1)."""
  q_len, kv_len = case.lengths()
  b, tq, nq, d = q.shape
  tk, nkv = k.shape[1], k.shape[2]
  q_pad, kv_pad = cdiv(tq, 8) * 8, cdiv(tk, 8) * 8
  tiles = dq_kernel.choose_config(d, q.dtype)
  lse2, delta = preprocess(out, lse, dout, q_len, q_pad)
  pad = lambda x, t: jnp.pad(x, [(0, 0), (0, t - x.shape[1]), (0, 0), (0, 0)])
  lengths = [x for x in (q_len, kv_len) if x is not None]
  segments = []
  if case.segment_ids() is not None:
    segments = dq_kernel.dq_segment_operands(*case.segment_ids(), tiles, q_pad)
  kernel = lambda: dq_kernel.build_dq_kernel(
      batch=b, q_seq=q_pad, kv_seq=kv_pad, kv_valid=tk, num_q_heads=nq, num_kv_heads=nkv,
      head_dim=d, dtype=q.dtype, score=ScoreFunction(scale, case.soft_cap),
      mask=case.mask, block_kv=tiles.block_kv,
      block_q=tiles.block_q, num_stages=tiles.num_stages, has_q_lengths=q_len is not None,
      has_kv_lengths=kv_len is not None, has_segments=bool(segments))
  args = (pad(q, q_pad), pad(k, kv_pad), pad(v, kv_pad), pad(dout, q_pad), lse2, delta,
          *lengths, *segments)
  results = run(lambda *a: [kernel()(*a) for _ in range(runs)], *args)
  for dq in results:
    assert dq.shape == (b, q_pad, nq, d) and dq.dtype == q.dtype
  results = [dq[:, :tq] for dq in results]
  return results if runs > 1 else results[0]


def _check(case: Case, run_interpreted):
  q, k, v, dout = case.backward_inputs()
  scale = 1.0 / math.sqrt(case.head_dim)
  out, lse, expected = _reference(case, q, k, v, dout, scale)
  got = np.asarray(_kernel_dq(case, q, k, v, dout, out, lse, scale, run_interpreted), np.float32)
  expected = np.asarray(expected)
  assert np.isfinite(got).all()
  # Rows that see no key (past q_lengths, or every key masked): exactly 0.
  dead = ~case.visible().any(-1)[:, 0, :]  # [B, Tq]
  np.testing.assert_array_equal(got[dead], 0.0)
  # bf16/fp16 operands of the GEMMs against an f32 reference: the error
  # relative to the gradient's overall size (as the sm90 backward's tests).
  rel = relative_error(got, expected)
  assert rel < (2e-2 if case.dtype == "bfloat16" else 5e-3), rel
  np.testing.assert_allclose(got, expected, atol=5e-2 * np.abs(expected).max(), rtol=5e-2)
  return got


_DOCS = packed_segment_ids
_ids = lambda *rows: tuple(tuple(int(x) for x in r) for r in rows)

# Small cases (the interpreter takes seconds per call), several features each.
CASES = {
    # Step 1: no mask, two Q tiles, many key blocks (both score buffers, the
    # K/V ring wraps), ragged tails left to TMA.
    "dense_head_dim_64": Case(q_seq=256, kv_seq=320),
    "dense_head_dim_128_ragged_tails": Case(head_dim=128, q_seq=200, kv_seq=136),
    # Step 2: causal (heavy tiles first, blocks above the diagonal skipped,
    # the element mask on the diagonal blocks only), GQA.
    "causal_gqa": Case(is_causal=True, q_seq=256, kv_seq=256, q_heads=2, kv_heads=1),
    # Bottom-right alignment by a fixed offset (the last query on the last key).
    "mqa_head_dim_128_causal_bottom_right": Case(
        head_dim=128, is_causal=True, q_seq=72, kv_seq=200, q_heads=3, kv_heads=1, q_offset=128),
    # Lengths: rows past q_len and a batch row with no keys at all (zero,
    # finite dQ; its CTAs walk nothing and store zeros).
    "lengths_rows_that_see_no_key": Case(
        batch=2, is_causal=True, q_seq=136, kv_seq=136, q_lengths=(100, 136),
        kv_lengths=(136, 0)),
    # Bottom-right alignment by each row's lengths (chunked prefill), with a window.
    "window_aligned_by_lengths": Case(
        batch=2, is_causal=True, window=(48, 0), q_seq=136, kv_seq=264, q_lengths=(136, 40),
        kv_lengths=(264, 200), aligned_by_lengths=True),
    # Step 3: a two-sided window skips far key blocks on both sides; fp16.
    "float16_two_sided_window": Case(dtype="float16", window=(40, 20), q_seq=200, kv_seq=330),
    "head_dim_128_causal_window_soft_cap": Case(
        head_dim=128, is_causal=True, window=(100, 0), q_seq=256, kv_seq=256, soft_cap=2.0),
    # Segment ids: documents packed one after the other (tiles skipped, one-id
    # blocks unmasked), GQA; an id the keys lack (rows that see no key).
    "segments_packed_causal_gqa": Case(
        is_causal=True, q_seq=256, kv_seq=256, q_heads=2, kv_heads=1,
        q_segment_ids=_ids(_DOCS([100, 60, 96], 256)),
        kv_segment_ids=_ids(_DOCS([100, 60, 96], 256))),
    "segments_interleaved_and_absent_ids_lengths": Case(
        batch=2, q_seq=128, kv_seq=136, q_lengths=(128, 100), kv_lengths=(100, 136),
        q_segment_ids=_ids(np.arange(128) % 3, np.r_[np.zeros(70), np.full(58, 5)]),
        kv_segment_ids=_ids(np.arange(136) // 2 % 3, np.zeros(136))),
    # head_dim 256: dQ takes half the TMEM; one K/V stage, one score buffer.
    "head_dim_256_causal_ragged": Case(head_dim=256, is_causal=True, q_seq=136, kv_seq=100),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dq_matches_the_f32_reference_without_races(name, run_interpreted):
  _check(CASES[name], run_interpreted)


def test_two_runs_are_bit_identical(run_interpreted):
  """Every dQ element is written by one CTA from one sequence of MMAs."""
  case = Case(is_causal=True, q_seq=128, kv_seq=192)
  q, k, v, dout = case.backward_inputs(seed=1)
  scale = 1.0 / math.sqrt(case.head_dim)
  out, lse, _ = _reference(case, q, k, v, dout, scale)
  first, second = _kernel_dq(case, q, k, v, dout, out, lse, scale, run_interpreted, runs=2)
  np.testing.assert_array_equal(np.asarray(first), np.asarray(second))


# --- The walk: blocks skipped, element masks only on boundary blocks -------------


def test_a_sliding_window_walks_only_the_blocks_of_its_band():
  """Rows [1024, 1152) under a causal 300-key window see keys [724, 1152]:
  blocks 11-17 of 64 keys; the blocks before and after are never loaded.
  Blocks 14 and 15 (keys 896-1023) are seen whole by every row (the last
  row sees keys >= 851, the first keys <= 1024): no element mask there."""
  tiles = dq_kernel.choose_config(128, jnp.bfloat16)
  mask = MaskSpec(left=300, right=0)
  r = dq_kernel.tile_key_blocks(mask, tiles, 1024, 4096, 4096)
  assert (int(r.lo), int(r.hi), int(r.full_lo), int(r.full_hi)) == (11, 18, 14, 16)
  # Bottom-right by the lengths: the same rows of a 2048-query row over
  # 3072 keys sit 1024 positions later.
  aligned = MaskSpec(left=300, right=0, offset_from_lengths=True)
  r = dq_kernel.tile_key_blocks(aligned, tiles, 1024, 2048, 3072)
  assert (int(r.lo), int(r.hi), int(r.full_lo), int(r.full_hi)) == (27, 34, 30, 32)


def scores_read(operand, tile):
  """One tile's segment ranges from a `tile_ranges_operand` (batch row 0)."""
  return _read_tile_ranges(operand, 0, tile)


def test_segment_ids_narrow_the_walk():
  """Documents of 300 and 724 tokens, causal: the tile of rows [384, 512)
  (second document) walks blocks 4-7 (keys 256-511: the first block holds
  both ids) instead of 0-7. Blocks 5 on hold only its id; of them only
  block 5 (keys 320-383) is seen whole by the tile's first row: the one
  block without an element mask."""
  tiles = dq_kernel.choose_config(64, jnp.bfloat16)
  ids = jnp.asarray(_DOCS([300, 724], 1024))[None]
  ops = dq_kernel.dq_segment_operands(ids, ids, tiles, 1024)
  seg = scores_read(ops[2], 3)
  r = dq_kernel.tile_key_blocks(MaskSpec(right=0), tiles, 384, 1024, 1024, seg)
  assert (int(r.lo), int(r.hi), int(r.full_lo), int(r.full_hi)) == (4, 8, 5, 6)


# --- Tiling: TMEM and SMEM plans, cross-lowering for sm_100 -------------------


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_tiles_fit_tmem_and_smem(head_dim, dtype):
  tiles = dq_kernel.choose_config(head_dim, dtype)
  plan = tiles.tmem_plan()
  assert plan["dQ"] == head_dim  # the accumulator lives in TMEM for the whole walk
  assert tiles.tmem_columns() == head_dim + 2 * tiles.score_buffers * tiles.block_kv
  assert tiles.tmem_columns() <= TMEM_COLUMNS
  assert tiles.smem_bytes() <= SMEM_LIMIT_BYTES
  # Block n+1's MMAs overlap dS_n, except at 256 where one K/V stage fits.
  assert tiles.score_buffers == (1 if head_dim == 256 else 2)
  assert tiles.num_stages >= tiles.score_buffers


def test_plans_beyond_the_budgets_are_refused():
  # 128-key blocks at head dim 256: 256 + 4 * 128 = 768 TMEM columns.
  with pytest.raises(KernelUnsupported, match="TMEM plan"):
    dq_kernel.DqTiles(256, jnp.dtype(jnp.bfloat16), block_kv=128, num_stages=2).check_budgets()
  # 64-key blocks at 256 fit TMEM (512) but not SMEM with two stages.
  with pytest.raises(KernelUnsupported, match="SMEM plan"):
    dq_kernel.DqTiles(256, jnp.dtype(jnp.bfloat16), block_kv=64, num_stages=2).check_budgets()
  # One stage, two score buffers: the MMA warp would wait for itself.
  with pytest.raises(KernelUnsupported, match="as many K/V stages"):
    dq_kernel.DqTiles(256, jnp.dtype(jnp.bfloat16), block_kv=64, num_stages=1).check_budgets()
  # dQ += dS K has K = block_kv: Mosaic GPU issues it in groups of 64.
  with pytest.raises(KernelUnsupported, match="multiple of 64"):
    dq_kernel.DqTiles(256, jnp.dtype(jnp.bfloat16), block_kv=32, num_stages=2).check_budgets()
  with pytest.raises(KernelUnsupported, match="head_dim must be one of"):
    dq_kernel.choose_config(96, jnp.bfloat16)


def _lower(cross_lower, head_dim, *, mask=MaskSpec(), lengths=False, segments=False,
           soft_cap=None, b=2, tq=1024, tk=1024, nq=4, nkv=2):
  tiles = dq_kernel.choose_config(head_dim, jnp.bfloat16)
  q = jax.ShapeDtypeStruct((b, tq, nq, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, tk, nkv, head_dim), jnp.bfloat16)
  stats = jax.ShapeDtypeStruct((b, nq, tq), jnp.float32)
  extra = [jax.ShapeDtypeStruct((b,), jnp.int32)] * (2 if lengths else 0)
  if segments:
    num_ctas = cdiv(tq, tiles.block_q)
    extra += [jax.ShapeDtypeStruct((b, num_ctas * tiles.block_q), jnp.int32),
              jax.ShapeDtypeStruct((b, cdiv(tk, tiles.block_kv) * tiles.block_kv), jnp.int32),
              jax.ShapeDtypeStruct((b, num_ctas, 4), jnp.int32)]
  kernel = dq_kernel.build_dq_kernel(
      batch=b, q_seq=tq, kv_seq=tk, kv_valid=tk, num_q_heads=nq, num_kv_heads=nkv,
      head_dim=head_dim, dtype=jnp.bfloat16, score=ScoreFunction(0.1, soft_cap),
      mask=mask, block_kv=tiles.block_kv,
      block_q=tiles.block_q, num_stages=tiles.num_stages, has_q_lengths=lengths,
      has_kv_lengths=lengths, has_segments=segments)
  return tiles, cross_lower(kernel, q, kv, kv, q, stats, stats, *extra, arch="sm_100")


MASK_VARIANTS = {
    "dense": dict(),
    "causal_window_lengths_aligned_segments_soft_cap": dict(
        mask=MaskSpec(left=256, right=0, offset_from_lengths=True), lengths=True,
        segments=True, soft_cap=30.0),
}


@pytest.mark.parametrize("variant", list(MASK_VARIANTS))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cross_lowers_for_sm100_with_tcgen05_and_tmem(head_dim, variant, cross_lower):
  tiles, lowered = _lower(cross_lower, head_dim, **MASK_VARIANTS[variant])
  assert len(lowered.modules) == 1
  for instruction in ("tcgen05.mma.cta_group::1.kind::f16", "tcgen05.ld", "tcgen05.st",
                      "tcgen05.alloc", "tcgen05.commit", "cp.async.bulk.tensor",
                      "mbarrier.try_wait.parity"):
    assert lowered.has(instruction), instruction
  assert not lowered.has("wgmma")
  # dQ += dS K reads dS from TMEM (A operand "[a_desc]", a TMEM address).
  assert lowered.has("kind::f16 [$0], [a_desc]")
  # The SMEM the kernel really allocates is within the plan, and the plan
  # within the SM's.
  assert 0 < lowered.max_smem_bytes <= tiles.smem_bytes() <= SMEM_LIMIT_BYTES
  # Two compute warpgroups (one per score buffer) take the registers the
  # load/MMA warpgroup gives up; with one, every thread may use 255.
  assert lowered.has(f"setmaxnreg.inc.sync.aligned.u32 {dq_kernel.COMPUTE_REGISTERS}") == (
      tiles.score_buffers == 2)
  # The TMEM ref spans exactly the planned columns.
  module = lowered.modules[0]
  assert re.findall(r"memref<128x(\d+)xi32, #mosaic_gpu.tmem", module)[0] == str(
      tiles.tmem_columns())


def test_mma_issue_counts_are_the_cost_model(cross_lower):
  """The module docstring's MMA instructions per key block, read off the
  lowering at head dim 128: S and dP (A = Q, dO from SMEM) are issued at
  three sites (the first block before the loop, then one per score buffer),
  dQ += dS K (A = dS from TMEM) at one site per score buffer."""
  tiles, lowered = _lower(cross_lower, 128)
  counts = tiles.mma_instructions_per_block()
  assert counts == {"S": 8, "dP": 8, "dQ": 4}
  module = lowered.modules[0]
  buffers = tiles.score_buffers
  assert module.count("kind::f16 [$0], [a_desc]") == buffers * counts["dQ"]
  assert module.count("kind::f16 [$0], a_desc") == (buffers + 1) * (counts["S"] + counts["dP"])


def test_stats_must_cover_whole_tiles():
  kernel = dq_kernel.build_dq_kernel(
      batch=1, q_seq=136, kv_seq=128, kv_valid=128, num_q_heads=1, num_kv_heads=1, head_dim=64,
      dtype=jnp.bfloat16, score=ScoreFunction(0.1), mask=MaskSpec(), block_kv=64, block_q=128,
      num_stages=3, has_q_lengths=False, has_kv_lengths=False)
  q = jnp.zeros((1, 136, 1, 64), jnp.bfloat16)
  kv = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
  short = jnp.zeros((1, 1, 136), jnp.float32)
  with pytest.raises(ValueError, match="whole 128-row tiles"):
    jax.eval_shape(kernel, q, kv, kv, q, short, short)


# --- The barrier table ---------------------------------------------------------


def test_barrier_table_lists_every_arrive_and_wait(monkeypatch):
  """Every DqBarrierTable accessor (the only way the roles touch a barrier)
  appears in the row of the barrier it arrives on or waits on, and every
  barrier has both an arriving and a waiting side; the interpreter-only
  drains are named where they wait."""
  barrier_tables.check_table(
      dq_kernel.DqBarrierTable,
      lambda refs: dq_kernel.DqBarrierTable(dq_kernel.choose_config(64, jnp.bfloat16), refs),
      dq_kernel, monkeypatch, indent=12, named_only=("drain_kv_rings", "drain_dq"))
