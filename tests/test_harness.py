"""The kernel test harness itself: it must catch what it claims to catch."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import fa4_jax
from fa4_jax import interpret, testing

SHAPE = (128, 128)


def _copy_plus_one(wait_for_copy: bool):
  """A TMA copy into SMEM, then a read of SMEM: racy unless we wait."""

  def body(x_gmem, o_gmem, x_smem, barrier):
    plgpu.copy_gmem_to_smem(x_gmem, x_smem, barrier)
    if wait_for_copy:
      plgpu.barrier_wait(barrier)
    o_gmem[...] = x_smem[...] + 1.0
    if not wait_for_copy:
      plgpu.barrier_wait(barrier)  # keep the barrier balanced

  return plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct(SHAPE, jnp.float32),
      scratch_types=[plgpu.SMEM(SHAPE, jnp.float32), plgpu.Barrier(num_arrivals=1)],
  )


def test_interpreted_kernel_computes_on_the_cpu():
  x = jnp.asarray(np.random.default_rng(0).normal(size=SHAPE), jnp.float32)
  out = testing.run_interpreted(_copy_plus_one(wait_for_copy=True), x)
  np.testing.assert_allclose(out, x + 1.0)


def test_interpreter_reports_a_read_before_the_barrier_wait_as_a_race():
  x = jnp.ones(SHAPE, jnp.float32)
  with pytest.raises(AssertionError, match="data race"):
    testing.run_interpreted(_copy_plus_one(wait_for_copy=False), x)
  # ...and the harness is usable again afterwards.
  testing.run_interpreted(_copy_plus_one(wait_for_copy=True), x)


def test_tests_give_the_interpreter_threads_enough():
  # conftest sets NPROC before JAX starts: with too few pool threads an
  # interpreted kernel can deadlock at random on a 2-core machine.
  assert interpret.interpreter_thread_pool_size() >= interpret.MIN_INTERPRETER_THREADS


@pytest.mark.parametrize("nproc, warns", [("2", True), ("32", False)])
def test_interpret_mode_warns_when_the_thread_pool_is_too_small(monkeypatch, nproc, warns):
  monkeypatch.setenv("NPROC", nproc)
  monkeypatch.setattr(interpret, "_warned_of_thread_pool", False)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with interpret.interpret_mode():
      pass
  told = [w for w in caught if "NPROC=32" in str(w.message)]
  assert len(told) == (1 if warns else 0)


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_cross_lowering_reports_shared_memory_and_instructions(arch):
  spec = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
  lowered = testing.cross_lower(_copy_plus_one(wait_for_copy=True), spec, arch=arch)
  assert len(lowered.modules) == 1
  # One f32 128x128 buffer plus the barrier, rounded up by Mosaic's alignment.
  assert 128 * 128 * 4 <= lowered.max_smem_bytes < 128 * 128 * 4 + 1024
  assert lowered.has("cp.async.bulk.tensor")
  assert lowered.has("mbarrier.try_wait.parity")
  assert not lowered.has("wgmma.mma_async")


def test_cross_lowering_rejects_unknown_architectures():
  spec = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
  with pytest.raises(ValueError, match="arch must be one of"):
    testing.cross_lower(_copy_plus_one(True), spec, arch="sm_80")


def test_an_interpreted_attention_call_runs_under_jit_and_grad():
  """jit(attention) in interpret mode: the sharding wrapper steps aside (its
  lowering could not carry the interpreter's ordered callbacks)."""
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (1, 64, 2, 64), jnp.bfloat16) for key in keys)
  attend = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=True, implementation="sm90")
  loss = lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum()
  out, dq = testing.run_interpreted(
      lambda: (jax.jit(attend)(q, k, v), jax.jit(jax.grad(loss))(q, k, v)))
  want = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True)
  want_dq = jax.grad(lambda q: jax.nn.dot_product_attention(
      q, k.astype(jnp.float32), v.astype(jnp.float32), is_causal=True).sum())(q.astype(jnp.float32))
  # bf16 inputs, outputs rounded to bf16 (2^-8 relative) against f32.
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(np.asarray(dq, np.float32), want_dq, atol=3e-2, rtol=3e-2)
