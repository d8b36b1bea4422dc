"""Which implementation serves a call, and why.

`select()` is the one place that maps `implementation=` plus the arguments and
the device onto a `Backend`:

* `None`: the Mosaic GPU kernel for this GPU when it supports the arguments,
  else the XLA path. It never raises for lack of a kernel.
* `"xla"`: the XLA path, on any device.
* `"sm90"` / `"sm100"`: that kernel, or a `ValueError` saying why it cannot
  serve the call. On a machine without that GPU it runs only inside
  `fa4_jax.interpret_mode()`, and lowers (for export) inside
  `fa4_jax.gpu_target(...)`.

"The device" is the target of `fa4_jax.gpu_target` while one is active, else
the default device (`fa4_jax.kernels.default_device`). Under a target, a
kernel backend stages out its kernel for CUDA and the XLA path for every
other platform (`_portable`), so one function exported for `("cuda", "cpu")`
carries both; without one, the kernel alone (`_cuda_only`).

Where the sm90 kernels serve a short query (T x G packed rows up to
`sm90_decode.MAX_PACKED_ROWS`) without a band mask or causal bottom-right
(decode against a KV cache, speculative decoding's few new tokens), they
run in the decode arrangement of `fa4_jax.kernels.sm90_decode` (query heads
packed as rows, the cache split into chunks): the backend is then named
"sm90_decode" (what `which_implementation` reports); its backward is the
sm90 backward. A `score_mod` / `mask_mod` runs there too where the kernel
can run it on rows of several heads (`mod_functions.packed_rows_problem`),
else in the forward kernel as it is. Other bands (windows, top-left causal) and longer queries
run the forward kernel as it is.

Kernels without a fused backward of their own use the XLA backward, which
consumes the kernel's log-sum-exp. A kernel module lists the optional
arguments it takes in `FEATURES` ("sinks", "score_function", "mods", "fp8",
"value_head_dim"): without
"sinks" the sinks are added after its forward (`scores.add_sinks`); without
a feature the call's score value needs (`Scores.kernel_features`: modified
logits, a `score_mod` / `mask_mod`) the forward cannot serve the call, and
the backward leaves it to XLA. Every kernel takes the call's score function
(`Scores.score_function`: scale, soft-cap); a module with "mods" is given
the whole score value (`mods=`) where the call has them.
Without "fp8" a call with float8 operands runs on the XLA path; without
"value_head_dim" one whose value head dim differs from the query's does
(a backward without it, or one whose `check_value_head_dim` rejects the
pair: the backward kernels with the head dims zero-padded to one,
`_one_head_dim`).
The gradients of a score_mod's captured arrays come from the XLA backward
where a kernel's backward does not compute them (`_captured_grads`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax.numpy as jnp

from fa4_jax import interpret, mod_functions, per_platform, scores, target, xla_attention
from fa4_jax.kernels import KernelUnsupported, default_device
from fa4_jax.scores import MaskSpec, Scores
from fa4_jax.validation import PagedArguments, PagedStatic
from fa4_jax.vjp import Backend

KERNEL_IMPLEMENTATIONS = ("sm90", "sm100")
IMPLEMENTATIONS = ("xla",) + KERNEL_IMPLEMENTATIONS

# Compute capability major version each kernel was written for.
_KERNEL_ARCH_MAJOR = {"sm90": 9, "sm100": 10}
_ARCH_NAMES = {"sm90": "Hopper (compute capability 9.x)",
               "sm100": "Blackwell (compute capability 10.x)"}


@dataclasses.dataclass(frozen=True)
class CallInfo:
  """What the selection looks at, taken from the validated arguments."""

  q_shape: tuple[int, ...]
  k_shape: tuple[int, ...]
  dtype: object
  spec: MaskSpec
  has_bias: bool
  has_mask: bool
  # What a kernel must offer for the call's scores (`Scores.kernel_features`).
  kernel_features: frozenset[str] = frozenset()
  has_segment_ids: bool = False
  score_mod: object = None  # mod_functions.ModFunction
  mask_mod: object = None
  has_fp8: bool = False  # float8 operands (a float8 query, or a float8 K/V cache)
  v_head_dim: int | None = None  # the value's head dim where it differs from q's and k's
  values_from_keys: bool = False  # `value=None`: v is k's first v_head_dim features (MLA)

  @property
  def has_mods(self) -> bool:
    return self.score_mod is not None or self.mask_mod is not None

  @classmethod
  def of(cls, q, k, bias, mask, scores_: Scores, v=None, values_from_keys=False) -> "CallInfo":
    v_head_dim = None if v is None or v.shape[-1] == q.shape[-1] else v.shape[-1]
    return cls(q_shape=q.shape, k_shape=k.shape, dtype=q.dtype, spec=scores_.mask,
               v_head_dim=v_head_dim, values_from_keys=bool(values_from_keys),
               has_bias=bias is not None, has_mask=mask is not None,
               kernel_features=scores_.kernel_features(),
               has_segment_ids=scores_.q_segment_ids is not None,
               score_mod=scores_.score_mod, mask_mod=scores_.mask_mod,
               has_fp8=scores_.has_fp8)


def _xla_backward(q, k, v, bias, mask, scores_: Scores, out, lse, dout, *,
                  deterministic: bool = True):
  """The XLA backward as a backend's (`deterministic` changes nothing: its
  sums have a fixed order)."""
  del deterministic
  return xla_attention.backward(q, k, v, bias, mask, scores_, out, lse, dout)


XLA = Backend("xla", xla_attention.forward, _xla_backward)


def _forward_warning_on_cuda(q, *operands, **static):
  q = per_platform.check_lowering(q, cuda_warning=target.UNTARGETED_WARNING)
  return xla_attention.forward(q, *operands, **static)


# The XLA path where a host without a GPU chose it for lack of one: lowering
# it for CUDA warns that the kernels need `fa4_jax.gpu_target`.
XLA_UNTARGETED = Backend("xla", _forward_warning_on_cuda, _xla_backward)


@functools.cache
def _kernel_backend(name: str) -> Backend:
  """Backend of one kernel family: its forward, its backward if it has one."""
  fwd_module = importlib.import_module(f"fa4_jax.kernels.{name}_forward")

  def forward(q, k, v, bias, mask, scores_: Scores):
    del bias, mask  # never selected with them (see _kernel_problem)
    options = _options(fwd_module, scores_)
    out, lse = fwd_module.forward(q, k, v, scores_.q_lengths, scores_.kv_lengths,
                                  score=scores_.score_function, mask=scores_.mask,
                                  segment_ids=scores_.segment_pair, **options)
    if scores_.sinks is not None and "sinks" not in options:
      out, lse = scores.add_sinks(out, lse, scores_.sinks, scores_.q_lengths)
    return out, lse

  def backward(q, k, v, bias, mask, scores_: Scores, out, lse, dout, *,
               deterministic: bool = True):
    # The fused backward where it supports the call, else the XLA backward
    # (which takes the kernel's lse): decided here, at trace time.
    # `deterministic=False` reaches a module with the "nondeterministic"
    # feature (sm90: the one kernel where it serves the call, else its two
    # deterministic kernels); the others are deterministic either way.
    bwd_module = fused_backward(name, CallInfo.of(q, k, bias, mask, scores_, v))
    if bwd_module is None:
      return xla_attention.backward(q, k, v, bias, mask, scores_, out, lse, dout)
    options = _options(bwd_module, scores_)
    options.pop("sinks", None)  # the lse holds them
    if not deterministic and "nondeterministic" in _features(bwd_module):
      options["deterministic"] = False
    operands = (q, k, v, out, lse, dout)
    padded = _pads_value_head_dim(bwd_module, q.shape[-1], v.shape[-1])
    if padded:
      operands = _one_head_dim(*operands)
    dq, dk, dv = bwd_module.backward(
        *operands, scores_.q_lengths, scores_.kv_lengths, score=scores_.score_function,
        mask=scores_.mask, segment_ids=scores_.segment_pair, **options)
    if padded:
      dq, dk, dv = dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]
    return dq, dk, dv, None, _captured_grads(q, k, v, scores_, out, lse, dout)

  return Backend(name, forward, backward)


def _pads_value_head_dim(module, head_dim: int, value_head_dim: int) -> bool:
  """Whether backward module `module` gets a value head dim of its own padded
  to one head dim (`_one_head_dim`): it lacks the "value_head_dim" feature,
  or its `check_value_head_dim` rejects the pair."""
  if value_head_dim == head_dim:
    return False
  if "value_head_dim" not in _features(module):
    return True
  try:
    module.check_value_head_dim(head_dim, value_head_dim)
  except KernelUnsupported:
    return True
  return False


def _one_head_dim(q, k, v, out, lse, dout):
  """A value head dim of its own for a backward kernel without one: the
  narrower of (q, k) and (v, out, dout) zero-padded to the other's head dim.
  Zero columns change no logit (q k^T), no dP (dout v^T) and no delta
  (rowsum(dout * out)), and get zero gradients, which the caller slices off;
  the price is the padded columns' FLOPs (at 192 / 128: 960 units of work
  per score instead of 832, 15 % more)."""
  width = max(q.shape[-1], v.shape[-1])
  pad = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
  return pad(q), pad(k), pad(v), pad(out), lse, pad(dout)


def _captured_grads(q, k, v, scores_: Scores, out, lse, dout):
  """The gradients of a score_mod's float captured arrays, for a kernel
  backward that computes dq, dk, dv only: one blockwise XLA pass (its dq,
  dk, dv are unused, and XLA drops them). As the XLA backward gives them
  (the kernel and the XLA path are traced side by side, `_portable`): None
  without a score_mod, else one entry per captured array, None for an
  integer one."""
  if scores_.score_mod is None:
    return None
  if not any(jnp.issubdtype(c.dtype, jnp.inexact) for c in scores_.score_captured):
    return (None,) * len(scores_.score_captured)
  return xla_attention.backward(q, k, v, None, None, scores_, out, lse, dout)[4]


def fused_backward(name: str, call: CallInfo):
  """Kernel family `name`'s backward module if it serves these arguments,
  else None (the XLA backward runs, on the kernel's lse)."""
  try:
    module = importlib.import_module(f"fa4_jax.kernels.{name}_backward")
  except ModuleNotFoundError:
    return None
  if "score_function" in _missing_features(module, call):
    return None
  if call.has_mods and ("mods" not in _features(module) or _mods_problem(call) is not None):
    return None
  q_shape, k_shape = call.q_shape, call.k_shape
  if call.v_head_dim is not None and _pads_value_head_dim(module, q_shape[-1], call.v_head_dim):
    # Served with the head dims padded to one (`_one_head_dim`).
    width = max(q_shape[-1], call.v_head_dim)
    q_shape, k_shape = (*q_shape[:-1], width), (*k_shape[:-1], width)
  try:
    module.check_supported(q_shape, k_shape, call.dtype, call.spec)
  except KernelUnsupported:
    return None
  return module


def backward_name(backend: Backend, call: CallInfo) -> str:
  """What runs the backward of `backend` for `call`: its kernel family's
  fused backward ("sm90", "sm100") or "xla"."""
  family = {"sm90_decode": "sm90"}.get(backend.name, backend.name)
  if family in KERNEL_IMPLEMENTATIONS and fused_backward(family, call) is not None:
    return family
  return "xla"


@functools.cache
def _decode_backend() -> Backend:
  """The sm90 forward kernel in the decode arrangement, the sm90 backward."""
  from fa4_jax.kernels import sm90_decode

  def forward(q, k, v, bias, mask, scores_: Scores):
    del bias, mask  # never selected with them (see _kernel_problem)
    plan = sm90_decode.plan(q.shape, k.shape, scores_.mask,
                            has_segment_ids=scores_.q_segment_ids is not None,
                            ragged=scores_.kv_lengths is not None,
                            fp8_cache=jnp.dtype(k.dtype) in scores.FP8_DTYPES)
    if plan is None:  # other shapes per device (e.g. a sharded call): the usual kernel
      return _kernel_backend("sm90").forward(q, k, v, None, None, scores_)
    options = {}
    if scores_.has_fp8:  # a float8 cache (`_fp8_problem`)
      options.update(descales=(scores_.q_descale, scores_.k_descale, scores_.v_descale),
                     out_dtype=scores_.out_dtype)
    if scores_.has_mods:  # (`_packed_mods_problem`)
      options.update(mods=scores_)
    return sm90_decode.forward(q, k, v, scores_.q_lengths, scores_.kv_lengths,
                               score=scores_.score_function, mask=scores_.mask, plan=plan,
                               sinks=scores_.sinks, **options)

  return Backend("sm90_decode", forward, _kernel_backend("sm90").backward)


@functools.cache
def _mla_backend() -> Backend:
  """The sm90 MLA decode kernel (`fa4_jax.kernels.sm90_mla_decode`): the
  values are the keys' first features, read from k alone; the XLA backward."""
  from fa4_jax.kernels import sm90_mla_decode

  def forward(q, k, v, bias, mask, scores_: Scores):
    del bias, mask  # never selected with them (see _mla_problem)
    out, lse = sm90_mla_decode.forward(q, k, scores_.q_lengths, scores_.kv_lengths,
                                       value_head_dim=v.shape[-1],
                                       score=scores_.score_function, mask=scores_.mask)
    if scores_.sinks is not None:
      out, lse = scores.add_sinks(out, lse, scores_.sinks, scores_.q_lengths)
    return out, lse

  return Backend("sm90_mla", forward, _xla_backward)


def _mla_problem(call: CallInfo) -> str | None:
  """Why the sm90 MLA decode kernel cannot serve `call` (values from the
  keys, `value=None`), or None if it can."""
  from fa4_jax.kernels import sm90_mla_decode

  if not call.values_from_keys:
    return "the values are not the keys' first features (value=None)"
  if (call.has_bias or call.has_mask or call.has_mods or call.has_fp8 or call.has_segment_ids
      or call.kernel_features):
    return ("the MLA decode kernel takes no bias, mask array, score_mod / mask_mod, float8, "
            "segment ids or soft-cap")
  try:
    sm90_mla_decode.check_supported(call.q_shape, call.k_shape, call.dtype, call.v_head_dim
                                    or call.q_shape[-1], call.spec)
  except KernelUnsupported as e:
    return str(e)
  return None


def _features(module) -> frozenset[str]:
  return getattr(module, "FEATURES", frozenset())


def _missing_features(module, call: CallInfo) -> frozenset[str]:
  """The features the call's scores need that `module` does not offer."""
  return call.kernel_features - _features(module)


def _options(module, scores_: Scores):
  """The optional keyword arguments a kernel module takes, those that are set
  (so that a module without a feature is called as before)."""
  options = dict(sinks=scores_.sinks, mods=scores_ if scores_.has_mods else None)
  if scores_.has_fp8:
    options.update(descales=(scores_.q_descale, scores_.k_descale, scores_.v_descale),
                   out_dtype=scores_.out_dtype)
  wanted = _features(module) | ({"descales", "out_dtype"} if "fp8" in _features(module) else set())
  return {k: v for k, v in options.items() if v is not None and k in wanted}


def _fp8_problem(name: str, module, call: CallInfo) -> str | None:
  """Why kernel `name` cannot take the call's float8 operands, or None: the
  kernels take q, k and v all in float8 (not in the decode arrangement), or
  a 16-bit query on a float8 cache (decode and the forward, without
  segment ids or mods)."""
  fallback = "use implementation=None (which falls back to the XLA path) or 'xla'"
  if "fp8" not in _features(module):
    return f"implementation={name!r} does not take float8 operands yet; {fallback}"
  if jnp.dtype(call.dtype) not in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)):
    if call.has_segment_ids or call.has_mods:
      return (f"implementation={name!r} reads a float8 cache without segment ids, score_mod "
              f"or mask_mod; {fallback}")
    return None
  from fa4_jax.kernels import sm90_decode
  if call.spec.is_dense and sm90_decode.plan(call.q_shape, call.k_shape, call.spec,
                                             has_segment_ids=call.has_segment_ids) is not None:
    return (f"implementation={name!r} has no float8 decode kernel yet (a short query against "
            f"a long cache); {fallback}")
  return None


