"""The dQ kernel of the Blackwell (sm_100) backward: TMEM accumulators, tcgen05 MMAs.

One CTA per (query head, 128-row Q tile, batch) walks the key blocks its rows
may see (`scores.kv_tile_ranges`, narrowed by the segment ids' ranges), the
forward's walk. Per key block n (buf = n % score_buffers):

    S_n  = Q K_n^T       (TMEM, f32)            MMA warp
    dP_n = dO V_n^T      (TMEM, f32)            MMA warp
    P    = exp2(c t - lse2), t = S or tanh(scale S / cap)
    dS_n = P (1 - t^2 with soft-cap) (dP_n - delta)
         -> 16-bit, over S_n's columns (TMEM)   compute warpgroup
    dQ  += dS_n K_n      (TMEM, f32; A from TMEM, B = K from SMEM)

and at the end dQ * scale goes TMEM -> registers -> SMEM (over the dead Q
tile) -> TMA. Every dQ element is written by exactly one CTA: deterministic,
no atomics. lse2 and delta come from `backward_inputs.preprocess` (lse2 = +inf
on rows that must not contribute), so dead rows need no special case.

Roles (score_buffers + 1 warpgroups):

    wg b   compute, one per score buffer b: dS_n of the blocks n with
           n % score_buffers == b; wg 0 then runs the epilogue.
    last   warp 0: TMA loads (Q, dO, lse2, delta once; K_n, V_n into a ring
           of `num_stages` slots); warp 1: every tcgen05 MMA (one thread).

With two score buffers the MMA warp issues S_(n+1) and dP_(n+1) before
dQ += dS_n K_n, so the tensor core computes block n+1 while a compute
warpgroup turns block n into dS_n, and the two compute warpgroups work on
consecutive blocks at once (as the forward's two softmax warpgroups do):

    S_0, dP_0 | S_1, dP_1, dQ += dS_0 K_0 | S_2, dP_2, dQ += dS_1 K_1 | ...

Static cost model (per CTA and key block; bf16/fp16 MMAs are issued in
K-steps of 16, M = 128, N <= 256 per instruction):

    head dim  block_kv  stages  buffers  tcgen05.mma per block     TMEM cols      SMEM (KiB)
    64        64        3       2        S 4 + dP 4 + dQ 4 = 12    64+4*64=320    2*16 + 3*16 + 3 = 83
    128       64        3       2        S 8 + dP 8 + dQ 4 = 20    128+4*64=384   2*32 + 3*32 + 3 = 163
    256       64        1       1        S 16 + dP 16 + dQ 4 = 36  256+2*64=384   2*64 + 1*64 + 3 = 195

The instruction counts are read off the lowering in
tests/test_sm100_backward_dq.py. MMA work per block: 3 * 128 * block_kv *
head_dim MACs (S, dP, dQ). The compute warpgroup's per block: 128 * block_kv
exp2 (two MUFU ops per element with soft-cap), ~6 FMA-class ops per element,
TMEM loads of S and dP (2 * block_kv columns) and one 16-bit store of
block_kv / 2 columns, with S and dP (2 * block_kv f32 registers per thread)
live at once. Mosaic GPU allocates TMEM in powers of two: every plan above
allocates all 512 columns, so one CTA per SM (SMEM allows one at head dims
128 and 256 anyway; at 64 a plan of <= 256 columns would let two share an SM).

Why these tiles. TMEM (512 columns): dQ takes head_dim columns for the whole
walk, each score buffer S (block_kv, dS packed over it) + dP (block_kv).
64-key blocks keep S and dP of a block in the compute warpgroup's registers
(128 per thread; 128 keys would need 256, i.e. chunked TMEM loads) and let
two score buffers fit at head dims 64 and 128. The dQ MMA's K is block_kv,
which Mosaic GPU issues in groups of 64 under K's 128-byte swizzle ("K must
be a multiple of 64" when lowering; the interpreter does not check it), so
blocks have at least 64 keys. At head dim 256 the dQ accumulator takes half
the TMEM; two score buffers of 64 keys would fit TMEM (512 columns) but not
SMEM beyond one K/V stage (Q and dO 128 KiB, each stage of K and V 64 KiB),
and with one stage the MMA warp cannot run a block ahead (S_(n+1) needs
K_(n+1) in the slot dQ += dS_n K_n still reads: `check_budgets` refuses
num_stages < score_buffers). So head dim 256 runs serially, one stage and one
score buffer: correct (tested) but expected slow. The shared plan has no
dK/dV kernel at 256 (dK + dV alone fill TMEM), so the backward falls back to
XLA there anyway. SMEM: Q and dO tiles resident (Q's later holds dQ on its
way out), the K and V rings, lse2 and delta rows, barriers.

Segment ids: the CTA walks the blocks its tile's ids may meet
(`backward_inputs.segment_operands(keys_are_rows=False, consumers=1)`); blocks
of the tile's one-id run need no element mask; masked blocks load their
keys' ids from GMEM (as the forward does). Soft-cap: the compute warpgroup
recomputes t = tanh(scale s / cap) (`ScoreFunction.logits`) and multiplies
dS by its slope 1 - t^2 (`ScoreFunction.slope`).

Programmable scores (`build_dq_kernel(mods=)`): the CTA walks its tile's
block list instead of its key range (`DqContext.key_block`), PARTIAL blocks
with the element mask and mask_mod, FULL ones without; `_grad_block` takes
t and its slope from `mod_tiles.TileMods.logits` (`sm100_backward`).

What is not here yet (measured nowhere: no Blackwell GPU): 128-key blocks
with chunked TMEM loads, a persistent grid, register counts from ptxas.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fa4_jax import scores
from fa4_jax.interpret import is_interpreting
from fa4_jax.kernels import KernelUnsupported
from fa4_jax.kernels import compile_ahead
from fa4_jax.kernels.build_cache import cached_build
from fa4_jax.kernels.mod_tiles import BlockList, ModRefs, ModStatics, TileMods, walk_block_list
from fa4_jax.kernels.pipeline import (ARRIVE, COMMIT, MMA, TMA, WAIT, WAITER, Barrier, rem,
                                       sequence_lengths)
from fa4_jax.kernels.backward_inputs import segment_operands
from fa4_jax.kernels.sm100_tiles import (EPILOGUE_LAYOUT, ROW_LAYOUT, ROW_VECTOR_LAYOUT,
                                         SMEM_BYTES, TMEM_COLUMNS, element_mask, tile_positions)
from fa4_jax.kernels.sm100_tiles import KV_RINGS, KvRingBarrierTable
from fa4_jax.kernels.backward_walk import KernelRefs, narrow
from fa4_jax.kernels.tiles import smem_transforms
from fa4_jax.scores import MaskSpec, TileRanges, cdiv, walk_blocks

BLOCK_Q = 128  # rows of the Q tile = TMEM lanes = threads of the compute warpgroup
# tcgen05 MMAs are issued in K groups of 128 bytes of the swizzled operands:
# 64 16-bit elements (dQ += dS K has K = block_kv).
MMA_K_GROUP = 64
EPILOGUE_CHUNK = 64  # dQ columns read from TMEM at once in the epilogue
_SUPPORTED_HEAD_DIMS = (64, 128, 256)


# ---------------------------------------------------------------------------
# Static tiling: TMEM and SMEM plans.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DqTiles:
  head_dim: int
  dtype: Any
  block_kv: int  # keys per K/V block
  num_stages: int  # slots of the K ring and of the V ring
  score_buffers: int = 2  # S/dS + dP pairs in TMEM (2: block n+1's MMAs overlap dS_n)
  block_q: int = BLOCK_Q

  # --- TMEM plan (columns of 32 bits, all 128 lanes) ---
  #   dQ       : head_dim columns (f32 accumulator), the whole walk
  #   S_b/dS_b : block_kv columns (f32 S; dS in 16 bits, two per column, over it)
  #   dP_b     : block_kv columns (f32)
  def tmem_plan(self) -> dict[str, int]:
    plan = {"dQ": self.head_dim}
    for b in range(self.score_buffers):
      plan[f"S{b}/dS{b}"] = self.block_kv
      plan[f"dP{b}"] = self.block_kv
    return plan

  def tmem_columns(self) -> int:
    return sum(self.tmem_plan().values())

  # --- SMEM plan (bytes) ---
  def smem_plan(self) -> dict[str, int]:
    item = jnp.dtype(self.dtype).itemsize
    tile = self.block_q * self.head_dim * item
    block = self.block_kv * self.head_dim * item
    return {
        "Q (then dQ)": tile,
        "dO": tile,
        "K ring": self.num_stages * block,
        "V ring": self.num_stages * block,
        "lse2, delta": 2 * self.block_q * 4,
        # < 30 mbarriers of 8 bytes, the TMEM address, alignment (cross-lowered:
        # the allocation stays within this plan, tests/test_sm100_backward_dq.py)
        "barriers and alignment": 2048,
    }

  def smem_bytes(self) -> int:
    return sum(self.smem_plan().values())

  def mma_instructions_per_block(self) -> dict[str, int]:
    """tcgen05.mma instructions per key block (16-bit: K-steps of 16)."""
    return {"S": self.head_dim // 16, "dP": self.head_dim // 16, "dQ": self.block_kv // 16}

  def check_budgets(self) -> None:
    if self.block_q != BLOCK_Q:
      raise KernelUnsupported(
          f"sm100 dQ: block_q must be {BLOCK_Q} (TMEM lanes); got {self.block_q}")
    if self.block_kv % MMA_K_GROUP:
      raise KernelUnsupported(
          f"sm100 dQ: block_kv must be a multiple of {MMA_K_GROUP} (the K of dQ += dS K under"
          f" K's 128-byte swizzle); got {self.block_kv}")
    if self.num_stages < self.score_buffers:
      raise KernelUnsupported(
          f"sm100 dQ: {self.score_buffers} score buffers need as many K/V stages (the MMA warp"
          f" runs {self.score_buffers - 1} block(s) ahead); got num_stages={self.num_stages}")
    cols = self.tmem_columns()
    if cols > TMEM_COLUMNS:
      raise KernelUnsupported(
          f"sm100 dQ: TMEM plan {self.tmem_plan()} needs {cols} columns, more than the"
          f" {TMEM_COLUMNS} of an sm_100 SM (head_dim={self.head_dim}, block_kv={self.block_kv})")
    smem = self.smem_bytes()
    if smem > SMEM_BYTES:
      raise KernelUnsupported(
          f"sm100 dQ: SMEM plan {self.smem_plan()} needs about {smem} bytes, more than"
          f" {SMEM_BYTES} (head_dim={self.head_dim}, block_kv={self.block_kv},"
          f" num_stages={self.num_stages})")


def choose_config(head_dim: int, dtype) -> DqTiles:
  """The tiling for a head dimension, checked against TMEM and SMEM (see the
  module docstring for why these sizes)."""
  if head_dim == 64:
    tiles = DqTiles(head_dim, jnp.dtype(dtype), block_kv=64, num_stages=3)
  elif head_dim == 128:
    tiles = DqTiles(head_dim, jnp.dtype(dtype), block_kv=64, num_stages=3)
  elif head_dim == 256:
    tiles = DqTiles(head_dim, jnp.dtype(dtype), block_kv=64, num_stages=1, score_buffers=1)
  else:
    raise KernelUnsupported(
        f"sm100 dQ: head_dim must be one of {_SUPPORTED_HEAD_DIMS}, got {head_dim}")
  tiles.check_budgets()
  return tiles


# ---------------------------------------------------------------------------
# Barriers: all of them, with their arrival counts, in one place.
# ---------------------------------------------------------------------------


class DqBarrierTable(KvRingBarrierTable):
  """Every mbarrier of the dQ kernel (cf. `sm100_forward.ForwardBarrierTable`).

  name        count    arrivals  t-core  arrived on by                     waited on by
  q_full      1        2 (TMA)   no      load: producer_q (Q, dO bytes)    MMA: consumer_q
  stats_full  1        2 (TMA)   no      load: producer_stats (lse2,       compute: consumer_stats
                                           delta bytes)
  k_full      stages   1 (TMA)   no      load: producer_k                  MMA: consumer_k
  k_free      stages   1 (MMA)   yes     MMA: consumer_k_release (after    load: producer_k_acquire,
                                           dQ += dS K)                             drain_kv_rings*
  v_full      stages   1 (TMA)   no      load: producer_v                  MMA: consumer_v
  v_free      stages   1 (MMA)   yes     MMA: consumer_v_release (after    load: producer_v_acquire,
                                           dP = dO V^T)                            drain_kv_rings*
  s_full      buffers  1 (MMA)   yes     MMA: producer_s (S_n = Q K^T)     compute: consumer_s
  dp_full     buffers  1 (MMA)   yes     MMA: producer_dp (dP_n = dO V^T)  compute: consumer_dp
  ds_full     buffers  1         yes     compute: producer_ds_commit       MMA: consumer_ds
                                           (dS_n in TMEM; S_n, dP_n read)
  dq_done     buffers  1 (MMA)   yes     MMA: producer_dq (dQ += dS_n K)   MMA: producer_s_acquire
                                                                             (before S_(n+buffers)
                                                                             overwrites dS_n),
                                                                             drain_dq*
  dq_final    1        1 (MMA)   yes     MMA: producer_dq_final (every     compute (epilogue):
                                           MMA completed)                    consumer_dq_final

  stages = num_stages, buffers = score_buffers; t-core: the barrier orders
  tensor-core work (tcgen05 commits arrive on it, or it hands TMEM written
  by threads to an MMA). * interpreter only.

  dP_b needs no "free" barrier: the compute warpgroup has read dP_n before it
  arrives on ds_full, and the MMA warp waits on ds_full of block n before it
  issues dP_(n+buffers). S_b's is dq_done (dS_n lives in its columns until
  the dQ MMA read it; tcgen05 MMAs of one thread are ordered among
  themselves only when they share the accumulator, as in the forward).
  """

  BARRIERS = {
      # name: Barrier(per "one", "stage" or "buffer", arrivals, orders tensor core,
      #               arrived on by {accessor: how}, waited on by {accessor: how})
      "q_full": Barrier("one", 2, False, arrive={"producer_q": TMA}, wait={"consumer_q": WAITER}),
      "stats_full": Barrier("one", 2, False, arrive={"producer_stats": TMA},
                            wait={"consumer_stats": WAITER}),
      **KV_RINGS,
      "s_full": Barrier("buffer", 1, True, arrive={"producer_s": MMA},
                        wait={"consumer_s": WAITER}),
      "dp_full": Barrier("buffer", 1, True, arrive={"producer_dp": MMA},
                         wait={"consumer_dp": WAITER}),
      "ds_full": Barrier("buffer", 1, True, arrive={"producer_ds_commit": ARRIVE},
                         wait={"consumer_ds": WAITER}),
      "dq_done": Barrier("buffer", 1, True, arrive={"producer_dq": MMA},
                         wait={"producer_s_acquire": WAIT}),
      "dq_final": Barrier("one", 1, True, arrive={"producer_dq_final": COMMIT},
                          wait={"consumer_dq_final": WAITER}),
  }

  @staticmethod
  def barrier_counts(tiles: DqTiles) -> dict:
    return {"one": 1, "stage": tiles.num_stages, "buffer": tiles.score_buffers}

  def __init__(self, tiles: DqTiles, refs: dict):
    super().__init__(tiles, refs)
    self.tiles = tiles  # for for_each_buffer

  # Interpreter-only drains of the last phases (see `BarrierTable`), with
  # the K/V rings' drain_kv_rings.
  def drain_dq(self, num_steps) -> None:
    """MMA warp: observe the dq_done phases no S MMA waited for."""
    if not self._interpreting:
      return
    buffers = self.counts["buffer"]

    @pl.loop(jnp.maximum(num_steps - buffers, 0), num_steps)
    def _(n):
      for_each_buffer(self.tiles, rem(n, buffers), self.producer_s_acquire)


def for_each_buffer(tiles: DqTiles, buf, fn) -> None:
  """fn(b) for the static score buffer b == buf (TMEM refs are picked
  statically)."""
  if tiles.score_buffers == 1:
    fn(0)
    return
  for b in range(tiles.score_buffers):
    pl.when(buf == b)(lambda b=b: fn(b))


# ---------------------------------------------------------------------------
# The kernel: a context every role reads, one function per role.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DqStatics:
  """What `build_dq_kernel` fixes at trace time."""

  tiles: DqTiles
  mask: MaskSpec
  score: scores.ScoreFunction  # how S becomes the logits, and their slope
  group: int  # query heads per key/value head
  num_q_tiles: int
  q_seq: int
  kv_valid: int
  has_segments: bool = False
  mods: ModStatics | None = None  # programmable scores; None without them

  @property
  def exp2_constant(self) -> float:
    return self.score.exp2_constant


@dataclasses.dataclass(frozen=True)
class DqContext:
  """Static configuration, refs, barriers and this CTA's geometry."""

  statics: DqStatics
  gmem: KernelRefs
  dq_ref: Any
  smem: dict
  tmem: dict
  bars: DqBarrierTable
  batch: Any
  head: Any  # query head
  kv_h: Any
  q_lo: Any
  q_len: Any
  kv_len: Any
  ranges: TileRanges | None  # the key blocks the tile walks, and the full ones
  # Programmable scores: the tile's block list (walked instead of `ranges`:
  # its PARTIAL blocks, then its FULL ones) and the mods' refs; None without.
  block_list: BlockList | None = None
  mod_refs: ModRefs | None = None

  @classmethod
  def create(cls, statics: DqStatics, gmem, dq_ref, smem, tmem, bars, mod_refs=None):
    b = lax.axis_index("batch")
    h = lax.axis_index("heads")
    tile = lax.axis_index("q_tiles")
    mask = statics.mask
    if mask.right is not None and mask.left is None:
      tile = statics.num_q_tiles - 1 - tile  # heavy tiles first (causal)
    kv_h = lax.div(h, jnp.int32(statics.group))
    q_len, kv_len = sequence_lengths(gmem.q_len, gmem.kv_len, b, statics.q_seq, statics.kv_valid)
    q_lo = tile * BLOCK_Q
    ranges = block_list = None
    if statics.mods is None:
      segment_ranges = None if gmem.segments is None else gmem.segments.of_cta(b, tile)
      ranges = tile_key_blocks(mask, statics.tiles, q_lo, q_len, kv_len, segment_ranges)
    else:  # the list holds the band, the lengths and the segment ids too
      block_list = mod_refs.walk(statics.mods, b, h, tile)
    return cls(statics, gmem, dq_ref, smem, tmem, bars, batch=b, head=h, kv_h=kv_h, q_lo=q_lo,
               q_len=q_len, kv_len=kv_len, ranges=ranges, block_list=block_list,
               mod_refs=mod_refs)

  @property
  def tiles(self) -> DqTiles:
    return self.statics.tiles

  @property
  def num_steps(self):
    if self.block_list is not None:
      return self.block_list.total
    return jnp.maximum(self.ranges.hi - self.ranges.lo, 0)

  def key_block(self, n):
    """The key block of walk position n (a block-list entry with mods)."""
    if self.block_list is not None:
      return self.block_list.block(n)
    return self.ranges.lo + n

  def s_tmem(self, b):
    return self.tmem["s"][b][0]

  def ds_tmem(self, b):
    return self.tmem["s"][b][1]

  def dp_tmem(self, b):
    return self.tmem["dp"][b]


