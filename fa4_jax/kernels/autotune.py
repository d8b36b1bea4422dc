"""An opt-in autotuner for the kernels' configuration choices.

Without it nothing changes: the sm90 forward and backward take their
heuristics (`sm90_forward.choose_config`, `sm90_backward.choose_config`) and
decode takes its device kind's measured table (`device_tables.DECODE`).

Switching it on
  * `FA4_JAX_AUTOTUNE=1` in the environment: tune on device kinds the
    measured tables do not name (`MEASURED_KINDS`: H100 SXM, H200);
    `FA4_JAX_AUTOTUNE=all`: tune on every kind. `0` or unset: off.
  * `with fa4_jax.autotune():` (or `autotune(everywhere=True)`) around the
    code that traces the calls; it overrides the environment variable
    (`autotune(enabled=False)` switches it off).

What happens when on
  Each choice point calls one function of this module with the choice the
  tables or rules made and the call's abstract shapes (`decode_choices`,
  `sm90_forward_config`, `sm90_backward_config`). For a new cache key it
  builds fresh random arrays of the call's shapes, runs every candidate
  eagerly (`jax.ensure_compile_time_eval`: the choice is made while a `jit`
  traces, where only shapes exist), times it and keeps the fastest. A
  candidate that fails to compile or run is skipped; if all fail, the
  default choice stands and nothing is stored.

  Candidates: for the sm90 forward, the configurations the heuristic picks
  for the call's head dim and mask at any length (one CTA per tile, the
  persistent grid, the work queue, one or two Q tiles); for the backward,
  those it picks for the head dim and mask at any GQA group and with or
  without a soft-cap (folded statistics or not); for decode, `DecodeChoices`
  variants (streaming CTAs: the SMs, 64 or 128; one consumer warpgroup with
  2, 4 or 6 K/V slots, or three consumers), deduplicated by the plan they
  make for the call.

  Timing: CUPTI kernel time of the call (`jax.experimental.mosaic.gpu.
  profiler.measure`, the median of `ITERATIONS` calls, after one call that
  compiles), as `benchmarks/bench_common.kernel_ms` measures.

  Cache: in memory per process, and in a JSON file,
  `$FA4_JAX_AUTOTUNE_CACHE_DIR/autotune.json` (default
  `~/.cache/fa4_jax/autotune.json`), which later processes read. Key: the
  kernel, the device kind, the shape bucket (batch and sequence lengths
  rounded up to powers of two; heads, KV heads, head dims and dtype as
  they are), the mask and the options (lengths, sinks, soft-cap...). Files
  are written atomically (a temporary file renamed over the old one,
  merged with what another process wrote meanwhile); a corrupt file or one
  of another `CACHE_VERSION` is ignored.

Never timed: under `fa4_jax.gpu_target` (export and AOT lowering time
nothing: they get the default choices), under `interpret_mode`, and without
a GPU as the default device (unless a timer is injected, below). Calls the
tuner does not model (paged or ragged decode, packed documents, mods,
unequal head dims, the decode arrangement's forward kernel) keep the default
choice.

Test seam: `autotune(timer=..., device_kind=...)`. A timer is
`timer(fn, args, candidate) -> milliseconds`: `fn(*args)` runs the call
with `candidate` (a `ForwardConfig`, `BackwardConfig` or `DecodeChoices`);
an exception skips the candidate; when every candidate raises, the default
stands and a warning names the first error (CUPTI, for one, cannot time
in a process that has run a `jax.profiler` trace). An injected timer also allows tuning
without a GPU, under `device_kind` (default: the default device's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import tempfile
import threading
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp

from fa4_jax.kernels import default_device, device_tables
from fa4_jax.scores import ScoreFunction

CACHE_VERSION = 2  # 2: a backward entry holds the dK/dV and dQ kernels' configs apart
CACHE_FILE = "autotune.json"
ITERATIONS = 10  # calls per CUPTI measurement
# Device kinds whose choices were measured (docs/performance-notes.md).
MEASURED_KINDS = frozenset(device_tables.DECODE)

Timer = Callable[[Callable, tuple, Any], float]


@dataclasses.dataclass(frozen=True)
class _Settings:
  enabled: bool
  everywhere: bool = False  # tune on MEASURED_KINDS too
  timer: Timer | None = None
  device_kind: str | None = None
  cache_dir: str | None = None


_local = threading.local()
# Winners (or None: nothing could be timed) per cache key, this process.
_memory: dict[str, dict | None] = {}


@contextlib.contextmanager
def autotune(enabled: bool = True, *, everywhere: bool = False, timer: Timer | None = None,
             device_kind: str | None = None, cache_dir: str | None = None):
  """Tunes the configurations of the calls traced inside (see the module
  docstring). `everywhere`: also on device kinds the tables measured.
  `timer`, `device_kind`: the test seam. `cache_dir`: None for
  `$FA4_JAX_AUTOTUNE_CACHE_DIR` or `~/.cache/fa4_jax`."""
  previous = getattr(_local, "settings", None)
  _local.settings = _Settings(enabled, everywhere, timer, device_kind, cache_dir)
  try:
    yield
  finally:
    _local.settings = previous


def clear_memory() -> None:
  """Forgets this process's winners (as a new process would); the file stays."""
  _memory.clear()


