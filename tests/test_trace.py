"""Trace files and the ``record`` hook: exact round trips, strict reading, replay as a workload."""

from __future__ import annotations

import struct
from pathlib import Path

import msgspec
import pytest
import torch

from pd_middleware import (
    ConfigError,
    DenseEncoding,
    Payload,
    PluginContext,
    Provenance,
    ReceiveContext,
    SparseEncoding,
)
from pd_middleware.decode.pipeline import ReceivePipeline
from pd_middleware.sampling.encodings import dense_law_tensor
from pd_middleware.workloads import make_workload
from pd_middleware.workloads.trace import FORMAT, TraceError, TraceHeader, TraceWriter, read_trace
from pd_middleware_plugins.record import PLUGIN, RecordHook, RecordOptions

V = 16


def dense(probs: torch.Tensor, dtype: str) -> DenseEncoding:
    t = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    return DenseEncoding(dtype=dtype, data=probs.to(t).contiguous().view(torch.uint8).numpy().tobytes())  # type: ignore[arg-type]


def payloads() -> list[Payload]:
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(2, V, generator=g), dim=-1)
    hidden = torch.randn(8, generator=g).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    sparse = SparseEncoding(
        lengths=(2, 3),
        indices=torch.tensor([1, 5, 0, 2, 9], dtype=torch.int32).numpy().tobytes(),
        values=torch.tensor([0.5, 0.3, 0.4, 0.3, 0.2], dtype=torch.float16).numpy().tobytes(),
        value_dtype="fp16",
        tail_mass=(0.2, 0.1),
    )
    return [
        Payload(
            "r-dense",
            (3,),
            (float(q[0, 3]),),
            V,
            hidden=hidden,
            provenance=Provenance("sampled", 0.7, "dense-fp32"),
            proposal=dense(q[:1], "fp32"),
        ),
        Payload(
            "r-bf16",
            (4, 7),
            (0.25, 1),
            V,
            hidden=memoryview(bytearray(hidden)),
            hidden_dtype="bf16",
            provenance=Provenance(sampled_from="dense-bf16"),
            proposal=dense(q, "bf16"),
        ),
        Payload("r-sparse", (1, 2), (0.5, 0.3), V, provenance=Provenance(sampled_from="sparse-fp16"), proposal=sparse),
        Payload("r-greedy", (11,), (0.9,), V, hidden=b"", hidden_dtype="fp32", provenance=Provenance("greedy", 0.0)),
    ]


def test_writer_reader_round_trip_is_exact(tmp_path: Path) -> None:
    path = tmp_path / "t.trace"
    sent = payloads()
    target = torch.softmax(torch.randn(2, V), dim=-1)
    with TraceWriter(path, meta={"who": "test"}) as w:
        for i, p in enumerate(sent):
            w.write(p, arm=f"arm{i % 2}", peer="10.0.0.1:5", received_at=1.5 + i, target=target if i == 0 else None)
    got = list(read_trace(path))
    assert [e.payload for e in got] == sent
    assert [e.seq for e in got] == [0, 1, 2, 3]
    assert [e.arm for e in got] == ["arm0", "arm1", "arm0", "arm1"] and got[2].received_at == 3.5
    assert torch.equal(got[0].target, target) and got[1].target is None
    assert got[1].payload.draft_probs == (0.25, 1.0) and got[3].payload.provenance.rule == "greedy"


def test_record_hook_is_lazy_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "rec.trace"
    ctx = PluginContext(vocab_size=V, num_steps=1, rejection_sampling=True)
    hook = PLUGIN.factory(RecordOptions(path=str(path)), ctx)
    assert PLUGIN.name == "record" and PLUGIN.kind == "hook" and PLUGIN.options is RecordOptions
    assert not path.exists(), "the file must be opened on the first payload, not by the factory"
    sent = payloads()
    for i, p in enumerate(sent):
        assert hook.on_receive(p, ReceiveContext(peer="pf-0", arm="a", received_at=float(i))) is None
    assert path.exists() and hook.recorded == 4
    hook.close()
    hook.close()  # idempotent
    assert hook.on_receive(sent[0], ReceiveContext()) is None and hook.skipped == 1
    got = list(read_trace(path))
    assert [e.payload for e in got] == sent and {e.peer for e in got} == {"pf-0"}


