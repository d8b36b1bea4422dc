"""The dQ kernel of the sm90 backward: CTAs that own query rows.

One CTA per (q head, Q tile of `num_consumers * block_q` rows, batch) of its
`DqConfig`: each consumer warpgroup owns `block_q` rows and their dQ, and the
producer streams (K, V) tiles of the key blocks those rows see
(barriers: `DqBarrierTable`). V, dO and O may be narrower than Q and K
(`value_head_dim`): dP = dO V^T contracts over it; S and dQ keep the head dim.
With `BackwardConfig.delta_in_dq` each consumer also loads its rows' O tile,
computes their delta before its first block and writes it out for the dK/dV
kernel, which then runs after this one.

The kernel reads as its roles: a producer, the consumers, their epilogue.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fa4_jax import scores
from fa4_jax.interpret import is_interpreting
from fa4_jax.kernels.build_cache import cached_build
from fa4_jax.kernels.pipeline import (ACQUIRE, ARRIVE, FILL, NO_CHAIN, RING, WAIT, Barrier,
                                     BarrierTable, check_register_split, sequence_lengths)
from fa4_jax.kernels.backward_walk import KernelRefs, narrow
from fa4_jax.kernels.sm90_backward_common import (BackwardStatics, ModRefs,
                                                  affine_scores_start, folds_affine, launch,
                                                  load_operand, mma_accumulate,
                                                  mma_accumulate_pair, mma_pair,
                                                  walk_block_list, zeros)
from fa4_jax.kernels.sm90_tiles import element_loader, id_ring, load_ids, swizzle_bytes
from fa4_jax.kernels.tiles import smem_tile
from fa4_jax.scores import TileRanges, cdiv, walk_blocks


@dataclasses.dataclass(frozen=True)
class DqConfig:
  """Static configuration of the dQ kernel: a CTA owns `num_consumers *
  block_q` query rows (one `block_q` tile per consumer warpgroup) and streams
  `block_kv`-key tiles through `num_stages` slots."""

  # --- tiles, stages and warpgroups (the heuristic's choice by shape) ---
  block_q: int = 64
  block_kv: int = 64
  num_stages: int = 2
  # The dQ kernel's warpgroups: its accumulators are half the dK/dV kernel's,
  # so at head dim <= 128 it runs three consumers on fewer registers each.
  num_consumers: int = 2
  producer_registers: int = 40
  consumer_registers: int = 232
  # --- which algorithm runs ---
  # Keep the tiles a consumer holds for its whole loop, Q and dO, in
  # registers, as the A operands of its first two GEMMs (S = Q K^T,
  # dP = dO V^T), instead of having every wgmma read them from SMEM again:
  # why it pays at head dim 64 only, `DkvConfig.operands_in_registers`. The
  # interpreter, which has no register A operands, keeps the tiles in SMEM.
  operands_in_registers: bool = False
  # Q alone in registers (S = Q K^T's A operand; dP = dO V^T keeps reading
  # dO from SMEM): 48 registers at head dim 192 instead of the 80 of Q and
  # dO at 192 / 128, for the SMEM reads of S's wgmmas halved (issue #56).
  q_in_registers: bool = False
  # Issue the next key block's S and dP wgmmas right behind this block's dQ
  # wgmma, before waiting for it (`_walk_issue_ahead`): the consumer's tensor
  # work stays queued across the dQ wait instead of the wait, the slot's
  # release and the next block's issue running with its wgmmas drained
  # (the SASS of the 192 / 128 kernel: `WARPGROUP.DEPBAR.LE gsb0, 0x0` after
  # dQ's last HGMMA, then the release and the loop's back edge). S and dP
  # of the next block then live across the step (64 more registers at
  # 64-key tiles). Not with a score_mod / mask_mod (their block lists).
  issue_ahead: bool = False
  # A score_mod in the affine form with a fixed a and no soft-cap
  # (`mod_tiles.folds_affine`): `fold_delta` starts the dP accumulator at
  # -delta (dS = P * dP: the mods' dQ kernel zeroed dP register by register
  # anyway), `fold_affine` the S one, where the mod has a key term C, at
  # (R2 - lse2 + c C) / k (a vector along the rows plus one along the
  # columns), so that P = exp2(k * acc) costs one multiply a score
  # (`DkvConfig.fold_affine`).
  fold_delta: bool = False
  fold_affine: bool = False

  def __post_init__(self):
    check_register_split("DqConfig", self.producer_registers, self.num_consumers,
                         self.consumer_registers)


def _row_delta(o_tile, do_tile, lse2):
  """delta = rowsum(dO * O) in float32 of one tile of rows, 0 on rows whose
  lse2 is +inf: they contribute nothing, and their O and dO may hold
  anything (0 * inf would otherwise reach dS)."""
  load = functools.partial(plgpu.load, layout=plgpu.Layout.WGMMA)
  delta = jnp.sum(load(o_tile).astype(jnp.float32) * load(do_tile).astype(jnp.float32), axis=1)
  return jnp.where(lse2 == jnp.inf, 0.0, delta)


@dataclasses.dataclass(frozen=True)
class _DqKernel(BackwardStatics):
  """The static description of the dQ kernel."""

  num_q_tiles: int
  interpreting: bool
  has_segments: bool = False
  mods: Any = None  # sm90_backward_common.ModStatics; None without mods
  # `BackwardConfig.delta_in_dq`: the sixth input is O (not delta) and delta
  # an output.
  with_delta: bool = False

  @property
  def num_streamed(self) -> int:
    return 3 if self.has_segments else 2  # K, V (and the keys' segment ids)

  def smem(self):
    """Scratch SMEM, in the order `_DqSmem` unpacks it."""
    cfg, nc, bq, bk = self.cfg, self.cfg.num_consumers, self.cfg.block_q, self.cfg.block_kv
    swizzle = swizzle_bytes(self.dtype, bq, bk)
    if self.has_segments:
      # lse2 and delta in one buffer: Mosaic GPU starts every buffer at a
      # multiple of 1 KiB, and at head dim 256 the ids' ring fits only in
      # the KiB this saves.
      stats = [plgpu.SMEM((2, nc, bq), jnp.float32)]
    else:
      stats = [plgpu.SMEM((nc, bq), jnp.float32)] * 2  # lse2, delta
    smem = [
        smem_tile((nc, bq, self.head_dim), self.dtype, swizzle),  # Q tiles, then dQ
        smem_tile((nc, bq, self.value_head_dim), self.dtype, swizzle),  # dO tiles
        *stats,
        smem_tile((cfg.num_stages, bk, self.head_dim), self.dtype, swizzle),  # K ring
        smem_tile((cfg.num_stages, bk, self.value_head_dim), self.dtype, swizzle),  # V ring
    ]
    if self.with_delta:
      smem.append(smem_tile((nc, bq, self.value_head_dim), self.dtype, swizzle))  # O tiles
    if self.interpreting:
      smem.append(smem_tile((nc, bq, bk), self.dtype, swizzle))  # dS staging
    if self.has_segments:
      smem.append(id_ring(cfg.num_stages, bk))  # the keys' segment ids
    return tuple(smem)


class _DqSmem(NamedTuple):
  q: Any
  do: Any
  lse: Any
  delta: Any
  k_ring: Any
  v_ring: Any
  o: Any  # None without `delta_in_dq`
  staging: list
  kv_ids: Any  # ring of the keys' segment ids; None without segment ids

  @classmethod
  def unpack(cls, smem, with_delta: bool, has_segments: bool) -> "_DqSmem":
    if has_segments:
      q, do, stats, k_ring, v_ring, *staging = smem
      lse, delta = stats.at[0], stats.at[1]
    else:
      q, do, lse, delta, k_ring, v_ring, *staging = smem
    o = staging.pop(0) if with_delta else None
    kv_ids = staging.pop() if has_segments else None
    return cls(q, do, lse, delta, k_ring, v_ring, o, staging, kv_ids)


@dataclasses.dataclass(frozen=True)
class _QueryTileWork:
  """What a CTA that owns query rows [q_lo, q_lo + rows) of one head walks:
  the key blocks [lo, hi) those rows may see."""

  head: Any
  kv_head: Any
  batch_idx: Any
  q_tile: Any  # the CTA's position along the query axis
  q_lo: Any
  q_len: Any
  kv_len: Any
  ranges: TileRanges

  @classmethod
  def of_this_cta(cls, kd: _DqKernel, *, gmem: KernelRefs, q_seq, kv_valid,
                  mod_refs: ModRefs | None = None):
    """The CTA at grid position (heads, q_tiles, batch); with mods whose
    `tile_order` is given, the tile that order puts at that position."""
    nc, bq = kd.cfg.num_consumers, kd.cfg.block_q
    head = lax.axis_index("heads")
    batch_idx = lax.axis_index("batch")
    tile = lax.axis_index("q_tiles")
    if kd.mods is not None and kd.mods.tile_order:
      tile = mod_refs.cta_tile(batch_idx, tile)  # the longest lists first
    # Heavy tiles first: with a right bound (causal), later rows see more keys.
    elif kd.mask.right is not None and kd.mask.left is None:
      tile = kd.num_q_tiles - 1 - tile
    kv_head = lax.div(head, jnp.int32(kd.group))
    q_len, kv_len = sequence_lengths(gmem.q_len, gmem.kv_len, batch_idx, q_seq, kv_valid)
    q_lo = tile * (nc * bq)
    ranges = scores.kv_tile_ranges(kd.mask, q_lo, q_lo + nc * bq, q_len, kv_len,
                                   kd.cfg.block_kv)
    ranges = narrow(ranges, gmem.segments, lambda seg: seg.of_cta(batch_idx, tile))
    return cls(head, kv_head, batch_idx, tile, q_lo, q_len, kv_len, ranges)


class DqBarrierTable(BarrierTable):
  """Every mbarrier of the dQ kernel, declared in the form of
  `pipeline.BarrierTable` (cf. `sm100_backward_dq.DqBarrierTable`).

  Who arrives on each barrier and who waits on it, by role and accessor
  (no role touches a barrier except through these accessors):

  name       count      arrivals    arrived on by                       waited on by
  q_do_full  consumers  4 (TMA)     producer: producer_q_do (TMAs of    consumer i: consumer_q_do,
                                      consumer i's Q, dO, lse2 and        once
                                      delta, or O with `delta_in_dq`)
  kv_full    stages     streamed    producer: producer_kv (TMAs of      consumers: consumer_kv, every
                          (TMA)       step n's K, V and the keys'         step
                                      segment ids)
  kv_free    stages     consumers   consumers: consumer_kv_release      producer: producer_kv_acquire
                                      (after their last wgmma reading     (before it refills the
                                      the slot)                           slot), drain_kv*

  stages = num_stages (ring slot `slot("kv_full", step)`). * interpreter
  only. The epilogue of consumer i stages dQ through its own Q buffer
  (only consumer i reads it, and all its wgmmas have completed).
  """

  ALLOCATION_ORDER = "as declared"
  BARRIERS = {
      # name: Barrier(how many, arrivals, orders tensor core, arrived on by
      #               {accessor: how}, waited on by {accessor: how}, index)
      "q_do_full": Barrier("consumers", 4, False, arrive={"producer_q_do": FILL},
                           wait={"consumer_q_do": WAIT}),
      "kv_full": Barrier("stage", "streamed", False, arrive={"producer_kv": FILL},
                         wait={"consumer_kv": WAIT}, index=RING),
      "kv_free": Barrier("stage", "consumers", False, arrive={"consumer_kv_release": ARRIVE},
                         wait={"producer_kv_acquire": ACQUIRE}, index=RING),
  }

  @staticmethod
  def barrier_counts(kd: "_DqKernel") -> dict:
    return {"consumers": kd.cfg.num_consumers, "stage": kd.cfg.num_stages,
            "streamed": kd.num_streamed}

  # Interpreter-only drain of the last phases (see `BarrierTable`).
  def drain_kv(self, num_steps) -> None:
    """Producer: observe the kv_free phases of the last lap."""
    self._drain_last_lap(num_steps, "kv_free")


def _dq_producer(kd: _DqKernel, gmem: KernelRefs, smem: _DqSmem, bars: DqBarrierTable,
                 work: _QueryTileWork, mod_refs: ModRefs | None = None):
  """Each consumer's Q, dO, lse2 and delta (or O) once, then the (K, V)
  tiles of the CTA's key blocks (and their keys' segment ids) through the
  ring: blocks [lo, hi), or with mods the CTA's block list."""
  cfg, nc, bq, bk = kd.cfg, kd.cfg.num_consumers, kd.cfg.block_q, kd.cfg.block_kv
  lo, hi = work.ranges.lo, work.ranges.hi
  plgpu.set_max_registers(cfg.producer_registers, action="decrease")
  for i in range(nc):
    rows = (work.batch_idx, pl.ds(work.q_lo + i * bq, bq), work.head)
    stats = (work.batch_idx, work.head, pl.ds(work.q_lo + i * bq, bq))
    fourth = ((gmem.delta.at[rows], smem.o) if kd.with_delta
              else (gmem.delta.at[stats], smem.delta))
    bars.producer_q_do(
        [(gmem.q.at[rows], smem.q), (gmem.do.at[rows], smem.do),
         (gmem.lse.at[stats], smem.lse), fourth], i)

  def load_block(step, j):
    keys = (work.batch_idx, pl.ds(j * bk, bk), work.kv_head)
    streamed = [(gmem.k.at[keys], smem.k_ring), (gmem.v.at[keys], smem.v_ring)]
    if kd.has_segments:
      streamed.append((gmem.segments.kv_ids.at[work.batch_idx, pl.ds(j * bk, bk)], smem.kv_ids))
    bars.producer_kv_acquire(step)
    bars.producer_kv(streamed, step)

  if kd.mods is not None:
    walk = mod_refs.walk(kd.mods, work.batch_idx, work.head, work.q_tile)
    pl.loop(0, walk.total)(lambda n: load_block(n, walk.block(n)))
    bars.drain_kv(walk.total)
    return

  @pl.loop(lo, hi)
  def _(j):
    step = j - lo
    load_block(step, j)

  bars.drain_kv(hi - lo)


