"""Fingerprints of every kernel the heuristics build, for refactors.

Cross-lowers (on the CPU, no GPU needed) the sm90 forward and backward and
the sm100 forward and backward (dK/dV and dQ kernels) for every head dim,
mask and grouping the heuristics distinguish, the kernels of packed
rows (segment ids), the float8 forwards (all-e4m3 prefill and a 16-bit
query on an e4m3 cache, in prefill and in the decode arrangement), a few calls with score modifications (soft-cap, a
`score_mod`, sinks; the sm90 decode arrangement with a soft-cap, causal
bottom-right over several tokens, and ALiBi with a mask_mod, contiguous and
paged), the sm90 MLA decode
kernel (contiguous and paged caches), plus the XLA path, and prints one
SHA-256 per case of the Mosaic GPU modules (MLIR without debug locations) or
of the StableHLO.

A refactor that leaves every fingerprint unchanged hands the GPU the very
same programs, so it cannot have changed their speed or their registers.

    python tools/kernel_fingerprints.py > before.json   # on the old commit
    python tools/kernel_fingerprints.py --compare before.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import re
import sys

# The tree this file lives in, not whichever one an editable install points
# to: a worktree at the old commit must fingerprint its own fa4_jax (found
# 2026-12-08, when a "before" taken in a worktree hashed main's kernels).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from fa4_jax import mod_functions, testing, xla_attention  # noqa: E402
from fa4_jax.kernels import sm90_decode, sm90_mla_decode  # noqa: E402
from fa4_jax.scores import MaskSpec, ScoreFunction, Scores  # noqa: E402

MASKS = {"dense": MaskSpec(), "causal": MaskSpec(right=0),
         "window": MaskSpec(left=256, right=0)}


# Mosaic GPU names each module's dump files after a per-process counter; the
# name says which kernel of the run it was, not what it is.
_DUMP_NAME = re.compile(r'mosaic_gpu.dump_basename = "[^"]*"')


def _digest(texts) -> str:
  h = hashlib.sha256()
  for t in texts:
    h.update(_DUMP_NAME.sub("", t).encode())
  return h.hexdigest()[:16]


def _segments(ids, segments):
  """The kernels' `segment_ids` argument: ids for queries and keys, or None."""
  return (ids, ids) if segments else None


# An ALiBi-like score_mod with a captured array (one slope per query head).
_SLOPES = jnp.asarray([2.0 ** -(i + 1) for i in range(8)], jnp.float32)


def _alibi_mods() -> Scores:
  """The kernels' `mods=` argument for the ALiBi-like score_mod."""
  fn = lambda s, b, h, q, kv: s + _SLOPES[h] * (kv - q).astype(jnp.float32)
  score_mod, captured = mod_functions.trace(fn, "score_mod")
  return Scores(score_mod=score_mod, score_captured=captured)


def _modified(soft_cap=None, score_mod=False) -> dict:
  """The kernels' keyword arguments of a call's score modifications."""
  options = {"score": ScoreFunction(0.125, soft_cap)}
  return options | ({"mods": _alibi_mods()} if score_mod else {})


def _forward(kernel, d, mask, seq, lengths, segments=False, group=2, sinks=False, **options):
  """The forward of kernel module `kernel` ("sm90_forward", "sm100_forward");
  `group` query heads per KV head (2 KV heads); `options` (`_modified`)
  passed on."""
  module = __import__(f"fa4_jax.kernels.{kernel}", fromlist=["forward"])
  options = _modified() | options
  q = jax.ShapeDtypeStruct((2, seq, 2 * group, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, seq, 2, d), jnp.bfloat16)
  ln = jax.ShapeDtypeStruct((2,), jnp.int32)
  ids = jax.ShapeDtypeStruct((2, seq), jnp.int32)
  sink_logits = jax.ShapeDtypeStruct((2 * group,), jnp.float32)

  def f(q, k, v, ql, kl, ids, sink_logits):
    return module.forward(q, k, v, ql if lengths else None, kl if lengths else None,
                          mask=mask, segment_ids=_segments(ids, segments),
                          **({"sinks": sink_logits} if sinks else {}), **options)
  return f, (q, kv, kv, ln, ln, ids, sink_logits)


