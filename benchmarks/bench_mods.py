"""Programmable attention on the GPU: each variant as a `score_mod` / `mask_mod`
beside our plain call and beside the same variant as the peers express it.

Columns per variant (bf16, one process, forward: kernel-duration sum,
backward: the VJP's kernel span, in interleaved rounds; see
`bench_common.forward_backward_columns`):
* `fa4 plain`: fa4_jax.attention with the variant's built-in base (causal or
  dense): the speed the mod is measured against;
* `fa4 mod`: fa4_jax.attention with the variant as score_mod / mask_mod
  (mask_mods with a block mask made once outside the timed call);
* `cudnn`: jax.nn.dot_product_attention(implementation="cudnn") given the
  variant as an explicit bias or boolean mask;
* `tokamax`: tokamax.dot_product_attention(implementation="mosaic") with the
  same bias or mask (where tokamax is installed);
* `xla path`: fa4_jax.attention(implementation="xla") with the mod (the
  memory-linear fallback).
TFLOP/s count every pair the plain base computes (4·B·H·S²·D, halved when
causal); `visible` gives the share of pairs the variant lets through, so
`tflops / visible` is the rate per visible pair.

  python benchmarks/bench_mods.py [--only alibi] [--rounds 3] [--gqa]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_common  # noqa: E402
import fa4_jax  # noqa: E402

B, S, H, D = 2, int(os.environ.get("BENCH_MODS_SEQ", 8192)), 16, 128


def _positions():
  return jnp.arange(S)[:, None], jnp.arange(S)[None, :]


def _bucket(q_idx, kv_idx):
  rel = kv_idx - q_idx
  sign_part = jnp.where(rel > 0, 16, 0)
  dist = jnp.abs(rel)
  big = 8 + (jnp.log(jnp.maximum(dist, 1).astype(jnp.float32) / 8) / np.log(16) * 8
             ).astype(jnp.int32)
  return sign_part + jnp.where(dist < 8, dist, jnp.minimum(big, 15))


def variants(num_heads):
  """name -> (causal base, score_mod or None, mask_mod or None, explicit
  (bias or None, mask or None) builder)."""
  slopes = jnp.asarray([2.0 ** (-8 * (i + 1) / num_heads) for i in range(num_heads)])
  table = jnp.asarray(np.random.default_rng(0).normal(size=(num_heads, 32)) * 0.5, jnp.float32)
  rng = np.random.default_rng(1)
  sparse = {d: jnp.asarray(rng.random(64) < d) for d in (0.25, 0.5)}

  def alibi(s, b, h, q, k):
    return s - slopes[h] * (q - k).astype(jnp.float32)

  def relative(s, b, h, q, k):
    return s + table[h, _bucket(q, k)]

  def prefix_lm(b, h, q, k):
    return (k < 1024) | (k <= q)

  def chunked(b, h, q, k):
    return ((q // 2048) == (k // 2048)) & (k <= q)

  def window_global(b, h, q, k):
    return ((k <= q) & (k > q - 4096)) | (k < 64)

  def block_sparse(density):
    keep = sparse[density]  # an 8 x 8 pattern of 128-token tiles, repeated
    return lambda b, h, q, k: keep[(q // 128) % 8 * 8 + (k // 128) % 8]

  qi, ki = _positions()
  as_mask = lambda mod: (None, mod(0, 0, qi, ki)[None, None])
  return {
      "alibi causal": (True, alibi, None,
                       lambda: ((-slopes[:, None, None] * (qi - ki))[None].astype(jnp.bfloat16),
                                None)),
      "relative 32 buckets": (False, relative, None,
                              lambda: (table[:, _bucket(qi, ki)][None].astype(jnp.bfloat16),
                                       None)),
      "prefix-lm 1k": (False, None, prefix_lm, lambda: as_mask(prefix_lm)),
      "chunked local 2k": (True, None, chunked, lambda: as_mask(chunked)),
      "window 4k + 64 global": (True, None, window_global, lambda: as_mask(window_global)),
      "block-sparse 25%": (False, None, block_sparse(0.25), lambda: as_mask(block_sparse(0.25))),
      "block-sparse 50%": (False, None, block_sparse(0.5), lambda: as_mask(block_sparse(0.5))),
  }


def rows_of(case, args):
  name, num_heads, kv_heads = case
  rounds = args.rounds
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(keys[0], (B, S, num_heads, D), jnp.bfloat16)
  k = jax.random.normal(keys[1], (B, S, kv_heads, D), jnp.bfloat16)
  v = jax.random.normal(keys[2], (B, S, kv_heads, D), jnp.bfloat16)
  do = jax.random.normal(keys[3], (B, S, num_heads, D), jnp.bfloat16)
  causal, score_mod, mask_mod, explicit = variants(num_heads)[name]
  block_mask = None
  if mask_mod is not None:
    block_mask = fa4_jax.create_block_mask(mask_mod, None, None, S, S)
    visible = float(jnp.mean(explicit()[1].astype(jnp.float32)))
  else:
    visible = 0.5 if causal else 1.0
  bias, mask = explicit()
  # The bias / mask (up to H x S x S) and the block mask are call operands,
  # not closure constants (`bench_common.prepare_traced`).
  operands = (bias, mask, block_mask)
  mods = lambda block_mask: dict(score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask)
  impls = {
      "fa4 plain": lambda q, k, v, bias, mask, bm: fa4_jax.attention(q, k, v, is_causal=causal),
      "fa4 mod": lambda q, k, v, bias, mask, bm: fa4_jax.attention(
          q, k, v, is_causal=causal, **mods(bm)),
      "cudnn": lambda q, k, v, bias, mask, bm: jax.nn.dot_product_attention(
          q, k, v, bias, mask, is_causal=causal, implementation="cudnn"),
      "xla path": lambda q, k, v, bias, mask, bm: fa4_jax.attention(
          q, k, v, is_causal=causal, implementation="xla", **mods(bm)),
  }
  try:
    import tokamax
    impls["tokamax"] = lambda q, k, v, bias, mask, bm: tokamax.dot_product_attention(
        q, k, v, bias=bias, mask=mask, is_causal=causal, implementation="mosaic")
  except ImportError:
    pass
  flops = 4 * B * num_heads * S * S * D * (0.5 if causal else 1.0)
  which = fa4_jax.which_implementation(q, k, v, is_causal=causal, **mods(block_mask))
  which_bwd = fa4_jax.which_implementation(q, k, v, is_causal=causal, part="backward",
                                           **mods(block_mask))
  results = bench_common.forward_backward_columns(impls, q, k, v, do, rounds, lambda _: flops,
                                                  operands)
  return [dict(case=name, shape=f"B{B} S{S} H{num_heads}/{kv_heads} D{D}", causal_base=causal,
               visible=visible, served_by=[which, which_bwd], **results)]


def markdown(rows):
  cols = ["fa4 plain", "fa4 mod", "cudnn", "tokamax", "xla path"]
  lines = ["| case | visible | " + " | ".join(f"{c} fwd / bwd" for c in cols) + " |",
           "|---|---|" + "---|" * len(cols)]
  fmt = lambda c: f"{c['fwd_tflops']:.0f} / {c['bwd_tflops']:.0f}"
  for r in rows:
    cells = [bench_common.table_cell(r.get(c), fmt) for c in cols]
    lines.append(f"| {r['case']} ({r['shape']}) | {r['visible']:.2f} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main():
  def add_arguments(ap):
    ap.add_argument("--gqa", action="store_true", help="also GQA 32/8 (H32, KV heads 8)")

  import argparse
  probe = argparse.ArgumentParser(add_help=False)
  probe.add_argument("--gqa", action="store_true")
  gqa = probe.parse_known_args()[0].gqa
  cases = [(name, H, H) for name in variants(H)]
  if gqa:
    cases += [(name + " gqa", 32, 8) for name in variants(H)]

  def rows(case, args):
    name, num_heads, kv_heads = case
    return rows_of((name.removesuffix(" gqa"), num_heads, kv_heads), args)

  bench_common.table_main(
      "mods", cases, rows, markdown,
      lambda a: (f"bf16, B{B} S{S} H{H} D{D} (GQA rows: H32, KV heads 8); forward: kernel "
                 "duration sum, backward: VJP kernel span (profiler traces), medians of "
                 f"{a.rounds} interleaved rounds; TFLOP/s over the plain base's pairs"),
      default_rounds=3, add_arguments=add_arguments)


if __name__ == "__main__":
  main()
