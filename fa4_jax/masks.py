"""Which keys a query may see: the static part of every attention mask.

Every backend (the XLA path and each kernel) derives its masking from one
`MaskSpec`, so "causal", "window" and "length" mean the same thing everywhere.

Positions: query row `i` sits at absolute position `i + q_offset`; key column `j`
at position `j`. Query `i` may see key `j` when

    (left  is None or j >= i + q_offset - left) and
    (right is None or j <= i + q_offset + right)

`jax.nn.dot_product_attention` aligns the causal mask top-left (`q_offset = 0`:
row 0 sees key 0), also when the query and key lengths differ; that is what
`fa4_jax.attention` does by default. A causal mask is `right = 0`; a causal
mask with `local_window_size=(l, r)` is `left = l, right = min(r, 0)`.

Sequence lengths (`query_seq_lengths`, `key_value_seq_lengths`) are run-time
arrays, not part of the spec: keys at or past the length are masked and query
rows at or past the length produce zeros, as in `jax.nn`.

The tile helpers below work on Python ints and on traced int32 scalars alike,
so kernels can call them inside their bodies and the XLA path at trace time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

Int = Any  # a Python int or a traced int32 scalar


def _is_static(*xs) -> bool:
  return all(isinstance(x, int) for x in xs)


def _max(a: Int, b: Int) -> Int:
  return max(a, b) if _is_static(a, b) else jnp.maximum(a, b)


def _min(a: Int, b: Int) -> Int:
  return min(a, b) if _is_static(a, b) else jnp.minimum(a, b)


def cdiv(a: Int, b: int) -> Int:
  """Ceiling division for non-negative `a`."""
  return (a + b - 1) // b


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static (shape-independent) mask: a band around the diagonal.

  `left` / `right`: how many positions before / after its own a query may
  see; `None` means unbounded on that side. `q_offset`: absolute position of
  query row 0 (0 aligns top-left, as `jax.nn` does).
  """

  left: int | None = None
  right: int | None = None
  q_offset: int = 0

  @classmethod
  def from_arguments(
      cls,
      is_causal: bool,
      local_window_size: tuple[int, int] | None,
      q_offset: int = 0,
  ) -> "MaskSpec":
    left = right = None
    if local_window_size is not None:
      left, right = local_window_size
    if is_causal:
      right = 0 if right is None else min(right, 0)
    return cls(left=left, right=right, q_offset=q_offset)

  @property
  def is_dense(self) -> bool:
    """True when every query sees every key (before lengths apply)."""
    return self.left is None and self.right is None

  @property
  def is_causal(self) -> bool:
    return self.left is None and self.right == 0

  def visible(self, q_idx, k_idx):
    """Elementwise: may query row `q_idx` see key column `k_idx`?

    Broadcasts like `q_idx[:, None]` against `k_idx[None, :]` would; works on
    jnp arrays inside and outside kernels.
    """
    ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(k_idx)), bool)
    pos = q_idx + self.q_offset
    if self.left is not None:
      ok = ok & (k_idx >= pos - self.left)
    if self.right is not None:
      ok = ok & (k_idx <= pos + self.right)
    return ok

  # --- Tile-level questions (half-open ranges [lo, hi)). ---

  def key_range(self, q_lo: Int, q_hi: Int, num_keys: Int) -> tuple[Int, Int]:
    """Keys [k_lo, k_hi) that some query in rows [q_lo, q_hi) may see.

    `num_keys` caps the range (pass the key/value length there). The range is
    empty (k_lo >= k_hi) when the rows see nothing.
    """
    k_lo, k_hi = 0, num_keys
    if self.left is not None:
      k_lo = _max(k_lo, q_lo + self.q_offset - self.left)
    if self.right is not None:
      k_hi = _min(k_hi, q_hi - 1 + self.q_offset + self.right + 1)
    return k_lo, k_hi

  def query_range(self, k_lo: Int, k_hi: Int, num_queries: Int) -> tuple[Int, Int]:
    """Query rows [q_lo, q_hi) that may see some key in [k_lo, k_hi)."""
    q_lo, q_hi = 0, num_queries
    if self.right is not None:
      # j <= i + off + right  <=>  i >= j - off - right
      q_lo = _max(q_lo, k_lo - self.q_offset - self.right)
    if self.left is not None:
      # j >= i + off - left  <=>  i <= j - off + left
      q_hi = _min(q_hi, (k_hi - 1) - self.q_offset + self.left + 1)
    return q_lo, q_hi

  def tile_is_full(self, q_lo: Int, q_hi: Int, k_lo: Int, k_hi: Int):
    """True when every (query, key) pair of the tile is visible, so the tile
    needs no element mask (lengths aside)."""
    full = True
    if self.left is not None:
      # the last query row must still see the first key
      full = full & (k_lo >= (q_hi - 1) + self.q_offset - self.left)
    if self.right is not None:
      # the first query row must already see the last key
      full = full & ((k_hi - 1) <= q_lo + self.q_offset + self.right)
    return full

  def key_block_range(
      self, q_lo: Int, q_hi: Int, num_keys: Int, block_k: int
  ) -> tuple[Int, Int]:
    """Key blocks [b_lo, b_hi) of size `block_k` that rows [q_lo, q_hi) touch."""
    k_lo, k_hi = self.key_range(q_lo, q_hi, num_keys)
    b_lo = k_lo // block_k
    b_hi = _max(b_lo, cdiv(k_hi, block_k))
    return b_lo, b_hi

  def query_block_range(
      self, k_lo: Int, k_hi: Int, num_queries: Int, block_q: int
  ) -> tuple[Int, Int]:
    """Query blocks [b_lo, b_hi) of size `block_q` that keys [k_lo, k_hi) touch."""
    q_lo, q_hi = self.query_range(k_lo, k_hi, num_queries)
    b_lo = q_lo // block_q
    b_hi = _max(b_lo, cdiv(q_hi, block_q))
    return b_lo, b_hi
