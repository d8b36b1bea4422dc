"""MLA decode on Hopper (sm_90): many query heads against one latent head.

DeepSeek's multi-head latent attention, in its absorbed form, attends Hq
query heads of D = 576 features (512 latent + 64 rotary) to ONE shared key
head of 576 features per token, whose first Dv = 512 features are also the
value: `fa4_jax.attention(q, k, None, value_head_dim=512)` and
`fa4_jax.paged_attention(q, key_pages, None, ..., value_head_dim=512)`.
The GQA decode arrangement (`sm90_decode`) cannot serve it: the forward
kernel's SMEM and registers end at head dims of 256, and it would read the
cache twice (as K and as V). This kernel reads each cache byte once.

Rows: the T <= 4 new tokens' query heads are the rows of the MMA, token
major (row r = t * Hq + h: [B, T, Hq, D] is [B, T * Hq, D] by a free
reshape, no packing copy). A CTA owns one tile of ROWS = 64 rows (Hq 16:
one tile of 16 rows per token, the rest of the tile unused; Hq 128: two
tiles per token) and one chunk of the cache (split-K, `plan`).

Roles (three warpgroups; `MlaBarrierTable` lists every barrier):

    warpgroup 2  producer: TMA of the Q tile once, then the cache's blocks
                 of `block_kv` keys x 576 features into a ring of
                 `num_stages` SMEM slots (through the page table for a
                 paged cache: one TMA per page, or one from inside a page).
    warpgroup 0  "softmax" consumer: S = Q K^T (64 x block_kv, 576 deep),
                 the online softmax (running max and sum in registers),
                 P into SMEM and the rows' rescale factor beside it, then
                 O[:, :256] += P V_lo with V_lo = the slot's columns 0..255.
    warpgroup 1  "second half" consumer: waits for P, rescales its O by
                 the factor from SMEM, O[:, 256:] += P V_hi (columns
                 256..511 of the same slot).

Each K slot is loaded once and read three times: as K^T (all 576
features) by warpgroup 0, as V's halves by both. The f32 accumulator of
64 x 512 would take 256 registers a thread in one warpgroup; split in two
it takes 128 in each, beside S (32) in warpgroup 0. Why one warpgroup
computes S and hands P over instead of both computing S redundantly: S is
576 deep and P V only 64, so a redundant S would add 576 / (576 + 512) =
53 % to the tensor core's work, which is the bound at Hq = 128 (the
compute-bound case); the hand-off costs one SMEM tile of P (8 KiB) and two
barriers per block, and warpgroup 1's P V of block j overlaps warpgroup
0's S of block j + 1. FlashMLA splits S by key halves between its two
warpgroups and exchanges row maxima instead: balanced, but two exchanges a
block; ours keeps one.

SMEM (block_kv 64, 2 stages, bf16): Q 64 x 576 (72 KiB), the ring 2 x 64
x 576 (144 KiB), P 64 x 64 (8 KiB), the factors and lse (0.5 KiB): 229,888
of the 232,448 bytes; the output is staged in Q's tile after the last S.
Registers: producer 24, consumers 240 each (64,512 of the CTA's 64,512).

Masks: keys past a row's length (per batch row, any length >= 0), and the
bottom-right causal band among the T new tokens (token t sees keys up to
length - T + t), or none. Blocks below every row's limit run without an
element mask. A row that sees no key of its chunk ends with zeros and lse
-inf; `sm90_decode.combine` merges the chunks (log-sum-exp, in XLA).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fa4_jax.interpret import is_interpreting
from fa4_jax.kernels import KernelUnsupported, compile_ahead, sm90_decode
from fa4_jax.kernels.build_cache import cached_build
from fa4_jax.kernels.pipeline import (ACQUIRE, ARRIVE, FILL, PUBLISH, RING, TMA, WAIT,
                                      Barrier, BarrierTable, check_register_split)
from fa4_jax.kernels.schedule import sm_count
from fa4_jax.kernels.tiles import smem_tile
from fa4_jax.scores import MaskSpec, ScoreFunction, cdiv, finish_rows

ROWS = 64  # MMA rows of a tile: one consumer warpgroup's wgmma M
MAX_TOKENS = 4  # new tokens per row the kernel serves (speculative decode's drafts)
MAX_VALUE_HEAD_DIM = 512  # two halves of 256 f32 columns: 128 registers a thread each
SMEM_LIMIT_BYTES = 232448
H100_SMS = 132
PRODUCER_REGISTERS = 24
CONSUMER_REGISTERS = 240
NUM_CONSUMERS = 2
_ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)
_MASKED = -jnp.inf


@dataclasses.dataclass(frozen=True)
class MlaPlan:
  """How one call is cut: the cache in `splits` chunks of whole key blocks
  (and pages), each walked in blocks of `block_kv` keys through a ring of
  `num_stages` slots."""

  splits: int = 1
  block_kv: int = 64
  num_stages: int = 2
  # The row tiles of an item as CUDA's fastest grid axis (`MlaConfig`).
  tiles_adjacent: bool = False
  # "handoff" (wg 0 computes every S) or "alternate" (`MlaConfig.schedule`).
  schedule: str = "handoff"

  def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
    q = ROWS * head_dim * itemsize
    ring = self.num_stages * self.block_kv * head_dim * itemsize
    p = ROWS * self.block_kv * itemsize
    if self.schedule == "alternate":  # m and l of each warpgroup, the lse
      rows, barriers = 5 * ROWS * 4, 8 * (2 * self.num_stages + 7)
    else:  # the rescale factors and the lse
      rows, barriers = 2 * ROWS * 4, 8 * (2 * self.num_stages + 3)
    return q + ring + p + rows + barriers

  def fits_smem(self, head_dim: int, itemsize: int = 2) -> bool:
    return self.smem_bytes(head_dim, itemsize) <= SMEM_LIMIT_BYTES


@dataclasses.dataclass(frozen=True)
class MlaConfig:
  """Switches of `choose_plan`, for side-by-side measurement (`CONFIGS`;
  the module's `CONFIG` is what calls get; `use_config` sets it while a call
  is traced).

  waves: the splits rule's waves of the SMs for calls with lengths (None:
    `sm90_decode.RAGGED_WAVES`, 8, the GQA decode's rule for ragged rows);
    1, the default, cuts the cache as for equal lengths: one CTA per SM's
    worth of items. H100, 2026-12-07 (`bench_mla.py --configs`, full
    lengths): B32 T1 Hq16 S32k 3,016 GB/s against 2,294 under 8 waves, B128
    T1 Hq16 S16k 3,099 against 3,003, B128 T1 Hq128 S8k 369 TFLOP/s against
    342 (the 8 waves' fill, drain and 32-way combine were the loss).
    Unequal lengths were not measured under either rule.
  tiles_adjacent: True, the default: the grid's row tiles vary fastest in
    CUDA's launch order, so the T * Hq / 64 CTAs of one item (batch row,
    chunk) start together and all but the first find the item's cache
    blocks in L2. False ("items_first", the former default): the items vary
    fastest (`plgpu.kernel` makes the last grid axis CUDA's x), so at B128
    Hq128 tile 0 of every item runs in the first wave and tile 1 a wave
    later, reading the cache from HBM again (docs/performance-notes.md,
    "MLA decode: the second row tile reads HBM"). H100, 2026-12-07, B128 T1
    Hq128 S8k: 595 TFLOP/s against 369, outputs bitwise equal. Changes no
    CTA's code or barriers; with one row tile, nothing.
  schedule: "handoff", the default: warpgroup 0 computes every S and hands
    P to warpgroup 1 (`MlaBarrierTable`). "alternate": FlashMLA's order,
    each warpgroup computes S and the softmax of every other block (wg w
    the blocks j with j % 2 == w), issuing its next S before it adds the
    other's P V, and the running row max passes between them through SMEM
    with P (`MlaAlternateBarrierTable`): each softmax runs beside the other
    warpgroup's GEMMs."""

  waves: int | None = 1
  tiles_adjacent: bool = True
  schedule: str = "handoff"


# Lost, and left the code (docs/performance-notes.md, "MLA decode on Hopper:
# a model of the bound"): warpgroup 0 issuing S of block j before P V_lo of
# block j - 1, to run the softmax under P V ("overlap": 2-3 % slower on all
# three rows, with one wave or eight); 32-key blocks through 4 slots (jax
# 0.11.2's Mosaic GPU layout inference finds no layouts for them).
CONFIGS = {
    "default": MlaConfig(),
    "waves8": MlaConfig(waves=None, tiles_adjacent=False),
    "items_first": MlaConfig(tiles_adjacent=False),
    "alternate": MlaConfig(schedule="alternate"),
    # For rows of unequal lengths: more waves of splits, so that short rows'
    # chunks leave SMs to long rows' chunks. H100, 2026-12-07, lengths S/16..S
    # (bench_mla.py --only ragged): memory-bound B32 Hq16 S32k one wave 2643
    # GB/s, two 2272, eight 1852; compute-bound B128 Hq128 S8k 403 / 402 /
    # 456 TFLOP/s. No rule: the call knows lengths were passed, not how
    # ragged they are.
    "waves2": MlaConfig(waves=2),
    "waves8_adjacent": MlaConfig(waves=None),
}
CONFIG = CONFIGS["default"]


@contextlib.contextmanager
def use_config(config):
  """`CONFIG` = config (a `MlaConfig` or a name in `CONFIGS`) inside the block."""
  global CONFIG
  old, CONFIG = CONFIG, CONFIGS[config] if isinstance(config, str) else config
  try:
    yield CONFIG
  finally:
    CONFIG = old


def check_supported(q_shape, k_shape, dtype, value_head_dim: int, mask: MaskSpec,
                    page_size: int | None = None) -> None:
  """Raises KernelUnsupported unless the kernel serves these shapes:
  q [B, T, Hq, D], k the logical cache [B, S, 1, D] (one latent head),
  values its first `value_head_dim` features."""
  b, t, n, d = q_shape
  s, kv_heads = k_shape[1], k_shape[2]
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise KernelUnsupported(f"sm90 MLA decode: bfloat16 or float16, got {jnp.dtype(dtype)}")
  if kv_heads != 1:
    raise KernelUnsupported(f"sm90 MLA decode: one latent KV head, got {kv_heads}")
  if d % 64 or d > 576:
    raise KernelUnsupported(f"sm90 MLA decode: head dim a multiple of 64 up to 576, got {d}")
  if value_head_dim % 128 or value_head_dim > min(d, MAX_VALUE_HEAD_DIM):
    raise KernelUnsupported(f"sm90 MLA decode: value head dim a multiple of 128 up to "
                            f"{MAX_VALUE_HEAD_DIM} and the head dim, got {value_head_dim}")
  if t > MAX_TOKENS:
    raise KernelUnsupported(f"sm90 MLA decode: at most {MAX_TOKENS} new tokens, got {t}")
  if not (mask.is_dense or (mask.is_causal and (mask.offset_from_lengths
                                                or mask.q_offset == s - t))):
    raise KernelUnsupported("sm90 MLA decode: no band, or the bottom-right causal band")
  if page_size is None and s % 64:
    raise KernelUnsupported(f"sm90 MLA decode: a contiguous cache of a multiple of 64 keys, "
                            f"got {s}")
  if page_size is not None and (page_size < 8 or page_size & (page_size - 1)):
    raise KernelUnsupported(f"sm90 MLA decode: pages of a power of two >= 8 keys, got "
                            f"{page_size}")


def choose_plan(q_shape, k_shape, *, ragged: bool = True, page_size: int | None = None,
         num_sms: int | None = None) -> MlaPlan:
  """Chunks of the cache: `sm90_decode.choose_splits` over B x (row tiles)
  items, chunks of whole blocks and pages, at least `sm90_decode.MIN_CHUNK`
  keys, with `MlaConfig.waves` waves of the SMs where lengths are passed
  (one: measured, `MlaConfig`). Blocks of 64
  keys through 2 slots (the largest ring SMEM holds beside the 64 x 576 Q
  tile); narrower head dims get more slots."""
  b, t, n, d = q_shape
  s = k_shape[1]
  config = CONFIG
  block_kv = 64
  stages = 2
  while MlaPlan(1, block_kv, stages + 1, schedule=config.schedule).fits_smem(d) and stages < 4:
    stages += 1
  granule = max(block_kv, page_size or 1)
  tiles = cdiv(t * n, ROWS)
  sms = sm_count(H100_SMS) if num_sms is None else num_sms
  if ragged and config.waves is not None:  # the rule's slots: waves x SMs
    ragged, sms = False, sms * config.waves
  splits = sm90_decode.choose_splits(b, 1, s, ragged=ragged, num_sms=sms, granule=granule,
                                     tiles=tiles)
  return MlaPlan(splits, block_kv, stages, tiles_adjacent=config.tiles_adjacent,
                 schedule=config.schedule)


@dataclasses.dataclass(frozen=True)
class _Statics:
  """A kernel's compile-time constants."""

  plan: MlaPlan
  batch: int
  tokens: int
  heads: int
  rows: int  # T * Hq, padded to whole tiles beyond one tile
  head_dim: int
  value_head_dim: int
  chunk: int  # keys per item
  dtype: object
  exp2_c: float  # P = exp2(c * s - m)
  causal: bool
  has_q_lengths: bool
  page_size: int | None
  num_pages: int | None
  interpreting: bool

  @property
  def tiles(self) -> int:
    return cdiv(self.rows, ROWS)

  @property
  def tile_rows(self) -> int:
    """Rows a tile loads and stores: whole tiles, or the one short tile."""
    return min(self.rows, ROWS)

  @property
  def half(self) -> int:
    return self.value_head_dim // NUM_CONSUMERS

  @property
  def copies_per_block(self) -> int:
    return 1 if self.page_size is None else max(self.plan.block_kv // self.page_size, 1)


class MlaBarrierTable(BarrierTable):
  """Every mbarrier of the MLA decode kernel, declared in the form of
  `pipeline.BarrierTable` (cf. `sm90_forward.ForwardBarrierTable`).

  Who arrives on each barrier and who waits on it, by role and accessor
  (no role touches a barrier except through these accessors), in the one
  work item of a CTA:

  name     count   arrivals   arrived on by                       waited on by
  q_full   1       1 (TMA)    producer: producer_q (TMA of the Q  both consumers: consumer_q, once
                                tile)                               (wg 1 also stages O in Q's tile)
  kv_full  stages  kv copies  producer: producer_kv (TMAs of      both consumers: consumer_kv,
                     (TMA)      block j's keys: paged, one per      every block
                                page, or one from inside a page)
  kv_free  stages  2          wg 0: consumer_kv_release after its producer: producer_kv_acquire
                                P V_lo, wg 1 after its P V_hi       (before it refills the slot),
                                                                    drain_kv*
  p_full   1       1          wg 0: producer_p (P and the         wg 1: consumer_p, n_blocks + 1
                                rescale factors of block j in       phases (the last: 1 / l)
                                SMEM; last phase: 1 / l and lse)
  p_free   1       1          wg 1: consumer_p_release after its  wg 0: producer_p_acquire, before
                                P V_hi of block j                   it rewrites P (block j > 0) and
                                                                    1 / l (n_blocks > 0)

  stages = num_stages (ring slot `slot("kv_full", j)` of block j), kv
  copies = `_Statics.copies_per_block`. * interpreter only. The output is
  staged in Q's tile after wg 0's last S (wg 1 waits for p_full's last
  phase, which follows it).
  """

  ALLOCATION_ORDER = "as declared"
  BARRIERS = {
      # name: Barrier(how many, arrivals, orders tensor core, arrived on by
      #               {accessor: how}, waited on by {accessor: how}, index)
      "q_full": Barrier("one", 1, False, arrive={"producer_q": TMA}, wait={"consumer_q": WAIT}),
      "kv_full": Barrier("stage", "kv copies", False, arrive={"producer_kv": FILL},
                         wait={"consumer_kv": WAIT}, index=RING),
      "kv_free": Barrier("stage", "consumers", False, arrive={"consumer_kv_release": ARRIVE},
                         wait={"producer_kv_acquire": ACQUIRE}, index=RING),
      "p_full": Barrier("one", 1, False, arrive={"producer_p": PUBLISH},
                        wait={"consumer_p": WAIT}),
      "p_free": Barrier("one", 1, False, arrive={"consumer_p_release": ARRIVE},
                        wait={"producer_p_acquire": WAIT}),
  }

  @staticmethod
  def barrier_counts(st: "_Statics") -> dict:
    return {"one": 1, "stage": st.plan.num_stages, "kv copies": st.copies_per_block,
            "consumers": NUM_CONSUMERS}

  # Interpreter-only drain of the last phases (see `BarrierTable`).
  def drain_kv(self, num_blocks) -> None:
    """Producer: observe the kv_free phases of the last lap."""
    self._drain_last_lap(num_blocks, "kv_free")


class MlaAlternateBarrierTable(BarrierTable):
  """Every mbarrier of the MLA decode kernel under `schedule="alternate"`
  (`MlaConfig`): warpgroup w computes S and the softmax of the blocks j
  with j % 2 == w ("its own"), and adds P V of every block to its half of O.
  The producer and the ring are those of `MlaBarrierTable`. In SMEM beside
  P: the running row max after each block (`stats` rows 0 and 1, by the
  writer's parity) and, at the end, each warpgroup's row sum (rows 2, 3).

  name     count   arrivals   arrived on by                       waited on by
  q_full   1       1 (TMA)    producer: producer_q (TMA of the Q  both consumers: consumer_q, once
                                tile)                               (both stage O in Q's tile)
  kv_full  stages  kv copies  producer: producer_kv (TMAs of      both consumers: consumer_kv,
                     (TMA)      block j, as in MlaBarrierTable)     every block (its S or P V)
  kv_free  stages  2          each consumer: consumer_kv_release  producer: producer_kv_acquire
                                after its P V of block j            (before it refills the slot),
                                                                    drain_kv*
  p_full   2       1          wg w: producer_p(w) (P of its own   wg 1 - w: consumer_p(w), before
                                block j and the row max after j     its P V of block j (every
                                in stats[w])                        phase)
  p_free   2       1          wg w: consumer_p_release(w) after   wg 1 - w: producer_p_acquire(w)
                                its P V of its own block j (P is    before it writes P of block
                                read; stats[w] read by wg 1 - w     j + 1; drain_p* (the phase of
                                before that)                        the last block, if it is w's)
  l_full   2       1          wg w: producer_l(w) (its row sum,   wg 1 - w: consumer_l(w), once
                                stats[2 + w], after its last S:     (then O is staged in Q's tile)
                                Q is free of wg w)

  stages, kv copies: as in MlaBarrierTable; barrier w of p_full, p_free
  and l_full is arrived on by warpgroup w. * interpreter only.
  """

  ALLOCATION_ORDER = "as declared"
  BARRIERS = {
      # The producer's three, as in MlaBarrierTable.
      **{name: MlaBarrierTable.BARRIERS[name] for name in ("q_full", "kv_full", "kv_free")},
      "p_full": Barrier("consumers", 1, False, arrive={"producer_p": PUBLISH},
                        wait={"consumer_p": WAIT}),
      "p_free": Barrier("consumers", 1, False, arrive={"consumer_p_release": ARRIVE},
                        wait={"producer_p_acquire": WAIT}),
      "l_full": Barrier("consumers", 1, False, arrive={"producer_l": PUBLISH},
                        wait={"consumer_l": WAIT}),
  }

  barrier_counts = staticmethod(MlaBarrierTable.barrier_counts)
  drain_kv = MlaBarrierTable.drain_kv

  def drain_p(self, num_blocks, other: int) -> None:
    """Interpreter only: a consumer observes the other's p_free phase of
    the last block when that block is the other's (no block of its own
    follows to wait for it)."""
    if not self._interpreting:
      return

    @pl.when((num_blocks > 0) & (lax.rem(num_blocks - 1, 2) == other))
    def _():
      plgpu.barrier_wait(self._refs["p_free"].at[other])


@dataclasses.dataclass(frozen=True)
class _Ctx:
  st: _Statics
  q: object
  k: object
  table: object
  ends: object
  diags: object
  q_lens: object
  out: object
  lse: object
  q_smem: object
  ring: object
  p_smem: object
  factor_smem: object
  lse_smem: object
  bars: MlaBarrierTable
  tile: object
  item: object

  @property
  def batch_row(self):
    return lax.div(self.item, jnp.int32(self.st.plan.splits))

  def block_range(self):
    """(blocks to walk, blocks below every row's limit) of this item."""
    st, bkv = self.st, self.st.plan.block_kv
    end = self.ends[self.item]
    hi, lo = end, end
    if st.causal:
      diag = self.diags[self.item]
      hi = jnp.minimum(end, diag + st.tokens)  # the last token's limit
      lo = jnp.minimum(end, diag + 1)  # token 0's
    hi = jnp.clip(hi, 0, st.chunk)
    lo = jnp.clip(lo, 0, st.chunk)
    return lax.div(hi + (bkv - 1), jnp.int32(bkv)), lax.div(lo, jnp.int32(bkv))

  def row_limits(self):
    """Per row of the tile: keys (chunk-local) below this are visible."""
    st = self.st
    end = self.ends[self.item]
    if not st.causal:
      return end
    rows = self.tile * ROWS + plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=_ROW_LAYOUT)
    token = lax.div(rows, jnp.int32(st.heads))
    return jnp.minimum(end, self.diags[self.item] + token + 1)


def _producer(ctx: _Ctx) -> None:
  st, bars = ctx.st, ctx.bars
  plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
  r = st.tile_rows
  plgpu.copy_gmem_to_smem(ctx.q.at[ctx.batch_row, pl.ds(ctx.tile * ROWS, r)],
                          ctx.q_smem.at[pl.ds(0, r)], bars.producer_q())
  n_blocks, _ = ctx.block_range()

  @pl.loop(0, n_blocks)
  def _(j):
    copies = _block_copies(ctx, j)  # page numbers read before the wait
    bars.producer_kv_acquire(j)
    bars.producer_kv(copies, j)

  bars.drain_kv(n_blocks)


def _block_copies(ctx: _Ctx, j):
  """[(GMEM source, the ring, rows of the slot)] that fill block j of the
  item (`MlaBarrierTable.producer_kv`'s copies)."""
  st, bkv = ctx.st, ctx.st.plan.block_kv
  if st.page_size is None:
    return [(ctx.k.at[ctx.item, pl.ds(j * bkv, bkv)], ctx.ring, pl.ds(0, bkv))]
  ps = st.page_size
  if ps < bkv:
    per_block = bkv // ps
    return [(ctx.k.at[ctx.table[ctx.item, j * per_block + c]], ctx.ring, pl.ds(c * ps, ps))
            for c in range(per_block)]
  per_page = jnp.int32(ps // bkv)
  page = ctx.table[ctx.item, lax.div(j, per_page)]
  return [(ctx.k.at[page, pl.ds(lax.rem(j, per_page) * bkv, bkv)], ctx.ring, pl.ds(0, bkv))]


def _mma(acc, a, b, shape, interpreting: bool):
  """acc + a @ b by wgmma (acc None: a fresh result). The interpreter takes
  no run_state: there a fresh accumulator is added."""
  if acc is None or interpreting:
    def fresh(ref):
      plgpu.wgmma(ref, a, b)
      return ref[...]
    out = pl.run_scoped(fresh, plgpu.ACC(shape, jnp.float32))
    return out if acc is None else acc + out

  def accumulate(ref):
    plgpu.wgmma(ref, a, b)
  return pl.run_state(accumulate)(plgpu.ACC.init(acc))


def _zeros(shape):
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def _row_vector(value):
  return plgpu.layout_cast(jnp.full((ROWS,), value, jnp.float32), _ROW_LAYOUT)


def _block_softmax(ctx: _Ctx, s, m, l, j, limits, masked: bool):
  """(P in the input dtype, new running max, new running sum, alpha) of the
  logits s of block j."""
  st, bkv, c = ctx.st, ctx.st.plan.block_kv, ctx.st.exp2_c
  if masked:
    keys = j * bkv + plgpu.broadcasted_iota(jnp.int32, (ROWS, bkv), 1,
                                            layout=plgpu.Layout.WGMMA)
    lim = limits if not st.causal else lax.broadcast_in_dim(limits, s.shape, [0])
    s = jnp.where(keys < lim, s, _MASKED)
  m_new = jnp.maximum(m, s.max(axis=1) * c)
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw no key yet
  alpha = jnp.exp2(m - m_use)
  p = jnp.exp2(s * c - lax.broadcast_in_dim(m_use, s.shape, [0]))
  l = l * alpha + p.sum(axis=1)
  return p.astype(st.dtype), m_new, l, alpha


def _softmax_consumer(ctx: _Ctx) -> None:
  """Warpgroup 0: S, the softmax, P to SMEM, O[:, :half] += P V_lo."""
  st, bars, bkv = ctx.st, ctx.bars, ctx.st.plan.block_kv
  n_blocks, full_blocks = ctx.block_range()
  limits = ctx.row_limits()

  def step(j, carry, masked: bool):
    acc, m, l = carry
    slot = bars.slot("kv_full", j)
    bars.consumer_kv(j)
    s = _mma(None, ctx.q_smem, ctx.ring.at[slot].transpose((1, 0)), (ROWS, bkv), st.interpreting)
    p, m_new, l, alpha = _block_softmax(ctx, s, m, l, j, limits, masked)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

    @pl.when(j > 0)
    def _():
      bars.producer_p_acquire()  # wg 1 is done with P of block j - 1

    ctx.p_smem[...] = p
    ctx.factor_smem[...] = alpha
    bars.producer_p()
    acc = _mma(acc, ctx.p_smem, ctx.ring.at[slot, :, pl.ds(0, st.half)], acc.shape,
               st.interpreting)
    bars.consumer_kv_release(j)
    return acc, m_new, l

  carry = (_zeros((ROWS, st.half)), _row_vector(-jnp.inf), _row_vector(0.0))
  bars.consumer_q()
  carry = lax.fori_loop(0, full_blocks, functools.partial(step, masked=False), carry)
  acc, m, l = lax.fori_loop(full_blocks, n_blocks, functools.partial(step, masked=True), carry)
  if st.has_q_lengths:  # rows of tokens past the row's query length: zeros, lse -inf
    rows = ctx.tile * ROWS + plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=_ROW_LAYOUT)
    l = jnp.where(lax.div(rows, jnp.int32(st.heads)) < ctx.q_lens[ctx.batch_row], l, 0.0)
  inv_l, lse = finish_rows(m, l)

  @pl.when(n_blocks > 0)
  def _():
    bars.producer_p_acquire()  # the last block's factors are read

  ctx.factor_smem[...] = inv_l
  ctx.lse_smem[...] = lse
  bars.producer_p()
  _store_half(ctx, acc * lax.broadcast_in_dim(inv_l, acc.shape, [0]), 0)
  r = st.tile_rows
  plgpu.copy_smem_to_gmem(ctx.lse_smem.at[pl.ds(0, r)],
                          ctx.lse.at[ctx.item, pl.ds(ctx.tile * ROWS, r)])
  plgpu.wait_smem_to_gmem(0)


def _second_half_consumer(ctx: _Ctx) -> None:
  """Warpgroup 1: O[:, half:] += P V_hi with P and the factors of wg 0."""
  st, bars = ctx.st, ctx.bars
  n_blocks, _ = ctx.block_range()

  def step(j, acc):
    slot = bars.slot("kv_full", j)
    bars.consumer_kv(j)
    bars.consumer_p()
    alpha = plgpu.load(ctx.factor_smem, layout=_ROW_LAYOUT)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    acc = _mma(acc, ctx.p_smem, ctx.ring.at[slot, :, pl.ds(st.half, st.half)], acc.shape,
               st.interpreting)
    bars.consumer_p_release()
    bars.consumer_kv_release(j)
    return acc

  bars.consumer_q()  # Q's tile holds the output at the end
  acc = lax.fori_loop(0, n_blocks, step, _zeros((ROWS, st.half)))
  bars.consumer_p()  # 1 / l, after wg 0's last S (Q is free)
  inv_l = plgpu.load(ctx.factor_smem, layout=_ROW_LAYOUT)
  _store_half(ctx, acc * lax.broadcast_in_dim(inv_l, acc.shape, [0]), 1)
  plgpu.wait_smem_to_gmem(0)


def _alternate_consumer(ctx: _Ctx, w: int) -> None:
  """Consumer warpgroup w under `schedule="alternate"`: S and the softmax of
  its own blocks (j % 2 == w), P V of every block into O[:, w * half:].
  At the other's block j it first issues S of block j + 1 (its own), then
  waits for P of j and adds P V; at its own block it runs the softmax of
  the S it holds, publishes P and the row max, and adds P V."""
  st, bars, bkv = ctx.st, ctx.bars, ctx.st.plan.block_kv
  other = 1 - w
  n_blocks, full_blocks = ctx.block_range()
  limits = ctx.row_limits()
  cols = pl.ds(w * st.half, st.half)
  bcast = lambda v, x: lax.broadcast_in_dim(v, x.shape, [0])

  def scores(j):
    bars.consumer_kv(j)
    slot = bars.slot("kv_full", j)
    return _mma(None, ctx.q_smem, ctx.ring.at[slot].transpose((1, 0)), (ROWS, bkv),
                st.interpreting)

  def add_pv(acc, j):
    acc = _mma(acc, ctx.p_smem, ctx.ring.at[bars.slot("kv_full", j), :, cols], acc.shape,
               st.interpreting)
    bars.consumer_kv_release(j)
    return acc

  def own(j, carry, masked: bool):
    acc, m, l, s = carry
    p, m_new, l, alpha = _block_softmax(ctx, s, m, l, j, limits, masked)
    acc = acc * bcast(alpha, acc)

    @pl.when(j > 0)
    def _():
      bars.producer_p_acquire(other)  # the other's P V of block j - 1 read P

    ctx.p_smem[...] = p
    ctx.factor_smem.at[w][...] = m_new
    bars.producer_p(w)
    acc = add_pv(acc, j)
    bars.consumer_p_release(w)
    return acc, m_new, l, s

  def others(j, carry, lookahead):
    """lookahead: True (block j + 1 exists), False (it does not) or None
    (it may: a cond on S alone)."""
    acc, m, l, s = carry
    if lookahead is None:
      s = lax.cond(j + 1 < n_blocks, lambda: scores(j + 1), lambda: _zeros(s.shape))
    elif lookahead:
      s = scores(j + 1)
    bars.consumer_p(other)
    m_j = plgpu.load(ctx.factor_smem.at[other], layout=_ROW_LAYOUT)
    alpha = jnp.exp2(m - jnp.where(m_j == -jnp.inf, 0.0, m_j))
    acc = add_pv(acc * bcast(alpha, acc), j)
    return acc, m_j, l * alpha, s

  def pair(i, carry, masked: bool):
    """Blocks 2i (wg 0's) and 2i + 1 (wg 1's), both present."""
    j = 2 * i
    if w == 0:
      return others(j + 1, own(j, carry, masked), None)
    return own(j + 1, others(j, carry, True), masked)

  def last(carry):
    """Block n - 1 of an odd count (wg 0's), masked."""
    j = n_blocks - 1
    return own(j, carry, True) if w == 0 else others(j, carry, False)

  bars.consumer_q()
  s0 = _zeros((ROWS, bkv))
  if w == 0:  # block 0 is wg 0's: its S before the loop
    s0 = lax.cond(n_blocks > 0, lambda: scores(0), lambda: s0)
  carry = (_zeros((ROWS, st.half)), _row_vector(-jnp.inf), _row_vector(0.0), s0)
  full_pairs, pairs = lax.div(full_blocks, 2), lax.div(n_blocks, 2)
  carry = lax.fori_loop(0, full_pairs, functools.partial(pair, masked=False), carry)
  carry = lax.fori_loop(full_pairs, pairs, functools.partial(pair, masked=True), carry)
  acc, m, l, _ = lax.cond(lax.rem(n_blocks, 2) == 1, last, lambda c: c, carry)
  bars.drain_p(n_blocks, other)
  ctx.factor_smem.at[2 + w][...] = l
  bars.producer_l(w)  # after this warpgroup's last S: Q is free of it
  bars.consumer_l(other)
  l = l + plgpu.load(ctx.factor_smem.at[2 + other], layout=_ROW_LAYOUT)
  if st.has_q_lengths:  # rows of tokens past the row's query length: zeros, lse -inf
    rows = ctx.tile * ROWS + plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=_ROW_LAYOUT)
    l = jnp.where(lax.div(rows, jnp.int32(st.heads)) < ctx.q_lens[ctx.batch_row], l, 0.0)
  inv_l, lse = finish_rows(m, l)
  _store_half(ctx, acc * bcast(inv_l, acc), w)
  if w == 0:
    ctx.lse_smem[...] = lse
    plgpu.commit_smem()
    r = st.tile_rows
    plgpu.copy_smem_to_gmem(ctx.lse_smem.at[pl.ds(0, r)],
                            ctx.lse.at[ctx.item, pl.ds(ctx.tile * ROWS, r)])
  plgpu.wait_smem_to_gmem(0)


