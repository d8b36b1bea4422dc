"""ptxas and SASS screen of the MLA decode kernel's configs, on the CPU machine.

For each (row, config): cross-lower `fa4_jax.attention(q, k, None,
value_head_dim=512)` under the config's switches (`sm90_mla_decode`
module constants, `CONFIGS` below), compile the kernel's PTX with the jax
plugin's Mosaic GPU (`tools/local_ptxas.py`), run ptxas (registers, spills,
wgmma serialization) and, with `--sass`, assemble a cubin and disassemble
it (nvdisasm, `--nvdisasm`) to report the spill accesses inside loops
(`tools/sass_loops.py`) and the wgmma / barrier-wait counts of the largest
loops. CPU figures, not GPU measurements.

    python3 benchmarks/mla_ptxas.py [--only SUBSTRING] [--sass --nvdisasm PATH] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fa4_jax  # noqa: E402
from fa4_jax.kernels import sm90_mla_decode as mla  # noqa: E402
import local_ptxas  # noqa: E402
import sass_loops  # noqa: E402

ROWS = {  # name: (B, T, Hq, S)
    "B32 T1 Hq16 S32k": (32, 1, 16, 32768),
    "B128 T1 Hq16 S16k": (128, 1, 16, 16384),
    "B128 T1 Hq128 S8k": (128, 1, 128, 8192),
    "B64 T2 Hq128 S4k": (64, 2, 128, 4096),
}


def call(t):
  return lambda q, c, n: fa4_jax.attention(
      q, c, None, value_head_dim=512, scale=192 ** -0.5, key_value_seq_lengths=n,
      is_causal=t > 1, causal_alignment="bottom_right", implementation="sm90")


def loop_facts(sass: str) -> list[dict]:
  """The largest loops of the listing (above a spin): instructions, wgmmas,
  mbarrier waits (try_wait), warpgroup waits, local accesses."""
  out = []
  for name, lines in sass_loops._functions(sass):
    instructions, labels = sass_loops._parse(lines)
    loops = sass_loops._loops(sass_loops._successors(instructions, labels))
    for head, body in loops:
      if len(body) <= sass_loops.SPIN_LOOP_SIZE:
        continue
      ops = [instructions[i][1] for i in sorted(body)]
      out.append(dict(
          head=hex(instructions[head][0]),
          size=len(body),
          wgmma=sum("HGMMA" in o for o in ops),
          try_wait=sum("SYNCS.PHASECHK" in o or "TRYWAIT" in o for o in ops),
          wgmma_wait=sum("WARPGROUP.DEPBAR" in o for o in ops),
          arrives=sum("SYNCS.ARRIVE" in o for o in ops),
          local=sum(bool(re.search(r"\b(STL|LDL)\b", o)) for o in ops),
          mufu=sum("MUFU" in o for o in ops),
          sts=sum(o.split()[0].startswith("STS") if o.split() else False for o in ops)))
  out.sort(key=lambda r: -r["size"])
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--only", action="append", default=[])
  ap.add_argument("--config", action="append", default=None,
                  help="names from sm90_mla_decode.CONFIGS (default: all)")
  ap.add_argument("--sass", action="store_true")
  ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
  ap.add_argument("--ptxas", default=shutil.which("ptxas") or f"{local_ptxas.CUDA_ROOT}/bin/ptxas")
  ap.add_argument("--keep", default=None)
  args = ap.parse_args()
  plugin, stub_dir = local_ptxas.setup(local_ptxas._cache_dir(None), jax.__version__)
  configs = args.config or list(mla.CONFIGS)
  for row, (b, t, n, s) in ROWS.items():
    if args.only and not any(o in row for o in args.only):
      continue
    specs = (jax.ShapeDtypeStruct((b, t, n, 576), jnp.bfloat16),
             jax.ShapeDtypeStruct((b, s, 1, 576), jnp.bfloat16),
             jax.ShapeDtypeStruct((b,), jnp.int32))
    for config in configs:
      with mla.use_config(config), tempfile.TemporaryDirectory() as tmp:
        plan = mla.choose_plan((b, t, n, 576), (b, s, 1, 576), ragged=True, num_sms=132)
        files = local_ptxas.capture(call(t), specs, "sm_90", pathlib.Path(tmp))
        ptx = local_ptxas.compile_to_ptx(files, plugin, stub_dir, "sm_90")
        for f in files:
          if "mla" not in f.stem:
            continue
          log = local_ptxas.ptxas_report(ptx[f], "sm_90", args.ptxas, [])
          res = dict(row=row, config=config, plan=str(plan), kernel=f.stem,
                     **local_ptxas.parse(log))
          if args.sass:
            p = pathlib.Path(tmp) / "k.ptx"
            p.write_text(ptx[f])
            subprocess.run([args.ptxas, "-arch=sm_90a", "-o", str(p.with_suffix(".cubin")),
                            str(p)], check=True, capture_output=True)
            sass = subprocess.run([args.nvdisasm, "-c", str(p.with_suffix(".cubin"))], check=True,
                                  capture_output=True, text=True).stdout
            res["loop_spills"] = sass_loops.summary(sass)
            res["loops"] = loop_facts(sass)[:4]
            if args.keep:
              keep = pathlib.Path(args.keep)
              keep.mkdir(parents=True, exist_ok=True)
              tag = f"{row}.{config}".replace(" ", "_")
              (keep / f"{tag}.ptx").write_text(ptx[f])
              (keep / f"{tag}.sass").write_text(sass)
          res.pop("log", None)
          res.pop("notes", None)
          print(json.dumps(res), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
