"""Payload validation: every bad field is named, with the request id."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pd_middleware import DenseEncoding, Payload, Provenance, SparseEncoding, ValidationError


def make(**kw):
    base = dict(request_id="r1", draft_tokens=(5,), draft_probs=(0.5,), vocab_size=10)
    base.update(kw)
    return Payload(**base)


def test_valid_payload_normalises_tensors_and_is_immutable():
    hidden = torch.arange(4, dtype=torch.bfloat16)
    p = make(
        draft_tokens=torch.tensor([1, 2, 3]),
        draft_probs=np.array([0.1, 0.2, 1.0], dtype=np.float32),
        hidden=hidden.view(torch.int16).numpy().tobytes(),
        hidden_dtype="bf16",
    )
    assert p.draft_tokens == (1, 2, 3) and p.num_steps == 3
    assert p.hidden_size == 4
    assert torch.equal(p.hidden_tensor(), hidden)
    with pytest.raises(AttributeError):
        p.request_id = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "kw, field, message",
    [
        (dict(request_id=""), "request_id", "must be a non-empty str"),
        (dict(vocab_size=0), "vocab_size", "must be a positive int"),
        (dict(draft_tokens=()), "draft_tokens", "at least one token"),
        (dict(draft_tokens=(10,)), "draft_tokens", r"token id 10 is not an int in \[0, 10\)"),
        (dict(draft_tokens=(-1,)), "draft_tokens", r"token id -1 is not an int in \[0, 10\)"),
        (dict(draft_tokens=(1.0,)), "draft_tokens", "is not an int"),
        (dict(draft_tokens=torch.tensor([[1]])), "draft_tokens", "expected a 1-D sequence"),
        (dict(draft_tokens=torch.tensor([1.0])), "draft_tokens", "expected an integer dtype"),
        (dict(draft_probs=(0.5, 0.5)), "draft_probs", "has 2 entries for 1 draft tokens"),
        (dict(draft_probs=(math.nan,)), "draft_probs", "not a finite probability"),
        (dict(draft_probs=(math.inf,)), "draft_probs", "not a finite probability"),
        (dict(draft_probs=(-0.1,)), "draft_probs", "not a finite probability"),
        (dict(draft_probs=(1.5,)), "draft_probs", "not a finite probability"),
        (dict(draft_probs=("x",)), "draft_probs", "is not a number"),
        (dict(hidden_dtype="int8"), "hidden_dtype", "must be one of bf16, fp16, fp32"),
        (dict(hidden=b"abc", hidden_dtype="fp16"), "hidden", "not a whole number of fp16 values"),
        (dict(hidden=[1, 2]), "hidden", "must be bytes or memoryview"),
        (dict(proposal="dense"), "proposal", "must be a DenseEncoding or SparseEncoding"),
    ],
)
def test_invalid_fields_are_named(kw, field, message):
    with pytest.raises(ValidationError, match=message) as ei:
        make(**kw)
    assert ei.value.field == field
    rid = kw.get("request_id", "r1")
    assert ei.value.request_id == (rid or None)
    if rid:
        assert "'r1'" in str(ei.value)


def test_provenance_validation():
    with pytest.raises(ValidationError, match="must be 'greedy' or 'sampled'") as ei:
        Provenance(rule="topk")  # type: ignore[arg-type]
    assert ei.value.field == "provenance.rule"
    with pytest.raises(ValidationError, match="finite number >= 0"):
        Provenance(temperature=math.nan)
    with pytest.raises(ValidationError, match="greedy draft was not sampled"):
        Provenance(rule="greedy", sampled_from="sparse-fp16")


def test_encodings_carry_ids_and_sizes():
    d = DenseEncoding("bf16", b"\0" * 20)
    assert d.encoding_id == "dense-bf16" and d.nbytes == 20
    s = SparseEncoding(lengths=(2,), indices=b"\0" * 8, values=b"\0" * 4, value_dtype="fp16")
    assert s.encoding_id == "sparse-fp16" and s.nbytes == 12


def test_check_fits_names_the_mismatched_field():
    p = make(draft_tokens=(1, 2), draft_probs=(0.5, 0.5))
    p.check_fits(10, 2)  # fits: no error
    with pytest.raises(ValidationError, match=r"payload vocab 10 != target vocab 11") as e:
        p.check_fits(11, 2)
    assert e.value.field == "vocab_size" and e.value.request_id == "r1"
    with pytest.raises(ValidationError, match=r"2 draft tokens, deployment drafts 3 steps") as e:
        p.check_fits(10, 3)
    assert e.value.field == "draft_tokens" and e.value.request_id == "r1"
