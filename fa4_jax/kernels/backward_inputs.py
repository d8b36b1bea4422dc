"""What every fused backward checks and computes in XLA before its kernels
run (the sm90 and the sm100 backward alike): its operands' shapes and
dtypes, the softmax statistics in the kernels' units and the segment ids'
per-tile ranges.

`preprocess` gives lse2 = lse * log2(e), with +inf on rows that must not
contribute, so that a kernel's exp2(c * s - lse2) is exactly 0 there and no
kernel special-cases dead rows, and delta = rowsum(dO * O), both padded to
whole tiles. `segment_operands` gives a kernel the ids and the block ranges
of its own tiling (`scores.segment_tile_ranges`). With a `score_mod` or
`mask_mod`, `fine_tile_classes` classifies every tile pair once and
`mod_operands` gives each kernel the block lists of its own CTA tiles
(`scores.block_lists`) and the mods' captured arrays.
"""

from __future__ import annotations

import jax.numpy as jnp

from fa4_jax import mod_functions, scores
from fa4_jax.kernels import KernelUnsupported
from fa4_jax.scores import LOG2_E, cdiv, pad_ids, tile_ranges_operand

# lse2 and delta are padded to a multiple of this (every block size divides it).
STATS_ALIGN = 128


def check_operands(q, k, v, *, own_value_head_dim: bool = False):
  """The checks both backwards make of their operands. `own_value_head_dim`:
  a backward whose v may have a head dim of its own (its other dims are k's)."""
  if v.shape[:-1] != k.shape[:-1] or (v.shape != k.shape and not own_value_head_dim):
    raise KernelUnsupported(f"v must have k's shape {k.shape}"
                            f"{' but for its head dim' if own_value_head_dim else ''}; "
                            f"got {v.shape}")
  if k.dtype != q.dtype or v.dtype != q.dtype:
    raise KernelUnsupported(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")


def preprocess(out, lse, dout, q_lengths, q_pad: int, *, with_delta: bool = True):
  """(lse2, delta), float32 [B, N, q_pad rounded up to STATS_ALIGN].

  delta = rowsum(dO * O) (None when not `with_delta`: a kernel computes
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


def segment_operands(q_ids, kv_ids, *, keys_are_rows: bool, block_rows: int, consumers: int,
                     num_ctas: int, block_cols: int):
  """The segment-id operands of one backward kernel whose CTAs own
  `consumers` tiles of `block_rows` rows (keys when `keys_are_rows`, as in
  dK/dV; queries in dQ) and walk blocks of `block_cols` columns.

  Returns [q ids, kv ids, CTA ranges (, consumer ranges when consumers > 1)]."""
  rows, cols = (kv_ids, q_ids) if keys_are_rows else (q_ids, kv_ids)
  ranges = [tile_ranges_operand(rows, cols, consumers * block_rows, block_cols, num_ctas)]
  if consumers > 1:
    ranges.append(tile_ranges_operand(rows, cols, block_rows, block_cols, num_ctas * consumers))
  rows = pad_ids(rows, num_ctas * consumers * block_rows)
  cols = pad_ids(cols, cdiv(cols.shape[1], block_cols) * block_cols)
  return [*((cols, rows) if keys_are_rows else (rows, cols)), *ranges]


def fine_tile_classes(mods, batch: int, heads: int, q_len: int, kv_len: int, q_block: int,
                      kv_block: int):
  """int8 [B, Hm, nq, nk]: every mask of the call (`scores.tile_classes`) at
  tiles of `q_block` x `kv_block`, fine enough that each kernel's CTA tiles
  are unions of them (`mod_operands`): mask_mod evaluated once for both."""
  return scores.tile_classes(mods, batch, heads, q_len, kv_len, q_block, kv_block)


def heavy_tiles_first(counts):
  """int32 [B, tiles]: a kernel's CTA tiles, those with the most blocks in
  their lists (`scores.block_lists`' counts [B, Hm, tiles, 2], summed over
  the heads) first, ties in the grid's order: the order in which the CTAs of
  the grid's tile axis take them (`mod_tiles.ModRefs.cta_tile`), so that
  the long walks do not start in the grid's last wave (prefix-LM's last
  query tiles see every key)."""
  work = counts.sum(axis=(1, 3))
  return jnp.argsort(-work, axis=-1, stable=True).astype(jnp.int32)


def mod_operands(mods, fine, fine_blocks, *, q_block: int, kv_block: int, num_q: int,
                 num_kv: int, keys_are_rows: bool, tile_order: bool = False):
  """The mods' operands of one backward kernel (`mod_tiles.ModRefs`):
  the block lists of its CTA tiles of `q_block` queries by `kv_block` keys
  (`num_q` x `num_kv` of them: the kernels' padded counts), rows per query
  tile, or per key tile when `keys_are_rows` (dK/dV), the (batch, head)
  offsets if any, then the captured arrays of score_mod and of mask_mod (0-d
  ones as shape (1,)). `fine`: `fine_tile_classes` at `fine_blocks`
  (q_block, kv_block), which divide this kernel's. `tile_order`: the CTAs'
  tile order (`heavy_tiles_first`) follows the lists."""
  fq, fk = fine_blocks
  classes = scores._regroup_axis(fine, 2, fq, q_block, num_q)  # noqa: SLF001
  classes = scores._regroup_axis(classes, 3, fk, kv_block, num_kv)  # noqa: SLF001
  if keys_are_rows:
    classes = jnp.swapaxes(classes, -1, -2)
  counts, order = scores.block_lists(classes)
  operands = [counts, order]
  if tile_order:
    operands.append(heavy_tiles_first(counts))
  if mods.index_offsets is not None:
    operands.append(jnp.asarray(mods.index_offsets, jnp.int32).reshape(2))
  operands += [mod_functions.kernel_operand(x)
               for x in (*mods.score_captured, *mods.mask_captured)]
  return operands
