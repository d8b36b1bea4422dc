"""The differentiation rule shared by every backend.

A backend is a pair of functions:

    forward(q, k, v, bias, mask, scores) -> (out [B,T,N,D], lse f32 [B,N,T])
    backward(q, k, v, bias, mask, scores, out, lse, dout)
        -> (dq, dk, dv, dbias or None, dcaptured or None)

`scores` is the score value (`fa4_jax.scores.Scores`): everything besides
q, k, v, bias and mask that shapes a score (the mask band, lengths, segment
ids, scale, soft-cap, sinks, `score_mod` and `mask_mod` with the arrays they
captured, the block mask). The forward's lse includes the sinks (a kernel
starts its softmax from them, the XLA path adds them after), so the
backward's P = exp(s - lse) needs no change and ignores them; their gradient
is a reduction here (`scores.sink_grad`). `dcaptured` are the gradients of
the score_mod's captured arrays (a tuple like them, None for integer ones).
A backend may pair a kernel forward with the XLA backward: any forward that
honours the lse contract of `fa4_jax/kernels/__init__.py` works with any
backward.

`attention_core` is a `jax.custom_jvp`. Its rule runs the backend's forward
and returns the tangent of (out, lse) as one linear primitive (`_LinearMap`):
* evaluated (`jax.jvp`, `jax.jacfwd`) it is the XLA path's exact tangent
  from the saved out and lse (`xla_attention.tangent`, blockwise: memory
  linear in sequence length): kernels are bypassed for the tangent only;
* transposed (`jax.grad`, also under `jax.checkpoint` and `vmap`) it is the
  backend's fused backward, alone, as with a `custom_vjp`: the forward runs
  once and its (out, lse) are the residuals;
* differentiated again (`jax.hessian`, `jax.jvp(jax.grad(f))`) the backward's
  tangent is that of the XLA backward (`_fused_backward` is a custom_jvp;
  kernels have no derivative). The tangent of the lse is exact, since the
  backward's derivative reads it.
The rule is held twice, outside and inside a `custom_vmap` call
(`keeping_rule`): partial evaluation (a `lax.scan` linearized for
`jax.grad`) inlines a custom_jvp and drops its rule, but stages the
custom_vmap call whole, so a Hessian-vector product through a scan still
finds the rule.
Reverse mode over these derivatives (`grad` of `grad`, `jacrev` of `jacfwd`)
is refused with a ValueError that names forward-over-reverse: the XLA path
loops over visible blocks with `fori_loop`s of dynamic bounds, which JAX
cannot transpose.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import hijax

from fa4_jax import scores, sharding, xla_attention
from fa4_jax.batching import custom_vmap_call
from fa4_jax.scores import Scores


@dataclasses.dataclass(frozen=True)
class Backend:
  name: str
  forward: Callable
  backward: Callable


@dataclasses.dataclass(frozen=True)
class CoreConfig:
  """What is static about one call besides the score value's own static
  part: hashable, so jit caches on it."""

  backend: Backend
  # `jax.default_matmul_precision` in force where the call was traced (None:
  # none set): the backward is traced later, often outside that scope, and
  # re-enters it so that its matmuls match the forward's (`precision_scope`).
  matmul_precision: str | None = None
  # `fa4_jax.attention(deterministic=...)`: False lets a kernel backend's
  # backward sum dQ in float32 in arrival order (the sm90 one kernel,
  # `fa4_jax.kernels.sm90_backward_fused_dq`); every other backward is
  # deterministic either way. Reaches the backends through
  # `sharding.backward` (`Backend.backward(..., deterministic=)`).
  deterministic: bool = True


@functools.partial(jax.custom_jvp, nondiff_argnums=(6,))
def attention_core(q, k, v, bias, mask, scores_: Scores, config: CoreConfig):
  """(out, lse) of attention with the backend named in `config`."""
  return keeping_rule(functools.partial(_partitioned_forward, config=config))(
      q, k, v, bias, mask, scores_)


@functools.partial(jax.custom_jvp, nondiff_argnums=(6,))
def _partitioned_forward(q, k, v, bias, mask, scores_: Scores, config: CoreConfig):
  """`attention_core` again, with the same rule: what `keeping_rule` shields."""
  return sharding.forward(config, q, k, v, bias, mask, scores_)


def keeping_rule(rule_fn):
  """`rule_fn` (a custom_jvp) as one `custom_vmap` primitive, so that its
  differentiation rule survives JAX's partial evaluation.

  Partial evaluation inlines a custom_jvp whose inputs are partly unknown,
  dropping its rule (it assumes it builds a linear function): a `lax.scan`
  linearized for `jax.grad` does this to its primal body while it hoists the
  loop-invariant work out, and a `jax.jvp` of that gradient (a Hessian-vector
  product) then differentiated the kernel's `custom_partitioning` call. A
  `custom_vmap` call is staged whole, and its derivative is that of the
  function inside, so the rule inside is honoured."""

  def shielded(*args):
    # Only arrays pass through (custom_vmap's jvp fails on None leaves).
    leaves, tree = jax.tree.flatten(args)
    on_leaves = lambda *leaves: rule_fn(*jax.tree.unflatten(tree, leaves))
    return custom_vmap_call(on_leaves)(*leaves)

  return shielded


@attention_core.defjvp
@_partitioned_forward.defjvp
def _core_jvp(config, primals, tangents):
  """(out, lse) from the backend's forward; their tangent from a linear map
  that evaluates with the XLA path and transposes to the fused backward."""
  q, k, v, bias, mask, scores_ = primals
  if scores_.has_fp8:
    raise ValueError(
        "fa4_jax.attention has no derivative with float8 operands (they serve inference "
        "and prefill); to differentiate, dequantize first: "
        "x.astype(jnp.bfloat16) * descale, and pass bfloat16 arrays")
  # The forward and the backward read one evaluation of a mask_mod's
  # classes (where it ignores batch and head), not one each.
  scores_ = scores.with_shared_mod_classes(scores_, q.shape[0], q.shape[2], q.shape[1],
                                           k.shape[1])
  primals = (q, k, v, bias, mask, scores_)
  out, lse = attention_core(*primals, config)
  dq, dk, dv, dbias, _, dscores = tangents
  # Of the score value only the sinks and the score_mod's float captured
  # arrays are differentiable (mask, lengths, segment ids, mask_mod's
  # captured arrays are not).
  dsinks = dscores.sinks if scores_.sinks is not None else None
  dcaptured = inexact_tangents(scores_.score_captured, dscores.score_captured)
  tangent = _LinearMap.of("attention", config, ((q, k, v, bias, mask, scores_), out, lse),
                          (dq, dk, dv, dbias, dsinks, dcaptured))
  return (out, lse), tangent


def _attention_tangent(config, residuals, linear, partitioned=True):
  """(dout, dlse) along the tangents (dq, dk, dv, dbias, dsinks, dcaptured):
  the XLA path's `tangent`, partitioned across devices unless it is to be
  differentiated (custom partitioning cannot be)."""
  operands, out, lse = residuals
  with precision_scope(config.matmul_precision):
    if partitioned:
      return sharding.tangent(config, *operands, out, lse, *linear)
    return xla_attention.tangent(*operands, out, lse, *linear)


def _attention_transpose(config, residuals, cotangents):
  """Cotangents (dq, dk, dv, dbias, dsinks, dcaptured) from those of (out,
  lse): the backend's fused backward. `dlse` is None (zero) unless the lse
  itself is differentiated (`fa4_jax.attention` returns it under
  stop_gradient); then the XLA backward serves (the kernels take no lse
  cotangent)."""
  operands, out, lse = residuals
  scores_ = operands[5]
  dout, dlse = cotangents  # None: zero
  if dout is None:
    dout = jnp.zeros_like(out)
  with precision_scope(config.matmul_precision):
    if dlse is None:
      dq, dk, dv, dbias, dcaptured = _fused_backward(config, operands, out, lse, dout)
    else:
      dq, dk, dv, dbias, dcaptured = _xla_backward(config, operands, out, lse, dout, dlse)
  dsinks = None
  if scores_.sinks is not None:
    delta = jnp.einsum("btnd,btnd->bnt", dout.astype(jnp.float32), out.astype(jnp.float32))
    if dlse is not None:
      delta = delta - dlse.astype(jnp.float32)
    dsinks = scores.sink_grad(scores_.sinks, lse, delta)
  if dcaptured is not None:  # leaves where the linear inputs have them (float arrays)
    dcaptured = inexact_tangents(scores_.score_captured, dcaptured)
  return dq, dk, dv, dbias, dsinks, dcaptured


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _fused_backward(config, operands, out, lse, dout):
  """The backend's backward, partitioned across devices (`sharding.backward`).
  A kernel cannot be differentiated: the derivative of the backward (for
  jax.hessian or a Hessian-vector product) is that of the XLA backward."""
  return sharding.backward(config, *operands, out, lse, dout)


def inexact_tangents(primals, tangents):
  """`tangents` with those of integer and boolean primals (float0: segment
  ids, lengths, masks) left out (None), as a linear map takes them."""
  return jax.tree.map(lambda x, t: t if jnp.issubdtype(x.dtype, jnp.inexact) else None,
                      primals, tangents)


@_fused_backward.defjvp
def _fused_backward_jvp(config, primals, tangents):
  tangent = _LinearMap.of("backward", config, primals, inexact_tangents(primals, tangents))
  return _fused_backward(config, *primals), tangent


def _backward_tangent(config, residuals, linear, partitioned=True):
  """Tangent of the XLA backward's (dq, dk, dv, dbias, dcaptured) at
  `residuals`. With a score_mod it is not partitioned (its captured arrays'
  tangents enter every block)."""
  operands, out, lse, dout = residuals
  with precision_scope(config.matmul_precision):
    if partitioned and operands[5].score_mod is None:
      return sharding.backward_tangent(config, *operands, out, lse, dout, *linear[0][:4],
                                       *linear[1:]) + (None,)
    linear = jax.tree.map(
        lambda x, t: np.zeros(x.shape, jax.dtypes.float0) if t is None else t, residuals, linear)
    return jax.jvp(lambda *a: _xla_backward(config, *a), residuals, linear)[1]


def _backward_transpose(config, residuals, cotangents):
  del config, residuals, cotangents
  raise ValueError(
      "fa4_jax.attention: reverse-over-reverse differentiation (jax.grad of a "
      "function that takes jax.grad through attention) is not supported: the "
      "backward is differentiated in forward mode. Use forward-over-reverse: "
      "jax.hessian(f), jax.jacfwd(jax.grad(f)), or jax.jvp(jax.grad(f), "
      "primals, tangents) for Hessian-vector products.")


def _xla_backward(config, operands, out, lse, dout, dlse=None):
  """The XLA path's backward (plain jnp: differentiable in forward mode)."""
  del config
  return xla_attention.backward(*operands, out, lse, dout, dlse=dlse)


