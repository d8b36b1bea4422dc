"""Attention of a few query tokens against a long KV cache (decode).

One new token per sequence reads the whole cache: the work is bound by the
bytes of K and V, not by FLOPs, and a forward kernel that gives every query
head its own CTA reads each K/V byte once per query head of a group and
leaves most SMs idle when B x heads is small. This path reuses the sm90
forward kernel on a re-shaped problem:

* **GQA packing**: the G query heads of one KV head become G rows of one
  query tile (row r = t * G + g for token t, group member g), so one CTA
  reads each K/V byte once per KV head. One token is read where it lies:
  [B, 1, Hkv * G, D] is [B, Hkv, G, D] by a free reshape, which the kernel
  reads and writes heads-major (`sm90_forward.forward(..., heads_major=True)`:
  a KV head's G rows, fewer than 8 or a multiple of 8, no padding); so no
  XLA copy packs Q or unpacks O. Several tokens are packed by a transpose
  (`pack_rows`, one XLA copy, with the kernel's padding of rows to 8).
* **Split-K**: the cache is cut into `splits` equal chunks along the
  sequence (a reshape, no copy: [B, S] -> [B * splits, S / splits]), each
  chunk a batch row of its own with its own key length, so B x Hkv x splits
  CTAs fill the GPU. The chunks of a sequence read its query (the kernel's
  `q_batch_divisor`), no copy per chunk.
* **Combine**: the chunks' outputs are merged with their log-sum-exps in
  f32 (`combine`), read in the caller's order so that the unpacking and the
  cast fuse into the merge (two small XLA kernels on an H100). With one
  chunk nothing runs after the kernel (one token) or the unpacking
  transpose (`unpack_rows`).

Masks: masks without a band (no `is_causal`, no window) with any key
lengths, which is how a cache of valid length L is read; and causal
bottom-right (`serves_mask`): the T queries are the last T tokens of their
row, query t at position L - T + t sees keys up to it (speculative
decoding's few new tokens, short chunks of a chunked prefill). The kernel
reads that band as `MaskSpec(right=0, offset_from_lengths=True,
rows_per_position=G, key_chunk=C)` (`packed_band`):

* packed row r holds token r // G (`rows_per_position`), and the rows'
  length counts rows (T * G, or the query lengths times G), so the band's
  offset is the key length minus the tokens;
* each chunk (C keys from c * C) is given the row's keys from its first key
  on, R_c = max(L - c * C, 0) (`chunk_lengths`), not its own clipped
  length: the band aligned by R_c puts token t at chunk position
  R_c - T + t, which is its true position L - T + t in the chunk's
  coordinates, and the kernel cuts the keys at min(R_c, C) (`key_chunk`).
  Chunks before the last T keys see all their keys; a chunk that ends
  inside them (a boundary between L - T and L) sees the part of the band it
  holds; a row's last chunk, the rest. (A chunk's own length min(R_c, C)
  would align every full chunk as if the row ended there, and hide its last
  keys from the first tokens.)

Only the last one or two key blocks of a row's last chunks need the
element mask; every other block runs without it. One token (T = 1) sees
every valid key: it is served as the band-free mask. Query rows that see
no key (L - T + t < 0, L = 0) get zeros and lse -inf, as in the forward
kernel. Sinks are added after the combine (`scores.add_sinks`: the packed
rows mix heads).

Programmable scores (`forward(..., mods=)`: a `score_mod` / `mask_mod`): the
kernel is told the packing (`sm90_forward.forward(..., decode_group=G)`), so
the mods see row r's query head kv_head * G + r % G and its token r // G
(`q_idx`: the query's index as passed, 0 .. T-1, as every backend gives it,
also under bottom-right alignment), key j of chunk c at its sequence's
position c * C + j, and the sequence as `batch`. What depends on the head
alone is bound once per head of the tile and merged into row vectors
(`mod_functions.bind_rows`). The mask_mod's block lists are made per token
and head at the kernel's key blocks, then regrouped to packed row tiles and
chunks (`packed_mod_classes`): key blocks no row of a tile sees are skipped.
The config is the plan's with one CTA per item (`mod_config`). The split and
the combine are unchanged (mods only change scores).

Paged caches (`fa4_jax.paged`): the split of a cache is then a reshape of
its page table ([B, P] -> [B * splits, P / splits], chunks of whole pages),
and the kernel reads each chunk's pages through its row of the table
(`forward(..., page_table=)`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax

from fa4_jax import scores
from fa4_jax.kernels import autotune, default_device, device_tables, sm90_forward
from fa4_jax.scores import MaskSpec
from fa4_jax.target import current_target


# Packed rows (T x G) up to which the decode path serves a call: at 256 rows
# the decode arrangement still beats the usual kernel, at 512 it loses
# (docs/performance-notes.md, "Decode heuristics: the constants in
# sm90_decode.py").
MAX_PACKED_ROWS = 256
# A chunk keeps at least this many keys: shorter ones spend more time in the
# pipeline's fill and drain and in the combine than they save.
MIN_CHUNK = 512
# How float8 pages (a float8 cache under a 16-bit query read through a page
# table, `plan(fp8_cache=True, paged=True)`) are cut (issue #55). k >= 1: the
# contiguous cache's own plan (`fp8_pages_plan`: every SM, one CTA per item)
# with up to k times its splits. None: as any ragged cache, the paged call's
# splits (up to 8 waves of the SMs) on the forward's persistent grid.
# H100, 2026-12-07 (`bench_fp8.py --only "page 64" --paged-configs`, B8
# S32768 H32/8 D128, pages of 64, 256 consumer registers; TB/s): k = 1 reads
# 4.84 (T1) / 4.89 (T16 causal), 0.955 / 0.958 of the contiguous cache under
# the same config; None 4.47 / 4.09, k = 2 4.68 / 4.71, k = 8 4.33 / 4.17.
# Lengths from S/16 to S favour more splits (k = 1 4.89, 2 5.65, 8 6.96, None
# 4.72), but the lengths are run-time data and k = 1 still beats None there.
FP8_PAGES_SPLITS_FACTOR: int | None = 1
# `plan(fp8_pages_factor=)`'s default: FP8_PAGES_SPLITS_FACTOR as it is at the call.
AS_SWITCHED = "as switched"
# Issue #55: the float8-cache decode (up to 64 packed rows, head dims up to
# 128) runs two consumers that split each CTA's key blocks in halves and
# merge at the end (`sm90_forward.ForwardConfig.consumers_split_keys`,
# `fp8_cache_split_keys_config`). H100, 2026-12-08 (`bench_fp8.py --only
# decode --decode-configs`, CUPTI, one round; TB/s of the bf16 cache's
# bytes, H32/8, bf16 query, e4m3 cache): B8 S32768 D128 5.63 against 5.05 for
# one consumer that widens, multiplies and runs the softmax of every block in
# series (bf16 cache 3.19); B64 S4096 D128 5.30 against 4.89 (3.15); B1
# S131072 D128 5.21 against 4.69 (3.10); B8 S32768 D64 4.25 against 3.68
# with two CTAs an SM (3.04). The one-consumer config and the two-CTA D64
# plan left the code (last in 0180d5c; the performance notes, "Float8 cache
# decode: widening beside the consumer").
# Each of the two consumers' registers: 24 + 2 x 240 of the 512 a thread of
# three warpgroups may hold (`check_register_split`).
FP8_CACHE_SPLIT_KEYS_REGISTERS = 240


@dataclasses.dataclass(frozen=True)
class DecodePlan:
  """How one call is cut: the cache in `splits` equal chunks, rows packed;
  `config` None takes the forward kernel's heuristic."""

  splits: int
  config: sm90_forward.ForwardConfig | None = None


