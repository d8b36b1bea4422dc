"""Paged decode: the newest T tokens per row against a paged KV cache, on one GPU.

Rows are issue #27's serving shapes (bf16, D128, GQA 32/8, T = 1) and issue
#54's several new tokens (T = 4 ... 64: speculative decoding, short chunks
of a chunked prefill; T = 128, a chunk beyond the decode arrangement's 256
packed rows): the cache is a pool of pages [num_pages, page_size, Hkv, D]
(vLLM / FlashInfer layout) whose pages are placed at shuffled physical
positions, each row's listed in its page table. `paged_attention` is causal
(bottom-right: query t at position L - T + t), as by default. Columns, in
one process:

* `paged`: `fa4_jax.paged_attention` as it picks (`which_paged_implementation`
  in the row's `chosen`, and `arrangement`: "decode" for the decode
  arrangement of `fa4_jax.kernels.sm90_decode`, "forward" for the forward
  kernel itself, one CTA per query tile and head);
* `paged xla`: `paged_attention(implementation="xla")` (gathers the pages,
  then the XLA attention);
* `paged forward kernel` (T > 1): the sm90 forward kernel itself reading
  the pages with the bottom-right band, what T > 1 ran before issue #54;
* `contiguous`: the same cache gathered into [B, S, Hkv, D] beforehand
  (outside the timing), through `fa4_jax.attention(key_value_seq_lengths=)`
  (`contiguous_chosen`), causal bottom-right where T > 1: what paging costs;
* `contiguous not causal` (T > 1): the same without the band (the decode
  arrangement's band-free row, the reference of issue #54);
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
    python3 benchmarks/bench_paged.py --only "B8 T" --only "page128"   # issue #54's rows
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

import bench_common  # noqa: E402
from bench_decode import markdown  # noqa: E402

# (name, B, S, page_size, ragged[, T]); Hq 32, Hkv 8, D 128, T 1 unless
# named. `ragged` draws each row's length uniformly from [S/16, S] (fixed
# seed); else every row is full. The T > 1 rows: B8 S32768 at a few (T, page
# size) pairs of T 4-64 and pages of 16, 64 and 128 (every pair would take
# about twice the time), and one chunk of 128 tokens (512 packed rows: the
# forward kernel).
CASES = [
    ("B8 S32768 page16", 8, 32768, 16, False),
    ("B8 S32768 page64", 8, 32768, 64, False),
    ("B64 S4096 page16", 64, 4096, 16, False),
    ("B64 S4096 page64", 64, 4096, 64, False),
    ("B32 S16384 page16 ragged", 32, 16384, 16, True),
    ("B8 S32768 page128", 8, 32768, 128, False),
    ("B8 T4 S32768 page16", 8, 32768, 16, False, 4),
    ("B8 T16 S32768 page16", 8, 32768, 16, False, 16),
    ("B8 T16 S32768 page64", 8, 32768, 64, False, 16),
    ("B8 T16 S32768 page128", 8, 32768, 128, False, 16),
    ("B8 T32 S32768 page64", 8, 32768, 64, False, 32),
    ("B8 T64 S32768 page16", 8, 32768, 16, False, 64),
    ("B8 T64 S32768 page64", 8, 32768, 64, False, 64),
    ("B8 T128 S32768 page64 chunked prefill", 8, 32768, 64, False, 128),
]
HQ, HKV, D = 32, 8, 128


def paged_cache(B, S, page_size, ragged, T=1):
  """(q, key_pages, value_pages, page_table, lengths): every row's pages at
  shuffled places of one pool."""
  keys = jax.random.split(jax.random.key(0), 3)
  rng = np.random.default_rng(0)
  max_pages = S // page_size
  num_pages = B * max_pages
  q = jax.random.normal(keys[0], (B, T, HQ, D), jnp.bfloat16)
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


def paged_forward_kernel(q, key_pages, value_pages, table, lengths):
  """The sm90 forward kernel itself over the pages, causal bottom-right:
  what `paged_attention` ran for T > 1 before issue #54."""
  from fa4_jax.kernels import sm90_forward
  from fa4_jax.scores import MaskSpec, ScoreFunction

  q_lengths = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
  return sm90_forward.forward(q, key_pages, value_pages, q_lengths, lengths,
                              score=ScoreFunction(D ** -0.5),
                              mask=MaskSpec(right=0, offset_from_lengths=True),
                              page_table=table)[0]


