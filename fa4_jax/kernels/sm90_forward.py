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
and the wait for the next K tile is issued while P V runs. In bfloat16,
FA3's intra-warpgroup overlap (the softmax of block j while O += P_{j-1}
V_{j-1} runs), a back-to-back issue of both GEMMs and P staged through SMEM
all measured slower on an H100 (docs/performance-notes.md) and were removed;
commit dcef065 still has them. In float8, with P in registers, the overlap
beat the serial schedule on two consumers, and three consumers without
turns beat both: they are the D128 default (`FP8_THREE_CONSUMERS`), and the
float8 overlap left the code too (commit 0180d5c is the last to have it).

Every barrier, who arrives on it and who waits on it is declared once in
`ForwardBarrierTable` (the form of `fa4_jax.kernels.pipeline.BarrierTable`).

Softmax (`fa4_jax.scores.online_softmax`, which also holds the tile ranges and
the element mask): logits are kept raw; `c = scale * log2(e)` is folded into
one FMA before `exp2`, the running max `m` is kept in those scaled log2 units,
in the wgmma accumulator's row layout. The max is only moved when a row's max
grew by more than `scores.RESCALE_THRESHOLD` (log2 units): a stale max is used
for both l and O, so the result stays exact and P stays below
2**RESCALE_THRESHOLD. With `ForwardConfig.conditional_rescale`, O is
multiplied by the rescale factor only in the warps where some row's max moved
(a warp-uniform branch, `fa4_jax.kernels.accumulator.rescale_rows`): after the
first blocks that is almost never, and the multiply costs head_dim / 2 FMULs
per thread and block.

