"""Run-time overrides of the CPU gaps in SGLang 0.5.23 for the test servers (never site-packages).

A real SGLang PD pair runs on a CPU-only machine with thirteen small overrides. Each is an
:class:`Override`: a name, the module and attribute it replaces, the parameters that
attribute must have, and the replacement. A meta-path finder applies an override when
its module is first imported, after the module's own code ran and before anyone imports
names from it. Each override is logged on stderr when applied
(``[cpu-gaps] override <name>: <module>.<attr>``) and **refused** when its target is
missing or its signature differs from the expected one: the import then fails with the
reason, so the server stops at start instead of running with a gap open.

The gaps (file:line in SGLang 0.5.23):

1. ``torchvision_meta``: ``torchvision/__init__.py`` imports ``_meta_registrations``, which
   fails when the CUDA-linked ``_C`` has no ops on a CPU torch; skipped when
   ``torchvision.extension._has_ops()`` is false.
2. ``amx_backend``: ``arg_groups/overrides.py`` around 1301 switches ``intel_amx`` to
   ``torch_native`` on a CPU without AMX, and ``speculative/draft_utils.py`` then refuses
   EAGLE; ``intel_amx`` is kept (the sgl-kernel stand-ins serve it).
3. ``prefill_host_indices``: ``disaggregation/prefill.py`` around 1746 takes a
   pinned-memory + ``torch.cuda.Event`` branch when the sender supports host tensor
   indices; on a CPU server the indices are already on the host, so the plain branch.
4. ``row_argmax``: ``kernels/ops/speculative/row_argmax.py`` is a Triton GPU kernel
   (called from ``spec_utils.py`` around 197); ``x.argmax(-1)`` on the CPU.
5. ``verify_greedy``: ``speculative/eagle_utils.py`` around 500 makes every CPU verify
   greedy, even at temperature > 0; with rejection sampling on, greedy only when every
   request is.
6. ``reject_sampling_interpreted``: ``kernels/ops/speculative/reject_sampling.py`` runs on
   the CPU only under Triton's interpreter; ``TRITON_INTERPRET=1`` must be in the process
   environment before Triton is imported (the harness sets it), checked here.
7. ``renorm``: ``kernels/ops/sampling/renorm.py`` around 34 leaves ``top_k_renorm_prob``
   and ``top_p_renorm_prob`` None on the CPU, so a batch mixing greedy and sampled
   requests crashes ``eagle_utils.py`` around 729; torch versions serve.

Three more open only under ``--enable-deterministic-inference`` (SGLang's seeded
sampling: ``sampling_seed`` reaches the draft's ``fast_sample`` and the verify's coins),
and do nothing without it:

8. ``deterministic_amx``: ``arg_groups/overrides.py`` around 1093 refuses every attention
   backend outside ``DETERMINISTIC_ATTENTION_BACKEND_CHOICES`` (``arg_groups/choices.py``
   around 113), ``intel_amx`` included; it is added to the list (SGLang's own
   ``add_deterministic_attention_backend_choices`` does the same). The tier's stand-in
   attention computes each request alone, so it is batch-invariant by construction;
   SGLang's compiled AMX kernels are not vouched for here.
9. ``deterministic_rejection_cpu``: ``arg_groups/speculative_hook.py`` around 1225 refuses
   deterministic rejection sampling on any device but CUDA, "because draft proposal
   sampling uses a Triton hash kernel"; on the CPU ``murmur_hash32`` dispatches to
   ``torch.ops.sgl_kernel.murmur_hash32_cpu`` (``kernels/ops/sampling/murmur_hash.py``),
   which the stand-ins provide. ``_handle_eagle_family`` runs with the flag hidden (a
   declaration, undone by the next) only on CPU with rejection sampling and that op
   registered; else SGLang refuses as before.
10. ``batch_invariant_cpu``: ``model_executor/model_runner.py`` around 843 calls
    ``enable_batch_invariant_mode``, whose ``get_dispatch_device_backend()``
    (``utils/common.py`` around 620) raises on the CPU ("No supported accelerator"); on
    the CPU it is skipped, logged. Its kernels are Triton GPU kernels: a CPU server
    then runs torch's own CPU matmuls, deterministic for equal shapes from run to run
    but not proven batch-invariant.
11. ``mtp_cuda_sync``: ``models/mimo_v2_nextn.py`` around 393, ``MiMoV2MTP.set_embed_and_head``
    ends with ``torch.cuda.synchronize()``, which raises on a CPU build of torch (the
    multi-layer EAGLE worker calls it at start); a no-op for that method's span on the
    CPU, the original untouched on an accelerator.
12. ``deepseek_cuda_sync``: ``models/deepseek_v2.py`` around 3448, the same call at the end of
    ``DeepseekV2ForCausalLM.set_embed_and_head``, which the EAGLE worker calls on a DeepSeek
    NextN draft (``DeepseekV3ForCausalLMNextN`` inherits it) at start; the same no-op.

And one that turns on what a GPU server runs by default:

13. ``overlap_spec_cpu``: ``arg_groups/speculative_hook.py:66``,
    ``_disable_overlap_schedule_for_cpu`` (called from ``_handle_eagle_family`` at 1096 and
    ``_handle_ngram`` at 1292) turns the overlap scheduler off for speculative decoding on
    the CPU ("Overlap schedule is not implemented for speculative decoding on CPU", 77);
    a no-op, logged, so spec v2 runs overlapped (its ``FutureMap`` relay, the overlapped
    event loops) as on a GPU. ``--disable-overlap-schedule`` still turns it off (the tier's
    prefill passes it: gap 3). Refused where the function's source no longer has that
    refusal. On the CPU every "stream" is the caller's: the overlap's control flow runs,
    not its concurrency.

And two test-only switches, off unless asked: ``seed_builder`` (``PDM_TEST_SEED_BUILDER=1``)
makes SGLang's own PD proposal inert, so its builder leaves ``draft_probs`` unset as
before SGLang's fix: the negative control of ``tests/server/test_seed.py``; and
``draft_kv_prefill`` / ``draft_kv_decode`` (``PDM_TEST_DRAFT_KV_DUMP=<dir>``) write each
chain step's draft KV at a request's prompt positions to files, on the prefill after its
forward and on the decode once the transfer landed (:mod:`draft_kv_dump`; read by
``tests/server/test_multi_layer.py``). They only read. And ``recompute_fault_source`` /
``recompute_fault_head`` (``PDM_TEST_RECOMPUTE_FAULT=<where>[:<rank>]``) make one step of
decode-only recompute fail on one TP rank, so a failure on one rank is seen to become its
vote (:mod:`recompute_fault`; read by ``tests/server/test_recompute_tp2.py`` and
``tests/server/test_deepseek.py``): they wrap the middleware's own per-rank steps, never SGLang.

**Older releases** (0.5.18 to 0.5.22, the tier's per-release modules,
``tests/server/test_release.py``): :data:`RELEASES` says, per release, which of the thirteen
differ there: the release's own variant of the override (another target, other
parameters) or the reason it is left out there. The release is read from the installed
SGLang's metadata (the release folder first on ``PYTHONPATH``); ``PDM_TEST_SGLANG_RELEASE``,
set by the harness, must equal it, or the server stops at start with both versions.
The variants on those releases:

- ``verify_greedy`` on 0.5.18 to 0.5.20: ``_verify_uses_greedy`` does not exist yet;
  ``eagle_utils.eagle_sample`` itself takes the greedy branch on ``_is_cpu`` (0.5.20
  ``eagle_utils.py`` around 784). With rejection sampling on and a batch not all greedy,
  ``eagle_sample`` runs with the module's ``_is_cpu`` False for its span (its sampling
  branch reads the flag nowhere else), so a CPU verify is greedy only when every request
  is: the rejection-sampling verify. An all-greedy batch runs untouched (the greedy
  branch's ``verify_tree_greedy_func`` reads ``_is_cpu`` to pick the CPU op).
- ``renorm`` on 0.5.18 to 0.5.22: the verify imports ``top_k_renorm_prob`` and
  ``top_p_renorm_prob`` from ``sgl_kernel`` on the CPU (0.5.21 ``eagle_utils.py`` around
  920), whose GPU kernels do not exist here: the same torch versions, on CPU tensors.
- ``reject_sampling_interpreted`` on 0.5.18 to 0.5.21: the kernel has no
  ``block_verification`` parameter yet; the same check with the release's parameters.
- ``deterministic_amx`` on 0.5.18 and 0.5.19: the list lives in ``server_args.py``.
- ``overlap_record_stream_cpu`` on 0.5.18 to 0.5.21 only (a gap of those releases):
  under the overlap schedule, ``FutureMap._resolve_spec_extras``
  (``managers/overlap_utils.py`` around 426 in 0.5.21, 417 in 0.5.18) calls
  ``indices.record_stream(torch.get_device_module(self.device).current_stream())``; on the
  CPU that stream is a ``torch.cpu.Stream`` and torch raises ``RuntimeError: unknown
  parameter type`` at the first batch (the health check's), killing the scheduler of an
  aggregated server and a decode alike. For that method's span ``record_stream`` on a CPU
  tensor does nothing, as 0.5.22 guards it (``if indices.device.type != "cpu":``);
  refused where that guard is present.

``PDM_CPU_GAPS`` selects the overrides (comma-separated names; default: all of the
release's).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

ENV_GAPS = "PDM_CPU_GAPS"
ENV_SEED = "PDM_TEST_SEED_BUILDER"
ENV_DRAFT_KV = "PDM_TEST_DRAFT_KV_DUMP"
ENV_RECOMPUTE_FAULT = "PDM_TEST_RECOMPUTE_FAULT"
ENV_RELEASE = "PDM_TEST_SGLANG_RELEASE"
#: The release whose targets :data:`GAPS` names (and any release newer than the table).
CURRENT = "0.5.23"


class OverrideRefused(RuntimeError):
    """An override's target changed (or vanished): the gap must be looked at again."""


