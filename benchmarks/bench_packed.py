"""Packed training on one GPU: documents packed into rows of 16k tokens, causal.

Each row of the batch holds documents whose lengths are drawn (fixed seed)
from an exponential distribution of mean 1k, 2k or 4k tokens, the last one
cut at the end of the row. Columns, in one process:

* `packed`: fa4_jax with `query_segment_ids` / `key_value_segment_ids`
  (causal inside each document), the default implementation;
* `tokamax`: tokamax 0.0.17's Mosaic GPU attention with the same mask as
  `Mask(k_start=start of the row's document, is_causal=True)`, where
  tokamax is installed;
* `dense`: fa4_jax dense causal over the whole row (our speed without
  packing);
* `cudnn`: cuDNN dense causal over the whole row through `jax.nn` (what a
  user runs today: wrong across documents, but the speed they know).

Forward: the sum of the kernel durations of a call in a profiler trace
(CUPTI underneath; our packed call includes the small XLA reductions that
summarise each tile's ids).
Backward: the span of the VJP's kernels in a profiler trace
(`bench_common.trace_spans`: our backward kernels overlap), median of
`ITERATIONS`. "Useful" TFLOP/s count only the visible (query, key) pairs:
4 * H * D per pair forward, 2.5x that backward; the dense rows count
S^2 / 2 pairs per row, the convention of the other tables.

Usage (GPU machine, repository root):
    python3 benchmarks/bench_packed.py [--only SUBSTRING] [--tag NAME] [--rounds N]
Writes benchmarks/results/packed[-NAME]-<device>-<date>.json (or $OUT/) and
prints a Markdown table.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fa4_jax  # noqa: E402

import bench_common  # noqa: E402

ROW = 16384
MEAN_DOCUMENTS = (1024, 2048, 4096)
# (name, B, Hq, Hkv, D)
SHAPES = [
    ("B1 H16 D128", 1, 16, 16, 128),
    ("B8 H16 D128", 8, 16, 16, 128),
    ("B1 H32/8 D128", 1, 32, 8, 128),
    ("B8 H32/8 D128", 8, 32, 8, 128),
    # Beyond the table: head dim 64, and two query heads per KV head.
    ("B1 H32 D64", 1, 32, 32, 64),
    ("B8 H32 D64", 8, 32, 32, 64),
    ("B1 H32/16 D128", 1, 32, 16, 128),
    ("B8 H32/16 D128", 8, 32, 16, 128),
]
BACKWARD_FACTOR = bench_common.BACKWARD_FLOPS_FACTOR
ITERATIONS = bench_common.ITERATIONS


def packed_rows(batch: int, mean: int, seed: int = 0) -> np.ndarray:
  """int32 [batch, ROW] segment ids: documents of exponential lengths (at
  least 1 token), packed one after the other, the last cut at the row's end."""
  rng = np.random.default_rng(seed + mean)
  rows = []
  for _ in range(batch):
    ids, start, doc = np.empty(ROW, np.int32), 0, 0
    while start < ROW:
      length = max(1, int(rng.exponential(mean)))
      ids[start:start + length] = doc
      start, doc = start + length, doc + 1
    rows.append(ids)
  return np.stack(rows)


def document_starts(ids: np.ndarray) -> np.ndarray:
  """int32 [batch, ROW]: the first position of each token's document."""
  starts = np.zeros_like(ids)
  for b, row in enumerate(ids):
    new = np.concatenate([[True], row[1:] != row[:-1]])
    starts[b] = np.maximum.accumulate(np.where(new, np.arange(ROW), 0))
  return starts


