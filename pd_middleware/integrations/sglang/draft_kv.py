"""Every chain step's draft KV across SGLang's PD transfer (multi-layer EAGLE, S > 1).

What SGLang 0.5.23 does (file:line under ``sglang/srt``):

- The multi-layer worker runs one ``ModelRunner`` per chain step
  (``speculative/multi_layer_eagle_worker_v2.py:189``, ``draft_runner_list``, built in
  ``managers/tp_worker.py:502-520``); each allocates its own KV pool
  (``model_executor/model_runner.py:988``) but all share the target's
  ``req_to_token_pool`` and ``token_to_kv_pool_allocator`` (``managers/tp_worker.py:403-416``,
  ``mem_cache/kv_cache_configurator.py:748``): one token index space, so one slot index
  addresses the same token in every step's pool.
- The prefill's draft extend runs every step over the prompt, each into its own pool at
  the target's slots (``multi_layer_eagle_worker_v2.py:688-700``).
- The scheduler hands the PD transfer one draft pool, ``primary_draft_kv_pool``
  (``managers/scheduler.py:1534-1538``), which is ``draft_runners[0].token_to_kv_pool``
  (``speculative/base_spec_worker.py:190-200``); ``disaggregation/prefill.py:301-317`` and
  ``disaggregation/decode.py:646-656`` append that pool's ``get_contiguous_buf_infos()``
  after the target's buffers. Steps 2..S's pools are never sent: on a decode, their MTP
  layers attend over prompt slots that hold zeros or another request's KV.

What the drop-in does, under ``[sglang].draft_kv = "all_steps"`` (the default) on a node
that runs S > 1 chain steps on the Mooncake backend (:func:`attach`, at scheduler start,
before SGLang builds its KV manager):

- ``get_contiguous_buf_infos`` of SGLang's primary draft pool (that one object: an
  instance attribute, :meth:`DraftKV.install`) returns every step's buffers, in step
  order; SGLang appends them after the target's and counts them all in
  ``num_draft_entries``. Both nodes register the same list, Mooncake pairs entries by
  position (``mooncake/conn.py:1143-1168``) and moves every entry at the same slot indices.
- The layout marker: ``kv_args.kv_layout`` (set from ``get_pd_kv_layout`` at ``prefill.py:271``
  and ``decode.py:620``, None for most pools) carries it (:meth:`DraftKV.layout`), added
  as ``CommonKVManager.__init__`` starts (``common/conn.py:316-325`` reads it into
  ``self.kv_layout``); the prefill publishes it to its bootstrap server
  (``common/conn.py:1599``).
- The decode refuses a prefill whose layout differs (none: a prefill without the drop-in
  or with ``"first_step"``) where SGLang refuses a page size, dtype or layout mismatch
  (``CommonKVManager.try_ensure_parallel_info``, ``common/conn.py:1293-1357``): a
  RuntimeError naming the flag.
- The prefill rejects a decode session that registered another number of KV buffers
  (``MooncakeKVManager._validate_peer_state_layout``, SGLang's per-session rejection hook:
  every transfer to it fails with the reason), before the in-band row's own check
  (:meth:`~.metadata.MetadataChannel.validate`), which the same wrapper runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .patching import MOONCAKE_MODULE, Feature, Hook, Refusal, Target, register_feature

logger = logging.getLogger("pd_middleware.integrations.sglang")

COMMON_CONN_MODULE = "sglang.srt.disaggregation.common.conn"
#: The config key an operator sets (named in every refusal).
FLAG = "[sglang].draft_kv"
#: How the layout marker starts (inside ``kv_args.kv_layout``).
MARKER = "pd-middleware-draft-kv"
#: The instance attribute that stands in for the primary pool's method.
BUF_INFOS = "get_contiguous_buf_infos"

BufInfos = tuple[list[int], list[int], list[int]]


@dataclass
class DraftKV:
    """Every chain step's draft KV pool in SGLang's PD transfer, on one node.

    ``pools``: one per chain step, in step order; ``pools[0]`` is SGLang's primary draft
    pool, the one its PD code reads. :meth:`install` makes that pool's
    ``get_contiguous_buf_infos()`` return every pool's buffers; :meth:`remove` undoes it.
    """

    pools: Sequence[Any]
    entries: int = 0  # KV buffers the draft adds to the transfer (all steps), set by install
    _originals: list[Callable[[], BufInfos]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.pools)

    def marker(self) -> str:
        """This node's draft KV layout, as both nodes must publish it."""
        return f"{MARKER} steps={self.steps} entries={self.entries}"

    def layout(self, sglang_layout: str | None) -> str:
        """``kv_args.kv_layout``: SGLang's own (None for most pools) with the marker."""
        return self.marker() if sglang_layout is None else f"{sglang_layout}+{self.marker()}"

    def buf_infos(self) -> BufInfos:
        """(ptrs, lens, item_lens) of every step's pool, step order (each pool's own order)."""
        ptrs: list[int] = []
        lens: list[int] = []
        items: list[int] = []
        for get in self._originals:
            p, n, i = get()
            ptrs += list(p)
            lens += list(n)
            items += list(i)
        return ptrs, lens, items

    def install(self) -> None:
        """Make the primary pool register every step's buffers (once)."""
        if self._originals:
            return
        # Bound methods taken before the override: pools[0]'s is SGLang's own.
        self._originals = [getattr(p, BUF_INFOS) for p in self.pools]
        self.entries = len(self.buf_infos()[0])
        setattr(self.pools[0], BUF_INFOS, self.buf_infos)

    def remove(self) -> None:
        """Give the primary pool its own method back."""
        if self._originals:
            vars(self.pools[0]).pop(BUF_INFOS, None)
            self._originals = []

    # -- the pair's agreement -----------------------------------------------------------
    def decode_refusal(self, bootstrap_addr: str, prefill_layout: str | None, decode_layout: str | None) -> str | None:
        """Decode: why the prefill at ``bootstrap_addr`` must not send to this node, or None."""
        if prefill_layout == decode_layout:
            return None
        theirs = (
            f"kv_layout {prefill_layout!r}"
            if prefill_layout is not None
            else "step 1's draft KV pool only (SGLang's list: no drop-in, or draft_kv = \"first_step\")"
        )
        return (
            f"pd-middleware: the prefill at {bootstrap_addr} registers {theirs}, this decode registers every "
            f"chain step's draft KV pool ({decode_layout}); their KV buffers would not pair up. Run both nodes with "
            f'the drop-in and {FLAG} = "all_steps", or set {FLAG} = "first_step" on this decode'
        )

    def prefill_refusal(self, session: str, local: int, remote: int) -> str | None:
        """Prefill: why decode ``session`` (``remote`` KV buffers registered) must be rejected, or None."""
        if local == remote:
            return None
        return (
            f"pd-middleware: decode session {session} registered {remote} KV buffers, this prefill {local} "
            f"({self.marker()}: every chain step's draft KV pool after the target's); the draft KV would land in "
            f'the wrong buffers. Run both nodes with the drop-in and {FLAG} = "all_steps", or set {FLAG} = '
            '"first_step" on this prefill'
        )


