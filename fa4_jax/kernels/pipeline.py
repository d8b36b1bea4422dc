"""Barrier protocols of the Mosaic GPU kernels, each declared once per kernel.

A warp-specialized kernel moves data between roles (a TMA producer,
MMA / softmax consumers) through shared or tensor memory. Every hand-off is
guarded by mbarriers named for what they guard, FA4-style:

    x_full   the producer's data landed in buffer x; its consumers wait on it.
    x_free   every consumer is done reading buffer x; the producer waits on
             it before it overwrites x.

A kernel declares all its barriers in one `BarrierTable` subclass: per
barrier (`Barrier`) how many there are, the arrivals of a phase, how an
accessor's arguments pick one of them (`AT`, `RING`, `Copies`) and the
accessors of the roles that arrive on it and wait on it (producer_*,
consumer_*, each with its `Touch`). The accessors are generated from that
declaration and are the only way a role touches a barrier, so a reader
matches every wait with its arrive in the table's docstring, and
`tests/barrier_tables.py` checks the docstring against the declaration. The
sm90 kernels (`sm90_forward.ForwardBarrierTable`, `sm90_backward_dkdv`'s
`DkvBarrierTable` and `HeadSplitBarrierTable`, `sm90_backward_dq`'s
`DqBarrierTable`, `sm90_mla_decode.MlaBarrierTable`) and the sm100 kernels
declare theirs the same way.

Arrival accounting (Pallas Mosaic GPU, lane semantics):
- A TMA copy that names a barrier arrives on it once, carrying its byte count.
- `plgpu.barrier_arrive` from a warpgroup counts as one arrival.
- `plgpu.barrier_wait` tracks the phase per thread: a thread that waits on a
  barrier must wait on every phase of it, in order (no skipping laps).

Interpreter note: Pallas' GPU interpreter also wants every waiter to observe
every phase before the kernel ends, so a producer must wait out the last lap
of free phases (a table's hand-written drain_* methods). Hardware does not
need that, so the drains only wait while interpreting
(`fa4_jax.interpret.is_interpreting`).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import inspect
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fa4_jax.interpret import is_interpreting

Ref = Any


def rem(x, n: int):
  """x mod n for a loop index (traced or a Python int): a ring's slot."""
  if isinstance(x, int):
    return x % n
  return lax.rem(x, jnp.asarray(n, x.dtype))


# --- Barrier tables ------------------------------------------------------------


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
  FILL = ("TMA-copies each (GMEM source, SMEM buffers[, rows]) of `copies` into the buffers' "
          "slot; the copies' bytes complete its phase")
  MMA = "returns the barrier, for the tcgen05 MMA that arrives on it once it completed"
  COMMIT = "arrives once every tcgen05 op the calling thread issued completed"
  ARRIVE = "one arrival of the calling threads"
  RELEASE_TO_TMA = ("one arrival of the calling threads, done reading SMEM that a TMA "
                    "rewrites next")
  PUBLISH = ("makes the calling threads' SMEM writes visible to wgmma and the other "
             "warpgroups, then one arrival")
  # The waiting side.
  WAIT = "waits for its next phase"
  WAITER = "returns a Waiter, to wait for its next phase where the caller chooses"
  ACQUIRE = ("waits for the consumers' release of the slot's previous lap; nothing to wait "
             "for in the first lap")
  # Both sides: a rendezvous of the roles that share it.
  SYNC = "one arrival of the calling threads, then waits for the phase that completes"


# The touches by name alone, for the kernels' tables.
TMA, FILL, MMA, COMMIT, ARRIVE, RELEASE_TO_TMA, PUBLISH = (
    Touch.TMA, Touch.FILL, Touch.MMA, Touch.COMMIT, Touch.ARRIVE, Touch.RELEASE_TO_TMA,
    Touch.PUBLISH)
WAIT, WAITER, ACQUIRE, SYNC = Touch.WAIT, Touch.WAITER, Touch.ACQUIRE, Touch.SYNC


def _parameter(name: str, **default):
  return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, **default)


# How an accessor's arguments pick one barrier of its array (`Barrier.index`).


class _At:
  """accessor(index=0) touches barrier[index], the index its caller picks
  (the sm100 roles also skip the waits that have no phase yet themselves)."""

  parameters = (_parameter("index", default=0),)

  def position(self, count: int, counts: dict, index=0):
    del count, counts
    return index


