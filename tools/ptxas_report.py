"""Registers, spills and SMEM of the sm90 kernels, as ptxas reports them.

On the GPU machine (the CUDA plugin compiles Mosaic GPU kernels only for a
present device), compiles the forward kernel (with `--backward`: the backward
kernels) for each `--config` override and
prints, per kernel, what `MOSAIC_GPU_DUMP_PTXAS` / `MOSAIC_GPU_DUMP_RESOURCES`
left: registers per thread, stack frame, spill stores / loads. The first
thing to read when a configuration is slower than expected.

    python3 tools/ptxas_report.py [--head-dim 128] [--causal] [--backward]
        [--soft-cap 50] [--config key=value,...]... [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BENCHMARKS = os.path.join(REPO, "benchmarks")  # bench_forward / bench_backward: config_for


def _compile(dump_dir: str, head_dim: int, causal: bool, config_text: str,
             backward: bool = False, group: int = 1, soft_cap: float | None = None) -> None:
  """Runs in a child process with the dump variables set."""
  sys.path.insert(0, REPO)
  sys.path.insert(0, BENCHMARKS)
  import jax
  import jax.numpy as jnp

  from fa4_jax.kernels import sm90_backward, sm90_forward
  from fa4_jax.scores import MaskSpec, ScoreFunction

  mask = MaskSpec.from_arguments(causal, None)
  score = ScoreFunction(0.1, soft_cap)
  q = jnp.ones((1, 1024, 2 * group, head_dim), jnp.bfloat16)
  kv = jnp.ones((1, 1024, 2, head_dim), jnp.bfloat16)
  if backward:
    import bench_backward
    config = bench_backward.config_for(config_text, head_dim, mask, group)
    lse = jnp.zeros((1, 2 * group, 1024), jnp.float32)
    fn = jax.jit(lambda q, k, v: sm90_backward.backward(
        q, k, v, q, lse, q, None, None, score=score, mask=mask, config=config))
  else:
    import bench_forward
    config = bench_forward.config_for(config_text, head_dim, mask, 8192)
    fn = jax.jit(lambda q, k, v: sm90_forward.forward(
        q, k, v, None, None, score=score, mask=mask, config=config)[0])
  jax.block_until_ready(fn(q, kv, kv))


def summarize(dump_dir: pathlib.Path) -> str:
  """One line per dumped kernel: its ptxas register / stack / spill figures."""
  lines = []
  for report in sorted(dump_dir.glob("*.ptxas")):
    text = report.read_text()
    regs = re.findall(r"Used (\d+) registers", text)
    stack = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    # C7510-C7515 ("wgmma.mma_async instructions are serialized ...") come as
    # `ptxas info`, not warnings, and apply to every wgmma of the function:
    # the most expensive line a report can hold.
    warnings = sorted(set(re.findall(r"warning[^\n]*|[^\n]*Performance Loss[^\n]*", text)))
    lines.append(f"{report.name}: registers {regs}, stack/spill-stores/spill-loads {stack}")
    lines += [f"  {w[:200]}" for w in warnings]
  for res in sorted(dump_dir.glob("*resources*")):
    lines.append(f"{res.name}: {res.read_text().strip()[:300]}")
  return "\n".join(lines) or "(nothing dumped)"


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--group", type=int, default=1,
                  help="query heads per KV head (GQA), two KV heads")
  ap.add_argument("--backward", action="store_true", help="the backward kernels")
  ap.add_argument("--soft-cap", type=float, default=None, help="compile with this logit soft-cap")
  ap.add_argument("--config", action="append", default=None)
  ap.add_argument("--keep", default=None, help="copy each dump folder here")
  args = ap.parse_args()
  for text in args.config or [""]:
    with tempfile.TemporaryDirectory() as tmp:
      env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1",
                 MOSAIC_GPU_DUMP_RESOURCES="1", MOSAIC_GPU_DUMP_TO=tmp)
      code = (f"import sys; sys.path.insert(0, {HERE!r}); import ptxas_report as r; "
              f"r._compile({tmp!r}, {args.head_dim}, {args.causal}, {text!r}, {args.backward}, "
              f"{args.group}, {args.soft_cap!r})")
      rc = subprocess.run([sys.executable, "-c", code], env=env).returncode
      print(f"== head_dim {args.head_dim} causal {args.causal} group {args.group} "
            f"soft-cap {args.soft_cap} config [{text}] (rc {rc})")
      print(summarize(pathlib.Path(tmp)), flush=True)
      if args.keep:
        pathlib.Path(args.keep).mkdir(parents=True, exist_ok=True)
        dest = pathlib.Path(args.keep) / (re.sub(r"[^A-Za-z0-9_.-]", "_", text) or "default")
        subprocess.run(["cp", "-r", tmp, str(dest)], check=False)
  return 0


if __name__ == "__main__":
  sys.exit(main())
