"""User score and mask functions (`score_mod`, `mask_mod`), traced once.

FlexAttention's contract, which `fa4_jax.attention` takes:

    score_mod(score, batch, head, q_idx, kv_idx) -> score   (float32)
    mask_mod(batch, head, q_idx, kv_idx) -> bool            (True: attend)

Each is a JAX function of scalars: `score` float32, the indices int32. It
may close over arrays (ALiBi slopes, a bias table, per-batch data).

`trace` turns such a function into a `ModFunction`: its jaxpr over scalars,
with every array it closed over made an explicit input (`captured`). The
`ModFunction` is static (hashable by its jaxpr's text, so jit caches on it)
and the captured arrays travel beside the inputs as ordinary operands, so
every JAX transformation (`grad` to the captured arrays included) sees them.

One traced function runs on every backend:
* `evaluate` applies it elementwise to arrays (the XLA path), by `vmap`;
* `evaluate_in_kernel` applies it to a kernel's tile, the captured arrays
  being refs in GPU memory: a small interpreter of the jaxpr that binds each
  elementwise op on whole tiles (scalars broadcast), reads a captured array
  at indices that are the same for the whole tile (`slopes[head]`) with one
  scalar load, and one that varies per element (`table[head, bucket]`) by
  the kernel's loads, one per element (`bind`'s `loader`: the sm90
  kernels'), or else by a chain of selects over the entries of that axis
  (at most `MAX_SELECT_ENTRIES`); anything else is `Unsupported`, naming
  the op;
* `value_and_slope` is the modified score with its derivative in the score,
  which the backward needs (JAX differentiates the traced function);
* `affine_form` finds a score_mod of the form a * score + R(q_idx) +
  C(kv_idx) (ALiBi, a bias per key, a constant), which the sm90 kernels run
  without an op of its own per score (`mod_tiles.affine_logits`), by the same
  interpreter on a symbolic score.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

SCORE_MOD_ARGS = ("score", "batch", "head", "q_idx", "kv_idx")
MASK_MOD_ARGS = ("batch", "head", "q_idx", "kv_idx")
# An index into a captured array that varies per element is read by a chain
# of selects over that axis: two ops per entry and element.
MAX_SELECT_ENTRIES = 64

_INT = jax.ShapeDtypeStruct((), jnp.int32)
_F32 = jax.ShapeDtypeStruct((), jnp.float32)


class Unsupported(ValueError):
  """A traced function uses an op a kernel cannot run."""


@dataclasses.dataclass(frozen=True, eq=False)
class ModFunction:
  """A `score_mod` or `mask_mod`, traced over scalars.

  `jaxpr`'s inputs are the captured arrays (`captured_avals`) and then the
  function's own arguments; it has one output. Equal (and hashed) by its
  text, so the same function traced twice is one jit cache entry."""

  kind: str  # "score_mod" or "mask_mod"
  jaxpr: Any  # jax.extend.core.Jaxpr
  captured_avals: tuple
  text: str

  def __eq__(self, other):
    return isinstance(other, ModFunction) and (self.kind, self.text) == (other.kind, other.text)

  def __hash__(self):
    return hash((self.kind, self.text))

  @property
  def num_args(self) -> int:
    return len(SCORE_MOD_ARGS if self.kind == "score_mod" else MASK_MOD_ARGS)

  def primitives(self) -> set[str]:
    """Names of every primitive the function uses (nested jaxprs included)."""
    return _primitive_names(self.jaxpr)


def trace(fn: Callable, kind: str) -> tuple[ModFunction, tuple]:
  """(the traced function, the arrays it closed over) for a user's `fn`.

  Raises a ValueError naming `kind` for a wrong arity, a non-scalar result
  or a result of the wrong type."""
  names = SCORE_MOD_ARGS if kind == "score_mod" else MASK_MOD_ARGS
  if not callable(fn):
    raise ValueError(f"`{kind}` must be a function; got {type(fn).__name__}")
  _check_arity(fn, kind, names)
  avals = ([_F32] if kind == "score_mod" else []) + [_INT] * 4
  try:
    closed = jax.make_jaxpr(fn)(*avals)
  except Exception as e:  # noqa: BLE001  (the user's function failed to trace)
    raise ValueError(
        f"`{kind}` failed when called as {kind}({', '.join(names)}) with scalar arguments "
        f"(score float32, indices int32): {type(e).__name__}: {e}") from e
  out = closed.out_avals
  want = "a float score" if kind == "score_mod" else "a bool"
  if len(out) != 1 or out[0].shape != ():
    shapes = [a.shape for a in out]
    raise ValueError(
        f"`{kind}` must return {want} per element: called with scalars it returned shapes "
        f"{shapes}. It must be elementwise (no reductions, no output of its own shape).")
  dtype = out[0].dtype
  if kind == "mask_mod" and dtype != jnp.bool_:
    raise ValueError(f"`mask_mod` must return a bool (True: attend); it returned {dtype}")
  if kind == "score_mod" and not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"`score_mod` must return a float score; it returned {dtype}")
  jaxpr = closed.jaxpr
  captured = tuple(jnp.asarray(c) for c in closed.consts)
  # The closed-over values become the first inputs.
  open_jaxpr = jaxpr.replace(constvars=[], invars=list(jaxpr.constvars) + list(jaxpr.invars))
  captured_avals = tuple(jax.typeof(c) for c in captured)
  text = f"{captured_avals} {open_jaxpr}"
  return ModFunction(kind, open_jaxpr, captured_avals, text), captured


def _check_arity(fn, kind, names):
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):
    return  # builtins and the like: tracing will tell
  try:
    signature.bind(*names)
  except TypeError:
    raise ValueError(
        f"`{kind}` must take {len(names)} positional arguments ({', '.join(names)}); "
        f"its signature is {fn.__name__ if hasattr(fn, '__name__') else fn}{signature}") from None


def _primitive_names(jaxpr) -> set[str]:
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for sub in _subjaxprs(eqn):
      names |= _primitive_names(sub)
  return names


def _subjaxprs(eqn):
  for value in eqn.params.values():
    if isinstance(value, jex_core.ClosedJaxpr):
      yield value.jaxpr
    elif isinstance(value, jex_core.Jaxpr):
      yield value


def _call_jaxpr(eqn):
  """The jaxpr of a call-like equation (jit, custom_jvp_call, ...), or None."""
  for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    value = eqn.params.get(name)
    if isinstance(value, jex_core.ClosedJaxpr):
      return value
    if isinstance(value, jex_core.Jaxpr):
      return jex_core.ClosedJaxpr(value, ())
  return None


# --- On arrays (the XLA path) -------------------------------------------------


def evaluate(mod: ModFunction, captured, *args):
  """`mod` applied elementwise to `args` (arrays that broadcast together,
  scalars included): the result has their broadcast shape.

  One `vmap` per axis, each batching only the arguments that vary along it,
  rather than one `vmap` over every element: an argument that is the same
  along an axis (the head index along the queries and keys) stays unbatched
  there, so a read such as `slopes[head]` is one gather per head, not one
  per score, and its gradient (the transpose) one scatter-add per head after
  a sum. Flattened, that gradient was a scatter-add of every score into a
  few entries, which serializes on a GPU's atomics (on an H100, the XLA
  path's ALiBi backward at B2 S8192 H16 took 2.4 s)."""
  shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in args))
  args = [jnp.reshape(a, (1,) * (len(shape) - jnp.ndim(a)) + jnp.shape(a)) for a in args]
  run = lambda *xs: jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(mod.jaxpr, ()))(*captured, *xs)[0]

  def over_axes(*xs):
    if not xs[0].ndim:
      return run(*xs)
    varies = [x.shape[0] != 1 for x in xs]
    if not any(varies):  # an axis of size 1: nothing to batch
      return over_axes(*(x[0] for x in xs))[None]
    return jax.vmap(over_axes, in_axes=[0 if v else None for v in varies])(
        *(x if v else x[0] for x, v in zip(xs, varies)))

  return jnp.broadcast_to(over_axes(*args), shape)


