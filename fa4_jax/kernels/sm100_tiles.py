"""What the sm_100 kernels (forward, dK/dV, dQ) share: the SM's budgets, the
TMEM register layouts, the mechanics of a barrier table.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fa4_jax import scores
from fa4_jax.interpret import is_interpreting

# Hardware limits of one sm_100 SM.
TMEM_COLUMNS = 512  # 128 lanes x 512 columns of 32 bits
SMEM_BYTES = 232448  # dynamic shared memory per block (227 KiB)

# TMEM loads in the 32x32b shape: thread t of the warpgroup owns TMEM lane
# (row) t, so row reductions need no shuffles.
ROW_LAYOUT = plgpu.Layout.TCGEN05_TMEM_NATIVE
ROW_VECTOR_LAYOUT = plgpu.Layout.TCGEN05_TMEM_NATIVE.reduce(1)  # one value per row
# A vector along the columns, broadcast along the rows: every thread holds all
# of it (e.g. a block's key segment ids).
COL_VECTOR_LAYOUT = plgpu.Layout.TCGEN05_TMEM_NATIVE.reduce(0)
# Epilogues read accumulators in the 16x256b shape instead: Mosaic GPU can
# store that layout into swizzled SMEM for the TMA (not the 32x32b one).
EPILOGUE_LAYOUT = plgpu.Layout.TCGEN05


def element_mask(mask: scores.MaskSpec, shape, *, row_lo, col_lo, keys_along_rows: bool, kv_len,
                 q_len, segments=None, hide_rows_past_q_len: bool = False, mask_mod=None):
  """`scores.visible` over a `ROW_LAYOUT` tile of `shape` whose rows start
  at `row_lo` and hold queries (keys when `keys_along_rows`, as in the
  dK/dV kernel), its columns at `col_lo`: the element mask of every sm100
  kernel. `segments`: None, or (the rows' ids as a vector along them, the
  GMEM ids [B, length] of what the columns hold, the batch index). The
  columns' ids are read here, so only blocks that need the element mask
  pay, one 4-byte id per column and thread (Mosaic GPU lowers GMEM loads
  into these layouts only unoptimized: per-thread loads, no SMEM plan).
  `hide_rows_past_q_len`: also hide rows at or past `q_len` (the forward,
  whose rows are queries). `mask_mod`: None, or a hook (q_idx, kv_idx) ->
  bool tile and-ed with the built-ins (`mod_tiles.TileMods.mask_hook`);
  without it the traced program is the one built before it existed."""
  rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=ROW_LAYOUT) + row_lo
  cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=ROW_LAYOUT) + col_lo
  row_seg = col_seg = None
  if segments is not None:
    row_ids, column_ids_ref, batch_idx = segments
    column_ids = plgpu.load(column_ids_ref.at[batch_idx, pl.ds(col_lo, shape[1])],
                            layout=COL_VECTOR_LAYOUT, optimized=False)
    row_seg = lax.broadcast_in_dim(row_ids, shape, [0])
    col_seg = lax.broadcast_in_dim(column_ids, shape, [1])
  k_idx, q_idx = (rows, cols) if keys_along_rows else (cols, rows)
  kv_seg, q_seg = (row_seg, col_seg) if keys_along_rows else (col_seg, row_seg)
  ok = scores.visible(mask, q_idx, k_idx, kv_len, q_seg, kv_seg, q_len=q_len)
  if mask_mod is not None:
    ok = ok & mask_mod(q_idx, k_idx)
  return ok & (rows < q_len) if hide_rows_past_q_len else ok


def tile_positions(shape, *, row_lo, col_lo, keys_along_rows: bool):
  """(q_idx, kv_idx): int32 `ROW_LAYOUT` tiles of `shape` of the query and
  key positions of a tile whose rows start at `row_lo` (keys when
  `keys_along_rows`) and columns at `col_lo`: what a `score_mod` sees."""
  rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=ROW_LAYOUT) + row_lo
  cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=ROW_LAYOUT) + col_lo
  return (cols, rows) if keys_along_rows else (rows, cols)


def rem(x, n: int):
  """x mod n for a loop index (traced or a Python int)."""
  if isinstance(x, int):
    return x % n
  return lax.rem(x, jnp.asarray(n, x.dtype))


@dataclasses.dataclass(frozen=True)
class Waiter:
  """The waiting side of a barrier (one phase per call)."""

  ref: object

  def wait(self) -> None:
    plgpu.barrier_wait(self.ref)


class BarrierTable:
  """Every mbarrier of one kernel, declared in one table.

  A kernel's subclass (`ForwardBarriers`, `DkvBarriers`, `DqBarriers`) keeps
  only its table: SPECS, name -> (arrivals, orders_tensor_core, per), where
  `per` is a key of the dict `barrier_counts(plan)` returns for the kernel's
  tile plan (how many barriers of that name: one per stage of a ring, per Q
  tile, ...; a count of 0 declares none); its docstring, which names who
  arrives on and who waits on every barrier; and its accessors (producer_*,
  consumer_*, drain_*), the only way the roles touch a barrier (`_at`).
  """

  SPECS: dict[str, tuple[int, bool, str]] = {}

  @staticmethod
  def barrier_counts(plan) -> dict[str, int]:
    raise NotImplementedError

  @classmethod
  def scratch_types(cls, plan) -> dict:
    """The kernel's barrier scratch: one plgpu.Barrier array per name."""
    counts = cls.barrier_counts(plan)
    return {
        name: plgpu.Barrier(num_arrivals=arrivals, num_barriers=counts[per],
                            orders_tensor_core=orders_tc)
        for name, (arrivals, orders_tc, per) in cls.SPECS.items() if counts[per]
    }

  def __init__(self, plan, refs: dict):
    self.counts = self.barrier_counts(plan)
    self._refs = refs
    # Pallas' GPU interpreter wants every waiter to observe every phase of a
    # barrier before the kernel ends; hardware does not. The drain_* accessors
    # wait out those last phases only when interpreting (the one place each
    # kernel decides that).
    self._interpreting = is_interpreting()

  def _at(self, name, index=0):
    return self._refs[name].at[index]

  def _drain_last_lap(self, num_steps, *acquires) -> None:
    """Interpreter only: the producer of a ring of `counts["stage"]` slots
    calls each of `acquires` (a slot's producer_*_acquire) on the slots of
    the last lap, observing the consumers' final free phases."""
    if not self._interpreting:
      return
    stages = self.counts["stage"]

    @pl.loop(jnp.maximum(num_steps - stages, 0), num_steps)
    def _(n):
      slot = rem(n, stages)
      for acquire in acquires:
        acquire(slot)


