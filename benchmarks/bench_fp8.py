"""float8 attention beside bfloat16, one process, on whatever GPU runs it.

Rows (issue targets in brackets):
* `prefill ...`: all-float8 forward (e4m3, per-head descales) against our
  bfloat16 forward of the same shape, D128 and D256, S 8k and 16k, dense and
  causal, GQA 32/8 [float8 >= 1.5x bfloat16];
* `decode ...`: a bfloat16 query on a float8 KV cache against the bfloat16
  cache, the decode table's shapes [float8 reads >= 90 % of the bfloat16
  call's bytes per second, i.e. about 1.8x its tokens per second];
* `paged ...`: float8 pages (pages of 64 or 16) against the same float8
  cache laid out contiguously [within 5 %]; `... ragged`: row lengths from
  S/16 to S (the contiguous column is then read with those lengths too).

Columns: `bf16` (fa4_jax.attention as it picks), `fp8` and `fp8 paged`
(the sm90 kernel by name; `which_implementation` in the row), `fp8 default`
(decode rows: what implementation=None runs on a float8 cache: the kernel
on a Hopper GPU, so it matches `fp8`) and `xla` (our XLA path on the bf16
inputs, the reference of `max_abs_diff`). Time: the sum of a call's kernel
durations in a profiler trace, medians of interleaved rounds
(`bench_common.bandwidth_columns`). `tb_per_s` divides the bytes the
bfloat16 call reads (K and V once) by each column's time, so a float8 cache
read at the same bytes per second shows 2x; prefill rows print TFLOP/s.

`--configs` adds, on prefill rows, the float8 kernel under each of
`CONFIG_CANDIDATES` (columns `fp8 <label>`): the sweep behind the float8
rules of `sm90_forward.choose_config`. `--decode-configs` adds, on decode
rows, the decode arrangement on the float8 cache under each of
`_decode_candidates` (columns `fp8 dec <label>`: splits and the kernel's
config; `16-bit plan` is the plan before the float8 rules of
`sm90_decode.plan(fp8_cache=True)`, i.e. the former default), so that one
run puts the grids side by side with the bf16 call and the `fp8` column
(the default plan: two consumers on halves of each CTA's key blocks since
2026-12-08, issue #55; the one-consumer and two-CTAs-an-SM candidates it
beat left with their configs, last in 0180d5c). On paged rows it adds
`fp8 paged dec 16-bit plan`:
float8 pages under their former plan (`paged_plan_columns`).

`--paged-configs` adds, on paged rows, float8 pages under each of
`PAGED_RULES` (columns `fp8 paged <rule>`, `sm90_decode.plan(...,
paged=True, fp8_pages_factor=)`) and, on the page-64 rows, the contiguous
float8 cache under the same plan (`fp8 dec <rule>`), so that each rule's
paged / contiguous ratio is read in one process (issue #55); a column whose
plan is the default's (`fp8 paged`, `fp8`) is left out (printed). It drops
the `bf16` and `fp8 default` columns on those rows (the latter on a Hopper
GPU the same call as `fp8`), for the time of one GPU command.

`--row-sums` adds, on prefill rows, the float8 kernel under its heuristic
config (`sm90_forward.fp8_config`) with the row sums on the tensor core
(column `fp8 row sums on tc`: `ForwardConfig.fp8_row_sums_on_tensor_core`,
issue #55), beside `fp8` (the same config with the sums by FADDs while
they are off: at head dims outside `FP8_ROW_SUMS_HEAD_DIMS`; at D128,
where they are the default, this column is two consumers' serial schedule
with turns and `fp8` three consumers since 2026-12-08), and on dense D128 rows the same with
192 and 256 keys per block (`fp8 row sums on tc kvN`, `ROW_SUM_BLOCKS`). `--no-xla` drops the XLA column (the
slowest to compile and run); `max_abs_diff` is then taken against `fp8`.

`--overlap` adds, on D128 prefill rows, the float8 kernel's serial
schedules on the heuristic's config under `SERIAL_BLOCKS` (columns `fp8
serial kv128[ no turns]`, `fp8 serial kv256`, and three consumers without
turns `fp8 serial kv128 [s3 ]3 consumers`; issue #55). Since 2026-12-08
`fp8` on D128 dense and causal rows is the three consumers
(`sm90_forward.FP8_THREE_CONSUMERS`). The flag's name is that of FA3's
intra-warpgroup overlap, whose columns (`fp8 overlap kvN[ sM][ no turns]`)
left with it: it lost to three consumers on every row (the performance
notes; commit 0180d5c is the last to have it).

  python3 benchmarks/bench_fp8.py [--only decode] [--rounds 3] [--configs] [--decode-configs]
                                  [--paged-configs] [--row-sums] [--overlap] [--no-xla]
                                  [--tag NAME]
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common  # noqa: E402
import fa4_jax  # noqa: E402
from fa4_jax.scores import ScoreFunction

F8 = jnp.float8_e4m3fn

# (name, kind, B, T, S, Hq, Hkv, D, causal)
CASES = [
    *[(f"prefill B{b} S{s} H32/8 D{d}{' causal' if c else ''}", "prefill", b, s, s, 32, 8, d, c)
      for d in (128, 256) for b, s in ((2, 8192), (1, 16384)) for c in (False, True)],
    ("decode B8 T1 S32768 H32/8 D128", "decode", 8, 1, 32768, 32, 8, 128, False),
    ("decode B64 T1 S4096 H32/8 D128", "decode", 64, 1, 4096, 32, 8, 128, False),
    ("decode B1 T1 S131072 H32/8 D128", "decode", 1, 1, 131072, 32, 8, 128, False),
    ("decode B8 T1 S32768 H32/8 D64", "decode", 8, 1, 32768, 32, 8, 64, False),
    ("decode B16 T1 S16384 H8/1 D64", "decode", 16, 1, 16384, 8, 1, 64, False),
    ("paged B8 T1 S32768 H32/8 D128 page 64", "paged", 8, 1, 32768, 32, 8, 128, False),
    ("paged B8 T16 S32768 H32/8 D128 page 64", "paged", 8, 16, 32768, 32, 8, 128, True),
    ("paged B8 T1 S32768 H32/8 D128 page 16", "paged", 8, 1, 32768, 32, 8, 128, False),
    ("paged B8 T16 S32768 H32/8 D128 page 16", "paged", 8, 16, 32768, 32, 8, 128, True),
    ("paged B8 T1 S32768 H32/8 D128 page 64 ragged", "paged", 8, 1, 32768, 32, 8, 128, False),
]
PAGE = 64  # a paged row's page size unless its name says `page N`


def page_of(case) -> int:
  """The page size of a paged row: `page N` in its name, else PAGE."""
  words = case[0].split()
  return int(words[words.index("page") + 1]) if "page" in words else PAGE


# How float8 pages are cut (`--paged-configs`): rule -> (`sm90_decode.plan`'s
# `fp8_pages_factor` (`sm90_decode.FP8_PAGES_SPLITS_FACTOR`), changes to the
# plan's config). Factor None: the ragged plan (16 splits at B8 S32k; on the
# forward's persistent grid until 2026-12-08); 1: the contiguous float8
# cache's plan (2 splits, a CTA per item; the default since 2026-12-07); 2
# and 8: that with up to 2x / 8x its splits, a CTA per item (ragged rows'
# balance). The runs of 2026-12-07 also varied the one consumer's registers
# (224, 256), a config that left the code (last in 0180d5c). The page-16
# rows take PAGE16_RULES, the others all; CONTIGUOUS_TWINS are also timed on
# the contiguous cache (page-64 full rows). A rule whose plan is the
# default's is printed, not timed twice.
PAGED_RULES = {
    "ragged": (None, None),
    "contiguous plan": (1, None),
    "contiguous plan x2": (2, None),
    "contiguous plan x8": (8, None),
}
PAGE16_RULES = ("contiguous plan", "contiguous plan x2")
CONTIGUOUS_TWINS = ("contiguous plan", "contiguous plan x2")
# The row every decode candidate runs on (`--decode-configs`): issue #55's.
CASES_DECODE_FIRST = "decode B8 T1 S32768 H32/8 D128"


# label -> changes to the heuristic's config (`--configs`). float8 halves the
# GEMM time per score and leaves the softmax's, so D = 128 in float8 has the
# balance of D = 64 in bfloat16 (three consumers without turns there) and
# D = 256 that of D = 128. "P regs": P the P V wgmma's A operand in
# registers (`ForwardConfig.fp8_p_in_registers`) instead of an SMEM round trip.
CONFIG_CANDIDATES = {
    128: {
        "P regs": dict(fp8_p_in_registers=True),
        "P regs s3": dict(fp8_p_in_registers=True, num_kv_stages=3),
        "P regs kv192": dict(fp8_p_in_registers=True, block_kv=192),
        "kv128 s3": dict(num_kv_stages=3),
        "kv128 s4": dict(num_kv_stages=4),
        "sum before": dict(sum_before_handoff=True),
        "kv192": dict(block_kv=192),
        "kv256": dict(block_kv=256),
        "3 consumers": dict(num_consumers=3, pingpong=False, producer_registers=24,
                            consumer_registers=160, sum_before_handoff=True,
                            conditional_rescale=True),
        "3 consumers s3": dict(num_consumers=3, pingpong=False, producer_registers=24,
                               consumer_registers=160, sum_before_handoff=True,
                               conditional_rescale=True, num_kv_stages=3),
    },
    # 128-key blocks do not fit SMEM at D = 256 in float8 (240 KiB with the
    # O tiles and the P staging), nor do four stages of 64 keys.
    256: {
        "kv64 s3": dict(num_kv_stages=3),
        "kv64 after": dict(sum_before_handoff=False),
        "kv64 after P regs": dict(sum_before_handoff=False, fp8_p_in_registers=True),
    },
}


def config_columns(q8, k8, v8, descales, d, causal):
  """`fp8 <label>` columns: the sm90 kernel under each candidate config."""
  import dataclasses

  from fa4_jax.kernels import sm90_forward

  mask, _ = bench_common.case_mask(causal, None)
  base = sm90_forward.choose_config(d, mask, k8.shape[1], q8.shape[1])
  columns = {}
  for label, changes in CONFIG_CANDIDATES.get(d, {}).items():
    try:
      config = dataclasses.replace(base, **changes)
    except ValueError as e:
      print("skip", label, e, flush=True)
      continue
    if not config.fits_smem(d, 2, False, d, fp8=True):
      config = dataclasses.replace(config, q_buffers=1)
    call = lambda q, k, v, qd, kd, vd, config=config: sm90_forward.forward(
        q, k, v, None, None, score=ScoreFunction(d ** -0.5), mask=mask, config=config,
        descales=(qd, kd, vd))[0]
    columns[f"fp8 {label}"] = (call, (q8, k8, v8, *descales))
  return columns


# Keys per block beside the heuristic's 128 under `--row-sums`, dense D128
# rows only: without the FADD sums (which kept the f32 P alive past the
# hand-off) 192- and 256-key blocks fit the consumers' registers without a
# spill (with them, they spill); causal rows spill in their masked blocks
# (tools/fp8_sass_counts.py --set block_kv=N).
ROW_SUM_BLOCKS = (192, 256)


def row_sum_columns(q8, k8, v8, descales, d, causal):
  """`fp8 row sums on tc[ kvN]`: the heuristic's float8 config with the row
  sums on the tensor core (`ForwardConfig.fp8_row_sums_on_tensor_core`),
  and on dense D128 rows with `ROW_SUM_BLOCKS` keys per block (three stages
  where SMEM holds them, else two)."""
  import dataclasses

  from fa4_jax.kernels import sm90_forward

  mask, _ = bench_common.case_mask(causal, None)
  base = sm90_forward.fp8_config(sm90_forward.choose_config(d, mask, k8.shape[1], q8.shape[1]),
                                 mask, d, d, False)
  # two consumers with turns, as when these columns were measured
  base = dataclasses.replace(base, fp8_row_sums_on_tensor_core=True, **_SERIAL)
  configs = {"fp8 row sums on tc": base}
  if d == 128 and not causal:
    for block_kv in ROW_SUM_BLOCKS:
      config = dataclasses.replace(base, block_kv=block_kv)
      if not config.fits_smem(d, 2, False, d, fp8=True):
        config = dataclasses.replace(config, num_kv_stages=2)
      configs[f"fp8 row sums on tc kv{block_kv}"] = config
  columns = {}
  for label, config in configs.items():
    call = lambda q, k, v, qd, kd, vd, config=config: sm90_forward.forward(
        q, k, v, None, None, score=ScoreFunction(d ** -0.5), mask=mask, config=config,
        descales=(qd, kd, vd))[0]
    columns[label] = (call, (q8, k8, v8, *descales))
  return columns


# `--overlap` (issue #55): the float8 kernel's serial schedules on the
# heuristic's float8 config (row sums on the tensor core at D128), D128
# prefill rows. "fp8 serial kv256" is the dense default before 2026-12-07;
# from then until 2026-12-08 the default was FA3's intra-warpgroup overlap
# on 128-key blocks (its columns left with it, last in 0180d5c), since then
# "fp8 serial kv128 3 consumers". Without the consumers' turns
# (`pingpong=False`, "no turns") the softmaxes may run at once. Entries:
# label -> (changes to the heuristic's float8 config, on causal rows too);
# each sets the turns itself.
_SERIAL = dict(pingpong=True)
_SERIAL_NO_TURNS = dict(pingpong=False)
SERIAL_BLOCKS = {
    "fp8 serial kv256": (dict(block_kv=256, num_kv_stages=2, **_SERIAL), False),
    "fp8 serial kv128": (dict(block_kv=128, num_kv_stages=2, **_SERIAL), True),
    "fp8 serial kv128 no turns": (dict(block_kv=128, num_kv_stages=2, **_SERIAL_NO_TURNS), True),
    # Three consumers, serial, no turns (192-row CTAs at 160 registers): local
    # ptxas, B2 S8192: dense 411 instructions a block, no spill; causal spills
    # 11 loads in the masked loop only. (The notes: "A model that fits".)
    "fp8 serial kv128 3 consumers": (dict(block_kv=128, num_kv_stages=2, num_consumers=3,
                                          producer_registers=24, consumer_registers=160,
                                          **_SERIAL_NO_TURNS), True),
    # the same with three stages: 440 instructions a block, no spill (dense)
    "fp8 serial kv128 s3 3 consumers": (dict(block_kv=128, num_kv_stages=3, num_consumers=3,
                                             producer_registers=24, consumer_registers=160,
                                             **_SERIAL_NO_TURNS), True),
}


def serial_columns(q8, k8, v8, descales, d, causal):
  """`fp8 serial ...`: the heuristic's float8 config under each of
  `SERIAL_BLOCKS`."""
  import dataclasses

  from fa4_jax.kernels import sm90_forward

  if d != 128:
    return {}
  mask, _ = bench_common.case_mask(causal, None)
  base = sm90_forward.fp8_config(sm90_forward.choose_config(d, mask, k8.shape[1], q8.shape[1]),
                                 mask, d, d, False)
  columns = {}
  for label, (changes, with_causal) in SERIAL_BLOCKS.items():
    config = dataclasses.replace(base, **changes)
    if (causal and not with_causal) or not config.fits_smem(d, 2, False, d, fp8=True):
      continue
    call = lambda q, k, v, qd, kd, vd, config=config: sm90_forward.forward(
        q, k, v, None, None, score=ScoreFunction(d ** -0.5), mask=mask, config=config,
        descales=(qd, kd, vd))[0]
    columns[label] = (call, (q8, k8, v8, *descales))
  return columns


# label -> how the decode arrangement cuts a float8 decode row (`--decode-configs`):
# a function of the call's shapes returning (splits, config or None), or None
# where the candidate does not apply. `fp8_rule` takes the float8 plan's
# config rule (`sm90_decode.fp8_cache_decode_config`); `ALL_ROWS` marks the
# candidates run on every decode row, the others only on the first (B8 S32k D128).
def _decode_candidates():
  import dataclasses

  from fa4_jax.kernels import sm90_decode, sm90_forward
  from fa4_jax.scores import MaskSpec

  def plan(q_shape, k_shape, **kw):
    return sm90_decode.plan(q_shape, k_shape, MaskSpec(), **kw)

  all_sms = lambda q, k: plan(q, k, streams=sm90_forward.sm_count()).splits
  paged = lambda q, k: plan(q, k, ragged=True).splits  # the paged call's splits

  def two_consumers(stages):
    """All SMs, the forward's config for the chunk as the kernel shrinks it
    (two consumers at D128, 64-key slots), on `stages` slots."""
    def candidate(q_shape, k_shape):
      p = all_sms(q_shape, k_shape)
      b, t, n, d = q_shape
      config = sm90_forward.fp8_cache_config(
          sm90_forward.choose_config(d, MaskSpec(), kv_seq=k_shape[1] // p,
                                     q_seq=t * n // k_shape[2]), d, d)
      if config.persistent:
        return None
      config = dataclasses.replace(config, num_kv_stages=stages)
      return (p, config) if config.fits_smem(d, 2, False, d, fp8_cache=True) else None
    return candidate

  def split_keys(changes):
    """The float8 plan (issue #55: two consumers on halves of each CTA's key
    blocks, merged at the end, `ForwardConfig.consumers_split_keys`) with
    `changes`."""
    def candidate(q_shape, k_shape):
      got = plan(q_shape, k_shape, fp8_cache=True)
      if got is None or got.config is None or not got.config.consumers_split_keys:
        return None
      config = dataclasses.replace(got.config, **changes)
      d = q_shape[-1]
      return (got.splits, config) if config.fits_smem(d, 2, False, d, fp8_cache=True) else None
    return candidate

  return {
      # Two chains of widening + GEMMs + softmax per CTA (issue #55, branch
      # h55d; docs/performance-notes.md, "Float8 cache decode: widening
      # beside the consumer"): the default, D128 two 128-key slots (each
      # consumer owns one), D64 four; here 64-key blocks on four slots (two
      # per consumer).
      "split keys kv64 s4": split_keys(dict(block_kv=64, num_kv_stages=4)),
      # The former default: the bf16 call's plan, the kernel shrinking its config.
      "16-bit plan": lambda q, k: (lambda x: (x.splits, x.config))(plan(q, k)),
      # The paged call's shape on the contiguous cache: its splits (8 waves of
      # the SMs) and the forward's config for its chunk (a persistent grid).
      "paged shape": lambda q, k: (paged(q, k), None),
      # The 16-bit plan's config, splits for every SM.
      "all SMs": lambda q, k: (all_sms(q, k), None),
      "all SMs 2c kv64 s5": two_consumers(5),
  }


ALL_ROWS = ("split keys kv64 s4", "16-bit plan", "paged shape", "all SMs")


def decode_plan_columns(q, k8, v8, kd, vd, first_row):
  """`fp8 dec <label>` columns: the decode arrangement under each of the
  decode candidates (duplicates of an earlier candidate's plan, and of the
  default plan, are left out; the label says which)."""
  from fa4_jax.kernels import sm90_decode
  from fa4_jax.scores import MaskSpec

  d = q.shape[-1]
  default = sm90_decode.plan(q.shape, k8.shape, MaskSpec(), fp8_cache=True)
  seen = {(default.splits, default.config): "default"}
  columns = {}
  for label, rule in _decode_candidates().items():
    if not first_row and label not in ALL_ROWS:
      continue
    try:
      got = rule(q.shape, k8.shape)
    except Exception as e:  # a candidate that cannot be built is skipped, not fatal
      print("skip", label, type(e).__name__, e, flush=True)
      continue
    if got is None:
      print("skip", label, "(does not apply)", flush=True)
      continue
    if got in seen:
      print(f"skip {label}: the plan of {seen[got]}", got, flush=True)
      continue
    seen[got] = label
    print(f"fp8 dec {label}: splits={got[0]} config={got[1]}", flush=True)
    columns[f"fp8 dec {label}"] = (decode_call(d, sm90_decode.DecodePlan(*got)),
                                   (q, k8, v8, kd, vd))
  return columns


def decode_call(d, decode_plan):
  """f(q, k8, v8, kd, vd): the decode arrangement on a float8 cache (head
  dim `d`, no mask) under `decode_plan` (`sm90_decode.DecodePlan`)."""
  from fa4_jax.kernels import sm90_decode
  from fa4_jax.scores import MaskSpec

  return lambda q, k, v, kd, vd: sm90_decode.forward(
      q, k, v, None, None, score=ScoreFunction(d ** -0.5), mask=MaskSpec(), plan=decode_plan,
      descales=(None, kd, vd))[0]


def paged_plan_columns(q, kp, vp, kd, vd, table, lengths, causal):
  """`fp8 paged dec 16-bit plan`: float8 pages under the plan they took
  before `backends.paged_decode_plan` gave them the float8 decode config
  (the paged call's splits and the 16-bit config, which the kernel shrinks
  for the widened tiles), beside the `fp8 paged` column (the default now:
  the same splits, `sm90_decode.fp8_cache_decode_config`). H200,
  2026-12-06, B8 T1 S32k D128 page 64: 3.77 TB/s before, 4.42 under the
  float8 config (then a column of its own, `fp8 paged dec 1c kv128 s4
  persistent`)."""
  from fa4_jax.kernels import sm90_decode
  from fa4_jax.scores import MaskSpec

  b, t, n, d = q.shape
  k_shape = (b, table.shape[1] * kp.shape[1], kp.shape[2], d)
  mask = MaskSpec(right=0, offset_from_lengths=True) if causal else MaskSpec()
  old = sm90_decode.plan(q.shape, k_shape, mask, ragged=True, granule=kp.shape[1])
  new = sm90_decode.plan(q.shape, k_shape, mask, ragged=True, granule=kp.shape[1],
                         fp8_cache=True)
  if old is None or old == new:
    return {}
  label = "fp8 paged dec 16-bit plan"
  print(f"{label}: {old}; the default: {new}", flush=True)
  call = lambda q, kp, vp, kd, vd: sm90_decode.forward(
      q, kp, vp, None, lengths, score=ScoreFunction(d ** -0.5), mask=mask, plan=old,
      page_table=table, descales=(None, kd, vd))[0]
  return {label: (call, (q, kp, vp, kd, vd))}


def paged_rule_columns(q, k8, v8, kp, vp, kd, vd, table, lengths, causal, rules=None,
                       twins=()):
  """`fp8 paged <rule>` for each of `rules` (None: all of `PAGED_RULES`) and
  `fp8 dec <rule>` for those in `twins`: float8 pages, and the same float8
  cache laid out contiguously, under the rule's plan; a plan equal to the
  default's on that layout (the `fp8 paged` / `fp8` columns) or to an earlier
  rule's is left out (printed)."""
  import dataclasses

  from fa4_jax.kernels import sm90_decode
  from fa4_jax.scores import MaskSpec

  b, t, n, d = q.shape
  page = kp.shape[1]
  k_shape = (b, table.shape[1] * page, kp.shape[2], d)
  mask = MaskSpec(right=0, offset_from_lengths=True) if causal else MaskSpec()
  score = ScoreFunction(d ** -0.5)
  paged_default = sm90_decode.plan(q.shape, k_shape, mask, ragged=True, granule=page,
                                   fp8_cache=True, paged=True)
  contiguous_default = sm90_decode.plan(
      q.shape, k_shape, MaskSpec(right=0, q_offset=k_shape[1] - t) if causal else MaskSpec(),
      fp8_cache=True)
  seen_paged, seen_contiguous = {paged_default: "fp8 paged"}, {contiguous_default: "fp8"}
  columns = {}

  def add(seen, label, p, args, **layout):
    """Column `label`: the decode kernel under plan `p` on `args` (q, k or key
    pages, v or value pages, descales), unless `seen` has the plan already."""
    if p in seen:
      print(f"  {label}: the plan of {seen[p]}", flush=True)
      return
    seen[p] = label
    columns[label] = (lambda q, k, v, kd, vd: sm90_decode.forward(
        q, k, v, None, lengths, score=score, mask=mask, plan=p, descales=(None, kd, vd),
        **layout)[0], args)
  for rule, (factor, changes) in PAGED_RULES.items():
    if rules is not None and rule not in rules:
      continue
    p = sm90_decode.plan(q.shape, k_shape, mask, ragged=True, granule=page, fp8_cache=True,
                         paged=True, fp8_pages_factor=factor)
    if changes:
      p = sm90_decode.DecodePlan(p.splits, dataclasses.replace(p.config, **changes))
    print(f"paged rule {rule}: {p}", flush=True)
    add(seen_paged, f"fp8 paged {rule}", p, (q, kp, vp, kd, vd), page_table=table)
    if rule in twins:
      add(seen_contiguous, f"fp8 dec {rule}", p, (q, k8, v8, kd, vd))
  return columns


