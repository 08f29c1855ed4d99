"""A multi-layer chain served: ``configs/multi_layer.yaml`` on both nodes of a PD pair.

The draft is the tier's distilled multi-layer MTP draft (``MiMoV2MTP``, 3 layers, one
per chain step; ``tests/server/models/``) run by SGLang's multi-layer EAGLE worker
(``--speculative-algorithm EAGLE --enable-multi-layer-eagle``) behind the tier's
trained target. Three servers answer the same prompts: aggregated serving, a stock pair
(SGLang's own one-hot chain) and the pair with the drop-in on both nodes.

What the CPU lacks for this worker (docs/server.md): ``--disable-hybrid-swa-memory``
(MiMo-V2's draft config asks for SWA pools, whose full-pool size the CPU path leaves
unset), ``MiMoV2MTP.set_embed_and_head``'s ``torch.cuda.synchronize()`` (cpu_gaps
``mtp_cuda_sync``) and sgl-kernel's ``rotate_input_ids_cpu`` (the stand-in in
``sgl_cpu_ops.py``, checked against SGLang's Triton kernel).

- Every request of the drop-in pair is served (no crash), and its greedy outputs equal
  aggregated serving's token for token (so do the stock pair's).
- First-verify acceptance per chain step, P(the first verify accepts >= k drafts) for
  k = 1, 2, 3, for the three servers. ``multi_layer.yaml``, the shipped multi-layer
  default, ships an exact compressed chain (sparse with a uniform floor, per step), so at
  every k the drop-in's rate is within aggregated serving's band (two-sided alpha 1e-3)
  and above SGLang's one-hot chain (one-sided alpha 1e-2), and SGLang's one-hot chain is
  below aggregated serving's.
- Counters, read from both nodes' ``/metrics``: each request the drop-in pair served is
  staged once by the prefill and received once by the decode, its chain taken from the
  prefill's row (no fallback).
- Each chain step's draft KV at a request's prompt positions, as the decode holds it once
  the transfer landed, against what the prefill computed (``PDM_TEST_DRAFT_KV_DUMP`` on
  both nodes of both pairs, ``site/draft_kv_dump.py``): every step equal with the drop-in
  (``[sglang].draft_kv = "all_steps"``: every step's pool is transferred); on the stock
  pair step 1 equal and steps 2..S different (SGLang transfers step 1's pool only): the
  negative control.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import draft_kv_dump  # tests/server/site is on sys.path (conftest.py)
import pytest

from server import harness as h
from server import workload as w
from server.conftest import attach_logs

pytestmark = pytest.mark.server
REPO = Path(__file__).resolve().parents[2]
MULTI_LAYER = ["--enable-multi-layer-eagle", "--disable-hybrid-swa-memory"]
STEPS = 3
N_ACCEPT = 128
N_GREEDY = 12
N_KV = 4
Z_SAME, Z_BETTER = 3.29, 2.33


@dataclass
class Servers:
    agg: h.Server
    stock: h.Pair
    dropin: h.Pair
    # Where each pair's nodes write their draft KV dumps while the folder exists (by pair name).
    kv_dumps: dict[str, Path]


@pytest.fixture(scope="module")
def servers(
    server_models: dict[str, Path], log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    if "trained_multi_layer" not in server_models:
        pytest.skip("PDM_SERVER_MODELS holds no multi-layer draft: the tier's built models have one")
    models = h.Models(server_models["trained_target"], server_models["trained_multi_layer"], algorithm="EAGLE")
    dumps = tmp_path_factory.mktemp("draft_kv")
    kv_dumps = {name: dumps / name for name in ("stock", "dropin")}  # created by the test that reads them
    kv_env = {name: {draft_kv_dump.ENV: str(path)} for name, path in kv_dumps.items()}
    cfg = h.server_config(REPO / "configs" / "multi_layer.yaml", tmp_path_factory.mktemp("cfg") / "multi_layer.yaml")
    starts = {
        "agg": lambda: h.start_server(
            "aggregated", models, log_dir / "agg", extra_args=MULTI_LAYER, sleep_on_idle=True
        ),
        "stock": lambda: h.start_pair(
            models,
            log_dir / "stock",
            prefill_env=kv_env["stock"],
            decode_env=kv_env["stock"],
            extra_args=MULTI_LAYER,
            sleep_on_idle=True,
        ),
        "dropin": lambda: h.start_pair(
            models,
            log_dir / "dropin",
            prefill_config=cfg,
            decode_config=cfg,
            prefill_env=kv_env["dropin"],
            decode_env=kv_env["dropin"],
            extra_args=[*MULTI_LAYER, "--enable-metrics"],
            sleep_on_idle=True,
        ),
    }
    out, error = h.start_together(starts)

    def stop_all() -> None:
        servers = [s for key in ("dropin", "stock") if key in out for s in out[key].servers]  # type: ignore[attr-defined]
        h.stop_all([*servers, *([out["agg"]] if "agg" in out else [])])  # type: ignore[list-item]

    try:
        if error is not None:
            raise error
        s = Servers(out["agg"], out["stock"], out["dropin"], kv_dumps)  # type: ignore[arg-type]
        attach_logs([s.agg, *s.stock.servers, *s.dropin.servers])
        yield s
    finally:
        stop_all()


def per_step(results: list[w.Result]) -> list[w.Rate]:
    """P(the first verify accepts >= k drafts), k = 1..STEPS (max_new_tokens = 2: one verify each)."""
    w.first_verify_rate(results)  # every request ran exactly one verify
    return [w.Rate(sum(1 for r in results if (r.correct_drafts or 0) >= k), len(results)) for k in range(1, STEPS + 1)]


def test_both_nodes_run_the_drop_in_with_the_chain(servers: Servers) -> None:
    log = servers.dropin.decode.log(10**7)
    assert "pd-middleware active: decode node" in log and f"S={STEPS}" in log, log[-3000:]
    assert "pd-middleware active: prefill node" in servers.dropin.prefill.log(10**7)


def test_the_chain_is_served_and_greedy_outputs_equal_aggregated(servers: Servers) -> None:
    texts = w.prompts(N_GREEDY, offset=1)
    agg = w.generate(servers.agg.url, texts, temperature=0.0, max_new_tokens=12)
    pd = w.generate(servers.dropin.router.url, texts, temperature=0.0, max_new_tokens=12)  # type: ignore[union-attr]
    stock = w.generate(servers.stock.router.url, texts, temperature=0.0, max_new_tokens=12)  # type: ignore[union-attr]
    bad = [r.error for r in agg + pd + stock if r.status != 200]
    assert not bad, bad
    assert [r.output_ids for r in pd] == [r.output_ids for r in agg]
    assert [r.output_ids for r in stock] == [r.output_ids for r in agg]


def test_first_verify_acceptance_per_chain_step(servers: Servers) -> None:
    texts = w.prompts(N_ACCEPT, offset=2)
    a = per_step(w.generate(servers.agg.url, texts, temperature=1.0, max_new_tokens=2))
    d = per_step(w.generate(servers.dropin.router.url, texts, temperature=1.0, max_new_tokens=2))  # type: ignore[union-attr]
    o = per_step(w.generate(servers.stock.router.url, texts, temperature=1.0, max_new_tokens=2))  # type: ignore[union-attr]
    for k in range(STEPS):
        print(
            f"first verify accepts >= {k + 1}: aggregated {a[k]}, drop-in shipped chain {d[k]}, SGLang one-hot {o[k]}"
        )
    for k in range(STEPS):
        assert abs(w.z_diff(d[k], a[k])) <= Z_SAME, f"k = {k + 1}: drop-in {d[k]} outside aggregated's band {a[k]}"
        assert w.z_diff(d[k], o[k]) >= Z_BETTER, f"k = {k + 1}: drop-in {d[k]} not above SGLang's one-hot {o[k]}"
    assert w.z_diff(a[0], o[0]) >= Z_BETTER
    for srv in servers.dropin.servers[:2]:
        ours = [ln for ln in srv.log(10**7).splitlines() if ln.lstrip().startswith('File "') and "pd_middleware" in ln]
        assert ours == [], f"a traceback through pd_middleware in the {srv.name}'s log"


def test_counters_count_each_request_once(servers: Servers) -> None:
    """Both earlier tests' requests through the drop-in pair: staged once, received once, no fallback."""
    sent = N_GREEDY + N_ACCEPT
    dec = w.settled_events(servers.dropin.decode.url)
    pre = w.settled_events(servers.dropin.prefill.url)
    print(f"multi-layer drop-in pair: decode events {dec}; prefill events {pre}")
    assert w.event(pre, "prefill", "staged") == sent
    assert w.event(dec, "decode", "proposal:prefill") == sent
    assert w.event(dec, "decode", "proposal:local") == 0
    fallbacks = {k: v for k, v in dec.items() if "fallback" in k and v}
    assert fallbacks == {}, fallbacks


