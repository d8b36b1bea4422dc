"""Context parallelism: attention over a sequence sharded along a mesh axis.

`context_parallel_attention(q, k, v, mesh=mesh, axis_name="seq")` computes the
same result as `fa4_jax.attention(q, k, v)` while `q`, `k` and `v` stay
sharded along their sequence axis over the `P` devices of mesh axis
`axis_name`: no device ever holds a whole sequence.

Ring attention
--------------
Each device keeps its own queries and passes its key/value block to the next
device of the ring (`lax.ppermute`, device `i` -> `i + 1`), `P` steps in all.
At every step it attends its queries to the block it holds and merges the
partial result into a running one with the log-sum-exp of each part:

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

The block sent at a step travels while the device computes with the block it
already has, so communication can hide behind compute.

`logits_soft_cap` is applied by every backend call to its own logits, before
its mask. `sinks` enter once, after the ring: the merged (out, lse) gets them
as any backend's post-pass does (`scores.add_sinks`), so the lse the
backward reads includes them.

Differentiation follows `fa4_jax/vjp.py`: one `jax.custom_jvp` whose tangent
is a `vjp.linear_map`. Reverse mode transposes it to the ring backward,
written by hand: blocks travel the ring again, each device adds its
contribution to the key/value gradients of the block it holds, and those
gradients travel with the block, arriving back at the block's owner after
the last step. Per block, the backend's backward recomputes probabilities
from the final (merged) log-sum-exp and output, which makes each block's
gradient exact; the sinks' gradient is a reduction (`scores.sink_grad`).
Forward mode (`jax.jvp`, `jax.jacfwd`) evaluates it with a tangent ring: the
XLA path's tangent is a sum over keys with P = exp(s - final lse), so each
block's part (`xla_attention.tangent_sums`, the key/value tangents
travelling with the block) adds up, finished once like the XLA path's
(`xla_attention.finish_tangent`). Second derivatives (`jax.hessian`,
`jax.jvp(jax.grad(f))`) differentiate the ring backward on the XLA path;
reverse-over-reverse raises the `ValueError` of `fa4_jax.attention`.

Layout and causal load balancing
--------------------------------
The sequence is cut into `2P` chunks of `T / (2P)` positions; each device
holds two. With `load_balanced=True` (the default) device `i` holds chunks `i`
and `2P - 1 - i`: under a causal mask, an early chunk has little to do and its
mirror a lot, so every device does the same work. Lay a sequence out in that
order with `load_balance(x, P)` (and back with `unload_balance`); do it once
at the input of a model (token ids, positions) and once at the output, not
around every attention call. With `load_balanced=False` device `i` holds the
contiguous chunks `2i` and `2i + 1` (correct, but under a causal mask the last
device does most of the work).

Work per ring step
------------------
At every step a device runs one or two backend calls with static masks and
shapes, chosen so that no call is spent on a fully masked pair of chunks and
each call is as large as possible (larger calls run the kernels closer to
their peak; fewer calls mean fewer merges). With `a` this device and `d` the
device the key/value block came from:

* not causal: its queries against the whole block (dense);
* causal, contiguous layout: step 0 the causal diagonal; later, the whole
  block when `d < a`, nothing when `d > a`;
* causal, load-balanced: step 0 the first query chunk against the first key
  chunk (causal diagonal) and the second query chunk against both key chunks
  (causal with the diagonal shifted by one chunk, `MaskSpec.q_offset`); later,
  when `d < a` both query chunks against the block's first chunk, else the
  second query chunk against the whole block (dense). Every step does the
  same work, on every device.

The choice between the two later cases depends on the device, so it is a
`lax.cond` at run time. The backend is the one `fa4_jax.attention` would pick
(`implementation=`), the XLA path on a CPU.

score_mod, mask_mod and block masks
-----------------------------------
The mods see global indices, as in one `fa4_jax.attention` call on the
unsharded sequence in its natural order. The global batch row and head of a
device's first ones come from `Scores.index_offsets` (`sharding.index_offsets`,
as a sharded `fa4_jax.attention` computes them). Positions need more: a call's
rows (or keys) may be two chunks that are not neighbours (chunks `a` and
`2P-1-a`), which no single offset describes, and the kernels read exactly a
(batch, head) offset. So each mod is traced once more, into a function of the
call's local positions (`_at_global_positions`): position `i` of the call is
`i + start_0` in its first chunk and `i - c + start_1` in its second, the
starts four int32 scalars captured by the mod (they change per device and
ring step; the traced function does not). Every backend runs it as it runs
any mod, kernels included.

A global `block_mask` gives each block pair its slice of tile classes (the
tiles of the pair's chunks, a dynamic slice per chunk: no `mask_mod` is
evaluated per step) when its tiles do not straddle chunk boundaries (`c`
divisible by its `q_block` and `kv_block`); a pair with no visible tile is
skipped, by a `lax.cond`, like the pairs a causal mask hides. Otherwise, or
without a block mask, each backend call classifies its own tiles from
`mask_mod`, as `fa4_jax.attention` does without one. The gradients of the
arrays a `score_mod` closes over are partial on every device (its queries, the
blocks it saw, its batch rows and heads) and summed over the ring, batch and
head axes (`psum`), as `sharding.py` sums them over the batch and head axes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from fa4_jax import backends, mod_functions, scores, sharding, vjp, xla_attention
from fa4_jax.scores import MaskSpec, ScoreFunction, Scores
from fa4_jax.validation import validate

# ---------------------------------------------------------------------------
# Sequence layout.


def _balanced_chunk_order(num_shards: int) -> np.ndarray:
  """Chunks in load-balanced order: 0, 2P-1, 1, 2P-2, ..., P-1, P."""
  p = num_shards
  return np.array([c for i in range(p) for c in (i, 2 * p - 1 - i)])


def _reorder_chunks(x, num_shards: int, axis: int, order: np.ndarray):
  _check_positive_int(num_shards, "num_shards")
  axis = axis % x.ndim
  n = x.shape[axis]
  if n % (2 * num_shards):
    raise ValueError(
        f"sequence length {n} (axis {axis}) must be divisible by 2 * num_shards "
        f"= {2 * num_shards}")
  sharding = jax.typeof(x).sharding
  mesh = getattr(sharding, "mesh", None)
  spec = tuple(getattr(sharding, "spec", ())) + (None,) * x.ndim
  if (mesh is not None and AxisType.Explicit in getattr(mesh, "axis_types", ())
      and spec[axis] is not None):
    # Explicitly sharded along the sequence: gather it, reorder, shard again.
    whole = PartitionSpec(*spec[:axis], None, *spec[axis + 1:x.ndim])
    x = jax.sharding.reshard(x, NamedSharding(mesh, whole))
    x = _reorder_chunks(x, num_shards, axis, order)
    return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec(*spec[:x.ndim])))
  chunks = x.reshape(x.shape[:axis] + (2 * num_shards, n // (2 * num_shards))
                     + x.shape[axis + 1:])
  return jnp.take(chunks, order, axis=axis).reshape(x.shape)


def load_balance(x, num_shards: int, *, axis: int = 1):
  """Reorders a sequence axis into the load-balanced layout.

  Cuts axis `axis` (length divisible by `2 * num_shards`) into `2 * num_shards`
  chunks and orders them `0, 2P-1, 1, 2P-2, ...`, so that sharding the result
  evenly over `num_shards` devices gives device `i` chunks `i` and `2P-1-i`.
  Works on any array with that axis (activations, token ids, positions). On
  an array already sharded along `axis` this moves data between devices (an
  all-gather): lay the sequence out once, not around every attention call.
  """
  return _reorder_chunks(x, num_shards, axis, _balanced_chunk_order(num_shards))


def unload_balance(x, num_shards: int, *, axis: int = 1):
  """Inverse of `load_balance`: back to the natural sequence order."""
  order = np.argsort(_balanced_chunk_order(num_shards))
  return _reorder_chunks(x, num_shards, axis, order)


# ---------------------------------------------------------------------------
# The public entry point.


def context_parallel_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    mesh,
    axis_name: str,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    load_balanced: bool = True,
    batch_axis: str | tuple[str, ...] | None = None,
    head_axis: str | tuple[str, ...] | None = None,
    implementation: str | None = None,
    query_segment_ids=None,
    key_value_segment_ids=None,
    sinks=None,
    logits_soft_cap: float | None = None,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
):
  """Attention with the sequence sharded over mesh axis `axis_name` (ring).

  Same result as `fa4_jax.attention(query, key, value, scale=scale,
  is_causal=is_causal)` on the sequence in its natural order, differentiable.

  Args:
    query: `[B, T, N, H]`; key, value: `[B, T, K, H]` (self-attention: the
      same sequence length; GQA `N % K == 0`). The sequence axis is sharded
      over `axis_name`; with `load_balanced=True` it is in the order of
      `load_balance(x, mesh.shape[axis_name])` (output likewise).
    mesh: the `jax.sharding.Mesh` to run on.
    axis_name: the mesh axis the sequence is sharded over.
    scale, is_causal: as in `fa4_jax.attention`.
    load_balanced: the layout of the sequence (see the module docstring).
    batch_axis, head_axis: optional mesh axes that also shard the batch and
      the heads (data / tensor parallelism next to the ring). A head shard
      must hold whole GQA groups.
    implementation: the per-block backend: None (best for the device), "xla",
      "sm90" or "sm100", as in `fa4_jax.attention`.
    query_segment_ids, key_value_segment_ids: int `[B, T]` each, both or
      neither, laid out and sharded like the sequence (packed documents, as in
      `fa4_jax.attention`): the key/value ids travel the ring with their block.
    sinks: optional float `[N]`, one logit per query head, as in
      `fa4_jax.attention` (differentiable; sharded like the heads): added once,
      to the ring's merged result.
    logits_soft_cap: optional positive Python number, as in
      `fa4_jax.attention`: every ring step soft-caps its logits before its mask.
    score_mod, mask_mod, block_mask: as in `fa4_jax.attention`, with the
      indices of the whole call: `q_idx` / `kv_idx` are positions in the
      natural order (not in the load-balanced layout), `batch` / `head` the
      global ones under `batch_axis` / `head_axis`. `block_mask` is made for
      the whole sequence (`create_block_mask(mask_mod, B, N, T, T)`); its
      tiles should divide the chunk length `T / (2P)` (then each ring step
      reads its slice and skips block pairs with no visible tile), else each
      step classifies its tiles from `mask_mod`. Gradients reach the arrays
      a `score_mod` closes over.
    bias, mask, query_seq_lengths, key_value_seq_lengths, local_window_size:
      not supported yet; passing one raises a `ValueError`.

  Returns:
    The attention output, `[B, T, N, H]`, sharded like `query`.

  Differentiable in reverse mode (`jax.grad`: a hand-written ring backward),
  forward mode (`jax.jvp`, `jax.jacfwd`: a ring over the XLA path's tangent)
  and forward-over-reverse (`jax.hessian`, `jax.jvp(jax.grad(f))`), as
  `fa4_jax.attention` is (`fa4_jax/vjp.py`).
  """
  unsupported = dict(bias=bias, mask=mask, query_seq_lengths=query_seq_lengths,
                     key_value_seq_lengths=key_value_seq_lengths,
                     local_window_size=local_window_size)
  for name, given in unsupported.items():
    if given is not None:
      raise ValueError(
          f"context_parallel_attention does not support `{name}` yet; use "
          "fa4_jax.attention (which gathers the sequence) for it")
  if implementation == "cudnn":
    raise ValueError("context_parallel_attention: implementation='cudnn' is not "
                     "supported; use None, 'xla', 'sm90' or 'sm100'")
  _check_mesh(mesh, axis_name, batch_axis, head_axis)
  args = validate(query, key, value, None, None, scale=scale, is_causal=is_causal,
                  query_seq_lengths=None, key_value_seq_lengths=None,
                  local_window_size=None, implementation=implementation,
                  query_segment_ids=query_segment_ids,
                  key_value_segment_ids=key_value_segment_ids, sinks=sinks,
                  logits_soft_cap=logits_soft_cap, score_mod=score_mod, mask_mod=mask_mod,
                  block_mask=block_mask)
  q, k, v = args.query, args.key, args.value
  if args.scores.has_fp8 or v.shape[-1] != q.shape[-1]:
    raise ValueError(
        "context_parallel_attention takes neither float8 inputs nor a value head dim other "
        f"than the query's yet (got {q.dtype.name}, {k.dtype.name} and {v.dtype.name}, head "
        f"dims {q.shape[-1]} and {v.shape[-1]}); use fa4_jax.attention under sharded jit")
  if q.ndim != 4 or len(args.output_shape) != 4:
    raise ValueError("context_parallel_attention needs rank-4 [B, T, N, H] inputs; "
                     f"got query shape {args.output_shape}")
  p = mesh.shape[axis_name]
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  if t != s:
    raise ValueError(
        f"context_parallel_attention is self-attention over one sharded sequence: "
        f"query length {t} must equal key/value length {s}")
  if t % (2 * p):
    raise ValueError(
        f"sequence length {t} must be divisible by 2 * (size of mesh axis "
        f"{axis_name!r}) = {2 * p}: each device holds two chunks of T / (2P)")
  batch_shards = _axes_size(mesh, batch_axis)
  head_shards = _axes_size(mesh, head_axis)
  if b % batch_shards:
    raise ValueError(f"batch {b} must be divisible by the {batch_shards} shards "
                     f"of batch_axis={batch_axis!r}")
  if kh % head_shards:
    raise ValueError(
        f"head_axis={head_axis!r} shards the heads {head_shards} ways, but each "
        f"device must hold whole GQA groups: the {kh} key/value heads must be "
        f"divisible by {head_shards}")

  local = t // p  # positions per device: two chunks
  spec = args.spec  # causal or dense, q_offset 0
  mods, mod_arrays = _ring_mods(args.scores, local // 2, mesh, batch_axis, head_axis)
  block_call = backends.CallInfo(
      q_shape=(b // batch_shards, local, n // head_shards, h),
      k_shape=(b // batch_shards, local, kh // head_shards, h),
      dtype=q.dtype, spec=spec, has_bias=False, has_mask=False,
      kernel_features=args.scores.kernel_features(),
      has_segment_ids=args.query_segment_ids is not None,
      score_mod=None if mods is None else mods.score_mod,
      mask_mod=None if mods is None else mods.mask_mod)
  ring = _Ring(axis_name=axis_name, size=p, causal=is_causal,
               matmul_precision=vjp.current_matmul_precision(),
               load_balanced=load_balanced, score=args.scores.score_function,
               backend=backends.select(implementation, block_call), mods=mods)
  plan = _Sharded(ring=ring, mesh=mesh, batch_axis=batch_axis, head_axis=head_axis)
  out, _ = _ring_core(
      plan, (q, k, v, args.query_segment_ids, args.key_value_segment_ids, mod_arrays),
      args.sinks)
  return out


def _check_positive_int(x, name):
  if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < 1:
    raise ValueError(f"`{name}` must be a positive int; got {x!r}")


def _as_axes(axes) -> tuple:
  if axes is None:
    return ()
  return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _axes_size(mesh, axes) -> int:
  return int(np.prod([mesh.shape[a] for a in _as_axes(axes)], dtype=int))


def _check_mesh(mesh, axis_name, batch_axis, head_axis):
  if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise ValueError(
        "context_parallel_attention: `mesh` must be a jax.sharding.Mesh "
        f"(e.g. jax.make_mesh((4,), ('seq',))); got {type(mesh).__name__}")
  names = tuple(mesh.axis_names)
  if not isinstance(axis_name, str) or axis_name not in names:
    raise ValueError(
        f"context_parallel_attention: axis_name={axis_name!r} is not an axis of "
        f"the mesh; its axes are {names}")
  used = [axis_name]
  for arg, axes in (("batch_axis", batch_axis), ("head_axis", head_axis)):
    for a in _as_axes(axes):
      if a not in names:
        raise ValueError(
            f"context_parallel_attention: {arg}={axes!r} names {a!r}, which is "
            f"not an axis of the mesh; its axes are {names}")
      if a in used:
        raise ValueError(
            f"context_parallel_attention: mesh axis {a!r} is used twice "
            f"(axis_name, batch_axis and head_axis must be different axes)")
      used.append(a)


# ---------------------------------------------------------------------------
# score_mod, mask_mod and block masks on the ring (the module docstring says
# how the mods see global indices).


@dataclasses.dataclass(frozen=True)
class _RingMods:
  """The static part of a ring call's mods (hashable, part of `_Ring`)."""

  chunk: int  # c: positions per chunk
  score_mod: object  # mod_functions.ModFunction of local positions, or None
  mask_mod: object
  # (q_block, kv_block) of the global block mask, sliced per block pair; None:
  # no block mask, or one whose tiles straddle chunks (mask_mod classifies).
  mask_blocks: tuple[int, int] | None
  axis_sizes: tuple  # (mesh axis name, size) pairs
  batch_axes: tuple  # mesh axes sharding the batch / the heads (index offsets)
  head_axes: tuple


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _ModArrays:
  """The arrays of a ring call's mods: what a `shard_map` operand holds."""

  score_captured: tuple = ()  # the user's score_mod's, replicated
  mask_captured: tuple = ()
  classes: object = None  # the global block mask's [Bm, Hm, nq, nk], or None


def _ring_mods(scores_: Scores, chunk: int, mesh, batch_axis, head_axis):
  """(_RingMods, _ModArrays) of the call's mods; (None, None) without any."""
  if not scores_.has_mods:
    return None, None
  bm = scores_.block_mask
  # Why slice the global classes rather than classify each pair's tiles from
  # mask_mod: a slice is a few int8 tiles per step, and it tells before the
  # backend call whether the pair has any visible tile (then it is skipped);
  # classifying evaluates mask_mod on all c x c pairs of every block pair of
  # every step (and of the backward again). A slice must not cut tiles: a
  # tile across two chunks would belong to two block pairs.
  sliced = bm is not None and chunk % bm.q_block == 0 and chunk % bm.kv_block == 0
  local = lambda mod: None if mod is None else _at_global_positions(mod, chunk)
  mods = _RingMods(chunk=chunk, score_mod=local(scores_.score_mod),
                   mask_mod=local(scores_.mask_mod),
                   mask_blocks=(bm.q_block, bm.kv_block) if sliced else None,
                   axis_sizes=tuple(mesh.shape.items()), batch_axes=_as_axes(batch_axis),
                   head_axes=_as_axes(head_axis))
  arrays = _ModArrays(tuple(scores_.score_captured), tuple(scores_.mask_captured),
                      bm.classes if sliced else None)
  return mods, arrays


# The starts `_at_global_positions` adds: (first rows chunk, second rows
# chunk, first keys chunk, second keys chunk), int32 scalars captured last.
_NUM_POSITION_STARTS = 4


def _at_global_positions(mod, chunk: int):
  """`mod` (a traced score_mod or mask_mod) as a function of one block
  pair's local positions: its last captured inputs are the global starts of
  the pair's row chunks and key chunks, and local position `i` is global
  `i + start_0` below `chunk`, `i - chunk + start_1` from it on. Only
  scalar, elementwise ops are added, so a kernel runs it as it runs `mod`.
  A score_mod in the affine form (ALiBi) keeps it: the kernels' analysis
  keeps these ops along their axis, and where `chunk` is a multiple of a
  kernel's tile the select is one scalar per tile
  (`mod_functions._bind_positions`, `_uniform_comparison`)."""
  num_captured = len(mod.captured_avals)
  original = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(mod.jaxpr, ()))

  def global_position(i, first, second):
    return i + lax.select(i < chunk, first, second - chunk)

  def at_local_positions(*inputs):
    own_from = num_captured + _NUM_POSITION_STARTS
    captured = inputs[:num_captured]
    q_first, q_second, kv_first, kv_second = inputs[num_captured:own_from]
    *score_batch_head, q_idx, kv_idx = inputs[own_from:]
    return original(*captured, *score_batch_head, global_position(q_idx, q_first, q_second),
                    global_position(kv_idx, kv_first, kv_second))

  int32 = jax.ShapeDtypeStruct((), jnp.int32)
  own_args = ([jax.ShapeDtypeStruct((), jnp.float32)] if mod.kind == "score_mod" else []
              ) + [int32] * len(mod_functions.MASK_MOD_ARGS)
  captured = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in mod.captured_avals]
  closed = jax.make_jaxpr(at_local_positions)(
      *captured, *[int32] * _NUM_POSITION_STARTS, *own_args)
  assert not closed.consts, closed.consts
  avals = tuple(mod.captured_avals) + (jax.typeof(jnp.int32(0)),) * _NUM_POSITION_STARTS
  return mod_functions.ModFunction(mod.kind, closed.jaxpr, avals,
                                   f"{avals} {closed.jaxpr}")


