"""Forward attention on one GPU: fa4_jax's sm90 kernel next to cuDNN, one process.

Kernel time: CUPTI (`jax.experimental.mosaic.gpu.profiler.measure`), median of
ITERATIONS calls, summing every kernel a call launches. TFLOP/s counts
4*B*H*Sq*Sk*D, halved when causal; a causal window counts 4*B*H*S*W*D
(W = window + 1). Errors: max |out - f32 reference| over batch 0 and two
heads (the full f32 logits would not fit at S=16k), for both implementations
on the same bf16 inputs.

The rows `B2 S8192 H16 D192/128 [causal]` give V and O a head dim of their
own (`VALUE_HEAD_DIMS`; issue #56): TFLOP/s count 2*B*H*S^2*(D + Dv), halved
when causal; cuDNN (jax.nn, one head dim) refuses them (`--no-cudnn`).

Usage (on the GPU machine, from the repository root):
    python3 benchmarks/bench_forward.py [--quick] [--only SUBSTRING (repeatable)]
        [--short] [--config key=value,... (repeatable: one column per config)]
        [--tag NAME]
Writes benchmarks/results/forward[-short][-NAME]-<device>-<date>.json (or $OUT/
when OUT is set) and prints a Markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fa4_jax.kernels import sm90_forward  # noqa: E402
from fa4_jax.scores import ScoreFunction

import bench_common  # noqa: E402  (this folder is on sys.path when run as a script)

ITERATIONS = bench_common.ITERATIONS

# (name, B, S, Hq, Hkv, D, causal, window_left)
CASES = [
    ("B8 S2048 H16 D128", 8, 2048, 16, 16, 128, False, None),
    ("B8 S2048 H16 D128 causal", 8, 2048, 16, 16, 128, True, None),
    ("B2 S8192 H16 D128", 2, 8192, 16, 16, 128, False, None),
    ("B2 S8192 H16 D128 causal", 2, 8192, 16, 16, 128, True, None),
    ("B1 S16384 H16 D128", 1, 16384, 16, 16, 128, False, None),
    ("B1 S16384 H16 D128 causal", 1, 16384, 16, 16, 128, True, None),
    ("B2 S8192 H32 D64", 2, 8192, 32, 32, 64, False, None),
    ("B2 S8192 H32 D64 causal", 2, 8192, 32, 32, 64, True, None),
    ("B2 S8192 H8 D256", 2, 8192, 8, 8, 256, False, None),
    ("B2 S8192 H8 D256 causal", 2, 8192, 8, 8, 256, True, None),
    ("B2 S8192 H32/8 D128 (GQA)", 2, 8192, 32, 8, 128, False, None),
    ("B2 S8192 H32/8 D128 (GQA) causal", 2, 8192, 32, 8, 128, True, None),
    ("B1 S16384 H16 D128 causal window 1024", 1, 16384, 16, 16, 128, True, 1023),
    # DeepSeek's training head dims (issue #56): V and O 128 wide beside Q and K at 192
    ("B2 S8192 H16 D192/128", 2, 8192, 16, 16, 192, False, None),
    ("B2 S8192 H16 D192/128 causal", 2, 8192, 16, 16, 192, True, None),
]

# V's (and O's) head dim of the cases where it is not D, by name: the tuples
# above keep their eight fields for the tools that unpack them.
VALUE_HEAD_DIMS = {"B2 S8192 H16 D192/128": 128, "B2 S8192 H16 D192/128 causal": 128}


def short_cases():
  """--short: the sweep's shapes up to S = 4096 at D = 64 and 128 and GQA
  (B = 32768 / S), where a CTA walks few KV blocks and its prologue and
  epilogue weigh most."""
  return [(c.name, c.B, c.S, c.Hq, c.Hkv, c.D, c.causal, None)
          for c in bench_common.gpu_cases(quick=False) if c.S <= 4096 and c.D <= 128]


def flops(B, S, H, D, causal, window_left, value_head_dim=None):
  """4*B*H*S^2*D, halved when causal; 2*B*H*S^2*(D + Dv) where V has a head
  dim of its own (`value_head_dim`)."""
  width = 2 * D if value_head_dim is None else D + value_head_dim
  if window_left is not None:
    return 2 * B * H * S * (window_left + 1) * width
  return 2 * B * H * S * S * width / (2 if causal else 1)


kernel_ms = bench_common.kernel_ms


def reference_rows(q, k, v, causal, window_left, heads):
  """f32 attention for batch 0 and the given query heads: [S, len(heads), D]."""
  S, D = q.shape[1], q.shape[3]
  group = q.shape[2] // k.shape[2]
  i = jnp.arange(S)[:, None]
  j = jnp.arange(S)[None, :]
  visible = jnp.ones((S, S), bool)
  if causal:
    visible &= j <= i
  if window_left is not None:
    visible &= j >= i - window_left
  outs = []
  for h in heads:
    qh = q[0, :, h].astype(jnp.float32)
    kh = k[0, :, h // group].astype(jnp.float32)
    vh = v[0, :, h // group].astype(jnp.float32)
    s = jnp.dot(qh, kh.T, precision="highest") / math.sqrt(D)
    p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
    outs.append(jnp.dot(p, vh, precision="highest"))
  return jnp.stack(outs, axis=1)


def config_for(text, head_dim, mask, kv_seq):
  """The heuristic's config, with `key=value,...` overrides (e.g. num_kv_stages=3)."""
  return apply_overrides(sm90_forward.choose_config(head_dim, mask, kv_seq), text)