def _store_half(ctx: _Ctx, out, half_index: int) -> None:
  """A consumer's columns of O through Q's SMEM tile (no S reads it now)."""
  st = ctx.st
  cols = pl.ds(half_index * st.half, st.half)
  staged = ctx.q_smem.at[:, cols]
  staged[...] = out.astype(st.dtype)
  plgpu.commit_smem()
  # TMA reads contiguous SMEM: a column slice of the (8, 64)-tiled tile is
  # contiguous within one group of 8 rows, so one copy per group.
  for g in range(st.tile_rows // 8):
    rows = pl.ds(g * 8, 8)
    plgpu.copy_smem_to_gmem(ctx.q_smem.at[rows, cols],
                            ctx.out.at[ctx.item, pl.ds(ctx.tile * ROWS + g * 8, 8), cols])


def _kernel(st: _Statics, *refs) -> None:
  refs = list(refs)
  q, k = refs.pop(0), refs.pop(0)
  table = refs.pop(0) if st.page_size is not None else None
  ends = refs.pop(0)
  diags = refs.pop(0) if st.causal else None
  q_lens = refs.pop(0) if st.has_q_lengths else None
  out, lse, smem, barrier_refs = refs
  q_smem, ring, p_smem, factor_smem, lse_smem = smem
  alternate = st.plan.schedule == "alternate"
  bars = (MlaAlternateBarrierTable if alternate else MlaBarrierTable)(st, barrier_refs)
  ctx = _Ctx(st, q, k, table, ends, diags, q_lens, out, lse, q_smem, ring, p_smem, factor_smem,
             lse_smem, bars, lax.axis_index("tiles"), lax.axis_index("items"))
  wg = lax.axis_index("wg")
  pl.when(wg == NUM_CONSUMERS)(functools.partial(_producer, ctx))

  @pl.when(wg < NUM_CONSUMERS)
  def _():
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    if alternate:
      for w in range(NUM_CONSUMERS):
        pl.when(wg == w)(functools.partial(_alternate_consumer, ctx, w))
    else:
      pl.when(wg == 0)(functools.partial(_softmax_consumer, ctx))
      pl.when(wg == 1)(functools.partial(_second_half_consumer, ctx))


def _grid(tiles: int, items: int, tiles_adjacent: bool) -> dict:
  """`plgpu.kernel`'s grid: its last axis is CUDA's x, which the block
  scheduler walks fastest, so the last axis' CTAs launch side by side."""
  if tiles_adjacent:
    return dict(grid=(items, tiles), grid_names=("items", "tiles"))
  return dict(grid=(tiles, items), grid_names=("tiles", "items"))


@cached_build
def _build(st: _Statics):
  check_register_split("sm90 MLA decode", PRODUCER_REGISTERS, NUM_CONSUMERS, CONSUMER_REGISTERS)
  pl_, d, bkv = st.plan, st.head_dim, st.plan.block_kv
  items = st.batch * pl_.splits

  def kernel(*refs):  # Mosaic GPU names the kernel after this function
    _kernel(st, *refs)

  smem = (smem_tile((ROWS, d), st.dtype),  # Q, then O
          smem_tile((pl_.num_stages, bkv, d), st.dtype),  # the K (and V) ring
          smem_tile((ROWS, bkv), st.dtype, swizzle=min(128, bkv * 2)),  # P
          # handoff: the rescale factors, then 1 / l; alternate: m of wg 0, 1, l of wg 0, 1
          plgpu.SMEM((ROWS,) if pl_.schedule != "alternate" else (2 * NUM_CONSUMERS, ROWS),
                     jnp.float32),
          plgpu.SMEM((ROWS,), jnp.float32))  # lse
  tiles_rows = st.tiles * ROWS if st.rows > ROWS else st.rows
  out_type = (jax.ShapeDtypeStruct((items, tiles_rows, st.value_head_dim), st.dtype),
              jax.ShapeDtypeStruct((items, tiles_rows), jnp.float32))
  return plgpu.kernel(
      compile_ahead.named(kernel, "sm90_mla_decode"),
      out_type=out_type,
      scratch_types=(smem, (MlaAlternateBarrierTable if pl_.schedule == "alternate"
                            else MlaBarrierTable).scratch_types(st)),
      **_grid(st.tiles, items, pl_.tiles_adjacent),
      num_threads=NUM_CONSUMERS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
  )


def _item_operands(kv_lengths, q_lengths, *, batch: int, kv_seq: int, tokens: int,
                   splits: int, mask: MaskSpec):
  """Per item (batch row, chunk) int32: `ends`, the chunk-local key count
  below the row's length, and `diags` (causal), token 0's last visible key
  + 0, chunk-local: token t sees keys <= diags + t."""
  chunk = kv_seq // splits
  total = (jnp.full((batch,), kv_seq, jnp.int32) if kv_lengths is None
           else jnp.clip(jnp.asarray(kv_lengths, jnp.int32), 0, kv_seq))
  starts = jnp.arange(splits, dtype=jnp.int32) * chunk
  ends = (total[:, None] - starts[None, :]).reshape(-1)
  if mask.is_dense:
    return ends, None
  if mask.offset_from_lengths:
    q_len = (jnp.full((batch,), tokens, jnp.int32) if q_lengths is None
             else jnp.clip(jnp.asarray(q_lengths, jnp.int32), 0, tokens))
    offset = total - q_len
  else:
    offset = jnp.full((batch,), mask.q_offset, jnp.int32)
  return ends, (offset[:, None] - starts[None, :]).reshape(-1)


def forward(q, k, q_lengths, kv_lengths, *, value_head_dim: int, score: ScoreFunction,
            mask: MaskSpec, page_table=None, plan: MlaPlan | None = None):
  """(out [B, T, Hq, Dv] in q's dtype, lse f32 [B, Hq, T]).

  q [B, T, Hq, D]; k the latent cache [B, S, 1, D], or pages
  [num_pages, page_size, 1, D] with `page_table` int32 [B, P] (S = P *
  page_size; entries clipped into range). The values are k's first
  `value_head_dim` features. `kv_lengths` None or int32 [B]; `q_lengths`
  None or int32 [B] (tokens at or past it get zeros and lse -inf). `mask`:
  no band, or bottom-right causal (`check_supported`)."""
  if score.cap is not None:
    raise KernelUnsupported("sm90 MLA decode: no soft-cap")
  b, t, n, d = q.shape
  page_size = None if page_table is None else k.shape[1]
  if page_table is None:
    s = k.shape[1]
  else:
    if k.ndim != 4 or jnp.ndim(page_table) != 2 or jnp.shape(page_table)[0] != b:
      raise KernelUnsupported(f"sm90 MLA decode: pages [num_pages, page_size, 1, D] and a table "
                              f"[B, P]; got {k.shape} and {jnp.shape(page_table)}")
    s = jnp.shape(page_table)[1] * page_size
  check_supported(q.shape, (b, s, k.shape[2], k.shape[3]), q.dtype, value_head_dim, mask,
                  page_size)
  if k.dtype != q.dtype:
    raise KernelUnsupported(f"sm90 MLA decode: q and the cache share a dtype; got {q.dtype} "
                            f"and {k.dtype}")
  if plan is None:
    plan = choose_plan(q.shape, (b, s, 1, d), ragged=kv_lengths is not None,
                             page_size=page_size)
  p, bkv = plan.splits, plan.block_kv
  granule = max(bkv, page_size or 1)
  if s % (p * granule) or (page_size is not None and bkv % page_size and page_size % bkv):
    raise KernelUnsupported(f"sm90 MLA decode: {p} chunks of whole blocks of {bkv} keys (and "
                            f"pages of {page_size}) must tile the {s} keys")
  if not plan.fits_smem(d, q.dtype.itemsize):
    raise KernelUnsupported(f"sm90 MLA decode: {plan} does not fit SMEM at head dim {d}")
  rows = t * n
  padded = rows if rows <= ROWS and rows % 8 == 0 else cdiv(rows, ROWS if rows > ROWS else 8) * (
      ROWS if rows > ROWS else 8)
  q_rows = q.reshape(b, rows, d)
  if padded != rows:
    q_rows = jnp.pad(q_rows, [(0, 0), (0, padded - rows), (0, 0)])
  st = _Statics(plan=plan, batch=b, tokens=t, heads=n, rows=padded, head_dim=d,
                value_head_dim=value_head_dim, chunk=s // p, dtype=jnp.dtype(q.dtype),
                exp2_c=score.exp2_constant, causal=not mask.is_dense,
                has_q_lengths=q_lengths is not None, page_size=page_size,
                num_pages=None if page_size is None else k.shape[0],
                interpreting=is_interpreting())
  if page_table is None:
    k_op = k.reshape(b * p, s // p, d)  # chunks as items: a free reshape
  else:
    k_op = k.reshape(k.shape[0], page_size, d)
  args = [q_rows, k_op]
  if page_table is not None:
    table = jnp.clip(jnp.asarray(page_table, jnp.int32), 0, k.shape[0] - 1)
    args.append(table.reshape(b * p, table.shape[1] // p))
  ends, diags = _item_operands(kv_lengths, q_lengths, batch=b, kv_seq=s, tokens=t, splits=p,
                               mask=mask)
  args.append(ends)
  if diags is not None:
    args.append(diags)
  if q_lengths is not None:
    args.append(jnp.asarray(q_lengths, jnp.int32))
  out, lse = _build(st)(*args)
  out, lse = out[:, :rows], lse[:, :rows]
  if p == 1:
    return (out.reshape(b, t, n, value_head_dim),
            lse.reshape(b, t, n).transpose(0, 2, 1))
  merged, lse = sm90_decode.combine(out.reshape(b * p, rows, 1, value_head_dim),
                                    lse.reshape(b * p, 1, rows), p, t)
  return merged.astype(q.dtype), lse
