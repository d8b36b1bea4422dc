"""One trace and one lowering per kernel configuration (fa4_jax/kernels/build_cache.py).

A program that calls attention with one shape in several places (layers that
are not scanned) must hand XLA each Mosaic GPU kernel once, and that kernel
must be the one built without the cache. Checked by cross-lowering for
sm_90 on the CPU; the interpreter bypasses the cache.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import fa4_jax
from fa4_jax import backends, interpret
from fa4_jax.kernels import build_cache, sm90_forward
from fa4_jax.scores import MaskSpec, ScoreFunction

B, S, H, D = 1, 256, 2, 64
_DUMP_NAME = re.compile(r'mosaic_gpu.dump_basename = "[^"]*"')


@pytest.fixture
def on_hopper(monkeypatch):
  """implementation=None picks the sm90 kernels, as on an H100."""
  monkeypatch.setattr(backends, "device_arch_major", lambda: 9)


def _spec(seq=S):
  return jax.ShapeDtypeStruct((B, seq, H, D), jnp.bfloat16)


def _layers(count):
  def forward(q, k, v):
    for _ in range(count):
      q = fa4_jax.attention(q, k, v, is_causal=True)
    return q
  return forward


def _grad(forward):
  return jax.grad(lambda q, k, v: forward(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))


def _texts(lowered):
  return [_DUMP_NAME.sub("", m) for m in lowered.modules]


def test_layers_of_one_shape_lower_the_forward_kernel_once(on_hopper, cross_lower):
  one, three = (cross_lower(_layers(n), _spec(), _spec(), _spec()) for n in (1, 3))
  assert len(one.modules) == 1
  assert _texts(three) == _texts(one)


def test_layers_of_one_shape_lower_the_gradient_kernels_once(on_hopper, cross_lower):
  one, three = (cross_lower(_grad(_layers(n)), _spec(), _spec(), _spec()) for n in (1, 3))
  assert len(one.modules) >= 3  # forward, dK/dV, dQ
  assert _texts(three) == _texts(one)


def test_another_shape_is_another_kernel(on_hopper, cross_lower):
  def two_shapes(q, k, v, q2):
    return fa4_jax.attention(q, k, v), fa4_jax.attention(q2, k, v)

  lowered = cross_lower(two_shapes, _spec(), _spec(), _spec(), _spec(seq=128))
  assert len(lowered.modules) == 2


def test_the_cached_kernel_is_the_kernel_built_without_the_cache(on_hopper, cross_lower,
                                                                 monkeypatch):
  cached = _texts(cross_lower(_grad(_layers(1)), _spec(), _spec(), _spec()))
  # The interpreter's bypass, without the interpreter: the builders are called directly.
  monkeypatch.setattr(build_cache, "is_interpreting", lambda: True)
  direct = _texts(cross_lower(_grad(_layers(1)), _spec(), _spec(), _spec()))
  assert cached == direct


def test_one_callable_per_configuration_but_none_kept_for_the_interpreter():
  static = dict(batch=B, q_seq=S, kv_seq=S, kv_valid=S, num_q_heads=H, num_kv_heads=H,
                head_dim=D, dtype=jnp.dtype(jnp.bfloat16), score=ScoreFunction(0.125),
                mask=MaskSpec(),
                config=sm90_forward.choose_config(D, MaskSpec(), S), has_q_lengths=False,
                has_kv_lengths=False)
  assert sm90_forward._build_kernel(**static) is sm90_forward._build_kernel(**static)
  assert (sm90_forward._build_kernel(**static)
          is not sm90_forward._build_kernel(**dict(static, q_seq=2 * S)))
  with interpret.interpret_mode():
    assert sm90_forward._build_kernel(**static) is not sm90_forward._build_kernel(**static)
