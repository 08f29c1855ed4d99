"""Each older SGLang release (0.5.18 to 0.5.22) in a real PD pair: the seed's failure, and the drop-in's fix.

One module, parametrised by release (:data:`RELEASES`); per release, four servers of that
release, started together (``harness.start_server(release=...)``: the release's folder
from ``make setup-releases`` first on ``PYTHONPATH``, its CPU overrides from
``cpu_gaps.RELEASES``, its version checked in every server process):

- one **stock prefill** (no drop-in), serving both decodes without a router (each request
  goes to the prefill and one decode with its own bootstrap room, ``workload.generate_pd``);
- a **stock decode** (no drop-in): the negative control;
- a **drop-in decode** with the shipped default, ``configs/sglang.toml`` (decode-only
  recompute: the one switch on the decode only);
- an **aggregated** server of the same release: the reference.

Claims, per release:

- **Negative control.** 0.5.18 to 0.5.21 have no PD proposal of their own: the stock
  decode's first rejection-sampling draft step stacks ``draft_probs = None`` and fails
  with the seed's ``TypeError`` (``expected Tensor as element 0``). 0.5.22 ships SGLang's
  one-hot proposal: the stock decode serves, at one-hot acceptance, below aggregated
  serving's (one-sided alpha 1e-2).
- **The drop-in.** Every request served; greedy outputs equal the same release's
  aggregated server's (``workload.greedy_mismatches``: up to bf16 near-ties); first-verify
  acceptance (T = 1, ``max_new_tokens = 2``: exactly one verify) within aggregated
  serving's band (two-sided alpha 1e-3) and above one-hot (one-sided alpha 1e-2), the
  statistics of test_recompute.py. One-hot is measured on 0.5.22's stock decode (the
  module runs 0.5.22 first); 0.5.18 to 0.5.21 serve no one-hot (their stock decode
  fails), so their drop-in is compared with 0.5.22's one-hot rate on the same models and
  prompts (a two-sample test of rates whose law depends only on the models).

**Multi-layer** (:data:`CHAIN_RELEASES`, 0.5.22 and 0.5.21): the same servers with the
tier's multi-layer MTP draft (``--enable-multi-layer-eagle``, as test_multi_layer.py), the
drop-in decode with ``configs/multi_layer.yaml`` as shipped, and one more server: a prefill
with the same file. Behind the stock prefill the drop-in decode reads an unwritten row for
every request and serves the exact one-hot chain (``fallback:not_sent``: its registration
still pairs with a stock prefill, the proposal buffer's address riding the drop-in's
trailing frame); its first-verify rate is within the stock one-hot chain's band where that
one serves (0.5.22). Behind the drop-in prefill, the shipped chain in SGLang's PD metadata
(``draft_kv`` left out: the first step's pool before 0.5.23): greedy outputs equal
aggregated's, every proposal from the prefill, the first verify within aggregated's band.
Negative control: 0.5.21's stock decode fails the first sampled verify (no proposal at
all); 0.5.22's serves its one-hot chain. On :data:`SIDECHANNEL` (0.5.21) two more servers,
a drop-in prefill and decode, serve the shipped chain on the side channel: every proposal
from the prefill (``fallback:missing`` 0), the first verify within aggregated's band.
"""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from server import harness as h
from server import workload as w
from server.conftest import attach_logs