def tile_key_blocks(mask: MaskSpec, tiles: DqTiles, q_lo, q_len, kv_len,
                    segment_ranges: TileRanges | None = None) -> TileRanges:
  """The key blocks [lo, hi) the Q tile of rows [q_lo, q_lo + 128) walks
  (every role of its CTA), and [full_lo, full_hi) of them that need no
  element mask: the band and the lengths (`scores.kv_tile_ranges`),
  intersected with the blocks its segment ids meet when given."""
  ranges = scores.kv_tile_ranges(mask, q_lo, q_lo + BLOCK_Q, q_len, kv_len, tiles.block_kv)
  return narrow(ranges, segment_ranges, lambda seg: seg)


# ----------------------------- load warp -------------------------------------


def load_warp(ctx: DqContext) -> None:
  """Q, dO, lse2, delta once; then K_j and V_j of every walked block."""
  g, smem, bars = ctx.gmem, ctx.smem, ctx.bars
  bk, stages = ctx.tiles.block_kv, ctx.tiles.num_stages

  @pl.when(ctx.num_steps > 0)
  def _():
    rows = (ctx.batch, pl.ds(ctx.q_lo, BLOCK_Q), ctx.head)
    stats = (ctx.batch, ctx.head, pl.ds(ctx.q_lo, BLOCK_Q))
    plgpu.copy_gmem_to_smem(g.q.at[rows], smem["q"], bars.producer_q())
    plgpu.copy_gmem_to_smem(g.do.at[rows], smem["do"], bars.producer_q())
    plgpu.copy_gmem_to_smem(g.lse.at[stats], smem["lse2"], bars.producer_stats())
    plgpu.copy_gmem_to_smem(g.delta.at[stats], smem["delta"], bars.producer_stats())

  @pl.loop(0, ctx.num_steps)
  def _(n):
    slot = rem(n, stages)
    keys = (ctx.batch, pl.ds(ctx.key_block(n) * bk, bk), ctx.kv_h)

    @pl.when(n >= stages)
    def _():
      bars.producer_k_acquire(slot)

    plgpu.copy_gmem_to_smem(g.k.at[keys], smem["k"].at[slot], bars.producer_k(slot))

    @pl.when(n >= stages)
    def _():
      bars.producer_v_acquire(slot)

    plgpu.copy_gmem_to_smem(g.v.at[keys], smem["v"].at[slot], bars.producer_v(slot))

  bars.drain_kv_rings(ctx.num_steps)


