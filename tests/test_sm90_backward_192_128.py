"""The 192 / 128 backward's dK/dV scheme (issue #56), on the CPU.

At 192 / 128 `sm90_backward.choose_config` takes `DKV_AT_192_128`:
"dv_dk_split", the head-split kernel's CTA with warpgroup 0 computing P^T
and dS^T and keeping dV and 64 of dK's columns, warpgroup 1 keeping dK's
other 128 (measured fastest on an H100, 2026-12-07, against the two passes
it replaced, the fused kernel on 32-row query tiles and dK wholly on
warpgroup 1; docs/performance-notes.md). Here: the scheme with dK wholly on
warpgroup 1 (`wg0_dk_columns=0`) in Pallas' GPU interpreter with race
detection (test_sm90_backward_dv_dk_split.py runs the default's cases)
against jax.grad of an f32 einsum attention (`reference.einsum_attention`);
both cross-lower for sm_90 within the SMEM limit with the wgmma widths the
scheme implies; and the rule picks it at 192 / 128 alone.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from fa4_jax.kernels import sm90_backward
from fa4_jax.scores import MaskSpec, ScoreFunction
from fa4_jax.testing import SMEM_LIMIT_BYTES
from test_sm90_backward_value_head_dim import check_gradients as value_head_dim_check

D, DV = 192, 128
CAUSAL = MaskSpec(right=0)


def _candidate(name: str, mask: MaskSpec) -> sm90_backward.BackwardConfig:
  base = sm90_backward.choose_config(D, mask, value_head_dim=DV)
  dkv = {
      "dv_dk_split": dataclasses.replace(sm90_backward.DKV_AT_192_128, wg0_dk_columns=0),
      "dv_dk_split_wg0_64": sm90_backward.DKV_AT_192_128,
      # Issue #56's dK/dV candidates (branch h56k): dV on warpgroup 1 too,
      # beside all of dK or its last 128 columns; K (and V) as warpgroup 0's
      # register A operands (on hardware only: the interpreter keeps them in
      # SMEM), and warpgroup 0 on registers of its own.
      "wg1_dv": dataclasses.replace(sm90_backward.DKV_AT_192_128, wg0_dk_columns=0,
                                    wg1_dv=True),
      "wg1_dv_wg0_64": dataclasses.replace(sm90_backward.DKV_AT_192_128, wg1_dv=True),
      "wg1_dv_kv_in_registers": dataclasses.replace(
          sm90_backward.DKV_AT_192_128, wg0_dk_columns=0, wg1_dv=True,
          operands_in_registers=True),
      "wg1_dv_fold_stats": dataclasses.replace(
          sm90_backward.DKV_AT_192_128, wg0_dk_columns=0, wg1_dv=True,
          operands_in_registers=True, fold_stats=True),
      "fold_stats": dataclasses.replace(sm90_backward.DKV_AT_192_128, fold_stats=True),
      "k_in_registers": dataclasses.replace(sm90_backward.DKV_AT_192_128, k_in_registers=True),
      "kv_in_registers_wg0_256": dataclasses.replace(
          sm90_backward.DKV_AT_192_128, wg0_dk_columns=0, operands_in_registers=True,
          wg0_registers=256, consumer_registers=224),
  }[name]
  return dataclasses.replace(base, dkv=dkv)


# (candidate, causal, (t, s), query heads, kv heads, kv lengths, soft-cap)
CASES = {
    "dv_dk_split_dense_odd_lengths": ("dv_dk_split", False, (75, 93), 2, 1, (93, 41), None),
    "dv_dk_split_causal_gqa_soft_cap": ("dv_dk_split", True, (93, 93), 2, 1, None, 20.0),
    "dv_dk_split_wg0_64_causal_gqa": ("dv_dk_split_wg0_64", True, (93, 93), 2, 1, None, None),
    "wg1_dv_dense_odd_lengths": ("wg1_dv", False, (75, 93), 2, 1, (93, 41), None),
    "wg1_dv_wg0_64_causal_gqa_soft_cap": ("wg1_dv_wg0_64", True, (93, 93), 2, 1, None, 20.0),
    "wg1_dv_kv_in_registers_causal": ("wg1_dv_kv_in_registers", True, (93, 93), 1, 1, None,
                                      None),
    "wg1_dv_fold_stats_causal_gqa": ("wg1_dv_fold_stats", True, (93, 93), 2, 1, None, None),
    "wg1_dv_fold_stats_dense_soft_cap": ("wg1_dv_fold_stats", False, (75, 93), 2, 1, (93, 41),
                                         20.0),
    "fold_stats_causal": ("fold_stats", True, (93, 93), 1, 1, None, None),
    "k_in_registers_dense": ("k_in_registers", False, (75, 93), 1, 1, (93, 41), None),
    "kv_in_registers_wg0_256_causal_gqa": ("kv_in_registers_wg0_256", True, (93, 93), 2, 1,
                                           None, None),
}


def check_gradients(run_interpreted, case):
  """Gradients of `case` (a `CASES` value) in the interpreter against
  jax.grad of the f32 einsum attention."""
  candidate, causal, (t, s), n, k, kv_lengths, soft_cap = case
  b = 1 if kv_lengths is None else len(kv_lengths)
  value_head_dim_check(run_interpreted, (b, t, s, n, k), D, DV, causal, kv_lengths, soft_cap,
                       config=_candidate(candidate, CAUSAL if causal else MaskSpec()))


def causal_backward_within_smem(cross_lower, config):
  """The causal 192 / 128 backward under `config`, cross-lowered for sm_90
  (B1 S1024 H2), after checking that every kernel fits SMEM."""
  q = jax.ShapeDtypeStruct((1, 1024, 2, D), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 1024, 2, DV), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((1, 2, 1024), jnp.float32)
  lowered = cross_lower(
      lambda q, k, v, o, lse: sm90_backward.backward(
          q, k, v, o, lse, o, None, None, score=ScoreFunction(0.1), mask=CAUSAL, config=config),
      q, q, v, v, lse, arch="sm_90")
  assert 0 < lowered.max_smem_bytes <= SMEM_LIMIT_BYTES, lowered.smem_bytes
  return lowered


@pytest.mark.parametrize("candidate", ["dv_dk_split", "dv_dk_split_wg0_64", "wg1_dv",
                                       "wg1_dv_wg0_64", "wg1_dv_kv_in_registers",
                                       "wg1_dv_fold_stats", "fold_stats", "k_in_registers",
                                       "kv_in_registers_wg0_256"])
def test_candidates_cross_lower_within_smem(cross_lower, candidate):
  config = _candidate(candidate, CAUSAL)
  lowered = causal_backward_within_smem(cross_lower, config)
  widths = [collections.Counter(int(n) for n in re.findall(
      r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", m)) for m in lowered.modules]
  # S^T and dP^T at N = 64, dV whole (Dv); dK whole (D) on warpgroup 1, or
  # 64 of its columns on warpgroup 0 and 128 on warpgroup 1: no half widths.
  dk_widths = {D} if not config.dkv.wg0_dk_columns else {64, D - 64}
  assert len(widths) == 2 and set(widths[0]) == {64, DV} | dk_widths, widths


def test_the_rule_takes_dv_dk_split_at_192_128_alone():
  masks = (MaskSpec(), CAUSAL, MaskSpec(left=255, right=0))
  pairs = [(64, None), (128, None), (128, 64), (192, None), (192, 64), (192, 128), (256, None),
           (256, 128)]
  for d, dv in pairs:
    for m in masks:
      for g in (1, 4):
        config = sm90_backward.choose_config(d, m, g, value_head_dim=dv)
        if (d, dv) == (192, 128):
          assert config.dkv == sm90_backward.DKV_AT_192_128, (m, g)
        else:
          assert config.dkv.dk_dv != "dv_dk_split", (d, dv, m, g)
