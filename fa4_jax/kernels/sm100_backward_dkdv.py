"""The dK/dV kernel of the Blackwell (sm_100) backward: CTAs that own key tiles.

One CTA per (kv head, tile of `BLOCK_KV` = 128 keys, batch) walks every
query block of every query head of the GQA group that the mask lets its keys
be seen by (`backward_walk.KeyTileWork`, the walk the sm90 dK/dV kernel
takes too), and accumulates dK and dV of its keys in tensor memory (TMEM): the
group sum happens in the accumulators. Scores are computed transposed, keys
along the TMEM lanes (one key per thread of the compute warpgroup):

    S^T  = K Q^T        (TMEM, f32)   P^T  = exp2(c S^T - lse2)  (TMEM, over S^T)
    dP^T = V dO^T       (TMEM, f32)   dS^T = P^T (dP^T - delta)  (TMEM, over dP^T)
    dV  += P^T dO       (TMEM)        dK  += dS^T Q              (TMEM; x scale at the end)

P^T and dS^T are the A operands of the dV and dK MMAs straight from TMEM (16
bits, two per column, over the columns of S^T and dP^T, as the forward's P
over S); the B operands (dO, Q) are SMEM tiles. No gradient is written by
two CTAs (deterministic, no atomics).

Warpgroups:

    wg 0   compute: P^T from S^T (element mask only on boundary blocks, as
           the sm90 kernel: `scores.q_tile_ranges`, `walk_blocks`), then
           dS^T from dP^T (`_compute_step`); then the epilogue (dK * scale
           and dV from TMEM through the K and V SMEM tiles to GMEM).
    wg 1   warp 0: TMA loads (K, V once; Q, dO and lse2, delta of every step
           into a ring of `num_stages` slots); warp 1: one thread issues
           every tcgen05 MMA.

MMA order of step n (one query block of one head), single S^T and dP^T
buffers:

    dV += P_n^T dO_n,  S_(n+1) = K Q_(n+1)^T,  dK += dS_n^T Q_n,  dP_(n+1) = V dO_(n+1)^T

The dV MMA and S_(n+1) (issued once dV_n has read P_n^T) run while the
compute warpgroup turns dP_n^T into dS_n^T; the softmax of step n+1 then
runs beside dK_n and dP_(n+1).

Static cost model (estimates on paper, never measured; per CTA and query
block; M = BLOCK_KV = 128 keys, bq = block_q, D = head dim; one tcgen05 MMA
instruction per product, M x N x K with K the contraction):

    MMA issues per query block: 4  (S^T: 128 x bq x D, dP^T: 128 x bq x D,
                                    dV: 128 x D x bq, dK: 128 x D x bq)
    tensor FLOP per query block: 4 * 2 * 128 * bq * D
        D = 128, bq = 128: 16.8 MFLOP, about 2048 clocks at 8192 dense
        16-bit FLOP per clock and SM; D = 64: 8.4 MFLOP, about 1024;
        D = 192, bq = 64: 12.6 MFLOP, about 1536.
    compute warpgroup per query block: 128 * bq exp2 (one per thread and
        column: 128 per thread; soft-cap adds a tanh per element), and
        about 6 more FP32 operations per element; about 1000-1500 clocks
        on one warpgroup at bq = 128 (half at 64), so D = 128 and 192
        should be tensor-bound and D = 64 bound by this warpgroup (a
        second one, splitting the columns of S^T and dP^T, is the next
        step there).
    registers of a compute thread: the f32 factors of dS^T of its key (bq)
        and P^T or dS^T in 16 bits (bq / 2) at once, about 200 at bq = 128;
        the launch leaves 255 per thread (two warpgroups).

    TMEM (columns of 32 bits, all 128 lanes; `DkvTiles.tmem_plan`):
        dK: D, dV: D, S^T/P^T: bq, dP^T/dS^T: bq
        D = 128, bq = 128: 512 of 512;  D = 64, bq = 128: 384;
        D = 192, bq = 64: 512 (`choose_config` takes bq = 128 where it fits).
        D = 256 does not fit: dK and dV alone take all 512 columns
        (`choose_config` raises KernelUnsupported; the caller falls back).
        So one CTA per SM at either head dim.
    SMEM (bytes, 16-bit inputs; `DkvTiles.smem_bytes`):
        K, V: 2 * 128 * D * 2   (then dK, dV on their way out)
        ring: num_stages * (2 * bq * D * 2 + 2 * bq * 4)   (Q, dO, lse2, delta)
        D = 128, bq = 128, 2 stages: 64 KiB + 130 KiB = 194 KiB of 227;
        D = 64, bq = 128, 3 stages: 32 KiB + 99 KiB = 131 KiB;
        D = 192, bq = 64, 2 stages: 96 KiB + 97 KiB = 193 KiB.

Programmable scores (`build_dkv_kernel(mods=)`): the load warp and the
compute warpgroup walk, head after head of the GQA group, each query
head's block list of the CTA's keys (`DkvContext.head_walk`; the MMA warp
only counts their steps), PARTIAL blocks with the element mask and
mask_mod, FULL ones without; `_chunk_softmax` takes t and its slope from
`mod_tiles.TileMods.logits` (`sm100_backward`).

Interpreter notes (Pallas' GPU interpreter, jax 0.11.2): it aliases the two
views of a TMEM `RefUnion` by bytes, row-major, where the hardware packs two
16-bit values per 32-bit column of the same lane: a 16-bit chunk written over
S^T lands on f32 columns of *other* chunks there. `_compute_step` therefore
reads every chunk of a tile before it writes the first 16-bit chunk, which is
also correct on hardware. Its race detector wants a proxy fence between the
compute warpgroup's SMEM reads of a ring slot and the TMA that rewrites it,
and every waiter to observe every barrier phase: `DkvBarrierTable` adds both
only when interpreting.

Every barrier is declared once in `DkvBarrierTable` (name, count, who arrives,
who waits); the roles use its accessors (generated from that declaration)
only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fa4_jax import scores
from fa4_jax.kernels import KernelUnsupported
from fa4_jax.kernels.backward_inputs import segment_operands
from fa4_jax.kernels import compile_ahead
from fa4_jax.kernels.build_cache import cached_build
from fa4_jax.kernels.pipeline import (ARRIVE, COMMIT, MMA, RELEASE_TO_TMA, TMA, WAIT, WAITER, Barrier,
                                       BarrierTable, rem)
from fa4_jax.kernels.mod_tiles import ModRefs, ModStatics, TileMods, walk_block_list
from fa4_jax.kernels.sm100_tiles import (COL_VECTOR_LAYOUT, EPILOGUE_LAYOUT, ROW_LAYOUT,
                                         ROW_VECTOR_LAYOUT, SMEM_BYTES, TMEM_COLUMNS,
                                         element_mask, tile_positions)
from fa4_jax.kernels.backward_walk import KernelRefs, KeyTileWork
from fa4_jax.kernels.tiles import smem_tile
from fa4_jax.scores import MaskSpec, cdiv, walk_blocks


BLOCK_KV = 128  # keys per CTA = TMEM lanes = threads of the compute warpgroup
# Columns of S^T / dP^T the compute warpgroup loads at once (with as many
# lse2 or delta values, broadcast to every thread).
CHUNK = 32
EPILOGUE_CHUNK = 64

_SUPPORTED_HEAD_DIMS = (64, 128, 192)


# Warpgroups and the warps of the last one.
COMPUTE_WG, LOAD_MMA_WG = 0, 1
LOAD_WARP, MMA_WARP = 0, 1


# ---------------------------------------------------------------------------
# Static configuration: tile sizes, TMEM and SMEM budgets.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DkvTiles:
  head_dim: int
  dtype: jnp.dtype
  block_q: int  # query rows per step (the N of S^T, the K of dV and dK)
  num_stages: int  # slots of the Q / dO / lse2 / delta ring
  block_kv: int = BLOCK_KV

  # --- TMEM plan (columns of 32 bits, all 128 lanes) ---
  #   dK, dV       : head_dim columns each (f32 accumulators)
  #   S^T / P^T    : block_q columns (f32 scores; P^T in 16 bits, packed two
  #                  per column, over their first block_q / 2)
  #   dP^T / dS^T  : block_q columns, the same way
  def tmem_plan(self) -> dict[str, int]:
    return {"dK": self.head_dim, "dV": self.head_dim,
            "S^T/P^T": self.block_q, "dP^T/dS^T": self.block_q}

  def tmem_columns(self) -> int:
    return sum(self.tmem_plan().values())

  # --- SMEM plan (bytes) ---
  def smem_bytes(self) -> int:
    item = jnp.dtype(self.dtype).itemsize
    resident = 2 * self.block_kv * self.head_dim * item  # K, V (then dK, dV)
    ring = self.num_stages * (2 * self.block_q * self.head_dim * item  # Q, dO
                              + 2 * self.block_q * 4)  # lse2, delta
    # mbarriers, the TMEM address and alignment: 1188 bytes lowered at D64.
    barriers = 2048
    return resident + ring + barriers

  def mma_issues_per_block(self) -> int:
    """tcgen05 MMA instructions per query block: S^T, dP^T, dV, dK."""
    return 4

  def check_budgets(self) -> None:
    assert self.block_kv == BLOCK_KV, (
        f"block_kv must be {BLOCK_KV} (TMEM lanes); got {self.block_kv}")
    assert self.block_q % CHUNK == 0, f"block_q must be a multiple of {CHUNK}; got {self.block_q}"
    cols = self.tmem_columns()
    assert cols <= TMEM_COLUMNS, (
        f"TMEM plan {self.tmem_plan()} needs {cols} columns, more than the"
        f" {TMEM_COLUMNS} of an sm_100 SM (head_dim={self.head_dim}, block_q={self.block_q})")
    smem = self.smem_bytes()
    assert smem <= SMEM_BYTES, (
        f"SMEM plan needs about {smem} bytes, more than {SMEM_BYTES}"
        f" (head_dim={self.head_dim}, block_q={self.block_q}, num_stages={self.num_stages})")


def choose_config(head_dim: int, dtype) -> DkvTiles:
  """The tiling for a head dimension, checked against TMEM and SMEM: the
  largest query block (128, else 64) whose S^T and dP^T fit beside dK and
  dV in TMEM, and as many ring stages as the SMEM holds, up to 3."""
  if head_dim not in _SUPPORTED_HEAD_DIMS:
    if head_dim == 256:
      raise KernelUnsupported(
          "sm100 backward dK/dV: head_dim 256 does not fit TMEM: dK and dV of 128 keys take"
          f" 2 x 256 = {TMEM_COLUMNS} columns alone, leaving none for S^T and dP^T")
    raise KernelUnsupported(
        f"sm100 backward dK/dV: head_dim must be one of {_SUPPORTED_HEAD_DIMS}, got {head_dim}")
  block_q = 128 if 2 * head_dim + 2 * 128 <= TMEM_COLUMNS else 64
  for num_stages in (3, 2):
    tiles = DkvTiles(head_dim, jnp.dtype(dtype), block_q=block_q, num_stages=num_stages)
    if tiles.smem_bytes() <= SMEM_BYTES:
      break
  tiles.check_budgets()
  return tiles


def dkv_segment_operands(q_ids, kv_ids, tiles: DkvTiles, kv_pad: int):
  """The three segment-id operands `build_dkv_kernel(has_segments=True)`
  takes for keys padded to `kv_pad`: `backward_inputs.segment_operands` at
  this kernel's tiling (keys as rows, one tile of `block_kv` keys per CTA,
  `block_q` columns)."""
  return segment_operands(jnp.asarray(q_ids, jnp.int32), jnp.asarray(kv_ids, jnp.int32),
                          keys_are_rows=True, block_rows=tiles.block_kv, consumers=1,
                          num_ctas=cdiv(kv_pad, tiles.block_kv), block_cols=tiles.block_q)


# ---------------------------------------------------------------------------
# Barriers: all of them, with their arrival counts, in one place.
# ---------------------------------------------------------------------------


class DkvBarrierTable(BarrierTable):
  """Every mbarrier of the dK/dV kernel (cf. the forward's `ForwardBarrierTable`).

  name        count   arrivals     t-core  arrived on by                     waited on by
  kv_full     1       2 (TMA)      no      load: producer_kv (K, V bytes)    MMA: consumer_kv
  qdo_full    stages  2 (TMA)      no      load: producer_qdo (Q, dO bytes)  MMA: consumer_qdo
  qdo_free    stages  1 (MMA)      yes     MMA: consumer_qdo_release         load: producer_qdo_acquire,
                                             (dV_n, dK_n done)                     drain_ring*
  stats_full  stages  2 (TMA)      no      load: producer_stats (lse2,       compute: consumer_stats
                                             delta bytes)
  stats_free  stages  1            no      compute: consumer_stats_release   load: producer_stats_acquire,
                                                                                   drain_ring*
  s_full      1       1 (MMA)      yes     MMA: producer_s (S^T = K Q^T)     compute: consumer_s
  p_full      1       1            yes     compute: producer_p_commit        MMA: consumer_p
                                             (P^T in TMEM)
  p_free      1       1 (MMA)      yes     MMA: consumer_p_release           MMA: producer_s_acquire,
                                             (dV += P^T dO completed)              drain_tmem*
  dp_full     1       1 (MMA)      yes     MMA: producer_dp (dP^T = V dO^T)  compute: consumer_dp
  ds_full     1       1            yes     compute: producer_ds_commit       MMA: consumer_ds
                                             (dS^T in TMEM)
  ds_free     1       1 (MMA)      yes     MMA: consumer_ds_release          MMA: producer_dp_acquire,
                                             (dK += dS^T Q completed)              drain_tmem*
  acc_full    1       1 (MMA)      yes     MMA: producer_acc (every MMA      compute (epilogue):
                                             completed)                            consumer_acc

  stages = num_stages; t-core: the barrier orders tensor-core work (tcgen05
  commits arrive on it, or TMEM written by the compute warpgroup is read by
  MMAs). * interpreter only.

  S^T and dP^T need their "free" barriers although one thread issues every
  MMA: tcgen05 MMAs are ordered among themselves only when they share the
  accumulator, and S^T = K Q^T (accumulator S^T) does not share one with
  dV += P^T dO (which reads P^T from S^T's columns).
  """

  BARRIERS = {
      # name: Barrier(per "one" or "stage", arrivals, orders tensor core,
      #               arrived on by {accessor: how}, waited on by {accessor: how})
      "kv_full": Barrier("one", 2, False, arrive={"producer_kv": TMA},
                         wait={"consumer_kv": WAITER}),
      "qdo_full": Barrier("stage", 2, False, arrive={"producer_qdo": TMA},
                          wait={"consumer_qdo": WAITER}),
      "qdo_free": Barrier("stage", 1, True, arrive={"consumer_qdo_release": COMMIT},
                          wait={"producer_qdo_acquire": WAIT}),
      "stats_full": Barrier("stage", 2, False, arrive={"producer_stats": TMA},
                            wait={"consumer_stats": WAITER}),
      "stats_free": Barrier("stage", 1, False, arrive={"consumer_stats_release": RELEASE_TO_TMA},
                            wait={"producer_stats_acquire": WAIT}),
      "s_full": Barrier("one", 1, True, arrive={"producer_s": MMA},
                        wait={"consumer_s": WAITER}),
      "p_full": Barrier("one", 1, True, arrive={"producer_p_commit": ARRIVE},
                        wait={"consumer_p": WAITER}),
      "p_free": Barrier("one", 1, True, arrive={"consumer_p_release": MMA},
                        wait={"producer_s_acquire": WAIT}),
      "dp_full": Barrier("one", 1, True, arrive={"producer_dp": MMA},
                         wait={"consumer_dp": WAITER}),
      "ds_full": Barrier("one", 1, True, arrive={"producer_ds_commit": ARRIVE},
                         wait={"consumer_ds": WAITER}),
      "ds_free": Barrier("one", 1, True, arrive={"consumer_ds_release": MMA},
                         wait={"producer_dp_acquire": WAIT}),
      "acc_full": Barrier("one", 1, True, arrive={"producer_acc": COMMIT},
                          wait={"consumer_acc": WAITER}),
  }

  @staticmethod
  def barrier_counts(tiles: DkvTiles) -> dict:
    return {"one": 1, "stage": tiles.num_stages}

  # Interpreter-only drains of the last phases (see `BarrierTable`).
  def drain_ring(self, num_steps) -> None:
    """Load warp: observe the qdo_free / stats_free phases of the last lap."""
    self._drain_last_lap(num_steps, "qdo_free", "stats_free")

  def drain_tmem(self) -> None:
    """MMA warp: observe the p_free / ds_free phases of the last step."""
    if self._interpreting:
      self.producer_s_acquire()
      self.producer_dp_acquire()


# ---------------------------------------------------------------------------
# The kernel: a context that every role reads, one function per role.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DkvStatics:
  """What `build_dkv_kernel` fixes at trace time, the same for every CTA."""

  tiles: DkvTiles
  mask: MaskSpec
  score: scores.ScoreFunction  # how S^T becomes the logits, and their slope
  mods: ModStatics | None = None  # programmable scores; None without them

  @property
  def exp2_scale(self) -> float:
    """c in P = exp2(c t - lse2) (`ScoreFunction.exp2_constant`)."""
    return self.score.exp2_constant


@dataclasses.dataclass(frozen=True)
class DkvRefs:
  """SMEM and TMEM scratch (the GMEM operands are a `KernelRefs`)."""

  k_smem: Any  # K tile, then dK on its way out
  v_smem: Any  # V tile, then dV
  q_smem: Any  # ring of Q tiles
  do_smem: Any  # ring of dO tiles
  lse_smem: Any  # ring of lse2 rows
  delta_smem: Any  # ring of delta rows
  st_tmem: Any  # S^T / P^T (RefUnion: P^T over S^T's columns)
  dpt_tmem: Any  # dP^T / dS^T
  dk_tmem: Any
  dv_tmem: Any


@dataclasses.dataclass(frozen=True)
class DkvContext:
  """What every role reads: statics, refs, barriers and this CTA's walk."""

  statics: DkvStatics
  gmem: KernelRefs
  refs: DkvRefs
  bars: DkvBarrierTable
  work: KeyTileWork
  num_steps: Any  # group * query blocks per head, or every head's list (traced)
  out: tuple  # (dk_ref, dv_ref) in GMEM
  mod_refs: ModRefs | None = None  # programmable scores: block lists per query head

  def head_walk(self, g):
    """With mods: (the block list of the CTA's keys for the GQA group's g-th
    query head, that head)."""
    w = self.work
    return self.mod_refs.group_walk(self.statics.mods, w.batch_idx, w.kv_head, w.kv_tile,
                                    w.group, g)

  @property
  def tiles(self) -> DkvTiles:
    return self.statics.tiles

  def slot(self, step):
    return rem(step, self.tiles.num_stages)

  @property
  def s_tmem(self):
    return self.refs.st_tmem[0]

  @property
  def p_tmem(self):
    return self.refs.st_tmem[1]

  @property
  def dp_tmem(self):
    return self.refs.dpt_tmem[0]

  @property
  def ds_tmem(self):
    return self.refs.dpt_tmem[1]

  def keys(self):
    """GMEM index of this CTA's key tile in K, V, dK, dV."""
    w = self.work
    return (w.batch_idx, pl.ds(w.k_lo, BLOCK_KV), w.kv_head)


# ----------------------------- load warp -------------------------------------


def load_warp(ctx: DkvContext) -> None:
  """TMA loads: K and V once, then (Q, dO) and (lse2, delta) of every step."""
  refs, bars, gmem, work = ctx.refs, ctx.bars, ctx.gmem, ctx.work
  bq, stages = ctx.tiles.block_q, ctx.tiles.num_stages

  @pl.when(ctx.num_steps > 0)
  def _():
    plgpu.copy_gmem_to_smem(gmem.k.at[ctx.keys()], refs.k_smem, bars.producer_kv())
    plgpu.copy_gmem_to_smem(gmem.v.at[ctx.keys()], refs.v_smem, bars.producer_kv())

  def load_block(step, rows_of):
    """Ring step `step`: query block qb of query `head`, (head, qb) = rows_of()."""
    slot = ctx.slot(step)
    head, qb = rows_of()
    rows = (work.batch_idx, pl.ds(qb * bq, bq), head)
    stats = (work.batch_idx, head, pl.ds(qb * bq, bq))

    @pl.when(step >= stages)
    def _():
      bars.producer_qdo_acquire(slot)

    plgpu.copy_gmem_to_smem(gmem.q.at[rows], refs.q_smem.at[slot], bars.producer_qdo(slot))
    plgpu.copy_gmem_to_smem(gmem.do.at[rows], refs.do_smem.at[slot], bars.producer_qdo(slot))

    @pl.when(step >= stages)
    def _():
      bars.producer_stats_acquire(slot)

    plgpu.copy_gmem_to_smem(gmem.lse.at[stats], refs.lse_smem.at[slot],
                            bars.producer_stats(slot))
    plgpu.copy_gmem_to_smem(gmem.delta.at[stats], refs.delta_smem.at[slot],
                            bars.producer_stats(slot))

  if ctx.mod_refs is None:
    pl.loop(0, ctx.num_steps)(lambda step: load_block(step, lambda: work.rows_of(step)))
  else:  # each query head's block list, one after the other
    def one_head(g, step0):
      walk, head = ctx.head_walk(g)
      pl.loop(0, walk.total)(lambda n: load_block(step0 + n, lambda: (head, walk.block(n))))
      return step0 + walk.total

    lax.fori_loop(0, work.group, one_head, jnp.int32(0))
  bars.drain_ring(ctx.num_steps)


# ----------------------------- MMA warp --------------------------------------


def _s_mma(ctx: DkvContext, step) -> None:
  """S^T = K Q^T (Q^T: the k-major view of the slot's Q tile)."""
  q_t = ctx.refs.q_smem.at[ctx.slot(step)].T
  plgpu.tcgen05_mma(ctx.s_tmem, ctx.refs.k_smem, q_t, ctx.bars.producer_s(), accumulate=False)


def _dp_mma(ctx: DkvContext, step) -> None:
  """dP^T = V dO^T."""
  do_t = ctx.refs.do_smem.at[ctx.slot(step)].T
  plgpu.tcgen05_mma(ctx.dp_tmem, ctx.refs.v_smem, do_t, ctx.bars.producer_dp(),
                    accumulate=False)


def mma_warp(ctx: DkvContext) -> None:
  """One thread issues every tcgen05 MMA, in the order of the module docstring."""
  bars, refs, n_steps = ctx.bars, ctx.refs, ctx.num_steps

  @pl.when(n_steps > 0)
  def _():
    bars.consumer_kv().wait()
    bars.consumer_qdo(0).wait()
    _s_mma(ctx, 0)
    _dp_mma(ctx, 0)

    @pl.loop(0, n_steps)
    def _(n):
      slot = ctx.slot(n)
      has_next = n + 1 < n_steps
      bars.consumer_p().wait()
      plgpu.tcgen05_mma(refs.dv_tmem, ctx.p_tmem, refs.do_smem.at[slot],
                        bars.consumer_p_release(), accumulate=n > 0)

      @pl.when(has_next)
      def _():
        bars.consumer_qdo(ctx.slot(n + 1)).wait()
        bars.producer_s_acquire()
        _s_mma(ctx, n + 1)

      bars.consumer_ds().wait()
      plgpu.tcgen05_mma(refs.dk_tmem, ctx.ds_tmem, refs.q_smem.at[slot],
                        bars.consumer_ds_release(), accumulate=n > 0)
      bars.consumer_qdo_release(slot)

      @pl.when(has_next)
      def _():
        bars.producer_dp_acquire()
        _dp_mma(ctx, n + 1)

    bars.producer_acc()
    bars.drain_tmem()


# ----------------------------- compute warpgroup -----------------------------


def _chunk_softmax(ctx: DkvContext, s, lse2, *, k_lo, q_lo, masked, key_ids,
                   tile_mods: TileMods | None = None):
  """(P^T, w) of one chunk of S^T (keys along rows, queries [q_lo, q_lo +
  CHUNK) along columns): P^T = exp2(c t - lse2), 0 where the element mask
  hides a pair (`masked` blocks only); w = P^T, or P^T times the logits'
  slope (soft-cap: 1 - t^2), the factor of dS^T (as
  `sm90_backward_common.tile_softmax`).
  With `tile_mods` (programmable scores) t and its slope come from
  `TileMods.logits` and a masked block's element mask includes mask_mod."""
  st, work = ctx.statics, ctx.work
  if tile_mods is None:
    t, slope = st.score.logits(s), None
  else:
    q_idx, kv_idx = tile_positions(s.shape, row_lo=k_lo, col_lo=q_lo, keys_along_rows=True)
    t, slope = tile_mods.logits(s, q_idx, kv_idx, score=st.score, with_slope=True)
  logits2 = t * st.exp2_scale - lax.broadcast_in_dim(lse2, s.shape, [1])
  if masked:
    segments = (None if key_ids is None
                else (key_ids, ctx.gmem.segments.q_ids, work.batch_idx))
    ok = element_mask(st.mask, s.shape, row_lo=k_lo, col_lo=q_lo, keys_along_rows=True,
                      kv_len=work.kv_len, q_len=work.q_len, segments=segments,
                      mask_mod=None if tile_mods is None else tile_mods.mask_hook())
    logits2 = jnp.where(ok, logits2, -jnp.inf)
  p = jnp.exp2(logits2)
  if tile_mods is None:
    slope = st.score.slope(t)  # after the exp2, as t's last use
  return p, (p if slope is None else p * slope)


def _compute_step(ctx: DkvContext, key_ids, step, qb, carry, *, masked, tile_mods=None):
  """Query block qb of one head at ring step `step`: S^T -> P^T,
  then dP^T -> dS^T, in TMEM. Scores are read column chunk by chunk; every
  chunk of a tile is read before the first 16-bit chunk is written over the
  tile's columns (the packed layout puts a 16-bit chunk over f32 columns of
  other chunks, and the interpreter aliases the two views by bytes, not by
  lane and column as the hardware does)."""
  bars, refs, tiles = ctx.bars, ctx.refs, ctx.tiles
  slot = ctx.slot(step)
  q_lo, k_lo = qb * tiles.block_q, ctx.work.k_lo
  chunks = [pl.ds(c, CHUNK) for c in range(0, tiles.block_q, CHUNK)]
  bars.consumer_stats(slot).wait()
  bars.consumer_s().wait()
  probs, weights = [], []  # P^T in 16 bits, and the f32 factors of dS^T
  for cols in chunks:
    s = plgpu.async_load_tmem(ctx.s_tmem.at[:, cols], layout=ROW_LAYOUT)
    lse2 = plgpu.load(refs.lse_smem.at[slot, cols], layout=COL_VECTOR_LAYOUT)
    p, w = _chunk_softmax(ctx, s, lse2, k_lo=k_lo, q_lo=q_lo + cols.start, masked=masked,
                          key_ids=key_ids, tile_mods=tile_mods)
    probs.append(p.astype(tiles.dtype))
    weights.append(w)
  _store_chunks(ctx.p_tmem, chunks, probs)
  bars.producer_p_commit()

  bars.consumer_dp().wait()
  grads = []
  for cols, w in zip(chunks, weights):
    dp = plgpu.async_load_tmem(ctx.dp_tmem.at[:, cols], layout=ROW_LAYOUT)
    delta = plgpu.load(refs.delta_smem.at[slot, cols], layout=COL_VECTOR_LAYOUT)
    grads.append((w * (dp - lax.broadcast_in_dim(delta, dp.shape, [1]))).astype(tiles.dtype))
  bars.consumer_stats_release(slot)
  _store_chunks(ctx.ds_tmem, chunks, grads)
  bars.producer_ds_commit()
  return carry


def _store_chunks(tmem, chunks, values) -> None:
  """16-bit column chunks into TMEM, once every pending TMEM load completed."""
  plgpu.wait_load_tmem()
  for cols, x in zip(chunks, values):
    plgpu.async_store_tmem(tmem.at[:, cols], x)
  plgpu.commit_tmem()


def compute_wg(ctx: DkvContext) -> None:
  """P^T and dS^T of every step (heads of the group one after the other,
  each over its query blocks: masked / full / masked), then the epilogue."""
  work = ctx.work

  @pl.when(ctx.num_steps > 0)
  def _():
    key_ids = None
    if ctx.gmem.segments is not None:
      key_ids = plgpu.load(ctx.gmem.segments.kv_ids.at[work.batch_idx, pl.ds(work.k_lo, BLOCK_KV)],
                           layout=ROW_VECTOR_LAYOUT, optimized=False)

    def one_head(g, carry):
      head_step0 = g * work.blocks_per_head
      step = lambda qb, carry, *, masked: _compute_step(
          ctx, key_ids, head_step0 + (qb - work.lo), qb, carry, masked=masked)
      # One consumer per CTA: its own blocks are the CTA's, nothing to skip.
      return walk_blocks(work.lo, work.hi, work.ranges, step, lambda qb, carry: carry, carry)

    def one_head_list(g, step0):
      """Programmable scores: the head's block list, PARTIAL blocks masked."""
      walk, head = ctx.head_walk(g)
      tile_mods = ctx.mod_refs.on_rows(ctx.statics.mods, work.batch_idx, head)
      step = lambda n, qb, carry, *, masked: _compute_step(
          ctx, key_ids, n, qb, carry, masked=masked, tile_mods=tile_mods)
      walk_block_list(walk, step, 0, step0)
      return step0 + walk.total

    if ctx.mod_refs is None:
      lax.fori_loop(0, work.group, one_head, 0)
    else:
      lax.fori_loop(0, work.group, one_head_list, jnp.int32(0))
    epilogue(ctx)

  @pl.when(ctx.num_steps == 0)
  def _():
    epilogue_no_queries(ctx)


# ----------------------------- epilogue (compute warpgroup) ------------------


def _store_tiles(ctx: DkvContext, dk_chunk, dv_chunk, dk_ref, dv_ref) -> None:
  """dK and dV (column chunk by chunk) to GMEM through the K and V tiles."""
  refs = ctx.refs
  for c in range(0, ctx.tiles.head_dim, EPILOGUE_CHUNK):
    cols = pl.ds(c, EPILOGUE_CHUNK)
    refs.k_smem[:, cols] = dk_chunk(cols)
    refs.v_smem[:, cols] = dv_chunk(cols)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(refs.k_smem, dk_ref.at[ctx.keys()])
  plgpu.copy_smem_to_gmem(refs.v_smem, dv_ref.at[ctx.keys()])
  plgpu.wait_smem_to_gmem(0)


def epilogue(ctx: DkvContext) -> None:
  """dK * scale and dV once the last MMA completed; K and V are dead (every
  MMA reading them completed), so their tiles carry the results out."""
  dk_ref, dv_ref = ctx.out
  refs, dtype = ctx.refs, ctx.tiles.dtype
  ctx.bars.consumer_acc().wait()

  def dk_chunk(cols):
    dk = plgpu.async_load_tmem(refs.dk_tmem.at[:, cols], layout=EPILOGUE_LAYOUT)
    return (dk * ctx.statics.score.scale).astype(dtype)

  def dv_chunk(cols):
    return plgpu.async_load_tmem(refs.dv_tmem.at[:, cols], layout=EPILOGUE_LAYOUT).astype(dtype)

  _store_tiles(ctx, dk_chunk, dv_chunk, dk_ref, dv_ref)


def epilogue_no_queries(ctx: DkvContext) -> None:
  """No query sees this CTA's keys: zeros (nothing was loaded into K, V)."""
  dk_ref, dv_ref = ctx.out
  zeros = lambda cols: jnp.zeros((BLOCK_KV, EPILOGUE_CHUNK), ctx.tiles.dtype)
  _store_tiles(ctx, zeros, zeros, dk_ref, dv_ref)


# ----------------------------- dispatch --------------------------------------


def dispatch_roles(ctx: DkvContext, wg) -> None:
  """Each warpgroup (and each warp of the last one) runs its role."""
  pl.when(wg == COMPUTE_WG)(lambda: compute_wg(ctx))

  @pl.when(wg == LOAD_MMA_WG)
  def _():
    @plgpu.warp_map
    def _(warp):
      pl.when(warp == LOAD_WARP)(lambda: load_warp(ctx))
      pl.when(warp == MMA_WARP)(lambda: mma_warp(ctx))


def _scratch_types(tiles: DkvTiles) -> dict:
  bk, bq, d, stages, dtype = (tiles.block_kv, tiles.block_q, tiles.head_dim,
                              tiles.num_stages, tiles.dtype)
  return dict(
      k_smem=smem_tile((bk, d), dtype),
      v_smem=smem_tile((bk, d), dtype),
      q_smem=smem_tile((stages, bq, d), dtype),
      do_smem=smem_tile((stages, bq, d), dtype),
      lse_smem=plgpu.SMEM((stages, bq), jnp.float32),
      delta_smem=plgpu.SMEM((stages, bq), jnp.float32),
      # f32 scores and their 16-bit successors share TMEM columns.
      st_tmem=plgpu.RefUnion(plgpu.TMEM((bk, bq), jnp.float32),
                             plgpu.TMEM((bk, bq), dtype, packed=True)),
      dpt_tmem=plgpu.RefUnion(plgpu.TMEM((bk, bq), jnp.float32),
                              plgpu.TMEM((bk, bq), dtype, packed=True)),
      dk_tmem=plgpu.TMEM((bk, d), jnp.float32),
      dv_tmem=plgpu.TMEM((bk, d), jnp.float32),
      barrier_refs=DkvBarrierTable.scratch_types(tiles),
  )


@cached_build
def build_dkv_kernel(*, batch, q_seq, kv_seq, kv_valid, num_q_heads, num_kv_heads, head_dim,
                     dtype, score: scores.ScoreFunction, mask, block_kv, block_q, num_stages,
                     has_q_lengths, has_kv_lengths, has_segments=False,
                     mods: ModStatics | None = None):
  """The dK/dV kernel: `(q, k, v, dout, lse2, delta, *lengths, *segments)
  -> (dk, dv)`.

  q, dout [B, q_seq, Nq, D]; k, v [B, kv_seq, Nkv, D] (sequences padded to
  multiples of 8; keys at or past `kv_valid` are padding); lse2, delta f32
  [B, Nq, >= q_seq rounded up to block_q] (`backward_inputs.preprocess`:
  lse2 = +inf on rows that must not contribute); lengths: [q_lengths] if
  `has_q_lengths`, then [kv_lengths] if `has_kv_lengths` (int32 [B]); with
  `has_segments` the three operands of `dkv_segment_operands`; with `mods`,
  then `ModRefs`' operands (block lists of the 128-key tiles by `block_q`
  queries, one per key tile and query head or for every head).
  dk, dv [B, kv_seq, Nkv, D] in `dtype`, summed over each GQA group.
  """
  tiles = DkvTiles(head_dim, jnp.dtype(dtype), block_q=block_q, num_stages=num_stages,
                   block_kv=block_kv)
  tiles.check_budgets()
  statics = DkvStatics(tiles, mask, score, mods=mods)
  group = num_q_heads // num_kv_heads

  def kernel(*refs, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, st_tmem, dpt_tmem,
             dk_tmem, dv_tmem, barrier_refs):
    gmem, rest = KernelRefs.split(refs, has_q_lengths, has_kv_lengths,
                                  1 if has_segments else None)
    mod_refs, (dk_ref, dv_ref) = ModRefs.split(rest, mods)
    work = KeyTileWork.of_this_cta(num_keys=BLOCK_KV, block_q=block_q, mask=mask, gmem=gmem,
                                   q_seq=q_seq, kv_valid=kv_valid, group=group)
    scratch = DkvRefs(k_smem=k_smem, v_smem=v_smem, q_smem=q_smem, do_smem=do_smem,
                      lse_smem=lse_smem, delta_smem=delta_smem, st_tmem=st_tmem,
                      dpt_tmem=dpt_tmem, dk_tmem=dk_tmem, dv_tmem=dv_tmem)
    num_steps = work.num_steps
    if mods is not None:  # every query head's block list of these keys
      num_steps = mod_refs.group_steps(mods, work.batch_idx, work.kv_head, work.kv_tile, group)
    ctx = DkvContext(statics, gmem, scratch, DkvBarrierTable(tiles, barrier_refs), work,
                     num_steps=num_steps, out=(dk_ref, dv_ref), mod_refs=mod_refs)
    dispatch_roles(ctx, lax.axis_index("wg"))

  out_type = (jax.ShapeDtypeStruct((batch, kv_seq, num_kv_heads, head_dim), jnp.dtype(dtype)),) * 2
  return plgpu.kernel(
      compile_ahead.named(kernel, "sm100_dkdv"),
      out_type=out_type,
      grid=(num_kv_heads, cdiv(kv_seq, BLOCK_KV), batch),
      grid_names=("heads", "kv_tiles", "batch"),
      num_threads=2,
      thread_name="wg",
      scratch_types=_scratch_types(tiles),
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )
