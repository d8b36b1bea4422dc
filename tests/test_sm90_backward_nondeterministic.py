"""The one-kernel sm90 backward with dQ in float32 (`deterministic=False`,
fa4_jax/kernels/sm90_backward_fused_dq.py), checked on the CPU.

* Numerics and barrier protocol: the kernel runs in Pallas' GPU interpreter
  with race detection (which has no TMA reduce-add: each CTA writes its
  partial dQ tiles to a slice of its own, summed by XLA) at small odd
  shapes; dq, dk, dv against the gradient of an f32 einsum attention.
* Hardware fit: cross-lowered for sm_90, it fits the shared memory, uses
  wgmma, and adds dQ with a TMA reduce-add (`cp.reduce.async.bulk.tensor`).
* Fallback: where the one kernel cannot serve a call (head dims other than
  128, a value head dim of its own, score_mod / mask_mod), `deterministic=False`
  runs the two deterministic kernels.
* Where it runs: only where it was measured faster
  (`sm90_backward.one_kernel_is_faster`); the other tests here take it at
  every shape it can serve, to check the kernel at small ones.
* The barrier table (`barrier_tables`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import barrier_tables
import fa4_jax
import fa4_jax.flax
from fa4_jax import xla_attention
from fa4_jax.kernels import sm90_backward, sm90_backward_fused_dq
from fa4_jax.scores import MaskSpec, ScoreFunction, Scores
from fa4_jax.testing import SMEM_LIMIT_BYTES, cross_lower
from reference import KernelCase, einsum_attention, relative_error


_measured_rule = sm90_backward.one_kernel_is_faster


@pytest.fixture(autouse=True)
def one_kernel_wherever_it_serves(monkeypatch):
  """The kernel at the small shapes these tests afford, where the measured
  rule would run the two kernels."""
  monkeypatch.setattr(sm90_backward, "one_kernel_is_faster", lambda *args: True)


def test_the_one_kernel_runs_only_where_it_measured_faster():
  dense, causal = MaskSpec(), MaskSpec(right=0)
  assert _measured_rule(dense, 8192, 1) and _measured_rule(dense, 8192, 4)
  assert not _measured_rule(dense, 2048, 1)  # a tie at B8 S2048
  assert _measured_rule(causal, 16384, 1)
  assert not _measured_rule(causal, 8192, 1)
  assert not _measured_rule(causal, 16384, 4)  # causal GQA: the two kernels won
  assert not _measured_rule(MaskSpec(left=1023, right=0), 16384, 1)  # a window
  assert not _measured_rule(MaskSpec(left=100, right=100), 16384, 1)


@dataclasses.dataclass(frozen=True)
class Case(KernelCase):
  head_dim: int = 128


def _grads(case: Case, run, q, k, v, dout, deterministic: bool, soft_cap=None):
  scale = 1.0 / math.sqrt(case.head_dim)
  q_len, kv_len = case.lengths()
  segments = case.segment_ids() or (None, None)
  scores_ = Scores(mask=case.mask, scale=scale, q_lengths=q_len, kv_lengths=kv_len,
                   soft_cap=soft_cap, q_segment_ids=segments[0], kv_segment_ids=segments[1])
  out, lse = xla_attention.forward(q, k, v, None, None, scores_)

  def fn(q, k, v, out, lse, dout):
    return sm90_backward.backward(q, k, v, out, lse, dout, q_len, kv_len,
                                  score=ScoreFunction(scale, soft_cap), mask=case.mask,
                                  segment_ids=case.segment_ids(), deterministic=deterministic)

  return run(fn, q, k, v, out, lse, dout)


def _reference(case: Case, q, k, v, dout, soft_cap=None):
  """The gradient of an f32 einsum attention (rows that see no key: none)."""
  scale = 1.0 / math.sqrt(case.head_dim)
  visible = jnp.asarray(case.visible())
  f32 = lambda x: x.astype(jnp.float32)

  def attention(q, k, v):
    return einsum_attention(q, k, v, visible, scale=scale, soft_cap=soft_cap)[0]

  _, vjp = jax.vjp(attention, f32(q), f32(k), f32(v))
  rows = visible.any(-1)[:, 0, :, None, None]
  return vjp(jnp.where(rows, f32(dout), 0.0))


_SEGMENTS = (tuple([0] * 50 + [1] * 40 + [2] * 46),)

# (case, soft-cap). Small and odd: the interpreter takes seconds per call.
CASES = {
    "dense_odd_lengths": (Case(q_seq=136, kv_seq=200), None),
    "causal_gqa_odd_lengths": (Case(q_heads=4, kv_heads=2, is_causal=True, q_seq=136,
                                    kv_seq=136), None),
    "window_lengths_fp16": (Case(batch=2, dtype="float16", window=(40, 20), q_seq=104,
                                 kv_seq=168, q_lengths=(104, 61), kv_lengths=(168, 90)), None),
    "causal_segments_soft_cap_head_dim_96_padded": (
        Case(head_dim=96, is_causal=True, q_seq=136, kv_seq=136, q_segment_ids=_SEGMENTS,
             kv_segment_ids=_SEGMENTS), 20.0),
}


@pytest.fixture
def one_kernel_calls(monkeypatch):
  """How many times the one kernel was built into a call (so a test knows
  which backward ran)."""
  calls = []
  original = sm90_backward_fused_dq.backward_kernels

  def counting(*args, **kwargs):
    calls.append(1)
    return original(*args, **kwargs)

  monkeypatch.setattr(sm90_backward_fused_dq, "backward_kernels", counting)
  return calls


@pytest.mark.parametrize("name", list(CASES))
def test_one_kernel_gradients_match_the_f32_reference_without_races(name, run_interpreted,
                                                                     one_kernel_calls):
  case, soft_cap = CASES[name]
  q, k, v, dout = case.backward_inputs()
  grads = _grads(case, run_interpreted, q, k, v, dout, deterministic=False, soft_cap=soft_cap)
  assert one_kernel_calls, "deterministic=False did not run the one kernel"
  reference = _reference(case, q, k, v, dout, soft_cap=soft_cap)
  for label, got, x, want in zip(("dq", "dk", "dv"), grads, (q, k, v), reference):
    assert got.shape == x.shape and got.dtype == x.dtype, label
    rel = relative_error(np.asarray(got, np.float32), np.asarray(want))
    assert rel < (2e-2 if case.dtype == "bfloat16" else 5e-3), (label, rel)


@pytest.mark.parametrize("case", [
    Case(head_dim=64, is_causal=True, q_seq=72, kv_seq=72),  # D64: halves of 32 columns
    Case(head_dim=192, q_seq=40, kv_seq=40),
], ids=["head_dim_64", "head_dim_192"])
def test_head_dims_the_one_kernel_does_not_take_run_the_deterministic_kernels(
    case, one_kernel_calls):
  """`deterministic=False` falls back to the two kernels (checked by
  tracing only: they have tests of their own)."""
  q, k, v, dout = case.backward_inputs()
  jax.eval_shape(lambda *a: _grads(case, lambda f, *x: f(*x), *a, deterministic=False),
                 q, k, v, dout)
  assert not one_kernel_calls


def test_the_one_kernel_refuses_what_it_cannot_serve():
  assert sm90_backward_fused_dq.fused_dq_problem(128, 128, has_mods=False) is None
  assert "head dim" in sm90_backward_fused_dq.fused_dq_problem(64, 64, has_mods=False)
  assert "value head dim" in sm90_backward_fused_dq.fused_dq_problem(128, 64, has_mods=False)
  assert "score_mod" in sm90_backward_fused_dq.fused_dq_problem(128, 128, has_mods=True)
  dkv = sm90_backward.choose_config(128, MaskSpec()).dkv
  with pytest.raises(ValueError, match="two consumers"):
    sm90_backward_fused_dq.FusedDqConfig(dkv=dataclasses.replace(dkv, dk_dv="two_passes"))


@pytest.mark.parametrize("causal, heads", [(False, (16, 16)), (True, (32, 8))],
                         ids=["dense", "causal_gqa"])
def test_one_kernel_lowers_for_sm90_with_wgmma_and_a_tma_reduce_add(causal, heads):
  """Cross-lowered for CUDA (no GPU): one kernel, within the shared memory,
  with wgmma, and dQ added by a TMA reduce-add (`cp.reduce.async.bulk.tensor
  ... .add`) into a float32 buffer."""
  hq, hkv = heads
  q = jax.ShapeDtypeStruct((1, 1024, hq, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 1024, hkv, 128), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((1, hq, 1024), jnp.float32)
  mask = MaskSpec.from_arguments(causal, None)

  def fn(q, k, v, lse):
    return sm90_backward.backward(q, k, v, q, lse, q, None, None, score=ScoreFunction(0.1),
                                  mask=mask, deterministic=False)

  lowered = cross_lower(fn, q, kv, kv, lse)
  assert len(lowered.modules) == 1, "one kernel"
  assert lowered.max_smem_bytes <= SMEM_LIMIT_BYTES
  assert lowered.has("wgmma.mma_async")
  assert lowered.has("cp.reduce.async.bulk.tensor") and lowered.has(".add.tile")


def test_barrier_table_lists_every_arrive_and_wait(monkeypatch):
  cfg = sm90_backward.choose_fused_dq_config(128, MaskSpec())
  plan = sm90_backward_fused_dq._FusedDqPass(
      cfg.dkv, MaskSpec(), jnp.bfloat16, 128, 128, ScoreFunction(0.1), 1, ("dk", "dv"), False,
      True, ds_slots=cfg.ds_slots, dq_stages=cfg.dq_stages)
  table_cls = sm90_backward_fused_dq.FusedDqBarrierTable
  drains = [m for m in dir(table_cls) if m.startswith("drain_")]
  barrier_tables.check_table(table_cls, lambda refs: table_cls(plan, refs),
                             sm90_backward_fused_dq, monkeypatch, indent=12, named_only=drains)


# --- fa4_jax.attention(deterministic=...) ---------------------------------------


def _api_inputs(head_dim=128, seq=136, heads=(4, 2)):
  keys = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(keys[0], (1, seq, heads[0], head_dim), jnp.bfloat16)
  k = jax.random.normal(keys[1], (1, seq, heads[1], head_dim), jnp.bfloat16)
  v = jax.random.normal(keys[2], (1, seq, heads[1], head_dim), jnp.bfloat16)
  return q, k, v


def _loss(attention, **kwargs):
  return lambda q, k, v: jnp.sum(attention(q, k, v, **kwargs).astype(jnp.float32) ** 2)


@pytest.mark.parametrize("value", ["no", None, 0, 1.0])
def test_deterministic_must_be_a_bool(value):
  q, k, v = _api_inputs(seq=16)
  with pytest.raises(ValueError, match="`deterministic` must be True or False"):
    fa4_jax.attention(q, k, v, deterministic=value)
  with pytest.raises(ValueError, match="`deterministic_backward` must be True or False"):
    fa4_jax.flax.make_attention_fn(deterministic_backward=value)


def test_deterministic_changes_nothing_on_the_xla_path():
  q, k, v = _api_inputs(seq=40)
  grads = [jax.grad(_loss(fa4_jax.attention, is_causal=True, implementation="xla",
                          deterministic=d), argnums=(0, 1, 2))(q, k, v) for d in (True, False)]
  for a, b in zip(*grads):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("flax", [False, True], ids=["attention", "flax"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_false_reaches_the_one_kernel_through_jit_and_grad(
    flax, deterministic, one_kernel_calls):
  """Traced for an sm90 target (no GPU needed): `deterministic=False` (Flax:
  `make_attention_fn(deterministic_backward=False)`) travels through the
  custom derivative, the partitioning and the backend to the one kernel;
  the default does not."""
  q, k, v = _api_inputs()
  if flax:
    fn = fa4_jax.flax.make_attention_fn(is_causal=True, deterministic_backward=deterministic)
    loss = _loss(fn)
  else:
    loss = _loss(fa4_jax.attention, is_causal=True, deterministic=deterministic)
  with fa4_jax.gpu_target("sm90"):
    jax.eval_shape(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v)
  assert bool(one_kernel_calls) == (not deterministic)


def test_attention_with_deterministic_false_in_the_interpreter(run_interpreted,
                                                               one_kernel_calls):
  """`fa4_jax.attention(implementation="sm90", deterministic=False)`: its
  gradient, kernels interpreted with race detection, against the XLA path's
  in f32."""
  q, k, v = _api_inputs(seq=72)
  loss = _loss(fa4_jax.attention, is_causal=True, implementation="sm90", deterministic=False)
  grads = run_interpreted(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v)
  assert one_kernel_calls
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  want = jax.grad(_loss(fa4_jax.attention, is_causal=True, implementation="xla"),
                  argnums=(0, 1, 2))(*f32)
  for got, w in zip(grads, want):
    assert relative_error(np.asarray(got, np.float32), np.asarray(w)) < 2e-2


def test_under_vmap_the_one_kernel_runs_per_element(one_kernel_calls):
  """JAX has no batching rule for the `run_state` that holds dQ's buffer:
  under `jax.vmap` the one kernel runs once per element (`lax.map`);
  cross-lowered for sm90."""
  q = jax.ShapeDtypeStruct((2, 1, 256, 4, 128), jnp.bfloat16)
  loss = _loss(fa4_jax.attention, is_causal=True, deterministic=False)
  lowered = cross_lower(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))), q, q, q)
  assert one_kernel_calls
  assert lowered.has("cp.reduce.async.bulk.tensor")
