"""Attention backward for Hopper (sm_90) in Pallas Mosaic GPU.

The backward recomputes the probabilities from Q, K and the forward's
log-sum-exp instead of storing them:

    P  = exp(scale * Q K^T - lse)        dP = dO V^T
    dS = P * (dP - delta),  delta = rowsum(dO * O)
    dQ = scale * dS K       dK = scale * dS^T Q       dV = P^T dO

Three steps, every gradient written by exactly one CTA (deterministic, no
atomics):

1. `_preprocess` (plain XLA): the lse converted to log2 units with +inf for
   rows that must not contribute (rows past the query length, rows that saw
   no key), so that P = exp2(c * s - lse2) is exactly 0 there, padded to
   whole blocks. delta too, by one fused reduction over dO and O, unless the
   dQ kernel computes it (`BackwardConfig.delta_in_dq`, the heuristic's
   choice at head dim <= 128 for causal masks without a window): then the
   dQ kernel runs first, and the reduction's 0.05 ms (B2 S8192 H16 D128,
   H100) is saved.
2. the dK/dV kernel: one CTA per (kv head, KV tile of `2 * block_kv` keys,
   batch). Two consumer warpgroups each own `block_kv` keys and keep their dK
   and dV in registers; a producer warpgroup streams (Q, dO, lse, delta) tiles
   of every query head of the GQA group and every query block the mask lets
   these keys be seen by, through a ring of `num_stages` SMEM slots. The group
   sum of dK/dV happens in the accumulators, not in a later pass. Above head
   dim 128 dK + dV do not fit one warpgroup: at 256 the consumers share the
   keys and split the head dim (`_build_dkv_head_split_kernel`), at 192 the
   kernel runs once for dK and once for dV (`BackwardConfig.dk_dv`).
3. the dQ kernel: one CTA per (q head, Q tile of `dq_num_consumers *
   dq_block_q` rows, batch), the mirror image: consumers own query rows and
   their dQ, the producer streams (K, V) tiles of the key blocks those rows
   see. With `delta_in_dq` each consumer also loads its rows' O tile, computes
   their delta before its first block and writes it out for the dK/dV kernel.

Without `delta_in_dq` the kernels read none of each other's outputs, and
with `BackwardConfig.overlap_kernels` (the heuristic's choice there) each
launches while the one before it finishes (programmatic dependent launch,
`pipeline.LaunchChain`): the next kernel's CTAs take the SMs the last, partial
wave of CTAs leaves idle.

Why two kernels rather than one with a dQ reduction: a single kernel must add
partial dQ tiles from many CTAs into one buffer, and float additions in
arrival order are not deterministic. Two kernels recompute S and dP once more
(7 instead of 5 GEMMs of one tile, +40% tensor work in dQ's share) but stay
deterministic and simple. A one-kernel variant (a dQ warpgroup summing dQ
in int32 fixed point, deterministic as well) was slower on an H100 at head
dim 128 (B2 S8192 H16: 5.14 against 4.69 ms; 2-15 % behind without a
window, 32 % under a 1024-key one): it left the package, its code is at
commit `dcef065` and the measurements in BENCHMARKS.md.

Barrier protocol (see `BackwardBarriers`): per CTA one "resident" operand pair
loaded once per consumer (K/V tiles in dK/dV, Q/dO/lse/delta in dQ) and one
streamed ring. Generic ring arithmetic comes from `fa4_jax.kernels.pipeline`;
a ring slot here holds several operands (a "bundle"), whose full barrier
expects one TMA arrival per operand (`pipeline.BundleRing`).

Masks: a consumer walks only the blocks its own rows/keys can touch (for
dK/dV `MaskSpec.query_block_range`, for dQ `key_block_range` through the
forward's `kv_tile_ranges`), uses element masks only on boundary tiles, and
only keeps the barrier protocol going for blocks of the CTA's range outside
its own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fa4_jax.interpret import is_interpreting
from fa4_jax.kernels import KernelUnsupported, check_common
from fa4_jax.kernels.pipeline import (NO_CHAIN, BundleRing, LaunchChain, OneShotBuffer,
                                     Rendezvous, SlotRing, check_register_split, fori,
                                     sequence_lengths)
from fa4_jax.kernels.sm90_forward import kv_tile_ranges, padded_head_dim
from fa4_jax.scores import MaskSpec, cdiv

LOG2_E = math.log2(math.e)
MAX_HEAD_DIM = 256
# dK and dV of a 64-key tile take head_dim fp32 registers per thread together;
# above this head dim they do not fit beside S and dP, so dK and dV are
# computed by two passes of the dK/dV kernel, one accumulator each.
MAX_FUSED_DK_DV_HEAD_DIM = 128
DK_DV_SCHEMES = ("fused", "head_dim_split", "two_passes")
# lse and delta are padded to a multiple of this (every block size divides it).
STATS_ALIGN = 128


# --- configuration -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """Static tiling of both kernels.

  dK/dV kernel, by `dk_dv` scheme:
  - "fused": a CTA owns `2 * block_kv` keys (one `block_kv` tile per consumer
    warpgroup, the wgmma M dimension), each warpgroup keeps dK and dV of its
    keys, and `block_q`-row query tiles stream through `num_stages` slots.
  - "head_dim_split": a CTA owns `block_kv` keys and each consumer keeps half
    the head dim of their dK and dV (`_build_dkv_head_split_kernel`).
  - "two_passes": the fused kernel runs twice, accumulating dK only, then dV
    only (S^T is computed twice: 5 tile GEMMs per query block instead of 4).
  dQ kernel: a CTA owns `dq_num_consumers * dq_block_q` rows and streams
  `dq_block_kv`-key tiles through `dq_num_stages` slots.

  dQ inside the dK/dV kernel (one kernel, five tile GEMMs instead of seven,
  dQ summed in int32 fixed point) was measured slower on an H100 (B2 S8192
  H16 D128: 535 vs 586 TFLOP/s; B1 S16384: 532 vs 543) and left the package;
  its code is at commit `dcef065`, the measurements in BENCHMARKS.md.
  """

  block_kv: int = 64
  block_q: int = 64
  num_stages: int = 2
  dq_block_q: int = 64
  dq_block_kv: int = 64
  dq_num_stages: int = 2
  num_consumers: int = 2
  producer_registers: int = 40
  consumer_registers: int = 232
  dk_dv: str = "fused"
  # The dQ kernel's warpgroups: its accumulators are half the dK/dV kernel's,
  # so at head dim <= 128 it runs three consumers on fewer registers each.
  dq_num_consumers: int = 2
  dq_producer_registers: int = 40
  dq_consumer_registers: int = 232
  # dK/dV kernel ("fused" scheme): load a block's lse and delta from SMEM
  # before waiting for its S^T and dP^T GEMMs rather than after (Nsight
  # Compute: the first FFMA of P^T waited on those loads). Holds them in
  # registers across the wait: 32 more per thread at block_q 64.
  stats_first: bool = False
  # delta = rowsum(dO * O) computed by the dQ kernel (which then runs first,
  # loads each consumer's O tile beside its dO tile and hands delta to the
  # dK/dV kernel) instead of by an XLA reduction before both kernels. Needs
  # SMEM for the O tiles (head dim <= 128).
  delta_in_dq: bool = False
  # Launch each kernel while the one before it finishes (programmatic
  # dependent launch, `pipeline.LaunchChain`): the dQ kernel's CTAs fill the
  # SMs the dK/dV kernel's last, partial wave leaves idle (at B2 S8192 H16
  # D128 2048 CTAs make 15.5 waves on 132 SMs, the dQ kernel's 1376 make
  # 10.4). The kernels must not read each other's outputs, so delta comes
  # from XLA (not with `delta_in_dq`).
  overlap_kernels: bool = False
  # Keep the tiles a consumer holds for its whole loop in registers, as the A
  # operands of its first two GEMMs, instead of having every wgmma read them
  # from SMEM again: Q and dO in the dQ kernel (S = Q K^T, dP = dO V^T), K and
  # V in the dK/dV kernel (S^T = K Q^T, dP^T = V dO^T; not "head_dim_split").
  # With both operands in SMEM, an N = 64 wgmma reads SMEM as fast as the
  # tensor core multiplies (4 KB per m64n64k16: 32 clocks at 128 B per clock,
  # 32 at ~4096 bf16 FLOP per clock and SM). Costs head_dim / 4 registers per
  # tile and thread, so it pays at head dim 64 only (choose_config). The
  # interpreter, which has no register A operands, keeps the tiles in SMEM.
  dq_operands_in_registers: bool = False
  operands_in_registers: bool = False
  # dK/dV kernel, passes with dK: start the S^T accumulator at -lse2 / c and
  # the dP^T one at -delta (broadcast along the keys) instead of 0, so that
  # the wgmmas leave c * S^T - lse2 (up to the factor c) and dP^T - delta.
  # lse2 and delta then die before the wait for the wgmmas instead of living
  # across it (`stats_first`: 32 registers per thread at block_q 64), and the
  # subtractions leave the softmax. Rows with lse2 = +inf start at -inf and
  # keep P = 0.
  fold_stats: bool = False

  def __post_init__(self):
    if self.dk_dv not in DK_DV_SCHEMES:
      raise ValueError(f"dk_dv must be one of {DK_DV_SCHEMES}; got {self.dk_dv!r}")
    if self.overlap_kernels and self.delta_in_dq:
      raise ValueError(f"overlap_kernels needs independent kernels: delta_in_dq=False; "
                       f"got delta_in_dq={self.delta_in_dq}: set overlap_kernels=False")
    dq_rows = self.dq_num_consumers * self.dq_block_q
    if self.delta_in_dq and dq_rows % self.block_q:  # (the dV pass reads no delta)
      # The dK/dV kernel must not read delta rows the dQ kernel never wrote.
      raise ValueError(f"delta_in_dq needs block_q to divide the dQ kernel's "
                       f"{dq_rows} rows per CTA; got block_q={self.block_q}")
    if self.fold_stats and self.dk_dv == "head_dim_split":
      raise ValueError(f"fold_stats is a choice of the dK/dV kernels whose consumers own whole "
                       f"key tiles ('fused' and 'two_passes'); got dk_dv={self.dk_dv!r}: "
                       f"set fold_stats=False")
    if self.operands_in_registers and self.dk_dv == "head_dim_split":
      raise ValueError(f"operands_in_registers is a choice of the dK/dV kernel of the 'fused' "
                       f"and 'two_passes' schemes; got dk_dv={self.dk_dv!r}: "
                       f"set operands_in_registers=False")
    check_register_split("BackwardConfig (dK/dV kernel)", self.producer_registers,
                         self.num_consumers, self.consumer_registers)
    check_register_split("BackwardConfig (dQ kernel)", self.dq_producer_registers,
                         self.dq_num_consumers, self.dq_consumer_registers)

def choose_config(head_dim: int, mask: MaskSpec, group: int = 1) -> BackwardConfig:
  """Block sizes per (padded) head dim; the same for every mask. Where delta
  is computed depends on whether the mask has a window, how lse and delta
  enter the dK/dV kernel on the GQA group size (`group` query heads per KV
  head) and the mask (below).

  Registers per consumer thread (64 rows per warpgroup, fp32):
  dK/dV: dK + dV = head_dim, S^T and dP^T = block_q / 2 each.
  dQ:    dQ = head_dim / 2, S and dP = dq_block_kv / 2 each.

  Measured on an H100 (benchmarks/results/backward-*-configs-*.json): at
  head_dim 128, dq_block_kv=128 gains 1-5% on dense shapes but loses 13% under
  a 1024-key window, and 3 stages gain at most 2%; at head_dim 64, block_q=128
  for dK/dV was 2-7% faster than 64 with two dK/dV consumers (and
  dq_block_kv=128 was, with two dQ consumers); since then two consumers on
  64-row query tiles that load lse and delta early beat both (below).
  """
  d = padded_head_dim(head_dim)
  # dQ with three consumers (160 registers each: dQ 64 + S 32 + dP 32 at
  # 128), measured on an H100 against two (B2 S8192, dQ kernel time): D128
  # 2.03 vs 2.18 ms dense, 1.06 vs 1.09 causal; D64 2.46 vs 2.70 dense, 1.32
  # vs 1.36 causal (backward-*-2026-11-23-dq-consumers-d*.json; there
  # three consumers ran both kernels: dK/dV, with twice the accumulators,
  # spills on 160 registers at 128 and at 64 loses 4 % dense, gains 4 %
  # causal).
  three_dq_consumers = dict(dq_block_q=64, dq_block_kv=64, dq_num_stages=2,
                            dq_num_consumers=3, dq_producer_registers=24,
                            dq_consumer_registers=160)
  # dK/dV: two consumers of 64 keys on 240 registers, 64-row query tiles,
  # lse and delta loaded before the S^T / dP^T wait (232 registers spill 92
  # bytes with it). H100, same process: B2 S8192 H16 D128 dK/dV kernel 2.75
  # vs 3.11 ms (572 vs 534 TFLOP/s), causal 544 vs 519, B1 S16384 causal 566
  # vs 526 (backward-stats-first-3-...json). D = 64 with three stages: 454 /
  # 444 TFLOP/s dense / causal against 439 / 436 for three consumers on 160
  # registers (where loading early spills 240 bytes and loses 16 %), 417 /
  # 401 with the loads after the wait (backward-d64-stats-first-2-...json).
  #
  # delta in the dQ kernel saves the XLA reduction (0.05 ms at B2 S8192 H16,
  # 0.09 at H32) and costs the dQ kernel an O tile load per consumer:
  # +0.01-0.02 ms dense or causal, but +0.06 ms under a 1024-key window,
  # where each CTA walks only ~19 key blocks (H100, same process,
  # backward-delta-in-dq-...-2026-11-24.json).
  #
  # Overlapping the kernels (PDL) needs the XLA delta but lets the dQ
  # kernel's CTAs fill the SMs the dK/dV kernel's last wave leaves idle.
  # H100, kernel span, three interleaved rounds in each of three runs
  # (backward-pdl-*-2026-11-24.json), against delta in the dQ kernel: B2
  # S8192 H16 D128 dense gains 1-2 % in each run (4.82 -> 4.76, 4.83 -> 4.72
  # ms), D = 64 dense gained in two runs and lost 1.3 % in one, the 1024-key
  # window gains 3.6 % (0.863 -> 0.832), the 4096-key window 0.6 %; causal
  # rows without a window lose 0-3 % (their dK/dV tail is short: light key
  # tiles run last), so they keep delta in the dQ kernel.
  causal_without_window = mask.left is None and mask.right is not None
  delta_in_dq = causal_without_window
  #
  # Register A operands (`operands_in_registers`, `dq_operands_in_registers`)
  # at D = 64, H100, B2 S8192 H32, span, two runs of interleaved rounds
  # (backward-regs-d64-...-2026-11-24.json): dense 5.72 vs 5.81 ms and 5.79
  # vs 5.91, causal 3.00 vs 3.06 and 3.00 vs 3.09; the gradients are bit for
  # bit those of SMEM operands. At D = 128 K and V in registers spill (360
  # bytes) and the dK/dV kernel takes 4.60 instead of 2.79 ms (3.78 without
  # `stats_first`); Q and dO in the dQ kernel leave room for two consumers
  # only: 2.24 vs 2.03 ms for three with SMEM operands (backward-regs-d128-...).
  #
  # lse and delta folded into the S^T / dP^T accumulators (`fold_stats`) at
  # D = 128, H100, B2 S8192, span (backward-fold-*-2026-11-24.json): with GQA
  # (H32/8) under a causal mask the dK/dV kernel spilled 348 bytes (ptxas)
  # and Nsight Compute counted 53 M spill requests in it, where H16 dense has
  # none; folded, 92 bytes, and the backward takes 5.00 vs 5.08 ms and 5.05
  # vs 5.11 in two runs (H200: 5.02 vs 5.15). Elsewhere the loads before the
  # wgmmas cost more than the spills save: 4.87 vs 4.73 ms H16 dense, 2.56 vs
  # 2.53 causal, 10.24 vs 9.68 GQA dense. Under causal windows it does not
  # pay either (five interleaved rounds each): 1024 keys (B1 S16384) 0.841 vs
  # 0.849 ms on an H100 but 0.809 vs 0.809 on an H200; 4096 keys (B1 S32768)
  # 5.010 vs 5.028 on the H100, 4.908 vs 4.834 on the H200, every folded
  # round slower there (backward-fold-window-..., backward-h200-fold-window*).
  fold_stats = causal_without_window and group > 1 and d > 64
  if d <= MAX_FUSED_DK_DV_HEAD_DIM:
    return BackwardConfig(block_kv=64, block_q=64, num_stages=3 if d <= 64 else 2,
                          producer_registers=24, consumer_registers=240, stats_first=True,
                          delta_in_dq=delta_in_dq, overlap_kernels=not delta_in_dq,
                          operands_in_registers=d <= 64, dq_operands_in_registers=d <= 64,
                          fold_stats=fold_stats, **three_dq_consumers)
  if d % 128 == 0:
    # 256: each consumer keeps half the head dim of dK and dV. SMEM: K, V
    # 64 KiB, two stages of Q and dO 128 KiB, P^T and dS^T rings 32 KiB; the
    # resident Q and dO tiles of dQ take 128 KiB, so its key tiles are 32
    # rows. H100, B2 S8192 H8: 466 / 455 TFLOP/s dense / causal, where two
    # passes reach 400 / 404; 240 consumer registers gain 1 %. Overlapped
    # kernels: 5.86 -> 5.82 ms dense, 3.00 -> 2.98 causal (one run).
    return BackwardConfig(block_kv=64, block_q=64, num_stages=2,
                          dq_block_q=64, dq_block_kv=32, dq_num_stages=3,
                          producer_registers=24, consumer_registers=240,
                          dk_dv="head_dim_split", overlap_kernels=True)
  # 192 (and 144-176, padded): halves of 96 columns do not fall on the
  # 64-column tiles of the swizzled layout, so dK and dV take two passes
  # (at 256 two passes cost 14 % against the split). 64-row tiles and two
  # stages fit the SMEM at 192 in every kernel (at most 192 KiB). With
  # `overlap_kernels` the trace showed none of the three kernels start
  # before the previous one ended (why was not found), and it ran 1 % slower.
  return BackwardConfig(block_kv=64, block_q=64, num_stages=2,
                        dq_block_q=64, dq_block_kv=64, dq_num_stages=2,
                        dk_dv="two_passes")


def all_configs() -> list[tuple[int, BackwardConfig]]:
  """Every (padded head dim, config) the heuristic can pick (for tests)."""
  seen = {}
  for d in (64, 128, 192, 256):
    for mask in (MaskSpec(), MaskSpec(right=0), MaskSpec(left=256, right=0)):
      for group in (1, 4):
        seen[(d, choose_config(d, mask, group))] = None
  return list(seen)


def check_supported(q_shape, k_shape, dtype, mask: MaskSpec) -> None:
  """Raises KernelUnsupported when the fused backward cannot serve the call."""
  d = check_common("sm90 backward", q_shape, k_shape, dtype, mask)[-1]
  if d % 16 or not 16 <= d <= MAX_HEAD_DIM:
    raise KernelUnsupported(
        f"sm90 backward: head_dim must be a multiple of 16 in [16, {MAX_HEAD_DIM}]; "
        f"got {d}")


# --- barriers ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BackwardBarriers:
  """Every barrier of one backward kernel, with its producer and consumer side.

  | barrier            | arrives (count)                        | waits                  |
  |--------------------|----------------------------------------|------------------------|
  | resident.full[i]   | producer TMAs of consumer i's resident | consumer i, once       |
  |                    | operands (one per operand)             |                        |
  | stream.full[slot]  | producer TMAs of step n (one/operand)  | both consumers, each n |
  | stream.consumed[s] | each consumer after its last wgmma     | producer, before it    |
  |                    | reading the slot (2)                   | refills the slot       |

  dK/dV kernel: resident = (K, V) tiles, stream = (Q, dO, lse, delta).
  dQ kernel:    resident = (Q, dO, lse, delta), or (Q, dO, lse, O) with
                `delta_in_dq`; stream = (K, V).
  The epilogue of consumer i writes its result into its own resident buffer
  (only consumer i reads it, and all its wgmmas have completed), then TMA-
  stores it and waits for the store before the CTA exits.
  """

  resident: OneShotBuffer
  stream: BundleRing

  @staticmethod
  def scratch_types(num_consumers, num_stages, num_resident, num_streamed):
    return (
        plgpu.Barrier(num_arrivals=num_resident, num_barriers=num_consumers),
        *BundleRing.barrier_types(num_stages, num_consumers, num_streamed),
    )

  @classmethod
  def from_refs(cls, refs, num_consumers, num_stages, num_streamed):
    resident_full, stream_full, stream_consumed = refs
    ring = SlotRing(stream_full, stream_consumed, num_stages, num_consumers)
    return cls(resident=OneShotBuffer(resident_full),
               stream=BundleRing(ring, num_streamed))

  def producer_fill_resident(self, copies, i):
    for src, dst in copies:
      plgpu.copy_gmem_to_smem(src, dst, self.resident.full.at[i])


# --- shared pieces ---------------------------------------------------------------


def _swizzle_bytes(dtype, *block_rows: int) -> int:
  """The SMEM swizzle of every tile of a kernel whose GEMMs contract over
  these block sizes. wgmma wants its two SMEM operands equally swizzled and
  the swizzle span (in elements) to divide the contraction: 128 bytes for
  blocks of 64 rows or more, 64 bytes when a block has 32 rows."""
  return min(128, min(block_rows) * jnp.dtype(dtype).itemsize)


def _smem_tile(shape, dtype, swizzle: int):
  """SMEM layout wgmma and TMA use directly: (8, swizzle span) tiles, swizzled."""
  tile_cols = swizzle // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(
      shape, dtype,
      transforms=(plgpu.TilingTransform((8, tile_cols)), plgpu.SwizzleTransform(swizzle)),
  )


def _clip(x, lo, hi):
  return jnp.minimum(jnp.maximum(x, lo), hi)


def _floor_div(x, d: int):
  """Floor division of a possibly negative int32 scalar by a positive int."""
  return jnp.where(x >= 0, lax.div(x, d), -lax.div(d - 1 - x, d))


def _ceil_div_nonneg(x, d: int):
  return lax.div(x + (d - 1), d)


@dataclasses.dataclass(frozen=True)
class _TileRanges:
  """Block ranges [lo, hi) that may be touched, [full_lo, full_hi) of them
  need no element mask."""

  lo: Any
  hi: Any
  full_lo: Any
  full_hi: Any


def q_tile_ranges(mask: MaskSpec, k_lo, k_hi, q_len, kv_len, block_q: int) -> _TileRanges:
  """Query blocks that may see keys [k_lo, k_hi) (keys >= kv_len do not count).

  The mirror of `sm90_forward.kv_tile_ranges`. A block is full when every
  (row, key) pair is visible under `mask` and every key is below `kv_len`;
  rows past `q_len` need no mask (their lse2 is +inf, so P = 0 there).
  """
  k_lo, k_hi, q_len, kv_len = (jnp.asarray(x, jnp.int32) for x in (k_lo, k_hi, q_len, kv_len))
  k_valid_hi = jnp.minimum(k_hi, kv_len)
  lo, hi = mask.query_block_range(k_lo, k_valid_hi, q_len, block_q)
  hi = jnp.where(k_lo < k_valid_hi, hi, lo)  # no valid key: nothing to do
  off = mask.q_offset
  full_lo, full_hi = lo, hi
  if mask.right is not None:
    # the block's first row must see the last key: row >= (k_hi-1) - off - right
    full_lo = _ceil_div_nonneg(jnp.maximum(k_hi - 1 - off - mask.right, 0), block_q)
  if mask.left is not None:
    # the block's last row must see the first key: row <= k_lo + left - off
    full_hi = _floor_div(k_lo + mask.left - off + 1, block_q)
  full_hi = jnp.where(k_hi <= kv_len, full_hi, lo)  # length edge inside the tile
  full_lo = _clip(full_lo, lo, hi)
  full_hi = _clip(full_hi, full_lo, hi)
  return _TileRanges(lo, hi, full_lo, full_hi)


def _own_ranges(own: _TileRanges, lo, hi) -> _TileRanges:
  """A consumer's ranges clipped into the CTA's [lo, hi)."""
  own_lo = _clip(own.lo, lo, hi)
  own_hi = _clip(own.hi, own_lo, hi)
  full_lo = _clip(own.full_lo, own_lo, own_hi)
  full_hi = _clip(own.full_hi, full_lo, own_hi)
  return _TileRanges(own_lo, own_hi, full_lo, full_hi)


def _walk(lo, hi, own: _TileRanges, step_fn, skip_fn, carry):
  """Runs blocks [lo, hi): skip / masked / full / masked / skip."""
  carry = fori(lo, own.lo, skip_fn, carry)
  carry = fori(own.lo, own.full_lo, functools.partial(step_fn, masked=True), carry)
  carry = fori(own.full_lo, own.full_hi, functools.partial(step_fn, masked=False), carry)
  carry = fori(own.full_hi, own.hi, functools.partial(step_fn, masked=True), carry)
  carry = fori(own.hi, hi, skip_fn, carry)
  return carry


@dataclasses.dataclass(frozen=True)
class _KeyTileWork:
  """What a CTA that owns keys [k_lo, k_lo + num_keys) of one KV head walks
  (the dK/dV, head-split and fused kernels): every query block of every
  query head of the GQA group that may see those keys, head-major (all
  blocks [lo, hi) of the group's first head, then the next head's, ...)."""

  kv_head: Any
  batch_idx: Any
  kv_tile: Any  # the CTA's position along the key axis
  k_lo: Any
  q_len: Any
  kv_len: Any
  ranges: "_TileRanges"  # the query blocks [lo, hi) of one head, and the full ones
  group: int

  @classmethod
  def of_this_cta(cls, *, num_keys, block_q, mask, q_len_ref, kv_len_ref, q_seq,
                  kv_valid, group):
    """The CTA at grid position (heads, kv_tiles, batch)."""
    kv_head = lax.axis_index("heads")
    batch_idx = lax.axis_index("batch")
    kv_tile = lax.axis_index("kv_tiles")
    k_lo = kv_tile * num_keys
    q_len, kv_len = sequence_lengths(q_len_ref, kv_len_ref, batch_idx, q_seq, kv_valid)
    ranges = q_tile_ranges(mask, k_lo, k_lo + num_keys, q_len, kv_len, block_q)
    return cls(kv_head, batch_idx, kv_tile, k_lo, q_len, kv_len, ranges, group)

  @property
  def lo(self):
    return self.ranges.lo

  @property
  def hi(self):
    return self.ranges.hi

  @property
  def blocks_per_head(self):
    return self.hi - self.lo

  @property
  def num_steps(self):
    return self.group * self.blocks_per_head

  def rows_of(self, step):
    """(query head, query block) of `step`."""
    return (self.kv_head * self.group + lax.div(step, self.blocks_per_head),
            self.lo + lax.rem(step, self.blocks_per_head))


def _probabilities(s, lse2, *, q_lo, k_lo, keys_along_rows: bool, kv_len, mask: MaskSpec,
                   c: float, masked: bool):
  """P = exp2(c * S - lse2) of one tile (S^T when `keys_along_rows`, as in the
  kernels that own keys; S in the dQ kernel), 0 where the mask or the key
  length hides an element; `masked=False` for tiles known to be fully visible.
  `lse2=None`: s already holds S - lse2 / c."""
  if lse2 is None:  # already in s (`fold_stats`)
    logits2 = s * c
  else:
    logits2 = s * c - lax.broadcast_in_dim(lse2, s.shape, [1 if keys_along_rows else 0])
  if masked:
    iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, s.shape, layout=plgpu.Layout.WGMMA)
    row_lo, col_lo = (k_lo, q_lo) if keys_along_rows else (q_lo, k_lo)
    rows, cols = row_lo + iota(0), col_lo + iota(1)
    k_idx, q_idx = (rows, cols) if keys_along_rows else (cols, rows)
    visible = mask.visible(q_idx, k_idx) & (k_idx < kv_len)
    logits2 = jnp.where(visible, logits2, -jnp.inf)
  return jnp.exp2(logits2)


def _mma(a, b, shape):
  """a @ b in fp32 (both in SMEM)."""

  def body(ref):
    plgpu.wgmma(ref, a, b)
    return ref[...]

  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def _load_operand(tile):
  """An SMEM tile in registers, laid out as a wgmma A operand."""
  return plgpu.load(tile, layout=plgpu.Layout.WGMMA)


def _mma_pair(a0, b0, a1, b1, shape):
  """(a0 @ b0, a1 @ b1) in fp32, both wgmmas issued before one wait."""

  def body(refs):
    r0, r1 = refs
    plgpu.wgmma(r0, a0, b0)
    plgpu.wgmma(r1, a1, b1)
    return r0[...], r1[...]

  acc = plgpu.ACC(shape, jnp.float32)
  return pl.run_scoped(body, (acc, acc))


def _mma_accumulate(acc, a, b_smem, staging):
  """acc + a @ b_smem with `a` (a 16-bit array in registers).

  On hardware wgmma reads `a` from registers and accumulates in place. The
  interpreter rejects register A operands and `run_state`: there `a` goes
  through the SMEM `staging` buffer into a fresh accumulator.
  """
  if is_interpreting():
    staging[...] = a
    plgpu.commit_smem()

    def body(ref):
      plgpu.wgmma(ref, staging, b_smem)
      return ref[...]

    return acc + pl.run_scoped(body, plgpu.ACC(acc.shape, jnp.float32))

  def body(ref):
    plgpu.wgmma(ref, a, b_smem)

  return pl.run_state(body)(plgpu.ACC.init(acc))


def _mma_accumulate_pair(acc0, a0, b0, acc1, a1, b1):
  """(acc0 + a0 @ b0, acc1 + a1 @ b1), both wgmmas issued before one wait.

  In place on hardware, where `a0` and `a1` may also be 16-bit arrays in
  registers; the interpreter (no `run_state`) adds fresh products, from SMEM.
  """
  if is_interpreting():
    def fresh(refs):
      plgpu.wgmma(refs[0], a0, b0)
      plgpu.wgmma(refs[1], a1, b1)
      return refs[0][...], refs[1][...]

    d0, d1 = pl.run_scoped(fresh, (plgpu.ACC(acc0.shape, jnp.float32),
                                   plgpu.ACC(acc1.shape, jnp.float32)))
    return acc0 + d0, acc1 + d1

  def in_place(refs):
    plgpu.wgmma(refs[0], a0, b0)
    plgpu.wgmma(refs[1], a1, b1)

  return pl.run_state(in_place)((plgpu.ACC.init(acc0), plgpu.ACC.init(acc1)))


def _stats_of_slot(lse_ring, delta_ring, slot):
  """`load_stats` for `_transposed_scores`: (lse2, delta) of a ring slot as
  vectors along S^T's columns; delta None without a delta ring (dV pass)."""
  col_layout = plgpu.Layout.WGMMA.reduce(0)

  def load_stats():
    lse2 = plgpu.load(lse_ring.at[slot], layout=col_layout)
    return lse2, (None if delta_ring is None else
                  plgpu.load(delta_ring.at[slot], layout=col_layout))

  return load_stats