def attach(scheduler: Any, num_steps: int, backend: str) -> DraftKV | None:
    """At scheduler start: every chain step's pool into the transfer, or None (SGLang's list kept).

    None when there is one step, or when this node's layout is not the one this module
    reads (said once in the log, with the reason; both nodes of a pair decide alike:
    the same model and flags).
    """
    if num_steps <= 1:
        return None
    why, pools = _step_pools(scheduler, num_steps, backend)
    if why is not None:
        logger.warning(
            "pd-middleware: %s = \"all_steps\" left SGLang's draft KV transfer as it is (step 1's pool only): %s",
            FLAG,
            why,
        )
        return None
    dk = DraftKV(pools)
    dk.install()
    logger.info(
        "pd-middleware: the PD transfer carries every chain step's draft KV pool (%s)",
        dk.marker(),
    )
    return dk


def _step_pools(scheduler: Any, num_steps: int, backend: str) -> tuple[str | None, list[Any]]:
    if backend != "mooncake":
        return f"the {backend} backend (the pair's check runs on mooncake only)", []
    spec = getattr(scheduler, "draft_worker", None)
    runners = list(getattr(getattr(spec, "draft_worker", None), "draft_runners", None) or ())
    if len(runners) != num_steps:
        return f"{len(runners)} draft runners for {num_steps} chain steps (not SGLang's multi-layer worker)", []
    pools = [getattr(r, "token_to_kv_pool", None) for r in runners]
    if any(p is None for p in pools) or len({id(p) for p in pools}) != len(pools):
        return "the chain steps do not own one KV pool each", []
    if getattr(spec, "primary_draft_kv_pool", None) is not pools[0]:
        return "SGLang transfers no separate draft pool here (a fused or unified draft pool)", []
    first = runners[0]
    for r in runners[1:]:
        same_slots = r.token_to_kv_pool_allocator is first.token_to_kv_pool_allocator and getattr(
            r.req_to_token_pool, "req_to_token", None
        ) is getattr(first.req_to_token_pool, "req_to_token", None)
        if not same_slots:
            return "the chain steps do not share one token index space", []
    if len({type(p) for p in pools}) != 1:
        return f"the chain steps' pools differ in kind ({sorted({type(p).__name__ for p in pools})})", []
    target = getattr(getattr(scheduler, "token_to_kv_pool_allocator", None), "get_kvcache", lambda: None)()
    if hasattr(target, "get_kv_layer_ids") or hasattr(pools[0], "get_kv_layer_ids"):
        # SGLang then pairs entries by layer id, and numbers every step's entries alike.
        return f"a {type(target).__name__} target pool (the transfer pairs its entries by layer id)", []
    return None, pools


# --------------------------------------------------------------------- the features


