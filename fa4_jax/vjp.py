"""The `jax.custom_vjp` shared by every backend.

A backend is a pair of functions:

    forward(q, k, v, bias, mask, q_lengths, kv_lengths, q_segment_ids,
            kv_segment_ids, sinks, *, scale, spec, soft_cap)
        -> (out [B,T,N,D], lse f32 [B,N,T])
    backward(q, k, v, bias, mask, q_lengths, kv_lengths, q_segment_ids,
             kv_segment_ids, out, lse, dout, *, scale, spec, soft_cap)
        -> (dq, dk, dv, dbias or None)

Lengths are int32 [B], segment ids int32 [B, T] and [B, S], sinks [N]; each
may be None. `soft_cap` is None or the logit soft-cap. The forward's lse
includes the sinks (a kernel starts its softmax from them, the XLA path adds
them after), so the backward's P = exp(s - lse) needs no change and takes no
sinks; their gradient is a reduction here (`scores.sink_grad`).
The forward saves its operands and (out, lse); the backward
recomputes probabilities from the log-sum-exp. A backend may pair a kernel
forward with the XLA backward: any forward that honours the lse contract of
`fa4_jax/kernels/__init__.py` works with any backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from fa4_jax import scores, sharding
from fa4_jax.scores import MaskSpec


@dataclasses.dataclass(frozen=True)
class Backend:
  name: str
  forward: Callable
  backward: Callable


@dataclasses.dataclass(frozen=True)
class CoreConfig:
  """Everything static about one call: hashable, so jit caches on it."""

  backend: Backend
  scale: float
  spec: MaskSpec
  soft_cap: float | None = None
  # `jax.default_matmul_precision` in force where the call was traced (None:
  # none set): the backward is traced later, often outside that scope, and
  # re-enters it so that its matmuls match the forward's (`_core_bwd`).
  matmul_precision: str | None = None


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def attention_core(q, k, v, bias, mask, q_lengths, kv_lengths, q_segment_ids,
                   kv_segment_ids, sinks, config: CoreConfig):
  """(out, lse) of attention with the backend named in `config`."""
  return sharding.forward(config, q, k, v, bias, mask, q_lengths, kv_lengths,
                          q_segment_ids, kv_segment_ids, sinks)


def _core_fwd(q, k, v, bias, mask, q_lengths, kv_lengths, q_segment_ids,
              kv_segment_ids, sinks, config):
  operands = (q, k, v, bias, mask, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids)
  out, lse = attention_core(*operands, sinks, config)
  return (out, lse), (operands, sinks, out, lse)


def _core_bwd(config, residuals, cotangents):
  operands, sinks, out, lse = residuals
  dout, _ = cotangents  # the lse is returned under stop_gradient
  with precision_scope(config.matmul_precision):
    dq, dk, dv, dbias = sharding.backward(config, *operands, out, lse, dout)
  dsinks = None
  if sinks is not None:
    delta = jnp.einsum("btnd,btnd->bnt", dout.astype(jnp.float32), out.astype(jnp.float32))
    dsinks = scores.sink_grad(sinks, lse, delta)
  # mask, lengths and segment ids are not differentiable: None is a zero cotangent.
  return dq, dk, dv, dbias, None, None, None, None, None, dsinks


def precision_scope(matmul_precision: str | None):
  """A forward's matmul precision scope (`current_matmul_precision`), for a
  backward to re-enter; no scope for None."""
  if matmul_precision is None:
    return contextlib.nullcontext()
  return jax.default_matmul_precision(matmul_precision)


def current_matmul_precision() -> str | None:
  """The `jax.default_matmul_precision` in force now, as a hashable value."""
  value = jax.config.jax_default_matmul_precision
  return None if value is None else str(value)


attention_core.defvjp(_core_fwd, _core_bwd)
