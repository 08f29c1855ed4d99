"""The CPU gap overrides (site/cpu_gaps.py): applied when the target matches, refused when it changed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import cpu_gaps  # tests/server/site is on sys.path (conftest.py)
import pytest
import torch


def _module(**attrs: object) -> types.ModuleType:
    m = types.ModuleType("fake_sglang_module")
    m.__dict__.update(attrs)
    return m


def test_an_override_applies_to_its_target_and_logs(capsys: pytest.CaptureFixture[str]) -> None:
    def row_argmax(x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the GPU kernel must not run on CPU")

    ov = next(o for o in cpu_gaps.GAPS if o.name == "row_argmax")
    mod = _module(row_argmax=row_argmax)
    assert cpu_gaps.apply(ov, mod) is row_argmax
    x = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.1, 0.4]])
    assert mod.row_argmax(x).tolist() == [1, 0]
    assert f"override row_argmax: {ov.module}.row_argmax" in capsys.readouterr().err


def test_an_override_is_refused_when_its_target_signature_changed() -> None:
    def _verify_uses_greedy(*, is_all_greedy: bool, is_cpu: bool) -> bool:
        return True

    ov = next(o for o in cpu_gaps.GAPS if o.name == "verify_greedy")
    mod = _module(_verify_uses_greedy=_verify_uses_greedy)
    with pytest.raises(
        cpu_gaps.OverrideRefused,
        match=r"override verify_greedy refused: .*has parameters \('is_all_greedy', 'is_cpu'\)",
    ):
        cpu_gaps.apply(ov, mod)
    assert mod._verify_uses_greedy is _verify_uses_greedy  # untouched
    with pytest.raises(cpu_gaps.OverrideRefused, match="not found"):
        cpu_gaps.apply(ov, _module())


def test_the_renorm_override_is_refused_once_sglang_has_the_function() -> None:
    ov = next(o for o in cpu_gaps.GAPS if o.name == "renorm")
    with pytest.raises(cpu_gaps.OverrideRefused, match="closed upstream"):
        cpu_gaps.apply(ov, _module(top_k_renorm_prob=lambda p, k: p))


def test_verify_greedy_keeps_sampling_on_cpu_with_rejection_sampling() -> None:
    ov = next(o for o in cpu_gaps.GAPS if o.name == "verify_greedy")

    def orig(*, is_all_greedy: bool, is_cpu: bool, is_hip: bool, is_xpu: bool, use_rejection_sampling: bool) -> bool:
        return is_all_greedy or is_cpu or is_xpu

    new = ov.make(_module(), orig)
    kw = {"is_cpu": True, "is_hip": False, "is_xpu": False}
    assert new(is_all_greedy=False, use_rejection_sampling=True, **kw) is False
    assert new(is_all_greedy=True, use_rejection_sampling=True, **kw) is True
    assert new(is_all_greedy=False, use_rejection_sampling=False, **kw) is True  # SGLang's rule without it


def test_unknown_gap_names_are_refused() -> None:
    with pytest.raises(ValueError, match=r"PDM_CPU_GAPS: unknown override\(s\) \['rowargmax'\]"):
        cpu_gaps.selected({cpu_gaps.ENV_GAPS: "rowargmax"})
    names = [o.name for o in cpu_gaps.selected({})]
    assert names[: len(cpu_gaps.GAPS)] == [o.name for o in cpu_gaps.GAPS] and "seed_builder" not in names
    assert "seed_builder" in [o.name for o in cpu_gaps.selected({cpu_gaps.ENV_SEED: "1"})]


@pytest.mark.parametrize("rows", [1, 5])
def test_top_k_and_top_p_renorm_against_a_plain_reference(rows: int) -> None:
    g = torch.Generator().manual_seed(7)
    probs = torch.softmax(torch.randn(rows, 12, generator=g), dim=-1)
    ks = torch.randint(1, 13, (rows,), generator=g)
    ps = torch.rand(rows, generator=g)
    got_k = cpu_gaps.top_k_renorm_prob(probs, ks)
    got_p = cpu_gaps.top_p_renorm_prob(probs, ps)
    for i in range(rows):
        order = probs[i].argsort(descending=True).tolist()
        keep_k = set(order[: int(ks[i])])
        want = torch.tensor([probs[i, j] if j in keep_k else 0.0 for j in range(12)])
        torch.testing.assert_close(got_k[i], want / want.sum())
        keep_p, mass = set(), 0.0
        for j in order:  # the smallest top set with mass >= p
            keep_p.add(j)
            mass += float(probs[i, j])
            if mass >= float(ps[i]):
                break
        want = torch.tensor([probs[i, j] if j in keep_p else 0.0 for j in range(12)])
        torch.testing.assert_close(got_p[i], want / want.sum())


# ---- the deterministic-inference gaps (open only with --enable-deterministic-inference) ----


def _gap(name: str) -> cpu_gaps.Override:
    return next(o for o in cpu_gaps.GAPS if o.name == name)


def test_deterministic_amx_adds_intel_amx_to_the_same_list(capsys: pytest.CaptureFixture[str]) -> None:
    ov = _gap("deterministic_amx")
    choices = ["fa3", "triton"]
    mod = _module(DETERMINISTIC_ATTENTION_BACKEND_CHOICES=choices)
    cpu_gaps.apply(ov, mod)
    assert mod.DETERMINISTIC_ATTENTION_BACKEND_CHOICES is choices  # importers of the name see it too
    assert choices == ["fa3", "triton", "intel_amx"]
    assert "override deterministic_amx: sglang.srt.arg_groups.choices" in capsys.readouterr().err
    with pytest.raises(cpu_gaps.OverrideRefused, match="has intel_amx already .*closed upstream"):
        cpu_gaps.apply(ov, _module(DETERMINISTIC_ATTENTION_BACKEND_CHOICES=["intel_amx"]))
    with pytest.raises(cpu_gaps.OverrideRefused, match="is tuple, not a list"):
        cpu_gaps.apply(ov, _module(DETERMINISTIC_ATTENTION_BACKEND_CHOICES=("fa3",)))


class _Args:
    """A stand-in server_args: raw fields, and SGLang-style declarations (last writer wins)."""

    def __init__(self, **raw: object) -> None:
        self.raw = raw
        self.declared: list[tuple[str, dict[str, object]]] = []


class _View:
    def __init__(self, args: _Args) -> None:
        self._args = args

    def __getattr__(self, name: str) -> object:
        for _, d in reversed(self._args.declared):
            if name in d:
                return d[name]
        return self._args.raw[name]


def _eagle_family_module(seen: list[object]) -> types.ModuleType:
    def resolving_view(server_args: _Args) -> _View:
        return _View(server_args)

    def declare_resolution(server_args: _Args, source: str, **fields: object) -> None:
        server_args.declared.append((source, fields))

    def _handle_eagle_family(server_args: _Args) -> None:  # SGLang 0.5.23's refusal, as it reads
        cfg = resolving_view(server_args)
        if cfg.speculative_use_rejection_sampling and (
            cfg.enable_deterministic_inference and not cfg.device.startswith("cuda")
        ):
            raise ValueError("Deterministic rejection sampling is currently supported only on CUDA-compatible devices")
        seen.append(cfg.enable_deterministic_inference)

    return _module(
        resolving_view=resolving_view, declare_resolution=declare_resolution, _handle_eagle_family=_handle_eagle_family
    )


@pytest.mark.parametrize(
    ("device", "hash_op", "outcome"),
    [("cpu", True, "runs"), ("cpu", False, "refused by SGLang"), ("cuda", False, "untouched")],
)
def test_deterministic_rejection_cpu_hides_the_flag_from_one_handler_only_on_cpu_with_the_hash(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], device: str, hash_op: bool, outcome: str
) -> None:
    seen: list[object] = []
    mod = _eagle_family_module(seen)
    cpu_gaps.apply(_gap("deterministic_rejection_cpu"), mod)
    monkeypatch.setattr(cpu_gaps, "cpu_hash_registered", lambda: hash_op)
    args = _Args(device=device, enable_deterministic_inference=True, speculative_use_rejection_sampling=True)
    if outcome == "refused by SGLang":
        with pytest.raises(ValueError, match="supported only on CUDA-compatible devices"):
            mod._handle_eagle_family(args)
        return
    mod._handle_eagle_family(args)
    assert _View(args).enable_deterministic_inference is True  # the resolved value is unchanged
    if outcome == "runs":
        assert seen == [False]  # hidden from that handler only
        assert "deterministic rejection sampling on cpu" in capsys.readouterr().err
    else:
        assert seen == [True] and args.declared == []


def test_deterministic_rejection_cpu_is_refused_once_sglang_drops_its_refusal() -> None:
    def _handle_eagle_family(server_args: object) -> None:
        return None

    with pytest.raises(cpu_gaps.OverrideRefused, match="no longer refuses deterministic rejection sampling off CUDA"):
        cpu_gaps.apply(_gap("deterministic_rejection_cpu"), _module(_handle_eagle_family=_handle_eagle_family))


@pytest.mark.parametrize("accelerator", [False, True])
def test_batch_invariant_cpu_skips_the_gpu_kernels_only_off_an_accelerator(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], accelerator: bool
) -> None:
    calls: list[bool] = []

    def enable_batch_invariant_mode(enable_bmm: bool = True) -> None:
        calls.append(enable_bmm)

    mod = _module(enable_batch_invariant_mode=enable_batch_invariant_mode)
    cpu_gaps.apply(_gap("batch_invariant_cpu"), mod)
    monkeypatch.setattr(cpu_gaps, "_on_accelerator", lambda: accelerator)
    mod.enable_batch_invariant_mode(False)
    assert calls == ([False] if accelerator else [])
    assert ("batch-invariant mode skipped" in capsys.readouterr().err) is not accelerator


def _sglang() -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (make setup-sglang)")


@pytest.mark.sglang
def test_the_deterministic_targets_match_sglang_0_5_23() -> None:
    """Each override's check passes on SGLang's real target, and the CPU gap it covers is real here."""
    _sglang()
    from _sglang_import import import_sglang

    for ov in (_gap("deterministic_amx"), _gap("deterministic_rejection_cpu"), _gap("batch_invariant_cpu")):
        mod = import_sglang(ov.module)
        target = getattr(mod, ov.attr)
        assert cpu_gaps._refusal(ov, target) == "", ov.name
    common = import_sglang("sglang.srt.utils.common")
    with pytest.raises(RuntimeError, match="No supported accelerator"):
        common.get_dispatch_device_backend()


_RESOLVE = r"""
import json, sys
from sglang.srt.server_args import prepare_server_args
m = sys.argv[1]
argv = ["--model-path", m + "/target", "--device", "cpu", "--attention-backend", "intel_amx",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", m + "/eagle3",
        "--speculative-eagle-topk", "1", "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4",
        "--speculative-use-rejection-sampling", "--enable-deterministic-inference"]
