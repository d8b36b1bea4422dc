"""What a packed call's kernels cost: a fixed part, and a cost per block walked.

Rows of 16k tokens cut into equal documents of L tokens (L = 128 ... 16384),
causal inside each, B1 H16 D128 bf16: every row launches the same grids,
only the blocks each CTA walks change with L. Each
kernel's time (median of `bench_common.ITERATIONS` calls in a profiler
trace) is fitted as `fixed + per_block * blocks` by least squares, where
`blocks` counts the blocks the CTAs' walks take (the kernels' own range
helpers, through `packed_tile_bound.walked_blocks`). `fixed` is what the
call pays whatever the documents: with one CTA per tile, each tile's loads
and stores that its walk does not hide. Then the same split for
`bench_packed.py`'s packings (`--packings`).

    python3 tools/packed_kernel_costs.py [--packings]   (GPU machine)

Writes packed-kernel-costs-<device>-<date>.json (`bench_common.write_results`)
and prints the fit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # fa4_jax
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))
sys.path.insert(0, HERE)
import bench_common  # noqa: E402
import bench_packed  # noqa: E402
import fa4_jax  # noqa: E402
from fa4_jax import scores  # noqa: E402
from fa4_jax.kernels import sm90_backward, sm90_forward  # noqa: E402
from packed_tile_bound import walked_blocks  # noqa: E402

ROW, HEADS, HEAD_DIM = bench_packed.ROW, 16, 128
DOCUMENT_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 16384)


def kernel_walks(ids) -> dict[str, int]:
  """Blocks walked by all CTAs of each kernel (a CTA's walk: the blocks its
  producer streams), over every head."""
  causal = scores.MaskSpec(right=0)
  fwd = sm90_forward.choose_config(HEAD_DIM, causal, ROW, ROW, segment_ids=True)
  bwd = sm90_backward.choose_config(HEAD_DIM, causal, segment_ids=True)
  tiles = {"forward": (fwd.block_q_cta, fwd.block_kv, False),
           "dq": (bwd.dq.num_consumers * bwd.dq.block_q, bwd.dq.block_kv, False),
           "dkdv": (bwd.dkv.num_consumers * bwd.dkv.block_kv, bwd.dkv.block_q, True)}
  return {name: HEADS * int(walked_blocks(ids, *tile).sum()) for name, tile in tiles.items()}


def kernel_times(ids, q, k, v, do) -> dict[str, float]:
  """us per kernel of one packed forward and its VJP ("xla": the small XLA
  kernels of both, summed)."""
  ids = jnp.asarray(ids)
  fwd = jax.jit(lambda q, k, v: fa4_jax.attention(
      q, k, v, is_causal=True, query_segment_ids=ids, key_value_segment_ids=ids))
  _, vjp = jax.vjp(fwd, q, k, v)
  bwd = jax.jit(lambda vjp, do: vjp(do))
  times = {"xla": 0.0}
  for f, args in ((fwd, (q, k, v)), (bwd, (vjp, do))):
    for name, _, duration in bench_common.kernel_medians(f, args)[1]:
      us = 1e3 * duration
      for role in ("forward", "dq", "dkdv"):
        if f"fa4_jax_sm90_{role}_" in name:
          times[role] = us
          break
      else:
        times["xla"] += us
  return times


def fit(rows, role):
  """(fixed us, per-block ns) of `role` by least squares over the rows."""
  blocks = np.array([r["blocks"][role] for r in rows], float)
  us = np.array([r["us"][role] for r in rows], float)
  per_block, fixed = np.polyfit(blocks, us, 1)
  return fixed, 1e3 * per_block


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--packings", action="store_true",
                  help="also bench_packed.py's B1 packings (mean 1k, 2k, 4k)")
  args = ap.parse_args()
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(key, (1, ROW, HEADS, HEAD_DIM), jnp.bfloat16)
                 for key in keys)
  equal = []
  for length in DOCUMENT_LENGTHS:
    ids = np.repeat(np.arange(ROW // length, dtype=np.int32), length)[None]
    row = dict(document=length, blocks=kernel_walks(ids), us=kernel_times(ids, q, k, v, do))
    print(json.dumps(row), flush=True)
    equal.append(row)
  fits = {}
  for role in ("forward", "dq", "dkdv"):
    fixed, per_block = fit(equal, role)
    fits[role] = dict(fixed_us=fixed, per_block_ns=per_block)
    print(f"{role}: {fixed:.1f} us + {per_block:.2f} ns per block walked", flush=True)
  packings = []
  if args.packings:
    for mean in bench_packed.MEAN_DOCUMENTS:
      ids = bench_packed.packed_rows(1, mean)
      row = dict(mean_document=mean, blocks=kernel_walks(ids), us=kernel_times(ids, q, k, v, do))
      row["fixed_share"] = {role: fits[role]["fixed_us"] / row["us"][role]
                            for role in ("forward", "dq", "dkdv")}
      print(json.dumps(row), flush=True)
      packings.append(row)
  bench_common.write_results(
      "packed-kernel-costs", jax.devices()[0].device_kind, "",
      (f"B1 S{ROW} H{HEADS} D{HEAD_DIM} bf16, causal inside documents; kernel durations in a "
       f"profiler trace, median of {bench_common.ITERATIONS} calls; fit: least squares of us "
       "against blocks walked over the equal-document rows"),
      equal, fit=fits, packings=packings)
  return 0


if __name__ == "__main__":
  sys.exit(main())