pytestmark = pytest.mark.server
REPO = Path(__file__).resolve().parents[2]
#: 0.5.22 first: its stock decode's one-hot rate is the older releases' one-hot reference.
RELEASES = ("0.5.22", "0.5.21", "0.5.20", "0.5.19", "0.5.18")
#: Releases whose stock decode fails the seed's way (no PD proposal of their own).
SEED_FAILS = ("0.5.21", "0.5.20", "0.5.19", "0.5.18")
#: Releases whose set starts a stock decode (the negative control in a server): 0.5.22's
#: serves SGLang's one-hot (the one-hot reference), 0.5.21's fails the seed's way. On 0.5.18
#: to 0.5.20 the same failure is shown in-process against each release's real builder
#: (tests/test_sglang_releases.py); a stock decode there would cost three server starts.
STOCK = ("0.5.22", "0.5.21")
#: First-verify requests per server (T = 1, max_new_tokens = 2): the SE of a rate near 0.8
#: is 0.032, of its difference from one-hot's (a rate of 0.33 to 0.39) 0.05, so the
#: drop-in's margin over one-hot (0.4 to 0.5) is z of about 8. (At 64, 0.5.18's drop-in once came out at z = 2.31 against one-hot:
#: its rates sat near 0.6 then, from the CPU-backend bug cpu_gaps' 0.5.18 variant of
#: ``amx_unscaled_ops`` now works around; with it, 0.5.18 serves at about 0.82 too.)
N_ACCEPT = 160
N_GREEDY = 8
Z_SAME, Z_BETTER = 3.29, 2.33
#: Releases whose set also serves ``configs/sparse_floor.toml`` in-band with a TP 2 decode.
INBAND_TP2 = ("0.5.21",)
N_TP2 = 64
#: Releases served with the multi-layer draft, 0.5.22 first.
CHAIN_RELEASES = ("0.5.22", "0.5.21")
MULTI_LAYER = ["--enable-multi-layer-eagle", "--disable-hybrid-swa-memory"]
N_CHAIN = 64
#: Chain releases that also serve the shipped chain with the drop-in on both nodes on the
#: side channel (for engines and deployments whose metadata cannot change).
SIDECHANNEL = ("0.5.21",)
N_SHIPPED = N_CHAIN
#: One-hot first-verify rates measured by a stock decode, by release (0.5.22's).
ONE_HOT: dict[str, w.Rate] = {}


@dataclass
class Release:
    version: str
    agg: h.Server
    prefill: h.Server
    stock: h.Server | None
    dropin: h.Server
    #: the drop-in on both nodes with the shipped chain on the side channel (SIDECHANNEL's
    #: chain sets only): its prefill, its decode
    shipped: tuple[h.Server, h.Server] | None = None
    #: a drop-in prefill shipping in SGLang's PD metadata to ``dropin`` (the chain sets)
    inband: h.Server | None = None
    #: ``configs/sparse_floor.toml`` in-band: a prefill and a TP 2 decode (:data:`INBAND_TP2`)
    tp2: tuple[h.Server, h.Server] | None = None
    #: first-verify rates measured by test_first_verify_acceptance, by server name
    rates: dict[str, w.Rate] = field(default_factory=dict)

    @property
    def servers(self) -> list[h.Server]:
        servers = (
            self.agg,
            self.prefill,
            self.stock,
            self.dropin,
            self.inband,
            *(self.shipped or ()),
            *(self.tp2 or ()),
        )
        return [s for s in servers if s is not None]


def start_release(
    version: str,
    models: h.Models,
    log_dir: Path,
    decode_config: Path,
    *,
    extra_args: list[str] | None = None,
    shipped_config: Path | None = None,
    inband_config: Path | None = None,
    tp2_config: Path | None = None,
) -> Release:
    """The four servers of ``version`` (three where it is not in :data:`STOCK`; one more with
    ``inband_config``: a drop-in prefill shipping in-band to the drop-in decode; two more with
    ``shipped_config``: a drop-in prefill and decode on the side channel; two more with
    ``tp2_config``: a drop-in prefill and a TP 2 drop-in decode, in-band), started together;
    all healthy, or every one stopped and ServerFailed."""
    args = list(extra_args or [])

    def start(name: str, role: str = "null", config: Path | None = None, **kw: Any) -> Callable[[], h.Server]:
        # A decode serves its counters on /metrics (the drop-in copies them there).
        more = ["--enable-metrics"] if role == "decode" and config is not None else []
        return lambda: h.start_server(
            name,
            models,
            log_dir,
            role=role,
            config=config,
            extra_args=[*args, *more],
            sleep_on_idle=True,
            release=version,
            **kw,
        )

    starts = {
        "agg": start("aggregated"),
        "prefill": start("prefill", "prefill"),
        "dropin": start("decode-dropin", "decode", decode_config),
    }
    if version in STOCK:
        starts["stock"] = start("decode-stock", "decode")
    if inband_config is not None:
        starts["inband"] = start("prefill-inband", "prefill", inband_config)
    if tp2_config is not None:
        starts["tp2_prefill"] = start("prefill-sparse", "prefill", tp2_config)
        starts["tp2_decode"] = start("decode-sparse-tp2", "decode", tp2_config, tp=2)
    if shipped_config is not None:
        port = _side_channel_config(shipped_config)
        address = {"PD_MIDDLEWARE_DECODE_ADDRESS": f"tcp://127.0.0.1:{port}"}
        starts["shipped_prefill"] = start("prefill-shipped", "prefill", shipped_config, env_extra=address)
        starts["shipped_decode"] = start("decode-shipped", "decode", shipped_config)
    out, error = h.start_together(starts)
    if error is not None:
        h.stop_all(list(out.values()))
        raise error
    shipped = (out["shipped_prefill"], out["shipped_decode"]) if shipped_config is not None else None
    tp2 = (out["tp2_prefill"], out["tp2_decode"]) if tp2_config is not None else None
    return Release(
        version, out["agg"], out["prefill"], out.get("stock"), out["dropin"], shipped, out.get("inband"), tp2
    )