def apply_overrides(config, text):
  """`config` with `key=value,...` overrides."""
  changes = {}
  for item in filter(None, text.split(",")):
    key, value = item.split("=")
    current = getattr(config, key)
    changes[key] = (value if isinstance(current, str) else
                    bool(int(value)) if isinstance(current, bool) else int(value))
  return dataclasses.replace(config, **changes)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="two shapes only")
  ap.add_argument("--short", action="store_true", help="the short-sequence cases instead")
  bench_common.add_case_options(ap)
  ap.add_argument("--config", action="append", default=None,
                  help="config overrides key=value,...; repeat to compare several")
  ap.add_argument("--no-cudnn", action="store_true")
  args = ap.parse_args()
  overrides = args.config or [""]

  device = jax.devices()[0]
  print(device.device_kind, jax.__version__, flush=True)
  cases = CASES[2:4] if args.quick else short_cases() if args.short else CASES
  cases = bench_common.selected(cases, args.only)
  rows = []
  for name, B, S, Hq, Hkv, D, causal, window_left in cases:
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, S, Hq, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, S, Hkv, D), jnp.bfloat16)
    Dv = VALUE_HEAD_DIMS.get(name, D)
    v = jax.random.normal(keys[2], (B, S, Hkv, Dv), jnp.bfloat16)
    scale = 1 / math.sqrt(D)
    mask, window = bench_common.case_mask(causal, window_left)
    configs = [config_for(text, D, mask, S) for text in overrides]
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, local_window_size=window, implementation="cudnn"))
    heads = (0, Hq - 1)
    ref = reference_rows(q, k, v, causal, window_left, heads)
    row = dict(case=name, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, causal=causal,
               window_left=window_left, dtype="bfloat16",
               config=dataclasses.asdict(configs[0]))
    if Dv != D:
      row["Dv"] = Dv
    fl = flops(B, S, Hq, D, causal, window_left, Dv)
    impls = []
    for i, config in enumerate(configs):
      ours = jax.jit(functools.partial(
          lambda q, k, v, config: sm90_forward.forward(
              q, k, v, None, None, score=ScoreFunction(scale), mask=mask,
              config=config)[0],
          config=config))
      impls.append(("fa4_sm90" if i == 0 else f"fa4_sm90[{overrides[i]}]", ours))
    if not args.no_cudnn:
      impls.append(("cudnn", cudnn))
    for impl, f in impls:
      try:
        out = f(q, k, v)
        err = float(jnp.max(jnp.abs(out[0][:, heads, :].astype(jnp.float32) - ref)))
        ms = kernel_ms(f, q, k, v)
        row[impl] = dict(ms=ms, tflops=fl / ms / 1e9, max_err=err)
      except Exception as e:  # keep going: one failure should not hide the rest
        row[impl] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    print(json.dumps(row), flush=True)
    rows.append(row)

  date = datetime.date.today().isoformat()
  path = bench_common.result_path("forward-short" if args.short else "forward",
                                  device.device_kind, args.tag)
  meta = dict(device=device.device_kind, jax=jax.__version__, date=date,
              method=f"CUPTI kernel time, median of {ITERATIONS}", rows=rows)
  with open(path, "w") as fh:
    json.dump(meta, fh, indent=1)
  print(markdown(rows))
  print("wrote", path)


def fmt(r, key):
  if "error" in r:
    return "error"
  return f"{r[key]:.0f}" if key == "tflops" else f"{r[key]:.2g}"


def markdown(rows):
  lines = ["| case | fa4_jax sm90 TFLOP/s | cuDNN TFLOP/s | max err ours | max err cuDNN |",
           "|---|---|---|---|---|"]
  for r in rows:
    ours, cud = r.get("fa4_sm90", {}), r.get("cudnn", {"error": 1})
    lines.append(f"| {r['case']} | {fmt(ours, 'tflops')} | {fmt(cud, 'tflops')} | "
                 f"{fmt(ours, 'max_err')} | {fmt(cud, 'max_err')} |")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
