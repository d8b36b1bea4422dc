"""The score pipeline: which keys a query sees and how a score becomes a probability.

Every backend (the XLA path, the sm90 forward and backward kernels, the sm100
forward kernel) reads this one module, so "causal", "window" and "length"
mean the same thing everywhere, and a new mask kind or score modification is
added here once:

| stage | here | a new feature goes |
|---|---|---|
| which tiles a tile visits | `MaskSpec.key_block_range` / `query_block_range`, `kv_tile_ranges` (query tile -> key blocks: forward, dQ), `q_tile_ranges` (key tile -> query blocks: dK/dV), `segment_tile_ranges` (the blocks a tile's segment ids meet), `TileRanges.intersect`, `walk_blocks` (the kernels' loop over them) | per-tile bounds of a new mask narrow `lo`/`hi` and `full_lo`/`full_hi` through `intersect` |
| whether a tile needs the element mask | `TileRanges.full_lo` / `full_hi`, `MaskSpec.tile_is_full` | a tile is full only if the new test holds for all its pairs |
| the element mask | `visible` (band, key length, segment ids) | one more `&` term |
| the softmax statistics | `initial_row_stats`, `online_softmax` (with soft-cap, where `fixed_max_is_exact`: `initial_row_stats(fixed_max=True)` and `fixed_max_softmax`, no running max), `normalize` / `finish_rows` | a sink enters the running max and sum at initialisation and the log-sum-exp at the end; a score modification (soft-cap) transforms `s` at the top of `online_softmax` |
| score modifications | `soft_cap` / `soft_cap_grad`; sinks: `initial_row_stats(sink=)` in the kernels that take them, else the post-pass `add_sinks` on the backend's (out, lse); `sink_grad` (the sinks' gradient, an XLA reduction) | here, with its derivative |

The kernels keep the statistics in their accumulator's row layout and call
these functions on whole tiles, so the same code runs on wgmma register
fragments (sm90) and tcgen05 TMEM loads (sm100). The XLA path reads the mask
stages (`MaskSpec`'s block ranges, `visible`); its softmax is its own, in
natural-log units with an exact running max, over batched blocks.

Positions: query row `i` sits at absolute position `i + q_offset`; key column `j`
at position `j`. Query `i` may see key `j` when

    (left  is None or j >= i + q_offset - left) and
    (right is None or j <= i + q_offset + right)

`jax.nn.dot_product_attention` aligns the causal mask top-left (`q_offset = 0`:
row 0 sees key 0), also when the query and key lengths differ; that is what
`fa4_jax.attention` does by default. A causal mask is `right = 0`; a causal
mask with `local_window_size=(l, r)` is `left = l, right = min(r, 0)`.
Bottom-right alignment (decoding, chunked prefill) puts each batch row's last
valid query on its last valid key: a fixed `q_offset = S - T` without
lengths; with lengths, `offset_from_lengths` makes the offset each row's
`kv_len - q_len`, a run-time value that `MaskSpec.at_lengths` resolves where
a backend knows the row (every tile helper below that takes the lengths, and
`visible`).

Sequence lengths (`query_seq_lengths`, `key_value_seq_lengths`) are run-time
arrays, not part of the spec: keys at or past the length are masked and query
rows at or past the length produce zeros, as in `jax.nn`.

The tile helpers below work on Python ints and on traced int32 scalars alike,
so kernels can call them inside their bodies and the XLA path at trace time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Int = Any  # a Python int or a traced int32 scalar


def _is_static(*xs) -> bool:
  return all(isinstance(x, int) for x in xs)


def _max(a: Int, b: Int) -> Int:
  return max(a, b) if _is_static(a, b) else jnp.maximum(a, b)


def _min(a: Int, b: Int) -> Int:
  return min(a, b) if _is_static(a, b) else jnp.minimum(a, b)


def cdiv(a: Int, b: int) -> Int:
  """Ceiling division for non-negative `a`."""
  return (a + b - 1) // b


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static (shape-independent) mask: a band around the diagonal.

  `left` / `right`: how many positions before / after its own a query may
  see; `None` means unbounded on that side. `q_offset`: absolute position of
  query row 0 (0 aligns top-left, as `jax.nn` does). `offset_from_lengths`:
  each batch row adds its own `kv_len - q_len` to `q_offset` (bottom-right
  alignment with sequence lengths; `at_lengths`).

  Two fields serve the decode arrangement (`fa4_jax.kernels.sm90_decode`)
  alone, and only the sm90 forward kernel reads them:
  `rows_per_position`: the G query heads of a KV head packed as G rows of
  one token (row r = t * G + g), so query row r sits at position
  `r // rows_per_position` (plus the offset), and with `offset_from_lengths`
  the query length counts rows (`q_len // rows_per_position` tokens).
  `key_chunk`: split-K, the kernel reads chunks of `key_chunk` keys of
  longer rows, and a chunk's key length counts the row's keys from the
  chunk's first key on (past `key_chunk` for every chunk but a row's last):
  the band is aligned by that length (`at_lengths`), so each chunk sees the
  keys its row's band lets it see, and keys past the chunk are cut
  (`chunk_keys`). Tiles of such a band are equally heavy (a few positions
  apart): `schedule.pairs_causal_tiles` does not pair them.
  """

  left: int | None = None
  right: int | None = None
  q_offset: int = 0
  offset_from_lengths: bool = False
  rows_per_position: int = 1
  key_chunk: int | None = None

  def __repr__(self) -> str:
    # The fields of every mask but the decode arrangement's, as the dataclass
    # wrote them before those existed (autotune files key on this text).
    text = (f"MaskSpec(left={self.left!r}, right={self.right!r}, q_offset={self.q_offset!r}, "
            f"offset_from_lengths={self.offset_from_lengths!r}")
    if self.rows_per_position != 1:
      text += f", rows_per_position={self.rows_per_position!r}"
    if self.key_chunk is not None:
      text += f", key_chunk={self.key_chunk!r}"
    return text + ")"

  @classmethod
  def from_arguments(
      cls,
      is_causal: bool,
      local_window_size: tuple[int, int] | None,
      q_offset: int = 0,
  ) -> "MaskSpec":
    left = right = None
    if local_window_size is not None:
      left, right = local_window_size
    if is_causal:
      right = 0 if right is None else min(right, 0)
    return cls(left=left, right=right, q_offset=q_offset)

  def at_lengths(self, q_len: Int, kv_len: Int) -> "MaskSpec":
    """This mask for a batch row of lengths `q_len`, `kv_len` (ints, traced
    scalars, or arrays that broadcast against the positions): with
    `offset_from_lengths` the row's offset becomes part of `q_offset`, so
    every method below sees one fixed band. The result may hold a traced
    offset: use it inside the trace, never as a static argument."""
    if not self.offset_from_lengths:
      return self
    return dataclasses.replace(self, q_offset=self.q_offset + kv_len - self.position(q_len),
                               offset_from_lengths=False)

  def position(self, row: Int) -> Int:
    """The position (before `q_offset`) of query row `row` >= 0 (ints,
    traced scalars or arrays): the row itself, or its token's with packed
    rows (`rows_per_position`)."""
    if self.rows_per_position == 1:
      return row
    if isinstance(row, int):
      return row // self.rows_per_position
    return lax.div(row, jnp.asarray(self.rows_per_position, jnp.result_type(row)))

  def chunk_keys(self, kv_len: Int) -> Int:
    """The keys of a row that lie in the chunk the kernel reads: `kv_len`,
    or at most `key_chunk` where the length counts past the chunk."""
    return kv_len if self.key_chunk is None else _min(kv_len, self.key_chunk)

  def _check_rows_are_positions(self):
    # The walks from keys to query rows (the backward's) know no packed rows
    # nor chunks: only the decode arrangement's forward builds such masks.
    if self.rows_per_position != 1 or self.key_chunk is not None:
      raise ValueError("packed rows and key chunks (the decode arrangement's mask) have no "
                       "walk from keys to query rows")

  def _check_resolved(self):
    # A band whose offset depends on the row cannot answer for a position:
    # a caller that forgot `at_lengths` fails while tracing, not silently.
    if self.offset_from_lengths:
      raise ValueError("this MaskSpec is aligned by the lengths: call at_lengths(q_len, "
                       "kv_len) for the batch row first")

  @property
  def is_dense(self) -> bool:
    """True when every query sees every key (before lengths apply)."""
    return self.left is None and self.right is None

  @property
  def is_causal(self) -> bool:
    return self.left is None and self.right == 0

  def visible(self, q_idx, k_idx):
    """Elementwise: may query row `q_idx` see key column `k_idx`?

    Broadcasts like `q_idx[:, None]` against `k_idx[None, :]` would; works on
    jnp arrays inside and outside kernels.
    """
    self._check_resolved()
    ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(k_idx)), bool)
    pos = self.position(q_idx) + self.q_offset
    if self.left is not None:
      ok = ok & (k_idx >= pos - self.left)
    if self.right is not None:
      ok = ok & (k_idx <= pos + self.right)
    return ok

  # --- Tile-level questions (half-open ranges [lo, hi)). ---

  def key_range(self, q_lo: Int, q_hi: Int, num_keys: Int) -> tuple[Int, Int]:
    """Keys [k_lo, k_hi) that some query in rows [q_lo, q_hi) may see.

    `num_keys` caps the range (pass the key/value length there). The range is
    empty (k_lo >= k_hi) when the rows see nothing.
    """
    self._check_resolved()
    k_lo, k_hi = 0, num_keys
    if self.left is not None:
      k_lo = _max(k_lo, self.position(q_lo) + self.q_offset - self.left)
    if self.right is not None:
      k_hi = _min(k_hi, self.position(q_hi - 1) + self.q_offset + self.right + 1)
    return k_lo, k_hi

  def query_range(self, k_lo: Int, k_hi: Int, num_queries: Int) -> tuple[Int, Int]:
    """Query rows [q_lo, q_hi) that may see some key in [k_lo, k_hi)."""
    self._check_resolved()
    self._check_rows_are_positions()
    q_lo, q_hi = 0, num_queries
    if self.right is not None:
      # j <= i + off + right  <=>  i >= j - off - right
      q_lo = _max(q_lo, k_lo - self.q_offset - self.right)
    if self.left is not None:
      # j >= i + off - left  <=>  i <= j - off + left
      q_hi = _min(q_hi, (k_hi - 1) - self.q_offset + self.left + 1)
    return q_lo, q_hi

  def tile_is_full(self, q_lo: Int, q_hi: Int, k_lo: Int, k_hi: Int):
    """True when every (query, key) pair of the tile is visible, so the tile
    needs no element mask (lengths aside)."""
    self._check_resolved()
    full = True
    if self.left is not None:
      # the last query row must still see the first key
      full = full & (k_lo >= self.position(q_hi - 1) + self.q_offset - self.left)
    if self.right is not None:
      # the first query row must already see the last key
      full = full & ((k_hi - 1) <= self.position(q_lo) + self.q_offset + self.right)
    return full

  def key_block_range(
      self, q_lo: Int, q_hi: Int, num_keys: Int, block_k: int
  ) -> tuple[Int, Int]:
    """Key blocks [b_lo, b_hi) of size `block_k` that rows [q_lo, q_hi) touch."""
    return _blocks_covering(*self.key_range(q_lo, q_hi, num_keys), block_k)

  def query_block_range(
      self, k_lo: Int, k_hi: Int, num_queries: Int, block_q: int
  ) -> tuple[Int, Int]:
    """Query blocks [b_lo, b_hi) of size `block_q` that keys [k_lo, k_hi) touch."""
    return _blocks_covering(*self.query_range(k_lo, k_hi, num_queries), block_q)


