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
import collections
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import local_ptxas  # noqa: E402
import sass_loops  # noqa: E402

OPS = ("MUFU.EX2", "FFMA", "FADD", "FMUL", "FSEL", "I2F", "IMAD", "MOV", "R2UR", "F2FP",
       "HGMMA", "WARPGROUP", "STL", "LDL")


def opcode_counts(instructions, body) -> collections.Counter:
  counts = collections.Counter()
  for i in body:
    op = instructions[i][1].split()[0] if instructions[i][1] else ""
    for name in OPS:
      if op == name or op.startswith(name + "."):
        counts[name] += 1
  counts["all"] = len(body)
  return counts


def loop_table(listing: str):
  """(function, loop head address, counts) of each loop past a spin holding a wgmma."""
  rows = []
  for function, lines in sass_loops._functions(listing):
    instructions, labels = sass_loops._parse(lines)
    for head, body in sass_loops._loops(sass_loops._successors(instructions, labels)):
      if len(body) <= sass_loops.SPIN_LOOP_SIZE:
        continue
      counts = opcode_counts(instructions, body)
      if counts["HGMMA"]:
        rows.append((function, instructions[head][0], counts))
  return sorted(rows, key=lambda r: (r[0], r[1]))


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
  ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"))
  ap.add_argument("--variants", nargs="+", default=["alibi", "alibi causal"])
  ap.add_argument("--switch", nargs="+", default=["off", "on"], choices=("off", "delta", "on"),
                  help="sm90_backward.FOLD_AFFINE_SCORE_MOD (delta: on, with "
                       "FOLD_AFFINE_SCORES off: dQ's dP from -delta alone)")
  ap.add_argument("--seq", type=int, default=4096)
  ap.add_argument("--keep", default=None, help="write each kernel's PTX and SASS here")
  args = ap.parse_args()
  if not args.nvdisasm:
    ap.error("needs nvdisasm (--nvdisasm PATH; pip download nvidia-cuda-nvdisasm)")
  import jax

  from fa4_jax.kernels import sm90_backward

  plugin, stub_dir = local_ptxas.setup(local_ptxas._cache_dir(None), jax.__version__)
  ptxas = shutil.which("ptxas") or f"{local_ptxas.CUDA_ROOT}/bin/ptxas"
  print("ops per loop:", ", ".join(OPS), flush=True)
  for variant in args.variants:
    for switch in args.switch:
      sm90_backward.FOLD_AFFINE_SCORE_MOD = switch != "off"
      sm90_backward.FOLD_AFFINE_SCORES = switch == "on"
      fn, specs = call(variant, args.seq)
      print(f"\n## {variant}, B2 S{args.seq} H16 D128, fold_affine {switch}", flush=True)
      with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        files = local_ptxas.capture(fn, specs, "sm_90", tmp)
        ptx = local_ptxas.compile_to_ptx(files, plugin, stub_dir, "sm_90")
        for f in files:
          src, cubin = tmp / "k.ptx", tmp / "k.cubin"
          src.write_text(ptx[f])
          log = subprocess.run([ptxas, "-arch=sm_90a", "-v", "-o", str(cubin), str(src)],
                               capture_output=True, text=True)
          figures = local_ptxas.parse(log.stdout + log.stderr)
          listing = subprocess.run([args.nvdisasm, str(cubin)], capture_output=True,
                                   text=True, check=True).stdout
          if args.keep:
            keep = pathlib.Path(args.keep)
            keep.mkdir(parents=True, exist_ok=True)
            stem = f"{variant.replace(' ', '_')}-{switch}-{f.stem}"
            (keep / f"{stem}.ptx").write_text(ptx[f])
            (keep / f"{stem}.sass").write_text(listing)
          print(f"{f.stem}: registers {figures['registers']}, spill stores/loads "
                f"{figures['spill_stores']}/{figures['spill_loads']}, serialized "
                f"{figures['serialized']}; loop spills {sass_loops.summary(listing)}")
          for function, head, counts in loop_table(listing):
            ops = " ".join(f"{k} {counts[k]}" for k in OPS if counts[k])
            print(f"  loop at {head:#07x}: {counts['all']} instructions; {ops}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