def test_record_hook_max_records_and_append_segments(tmp_path: Path) -> None:
    path = tmp_path / "rec.trace"
    ctx = PluginContext(vocab_size=V, num_steps=1, rejection_sampling=True)
    sent = payloads()
    for _ in range(2):
        hook = RecordHook(RecordOptions(path=str(path), max_records=3), ctx)
        for p in sent:
            hook.on_receive(p, ReceiveContext())
        assert (hook.recorded, hook.skipped) == (3, 1)
        hook.close()
    assert [e.payload.request_id for e in read_trace(path)] == ["r-dense", "r-bf16", "r-sparse"] * 2
    with pytest.raises(TraceError, match="rec.trace: already exists and mode is 'create'"):
        RecordHook(RecordOptions(path=str(path), mode="create"), ctx).on_receive(sent[0], ReceiveContext())


def test_record_hook_in_a_pipeline_closes_with_it(tmp_path: Path) -> None:
    from pd_middleware_plugins.one_hot import SYNTHESIZER

    path = tmp_path / "pipe.trace"
    ctx = PluginContext(vocab_size=V, num_steps=1, rejection_sampling=True)
    hook = RecordHook(RecordOptions(path=str(path)), ctx)
    pipe = ReceivePipeline([("record", hook)], {"default": ("one_hot", SYNTHESIZER.factory(None, ctx))})
    sent = [p for p in payloads() if p.num_steps == 1]
    outcomes = [pipe.process(p) for p in sent]
    assert all(o.proposal is not None for o in outcomes)  # type: ignore[union-attr]
    pipe.close()
    assert [e.payload for e in read_trace(path)] == sent


def test_record_options_are_strict() -> None:
    from pd_middleware.config import convert_options

    with pytest.raises(ConfigError, match=r"at hooks\[0\].options.bogus: unknown field `bogus`"):
        convert_options(PLUGIN, {"path": "x", "bogus": 1}, "hooks[0].options")
    with pytest.raises(ConfigError, match=r"at hooks\[0\].options.max_records: must be >= 0, got -1"):
        convert_options(PLUGIN, {"path": "x", "max_records": -1}, "hooks[0].options")
    with pytest.raises(ConfigError, match=r"at hooks\[0\].options.path: must name a trace file"):
        convert_options(PLUGIN, {"path": ""}, "hooks[0].options")


def _frame(obj: object) -> bytes:
    data = msgspec.msgpack.encode(obj)
    return struct.pack("<I", len(data)) + data


def test_reader_rejects_malformed_files(tmp_path: Path) -> None:
    good = tmp_path / "good.trace"
    with TraceWriter(good) as w:
        w.write(payloads()[0])
    raw = good.read_bytes()

    bad = tmp_path / "v2.trace"
    bad.write_bytes(_frame(TraceHeader(format=FORMAT, version=2, created_unix=0.0)))
    with pytest.raises(TraceError, match=r"v2.trace at byte 0: version 2 is not supported \(reader speaks 1\)") as ei:
        list(read_trace(bad))
    assert ei.value.path == str(bad) and ei.value.field == "version"
    bad.write_bytes(_frame(TraceHeader(format="other", version=1, created_unix=0.0)))
    with pytest.raises(TraceError, match="format 'other' is not 'pd-middleware-trace'"):
        list(read_trace(bad))
    bad.write_bytes(_frame({"kind": "end", "records": 0}))
    with pytest.raises(TraceError, match="TraceEnd record before any header"):
        list(read_trace(bad))
    bad.write_bytes(struct.pack("<I", 3) + b"\xc1\xc1\xc1")
    with pytest.raises(TraceError, match="at byte 0: bad record"):
        list(read_trace(bad))
    bad.write_bytes(struct.pack("<I", 1 << 30))
    with pytest.raises(TraceError, match="frame of 1073741824 bytes exceeds"):
        list(read_trace(bad))

    cut = tmp_path / "cut.trace"
    cut.write_bytes(raw[:-3])
    with pytest.raises(TraceError, match="ends with a partial frame"):
        list(read_trace(cut))
    assert len(list(read_trace(cut, allow_truncated=True))) == 1
    with pytest.raises(TraceError, match="ends with a partial frame; refusing to append after it"):
        TraceWriter(cut)
    open_seg = tmp_path / "open.trace"
    open_seg.write_bytes(raw[: len(raw) - len(_frame({"kind": "end", "records": 1}))])
    with pytest.raises(TraceError, match="last segment has no end record"):
        list(read_trace(open_seg))
    bad.write_bytes(raw[: -len(_frame({"kind": "end", "records": 1}))] + _frame({"kind": "end", "records": 5}))
    with pytest.raises(TraceError, match="end record counts 5 payloads, segment holds 1"):
        list(read_trace(bad))