def _position_starts(chunks, chunk: int):
  """(start of the first chunk, of the second) of a call's rows or keys,
  given their global chunk indices; one chunk: the second would follow it."""
  first = chunks[0] * chunk
  second = chunks[1] * chunk if len(chunks) == 2 else first + chunk
  return first, second


# ---------------------------------------------------------------------------
# The ring, on one device's shard (inside shard_map).


@dataclasses.dataclass(frozen=True)
class _Ring:
  """Everything static about one ring attention call."""

  axis_name: str
  size: int  # P, devices in the ring
  causal: bool
  load_balanced: bool
  # The scale and the built-in modifications (soft-cap), which every backend
  # call applies to its own logits.
  score: ScoreFunction
  backend: object  # vjp.Backend
  # The matmul precision scope of the call, re-entered by the backward
  # (`vjp.CoreConfig.matmul_precision`).
  matmul_precision: str | None = None
  mods: "_RingMods | None" = None  # score_mod / mask_mod / block mask, if any

  def chunks(self, device):
    """Global chunk indices (of 2P) of the two halves device `device` holds."""
    if self.load_balanced:
      return device, 2 * self.size - 1 - device
    return 2 * device, 2 * device + 1

  def shift(self, tree):
    """Sends `tree` to the next device of the ring (i -> i + 1)."""
    perm = [(i, (i + 1) % self.size) for i in range(self.size)]
    return jax.tree.map(lambda x: lax.ppermute(x, self.axis_name, perm), tree)