def mark_layout(dk: DraftKV | None, args: Any) -> None:
    """``args.kv_layout`` with this node's marker (once), before SGLang's KV manager reads it."""
    layout = getattr(args, "kv_layout", None)
    if dk is not None and MARKER not in (layout or ""):
        args.kv_layout = dk.layout(layout)


def wrap_manager_init(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def __init__(self: Any, args: Any, disaggregation_mode: Any, server_args: Any, is_mla_backend: Any = False) -> None:
        mark_layout(inst.draft_kv, args)  # startup: a failure here stops the scheduler, on purpose
        orig(self, args, disaggregation_mode, server_args, is_mla_backend)

    return __init__


def wrap_parallel_info(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def try_ensure_parallel_info(self: Any, bootstrap_addr: str) -> Any:
        dk = inst.draft_kv
        if dk is None:
            return orig(self, bootstrap_addr)
        mine = getattr(self, "kv_layout", None)
        try:
            ok = orig(self, bootstrap_addr)
        except RuntimeError as exc:
            if "KV layout mismatch" not in str(exc):
                raise
            # SGLang's own refusal (both sides publish a layout) names other flags: name ours too.
            raise RuntimeError(
                f"{exc} (pd-middleware: this decode's layout is {mine!r}; run both nodes with the drop-in and the "
                f'same {FLAG}, or set {FLAG} = "first_step" on this decode)'
            ) from exc
        if not ok:
            return ok
        info = self.prefill_info_table.get(bootstrap_addr)
        why = dk.decode_refusal(bootstrap_addr, getattr(info, "kv_layout", None), mine)
        if why is not None:
            self.prefill_info_table.pop(bootstrap_addr, None)  # never marked ready
            logger.error("%s", why)
            raise RuntimeError(why)
        return ok

    return try_ensure_parallel_info


def peer_mismatch(inst: Any, manager: Any, info: Any) -> str | None:
    """Prefill, at a decode's registration: why the session must be rejected, or None
    (the draft KV list first, then the in-band row's layout)."""
    dk = inst.draft_kv
    if dk is not None:
        why: str | None = dk.prefill_refusal(
            str(info.mooncake_session_id), len(manager.kv_args.kv_data_ptrs), len(info.dst_kv_ptrs)
        )
        if why is not None:
            inst.events.count("draft_kv:peer_rejected")
            logger.error("pd-middleware: rejecting decode session %s: %s", info.mooncake_session_id, why)
            return why
    channel = inst.channel
    if channel is None:
        return None
    row: str | None = channel.validate(manager, info)
    return row


def wrap_validate(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def _validate_peer_state_layout(self: Any, registration_info: Any) -> Any:
        fully_checked, mismatch = orig(self, registration_info)
        if mismatch is None:
            try:
                mismatch = peer_mismatch(inst, self, registration_info)
            except Exception as exc:
                inst.events.failed("validate_peer", exc, "rejecting the session")
                mismatch = f"pd-middleware could not check the decode's registration (KV buffers, proposal rows): {exc}"
        return fully_checked, mismatch

    return _validate_peer_state_layout


def _all_steps(plan: Any) -> bool:
    return bool(plan.config.sglang.draft_kv == "all_steps")


register_feature(
    Feature(
        "draft_kv",
        (
            Target(
                COMMON_CONN_MODULE,
                "CommonKVManager.__init__",
                ("self", "args", "disaggregation_mode", "server_args", "is_mla_backend"),
                Hook.AROUND,
                wrap_manager_init,
            ),
            Target(
                COMMON_CONN_MODULE,
                "CommonKVManager.try_ensure_parallel_info",
                ("self", "bootstrap_addr"),
                Hook.AROUND,
                wrap_parallel_info,
            ),
        ),
        _all_steps,
        summary="every chain step's draft KV pool in the PD transfer, the pair's layout marker and the decode's check ([sglang].draft_kv = \"all_steps\", S > 1)",
        refused=(
            Refusal(
                "no kv_args.kv_layout, the carrier of every chain step's draft KV, before SGLang 0.5.23",
                'run [sglang].draft_kv = "first_step" (the first step\'s draft KV, as SGLang transfers it)',
                until="0.5.22",
            ),
        ),
    )
)
register_feature(
    Feature(
        "peer_check",
        (
            Target(
                MOONCAKE_MODULE,
                "MooncakeKVManager._validate_peer_state_layout",
                ("self", "registration_info"),
                Hook.AROUND,
                wrap_validate,
            ),
        ),
        lambda plan: "metadata" in plan.features or _all_steps(plan),
        summary="the prefill's check of each decode session: its KV buffer count (draft_kv) and its proposal row layout",
        refused=(
            Refusal(
                "no MooncakeKVManager._validate_peer_state_layout before SGLang 0.5.22",
                'run [sglang].channel = "sidechannel" for a shipped strategy and [sglang].draft_kv = "first_step"',
                until="0.5.21",
            ),
        ),
    )
)