@functools.lru_cache(maxsize=256)
def _packed_rows_problem(mod) -> str | None:
  return mod_functions.packed_rows_problem(mod)


def _packed_mods_problem(score_mod, mask_mod) -> str | None:
  """Why the decode arrangement cannot run these mods (on rows of several
  heads: `mod_functions.packed_rows_problem`), or None."""
  for mod in (score_mod, mask_mod):
    if mod is not None:
      problem = _packed_rows_problem(mod)
      if problem is not None:
        return problem
  return None


def _mods_problem(call: CallInfo) -> str | None:
  """Why no kernel can run the call's score_mod or mask_mod, or None."""
  for mod in (call.score_mod, call.mask_mod):
    if mod is not None:
      problem = mod_functions.kernel_problem(mod)
      if problem is not None:
        return problem
  return None


def device_arch_major() -> int | None:
  """Compute capability major of the device calls are built for: the
  `gpu_target` if one is active, else the default device; None if it is no
  CUDA GPU."""
  chosen = target.current_target()
  if chosen is not None:
    return chosen.compute_capability[0]
  device = default_device()
  capability = getattr(device, "compute_capability", None)
  if device.platform != "gpu" or not capability:
    return None
  try:
    return int(str(capability).split(".")[0])
  except ValueError:  # e.g. ROCm's "gfx90a"
    return None


