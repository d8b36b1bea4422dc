"""Independent references for the tests: jax.nn and a plain f32 einsum."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax.scores import MaskSpec


def relative_error(got, want) -> float:
  """|got - want| / |want| over all elements (Frobenius norms, in float64):
  the gradient checks' measure, since bf16 leaves a few elements far off
  while the whole stays close. `want` of norm below 1e-6 counts as 1e-6."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-6))


def visible_mask(t, s, *, is_causal=False, window=None, q_lengths=None,
                 kv_lengths=None, batch=1, q_offset=0, q_segment_ids=None,
                 kv_segment_ids=None):
  """[B, 1, T, S] bool: which key each query row may see, built the naive way.

  `q_offset`: absolute position of query row 0 (causal and window bands move
  with it; lengths count rows as they are). Segment ids ([B, T] and [B, S]):
  a row sees only keys with its own id."""
  i = np.arange(t)[:, None] + q_offset
  j = np.arange(s)[None, :]
  ok = np.ones((t, s), bool)
  if is_causal:
    ok &= j <= i
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    ok &= (j >= i - left) & (j <= i + right)
  ok = np.broadcast_to(ok, (batch, 1, t, s)).copy()
  if q_lengths is not None:
    ok &= (np.arange(t)[None, None, :, None] < np.asarray(q_lengths)[:, None, None, None])
  if kv_lengths is not None:
    ok &= (np.arange(s)[None, None, None, :] < np.asarray(kv_lengths)[:, None, None, None])
  if q_segment_ids is not None:
    q_ids, kv_ids = np.asarray(q_segment_ids), np.asarray(kv_segment_ids)
    ok &= q_ids[:, None, :, None] == kv_ids[:, None, None, :]
  return ok


def packed_segment_ids(document_lengths, total: int, first_id: int = 0) -> np.ndarray:
  """int32 [total]: documents of the given lengths one after the other
  (ids first_id, first_id + 1, ...); positions past them get the last id + 1
  (padding, as a packing pipeline would mark it)."""
  ids = np.full((total,), first_id + len(document_lengths), np.int32)
  start = 0
  for i, n in enumerate(document_lengths):
    ids[start:start + n] = first_id + i
    start += n
  assert start <= total, (document_lengths, total)
  return ids


def random_packing(rng: np.random.Generator, total: int, max_documents: int) -> np.ndarray:
  """int32 [total]: 1 .. max_documents documents of random lengths filling
  `total` positions, as a packed pretraining row."""
  count = int(rng.integers(1, max_documents + 1))
  cuts = np.sort(rng.choice(np.arange(1, total), size=min(count - 1, total - 1), replace=False))
  lengths = np.diff(np.concatenate([[0], cuts, [total]]))
  return packed_segment_ids(list(lengths), total)


def einsum_attention(q, k, v, visible, bias=None, scale=None, *, sinks=None, soft_cap=None):
  """f32 attention by einsum; rows that see nothing give 0 (our convention).

  `soft_cap`: logits -> cap * tanh(logits / cap) after scale and bias, before
  the mask. `sinks` [N]: one more column per row with the head's sink as its
  (uncapped) logit and a zero value; the lse includes it, so a row that sees
  no key gets lse = sink.
  """
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  n, kh = q.shape[2], k.shape[2]
  k = jnp.repeat(k, n // kh, axis=2)
  v = jnp.repeat(v, n // kh, axis=2)
  scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
  logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest") * scale
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  visible = jnp.broadcast_to(jnp.asarray(visible), logits.shape)
  if sinks is not None:
    column = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32)[None, :, None, None],
                              logits.shape[:3] + (1,))
    logits = jnp.concatenate([logits, column], axis=-1)
    visible = jnp.concatenate([visible, jnp.ones(column.shape, bool)], axis=-1)
  logits = jnp.where(visible, logits, -jnp.inf)
  sees_any = visible.any(-1, keepdims=True)
  probs = jax.nn.softmax(jnp.where(sees_any, logits, 0.0), axis=-1)
  probs = jnp.where(visible, probs, 0.0)
  lse = jnp.where(sees_any[..., 0], jax.nn.logsumexp(jnp.where(sees_any, logits, 0.0), -1), -jnp.inf)
  if sinks is not None:
    probs = probs[..., :-1]
  out = jnp.einsum("bnts,bsnh->btnh", probs, v, precision="highest")
  return out, lse  # lse: [B, N, T]