def _transposed_scores(k_operand, v_operand, q_tile, do_tile, load_stats, *, c: float,
                       fold_stats: bool, stats_first: bool):
  """S^T = K Q^T and, given `v_operand`, dP^T = V dO^T of one step of a
  kernel that owns keys ([keys, queries] tiles), with the statistics the
  softmax needs: (s, dp, lse2, delta), delta broadcast along the keys.

  `load_stats()` returns (lse2, delta or None) from SMEM; `stats_first`
  calls it before waiting for the wgmmas. With `fold_stats` (where there is
  a dP^T and c != 0, so -lse2 / c exists) the wgmmas start from -lse2 / c
  and -delta, so s holds S^T - lse2 / c and dp holds dP^T - delta, and
  lse2 = delta = None.
  """
  bk, bq = k_operand.shape[0], q_tile.shape[0]
  along_keys = lambda x: lax.broadcast_in_dim(x, (bk, bq), [1])
  q_t, do_t = q_tile.transpose((1, 0)), do_tile.transpose((1, 0))
  if fold_stats and v_operand is not None and c != 0:
    lse2, delta = load_stats()
    s, dp = _mma_accumulate_pair(along_keys(lse2 * (-1.0 / c)), k_operand, q_t,
                                 along_keys(-delta), v_operand, do_t)
    return s, dp, None, None
  stats = load_stats() if stats_first else None
  if v_operand is None:
    s, dp = _mma(k_operand, q_t, (bk, bq)), None
  else:
    s, dp = _mma_pair(k_operand, q_t, v_operand, do_t, (bk, bq))
  lse2, delta = stats or load_stats()
  return s, dp, lse2, (None if delta is None else along_keys(delta))