def _kernel_problem(name: str, call: CallInfo) -> str | None:
  """Why kernel `name` cannot serve `call` here, or None if it can."""
  if not interpret.is_interpreting():
    major = device_arch_major()
    if major != _KERNEL_ARCH_MAJOR[name]:
      return (f"implementation={name!r} needs a {_ARCH_NAMES[name]} GPU, but "
              f"{_device_description()}; use implementation=None to pick what "
              "this device supports, run inside fa4_jax.interpret_mode(), or, to "
              f"lower or export for that GPU from here, inside fa4_jax.gpu_target({name!r})")
  if call.has_bias:
    return f"implementation={name!r} does not support `bias`; use implementation='xla'"
  if call.has_mask:
    return (f"implementation={name!r} does not support a boolean `mask` array; "
            "use is_causal, local_window_size or the *_seq_lengths arguments, "
            "or implementation='xla'")
  if name == "sm90" and call.values_from_keys and _mla_problem(call) is None:
    return None  # the MLA decode kernel (`_arrangement`)
  try:
    module = importlib.import_module(f"fa4_jax.kernels.{name}_forward")
  except ModuleNotFoundError:
    return f"implementation={name!r}: this build of fa4_jax has no {name} kernel"
  if "score_function" in _missing_features(module, call):
    return (f"implementation={name!r} does not support `logits_soft_cap` yet; use "
            "implementation=None (which falls back to the XLA path) or 'xla'")
  if call.v_head_dim is not None and ("value_head_dim" not in _features(module)
                                      or call.v_head_dim > 256 or call.v_head_dim % 16):
    return (f"implementation={name!r} takes no value head dim of {call.v_head_dim} with a "
            f"query head dim of {call.q_shape[-1]} (value head dims of their own: sm90, multiples "
            "of 16 up to 256); use implementation=None (which falls back to the XLA path) or 'xla'")
  if call.has_fp8:
    problem = _fp8_problem(name, module, call)
    if problem is not None:
      return problem
  if call.has_mods:
    if "mods" not in _features(module):
      return (f"implementation={name!r} does not support `score_mod` / `mask_mod` yet; use "
              "implementation=None (which falls back to the XLA path) or 'xla'")
    problem = _mods_problem(call)
    if problem is not None:
      return f"implementation={name!r}: {problem}"
  try:
    module.check_supported(call.q_shape, call.k_shape, call.dtype, call.spec)
  except KernelUnsupported as e:
    return str(e)
  return None