def plan(q_shape, k_shape, mask: MaskSpec, *, has_segment_ids: bool = False,
         ragged: bool = False, num_sms: int | None = None, streams: int | None = None,
         granule: int = 1, choices: device_tables.DecodeChoices | None = None,
         fp8_cache: bool = False, paged: bool = False,
         fp8_pages_factor: int | None | str = AS_SWITCHED) -> DecodePlan | None:
  """The decode plan for a call, or None when the forward kernel serves it.

  `mask`: without a band, or causal bottom-right (`serves_mask`), which is
  planned as the band-free call is (the same splits and config; where that
  plan leaves the config to the forward's heuristic, the band takes the
  heuristic's band-free choice, `band_config`).

  Splits: the largest power of two that keeps B x Hkv x splits x tiles CTAs
  (tiles: the query tiles of an item, two for 256 packed rows) within
  `streams` (`streaming_ctas`: the SM count, or fewer where fewer CTAs read a
  cache faster), divides the key length and leaves chunks of at least
  MIN_CHUNK keys. H200 (B*Hkv*splits CTAs on 132 SMs): B8 S32k best at 2
  (128 CTAs: 4.48 TB/s; 4: 4.39, 1: 3.41), B64 S4k at 1 (512: 4.34; 2:
  4.28), B1 S131k at 16 (128: 4.25; 8: 3.29). With `ragged` key lengths
  (each row its own) chunks past a row's length end at once, and more of
  them balance the rows: up to 8 waves of the SMs (B32 S16k, lengths
  S/16..S: 4 chunks 4.04, 2: 3.86, 1: 3.53, 8: 3.85). `granule`: chunks
  hold whole granules of keys (a paged cache's pages; `k_shape` is then
  the logical [B, pages * page_size, Hkv, D]). Counting the tiles: B8 T64
  S32k (256 rows) on 128 CTAs (1 chunk) 2.50 TB/s, on 256 (2) 2.43. The
  grid: `choose_config`.
  `num_sms`, `streams`: None for the GPU's (tests name them). `choices`:
  None for the default device's kind (`device_choices`). Full, equal key
  lengths at D64 may take one consumer per CTA (`one_consumer_config`).
  `fp8_cache`: a float8 cache under a 16-bit query, planned for every SM
  and two consumers on halves of the keys (`fp8_cache_decode_config`); with `ragged` (paged
  caches) the splits are the 16-bit call's (ragged splits do not depend on
  `streams`) and only the config changes.
  """
  b, t, n, d = q_shape
  s, kv_heads = k_shape[1], k_shape[2]
  rows = t * (n // kv_heads)
  if has_segment_ids or not serves_mask(mask, t, s) or rows > MAX_PACKED_ROWS:
    return None
  if fp8_cache and paged:
    factor = FP8_PAGES_SPLITS_FACTOR if fp8_pages_factor == AS_SWITCHED else fp8_pages_factor
    if factor is not None:
      return fp8_pages_plan(q_shape, k_shape, mask, factor, num_sms=num_sms, streams=streams,
                            granule=granule, choices=choices)
  banded = not mask.is_dense and t > 1
  mask = MaskSpec()  # a band is cut as the band-free call is (`band_config`)
  if num_sms is None:
    num_sms = sm90_forward.sm_count()
  if choices is None:  # the device kind's table, unless the autotuner is switched on
    choices = autotune.decode_choices(device_choices(), q_shape=q_shape, k_shape=k_shape,
                                      mask=mask, tunable=not ragged and granule == 1)
  if streams is None:
    # A float8 cache streams from every SM (`fp8_cache_decode_config`).
    streams = num_sms if fp8_cache else streaming_ctas(d, rows, num_sms, choices)
  # Query tiles of an item: 128 packed rows at D128 fill one CTA's consumers.
  tiles = -(-rows // sm90_forward.choose_config(d, mask).block_q_cta)
  splits = choose_splits(b, kv_heads, s, ragged=ragged, num_sms=num_sms, streams=streams,
                         granule=granule, tiles=tiles)
  config = None if ragged else choose_config(d, mask, s // splits, rows,
                                             b * kv_heads * splits * tiles,
                                             num_sms=num_sms, streams=streams)
  if config is None and not ragged:
    config = one_consumer_config(d, mask, s // splits, rows, b * kv_heads * splits * tiles,
                                 num_sms=num_sms, choices=choices)
  if fp8_cache:
    config = fp8_cache_decode_config(d, s // splits, rows, config)
  if config is None and banded:
    config = band_config(d, s // splits, rows)
  return DecodePlan(splits, config)


def serves_mask(mask: MaskSpec, t: int, s: int) -> bool:
  """Whether the decode arrangement serves `mask` for T = `t` queries
  against `s` keys: no band, or causal bottom-right (aligned per row by the
  lengths, or without lengths by the static offset S - T > 0: a square
  causal mask, T = S, is self-attention's top-left one, which keeps the
  forward kernel)."""
  if mask.is_dense:
    return True
  if (mask.left is not None or mask.right != 0 or mask.rows_per_position != 1
      or mask.key_chunk is not None):
    return False
  if mask.offset_from_lengths:
    return mask.q_offset == 0
  return mask.q_offset == s - t > 0


def fp8_cache_decode_config(head_dim: int, chunk: int, rows: int,
                            config: sm90_forward.ForwardConfig | None
                            ) -> sm90_forward.ForwardConfig | None:
  """The kernel's config for a float8 cache under a 16-bit query
  (`sm90_forward.ForwardStatics.fp8_cache`): `config` (None: the forward's
  heuristic for the chunk) turned, where the packed rows fit one consumer's
  tile (up to 64) at head dims up to 128, into two consumers on halves of
  each CTA's key blocks (`fp8_cache_split_keys_config`); other calls keep
  `config` (the kernel shrinks it, `sm90_forward.fp8_cache_config`).

  Why: the 16-bit call's config, shrunk for each consumer's widened float16
  K and V tiles, keeps a quarter of the bfloat16 kernel's bytes in flight
  per CTA, and at a few packed rows the second consumer's rows are all
  padding; the float8 kernel is bound by the bytes its rings keep in flight
  and by the widening in series with each block's products and softmax,
  which the two halves overlap. `plan` gives every SM a CTA. The model and
  the measurements: the performance notes, "A float8 cache under a 16-bit
  query" and "Float8 cache decode: widening beside the consumer"."""
  d = sm90_forward.padded_head_dim(head_dim)
  if d > 128 or rows > 64:
    return config
  if config is None:
    config = sm90_forward.choose_config(d, MaskSpec(), kv_seq=chunk, q_seq=rows)
  return fp8_cache_split_keys_config(d, config)


def fp8_cache_split_keys_config(head_dim: int, config: sm90_forward.ForwardConfig
                                ) -> sm90_forward.ForwardConfig:
  """The float8-cache decode's config: two consumers on the same packed rows
  (up to 64), each on half of the CTA's 128-key blocks
  (`ForwardConfig.consumers_split_keys`), one CTA per work item, and the
  deepest even ring SMEM holds (4 slots, else 2: each consumer owns every
  other slot). D128: 32 KiB of Q tiles, 2 x 32 KiB of 8-bit slots, 64 KiB of
  widened tiles (one per consumer, K then V), 32 KiB of O tiles: 193 KiB;
  four slots would need 257."""
  split = dataclasses.replace(
      config, num_consumers=2, pingpong=False, producer_registers=24,
      consumer_registers=FP8_CACHE_SPLIT_KEYS_REGISTERS, block_q=64, block_kv=128,
      persistent=False, work_queue=False, num_sms=0, q_buffers=1, consumers_split_keys=True,
      num_kv_stages=2)
  for stages in (4, 2):
    candidate = dataclasses.replace(split, num_kv_stages=stages)
    if candidate.fits_smem(head_dim, 2, False, head_dim, fp8_cache=True):
      return candidate
  return split


def fp8_pages_plan(q_shape, k_shape, mask: MaskSpec, factor: int, *, num_sms: int | None = None,
                   streams: int | None = None, granule: int = 1,
                   choices: device_tables.DecodeChoices | None = None) -> DecodePlan | None:
  """Float8 pages under the contiguous float8 cache's plan (`plan(...,
  fp8_cache=True)` without `ragged`, chunks of whole pages of `granule`
  keys), with up to `factor` (a power of two) times its splits while chunks
  keep whole pages and at least `MIN_CHUNK` keys; beyond its own splits,
  one CTA per item (the block scheduler, not a persistent grid's fixed order,
  deals out chunks of rows of unequal lengths).

  Why (issue #55): the ragged plan reads pages of 64 at 0.86 (T1) / 0.77
  (T16 causal) of the contiguous cache (H100, 2026-12-07); its chunks of
  2,048 keys take the forward's persistent grid (eight items a CTA, each
  item's Q and epilogue in series, 16 chunks to combine) and, by local
  ptxas, spill more inside the key loop (B8 S32k H32/8 D128, T16 page 64:
  200 / 284 bytes, 34 reloads in its main key loop; this plan 100 / 116
  bytes, 23, the contiguous cache 108 / 124, 25). A row shorter than
  its chunks leaves SMs idle for the plan's few splits: `factor` trades that
  back."""
  base = plan(q_shape, k_shape, mask, num_sms=num_sms, streams=streams, granule=granule,
              choices=choices, fp8_cache=True)
  if base is None or factor <= 1:
    return base
  keys, splits = k_shape[1], base.splits
  more = 1
  while (more * 2 <= factor and keys % (splits * more * 2 * granule) == 0
         and keys // (splits * more * 2) >= MIN_CHUNK):
    more *= 2
  if more == 1:
    return base
  config = base.config
  if config is not None:
    config = dataclasses.replace(config, persistent=False, work_queue=False, num_sms=0,
                                 q_buffers=1)
  return DecodePlan(splits * more, config)


def band_config(head_dim: int, chunk: int, rows: int) -> sm90_forward.ForwardConfig:
  """The kernel's config for a causal band where the plan leaves it to the
  forward's heuristic: the one that heuristic picks for the band-free mask,
  so that a band is read as the band-free call is (the heuristic's causal
  choices are made for square rows)."""
  return sm90_forward.choose_config(head_dim, MaskSpec(), kv_seq=chunk, q_seq=rows)


def packed_band(g: int, chunk: int) -> MaskSpec:
  """The kernel's mask for causal bottom-right over rows that pack `g`
  query heads per token, in chunks of `chunk` keys (module docstring)."""
  return MaskSpec(right=0, offset_from_lengths=True, rows_per_position=g, key_chunk=chunk)


def chunk_lengths(kv_lengths, batch: int, kv_seq: int, splits: int):
  """int32 [B * splits]: the keys of each row from each chunk's first key
  on, max(L - c * chunk, 0) (past the chunk for all but a row's last: the
  lengths `packed_band` aligns by)."""
  chunk = kv_seq // splits
  total = (jnp.full((batch,), kv_seq, jnp.int32) if kv_lengths is None
           else jnp.asarray(kv_lengths, jnp.int32))
  starts = jnp.arange(splits, dtype=jnp.int32) * chunk
  return jnp.maximum(total[:, None] - starts[None, :], 0).reshape(batch * splits)


def device_choices() -> device_tables.DecodeChoices:
  """`device_tables.decode_choices` of the default device's kind; the
  generic choices under `fa4_jax.gpu_target` (which names no kind: lowering
  queries no device) and without a device."""
  if current_target() is not None:
    return device_tables.decode_choices(None)
  try:
    device = default_device()
  except RuntimeError:
    return device_tables.decode_choices(None)
  return device_tables.decode_choices(getattr(device, "device_kind", None))


def streaming_ctas(head_dim: int, rows: int, num_sms: int,
                   choices: device_tables.DecodeChoices | None = None) -> int:
  """CTAs that should read a cache at once: the device kind's
  `streaming_ctas` (`device_tables.DECODE`: 64 on an H100, 128 on an H200)
  at head dims >= 128 and up to 64 packed rows, else `num_sms`. `choices`:
  None for `device_choices()`."""
  if head_dim < 128 or rows > 64:
    return num_sms
  streams = (choices or device_choices()).streaming_ctas
  return num_sms if streams is None else min(num_sms, streams)


def one_consumer_config(head_dim: int, mask: MaskSpec, chunk: int, rows: int, ctas: int, *,
                        num_sms: int, choices: device_tables.DecodeChoices
                        ) -> sm90_forward.ForwardConfig | None:
  """One CTA per item with one consumer warpgroup (64 rows, no ping-pong)
  and `choices.one_consumer_stages` K/V slots, where the device kind measured
  it faster: head dims <= 64, up to `choices.one_consumer_max_rows` packed
  rows, `ctas` items within one wave of the SMs (H200 figures at
  `device_tables.DECODE`); else None."""
  d = sm90_forward.padded_head_dim(head_dim)
  if d > 64 or rows > choices.one_consumer_max_rows or ctas > num_sms:
    return None
  config = dataclasses.replace(
      sm90_forward.choose_config(head_dim, mask, kv_seq=chunk, q_seq=rows), persistent=False,
      work_queue=False, q_buffers=1, num_sms=0, num_consumers=1, pingpong=False,
      producer_registers=24, consumer_registers=224, num_kv_stages=choices.one_consumer_stages)
  return config if config.fits_smem(d, 2) else None


def choose_config(head_dim: int, mask: MaskSpec, chunk: int, rows: int, ctas: int, *,
                  num_sms: int, streams: int) -> sm90_forward.ForwardConfig | None:
  """The kernel's config for `ctas` CTA tiles of `chunk` keys and up to
  `rows` packed rows each; None keeps the forward kernel's heuristic (one
  CTA per tile, or its own persistent grid for short chunks).

  Items beyond `streams` that `streams` CTAs share evenly, or beyond the
  SMs, run on a persistent grid of that many CTAs with two Q tiles per
  consumer: a CTA starts its next item while the current one ends, where
  one CTA per item pays a launch and a pipeline fill each (figures at
  `device_tables.DECODE`). `plan` keeps one CTA per item for ragged key lengths
  (and paged caches), whose items differ in length: there the GPU's block
  scheduler balances them, where a persistent grid deals them out in a
  fixed order. Short chunks keep the heuristic's persistent grid of one CTA
  per SM (B128 S2k: 3.061 TB/s on 132 CTAs, 3.047 on 64). Head dims above
  128 have no SMEM for a second Q tile beside the O tiles."""
  config = sm90_forward.choose_config(head_dim, mask, kv_seq=chunk, q_seq=rows)
  if config.persistent:
    return None
  if ctas > streams and ctas % streams == 0:
    grid = streams
  elif ctas > num_sms:
    grid = num_sms
  else:
    return None
  persistent = dataclasses.replace(config, persistent=True, q_buffers=2, num_sms=grid)
  return persistent if persistent.fits_smem(sm90_forward.padded_head_dim(head_dim), 2) else None


RAGGED_WAVES = 8


def choose_splits(batch: int, kv_heads: int, kv_seq: int, *, ragged: bool = False,
                  num_sms: int | None = None, streams: int | None = None,
                  granule: int = 1, tiles: int = 1) -> int:
  """Chunks of the cache: see `plan` (`streams` None: `num_sms`)."""
  if num_sms is None:
    num_sms = sm90_forward.sm_count()
  slots = num_sms * RAGGED_WAVES if ragged else (streams or num_sms)
  splits = 1
  while (batch * kv_heads * tiles * splits * 2 <= slots and kv_seq % (splits * 2 * granule) == 0
         and kv_seq // (splits * 2) >= MIN_CHUNK):
    splits *= 2
  return splits


def mod_config(config: sm90_forward.ForwardConfig | None, head_dim: int, mask: MaskSpec,
               chunk: int, rows: int) -> sm90_forward.ForwardConfig:
  """The kernel's config with a `score_mod` / `mask_mod`: the plan's (else
  the forward heuristic's for the chunk), with one CTA per item
  (`sm90_forward.mods_config`: the block lists are per CTA tile)."""
  if config is None:
    config = sm90_forward.choose_config(sm90_forward.padded_head_dim(head_dim), mask,
                                        kv_seq=chunk, q_seq=rows)
  return sm90_forward.mods_config(config)


def packed_mod_classes(mods, batch: int, t: int, q_heads: int, kv_heads: int, kv_seq: int,
                       splits: int, config: sm90_forward.ForwardConfig):
  """int8 [B * splits or 1, Hkv or 1, row tiles, key blocks of a chunk]: the
  classes of the call's `mask_mod` at the kernel's tiles of packed rows
  (row r: token r // G, query head kv_head * G + r % G) and chunks of keys,
  for `sm90_forward.forward(..., mods=)`'s block lists (as a
  `scores.BlockMask` of the packed problem).

  `mask_mod` is classified once per token and head at the kernel's key
  blocks (`Scores.mod_classes`: the call's block mask where it nests), and
  a tile of rows is EMPTY (FULL) where every row of it is; chunks are runs
  of those blocks. Where a chunk is no whole number of blocks every block is
  PARTIAL: the element mask then decides, block by block."""
  g, block_q, block_kv = q_heads // kv_heads, config.block_q_cta, config.block_kv
  chunk = kv_seq // splits
  row_tiles, chunk_blocks = scores.cdiv(t * g, block_q), scores.cdiv(chunk, block_kv)
  if splits > 1 and chunk % block_kv:
    return jnp.full((1, 1, row_tiles, chunk_blocks), scores.PARTIAL, jnp.int8)
  classes = mods.mod_classes(batch, q_heads, t, kv_seq, 1, block_kv)  # [Bm, Hm, T, nk]
  classes = jnp.broadcast_to(classes, (batch, *classes.shape[1:]))
  if classes.shape[1] == 1:  # the same for every head: row r's is token r // G's
    rows = jnp.repeat(classes, g, axis=2)
  else:  # [B, Hkv, G, T, nk] -> rows t * G + g
    rows = classes.reshape(batch, kv_heads, g, t, -1).transpose(0, 1, 3, 2, 4)
    rows = rows.reshape(batch, kv_heads, t * g, -1)
  tiles = scores._regroup_axis(rows, 2, 1, block_q, row_tiles)
  heads = tiles.shape[1]
  tiles = tiles.reshape(batch, heads, row_tiles, splits, chunk_blocks).transpose(0, 3, 1, 2, 4)
  return tiles.reshape(batch * splits, heads, row_tiles, chunk_blocks)


def pack_rows(q, kv_heads: int):
  """[B, T, Hkv * G, D] -> [B, T * G, Hkv, D]: a KV head's query heads as rows."""
  b, t, n, d = q.shape
  g = n // kv_heads
  return q.reshape(b, t, kv_heads, g, d).transpose(0, 1, 3, 2, 4).reshape(b, t * g, kv_heads, d)


def unpack_rows(out, lse, t: int):
  """Inverse of `pack_rows` for out [B, T * G, Hkv, D] and lse [B, Hkv, T * G]."""
  b, rows, kv_heads, d = out.shape
  g = rows // t
  out = out.reshape(b, t, g, kv_heads, d).transpose(0, 1, 3, 2, 4).reshape(b, t, kv_heads * g, d)
  lse = lse.reshape(b, kv_heads, t, g).transpose(0, 1, 3, 2).reshape(b, kv_heads * g, t)
  return out, lse


def reads_query_in_place(q_shape, kv_heads: int) -> bool:
  """Whether the kernel reads the query where it lies, heads-major, without
  `pack_rows`' copy: one token, groups of fewer than 8 or a multiple of 8
  query heads (GQA 32/8, MQA 8/1, GQA 64/8; not 12 or 24), head dims a
  multiple of 64 (`sm90_forward.check_heads_major`)."""
  _, t, n, d = q_shape
  g = n // kv_heads
  return t == 1 and (g < 8 or g % 8 == 0) and d % 64 == 0


def split_lengths(kv_lengths, batch: int, kv_seq: int, splits: int):
  """int32 [B * splits]: the valid keys of each chunk (0 past the length)."""
  chunk = kv_seq // splits
  total = (jnp.full((batch,), kv_seq, jnp.int32) if kv_lengths is None
           else jnp.asarray(kv_lengths, jnp.int32))
  starts = jnp.arange(splits, dtype=jnp.int32) * chunk
  return jnp.clip(total[:, None] - starts[None, :], 0, chunk).reshape(batch * splits)


# Chunks up to which `combine` unrolls its merge into elementwise ops over
# the chunks' slices, the shortest of the three forms measured (XLA makes
# two kernels of it; docs/performance-notes.md, "Decode heuristics: the
# constants in sm90_decode.py"). More chunks would grow the program with
# their count: those take the reduction.
MAX_UNROLLED_CHUNKS = 16


def _merge_chunks(a, b):
  """The online-softmax merge of two (running max, sum, weighted output)
  states. A state of max -inf (chunks that saw no key) weighs 0: the max
  is taken as 0 there, so no -inf - -inf = nan arises."""
  (m_a, sum_a, out_a), (m_b, sum_b, out_b) = a, b
  m = jnp.maximum(m_a, m_b)
  finite_m = jnp.where(m == -jnp.inf, 0.0, m)
  w_a, w_b = jnp.exp(m_a - finite_m), jnp.exp(m_b - finite_m)
  return m, sum_a * w_a + sum_b * w_b, out_a * w_a + out_b * w_b


def combine(out, lse, splits: int, t: int):
  """Merge chunk results: out [B * P, T * G, Hkv, D], lse [B * P, Hkv, T * G]
  (packed rows, `pack_rows`) -> (f32 out [B, T, Hkv * G, D], lse [B, Hkv * G, T])
  in the caller's layout; rows no chunk saw get 0 / -inf.

  Each chunk's output is read in the final order ([B, T, Hkv, G, D]), so
  that the unpacking transpose and the caller's cast fuse into the merge.
  Up to MAX_UNROLLED_CHUNKS chunks the merge is written out chunk by chunk
  (max, weights, weighted sum: elementwise ops XLA fuses); beyond, one
  variadic reduction over the chunks carries the merge state
  (`_merge_chunks`)."""
  bp, rows, kv_heads, d = out.shape
  b, g = bp // splits, rows // t
  out = out.reshape(b, splits, t, g, kv_heads, d).transpose(0, 2, 4, 3, 1, 5)
  lse = lse.reshape(b, splits, kv_heads, t, g).transpose(0, 3, 2, 4, 1)  # [B, T, Hkv, G, P]
  if splits <= MAX_UNROLLED_CHUNKS:
    parts = [lse[..., c] for c in range(splits)]
    m = functools.reduce(jnp.maximum, parts)
    m = jnp.where(m == -jnp.inf, 0.0, m)  # rows no chunk saw
    weights = [jnp.exp(part - m) for part in parts]  # 0 for chunks that saw no key
    total = functools.reduce(jnp.add, weights)
    acc = functools.reduce(jnp.add, [w[..., None] * out[..., c, :].astype(jnp.float32)
                                     for c, w in enumerate(weights)])
  else:
    lse = jnp.broadcast_to(lse[..., None], out.shape)  # a reduce's operands share a shape
    m, total, acc = lax.reduce(
        (lse, jnp.ones(out.shape, jnp.float32), out.astype(jnp.float32)),
        (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.float32(0.0)), _merge_chunks, (4,))
    m, total = m[..., 0], total[..., 0]
  seen = total > 0.0
  safe_total = jnp.where(seen, total, 1.0)
  merged = jnp.where(seen[..., None], acc / safe_total[..., None], 0.0)
  merged_lse = jnp.where(seen, m + jnp.log(safe_total), -jnp.inf)  # [B, T, Hkv, G]
  return (merged.reshape(b, t, kv_heads * g, d),
          merged_lse.reshape(b, t, kv_heads * g).transpose(0, 2, 1))


def forward(q, k, v, q_lengths, kv_lengths, *, score: scores.ScoreFunction, mask: MaskSpec,
            plan: DecodePlan, sinks=None, page_table=None, descales=None, out_dtype=None,
            mods=None):
  """(out [B, T, Hq, D], lse [B, Hq, T]) of a band-free or a causal
  bottom-right mask (`serves_mask`), by packing and splitting (see the
  module docstring). The lse is the whole row's, so any backward that takes
  (out, lse) works with it. `page_table`: None, or int32
  [B, P] with k, v pages [num_pages, page_size, Hkv, D] (`sm90_forward.forward`).
  A float8 cache under a 16-bit query: `descales` (q, k, v; q's None) and
  `out_dtype` (None: the query's) as `sm90_forward.forward` takes them.
  `mods`: None, or the call's `scores.Scores` with a `score_mod` and / or a
  `mask_mod` (`mod_config`, `packed_mod_classes`; not with a float8 cache)."""
  b, t, n, d = q.shape
  kv_heads = k.shape[2]
  g = n // kv_heads
  p = plan.splits
  # Keys per row, and per granule the splits keep whole (pages of a paged cache).
  s, granule = (k.shape[1], 1) if page_table is None else (
      page_table.shape[1] * k.shape[1], k.shape[1])
  if not serves_mask(mask, t, s):
    raise ValueError("the decode path serves masks without a band, and causal bottom-right "
                     f"(the queries the last tokens of their rows); got {mask}")
  if t == 1:
    mask = MaskSpec()  # one token at its row's last position sees every valid key
  if s % (p * granule):
    raise ValueError(f"splits={p} must divide the key length {s} into chunks of whole "
                     f"granules of {granule}")
  options = {} if page_table is None else dict(page_table=page_table)
  in_place = reads_query_in_place(q.shape, kv_heads)
  if in_place:  # [B, 1, Hkv * G, D] as [B, Hkv, G, D]: a KV head's query heads as rows
    packed = q.reshape(b, kv_heads, g, d)
    options["heads_major"] = True
  else:
    packed = pack_rows(q, kv_heads)
  if p > 1:
    options["q_batch_divisor"] = p  # the chunks of a sequence share its query
    if page_table is None:
      k = k.reshape(b * p, s // p, kv_heads, d)
      v = v.reshape(b * p, s // p, kv_heads, d)
    else:
      options["page_table"] = jnp.reshape(page_table, (b * p, page_table.shape[1] // p))
  if not mask.is_dense:  # the band's offset needs every row's true lengths
    mask = packed_band(g, s // p)
    q_lengths = jnp.full((b,), t, jnp.int32) if q_lengths is None else q_lengths
    chunk_len = chunk_lengths(kv_lengths, b, s, p)
  else:
    chunk_len = kv_lengths if p == 1 else (
        None if kv_lengths is None else split_lengths(kv_lengths, b, s, p))
  rows_len = None if q_lengths is None else jnp.asarray(q_lengths, jnp.int32) * g
  if rows_len is not None and p > 1:
    rows_len = jnp.repeat(rows_len, p)
  if descales is not None:
    options.update(descales=descales, out_dtype=out_dtype)
  config = plan.config
  if config is None and not mask.is_dense:
    config = band_config(d, s // p, t * g)
  if mods is not None and mods.has_mods:
    config = mod_config(config, d, mask, s // p, t * g)
    if mods.mask_mod is not None:  # its classes at the packed problem's tiles
      mods = mods.replace(block_mask=scores.BlockMask(
          packed_mod_classes(mods, b, t, n, kv_heads, s, p, config), q_block=config.block_q_cta,
          kv_block=config.block_kv, q_len=t * g, kv_len=s // p, mask_mod=mods.mask_mod))
    options.update(mods=mods, decode_group=g)
  out, lse = sm90_forward.forward(packed, k, v, rows_len, chunk_len, score=score, mask=mask,
                                  config=config, **options)
  if in_place:  # out [B * P, Hkv, G, D], lse [B * P, Hkv, G]
    if p == 1:
      out, lse = out.reshape(b, 1, n, d), lse.reshape(b, n, 1)
    else:
      out = out.transpose(0, 2, 1, 3)  # as packed rows, for `combine` (XLA fuses it)
  elif p == 1:
    out, lse = unpack_rows(out, lse, t)
  if p > 1:
    merged, lse = combine(out, lse, p, t)
    out = merged.astype(out_dtype or q.dtype)
  if sinks is not None:
    out, lse = scores.add_sinks(out, lse, sinks, q_lengths)
  return out, lse
