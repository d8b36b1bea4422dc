"""Issue #56's dK/dV candidates at 192 / 128 (branch h56k): dV on warpgroup 1
(`DkvConfig.wg1_dv`) in Pallas' GPU interpreter with race
detection: warpgroup 0 keeping no gradient (only S^T, dP^T, P^T and dS^T),
or 64 of dK's columns, and with K and V as its register A operands (which
the interpreter keeps in SMEM: the case checks that config's barriers and
SMEM path; the registers run on hardware only), and with lse2 and delta
folded into warpgroup 0's S^T and dP^T accumulators (`fold_stats`; delta
alone under soft-cap); and the default's layout or dK wholly on warpgroup 1
with K (and V) in registers, warpgroup 0 on 256 registers (`k_in_registers`,
`wg0_registers`). With `pytest --kernels-on-gpu` the same cases run the
register operands on hardware. The cases and the check are
those of test_sm90_backward_192_128.py (which cross-lowers them); a file of
their own keeps each file's interpreter time short.
"""

from __future__ import annotations

import pytest

from test_sm90_backward_192_128 import CASES, check_gradients


@pytest.mark.parametrize("name", [n for n in CASES if not n.startswith("dv_dk_split")])
def test_gradients_match_an_f32_einsum(run_interpreted, name):
  check_gradients(run_interpreted, CASES[name])
