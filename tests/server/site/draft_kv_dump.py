"""Test-only: each chain step's draft KV at a request's prompt positions, to files.

``PDM_TEST_DRAFT_KV_DUMP=<dir>`` in a test server's environment turns it on (the
overrides ``draft_kv_prefill`` and ``draft_kv_decode`` of :mod:`cpu_gaps`, which call
:func:`on_prefill` and :func:`on_decode`). Files are written only while ``<dir>`` exists:
the test creates it before its requests and renames it after, so warmup and other
tests' requests leave nothing.

- Prefill: before SGLang's ``process_batch_result_disagg_prefill(self, batch, result)``
  (``disaggregation/prefill.py`` around 901): the batch's forward, draft extend of every
  chain step included, has run, and each request's slots are its own until its transfer
  ends. A request still mid-prompt (chunked) is skipped.
- Decode: after ``DecodeTransferQueue._commit_transfer_to_req(self, decode_req)``
  (``disaggregation/decode.py`` around 2600): the transfer has landed and nothing has run
  on the request's slots yet. A warmup's fake transfer and an aborted request are skipped.

One file per (node, request, chain step): ``<role>-<bootstrap_room>-step<k>.pt`` (k from
1), a ``torch.save`` of ``{"role", "room", "step", "input_ids", "k", "v"}`` with ``k``/``v``
of shape (layers, n, heads, head_dim): that step's pool at the request's n prompt slots
(``req_to_token[req.kv.req_pool_idx, :n]``; every step's runner shares the target's token index
space, ``managers/tp_worker.py`` around 405).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ENV = "PDM_TEST_DRAFT_KV_DUMP"


def step_pools(scheduler: Any) -> list[Any]:
    """Each chain step's draft KV pool, step order (``scheduler.draft_worker.draft_worker.draft_runners``)."""
    worker = getattr(getattr(scheduler, "draft_worker", None), "draft_worker", None)
    return [r.token_to_kv_pool for r in getattr(worker, "draft_runners", None) or ()]


def prompt_slots(req_to_token_pool: Any, req: Any) -> Any:
    """The KV slots of ``req``'s prompt positions: ``req_to_token[req.kv.req_pool_idx, :len(origin_input_ids)]``
    (SGLang 0.5.23 keeps the row on ``Req.kv``, a ``ReqKvInfo``)."""
    n = len(req.origin_input_ids)
    return req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].long().cpu()


def read_kv(pool: Any, slots: Any) -> dict[str, Any]:
    """One pool's K and V at ``slots``: (layers, n, heads, head_dim) each, on the CPU."""
    import torch

    return {
        "k": torch.stack([buf[slots.to(buf.device)].cpu() for buf in pool.k_buffer]),
        "v": torch.stack([buf[slots.to(buf.device)].cpu() for buf in pool.v_buffer]),
    }


def dump(out: Path, role: str, room: int, input_ids: Sequence[int], pools: Sequence[Any], slots: Any) -> list[Path]:
    """Write one file per chain step for this request; returns the paths."""
    import torch

    paths = []
    for step, pool in enumerate(pools, start=1):
        path = out / f"{role}-{room}-step{step}.pt"
        record = {"role": role, "room": room, "step": step, "input_ids": list(input_ids), **read_kv(pool, slots)}
        tmp = path.with_suffix(".tmp")
        torch.save(record, tmp)
        tmp.replace(path)  # a reader never sees half a file
        paths.append(path)
    return paths


def _armed() -> Path | None:
    where = os.environ.get(ENV)
    if not where:
        return None
    out = Path(where)
    return out if out.is_dir() else None


def on_prefill(scheduler: Any, batch: Any) -> list[Path]:
    """Prefill, before ``process_batch_result_disagg_prefill``: dump each request whose prompt is complete."""
    out = _armed()
    if out is None:
        return []
    pools = step_pools(scheduler)
    written: list[Path] = []
    for req in batch.reqs:
        room = getattr(req, "bootstrap_room", None)
        if room is None or getattr(req, "is_chunked", 0) > 0 or getattr(req, "inflight_middle_chunks", 0) > 0:
            continue
        slots = prompt_slots(scheduler.req_to_token_pool, req)
        written += dump(out, "prefill", int(room), req.origin_input_ids, pools, slots)
    return written


def on_decode(queue: Any, decode_req: Any, is_fake: Any = None) -> list[Path]:
    """Decode, after ``_commit_transfer_to_req``: dump the request's prompt KV as the transfer left it."""
    out = _armed()
    req = decode_req.req
    room = getattr(req, "bootstrap_room", None)
    if out is None or room is None or getattr(req, "finished_reason", None) is not None:
        return []
    if is_fake is not None and is_fake(req):
        return []
    scheduler = queue.scheduler
    return dump(
        out,
        "decode",
        int(room),
        req.origin_input_ids,
        step_pools(scheduler),
        prompt_slots(scheduler.req_to_token_pool, req),
    )


# ---- the test's side ----------------------------------------------------------------------


def load(out: Path) -> dict[tuple[str, int, int], dict[str, Any]]:
    """Every record under ``out`` by (role, room, step)."""
    import torch

    got = {}
    for path in sorted(out.glob("*.pt")):
        rec = torch.load(path, map_location="cpu")
        got[(rec["role"], int(rec["room"]), int(rec["step"]))] = rec
    return got


def compare(records: dict[tuple[str, int, int], dict[str, Any]]) -> dict[int, list[bool]]:
    """For each room the decode dumped: per chain step, whether its K and V equal the prefill's.

    Raises AssertionError when the two nodes' records of a room are not the same request
    (prompt ids) or a step is missing on the prefill.
    """
    import torch

    rooms = sorted({room for role, room, _ in records if role == "decode"})
    out: dict[int, list[bool]] = {}
    for room in rooms:
        steps = sorted(step for role, r, step in records if role == "decode" and r == room)
        same = []
        for step in steps:
            d = records[("decode", room, step)]
            p = records.get(("prefill", room, step))
            assert p is not None, f"room {room} step {step}: the decode dumped it, the prefill did not"
            assert d["input_ids"] == p["input_ids"], f"room {room}: the nodes' records are different requests"
            assert d["k"].shape == p["k"].shape and d["v"].shape == p["v"].shape, (room, step, d["k"].shape)
            same.append(bool(torch.equal(d["k"], p["k"]) and torch.equal(d["v"], p["v"])))
        out[room] = same
    return out


def nonzero_steps(records: Iterable[dict[str, Any]]) -> set[int]:
    """The chain steps whose K holds a nonzero value somewhere (the prefill did write them)."""
    return {int(r["step"]) for r in records if bool(r["k"].abs().sum() > 0)}
