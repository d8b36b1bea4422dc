"""One call of an sm90 kernel, for a profiler to attach to.

Runs one benchmark case of `bench_forward.py` or `bench_backward.py` (exact
name) twice on random inputs: a warm-up call and the call to profile. Meant to
run under Nsight Compute on the GPU machine, skipping the warm-up's kernels
(the forward launches one Mosaic GPU kernel per call, the backward two: dK/dV
and dQ; `ncu_profile.sh` does this):

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none \\
        --kernel-name regex:mosaic --launch-skip 1 --launch-count 1 \\
        --set full -o report python3 tools/profile_kernel.py forward \\
        --case "B2 S8192 H32 D64 causal" [--config key=value,...] [--soft-cap 50]

`--fp8` (forward only): q, k and v in e4m3 with per-head descales, under
the float8 rule's config (`sm90_forward.fp8_config`) before the overrides.
A backward case with a value head dim of its own (`D192/128`) gives V and dO
that width.

(Preallocation off: ncu saves and restores the memory a replayed kernel can
reach, and XLA's default pool would make that most of the GPU.)
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)  # fa4_jax
sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # the benchmarks' cases and configs
import bench_backward  # noqa: E402
import bench_forward  # noqa: E402
from fa4_jax.kernels import sm90_backward, sm90_forward  # noqa: E402
from fa4_jax.scores import ScoreFunction
import bench_common  # noqa: E402


def forward_call(case, config_text, soft_cap=None, fp8=False):
  _, B, S, Hq, Hkv, D, causal, window_left = case
  q, k, v, _ = random_inputs(B, S, Hq, Hkv, D)
  mask, _ = bench_common.case_mask(causal, window_left)
  score = ScoreFunction(1 / math.sqrt(D), soft_cap)
  if not fp8:
    config = bench_forward.config_for(config_text, D, mask, S)
    fn = jax.jit(lambda q, k, v: sm90_forward.forward(
        q, k, v, None, None, score=score, mask=mask, config=config)[0])
    return config, lambda: fn(q, k, v)
  import bench_fp8  # noqa: E402  (its per-head e4m3 quantization)
  (q8, qd), (k8, kd), (v8, vd) = (bench_fp8.quantized(x) for x in (q, k, v))
  config = sm90_forward.fp8_config(sm90_forward.choose_config(D, mask, S, S), mask, D, D, False)
  config = bench_forward.apply_overrides(config, config_text)
  fn = jax.jit(lambda *args: sm90_forward.forward(
      *args[:3], None, None, score=score, mask=mask, config=config, descales=args[3:])[0])
  return config, lambda: fn(q8, k8, v8, qd, kd, vd)


def backward_call(case, config_text, soft_cap=None):
  name, B, S, Hq, Hkv, D, causal, window_left, _ = case
  Dv = bench_backward.VALUE_HEAD_DIMS.get(name, D)
  q, k, v, do = random_inputs(B, S, Hq, Hkv, D, Dv)
  mask, _ = bench_common.case_mask(causal, window_left)
  scale = 1 / math.sqrt(D)
  # Stand-in residuals: computing them with the XLA forward first made
  # `ncu --set full` crash the process before any kernel ran (H100,
  # 2026-11-23). Logits scale * q.k are about N(0, 1) here, so an lse of
  # log(S) + 0.5 keeps P in the range a real softmax gives; the kernels'
  # work does not depend on the values.
  out = jax.random.normal(jax.random.key(1), do.shape, q.dtype)
  lse = jnp.full((B, Hq, S), math.log(S) + 0.5, jnp.float32)
  config = bench_backward.config_for(config_text, D, mask, Hq // Hkv,
                                     value_head_dim=Dv if Dv != D else None)
  fn = jax.jit(lambda *args: sm90_backward.backward(
      *args, None, None, score=ScoreFunction(scale, soft_cap), mask=mask, config=config))
  return config, lambda: fn(q, k, v, out, lse, do)


PASSES = {"forward": (bench_forward.CASES, forward_call),
          "backward": (bench_backward.CASES, backward_call)}


def random_inputs(B, S, Hq, Hkv, D, Dv=None):
  """bf16 q, k, v, dout of a benchmark case, fixed seed (`ab_kernels.py` uses it too);
  v and dout `Dv` wide (default D)."""
  Dv = D if Dv is None else Dv
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (B, S, Hq, D), jnp.bfloat16)
  k = jax.random.normal(keys[1], (B, S, Hkv, D), jnp.bfloat16)
  v = jax.random.normal(keys[2], (B, S, Hkv, Dv), jnp.bfloat16)
  do = jax.random.normal(keys[3], (B, S, Hq, Dv), jnp.bfloat16)
  return q, k, v, do


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("pass_", metavar="pass", choices=sorted(PASSES))
  ap.add_argument("--case", required=True, help="a case name of the pass's benchmark")
  ap.add_argument("--config", default="", help="config overrides key=value,...")
  ap.add_argument("--soft-cap", type=float, default=None, help="logit soft-cap (default: none)")
  ap.add_argument("--fp8", action="store_true", help="forward only: e4m3 q, k, v")
  args = ap.parse_args()
  if args.fp8 and args.pass_ != "forward":
    ap.error("--fp8 is for the forward pass")
  case_list, make_call = PASSES[args.pass_]
  cases = {c[0]: c for c in case_list}
  if args.case not in cases:
    ap.error(f"--case must be one of {sorted(cases)}")
  extra = dict(fp8=True) if args.fp8 else {}
  config, call = make_call(cases[args.case], args.config, args.soft_cap, **extra)
  print(args.pass_, args.case, config, flush=True)
  for _ in range(2):
    jax.block_until_ready(call())
  return 0


if __name__ == "__main__":
  sys.exit(main())