out = {}
from sglang.srt.arg_groups.overrides import resolved_view
def resolve():
    args = prepare_server_args(argv)
    args.resolve_once()
    return resolved_view(args)
v = resolve()
out["with"] = [v.enable_deterministic_inference, v.attention_backend, v.disable_radix_cache]
from sglang.srt.arg_groups import choices, speculative_hook
choices.DETERMINISTIC_ATTENTION_BACKEND_CHOICES.remove("intel_amx")  # SGLang's own list again
def attempt():
    try:
        resolve()
        return "resolved"
    except ValueError as exc:
        return str(exc)
out["amx"] = attempt()
choices.DETERMINISTIC_ATTENTION_BACKEND_CHOICES.append("intel_amx")
speculative_hook._handle_eagle_family = speculative_hook._handle_eagle_family.__wrapped__
out["rejection"] = attempt()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.sglang
@pytest.mark.server  # SGLang's argument resolution imports torchvision: make setup-server
def test_sglang_resolves_the_tier_flags_with_deterministic_inference_only_with_the_overrides() -> None:
    """SGLang's real argument resolution, in a fresh interpreter (the overrides apply at import):
    the tier's flags with ``--enable-deterministic-inference`` resolve with the overrides; with
    each undone, SGLang refuses with its own message (the negative control)."""
    _sglang()
    import os

    site = Path(cpu_gaps.__file__).resolve().parent
    models = site.parent / "models" / "trained"
    env = {k: v for k, v in os.environ.items() if k not in (cpu_gaps.ENV_GAPS, cpu_gaps.ENV_SEED)}
    env.update(PYTHONPATH=str(site), SGLANG_USE_CPU_ENGINE="1", TRITON_INTERPRET="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", _RESOLVE, str(models)], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT ") :])
    assert out["with"] == [True, "intel_amx", True]  # radix cache off: SGLang's rule for this backend
    assert (
        "attention backends are supported for deterministic inference, but you explicitly specified 'intel_amx'"
        in (out["amx"])
    )
    assert out["rejection"].startswith("Deterministic rejection sampling is currently supported only on CUDA")
    assert "[cpu-gaps] deterministic rejection sampling on cpu" in proc.stderr