def _device_description() -> str:
  chosen = target.current_target()
  if chosen is not None:
    return f"the gpu_target is {chosen.arch!r}"
  return f"the default device is {default_device().device_kind!r}"


def select(implementation: str | None, call: CallInfo) -> Backend:
  if implementation == "xla":
    return XLA
  if implementation in KERNEL_IMPLEMENTATIONS:
    problem = _kernel_problem(implementation, call)
    if problem is not None:
      raise ValueError(problem)
    return _staged(implementation, _arrangement(implementation, call))
  assert implementation is None, implementation
  major = device_arch_major()
  for name in KERNEL_IMPLEMENTATIONS:
    if major == _KERNEL_ARCH_MAJOR[name] and _kernel_problem(name, call) is None:
      return _staged(name, _arrangement(name, call))
  return XLA_UNTARGETED if _untargeted_host() else XLA


def _staged(arch: str, kernel: Backend) -> Backend:
  """Kernel family `arch`'s backend as it is staged out: as it is in
  interpret mode (the interpreter runs on any platform); for CUDA, with the
  XLA path for other platforms, under a `gpu_target`; else for CUDA alone."""
  if interpret.is_interpreting():
    return kernel
  if target.current_target() is not None:
    return _portable(kernel)
  return _cuda_only(arch, kernel)