# ---------------------------------------------------------------------------
# Plans: which backend calls one ring step makes.

_ALL, _FIRST, _SECOND = "all", 0, 1  # rows of the local queries / of the held block


@dataclasses.dataclass(frozen=True)
class _BlockPairCall:
  """One backend call: some of the local query rows against some of the held
  key/value block's rows, with a static mask."""

  rows: object  # _ALL, _FIRST or _SECOND (chunk of the local queries)
  cols: object  # _ALL, _FIRST or _SECOND (chunk of the held key/value block)
  spec: MaskSpec


def _first_step_plan(ring: _Ring, chunk: int) -> tuple[_BlockPairCall, ...]:
  """Step 0: the device's queries against its own key/value block."""
  if not ring.causal:
    return (_BlockPairCall(_ALL, _ALL, MaskSpec()),)
  if not ring.load_balanced:  # chunks 2a, 2a+1: one causal diagonal
    return (_BlockPairCall(_ALL, _ALL, MaskSpec(right=0)),)
  # Chunks a and 2P-1-a: chunk a sees itself causally; chunk 2P-1-a sees all
  # of chunk a and itself causally, which is causal with the diagonal moved
  # one chunk to the right in the [a | 2P-1-a] key layout.
  return (_BlockPairCall(_FIRST, _FIRST, MaskSpec(right=0)),
          _BlockPairCall(_SECOND, _ALL, MaskSpec(right=0, q_offset=chunk)))