# --- In a kernel ----------------------------------------------------------------
# Names of primitives bound on whole tiles as they are. Others need their
# own rule below or are Unsupported. Mosaic GPU lowers these elementwise
# (each cross-lowered for sm_90 on WGMMA-layout f32 and int32 tiles, jax
# 0.11.2): except `rem` on floats (no lowering: `_DTYPE_PROBLEMS`), `not`
# on bools and `floor` / `ceil` (no lowering: rewritten, `_REWRITES`).
# `log1p`, `expm1`, `pow`, `erf`, `is_finite`, `population_count` and more
# do not lower; `sin`, `cos`, `round` and `clz` do, but are left out until
# checked on hardware (approx_math).
ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "exp", "exp2", "log",
    "tanh", "logistic", "sqrt", "rsqrt", "integer_pow", "square", "select_n",
    "convert_element_type", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor",
    "rem", "clamp", "shift_left", "shift_right_logical", "shift_right_arithmetic", "floor",
    "ceil", "copy", "copy_p",
})
CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call",
                   "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "checkpoint"})
_VIEWS = frozenset({"dynamic_slice", "squeeze", "reshape", "expand_dims"})


def kernel_problem(mod: ModFunction) -> str | None:
  """Why a kernel cannot run `mod` (an op it cannot lower, or a captured
  array read in a way it cannot), or None. Decided before any kernel is
  traced: the function is also run abstractly on a tile, as a kernel runs it."""
  bad = sorted((mod.primitives() - ELEMENTWISE - CALLS - _VIEWS - {"broadcast_in_dim"})
               | _dtype_problems(mod.jaxpr))
  if bad:
    return (f"`{mod.kind}` uses {', '.join(repr(b) for b in bad)}, which the kernels cannot "
            "run on a tile; use implementation='xla' (or None, which falls back to it)")
  tile = jax.ShapeDtypeStruct((64, 128), jnp.int32)
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  args = [jax.ShapeDtypeStruct((64, 128), jnp.float32)] if mod.kind == "score_mod" else []
  args += [scalar, scalar, tile, tile]
  captured = [jax.eval_shape(kernel_operand, a) for a in mod.captured_avals]
  try:
    jax.eval_shape(lambda c, a: evaluate_in_kernel(mod, c, *a), captured, args)
  except Unsupported as e:
    return f"`{mod.kind}`: {e}"
  return None


# Allowed ops that Mosaic GPU does not lower for some operand types: the
# primitive's name -> (a test of its first operand's dtype, what to call it).
_DTYPE_PROBLEMS = {
    "rem": (lambda dtype: jnp.issubdtype(dtype, jnp.floating), "rem on floats (fmod, %)"),
}


def _dtype_problems(jaxpr) -> set[str]:
  found = set()
  for eqn in jaxpr.eqns:
    rule = _DTYPE_PROBLEMS.get(eqn.primitive.name)
    if rule is not None and eqn.invars and rule[0](eqn.invars[0].aval.dtype):
      found.add(rule[1])
    for sub in _subjaxprs(eqn):
      found |= _dtype_problems(sub)
  return found


@dataclasses.dataclass(frozen=True)
class _Captured:
  """A captured array in a kernel (a ref in GPU memory) being indexed: per
  axis of the ref, None while the axis is whole, else the index (a scalar,
  or a tile when it varies per element)."""

  ref: Any
  index: tuple
  dtype: Any = None  # the captured array's own (a bool array is int32 in GPU memory)
  # The kernel's per-element reads (`bind`'s `loader`), or None: a chain of selects.
  loader: Any = None
  # Every per-element index is known within its axis (`_int_ranges`): read unclamped.
  in_range: bool = False

  @property
  def loads_elements(self) -> bool:
    """Whether a per-element index into it is one load per element."""
    return self.loader is not None and jnp.dtype(self.ref.dtype).itemsize in (2, 4)

  @property
  def complete(self) -> bool:
    return all(i is not None for i in self.index)


def evaluate_in_kernel(mod: ModFunction, captured_refs, *args):
  """`mod` on a kernel's tile. `args` are the function's arguments: tiles of
  one shape (the score, q_idx, kv_idx) and scalars (batch, head: anything
  the same for the whole tile). `captured_refs`: the captured arrays as
  refs, in `mod.captured_avals`' order (`kernel_operand`). A kernel that
  calls it once per key block should `bind` the mod before its loop."""
  tile_args = list(args)
  batch, head = tile_args[-4], tile_args[-3]
  del tile_args[-4:-2]
  return bind(mod, captured_refs, batch, head)(*tile_args)


@dataclasses.dataclass(frozen=True)
class BoundMod:
  """`mod` bound to one tile's batch and head, with all it computes from
  them alone already done: the reads of captured arrays at those indices
  (`slopes[head]`, the entries of `table[head, :]` a per-element lookup
  chooses from) are loads from GPU memory, which a kernel does once before
  its loop over key blocks instead of once per block (`bind`). Called on the
  tile arguments: (score,) q_idx, kv_idx."""

  mod: ModFunction
  env: dict  # the values of the variables that do not vary per element
  varying: frozenset  # the variables that do
  rows: dict  # equation position -> (axis, entries) of a per-element lookup
  # Whether a captured array is read by the kernel's per-element loads
  # (`bind`'s `loader`) at an index that varies per element.
  loads: bool = False

  def __call__(self, *tile_args):
    """The function on a tile: `tile_args` are (score,) q_idx, kv_idx, each a
    tile or a vector `Along` one of its axes. The result is a tile, or a
    scalar where it depends on no tile argument."""
    env = self._evaluate(self._start(tile_args), self.varying)
    return _tile(_read_var(env, self.mod.jaxpr.outvars[0]))

  def _start(self, tile_args) -> dict:
    env = dict(self.env)
    for var, value in zip(_tile_vars(self.mod), tile_args):
      env[var] = value
    return env

  def _evaluate(self, env, which, affine: bool = False) -> dict:
    """`env` with the equations whose outputs are in `which` evaluated
    (`affine`: keeping the affine form, `_bind_affine`).

    With per-element loads (`loads`), and in the affine form, what the
    int32 ranges of the values decide is not computed per element
    (`_int_ranges`): a comparison known for every element is a constant, a
    select on a constant picks its case, and a lookup whose index is known
    within the table reads it unclamped (jnp's wrap of negative indices and
    the clamp of `dynamic_slice` after a user's `jnp.clip`: 5 ops per
    element). The wrap decided, `table[h, kv_idx]` stays a vector along
    the keys."""
    ranges = _int_ranges(self.mod, env) if self.loads or affine else {}
    for position, eqn in enumerate(self.mod.jaxpr.eqns):
      if eqn.outvars[0] not in which:
        continue  # done in `bind`, or left to the caller
      ins = [_read_var(env, v) for v in eqn.invars]
      decided = _decided(eqn, ins, ranges)
      if decided is not None:
        env[eqn.outvars[0]] = decided
        continue
      if position in self.rows:
        axis, entries, dtype = self.rows[position]
        outs = [_select_entry(entries, ins[1 + axis], dtype)]
      else:
        if _within(eqn, ins, ranges):
          ins[0] = dataclasses.replace(ins[0], in_range=True)
        outs = _bind(eqn, ins, affine)
      for var, value in zip(eqn.outvars, outs):
        env[var] = value
    return env

  def affine(self, q_idx, kv_idx) -> "_Affine | None":
    """The function on a tile with a symbolic score (`_Affine.score()`):
    its value as an `_Affine` holding the score, or None where it is not in
    the affine form ("The affine form of a score_mod"). `q_idx`, `kv_idx`:
    `Along` one axis of the tile each (`Positions` where they are a tile's
    positions)."""
    env = self._start((_Affine.score(), q_idx, kv_idx))
    try:
      out = _read_var(self._evaluate(env, self.varying, affine=True), self.mod.jaxpr.outvars[0])
    except _NeedsScoreTile:
      return None
    if not isinstance(out, _Affine) or _is_zero(out.factor):
      return None
    return out

  def affine_parts(self, q_idx, kv_idx, query_axis: int, rest_scale: float = 1.0):
    """(a, C, R) of a mod that `affine_form` found affine, on a tile whose
    queries lie along axis `query_axis`: a a scalar, C an `Along` the keys
    or None, R (with the mod's constant, times `rest_scale`) an `Along` the
    queries, a scalar or None (`_Affine.split`)."""
    form = self.affine(q_idx, kv_idx)
    if form is None:  # `affine_form` ran this very interpreter on these values
      raise AssertionError(f"a score_mod found affine is not on this tile: {self.mod.text}")
    return form.split(query_axis, rest_scale)

  def value_and_slope(self, score, q_idx, kv_idx):
    """(score_mod(score, ...), its derivative in `score`) on a tile.

    With per-element loads (`loads`), what does not depend on the score is
    evaluated first, outside the JVP: a load reads a ref, which JAX's JVP
    does not pass through (Mosaic GPU's inline code has no derivative rule),
    and it does not depend on the score anyway. A lookup at an index that
    does depend on it reads by the chain of selects."""
    if not self.loads:
      return jax.jvp(lambda s: self(s, q_idx, kv_idx), (score,), (jnp.ones_like(score),))
    # Whole equations (`_evaluate` runs a call whole, keyed by its first
    # output): a call that reads the score runs inside the JVP.
    on_score = _flows_from(self.mod.jaxpr, {_tile_vars(self.mod)[0]}, into_calls=False)
    env = self._evaluate(self._start((score, q_idx, kv_idx)), self.varying - on_score)
    env = {var: dataclasses.replace(value, loader=None) if isinstance(value, _Captured) else value
           for var, value in env.items()}

    def on(s):
      env[_tile_vars(self.mod)[0]] = s
      return _tile(_read_var(self._evaluate(env, on_score), self.mod.jaxpr.outvars[0]))

    return jax.jvp(on, (score,), (jnp.ones_like(score),))


