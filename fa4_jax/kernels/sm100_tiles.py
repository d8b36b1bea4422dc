"""What the sm_100 kernels (forward, dK/dV, dQ) share: the SM's budgets, the
TMEM register layouts, the element mask, and the barrier table: each barrier
declared once (`Barrier`: count, arrivals, the accessors of the roles that
arrive and wait), its accessors generated from that declaration
(`BarrierTable`).
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fa4_jax import scores
from fa4_jax.interpret import is_interpreting
from fa4_jax.kernels.pipeline import rem

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


@dataclasses.dataclass(frozen=True)
class Waiter:
  """The waiting side of a barrier (one phase per call)."""

  ref: object

  def wait(self) -> None:
    plgpu.barrier_wait(self.ref)


class Touch(enum.Enum):
  """How an accessor touches its barrier: one phase per call."""

  # The arriving side.
  TMA = "returns the barrier, for the TMA copies whose bytes complete its phase"
  MMA = "returns the barrier, for the tcgen05 MMA that arrives on it once it completed"
  COMMIT = "arrives once every tcgen05 op the calling thread issued completed"
  ARRIVE = "one arrival of the calling threads"
  RELEASE_TO_TMA = ("one arrival of the calling threads, done reading SMEM that a TMA "
                    "rewrites next")
  # The waiting side.
  WAIT = "waits for its next phase"
  WAITER = "returns a Waiter, to wait for its next phase where the caller chooses"


# The touches by name alone, for the kernels' tables.
TMA, MMA, COMMIT, ARRIVE, RELEASE_TO_TMA = (Touch.TMA, Touch.MMA, Touch.COMMIT, Touch.ARRIVE,
                                            Touch.RELEASE_TO_TMA)
WAIT, WAITER = Touch.WAIT, Touch.WAITER


@dataclasses.dataclass(frozen=True)
class Barrier:
  """One barrier (an array of them) of a kernel's `BarrierTable`.

  `per`: how many, a key of the dict the table's `barrier_counts(plan)`
  returns (one per ring stage, per Q tile, ...; a count of 0 declares
  none); `arrivals`: the arrivals that complete one phase;
  `orders_tensor_core`: tcgen05 commits arrive on it, or it hands TMEM that
  threads wrote to an MMA. `arrive` and `wait`: its two sides, the
  accessors of the roles that arrive on it and of those that wait on it,
  accessor name -> `Touch`."""

  per: str
  arrivals: int
  orders_tensor_core: bool
  arrive: dict
  wait: dict


def _accessor(name: str, barrier: str, touch: Touch):
  """The method `name` of a `BarrierTable`: `touch` on barrier[index]."""
  def accessor(self, index=0):
    return self._touch(touch, self._refs[barrier].at[index])

  accessor.__name__ = accessor.__qualname__ = name
  accessor.__doc__ = f"{barrier}[index]: {touch.value}."
  return accessor


class BarrierTable:
  """Every mbarrier of one kernel, declared in one table.

  A kernel's subclass (`sm100_forward.ForwardBarrierTable`,
  `DkvBarrierTable`, `DqBarrierTable`) declares BARRIERS, name -> `Barrier`:
  how many, the arrivals of a phase and the accessors of the roles that
  arrive on it and wait on it. Those accessors (producer_*, consumer_*) are
  generated from the declaration and are the only way the roles touch a
  barrier; the subclass writes by hand only its interpreter-only drains
  (drain_*), which call them. Its docstring's table names who arrives on
  and who waits on every barrier, and why (`tests/barrier_tables.py` checks
  it against the declaration).
  """

  BARRIERS: dict[str, Barrier] = {}

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    for barrier, spec in vars(cls).get("BARRIERS", {}).items():
      for name, touch in {**spec.arrive, **spec.wait}.items():
        assert name not in vars(cls), f"{cls.__name__}.{name} is declared twice"
        setattr(cls, name, _accessor(name, barrier, touch))

  @staticmethod
  def barrier_counts(plan) -> dict[str, int]:
    raise NotImplementedError

  @classmethod
  def scratch_types(cls, plan) -> dict:
    """The kernel's barrier scratch: one plgpu.Barrier array per name."""
    counts = cls.barrier_counts(plan)
    return {
        name: plgpu.Barrier(num_arrivals=spec.arrivals, num_barriers=counts[spec.per],
                            orders_tensor_core=spec.orders_tensor_core)
        for name, spec in cls.BARRIERS.items() if counts[spec.per]
    }

  def __init__(self, plan, refs: dict):
    self.counts = self.barrier_counts(plan)
    self._refs = refs
    # Pallas' GPU interpreter wants every waiter to observe every phase of a
    # barrier before the kernel ends; hardware does not. The drain_* accessors
    # wait out those last phases only when interpreting (the one place each
    # kernel decides that).
    self._interpreting = is_interpreting()

  def _touch(self, touch: Touch, barrier):
    if touch in (Touch.TMA, Touch.MMA):
      return barrier
    if touch is Touch.WAITER:
      return Waiter(barrier)
    if touch is Touch.WAIT:
      plgpu.barrier_wait(barrier)
    elif touch is Touch.COMMIT:
      plgpu.tcgen05_commit_arrive(barrier)
    else:
      if touch is Touch.RELEASE_TO_TMA and self._interpreting:
        # The interpreter wants a proxy fence between the threads' SMEM
        # reads and the TMA that rewrites them; hardware does not (a TMA
        # ring's consumer releases its slot with a plain arrive).
        plgpu.commit_smem()
      plgpu.barrier_arrive(barrier)
    return None

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


# The K and V rings of a kernel whose load warp streams K and V blocks
# through ring slots that its MMA warp frees (the forward and the dQ kernel),
# one barrier of each per "stage"; the table splices them into its BARRIERS
# and derives from `KvRingBarrierTable`.
KV_RINGS = {
    "k_full": Barrier("stage", 1, False, arrive={"producer_k": TMA}, wait={"consumer_k": WAITER}),
    "k_free": Barrier("stage", 1, True, arrive={"consumer_k_release": COMMIT},
                      wait={"producer_k_acquire": WAIT}),
    "v_full": Barrier("stage", 1, False, arrive={"producer_v": TMA}, wait={"consumer_v": WAITER}),
    "v_free": Barrier("stage", 1, True, arrive={"consumer_v_release": COMMIT},
                      wait={"producer_v_acquire": WAIT}),
}


class KvRingBarrierTable(BarrierTable):
  """A `BarrierTable` with the `KV_RINGS`, and their drain."""

  def drain_kv_rings(self, num_steps) -> None:
    """Load warp, interpreter only: observe the k_free / v_free phases of the
    last lap."""
    self._drain_last_lap(num_steps, self.producer_k_acquire, self.producer_v_acquire)