def _fp8_forward(d, mask, seq, cache_only=False):
  """The sm90 forward on e4m3 K and V with per-head descales, Q in e4m3 too
  (prefill) or in bf16 (`cache_only`: the cache widened in SMEM); GQA 4/2.
  The forward picks the float8 configs itself (`sm90_forward.fp8_config`,
  `fp8_cache_config`)."""
  from fa4_jax.kernels import sm90_forward
  f8 = jnp.float8_e4m3fn
  q = jax.ShapeDtypeStruct((2, seq, 4, d), jnp.bfloat16 if cache_only else f8)
  kv = jax.ShapeDtypeStruct((2, seq, 2, d), f8)
  qd = jax.ShapeDtypeStruct((4,), jnp.float32)
  kvd = jax.ShapeDtypeStruct((2,), jnp.float32)

  def f(q, k, v, qd, kd, vd):
    return sm90_forward.forward(q, k, v, None, None, mask=mask, score=ScoreFunction(0.125),
                                descales=(None if cache_only else qd, kd, vd),
                                out_dtype=jnp.bfloat16)
  return f, (q, kv, kv, qd, kvd, kvd)


def _backward(kernel, d, mask, seq, lengths, group=1, segments=False, dv=None, **options):
  """The backward of kernel module `kernel` ("sm90_backward", "sm100_backward");
  `dv`: V's (and O's) head dim, None: d; `options` (`_modified`) passed on."""
  module = __import__(f"fa4_jax.kernels.{kernel}", fromlist=["backward"])
  options = _modified() | options
  q = jax.ShapeDtypeStruct((2, seq, 2 * group, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, seq, 2, d), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((2, seq, 2, dv or d), jnp.bfloat16)
  o = jax.ShapeDtypeStruct((2, seq, 2 * group, dv or d), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((2, 2 * group, seq), jnp.float32)
  ln = jax.ShapeDtypeStruct((2,), jnp.int32)
  ids = jax.ShapeDtypeStruct((2, seq), jnp.int32)

  def f(q, k, v, o, lse, do, ql, kl, ids):
    return module.backward(q, k, v, o, lse, do, ql if lengths else None,
                           kl if lengths else None, mask=mask,
                           segment_ids=_segments(ids, segments), **options)
  return f, (q, kv, v, o, lse, o, ln, ln, ids)


def _decode(soft_cap):
  """The sm90 decode arrangement of one token against 32768 keys (GQA 32/8,
  D128: split into chunks, the query read in place)."""
  q = jax.ShapeDtypeStruct((8, 1, 32, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((8, 32768, 8, 128), jnp.bfloat16)
  ln = jax.ShapeDtypeStruct((8,), jnp.int32)
  plan = sm90_decode.plan(q.shape, kv.shape, MaskSpec(), ragged=True, num_sms=132,
                          streams=132)

  def f(q, k, v, kl):
    return sm90_decode.forward(q, k, v, None, kl, score=ScoreFunction(0.125, soft_cap),
                               mask=MaskSpec(), plan=plan)
  return f, (q, kv, kv, ln)


def _mla(batch, tokens, heads, seq, page_size):
  """The sm90 MLA decode kernel (576 / 512, one latent head) in the plan the
  planner picks for 132 SMs: a contiguous cache, or pages of `page_size`
  through a table; bottom-right causal among T > 1 tokens."""
  q = jax.ShapeDtypeStruct((batch, tokens, heads, 576), jnp.bfloat16)
  ln = jax.ShapeDtypeStruct((batch,), jnp.int32)
  mask = MaskSpec(right=0, offset_from_lengths=True) if tokens > 1 else MaskSpec()
  plan = sm90_mla_decode.choose_plan(q.shape, (batch, seq, 1, 576), page_size=page_size,
                                     num_sms=132)
  if page_size is None:
    k = jax.ShapeDtypeStruct((batch, seq, 1, 576), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((batch, 1), jnp.int32)  # unused
  else:
    k = jax.ShapeDtypeStruct((batch * seq // page_size, page_size, 1, 576), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((batch, seq // page_size), jnp.int32)

  def f(q, k, table, kl):
    return sm90_mla_decode.forward(q, k, None, kl, value_head_dim=512,
                                   score=ScoreFunction(192 ** -0.5), mask=mask, plan=plan,
                                   page_table=None if page_size is None else table)
  return f, (q, k, table, ln)


def _decode_fp8_cache(d, t, page_size):
  """The sm90 decode arrangement of a bf16 query on an e4m3 cache (GQA
  32/8, 32768 keys a row, per-KV-head descales), T tokens (causal
  bottom-right for T > 1), contiguous (`page_size` None) or paged, on the
  float8 plan (two consumers on halves of the key blocks)."""
  f8 = jnp.float8_e4m3fn
  q = jax.ShapeDtypeStruct((8, t, 32, d), jnp.bfloat16)
  ln = jax.ShapeDtypeStruct((8,), jnp.int32)
  kvd = jax.ShapeDtypeStruct((8,), jnp.float32)
  mask = MaskSpec(right=0, offset_from_lengths=True) if t > 1 else MaskSpec()
  # Pages take the contiguous cache's float8 plan (`fp8_pages_plan`, as
  # `backends.paged_decode_plan` does under `FP8_PAGES_SPLITS_FACTOR`).
  plan = sm90_decode.fp8_pages_plan(q.shape, (8, 32768, 8, d), mask, 1,
                                    granule=page_size or 1, num_sms=132, streams=128)
  score = ScoreFunction(d ** -0.5)

  def f(q, k, v, kl, kd, vd, *table):
    return sm90_decode.forward(q, k, v, None, kl, score=score, mask=mask, plan=plan,
                               descales=(None, kd, vd), out_dtype=jnp.bfloat16,
                               page_table=table[0] if table else None)
  if page_size is None:
    kv = jax.ShapeDtypeStruct((8, 32768, 8, d), f8)
    return f, (q, kv, kv, ln, kvd, kvd)
  pages = jax.ShapeDtypeStruct((8 * 32768 // page_size, page_size, 8, d), f8)
  table = jax.ShapeDtypeStruct((8, 32768 // page_size), jnp.int32)
  return f, (q, pages, pages, ln, kvd, kvd, table)


def _decode_causal(t, page_size):
  """The sm90 decode arrangement of T tokens causal bottom-right against
  32768 keys per row (GQA 32/8, D128, ragged lengths: the band aligned per
  row and per chunk), contiguous (`page_size` None) or paged."""
  q = jax.ShapeDtypeStruct((8, t, 32, 128), jnp.bfloat16)
  ln = jax.ShapeDtypeStruct((8,), jnp.int32)
  band = MaskSpec(right=0, offset_from_lengths=True)
  plan = sm90_decode.plan(q.shape, (8, 32768, 8, 128), band, ragged=True,
                          granule=page_size or 1, num_sms=132, streams=128)
  score = ScoreFunction(0.125)
  if page_size is None:
    kv = jax.ShapeDtypeStruct((8, 32768, 8, 128), jnp.bfloat16)
    return (lambda q, k, v, kl: sm90_decode.forward(q, k, v, None, kl, score=score, mask=band,
                                                    plan=plan), (q, kv, kv, ln))
  pages = jax.ShapeDtypeStruct((8 * 32768 // page_size, page_size, 8, 128), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((8, 32768 // page_size), jnp.int32)
  return (lambda q, k, v, p, kl: sm90_decode.forward(q, k, v, None, kl, score=score, mask=band,
                                                     plan=plan, page_table=p),
          (q, pages, pages, table, ln))


def _decode_mods(t, page_size):
  """The sm90 decode arrangement of T tokens (causal bottom-right for T > 1)
  with ALiBi (`_alibi_mods`, GQA 32/8: slopes of 8 heads clipped per head)
  and a decode sliding window as mask_mod, against 32768 keys per row
  (ragged lengths), contiguous (`page_size` None) or paged."""
  q = jax.ShapeDtypeStruct((8, t, 32, 128), jnp.bfloat16)
  ln = jax.ShapeDtypeStruct((8,), jnp.int32)
  mask = MaskSpec(right=0, offset_from_lengths=True) if t > 1 else MaskSpec()
  plan = sm90_decode.plan(q.shape, (8, 32768, 8, 128), mask, ragged=True,
                          granule=page_size or 1, num_sms=132, streams=64)
  window, captured = mod_functions.trace(lambda b, h, i, j: j >= 1024 * (b + 1), "mask_mod")
  mods = _alibi_mods().replace(mask_mod=window, mask_captured=captured)
  options = dict(score=ScoreFunction(0.125), mask=mask, plan=plan, mods=mods)
  if page_size is None:
    kv = jax.ShapeDtypeStruct((8, 32768, 8, 128), jnp.bfloat16)
    return (lambda q, k, v, kl: sm90_decode.forward(q, k, v, None, kl, **options),
            (q, kv, kv, ln))
  pages = jax.ShapeDtypeStruct((8 * 32768 // page_size, page_size, 8, 128), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((8, 32768 // page_size), jnp.int32)
  return (lambda q, k, v, p, kl: sm90_decode.forward(q, k, v, None, kl, page_table=p,
                                                     **options),
          (q, pages, pages, table, ln))


def _scores(mask, ql, kl, lengths, soft_cap=None, score_mod=False):
  mods = _alibi_mods() if score_mod else Scores()
  return mods.replace(mask=mask, scale=0.125, soft_cap=soft_cap,
                      q_lengths=ql if lengths else None, kv_lengths=kl if lengths else None)


def _xla(mask, seq, lengths, backward, **modified):
  """The XLA path's forward or backward; `modified`: `_scores`' soft_cap,
  score_mod."""
  q = jax.ShapeDtypeStruct((2, seq, 4, 64), jnp.float32)
  kv = jax.ShapeDtypeStruct((2, seq, 2, 64), jnp.float32)
  ln = jax.ShapeDtypeStruct((2,), jnp.int32)

  def fwd(q, k, v, ql, kl):
    return xla_attention.forward(q, k, v, None, None, _scores(mask, ql, kl, lengths, **modified))

  def bwd(q, k, v, ql, kl):
    out, lse = fwd(q, k, v, ql, kl)
    return xla_attention.backward(q, k, v, None, None,
                                  _scores(mask, ql, kl, lengths, **modified), out, lse, out)
  return (bwd if backward else fwd), (q, kv, kv, ln, ln)


def cases():
  for d in (64, 80, 128, 192, 256):
    for mname, mask in MASKS.items():
      for seq in (1000, 8192):
        lengths = seq == 1000
        yield (f"sm90 forward d{d} {mname} s{seq}", "sm_90",
               _forward("sm90_forward", d, mask, seq, lengths))
        for group in (1, 4):
          yield (f"sm90 backward d{d} {mname} s{seq} g{group}", "sm_90",
                 _backward("sm90_backward", d, mask, seq, lengths, group))
  for d, dv in ((192, 128), (128, 64)):  # a value head dim of its own
    for mname, mask in MASKS.items():
      for group in (1, 4):
        yield (f"sm90 backward d{d} dv{dv} {mname} s1000 g{group}", "sm_90",
               _backward("sm90_backward", d, mask, 1000, True, group, dv=dv))
  for d in (64, 128):  # packed rows: segment ids, causal and dense
    for mname in ("dense", "causal"):
      for seq in (1000, 8192):
        yield (f"sm90 forward d{d} {mname} s{seq} segment ids", "sm_90",
               _forward("sm90_forward", d, MASKS[mname], seq, seq == 1000, segments=True))
        yield (f"sm90 backward d{d} {mname} s{seq} segment ids", "sm_90",
               _backward("sm90_backward", d, MASKS[mname], seq, seq == 1000, segments=True))
  # Packed causal D128 rows take the persistent grid with a work queue at any
  # length and group (the cases above: two query heads per KV head); here
  # four.
  for seq in (1000, 8192):
    yield (f"sm90 forward d128 causal s{seq} segment ids g4", "sm_90",
           _forward("sm90_forward", 128, MASKS["causal"], seq, seq == 1000, segments=True,
                    group=4))
  for d in (64, 128, 256):  # float8: the default rule per head dim and mask
    for mname in ("dense", "causal"):
      yield (f"sm90 forward fp8 d{d} {mname} s8192", "sm_90",
             _fp8_forward(d, MASKS[mname], 8192))
  yield ("sm90 forward fp8 cache d128 dense s8192", "sm_90",
         _fp8_forward(128, MASKS["dense"], 8192, cache_only=True))
  for d in (64, 128, 256):
    for mname, mask in MASKS.items():
      for seq in (1000, 4096):
        yield (f"sm100 forward d{d} {mname} s{seq}", "sm_100",
               _forward("sm100_forward", d, mask, seq, seq == 1000))
  for d in (64, 128):  # the head dims the sm100 backward serves
    for mname in ("dense", "causal"):
      yield (f"sm100 backward d{d} {mname} s1000", "sm_100",
             _backward("sm100_backward", d, MASKS[mname], 1000, True))
  yield ("sm100 forward d128 causal s1000 segment ids", "sm_100",
         _forward("sm100_forward", 128, MASKS["causal"], 1000, True, segments=True))
  yield ("sm100 backward d128 causal s1000 segment ids", "sm_100",
         _backward("sm100_backward", 128, MASKS["causal"], 1000, True, segments=True))
  # Score modifications: each kernel soft-capped, with a score_mod (alone and
  # soft-capped), and the forwards with sinks.
  for kernel, arch in (("sm90", "sm_90"), ("sm100", "sm_100")):
    for d, mname, name, options in (
        (64, "dense", "soft_cap", _modified(soft_cap=30.0)),
        (128, "causal", "soft_cap", _modified(soft_cap=30.0)),
        (64, "dense", "score_mod", _modified(score_mod=True)),
        (128, "causal", "score_mod soft_cap", _modified(30.0, score_mod=True))):
      yield (f"{kernel} forward d{d} {mname} s1000 {name}", arch,
             _forward(f"{kernel}_forward", d, MASKS[mname], 1000, True, **options))
      yield (f"{kernel} backward d{d} {mname} s1000 {name}", arch,
             _backward(f"{kernel}_backward", d, MASKS[mname], 1000, True, **options))
    yield (f"{kernel} forward d128 causal s1000 sinks soft_cap", arch,
           _forward(f"{kernel}_forward", 128, MASKS["causal"], 1000, True, sinks=True,
                    **_modified(soft_cap=30.0)))
  yield "sm90 decode d128 s32768 soft_cap", "sm_90", _decode(30.0)
  # MLA decode: memory-bound (Hq 16) and compute-bound (Hq 128, two row
  # tiles), contiguous and paged (4 TMAs a block, one a page, one from
  # inside a page), one token and the causal band among 2 and 4.
  for b, t, n, seq, page_size in ((32, 1, 16, 4096, None), (64, 2, 128, 8192, None),
                                  (64, 4, 16, 16384, 16), (128, 1, 16, 32768, 64),
                                  (128, 1, 128, 4096, 128)):
    paged = f" pages {page_size}" if page_size else ""
    yield (f"sm90 mla decode b{b} t{t} h{n} s{seq}{paged}", "sm_90",
           _mla(b, t, n, seq, page_size))
  for t, page_size in ((16, None), (16, 16), (64, 64)):
    cache = f"pages {page_size}" if page_size else "contiguous"
    yield f"sm90 decode d128 s32768 causal t{t} {cache}", "sm_90", _decode_causal(t, page_size)
  for t, page_size in ((1, None), (1, 64), (4, 16)):
    cache = f"pages {page_size}" if page_size else "contiguous"
    yield (f"sm90 decode d128 s32768 t{t} alibi window {cache}", "sm_90",
           _decode_mods(t, page_size))
  for d, t, page_size in ((128, 1, None), (64, 1, None), (128, 16, None), (128, 1, 64),
                          (128, 16, 16)):
    cache = f"pages {page_size}" if page_size else "contiguous"
    yield (f"sm90 decode fp8 cache d{d} s32768 t{t} {cache}", "sm_90",
           _decode_fp8_cache(d, t, page_size))
  for mname, mask in MASKS.items():
    for backward in (False, True):
      yield f"xla {'backward' if backward else 'forward'} {mname}", None, _xla(
          mask, 2048, True, backward)
  for backward in (False, True):
    for name, modified in (("soft_cap", {"soft_cap": 30.0}),
                           ("score_mod soft_cap", {"soft_cap": 30.0, "score_mod": True})):
      yield (f"xla {'backward' if backward else 'forward'} causal {name}", None,
             _xla(MASKS["causal"], 2048, True, backward, **modified))


def fingerprint(arch, fn_specs) -> str:
  fn, specs = fn_specs
  if arch is None:
    lowered = jax.jit(fn).trace(*specs).lower()
    return _digest([lowered.compiler_ir("stablehlo").operation.get_asm(enable_debug_info=False)])
  return _digest(testing.cross_lower(fn, *specs, arch=arch).modules)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--compare", help="a JSON printed by an earlier run")
  parser.add_argument("--only", default="", help="run the cases whose name contains this")
  args = parser.parse_args()
  found = {}
  for name, arch, fn_specs in cases():
    if args.only in name:
      found[name] = fingerprint(arch, fn_specs)
      print(f"{name}: {found[name]}", file=sys.stderr, flush=True)
  if not args.compare:
    json.dump(found, sys.stdout, indent=1)
    return 0
  with open(args.compare) as f:
    before = json.load(f)
  new = [n for n in found if n not in before]  # cases added since: nothing to compare
  changed = [n for n in found if n in before and before[n] != found[n]]
  for n in new:
    print(f"NEW {n}: {found[n]}")
  for n in changed:
    print(f"CHANGED {n}: {before[n]} -> {found[n]}")
  print(f"{len(found) - len(changed) - len(new)} unchanged, {len(changed)} changed, "
        f"{len(new)} new")
  return 1 if changed else 0


if __name__ == "__main__":
  sys.exit(main())
