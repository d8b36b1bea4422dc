"""Op counts of the Mosaic GPU kernels of one attention call, cross-lowered
for sm_90 on the CPU (no GPU needed), and where in our source they come from.

Mosaic GPU's passes (layout inference, then its dialect lowering, which
unrolls every tile-level op into per-register ops) take most of the
lowering, and LLVM and ptxas then compile what they produced: a kernel's
first-call time grows with these counts (issue #28). Per kernel this prints
the ops Pallas emitted ("before passes"), the ops after the passes, and the
passes' CPU seconds; `--by-line N` adds the N source lines of fa4_jax whose
code becomes the most ops after the passes (each op counted at the innermost
fa4_jax line of its location, with its count before the passes; the
backward kernels' ops carry only the location of the `custom_vjp` call,
fa4_jax/vjp.py, so `grad` needs the sm90 backward called directly to be
attributed).

    python tools/kernel_op_counts.py forward --head-dim 128 --causal [--by-line 25]
    python tools/kernel_op_counts.py grad --head-dim 256 --causal --kv-heads 4

`--score-mod alibi|constant|alibi-cp` adds a score_mod (ALiBi, s - slopes[h] *
(q_idx - kv_idx); s + 0.5; ALiBi as one ring step of
`context_parallel_attention` calls it: at the global positions of two
chunks of seq / 2 each, `context_parallel._at_global_positions`), and
`--float-ops` prints per loop of each kernel (the loops over key or query
blocks: what runs per block) its float ops after the passes, counted per
element (an op on a vector<2xf32> counts 2) by name: what a score_mod adds
per score. A multiply and an add listed apart may
still become one FMA in LLVM (fp-contract).
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import sys
import time

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax.experimental.mosaic.gpu import core as mgpu_core

import fa4_jax
from fa4_jax import context_parallel, mod_functions, testing
from jax.extend import core as jex_core

_FRAME = re.compile(r'"([^"]*fa4_jax/[^"]*)":(\d+)')


def _ops(module) -> list:
  ops = []

  def visit(op):
    ops.append(op)
    return ir.WalkResult.ADVANCE

  module.operation.walk(visit)
  return ops


def _lines(ops) -> collections.Counter:
  """Ops per innermost fa4_jax source line of their location."""
  counts = collections.Counter()
  for op in ops:
    frames = _FRAME.findall(str(op.location))
    if frames:
      path, line = frames[0]
      counts[f"{path.split('fa4_jax/')[-1]}:{line}"] += 1
  return counts


_FLOAT_OPS = ("arith.mulf", "arith.addf", "arith.subf", "arith.negf", "arith.divf",
              "arith.maximumf", "arith.minimumf", "math.fma", "arith.sitofp", "arith.uitofp")


def _elements(op) -> int:
  """Elements of an op's result: a vector<AxBxf32>'s A * B, else 1."""
  kind = str(op.results[0].type) if op.results else ""
  if not kind.startswith("vector<"):
    return 1
  return math.prod(int(n) for n in kind[len("vector<"):].split("x")[:-1])


def _loop_float_ops(module) -> list[collections.Counter]:
  """Per `scf.for` of the module, its float ops by name, counted per element."""
  loops = []

  def visit(op):
    if op.name == "scf.for":
      counts = collections.Counter()
      for inner in _ops(op):
        if inner.name in _FLOAT_OPS:
          counts[inner.name] += _elements(inner)
      loops.append(counts)
    return ir.WalkResult.ADVANCE

  module.operation.walk(visit)
  return loops


def measure(fn, specs, by_line: bool) -> tuple[float, float, list[dict]]:
  """(trace s, lower s, one dict per kernel), process CPU seconds."""
  kernels = []
  original = mgpu_core.lower_mgpu_module

  def counting(module, *args, **kwargs):
    before = _ops(module)
    lines_before = _lines(before) if by_line else None
    start = time.process_time()
    result = original(module, *args, **kwargs)
    passes_s = time.process_time() - start
    after = _ops(module)
    kernels.append(dict(before=len(before), after=len(after), passes_s=passes_s,
                        lines_before=lines_before,
                        lines_after=_lines(after) if by_line else None,
                        loop_float_ops=_loop_float_ops(module)))
    return result

  mgpu_core.lower_mgpu_module = counting
  try:
    with testing._target_arch("sm_90"):
      start = time.process_time()
      traced = jax.jit(fn).trace(*specs)
      traced_at = time.process_time()
      traced.lower(lowering_platforms=("cuda",))
      lowered_at = time.process_time()
  finally:
    mgpu_core.lower_mgpu_module = original
  return traced_at - start, lowered_at - traced_at, kernels


def _ring_step(score_mod, chunk: int):
  """`score_mod` as a ring step of `context_parallel_attention` calls the
  kernels (load-balanced, 4 devices): rows at global chunks 0 and 7, keys at
  chunks 2 and 5, of `chunk` positions each."""
  mod, captured = mod_functions.trace(score_mod, "score_mod")
  step = context_parallel._at_global_positions(mod, chunk)
  run = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(step.jaxpr, ()))
  starts = [jnp.int32(c * chunk) for c in (0, 7, 2, 5)]  # captured again, as the ring's
  return lambda s, b, h, q_idx, kv_idx: run(*captured, *starts, s, b, h, q_idx, kv_idx)[0]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("pass_", choices=("forward", "grad"), metavar="forward|grad")
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--kv-heads", type=int, default=None)
  parser.add_argument("--by-line", type=int, default=0, metavar="N")
  parser.add_argument("--score-mod", choices=("alibi", "constant", "alibi-cp"), default=None)
  parser.add_argument("--float-ops", action="store_true")
  args = parser.parse_args()
  if args.by_line:  # whole call stacks in the locations, so that our frames are found
    jax.config.update("jax_include_full_tracebacks_in_locations", True)
  kv_heads = args.kv_heads or args.heads
  q = jax.ShapeDtypeStruct((args.batch, args.seq, args.heads, args.head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((args.batch, args.seq, kv_heads, args.head_dim), jnp.bfloat16)

  slopes = jnp.asarray([2.0 ** (-8 * (i + 1) / args.heads) for i in range(args.heads)])
  score_mod = {None: None, "constant": lambda s, b, h, q_idx, kv_idx: s + 0.5,
               "alibi": lambda s, b, h, q_idx, kv_idx: (
                   s - slopes[h] * (q_idx - kv_idx).astype(jnp.float32))}.get(args.score_mod)
  if args.score_mod == "alibi-cp":
    score_mod = _ring_step(lambda s, b, h, q_idx, kv_idx: (
        s - slopes[h] * (q_idx - kv_idx).astype(jnp.float32)), args.seq // 2)

  def attend(q, k, v):
    options = {} if score_mod is None else dict(score_mod=score_mod, implementation="sm90")
    return fa4_jax.attention(q, k, v, is_causal=args.causal, **options)

  fn = attend
  if args.pass_ == "grad":
    fn = jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  trace_s, lower_s, kernels = measure(fn, (q, kv, kv), bool(args.by_line))
  print(f"{args.pass_} D{args.head_dim}{' causal' if args.causal else ''} H{args.heads}/"
        f"{kv_heads}: trace {trace_s:.2f} s, lower {lower_s:.2f} s (process CPU, first "
        f"call in this process)")
  for i, k in enumerate(kernels):
    print(f"  kernel {i}: {k['before']} ops before Mosaic GPU's passes, {k['after']} after, "
          f"passes {k['passes_s']:.2f} s")
    if args.by_line:
      for line, n in k["lines_after"].most_common(args.by_line):
        print(f"    {n:6d} {k['lines_before'].get(line, 0):5d}  {line}")
    if args.float_ops:
      for j, counts in enumerate(k["loop_float_ops"]):
        if counts:
          print(f"    loop {j}: {sum(counts.values())} float ops (per element):",
                ", ".join(f"{name.split('.')[-1]} {n}" for name, n in sorted(counts.items())))
  return 0


if __name__ == "__main__":
  sys.exit(main())
