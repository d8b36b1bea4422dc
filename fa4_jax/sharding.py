"""Partitioning of attention under `jax.jit` with sharded inputs.

`vjp.py` calls the backends only through `forward` and `backward` here, so
this module is the one place that decides how a call is split across devices.

How a sharded call is split
---------------------------
Both calls are wrapped in `jax.experimental.custom_partitioning`. Under
`jax.jit`, XLA first decides the shardings around the call (Shardy, the
default partitioner in jax 0.11, reads the einsum-like `sharding_rule` built
by `_sharding_rule`; the older GSPMD partitioner calls
`_infer_result_shardings` instead). Then the SPMD partitioner calls
`_partition` with the operands' shardings; it returns the shardings it wants
for every operand and result, and a function that runs the backend on one
device's shard. For each axis of `query` ([B, T, N, H]):

* batch (B): stays sharded. `key`, `value`, the `*_seq_lengths` and
  `*_segment_ids` arrays and the batch dimension of `bias`/`mask` follow it.
  No communication.
* heads (N): stays sharded, and `key`/`value` heads follow, so a device holds
  whole GQA groups (query heads `g*G .. g*G+G-1` with KV head `g`). That needs
  the number of head shards to divide the number of KV heads; otherwise
  `_partition` raises a `ValueError` that says so (XLA reports it wrapped in
  a `JaxRuntimeError` from `.compile()`, the message intact).
* sequence (T of `query` and its segment ids, S of `key`/`value` and theirs)
  and head_dim (H): every device
  needs whole sequences, so these are **all-gathered** before the call (the
  result is correct, but memory and traffic grow with the sequence). For
  sequences too long for one device use `fa4_jax.context_parallel_attention`,
  which keeps them sharded and passes K/V blocks around a ring.
* `bias` / `mask` dimensions of size 1 (broadcast) are replicated; full ones
  follow the batch and head sharding. In the backward, the gradient of a
  bias broadcast over a sharded batch or head axis is summed across those
  devices (`psum`), so it comes out replicated, as its shape demands.

Under `jax.vmap` the call falls back to the backend batched by `vmap`, with
XLA's own partitioning (custom partitioning has no batching rule). In
`fa4_jax.interpret_mode` the backend runs unwrapped: the interpreter holds
one GPU's state on the host.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from fa4_jax import interpret, xla_attention
from fa4_jax.batching import custom_vmap_call

# One letter per dimension of every array the backends see:
#   b batch, t query position, s key position, n query head, k KV head,
#   h head dim of q and k, e head dim of v (and of the output: it may differ
#   from h); r any dimension every device needs whole (the arrays a
#   score_mod or mask_mod captured, the block mask's tile axes).
#   `bias`/`mask`/block-mask dims of size 1 are broadcast (see `_labels`).
_LAYOUTS = {
    "q": "btnh", "k": "bskh", "v": "bske", "bias": "bnts", "mask": "bnts",
    "q_lengths": "b", "kv_lengths": "b", "q_segment_ids": "bt", "kv_segment_ids": "bs",
    "sinks": "n", "q_descale": "n", "k_descale": "k", "v_descale": "k",
    "block_mask.classes": "bnrr", "out": "btne", "lse": "bnt", "dout": "btne",
    "dq": "btnh", "dk": "bskh", "dv": "bske", "dbias": "bnts",
}
# Arrays whose size-1 dims broadcast (labelled "1").
_BROADCASTING = ("bias", "mask", "dbias", "block_mask.classes")
_FORWARD_OPERANDS = ("q", "k", "v", "bias", "mask")
_BACKWARD_OPERANDS = _FORWARD_OPERANDS + ("out", "lse", "dout")
# Forward-mode derivatives: "x_t" is the tangent of "x" (laid out like it).
_TANGENT_OPERANDS = _FORWARD_OPERANDS + ("out", "lse", "q_t", "k_t", "v_t", "bias_t",
                                         "sinks_t")
_BACKWARD_TANGENT_OPERANDS = _BACKWARD_OPERANDS + ("q_t", "k_t", "v_t", "bias_t", "out_t",
                                                   "lse_t", "dout_t")


def _base(name: str) -> str:
  """The array whose layout `name` has: itself, or what it is the tangent of."""
  return name.removesuffix("_t")
# Dimensions every device needs whole (gathered when they arrive sharded).
_REPLICATED_DIMS = "tsher"


@dataclasses.dataclass(frozen=True)
class _PartitionedCall:
  """The static part of one partitioned call (hashable: a static argument).

  `operands` / `results` name the arrays actually passed and returned, in
  order; absent optional operands (None) are left out. The score value's
  arrays are operands named by their field (`_score_leaves`); `scores` is
  its tree structure, which holds its static part.
  """

  config: object  # vjp.CoreConfig
  operands: tuple[str, ...]
  results: tuple[str, ...]
  scores: object = None  # the score value's treedef


def _score_leaves(scores_) -> tuple[tuple[str, ...], list, object]:
  """(names, arrays, treedef) of the score value's arrays: "q_lengths",
  "score_captured[0]", "block_mask.classes", ..."""
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(scores_)
  names = tuple(jax.tree_util.keystr(path, simple=True, separator=".")
                for path, _ in with_paths)
  return names, [x for _, x in with_paths], treedef


def _captured_layout(name: str, ndim: int) -> str:
  return "r" * ndim


def _score_results(scores_) -> tuple[str, ...]:
  """Names of the gradients of the score_mod's float captured arrays."""
  if scores_.score_mod is None:
    return ()
  return tuple(f"dcaptured.{i}" for i, c in enumerate(scores_.score_captured)
               if jax.numpy.issubdtype(c.dtype, jax.numpy.inexact))