# ----------------------------- MMA warp --------------------------------------


def _issue_scores(ctx: DqContext, m) -> None:
  """S_m = Q K_m^T and dP_m = dO V_m^T into score buffer m % buffers."""
  bars, smem = ctx.bars, ctx.smem
  slot = rem(m, ctx.tiles.num_stages)
  buffers = ctx.tiles.score_buffers

  def issue(b):
    @pl.when(m >= buffers)
    def _():
      bars.producer_s_acquire(b)  # dS_(m - buffers) read by its dQ MMA

    bars.consumer_k(slot).wait()
    plgpu.tcgen05_mma(ctx.s_tmem(b), smem["q"], smem["k"].at[slot].T, bars.producer_s(b),
                      accumulate=False)
    bars.consumer_v(slot).wait()
    plgpu.tcgen05_mma(ctx.dp_tmem(b), smem["do"], smem["v"].at[slot].T, bars.producer_dp(b),
                      accumulate=False)
    bars.consumer_v_release(slot)

  for_each_buffer(ctx.tiles, rem(m, buffers), issue)


def _accumulate_dq(ctx: DqContext, n) -> None:
  """dQ += dS_n K_n (overwrite at n == 0), once dS_n is in TMEM."""
  bars = ctx.bars
  slot = rem(n, ctx.tiles.num_stages)

  def issue(b):
    bars.consumer_ds(b).wait()
    plgpu.tcgen05_mma(ctx.tmem["dq"], ctx.ds_tmem(b), ctx.smem["k"].at[slot],
                      bars.producer_dq(b), accumulate=n > 0)
    bars.consumer_k_release(slot)

  for_each_buffer(ctx.tiles, rem(n, ctx.tiles.score_buffers), issue)