@functools.cache
def _cuda_only(arch: str, kernel: Backend) -> Backend:
  """`kernel`, whose lowering for a platform other than CUDA raises an error
  that names `gpu_target` (instead of Pallas' own, which does not)."""
  error = target.multi_platform_error(arch)

  def forward(q, *operands, **static):
    return kernel.forward(per_platform.check_lowering(q, elsewhere_error=error), *operands,
                          **static)

  def backward(q, *operands, **static):
    return kernel.backward(per_platform.check_lowering(q, elsewhere_error=error), *operands,
                           **static)

  return Backend(kernel.name, forward, backward)


@functools.cache
def _portable(kernel: Backend) -> Backend:
  """`kernel` where the function is lowered for CUDA, the XLA path on every
  other platform (`fa4_jax.per_platform.cuda_else`).

  Both are traced, but lowering keeps only what the platforms lowered for
  need: a function jitted on a GPU compiles the kernel alone; one exported
  for ("cuda", "cpu") carries both, and the platform it is loaded on picks
  one. They return the same types (the backend contract of `fa4_jax.vjp`).
  """

  def forward(*operands, **static):
    return per_platform.cuda_else(functools.partial(kernel.forward, **static),
                                  functools.partial(XLA.forward, **static), *operands)

  def backward(*operands, **static):
    return per_platform.cuda_else(functools.partial(kernel.backward, **static),
                                  functools.partial(XLA.backward, **static), *operands)

  return Backend(kernel.name, forward, backward)