def _named_call(config, given: dict, order, scores_, results, extra=()):
  """(call, arrays) for the arrays in `given` (None left out), then the
  score value's, then `extra` (name, array) pairs."""
  names = [n for n in order if given.get(n) is not None]
  arrays = [given[n] for n in names]
  score_names, score_arrays, treedef = _score_leaves(scores_)
  for name, x in extra:
    if x is not None:
      names.append(name)
      arrays.append(x)
  call = _PartitionedCall(config, tuple(names) + score_names, tuple(results), treedef)
  return call, arrays + score_arrays


# ---------------------------------------------------------------------------
# Entry points used by vjp.py.


def forward(config, q, k, v, bias, mask, scores_):
  """(out, lse) of the backend in `config`, partitioned across devices."""
  given = dict(q=q, k=k, v=v, bias=bias, mask=mask)
  call, arrays = _named_call(config, given, _FORWARD_OPERANDS, scores_, ("out", "lse"))
  return _run(call, arrays)


def backward(config, q, k, v, bias, mask, scores_, out, lse, dout):
  """(dq, dk, dv, dbias or None, dcaptured or None) of the backend,
  partitioned across devices."""
  given = dict(q=q, k=k, v=v, bias=bias, mask=mask, out=out, lse=lse, dout=dout)
  results = (("dq", "dk", "dv") + (("dbias",) if bias is not None else ())
             + _score_results(scores_))
  call, arrays = _named_call(config, given, _BACKWARD_OPERANDS, scores_, results)
  grads = dict(zip(results, _run(call, arrays)))
  return (grads["dq"], grads["dk"], grads["dv"], grads.get("dbias"),
          _captured_grads(scores_, grads))


def _captured_grads(scores_, grads: dict):
  if scores_.score_mod is None:
    return None
  return tuple(grads.get(f"dcaptured.{i}") for i in range(len(scores_.score_captured)))


def tangent(config, q, k, v, bias, mask, scores_, out, lse, q_t, k_t, v_t, bias_t, sinks_t,
            captured_t):
  """Tangents (of out, of lse) of the forward (`xla_attention.tangent`),
  partitioned like it."""
  given = dict(q=q, k=k, v=v, bias=bias, mask=mask, out=out, lse=lse, q_t=q_t, k_t=k_t,
               v_t=v_t, bias_t=bias_t, sinks_t=sinks_t)
  extra = [(f"captured_t.{i}", t) for i, t in enumerate(captured_t or ())]
  call, arrays = _named_call(config, given, _TANGENT_OPERANDS, scores_, ("out_t", "lse_t"),
                             extra)
  return _run(call, arrays)