def _blocks_covering(lo: Int, hi: Int, block: int) -> tuple[Int, Int]:
  """Blocks [b_lo, b_hi) of size `block` that cover positions [lo, hi)
  (none where hi <= lo)."""
  b_lo = lo // block
  return b_lo, _max(b_lo, cdiv(hi, block))


# --- Tile ranges of the kernels ---------------------------------------------
# Half-open block ranges; Python ints or traced int32 scalars.


def floor_div(x: Int, d: int) -> Int:
  """Floor division of a possibly negative int32 scalar by a positive int."""
  if isinstance(x, int):
    return x // d
  return jnp.where(x >= 0, lax.div(x, d), -lax.div(d - 1 - x, d))


def ceil_div_nonneg(x: Int, d: int) -> Int:
  if isinstance(x, int):
    return -(-x // d)
  return lax.div(x + (d - 1), d)


def clip(x: Int, lo: Int, hi: Int) -> Int:
  return jnp.minimum(jnp.maximum(x, lo), hi)


@dataclasses.dataclass(frozen=True)
class TileRanges:
  """Blocks [lo, hi) a tile may touch; [full_lo, full_hi) of them need no
  element mask (every pair visible, every key inside the length)."""

  lo: Any
  hi: Any
  full_lo: Any
  full_hi: Any

  def intersect(self, other: "TileRanges") -> "TileRanges":
    """Blocks that both ranges allow; full only where both say full (two
    masks, e.g. the band and the segment ids, must both see every pair)."""
    lo = jnp.maximum(self.lo, other.lo)
    hi = jnp.maximum(lo, jnp.minimum(self.hi, other.hi))
    full_lo = clip(jnp.maximum(self.full_lo, other.full_lo), lo, hi)
    full_hi = clip(jnp.minimum(self.full_hi, other.full_hi), full_lo, hi)
    return TileRanges(lo, hi, full_lo, full_hi)

  def within(self, lo: Int, hi: Int) -> "TileRanges":
    """These ranges clipped into [lo, hi): a consumer's own blocks inside the
    CTA's range, which the producer loads for all consumers."""
    own_lo = clip(self.lo, lo, hi)
    own_hi = clip(self.hi, own_lo, hi)
    full_lo = clip(self.full_lo, own_lo, own_hi)
    full_hi = clip(self.full_hi, full_lo, own_hi)
    return TileRanges(own_lo, own_hi, full_lo, full_hi)


def walk_blocks(lo, hi, own: TileRanges, step_fn, skip_fn, carry):
  """Runs blocks [lo, hi) of a CTA's range for one consumer whose own blocks
  are `own` (already `within` [lo, hi)): skip / masked / full / masked /
  skip. `step_fn(j, carry, masked=...)` computes block j, with the element
  mask or without; `skip_fn(j, carry)` only keeps the CTA's pipeline going."""
  carry = _fori(lo, own.lo, skip_fn, carry)
  carry = _fori(own.lo, own.full_lo, functools.partial(step_fn, masked=True), carry)
  carry = _fori(own.full_lo, own.full_hi, functools.partial(step_fn, masked=False), carry)
  carry = _fori(own.full_hi, own.hi, functools.partial(step_fn, masked=True), carry)
  carry = _fori(own.hi, hi, skip_fn, carry)
  return carry


def _fori(lo, hi, body, carry):
  return lax.fori_loop(lo, jnp.maximum(lo, hi), body, carry)


def kv_tile_ranges(mask: MaskSpec, q_lo, q_hi, q_len, kv_len, block_kv: int) -> TileRanges:
  """Key blocks of query rows [q_lo, q_hi) (rows >= q_len do not count): the
  forward and the dQ kernel walk these.

  `full` blocks are those for which `mask.tile_is_full` holds and all keys
  are below `kv_len`.
  """
  mask = mask.at_lengths(q_len, kv_len)
  kv_len = mask.chunk_keys(kv_len)
  q_hi = jnp.minimum(q_hi, q_len)
  lo, hi = mask.key_block_range(q_lo, q_hi, kv_len, block_kv)
  hi = jnp.where(q_lo < q_hi, hi, lo)  # no valid rows: nothing to see
  off = mask.q_offset
  full_lo, full_hi = lo, hi
  if mask.left is not None:
    # full on the left iff first key >= (last row's position) + off - left
    full_lo = ceil_div_nonneg(jnp.maximum(mask.position(q_hi - 1) + off - mask.left, 0),
                              block_kv)
  if mask.right is not None:
    # full on the right iff last key <= (first row's position) + off + right
    full_hi = floor_div(mask.position(q_lo) + off + mask.right + 1, block_kv)
  full_hi = jnp.minimum(full_hi, floor_div(kv_len, block_kv))  # length edge
  full_lo = clip(full_lo, lo, hi)
  full_hi = clip(full_hi, full_lo, hi)
  return TileRanges(lo, hi, full_lo, full_hi)


def q_tile_ranges(mask: MaskSpec, k_lo, k_hi, q_len, kv_len, block_q: int) -> TileRanges:
  """Query blocks that may see keys [k_lo, k_hi) (keys >= kv_len do not
  count): the dK/dV kernels walk these. The mirror of `kv_tile_ranges`.

  A block is full when every (row, key) pair is visible under `mask` and
  every key is below `kv_len`; rows past `q_len` need no mask (the backward
  gives them an lse of +inf, so P = 0 there).
  """
  mask._check_rows_are_positions()
  k_lo, k_hi, q_len, kv_len = (jnp.asarray(x, jnp.int32) for x in (k_lo, k_hi, q_len, kv_len))
  mask = mask.at_lengths(q_len, kv_len)
  k_valid_hi = jnp.minimum(k_hi, kv_len)
  lo, hi = mask.query_block_range(k_lo, k_valid_hi, q_len, block_q)
  hi = jnp.where(k_lo < k_valid_hi, hi, lo)  # no valid key: nothing to do
  off = mask.q_offset
  full_lo, full_hi = lo, hi
  if mask.right is not None:
    # the block's first row must see the last key: row >= (k_hi-1) - off - right
    full_lo = ceil_div_nonneg(jnp.maximum(k_hi - 1 - off - mask.right, 0), block_q)
  if mask.left is not None:
    # the block's last row must see the first key: row <= k_lo + left - off
    full_hi = floor_div(k_lo + mask.left - off + 1, block_q)
  full_hi = jnp.where(k_hi <= kv_len, full_hi, lo)  # length edge inside the tile
  full_lo = clip(full_lo, lo, hi)
  full_hi = clip(full_hi, full_lo, hi)
  return TileRanges(lo, hi, full_lo, full_hi)


# --- Segment ids (packed sequences) ---------------------------------------------
# Query i may see key j only when q_segment_ids[i] == kv_segment_ids[j]. At
# tile level each tile's ids are summarised by their min and max: a key block
# whose [min, max] does not meet the query tile's is skipped, and a pair of
# tiles that both hold one id, the same, needs no element mask. Contiguous
# runs of ids (documents packed one after the other) make these ranges tight;
# any other layout stays correct (the element mask decides) but skips less.


def _tile_id_bounds(ids, block: int):
  """Per-tile (min, max) of int32 ids [B, L], tiles of `block` positions:
  two int32 [B, cdiv(L, block)]. The last tile's padding counts for nothing."""
  batch, length = ids.shape
  num_tiles = cdiv(length, block)
  pad = [(0, 0), (0, num_tiles * block - length)]
  info = jnp.iinfo(jnp.int32)
  tiles = lambda fill: jnp.pad(ids, pad, constant_values=fill).reshape(batch, num_tiles, block)
  return tiles(info.max).min(axis=2), tiles(info.min).max(axis=2)


def _segment_ranges_stacked(row_ids, col_ids, block_rows: int, block_cols: int):
  """`segment_tile_ranges` as one int32 [B, num_row_tiles, 4] array (lo, hi,
  full_lo, full_hi), computed as a single min-reduction over the column
  blocks so that XLA fuses it into few small kernels: a backward computes
  four of these before its kernels (on an H100 its small kernels went from
  20 to 14, each 1-2 us, when the four bounds stopped being separate
  argmax passes and a stack)."""
  row_min, row_max = _tile_id_bounds(row_ids.astype(jnp.int32), block_rows)
  col_min, col_max = _tile_id_bounds(col_ids.astype(jnp.int32), block_cols)
  row_min, row_max = row_min[:, :, None], row_max[:, :, None]
  col_min, col_max = col_min[:, None, :], col_max[:, None, :]
  num_cols = col_min.shape[2]
  col = jnp.arange(num_cols, dtype=jnp.int32)
  meets = (col_max >= row_min) & (col_min <= row_max)  # [B, rows, cols]
  one_id = (row_min == row_max) & (col_min == col_max) & (col_min == row_min)
  run_end = one_id & ~jnp.pad(one_id[..., 1:], [(0, 0), (0, 0), (0, 1)])
  # Each bound is the least value over a set of columns (num_cols and past
  # it: the set is empty): 0, lo: the first block met; 1, minus hi: -(c + 1)
  # over the blocks met; 2, full_lo: the first one-id block; 3, full_hi:
  # c + 1 over the one-id blocks whose next block is not one-id (the end of
  # the first run). Chosen by a broadcast index, not stacked, so that the
  # four sets stay one fused reduction.
  none = num_cols
  bound = jnp.arange(4, dtype=jnp.int32)[:, None]  # [4, 1] against [B, rows, 1, cols]
  in_set = jnp.where(bound < 2, meets[:, :, None], jnp.where(bound == 2, one_id[:, :, None],
                                                             run_end[:, :, None]))
  value = jnp.where(bound == 1, -(col + 1), col + (bound == 3))
  empty = jnp.where(bound == 1, 0, none + (bound == 3))
  firsts = jnp.min(jnp.where(in_set, value, empty), axis=3)  # [B, rows, 4]
  # Empty ranges are [0, 0): lo and hi where no block is met (hi is then 0
  # already), full_lo and full_hi where no block is one-id. One elementwise
  # pass over the [B, rows, 4] result, not a stack of four.
  found = jnp.repeat(firsts[..., ::2] < none, 2, axis=-1)  # met, met, full, full
  # Bound 1 holds minus hi. An iota, not a constant array: custom_partitioning
  # refuses closed-over constants.
  negated = jnp.arange(4) == 1
  return jnp.where(found, jnp.where(negated, -firsts, firsts), 0)


def segment_tile_ranges(row_ids, col_ids, block_rows: int, block_cols: int) -> TileRanges:
  """For every tile of `block_rows` rows, the column blocks of `block_cols`
  its segment ids may meet: a `TileRanges` of int32 [B, num_row_tiles].

  Rows are queries and columns keys for the forward and dQ kernels
  (`segment_tile_ranges(q_ids, kv_ids, block_q, block_kv)`); the dK/dV
  kernels pass them the other way round. Blocks outside [lo, hi) meet no
  row's segment; blocks in [full_lo, full_hi) hold only the one id every row
  of the tile holds (the first run of such blocks; empty ranges are [0, 0)).
  Runs in XLA before a kernel (O(B x tiles x blocks)).
  """
  stacked = _segment_ranges_stacked(row_ids, col_ids, block_rows, block_cols)
  return TileRanges(*(stacked[..., i] for i in range(4)))


def tile_ranges_operand(row_ids, col_ids, block_rows: int, block_cols: int, num_tiles: int):
  """`segment_tile_ranges` as one int32 [B, num_tiles, 4] operand for a
  kernel (lo, hi, full_lo, full_hi of each row tile) whose grid names
  `num_tiles` row tiles: tiles past the ids (an empty slot of a persistent
  grid, a CTA's last consumer) get empty ranges."""
  ranges = _segment_ranges_stacked(row_ids, col_ids, block_rows, block_cols)
  return jnp.pad(ranges, [(0, 0), (0, num_tiles - ranges.shape[1]), (0, 0)])


def pad_ids(ids, length: int):
  """int32 ids [B, L] padded to `length` positions (whole tiles, so a kernel
  never reads past the end) by repeating the last id: the padding widens no
  tile's id range, and the rows and keys it stands for are masked by the
  lengths anyway."""
  ids = jnp.asarray(ids, jnp.int32)
  return jnp.pad(ids, [(0, 0), (0, length - ids.shape[1])], mode="edge")


def read_tile_ranges(ref, batch_idx, tile) -> TileRanges:
  """The ranges of one tile from a `tile_ranges_operand` in a kernel."""
  return TileRanges(*(ref[batch_idx, tile, i] for i in range(4)))


def hull(ranges) -> TileRanges:
  """The smallest block range holding every non-empty one of `ranges` (empty
  when all are); no block of it is claimed full. A CTA whose tiles walk
  different ranges loads their hull."""
  nonempty = [r.hi > r.lo for r in ranges]
  lo = functools.reduce(jnp.minimum, [jnp.where(ok, r.lo, jnp.iinfo(jnp.int32).max)
                                      for ok, r in zip(nonempty, ranges)])
  hi = functools.reduce(jnp.maximum, [jnp.where(ok, r.hi, 0) for ok, r in zip(nonempty, ranges)])
  lo = jnp.minimum(lo, hi)  # all empty: [0, 0)
  return TileRanges(lo, hi, lo, lo)


# --- The element mask ----------------------------------------------------------


def visible(mask: MaskSpec, q_idx, k_idx, kv_len, q_segment=None, kv_segment=None, *,
            q_len=None):
  """May query row `q_idx` see key `k_idx` (elementwise, broadcasting)?

  The mask, the key length and, when given, the segment ids of the row and
  the key (equal ids only); rows past the query length are the caller's
  business (the forward zeroes their output, the backward their P through
  the lse). Every backend's element mask is this one test. `q_len` (the
  row's query length) is needed only by a mask with `offset_from_lengths`.
  `kv_len=None`: the caller knows every `k_idx` lies below the key length
  (a kernel whose blocks end at a static length), so no compare is spent.
  """
  if mask.offset_from_lengths:
    if q_len is None or kv_len is None:
      raise ValueError("a mask aligned by the lengths needs the row's q_len and kv_len")
    mask = mask.at_lengths(q_len, kv_len)
  ok = mask.visible(q_idx, k_idx)
  if kv_len is not None and mask.key_chunk is not None:
    kv_len = mask.chunk_keys(kv_len)  # a scalar min: no select per element more
  if kv_len is not None:
    ok = ok & (k_idx < kv_len)
  if q_segment is not None:
    ok = ok & (q_segment == kv_segment)
  return ok


def check_query_lengths_for_alignment(mask: MaskSpec, q_lengths, kernel: str) -> None:
  """A band aligned by the lengths (`offset_from_lengths`: row b's offset is
  kv_len[b] - q_len[b]) needs the query lengths: a kernel given none would
  align each row by its padded query length, silently wrong. The public
  API always passes them (`validation._align` fills them with T)."""
  if mask.offset_from_lengths and q_lengths is None:
    raise ValueError(f"{kernel}: a mask aligned by the lengths (offset_from_lengths) needs "
                     f"q_lengths")


def key_length_to_compare(kv_len, block_kv: int, mask: MaskSpec, *, segment_ids: bool):
  """The key length an element mask of key blocks of `block_kv` compares
  keys with (`visible`'s `kv_len`), or None where that compare cannot fail:
  a static length that ends a block, so no walked block holds a key past
  it. Each condition of the mask costs a select per element of a masked
  block (Nsight Compute, H100).

  Only for kernels with segment ids (`segment_ids`), whose boundary blocks
  make masked steps common: there it made the packed forward 2.7-5.2 %
  faster on an H100, bitwise equal. Dropping it in the plain forward sped
  most causal rows up by 0.5-5.7 % but slowed B64 S512 H16 D128 causal by
  3 % (performance notes), so the plain kernels keep it. The sm90 backward
  keeps it too: without it the packed rows moved -2.4 to +1.4 %, no clear
  gain (same notes). So only the sm90 forward asks here."""
  if (segment_ids and isinstance(kv_len, int) and kv_len % block_kv == 0
      and not mask.offset_from_lengths):
    return None
  return kv_len


# --- The online softmax ---------------------------------------------------------
# Logits are kept raw; c = scale * log2(e) is folded into one FMA before exp2,
# and the running max m is kept in those scaled log2 units.

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
# Move a row's running max only when it grew by more than this (log2 units):
# a stale max is used for both l and O, so the result stays exact and P stays
# below 2**RESCALE_THRESHOLD, while O is rescaled far less often.
RESCALE_THRESHOLD = 8.0
# Finite "minus infinity" for the running max: rows that have seen only masked
# keys keep it, and exp2(-inf - M_INIT) = 0 never produces inf - inf = NaN.
M_INIT = -1e30


def initial_row_stats(num_rows: int, place=lambda x: x, sink=None, *, fixed_max: bool = False):
  """(running max, running sum) of `num_rows` rows before their first key:
  `M_INIT` and 0. `place` puts each vector into the kernel's row layout.

  With `sink` (this head's sink logit, natural log, an f32 scalar) the rows
  start as if they had seen the sink's virtual key: max = sink in log2 units,
  sum = exp2(0) = 1, and O = 0 since its value is zero. No extra pass: a row
  that then sees no key ends with O = 0 and lse = sink.

  `fixed_max` (soft-cap, where `fixed_max_is_exact`): the max the rows keep
  to the end, 0 or with a sink max(sink, 0) in log2 units (the comment above
  `fixed_max_is_exact`), and the sum holds the sink's term against it,
  exp2(sink - max) <= 1. Keys' P then stays <= 2^c; with a large sink it may
  underflow only where it is negligible next to the sink's term. A sink below
  about -87 (natural log) underflows itself: a row that sees no key then
  gets lse -inf, not the sink (its output is zeros either way).
  """
  if fixed_max:
    zeros = jnp.full((num_rows,), 0.0, jnp.float32)
    if sink is None:
      return place(zeros), place(zeros)
    sink_m = zeros + sink.astype(jnp.float32) * LOG2_E
    m = jnp.maximum(sink_m, 0.0)
    return place(m), place(exact_alpha(sink_m, m))
  if sink is None:
    m = jnp.full((num_rows,), M_INIT, jnp.float32)
    l = jnp.full((num_rows,), 0.0, jnp.float32)
  else:
    m = jnp.full((num_rows,), 0.0, jnp.float32) + sink.astype(jnp.float32) * LOG2_E
    l = jnp.full((num_rows,), 1.0, jnp.float32)
  return place(m), place(l)


def exact_alpha(m_old, m_new):
  """exp2(m_old - m_new), exactly 1.0 where the max did not move (the
  approximate exp2 of 0 is not promised to be exactly 1)."""
  return jnp.where(m_new == m_old, 1.0, jnp.exp2(m_old - m_new))


def online_softmax(s, m, c: float, descale=None, row_offset=None):
  """One tile's step of the online softmax: (P, new running max, alpha).

  `s`: raw logits [rows, keys] (masked ones at -inf, or +inf when c < 0);
  `m`: the running max of the rows in scaled log2 units. P = exp2(c s - m')
  and the caller rescales its sum and O by `alpha` = exp2(m - m').
  `descale`: None, or a run-time factor >= 0 of c (float8 operands' q and k
  descales): c's sign, static, still picks max or min.
  `row_offset`: None, or a value per row (a vector, or a scalar for every
  row) in log2 units added to c s of each of its keys (a score_mod's terms
  along the queries, `mod_tiles.affine_logits`): it moves the row's max and
  the exp2's operand, ops per row, not per key.
  """
  row_best = s.max(axis=1) if c >= 0 else s.min(axis=1)
  if descale is not None:
    c = c * descale
  best = row_best * c
  if row_offset is not None:
    best = best + row_offset
  m_grown = jnp.maximum(m, best)
  # Keep the stale max unless it grew enough to risk overflow.
  m_new = jnp.where(m_grown - m > RESCALE_THRESHOLD, m_grown, m)
  alpha = exact_alpha(m, m_new)
  shift = m_new if row_offset is None else m_new - row_offset
  p = jnp.exp2(s * c - lax.broadcast_in_dim(shift, s.shape, [0]))
  return p, m_new, alpha


# --- Soft-capped logits: a fixed row max ---------------------------------------
# With soft-cap a logit is c t in log2 units with t = tanh(...) in [-1, 1] and
# c = cap log2(e), so P = exp2(c t - m) lies in [2^(-c - m), 2^(c - m)] for
# any m. The softmax may then keep one fixed max m0 instead of a running one:
# no row max per block, no rescale factor, no rescale of O, and l sums P
# without l * alpha (`fixed_max_softmax`). The result is the same quotient
# O / l; P's relative rounding in a 16-bit float with f32's exponents (bf16)
# does not depend on its size, and O and l add up in f32.
#
# It is exact when nothing overflows or vanishes (`fixed_max_is_exact`):
# - P = 2^(c t - m0) <= 2^c (m0 >= 0) must be a finite P in P's dtype: bf16
#   holds up to 2^128 like f32; fp16 only up to 65504, so fp16 keeps the
#   running max;
# - l <= N 2^c + 1 (N keys, the sink's term <= 1) and every O element
#   <= N 2^c max|v| must stay finite in f32: c + log2(N) <= 96 leaves 2^32
#   of f32's 2^128 for |v| (the running max bounds P by 2^RESCALE_THRESHOLD,
#   so it tolerated |v| up to about 2^120 / N);
# - the smallest key term 2^(-c) (without a sink, m0 = 0) must be a normal
#   f32, or a row whose keys all sit at -cap would sum to l = 0 (exp2 flushes
#   subnormals): -c >= -126 follows from the first bound.
# Gemma 2's cap 50 gives c = 72.1: up to 2^23.9 (15.6 M) keys.
FIXED_MAX_LOG2_BUDGET = 96.0


def fixed_max_is_exact(dtype, cap: float | None, num_keys: int) -> bool:
  """May a softmax with soft-cap `cap` over at most `num_keys` keys per row,
  with P in `dtype`, keep a fixed max instead of a running one? (The
  bounds and why: the comment above.) False without soft-cap."""
  if cap is None:
    return False
  p, f32 = jnp.finfo(dtype), jnp.finfo(jnp.float32)
  if p.maxexp < f32.maxexp or p.minexp > f32.minexp:
    return False  # fp16: P past 65504 overflows
  return float(cap) * LOG2_E + math.log2(max(int(num_keys), 1)) <= FIXED_MAX_LOG2_BUDGET


def fixed_max_softmax(s, m, c: float):
  """P = exp2(c s - m) of a tile of soft-capped logits `s` (t of
  `softmax_logits`, masked ones at -inf) against the rows' fixed max `m`
  (`initial_row_stats(fixed_max=True)`): the running sum adds P.sum(1), O
  adds P V, and neither is rescaled."""
  return jnp.exp2(s * c - lax.broadcast_in_dim(m, s.shape, [0]))


def _inverse_sum(l):
  seen_any = l > 0.0
  return seen_any, jnp.where(seen_any, 1.0 / jnp.where(seen_any, l, 1.0), 0.0)


def _log_sum_exp(m, l, seen_any):
  return jnp.where(seen_any, (m + jnp.log2(jnp.where(seen_any, l, 1.0))) * LN_2, -jnp.inf)


def finish_rows(m, l):
  """(1 / l, natural-log lse) of rows with running max `m` and sum `l`.

  Rows that saw no key (l = 0) get 0 and -inf: their output is zeros.
  """
  seen_any, inv_l = _inverse_sum(l)
  return inv_l, _log_sum_exp(m, l, seen_any)


def normalize(acc, m, l):
  """(O / l, lse) for an accumulator `acc` [rows, head_dim] in registers;
  `finish_rows` for kernels that scale O piece by piece."""
  seen_any, inv_l = _inverse_sum(l)
  out = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
  return out, _log_sum_exp(m, l, seen_any)


# --- Score modifications ----------------------------------------------------------
# Logit soft-capping (Gemma 2): logits -> cap * tanh(logits / cap), applied to
# the scaled (and biased) logits before masking and the softmax.
#
# The kernels fold it into the softmax constant: with soft-cap they turn a raw
# tile s into t = tanh(s * scale / cap) (`softmax_logits`) and use
# c = cap * log2(e) (`softmax_scale`) where they used scale * log2(e), so
# P = exp2(c t - m) costs one multiply and one tanh more per element
# (tanh.approx.f32 under Mosaic GPU's approx_math). Masking comes after the
# tanh (tanh(-inf) = -1 is no mask). The backward multiplies dS by the slope
# 1 - t^2 (`soft_cap_slope`); the chain rule's `scale` stays where it was.


def softmax_scale(scale: float, cap: float | None) -> float:
  """The constant c with P = exp2(c * softmax_logits(s) - m)."""
  return float(scale if cap is None else cap) * LOG2_E


def softmax_logits(s, scale: float, cap: float | None):
  """A tile of raw logits q.k in the units of `softmax_scale`: `s` itself,
  or tanh(s * scale / cap) with soft-cap."""
  if cap is None:
    return s
  return jnp.tanh(s * jnp.float32(scale / cap))


def soft_cap_slope(t):
  """d(cap * tanh(x / cap)) / dx = 1 - t^2, from t = `softmax_logits`."""
  return 1.0 - t * t


def soft_cap(s, cap: float | None):
  """`cap * tanh(s / cap)`, or `s` when `cap` is None."""
  if cap is None:
    return s
  return jnp.float32(cap) * jnp.tanh(s * jnp.float32(1.0 / cap))


def soft_cap_grad(capped, cap: float | None):
  """d capped / d logits = 1 - tanh^2, from the capped logits; 0 where they
  are masked (-inf), so that 0 * it stays 0."""
  if cap is None:
    return 1.0
  t = capped * jnp.float32(1.0 / cap)
  return jnp.where(jnp.isfinite(capped), 1.0 - t * t, 0.0)


@dataclasses.dataclass(frozen=True)
class ScoreFunction:
  """How a kernel turns a raw Q K^T tile s into the logits t of its softmax
  P = exp2(c t - m), and back for dS: the static piece of `Scores` a kernel
  computes with (hashable, so it can be one of its statics). The built-in
  score modifications (the soft-cap) live here alone; a kernel asks for the
  constant c, the logits of a tile and their slope, and for what they
  require of it (`needs_raw_scores`, `bounds_logits`), never for the cap.

  `has_score_mod`: a user score_mod runs on the scaled scores
  (`mod_tiles.TileMods.logits`), so the scale leaves c."""

  scale: float = 1.0
  cap: float | None = None  # logits -> cap * tanh(logits / cap)
  has_score_mod: bool = False

  def __post_init__(self):
    # Python floats: the kernels' constants, whatever number type came in.
    object.__setattr__(self, "scale", float(self.scale))
    if self.cap is not None:
      if (isinstance(self.cap, bool) or not isinstance(self.cap, numbers.Real)
          or not self.cap > 0):
        raise ValueError(f"the soft-cap must be a float > 0; got {self.cap!r}")
      object.__setattr__(self, "cap", float(self.cap))

  def with_score_mod(self, has_score_mod: bool) -> ScoreFunction:
    """This function for a kernel call whose `mods` have (or lack) a score_mod."""
    return dataclasses.replace(self, has_score_mod=has_score_mod)

  def with_affine_score_mod(self, factor: float, per_score: bool) -> ScoreFunction:
    """This function for a score_mod a * x + R(q_idx) + C(kv_idx) with a
    fixed a = `factor` (`mod_functions.affine_form`): a joins the scale
    (so it is also the backward's factor of dQ and dK). Unless the mod needs
    an op per score (`per_score`: C is there) or there is a soft-cap, the
    logits are the raw scores with the scale in c, as without a score_mod,
    and R joins the rows' statistics (`mod_tiles.affine_logits`)."""
    return dataclasses.replace(self, scale=self.scale * factor,
                               has_score_mod=per_score or self.cap is not None)

  def as_scores(self, **parts) -> Scores:
    """A score value with this scale and these built-in modifications, and
    `parts` (a score_mod among them is the caller's to add)."""
    return Scores(scale=self.scale, soft_cap=self.cap, **parts)

  @property
  def exp2_constant(self) -> float:
    """c in P = exp2(c t - m) (`softmax_scale`)."""
    return softmax_scale(1.0 if self.has_score_mod else self.scale, self.cap)

  @property
  def modifies_logits(self) -> bool:
    """Whether a built-in modification makes t more than the (scaled) s."""
    return self.cap is not None

  @property
  def logits_are_raw_scores(self) -> bool:
    """t = s, the scale all in c: a traced factor of the scale (float8
    descales) may join c, at no multiply per score."""
    return not self.has_score_mod and not self.modifies_logits

  @property
  def needs_raw_scores(self) -> bool:
    """The logits need the raw S tile: a kernel cannot fold -lse2 / c into
    it (the tanh of the soft-cap is not linear)."""
    return self.cap is not None

  def tuning_flags(self) -> dict:
    """What of the score function keys a call's autotuned config (the cache
    files' names of it, unchanged since the soft-cap was an argument)."""
    return {"soft_cap": self.cap is not None}

  def bounds_logits(self, dtype, num_keys: int) -> bool:
    """Whether the logits are bounded so that a softmax over `num_keys` keys
    with P in `dtype` may keep a fixed max (`fixed_max_is_exact`)."""
    return fixed_max_is_exact(dtype, self.cap, num_keys)

  def logits(self, s, scale=None):
    """t of a raw tile `s` without a score_mod: s itself (the scale is in c)
    or tanh(s * scale / cap). `scale`: a traced factor in place of the
    static one (float8 descales)."""
    return softmax_logits(s, self.scale if scale is None else scale, self.cap)

  def modified_logits(self, x):
    """t of a tile `x` already scaled and through the score_mod."""
    return softmax_logits(x, 1.0, self.cap)

  def slope(self, t):
    """dt/dx of the built-in modifications at logits `t` (`logits`), or None
    where it is 1."""
    return None if self.cap is None else soft_cap_slope(t)

  # The XLA path keeps logits in natural units (no exp2 constant folded in).
  def modify(self, x):
    """Scaled (and score_mod-modified) logits `x` through the built-in
    modifications: cap * tanh(x / cap), or `x`."""
    return soft_cap(x, self.cap)

  def modify_grad(self, modified):
    """d modify(x) / dx from the modified logits, 0 where they are masked
    (-inf); 1 without a built-in modification."""
    return soft_cap_grad(modified, self.cap)


# Attention sinks (gpt-oss, StreamingLLM): per query head a logit `sink` of a
# virtual key whose value is zero. It adds exp(sink) to every row's softmax
# denominator and nothing to the output. With the sink in the log-sum-exp,
# the backward's P = exp(s - lse) needs no change; the sink's own gradient is
# that of a key with logit `sink` and value 0: dS = P_sink * (dP - delta) with
# dP = 0, summed over the rows of its head.


def add_sinks(out, lse, sinks, q_lengths=None):
  """(out, lse) of attention without sinks -> with them: the post-pass of a
  backend that does not start its softmax from the sink.

  out [B, T, N, D]; lse f32 [B, N, T] (natural log; -inf for rows that saw
  no key); sinks [N]; q_lengths int32 [B] or None (rows at or past it keep
  zeros and -inf). A row that saw no key keeps zeros and gets lse = sink.
  """
  rows = jnp.arange(out.shape[1])[None, :]
  rows_valid = jnp.broadcast_to(
      rows < (out.shape[1] if q_lengths is None else q_lengths[:, None]), out.shape[:2])
  sink = sinks.astype(jnp.float32)[None, :, None]
  total = jnp.where(rows_valid[:, None, :], jnp.logaddexp(lse, sink), lse)
  keep = jnp.where(jnp.isfinite(total), jnp.exp(lse - jnp.where(jnp.isfinite(total), total, 0.0)),
                   0.0)  # [B, N, T]: the share of the keys in the new denominator
  out = (out.astype(jnp.float32) * keep.transpose(0, 2, 1)[..., None]).astype(out.dtype)
  return out, total


def sink_probability(sinks, lse):
  """The sink's softmax share exp(sink - lse) [B, N, T], from the lse with
  sinks [B, N, T]; 0 in rows past the query length (lse = -inf)."""
  sink = sinks.astype(jnp.float32)[None, :, None]
  return jnp.where(jnp.isfinite(lse), jnp.exp(sink - jnp.where(jnp.isfinite(lse), lse, 0.0)),
                   0.0)


def sink_grad(sinks, lse, delta):
  """d loss / d sinks [N], from the lse with sinks [B, N, T] and delta =
  rowsum(dout * out) [B, N, T]: -sum over rows of exp(sink - lse) * delta."""
  return -(sink_probability(sinks, lse) * delta).sum(axis=(0, 2)).astype(sinks.dtype)


# --- Programmable scores: block masks ---------------------------------------------
# A block mask classifies every (query tile, key tile) pair of one call:
# EMPTY (no pair visible: never loaded), PARTIAL (some: the element mask
# runs) or FULL (all: no element mask). It is data, [Bm, Hm, nq, nk] int8,
# Bm and Hm 1 where it broadcasts over the batch or the heads. The kernels
# read it as lists (`block_lists`): per query tile, the partial key tiles,
# then the full ones.

EMPTY, PARTIAL, FULL = 0, 1, 2
DEFAULT_MASK_BLOCK = 128  # FlexAttention's; the sm90 forward's CTA tile


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMask:
  """Per-tile classes of a `mask_mod` (`create_block_mask`), reusable across
  layers and calls. `classes` int8 [Bm, Hm, ceil(q_len / q_block),
  ceil(kv_len / kv_block)]; the `mask_mod` itself and its captured arrays
  come along, so a call given only the block mask applies it."""

  classes: Any
  mask_captured: tuple = ()
  q_block: int = dataclasses.field(default=DEFAULT_MASK_BLOCK, metadata=dict(static=True))
  kv_block: int = dataclasses.field(default=DEFAULT_MASK_BLOCK, metadata=dict(static=True))
  q_len: int = dataclasses.field(default=0, metadata=dict(static=True))
  kv_len: int = dataclasses.field(default=0, metadata=dict(static=True))
  mask_mod: Any = dataclasses.field(default=None, metadata=dict(static=True))
  # Made by a differentiated call itself (`with_shared_mod_classes`), not
  # by the user: read only at tiles that are unions of its own, where
  # regrouping is exact; at finer tiles `mask_mod` is evaluated anew.
  unions_only: bool = dataclasses.field(default=False, metadata=dict(static=True))

  @property
  def shape(self):
    return self.classes.shape

  def density(self):
    """The share of tiles that are not EMPTY (a traced or concrete scalar)."""
    return jnp.mean((self.classes != EMPTY).astype(jnp.float32))


def evaluate_mask_mod(mask_mod, captured, batch_idx, head_idx, q_idx, kv_idx):
  """`mask_mod` on broadcasting index arrays (the XLA path's element mask)."""
  from fa4_jax import mod_functions
  return mod_functions.evaluate(mask_mod, captured, batch_idx, head_idx, q_idx, kv_idx)


def mask_mod_classes(mask_mod, captured, batch: int, heads: int, q_len: int, kv_len: int,
                     q_block: int, kv_block: int, *, first_batch=0, first_head=0):
  """int8 [batch, heads, nq, nk]: `mask_mod` evaluated once, in XLA, a few
  query tiles at a time, into classes. Positions past the lengths count as
  not visible. `first_batch`, `first_head`: the indices `mask_mod` sees for
  row 0 and head 0 (a shard's).

  Each step evaluates at most `MASK_MOD_STEP_ELEMENTS` pairs (and never less
  than one query tile): one tile a step made a loop of q_len / q_block
  small steps, whose per-step launches, not the mask, set the cost."""
  nq, nk = cdiv(q_len, q_block), cdiv(kv_len, kv_block)
  b = first_batch + jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
  h = first_head + jnp.arange(heads, dtype=jnp.int32)[None, :, None, None]
  cols = jnp.arange(nk * kv_block, dtype=jnp.int32)[None, None, None, :]

  def one_tile(qt):
    rows = (qt * q_block + jnp.arange(q_block, dtype=jnp.int32))[None, None, :, None]
    real = (rows < q_len) & (cols < kv_len)
    keep = evaluate_mask_mod(mask_mod, captured, b, h, rows, cols) & real
    tiles = keep.reshape(batch, heads, q_block, nk, kv_block)
    real = real.reshape(1, 1, q_block, nk, kv_block)
    any_ = tiles.any(axis=(2, 4))
    all_ = jnp.where(real, tiles, True).all(axis=(2, 4))
    return jnp.where(all_ & any_, FULL, jnp.where(any_, PARTIAL, EMPTY)).astype(jnp.int8)

  tiles_per_step = max(1, MASK_MOD_STEP_ELEMENTS // (batch * heads * q_block * nk * kv_block))
  classes = lax.map(one_tile, jnp.arange(nq, dtype=jnp.int32), batch_size=min(tiles_per_step, nq))
  return jnp.moveaxis(classes, 0, 2)


def broadcast_extents(mask_mod, batch: int, heads: int) -> tuple[int, int]:
  """(batch, heads) at which `mask_mod`'s classes need evaluating: 1 for an
  index the function provably ignores (`mod_functions.index_dependence`),
  since the result is then the same for every row / head. Every consumer
  takes such classes as they are, as it takes a `create_block_mask(batch=
  None, heads=None)` block mask's: `tile_classes` broadcasts them against
  the built-ins' [B, 1, ...], and a kernel whose classes have one head
  walks that one list for every head (`ModStatics.per_head`). Most masks
  (causal variants, prefix-LM, chunked local, a sliding window with global
  tokens) ignore both: q_len x kv_len pairs evaluated instead of batch x
  heads times as many."""
  from fa4_jax import mod_functions
  on_batch, on_head = mod_functions.index_dependence(mask_mod)
  return batch if on_batch else 1, heads if on_head else 1


# Pairs one step of `mask_mod_classes` evaluates at most: 2**24 booleans (16
# MiB, and a few times that in the mod's temporaries).
MASK_MOD_STEP_ELEMENTS = 1 << 24


def combine_classes(a, b):
  """Classes of two masks and-ed: EMPTY if either is, FULL if both are."""
  return jnp.where((a == EMPTY) | (b == EMPTY), EMPTY,
                   jnp.where((a == FULL) & (b == FULL), FULL, PARTIAL)).astype(jnp.int8)


def _regroup_axis(classes, axis: int, size_from: int, size_to: int, count_to: int):
  """Classes along `axis` from tiles of `size_from` to tiles of `size_to`:
  unions of tiles (coarser) or parts of one (finer); EMPTY past the end."""
  if size_from == size_to:
    out = classes
  elif size_to % size_from == 0:  # each new tile is `r` old ones
    r = size_to // size_from
    n = classes.shape[axis]
    pad = [(0, 0)] * classes.ndim
    pad[axis] = (0, cdiv(n, r) * r - n)
    # Padding tiles lie past the length: they neither add pairs nor make a
    # union partial (EMPTY entries of a FULL union are past the length).
    padded = jnp.pad(classes, pad, constant_values=-1)
    shape = classes.shape[:axis] + (cdiv(n, r), r) + classes.shape[axis + 1:]
    grouped = padded.reshape(shape)
    real = grouped >= 0
    any_ = (real & (grouped != EMPTY)).any(axis=axis + 1)
    all_ = jnp.where(real, grouped == FULL, True).all(axis=axis + 1)
    out = jnp.where(any_ & all_, FULL, jnp.where(any_, PARTIAL, EMPTY)).astype(jnp.int8)
  elif size_from % size_to == 0:
    out = jnp.repeat(classes, size_from // size_to, axis=axis)
  else:
    raise ValueError(f"block sizes {size_from} and {size_to} do not nest")
  n = out.shape[axis]
  if n < count_to:
    pad = [(0, 0)] * out.ndim
    pad[axis] = (0, count_to - n)
    out = jnp.pad(out, pad, constant_values=EMPTY)
  return lax.slice_in_dim(out, 0, count_to, axis=axis)


def block_mask_nests(block_mask: BlockMask, q_block: int, kv_block: int) -> bool:
  """Whether `block_mask`'s tiles and tiles of (q_block, kv_block) nest
  (for a `unions_only` one: whether the latter are unions of the former)."""
  if block_mask.unions_only:
    return q_block % block_mask.q_block == 0 and kv_block % block_mask.kv_block == 0
  nests = lambda a, b: a % b == 0 or b % a == 0
  return nests(block_mask.q_block, q_block) and nests(block_mask.kv_block, kv_block)


# The tiles of `with_shared_mod_classes`' classes: they divide every tile
# of the kernels that read classes (multiples of 32: the sm90 backward's
# finest is 64 x 32) and the XLA path's blocks from 32 positions on.
SHARED_MASK_BLOCK = 32


def with_shared_mod_classes(scores_: "Scores", batch: int, heads: int, q_len: int,
                            kv_len: int) -> "Scores":
  """`scores_` with its `mask_mod`'s classes evaluated here, once, as a
  `unions_only` block mask of small tiles, where it has a `mask_mod`, no
  block mask, and the mod ignores both batch and head (`broadcast_extents`:
  the classes are then [1, 1, nq, nk], the same on every device of a
  sharded call); else `scores_` as it is.

  For a differentiated call (`vjp._core_jvp`): its forward and its
  backward each classified their tiles at their own tile sizes, so
  `jax.grad` evaluated `mask_mod` over every pair twice; each now regroups
  these classes to its own tiles (exactly: its tiles are unions of them).
  A tile size that is no multiple of these (the decode arrangement's rows,
  the XLA path's blocks of a short sequence) evaluates anew as before."""
  if scores_.mask_mod is None or scores_.block_mask is not None:
    return scores_
  if broadcast_extents(scores_.mask_mod, batch, heads) != (1, 1):
    return scores_
  block = lambda n: math.gcd(SHARED_MASK_BLOCK, max(8, cdiv(n, 8) * 8))
  q_block, kv_block = block(q_len), block(kv_len)
  b0, h0 = scores_.global_indices(0, 0)
  classes = mask_mod_classes(scores_.mask_mod, scores_.mask_captured, 1, 1, q_len, kv_len,
                             q_block, kv_block, first_batch=b0, first_head=h0)
  return scores_.replace(block_mask=BlockMask(
      classes=classes, mask_captured=scores_.mask_captured, q_block=q_block,
      kv_block=kv_block, q_len=q_len, kv_len=kv_len, mask_mod=scores_.mask_mod,
      unions_only=True))


def block_lists(classes):
  """int32 (counts [..., nq, 2], order [..., nq, nk]) of classes [..., nq, nk]:
  per query tile the number of PARTIAL and FULL key tiles, and the key
  tiles in walking order: the partial ones, then the full ones (each in
  increasing order), then the empty ones (never walked)."""
  rank = jnp.where(classes == PARTIAL, 0, jnp.where(classes == FULL, 1, 2))
  order = jnp.argsort(rank, axis=-1, stable=True).astype(jnp.int32)
  counts = jnp.stack([(classes == PARTIAL).sum(-1), (classes == FULL).sum(-1)], axis=-1)
  return counts.astype(jnp.int32), order


# --- Programmable scores: the score value -----------------------------------------


# Stored inputs whose real value is the stored one times a descale factor
# (`Scores.q_descale` ...).
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _static(**kwargs):
  return dataclasses.field(metadata=dict(static=True), **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Scores:
  """Everything that shapes a score, built once (`fa4_jax.validation`) and
  carried whole to every backend: a pytree whose arrays are leaves and
  whose static description (mask band, scale, soft-cap, the traced
  `score_mod` and `mask_mod`) is hashable.

  How a score is formed, in this order (every backend):
    s = scale * q.k (+ bias)
    s = score_mod(s, batch, head, q_idx, kv_idx)        if given
    s = cap * tanh(s / cap)                             with soft-cap
    s = -inf where not visible: the band (causal, windows), the lengths,
        the segment ids, and mask_mod(batch, head, q_idx, kv_idx)
    softmax over the keys, with the sink's virtual key if given.
  With float8 operands the real q, k, v are the stored ones times their
  descales: `scale` above is then scale * q_descale[head] *
  k_descale[kv head], and the output is multiplied by v_descale[kv head].
  `q_idx` / `kv_idx` are positions in the query and key sequences as passed
  (0-based; under bottom-right alignment too: alignment moves the causal
  diagonal, not the indices); `head` is the query head; `batch` the row.
  """

  mask: MaskSpec = _static(default=MaskSpec())
  scale: float = _static(default=1.0)
  soft_cap: float | None = _static(default=None)
  score_mod: Any = _static(default=None)  # mod_functions.ModFunction
  mask_mod: Any = _static(default=None)
  q_lengths: Any = None  # int32 [B]
  kv_lengths: Any = None  # int32 [B]
  q_segment_ids: Any = None  # int32 [B, T]
  kv_segment_ids: Any = None  # int32 [B, S]
  sinks: Any = None  # float [N]
  score_captured: tuple = ()
  mask_captured: tuple = ()
  block_mask: BlockMask | None = None  # classes of mask_mod alone
  # int32 [2]: the global (batch, head) index of this shard's first row and
  # head, which a sharded call adds before calling the mods; None: 0, 0.
  index_offsets: Any = None
  # float8 operands: float32 descales per query head [N] and per key/value
  # head [K] (None: 1), and the output's dtype, set exactly when the call has
  # float8 operands (None: the query's dtype).
  q_descale: Any = None
  k_descale: Any = None
  v_descale: Any = None
  out_dtype: Any = _static(default=None)

  @property
  def has_mods(self) -> bool:
    return self.score_mod is not None or self.mask_mod is not None

  @property
  def has_fp8(self) -> bool:
    return self.out_dtype is not None

  @property
  def score_function(self) -> ScoreFunction:
    """What a kernel needs of how a raw score becomes a logit."""
    return ScoreFunction(self.scale, self.soft_cap, self.score_mod is not None)

  def kernel_features(self) -> frozenset[str]:
    """The optional features (`fa4_jax.kernels`' `FEATURES`) a kernel must
    have to serve this call's score modifications: "score_function" for
    modified logits, "mods" for a score_mod or mask_mod. (Sinks it need
    not: the backends add them after a kernel without them.)"""
    return frozenset(name for name, needed in (
        ("score_function", self.score_function.modifies_logits),
        ("mods", self.has_mods)) if needed)

  @property
  def segment_pair(self):
    """The kernels' `segment_ids` argument: both arrays or None."""
    return None if self.q_segment_ids is None else (self.q_segment_ids, self.kv_segment_ids)

  def replace(self, **changes) -> "Scores":
    return dataclasses.replace(self, **changes)

  def without_sinks(self) -> "Scores":
    return self.replace(sinks=None)

  def global_indices(self, batch_idx, head_idx):
    """(batch, head) as the mods see them: shard-local plus the offsets."""
    if self.index_offsets is None:
      return batch_idx, head_idx
    return batch_idx + self.index_offsets[0], head_idx + self.index_offsets[1]

  def modified(self, s, batch_idx, head_idx, q_idx, kv_idx):
    """Scaled logits `s` (f32, broadcasting against the indices) through
    `score_mod` and the soft-cap (the order above)."""
    if self.score_mod is not None:
      from fa4_jax import mod_functions
      b, h = self.global_indices(batch_idx, head_idx)
      s = mod_functions.evaluate(self.score_mod, self.score_captured, s, b, h, q_idx, kv_idx)
    return self.score_function.modify(s)

  def mod_keeps(self, batch_idx, head_idx, q_idx, kv_idx):
    """`mask_mod` on broadcasting indices (True without one)."""
    if self.mask_mod is None:
      return True
    b, h = self.global_indices(batch_idx, head_idx)
    return evaluate_mask_mod(self.mask_mod, self.mask_captured, b, h, q_idx, kv_idx)

  def mod_classes(self, batch: int, heads: int, q_len: int, kv_len: int, q_block: int,
                  kv_block: int):
    """int8 [Bm, Hm, nq, nk] classes of `mask_mod` alone at these tiles: the
    block mask's where it nests with them (a sharded call holds its shard's
    part of it), else `mask_mod` evaluated anew, at one batch row (Bm = 1)
    where it ignores its `batch` argument and at one head (Hm = 1) where it
    ignores `head` (`broadcast_extents`); None without a `mask_mod`."""
    if self.mask_mod is None:
      return None
    nq, nk = cdiv(q_len, q_block), cdiv(kv_len, kv_block)
    bm = self.block_mask
    if bm is not None and block_mask_nests(bm, q_block, kv_block):
      classes = _regroup_axis(bm.classes, 2, bm.q_block, q_block, nq)
      return _regroup_axis(classes, 3, bm.kv_block, kv_block, nk)
    # Evaluated a DEFAULT_MASK_BLOCK of rows at a time where the tiles are
    # made of such blocks: large tiles (the XLA path's) cost no more memory.
    fine = lambda size: DEFAULT_MASK_BLOCK if size % DEFAULT_MASK_BLOCK == 0 else size
    b0, h0 = self.global_indices(0, 0)
    batch, heads = broadcast_extents(self.mask_mod, batch, heads)
    classes = mask_mod_classes(self.mask_mod, self.mask_captured, batch, heads, q_len, kv_len,
                               fine(q_block), fine(kv_block), first_batch=b0, first_head=h0)
    classes = _regroup_axis(classes, 2, fine(q_block), q_block, nq)
    return _regroup_axis(classes, 3, fine(kv_block), kv_block, nk)


def _ranges_to_classes(ranges: TileRanges, num_cols: int):
  """int8 [..., num_cols] classes of tile ranges [...]: EMPTY outside [lo,
  hi), FULL inside [full_lo, full_hi), PARTIAL between."""
  col = jnp.arange(num_cols, dtype=jnp.int32)
  at = lambda x: jnp.asarray(x, jnp.int32)[..., None]
  inside = (col >= at(ranges.lo)) & (col < at(ranges.hi))
  full = (col >= at(ranges.full_lo)) & (col < at(ranges.full_hi))
  return jnp.where(inside, jnp.where(full, FULL, PARTIAL), EMPTY).astype(jnp.int8)


def builtin_tile_classes(scores_: "Scores", batch: int, q_len: int, kv_len: int, q_block: int,
                         kv_block: int):
  """int8 [B, 1, nq, nk]: the classes of the built-in masks (band, lengths,
  segment ids) at tiles of `q_block` x `kv_block`: the same tile bounds the
  kernels walk (`kv_tile_ranges`, `segment_tile_ranges`), as classes, to
  combine with a `mask_mod`'s (`Scores.tile_classes`)."""
  nq, nk = cdiv(q_len, q_block), cdiv(kv_len, kv_block)
  full_len = lambda n: jnp.full((batch,), n, jnp.int32)
  q_lens = full_len(q_len) if scores_.q_lengths is None else scores_.q_lengths
  kv_lens = full_len(kv_len) if scores_.kv_lengths is None else scores_.kv_lengths
  q_lo = jnp.arange(nq, dtype=jnp.int32) * q_block

  def one_row(ql, kl):
    r = kv_tile_ranges(scores_.mask, q_lo, q_lo + q_block, ql, kl, kv_block)
    return tuple(jnp.broadcast_to(x, (nq,)) for x in (r.lo, r.hi, r.full_lo, r.full_hi))

  ranges = TileRanges(*jax.vmap(one_row)(q_lens.astype(jnp.int32),
                                         kv_lens.astype(jnp.int32)))  # [B, nq] each
  if scores_.q_segment_ids is not None:
    ranges = ranges.intersect(segment_tile_ranges(
        scores_.q_segment_ids, scores_.kv_segment_ids, q_block, kv_block))
  return _ranges_to_classes(ranges, nk)[:, None]


def tile_classes(scores_: "Scores", batch: int, heads: int, q_len: int, kv_len: int,
                 q_block: int, kv_block: int):
  """int8 [B, Hm, nq, nk] (Hm: 1 or `heads`): every mask of the call, the
  built-ins and `mask_mod`, as classes of tiles of `q_block` x `kv_block`;
  what a kernel that walks `block_lists` reads."""
  classes = builtin_tile_classes(scores_, batch, q_len, kv_len, q_block, kv_block)
  mod = scores_.mod_classes(batch, heads, q_len, kv_len, q_block, kv_block)
  if mod is None:
    return classes
  return combine_classes(classes, mod)