def _dq_consumer(kd: _DqKernel, wg, smem: _DqSmem, bars: DqBarrierTable,
                 work: _QueryTileWork, delta_out, segments, mod_refs: ModRefs | None = None):
  """Consumer `wg`: dQ of its `block_q` rows over the CTA's key blocks
  (blocks its rows cannot see only keep the ring going; with mods, every
  block of the CTA's list, with the CTA's class). Returns (dQ, its first
  row)."""
  cfg, bq, bk, mask = kd.cfg, kd.cfg.block_q, kd.cfg.block_kv, kd.mask
  lo, hi = work.ranges.lo, work.ranges.hi
  plgpu.set_max_registers(cfg.consumer_registers, action="increase")
  q_lo = work.q_lo + wg * bq
  if kd.mods is None:
    own = scores.kv_tile_ranges(mask, q_lo, q_lo + bq, work.q_len, work.kv_len, bk)
    own = narrow(own, segments, lambda seg: seg.of_consumer(work.batch_idx, work.q_tile, wg))
    own = own.within(lo, hi)
  if segments is not None:  # the rows' ids once; the keys' from the ring's slot
    q_seg = load_ids(segments.q_ids, work.batch_idx, q_lo, bq, along_rows=True)
    block_segments = lambda slot: (q_seg, smem.kv_ids.at[slot])  # read after the wait
  else:
    block_segments = lambda slot: None
  q_tile, do_tile = smem.q.at[wg], smem.do.at[wg]
  row_layout = plgpu.Layout.WGMMA.reduce(1)  # a vector along S's rows
  stage = smem.staging[0].at[wg] if kd.interpreting else None

  bars.consumer_q_do(wg)
  q_operand, do_operand = q_tile, do_tile  # the A operands of S and dP
  if cfg.operands_in_registers and not kd.interpreting:
    q_operand, do_operand = load_operand(q_tile), load_operand(do_tile)
  elif cfg.q_in_registers and not kd.interpreting:
    q_operand = load_operand(q_tile)
  lse2 = plgpu.load(smem.lse.at[wg], layout=row_layout)
  if kd.with_delta:
    # delta of this consumer's rows, for itself and (through GMEM) for
    # the dK/dV kernel, which runs after this one.
    delta = _row_delta(smem.o.at[wg], do_tile, lse2)
    smem.delta.at[wg][...] = delta
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem.delta.at[wg],
                            delta_out[0].at[work.batch_idx, work.head, pl.ds(q_lo, bq)])
  else:
    delta = plgpu.load(smem.delta.at[wg], layout=row_layout)

  tile_mods = None
  if kd.mods is not None:
    tile_mods = mod_refs.on_rows(kd.mods, work.batch_idx, work.head, element_loader())

  # An affine score_mod (`DqConfig.fold_delta`, `fold_affine`): dP starts at
  # -delta, and where the mod has a key term C, S at its terms and lse2
  # (`affine_scores_start`). Without C the logits are the raw S, whose
  # softmax takes lse2 - R in its one FFMA as it is: a start would cost a
  # write per element for nothing (local ptxas, `s + 0.5`: 293 instructions
  # in the FULL loop with the start, as without the fold).
  fold_affine = ((cfg.fold_delta or cfg.fold_affine) and tile_mods is not None
                 and folds_affine(tile_mods.score_mod, kd.score))
  start_scores = fold_affine and cfg.fold_affine and kd.score.has_score_mod

  def tiles(step):
    """(slot, K tile, V tile) of ring position `step`."""
    slot = bars.slot("kv_full", step)
    return slot, smem.k_ring.at[slot], smem.v_ring.at[slot]

  def ds_of(step, j, s, dp, *, masked, lse2=lse2, delta=delta, mods=None):
    """dS (in the kernel's dtype) of key block j at ring position `step`,
    from its S and dP."""
    seg = block_segments(tiles(step)[0]) if masked else None
    ds = kd.softmax(s, lse2, q_lo=q_lo, k_lo=j * bk, keys_along_rows=False,
                    kv_len=work.kv_len, q_len=work.q_len, masked=masked, segments=seg,
                    dp=dp, delta=delta, **(mods or {})).grad()
    return ds.astype(kd.dtype)

  def accumulate(dq, ds, step):
    """dQ += dS K of the block at ring position `step`; its slot released."""
    dq = mma_accumulate(dq, ds, tiles(step)[1], stage)
    bars.consumer_kv_release(step)
    return dq

  def block_fn(step, j, dq, *, masked):
    """Key block j at ring position `step`."""
    _, k_tile, v_tile = tiles(step)
    mods = {} if tile_mods is None else dict(mods=tile_mods)
    stats = dict(lse2=lse2, delta=None if fold_affine else delta)
    if start_scores:
      start, mods["affine_k"] = affine_scores_start(
          tile_mods, kd.score, lse2, shape=(bq, bk), q_lo=q_lo, k_lo=j * bk,
          keys_along_rows=False)
      stats["lse2"] = None
    elif fold_affine:
      start = zeros((bq, bk))
    bars.consumer_kv(step)
    if fold_affine:
      s, dp = mma_accumulate_pair(start, q_operand, k_tile.transpose((1, 0)),
                                  lax.broadcast_in_dim(-delta, (bq, bk), [0]),
                                  do_operand, v_tile.transpose((1, 0)))
    else:
      s, dp = mma_pair(q_operand, k_tile.transpose((1, 0)),
                       do_operand, v_tile.transpose((1, 0)), (bq, bk))
    ds = ds_of(step, j, s, dp, masked=masked, lse2=stats["lse2"], delta=stats["delta"],
               mods=mods)
    return accumulate(dq, ds, step)

  if kd.mods is not None:
    walk = mod_refs.walk(kd.mods, work.batch_idx, work.head, work.q_tile)
    return walk_block_list(walk, block_fn, zeros((bq, kd.head_dim))), q_lo

  def step_fn(j, dq, *, masked):
    step = j - lo
    return block_fn(step, j, dq, masked=masked)

  def skip_fn(j, dq):
    bars.consumer_kv(j - lo)
    bars.consumer_kv_release(j - lo)
    return dq

  if cfg.issue_ahead:
    def scores_of(step):
      """S and dP of the block at ring position `step`, once its tiles are in."""
      _, k_tile, v_tile = tiles(step)
      bars.consumer_kv(step)
      return mma_pair(q_operand, k_tile.transpose((1, 0)), do_operand,
                      v_tile.transpose((1, 0)), (bq, bk))

    def ahead_fn(j, carry, *, masked):
      """Block j's dS and dQ wgmma, then block j + 1's S and dP behind it."""
      dq, s, dp = carry
      step = j - lo
      ds = ds_of(step, j, s, dp, masked=masked)
      if kd.interpreting:  # no run_state there: the same order, one GEMM at a time
        return (accumulate(dq, ds, step), *scores_of(step + 1))
      _, k_tile, _ = tiles(step)
      _, k_next, v_next = tiles(step + 1)

      def scoped(refs):
        s_ref, dp_ref = refs

        def in_place(dq_ref):
          plgpu.wgmma(dq_ref, ds, k_tile)
          bars.consumer_kv(step + 1)
          plgpu.wgmma(s_ref, q_operand, k_next.transpose((1, 0)))
          plgpu.wgmma(dp_ref, do_operand, v_next.transpose((1, 0)))
          plgpu.wgmma_wait(2)  # dQ's group has completed: slot j is read
          bars.consumer_kv_release(step)

        new_dq = pl.run_state(in_place)(plgpu.ACC.init(dq))
        return new_dq, s_ref[...], dp_ref[...]

      return pl.run_scoped(scoped, (plgpu.ACC((bq, bk), jnp.float32),
                                    plgpu.ACC((bq, bk), jnp.float32)))

    def last_fn(j, carry, *, masked):
      dq, s, dp = carry
      return accumulate(dq, ds_of(j - lo, j, s, dp, masked=masked), j - lo)

    return _walk_issue_ahead(lo, hi, own, scores_of, ahead_fn, last_fn, skip_fn,
                             zeros((bq, kd.head_dim))), q_lo

  return walk_blocks(lo, hi, own, step_fn, skip_fn, zeros((bq, kd.head_dim))), q_lo


