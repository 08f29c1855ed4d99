"""The in-band channel on SGLang's decode: aux bytes, cost per batch against SGLang's own
builder, and the scheduler-thread cost of one row.

For each strategy config (``configs/*.toml``) the real prefill encoder encodes rows of the
synthetic workload (V = 152064) and :func:`pd_middleware.codecs.inband.write_row` writes each
request's row, as the prefill does into SGLang's metadata buffer. Then, side by side in
one run, with medians over repeats:

- ``aux_bytes_per_request``: bytes of each strategy's row (header + X + q(X) + proposal),
  mean over the requests; ``aux_capacity_needed``: the largest row, the capacity the
  config's ``capacity_bytes`` must hold.
- ``ratio_vs_sglang_builder``: the decode's cost per batch of B requests, through the
  drop-in's own SGLang decode code (:class:`~pd_middleware.integrations.sglang.proposer.DecodeProposer`):
  at each request's transfer commit, read its row as SGLang's patched commit does
  (:meth:`MetadataChannel.read <pd_middleware.integrations.sglang.metadata.MetadataChannel.read>`:
  one copy of the row, :func:`~pd_middleware.codecs.inband.read_row`, the binding tag beside
  X) and attach it (``on_row``: X checked against the engine's, the receive pipeline
  with the strategy's synthesizer), then build the
  batch's fresh (B, 1, V) fp32 ``draft_probs`` (``propose``, which ends in
  :meth:`~pd_middleware.decode.assembler.ProposalAssembler.build_fresh`), over SGLang's own
  ``pd_first_draft_proposal`` alone (zeros + scatter of the one-hots),
  at B = 1, 16, 256, with ``topk_index`` on ``--device`` (default: CUDA when present),
  for each strategy and, in the same run, for the multi-layer chain
  (``sparse_floor_chain``: ``configs/multi_layer.yaml`` at S = 3 against SGLang's (B, 3, V)
  one-hot chain; the JSON's ``chain`` section and ``ratio_vs_sglang_builder_chain_B*``),
where both builders then build (``decode_device``). Goal <= 1.5 on CPU. SGLang's function is taken from the installed
  package: imported when it imports, else its source compiled from the installed file
  (importing the module pulls every model config, two of which need torchvision; the
  function itself only uses torch). Without SGLang the ratio is reported as skipped.
  ``ratio_vs_sglang_builder_best`` is the ratio of the fastest repeats (on a loaded
  machine, the least disturbed samples).
- ``per_request_us``: the scheduler-thread cost of turning one row into a proposal
  (``MetadataChannel.read`` + ``on_row``: pipeline and synthesizer, every check included) at the ``sparse_floor``
  operating point (about 2,700 entries per request). Goal <= 50 us. Also per strategy:
  on the thread's CPU clock (``per_request_cpu_us_by_strategy``) and the fastest repeat
  (``per_request_best_us_by_strategy``).

    python benchmarks/sglang_inband.py [--quick] [--requests 32] [--seed 0] [--repeats 9]
                                       [--strategies one_hot sparse_floor ...]

The requests are stand-ins for SGLang's ``Req`` (a real one needs a scheduler) holding
the fields the decode reads, of SGLang's types: ``bootstrap_room``, and
``output_topk_index``/``output_topk_p`` as the int64/fp32 (16,) CPU rows SGLang clones
out of its metadata buffers at commit. The last stdout line is one JSON object. Figures
taken on a loaded machine are inflated.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit

from pd_middleware import Payload
from pd_middleware.codecs.inband import RowLayout, row_bytes, write_row
from pd_middleware.config import load_config
from pd_middleware.integrations.sglang.metadata import BUFFER_ATTR, TAG_COLUMN, MetadataChannel, row_tag
from pd_middleware.integrations.sglang.proposer import DecodeProposer
from pd_middleware.middleware import build_encoders
from pd_middleware.workloads import make_workload

ROOT = Path(__file__).resolve().parent.parent
STRATEGIES = ("one_hot", "sparse_topk", "sparse_topp", "sparse_floor", "full_bf16", "full_fp32")
QUICK_STRATEGIES = ("one_hot", "sparse_floor")
#: The multi-layer chain: ``sparse_floor`` per step (configs/multi_layer.yaml), S = CHAIN_STEPS.
CHAIN = "sparse_floor_chain"
CHAIN_STEPS = 3
BATCHES = (1, 16, 256)
RATIO_GOAL = 1.5
PER_REQUEST_GOAL_US = 50.0


def sglang_builder() -> tuple[Callable[[torch.Tensor, int], torch.Tensor] | None, str]:
    """SGLang's ``pd_first_draft_proposal`` and where it came from, or (None, why not)."""
    spec = importlib.util.find_spec("sglang")  # top level only: imports nothing
    if spec is None or not spec.submodule_search_locations:
        return None, "SGLang is not installed"
    if importlib.util.find_spec("torchvision") is None:
        # The module imports every model config, two of which import torchvision: the
        # import would fail after seconds of loading, so go to the source at once.
        why = "torchvision, which its model configs import, is absent"
    else:
        try:
            from sglang.srt.speculative.eagle_disaggregation import pd_first_draft_proposal

            return pd_first_draft_proposal, "imported"
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
    path = Path(spec.submodule_search_locations[0]) / "srt" / "speculative" / "eagle_disaggregation.py"
    if not path.is_file():
        return None, f"SGLang has no {path.name} ({why})"
    tree = ast.parse(path.read_text(), str(path))
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "pd_first_draft_proposal"), None)
    if fn is None:
        return None, f"this SGLang has no pd_first_draft_proposal ({why})"
    ns: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), ns)
    return ns["pd_first_draft_proposal"], f"compiled from the installed source ({why})"


