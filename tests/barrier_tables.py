"""The check every kernel's barrier table gets, sm90 and sm100 alike (test support).

A kernel's `*BarrierTable` class declares each barrier once (`BARRIERS`,
with the accessors of the roles that arrive on it and wait on it, generated
from that declaration: `pipeline.BarrierTable`) and lists it in its
docstring table (name, count, who arrives, who waits, why). `check_table` calls every
accessor, generated or hand-written (the drains), on fake barriers and checks
that it touches its barrier on the side it is declared for, that it appears
in the docstring row of each barrier it arrives on or waits on, and that
every barrier has both an arriving and a waiting side. An accessor's
conditional wait (ACQUIRE: none in a ring's first lap) is taken as made; a
FILL accessor gets one fake copy, which arrives on its barrier.
"""

import collections
import inspect
import types

from fa4_jax.kernels import pipeline


def table_rows(bars_cls, indent: int) -> dict[str, str]:
  """Barrier name -> its row of the class docstring's table (continuation
  lines, indented by `indent` spaces or more, included)."""
  rows, current = {}, None
  for line in bars_cls.__doc__.splitlines():
    first = line.split()[0] if line.strip() else None
    if first in bars_cls.BARRIERS:
      current = first
      rows[current] = line
    elif first is None:
      current = None
    elif current is not None and line.startswith(" " * indent):
      rows[current] += " " + line.strip()
  return rows


def check_table(bars_cls, make_bars, kernel_module, monkeypatch, *, indent: int,
                skip=(), named_only=()):
  """`make_bars(refs)` builds the class over fake barrier refs; the accessors
  in `skip` are not called (loops over others), those in `named_only` only
  have to appear in the table (e.g. interpreter-only drains)."""
  rows = table_rows(bars_cls, indent)
  assert sorted(rows) == sorted(bars_cls.BARRIERS)
  log = []

  class FakeBarrierArray:
    def __init__(self, name):
      self.at = {0: name}  # .at[0] is the barrier's name

  fake_plgpu = types.SimpleNamespace(
      barrier_wait=lambda ref: log.append(("wait", ref)),
      barrier_arrive=lambda ref: log.append(("arrive", ref)),
      tcgen05_commit_arrive=lambda ref: log.append(("arrive", ref)),
      copy_gmem_to_smem=lambda src, dst, ref: log.append(("arrive", ref)),
      commit_smem=lambda: None)  # a fence, touching no barrier
  monkeypatch.setattr(kernel_module, "plgpu", fake_plgpu)
  monkeypatch.setattr(pipeline, "plgpu", fake_plgpu)  # the generated accessors, Waiter.wait
  # A conditional wait runs as if its condition held: the side it touches.
  monkeypatch.setattr(pipeline, "pl", types.SimpleNamespace(when=lambda cond: lambda f: f()))
  fake_copies = [("gmem", types.SimpleNamespace(at=collections.defaultdict(str)))]
  bars = make_bars({name: FakeBarrierArray(name) for name in bars_cls.BARRIERS})
  table = " ".join(rows.values())
  for method in named_only:
    assert method in table, f"{method} is missing from the barrier table"
  accessors = [m for m in dir(bars_cls) if m.startswith(("producer_", "consumer_", "drain_"))
               and m not in named_only]
  sides = {name: set() for name in bars_cls.BARRIERS}
  for method in accessors:
    assert method in table, f"{method} is missing from the barrier table"
    if method in skip:
      continue
    log.clear()
    params = inspect.signature(getattr(bars, method)).parameters
    result = getattr(bars, method)(*[fake_copies if p == "copies" else 0 for p in params])
    if isinstance(result, pipeline.Waiter):
      result.wait()
    elif result is not None:
      log.append(("arrive", result))  # a barrier handed to TMA or to an MMA
    assert log, method
    for side, name in log:
      assert method in rows[name], f"{method} ({side} on {name}) is not in the {name} row"
      sides[name].add(side)
    declared = [(side, name) for name, spec in bars_cls.BARRIERS.items()
                for side, accessors in (("arrive", spec.arrive), ("wait", spec.wait))
                if method in accessors]
    if declared:  # a generated accessor touches its barrier once, on its declared side
      assert log == declared, f"{method}: touched {log}, declared {declared}"
  for name, seen in sides.items():
    assert seen == {"arrive", "wait"}, f"{name}: only {seen}"
