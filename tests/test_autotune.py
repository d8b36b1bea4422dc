"""The opt-in autotuner (`fa4_jax.kernels.autotune`), on the CPU.

A fake timer (the documented seam `autotune(timer=..., device_kind=...)`)
gives each candidate a time, so no kernel runs: the tests check which
candidate wins, what the cache file holds and when nothing is timed.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax.kernels import autotune, device_tables, sm90_backward, sm90_decode, sm90_forward
from fa4_jax.scores import MaskSpec, ScoreFunction

KIND = "Test GPU"  # a device kind no table names
CAUSAL = MaskSpec(right=0)


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
  """Each test: no switch in the environment, a cache of its own, an empty memory."""
  monkeypatch.delenv("FA4_JAX_AUTOTUNE", raising=False)
  monkeypatch.setenv("FA4_JAX_AUTOTUNE_CACHE_DIR", str(tmp_path))
  autotune.clear_memory()
  yield
  autotune.clear_memory()


class FakeTimer:
  """Times a candidate by `ms(candidate)`; records what it timed."""

  def __init__(self, ms):
    self.ms = ms
    self.timed = []

  def __call__(self, fn, args, candidate):
    self.timed.append(candidate)
    return self.ms(candidate)


def never_called(fn, args, candidate):
  raise AssertionError("nothing should be timed here")


def forward_config(q_shape=(2, 8192, 4, 128), k_shape=(2, 8192, 4, 128), mask=MaskSpec(),
                   soft_cap=None):
  default = sm90_forward.choose_config(q_shape[-1], mask, k_shape[1], q_shape[1])
  return default, autotune.sm90_forward_config(
      default, q_shape=q_shape, k_shape=k_shape, dtype=jnp.bfloat16,
      mask=mask, score=ScoreFunction(0.1, soft_cap),
      has_q_lengths=False, has_kv_lengths=False, has_sinks=False, tunable=True)


def prefer_persistent(config):
  return 1.0 if config.persistent else 2.0


def cache_entries(tmp_path):
  return json.loads((tmp_path / autotune.CACHE_FILE).read_text())["entries"]


def test_off_by_default_the_tables_and_rules_choose(tmp_path):
  default, chosen = forward_config()
  assert chosen is default
  q_shape, k_shape = (16, 1, 32, 128), (16, 1024, 8, 128)
  assert sm90_decode.plan(q_shape, k_shape, MaskSpec()) == sm90_decode.plan(
      q_shape, k_shape, MaskSpec(), choices=sm90_decode.device_choices())
  assert not (tmp_path / autotune.CACHE_FILE).exists()


def test_the_fastest_candidate_wins_and_is_written(tmp_path):
  timer = FakeTimer(prefer_persistent)
  with fa4_jax.autotune(timer=timer, device_kind=KIND):
    default, chosen = forward_config()
  assert not default.persistent  # S8192 D128 dense: one CTA per tile by the rule
  assert chosen.persistent and default in timer.timed and len(timer.timed) >= 2
  (entry,) = cache_entries(tmp_path).values()
  assert sm90_forward.ForwardConfig(**entry["choice"]) == chosen
  assert entry["ms"] == 1.0


def test_a_new_process_reads_the_winner_from_the_file():
  with fa4_jax.autotune(timer=FakeTimer(prefer_persistent), device_kind=KIND):
    _, first = forward_config()
  autotune.clear_memory()  # as a new process: only the file remembers
  with fa4_jax.autotune(timer=never_called, device_kind=KIND):
    _, again = forward_config()
  assert again == first and again.persistent


def test_the_key_separates_device_kinds_buckets_and_options():
  timer = FakeTimer(prefer_persistent)
  with fa4_jax.autotune(timer=timer, device_kind=KIND):
    forward_config()
    timed = len(timer.timed)
    forward_config(q_shape=(2, 8000, 4, 128), k_shape=(2, 8000, 4, 128))  # same bucket
    assert len(timer.timed) == timed
    forward_config(q_shape=(2, 16384, 4, 128), k_shape=(2, 16384, 4, 128))  # next bucket
    assert len(timer.timed) == 2 * timed
    forward_config(soft_cap=30.0)
    forward_config(mask=CAUSAL)
  with fa4_jax.autotune(timer=timer, device_kind="Another GPU"):
    forward_config()
  kinds = {json.loads(key)["device_kind"] for key in autotune._memory}
  assert kinds == {KIND, "Another GPU"} and len(autotune._memory) == 5


def test_a_candidate_that_raises_is_skipped():
  def persistent_fails_to_compile(config):
    if config.persistent:
      raise RuntimeError("does not compile")
    return 1.0

  with fa4_jax.autotune(timer=FakeTimer(persistent_fails_to_compile), device_kind=KIND):
    default, chosen = forward_config()
  assert chosen == default


def test_when_every_candidate_raises_the_default_stands_and_nothing_is_written(tmp_path):
  with fa4_jax.autotune(timer=FakeTimer(lambda c: 1 / 0), device_kind=KIND):
    with pytest.warns(UserWarning, match="could be timed.*ZeroDivisionError"):
      default, chosen = forward_config()
  assert chosen is default
  assert not (tmp_path / autotune.CACHE_FILE).exists()


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": -1, "entries": {}}),
                                     json.dumps([1, 2])])
def test_a_corrupt_or_foreign_cache_file_is_ignored_and_replaced(tmp_path, content):
  (tmp_path / autotune.CACHE_FILE).write_text(content)
  with fa4_jax.autotune(timer=FakeTimer(prefer_persistent), device_kind=KIND):
    _, chosen = forward_config()
  assert chosen.persistent
  assert len(cache_entries(tmp_path)) == 1


def test_nothing_is_timed_under_gpu_target(tmp_path):
  with fa4_jax.gpu_target("sm90"), fa4_jax.autotune(timer=never_called, device_kind=KIND):
    default, chosen = forward_config()
  assert chosen is default
  assert not (tmp_path / autotune.CACHE_FILE).exists()


def test_measured_kinds_keep_their_tables_unless_tuned_everywhere():
  kind = "NVIDIA H200"
  assert kind in autotune.MEASURED_KINDS
  with fa4_jax.autotune(timer=never_called, device_kind=kind):
    default, chosen = forward_config()
  assert chosen is default
  with fa4_jax.autotune(timer=FakeTimer(prefer_persistent), device_kind=kind, everywhere=True):
    _, chosen = forward_config()
  assert chosen.persistent


def test_the_environment_variable_switches_it_on(monkeypatch):
  monkeypatch.setenv("FA4_JAX_AUTOTUNE", "1")
  assert autotune._settings().enabled and not autotune._settings().everywhere
  monkeypatch.setenv("FA4_JAX_AUTOTUNE", "all")
  assert autotune._settings().everywhere
  with fa4_jax.autotune(enabled=False):  # the context overrides the environment
    assert not autotune._settings().enabled


def test_under_jit_the_candidates_run_on_concrete_arrays():
  seen = []

  def reads_its_arguments(fn, args, candidate):
    seen.append(np.asarray(args[0]).shape)  # a tracer would raise here
    return prefer_persistent(candidate)

  def traced(q):
    default = sm90_forward.choose_config(128, MaskSpec())
    config = autotune.sm90_forward_config(
        default, q_shape=q.shape, k_shape=q.shape, dtype=q.dtype,
        mask=MaskSpec(), score=ScoreFunction(0.1, None), has_q_lengths=False, has_kv_lengths=False,
        has_sinks=False, tunable=True)
    return q * config.persistent

  with fa4_jax.autotune(timer=reads_its_arguments, device_kind=KIND):
    out = jax.jit(traced)(jnp.ones((1, 512, 2, 128), jnp.bfloat16))
  assert seen and all(shape == (1, 512, 2, 128) for shape in seen)
  assert float(out[0, 0, 0, 0]) == 1.0


def backward_config(default):
  return autotune.sm90_backward_config(
      default, q_shape=(2, 1024, 4, 128), k_shape=(2, 1024, 4, 128), dtype=jnp.bfloat16,
      mask=CAUSAL, score=ScoreFunction(0.1, None), has_q_lengths=False, has_kv_lengths=False,
      tunable=True)


def test_backward_candidates_are_the_heuristics_configs_for_the_head_dim_and_mask():
  timer = FakeTimer(lambda config: 1.0 if config.dkv.fold_stats else 2.0)
  default = sm90_backward.choose_config(128, CAUSAL, 1)
  with fa4_jax.autotune(timer=timer, device_kind=KIND):
    chosen = backward_config(default)
  assert not default.dkv.fold_stats and chosen.dkv.fold_stats  # the GQA rule's choice
  assert chosen == sm90_backward.choose_config(128, CAUSAL, 4)
  assert set(timer.timed) <= {sm90_backward.choose_config(128, CAUSAL, g, raw_scores=c)
                              for g in (1, 4) for c in (False, True)}


def test_a_new_process_reads_the_backward_winner_with_both_kernels_configs(tmp_path):
  """The file holds the dK/dV and the dQ kernel's configs of the winner
  apart (`dkv`, `dq`), and they come back as they went in."""
  default = sm90_backward.choose_config(128, CAUSAL, 1)
  with fa4_jax.autotune(timer=FakeTimer(lambda c: 1.0 if c.dkv.fold_stats else 2.0),
                        device_kind=KIND):
    first = backward_config(default)
  (entry,) = cache_entries(tmp_path).values()
  assert entry["choice"]["dkv"]["fold_stats"] and entry["choice"]["dq"]["num_consumers"] == 3
  autotune.clear_memory()  # as a new process: only the file remembers
  with fa4_jax.autotune(timer=never_called, device_kind=KIND):
    again = backward_config(default)
  assert again == first and isinstance(again.dkv, sm90_backward.DkvConfig)


def test_decode_plan_takes_the_tuned_choices():
  q_shape, k_shape = (1, 1, 32, 128), (1, 32768, 4, 128)  # D128: 16 chunks on 64 streams, 32 on 132 SMs
  fewer = device_tables.DecodeChoices(streaming_ctas=64)
  assert sm90_decode.plan(q_shape, k_shape, MaskSpec(), choices=fewer) != sm90_decode.plan(
      q_shape, k_shape, MaskSpec(), choices=device_tables.GENERIC_DECODE)
  timer = FakeTimer(lambda choices: 1.0 if choices.streaming_ctas == 64 else 2.0)
  with fa4_jax.autotune(timer=timer, device_kind=KIND):
    tuned = sm90_decode.plan(q_shape, k_shape, MaskSpec())
    assert sm90_decode.plan(q_shape, k_shape, MaskSpec()) == tuned  # timed once
  assert tuned == sm90_decode.plan(q_shape, k_shape, MaskSpec(), choices=fewer)
  plans = [sm90_decode.plan(q_shape, k_shape, MaskSpec(), choices=c) for c in timer.timed]
  assert len(plans) == len(set(plans))  # choices that make the same plan are timed once
  # Ragged key lengths and pages keep the table's choices.
  with fa4_jax.autotune(timer=never_called, device_kind=KIND):
    sm90_decode.plan(q_shape, k_shape, MaskSpec(), ragged=True)