def _settings() -> _Settings:
  chosen = getattr(_local, "settings", None)
  if chosen is not None:
    return chosen
  value = os.environ.get("FA4_JAX_AUTOTUNE", "").strip().lower()
  if value in ("", "0", "false", "off", "no"):
    return _Settings(enabled=False)
  return _Settings(enabled=True, everywhere=value == "all")


def cache_path(settings: _Settings | None = None) -> str:
  settings = settings or _settings()
  directory = (settings.cache_dir or os.environ.get("FA4_JAX_AUTOTUNE_CACHE_DIR")
               or os.path.join(os.path.expanduser("~"), ".cache", "fa4_jax"))
  return os.path.join(directory, CACHE_FILE)


def _device_kind_to_tune(settings: _Settings) -> str | None:
  """The device kind to tune for, or None when this call must not be timed."""
  from fa4_jax.interpret import is_interpreting
  from fa4_jax.target import current_target

  if not settings.enabled or current_target() is not None or is_interpreting():
    return None
  try:
    device = default_device()
  except RuntimeError:
    return None
  if settings.timer is None and device.platform != "gpu":
    return None
  kind = settings.device_kind or getattr(device, "device_kind", None)
  if kind is None or (kind in MEASURED_KINDS and not settings.everywhere):
    return None
  return kind


# --- the on-disk cache -----------------------------------------------------


def _read_entries(path: str) -> dict:
  """The file's entries; {} for a missing, corrupt or foreign-version file."""
  try:
    with open(path) as f:
      data = json.load(f)
  except (OSError, ValueError):
    return {}
  if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
    return {}
  entries = data.get("entries")
  return entries if isinstance(entries, dict) else {}


def _write_entry(path: str, key: str, entry: dict) -> None:
  """Adds one entry, merged with the file as it is now, by an atomic rename."""
  directory = os.path.dirname(path)
  try:
    os.makedirs(directory, exist_ok=True)
    entries = _read_entries(path)
    entries[key] = entry
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".autotune-", suffix=".json")
    with os.fdopen(fd, "w") as f:
      json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
    os.replace(temporary, path)
  except OSError:
    pass  # a read-only home: the winner still lives in this process


def make_key(kernel: str, device_kind: str, **problem) -> str:
  """The cache key: kernel, device kind and the call's bucketed problem."""
  return json.dumps(dict(kernel=kernel, device_kind=device_kind, **problem), sort_keys=True)


def bucket(n: int) -> int:
  """`n` rounded up to a power of two (shapes in one bucket share a winner)."""
  return 1 << max(int(n) - 1, 0).bit_length()


# --- tuning ----------------------------------------------------------------


def measure_kernel_ms(fn, args, candidate) -> float:
  """The default timer: CUPTI kernel time of `fn(*args)`, median of ITERATIONS."""
  del candidate
  import numpy as np
  from jax.experimental.mosaic.gpu import profiler

  jax.block_until_ready(fn(*args))  # compiles; a failure skips the candidate
  _, times = profiler.measure(fn, iterations=ITERATIONS)(*args)
  return float(np.median(times))


def _tune(key_problem: dict, kernel: str, default, candidates, run_candidate, to_json,
          from_json):
  """The fastest of `candidates()` for this call, or `default` when off or
  untimeable. `run_candidate(candidate) -> (fn, args)` builds a timed call.
  Nothing but the switch is looked at when off: the default path stays as
  it was."""
  settings = _settings()
  kind = _device_kind_to_tune(settings)
  if kind is None:
    return default
  key = make_key(kernel, kind, **key_problem)
  if key not in _memory:
    path = cache_path(settings)
    stored = _read_entries(path).get(key)
    if isinstance(stored, dict) and "choice" in stored:
      _memory[key] = stored
    else:
      _memory[key] = _time_candidates(settings, candidates(), run_candidate, to_json)
      if _memory[key] is not None:
        _write_entry(path, key, _memory[key])
  entry = _memory[key]
  if entry is None:
    return default
  try:
    return from_json(entry["choice"])
  except (TypeError, ValueError, KeyError):  # an entry of an older layout
    return default


