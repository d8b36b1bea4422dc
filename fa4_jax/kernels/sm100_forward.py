"""Blackwell (sm_100) attention forward: the FA4 pipeline in Pallas Mosaic GPU.

A work item is a CTA tile, `num_q_tiles` (2, or 1 for head_dim 256) query
tiles of 128 rows of one (batch, head); its CTA walks the key/value blocks
that those rows can see. Accumulators live in tensor memory (TMEM);
warpgroups specialise:

    wg 0 .. nq-1   softmax of Q tile i: S_i (TMEM) -> P_i (TMEM, over S_i),
                   running max / sum, rescale factor for the correction wg.
    wg nq          correction: rescales O_i in TMEM when a row's max grew
                   past `scores.RESCALE_THRESHOLD` (exact: P is computed
                   against the same stale max), then the epilogue O / l and
                   the LSE.
    wg nq+1        warp 0: TMA loads (Q once, K and V into a ring of slots);
                   warp 1: issues every tcgen05 MMA (one thread).

MMA order per key block n (two Q tiles), as in the reference `SM100MHA2Q`:

    S0 = Q0 K_n^T,  O1 += P1 V_(n-1),  S1 = Q1 K_n^T,  O0 += P0 V_n

so two MMAs separate the production of S_i from the consumption of P_i and
the softmax of one tile overlaps the tensor core's work on the other. K is
fed k-major (K^T of a row-major tile), V mn-major, P straight from TMEM.

Every barrier is declared once in `ForwardBarrierTable` with its arrival
count, the role that arrives on it and the roles that wait on it; the roles
use its producer_* / consumer_* accessors (generated from that
declaration), never a raw barrier.

Grid (`fa4_jax.kernels.schedule`), two of them:

* One CTA per work item, grid (q heads, CTA tiles, batch): the default.
  Under causal-like masks the CTA tiles are launched heaviest (most key
  blocks) first (`heavy_first_tile`), so the long ones start in the first
  wave and the short ones fill the tail.
* Persistent (`TileConfig.persistent`): one CTA per SM (`num_sms`, the
  GPU's or the `gpu_target`'s count; a B200's 148 without one) walks its
  share of the work items (`PersistentWork`: the launch order of the other
  grid, causal tiles paired heavy with light). TMEM is allocated once;
  every role walks the same items in the same order (`CtaWork.walk`), the
  barriers' phases run on across items (`ForwardBarrierTable`, "Phases"), O
  and the row statistics start afresh with each item, and Q's SMEM, which
  the epilogue reuses for O on its way out, goes back to the load warp
  through one more barrier (q_free).

Why the persistent grid is not the default: nothing here was measured on a
Blackwell GPU. On Hopper the persistent grid pays for short items (up to a
mean of 24 key blocks per tile, 12 for causal pairs; `sm90_forward`)
because the next item's Q load and the current item's O store overlap the
neighbours' work, which needs a separate O tile in SMEM. Here Q's SMEM
doubles as O's (a separate O tile does not fit next to the K/V ring at
head_dim 128 and 256: 192 of 227 KiB are taken), and TMEM has no room for
a second O (S and O fill all 512 columns at head_dim 128), so the next
item's Q load waits for this item's O store and its first P V MMA for the
epilogue's TMEM reads: what remains is the saved launches and the balanced
causal tail. Whether that pays, and where, is for a B200 to say; until
then the grid whose protocol is simpler stays the default and the
persistent one is an option that the tests run.

The element mask and the online softmax (running max from `scores.M_INIT`,
threshold, exact rescale factor, 1 / l and LSE) come from `fa4_jax.scores`,
the one implementation every backend uses, applied to whole tiles in the
TMEM row layout.

Each role is a module-level function of the CTA's `CtaWork` (`load_warp`,
`mma_warp`, `softmax_wg`, `correction_wg`) that walks the work items and
runs its per-item function on each item's `ForwardContext` (static
configuration, refs, barriers, the item's tile geometry): `_load_item`,
`_mma_item`, `_softmax_item`, `_correct_item` and its `epilogue`. The
kernel body builds the `CtaWork` and `dispatch_roles` hands each warpgroup
(and each warp of the last one) its role. With one CTA per tile the walk is
the one item, built once before the roles branch.

Segment ids (packed sequences, `forward(..., segment_ids=(q_ids, kv_ids))`):
`scores.segment_tile_ranges` gives, per Q tile, the key blocks its ids may
meet and the ones that hold only its single id. A work item walks the hull of
its Q tiles' blocks intersected with the band (`cta_key_blocks`, computed
once in `ForwardContext.create`, so the load warp, the MMA warp, the softmax
and the correction walk the same blocks); a softmax warpgroup applies the
id comparison only in blocks outside its tile's one-id run. Without segment
ids the kernel is the one it was (no extra operand, no extra instruction).

Attention sinks (`forward(..., sinks=f32 [Nq])`, one more operand): each
softmax warpgroup starts its rows' running max and sum from its head's sink
(`scores.initial_row_stats(sink=)`), so the correction and the epilogue see
the sink in m and l like any key; the epilogue gives rows at or past
q_lengths lse -inf (they start from the sink too) and a CTA that walks no
key block lse = sink for its valid rows. Logit soft-capping (the cap of
`forward(..., score=)`, a `scores.ScoreFunction`, static): the softmax turns
each S tile into its logits (`ScoreFunction.logits`: one multiply and a
tanh.approx per element) before the element mask and folds cap into the
exp2 constant (`ScoreFunction.exp2_constant`). Where the capped logits bound
P (`ScoreFunction.bounds_logits`: bf16, cap * log2(e) + log2(keys) <= 96) the
rows keep a fixed max (`ForwardStatics.fixed_max`): the softmax takes no row
max and hands no row factors over (c_full / c_free carry only the final
statistics), and the correction leaves O alone, only keeping its turn in
p_full_o_rescaled. Without them the kernel is unchanged.

Programmable scores (`forward(..., mods=)`, a `scores.Scores` with a
`score_mod` and / or a `mask_mod`): before the kernel XLA classifies every
(CTA tile, key block) pair by every mask of the call, the built-ins and
`mask_mod` (`scores.tile_classes`: EMPTY, PARTIAL, FULL; from the block
mask where its tiles nest with the CTA's 256 x 128, or 128 x 64 at head
dim 256) and turns the classes into per-CTA lists (`scores.block_lists`:
the PARTIAL blocks, then the FULL ones; `mods_operands`). Every role walks
the list instead of [blk_lo, blk_lo + num_steps) (`ForwardContext.key_block`:
one scalar GMEM load per block), so the load warp loads only listed
blocks and the barrier protocol is the plain one, block for block. The
softmax warpgroups bind the mods to their tile's (batch, head) once before
the walk (`mod_tiles.ModRefs.on_rows`: captured arrays read once per
tile), then run `score_mod` on every walked block after the scale and
before the soft-cap (`mod_tiles.TileMods.logits`; the exp2 constant is then
log2(e), or cap * log2(e)), and the element mask with `mask_mod` on
PARTIAL blocks only (`_softmax_step_with_mods`); FULL blocks evaluate no
mask_mod. The mods see the global (batch, head) (`Scores.index_offsets`)
and the query and key positions; their captured arrays are GMEM operands.
With segment ids the lists hold the ids' tile ranges (the ids' range
operand is dropped). Both grids take mods: the lists are per CTA tile, and
a persistent CTA reads each item's. No new barrier, role or TMEM column;
without mods the kernel is unchanged (`tools/kernel_fingerprints.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fa4_jax import scores
from fa4_jax.interpret import is_interpreting
from fa4_jax.kernels import KernelUnsupported, check_common
from fa4_jax.kernels import compile_ahead
from fa4_jax.kernels.backward_inputs import mod_operands
from fa4_jax.kernels.build_cache import cached_build
from fa4_jax.kernels.mod_tiles import (BlockList, ModRefs, ModStatics, TileMods, check_mods,
                                       walk_block_list)
from fa4_jax.kernels.pipeline import ARRIVE, MMA, TMA, WAIT, WAITER, Barrier, rem
from fa4_jax.kernels.schedule import (PersistentWork, heavy_first_tile, pairs_causal_tiles,
                                      sm_count)
from fa4_jax.kernels.sm100_tiles import (EPILOGUE_LAYOUT, ROW_LAYOUT, ROW_VECTOR_LAYOUT,
                                         SMEM_BYTES, TMEM_COLUMNS, element_mask, tile_positions)
from fa4_jax.kernels.sm100_tiles import KV_RINGS, KvRingBarrierTable
from fa4_jax.kernels.tiles import smem_transforms
from fa4_jax.scores import MaskSpec
from fa4_jax.target import DEFAULT_NUM_SMS

# Optional arguments of `forward` (see fa4_jax/kernels/__init__.py).
FEATURES = frozenset({"sinks", "score_function", "mods"})

BLOCK_Q = 128  # rows of one Q tile = TMEM lanes = threads of a warpgroup
# Columns of O handled at once by the correction warpgroup (rescale) and by
# the epilogue: bounds its register use.
RESCALE_CHUNK = 32
EPILOGUE_CHUNK = 64

_SUPPORTED_HEAD_DIMS = (64, 128, 256)


_EPILOGUE_VECTOR_LAYOUT = plgpu.Layout.TCGEN05.reduce(1)


# ---------------------------------------------------------------------------
# Static configuration: tile sizes, SMEM and TMEM budgets.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TileConfig:
  head_dim: int
  dtype: jnp.dtype
  block_kv: int  # keys per K/V block
  num_q_tiles: int  # Q tiles (of BLOCK_Q rows) per CTA, one softmax wg each
  num_kv_stages: int  # slots of the K ring and of the V ring
  # Persistent grid: one CTA per SM walks a share of the (batch, head, CTA
  # tile) work items (`schedule.PersistentWork`). Off by default: see the
  # module docstring ("Grid") for why.
  persistent: bool = False
  # CTAs of the persistent grid; 0: one per SM of the GPU at call time (148,
  # a B200's count, where there is no GPU).
  num_sms: int = 0

  def __post_init__(self):
    if self.num_sms < 0:
      raise ValueError(f"TileConfig.num_sms must be >= 0 (0: the GPU's SM count); "
                       f"got {self.num_sms}")

  @property
  def rows_per_cta(self) -> int:
    return BLOCK_Q * self.num_q_tiles

  # --- TMEM plan (columns of 32 bits, all 128 lanes) ---
  #   S_i : block_kv columns (f32 scores), one per Q tile
  #   P_i : aliases S_i (bf16/f16 packed two per column: block_kv / 2)
  #   O_i : head_dim columns (f32 accumulator), one per Q tile
  def tmem_plan(self) -> dict[str, int]:
    plan = {}
    for i in range(self.num_q_tiles):
      plan[f"S{i}/P{i}"] = self.block_kv
    for i in range(self.num_q_tiles):
      plan[f"O{i}"] = self.head_dim
    return plan

  def tmem_columns(self) -> int:
    return sum(self.tmem_plan().values())

  # --- SMEM plan (bytes) ---
  def smem_bytes(self) -> int:
    item = jnp.dtype(self.dtype).itemsize
    q = self.num_q_tiles * BLOCK_Q * self.head_dim * item  # Q, later O
    kv = 2 * self.num_kv_stages * self.block_kv * self.head_dim * item
    row_vectors = self.num_q_tiles * 4 * BLOCK_Q * 4  # alpha, m, l, lse
    barriers = 1024  # generous: < 40 mbarriers of 8 bytes, plus alignment
    return q + kv + row_vectors + barriers

  def check_budgets(self) -> None:
    cols = self.tmem_columns()
    assert cols <= TMEM_COLUMNS, (
        f"TMEM plan {self.tmem_plan()} needs {cols} columns, more than the"
        f" {TMEM_COLUMNS} of an sm_100 SM (head_dim={self.head_dim},"
        f" block_kv={self.block_kv}, num_q_tiles={self.num_q_tiles})"
    )
    smem = self.smem_bytes()
    assert smem <= SMEM_BYTES, (
        f"SMEM plan needs about {smem} bytes, more than {SMEM_BYTES}"
        f" (head_dim={self.head_dim}, block_kv={self.block_kv},"
        f" num_kv_stages={self.num_kv_stages})"
    )


def choose_config(head_dim: int, dtype) -> TileConfig:
  """The tiling for a head dimension (checked against TMEM and SMEM)."""
  if head_dim == 64:
    cfg = TileConfig(head_dim, jnp.dtype(dtype), block_kv=128, num_q_tiles=2, num_kv_stages=3)
  elif head_dim == 128:
    cfg = TileConfig(head_dim, jnp.dtype(dtype), block_kv=128, num_q_tiles=2, num_kv_stages=2)
  elif head_dim == 256:
    # Two O tiles of 256 columns would fill all of TMEM: one Q tile per CTA.
    cfg = TileConfig(head_dim, jnp.dtype(dtype), block_kv=64, num_q_tiles=1, num_kv_stages=2)
  else:
    raise KernelUnsupported(
        f"sm100 forward: head_dim must be one of {_SUPPORTED_HEAD_DIMS}, got {head_dim}"
    )
  cfg.check_budgets()
  return cfg


# Registers per thread of each role, by number of Q tiles: the sum over the
# warpgroups must stay within 512 (64K registers / 128 threads per warpgroup).
# Softmax holds a row of S and of P; the correction and load/MMA roles little.
REGISTERS = {
    2: {"softmax": (192, "increase"), "correction": (80, "decrease"),
        "load_mma": (48, "decrease")},
    1: {"softmax": (208, "increase"), "correction": (200, "increase"),
        "load_mma": (104, "decrease")},
}
for _nq, _roles in REGISTERS.items():
  _total = _roles["softmax"][0] * _nq + _roles["correction"][0] + _roles["load_mma"][0]
  assert _total <= 512, f"register plan for {_nq} Q tiles uses {_total} > 512 per lane"


# ---------------------------------------------------------------------------
# Barriers: all of them, with their arrival counts, in one place.
# ---------------------------------------------------------------------------


class ForwardBarrierTable(KvRingBarrierTable):
  """Every mbarrier of the forward kernel (cf. the reference `Depth512MBars`).

  Who arrives on each barrier and who waits on it, by role and accessor
  (no role touches a barrier except through these accessors):

  name      count   arrivals  t-core  arrived on by                   waited on by
  q_full    tiles   1 (TMA)   no      load: producer_q (TMA bytes)    MMA: consumer_q (one CTA
                                        or, persistent, for an item     per tile: if it walks
                                        that walks no key block:        keys; persistent: every
                                        producer_q_no_keys              item); correction:
                                                                        consumer_q (persistent:
                                                                        every item)
  q_free    tiles   2         no      correction: consumer_q_release  load: producer_q_acquire
                                        (the item's O_i has left        (before Q_i of every
                                        Q_i's SMEM) and MMA:            item but the first)
                                        consumer_q_seen (its wait
                                        on q_full passed); every item
                                        but the CTA's last
  k_full    stages  1 (TMA)   no      load: producer_k (TMA bytes)    MMA: consumer_k
  k_free    stages  1 (MMA)   yes     MMA: consumer_k_release         load: producer_k_acquire,
                                                                            drain_kv_rings*
  v_full    stages  1 (TMA)   no      load: producer_v (TMA bytes)    MMA: consumer_v
  v_free    stages  1 (MMA)   yes     MMA: consumer_v_release         load: producer_v_acquire,
                                                                            drain_kv_rings*
  s_full    tiles   1 (MMA)   yes     MMA: producer_s (S_i = Q_i K^T) softmax_i: consumer_s
  p_full_o_rescaled
            tiles   2         yes     softmax_i: producer_p_commit    MMA: producer_o_acquire
                                        (P_i in TMEM) and
                                      correction: consumer_o_release
                                        (O_i rescaled; at an item's
                                        first block: the previous
                                        item's epilogue has read O_i)
  o_full    tiles   1 (MMA)   yes     MMA: producer_o (O_i += P_i V)  correction: consumer_o;
                                                                      MMA: producer_s_acquire
                                                                        (before S_i is
                                                                        rewritten), drain_o*
  c_full    tiles   1         no      softmax_i: producer_c_commit    correction: consumer_c
                                        (row factors in SMEM; with a
                                        fixed max only the final m, l)
  c_free    tiles   1         no      correction: consumer_c_release  softmax_i: producer_c_acquire,
                                                                                 drain_c*

  tiles = num_q_tiles, stages = num_kv_stages; t-core: the barrier orders
  tensor-core work (tcgen05 commits arrive on it). * interpreter only. The
  persistent grid alone has a q_free barrier.

  Phases: every barrier is used in the same order by every role, so each
  wait observes the next phase; nothing is counted by hand. A persistent
  CTA's roles walk the same work items, one after the other, and the
  phases simply run on across items. What changes with items is only which
  waits have a previous phase to wait for: the per-block waits (k_free /
  v_free, o_full before an S MMA, c_free before a hand-off) are skipped
  while the CTA's *running* block count (`ForwardContext.steps_before`,
  over all items so far, not the item's block index) says no phase exists
  yet, and the wait on q_free is skipped for the CTA's first item. A
  thread that waits on a barrier must wait on every phase of it (Mosaic
  GPU keeps each thread's expected parity by counting its own waits), so
  the per-item barriers get one phase per item, also for items that walk
  no key block (they add none to the per-block barriers): for those the
  load warp arrives on q_full without a copy. The correction waits on the
  Q barriers too, which keeps it from releasing Q's buffer (q_free) twice
  before the load warp waited once. The MMA warp arrives on q_free too,
  once its wait on q_full has passed: over items without keys nothing else
  ties it to the load and correction, which could otherwise run q_full two
  phases past its wait (a parity wait then misreads the phase; the GPU
  interpreter caught it as a first wait at phase 2, at random).

  An item's epilogue (correction) reads O_i from TMEM before the next
  item's first O_i = P_i V MMA overwrites it: that MMA waits on
  p_full_o_rescaled, which the correction arrives on for the new item's
  first block only after its epilogue of the previous item, and after
  `wait_load_tmem`.

  S_i needs no "free" barrier of its own: P_i overwrites S_i (same TMEM
  columns), and the MMA warp issues the next S_i MMA only after the P_i V MMA
  completed (it waits on o_full too). That wait is needed: tcgen05 MMAs of
  one thread are only ordered among themselves when they share the
  accumulator, and S_i = Q K^T and O_i += P_i V do not.
  """

  BARRIERS = {
      # name: Barrier(per "tile", "persistent tile" or "stage", arrivals, orders tensor
      #               core, arrived on by {accessor: how}, waited on by {accessor: how})
      "q_full": Barrier("tile", 1, False,
                        arrive={"producer_q": TMA, "producer_q_no_keys": ARRIVE},
                        wait={"consumer_q": WAITER}),
      "q_free": Barrier("persistent tile", 2, False,
                        arrive={"consumer_q_release": ARRIVE, "consumer_q_seen": ARRIVE},
                        wait={"producer_q_acquire": WAIT}),
      **KV_RINGS,
      "s_full": Barrier("tile", 1, True, arrive={"producer_s": MMA},
                        wait={"consumer_s": WAITER}),
      "p_full_o_rescaled": Barrier("tile", 2, True,
                                   arrive={"producer_p_commit": ARRIVE,
                                           "consumer_o_release": ARRIVE},
                                   wait={"producer_o_acquire": WAIT}),
      "o_full": Barrier("tile", 1, True, arrive={"producer_o": MMA},
                        wait={"consumer_o": WAITER, "producer_s_acquire": WAIT}),
      "c_full": Barrier("tile", 1, False, arrive={"producer_c_commit": ARRIVE},
                        wait={"consumer_c": WAITER}),
      "c_free": Barrier("tile", 1, False, arrive={"consumer_c_release": ARRIVE},
                        wait={"producer_c_acquire": WAIT}),
  }

  @staticmethod
  def barrier_counts(cfg: TileConfig) -> dict:
    # One item per CTA without a persistent grid: Q_i is loaded once, no q_free.
    persistent_tiles = cfg.num_q_tiles if cfg.persistent else 0
    return {"tile": cfg.num_q_tiles, "persistent tile": persistent_tiles,
            "stage": cfg.num_kv_stages}

  # Interpreter-only drains of the last phases (see `BarrierTable`), with
  # the K/V rings' drain_kv_rings.
  def drain_o(self, i) -> None:
    """MMA warp: observe the o_full phase of the last P_i V MMA."""
    if self._interpreting:
      self.producer_s_acquire(i)

  def drain_c(self, i) -> None:
    """Softmax_i: observe the correction's release of the final statistics."""
    if self._interpreting:
      self.producer_c_acquire(i)


# ---------------------------------------------------------------------------
# The kernel: a context that every role reads, one function per role.
# ---------------------------------------------------------------------------


# Warps of the load/MMA warpgroup.
LOAD_WARP, MMA_WARP = 0, 1


@dataclasses.dataclass(frozen=True)
class ForwardStatics:
  """What `_build_kernel` fixes at trace time, the same for every CTA."""

  cfg: TileConfig
  mask: MaskSpec
  tq: int  # true extents; the arrays may be padded past them
  tk: int
  group: int  # query heads per key/value head
  score: scores.ScoreFunction  # how S becomes the softmax's logits
  segments: bool = False  # segment ids given (three more operands)
  sinks: bool = False  # one sink logit per query head given (one more operand)
  # Bounded logits only (`ScoreFunction.bounds_logits`): the rows keep one
  # fixed max, so no row factors go to the correction and O is never rescaled.
  fixed_max: bool = False
  num_cta_tiles: int = 1  # CTA tiles (of rows_per_cta query rows) along Tq
  # One CTA per tile: walk the grid's q chunks heaviest first (causal-like).
  heavy_first: bool = False
  work: PersistentWork | None = None  # the persistent grid's work items
  # Programmable scores (`forward(..., mods=)`): the traced score_mod /
  # mask_mod and how their operands come; None without them.
  mods: ModStatics | None = None

  @property
  def persistent(self) -> bool:
    return self.work is not None

  def kv_head(self, h):
    """The key/value head of query head h."""
    return lax.div(h, jnp.asarray(self.group, h.dtype))

  @property
  def exp2_scale(self) -> float:
    """c in P = exp2(c t - m) (`ScoreFunction.exp2_constant`)."""
    return self.score.exp2_constant

  # Warpgroups (the "wg" threads of plgpu.kernel), as in the module docstring.
  @property
  def softmax_wgs(self) -> tuple[int, ...]:
    return tuple(range(self.cfg.num_q_tiles))

  @property
  def correction_wg(self) -> int:
    return self.cfg.num_q_tiles

  @property
  def load_mma_wg(self) -> int:
    return self.cfg.num_q_tiles + 1


@dataclasses.dataclass(frozen=True)
class ForwardRefs:
  """The kernel's operands (GMEM) and its SMEM / TMEM scratch."""

  q_ref: Any
  k_ref: Any
  v_ref: Any
  q_len_ref: Any
  kv_len_ref: Any
  out_ref: Any
  lse_ref: Any
  q_smem: Any  # Q_i, later O_i on its way out
  k_smem: Any  # K ring
  v_smem: Any  # V ring
  alpha_smem: Any  # per-row rescale factors, softmax_i -> correction
  m_smem: Any  # final running max, softmax_i -> epilogue
  l_smem: Any  # final running sum, softmax_i -> epilogue
  lse_smem: Any
  sp_tmem: Any  # S_i / P_i (RefUnion: P_i over S_i's columns)
  o_tmem: Any
  # With segment ids only: ids padded to whole tiles / blocks, and the
  # `scores.tile_ranges_operand` of every Q tile of the grid.
  q_seg_ref: Any = None
  kv_seg_ref: Any = None
  seg_ranges_ref: Any = None
  # With sinks only: f32 [Nq], each query head's sink logit.
  sinks_ref: Any = None
  # With programmable scores only: the block lists, offsets and captured arrays.
  mod_refs: ModRefs | None = None


@dataclasses.dataclass(frozen=True)
class ForwardContext:
  """What every role reads about one work item of the CTA (one CTA tile of
  one (batch, head)): the static configuration, the refs, the barriers and
  the item's geometry (traced scalars)."""

  statics: ForwardStatics
  refs: ForwardRefs
  bars: ForwardBarrierTable
  batch: Any
  head: Any  # query head
  kv_h: Any  # its key/value head
  row0: Any  # first query row of the item
  q_len: Any  # run-time lengths, clamped to the array extents
  kv_len: Any
  blk_lo: Any  # the item walks key blocks [blk_lo, blk_lo + num_steps)
  num_steps: Any
  # With segment ids: per Q tile, the key blocks its ids meet (TileRanges).
  seg_tiles: tuple[scores.TileRanges, ...] | None = None
  # Where the item sits in the CTA's walk: its index, the key blocks the
  # CTA's earlier items walked, and the CTA's item count (0, 0, 1 for one
  # CTA per tile, Python ints).
  index: Any = 0
  step0: Any = 0
  num_items: Any = 1
  # Programmable scores: the CTA tile's block list (`scores.block_lists`),
  # walked instead of [blk_lo, blk_lo + num_steps): its PARTIAL blocks, then
  # its FULL ones; EMPTY blocks are not in it. None without mods.
  block_list: BlockList | None = None

  @classmethod
  def create(cls, statics: ForwardStatics, refs: ForwardRefs, bars: ForwardBarrierTable, b, h,
             kv_h, cta_tile, **position):
    cfg = statics.cfg
    row0 = cta_tile * cfg.rows_per_cta

    # Run-time lengths, clamped to the array extents.
    q_len = jnp.minimum(refs.q_len_ref[b], statics.tq)
    kv_len = jnp.minimum(refs.kv_len_ref[b], statics.tk)
    if statics.mods is not None:
      # Every role walks the list; it holds the band, lengths and segment ids too.
      block_list = refs.mod_refs.walk(statics.mods, b, h, cta_tile)
      return cls(statics, refs, bars, batch=b, head=h, kv_h=kv_h, row0=row0, q_len=q_len,
                 kv_len=kv_len, blk_lo=0, num_steps=block_list.total, block_list=block_list,
                 **position)
    seg_tiles = None
    if statics.segments:
      seg_tiles = tuple(
          scores.read_tile_ranges(refs.seg_ranges_ref, b, cta_tile * cfg.num_q_tiles + i)
          for i in range(cfg.num_q_tiles))
    blk_lo, num_steps = cta_key_blocks(statics.mask, cfg, row0, q_len, kv_len, seg_tiles)
    return cls(statics, refs, bars, batch=b, head=h, kv_h=kv_h, row0=row0, q_len=q_len,
               kv_len=kv_len, blk_lo=blk_lo, num_steps=num_steps, seg_tiles=seg_tiles,
               **position)

  @property
  def cfg(self) -> TileConfig:
    return self.statics.cfg

  def tile_rows(self, i):
    """First query row of Q tile i."""
    return self.row0 + i * BLOCK_Q

  def key_block(self, n):
    """The key block of the item's walk position n: blk_lo + n, or with
    programmable scores the block list's n-th entry (a scalar GMEM load)."""
    if self.block_list is not None:
      return self.block_list.block(n)
    return self.blk_lo + n

  def s_tmem(self, i):
    return self.refs.sp_tmem[i][0]

  def p_tmem(self, i):
    return self.refs.sp_tmem[i][1]

  def steps_before(self, n):
    """Key blocks this CTA walked before block n of this item, over all its
    items: the K/V ring position, and the phases every per-block barrier
    has completed (ForwardBarrierTable: "Phases")."""
    if isinstance(self.step0, int) and self.step0 == 0:
      return n
    return self.step0 + n

  def has_next_item(self):
    return self.index + 1 < self.num_items


@dataclasses.dataclass(frozen=True)
class CtaWork:
  """The work items of this CTA, which every role walks in the same order:
  one (batch, head, CTA tile) per CTA, or a persistent CTA's share
  (`schedule.PersistentWork`)."""

  statics: ForwardStatics
  refs: ForwardRefs
  bars: ForwardBarrierTable
  num_items: Any  # 1 (a Python int) for one CTA per tile
  coords: Callable  # item index -> (batch, head, CTA tile)
  only_item: ForwardContext | None = None  # one CTA per tile: its item

  @classmethod
  def create(cls, statics: ForwardStatics, refs: ForwardRefs, bars: ForwardBarrierTable):
    if statics.persistent:
      cta = lax.axis_index("ctas")
      return cls(statics, refs, bars, statics.work.count(cta),
                 functools.partial(statics.work.coords, cta))
    b = lax.axis_index("batch")
    h = lax.axis_index("heads")
    kv_h = statics.kv_head(h)
    # Causal-like masks: the last (heaviest) q chunks are launched first.
    tile = heavy_first_tile(lax.axis_index("q_chunk"), statics.num_cta_tiles,
                            statics.heavy_first)
    only = ForwardContext.create(statics, refs, bars, b, h, kv_h, tile)
    return cls(statics, refs, bars, 1, lambda j: (b, h, tile), only)

  def walk(self, role_item: Callable[[ForwardContext], None]):
    """Runs `role_item` on each work item in order; returns the key blocks
    the CTA walked in all (the drains wait out the last of their phases)."""
    if self.only_item is not None:
      role_item(self.only_item)
      return self.only_item.num_steps

    def item(j, step0):
      b, h, tile = self.coords(j)
      ctx = ForwardContext.create(self.statics, self.refs, self.bars, b, h,
                                  self.statics.kv_head(h), tile, index=j, step0=step0,
                                  num_items=self.num_items)
      role_item(ctx)
      return step0 + ctx.num_steps

    return lax.fori_loop(0, self.num_items, item, jnp.int32(0))


def cta_key_blocks(mask: MaskSpec, cfg: TileConfig, row0, q_len, kv_len, seg_tiles=None):
  """(blk_lo, num_steps): the key blocks [blk_lo, blk_lo + num_steps) that
  the CTA of query rows [row0, row0 + rows_per_cta) walks, the same for all
  its roles. The band and the lengths bound them; with segment ids
  (`seg_tiles`: each Q tile's `segment_tile_ranges`) so does the hull of the
  blocks its tiles' ids meet. Traced scalars in the kernel; arrays (one
  entry per CTA) in the tests."""
  cta_rows_hi = jnp.minimum(row0 + cfg.rows_per_cta, q_len)
  blk_lo, blk_hi = mask.at_lengths(q_len, kv_len).key_block_range(row0, cta_rows_hi, kv_len,
                                                                  cfg.block_kv)
  if seg_tiles is not None:
    band = scores.TileRanges(blk_lo, blk_hi, blk_lo, blk_hi)
    walked = band.intersect(scores.hull(seg_tiles))
    blk_lo, blk_hi = walked.lo, walked.hi
  blk_lo = jnp.asarray(blk_lo, jnp.int32)
  num_steps = jnp.where(cta_rows_hi > row0, jnp.maximum(blk_hi - blk_lo, 0), 0)
  return blk_lo, num_steps.astype(jnp.int32)


# ----------------------------- load warp -------------------------------------


def load_warp(work: CtaWork) -> None:
  """TMA loads, item by item: Q_i, then K_n and V_n into the ring of slots."""
  num_steps = work.walk(_load_item)
  work.bars.drain_kv_rings(num_steps)


def _load_item(ctx: ForwardContext) -> None:
  refs, bars = ctx.refs, ctx.bars
  bn, stages = ctx.cfg.block_kv, ctx.cfg.num_kv_stages

  if ctx.statics.persistent:
    # Q_i's SMEM holds the previous item's O_i until the epilogue stored it.
    @pl.when(ctx.index > 0)
    def _():
      for i in range(ctx.cfg.num_q_tiles):
        bars.producer_q_acquire(i)

    @pl.when(ctx.num_steps == 0)
    def _():
      for i in range(ctx.cfg.num_q_tiles):
        bars.producer_q_no_keys(i)

  @pl.when(ctx.num_steps > 0)
  def _():
    for i in range(ctx.cfg.num_q_tiles):
      plgpu.copy_gmem_to_smem(
          refs.q_ref.at[ctx.batch, pl.ds(ctx.tile_rows(i), BLOCK_Q), ctx.head],
          refs.q_smem.at[i],
          bars.producer_q(i),
      )

  @pl.loop(0, ctx.num_steps)
  def _(n):
    step = ctx.steps_before(n)
    slot = rem(step, stages)
    keys = pl.ds(ctx.key_block(n) * bn, bn)

    @pl.when(step >= stages)
    def _():
      bars.producer_k_acquire(slot)

    plgpu.copy_gmem_to_smem(
        refs.k_ref.at[ctx.batch, keys, ctx.kv_h], refs.k_smem.at[slot], bars.producer_k(slot))

    @pl.when(step >= stages)
    def _():
      bars.producer_v_acquire(slot)

    plgpu.copy_gmem_to_smem(
        refs.v_ref.at[ctx.batch, keys, ctx.kv_h], refs.v_smem.at[slot], bars.producer_v(slot))


# ----------------------------- MMA warp --------------------------------------


def _s_mma(ctx: ForwardContext, i, n, k_t) -> None:
  """S_i = Q_i K_n^T, once P_i of the previous block (of this item or the
  CTA's previous one) has been consumed."""
  @pl.when(ctx.steps_before(n) > 0)
  def _():
    ctx.bars.producer_s_acquire(i)

  plgpu.tcgen05_mma(ctx.s_tmem(i), ctx.refs.q_smem.at[i], k_t, ctx.bars.producer_s(i),
                    accumulate=False)


def _pv_mma(ctx: ForwardContext, i, n) -> None:
  """O_i += P_i V_n (overwrite at the item's first block, n == 0)."""
  ctx.bars.producer_o_acquire(i)
  plgpu.tcgen05_mma(
      ctx.refs.o_tmem[i], ctx.p_tmem(i),
      ctx.refs.v_smem.at[rem(ctx.steps_before(n), ctx.cfg.num_kv_stages)],
      ctx.bars.producer_o(i), accumulate=n > 0,
  )


def mma_warp(work: CtaWork) -> None:
  """One thread issues every tcgen05 MMA, in the order of the module docstring."""
  num_steps = work.walk(_mma_item)

  @pl.when(num_steps > 0)
  def _():
    for i in range(work.statics.cfg.num_q_tiles):
      work.bars.drain_o(i)


def _mma_item(ctx: ForwardContext) -> None:
  bars, nq, stages = ctx.bars, ctx.cfg.num_q_tiles, ctx.cfg.num_kv_stages

  def wait_for_q():
    for i in range(nq):
      bars.consumer_q(i).wait()

  if ctx.statics.persistent:
    wait_for_q()  # every item's phase, also of an item without keys

    @pl.when(ctx.has_next_item())
    def _():
      for i in range(nq):
        bars.consumer_q_seen(i)

  @pl.when(ctx.num_steps > 0)
  def _():
    if not ctx.statics.persistent:
      wait_for_q()

    @pl.loop(0, ctx.num_steps)
    def _(n):
      step = ctx.steps_before(n)
      slot = rem(step, stages)
      k_t = ctx.refs.k_smem.at[slot].T  # k-major B operand
      bars.consumer_k(slot).wait()
      _s_mma(ctx, 0, n, k_t)
      if nq == 2:
        @pl.when(n > 0)
        def _():
          _pv_mma(ctx, 1, n - 1)
          bars.consumer_v_release(rem(step - 1, stages))  # V_(n-1) read by both tiles

        _s_mma(ctx, 1, n, k_t)
      bars.consumer_k_release(slot)
      bars.consumer_v(slot).wait()
      _pv_mma(ctx, 0, n)
      if nq == 1:
        bars.consumer_v_release(slot)

    if nq == 2:
      last = ctx.num_steps - 1
      _pv_mma(ctx, 1, last)
      bars.consumer_v_release(rem(ctx.steps_before(last), stages))


# ----------------------------- softmax warpgroups ----------------------------


def _masked_scores(ctx: ForwardContext, s, r_lo, k_lo, row_ids, mask_mod=None):
  segments = None if row_ids is None else (row_ids, ctx.refs.kv_seg_ref, ctx.batch)
  ok = element_mask(ctx.statics.mask, s.shape, row_lo=r_lo, col_lo=k_lo, keys_along_rows=False,
                    kv_len=ctx.kv_len, q_len=ctx.q_len, segments=segments,
                    hide_rows_past_q_len=True, mask_mod=mask_mod)
  return jnp.where(ok, s, -jnp.inf)


def _softmax_step(ctx: ForwardContext, i, r_lo, row_ids, n, carry):
  """Key block n of Q tile i (first row r_lo; its segment ids `row_ids`, or
  None): S_i -> P_i, the running statistics, and the rescale factors for the
  correction warpgroup."""
  bars, bn = ctx.bars, ctx.cfg.block_kv
  k_lo = (ctx.blk_lo + n) * bn
  bars.consumer_s(i).wait()
  s = plgpu.async_load_tmem(ctx.s_tmem(i), layout=ROW_LAYOUT)
  # The logits (soft-cap: t = tanh(s * scale / cap)), in place (no second
  # tile alive), before the mask: tanh(-inf) = -1 would unmask a key.
  s = ctx.statics.score.logits(s)
  # Element masks only where the block straddles a mask/length edge (or,
  # with segment ids, lies outside the tile's run of its one id).
  needs_no_mask = (
      ctx.statics.mask.at_lengths(ctx.q_len, ctx.kv_len).tile_is_full(r_lo, r_lo + BLOCK_Q,
                                                                      k_lo, k_lo + bn)
      & (k_lo + bn <= ctx.kv_len)
      & (r_lo + BLOCK_Q <= ctx.q_len)
  )
  if ctx.seg_tiles is not None:
    seg, blk = ctx.seg_tiles[i], ctx.blk_lo + n
    needs_no_mask = needs_no_mask & (seg.full_lo <= blk) & (blk < seg.full_hi)
  s = lax.cond(needs_no_mask, lambda s: s,
               lambda s: _masked_scores(ctx, s, r_lo, k_lo, row_ids), s)
  return _softmax_update(ctx, i, n, s, carry)


def _softmax_step_with_mods(ctx: ForwardContext, i, r_lo, row_ids, tile_mods: TileMods, n,
                            block, carry, *, masked: bool):
  """`_softmax_step` for programmable scores: walk position n holds key
  block `block` of the CTA tile's list, PARTIAL (`masked`: the built-in
  element mask and mask_mod) or FULL for the whole CTA tile (no mask_mod;
  only a Q tile straddling q_len hides its rows past it, as every forward
  tile does). score_mod runs on every walked block, after the scale and
  before the soft-cap (`TileMods.logits`)."""
  bn = ctx.cfg.block_kv
  k_lo = block * bn
  ctx.bars.consumer_s(i).wait()
  s = plgpu.async_load_tmem(ctx.s_tmem(i), layout=ROW_LAYOUT)
  q_idx, kv_idx = tile_positions(s.shape, row_lo=r_lo, col_lo=k_lo, keys_along_rows=False)
  s, _ = tile_mods.logits(s, q_idx, kv_idx, score=ctx.statics.score, with_slope=False)
  if masked:
    s = _masked_scores(ctx, s, r_lo, k_lo, row_ids, mask_mod=tile_mods.mask_hook())
  else:
    s = lax.cond(r_lo + BLOCK_Q <= ctx.q_len, lambda s: s,
                 lambda s: _masked_scores(ctx, s, r_lo, k_lo, row_ids), s)
  return _softmax_update(ctx, i, n, s, carry)


def _softmax_update(ctx: ForwardContext, i, n, s, carry):
  """The online softmax of the masked logits `s` of walk position n: P_i
  into TMEM, the running statistics, and the row factors handed to the
  correction warpgroup."""
  bars = ctx.bars
  m_run, l_run = carry  # log2-scaled running max, running sum
  if ctx.statics.fixed_max:
    # Bounded logits against a fixed max: P only, nothing to rescale.
    p = scores.fixed_max_softmax(s, m_run, ctx.statics.exp2_scale)
    l_run = l_run + p.sum(axis=1)
    _store_p(ctx, i, p)
    bars.producer_p_commit(i)
    return m_run, l_run
  # The shared step: the max moves only past the threshold; alpha is exact.
  p, m_run, alpha = scores.online_softmax(s, m_run, ctx.statics.exp2_scale)
  l_run = l_run * alpha + p.sum(axis=1)
  _store_p(ctx, i, p)
  # Hand the row factors to the correction warpgroup (which has taken the
  # previous hand-off: of this item, or the previous item's final m and l).
  @pl.when(ctx.steps_before(n) > 0)
  def _():
    bars.producer_c_acquire(i)

  ctx.refs.alpha_smem[i] = alpha
  bars.producer_c_commit(i)
  bars.producer_p_commit(i)
  return m_run, l_run


def _store_p(ctx: ForwardContext, i, p) -> None:
  """P_i into TMEM over S_i."""
  plgpu.wait_load_tmem()  # S_i fully read before P_i overwrites it
  plgpu.async_store_tmem(ctx.p_tmem(i), p.astype(ctx.cfg.dtype))
  plgpu.commit_tmem()


def softmax_wg(work: CtaWork, i) -> None:
  """Softmax of Q tile i of every work item; see `_softmax_item`."""
  num_steps = work.walk(functools.partial(_softmax_item, i=i))

  @pl.when(num_steps > 0)
  def _():
    work.bars.drain_c(i)


def _softmax_item(ctx: ForwardContext, i) -> None:
  """Softmax of Q tile i over the item's key blocks, from fresh row
  statistics; the final running max and sum go to the epilogue through the
  same hand-off as the factors."""
  bars, refs = ctx.bars, ctx.refs
  r_lo = ctx.tile_rows(i)

  @pl.when(ctx.num_steps > 0)
  def _():
    # With sinks every row starts as if it had seen its head's sink (m =
    # sink, l = 1); the correction and the epilogue read these m and l.
    sink = refs.sinks_ref[ctx.head] if ctx.statics.sinks else None
    init = scores.initial_row_stats(
        BLOCK_Q, place=lambda x: plgpu.layout_cast(x, ROW_VECTOR_LAYOUT), sink=sink,
        fixed_max=ctx.statics.fixed_max)
    row_ids = None  # the tile's segment ids, one per thread, for masked blocks
    if ctx.statics.segments:
      row_ids = plgpu.load(refs.q_seg_ref.at[ctx.batch, pl.ds(r_lo, BLOCK_Q)],
                           layout=ROW_VECTOR_LAYOUT, optimized=False)
    if ctx.block_list is None:
      step = functools.partial(_softmax_step, ctx, i, r_lo, row_ids)
      m_run, l_run = lax.fori_loop(0, ctx.num_steps, step, init)
    else:
      # The mods bound to the tile's (batch, head) once, before the walk.
      tile_mods = refs.mod_refs.on_rows(ctx.statics.mods, ctx.batch, ctx.head)
      step = functools.partial(_softmax_step_with_mods, ctx, i, r_lo, row_ids, tile_mods)
      m_run, l_run = walk_block_list(ctx.block_list, step, init)
    # Final statistics for the epilogue, through the same hand-off. With a
    # fixed max no block handed factors over: the hand-off is free unless an
    # earlier item of this CTA handed its statistics over.
    if ctx.statics.fixed_max:
      @pl.when(ctx.steps_before(0) > 0)
      def _():
        bars.producer_c_acquire(i)
    else:
      bars.producer_c_acquire(i)
    refs.m_smem[i] = m_run
    refs.l_smem[i] = l_run
    bars.producer_c_commit(i)


# ----------------------------- correction warpgroup --------------------------


def _rescale_o(ctx: ForwardContext, i, alpha) -> None:
  """O_i *= alpha in TMEM, in column chunks to stay within the registers."""
  o_tmem = ctx.refs.o_tmem[i]
  for c in range(0, ctx.cfg.head_dim, RESCALE_CHUNK):
    chunk = o_tmem.at[:, pl.ds(c, RESCALE_CHUNK)]
    o = plgpu.async_load_tmem(chunk, layout=ROW_LAYOUT)
    o = o * lax.broadcast_in_dim(alpha, o.shape, [0])
    plgpu.wait_load_tmem()
    plgpu.async_store_tmem(chunk, o)
  plgpu.commit_tmem()


def correction_wg(work: CtaWork) -> None:
  """Every work item: see `_correct_item`."""
  work.walk(_correct_item)


def _correct_item(ctx: ForwardContext) -> None:
  """Per key block, rescale O_i where a row's max moved; then the epilogue.
  With a fixed max no row factors come and O_i is left alone: the
  correction only keeps its turn in p_full_o_rescaled, after each P_i V
  completed.
  In a persistent CTA the epilogue then hands Q_i's SMEM back to the load
  warp for the next item."""
  bars, fixed_max = ctx.bars, ctx.statics.fixed_max
  if ctx.statics.persistent:
    # The item's Q_i (or the load warp's arrival for an item without keys)
    # is in Q_i's SMEM, which the epilogue reuses for O_i.
    for i in range(ctx.cfg.num_q_tiles):
      bars.consumer_q(i).wait()

  @pl.when(ctx.num_steps > 0)
  def _():
    @pl.loop(0, ctx.num_steps)
    def _(n):
      for i in range(ctx.cfg.num_q_tiles):
        alpha = None
        if not fixed_max:
          bars.consumer_c(i).wait()
          alpha = plgpu.load(ctx.refs.alpha_smem.at[i], layout=ROW_VECTOR_LAYOUT)
          bars.consumer_c_release(i)

        @pl.when(n > 0)
        def _():
          bars.consumer_o(i).wait()
          if not fixed_max:
            @pl.when(jnp.min(alpha) < 1.0)
            def _():
              _rescale_o(ctx, i, alpha)

        bars.consumer_o_release(i)

    epilogue(ctx)

  @pl.when(ctx.num_steps == 0)
  def _():
    epilogue_no_keys(ctx)

  if ctx.statics.persistent:
    @pl.when(ctx.has_next_item())
    def _():
      for i in range(ctx.cfg.num_q_tiles):
        bars.consumer_q_release(i)


# ----------------------------- epilogue (correction warpgroup) ---------------


def _store_tile(ctx: ForwardContext, i, o_chunk, lse) -> None:
  """O_i (column chunk by chunk) and lse_i to GMEM through SMEM."""
  refs = ctx.refs
  for c in range(0, ctx.cfg.head_dim, EPILOGUE_CHUNK):
    # Q_i is dead: every MMA reading it has completed.
    refs.q_smem[i, :, pl.ds(c, EPILOGUE_CHUNK)] = o_chunk(c)
  refs.lse_smem[i] = lse
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(
      refs.q_smem.at[i], refs.out_ref.at[ctx.batch, pl.ds(ctx.tile_rows(i), BLOCK_Q), ctx.head])
  plgpu.copy_smem_to_gmem(
      refs.lse_smem.at[i], refs.lse_ref.at[ctx.batch, ctx.head, pl.ds(ctx.tile_rows(i), BLOCK_Q)])


def epilogue(ctx: ForwardContext) -> None:
  """O_i / l and the LSE, once the last P_i V MMA completed."""
  bars, refs = ctx.bars, ctx.refs
  for i in range(ctx.cfg.num_q_tiles):
    bars.consumer_c(i).wait()
    m = plgpu.load(refs.m_smem.at[i], layout=_EPILOGUE_VECTOR_LAYOUT)
    l = plgpu.load(refs.l_smem.at[i], layout=_EPILOGUE_VECTOR_LAYOUT)
    bars.consumer_c_release(i)
    bars.consumer_o(i).wait()  # the last P_i V MMA
    inv_l, lse = scores.finish_rows(m, l)
    lse = _rows_past_q_len_to_minus_inf(ctx, i, lse)

    def normalized(c, i=i, inv_l=inv_l):
      o = plgpu.async_load_tmem(
          refs.o_tmem[i].at[:, pl.ds(c, EPILOGUE_CHUNK)], layout=EPILOGUE_LAYOUT)
      return (o * lax.broadcast_in_dim(inv_l, o.shape, [0])).astype(ctx.cfg.dtype)

    _store_tile(ctx, i, normalized, lse)
  if ctx.statics.persistent:
    # O_i read out of TMEM before the next item's first P_i V MMA (which
    # waits on p_full_o_rescaled, arrived on after this) overwrites it.
    plgpu.wait_load_tmem()
  plgpu.wait_smem_to_gmem(0)


def _rows_past_q_len_to_minus_inf(ctx: ForwardContext, i, lse):
  """Rows of Q tile i at or past q_len end with lse -inf. Without sinks they
  already do (l = 0); with sinks they started from the sink (l = 1) like
  every row, and their O is zero either way (every key masked)."""
  if not ctx.statics.sinks:
    return lse
  rows = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q,), 0, layout=_EPILOGUE_VECTOR_LAYOUT)
  return jnp.where(rows + ctx.tile_rows(i) < ctx.q_len, lse, -jnp.inf)


def epilogue_no_keys(ctx: ForwardContext) -> None:
  """No row of this item sees a key: zeros and lse = -inf, or with sinks
  lse = sink for the rows before q_len."""
  for i in range(ctx.cfg.num_q_tiles):
    zeros = lambda c: jnp.zeros((BLOCK_Q, EPILOGUE_CHUNK), ctx.cfg.dtype)
    if ctx.statics.sinks:
      sink = jnp.full((BLOCK_Q,), ctx.refs.sinks_ref[ctx.head], jnp.float32)
      lse = _rows_past_q_len_to_minus_inf(ctx, i, sink)
    else:
      lse = jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32)
    _store_tile(ctx, i, zeros, lse)
  plgpu.wait_smem_to_gmem(0)