def _read_var(env, var):
  return var.val if isinstance(var, jex_core.Literal) else env[var]


# --- int32 ranges of a mod's values ----------------------------------------------
# (lo, hi) of every int32 variable the analysis bounds (bools as 0 / 1);
# positions are >= 0 and, where the kernel says so, below `Along.bound`. A
# result that could leave int32 (and wrap) is left unbounded.

_I32 = (-2 ** 31, 2 ** 31 - 1)
_COMPARE = {"lt": lambda a, b: (a[1] < b[0], a[0] >= b[1]),
            "le": lambda a, b: (a[1] <= b[0], a[0] > b[1]),
            "gt": lambda a, b: (a[0] > b[1], a[1] <= b[0]),
            "ge": lambda a, b: (a[0] >= b[1], a[1] < b[0])}


def _int_ranges(mod: ModFunction, env) -> dict:
  """The ranges of `mod`'s int32 and bool variables, from its positions'."""
  known = {}
  for var in _tile_vars(mod)[-2:]:
    bound = getattr(env.get(var), "bound", None)
    known[var] = (0, _I32[1] if bound is None else bound - 1)
  return _ranges_of(mod.jaxpr, known)


def _ranges_of(jaxpr, known: dict) -> dict:
  known = dict(known)
  for eqn in jaxpr.eqns:
    ins = [_range_of(v, known) for v in eqn.invars]
    out = _range_rule(eqn, ins)
    if out is not None and len(eqn.outvars) == 1:
      known[eqn.outvars[0]] = out
  return known


def _range_of(var, known):
  if isinstance(var, jex_core.Literal):
    value = var.val
    if np.ndim(value) == 0 and np.asarray(value).dtype.kind in "biu":
      return (int(value), int(value))
    return None
  return known.get(var)


def _range_rule(eqn, ins):
  """(lo, hi) of `eqn`'s int32 or bool result, or None (unknown)."""
  name, dtype = eqn.primitive.name, eqn.outvars[0].aval.dtype
  if dtype == jnp.bool_ and name in _COMPARE and all(ins[:2]):
    true, false = _COMPARE[name](*ins[:2])
    return (1, 1) if true else (0, 0) if false else (0, 1)
  if dtype != jnp.int32:
    return None
  if name in CALLS:
    sub = _call_jaxpr(eqn)
    if sub is None or sub.consts:
      return None
    inner = _ranges_of(sub.jaxpr, {v: r for v, r in zip(sub.jaxpr.invars, ins) if r})
    out = _range_of(sub.jaxpr.outvars[0], inner)
    if out is None:
      return None
  elif name == "select_n" and ins[0] is not None and all(ins[1:]):
    which, cases = ins[0], ins[1:]
    if which[0] == which[1] and 0 <= which[0] < len(cases):
      cases = [cases[which[0]]]  # the predicate is known
    out = (min(c[0] for c in cases), max(c[1] for c in cases))
  elif name in ("convert_element_type", "copy", "copy_p") and ins[0]:
    out = ins[0]
  elif name in ("add", "sub", "max", "min") and all(ins):
    (a, b), (c, d) = ins
    out = {"add": (a + c, b + d), "sub": (a - d, b - c), "max": (max(a, c), max(b, d)),
           "min": (min(a, c), min(b, d))}[name]
  elif name == "clamp" and all(ins):  # clamp(lo, x, hi) rises with each of them
    (lo0, lo1), (a, b), (hi0, hi1) = ins
    out = (min(max(a, lo0), hi0), min(max(b, lo1), hi1))
  elif name == "max" and ins[0] or name == "max" and ins[1]:
    out = (max(r[0] for r in ins if r), _I32[1])
  elif name == "min" and ins[0] or name == "min" and ins[1]:
    out = (_I32[0], min(r[1] for r in ins if r))
  elif name == "clamp" and ins[0] and ins[2]:
    out = (min(ins[0][0], ins[2][0]), ins[2][1])
  else:
    return None
  return out if _I32[0] <= out[0] <= out[1] <= _I32[1] else None


def _within(eqn, ins, ranges) -> bool:
  """Whether `eqn` is a lookup into a captured array whose per-element
  indices are known within its axes."""
  if eqn.primitive.name != "dynamic_slice" or not isinstance(ins[0], _Captured) or not ranges:
    return False
  shape = ins[0].ref.shape
  for axis, (var, value) in enumerate(zip(eqn.invars[1:], ins[1:])):
    if isinstance(value, _STRUCTURED) or jnp.ndim(value) > 0:
      r = _range_of(var, ranges)
      if r is None or not 0 <= r[0] <= r[1] < shape[axis]:
        return False
  return True


def _decided(eqn, ins, ranges):
  """The value of `eqn` where the ranges decide it for every element (a
  comparison: a constant; a select on a constant: its case), else None."""
  if not ranges:
    return None
  name = eqn.primitive.name
  if name in _COMPARE:
    r = ranges.get(eqn.outvars[0])
    return None if r is None or r == (0, 1) else np.bool_(r[0])
  if name == "select_n" and isinstance(ins[0], np.bool_):
    return ins[1 + int(ins[0])]
  return None


def index_dependence(mod: ModFunction) -> tuple[bool, bool]:
  """(whether `mod`'s result may depend on its `batch` argument, whether on
  its `head` argument), by data flow through its jaxpr: a value computed
  from the index depends on it, a captured array's entry read at it too
  (`lengths[batch]`), and so does everything computed from such values.
  Into calls (`jit`, `custom_jvp_call`) the flow is followed through their
  own jaxprs; any other op with a jaxpr of its own (`cond`, `while`) counts
  each of its results as depending on every input. False is a proof: the
  result is the same whatever that index is."""
  own = mod.jaxpr.invars[len(mod.captured_avals):]
  batch, head = own[-4], own[-3]
  out = mod.jaxpr.outvars[0]
  depends = lambda var: not isinstance(out, jex_core.Literal) and out in _flows_from(
      mod.jaxpr, {var})
  return depends(batch), depends(head)


def _flows_from(jaxpr, sources, into_calls: bool = True) -> set:
  """The variables of `jaxpr` whose value may depend on those in `sources`
  (themselves included). `into_calls`: following calls into their jaxprs
  (an output counts only where its own flow reaches it); else every output
  of an equation that reads one of them counts, the call's too."""
  found = set(sources)
  for eqn in jaxpr.eqns:
    hit = [not isinstance(v, jex_core.Literal) and v in found for v in eqn.invars]
    if not any(hit):
      continue
    sub = _call_jaxpr(eqn) if into_calls and eqn.primitive.name in CALLS else None
    if sub is not None and len(sub.jaxpr.invars) == len(eqn.invars) and len(
        sub.jaxpr.outvars) == len(eqn.outvars):
      inner = _flows_from(sub.jaxpr, {v for v, h in zip(sub.jaxpr.invars, hit) if h})
      found.update(o for o, inner_out in zip(eqn.outvars, sub.jaxpr.outvars)
                   if not isinstance(inner_out, jex_core.Literal) and inner_out in inner)
    else:
      found.update(eqn.outvars)
  return found


