"""Paged decode: one new token per row against a paged KV cache, on one GPU.

Rows are issue #27's serving shapes (bf16, D128, GQA 32/8, T = 1): the cache
is a pool of pages [num_pages, page_size, Hkv, D] (vLLM / FlashInfer
layout) whose pages are placed at shuffled physical positions, each row's
listed in its page table. Columns, in one process:

* `paged`: `fa4_jax.paged_attention` as it picks (`which_paged_implementation`
  in the row's `chosen`: the sm90 kernel reading through the page table on
  a Hopper GPU);
* `paged xla`: `paged_attention(implementation="xla")` (gathers the pages,
  then the XLA attention);
* `contiguous`: the same cache gathered into [B, S, Hkv, D] beforehand
  (outside the timing), through `fa4_jax.attention(key_value_seq_lengths=)`
  (the decode arrangement: `contiguous_chosen`): what paging costs;
* `tokamax`: tokamax 0.0.17's Mosaic GPU attention with `paging_info`,
  where installed (0.0.17 raises NotImplementedError for paging on Mosaic
  GPU; the row then records the error).

Time: the sum of a call's kernel durations in a profiler trace (CUPTI
underneath; every kernel of a call: the combine of chunks, the page table's
padding, the XLA gather), median of `bench_common.ITERATIONS` calls, then
median of the rounds (interleaved). TB/s = K and V bytes of the valid keys
(read once) / time.

Usage (GPU machine, repository root):
    python3 benchmarks/bench_paged.py [--only SUBSTRING] [--tag NAME] [--rounds N]
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
from fa4_jax import paged  # noqa: E402
from fa4_jax.kernels import sm90_decode  # noqa: E402

import bench_common  # noqa: E402
from bench_decode import markdown  # noqa: E402

# (name, B, S, page_size, ragged); Hq 32, Hkv 8, D 128, T 1. `ragged` draws
# each row's length uniformly from [S/16, S] (fixed seed); else every row is full.
CASES = [
    ("B8 S32768 page16", 8, 32768, 16, False),
    ("B8 S32768 page64", 8, 32768, 64, False),
    ("B64 S4096 page16", 64, 4096, 16, False),
    ("B64 S4096 page64", 64, 4096, 64, False),
    ("B32 S16384 page16 ragged", 32, 16384, 16, True),
]
HQ, HKV, D = 32, 8, 128


def paged_cache(B, S, page_size, ragged):
  """(q, key_pages, value_pages, page_table, lengths): every row's pages at
  shuffled places of one pool."""
  keys = jax.random.split(jax.random.key(0), 3)
  rng = np.random.default_rng(0)
  max_pages = S // page_size
  num_pages = B * max_pages
  q = jax.random.normal(keys[0], (B, 1, HQ, D), jnp.bfloat16)
  key_pages = jax.random.normal(keys[1], (num_pages, page_size, HKV, D), jnp.bfloat16)
  value_pages = jax.random.normal(keys[2], (num_pages, page_size, HKV, D), jnp.bfloat16)
  table = jnp.asarray(rng.permutation(num_pages).reshape(B, max_pages), jnp.int32)
  lengths = (rng.integers(S // 16, S + 1, size=B) if ragged else np.full((B,), S))
  return q, key_pages, value_pages, table, jnp.asarray(lengths, jnp.int32)


def tokamax_paged(page_size):
  """tokamax's Mosaic GPU attention with `paging_info`, or None if not installed."""
  try:
    from tokamax._src.ops.attention import base
    from tokamax._src.ops.attention import pallas_mosaic_gpu as tokamax_gpu
  except ImportError as e:
    print("no tokamax:", repr(e)[:200], flush=True)
    return None
  op = tokamax_gpu.PallasMosaicGpuFlashAttention()

  def run(q, key_pages, value_pages, table, lengths):
    # PagingInfo: pages each row attends to, their indices, valid tokens per physical page.
    active = -(-lengths // page_size)
    per_page = jnp.clip(lengths[:, None] - jnp.arange(table.shape[1])[None, :] * page_size, 0,
                        page_size)
    page_lengths = jnp.zeros((key_pages.shape[0],), jnp.int32).at[table].set(per_page)
    info = base.PagingInfo(num_active_pages=active, active_page_indices=table,
                           lengths=page_lengths)
    return op(q, key_pages, value_pages, paging_info=info)
  return run


def columns(page_size):
  contiguous = jax.jit(lambda pages, table: paged.gather_pages(pages, table))
  impls = {
      "paged": (lambda q, kp, vp, t, n: fa4_jax.paged_attention(q, kp, vp, t, n), "paged"),
      "paged xla": (lambda q, kp, vp, t, n: fa4_jax.paged_attention(
          q, kp, vp, t, n, implementation="xla"), "paged"),
      "contiguous": (lambda q, k, v, n: fa4_jax.attention(q, k, v, key_value_seq_lengths=n),
                     "contiguous"),
  }
  tokamax = tokamax_paged(page_size)
  if tokamax is not None:
    impls["tokamax"] = (tokamax, "paged")
  return impls, contiguous


def run_case(name, B, S, page_size, ragged, rounds):
  q, kp, vp, table, lengths = paged_cache(B, S, page_size, ragged)
  impls, contiguous = columns(page_size)
  k, v = contiguous(kp, table), contiguous(vp, table)
  inputs = {"paged": (q, kp, vp, table, lengths), "contiguous": (q, k, v, lengths)}
  kv_bytes = 2 * int(lengths.sum()) * HKV * D * 2
  row = dict(case=name, B=B, T=1, S=S, Hq=HQ, Hkv=HKV, D=D, page_size=page_size,
             kv_bytes=kv_bytes, chosen=fa4_jax.which_paged_implementation(*inputs["paged"]),
             contiguous_chosen=fa4_jax.which_implementation(q, k, v,
                                                            key_value_seq_lengths=lengths),
             splits=sm90_decode.choose_splits(B, HKV, S, ragged=True, granule=page_size))
  row.update(bench_common.bandwidth_columns(
      {column: (f, inputs[layout]) for column, (f, layout) in impls.items()}, rounds, kv_bytes,
      "paged xla"))
  print(json.dumps(row), flush=True)
  return row


def main():
  bench_common.table_main(
      "paged", CASES, lambda case, args: [run_case(*case, args.rounds)], markdown,
      lambda args: ("sum of kernel durations in a profiler trace, median of "
                    f"{bench_common.ITERATIONS}, median of {args.rounds} rounds; "
                    "TB/s = K and V bytes of the valid keys read once / time; bf16; "
                    "pages shuffled in the pool"))


if __name__ == "__main__":
  main()