@dataclass(frozen=True)
class Override:
    """One run-time replacement.

    ``module``/``attr``: what is replaced; ``params``: the parameter names the original
    must have (None: not a function, ``check`` decides); ``make``: given the module and
    the original, returns the replacement (or None to leave it; the override then
    only checked); ``check``: an extra test of the original, returning a refusal reason.
    """

    name: str
    module: str
    attr: str
    params: tuple[str, ...] | None
    make: Callable[[types.ModuleType, Any], Any]
    check: Callable[[Any], str] | None = None


def _say(msg: str) -> None:
    print(f"[cpu-gaps] {msg}", file=sys.stderr, flush=True)


def _refusal(ov: Override, orig: Any) -> str:
    if ov.check is not None:
        why = ov.check(orig)
        if why:
            return why
    if ov.params is None:
        return ""
    if not callable(orig):
        return f"{ov.attr} is {type(orig).__name__}, not a function"
    got = tuple(inspect.signature(orig).parameters)
    if got != ov.params:
        return f"{ov.attr} has parameters {got}, expected {ov.params}"
    return ""


def apply(ov: Override, module: types.ModuleType) -> Any:
    """Apply ``ov`` to the loaded ``module``; returns the original. Raises OverrideRefused."""
    if not hasattr(module, ov.attr):
        raise OverrideRefused(f"override {ov.name}: {ov.module}.{ov.attr} not found")
    orig = getattr(module, ov.attr)
    why = _refusal(ov, orig)
    if why:
        raise OverrideRefused(f"override {ov.name} refused: {ov.module}.{why}; SGLang changed, revisit the gap")
    new = ov.make(module, orig)
    if new is not None:
        setattr(module, ov.attr, new)
    _say(f"override {ov.name}: {ov.module}.{ov.attr}")
    return orig


# ---- the replacements --------------------------------------------------------------------


def _empty_meta(module: types.ModuleType, orig: Any) -> None:
    return None  # the finder decides whether the module body runs (see _Finder)


def _keep_amx(module: types.ModuleType, orig: Any) -> Any:
    def _attention_backend_platform_fallbacks(view: Any) -> dict[str, Any]:
        if view.attention_backend == "intel_amx" and view.device == "cpu":
            return {}
        result: dict[str, Any] = orig(view)
        return result

    passes = module.POST_PROCESS_PASSES
    for i, fn in enumerate(passes):
        if fn is orig:
            passes[i] = _attention_backend_platform_fallbacks
            break
    else:
        raise OverrideRefused("override amx_backend: the pass is not in POST_PROCESS_PASSES")
    return _attention_backend_platform_fallbacks


