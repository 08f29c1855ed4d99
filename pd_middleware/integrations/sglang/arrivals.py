"""The side channel's bounded wait, inside SGLang's transfer poll (the feature ``arrival_wait``).

A shipped proposal on the side channel travels beside SGLang's KV transfer, not with it:
without a wait, a request whose KV landed first is built before its payload is stored and
verifies the one-hot (``fallback:missing``), and its payload, arriving later, is an orphan.

SGLang's decode polls every transfer of its queue, then takes the MIN of the polls across
its ranks (``poll_and_all_reduce``). Before that MIN, ``_apply_metadata_gate`` already
reports "transferring" for a request whose metadata has not landed. The drop-in wraps that
gate: after SGLang's own gate, a request whose KV is done but whose payload is not in the
store yet (and a shipping prefill is connected) is reported still transferring, for at most
``[sglang].sidechannel_wait_s`` (:class:`~.store.ArrivalWait`). Only the rank with the
receiver holds; the MIN makes every rank wait with it, and nothing blocks the scheduler loop.

The same wrapper records each request's life (:func:`~.common.life_of`, read before the
transfer commits) on the Req: the proposer takes a payload only for that life.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .common import LIFE_ATTR, is_probe, life_of, room_key
from .patching import UTILS_MODULE, Feature, Hook, Target, read, register_feature
from .store import ArrivalWait, ProposalStore

logger = logging.getLogger("pd_middleware.integrations.sglang")

KVPOLL = f"{UTILS_MODULE}.KVPoll"


def wait_on(store: ProposalStore, receiver: Any, wait_s: float, events: Any) -> ArrivalWait:
    """The side channel's bounded wait on ``store``: a request is held only while
    ``receiver`` has a prefill connected, for at most ``wait_s``; ``events`` counts it
    (``wait:expired`` logged once)."""

    def expecting() -> bool:
        try:
            return receiver is not None and bool(receiver.peers)
        except RuntimeError:  # the receive thread changed its table meanwhile: ask next poll
            return True

    def count(key: str) -> None:
        if key != "wait:expired":
            events.count(key)
            return
        events.count(
            key,
            log=lambda: (
                f"pd-middleware side channel: a payload did not arrive within sidechannel_wait_s={wait_s} s of "
                "its KV; the request verifies one-hot (fallback:missing) and its payload, if it comes, is "
                "released at once"
            ),
        )

    return ArrivalWait(store, wait_s, expecting=expecting, count=count)


def hold_arrivals(inst: Any, polls: list[Any], decode_reqs: Any) -> None:
    """Report "transferring" for each request whose transfer is done but whose payload the
    installation's source still awaits (its :meth:`~.sources.ProposalSource.hold`)."""
    kv_poll = inst.symbols.get(KVPOLL)
    if kv_poll is None or decode_reqs is None:
        return
    success, transferring = int(kv_poll.Success), int(kv_poll.Transferring)
    rows = [i for i, p in enumerate(polls) if int(p) == success]
    if not rows:
        return
    keys: list[tuple[str | None, int | None]] = []
    for i in rows:
        req = decode_reqs[i].req
        if is_probe(req):
            keys.append((None, None))
            continue
        life = life_of(req)
        setattr(req, LIFE_ATTR, life)
        keys.append((room_key(getattr(req, "bootstrap_room", None)), life))
    held = inst.source.hold(keys)
    if held is None:
        return
    for i, h in zip(rows, held):
        if h:
            polls[i] = transferring


def wrap_gate(original: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def _apply_metadata_gate(polls: Any, decode_reqs: Any, metadata_buffers: Any, *rest: Any) -> Any:
        out = original(polls, decode_reqs, metadata_buffers, *rest)
        try:
            hold_arrivals(inst, polls, decode_reqs)
        except Exception as exc:  # never fails SGLang's poll: the request goes on unheld
            inst.events.failed("arrival_wait", exc, "the request goes on without waiting for its payload")
        return out

    return _apply_metadata_gate


register_feature(
    Feature(
        "arrival_wait",
        (
            Target(
                UTILS_MODULE,
                "_apply_metadata_gate",
                ("polls", "decode_reqs", "metadata_buffers", "server_args"),
                Hook.AROUND,
                wrap_gate,
                until="0.5.18",
            ),
            Target(
                UTILS_MODULE,
                "_apply_metadata_gate",
                ("polls", "decode_reqs", "metadata_buffers"),
                Hook.AROUND,
                wrap_gate,
                since="0.5.19",
            ),
            read(UTILS_MODULE, "KVPoll"),
        ),
        lambda plan: "arrival_wait" in plan.features,
        summary="the side channel's bounded wait: a transfer's success held until its payload is stored",
    )
)
