"""Kernels on real hardware (skipped without a Hopper GPU).

The interpreter cannot see everything the hardware does (TMA boundary
handling, for one), so the same contract is checked on the device: output,
log-sum-exp and gradients of the sm90 kernels against the XLA path, at shapes
that are not multiples of any block.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import backends, xla_attention
from fa4_jax.scores import MaskSpec, ScoreFunction, Scores
from reference import relative_error

pytestmark = pytest.mark.skipif(backends.device_arch_major() != 9,
                                reason="needs a Hopper GPU")

CASES = [  # (B, Tq, Tk, Nq, Nkv, D, spec, lengths)
    (2, 53, 53, 4, 2, 32, MaskSpec(), False),
    (2, 53, 53, 4, 2, 32, MaskSpec(right=0), False),
    (1, 1000, 1000, 8, 8, 128, MaskSpec(right=0), False),
    (2, 300, 700, 8, 2, 64, MaskSpec(left=100, right=0), True),
    # head dim 128 under a window with GQA and lengths
    (2, 300, 700, 8, 2, 128, MaskSpec(left=100, right=0), True),
    (1, 777, 513, 4, 1, 256, MaskSpec(), True),
    (1, 333, 257, 4, 2, 192, MaskSpec(right=0), False),
    # Persistent grid, several work items per CTA: Q prefetched into the
    # second tile of each consumer while the current item runs.
    (4, 1500, 1500, 16, 4, 128, MaskSpec(right=0), True),
]


def inputs(b, tq, tk, nq, nkv, d, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, tq, nq, d)), jnp.bfloat16)
  k = jnp.asarray(rng.normal(size=(b, tk, nkv, d)), jnp.bfloat16)
  v = jnp.asarray(rng.normal(size=(b, tk, nkv, d)), jnp.bfloat16)
  return q, k, v


def sequence_lengths(case):
  """(q_lengths, kv_lengths) of a case with `lengths`: from half of the
  queries and a third of the keys up to all of them, one per batch row."""
  b, tq, tk, *_, with_lengths = case
  if not with_lengths:
    return None, None
  return (jnp.asarray(np.linspace(tq // 2, tq, b).astype(np.int32)),
          jnp.asarray(np.linspace(tk // 3, tk, b).astype(np.int32)))


def backward_inputs(case, seed):
  """((q, k, v, out, lse, dout), q_lengths, kv_lengths) for the kernel-level
  backward: dout from seed + 1, out and lse from the XLA path."""
  b, tq, tk, nq, nkv, d, spec, _ = case
  q, k, v = inputs(b, tq, tk, nq, nkv, d, seed=seed)
  dout = jnp.asarray(np.random.default_rng(seed + 1).normal(size=q.shape), jnp.bfloat16)
  ql, kl = sequence_lengths(case)
  out, lse = xla_attention.forward(q, k, v, None, None,
                                  Scores(mask=spec, scale=d**-0.5, q_lengths=ql, kv_lengths=kl))
  return (q, k, v, out.astype(q.dtype), lse, dout), ql, kl


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sm90_forward_matches_the_xla_path_including_lse(case):
  from fa4_jax.kernels import sm90_forward
  b, tq, tk, nq, nkv, d, spec, _ = case
  q, k, v = inputs(b, tq, tk, nq, nkv, d)
  ql, kl = sequence_lengths(case)
  out, lse = sm90_forward.forward(q, k, v, ql, kl, score=ScoreFunction(d**-0.5), mask=spec)
  f32 = lambda x: x.astype(jnp.float32)
  ref_out, ref_lse = xla_attention.forward(
      f32(q), f32(k), f32(v), None, None,
      Scores(mask=spec, scale=d**-0.5, q_lengths=ql, kv_lengths=kl))
  np.testing.assert_allclose(f32(out), ref_out, atol=2e-2)
  np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))
  finite = ~np.isinf(np.asarray(ref_lse))
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], atol=1e-3)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_default_path_gradients_match_the_xla_path(case):
  b, tq, tk, nq, nkv, d, spec, _ = case
  q, k, v = inputs(b, tq, tk, nq, nkv, d, seed=1)
  window = None if spec.left is None else (spec.left, 0)
  kw = dict(is_causal=spec.right == 0, local_window_size=window)
  ct = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32)
  loss = lambda impl: lambda q, k, v: jnp.sum(
      fa4_jax.attention(q, k, v, implementation=impl, **kw).astype(jnp.float32) * ct)
  ours = jax.grad(loss(None), (0, 1, 2))(q, k, v)
  exact = jax.grad(loss("xla"), (0, 1, 2))(*(x.astype(jnp.float32) for x in (q, k, v)))
  for a, r in zip(ours, exact):
    rel = relative_error(a, r)
    assert rel < 2e-2, rel  # bf16 inputs and P: ~3e-3 expected


@pytest.mark.parametrize("d,causal", [(128, False), (256, True), (64, True)])
def test_conditional_rescale_is_bit_identical_to_always_rescaling(d, causal):
  """The warp-uniform skip of O's rescale (`ForwardConfig.conditional_rescale`)
  only skips multiplications by exactly 1.0, so the output must not change
  by a single bit. Keys grow along the sequence and the scale is large, so
  running maxima jump past the threshold in late blocks for some rows and
  warps (the branch is taken) while other warps keep their max (it is not)."""
  import dataclasses

  from fa4_jax.kernels import sm90_forward
  b, t, nq, nkv = 1, 1111, 4, 2
  q, k, v = inputs(b, t, t, nq, nkv, d, seed=3)
  growth = jnp.linspace(0.2, 3.0, t, dtype=jnp.float32)[None, :, None, None]
  k = (k.astype(jnp.float32) * growth).astype(k.dtype)
  spec = MaskSpec(right=0) if causal else MaskSpec()
  base = sm90_forward.choose_config(d, spec, t, t)
  outs = []
  for conditional in (False, True):
    config = dataclasses.replace(base, conditional_rescale=conditional)
    outs.append(sm90_forward.forward(q, k, v, None, None, score=ScoreFunction(0.5), mask=spec,
                                     config=config))
  np.testing.assert_array_equal(np.asarray(outs[0][0]), np.asarray(outs[1][0]))
  np.testing.assert_array_equal(np.asarray(outs[0][1]), np.asarray(outs[1][1]))
  f32 = lambda x: x.astype(jnp.float32)
  ref_out, _ = xla_attention.forward(f32(q), f32(k), f32(v), None, None,
                                     Scores(mask=spec, scale=0.5))
  np.testing.assert_allclose(f32(outs[1][0]), ref_out, atol=3e-2)


OVERLAP_CASES = [  # (B, Tq, Tk, Nq, Nkv, D, spec, lengths): every dK/dV scheme
    (2, 2000, 2000, 16, 16, 128, MaskSpec(), False),
    (1, 1500, 1300, 8, 2, 64, MaskSpec(right=0), True),
    (1, 1000, 1000, 4, 4, 256, MaskSpec(left=300, right=0), False),
    (1, 777, 777, 4, 2, 192, MaskSpec(), False),
]


@pytest.mark.parametrize("case", OVERLAP_CASES, ids=str)
def test_overlapped_kernels_give_the_gradients_of_serial_ones_bit_for_bit(case):
  """`BackwardConfig.overlap_kernels` launches the dQ kernel (and the dV pass
  at head dim 192) while the kernel before it finishes. The kernels read none
  of each other's outputs and do the same arithmetic, so nothing may change,
  and a later computation on the gradients must see them complete."""
  import dataclasses

  from fa4_jax.kernels import sm90_backward
  *_, d, spec, _ = case
  args, ql, kl = backward_inputs(case, seed=6)
  serial = dataclasses.replace(sm90_backward.choose_config(d, spec), delta_in_dq=False,
                               overlap_kernels=False)

  def run(config):
    # The sums run right after the kernels, in the same program: they read
    # the gradients the moment the last kernel is done.
    fn = jax.jit(lambda *a: [(g, jnp.sum(g.astype(jnp.float32))) for g in
                             sm90_backward.backward(*a, ql, kl, score=ScoreFunction(d**-0.5),
                                                    mask=spec,
                                                    config=config)])
    return fn(*args)

  want = run(serial)
  got = run(dataclasses.replace(serial, overlap_kernels=True))
  for name, (g, s), (w, ws) in zip(("dq", "dk", "dv"), got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
    assert float(s) == float(ws), name


REGISTER_OPERAND_CASES = [  # (B, Tq, Tk, Nq, Nkv, D, spec, lengths)
    (2, 1000, 1000, 4, 4, 64, MaskSpec(), False),
    (2, 1537, 1537, 8, 2, 64, MaskSpec(left=200, right=0), True),
]


@pytest.mark.parametrize("case", REGISTER_OPERAND_CASES, ids=str)
def test_register_operands_give_the_gradients_of_smem_operands_bit_for_bit(case):
  """At head dim 64 the heuristic keeps K and V (dK/dV kernel), Q and dO (dQ
  kernel) in registers as wgmma A operands. The tensor core multiplies the
  same bf16 values in the same order, so the gradients must not change."""
  import dataclasses

  from fa4_jax.kernels import sm90_backward
  *_, d, spec, _ = case
  args, ql, kl = backward_inputs(case, seed=8)
  in_registers = sm90_backward.choose_config(d, spec)
  assert in_registers.dkv.operands_in_registers and in_registers.dq.operands_in_registers
  in_smem = dataclasses.replace(
      in_registers, dkv=dataclasses.replace(in_registers.dkv, operands_in_registers=False),
      dq=dataclasses.replace(in_registers.dq, operands_in_registers=False))

  def run(config):
    return jax.jit(lambda *a: sm90_backward.backward(*a, ql, kl, score=ScoreFunction(d**-0.5),
                                                     mask=spec,
                                                     config=config))(*args)

  for name, got, want in zip(("dq", "dk", "dv"), run(in_registers), run(in_smem)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