def strategy_config(strategy: str, vocab_size: int, steps: int) -> Any:
    """The strategy's shipped config with the engine's shapes filled in (V, S): the chain
    uses ``configs/multi_layer.yaml`` (what a multi-layer pair ships), the others their
    ``configs/<strategy>.toml``."""
    import msgspec

    path = ROOT / "configs" / ("multi_layer.yaml" if strategy == CHAIN else f"{strategy}.toml")
    cfg = load_config(path)
    return msgspec.structs.replace(cfg, model=cfg.model.with_shapes(vocab_size, steps, engine="benchmark"))


def encode_rows(cfg: Any, q: torch.Tensor, seed: int) -> tuple[list[Payload], RowLayout, np.ndarray, list[int]]:
    """Encode ``q`` (N, V) or (N, S, V) with ``cfg``'s encoder; write one row per request.

    Returns the payloads, the layout (capacity: the config's ``[sglang].capacity_bytes``,
    or the largest row rounded up to 64 B if larger), the rows (N, capacity) uint8 and
    the rooms.
    """
    enc = build_encoders(cfg)["default"]
    out = enc.encode(q, generator=torch.Generator().manual_seed(seed))
    n, v = q.shape[0], q.shape[-1]
    steps = 1 if q.dim() == 2 else q.shape[1]
    tokens, probs = out.tokens.tolist(), out.token_probs.tolist()
    payloads = [
        Payload(
            request_id=str(1000 + i),
            draft_tokens=tuple(tokens[i]),
            draft_probs=tuple(min(1.0, max(0.0, p)) for p in probs[i]),
            vocab_size=v,
            provenance=out.provenance,
            proposal=out.proposals[i],
        )
        for i in range(n)
    ]
    need = max(row_bytes(p) for p in payloads)
    # The config's row capacity (what a deployment allocates and the decode reads from),
    # raised to the largest row if that does not fit.
    layout = RowLayout(
        capacity_bytes=max(cfg.sglang.capacity_bytes, -(-need // 64) * 64), vocab_size=v, num_steps=steps
    )
    rows = np.zeros((n, layout.capacity_bytes), dtype=np.uint8)
    rooms = [1000 + i for i in range(n)]
    for i, p in enumerate(payloads):
        write_row(rows[i], rooms[i], p, layout)
    return payloads, layout, rows, rooms


class Req:
    """The fields of SGLang's ``Req`` the decode side reads (a stand-in; see above)."""

    def __init__(self, room: int, tokens: tuple[int, ...], probs: tuple[float, ...], tag: int) -> None:
        self.bootstrap_room = room
        self.rid = str(room)
        # SGLang's metadata rows are 16 wide; commit clones the request's row. The
        # prefill's drop-in writes the row's binding tag into the spare last column.
        self.output_topk_index = torch.zeros(16, dtype=torch.int64)
        self.output_topk_index[: len(tokens)] = torch.tensor(tokens)
        self.output_topk_index[TAG_COLUMN] = tag
        self.output_topk_p = torch.zeros(16, dtype=torch.float32)
        self.output_topk_p[: len(probs)] = torch.tensor(probs)


class Buffers:
    """SGLang's ``MetadataBuffers`` as the channel reads it: the proposal rows."""

    def __init__(self, rows: np.ndarray) -> None:
        setattr(self, BUFFER_ATTR, torch.from_numpy(rows))


class Batch:
    """SGLang's ``ScheduleBatch`` as the builder sees it: its requests."""

    def __init__(self, reqs: list[Req]) -> None:
        self.reqs = reqs


def decode_batch(
    channel: MetadataChannel, proposer: DecodeProposer, bufs: Buffers, n: int, batch: Batch, topk: torch.Tensor
) -> torch.Tensor:
    """What the decode does for a batch: each request's row at its transfer commit
    (request j holds slot j mod n), then the draft input."""
    for j, req in enumerate(batch.reqs):
        proposer.on_row(req, channel.read(bufs, j % n, req))
    assert channel.layout is not None
    return proposer.propose(batch, topk, channel.layout.vocab_size)


def side_by_side(
    fns: dict[str, Callable[[], Any]],
    repeats: int,
    inner: int,
    clock: Callable[[], float] = time.perf_counter,
    best: dict[str, float] | None = None,
) -> dict[str, float]:
    """Median seconds per call of each function, timed in alternation (same load).

    ``best``, when given, receives each function's fastest repeat: on a loaded machine
    the least disturbed sample, closest to the cost on a quiet one.
    """
    for f in fns.values():
        f()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = clock()
            for _ in range(inner):
                f()
            samples[k].append((clock() - t0) / inner)
    if best is not None:
        best.update({k: min(v) for k, v in samples.items()})
    return {k: statistics.median(v) for k, v in samples.items()}


def _done(t: torch.Tensor) -> torch.Tensor:
    """Wait for a device tensor (CUDA work is asynchronous: time it finished)."""
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two strategies, B = 1 and 16, few repeats (a smoke run)")
    ap.add_argument("--requests", type=int, default=32, help="distinct workload rows per strategy (batches reuse them)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--strategies", nargs="+", choices=STRATEGIES, help="a subset (sparse_floor is always run: the headline)"
    )
    ap.add_argument("--repeats", type=int, default=9, help="timed repeats per figure (medians)")
    ap.add_argument(
        "--device",
        default="auto",
        help="where topk_index (and so both builders' draft_probs) lives: cpu, cuda, or auto (cuda when present)",
    )
    args = ap.parse_args()
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    strategies = QUICK_STRATEGIES if args.quick else STRATEGIES
    if args.strategies:
        strategies = tuple(s for s in STRATEGIES if s in args.strategies or s == "sparse_floor")
    batches = (1, 16) if args.quick else BATCHES
    repeats = 2 if args.quick else args.repeats
    n_req = min(args.requests, 8) if args.quick else args.requests

    wl = make_workload("synthetic")
    v = wl.vocab_size
    q = next(iter(wl.batches(n_req, n_req, args.seed))).draft_probs[:, 0].float()
    chain_wl = make_workload("synthetic", num_steps=CHAIN_STEPS)
    q_chain = next(iter(chain_wl.batches(n_req, n_req, args.seed))).draft_probs.float()
    builder, builder_source = sglang_builder()

    aux_bytes: dict[str, float] = {}
    aux_capacity: dict[str, int] = {}
    entries: dict[str, float] = {}
    ratios: dict[str, dict[str, float]] = {}
    ours_ms: dict[str, dict[str, float]] = {}
    sglang_ms: dict[str, dict[str, float]] = {}
    per_request: dict[str, float] = {}
    per_request_cpu: dict[str, float] = {}
    per_request_best: dict[str, float] = {}
    ratios_best: dict[str, dict[str, float]] = {}
    for strategy in (*strategies, CHAIN):
        steps = CHAIN_STEPS if strategy == CHAIN else 1
        cfg = strategy_config(strategy, v, steps)
        payloads, layout, rows, rooms = encode_rows(cfg, q_chain if steps > 1 else q, args.seed)
        aux_bytes[strategy] = round(statistics.fmean(row_bytes(p) for p in payloads), 1)
        aux_capacity[strategy] = -(-max(row_bytes(p) for p in payloads) // 64) * 64
        props = [p.proposal for p in payloads]
        entries[strategy] = round(
            statistics.fmean(
                sum(p.lengths) if p is not None and p.kind == "sparse" else (v if p is not None else 0) for p in props
            ),
            1,
        )
        proposer = DecodeProposer(cfg)
        proposer.bind(v, steps)
        mw = proposer.middleware
        x = [p.draft_tokens for p in payloads]
        # Request j of a batch carries row j mod N (its room and X).
        n = len(payloads)
        tags = [row_tag(rows[i]) for i in range(n)]
        reqs = [Req(rooms[j % n], x[j % n], payloads[j % n].draft_probs, tags[j % n]) for j in range(max(batches))]
        channel = MetadataChannel(layout.capacity_bytes)
        assert channel.bind(v, steps) == layout
        bufs = Buffers(rows)
        # Every row is handed over as its strategy's law, never a fallback (which would
        # time the cheap one-hot path instead).
        everyone = Batch(reqs[:n])
        built = decode_batch(channel, proposer, bufs, n, everyone, torch.tensor([t[:steps] for t in x]))
        fallbacks = {k: c for k, c in proposer.counts.items() if k.startswith("fallback")}
        if mw.metrics.fallbacks or fallbacks or set(channel.counts) != {"inband:read"}:
            raise RuntimeError(
                f"{strategy}: unexpected fallbacks {dict(mw.metrics.fallbacks)} {fallbacks} {dict(channel.counts)}"
            )
        assert built.shape == (len(payloads), steps, v)
        ratios[strategy], ours_ms[strategy], sglang_ms[strategy] = {}, {}, {}
        ratios_best[strategy] = {}
        for b in batches:
            # On topk_index's device, where SGLang builds its own proposal (and so do we).
            topk = torch.tensor([x[j % len(x)] for j in range(b)], dtype=torch.int64).view(b, steps).to(dev)
            batch = Batch(reqs[:b])
            fns: dict[str, Callable[[], Any]] = {
                "ours": lambda batch=batch, topk=topk, ch=channel, dp=proposer, bf=bufs, n=n: _done(
                    decode_batch(ch, dp, bf, n, batch, topk)
                )
            }
            if builder is not None:
                fns["sglang"] = lambda topk=topk: _done(builder(topk, v))
            inner = 1 if args.quick else max(1, 64 // b)
            fast: dict[str, float] = {}
            med = side_by_side(fns, repeats, inner, best=fast)
            ours_ms[strategy][f"B{b}"] = round(1e3 * med["ours"], 4)
            if builder is not None:
                sglang_ms[strategy][f"B{b}"] = round(1e3 * med["sglang"], 4)
                ratios[strategy][f"B{b}"] = round(med["ours"] / med["sglang"], 3)
                ratios_best[strategy][f"B{b}"] = round(fast["ours"] / fast["sglang"], 3)

        # Scheduler-thread cost of one row: read, validate, synthesize (no assembly).
        def one_row(
            channel: MetadataChannel = channel,
            proposer: DecodeProposer = proposer,
            bufs: Buffers = bufs,
            n: int = n,
            reqs: list[Req] = reqs,
        ) -> None:
            for i, req in enumerate(reqs[:n]):
                proposer.on_row(req, channel.read(bufs, i, req))

        row_inner = 1 if args.quick else 3
        fast = {}
        med = side_by_side({"row": one_row}, repeats, row_inner, best=fast)
        per_request[strategy] = round(1e6 * med["row"] / rows.shape[0], 2)
        per_request_best[strategy] = round(1e6 * fast["row"] / rows.shape[0], 2)
        # The same on this thread's CPU clock: what other processes' load adds to the
        # wall clock (time slices lost to them) is left out.
        med = side_by_side({"row": one_row}, repeats, row_inner, clock=time.thread_time)
        per_request_cpu[strategy] = round(1e6 * med["row"] / rows.shape[0], 2)
        if any(k.startswith("fallback") for k in proposer.counts) or set(channel.counts) != {"inband:read"}:
            raise RuntimeError(f"{strategy}: unexpected fallbacks {dict(proposer.counts)} {dict(channel.counts)}")
        proposer.close()

    # The chain apart: its own section, and headline figures beside the single step's.
    chain: dict[str, Any] = {"steps": CHAIN_STEPS, "config": "configs/multi_layer.yaml"}
    for key, d in (
        ("aux_bytes_per_request", aux_bytes),
        ("aux_capacity_needed", aux_capacity),
        ("entries_per_request", entries),
        ("per_request_us", per_request),
        ("per_request_cpu_us", per_request_cpu),
        ("per_request_best_us", per_request_best),
        ("decode_batch_ms", ours_ms),
        ("ratio_vs_sglang_builder", ratios),
        ("ratio_vs_sglang_builder_best", ratios_best),
        ("sglang_builder_ms", sglang_ms),
    ):
        chain[key] = d.pop(CHAIN, None)
    head = "sparse_floor"
    result: dict[str, Any] = {
        "benchmark": "sglang_inband",
        "vocab_size": v,
        "requests": n_req,
        "quick": args.quick,
        "per_request_us": per_request.get(head),
        "per_request_goal_us": PER_REQUEST_GOAL_US,
        "per_request_us_by_strategy": per_request,
        "per_request_cpu_us_by_strategy": per_request_cpu,
        "per_request_best_us_by_strategy": per_request_best,
        "aux_bytes_per_request": aux_bytes,
        "aux_capacity_needed": aux_capacity,
        "entries_per_request": entries,
        "decode_batch_ms": ours_ms,
        "decode_device": str(dev),
        "sglang_builder": builder_source,
    }
    if builder is None:
        result["ratio_vs_sglang_builder"] = {"skipped": builder_source}
    else:
        result["ratio_vs_sglang_builder"] = ratios
        result["ratio_vs_sglang_builder_best"] = ratios_best
        result["ratio_goal"] = RATIO_GOAL
        result["sglang_builder_ms"] = sglang_ms
        for b in batches:  # the headline figures: the sparse_floor operating point, one step and the chain
            result[f"ratio_vs_sglang_builder_B{b}"] = ratios[head][f"B{b}"]
            result[f"ratio_vs_sglang_builder_chain_B{b}"] = chain["ratio_vs_sglang_builder"][f"B{b}"]
    result["chain"] = chain
    print(
        f"in-band decode, V={v}, {n_req} distinct rows, medians of {repeats} repeats (SGLang builder: {builder_source})"
    )
    print(
        f"{'strategy':14s} {'aux B':>9s} {'entries':>8s} {'us/row':>8s} {'cpu us':>8s} {'best us':>8s} "
        + " ".join(f"{'ratio B' + str(b):>10s}" for b in batches)
        + " "
        + " ".join(f"{'best B' + str(b):>10s}" for b in batches)
    )
    for s in strategies:
        rs = " ".join(f"{ratios.get(s, {}).get(f'B{b}', float('nan')):10.3f}" for b in batches)
        ts = " ".join(f"{ratios_best.get(s, {}).get(f'B{b}', float('nan')):10.3f}" for b in batches)
        print(
            f"{s:14s} {aux_bytes[s]:9.0f} {entries[s]:8.0f} {per_request[s]:8.1f} {per_request_cpu[s]:8.1f} "
            f"{per_request_best[s]:8.1f} {rs} {ts}"
        )
    cr, cb = chain["ratio_vs_sglang_builder"] or {}, chain["ratio_vs_sglang_builder_best"] or {}
    rs = " ".join(f"{cr.get(f'B{b}', float('nan')):10.3f}" for b in batches)
    ts = " ".join(f"{cb.get(f'B{b}', float('nan')):10.3f}" for b in batches)
    print(
        f"{'chain S=' + str(CHAIN_STEPS):14s} {chain['aux_bytes_per_request']:9.0f} {chain['entries_per_request']:8.0f} "
        f"{chain['per_request_us']:8.1f} {chain['per_request_cpu_us']:8.1f} {chain['per_request_best_us']:8.1f} {rs} {ts}"
    )
    emit(result)


if __name__ == "__main__":
    main()