# ----------------------------- dispatch --------------------------------------


def _set_registers(cfg: TileConfig, role: str) -> None:
  if is_interpreting():
    return  # the interpreter has no register file
  n, action = REGISTERS[cfg.num_q_tiles][role]
  plgpu.set_max_registers(n, action=action)


def dispatch_roles(work: CtaWork, wg) -> None:
  """Each warpgroup (and each warp of the last one) runs its role over the
  CTA's work items."""
  statics = work.statics
  for i in statics.softmax_wgs:
    @pl.when(wg == i)
    def _():
      _set_registers(statics.cfg, "softmax")
      softmax_wg(work, i)

  @pl.when(wg == statics.correction_wg)
  def _():
    _set_registers(statics.cfg, "correction")
    correction_wg(work)

  @pl.when(wg == statics.load_mma_wg)
  def _():
    _set_registers(statics.cfg, "load_mma")
    @plgpu.warp_map
    def _(warp):
      @pl.when(warp == LOAD_WARP)
      def _():
        load_warp(work)

      @pl.when(warp == MMA_WARP)
      def _():
        mma_warp(work)


def _scratch_types(cfg: TileConfig) -> dict:
  nq, bn, stages, head_dim = cfg.num_q_tiles, cfg.block_kv, cfg.num_kv_stages, cfg.head_dim
  item = jnp.dtype(cfg.dtype)
  tf = smem_transforms(cfg.dtype, head_dim)
  return dict(
      q_smem=plgpu.SMEM((nq, BLOCK_Q, head_dim), item, transforms=tf),
      k_smem=plgpu.SMEM((stages, bn, head_dim), item, transforms=tf),
      v_smem=plgpu.SMEM((stages, bn, head_dim), item, transforms=tf),
      alpha_smem=plgpu.SMEM((nq, BLOCK_Q), jnp.float32),
      m_smem=plgpu.SMEM((nq, BLOCK_Q), jnp.float32),
      l_smem=plgpu.SMEM((nq, BLOCK_Q), jnp.float32),
      lse_smem=plgpu.SMEM((nq, BLOCK_Q), jnp.float32),
      # S_i (f32) and P_i (16-bit, two per column) share their TMEM columns.
      sp_tmem=[
          plgpu.RefUnion(
              plgpu.TMEM((BLOCK_Q, bn), jnp.float32),
              plgpu.TMEM((BLOCK_Q, bn), item, packed=True),
          )
          for _ in range(nq)
      ],
      o_tmem=[plgpu.TMEM((BLOCK_Q, head_dim), jnp.float32) for _ in range(nq)],
      barrier_refs=ForwardBarrierTable.scratch_types(cfg),
  )