def _host_indices_flag(orig: Any) -> str:
    return "" if orig is True else f"supports_host_tensor_indices is {orig!r}, expected True"


def _no_host_indices(module: types.ModuleType, orig: Any) -> Any:
    return False


def _cpu_argmax(module: types.ModuleType, orig: Any) -> Any:
    def row_argmax(x: Any) -> Any:
        if x.device.type == "cpu":
            return x.argmax(dim=-1)
        return orig(x)

    return row_argmax


def _verify_greedy(module: types.ModuleType, orig: Any) -> Any:
    def _verify_uses_greedy(
        *, is_all_greedy: bool, is_cpu: bool, is_hip: bool, is_xpu: bool, use_rejection_sampling: bool
    ) -> bool:
        if is_cpu and use_rejection_sampling:
            return is_all_greedy
        return bool(
            orig(
                is_all_greedy=is_all_greedy,
                is_cpu=is_cpu,
                is_hip=is_hip,
                is_xpu=is_xpu,
                use_rejection_sampling=use_rejection_sampling,
            )
        )

    return _verify_uses_greedy


def _interpreter_on(orig: Any) -> str:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "TRITON_INTERPRET=1 is not set in this process (set it before Triton is imported)"
    return ""


def _none_only(orig: Any) -> str:
    return "" if orig is None else "the function exists now on CPU (the gap is closed upstream; drop the override)"


def top_k_renorm_prob(probs: Any, top_k: Any) -> Any:
    """Keep each row's ``top_k[i]`` largest probabilities (ties at the k-th kept) and renormalise."""
    import torch

    k = torch.as_tensor(top_k, device=probs.device).reshape(-1, 1).long().clamp(1, probs.shape[-1])
    kth = probs.sort(dim=-1, descending=True).values.gather(-1, k - 1)
    kept = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def top_p_renorm_prob(probs: Any, top_p: Any) -> Any:
    """Keep each row's smallest top set of mass ``>= top_p[i]`` (nucleus) and renormalise."""
    import torch

    p = torch.as_tensor(top_p, device=probs.device, dtype=probs.dtype).reshape(-1, 1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each entry
    keep_sorted = before < p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def _renorm_k(module: types.ModuleType, orig: Any) -> Any:
    return top_k_renorm_prob


def _renorm_p(module: types.ModuleType, orig: Any) -> Any:
    return top_p_renorm_prob


def _amx_absent(orig: Any) -> str:
    if not isinstance(orig, list):
        return f"DETERMINISTIC_ATTENTION_BACKEND_CHOICES is {type(orig).__name__}, not a list"
    if "intel_amx" in orig:
        return "DETERMINISTIC_ATTENTION_BACKEND_CHOICES has intel_amx already (the gap is closed upstream; drop the override)"
    return ""


def _add_amx(module: types.ModuleType, orig: Any) -> None:
    orig.append("intel_amx")  # in place: server_args and overrides import this list object
    return None


#: The refusal ``deterministic_rejection_cpu`` lifts, as it reads in SGLang 0.5.23's source.
DETERMINISTIC_REFUSAL = "Deterministic rejection sampling is currently supported only on"


def _source_says(name: str, needles: tuple[str, ...], gone: str) -> Callable[[Any], str]:
    """A check that function ``name``'s source still holds every one of ``needles`` (the
    refusal an override lifts); ``gone``: what it no longer does when one is missing."""

    def check(orig: Any) -> str:
        try:
            src = inspect.getsource(orig)
        except (OSError, TypeError) as exc:
            return f"{name}'s source cannot be read ({exc})"
        if any(n not in src for n in needles):
            return f"{name} no longer {gone} (drop the override)"
        return ""

    return check


_refusal_present = _source_says(
    "_handle_eagle_family",
    (DETERMINISTIC_REFUSAL, 'not cfg.device.startswith("cuda")'),
    "refuses deterministic rejection sampling off CUDA",
)


def cpu_hash_registered() -> bool:
    """Whether ``torch.ops.sgl_kernel.murmur_hash32_cpu`` resolves (``import sgl_kernel`` first)."""
    import torch

    try:
        import sgl_kernel  # noqa: F401  (on a CPU its loader falls back to common_ops: the stand-ins)
    except ImportError:
        return False
    return hasattr(torch.ops.sgl_kernel, "murmur_hash32_cpu")


def _deterministic_rejection(module: types.ModuleType, orig: Any) -> Any:
    source = "cpu_gaps.deterministic_rejection_cpu"

    def _handle_eagle_family(server_args: Any) -> None:
        cfg = module.resolving_view(server_args)
        if not (
            cfg.enable_deterministic_inference
            and cfg.device == "cpu"
            and cfg.speculative_use_rejection_sampling
            and cpu_hash_registered()
        ):
            orig(server_args)
            return
        # The flag is hidden from this one handler (it reads it only for that refusal and
        # for a ROCm-only default), then declared back: the resolved value is unchanged.
        module.declare_resolution(server_args, source, enable_deterministic_inference=False)
        try:
            orig(server_args)
        finally:
            module.declare_resolution(server_args, source, enable_deterministic_inference=True)
        _say("deterministic rejection sampling on cpu: murmur_hash32 -> torch.ops.sgl_kernel.murmur_hash32_cpu")

    _handle_eagle_family.__wrapped__ = orig  # type: ignore[attr-defined]  # SGLang's own, for tests
    return _handle_eagle_family


def _on_accelerator() -> bool:
    from sglang.srt.utils.common import get_dispatch_device_backend

    try:
        get_dispatch_device_backend()
    except RuntimeError:
        return False
    return True


def _batch_invariant_off_cpu(module: types.ModuleType, orig: Any) -> Any:
    def enable_batch_invariant_mode(enable_bmm: bool = True) -> None:
        if _on_accelerator():
            orig(enable_bmm)
            return
        _say(
            "batch_invariant_cpu: batch-invariant mode skipped (its kernels are Triton GPU kernels; CPU torch ops run)"
        )

    return enable_batch_invariant_mode


#: The refusal ``overlap_spec_cpu`` lifts, as it reads in SGLang 0.5.18 to 0.5.23's source.
OVERLAP_REFUSAL = "Overlap schedule is not implemented for speculative decoding on CPU"


_overlap_refusal_present = _source_says(
    "_disable_overlap_schedule_for_cpu",
    (OVERLAP_REFUSAL, "disable_overlap_schedule"),
    "turns the overlap schedule off on CPU",
)


def _keep_overlap(module: types.ModuleType, orig: Any) -> Any:
    def _disable_overlap_schedule_for_cpu(server_args: Any) -> None:
        # The original only refuses: on the CPU it turns the schedule off, elsewhere it does
        # nothing. Lifted for NGRAM too (_handle_ngram calls it), which the tier never serves.
        _say(
            "overlap_spec_cpu: SGLang's CPU refusal of the overlap schedule skipped (disable_overlap_schedule as given)"
        )

    _disable_overlap_schedule_for_cpu.__wrapped__ = orig  # type: ignore[attr-defined]  # SGLang's own, for tests
    return _disable_overlap_schedule_for_cpu


#: The guard SGLang 0.5.22 added before the overlap relay's ``record_stream`` (its absence is the gap).
RECORD_STREAM_GUARD = 'if indices.device.type != "cpu":'


def _relay_records_unguarded(cls: Any) -> str:
    """'' (apply) when ``FutureMap._resolve_spec_extras`` takes ``(self, batch)`` and calls
    ``indices.record_stream(`` without 0.5.22's CPU guard, as 0.5.18 to 0.5.21 do."""
    fn = getattr(cls, "_resolve_spec_extras", None)
    if fn is None:
        return f"{cls.__name__} has no _resolve_spec_extras"
    got = tuple(inspect.signature(fn).parameters)
    if got != ("self", "batch"):
        return f"{cls.__name__}._resolve_spec_extras has parameters {got}, expected ('self', 'batch')"
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError) as exc:
        return f"{cls.__name__}._resolve_spec_extras' source cannot be read ({exc})"
    if "indices.record_stream(" not in src:
        return f"{cls.__name__}._resolve_spec_extras no longer calls indices.record_stream (drop the override)"
    if RECORD_STREAM_GUARD in src:
        return f"{cls.__name__}._resolve_spec_extras skips record_stream on CPU itself (the gap is closed; drop the override)"
    return ""