def mma_warp(ctx: DqContext) -> None:
  """One thread issues every tcgen05 MMA, `score_buffers - 1` blocks ahead
  (module docstring)."""
  bars, steps = ctx.bars, ctx.num_steps
  ahead = ctx.tiles.score_buffers - 1

  @pl.when(steps > 0)
  def _():
    bars.consumer_q().wait()
    for m in range(ahead):
      pl.when(m < steps)(lambda m=m: _issue_scores(ctx, jnp.int32(m)))

    @pl.loop(0, steps)
    def _(n):
      @pl.when(n + ahead < steps)
      def _():
        _issue_scores(ctx, n + ahead)

      _accumulate_dq(ctx, n)

    bars.producer_dq_final()
    bars.drain_dq(steps)


# ----------------------------- compute warpgroup -----------------------------


def _grad_block(ctx: DqContext, lse2, delta, row_ids, j, b, *, masked: bool,
                tile_mods: TileMods | None = None) -> None:
  """dS of key block j (score buffer b) into TMEM over S. With `tile_mods`
  (programmable scores) t and its slope come from `TileMods.logits` (dS is
  w.r.t. the scaled score, as without mods), and a masked block's element
  mask includes mask_mod."""
  st, bars = ctx.statics, ctx.bars
  bars.consumer_s(b).wait()
  s = plgpu.async_load_tmem(ctx.s_tmem(b), layout=ROW_LAYOUT)
  if tile_mods is None:
    t, slope = st.score.logits(s), None
  else:
    q_idx, kv_idx = tile_positions(s.shape, row_lo=ctx.q_lo, col_lo=j * ctx.tiles.block_kv,
                                   keys_along_rows=False)
    t, slope = tile_mods.logits(s, q_idx, kv_idx, score=st.score, with_slope=True)
  logits2 = t * st.exp2_constant - lax.broadcast_in_dim(lse2, s.shape, [0])
  if masked:
    segments = None if row_ids is None else (row_ids, ctx.gmem.segments.kv_ids, ctx.batch)
    ok = element_mask(st.mask, s.shape, row_lo=ctx.q_lo, col_lo=j * ctx.tiles.block_kv,
                      keys_along_rows=False, kv_len=ctx.kv_len, q_len=ctx.q_len,
                      segments=segments,
                      mask_mod=None if tile_mods is None else tile_mods.mask_hook())
    logits2 = jnp.where(ok, logits2, -jnp.inf)
  w = jnp.exp2(logits2)  # P
  if tile_mods is None:
    slope = st.score.slope(t)  # after the exp2, as t's last use
  if slope is not None:
    w = w * slope
  bars.consumer_dp(b).wait()
  dp = plgpu.async_load_tmem(ctx.dp_tmem(b), layout=ROW_LAYOUT)
  ds = w * (dp - lax.broadcast_in_dim(delta, s.shape, [0]))
  plgpu.wait_load_tmem()  # S fully read before dS overwrites it
  plgpu.async_store_tmem(ctx.ds_tmem(b), ds.astype(ctx.tiles.dtype))
  plgpu.commit_tmem()
  bars.producer_ds_commit(b)