@cached_build
def _build_kernel(cfg: TileConfig, *, batch, tq, tk, tq_pad, tk_pad, num_q_heads,
                  num_kv_heads, score: scores.ScoreFunction, mask: MaskSpec,
                  segments: bool = False, sinks: bool = False,
                  fixed_max: bool = False, mods: ModStatics | None = None):
  """The pallas kernel for q [batch, tq_pad, ...], k/v [batch, tk_pad, ...]
  whose true extents are tq, tk (rows/keys past them are padding). With
  `segments`, three more operands follow the lengths (`segment_operands`;
  two with `mods`, whose block lists hold the ids' ranges); with `sinks`,
  then the f32 [num_q_heads] sinks; with `mods`, then `ModRefs`' operands
  (`mods_operands`)."""
  num_cta_tiles = pl.cdiv(tq_pad, cfg.rows_per_cta)
  statics = ForwardStatics(cfg, mask, tq=tq, tk=tk, group=num_q_heads // num_kv_heads,
                          score=score, segments=segments, sinks=sinks,
                          fixed_max=fixed_max, mods=mods,
                          num_cta_tiles=num_cta_tiles, heavy_first=pairs_causal_tiles(mask),
                          work=persistent_work(cfg, mask, batch, num_q_heads, tq_pad))

  def kernel(q_ref, k_ref, v_ref, q_len_ref, kv_len_ref, *optional_and_out_refs,
             q_smem, k_smem, v_smem, alpha_smem, m_smem, l_smem, lse_smem,
             sp_tmem, o_tmem, barrier_refs):
    *optional_refs, out_ref, lse_ref = optional_and_out_refs
    num_segment_refs = (2 if mods is not None else 3) if segments else 0
    segment_refs = optional_refs[:num_segment_refs]
    del optional_refs[:num_segment_refs]
    sinks_ref = optional_refs.pop(0) if sinks else None
    mod_refs, unused = ModRefs.split(optional_refs, mods)
    assert not unused, unused
    refs = ForwardRefs(
        q_ref=q_ref, k_ref=k_ref, v_ref=v_ref, q_len_ref=q_len_ref, kv_len_ref=kv_len_ref,
        out_ref=out_ref, lse_ref=lse_ref, q_smem=q_smem, k_smem=k_smem, v_smem=v_smem,
        alpha_smem=alpha_smem, m_smem=m_smem, l_smem=l_smem, lse_smem=lse_smem,
        sp_tmem=sp_tmem, o_tmem=o_tmem, sinks_ref=sinks_ref, mod_refs=mod_refs,
        **dict(zip(("q_seg_ref", "kv_seg_ref", "seg_ranges_ref"), segment_refs)))
    bars = ForwardBarrierTable(cfg, barrier_refs)
    wg = lax.axis_index("wg")
    dispatch_roles(CtaWork.create(statics, refs, bars), wg)

  del tk_pad  # the K/V extents come with the arrays
  # LSE rows go out in 1-D TMA boxes along the sequence, its contiguous axis.
  # On an H100 the sm90 kernel's LSE came back wrong where such a box ran past
  # the end (the interpreter clips it correctly), so the LSE output covers
  # every CTA tile the grid names (with a persistent causal grid's empty
  # tile past the end) and `forward` slices it.
  lse_seq = cta_tile_slots(cfg, mask, tq_pad) * cfg.rows_per_cta
  out_types = (
      jax.ShapeDtypeStruct((batch, tq_pad, num_q_heads, cfg.head_dim), jnp.dtype(cfg.dtype)),
      jax.ShapeDtypeStruct((batch, num_q_heads, lse_seq), jnp.float32),
  )
  return plgpu.kernel(
      compile_ahead.named(kernel, "sm100_forward"),
      out_type=out_types,
      grid=(statics.work.num_ctas,) if statics.persistent else (num_q_heads, num_cta_tiles, batch),
      grid_names=("ctas",) if statics.persistent else ("heads", "q_chunk", "batch"),
      num_threads=cfg.num_q_tiles + 2,
      thread_name="wg",
      scratch_types=_scratch_types(cfg),
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )


