"""Independent references for the tests: jax.nn and a plain f32 einsum."""

import jax
import jax.numpy as jnp
import numpy as np


def visible_mask(t, s, *, is_causal=False, window=None, q_lengths=None,
                 kv_lengths=None, batch=1):
  """[B, 1, T, S] bool: which key each query row may see, built the naive way."""
  i = np.arange(t)[:, None]
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
  return ok


def einsum_attention(q, k, v, visible, bias=None, scale=None):
  """f32 attention by einsum; rows that see nothing give 0 (our convention)."""
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  n, kh = q.shape[2], k.shape[2]
  k = jnp.repeat(k, n // kh, axis=2)
  v = jnp.repeat(v, n // kh, axis=2)
  scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
  logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest") * scale
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  logits = jnp.where(visible, logits, -jnp.inf)
  sees_any = visible.any(-1, keepdims=True)
  probs = jax.nn.softmax(jnp.where(sees_any, logits, 0.0), axis=-1)
  probs = jnp.where(visible, probs, 0.0)
  lse = jnp.where(sees_any[..., 0], jax.nn.logsumexp(jnp.where(sees_any, logits, 0.0), -1), -jnp.inf)
  out = jnp.einsum("bnts,bsnh->btnh", probs, v, precision="highest")
  return out, lse  # lse: [B, N, T]


def rows_seeing_keys(visible, n_heads):
  """[B, T, N, 1] float: 1 where a query row sees at least one key."""
  rows = np.asarray(visible).any(-1)  # [B, 1|N, T]
  rows = np.broadcast_to(rows, (rows.shape[0], n_heads, rows.shape[2]))
  return jnp.asarray(rows.transpose(0, 2, 1)[..., None], jnp.float32)