def quantized(x, axis_heads=2):
  """(float8 array, float32 per-head descale) with each head's largest
  magnitude mapped to 448 (e4m3's largest finite value)."""
  amax = jnp.abs(x.astype(jnp.float32)).max(axis=tuple(i for i in range(x.ndim)
                                                       if i != axis_heads))
  descale = jnp.maximum(amax, 1e-6) / 448.0
  shape = [1] * x.ndim
  shape[axis_heads] = -1
  return (x.astype(jnp.float32) / descale.reshape(shape)).astype(F8), descale


def case_inputs(case):
  """The row's inputs by name: bfloat16 q, k, v; the float8 cache k8, v8
  and its per-head descales kd, vd; prefill rows also q8, qd; paged rows
  the float8 pages kp8, vp8 (`page_table`). Under `jax.eval_shape`, their
  shapes (`fp8_ptxas.py` lowers the calls on those)."""
  name, kind, b, t, s, hq, hkv, d, causal = case
  keys = jax.random.split(jax.random.key(0), 3)
  x = dict(q=jax.random.normal(keys[0], (b, t, hq, d), jnp.bfloat16),
           k=jax.random.normal(keys[1], (b, s, hkv, d), jnp.bfloat16),
           v=jax.random.normal(keys[2], (b, s, hkv, d), jnp.bfloat16))
  x["k8"], x["kd"] = quantized(x["k"])
  x["v8"], x["vd"] = quantized(x["v"])
  if kind == "prefill":
    x["q8"], x["qd"] = quantized(x["q"])
  if kind == "paged":
    table, _ = page_table(case)
    page = page_of(case)
    pages = b * s // page
    to_pages = lambda a: jnp.zeros((pages, page) + a.shape[2:], a.dtype).at[
        table.reshape(-1)].set(a.reshape((pages, page) + a.shape[2:]))
    x["kp8"], x["vp8"] = to_pages(x["k8"]), to_pages(x["v8"])
  return x