def _no_cpu_record_stream(module: types.ModuleType, cls: Any) -> None:
    """``FutureMap._resolve_spec_extras`` of 0.5.18 to 0.5.21 (the overlap relay's read of
    the previous step's draft state) calls ``indices.record_stream(<the device module's
    current stream>)``, which on the CPU gets a ``torch.cpu.Stream`` and raises
    ``RuntimeError: unknown parameter type`` (a CPU tensor refuses ``torch.Stream`` too):
    for the span of that method, ``record_stream`` on a CPU tensor does nothing, as
    0.5.22 does (``if indices.device.type != "cpu":``); any other tensor's is the original."""
    import torch

    orig = cls._resolve_spec_extras

    def _resolve_spec_extras(self: Any, batch: Any) -> Any:
        own = "record_stream" in vars(torch.Tensor)
        real = torch.Tensor.record_stream

        def record_stream(tensor: Any, stream: Any) -> Any:
            if tensor.device.type == "cpu":
                return None  # no stream to order against: a CPU tensor's memory is freed in program order
            return real(tensor, stream)

        # Process-wide for the span (as mtp_cuda_sync's torch.cuda.synchronize): another
        # thread's call meanwhile skips a CPU tensor too; any other device's runs the original.
        torch.Tensor.record_stream = record_stream  # type: ignore[method-assign]  # restored below
        try:
            return orig(self, batch)
        finally:
            if own:
                torch.Tensor.record_stream = real  # type: ignore[method-assign]  # as it was
            else:
                del torch.Tensor.record_stream  # TensorBase's own shows through again

    _resolve_spec_extras.__wrapped__ = orig  # type: ignore[attr-defined]  # SGLang's own, for tests
    cls._resolve_spec_extras = _resolve_spec_extras


class _Inert:
    """What the inert proposal returns: ``[:, 0]`` of it is None, as if never built."""

    def __getitem__(self, key: Any) -> None:
        return None


def _inert_proposal(module: types.ModuleType, orig: Any) -> Any:
    def pd_first_draft_proposal(topk_index: Any, vocab_size: int) -> Any:
        return _Inert()

    return pd_first_draft_proposal


def _set_embed_and_head_params(cls: Any) -> str:
    fn = getattr(cls, "set_embed_and_head", None)
    if fn is None:
        return f"{cls.__name__} has no set_embed_and_head"
    got = tuple(inspect.signature(fn).parameters)
    return "" if got == ("self", "embed", "head") else f"{cls.__name__}.set_embed_and_head has parameters {got}"


def _no_cuda_sync_in_set_embed_and_head(module: types.ModuleType, cls: Any) -> None:
    """``set_embed_and_head`` (``MiMoV2MTP``'s, ``DeepseekV2ForCausalLM``'s) ends with
    ``torch.cuda.synchronize()``, which raises on a CPU build of torch: on the CPU there is
    no device work to wait for, so the call is a no-op for the span of that method (on an
    accelerator the original runs untouched)."""
    import torch

    orig = cls.set_embed_and_head

    def set_embed_and_head(self: Any, embed: Any, head: Any) -> Any:
        if torch.cuda.is_available():
            return orig(self, embed, head)
        real = torch.cuda.synchronize
        torch.cuda.synchronize = lambda *a, **k: None
        try:
            return orig(self, embed, head)
        finally:
            torch.cuda.synchronize = real

    cls.set_embed_and_head = set_embed_and_head