def compute_wg(ctx: DqContext, i: int) -> None:
  """Compute warpgroup i: dS of the walked blocks of score buffer i (element
  mask only on boundary blocks); warpgroup 0 then runs the epilogue."""
  bars, smem, ranges = ctx.bars, ctx.smem, ctx.ranges

  @pl.when(ctx.num_steps > 0)
  def _():
    bars.consumer_stats().wait()
    lse2 = plgpu.load(smem["lse2"], layout=ROW_VECTOR_LAYOUT)
    delta = plgpu.load(smem["delta"], layout=ROW_VECTOR_LAYOUT)
    row_ids = None
    if ctx.statics.has_segments:
      row_ids = plgpu.load(ctx.gmem.segments.q_ids.at[ctx.batch, pl.ds(ctx.q_lo, BLOCK_Q)],
                           layout=ROW_VECTOR_LAYOUT, optimized=False)

    def step(j, carry, *, masked):
      mine = rem(j - ranges.lo, ctx.tiles.score_buffers) == i
      pl.when(mine)(lambda: _grad_block(ctx, lse2, delta, row_ids, j, i, masked=masked))
      return carry

    def list_step(n, j, carry, *, masked, tile_mods):
      """Walk position n of the block list holds key block j."""
      mine = rem(n, ctx.tiles.score_buffers) == i
      pl.when(mine)(lambda: _grad_block(ctx, lse2, delta, row_ids, j, i, masked=masked,
                                        tile_mods=tile_mods))
      return carry

    if ctx.block_list is None:
      walk_blocks(ranges.lo, ranges.hi, ranges, step, lambda j, carry: carry, 0)
    else:
      # The mods bound to the tile's (batch, head) once, before the walk.
      tile_mods = ctx.mod_refs.on_rows(ctx.statics.mods, ctx.batch, ctx.head)
      walk_block_list(ctx.block_list, functools.partial(list_step, tile_mods=tile_mods), 0)
    if i == 0:
      epilogue(ctx)

  if i == 0:
    @pl.when(ctx.num_steps == 0)
    def _():
      _store_dq(ctx, lambda c: jnp.zeros((BLOCK_Q, EPILOGUE_CHUNK), ctx.tiles.dtype))


