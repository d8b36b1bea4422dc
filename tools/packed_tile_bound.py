"""How much of the work of a packed call is useful, at the kernels' own tiles.

For `benchmarks/bench_packed.py`'s packings (16k-token rows, causal inside
each document), counts the (query, key) pairs the sm90 kernels compute: every
block of a tile's walk, from the same helpers the kernels use
(`scores.segment_tile_ranges` intersected with the causal band's
`kv_tile_ranges` / `q_tile_ranges`), times the block's area. Divides the
visible pairs by that, and by the same fraction for dense causal over the
row: the highest "useful TFLOP/s as a share of dense causal" a kernel with
these tiles can reach, if every computed block cost the same (issue #25's
90 % target). No GPU needed:

    python3 tools/packed_tile_bound.py [--batch 8]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # fa4_jax
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))
import bench_packed  # noqa: E402
from fa4_jax import scores  # noqa: E402
from fa4_jax.kernels import sm90_backward, sm90_forward  # noqa: E402

CAUSAL = scores.MaskSpec(right=0)


def walked_blocks(ids, block_rows: int, block_cols: int, keys_are_rows: bool) -> np.ndarray:
  """int [batch, tiles]: the blocks of `block_cols` columns that each tile of
  `block_rows` rows walks (rows are keys for the dK/dV kernel)."""
  ids = jnp.asarray(ids)
  seq = ids.shape[1]
  segments = scores.segment_tile_ranges(ids, ids, block_rows, block_cols)
  tiles = jnp.arange(segments.lo.shape[1])
  lo, hi = tiles * block_rows, (tiles + 1) * block_rows
  ranges = scores.q_tile_ranges if keys_are_rows else scores.kv_tile_ranges
  band = ranges(CAUSAL, lo, hi, seq, seq, block_cols)
  band = scores.TileRanges(*(jnp.broadcast_to(x, segments.lo.shape) for x in
                             (band.lo, band.hi, band.full_lo, band.full_hi)))
  walked = band.intersect(segments)
  return np.maximum(np.asarray(walked.hi - walked.lo), 0)


def computed_pairs(ids, block_rows: int, block_cols: int, keys_are_rows: bool) -> int:
  """Pairs computed by tiles of `block_rows` rows walking `block_cols`-wide
  blocks (rows are keys for the dK/dV kernel)."""
  return int(walked_blocks(ids, block_rows, block_cols, keys_are_rows).sum()) * (
      block_rows * block_cols)


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=8)
  args = ap.parse_args()
  fwd = sm90_forward.choose_config(128, CAUSAL, bench_packed.ROW, bench_packed.ROW)
  bwd = sm90_backward.choose_config(128, CAUSAL)
  kernels = [("forward", fwd.block_q, fwd.block_kv, False),
             ("dK/dV", bwd.dkv.block_kv, bwd.dkv.block_q, True),
             ("dQ", bwd.dq.block_q, bwd.dq.block_kv, False)]
  dense_ids = np.zeros((1, bench_packed.ROW), np.int32)
  dense_useful = bench_packed.visible_pairs(dense_ids)
  print("| mean document | " + " | ".join(f"{k} ({r}x{c})" for k, r, c, _ in kernels) + " |")
  print("|---|" + "---|" * len(kernels))
  for mean in bench_packed.MEAN_DOCUMENTS:
    ids = bench_packed.packed_rows(args.batch, mean)
    useful = bench_packed.visible_pairs(ids)
    cells = []
    for _, rows, cols, keys_are_rows in kernels:
      share = useful / computed_pairs(ids, rows, cols, keys_are_rows)
      dense = dense_useful / computed_pairs(dense_ids, rows, cols, keys_are_rows)
      cells.append(f"{share:.3f} ({share / dense:.1%} of dense)")
    print(f"| {mean} | " + " | ".join(cells) + " |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