def _time_candidates(settings: _Settings, candidates, run_candidate, to_json) -> dict | None:
  timer = settings.timer or measure_kernel_ms
  times, errors = [], []
  # Eagerly, even while a jit traces the call: fresh concrete arrays.
  with jax.ensure_compile_time_eval():
    for candidate in candidates:
      try:
        fn, args = run_candidate(candidate)
        times.append((float(timer(fn, args, candidate)), candidate))
      except Exception as e:  # noqa: BLE001 - a candidate that does not compile or run
        errors.append(e)
  if not times:
    if errors:  # silence here would look like a tuned call
      warnings.warn(f"fa4_jax.autotune: none of {len(errors)} candidates could be timed, the "
                    f"default configuration stands; the first error: "
                    f"{type(errors[0]).__name__}: {str(errors[0])[:300]}", stacklevel=2)
    return None
  best_ms, best = min(times, key=lambda t: t[0])
  return dict(choice=to_json(best), ms=best_ms, candidates_timed=len(times))


def _random(key: int, shape, dtype):
  return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32).astype(dtype)


def _unique(items) -> list:
  return list(dict.fromkeys(items))


def _mask_key(mask) -> str:
  return repr(mask)


def _kernel_problem(q_shape, k_shape, dtype, mask, **flags) -> dict:
  """The cache key's problem of a forward or backward call: lengths and
  batch bucketed, heads, head dim, dtype, mask, and the call's `flags`
  (which optional operands it has)."""
  batch, q_seq, heads, head_dim = q_shape
  return dict(batch=bucket(batch), q_seq=bucket(q_seq), kv_seq=bucket(k_shape[1]), heads=heads,
              kv_heads=k_shape[2], head_dim=head_dim, dtype=jnp.dtype(dtype).name,
              mask=_mask_key(mask), **flags)


# --- sm90 forward ----------------------------------------------------------


def sm90_forward_config(default, *, q_shape, k_shape, dtype, mask, score: ScoreFunction,
                        has_q_lengths: bool, has_kv_lengths: bool, has_sinks: bool,
                        tunable: bool):
  """The forward kernel's config: `default` (the heuristic's) unless the
  autotuner is on and the call is `tunable` (a plain layout: no page
  table, heads-major Q, segment ids or mods, equal head dims: V's shape is
  K's). The shapes are the call's, before the kernel's padding."""
  if not tunable:
    return default
  from fa4_jax.kernels import sm90_forward

  d = sm90_forward.padded_head_dim(q_shape[-1])
  batch, q_seq, heads, _ = q_shape
  kv_seq = k_shape[1]
  problem = _kernel_problem(q_shape, k_shape, dtype, mask, q_lengths=has_q_lengths,
                            kv_lengths=has_kv_lengths, sinks=has_sinks,
                            **score.tuning_flags())

  def candidates():
    lengths = (256, 1024, 4096, 8192, 32768, kv_seq)
    return _unique([default] + [sm90_forward.choose_config(d, mask, s, q) for s in lengths
                                for q in (s, q_seq)])

  @functools.cache  # one set of arrays for every candidate
  def arrays():
    return tuple(_random(i, s, dtype) for i, s in enumerate((q_shape, k_shape, k_shape)))

  def run_candidate(config):
    q_lengths = jnp.full((batch,), q_seq, jnp.int32) if has_q_lengths else None
    kv_lengths = jnp.full((batch,), kv_seq, jnp.int32) if has_kv_lengths else None
    sinks = jnp.zeros((heads,), jnp.float32) if has_sinks else None

    @jax.jit
    def fn(q, k, v):
      return sm90_forward.forward(q, k, v, q_lengths, kv_lengths, score=score, mask=mask,
                                  config=config, sinks=sinks)

    return fn, arrays()

  return _tune(problem, "sm90_forward", default, candidates, run_candidate,
               dataclasses.asdict, lambda c: sm90_forward.ForwardConfig(**c))


# --- sm90 backward ---------------------------------------------------------


