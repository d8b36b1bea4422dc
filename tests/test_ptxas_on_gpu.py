"""What ptxas makes of the sm90 kernels (skipped without a Hopper GPU).

A kernel can be right and still compiled badly: ptxas decides, for the whole
kernel, whether its wgmmas may overlap. This file is kept apart from
`test_on_gpu.py` so that each runs within one ten-minute device command.
Every configuration is compiled plain, with segment ids, and with sinks and
soft-cap (whose tanh and slope add registers to the softmax and to dS). No
variant may be serialized, and the soft-capped forward and the forward
with segment ids may not spill more than the plain kernel. Every call's
spill bytes are printed (`pytest -s`):
the segment-id backward and the soft-capped backward spill more than the
plain kernels in several configurations (H200, 2026-11-26; the tables are
in docs/performance-notes.md), which issues #25 and #26 keep open.
"""


import pytest

import ptxas_dumps

from fa4_jax import backends

pytestmark = pytest.mark.skipif(backends.device_arch_major() != 9,
                                reason="needs a Hopper GPU")


# Compiles, with Mosaic GPU's ptxas dump switched on, the kernels of every
# distinct config the heuristics pick, each with the mask it was picked for
# (the items `int(argv[1]) :: int(argv[2])` of the list, so that several
# children can share the work), and prints which dumps each call left. Item 0
# is a control that ptxas is known to serialize: the dK/dV kernel at head dim
# 128 whose consumers have 208 registers and load lse and delta after the
# S^T / dP^T wait (C7512; 224 escape it).
_COMPILE_HEURISTIC_KERNELS = r"""
import dataclasses, os, sys
import jax, jax.numpy as jnp
from fa4_jax.kernels import sm90_backward, sm90_forward
from fa4_jax.scores import MaskSpec, ScoreFunction

# Each item builds its inputs when it runs: a child runs a quarter of them.
# `segments`: with segment ids (packed sequences), whose element mask adds
# registers to the consumers' masked steps.
# `capped`: with soft-cap (and sinks in the forward).
def ids(segments):
  return (jnp.zeros((1, 1024), jnp.int32),) * 2 if segments else None

def forward(d, mask, config, segments=False, capped=False):
  def call():
    q = jnp.ones((1, 1024, 2, d), jnp.bfloat16)
    options = dict(sinks=jnp.zeros((2,), jnp.float32)) if capped else {}
    score = ScoreFunction(0.1, 30.0 if capped else None)
    return sm90_forward.forward(q, q, q, None, None, score=score, mask=mask, config=config,
                                segment_ids=ids(segments), **options)[0]
  return call

def backward(d, mask, group, config, segments=False, capped=False):
  def call():
    q = jnp.ones((1, 1024, 2 * group, d), jnp.bfloat16)
    kv = jnp.ones((1, 1024, 2, d), jnp.bfloat16)
    lse = jnp.zeros((1, 2 * group, 1024), jnp.float32)
    score = ScoreFunction(0.1, 30.0 if capped else None)
    return sm90_backward.backward(q, kv, kv, q, lse, q, None, None, score=score, mask=mask,
                                  config=config, segment_ids=ids(segments))
  return call

causal = MaskSpec(right=0)
_heuristic = sm90_backward.choose_config(128, causal)
items = {"control: dK/dV consumers on 208 registers": backward(
    128, causal, 1, dataclasses.replace(_heuristic, dkv=dataclasses.replace(
        _heuristic.dkv, consumer_registers=208, stats_first=False, fold_stats=False)))}
for d in (64, 128, 192, 256):
  for mask in (MaskSpec(), causal, MaskSpec(left=256, right=0)):
    for seq in (1024, 8192):
      config = sm90_forward.choose_config(d, mask, seq)
      items.setdefault(f"forward d={d} {mask} {config}", forward(d, mask, config))
      items.setdefault(f"forward d={d} {mask} {config} segment ids",
                       forward(d, mask, config, segments=True))
      items.setdefault(f"forward d={d} {mask} {config} soft-cap",
                       forward(d, mask, config, capped=True))
      # Packed causal rows take the persistent grid with a work queue at any
      # length (at 8192 the plain causal call takes another grid).
      packed = sm90_forward.choose_config(d, mask, seq, segment_ids=True)
      items.setdefault(f"forward d={d} {mask} {packed} segment ids",
                       forward(d, mask, packed, segments=True))
    for group in (1, 4):
      config = sm90_backward.choose_config(d, mask, group)
      items.setdefault(f"backward d={d} {mask} group={group > 1} {config}",
                       backward(d, mask, group, config))
      items.setdefault(f"backward d={d} {mask} group={group > 1} {config} segment ids",
                       backward(d, mask, group, config, segments=True))
      capped = sm90_backward.choose_config(d, mask, group, raw_scores=True)
      items.setdefault(f"backward d={d} {mask} group={group > 1} {capped} soft-cap",
                       backward(d, mask, group, capped, capped=True))
      # Packed causal rows (head dim 64): the dK/dV kernel takes a work queue.
      packed = sm90_backward.choose_config(d, mask, group, segment_ids=True)
      items.setdefault(f"backward d={d} {mask} group={group > 1} {packed} segment ids",
                       backward(d, mask, group, packed, segments=True))

"""


def test_no_heuristic_kernel_has_its_wgmmas_serialized_by_ptxas(tmp_path):
  """ptxas serializes every wgmma of a kernel (each waits for the one before)
  when a warpgroup lacks the registers to keep its wgmma pipeline (C7510-
  C7515, reported as `ptxas info`, not as a warning), and ignores
  `setmaxnreg` below what a warpgroup needs (C7507, which spills and
  serializes). Either takes from every wgmma its overlap with the next
  (docs/performance-notes.md, "ptxas serialized every wgmma of the one kernel"). No
  configuration the heuristics pick may be compiled that way; the control,
  which is, must be caught."""
  children = 8  # ptxas dominates: compile on several cores at once
  dump_dirs = [tmp_path / f"child{i}" for i in range(children)]
  procs = []
  for i, dump_dir in enumerate(dump_dirs):
    dump_dir.mkdir()
    procs.append(ptxas_dumps.start(_COMPILE_HEURISTIC_KERNELS, dump_dir, str(i), str(children)))
  calls, num_items = [], None
  for proc, dump_dir in zip(procs, dump_dirs):
    num_items, child_calls = ptxas_dumps.reports(proc, dump_dir, timeout=600)
    calls += child_calls
  assert len(calls) == num_items, [name for name, _ in calls]
  found = {name: ptxas_dumps.serialized_wgmmas(dumps) for name, dumps in calls}
  assert all(dumps for _, dumps in calls), "a call left no ptxas report"
  assert found.pop("control: dK/dV consumers on 208 registers"), "the control's serialization went unseen"
  bad = [f"{name}: {message}" for name, messages in found.items() for message in messages]
  assert not bad, "\n".join(bad)
  spills = {name: ptxas_dumps.spill_bytes(dumps) for name, dumps in calls}
  for name, total in spills.items():
    print(f"spill bytes {total:5d}  {name}")
  # (A packed grid that no plain call picks has nothing to compare with.)
  held = [(name, suffix) for name in spills for suffix in (" soft-cap", " segment ids")
          if name.endswith(suffix) and name.startswith("forward")
          and name[:-len(suffix)] in spills]
  more = [f"{name}: {spills[name]} spill bytes, plain {spills[name[:-len(suffix)]]}"
          for name, suffix in held if spills[name] > spills[name[:-len(suffix)]]]
  assert not more, "\n".join(more)

