"""Decode: a few query tokens against a long KV cache, on one GPU.

Memory-bound: the figure of merit is the K/V bytes read once divided by the
kernel time (TB/s; the H100 SXM's HBM3 peaks near 3.35). Rows are issue #27's
(bf16, D128, GQA 32/8, a full cache, no mask). Columns, in one process:

* `default`: `fa4_jax.attention` as it picks (`which_implementation` in
  the row's `chosen`);
* `kernel`: the sm90 forward kernel in its usual arrangement (one CTA per
  query head and tile);
* `decode`: `fa4_jax.kernels.sm90_decode` as `sm90_decode.plan` plans it
  (query heads packed as rows, the cache in chunks combined in XLA, the
  grid), also above its row limit (then its splits only);
* `decode pN`: the same with N chunks and one CTA per item (`--splits`);
* `cudnn`, `xla`: `jax.nn.dot_product_attention`;
* `tokamax`: tokamax 0.0.17's Mosaic GPU attention, where installed.

Time: the sum of a call's kernel durations in a profiler trace (CUPTI
underneath; the decode columns include their combine), median of
`bench_common.ITERATIONS` calls, then median of the rounds (interleaved).

Usage (GPU machine, repository root):
    python3 benchmarks/bench_decode.py [--only SUBSTRING] [--tag NAME] [--rounds N] [--splits 1,4,16]
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
from fa4_jax.kernels import sm90_decode, sm90_forward  # noqa: E402
from fa4_jax.scores import MaskSpec, ScoreFunction  # noqa: E402

import bench_common  # noqa: E402

# (name, B, T, S, Hq, Hkv, D, ragged): `ragged` draws each row's cache
# length uniformly from [S/16, S] (fixed seed), passed as key_value_seq_lengths.
CASES = [
    ("B8 T1 S32768", 8, 1, 32768, 32, 8, 128, False),
    ("B64 T1 S4096", 64, 1, 4096, 32, 8, 128, False),
    ("B1 T1 S131072", 1, 1, 131072, 32, 8, 128, False),
    ("B8 T16 S32768", 8, 16, 32768, 32, 8, 128, False),
    ("B8 T32 S32768", 8, 32, 32768, 32, 8, 128, False),
    ("B8 T64 S32768", 8, 64, 32768, 32, 8, 128, False),
    ("B8 T128 S8192", 8, 128, 8192, 32, 8, 128, False),
    ("B32 T1 S16384 ragged", 32, 1, 16384, 32, 8, 128, True),
    ("B8 T1 S32768 H8/1 D64", 8, 1, 32768, 8, 1, 64, False),
    ("B32 T1 S8192", 32, 1, 8192, 32, 8, 128, False),
    ("B128 T1 S2048", 128, 1, 2048, 32, 8, 128, False),
    ("B8 T1 S32768 D64", 8, 1, 32768, 32, 8, 64, False),
    ("B8 T1 S32768 D256", 8, 1, 32768, 32, 8, 256, False),
]


def planned(q_shape, k_shape, ragged):
  """`sm90_decode.plan`'s plan (splits, grid), or its splits alone for rows
  above its limit."""
  return (sm90_decode.plan(q_shape, k_shape, MaskSpec(), ragged=ragged)
          or sm90_decode.DecodePlan(sm90_decode.choose_splits(q_shape[0], k_shape[2], k_shape[1],
                                                              ragged=ragged)))


def implementations(splits, scale, kv_lengths):
  lengths = {} if kv_lengths is None else dict(key_value_seq_lengths=kv_lengths)
  impls = {
      "default": lambda q, k, v: fa4_jax.attention(q, k, v, **lengths),
      "kernel": lambda q, k, v: sm90_forward.forward(q, k, v, None, kv_lengths,
                                                     score=ScoreFunction(scale),
                                                     mask=MaskSpec())[0],
      "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn",
                                                            **lengths),
      "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla",
                                                          **lengths),
  }
  plans = {"decode": None} | {f"decode p{p}": p for p in splits}
  for label, p in plans.items():
    def run(q, k, v, p=p):
      chosen = sm90_decode.DecodePlan(p) if p is not None else planned(q.shape, k.shape,
                                                                       kv_lengths is not None)
      return sm90_decode.forward(q, k, v, None, kv_lengths, score=ScoreFunction(scale),
                                 mask=MaskSpec(), plan=chosen)[0]
    impls[label] = run
  try:
    from tokamax._src.ops.attention import pallas_mosaic_gpu as tokamax_gpu
  except ImportError as e:
    print("no tokamax:", repr(e)[:200], flush=True)
  else:
    op = tokamax_gpu.PallasMosaicGpuFlashAttention()
    if kv_lengths is None:
      impls["tokamax"] = lambda q, k, v: op(q, k, v)
  return impls


def case_inputs(B, T, S, Hq, Hkv, D, ragged):
  """(q, k, v, key lengths or None, the K and V bytes a call must read) of a case."""
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (B, T, Hq, D), jnp.bfloat16)
  k = jax.random.normal(keys[1], (B, S, Hkv, D), jnp.bfloat16)
  v = jax.random.normal(keys[2], (B, S, Hkv, D), jnp.bfloat16)
  kv_lengths = None
  if ragged:
    kv_lengths = jnp.asarray(np.random.default_rng(0).integers(S // 16, S + 1, size=B), jnp.int32)
  return q, k, v, kv_lengths, kv_bytes_read(k, kv_lengths)


def kv_bytes_read(k, kv_lengths):
  """The K and V bytes a call must read: each row's first kv_lengths keys (all without)."""
  B, S, Hkv, D = k.shape
  valid_keys = B * S if kv_lengths is None else int(kv_lengths.sum())
  return 2 * valid_keys * Hkv * D * k.dtype.itemsize


def run_case(name, B, T, S, Hq, Hkv, D, ragged, splits, rounds):
  q, k, v, kv_lengths, kv_bytes = case_inputs(B, T, S, Hq, Hkv, D, ragged)
  row = dict(case=name, B=B, T=T, S=S, Hq=Hq, Hkv=Hkv, D=D, kv_bytes=kv_bytes,
             chosen=fa4_jax.which_implementation(
                 q, k, v, **({} if kv_lengths is None else dict(key_value_seq_lengths=kv_lengths))),
             splits=planned((B, T, Hq, D), (B, S, Hkv, D), ragged).splits)
  columns = implementations([p for p in splits if S % p == 0], D ** -0.5, kv_lengths)
  row.update(bench_common.bandwidth_columns(
      {column: (f, (q, k, v)) for column, f in columns.items()}, rounds, kv_bytes, "xla"))
  print(json.dumps(row), flush=True)
  return row


def markdown(rows):
  columns = sorted({c for r in rows for c in r if isinstance(r[c], dict)})
  lines = ["| case | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 1)]
  for r in rows:
    cells = [bench_common.table_cell(r.get(c), lambda x: f"{x['tb_per_s']:.2f}")
             for c in columns]
    lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main():
  def rows_of(case, args):
    return [run_case(*case, [int(x) for x in args.splits.split(",")], args.rounds)]

  bench_common.table_main(
      "decode", CASES, rows_of, markdown,
      lambda args: ("sum of kernel durations in a profiler trace, median of "
                    f"{bench_common.ITERATIONS}, median of {args.rounds} rounds; "
                    "TB/s = K and V bytes read once / time; bf16"),
      add_arguments=lambda ap: ap.add_argument("--splits", default="1,2,4,8,16"))


if __name__ == "__main__":
  main()
