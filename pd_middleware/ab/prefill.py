"""The prefill process of the embedded A/B deployment.

It regenerates the seeded workload, runs every arm's encoder on the same draft rows,
turns each encoded request into a :class:`~pd_middleware.Payload` and ships it through a
real :class:`~pd_middleware.transport.sender.PrefillSender` (ZMQ control plane, Mooncake
bulk plane). Request ids are ``"<arm>/<index>"`` so the decode can route and match them.

It starts each batch only with the decode's credit (:mod:`~pd_middleware.ab.credit`),
so it never runs more than a bounded number of batches ahead of the verifier. It reports
per-arm bytes by plane, its sender's counters, the CPU seconds of each of its stages and
its peak RSS on a multiprocessing queue. Runs as a ``spawn`` child: everything it needs
arrives as plain data (and the credit's shared semaphore).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any

from ..core.payload import DenseEncoding, EncodedProposal, HiddenDType, Payload, SparseEncoding
from .credit import Credit
from .heap import return_big_blocks

# Send errors kept verbatim per arm (all are counted): a run that fails every payload
# must not grow a list per request.
_MAX_ERRORS = 16


@dataclass(frozen=True)
class PrefillJob:
    """Plain-data description of the prefill's work (picklable for ``spawn``)."""

    config_data: dict[str, Any]
    address: str
    requests: int
    seed: int
    batch_size: int
    arm_names: tuple[str, ...]
    # Longest wait for the decode's credit before the prefill gives up.
    timeout_s: float = 1800.0


def combine_steps(parts: list[EncodedProposal | None]) -> EncodedProposal | None:
    """Join per-step encodings of one request into one S-step encoding."""
    if any(p is None for p in parts):
        return None
    first = parts[0]
    if isinstance(first, DenseEncoding):
        assert all(isinstance(p, DenseEncoding) and p.dtype == first.dtype for p in parts)
        return DenseEncoding(first.dtype, b"".join(bytes(p.data) for p in parts))  # type: ignore[union-attr]  # the assert above; mypy keeps no narrowing through all()
    assert isinstance(first, SparseEncoding)
    sp: list[SparseEncoding] = parts  # type: ignore[assignment]  # no None (checked above), all sparse (same kind per request)
    assert all(p.index_format == first.index_format for p in sp)
    return SparseEncoding(
        lengths=tuple(n for p in sp for n in p.lengths),
        indices=b"".join(bytes(p.indices) for p in sp),
        values=b"".join(bytes(p.values) for p in sp),
        value_dtype=first.value_dtype,
        tail_mass=tuple(t for p in sp for t in (p.tail_mass or (0.0,) * len(p.lengths))),
        # Per-step fields concatenate over steps, like lengths.
        index_format=first.index_format,
        bucket_counts=tuple(c for p in sp for c in p.bucket_counts),
    )


def encode_batch(encoder: Any, batch: Any, generator: Any, temperature: float = 1.0) -> Any:
    """Run ``encoder`` on a workload batch; step by step when rows depend on the prefix.

    Returns ``(tokens (B, S) int64, token_probs (B, S) fp32, proposals, provenance)``.
    """
    import torch

    if batch.conditional is None:
        enc = encoder.encode(batch.draft_probs, temperature=temperature, generator=generator)
        return enc.tokens, enc.token_probs, enc.proposals, enc.provenance
    b, s = batch.batch_size, batch.num_steps
    tokens = torch.empty(b, s, dtype=torch.int64)
    token_probs = torch.empty(b, s, dtype=torch.float32)
    per_step: list[list[EncodedProposal | None]] = [[] for _ in range(b)]
    prov = None
    for k in range(s):
        q = batch.draft_given(k, tokens[:, :k])
        enc = encoder.encode(q.unsqueeze(1), temperature=temperature, generator=generator)
        tokens[:, k] = enc.tokens[:, 0]
        token_probs[:, k] = enc.token_probs[:, 0]
        for i, p in enumerate(enc.proposals):
            per_step[i].append(p)
        prov = enc.provenance
    return tokens, token_probs, [combine_steps(p) for p in per_step], prov


def build_payloads(arm: str, start: int, vocab: int, hidden: Any, enc: Any) -> list[Payload]:
    """Payloads for one arm's encoded batch; ``hidden`` is (B, H) of the wire dtype."""
    tokens, token_probs, proposals, prov = enc
    hidden_bytes = hidden.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
    h = len(hidden_bytes) // max(1, tokens.shape[0])
    names: dict[str, HiddenDType] = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}
    dtype = names[str(hidden.dtype)]
    tl, pl = tokens.tolist(), token_probs.tolist()
    return [
        Payload(
            request_id=f"{arm}/{start + i}",
            draft_tokens=tuple(tl[i]),
            draft_probs=tuple(min(1.0, max(0.0, x)) for x in pl[i]),
            vocab_size=vocab,
            hidden=hidden_bytes[i * h : (i + 1) * h],
            hidden_dtype=dtype,
            provenance=prov,
            proposal=proposals[i],
        )
        for i in range(tokens.shape[0])
    ]


