"""A prefill peer for the transport tests, run as a real subprocess.

``python tests/_transport_peer.py ADDRESS NAME COUNT MODE [DELAY_S]`` connects a
:class:`PrefillSender` named NAME to ADDRESS and sends COUNT deterministic payloads
(:func:`make_payload`), inline (MODE ``inline``) or through Mooncake (``bulk``),
sleeping DELAY_S between sends. Prints ``READY`` after connecting and, at the end,
one JSON line with the sender's counters.
"""

from __future__ import annotations

import json
import os
import random
import struct
import sys

from pd_middleware import Payload, Provenance, SparseEncoding


def collect_outcomes(rx, n: int, timeout: float = 10.0) -> list:
    """The next ``n`` outcomes of receiver ``rx``, bounded in time: fails rather than hangs."""
    import time

    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        item = rx.get(timeout=0.1)
        if item is not None:
            out.append(item)
    assert len(out) == n, f"got {len(out)} of {n} outcomes within {timeout} s"
    return out


def make_payload(name: str, i: int, vocab: int = 1000) -> Payload:
    """Payload ``i`` of peer ``name``: same bytes for the same arguments, on any machine."""
    rng = random.Random(f"{name}/{i}")
    steps = 1 + i % 3
    hidden = bytes(rng.getrandbits(8) for _ in range(64 * (1 + i % 4)))
    tokens = tuple(rng.randrange(vocab) for _ in range(steps))
    probs = tuple(rng.random() for _ in range(steps))
    proposal = None
    if i % 2:
        idx = [rng.sample(range(vocab), 4) for _ in range(steps)]
        vals = [0.25] * (4 * steps)
        proposal = SparseEncoding(
            lengths=(4,) * steps,
            indices=struct.pack(f"<{4 * steps}i", *(x for row in idx for x in row)),
            values=struct.pack(f"<{4 * steps}e", *vals),
            value_dtype="fp16",
        )
    return Payload(
        f"{name}-{i}",
        tokens,
        probs,
        vocab,
        hidden=hidden,
        hidden_dtype="fp16",
        provenance=Provenance(),
        proposal=proposal,
    )


def main() -> None:
    address, name, count, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    delay = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    import time

    from pd_middleware.transport import MooncakeEngine, PrefillSender, SlotsConfig, TransportConfig

    cfg = TransportConfig(
        inline_threshold_bytes=0 if mode == "bulk" else 1 << 30,
        heartbeat_s=0.1,
        peer_timeout_s=5.0,
        slots=SlotsConfig(count=64, size_bytes=4096, per_peer=16, wait_s=20.0),
    )
    engine = MooncakeEngine.open() if mode == "bulk" else None
    tx = PrefillSender(cfg, engine=engine, name=name).connect(address, timeout=20.0)
    print("READY", flush=True)
    for i in range(count):
        tx.send(make_payload(name, i))
        if delay:
            time.sleep(delay)
    ok = tx.flush(60.0)
    print(json.dumps({"flushed": ok, **tx.statuses()}), flush=True)
    tx.close()
    os._exit(0)  # skip engine teardown at exit: faster, and nothing is left to flush


if __name__ == "__main__":
    main()