def _side_channel_config(path: Path) -> int:
    """``configs/multi_layer.yaml`` as ``pd-middleware sglang`` says to run it where SGLang's PD
    metadata cannot carry the chain (before 0.5.23): ``[sglang] channel = "sidechannel"`` and
    ``draft_kv = "first_step"``, the decode's receiver on a free loopback port (returned)."""
    import yaml

    doc = yaml.safe_load((REPO / "configs" / "multi_layer.yaml").read_text())
    doc.pop("model", None)
    port = h.free_port()
    doc["sglang"] = {**doc.get("sglang", {}), "channel": "sidechannel", "draft_kv": "first_step"}
    doc["transport"] = {**doc.get("transport", {}), "bind_host": "127.0.0.1", "port": port}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return port


@pytest.fixture(scope="module", params=RELEASES)
def rel(
    request: pytest.FixtureRequest,
    server_models: dict[str, Path],
    log_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Release]:
    version: str = request.param
    if not (h.release_dir(version) / "sglang").is_dir():
        pytest.skip(f"SGLang {version}: no release folder at {h.release_dir(version)} (make setup-releases)")
    cfg = h.server_config(REPO / "configs" / "sglang.toml", tmp_path_factory.mktemp("cfg") / "sglang.toml")
    models = h.Models(server_models["target"], server_models["eagle3"])
    tp2 = None
    if version in INBAND_TP2:
        tp2 = h.server_config(REPO / "configs" / "sparse_floor.toml", tmp_path_factory.mktemp("cfg") / "sparse.toml")
    r = start_release(version, models, log_dir / version, cfg, tp2_config=tp2)
    attach_logs(r.servers)
    try:
        yield r
    finally:
        h.stop_all(r.servers)


@pytest.fixture(scope="module", params=CHAIN_RELEASES)
def chain(
    request: pytest.FixtureRequest,
    server_models: dict[str, Path],
    log_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Release]:
    version: str = request.param
    if not (h.release_dir(version) / "sglang").is_dir():
        pytest.skip(f"SGLang {version}: no release folder at {h.release_dir(version)} (make setup-releases)")
    if "trained_multi_layer" not in server_models:
        pytest.skip("PDM_SERVER_MODELS holds no multi-layer draft: the tier's built models have one")
    # configs/multi_layer.yaml as shipped on the drop-in decode and the in-band prefill.
    cfg = h.server_config(REPO / "configs" / "multi_layer.yaml", tmp_path_factory.mktemp("cfg") / "multi_layer.yaml")
    models = h.Models(server_models["trained_target"], server_models["trained_multi_layer"], algorithm="EAGLE")
    shipped = tmp_path_factory.mktemp("cfg") / "multi_layer_sidechannel.yaml" if version in SIDECHANNEL else None
    r = start_release(
        version,
        models,
        log_dir / f"{version}-chain",
        cfg,
        extra_args=MULTI_LAYER,
        shipped_config=shipped,
        inband_config=cfg,
    )
    attach_logs(r.servers)
    try:
        yield r
    finally:
        h.stop_all(r.servers)


def test_every_server_runs_the_release_and_only_the_drop_in_decode_the_drop_in(rel: Release) -> None:
    for srv in (s for s in (rel.agg, rel.prefill, rel.stock, rel.dropin) if s is not None):
        log = srv.log(10**8)
        assert f"[cpu-gaps] SGLang {rel.version}" in log, srv.name  # said by the server's own processes
        assert ("pd-middleware active" in log) is (srv is rel.dropin), srv.name
        # Every decode and the aggregated reference run SGLang's overlap scheduler (cpu_gaps'
        # overlap_spec_cpu, and on 0.5.18 to 0.5.21 its relay's record_stream stand-in); the
        # prefill does not (the tier's prefill_host_indices gap relies on it).
        assert h.overlapped(srv) is (srv is not rel.prefill), srv.name
    assert "decode-only recompute" in rel.dropin.log(10**8)


