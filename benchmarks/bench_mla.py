"""MLA decode (absorbed form): Hq query heads of 576 features against one
latent head whose first 512 features are the values, on one GPU.

Rows (bf16, scale 1/sqrt(192), every row's cache full but in `ragged` rows,
whose lengths are drawn between S / 16 and S; `paged`: pages of 64 tokens
at shuffled physical positions):

* memory-bound: B32-128, Hq 16, S 4k-32k, one new token;
* compute-bound: B64-128, Hq 128, one or two new tokens (two: bottom-right
  causal).

Columns, in one process:

* `default`: `fa4_jax.attention(q, k, None, value_head_dim=512)` or
  `fa4_jax.paged_attention(q, pages, None, ..., value_head_dim=512)` as they
  pick (`which_implementation` / `which_paged_implementation` in the row's
  `chosen`: the sm90 MLA decode kernel on a Hopper GPU);
* `xla`: the same call with `implementation="xla"`;
* `gqa decode`: our GQA decode arrangement (`sm90_decode`, the default
  path of `fa4_jax.attention`) on an MQA cache of one KV head at D 256,
  K and V 1024 bytes a token against the latent 1152: the same kind of
  bytes streamed by the kernel this library had before; its GB/s count its
  own bytes.

Figures: GB/s = the cache bytes a call must read (each row's keys once,
576 features; `gqa decode`: its K and V) / time; TFLOP/s = B x T x Hq x
keys x 2 x (576 + 512) / time (causal tokens count the keys they see;
ragged rows count their own keys, in bytes too).
Time: the sum of a call's kernel durations in a profiler trace (the split-K
combine included), median of `bench_common.ITERATIONS` calls, median of the
rounds (interleaved). Measured on an H100: docs/performance-notes.md, the MLA
sections, and `results/mla-*`.

Usage (GPU machine, repository root):
    python3 benchmarks/bench_mla.py [--only SUBSTRING] [--tag NAME] [--rounds N]
        [--configs waves8,...] [--layout both|contiguous|paged] [--no-xla] [--no-gqa]
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
from fa4_jax.kernels import sm90_mla_decode as mla  # noqa: E402

import bench_common  # noqa: E402

D, DV, PAGE = 576, 512, 64
SCALE = 192 ** -0.5
GQA_D = 256

# (name, B, T, Hq, S, paged, ragged): ragged rows hold between S / 16 and S
# keys each (fixed seed), the rest a full cache.
CASES = [
    (f"{bound} B{b} T{t} Hq{n} S{s // 1024}k{' paged' if paged else ''}", b, t, n, s, paged,
     False)
    for bound, rows in (("memory", [(32, 1, 16, 4096), (32, 1, 16, 32768), (64, 1, 16, 16384),
                                    (128, 1, 16, 4096), (128, 1, 16, 16384)]),
                        ("compute", [(64, 1, 128, 4096), (64, 2, 128, 4096), (64, 1, 128, 8192),
                                     (128, 1, 128, 8192), (128, 2, 128, 8192)]))
    for b, t, n, s in rows for paged in (False, True)
] + [
    (f"{bound} B{b} T1 Hq{n} S{s // 1024}k ragged{' paged' if paged else ''}", b, 1, n, s,
     paged, True)
    for bound, b, n, s in (("memory", 32, 16, 32768), ("compute", 128, 128, 8192))
    for paged in (False, True)
]


def row_lengths(b, s, ragged):
  """Keys per batch row: all S, or (ragged) drawn between S / 16 and S."""
  if not ragged:
    return np.full((b,), s, np.int32)
  return np.random.default_rng(1).integers(s // 16, s + 1, size=b).astype(np.int32)


def case_inputs(b, t, n, s, paged, ragged=False):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, n, D), jnp.bfloat16)
  latent = jax.random.normal(keys[1], (b, s, 1, D), jnp.bfloat16)
  lengths = jnp.asarray(row_lengths(b, s, ragged))
  table = None
  if paged:
    order = np.random.default_rng(0).permutation(b * s // PAGE)
    pool = jnp.zeros((b * s // PAGE, PAGE, 1, D), jnp.bfloat16).at[order].set(
        latent.reshape(b * s // PAGE, PAGE, 1, D))
    latent, table = pool, jnp.asarray(order.reshape(b, s // PAGE), jnp.int32)
  return q, latent, table, lengths


def under_config(name, f):
  """f with `sm90_mla_decode.CONFIGS[name]` in force while it is traced."""
  def g(*args):
    with mla.use_config(name):
      return f(*args)
  return g


def implementations(t, paged, configs=(), xla=True):
  causal = dict(is_causal=t > 1, causal_alignment="bottom_right")
  if paged:
    call = lambda impl: (lambda q, pages, table, n: fa4_jax.paged_attention(
        q, pages, None, table, n, value_head_dim=DV, scale=SCALE, is_causal=t > 1,
        implementation=impl))
  else:
    call = lambda impl: (lambda q, k, table, n: fa4_jax.attention(
        q, k, None, value_head_dim=DV, scale=SCALE, key_value_seq_lengths=n,
        implementation=impl, **causal))
  out = {"default": call(None)}
  if xla:
    out["xla"] = call("xla")
  for name in configs:
    out[f"cfg {name}"] = under_config(name, call(None))
  return out


def gqa_inputs(b, t, n, s):
  keys = jax.random.split(jax.random.key(1), 3)
  return (jax.random.normal(keys[0], (b, t, n, GQA_D), jnp.bfloat16),
          jax.random.normal(keys[1], (b, s, 1, GQA_D), jnp.bfloat16),
          jax.random.normal(keys[2], (b, s, 1, GQA_D), jnp.bfloat16))


def visible_keys(lengths, t):
  """Keys the B x T queries see: each row's cache, its last T tokens causal."""
  return int(sum(int(n) - (t - 1 - i) for n in lengths for i in range(t)))


