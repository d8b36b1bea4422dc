"""The `jax.custom_vjp` shared by every backend.

A backend is a pair of functions:

    forward(q, k, v, bias, mask, q_lengths, kv_lengths, q_segment_ids,
            kv_segment_ids, *, scale, spec) -> (out [B,T,N,D], lse f32 [B,N,T])
    backward(q, k, v, bias, mask, q_lengths, kv_lengths, q_segment_ids,
             kv_segment_ids, out, lse, dout, *, scale, spec)
        -> (dq, dk, dv, dbias or None)

Lengths are int32 [B], segment ids int32 [B, T] and [B, S]; each may be None.
The forward saves its operands and (out, lse); the backward
recomputes probabilities from the log-sum-exp. A backend may pair a kernel
forward with the XLA backward: any forward that honours the lse contract of
`fa4_jax/kernels/__init__.py` works with any backward.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax

from fa4_jax import sharding
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def attention_core(q, k, v, bias, mask, q_lengths, kv_lengths, q_segment_ids,
                   kv_segment_ids, config: CoreConfig):
  """(out, lse) of attention with the backend named in `config`."""
  return sharding.forward(config, q, k, v, bias, mask, q_lengths, kv_lengths,
                          q_segment_ids, kv_segment_ids)


def _core_fwd(q, k, v, bias, mask, q_lengths, kv_lengths, q_segment_ids,
              kv_segment_ids, config):
  operands = (q, k, v, bias, mask, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids)
  out, lse = attention_core(*operands, config)
  return (out, lse), (operands, out, lse)


def _core_bwd(config, residuals, cotangents):
  operands, out, lse = residuals
  dout, _ = cotangents  # the lse is returned under stop_gradient
  dq, dk, dv, dbias = sharding.backward(config, *operands, out, lse, dout)
  # mask, lengths and segment ids are not differentiable: None is a zero cotangent.
  return dq, dk, dv, dbias, None, None, None, None, None


attention_core.defvjp(_core_fwd, _core_bwd)