def _tile_vars(mod: ModFunction):
  """The jaxpr's inputs that vary per element: (score,) q_idx, kv_idx."""
  own = mod.jaxpr.invars[len(mod.captured_avals):]
  return ([own[0]] if mod.kind == "score_mod" else []) + list(own[-2:])


def bind(mod: ModFunction, captured_refs, batch, head, *, loader=None) -> BoundMod:
  """`mod` with its batch and head fixed (scalars), evaluated as far as they
  alone allow; see `BoundMod`.

  `loader`: how the kernel reads a captured array at an index that varies
  per element, `loader(row, index, axis=None)` -> row[index] elementwise
  (`row` a 1-D view of the array along the looked-up axis, its other
  indices fixed; `index` a tile, or a vector along `axis` of one, within
  range): one load per element (`sm90_tiles.load_elements`). None: a chain
  of selects over the row's entries, loaded once here."""
  jaxpr = mod.jaxpr
  num_tile_args = 3 if mod.kind == "score_mod" else 2
  captured_vars = jaxpr.invars[:len(mod.captured_avals)]
  index_vars = jaxpr.invars[len(mod.captured_avals):]
  env = {}
  for var, ref, aval in zip(captured_vars, captured_refs, mod.captured_avals):
    if aval.shape == ():
      env[var] = _as_dtype(ref[0], aval.dtype)
    else:
      env[var] = _Captured(ref, (None,) * len(aval.shape), aval.dtype, loader)
  scalar_vars = index_vars[:-2] if num_tile_args == 2 else index_vars[1:-2]
  for var, value in zip(scalar_vars, (batch, head)):
    env[var] = value
  varying = set(_tile_vars(mod))
  read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]
  rows, loads = {}, False
  for position, eqn in enumerate(jaxpr.eqns):
    inputs_vary = [not isinstance(v, jex_core.Literal) and v in varying for v in eqn.invars]
    if any(inputs_vary):
      varying.update(eqn.outvars)
      ins = [None if vary else read(v) for v, vary in zip(eqn.invars, inputs_vary)]
      row = _hoisted_row(eqn, ins, inputs_vary)
      if row is not None:
        rows[position] = row
      loads = loads or isinstance(ins[0], _Captured) and ins[0].loads_elements
      continue
    for var, value in zip(eqn.outvars, _bind(eqn, [read(v) for v in eqn.invars])):
      env[var] = value
  return BoundMod(mod, env, frozenset(varying), rows, loads)


def bind_rows(mod: ModFunction, captured_refs, batch, heads, member) -> BoundMod:
  """`mod` bound for a tile whose rows hold several query heads (the decode
  arrangement's packed rows): row r holds head `heads[member[r]]`.
  `heads`: the distinct heads (scalars); `member`: an int32 `Along` the
  tile's rows, in [0, len(heads)).

  The mod is bound once per head (`bind`: what the head and the batch alone
  determine, the reads of captured arrays at that head included, done before
  the loop over key blocks as for a tile of one head), then every value
  that depends on the head and that the per-element part reads is merged
  into a vector along the rows (a chain of selects on `member`): `head`
  itself becomes the rows' heads, `slopes[head]` the rows' slopes, a
  per-element lookup's entries (`table[head, bucket]`) the rows' entries.
  Raises `Unsupported` where a value that depends on the head cannot be
  merged (a captured array indexed by the head and then read whole)."""
  bound = [bind(mod, captured_refs, batch, h) for h in heads]
  if len(bound) == 1:
    return bound[0]
  first = bound[0]
  jaxpr = mod.jaxpr
  index_vars = jaxpr.invars[len(mod.captured_avals):]
  dependent = _flows_from(jaxpr, {index_vars[-3]}, into_calls=False)  # on the head
  # The values the per-element part reads (and the result, where it is one):
  # of a hoisted lookup (`BoundMod.rows`) only its per-element index. They
  # are merged here, before the kernel's loop over key blocks: a vector made
  # inside one loop's trace would leak into the next.
  read = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
  for position, eqn in enumerate(jaxpr.eqns):
    if eqn.outvars[0] in first.varying:
      ins = eqn.invars
      if position in first.rows:
        ins = [ins[1 + first.rows[position][0]]]
      read |= {v for v in ins if not isinstance(v, jex_core.Literal)}
  env = dict(first.env)
  for var in read:
    if var in first.varying or var not in dependent or var not in first.env:
      continue
    values = [b.env[var] for b in bound]
    if isinstance(values[0], _Captured):
      raise Unsupported("a captured array indexed by the head and then read by a value of "
                        "each element; index it by single entries at once (table[head, i]) or "
                        "use implementation='xla'")
    env[var] = _merge_rows(values, member)
  rows = dict(first.rows)
  for position in rows:
    eqn = jaxpr.eqns[position]
    if any(not isinstance(v, jex_core.Literal) and v in dependent for v in eqn.invars):
      axis, entries, dtype = rows[position]
      merged = [_merge_rows([b.rows[position][1][e] for b in bound], member)
                for e in range(len(entries))]
      rows[position] = (axis, merged, dtype)
  return BoundMod(mod, env, first.varying, rows)


def _merge_rows(values, member: Along) -> Along:
  """One scalar per head (`bind_rows`) as a vector along the rows: row r
  gets values[member[r]] (bools as int32 0 / 1: `_BoolRows`). Made now,
  where the mod is bound."""
  values = [jnp.asarray(v) for v in values]
  kind = Along
  if values[0].dtype == jnp.bool_:
    values, kind = [v.astype(jnp.int32) for v in values], _BoolRows

  index = member.vector
  value = jnp.broadcast_to(values[0], index.shape)
  for g in range(1, len(values)):
    value = jnp.where(index == g, values[g], value)
  return kind(value, member.axis, member.shape)


@dataclasses.dataclass(frozen=True)
class AffineForm:
  """A score_mod whose value is a * x + R(q_idx) + C(kv_idx) on a tile
  (`affine_form`), as far as is known before a kernel is traced."""

  factor: float | None  # a where the mod's literals fix it; None: a value read per tile
  key_terms: bool  # C is there (else the logits need no op of the mod per score)


@functools.lru_cache(maxsize=256)
def affine_form(mod: ModFunction, decode_group: int | None = None) -> AffineForm | None:
  """`mod`'s `AffineForm` where it is a score_mod in the affine form (the
  comment "The affine form of a score_mod" below), else None. Decided on a tile as the
  kernels hold it: rows and columns of positions (`Positions`) of one
  (batch, head); with `decode_group` = G the decode arrangement's rows of
  G heads (`bind_rows`), whose positions are computed (a plain `Along`)."""
  if mod.kind != "score_mod":
    return None
  problem = kernel_problem(mod) if decode_group is None else packed_rows_problem(mod)
  if problem is not None:
    return None
  shape = (64, 128)
  found = []

  def run(captured, batch, head, q_origin, kv_origin):
    offsets = lambda axis: jnp.arange(shape[axis], dtype=jnp.int32)
    kv_idx = Positions(kv_origin, lambda: offsets(1), 1, shape)
    if decode_group is None:
      q_idx = Positions(q_origin, lambda: offsets(0), 0, shape)
      bound = bind(mod, captured, batch, head)
    else:
      q_idx = Along(q_origin + offsets(0), 0, shape)
      member = Along(offsets(0) % decode_group, 0, shape)
      bound = bind_rows(mod, captured, batch, [head + g for g in range(decode_group)], member)
    form = bound.affine(q_idx, kv_idx)
    found.append(None if form is None else AffineForm(
        factor=float(form.factor) if is_number(form.factor) else None,
        key_terms=form.terms[1] is not None))
    return jnp.int32(0)

  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  captured = [jax.eval_shape(kernel_operand, a) for a in mod.captured_avals]
  try:
    jax.eval_shape(run, captured, scalar, scalar, scalar, scalar)
  except Unsupported:
    return None
  return found[0]


