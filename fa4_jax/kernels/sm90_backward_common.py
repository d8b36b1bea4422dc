"""What the sm90 backward kernels share: the launch, the softmax and
gradient of one tile, and the wgmma helpers (each kernel declares its own
barrier table). Their GMEM inputs and the walk over a key tile's blocks, which
the sm100 backward shares too, are in `backward_walk`.

The dK/dV kernels (`sm90_backward_dkdv`) own key tiles and compute scores
transposed ([keys, queries]); the dQ kernel (`sm90_backward_dq`) owns query
rows. Both read tile ranges and the element mask from `fa4_jax.scores`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fa4_jax.interpret import is_interpreting
from fa4_jax.kernels import compile_ahead
from fa4_jax.kernels.mod_tiles import (BlockList, ModRefs, ModStatics,  # noqa: F401 (shared)
                                      TileMods, folds_affine, walk_block_list)
from fa4_jax.kernels.sm90_tiles import mod_positions, where_visible
from fa4_jax.scores import MaskSpec, ScoreFunction


# --- what every kernel knows before tracing, and its launch ------------------


@dataclasses.dataclass(frozen=True)
class BackwardStatics:
  """What every backward kernel knows about its call before tracing."""

  cfg: Any  # the kernel's own: a DkvConfig (dK/dV kernels) or a DqConfig
  mask: MaskSpec
  dtype: Any
  head_dim: int  # Q's, K's, dQ's and dK's
  value_head_dim: int  # V's, O's, dO's and dV's (head_dim, or narrower: `check_value_head_dim`)
  score: ScoreFunction  # how S becomes the logits, and their slope
  group: int  # query heads per KV head

  @property
  def exp2_constant(self) -> float:
    """The folded softmax scale: exp(scale * s) = exp2(c * s), or with
    soft-cap exp(cap * tanh(scale * s / cap)) = exp2(c * t)
    (`ScoreFunction.exp2_constant`; with a `score_mod` the scale is applied
    before it, so c is log2(e), times the cap, on the modified score)."""
    return self.score.exp2_constant

  def softmax(self, s, lse2, **kwargs) -> "TileSoftmax":
    """`tile_softmax` of a raw S (or S^T) tile with this kernel's score
    function."""
    return tile_softmax(s, lse2, c=self.exp2_constant, score=self.score, mask=self.mask, **kwargs)


def launch(kernel, *, role: str, out_type, smem, barriers, grid: dict, num_threads: int):
  """`kernel` as a Mosaic GPU kernel over `grid` (axis name -> size), with
  `num_threads` warpgroups named "wg"; `role` names it (`compile_ahead`)."""
  return plgpu.kernel(
      compile_ahead.named(kernel, role),
      out_type=out_type,
      scratch_types=(smem, barriers),
      grid=tuple(grid.values()),
      grid_names=tuple(grid),
      num_threads=num_threads,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )


# --- one tile's softmax and gradient, and the wgmmas ---------------------------


class TileSoftmax(NamedTuple):
  """One tile's recomputed softmax and what its dS needs: `probs` = P (for dV =
  P^T dO) and dS = `grad()` = w * (dp - delta), w = `ds_weight` (`scores_grad`).

  Without modified logits w = P and (dp, delta) are the caller's dP and
  delta, untouched: dS is formed where the caller asks for it (after the dV
  wgmma is issued, in the dK/dV kernel). With them (soft-cap) dS also
  carries their slope (1 - t^2 of cap * tanh(x / cap)), so that dS is the
  gradient w.r.t. x = scale * s as without (the kernels' factor `scale` in
  dQ and dK stays): the
  slope is applied to dP - delta while t is alive, before P exists, and dp
  then holds slope * (dP - delta), delta None."""

  probs: Any  # P (P^T with keys along rows)
  ds_weight: Any  # w: dS = w * (dp - delta)
  dp: Any = None
  delta: Any = None
  keys_along_rows: bool = False

  def grad(self):
    """dS = w * (dp - delta) in fp32; a delta vector (one per query) is
    broadcast along the keys here."""
    delta = per_query_tile(self.delta, self.probs.shape, self.keys_along_rows)
    return scores_grad(self.ds_weight, self.dp, delta)


def per_query_tile(x, shape, keys_along_rows: bool):
  """A vector of one value per query broadcast over a tile of `shape`
  (queries along its columns when `keys_along_rows`); a tile or None as is."""
  if x is None or x.ndim != 1:
    return x
  return lax.broadcast_in_dim(x, shape, [1 if keys_along_rows else 0])


def tile_softmax(s, lse2, *, q_lo, k_lo, keys_along_rows: bool, kv_len, q_len, mask: MaskSpec,
                 c: float, masked: bool, score: ScoreFunction, segments=None, dp=None,
                 delta=None, mods: "TileMods | None" = None,
                 affine_k: float | None = None) -> TileSoftmax:
  """P = exp2(c * t - lse2) of one tile (S^T when `keys_along_rows`, as in
  the kernels that own keys; S in the dQ kernel) with t the logits of
  `score` (`ScoreFunction.logits`: s, or tanh(s * scale / cap) with soft-cap;
  c = `ScoreFunction.exp2_constant`), 0 where the mask, the key length or the
  segment ids hide an element; `masked=False` for tiles known to be fully
  visible. `segments`: None, or the segment ids of the tile's rows (a
  vector along them, `sm90_tiles.load_ids`) and columns (the `id_ring` slot
  that holds them, read chunk by chunk: `where_visible_by_column_chunks`).
  `lse2=None`: s already holds S - lse2 / c (`fold_stats`, not where the
  logits need the raw S: `ScoreFunction.needs_raw_scores`).

  `dp`, `delta`: the tile's dP (or dP^T) and delta (tile-shaped, a vector
  of one value per query, or None when dp already holds dP - delta),
  carried in the result for `TileSoftmax.grad`; or dp None where the caller
  forms dS itself as w * (dP - delta), with soft-cap w = P * slope (the
  head-dim-split dK/dV kernel, whose softmax warpgroup spilled more with
  the slope on dP: ptxas, D256 window GQA, 1792 bytes against 1256).

  Soft-cap's slope 1 - t^2 is applied to dP - delta here, right after the
  tanh: t then dies when the logits are formed (they take its registers)
  and P never lives beside it. Per element that costs one FMUL and one MUFU
  (tanh.approx) for t, one FFMA (1 - t^2) and one FMUL (the slope onto dP -
  delta): 2 MUFU ops instead of 1. Two earlier orders held one more f32 tile
  (32 registers per thread at 64 x 64) and spilled in the D128 dK/dV
  kernel: w = P * slope formed after the exp2 (t beside P; Nsight Compute,
  H100, B2 S8192 H16 D128 cap 50: 21 M local-memory spill requests in the
  dK/dV kernel against 0.12 M without soft-cap, and the kernel +20 %), and t
  recovered from P at dS (t = (log2 P + lse2) / c: a lg2 per element, lse2
  alive; ptxas, H200: D128 causal dK/dV 308 spill bytes). Masked elements
  have P = 0 and a finite slope, so dS = 0 there.

  `mods`: the call's `score_mod` / `mask_mod` on this tile (`TileMods`;
  `_tile_softmax_with_mods`). `affine_k`: s holds V + S of an affine
  score_mod (`affine_scores_start`), P = exp2(affine_k * s); lse2 None. `q_lo` and `k_lo`, the tile's first query and
  key, are multiples of its extents along them (every caller's are: block
  indices times block sizes), which the mods' positions rely on
  (`Positions.align`).
  """
  if mods is not None:
    return _tile_softmax_with_mods(
        s, lse2, q_lo=q_lo, k_lo=k_lo, keys_along_rows=keys_along_rows, kv_len=kv_len,
        q_len=q_len, mask=mask, c=c, masked=masked, segments=segments, score=score,
        dp=dp, delta=delta, mods=mods, affine_k=affine_k)
  t = score.logits(s)
  if score.modifies_logits and dp is not None:
    delta = per_query_tile(delta, s.shape, keys_along_rows)
    dp, delta = scores_grad(score.slope(t), dp, delta), None
  if lse2 is None:  # already in s (`fold_stats`)
    assert not score.needs_raw_scores, "lse2 cannot be folded into the raw S these logits need"
    logits2 = t * c
  else:
    logits2 = t * c - per_query_tile(lse2, s.shape, keys_along_rows)
  if masked:
    row_lo, col_lo = (k_lo, q_lo) if keys_along_rows else (q_lo, k_lo)
    logits2 = where_visible(logits2, -jnp.inf, mask=mask, row_lo=row_lo, col_lo=col_lo,
                            keys_along_rows=keys_along_rows, kv_len=kv_len, q_len=q_len,
                            segments=segments)
  p = jnp.exp2(logits2)
  if score.modifies_logits and dp is None:  # a caller that forms dS itself: w = P * slope
    return TileSoftmax(p, p * score.slope(t))
  return TileSoftmax(p, p, dp, delta, keys_along_rows)


# --- score_mod and mask_mod (`BackwardConfig` with `mods`) -------------------
# With a `score_mod` or `mask_mod` both kernels walk block lists instead of
# tile ranges: per CTA tile, the other side's blocks in the order
# `scores.block_lists` gives (PARTIAL ones, with the element mask, then FULL
# ones, without it; EMPTY ones are never loaded). The lists are of the CTA's
# tile as a whole (`backward_inputs.mod_operands`), and every consumer of the
# CTA takes each listed block with the CTA's class: a block PARTIAL for the
# CTA but empty for one consumer's rows costs that consumer a masked step
# whose P is 0 (no per-step branch on a consumer's own class).


def _tile_softmax_with_mods(s, lse2, *, q_lo, k_lo, keys_along_rows: bool, kv_len, q_len,
                            mask: MaskSpec, c: float, masked: bool, segments,
                            score: ScoreFunction, dp, delta, mods: TileMods,
                            affine_k: float | None = None) -> TileSoftmax:
  """`tile_softmax` with a `score_mod` and/or `mask_mod`, in the forward's
  order: x = scale * s, x = score_mod(x) (with its slope), then the built-in
  modifications (soft-cap: t = tanh(x / cap), slope times 1 - t^2), then the
  element mask on masked tiles (the built-ins, then mask_mod) and P =
  exp2(c * t - lse2), c = log2(e) (times the cap; without a score_mod the
  scale stays folded into c as in `tile_softmax`). dS is w.r.t. x: the
  slopes go onto dP - delta as the built-ins' do, and the kernels' factor
  `scale` in dQ and dK stays. A score_mod a * x + R(q_idx) + C(kv_idx)
  (`TileMods.affine`) forms t = s * (scale * a) + C by one FMA (or t = s,
  a and the scale in c) and moves lse2 by R per query, as the forward moved
  its running max (`mod_tiles.affine_logits`); a fixed a is in `scale`, so
  its slope is 1. With `affine_k` the kernel started the accumulator at the
  form's terms and lse2 (`affine_scores_start`): s holds V + S and
  P = exp2(affine_k * s), one multiply a score."""
  shape = s.shape
  slope = None
  if affine_k is not None:
    assert lse2 is None and mods.affine, "an affine fold without its score_mod"
    logits2 = s * jnp.float32(affine_k)
  elif mods.score_mod is not None:
    q_idx, kv_idx = _score_mod_positions(mods, shape, q_lo, k_lo, keys_along_rows)
    if mods.affine:  # one FMA per score or none; R leaves P = exp2(c t + R - lse2) per query
      t, offset, slope = mods.affine_logits(s, q_idx, kv_idx, score=score,
                                            query_axis=1 if keys_along_rows else 0)
      if offset is not None:
        lse2 = lse2 - offset
    else:
      x, slope = mods.score(s * jnp.float32(score.scale), q_idx, kv_idx)
      t = score.modified_logits(x)
      if score.modifies_logits:
        slope = slope * score.slope(t)
  else:
    t = score.logits(s)
    slope = score.slope(t)
  if slope is not None and dp is not None:
    delta = per_query_tile(delta, shape, keys_along_rows)
    dp, delta = scores_grad(slope, dp, delta), None
  if affine_k is not None:
    pass  # logits2 above
  elif lse2 is None:  # already in s (`fold_stats`): a mask_mod alone needs no raw S
    assert mods.score_mod is None, "lse2 cannot be folded into the raw S a score_mod needs"
    logits2 = t * c
  else:
    logits2 = t * c - per_query_tile(lse2, shape, keys_along_rows)
  if masked:
    row_lo, col_lo = (k_lo, q_lo) if keys_along_rows else (q_lo, k_lo)
    logits2 = where_visible(logits2, -jnp.inf, mask=mask, row_lo=row_lo, col_lo=col_lo,
                            keys_along_rows=keys_along_rows, kv_len=kv_len, q_len=q_len,
                            segments=segments, mask_mod=mods.mask_hook())
  p = jnp.exp2(logits2)
  if slope is not None and dp is None:  # a caller that forms dS itself: w = P * slope
    return TileSoftmax(p, p * slope)
  return TileSoftmax(p, p, dp, delta, keys_along_rows)


def affine_scores_start(mods: TileMods, score: ScoreFunction, lse2, *, shape, q_lo, k_lo,
                        keys_along_rows: bool):
  """(V, k): the start of a tile's S (S^T when `keys_along_rows`) accumulator
  under an affine score_mod that `folds_affine` admits, and the factor of
  P = exp2(k * (V + S)) (`mod_tiles.affine_scores_init`); positions as
  `_tile_softmax_with_mods` forms them. `lse2`: a vector along the
  queries."""
  q_idx, kv_idx = _score_mod_positions(mods, shape, q_lo, k_lo, keys_along_rows)
  return mods.affine_scores_init(q_idx, kv_idx, lse2, score=score,
                                 query_axis=1 if keys_along_rows else 0)


def _score_mod_positions(mods: TileMods, shape, q_lo, k_lo, keys_along_rows: bool):
  """(q_idx, kv_idx) of a tile's elements for its score_mod; `q_lo`, `k_lo`
  multiples of the tile's extents (`tile_softmax`)."""
  row_lo, col_lo = (k_lo, q_lo) if keys_along_rows else (q_lo, k_lo)
  return mod_positions(shape, row_lo=row_lo, col_lo=col_lo, keys_along_rows=keys_along_rows,
                       bound=mods.position_bound, aligned=True)


