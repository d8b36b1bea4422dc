"""A call staged whole under `jax.vmap`, with one batching rule.

Three places wrap a call in `jax.custom_batching.custom_vmap`: the sharding
rules (`custom_partitioning` has no batching rule of its own), the work
queue's kernels (a vmapped kernel must not share one queue counter across
the batch: `kernels.schedule.fixed_shares_under_vmap`) and the custom_jvp
rules that partial evaluation would otherwise drop (`vjp.keeping_rule`).
Their batching rule is the same, so it lives here.
"""

from __future__ import annotations

from typing import Callable

import jax


def custom_vmap_call(fn: Callable, under_vmap: Callable | None = None) -> Callable:
  """`fn(*arrays)` as one `custom_vmap` call. Under `jax.vmap` it runs
  `jax.vmap(under_vmap or fn)` over the batched operands (every output
  batched); called with no operand batched (as custom_vmap's own jvp does),
  it runs `fn` itself."""
  batched_fn = fn if under_vmap is None else under_vmap

  @jax.custom_batching.custom_vmap
  def call(*arrays):
    return fn(*arrays)

  @call.def_vmap
  def _vmap_rule(axis_size, in_batched, *arrays):
    del axis_size
    if not any(in_batched):
      out = fn(*arrays)
      return out, jax.tree.map(lambda _: False, out)
    in_axes = tuple(0 if batched else None for batched in in_batched)
    out = jax.vmap(batched_fn, in_axes=in_axes)(*arrays)
    return out, jax.tree.map(lambda _: True, out)

  return call
