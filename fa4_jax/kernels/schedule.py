"""Which work items a CTA runs, and in what order.

Two grids, chosen per call by the kernel's config:

* One CTA per (q head, q tile, batch) tile. Under causal-like masks
  (`pairs_causal_tiles`) later query tiles see more keys, so the grid is
  walked heavy first (`heavy_first_tile`): the long tiles start in the first
  wave and the short ones fill the tail.
* A persistent grid (`PersistentWork`): one CTA per SM walks a share of the
  tiles in closed form, in the order the hardware would launch the
  one-CTA-per-tile grid, so the tiles in flight share K/V in L2. Causal tiles
  are paired heavy with light so that every CTA gets the same work.
* A persistent grid with a work queue (`PersistentWork.queued`, `WorkQueue`):
  the same order, but each CTA takes its next tile from a counter in GMEM
  when it starts the previous one, so CTAs whose tiles turned out short
  (packed documents: a tile's cost is run-time data) take more of them.

The functions work on Python ints (tests, host-side sizing) and on traced
int32 scalars (inside a kernel) alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from fa4_jax.batching import custom_vmap_call
from fa4_jax.kernels import default_device
from fa4_jax.scores import MaskSpec
from fa4_jax.target import current_target


def pairs_causal_tiles(mask: MaskSpec) -> bool:
  """Causal-like masks (a right bound, no left one): later query tiles see
  more keys, so they run first and a persistent grid pairs them. Not the
  decode arrangement's band (`MaskSpec.key_chunk`): its rows are the last
  few tokens of long rows, and its tiles equally heavy."""
  return mask.right is not None and mask.left is None and mask.key_chunk is None


def heavy_first_tile(grid_index, num_q_tiles: int, heavy_first: bool):
  """The q tile that grid index `grid_index` of a one-CTA-per-tile grid
  computes: the last (heaviest) tiles first when `heavy_first`."""
  return num_q_tiles - 1 - grid_index if heavy_first else grid_index


def _div(x, n: int):
  return x // n if isinstance(x, int) else lax.div(x, jnp.int32(n))


def _rem(x, n: int):
  return x % n if isinstance(x, int) else lax.rem(x, jnp.int32(n))


# A work queue's SMEM cells hold units as f32 values (`WorkQueue`).
MAX_QUEUED_UNITS = 2 ** 24


@dataclasses.dataclass(frozen=True)
class PersistentWork:
  """The work items of a persistent grid: which (batch, q head, q tile) the
  i-th item of CTA `cta` is, in closed form (Python ints or int32 scalars).

  Units of work are dealt round-robin to the CTAs, heads varying fastest,
  then q tiles, then the batch, as the hardware launches a (heads, q_tiles,
  batch) grid: the units in flight read the K/V of few (batch, head) pairs,
  which stay in L2 (walking the batch before the tiles measured 412 vs 629
  TFLOP/s at B8 S2048 D128 on an H100).

  A unit is one q tile, or, under causal-like masks (`paired`), a pair of
  tiles whose costs add up to the same for every pair: the heaviest with the
  lightest, and so on (the heavy one first). Dealing single causal tiles
  round-robin gave some CTAs only heavy tiles (436 vs 531 TFLOP/s at B8
  S2048 causal). An odd tile count gets one empty tile past the end (no KV
  blocks; its rows are past the query length, so nothing lands in the output).

  `queued`: units are single tiles, heavy first under causal-like masks
  (`heavy_first`), and CTA `cta` starts with unit `cta`; the others are
  handed out at run time (`WorkQueue`), so `count` and `coords` do not apply
  and `unit_coords` names a unit's tile.
  """

  batch: int
  num_heads: int
  num_q_tiles: int
  num_sms: int
  paired: bool
  queued: bool = False
  heavy_first: bool = False

  def __post_init__(self):
    if self.queued and self.paired:
      raise ValueError("PersistentWork: a queued grid hands out single tiles (paired=False)")
    if self.queued and self.num_units > MAX_QUEUED_UNITS:
      raise ValueError(f"PersistentWork: a work queue names at most {MAX_QUEUED_UNITS} units "
                       f"(f32 cells); got {self.num_units}")

  @property
  def tile_slots(self) -> int:
    return self.num_q_tiles + (self.num_q_tiles % 2 if self.paired else 0)

  @property
  def tiles_per_unit(self) -> int:
    return 2 if self.paired else 1

  @property
  def num_units(self) -> int:
    return self.batch * self.num_heads * self.tile_slots // self.tiles_per_unit

  @property
  def num_ctas(self) -> int:
    return min(self.num_units, self.num_sms)

  def count(self, cta):
    """Work items (tiles) of CTA `cta`."""
    return _div(self.num_units - cta + (self.num_ctas - 1), self.num_ctas) * self.tiles_per_unit

  def coords(self, cta, i):
    """(batch, q head, q tile) of CTA `cta`'s i-th work item."""
    unit = cta + _div(i, self.tiles_per_unit) * self.num_ctas
    head = _rem(unit, self.num_heads)
    rest = _div(unit, self.num_heads)
    per_batch = self.tile_slots // self.tiles_per_unit
    position, batch_idx = _rem(rest, per_batch), _div(rest, per_batch)
    last = self.tile_slots - 1
    if not self.paired:
      return batch_idx, head, position
    first = _rem(i, 2) == 0
    heavy, light = last - position, position
    if isinstance(i, int):
      return batch_idx, head, heavy if first else light
    return batch_idx, head, jnp.where(first, heavy, light)

  def unit_coords(self, unit):
    """(batch, q head, q tile) of unit `unit` of a queued grid: heads vary
    fastest, then tiles (heavy first), then the batch, as the hardware
    launches the one-CTA-per-tile grid."""
    head = _rem(unit, self.num_heads)
    rest = _div(unit, self.num_heads)
    position, batch_idx = _rem(rest, self.num_q_tiles), _div(rest, self.num_q_tiles)
    return batch_idx, head, heavy_first_tile(position, self.num_q_tiles, self.heavy_first)