def _rs_verify_on_cpu(module: types.ModuleType, orig: Any) -> Any:
    """``eagle_sample`` of 0.5.18 to 0.5.20, which goes greedy on ``_is_cpu``: with rejection
    sampling on and a batch not all greedy, it runs with ``_is_cpu`` False (one scheduler
    thread calls it), so it takes the sampling branch, as :func:`_verify_greedy` on 0.5.23.
    An all-greedy batch runs untouched: the greedy branch calls ``verify_tree_greedy_func``,
    which reads ``_is_cpu`` too (to pick the CPU op); the sampling branch reads it nowhere."""

    def eagle_sample(*args: Any, **kwargs: Any) -> Any:
        batch = args[1] if len(args) > 1 else kwargs["batch"]
        if not (
            module._is_cpu
            and module.get_spec().speculative_use_rejection_sampling
            and not batch.sampling_info.is_all_greedy
        ):
            return orig(*args, **kwargs)
        module._is_cpu = False
        try:
            return orig(*args, **kwargs)
        finally:
            module._is_cpu = True

    eagle_sample.__wrapped__ = orig  # type: ignore[attr-defined]
    return eagle_sample


def _cpu_renorm(torch_version: Callable[[Any, Any], Any]) -> Callable[[types.ModuleType, Any], Any]:
    """The torch renormalisation on CPU tensors, ``sgl_kernel``'s own elsewhere."""

    def make(module: types.ModuleType, orig: Any) -> Any:
        def renorm(probs: Any, top: Any) -> Any:
            if probs.device.type == "cpu":
                return torch_version(probs, top)
            return orig(probs, top)

        return renorm

    return make


#: sgl-kernel's CPU attention ops of 0.5.18 and 0.5.19 had no KV scales: where the stand-ins'
#: schema (sgl-kernel 0.4.10's, ``sgl_cpu_ops.py``) takes them, and, by the number of
#: positional arguments a release passes, what goes at the end: 0.5.18's extend passes no
#: ``is_causal`` (its kernel had only causal extend), 0.5.19's passes it last.
_DECODE_SCALES_AT, _EXTEND_SCALES_AT = 3, 6
_DECODE_TAILS: dict[int, tuple[Any, ...]] = {17: ()}
_EXTEND_TAILS: dict[int, tuple[Any, ...]] = {19: (True,), 20: ()}
#: Where each op takes ``seq_lens`` (the release's own positional arguments).
_DECODE_SEQ_LENS_AT, _EXTEND_SEQ_LENS_AT = 10, 8


def _metadata_seq_lens(backend: Any, op: str, given: Any) -> Any:
    """The ``seq_lens`` 0.5.19 passes where 0.5.18 passes ``forward_batch.seq_lens``: the
    extend's from ``extend_metadata`` (a verify's includes its draft tokens), the draft
    decode's from ``draft_decode_metadata`` (each draft step's own lengths)."""
    import torch

    if op == "extend":
        meta = backend.extend_metadata
        lens = meta[0] if meta is not None else given
    else:
        meta = backend.draft_decode_metadata
        lens = meta[1] if meta is not None else given
    return lens if lens.dtype == torch.int64 else lens.to(torch.int64)


def _unscaled_ops(*, seq_lens_from_metadata: bool) -> Callable[[types.ModuleType, Any], None]:
    """``IntelAMXAttnBackend`` of 0.5.18/0.5.19 calls the CPU attention ops without KV
    scales: each instance's two ops get them as 1.0 (the tier's KV cache is bf16, never
    fp8; the scales multiply nothing else), and 0.5.18's extend gets ``is_causal=True``.

    ``seq_lens_from_metadata`` (0.5.18): that release's ``forward_extend`` and
    ``forward_decode`` overwrite the lengths they just read from the forward metadata with
    ``forward_batch.seq_lens`` (a CPU-backend bug, gone in 0.5.19): a verify then attends
    to ``seq_lens`` minus its draft tokens, a draft step to the target's lengths, and
    aggregated serving's own greedy outputs change from one run to the next. The ops get
    the metadata's lengths, as 0.5.19 passes them. Top-k 1 only (the tier's): with a
    larger top-k a draft step's lengths are ``bs * topk`` long, and 0.5.18 sizes a
    differently shaped layer's ``attn_logits`` from ``forward_batch``'s ``bs``."""

    def make(module: types.ModuleType, cls: Any) -> None:
        orig_init = cls.__init__

        def insert(backend: Any, name: str, at: int, tails: dict[int, tuple[Any, ...]], lens_at: int) -> Any:
            op = getattr(backend, f"{name}_attention_fwd")

            def call(*args: Any) -> Any:
                if len(args) not in tails:
                    raise TypeError(
                        f"cpu_gaps amx_unscaled_ops: {len(args)} arguments, these releases pass {sorted(tails)}"
                    )
                if seq_lens_from_metadata:
                    args = (*args[:lens_at], _metadata_seq_lens(backend, name, args[lens_at]), *args[lens_at + 1 :])
                return op(*args[:at], 1.0, 1.0, *args[at:], *tails[len(args)])

            return call

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            orig_init(self, *args, **kwargs)
            self.decode_attention_fwd = insert(self, "decode", _DECODE_SCALES_AT, _DECODE_TAILS, _DECODE_SEQ_LENS_AT)
            self.extend_attention_fwd = insert(self, "extend", _EXTEND_SCALES_AT, _EXTEND_TAILS, _EXTEND_SEQ_LENS_AT)

        cls.__init__ = __init__

    return make


def _amx_backend_without_scales(cls: Any) -> str:
    import inspect as _inspect

    try:
        src = _inspect.getsource(cls)
    except (OSError, TypeError) as exc:
        return f"IntelAMXAttnBackend's source cannot be read ({exc})"
    if "k_scale" in src:
        return "IntelAMXAttnBackend passes KV scales in this release (drop the override here)"
    return _method_params("__init__", ("self", "model_runner"))(cls)


def _amx_overwrites_seq_lens(cls: Any) -> str:
    """'' (apply) when both forward methods set ``seq_lens = forward_batch.seq_lens`` once
    more than they would to take the metadata's (extend: never; decode: in the branch
    without draft metadata), as 0.5.18's do."""
    import inspect as _inspect

    line = "seq_lens = forward_batch.seq_lens"
    for name, keeps in (("forward_extend", 0), ("forward_decode", 1)):
        try:
            src = _inspect.getsource(getattr(cls, name))
        except (AttributeError, OSError, TypeError) as exc:
            return f"IntelAMXAttnBackend.{name}'s source cannot be read ({exc})"
        if src.count(line) <= keeps:
            return f"IntelAMXAttnBackend.{name} keeps its metadata's seq_lens in this release (drop the 0.5.18 variant)"
    return ""