def columns(page_size, T=1):
  contiguous = jax.jit(lambda pages, table: paged.gather_pages(pages, table))
  causal = dict(is_causal=True, causal_alignment="bottom_right") if T > 1 else {}
  impls = {
      "paged": (lambda q, kp, vp, t, n: fa4_jax.paged_attention(q, kp, vp, t, n), "paged"),
      "paged xla": (lambda q, kp, vp, t, n: fa4_jax.paged_attention(
          q, kp, vp, t, n, implementation="xla"), "paged"),
      "contiguous": (lambda q, k, v, n: fa4_jax.attention(q, k, v, key_value_seq_lengths=n,
                                                          **causal), "contiguous"),
  }
  if T > 1:
    impls["paged forward kernel"] = (paged_forward_kernel, "paged")
    impls["contiguous not causal"] = (
        lambda q, k, v, n: fa4_jax.attention(q, k, v, key_value_seq_lengths=n), "contiguous")
  tokamax = tokamax_paged(page_size) if T == 1 else None
  if tokamax is not None:
    impls["tokamax"] = (tokamax, "paged")
  return impls, contiguous


def decode_plan(q, kp, vp, table, lengths):
  """The decode plan `paged_attention` takes here, or None (the forward kernel)."""
  from fa4_jax import backends

  args = paged._validated(q, kp, vp, table, lengths, scale=None, is_causal=True, sinks=None,
                          logits_soft_cap=None, implementation=None, query_descale=None,
                          key_descale=None, value_descale=None, output_dtype=None,
                          value_head_dim=None, score_mod=None, mask_mod=None)
  return backends.paged_decode_plan(args)


def run_case(name, B, S, page_size, ragged, rounds, T=1):
  q, kp, vp, table, lengths = paged_cache(B, S, page_size, ragged, T)
  impls, contiguous = columns(page_size, T)
  k, v = contiguous(kp, table), contiguous(vp, table)
  inputs = {"paged": (q, kp, vp, table, lengths), "contiguous": (q, k, v, lengths)}
  kv_bytes = 2 * int(lengths.sum()) * HKV * D * 2
  plan = decode_plan(*inputs["paged"])
  causal = dict(is_causal=True, causal_alignment="bottom_right") if T > 1 else {}
  row = dict(case=name, B=B, T=T, S=S, Hq=HQ, Hkv=HKV, D=D, page_size=page_size,
             kv_bytes=kv_bytes, chosen=fa4_jax.which_paged_implementation(*inputs["paged"]),
             arrangement="forward" if plan is None else "decode",
             contiguous_chosen=fa4_jax.which_implementation(q, k, v,
                                                            key_value_seq_lengths=lengths,
                                                            **causal),
             splits=None if plan is None else plan.splits)
  row.update(bench_common.bandwidth_columns(
      {column: (f, inputs[layout]) for column, (f, layout) in impls.items()}, rounds, kv_bytes,
      "paged xla"))
  print(json.dumps(row), flush=True)
  return row


def main():
  bench_common.table_main(
      "paged", CASES, lambda case, args: [run_case(*case[:5], args.rounds, *case[5:])], markdown,
      lambda args: ("sum of kernel durations in a profiler trace, median of "
                    f"{bench_common.ITERATIONS}, median of {args.rounds} rounds; "
                    "TB/s = K and V bytes of the valid keys read once / time; bf16; "
                    "pages shuffled in the pool"))


if __name__ == "__main__":
  main()