@dataclasses.dataclass(frozen=True)
class WorkQueue:
  """Hands out a persistent grid's units at run time (`PersistentWork.queued`):
  the forward's query tiles, the dK/dV kernel's key tiles.

  A counter in GMEM (a Pallas global semaphore: zeroed before every launch)
  counts the units taken after the first wave: CTA `cta` runs unit `cta`
  first, then `num_ctas + atomicAdd(counter, 1)` until that passes
  `num_units`. Only the producer takes units, one ahead: when it starts
  work item i (the copies of its per-item buffer acquired: Q in the
  forward, K and V in the dK/dV kernel), `fetch` issues the atomic from one
  thread (warp 1, lane 0 of the warpgroup, so the thread that issues the TMA
  copies does not wait for it), which stores the unit into the SMEM cell of
  item i + 1; the producer reads it after a warpgroup barrier when it is
  done loading item i (`fetched`), and each consumer after its wait for
  item i + 1's buffer (`unit_of`), which that barrier and the buffer's TMA
  order after the store. A unit past the end, followed by plain arrives on
  the buffer's barriers, tells the consumers to stop. `producer_loop` and
  `consumer_loop` are the two roles' sides of this protocol.

  `depth + 1` cells (`num_cells`), used round robin: item i + 1's cell was
  last read by item i - depth's consumers, whose copy the producer had to
  see released before starting item i. The cells ride in the LSE rows'
  buffer (the lse2 ring's in the dK/dV kernel), which has bytes to spare
  (every SMEM buffer starts at a 1 KiB multiple, and one more KiB would not
  fit beside the packed D128 config),
  so they are f32 words; Pallas' Mosaic GPU lowering has no scalar bitcast,
  so they hold the unit as a float, exact below 2^24 units
  (`PersistentWork` checks). Without the counter (the interpreter, and
  vmapped calls: `fixed_shares_under_vmap`) the fetch is the fixed round robin
  `unit + num_ctas`: the same protocol without the atomic.
  """

  counter: Any  # GMEM int32 semaphore; None: fixed round robin
  cells: Any  # SMEM f32 [>= num_cells(depth)]
  depth: int  # copies of each consumer's per-item buffer (Q in the forward)
  first_unit: Any  # this CTA's first unit (its index)
  num_ctas: int
  num_units: int

  @staticmethod
  def num_cells(depth: int) -> int:
    return depth + 1

  @classmethod
  def create(cls, cells, depth: int, work: PersistentWork, cta, counter: bool) -> "WorkQueue":
    """`counter`: take units from a GMEM counter (hardware only), else in a
    fixed round robin."""
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR((1,))) if counter else None
    return cls(sem, cells, depth, cta, work.num_ctas, work.num_units)

  def loop(self, body, first_unit, init):
    """Runs body(i, unit, carry) -> (next unit, carry) while the unit is one
    of the grid's; returns (items run, carry)."""

    def step(state):
      i, unit, carry = state
      unit, carry = body(i, unit, carry)
      return i + 1, unit, carry

    i, _, carry = lax.while_loop(lambda state: state[1] < self.num_units, step,
                                 (jnp.int32(0), first_unit, init))
    return i, carry

  def _cell(self, item):
    return _rem(item, self.num_cells(self.depth))

  def fetch(self, item, unit) -> None:
    """Producer, starting item `item` (of unit `unit`): takes the unit of
    item + 1 into its cell."""
    cell = self._cell(item + 1)
    if self.counter is None:
      self.cells[cell] = (unit + self.num_ctas).astype(jnp.float32)
      return
    _fetch_add_into(self.counter, self.cells, cell, self.num_ctas)

  def fetched(self, item):
    """Producer, done loading item `item`: the unit of item + 1."""
    if self.counter is not None:
      _warpgroup_barrier()
    return self._read(item + 1)

  def unit_of(self, item):
    """Consumer, after its Q wait of item `item`: the item's unit. At item 0
    the cell read holds nothing written yet (cell 0 is first written when
    the producer starts item `depth`, which reuses item 0's copies and so
    waits for their release); the select discards it."""
    return jnp.where(item == 0, self.first_unit, self._read(item))

  # --- the two roles' loops --------------------------------------------------
  # They take the accessors (`pipeline.BarrierTable`) of the buffer each
  # consumer gets once per item and whose full barrier carries the unit (Q
  # in the forward, K and V in the dK/dV kernel): each (item, consumer).

  def producer_loop(self, num_consumers: int, prepare, produce, *, acquire, stop, drain,
                    stop_arrivals: int = 1):
    """The producer's loop over the units this CTA takes. Per item i:
    `prepare(unit)` (what the item needs, read before the wait), the wait
    for every consumer's release of the copies item i will use, the fetch
    of item i + 1's unit, then `produce(i, prepared, step0)` -> step0, which
    fills those copies. Then the stop signal: the unit past the end sits in
    the next item's cell, and `stop_arrivals` plain arrives (one per TMA a
    fill makes) on each consumer's copy of that item let them read it.
    `acquire(item, consumer)`: the wait for the consumer's release;
    `stop(item, consumer)`: one plain arrive on the full barrier;
    `drain(num_items, next_acquired)`: the interpreter's drain of the
    releases. Returns the ring position after the last item."""

    def one_item(i, unit, step0):
      prepared = prepare(unit)
      for c in range(num_consumers):
        acquire(i, c)
      self.fetch(i, unit)  # item i + 1's unit, read once this item is loaded
      step0 = produce(i, prepared, step0)
      return self.fetched(i), step0

    num_items, total_steps = self.loop(one_item, self.first_unit, jnp.int32(0))
    for c in range(num_consumers):
      acquire(num_items, c)
    for c in range(num_consumers):
      for _ in range(stop_arrivals):
        stop(num_items, c)
    drain(num_items, next_acquired=True)
    return total_steps

  def consumer_loop(self, wait, consumer, consume) -> None:
    """Consumer `consumer`'s loop over the units the producer publishes:
    each item's wait (`wait(item, consumer)`) comes first (the unit rides with it),
    then `consume(i, unit, step0)` -> step0; the unit read after the next
    item's wait decides whether the loop goes on."""

    def next_unit(i):
      wait(i, consumer)
      return self.unit_of(i)

    def one_item(i, unit, step0):
      step0 = consume(i, unit, step0)
      return next_unit(i + 1), step0

    self.loop(one_item, next_unit(jnp.int32(0)), jnp.int32(0))

  def _read(self, item):
    return self.cells[self._cell(item)].astype(jnp.int32)