def backward_tangent(config, q, k, v, bias, mask, scores_, out, lse, dout, q_t, k_t, v_t,
                     bias_t, out_t, lse_t, dout_t):
  """Tangents (of dq, dk, dv, dbias or None) of the XLA backward, partitioned
  like the backward (a call without a score_mod)."""
  given = dict(q=q, k=k, v=v, bias=bias, mask=mask, out=out, lse=lse, dout=dout, q_t=q_t,
               k_t=k_t, v_t=v_t, bias_t=bias_t, out_t=out_t, lse_t=lse_t, dout_t=dout_t)
  results = ("dq_t", "dk_t", "dv_t") + (("dbias_t",) if bias is not None else ())
  call, arrays = _named_call(config, given, _BACKWARD_TANGENT_OPERANDS, scores_, results)
  grads = _run(call, arrays)
  return tuple(grads) + ((None,) if bias is None else ())


# ---------------------------------------------------------------------------
# The per-device computation: the backend on whatever shapes it is given.


def _split_named(call: _PartitionedCall, arrays):
  """(the named arrays as a dict, the score value rebuilt)."""
  num_scores = call.scores.num_leaves
  named = dict(zip(call.operands[:len(arrays) - num_scores], arrays[:len(arrays) - num_scores]))
  scores_ = call.scores.unflatten(arrays[len(arrays) - num_scores:])
  return named, scores_


def _call_backend(call: _PartitionedCall, *arrays):
  """Runs the backend on `arrays` (named by `call.operands`); a flat tuple."""
  return _call_backend_at(call, arrays, None)


def _call_backend_at(call: _PartitionedCall, arrays, index_offsets):
  """`_call_backend` on one device's shard; `index_offsets`: its first
  (batch, head), which a score_mod or mask_mod must see as global indices."""
  a, scores_ = _split_named(call, arrays)
  if index_offsets is not None:
    scores_ = scores_.replace(index_offsets=index_offsets)
  cfg = call.config
  common = tuple(a.get(n) for n in _FORWARD_OPERANDS) + (scores_,)
  if call.results == ("out", "lse"):
    return tuple(cfg.backend.forward(*common))
  if call.results == ("out_t", "lse_t"):
    tangents = [a.get(n) for n in ("q_t", "k_t", "v_t", "bias_t", "sinks_t")]
    captured_t = tuple(a.get(f"captured_t.{i}") for i in range(len(scores_.score_captured)))
    return xla_attention.tangent(*common, a["out"], a["lse"], *tangents, captured_t)
  if call.results[0] == "dq_t":
    primals = tuple(a.get(n) for n in _FORWARD_OPERANDS) + (a["out"], a["lse"], a["dout"])
    tangents = tuple(a.get(n + "_t") for n in _BACKWARD_OPERANDS)
    # Integer operands (and absent ones) have no tangent: float0 zeros.
    tangents = tuple(np.zeros(x.shape, jax.dtypes.float0) if x is not None and t is None else t
                     for x, t in zip(primals, tangents))

    def xla_backward(q, k, v, bias, mask, out, lse, dout):
      return xla_attention.backward(q, k, v, bias, mask, scores_, out, lse, dout)[:4]

    dq, dk, dv, dbias = jax.jvp(xla_backward, primals, tangents)[1]
    return (dq, dk, dv) + ((dbias,) if "dbias_t" in call.results else ())
  # `deterministic` reaches the backend only where it is False (the default
  # needs no keyword from backends that have no non-deterministic backward).
  options = {} if cfg.deterministic else dict(deterministic=False)
  dq, dk, dv, dbias, dcaptured = cfg.backend.backward(*common, a["out"], a["lse"], a["dout"],
                                                      **options)
  grads = dict(dq=dq, dk=dk, dv=dv, dbias=dbias)
  for i, g in enumerate(dcaptured or ()):
    grads[f"dcaptured.{i}"] = g
  return tuple(grads[n] for n in call.results)


