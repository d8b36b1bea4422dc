"""Decode choices per device kind: sweep the candidates, then check the default.

Two modes, one process each, cuDNN and the XLA path in the same process
(bf16, one query token, full caches, no mask; TB/s = K and V bytes read
once / the sum of a call's kernel durations in a profiler trace, CUPTI
underneath, median of `bench_common.ITERATIONS` calls, median of the
interleaved rounds):

* `--mode sweep`: per row, the decode arrangement with each candidate
  (chunks of the cache, one CTA per item or a persistent grid of N CTAs,
  K/V ring stages) beside `plan` (what `sm90_decode.plan` picks here),
  `default` (`fa4_jax.attention`), cuDNN and XLA. The winners become rules in
  `fa4_jax/kernels/device_tables.py`.
* `--mode final`: `default`, `plan`, cuDNN and XLA on the same rows.
  `--timer cupti` times with CUPTI's own sum (`profiler.measure`, as issue
  #54 quoted) instead of traces; the two cannot share a process (CUPTI then
  reports dropped activity records), so each is its own run.

Usage (GPU machine, repository root):
    python3 benchmarks/bench_decode_tuning.py --mode sweep [--rounds 3] [--budget-s 420]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fa4_jax  # noqa: E402
from fa4_jax.kernels import device_tables, sm90_decode, sm90_forward  # noqa: E402
from fa4_jax.scores import MaskSpec, ScoreFunction  # noqa: E402

import bench_common  # noqa: E402

# (name, B, S, Hq, Hkv, D, candidates): a candidate is (splits, grid, stages[,
# consumers]): grid "item" = one CTA per item, an int = a persistent grid of
# that many CTAs (two Q tiles per consumer where SMEM allows); consumers: the
# consumer warpgroups of a CTA (default: the kernel's choice for the head dim;
# 1 takes 64 rows, without ping-pong).
ROWS = [
    ("B16 S16384 H8/1 D64", 16, 16384, 8, 1, 64,
     [(8, "item", 2), (8, "item", 4), (8, 128, 4), (16, 128, 2), (16, 128, 4), (16, "item", 4),
      (32, 128, 4), (8, "item", 4, 1), (16, 128, 4, 1)]),
    ("B64 S1024 H8/2 D64", 64, 1024, 8, 2, 64,
     [(1, "item", 2), (1, "item", 4), (1, 128, 4), (2, 128, 2), (2, 128, 4), (2, "item", 4),
      (4, 128, 4), (1, "item", 4, 1), (2, 128, 4, 1)]),
    ("B8 S32768 H32/8 D64", 8, 32768, 32, 8, 64,
     [(2, "item", 3), (2, "item", 4), (2, "item", 6), (4, 128, 4), (4, "item", 4),
      (2, "item", 4, 1), (2, "item", 6, 1)]),
    ("B1 S131072 H32/8 D128", 1, 131072, 32, 8, 128,
     [(8, "item", 2), (16, "item", 3), (32, "item", 2), (32, "item", 3), (32, 128, 2),
      (64, 128, 2), (16, "item", 3, 1), (16, "item", 4, 1)]),
    ("B8 S32768 H32/8 D128", 8, 32768, 32, 8, 128,
     [(2, "item", 3), (4, 128, 2), (4, "item", 2), (4, "item", 3)]),
    ("B64 S4096 H32/8 D128", 64, 4096, 32, 8, 128,
     [(1, 128, 2), (1, 64, 2), (1, "item", 2), (1, "item", 3), (2, 128, 2)]),
    ("B32 S8192 H32/8 D128", 32, 8192, 32, 8, 128,
     [(1, 128, 2), (1, 64, 2), (1, "item", 2), (1, "item", 3), (2, 128, 2)]),
    # Rows of bench_decode.py whose plan the tables could change.
    ("B8 S32768 H8/1 D64", 8, 32768, 8, 1, 64, []),
    ("B128 S2048 H32/8 D128", 128, 2048, 32, 8, 128, []),
]


def candidate_config(d, chunk, rows, grid, stages, consumers=None):
  """The kernel config of a candidate, or None where it does not fit SMEM."""
  base = sm90_forward.choose_config(d, MaskSpec(), kv_seq=chunk, q_seq=rows)
  base = dataclasses.replace(base, persistent=False, work_queue=False, q_buffers=1, num_sms=0,
                             num_kv_stages=stages)
  if consumers is not None and consumers != base.num_consumers:
    base = dataclasses.replace(base, num_consumers=consumers, pingpong=consumers == 2,
                               producer_registers=24, consumer_registers=224)
  if grid != "item":
    base = dataclasses.replace(base, persistent=True, num_sms=grid, q_buffers=2)
    if not base.fits_smem(sm90_forward.padded_head_dim(d), 2):
      base = dataclasses.replace(base, q_buffers=1)
  return base if base.fits_smem(sm90_forward.padded_head_dim(d), 2) else None


def columns_of(row, mode):
  name, B, S, Hq, Hkv, D, candidates = row
  scale = D ** -0.5

  def with_plan(p):
    return lambda q, k, v: sm90_decode.forward(q, k, v, None, None, score=ScoreFunction(scale),
                                               mask=MaskSpec(), plan=p)[0]

  cols = {
      "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"),
      "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"),
      "plan": lambda q, k, v: sm90_decode.forward(
          q, k, v, None, None, score=ScoreFunction(scale), mask=MaskSpec(),
          plan=sm90_decode.plan(q.shape, k.shape, MaskSpec()))[0],
  }
  if mode == "final":
    cols["default"] = lambda q, k, v: fa4_jax.attention(q, k, v)
    # The plan before the tables named this kind: the generic rules.
    cols["before"] = lambda q, k, v: sm90_decode.forward(
        q, k, v, None, None, score=ScoreFunction(scale), mask=MaskSpec(),
        plan=sm90_decode.plan(q.shape, k.shape, MaskSpec(),
                              choices=device_tables.GENERIC_DECODE))[0]
  else:
    rows = Hq // Hkv
    for splits, grid, stages, *consumers in candidates:
      if S % splits:
        continue
      config = candidate_config(D, S // splits, rows, grid, stages, *consumers)
      if config is None:
        print("skip (SMEM)", name, splits, grid, stages, flush=True)
        continue
      label = (f"p{splits} {'item' if grid == 'item' else f'grid{grid}'} s{stages}"
               + (f" c{consumers[0]}" if consumers else ""))
      cols[label] = with_plan(sm90_decode.DecodePlan(splits, config))
  return cols


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--mode", choices=("sweep", "final"), default="sweep")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--budget-s", type=float, default=420.0,
                  help="skip the rows left once this many seconds have passed")
  ap.add_argument("--timer", choices=("trace", "cupti"), default="trace")
  ap.add_argument("--tag", default="")
  ap.add_argument("--only", action="append", default=None)
  args = ap.parse_args()
  t0 = time.time()
  device = jax.devices()[0]
  print(device.device_kind, jax.__version__, flush=True)
  out = []
  tag = args.tag + ("-cupti" if args.timer == "cupti" else "")
  timer = bench_common.kernel_ms if args.timer == "cupti" else bench_common.kernel_sum_ms
  method = ("CUPTI kernel time (profiler.measure), median of" if args.timer == "cupti" else
            "sum of kernel durations in a profiler trace (CUPTI), median of")
  path = bench_common.result_path(f"decode-{args.mode}", device.device_kind, tag)
  for row in ROWS:
    name, B, S, Hq, Hkv, D, _ = row
    if args.only and not any(o in name for o in args.only):
      continue
    if time.time() - t0 > args.budget_s:
      print("out of time, skipped", name, flush=True)
      continue
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, 1, Hq, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, S, Hkv, D), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, S, Hkv, D), jnp.bfloat16)
    nbytes = 2 * B * S * Hkv * D * 2
    p = sm90_decode.plan(q.shape, k.shape, MaskSpec())
    result = dict(case=name, B=B, T=1, S=S, Hq=Hq, Hkv=Hkv, D=D, kv_bytes=nbytes,
                  chosen=fa4_jax.which_implementation(q, k, v),
                  planned=None if p is None else dict(splits=p.splits, config=None if p.config is None
                                                   else dataclasses.asdict(p.config)))
    cols = columns_of(row, args.mode)
    result.update(bench_common.bandwidth_columns(
        {c: (f, (q, k, v)) for c, f in cols.items()}, args.rounds, nbytes, "xla", timer))
    out.append(result)
    summary = {c: (round(r["tb_per_s"], 3) if "tb_per_s" in r else r.get("error", "?")[:80])
               for c, r in result.items() if isinstance(r, dict) and c != "planned"}
    print(json.dumps(dict(case=name, splits=result["planned"] and result["planned"]["splits"],
                          **summary)), flush=True)
    bench_common.write_results(f"decode-{args.mode}", device.device_kind, tag,
                               f"{method} {bench_common.ITERATIONS} calls, median of {args.rounds} interleaved "
                               "rounds; TB/s = K and V bytes read once / time; bf16, T=1",
                               out, path=path)
    del q, k, v
  print(f"total {time.time() - t0:.0f} s", flush=True)
  for r in out:
    best = max(((c, x["tb_per_s"]) for c, x in r.items()
                if isinstance(x, dict) and "tb_per_s" in x and c not in ("cudnn", "xla")),
               key=lambda t: t[1])
    cudnn = r.get("cudnn", {}).get("tb_per_s", float("nan"))
    print(f"{r['case']:24s} plan {r['plan'].get('tb_per_s', float('nan')):.3f} "
          f"default {r.get('default', {}).get('tb_per_s', float('nan')):.3f} "
          f"cudnn {cudnn:.3f} xla {r['xla'].get('tb_per_s', float('nan')):.3f} "
          f"best {best[0]} {best[1]:.3f}", flush=True)


if __name__ == "__main__":
  main()
