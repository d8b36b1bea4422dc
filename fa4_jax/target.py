"""Lowering for a GPU that is not here: `gpu_target`, for export and AOT.

`fa4_jax.attention` picks its kernel while it is traced, from the default
device (`fa4_jax.backends`). A build host or a CI runner without a GPU would
therefore export the XLA path, although the module will be served on GPUs.
Inside `gpu_target("sm90")` (or `"sm100"`) fa4_jax behaves as if the default
device were that GPU: selection, the persistent grids' SM count, and the
architecture Mosaic GPU lowers for. So

    with fa4_jax.gpu_target("sm90"):
      exported = jax.export.export(jax.jit(f), platforms=("cuda", "cpu"))(*specs)

holds the Hopper kernels in its CUDA branch and the XLA path in its CPU
branch (`fa4_jax.backends` stages a kernel backend with
`fa4_jax.per_platform.cuda_else`).

Without a target:
* exporting for CUDA from a host without a GPU works, but the module
  carries the XLA path: fa4_jax warns when it is lowered for CUDA
  (`UNTARGETED_WARNING`);
* on a GPU host the kernel is staged out alone (tracing the XLA path too
  would slow every first call); lowering it for another platform as well
  raises `multi_platform_error`, which names `gpu_target`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import jax

# SMs of the GPU each kernel family was built for: H100 SXM and H200 have
# 132, B200 148. The persistent grids launch one CTA per SM; on a GPU with
# another count they stay correct (a CTA loops over work units; more CTAs
# than SMs queue a second wave, fewer leave SMs idle).
DEFAULT_NUM_SMS = {"sm90": 132, "sm100": 148}
# (major, minor) compute capability Mosaic GPU lowers for.
_ARCH = {"sm90": (9, 0), "sm100": (10, 0)}


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """The GPU a lowering is for: kernel family name, SM count."""

  arch: str
  num_sms: int

  @property
  def compute_capability(self) -> tuple[int, int]:
    return _ARCH[self.arch]


# A jit-cache-sensitive context (`jax.make_user_context`): a function traced
# outside a target (the XLA path) is traced again inside one, and the other
# way round. The value is thread-local, as jax's own contexts are.
_TARGET = jax.make_user_context(None)


def current_target() -> GpuTarget | None:
  """The `gpu_target` in force on this thread, or None."""
  return _TARGET.value


@contextlib.contextmanager
def gpu_target(arch: str, *, num_sms: int | None = None):
  """Lowers fa4_jax's attention for GPU `arch`, whatever this host has.

  Use it around `jax.export.export(...)`, `jax.jit(f).lower(...)` or
  `.trace(...).lower(lowering_platforms=("cuda", ...))` on a machine
  without that GPU (a build host, CI) or with another one:

      with fa4_jax.gpu_target("sm90"):
        exported = jax.export.export(jax.jit(f), platforms=("cuda",))(*specs)

  Inside, `implementation=None` picks the `arch` kernel wherever it supports
  the arguments (the XLA path otherwise, as on that GPU), and
  `implementation="sm90"` / `"sm100"` is accepted when it matches `arch`.
  Lowered for several platforms, the CUDA branch runs the kernel and every
  other platform the XLA path.

  Args:
    arch: `"sm90"` (Hopper: H100, H200) or `"sm100"` (Blackwell: B200).
    num_sms: SM count the persistent kernels size their grid for; default
      132 for sm90 (H100 SXM, H200), 148 for sm100 (B200). A module built
      for one count runs correctly on a GPU with another, only the grid's
      fit to the SMs differs.

  Functions *run* inside the block still run on this host's default device:
  the block is meant for lowering. A function jitted outside the block is
  traced again inside it (the target is part of jax's jit cache key).
  Mosaic GPU reads the architecture it lowers for from the default device;
  while a target is active, fa4_jax answers that query with the target's
  (see `_ArchOverride`).
  """
  if arch not in _ARCH:
    raise ValueError(f"gpu_target: `arch` must be one of {sorted(_ARCH)}; got {arch!r}")
  if num_sms is None:
    num_sms = DEFAULT_NUM_SMS[arch]
  if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1:
    raise ValueError(f"gpu_target: `num_sms` must be a positive int; got {num_sms!r}")
  with _ARCH_OVERRIDE, _TARGET(GpuTarget(arch, num_sms)):
    yield


class _ArchOverride:
  """Makes Mosaic GPU lower for the current target's architecture.

  Mosaic GPU (jax 0.11.2, which fa4_jax pins) takes the architecture it lowers
  for from the private `jax.experimental.mosaic.gpu.utils._infer_arch()`,
  which reads the default device; without a GPU it answers (9, 0) whatever
  the target ("TODO: figure out the export story" in jax). jax offers no
  public way to name it, so while any `gpu_target` is active (on any thread)
  that function is replaced by one that answers the target of the calling
  thread and defers to jax's own elsewhere. Revisit when jax gains an option.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._active = 0
    self._original = None

  def __enter__(self):
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    with self._lock:
      if self._active == 0:
        self._original = original = mgpu_utils._infer_arch

        def infer_arch():
          target = current_target()
          return target.compute_capability if target is not None else original()

        mgpu_utils._infer_arch = infer_arch
      self._active += 1

  def __exit__(self, *exc):
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    with self._lock:
      self._active -= 1
      if self._active == 0:
        mgpu_utils._infer_arch = self._original
        self._original = None


_ARCH_OVERRIDE = _ArchOverride()


# Lowering for CUDA the XLA path that a host without a GPU chose for lack of
# one (`fa4_jax.backends`, `per_platform.check_lowering`).
UNTARGETED_WARNING = (
    "fa4_jax.attention is being lowered for CUDA on a host without a GPU and outside "
    "fa4_jax.gpu_target(...): the module runs the XLA attention path on the GPU, not "
    "the Mosaic GPU kernels. Trace and lower inside `with fa4_jax.gpu_target('sm90'):` "
    "(Hopper) or `gpu_target('sm100')` (Blackwell) to carry the kernels.")


def multi_platform_error(arch: str) -> str:
  """Lowering for a platform other than CUDA a kernel that was chosen outside
  `gpu_target` (for this host's GPU): what to do instead."""
  return (f"fa4_jax.attention chose the {arch} kernel for this host's GPU and is being "
          "lowered for a platform other than CUDA, where the kernel cannot run. To "
          "export for several platforms (the kernel for CUDA, the XLA path elsewhere), "
          f"trace and lower inside `with fa4_jax.gpu_target({arch!r}):`; for another "
          "platform alone, use implementation='xla' or jax.default_device(...).")
