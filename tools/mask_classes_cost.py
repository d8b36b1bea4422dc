"""The XLA cost of the tile classes a call with a `mask_mod` (and no block
mask) builds for its kernels (#52), on the default device.

    python tools/mask_classes_cost.py time [--as-before]
    python tools/mask_classes_cost.py hlo

`time`: median wall time (block_until_ready) of one jitted build of what a
`jax.grad` call's sm90 kernels get: the forward's classes at 128 x 128 CTA
tiles and the backward's at its 64 x 64 fine tiles, every mask of the call
(`scores.tile_classes`); prefix-LM and chunked-local masks at B2 S4096 H16
and B8 S2048 H16. `--as-before` builds them as the code did before #52's
change: over every batch row and head (no dependence analysis), once for
the forward and once for the backward (no shared evaluation).

`hlo`: how often the mask_mod's XLA evaluation appears in the lowered HLO
of `jax.grad` of a call pinned to the sm90 kernels, cross-lowered for CUDA
(`fa4_jax.gpu_target`): the count of a constant only the mask_mod holds
(the kernels' own code is not in the HLO text).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fa4_jax  # noqa: E402
from fa4_jax import mod_functions, scores  # noqa: E402

MARK = 1237  # a constant of the mask_mods alone


def prefix_lm(b, h, q_idx, kv_idx):
  return (kv_idx < MARK) | (kv_idx <= q_idx)


def chunked_local(b, h, q_idx, kv_idx):
  return (q_idx // MARK == kv_idx // MARK) & (kv_idx <= q_idx)


MODS = {"prefix_lm": prefix_lm, "chunked_local": chunked_local}
SHAPES = ((2, 4096, 16), (8, 2048, 16))  # batch, sequence, heads


def build(scores_, batch, heads, seq, as_before):
  if not as_before:
    scores_ = scores.with_shared_mod_classes(scores_, batch, heads, seq, seq)
  return (scores.tile_classes(scores_, batch, heads, seq, seq, 128, 128),
          scores.tile_classes(scores_, batch, heads, seq, seq, 64, 64))


def time_builds(as_before: bool, reps: int):
  if as_before:  # every row and head evaluated
    scores.broadcast_extents = lambda mask_mod, batch, heads: (batch, heads)
  for name, fn in MODS.items():
    for batch, seq, heads in SHAPES:
      mod, captured = mod_functions.trace(fn, "mask_mod")
      scores_ = scores.Scores(mask_mod=mod, mask_captured=captured)
      f = jax.jit(lambda s, b=batch, h=heads, t=seq: build(s, b, h, t, as_before))
      out = jax.block_until_ready(f(scores_))
      times = []
      for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(f(scores_))
        times.append(time.perf_counter() - start)
      print(f"{name} B{batch} S{seq} H{heads}: {1e3 * statistics.median(times):.2f} ms "
            f"(median of {reps}; classes {[tuple(o.shape) for o in out]})", flush=True)


def hlo_counts():
  spec = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)
  for name, fn in MODS.items():
    loss = lambda q, k, v, fn=fn: fa4_jax.attention(
        q, k, v, mask_mod=fn, implementation="sm90").astype(jnp.float32).sum()
    jax.clear_caches()
    with fa4_jax.gpu_target("sm90"):
      text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(spec, spec, spec).lower(
          lowering_platforms=("cuda",)).as_text()
    per_evaluation = 2 if name == "chunked_local" else 1  # MARK appears twice in it
    count = len(re.findall(rf"dense<{MARK}>", text))
    print(f"{name}: {count // per_evaluation} evaluation(s) of mask_mod in the gradient's HLO "
          f"({count} constants), {text.count('stablehlo.while')} while loops")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("what", choices=("time", "hlo"))
  parser.add_argument("--as-before", action="store_true")
  parser.add_argument("--reps", type=int, default=7)
  args = parser.parse_args()
  if args.what == "time":
    time_builds(args.as_before, args.reps)
  else:
    hlo_counts()


if __name__ == "__main__":
  main()