def mma(a, b, shape):
  """a @ b in fp32 (both in SMEM)."""

  def body(ref):
    plgpu.wgmma(ref, a, b)
    return ref[...]

  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def load_operand(tile):
  """An SMEM tile in registers, laid out as a wgmma A operand."""
  return plgpu.load(tile, layout=plgpu.Layout.WGMMA)


def mma_pair(a0, b0, a1, b1, shape):
  """(a0 @ b0, a1 @ b1) in fp32, both wgmmas issued before one wait."""

  def body(refs):
    r0, r1 = refs
    plgpu.wgmma(r0, a0, b0)
    plgpu.wgmma(r1, a1, b1)
    return r0[...], r1[...]

  acc = plgpu.ACC(shape, jnp.float32)
  return pl.run_scoped(body, (acc, acc))


def mma_accumulate(acc, a, b_smem, staging):
  """acc + a @ b_smem with `a` (a 16-bit array in registers).

  On hardware wgmma reads `a` from registers and accumulates in place. The
  interpreter rejects register A operands and `run_state`: there `a` goes
  through the SMEM `staging` buffer into a fresh accumulator.
  """
  if is_interpreting():
    staging[...] = a
    plgpu.commit_smem()
    a = staging
  return mma_accumulate_smem(acc, a, b_smem)


