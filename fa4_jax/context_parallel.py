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

The backward is written by hand (a `jax.custom_vjp`): blocks travel the ring
again, each device adds its contribution to the key/value gradients of the
block it holds, and those gradients travel with the block, arriving back at
the block's owner after the last step. Per block, the backend's backward
recomputes probabilities from the final (merged) log-sum-exp and output, which
makes each block's gradient exact.

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

Each (query chunk, key chunk) pair is one backend call with a static mask: a
key chunk before the query chunk is fully visible (dense), the same chunk is
the causal diagonal, a later chunk is skipped (no work). The backend is the
one `fa4_jax.attention` would pick (`implementation=`), the XLA path on CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from fa4_jax import backends
from fa4_jax.masks import MaskSpec
from fa4_jax.validation import validate

# What a (query chunk, key chunk) pair needs, as a lax.switch index.
_FULL, _DIAGONAL, _SKIP = 0, 1, 2


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
    bias, mask, query_seq_lengths, key_value_seq_lengths, local_window_size:
      not supported yet; passing one raises a `ValueError`.

  Returns:
    The attention output, `[B, T, N, H]`, sharded like `query`.
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
                  local_window_size=None, implementation=implementation)
  q, k, v = args.query, args.key, args.value
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

  chunk = t // (2 * p)
  spec = args.spec  # causal or dense, q_offset 0
  block_call = backends.CallInfo(
      q_shape=(b // batch_shards, chunk, n // head_shards, h),
      k_shape=(b // batch_shards, chunk, kh // head_shards, h),
      dtype=q.dtype, spec=spec, has_bias=False, has_mask=False)
  ring = _Ring(axis_name=axis_name, size=p, causal=is_causal,
               load_balanced=load_balanced, scale=args.scale,
               backend=backends.select(implementation, block_call))
  pspec = PartitionSpec(batch_axis, axis_name, head_axis, None)
  run = jax.shard_map(functools.partial(_ring_attention, ring), mesh=mesh,
                      in_specs=(pspec, pspec, pspec), out_specs=pspec,
                      check_vma=False)
  return run(q, k, v)


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
# The ring, on one device's shard (inside shard_map).


@dataclasses.dataclass(frozen=True)
class _Ring:
  """Everything static about one ring attention call."""

  axis_name: str
  size: int  # P, devices in the ring
  causal: bool
  load_balanced: bool
  scale: float
  backend: object  # vjp.Backend

  def chunks(self, device):
    """Global chunk indices (of 2P) of the two halves device `device` holds."""
    if self.load_balanced:
      return device, 2 * self.size - 1 - device
    return 2 * device, 2 * device + 1

  def kind(self, q_chunk, k_chunk):
    """_FULL, _DIAGONAL or _SKIP for a (query chunk, key chunk) pair."""
    if not self.causal:
      return _FULL
    return jnp.where(k_chunk < q_chunk, _FULL,
                     jnp.where(k_chunk == q_chunk, _DIAGONAL, _SKIP))

  def shift(self, tree):
    """Sends `tree` to the next device of the ring (i -> i + 1)."""
    perm = [(i, (i + 1) % self.size) for i in range(self.size)]
    return jax.tree.map(lambda x: lax.ppermute(x, self.axis_name, perm), tree)


_SPECS = (MaskSpec(), MaskSpec(right=0))  # by kind: _FULL (dense), _DIAGONAL (causal)


def _halves(x, axis=1):
  c = x.shape[axis] // 2
  return (lax.slice_in_dim(x, 0, c, axis=axis), lax.slice_in_dim(x, c, 2 * c, axis=axis))


def _pair_forward(ring: _Ring, kind, q, k, v):
  """(out, lse) of one query chunk against one key chunk."""

  def attend(spec):
    return lambda q, k, v: ring.backend.forward(
        q, k, v, None, None, None, None, scale=ring.scale, spec=spec)

  def skip(q, k, v):
    del k, v
    b, c, n, _ = q.shape
    return jnp.zeros_like(q), jnp.full((b, n, c), -jnp.inf, jnp.float32)

  if not ring.causal:
    return attend(_SPECS[_FULL])(q, k, v)
  return lax.switch(kind, [attend(_SPECS[_FULL]), attend(_SPECS[_DIAGONAL]), skip],
                    q, k, v)


def _merge(acc, part):
  """Merges two normalized partial results by their log-sum-exp."""
  out_a, lse_a = acc
  out_b, lse_b = part
  lse = jnp.logaddexp(lse_a, lse_b)
  safe = jnp.where(lse == -jnp.inf, 0.0, lse)  # rows that saw no key yet
  weight = lambda l: jnp.exp(l - safe).transpose(0, 2, 1)[..., None]  # [B,c,N,1]
  out = weight(lse_a) * out_a + weight(lse_b) * out_b.astype(jnp.float32)
  return out, lse


def _forward(ring: _Ring, q, k, v):
  """Ring forward on one device: (out [B,2c,N,H], lse f32 [B,N,2c])."""
  me = lax.axis_index(ring.axis_name)
  q_halves, q_chunks = _halves(q), ring.chunks(me)
  b, c, n, h = q_halves[0].shape
  empty = (jnp.zeros((b, c, n, h), jnp.float32),
           jnp.full((b, n, c), -jnp.inf, jnp.float32))

  def attend_block(step, kv, acc):
    """Queries against the K/V block that started on device me - step."""
    k_chunks = ring.chunks((me - step) % ring.size)
    k_halves, v_halves = _halves(kv[0]), _halves(kv[1])
    acc = list(acc)
    for i in range(2):
      for j in range(2):
        part = _pair_forward(ring, ring.kind(q_chunks[i], k_chunks[j]),
                             q_halves[i], k_halves[j], v_halves[j])
        acc[i] = _merge(acc[i], part)
    return tuple(acc)

  def step(carry, step_index):
    kv, acc = carry
    next_kv = ring.shift(kv)  # in flight while this block is computed
    return (next_kv, attend_block(step_index, kv, acc)), None

  (kv, acc), _ = lax.scan(step, ((k, v), (empty, empty)), jnp.arange(ring.size - 1))
  acc = attend_block(ring.size - 1, kv, acc)  # the last block: nothing to send
  out = jnp.concatenate([acc[0][0], acc[1][0]], axis=1).astype(q.dtype)
  lse = jnp.concatenate([acc[0][1], acc[1][1]], axis=2)
  return out, lse


def _pair_backward(ring: _Ring, kind, q, k, v, out, lse, dout):
  """(dq, dk, dv) of one query chunk against one key chunk, in float32."""

  def grads(spec):
    def run(q, k, v, out, lse, dout):
      dq, dk, dv, _ = ring.backend.backward(
          q, k, v, None, None, None, None, out, lse, dout, scale=ring.scale, spec=spec)
      return tuple(x.astype(jnp.float32) for x in (dq, dk, dv))
    return run

  def skip(q, k, v, out, lse, dout):
    del out, lse, dout
    return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))

  operands = (q, k, v, out, lse, dout)
  if not ring.causal:
    return grads(_SPECS[_FULL])(*operands)
  return lax.switch(kind, [grads(_SPECS[_FULL]), grads(_SPECS[_DIAGONAL]), skip],
                    *operands)


