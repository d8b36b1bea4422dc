"""Attention forward for Hopper (sm_90) in Pallas Mosaic GPU.

One CTA computes `num_consumers * block_q` query rows of one (batch, q head):

    warpgroup 0, 1  consumers: each owns a Q tile of `block_q` rows (Q0, Q1),
                    issues its own `wgmma`s (S = Q K^T, O += P V) and runs the
                    online softmax in registers.
    warpgroup 2     producer: TMA loads of Q0, Q1 once, then K_n, V_n into a
                    ring of `num_kv_stages` SMEM slots. It keeps few registers
                    (`set_max_registers`) so the consumers can have more.

The two consumers take turns on the tensor core ("ping-pong"): a rendezvous
barrier makes one warpgroup's softmax run while the other's GEMMs execute.
At D = 64 the softmax takes longer than the other's GEMMs, so taking turns
would serialize the softmaxes; there three consumers (warpgroups 0-2, the
producer is warpgroup 3) run without turns (`ForwardConfig.pingpong`).
Inside a warpgroup the GEMMs run in order (S = Q K^T, softmax, O += P V),
and the wait for the next K tile is issued while P V runs. FA3's
intra-warpgroup overlap (the softmax of block j while O += P_{j-1} V_{j-1}
runs), a back-to-back issue of both GEMMs and P staged through SMEM all
measured slower on an H100 (BENCHMARKS.md) and were removed; commit dcef065
still has them.

Every barrier and who arrives on it is listed in `ForwardBarriers`; the ring
arithmetic lives in `fa4_jax.kernels.pipeline`.

Softmax (`fa4_jax.scores.online_softmax`, which also holds the tile ranges
and the element mask): logits are kept raw; `c = scale * log2(e)` is folded
into one FMA before `exp2`, the running max `m` is kept in those scaled log2
units, in the wgmma accumulator's row layout. The max is only moved when a
row's max grew by more than `scores.RESCALE_THRESHOLD` (log2 units): a stale
max is used for both l and O, so the result stays exact and P stays below
2**RESCALE_THRESHOLD. With
`ForwardConfig.conditional_rescale`, O is multiplied by the rescale factor only
in the warps where some row's max moved (a warp-uniform branch,
`fa4_jax.kernels.accumulator.rescale_rows`): after the first blocks that is
almost never, and the multiply costs head_dim / 2 FMULs per thread and block.

Masks (`fa4_jax.scores.MaskSpec`, lengths): each consumer walks the KV blocks
its rows can see; blocks fully visible run without an element mask, boundary
blocks (diagonal, window edge, length edge) with one, and blocks outside its
own range (but inside the CTA's, which the producer loads) only keep the
barrier protocol going. Causal-like masks schedule the heaviest query tiles
first.

Grid: one CTA per (q head, q tile, batch); or, with `ForwardConfig.persistent`
(chosen when a tile walks few KV blocks: short sequences, local windows), one
CTA per SM walks a share of those work items (`fa4_jax.kernels.schedule`: in the
grid's launch order, causal tiles paired heavy with light so that every CTA
gets the same work), the K/V ring and Q buffers carrying their barrier phases
across items, so that one item's Q load and O store overlap the neighbouring
items' work. With two Q tiles per consumer (`ForwardConfig.q_buffers`) the
next item's Q loads while the current item runs, instead of after its last
Q K^T with the next K/V loads queued behind it.

Interpreter (`fa4_jax.interpret`): P goes through SMEM for the P V wgmma and
the producer drains its barriers; both are chosen in one place each
(`p_times_v`, `SlotRing.producer_drain` / `OneShotBuffer.producer_drain`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fa4_jax.interpret import is_interpreting
from fa4_jax.kernels import KernelUnsupported, check_common, default_device
from fa4_jax.kernels.accumulator import rescale_rows
from fa4_jax.kernels.pipeline import (OneShotBuffer, Rendezvous, SlotRing, check_register_split,
                                      fori, sequence_lengths)
from fa4_jax.kernels.schedule import PersistentWork, heavy_first_tile, pairs_causal_tiles
# padded_head_dim and kv_tile_ranges are imported from here by other modules.
from fa4_jax.kernels.sm90_tiles import padded_head_dim, smem_tile
from fa4_jax.scores import (LOG2_E, M_INIT, MaskSpec, cdiv, kv_tile_ranges, normalize,
                            online_softmax, visible)

# SMs of an H100 SXM: the persistent grid's size where no GPU is present
# (cross-lowering, the interpreter).
H100_SMS = 132
# Hopper: 227 KiB of dynamic shared memory per block.
SMEM_LIMIT_BYTES = 232448
# Barriers and alignment padding on top of `ForwardConfig.smem_bytes`
# (cross-lowered heuristic configs add 376-712 bytes; a test checks it).
SMEM_RESERVE_BYTES = 1024
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
  """Static tiling of the kernel. A CTA covers `num_consumers * block_q` rows.

  The paired GEMM schedules and P in SMEM measured slower and were removed
  (commit dcef065 has them).
  """

  block_q: int  # query rows per consumer warpgroup (wgmma M)
  block_kv: int  # keys per ring slot
  num_kv_stages: int  # slots in the K ring and in the V ring
  num_consumers: int = 2
  producer_registers: int = 40
  consumer_registers: int = 232
  # Finish the row sums before handing the tensor core over, or after.
  sum_before_handoff: bool = False
  # Persistent grid: one CTA per SM walks work items; the next tile's Q loads
  # while the current tile's O is stored (needs SMEM for separate O tiles).
  persistent: bool = False
  # CTAs of the persistent grid; 0: one per SM of the GPU at call time (132
  # on an H100 SXM, the count used where there is no GPU).
  num_sms: int = 0
  # Q tiles per consumer in a persistent CTA. With 2, the next work item's Q
  # loads into the other tile during the current item; with 1 that load (and
  # the K/V loads queued behind it) waits for the item's last Q K^T and can
  # be exposed at the start of the next item. One CTA per tile has one item
  # and always uses one (`q_depth`).
  q_buffers: int = 1
  # Multiply O by alpha only in warps where some row's max moved
  # (`fa4_jax.kernels.accumulator.rescale_rows`); exact either way.
  conditional_rescale: bool = False
  # The two consumers take turns on the tensor core (one's softmax runs while
  # the other's GEMMs execute). Off, the consumers run unsynchronized: where
  # a softmax takes longer than the other consumer's GEMMs (D = 64), taking
  # turns serializes the softmaxes and leaves the tensor core idle.
  pingpong: bool = True

  def __post_init__(self):
    if self.pingpong and self.num_consumers != 2:
      raise ValueError("ForwardConfig.pingpong alternates two consumers; "
                       f"got num_consumers={self.num_consumers} (set pingpong=False)")
    if self.num_sms < 0:
      raise ValueError(f"ForwardConfig.num_sms must be >= 0 (0: the GPU's SM count); "
                       f"got {self.num_sms}")
    if self.q_buffers not in (1, 2):
      raise ValueError(f"ForwardConfig.q_buffers must be 1 or 2; got {self.q_buffers}")
    check_register_split("ForwardConfig", self.producer_registers, self.num_consumers,
                         self.consumer_registers)

  @property
  def q_depth(self) -> int:
    """Q tiles per consumer the kernel allocates."""
    return self.q_buffers if self.persistent else 1

  @property
  def block_q_cta(self) -> int:
    return self.num_consumers * self.block_q

  def smem_bytes(self, head_dim: int, itemsize: int) -> int:
    """SMEM the kernel allocates (without barriers and alignment padding)."""
    tile = self.num_consumers * self.block_q * head_dim * itemsize
    q_tiles = self.q_depth * tile
    kv_ring = 2 * self.num_kv_stages * self.block_kv * head_dim * itemsize
    lse = self.num_consumers * self.block_q * 4
    o_tiles = tile if self.persistent else 0
    return q_tiles + kv_ring + lse + o_tiles


def choose_config(head_dim: int, mask: MaskSpec, kv_seq: int | None = None,
                  q_seq: int | None = None) -> ForwardConfig:
  """Block sizes, stages and grid per (padded) head dim. No autotuning at call time.

  Register budget per consumer thread (64 rows per warpgroup): O takes
  head_dim / 2 fp32 registers, S takes block_kv / 2, P a quarter of that.
  SMEM: Q tiles + 2 * stages * block_kv * head_dim * 2 bytes must fit 227 KiB.
  """
  d = padded_head_dim(head_dim)
  short_causal = mask.right is not None and kv_seq is not None and kv_seq < 4096
  if d <= 64 and short_causal:
    # Short causal rows: 256-key blocks waste half of each diagonal block
    # (H100 sweep: 329 vs 343 TFLOP/s at S2048, 155 vs 171 at S512).
    config = ForwardConfig(block_q=64, block_kv=128, num_kv_stages=4)
  elif d <= 64:
    # Half the GEMM work per softmax element of D = 128, so the softmax
    # outlasts the other consumer's GEMMs: taking turns (ping-pong) would
    # serialize the two softmaxes and idle the tensor core half the time
    # (Nsight Compute, B2 S8192 H32, 2026-11-23). Three consumers that do not
    # take turns keep the exp2 unit and the tensor core busy: 528 vs 504
    # TFLOP/s dense, 478 vs 458 causal over two ping-pong consumers on
    # 256-key blocks (the previous choice). 160 registers each hold S (64),
    # P (32) and O (32) of a 128-key block without spills. With three
    # consumers the conditional rescale pays at D = 64 too (it lost 3-4 %
    # with two): 553 vs 530 dense, 490 vs 475 causal (cuDNN 498 / 465).
    config = ForwardConfig(block_q=64, block_kv=128, num_kv_stages=2, num_consumers=3,
                           pingpong=False, producer_registers=24, consumer_registers=160,
                           sum_before_handoff=True, conditional_rescale=True)
  elif d <= 128:
    # Conditional rescale: +2-4 % on every D = 128 row (H100, B2 S8192 676 ->
    # 695, B1 S16384 689 -> 707, causal 682 -> 705).
    config = ForwardConfig(block_q=64, block_kv=128, num_kv_stages=2, conditional_rescale=True)
  else:
    # 192 and 256: O alone takes up to 128 registers; keep S small. The
    # persistent grid's separate O tiles do not fit SMEM here. Skipping O's
    # rescale saves 128 FMULs per thread and 64-key block at D = 256 (H100,
    # B2 S8192 H8: 690 -> 740 dense, 687 -> 726 causal).
    return ForwardConfig(block_q=64, block_kv=64, num_kv_stages=2, sum_before_handoff=True,
                         conditional_rescale=True)
  if kv_seq is not None:
    limit = (PERSISTENT_MAX_MEAN_BLOCKS_PAIRED if pairs_causal_tiles(mask)
             else PERSISTENT_MAX_MEAN_BLOCKS)
    if mean_kv_blocks_per_tile(config, mask, kv_seq, q_seq) <= limit:
      config = dataclasses.replace(config, persistent=True)
      # A second Q tile per consumer fits next to the ring and the O tiles
      # at D <= 128 (D = 128: 224.5 of 227 KiB). H100, against one Q tile:
      # B8 S2048 D128 663 vs 648 dense, 572 vs 553 causal; the short sweep
      # rows +2 to +7 % (forward-qbuf-*.json, forward-short-qbuf-*.json).
      double = dataclasses.replace(config, q_buffers=2)
      if double.smem_bytes(d, 2) <= SMEM_LIMIT_BYTES - SMEM_RESERVE_BYTES:
        config = double
  return config


# A persistent grid hides each work item's Q load and O store behind the
# previous item's work, which pays when items are short. Measured on an H100
# against one CTA per tile (2026-11-23; forward-short-*.json, sweep shapes):
# - one tile per unit (dense masks): +16-20 % at S512, +6-11 % at S1024,
#   +2-6 % at S2048 (a mean of 16 blocks per tile at D128), D64 S4096 (16)
#   +2 %; at a mean of 32 it lost 1.5-2.5 % (D128 S4096, S8192).
# - causal tile pairs: +20-30 % at S512, +13-22 % at S1024, +3-9 % at S2048
#   (8.5), D64 S4096 (8.5) +1 %; at 16.5 it lost 2.5 % (D128 S4096) or tied
#   (D64 S8192, GQA S4096).
# Local windows keep items short at any length (B1 S16384, window 1024: 509
# vs 475 on 2026-11-22). The thresholds sit between the measured points.
PERSISTENT_MAX_MEAN_BLOCKS = 24
PERSISTENT_MAX_MEAN_BLOCKS_PAIRED = 12


def mean_kv_blocks_per_tile(config: ForwardConfig, mask: MaskSpec, kv_seq: int,
                            q_seq: int | None = None) -> float:
  """KV blocks a CTA's query tile walks, averaged over the tiles (full lengths)."""
  q_seq = kv_seq if q_seq is None else q_seq
  rows = config.block_q_cta
  blocks = []
  for q_lo in range(0, q_seq, rows):
    lo, hi = mask.key_block_range(q_lo, min(q_lo + rows, q_seq), kv_seq, config.block_kv)
    blocks.append(max(hi - lo, 0))
  return sum(blocks) / max(len(blocks), 1)