def mma_accumulate_smem(acc, a, b_smem):
  """acc + a @ b_smem, `a` in SMEM (or, on hardware, in registers): in place
  on hardware; the interpreter, without `run_state`, adds a fresh product."""
  if is_interpreting():
    def fresh(ref):
      plgpu.wgmma(ref, a, b_smem)
      return ref[...]

    return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))

  def in_place(ref):
    plgpu.wgmma(ref, a, b_smem)

  return pl.run_state(in_place)(plgpu.ACC.init(acc))


def mma_accumulate_pair(acc0, a0, b0, acc1, a1, b1):
  """(acc0 + a0 @ b0, acc1 + a1 @ b1), both wgmmas issued before one wait.

  In place on hardware, where `a0` and `a1` may also be 16-bit arrays in
  registers; the interpreter (no `run_state`) adds fresh products, from SMEM.
  """
  if is_interpreting():
    def fresh(refs):
      plgpu.wgmma(refs[0], a0, b0)
      plgpu.wgmma(refs[1], a1, b1)
      return refs[0][...], refs[1][...]

    d0, d1 = pl.run_scoped(fresh, (plgpu.ACC(acc0.shape, jnp.float32),
                                   plgpu.ACC(acc1.shape, jnp.float32)))
    return acc0 + d0, acc1 + d1

  def in_place(refs):
    plgpu.wgmma(refs[0], a0, b0)
    plgpu.wgmma(refs[1], a1, b1)

  return pl.run_state(in_place)((plgpu.ACC.init(acc0), plgpu.ACC.init(acc1)))