def _later_step_plans(ring: _Ring) -> tuple[tuple[_BlockPairCall, ...], tuple[_BlockPairCall, ...]]:
  """Steps >= 1 (block from device d != a): (plan when d < a, plan when d > a)."""
  dense = MaskSpec()
  if not ring.causal:
    return (_BlockPairCall(_ALL, _ALL, dense),), (_BlockPairCall(_ALL, _ALL, dense),)
  if not ring.load_balanced:  # an earlier block is all visible, a later one not at all
    return (_BlockPairCall(_ALL, _ALL, dense),), ()
  # Block chunks d and 2P-1-d. Query chunk a sees chunk d iff d < a and never
  # chunk 2P-1-d; query chunk 2P-1-a sees chunk d always, chunk 2P-1-d iff d > a.
  return (_BlockPairCall(_ALL, _FIRST, dense),), (_BlockPairCall(_SECOND, _ALL, dense),)


def _part(x, which, axis=1):
  """Chunk `which` (_FIRST, _SECOND) of x along `axis`, or all of it."""
  if which == _ALL:
    return x
  c = x.shape[axis] // 2
  return lax.slice_in_dim(x, which * c, (which + 1) * c, axis=axis)


def _add_rows(total, rows, value, axis=1):
  """total with `value` added to chunk `rows` (or all) along `axis`."""
  if rows == _ALL:
    return total + value
  first, second = _part(total, _FIRST, axis), _part(total, _SECOND, axis)
  if rows == _FIRST:
    return jnp.concatenate([first + value, second], axis=axis)
  return jnp.concatenate([first, second + value], axis=axis)


