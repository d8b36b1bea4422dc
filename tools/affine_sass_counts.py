"""Per key-block SASS counts of the backward kernels under an affine score_mod, without a GPU.

Issue #52: ALiBi's backward costs more than the plain one per block because
each score takes two FMAs (t = s * scale + C, then c t - lse2) and the
accumulators are zeroed register by register (docs/performance-notes.md,
"The ALiBi backward's registers"). `sm90_backward.FOLD_AFFINE_SCORE_MOD`
starts S^T / S at the form's terms and lse2 instead (`DkvConfig.fold_affine`,
`DqConfig.fold_affine`). This compiles `jax.grad` of `fa4_jax.attention` with
each variant's score_mod under each value of the switch (cross-lowered for
sm_90a, PTX by the jax CUDA plugin, cubin by ptxas: `tools/local_ptxas.py`),
decodes it with `nvdisasm` (the `nvidia-cuda-nvdisasm` pip wheel) and prints,
per kernel, ptxas's registers and spills, whether it serialized a wgmma, the
spill accesses in loops (`tools/sass_loops.py`), and every loop past an
mbarrier spin that holds a wgmma: its size and its counts of `OPS`.

    python3 tools/affine_sass_counts.py --nvdisasm PATH [--variants alibi "alibi causal"] \\
        [--switch off delta on] [--seq 4096] [--keep DIR]

Variants: plain, plain causal, alibi, alibi causal, add const (B2 S4096 H16
D128 bf16, `bench_mod_costs.py`'s mods).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import local_sass  # noqa: E402

OPS = ("MUFU.EX2", "FFMA", "FADD", "FMUL", "FSEL", "I2F", "IMAD", "MOV", "R2UR", "F2FP",
       "HGMMA", "WARPGROUP", "STL", "LDL")


def call(variant: str, seq: int):
  import jax
  import jax.numpy as jnp

  import fa4_jax

  heads = 16
  slopes = jnp.asarray([2.0 ** (-8 * (i + 1) / heads) for i in range(heads)])
  alibi = lambda s, b, h, q, k: s - slopes[h] * (q - k).astype(jnp.float32)
  mods = {"plain": None, "alibi": alibi, "add const": lambda s, b, h, q, k: s + 0.5}
  causal = variant.endswith(" causal")
  mod = mods[variant.removesuffix(" causal")]

  def loss(q, k, v):
    return fa4_jax.attention(q, k, v, is_causal=causal, score_mod=mod,
                             implementation="sm90").astype(jnp.float32).sum()

  spec = jax.ShapeDtypeStruct((2, seq, heads, 128), jnp.bfloat16)
  return jax.grad(loss, argnums=(0, 1, 2)), (spec, spec, spec)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  local_sass.add_arguments(ap)
  ap.add_argument("--variants", nargs="+", default=["alibi", "alibi causal"])
  ap.add_argument("--switch", nargs="+", default=["off", "on"], choices=("off", "delta", "on"),
                  help="sm90_backward.FOLD_AFFINE_SCORE_MOD (delta: on, with "
                       "FOLD_AFFINE_SCORES off: dQ's dP from -delta alone)")
  ap.add_argument("--seq", type=int, default=4096)
  args = ap.parse_args()
  from fa4_jax.kernels import sm90_backward

  tools = local_sass.toolchain(ap, args)
  print("ops per loop:", ", ".join(OPS), flush=True)
  for variant in args.variants:
    for switch in args.switch:
      sm90_backward.FOLD_AFFINE_SCORE_MOD = switch != "off"
      sm90_backward.FOLD_AFFINE_SCORES = switch == "on"
      fn, specs = call(variant, args.seq)
      print(f"\n## {variant}, B2 S{args.seq} H16 D128, fold_affine {switch}", flush=True)
      stem = f"{variant.replace(' ', '_')}-{switch}"
      for kernel in local_sass.kernels_of(fn, specs, tools, args, stem):
        local_sass.report(kernel.name, kernel, OPS, marks=("HGMMA",))
  return 0


if __name__ == "__main__":
  sys.exit(main())