def run_prefill(job: PrefillJob, results: Any, credit: Credit | None = None) -> None:
    """Child-process entry point: send every arm's traffic, then report on ``results``.

    ``credit``: the decode's credit (None: send as fast as the transport takes it).
    """
    import signal

    # Ctrl-C reaches the whole process group; the parent decides (it returns a partial
    # report and terminates this process), so the child must not die on its own first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return_big_blocks()  # this process is ours: freed batches go back to the OS (heap.py)
    try:
        results.put(("done", _run(job, credit)))
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class _Shipper:
    """Encodes each batch with every arm's encoder and sends its payloads; owns what was
    sent per arm (payloads, bytes by plane, send errors: each counted, the first
    :data:`_MAX_ERRORS` kept verbatim) and adds its thread CPU seconds to ``cpu``."""

    def __init__(self, job: PrefillJob, encoders: dict[str, Any], vocab_size: int, sender: Any, cpu: dict[str, float]):
        self.job, self.encoders, self.vocab_size, self.sender, self.cpu = job, encoders, vocab_size, sender, cpu
        arms = job.arm_names
        self.sent = dict.fromkeys(arms, 0)
        self.bytes = {a: {"control": 0, "inline": 0, "bulk": 0} for a in arms}
        self.errors: dict[str, list[str]] = {a: [] for a in arms}
        self.error_count = dict.fromkeys(arms, 0)

    def ship(self, k: int, batch: Any, hidden: Any) -> None:
        """Batch ``k`` of the workload, with ``hidden`` (B, H) of the wire dtype, for every arm."""
        import time

        import torch

        clock, job = time.thread_time, self.job
        for ai, arm in enumerate(job.arm_names):
            t1 = clock()
            # Each arm draws its X with its own stream, fixed by (seed, batch, arm).
            gen = torch.Generator().manual_seed((job.seed * 1_000_003 + k * 1_009 + ai) & 0x7FFFFFFFFFFF)
            enc = encode_batch(self.encoders[arm], batch, gen)
            payloads = build_payloads(arm, k * job.batch_size, self.vocab_size, hidden, enc)
            t2 = clock()
            self.cpu["encode"] += t2 - t1
            self._send(arm, payloads)
            del payloads, enc  # nothing of this batch is kept past its send
            self.cpu["send"] += clock() - t2

    def _send(self, arm: str, payloads: list[Payload]) -> None:
        """A failing send fails (and is counted for) its payload only."""
        before = dict(self.sender.statuses()["bytes_by_plane"])
        for p in payloads:
            try:
                self.sender.send(p)
                self.sent[arm] += 1
            except Exception as exc:
                self.sent[arm] += 1
                if len(self.errors[arm]) < _MAX_ERRORS:
                    self.errors[arm].append(f"{p.request_id}: {type(exc).__name__}: {exc}")
                self.error_count[arm] += 1
        after = self.sender.statuses()["bytes_by_plane"]
        for plane in self.bytes[arm]:
            self.bytes[arm][plane] += after.get(plane, 0) - before.get(plane, 0)


def _run(job: PrefillJob, credit: Credit | None) -> dict[str, Any]:
    import resource
    import time

    import torch

    from ..config import parse_config
    from ..middleware import build_encoders
    from ..transport.sender import open_sender
    from ..workloads import make_workload
    from .config import workload_options

    torch.set_num_threads(1)
    cfg = parse_config(job.config_data)
    encoders = build_encoders(cfg)
    wl = make_workload(cfg.ab.workload.name, **workload_options(cfg))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.model.hidden_dtype]
    sender = open_sender(cfg.transport, job.address, name="ab-prefill")
    # Thread CPU seconds by stage (wall seconds for the credit wait).
    cpu = {"generate": 0.0, "encode": 0.0, "send": 0.0}
    shipper = _Shipper(job, encoders, wl.vocab_size, sender, cpu)
    waited = 0.0
    hidden_gen = torch.Generator().manual_seed(job.seed ^ 0x5EED)
    n_batches = (job.requests + job.batch_size - 1) // job.batch_size
    batches = wl.batches(job.requests, job.batch_size, job.seed)
    clock = time.thread_time
    try:
        for k in range(n_batches):
            if credit is not None:
                waited += credit.take(k, lambda t: sender.flush(timeout=t), job.timeout_s)
            t0 = clock()
            batch = next(batches)
            cpu["generate"] += clock() - t0
            shipper.ship(k, batch, _hidden(batch, cfg.model.hidden_size, dtype, hidden_gen))
            del batch  # nothing of this batch is kept past its send
        t0 = clock()
        sender.flush(timeout=60.0)
        cpu["send"] += clock() - t0
        status = sender.statuses()
    finally:
        sender.close()
    return {
        "sent": shipper.sent,
        "bytes": shipper.bytes,
        "send_errors": shipper.errors,
        "send_error_count": shipper.error_count,
        "sender": status,
        "cpu_s": cpu,
        "process_cpu_s": time.process_time(),
        "credit_wait_s": waited,
        # ru_maxrss is in KiB on Linux.
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _hidden(batch: Any, hidden_size: int, dtype: Any, generator: Any) -> Any:
    """The batch's hidden states, (B, H) of the wire dtype, with the workload's draft-head
    state written into them where it has one (workloads/heads.py)."""
    import torch

    from ..workloads.heads import write_state

    hidden = torch.randn(batch.batch_size, hidden_size, generator=generator).to(dtype)
    if batch.draft_state is not None:
        write_state(hidden, batch.draft_state)
    return hidden
