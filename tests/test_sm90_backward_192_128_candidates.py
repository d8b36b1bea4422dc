"""The 192 / 128 backward configurations under test for issue #56, on the CPU.

The heuristic runs 192 / 128 as two dK/dV passes and the dQ kernel
(`sm90_backward.choose_config`); these are the candidates the GPU is to
time beside it (`benchmarks/bench_backward.py --only D192/128 --config ...`):

* the fused dK/dV kernel on 32-row query tiles, lse2 and delta folded into
  the S^T / dP^T accumulators (`sm90_backward.FUSED_DKV_192_128`; set as
  `DKV_AT_192_128`, `choose_config` takes it at 192 / 128);
* the head-split kernel's CTA with warpgroup 0 keeping dV (and computing
  P^T and dS^T) and warpgroup 1 keeping dK (`sm90_backward.
  DV_DK_SPLIT_192_128`, "dv_dk_split"), and with 64 of dK's columns on
  warpgroup 0 (`wg0_dk_columns=64`);
* two passes with three stages of Q and dO.

Each runs in Pallas' GPU interpreter with race detection at small shapes
(dense with lengths that are not multiples of 8 and kv lengths, causal with
GQA, one soft-capped) against jax.grad of an f32 einsum attention
(`reference.einsum_attention`), and cross-lowers for sm_90 within the SMEM
limit with the wgmma widths its scheme implies.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax.kernels import sm90_backward
from fa4_jax.kernels.sm90_backward_dkdv import DkvConfig
from fa4_jax.scores import MaskSpec, ScoreFunction
from fa4_jax.testing import SMEM_LIMIT_BYTES
from reference import einsum_attention, relative_error, visible_mask

D, DV = 192, 128
CAUSAL = MaskSpec(right=0)


def _candidate(name: str, mask: MaskSpec) -> sm90_backward.BackwardConfig:
  base = sm90_backward.choose_config(D, mask, value_head_dim=DV)
  fused = sm90_backward.FUSED_DKV_192_128
  dkv = {
      "fused_q32_fold": fused,
      "two_passes_3_stages": dataclasses.replace(base.dkv, num_stages=3),
      "dv_dk_split": sm90_backward.DV_DK_SPLIT_192_128,
      "dv_dk_split_wg0_64": dataclasses.replace(sm90_backward.DV_DK_SPLIT_192_128,
                                                wg0_dk_columns=64),
  }[name]
  return dataclasses.replace(base, dkv=dkv)


# (candidate, causal, (t, s), query heads, kv heads, kv lengths, soft-cap)
CASES = {
    "fused_q32_fold_dense_odd_lengths": ("fused_q32_fold", False, (75, 93), 1, 1, (93, 41), None),
    "fused_q32_fold_causal_gqa_soft_cap": ("fused_q32_fold", True, (93, 93), 2, 1, None, 20.0),
    "two_passes_3_stages_causal_gqa": ("two_passes_3_stages", True, (93, 93), 2, 1, None, None),
    "dv_dk_split_dense_odd_lengths": ("dv_dk_split", False, (75, 93), 2, 1, (93, 41), None),
    "dv_dk_split_causal_gqa_soft_cap": ("dv_dk_split", True, (93, 93), 2, 1, None, 20.0),
    "dv_dk_split_wg0_64_causal_gqa": ("dv_dk_split_wg0_64", True, (93, 93), 2, 1, None, None),
}


def check_gradients(run_interpreted, case):
  """Gradients of `case` (a `CASES` value) in the interpreter against
  jax.grad of the f32 einsum attention."""
  candidate, causal, (t, s), n, k, kv_lengths, soft_cap = case
  b = 1 if kv_lengths is None else len(kv_lengths)
  rng = np.random.default_rng(0)
  make = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  q, key, v, dout = make(b, t, n, D), make(b, s, k, D), make(b, s, k, DV), make(b, t, n, DV)
  mask = CAUSAL if causal else MaskSpec()
  config = _candidate(candidate, mask)
  kv_len = None if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32)
  visible = visible_mask(t, s, is_causal=causal, kv_lengths=kv_lengths, batch=b)
  scale = D ** -0.5
  out, lse = einsum_attention(q, key, v, visible, scale=scale, soft_cap=soft_cap)
  grads = run_interpreted(
      lambda *xs: sm90_backward.backward(*xs, None, kv_len, score=ScoreFunction(scale, soft_cap),
                                         mask=mask, config=config),
      q, key, v, out.astype(q.dtype), lse, dout)
  loss = lambda q, key, v: (einsum_attention(q, key, v, visible, scale=scale,
                                             soft_cap=soft_cap)[0]
                            * dout.astype(jnp.float32)).sum()
  f32 = lambda x: x.astype(jnp.float32)
  want = jax.grad(loss, argnums=(0, 1, 2))(f32(q), f32(key), f32(v))
  # bf16 operands, P and dS rounded to bf16 before their GEMMs, f32
  # accumulation: 2-3e-3 (as in test_sm90_backward_value_head_dim.py).
  for g_name, got, w, x in zip(("dq", "dk", "dv"), grads, want, (q, key, v)):
    assert got.shape == x.shape and got.dtype == x.dtype, g_name
    assert relative_error(got, w) < 1e-2, (g_name, relative_error(got, w))


@pytest.mark.parametrize("name", [n for n in CASES if not n.startswith("dv_dk_split")])
def test_gradients_match_an_f32_einsum(run_interpreted, name):
  check_gradients(run_interpreted, CASES[name])


@pytest.mark.parametrize("candidate", ["fused_q32_fold", "two_passes_3_stages", "dv_dk_split"])
def test_candidates_cross_lower_within_smem(cross_lower, candidate):
  config = _candidate(candidate, CAUSAL)
  q = jax.ShapeDtypeStruct((1, 1024, 2, D), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 1024, 2, DV), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((1, 2, 1024), jnp.float32)
  lowered = cross_lower(
      lambda q, k, v, o, lse: sm90_backward.backward(
          q, k, v, o, lse, o, None, None, score=ScoreFunction(0.1), mask=CAUSAL, config=config),
      q, q, v, v, lse, arch="sm_90")
  assert 0 < lowered.max_smem_bytes <= SMEM_LIMIT_BYTES, lowered.smem_bytes
  widths = [collections.Counter(int(n) for n in re.findall(
      r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", m)) for m in lowered.modules]
  if config.dkv.dk_dv == "fused":
    # One dK/dV kernel: S^T and dP^T at N = 32 (the query tile), dV at Dv,
    # dK at D; then the dQ kernel.
    assert len(widths) == 2 and set(widths[0]) == {32, DV, D}, widths
  elif config.dkv.dk_dv == "dv_dk_split":
    # S^T and dP^T at N = 64, dV whole (Dv), dK whole (D): no half widths.
    assert len(widths) == 2 and set(widths[0]) == {64, DV, D}, widths
  else:
    assert len(widths) == 3 and set(widths[1]) == {64, DV}, widths


@pytest.mark.parametrize("dkv", ["FUSED_DKV_192_128", "DV_DK_SPLIT_192_128"])
def test_the_switch_changes_192_128_alone(monkeypatch, dkv):
  masks = (MaskSpec(), CAUSAL, MaskSpec(left=255, right=0))
  pairs = [(64, None), (128, None), (128, 64), (192, None), (192, 64), (192, 128), (256, None),
           (256, 128)]
  before = {(d, dv, m, g): sm90_backward.choose_config(d, m, g, value_head_dim=dv)
            for d, dv in pairs for m in masks for g in (1, 4)}
  assert all(c.dkv.dk_dv == "two_passes" for (d, dv, _, _), c in before.items()
             if (d, dv) == (192, 128))
  wanted = getattr(sm90_backward, dkv)
  assert isinstance(wanted, DkvConfig)
  monkeypatch.setattr(sm90_backward, "DKV_AT_192_128", wanted)
  for (d, dv, m, g), config in before.items():
    now = sm90_backward.choose_config(d, m, g, value_head_dim=dv)
    if (d, dv) == (192, 128):
      assert now.dkv == wanted and now.dq == config.dq
    else:
      assert now == config, (d, dv, m, g)