def test_the_drop_in_serves_greedy_outputs_equal_to_aggregated(rel: Release) -> None:
    texts = w.prompts(N_GREEDY, offset=4)
    agg = w.generate(rel.agg.url, texts, temperature=0.0, max_new_tokens=8, top_logprobs=2)
    pd = w.generate_pd(rel.prefill, rel.dropin, texts, temperature=0.0, max_new_tokens=8)
    bad = [r.error for r in agg + pd if r.status != 200]
    assert not bad, bad
    assert w.greedy_mismatches(pd, agg) == []


def _rates(rel: Release) -> dict[str, w.Rate]:
    """First-verify rates of aggregated, the drop-in decode and (0.5.22) the stock decode, measured once."""
    if not rel.rates:
        texts = w.prompts(N_ACCEPT, offset=2)
        rel.rates["agg"] = w.first_verify_rate(w.generate(rel.agg.url, texts, temperature=1.0, max_new_tokens=2))
        got = w.generate_pd(rel.prefill, rel.dropin, texts, temperature=1.0, max_new_tokens=2)
        assert all(r.status == 200 for r in got), [r.error for r in got if r.status != 200]
        rel.rates["dropin"] = w.first_verify_rate(got)
        if rel.version not in SEED_FAILS:
            stock = w.generate_pd(rel.prefill, rel.stock, texts, temperature=1.0, max_new_tokens=2)
            rel.rates["stock"] = ONE_HOT[rel.version] = w.first_verify_rate(stock)
        print(f"SGLang {rel.version} first-verify acceptance: " + ", ".join(f"{k} {v}" for k, v in rel.rates.items()))
    return rel.rates


def test_the_drop_in_decode_is_at_aggregated_acceptance(rel: Release) -> None:
    rates = _rates(rel)
    assert abs(w.z_diff(rates["dropin"], rates["agg"])) <= Z_SAME, rates


def test_the_drop_in_decode_beats_one_hot(rel: Release) -> None:
    rates = _rates(rel)
    one_hot = rates.get("stock") or next(iter(ONE_HOT.values()), None)
    if one_hot is None:
        pytest.skip(f"SGLang {rel.version} serves no one-hot and no 0.5.22 stock rate was measured in this session")
    print(f"SGLang {rel.version}: drop-in {rates['dropin']} against one-hot {one_hot}")
    assert w.z_diff(rates["dropin"], one_hot) >= Z_BETTER, (rates, one_hot)


def test_the_stock_decode_fails_the_seed_way_or_serves_one_hot(rel: Release) -> None:
    """Last per release: on 0.5.21 the stock decode dies of it (0.5.18 to 0.5.20: in-process,
    :data:`STOCK`); 0.5.22's serves SGLang's one-hot, below aggregated."""
    if rel.stock is None:
        pytest.skip(f"SGLang {rel.version}: the seed failure is checked in-process (tests/test_sglang_releases.py)")
    if rel.version not in SEED_FAILS:
        rates = _rates(rel)
        assert w.z_diff(rates["agg"], rates["stock"]) >= Z_BETTER, rates  # SGLang's one-hot, below aggregated
        return
    log = _fail_one_request(rel, ("NoneType",))
    assert "torch.stack(draft_probs_list, dim=1)" in log, log[-3000:]
    assert "expected Tensor as element 0" in log and "NoneType" in log, log[-3000:]


def test_a_shipped_strategy_in_band_reaches_a_tp2_decode(rel: Release) -> None:
    """:data:`INBAND_TP2`: ``configs/sparse_floor.toml`` as shipped on a TP 1 prefill and a
    TP 2 decode (before 0.5.23 the metadata channel is the only one at TP > 1: the side
    channel serves rank 0 only). Both decode ranks register with the prefill, each its own
    row's address in the trailing frame; the prefill sends the row to both. Every request
    served; greedy outputs the same on two sends (not compared with aggregated serving at
    TP 1: a TP 2 all-reduce order alone changes a greedy token of one prompt in twelve on
    these models, test_recompute_tp2.py); every sampled request's proposal from the
    prefill, no ``fallback:*``; the first verify within aggregated serving's band."""
    if rel.tp2 is None:
        pytest.skip(f"SGLang {rel.version}: the TP 2 in-band pair is served on {INBAND_TP2} (budget)")
    prefill, decode = rel.tp2
    assert "pd-middleware active: prefill node, channel metadata" in prefill.log(10**8)
    got = _serve_shipped(prefill, decode, rel.agg, N_TP2, greedy_offset=4, greedy_vs_agg=False)
    print(f"SGLang {rel.version} " + got.line("sparse_floor in-band to a TP 2 decode") + f"; decode events {got.after}")
    assert got.delta("requests") == N_TP2 and got.delta("proposal:prefill") == N_TP2, (got.before, got.after)
    assert not got.fallbacks, got.fallbacks
    assert abs(got.z) <= Z_SAME, (got.rate, got.agg)
    for srv in rel.tp2:
        assert _our_tracebacks(srv) == [], f"a traceback through pd_middleware in {srv.name}'s log"