def run_case(name, b, t, n, s, paged, ragged, rounds, configs=(), xla=True, gqa=True):
  q, cache, table, lengths = case_inputs(b, t, n, s, paged, ragged)
  if paged:
    chosen = fa4_jax.which_paged_implementation(q, cache, None, table, lengths,
                                                value_head_dim=DV, scale=SCALE,
                                                is_causal=t > 1)
  else:
    chosen = fa4_jax.which_implementation(q, cache, None, value_head_dim=DV, scale=SCALE,
                                          key_value_seq_lengths=lengths, is_causal=t > 1,
                                          causal_alignment="bottom_right")
  nbytes = int(np.sum(row_lengths(b, s, ragged))) * D * 2
  flops = visible_keys(row_lengths(b, s, ragged), t) * n * 2 * (D + DV)
  row = dict(case=name, B=b, T=t, Hq=n, S=s, paged=paged, ragged=ragged, cache_bytes=nbytes,
             flops=flops, chosen=chosen)
  calls = {c: (f, (q, cache, table, lengths))
           for c, f in implementations(t, paged, configs, xla).items()}
  row.update(bench_common.bandwidth_columns(calls, rounds, nbytes, "xla" if xla else "default"))
  for c in configs:
    with mla.use_config(c):
      row[f"cfg {c} plan"] = str(mla.choose_plan((b, t, n, D), (b, s, 1, D), ragged=True,
                                                 page_size=PAGE if paged else None))
  if gqa and not ragged:  # our GQA decode reading K and V of the same bytes
    gq, gk, gv = gqa_inputs(b, t, n, s)
    gqa_bytes = 2 * b * s * GQA_D * 2
    row.update(bench_common.bandwidth_columns(
        {"gqa decode": (lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=t > 1,
                                                          causal_alignment="bottom_right"),
                        (gq, gk, gv))}, rounds, gqa_bytes, "gqa decode"))
    row["gqa_decode_chosen"] = fa4_jax.which_implementation(gq, gk, gv, is_causal=t > 1,
                                                            causal_alignment="bottom_right")
  for column in [*calls, "gqa decode"]:
    result = row.get(column)
    if isinstance(result, dict) and "ms" in result:
      result["gb_per_s"] = result["tb_per_s"] * 1e3
      if column != "gqa decode":
        result["tflops"] = flops / result["ms"] / 1e9
  print(json.dumps(row), flush=True)
  return row


def markdown(rows):
  columns = ["default", "xla"] + sorted({c for r in rows for c in r
                                         if c.startswith("cfg ") and not c.endswith(" plan")})
  columns += ["gqa decode"]
  head = " | ".join(f"{c} GB/s | {c} TFLOP/s" if c != "gqa decode" else f"{c} GB/s"
                    for c in columns)
  lines = [f"| case | chosen | {head} |", "|" + "---|" * (2 + 2 * len(columns) - 1)]
  for r in rows:
    cells = []
    for c in columns:
      cells.append(bench_common.table_cell(r.get(c), lambda x: f"{x['gb_per_s']:.0f}"))
      if c != "gqa decode":
        cells.append(bench_common.table_cell(r.get(c), lambda x: f"{x['tflops']:.0f}"))
    lines.append(f"| {r['case']} | {r['chosen']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main():
  bench_common.table_main(
      "mla", CASES, lambda case, args: [run_case(
          *case, args.rounds, [c for c in args.configs.split(",") if c], not args.no_xla,
          not args.no_gqa)] if args.layout in ("both", ("paged" if case[5] else "contiguous"))
      else [], markdown,
      lambda args: ("sum of kernel durations in a profiler trace, median of "
                    f"{bench_common.ITERATIONS}, median of {args.rounds} rounds; GB/s = latent "
                    "cache bytes read once / time; TFLOP/s = 2 x (576 + 512) per visible "
                    "(query head, key) pair / time; bf16"), add_arguments=_arguments)


def _arguments(ap):
  ap.add_argument("--configs", default="",
                  help="comma-separated sm90_mla_decode.CONFIGS names: a column each")
  ap.add_argument("--layout", choices=("both", "contiguous", "paged"), default="both",
                  help="which rows of the selected cases: contiguous, paged or both")
  ap.add_argument("--no-xla", action="store_true", help="no XLA column")
  ap.add_argument("--no-gqa", action="store_true", help="no GQA decode column")


if __name__ == "__main__":
  main()