def page_table(case):
  """(table [B, S / page], lengths [B]) of a paged row: its pages in a fixed
  shuffled order, every row full (`ragged` rows: lengths spread evenly from
  S/16 to S, in a shuffled order)."""
  name, kind, b, t, s, hq, hkv, d, causal = case
  page = page_of(case)
  order = jnp.asarray(np.random.default_rng(0).permutation(b * s // page), jnp.int32)
  lengths = np.full((b,), s)
  if name.endswith("ragged"):
    lengths = np.random.default_rng(1).permutation(np.linspace(s // 16, s, b).astype(int))
  return order.reshape(b, s // page), jnp.asarray(lengths, jnp.int32)


def case_calls(case, x, configs=False, decode_configs=False, paged_configs=False,
               row_sums=False, xla_column=True, overlap=False):
  """(calls, served): the row's columns, name -> (function, its arguments
  from `x`, `case_inputs`), and the implementation that serves the float8
  column (`which_implementation`)."""
  name, kind, b, t, s, hq, hkv, d, causal = case
  q, k, v, k8, kd, v8, vd = (x[n] for n in ("q", "k", "v", "k8", "kd", "v8", "vd"))
  alignment = dict(causal_alignment="bottom_right") if causal and t < s else {}
  bf16 = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=causal, **alignment)
  xla = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=causal, implementation="xla",
                                         **alignment)
  calls = {"bf16": (bf16, (q, k, v)), "xla": (xla, (q, k, v))}
  if not xla_column:
    del calls["xla"]
  if paged_configs and kind == "paged":  # the float8 columns against each other only
    del calls["bf16"]
  if kind == "prefill":
    q8, qd = x["q8"], x["qd"]
    fp8 = lambda q, k, v, qd, kd, vd: fa4_jax.attention(
        q, k, v, is_causal=causal, query_descale=qd, key_descale=kd, value_descale=vd)
    calls["fp8"] = (fp8, (q8, k8, v8, qd, kd, vd))
    if configs:
      calls.update(config_columns(q8, k8, v8, (qd, kd, vd), d, causal))
    if row_sums:
      calls.update(row_sum_columns(q8, k8, v8, (qd, kd, vd), d, causal))
    if overlap:
      calls.update(serial_columns(q8, k8, v8, (qd, kd, vd), d, causal))
    served = traced(lambda q8, k8, v8, qd, kd, vd: fa4_jax.which_implementation(
        q8, k8, v8, is_causal=causal, query_descale=qd, key_descale=kd, value_descale=vd),
        q8, k8, v8, qd, kd, vd)
  else:
    if kind == "paged" and name.endswith("ragged"):  # the contiguous cache at the rows' lengths
      alignment["key_value_seq_lengths"] = page_table(case)[1]
    # The kernel by name (`fp8 default` below: what implementation=None picks).
    fp8 = lambda q, k, v, kd, vd: fa4_jax.attention(q, k, v, is_causal=causal, key_descale=kd,
                                                    value_descale=vd, implementation="sm90",
                                                    **alignment)
    calls["fp8"] = (fp8, (q, k8, v8, kd, vd))
    if not (paged_configs and kind == "paged"):
      calls["fp8 default"] = (lambda q, k, v, kd, vd: fa4_jax.attention(
          q, k, v, is_causal=causal, key_descale=kd, value_descale=vd, **alignment),
          (q, k8, v8, kd, vd))
    served = traced(lambda q, k8, v8, kd, vd: fa4_jax.which_implementation(
        q, k8, v8, is_causal=causal, implementation="sm90", key_descale=kd, value_descale=vd,
        **alignment), q, k8, v8, kd, vd)
    if decode_configs and kind == "decode" and served == "sm90_decode":
      calls.update(decode_plan_columns(q, k8, v8, kd, vd, first_row=name == CASES_DECODE_FIRST))
  if kind == "paged":
    table, lengths = page_table(case)
    paged = lambda q, kp, vp, kd, vd: fa4_jax.paged_attention(
        q, kp, vp, table, lengths, is_causal=causal, key_descale=kd, value_descale=vd,
        implementation="sm90")
    calls["fp8 paged"] = (paged, (q, x["kp8"], x["vp8"], kd, vd))
    if decode_configs:
      calls.update(paged_plan_columns(q, x["kp8"], x["vp8"], kd, vd, table, lengths, causal))
    if paged_configs:  # the contiguous twins once, on the full page-64 rows
      ragged, small = name.endswith("ragged"), page_of(case) != PAGE
      calls.update(paged_rule_columns(
          q, k8, v8, x["kp8"], x["vp8"], kd, vd, table, lengths, causal,
          rules=PAGE16_RULES if small else None,
          twins=() if ragged or small else CONTIGUOUS_TWINS))
  return calls, served


def traced(fn, *args):
  """What `fn(*args)` returns (a `which_implementation` answer), `args`
  traced: arrays, or their shapes (`jax.ShapeDtypeStruct`s)."""
  out = []
  jax.eval_shape(lambda *a: out.append(fn(*a)), *args)
  return out[0]


def run_case(case, rounds, configs=False, decode_configs=False, paged_configs=False,
             row_sums=False, xla_column=True, overlap=False):
  name, kind, b, t, s, hq, hkv, d, causal = case
  x = case_inputs(case)
  calls, served = case_calls(case, x, configs, decode_configs, paged_configs, row_sums,
                             xla_column, overlap)
  bf16_bytes = 2 * x["k"].size * x["k"].dtype.itemsize
  row = dict(case=name, kind=kind, served_by=served, bf16_kv_bytes=bf16_bytes,
             flops=4 * b * hq * t * s * d * (0.5 if causal and t == s else 1.0))
  row.update(bench_common.bandwidth_columns(calls, rounds, bf16_bytes,
                                            "xla" if "xla" in calls else "fp8"))
  return [row]


def markdown(rows):
  cols = ["bf16", "fp8", "fp8 paged", "fp8 default", "xla"]
  cols += sorted({c for r in rows for c in r if c.startswith("fp8 ") and c not in cols})
  lines = ["| case | served | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
  for r in rows:
    if r["kind"] == "prefill":
      fmt = lambda c, r=r: f"{r['flops'] / c['ms'] / 1e9:.0f} TFLOP/s"
    else:
      fmt = lambda c: f"{c['tb_per_s']:.2f} TB/s (bf16 bytes)"
    cells = [bench_common.table_cell(r.get(c), fmt) for c in cols]
    lines.append(f"| {r['case']} | {r['served_by']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main():
  bench_common.table_main(
      "fp8", CASES,
      lambda case, args: run_case(case, args.rounds, args.configs, args.decode_configs,
                                  args.paged_configs, args.row_sums, not args.no_xla,
                                  args.overlap),
      markdown,
      lambda a: ("e4m3 with per-head descales (amax / 448); kernel-duration sums in profiler "
                 f"traces, medians of {a.rounds} interleaved rounds; decode and paged TB/s: the "
                 "bf16 cache's K and V bytes over each column's time"),
      default_rounds=3,
      add_arguments=add_arguments)


def add_arguments(ap):
  ap.add_argument("--configs", action="store_true",
                  help="prefill rows: also the float8 kernel under each of CONFIG_CANDIDATES")
  ap.add_argument("--decode-configs", action="store_true",
                  help="decode rows: also the decode arrangement under each of "
                       "_decode_candidates (all of them on the B8 S32k D128 row)")
  ap.add_argument("--paged-configs", action="store_true",
                  help="paged rows: also float8 pages (and on page-64 rows the contiguous "
                       "cache) under each of PAGED_RULES")
  ap.add_argument("--row-sums", action="store_true",
                  help="prefill rows: also the float8 kernel with the row sums on the tensor "
                       "core (ForwardConfig.fp8_row_sums_on_tensor_core)")
  ap.add_argument("--overlap", action="store_true",
                  help="D128 prefill rows: also the float8 kernel's serial schedules (two "
                       "consumers with and without turns, three consumers) under SERIAL_BLOCKS")
  ap.add_argument("--no-xla", action="store_true",
                  help="leave out the XLA column (max_abs_diff then against `fp8`)")


if __name__ == "__main__":
  main()