def dump_draft_kv(pair: h.Pair, out: Path, offset: int) -> dict[tuple[str, int, int], dict[str, object]]:
    """Serve N_KV requests with ``out`` present (both nodes dump each chain step's draft KV
    at the prompt positions into it), then stop the dumps; returns the records."""
    out.mkdir()
    try:
        res = w.generate(pair.router.url, w.prompts(N_KV, offset=offset), temperature=0.0, max_new_tokens=2)  # type: ignore[union-attr]
    finally:
        done = out.with_name(out.name + "-done")
        out.rename(done)  # the nodes write only while `out` exists
    bad = [r.error for r in res if r.status != 200]
    assert not bad, bad
    return draft_kv_dump.load(done)


def test_every_chain_steps_draft_kv_crosses_the_transfer(servers: Servers) -> None:
    """Last in the module: its N_KV requests through the drop-in pair come after the counters' count."""
    for name in ("dropin", "stock"):
        pair: h.Pair = getattr(servers, name)
        records = dump_draft_kv(pair, servers.kv_dumps[name], offset=3)
        same = draft_kv_dump.compare(records)  # room -> [step 1 equal, ..., step S equal]
        print(f"{name}: draft KV at the prompt positions equal to the prefill's, per chain step: {same}")
        assert len(same) == N_KV, f"{name}: the decode dumped {sorted(same)}"
        prefill = [r for (role, _, _), r in records.items() if role == "prefill"]
        # The prefill's draft extend wrote every step's pool (else "equal" would prove nothing).
        assert draft_kv_dump.nonzero_steps(prefill) == set(range(1, STEPS + 1))
        if name == "dropin":
            assert all(steps == [True] * STEPS for steps in same.values()), same
            for srv in (pair.prefill, pair.decode):
                assert "carries every chain step's draft KV pool" in srv.log(10**7), srv.name
        else:
            # Negative control: SGLang sends step 1's pool only.
            assert all(steps == [True] + [False] * (STEPS - 1) for steps in same.values()), same