def _walk_issue_ahead(lo, hi, own: TileRanges, scores_of, ahead_fn, last_fn, skip_fn, dq):
  """`walk_blocks` for `DqConfig.issue_ahead`: the consumer's own blocks
  [own.lo, own.hi) carry (dQ, S, dP), S and dP those of the block about to
  be differentiated, issued during the previous step (`ahead_fn`) or before
  the first (`scores_of`); the last own block issues nothing ahead
  (`last_fn`, masked or not as it falls). Blocks of the CTA's range outside
  its own only keep the ring going (`skip_fn`), as in `walk_blocks`."""
  fori = lambda a, b, body, carry: lax.fori_loop(a, jnp.maximum(a, b), body, carry)
  dq = fori(lo, own.lo, skip_fn, dq)

  def own_blocks(dq):
    last = own.hi - 1
    carry = (dq, *scores_of(own.lo - lo))
    carry = fori(own.lo, jnp.minimum(own.full_lo, last),
                 functools.partial(ahead_fn, masked=True), carry)
    carry = fori(own.full_lo, jnp.minimum(own.full_hi, last),
                 functools.partial(ahead_fn, masked=False), carry)
    carry = fori(own.full_hi, last, functools.partial(ahead_fn, masked=True), carry)
    last_is_full = (own.full_lo <= last) & (last < own.full_hi)
    return lax.cond(last_is_full, functools.partial(last_fn, last, masked=False),
                    functools.partial(last_fn, last, masked=True), carry)

  dq = lax.cond(own.lo < own.hi, own_blocks, lambda dq: dq, dq)
  return fori(own.hi, hi, skip_fn, dq)