class _SetsEmbedAndHead:
    """A stand-in for ``MiMoV2MTP`` / ``DeepseekV2ForCausalLM`` whose ``set_embed_and_head`` ends as SGLang's does."""

    def set_embed_and_head(self, embed: object, head: object) -> str:
        torch.cuda.synchronize()  # raises on a CPU build of torch
        return f"{embed}/{head}"


_CUDA_SYNC_GAPS = [("mtp_cuda_sync", "MiMoV2MTP"), ("deepseek_cuda_sync", "DeepseekV2ForCausalLM")]


@pytest.mark.parametrize(("gap", "cls_name"), _CUDA_SYNC_GAPS)
def test_cuda_sync_gap_lets_set_embed_and_head_run_on_cpu_only_for_that_method(gap: str, cls_name: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the original runs untouched there")
    cls = type(cls_name, (_SetsEmbedAndHead,), {})
    sub = type("Subclass", (cls,), {})  # DeepseekV3ForCausalLMNextN inherits the method
    with pytest.raises((AssertionError, RuntimeError)):  # the gap is real here: the original raises
        cls().set_embed_and_head("e", "h")
    ov = _gap(gap)
    assert (ov.attr, ov.check) == (cls_name, cpu_gaps._set_embed_and_head_params)
    cpu_gaps.apply(ov, _module(**{cls_name: cls}))
    assert cls().set_embed_and_head("e", "h") == "e/h"
    assert sub().set_embed_and_head("e", "h") == "e/h"
    with pytest.raises((AssertionError, RuntimeError)):  # torch.cuda.synchronize itself is restored
        torch.cuda.synchronize()


@pytest.mark.parametrize(("gap", "cls_name"), _CUDA_SYNC_GAPS)
def test_cuda_sync_gap_is_refused_when_the_method_changed(gap: str, cls_name: str) -> None:
    def changed(self: object, embed: object, head: object, extra: object) -> None: ...

    with pytest.raises(cpu_gaps.OverrideRefused, match=f"{cls_name}.set_embed_and_head has parameters"):
        cpu_gaps.apply(_gap(gap), _module(**{cls_name: type(cls_name, (), {"set_embed_and_head": changed})}))
    with pytest.raises(cpu_gaps.OverrideRefused, match=f"{cls_name} has no set_embed_and_head"):
        cpu_gaps.apply(_gap(gap), _module(**{cls_name: type(cls_name, (), {})}))


@pytest.mark.sglang
@pytest.mark.server  # SGLang's MiMo-V2 and DeepSeek modules import sgl-kernel's package: make setup-server
@pytest.mark.parametrize("gap", [g for g, _ in _CUDA_SYNC_GAPS])
def test_cuda_sync_gap_target_matches_sglang_0_5_23(gap: str) -> None:
    _sglang()
    from _sglang_import import import_sglang

    ov = _gap(gap)
    cls = getattr(import_sglang(ov.module), ov.attr)
    assert cpu_gaps._refusal(ov, cls) == ""
    import inspect

    assert "torch.cuda.synchronize()" in inspect.getsource(cls.set_embed_and_head)  # the gap is still there


# ---- the overlap scheduler (spec v2 overlapped on the CPU) ------------------------------


def _overlap_module() -> types.ModuleType:
    """SGLang's ``_disable_overlap_schedule_for_cpu`` as it reads in 0.5.18 (plain fields)."""

    def _disable_overlap_schedule_for_cpu(server_args: types.SimpleNamespace) -> None:
        if server_args.device != "cpu" or server_args.disable_overlap_schedule:
            return
        server_args.disable_overlap_schedule = True
        print("Overlap schedule is not implemented for speculative decoding on CPU.")

    return _module(_disable_overlap_schedule_for_cpu=_disable_overlap_schedule_for_cpu)


def test_overlap_spec_cpu_keeps_the_overlap_schedule_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    mod = _overlap_module()
    args = types.SimpleNamespace(device="cpu", disable_overlap_schedule=False)
    mod._disable_overlap_schedule_for_cpu(args)  # negative control: SGLang's own turns it off
    assert args.disable_overlap_schedule is True
    assert cpu_gaps.OVERLAP_REFUSAL in capsys.readouterr().out
    orig = cpu_gaps.apply(_gap("overlap_spec_cpu"), mod)
    args = types.SimpleNamespace(device="cpu", disable_overlap_schedule=False)
    mod._disable_overlap_schedule_for_cpu(args)
    assert args.disable_overlap_schedule is False
    assert mod._disable_overlap_schedule_for_cpu.__wrapped__ is orig
    out = capsys.readouterr()
    assert cpu_gaps.OVERLAP_REFUSAL not in out.out
    assert (
        "override overlap_spec_cpu: sglang.srt.arg_groups.speculative_hook._disable_overlap_schedule_for_cpu" in out.err
    )
    assert "overlap_spec_cpu: SGLang's CPU refusal of the overlap schedule skipped" in out.err
    asked = types.SimpleNamespace(device="cpu", disable_overlap_schedule=True)  # --disable-overlap-schedule
    mod._disable_overlap_schedule_for_cpu(asked)
    assert asked.disable_overlap_schedule is True


def test_overlap_spec_cpu_is_refused_when_the_function_changed() -> None:
    def changed(server_args: types.SimpleNamespace, algorithm: object) -> None:
        server_args.disable_overlap_schedule = True
        print("Overlap schedule is not implemented for speculative decoding on CPU.")

    with pytest.raises(cpu_gaps.OverrideRefused, match=r"has parameters \('server_args', 'algorithm'\)"):
        cpu_gaps.apply(_gap("overlap_spec_cpu"), _module(_disable_overlap_schedule_for_cpu=changed))

    def _disable_overlap_schedule_for_cpu(server_args: object) -> None:
        return None  # upstream implemented overlap on CPU: nothing left to lift

    with pytest.raises(cpu_gaps.OverrideRefused, match="no longer turns the overlap schedule off on CPU"):
        cpu_gaps.apply(
            _gap("overlap_spec_cpu"), _module(_disable_overlap_schedule_for_cpu=_disable_overlap_schedule_for_cpu)
        )
    with pytest.raises(cpu_gaps.OverrideRefused, match="not found"):
        cpu_gaps.apply(_gap("overlap_spec_cpu"), _module())


class _FutureMap:
    """SGLang 0.5.21's ``FutureMap._resolve_spec_extras`` in the shape the override checks:
    ``indices.record_stream(<the device module's current stream>)``, unguarded."""

    device = "cpu"

    def __init__(self) -> None:
        self.gathered: list[list[int]] = []

    def _resolve_spec_extras(self, batch: torch.Tensor) -> None:
        indices = batch
        indices.record_stream(torch.get_device_module(self.device).current_stream())
        self.gathered.append(indices.tolist())


def _future_map(base: type = _FutureMap) -> type:
    return type("FutureMap", (base,), {})  # a fresh class per test: the override patches it


def test_overlap_record_stream_cpu_skips_record_stream_on_cpu_tensors_for_that_method_only() -> None:
    cls = _future_map()
    with pytest.raises(RuntimeError, match="unknown parameter type"):  # the gap is real here (0.5.21's crash)
        cls()._resolve_spec_extras(torch.tensor([3, 1]))
    (ov,) = cpu_gaps.RELEASES["0.5.21"]["overlap_record_stream_cpu"]  # type: ignore[misc]
    cpu_gaps.apply(ov, _module(FutureMap=cls))
    fm = cls()
    fm._resolve_spec_extras(torch.tensor([3, 1]))
    assert fm.gathered == [[3, 1]]
    assert "record_stream" not in vars(torch.Tensor)  # TensorBase's own again after the call
    with pytest.raises(RuntimeError, match="unknown parameter type"):
        torch.tensor([1]).record_stream(torch.cpu.current_stream())
    # Another device's tensor reaches torch's own record_stream (a meta tensor: it refuses the CPU stream).
    with pytest.raises(RuntimeError, match="unknown parameter type"):
        fm._resolve_spec_extras(torch.empty(2, device="meta"))
    assert "record_stream" not in vars(torch.Tensor)


def test_overlap_record_stream_cpu_is_refused_where_the_relay_guards_it_or_changed() -> None:
    (ov,) = cpu_gaps.RELEASES["0.5.18"]["overlap_record_stream_cpu"]  # type: ignore[misc]

    class Guarded(_FutureMap):  # 0.5.22's own fix
        def _resolve_spec_extras(self, batch: torch.Tensor) -> None:
            indices = batch
            if indices.device.type != "cpu":
                indices.record_stream(torch.get_device_module(self.device).current_stream())

    class NoCall(_FutureMap):
        def _resolve_spec_extras(self, batch: torch.Tensor) -> None:
            return None

    class Changed(_FutureMap):
        def _resolve_spec_extras(self, batch: torch.Tensor, stream: object) -> None:  # type: ignore[override]
            return None

    cases = [
        (Guarded, "skips record_stream on CPU itself"),
        (NoCall, "no longer calls indices.record_stream"),
        (Changed, r"_resolve_spec_extras has parameters \('self', 'batch', 'stream'\)"),
        (type("FutureMap", (), {}), "FutureMap has no _resolve_spec_extras"),
    ]
    for base, why in cases:
        with pytest.raises(cpu_gaps.OverrideRefused, match=why):
            cpu_gaps.apply(ov, _module(FutureMap=_future_map(base)))


@pytest.mark.parametrize("release", [*sorted(cpu_gaps.RELEASES), cpu_gaps.CURRENT])
def test_every_release_keeps_the_overlap_schedule_and_the_older_ones_skip_the_relays_record_stream(
    release: str,
) -> None:
    names = [ov.name for ov in cpu_gaps.release_gaps(release)[0]]
    assert names.count("overlap_spec_cpu") == 1  # the same function in 0.5.18 to 0.5.23
    assert ("overlap_record_stream_cpu" in names) is (release in ("0.5.18", "0.5.19", "0.5.20", "0.5.21"))
    chosen = cpu_gaps.selected({cpu_gaps.ENV_GAPS: "overlap_spec_cpu,overlap_record_stream_cpu"}, release)
    assert [ov.name for ov in chosen] == [n for n in names if n.startswith("overlap_")]


@pytest.mark.sglang
def test_the_overlap_targets_match_sglang_0_5_23() -> None:
    """``overlap_spec_cpu``'s check passes on SGLang's real function, and the relay's
    ``record_stream`` override is refused there: 0.5.23 guards the call itself (why it is
    left out of 0.5.22's and 0.5.23's rows)."""
    _sglang()
    from _sglang_import import import_sglang

    ov = _gap("overlap_spec_cpu")
    assert cpu_gaps._refusal(ov, getattr(import_sglang(ov.module), ov.attr)) == ""
    (relay,) = cpu_gaps.RELEASES["0.5.21"]["overlap_record_stream_cpu"]  # type: ignore[misc]
    why = cpu_gaps._refusal(relay, import_sglang(relay.module).FutureMap)
    assert "skips record_stream on CPU itself" in why


_RESOLVE_OVERLAP = r"""
import json, sys
import cpu_gaps
from sglang.srt.server_args import prepare_server_args
from sglang.srt.arg_groups import speculative_hook
from sglang.srt.arg_groups.overrides import resolved_view
m = sys.argv[1]
argv = ["--model-path", m + "/target", "--device", "cpu", "--attention-backend", "intel_amx",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", m + "/eagle3",
        "--speculative-eagle-topk", "1", "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4",
        "--speculative-use-rejection-sampling"]
def overlap_off():
    args = prepare_server_args(argv)
    if hasattr(args, "resolve_once"):  # 0.5.19 on; 0.5.18 resolves at construction
        args.resolve_once()
    return resolved_view(args).disable_overlap_schedule
out = {"release": cpu_gaps.installed_release(), "with": overlap_off()}
print("WITHOUT", file=sys.stderr, flush=True)
speculative_hook._disable_overlap_schedule_for_cpu = speculative_hook._disable_overlap_schedule_for_cpu.__wrapped__
out["without"] = overlap_off()
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def overlap_resolutions() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """:data:`_RESOLVE_OVERLAP` in one fresh interpreter per SGLang release here (0.5.23, and
    each older one with a folder, ``make setup-releases``), all started at once."""
    _sglang()
    from server import harness as h

    models = Path(cpu_gaps.__file__).resolve().parents[1] / "models" / "trained"
    envs: dict[str, dict[str, str]] = {}
    for release in [cpu_gaps.CURRENT, *sorted(cpu_gaps.RELEASES)]:
        folder = None if release == cpu_gaps.CURRENT else release
        if folder is not None and not (h.release_dir(folder) / "sglang").is_dir():
            continue
        env = h.server_env(None, release=folder)
        env.pop(cpu_gaps.ENV_GAPS, None)
        envs[release] = env
    with h.interpreters(_RESOLVE_OVERLAP, envs, [str(models)]) as procs:
        yield procs


@pytest.mark.sglang
@pytest.mark.server  # SGLang's argument resolution imports torchvision: make setup-server
@pytest.mark.parametrize("release", [cpu_gaps.CURRENT, *sorted(cpu_gaps.RELEASES)])
def test_sglang_turns_the_overlap_schedule_off_on_cpu_without_the_override(
    release: str, overlap_resolutions: dict[str, subprocess.Popen[str]]
) -> None:
    """SGLang's real argument resolution of the tier's flags (EAGLE3, rejection sampling, CPU),
    in a fresh interpreter of each release: the overlap schedule stays on with
    ``overlap_spec_cpu``; with SGLang's own function put back, SGLang turns it off and says
    why (the negative control)."""
    if release not in overlap_resolutions:
        pytest.skip(f"SGLang {release}: no release folder (make setup-releases)")
    proc = overlap_resolutions[release]
    stdout, stderr = proc.communicate(timeout=300)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, stderr[-3000:]
    out = json.loads(lines[0][len("RESULT ") :])
    assert out == {"release": release, "with": False, "without": True}
    with_it, _, without = stderr.partition("WITHOUT\n")
    assert "[cpu-gaps] overlap_spec_cpu: SGLang's CPU refusal of the overlap schedule skipped" in with_it
    assert cpu_gaps.OVERLAP_REFUSAL not in with_it and cpu_gaps.OVERLAP_REFUSAL in without


# ---- the per-release table (cpu_gaps.RELEASES) ------------------------------------------


def test_the_current_release_gets_the_overrides_of_gaps_as_they_are() -> None:
    table, left_out = cpu_gaps.release_gaps(cpu_gaps.CURRENT)
    assert table == [*cpu_gaps.GAPS, cpu_gaps.RENORM_P] and left_out == {}
    assert cpu_gaps.release_gaps("0.6.0") == (table, {})  # newer than the table: checked as 0.5.23's
    assert cpu_gaps.selected({}) == cpu_gaps.selected({}, cpu_gaps.CURRENT) == table


@pytest.mark.parametrize("release", sorted(cpu_gaps.RELEASES))
def test_each_release_row_names_known_overrides_and_keeps_their_names(release: str) -> None:
    known = {ov.name for ov in cpu_gaps.GAPS}
    row = cpu_gaps.RELEASES[release]
    # A name outside GAPS is a gap of that release only: an override, never a reason.
    assert all(not isinstance(row[name], str) for name in set(row) - known), row
    table, left_out = cpu_gaps.release_gaps(release)
    for name, alt in row.items():
        if isinstance(alt, str):
            assert left_out[name] == alt and alt and name not in {ov.name for ov in table}
        else:
            assert alt and all(ov.name == name for ov in alt)
            assert [ov for ov in table if ov.name == name] == list(alt)
    # Every other override applies there as on 0.5.23 (one of each, in GAPS' order).
    same = [ov.name for ov in table if ov.name not in row]
    assert same == [ov.name for ov in [*cpu_gaps.GAPS, cpu_gaps.RENORM_P] if ov.name not in row]
    # The rejection-sampling verify on the CPU exists on every release, under some target.
    assert "verify_greedy" in {ov.name for ov in table} and "renorm" in {ov.name for ov in table}


@pytest.mark.parametrize("release", cpu_gaps.WITHOUT_PD_PROPOSAL)
def test_the_seed_builder_is_refused_where_the_builder_is_the_seeds_already(release: str) -> None:
    with pytest.raises(ValueError, match=f"PDM_TEST_SEED_BUILDER=1: SGLang {release} has no pd_first_draft_proposal"):
        cpu_gaps.selected({cpu_gaps.ENV_SEED: "1"}, release)
    assert "seed_builder" in [o.name for o in cpu_gaps.selected({cpu_gaps.ENV_SEED: "1"}, "0.5.22")]


def test_a_server_that_imports_another_release_than_asked_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cpu_gaps, "installed_release", lambda: "0.5.23")
    with pytest.raises(
        cpu_gaps.OverrideRefused, match="PDM_TEST_SGLANG_RELEASE=0.5.21, but this interpreter imports SGLang 0.5.23"
    ):
        cpu_gaps._release_checked({cpu_gaps.ENV_RELEASE: "0.5.21"})
    monkeypatch.setattr(cpu_gaps, "installed_release", lambda: "0.5.20")
    assert cpu_gaps._release_checked({cpu_gaps.ENV_RELEASE: "0.5.20"}) == "0.5.20"
    err = capsys.readouterr().err
    assert "[cpu-gaps] SGLang 0.5.20; prefill_host_indices left out: " in err and "row_argmax left out" in err


def _verify_module(rejection_sampling: bool) -> types.ModuleType:
    spec = types.SimpleNamespace(speculative_use_rejection_sampling=rejection_sampling)
    mod = _module(_is_cpu=True, get_spec=lambda: spec)
    seen: list[bool] = []

    def eagle_sample(verify_input: object, batch: object, logits_output: object, grammar_mask: object = None) -> str:
        seen.append(mod._is_cpu)  # the branch SGLang 0.5.18 to 0.5.20 take on `_is_cpu`
        if grammar_mask == "raise":
            raise RuntimeError("verify failed")
        return "greedy" if mod._is_cpu else "sampling"

    mod.eagle_sample = eagle_sample
    mod.seen = seen
    return mod


def _batch(all_greedy: bool) -> object:
    return types.SimpleNamespace(sampling_info=types.SimpleNamespace(is_all_greedy=all_greedy))


@pytest.mark.parametrize("rejection_sampling", [True, False])
def test_the_rs_verify_of_the_older_releases_runs_eagle_sample_off_the_cpu_branch(rejection_sampling: bool) -> None:
    ov = cpu_gaps.RELEASES["0.5.18"]["verify_greedy"][0]  # type: ignore[index]
    mod = _verify_module(rejection_sampling)
    cpu_gaps.apply(ov, mod)
    assert mod.eagle_sample(1, _batch(False), 3) == ("sampling" if rejection_sampling else "greedy")
    assert mod._is_cpu is True  # restored after the call
    with pytest.raises(RuntimeError, match="verify failed"):
        mod.eagle_sample(1, _batch(False), 3, "raise")
    assert mod._is_cpu is True and mod.seen == [not rejection_sampling] * 2
    # An all-greedy batch keeps the CPU flag: its greedy verify picks the CPU op by it.
    assert mod.eagle_sample(1, batch=_batch(True), logits_output=3) == "greedy" and mod.seen[-1] is True
    # 0.5.20's eagle_sample has one parameter more: 0.5.18's variant refuses it.
    ov20 = cpu_gaps.RELEASES["0.5.20"]["verify_greedy"][0]  # type: ignore[index]
    with pytest.raises(cpu_gaps.OverrideRefused, match="eagle_sample has parameters"):
        cpu_gaps.apply(ov20, _verify_module(True))


def test_the_older_releases_renorm_serves_cpu_tensors_with_the_torch_versions() -> None:
    calls: list[str] = []

    def top_k_renorm_prob(probs: torch.Tensor, top_k: object) -> torch.Tensor:
        calls.append("gpu kernel")
        return probs

    def top_p_renorm_prob(probs: torch.Tensor, top_p: object) -> torch.Tensor:
        calls.append("gpu kernel")
        return probs

    mod = _module(top_k_renorm_prob=top_k_renorm_prob, top_p_renorm_prob=top_p_renorm_prob)
    for ov in cpu_gaps.RELEASES["0.5.21"]["renorm"]:  # type: ignore[union-attr]
        assert ov.module == "sgl_kernel"
        cpu_gaps.apply(ov, mod)
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    assert torch.allclose(mod.top_k_renorm_prob(probs, torch.tensor([2])), cpu_gaps.top_k_renorm_prob(probs, [2]))
    assert torch.allclose(mod.top_p_renorm_prob(probs, torch.tensor([0.6])), cpu_gaps.top_p_renorm_prob(probs, [0.6]))
    assert calls == []


def test_the_attention_ops_of_0_5_18_and_0_5_19_get_unit_kv_scales() -> None:
    calls: list[tuple[object, ...]] = []

    class IntelAMXAttnBackend:
        def __init__(self, model_runner: object) -> None:
            self.decode_attention_fwd = lambda *a: calls.append(("decode", *a))
            self.extend_attention_fwd = lambda *a: calls.append(("extend", *a))

    ov = cpu_gaps.RELEASES["0.5.19"]["amx_unscaled_ops"][0]  # type: ignore[index]
    cpu_gaps.apply(ov, _module(IntelAMXAttnBackend=IntelAMXAttnBackend))
    backend = IntelAMXAttnBackend(None)
    backend.decode_attention_fwd(*range(17))
    backend.extend_attention_fwd(*range(19))  # 0.5.18: no is_causal
    backend.extend_attention_fwd(*range(20))  # 0.5.19: is_causal last
    assert calls[0] == ("decode", 0, 1, 2, 1.0, 1.0, *range(3, 17))
    assert calls[1] == ("extend", *range(6), 1.0, 1.0, *range(6, 19), True)
    assert calls[2] == ("extend", *range(6), 1.0, 1.0, *range(6, 20))
    with pytest.raises(TypeError, match=r"18 arguments, these releases pass \[17\]"):
        backend.decode_attention_fwd(*range(18))

    class Scaled(IntelAMXAttnBackend):
        """A release that passes the scales itself (k_scale in its source)."""

    with pytest.raises(cpu_gaps.OverrideRefused, match="passes KV scales in this release"):
        cpu_gaps.apply(ov, _module(IntelAMXAttnBackend=Scaled))


class _Backend0518:
    """0.5.18's ``IntelAMXAttnBackend`` in the shape the override checks: each forward reads
    its metadata's ``seq_lens``, then overwrites it with ``forward_batch.seq_lens``."""

    def __init__(self, model_runner: object) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.extend_metadata: tuple[object, ...] | None = None
        self.draft_decode_metadata: tuple[object, ...] | None = None
        self.decode_attention_fwd = lambda *a: self.calls.append(("decode", *a))
        self.extend_attention_fwd = lambda *a: self.calls.append(("extend", *a))

    def forward_extend(self, forward_batch: types.SimpleNamespace) -> None:
        seq_lens = self.extend_metadata[0]  # type: ignore[index]
        seq_lens = forward_batch.seq_lens
        self.extend_attention_fwd(*range(8), seq_lens, *range(9, 19))

    def forward_decode(self, forward_batch: types.SimpleNamespace) -> None:
        if self.draft_decode_metadata is not None:
            seq_lens = self.draft_decode_metadata[1]
        else:
            seq_lens = forward_batch.seq_lens
        seq_lens = forward_batch.seq_lens
        self.decode_attention_fwd(*range(10), seq_lens, *range(11, 17))


def _backend_0_5_18(release: str, base: type = _Backend0518) -> types.ModuleType:
    class IntelAMXAttnBackend(base):  # type: ignore[valid-type,misc]
        """The class the override wraps (a fresh one per call: it wraps ``__init__``)."""

    mod = _module(IntelAMXAttnBackend=IntelAMXAttnBackend)
    cpu_gaps.apply(cpu_gaps.RELEASES[release]["amx_unscaled_ops"][0], mod)  # type: ignore[index]
    return mod


def test_0_5_18s_attention_ops_get_the_metadatas_seq_lens() -> None:
    """0.5.18 passes ``forward_batch.seq_lens`` where its metadata has the verify's (with its
    draft tokens) and each draft step's lengths (aggregated serving's greedy outputs then
    change from run to run): the ops get the metadata's, as 0.5.19 passes them."""
    batch = types.SimpleNamespace(seq_lens=torch.tensor([5, 7], dtype=torch.int32))
    lens = 1 + 2  # the op's name and the two scales come first in a recorded call
    backend = _backend_0_5_18("0.5.18").IntelAMXAttnBackend(None)
    backend.extend_metadata = (torch.tensor([9, 11], dtype=torch.int32), None, None, None)
    backend.forward_extend(batch)
    backend.draft_decode_metadata = (None, torch.tensor([6, 6, 8, 8]), None)
    backend.forward_decode(batch)
    backend.draft_decode_metadata = None
    backend.forward_decode(batch)
    extend, draft_decode, decode = backend.calls
    assert extend[8 + lens].tolist() == [9, 11] and extend[8 + lens].dtype == torch.int64
    assert extend[-1] is True  # 19 arguments: causal extend
    assert draft_decode[10 + lens].tolist() == [6, 6, 8, 8]
    assert decode[10 + lens].tolist() == [5, 7] and decode[10 + lens].dtype == torch.int64
    # Negative control: 0.5.19's variant passes what it is given (forward_batch's lengths).
    other = _backend_0_5_18("0.5.19").IntelAMXAttnBackend(None)
    other.extend_metadata = backend.extend_metadata
    other.forward_extend(batch)
    assert other.calls[0][8 + lens].tolist() == [5, 7]


def test_the_0_5_18_variant_is_refused_where_the_metadatas_seq_lens_are_kept() -> None:
    class Kept(_Backend0518):
        def forward_extend(self, forward_batch: types.SimpleNamespace) -> None:
            seq_lens = self.extend_metadata[0]  # type: ignore[index]
            self.extend_attention_fwd(*range(8), seq_lens, *range(9, 19))

    with pytest.raises(cpu_gaps.OverrideRefused, match="forward_extend keeps its metadata's seq_lens"):
        _backend_0_5_18("0.5.18", Kept)
