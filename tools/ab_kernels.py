"""The sm90 kernels of two checkouts side by side in one process (GPU).

For refactors: a copy of the old package, renamed `fa4_jax_before`, sits in
a folder given with --before; both run on the same inputs with their own
heuristic configs, their kernel time taken in interleaved rounds (A B A B
...), so clock drift hits both alike. `forward`: the forward kernel's time
(`bench_common.kernel_ms`) on `bench_forward.py`'s cases (`--short`: its
short-sequence cases); `backward`: the backward's kernel span
(`bench_backward.span_times`) on `bench_backward.py`'s cases. Also reports
whether the two give bitwise equal results. `packed`: the forward with
segment ids on `bench_packed.py`'s packings (causal, rows of 16k tokens,
documents of 1k-4k tokens), timed as bench_packed times its forward
(`bench_common.kernel_sum_ms`: every kernel of the call, the XLA work on
the ids included). `packed-backward`: the backward with segment ids on the
same packings, the lse and output from the new checkout's forward, timed
as the backward pass (the kernel span). `--soft-cap CAP`: every case
of either pass with that logit soft-cap (both checkouts), e.g. 50 (Gemma 2)
for the soft-capped forward against the old one.

`decode`: `sm90_decode.forward` (the whole arrangement: packing, the kernel, the
combine) on `bench_decode.py`'s T=1 and T=16 cases, each with its
`choose_splits` plan, timed as bench_decode times it (the sum of a call's
kernel durations in a profiler trace, `bench_common.kernel_sum_ms`): TB/s of
K/V read per side, and one call's kernels (name, microseconds) per side.

    cp -r OLD/fa4_jax DIR/fa4_jax_before
    find DIR/fa4_jax_before -name '*.py' | xargs sed -i 's/\\bfa4_jax\\b/fa4_jax_before/g'
    python3 tools/ab_kernels.py forward|backward|decode|packed|packed-backward --before DIR [--short] [--only SUBSTRING] \\
        [--rounds 5] [--soft-cap 50]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bench_backward  # noqa: E402
import bench_common  # noqa: E402
import bench_decode  # noqa: E402
import bench_forward  # noqa: E402
import bench_packed  # noqa: E402
from profile_kernel import random_inputs  # noqa: E402  (tools/, the script's folder)


def _mask_spec(package, causal, window_left):
  # A checkout older than commit c5e97bc has masks.py where scores.py is now.
  try:
    masks = __import__(f"{package}.scores", fromlist=["MaskSpec"])
  except ImportError:
    masks = __import__(f"{package}.masks", fromlist=["MaskSpec"])
  return masks.MaskSpec.from_arguments(causal, None if window_left is None else (window_left, 0))


def _score(package, scale, soft_cap):
  """The kernels' arguments for the logits' scale and soft-cap: one
  `ScoreFunction` where the checkout has it (`score=`), else `scale=` and,
  only when set (a checkout from before soft-cap takes no such argument),
  `soft_cap=`."""
  try:
    score_function = __import__(f"{package}.scores", fromlist=["ScoreFunction"]).ScoreFunction
  except (ImportError, AttributeError):
    return {"scale": scale} | ({} if soft_cap is None else {"soft_cap": soft_cap})
  return {"score": score_function(scale, soft_cap)}


def forward_call(package, case, soft_cap=None):
  """(jitted forward of `package`'s sm90 kernel, its inputs, its timer)."""
  _, B, S, Hq, Hkv, D, causal, window_left = case[:8]
  forward = __import__(f"{package}.kernels.sm90_forward", fromlist=["forward"])
  spec = _mask_spec(package, causal, window_left)
  q, k, v, _ = random_inputs(B, S, Hq, Hkv, D)
  f = jax.jit(lambda q, k, v: forward.forward(q, k, v, None, None, mask=spec,
                                              **_score(package, D ** -0.5, soft_cap))[0])
  return f, (q, k, v), bench_common.kernel_ms


def packed_cases():
  """bench_packed's rows: (name, B, Hq, Hkv, D, mean document length)."""
  return [(f"{name} mean doc {mean}", B, Hq, Hkv, D, mean)
          for name, B, Hq, Hkv, D in bench_packed.SHAPES for mean in bench_packed.MEAN_DOCUMENTS]


def packed_inputs(case):
  """(q, k, v, dout, segment ids) of a packed case: bench_packed's packing."""
  _, B, Hq, Hkv, D, mean = case
  q, k, v, do = random_inputs(B, bench_packed.ROW, Hq, Hkv, D)
  return q, k, v, do, jnp.asarray(bench_packed.packed_rows(B, mean))


def packed_call(package, case, soft_cap=None):
  """(jitted causal forward of `package`'s sm90 kernel with bench_packed's
  segment ids, its inputs, its timer)."""
  D = case[4]
  forward = __import__(f"{package}.kernels.sm90_forward", fromlist=["forward"])
  spec = _mask_spec(package, True, None)
  q, k, v, _, ids = packed_inputs(case)
  f = jax.jit(lambda q, k, v, ids: forward.forward(
      q, k, v, None, None, mask=spec, segment_ids=(ids, ids),
      **_score(package, D ** -0.5, soft_cap))[0])
  return f, (q, k, v, ids), bench_common.kernel_sum_ms


def packed_backward_call(package, case, soft_cap=None):
  """(jitted backward of `package`'s sm90 kernels with bench_packed's
  segment ids, its inputs, its timer). The output and lse come from the new
  checkout's forward, so both sides see the same inputs."""
  D = case[4]
  backward = __import__(f"{package}.kernels.sm90_backward", fromlist=["backward"])
  forward = __import__("fa4_jax.kernels.sm90_forward", fromlist=["forward"])
  q, k, v, do, ids = packed_inputs(case)
  o, lse = jax.jit(lambda q, k, v, ids: forward.forward(
      q, k, v, None, None, mask=_mask_spec("fa4_jax", True, None),
      segment_ids=(ids, ids), **_score("fa4_jax", D ** -0.5, soft_cap)))(q, k, v, ids)
  spec = _mask_spec(package, True, None)
  f = jax.jit(lambda q, k, v, o, lse, do, ids: backward.backward(
      q, k, v, o, lse, do, None, None, mask=spec, segment_ids=(ids, ids),
      **_score(package, D ** -0.5, soft_cap)))
  return f, (q, k, v, o, lse, do, ids), lambda f, *a: bench_backward.span_times(f, *a)[0]


def backward_call(package, case, soft_cap=None):
  """(jitted backward of `package`'s sm90 kernels, its inputs, its timer)."""
  _, B, S, Hq, Hkv, D, causal, window_left = case[:8]
  backward = __import__(f"{package}.kernels.sm90_backward", fromlist=["backward"])
  spec = _mask_spec(package, causal, window_left)
  q, k, v, do = random_inputs(B, S, Hq, Hkv, D)
  # A plausible lse: the backward's speed does not depend on its values.
  lse = jnp.full((B, Hq, S), 4.0, jnp.float32)
  f = jax.jit(lambda q, k, v, o, lse, do: backward.backward(
      q, k, v, o, lse, do, None, None, mask=spec, **_score(package, D ** -0.5, soft_cap)))
  return f, (q, k, v, do, lse, do), lambda f, *a: bench_backward.span_times(f, *a)[0]


def decode_call(package, case, soft_cap=None):
  """(jitted `package`'s decode arrangement, its inputs, its timer)."""
  _, B, T, S, Hq, Hkv, D, ragged = case
  # A checkout older than issue #53's move has decode.py where kernels/sm90_decode.py is now.
  try:
    sm90_decode = __import__(f"{package}.kernels.sm90_decode", fromlist=["forward"])
  except ImportError:
    sm90_decode = __import__(f"{package}.decode", fromlist=["forward"])
  q, k, v, kv_lengths, _ = bench_decode.case_inputs(B, T, S, Hq, Hkv, D, ragged)
  spec = _mask_spec(package, False, None)
  plan = sm90_decode.plan(q.shape, k.shape, spec, ragged=ragged)  # each package's own heuristic
  f = jax.jit(lambda q, k, v, kv_lengths: sm90_decode.forward(
      q, k, v, None, kv_lengths, mask=spec, plan=plan, **_score(package, D ** -0.5, soft_cap))[0])
  return f, (q, k, v, kv_lengths), bench_common.kernel_sum_ms


def decode_cases():
  """bench_decode's cases of one token and of 16."""
  return [c for c in bench_decode.CASES if c[2] in (1, 16)]


def one_call_kernels(f, args):
  """[(kernel name, microseconds)] of one call of `f(*args)` (a profiler trace)."""
  _, kernels = bench_common.trace_spans(f, args, 1)[0]
  return [(name, round(1e3 * duration, 2)) for name, _, duration in kernels]


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("pass_", metavar="pass", choices=("forward", "backward", "decode", "packed",
                                                      "packed-backward"))
  ap.add_argument("--before", required=True, help="folder holding fa4_jax_before")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--short", action="store_true", help="forward: bench_forward's short cases")
  ap.add_argument("--soft-cap", type=float, default=None,
                  help="every case with this logit soft-cap (default: none)")
  bench_common.add_case_options(ap)
  args = ap.parse_args()
  sys.path.insert(0, args.before)
  if args.pass_ == "forward":
    cases = bench_forward.short_cases() if args.short else bench_forward.CASES
    make_call = forward_call
  elif args.pass_ == "decode":
    cases, make_call = decode_cases(), decode_call
  elif args.pass_ == "packed":
    cases, make_call = packed_cases(), packed_call
  elif args.pass_ == "packed-backward":
    cases, make_call = packed_cases(), packed_backward_call
  else:
    cases, make_call = bench_backward.CASES, backward_call
  rows = []
  for case in bench_common.selected(cases, args.only):
    calls = {p: make_call(p, case, args.soft_cap) for p in ("fa4_jax_before", "fa4_jax")}
    outs = {p: jax.block_until_ready(f(*a)) for p, (f, a, _) in calls.items()}
    pairs = list(zip(*(jax.tree.leaves(o) for o in outs.values())))
    same = all(bool(jnp.array_equal(x, y)) for x, y in pairs)
    # A change of the arithmetic (e.g. the fixed max of soft-cap) is not
    # bitwise: how far apart the two are.
    max_abs_diff = max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
                       for x, y in pairs)
    times = {p: [] for p in calls}
    for _ in range(args.rounds):
      for p, (f, a, timer) in calls.items():
        times[p].append(timer(f, *a))
    before, after = (float(np.median(times[p])) for p in calls)
    row = dict(case=case[0], soft_cap=args.soft_cap, before_ms=before, after_ms=after,
               change=after / before - 1, bitwise_equal=same, max_abs_diff=max_abs_diff,
               rounds=times)
    if args.pass_ == "decode":
      _, k, _, kv_lengths = calls["fa4_jax"][1]
      kv_bytes = bench_decode.kv_bytes_read(k, kv_lengths)
      row.update(before_tb_per_s=kv_bytes / before / 1e9, after_tb_per_s=kv_bytes / after / 1e9)
    if args.pass_ in ("decode", "packed", "packed-backward"):
      # Calls of several kernels: which ones, and how long each ran once.
      row["kernels"] = {p: one_call_kernels(f, a) for p, (f, a, _) in calls.items()}
    print(json.dumps(row), flush=True)
    rows.append(row)
  timer = {"forward": "kernel time (bench_common.kernel_ms)",
           "backward": "kernel span (bench_backward.span_times)",
           "packed": "kernel time of every kernel of the call (bench_common.kernel_sum_ms)",
           "packed-backward": "kernel span (bench_backward.span_times)",
           "decode": "sum of kernel durations (bench_common.kernel_sum_ms)"}[args.pass_]
  name = args.pass_ if args.soft_cap is None else f"{args.pass_}-softcap{args.soft_cap:g}"
  path = bench_common.result_path(f"{name}-ab", jax.devices()[0].device_kind, args.tag)
  with open(path, "w") as fh:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                   method=f"{timer}, median of {args.rounds} interleaved rounds, one process",
                   rows=rows), fh, indent=1)
  print("wrote", path)


if __name__ == "__main__":
  main()