def rows_seeing_keys(visible, n_heads):
  """[B, T, N, 1] float: 1 where a query row sees at least one key."""
  rows = np.asarray(visible).any(-1)  # [B, 1|N, T]
  rows = np.broadcast_to(rows, (rows.shape[0], n_heads, rows.shape[2]))
  return jnp.asarray(rows.transpose(0, 2, 1)[..., None], jnp.float32)


@dataclasses.dataclass(frozen=True)
class KernelCase:
  """One kernel call: shapes, dtype and mask arguments in jax.nn terms.

  Kernel test files subclass it to pick their own default sequence lengths."""

  batch: int = 1
  q_seq: int = 128
  kv_seq: int = 128
  q_heads: int = 1
  kv_heads: int = 1
  head_dim: int = 64
  dtype: str = "bfloat16"
  is_causal: bool = False
  window: tuple[int, int] | None = None  # jax.nn's local_window_size
  q_offset: int = 0  # not expressible in jax.nn: references get a bool mask
  q_lengths: tuple[int, ...] | None = None
  kv_lengths: tuple[int, ...] | None = None
  # Per batch row, a tuple of ids (see `packed_segment_ids`); both or neither.
  q_segment_ids: tuple[tuple[int, ...], ...] | None = None
  kv_segment_ids: tuple[tuple[int, ...], ...] | None = None

  @property
  def mask(self) -> MaskSpec:
    return MaskSpec.from_arguments(self.is_causal, self.window, self.q_offset)

  def lengths(self):
    """(q_lengths, kv_lengths) as int32 arrays, or None."""
    as_array = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
    return as_array(self.q_lengths), as_array(self.kv_lengths)

  def segment_ids(self):
    """(q_ids int32 [B, Tq], kv_ids int32 [B, Tk]), or None."""
    if self.q_segment_ids is None:
      return None
    return (jnp.asarray(self.q_segment_ids, jnp.int32),
            jnp.asarray(self.kv_segment_ids, jnp.int32))

  def backward_inputs(self, seed: int = 0):
    """(q, k, v, dout) in the case's dtype, normal; v with mean 1, so that
    "averaged the wrong keys" is visible."""
    keys = jax.random.split(jax.random.key(seed), 4)
    dtype = jnp.dtype(self.dtype)
    q_shape = (self.batch, self.q_seq, self.q_heads, self.head_dim)
    kv_shape = (self.batch, self.kv_seq, self.kv_heads, self.head_dim)
    q = jax.random.normal(keys[0], q_shape, dtype)
    k = jax.random.normal(keys[1], kv_shape, dtype)
    v = 1.0 + jax.random.normal(keys[2], kv_shape, dtype)
    dout = jax.random.normal(keys[3], q_shape, dtype)
    return q, k, v, dout

  def visible(self) -> np.ndarray:
    """[B, 1, Tq, Tk]: which key each row sees, from the definitions."""
    return visible_mask(self.q_seq, self.kv_seq, is_causal=self.is_causal,
                        window=self.window, q_lengths=self.q_lengths,
                        kv_lengths=self.kv_lengths, batch=self.batch,
                        q_offset=self.q_offset, q_segment_ids=self.q_segment_ids,
                        kv_segment_ids=self.kv_segment_ids)


def jax_nn_with_sinks(q, k, v, sinks, visible, scale):
  """jax.nn on k, v extended by a zero key whose logit is pinned to the sink."""
  f32 = lambda x: x.astype(jnp.float32)
  b, t, n, _ = q.shape
  zero = jnp.zeros(k.shape[:1] + (1,) + k.shape[2:], jnp.float32)
  k_ext = jnp.concatenate([f32(k), zero], axis=1)
  v_ext = jnp.concatenate([f32(v), zero], axis=1)
  s = k.shape[1]
  bias = jnp.zeros((1, n, t, s + 1), jnp.float32).at[..., s].set(f32(sinks)[:, None])
  mask = np.concatenate([np.broadcast_to(visible, (b, 1, t, s)), np.ones((b, 1, t, 1), bool)],
                        axis=-1)
  return jax.nn.dot_product_attention(f32(q), k_ext, v_ext, bias=bias, mask=jnp.asarray(mask),
                                      scale=scale, implementation="xla")
