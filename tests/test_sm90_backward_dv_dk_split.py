"""The "dv_dk_split" dK/dV scheme at 192 / 128 (`sm90_backward.
DV_DK_SPLIT_192_128`; issue #56) in Pallas' GPU interpreter with race
detection: dense with odd lengths and kv lengths, causal with GQA and
soft-cap, and with 64 of dK's columns on warpgroup 0. The cases and the
check are those of test_sm90_backward_192_128_candidates.py (its
cross-lowering covers this scheme too); a file of their own keeps each
file's interpreter time short.
"""

from __future__ import annotations

import pytest

from test_sm90_backward_192_128_candidates import CASES, check_gradients


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("dv_dk_split")])
def test_gradients_match_an_f32_einsum(run_interpreted, name):
  check_gradients(run_interpreted, CASES[name])
