"""Matmul precision scopes reach the backward.

Specification (issue #28):
* A call made inside `jax.default_matmul_precision(p)` and differentiated
  outside it (as Flax modules and many test suites do) gets a backward whose
  matmuls carry `p` too, like jax.nn's: every dot of the lowered gradient,
  forward and backward, has the scope's precision. So does the ring of
  `context_parallel_attention`.
* Without a scope nothing changes: the dots carry no precision.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fa4_jax


@pytest.fixture(autouse=True)
def no_global_precision():
  """conftest.py sets "highest" for every test; here no precision is set
  outside the scopes, so a backward traced outside them would show it."""
  before = jax.config.jax_default_matmul_precision
  jax.config.update("jax_default_matmul_precision", None)
  yield
  jax.config.update("jax_default_matmul_precision", before)


def _dot_precisions(fn, *args):
  """The precision attribute of every dot_general in `fn`'s lowered gradient."""
  text = jax.jit(jax.grad(fn, argnums=(0, 1, 2))).lower(*args).as_text()
  dots = re.findall(r"stablehlo\.dot_general.*", text)
  assert dots
  return [("HIGHEST" if "HIGHEST" in d else "HIGH" if "HIGH" in d else "DEFAULT") for d in dots]


def _qkv(t=64):
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, t, 2, 16)), jnp.float32)
  return x, x + 1.0, x - 1.0


@pytest.mark.parametrize("scope, want", [("highest", "HIGHEST"), ("high", "HIGH")])
def test_the_backward_takes_the_forwards_precision_scope(scope, want):
  def loss(q, k, v):
    with jax.default_matmul_precision(scope):
      out = fa4_jax.attention(q, k, v, is_causal=True)
    return out.sum()  # differentiated outside the scope

  assert set(_dot_precisions(loss, *_qkv())) == {want}


def test_without_a_scope_the_dots_carry_no_precision():
  loss = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=True).sum()
  assert set(_dot_precisions(loss, *_qkv())) == {"DEFAULT"}


def test_the_context_parallel_ring_takes_the_scope_too(host_devices):
  mesh = jax.make_mesh((4,), ("seq",))

  def loss(q, k, v):
    with jax.default_matmul_precision("highest"):
      out = fa4_jax.context_parallel_attention(q, k, v, mesh=mesh, axis_name="seq")
    return out.sum()

  sharded = [jax.device_put(x, NamedSharding(mesh, P(None, "seq"))) for x in _qkv(32)]
  assert set(_dot_precisions(loss, *sharded)) == {"HIGHEST"}
