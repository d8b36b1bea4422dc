"""The sm90 backward with a value head dim of its own on real hardware
(skipped without a Hopper GPU).

tests/test_sm90_backward_value_head_dim.py runs these kernels in the
interpreter at tiny shapes; here DeepSeek's 192 / 128 and 128 / 64 run at
training size (B2 S4096 H16) through `fa4_jax.attention`, their gradients
against an f32 einsum attention, then what ptxas makes of every kernel the
heuristic picks for the pairs the backward takes: no wgmma serialized (spill
bytes printed with `pytest -s`). Kept apart from the other *_on_gpu.py files
so that each runs within one ten-minute device command.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ptxas_dumps

import fa4_jax
from fa4_jax import backends
from fa4_jax.kernels import sm90_backward
from reference import relative_error

pytestmark = pytest.mark.skipif(backends.device_arch_major() != 9,
                                reason="needs a Hopper GPU")

f32 = lambda x: jnp.asarray(x, jnp.float32)


def _reference(q, k, v, causal: bool):
  """f32 attention by einsum, D wide scores and Dv wide values."""
  group = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  logits = jnp.einsum("btnd,bsnd->bnts", q, k, precision="highest") * q.shape[-1] ** -0.5
  if causal:
    t, s = logits.shape[-2:]
    logits = jnp.where(jnp.tril(jnp.ones((t, s), bool)), logits, -jnp.inf)
  return jnp.einsum("bnts,bsnd->btnd", jax.nn.softmax(logits, axis=-1), v,
                    precision="highest")


@pytest.mark.parametrize("d, dv, causal, kv_heads", [
    (192, 128, False, 16), (192, 128, True, 16), (128, 64, True, 4)])
def test_gradients_at_training_size(d, dv, causal, kv_heads):
  b, t, n = 2, 4096, 16
  rng = np.random.default_rng(d + dv + causal)
  make = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  q, k, dout = make(b, t, n, d), make(b, t, kv_heads, d), make(b, t, n, dv)
  v = make(b, t, kv_heads, dv)
  assert fa4_jax.which_implementation(q, k, v, is_causal=causal, part="backward") == "sm90"
  assert not backends._pads_value_head_dim(sm90_backward, d, dv)  # noqa: SLF001 (Dv wide)
  ours = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=causal, implementation="sm90")
  grads = jax.jit(jax.grad(lambda *a: jnp.vdot(f32(ours(*a)), f32(dout)), argnums=(0, 1, 2)))(
      q, k, v)
  want = jax.jit(jax.grad(lambda *a: jnp.vdot(_reference(*a, causal), f32(dout)),
                          argnums=(0, 1, 2)))(f32(q), f32(k), f32(v))
  # bf16 operands, P and dS rounded to bf16 before their GEMMs: about 2.5e-3
  # over all elements in the interpreter tests; 1e-2 as there.
  for name, got, expected in zip(("dq", "dk", "dv"), grads, want):
    assert got.shape == expected.shape, name
    assert relative_error(got, expected) < 1e-2, (name, relative_error(got, expected))


# Compiles, with Mosaic GPU's ptxas dump on, the backward of every distinct
# (config, soft-cap) the heuristic picks for the pairs the kernels take with
# a narrower V, and prints the ptxas reports each left.
_COMPILE_VALUE_HEAD_DIM_KERNELS = r"""
import os
import jax, jax.numpy as jnp
from fa4_jax.kernels import sm90_backward, sm90_tiles
from fa4_jax.scores import ScoreFunction

def backward(d, dv, mask, group, config, soft_cap):
  def run():
    q = jnp.ones((1, 2048, 2 * group, d), jnp.bfloat16)
    k = jnp.ones((1, 2048, 2, d), jnp.bfloat16)
    v = jnp.ones((1, 2048, 2, dv), jnp.bfloat16)
    o = jnp.ones((1, 2048, 2 * group, dv), jnp.bfloat16)
    lse = jnp.zeros((1, 2 * group, 2048), jnp.float32)
    return sm90_backward.backward(q, k, v, o, lse, o, None, None,
                                  score=ScoreFunction(0.1, soft_cap), mask=mask, config=config)
  return run

items = {}
for d, dv in ((192, 128), (128, 64), (192, 64), (256, 128)):
  for mask in sm90_tiles.HEURISTIC_MASKS:
    for group in (1, 4):
      for soft_cap in (None, 30.0):
        config = sm90_backward.choose_config(d, mask, group, raw_scores=soft_cap is not None,
                                             value_head_dim=dv)
        items.setdefault(f"d={d} dv={dv} soft_cap={soft_cap} {config}",
                         backward(d, dv, mask, group, config, soft_cap))

"""


def test_no_value_head_dim_kernel_has_its_wgmmas_serialized_by_ptxas(tmp_path):
  """As tests/test_ptxas_on_gpu.py for the equal head dims' kernels: ptxas
  must not serialize the wgmmas of a backward kernel with a narrower V
  (C7507-C7519)."""
  calls = ptxas_dumps.compile_items(_COMPILE_VALUE_HEAD_DIM_KERNELS, tmp_path, timeout=540)
  ptxas_dumps.check_no_serialized_wgmmas(calls)