def _store_dq(ctx: DqContext, chunk) -> None:
  """dQ (column chunk by chunk) to GMEM through the Q tile's SMEM."""
  q_smem = ctx.smem["q"]
  for c in range(0, ctx.tiles.head_dim, EPILOGUE_CHUNK):
    q_smem[:, pl.ds(c, EPILOGUE_CHUNK)] = chunk(c)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_smem, ctx.dq_ref.at[ctx.batch, pl.ds(ctx.q_lo, BLOCK_Q), ctx.head])
  plgpu.wait_smem_to_gmem(0)


def epilogue(ctx: DqContext) -> None:
  """dQ * scale once every MMA completed (Q is dead: its SMEM takes dQ)."""
  ctx.bars.consumer_dq_final().wait()

  def scaled(c):
    dq = plgpu.async_load_tmem(ctx.tmem["dq"].at[:, pl.ds(c, EPILOGUE_CHUNK)],
                               layout=EPILOGUE_LAYOUT)
    return (dq * ctx.statics.score.scale).astype(ctx.tiles.dtype)

  _store_dq(ctx, scaled)


# ----------------------------- dispatch and build ----------------------------

LOAD_WARP, MMA_WARP = 0, 1

# Registers per thread (a multiple of 8, at most 512 per lane in all) with two
# compute warpgroups: each holds S and dP of a 64-key block (128) and its
# temporaries; the load and MMA warps need few. With one compute warpgroup
# (two in all) every thread may use 255 and nothing is set.
COMPUTE_REGISTERS, LOAD_MMA_REGISTERS = 232, 40
assert 2 * COMPUTE_REGISTERS + LOAD_MMA_REGISTERS <= 512


