"""The dK/dV kernels of the sm90 backward: CTAs that own key tiles.

`_build_dkv_kernel`: one CTA per (kv head, KV tile of `num_consumers *
block_kv` keys, batch). Each consumer warpgroup owns `block_kv` keys and keeps
their dK and dV in registers; a producer warpgroup streams (Q, dO, lse2,
delta) tiles of every query head of the GQA group and every query block the
mask lets these keys be seen by (barriers: `DkvBarrierTable`). With `outputs` naming
one gradient it is one pass of the "two_passes" scheme (head dim 192).
V, dO and dV may be narrower than Q, K and dK (`value_head_dim`): dP^T = V
dO^T contracts over it and dV is as wide, S^T and dK keep the head dim.
With `DkvConfig.work_queue` the same roles run as a persistent grid:
one CTA per SM takes key tiles from a work queue (`schedule.WorkQueue`),
and the next tile's K and V load while the current one runs.

`_build_dkv_head_split_kernel`: at head dim 256 the two consumers share one
key tile and split the head dim of dK and dV (`HeadSplitBarrierTable`).

Each kernel reads as its roles: a producer, the consumers, their epilogue.
Their configuration is a `DkvConfig`.
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
from fa4_jax.kernels.pipeline import (ACQUIRE, ARRIVE, FILL, NO_CHAIN, PUBLISH, RING, SYNC, TMA,
                                     WAIT, Barrier, BarrierTable, Copies, check_register_split)
from fa4_jax.kernels.schedule import PersistentWork, WorkQueue
from fa4_jax.kernels.backward_walk import KernelRefs, KeyTileWork, SegmentRefs, narrow
from fa4_jax.kernels.sm90_backward_common import (BackwardStatics, ModRefs,
                                                  affine_scores_start, folds_affine, launch,
                                                  load_operand, mma_accumulate, mma_accumulate_smem,
                                                  mma_accumulate_pair, scores_grad,
                                                  stats_of_slot, TileSoftmax, transposed_scores,
                                                  walk_block_list, zeros)
from fa4_jax.kernels.sm90_tiles import element_loader, id_ring, load_ids, swizzle_bytes
from fa4_jax.kernels.tiles import smem_tile
from fa4_jax.scores import cdiv, walk_blocks


DK_DV_SCHEMES = ("fused", "head_dim_split", "two_passes", "dv_dk_split")
# The schemes whose two consumers share one key tile and split its columns
# (`_build_dkv_head_split_kernel`).
SPLIT_SCHEMES = ("head_dim_split", "dv_dk_split")


@dataclasses.dataclass(frozen=True)
class DkvConfig:
  """Static configuration of the dK/dV kernel, by `dk_dv` scheme:

  - "fused": a CTA owns `num_consumers * block_kv` keys (one `block_kv`
    tile per consumer warpgroup, the wgmma M dimension), each warpgroup
    keeps dK and dV of its keys, and `block_q`-row query tiles stream
    through `num_stages` slots.
  - "head_dim_split": a CTA owns `block_kv` keys and each consumer keeps half
    the head dim of their dK and dV (`_build_dkv_head_split_kernel`).
  - "two_passes": the fused kernel runs twice, accumulating dK only, then dV
    only (S^T is computed twice: 5 tile GEMMs per query block instead of 4).
  - "dv_dk_split": as "head_dim_split", but warpgroup 0 keeps all of dV and
    the first `wg0_dk_columns` columns of dK, warpgroup 1 the other dK
    columns (192 / 128: dV 64 + S^T 32 + dP^T 32 registers against dK's 96;
    four tile GEMMs a block, all at N >= 64).
  """

  # --- tiles, stages and warpgroups (the heuristic's choice by shape) ---
  block_kv: int = 64
  block_q: int = 64
  num_stages: int = 2
  num_consumers: int = 2
  producer_registers: int = 40
  consumer_registers: int = 232
  # --- which algorithm runs ---
  dk_dv: str = "fused"
  # "fused" and "dv_dk_split" schemes: load a block's lse and delta from SMEM before waiting for
  # its S^T and dP^T GEMMs rather than after (Nsight Compute: the first FFMA
  # of P^T waited on those loads). Holds them in registers across the wait:
  # 32 more per thread at block_q 64.
  stats_first: bool = False
  # Passes with dK: start the S^T accumulator at -lse2 / c and the dP^T one
  # at -delta (broadcast along the keys) instead of 0, so that the wgmmas
  # leave c * S^T - lse2 (up to the factor c) and dP^T - delta. lse2 and
  # delta then die before the wait for the wgmmas instead of living across
  # it (`stats_first`: 32 registers per thread at block_q 64), and the
  # subtractions leave the softmax. Rows with lse2 = +inf start at -inf and
  # keep P = 0.
  fold_stats: bool = False
  # A score_mod in the affine form a * x + R(q_idx) + C(kv_idx) with a fixed
  # a and no soft-cap (`mod_tiles.affine_scores_init`): start the S^T
  # accumulator at (c C + R2 - lse2) / k, a vector along the keys plus one
  # along the queries (one add per element, where the accumulator was zeroed
  # register by register), so that P^T = exp2(k * acc) costs one multiply a
  # score, as in the plain kernel, instead of t = s * (scale a) + C and
  # c t - lse2 (two FMAs) and the subtraction lse2 - R per query. Calls
  # without such a mod ignore it. (`sm90_backward.FOLD_AFFINE_SCORE_MOD`.)
  fold_affine: bool = False
  # Keep the tiles a consumer holds for its whole loop, K and V, in
  # registers, as the A operands of its first two GEMMs (S^T = K Q^T,
  # dP^T = V dO^T; not "head_dim_split"), instead of having every wgmma read
  # them from SMEM again (the dQ kernel's counterpart:
  # `DqConfig.operands_in_registers`). With both operands in SMEM, an N = 64
  # wgmma reads SMEM as fast as the tensor core multiplies (4 KB per
  # m64n64k16: 32 clocks at 128 B per clock, 32 at ~4096 bf16 FLOP per clock
  # and SM). Costs head_dim / 4 registers per tile and thread, so it pays at
  # head dim 64 only (choose_config). The interpreter, which has no register
  # A operands, keeps the tiles in SMEM.
  operands_in_registers: bool = False
  # A persistent grid: one CTA per SM (`num_sms`; 0: the device's, filled in
  # by `sm90_backward.backward`) takes key tiles from a work queue
  # (`schedule.WorkQueue`), with two copies of each consumer's K and V tiles
  # so that the next tile's K and V load while the current one runs. For
  # packed rows, whose key tiles' costs are run-time data and often short
  # (no CTA launch, no K/V load latency between tiles).
  work_queue: bool = False
  num_sms: int = 0
  # "dv_dk_split": the dK columns warpgroup 0 keeps beside dV (a multiple of
  # 64, the swizzle tiles' width; 0: warpgroup 1 keeps all of dK).
  wg0_dk_columns: int = 0
  # K alone in registers as S^T's A operand (`operands_in_registers` keeps
  # V there too): head_dim / 4 registers per thread. In "dv_dk_split" only
  # warpgroup 0 computes S^T and dP^T, so only it holds them; there
  # `operands_in_registers` is taken too. Issue #56's SMEM model of one
  # 64 x 64 block at 192 / 128: K read by S^T's wgmmas is 24 of the 184 KB
  # the default kernel moves through SMEM, V 16 KB.
  k_in_registers: bool = False
  # "dv_dk_split": warpgroup 1 keeps dV too (P^T through the pds ring, as
  # "head_dim_split" has it), beside dK's columns past `wg0_dk_columns`;
  # with wg0_dk_columns=0 warpgroup 0 only computes S^T, dP^T, P^T and dS^T
  # (640 of a block's 1280 tensor clocks on each warpgroup at 192 / 128).
  wg1_dv: bool = False
  # The split schemes: warpgroup 0's registers (0: `consumer_registers`, as
  # warpgroup 1's); producer + warpgroup 0 + warpgroup 1 must fit the CTA.
  wg0_registers: int = 0

  @property
  def split_consumers(self) -> bool:
    """The consumers share one key tile and split its columns (`SPLIT_SCHEMES`)."""
    return self.dk_dv in SPLIT_SCHEMES

  def __post_init__(self):
    if self.dk_dv not in DK_DV_SCHEMES:
      raise ValueError(f"dk_dv must be one of {DK_DV_SCHEMES}; got {self.dk_dv!r}")
    if self.work_queue and self.dk_dv != "fused":
      raise ValueError(f"work_queue is a choice of the 'fused' dK/dV kernel; got "
                       f"dk_dv={self.dk_dv!r}: set work_queue=False")
    if self.wg0_dk_columns % 64 or (self.wg0_dk_columns and self.dk_dv != "dv_dk_split"):
      raise ValueError(f"wg0_dk_columns is a multiple of 64 for the 'dv_dk_split' scheme; "
                       f"got {self.wg0_dk_columns} with dk_dv={self.dk_dv!r}")
    if (self.fold_stats or self.stats_first) and self.dk_dv == "head_dim_split":
      raise ValueError(f"fold_stats and stats_first are choices of the dK/dV kernels whose "
                       f"consumers own whole key tiles ('fused' and 'two_passes') and of "
                       f"'dv_dk_split' (warpgroup 0's S^T and dP^T); got dk_dv={self.dk_dv!r}: "
                       f"set them False")
    if (self.operands_in_registers or self.k_in_registers) and self.dk_dv == "head_dim_split":
      raise ValueError(f"operands_in_registers and k_in_registers are choices of the 'fused', "
                       f"'two_passes' and 'dv_dk_split' schemes; got dk_dv={self.dk_dv!r}: "
                       f"set them False")
    if self.wg1_dv and self.dk_dv != "dv_dk_split":
      raise ValueError(f"wg1_dv is a choice of the 'dv_dk_split' scheme; got "
                       f"dk_dv={self.dk_dv!r}: set wg1_dv=False")
    if self.wg0_registers and not self.split_consumers:
      raise ValueError(f"wg0_registers is a choice of the split schemes {SPLIT_SCHEMES}; got "
                       f"dk_dv={self.dk_dv!r}: set wg0_registers=0")
    if self.wg0_registers:
      check_register_split("DkvConfig", self.producer_registers, self.num_consumers - 1,
                           self.consumer_registers, other=self.wg0_registers)
    else:
      check_register_split("DkvConfig", self.producer_registers, self.num_consumers,
                           self.consumer_registers)


def _dk_dv_update(dk, dv, softmax: TileSoftmax, q_tile, do_tile, staging, publish_ds=None):
  """dV += P^T dO and dK += dS^T Q with dS^T = `softmax.grad()` (keys along
  rows: `softmax.probs` is P^T).

  On hardware the dV wgmma is issued first and dS is computed while it runs;
  one wait covers both. `publish_ds(ds)`, if given, is called with dS^T (in
  the operands' dtype) before the dK wgmma is issued (the one kernel with
  dQ, `sm90_backward_fused_dq`, stores it for the dQ wgmmas there).
  """
  dtype = q_tile.dtype
  if is_interpreting():
    dv = mma_accumulate(dv, softmax.probs.astype(dtype), do_tile, staging)
    ds = softmax.grad().astype(dtype)
    if publish_ds is not None:
      publish_ds(ds)
    return mma_accumulate(dk, ds, q_tile, staging), dv

  def body(refs):
    dk_ref, dv_ref = refs
    plgpu.wgmma(dv_ref, softmax.probs.astype(dtype), do_tile)
    ds = softmax.grad().astype(dtype)
    if publish_ds is not None:
      publish_ds(ds)
    plgpu.wgmma(dk_ref, ds, q_tile)

  return pl.run_state(body)((plgpu.ACC.init(dk), plgpu.ACC.init(dv)))


# --- dK / dV: each consumer owns a key tile -------------------------------------

# K/V copies per consumer in the queued grid: with one, the producer could
# load the next tile's only once the epilogue's store has read the last.
QUEUED_RESIDENT_COPIES = 2


@dataclasses.dataclass(frozen=True)
class _DkvPass(BackwardStatics):
  """The static description of one dK/dV kernel (or pass)."""

  outputs: tuple[str, ...]
  interpreting: bool
  has_segments: bool = False
  queued: bool = False  # a persistent grid fed by a work queue
  mods: Any = None  # sm90_backward_common.ModStatics; None without mods

  def head_walks(self, mod_refs: ModRefs, work: KeyTileWork):
    """With mods: `walk(g)`, the block list of the CTA's keys for the
    GQA group's g-th query head, and that head's index."""
    def walk(g):
      head = work.kv_head * self.group + g
      return mod_refs.walk(self.mods, work.batch_idx, head, work.kv_tile), head
    return walk

  def total_steps(self, mod_refs: ModRefs, work: KeyTileWork):
    """With mods: the ring steps of a CTA (every head's list)."""
    walk = self.head_walks(mod_refs, work)
    return lax.fori_loop(0, self.group, lambda g, n: n + walk(g)[0].total, jnp.int32(0))

  @property
  def resident_copies(self) -> int:
    """Copies of each consumer's K (and V) tile: the queued grid loads the
    next tile's while the current one runs."""
    return QUEUED_RESIDENT_COPIES if self.queued else 1

  def split_columns(self, h: int):
    """Split schemes: ((first, count) of dK's columns, (first, count) of
    dV's) that consumer `h` keeps; a count may be 0 ("dv_dk_split")."""
    d, dv = self.head_dim, self.value_head_dim
    if self.cfg.dk_dv == "head_dim_split":
      return (h * d // 2, d // 2), (h * dv // 2, dv // 2)
    a, wg1_dv = self.cfg.wg0_dk_columns, self.cfg.wg1_dv
    if h == 0:
      return (0, a), (0, 0 if wg1_dv else dv)
    return (a, d - a), (0, dv if wg1_dv else 0)

  @property
  def with_dk(self) -> bool:
    return "dk" in self.outputs

  @property
  def needs_raw_scores(self) -> bool:
    """Whether the softmax reads the raw S^T (soft-cap's tanh, a score_mod),
    so that `fold_stats` folds delta alone (`transposed_scores`)."""
    return self.score.needs_raw_scores or (self.mods is not None
                                           and self.mods.score_mod is not None)

  @property
  def with_dv(self) -> bool:
    return "dv" in self.outputs

  @property
  def dv_wide_tile(self) -> bool:
    """Whether each consumer has a resident tile of the value head dim: V's
    in a pass with dK (dV takes it on the way out), dV's alone in a pass
    without dK whose dV is narrower than the K tile it would otherwise take
    (TMA stores whole tiles)."""
    return self.with_dk or self.value_head_dim != self.head_dim

  @property
  def num_resident(self) -> int:
    return 2 if self.with_dk else 1  # K (and V)

  @property
  def num_streamed(self) -> int:
    # Q, dO, lse (and delta), (and the queries' segment ids)
    return (4 if self.with_dk else 3) + self.has_segments

  def smem(self):
    """Scratch SMEM, in the order `_DkvSmem` unpacks it."""
    cfg, bk, bq, nc = self.cfg, self.cfg.block_kv, self.cfg.block_q, self.cfg.num_consumers
    swizzle = swizzle_bytes(self.dtype, bk, bq)
    resident_tile = lambda width: smem_tile((nc * self.resident_copies, bk, width), self.dtype,
                                            swizzle)
    ring_tile = lambda width: smem_tile((cfg.num_stages, bq, width), self.dtype, swizzle)
    ring_stats = plgpu.SMEM((cfg.num_stages, bq), jnp.float32)
    # A work queue's cells ride in one more row of the lse2 ring's buffer
    # (which starts a KiB of SMEM of its own either way).
    lse_ring = plgpu.SMEM((cfg.num_stages + self.queued, bq), jnp.float32)
    smem = [resident_tile(self.head_dim)]  # K tiles, then dK (or dV)
    if self.dv_wide_tile:
      smem.append(resident_tile(self.value_head_dim))  # V tiles (with dK), then dV
    smem += [ring_tile(self.head_dim), ring_tile(self.value_head_dim), lse_ring]  # Q, dO, lse2
    if self.with_dk:
      smem.append(ring_stats)  # delta ring
    if self.interpreting:
      smem.append(smem_tile((nc, bk, bq), self.dtype, swizzle))  # P^T / dS^T staging
    if self.has_segments:
      smem.append(id_ring(cfg.num_stages, bq))  # the queries' segment ids
    return tuple(smem)


class _DkvSmem(NamedTuple):
  k: Any
  v: Any  # V tiles, then dV; dV's alone, or None (`_DkvPass.dv_wide_tile`)
  q_ring: Any
  do_ring: Any
  lse_ring: Any
  delta_ring: Any  # None in a pass without dK
  staging: list
  q_ids: Any  # ring of the queries' segment ids; None without segment ids

  @classmethod
  def unpack(cls, smem, with_dk: bool, dv_wide_tile: bool,
             has_segments: bool) -> "_DkvSmem":
    smem = iter(smem)
    k = next(smem)
    v = next(smem) if dv_wide_tile else None
    q_ring, do_ring, lse_ring = next(smem), next(smem), next(smem)
    delta_ring = next(smem) if with_dk else None
    rest = list(smem)
    q_ids = rest.pop() if has_segments else None
    return cls(k, v, q_ring, do_ring, lse_ring, delta_ring, rest, q_ids)


class DkvBarrierTable(BarrierTable):
  """Every mbarrier of the dK/dV kernel (`_build_dkv_kernel`; the head-split
  kernel's are in `HeadSplitBarrierTable`), declared in the form of
  `pipeline.BarrierTable` (cf. `sm100_backward_dkdv.DkvBarrierTable`).

  Who arrives on each barrier and who waits on it, by role and accessor
  (no role touches a barrier except through these accessors):

  name       count      arrivals     arrived on by                      waited on by
  kv_full    kv copies  kv operands  producer: producer_kv (TMAs of     consumer i: consumer_kv, once
                          (TMA)        consumer i's K tile and, with      per work item
                                       dK, V tile); a queued grid's
                                       stop: producer_kv_stop, one
                                       plain arrive per operand
  kv_free    queued kv  1            consumer i: consumer_kv_release    producer: producer_kv_acquire
               copies                  (its epilogue's store has read     (before it reloads the
                                       the copy; queued grid only)        copy), drain_kv*
  q_do_full  stages     streamed     producer: producer_q_do (TMAs of   consumers: consumer_q_do,
                          (TMA)        step n's Q, dO, lse2, delta with   every step
                                       dK, and the queries' segment ids)
  q_do_free  stages     consumers    consumers: consumer_q_do_release   producer: producer_q_do_acquire
                                       (after their last wgmma reading    (before it refills the
                                       the slot)                          slot), drain_q_do*

  kv copies = num_consumers * resident copies (2 in a queued grid, else 1:
  copy `slot("kv_full", item, i)` of consumer i's tiles for work item
  `item`), stages = num_stages (ring slot `slot("q_do_full", step)`, the
  steps counting on across work items). * interpreter only. The queued
  grid's unit past the end rides on the stop arrives (`schedule.WorkQueue`).

  The epilogue of consumer i writes dK and dV into its own K and V copy
  (only consumer i reads it, and all its wgmmas have completed), then
  TMA-stores them and waits for the store before the copy is released or
  the CTA exits.
  """

  ALLOCATION_ORDER = "as declared"
  KV_COPIES = Copies(depth="kv depth")
  BARRIERS = {
      # name: Barrier(how many, arrivals, orders tensor core, arrived on by
      #               {accessor: how}, waited on by {accessor: how}, index)
      "kv_full": Barrier("kv copies", "kv operands", False,
                         arrive={"producer_kv": FILL, "producer_kv_stop": ARRIVE},
                         wait={"consumer_kv": WAIT}, index=KV_COPIES),
      "kv_free": Barrier("queued kv copies", 1, False, arrive={"consumer_kv_release": ARRIVE},
                         wait={"producer_kv_acquire": ACQUIRE}, index=KV_COPIES),
      "q_do_full": Barrier("stage", "streamed", False, arrive={"producer_q_do": FILL},
                           wait={"consumer_q_do": WAIT}, index=RING),
      "q_do_free": Barrier("stage", "consumers", False,
                           arrive={"consumer_q_do_release": ARRIVE},
                           wait={"producer_q_do_acquire": ACQUIRE}, index=RING),
  }

  @staticmethod
  def barrier_counts(kp: "_DkvPass") -> dict:
    nc = kp.cfg.num_consumers
    return {"kv copies": nc * kp.resident_copies, "kv depth": kp.resident_copies,
            "kv operands": kp.num_resident, "queued kv copies": nc * kp.resident_copies * kp.queued,
            "stage": kp.cfg.num_stages, "streamed": kp.num_streamed, "consumers": nc}

  # Interpreter-only drains of the last phases (see `BarrierTable`).
  def drain_q_do(self, num_steps) -> None:
    """Producer: observe the q_do_free phases of the last lap."""
    self._drain_last_lap(num_steps, "q_do_free")

  def drain_kv(self, num_items, next_acquired: bool = False) -> None:
    """Producer (queued grid): observe the last kv_free phase of every copy."""
    self._drain_last_items(num_items, "kv_free", next_acquired)


def _dkv_producer(kp: _DkvPass, gmem: KernelRefs, smem: _DkvSmem, bars: DkvBarrierTable,
                  work: KeyTileWork, item=0, step0=0, mod_refs: ModRefs | None = None):
  """Work item `item`'s K (and V) tile of each consumer once, then (Q, dO,
  lse2, delta, and the queries' segment ids) of every step through the
  ring, from ring position `step0`; returns the position after the item.
  With mods the steps are each query head's block list."""
  bk, bq = kp.cfg.block_kv, kp.cfg.block_q
  for i in range(kp.cfg.num_consumers):
    keys = (work.batch_idx, pl.ds(work.k_lo + i * bk, bk), work.kv_head)
    resident = [(gmem.k.at[keys], smem.k)]
    if kp.with_dk:
      resident.append((gmem.v.at[keys], smem.v))
    bars.producer_kv(resident, item, i)

  def load_block(step, head, qb):
    rows = (work.batch_idx, pl.ds(qb * bq, bq), head)
    stats = (work.batch_idx, head, pl.ds(qb * bq, bq))
    streamed = [(gmem.q.at[rows], smem.q_ring), (gmem.do.at[rows], smem.do_ring),
                (gmem.lse.at[stats], smem.lse_ring)]
    if kp.with_dk:
      streamed.append((gmem.delta.at[stats], smem.delta_ring))
    if kp.has_segments:
      streamed.append(_query_ids(gmem, work.batch_idx, qb, bq, smem.q_ids))
    bars.producer_q_do_acquire(step)
    bars.producer_q_do(streamed, step)

  if kp.mods is not None:
    head_walk = kp.head_walks(mod_refs, work)

    def one_head(g, step):
      walk, head = head_walk(g)
      pl.loop(0, walk.total)(lambda n: load_block(step + n, head, walk.block(n)))
      return step + walk.total

    return lax.fori_loop(0, kp.group, one_head, jnp.asarray(step0, jnp.int32))

  @pl.loop(0, work.num_steps)
  def _(n):
    step = step0 + n
    head, qb = work.rows_of(n)
    load_block(step, head, qb)

  return step0 + work.num_steps


def _query_ids(gmem: KernelRefs, batch_idx, qb, bq: int, q_ids_ring):
  """(GMEM source, SMEM ring) of the segment ids of query block qb, which
  the producer streams with the block's Q and dO."""
  return gmem.segments.q_ids.at[batch_idx, pl.ds(qb * bq, bq)], q_ids_ring


def _key_tile_segments(segments: SegmentRefs | None, batch_idx, k_lo, bk: int, q_ids_ring):
  """`block_segments(slot)`: the segment ids that a masked step of the key
  tile [k_lo, k_lo + bk) passes to `softmax`: the keys' (along rows, loaded
  once, here) and the ring slot of the step's queries' (along columns, read
  after the step's wgmma wait); None without segment ids."""
  if segments is None:
    return lambda slot: None
  kv_seg = load_ids(segments.kv_ids, batch_idx, k_lo, bk, along_rows=True)
  return lambda slot: (kv_seg, q_ids_ring.at[slot])


def _dkv_consumer(kp: _DkvPass, wg, smem: _DkvSmem, bars: DkvBarrierTable,
                  work: KeyTileWork, segments: SegmentRefs | None, item=0, step0=0,
                  mod_refs: ModRefs | None = None, dq=None):
  """Consumer `wg`: the dK and/or dV of its `block_kv` keys over every step
  of work item `item` (steps its keys cannot see only keep the ring going),
  whose first step sits at ring position `step0`. Returns (accumulators by
  name, its first key). A queued consumer waited for its resident copy
  already (the item's unit rides with it); otherwise the wait is here,
  after the ranges' reads. With mods the consumer walks each query head's
  block list of the CTA (`walk_block_list`), with the CTA's classes.
  `dq` (the one kernel with dQ, `sm90_backward_fused_dq.DqAdder`; not with
  mods): every step also hands dS^T to it (`publish`, zeros on a skipped
  step) and then adds this consumer's share of dQ (`add`)."""
  assert dq is None or kp.mods is None, "the one kernel with dQ walks no block lists"
  cfg, bk, bq, c, mask = kp.cfg, kp.cfg.block_kv, kp.cfg.block_q, kp.exp2_constant, kp.mask
  lo, hi, blocks_per_head = work.lo, work.hi, work.blocks_per_head
  k_lo = work.k_lo + wg * bk
  if kp.mods is None:
    own = scores.q_tile_ranges(mask, k_lo, k_lo + bk, work.q_len, work.kv_len, bq)
    own = narrow(own, segments, lambda seg: seg.of_consumer(work.batch_idx, work.kv_tile, wg))
    own = own.within(lo, hi)
  block_segments = _key_tile_segments(segments, work.batch_idx, k_lo, bk, smem.q_ids)
  copy = bars.slot("kv_full", item, wg)
  k_tile = smem.k.at[copy]
  v_tile = smem.v.at[copy] if kp.with_dk else None
  stage = smem.staging[0].at[wg] if kp.interpreting else None
  if not kp.queued:
    bars.consumer_kv(item, wg)
  k_operand, v_operand = k_tile, v_tile  # the A operands of S^T and dP^T
  if (cfg.operands_in_registers or cfg.k_in_registers) and not kp.interpreting:
    k_operand = load_operand(k_tile)
  if cfg.operands_in_registers and not kp.interpreting:
    v_operand = load_operand(v_tile) if kp.with_dk else None

  def block_fn(step, qb, acc, *, masked, tile_mods=None, head=None):
    """Query block qb (of query head `head`, with `dq`) at ring position `step`."""
    acc = dict(acc)
    slot = bars.slot("q_do_full", step)
    q_tile, do_tile = smem.q_ring.at[slot], smem.do_ring.at[slot]
    bars.consumer_q_do(step)

    # With a score_mod the softmax takes the raw S^T and lse2
    # (`_tile_softmax_with_mods`): `fold_stats` folds delta alone. An affine
    # one with a key term C and `fold_affine` starts S^T at its terms and
    # lse2 instead, on unmasked steps only: on masked ones the positions'
    # vectors then lived across the wait beside the mask's (local ptxas,
    # ALiBi causal B2 S4096 H16 D128: the PARTIAL loop 564 -> 697
    # instructions, 6 spill accesses in it; 564 and 1 unfolded). Without C
    # the start would cost a write per element for nothing (`s + 0.5`: the
    # FULL loop 329 -> 361 instructions).
    mods = {} if tile_mods is None else dict(mods=tile_mods)
    affine = {}
    starts_at_affine_terms = (cfg.fold_affine and tile_mods is not None and not masked
                              and kp.score.has_score_mod
                              and folds_affine(tile_mods.score_mod, kp.score))

    def affine_start(lse2):
      v, affine["affine_k"] = affine_scores_start(
          tile_mods, kp.score, lse2, shape=(bk, bq), q_lo=qb * bq, k_lo=k_lo,
          keys_along_rows=True)
      return v

    s, dp, lse2, delta = transposed_scores(  # delta: only a pass with dK has it
        k_operand, v_operand, q_tile, do_tile,
        stats_of_slot(smem.lse_ring, smem.delta_ring, slot),
        c=c, fold_stats=cfg.fold_stats, stats_first=cfg.stats_first,
        needs_raw_scores=kp.needs_raw_scores,
        scores_start=affine_start if starts_at_affine_terms else None)
    mods.update(affine)
    seg = block_segments(slot) if masked else None
    softmax = kp.softmax(s, lse2, q_lo=qb * bq, k_lo=k_lo, keys_along_rows=True,
                         kv_len=work.kv_len, q_len=work.q_len, masked=masked, segments=seg,
                         dp=dp, delta=delta, **mods)
    if kp.with_dk and kp.with_dv:
      publish = None if dq is None else functools.partial(dq.publish, step)
      acc["dk"], acc["dv"] = _dk_dv_update(acc["dk"], acc["dv"], softmax, q_tile, do_tile,
                                           stage, publish_ds=publish)
    elif kp.with_dk:
      acc["dk"] = mma_accumulate(acc["dk"], softmax.grad().astype(kp.dtype), q_tile, stage)
    else:
      acc["dv"] = mma_accumulate(acc["dv"], softmax.probs.astype(kp.dtype), do_tile, stage)
    bars.consumer_q_do_release(step)
    if dq is not None:
      dq.add(step, head, qb)
    return acc

  width = dict(dk=kp.head_dim, dv=kp.value_head_dim)
  zero_acc = lambda: {g: zeros((bk, width[g])) for g in kp.outputs}
  if kp.mods is not None:
    head_walk = kp.head_walks(mod_refs, work)

    def one_head_list(g, carry):
      acc, step = carry
      walk, head = head_walk(g)
      tile_mods = mod_refs.on_rows(kp.mods, work.batch_idx, head, element_loader())
      acc = walk_block_list(walk, functools.partial(block_fn, tile_mods=tile_mods), acc, step)
      return acc, step + walk.total

    acc, _ = lax.fori_loop(0, kp.group, one_head_list,
                           (zero_acc(), jnp.asarray(step0, jnp.int32)))
    return acc, k_lo

  def step_fn(qb, acc, *, masked, head_step0, head):
    step = head_step0 + (qb - lo)
    return block_fn(step, qb, acc, masked=masked, head=head)

  def skip_fn(qb, acc, *, head_step0, head):
    step = head_step0 + (qb - lo)
    bars.consumer_q_do(step)
    bars.consumer_q_do_release(step)
    if dq is not None:  # the other consumer's keys see the block: its dS^T counts
      dq.skip(step, head, qb)
    return acc

  def one_head(g, acc):
    head_step0 = step0 + g * blocks_per_head
    head = work.kv_head * kp.group + g
    return walk_blocks(lo, hi, own,
                functools.partial(step_fn, head_step0=head_step0, head=head),
                functools.partial(skip_fn, head_step0=head_step0, head=head), acc)

  acc = lax.fori_loop(0, kp.group, one_head, zero_acc())
  return acc, k_lo


def _dkv_epilogue(kp: _DkvPass, wg, acc, k_lo, smem: _DkvSmem, bars: DkvBarrierTable,
                  grad_refs, work: KeyTileWork, item=0):
  """Every wgmma reading K and V has completed, so their tiles hold the
  results on the way out (dV takes the K tile where it has no tile of its
  width: `_DkvPass.dv_wide_tile`). A queued consumer releases the copy for
  the producer once the store has read it."""
  bk = kp.cfg.block_kv
  copy = bars.slot("kv_full", item, wg)
  k_tile = smem.k.at[copy]
  out_tiles = {"dk": k_tile, "dv": k_tile if smem.v is None else smem.v.at[copy]}
  for g in kp.outputs:
    out_tiles[g][...] = (acc[g] * kp.score.scale if g == "dk" else acc[g]).astype(kp.dtype)
  plgpu.commit_smem()
  keys = (work.batch_idx, pl.ds(k_lo, bk), work.kv_head)
  for g, grad_ref in zip(kp.outputs, grad_refs):
    plgpu.copy_smem_to_gmem(out_tiles[g], grad_ref.at[keys])
  if kp.queued:
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    bars.consumer_kv_release(item, wg)
  else:
    plgpu.wait_smem_to_gmem(0)


def _tile_of(mods, mod_refs: ModRefs | None):
  """`KeyTileWork.of_this_cta`'s `tile_of`: with mods whose `tile_order` is
  given, the key tile that order puts at a CTA's position; else None."""
  return mod_refs.cta_tile if mods is not None and mods.tile_order else None


def dkv_persistent_work(cfg, batch: int, num_kv_heads: int, kv_seq: int) -> PersistentWork:
  """The queued dK/dV grid's units: key tiles of `num_consumers * block_kv`
  keys, heads fastest, then tiles (in order: under causal masks the first
  key tiles see the most queries, so they start first), then the batch."""
  return PersistentWork(batch, num_kv_heads, cdiv(kv_seq, cfg.num_consumers * cfg.block_kv),
                        cfg.num_sms, paired=False, queued=True)


@cached_build
def _build_dkv_kernel(*, batch, q_seq, kv_seq, kv_valid, num_q_heads, num_kv_heads,
                      head_dim, value_head_dim, dtype, score, mask, config, has_q_lengths,
                      has_kv_lengths, has_segments=False, outputs=("dk", "dv"),
                      chain=NO_CHAIN, queue_counter=True, mods=None):
  """The dK/dV kernel; `outputs` names the gradients this pass accumulates.

  A pass without dK needs neither V (for dP) nor delta: they are not loaded.
  With `has_segments` the inputs end with `SegmentRefs` (one consumer tile
  per consumer), and the ring streams each query block's ids with it.
  With `config.work_queue` the grid is persistent (`dkv_persistent_work`);
  `queue_counter=False` hands its units out in fixed round robin (the
  interpreter, vmapped calls).
  `mods` (`ModStatics`): the inputs end with `ModRefs` (block lists of the
  CTAs' key tiles), and the CTAs walk those lists (not with a work queue).
  """
  cfg = config
  nc = cfg.num_consumers
  kp = _DkvPass(cfg, mask, dtype, head_dim, value_head_dim, score,
                num_q_heads // num_kv_heads, tuple(outputs), is_interpreting(), has_segments,
                queued=cfg.work_queue, mods=mods)
  assert mods is None or not kp.queued, "mods: no work queue"
  statics = dict(num_keys=nc * cfg.block_kv, block_q=cfg.block_q, mask=mask, q_seq=q_seq,
                 kv_valid=kv_valid, group=kp.group)
  if kp.queued:
    persistent = dkv_persistent_work(cfg, batch, num_kv_heads, kv_seq)
    grid = dict(ctas=persistent.num_ctas)
  else:
    grid = dict(heads=num_kv_heads, kv_tiles=cdiv(kv_seq, nc * cfg.block_kv), batch=batch)

  def kernel(*refs):
    chain.at_start()
    gmem, rest = KernelRefs.split(refs, has_q_lengths, has_kv_lengths,
                                  nc if has_segments else None)
    mod_refs, (*grad_refs, smem, barrier_refs) = ModRefs.split(rest, mods)
    smem = _DkvSmem.unpack(smem, kp.with_dk, kp.dv_wide_tile, has_segments)
    bars = DkvBarrierTable(kp, barrier_refs)
    wg = lax.axis_index("wg")
    if kp.queued:
      queue = WorkQueue.create(smem.lse_ring.at[cfg.num_stages], kp.resident_copies,
                               persistent, lax.axis_index("ctas"),
                               counter=queue_counter and not kp.interpreting)

      def work_of(unit):
        batch_idx, kv_head, kv_tile = persistent.unit_coords(unit)
        return KeyTileWork.at(kv_head, batch_idx, kv_tile, gmem=gmem, **statics)
    else:
      work = KeyTileWork.of_this_cta(gmem=gmem, tile_of=_tile_of(mods, mod_refs), **statics)

    @pl.when(wg == nc)
    def _producer():
      plgpu.set_max_registers(cfg.producer_registers, action="decrease")
      if kp.queued:
        # The unit past the end rides on one plain arrive per K/V copy.
        num_steps = queue.producer_loop(
            nc, prepare=work_of,
            produce=lambda i, work, step0: _dkv_producer(kp, gmem, smem, bars, work, i, step0),
            acquire=bars.producer_kv_acquire, stop=bars.producer_kv_stop, drain=bars.drain_kv,
            stop_arrivals=kp.num_resident)
      else:
        num_steps = _dkv_producer(kp, gmem, smem, bars, work, mod_refs=mod_refs)
      bars.drain_q_do(num_steps)

    @pl.when(wg < nc)
    def _consumers():
      plgpu.set_max_registers(cfg.consumer_registers, action="increase")
      if kp.queued:
        def consume(i, unit, step0):
          work = work_of(unit)
          acc, k_lo = _dkv_consumer(kp, wg, smem, bars, work, gmem.segments, i, step0)
          _dkv_epilogue(kp, wg, acc, k_lo, smem, bars, grad_refs, work, i)
          return step0 + work.num_steps

        queue.consumer_loop(bars.consumer_kv, wg, consume)
        plgpu.wait_smem_to_gmem(0)
      else:
        acc, k_lo = _dkv_consumer(kp, wg, smem, bars, work, gmem.segments, mod_refs=mod_refs)
        _dkv_epilogue(kp, wg, acc, k_lo, smem, bars, grad_refs, work)

    chain.at_exit(grid)

  width = dict(dk=head_dim, dv=value_head_dim)
  out_type = tuple(jax.ShapeDtypeStruct((batch, kv_seq, num_kv_heads, width[g]), dtype)
                   for g in outputs)
  return launch(kernel, role="sm90_dkdv", out_type=out_type, smem=kp.smem(),
                barriers=DkvBarrierTable.scratch_types(kp),
                grid=grid, num_threads=nc + 1)


# --- dK / dV at head dim 256: the consumers split the head dim ------------------


class HeadSplitBarrierTable(BarrierTable):
  """Every mbarrier of the head-split kernel (`_build_dkv_head_split_kernel`),
  declared in the form of `pipeline.BarrierTable`.

  Who arrives on each barrier and who waits on it, by role and accessor
  (no role touches a barrier except through these accessors):

  name        count   arrivals   arrived on by                       waited on by
  kv_full     1       2 (TMA)    producer: producer_kv (TMAs of K    both consumers: consumer_kv,
                                   and V)                              once
  q_do_full   stages  streamed   producer: producer_q_do (TMAs of    both consumers: consumer_q_do,
                        (TMA)      Q, dO, lse2, delta, and the         every step
                                   queries' segment ids)
  q_do_free   stages  2          each consumer: consumer_q_do_release producer: producer_q_do_acquire
                                   (after its dK/dV GEMMs)             (before it refills the
                                                                       slot), drain_q_do*
  p_ds_full   2       1          warpgroup 0: producer_p_ds (P^T     warpgroup 1: consumer_p_ds
                                   and dS^T of the step stored)
  p_ds_free   2       2          each consumer: consumer_p_ds_release warpgroup 0: producer_p_ds_acquire
                                   (after its dK/dV GEMMs)             (before it rewrites the
                                                                       slot), drain_p_ds*
  dk_dv_full  1       2          each consumer: consumer_dk_dv_sync  both consumers: consumer_dk_dv_sync
                                   (its halves of dK and dV are in     (then one TMA-stores dK, the
                                   the K and V tiles)                  other dV)

  stages = num_stages; the q_do ring's slot is `slot("q_do_full", step)`,
  the p_ds ring's (two slots) `slot("p_ds_full", step)`. * interpreter only.
  """

  ALLOCATION_ORDER = "as declared"
  BARRIERS = {
      # name: Barrier(how many, arrivals, orders tensor core, arrived on by
      #               {accessor: how}, waited on by {accessor: how}, index)
      "kv_full": Barrier("one", 2, False, arrive={"producer_kv": TMA},
                         wait={"consumer_kv": WAIT}),
      "q_do_full": Barrier("stage", "streamed", False, arrive={"producer_q_do": FILL},
                           wait={"consumer_q_do": WAIT}, index=RING),
      "q_do_free": Barrier("stage", 2, False, arrive={"consumer_q_do_release": ARRIVE},
                           wait={"producer_q_do_acquire": ACQUIRE}, index=RING),
      "p_ds_full": Barrier("p_ds slots", 1, False, arrive={"producer_p_ds": PUBLISH},
                           wait={"consumer_p_ds": WAIT}, index=RING),
      "p_ds_free": Barrier("p_ds slots", 2, False, arrive={"consumer_p_ds_release": ARRIVE},
                           wait={"producer_p_ds_acquire": ACQUIRE}, index=RING),
      "dk_dv_full": Barrier("one", 2, False, arrive={"consumer_dk_dv_sync": SYNC},
                            wait={"consumer_dk_dv_sync": SYNC}),
  }

  @staticmethod
  def barrier_counts(kp: "_DkvPass") -> dict:
    return {"one": 1, "stage": kp.cfg.num_stages, "streamed": kp.num_streamed, "p_ds slots": 2}

  # Interpreter-only drains of the last phases (see `BarrierTable`).
  def drain_q_do(self, num_steps) -> None:
    """Producer: observe the q_do_free phases of the last lap."""
    self._drain_last_lap(num_steps, "q_do_free")

  def drain_p_ds(self, num_steps) -> None:
    """Warpgroup 0: observe the p_ds_free phases of the last lap."""
    self._drain_last_lap(num_steps, "p_ds_free")


class _HeadSplitSmem(NamedTuple):
  k: Any  # K tile, then dK
  v: Any  # V tile, then dV
  q_ring: Any
  do_ring: Any
  lse_ring: Any
  delta_ring: Any
  p_ring: Any  # pds ring: P^T
  ds: Any  # pds ring: dS^T
  q_ids: Any = None  # ring of the queries' segment ids; None without segment ids

  @staticmethod
  def types(cfg, head_dim: int, value_head_dim: int, dtype, has_segments: bool):
    bk, bq = cfg.block_kv, cfg.block_q
    swizzle = swizzle_bytes(dtype, bk, bq)
    if has_segments:
      # lse2 and delta rings in one buffer: Mosaic GPU starts every buffer at
      # a multiple of 1 KiB, and the ids' ring fits only in the KiB this saves.
      stats = (plgpu.SMEM((2, cfg.num_stages, bq), jnp.float32),)
    else:
      stats = (plgpu.SMEM((cfg.num_stages, bq), jnp.float32),) * 2  # lse2, delta rings
    ids = (id_ring(cfg.num_stages, bq),) if has_segments else ()
    return (
        smem_tile((bk, head_dim), dtype, swizzle),  # K tile, then dK
        smem_tile((bk, value_head_dim), dtype, swizzle),  # V tile, then dV
        smem_tile((cfg.num_stages, bq, head_dim), dtype, swizzle),  # Q ring
        smem_tile((cfg.num_stages, bq, value_head_dim), dtype, swizzle),  # dO ring
        *stats,
        smem_tile((2, bk, bq), dtype, swizzle),  # pds ring: P^T
        smem_tile((2, bk, bq), dtype, swizzle),  # pds ring: dS^T
        *ids,  # the queries' segment ids
    )

  @classmethod
  def unpack(cls, smem, has_segments: bool) -> "_HeadSplitSmem":
    if not has_segments:
      return cls(*smem)
    k, v, q_ring, do_ring, stats, p, ds, q_ids = smem
    return cls(k, v, q_ring, do_ring, stats.at[0], stats.at[1], p, ds, q_ids)


def _dv_first_then_dk(acc, softmax: TileSoftmax, dp, delta, dtype, do_cols, q_cols, ds_tile,
                      acquire, publish):
  """Warpgroup 0 of "dv_dk_split" on hardware: dV += P^T dO with P^T in
  registers is issued first; dS^T is computed while it runs, written to the
  ring slot (`acquire` before, `publish` after: warpgroup 1 takes it from
  there), and, where warpgroup 0 keeps dK columns (`q_cols`), dK += dS^T Q
  follows from the slot. One wait covers both. Returns (dk, dv)."""
  p = softmax.probs.astype(dtype)

  def body(refs):
    dk_ref, dv_ref = refs
    plgpu.wgmma(dv_ref, p, do_cols)
    ds = scores_grad(softmax.ds_weight, dp, delta)
    acquire()
    ds_tile[...] = ds.astype(dtype)
    publish()
    if dk_ref is not None:
      plgpu.wgmma(dk_ref, ds_tile, q_cols)

  dk, dv = acc
  return pl.run_state(body)((None if dk is None else plgpu.ACC.init(dk), plgpu.ACC.init(dv)))


def _head_split_producer(cfg, gmem: KernelRefs, smem: _HeadSplitSmem,
                         bars: HeadSplitBarrierTable, work: KeyTileWork, keys, num_steps,
                         head_walk=None, group: int = 1):
  """K and V once, then (Q, dO, lse2, delta, and the queries' segment ids)
  of every step through the ring. With mods (`head_walk`:
  `_DkvPass.head_walks`) the steps are each query head's block list."""
  bq = cfg.block_q
  plgpu.set_max_registers(cfg.producer_registers, action="decrease")
  kv_full = bars.producer_kv()
  plgpu.copy_gmem_to_smem(gmem.k.at[keys], smem.k, kv_full)
  plgpu.copy_gmem_to_smem(gmem.v.at[keys], smem.v, kv_full)

  def load_block(step, head, qb):
    rows = (work.batch_idx, pl.ds(qb * bq, bq), head)
    stats = (work.batch_idx, head, pl.ds(qb * bq, bq))
    streamed = [(gmem.q.at[rows], smem.q_ring), (gmem.do.at[rows], smem.do_ring),
                (gmem.lse.at[stats], smem.lse_ring), (gmem.delta.at[stats], smem.delta_ring)]
    if smem.q_ids is not None:
      streamed.append(_query_ids(gmem, work.batch_idx, qb, bq, smem.q_ids))
    bars.producer_q_do_acquire(step)
    bars.producer_q_do(streamed, step)

  if head_walk is not None:
    def one_head(g, step):
      walk, head = head_walk(g)
      pl.loop(0, walk.total)(lambda n: load_block(step + n, head, walk.block(n)))
      return step + walk.total

    lax.fori_loop(0, group, one_head, jnp.int32(0))
  else:
    @pl.loop(0, num_steps)
    def _(step):
      head, qb = work.rows_of(step)
      load_block(step, head, qb)

  bars.drain_q_do(num_steps)


def _head_split_consumer(h: int, kp: _DkvPass, smem: _HeadSplitSmem, bars: HeadSplitBarrierTable,
                         work: KeyTileWork, blocks_per_head, num_steps,
                         segments: SegmentRefs | None, mod_refs: ModRefs | None = None):
  """Consumer `h`: columns [h * d/2, (h + 1) * d/2) of dK and [h * dv/2,
  (h + 1) * dv/2) of dV of the CTA's keys. Warpgroup 0 computes P^T and
  dS^T of each step and hands them to warpgroup 1 through the pds ring.
  Returns (dK half, dV half). With mods
  warpgroup 0 walks each query head's block list; warpgroup 1 takes the
  `num_steps` steps in order."""
  cfg, bk, bq, c = kp.cfg, kp.cfg.block_kv, kp.cfg.block_q, kp.exp2_constant
  (dk_lo, dk_w), (dv_lo, dv_w) = kp.split_columns(h)
  cols, cols_v = pl.ds(dk_lo, dk_w), pl.ds(dv_lo, dv_w)
  # "dv_dk_split" on hardware: warpgroup 0 alone reads P^T, so it stays in
  # registers as the dV wgmma's A operand (no P^T tile written or read), and
  # that wgmma runs while dS^T is computed (`_dv_first_then_dk`). The
  # interpreter, which has no register A operands, goes through the P^T ring.
  # (With `wg1_dv` warpgroup 1 reads P^T from the ring.)
  p_in_registers = (h == 0 and cfg.dk_dv == "dv_dk_split" and not cfg.wg1_dv
                    and not kp.interpreting)
  lo, hi = work.lo, work.hi
  # Only warpgroup 0 computes P^T and needs the ids.
  block_segments = _key_tile_segments(segments if h == 0 else None, work.batch_idx, work.k_lo,
                                      bk, smem.q_ids)

  def block_fn(step, qb, acc, *, masked, tile_mods=None):
    """Query block qb (warpgroup 0's business) at ring position `step`."""
    slot = bars.slot("q_do_full", step)
    q_tile, do_tile = smem.q_ring.at[slot], smem.do_ring.at[slot]
    p_tile = smem.p_ring.at[bars.slot("p_ds_full", step)]
    ds_tile = smem.ds.at[bars.slot("p_ds_full", step)]
    bars.consumer_q_do(step)
    if h == 0:
      # ("dv_dk_split" may fold lse2 and delta into the accumulators or load
      # them first, as the fused kernel; `sm90_backward.choose_mods_config`
      # folds nothing here.)
      s, dp, lse2, delta = transposed_scores(
          *operands, q_tile, do_tile, stats_of_slot(smem.lse_ring, smem.delta_ring, slot),
          c=c, fold_stats=cfg.fold_stats, stats_first=cfg.stats_first,
          needs_raw_scores=kp.needs_raw_scores)
      seg = block_segments(slot) if masked else None
      mods = {} if tile_mods is None else dict(mods=tile_mods)
      softmax = kp.softmax(s, lse2, q_lo=qb * bq, k_lo=work.k_lo, keys_along_rows=True,
                           kv_len=work.kv_len, q_len=work.q_len, masked=masked, segments=seg,
                           **mods)
      if p_in_registers:
        dk, dv = _dv_first_then_dk(acc, softmax, dp, delta, kp.dtype, do_tile.at[:, cols_v],
                                   q_tile.at[:, cols] if dk_w else None, ds_tile,
                                   lambda: bars.producer_p_ds_acquire(step),
                                   lambda: bars.producer_p_ds(step))
        bars.consumer_q_do_release(step)
        bars.consumer_p_ds_release(step)
        return dk, dv
      ds = scores_grad(softmax.ds_weight, dp, delta)
      bars.producer_p_ds_acquire(step)
      p_tile[...] = softmax.probs.astype(kp.dtype)
      ds_tile[...] = ds.astype(kp.dtype)
      bars.producer_p_ds(step)
    else:
      bars.consumer_p_ds(step)
    if dk_w and dv_w:
      dk, dv = mma_accumulate_pair(acc[0], ds_tile, q_tile.at[:, cols],
                                   acc[1], p_tile, do_tile.at[:, cols_v])
    elif dk_w:  # ("dv_dk_split": warpgroup 1, or 0 without dK columns)
      dk, dv = mma_accumulate_smem(acc[0], ds_tile, q_tile.at[:, cols]), acc[1]
    elif dv_w:
      dk, dv = acc[0], mma_accumulate_smem(acc[1], p_tile, do_tile.at[:, cols_v])
    else:  # ("dv_dk_split" with wg1_dv: warpgroup 0 keeps nothing)
      dk, dv = acc
    bars.consumer_q_do_release(step)
    bars.consumer_p_ds_release(step)
    return dk, dv

  def step_fn(qb, acc, *, masked, head_step0):
    step = head_step0 + (qb - lo)
    return block_fn(step, qb, acc, masked=masked)

  def one_head_list(g, carry):
    acc, step = carry
    walk, head = kp.head_walks(mod_refs, work)(g)
    tile_mods = mod_refs.on_rows(kp.mods, work.batch_idx, head, element_loader())
    acc = walk_block_list(walk, functools.partial(block_fn, tile_mods=tile_mods), acc, step)
    return acc, step + walk.total

  def one_head(g, acc):
    head_step0 = g * blocks_per_head
    # One consumer tile: the CTA's ranges are its own.
    return walk_blocks(lo, hi, work.ranges, functools.partial(step_fn, head_step0=head_step0),
                lambda qb, acc: acc, acc)

  registers = cfg.wg0_registers if h == 0 and cfg.wg0_registers else cfg.consumer_registers
  plgpu.set_max_registers(registers, action="increase")
  bars.consumer_kv()
  # The A operands of S^T and dP^T (warpgroup 0's): SMEM tiles, or in
  # registers (`k_in_registers`, `operands_in_registers`; not in the
  # interpreter, which has no register A operands).
  operands = (smem.k, smem.v)
  if h == 0 and (cfg.k_in_registers or cfg.operands_in_registers) and not kp.interpreting:
    operands = (load_operand(smem.k),
                load_operand(smem.v) if cfg.operands_in_registers else smem.v)
  zero_acc = lambda: (zeros((bk, dk_w)) if dk_w else None,
                      zeros((bk, dv_w)) if dv_w else None)
  if kp.mods is not None and h == 0:
    (dk, dv), _ = lax.fori_loop(0, kp.group, one_head_list, (zero_acc(), jnp.int32(0)))
  elif kp.mods is not None:  # warpgroup 1 needs no block index
    dk, dv = lax.fori_loop(0, num_steps, lambda step, acc: block_fn(step, None, acc, masked=False),
                           zero_acc())
  else:
    dk, dv = lax.fori_loop(0, kp.group, one_head, zero_acc())
  if h == 0:
    bars.drain_p_ds(num_steps)
  return dk, dv


def _head_split_epilogue(h: int, kp: _DkvPass, dk, dv, smem: _HeadSplitSmem,
                         bars: HeadSplitBarrierTable, dk_ref, dv_ref, keys):
  """dK_h and dV_h go into column halves of the K and V tiles (TMA wants
  contiguous SMEM, so whole tiles go out after the rendezvous). Only
  warpgroup 0 reads K and V, and its last reads completed before it published
  the last pds slot that warpgroup 1 waited for; both waited for K and V to
  have landed, so a CTA with no work cannot race their TMA."""
  (dk_lo, dk_w), (dv_lo, dv_w) = kp.split_columns(h)
  if dk_w:
    smem.k.at[:, pl.ds(dk_lo, dk_w)][...] = (dk * kp.score.scale).astype(kp.dtype)
  if dv_w:
    smem.v.at[:, pl.ds(dv_lo, dv_w)][...] = dv.astype(kp.dtype)
  plgpu.commit_smem()
  bars.consumer_dk_dv_sync()
  out_tile, out_ref = (smem.k, dk_ref) if h == 0 else (smem.v, dv_ref)
  plgpu.copy_smem_to_gmem(out_tile, out_ref.at[keys])
  plgpu.wait_smem_to_gmem(0)


@cached_build
def _build_dkv_head_split_kernel(*, batch, q_seq, kv_seq, kv_valid, num_q_heads,
                                 num_kv_heads, head_dim, value_head_dim, dtype, score, mask,
                                 config, has_q_lengths, has_kv_lengths, has_segments=False,
                                 chain=NO_CHAIN, mods=None):
  """dK and dV where they do not fit one warpgroup's registers (head dim 256).

  A CTA owns `block_kv` keys, and consumer warpgroup h owns columns
  [h * d/2, (h + 1) * d/2) of their dK and [h * dv/2, (h + 1) * dv/2) of
  their dV (dv: `value_head_dim`, whose halves must fall on the 64-column
  swizzle tiles too): (d + dv) / 4 fp32 registers per thread, at 256 / 256
  as many as dK + dV at head dim 128. Every column needs the whole P^T and
  dS^T of a step. Warpgroup 0 computes them (in fp32, as `_build_dkv_kernel` does) and
  hands them to warpgroup 1 through a double-buffered SMEM ring:

    warpgroup 0: S^T = K Q^T, dP^T = V dO^T, P^T, dS^T -> pds ring
                 dV_0 += P^T dO_0,  dK_0 += dS^T Q_0
    warpgroup 1: dV_1 += P^T dO_1,  dK_1 += dS^T Q_1   (from the ring)

  Four tile GEMMs per query block (S^T, dP^T, dV, dK) as in the "fused"
  scheme, where two passes of `_build_dkv_kernel` run five. Warpgroup 1's
  GEMMs of step n run on the tensor core while warpgroup 0 computes the
  softmax of step n + 1. Barriers: `HeadSplitBarrierTable`. With
  `has_segments` the inputs end with `SegmentRefs` of one consumer tile (the
  CTA's) per CTA, and the ring streams each query block's ids with it.
  `mods` (`ModStatics`): the inputs end with `ModRefs` (block lists of the
  CTAs' key tiles), and the CTAs walk those lists.
  """
  cfg = config
  kp = _DkvPass(cfg, mask, dtype, head_dim, value_head_dim, score,
                num_q_heads // num_kv_heads, ("dk", "dv"), is_interpreting(), has_segments,
                mods=mods)
  bk = cfg.block_kv
  grid = dict(heads=num_kv_heads, kv_tiles=cdiv(kv_seq, bk), batch=batch)

  def kernel(*refs):
    chain.at_start()
    gmem, rest = KernelRefs.split(refs, has_q_lengths, has_kv_lengths,
                                  1 if has_segments else None)
    mod_refs, (dk_ref, dv_ref, smem, barrier_refs) = ModRefs.split(rest, mods)
    smem = _HeadSplitSmem.unpack(smem, has_segments)
    bars = HeadSplitBarrierTable(kp, barrier_refs)
    work = KeyTileWork.of_this_cta(
        tile_of=_tile_of(mods, mod_refs), num_keys=bk, block_q=cfg.block_q, mask=mask,
        gmem=gmem, q_seq=q_seq, kv_valid=kv_valid, group=kp.group)
    # Once per CTA, outside the roles (as the roles' loops use them).
    blocks_per_head, num_steps = work.blocks_per_head, work.num_steps
    head_walk = None
    if mods is not None:
      head_walk, num_steps = kp.head_walks(mod_refs, work), kp.total_steps(mod_refs, work)
    keys = (work.batch_idx, pl.ds(work.k_lo, bk), work.kv_head)
    wg = lax.axis_index("wg")

    pl.when(wg == 2)(
        lambda: _head_split_producer(cfg, gmem, smem, bars, work, keys, num_steps, head_walk,
                                     kp.group))

    def consumer(h: int):
      dk, dv = _head_split_consumer(h, kp, smem, bars, work, blocks_per_head, num_steps,
                                    gmem.segments, mod_refs)
      _head_split_epilogue(h, kp, dk, dv, smem, bars, dk_ref, dv_ref, keys)

    pl.when(wg == 0)(lambda: consumer(0))
    pl.when(wg == 1)(lambda: consumer(1))
    chain.at_exit(grid)

  out_type = tuple(jax.ShapeDtypeStruct((batch, kv_seq, num_kv_heads, width), dtype)
                   for width in (head_dim, value_head_dim))
  return launch(kernel, role="sm90_dkdv_head_split", out_type=out_type,
                smem=_HeadSplitSmem.types(cfg, head_dim, value_head_dim, dtype, has_segments),
                barriers=HeadSplitBarrierTable.scratch_types(kp),
                grid=grid, num_threads=3)
