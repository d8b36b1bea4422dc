"""Which work items a CTA runs, and in what order.

Two grids, chosen per call by the kernel's config:

* One CTA per (q head, q tile, batch) tile. Under causal-like masks
  (`pairs_causal_tiles`) later query tiles see more keys, so the grid is
  walked heavy first (`heavy_first_tile`): the long tiles start in the first
  wave and the short ones fill the tail.
* A persistent grid (`PersistentWork`): one CTA per SM walks a share of the
  tiles in closed form, in the order the hardware would launch the
  one-CTA-per-tile grid, so the tiles in flight share K/V in L2. Causal tiles
  are paired heavy with light so that every CTA gets the same work.

The functions work on Python ints (tests, host-side sizing) and on traced
int32 scalars (inside a kernel) alike.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from fa4_jax.kernels import default_device
from fa4_jax.scores import MaskSpec
from fa4_jax.target import current_target


def pairs_causal_tiles(mask: MaskSpec) -> bool:
  """Causal-like masks (a right bound, no left one): later query tiles see
  more keys, so they run first and a persistent grid pairs them."""
  return mask.right is not None and mask.left is None


def heavy_first_tile(grid_index, num_q_tiles: int, heavy_first: bool):
  """The q tile that grid index `grid_index` of a one-CTA-per-tile grid
  computes: the last (heaviest) tiles first when `heavy_first`."""
  return num_q_tiles - 1 - grid_index if heavy_first else grid_index


def _div(x, n: int):
  return x // n if isinstance(x, int) else lax.div(x, jnp.int32(n))


def _rem(x, n: int):
  return x % n if isinstance(x, int) else lax.rem(x, jnp.int32(n))


@dataclasses.dataclass(frozen=True)
class PersistentWork:
  """The work items of a persistent grid: which (batch, q head, q tile) the
  i-th item of CTA `cta` is, in closed form (Python ints or int32 scalars).

  Units of work are dealt round-robin to the CTAs, heads varying fastest,
  then q tiles, then the batch, as the hardware launches a (heads, q_tiles,
  batch) grid: the units in flight read the K/V of few (batch, head) pairs,
  which stay in L2 (walking the batch before the tiles measured 412 vs 629
  TFLOP/s at B8 S2048 D128 on an H100).

  A unit is one q tile, or, under causal-like masks (`paired`), a pair of
  tiles whose costs add up to the same for every pair: the heaviest with the
  lightest, and so on (the heavy one first). Dealing single causal tiles
  round-robin gave some CTAs only heavy tiles (436 vs 531 TFLOP/s at B8
  S2048 causal). An odd tile count gets one empty tile past the end (no KV
  blocks; its rows are past the query length, so nothing lands in the output).
  """

  batch: int
  num_heads: int
  num_q_tiles: int
  num_sms: int
  paired: bool

  @property
  def tile_slots(self) -> int:
    return self.num_q_tiles + (self.num_q_tiles % 2 if self.paired else 0)

  @property
  def tiles_per_unit(self) -> int:
    return 2 if self.paired else 1

  @property
  def num_units(self) -> int:
    return self.batch * self.num_heads * self.tile_slots // self.tiles_per_unit

  @property
  def num_ctas(self) -> int:
    return min(self.num_units, self.num_sms)

  def count(self, cta):
    """Work items (tiles) of CTA `cta`."""
    return _div(self.num_units - cta + (self.num_ctas - 1), self.num_ctas) * self.tiles_per_unit

  def coords(self, cta, i):
    """(batch, q head, q tile) of CTA `cta`'s i-th work item."""
    unit = cta + _div(i, self.tiles_per_unit) * self.num_ctas
    head = _rem(unit, self.num_heads)
    rest = _div(unit, self.num_heads)
    per_batch = self.tile_slots // self.tiles_per_unit
    position, batch_idx = _rem(rest, per_batch), _div(rest, per_batch)
    last = self.tile_slots - 1
    if not self.paired:
      return batch_idx, head, position
    first = _rem(i, 2) == 0
    heavy, light = last - position, position
    if isinstance(i, int):
      return batch_idx, head, heavy if first else light
    return batch_idx, head, jnp.where(first, heavy, light)


def sm_count(default: int) -> int:
  """SMs of the `fa4_jax.gpu_target` if one is active, else of the default
  device (a persistent grid launches one CTA per SM: more would queue a
  second wave); `default` without a GPU."""
  if (chosen := current_target()) is not None:
    return chosen.num_sms
  try:
    device = default_device()
  except RuntimeError:
    return default
  if device.platform != "gpu":
    return default
  return getattr(device, "core_count", None) or default
