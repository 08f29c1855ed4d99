"""A whole PD hand-off on one machine: prefill encoder -> ZMQ + Mooncake -> decode middleware.

    python examples/loopback.py [CONFIG] [--vocab V] [--batch B]

The decode side builds the middleware from CONFIG (default configs/sparse_floor.toml)
and binds a receiver on 127.0.0.1; the prefill side runs the config's encoder on random
draft distributions, ships each request with a real PrefillSender, and the decode
assembles the batch's ``draft_probs`` exactly as a verifier would read it.
"""

from __future__ import annotations

import argparse

import msgspec
import torch

from pd_middleware import Payload
from pd_middleware.config import load_config, parse_config
from pd_middleware.decode.pipeline import Delivery
from pd_middleware.middleware import DecodeMiddleware, build_encoders
from pd_middleware.transport import open_receiver, open_sender


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default="configs/sparse_floor.toml")
    ap.add_argument("--vocab", type=int, default=None, help="override model.vocab_size")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()

    data = msgspec.to_builtins(load_config(args.config))
    if args.vocab:
        data["model"]["vocab_size"] = args.vocab
    cfg = parse_config(data)
    v, s, h = cfg.model.vocab_size, cfg.model.num_steps, cfg.model.hidden_size

    # Decode node: hooks + synthesizer + assembler, and a receiver bound on loopback.
    mw = DecodeMiddleware.from_config(cfg)
    rx = open_receiver(cfg.transport, mw.pipeline)
    # Prefill node: the config's encoder and a sender connected to the decode.
    encoder = build_encoders(cfg)["default"]
    tx = open_sender(cfg.transport, rx.address, name="prefill-0")
    try:
        gen = torch.Generator().manual_seed(0)
        draft = torch.softmax(2.0 * torch.randn(args.batch, s, v, generator=gen), dim=-1)
        enc = encoder.encode(draft, temperature=1.0, generator=gen)
        hidden = torch.randn(args.batch, h, generator=gen).to(torch.bfloat16)
        for i in range(args.batch):
            tx.send(
                Payload(
                    request_id=f"req-{i}",
                    draft_tokens=enc.tokens[i],
                    draft_probs=enc.token_probs[i],
                    vocab_size=v,
                    hidden=hidden[i].view(torch.int16).numpy().tobytes(),
                    hidden_dtype="bf16",
                    provenance=enc.provenance,
                    proposal=enc.proposals[i],
                )
            )
        tx.flush(timeout=30.0)
        got = [rx.get(timeout=10.0) for _ in range(args.batch)]
        deliveries = [d for d in got if isinstance(d, Delivery)]
        draft_probs = mw.assemble(deliveries)  # what the verifier reads: (B, V) or (B, S, V)
        print(f"encoder {cfg.encoder.name} -> synthesizer {cfg.synthesizer.name}, V={v}, S={s}")
        print(f"delivered {len(deliveries)}/{args.batch}; draft_probs {tuple(draft_probs.shape)} {draft_probs.dtype}")
        rows = draft_probs.view(len(deliveries), -1, v)
        for d, row in zip(deliveries[:3], rows):
            x = d.payload.draft_tokens
            print(
                f"  {d.request_id}: X={x} q'(X)={[round(float(row[k, t]), 6) for k, t in enumerate(x)]} "
                f"row sums={[round(float(r.sum()), 6) for r in row]}"
            )
        for d in deliveries:
            d.release()
        print(mw.metrics.format())
    finally:
        tx.close()
        rx.stop()
        mw.close()


if __name__ == "__main__":
    main()