def persistent_work(cfg: TileConfig, mask: MaskSpec, batch: int, num_q_heads: int,
                    tq_pad: int) -> PersistentWork | None:
  """The persistent grid's work items (CTA tiles paired heavy with light
  under causal-like masks); None for one CTA per tile."""
  if not cfg.persistent:
    return None
  return PersistentWork(batch, num_q_heads, pl.cdiv(tq_pad, cfg.rows_per_cta), cfg.num_sms,
                        paired=pairs_causal_tiles(mask))


def cta_tile_slots(cfg: TileConfig, mask: MaskSpec, tq_pad: int) -> int:
  """CTA tiles the grid can name: the query's, and in a persistent causal
  grid with an odd count one empty tile past the end."""
  work = persistent_work(cfg, mask, 1, 1, tq_pad)
  return work.tile_slots if work else pl.cdiv(tq_pad, cfg.rows_per_cta)


# ---------------------------------------------------------------------------
# Public entry points (see fa4_jax/kernels/__init__.py for the contract).
# ---------------------------------------------------------------------------


def check_supported(q_shape, k_shape, dtype, mask: MaskSpec) -> None:
  b, _, _, _, _, d = check_common("sm100 forward", q_shape, k_shape, dtype, mask)
  if d not in _SUPPORTED_HEAD_DIMS:
    raise KernelUnsupported(
        f"sm100 forward: head_dim must be one of {_SUPPORTED_HEAD_DIMS}, got {d}")
  if b > 65535:
    raise KernelUnsupported(f"sm100 forward: batch {b} exceeds the grid limit 65535")
  choose_config(d, dtype)