class KvRingAccessors(BarrierTable):
  """The barrier table of a kernel whose load warp streams K and V blocks
  through ring slots that its MMA warp frees (the forward and the dQ
  kernel), with the rings' accessors: k_full / v_full (TMA, one arrival per
  slot), k_free / v_free (tcgen05 commit, one per slot), one of each per
  "stage". The subclass lists these in its table."""
  def producer_k_acquire(self, slot) -> None:
    """Load warp: wait until the MMAs that read this K slot completed."""
    plgpu.barrier_wait(self._at("k_free", slot))

  def producer_k(self, slot):
    """TMA barrier of a K slot."""
    return self._at("k_full", slot)

  def consumer_k(self, slot) -> Waiter:
    return Waiter(self._at("k_full", slot))

  def consumer_k_release(self, slot) -> None:
    """MMA warp: the slot is free once every MMA issued so far completed."""
    plgpu.tcgen05_commit_arrive(self._at("k_free", slot))

  def producer_v_acquire(self, slot) -> None:
    plgpu.barrier_wait(self._at("v_free", slot))

  def producer_v(self, slot):
    return self._at("v_full", slot)

  def consumer_v(self, slot) -> Waiter:
    return Waiter(self._at("v_full", slot))

  def consumer_v_release(self, slot) -> None:
    plgpu.tcgen05_commit_arrive(self._at("v_free", slot))

  def drain_kv_rings(self, num_steps) -> None:
    """Load warp, interpreter only: observe the k_free / v_free phases of the
    last lap."""
    self._drain_last_lap(num_steps, self.producer_k_acquire, self.producer_v_acquire)