def _fetch_add_into(counter, cells, cell, num_ctas: int) -> None:
  """cells[cell] = num_ctas + atomicAdd(counter, 1) (as an f32 value), by
  one thread of the warpgroup (warp 1, lane 0)."""

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(),
                                plgpu.Layout.WG_SPLAT(shape=(1,))))
  def _(ctx, counter_ref, cells_ref, cell_splat):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    index = arith.index_cast(ir.IndexType.get(), cell_splat.registers.flat[0])
    tid = mgpu.utils.thread_idx()
    lane32 = arith.cmpi(arith.CmpIPredicate.eq,
                        arith.remui(tid, mgpu.c(128, tid.type)), mgpu.c(32, tid.type))
    with mgpu.utils.when(lane32):
      old = llvm.inline_asm(i32, [mgpu.utils.memref_ptr(counter_ref)],
                            "atom.relaxed.gpu.global.add.u32 $0, [$1], 1;", "=r,l",
                            has_side_effects=True)
      unit = arith.addi(old, mgpu.c(num_ctas, i32))
      memref.store(arith.sitofp(ir.F32Type.get(), unit), cells_ref, [index])

  _(counter, cells, jnp.full((1,), cell, jnp.int32))


def _warpgroup_barrier() -> None:
  """All 128 threads of this warpgroup meet (bar.sync): orders the fetching
  thread's SMEM store before the others' reads and the TMA that follows."""

  @plgpu.inline_mgpu()
  def _(ctx):
    del ctx
    mgpu.utils.warpgroup_barrier()

  _()


def fixed_shares_under_vmap(queued_call, build_fixed):
  """`queued_call`, except under `jax.vmap`: Pallas batches a kernel by
  adding a grid axis, whose CTAs would all take units from the one counter
  of the work queue (`WorkQueue`), so a vmapped call runs the same kernel
  with the queue's counter replaced by fixed round-robin shares
  (`build_fixed()`, as in the interpreter)."""

  return custom_vmap_call(queued_call, under_vmap=lambda *args: build_fixed()(*args))


def sm_count(default: int) -> int:
  """SMs of the `fa4_jax.gpu_target` if one is active, else of the default
  device (a persistent grid launches one CTA per SM: more would queue a
  second wave); `default` without a GPU."""
  if (chosen := current_target()) is not None:
    return chosen.num_sms
  try:
    device = default_device()
  except RuntimeError:
    return default
  if device.platform != "gpu":
    return default
  return getattr(device, "core_count", None) or default
