"""What every backward kernel, sm90 and sm100 alike, reads the same way: its
GMEM inputs (`KernelRefs`, with the segment ids' `SegmentRefs`) and the query
blocks a CTA that owns a key tile walks (`KeyTileWork`, narrowed to the
segment ids by `narrow`). The operands themselves are built in XLA by
`backward_inputs`."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax import lax

from fa4_jax import scores
from fa4_jax.kernels.pipeline import sequence_lengths
from fa4_jax.scores import TileRanges


# --- the operands of every kernel ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelRefs:
  """The GMEM inputs every backward kernel takes, in this order: Q, K, V, dO,
  lse2, delta (O in the dQ kernel with `delta_in_dq`), then the optional
  sequence lengths."""

  q: Any
  k: Any
  v: Any
  do: Any
  lse: Any
  delta: Any  # or O
  q_len: Any  # None without query lengths
  kv_len: Any  # None without key lengths
  segments: "SegmentRefs | None" = None  # None without segment ids

  @classmethod
  def split(cls, refs, has_q_lengths: bool, has_kv_lengths: bool,
            segment_consumers: int | None = None):
    """(the inputs, the rest: outputs, SMEM scratch, barriers).

    `segment_consumers`: with segment ids, the kernel's consumer tiles per
    CTA (`SegmentRefs`); None without them."""
    refs = list(refs)
    inputs = refs[:6]
    del refs[:6]
    q_len = refs.pop(0) if has_q_lengths else None
    kv_len = refs.pop(0) if has_kv_lengths else None
    segments = None
    if segment_consumers is not None:
      segments, refs = SegmentRefs.split(refs, segment_consumers)
    return cls(*inputs, q_len, kv_len, segments), refs


@dataclasses.dataclass(frozen=True)
class SegmentRefs:
  """The segment-id inputs of a kernel, after the sequence lengths: the ids
  of the queries and of the keys (int32 [B, L], padded to whole tiles), the
  segment ranges (`scores.tile_ranges_operand`) of each CTA's tile and, with
  several consumer tiles per CTA, of each consumer's (CTA t, consumer i: row
  t * consumers + i). Built by `backward_inputs.segment_operands`."""

  q_ids: Any
  kv_ids: Any
  cta_ranges: Any
  consumer_ranges: Any  # cta_ranges when a CTA has one consumer tile
  consumers: int

  @classmethod
  def split(cls, refs, consumers: int):
    q_ids, kv_ids, cta_ranges = refs[:3]
    consumer_ranges = refs[3] if consumers > 1 else cta_ranges
    rest = refs[4:] if consumers > 1 else refs[3:]
    return cls(q_ids, kv_ids, cta_ranges, consumer_ranges, consumers), rest

  def of_cta(self, batch_idx, tile) -> TileRanges:
    return scores.read_tile_ranges(self.cta_ranges, batch_idx, tile)

  def of_consumer(self, batch_idx, tile, consumer) -> TileRanges:
    return scores.read_tile_ranges(self.consumer_ranges, batch_idx,
                                   tile * self.consumers + consumer)


def narrow(ranges: TileRanges, segments: "SegmentRefs | None", read) -> TileRanges:
  """`ranges` intersected with the segment ranges `read(segments)` gives,
  unchanged without segment ids."""
  return ranges if segments is None else ranges.intersect(read(segments))


# --- walking a tile's blocks ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KeyTileWork:
  """What a CTA that owns keys [k_lo, k_lo + num_keys) of one KV head walks
  (the dK/dV and the head-split kernel): every query block of every
  query head of the GQA group that may see those keys, head-major (all
  blocks [lo, hi) of the group's first head, then the next head's, ...)."""

  kv_head: Any
  batch_idx: Any
  kv_tile: Any  # the CTA's position along the key axis
  k_lo: Any
  q_len: Any
  kv_len: Any
  ranges: TileRanges  # the query blocks [lo, hi) of one head, and the full ones
  group: int

  @classmethod
  def of_this_cta(cls, tile_of=None, **statics):
    """The CTA at grid position (heads, kv_tiles, batch). `tile_of(batch,
    position)`: the key tile the CTA at that position along the grid's tile
    axis takes (`mod_tiles.ModRefs.cta_tile`); None: the position."""
    head, batch_idx, tile = (lax.axis_index(a) for a in ("heads", "batch", "kv_tiles"))
    if tile_of is not None:
      tile = tile_of(batch_idx, tile)
    return cls.at(head, batch_idx, tile, **statics)

  @classmethod
  def at(cls, kv_head, batch_idx, kv_tile, *, num_keys, block_q, mask, gmem: KernelRefs, q_seq,
         kv_valid, group):
    """The key tile `kv_tile` of (`batch_idx`, `kv_head`)."""
    k_lo = kv_tile * num_keys
    q_len, kv_len = sequence_lengths(gmem.q_len, gmem.kv_len, batch_idx, q_seq, kv_valid)
    ranges = scores.q_tile_ranges(mask, k_lo, k_lo + num_keys, q_len, kv_len, block_q)
    ranges = narrow(ranges, gmem.segments, lambda seg: seg.of_cta(batch_idx, kv_tile))
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