def _merge(acc, part, rows):
  """Merges a normalized partial result (out, lse) of query chunk `rows` into
  the running one (f32 out [B,2c,N,H], lse [B,N,2c]) by log-sum-exp."""
  out_b, lse_b = part
  out_a, lse_a = _part(acc[0], rows), _part(acc[1], rows, axis=2)
  lse = jnp.logaddexp(lse_a, lse_b)
  safe = jnp.where(lse == -jnp.inf, 0.0, lse)  # rows that saw no key yet
  weight = lambda l: jnp.exp(l - safe).transpose(0, 2, 1)[..., None]  # [B,c,N,1]
  out = weight(lse_a) * out_a + weight(lse_b) * out_b.astype(jnp.float32)
  if rows == _ALL:
    return out, lse
  put = lambda whole, new, axis: jnp.concatenate(
      [new, _part(whole, _SECOND, axis)] if rows == _FIRST
      else [_part(whole, _FIRST, axis), new], axis=axis)
  return put(acc[0], out, 1), put(acc[1], lse, 2)


def _run_plan(plan, fn, state):
  for call in plan:
    state = fn(call, state)
  return state


def _by_source(ring: _Ring, step, plans, work, block, state):
  """Runs the plan for a block that came from device me - step (step >= 1)."""
  earlier, later = plans
  me = lax.axis_index(ring.axis_name)
  source = (me - step) % ring.size
  fn = work(block, source)
  if earlier == later:
    return _run_plan(earlier, fn, state)
  return lax.cond(source < me, lambda s: _run_plan(earlier, fn, s),
                  lambda s: _run_plan(later, fn, s), state)


def _ring_steps(ring: _Ring, kv, state, work, after_work=lambda state: state):
  """Runs the ring: at step s the block that started on device
  `source = me - s` is held and `work(block, source)(call, state)` applied
  for each call of the step's plan, while the block travels on to the next
  device (sent before the work, so that the transfer overlaps it; the last
  step sends nothing). Then `after_work(state)` (the backward sends the
  block's gradients on there)."""
  chunk = kv[0].shape[1] // 2
  incoming = ring.shift(kv) if ring.size > 1 else None
  me = lax.axis_index(ring.axis_name)
  state = after_work(_run_plan(_first_step_plan(ring, chunk), work(kv, me), state))
  plans = _later_step_plans(ring)

  def step(carry, step_index):
    held, state = carry
    incoming = ring.shift(held)
    state = _by_source(ring, step_index, plans, work, held, state)
    return (incoming, after_work(state)), None

  if ring.size > 2:
    (incoming, state), _ = lax.scan(step, (incoming, state), jnp.arange(1, ring.size - 1))
  if ring.size > 1:
    state = after_work(_by_source(ring, ring.size - 1, plans, work, incoming, state))
  return state


def _segment_parts(q_ids, block, call: _BlockPairCall):
  """(query ids, key ids) of one call: the rows' ids and those of the held
  block's columns (they travel with it, last in the block), or (None, None)."""
  if q_ids is None:
    return None, None
  return _part(q_ids, call.rows), _part(block[-1], call.cols)


