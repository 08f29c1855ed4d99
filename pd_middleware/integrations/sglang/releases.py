"""What each SGLang release gets from the drop-in, read from the table (``pd-middleware sglang``).

Nothing here imports SGLang or decides by version: every answer is derived from the
versioned table (:mod:`.patching`: each feature's rows for the release, or its refusal
line), so the CLI, docs/sglang.md and :func:`~pd_middleware.integrations.sglang.install`
say the same thing.
"""

from __future__ import annotations

from typing import Any

from .patching import FEATURES, NEWEST, Feature, doc_features, parse_version

#: Draft kinds an operator runs, with the shipped config for each (the decode-only default first).
DECODE_ONLY = "configs/sglang.toml on the decode only (decode-only recompute; the prefill runs stock SGLang)"


def _rows(feature: Feature, release: tuple[int, ...]) -> list[dict[str, str]]:
    return [{"target": t.path, "hook": t.hook.value, "releases": t.span} for t in feature.targets_for(release)]


def configs_for(available: dict[str, bool]) -> dict[str, str]:
    """The config to run per draft kind, given which features the release has."""
    if available.get("metadata") and available.get("draft_kv"):
        chain = 'configs/multi_layer.yaml on both nodes (the shipped chain in SGLang\'s PD metadata, draft_kv = "all_steps")'
    elif available.get("metadata") and available.get("chain") and available.get("prefill"):
        chain = (
            "configs/multi_layer.yaml on both nodes (the shipped chain in SGLang's PD metadata; draft_kv left out "
            'is "first_step" on this release: the first step\'s draft KV, as SGLang transfers it)'
        )
    elif available.get("chain") and available.get("prefill"):
        chain = (
            'configs/multi_layer.yaml on both nodes with [sglang] channel = "sidechannel" and draft_kv = "first_step" '
            "(PD_MIDDLEWARE_DECODE_ADDRESS on the prefill): this release's metadata path cannot carry the chain"
        )
    else:
        chain = "no shipped chain on this release"
    return {
        "single-layer EAGLE/EAGLE3": DECODE_ONLY,
        "DeepSeek NextN": DECODE_ONLY,
        "multi-layer MTP chain": chain
        + "; behind a stock prefill: configs/sglang.toml on the decode only (an exact one-hot chain)",
    }


def _recompute_rows(release: tuple[int, ...]) -> dict[str, Any]:
    """The recompute feature's rows for ``release`` by attribute (empty where it is refused or absent)."""
    return {t.attr: t for t in FEATURES["recompute"].targets_for(release)} if "recompute" in FEATURES else {}


def _seeded(release: tuple[int, ...]) -> bool | None:
    """Whether ``release``'s ``fast_sample`` row takes a seed (None: no recompute rows)."""
    fast = _recompute_rows(release).get("fast_sample")
    return None if fast is None else "sampling_seed" in (fast.params or ())


def recompute_draw(release: tuple[int, ...]) -> str:
    """Which sampler draws the decode-only recompute's X' on ``release``, read from the
    recompute feature's ``fast_sample`` row: SGLang's where that row takes a seed, else the
    drop-in's own seeded draw (the row's adapter hands out nothing: an unseeded
    ``fast_sample`` cannot give every TP rank the same X')."""
    seeded = _seeded(release)
    if seeded is None:
        return "no decode-only recompute on this release"
    if seeded:
        return (
            "SGLang's seeded fast_sample(q', sampling_seed, positions), aggregated serving's own draw; where "
            "sgl-kernel's ops cannot run, the drop-in's seeded inverse-CDF draw (logged at startup)"
        )
    return (
        "the drop-in's seeded inverse-CDF draw (pd_middleware.decode.recompute.inverse_cdf: the same law, the "
        "same X' on every TP rank); this release's fast_sample takes no seed"
    )


def recompute_overlap(release: tuple[int, ...]) -> str:
    """Where a gathering recompute head runs under SGLang's overlap scheduler on ``release``
    (the recompute rows' ``Scheduler.forward_stream``: :mod:`.ordering`)."""
    if "Scheduler.forward_stream" not in _recompute_rows(release):
        return "no decode-only recompute on this release"
    return (
        "a draft head that gathers its logits (TP > 1, or attention TP > 1 with --enable-dp-lm-head; DeepSeek "
        "NextN included) is issued on the scheduler's forward stream, between the forward in flight and the next"
    )


def graph_path(release: tuple[int, ...]) -> str:
    """How the proposal reaches the first verify on the draft CUDA-graph path, per the decode's rows."""
    attrs = {t.attr for t in FEATURES["decode"].targets_for(release)} if "decode" in FEATURES else set()
    if "EagleDraftInput" in attrs:
        return (
            "SGLang's builder sets no proposal on this release; the drop-in constructs its draft input with the "
            "proposal (EagleDraftInput row, before the overlap relay's stash), so draft_probs is never None and the "
            "draft CUDA-graph runner copies it into its static buffer before the replay (stock: None is never "
            "copied, the replay reads a zero or stale proposal)"
        )
    return (
        "SGLang's builder asks pd_first_draft_proposal for the proposal (replaced by the drop-in's): draft_probs "
        "is set in the draft input before the relay's stash and copied into the graph runner's static buffer"
    )


def release_report(version: str) -> dict[str, Any]:
    """Per feature, supported or refused (with its line) and its rows; the config per draft
    kind; the graph path; which sampler draws the decode-only recompute's X' and where its
    head runs under the overlap scheduler. ``version``: any version (a newer one gets the newest rows)."""
    release = min(parse_version(version), parse_version(NEWEST))
    features: dict[str, Any] = {}
    for f in doc_features():
        name = f.name
        r = f.refusal(release)
        features[name] = {
            "available": r is None,
            "refused": None if r is None else r.line(version, name),
            "summary": f.summary,
            "rows": _rows(f, release),
        }
    available = {n: bool(v["available"]) for n, v in features.items()}
    return {
        "release": version,
        "rows_of": ".".join(map(str, release)),
        "features": features,
        "configs": configs_for(available),
        "graph_path": graph_path(release),
        "recompute": {"draw": recompute_draw(release), "overlap": recompute_overlap(release)},
    }