GAPS: tuple[Override, ...] = (
    Override("torchvision_meta", "torchvision.extension", "_has_ops", (), lambda m, o: None),
    Override(
        "amx_backend", "sglang.srt.arg_groups.overrides", "_attention_backend_platform_fallbacks", ("view",), _keep_amx
    ),
    Override(
        "prefill_host_indices",
        "sglang.srt.disaggregation.mooncake.conn",
        "MooncakeKVSender",
        None,
        lambda m, o: None,
        check=lambda cls: _host_indices_flag(getattr(cls, "supports_host_tensor_indices", None)),
    ),
    Override("row_argmax", "sglang.kernels.ops.speculative.row_argmax", "row_argmax", ("x",), _cpu_argmax),
    Override(
        "verify_greedy",
        "sglang.srt.speculative.eagle_utils",
        "_verify_uses_greedy",
        ("is_all_greedy", "is_cpu", "is_hip", "is_xpu", "use_rejection_sampling"),
        _verify_greedy,
    ),
    Override(
        "reject_sampling_interpreted",
        "sglang.kernels.ops.speculative.reject_sampling",
        "chain_speculative_sampling_triton",
        None,
        lambda m, o: None,
        check=lambda fn: _interpreter_on(fn) or _params(fn, _CHAIN_PARAMS),
    ),
    Override("renorm", "sglang.kernels.ops.sampling.renorm", "top_k_renorm_prob", None, _renorm_k, check=_none_only),
    Override(
        "deterministic_amx",
        "sglang.srt.arg_groups.choices",
        "DETERMINISTIC_ATTENTION_BACKEND_CHOICES",
        None,
        _add_amx,
        check=_amx_absent,
    ),
    Override(
        "deterministic_rejection_cpu",
        "sglang.srt.arg_groups.speculative_hook",
        "_handle_eagle_family",
        ("server_args",),
        _deterministic_rejection,
        check=_refusal_present,
    ),
    Override(
        "mtp_cuda_sync",
        "sglang.srt.models.mimo_v2_nextn",
        "MiMoV2MTP",
        None,
        _no_cuda_sync_in_set_embed_and_head,
        check=_set_embed_and_head_params,
    ),
    Override(
        "deepseek_cuda_sync",
        "sglang.srt.models.deepseek_v2",
        "DeepseekV2ForCausalLM",
        None,
        _no_cuda_sync_in_set_embed_and_head,
        check=_set_embed_and_head_params,
    ),
    Override(
        "batch_invariant_cpu",
        "sglang.srt.batch_invariant_ops.batch_invariant_ops",
        "enable_batch_invariant_mode",
        ("enable_bmm",),
        _batch_invariant_off_cpu,
    ),
    Override(
        "overlap_spec_cpu",
        "sglang.srt.arg_groups.speculative_hook",
        "_disable_overlap_schedule_for_cpu",
        ("server_args",),
        _keep_overlap,
        check=_overlap_refusal_present,
    ),
)
#: Applied with ``renorm`` (the same gap: both names are None on the CPU).
RENORM_P = Override(
    "renorm", "sglang.kernels.ops.sampling.renorm", "top_p_renorm_prob", None, _renorm_p, check=_none_only
)
SEED_BUILDER = Override(
    "seed_builder",
    "sglang.srt.speculative.eagle_disaggregation",
    "pd_first_draft_proposal",
    ("topk_index", "vocab_size"),
    _inert_proposal,
)


#: Releases without SGLang's own PD proposal (``pd_first_draft_proposal``, since 0.5.22):
#: their builder leaves ``draft_probs`` unset, the seed's failure, with no switch needed.
WITHOUT_PD_PROPOSAL = ("0.5.18", "0.5.19", "0.5.20", "0.5.21")
_EAGLE_SAMPLE = ("verify_input", "batch", "logits_output", "grammar_mask")


def _gap(name: str) -> Override:
    return next(ov for ov in GAPS if ov.name == name)


def _rs_verify(params: tuple[str, ...]) -> Override:
    return Override("verify_greedy", "sglang.srt.speculative.eagle_utils", "eagle_sample", params, _rs_verify_on_cpu)


_CPU_RENORM = (
    Override("renorm", "sgl_kernel", "top_k_renorm_prob", ("probs", "top_k"), _cpu_renorm(top_k_renorm_prob)),
    Override("renorm", "sgl_kernel", "top_p_renorm_prob", ("probs", "top_p"), _cpu_renorm(top_p_renorm_prob)),
)
_INTERPRETED_WITHOUT_BLOCK = Override(
    "reject_sampling_interpreted",
    "sglang.kernels.ops.speculative.reject_sampling",
    "chain_speculative_sampling_triton",
    None,
    lambda m, o: None,
    check=lambda fn: _interpreter_on(fn) or _params(fn, _CHAIN_PARAMS[:-1]),
)
_AMX_IN_SERVER_ARGS = Override(
    "deterministic_amx",
    "sglang.srt.server_args",
    "DETERMINISTIC_ATTENTION_BACKEND_CHOICES",
    None,
    _add_amx,
    check=_amx_absent,
)
_AMX_UNSCALED_OPS = Override(
    "amx_unscaled_ops",
    "sglang.srt.layers.attention.intel_amx_backend",
    "IntelAMXAttnBackend",
    None,
    _unscaled_ops(seq_lens_from_metadata=False),
    check=_amx_backend_without_scales,
)
_AMX_UNSCALED_OPS_0_5_18 = Override(
    "amx_unscaled_ops",
    "sglang.srt.layers.attention.intel_amx_backend",
    "IntelAMXAttnBackend",
    None,
    _unscaled_ops(seq_lens_from_metadata=True),
    check=lambda cls: _amx_backend_without_scales(cls) or _amx_overwrites_seq_lens(cls),
)
_NO_HOST_INDICES = (
    "no host tensor indices before 0.5.23 (MooncakeKVSender has no supports_host_tensor_indices); the "
    "prefill's only torch.cuda.Event is under the overlap schedule, which the tier's prefill turns off"
)
_NO_REFUSAL = "_handle_eagle_family has no device refusal of deterministic rejection sampling to lift in this release"
_NO_ROW_ARGMAX = "no Triton row_argmax in this release (sglang.kernels.ops.speculative.row_argmax absent)"
#: 0.5.18 to 0.5.21 only (0.5.22 guards the call itself): the overlap relay's ``record_stream``.
_RELAY_RECORD_STREAM = Override(
    "overlap_record_stream_cpu",
    "sglang.srt.managers.overlap_utils",
    "FutureMap",
    None,
    _no_cpu_record_stream,
    check=_relay_records_unguarded,
)