def _row_delta(o_tile, do_tile, lse2):
  """delta = rowsum(dO * O) in float32 of one tile of rows, 0 on rows whose
  lse2 is +inf: they contribute nothing, and their O and dO may hold
  anything (0 * inf would otherwise reach dS)."""
  load = functools.partial(plgpu.load, layout=plgpu.Layout.WGMMA)
  delta = jnp.sum(load(o_tile).astype(jnp.float32) * load(do_tile).astype(jnp.float32), axis=1)
  return jnp.where(lse2 == jnp.inf, 0.0, delta)


def _scores_grad(p, dp, delta):
  """dS = P * (dP - delta) in fp32, of a tile in either orientation (delta
  broadcast to it); `delta=None`: dp already holds dP - delta (`fold_stats`)."""
  return p * dp if delta is None else p * (dp - delta)


def _dk_dv_update(dk, dv, p, dp, delta, q_tile, do_tile, staging, with_ds=None):
  """dV += P^T dO and dK += dS^T Q with dS^T = P^T * (dP^T - delta)
  (`delta=None`: dp already holds dP^T - delta).

  On hardware the dV wgmma is issued first and dS is computed while it runs;
  one wait covers both. (Here `p` is P^T: keys along rows.) `with_ds(ds)`,
  if given, receives dS^T in the input dtype while the dV wgmma runs.
  """
  dtype = q_tile.dtype
  if is_interpreting():
    dv = _mma_accumulate(dv, p.astype(dtype), do_tile, staging)
    ds = _scores_grad(p, dp, delta).astype(dtype)
    if with_ds is not None:
      with_ds(ds)
    return _mma_accumulate(dk, ds, q_tile, staging), dv

  def body(refs):
    dk_ref, dv_ref = refs
    plgpu.wgmma(dv_ref, p.astype(dtype), do_tile)
    ds = _scores_grad(p, dp, delta).astype(dtype)
    if with_ds is not None:
      with_ds(ds)
    plgpu.wgmma(dk_ref, ds, q_tile)

  return pl.run_state(body)((plgpu.ACC.init(dk), plgpu.ACC.init(dv)))


