"""Staging code per lowering platform.

`cuda_else(cuda, default, *operands)`: one function for CUDA, another for
every other platform. Under `fa4_jax.gpu_target` a kernel backend stages out
its Mosaic GPU kernel for CUDA and the XLA path for the CPU (and TPU), so
that one function exported for `("cuda", "cpu")` runs on both.
`jax.lax.platform_dependent` is the public way, but in jax 0.11.2 (pinned)
it lowers each branch for *all* the lowering platforms, and Pallas' GPU
lowering refuses a multi-platform lowering ("mpmd_map does not support
multi-platform lowering"). So `cuda_else` binds a primitive holding both
functions as jaxprs whose lowering rule (`mlir.lower_per_platform`) lowers
the CUDA one for CUDA alone and the other one for the remaining platforms.
Lowered for one platform, only that platform's function is emitted; both
are traced, though (when `cuda_else` is called).

`check_lowering(x, cuda_warning=, elsewhere_error=)`: `x` unchanged, but
lowering it for CUDA warns and lowering it for another platform raises, with
the given messages. Free at run time (it lowers to nothing) and nearly free
to trace.
"""

from __future__ import annotations

import warnings
from typing import Callable

import jax
import jax.extend
from jax._src.interpreters import mlir as mlir_internal  # lower_per_platform: jax is pinned
from jax.interpreters import ad, batching, mlir

_per_platform_p = jax.extend.core.Primitive("fa4_jax_cuda_else")
_per_platform_p.multiple_results = True


def cuda_else(cuda: Callable, default: Callable, *operands):
  """`cuda(*operands)` where lowered for CUDA, `default(*operands)` on every
  other platform. Operands and results are pytrees (None allowed); both
  functions must return the same structure, shapes and dtypes."""
  flat, in_tree = jax.tree.flatten(operands)
  cuda_jaxpr, out_tree = _trace(cuda, in_tree, flat)
  default_jaxpr, default_tree = _trace(default, in_tree, flat)
  if default_tree != out_tree or default_jaxpr.out_avals != cuda_jaxpr.out_avals:
    raise TypeError(f"cuda_else: the functions' results differ: {out_tree} "
                    f"{cuda_jaxpr.out_avals} vs {default_tree} {default_jaxpr.out_avals}")
  outs = _per_platform_p.bind(*flat, cuda=cuda_jaxpr, default=default_jaxpr)
  return jax.tree.unflatten(out_tree, outs)


def _trace(fn, in_tree, flat):
  """`fn` on the unflattened operands as a closed jaxpr of flat arrays."""
  out_tree = None

  def flat_fn(*flat_operands):
    nonlocal out_tree
    outs, out_tree = jax.tree.flatten(fn(*jax.tree.unflatten(in_tree, flat_operands)))
    return outs

  jaxpr = jax.make_jaxpr(flat_fn)(*flat)
  return jaxpr, out_tree


@_per_platform_p.def_effectful_abstract_eval
def _abstract_eval(*avals, cuda, default):
  del avals
  return cuda.out_avals, cuda.effects | default.effects


def _lowering_rule(jaxpr):
  return mlir.lower_fun(jax.extend.core.jaxpr_as_fun(jaxpr), multiple_results=True)


def _lower(ctx, *args, cuda, default):
  # `lower_per_platform` narrows each rule's context to its platforms, and
  # `lower_fun` lowers the jaxpr for those alone.
  return mlir_internal.lower_per_platform(
      ctx, "fa4_jax_cuda_else", {"cuda": _lowering_rule(cuda)}, _lowering_rule(default),
      cuda.effects | default.effects, *args)


mlir.register_lowering(_per_platform_p, _lower)


def _batch(args, dims, *, cuda, default):
  """vmap: both functions vmapped, results batched along axis 0."""
  def batched(jaxpr):  # dims: an operand's batch axis, None where it has none
    return jax.vmap(jax.extend.core.jaxpr_as_fun(jaxpr), in_axes=list(dims))

  outs = cuda_else(batched(cuda), batched(default), *args)
  return outs, [0] * len(outs)


batching.primitive_batchers[_per_platform_p] = _batch


# --- check_lowering ----------------------------------------------------------

_check_p = jax.extend.core.Primitive("fa4_jax_check_lowering")
_check_p.def_impl(lambda x, **_: x)
_check_p.def_abstract_eval(lambda x, **_: x)
batching.primitive_batchers[_check_p] = (
    lambda args, dims, **params: (_check_p.bind(*args, **params), dims[0]))
ad.deflinear2(_check_p, lambda cotangent, x, **_: [cotangent])


def check_lowering(x, *, cuda_warning: str | None = None, elsewhere_error: str | None = None):
  """`x`; lowering it for CUDA warns `cuda_warning`, lowering it for any
  other platform raises a ValueError with `elsewhere_error` (each if set)."""
  return _check_p.bind(x, cuda_warning=cuda_warning, elsewhere_error=elsewhere_error)


def _lower_check_for_cuda(ctx, x, *, cuda_warning, elsewhere_error):
  del ctx, elsewhere_error
  if cuda_warning is not None:
    warnings.warn(cuda_warning, stacklevel=2)
  return [x]


def _lower_check_elsewhere(ctx, x, *, cuda_warning, elsewhere_error):
  del ctx, cuda_warning
  if elsewhere_error is not None:
    raise ValueError(elsewhere_error)
  return [x]


mlir.register_lowering(_check_p, _lower_check_elsewhere)
mlir.register_lowering(_check_p, _lower_check_for_cuda, platform="cuda")