def stats_of_slot(lse_ring, delta_ring, slot):
  """`load_stats(lse=True, delta=True)` for `transposed_scores`: (lse2,
  delta) of a ring slot as vectors along S^T's columns; None for those not
  asked for, and delta None without a delta ring (dV pass)."""
  col_layout = plgpu.Layout.WGMMA.reduce(0)

  def load_stats(lse: bool = True, delta: bool = True):
    lse2 = plgpu.load(lse_ring.at[slot], layout=col_layout) if lse else None
    return lse2, (None if delta_ring is None or not delta else
                  plgpu.load(delta_ring.at[slot], layout=col_layout))

  return load_stats


def transposed_scores(k_operand, v_operand, q_tile, do_tile, load_stats, *, c: float,
                       fold_stats: bool, stats_first: bool, needs_raw_scores: bool = False,
                       scores_start=None):
  """S^T = K Q^T and, given `v_operand`, dP^T = V dO^T of one step of a
  kernel that owns keys ([keys, queries] tiles), with the statistics the
  softmax needs: (s, dp, lse2, delta), delta broadcast along the keys.

  `load_stats()` returns (lse2, delta or None) from SMEM; `stats_first`
  calls it before waiting for the wgmmas. With `fold_stats` (where there is
  a dP^T and c != 0, so -lse2 / c exists) the wgmmas start from -lse2 / c
  and -delta, so s holds S^T - lse2 / c and dp holds dP^T - delta, and
  lse2 = delta = None. Where the logits need the raw S^T
  (`ScoreFunction.needs_raw_scores`: soft-cap's tanh) only delta is folded,
  and lse2 is loaded after the wait (ptxas, D128 causal
  GQA: 92 spill bytes as without soft-cap; 180 when lse2 was loaded before
  the wait and held across it).

  `scores_start(lse2)`: the S^T accumulator's start, an affine score_mod's
  terms and lse2 (`affine_scores_start`, `DkvConfig.fold_affine`); lse2 is
  loaded before the wgmmas and returned None, and with `fold_stats` dP^T
  starts at -delta as above.
  """
  bk, bq = k_operand.shape[0], q_tile.shape[0]
  along_keys = lambda x: lax.broadcast_in_dim(x, (bk, bq), [1])
  q_t, do_t = q_tile.transpose((1, 0)), do_tile.transpose((1, 0))
  if scores_start is not None:
    fold_delta = fold_stats and v_operand is not None
    lse2, delta = load_stats(delta=fold_delta)
    start = scores_start(lse2)
    if v_operand is None:
      return mma_accumulate_smem(start, k_operand, q_t), None, None, None
    dp_start = along_keys(-delta) if fold_delta else zeros((bk, bq))
    s, dp = mma_accumulate_pair(start, k_operand, q_t, dp_start, v_operand, do_t)
    if fold_delta:
      return s, dp, None, None
    _, delta = load_stats(lse=False)
    return s, dp, None, (None if delta is None else along_keys(delta))
  if fold_stats and v_operand is not None and needs_raw_scores:
    _, delta = load_stats(lse=False)
    s, dp = mma_accumulate_pair(zeros((bk, bq)), k_operand, q_t,
                                 along_keys(-delta), v_operand, do_t)
    lse2, _ = load_stats(delta=False)
    return s, dp, lse2, None
  if fold_stats and v_operand is not None and c != 0:
    lse2, delta = load_stats()
    s, dp = mma_accumulate_pair(along_keys(lse2 * (-1.0 / c)), k_operand, q_t,
                                 along_keys(-delta), v_operand, do_t)
    return s, dp, None, None
  stats = load_stats() if stats_first else None
  if v_operand is None:
    s, dp = mma(k_operand, q_t, (bk, bq)), None
  else:
    s, dp = mma_pair(k_operand, q_t, v_operand, do_t, (bk, bq))
  lse2, delta = stats or load_stats()
  return s, dp, lse2, (None if delta is None else along_keys(delta))


def scores_grad(p, dp, delta):
  """dS = P * (dP - delta) in fp32, of a tile in either orientation (delta
  broadcast to it); `delta=None`: dp already holds dP - delta (`fold_stats`)."""
  return p * dp if delta is None else p * (dp - delta)


def zeros(shape):
  return plgpu.layout_cast(jnp.full(shape, 0.0, jnp.float32), plgpu.Layout.WGMMA)