def _zeros(shape):
  return plgpu.layout_cast(jnp.full(shape, 0.0, jnp.float32), plgpu.Layout.WGMMA)


# --- dK / dV -------------------------------------------------------------------


def _build_dkv_kernel(*, batch, q_seq, kv_seq, kv_valid, num_q_heads, num_kv_heads,
                      head_dim, dtype, scale, mask, config, has_q_lengths,
                      has_kv_lengths, outputs=("dk", "dv"), chain=NO_CHAIN):
  """The dK/dV kernel; `outputs` names the gradients this pass accumulates.

  A pass without dK needs neither V (for dP) nor delta: they are not loaded.
  """
  cfg = config
  bk, bq, nc = cfg.block_kv, cfg.block_q, cfg.num_consumers
  group = num_q_heads // num_kv_heads
  num_kv_tiles = cdiv(kv_seq, nc * bk)
  c = scale * LOG2_E
  interpreting = is_interpreting()
  with_dk, with_dv = "dk" in outputs, "dv" in outputs
  num_resident = 2 if with_dk else 1  # K (and V)
  num_streamed = 4 if with_dk else 3  # Q, dO, lse (and delta)
  grid = dict(heads=num_kv_heads, kv_tiles=num_kv_tiles, batch=batch)

  def kernel(*refs):
    chain.at_start()
    refs = list(refs)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    del refs[:6]
    q_len_ref = refs.pop(0) if has_q_lengths else None
    kv_len_ref = refs.pop(0) if has_kv_lengths else None
    *grad_refs, smem, barrier_refs = refs
    smem = iter(smem)
    k_smem = next(smem)
    v_smem = next(smem) if with_dk else None
    q_ring, do_ring, lse_ring = next(smem), next(smem), next(smem)
    delta_ring = next(smem) if with_dk else None
    staging = list(smem)
    bars = BackwardBarriers.from_refs(barrier_refs, nc, cfg.num_stages, num_streamed)

    work = _KeyTileWork.of_this_cta(
        num_keys=nc * bk, block_q=bq, mask=mask, q_len_ref=q_len_ref, kv_len_ref=kv_len_ref,
        q_seq=q_seq, kv_valid=kv_valid, group=group)
    kv_head, batch_idx, cta_k_lo = work.kv_head, work.batch_idx, work.k_lo
    q_len, kv_len, lo, hi = work.q_len, work.kv_len, work.lo, work.hi
    blocks_per_head, num_steps = work.blocks_per_head, work.num_steps
    wg = lax.axis_index("wg")

    @pl.when(wg == nc)
    def _producer():
      plgpu.set_max_registers(cfg.producer_registers, action="decrease")
      for i in range(nc):
        keys = (batch_idx, pl.ds(cta_k_lo + i * bk, bk), kv_head)
        resident = [(k_ref.at[keys], k_smem.at[i])]
        if with_dk:
          resident.append((v_ref.at[keys], v_smem.at[i]))
        bars.producer_fill_resident(resident, i)

      @pl.loop(0, num_steps)
      def _(step):
        head, qb = work.rows_of(step)
        rows = (batch_idx, pl.ds(qb * bq, bq), head)
        stats = (batch_idx, head, pl.ds(qb * bq, bq))
        streamed = [(q_ref.at[rows], q_ring), (do_ref.at[rows], do_ring),
                    (lse_ref.at[stats], lse_ring)]
        if with_dk:
          streamed.append((delta_ref.at[stats], delta_ring))
        bars.stream.producer_acquire(step)
        bars.stream.producer_fill(streamed, step)

      bars.stream.producer_drain(num_steps)

    @pl.when(wg < nc)
    def _consumer():
      plgpu.set_max_registers(cfg.consumer_registers, action="increase")
      k_lo = cta_k_lo + wg * bk
      own = _own_ranges(q_tile_ranges(mask, k_lo, k_lo + bk, q_len, kv_len, bq), lo, hi)
      k_tile = k_smem.at[wg]
      v_tile = v_smem.at[wg] if with_dk else None
      stage = staging[0].at[wg] if interpreting else None
      bars.resident.consumer_wait(0, wg)
      k_operand, v_operand = k_tile, v_tile  # the A operands of S^T and dP^T
      if cfg.operands_in_registers and not interpreting:
        k_operand = _load_operand(k_tile)
        v_operand = _load_operand(v_tile) if with_dk else None

      def step_fn(qb, acc, *, masked, head_step0):
        acc = dict(acc)
        step = head_step0 + (qb - lo)
        slot = bars.stream.slot(step)
        q_tile, do_tile = q_ring.at[slot], do_ring.at[slot]
        bars.stream.consumer_wait(step)

        s, dp, lse2, delta = _transposed_scores(  # delta: only a pass with dK has it
            k_operand, v_operand, q_tile, do_tile, _stats_of_slot(lse_ring, delta_ring, slot),
            c=c, fold_stats=cfg.fold_stats, stats_first=cfg.stats_first)
        p = _probabilities(s, lse2, q_lo=qb * bq, k_lo=k_lo, keys_along_rows=True,
                           kv_len=kv_len, mask=mask, c=c, masked=masked)
        if with_dk and with_dv:
          acc["dk"], acc["dv"] = _dk_dv_update(acc["dk"], acc["dv"], p, dp, delta,
                                               q_tile, do_tile, stage)
        elif with_dk:
          acc["dk"] = _mma_accumulate(acc["dk"], _scores_grad(p, dp, delta).astype(dtype),
                                      q_tile, stage)
        else:
          acc["dv"] = _mma_accumulate(acc["dv"], p.astype(dtype), do_tile, stage)
        bars.stream.consumer_release(step)
        return acc

      def skip_fn(qb, acc, *, head_step0):
        step = head_step0 + (qb - lo)
        bars.stream.consumer_wait(step)
        bars.stream.consumer_release(step)
        return acc

      def one_head(g, acc):
        head_step0 = g * blocks_per_head
        return _walk(lo, hi, own,
                     functools.partial(step_fn, head_step0=head_step0),
                     functools.partial(skip_fn, head_step0=head_step0), acc)

      acc = lax.fori_loop(0, group, one_head, {g: _zeros((bk, head_dim)) for g in outputs})

      # Epilogue: every wgmma reading K and V has completed, so their tiles
      # hold the results on the way out (dV uses the K tile when V is absent).
      out_tiles = {"dk": k_tile, "dv": v_tile if with_dk else k_tile}
      for g in outputs:
        out_tiles[g][...] = (acc[g] * scale if g == "dk" else acc[g]).astype(dtype)
      plgpu.commit_smem()
      keys = (batch_idx, pl.ds(k_lo, bk), kv_head)
      for g, grad_ref in zip(outputs, grad_refs):
        plgpu.copy_smem_to_gmem(out_tiles[g], grad_ref.at[keys])
      plgpu.wait_smem_to_gmem(0)

    chain.at_exit(grid)

  swizzle = _swizzle_bytes(dtype, bk, bq)
  resident_tile = _smem_tile((nc, bk, head_dim), dtype, swizzle)
  ring_tile = _smem_tile((cfg.num_stages, bq, head_dim), dtype, swizzle)
  ring_stats = plgpu.SMEM((cfg.num_stages, bq), jnp.float32)
  smem = [resident_tile]  # K tiles, then dK (or dV)
  if with_dk:
    smem.append(resident_tile)  # V tiles, then dV
  smem += [ring_tile, ring_tile, ring_stats]  # Q, dO, lse2 rings
  if with_dk:
    smem.append(ring_stats)  # delta ring
  if interpreting:
    smem.append(_smem_tile((nc, bk, bq), dtype, swizzle))  # P^T / dS^T staging
  out_type = tuple(jax.ShapeDtypeStruct((batch, kv_seq, num_kv_heads, head_dim), dtype)
                   for _ in outputs)
  return plgpu.kernel(
      kernel,
      out_type=out_type,
      scratch_types=(tuple(smem), BackwardBarriers.scratch_types(
          nc, cfg.num_stages, num_resident, num_streamed)),
      grid=tuple(grid.values()),
      grid_names=tuple(grid),
      num_threads=nc + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )


def _build_dkv_head_split_kernel(*, batch, q_seq, kv_seq, kv_valid, num_q_heads,
                                 num_kv_heads, head_dim, dtype, scale, mask, config,
                                 has_q_lengths, has_kv_lengths, chain=NO_CHAIN):
  """dK and dV where they do not fit one warpgroup's registers (head dim 256).

  A CTA owns `block_kv` keys, and consumer warpgroup h owns columns
  [h * d/2, (h + 1) * d/2) of their dK and dV: d/2 fp32 registers per thread,
  like dK + dV at head dim 128. Every column needs the whole P^T and dS^T of a
  step. Warpgroup 0 computes them (in fp32, as the fused kernel does) and
  hands them to warpgroup 1 through a double-buffered SMEM ring:

    warpgroup 0: S^T = K Q^T, dP^T = V dO^T, P^T, dS^T -> pds ring
                 dV_0 += P^T dO_0,  dK_0 += dS^T Q_0
    warpgroup 1: dV_1 += P^T dO_1,  dK_1 += dS^T Q_1   (from the ring)

  Four tile GEMMs per query block (S^T, dP^T, dV, dK) as in the fused
  kernel, where two passes of `_build_dkv_kernel` run five. Warpgroup 1's GEMMs of step n run on
  the tensor core while warpgroup 0 computes the softmax of step n + 1.

  Barriers (every wait is matched by the arrive in the same row):

  | barrier              | arrives (count)                          | waits                     |
  |----------------------|------------------------------------------|---------------------------|
  | resident.full[0]     | producer TMAs of K and V (2)             | both consumers, once      |
  | stream.full[slot]    | producer TMAs of Q, dO, lse2, delta (4)  | both consumers, each step |
  | stream.consumed[slot]| each consumer after its dK/dV GEMMs (2)  | producer, before refill   |
  | pds.full[slot]       | warpgroup 0 after storing P^T, dS^T (1)  | warpgroup 1               |
  | pds.consumed[slot]   | each consumer after its dK/dV GEMMs (2)  | warpgroup 0, before it    |
  |                      |                                          | rewrites the slot         |
  | epilogue             | each consumer after writing its halves   | both consumers; then one  |
  |                      | of dK and dV into the K and V tiles (2)  | TMA-stores dK, the other dV|

  Epilogue: dK_h and dV_h go into column halves of the K and V tiles (TMA
  wants contiguous SMEM, so whole tiles go out after the rendezvous). Only
  warpgroup 0 reads K and V, and its last reads completed before it published
  the last pds slot that warpgroup 1 waited for; both wait for K and V to have
  landed, so a CTA with no work cannot race their TMA.
  """
  cfg = config
  bk, bq = cfg.block_kv, cfg.block_q
  half = head_dim // 2
  group = num_q_heads // num_kv_heads
  c = scale * LOG2_E
  grid = dict(heads=num_kv_heads, kv_tiles=cdiv(kv_seq, bk), batch=batch)

  def kernel(*refs):
    chain.at_start()
    refs = list(refs)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    del refs[:6]
    q_len_ref = refs.pop(0) if has_q_lengths else None
    kv_len_ref = refs.pop(0) if has_kv_lengths else None
    dk_ref, dv_ref, smem, barrier_refs = refs
    k_tile, v_tile, q_ring, do_ring, lse_ring, delta_ring, p_smem, ds_smem = smem
    (resident_full, stream_full, stream_consumed,
     pds_full, pds_consumed, epilogue_barrier) = barrier_refs
    resident = OneShotBuffer(resident_full)
    stream = BundleRing(SlotRing(stream_full, stream_consumed, cfg.num_stages, 2), 4)
    pds = SlotRing(pds_full, pds_consumed, 2, 2)
    epilogue = Rendezvous(epilogue_barrier, 2)

    work = _KeyTileWork.of_this_cta(
        num_keys=bk, block_q=bq, mask=mask, q_len_ref=q_len_ref, kv_len_ref=kv_len_ref,
        q_seq=q_seq, kv_valid=kv_valid, group=group)
    kv_head, batch_idx, k_lo = work.kv_head, work.batch_idx, work.k_lo
    kv_len, lo, hi = work.kv_len, work.lo, work.hi
    blocks_per_head, num_steps = work.blocks_per_head, work.num_steps
    blocks = work.ranges  # one consumer tile: the CTA's ranges are its own
    keys = (batch_idx, pl.ds(k_lo, bk), kv_head)
    wg = lax.axis_index("wg")

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(cfg.producer_registers, action="decrease")
      plgpu.copy_gmem_to_smem(k_ref.at[keys], k_tile, resident.full.at[0])
      plgpu.copy_gmem_to_smem(v_ref.at[keys], v_tile, resident.full.at[0])

      @pl.loop(0, num_steps)
      def _(step):
        head, qb = work.rows_of(step)
        rows = (batch_idx, pl.ds(qb * bq, bq), head)
        stats = (batch_idx, head, pl.ds(qb * bq, bq))
        stream.producer_acquire(step)
        stream.producer_fill(
            [(q_ref.at[rows], q_ring), (do_ref.at[rows], do_ring),
             (lse_ref.at[stats], lse_ring), (delta_ref.at[stats], delta_ring)], step)

      stream.producer_drain(num_steps)

    def consumer(h: int):
      cols = pl.ds(h * half, half)

      def step_fn(qb, acc, *, masked, head_step0):
        step = head_step0 + (qb - lo)
        slot = stream.slot(step)
        q_tile, do_tile = q_ring.at[slot], do_ring.at[slot]
        p_tile, ds_tile = p_smem.at[pds.slot(step)], ds_smem.at[pds.slot(step)]
        stream.consumer_wait(step)
        if h == 0:
          s, dp, lse2, delta = _transposed_scores(
              k_tile, v_tile, q_tile, do_tile, _stats_of_slot(lse_ring, delta_ring, slot),
              c=c, fold_stats=False, stats_first=False)
          p = _probabilities(s, lse2, q_lo=qb * bq, k_lo=k_lo, keys_along_rows=True,
                             kv_len=kv_len, mask=mask, c=c, masked=masked)
          ds = _scores_grad(p, dp, delta)
          pds.producer_acquire(step)
          p_tile[...] = p.astype(dtype)
          ds_tile[...] = ds.astype(dtype)
          pds.producer_publish(step)
        else:
          pds.consumer_wait(step)
        dk, dv = _mma_accumulate_pair(acc[0], ds_tile, q_tile.at[:, cols],
                                      acc[1], p_tile, do_tile.at[:, cols])
        stream.consumer_release(step)
        pds.consumer_release(step)
        return dk, dv

      def one_head(g, acc):
        head_step0 = g * blocks_per_head
        return _walk(lo, hi, blocks, functools.partial(step_fn, head_step0=head_step0),
                     lambda qb, acc: acc, acc)

      plgpu.set_max_registers(cfg.consumer_registers, action="increase")
      resident.consumer_wait(0, 0)
      dk, dv = lax.fori_loop(0, group, one_head,
                             (_zeros((bk, half)), _zeros((bk, half))))
      if h == 0:
        pds.producer_drain(num_steps)

      k_tile.at[:, cols][...] = (dk * scale).astype(dtype)
      v_tile.at[:, cols][...] = dv.astype(dtype)
      plgpu.commit_smem()
      epilogue.sync()
      out_tile, out_ref = (k_tile, dk_ref) if h == 0 else (v_tile, dv_ref)
      plgpu.copy_smem_to_gmem(out_tile, out_ref.at[keys])
      plgpu.wait_smem_to_gmem(0)

    pl.when(wg == 0)(lambda: consumer(0))
    pl.when(wg == 1)(lambda: consumer(1))
    chain.at_exit(grid)

  swizzle = _swizzle_bytes(dtype, bk, bq)
  ring_stats = plgpu.SMEM((cfg.num_stages, bq), jnp.float32)
  smem = (
      _smem_tile((bk, head_dim), dtype, swizzle),  # K tile, then dK
      _smem_tile((bk, head_dim), dtype, swizzle),  # V tile, then dV
      _smem_tile((cfg.num_stages, bq, head_dim), dtype, swizzle),  # Q ring
      _smem_tile((cfg.num_stages, bq, head_dim), dtype, swizzle),  # dO ring
      ring_stats, ring_stats,  # lse2 and delta rings
      _smem_tile((2, bk, bq), dtype, swizzle),  # pds ring: P^T
      _smem_tile((2, bk, bq), dtype, swizzle),  # pds ring: dS^T
  )
  barriers = (
      plgpu.Barrier(num_arrivals=2, num_barriers=1),  # resident: K and V
      *BundleRing.barrier_types(cfg.num_stages, 2, 4),
      *SlotRing.barrier_types(2, 2),  # pds
      Rendezvous.barrier_type(2),  # epilogue
  )
  out_type = (jax.ShapeDtypeStruct((batch, kv_seq, num_kv_heads, head_dim), dtype),) * 2
  return plgpu.kernel(
      kernel,
      out_type=out_type,
      scratch_types=(smem, barriers),
      grid=tuple(grid.values()),
      grid_names=tuple(grid),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )


# --- dQ ------------------------------------------------------------------------


def _build_dq_kernel(*, batch, q_seq, kv_seq, kv_valid, num_q_heads, num_kv_heads,
                     head_dim, dtype, scale, mask, config, has_q_lengths,
                     has_kv_lengths, chain=NO_CHAIN):
  cfg = config
  bq, bk, nc = cfg.dq_block_q, cfg.dq_block_kv, cfg.dq_num_consumers
  group = num_q_heads // num_kv_heads
  num_q_tiles = cdiv(q_seq, nc * bq)
  grid = dict(heads=num_q_heads, q_tiles=num_q_tiles, batch=batch)
  c = scale * LOG2_E
  # Heavy tiles first: with a right bound (causal), later rows see more keys.
  heavy_last = mask.right is not None and mask.left is None
  interpreting = is_interpreting()
  # With `delta_in_dq` the sixth input is O (not delta) and delta an output.
  with_delta = cfg.delta_in_dq

  def kernel(*refs):
    chain.at_start()
    refs = list(refs)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_or_o_ref = refs[:6]
    del refs[:6]
    q_len_ref = refs.pop(0) if has_q_lengths else None
    kv_len_ref = refs.pop(0) if has_kv_lengths else None
    dq_ref, *delta_out, smem, barrier_refs = refs
    q_smem, do_smem, lse_smem, delta_smem, k_ring, v_ring, *staging = smem
    o_smem = staging.pop(0) if with_delta else None
    bars = BackwardBarriers.from_refs(barrier_refs, nc, cfg.dq_num_stages, 2)

    head = lax.axis_index("heads")
    batch_idx = lax.axis_index("batch")
    tile = lax.axis_index("q_tiles")
    if heavy_last:
      tile = num_q_tiles - 1 - tile
    kv_head = lax.div(head, jnp.int32(group))
    q_len, kv_len = sequence_lengths(q_len_ref, kv_len_ref, batch_idx, q_seq, kv_valid)

    cta_q_lo = tile * (nc * bq)
    cta = kv_tile_ranges(mask, cta_q_lo, cta_q_lo + nc * bq, q_len, kv_len, bk)
    lo, hi = cta.lo, cta.hi
    wg = lax.axis_index("wg")

    @pl.when(wg == nc)
    def _producer():
      plgpu.set_max_registers(cfg.dq_producer_registers, action="decrease")
      for i in range(nc):
        rows = (batch_idx, pl.ds(cta_q_lo + i * bq, bq), head)
        stats = (batch_idx, head, pl.ds(cta_q_lo + i * bq, bq))
        fourth = ((delta_or_o_ref.at[rows], o_smem.at[i]) if with_delta
                  else (delta_or_o_ref.at[stats], delta_smem.at[i]))
        bars.producer_fill_resident(
            [(q_ref.at[rows], q_smem.at[i]), (do_ref.at[rows], do_smem.at[i]),
             (lse_ref.at[stats], lse_smem.at[i]), fourth], i)

      @pl.loop(lo, hi)
      def _(j):
        step = j - lo
        keys = (batch_idx, pl.ds(j * bk, bk), kv_head)
        bars.stream.producer_acquire(step)
        bars.stream.producer_fill([(k_ref.at[keys], k_ring), (v_ref.at[keys], v_ring)], step)

      bars.stream.producer_drain(hi - lo)

    @pl.when(wg < nc)
    def _consumer():
      plgpu.set_max_registers(cfg.dq_consumer_registers, action="increase")
      q_lo = cta_q_lo + wg * bq
      own = _own_ranges(kv_tile_ranges(mask, q_lo, q_lo + bq, q_len, kv_len, bk), lo, hi)
      q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
      row_layout = plgpu.Layout.WGMMA.reduce(1)  # a vector along S's rows
      stage = staging[0].at[wg] if interpreting else None

      bars.resident.consumer_wait(0, wg)
      q_operand, do_operand = q_tile, do_tile  # the A operands of S and dP
      if cfg.dq_operands_in_registers and not interpreting:
        q_operand, do_operand = _load_operand(q_tile), _load_operand(do_tile)
      lse2 = plgpu.load(lse_smem.at[wg], layout=row_layout)
      if with_delta:
        # delta of this consumer's rows, for itself and (through GMEM) for
        # the dK/dV kernel, which runs after this one.
        delta = _row_delta(o_smem.at[wg], do_tile, lse2)
        delta_smem.at[wg][...] = delta
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(delta_smem.at[wg],
                                delta_out[0].at[batch_idx, head, pl.ds(q_lo, bq)])
      else:
        delta = plgpu.load(delta_smem.at[wg], layout=row_layout)

      def step_fn(j, dq, *, masked):
        step = j - lo
        slot = bars.stream.slot(step)
        k_tile, v_tile = k_ring.at[slot], v_ring.at[slot]
        bars.stream.consumer_wait(step)
        s, dp = _mma_pair(q_operand, k_tile.transpose((1, 0)),
                          do_operand, v_tile.transpose((1, 0)), (bq, bk))
        p = _probabilities(s, lse2, q_lo=q_lo, k_lo=j * bk, keys_along_rows=False,
                           kv_len=kv_len, mask=mask, c=c, masked=masked)
        ds = _scores_grad(p, dp, lax.broadcast_in_dim(delta, s.shape, [0]))
        dq = _mma_accumulate(dq, ds.astype(dtype), k_tile, stage)
        bars.stream.consumer_release(step)
        return dq

      def skip_fn(j, dq):
        bars.stream.consumer_wait(j - lo)
        bars.stream.consumer_release(j - lo)
        return dq

      dq = _walk(lo, hi, own, step_fn, skip_fn, _zeros((bq, head_dim)))
      q_tile[...] = (dq * scale).astype(dtype)  # every wgmma reading Q has completed
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[batch_idx, pl.ds(q_lo, bq), head])
      plgpu.wait_smem_to_gmem(0)

    chain.at_exit(grid)

  swizzle = _swizzle_bytes(dtype, bq, bk)
  smem = [
      _smem_tile((nc, bq, head_dim), dtype, swizzle),  # Q tiles, then dQ
      _smem_tile((nc, bq, head_dim), dtype, swizzle),  # dO tiles
      plgpu.SMEM((nc, bq), jnp.float32),  # lse2
      plgpu.SMEM((nc, bq), jnp.float32),  # delta
      _smem_tile((cfg.dq_num_stages, bk, head_dim), dtype, swizzle),  # K ring
      _smem_tile((cfg.dq_num_stages, bk, head_dim), dtype, swizzle),  # V ring
  ]
  out_type = jax.ShapeDtypeStruct((batch, q_seq, num_q_heads, head_dim), dtype)
  if with_delta:
    smem.append(_smem_tile((nc, bq, head_dim), dtype, swizzle))  # O tiles
    # Every row of every CTA's tiles is written (0 past the query length), so
    # the dK/dV kernel's blocks, which divide a CTA's rows, read only written rows.
    delta_type = jax.ShapeDtypeStruct((batch, num_q_heads, num_q_tiles * nc * bq), jnp.float32)
    out_type = (out_type, delta_type)
  if interpreting:
    smem.append(_smem_tile((nc, bq, bk), dtype, swizzle))  # dS staging
  return plgpu.kernel(
      kernel,
      out_type=out_type,
      scratch_types=(tuple(smem), BackwardBarriers.scratch_types(nc, cfg.dq_num_stages, 4, 2)),
      grid=tuple(grid.values()),
      grid_names=tuple(grid),
      num_threads=nc + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )


# --- entry point -----------------------------------------------------------------


def _preprocess(out, lse, dout, q_lengths, q_pad: int, *, with_delta: bool = True):
  """(lse2, delta), float32 [B, N, q_pad rounded up to STATS_ALIGN].

  delta = rowsum(dO * O) (None when not `with_delta`: the dQ kernel computes
  it). lse2 = lse * log2(e), or +inf where the row must not contribute (past
  its query length, sees no key, or padding), so that the kernels'
  exp2(c * s - lse2) is exactly 0 there.
  """
  t = lse.shape[-1]  # lse: [B, N, Tq]
  live = lse > -jnp.inf
  if q_lengths is not None:
    live = live & (jnp.arange(t)[None, None, :] < q_lengths.astype(jnp.int32)[:, None, None])
  lse2 = jnp.where(live, lse * LOG2_E, jnp.inf)
  padded = cdiv(q_pad, STATS_ALIGN) * STATS_ALIGN
  pad = [(0, 0), (0, 0), (0, padded - t)]
  lse2 = jnp.pad(lse2, pad, constant_values=jnp.inf)
  if not with_delta:
    return lse2, None
  delta = jnp.einsum("btnd,btnd->bnt", dout.astype(jnp.float32), out.astype(jnp.float32))
  return lse2, jnp.pad(jnp.where(live, delta, 0.0), pad)