def forward(q, k, v, q_lengths, kv_lengths, *, score: scores.ScoreFunction, mask: MaskSpec,
            segment_ids=None, sinks=None, config: TileConfig | None = None, mods=None):
  """See fa4_jax/kernels/__init__.py; `segment_ids`: None or (q_ids int32
  [B, Tq], kv_ids int32 [B, Tk]): a query sees only keys of its own id;
  `sinks`: None or f32 [Nq]. `config`:
  None for `choose_config(head_dim, dtype)`, or that config with other grid
  fields (`persistent`, `num_sms`); its tiling must be the one the head dim
  gets.

  `mods`: None, or the call's `scores.Scores` with a `score_mod` and / or a
  `mask_mod` (its lengths, segment ids, band and score function are the
  arguments above; it adds the mods, their captured arrays, the block mask
  and the index offsets). Every role then walks per CTA tile the block list
  of every mask (`mods_operands`, computed here in XLA): PARTIAL blocks with
  the element mask and mask_mod, FULL ones without, EMPTY ones neither
  loaded nor computed; score_mod runs on every walked block. An op the
  kernel cannot run is a ValueError naming it (`mod_tiles.check_mods`)."""
  if mods is not None and not mods.has_mods:
    mods = None
  if mods is not None:
    check_mods("sm100 forward", mods)
  scores.check_query_lengths_for_alignment(mask, q_lengths, "sm100 forward")
  check_supported(q.shape, k.shape, q.dtype, mask)
  if k.dtype != q.dtype or v.dtype != q.dtype or v.shape != k.shape:
    raise KernelUnsupported(
        f"sm100 forward: q, k, v must share a dtype and k, v a shape; got"
        f" {q.dtype}{q.shape}, {k.dtype}{k.shape}, {v.dtype}{v.shape}")
  if not score.scale > 0:
    raise KernelUnsupported(f"sm100 forward: scale must be positive, got {score.scale}")
  score = score.with_score_mod(mods is not None and mods.score_mod is not None)
  b, tq, nq, d = q.shape
  _, tk, nkv, _ = k.shape
  if q_lengths is None:
    q_lengths = jnp.full((b,), tq, jnp.int32)
  if kv_lengths is None:
    kv_lengths = jnp.full((b,), tk, jnp.int32)
  cfg = choose_config(d, q.dtype)
  if config is not None:
    if dataclasses.replace(config, persistent=False, num_sms=0) != cfg:
      raise KernelUnsupported(
          f"sm100 forward: config must tile head_dim {d} as choose_config does ({cfg}), "
          f"up to persistent and num_sms; got {config}")
    cfg = config
  if cfg.persistent and not cfg.num_sms:
    cfg = dataclasses.replace(cfg, num_sms=sm_count(DEFAULT_NUM_SMS["sm100"]))
  # Tiled TMA copies need the sequence extents to be multiples of 8 rows (and
  # the f32 LSE rows 16-byte aligned). Other lengths are padded here, a copy
  # only for such odd lengths; the padding is masked (lengths are clamped to
  # the true extents) and sliced off. Blocks past the end are left to TMA.
  tq_pad, tk_pad = _round_up(tq, _ROW_ALIGN), _round_up(tk, _ROW_ALIGN)
  if tq_pad != tq:
    q = jnp.pad(q, ((0, 0), (0, tq_pad - tq), (0, 0), (0, 0)))
  if tk_pad != tk:
    k = jnp.pad(k, ((0, 0), (0, tk_pad - tk), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, tk_pad - tk), (0, 0), (0, 0)))
  num_cta_tiles = cta_tile_slots(cfg, mask, tq_pad)
  segments = ()
  if segment_ids is not None:
    segments = segment_operands(cfg, segment_ids, b, tq, tk, tq_pad,
                                num_cta_tiles=num_cta_tiles)
    if mods is not None:
      segments = segments[:2]  # the block lists hold the ids' tile ranges
  sink_operand = ()
  if sinks is not None:
    if jnp.shape(sinks) != (nq,):
      raise KernelUnsupported(
          f"sm100 forward: sinks must be [query heads] = ({nq},); got {jnp.shape(sinks)}")
    sink_operand = (jnp.asarray(sinks, jnp.float32),)
  mod_options, mod_args = {}, ()
  if mods is not None:
    mods = kernel_scores(mods, mask=mask, q_lengths=q_lengths, kv_lengths=kv_lengths,
                         segment_ids=segment_ids, q_seq=tq, kv_seq=tk)
    mod_statics, mod_args = mods_operands(mods, cfg, b, nq, tq, tk, num_cta_tiles)
    mod_options = dict(mods=mod_statics)
  call = _build_kernel(
      cfg, batch=b, tq=tq, tk=tk, tq_pad=tq_pad, tk_pad=tk_pad, num_q_heads=nq,
      num_kv_heads=nkv, score=score, mask=mask, segments=bool(segments),
      sinks=bool(sink_operand),
      # Where bounded logits bound P, no running max.
      fixed_max=score.bounds_logits(q.dtype, tk), **mod_options)
  out, lse = call(q, k, v, q_lengths.astype(jnp.int32), kv_lengths.astype(jnp.int32),
                  *segments, *sink_operand, *mod_args)
  return out[:, :tq], lse[:, :, :tq]


