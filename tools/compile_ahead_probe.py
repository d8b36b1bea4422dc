"""Where the first call's compile time goes with `fa4_jax.kernels.compile_ahead` (GPU).

Two measurements, for issue #28:

`timeline`: one fresh process per (case, pass, workers), the first call as
`benchmarks/bench_compile.py` measures it (`bench_compile.measure`), with
the workers' timeline: when each kernel's compile was queued, started and
finished, and how long jax's compile of the program waited for them, in
seconds from the start of the first call. `workers` is compile_ahead's
thread count ("default") or 1 (the kernels compile one after another, each
alone: their own compile times).

`threads`: in one process, the three kernels of a D128 `jax.grad` (lowered
several times: Mosaic GPU numbers each lowering, so every set has its own
hashes and nothing hits the kernel cache) compiled as compile_ahead's
one-op programs, one after another and then on threads, with the main
thread idle, busy in Python, or lowering the grad again: whether the
compiles overlap, and whether the main thread's work slows them.

    python3 tools/compile_ahead_probe.py timeline|threads [--passes grad,forward] [--tag NAME]

Writes benchmarks/results/compile-ahead-<kind>[-NAME]-<device>-<date>.json (or $OUT/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import bench_common  # noqa: E402

import bench_compile  # noqa: E402

# bench_compile's cases whose grads were near tokamax's (no segment ids).
TIMELINE_CASES = [case for case in bench_compile.CASES
                  if case[0] in ("B2 S4096 H16 D128", "B2 S4096 H16 D128 causal",
                                 "B2 S4096 H16 D64", "B2 S4096 H16/4 D128 (GQA) causal")]


def timeline_child(spec: dict, workers: int) -> None:
  from fa4_jax.kernels import compile_ahead

  if workers:
    compile_ahead.MAX_WORKERS = workers
  print("RESULT " + json.dumps(bench_compile.measure(spec)), flush=True)


def timeline(passes) -> list[dict]:
  rows = []
  for case, B, S, Hq, Hkv, D, causal, segments in TIMELINE_CASES:
    for pass_name in passes:
      for workers in (0, 1):
        spec = dict(B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, causal=causal, segments=segments,
                    cpu=False, layers=1, column="fa4_jax", **{"pass": pass_name})
        proc = subprocess.run(
            [sys.executable, __file__, "--timeline-child", json.dumps(spec), str(workers)],
            capture_output=True, text=True, timeout=180)
        found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if not found:
          print(case, pass_name, workers, "failed:", proc.stderr[-2000:], flush=True)
          continue
        result = json.loads(found[0][len("RESULT "):])
        rows.append(dict(case=case, **{"pass": pass_name}, workers=workers or "default",
                         **result))
        print(f"{case:34s} {pass_name:7s} workers={workers or 'default':7} "
              f"trace {result['trace_s']:.2f} lower {result['lower_s']:.2f} "
              f"compile {result['compile_s']:.2f} total {result['total_s']:.2f}", flush=True)
        for event in result.get("compile_ahead_timeline", []):
          print("    ", event, flush=True)
  return rows


def _grad_kernel_sets(count: int):
  """`count` lowerings of a D128 grad's three kernels: (module name, backend
  config values, signature) each, as compile_ahead would queue them."""
  import jax
  import jax.numpy as jnp

  import fa4_jax
  from fa4_jax.kernels import compile_ahead

  captured = []
  compile_ahead.install()
  queue = compile_ahead._submit

  def capture(custom_call, module):
    captured.append((compile_ahead.module_name(module),
                     *compile_ahead.custom_call_config(custom_call)))

  q = jnp.zeros((2, 4096, 16, 128), jnp.bfloat16)
  loss = lambda q, k, v: fa4_jax.attention(q, k, v).astype(jnp.float32).sum()
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

  def lower_again():
    jax.clear_caches()
    grad.trace(q, q, q).lower()

  compile_ahead._submit = capture
  try:
    for _ in range(count):
      lower_again()
  finally:
    compile_ahead._submit = queue
  return [captured[i:i + 3] for i in range(0, len(captured), 3)], lower_again


def threads() -> list[dict]:
  import jax

  from fa4_jax.kernels import compile_ahead

  sets, lower_again = _grad_kernel_sets(7)
  device = jax.devices()[0]
  rows = []

  def run(label, kernels, *, on_threads=True, main=None):
    out = {}
    origin = time.perf_counter()

    def compile_one(name, values, signature):
      start = time.perf_counter()
      ok = compile_ahead._compile(device, values, signature, {})
      out[name] = dict(started=round(start - origin, 3),
                       finished=round(time.perf_counter() - origin, 3), compiled=ok)

    main_s = None
    if on_threads:
      workers = [threading.Thread(target=compile_one, args=k) for k in kernels]
      for w in workers:
        w.start()
      if main is not None:
        start = time.perf_counter()
        main(workers)
        main_s = round(time.perf_counter() - start, 3)
      for w in workers:
        w.join()
    else:
      for k in kernels:
        compile_one(*k)
    row = dict(label=label, kernels=out, span_s=round(time.perf_counter() - origin, 3),
               main_thread_s=main_s)
    rows.append(row)
    print(json.dumps(row), flush=True)

  def busy_in_python(workers):
    x = 0
    while any(w.is_alive() for w in workers):
      for i in range(2000):
        x += i * i % 7

  def lowering(workers):
    lower_again()

  only = lambda kernels, part: [k for k in kernels if part in k[0]]
  without_forward = lambda kernels: [k for k in kernels if "forward" not in k[0]]
  start = time.perf_counter()
  lower_again()
  rows.append(dict(label="main thread lowering the grad alone",
                   main_thread_s=round(time.perf_counter() - start, 3)))
  run("one after another: forward, dkdv, dq", sets[0], on_threads=False)
  run("threads: forward, dkdv, dq; main idle", sets[1])
  run("threads: dkdv, dq; main idle", without_forward(sets[2]))
  run("threads: dkdv, dq; main busy in Python", without_forward(sets[3]), main=busy_in_python)
  run("threads: dkdv, dq; main lowering the grad", without_forward(sets[4]), main=lowering)
  run("thread: dkdv; main idle", only(sets[5], "dkdv"))
  run("thread: dkdv; main lowering the grad", only(sets[6], "dkdv"), main=lowering)
  return rows


def main():
  if len(sys.argv) > 1 and sys.argv[1] == "--timeline-child":
    timeline_child(json.loads(sys.argv[2]), int(sys.argv[3]))
    return
  ap = argparse.ArgumentParser()
  ap.add_argument("kind", choices=("timeline", "threads"))
  ap.add_argument("--passes", default="grad,forward")
  ap.add_argument("--tag", default="")
  args = ap.parse_args()
  import jax

  device = jax.devices()[0].device_kind
  started = time.perf_counter()
  if args.kind == "timeline":
    rows = timeline(args.passes.split(","))
    method = ("bench_compile.measure in one fresh process per row; compile_ahead's "
              "timeline in seconds from the start of the first call; workers=1: the "
              "kernels compile one after another")
  else:
    rows = threads()
    method = ("one process; a D128 grad's three kernels (B2 S4096 H16 bf16) lowered 7 "
              "times, each set compiled as compile_ahead's one-op programs, serially or "
              "on threads, seconds from the set's start")
  bench_common.write_results(f"compile-ahead-{args.kind}", device, args.tag, method, rows,
                             wall_s=time.perf_counter() - started)


if __name__ == "__main__":
  main()
