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

What the drop-in does, under ``[sglang].draft_kv = "all_steps"`` (the default when the
source ships proposals; ``"first_step"`` under ``channel = "none"``) on a node that runs
S > 1 chain steps on the Mooncake backend (:func:`attach`, at scheduler start, before
SGLang builds its KV manager; it keeps SGLang's list, with a warning naming the flag,
where SGLang would not move every entry it registers: the staging buffer, a PP stage,
host receive, step pools whose KV shape is not the target's: :func:`_step_pools`):

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
- The decode decides per prefill, as SGLang fetches its info, and never by raising:
  SGLang raises its own mismatches inside ``CommonKVManager.try_ensure_parallel_info``
  (``common/conn.py:1293-1357``), which ``DecodePreallocQueue._ensure_prefill_info``
  (``decode.py:1180``) calls without a try, so a raise there stops the scheduler with
  every in-flight request. The wrapper keeps the marker's comparison to itself (it hands
  SGLang ``kv_layout = None`` for the call) and caches the prefill's info. SGLang's own
  parts of the two layouts (the marker stripped from both: ``--dsv4-attn-backend``,
  ``SGLANG_DSV4_KV_LAYOUT``) stay SGLang's: where both are set and differ, the info is
  fetched again with this node's own part handed to SGLang, whose check raises as it
  does without the drop-in. Otherwise:

  - the same marker: every step's pool;
  - SGLang's list (no marker: no drop-in, or ``"first_step"``): the decode registers
    SGLang's list with that prefill (``CommonKVReceiver._register_kv_args``, sent once per
    prefill rank), so step 1's KV lands in step 1's pool, and serves its requests with
    step 1's KV and SGLang's chain, as a stock pair does (counted at each receiver's
    start, ``guard.draft_kv:first_step_requests``: see docs/sglang.md);
  - another marker (another chain): each request from that prefill fails where SGLang
    fails a request whose peer disagrees (``CommonKVReceiver.init``,
    ``common/conn.py:2512-2535``, an allocation-policy mismatch): the receiver is aborted
    and the room's failure reason is ours, so the handshake waiter ends the request with
    SGLang's "Decode handshake failed ..." error carrying the reason (counted once per
    request, ``guard.draft_kv:prefill_refused``). Every other prefill is served.
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