def _run(call: _PartitionedCall, arrays):
  """Runs `_call_backend` split across devices.

  Inputs typed with explicit shardings (a mesh with `AxisType.Explicit` axes,
  the default of `jax.make_mesh`) have their shardings known while tracing:
  the call becomes a `shard_map`. Otherwise (`AxisType.Auto` meshes, no mesh)
  XLA decides the shardings at compile time through `custom_partitioning`.
  """
  if interpret.is_interpreting():
    # The GPU interpreter runs on one host device, and custom_partitioning's
    # lowering cannot carry its ordered callbacks (under jax.jit it raised a
    # KeyError): the backend itself.
    return _call_backend(call, *arrays)
  mesh = _explicit_mesh(arrays)
  if mesh is not None:
    return _shard_mapped(call, mesh, arrays)

  # custom_partitioning has no batching rule: under vmap, the backend itself.
  return custom_vmap_call(functools.partial(_partitioned, call),
                          under_vmap=functools.partial(_call_backend, call))(*arrays)


def _explicit_mesh(arrays):
  """The mesh of the operands' sharding types if it has explicit axes."""
  for x in arrays:
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    if mesh is not None and AxisType.Explicit in getattr(mesh, "axis_types", ()):
      return mesh
  return None


def _result_shape(name: str, shapes: dict) -> tuple[int, ...]:
  if name.startswith("dcaptured."):
    return shapes["score_captured." + name.split(".")[1]]
  q, k = shapes["q"], shapes["k"]
  return {"out": q, "dq": q, "lse": (q[0], q[2], q[1]), "dk": k, "dv": k,
          "dbias": shapes.get("bias")}[_base(name)]


def _full_spec(spec, ndim: int) -> tuple:
  return tuple(spec) + (None,) * (ndim - len(tuple(spec)))


def _result_specs(call: _PartitionedCall, given_specs: dict) -> list[PartitionSpec]:
  """Each result sharded like the operand it mirrors (lse like the query)."""
  q = given_specs["q"]
  like = {"out": q, "dq": q, "lse": (q[0], q[2], q[1]),
          "dk": given_specs["k"], "dv": given_specs["v"],
          "dbias": given_specs.get("bias")}
  return [PartitionSpec() if n.startswith("dcaptured.") else PartitionSpec(*like[_base(n)])
          for n in call.results]


def _shard_mapped(call: _PartitionedCall, mesh, arrays):
  """Explicit shardings: one `shard_map` over the batch and head axes."""
  shapes = {n: a.shape for n, a in zip(call.operands, arrays)}
  given_specs = {n: _full_spec(jax.typeof(a).sharding.spec, a.ndim)
                 for n, a in zip(call.operands, arrays)}
  q_spec = given_specs["q"]
  plan = _plan(mesh, shapes["q"], shapes["k"][2], q_spec)
  in_specs = tuple(plan.spec(_labels(call, n, shapes[n])) for n in call.operands)
  result_shapes = [_result_shape(n, shapes) for n in call.results]
  out_specs = tuple(plan.spec(_labels(call, n, r))
                    for n, r in zip(call.results, result_shapes))
  # Operands sharded otherwise (a sequence axis, say) are resharded first:
  # an all-gather along those axes.
  arrays = [jax.sharding.reshard(a, NamedSharding(mesh, spec))
            for a, spec in zip(arrays, in_specs)]
  reduce_axes = _reduce_axes(call, plan, result_shapes)
  run = jax.shard_map(_per_device(call, plan, reduce_axes), mesh=mesh,
                      in_specs=in_specs, out_specs=out_specs, check_vma=False)
  results = run(*arrays)
  # Results take their operands' shardings back (the custom_vjp needs each
  # gradient typed like its input); undoing a gather is a local slice.
  return tuple(jax.sharding.reshard(r, NamedSharding(mesh, spec))
               for r, spec in zip(results, _result_specs(call, given_specs)))


# ---------------------------------------------------------------------------
# Partitioning rules.


