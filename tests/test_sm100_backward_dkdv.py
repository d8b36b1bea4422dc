"""The dK/dV kernel of the Blackwell (sm_100) backward, checked without a GPU.

* Interpretation with the race detector on: dK and dV match the gradients of
  an f32 einsum attention (`reference.einsum_attention`, differentiated by
  jax.vjp) with the mask built the naive way, within bf16 tolerance: every
  mask the kernel walks (causal, windows, lengths, bottom-right alignment,
  segment ids), GQA / MQA (dK, dV summed over the group), soft-cap, fp16;
  keys no query sees get exact zeros; two runs are bit-identical.
* Cross-lowering for sm_100 of every tiling `choose_config` picks, under each
  kind of mask: tcgen05 MMAs and TMEM loads / stores, no wgmma, within the
  SMEM budget; the TMEM plan is checked in code.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import barrier_tables
import reference
from fa4_jax.kernels import KernelUnsupported
from fa4_jax.kernels import sm100_backward_dkdv as dkdv
from fa4_jax.kernels.backward_inputs import preprocess
from fa4_jax.scores import MaskSpec, ScoreFunction, cdiv

# bf16 inputs; P^T and dS^T are rounded to 16 bits before their MMAs (as in
# every FlashAttention backward): gradients of size ~1 agree to ~1e-2.
GRAD_TOL = 2e-2


@dataclasses.dataclass(frozen=True)
class DkvCase(reference.KernelCase):
  q_seq: int = 256
  kv_seq: int = 256
  soft_cap: float | None = None
  # Bottom-right alignment by the lengths (MaskSpec.offset_from_lengths).
  bottom_right: bool = False

  @property
  def mask(self) -> MaskSpec:
    mask = super().mask
    return dataclasses.replace(mask, offset_from_lengths=True) if self.bottom_right else mask

  def visible(self) -> np.ndarray:
    if not self.bottom_right:
      return super().visible()
    # Each batch row's last valid query sits on its last valid key.
    ql = self.q_lengths or (self.q_seq,) * self.batch
    kl = self.kv_lengths or (self.kv_seq,) * self.batch
    rows = [reference.visible_mask(self.q_seq, self.kv_seq, is_causal=self.is_causal,
                                   window=self.window, q_lengths=(ql[i],), kv_lengths=(kl[i],),
                                   q_offset=kl[i] - ql[i])
            for i in range(self.batch)]
    return np.concatenate(rows, axis=0)


def _inputs(case: DkvCase, seed=0):
  b, t, s, n, nkv, d = (case.batch, case.q_seq, case.kv_seq, case.q_heads, case.kv_heads,
                        case.head_dim)
  kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (b, t, n, d), jnp.float32)
  k = jax.random.normal(kk, (b, s, nkv, d), jnp.float32)
  v = jax.random.normal(kv, (b, s, nkv, d), jnp.float32)
  do = jax.random.normal(kd, (b, t, n, d), jnp.float32)
  return tuple(x.astype(case.dtype) for x in (q, k, v, do))


def _reference(case: DkvCase, q, k, v, do, scale):
  """(out, lse, dk, dv) of f32 einsum attention on the upcast inputs."""
  def attention(q, k, v):
    return reference.einsum_attention(q, k, v, case.visible(), scale=scale,
                                      soft_cap=case.soft_cap)

  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  (out, lse), vjp = jax.vjp(attention, *f32)
  _, dk, dv = vjp((do.astype(jnp.float32), jnp.zeros_like(lse)))
  return out, lse, dk, dv


def _kernel_dk_dv(case: DkvCase, q, k, v, do, out, lse, scale):
  """dK, dV from the kernel, with its operands prepared as the backward's
  entry point prepares them (sequences padded to multiples of 8, lse2 and
  delta from `backward_inputs.preprocess`, segment operands of this tiling)."""
  tiles = dkdv.choose_config(case.head_dim, case.dtype)
  b, t, n, d = q.shape
  s, nkv = k.shape[1], k.shape[2]
  q_pad, kv_pad = cdiv(t, 8) * 8, cdiv(s, 8) * 8
  ql, kl = case.lengths()
  lse2, delta = preprocess(out, lse, do, ql, q_pad)
  pad = lambda x, to: jnp.pad(x, [(0, 0), (0, to - x.shape[1]), (0, 0), (0, 0)])
  operands = [pad(q, q_pad), pad(k, kv_pad), pad(v, kv_pad), pad(do, q_pad), lse2, delta]
  operands += [x for x in (ql, kl) if x is not None]
  if case.segment_ids() is not None:
    operands += dkdv.dkv_segment_operands(*case.segment_ids(), tiles, kv_pad)
  kernel = dkdv.build_dkv_kernel(
      batch=b, q_seq=q_pad, kv_seq=kv_pad, kv_valid=s, num_q_heads=n, num_kv_heads=nkv,
      head_dim=d, dtype=jnp.dtype(case.dtype), score=ScoreFunction(scale, case.soft_cap),
      mask=case.mask,
      block_kv=tiles.block_kv, block_q=tiles.block_q, num_stages=tiles.num_stages,
      has_q_lengths=ql is not None, has_kv_lengths=kl is not None,
      has_segments=case.segment_ids() is not None)
  dk, dv = kernel(*operands)
  return dk[:, :s], dv[:, :s]


def _run(case: DkvCase, run_interpreted, seed=0):
  q, k, v, do = _inputs(case, seed)
  scale = 1.0 / np.sqrt(case.head_dim)
  out, lse, dk_ref, dv_ref = _reference(case, q, k, v, do, scale)
  dk, dv = run_interpreted(
      lambda *args: _kernel_dk_dv(case, *args, scale=scale), q, k, v, do, out, lse)
  return (dk, dv), (dk_ref, dv_ref)


def _assert_close(got, expected):
  for name, g, e in zip(("dk", "dv"), got, expected):
    g = np.asarray(g, np.float32)
    assert np.isfinite(g).all(), name
    np.testing.assert_allclose(g, np.asarray(e), atol=GRAD_TOL, rtol=GRAD_TOL, err_msg=name)


_DOCS = reference.packed_segment_ids


def _ids(*rows):
  return tuple(tuple(int(x) for x in r) for r in rows)


CASES = {
    # --- no mask ---
    "dense_d128": DkvCase(head_dim=128),
    # D64, three query heads per kv head: dK, dV summed over the group.
    "mqa_d64": DkvCase(q_seq=128, kv_seq=128, q_heads=3, kv_heads=1),
    # --- causal, lengths, GQA, alignment ---
    # Two key tiles: tile 0 walks both query blocks (block 0 masked), tile 1
    # only block 1 (block 0 skipped); ragged extents (padded to 8 rows; the
    # last key tile and query block run past the arrays).
    "causal_ragged_tails": DkvCase(q_seq=136, kv_seq=200, is_causal=True),
    # Row 0: queries past 100 and keys past 77 do not count; row 1: no query
    # at all (its CTAs walk nothing and write zeros).
    "lengths_and_keys_nobody_sees": DkvCase(
        batch=2, is_causal=True, q_lengths=(100, 0), kv_lengths=(77, 256)),
    # Fewer queries than keys, each batch row's last valid query on its last
    # valid key; two query heads per kv head.
    "bottom_right_causal_lengths_gqa": DkvCase(
        batch=2, q_seq=128, kv_seq=256, q_heads=2, kv_heads=1, is_causal=True,
        bottom_right=True, q_lengths=(100, 128), kv_lengths=(256, 150)),
    # --- windows, segment ids, soft-cap, fp16 ---
    # Head dim 192 (64-row query blocks, TMEM full): a key tile sees up to
    # four of the six query blocks, none whole (diagonal or window edge).
    "causal_sliding_window_d192": DkvCase(q_seq=384, kv_seq=384, head_dim=192, is_causal=True,
                                          window=(100, 0)),
    # Key tile 0 is one document (its query blocks need no element mask past
    # the diagonal); tile 2 skips the blocks of the first document.
    "segments_packed_causal": DkvCase(
        q_seq=384, kv_seq=384, is_causal=True,
        q_segment_ids=_ids(_DOCS([256, 100, 28], 384)),
        kv_segment_ids=_ids(_DOCS([256, 100, 28], 384))),
    # Ids that change every few positions: every block needs the element mask.
    "segments_interleaved_gqa_lengths": DkvCase(
        q_seq=256, kv_seq=200, q_heads=2, kv_heads=1, kv_lengths=(180,),
        q_segment_ids=_ids(np.arange(256) % 3), kv_segment_ids=_ids(np.arange(200) // 2 % 3)),
    "soft_cap_causal_gqa": DkvCase(q_seq=128, q_heads=2, kv_heads=1, is_causal=True,
                                   soft_cap=5.0),
    # A window on both sides of the diagonal.
    "float16_d128_window": DkvCase(head_dim=128, dtype="float16", window=(100, 100)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dk_dv_match_the_f32_reference_without_races(name, run_interpreted):
  case = CASES[name]
  (dk, dv), expected = _run(case, run_interpreted)
  assert dk.dtype == dv.dtype == jnp.dtype(case.dtype)
  _assert_close((dk, dv), expected)
  # Keys that no query sees (past kv_lengths, or in a batch row without
  # queries) get exact zeros, not merely small values.
  seen = case.visible().any(axis=2)[:, 0]  # [B, Tk]
  for g in (dk, dv):
    g = np.asarray(g, np.float32).transpose(0, 1, 3, 2)  # [B, Tk, D, Nkv]
    assert (g[~seen] == 0).all()
    assert (np.abs(g[seen]) > 0).any()


def test_two_runs_are_bit_identical(run_interpreted):
  case = DkvCase(q_seq=128, kv_seq=128, q_heads=2, kv_heads=1, is_causal=True)
  first, _ = _run(case, run_interpreted)
  second, _ = _run(case, run_interpreted)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# --- the static plan ----------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 128, 192])
def test_tmem_plan_is_dk_dv_and_two_score_tiles(head_dim):
  tiles = dkdv.choose_config(head_dim, jnp.bfloat16)
  assert tiles.tmem_columns() == 2 * head_dim + 2 * tiles.block_q <= dkdv.TMEM_COLUMNS
  assert tiles.smem_bytes() <= dkdv.SMEM_BYTES
  assert tiles.mma_issues_per_block() == 4


def test_head_dim_256_is_refused_because_dk_and_dv_fill_tmem():
  with pytest.raises(KernelUnsupported, match="does not fit TMEM"):
    dkdv.choose_config(256, jnp.bfloat16)


def test_budgets_are_asserted():
  with pytest.raises(AssertionError, match="TMEM plan"):
    dkdv.DkvTiles(192, jnp.dtype(jnp.bfloat16), block_q=128, num_stages=1).check_budgets()
  with pytest.raises(AssertionError, match="SMEM plan"):
    dkdv.DkvTiles(128, jnp.dtype(jnp.bfloat16), block_q=128, num_stages=3).check_budgets()


def test_barrier_table_lists_every_arrive_and_wait(monkeypatch):
  """Every DkvBarrierTable accessor (the only way the roles touch a barrier)
  appears in the row of the barrier it arrives on or waits on, on its
  declared side, and every barrier has both an arriving and a waiting side."""
  def make_bars(refs):
    bars = dkdv.DkvBarrierTable(dkdv.choose_config(64, jnp.bfloat16), refs)
    bars._interpreting = True  # the interpreter's drains wait too
    return bars

  barrier_tables.check_table(dkdv.DkvBarrierTable, make_bars, dkdv, monkeypatch, indent=12,
                             skip=("drain_ring",))  # a pl.loop


# --- cross-lowering -------------------------------------------------------------

# The tiling depends on the head dim only; the masks decide which code the
# compute warpgroup holds (element mask, lengths, ids, tanh).
_MASKS = {
    "bottom_right_window_lengths": dict(
        mask=MaskSpec(left=256, right=0, offset_from_lengths=True), lengths=True),
    "causal_segments_soft_cap": dict(mask=MaskSpec(right=0), segments=True, soft_cap=30.0),
}


@pytest.mark.parametrize("mask_name", list(_MASKS))
@pytest.mark.parametrize("head_dim", [64, 128, 192])
def test_every_tiling_lowers_for_sm100_with_tcgen05_and_fits_smem(head_dim, mask_name,
                                                                   cross_lower):
  options = _MASKS[mask_name]
  tiles = dkdv.choose_config(head_dim, jnp.bfloat16)
  b, t, s, n, nkv = 2, 304, 1032, 4, 2
  kernel = dkdv.build_dkv_kernel(
      batch=b, q_seq=t, kv_seq=s, kv_valid=1030, num_q_heads=n, num_kv_heads=nkv,
      head_dim=head_dim, dtype=jnp.dtype(jnp.bfloat16),
      score=ScoreFunction(0.1, options.get("soft_cap")), mask=options["mask"],
      block_kv=tiles.block_kv, block_q=tiles.block_q, num_stages=tiles.num_stages,
      has_q_lengths=options.get("lengths", False), has_kv_lengths=options.get("lengths", False),
      has_segments=options.get("segments", False))
  spec = jax.ShapeDtypeStruct
  stats = spec((b, n, cdiv(t, 128) * 128), jnp.float32)
  specs = [spec((b, t, n, head_dim), jnp.bfloat16), spec((b, s, nkv, head_dim), jnp.bfloat16),
           spec((b, s, nkv, head_dim), jnp.bfloat16), spec((b, t, n, head_dim), jnp.bfloat16),
           stats, stats]
  if options.get("lengths"):
    specs += [spec((b,), jnp.int32)] * 2
  if options.get("segments"):
    num_ctas = cdiv(s, tiles.block_kv)
    specs += [spec((b, cdiv(t, tiles.block_q) * tiles.block_q), jnp.int32),
              spec((b, num_ctas * tiles.block_kv), jnp.int32),
              spec((b, num_ctas, 4), jnp.int32)]
  lowered = cross_lower(kernel, *specs, arch="sm_100")
  assert len(lowered.modules) == 1
  for instruction in ("tcgen05.mma.cta_group::1.kind::f16", "tcgen05.ld", "tcgen05.st"):
    assert lowered.has(instruction), instruction
  assert not lowered.has("wgmma")
  assert 0 < lowered.max_smem_bytes <= dkdv.SMEM_BYTES
  assert lowered.max_smem_bytes <= tiles.smem_bytes()
