"""A value head dim of its own (192/128 training) and MLA's latent-cache
decode, one process, on whatever GPU runs it.

Rows (issue targets in brackets):
* `train B2 S8192 H16 192/128 [causal]`: forward and backward beside our
  D128 and D256 rows of the same B, S, H [>= 95 % of the D128 rows'
  TFLOP/s; cuDNN 9's published H200 figures 643 / 442];
* `mla ...`: absorbed MLA decode, one latent head of 576 features (the first
  512 the values), Hq query heads, contiguous and paged (page 64) [>= 90 %
  of the card's HBM bandwidth when memory-bound, >= 600 TFLOP/s when
  compute-bound, paged within 5 % of contiguous], beside our GQA decode of
  two KV heads of 128 (512 features a token against the latent's 576; its
  TB/s by its own bytes, its TFLOP/s column meaningless).

Training FLOPs: 2·B·H·T·S·(D + Dv), halved when causal. Decode bytes: the
latent cache read once (B·S·576·2). Time: kernel-duration sums (forward)
and VJP kernel spans (backward) in profiler traces, medians of interleaved
rounds (`bench_common`).

On a Hopper GPU the 192/128 rows run the sm90 kernels, forward and
backward, at both head dims (no padding since issue #56); the MLA rows the
sm90 MLA decode kernel (`sm90_mla_decode`; `bench_mla.py` times it in more
rows and configurations).

  python3 benchmarks/bench_head_dims.py [--only mla] [--rounds 3] [--tag NAME]
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common  # noqa: E402
import fa4_jax  # noqa: E402

B, S, H = 2, 8192, 16
LATENT, VALUES, PAGE = 576, 512, 64
SCALE = 192 ** -0.5  # DeepSeek scales by the unabsorbed query-key head dim

# (name, kind, B, T, S, Hq, causal)
CASES = [
    ("train B2 S8192 H16 192/128", "train", B, S, S, H, False),
    ("train B2 S8192 H16 192/128 causal", "train", B, S, S, H, True),
    *[(f"mla B{b} T{t} S{s} Hq{h}", "mla", b, t, s, h, True)
      for b, t, s, h in ((32, 1, 4096, 16), (64, 1, 16384, 16), (128, 1, 32768, 16),
                         (64, 1, 4096, 128), (128, 2, 4096, 128))],
]


def train_rows(name, b, s, h, causal, rounds):
  keys = jax.random.split(jax.random.key(0), 4)
  normal = lambda i, d: jax.random.normal(keys[i], (b, s, h, d), jnp.bfloat16)
  q, k, v, do = normal(0, 192), normal(1, 192), normal(2, 128), normal(3, 128)
  attend = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=causal)
  impls = {"192/128": attend}
  results = bench_common.forward_backward_columns(
      impls, q, k, v, do, rounds, lambda _: 2 * b * h * s * s * (192 + 128) * (0.5 if causal else 1))
  for d in (128, 256):  # our equal-dim rows, in the same process
    qd, kd, vd = (normal(i, d) for i in range(3))
    results |= bench_common.forward_backward_columns(
        {f"D{d}": attend}, qd, kd, vd, normal(3, d), rounds,
        lambda _, d=d: 4 * b * h * s * s * d * (0.5 if causal else 1))
  served = [fa4_jax.which_implementation(q, k, v, is_causal=causal, part=part)
            for part in ("forward", "backward")]
  return [dict(case=name, kind="train", served_by=served, **results)]


def mla_rows(name, b, t, s, hq, rounds):
  keys = jax.random.split(jax.random.key(1), 2)
  q = jax.random.normal(keys[0], (b, t, hq, LATENT), jnp.bfloat16)
  latent = jax.random.normal(keys[1], (b, s, 1, LATENT), jnp.bfloat16)
  lengths = jnp.full((b,), s, jnp.int32)
  mla = lambda q, c: fa4_jax.attention(q, c, None, value_head_dim=VALUES, scale=SCALE,
                                       is_causal=True, causal_alignment="bottom_right")
  pages = b * s // PAGE
  table = jnp.asarray(np.random.default_rng(0).permutation(pages), jnp.int32).reshape(b, -1)
  latent_pages = jnp.zeros((pages, PAGE, 1, LATENT), latent.dtype).at[table.reshape(-1)].set(
      latent.reshape(pages, PAGE, 1, LATENT))
  paged = lambda q, p: fa4_jax.paged_attention(q, p, None, table, lengths,
                                               value_head_dim=VALUES, scale=SCALE)
  # Our GQA decode on a cache of nearly the same bytes: K and V of 2 heads x
  # 128 (512 features a token against the latent's 576), its TB/s by its own bytes.
  gqa = lambda q, k, v: fa4_jax.attention(q, k, v, scale=SCALE, is_causal=True,
                                          causal_alignment="bottom_right")
  gqa_k = latent[..., :256].reshape(b, s, 2, 128)
  calls = {"mla": (mla, (q, latent)), "mla paged": (paged, (q, latent_pages)),
           "gqa 2x128": (gqa, (q[..., :128], gqa_k, gqa_k))}
  nbytes = latent.size * latent.dtype.itemsize
  row = dict(case=name, kind="mla", served_by=fa4_jax.which_implementation(
      q, latent, None, value_head_dim=VALUES, is_causal=True, causal_alignment="bottom_right"),
      latent_bytes=nbytes, gqa_bytes=2 * gqa_k.size * gqa_k.dtype.itemsize,
      flops=2 * b * hq * t * s * (LATENT + VALUES))
  row.update(bench_common.bandwidth_columns(calls, rounds, nbytes, "mla"))
  if "ms" in row.get("gqa 2x128", {}):
    row["gqa 2x128"]["tb_per_s"] = row["gqa_bytes"] / row["gqa 2x128"]["ms"] / 1e9
  return [row]


def rows_of(case, args):
  name, kind, b, t, s, h, causal = case
  if kind == "train":
    return train_rows(name, b, s, h, causal, args.rounds)
  return mla_rows(name, b, t, s, h, args.rounds)


def markdown(rows):
  lines = ["| case | served | columns |", "|---|---|---|"]
  for r in rows:
    if r["kind"] == "train":
      fmt = lambda c: f"{c['fwd_tflops']:.0f} / {c['bwd_tflops']:.0f} TFLOP/s fwd / bwd"
      cols = ("192/128", "D128", "D256")
    else:
      fmt = lambda c, r=r: (f"{c['tb_per_s']:.2f} TB/s, "
                            f"{r['flops'] / c['ms'] / 1e9:.0f} TFLOP/s")
      cols = ("mla", "mla paged", "gqa 2x128")
    cells = "; ".join(f"{c}: {bench_common.table_cell(r.get(c), fmt)}" for c in cols)
    lines.append(f"| {r['case']} | {r['served_by']} | {cells} |")
  return "\n".join(lines)


def main():
  bench_common.table_main(
      "head-dims", CASES, rows_of, markdown,
      lambda a: (f"bf16; training: forward kernel-duration sum, backward VJP kernel span; MLA: "
                 f"kernel-duration sums, TB/s of the latent cache read once; medians of "
                 f"{a.rounds} interleaved rounds"),
      default_rounds=3)


if __name__ == "__main__":
  main()
