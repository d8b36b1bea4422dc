"""Attention backward for Hopper (sm_90) in Pallas Mosaic GPU.

The backward recomputes the probabilities from Q, K and the forward's
log-sum-exp instead of storing them:

    P  = exp(scale * Q K^T - lse)        dP = dO V^T
    dS = P * (dP - delta),  delta = rowsum(dO * O)
    dQ = scale * dS K       dK = scale * dS^T Q       dV = P^T dO

Three steps, every gradient written by exactly one CTA (deterministic, no
atomics):

1. `backward_inputs.preprocess` (plain XLA): the lse converted to log2 units with +inf for
   rows that must not contribute (rows past the query length, rows that saw
   no key), so that P = exp2(c * s - lse2) is exactly 0 there, padded to
   whole blocks. delta too, by one fused reduction over dO and O, unless the
   dQ kernel computes it (`BackwardConfig.delta_in_dq`, the heuristic's
   choice at head dim <= 128 for causal masks without a window): then the
   dQ kernel runs first, and the reduction's 0.05 ms (B2 S8192 H16 D128,
   H100) is saved.
2. the dK/dV kernel (`sm90_backward_dkdv`, configured by `BackwardConfig.dkv`):
   one CTA per (kv head, KV tile of `2 * block_kv` keys, batch). Two consumer
   warpgroups each own `block_kv` keys and keep their dK and dV in registers;
   a producer warpgroup streams (Q, dO, lse, delta) tiles of every query head
   of the GQA group and every query block the mask lets these keys be seen
   by, through a ring of `num_stages` SMEM slots. The group sum of dK/dV
   happens in the accumulators, not in a later pass. Above head dim 128
   dK + dV do not fit one warpgroup: at 256 the consumers share the keys and
   split the head dim (`_build_dkv_head_split_kernel`), at 192 the kernel
   runs once for dK and once for dV (`DkvConfig.dk_dv`).
   V, O, dO and dV may have a head dim of their own, no wider than Q's and
   K's (`check_value_head_dim`; DeepSeek's 192 / 128): the GEMMs with V or
   dO contract over it or are as wide (dP, dV), the others keep the head
   dim, and `choose_config` counts dK + dV registers by the pair.
   Packed causal rows at head dim 64 run it as a persistent grid whose CTAs
   take key tiles from a work queue (`DkvConfig.work_queue`).
3. the dQ kernel (`sm90_backward_dq`, configured by `BackwardConfig.dq`): one
   CTA per (q head, Q tile of `num_consumers * block_q` rows, batch), the
   mirror image: consumers own query rows and their dQ, the producer streams
   (K, V) tiles of the key blocks those rows see. With `delta_in_dq` each
   consumer also loads its rows' O tile, computes their delta before its
   first block and writes it out for the dK/dV kernel.

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
commit `dcef065` and the measurements in docs/performance-notes.md.

`deterministic=False` (opt-in, `fa4_jax.attention(deterministic=False)`):
one kernel after all, at head dim 128 (`sm90_backward_fused_dq`): the dK/dV
kernel's consumers also add dQ, each its half of dQ's columns over both
key halves once both have published their dS^T, in float32, with TMA
reduce-adds into a zeroed buffer that XLA converts afterwards: no int32
conversion, no bounds, and no wait on a reduce-add but before its staging
tile is rewritten. dQ is then summed in arrival order (not bit-reproducible;
dK and dV still are). Five tile GEMMs per step. Where it cannot serve a call
(`sm90_backward_fused_dq.fused_dq_problem`: other head dims, a value head
dim of its own, score_mod / mask_mod) the two kernels run.

This module holds the configuration (`BackwardConfig`; each kernel's own,
`DkvConfig` and `DqConfig`, is in that kernel's module), the heuristic and
the entry point; what the kernels share (block walk, one tile's softmax and
gradient, wgmma helpers) is in `sm90_backward_common`.
Each kernel reads as its roles: a producer, the consumers and their
epilogue, functions that take the kernel's barrier table.

Barrier protocol (each kernel's table, in the form of
`pipeline.BarrierTable`: `sm90_backward_dkdv.DkvBarrierTable`,
`HeadSplitBarrierTable`, `sm90_backward_dq.DqBarrierTable`): per CTA one
"resident" set of operands loaded once per consumer (K/V tiles in dK/dV,
Q/dO/lse/delta in dQ) and one streamed ring whose slot holds several
operands, its full barrier expecting one TMA arrival per operand.

Masks: a consumer walks only the blocks its own rows/keys can touch
(`fa4_jax.scores`: `q_tile_ranges` for dK/dV, `kv_tile_ranges` for dQ,
`TileRanges.within` the CTA's), applies the element mask (`scores.visible`)
only on boundary tiles, and only keeps the barrier protocol going for blocks
of the CTA's range outside its own.

Logit soft-capping (the cap of `score=`, a `scores.ScoreFunction`): both
kernels recompute P from t = tanh(scale * s / cap) with c = cap * log2(e)
and multiply dS by the slope 1 - t^2; `sm90_backward_common.tile_softmax`
asks the score function for them in all of them (what it costs: there).
With `fold_stats` only delta is folded (the tanh needs the raw S^T:
`ScoreFunction.needs_raw_scores`). Measured (H200, B2 S8192, soft-cap against plain,
same process, CUPTI): D128 4.88 -> 5.70 ms dense, 2.51 -> 2.94 causal;
GQA 32/8 10.0 -> 12.5 dense, 4.98 -> 5.72 causal; D64 H32 5.78 -> 8.18
dense, 3.00 -> 4.31 causal (two MUFU ops per element instead of one: at
D64 the MUFU work of a 64 x 64 tile approaches its tensor work); D192
8.96 -> 10.3 / 4.57 -> 4.98; D256 6.04 -> 6.49 / 2.98 -> 3.21. Sinks need
nothing: the lse includes them, and their gradient is an XLA reduction
(`scores.sink_grad`).

Segment ids (packed sequences): `segment_operands` computes, in XLA before
each kernel, the blocks every CTA's tile and every consumer's tile may meet
(`scores.segment_tile_ranges` at that kernel's tiles: keys as rows in dK/dV,
queries in dQ); the kernels intersect them with the ranges above, where the
CTA's range is computed for its producer and consumers alike and where each
consumer's own is. Blocks outside are neither loaded nor computed; blocks of
one shared id need no element mask; masked blocks load the ids of their rows
and columns for `scores.visible`. Rows that see no key have lse -inf, so
lse2 = +inf, P = 0 and delta = 0: their gradients are zeros.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from fa4_jax.kernels import KernelUnsupported, autotune, sm90_tiles
from fa4_jax.kernels.backward_inputs import (check_operands, fine_tile_classes, mod_operands,
                                             preprocess, segment_operands)
from fa4_jax.kernels.pipeline import LaunchChain
from fa4_jax.kernels.schedule import fixed_shares_under_vmap, sm_count
from fa4_jax.kernels.mod_tiles import kernel_score_function
from fa4_jax.kernels.sm90_backward_common import ModStatics
from fa4_jax.kernels.sm90_backward_dkdv import (DkvConfig, _build_dkv_head_split_kernel,
                                                _build_dkv_kernel)
from fa4_jax.kernels.sm90_backward_dq import DqConfig, _build_dq_kernel
from fa4_jax.kernels.sm90_backward_fused_dq import FusedDqConfig, fused_dq_problem
from fa4_jax.kernels import sm90_backward_fused_dq
from fa4_jax.kernels.sm90_tiles import padded_head_dim
from fa4_jax.scores import MaskSpec, ScoreFunction, cdiv, check_query_lengths_for_alignment
from fa4_jax.target import DEFAULT_NUM_SMS

# The optional arguments of `backward` (`fa4_jax.kernels`: the contract).
FEATURES = frozenset({"score_function", "mods", "value_head_dim", "nondeterministic"})

# dK and dV of a 64-key tile take (head_dim + value_head_dim) / 2 fp32
# registers per thread together (64 rows x width x 4 B / 128 threads each);
# beyond this head dim's share (128 + 128, or 192 + 64) they do not fit beside
# S^T and dP^T, so dK and dV are computed by two passes of the dK/dV kernel,
# one accumulator each.
MAX_FUSED_DK_DV_HEAD_DIM = 128

# 192 / 128 (DeepSeek's training head dims, issue #56): the dK/dV kernel's
# config there ("dv_dk_split"): the head-split kernel's CTA of 64 keys and two
# consumers, warpgroup 0 computing S^T, dP^T, P^T and dS^T and keeping dV and
# 64 of dK's columns (64 + 32 + 32 + 32 registers), warpgroup 1 keeping dK's
# other 128 columns from dS^T handed over through SMEM. Four tile GEMMs a
# block, every one at N >= 64 (1152 multiply-adds per score element with the
# dQ kernel's 512, against the two passes' 1344); ptxas (local, B2 S8192
# H16, dense and causal): no spills. Measured on an H100, 2026-12-07
# (`bench_backward.py --only D192/128 --config ...`, one process, one round,
# B2 S8192 H16, TFLOP/s dense / causal): this config 484 / 459; dK wholly on
# warpgroup 1 478 / 456; the fused kernel on 32-row query tiles with lse2
# and delta folded 469 / 460; the two passes (before) 424 / 420, with three
# stages 403 / 413. The losers left the code; the notes keep them
# ("192 / 128: candidates screened on the CPU" and after).
DKV_AT_192_128 = DkvConfig(block_kv=64, block_q=64, num_stages=2, producer_registers=24,
                           consumer_registers=240, dk_dv="dv_dk_split", wg0_dk_columns=64)

# `choose_mods_config`: calls with a score_mod fold delta into the dK/dV
# kernel's dP^T accumulator. A switch for benchmarks (bench_mod_costs.py's
# MOD_COSTS_FOLD_DELTA=0 times the loads before the wait, as before).
FOLD_DELTA_WITH_SCORE_MOD = True
# `choose_mods_config`: calls without a mask_mod keep the plain call's three
# dQ consumers. Off until measured (bench_mod_costs.py's MOD_COSTS_DQ3=1).
THREE_DQ_CONSUMERS_WITHOUT_MASK_MOD = False
# `choose_mods_config`: calls with a mask_mod and no score_mod start the dK/dV
# kernel's S^T and dP^T accumulators at -lse2 / c and -delta (`fold_stats`,
# as plain GQA causal calls do: a mask needs no raw S^T). Local ptxas,
# prefix-LM B2 S4096 H16 D128: dK/dV spills 52 / 56 bytes -> 0 / 0; H100
# (2026-12-07, bench_mod_costs.py --backward, MOD_COSTS_FOLD_MASK=1 / 0):
# dK/dV 0.451-0.456 ms against 0.455-0.464, the gradient 2.532 against 2.547.
FOLD_STATS_WITH_MASK_MOD_ALONE = True
# `choose_mods_config`: calls with a score_mod in the affine form (a fixed
# a, no soft-cap: `mod_tiles.folds_affine`; others ignore it) start the dQ
# kernel's dP accumulator at -delta (`DqConfig.fold_delta`) and, with
# `FOLD_AFFINE_SCORES` and a key term C, the S^T (dK/dV, unmasked steps) and
# S (dQ) accumulators at the form's terms and lse2 (`DkvConfig.fold_affine`,
# `DqConfig.fold_affine`). Switches for benchmarks (bench_mod_costs.py's
# MOD_COSTS_FOLD_AFFINE=0 / delta, rows "<row> no-affine-fold" and
# "<row> delta-only"). Local ptxas / SASS, B2 S4096 H16 D128, instructions
# in the FULL key loops: ALiBi dK/dV 381 -> 379 (its 2 spill loads gone),
# dQ 343 -> 311 (causal 337 -> 303); `s + 0.5` dQ 295 -> 261
# (docs/performance-notes.md, "The affine form in the backward's accumulators").
# H100, 2026-12-07, B2 S4096 H16 D128 bf16 ALiBi backward (forward + both
# kernels, CUPTI, `bench_mod_costs.py --backward`, MOD_COSTS_FOLD_AFFINE=all):
# dense 1.888 -> 1.809 ms (x1.13 -> x1.08 of the plain call), causal 1.115
# -> 1.061 ms (x1.16 -> x1.10 of plain causal); the dK/dV kernel gains most
# (0.832 -> 0.762, causal 0.476 -> 0.435 ms), dQ 0.564 -> 0.538; the delta
# fold alone gains nothing (1.896 / 1.115). Largest |gradient - XLA path's|
# the same with and without (0.5 dense, the bf16 cancellation of the notes;
# 0.0156 causal).
FOLD_AFFINE_SCORE_MOD = True
FOLD_AFFINE_SCORES = True
# `_kernel_mods`: with a score_mod or mask_mod, both kernels' CTAs take
# their tiles longest list first (`backward_inputs.heavy_tiles_first`, an
# operand built from the lists' counts) instead of in the grid's order.
# Without it a mask_mod on the dense base (prefix-LM) runs its dQ kernel's
# heaviest query tiles in the last wave, where the plain causal call
# reverses its tiles; list scheduling on 132 SMs (fixed cost per CTA plus a
# cost per block, the packed-rows fit): prefix-LM B2 S8192 H16 dQ tail +6.0 %
# over a perfect split in the grid's order, +0.6 % heavy first. H100,
# 2026-12-07, that row (bench_mod_costs.py, MOD_COSTS_HEAVY_FIRST=both, two
# rounds): dQ 1.125-1.126 ms against 1.157-1.158, dK/dV 1.499-1.509 against
# 1.515; the backward kernels at 0.89 of the dense kernels' rate per
# visible pair against 0.88.
HEAVY_TILES_FIRST_WITH_MODS = True
# `choose_mods_config`: calls with a mask_mod keep the plain call's three dQ
# consumers (192-row CTA tiles, 160 registers) too. The lists come from
# 64-row fine tiles, so they nest; but a 128 x 128 block mask's FULL / EMPTY
# tiles then meet in one CTA tile and make it PARTIAL (bench_mods' 50 %
# block-sparse pattern: about 0.75 of the key blocks walked instead of 0.5),
# so it is for masks without that block structure (prefix-LM, windows).
# Local ptxas, prefix-LM B2 S8192 H16 D128: the dQ kernel without spills, its
# FULL and PARTIAL loops as on two consumers (289 / 402 SASS instructions).
# The plain dense dQ kernel measured 2.03 ms on three against 2.18 on two.
# H100, 2026-12-07, prefix-LM B2 S8192 (with heavy tiles first): dQ 1.075 ms
# against 1.125, the backward kernels at 0.907 of the dense rate per visible
# pair. Off: the block-structured masks it would slow were not measured, and
# which kind a call's mask is, is run-time data.
THREE_DQ_CONSUMERS_WITH_MASK_MOD = False


# --- configuration -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """Static configuration of both kernels: each kernel's own (`dkv`: the
  dK/dV kernel's `DkvConfig`, its `dk_dv` schemes there; `dq`: the dQ
  kernel's `DqConfig`) and how the two run together.

  dQ inside the dK/dV kernel (one kernel, five tile GEMMs instead of seven,
  dQ summed in int32 fixed point) was measured slower on an H100 (B2 S8192
  H16 D128: 535 vs 586 TFLOP/s; B1 S16384: 532 vs 543) and left the package;
  its code is at commit `dcef065`, the measurements in docs/performance-notes.md.
  """

  dkv: DkvConfig = dataclasses.field(default_factory=DkvConfig)
  dq: DqConfig = dataclasses.field(default_factory=DqConfig)
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

  def __post_init__(self):
    if self.overlap_kernels and self.delta_in_dq:
      raise ValueError(f"overlap_kernels needs independent kernels: delta_in_dq=False; "
                       f"got delta_in_dq={self.delta_in_dq}: set overlap_kernels=False")
    dq_rows = self.dq.num_consumers * self.dq.block_q
    if self.delta_in_dq and dq_rows % self.dkv.block_q:  # (the dV pass reads no delta)
      # The dK/dV kernel must not read delta rows the dQ kernel never wrote.
      raise ValueError(f"delta_in_dq needs dkv.block_q to divide the dQ kernel's "
                       f"{dq_rows} rows per CTA; got dkv.block_q={self.dkv.block_q}")

def choose_config(head_dim: int, mask: MaskSpec, group: int = 1,
                  segment_ids: bool = False, raw_scores: bool = False,
                  value_head_dim: int | None = None) -> BackwardConfig:
  """Block sizes per (padded) head dim pair, Q's and K's `head_dim` and V's
  `value_head_dim` (None: the same; `check_value_head_dim` says which pairs
  the kernels take); the same for every mask. Where delta
  is computed depends on whether the mask has a window, how lse and delta
  enter the dK/dV kernel on the GQA group size (`group` query heads per KV
  head), the mask and whether the logits need the raw S^T (`raw_scores`:
  `ScoreFunction.needs_raw_scores`, soft-capped logits; below).

  Registers per consumer thread (64 rows per warpgroup, fp32):
  dK/dV: dK + dV = (head_dim + value_head_dim) / 2, S^T and dP^T =
         dkv.block_q / 2 each.
  dQ:    dQ = head_dim / 2, S and dP = dq.block_kv / 2 each.

  Every rule's measurements are in docs/performance-notes.md, "The backward
  heuristic, rule by rule", one subsection per rule (named in quotes below).
  Up to head dim 128: 64-key and 64-row tiles, three stages at 64 and two
  at 128 ("Block sizes per head dim").
  """
  d = padded_head_dim(head_dim)
  dv = d if value_head_dim is None else padded_head_dim(value_head_dim)
  # dQ: three consumers of 64 rows on 160 registers (dQ 64 + S 32 + dP 32
  # at 128), 64-key tiles ("dQ: three consumers").
  three_dq_consumers = DqConfig(block_q=64, block_kv=64, num_stages=2, num_consumers=3,
                                producer_registers=24, consumer_registers=160)
  # dK/dV: two consumers of 64 keys on 240 registers, 64-row query tiles,
  # lse and delta loaded before the S^T / dP^T wait ("dK/dV: two consumers,
  # 64-row query tiles, lse and delta first").
  #
  # Causal masks without a window compute delta in the dQ kernel and run
  # the kernels apart; every other mask computes delta in XLA and overlaps
  # the dQ kernel with the dK/dV kernel's last wave (PDL) ("Delta in the dQ
  # kernel, or overlapped kernels").
  causal_without_window = mask.left is None and mask.right is not None
  delta_in_dq = causal_without_window
  #
  # The resident tiles are register A operands at head dim 64 only
  # ("Register A operands at D = 64").
  #
  # lse and delta start the S^T / dP^T accumulators (`fold_stats`) for GQA
  # under a causal mask without a window above head dim 64, where they end
  # the dK/dV kernel's spills ("lse and delta folded into the accumulators").
  fold_stats = causal_without_window and group > 1 and d > 64
  #
  # Soft-capped (logits of the raw S^T): delta alone is folded, under causal
  # masks, windows included, above head dim 64 ("Soft-cap: delta folded
  # under causal masks").
  fold_stats = fold_stats or (raw_scores and mask.right == 0 and d > 64)
  #
  # Packed causal rows (segment ids) without a window at head dim <= 64: the
  # dK/dV kernel on a persistent grid with a work queue and two K/V copies
  # per consumer ("Packed causal rows at D = 64: a work queue").
  work_queue = segment_ids and causal_without_window and d <= 64
  #
  # Soft-capped calls keep the plain call's tiles ("Soft-cap at D = 128:
  # 32-row query tiles (lost)").
  fused_dkv = DkvConfig(block_kv=64, block_q=64, num_stages=3 if d <= 64 else 2,
                        producer_registers=24, consumer_registers=240, stats_first=True,
                        operands_in_registers=d <= 64, fold_stats=fold_stats,
                        work_queue=work_queue)
  if d <= MAX_FUSED_DK_DV_HEAD_DIM:
    # (128 / 64 too: its narrower dO, V and dV tiles only free SMEM and registers.)
    dq = dataclasses.replace(three_dq_consumers, operands_in_registers=d <= 64)
    return BackwardConfig(fused_dkv, dq, delta_in_dq=delta_in_dq, overlap_kernels=not delta_in_dq)
  # The 192-wide dQ kernel: two consumers (dQ 96 + S 32 + dP 32 registers
  # leave three consumers' 160 none to spare); 64-row tiles and two stages
  # fit SMEM at every value head dim (194 KiB at 192 / 192).
  dq_192 = DqConfig(block_q=64, block_kv=64, num_stages=2)
  if d + dv <= 2 * MAX_FUSED_DK_DV_HEAD_DIM:
    # 192 / 64: dK 96 + dV 32 registers, as many as dK + dV at 128, so the
    # D = 128 dK/dV kernel; dQ and the kernels' order as at 192. Unmeasured
    # (docs/performance-notes.md, "Value head dims of their own").
    return BackwardConfig(fused_dkv, dq_192)
  if d == 192 and dv == 128:
    # 192 / 128: `DKV_AT_192_128`; dQ and the kernels' order as at 192.
    return BackwardConfig(DKV_AT_192_128, dq_192)
  if d % 128 == 0:
    # 256: each consumer keeps half the head dim of dK and dV (of dV's own,
    # 128 or 256). SMEM at 256 / 256: K, V
    # 64 KiB, two stages of Q and dO 128 KiB, P^T and dS^T rings 32 KiB; the
    # resident Q and dO tiles of dQ take 128 KiB, so its key tiles are 32
    # rows. Kernels overlapped ("Head dim 256: the head-dim split").
    return BackwardConfig(
        DkvConfig(block_kv=64, block_q=64, num_stages=2, producer_registers=24,
                  consumer_registers=240, dk_dv="head_dim_split"),
        DqConfig(block_q=64, block_kv=32, num_stages=3), overlap_kernels=True)
  # 192 (and 144-176, padded): halves of 96 columns do not fall on the
  # 64-column tiles of the swizzled layout, so dK and dV take two passes.
  # 64-row tiles and two stages fit the SMEM at 192 in every kernel (at most
  # 192 KiB). The kernels run one after another ("Head dim 192: two passes").
  # 192 / 128 keeps these tiles: fused, dK 96 + dV 64 + S^T 32 + dP^T 32
  # registers would leave 16 of 240 for the rest; the dK pass holds 160 as
  # at 192, the Dv-wide dV pass 96 (docs/performance-notes.md, "Value head
  # dims of their own").
  return BackwardConfig(DkvConfig(block_kv=64, block_q=64, num_stages=2, dk_dv="two_passes"),
                        dq_192)


def choose_mods_config(head_dim: int, mask: MaskSpec, group: int = 1,
                       segment_ids: bool = False, raw_scores: bool = False,
                       value_head_dim: int | None = None,
                       score_mod: bool = False, mask_mod: bool = True) -> BackwardConfig:
  """The config of a call with a `score_mod` or `mask_mod`: the plain call's
  (`choose_config`) without the variant the block lists do not drive (the
  work queue), and with two dQ consumers at head dim <= 128, so that the dQ
  kernel's CTA tiles (128 rows) and the dK/dV kernel's (128 keys) nest with
  the 128 x 128 tiles of a `create_block_mask` block mask (three
  consumers' 192 rows do not: the mask_mod would be evaluated anew).
  A call without a `mask_mod` (`mask_mod=False`; so without a block mask)
  has only the built-in masks' classes, computed at any tile: with
  `THREE_DQ_CONSUMERS_WITHOUT_MASK_MOD` it keeps the plain call's dQ kernel
  (three consumers on 160 registers; ptxas, local: ALiBi's then spills 92 /
  112 bytes, 9 spill loads in its key loop).

  The softmax with mods takes the raw S^T and lse2 (a score_mod's R moves
  lse2 per query: `sm90_backward_common._tile_softmax_with_mods`), so lse2
  is never folded into the S^T accumulator. With a `score_mod` (`score_mod`)
  delta alone is folded into the dP^T one (`fold_stats` on the raw-scores
  branch of `transposed_scores`) where the consumers own whole key tiles:
  delta then dies before the wait instead of living across it beside lse2
  (`stats_first`). ptxas (local, B2 S4096 H16 D128): the ALiBi dK/dV
  kernel spills 12 / 8 bytes instead of 184 / 180 (24 spill loads in its
  FULL key loop before, one after), causal 16 / 12 instead of 252 / 248, a
  32-entry table 72 / 76 instead of 332 / 340; the loop loses the 32
  subtractions dP - delta (docs/performance-notes.md, "The ALiBi backward's
  registers"). Calls with a mask_mod alone fold both lse2 and delta
  (`FOLD_STATS_WITH_MASK_MOD_ALONE`: their softmax needs no raw S^T)."""
  config = choose_config(head_dim, mask, group, segment_ids=segment_ids, raw_scores=raw_scores,
                         value_head_dim=value_head_dim)
  fold = FOLD_DELTA_WITH_SCORE_MOD if score_mod else FOLD_STATS_WITH_MASK_MOD_ALONE
  fold = fold and not config.dkv.split_consumers
  fold_delta = score_mod and FOLD_AFFINE_SCORE_MOD
  fold_affine = fold_delta and FOLD_AFFINE_SCORES
  dkv = dataclasses.replace(config.dkv, work_queue=False, fold_stats=fold,
                            fold_affine=fold_affine)
  dq = dataclasses.replace(config.dq, fold_delta=fold_delta, fold_affine=fold_affine)
  keep_dq = (THREE_DQ_CONSUMERS_WITH_MASK_MOD if mask_mod
             else THREE_DQ_CONSUMERS_WITHOUT_MASK_MOD)
  if dq.num_consumers != 2 and not keep_dq:
    dq = dataclasses.replace(dq, num_consumers=2, producer_registers=24, consumer_registers=240)
  return dataclasses.replace(config, dkv=dkv, dq=dq)


def choose_fused_dq_config(head_dim: int, mask: MaskSpec, group: int = 1,
                           raw_scores: bool = False) -> FusedDqConfig:
  """The one kernel's config (`deterministic=False`, head dim 128): the
  plain dK/dV kernel's tiles, stages and registers (`choose_config`; two
  stages, 24 / 240 registers), no work queue, and lse and delta folded into
  the S^T and dP^T accumulators for every mask (`fold_stats`; delta alone
  with soft-cap). ptxas (local, B2 S4096 H16 D128 dense, spill stores /
  loads): 0 / 0 with the fold, 4 / 12 with lse and delta loaded after the
  S^T / dP^T wait, 24 / 40 before it (three reloads in the step loops)."""
  dkv = choose_config(head_dim, mask, group, raw_scores=raw_scores).dkv
  dkv = dataclasses.replace(dkv, work_queue=False, operands_in_registers=False, fold_stats=True)
  return FusedDqConfig(dkv=dkv)


# Keys from which `deterministic=False` takes the one kernel. H100,
# 2026-12-07, `bench_backward.py --nondeterministic --rounds 2`, TFLOP/s of
# the one kernel / the two kernels / cuDNN's default backward:
#   dense:  B2 S8192 H16 619 / 590 / 574; B1 S16384 634 / 592 / 597;
#           GQA 32/8 S8192 586 / 575 / 551; B8 S2048 528 / 531 / 468.
#   causal: B1 S16384 574 / 559 / 571; B2 S8192 541 / 546 / 507;
#           GQA 32/8 S8192 512 / 544 / 509; B8 S2048 403 / 451 / 349.
#   window of 1024 keys, B1 S16384: 386 / 413 / 344.
# Below these lengths, under GQA with a causal mask and under windows the
# two kernels were as fast or faster, and they are deterministic besides.
ONE_KERNEL_MIN_KEYS = {"dense": 4096, "causal": 16384}


def one_kernel_is_faster(mask: MaskSpec, kv_seq: int, group: int) -> bool:
  """Whether `deterministic=False` runs the one kernel (where it can serve
  the call) rather than the two: where it measured faster."""
  if mask.right is None and mask.left is None:
    return kv_seq >= ONE_KERNEL_MIN_KEYS["dense"]
  if mask.right == 0 and mask.left is None and group == 1:
    return kv_seq >= ONE_KERNEL_MIN_KEYS["causal"]
  return False


def mods_configs() -> list[tuple[int, BackwardConfig]]:
  """Every (padded head dim, config) `choose_mods_config` can pick (for tests)."""
  seen = {}
  for d in (64, 128, 192, 256):
    for mask in sm90_tiles.HEURISTIC_MASKS:
      for group in (1, 4):
        for raw_scores in (False, True):
          for segment_ids in (False, True):
            for score_mod, mask_mod in ((False, True), (True, True), (True, False)):
              seen[(d, choose_mods_config(d, mask, group, segment_ids, raw_scores,
                                          score_mod=score_mod, mask_mod=mask_mod))] = None
  return list(seen)


def all_configs() -> list[tuple[int, BackwardConfig]]:
  """Every (padded head dim, config) the heuristic can pick (for tests)."""
  seen = {}
  for d in (64, 128, 192, 256):
    for mask in sm90_tiles.HEURISTIC_MASKS:
      for group in (1, 4):
        for raw_scores in (False, True):
          seen[(d, choose_config(d, mask, group, raw_scores=raw_scores))] = None
  return list(seen)


def check_supported(q_shape, k_shape, dtype, mask: MaskSpec) -> None:
  """Raises KernelUnsupported when the backward kernels cannot serve the call."""
  sm90_tiles.check_supported("sm90 backward", q_shape, k_shape, dtype, mask)


def check_value_head_dim(head_dim: int, value_head_dim: int) -> None:
  """Raises KernelUnsupported unless the kernels take V, O and dO (and give
  dV) at `value_head_dim` beside Q and K at `head_dim` (each padded to a
  multiple of 64): a multiple of 16 (as the head dim), V no wider than K,
  and at a padded head dim of 256 (the head-dim split) halves of V that
  fall on 64-column tiles (128 or 256). `backends` pads the other pairs to
  one head dim."""
  d, dv = padded_head_dim(head_dim), padded_head_dim(value_head_dim)
  if value_head_dim % 16 or dv > d or (d == 256 and dv % 128):
    raise KernelUnsupported(f"sm90 backward: value head dim {value_head_dim} with head dim "
                            f"{head_dim}; the kernels take multiples of 16 no wider than the "
                            "head dim, at 256 only 128 and 256")


# --- entry point -----------------------------------------------------------------


def _kernel_segments(segment_ids, config: BackwardConfig, q_pad: int, kv_pad: int):
  """(dK/dV kernel's, dQ kernel's) `segment_operands`; empty lists without
  segment ids."""
  if segment_ids is None:
    return [], []
  q_ids, kv_ids = (jnp.asarray(x, jnp.int32) for x in segment_ids)
  dkv_config, dq_config = config.dkv, config.dq
  nc = 1 if dkv_config.split_consumers else dkv_config.num_consumers
  dkv = segment_operands(q_ids, kv_ids, keys_are_rows=True, block_rows=dkv_config.block_kv,
                         consumers=nc, num_ctas=cdiv(kv_pad, nc * dkv_config.block_kv),
                         block_cols=dkv_config.block_q)
  dq_nc = dq_config.num_consumers
  dq = segment_operands(q_ids, kv_ids, keys_are_rows=False, block_rows=dq_config.block_q,
                        consumers=dq_nc, num_ctas=cdiv(q_pad, dq_nc * dq_config.block_q),
                        block_cols=dq_config.block_kv)
  return dkv, dq


def _kernel_mods(mods, config: BackwardConfig, batch: int, num_q_heads: int, q_seq: int,
                 kv_seq: int, q_pad: int, kv_pad: int):
  """(`ModStatics`, the dK/dV kernel's mods operands, the dQ kernel's) of a
  call with a score_mod or mask_mod (`mods`, the call's `scores.Scores`):
  the tile classes of every mask of the call evaluated once, at tiles that
  divide both kernels' CTA tiles, and each kernel's block lists."""
  dkv_config, dq_config = config.dkv, config.dq
  dq_rows = dq_config.num_consumers * dq_config.block_q
  dkv_keys = dkv_config.block_kv * (1 if dkv_config.split_consumers
                                    else dkv_config.num_consumers)
  fine = (min(dkv_config.block_q, dq_rows), min(dq_config.block_kv, dkv_keys))
  assert dq_rows % fine[0] == 0 and dkv_config.block_q % fine[0] == 0, (config, fine)
  assert dkv_keys % fine[1] == 0 and dq_config.block_kv % fine[1] == 0, (config, fine)
  classes = fine_tile_classes(mods, batch, num_q_heads, q_seq, kv_seq, *fine)
  tile_order = HEAVY_TILES_FIRST_WITH_MODS
  operands = functools.partial(mod_operands, mods, classes, fine, tile_order=tile_order)
  dkv = operands(q_block=dkv_config.block_q, kv_block=dkv_keys,
                 num_q=cdiv(q_pad, dkv_config.block_q), num_kv=cdiv(kv_pad, dkv_keys),
                 keys_are_rows=True)
  dq = operands(q_block=dq_rows, kv_block=dq_config.block_kv, num_q=cdiv(q_pad, dq_rows),
                num_kv=cdiv(kv_pad, dq_config.block_kv), keys_are_rows=False)
  statics = ModStatics(score_mod=mods.score_mod, mask_mod=mods.mask_mod,
                       per_head=classes.shape[1] > 1,
                       has_offsets=mods.index_offsets is not None,
                       num_score_captured=len(mods.score_captured),
                       num_mask_captured=len(mods.mask_captured),
                       position_bound=max(q_pad, kv_pad) + 2 * max(dq_rows, dkv_keys),
                       tile_order=tile_order)
  return statics, dkv, dq


def backward(q, k, v, out, lse, dout, q_lengths, kv_lengths, *, score: ScoreFunction,
             mask: MaskSpec, config: BackwardConfig | FusedDqConfig | None = None,
             segment_ids=None, mods=None, deterministic: bool = True):
  """Gradients (dq, dk, dv) of attention. See `fa4_jax.kernels` for the contract.

  q: [B, Tq, Nq, D]; out, dout: [B, Tq, Nq, Dv]; k: [B, Tk, Nkv, D]; v:
  [B, Tk, Nkv, Dv]; lse: f32 [B, Nq, Tq]. Dv may be narrower than D
  (`check_value_head_dim`): V, O, dO and dV are Dv wide in the kernels.
  dk and dv are summed over the query heads of each GQA group.
  segment_ids: None, or (q ids int32 [B, Tq], kv ids int32 [B, Tk]): a query
  sees only keys of its own id.
  score: how the forward formed its logits from q.k (`ScoreFunction`: the
  scale, the soft-cap; `sm90_backward_common.tile_softmax`).
  Sinks need nothing here: the lse includes them.
  mods: None, or the call's `scores.Scores` where it has a `score_mod` or
  `mask_mod` (its mask, score function, lengths and segment ids are the
  arguments above): the kernels recompute P with the modified score and
  walk block lists (`sm90_backward_common`, "score_mod and mask_mod");
  the captured arrays' gradients are the caller's (`backends`).
  deterministic: True (default), the two kernels above, bit-reproducible.
  False: the one kernel with dQ summed in float32 by TMA reduce-adds
  (`sm90_backward_fused_dq`) where it serves the call (head dim 128 after
  padding, V as wide, no score_mod / mask_mod: `fused_dq_problem`) and was
  measured faster (`one_kernel_is_faster`: long dense rows, long causal
  rows without GQA), else the two kernels. A `FusedDqConfig` as `config`
  asks for the one kernel.
  """
  check_query_lengths_for_alignment(mask, q_lengths, "sm90 backward")
  check_supported(q.shape, k.shape, q.dtype, mask)
  check_operands(q, k, v, own_value_head_dim=True)
  batch, q_seq, num_q_heads, head_dim = q.shape
  _, kv_seq, num_kv_heads, _ = k.shape
  value_dim = v.shape[-1]
  check_value_head_dim(head_dim, value_dim)
  dtype = q.dtype
  dout = dout.astype(dtype)
  # TMA tiles (sequence, head_dim) by (8, 64): pad sequences to multiples of 8
  # and head dims to multiples of 64 (a copy only for unaligned shapes).
  d, d_value = padded_head_dim(head_dim), padded_head_dim(value_dim)
  q_pad, kv_pad = cdiv(q_seq, 8) * 8, cdiv(kv_seq, 8) * 8
  if mods is not None and not mods.has_mods:
    mods = None
  score = kernel_score_function(score, None if mods is None else mods.score_mod)
  choose = choose_config if mods is None else functools.partial(
      choose_mods_config, score_mod=mods.score_mod is not None,
      mask_mod=mods.mask_mod is not None)
  # (The tuner's candidates and arrays have one head dim.)
  tunable = mods is None and segment_ids is None and d_value == d
  problem = fused_dq_problem(d, d_value, mods is not None)
  one_kernel = isinstance(config, FusedDqConfig) or (
      not deterministic and config is None and problem is None
      and one_kernel_is_faster(mask, kv_seq, num_q_heads // num_kv_heads))
  if one_kernel:
    if problem is not None:
      raise KernelUnsupported(f"sm90 backward: the one kernel with dQ cannot take {problem}")
    config = config or choose_fused_dq_config(d, mask, num_q_heads // num_kv_heads,
                                              raw_scores=score.needs_raw_scores)
    return _one_kernel_backward(q, k, v, out, lse, dout, q_lengths, kv_lengths, score=score,
                                mask=mask, config=config, segment_ids=segment_ids)
  config = config or autotune.sm90_backward_config(  # the heuristic's, unless switched on
      choose(d, mask, num_q_heads // num_kv_heads, segment_ids=segment_ids is not None,
             raw_scores=score.needs_raw_scores, value_head_dim=d_value),
      q_shape=q.shape, k_shape=k.shape, dtype=dtype, mask=mask, score=score,
      has_q_lengths=q_lengths is not None, has_kv_lengths=kv_lengths is not None,
      tunable=tunable)
  if mods is not None and config.dkv.work_queue:
    raise ValueError("with a score_mod or mask_mod the dK/dV kernel's config takes no "
                     f"work_queue; got {config.dkv}")
  if config.dkv.work_queue and not config.dkv.num_sms:
    config = dataclasses.replace(config, dkv=dataclasses.replace(
        config.dkv, num_sms=sm_count(DEFAULT_NUM_SMS["sm90"])))
  lse2, delta = preprocess(out, lse, dout, q_lengths, q_pad, with_delta=not config.delta_in_dq)

  q, k, v, dout, common = _padded_operands(q, k, v, dout, d=d, d_value=d_value, q_pad=q_pad,
                                           kv_pad=kv_pad, score=score, mask=mask,
                                           q_lengths=q_lengths, kv_lengths=kv_lengths,
                                           segment_ids=segment_ids)
  dkv_segments, dq_segments = _kernel_segments(segment_ids, config, q_pad, kv_pad)
  dkv_mods = dq_mods = []
  if mods is not None:
    common["mods"], dkv_mods, dq_mods = _kernel_mods(mods, config, batch, num_q_heads, q_seq,
                                                     kv_seq, q_pad, kv_pad)
  lengths = []
  if q_lengths is not None:
    lengths.append(jnp.asarray(q_lengths, jnp.int32))
  if kv_lengths is not None:
    lengths.append(jnp.asarray(kv_lengths, jnp.int32))
  dkv_common = dict(common, config=config.dkv)
  dq_common = dict(common, config=config.dq, with_delta=config.delta_in_dq)
  if config.delta_in_dq:  # the dQ kernel first: it computes delta for both
    o = _pad_to_tiles(out.astype(dtype), q_pad, d_value)
    dq, delta = _build_dq_kernel(**dq_common)(q, k, v, dout, lse2, o, *lengths, *dq_segments,
                                              *dq_mods)
  args = [q, k, v, dout, lse2, delta, *lengths]
  # With `overlap_kernels` (the dQ kernel last) each
  # kernel below launches while the one before it finishes: the dK/dV
  # kernel, or the dK and the dV pass, release the next; all but the first
  # follow the previous one.
  overlap = config.overlap_kernels
  first_dkv = LaunchChain(releases_next=overlap)
  second_dkv = LaunchChain(releases_next=overlap, follows_previous=overlap)
  last_dq = LaunchChain(follows_previous=overlap)
  dkv_args = [*args, *dkv_segments, *dkv_mods]
  if config.dkv.dk_dv == "fused":
    build_dkv = functools.partial(_build_dkv_kernel, **dkv_common, outputs=("dk", "dv"),
                                  chain=first_dkv)
    dkv_call = build_dkv()
    if config.dkv.work_queue:
      dkv_call = fixed_shares_under_vmap(dkv_call, lambda: build_dkv(queue_counter=False))
    dk, dv = dkv_call(*dkv_args)
  elif config.dkv.split_consumers:  # "head_dim_split", "dv_dk_split"
    dk, dv = _build_dkv_head_split_kernel(**dkv_common, chain=first_dkv)(*dkv_args)
  else:
    (dk,) = _build_dkv_kernel(**dkv_common, outputs=("dk",), chain=first_dkv)(*dkv_args)
    (dv,) = _build_dkv_kernel(**dkv_common, outputs=("dv",), chain=second_dkv)(*dkv_args)
  if not config.delta_in_dq:
    dq = _build_dq_kernel(**dq_common, chain=last_dq)(*args, *dq_segments, *dq_mods)
  if d != head_dim or q_pad != q_seq:
    dq = dq[:, :q_seq, :, :head_dim]
  if d != head_dim or kv_pad != kv_seq:
    dk = dk[:, :kv_seq, :, :head_dim]
  if d_value != value_dim or kv_pad != kv_seq:
    dv = dv[:, :kv_seq, :, :value_dim]
  return dq, dk, dv


def _pad_to_tiles(x, t_pad, width):
  """x [B, T, H, D] padded to `t_pad` rows and `width` features (no copy if aligned)."""
  if width == x.shape[-1] and t_pad == x.shape[1]:
    return x
  return jnp.pad(x, [(0, 0), (0, t_pad - x.shape[1]), (0, 0), (0, width - x.shape[-1])])


def _padded_operands(q, k, v, dout, *, d, d_value, q_pad, kv_pad, score, mask, q_lengths,
                     kv_lengths, segment_ids):
  """q, k, v, dout padded to the kernels' tiles (sequences to `q_pad` /
  `kv_pad`, head dims to `d` / `d_value`; a copy only where unaligned) and
  the static arguments every backward kernel builder takes."""
  batch, q_seq, num_q_heads, _ = q.shape
  _, kv_seq, num_kv_heads, _ = k.shape

  common = dict(
      batch=batch, q_seq=q_pad, kv_seq=kv_pad, kv_valid=kv_seq,
      num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=d, value_head_dim=d_value,
      dtype=q.dtype, score=score, mask=mask,
      has_q_lengths=q_lengths is not None, has_kv_lengths=kv_lengths is not None)
  if segment_ids is not None:
    common["has_segments"] = True
  return (_pad_to_tiles(q, q_pad, d), _pad_to_tiles(k, kv_pad, d), _pad_to_tiles(v, kv_pad, d_value),
          _pad_to_tiles(dout, q_pad, d_value), common)


def _one_kernel_backward(q, k, v, out, lse, dout, q_lengths, kv_lengths, *,
                         score: ScoreFunction, mask: MaskSpec, config: FusedDqConfig,
                         segment_ids):
  """`backward` with the one kernel (`sm90_backward_fused_dq`): delta by
  XLA, dK and dV from the kernel, dQ summed in float32 and cast here."""
  batch, q_seq, num_q_heads, head_dim = q.shape
  _, kv_seq, num_kv_heads, _ = k.shape
  value_dim = v.shape[-1]
  dtype = q.dtype
  dout = dout.astype(dtype)
  d = padded_head_dim(head_dim)
  q_pad, kv_pad = cdiv(q_seq, 8) * 8, cdiv(kv_seq, 8) * 8
  lse2, delta = preprocess(out, lse, dout, q_lengths, q_pad, with_delta=True)
  q, k, v, dout, common = _padded_operands(q, k, v, dout, d=d, d_value=d, q_pad=q_pad,
                                           kv_pad=kv_pad, score=score, mask=mask,
                                           q_lengths=q_lengths, kv_lengths=kv_lengths,
                                           segment_ids=segment_ids)
  dkv_segments, _ = _kernel_segments(segment_ids, BackwardConfig(dkv=config.dkv), q_pad, kv_pad)
  lengths = [jnp.asarray(x, jnp.int32) for x in (q_lengths, kv_lengths) if x is not None]
  args = [q, k, v, dout, lse2, delta, *lengths]
  dq, dk, dv = sm90_backward_fused_dq.backward_kernels(args, dkv_segments, common=common,
                                                       config=config, kv_pad=kv_pad)
  dq = dq[:, :q_seq, :, :head_dim].astype(dtype)
  dk, dv = dk[:, :kv_seq, :, :head_dim], dv[:, :kv_seq, :, :value_dim]
  return dq, dk, dv