def _labels(call: _PartitionedCall, name: str, shape) -> str:
  """Dimension letters of array `name`; "1" marks a broadcast (size-1) dim of
  `bias`/`mask`/`dbias`/the block mask whose full size is larger."""
  base = _base(name)
  if base not in _LAYOUTS:  # captured arrays, their tangents and gradients
    return "r" * len(shape)
  layout = _LAYOUTS[base]
  if base not in _BROADCASTING:
    return layout
  return "".join("1" if size == 1 and letter in "bn" + "ts" * (base != "block_mask.classes")
                 else letter for letter, size in zip(layout, shape))


def _sharding_rule(call: _PartitionedCall, mesh, operand_types, result_types):
  """Shardy rule, e.g. "b t (k g) h, b s k h, b s k h -> b t (k g) h, b (k g) t".

  Query heads are the compound factor (k g): KV head major, group member
  minor, so sharding the heads shards whole groups first. t, s and h must be
  replicated. Broadcast dims get a factor of their own, of size 1.
  """
  del mesh
  shapes = [t.shape for t in list(operand_types) + list(result_types)]
  names = call.operands + call.results
  q_heads = shapes[0][2]
  kv_heads = shapes[1][2]
  group = q_heads // kv_heads
  factor = {"b": "b", "t": "t", "s": "s", "k": "k", "h": "h", "e": "e",
            "n": "(k g)" if group > 1 else "k"}
  if kv_heads == 1:  # MQA: Shardy takes no size-1 factor inside a compound
    factor["n"] = "n"
  ones = 0
  whole = []

  def dims(name, shape):
    nonlocal ones
    out = []
    for letter in _labels(call, name, shape):
      if letter == "1" or (letter == "k" and kv_heads == 1):
        out.append(f"one{ones}")
        ones += 1
      elif letter == "r":  # a dimension of its own, kept whole
        out.append(f"whole{len(whole)}")
        whole.append(out[-1])
      else:
        out.append(factor[letter])
    return " ".join(out)

  terms = [dims(n, s) for n, s in zip(names, shapes)]
  nin = len(call.operands)
  rule = ", ".join(terms[:nin]) + " -> " + ", ".join(terms[nin:])
  # Shardy wants special factors listed in order of first appearance.
  tokens = re.findall(r"\w+", rule)
  replicated = sorted([d for d in _REPLICATED_DIMS if d in tokens] + whole, key=tokens.index)
  options = {"need_replication_factors": tuple(replicated)}
  if group > 1 and kv_heads > 1:
    options["g"] = group  # g appears only inside (k g): its size must be given
  return rule, options


def _mesh_axes(entry) -> tuple[str, ...]:
  """Mesh axis names of one PartitionSpec entry (None, a name or a tuple)."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Which mesh axes shard the batch and the head dimensions."""

  mesh: object
  batch: tuple[str, ...]
  heads: tuple[str, ...]

  def spec(self, labels: str) -> PartitionSpec:
    axes = {"b": self.batch, "n": self.heads, "k": self.heads}
    entries = []
    for letter in labels:
      got = axes.get(letter, ())
      entries.append(None if not got else (got[0] if len(got) == 1 else got))
    return PartitionSpec(*entries)

  def sharding(self, call: _PartitionedCall, name: str, shape) -> NamedSharding:
    return NamedSharding(self.mesh, self.spec(_labels(call, name, shape)))


def _plan(mesh, q_shape, kv_heads: int, q_spec) -> _Plan:
  """Reads the batch and head sharding off the query's spec; checks GQA groups."""
  spec = tuple(q_spec) + (None,) * (4 - len(tuple(q_spec)))
  batch, heads = _mesh_axes(spec[0]), _mesh_axes(spec[2])
  head_shards = math.prod(mesh.shape[a] for a in heads)
  q_heads = q_shape[2]
  if kv_heads % head_shards:
    raise ValueError(
        f"fa4_jax.attention: the query heads are sharded {head_shards} ways "
        f"(mesh axes {heads}), which splits grouped-query attention groups: "
        f"{q_heads} query heads share {kv_heads} key/value heads "
        f"({q_heads // kv_heads} per group), and each device must hold whole "
        f"groups, so the number of head shards must divide {kv_heads}. Shard "
        "the heads over fewer devices, or replicate them.")
  return _Plan(mesh, batch, heads)