def _set_registers(ctx: DqContext, count: int, action: str) -> None:
  if ctx.tiles.score_buffers > 1 and not is_interpreting():  # no register file there
    plgpu.set_max_registers(count, action=action)


def dispatch_roles(ctx: DqContext, wg) -> None:
  """Warpgroups 0 .. score_buffers - 1 compute (one per score buffer); the
  last one's warps load and issue the MMAs."""
  for i in range(ctx.tiles.score_buffers):
    @pl.when(wg == i)
    def _(i=i):
      _set_registers(ctx, COMPUTE_REGISTERS, "increase")
      compute_wg(ctx, i)

  @pl.when(wg == ctx.tiles.score_buffers)
  def _():
    _set_registers(ctx, LOAD_MMA_REGISTERS, "decrease")

    @plgpu.warp_map
    def _(warp):
      pl.when(warp == LOAD_WARP)(lambda: load_warp(ctx))
      pl.when(warp == MMA_WARP)(lambda: mma_warp(ctx))


def _scratch_types(tiles: DqTiles) -> dict:
  d, bk, item = tiles.head_dim, tiles.block_kv, jnp.dtype(tiles.dtype)
  tf = smem_transforms(item, d)
  smem = dict(
      q=plgpu.SMEM((BLOCK_Q, d), item, transforms=tf),
      do=plgpu.SMEM((BLOCK_Q, d), item, transforms=tf),
      k=plgpu.SMEM((tiles.num_stages, bk, d), item, transforms=tf),
      v=plgpu.SMEM((tiles.num_stages, bk, d), item, transforms=tf),
      lse2=plgpu.SMEM((BLOCK_Q,), jnp.float32),
      delta=plgpu.SMEM((BLOCK_Q,), jnp.float32),
  )
  tmem = dict(
      dq=plgpu.TMEM((BLOCK_Q, d), jnp.float32),
      # S_b (f32) and dS_b (16-bit, two per column) share their columns.
      s=[plgpu.RefUnion(plgpu.TMEM((BLOCK_Q, bk), jnp.float32),
                        plgpu.TMEM((BLOCK_Q, bk), item, packed=True))
         for _ in range(tiles.score_buffers)],
      dp=[plgpu.TMEM((BLOCK_Q, bk), jnp.float32) for _ in range(tiles.score_buffers)],
  )
  return dict(smem=smem, tmem=tmem, barrier_refs=DqBarrierTable.scratch_types(tiles))


