"""The decode's reference verifier for the A/B job: target rows, chain verify, measurements.

Target rows are regenerated from the workload seed on one thread (:class:`TargetFeed`)
and every assembled batch is verified on another (:class:`VerifyThread`), so that batch
formation (receive -> assemble) never waits for either. torch releases the GIL.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..core._errors import PDMiddlewareError
from .collector import ArmStats, Assembled


class TargetFeed:
    """Regenerates the workload's batches (target rows) on a thread, in order."""

    def __init__(self, wl: Any, n_req: int, batch_size: int, seed: int) -> None:
        self._it = wl.batches(n_req, batch_size, seed)
        self._q: queue.Queue[Any] = queue.Queue(maxsize=2)
        self._stop = threading.Event()
        self._held: Any = None
        self.cpu_s = 0.0  # thread CPU seconds spent generating target rows
        self._thread = threading.Thread(target=self._run, name="ab-targets", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            t0 = time.thread_time()
            for k, batch in enumerate(self._it):
                self.cpu_s += time.thread_time() - t0
                while not self._stop.is_set():
                    try:
                        self._q.put((k, batch), timeout=0.2)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
                t0 = time.thread_time()
        except BaseException as exc:
            self._q.put(("error", exc))

    def poll(self, k: int) -> Any:
        """Batch ``k`` if it is generated, else None (never blocks)."""
        return self.get(k, 0.0)

    def get(self, k: int, until: float) -> Any:
        """Batch ``k``, waiting until monotonic time ``until`` at most; None if not ready."""
        if self._held is None:
            try:
                self._held = (
                    self._q.get(timeout=max(0.0, until - time.monotonic())) if until > 0 else self._q.get_nowait()
                )
            except queue.Empty:
                return None
        got, batch = self._held
        if got == "error":
            raise batch
        if got != k:
            raise PDMiddlewareError(f"ab: workload batches out of order: {got} != {k}")
        self._held = None
        return batch

    def stop(self) -> None:
        self._stop.set()


class VerifyThread:
    """Runs :func:`verify_batch` in order on a worker thread, at most ``max_queued`` batches behind.

    ``on_verified`` is called on the worker after each batch (the job grants the prefill
    one batch of credit there). The job's credit keeps the queue short on its own; the
    bound makes that a property of this class too.
    """

    def __init__(
        self, stats: dict[str, ArmStats], gen: Any, on_verified: Callable[[], None] | None = None, max_queued: int = 2
    ) -> None:
        self._stats = stats
        self._gen = gen
        self._on_verified = on_verified
        self._q: queue.Queue[Any] = queue.Queue(maxsize=max_queued)
        self._error: BaseException | None = None
        self._abort = threading.Event()
        self.cpu_s = 0.0  # thread CPU seconds spent verifying
        self._thread = threading.Thread(target=self._run, name="ab-verify", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, batch: Any, assembled: dict[str, Assembled], timeout: float = 600.0) -> None:
        """Queue one batch; waits (``timeout`` s at most) while ``max_queued`` are waiting."""
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            try:
                self._q.put((batch, assembled), timeout=0.2)
                return
            except queue.Full:
                if time.monotonic() > deadline:
                    raise PDMiddlewareError(f"ab: the verifier took no batch for {timeout:.0f}s") from None

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None or self._abort.is_set():
                return
            try:
                t0 = time.thread_time()
                verify_batch(item[0], item[1], self._stats, self._gen)
                self.cpu_s += time.thread_time() - t0
                del item  # nothing of the batch outlives its verification
                if self._on_verified is not None:
                    self._on_verified()
            except BaseException as exc:
                self._error = exc
                return

    def check(self) -> None:
        """Re-raise a failure of the worker on the calling thread."""
        if self._error is not None:
            raise self._error

    def finish(self, timeout: float) -> None:
        """Wait until every submitted batch is verified."""
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:
            pass  # the worker is stuck or dead: the join below and check() say which
        self._thread.join(timeout)
        self.check()
        if self._thread.is_alive():
            raise PDMiddlewareError("ab: verification did not finish in time")

    def stop(self, timeout: float = 0.0) -> None:
        """End the worker after the batch in hand, skipping queued ones (waits ``timeout`` s).

        Called after :meth:`finish` on success; on cancellation or failure the batches
        still queued are dropped, so the statistics stop changing once this returns.
        """
        if self._thread.is_alive():
            self._abort.set()
            try:
                self._q.put_nowait(None)
            except queue.Full:
                pass  # the worker sees the abort flag when it takes the next batch
            self._thread.join(timeout)


def verify_batch(batch: Any, assembled: dict[str, Assembled], stats: dict[str, ArmStats], gen: Any) -> None:
    """Verify every arm's share of one workload batch against its target rows.

    What does not depend on the arm (the full-distribution bound, the binned law of
    each target row for the exactness test) is computed once per batch: those are the
    only V-wide passes besides the verifier itself.
    """
    import torch

    from ..evaluation.verify import acceptance_probability, sum_min, verify_chain

    full_rows = sum_min(batch.target_probs[:, 0], batch.draft_probs[:, 0])
    shared_law: dict[int, Any] = {}
    shared_terms: dict[str, Any] = {}
    b = batch.batch_size
    for arm, asm in assembled.items():
        st = stats[arm]
        if not asm.rows:
            continue
        sel = torch.tensor(asm.rows)
        whole = len(asm.rows) == b
        if batch.conditional is not None:
            target = batch.target_given(_full_prefix(batch, sel, asm.tokens))
            target = target if whole else target[sel]
        else:
            target = batch.target_probs if whole else batch.target_probs[sel]
        res = verify_chain(target, asm.draft_probs, asm.tokens, gen)
        # Rao-Blackwellised acceptance: P(accept | X) = min(1, p(X)/q'(X)), a lower-variance
        # estimate of the same mean as the observed rate.
        draft3 = asm.draft_probs if asm.draft_probs.dim() == 3 else asm.draft_probs.unsqueeze(1)
        st.expected_first_sum += float(acceptance_probability(target, draft3, asm.tokens)[:, 0].sum())
        st.exact_first_sum += paired_expectation(asm, draft3, batch, sel, shared_terms)
        st.verified += len(asm.rows)
        st.first_accepted += int(res.first_accepted.sum())
        st.accepted_sum += int(res.accepted_lengths.sum())
        st.full_bound_sum += float(full_rows[sel].sum())
        # Exactness: every committed position, against p given the accepted prefix.
        for pos in range(res.committed.shape[1]):
            live = res.committed[:, pos] >= 0
            if not bool(live.any()):
                continue
            rows = target[live, pos]
            law = None
            if batch.conditional is None:
                if pos not in shared_law:
                    shared_law[pos] = st.exactness.bin_law(batch.target_probs[:, pos])
                law = shared_law[pos][sel[live]]
            st.exactness.update(rows, res.committed[live, pos], bin_law=law)


def paired_expectation(asm: Assembled, draft3: Any, batch: Any, sel: Any, cache: dict[str, Any] | None = None) -> float:
    """Sum over rows of the exact first-position acceptance given the workload rows.

    X ~ q' handed over: sum min(p, q'). X ~ draft q with one-hot q': sum q.p.
    X = argmax q: p(argmax q). Free of the sampling noise of X and u, and paired
    across arms (same contexts), so ratios between arms are precise.

    ``cache``: one dict per workload batch, shared by its arms: the two terms that do
    not depend on the arm (q.p and p(argmax q), float64 per row) are computed once.
    min(p, q') is taken in fp32 (exact: it picks one of two fp32 values) and summed in
    float64, with no V-wide float64 copy.
    """
    import torch

    from ..evaluation.verify import sanitize_q

    cache = {} if cache is None else cache
    if "qp" not in cache:
        p0, q0 = batch.target_probs[:, 0], batch.draft_probs[:, 0]
        cache["qp"] = (p0.double() * q0.double()).sum(dim=1)
        cache["greedy"] = p0.gather(1, q0.argmax(1, keepdim=True))[:, 0].double()
    law = torch.tensor([k == "law" for k in asm.kinds])
    greedy = torch.tensor([k == "greedy" for k in asm.kinds])
    total = 0.0
    if bool(law.any()):
        p_law = batch.target_probs[sel[law], 0]
        total += float(torch.minimum(p_law, sanitize_q(draft3[law, 0])).sum(dtype=torch.float64))
    samp = ~(law | greedy)
    if bool(samp.any()):
        total += float(cache["qp"][sel[samp]].sum())
    if bool(greedy.any()):
        total += float(cache["greedy"][sel[greedy]].sum())
    return total


def _full_prefix(batch: Any, sel: Any, tokens: Any) -> Any:
    """(B, S) drafted tokens for the whole batch, with the delivered rows filled in."""
    import torch

    full = torch.zeros(batch.batch_size, tokens.shape[1], dtype=torch.int64)
    full[sel] = tokens
    return full
