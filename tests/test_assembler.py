"""The assembler: fresh values every build, no stale entry anywhere, same storage reused."""

from __future__ import annotations

import random

import pytest
import torch

from pd_middleware.core.proposal import DenseProposal, OneHotProposal, SparseProposal
from pd_middleware.decode.assembler import ProposalAssembler

SEED = 1234


def _reference(props, b, s, v):
    """What the build must equal: a freshly zeroed tensor with each proposal's rows."""
    out = torch.zeros(b, s, v)
    for i, p in enumerate(props):
        out[i] = p.to_dense(v)
    return out


def _random_proposal(rng: random.Random, s: int, v: int):
    kind = rng.choice(["one_hot", "one_hot", "sparse", "sparse_floor", "dense"])
    if kind == "one_hot":
        return OneHotProposal(tuple(rng.randrange(v) for _ in range(s)))
    if kind == "dense":
        probs = torch.rand(s, v, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        return DenseProposal(probs=probs, scale=1.0 / probs.sum(1))
    lengths = tuple(rng.randint(1, min(5, v)) for _ in range(s))
    idx = torch.cat([torch.tensor(rng.sample(range(v), n)) for n in lengths])
    vals = torch.rand(sum(lengths))
    floor = tuple(rng.random() * 0.01 if kind == "sparse_floor" else 0.0 for _ in range(s))
    return SparseProposal(lengths=lengths, indices=idx, values=vals, floor=floor)


@pytest.mark.parametrize("num_steps", [1, 3])
@pytest.mark.parametrize("num_buffers", [1, 2])
def test_no_stale_entries_across_batches(num_steps, num_buffers):
    """Random sequences of batches that grow and shrink, mixing every proposal kind."""
    rng = random.Random(SEED + num_steps * 10 + num_buffers)
    v, max_b = 37, 9
    asm = ProposalAssembler(v, num_steps, max_b, num_buffers=num_buffers)
    ptrs = {asm.graph_buffer(k).data_ptr() for k in range(num_buffers)}
    for step in range(60):
        b = rng.randint(1, max_b)
        props = [_random_proposal(rng, num_steps, v) for _ in range(b)]
        out = asm.build(props)
        want = _reference(props, b, num_steps, v)
        got = out if num_steps > 1 else out.unsqueeze(1)
        assert torch.equal(got, want), f"seed={SEED} step={step}: built batch differs from reference"
        # Rows past the batch are zero too: a graph padded to max_batch reads them.
        full = asm.graph_buffer((step) % num_buffers)
        assert out.data_ptr() == full.data_ptr(), "build must return a view of the persistent buffer"
        assert float(full[b:].abs().sum()) == 0.0, f"seed={SEED} step={step}: stale rows past the batch"
        assert out.data_ptr() in ptrs, "storage must be reused, never reallocated"


@pytest.mark.parametrize("num_steps", [1, 3])
def test_all_one_hot_batches_match_reference_between_mixed_ones(num_steps):
    """All-one-hot batches take a vectorised path; mixed ones the general path. Alternate
    them so each clears what the other wrote, and compare every build to the reference."""
    rng = random.Random(SEED + 7 * num_steps)
    v, max_b = 29, 8
    asm = ProposalAssembler(v, num_steps, max_b)
    for step in range(40):
        b = rng.randint(1, max_b)
        if step % 2:
            props = [_random_proposal(rng, num_steps, v) for _ in range(b)]
        else:
            props = [OneHotProposal(tuple(rng.randrange(v) for _ in range(num_steps))) for _ in range(b)]
        out = asm.build(props)
        got = out if num_steps > 1 else out.unsqueeze(1)
        assert torch.equal(got, _reference(props, b, num_steps, v)), f"step={step}: differs from reference"
        assert float(asm.graph_buffer()[b:].abs().sum()) == 0.0, f"step={step}: stale rows past the batch"


def test_all_one_hot_batch_errors_name_the_request():
    """A bad token in an otherwise all-one-hot batch still gets the precise error."""
    asm = ProposalAssembler(11, 2, 4)
    good = OneHotProposal((1, 2))
    first = asm.build([good]).clone()
    with pytest.raises(ValueError, match=r"request 1: token 11 outside \[0, 11\)"):
        asm.build([good, OneHotProposal((3, 11))])
    with pytest.raises(ValueError, match=r"request 2: token -1 outside \[0, 11\)"):
        asm.build([good, good, OneHotProposal((-1, 0))])
    with pytest.raises(ValueError, match="request 0: one-hot proposal has 3 steps, expected 2"):
        asm.build([OneHotProposal((1, 2, 3)), OneHotProposal((4,))])  # 4 tokens in all, still refused
    assert torch.equal(asm.graph_buffer()[:1], first)


def test_shapes_and_dtype_single_and_multi_layer():
    asm1 = ProposalAssembler(11, 1, 4)
    out = asm1.build([OneHotProposal((3,)), OneHotProposal((10,))])
    assert out.shape == (2, 11) and out.dtype == torch.float32
    assert out[0, 3] == 1.0 and out[1, 10] == 1.0 and float(out.sum()) == 2.0
    asm3 = ProposalAssembler(11, 3, 4)
    out = asm3.build([OneHotProposal((1, 2, 3))])
    assert out.shape == (1, 3, 11)
    assert out[0].argmax(-1).tolist() == [1, 2, 3]


def test_none_when_no_proposals_and_mixed_is_an_error():
    asm = ProposalAssembler(11, 1, 4)
    assert asm.build([None, None]) is None
    with pytest.raises(ValueError, match="1 of 2 requests have no proposal"):
        asm.build([None, OneHotProposal((1,))])


def test_errors_leave_buffer_untouched():
    asm = ProposalAssembler(11, 1, 4)
    first = asm.build([OneHotProposal((5,))]).clone()
    with pytest.raises(ValueError, match=r"token 11 outside \[0, 11\)"):
        asm.build([OneHotProposal((11,))])
    with pytest.raises(ValueError, match="exceeds max_batch=4"):
        asm.build([OneHotProposal((1,))] * 5)
    with pytest.raises(ValueError, match="one-hot proposal has 2 steps, expected 1"):
        asm.build([OneHotProposal((1, 2))])
    bad = SparseProposal(lengths=(1,), indices=torch.tensor([11]), values=torch.tensor([1.0]), floor=(0.0,))
    with pytest.raises(ValueError, match=r"index outside \[0, vocab_size\)"):
        asm.build([bad])
    with pytest.raises(ValueError, match=r"dense proposal has shape \(1, 10\), expected \(1, 11\)"):
        asm.build([DenseProposal(torch.ones(1, 10), torch.ones(1))])
    # build and build_fresh check descriptors in one place: a short or float index buffer
    # is refused before the clear (it was once accepted, or failed in index_copy_ after it).
    short = SparseProposal(lengths=(2,), indices=torch.tensor([1]), values=torch.tensor([1.0]), floor=(0.0,))
    with pytest.raises(ValueError, match="request 0: sparse proposal has 1 indices and 1 values for 2 entries"):
        asm.build([short])
    floats = SparseProposal(lengths=(1,), indices=torch.tensor([1.0]), values=torch.tensor([1.0]), floor=(0.0,))
    with pytest.raises(ValueError, match="request 0: sparse proposal indices must be integers"):
        asm.build([floats])
    assert torch.equal(asm.graph_buffer()[:1], first)


def test_view_lifetime_with_rotation():
    """A view stays valid for num_buffers - 1 further builds, then is overwritten."""
    asm = ProposalAssembler(8, 1, 2, num_buffers=2)
    a = asm.build([OneHotProposal((1,))])
    b = asm.build([OneHotProposal((2,))])
    assert a.argmax().item() == 1 and b.argmax().item() == 2  # a survived one build
    asm.build([OneHotProposal((3,))])  # reuses a's buffer
    assert a.argmax().item() == 3
    single = ProposalAssembler(8, 1, 2)
    x = single.build([OneHotProposal((1,))])
    single.build([OneHotProposal((4,))])
    assert x.argmax().item() == 4, "with one buffer, a view is valid only until the next build"


def test_dense_rows_are_scaled_copies():
    asm = ProposalAssembler(5, 1, 2)
    raw = torch.tensor([[1.0, 1.0, 2.0, 0.0, 0.0]], dtype=torch.bfloat16)
    out = asm.build([DenseProposal(raw, torch.tensor([0.25]))])
    assert out[0].tolist() == [0.25, 0.25, 0.5, 0.0, 0.0]


@pytest.mark.parametrize("num_steps", [1, 3])
def test_build_fresh_equals_the_reference_and_leaves_the_buffers_alone(num_steps):
    """build_fresh: a new tensor per call, equal to a freshly zeroed reference for every
    kind of proposal, any batch size (past max_batch too); the persistent buffer is not
    written. The tensor starts as torch.empty (whatever memory held), so a row that
    build_fresh forgot to write would show."""
    rng = random.Random(SEED + 7 * num_steps)
    v, max_b = 37, 4
    asm = ProposalAssembler(v, num_steps, max_b)
    before = asm.graph_buffer().clone()
    for step in range(30):
        b = rng.randint(1, 2 * max_b)
        kinds = rng.choice(["all_one_hot", "mixed"])
        props = [
            OneHotProposal(tuple(rng.randrange(v) for _ in range(num_steps)))
            if kinds == "all_one_hot"
            else _random_proposal(rng, num_steps, v)
            for _ in range(b)
        ]
        out = asm.build_fresh(props)
        got = out if num_steps > 1 else out.unsqueeze(1)
        assert torch.equal(got, _reference(props, b, num_steps, v)), f"seed={SEED} step={step} kinds={kinds}"
        assert out.dtype == torch.float32 and tuple(out.shape) == ((b, v) if num_steps == 1 else (b, num_steps, v))
    assert torch.equal(asm.graph_buffer(), before)
    assert asm.build_fresh([None, None]) is None
    with pytest.raises(ValueError, match="1 of 2 requests have no proposal"):
        asm.build_fresh([None, OneHotProposal((0,) * num_steps)])


def test_build_fresh_refuses_what_build_refuses():
    """The CPU build_fresh path checks every descriptor itself (it writes through numpy,
    which wraps negative indices): the same errors as build, naming the request."""
    asm = ProposalAssembler(11, 1, 4)
    with pytest.raises(ValueError, match=r"request 1: token 11 outside \[0, 11\)"):
        asm.build_fresh([OneHotProposal((1,)), OneHotProposal((11,))])
    with pytest.raises(ValueError, match=r"request 0: token True outside \[0, 11\)"):
        asm.build_fresh([OneHotProposal((True,))])
    for bad in (-1, 11):
        sp = SparseProposal(lengths=(1,), indices=torch.tensor([bad]), values=torch.tensor([1.0]), floor=(0.0,))
        with pytest.raises(ValueError, match=r"index outside \[0, vocab_size\)"):
            asm.build_fresh([OneHotProposal((1,)), sp])
    short = SparseProposal(lengths=(2,), indices=torch.tensor([1]), values=torch.tensor([1.0]), floor=(0.0,))
    with pytest.raises(ValueError, match="request 0: sparse proposal has 1 indices and 1 values for 2 entries"):
        asm.build_fresh([short])
    floats = SparseProposal(lengths=(1,), indices=torch.tensor([1.0]), values=torch.tensor([1.0]), floor=(0.0,))
    with pytest.raises(ValueError, match="request 0: sparse proposal indices must be integers"):
        asm.build_fresh([floats])
    # A listed value overrides its step's floor; int32 ids are widened, bf16 values too.
    sp = SparseProposal(
        lengths=(2,),
        indices=torch.tensor([3, 0], dtype=torch.int32),
        values=torch.tensor([0.5, 0.25], dtype=torch.bfloat16),
        floor=(0.03125,),
    )
    out = asm.build_fresh([sp, OneHotProposal((10,))])
    assert out[0].tolist() == [0.25, 0.03125, 0.03125, 0.5] + [0.03125] * 7
    assert out[1].tolist() == [0.0] * 10 + [1.0]


@pytest.mark.parametrize("num_steps", [1, 3])
def test_device_write_path_on_cpu_tensors(num_steps):
    """The write path a GPU takes (index_fill_/index_copy_ on one concatenated index
    tensor, kept on the device for the next clear) instead of the CPU's numpy stores,
    run on CPU tensors: CI has no GPU, and both must write the same bytes."""
    rng = random.Random(SEED + 11 * num_steps)
    v, max_b = 37, 9
    asm = ProposalAssembler(v, num_steps, max_b, num_buffers=2)
    asm._host = False  # private switch: the device branch, on CPU memory (no pinning there)
    for step in range(60):
        b = rng.randint(1, max_b)
        if step % 3 == 0:
            props = [OneHotProposal(tuple(rng.randrange(v) for _ in range(num_steps))) for _ in range(b)]
        else:
            props = [_random_proposal(rng, num_steps, v) for _ in range(b)]
        out = asm.build(props)
        got = out if num_steps > 1 else out.unsqueeze(1)
        assert torch.equal(got, _reference(props, b, num_steps, v)), f"seed={SEED} step={step}"
        assert float(asm.graph_buffer(step % 2)[b:].abs().sum()) == 0.0, f"seed={SEED} step={step}: stale rows"
        fresh = [_random_proposal(rng, num_steps, v) for _ in range(rng.randint(1, 2 * max_b))]
        out = asm.build_fresh(fresh)
        got = out if num_steps > 1 else out.unsqueeze(1)
        assert torch.equal(got, _reference(fresh, len(fresh), num_steps, v)), f"seed={SEED} step={step}: fresh"


@pytest.mark.parametrize("num_steps", [1, 3])
def test_build_fresh_on_cpu_writes_every_byte_of_its_numpy_memory(num_steps, monkeypatch):
    """On CPU build_fresh wraps uninitialised numpy memory (huge pages for a large batch).
    Here that memory starts as NaN, so any position the write path skipped would show;
    every kind of batch (all one-hot, sparse with and without a floor, dense, mixed)
    must still equal the zeroed reference. Negative control: with the write path
    skipped, the NaN shows."""
    import numpy as np

    from pd_middleware.decode import assembler as mod

    monkeypatch.setattr(mod, "_host_empty", lambda shape: np.full(shape, np.nan, dtype=np.float32))
    rng = random.Random(SEED + 13 * num_steps)
    v = 37
    asm = ProposalAssembler(v, num_steps, 4)
    for step in range(40):
        b = rng.randint(1, 9)
        props = [_random_proposal(rng, num_steps, v) for _ in range(b)]
        if step % 4 == 0:
            props = [OneHotProposal(tuple(rng.randrange(v) for _ in range(num_steps))) for _ in range(b)]
        out = asm.build_fresh(props)
        got = out if num_steps > 1 else out.unsqueeze(1)
        assert not bool(torch.isnan(got).any()), f"seed={SEED} step={step}: an unwritten position"
        assert torch.equal(got, _reference(props, b, num_steps, v)), f"seed={SEED} step={step}"
    # Negative control: without the write path the NaN memory shows through.
    monkeypatch.setattr(asm, "_write_fresh_host", lambda *args: None)
    out = asm.build_fresh([OneHotProposal((0,) * num_steps)])
    assert bool(torch.isnan(out).any())