def all_configs() -> list[tuple[int, ForwardConfig]]:
  """Every (padded head dim, config) the heuristic can pick (for tests)."""
  seen = {}
  for d in (64, 128, 192, 256):
    for mask in (MaskSpec(), MaskSpec(right=0), MaskSpec(left=256, right=0)):
      for kv_seq in (1024, 8192):
        seen[(d, choose_config(d, mask, kv_seq))] = None
  return list(seen)


def check_supported(q_shape, k_shape, dtype, mask: MaskSpec) -> None:
  """Raises KernelUnsupported when this kernel cannot serve the call."""
  d = check_common("sm90 forward", q_shape, k_shape, dtype, mask)[-1]
  if d % 16 or not 16 <= d <= MAX_HEAD_DIM:
    raise KernelUnsupported(
        f"sm90 forward: head_dim must be a multiple of 16 in [16, {MAX_HEAD_DIM}]; got {d}")


@dataclasses.dataclass(frozen=True)
class ForwardBarriers:
  """Every barrier of the forward kernel, with its producer and consumer side.

  | barrier              | arrives (count)                  | waits                       |
  |----------------------|----------------------------------|-----------------------------|
  | q.full[b]            | producer TMA of Q_i (1)          | consumer i, once per tile   |
  | q.consumed[b]        | consumer i after its last QK (1) | producer before reloading copy b (persistent only) |
  | k.full[slot]         | producer TMA of K_n (1)          | both consumers, every step  |
  | k.consumed[slot]     | each consumer once S=QK^T is done (2) | producer before refilling |
  | v.full[slot]         | producer TMA of V_n (1)          | both consumers, every step  |
  | v.consumed[slot]     | each consumer once O+=PV is done (2)  | producer before refilling |
  | pingpong             | both consumers (2)               | both consumers (only with `config.pingpong`) |

  b = `q.buffer(item, i)`: consumer i's Q tile for work item `item`, one of
  `config.q_depth` copies (two let a persistent CTA prefetch the next Q).

  O epilogue: without a persistent grid it reuses consumer i's Q buffer
  (only consumer i touches it after `q.full[i]`); a persistent CTA has
  separate O tiles, and consumer i waits for its previous TMA store to have
  read them (`wait_smem_to_gmem(0, wait_read_only=True)`) before rewriting.
  """

  q: OneShotBuffer
  k: SlotRing
  v: SlotRing
  pingpong: Rendezvous

  @staticmethod
  def scratch_types(config: ForwardConfig):
    n, c = config.num_kv_stages, config.num_consumers
    return (
        *OneShotBuffer.barrier_types(c, config.q_depth),
        *SlotRing.barrier_types(n, c),
        *SlotRing.barrier_types(n, c),
        Rendezvous.barrier_type(c),
    )

  @classmethod
  def from_refs(cls, config: ForwardConfig, refs) -> "ForwardBarriers":
    q_full, q_consumed, k_full, k_consumed, v_full, v_consumed, pingpong = refs
    n, c = config.num_kv_stages, config.num_consumers
    return cls(
        q=OneShotBuffer(q_full, q_consumed, depth=config.q_depth),
        k=SlotRing(k_full, k_consumed, n, c),
        v=SlotRing(v_full, v_consumed, n, c),
        pingpong=Rendezvous(pingpong, c) if config.pingpong else Rendezvous.disabled(),
    )