def _untargeted_host() -> bool:
  """Whether the XLA path was chosen only because this host has no GPU and
  names no `gpu_target` (then lowering it for CUDA warns)."""
  if target.current_target() is not None or interpret.is_interpreting():
    return False
  return default_device().platform != "gpu"


def _arrangement(name: str, call: CallInfo) -> Backend:
  """Kernel family `name`'s backend for this call: the sm90 decode
  arrangement for short queries without a band or causal bottom-right
  (`sm90_decode.serves_mask`: the last T tokens of each row, T x G packed
  rows within `sm90_decode.MAX_PACKED_ROWS`), the MLA decode kernel for a
  latent cache (`value=None`), else the kernels as they are (a float8 query
  with a band: the forward's float8 kernel). A `score_mod` / `mask_mod`
  takes the decode arrangement where it runs on packed rows
  (`_packed_mods_problem`), else the forward kernel."""
  if name == "sm90" and call.values_from_keys and _mla_problem(call) is None:
    return _mla_backend()
  if (name == "sm90" and call.v_head_dim is None
      and _packed_mods_problem(call.score_mod, call.mask_mod) is None):
    from fa4_jax.kernels import sm90_decode
    fp8_query = jnp.dtype(call.dtype) in scores.FP8_DTYPES
    if (not (fp8_query and not call.spec.is_dense)
        and sm90_decode.plan(call.q_shape, call.k_shape, call.spec,
                             has_segment_ids=call.has_segment_ids) is not None):
      return _decode_backend()
  return _kernel_backend(name)


# --- paged_attention -----------------------------------------------------------


