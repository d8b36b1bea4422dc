"""The 192 / 128 dQ kernel's candidates (issue #56), on the CPU.

The dQ kernel at 192 / 128 (two consumers, 64-key tiles, Q and dO read
from SMEM by every S and dP wgmma) runs a third of the backward. Its
candidates, selectable by `benchmarks/bench_backward.py --config` and not a
default until timed:

- `q_in_registers` (a `DqConfig` field): Q alone as S's register A operand
  (48 registers), dO still from SMEM: S's wgmmas read only K from SMEM.
- 32-key tiles with Q and dO in registers (`operands_in_registers`, 80
  registers), four stages: every S and dP wgmma reads only its B operand.
- `issue_ahead` (a `DqConfig` field): the next block's S and dP wgmmas
  issued behind this block's dQ wgmma, before waiting for it; the slot is
  released once dQ's group alone has completed (`wgmma.wait_group 2`).

Here: both in Pallas' GPU interpreter with race detection against jax.grad
of an f32 einsum attention (the interpreter has no register A operands, so
it runs their SMEM path: the hardware path is the GPU benchmark's gradient
check), and both cross-lower for sm_90 within the SMEM limit, with the
register A operands in the dQ module where asked for.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import pytest

from fa4_jax.kernels import sm90_backward
from fa4_jax.scores import MaskSpec
from test_sm90_backward_192_128 import causal_backward_within_smem
from test_sm90_backward_value_head_dim import check_gradients as value_head_dim_check

D, DV = 192, 128
CAUSAL = MaskSpec(right=0)

# name: the dQ kernel's overrides (as bench_backward.py's `dq.KEY=` items)
CANDIDATES = {
    "default": {},
    "q_in_registers": dict(q_in_registers=True, producer_registers=24, consumer_registers=240),
    "kv32_operands_in_registers": dict(block_kv=32, num_stages=4, operands_in_registers=True,
                                       producer_registers=24, consumer_registers=240),
    "issue_ahead": dict(issue_ahead=True, producer_registers=24, consumer_registers=240),
}


def _config(name: str, mask: MaskSpec) -> sm90_backward.BackwardConfig:
  base = sm90_backward.choose_config(D, mask, value_head_dim=DV)
  return dataclasses.replace(base, dq=dataclasses.replace(base.dq, **CANDIDATES[name]))


# (candidate, causal, (t, s), query heads, kv heads, kv lengths)
CASES = {
    "q_in_registers_causal_gqa": ("q_in_registers", True, (93, 93), 2, 1, None),
    "kv32_dense_odd_lengths": ("kv32_operands_in_registers", False, (75, 93), 2, 1, (93, 41)),
    # masked, full and last blocks; consumer 0 skips the CTA's last block
    "issue_ahead_causal_gqa": ("issue_ahead", True, (93, 93), 2, 1, None),
    # one own block (the last alone) and, past the 40 rows, a consumer with none
    "issue_ahead_dense_short_rows": ("issue_ahead", False, (40, 93), 2, 1, (93, 41)),
}


@pytest.mark.parametrize("name", CASES)
def test_gradients_match_an_f32_einsum(run_interpreted, name):
  candidate, causal, (t, s), n, k, kv_lengths = CASES[name]
  b = 1 if kv_lengths is None else len(kv_lengths)
  value_head_dim_check(run_interpreted, (b, t, s, n, k), D, DV, causal, kv_lengths, None,
                       config=_config(candidate, CAUSAL if causal else MaskSpec()))


def _dq_module(cross_lower, name):
  lowered = causal_backward_within_smem(cross_lower, _config(name, CAUSAL))
  (dq,) = [m for m in lowered.modules if "sm90_dq" in m]
  return dq


def _wgmmas(module: str) -> collections.Counter:
  """(N, whether A is in registers) of every wgmma instruction of a lowered
  kernel module: a register A is a brace group after the accumulator's."""
  return collections.Counter(
      (int(n), bool(a)) for n, a in re.findall(
          r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.\S+ \{[^}]*\}, (\{)?", module))


@pytest.mark.parametrize("name", ["q_in_registers", "kv32_operands_in_registers"])
def test_register_candidates_cross_lower_within_smem(cross_lower, name):
  widths = _wgmmas(_dq_module(cross_lower, name))
  block_kv = CANDIDATES[name].get("block_kv", 64)
  # S and dP block_kv wide, dQ (dS from registers) as wide as the head dim.
  # S's A operand (Q, K-dim 192: 12 k-steps) from registers in both; dP's
  # (dO, 8 k-steps) only with `operands_in_registers`.
  assert {n for n, _ in widths} == {block_kv, D}, widths
  assert all(a for n, a in widths if n == D), widths
  in_registers = sum(c for (n, a), c in widths.items() if n == block_kv and a)
  from_smem = sum(c for (n, a), c in widths.items() if n == block_kv and not a)
  if CANDIDATES[name].get("operands_in_registers"):
    assert from_smem == 0 and in_registers > 0, widths
  else:
    assert in_registers and from_smem and in_registers * 8 == from_smem * 12, widths
  default = _wgmmas(_dq_module(cross_lower, "default"))
  assert not any(a for (n, a) in default if n == 64), default


def test_defaults_keep_q_in_smem():
  for d, dv in ((64, None), (128, None), (192, None), (192, 128), (256, None)):
    for mask in (MaskSpec(), CAUSAL):
      assert not sm90_backward.choose_config(d, mask, value_head_dim=dv).dq.q_in_registers


def test_issue_ahead_waits_for_dq_alone_before_the_release(cross_lower):
  dq = _dq_module(cross_lower, "issue_ahead")
  widths = _wgmmas(dq)
  assert {n for n, _ in widths} == {64, D}, widths
  # dQ's group, then S's and dP's: two may still run when slot j is released.
  assert "wgmma.wait_group.sync.aligned 2;" in dq
  assert "wgmma.wait_group.sync.aligned 2;" not in _dq_module(cross_lower, "default")
