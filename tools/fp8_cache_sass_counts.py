"""Per key-block SASS counts of the float8-cache decode (a 16-bit query on
an e4m3 cache), without a GPU.

Issue #55: the float8-cache decode read its cache at 79 % of the bf16
decode's bytes per second (H100, D128) while one consumer warpgroup widened,
multiplied and ran the softmax of every block in series; two consumers on
halves of each CTA's key blocks replaced it (2026-12-08; the one-consumer
plan is last in 0180d5c). This tool shows the chain's instructions per
block: each call is cross-lowered for sm_90a in the decode plan
`sm90_decode.plan(fp8_cache=True)` makes, compiled to PTX by the jax
CUDA plugin and to a cubin by the local ptxas, decoded by `nvdisasm`; the
loops with a wgmma are printed with their counts (`tools/local_sass.py`).
Also printed: the SHA-256 of each kernel's PTX without its debug lines (a
switch that is off must leave it unchanged).

    python3 tools/fp8_cache_sass_counts.py --nvdisasm PATH [--shape b8s32k|b64s4k|d64]
        [--candidates default bf16] [--set block_kv=64 ...] [--keep DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import local_sass  # noqa: E402

OPS = ("LDS", "STS", "F2FP", "HADD2", "PRMT", "MUFU.EX2", "FFMA", "FADD", "FMUL", "FMNMX",
       "FSEL", "SHFL", "HGMMA", "WARPGROUP", "FENCE", "BAR", "SYNCS", "STL", "LDL")
SHAPES = {  # (batch, keys, q heads, kv heads, head dim)
    "b8s32k": (8, 32768, 32, 8, 128),
    "b64s4k": (64, 4096, 32, 8, 128),
    "d64": (8, 32768, 32, 8, 64),
}


def decode_call(shape: str, candidate: str, changes=None):
  import jax
  import jax.numpy as jnp

  from fa4_jax.kernels import sm90_decode
  from fa4_jax.scores import MaskSpec, ScoreFunction

  b, s, n, kv_heads, d = SHAPES[shape]
  cache = candidate != "bf16"
  q = jax.ShapeDtypeStruct((b, 1, n, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, s, kv_heads, d), jnp.float8_e4m3fn if cache else jnp.bfloat16)
  plan = sm90_decode.plan(q.shape, kv.shape, MaskSpec(), num_sms=132, fp8_cache=cache)
  if changes:
    import dataclasses
    plan = sm90_decode.DecodePlan(plan.splits, dataclasses.replace(plan.config, **changes))
  descales = (None, jnp.ones((kv_heads,), jnp.float32), jnp.ones((kv_heads,), jnp.float32))

  def fn(q, k, v):
    return sm90_decode.forward(q, k, v, None, None, score=ScoreFunction(d ** -0.5),
                               mask=MaskSpec(), plan=plan,
                               **({"descales": descales} if cache else {}))[0]

  return fn, (q, kv, kv), plan


def ptx_digest(ptx: str) -> str:
  """SHA-256 of the PTX without its debug lines (`.loc`, `.file`: source
  paths and line numbers, which an edit elsewhere in the file moves)."""
  kept = [line for line in ptx.splitlines()
          if not line.lstrip().startswith((".loc", ".file", "//"))]
  return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  local_sass.add_arguments(ap)
  ap.add_argument("--shape", choices=sorted(SHAPES), default="b8s32k")
  ap.add_argument("--candidates", nargs="+", default=["default"],
                  choices=("default", "bf16"),
                  help="today's float8 plan or the bf16 cache")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=INT",
                  help="a ForwardConfig field of the plan's config, e.g. block_kv=64; repeatable")
  args = ap.parse_args()
  changes = {k: int(v) for k, v in (x.split("=") for x in args.set)}
  tools = local_sass.toolchain(ap, args)
  print("ops per loop:", ", ".join(OPS), flush=True)
  for candidate in args.candidates:
    fn, specs, plan = decode_call(args.shape, candidate, changes)
    print(f"\n## {args.shape} {candidate}: splits {plan.splits}, {plan.config}", flush=True)
    for kernel in local_sass.kernels_of(fn, specs, tools, args, f"{args.shape}-{candidate}"):
      print(f"PTX sha256 {ptx_digest(kernel.ptx)} (without debug lines)")
      local_sass.report(kernel.name, kernel, OPS)
  return 0


if __name__ == "__main__":
  sys.exit(main())
