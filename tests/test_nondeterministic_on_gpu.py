"""`fa4_jax.attention(deterministic=False)` on real hardware (skipped without
a Hopper GPU): the one-kernel sm90 backward with dQ summed in float32 by TMA
reduce-adds (`fa4_jax/kernels/sm90_backward_fused_dq.py`).

tests/test_sm90_backward_nondeterministic.py runs the kernel in the
interpreter at small shapes, where there is no TMA reduce-add (each CTA
writes its partial dQ to a slice of its own); here the real reduce-adds of
many CTAs meet in one buffer, at training shapes, against the XLA path's
gradient in float32; then what ptxas makes of the kernel at every mask the
heuristic knows: no wgmma serialized (spill bytes printed with `pytest -s`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ptxas_dumps

import fa4_jax
from fa4_jax import backends
from fa4_jax.kernels import sm90_backward, sm90_backward_fused_dq
from reference import relative_error

pytestmark = pytest.mark.skipif(backends.device_arch_major() != 9,
                                reason="needs a Hopper GPU")

f32 = lambda x: jnp.asarray(x, jnp.float32)


@pytest.fixture(autouse=True)
def one_kernel_wherever_it_serves(monkeypatch):
  """The kernel at every shape here, also where `one_kernel_is_faster`
  would run the two kernels (causal and windowed rows of 4096 keys)."""
  monkeypatch.setattr(sm90_backward, "one_kernel_is_faster", lambda *args: True)


def _grads(attention, q, k, v, dout):
  loss = lambda *a: jnp.vdot(f32(attention(*a)), f32(dout))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("b, t, hq, hkv, causal, window", [
    (2, 4096, 16, 16, False, None),
    (2, 4096, 16, 16, True, None),
    (1, 4096, 32, 8, True, None),  # GQA 32/8
    (1, 4093, 16, 16, False, (300, 0)),  # a ragged length and a window
])
def test_gradients_against_the_xla_path_in_f32(b, t, hq, hkv, causal, window, monkeypatch):
  calls = []
  original = sm90_backward_fused_dq.backward_kernels
  monkeypatch.setattr(sm90_backward_fused_dq, "backward_kernels",
                      lambda *a, **kw: calls.append(1) or original(*a, **kw))
  rng = np.random.default_rng(t + hq + causal)
  make = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  q, k, v, dout = make(b, t, hq, 128), make(b, t, hkv, 128), make(b, t, hkv, 128), make(
      b, t, hq, 128)
  options = dict(is_causal=causal, local_window_size=window)
  ours = lambda q, k, v: fa4_jax.attention(q, k, v, implementation="sm90", deterministic=False,
                                           **options)
  grads = _grads(ours, q, k, v, dout)
  assert calls, "deterministic=False did not run the one kernel"
  default = _grads(lambda q, k, v: fa4_jax.attention(q, k, v, implementation="sm90", **options),
                   q, k, v, dout)
  xla = lambda q, k, v: fa4_jax.attention(q, k, v, implementation="xla", **options)
  with jax.default_matmul_precision("highest"):
    want = _grads(xla, f32(q), f32(k), f32(v), dout)
  for name, got, same, expected in zip(("dq", "dk", "dv"), grads, default, want):
    assert got.shape == expected.shape and got.dtype == q.dtype, name
    err, err_default = relative_error(got, expected), relative_error(same, expected)
    print(f"{name}: rel err {err:.2e} (deterministic: {err_default:.2e})")
    assert err < 1e-2, (name, err)
    # The one kernel rounds dQ to bf16 once, from f32 sums, as the two kernels do.
    assert err < 1.5 * err_default + 1e-4, (name, err, err_default)


def test_dk_and_dv_are_deterministic_and_dq_close_between_runs():
  rng = np.random.default_rng(0)
  make = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  q, k, v, dout = (make(1, 4096, 16, 128) for _ in range(4))
  ours = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=True, deterministic=False)
  first, second = _grads(ours, q, k, v, dout), _grads(ours, q, k, v, dout)
  for name, a, b in zip(("dk", "dv"), first[1:], second[1:]):
    np.testing.assert_array_equal(np.asarray(f32(a)), np.asarray(f32(b)), err_msg=name)
  assert relative_error(first[0], f32(second[0])) < 1e-3


# Compiles the one kernel, with Mosaic GPU's ptxas dump on, at every mask the
# heuristic knows, with and without GQA; soft-capped under the causal mask.
_COMPILE_ONE_KERNEL = r"""
import jax, jax.numpy as jnp
from fa4_jax.kernels import sm90_backward, sm90_tiles
from fa4_jax.scores import ScoreFunction

def backward(mask, group, soft_cap):
  def run():
    q = jnp.ones((1, 2048, 2 * group, 128), jnp.bfloat16)
    k = jnp.ones((1, 2048, 2, 128), jnp.bfloat16)
    lse = jnp.zeros((1, 2 * group, 2048), jnp.float32)
    return sm90_backward.backward(q, k, k, q, lse, q, None, None,
                                  score=ScoreFunction(0.1, soft_cap), mask=mask,
                                  deterministic=False)
  return run

items = {}
for mask in sm90_tiles.HEURISTIC_MASKS:
  for group in (1, 4):
    items[f"{mask} group={group}"] = backward(mask, group, None)
items["causal soft_cap=30"] = backward(sm90_tiles.HEURISTIC_MASKS[1], 1, 30.0)

"""


def test_the_one_kernel_has_no_wgmma_serialized_by_ptxas(tmp_path):
  """ptxas must not serialize its wgmmas (C7507-C7519) at any mask."""
  calls = ptxas_dumps.compile_items(_COMPILE_ONE_KERNEL, tmp_path, timeout=400)
  ptxas_dumps.check_no_serialized_wgmmas(calls)
