"""Decode with a score_mod / mask_mod, on one GPU: B8 T1 S32768 Hq32 Hkv8
D128 bf16, every row full (lengths given, as a server passes them).

Columns, contiguous cache (`fa4_jax.attention(key_value_seq_lengths=)`):
* `plain`: no mods (the decode arrangement);
* `alibi`: score_mod = s + slopes[head] * (kv - q), as chosen (the decode
  arrangement since mods run there);
* `alibi forward kernel`: the sm90 forward kernel itself with the same mods
  (one 64-row tile per head and token: what `attention` ran before);
* `alibi xla`: `implementation="xla"`;
* `alibi window`: ALiBi and a mask_mod keeping each row's last 4096 keys
  (7/8 of the key blocks EMPTY, skipped; bytes below are still the whole
  cache's).
Paged cache (pages of 64 at shuffled places, `paged_attention`): `plain`,
`alibi` (the kernel now), `alibi xla` (what ran before), `alibi window`.

Time: the sum of a call's kernel durations in a profiler trace
(`bench_common.kernel_sum_ms`: every kernel of a call, the combine of
chunks and the mask_mod's block classes included), median of
`bench_common.ITERATIONS` calls, median of `--rounds` rounds. TB/s: K and V
bytes of the valid keys / time.

Usage (GPU machine, repository root):
    python3 benchmarks/bench_decode_mods.py [--rounds N] [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fa4_jax  # noqa: E402
from fa4_jax import mod_functions  # noqa: E402
from fa4_jax.kernels import sm90_forward  # noqa: E402
from fa4_jax.scores import MaskSpec, ScoreFunction, Scores  # noqa: E402

import bench_common  # noqa: E402

B, T, S, HQ, HKV, D, PAGE = 8, 1, 32768, 32, 8, 128, 64
WINDOW = 4096
SLOPES = jnp.asarray([2.0 ** (-8.0 * (h + 1) / HQ) for h in range(HQ)], jnp.float32)


def alibi(s, b, h, q, kv):
  return s + SLOPES[h] * (kv - q).astype(jnp.float32)


def window_of(lengths):
  return lambda b, h, q, kv: kv >= lengths[b] - WINDOW


def forward_kernel_alibi(q, k, v, lengths):
  """The sm90 forward kernel itself with ALiBi (what ran before)."""
  score_mod, captured = mod_functions.trace(alibi, "score_mod")
  mods = Scores(score_mod=score_mod, score_captured=captured)
  return sm90_forward.forward(q, k, v, None, lengths, score=ScoreFunction(D ** -0.5),
                              mask=MaskSpec(), mods=mods)[0]


def inputs():
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (B, T, HQ, D), jnp.bfloat16)
  k = jax.random.normal(keys[1], (B, S, HKV, D), jnp.bfloat16)
  v = jax.random.normal(keys[2], (B, S, HKV, D), jnp.bfloat16)
  lengths = jnp.full((B,), S, jnp.int32)
  pages = B * S // PAGE
  order = np.random.default_rng(0).permutation(pages)
  table = jnp.asarray(order.reshape(B, S // PAGE), jnp.int32)
  # Page p of the pool holds the contiguous cache's page whose table entry is p.
  inverse = np.argsort(order)
  to_pages = lambda x: x.reshape(pages, PAGE, HKV, D)[jnp.asarray(inverse)]
  return q, k, v, lengths, to_pages(k), to_pages(v), table


def columns(lengths):
  window = window_of(lengths)
  contiguous = {
      "plain": lambda q, k, v, n: fa4_jax.attention(q, k, v, key_value_seq_lengths=n),
      "alibi": lambda q, k, v, n: fa4_jax.attention(q, k, v, key_value_seq_lengths=n,
                                                    score_mod=alibi),
      "alibi forward kernel": forward_kernel_alibi,
      "alibi xla": lambda q, k, v, n: fa4_jax.attention(q, k, v, key_value_seq_lengths=n,
                                                        score_mod=alibi, implementation="xla"),
      "alibi window": lambda q, k, v, n: fa4_jax.attention(
          q, k, v, key_value_seq_lengths=n, score_mod=alibi, mask_mod=window),
  }
  paged = {
      "plain": lambda q, kp, vp, t, n: fa4_jax.paged_attention(q, kp, vp, t, n),
      "alibi": lambda q, kp, vp, t, n: fa4_jax.paged_attention(q, kp, vp, t, n,
                                                               score_mod=alibi),
      "alibi xla": lambda q, kp, vp, t, n: fa4_jax.paged_attention(
          q, kp, vp, t, n, score_mod=alibi, implementation="xla"),
      "alibi window": lambda q, kp, vp, t, n: fa4_jax.paged_attention(
          q, kp, vp, t, n, score_mod=alibi, mask_mod=window),
  }
  return contiguous, paged


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", default=None, help="also write the rows here (JSON lines)")
  args = parser.parse_args()
  q, k, v, lengths, kp, vp, table = inputs()
  kv_bytes = 2 * int(lengths.sum()) * HKV * D * 2
  contiguous, paged = columns(lengths)
  cases = ([("contiguous", name, jax.jit(f), (q, k, v, lengths))
            for name, f in contiguous.items()]
           + [(f"paged {PAGE}", name, jax.jit(f), (q, kp, vp, table, lengths))
              for name, f in paged.items()])
  reference = {}
  times = {(layout, name): [] for layout, name, _, _ in cases}
  for layout, name, f, a in cases:  # compile, check against the XLA path
    out = np.asarray(f(*a), np.float32)
    reference.setdefault(layout, {})[name] = out
  for layout in reference:
    want = reference[layout]["alibi xla"]
    for name, out in reference[layout].items():
      if name.startswith("alibi") and name != "alibi window":
        err = float(np.max(np.abs(out - want)))
        print(f"{layout} {name}: max |out - xla| = {err:.4f}", flush=True)
  which = {
      "contiguous": {n: fa4_jax.which_implementation(q, k, v, key_value_seq_lengths=lengths,
                                                     **m)
                     for n, m in (("plain", {}), ("alibi", dict(score_mod=alibi)),
                                  ("alibi window", dict(score_mod=alibi,
                                                        mask_mod=window_of(lengths))))},
      f"paged {PAGE}": {n: fa4_jax.which_paged_implementation(q, kp, vp, table, lengths, **m)
                        for n, m in (("plain", {}), ("alibi", dict(score_mod=alibi)),
                                     ("alibi window", dict(score_mod=alibi,
                                                           mask_mod=window_of(lengths))))},
  }
  print("chosen:", json.dumps(which), flush=True)
  for _ in range(args.rounds):
    for layout, name, f, a in cases:
      times[(layout, name)].append(bench_common.kernel_sum_ms(f, *a))
  rows = []
  device = jax.devices()[0].device_kind
  for (layout, name), ts in times.items():
    ms = statistics.median(ts)
    row = dict(device=device, layout=layout, column=name, B=B, T=T, S=S, Hq=HQ, Hkv=HKV, D=D,
               ms=round(ms, 4), tb_s=round(kv_bytes / ms / 1e9, 3),
               chosen=which[layout].get(name), rounds=[round(t, 4) for t in ts])
    rows.append(row)
    print(json.dumps(row), flush=True)
  print(f"\n| layout | column | ms | TB/s | chosen |\n|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['layout']} | {r['column']} | {r['ms']:.3f} | {r['tb_s']:.2f} | "
          f"{r['chosen'] or ''} |")
  if args.out:
    with open(args.out, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
  main()