# kind -> (evaluate(config, residuals, linear, partitioned=True),
#          transpose(config, residuals, cts))
_LINEAR_MAPS = {
    "attention": (_attention_tangent, _attention_transpose),
    "backward": (_backward_tangent, _backward_transpose),
}


def register_linear_map(kind: str, evaluate: Callable, transpose: Callable):
  """Adds a kind of `linear_map` (another module's differentiation rule,
  e.g. the context-parallel ring's): `evaluate(config, residuals, linear,
  partitioned=True)` is the map (plain jnp: it is differentiated for higher
  orders, with partitioned=False), `transpose(config, residuals, cts)` its
  transpose (None cotangents are zeros)."""
  _LINEAR_MAPS[kind] = (evaluate, transpose)


def linear_map(kind: str, config, residuals, linear):
  """The registered map `kind` applied to `linear` at fixed `residuals`, as
  one primitive: the tangent a `custom_jvp` rule returns, so that forward
  mode evaluates it and reverse mode transposes it (`_LinearMap`)."""
  return _LinearMap.of(kind, config, residuals, linear)


def refuse_reverse_over_reverse(config, residuals, cotangents):
  """The transpose of a backward's tangent: not supported (see the error)."""
  return _backward_transpose(config, residuals, cotangents)


class _LinearMap(hijax.HiPrim):
  """A map linear in its second input at fixed residuals, as one primitive
  (`jax.custom_derivatives.linear_call` has no batching rule and cannot be
  differentiated in its residuals): evaluated (forward mode) and
  transposed (reverse mode) by the pair `_LINEAR_MAPS[kind]`; differentiated
  in the residuals (higher orders) through the evaluation, which is plain
  jnp. Under `vmap` it stays one primitive, batched by `levels`: per vmap
  level (outermost first) which residual leaves carry that level's axis in
  front; the linear inputs always do."""

  skip_linearization_on_zero_tangents = True

  def __init__(self, kind, config, in_avals, out_aval, levels=()):
    self.in_avals = in_avals
    self.out_aval = out_aval
    self.params = dict(kind=kind, config=config, levels=levels)
    super().__init__()

  @classmethod
  def of(cls, kind, config, residuals, linear):
    """The map applied to `linear` (zero tangents as arrays)."""
    linear = jax.tree.map(_instantiate, linear, is_leaf=_is_zero)
    evaluate = _LINEAR_MAPS[kind][0]
    out_aval = jax.tree.map(jax.typeof, jax.eval_shape(
        functools.partial(evaluate, config), residuals, linear))
    in_avals = jax.tree.map(jax.typeof, (residuals, linear))
    return cls(kind, config, in_avals, out_aval)(residuals, linear)

  def _batched(self, fn):
    """`fn(config, residuals, x)` vmapped over every level, x batched in front."""
    fn = functools.partial(fn, self.config)
    residual_tree = jax.tree.structure(self.in_avals[0])
    for batched in reversed(self.levels):  # innermost level first
      res_axes = jax.tree.unflatten(residual_tree, [0 if b else None for b in batched])
      fn = jax.vmap(fn, in_axes=(res_axes, 0))
    return fn

  def expand(self, residuals, linear):
    return self._batched(_LINEAR_MAPS[self.kind][0])(residuals, linear)

  def transpose(self, out_ct, residuals, linear_accums):
    cts = jax.tree.map(lambda ct: None if _is_zero(ct) else ct, out_ct, is_leaf=_is_zero)
    grads = self._batched(_LINEAR_MAPS[self.kind][1])(residuals, cts)
    for accum, grad in zip(jax.tree.leaves(linear_accums, is_leaf=_is_accum),
                           jax.tree.leaves(grads)):
      if _is_accum(accum):  # else a known input (e.g. an instantiated zero)
        accum.accum(grad)

  def jvp(self, primals, tangents):
    tangents = jax.tree.map(_instantiate, tangents, is_leaf=_is_zero)
    evaluate = functools.partial(_LINEAR_MAPS[self.kind][0], partitioned=False)
    return jax.jvp(self._batched(evaluate), primals, tangents)

  lin, linearized = hijax.linearize_from_jvp

  def vjp_fwd(self, nzs_in, *args):
    del nzs_in, args
    raise ValueError(
        "fa4_jax.attention: reverse-mode differentiation of a forward-mode "
        "derivative (e.g. jax.jacrev(jax.jacfwd(f)) or jax.grad of a jax.jvp) is "
        "not supported. Use forward-over-reverse instead: jax.hessian(f), "
        "jax.jacfwd(jax.jacrev(f)), or jax.jvp(jax.grad(f), primals, tangents).")

  def batch(self, axis_data, args, dims):
    residuals, linear = args
    res_dims, lin_dims = dims
    front = lambda x, d: x if d is None else jnp.moveaxis(x, d, 0)
    residuals = jax.tree.map(front, residuals, res_dims)
    # The linear inputs all get the axis (their cotangents come back batched).
    size = axis_data.size
    linear = jax.tree.map(
        lambda x, d: jnp.broadcast_to(x, (size,) + x.shape) if d is None else front(x, d),
        linear, lin_dims)
    res_dims = jax.tree.structure(residuals).flatten_up_to(res_dims)
    levels = (tuple(d is not None for d in res_dims),) + self.levels
    in_avals = jax.tree.map(jax.typeof, (residuals, linear))
    out_aval = jax.tree.map(lambda a: hijax.ShapedArray((size,) + a.shape, a.dtype),
                            self.out_aval)
    out = _LinearMap(self.kind, self.config, in_avals, out_aval, levels)(residuals, linear)
    return out, jax.tree.map(lambda _: 0, out)


def _is_accum(x):
  return isinstance(x, hijax.GradAccum)


def _is_zero(x):
  return isinstance(x, hijax.Zero)


def _instantiate(t):
  """A symbolic zero as an array (float0 for integer primals)."""
  return np.zeros(t.aval.shape, t.aval.dtype) if _is_zero(t) else t


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