class _Ring:
  """A ring of `count` slots, one barrier each: accessor(step), with steps
  numbered 0, 1, 2, ... in the order the producer fills the slots, touches
  slot step % count. A lap is `count` steps; there is nothing to acquire
  in the first one."""

  parameters = (_parameter("step"),)

  def position(self, count: int, counts: dict, step):
    del counts
    return rem(step, count)

  def has_previous_lap(self, count: int, counts: dict, step):
    del counts
    return step >= count


AT, RING = _At(), _Ring()


@dataclasses.dataclass(frozen=True)
class Copies:
  """Per-item buffers (one per consumer), each in counts[`depth`] copies:
  accessor(item, buffer) touches copy buffer * depth + item % depth, so with
  depth 2 the next work item's data loads while the current one runs. A lap
  is `depth` items; there is nothing to acquire in the first one."""

  depth: str  # a key of the table's counts

  parameters = (_parameter("item"), _parameter("buffer"))

  def position(self, count: int, counts: dict, item, buffer):
    del count
    depth = counts[self.depth]
    if depth == 1:
      return buffer
    return buffer * depth + rem(item, depth)

  def has_previous_lap(self, count: int, counts: dict, item, buffer):
    del count, buffer
    return item >= counts[self.depth]


@dataclasses.dataclass(frozen=True)
class Barrier:
  """One barrier (an array of them) of a kernel's `BarrierTable`.

  `per`: how many, a key of the dict the table's `barrier_counts(plan)`
  returns (one per ring stage, per Q tile, ...; a count of 0 declares
  none); `arrivals`: the arrivals that complete one phase (a number or a
  key of those counts); `orders_tensor_core`: tcgen05 commits arrive on it,
  or it hands TMEM that threads wrote to an MMA. `arrive` and `wait`: its
  two sides, the accessors of the roles that arrive on it and of those that
  wait on it, accessor name -> `Touch` (a SYNC accessor is on both).
  `index`: how an accessor's arguments pick one barrier (`AT`, `RING`,
  `Copies`). `active`: None, or a key of the counts whose falsity makes
  every accessor do nothing (the barrier is allocated either way)."""

  per: str
  arrivals: int | str
  orders_tensor_core: bool
  arrive: dict
  wait: dict
  index: Any = AT
  active: str | None = None


def _accessor(name: str, barrier: str, spec: Barrier, touch: Touch):
  """The method `name` of a `BarrierTable`: `touch` on the barrier of
  `barrier` that its arguments pick."""
  parameters = [_parameter("self"), *spec.index.parameters]
  if touch is Touch.FILL:
    parameters.insert(1, _parameter("copies"))
  signature = inspect.Signature(parameters)

  def accessor(*args, **kwargs):
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    self, *where = bound.arguments.values()
    return self._touch(touch, barrier, where)

  accessor.__name__ = accessor.__qualname__ = name
  accessor.__signature__ = signature
  accessor.__doc__ = f"{barrier}: {touch.value}."
  return accessor