def packed_rows_problem(mod: ModFunction) -> str | None:
  """Why a kernel cannot run `mod` on packed rows of several heads
  (`bind_rows`: the decode arrangement), or None; checked as
  `kernel_problem` checks a tile of one head, after it."""
  problem = kernel_problem(mod)
  if problem is not None:
    return problem
  shape = (64, 128)
  tile = jax.ShapeDtypeStruct(shape, jnp.int32)
  args = [jax.ShapeDtypeStruct(shape, jnp.float32)] if mod.kind == "score_mod" else []
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  member = jax.ShapeDtypeStruct((shape[0],), jnp.int32)
  captured = [jax.eval_shape(kernel_operand, a) for a in mod.captured_avals]

  def run(c, batch, heads, rows, a):
    bound = bind_rows(mod, c, batch, heads, Along(rows, 0, shape))
    return bound(*a)

  try:
    jax.eval_shape(run, captured, scalar, [scalar, scalar], member, args + [tile, tile])
  except Unsupported as e:
    return f"`{mod.kind}` on packed rows: {e}"
  return None


def _hoisted_row(eqn, ins, inputs_vary):
  """For a per-element lookup `table[i, j(q_idx, kv_idx)]` (a dynamic_slice
  of a captured array whose indices all but one are fixed per tile): (axis,
  the entries along it at the fixed indices, dtype), loaded now; else None."""
  if eqn.primitive.name != "dynamic_slice" or not isinstance(ins[0], _Captured):
    return None
  view = ins[0]
  if inputs_vary[0] or sum(inputs_vary[1:]) != 1 or any(i is not None for i in view.index):
    return None
  if view.loads_elements:
    return None  # read per element in the loop (`_read`)
  axis = inputs_vary[1:].index(True)
  entries = view.ref.shape[axis]
  if entries > MAX_SELECT_ENTRIES or any(size != 1 for size in eqn.params["slice_sizes"]):
    return None  # `_index_captured` says why, in the loop
  clamp = lambda i, a: jnp.clip(i, 0, view.ref.shape[a] - 1)
  fixed = [None if a == axis else clamp(i, a) for a, i in enumerate(ins[1:])]
  at = lambda e: tuple(e if a == axis else i for a, i in enumerate(fixed))
  return axis, [view.ref[at(e)] for e in range(entries)], view.dtype


def _select_entry(entries, index, dtype):
  """entries[index] per element of the tile `index` (clamped into range),
  by a chain of selects; on the vector alone where `index` is `Along` one
  axis (a thread holds fewer of its elements than of the tile's)."""
  if any(isinstance(e, Along) for e in entries):  # the rows' entries (`bind_rows`)
    if isinstance(index, Along) and index.axis == entries[0].axis:
      return index.with_vector(_select_entry([e.vector for e in entries], index.vector, dtype))
    entries = [_tile(e) for e in entries]
  elif isinstance(index, Along):
    return index.with_vector(_select_entry(entries, index.vector, dtype))
  index = jnp.clip(_tile(index), 0, len(entries) - 1)
  value = jnp.broadcast_to(entries[0], index.shape)
  for e in range(1, len(entries)):
    value = jnp.where(index == e, entries[e], value)
  return _as_dtype(value, dtype)


def kernel_operand(x):
  """A captured array as the kernels take it in GPU memory: a 0-d array as
  shape (1,), a bool array as int32 (`evaluate_in_kernel` reads it back as
  bool)."""
  x = jnp.asarray(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.int32)
  return x.reshape((1,)) if x.ndim == 0 else x


def _as_dtype(value, dtype):
  return value != 0 if dtype == jnp.bool_ and value.dtype != jnp.bool_ else value


def value_and_slope(mod: ModFunction, captured_refs, score, batch, head, q_idx, kv_idx):
  """(score_mod(score, ...), its derivative in `score`) on a kernel's tile."""
  return bind(mod, captured_refs, batch, head).value_and_slope(score, q_idx, kv_idx)


def _run(closed, args, affine: bool = False):
  env = {}
  read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]
  for var, value in zip(closed.jaxpr.constvars, closed.consts):
    env[var] = value
  for var, value in zip(closed.jaxpr.invars, args):
    env[var] = value
  for eqn in closed.jaxpr.eqns:
    outs = _bind(eqn, [read(v) for v in eqn.invars], affine)
    for var, value in zip(eqn.outvars, outs):
      env[var] = value
  return [read(v) for v in closed.jaxpr.outvars]


# --- Positions along one axis of a tile ----------------------------------------
# A kernel gives q_idx and kv_idx as vectors along the tile's rows or columns
# (`Along`), not as whole tiles: an op on values that vary along one axis
# alone (kv_idx < 1024, slopes[head] * q_idx) then runs on the vector, and the
# tile is formed only where an op needs it. `q_idx - kv_idx` stays a lazy
# `_Outer` until used, so that converting it to float converts the two
# vectors instead of every element (ALiBi's (q_idx - kv_idx).astype(float32)):
# an int-to-float conversion issues at a quarter of the FMA rate on Hopper,
# the rate of the softmax's exp2. Values are the same as on whole tiles: the
# ops are the same elementwise ops on the same values, and the conversion is
# rewritten only where it is exact (|values| below 2**24).

EXACT_FLOAT32_INTS = 2 ** 24


class Along:
  """A value of a tile of `shape` that varies along axis `axis` alone: its
  `vector` (in the layout of that axis of the tile's), broadcast only when
  an op needs the tile. `bound`: |value| < bound for every element where
  known (positions: the sequence's extent), else None.

  `vector` may be given as a function of no arguments that makes it: a
  kernel's positions are then traced only if the mod reads them (Mosaic GPU
  cannot infer the layout of an iota nothing uses)."""

  def __init__(self, vector, axis: int, shape: tuple, bound: int | None = None):
    self._vector, self.axis, self.shape, self.bound = vector, axis, tuple(shape), bound

  @property
  def vector(self):
    if callable(self._vector):
      self._vector = self._vector()
    return self._vector

  def tile(self):
    return lax.broadcast_in_dim(self.vector, self.shape, [self.axis])

  def with_vector(self, vector):
    """Another value along the same axis (its bound unknown)."""
    return Along(vector, self.axis, self.shape)

  @property
  def dtype(self):
    return self.vector.dtype


class Positions(Along):
  """A tile's positions along one axis: `origin` (an int32 scalar, its
  first position) plus `offsets` (0, 1, ... in the axis' layout: the same
  for every tile). Each is given as a value or a function of no arguments
  and made only if read; `vector` is origin + offsets. The affine form
  (`affine_form`) measures position differences from an origin, so that
  they stay as small as the tile is far from the diagonal.

  In the affine form an int32 or bool function of one axis' positions
  alone is `Positions` too (`_bind_positions`): `origin` its value at the
  axis' first position, `offsets` vector - origin (bools have no offsets).

  `align`: the origin is a multiple of it (a kernel's tiles start at
  multiples of their extents), where known; then a comparison with a
  multiple of it is the same for the whole tile (`_uniform_comparison`)."""

  def __init__(self, origin, offsets, axis: int, shape: tuple, bound: int | None = None,
               vector=None, align: int | None = None, dtype=jnp.int32):
    self._origin, self._offsets, self.align, self._dtype = origin, offsets, align, dtype
    super().__init__(vector or (lambda: self.origin + self.offsets), axis, shape, bound)

  @property
  def dtype(self):
    return jnp.dtype(self._dtype)  # known without tracing the vector

  @property
  def origin(self):
    if callable(self._origin):
      self._origin = self._origin()
    return self._origin

  @property
  def offsets(self):
    if callable(self._offsets):
      self._offsets = self._offsets()
    return self._offsets

  def shifted(self, delta) -> "Positions":
    """These positions plus `delta` (an int32 scalar)."""
    return Positions(lambda: self.origin + delta, lambda: self.offsets, self.axis, self.shape,
                     self.bound, vector=lambda: self.vector + delta)

  def tile(self):
    if self.dtype != jnp.bool_:
      return super().tile()
    # Mosaic GPU broadcasts no bool vector (its i1 registers): as `_BoolRows`.
    ones = jnp.where(self.vector, jnp.int32(1), jnp.int32(0))
    return lax.broadcast_in_dim(ones, self.shape, [self.axis]) != 0