def _dq_epilogue(kd: _DqKernel, wg, dq, q_lo, smem: _DqSmem, dq_ref, work: _QueryTileWork):
  """Every wgmma reading Q has completed: its tile takes dQ on the way out."""
  bq = kd.cfg.block_q
  q_tile = smem.q.at[wg]
  q_tile[...] = (dq * kd.score.scale).astype(kd.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[work.batch_idx, pl.ds(q_lo, bq), work.head])
  plgpu.wait_smem_to_gmem(0)


@cached_build
def _build_dq_kernel(*, batch, q_seq, kv_seq, kv_valid, num_q_heads, num_kv_heads,
                     head_dim, value_head_dim, dtype, score, mask, config, has_q_lengths,
                     has_kv_lengths, has_segments=False, with_delta=False, chain=NO_CHAIN,
                     mods=None):
  """The dQ kernel of `config` (a `DqConfig`): dq, and with `with_delta`
  (`BackwardConfig.delta_in_dq`) also delta [B, Nq, rows].
  With `has_segments` the inputs end with `SegmentRefs` (one consumer tile
  per consumer), and the ring streams each block's key ids with K and V.
  `mods` (`ModStatics`): the inputs end with `ModRefs` (block lists of the
  CTAs' query tiles), and the CTAs walk those lists."""
  cfg = config
  nc, bq = cfg.num_consumers, cfg.block_q
  num_q_tiles = cdiv(q_seq, nc * bq)
  kd = _DqKernel(cfg, mask, dtype, head_dim, value_head_dim, score,
                 num_q_heads // num_kv_heads, num_q_tiles, is_interpreting(), has_segments, mods,
                 with_delta)
  grid = dict(heads=num_q_heads, q_tiles=num_q_tiles, batch=batch)

  def kernel(*refs):
    chain.at_start()
    gmem, rest = KernelRefs.split(refs, has_q_lengths, has_kv_lengths,
                                  nc if has_segments else None)
    mod_refs, (dq_ref, *delta_out, smem, barrier_refs) = ModRefs.split(rest, mods)
    smem = _DqSmem.unpack(smem, kd.with_delta, has_segments)
    bars = DqBarrierTable(kd, barrier_refs)
    work = _QueryTileWork.of_this_cta(kd, gmem=gmem, q_seq=q_seq, kv_valid=kv_valid,
                                      mod_refs=mod_refs)
    wg = lax.axis_index("wg")

    pl.when(wg == nc)(lambda: _dq_producer(kd, gmem, smem, bars, work, mod_refs))

    @pl.when(wg < nc)
    def _consumers():
      dq, q_lo = _dq_consumer(kd, wg, smem, bars, work, delta_out, gmem.segments, mod_refs)
      _dq_epilogue(kd, wg, dq, q_lo, smem, dq_ref, work)

    chain.at_exit(grid)

  out_type = jax.ShapeDtypeStruct((batch, q_seq, num_q_heads, head_dim), dtype)
  if kd.with_delta:
    # Every row of every CTA's tiles is written (0 past the query length), so
    # the dK/dV kernel's blocks, which divide a CTA's rows, read only written rows.
    delta_type = jax.ShapeDtypeStruct((batch, num_q_heads, num_q_tiles * nc * bq), jnp.float32)
    out_type = (out_type, delta_type)
  return launch(kernel, role="sm90_dq", out_type=out_type, smem=kd.smem(),
                barriers=DqBarrierTable.scratch_types(kd),
                grid=grid, num_threads=nc + 1)