class BarrierTable:
  """Every mbarrier of one kernel, declared in one table.

  A kernel's subclass declares BARRIERS, name -> `Barrier`: how many, the
  arrivals of a phase, how an accessor picks one and the accessors of the
  roles that arrive on it and wait on it. Those accessors (producer_*,
  consumer_*) are generated from the declaration and are the only way the
  roles touch a barrier; the subclass writes by hand only its
  interpreter-only drains (drain_*, with `_drain_last_lap` and
  `_drain_last_items`). Its docstring's table names who arrives on and who
  waits on every barrier, and why (`tests/barrier_tables.py` checks it
  against the declaration).

  ALLOCATION_ORDER: the order of the barriers in the kernel's scratch, which
  fixes each one's place in the kernel's barrier array and so its traced
  program: "by name" (a dict, which JAX flattens in sorted key order; the
  sm100 kernels) or "as declared" (the order of BARRIERS; the sm90 kernels).
  Each kernel keeps the order it was written with.
  """

  BARRIERS: dict[str, Barrier] = {}
  ALLOCATION_ORDER = "by name"

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    assert cls.ALLOCATION_ORDER in ("by name", "as declared"), cls.ALLOCATION_ORDER
    for barrier, spec in vars(cls).get("BARRIERS", {}).items():
      for name, touch in {**spec.arrive, **spec.wait}.items():
        assert name not in vars(cls), f"{cls.__name__}.{name} is declared twice"
        assert (touch is Touch.SYNC) == (name in spec.arrive and name in spec.wait), name
        assert touch is not Touch.ACQUIRE or hasattr(spec.index, "has_previous_lap"), name
        setattr(cls, name, _accessor(name, barrier, spec, touch))

  @staticmethod
  def barrier_counts(plan) -> dict:
    raise NotImplementedError

  @classmethod
  def scratch_types(cls, plan) -> dict:
    """The kernel's barrier scratch: one plgpu.Barrier array per name, in
    the table's ALLOCATION_ORDER."""
    counts = cls.barrier_counts(plan)
    barriers = {
        name: plgpu.Barrier(num_arrivals=counts.get(spec.arrivals, spec.arrivals),
                            num_barriers=counts[spec.per],
                            orders_tensor_core=spec.orders_tensor_core)
        for name, spec in cls.BARRIERS.items() if counts[spec.per]
    }
    return barriers if cls.ALLOCATION_ORDER == "by name" else collections.OrderedDict(barriers)

  def __init__(self, plan, refs: dict):
    self.counts = self.barrier_counts(plan)
    self._refs = refs
    # Pallas' GPU interpreter wants every waiter to observe every phase of a
    # barrier before the kernel ends; hardware does not. The drain_* methods
    # wait out those last phases only when interpreting (the one place each
    # kernel decides that).
    self._interpreting = is_interpreting()

  def slot(self, barrier: str, *where):
    """The index into `barrier`'s array that its accessors touch for the
    arguments `where` (a ring's slot, a buffer's copy): also the index of
    the SMEM buffer it guards."""
    spec = self.BARRIERS[barrier]
    return spec.index.position(self.counts[spec.per], self.counts, *where)

  def _touch(self, touch: Touch, name: str, where):
    spec = self.BARRIERS[name]
    if spec.active is not None and not self.counts[spec.active]:
      return None
    array, count = self._refs[name], self.counts[spec.per]
    if touch is Touch.FILL:
      copies, *where = where
    if touch is Touch.ACQUIRE:
      # The slot is computed where the wait is, inside the condition.
      @pl.when(spec.index.has_previous_lap(count, self.counts, *where))
      def _():
        plgpu.barrier_wait(array.at[self.slot(name, *where)])
      return None
    at = self.slot(name, *where)
    barrier = array.at[at]
    if touch in (Touch.TMA, Touch.MMA):
      return barrier
    if touch is Touch.WAITER:
      return Waiter(barrier)
    if touch is Touch.FILL:
      for src, buffers, *rows in copies:
        plgpu.copy_gmem_to_smem(src, buffers.at[(at, *rows)] if rows else buffers.at[at],
                                barrier)
    elif touch is Touch.WAIT:
      plgpu.barrier_wait(barrier)
    elif touch is Touch.COMMIT:
      plgpu.tcgen05_commit_arrive(barrier)
    else:
      if touch is Touch.PUBLISH or (touch is Touch.RELEASE_TO_TMA and self._interpreting):
        # PUBLISH: wgmma reads SMEM through the async proxy. RELEASE_TO_TMA:
        # the interpreter wants a proxy fence between the threads' SMEM reads
        # and the TMA that rewrites them; hardware does not (a TMA ring's
        # consumer releases its slot with a plain arrive).
        plgpu.commit_smem()
      plgpu.barrier_arrive(barrier)
      if touch is Touch.SYNC:
        plgpu.barrier_wait(barrier)
    return None

  def _drain_last_lap(self, num_steps, *names: str) -> None:
    """Interpreter only: the producer of ring barriers `names` (free
    barriers of as many slots each) observes the phases of the last lap's
    releases, steps [num_steps - slots, num_steps)."""
    if not self._interpreting:
      return
    slots = self.counts[self.BARRIERS[names[0]].per]

    @pl.loop(jnp.maximum(num_steps - slots, 0), num_steps)
    def _(step):
      slot = rem(step, slots)
      for name in names:
        plgpu.barrier_wait(self._refs[name].at[slot])

  def _drain_last_items(self, num_items, name: str, next_acquired: bool = False) -> None:
    """Interpreter only: the producer of `Copies` barrier `name` (a free
    barrier) observes the last release of every copy: those of the items
    after num_items - depth, or after num_items - depth + 1 when it already
    acquired item `num_items` (whose acquire observed that one's)."""
    if not self._interpreting:
      return
    spec = self.BARRIERS[name]
    depth = self.counts[spec.index.depth]
    first = jnp.maximum(num_items - depth + int(next_acquired), 0)

    @pl.loop(first, num_items)
    def _(item):
      for buffer in range(self.counts[spec.per] // depth):
        plgpu.barrier_wait(self._refs[name].at[self.slot(name, item, buffer)])


@dataclasses.dataclass(frozen=True)
class LaunchChain:
  """A kernel's place in a chain of kernels that run back to back on one
  stream and read none of each other's outputs (programmatic dependent
  launch, PDL, sm_90+).

  Without it a kernel starts only when the one before it has finished, so
  the SMs its predecessor's last, partial wave leaves idle stay idle. With it:

  - `releases_next`: every CTA signals at its start
    (`griddepcontrol.launch_dependents`) that the next kernel may launch; it
    does once every CTA of this one has started, onto the SMs they leave free.
  - `follows_previous`: the kernel's last CTA waits for the previous kernel
    to complete (`griddepcontrol.wait`) before it exits, so this kernel
    completes after it: whatever runs next (a normal launch, which waits only
    for this kernel) may read both kernels' results. One CTA suffices, and
    the last one launched finds the previous kernel done or nearly so. A wait
    in every CTA idles the SMs of the CTAs that finish early (H100, GQA
    backward: the dQ kernel took 4.79 instead of 3.99 ms). The wait also
    marks the module as using PDL, so the runtime launches it that way.

  The interpreter runs kernels one after another; it skips both.
  """

  releases_next: bool = False
  follows_previous: bool = False

  def at_start(self) -> None:
    if self.releases_next and not is_interpreting():
      plgpu.griddepcontrol_launch_dependents()

  def at_exit(self, grid: dict[str, int]) -> None:
    """`grid`: the kernel's grid, {axis name: size}, to find its last CTA."""
    if not self.follows_previous or is_interpreting():
      return
    last = jnp.bool_(True)
    for name, size in grid.items():
      last = last & (lax.axis_index(name) == size - 1)
    pl.when(last)(plgpu.griddepcontrol_wait)


NO_CHAIN = LaunchChain()


# Hopper: 64K 32-bit registers per SM; these kernels run one CTA per SM.
REGISTERS_PER_SM = 65536
MAX_REGISTERS_PER_THREAD = 255


def register_pool(num_warpgroups: int) -> int:
  """Registers a CTA of `num_warpgroups` 128-thread warpgroups holds: the
  launch gives every thread the same count, a multiple of 8, and
  `set_max_registers` only moves registers between its warpgroups."""
  threads = 128 * num_warpgroups
  per_thread = min(REGISTERS_PER_SM // threads, MAX_REGISTERS_PER_THREAD) // 8 * 8
  return per_thread * threads


def check_register_split(what: str, producer: int, consumers: int, per_consumer: int,
                         other: int = 0) -> None:
  """Raises ValueError unless one 128-thread producer warpgroup on `producer`
  registers, `consumers` warpgroups on `per_consumer` and, if `other` is not
  0, one more warpgroup on `other` fit the CTA's registers (`register_pool`).

  `set_max_registers` raises the consumers' registers out of those the
  others gave back; asking for more than the CTA holds makes them wait
  forever (seen on an H100: a 40-register producer and three consumers on
  160, 66560 registers of a 65536 pool; and a 64-register producer and two
  consumers on 224, 65536 of the 64512 that three warpgroups launch with).
  """
  num_warpgroups = 1 + consumers + (other > 0)
  total = 128 * (producer + consumers * per_consumer + other)
  pool = register_pool(num_warpgroups)
  if total > pool:
    also = f" + other {other}" if other else ""
    raise ValueError(
        f"{what}: 128 x (producer {producer} + {consumers} x consumer {per_consumer}{also}) = "
        f"{total} registers exceeds the {pool} registers a CTA of {num_warpgroups} "
        f"warpgroups launches with")


def sequence_lengths(q_len_ref, kv_len_ref, batch_idx, q_seq: int, kv_valid: int):
  """(q_len, kv_len) of one batch element inside a kernel, clamped to the
  arrays' extents; a missing lengths ref (None) means the full extent.
  `kv_valid` is the true key length (keys past it are TMA padding).
  Static lengths stay Python ints: a concrete array closed over by a
  `pl.run_state` body becomes an input that Mosaic GPU cannot lower."""
  q_len, kv_len = q_seq, kv_valid
  if q_len_ref is not None:
    q_len = jnp.clip(q_len_ref[batch_idx], 0, q_seq)
  if kv_len_ref is not None:
    kv_len = jnp.clip(kv_len_ref[batch_idx], 0, kv_valid)
  return q_len, kv_len