def kernel_scores(mods, *, mask: MaskSpec, q_lengths, kv_lengths, segment_ids, q_seq: int,
                  kv_seq: int):
  """`mods` (the call's `scores.Scores`) with the kernel call's own mask,
  lengths and segment ids: what its tile classes are of
  (`scores.tile_classes`), for the forward and the backward kernels. The
  lengths are clipped to the sequences, as the kernels mask them (a length
  past them would make the last, padded, block look full)."""
  clip = lambda x, n: None if x is None else jnp.clip(jnp.asarray(x, jnp.int32), 0, n)
  q_ids, kv_ids = (None, None) if segment_ids is None else segment_ids
  return mods.replace(mask=mask, q_lengths=clip(q_lengths, q_seq),
                      kv_lengths=clip(kv_lengths, kv_seq),
                      q_segment_ids=q_ids, kv_segment_ids=kv_ids)


def mods_operands(mods, cfg: TileConfig, b: int, nq: int, tq: int, tk: int,
                  num_cta_tiles: int):
  """(`ModStatics`, the kernel's mods operands) of `mods` (`kernel_scores`):
  the classes of every mask at CTA tiles of `rows_per_cta` x `block_kv`,
  their block lists for the `num_cta_tiles` tiles the grid names, the
  offsets and the captured arrays (`backward_inputs.mod_operands`)."""
  tiles = (cfg.rows_per_cta, cfg.block_kv)
  classes = scores.tile_classes(mods, b, nq, tq, tk, *tiles)
  operands = mod_operands(mods, classes, tiles, q_block=tiles[0], kv_block=tiles[1],
                          num_q=num_cta_tiles, num_kv=pl.cdiv(tk, cfg.block_kv),
                          keys_are_rows=False)
  return ModStatics.of(mods, classes), operands