#: Per SGLang release older than :data:`CURRENT`, the overrides of :data:`GAPS` that differ
#: there: the release's variant(s) of that name, or the reason it is left out. The rest of
#: :data:`GAPS` applies unchanged (each still refused where its target differs). A name
#: outside :data:`GAPS` is a gap of that release only, applied after the others.
_RELEASE_0_5_19: dict[str, tuple[Override, ...] | str] = {
    "prefill_host_indices": _NO_HOST_INDICES,
    "row_argmax": _NO_ROW_ARGMAX,
    "verify_greedy": (_rs_verify(_EAGLE_SAMPLE),),
    "reject_sampling_interpreted": (_INTERPRETED_WITHOUT_BLOCK,),
    "renorm": _CPU_RENORM,
    "deterministic_amx": (_AMX_IN_SERVER_ARGS,),
    "deterministic_rejection_cpu": _NO_REFUSAL,
    "amx_unscaled_ops": (_AMX_UNSCALED_OPS,),
    "overlap_record_stream_cpu": (_RELAY_RECORD_STREAM,),
}
RELEASES: dict[str, dict[str, tuple[Override, ...] | str]] = {
    # 0.5.19's row, but its attention ops also get the metadata's seq_lens
    "0.5.18": {**_RELEASE_0_5_19, "amx_unscaled_ops": (_AMX_UNSCALED_OPS_0_5_18,)},
    "0.5.19": _RELEASE_0_5_19,
    "0.5.20": {
        "prefill_host_indices": _NO_HOST_INDICES,
        "row_argmax": _NO_ROW_ARGMAX,
        "verify_greedy": (_rs_verify((*_EAGLE_SAMPLE, "uno_target_max_top_k")),),
        "reject_sampling_interpreted": (_INTERPRETED_WITHOUT_BLOCK,),
        "renorm": _CPU_RENORM,
        "deterministic_rejection_cpu": _NO_REFUSAL,
        "overlap_record_stream_cpu": (_RELAY_RECORD_STREAM,),
    },
    "0.5.21": {
        "prefill_host_indices": _NO_HOST_INDICES,
        "reject_sampling_interpreted": (_INTERPRETED_WITHOUT_BLOCK,),
        "renorm": _CPU_RENORM,
        "deterministic_rejection_cpu": _NO_REFUSAL,
        "overlap_record_stream_cpu": (_RELAY_RECORD_STREAM,),
    },
    "0.5.22": {
        "prefill_host_indices": _NO_HOST_INDICES,
        "renorm": _CPU_RENORM,
        "deterministic_rejection_cpu": _NO_REFUSAL,
    },
}


def release_gaps(release: str) -> tuple[list[Override], dict[str, str]]:
    """The overrides of SGLang ``release`` in :data:`GAPS`' order (a name may have two, as
    ``renorm``), and the names left out there with the reason. A release outside
    :data:`RELEASES` (0.5.23, or newer) gets :data:`GAPS` as they are."""
    diff = RELEASES.get(release, {})
    out: list[Override] = []
    left_out: dict[str, str] = {}
    for ov in GAPS:
        alt = diff.get(ov.name)
        if isinstance(alt, str):
            left_out[ov.name] = alt
        elif alt is not None:
            out.extend(alt)
        else:
            out.append(ov)
    if "renorm" not in diff:  # GAPS' renorm: its top-p half goes last, as it always has
        out.append(RENORM_P)
    names = {ov.name for ov in GAPS}
    for name, alt in diff.items():
        if name not in names and not isinstance(alt, str):
            out.extend(alt)
    return out, left_out


def installed_release() -> str:
    """The version of the ``sglang`` distribution this interpreter imports (its metadata,
    first on ``sys.path``: a release folder ahead of the venv wins)."""
    from importlib.metadata import version

    return version("sglang")


def _method_params(name: str, expected: tuple[str, ...]) -> Callable[[Any], str]:
    def check(cls: Any) -> str:
        fn = getattr(cls, name, None)
        if fn is None:
            return f"{cls.__name__} has no {name}"
        got = tuple(inspect.signature(fn).parameters)
        return "" if got == expected else f"{cls.__name__}.{name} has parameters {got}, expected {expected}"

    return check


_PREFILL_RESULT = ("self", "batch", "result")
_COMMIT = ("self", "decode_req")


def _dump_before_prefill_result(module: types.ModuleType, cls: Any) -> None:
    """Each chain step's draft KV of the batch's requests, before SGLang processes the prefill's result."""
    import draft_kv_dump

    orig = cls.process_batch_result_disagg_prefill

    def process_batch_result_disagg_prefill(self: Any, batch: Any, result: Any) -> Any:
        draft_kv_dump.on_prefill(self, batch)
        return orig(self, batch, result)

    cls.process_batch_result_disagg_prefill = process_batch_result_disagg_prefill


def _dump_after_commit(module: types.ModuleType, cls: Any) -> None:
    """Each chain step's draft KV of a request once its transfer landed on the decode."""
    import draft_kv_dump

    orig = cls._commit_transfer_to_req
    is_fake = module._is_fake_transfer

    def _commit_transfer_to_req(self: Any, decode_req: Any) -> Any:
        out = orig(self, decode_req)
        draft_kv_dump.on_decode(self, decode_req, is_fake)
        return out

    cls._commit_transfer_to_req = _commit_transfer_to_req


DRAFT_KV_DUMP = (
    Override(
        "draft_kv_prefill",
        "sglang.srt.disaggregation.prefill",
        "SchedulerDisaggregationPrefillMixin",
        None,
        _dump_before_prefill_result,
        check=_method_params("process_batch_result_disagg_prefill", _PREFILL_RESULT),
    ),
    Override(
        "draft_kv_decode",
        "sglang.srt.disaggregation.decode",
        "DecodeTransferQueue",
        None,
        _dump_after_commit,
        check=_method_params("_commit_transfer_to_req", _COMMIT),
    ),
)