def test_trace_workload_replays_targets_and_proposals(tmp_path: Path) -> None:
    path = tmp_path / "wl.trace"
    g = torch.Generator().manual_seed(4)
    q = torch.softmax(torch.randn(5, 2, V, generator=g), dim=-1)
    target = torch.softmax(torch.randn(5, 3, V, generator=g), dim=-1)
    with TraceWriter(path) as w:
        for i in range(5):
            enc = dense(q[i], "fp32")
            w.write(
                Payload(
                    f"t{i}", (i, i + 1), (0.1, 0.2), V, provenance=Provenance(sampled_from="dense-fp32"), proposal=enc
                ),
                target=target[i],
            )
    wl = make_workload("trace", path=str(path))
    assert (wl.vocab_size, wl.num_steps) == (V, 2)
    batches = list(wl.batches(4, 3, seed=0))
    assert [b.request_ids for b in batches] == [("t0", "t1", "t2"), ("t3",)]
    assert torch.equal(batches[0].target_probs, target[:3])
    assert torch.allclose(
        batches[0].draft_probs, torch.stack([dense_law_tensor(dense(q[i], "fp32"), 2, V) for i in range(3)])
    )
    assert batches[1].prefix.tolist() == [[3, 4]]
    assert len(list(wl.payloads())) == 5

    bare = tmp_path / "bare.trace"
    with TraceWriter(bare) as w:
        w.write(payloads()[0])
    with pytest.raises(TraceError, match=r"record 0 \(r-dense\) has no target; only payloads\(\) can replay it"):
        list(make_workload("trace", path=str(bare)).batches(1, 1, 0))


def _u16_payload() -> Payload:
    """Two steps at V = 152064 (three 65536-token buckets), u16 indices."""
    ids = [[7, 70000, 150000], [65535, 65536]]
    return Payload(
        "r-u16",
        (7, 65536),
        (0.25, 0.5),
        152064,
        provenance=Provenance(sampled_from="sparse-fp16"),
        proposal=SparseEncoding(
            lengths=(3, 2),
            indices=torch.tensor([i & 0xFFFF for r in ids for i in r], dtype=torch.uint16).numpy().tobytes(),
            values=torch.tensor([0.25, 0.25, 0.25, 0.25, 0.5], dtype=torch.float16).numpy().tobytes(),
            value_dtype="fp16",
            tail_mass=(0.25, 0.25),
            index_format="u16",
            bucket_counts=(1, 1, 1, 1, 1, 0),
        ),
    )


def test_u16_sparse_round_trips_and_int32_records_keep_the_v1_layout(tmp_path: Path) -> None:
    from pd_middleware.sampling.encodings import sparse_law

    path = tmp_path / "u16.trace"
    sent = [_u16_payload(), payloads()[2]]
    with TraceWriter(path) as w:
        for p in sent:
            w.write(p)
    got = [e.payload for e in read_trace(path)]
    assert got == sent
    assert sparse_law(got[0].proposal, 2, 152064).indices.tolist() == [7, 70000, 150000, 65535, 65536]  # type: ignore[arg-type]
    # On disk: the u16 record names its format; the int32 one has exactly the v1 keys.
    raw = path.read_bytes()
    frames, off = [], 0
    while off < len(raw):
        (n,) = struct.unpack_from("<I", raw, off)
        frames.append(msgspec.msgpack.decode(raw[off + 4 : off + 4 + n]))
        off += 4 + n
    u16_rec, int32_rec = frames[1]["proposal"], frames[2]["proposal"]
    assert (u16_rec["index_format"], u16_rec["bucket_counts"]) == ("u16", [1, 1, 1, 1, 1, 0])
    assert sorted(int32_rec) == ["indices", "kind", "lengths", "tail_mass", "value_dtype", "values"]


def test_traces_written_before_u16_still_read(tmp_path: Path) -> None:
    """A version-1 sparse record without index_format/bucket_counts reads as int32."""
    path = tmp_path / "old.trace"
    p = payloads()[2]
    sp = p.proposal
    record = {
        "kind": "payload",
        "seq": 0,
        "request_id": p.request_id,
        "draft_tokens": list(p.draft_tokens),
        "draft_probs": list(p.draft_probs),
        "vocab_size": V,
        "hidden": b"",
        "hidden_dtype": "bf16",
        "provenance": {"rule": "sampled", "temperature": 1.0, "sampled_from": "sparse-fp16"},
        "proposal": {
            "kind": "sparse",
            "lengths": [2, 3],
            "indices": bytes(sp.indices),
            "values": bytes(sp.values),  # type: ignore[union-attr]
            "value_dtype": "fp16",
            "tail_mass": [0.2, 0.1],
        },
    }
    path.write_bytes(
        _frame({"kind": "header", "format": FORMAT, "version": 1, "created_unix": 0.0, "meta": {}})
        + _frame(record)
        + _frame({"kind": "end", "records": 1})
    )
    (e,) = list(read_trace(path))
    assert e.payload == p and e.payload.proposal.index_format == "int32"  # type: ignore[union-attr]
