"""The typed A/B report (``report.json``): one msgspec Struct per table of the file.

Every field is documented in docs/report.md. Numbers that could not be measured (an
arm whose every payload failed) are ``null``, never NaN. ``schema_version`` changes
whenever a field changes meaning or goes away.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

SCHEMA_VERSION = 2
# Response lengths of the effect curve (the plot's second panel).
RESPONSE_LENGTHS = (16, 32, 64, 128, 256, 512, 1024)

_S = dict(frozen=True, kw_only=True, forbid_unknown_fields=True)


class Acceptance(msgspec.Struct, **_S):
    """First-verify acceptance of one arm."""

    mean: float | None
    ci95: tuple[float, float] | None
    n: int
    expected: float | None
    exact_expected: float | None


class Exactness(msgspec.Struct, **_S):
    """Binned TV of committed tokens against their target laws."""

    tv: float | None
    bound: float | None
    passed: bool = msgspec.field(name="pass")
    tokens: int
    bins: int


class BytesPerRequest(msgspec.Struct, **_S):
    """Bytes on the wire per sent request, by plane."""

    control: float
    bulk: float
    bulk_mooncake: float
    bulk_inline: float
    total: float
    proposal: float


class Latency(msgspec.Struct, **_S):
    """Receive-to-batch latency percentiles (ms), nearest rank, from a log histogram: within 1%."""

    p50: float | None
    p99: float | None


class Payloads(msgspec.Struct, **_S):
    """Payload accounting: every sent payload is delivered or failed."""

    sent: int
    delivered: int
    failed: int
    failed_by_reason: dict[str, int]


class FailureCount(msgspec.Struct, **_S):
    """Failures of one kind (``stage`` or ``stage:field``) with the first one's text."""

    kind: str
    count: int
    first_error: str
    first_request: str


class HookFailures(msgspec.Struct, **_S):
    """Payloads one receive hook failed, over all arms."""

    hook: str
    count: int
    first_error: str
    first_request: str
    by_arm: dict[str, int]


class EffectPoint(msgspec.Struct, **_S):
    """Verify steps for one response length, and the share saved against the baseline."""

    response_tokens: int
    verifies: float
    saved_vs_baseline: float
    saved_pct_vs_baseline: float


class Effect(msgspec.Struct, **_S):
    """What the arm's first verify buys over a whole response."""

    first_verify_tokens: float | None
    later_tokens_per_verify: float
    verifies_per_response: float | None
    verifies_vs_baseline: float | None
    by_response_length: list[EffectPoint]


class VsReference(msgspec.Struct, **_S):
    """The arm as a share of the reference arm (paired acceptance, bytes)."""

    acceptance_ratio: float | None
    bytes_ratio: float | None
    proposal_bytes_ratio: float | None


class ArmReport(msgspec.Struct, **_S):
    """Everything measured for one arm."""

    name: str
    role: Literal["baseline", "reference", "candidate"]
    synthesizer: str
    encoding: str
    encoder_options: dict[str, Any]
    acceptance: Acceptance
    full_distribution_bound: float | None
    accepted_length: float | None
    exact: Exactness
    bytes_per_request: BytesPerRequest
    latency_ms: Latency
    throughput_per_s: float | None
    payloads: Payloads
    failures: list[FailureCount]
    send_failures: FailureCount | None
    effect: Effect
    vs_reference: VsReference | None


class Pipeline(msgspec.Struct, **_S):
    """How the run was paced, where its CPU time went and the memory each process peaked at."""

    # Batches of every arm allowed between the prefill and the verifier (the decode's credit).
    in_flight_batches: int
    # Peak RSS of each process (``decode``, ``prefill``) since it started, bytes.
    peak_rss_bytes: dict[str, int]
    # CPU seconds by stage, ``<process>.<stage>``; see docs/report.md.
    cpu_s: dict[str, float]
    # Wall seconds the prefill waited for the decode's credit.
    credit_wait_s: float


class Report(msgspec.Struct, **_S):
    """One ``pd-middleware ab`` run."""

    schema_version: int
    created_at: str
    partial: bool
    seed: int
    requests_per_arm: int
    baseline: str
    reference: str | None
    workload: dict[str, Any]
    model: dict[str, Any]
    ab: dict[str, Any]
    config: dict[str, Any]
    versions: dict[str, str]
    wall_s: float
    arms: list[ArmReport]
    hook_failures: list[HookFailures]
    receiver: dict[str, Any]
    sender: dict[str, Any] | None
    # None in a partial report, or one cancelled before the prefill reported.
    pipeline: Pipeline | None = None

    def to_json(self) -> bytes:
        """Indented JSON, as written to ``report.json``."""
        return msgspec.json.format(msgspec.json.encode(self), indent=2) + b"\n"

    @property
    def passed(self) -> bool:
        """Every arm passed exactness and no sent payload is unaccounted for."""
        return all(a.exact.passed for a in self.arms) and self.lost == 0

    @property
    def lost(self) -> int:
        """Sent payloads neither delivered nor failed (must be 0)."""
        return sum(a.payloads.sent - a.payloads.delivered - a.payloads.failed for a in self.arms)