def _methods(expected: dict[str, tuple[str, ...]]) -> Callable[[Any], str]:
    """A check that each named method of a class has the expected parameters."""
    checks = [_method_params(name, params) for name, params in expected.items()]

    def check(cls: Any) -> str:
        return next((why for why in (c(cls) for c in checks) if why), "")

    return check


def _fault_source(module: types.ModuleType, cls: Any) -> None:
    import recompute_fault

    recompute_fault.wrap_source(cls)


def _fault_head(module: types.ModuleType, cls: Any) -> None:
    import recompute_fault

    recompute_fault.wrap_head(cls)


#: The per-rank steps of decode-only recompute the fault switch wraps (pd_middleware's own).
RECOMPUTE_SOURCE_METHODS = {
    "bind_head": ("self", "head", "vocab_size", "num_steps", "rejection_sampling", "group", "draw"),
    "prepare": ("self", "batch"),
    "_hidden": ("self", "reqs"),
    "_stage": ("self", "rec", "tokens"),
}
RECOMPUTE_FAULT = (
    Override(
        "recompute_fault_source",
        "pd_middleware.integrations.sglang.recompute",
        "RecomputeSource",
        None,
        _fault_source,
        check=_methods(RECOMPUTE_SOURCE_METHODS),
    ),
    Override(
        "recompute_fault_head",
        "pd_middleware.integrations.sglang.draft_head",
        "SGLangDraftHead",
        None,
        _fault_head,
        check=_method_params("_local", ("self", "hidden")),
    ),
)

_CHAIN_PARAMS = (
    "predicts",
    "accept_index",
    "accept_token_num",
    "candidates",
    "retrive_index",
    "retrive_next_token",
    "retrive_next_sibling",
    "uniform_samples",
    "uniform_samples_for_final_sampling",
    "target_probs",
    "draft_probs",
    "threshold_single",
    "threshold_acc",
    "deterministic",
    "block_verification",
)


def _params(fn: Any, expected: tuple[str, ...]) -> str:
    got = tuple(inspect.signature(fn).parameters)
    return "" if got == expected else f"parameters {got}, expected {expected}"


def _patch_prefill_sender(module: types.ModuleType) -> None:
    # Gap 3 replaces a class attribute, not a module attribute.
    module.MooncakeKVSender.supports_host_tensor_indices = False


class _Finder(importlib.abc.MetaPathFinder):
    """Applies the overrides of a module right after the module's own code ran."""

    def __init__(self, overrides: Sequence[Override]) -> None:
        self.by_module: dict[str, list[Override]] = {}
        for ov in overrides:
            self.by_module.setdefault(ov.module, []).append(ov)
        self.meta = any(ov.name == "torchvision_meta" for ov in overrides)

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name == "torchvision._meta_registrations" and self.meta:
            return self._meta_spec(name, path)
        ovs = self.by_module.get(name)
        if not ovs:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            for ov in ovs:
                apply(ov, module)
                if ov.name == "prefill_host_indices":
                    _patch_prefill_sender(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def _meta_spec(self, name: str, path: Any) -> Any:
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            ext = sys.modules.get("torchvision.extension")
            if ext is not None and not ext._has_ops():
                _say("override torchvision_meta: torchvision._meta_registrations skipped (_C has no ops)")
                return
            run(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_installed: _Finder | None = None


def _release_checked(env: Any) -> str:
    """The installed SGLang release, said on stderr; refused when ``PDM_TEST_SGLANG_RELEASE``
    names another (the release folder is not first on ``PYTHONPATH``)."""
    try:
        release = installed_release()
    except Exception:  # no SGLang here (a builder process): the current table, nothing to check
        return CURRENT
    want = env.get(ENV_RELEASE)
    if want and want != release:
        raise OverrideRefused(f"{ENV_RELEASE}={want}, but this interpreter imports SGLang {release}")
    _, left_out = release_gaps(release)
    _say(f"SGLang {release}" + "".join(f"; {name} left out: {why}" for name, why in left_out.items()))
    return release


def selected(environ: Any = None, release: str | None = None) -> list[Override]:
    """The overrides ``PDM_CPU_GAPS``, ``PDM_TEST_SEED_BUILDER``, ``PDM_TEST_DRAFT_KV_DUMP`` and
    ``PDM_TEST_RECOMPUTE_FAULT`` ask for, of SGLang ``release`` (:data:`CURRENT` when None). Raises ValueError on an
    unknown name, or on a seed builder asked of a release that has no fix to make inert."""
    env = os.environ if environ is None else environ
    release = CURRENT if release is None else release
    names = [n.strip() for n in env.get(ENV_GAPS, "").split(",") if n.strip()]
    known = {ov.name for ov in GAPS} | {name for row in RELEASES.values() for name in row}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(f"{ENV_GAPS}: unknown override(s) {unknown}; known: {sorted(known)}")
    table, _left_out = release_gaps(release)
    chosen = [ov for ov in table if not names or ov.name in names]
    if env.get(ENV_SEED) == "1":
        if release in WITHOUT_PD_PROPOSAL:
            raise ValueError(
                f"{ENV_SEED}=1: SGLang {release} has no pd_first_draft_proposal (its builder is the seed's already)"
            )
        chosen.append(SEED_BUILDER)
    if env.get(ENV_DRAFT_KV):
        chosen.extend(DRAFT_KV_DUMP)
    if env.get(ENV_RECOMPUTE_FAULT):
        chosen.extend(RECOMPUTE_FAULT)
    return chosen


def install_from_env(environ: Any = None) -> _Finder:
    """Put the finder for the selected overrides first on ``sys.meta_path`` (once per process)."""
    global _installed
    if _installed is None:
        release = _release_checked(os.environ if environ is None else environ)
        chosen = selected(environ, release)
        for ov in chosen:
            if ov.module in sys.modules:
                raise OverrideRefused(f"override {ov.name}: {ov.module} was imported before sitecustomize")
        _installed = _Finder(chosen)
        sys.meta_path.insert(0, _installed)
    return _installed