def _fail_one_request(rel: Release, signs: tuple[str, ...]) -> str:
    """One sampled request through the stock decode, sent aside and not waited for once the
    decode's log shows one of ``signs`` (the prefill then waits for the dead decode until
    SGLang's transfer timeout); if its answer comes back first, it must be a failure.
    Returns the decode's log."""
    stock = rel.stock
    assert stock is not None, f"SGLang {rel.version}'s set starts no stock decode (STOCK)"
    body = {"text": w.prompts(1)[0], "sampling_params": {"max_new_tokens": 4, "temperature": 1.0}}
    res: list[tuple[tuple[int, object], tuple[int, object]]] = []
    sender = threading.Thread(
        target=lambda: res.append(h.post_pd(rel.prefill, stock, body, room=random.getrandbits(62))), daemon=True
    )
    sender.start()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and sender.is_alive() and not any(s in stock.log(10**8) for s in signs):
        time.sleep(1)
    if not sender.is_alive():  # the answers came back first: the decode's must have failed
        assert res and res[0][1][0] != 200, res
    return stock.log(10**8)


def test_a_multi_layer_chain_is_served_exactly_by_the_drop_in_decode(chain: Release) -> None:
    assert "pd-middleware active: decode node" in chain.dropin.log(10**8)
    texts = w.prompts(N_GREEDY, offset=1)
    agg = w.generate(chain.agg.url, texts, temperature=0.0, max_new_tokens=8, top_logprobs=2)
    pd = w.generate_pd(chain.prefill, chain.dropin, texts, temperature=0.0, max_new_tokens=8)
    bad = [r.error for r in agg + pd if r.status != 200]
    assert not bad, bad
    assert w.greedy_mismatches(pd, agg) == []
    sampled = w.prompts(N_CHAIN, offset=2)  # N_SHIPPED's prompts too
    before = w.settled_events(chain.dropin.url)
    d = w.first_verify_rate(w.generate_pd(chain.prefill, chain.dropin, sampled, temperature=1.0, max_new_tokens=2))
    after = w.settled_events(chain.dropin.url)
    chain.rates["dropin"] = d
    # Behind a stock prefill the decode's registration still pairs (its proposal row's address
    # rides the drop-in's trailing frame before 0.5.23, which a stock prefill ignores): every
    # request reads an unwritten row and verifies SGLang's exact one-hot chain.
    not_sent = w.event(after, "decode", "fallback:not_sent") - w.event(before, "decode", "fallback:not_sent")
    from_prefill = w.event(after, "decode", "proposal:prefill") - w.event(before, "decode", "proposal:prefill")
    assert not_sent == N_CHAIN and from_prefill == 0, (before, after)
    a = w.first_verify_rate(w.generate(chain.agg.url, sampled, temperature=1.0, max_new_tokens=2))
    line = f"SGLang {chain.version} multi-layer first-verify acceptance: aggregated {a}, drop-in decode {d}"
    if chain.version not in SEED_FAILS:
        o = w.first_verify_rate(w.generate_pd(chain.prefill, chain.stock, sampled, temperature=1.0, max_new_tokens=2))
        print(f"{line}, stock one-hot chain {o}")
        assert abs(w.z_diff(d, o)) <= Z_SAME, (d, o)  # SGLang's one-hot chain, the same law
    else:
        print(line)
    print(f"drop-in decode events: {w.settled_events(chain.dropin.url)}")
    assert _our_tracebacks(chain.dropin) == [], "a traceback through pd_middleware in the drop-in decode's log"