def sm90_backward_config(default, *, q_shape, k_shape, dtype, mask, score: ScoreFunction,
                         has_q_lengths: bool, has_kv_lengths: bool, tunable: bool):
  """The backward kernels' config: `default` (the heuristic's) unless the
  autotuner is on and the call is `tunable` (no segment ids or mods)."""
  if not tunable:
    return default
  from fa4_jax.kernels import sm90_backward

  d = sm90_backward.padded_head_dim(q_shape[-1])
  batch, q_seq, heads, _ = q_shape
  kv_seq, kv_heads = k_shape[1], k_shape[2]
  problem = _kernel_problem(q_shape, k_shape, dtype, mask, q_lengths=has_q_lengths,
                            kv_lengths=has_kv_lengths, **score.tuning_flags())
  group = heads // kv_heads

  def candidates():
    return _unique([default] + [sm90_backward.choose_config(d, mask, g, raw_scores=raw)
                                for g in (1, 4, group) for raw in (False, True)])

  @functools.cache  # one set of arrays for every candidate
  def arrays():
    q, out, dout = (_random(i, q_shape, dtype) for i in range(3))
    k, v = (_random(3 + i, k_shape, dtype) for i in range(2))
    # Timing does not depend on the values: any finite lse will do.
    lse = jnp.full((batch, heads, q_seq), math.log(kv_seq), jnp.float32)
    return q, k, v, out, lse, dout

  def run_candidate(config):
    q_lengths = jnp.full((batch,), q_seq, jnp.int32) if has_q_lengths else None
    kv_lengths = jnp.full((batch,), kv_seq, jnp.int32) if has_kv_lengths else None

    @jax.jit
    def fn(q, k, v, out, lse, dout):
      return sm90_backward.backward(q, k, v, out, lse, dout, q_lengths, kv_lengths, score=score,
                                    mask=mask, config=config)

    return fn, arrays()

  return _tune(problem, "sm90_backward", default, candidates, run_candidate,
               dataclasses.asdict, _backward_config_from_json)


def _backward_config_from_json(c: dict):
  """The `BackwardConfig` of its `dataclasses.asdict` (nested: `dkv`, `dq`)."""
  from fa4_jax.kernels import sm90_backward

  c = dict(c)
  return sm90_backward.BackwardConfig(dkv=sm90_backward.DkvConfig(**c.pop("dkv")),
                                      dq=sm90_backward.DqConfig(**c.pop("dq")), **c)


# --- decode ----------------------------------------------------------------


def decode_choices(default: device_tables.DecodeChoices, *, q_shape, k_shape, mask,
                   tunable: bool) -> device_tables.DecodeChoices:
  """The decode arrangement's knobs: `default` (the device kind's table)
  unless the autotuner is on and the call is `tunable` (equal key lengths,
  no pages). `plan` does not see the dtype: candidates run in bfloat16."""
  if not tunable:
    return default
  from fa4_jax.kernels import sm90_decode

  b, t, n, d = q_shape
  s, kv_heads = k_shape[1], k_shape[2]
  problem = dict(batch=bucket(b), q_seq=t, kv_seq=bucket(s), heads=n, kv_heads=kv_heads,
                 head_dim=d, dtype="bfloat16", mask=_mask_key(mask))

  def candidates():
    variants = [default] + [
        device_tables.DecodeChoices(streaming_ctas=streams, one_consumer_max_rows=rows,
                                    one_consumer_stages=stages)
        for streams in (None, 64, 128) for rows in (0, sm90_decode.MAX_PACKED_ROWS)
        for stages in ((4,) if rows == 0 else (2, 4, 6))]
    # Choices that make the same plan would time the same kernels.
    by_plan = {}
    for choices in variants:
      by_plan.setdefault(sm90_decode.plan(q_shape, k_shape, mask, choices=choices), choices)
    return list(by_plan.values())

  @functools.cache  # one set of arrays for every candidate
  def arrays():
    return (_random(0, q_shape, jnp.bfloat16),
            *(_random(1 + i, k_shape, jnp.bfloat16) for i in range(2)))

  def run_candidate(choices):
    call_plan = sm90_decode.plan(q_shape, k_shape, mask, choices=choices)

    @jax.jit
    def fn(q, k, v):
      return sm90_decode.forward(q, k, v, None, None, score=ScoreFunction(d ** -0.5), mask=mask,
                                 plan=call_plan)

    return fn, arrays()

  return _tune(problem, "decode", default, candidates, run_candidate,
               dataclasses.asdict, lambda c: device_tables.DecodeChoices(**c))