def backward(q, k, v, out, lse, dout, q_lengths, kv_lengths, *, scale: float,
             mask: MaskSpec, config: BackwardConfig | None = None):
  """Gradients (dq, dk, dv) of attention. See `fa4_jax.kernels` for the contract.

  q, out, dout: [B, Tq, Nq, D]; k, v: [B, Tk, Nkv, D]; lse: f32 [B, Nq, Tq].
  dk and dv are summed over the query heads of each GQA group.
  """
  check_supported(q.shape, k.shape, q.dtype, mask)
  if v.shape != k.shape:
    raise KernelUnsupported(f"v must have k's shape {k.shape}; got {v.shape}")
  if k.dtype != q.dtype or v.dtype != q.dtype:
    raise KernelUnsupported(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
  batch, q_seq, num_q_heads, head_dim = q.shape
  _, kv_seq, num_kv_heads, _ = k.shape
  dtype = q.dtype
  dout = dout.astype(dtype)
  # TMA tiles (sequence, head_dim) by (8, 64): pad sequences to multiples of 8
  # and head dims to multiples of 64 (a copy only for unaligned shapes).
  d = padded_head_dim(head_dim)
  q_pad, kv_pad = cdiv(q_seq, 8) * 8, cdiv(kv_seq, 8) * 8
  config = config or choose_config(d, mask, num_q_heads // num_kv_heads)
  lse2, delta = _preprocess(out, lse, dout, q_lengths, q_pad, with_delta=not config.delta_in_dq)

  def pad(x, t_pad):
    if d == head_dim and t_pad == x.shape[1]:
      return x
    return jnp.pad(x, [(0, 0), (0, t_pad - x.shape[1]), (0, 0), (0, d - head_dim)])

  q, dout = pad(q, q_pad), pad(dout, q_pad)
  k, v = pad(k, kv_pad), pad(v, kv_pad)
  common = dict(
      batch=batch, q_seq=q_pad, kv_seq=kv_pad, kv_valid=kv_seq,
      num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=d,
      dtype=dtype, scale=float(scale), mask=mask, config=config,
      has_q_lengths=q_lengths is not None, has_kv_lengths=kv_lengths is not None)
  lengths = []
  if q_lengths is not None:
    lengths.append(jnp.asarray(q_lengths, jnp.int32))
  if kv_lengths is not None:
    lengths.append(jnp.asarray(kv_lengths, jnp.int32))
  if config.delta_in_dq:  # the dQ kernel first: it computes delta for both
    o = pad(out.astype(dtype), q_pad)
    dq, delta = _build_dq_kernel(**common)(q, k, v, dout, lse2, o, *lengths)
  args = [q, k, v, dout, lse2, delta, *lengths]
  # With `overlap_kernels` (the dQ kernel last) each
  # kernel below launches while the one before it finishes: the dK/dV
  # kernel, or the dK and the dV pass, release the next; all but the first
  # follow the previous one.
  overlap = config.overlap_kernels
  first_dkv = LaunchChain(releases_next=overlap)
  second_dkv = LaunchChain(releases_next=overlap, follows_previous=overlap)
  last_dq = LaunchChain(follows_previous=overlap)
  if config.dk_dv == "fused":
    dk, dv = _build_dkv_kernel(**common, outputs=("dk", "dv"), chain=first_dkv)(*args)
  elif config.dk_dv == "head_dim_split":
    dk, dv = _build_dkv_head_split_kernel(**common, chain=first_dkv)(*args)
  else:
    (dk,) = _build_dkv_kernel(**common, outputs=("dk",), chain=first_dkv)(*args)
    (dv,) = _build_dkv_kernel(**common, outputs=("dv",), chain=second_dkv)(*args)
  if not config.delta_in_dq:
    dq = _build_dq_kernel(**common, chain=last_dq)(*args)
  if d != head_dim or q_pad != q_seq:
    dq = dq[:, :q_seq, :, :head_dim]
  if d != head_dim or kv_pad != kv_seq:
    dk, dv = dk[:, :kv_seq, :, :head_dim], dv[:, :kv_seq, :, :head_dim]
  return dq, dk, dv
