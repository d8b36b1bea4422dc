"""The one-kernel sm90 backward with dQ in float32 (`deterministic=False`).

The dK/dV kernel (`sm90_backward_dkdv._build_dkv_kernel`, "fused" scheme: a
CTA owns `2 * block_kv` keys, each consumer warpgroup one `block_kv` tile,
and a producer warpgroup streams (Q, dO, lse2, delta) tiles of every query
block and head its keys can see) also adds dQ, so that S and dP are computed
once: five tile GEMMs per step instead of the two kernels' seven.

    step n, consumer w:  S^T, dP^T -> P^T, dS^T_w; dV_w += P^T dO, dK_w += dS^T_w Q
                         dS^T_w (16-bit) -> ds ring slot of step n
                         wait for both halves of dS^T in the slot, then
                         dQ[:, cols_w] = scale * sum_v dS_v K_v[:, cols_w]
                         -> f32 staging tile -> TMA reduce-add into dQ_acc

Each consumer computes the columns `cols_w` (half of the head dim) of the
step's 64 x head_dim dQ tile over both halves of the key tile (the
arrangement of FlashAttention-3's backward): 64 x 64 x 128 of tensor work,
32 fp32 accumulator registers that live only inside the dQ step, while S^T
and dP^T are dead. The partial tiles of every CTA that sees a query block
land in one float32 buffer (`dq_acc`: zeros, a Ref of `pl.run_state`) by TMA
reduce-adds (`cp.reduce.async.bulk.tensor ... .add`), which L2 performs in
arrival order: **dQ is not bit-deterministic** (dK and dV are: each is
written by one CTA). XLA converts dQ to the inputs' dtype after the kernel.

The consumers never wait for a reduce-add to complete: each has
`FusedDqConfig.dq_stages` staging tiles and, before rewriting one, waits
only until the TMA issued from it `dq_stages` steps earlier has *read* it
(`wait_smem_to_gmem(dq_stages - 1, wait_read_only=True)`).

Under Pallas' GPU interpreter, which has no TMA reduction, each CTA writes
its partial tiles into a slice of its own (`dq_acc` then has a leading
key-tile axis, summed by XLA afterwards): the same partial tiles, summed in
another order.

Barriers: `FusedDqBarrierTable` (the dK/dV kernel's table and the ds ring).
Serves what the plain dK/dV kernel serves at a padded head dim of 128 with V
as wide as K: every built-in mask, lengths, GQA, segment ids, soft-cap;
`sm90_backward.backward` falls back to the two deterministic kernels
elsewhere (`fused_dq_problem`).
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

from fa4_jax.interpret import is_interpreting
from fa4_jax.kernels.backward_walk import KernelRefs, KeyTileWork
from fa4_jax.kernels.build_cache import cached_build
from fa4_jax.kernels.pipeline import (ACQUIRE, ARRIVE, NO_CHAIN, PUBLISH, RING, SYNC, WAIT, Barrier,
                                     check_register_split)
from fa4_jax.kernels.sm90_backward_common import launch
from fa4_jax.kernels.sm90_backward_dkdv import (DkvBarrierTable, DkvConfig, _DkvPass, _DkvSmem,
                                                _dkv_consumer, _dkv_epilogue, _dkv_producer)
from fa4_jax.kernels.sm90_tiles import swizzle_bytes
from fa4_jax.kernels.tiles import smem_tile
from fa4_jax.scores import cdiv

# The head dims (padded) the one kernel takes: each consumer's half of dQ's
# columns must be whole 64-column tiles of K's swizzled SMEM layout (at 64,
# halves of 32 columns are not; at 192 and 256 dK + dV leave no registers).
FUSED_DQ_HEAD_DIMS = (128,)


@dataclasses.dataclass(frozen=True)
class FusedDqConfig:
  """Static configuration of the one kernel: its dK/dV part (`dkv`, the
  "fused" scheme with two consumers; no work queue) and the dQ hand-off."""

  dkv: DkvConfig = dataclasses.field(default_factory=lambda: DkvConfig(
      block_kv=64, block_q=64, num_stages=2, producer_registers=24, consumer_registers=240))
  # Slots of the ring that holds both consumers' dS^T of a step (16 KiB
  # each at 64 x 64 keys x queries, two halves).
  ds_slots: int = 2
  # f32 staging tiles of dQ per consumer (16 KiB each at 64 x 64).
  dq_stages: int = 1

  def __post_init__(self):
    if self.dkv.dk_dv != "fused" or self.dkv.num_consumers != 2 or self.dkv.work_queue:
      raise ValueError(f"the one kernel with dQ needs the 'fused' dK/dV scheme with two "
                       f"consumers and no work queue; got {self.dkv}")
    if self.dkv.block_q != 64 or self.dkv.block_kv != 64:
      raise ValueError(f"the one kernel with dQ takes 64-row query and key tiles; got "
                       f"block_q={self.dkv.block_q}, block_kv={self.dkv.block_kv}")
    if self.ds_slots < 1 or self.dq_stages < 1:
      raise ValueError(f"ds_slots and dq_stages must be >= 1; got {self.ds_slots}, "
                       f"{self.dq_stages}")
    check_register_split("FusedDqConfig", self.dkv.producer_registers,
                         self.dkv.num_consumers, self.dkv.consumer_registers)


def fused_dq_problem(head_dim: int, value_head_dim: int, has_mods: bool) -> str | None:
  """Why the one kernel cannot serve a call (None: it can). `head_dim` and
  `value_head_dim` padded to multiples of 64."""
  if head_dim not in FUSED_DQ_HEAD_DIMS:
    return f"head dim {head_dim} (the one kernel takes {FUSED_DQ_HEAD_DIMS})"
  if value_head_dim != head_dim:
    return f"a value head dim of its own ({value_head_dim} against {head_dim})"
  if has_mods:
    return "a score_mod or mask_mod"
  return None


@dataclasses.dataclass(frozen=True)
class _FusedDqPass(_DkvPass):
  """The dK/dV pass with the dQ hand-off's SMEM after the pass's own."""

  ds_slots: int = 2
  dq_stages: int = 1

  @property
  def dq_columns(self) -> int:
    """dQ columns per consumer."""
    return self.head_dim // self.cfg.num_consumers

  def fused_smem(self):
    """(the dK/dV pass's SMEM, (the ds ring, the dQ staging tiles))."""
    nc, bk, bq = self.cfg.num_consumers, self.cfg.block_kv, self.cfg.block_q
    swizzle = swizzle_bytes(self.dtype, bk, bq)
    ds_ring = smem_tile((self.ds_slots, nc, bk, bq), self.dtype, swizzle)
    dq_stage = smem_tile((nc, self.dq_stages, bq, self.dq_columns), jnp.float32, 128)
    return self.smem(), (ds_ring, dq_stage)


class FusedDqBarrierTable(DkvBarrierTable):
  """Every mbarrier of the one kernel with dQ (`_build_fused_dq_kernel`):
  the dK/dV kernel's (`DkvBarrierTable`; no queued copies here, so no
  kv_free barrier is allocated) and the ds ring's.

  Who arrives on each barrier and who waits on it, by role and accessor
  (no role touches a barrier except through these accessors):

  name       count      arrivals     arrived on by                      waited on by
  kv_full    kv copies  kv operands  producer: producer_kv (TMAs of     consumer i: consumer_kv, once
                          (TMA)        consumer i's K and V tiles);
                                       producer_kv_stop (queued grids
                                       only: never here)
  kv_free    queued kv  1            consumer i: consumer_kv_release    producer: producer_kv_acquire,
               copies                  (queued grids only: none here)     drain_kv* (none here)
  q_do_full  stages     streamed     producer: producer_q_do (TMAs of   consumers: consumer_q_do,
                          (TMA)        step n's Q, dO, lse2, delta and    every step
                                       the queries' segment ids)
  q_do_free  stages     consumers    consumers: consumer_q_do_release   producer: producer_q_do_acquire
                                       (after their dK/dV wgmmas)         (before it refills the
                                                                          slot), drain_q_do*
  ds_full    ds slots   consumers    each consumer: producer_ds (its    both consumers: consumer_ds
                                       half of step n's dS^T stored;      (then their dQ wgmmas read
                                       zeros on a skipped step)           both halves)
  ds_free    ds slots   consumers    each consumer: consumer_ds_release each consumer: producer_ds_acquire
                                       (its dQ wgmmas of the step have    (before it stores into the
                                       read both halves)                  slot again), drain_ds*
  k_read     1          consumers    each consumer: consumer_k_read     both consumers: consumer_k_read
                                       (its last dQ wgmma, which read     (then each writes dK over its
                                       both K tiles, completed)           own K tile)

  kv copies = num_consumers, stages = num_stages, ds slots =
  `FusedDqConfig.ds_slots` (slot `slot("ds_full", step)`, the steps those of
  the q_do ring). * interpreter only.
  """

  BARRIERS = {
      **DkvBarrierTable.BARRIERS,
      "ds_full": Barrier("ds slots", "consumers", False, arrive={"producer_ds": PUBLISH},
                         wait={"consumer_ds": WAIT}, index=RING),
      "ds_free": Barrier("ds slots", "consumers", False, arrive={"consumer_ds_release": ARRIVE},
                         wait={"producer_ds_acquire": ACQUIRE}, index=RING),
      "k_read": Barrier("one", "consumers", False, arrive={"consumer_k_read": SYNC},
                        wait={"consumer_k_read": SYNC}),
  }

  @staticmethod
  def barrier_counts(kp: "_FusedDqPass") -> dict:
    return {**DkvBarrierTable.barrier_counts(kp), "ds slots": kp.ds_slots, "one": 1}

  def drain_ds(self, num_steps) -> None:
    """Each consumer: observe the ds_free phases of the last lap."""
    self._drain_last_lap(num_steps, "ds_free")


class DqAdder(NamedTuple):
  """Consumer `wg`'s side of the dQ hand-off (`_dkv_consumer`'s `dq`)."""

  kp: _FusedDqPass
  wg: Any
  k_tiles: Any  # both consumers' K tiles [nc, bk, d]
  ds_ring: Any  # [ds slots, nc, bk, bq]
  dq_stage: Any  # [nc, dq stages, bq, d / nc] f32
  bars: FusedDqBarrierTable
  dq_acc: Any  # f32 [B, Tq, Nq, d] (interpreter: [key tiles, B, Tq, Nq, d])
  work: KeyTileWork

  def publish(self, step, ds):
    """This consumer's half of step `step`'s dS^T (keys x queries) into
    the ds ring."""
    self.bars.producer_ds_acquire(step)
    self.ds_ring.at[self.bars.slot("ds_full", step), self.wg][...] = ds
    self.bars.producer_ds(step)

  def skip(self, step, head, qb):
    """A step this consumer's keys do not see: zeros for its half of dS^T,
    then its columns of dQ from the other half."""
    bk, bq = self.kp.cfg.block_kv, self.kp.cfg.block_q
    self.publish(step, plgpu.layout_cast(jnp.zeros((bk, bq), self.kp.dtype),
                                         plgpu.Layout.WGMMA))
    self.add(step, head, qb)

  def add(self, step, head, qb):
    """dQ[rows of qb, this consumer's columns] += scale * dS K, once both
    halves of step `step`'s dS^T are in the ring."""
    kp, bars, h = self.kp, self.bars, self.wg
    nc, bq, width = kp.cfg.num_consumers, kp.cfg.block_q, kp.dq_columns
    bars.consumer_ds(step)
    slot = bars.slot("ds_full", step)
    # The consumer's columns start at a run-time multiple of 64: one code
    # path for both consumers (a branch per consumer kept the consumer's
    # index alive across the loop; ptxas, local: 4 spill reloads in the
    # dense loops, none without).
    cols = pl.ds(pl.multiple_of(h * width, width), width)

    def body(acc_ref):
      for i in range(nc):  # dS = (dS^T)^T: the ring's halves, transposed
        # Half v of the keys, starting from a step-dependent one: the wgmma
        # descriptors then depend on the step, and the compiler does not
        # hoist them out of the loop, where they would live across the S^T
        # / dP^T GEMMs and their softmax (ptxas, local, D128 dense: 148 /
        # 184 spill bytes, 25 reloads in the loops, with a fixed order; 0
        # with this one and the columns above).
        v = lax.rem(step + i, nc)
        plgpu.wgmma(acc_ref, self.ds_ring.at[slot, v].transpose((1, 0)),
                    self.k_tiles.at[v, :, cols])
      return acc_ref[...]

    dq = pl.run_scoped(body, plgpu.ACC((bq, width), jnp.float32))
    bars.consumer_ds_release(step)
    stages = kp.dq_stages
    stage = self.dq_stage.at[h, lax.rem(step, stages) if stages > 1 else 0]
    # The reduce-add issued from this tile `stages` steps ago must have read it.
    plgpu.wait_smem_to_gmem(stages - 1, wait_read_only=True)
    stage[...] = dq * jnp.float32(kp.score.scale)
    plgpu.commit_smem()
    work = self.work
    rows = (work.batch_idx, pl.ds(qb * bq, bq), head, cols)
    if kp.interpreting:  # no TMA reduction: this key tile's partials, summed by XLA
      plgpu.copy_smem_to_gmem(stage, self.dq_acc.at[(work.kv_tile, *rows)])
    else:
      plgpu.copy_smem_to_gmem(stage, self.dq_acc.at[rows], reduction_op="add")


@cached_build
def _build_fused_dq_kernel(*, batch, q_seq, kv_seq, kv_valid, num_q_heads, num_kv_heads,
                           head_dim, value_head_dim, dtype, score, mask, config: FusedDqConfig,
                           has_q_lengths, has_kv_lengths, has_segments=False, chain=NO_CHAIN):
  """dK, dV and dQ in one kernel. Inputs: those of the dK/dV kernel, then
  `dq_acc` (a `jax.Ref` of float32 zeros, [B, q_seq, Nq, head_dim]; under
  the interpreter [key tiles, B, q_seq, Nq, head_dim]), which the kernel adds
  scale * dS K into. Outputs: (dk, dv)."""
  cfg = config.dkv
  nc = cfg.num_consumers
  assert head_dim == value_head_dim and head_dim % (64 * nc) == 0, (head_dim, value_head_dim)
  kp = _FusedDqPass(cfg, mask, dtype, head_dim, value_head_dim, score,
                    num_q_heads // num_kv_heads, ("dk", "dv"), is_interpreting(), has_segments,
                    ds_slots=config.ds_slots, dq_stages=config.dq_stages)
  statics = dict(num_keys=nc * cfg.block_kv, block_q=cfg.block_q, mask=mask, q_seq=q_seq,
                 kv_valid=kv_valid, group=kp.group)
  grid = dict(heads=num_kv_heads, kv_tiles=cdiv(kv_seq, nc * cfg.block_kv), batch=batch)

  def kernel(*refs):
    chain.at_start()
    gmem, rest = KernelRefs.split(refs, has_q_lengths, has_kv_lengths,
                                  nc if has_segments else None)
    dq_acc, dk_ref, dv_ref, (dkv_smem, (ds_ring, dq_stage)), barrier_refs = rest
    smem = _DkvSmem.unpack(dkv_smem, True, True, has_segments)
    bars = FusedDqBarrierTable(kp, barrier_refs)
    wg = lax.axis_index("wg")
    work = KeyTileWork.of_this_cta(gmem=gmem, **statics)

    @pl.when(wg == nc)
    def _producer():
      plgpu.set_max_registers(cfg.producer_registers, action="decrease")
      num_steps = _dkv_producer(kp, gmem, smem, bars, work)
      bars.drain_q_do(num_steps)

    @pl.when(wg < nc)
    def _consumers():
      plgpu.set_max_registers(cfg.consumer_registers, action="increase")
      adder = DqAdder(kp, wg, smem.k, ds_ring, dq_stage, bars, dq_acc, work)
      acc, k_lo = _dkv_consumer(kp, wg, smem, bars, work, gmem.segments, dq=adder)
      bars.drain_ds(work.num_steps)
      # The other consumer's dQ wgmmas read this consumer's K tile: only
      # after the last of them may it take dK.
      bars.consumer_k_read()
      _dkv_epilogue(kp, wg, acc, k_lo, smem, bars, (dk_ref, dv_ref), work)

    chain.at_exit(grid)

  out_type = tuple(jax.ShapeDtypeStruct((batch, kv_seq, num_kv_heads, head_dim), dtype)
                   for _ in range(2))
  return launch(kernel, role="sm90_dkdv_fused_dq", out_type=out_type, smem=kp.fused_smem(),
                barriers=FusedDqBarrierTable.scratch_types(kp), grid=grid,
                num_threads=nc + 1)


def backward_kernels(args, dkv_segments, *, common, config: FusedDqConfig, kv_pad: int):
  """(dq in float32, dk, dv) from the one kernel; `args` are the dK/dV
  kernel's inputs (q, k, v, dout, lse2, delta, lengths...)."""
  run = functools.partial(_run_kernel, num_args=len(args), common=common, config=config,
                          kv_pad=kv_pad)

  # Under `jax.vmap` (JAX has no batching rule for `run_state`) the calls
  # run one after another, each the kernel as it is.
  @jax.custom_batching.custom_vmap
  def call(*operands):
    return run(*operands)

  @call.def_vmap
  def _vmap_rule(axis_size, in_batched, *operands):
    operands = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
                for x, batched in zip(operands, in_batched)]
    return lax.map(lambda ops: call(*ops), operands), (True, True, True)

  return call(*args, *dkv_segments)