def visible_pairs(ids: np.ndarray) -> int:
  """Causal pairs inside documents, summed over the batch."""
  total = 0
  for row in ids:
    _, counts = np.unique(row, return_counts=True)
    total += int((counts * (counts + 1) // 2).sum())
  return total


def implementations(ids, starts):
  """name -> (forward(q, k, v), whether it is packed)."""
  q_ids = jnp.asarray(ids)
  impls = {
      "packed": (lambda q, k, v: fa4_jax.attention(
          q, k, v, is_causal=True, query_segment_ids=q_ids, key_value_segment_ids=q_ids), True),
      "dense": (lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=True), False),
      "cudnn": (lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation="cudnn"), False),
  }
  try:
    from tokamax._src.ops.attention import base as tokamax_base
    from tokamax._src.ops.attention import pallas_mosaic_gpu as tokamax_gpu
  except ImportError as e:
    print("no tokamax:", repr(e)[:200], flush=True)
  else:
    op = tokamax_gpu.PallasMosaicGpuFlashAttention()
    mask = tokamax_base.Mask(k_start=jnp.asarray(starts)[:, None, :], is_causal=True)
    impls["tokamax"] = (lambda q, k, v: op(q, k, v, mask=mask), True)
  return impls


def run_shape(name, B, Hq, Hkv, D, rounds):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (B, ROW, Hq, D), jnp.bfloat16)
  k = jax.random.normal(keys[1], (B, ROW, Hkv, D), jnp.bfloat16)
  v = jax.random.normal(keys[2], (B, ROW, Hkv, D), jnp.bfloat16)
  do = jax.random.normal(keys[3], (B, ROW, Hq, D), jnp.bfloat16)
  dense_pairs = B * ROW * ROW / 2
  rows, dense_done = [], {}
  for mean in MEAN_DOCUMENTS:
    ids = packed_rows(B, mean)
    pairs = visible_pairs(ids)
    row = dict(case=f"{name} mean doc {mean}", B=B, S=ROW, Hq=Hq, Hkv=Hkv, D=D,
               mean_document=mean, documents=int(sum(len(np.unique(r)) for r in ids)),
               visible_pairs=pairs)
    impls, packed_impls = {}, set()
    for impl, (fwd, packed) in implementations(ids, document_starts(ids)).items():
      if packed:
        packed_impls.add(impl)
      if not packed and impl in dense_done:  # the dense rows do not depend on the packing
        row[impl] = dense_done[impl]
      else:
        impls[impl] = fwd
    flops = lambda impl: 4 * Hq * D * (pairs if impl in packed_impls else dense_pairs)
    for impl, result in bench_common.forward_backward_columns(impls, q, k, v, do, rounds,
                                                              flops).items():
      row[impl] = result
      if impl not in packed_impls and "error" not in result:
        dense_done[impl] = result
    print(json.dumps(row), flush=True)
    rows.append(row)
  return rows


def markdown(rows):
  lines = ["| case | docs | packed fwd ms (useful TFLOP/s) | tokamax fwd ms | dense fwd ms (TFLOP/s) "
           "| cuDNN dense fwd ms | packed bwd ms (useful TFLOP/s) | tokamax bwd ms "
           "| dense bwd ms (TFLOP/s) | cuDNN dense bwd ms |",
           "|---|---|---|---|---|---|---|---|---|---|"]

  def cell(r, p, with_rate):
    if r is None or "error" in r:
      return "-" if r is None else "error"
    ms = r[f"{p}_ms"]
    return f"{ms:.2f} ({r[f'{p}_tflops']:.0f})" if with_rate else f"{ms:.2f}"

  for r in rows:
    get = r.get
    lines.append(
        f"| {r['case']} | {r['documents']} | {cell(get('packed'), 'fwd', True)} | "
        f"{cell(get('tokamax'), 'fwd', False)} | {cell(get('dense'), 'fwd', True)} | "
        f"{cell(get('cudnn'), 'fwd', False)} | {cell(get('packed'), 'bwd', True)} | "
        f"{cell(get('tokamax'), 'bwd', False)} | {cell(get('dense'), 'bwd', True)} | "
        f"{cell(get('cudnn'), 'bwd', False)} |")
  return "\n".join(lines)


def main():
  bench_common.table_main(
      "packed", SHAPES, lambda shape, args: run_shape(*shape, args.rounds), markdown,
      lambda args: (f"forward: sum of kernel durations in a profiler trace, median of "
                    f"{ITERATIONS}; backward: kernel span in a profiler trace, median of "
                    f"{ITERATIONS}; median of {args.rounds} interleaved rounds; useful "
                    "FLOPs: visible pairs only (dense: S^2/2 per row), backward "
                    f"{BACKWARD_FACTOR}x forward"))


if __name__ == "__main__":
  main()