def _our_tracebacks(srv: h.Server) -> list[str]:
    """The traceback lines of ``srv``'s log that pass through pd_middleware."""
    return [ln for ln in srv.log(10**8).splitlines() if ln.lstrip().startswith('File "') and "pd_middleware" in ln]


@dataclass
class Shipped:
    """What a pair with the drop-in on both nodes served: its first-verify rate, aggregated
    serving's on the same prompts, and the decode's event samples around the sampled run."""

    rate: w.Rate
    agg: w.Rate
    before: dict[str, float]
    after: dict[str, float]

    def delta(self, key: str) -> float:
        return w.event(self.after, "decode", key) - w.event(self.before, "decode", key)

    @property
    def fallbacks(self) -> dict[str, float]:
        """Every ``fallback:*`` event of the decode that moved during the sampled run."""
        moved = {k: v - self.before.get(k, 0) for k, v in self.after.items() if v != self.before.get(k, 0)}
        return {k: v for k, v in moved.items() if 'event="fallback:' in k and 'part="decode"' in k}

    @property
    def z(self) -> float:
        return w.z_diff(self.rate, self.agg)

    def line(self, what: str) -> str:
        return (
            f"{what}, first-verify acceptance: aggregated {self.agg}, shipped {self.rate} (z {self.z:.2f}) with "
            f"{self.delta('proposal:prefill'):.0f} of {self.delta('requests'):.0f} proposals from the prefill"
        )


def _serve_shipped(
    prefill: h.Server, decode: h.Server, agg: h.Server, n: int, *, greedy_offset: int, greedy_vs_agg: bool = True
) -> Shipped:
    """Greedy requests through the pair (equal to ``agg``'s, or with ``greedy_vs_agg`` False
    the same on two sends), then ``n`` sampled first-verify requests through it and through
    ``agg``; every request must be served."""
    texts = w.prompts(N_GREEDY, offset=greedy_offset)
    first = w.generate_pd(prefill, decode, texts, temperature=0.0, max_new_tokens=8)
    if greedy_vs_agg:
        other = w.generate(agg.url, texts, temperature=0.0, max_new_tokens=8, top_logprobs=2)
    else:
        other = w.generate_pd(prefill, decode, texts, temperature=0.0, max_new_tokens=8)
    bad = [r.error for r in first + other if r.status != 200]
    assert not bad, bad
    if greedy_vs_agg:
        assert w.greedy_mismatches(first, other) == []
    else:
        assert [r.output_ids for r in first] == [r.output_ids for r in other]
    sampled = w.prompts(n, offset=2)
    before = w.settled_events(decode.url)
    got = w.generate_pd(prefill, decode, sampled, temperature=1.0, max_new_tokens=2)
    assert all(r.status == 200 for r in got), [r.error for r in got if r.status != 200]
    after = w.settled_events(decode.url)
    a = w.first_verify_rate(w.generate(agg.url, sampled, temperature=1.0, max_new_tokens=2))
    return Shipped(w.first_verify_rate(got), a, before, after)


def test_the_shipped_chain_with_the_drop_in_on_both_nodes_serves_at_aggregated_level(chain: Release) -> None:
    """SIDECHANNEL: ``configs/multi_layer.yaml`` on both nodes with the side channel and
    ``draft_kv = "first_step"`` (what ``pd-middleware sglang`` says to run there): every
    request served, greedy outputs equal aggregated's, every sampled request's proposal from
    the prefill (the decode holds a request whose KV landed first until its payload is
    stored, ``arrival_wait``: ``fallback:missing`` 0), and the first verify at aggregated
    serving's level. Before that wait, 2 to 32 of 72 requests lost the race on this CPU."""
    if chain.shipped is None:
        pytest.skip(f"SGLang {chain.version}: the shipped chain is served on {SIDECHANNEL} (budget)")
    prefill, decode = chain.shipped
    for srv in chain.shipped:
        assert "pd-middleware active" in srv.log(10**8), srv.name
    got = _serve_shipped(prefill, decode, chain.agg, N_SHIPPED, greedy_offset=1)
    print(
        f"SGLang {chain.version} " + got.line("shipped chain on the side channel") + f", fallback:missing "
        f"{got.delta('fallback:missing'):.0f}, held for their payload {got.delta('wait:held'):.0f} (arrived "
        f"{got.delta('wait:arrived'):.0f}, expired {got.delta('wait:expired'):.0f}); decode events {got.after}"
    )
    assert got.delta("requests") == N_SHIPPED, (got.before, got.after)
    assert got.delta("fallback:missing") == 0 and got.delta("proposal:prefill") == N_SHIPPED, (got.before, got.after)
    assert abs(got.z) <= Z_SAME, (got.rate, got.agg)
    for srv in chain.shipped:
        assert _our_tracebacks(srv) == [], f"a traceback through pd_middleware in {srv.name}'s log"