def _build_kernel(
    *,
    batch: int,
    q_seq: int,
    kv_seq: int,
    kv_valid: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype,
    scale: float,
    mask: MaskSpec,
    config: ForwardConfig,
    has_q_lengths: bool,
    has_kv_lengths: bool,
):
  bq, bk, cfg = config.block_q, config.block_kv, config
  num_q_tiles = cdiv(q_seq, cfg.block_q_cta)
  group = num_q_heads // num_kv_heads
  c = scale * LOG2_E  # folded softmax scale: exp(scale*s - m) = exp2(c*s - m2)
  # Heavy tiles first: with a right bound (causal), later rows see more keys.
  heavy_last = pairs_causal_tiles(mask)
  masked_logit = -jnp.inf if c >= 0 else jnp.inf
  interpreting = is_interpreting()

  work = PersistentWork(batch, num_q_heads, num_q_tiles, cfg.num_sms, heavy_last) if cfg.persistent else None

  def kernel(*refs):
    refs = list(refs)
    q_ref, k_ref, v_ref = refs[:3]
    del refs[:3]
    q_len_ref = refs.pop(0) if has_q_lengths else None
    kv_len_ref = refs.pop(0) if has_kv_lengths else None
    out_ref, lse_ref, smem, barrier_refs = refs
    q_smem, k_smem, v_smem, lse_smem, *optional_smem = smem
    o_smem = optional_smem.pop(0) if cfg.persistent else None
    p_smem = optional_smem.pop(0) if interpreting else None
    bars = ForwardBarriers.from_refs(cfg, barrier_refs)
    wg = lax.axis_index("wg")

    if cfg.persistent:
      cta = lax.axis_index("ctas")
      my_tiles = work.count(cta)
      tile_coords = functools.partial(work.coords, cta)
    else:
      # One work item per CTA; heavy causal tiles are launched first.
      my_tiles = 1
      tile = lax.axis_index("q_tiles")
      tile = heavy_first_tile(tile, num_q_tiles, heavy_last)
      coords = (lax.axis_index("batch"), lax.axis_index("heads"), tile)
      tile_coords = lambda i: coords

    def geometry(i):
      """Everything about this CTA's work item i both roles agree on."""
      batch_idx, head, tile = tile_coords(i)
      q_len, kv_len = sequence_lengths(q_len_ref, kv_len_ref, batch_idx, q_seq, kv_valid)
      cta_q_lo = tile * cfg.block_q_cta
      blocks = kv_tile_ranges(mask, cta_q_lo, cta_q_lo + cfg.block_q_cta, q_len, kv_len, bk)
      # The producer loads KV blocks [lo, hi) for the whole CTA tile.
      return dict(batch_idx=batch_idx, head=head, q_len=q_len, kv_len=kv_len,
                  cta_q_lo=cta_q_lo, lo=blocks.lo, hi=blocks.hi)

    def tile_loop(body, init):
      """Runs body(i, carry) over this CTA's work items (a loop even for one
      item, so the ring position is a run-time value wgmma closures accept)."""
      return lax.fori_loop(0, my_tiles, body, init)

    @pl.when(wg == cfg.num_consumers)
    def _producer():
      plgpu.set_max_registers(cfg.producer_registers, action="decrease")

      def produce_tile(i, step0):
        g = geometry(i)
        lo, hi = g["lo"], g["hi"]
        for c_i in range(cfg.num_consumers):
          if cfg.persistent:
            bars.q.producer_acquire(i, c_i)
          rows = pl.ds(g["cta_q_lo"] + c_i * bq, bq)
          bars.q.producer_fill(q_ref.at[g["batch_idx"], rows, g["head"]], q_smem, i, c_i)
        kv_head = lax.div(g["head"], jnp.int32(group))

        @pl.loop(lo, hi)
        def _(j):
          step = step0 + j - lo
          keys = (g["batch_idx"], pl.ds(j * bk, bk), kv_head)
          bars.k.producer_acquire(step)
          bars.k.producer_fill(k_ref.at[keys], k_smem, step)
          bars.v.producer_acquire(step)
          bars.v.producer_fill(v_ref.at[keys], v_smem, step)

        return step0 + (hi - lo)

      total_steps = tile_loop(produce_tile, jnp.int32(0))
      bars.k.producer_drain(total_steps)
      bars.v.producer_drain(total_steps)
      if cfg.persistent:
        bars.q.producer_drain(my_tiles)

    @pl.when(wg < cfg.num_consumers)
    def _consumer():
      plgpu.set_max_registers(cfg.consumer_registers, action="increase")
      row_layout = plgpu.Layout.WGMMA.reduce(1)

      def consume_tile(i, step0):
        g = geometry(i)
        q_tile = q_smem.at[bars.q.buffer(i, wg)]
        o_tile = o_smem.at[wg] if cfg.persistent else q_tile
        lo, hi, q_len, kv_len = g["lo"], g["hi"], g["q_len"], g["kv_len"]
        q_lo = g["cta_q_lo"] + wg * bq
        own = kv_tile_ranges(mask, q_lo, q_lo + bq, q_len, kv_len, bk).within(lo, hi)
        ring_step = lambda j: step0 + (j - lo)  # ring position of KV block j

        def wait_next_k(j):
          @pl.when(j + 1 < hi)
          def _():
            bars.k.consumer_wait(ring_step(j + 1))

        def p_times_v(acc, p, v_tile, while_running):
          """O += P V, with `while_running()` issued while the wgmma runs."""
          if interpreting:
            # The interpreter rejects wgmma with A in registers and run_state:
            # stage P through SMEM and add a fresh accumulator.
            p_operand = p_smem.at[wg]
            p_operand[...] = p
            plgpu.commit_smem()

            def pv_delta(delta_ref):
              plgpu.wgmma(delta_ref, p_operand, v_tile)
              while_running()
              return delta_ref[...]

            return acc + pl.run_scoped(pv_delta, plgpu.ACC((bq, head_dim), jnp.float32))

          def pv(acc_ref):
            plgpu.wgmma(acc_ref, p, v_tile)
            while_running()

          return pl.run_state(pv)(plgpu.ACC.init(acc))

        def qk(s_ref, k_tile):
          plgpu.wgmma(s_ref, q_tile, k_tile.transpose((1, 0)))
          bars.pingpong.sync()  # the other consumer's softmax ends here
          return s_ref[...]

        def block_softmax(s, m, j, *, masked: bool):
          """(P, new running max, alpha) for the logits of KV block j."""
          if masked:
            q_idx = q_lo + plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
            k_idx = j * bk + plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
            s = jnp.where(visible(mask, q_idx, k_idx, kv_len), s, masked_logit)
          return online_softmax(s, m, c)

        def hand_off(step):
          bars.pingpong.arrive()  # done with softmax
          bars.v.consumer_wait(step)
          bars.pingpong.wait()  # tensor core free: the other consumer issued its QK

        def softmax_and_hand_off(s, m, l, j, *, masked: bool, acc=None):
          """Softmax of block j, the hand-off of the tensor core, and the row
          sums before or after it (`sum_before_handoff`). `acc`, if given, is
          rescaled before the hand-off."""
          p, m_new, alpha = block_softmax(s, m, j, masked=masked)
          if acc is not None:
            acc = rescale_rows(acc, alpha, skip_unchanged=cfg.conditional_rescale)
          p16 = p.astype(dtype)
          if cfg.sum_before_handoff:
            l = l * alpha + p.sum(axis=1)
            # Pin the order: the softmax must be done before the hand-off.
            acc, l, m_new, alpha, p16 = lax.optimization_barrier((acc, l, m_new, alpha, p16))
            hand_off(ring_step(j))
          else:
            hand_off(ring_step(j))
            l = l * alpha + p.sum(axis=1)
          return p16, m_new, l, alpha, acc

        def compute_step(j, carry, *, masked: bool):
          """S = Q K^T, softmax, O += P V, one after the other."""
          acc, m, l = carry
          step = ring_step(j)
          s = pl.run_scoped(functools.partial(qk, k_tile=k_smem.at[bars.k.slot(step)]),
                            plgpu.ACC((bq, bk), jnp.float32))
          bars.k.consumer_release(step)
          p16, m_new, l, _, acc = softmax_and_hand_off(s, m, l, j, masked=masked, acc=acc)
          acc = p_times_v(acc, p16, v_smem.at[bars.v.slot(step)], lambda: wait_next_k(j))
          bars.v.consumer_release(step)
          return acc, m_new, l

        def skip_step(j, carry):
          """A block this consumer's rows cannot see: keep the protocol going."""
          step = ring_step(j)
          bars.pingpong.sync()
          bars.k.consumer_release(step)
          bars.pingpong.arrive()
          bars.v.consumer_wait(step)
          bars.pingpong.wait()
          bars.v.consumer_release(step)
          wait_next_k(j)
          return carry

        bars.q.consumer_wait(i, wg)
        m = plgpu.layout_cast(jnp.full((bq,), M_INIT, jnp.float32), row_layout)
        l = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), row_layout)
        acc = plgpu.layout_cast(jnp.full((bq, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        @pl.when(hi > lo)
        def _():
          bars.k.consumer_wait(step0)

        pl.when(wg == 1)(bars.pingpong.sync)  # offset the two consumers by one turn
        carry = fori(lo, own.lo, skip_step, (acc, m, l))
        carry = fori(own.lo, own.full_lo, functools.partial(compute_step, masked=True), carry)
        carry = fori(own.full_lo, own.full_hi, functools.partial(compute_step, masked=False), carry)
        carry = fori(own.full_hi, own.hi, functools.partial(compute_step, masked=True), carry)
        carry = fori(own.hi, hi, skip_step, carry)
        pl.when(wg == 0)(bars.pingpong.sync)
        acc, m, l = carry
        if cfg.persistent:
          bars.q.consumer_release(i, wg)  # every QK of this tile completed

        if has_q_lengths:
          rows = q_lo + plgpu.broadcasted_iota(jnp.int32, (bq,), 0, layout=row_layout)
          l = jnp.where(rows < q_len, l, 0.0)  # rows past the length: zeros, lse -inf
        out, lse = normalize(acc, m, l)
        if cfg.persistent:
          # The previous tile's stores must have read o_tile and the LSE row.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        o_tile[...] = out.astype(dtype)
        lse_smem.at[wg][...] = lse
        plgpu.commit_smem()
        b_i, h_i = g["batch_idx"], g["head"]
        plgpu.copy_smem_to_gmem(o_tile, out_ref.at[b_i, pl.ds(q_lo, bq), h_i])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b_i, h_i, pl.ds(q_lo, bq)])
        return step0 + (hi - lo)

      tile_loop(consume_tile, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0)

  smem = [
      smem_tile((cfg.q_depth * cfg.num_consumers, bq, head_dim), dtype),  # Q tiles (then O)
      smem_tile((cfg.num_kv_stages, bk, head_dim), dtype),  # K ring
      smem_tile((cfg.num_kv_stages, bk, head_dim), dtype),  # V ring
      plgpu.SMEM((cfg.num_consumers, bq), jnp.float32),  # LSE rows
  ]
  if cfg.persistent:
    # O tiles of their own, so the next work item's Q can land during the epilogue.
    smem.append(smem_tile((cfg.num_consumers, bq, head_dim), dtype))
  if interpreting:
    smem.append(smem_tile((cfg.num_consumers, bq, bk), dtype))  # P staging
  # The LSE rows are stored with 1-D TMA boxes along the sequence, its
  # contiguous axis. On an H100 a box that ran past the end of that axis left
  # wrong values (seen at q_seq = 56, block_q = 64; the interpreter clips it
  # correctly), so the LSE output covers whole tiles and `forward` slices it.
  lse_seq = (work.tile_slots if work else num_q_tiles) * cfg.block_q_cta
  out_type = (
      jax.ShapeDtypeStruct((batch, q_seq, num_q_heads, head_dim), dtype),
      jax.ShapeDtypeStruct((batch, num_q_heads, lse_seq), jnp.float32),
  )
  return plgpu.kernel(
      kernel,
      out_type=out_type,
      scratch_types=(tuple(smem), ForwardBarriers.scratch_types(cfg)),
      grid=(work.num_ctas,) if cfg.persistent else (num_q_heads, num_q_tiles, batch),
      grid_names=("ctas",) if cfg.persistent else ("heads", "q_tiles", "batch"),
      num_threads=cfg.num_consumers + 1,
      thread_name="wg",
      # Row reductions of a wgmma tile stay inside a warp (shuffles), so the
      # 2 KiB of SMEM reserved by default for cross-warp reductions is given
      # to the KV ring (block_kv 192 at D = 128 misses the limit by 104 bytes
      # with it). A reduction that needs it fails to lower.
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
  )


def _sm_count(default: int) -> int:
  """SMs of the default device (a persistent grid launches one CTA per SM:
  more would queue a second wave); `default` without a GPU."""
  try:
    device = default_device()
  except RuntimeError:
    return default
  if device.platform != "gpu":
    return default
  return getattr(device, "core_count", None) or default


def forward(q, k, v, q_lengths, kv_lengths, *, scale: float, mask: MaskSpec,
            config: ForwardConfig | None = None):
  """Attention forward. See `fa4_jax.kernels` for the contract.

  q: [B, Tq, Nq, D]; k, v: [B, Tk, Nkv, D]. Returns (out [B, Tq, Nq, D] in
  q.dtype, lse float32 [B, Nq, Tq]).
  """
  check_supported(q.shape, k.shape, q.dtype, mask)
  if v.shape != k.shape:
    raise KernelUnsupported(f"v must have k's shape {k.shape}; got {v.shape}")
  if k.dtype != q.dtype or v.dtype != q.dtype:
    raise KernelUnsupported(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
  batch, q_seq, num_q_heads, head_dim = q.shape
  _, kv_seq, num_kv_heads, _ = k.shape
  # The TMA descriptors tile (sequence, head_dim) by (8, 64): sequence lengths
  # must be multiples of 8 and head dims multiples of 64. Other sizes are
  # zero-padded here (a copy; aligned shapes take no detour). Padded keys are
  # masked in the kernel, padded rows and columns are sliced off.
  d = padded_head_dim(head_dim)
  q_pad, kv_pad = cdiv(q_seq, 8) * 8, cdiv(kv_seq, 8) * 8
  if d != head_dim or q_pad != q_seq:
    q = jnp.pad(q, [(0, 0), (0, q_pad - q_seq), (0, 0), (0, d - head_dim)])
  if d != head_dim or kv_pad != kv_seq:
    k, v = (jnp.pad(x, [(0, 0), (0, kv_pad - kv_seq), (0, 0), (0, d - head_dim)])
            for x in (k, v))
  if config is None:
    config = choose_config(d, mask, kv_seq, q_seq)
  if config.persistent and not config.num_sms:
    config = dataclasses.replace(config, num_sms=_sm_count(H100_SMS))
  call = _build_kernel(
      batch=batch, q_seq=q_pad, kv_seq=kv_pad, kv_valid=kv_seq,
      num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=d,
      dtype=q.dtype, scale=float(scale), mask=mask, config=config,
      has_q_lengths=q_lengths is not None, has_kv_lengths=kv_lengths is not None,
  )
  args = [q, k, v]
  if q_lengths is not None:
    args.append(jnp.asarray(q_lengths, jnp.int32))
  if kv_lengths is not None:
    args.append(jnp.asarray(kv_lengths, jnp.int32))
  out, lse = call(*args)
  if d != head_dim or q_pad != q_seq:
    out = out[:, :q_seq, :, :head_dim]
  return out, lse[..., :q_seq]