def segment_operands(cfg: TileConfig, segment_ids, b, tq, tk, tq_pad, num_cta_tiles=None):
  """(q_ids, kv_ids, ranges): the ids padded so that every row of the grid
  and every key of a walked block has one (padding is masked by the
  lengths), and each Q tile's `segment_tile_ranges` as one int32
  [B, tiles, 4] operand, with empty ranges for the tiles past tq that the
  last CTA tile may hold. `num_cta_tiles`: the CTA tiles the grid names
  (`cta_tile_slots`; by default those of tq_pad)."""
  q_ids, kv_ids = (jnp.asarray(x, jnp.int32) for x in segment_ids)
  if q_ids.shape != (b, tq) or kv_ids.shape != (b, tk):
    raise KernelUnsupported(
        f"sm100 forward: segment ids must be int32 [B, Tq] = {(b, tq)} and [B, Tk] ="
        f" {(b, tk)}; got {q_ids.shape} and {kv_ids.shape}")
  if num_cta_tiles is None:
    num_cta_tiles = pl.cdiv(tq_pad, cfg.rows_per_cta)
  num_tiles = num_cta_tiles * cfg.num_q_tiles
  ranges = scores.tile_ranges_operand(q_ids, kv_ids, BLOCK_Q, cfg.block_kv, num_tiles)
  return (scores.pad_ids(q_ids, num_tiles * BLOCK_Q),
          scores.pad_ids(kv_ids, _round_up(tk, cfg.block_kv)), ranges)


_ROW_ALIGN = 8


def _round_up(x: int, m: int) -> int:
  return (x + m - 1) // m * m