def dq_segment_operands(q_ids, kv_ids, tiles: DqTiles, q_seq: int):
  """The segment-id operands `build_dq_kernel(has_segments=True)` takes for
  q_seq (padded) query rows: `backward_inputs.segment_operands` at this
  kernel's tiling (queries are the rows, one 128-row tile per CTA)."""
  return segment_operands(q_ids, kv_ids, keys_are_rows=False, block_rows=tiles.block_q,
                          consumers=1, num_ctas=cdiv(q_seq, tiles.block_q),
                          block_cols=tiles.block_kv)


@cached_build
def build_dq_kernel(*, batch, q_seq, kv_seq, kv_valid, num_q_heads, num_kv_heads, head_dim,
                    dtype, score: scores.ScoreFunction, mask, block_kv, block_q, num_stages,
                    has_q_lengths, has_kv_lengths, has_segments=False,
                    mods: ModStatics | None = None):
  """(q, k, v, dout, lse2, delta, *lengths, *segment_operands) -> dq.

  q, dout [B, q_seq, Nq, D]; k, v [B, kv_seq, Nkv, D] (sequences padded to
  multiples of 8; keys past `kv_valid` are padding); lse2, delta f32
  [B, Nq, >= q_seq rounded up to 128] (`backward_inputs.preprocess`);
  lengths: [q_lengths] if has_q_lengths, then [kv_lengths]; segment
  operands: `dq_segment_operands(q_ids, kv_ids, tiles, q_seq)`, i.e.
  `backward_inputs.segment_operands(q_ids, kv_ids, keys_are_rows=False,
  block_rows=128, consumers=1, num_ctas=cdiv(q_seq, 128),
  block_cols=block_kv)`; with `mods`, then `ModRefs`' operands (block lists
  of the 128-row tiles by `block_kv` keys). Returns dq [B, q_seq, Nq, D] in
  dtype."""
  tiles = dataclasses.replace(choose_config(head_dim, dtype), block_kv=block_kv, block_q=block_q,
                              num_stages=num_stages)
  tiles.check_budgets()
  del kv_seq  # the K/V extents come with the arrays
  num_q_tiles = cdiv(q_seq, BLOCK_Q)
  statics = DqStatics(tiles, mask, score, num_q_heads // num_kv_heads, num_q_tiles,
                      q_seq, kv_valid, has_segments=has_segments, mods=mods)

  def kernel(*refs, smem, tmem, barrier_refs):
    gmem, rest = KernelRefs.split(refs, has_q_lengths, has_kv_lengths,
                                  1 if has_segments else None)
    mod_refs, (dq_ref,) = ModRefs.split(rest, mods)
    bars = DqBarrierTable(tiles, barrier_refs)
    ctx = DqContext.create(statics, gmem, dq_ref, smem, tmem, bars, mod_refs)
    dispatch_roles(ctx, lax.axis_index("wg"))

  call = plgpu.kernel(
      compile_ahead.named(kernel, "sm100_dq"),
      out_type=jax.ShapeDtypeStruct((batch, q_seq, num_q_heads, head_dim), jnp.dtype(dtype)),
      grid=(num_q_heads, num_q_tiles, batch),
      grid_names=("heads", "q_tiles", "batch"),
      num_threads=tiles.score_buffers + 1,
      thread_name="wg",
      scratch_types=_scratch_types(tiles),
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )

  def dq_kernel(q, k, v, dout, lse2, delta, *rest):
    rows = num_q_tiles * BLOCK_Q
    if lse2.shape[-1] < rows or delta.shape[-1] < rows:
      raise ValueError(f"lse2 and delta must cover {rows} rows (whole 128-row tiles); got"
                       f" {lse2.shape} and {delta.shape}")
    return call(q, k, v, dout, lse2, delta, *rest)

  return dq_kernel
