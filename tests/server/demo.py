"""``make server-demo``: a real SGLang PD pair with the drop-in, behind sglang-router, on this machine.

Starts a prefill and a decode (EAGLE3, rejection sampling, Mooncake over TCP) with
``PD_MIDDLEWARE_CONFIG=configs/sglang.toml`` on both, and the router; sends a few requests;
prints the outputs, SGLang's per-request acceptance and the decode's ``pd_middleware_*``
counters from SGLang's ``/metrics``; keeps serving for ``--serve-s`` seconds (curl the
router meanwhile), then stops everything. Models: ``PDM_SERVER_MODELS`` (target/, eagle3/).
What is real and what stands in: docs/server.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from . import harness as h
from . import workload as w

REPO = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="A real SGLang PD pair with the drop-in on this CPU (docs/server.md)")
    ap.add_argument("--config", default=str(REPO / "configs" / "sglang.toml"), help="drop-in config for both nodes")
    ap.add_argument("--serve-s", type=float, default=0.0, help="keep the pair up this many seconds after the demo")
    args = ap.parse_args(argv)
    root = os.environ.get("PDM_SERVER_MODELS")
    if not root:
        print("set PDM_SERVER_MODELS to a folder with target/ and eagle3/ (docs/server.md)", file=sys.stderr)
        return 2
    draft = Path(root) / "eagle3"
    models = h.Models(Path(root) / "target", draft if draft.is_dir() else Path(root) / "eagle3-fullvocab")
    tmp = Path(tempfile.mkdtemp(prefix="server-demo-"))
    cfg = h.server_config(Path(args.config), tmp / "config.toml")
    print(f"starting prefill, decode and router (logs in {tmp}); about a minute or two...", flush=True)
    pair = h.start_pair(models, tmp, prefill_config=cfg, decode_config=cfg, extra_args=["--enable-metrics"])
    try:
        assert pair.router is not None
        print(f"router: {pair.router.url}  prefill: {pair.prefill.url}  decode: {pair.decode.url}")
        texts = w.prompts(4)
        for temp in (0.0, 1.0):
            for text, r in zip(texts, w.generate(pair.router.url, texts, temperature=temp, max_new_tokens=16)):
                print(
                    f"T={temp} {text.splitlines()[0]!r} -> {r.status} ids={list(r.output_ids)} accept_length={r.accept_length}"
                )
        time.sleep(3)
        metrics = h.get_text(pair.decode.url + "/metrics")
        print("\n".join(line for line in metrics.splitlines() if line.startswith("pd_middleware_")))
        if args.serve_s > 0:
            print(
                f'serving for {args.serve_s:.0f} s: curl -s {pair.router.url}/generate -d \'{{"text": "def f(x):"}}\''
            )
            time.sleep(args.serve_s)
    finally:
        pair.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