class _BoolRows(Along):
  """A bool per row (`_merge_rows`), held as an int32 vector of 0 / 1
  (Mosaic GPU broadcasts no bool vector): a bool tile where an op needs the
  tile; ops on the vector read 0 / 1 as a bool would (`select_n` takes an
  int32 predicate, a conversion gives 0 / 1)."""

  def tile(self):
    return super().tile() != 0


@dataclasses.dataclass(frozen=True)
class _Outer:
  """`op(left, right)` (add or sub) of two values `Along` different axes, not yet
  formed on the tile."""

  left: Along
  right: Along
  name: str

  def tile(self):
    op = lax.add if self.name == "add" else lax.sub
    return op(self.left.tile(), self.right.tile())


def _tile(x):
  """A value of the interpreter as a tile (or a scalar as it is)."""
  return x.tile() if isinstance(x, _STRUCTURED) else x


_NUMBERS = (jnp.int32, jnp.float32)


def _bind_structured(eqn, ins):
  """The result of an elementwise op with `Along` / `_Outer` inputs, kept
  structured where that is cheaper and exact; None: bind it on tiles."""
  name = eqn.primitive.name
  out_dtype = eqn.outvars[0].aval.dtype
  if name not in ELEMENTWISE or name in _REWRITES or out_dtype not in _NUMBERS:
    return None  # (bool vectors are not broadcast: Mosaic GPU's i1 registers)
  if name == "convert_element_type" and isinstance(ins[0], _Outer):
    outer = ins[0]
    bounds = (outer.left.bound, outer.right.bound)
    if (outer.left.dtype == jnp.int32 and out_dtype == jnp.float32 and None not in bounds
        and sum(bounds) <= EXACT_FLOAT32_INTS):
      # float(a - b) == float(a) - float(b): every value and the result are
      # integers below 2**24, exact in float32.
      return _Outer(_to_float(outer.left), _to_float(outer.right), outer.name)
    return None
  if (name == "convert_element_type" and isinstance(ins[0], Along)
      and ins[0].dtype == jnp.int32 and out_dtype == jnp.float32):
    return _to_float(ins[0])
  structured = [x for x in ins if isinstance(x, (Along, _Outer))]
  if any(isinstance(x, _Outer) for x in structured):
    return None
  if any(jnp.ndim(x) for x in ins if not isinstance(x, Along)):
    return None  # a tile among the inputs
  axes = {x.axis for x in structured}
  if len(axes) == 1:
    vectors = [x.vector if isinstance(x, Along) else x for x in ins]
    out = eqn.primitive.bind(*_broadcast_all(vectors), **eqn.params)
    return structured[0].with_vector(out)
  if name in ("add", "sub") and len(ins) == 2 and all(isinstance(x, Along) for x in ins):
    return _Outer(ins[0], ins[1], name)
  return None


def _to_float(x: Along) -> Along:
  """float32(x) of an int32 vector."""
  return x.with_vector(x.vector.astype(jnp.float32))


def _broadcast_all(xs):
  shape = max((jnp.shape(x) for x in xs), key=len, default=())
  return [x if jnp.shape(x) == shape else jnp.broadcast_to(jnp.asarray(x), shape) for x in xs]


# --- The affine form of a score_mod ---------------------------------------------
# Most score_mods add to the score what depends on the query alone and what
# depends on the key alone:
#
#     score_mod(x, b, h, q_idx, kv_idx) = a * x + R(q_idx) + C(kv_idx)
#
# with a the same for a whole tile (usually 1): ALiBi (x - slopes[h] *
# (q_idx - kv_idx)), a bias per key (x + table[h, kv_idx]), a constant
# (x + 0.5), a row bias (2 * x + bias[q_idx]). A kernel then runs no op of
# the mod per score: s * (scale * a) + C is one FMA (C a vector along the
# keys), and R, a vector along the queries, joins the softmax's statistics
# of each row, one op per row (`mod_tiles.affine_logits`). `affine_form`
# decides it before a kernel is traced, by running this interpreter on a
# symbolic score (`_Affine.score()`) and `Positions` along the tile's axes:
# sums and differences of such values, and their products and quotients by
# values the same for the whole tile, stay `_Affine`; an op that would need
# the score on the tile means the mod is evaluated as it always is.
#
# Rounding. Distributing slope * (q - k) into slope * q - slope * k would
# cancel: with q and k near 100000 each product is off by up to
# ulp(50000) / 2 = 0.002 at slope 0.5. So an int32 difference of positions
# converted to float is split at an origin (`_relative_difference`): with
# the key positions k = k0 + j (j below the tile's width w), q - k =
# (q - k0) - j, two exact integers (below 2**24), |q - k0| <= |q - k| + w.
# Each term is then rounded once by a product (the slope), and their sum
# once more in the kernel: the logit is within a few float32 roundings
# (2**-24 relative) of |a x| + |slope| (|q - k| + 2 w) of the exact one, as
# today's whole-tile evaluation is of |a x| + |slope| |q - k|: the same
# within a few tile widths of the diagonal and beyond (test_affine_mods
# checks 4 roundings at positions near 2**17).


class _NeedsScoreTile(Exception):
  """An op needs the symbolic score on a tile: the mod is not affine."""


def is_number(x) -> bool:
  """A Python or NumPy number: a value the mod's text fixes (a literal),
  known before a kernel is traced."""
  return isinstance(x, (int, float, np.number)) or (isinstance(x, np.ndarray) and x.ndim == 0)


def _is_zero(x) -> bool:
  return is_number(x) and float(x) == 0.0


def _scalar_mul(a, b):
  """a * b of two scalars: numbers stay Python floats, a factor 1 is no op
  and a factor 0 a number (a term the value does not have)."""
  if is_number(a) and is_number(b):
    return float(a) * float(b)
  if _is_zero(a) or _is_zero(b):
    return 0.0
  if is_number(a) and float(a) == 1.0:
    return b
  if is_number(b) and float(b) == 1.0:
    return a
  return jnp.multiply(a, b)


def _scalar_add(a, b):
  if is_number(a) and is_number(b):
    return float(a) + float(b)
  if _is_zero(a):
    return b
  return a if _is_zero(b) else jnp.add(a, b)


def _scalar_div(a, b):
  if is_number(a) and is_number(b):
    return float(a) / float(b)
  return a if is_number(b) and float(b) == 1.0 else jnp.divide(a, b)


@dataclasses.dataclass(frozen=True)
class _Term:
  """`coef * along`: a float value along one axis of the tile whose scalar
  factor is applied when it is read (`value`), so that factors applied to it
  (a slope, a sign) are scalar ops."""

  coef: Any
  along: Along

  def times(self, k) -> "_Term":
    return _Term(_scalar_mul(self.coef, k), self.along)

  def divided(self, k) -> "_Term":
    return _Term(_scalar_div(self.coef, k), self.along)

  def value(self) -> Along:
    if is_number(self.coef) and float(self.coef) in (1.0, -1.0):
      return self.along if float(self.coef) == 1.0 else self.along.with_vector(-self.along.vector)
    return self.along.with_vector(self.along.vector * self.coef)


def _add_terms(a: _Term | None, b: _Term | None, sign: float) -> _Term | None:
  """a + sign * b of two terms along one axis (sign: 1 or -1)."""
  if b is None:
    return a
  if a is None:
    return b.times(sign)
  va, vb = a.value(), b.value()
  return _Term(1.0, va.with_vector(va.vector + vb.vector if sign > 0 else va.vector - vb.vector))


