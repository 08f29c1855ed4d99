"""Tokens per verify over long responses, multi-layer EAGLE (MTP chain): aggregated, stock pair, drop-in pair.

SGLang 0.5.23 transfers only chain step 1's draft KV across the PD transfer; the drop-in
(``configs/multi_layer.yaml``, ``[sglang].draft_kv = "all_steps"``) transfers every step's
(docs/sglang.md, "Draft KV of every chain step"). On a stock pair the decode's MTP layers
2..S attend over prompt slots their pools never received, for the whole response; this
measures what that costs in SGLang's own ``spec_accept_length`` (accepted drafts + 1 per
verify, every verify of a request), on long prompts (standard-library source, about
``--prompt-chars`` characters each) and long responses, at T = 1 and T = 0.

The servers are the tier's (tests/server: the trained Llama target and its distilled
3-layer MTP draft, ``--enable-multi-layer-eagle``, the CPU stand-ins). Prints one JSON
line: per server and temperature, the mean tokens per verify with its standard error
over requests, and the errors. Usage::

    python benchmarks/multi_layer_kv.py [--n 24] [--tokens 48] [--prompt-chars 4000]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from server import harness as h
from server import workload as w

MULTI_LAYER = ["--enable-multi-layer-eagle", "--disable-hybrid-swa-memory"]


def long_prompts(n: int, chars: int) -> list[str]:
    """``n`` prompts of about ``chars`` characters: consecutive stretches of sorted stdlib files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    for path in sorted(root.glob("*.py")):
        text = path.read_text(errors="replace")
        for start in range(0, len(text) - chars, chars):
            out.append(text[start : start + chars])
            if len(out) == n:
                return out
    raise RuntimeError(f"only {len(out)} prompts of {chars} characters under {root}")


def tokens_per_verify(results: list[w.Result]) -> dict[str, float | str]:
    got = [r.accept_length for r in results if r.status == 200 and r.accept_length is not None]
    mean = sum(got) / max(1, len(got))
    var = sum((x - mean) ** 2 for x in got) / max(1, len(got) - 1)
    return {
        "tokens_per_verify": round(mean, 3),
        "se": round(math.sqrt(var / max(1, len(got))), 3),
        "errors": f"{sum(r.status != 200 for r in results)}/{len(results)}",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=24, help="requests per server and temperature (default 24)")
    ap.add_argument("--tokens", type=int, default=48, help="max_new_tokens of each request (default 48)")
    ap.add_argument("--prompt-chars", type=int, default=4000, help="characters per prompt (default 4000)")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("sglang_router") is None:
        print(json.dumps({"bench": "multi_layer_kv", "skipped": "needs make setup-server (docs/server.md)"}))
        return 0
    from server_acceptance import load_models  # the tier's models, torchvision's CPU gap first

    load_models()
    from server.models.build import build_models

    built = build_models(REPO / "build" / "server-models")
    models = h.Models(Path(built["trained_target"]), Path(built["trained_multi_layer"]), "EAGLE")
    tmp = Path(tempfile.mkdtemp(prefix="multi-layer-kv-"))
    cfg = h.server_config(REPO / "configs" / "multi_layer.yaml", tmp / "multi_layer.yaml")
    texts = long_prompts(args.n, args.prompt_chars)
    out: dict[str, object] = {"bench": "multi_layer_kv", "n": args.n, "max_new_tokens": args.tokens}
    t0 = time.monotonic()
    servers: dict[str, tuple[str, list[h.Server]]] = {}
    try:
        agg = h.start_server("aggregated", models, tmp / "agg", extra_args=MULTI_LAYER, max_total_tokens=16384)
        servers["aggregated"] = (agg.url, [agg])
        for name, conf in (("stock", None), ("dropin", cfg)):
            pair = h.start_pair(
                models,
                tmp / name,
                prefill_config=conf,
                decode_config=conf,
                extra_args=MULTI_LAYER,
                max_total_tokens=16384,
            )
            servers[name] = (pair.router.url, pair.servers)  # type: ignore[union-attr]
        for temperature in (1.0, 0.0):
            for name, (url, _) in servers.items():
                res = w.generate(url, texts, temperature=temperature, max_new_tokens=args.tokens, concurrency=4)
                out[f"{name}_T{temperature:g}"] = tokens_per_verify(res)
    finally:
        h.stop_all([s for _, group in servers.values() for s in group])
    out["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