from .metadata_inline import wrap_send_aux
from .patching import FEATURES, MOONCAKE_MODULE, Feature, Hook, Refusal, Target, register_feature
from .startup import STAGING_ENV, EngineFacts

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
    first_entries: int = 0  # of which step 1's (SGLang's own list), set by install
    # Decode, by bootstrap address, set when SGLang fetches that prefill's info and read as
    # each request's receiver starts: why its requests fail (another marker) ...
    refused: dict[str, str] = field(default_factory=dict)
    # ... or that it sends step 1's pool only (SGLang's list): this decode registers
    # SGLang's list with it and serves its requests with step 1's KV.
    first_step_only: set[str] = field(default_factory=set)
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
        self.first_entries = len(self._originals[0]()[0])
        setattr(self.pools[0], BUF_INFOS, self.buf_infos)

    def remove(self) -> None:
        """Give the primary pool its own method back."""
        if self._originals:
            vars(self.pools[0]).pop(BUF_INFOS, None)
            self._originals = []

    def sglang_list(self, ptrs: Sequence[int], items: Sequence[int]) -> tuple[list[int], list[int]]:
        """SGLang's own KV list (the target's, then step 1's) out of this node's (every step's)."""
        cut = len(ptrs) - (self.entries - self.first_entries)
        return list(ptrs[:cut]), list(items[:cut])

    # -- the pair's agreement -----------------------------------------------------------
    def sglang_layout(self, decode_layout: str | None) -> str | None:
        """This node's ``kv_layout`` without the marker: what SGLang alone publishes here."""
        return sglang_part(decode_layout)

    def first_step_only_from(self, prefill_layout: str | None, decode_layout: str | None) -> bool:
        """Decode: whether that prefill registers SGLang's list (step 1's pool only: no
        drop-in, or ``"first_step"``: it publishes no marker), which this decode can pair
        by registering it too. SGLang's own parts of the two layouts are SGLang's to
        compare (:func:`wrap_parallel_info` leaves that check to SGLang)."""
        return MARKER not in (prefill_layout or "")

    def decode_refusal(self, bootstrap_addr: str, prefill_layout: str | None, decode_layout: str | None) -> str | None:
        """Decode: why the prefill at ``bootstrap_addr`` must not send to this node, or None
        (the same marker, or SGLang's list: :meth:`first_step_only_from`). SGLang's own
        parts of the layouts are not compared here: SGLang compares them
        (:func:`wrap_parallel_info`)."""
        if self.first_step_only_from(prefill_layout, decode_layout) or marker_part(prefill_layout) == marker_part(
            decode_layout
        ):
            return None
        return (
            f"pd-middleware: the prefill at {bootstrap_addr} registers kv_layout {prefill_layout!r}, this decode "
            f"{decode_layout!r} (every chain step's draft KV pool); their KV buffers would not pair up. Run both "
            f'nodes with the drop-in and the same {FLAG} and chain, or set {FLAG} = "first_step" on this decode'
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


def attach(scheduler: Any, facts: EngineFacts) -> DraftKV | None:
    """At scheduler start: every chain step's pool into the transfer, or None (SGLang's list kept).

    None when there is one step, or when SGLang would not move every entry this module
    registers here (said once in the log, naming the flag and the reason; the node then
    advertises no marker: nothing is advertised that is not sent. A decode with
    ``"all_steps"`` serves such a prefill with step 1's KV; a prefill with it rejects
    such a decode's sessions, naming the flag). SGLang's settings come from ``facts``
    (:class:`~.startup.EngineFacts`: ``pp_size``, ``staging``, ``host_receive``, read once
    by :func:`~.startup.facts_from_scheduler`).
    """
    if facts.num_steps <= 1:
        return None
    why, pools = _step_pools(scheduler, facts)
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


def _step_pools(scheduler: Any, facts: EngineFacts) -> tuple[str | None, list[Any]]:
    num_steps, backend = facts.num_steps, facts.backend
    if backend != "mooncake":
        return f"the {backend} backend (the pair's check runs on mooncake only)", []
    # Settings under which SGLang's transfer moves fewer entries than are registered.
    if facts.pp_size > 1:
        return (
            f"pipeline parallelism ({facts.pp_size} stages: each stage registers its own layers' pools, "
            "so no stage's list matches a peer's)"
        ), []
    if facts.staging:
        return (
            f"{STAGING_ENV} is set (its path, for different attention TP sizes, gathers step 1's pool only); "
            f'unset it or set {FLAG} = "first_step" on both nodes'
        ), []
    if facts.host_receive:
        return (
            "host receive (--disaggregation-decode-host-receive-threshold below 1: the host buffers mirror "
            "SGLang's list, step 1's pool only)"
        ), []
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
    shape = _kv_shape(target)
    for i, p in enumerate(pools):
        if shape is not None and _kv_shape(p) != shape:
            # Between different attention TP sizes SGLang slices every entry with the
            # target's item length and head count (send_kvcache_slice, mooncake/conn.py:1672).
            return (
                f"chain step {i + 1}'s KV shape {_kv_shape(p)} is not the target's {shape} (a head-sliced "
                "transfer between different attention TP sizes would cut it with the target's)"
            ), []
    return None, pools


def _kv_shape(pool: Any) -> tuple[Any, ...] | None:
    """(heads, head dim, value head dim, bytes per token entry) of an MHA pool, or None."""
    if pool is None or not hasattr(pool, "head_num"):
        return None
    items = list(pool.get_contiguous_buf_infos()[2])
    return (
        getattr(pool, "head_num", None),
        getattr(pool, "head_dim", None),
        getattr(pool, "v_head_dim", None),
        tuple(sorted(set(items))),
    )


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


def sglang_part(layout: str | None) -> str | None:
    """A published ``kv_layout`` without the drop-in's marker (any node's: any steps and
    entries): what SGLang alone publishes there (None for most pools)."""
    if layout is None or MARKER not in layout:
        return layout
    head = layout[: layout.index(MARKER)]
    return head[:-1] if head.endswith("+") else (head or None)


def marker_part(layout: str | None) -> str | None:
    """The drop-in's marker in a published ``kv_layout`` (None: none there)."""
    if layout is None or MARKER not in layout:
        return None
    return layout[layout.index(MARKER) :]


def wrap_parallel_info(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def try_ensure_parallel_info(self: Any, bootstrap_addr: str) -> Any:
        dk = inst.draft_kv
        if dk is None or bootstrap_addr in self.prefill_info_table:
            return orig(self, bootstrap_addr)  # cached: decided when it was fetched
        mine = getattr(self, "kv_layout", None)

        def fetch(layout: str | None) -> Any:
            self.kv_layout = layout
            try:
                return orig(self, bootstrap_addr)
            finally:
                self.kv_layout = mine

        # SGLang raises on a layout mismatch here, and its caller has no try: the
        # scheduler would stop with every in-flight request. Hand SGLang no layout for
        # this call (it compares only when both nodes publish one) and compare here.
        ok = fetch(None)
        if not ok:
            return ok
        theirs = getattr(self.prefill_info_table.get(bootstrap_addr), "kv_layout", None)
        ours, own = sglang_part(theirs), sglang_part(mine)
        if ours is not None and own is not None and ours != own:
            # SGLang's own parts differ (--dsv4-attn-backend, SGLANG_DSV4_KV_LAYOUT): SGLang's
            # check, as without the drop-in. Fetched again, this node's part alone handed
            # to SGLang, which raises its own mismatch.
            self.prefill_info_table.pop(bootstrap_addr, None)
            ok = fetch(own)
            if not ok:
                return ok
            theirs = getattr(self.prefill_info_table.get(bootstrap_addr), "kv_layout", None)
        why = dk.decode_refusal(bootstrap_addr, theirs, mine)
        dk.refused.pop(bootstrap_addr, None)
        dk.first_step_only.discard(bootstrap_addr)
        if why is not None:
            dk.refused[bootstrap_addr] = why  # each request from it fails as its receiver starts
            logger.error("%s; its requests fail, every other prefill is served", why)
        elif dk.first_step_only_from(theirs, mine):
            dk.first_step_only.add(bootstrap_addr)
            logger.warning(
                "pd-middleware: the prefill at %s registers step 1's draft KV pool only (no drop-in, or %s = "
                "\"first_step\"): this decode registers SGLang's list with it and serves its requests with step 1's "
                "KV and SGLang's chain (steps 2..S's prompt KV not sent), counted draft_kv:first_step_requests",
                bootstrap_addr,
                FLAG,
            )
        return ok

    return try_ensure_parallel_info


def wrap_receiver_init(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def init(self: Any, prefill_dp_rank: int) -> Any:
        dk = inst.draft_kv
        why = None if dk is None else dk.refused.get(self.bootstrap_addr)
        if why is None or self.conclude_state is not None:
            if dk is not None and self.conclude_state is None and self.bootstrap_addr in dk.first_step_only:
                inst.events.count("draft_kv:first_step_requests")
            return orig(self, prefill_dp_rank)
        # Where SGLang fails a request whose peer disagrees (its allocation-policy
        # mismatch in this method): the room fails with the reason, never the scheduler.
        # abort() marks it Failed (it records a generic reason), then ours replaces it,
        # as SGLang's own _fail_prefill_recompute does.
        self.abort()
        self.kv_mgr.record_failure(self.bootstrap_room, why)
        inst.events.count("draft_kv:prefill_refused")
        return None

    return init


def wrap_register(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def _register_kv_args(self: Any) -> Any:
        dk = inst.draft_kv
        if dk is None or self.bootstrap_addr not in dk.first_step_only:
            return orig(self)
        # A prefill that sends step 1's pool only: register SGLang's list with it (its
        # entries then pair up, position by position), for this call only. SGLang sends
        # this registration once per prefill rank (its connection pool caches the rest).
        # The decode's scheduler thread is the one that reads these lists (a decode is
        # written to, it sends no KV), and it is the thread running this call.
        args = self.kv_mgr.kv_args
        ptrs, items = args.kv_data_ptrs, args.kv_item_lens
        args.kv_data_ptrs, args.kv_item_lens = dk.sglang_list(ptrs, items)
        try:
            return orig(self)
        finally:
            args.kv_data_ptrs, args.kv_item_lens = ptrs, items

    return _register_kv_args


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


def session_verdict(inst: Any, manager: Any, info: Any) -> str | None:
    """:func:`peer_mismatch` that never raises: a check that fails rejects the session."""
    try:
        return peer_mismatch(inst, manager, info)
    except Exception as exc:
        inst.events.failed("validate_peer", exc, "rejecting the session")
        return f"pd-middleware could not check the decode's registration (KV buffers, proposal rows): {exc}"


def wrap_validate(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def _validate_peer_state_layout(self: Any, registration_info: Any) -> Any:
        fully_checked, mismatch = orig(self, registration_info)
        if mismatch is None:
            mismatch = session_verdict(inst, self, registration_info)
        return fully_checked, mismatch

    return _validate_peer_state_layout


def _all_steps(plan: Any) -> bool:
    """``[sglang].draft_kv`` as this node runs it: left out, "all_steps" only when the
    source ships proposals (its features hold ``prefill``); a source that ships nothing
    (decode-only recompute, ``channel = "none"``) runs behind a stock prefill, which sends
    step 1's pool only: "all_steps" there would only patch SGLang's transfer for nothing.
    Left out on a release without the carrier (before 0.5.23): "first_step"."""
    chosen = plan.config.sglang.draft_kv
    if chosen is None:
        # Left out: every step's pool where the release can carry it (0.5.23+), else SGLang's
        # first step (the chain still ships; its later steps' draft KV is the decode's own).
        return "prefill" in plan.features and FEATURES["draft_kv"].refusal(plan.release) is None
    return bool(chosen == "all_steps")


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
            Target(
                COMMON_CONN_MODULE,
                "CommonKVReceiver.init",
                ("self", "prefill_dp_rank"),
                Hook.AROUND,
                wrap_receiver_init,
            ),
            Target(
                COMMON_CONN_MODULE,
                "CommonKVReceiver._register_kv_args",
                ("self",),
                Hook.AROUND,
                wrap_register,
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
                since="0.5.22",
            ),
            # Before SGLang's per-session hook: the same check at the session's first aux
            # transfer, which a mismatch fails (metadata_inline).
            Target(
                MOONCAKE_MODULE,
                "MooncakeKVManager.send_aux",
                ("self", "req", "prefill_aux_index", "dst_aux_ptrs"),
                Hook.AROUND,
                wrap_send_aux,
                until="0.5.21",
            ),
        ),
        lambda plan: "metadata" in plan.features or _all_steps(plan),
        summary="the prefill's check of each decode session: its KV buffer count (draft_kv) and its proposal row layout",
    )
)