Masks (`fa4_jax.scores.MaskSpec`, lengths): each consumer walks the KV blocks
its rows can see; blocks fully visible run without an element mask, boundary
blocks (diagonal, window edge, length edge) with one, and blocks outside its
own range (but inside the CTA's, which the producer loads) only keep the
barrier protocol going. Causal-like masks schedule the heaviest query tiles
first.

Segment ids (packed sequences, `forward(..., segment_ids=...)`): before the
kernel, XLA computes per consumer tile the key blocks its ids can meet and
the ones of its single id (`segment_operands`, `scores.segment_tile_ranges`).
In the kernel they narrow each consumer's range (`consumer_kv_blocks`), and
the producer loads the hull of its consumers' ranges (`scores.hull`), so
blocks of other documents are neither loaded nor computed. Only boundary
blocks compare ids: the rows' ids are loaded once per tile; a block's key ids
arrive by TMA with its K tile (`sm90_tiles.id_ring`) and are read from SMEM
after its Q K^T, a chunk of columns at a time, before the K slot is
released. The causal pairing of the persistent grid balances the band's
work, not the documents'.

Grid (`fa4_jax.kernels.schedule`): one CTA per (q head, q tile, batch); or,
with `ForwardConfig.persistent` (chosen when a tile walks few KV blocks: short
sequences, local windows, and packed causal rows), one CTA per SM walks a
share of those work items (in the grid's launch order, causal tiles paired
heavy with light so that every CTA gets the same work), the K/V ring and Q
buffers carrying their barrier phases across items, so that one item's Q load
and O store overlap the neighbouring items' work. With two Q tiles per
consumer (`ForwardConfig.q_buffers`) the next item's Q loads while the
current item runs, instead of after its last Q K^T with the next K/V loads
queued behind it. Packed rows, whose tiles' costs are run-time data, and
short causal rows take their tiles from a work queue instead of a fixed
share (`ForwardConfig.work_queue`, `schedule.WorkQueue`,
`packed_rows_use_a_work_queue`, `short_causal_rows_use_a_work_queue`):
the producer takes the next tile from a GMEM counter and passes it to the
consumers in an SMEM cell that their Q barrier orders.

Sinks and soft-cap (`forward(..., sinks=, score=)`, `FEATURES`): a
head's sink logit is read from a small GMEM operand [Nq] once per tile and
starts the rows' running max and sum (`scores.initial_row_stats(sink=)`),
so a row that sees no key ends with zeros and lse = sink, and rows past
q_lengths are still zeroed with lse -inf in `_epilogue`. Soft-cap turns the
Q K^T tile into t = tanh(s * scale / cap) before the element mask and folds
c = cap * log2(e) into the exp2 (`ScoreFunction.logits`, `exp2_constant`):
one multiply and one tanh.approx per element, in the softmax turn of the
ping-pong. Capped logits are bounded, so where that bounds P
(`ScoreFunction.bounds_logits`: bf16, cap * log2(e) + log2(keys) <= 96) the
rows keep a fixed max (`ForwardStatics.fixed_max`): no row max, no rescale factor,
no rescale of O, and the turn is tanh, FMA, exp2, row sum. Without them the
kernel is unchanged.

Paged KV cache (`forward(..., page_table=)`, for `fa4_jax.paged`): K and V
are pages [num_pages, page_size, Nkv, D] and row b's keys are the pages
page_table[b, 0], page_table[b, 1], ... one after the other. Only the
producer changes (`_paged_block_fill`): block j of `block_kv` keys arrives
by one TMA per page inside it (page_size < block_kv, each into its rows of
the ring slot) or by one TMA from inside its page (page_size >= block_kv),
the page numbers read from the table in GMEM before the producer waits for
the slot. The K and V rings' full barriers expect that many copies a step
(`kv_copies_per_block`). Page sizes: powers of two >= 8 (they divide
block_kv or block_kv divides them) and head dims multiples of 64 (the cache
is read in place, never padded): `check_paged`. Without a page table the
kernel is unchanged.

Programmable scores (`forward(..., mods=)`, a `scores.Scores` with a
`score_mod` and / or a `mask_mod`): before the kernel XLA classifies every
(CTA tile, key block) pair by every mask of the call, the built-ins and
`mask_mod` (`scores.tile_classes`: EMPTY, PARTIAL, FULL; from the block
mask where it nests) and turns the classes into lists (`scores.block_lists`:
per CTA tile the partial blocks, then the full ones). The producer loads
the listed blocks only; both consumers walk the same list, the partial
blocks with the element mask (the built-ins and `mask_mod` evaluated on the
tile, `sm90_tiles.where_visible`'s hook), the full ones without (`mask_mod`
is not evaluated there). `score_mod` runs on every walked block after the
scale and before the soft-cap (`_ConsumerTile.modified_logits`), and the
softmax's constant is then log2(e) (cap * log2(e)). The mods see the global
(batch, head) (`Scores.index_offsets`) and the query and key positions;
their captured arrays are GMEM operands (`mod_functions.evaluate_in_kernel`).
A score_mod that adds to the score terms of the query alone and of the key
alone, a * x + R(q_idx) + C(kv_idx) (ALiBi, a bias per key, a constant:
`mod_functions.affine_form`), runs in place of the mod's own ops: the logits
are s * (scale * a) + C, one FMA (or the raw s, a in the exp2 constant,
without C), and R moves each row's running max, so the lse holds it
(`_ConsumerTile.affine_logits`, `mod_tiles.affine_logits`); soft-capped,
R joins the logits before the tanh. Such calls take one CTA per tile
(`mods_config`). Without mods the kernel is unchanged
(`tools/kernel_fingerprints.py`).

A value head dim of its own (`v` [B, S, Nkv, Dv], out [..., Dv]; 192 / 128
and others, `check_value_head_dim`): the V ring and the accumulator take Dv,
and O gets SMEM tiles of its own (`ForwardStatics.separate_o_tiles`; without one it
is staged in the consumer's Q tile). The configuration is the larger head
dim's. Not with a page table or heads-major Q. Equal head dims build the
kernel as before (`tools/kernel_fingerprints.py`).

Interpreter (`fa4_jax.interpret`): P goes through SMEM for the P V wgmma and
the producer drains its barriers; both are chosen in one place each
(`_ConsumerTile.p_times_v`, `ForwardBarrierTable.drain_kv_rings` /
`drain_q`).

Code: the roles are functions of one `_Context` (the call's static facts,
refs, barriers, the CTA's work items): `_producer`, `_consumer` (its KV walk
and per-block steps in `_ConsumerTile`) and `_epilogue`.
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

from fa4_jax import mod_functions
from fa4_jax.interpret import is_interpreting
from fa4_jax.kernels import KernelUnsupported, sm90_tiles
from fa4_jax.kernels import compile_ahead
from fa4_jax.kernels.build_cache import cached_build
from fa4_jax.kernels.accumulator import fp8_p_operand, in_p_key_order, rescale_rows
from fa4_jax.kernels.pipeline import (ACQUIRE, ARRIVE, FILL, PUBLISH, RING, SYNC, WAIT,
                                      Barrier, BarrierTable, Copies, check_register_split,
                                      sequence_lengths)
from fa4_jax.kernels.schedule import (PersistentWork, WorkQueue, fixed_shares_under_vmap,
                                     heavy_first_tile, pairs_causal_tiles)
from fa4_jax.kernels.schedule import sm_count as schedule_sm_count
from fa4_jax.kernels import autotune
from fa4_jax.kernels.mod_tiles import affine_logits, kernel_score_function
from fa4_jax.kernels.sm90_tiles import (bound_mask_hook, id_ring, load_ids, mod_positions,
                                       padded_head_dim, where_visible)
from fa4_jax.kernels.tiles import smem_tile, smem_transforms
from fa4_jax import scores as score_lib
from fa4_jax.scores import (MaskSpec, ScoreFunction, TileRanges, cdiv, exact_alpha,
                            fixed_max_softmax, initial_row_stats, key_length_to_compare,
                            kv_tile_ranges, normalize, online_softmax, read_tile_ranges, hull,
                            pad_ids, tile_ranges_operand, walk_blocks)

# The optional arguments `forward` takes (`fa4_jax.kernels`); backends pass
# them only when set.
FEATURES = frozenset({"sinks", "score_function", "mods", "value_head_dim", "fp8"})

def o_rows_in_q_tile(block_q: int, head_dim: int, value_head_dim: int) -> int:
  """Rows of `value_head_dim` that hold a (block_q, head_dim) Q tile's bytes,
  where O, narrower than Q, can be staged in them (`ForwardConfig.
  o_in_q_tile`): whole 8-row tiles, at least block_q of them; else 0."""
  if value_head_dim >= head_dim or (block_q * head_dim) % (8 * value_head_dim):
    return 0
  return block_q * head_dim // value_head_dim


# P of a float8 call, whatever V's float8 type: e4m3 keeps a mantissa bit
# more than e5m2, and P in [0, 1] needs no range (wgmma mixes the two).
FP8_P_DTYPE = jnp.float8_e4m3fn

# Issue #55: the heuristic's float8 configs (`fp8_config`) at these head
# dims take `ForwardConfig.fp8_row_sums_on_tensor_core`, the softmax's row
# sums computed by the P V wgmma instead of one FADD per score (about 70 of
# the 520 instructions a consumer warp issued per 128-key block at D128,
# `tools/fp8_sass_counts.py`). H100, 2026-12-07, B2 S8192 H32/8 D128
# (`bench_fp8.py --row-sums`, 3 rounds), TFLOP/s: causal 909 against 882,
# dense 899 against 905 (a tie), and dense with 256-key blocks, which fit
# the registers only once the sums left the softmax, 942 (192-key blocks
# 915). D64 and D256 fewer instructions too, but not timed: they keep the
# FADDs.
FP8_ROW_SUMS_HEAD_DIMS = (128,)
# Issue #55: float8 calls at those head dims, dense or causal, without
# segment ids or mods, run three consumers without turns (192-row CTAs, 160
# registers each) on 128-key blocks, two stages, serial
# (`FP8_THREE_CONSUMERS`). H100, 2026-12-08, GQA 32/8 e4m3 (`bench_fp8.py
# --overlap`, CUPTI, one process per command), TFLOP/s against FA3's
# intra-warpgroup overlap, the default before (bf16 in brackets): B2 S8192
# dense 1141 against 985 (710), causal 986 against 910-938 (681); B1 S16384
# dense 1144 against 1009 (683), causal 1062 against 976-995 (706). The
# outputs equal the overlap's bit for bit. Three stages lost (1018 / 928).
# Calls the heuristic gives the persistent grid keep the two-consumer serial
# schedule (not timed with three): at D128 dense below about 3.3k keys,
# causal below 6k.
FP8_THREE_CONSUMERS = dict(block_kv=128, num_kv_stages=2, num_consumers=3, pingpong=False,
                           producer_registers=24, consumer_registers=160)
# Keys per block of dense float8 calls at those head dims that three
# consumers do not take (with mods; two stages):
# with the row sums on the tensor core 256-key blocks run without spills in
# the unmasked loop (ptxas, local); masked blocks (causal diagonals, segment
# ids) spill, so those calls keep 128.
FP8_DENSE_BLOCK_KV = 256
# The accumulator's columns that hold the row sums (the narrowest wgmma N):
# each holds the same sum, P times a column of ones.
FP8_ROW_SUM_COLUMNS = 8

# SMs of an H100 SXM: the persistent grid's size where no GPU is present
# (cross-lowering, the interpreter).
H100_SMS = 132
# Hopper: 227 KiB of dynamic shared memory per block.
SMEM_LIMIT_BYTES = 232448
# Barriers and alignment padding on top of `ForwardConfig.smem_bytes`
# (cross-lowered heuristic configs add 376-712 bytes; a test checks it).
SMEM_RESERVE_BYTES = 1024


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
  """Static tiling of the kernel. A CTA covers `num_consumers * block_q` rows.

  Block sizes, stages, consumers and registers per head dim: `choose_config`
  says what each choice measured. The paired GEMM schedules and P in SMEM
  measured slower and were removed (commit dcef065 has them).
  """

  block_q: int  # query rows per consumer warpgroup (wgmma M)
  block_kv: int  # keys per ring slot
  num_kv_stages: int  # slots in the K ring and in the V ring
  # Consumer warpgroups: 3 at D = 64 (528 vs 504 TFLOP/s dense, see `choose_config`).
  num_consumers: int = 2
  producer_registers: int = 40
  consumer_registers: int = 232
  # Finish the row sums before handing the tensor core over, or after. H100:
  # before wins at D = 64 (528 vs 495 dense, 478 vs 453 causal, three
  # consumers) and ties or wins at D = 256 (697 vs 692 causal); after wins
  # at D = 128 (B8 S2048: 648 vs 635; docs/performance-notes.md).
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
  # Persistent grid only: each CTA takes its next tile from a counter in GMEM
  # (`schedule.WorkQueue`) instead of a fixed share, so CTAs that drew short
  # tiles take more; tiles are not paired.
  work_queue: bool = False
  # Multiply O by alpha only in warps where some row's max moved
  # (`fa4_jax.kernels.accumulator.rescale_rows`); exact either way.
  conditional_rescale: bool = False
  # The two consumers take turns on the tensor core (one's softmax runs while
  # the other's GEMMs execute). Off, the consumers run unsynchronized: where
  # a softmax takes longer than the other consumer's GEMMs (D = 64), taking
  # turns serializes the softmaxes and leaves the tensor core idle.
  pingpong: bool = True
  # float8 only: P is the P V wgmma's A operand in registers (no SMEM round
  # trip), where the row sums follow the hand-off (`ForwardStatics.
  # fp8_p_in_registers`). The heuristic's float8 configs set it (`fp8_config`).
  fp8_p_in_registers: bool = False
  # O narrower than Q (a value head dim of its own, 192 / 128): stage it in
  # the first Dv columns of the consumer's Q tile, as O of Q's width is,
  # instead of in tiles of its own (`ForwardStatics.separate_o_tiles`). Frees
  # num_consumers * block_q * Dv * 2 bytes (32 KiB at 192 / 128), what
  # 128-key blocks on two stages need there (208 KiB instead of 240). Not on
  # a persistent grid or in float8 (their O tiles are separate anyway).
  # `value_head_dim_config` sets it at 192 / 128.
  o_in_q_tile: bool = False
  # float8 with P in registers only (`p_operand_in_registers`): the rows'
  # running sums l are not added up by the softmax (one FADD per score) but
  # by the tensor core. The P V wgmma's accumulator gets
  # `FP8_ROW_SUM_COLUMNS` more columns, and a second, narrow wgmma with the
  # same P registers as its A operand adds P times a tile of e4m3 ones into
  # them: each of those columns is then l. O's rescale by alpha (the max's
  # correction) rescales them with O, and the epilogue reads l from them.
  # The sum is of the e4m3-rounded P, the values the numerator P V sums.
  # The ones tile is each consumer's own (`_fill_ones_tile`). Set by
  # `fp8_config` at the head dims of `FP8_ROW_SUMS_HEAD_DIMS`.
  fp8_row_sums_on_tensor_core: bool = False
  # A float8 cache under a 16-bit query only (`ForwardStatics.fp8_cache`,
  # issue #55): the two consumers compute the same `block_q` rows (a CTA
  # covers block_q rows, `block_q_cta`), each on half of the CTA's key
  # blocks, and consumer 0 merges consumer 1's (O, m, l) through SMEM before
  # the epilogue (`_merge_halves`). The producer loads the halves' blocks in
  # turns (ring step 2i + c holds consumer c's i-th block, `_Context.
  # split_block`), so with an even number of stages each consumer owns every
  # other slot (its K and V free barriers take one arrival). Each consumer
  # widens into one float16 tile for K and V (its K is read before its V is
  # widened), whose bytes also hold consumer 1's O for the merge. Two
  # widening + GEMM + softmax chains per CTA instead of one: the model is in
  # the performance notes, "Float8 cache decode: widening beside the
  # consumer". One CTA per work item, two consumers, no turns.
  consumers_split_keys: bool = False

  def __post_init__(self):
    if self.pingpong and self.num_consumers != 2:
      raise ValueError("ForwardConfig.pingpong alternates two consumers; "
                       f"got num_consumers={self.num_consumers} (set pingpong=False)")
    if self.num_sms < 0:
      raise ValueError(f"ForwardConfig.num_sms must be >= 0 (0: the GPU's SM count); "
                       f"got {self.num_sms}")
    if self.work_queue and not self.persistent:
      raise ValueError("ForwardConfig.work_queue hands out a persistent grid's tiles; "
                       "set persistent=True")
    if self.q_buffers not in (1, 2):
      raise ValueError(f"ForwardConfig.q_buffers must be 1 or 2; got {self.q_buffers}")
    if self.consumers_split_keys and (
        self.num_consumers != 2 or self.pingpong or self.persistent or self.num_kv_stages % 2):
      raise ValueError("ForwardConfig.consumers_split_keys needs two consumers without turns, "
                       "one CTA per item and an even number of stages; got "
                       f"{self.num_consumers} consumers, pingpong={self.pingpong}, "
                       f"persistent={self.persistent}, {self.num_kv_stages} stages")
    check_register_split("ForwardConfig", self.producer_registers, self.num_consumers,
                         self.consumer_registers)

  @property
  def q_depth(self) -> int:
    """Q tiles per consumer the kernel allocates."""
    return self.q_buffers if self.persistent else 1

  @property
  def block_q_cta(self) -> int:
    if self.consumers_split_keys:  # both consumers compute the same rows
      return self.block_q
    return self.num_consumers * self.block_q

  @property
  def p_operand_in_registers(self) -> bool:
    """`fp8_p_in_registers` where it applies: the row sums follow the
    hand-off (before it, an optimization barrier no 8-bit array passes
    pins the order, so P is staged in SMEM)."""
    return self.fp8_p_in_registers and not self.sum_before_handoff

  def separate_o_tiles(self, head_dim: int, value_head_dim: int, fp8: bool = False,
                       fp8_cache: bool = False) -> bool:
    """O is staged in tiles of its own (else in the consumer's Q tile): on a
    persistent grid (the next item's Q lands during the epilogue) and when
    O's head dim or dtype is not Q's, unless O is narrower and `o_in_q_tile`
    stages it in the Q tile's bytes (`o_rows_in_q_tile`)."""
    narrower_o_in_q = (self.o_in_q_tile and not self.persistent
                       and o_rows_in_q_tile(self.block_q, head_dim, value_head_dim) > 0)
    return (self.persistent or (value_head_dim != head_dim and not narrower_o_in_q)
            or fp8 or fp8_cache)

  @property
  def row_sums_on_tensor_core(self) -> bool:
    """`fp8_row_sums_on_tensor_core` where it applies: P is the P V wgmma's
    operand in registers (float8 only: `ForwardStatics.row_sums_on_tensor_core`)."""
    return self.fp8_row_sums_on_tensor_core and self.p_operand_in_registers

  def smem_bytes(self, head_dim: int, itemsize: int, segment_ids: bool = False,
                 value_head_dim: int | None = None, *, fp8: bool = False,
                 fp8_cache: bool = False) -> int:
    """SMEM the kernel allocates (without barriers and alignment padding);
    `segment_ids` adds the ring of the keys' ids (4 bytes a key and slot,
    `sm90_tiles.id_ring`); `value_head_dim` (V's and O's, None: head_dim).
    `fp8`: 8-bit Q, K and V, O tiles of `itemsize`, and a P tile per
    consumer where P is staged (`ForwardStatics.stages_p`: the sum before
    the hand-off). `fp8_cache`: 8-bit K and V rings, O tiles of `itemsize`
    and a 16-bit K and V tile per consumer (`ForwardStatics.fp8_cache`)."""
    value_head_dim = value_head_dim or head_dim
    o_itemsize, itemsize = itemsize, (1 if fp8 else itemsize)
    tile = self.num_consumers * self.block_q * head_dim * (2 if fp8_cache else itemsize)
    q_tiles = self.q_depth * tile
    kv_ring = self.num_kv_stages * self.block_kv * (head_dim + value_head_dim) * (
        1 if fp8_cache else itemsize)
    if fp8_cache and self.consumers_split_keys:  # one widened tile per consumer for K and V
      kv_ring += self.num_consumers * self.block_kv * head_dim * 2
    elif fp8_cache:  # the widened K and V tiles
      kv_ring += self.num_consumers * self.block_kv * (head_dim + value_head_dim) * 2
    # LSE rows, and a row for the work queue's cells (`schedule.WorkQueue`);
    # with `consumers_split_keys`, consumer 1's m and l rows.
    lse = (self.num_consumers + self.work_queue + 2 * self.consumers_split_keys) * (
        self.block_q * 4)
    o_tiles = (self.num_consumers * self.block_q * value_head_dim * o_itemsize
               if self.separate_o_tiles(head_dim, value_head_dim, fp8, fp8_cache) else 0)
    if fp8_cache and self.consumers_split_keys:  # or consumer 1's O in f32, for the merge
      o_tiles = max(o_tiles, self.block_q * value_head_dim * 4)
    if fp8 and not self.p_operand_in_registers:
      o_tiles += self.num_consumers * self.block_q * self.block_kv  # P tiles
    if fp8 and self.row_sums_on_tensor_core:
      o_tiles += self.num_consumers * self.block_q * self.block_kv  # the ones tiles
    # Mosaic GPU starts every scratch buffer at a multiple of 1 KiB: the
    # small ring takes a whole one at block_kv 64 (the LSE rows' padding is
    # in SMEM_RESERVE_BYTES).
    key_ids = cdiv(self.num_kv_stages * self.block_kv * 4, 1024) * 1024 if segment_ids else 0
    return q_tiles + kv_ring + lse + o_tiles + key_ids

  def fits_smem(self, head_dim: int, itemsize: int, segment_ids: bool = False,
                value_head_dim: int | None = None, *, fp8: bool = False,
                fp8_cache: bool = False) -> bool:
    """Whether `smem_bytes` leaves the barriers and padding their reserve."""
    return (self.smem_bytes(head_dim, itemsize, segment_ids, value_head_dim, fp8=fp8,
                            fp8_cache=fp8_cache)
            <= SMEM_LIMIT_BYTES - SMEM_RESERVE_BYTES)


def choose_config(head_dim: int, mask: MaskSpec, kv_seq: int | None = None,
                  q_seq: int | None = None, *, segment_ids: bool = False) -> ForwardConfig:
  """Block sizes, stages and grid per (padded) head dim. No autotuning at call time.

  `segment_ids` (the call packs documents) matters only for the grid:
  `packed_rows_use_a_work_queue`.

  Register budget per consumer thread (64 rows per warpgroup): O takes
  head_dim / 2 fp32 registers, S takes block_kv / 2, P a quarter of that.
  SMEM: Q tiles + 2 * stages * block_kv * head_dim * 2 bytes must fit 227 KiB.
  """
  d = padded_head_dim(head_dim)
  if d <= 64:
    # Half the GEMM work per softmax element of D = 128, so the softmax
    # outlasts the other consumer's GEMMs: taking turns (ping-pong) would
    # serialize the two softmaxes and idle the tensor core half the time.
    # Three consumers that do not take turns keep the exp2 unit and the
    # tensor core busy; 160 registers each hold S (64), P (32) and O (32) of
    # a 128-key block without spills. With three consumers the conditional
    # rescale pays at D = 64 too ("D = 64: three consumers without turns").
    # Short causal rows too: they had two ping-pong consumers on four stages
    # of 128-key blocks, 7-13 % slower at S 512-2048 ("Short causal rows at
    # D = 64").
    config = ForwardConfig(block_q=64, block_kv=128, num_kv_stages=2, num_consumers=3,
                           pingpong=False, producer_registers=24, consumer_registers=160,
                           sum_before_handoff=True, conditional_rescale=True)
  elif d <= 128:
    # Two ping-pong consumers, 128-key blocks, conditional rescale
    # ("Conditional rescale at D = 128").
    config = ForwardConfig(block_q=64, block_kv=128, num_kv_stages=2, conditional_rescale=True)
  else:
    # 192 and 256: O alone takes up to 128 registers; keep S small. The
    # persistent grid's separate O tiles do not fit SMEM here. Skipping O's
    # rescale saves 128 FMULs per thread and 64-key block at D = 256
    # ("Head dims 192 and 256").
    return ForwardConfig(block_q=64, block_kv=64, num_kv_stages=2, sum_before_handoff=True,
                         conditional_rescale=True)
  if kv_seq is not None:
    causal = pairs_causal_tiles(mask)
    limit = PERSISTENT_MAX_MEAN_BLOCKS_PAIRED if causal else PERSISTENT_MAX_MEAN_BLOCKS
    mean_blocks = mean_kv_blocks_per_tile(config, mask, kv_seq, q_seq)
    queued = (packed_rows_use_a_work_queue(d, mask, segment_ids)
              or short_causal_rows_use_a_work_queue(mask, mean_blocks, kv_seq, q_seq))
    if queued or mean_blocks <= limit:
      config = dataclasses.replace(config, persistent=True, work_queue=queued)
      # A second Q tile per consumer fits next to the ring and the O tiles
      # at D <= 128 (D = 128: 224.5 of 227 KiB, 225.5 with the keys' ids);
      # it loads the next tile's Q while the current one runs ("A second Q
      # tile per consumer").
      double = dataclasses.replace(config, q_buffers=2)
      if double.fits_smem(d, 2, segment_ids):
        config = double
  return config


def value_head_dim_config(config: ForwardConfig, head_dim: int,
                          value_head_dim: int) -> ForwardConfig:
  """At 192 / 128 (DeepSeek's training head dims, issue #56): 128-key
  blocks, O staged in the consumer's own Q tile (`o_in_q_tile`, which frees
  the 32 KiB they need) and the row sums after the hand-off, as at D = 128.
  H100, 2026-12-07, B2 S8192 H16 (`bench_forward.py --only D192/128
  --config ...`, one process), TFLOP/s dense / causal: 757 / 738 against
  645 / 641 for the 192 rule's 64-key blocks; with the sums before the
  hand-off 747 / 726; three stages of 64-key blocks 635 / 584. Measured
  without sinks, segment ids, mods, pages or float8, which keep the 192
  rule. Other pairs: `config` unchanged."""
  if (head_dim, value_head_dim) != (192, 128) or config.persistent:
    return config
  return dataclasses.replace(config, block_kv=128, o_in_q_tile=True, sum_before_handoff=False)


# Packed rows walk short documents whatever the row's length, so the mean
# above (which assumes one document) misjudges them; the documents' lengths,
# and so each tile's cost, are run-time data. A persistent grid hides each
# tile's Q load and O store behind its neighbours' work, but a fixed share
# per CTA leaves CTAs that drew long tiles working while the others idle; the
# work queue hands tiles out as CTAs free up. So causal packed rows at
# D <= 128 take the persistent grid with a work queue and two Q tiles per
# consumer at any length ("Packed rows: a work queue").
def packed_rows_use_a_work_queue(head_dim: int, mask: MaskSpec, segment_ids: bool) -> bool:
  """Whether a causal call with segment ids takes the persistent grid with
  a work queue regardless of its row length (measured: D64, D128)."""
  return segment_ids and head_dim <= 128 and pairs_causal_tiles(mask)


def short_causal_rows_use_a_work_queue(mask: MaskSpec, mean_blocks: float, kv_seq: int,
                                       q_seq: int | None) -> bool:
  """Whether a causal call without segment ids, whose tiles walk
  `mean_blocks` key blocks on average, takes the persistent grid with a work
  queue instead of fixed shares of paired tiles (measured: square rows)."""
  square = q_seq is None or q_seq == kv_seq
  return pairs_causal_tiles(mask) and square and mean_blocks <= QUEUED_MAX_MEAN_BLOCKS


# Causal rows without segment ids whose tiles walk at most this many key
# blocks on average take the work queue (tiles unpaired, heavy first, two Q
# tiles) instead of the static persistent grid with paired tiles or one CTA
# per tile; the threshold sits between the measured 16.5 (S4096) and 32.5
# (S8192) blocks ("Short causal rows: a work queue").
QUEUED_MAX_MEAN_BLOCKS = 24


# A persistent grid hides each work item's Q load and O store behind the
# previous item's work, which pays when items are short: up to a mean of 24
# key blocks per tile for one tile per unit (dense masks), 12 for causal
# tile pairs. Local windows keep items short at any length. The thresholds
# sit between the measured points ("The persistent grid's thresholds").
PERSISTENT_MAX_MEAN_BLOCKS = 24
PERSISTENT_MAX_MEAN_BLOCKS_PAIRED = 12


def mean_kv_blocks_per_tile(config: ForwardConfig, mask: MaskSpec, kv_seq: int,
                            q_seq: int | None = None) -> float:
  """KV blocks a CTA's query tile walks, averaged over the tiles (full lengths)."""
  q_seq = kv_seq if q_seq is None else q_seq
  mask = mask.at_lengths(q_seq, kv_seq)
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
    for mask in sm90_tiles.HEURISTIC_MASKS:
      for kv_seq in (1024, 8192):
        seen[(d, choose_config(d, mask, kv_seq))] = None
  return list(seen)


FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def check_supported(q_shape, k_shape, dtype, mask: MaskSpec) -> None:
  """Raises KernelUnsupported when this kernel cannot serve the call (float8
  operands: `fp8_mode` too)."""
  if jnp.dtype(dtype) in FP8_DTYPES:
    dtype = jnp.bfloat16  # the 16-bit checks, on the shapes
  sm90_tiles.check_supported("sm90 forward", q_shape, k_shape, dtype, mask)


def fp8_mode(q_dtype, k_dtype, v_dtype, *, page_table, heads_major: bool,
             q_batch_divisor: int) -> str | None:
  """The call's float8 operands: None (none), "all" (q, k and v, e4m3 or
  e5m2, in the usual arrangement) or "cache" (a bfloat16 or float16 query
  on float8 keys and values, in any arrangement, pages included); raises
  KernelUnsupported for other mixes, or all-float8 with a page table or in
  the decode arrangement."""
  dtypes = [jnp.dtype(x) for x in (q_dtype, k_dtype, v_dtype)]
  is_fp8 = [x in FP8_DTYPES for x in dtypes]
  if not any(is_fp8):
    return None
  if is_fp8 == [False, True, True] and dtypes[0] in (jnp.dtype(jnp.bfloat16),
                                                     jnp.dtype(jnp.float16)):
    return "cache"
  if not all(is_fp8):
    raise KernelUnsupported("sm90 forward: float8 needs k and v in float8, and q in float8, "
                            f"bfloat16 or float16; got {', '.join(map(str, dtypes))}")
  if page_table is not None or heads_major or q_batch_divisor != 1:
    raise KernelUnsupported("sm90 forward: an all-float8 call with a page table or in the "
                            "decode arrangement is not supported (a 16-bit query on float8 "
                            "pages is)")
  return "all"


class ForwardBarrierTable(BarrierTable):
  """Every mbarrier of the forward kernel (cf. `sm100_forward.ForwardBarrierTable`).

  Who arrives on each barrier and who waits on it, by role and accessor
  (no role touches a barrier except through these accessors):

  name      count    arrivals     arrived on by                       waited on by
  q_full    q copies 1 (TMA)      producer: producer_q (TMA of         consumer i: consumer_q, once
                                    consumer i's Q tile); with a         per work item
                                    work queue producer_q_stop, a
                                    plain arrive after its last item
  q_free    q copies 1            consumer i: consumer_q_release       producer: producer_q_acquire
                                    (every QK of the item completed;     (before it reloads the
                                    persistent grid only)                copy), drain_q*
  k_full    stages   k copies     producer: producer_k (TMA of K_n;    consumers: consumer_k, every
                       (TMA)        paged: one per page; plus one of     step
                                    the keys' segment ids, if any)
  k_free    stages   ring         consumers: consumer_k_release        producer: producer_k_acquire
                                    (S = Q K^T done, or the mask has     (before it refills the
                                    read the keys' ids)                  slot), drain_kv_rings*
  v_full    stages   v copies     producer: producer_v (TMA of V_n,    consumers: consumer_v, every
                       (TMA)        likewise)                            step
  v_free    stages   ring         consumers: consumer_v_release        producer: producer_v_acquire,
                                    (O += P V done)                      drain_kv_rings*
  tensor_core_turn
            1        consumers    consumers: consumer_end_turn (done   consumers: consumer_await_turn
                                    with its softmax),                   (the other issued its QK),
                                    consumer_sync_turn                   consumer_sync_turn
  half_full 1        1            consumer 1: consumer_publish_half    consumer 0:
                                    (its half's O, m and l stored in     consumer_merge_half, once
                                    SMEM after its last P V;             per work item, before it
                                    `consumers_split_keys` only)         reads them, `_merge_halves`

  q copies = num_consumers * q_depth, stages = num_kv_stages, ring readers =
  num_consumers (with `consumers_split_keys` 1: ring step 2i + c is consumer
  c's alone, `_Context.split_block`). * interpreter only. q_full / q_free:
  copy `slot("q_full", item, i)` of consumer i's Q tile for work item
  `item`, one of `config.q_depth` copies (two let a persistent CTA prefetch
  the next Q). k / v: ring slot `slot("k_full",
  step)` of the step-th KV block the CTA loads, its steps counting on across
  work items. tensor_core_turn: the two consumers take turns on the tensor
  core (ping-pong): both touch it equally often, in the same order; without
  `config.pingpong` its accessors do nothing.

  Work queue (`schedule.WorkQueue`): the producer's fetch thread stores item
  i + 1's unit in its SMEM cell while item i loads; a warpgroup barrier, then
  the TMA of item i + 1's Q (or the stop arrive) on q_full publishes it,
  and each consumer reads the cell after that wait.

  O epilogue: without a persistent grid it reuses consumer i's Q buffer
  (only consumer i touches it after q_full); a persistent CTA has separate
  O tiles, and consumer i waits for its previous TMA store to have read
  them (`wait_smem_to_gmem(0, wait_read_only=True)`) before rewriting.
  """

  ALLOCATION_ORDER = "as declared"
  Q_COPIES = Copies(depth="q depth")
  BARRIERS = {
      # name: Barrier(how many, arrivals, orders tensor core, arrived on by
      #               {accessor: how}, waited on by {accessor: how}, index)
      "q_full": Barrier("q copies", 1, False,
                        arrive={"producer_q": FILL, "producer_q_stop": ARRIVE},
                        wait={"consumer_q": WAIT}, index=Q_COPIES),
      "q_free": Barrier("q copies", 1, False, arrive={"consumer_q_release": ARRIVE},
                        wait={"producer_q_acquire": ACQUIRE}, index=Q_COPIES),
      "k_full": Barrier("stage", "k copies", False, arrive={"producer_k": FILL},
                        wait={"consumer_k": WAIT}, index=RING),
      "k_free": Barrier("stage", "ring readers", False, arrive={"consumer_k_release": ARRIVE},
                        wait={"producer_k_acquire": ACQUIRE}, index=RING),
      "v_full": Barrier("stage", "v copies", False, arrive={"producer_v": FILL},
                        wait={"consumer_v": WAIT}, index=RING),
      "v_free": Barrier("stage", "ring readers", False, arrive={"consumer_v_release": ARRIVE},
                        wait={"producer_v_acquire": ACQUIRE}, index=RING),
      "tensor_core_turn": Barrier(
          "one", "consumers", False,
          arrive={"consumer_end_turn": ARRIVE, "consumer_sync_turn": SYNC},
          wait={"consumer_await_turn": WAIT, "consumer_sync_turn": SYNC}, active="pingpong"),
      # Allocated only with `consumers_split_keys` (none of it otherwise).
      "half_full": Barrier("split", 1, False, arrive={"consumer_publish_half": PUBLISH},
                           wait={"consumer_merge_half": WAIT}),
  }

  @staticmethod
  def barrier_counts(call: "ForwardStatics") -> dict:
    cfg = call.config
    kv_copies = kv_copies_per_block(cfg.block_kv, call.page_size)
    return {"q copies": cfg.num_consumers * cfg.q_depth, "q depth": cfg.q_depth,
            "stage": cfg.num_kv_stages, "consumers": cfg.num_consumers,
            "k copies": kv_copies + call.has_segment_ids, "v copies": kv_copies,
            "one": 1, "pingpong": cfg.pingpong,
            "ring readers": 1 if cfg.consumers_split_keys else cfg.num_consumers,
            "split": int(cfg.consumers_split_keys)}

  # Interpreter-only drains of the last phases (see `BarrierTable`).
  def drain_kv_rings(self, num_steps) -> None:
    """Producer: observe the k_free / v_free phases of the last lap."""
    self._drain_last_lap(num_steps, "k_free", "v_free")

  def drain_q(self, num_items, next_acquired: bool = False) -> None:
    """Producer: observe the last q_free phase of every Q copy."""
    self._drain_last_items(num_items, "q_free", next_acquired)


# --- The kernel: one context, three roles -----------------------------------
# `_build_kernel` fixes the call's static facts (`ForwardStatics`); inside the kernel
# `_Context` adds the refs, the barriers and the CTA's work items, and the
# roles read it: `_producer` (TMA loads), `_consumer` with `_ConsumerTile`
# (Q K^T, online softmax, P V, the hand-off of the tensor core) and
# `_epilogue` (normalise, store O and the lse). The order of the traced
# operations is the program: moving one changes the kernel.

# Per-row values (m, l, lse) in the wgmma accumulator's row layout.
_ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)


@dataclasses.dataclass(frozen=True)
class ForwardStatics:
  """What one call fixes before tracing, read by every role."""

  config: ForwardConfig
  mask: MaskSpec
  q_seq: int  # padded query length (the arrays' extent)
  kv_valid: int  # the true key length; keys past it are TMA padding
  head_dim: int  # padded, of Q and K
  dtype: Any
  group: int  # q heads per kv head
  num_q_tiles: int  # CTA tiles of `config.block_q_cta` rows
  score: ScoreFunction  # how S becomes the softmax's logits (c: `exp2_scale`)
  # Causal-like masks: later query tiles see more keys; they run first
  # (`schedule.heavy_first_tile`) and a persistent grid pairs them.
  heavy_first: bool
  work: PersistentWork | None  # the persistent grid's work items
  interpreting: bool
  has_q_lengths: bool
  has_kv_lengths: bool
  has_segment_ids: bool = False
  has_sinks: bool = False  # a sinks operand [Nq]: the rows' softmax starts from it
  page_size: int | None = None  # keys per page of a paged K/V; None: K/V are [B, S, Nkv, D]
  # Bounded logits only (`ScoreFunction.bounds_logits`): the rows keep one fixed
  # max (no row max, no alpha, no rescale of O; `scores.fixed_max_softmax`).
  fixed_max: bool = False
  # Decode (`forward(..., heads_major=True)`): Q and O are [B, heads, q_seq,
  # D] (a one-token query's heads as rows is then a free reshape); else
  # [B, q_seq, heads, D].
  heads_major: bool = False
  q_batch_divisor: int = 1  # batch row b reads Q's row b // this
  # With `config.work_queue`: units from the GMEM counter (else the fixed
  # round robin the interpreter runs; `schedule.fixed_shares_under_vmap`).
  queue_counter: bool = True
  # Programmable scores (`forward(..., mods=)`): the CTA walks its key blocks
  # from the block lists (`scores.block_lists`), partial ones masked;
  # `score_mod` / `mask_mod` are the traced functions (`mod_functions`), or None.
  mods: bool = False
  score_mod: Any = None
  mask_mod: Any = None
  # Programmable scores in the decode arrangement (`sm90_decode`): tile row r
  # holds token r // G of query head kv_head * G + r % G (G this group), and
  # batch row b is chunk b % q_batch_divisor of sequence b // q_batch_divisor
  # (its keys from chunk * kv_valid on): what the mods see
  # (`_ConsumerTile.mod_positions`). None: rows are positions of one head.
  decode_group: int | None = None
  # V's and O's head dim (padded) where it differs from Q's and K's (192 /
  # 128 ...); None: head_dim. O then has SMEM tiles of its own.
  value_head_dim: int | None = None
  # float8 Q, K and V (`forward(..., descales=)`): V comes transposed ([B,
  # Nkv, Dv, Tk]: wgmma reads an 8-bit B operand only K-major), P is e4m3
  # (`fp8_p_in_registers`, else staged in SMEM), the logits are scaled by the head's q and k
  # descales and O by its v descale, and O is written in `out_dtype`.
  fp8: bool = False
  out_dtype: Any = None
  # A float8 cache under a 16-bit query (`forward(..., descales=)`): K and V
  # arrive in `kv_dtype` (e4m3 or e5m2) and each consumer widens every block
  # into float16 tiles of its own (exact: float16 holds every float8 value)
  # for float16 GEMMs (`dtype` is float16, the query converted); the logits
  # are scaled by the k descale and O by the v descale, written in `out_dtype`.
  kv_dtype: Any = None  # None: no float8 cache

  @property
  def fp8_cache(self) -> bool:
    return self.kv_dtype is not None

  @property
  def affine_score_mod(self) -> bool:
    """The score_mod is a * x + R(q_idx) + C(kv_idx) (`mod_functions.affine_form`):
    its logits take one FMA per score or none, and R moves the rows' running
    max (`_ConsumerTile.affine_logits`)."""
    return (self.score_mod is not None
            and mod_functions.affine_form(self.score_mod, self.decode_group) is not None)

  @property
  def exp2_scale(self) -> float:
    """The folded softmax scale: exp(scale*s - m) = exp2(c*s - m2)
    (`ScoreFunction.exp2_constant`)."""
    return self.score.exp2_constant

  @property
  def out_dim(self) -> int:
    """The head dim of V, of the accumulator and of the output."""
    return self.value_head_dim or self.head_dim

  @property
  def output_dtype(self):
    return self.out_dtype if self.fp8 or self.fp8_cache else self.dtype

  @property
  def has_descales(self) -> bool:
    """A descale operand (`_descale_operand`): float8 operands."""
    return self.fp8 or self.fp8_cache

  @property
  def separate_o_tiles(self) -> bool:
    """O is staged in tiles of its own (`ForwardConfig.separate_o_tiles`)."""
    return self.config.separate_o_tiles(self.head_dim, self.out_dim, self.fp8, self.fp8_cache)

  @property
  def o_view_of_q_tiles(self) -> bool:
    """O, narrower than Q, is staged in the consumer's Q tile through a view
    of the Q tiles' bytes as `o_rows_in_q_tile` rows of Dv (`ForwardConfig.
    o_in_q_tile`): TMA stores from a contiguous tile only, and the first Dv
    columns of a (rows, D) tile are not one."""
    return not self.separate_o_tiles and self.out_dim != self.head_dim

  @property
  def fp8_p_in_registers(self) -> bool:
    """A float8 P is the P V wgmma's A operand in registers, its keys in
    `accumulator.in_p_key_order` within 16-key chunks, as are V^T's
    (`forward`; `ForwardConfig.p_operand_in_registers`)."""
    return self.fp8 and self.config.p_operand_in_registers

  @property
  def row_sums_on_tensor_core(self) -> bool:
    """The rows' sums are accumulated by the tensor core in the accumulator's
    last `FP8_ROW_SUM_COLUMNS` columns (`ForwardConfig.fp8_row_sums_on_tensor_core`)."""
    return self.fp8 and self.config.row_sums_on_tensor_core

  @property
  def acc_dim(self) -> int:
    """Columns of a consumer's accumulator: O's, and the row sums' where the
    tensor core adds them up."""
    return self.out_dim + (FP8_ROW_SUM_COLUMNS if self.row_sums_on_tensor_core else 0)

  @property
  def stages_p(self) -> bool:
    """P goes through SMEM for the P V wgmma: in the interpreter (which takes
    no A operand in registers) and a float8 P not in registers."""
    return self.interpreting or (self.fp8 and not self.fp8_p_in_registers)

  @property
  def masked_logit(self) -> float:
    """The logit of a masked key: it loses every max (min when c < 0). With
    soft-cap c = cap * log2(e) > 0 whatever the scale's sign (the sign is
    inside the tanh), so -inf."""
    return -jnp.inf if self.exp2_scale >= 0 else jnp.inf


@dataclasses.dataclass(frozen=True)
class _Refs:
  """The kernel's operands in GMEM and its SMEM buffers."""

  q: Any
  k: Any
  v: Any
  q_len: Any  # None without query lengths
  kv_len: Any  # None without key lengths
  q_ids: Any  # segment ids [B, rows of every tile slot]; None without segment ids
  kv_ids: Any  # segment ids [B, keys of every key block]
  segment_ranges: Any  # [B, consumer tiles, 4]: `tile_ranges_operand` of the ids
  sinks: Any  # f32 [Nq] in GMEM; None without sinks
  page_table: Any  # int32 [B, pages] in GMEM; None without a paged K/V
  descales: Any  # f32 [2, Nq] in GMEM (q*k descale, v descale per q head); float8 only
  out: Any
  lse: Any
  q_smem: Any  # Q tiles (and O, without a persistent grid)
  k_smem: Any  # K ring
  v_smem: Any  # V ring
  lse_smem: Any  # LSE rows
  o_smem: Any  # O tiles (`ForwardStatics.separate_o_tiles` only)
  p_smem: Any  # P staging (`ForwardStatics.stages_p` only)
  kv_ids_smem: Any  # the keys' segment ids, a ring beside K's; None without segment ids
  # A float8 cache (`ForwardStatics.fp8_cache`): each consumer's float16 K
  # and V tiles, widened from the rings; None otherwise.
  k16_smem: Any = None
  v16_smem: Any = None
  # `ForwardConfig.consumers_split_keys`: consumer 1's O (f32, [block_q, Dv])
  # for the merge, in the O tiles' bytes (and k16_smem is v16_smem, one tile
  # per consumer for K and V); None otherwise.
  merge_smem: Any = None
  # Each consumer's tile of e4m3 ones (`ForwardStatics.row_sums_on_tensor_core`
  # only, `_fill_ones_tile`); None otherwise.
  ones_smem: Any = None
  # Programmable scores only (`ForwardStatics.mods`), in GMEM: the block lists
  # (`scores.block_lists`: counts int32 [B, Hm, tiles, 2], order int32
  # [B, Hm, tiles, nk]), the (batch, head) offsets the mods add (int32 [2]),
  # and the captured arrays of score_mod and mask_mod.
  block_counts: Any = None
  block_order: Any = None
  index_offsets: Any = None
  score_captured: tuple = ()
  mask_captured: tuple = ()

  @classmethod
  def unpack(cls, call: ForwardStatics, refs) -> tuple["_Refs", Any]:
    """(refs, barrier refs) from the kernel's arguments."""
    refs = list(refs)
    q, k, v = refs[:3]
    del refs[:3]
    q_len = refs.pop(0) if call.has_q_lengths else None
    kv_len = refs.pop(0) if call.has_kv_lengths else None
    q_ids = kv_ids = segment_ranges = None
    if call.has_segment_ids:
      # (The block lists hold the ids' tile ranges where there are mods.)
      q_ids, kv_ids = refs[:2]
      segment_ranges = None if call.mods else refs[2]
      del refs[:2 if call.mods else 3]
    sinks = refs.pop(0) if call.has_sinks else None
    page_table = refs.pop(0) if call.page_size is not None else None
    descales = refs.pop(0) if call.has_descales else None
    mod_refs = {}
    if call.mods:
      mod_refs = dict(block_counts=refs.pop(0), block_order=refs.pop(0),
                      index_offsets=refs.pop(0))
      for key, mod in (("score_captured", call.score_mod), ("mask_captured", call.mask_mod)):
        count = 0 if mod is None else len(mod.captured_avals)
        mod_refs[key] = tuple(refs[:count])
        del refs[:count]
    out, lse, smem, barrier_refs = refs
    q_smem, k_smem, v_smem, lse_smem, *optional_smem = smem
    o_smem = optional_smem.pop(0) if call.separate_o_tiles else None
    merge_smem = None
    if call.fp8_cache and call.config.consumers_split_keys:  # the RefUnion of `_scratch_smem`
      o_smem, merge_smem = o_smem
    if call.o_view_of_q_tiles:  # (Q tiles, O's view of their bytes)
      q_smem, o_smem = q_smem
    p_smem = optional_smem.pop(0) if call.stages_p else None
    kv_ids_smem = optional_smem.pop(0) if call.has_segment_ids else None
    ones_smem = optional_smem.pop(0) if call.row_sums_on_tensor_core else None
    if call.fp8_cache and call.config.consumers_split_keys:
      k16_smem, = v16_smem, = optional_smem
    else:
      k16_smem, v16_smem = optional_smem if call.fp8_cache else (None, None)
    return cls(q, k, v, q_len, kv_len, q_ids, kv_ids, segment_ranges, sinks, page_table,
               descales, out, lse, q_smem, k_smem, v_smem, lse_smem, o_smem, p_smem,
               kv_ids_smem, k16_smem, v16_smem, merge_smem=merge_smem, ones_smem=ones_smem,
               **mod_refs), barrier_refs


def _scratch_smem(call: ForwardStatics) -> list:
  """The SMEM buffers, in the order `_Refs.unpack` reads them."""
  cfg, d, dtype = call.config, call.head_dim, call.dtype
  bq, bk = cfg.block_q, cfg.block_kv
  if call.fp8:
    return _fp8_scratch_smem(call)

  def ring(shape):
    if call.fp8_cache:  # 8-bit tiles swizzled as wide as their rows allow
      return plgpu.SMEM(shape, call.kv_dtype, transforms=smem_transforms(call.kv_dtype, shape[-1]))
    return smem_tile(shape, dtype)

  q_tiles = smem_tile((cfg.q_depth * cfg.num_consumers, bq, d), dtype)  # Q tiles (then O)
  if call.o_view_of_q_tiles:
    # O narrower than Q: consumer i's O is the first block_q rows of view i,
    # whose bytes are Q tile i's (`ForwardConfig.o_in_q_tile`).
    rows = o_rows_in_q_tile(bq, d, call.out_dim)
    q_tiles = plgpu.RefUnion(q_tiles, smem_tile((cfg.num_consumers, rows, call.out_dim), dtype))
  smem = [
      q_tiles,
      ring((cfg.num_kv_stages, bk, d)),  # K ring
      ring((cfg.num_kv_stages, bk, call.out_dim)),  # V ring
      # LSE rows (then, with a work queue, a row of its cells; with
      # `consumers_split_keys` consumer 1's m and l)
      plgpu.SMEM((cfg.num_consumers + cfg.work_queue + 2 * cfg.consumers_split_keys, bq),
                 jnp.float32),
  ]
  if call.fp8_cache and cfg.consumers_split_keys:
    # The O tiles, whose bytes first hold consumer 1's O for the merge
    # (`_merge_halves`).
    smem.append(plgpu.RefUnion(smem_tile((cfg.num_consumers, bq, call.out_dim),
                                         call.output_dtype),
                               smem_tile((bq, call.out_dim), jnp.float32)))
  elif call.separate_o_tiles:
    # O tiles of their own, so the next work item's Q can land during the
    # epilogue (or because O's head dim is not Q's).
    smem.append(smem_tile((cfg.num_consumers, bq, call.out_dim), call.output_dtype))
  if call.stages_p:
    smem.append(smem_tile((cfg.num_consumers, bq, bk), dtype))  # P staging
  if call.has_segment_ids:
    smem.append(id_ring(cfg.num_kv_stages, bk))  # the keys' segment ids
  if call.fp8_cache and cfg.consumers_split_keys:
    smem.append(smem_tile((cfg.num_consumers, bk, d), dtype))  # each one's K, then V (d == Dv)
  elif call.fp8_cache:  # each consumer's widened K and V
    smem.append(smem_tile((cfg.num_consumers, bk, d), dtype))
    smem.append(smem_tile((cfg.num_consumers, bk, call.out_dim), dtype))
  return smem


def _fp8_scratch_smem(call: ForwardStatics) -> list:
  """`_scratch_smem` of a float8 call: 8-bit tiles swizzled as wide as their
  rows allow (a 64-wide head dim: 64 bytes; Q and K, P and V^T share their
  rows' length, so each GEMM's operands share a swizzle), the V ring
  transposed (Dv rows of block_kv keys), O in tiles of its own in the output
  dtype, and a P tile per consumer."""
  cfg, d, dtype = call.config, call.head_dim, call.dtype
  bq, bk = cfg.block_q, cfg.block_kv
  tile = lambda shape, dt: plgpu.SMEM(shape, dt, transforms=smem_transforms(dt, shape[-1]))
  smem = [
      tile((cfg.q_depth * cfg.num_consumers, bq, d), dtype),  # Q tiles
      tile((cfg.num_kv_stages, bk, d), dtype),  # K ring
      tile((cfg.num_kv_stages, call.out_dim, bk), dtype),  # V^T ring
      plgpu.SMEM((cfg.num_consumers + cfg.work_queue, bq), jnp.float32),  # LSE rows
      smem_tile((cfg.num_consumers, bq, call.out_dim), call.output_dtype),  # O tiles
  ]
  if call.stages_p:
    smem.append(tile((cfg.num_consumers, bq, bk), FP8_P_DTYPE))  # P staging
  if call.has_segment_ids:
    smem.append(id_ring(cfg.num_kv_stages, bk))
  if call.row_sums_on_tensor_core:
    # Each consumer's tile of ones (`_fill_ones_tile`): the row sums' wgmma
    # reads its first FP8_ROW_SUM_COLUMNS rows as its B operand; it has
    # block_q rows so that the WGMMA layout's store can fill it.
    smem.append(tile((cfg.num_consumers, bq, bk), FP8_P_DTYPE))
  return smem


@dataclasses.dataclass(frozen=True)
class _WorkItem:
  """One (batch, q head, q tile) work item of a CTA, as both roles see it."""

  batch_idx: Any
  head: Any
  q_len: Any
  kv_len: Any
  cta_q_lo: Any  # first query row of the CTA tile
  lo: Any  # the producer loads KV blocks [lo, hi) for the whole CTA tile
  hi: Any
  tile: Any  # the CTA tile's index; consumer c's rows are tile `tile * num_consumers + c`
  # Programmable scores (`ForwardStatics.mods`): [lo, hi) are positions in the CTA's
  # block list, [lo, partial) its partial blocks, [partial, hi) its full ones.
  partial: Any = None


@dataclasses.dataclass(frozen=True)
class _Context:
  """What the roles of one CTA share: the call, the refs, the barriers, the
  warpgroup's index and the CTA's work items."""

  call: ForwardStatics
  refs: _Refs
  bars: ForwardBarrierTable
  wg: Any  # this warpgroup's index
  num_items: Any  # work items of this CTA; None with a work queue
  item_coords: Callable  # i -> (batch, q head, q tile) of work item i; None with a queue
  queue: WorkQueue | None = None  # the persistent grid's work queue, if it has one

  @classmethod
  def create(cls, call: ForwardStatics, refs: _Refs, barrier_refs) -> "_Context":
    cfg = call.config
    bars = ForwardBarrierTable(call, barrier_refs)
    wg = lax.axis_index("wg")
    if cfg.work_queue:
      cells = refs.lse_smem.at[cfg.num_consumers]
      queue = WorkQueue.create(cells, cfg.q_depth, call.work, lax.axis_index("ctas"),
                               counter=call.queue_counter and not call.interpreting)
      return cls(call, refs, bars, wg, None, None, queue)
    if cfg.persistent:
      cta = lax.axis_index("ctas")
      num_items = call.work.count(cta)
      item_coords = functools.partial(call.work.coords, cta)
    else:
      # One work item per CTA; heavy causal tiles are launched first.
      tile = heavy_first_tile(lax.axis_index("q_tiles"), call.num_q_tiles, call.heavy_first)
      coords = (lax.axis_index("batch"), lax.axis_index("heads"), tile)
      num_items, item_coords = 1, lambda i: coords
    return cls(call, refs, bars, wg, num_items, item_coords)

  def item(self, i, unit=None) -> _WorkItem:
    """Everything about this CTA's work item i both roles agree on (with a
    work queue: the item of `unit`)."""
    call, cfg = self.call, self.call.config
    if unit is None:
      batch_idx, head, tile = self.item_coords(i)
    else:
      batch_idx, head, tile = call.work.unit_coords(unit)
    # A split-K chunk's given length counts past the chunk
    # (`MaskSpec.key_chunk`): the mask cuts it there, after aligning the band by it.
    kv_bound = call.kv_valid
    if call.mask.key_chunk is not None and call.has_kv_lengths:
      kv_bound = jnp.iinfo(jnp.int32).max
    q_len, kv_len = sequence_lengths(self.refs.q_len, self.refs.kv_len, batch_idx, call.q_seq,
                                     kv_bound)
    cta_q_lo = tile * cfg.block_q_cta
    if call.mods:
      # The CTA's block list: its partial blocks, then its full ones.
      at = (batch_idx, self.list_head(head), tile)
      partial = self.refs.block_counts[(*at, 0)]
      # (lo a Python int: a concrete array closed over by `p_times_v`'s
      # `pl.run_state` body would become an input Mosaic GPU cannot lower.)
      return _WorkItem(batch_idx, head, q_len, kv_len, cta_q_lo, 0,
                       partial + self.refs.block_counts[(*at, 1)], tile, partial)
    if call.has_segment_ids:
      # The blocks some consumer computes: its segments can meet the CTA
      # tile's in a narrower span than the band allows.
      walked = hull([
          self.consumer_blocks(batch_idx, tile, c, cta_q_lo + c * cfg.block_q, q_len, kv_len)
          for c in range(cfg.num_consumers)])
      lo, hi = walked.lo, walked.hi
    else:
      blocks = kv_tile_ranges(call.mask, cta_q_lo, cta_q_lo + cfg.block_q_cta, q_len, kv_len,
                              cfg.block_kv)
      lo, hi = blocks.lo, blocks.hi
    return _WorkItem(batch_idx, head, q_len, kv_len, cta_q_lo, lo, hi, tile)

  def consumer_q_lo(self, item: _WorkItem, c):
    """The first query row of consumer c's tile of `item` (with
    `consumers_split_keys` every consumer's rows are the CTA's)."""
    cfg = self.call.config
    return item.cta_q_lo + (0 if cfg.consumers_split_keys else c * cfg.block_q)

  def item_steps(self, item: _WorkItem):
    """Ring steps of `item`: one per key block, or with `consumers_split_keys`
    two per block of the larger half (`split_block`)."""
    if not self.call.config.consumers_split_keys:
      return item.hi - item.lo
    return 2 * self._half(item)

  def _half(self, item: _WorkItem):
    """Key blocks of the first half of `item`'s range (the second has as
    many or one fewer)."""
    return lax.div(jnp.maximum(item.hi - item.lo, 0) + 1, jnp.int32(2))

  def split_range(self, item: _WorkItem, c):
    """`consumers_split_keys`: (lo, hi) of consumer c's half of the key
    blocks; the second half's range may end one block past `item.hi` (a
    step whose block is not its own, `split_block`)."""
    half = self._half(item)
    lo = item.lo + c * half
    return lo, lo + half

  def split_block(self, item: _WorkItem, i):
    """`consumers_split_keys`: the key block the producer loads at ring step
    `step0 + i` of `item`: block i // 2 of consumer (i % 2)'s half. Where the
    second half is one block shorter its last step loads block hi - 1 again
    (a valid block; consumer 1 only releases it, `walk_kv_blocks`), so
    that every consumer's steps keep their parity."""
    c, k = lax.rem(i, jnp.int32(2)), lax.div(i, jnp.int32(2))
    lo, _ = self.split_range(item, c)
    return jnp.minimum(lo + k, item.hi - 1)

  def list_head(self, head):
    """The head index of the block lists (`_Refs.block_order`): theirs have
    one head where no mask varies with the head."""
    return head if self.refs.block_order.shape[1] > 1 else 0

  def kv_block(self, item: _WorkItem, j):
    """The key block of walk position j: j itself, or with programmable
    scores the list's j-th entry (`scores.block_lists`, a scalar GMEM load)."""
    if not self.call.mods:
      return j
    return self.refs.block_order[item.batch_idx, self.list_head(item.head), item.tile, j]

  def consumer_blocks(self, batch_idx, tile, c, q_lo, q_len, kv_len) -> TileRanges:
    """The key blocks consumer c's rows (from `q_lo`) of CTA tile `tile` see:
    the band and lengths, and the blocks their segment ids can meet (producer
    and consumers both derive the CTA's range from these)."""
    cfg, segments = self.call.config, None
    if self.refs.segment_ranges is not None:
      segments = read_tile_ranges(self.refs.segment_ranges, batch_idx,
                                  tile * cfg.num_consumers + c)
    return consumer_kv_blocks(self.call.mask, cfg, q_lo, q_len, kv_len, segments)

  def item_loop(self, body, init):
    """Runs body(i, carry) over this CTA's work items (a loop even for one
    item, so the ring position is a run-time value wgmma closures accept)."""
    return lax.fori_loop(0, self.num_items, body, init)


def consumer_kv_blocks(mask: MaskSpec, cfg: ForwardConfig, q_lo, q_len, kv_len,
                       segments: TileRanges | None = None) -> TileRanges:
  """The key blocks a consumer's `block_q` rows from `q_lo` compute (and
  the full ones among them): the band and the lengths, intersected with the
  blocks their segment ids meet (`segments`, a row of `segment_operands`'
  ranges) when there are segment ids."""
  blocks = kv_tile_ranges(mask, q_lo, q_lo + cfg.block_q, q_len, kv_len, cfg.block_kv)
  return blocks if segments is None else blocks.intersect(segments)


def _mod_binder(ctx: _Context, item: _WorkItem, q_lo) -> Callable:
  """bind(mod, captured refs) -> the mod bound to the (batch, head) of a
  consumer tile of `item` (global indices: a sharded call's offsets added),
  before its walk. In the decode arrangement (`ForwardStatics.decode_group`
  = G) the tile's rows hold G query heads of KV head `item.head` (row r:
  head item.head * G + r % G) of sequence batch_idx // q_batch_divisor:
  the mod is bound for each head and its values merged along the rows
  (`mod_functions.bind_rows`)."""
  call, offsets = ctx.call, ctx.refs.index_offsets
  if call.decode_group is None:
    indices = (item.batch_idx + offsets[0], item.head + offsets[1])
    loader = sm90_tiles.element_loader()  # tables read per element
    return lambda mod, refs: mod_functions.bind(mod, refs, *indices, loader=loader)
  g, cfg = call.decode_group, call.config
  batch = item.batch_idx
  if call.q_batch_divisor != 1:
    batch = lax.div(batch, jnp.int32(call.q_batch_divisor))
  heads = [item.head * g + h + offsets[1] for h in range(g)]

  def member():  # r % G of the tile's rows, along them (read only where G > 1)
    rows = q_lo + plgpu.broadcasted_iota(jnp.int32, (cfg.block_q,), 0, layout=_ROW_LAYOUT)
    return lax.rem(rows, jnp.int32(g))

  along = mod_functions.Along(member, 0, (cfg.block_q, cfg.block_kv))
  # Packed rows read a table by its entries merged along the rows (a chain of
  # selects, as `mod_functions.packed_rows_problem` checks), not per element.
  return lambda mod, refs: mod_functions.bind_rows(mod, refs, batch + offsets[0], heads, along)


def _along_map(x, fn):
  """fn applied to the positions `x` (an `Along`, kept lazy and keeping its
  bound, or a tile)."""
  if isinstance(x, mod_functions.Along):
    return mod_functions.Along(lambda: fn(x.vector), x.axis, x.shape, x.bound)
  return fn(x)


def _producer(ctx: _Context) -> None:
  """Warpgroup `num_consumers`: per work item, TMA loads of the consumers' Q
  tiles, then of the K and V blocks [lo, hi) into the rings."""
  cfg, refs, bars = ctx.call.config, ctx.refs, ctx.bars
  plgpu.set_max_registers(cfg.producer_registers, action="decrease")

  def produce_item(i, item: _WorkItem, step0):
    """Item i's Q tiles, then its KV blocks (a work queue's loop waited for
    the Q copies already)."""
    for c_i in range(cfg.num_consumers):
      if cfg.persistent and ctx.queue is None:
        bars.producer_q_acquire(i, c_i)
      bars.producer_q([(_q_rows(ctx, item, ctx.consumer_q_lo(item, c_i)), refs.q_smem)], i,
                      c_i)
    kv_head = lax.div(item.head, jnp.int32(ctx.call.group))

    def load_block(step, n):
      """Key block of walk position n (the CTA's n-th) into ring step `step`."""
      j = ctx.kv_block(item, n)  # n itself without programmable scores
      fill = _kv_block_fill(ctx, item, j, kv_head)
      bars.producer_k_acquire(step)
      fill(bars.producer_k, refs.k, refs.k_smem, step)
      if ctx.call.has_segment_ids:  # the keys' ids ride on the K slot's barrier
        bars.producer_k([(refs.kv_ids.at[item.batch_idx, pl.ds(j * cfg.block_kv, cfg.block_kv)],
                          refs.kv_ids_smem)], step)
      bars.producer_v_acquire(step)
      if ctx.call.fp8:  # V^T [B, Nkv, Dv, Tk]: the block's columns
        bars.producer_v([(refs.v.at[item.batch_idx, kv_head, :,
                                    pl.ds(j * cfg.block_kv, cfg.block_kv)], refs.v_smem)],
                        step)
      else:
        fill(bars.producer_v, refs.v, refs.v_smem, step)

    if cfg.consumers_split_keys:  # the two halves' blocks in turns
      pl.loop(0, ctx.item_steps(item))(
          lambda i: load_block(step0 + i, ctx.split_block(item, i)))
    else:
      pl.loop(item.lo, item.hi)(lambda n: load_block(step0 + n - item.lo, n))
    return step0 + ctx.item_steps(item)

  if ctx.queue is not None:
    # The unit past the end rides on a plain arrive on each Q barrier.
    total_steps = ctx.queue.producer_loop(
        cfg.num_consumers, prepare=lambda unit: ctx.item(None, unit), produce=produce_item,
        acquire=bars.producer_q_acquire, stop=bars.producer_q_stop, drain=bars.drain_q)
    bars.drain_kv_rings(total_steps)
    return
  total_steps = ctx.item_loop(lambda i, step0: produce_item(i, ctx.item(i), step0),
                              jnp.int32(0))
  bars.drain_kv_rings(total_steps)
  if cfg.persistent:
    bars.drain_q(ctx.num_items)


def _q_rows(ctx: _Context, item: _WorkItem, row0):
  """The GMEM rows of Q from `row0` that one consumer tile of `item` reads
  (past the rows Q has, TMA fills zeros)."""
  call, q = ctx.call, ctx.refs.q
  rows = pl.ds(row0, call.config.block_q)
  batch = item.batch_idx
  if call.q_batch_divisor != 1:
    batch = lax.div(batch, jnp.int32(call.q_batch_divisor))
  return q.at[batch, item.head, rows] if call.heads_major else q.at[batch, rows, item.head]


def _kv_block_fill(ctx: _Context, item: _WorkItem, j, kv_head) -> Callable:
  """fill(producer_fill, src, smem, step): the TMA load(s) of KV block j of
  `item` from K or V (`src`) into the ring slot of `step`, by the producer's
  FILL accessor of that ring (`producer_k` or `producer_v`)."""
  bk = ctx.call.config.block_kv
  if ctx.call.page_size is not None:
    return _paged_block_fill(ctx, item, j, kv_head)
  keys = (item.batch_idx, pl.ds(j * bk, bk), kv_head)
  return lambda producer_fill, src, smem, step: producer_fill([(src.at[keys], smem)], step)


def _paged_block_fill(ctx: _Context, item: _WorkItem, j, kv_head) -> Callable:
  """`_kv_block_fill` through the page table: one TMA per page of block j
  (pages shorter than a block, each into its rows of the slot) or one from
  inside the block's page. The page numbers are read here, before the
  producer waits for the slot, so their GMEM latency hides behind the wait;
  K and V share them."""
  bk, page_size = ctx.call.config.block_kv, ctx.call.page_size
  table, row = ctx.refs.page_table, item.batch_idx
  if page_size < bk:
    per_block = bk // page_size
    pages = [table[row, j * per_block + c] for c in range(per_block)]

    def fill_pages(producer_fill, src, smem, step):  # each page into its rows of the slot
      producer_fill([(src.at[page, pl.ds(0, page_size), kv_head], smem,
                      pl.ds(c * page_size, page_size)) for c, page in enumerate(pages)], step)
    return fill_pages
  per_page = jnp.int32(page_size // bk)
  page = table[row, lax.div(j, per_page)]
  keys = (page, pl.ds(lax.rem(j, per_page) * bk, bk), kv_head)
  return lambda producer_fill, src, smem, step: producer_fill([(src.at[keys], smem)], step)


def kv_copies_per_block(block_kv: int, page_size: int | None) -> int:
  """TMA copies that fill one K (or V) ring slot: one per page inside a
  block of a paged K/V, else one."""
  return 1 if page_size is None else max(block_kv // page_size, 1)


def _consumer(ctx: _Context) -> None:
  """Warpgroups 0 .. num_consumers - 1: consumer `wg` computes the rows
  [wg * block_q, (wg + 1) * block_q) of every work item of the CTA."""
  plgpu.set_max_registers(ctx.call.config.consumer_registers, action="increase")
  if ctx.call.row_sums_on_tensor_core:
    _fill_ones_tile(ctx)
  if ctx.queue is not None:
    ctx.queue.consumer_loop(ctx.bars.consumer_q, ctx.wg,
                            lambda i, unit, step0: _consume_item(ctx, i, step0, unit))
  else:
    ctx.item_loop(functools.partial(_consume_item, ctx), jnp.int32(0))
  plgpu.wait_smem_to_gmem(0)


def _fill_ones_tile(ctx: _Context) -> None:
  """The consumer's tile of e4m3 ones, written once before its first work
  item (`ForwardConfig.fp8_row_sums_on_tensor_core`). Only this consumer's
  row-sum wgmmas read it and nothing writes it again, so no barrier guards
  it: `commit_smem` (a proxy fence and a warpgroup barrier) makes the
  warpgroup's stores visible to its wgmmas."""
  cfg = ctx.call.config
  # Stored as P is staged (an f32 WGMMA array cast to e4m3): a layout the
  # swizzled tile's store takes.
  ones = plgpu.layout_cast(jnp.full((cfg.block_q, cfg.block_kv), 1.0, jnp.float32),
                           plgpu.Layout.WGMMA)
  ctx.refs.ones_smem.at[ctx.wg][...] = ones.astype(FP8_P_DTYPE)
  plgpu.commit_smem()


def _consume_item(ctx: _Context, i, step0, unit=None):
  """One consumer's share of work item i, whose first KV block sits at ring
  position `step0`; returns the ring position after the item. With a work
  queue, `unit` is the item's (its Q wait came first)."""
  tile = _ConsumerTile.create(ctx, i, step0, unit)
  acc, m, l = tile.walk_kv_blocks()
  if ctx.call.config.persistent:
    ctx.bars.consumer_q_release(i, ctx.wg)  # every QK of this tile completed
  if ctx.call.config.consumers_split_keys:
    _merge_halves(ctx, tile, acc, m, l)
  else:
    _epilogue(ctx, tile, acc, m, l)
  return step0 + ctx.item_steps(tile.item)


@dataclasses.dataclass(frozen=True)
class _ConsumerTile:
  """One consumer's Q tile of one work item: the walk over the CTA's KV
  blocks, with the steps it runs per block."""

  ctx: _Context
  index: Any  # the work item's index in the CTA
  item: _WorkItem
  step0: Any  # ring position of KV block `item.lo`
  q_tile: Any
  o_tile: Any
  q_lo: Any  # first query row of this consumer's tile
  own: TileRanges  # the blocks its rows see, inside [item.lo, item.hi)
  q_segment: Any  # the rows' segment ids (`_ROW_LAYOUT`); None without segment ids
  sink: Any  # the head's sink logit (f32 scalar); None without sinks
  q_waited: bool = False  # the Q wait came before (a work queue's unit rides with it)
  # The key blocks [walk_lo, walk_hi) this consumer steps through: the CTA's
  # [lo, hi), or with `consumers_split_keys` its half (`_Context.split_range`).
  walk_lo: Any = None
  walk_hi: Any = None
  # Programmable scores: the score_mod and mask_mod bound to the tile's
  # (batch, head) as they see them (a sharded call's offsets added), before
  # the walk, so their reads of captured arrays happen once per tile
  # (`mod_functions.bind`); None without them.
  score_fn: Any = None
  mask_fn: Any = None
  # float8 operands: the head's q*k descale (scales the logits) and v
  # descale (scales O), f32 scalars; None otherwise.
  qk_descale: Any = None
  v_descale: Any = None

  @classmethod
  def create(cls, ctx: _Context, i, step0, unit=None) -> "_ConsumerTile":
    cfg, wg = ctx.call.config, ctx.wg
    item = ctx.item(i, unit)
    q_tile = ctx.refs.q_smem.at[ctx.bars.slot("q_full", i, wg)]
    if ctx.call.separate_o_tiles:
      o_tile = ctx.refs.o_smem.at[wg]
    elif ctx.call.o_view_of_q_tiles:  # `ForwardConfig.o_in_q_tile`
      o_tile = ctx.refs.o_smem.at[wg, pl.ds(0, cfg.block_q)]
    else:
      o_tile = q_tile
    q_lo = ctx.consumer_q_lo(item, wg)
    walk_lo, walk_hi = item.lo, item.hi
    if cfg.consumers_split_keys:
      walk_lo, walk_hi = ctx.split_range(item, wg)
    own = score_fn = mask_fn = None
    if ctx.call.mods:  # both consumers walk the CTA's list (`walk_block_list`)
      bind = _mod_binder(ctx, item, q_lo)
      if ctx.call.score_mod is not None:
        score_fn = bind(ctx.call.score_mod, ctx.refs.score_captured)
      if ctx.call.mask_mod is not None:
        mask_fn = bind(ctx.call.mask_mod, ctx.refs.mask_captured)
    else:
      own = ctx.consumer_blocks(item.batch_idx, item.tile, wg, q_lo, item.q_len,
                                item.kv_len).within(walk_lo, jnp.minimum(walk_hi, item.hi)
                                                    if cfg.consumers_split_keys else walk_hi)
    q_segment = None
    if ctx.call.has_segment_ids:
      # The rows' ids, for the element mask of boundary blocks.
      q_segment = load_ids(ctx.refs.q_ids, item.batch_idx, q_lo, cfg.block_q, along_rows=True)
    # One scalar per tile from GMEM, loaded before the wait for Q hides its latency.
    sink = ctx.refs.sinks[item.head] if ctx.call.has_sinks else None
    descales = {}
    if ctx.call.has_descales:
      descales = dict(qk_descale=ctx.refs.descales[0, item.head],
                      v_descale=ctx.refs.descales[1, item.head])
    return cls(ctx, i, item, step0, q_tile, o_tile, q_lo, own, q_segment, sink,
               q_waited=unit is not None, walk_lo=walk_lo, walk_hi=walk_hi, score_fn=score_fn,
               mask_fn=mask_fn, **descales)

  def walk_kv_blocks(self):
    """(O, m, l) of the tile, unnormalised. Every consumer steps through all
    of the CTA's blocks [lo, hi) to keep the ring protocol; it computes only
    its own ones, masking the elements of the boundary blocks."""
    cfg, bars, wg = self.ctx.call.config, self.ctx.bars, self.ctx.wg
    bq, lo, hi, own = cfg.block_q, self.walk_lo, self.walk_hi, self.own
    if not self.q_waited:
      bars.consumer_q(self.index, wg)
    # With a sink the rows start from its virtual key (m = sink, l = 1):
    # rows that then see no key end with zeros and lse = sink. Registers:
    # only m and l start from a run-time scalar; nothing more lives in the loop.
    place = lambda x: plgpu.layout_cast(x, _ROW_LAYOUT)
    m, l = initial_row_stats(bq, place=place, sink=self.sink, fixed_max=self.ctx.call.fixed_max)
    if cfg.consumers_split_keys and self.sink is not None:
      # The sink's term once: consumer 0's half starts from it, consumer 1's not.
      m1, l1 = initial_row_stats(bq, place=place, fixed_max=self.ctx.call.fixed_max)
      m, l = jnp.where(wg == 0, m, m1), jnp.where(wg == 0, l, l1)
    acc = plgpu.layout_cast(jnp.full((bq, self.ctx.call.acc_dim), 0.0, jnp.float32),
                            plgpu.Layout.WGMMA)
    if self.ctx.call.row_sums_on_tensor_core:
      # The row-sum columns start from l (1 with a sink); l itself is not
      # updated in the walk (`softmax_and_hand_off`).
      col = plgpu.broadcasted_iota(jnp.int32, acc.shape, 1, layout=plgpu.Layout.WGMMA)
      acc = jnp.where(col >= self.ctx.call.out_dim, lax.broadcast_in_dim(l, acc.shape, [0]),
                      acc)

    @pl.when(hi > lo)
    def _():
      bars.consumer_k(self.ring_step(lo) if cfg.consumers_split_keys else self.step0)

    pl.when(wg == 1)(bars.consumer_sync_turn)  # offset the two consumers by one turn
    if self.ctx.call.mods:
      carry = self.walk_block_list((acc, m, l))
    else:
      carry = walk_blocks(lo, hi, own, self.compute_step, self.skip_step, (acc, m, l))
    pl.when(wg == 0)(bars.consumer_sync_turn)
    return carry

  def walk_block_list(self, carry):
    """Programmable scores: the CTA's block list, its partial blocks with the
    element mask (the built-ins and `mask_mod`), then its full ones without
    (`mask_mod` is not evaluated there); empty blocks are not in it. Both
    consumers compute every listed block: the list is the CTA tile's."""
    item = self.item
    step = lambda masked: functools.partial(self.compute_step, masked=masked)
    carry = lax.fori_loop(item.lo, item.partial, step(True), carry)
    return lax.fori_loop(item.partial, item.hi, step(False), carry)

  def ring_step(self, j):
    """Ring position of KV block j (with `consumers_split_keys`: of this
    consumer's block j, `_Context.split_block`)."""
    if self.ctx.call.config.consumers_split_keys:
      return self.step0 + 2 * (j - self.walk_lo) + self.ctx.wg
    return self.step0 + (j - self.item.lo)

  def compute_step(self, j, carry, *, masked: bool):
    """S = Q K^T, softmax, O += P V, one after the other."""
    bars = self.ctx.bars
    acc, m, l = carry
    step = self.ring_step(j)
    # The key block at walk position j (j itself without programmable
    # scores), read before Q K^T so that its GMEM latency hides behind it.
    block = self.ctx.kv_block(self.item, j)
    k_slot = bars.slot("k_full", step)
    k_tile = self.widened(self.ctx.refs.k_smem.at[k_slot], self.ctx.refs.k16_smem)
    s = self.qk(k_tile)
    key_ids = self.key_ids(step) if masked else None
    if key_ids is None:
      bars.consumer_k_release(step)
    # else: released once the mask has read the keys' ids (`block_softmax`)
    p16, m_new, l, acc = self.softmax_and_hand_off(s, m, l, j, acc, masked=masked,
                                                   key_ids=key_ids, block=block)
    v_slot = bars.slot("v_full", step)
    v_tile = self.widened(self.ctx.refs.v_smem.at[v_slot], self.ctx.refs.v16_smem)
    acc = self.p_times_v(acc, p16, v_tile, lambda: self.wait_next_k(j))
    bars.consumer_v_release(step)
    return acc, m_new, l

  def skip_step(self, j, carry):
    """A block this consumer's rows cannot see: keep the protocol going."""
    bars = self.ctx.bars
    step = self.ring_step(j)
    bars.consumer_sync_turn()
    bars.consumer_k_release(step)
    bars.consumer_end_turn()
    bars.consumer_v(step)
    bars.consumer_await_turn()
    bars.consumer_v_release(step)
    self.wait_next_k(j)
    return carry

  def qk(self, k_tile):
    """S = Q K^T against `k_tile` (f32, in a scoped accumulator)."""
    cfg = self.ctx.call.config

    def issue(s_ref):
      plgpu.wgmma(s_ref, self.q_tile, k_tile.transpose((1, 0)))
      self.ctx.bars.consumer_sync_turn()  # the other consumer's softmax ends here
      return s_ref[...]

    return pl.run_scoped(issue, plgpu.ACC((cfg.block_q, cfg.block_kv), jnp.float32))

  def key_ids(self, step):
    """The slot holding the segment ids of the keys of `step` (beside its K
    slot, `sm90_tiles.id_ring`), or None without segment ids."""
    if not self.ctx.call.has_segment_ids:
      return None
    return self.ctx.refs.kv_ids_smem.at[self.ctx.bars.slot("k_full", step)]

  def block_softmax(self, s, m, j, *, masked: bool, key_ids=None, block=None):
    """(P, new running max, alpha) for the logits of KV block j; with a
    fixed max (`ForwardStatics.fixed_max`) (P, m, None): nothing to rescale.

    Soft-cap's tanh runs here, after `qk`'s rendezvous and before
    `hand_off`: inside this consumer's softmax turn, whose MUFU work (tanh,
    exp2) overlaps the other consumer's GEMMs. t = tanh(s * scale / cap)
    replaces s in place (no second tile-sized array lives across it), and
    the mask comes after it (tanh(-inf) = -1 would be no mask).

    `key_ids`: the SMEM slot of the block's key segment ids; the mask reads
    them a chunk of columns at a time (`where_visible_by_column_chunks`),
    then the block's K slot (which they ride with) is released.

    `block`: the key block (j: its position in the walk, which differs with
    programmable scores' block lists). A `score_mod` runs on the scaled
    scores before the soft-cap, a `mask_mod` in the element mask of partial
    blocks (`modified_logits`, `mask_mod_hook`).
    """
    call = self.ctx.call
    block = j if block is None else block
    row_offset = None  # a score_mod's terms along the rows (`affine_logits`)
    if call.score_mod is None:
      # (float8 with soft-cap: the descale scales the tanh's argument; without
      # it, c, below.)
      s = call.score.logits(s, self.logit_scale())
    elif call.affine_score_mod:
      s, row_offset = self.affine_logits(s, block)
    else:
      s = self.modified_logits(s, block)
    if masked:
      kv_len = key_length_to_compare(self.item.kv_len, call.config.block_kv, call.mask,
                                     segment_ids=call.has_segment_ids)
      segments = None if key_ids is None else (self.q_segment, key_ids)
      mask_mod = bound_mask_hook(self.mask_fn)
      to_positions = self.decode_positions()
      if mask_mod is not None and to_positions is not None:
        mask_mod = lambda q_idx, kv_idx, hook=mask_mod: hook(*to_positions(q_idx, kv_idx))
      s = where_visible(s, call.masked_logit, mask=call.mask, row_lo=self.q_lo,
                        col_lo=block * call.config.block_kv, keys_along_rows=False,
                        kv_len=kv_len, q_len=self.item.q_len, segments=segments,
                        mask_mod=mask_mod)
      if key_ids is not None:
        self.release_k_after_reading_ids(j)
    if call.fixed_max:  # (soft-capped: no row offset)
      return fixed_max_softmax(s, m, call.exp2_scale), m, None
    descale = None
    if self.qk_descale is not None and call.score.logits_are_raw_scores:
      descale = self.qk_descale  # folded into exp2_scale: no multiply per score
    return online_softmax(s, m, call.exp2_scale, descale, row_offset=row_offset)

  def logit_scale(self):
    """The factor of the raw logits before a score_mod or soft-cap: the
    softmax scale, times the head's q and k descales with float8 operands."""
    scale = self.ctx.call.score.scale
    return scale if self.qk_descale is None else scale * self.qk_descale

  def score_mod_positions(self, shape, block):
    """(q_idx, kv_idx) of a tile of key block `block` as the score_mod sees
    them: vectors along its rows and columns (`sm90_tiles.mod_positions`)."""
    call, cfg = self.ctx.call, self.ctx.call.config
    # Positions are below the padded extents plus a tile (in the decode
    # arrangement: the keys of every chunk of a sequence).
    kv_extent = call.kv_valid * (1 if call.decode_group is None else call.q_batch_divisor)
    bound = max(call.q_seq, kv_extent) + 2 * max(cfg.block_q, cfg.block_kv)
    # q_lo and the key block's start are multiples of block_q and block_kv.
    q_idx, kv_idx = mod_positions(shape, row_lo=self.q_lo, col_lo=block * cfg.block_kv,
                                  keys_along_rows=False, bound=bound,
                                  aligned=tuple(shape) == (cfg.block_q, cfg.block_kv))
    if call.decode_group is not None:
      q_idx, kv_idx = self.decode_positions()(q_idx, kv_idx)
    return q_idx, kv_idx

  def affine_logits(self, s, block):
    """(t, row offset) of a raw Q K^T tile of key block `block` under a
    score_mod a * x + R(q_idx) + C(kv_idx) (`ForwardStatics.affine_score_mod`,
    `mod_tiles.affine_logits`): t = s * (scale * a) + C, one FMA per score,
    or s itself; R (in log2 units) moves the rows' running max."""
    call = self.ctx.call
    q_idx, kv_idx = self.score_mod_positions(s.shape, block)
    t, row_offset, _ = affine_logits(self.score_fn, s, q_idx, kv_idx, score=call.score,
                                     scale=self.logit_scale(), query_axis=0)
    return t, row_offset

  def modified_logits(self, s, block):
    """A tile of raw Q K^T logits of key block `block` through the scale and
    `score_mod`, then soft-capped (t = tanh(s / cap)) if the call is: in the
    units of `ForwardStatics.exp2_scale` (`scores.Scores` has the order)."""
    call = self.ctx.call
    q_idx, kv_idx = self.score_mod_positions(s.shape, block)
    s = self.score_fn(s * jnp.float32(self.logit_scale()), q_idx, kv_idx)
    s = s.astype(jnp.float32)
    if s.shape != q_idx.shape:  # a score_mod that ignores the score
      s = jnp.broadcast_to(s, q_idx.shape)
    return call.score.modified_logits(s)

  def decode_positions(self):
    """In the decode arrangement (`ForwardStatics.decode_group`), the
    positions a mod sees as a function of the tile's own (`mod_positions`):
    (q_idx, kv_idx) -> (token r // G of row r, key j of chunk c at
    c * chunk + j); None without the arrangement."""
    call = self.ctx.call
    if call.decode_group is None:
      return None
    g, p = call.decode_group, call.q_batch_divisor
    first_key = None
    if p != 1:
      first_key = lax.rem(self.item.batch_idx, jnp.int32(p)) * jnp.int32(call.kv_valid)

    def positions(q_idx, kv_idx):
      q_idx = _along_map(q_idx, lambda x: lax.div(x, jnp.int32(g)) if g != 1 else x)
      if first_key is not None and isinstance(kv_idx, mod_functions.Positions):
        kv_idx = kv_idx.shifted(first_key)  # (positions still: `affine_logits`)
      elif first_key is not None:
        kv_idx = _along_map(kv_idx, lambda x: x + first_key)
      return q_idx, kv_idx

    return positions

  def release_k_after_reading_ids(self, j):
    """Releases the K slot of block j once its key ids have been read."""
    if self.ctx.call.interpreting:
      # The interpreter orders these generic-proxy reads before the TMA that
      # refills the slot only through a proxy fence; on hardware the release
      # (an mbarrier arrive) orders them, as for the backward's lse2 rings.
      plgpu.commit_smem()
    self.ctx.bars.consumer_k_release(self.ring_step(j))

  def softmax_and_hand_off(self, s, m, l, j, acc, *, masked: bool, key_ids=None, block=None):
    """Softmax of block j, O rescaled, the hand-off of the tensor core, and
    the row sums before or after it (`sum_before_handoff`)."""
    cfg = self.ctx.call.config
    p, m_new, alpha = self.block_softmax(s, m, j, masked=masked, key_ids=key_ids, block=block)
    if alpha is not None:
      acc = rescale_rows(acc, alpha, skip_unchanged=cfg.conditional_rescale)
    if self.ctx.call.fp8_p_in_registers:
      p16 = fp8_p_operand(p, FP8_P_DTYPE)
    elif self.ctx.call.fp8:
      # P to SMEM inside this consumer's softmax turn (no 8-bit array can
      # pass an optimization barrier): p16 is then its SMEM tile.
      p16 = self.stage_p(p.astype(FP8_P_DTYPE))
    else:
      p16 = p.astype(self.ctx.call.dtype)
    if cfg.sum_before_handoff:
      l = _add_row_sums(l, alpha, p)
      # Pin the order: the softmax must be done before the hand-off.
      if self.ctx.call.fp8:
        acc, l, m_new, alpha = lax.optimization_barrier((acc, l, m_new, alpha))
      else:
        acc, l, m_new, alpha, p16 = lax.optimization_barrier((acc, l, m_new, alpha, p16))
      self.hand_off(self.ring_step(j))
    else:
      self.hand_off(self.ring_step(j))
      if not self.ctx.call.row_sums_on_tensor_core:  # else the P V wgmma sums P
        l = _add_row_sums(l, alpha, p)
    return p16, m_new, l, acc

  def hand_off(self, step):
    bars = self.ctx.bars
    bars.consumer_end_turn()  # done with softmax
    bars.consumer_v(step)
    bars.consumer_await_turn()  # tensor core free: the other consumer issued its QK

  def p_times_v(self, acc, p, v_tile, while_running):
    """O += P V, with `while_running()` issued while the wgmma runs."""
    call = self.ctx.call
    if call.fp8:
      v_tile = v_tile.transpose((1, 0))  # the V^T slot as the [keys, Dv] operand
    if call.interpreting and (call.fp8_p_in_registers or not call.fp8):
      p = self.stage_p(p)
    issue = functools.partial(self.issue_pv, p=p, v_tile=v_tile)

    if call.interpreting:
      # The interpreter rejects wgmma with run_state: add a fresh accumulator.

      def pv_delta(delta_ref):
        issue(delta_ref)
        while_running()
        return delta_ref[...]

      return acc + pl.run_scoped(pv_delta,
                                 plgpu.ACC((call.config.block_q, call.acc_dim), jnp.float32))

    def pv(acc_ref):
      issue(acc_ref)
      while_running()

    return pl.run_state(pv)(plgpu.ACC.init(acc))

  def issue_pv(self, acc_ref, p, v_tile):
    """Issues O += P V into `acc_ref` (V as the [keys, Dv] operand): one
    wgmma, or two with the row sums on the tensor core."""
    call = self.ctx.call
    if not call.row_sums_on_tensor_core:
      plgpu.wgmma(acc_ref, p, v_tile)
      return
    # O's columns += P V; the row-sum columns += P times ones (B: the first
    # FP8_ROW_SUM_COLUMNS rows of the consumer's ones tile, as [keys, N]).
    dv, n = call.out_dim, FP8_ROW_SUM_COLUMNS
    ones = self.ctx.refs.ones_smem.at[self.ctx.wg].at[pl.ds(0, n)].transpose((1, 0))
    plgpu.wgmma(acc_ref.at[:, pl.ds(0, dv)], p, v_tile)
    plgpu.wgmma(acc_ref.at[:, pl.ds(dv, n)], p, ones)

  def widened(self, slot, tiles16):
    """A float8 cache's ring slot widened into this consumer's float16 tile
    (`ForwardStatics.fp8_cache`), for the GEMM that follows; else the slot.
    The tile's previous GEMM has completed: its result was read (S) or its
    accumulator is waited for here (O)."""
    if not self.ctx.call.fp8_cache:
      return slot
    tile = tiles16.at[self.ctx.wg]
    if self.ctx.call.interpreting:
      x = slot[...]
    else:
      plgpu.wgmma_wait(0)
      # The 8-bit wgmma operand layout: 32-bit SMEM loads of 4 keys' bytes.
      x = plgpu.load(slot, layout=plgpu.Layout.WGMMA_8BIT)
    tile[...] = x.astype(tile.dtype)
    plgpu.commit_smem()
    return tile

  def stage_p(self, p):
    """P into the consumer's SMEM tile for the P V wgmma (`ForwardStatics.stages_p`);
    returns the tile. Its previous P V wgmma has completed (its accumulator
    was read)."""
    p_tile = self.ctx.refs.p_smem.at[self.ctx.wg]
    p_tile[...] = p
    plgpu.commit_smem()
    return p_tile

  def wait_next_k(self, j):
    @pl.when(j + 1 < self.walk_hi)
    def _():
      self.ctx.bars.consumer_k(self.ring_step(j + 1))


def _add_row_sums(l, alpha, p):
  """The running sum after a block of P: l * alpha + rowsum(P), or without
  a rescale factor (a fixed max) l + rowsum(P)."""
  if alpha is None:
    return l + p.sum(axis=1)
  return l * alpha + p.sum(axis=1)


def _epilogue(ctx: _Context, tile: _ConsumerTile, acc, m, l) -> None:
  """O / l and the lse of the consumer's rows, stored through SMEM by TMA."""
  call, refs, wg = ctx.call, ctx.refs, ctx.wg
  bq = call.config.block_q
  if call.row_sums_on_tensor_core:
    # Every row-sum column holds l (P times a column of ones): their max is
    # l exactly, whatever order they are read in.
    l = acc[:, call.out_dim:].max(axis=1)
    acc = acc[:, :call.out_dim]
  if call.has_q_lengths:
    rows = tile.q_lo + plgpu.broadcasted_iota(jnp.int32, (bq,), 0, layout=_ROW_LAYOUT)
    # Rows past the length: zeros and lse -inf, also when a sink started their sum at 1.
    l = jnp.where(rows < tile.item.q_len, l, 0.0)
  out, lse = normalize(acc, m, l)
  if tile.v_descale is not None:
    out = out * tile.v_descale
  if call.config.persistent:
    # The previous tile's stores must have read o_tile and the LSE row.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  tile.o_tile[...] = out.astype(call.output_dtype)
  refs.lse_smem.at[wg][...] = lse
  plgpu.commit_smem()
  b_i, h_i = tile.item.batch_idx, tile.item.head
  rows = pl.ds(tile.q_lo, bq)  # (TMA writes only the rows O has)
  plgpu.copy_smem_to_gmem(tile.o_tile, refs.out.at[b_i, h_i, rows] if call.heads_major
                          else refs.out.at[b_i, rows, h_i])
  plgpu.copy_smem_to_gmem(refs.lse_smem.at[wg], refs.lse.at[b_i, h_i, pl.ds(tile.q_lo, bq)])


def _merge_halves(ctx: _Context, tile: _ConsumerTile, acc, m, l) -> None:
  """`ForwardConfig.consumers_split_keys`: consumer 1 hands its half's
  (O, m, l) to consumer 0 through SMEM (O, in f32, in the bytes of the O
  tiles; m and l in the LSE rows past the consumers'), and consumer 0
  merges them into its own and runs the epilogue of the rows. Both halves' m
  are running maxima in the softmax's log2 units, so the merge is the online
  softmax's own step: m = max(m0, m1), O and l of each half times exp2(m_c -
  m) (exactly 1 where m_c = m, `exact_alpha`; a half without keys has l = 0
  and O = 0)."""
  refs, bars, nc = ctx.refs, ctx.bars, ctx.call.config.num_consumers
  o_half, m_row, l_row = refs.merge_smem, refs.lse_smem.at[nc], refs.lse_smem.at[nc + 1]

  @pl.when(ctx.wg == 1)
  def _():
    o_half[...] = acc
    m_row[...] = m
    l_row[...] = l
    bars.consumer_publish_half()

  @pl.when(ctx.wg == 0)
  def _():
    bars.consumer_merge_half()
    if ctx.call.interpreting:
      acc1, m1, l1 = o_half[...], m_row[...], l_row[...]
    else:
      acc1 = plgpu.load(o_half, layout=plgpu.Layout.WGMMA)
      m1, l1 = (plgpu.load(row, layout=_ROW_LAYOUT) for row in (m_row, l_row))
    # Every thread has read consumer 1's O before the epilogue's O tile
    # overwrites its bytes (a warpgroup barrier).
    plgpu.commit_smem()
    m_new = jnp.maximum(m, m1)
    a0, a1 = exact_alpha(m, m_new), exact_alpha(m1, m_new)
    rows = lambda x: lax.broadcast_in_dim(x, acc.shape, [0])
    _epilogue(ctx, tile, acc * rows(a0) + acc1 * rows(a1), m_new, l * a0 + l1 * a1)


def _kernel(call: ForwardStatics, *refs) -> None:
  refs, barrier_refs = _Refs.unpack(call, refs)
  ctx = _Context.create(call, refs, barrier_refs)
  pl.when(ctx.wg == call.config.num_consumers)(functools.partial(_producer, ctx))
  pl.when(ctx.wg < call.config.num_consumers)(functools.partial(_consumer, ctx))


@cached_build
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
    score: ScoreFunction,
    mask: MaskSpec,
    config: ForwardConfig,
    has_q_lengths: bool,
    has_kv_lengths: bool,
    has_segment_ids: bool = False,
    has_sinks: bool = False,
    page_size: int | None = None,
    fixed_max: bool = False,
    heads_major: bool = False,
    q_batch_divisor: int = 1,
    queue_counter: bool = True,
    mods: bool = False,
    score_mod=None,
    mask_mod=None,
    decode_group: int | None = None,
    value_head_dim: int | None = None,
    fp8: bool = False,
    out_dtype=None,
    kv_dtype=None,
):
  cfg = config
  num_q_tiles = cdiv(q_seq, cfg.block_q_cta)
  heavy_first = pairs_causal_tiles(mask)
  work = _persistent_work(cfg, mask, batch, num_q_heads, q_seq)
  call = ForwardStatics(config=cfg, mask=mask, q_seq=q_seq, kv_valid=kv_valid, head_dim=head_dim,
               dtype=dtype, group=num_q_heads // num_kv_heads, num_q_tiles=num_q_tiles,
               score=score, heavy_first=heavy_first, work=work,
               interpreting=is_interpreting(), has_q_lengths=has_q_lengths,
               has_kv_lengths=has_kv_lengths, has_segment_ids=has_segment_ids,
               has_sinks=has_sinks, page_size=page_size,
               fixed_max=fixed_max, heads_major=heads_major,
               q_batch_divisor=q_batch_divisor, queue_counter=queue_counter, mods=mods,
               score_mod=score_mod, mask_mod=mask_mod, decode_group=decode_group,
               value_head_dim=None if value_head_dim == head_dim else value_head_dim,
               fp8=fp8, out_dtype=out_dtype, kv_dtype=kv_dtype)

  def kernel(*refs):  # Mosaic GPU names the kernel after this function
    _kernel(call, *refs)

  # The LSE rows are stored with 1-D TMA boxes along the sequence, its
  # contiguous axis. On an H100 a box that ran past the end of that axis left
  # wrong values (seen at q_seq = 56, block_q = 64; the interpreter clips it
  # correctly), so the LSE output covers whole tiles and `forward` slices it.
  lse_seq = _tile_slots(cfg, mask, q_seq) * cfg.block_q_cta
  out_type = (
      jax.ShapeDtypeStruct((batch, num_q_heads, q_seq, call.out_dim) if heads_major
                           else (batch, q_seq, num_q_heads, call.out_dim), call.output_dtype),
      jax.ShapeDtypeStruct((batch, num_q_heads, lse_seq), jnp.float32),
  )
  return plgpu.kernel(
      compile_ahead.named(kernel, "sm90_forward"),
      out_type=out_type,
      scratch_types=(tuple(_scratch_smem(call)), ForwardBarrierTable.scratch_types(call)),
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


def _persistent_work(cfg: ForwardConfig, mask: MaskSpec, batch: int, num_q_heads: int,
                     q_seq: int) -> PersistentWork | None:
  """The persistent grid's work items; None for one CTA per tile."""
  if not cfg.persistent:
    return None
  causal = pairs_causal_tiles(mask)
  return PersistentWork(batch, num_q_heads, cdiv(q_seq, cfg.block_q_cta), cfg.num_sms,
                        paired=causal and not cfg.work_queue, queued=cfg.work_queue,
                        heavy_first=causal)


def _tile_slots(cfg: ForwardConfig, mask: MaskSpec, q_seq: int) -> int:
  """CTA tiles the grid can name: the query tiles and, in a persistent
  causal grid with an odd count, one empty tile past the end."""
  work = _persistent_work(cfg, mask, 1, 1, q_seq)
  return work.tile_slots if work else cdiv(q_seq, cfg.block_q_cta)


def segment_operands(segment_ids, cfg: ForwardConfig, mask: MaskSpec, q_seq: int,
                      kv_seq: int):
  """(q ids, kv ids, tile ranges): the kernel's segment-id operands.

  The ids are padded (repeating the last id, which keeps every tile's id
  range as it is) to cover every row of every CTA tile the grid can name and
  every key of every key block, so that no tile and no block reads past the
  end; padded keys are masked by the key length and padded rows are sliced
  off or lie past the query length. The ranges (`segment_tile_ranges`) have
  one row per consumer tile of `block_q` rows.
  """
  q_ids, kv_ids = segment_ids
  num_tiles = _tile_slots(cfg, mask, q_seq) * cfg.num_consumers
  ranges = tile_ranges_operand(q_ids, kv_ids, cfg.block_q, cfg.block_kv, num_tiles)
  return (pad_ids(q_ids, num_tiles * cfg.block_q),
          pad_ids(kv_ids, cdiv(kv_seq, cfg.block_kv) * cfg.block_kv), ranges)


def sm_count(default: int = H100_SMS) -> int:
  """The persistent grid's CTA count: `schedule.sm_count`, an H100's 132
  without a GPU."""
  return schedule_sm_count(default)


def forward(q, k, v, q_lengths, kv_lengths, *, score: ScoreFunction, mask: MaskSpec,
            config: ForwardConfig | None = None, segment_ids=None, sinks=None, page_table=None,
            heads_major: bool = False, q_batch_divisor: int = 1, mods=None,
            descales=None, out_dtype=None, decode_group: int | None = None):
  """Attention forward. See `fa4_jax.kernels` for the contract.

  q: [B, Tq, Nq, D]; k, v: [B, Tk, Nkv, D]. Returns (out [B, Tq, Nq, D] in
  q.dtype, lse float32 [B, Nq, Tq]). `segment_ids`: None or (q ids int32
  [B, Tq], kv ids int32 [B, Tk]); a query sees only keys of its own id.
  `sinks`: None or [Nq], each head's sink logit (natural log; in the lse,
  not in the output). `score`: how q.k becomes a logit (the scale, the
  soft-cap: `scores.ScoreFunction`). `page_table`: None, or int32
  [B, P] with k, v a paged cache [num_pages, page_size, Nkv, D]: row b's
  keys are pages page_table[b, 0 .. P-1] one after the other (Tk = P *
  page_size; `check_paged`); entries are clipped into [0, num_pages).
  Without them the kernel is the one built before they existed.

  Decode (`sm90_decode`), the query where it lies: `heads_major` takes
  q [Bq, Nq, Tq, D] and returns out [B, Nq, Tq, D] (a one-token query's G
  heads of a KV head as its rows is then a free reshape, `check_heads_major`);
  `q_batch_divisor` = P serves B = Bq * P rows of K/V with batch row b
  reading Q's row b // P (split-K chunks of one sequence, Q not repeated).

  `mods`: None, or the call's `scores.Scores` with a `score_mod` and / or a
  `mask_mod` (its lengths, segment ids, band and score function are the
  arguments above; it adds the mods, their captured arrays, the block mask
  and the index offsets). The kernel then walks per CTA tile the block
  lists of every mask (`scores.tile_classes`, `block_lists`, computed here
  in XLA): partial blocks with the element mask and `mask_mod`, full ones
  without, empty ones neither loaded nor computed; `score_mod` runs on every
  walked block. One CTA per tile (no persistent grid), no page table or
  heads-major Q, except in the decode arrangement: `decode_group` = G says
  the rows pack G query heads per token and the batch rows are chunks of
  `q_batch_divisor` (`ForwardStatics.decode_group`); the mods then see each
  row's head and token and each key's position in its sequence, and the
  block lists come from `mods.block_mask`, made for the packed problem
  (`sm90_decode.forward`).

  float8 q, k and v (`fp8_mode` "all"): `descales` = (q_descale f32 [Nq] or
  None, k_descale [Nkv] or None, v_descale [Nkv] or None), the stored
  values' factors (`scores.Scores`); out in `out_dtype` (None: bfloat16).
  They must be >= 0 (quantization scales): a negative one makes the output
  NaN. V is transposed here (an XLA copy of V) for the kernel's P V^T
  operand. A bfloat16 or float16 query on float8 k and v (`fp8_mode`
  "cache": decode, pages, chunked prefill): the same descales (q_descale
  None), out in `out_dtype` (None: the query's dtype); the kernel widens
  each K and V block to float16 in SMEM (`ForwardStatics.fp8_cache`).
  """
  if mods is not None and not mods.has_mods:
    mods = None
  if mods is not None:
    check_mods(mods, config, page_table, heads_major, q_batch_divisor, decode_group)
  score_lib.check_query_lengths_for_alignment(mask, q_lengths, "sm90 forward")
  if q_batch_divisor < 1:
    raise KernelUnsupported(f"sm90 forward: q_batch_divisor must be >= 1; got {q_batch_divisor}")
  if heads_major:
    check_heads_major(q.shape)
    q_shape = (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
  else:
    q_shape = q.shape
  q_shape = (q_shape[0] * q_batch_divisor, *q_shape[1:])
  logical_k_shape = k.shape
  if page_table is not None:
    logical_k_shape = check_paged(q_shape, k.shape, jnp.shape(page_table), segment_ids)
  check_supported(q_shape, logical_k_shape, q.dtype, mask)
  check_value_head_dim(k.shape, v.shape, page_table, heads_major)
  mode = fp8_mode(q.dtype, k.dtype, v.dtype, page_table=page_table, heads_major=heads_major,
                  q_batch_divisor=q_batch_divisor)
  fp8, fp8_cache = mode == "all", mode == "cache"
  if mode is None and (k.dtype != q.dtype or v.dtype != q.dtype):
    raise KernelUnsupported(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
  if fp8_cache:
    if k.dtype != v.dtype:
      raise KernelUnsupported(f"sm90 forward: a float8 cache needs k and v of one float8 type; "
                              f"got {k.dtype}, {v.dtype}")
    if segment_ids is not None or mods is not None:
      raise KernelUnsupported("sm90 forward: a float8 cache with segment ids or "
                              "score_mod / mask_mod is not supported")
    # float16 GEMMs against the widened cache: the query converted (exact
    # for |q| in float16's normal range, 2^-14 .. 65504), O in its dtype.
    out_dtype = out_dtype or q.dtype
    q = q.astype(jnp.float16)
  batch, q_seq, num_q_heads, head_dim = q_shape
  _, kv_seq, num_kv_heads, _ = logical_k_shape
  if segment_ids is not None:
    shapes = tuple(jnp.shape(x) for x in segment_ids)
    if shapes != ((batch, q_seq), (batch, kv_seq)):
      raise KernelUnsupported(f"segment_ids must be [B, Tq] and [B, Tk]: {(batch, q_seq)} and "
                              f"{(batch, kv_seq)}; got {shapes[0]} and {shapes[1]}")
  if sinks is not None and jnp.shape(sinks) != (num_q_heads,):
    raise KernelUnsupported(f"sinks must be [Nq] = ({num_q_heads},); got {jnp.shape(sinks)}")
  score = kernel_score_function(score, None if mods is None else mods.score_mod,
                                None if mods is None else decode_group)
  # The TMA descriptors tile (sequence, head_dim) by (8, 64): sequence lengths
  # must be multiples of 8 and head dims multiples of 64. Other sizes are
  # zero-padded here (a copy; aligned shapes take no detour). Padded keys are
  # masked in the kernel, padded rows and columns are sliced off.
  d = padded_head_dim(head_dim)
  q_pad, kv_pad = cdiv(q_seq, 8) * 8, cdiv(kv_seq, 8) * 8
  if fp8:  # V^T's rows are keys: TMA wants their bytes a multiple of 16
    kv_pad = cdiv(kv_seq, 16) * 16
  if heads_major:
    q_pad = q_seq  # read as it lies (`check_heads_major`)
  if d != head_dim or q_pad != q_seq:
    q = jnp.pad(q, [(0, 0), (0, q_pad - q_seq), (0, 0), (0, d - head_dim)])
  value_dim = v.shape[-1]  # O's too
  dv = padded_head_dim(value_dim)
  if d != head_dim or kv_pad != kv_seq:  # never for a paged K/V (`check_paged`)
    k = jnp.pad(k, [(0, 0), (0, kv_pad - kv_seq), (0, 0), (0, d - head_dim)])
  if dv != value_dim or kv_pad != kv_seq:
    v = jnp.pad(v, [(0, 0), (0, kv_pad - kv_seq), (0, 0), (0, dv - value_dim)])
  if config is None:
    # Unequal head dims take the larger one's configuration (registers: O
    # grows with V's, S and the SMEM rings with both).
    config = choose_config(max(d, dv), mask, kv_seq, q_seq,
                           segment_ids=segment_ids is not None)
    config = autotune.sm90_forward_config(  # the heuristic's, unless switched on
        config, q_shape=q_shape, k_shape=logical_k_shape, dtype=q.dtype,
        mask=mask, score=score, has_q_lengths=q_lengths is not None,
        has_kv_lengths=kv_lengths is not None, has_sinks=sinks is not None,
        tunable=(mods is None and segment_ids is None and page_table is None and mode is None
                 and value_dim == head_dim and not heads_major and q_batch_divisor == 1))
    if (mods is None and segment_ids is None and sinks is None and page_table is None
        and mode is None and not fp8 and not heads_major and decode_group is None):
      config = value_head_dim_config(config, d, dv)
    if mods is not None:
      config = mods_config(config, mods)
    if fp8:
      config = fp8_config(config, mask, d, dv, segment_ids is not None, mods is not None)
    if (dv != d or fp8) and not config.fits_smem(d, 2, segment_ids is not None, dv, fp8=fp8):
      config = dataclasses.replace(config, q_buffers=1)
  if fp8_cache:
    # Also a caller's config (the decode arrangement's persistent grid with two
    # Q tiles per consumer): the widened float16 tiles need their SMEM.
    config = fp8_cache_config(config, d, dv)
  fits = config.fits_smem(d, 2, segment_ids is not None, dv, fp8=fp8, fp8_cache=fp8_cache)
  if (dv != d or mode is not None) and not fits:
    raise KernelUnsupported(f"sm90 forward: head dims {d} (q, k) and {dv} (v) do not fit SMEM "
                            f"with this configuration{' in float8' if mode else ''}")
  if config.consumers_split_keys and not (fp8_cache and dv == d):
    raise KernelUnsupported("sm90 forward: consumers_split_keys serves a float8 cache with "
                            "equal head dims")
  if page_table is not None and config.block_kv % k.shape[1] and k.shape[1] % config.block_kv:
    raise KernelUnsupported(f"sm90 forward: block_kv {config.block_kv} and the page size "
                            f"{k.shape[1]} must divide one another")
  if config.persistent and not config.num_sms:
    config = dataclasses.replace(config, num_sms=sm_count(H100_SMS))
  build = functools.partial(
      _build_kernel,
      batch=batch, q_seq=q_pad, kv_seq=kv_pad, kv_valid=kv_seq,
      num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=d, value_head_dim=dv,
      dtype=q.dtype, score=score, mask=mask,
      has_q_lengths=q_lengths is not None, has_kv_lengths=kv_lengths is not None,
      has_segment_ids=segment_ids is not None, has_sinks=sinks is not None,
      page_size=None if page_table is None else k.shape[1],
      # Where bounded logits bound P, no running max.
      fixed_max=score.bounds_logits(FP8_P_DTYPE if fp8 else q.dtype, kv_seq),
      **_q_options(heads_major, q_batch_divisor),
      **({} if mods is None else dict(mods=True, score_mod=mods.score_mod,
                                      mask_mod=mods.mask_mod)),
      **({} if mods is None or decode_group is None else dict(decode_group=decode_group)),
      **({} if not fp8 else dict(fp8=True, out_dtype=jnp.dtype(out_dtype or jnp.bfloat16))),
      **({} if not fp8_cache else dict(out_dtype=jnp.dtype(out_dtype), kv_dtype=k.dtype)),
  )
  call = build(config=config)
  if config.work_queue:
    call = fixed_shares_under_vmap(call, lambda: build(config=config, queue_counter=False))
  if fp8:
    # V^T [B, Nkv, Dv, Tk]. Its TMA tiles the key axis by the swizzle width
    # (up to 128 one-byte keys), so that axis holds whole tiles: zero keys,
    # masked like the other padded ones (one XLA copy with the transpose).
    vt_keys = cdiv(kv_pad, 128) * 128
    if vt_keys != v.shape[1]:
      v = jnp.pad(v, [(0, 0), (0, vt_keys - v.shape[1]), (0, 0), (0, 0)])
    if config.p_operand_in_registers:  # V^T's keys in the order of the kernel's P
      v = in_p_key_order(v, 1)
    v = jnp.transpose(v, (0, 2, 3, 1))
  args = [q, k, v]
  if q_lengths is not None:
    args.append(jnp.asarray(q_lengths, jnp.int32))
  if kv_lengths is not None:
    args.append(jnp.asarray(kv_lengths, jnp.int32))
  if segment_ids is not None:
    segment_args = segment_operands(segment_ids, config, mask, q_pad, kv_pad)
    # With mods the block lists hold the ids' tile ranges.
    args.extend(segment_args[:2] if mods is not None else segment_args)
  if sinks is not None:
    args.append(jnp.asarray(sinks, jnp.float32))
  if page_table is not None:
    args.append(page_table_operand(page_table, config.block_kv, k.shape[1], k.shape[0]))
  if mode is not None:
    args.append(_descale_operand(descales, num_q_heads, num_kv_heads))
  if mods is not None:
    args.extend(mods_operands(mods, config, q_shape, logical_k_shape, q_lengths, kv_lengths,
                              segment_ids, mask=mask))
  out, lse = call(*args)
  if dv != value_dim or q_pad != q_seq:
    out = out[:, :q_seq, :, :value_dim]
  return out, lse[..., :q_seq]


def fp8_config(config: ForwardConfig, mask: MaskSpec, d: int, dv: int,
               segment_ids: bool, mods: bool = False) -> ForwardConfig:
  """The heuristic's config for all-float8 operands: P handed to the P V
  wgmma in registers (`fp8_p_in_registers`, with the row sums after the
  hand-off), and without a band a third K/V stage where SMEM holds it. The
  SMEM round trip of P is what kept D128 at bfloat16's speed: in float8 the
  GEMMs take half their bfloat16 time and the hand-off sits between them and
  the softmax (measured: the performance notes, "P in registers"). Dense
  and causal calls at `FP8_ROW_SUMS_HEAD_DIMS` without segment ids or `mods`
  run three consumers (`FP8_THREE_CONSUMERS`)."""
  row_sums = d in FP8_ROW_SUMS_HEAD_DIMS
  config = dataclasses.replace(config, fp8_p_in_registers=True, sum_before_handoff=False,
                               fp8_row_sums_on_tensor_core=row_sums)
  if row_sums and not segment_ids and not config.persistent:
    if (mask.is_dense or mask.is_causal) and not mods:
      three = dataclasses.replace(config, **FP8_THREE_CONSUMERS)
      if three.fits_smem(d, 2, segment_ids, dv, fp8=True):
        return three
    if mask.is_dense:  # with mods (or where three consumers do not fit)
      wide = dataclasses.replace(config, block_kv=FP8_DENSE_BLOCK_KV, num_kv_stages=2)
      if wide.fits_smem(d, 2, segment_ids, dv, fp8=True):
        return wide
  if mask.is_dense and d <= 128 and config.num_kv_stages == 2:
    deeper = dataclasses.replace(config, num_kv_stages=3)
    if deeper.fits_smem(d, 2, segment_ids, dv, fp8=True):
      return deeper
  return config


def fp8_cache_config(config: ForwardConfig, d: int, dv: int) -> ForwardConfig:
  """A config whose SMEM holds a float8 cache's rings and each consumer's
  widened float16 K and V tiles: the heuristic's, else with one Q tile per
  consumer, else 64-key blocks, else one consumer (D = 256)."""
  one_consumer = dict(num_consumers=1, pingpong=False, producer_registers=24,
                      consumer_registers=224, consumers_split_keys=False)
  for changes in ({}, dict(q_buffers=1), dict(q_buffers=1, block_kv=64),
                  dict(q_buffers=1, block_kv=64, **one_consumer)):
    candidate = dataclasses.replace(config, **changes)
    if candidate.fits_smem(d, 2, False, dv, fp8_cache=True):
      return candidate
  return candidate


def _descale_operand(descales, num_q_heads: int, num_kv_heads: int):
  """f32 [2, Nq]: per query head, q_descale * k_descale (the logits' factor)
  and v_descale (O's), a missing one 1. Negative ones become NaN: the kernel
  folds the logits' factor into the softmax's, whose sign must be known."""
  q_descale, k_descale, v_descale = descales if descales is not None else (None,) * 3
  per_q_head = lambda x, n: (jnp.ones((num_q_heads,), jnp.float32) if x is None else
                             jnp.repeat(jnp.asarray(x, jnp.float32).reshape(n), num_q_heads // n))
  qk = per_q_head(q_descale, num_q_heads) * per_q_head(k_descale, num_kv_heads)
  both = jnp.stack([qk, per_q_head(v_descale, num_kv_heads)])
  return jnp.where(both >= 0, both, jnp.nan)


def check_value_head_dim(k_shape, v_shape, page_table, heads_major: bool) -> None:
  """V may have a head dim of its own (O has it too), a multiple of 16 up to
  256, with K's other dims; not with a page table or heads-major Q (the decode
  arrangements)."""
  if (tuple(v_shape[:-1]) != tuple(k_shape[:-1]) or v_shape[-1] % 16
      or not 0 < v_shape[-1] <= 256):
    raise KernelUnsupported(f"sm90 forward: v must be k's shape {tuple(k_shape)} but for its "
                            f"head dim, a multiple of 16 up to 256; got {tuple(v_shape)}")
  if v_shape[-1] != k_shape[-1] and (page_table is not None or heads_major):
    raise KernelUnsupported("sm90 forward: a value head dim of its own is not supported with "
                            "a page table or heads-major Q")


# Issue #52, a candidate off until a GPU times it: a call whose programmable
# scores are a score_mod alone (no mask_mod, no block mask) keeps the
# heuristic's persistent grid and work queue (`mods_config`). Plain short
# causal rows take the queue (measured -3.5 % against one CTA per tile at B8
# S4096 H16 D128, 2026-11-27), and ALiBi causal costs 1.21x of plain causal
# at B2 S4096 against dense's 1.09x (H100, 2026-12-08). A work item reads
# its CTA tile's block list by (batch, head, tile) whichever grid runs it, and
# a score_mod's lists are the built-in mask's ranges, so the queue's order
# (heaviest tiles first, by those ranges) stays right. Interpreter with race
# detection: `tests/test_sm90_forward_mods.py -k persistent_grid`.
MODS_ON_THE_PERSISTENT_GRID = False


def mods_keep_the_persistent_grid(mods) -> bool:
  """Whether a call with `mods` (a `scores.Scores` or None) keeps the
  heuristic's persistent grid: `MODS_ON_THE_PERSISTENT_GRID` on, and a
  score_mod without a mask_mod or a block mask."""
  return (MODS_ON_THE_PERSISTENT_GRID and mods is not None and mods.score_mod is not None
          and mods.mask_mod is None and mods.block_mask is None)


def mods_config(config: ForwardConfig, mods=None) -> ForwardConfig:
  """The heuristic's config for a call with programmable scores `mods`: one
  CTA per tile (the block lists are per CTA tile), so one Q tile per
  consumer; under `MODS_ON_THE_PERSISTENT_GRID` a score_mod alone keeps
  `config` as it is."""
  if mods_keep_the_persistent_grid(mods):
    return config
  return dataclasses.replace(config, persistent=False, work_queue=False, q_buffers=1)


def check_mods(mods, config: ForwardConfig | None, page_table, heads_major: bool,
               q_batch_divisor: int, decode_group: int | None = None) -> None:
  """Raises KernelUnsupported (or a ValueError naming an op the kernel
  cannot run, `mod_functions.kernel_problem`) unless the kernel can run
  these programmable scores. A page table, heads-major Q and a Q batch
  divisor only in the decode arrangement (`decode_group`)."""
  if decode_group is None and (page_table is not None or heads_major or q_batch_divisor != 1):
    raise KernelUnsupported("sm90 forward: score_mod / mask_mod are not supported with a page "
                            "table, heads-major Q or a Q batch divisor outside the decode "
                            "arrangement")
  if (config is not None and config.persistent
      and not mods_keep_the_persistent_grid(mods)):
    raise KernelUnsupported("sm90 forward: score_mod / mask_mod walk one CTA per tile; pass a "
                            "config with persistent=False (`mods_config`)")
  for mod in (mods.score_mod, mods.mask_mod):
    if mod is not None:
      problem = (mod_functions.kernel_problem(mod) if decode_group is None
                 else mod_functions.packed_rows_problem(mod))
      if problem is not None:
        raise mod_functions.Unsupported(f"sm90 forward: {problem}")


def mods_operands(mods, config: ForwardConfig, q_shape, k_shape, q_lengths, kv_lengths,
                  segment_ids, *, mask: MaskSpec) -> list:
  """The kernel's operands for programmable scores: the block lists of the
  CTA tiles (counts, order: `scores.block_lists` of `scores.tile_classes`
  of every mask of the call, at `block_q_cta` x `block_kv`), the (batch,
  head) offsets of a sharded call (zeros without), then the captured arrays
  of `score_mod` and of `mask_mod` (0-d ones as shape (1,), bool ones as int32).

  The classes take the call's arguments as the kernel masks them: the
  lengths clipped to the sequences (a length past them would make the last,
  padded, key block look full), but for split-K chunks' key lengths, which
  count past the chunk to align a band (`MaskSpec.key_chunk` cuts them)."""
  batch, q_seq, num_q_heads, _ = q_shape
  kv_seq = k_shape[1]
  clip = lambda x, n: None if x is None else jnp.clip(jnp.asarray(x, jnp.int32), 0, n)
  q_ids, kv_ids = (None, None) if segment_ids is None else segment_ids
  kv_lengths = kv_lengths if mask.key_chunk is not None else clip(kv_lengths, kv_seq)
  scores_ = mods.replace(mask=mask, q_lengths=clip(q_lengths, q_seq), kv_lengths=kv_lengths,
                         q_segment_ids=q_ids, kv_segment_ids=kv_ids)
  classes = score_lib.tile_classes(scores_, batch, num_q_heads, q_seq, kv_seq,
                                   config.block_q_cta, config.block_kv)
  counts, order = score_lib.block_lists(classes)
  offsets = (jnp.zeros((2,), jnp.int32) if mods.index_offsets is None
             else jnp.asarray(mods.index_offsets, jnp.int32).reshape(2))
  captured = [*(mods.score_captured if mods.score_mod is not None else ()),
              *(mods.mask_captured if mods.mask_mod is not None else ())]
  return [counts, order, offsets, *(_captured_operand(c) for c in captured)]


def _captured_operand(x):
  """A captured array as the kernel takes it in GMEM (`mod_functions`'
  convention): a 0-d array as shape (1,), a bool array as int32."""
  x = jnp.asarray(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.int32)
  return x.reshape((1,)) if x.ndim == 0 else x


def _q_options(heads_major, q_batch_divisor) -> dict:
  """The build's Q-layout arguments, only where set (the usual call builds
  the very kernel it built before they existed)."""
  options = {}
  if heads_major:
    options["heads_major"] = True
  if q_batch_divisor != 1:
    options["q_batch_divisor"] = q_batch_divisor
  return options


def check_heads_major(q_shape) -> None:
  """Raises KernelUnsupported unless Q [B, Nq, Tq, D] can be read heads-major
  without padding: head dims multiples of 64, and Tq below 8 or a multiple
  of 8 (TMA tiles (rows, head_dim) by (8, 64); a dimension shorter than a
  tile is read with zeros past it and written only where it exists,
  checked on an H100 for 2, 4 and 8 rows)."""
  if len(q_shape) != 4 or q_shape[3] % 64 or not (q_shape[2] < 8 or q_shape[2] % 8 == 0):
    raise KernelUnsupported(f"sm90 forward: heads_major takes q [B, heads, rows, head_dim] with "
                            f"rows < 8 or a multiple of 8 and head_dim a multiple of 64; got "
                            f"{q_shape}")


def check_paged(q_shape, pages_shape, table_shape, segment_ids=None) -> tuple[int, ...]:
  """Raises KernelUnsupported unless the kernel can read K/V pages of
  `pages_shape` [num_pages, page_size, Nkv, D] through a page table of
  `table_shape` [B, P]; returns the logical K shape [B, P * page_size, Nkv, D].

  Page sizes are powers of two >= 8: a page holds whole 8-row SMEM tiles,
  and a page size and `block_kv` (64 or 128) divide one another, so a block
  is whole pages or lies inside one. Head dims are multiples of 64: the cache
  is read in place, and padding it would copy it.
  """
  if len(pages_shape) != 4 or len(table_shape) != 2:
    raise KernelUnsupported(
        f"sm90 forward: pages must be [num_pages, page_size, heads, head_dim] and the page "
        f"table [batch, pages]; got {pages_shape} and {table_shape}")
  page_size, head_dim = pages_shape[1], pages_shape[3]
  if page_size < 8 or page_size & (page_size - 1):
    raise KernelUnsupported(
        f"sm90 forward: the page size (key_pages.shape[1]) must be a power of two >= 8; "
        f"got {page_size}")
  if head_dim % 64:
    raise KernelUnsupported(
        f"sm90 forward: a paged cache's head_dim must be a multiple of 64 (64, 128, 192, "
        f"256; the cache is not padded); got {head_dim}")
  if segment_ids is not None:
    raise KernelUnsupported("sm90 forward: segment_ids are not supported with a page table")
  if table_shape[0] != q_shape[0] or table_shape[1] == 0:
    raise KernelUnsupported(
        f"sm90 forward: the page table must be [batch, pages >= 1] with batch {q_shape[0]}; "
        f"got {table_shape}")
  return (table_shape[0], table_shape[1] * page_size, pages_shape[2], head_dim)


def page_table_operand(page_table, block_kv: int, page_size: int, num_pages: int):
  """The kernel's page table: int32, entries clipped into [0, num_pages)
  (entries past a row's length may hold anything, and the producer loads
  every page of a block it walks), columns padded with page 0 to whole key
  blocks (a block of small pages reads one entry per page)."""
  table = jnp.clip(jnp.asarray(page_table, jnp.int32), 0, num_pages - 1)
  per_block = kv_copies_per_block(block_kv, page_size)
  pad = -table.shape[1] % per_block
  return jnp.pad(table, [(0, 0), (0, pad)]) if pad else table