def _backward(ring: _Ring, q, k, v, out, lse, dout):
  """Ring backward on one device: (dq, dk, dv) of its own shards."""
  me = lax.axis_index(ring.axis_name)
  q_chunks = ring.chunks(me)
  q_h, out_h, dout_h, lse_h = _halves(q), _halves(out), _halves(dout), _halves(lse, 2)
  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)

  def grads_for_block(step, kv, dq):
    """dq (accumulated) and this device's dk, dv contributions to the block
    that started on device me - step."""
    k_chunks = ring.chunks((me - step) % ring.size)
    k_h, v_h = _halves(kv[0]), _halves(kv[1])
    dq, dk, dv = list(dq), [zeros(k_h[0])] * 2, [zeros(v_h[0])] * 2
    for i in range(2):
      for j in range(2):
        dq_ij, dk_ij, dv_ij = _pair_backward(
            ring, ring.kind(q_chunks[i], k_chunks[j]), q_h[i], k_h[j], v_h[j],
            out_h[i], lse_h[i], dout_h[i])
        dq[i], dk[j], dv[j] = dq[i] + dq_ij, dk[j] + dk_ij, dv[j] + dv_ij
    return tuple(dq), jnp.concatenate(dk, axis=1), jnp.concatenate(dv, axis=1)

  def step(carry, step_index):
    kv, dkv, dq = carry
    next_kv = ring.shift(kv)  # in flight while this block is computed
    dq, dk, dv = grads_for_block(step_index, kv, dq)
    # The block's gradients travel with it around the ring.
    next_dkv = ring.shift((dkv[0] + dk, dkv[1] + dv))
    return (next_kv, next_dkv, dq), None

  dq0 = (zeros(q_h[0]), zeros(q_h[1]))
  dkv0 = (zeros(k), zeros(v))
  (kv, dkv, dq), _ = lax.scan(step, ((k, v), dkv0, dq0), jnp.arange(ring.size - 1))
  dq, dk, dv = grads_for_block(ring.size - 1, kv, dq)
  # After this last shift every block's gradients are back on their owner.
  dk, dv = ring.shift((dkv[0] + dk, dkv[1] + dv))
  dq = jnp.concatenate(dq, axis=1)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring: _Ring, q, k, v):
  return _forward(ring, q, k, v)[0]


def _ring_attention_fwd(ring, q, k, v):
  out, lse = _forward(ring, q, k, v)
  return out, (q, k, v, out, lse)


def _ring_attention_bwd(ring, residuals, dout):
  return _backward(ring, *residuals, dout)


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)