def _plan_from_shapes(mesh, arg_shapes) -> _Plan:
  q, k = arg_shapes[0], arg_shapes[1]
  return _plan(mesh, q.shape, k.shape[2], getattr(q.sharding, "spec", ()))


def _reduce_axes(call: _PartitionedCall, plan: _Plan, result_shapes) -> tuple[tuple[str, ...], ...]:
  """Per result, the mesh axes to sum it over: a bias broadcast over a
  sharded batch or head axis, and the captured arrays of a score_mod, get a
  partial gradient on each device."""
  axes = []
  for name, shape in zip(call.results, result_shapes):
    if _base(name) == "dbias":
      labels = _labels(call, "dbias", shape)
      axes.append((plan.batch if labels[0] == "1" else ())
                  + (plan.heads if labels[1] == "1" else ()))
    elif name.startswith("dcaptured."):
      axes.append(plan.batch + plan.heads)
    else:
      axes.append(())
  return tuple(axes)


def _index_offsets(call: _PartitionedCall, plan: _Plan, arrays):
  """int32 [2]: this device's first (batch, head) in the whole call, for a
  score_mod or mask_mod (which see global indices); None without them or
  when neither axis is sharded."""
  if call.scores is None or not (plan.batch or plan.heads):
    return None
  _, scores_ = _split_named(call, arrays)
  if not scores_.has_mods:
    return None
  q = arrays[call.operands.index("q")]
  return index_offsets(plan.mesh.shape, plan.batch, q.shape[0], plan.heads, q.shape[2])


def index_offsets(axis_sizes, batch_axes, local_batch: int, head_axes, local_heads: int):
  """int32 [2] (`Scores.index_offsets`): the global (batch, head) of this
  device's first row and head, inside a `shard_map` or a partitioned call
  whose batch and heads are sharded over `batch_axes` and `head_axes`
  (`axis_sizes`: mesh axis name -> size). The context-parallel ring uses it too."""

  def first(axes, local_size):
    index = 0
    for axis in axes:  # row-major over the axes, as PartitionSpec lays them out
      index = index * axis_sizes[axis] + jax.lax.axis_index(axis)
    return index * local_size

  return jax.numpy.stack([first(batch_axes, local_batch),
                          first(head_axes, local_heads)]).astype(jax.numpy.int32)


def _per_device(call: _PartitionedCall, plan: _Plan, reduce_axes):
  """The backend on one device's shard, with partial gradients summed."""

  def run(*arrays):
    results = _call_backend_at(call, arrays, _index_offsets(call, plan, arrays))
    return tuple(jax.lax.psum(r, axes) if axes else r for r, axes in zip(results, reduce_axes))

  return run


def _partition(call: _PartitionedCall, mesh, arg_shapes, result_shapes):
  """custom_partitioning callback: shardings wanted, and the per-device call."""
  plan = _plan_from_shapes(mesh, arg_shapes)
  arg_shardings = tuple(plan.sharding(call, n, a.shape)
                        for n, a in zip(call.operands, arg_shapes))
  result_shardings = tuple(plan.sharding(call, n, r.shape)
                           for n, r in zip(call.results, result_shapes))
  reduce_axes = _reduce_axes(call, plan, [r.shape for r in result_shapes])
  return mesh, _per_device(call, plan, reduce_axes), result_shardings, arg_shardings


def _infer_result_shardings(call: _PartitionedCall, mesh, arg_shapes, result_shapes):
  """Result shardings from the operands' (GSPMD partitioner only)."""
  plan = _plan_from_shapes(mesh, arg_shapes)
  return tuple(plan.sharding(call, n, r.shape)
               for n, r in zip(call.results, result_shapes))


_partitioned = custom_partitioning(_call_backend, static_argnums=(0,))
_partitioned.def_partition(
    partition=_partition,
    infer_sharding_from_operands=_infer_result_shardings,
    sharding_rule=_sharding_rule)