def select_paged(implementation, args: PagedArguments) -> str:
  """What `paged_attention` runs: "xla", "sm90" (the sm90 kernels reading
  the pages: the decode arrangement, or beyond its rows the forward kernel)
  or "sm90_mla" (the MLA decode kernel, for latent pages: `value_pages=None`),
  as `paged_kernel_forward` dispatches; raises ValueError when "sm90" was
  asked for and cannot serve. None takes the kernel only on a Hopper GPU (as
  `fa4_jax.attention` does: inside `interpret_mode()` the kernel runs when
  asked for by name)."""
  if implementation == "xla":
    return "xla"
  problem = _paged_kernel_problem(args)
  kernel = "sm90_mla" if args.value_pages is None else "sm90"
  if implementation == "sm90":
    if problem is not None:
      raise ValueError(f"implementation='sm90': {problem}")
    return kernel
  return kernel if problem is None and device_arch_major() == 9 else "xla"


def paged_kernel_forward(q, key_pages, value_pages, page_table, lengths, sinks, descales, mods,
                         static: PagedStatic):
  """The output of the sm90 kernel `select_paged` chose, reading through the
  table: the MLA decode kernel for latent pages (`value_pages=None`), else
  the decode arrangement (also causal T > 1, the band aligned by each row's
  length), or the forward kernel itself for chunked prefill beyond the
  arrangement's packed rows. `descales`: float8 pages' (q, k, v) descales,
  (None, None, None) otherwise. `mods`: None, or the traced `score_mod` /
  `mask_mod` (`PagedArguments.traced_mods`), which only the decode arrangement runs."""
  from fa4_jax.kernels import sm90_decode, sm90_forward

  if value_pages is None:  # MLA's latent pages: the MLA decode kernel
    from fa4_jax.kernels import sm90_mla_decode
    out, lse = sm90_mla_decode.forward(q, key_pages, None, lengths,
                                       value_head_dim=static.value_head_dim, score=static.score,
                                       mask=static.kernel_mask(q.shape), page_table=page_table)
    return out if sinks is None else scores.add_sinks(out, lse, sinks)[0]
  fp8 = {}
  if key_pages.dtype in scores.FP8_DTYPES:  # a 16-bit query on float8 pages
    fp8 = dict(descales=descales, out_dtype=static.output_dtype)
  plan = paged_decode_plan(PagedArguments(q, key_pages, value_pages, page_table, lengths, sinks,
                                          static))
  if plan is None:  # chunked prefill beyond the decode arrangement's rows
    q_lengths = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
    out, _ = sm90_forward.forward(q, key_pages, value_pages, q_lengths, lengths,
                                  score=static.score, mask=static.kernel_mask(q.shape),
                                  sinks=sinks, page_table=page_table, **fp8)
    return out
  out, _ = sm90_decode.forward(q, key_pages, value_pages, None, lengths, score=static.score,
                               mask=static.kernel_mask(q.shape), plan=plan, sinks=sinks,
                               page_table=page_table, mods=mods, **fp8)
  return out


def _paged_kernel_problem(args: PagedArguments) -> str | None:
  """Why the sm90 kernel cannot serve the paged call here, or None if it can."""
  from fa4_jax.kernels import sm90_decode, sm90_forward

  if not interpret.is_interpreting() and device_arch_major() != 9:
    return ("needs a Hopper (compute capability 9.x) GPU as the default device, or "
            "fa4_jax.interpret_mode()")
  if args.key_pages.dtype in scores.FP8_DTYPES and args.query.dtype in scores.FP8_DTYPES:
    return ("float8 pages under a float8 query are read by the XLA path; use a 16-bit "
            "query, implementation=None or 'xla'")
  mods = args.traced_mods
  if mods is not None:
    problem = _paged_mods_problem(args, mods)
    if problem is not None:
      return problem
  if args.value_pages is None:
    return paged_mla_problem(args)
  if args.value_pages.shape[-1] != args.key_pages.shape[-1]:
    return ("a value head dim other than the keys' (MLA's latent pages, `value_pages=None`) "
            "is read by the XLA path for now; use implementation=None or 'xla'")
  q_shape = args.query.shape
  try:
    k_shape = sm90_forward.check_paged(q_shape, args.key_pages.shape, args.page_table.shape)
    sm90_forward.check_supported(q_shape, k_shape, args.query.dtype,
                                 args.static.kernel_mask(q_shape))
  except KernelUnsupported as e:
    return str(e)
  if args.static.is_prefill(q_shape):
    return None  # the decode arrangement, or beyond its rows the forward kernel as it is
  if paged_decode_plan(args) is None:
    return (f"T * Hq / Hkv = {q_shape[1] * q_shape[2] // k_shape[2]} query rows per KV head; "
            f"the decode arrangement packs at most {sm90_decode.MAX_PACKED_ROWS}")
  return None