@dataclasses.dataclass(frozen=True)
class _Affine:
  """factor * score + terms[0] + terms[1] + const, not formed on the tile:
  a value of the affine form (the comment above). `factor` and `const` are
  scalars (numbers where the mod's literals fix them); terms[axis] is a
  `_Term` along that axis of the tile, or None."""

  factor: Any = 0.0
  terms: tuple = (None, None)
  const: Any = 0.0

  @classmethod
  def score(cls) -> "_Affine":
    return cls(factor=1.0)

  @classmethod
  def of(cls, x) -> "_Affine":
    """`x` (an `_Affine`, a float `Along` or a scalar) as an `_Affine`."""
    if isinstance(x, _Affine):
      return x
    if isinstance(x, Along):
      terms = [None, None]
      terms[x.axis] = _Term(1.0, x)
      return cls(terms=tuple(terms))
    return cls(const=x)

  def plus(self, other, sign: float = 1.0) -> "_Affine":
    """self + sign * other (sign: 1 or -1)."""
    other = _Affine.of(other)
    return _Affine(_scalar_add(self.factor, _scalar_mul(sign, other.factor)),
                   tuple(_add_terms(a, b, sign) for a, b in zip(self.terms, other.terms)),
                   _scalar_add(self.const, _scalar_mul(sign, other.const)))

  def times(self, k) -> "_Affine":
    return _Affine(_scalar_mul(self.factor, k), tuple(t and t.times(k) for t in self.terms),
                   _scalar_mul(self.const, k))

  def divided(self, k) -> "_Affine":
    return _Affine(_scalar_div(self.factor, k), tuple(t and t.divided(k) for t in self.terms),
                   _scalar_div(self.const, k))

  def tile(self):
    """The value on the tile, where it holds no score (else `_NeedsScoreTile`)."""
    if not _is_zero(self.factor):
      raise _NeedsScoreTile()
    parts = [t.value().tile() for t in self.terms if t is not None]
    if not parts:
      return self.const
    value = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    return value if _is_zero(self.const) else value + self.const

  def split(self, query_axis: int, rest_scale: float = 1.0):
    """(factor, the term along the keys (an `Along`) or None, the rest: the
    term along the queries plus the constant (an `Along`, a scalar) or
    None, times `rest_scale`), with the queries along tile axis
    `query_axis`. (The rest's scale joins its coefficient: no op on the
    vector.)"""
    key, query = self.terms[1 - query_axis], self.terms[query_axis]
    rest = None if query is None else query.times(rest_scale).value()
    const = _scalar_mul(self.const, rest_scale)
    if not _is_zero(const):
      rest = const if rest is None else rest.with_vector(rest.vector + const)
    return self.factor, None if key is None else key.value(), rest


# The interpreter's values that stand for a tile without being one.
_STRUCTURED = (Along, _Outer, _Affine)


def _relative_difference(outer: _Outer) -> _Affine | None:
  """float(outer) of an int32 `_Outer` with `Positions` on one side at
  least, as the two terms of an `_Affine` measured from their origin (the
  comment above: rounding); None without positions. The origin is the
  columns' where they are `Positions`: their term is then their offsets,
  the same for every tile, and the rows, of which a thread holds few (two
  of a WGMMA tile's 64, against 32 of its 128 columns), take the
  difference of origins."""
  sides = {outer.left.axis: outer.left, outer.right.axis: outer.right}
  ref = next((sides[a] for a in (1, 0) if isinstance(sides[a], Positions)), None)
  if ref is None:
    return None
  other = sides[1 - ref.axis]
  ref_sign = -1.0 if outer.name == "sub" and ref is outer.right else 1.0
  other_sign = -1.0 if outer.name == "sub" and other is outer.right else 1.0
  # left op right = ref_sign * offsets + other_sign * (other + ref_sign * other_sign * origin)
  if isinstance(other, Positions):
    start = other.origin + ref.origin if ref_sign == other_sign else other.origin - ref.origin
    moved = start + other.offsets
  else:
    moved = other.vector + ref.origin if ref_sign == other_sign else other.vector - ref.origin
  terms = [None, None]
  terms[ref.axis] = _Term(ref_sign, _to_float(ref.with_vector(ref.offsets)))
  terms[other.axis] = _Term(other_sign, _to_float(other.with_vector(moved)))
  return _Affine(terms=tuple(terms))


def _is_scalar(x) -> bool:
  return not isinstance(x, _STRUCTURED) and jnp.ndim(x) == 0


def _bind_positions(eqn, ins):
  """An int32 or bool elementwise op on `Positions` of one axis and scalars,
  as `Positions` again (the affine form only), else None.

  Why: `context_parallel_attention` rewrites a mod's positions per ring step
  (`context_parallel._at_global_positions`): local `i` is global
  `i + select(i < chunk, first, second - chunk)`. On whole tiles that is
  several ops per score, and the positions lose their origin, so ALiBi is no
  longer affine. Kept along its axis, each op runs on the axis' vector, and
  its value at the axis' first position (an op on the origins) is the new
  origin: a difference of such positions is split at it as before
  (`_relative_difference`). In a tile that does not straddle the chunk
  boundary the shift is the same for every position, so the offsets are the
  tile's own (0, 1, ...) and the rounding is that of plain positions; in one
  that straddles it (chunk not a multiple of the kernel's tile) the values
  are still exact integers, but the offsets jump by the distance between the
  chunks, and the terms are rounded as large as that."""
  name, out_dtype = eqn.primitive.name, eqn.outvars[0].aval.dtype
  if name not in ELEMENTWISE or name in _REWRITES or out_dtype not in (jnp.int32, jnp.bool_):
    return None
  positions = [x for x in ins if isinstance(x, Positions)]
  if (not positions or len({p.axis for p in positions}) > 1
      or not all(isinstance(x, Positions) or _is_scalar(x) for x in ins)):
    return None
  uniform = _uniform_comparison(eqn, ins)
  if uniform is not None:
    return uniform
  first = positions[0]
  if name in ("add", "sub") and positions == [ins[0]] and out_dtype == jnp.int32:
    return first.shifted(ins[1] if name == "add" else -ins[1])  # the offsets stay
  if name == "add" and positions == [ins[1]]:
    return first.shifted(ins[0])
  on = lambda part: eqn.primitive.bind(
      *_broadcast_all([part(x) if isinstance(x, Positions) else x for x in ins]), **eqn.params)
  out = Positions(lambda: on(lambda p: p.origin), lambda: out.vector - out.origin,
                  first.axis, first.shape, vector=lambda: on(lambda p: p.vector),
                  dtype=out_dtype)
  return out


def _affine_operand(x) -> bool:
  """Whether `x` may join an `_Affine` by a sum: an `_Affine`, a float
  `Along` or a scalar (a float `_Outer` may not: formed from large positions
  without an origin, its two vectors would cancel)."""
  return (isinstance(x, _Affine) or isinstance(x, Along) and x.dtype == jnp.float32
          or _is_scalar(x))


def _uniform_comparison(eqn, ins):
  """`p < c` (>=, or c > p, c <= p) of `Positions` p whose origin is a
  multiple of `p.align`, no fewer than the tile's extent, and a literal c
  that is a multiple of it too: the tile's positions lie in [origin, origin
  + align), which c does not cut, so every one compares as the origin does:
  a scalar (else None). In a ring step (`_bind_positions`) the chunk
  boundary is such a c when the chunk is a multiple of the kernel's tile:
  the shift is then a scalar, and the positions keep their offsets, with no
  op on the vector."""
  name = eqn.primitive.name
  if name not in ("lt", "ge", "gt", "le") or len(ins) != 2:
    return None
  p, c = ins if name in ("lt", "ge") else ins[::-1]
  if not isinstance(p, Positions) or p.align is None or not is_number(c):
    return None
  if p.shape[p.axis] > p.align or int(c) % p.align != 0:
    return None
  return eqn.primitive.bind(*[p.origin if x is p else x for x in ins], **eqn.params)


