"""The cost of attention sinks and logit soft-capping on one GPU.

Issue #26's bar: a call with `sinks=` or `logits_soft_cap=` takes within 3 %
of the same call without them (forward and backward), and soft-cap is ahead
of tokamax's soft-cap. cuDNN has neither option, so our plain call is the bar.

Shapes: B2 S8192 D128, H16 and GQA 32/8, dense and causal, bf16. Columns, in
one process, interleaved round by round (the card's clock drifts under its
power cap):

* `plain`: fa4_jax, the default implementation, no option;
* `sinks`: with `sinks=` (one logit per query head);
* `soft_cap`: with `logits_soft_cap=SOFT_CAP`;
* `both`: with both;
* `tokamax` / `tokamax_soft_cap`: tokamax 0.0.17's Mosaic GPU attention
  without and with the same soft-cap, where tokamax is installed.

Forward: the sum of a call's kernel durations in a profiler trace (CUPTI
underneath; a call with sinks includes whatever small XLA ops it runs).
Backward: the span of the VJP's kernels in a profiler trace, including the
sinks' gradient reduction. Medians of `bench_common.ITERATIONS` calls, then of
the rounds. TFLOP/s use the usual convention (causal: S^2/2 pairs per row;
backward 2.5x the forward's FLOPs).

Usage (GPU machine, repository root):
    python3 benchmarks/bench_options.py [--only SUBSTRING] [--tag NAME] [--rounds N]
Writes benchmarks/results/options[-NAME]-<device>-<date>.json (or $OUT/) and
prints a Markdown table.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fa4_jax  # noqa: E402

import bench_common  # noqa: E402

SEQ = 8192
SOFT_CAP = 50.0  # Gemma 2's attention logit cap
# (name, B, Hq, Hkv, D, causal)
CASES = [
    ("B2 H16 D128 dense", 2, 16, 16, 128, False),
    ("B2 H16 D128 causal", 2, 16, 16, 128, True),
    ("B2 H32/8 D128 dense", 2, 32, 8, 128, False),
    ("B2 H32/8 D128 causal", 2, 32, 8, 128, True),
]
COLUMNS = ("plain", "sinks", "soft_cap", "both", "tokamax", "tokamax_soft_cap")


def implementations(causal: bool, sinks):
  """column -> forward(q, k, v)."""
  ours = lambda **options: (lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=causal,
                                                              **options))
  impls = {
      "plain": ours(),
      "sinks": ours(sinks=sinks),
      "soft_cap": ours(logits_soft_cap=SOFT_CAP),
      "both": ours(sinks=sinks, logits_soft_cap=SOFT_CAP),
  }
  try:
    from tokamax._src.ops.attention import pallas_mosaic_gpu as tokamax_gpu
  except ImportError as e:
    print("no tokamax:", repr(e)[:200], flush=True)
  else:
    op = tokamax_gpu.PallasMosaicGpuFlashAttention()
    impls["tokamax"] = lambda q, k, v: op(q, k, v, is_causal=causal)
    impls["tokamax_soft_cap"] = lambda q, k, v: op(q, k, v, is_causal=causal,
                                                   logits_soft_cap=SOFT_CAP)
  return impls


def run_case(name, B, Hq, Hkv, D, causal, rounds):
  keys = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(keys[0], (B, SEQ, Hq, D), jnp.bfloat16)
  k = jax.random.normal(keys[1], (B, SEQ, Hkv, D), jnp.bfloat16)
  v = jax.random.normal(keys[2], (B, SEQ, Hkv, D), jnp.bfloat16)
  do = jax.random.normal(keys[3], (B, SEQ, Hq, D), jnp.bfloat16)
  sinks = jax.random.normal(keys[4], (Hq,), jnp.float32)
  flops = 4 * B * Hq * D * SEQ * SEQ / (2 if causal else 1)
  row = dict(case=name, B=B, S=SEQ, Hq=Hq, Hkv=Hkv, D=D, causal=causal, soft_cap=SOFT_CAP)
  impls = implementations(causal, sinks)
  row["chosen"] = {
      c: fa4_jax.which_implementation(q, k, v, is_causal=causal,
                                      **({"sinks": sinks} if c in ("sinks", "both") else {}),
                                      **({"logits_soft_cap": SOFT_CAP}
                                         if c in ("soft_cap", "both") else {}))
      for c in ("plain", "sinks", "soft_cap", "both")}
  row.update(bench_common.forward_backward_columns(impls, q, k, v, do, rounds, lambda _: flops))
  print(json.dumps(row), flush=True)
  return row


def markdown(rows):
  head = "| case | pass | " + " | ".join(COLUMNS) + " |"
  lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
  for r in rows:
    for p in ("fwd", "bwd"):
      plain = r.get("plain", {}).get(f"{p}_ms")

      def against_plain(x, c):
        ms = x[f"{p}_ms"]
        vs = f" ({100 * (ms / plain - 1):+.1f} %)" if plain and c != "plain" else ""
        return f"{ms:.3f}{vs}"

      cells = [bench_common.table_cell(r.get(c), lambda x, c=c: against_plain(x, c))
               for c in COLUMNS]
      lines.append(f"| {r['case']} | {p} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main():
  bench_common.table_main(
      "options", CASES, lambda case, args: [run_case(*case, args.rounds)], markdown,
      lambda args: (f"forward: sum of kernel durations in a profiler trace, median of "
                    f"{bench_common.ITERATIONS}; backward: kernel span of the VJP in a "
                    f"profiler trace, median of {bench_common.ITERATIONS}; median of "
                    f"{args.rounds} interleaved rounds; bf16; percentages against the plain "
                    "column"),
      default_rounds=3)


if __name__ == "__main__":
  main()
