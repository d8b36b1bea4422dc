"""The "dv_dk_split" dK/dV scheme at 192 / 128 (`sm90_backward.
DKV_AT_192_128`, the default there; issue #56) in Pallas' GPU interpreter with race
detection: dense with odd lengths and kv lengths, causal with GQA and
soft-cap, and with 64 of dK's columns on warpgroup 0. The cases and the
check are those of test_sm90_backward_192_128.py (its
cross-lowering covers this scheme too); a file of their own keeps each
file's interpreter time short.
"""

from __future__ import annotations

import pytest

import jax
import jax.numpy as jnp
import numpy as np

import fa4_jax
from fa4_jax.kernels import sm90_backward
from fa4_jax.scores import MaskSpec
from reference import relative_error
from test_sm90_backward_192_128 import CASES, check_gradients


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("dv_dk_split")])
def test_gradients_match_an_f32_einsum(run_interpreted, name):
  check_gradients(run_interpreted, CASES[name])


def test_the_default_with_a_score_mod_and_a_mask_mod_in_the_interpreter():
  """`choose_mods_config` keeps "dv_dk_split" at 192 / 128: ALiBi and a
  prefix-LM mask_mod through `fa4_jax.attention` in the interpreter, with
  race detection; q, k, v and the slopes' gradients against the XLA path's
  in f32 (bf16 operands: 1e-2)."""
  config = sm90_backward.choose_mods_config(192, MaskSpec(), score_mod=True, mask_mod=True,
                                            value_head_dim=128)
  assert config.dkv.dk_dv == "dv_dk_split"
  rng = np.random.default_rng(0)
  b, t, n, k = 1, 93, 2, 1
  make = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  q, key, v = make(b, t, n, 192), make(b, t, k, 192), make(b, t, k, 128)
  slopes = jnp.asarray([0.1, 0.3], jnp.float32)
  prefix_lm = lambda bb, h, i, j: (j < 24) | (i >= j)
  weights = jnp.cos(jnp.arange(128, dtype=jnp.float32))

  def loss(implementation):
    def f(q, key, v, slopes):
      out = fa4_jax.attention(
          q, key, v, implementation=implementation, mask_mod=prefix_lm,
          score_mod=lambda s, bb, h, i, j: s - slopes[h] * (i - j).astype(jnp.float32))
      return jnp.sum(out.astype(jnp.float32) * weights)
    return f

  f32 = lambda x: x.astype(jnp.float32)
  want = jax.grad(loss("xla"), (0, 1, 2, 3))(f32(q), f32(key), f32(v), slopes)
  with fa4_jax.interpret_mode(detect_races=True):
    got = jax.grad(loss("sm90"), (0, 1, 2, 3))(q, key, v, slopes)
  for name, g, w in zip(("dq", "dk", "dv", "dslopes"), got, want):
    assert relative_error(g, w) < 1e-2, (name, relative_error(g, w))