def _paged_mods_problem(args: PagedArguments, mods: Scores) -> str | None:
  """Why the kernel cannot run a paged call's traced mods, or None: it runs
  them in the decode arrangement (16-bit pages of K and V, T x G packed rows
  within `sm90_decode.MAX_PACKED_ROWS`), on rows of several heads."""
  fallback = "use implementation=None or 'xla'"
  if args.value_pages is None or args.key_pages.dtype in scores.FP8_DTYPES:
    return ("score_mod / mask_mod over latent (`value_pages=None`) or float8 pages are read by "
            f"the XLA path; {fallback}")
  problem = _packed_mods_problem(mods.score_mod, mods.mask_mod)
  if problem is not None:
    return f"{problem} (paged_attention: {fallback})"
  if args.value_pages.shape[-1] == args.key_pages.shape[-1] and paged_decode_plan(args) is None:
    return ("score_mod / mask_mod over pages run in the decode arrangement only (up to "
            "256 query rows per KV head); longer queries are read by the XLA path; "
            f"{fallback}")
  return None


def paged_decode_plan(args: PagedArguments):
  """The decode plan of a paged call: chunks of whole pages, balanced for
  ragged lengths; None where the decode arrangement cannot serve it (more
  than `sm90_decode.MAX_PACKED_ROWS` packed rows). Causal calls with T > 1
  (chunked prefill, speculative decoding) take it too, with the band
  aligned by each row's length (`PagedStatic.kernel_mask`). float8 pages
  under a 16-bit query take the contiguous float8 cache's plan
  (`sm90_decode.fp8_pages_plan`, as `sm90_decode.FP8_PAGES_SPLITS_FACTOR`
  sets it; measured in the performance notes, "Float8 pages under the
  contiguous cache's plan")."""
  from fa4_jax.kernels import sm90_decode

  b, _, _, d = args.query.shape
  page_size, kv_heads = args.key_pages.shape[1], args.key_pages.shape[2]
  k_shape = (b, args.page_table.shape[1] * page_size, kv_heads, d)
  fp8_cache = (jnp.dtype(args.key_pages.dtype) in scores.FP8_DTYPES
               and jnp.dtype(args.query.dtype) not in scores.FP8_DTYPES)
  return sm90_decode.plan(args.query.shape, k_shape, args.static.kernel_mask(args.query.shape),
                          ragged=True, granule=page_size, fp8_cache=fp8_cache, paged=True)


def paged_mla_problem(args: PagedArguments) -> str | None:
  """Why the sm90 MLA decode kernel cannot read the latent pages of a
  `value_pages=None` call, or None if it can (the caller checked the GPU)."""
  from fa4_jax.kernels import sm90_mla_decode

  b, t, _, d = args.query.shape
  page_size = args.key_pages.shape[1]
  keys = args.page_table.shape[1] * page_size
  if args.static.score.cap is not None or args.key_pages.dtype in scores.FP8_DTYPES:
    return ("latent pages (`value_pages=None`) with a soft-cap or in float8 are read by the "
            "XLA path; use implementation=None or 'xla'")
  mask = MaskSpec(right=0, offset_from_lengths=True) if args.static.is_prefill(
      args.query.shape) else MaskSpec()
  try:
    sm90_mla_decode.check_supported(args.query.shape, (b, keys, args.key_pages.shape[2], d),
                                    args.query.dtype, args.static.value_head_dim, mask,
                                    page_size)
  except KernelUnsupported as e:
    return f"latent pages (`value_pages=None`): {e}; use implementation=None or 'xla'"
  if keys % max(sm90_mla_decode.MlaPlan().block_kv, page_size):
    return (f"latent pages (`value_pages=None`): max_pages * page_size = {keys} keys must be "
            "whole blocks of 64; use implementation=None or 'xla'")
  return None