def test_the_shipped_chain_in_band_serves_at_aggregated_level(chain: Release) -> None:
    """``configs/multi_layer.yaml`` as shipped on both nodes (the chain in SGLang's PD metadata,
    ``draft_kv`` left out: the first step's pool before 0.5.23): every request served, greedy
    outputs equal aggregated's, every sampled request's proposal from the prefill (no
    ``fallback:*``: in-band, the row lands with the KV) and the first verify within
    aggregated serving's band."""
    prefill, decode = chain.inband, chain.dropin
    assert prefill is not None
    assert "pd-middleware active: prefill node, channel metadata" in prefill.log(10**8)
    got = _serve_shipped(prefill, decode, chain.agg, N_SHIPPED, greedy_offset=1)
    print(f"SGLang {chain.version} " + got.line("shipped chain in-band") + f"; decode events {got.after}")
    assert got.delta("requests") == N_SHIPPED and got.delta("proposal:prefill") == N_SHIPPED, (got.before, got.after)
    assert not got.fallbacks, got.fallbacks
    assert abs(got.z) <= Z_SAME, (got.rate, got.agg)
    for srv in (prefill, decode):
        assert _our_tracebacks(srv) == [], f"a traceback through pd_middleware in {srv.name}'s log"


def test_the_stock_multi_layer_decode_fails_without_a_proposal(chain: Release) -> None:
    """0.5.21: the first sampled verify of the stock chain has no proposal (the seed's
    stack, or the verify's own refusal); 0.5.22's one-hot chain served the test before."""
    if chain.version not in SEED_FAILS:
        pytest.skip(f"SGLang {chain.version} serves its one-hot chain (the previous test)")
    signs = ("expected Tensor as element 0", "Rejection sampling requires a target-vocab draft proposal")
    log = _fail_one_request(chain, signs)
    assert any(s in log for s in signs), log[-3000:]


_CHECK = r"""
import importlib, json, sys
import cpu_gaps
release = cpu_gaps.installed_release()
table, left_out = cpu_gaps.release_gaps(release)
out = {"release": release, "left_out": sorted(left_out), "refused": {}}
for ov in table:
    if ov.name == "torchvision_meta":
        continue
    mod = importlib.import_module(ov.module)
    why = cpu_gaps._refusal(ov, getattr(mod, ov.attr)) if hasattr(mod, ov.attr) else f"{ov.attr} not found"
    if why:
        out["refused"][f"{ov.name} {ov.module}.{ov.attr}"] = why
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def override_checks(request: pytest.FixtureRequest) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """:data:`_CHECK` in one fresh interpreter per selected release with a folder, all
    started at once (each is an import of the release's modules; together they take the
    time of the slowest, not the sum)."""
    name = test_each_override_of_the_release_matches_its_real_target.__name__
    selected = {
        it.callspec.params["version"]  # type: ignore[attr-defined]
        for it in request.session.items
        if getattr(it, "originalname", None) == name
    }
    envs = {
        v: h.server_env(None, {"PDM_CPU_GAPS": "torchvision_meta"}, release=v)
        for v in RELEASES
        if v in selected and (h.release_dir(v) / "sglang").is_dir()
    }
    with h.interpreters(_CHECK, envs) as procs:
        yield procs


@pytest.mark.parametrize("version", RELEASES)
def test_each_override_of_the_release_matches_its_real_target(
    version: str, override_checks: dict[str, subprocess.Popen[str]]
) -> None:
    """Every override of the release's row (``cpu_gaps.release_gaps``) against that release's
    own modules, imported in a fresh interpreter with its folder first on PYTHONPATH: none
    refused, including those whose module a server imports only on its first request."""
    if version not in override_checks:
        pytest.skip(f"SGLang {version}: no release folder at {h.release_dir(version)} (make setup-releases)")
    proc = override_checks[version]
    stdout, stderr = proc.communicate(timeout=300)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, stderr[-3000:]
    out = json.loads(lines[0][len("RESULT ") :])
    print(f"SGLang {version}: left out {out['left_out']}")
    assert out["release"] == version and out["refused"] == {}, out