def _run_kernel(*operands, num_args: int, common, config: FusedDqConfig, kv_pad: int):
  args, dkv_segments = operands[:num_args], operands[num_args:]
  q = args[0]
  batch, q_pad, num_q_heads, d = q.shape
  shape = (batch, q_pad, num_q_heads, d)
  interpreting = is_interpreting()
  if interpreting:  # one slice of partial tiles per CTA column of keys (no TMA reduction)
    cfg = config.dkv
    shape = (cdiv(kv_pad, cfg.num_consumers * cfg.block_kv),) + shape
  kernel = _build_fused_dq_kernel(**common, config=config)
  kv_shape = (batch, kv_pad, common["num_kv_heads"], d)

  # The kernel adds into `dq_acc`, a Ref that lives only inside `run_state`
  # (a Ref created by `jax.new_ref` would escape into the custom derivative
  # of `fa4_jax.vjp`, which JAX cannot discharge). dK and dV leave through
  # Refs too; their initial values are dead and XLA drops them.
  def stateful(refs):
    dq_acc, dk_ref, dv_ref = refs
    dk_ref[...], dv_ref[...] = kernel(*args, *dkv_segments, dq_acc)

  dq, dk, dv = pl.run_state(stateful)((jnp.zeros(shape, jnp.float32),
                                       jnp.zeros(kv_shape, q.dtype), jnp.zeros(kv_shape, q.dtype)))
  if interpreting:
    dq = jnp.sum(dq, axis=0)
  return dq, dk, dv