def _bind_affine(eqn, ins):
  """The result of an op in the affine form (`_Affine`) where it stays in
  it, else None: sums and differences with float vectors and scalars, a
  product or quotient by a scalar, a negation, an int32 difference of
  positions converted to float."""
  name, x = eqn.primitive.name, ins[0]
  if eqn.outvars[0].aval.dtype != jnp.float32:
    return None
  if name == "convert_element_type" and isinstance(x, _Outer) and x.left.dtype == jnp.int32:
    return _relative_difference(x)
  if name in ("convert_element_type", "copy", "copy_p"):
    return x if isinstance(x, _Affine) else None
  if name == "neg":
    return x.times(-1.0) if isinstance(x, _Affine) else None
  if name in ("add", "sub") and all(_affine_operand(v) for v in ins):
    new = any(isinstance(v, _Affine) for v in ins)
    two_axes = all(isinstance(v, Along) for v in ins) and ins[0].axis != ins[1].axis
    if new or two_axes:
      return _Affine.of(x).plus(ins[1], -1.0 if name == "sub" else 1.0)
    return None
  if name == "mul":
    a, b = ins if isinstance(x, _Affine) else ins[::-1]
    return a.times(b) if isinstance(a, _Affine) and _is_scalar(b) else None
  if name == "div" and isinstance(x, _Affine) and _is_scalar(ins[1]) and not _is_zero(ins[1]):
    return x.divided(ins[1])
  return None


# Ops that only reshape a one-element value: each value here stands for one
# element, so they change nothing.
_SHAPE_ONLY = frozenset({"squeeze", "reshape", "broadcast_in_dim", "expand_dims"})


def _bind(eqn, ins, affine: bool = False):
  """The outputs of `eqn` on the interpreter's values `ins`; `affine`:
  keeping the affine form where it can (`_bind_affine`)."""
  name = eqn.primitive.name
  if isinstance(ins[0] if ins else None, _Captured):
    # Indices as they are where the kernel loads per element (a vector stays one).
    index = ins[1:] if ins[0].loads_elements else map(_tile, ins[1:])
    return [_index_captured(eqn, [ins[0], *index])]
  if any(isinstance(x, _Captured) for x in ins):
    raise Unsupported(f"a captured array is used whole by {name!r}; the kernels read captured "
                      "arrays only by indexing them (e.g. slopes[head]): use "
                      "implementation='xla'")
  if name in CALLS:
    sub = _call_jaxpr(eqn)
    if sub is None:
      raise Unsupported(f"the kernels cannot run {name!r} in a `score_mod` or `mask_mod`; "
                        "use implementation='xla'")
    return _run(sub, ins, affine)
  if name in _SHAPE_ONLY and math.prod(eqn.outvars[0].aval.shape) == 1:
    return [ins[0]]
  if any(isinstance(x, _STRUCTURED) for x in ins):
    out = None
    if affine:
      out = _bind_positions(eqn, ins)
      out = _bind_affine(eqn, ins) if out is None else out
    if out is None and not any(isinstance(x, _Affine) for x in ins):
      out = _bind_structured(eqn, ins)
    if out is not None:
      return [out]
    ins = [_tile(x) for x in ins]
  if name not in ELEMENTWISE:
    raise Unsupported(f"the kernels cannot run {name!r} in a `score_mod` or `mask_mod`; "
                      "use implementation='xla'")
  shape = max((jnp.shape(x) for x in ins), key=len, default=())
  ins = [x if jnp.shape(x) == shape else jnp.broadcast_to(jnp.asarray(x), shape) for x in ins]
  rewrite = _REWRITES.get(name)
  if rewrite is not None and jnp.ndim(ins[0]) > 0:
    out = rewrite(*ins)
    if out is not None:
      return [out]
  out = eqn.primitive.bind(*ins, **eqn.params)
  return out if eqn.primitive.multiple_results else [out]


def _not(x):
  """`not` of a bool tile as x == False: Mosaic GPU fails to lower a bool
  `not` ("register bitwidth ... divisible by 8"); integers bind it as is."""
  if x.dtype != jnp.bool_:
    return None
  return lax.eq(x, jnp.broadcast_to(jnp.asarray(False), x.shape))


# Floats from 2**23 on (and inf, nan) are whole already; below, the int32
# conversion truncates toward zero.
_WHOLE_FROM = 2.0 ** 23


def _rounded(x, up: bool):
  """floor (ceil with `up`) of a float tile through an int32 conversion:
  Mosaic GPU lowers no `floor` / `ceil`."""
  t = x.astype(jnp.int32).astype(x.dtype)
  one = jnp.broadcast_to(jnp.asarray(1.0, x.dtype), x.shape)
  rounded = jnp.where(t < x, t + one, t) if up else jnp.where(t > x, t - one, t)
  return jnp.where(jnp.abs(x) < _WHOLE_FROM, rounded, x)


# Tile rules for allowed ops Mosaic GPU does not lower as they are; a rule
# returning None binds the op itself.
_REWRITES = {
    "not": _not,
    "floor": lambda x: _rounded(x, up=False),
    "ceil": lambda x: _rounded(x, up=True),
}


def _index_captured(eqn, ins):
  """An op on a captured array: `dynamic_slice` of single entries fixes
  axes; once every axis is fixed the entry is read. A unit-axis reshape
  changes nothing."""
  x, name = ins[0], eqn.primitive.name
  if name in _SHAPE_ONLY:
    if eqn.outvars[0].aval.shape == () and not x.complete:
      # A one-entry axis left whole and squeezed away (jnp indexes an axis of
      # one entry, `slopes[head]` of one head, without a dynamic_slice).
      return _read(dataclasses.replace(x, index=tuple(0 if i is None else i for i in x.index)))
    return x
  if name != "dynamic_slice":
    raise Unsupported(f"a captured array is used by {name!r}, which the kernels cannot run; "
                      "index captured arrays by single entries (e.g. table[head, bucket]) or "
                      "use implementation='xla'")
  index = list(x.index)
  for axis, (start, size) in enumerate(zip(ins[1:], eqn.params["slice_sizes"])):
    if size != x.ref.shape[axis] or index[axis] is not None:
      if size != 1:
        raise Unsupported("the kernels read captured arrays an entry at a time; a slice of "
                          f"{size} entries needs implementation='xla'")
      index[axis] = start  # dynamic_slice clamps: so does the read below
  view = dataclasses.replace(x, index=tuple(index))
  return _read(view) if view.complete else view


def _load_elements(view: _Captured, axis: int):
  """The entries of `view` (fully indexed, per element along `axis` alone)
  by the kernel's per-element loads, on the vector where the index is
  `Along` one axis of the tile."""
  ref = view.ref
  clamp = lambda i, a: jnp.clip(i, 0, ref.shape[a] - 1)
  row = ref.at[tuple(slice(None) if a == axis else clamp(i, a)
                     for a, i in enumerate(view.index))]
  index = view.index[axis]
  clamp_index = (lambda i: i) if view.in_range else (lambda i: clamp(i, axis))
  if isinstance(index, Along):
    vector = clamp_index(index.vector)
    return index.with_vector(_as_dtype(view.loader(row, vector, index.axis), view.dtype))
  return _as_dtype(view.loader(row, clamp_index(_tile(index))), view.dtype)


def _read(view: _Captured):
  """The entry of a fully indexed captured array: one scalar load where the
  indices are the same for the whole tile; where one axis' index varies per
  element, the kernel's per-element loads (`bind`'s `loader`), else a chain
  of selects over that axis."""
  ref = view.ref
  per_element = [a for a, i in enumerate(view.index)
                 if isinstance(i, _STRUCTURED) or jnp.ndim(i) > 0]
  clamp = lambda i, a: jnp.clip(i, 0, ref.shape[a] - 1)
  if len(per_element) == 1 and view.loads_elements:
    return _load_elements(view, per_element[0])
  view = dataclasses.replace(view, index=tuple(map(_tile, view.index)))
  if not per_element:
    return _as_dtype(ref[tuple(clamp(i, a) for a, i in enumerate(view.index))], view.dtype)
  if len(per_element) > 1:
    raise Unsupported("a captured array indexed per element along two axes; the kernels "
                      "take one such axis: use implementation='xla'")
  axis = per_element[0]
  entries = ref.shape[axis]
  if entries > MAX_SELECT_ENTRIES:
    raise Unsupported(f"a captured axis of {entries} entries indexed per element; the kernels "
                      f"take at most {MAX_SELECT_ENTRIES}: use implementation='xla'")
  tile_index = clamp(view.index[axis], axis)
  at = lambda e: tuple(e if a == axis else clamp(i, a) for a, i in enumerate(view.index))
  value = jnp.broadcast_to(ref[at(0)], tile_index.shape)
  for e in range(1, entries):
    value = jnp.where(tile_index == e, ref[at(e)], value)
  return _as_dtype(value, view.dtype)