@dataclasses.dataclass(frozen=True)
class _PairScores:
  """The score values of one device's backend calls (`of`): built once per
  ring pass on the device, from what is the same for all its calls."""

  ring: _Ring
  q_ids: object  # the local queries' segment ids, or None
  mod_arrays: _ModArrays | None
  index_offsets: object  # int32 [2] (global batch, head of this shard), or None

  @classmethod
  def on_this_device(cls, ring: _Ring, q, q_ids, mod_arrays):
    mods, offsets = ring.mods, None
    if mods is not None and (mods.batch_axes or mods.head_axes):
      offsets = sharding.index_offsets(dict(mods.axis_sizes), mods.batch_axes, q.shape[0],
                                       mods.head_axes, q.shape[2])
    return cls(ring, q_ids, mod_arrays, offsets)

  def of(self, block, call: _BlockPairCall, source) -> Scores:
    """The score value of one block pair's call: the local queries `call.rows`
    against the block from device `source`, columns `call.cols` (no sinks:
    they join the merged result once)."""
    ring = self.ring
    q_seg, kv_seg = _segment_parts(self.q_ids, block, call)
    pair = ring.score.as_scores(mask=call.spec, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    mods = ring.mods
    if mods is None:
      return pair
    rows = _part_chunks(ring, lax.axis_index(ring.axis_name), call.rows)
    cols = _part_chunks(ring, source, call.cols)
    starts = [jnp.asarray(x, jnp.int32) for x in (*_position_starts(rows, mods.chunk),
                                                  *_position_starts(cols, mods.chunk))]
    arrays = self.mod_arrays
    with_starts = lambda mod, captured: (*captured, *starts) if mod is not None else ()
    pair = pair.replace(score_mod=mods.score_mod, mask_mod=mods.mask_mod,
                        score_captured=with_starts(mods.score_mod, arrays.score_captured),
                        mask_captured=with_starts(mods.mask_mod, arrays.mask_captured),
                        index_offsets=self.index_offsets)
    if mods.mask_blocks is None:
      return pair
    q_block, kv_block = mods.mask_blocks
    classes = _chunk_tiles(arrays.classes, rows, 2, mods.chunk // q_block)
    classes = _chunk_tiles(classes, cols, 3, mods.chunk // kv_block)
    return pair.replace(block_mask=scores.BlockMask(
        classes=classes, mask_captured=pair.mask_captured, q_block=q_block, kv_block=kv_block,
        q_len=len(rows) * mods.chunk, kv_len=len(cols) * mods.chunk, mask_mod=mods.mask_mod))


def _part_chunks(ring: _Ring, device, which) -> tuple:
  """Global chunk indices of part `which` (_ALL, _FIRST, _SECOND) of what
  device `device` holds (its queries, or its key/value block)."""
  first, second = ring.chunks(device)
  return {_ALL: (first, second), _FIRST: (first,), _SECOND: (second,)}[which]


def _chunk_tiles(classes, chunks, axis: int, tiles_per_chunk: int):
  """The tiles of global chunks `chunks` along `axis` of block classes, in
  that order (a dynamic slice each: the chunks depend on the device)."""
  return jnp.concatenate([lax.dynamic_slice_in_dim(classes, c * tiles_per_chunk,
                                                   tiles_per_chunk, axis)
                          for c in chunks], axis=axis)


def _unless_all_empty(pair_scores: Scores, run, state):
  """`run(state)`, or `state` unchanged when the pair's block mask has no
  visible tile: such a pair is skipped as the plans skip the pairs a causal
  mask hides (at run time here, since the classes are data)."""
  if pair_scores.block_mask is None:
    return run(state)
  visible = jnp.any(pair_scores.block_mask.classes != scores.EMPTY)
  return lax.cond(visible, run, lambda s: s, state)


def _forward(ring: _Ring, q, k, v, q_ids=None, kv_ids=None, mod_arrays=None):
  """Ring forward on one device: (out [B,2c,N,H], lse f32 [B,N,2c]), no sinks."""
  b, t, n, h = q.shape
  pair_scores = _PairScores.on_this_device(ring, q, q_ids, mod_arrays)

  def attend(block, source):
    def fn(call, acc):
      scores_ = pair_scores.of(block, call, source)

      def run(acc):
        out, lse = ring.backend.forward(
            _part(q, call.rows), _part(block[0], call.cols), _part(block[1], call.cols),
            None, None, scores_)
        return _merge(acc, (out, lse), call.rows)

      return _unless_all_empty(scores_, run, acc)
    return fn

  empty = (jnp.zeros((b, t, n, h), jnp.float32), jnp.full((b, n, t), -jnp.inf, jnp.float32))
  out, lse = _ring_steps(ring, _block(kv_ids, k, v), empty, attend)
  return out.astype(q.dtype), lse


def _block(kv_ids, *arrays):
  """What travels the ring: K and V (and their tangents, for the tangent
  ring) and, with segment ids, the keys' ids, last."""
  return arrays if kv_ids is None else (*arrays, kv_ids)


def _backward(ring: _Ring, q, k, v, q_ids, kv_ids, mod_arrays, out, lse, dout):
  """Ring backward on one device: (dq, dk, dv) of its own shards, and the
  gradients of the score_mod's captured arrays (a tuple like them, None for
  integer ones; summed over all devices).

  The state is (dq of the local queries, dk and dv of the held block, the
  captured arrays' gradients): the block's gradients travel the ring with
  it, each device adding its part, and are back on the block's owner after
  the last step's send.
  """
  f32_zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  f32 = lambda x: x.astype(jnp.float32)
  captured = () if mod_arrays is None else mod_arrays.score_captured
  is_float = lambda x: jnp.issubdtype(x.dtype, jnp.inexact)
  pair_scores = _PairScores.on_this_device(ring, q, q_ids, mod_arrays)

  def grads(block, source):
    def fn(call, state):
      rows, cols = call.rows, call.cols
      scores_ = pair_scores.of(block, call, source)

      def run(state):
        dq, dk, dv, dcaptured = state
        dq_c, dk_c, dv_c, _, dcaptured_c = ring.backend.backward(
            _part(q, rows), _part(block[0], cols), _part(block[1], cols), None, None,
            scores_, _part(out, rows), _part(lse, rows, axis=2), _part(dout, rows))
        # The pair's score_mod captures the user's arrays, then the position
        # starts (integers: no gradient); zip stops at the user's.
        dcaptured = tuple(None if total is None else total + f32(part)
                          for total, part in zip(dcaptured, dcaptured_c or ()))
        return (_add_rows(dq, rows, f32(dq_c)), _add_rows(dk, cols, f32(dk_c)),
                _add_rows(dv, cols, f32(dv_c)), dcaptured)

      return _unless_all_empty(scores_, run, state)
    return fn

  def send_block_grads(state):
    dq, dk, dv, dcaptured = state
    return (dq, *ring.shift((dk, dv)), dcaptured)

  zeros = (f32_zeros(q), f32_zeros(k), f32_zeros(v),
           tuple(f32_zeros(c) if is_float(c) else None for c in captured))
  dq, dk, dv, dcaptured = _ring_steps(ring, _block(kv_ids, k, v), zeros, grads,
                                      send_block_grads)
  if ring.mods is not None:  # every device saw its own queries, blocks, rows and heads
    axes = (ring.axis_name, *ring.mods.batch_axes, *ring.mods.head_axes)
    dcaptured = tuple(None if g is None else lax.psum(g, axes).astype(c.dtype)
                      for g, c in zip(dcaptured, captured))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dcaptured


def _tangent_sums(ring: _Ring, q, k, v, q_ids, kv_ids, mod_arrays, lse, dq, dk, dv,
                  dcaptured=()):
  """Ring tangent on one device: the key sums of the XLA path's tangent
  (`xla_attention.tangent_sums`) over every block, f32 ([B,2c,N,H],
  [B,N,2c]). P = exp(s - lse) is exact per block with the final lse, so the
  blocks' sums add up; the key/value tangents travel with their block.
  `dcaptured`: the tangents of the score_mod's captured arrays (None: zero)."""
  b, t, n, h = q.shape
  pair_scores = _PairScores.on_this_device(ring, q, q_ids, mod_arrays)
  # The position starts the pair's score_mod captures last have no tangent.
  pair_dcaptured = (*dcaptured, *[None] * _NUM_POSITION_STARTS) if dcaptured else None

  def sums(block, source):
    def fn(call, acc):
      rows, cols = call.rows, call.cols
      scores_ = pair_scores.of(block, call, source)

      def run(acc):
        d_out, d_lse = xla_attention.tangent_sums(
            _part(q, rows), _part(block[0], cols), _part(block[1], cols), None, None,
            scores_, _part(lse, rows, axis=2), _part(dq, rows), _part(block[2], cols),
            _part(block[3], cols), None, pair_dcaptured)
        return _add_rows(acc[0], rows, d_out), _add_rows(acc[1], rows, d_lse, axis=2)

      return _unless_all_empty(scores_, run, acc)
    return fn

  zeros = (jnp.zeros((b, t, n, h), jnp.float32), jnp.zeros((b, n, t), jnp.float32))
  return _ring_steps(ring, _block(kv_ids, k, v, dk, dv), zeros, sums)


# ---------------------------------------------------------------------------
# Differentiation: the rule of `fa4_jax/vjp.py`, around the ring.
#
# `_ring_core` is a `jax.custom_jvp` of the whole sharded call: (out, lse)
# from the ring forward, and their tangent as one `vjp.linear_map` ("ring"),
# evaluated by the tangent ring (forward mode) and transposed to the ring
# backward (reverse mode: one forward, one backward, as a custom_vjp would).
# The ring backward is itself a custom_jvp ("ring_backward": the derivative
# of the ring backward on the XLA path; kernels have none) for
# forward-over-reverse. Sinks enter once, outside the ring: added to the
# merged (out, lse) like any backend's post-pass (`scores.add_sinks`), their
# gradient a reduction (`scores.sink_grad`).


@dataclasses.dataclass(frozen=True)
class _Sharded:
  """The ring and where it runs: what the differentiation rules hold."""

  ring: _Ring
  mesh: object
  batch_axis: object = None
  head_axis: object = None

  @property
  def sequence_spec(self):  # q, k, v, out and their tangents, [B, T, N, H]
    return PartitionSpec(self.batch_axis, self.ring.axis_name, self.head_axis, None)

  @property
  def ids_spec(self):  # segment ids, [B, T]
    return PartitionSpec(self.batch_axis, self.ring.axis_name)

  @property
  def stats_spec(self):  # lse, [B, N, T]
    return PartitionSpec(self.batch_axis, self.head_axis, self.ring.axis_name)

  def mods_spec(self, mod_arrays):
    """Specs of a `_ModArrays`: captured arrays replicated; the block mask's
    classes sharded like the batch and heads where they do not broadcast."""
    if mod_arrays is None:
      return None
    spec = jax.tree.map(lambda _: PartitionSpec(), mod_arrays)
    if mod_arrays.classes is None:
      return spec
    bm, hm = mod_arrays.classes.shape[:2]
    return dataclasses.replace(spec, classes=PartitionSpec(
        self.batch_axis if bm > 1 else None, self.head_axis if hm > 1 else None))

  def run(self, fn, operands, specs, out_specs):
    """`fn(*operands)` on every device's shards (shard_map). `operands` are
    pytrees (None: absent, e.g. no segment ids) and `specs` give each of
    their leaves a spec (a spec for a subtree holds for all its leaves)."""
    leaves, tree = jax.tree.flatten(tuple(operands))
    # Each spec once per leaf of its operand subtree, in the leaves' order.
    per_subtree = jax.tree.map(lambda spec, subtree: [spec] * len(jax.tree.leaves(subtree)),
                               tuple(specs), tuple(operands))
    leaf_specs = jax.tree.leaves(per_subtree)
    # Under Explicit mesh axes shard_map takes only inputs already laid out
    # as its specs say; a caller's replicated or unsharded arrays, and the
    # tangents JAX makes, are moved there first (a no-op for arrays that
    # already are).
    leaves = [self.laid_out(x, spec) for x, spec in zip(leaves, leaf_specs)]
    local = lambda *leaves: fn(*jax.tree.unflatten(tree, leaves))
    return jax.shard_map(local, mesh=self.mesh, in_specs=tuple(leaf_specs),
                         out_specs=out_specs, check_vma=False)(*leaves)

  def operand_specs(self, operands, extra_sequence=0, extra_stats=0):
    """Specs of `operands` (q, k, v, q_ids, kv_ids, mod_arrays) followed by
    stats and sequence arrays."""
    seq, ids = self.sequence_spec, self.ids_spec
    return ([seq, seq, seq, ids, ids, self.mods_spec(operands[5])]
            + [self.stats_spec] * extra_stats + [seq] * extra_sequence)

  def laid_out(self, x, spec):
    """`x` with the sharding `spec` where the mesh's axes are Explicit
    (shard_map takes nothing else there): every operand of `run`, the
    caller's arrays and the tangents JAX makes (`jax.jacfwd`'s basis is
    replicated) alike."""
    if x is None or AxisType.Explicit not in tuple(getattr(self.mesh, "axis_types", ())):
      return x
    return jax.sharding.reshard(x, NamedSharding(self.mesh, spec))

  def with_backend(self, backend):
    return dataclasses.replace(self, ring=dataclasses.replace(self.ring, backend=backend))


def _sharded_forward(plan: _Sharded, operands, sinks):
  """(out [B,T,N,H], lse f32 [B,N,T]) of the ring, sinks included."""
  out, lse = plan.run(functools.partial(_forward, plan.ring), operands,
                      plan.operand_specs(operands), (plan.sequence_spec, plan.stats_spec))
  if sinks is not None:
    out, lse = scores.add_sinks(out, lse, sinks)
  return out, lse


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _ring_core(plan: _Sharded, operands, sinks):
  """(out, lse) of ring attention; operands = (q, k, v, q_ids, kv_ids,
  mod_arrays), the last three None where absent."""
  shielded = functools.partial(_ring_core_shielded, plan)
  return vjp.keeping_rule(shielded)(operands, sinks)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _ring_core_shielded(plan: _Sharded, operands, sinks):
  """`_ring_core` again, with the same rule, inside `vjp.keeping_rule`."""
  return _sharded_forward(plan, operands, sinks)


@_ring_core.defjvp
@_ring_core_shielded.defjvp
def _ring_core_jvp(plan, primals, tangents):
  operands, sinks = primals
  out, lse = _ring_core(plan, operands, sinks)
  dq, dk, dv = tangents[0][:3]  # segment ids are not differentiable
  dsinks = tangents[1] if sinks is not None else None
  # Of the mods' arrays only the score_mod's float captured ones are.
  mod_arrays, mod_tangents = operands[5], tangents[0][5]
  dcaptured = (() if mod_arrays is None else
               vjp.inexact_tangents(mod_arrays.score_captured, mod_tangents.score_captured))
  tangent = vjp.linear_map("ring", plan, (operands, sinks, out, lse),
                           (dq, dk, dv, dsinks, dcaptured))
  return (out, lse), tangent


def _ring_tangent(plan: _Sharded, residuals, linear, partitioned=True):
  """(dout, dlse) along (dq, dk, dv, dsinks, dcaptured): the tangent ring's
  key sums, finished as the XLA path finishes them (sinks, normalization)."""
  del partitioned  # the ring is always partitioned, and plain jnp
  operands, sinks, out, lse = residuals
  dq, dk, dv = linear[:3]
  dsinks, dcaptured = linear[3], linear[4]
  with vjp.precision_scope(plan.ring.matmul_precision):
    sums = plan.run(functools.partial(_tangent_sums, plan.ring),
                    (*operands, lse, dq, dk, dv, dcaptured),
                    plan.operand_specs(operands, extra_stats=1, extra_sequence=3)
                    + [PartitionSpec()],
                    (plan.sequence_spec, plan.stats_spec))
    return xla_attention.finish_tangent(*sums, out, lse, sinks, dsinks)


def _ring_transpose(plan: _Sharded, residuals, cotangents):
  """(dq, dk, dv, dsinks, dcaptured) from the cotangent of the output: the
  ring backward, the sinks' gradient and the score_mod's captured arrays'."""
  operands, sinks, out, lse = residuals
  dout, dlse = cotangents  # None: zero
  if dlse is not None:
    # The lse never leaves context_parallel_attention, so no caller gives it
    # a cotangent; the kernels' backward could not take one.
    raise ValueError("context_parallel_attention: the ring's log-sum-exp has no "
                     "reverse-mode rule")
  if dout is None:
    dout = jnp.zeros_like(out)
  with vjp.precision_scope(plan.ring.matmul_precision):
    dq, dk, dv, dcaptured = _ring_backward(plan, operands, out, lse, dout)
  dsinks = None
  if sinks is not None:
    delta = jnp.einsum("btnd,btnd->bnt", dout.astype(jnp.float32), out.astype(jnp.float32))
    dsinks = scores.sink_grad(sinks, lse, delta)
  return dq, dk, dv, dsinks, dcaptured


def _sharded_backward(plan: _Sharded, operands, out, lse, dout):
  """(dq, dk, dv, dcaptured) of the ring backward, on every device
  (dcaptured replicated: summed over the devices)."""
  return plan.run(functools.partial(_backward, plan.ring), (*operands, out, lse, dout),
                  plan.operand_specs(operands, extra_sequence=1)
                  + [plan.stats_spec, plan.sequence_spec],
                  (plan.sequence_spec,) * 3 + (PartitionSpec(),))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _ring_backward(plan: _Sharded, operands, out, lse, dout):
  """The ring backward with the backend's kernels; its derivative (for
  `jax.hessian`) is that of the ring backward on the XLA path."""
  return _sharded_backward(plan, operands, out, lse, dout)


@_ring_backward.defjvp
def _ring_backward_jvp(plan, primals, tangents):
  tangent = vjp.linear_map("ring_backward", plan, primals,
                           vjp.inexact_tangents(primals, tangents))
  return _ring_backward(plan, *primals), tangent


def _ring_backward_tangent(plan: _Sharded, residuals, linear, partitioned=True):
  """Tangent of the ring backward on the XLA path at `residuals`."""
  del partitioned
  linear = jax.tree.map(
      lambda x, t: np.zeros(x.shape, jax.dtypes.float0) if t is None else t, residuals, linear)
  xla_plan = plan.with_backend(backends.XLA)
  with vjp.precision_scope(plan.ring.matmul_precision):
    return jax.jvp(functools.partial(_sharded_backward, xla_plan), residuals, linear)[1]


vjp.register_linear_map("ring", _ring_tangent, _ring_transpose)
vjp.register_linear_map("ring_backward", _ring_backward_tangent, vjp.refuse_reverse_over_reverse)
