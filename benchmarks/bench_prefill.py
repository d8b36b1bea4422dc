"""Chunked prefill and sliding windows against a KV cache, on one GPU.

The queries are the last T tokens of each row's context
(`causal_alignment="bottom_right"`): with per-row cache lengths each row's
band sits at its own offset (kv_len - T), which the kernels read per row.
Before issue #27's per-row alignment these calls ran on the XLA path with
an explicit mask. Rows: bf16, D128, GQA 32/8; "ragged" draws each row's
cache length uniformly from [T, S] (fixed seed). Columns, in one process:

* `default`: `fa4_jax.attention` as it picks (`chosen` in the row);
* `static shift`: the same call without lengths (every row's cache full, a
  fixed shift the kernels knew before): on a full cache the same work, so
  the per-row alignment's cost is `default` against it;
* `xla`: `implementation="xla"` (its blockwise path, per-row bands);
* `explicit mask`: what a user ran before: the band as a boolean mask
  (the XLA path);
* paged rows: `fa4_jax.paged_attention` (default: the sm90 forward through
  the page table; `xla`: pages gathered) — forward only, a serving op.

jax.nn (cuDNN) and tokamax have no bottom-right alignment with per-row
lengths, so they have no column. TFLOP/s count only the visible pairs
(4 * D flops each in the forward). Time: kernel-duration sums in profiler
traces (`bench_common.forward_backward_columns` / `bandwidth_columns`),
median of interleaved rounds.

Usage (GPU machine, repository root):
    python3 benchmarks/bench_prefill.py [--only SUBSTRING] [--tag NAME] [--rounds N]
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

# (name, B, T, S, window_left or None, ragged, page_size or None)
CASES = [
    ("B4 T1024 S16384 full", 4, 1024, 16384, None, False, None),
    ("B4 T1024 S16384 ragged", 4, 1024, 16384, None, True, None),
    ("B2 T4096 S32768 ragged", 2, 4096, 32768, None, True, None),
    ("B8 T16 S32768 window 4096 ragged", 8, 16, 32768, 4096, True, None),
    ("paged B4 T1024 S16384 ragged, pages of 64", 4, 1024, 16384, None, True, 64),
]
HQ, HKV, D = 32, 8, 128


def visible_pairs(t, lengths, window_left):
  """Pairs (query, key) the bottom-right band shows, summed over rows."""
  pairs = 0
  for n in lengths:
    pos = np.arange(t) + n - t  # each query's position
    hi = np.clip(pos + 1, 0, n)
    lo = np.zeros_like(hi) if window_left is None else np.clip(pos - window_left, 0, n)
    pairs += int(np.maximum(hi - lo, 0).sum())
  return pairs


def explicit_band(t, s, lengths, window_left):
  """[B, 1, T, S] bool: the band a user had to build before."""
  pos = (lengths[:, None] - t + jnp.arange(t)[None, :])[:, None, :, None]
  j = jnp.arange(s)[None, None, None, :]
  band = j <= pos
  if window_left is not None:
    band = band & (j >= pos - window_left)
  return band


def run_case(name, b, t, s, window_left, ragged, page_size, rounds):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, HQ, D), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, s, HKV, D), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, s, HKV, D), jnp.bfloat16)
  do = jax.random.normal(keys[3], (b, t, HQ, D), jnp.bfloat16)
  lengths = (np.random.default_rng(0).integers(t, s + 1, size=b) if ragged
             else np.full(b, s))
  kv_len = jnp.asarray(lengths, jnp.int32)
  flops = 4 * D * HQ * visible_pairs(t, lengths, window_left)
  band = dict(is_causal=True, causal_alignment="bottom_right")
  if window_left is not None:
    band["local_window_size"] = (window_left, 0)
  row = dict(case=name, B=b, T=t, S=s, Hq=HQ, Hkv=HKV, D=D, window_left=window_left,
             lengths=[int(x) for x in lengths], fwd_flops=flops)
  if page_size is None:
    row["chosen"] = fa4_jax.which_implementation(q, k, v, key_value_seq_lengths=kv_len, **band)
    impls = {
        "default": lambda q, k, v: fa4_jax.attention(q, k, v, key_value_seq_lengths=kv_len,
                                                     **band),
        "xla": lambda q, k, v: fa4_jax.attention(q, k, v, key_value_seq_lengths=kv_len,
                                                 implementation="xla", **band),
        "explicit mask": lambda q, k, v: fa4_jax.attention(
            q, k, v, mask=explicit_band(t, s, kv_len, window_left),
            key_value_seq_lengths=kv_len),
    }
    if not ragged:
      impls["static shift"] = lambda q, k, v: fa4_jax.attention(q, k, v, **band)
    row.update(bench_common.forward_backward_columns(impls, q, k, v, do, rounds,
                                                     lambda column: flops))
  else:
    pages = s // page_size
    order = np.random.default_rng(1).permutation(b * pages)
    table = jnp.asarray(order.reshape(b, pages), jnp.int32)
    to_pages = lambda x: x.reshape(b * pages, page_size, HKV, D)[jnp.argsort(table.reshape(-1))]
    kp, vp = to_pages(k), to_pages(v)
    row["chosen"] = fa4_jax.which_paged_implementation(q, kp, vp, table, kv_len)
    calls = {impl: (lambda q, kp, vp, impl=impl: fa4_jax.paged_attention(
        q, kp, vp, table, kv_len, implementation=impl), (q, kp, vp)) for impl in (None, "xla")}
    calls = {("default" if impl is None else impl): c for impl, c in calls.items()}
    columns = bench_common.bandwidth_columns(calls, rounds, 1, "xla")
    for column in columns.values():  # compute-bound: report FLOP rates, not bytes
      if "ms" in column:
        column["fwd_ms"] = column.pop("ms")
        column["fwd_tflops"] = flops / column["fwd_ms"] / 1e9
        del column["tb_per_s"]
    row.update(columns)
  print(json.dumps(row), flush=True)
  return row


def markdown(rows):
  columns = ["default", "static shift", "xla", "explicit mask"]
  lines = ["| case | chosen | " + " | ".join(f"{c} fwd / bwd ms" for c in columns) + " |",
           "|" + "---|" * (len(columns) + 2)]
  for r in rows:
    fwd_bwd = lambda x: f"{x['fwd_ms']:.3f}" + (f" / {x['bwd_ms']:.3f}" if "bwd_ms" in x else "")
    cells = [bench_common.table_cell(r.get(c), fwd_bwd) for c in columns]
    lines.append(f"| {r['case']} | {r['chosen']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main():
  bench_common.table_main(
      "prefill", CASES, lambda case, args: [run_case(*case, args.rounds)], markdown,
      lambda args: ("sum of kernel durations in a profiler trace (backward: the VJP's "
                    f"kernel span), median of {bench_common.ITERATIONS}, median of "
                    f"{args.rounds} interleaved rounds; bf16; TFLOP/s over visible pairs"))


if __name__ == "__main__":
  main()
