"""The canonical sparse law for both index formats: u16 decoding against a brute-force
reference, equality of the int32 and u16 laws, and every u16 validation error with its
message. (int32 errors: tests/test_synthesizers.py; wire checks: tests/test_wire.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pd_middleware import SparseEncoding, ValidationError
from pd_middleware.core.payload import U16_BUCKET, u16_buckets
from pd_middleware.sampling.encodings import sample_sparse_law, sparse_law, sparse_law_tensor

SEED = 20261129
BIG_V = 152064  # the default synthetic vocab: 3 buckets of 65536 tokens


def u16(ids_per_step, vals_per_step, v, tail=(), dtype="fp32", counts=None, lengths=None):
    """A u16 encoding of the given ids (kept in the order given) and values."""
    nb = u16_buckets(v)
    flat_ids = [i for row in ids_per_step for i in row]
    if counts is None:
        counts = [int(sum(1 for i in row if i // U16_BUCKET == b)) for row in ids_per_step for b in range(nb)]
    return SparseEncoding(
        lengths=tuple(lengths) if lengths is not None else tuple(len(r) for r in ids_per_step),
        indices=np.asarray([i & 0xFFFF for i in flat_ids], dtype=np.uint16).tobytes(),
        values=np.asarray(
            [x for r in vals_per_step for x in r], dtype=np.float16 if dtype == "fp16" else np.float32
        ).tobytes(),
        value_dtype=dtype,
        tail_mass=tuple(tail),
        index_format="u16",
        bucket_counts=tuple(counts),
    )


def int32(ids_per_step, vals_per_step, tail=(), dtype="fp32"):
    return SparseEncoding(
        lengths=tuple(len(r) for r in ids_per_step),
        indices=np.asarray([i for r in ids_per_step for i in r], dtype=np.int32).tobytes(),
        values=np.asarray(
            [x for r in vals_per_step for x in r], dtype=np.float16 if dtype == "fp16" else np.float32
        ).tobytes(),
        value_dtype=dtype,
        tail_mass=tuple(tail),
    )


def random_rows(rng, steps, v, n_max):
    """Per step: sorted unique ids spread over every bucket, and dyadic values + tail."""
    ids, vals, tails = [], [], []
    for _ in range(steps):
        n = int(rng.integers(1, n_max + 1))
        row = np.sort(rng.choice(v, size=n, replace=False))
        ids.append([int(i) for i in row])
        vals.append([1.0 / (2 * n)] * n)  # listed mass 1/2, exact in fp32
        tails.append(0.5)
    return ids, vals, tails


@pytest.mark.parametrize("steps", [1, 3])
def test_u16_decodes_to_the_ids_and_the_same_law_as_int32(steps):
    rng = np.random.default_rng(SEED)
    for trial in range(20):
        ids, vals, tails = random_rows(rng, steps, BIG_V, 400)
        a, b = u16(ids, vals, BIG_V, tails), int32(ids, vals, tails)
        assert a.encoding_id == b.encoding_id == "sparse-fp32"  # the guard cannot tell them apart
        assert a.nbytes == 6 * sum(a.lengths) and b.nbytes == 8 * sum(b.lengths)
        la, lb = sparse_law(a, steps, BIG_V), sparse_law(b, steps, BIG_V)
        assert la.indices.dtype == torch.int64
        assert la.indices.tolist() == [i for r in ids for i in r], f"seed {SEED} trial {trial}"
        assert torch.equal(la.values, lb.values) and la.floor == lb.floor and la.lengths == lb.lengths
        assert torch.equal(sparse_law_tensor(a, steps, BIG_V), sparse_law_tensor(b, steps, BIG_V))


def test_u16_edges_of_the_buckets_and_of_the_vocab():
    edge = [0, U16_BUCKET - 1, U16_BUCKET, 2 * U16_BUCKET - 1, 2 * U16_BUCKET, BIG_V - 1]
    enc = u16([edge], [[1 / 6] * 6], BIG_V)
    assert enc.bucket_counts == (2, 2, 2)
    law = sparse_law(enc, 1, BIG_V)
    assert law.indices.tolist() == edge
    # Empty buckets anywhere, including a step that lives in the last bucket only.
    enc = u16([[5], [BIG_V - 1], [U16_BUCKET + 3]], [[1.0]] * 3, BIG_V)
    assert enc.bucket_counts == (1, 0, 0, 0, 0, 1, 0, 1, 0)
    assert sparse_law(enc, 3, BIG_V).indices.tolist() == [5, BIG_V - 1, U16_BUCKET + 3]


def test_u16_sampling_draws_only_from_the_law():
    """sample_sparse_law over u16 laws: listed tokens with their values, floor elsewhere."""
    ids = [[3, 70000, 140000], [1, 2, 150000]]
    enc = u16(ids, [[0.25, 0.125, 0.125], [0.5, 0.25, 0.125]], BIG_V, tail=(0.5, 0.125))
    law = sparse_law(enc, 2, BIG_V)
    dense = sparse_law_tensor(enc, 2, BIG_V)
    tokens, probs = sample_sparse_law([law] * 200, BIG_V, torch.Generator().manual_seed(SEED))
    tokens, probs = tokens.view(200, 2), probs.view(200, 2)
    for s in range(2):
        assert torch.equal(probs[:, s], dense[s, tokens[:, s]]), f"seed {SEED}"
    # The floor is half the mass of step 0: some draws land on unlisted tokens.
    assert not set(tokens[:, 0].tolist()) <= set(ids[0])


V = 12  # a single bucket


U16_BAD = [
    # (encoding, steps, field, message)
    (
        u16([[1, 2]], [[0.5, 0.5]], V, counts=[2, 0]),
        1,
        "proposal.bucket_counts",
        "has 2 counts, expected 1 steps x 1 buckets of 65536 tokens = 1",
    ),
    (
        u16([[1, 2]], [[0.5, 0.5]], V, counts=[]),
        1,
        "proposal.bucket_counts",
        "has 0 counts, expected 1 steps x 1 buckets",
    ),
    (
        u16([[1, 2]], [[0.5, 0.5]], V, counts=[1]),
        1,
        "proposal.bucket_counts",
        "step 0: counts sum to 1, but the step lists 2 entries",
    ),
    (
        u16([[1, 2]], [[0.5, 0.5]], V, counts=[3]),
        1,
        "proposal.bucket_counts",
        "step 0: counts sum to 3, but the step lists 2 entries",
    ),
    (u16([[1, 2]], [[0.5, 0.5]], V, counts=[-1]), 1, "proposal.bucket_counts", "count -1 is not an int >= 0"),
    (u16([[1, 2]], [[0.5, 0.5]], V, counts=[True]), 1, "proposal.bucket_counts", "count True is not an int >= 0"),
    (
        u16([[2, 1]], [[0.5, 0.5]], V),
        1,
        "proposal.indices",
        "step 0: ids are not strictly ascending (entry 1: id 1 after 2)",
    ),
    (
        u16([[1, 1]], [[0.5, 0.5]], V),
        1,
        "proposal.indices",
        "step 0: ids are not strictly ascending (entry 1: id 1 after 1)",
    ),
    (
        u16([[1, 5], [3, 9, 4]], [[0.5, 0.5], [0.5, 0.25, 0.25]], V),
        2,
        "proposal.indices",
        "step 1: ids are not strictly ascending (entry 4: id 4 after 9)",
    ),
    (u16([[1, V]], [[0.5, 0.5]], V), 1, "proposal.indices", f"index {V} is outside [0, {V})"),
    (u16([[1, 65535]], [[0.5, 0.5]], V), 1, "proposal.indices", f"index 65535 is outside [0, {V})"),
    (
        SparseEncoding(
            lengths=(2,),
            indices=b"\0" * 8,
            values=b"\0" * 8,
            value_dtype="fp32",
            index_format="u16",
            bucket_counts=(2,),
        ),
        1,
        "proposal.indices",
        "holds 8 bytes, expected 2 u16 indices",
    ),
    (
        SparseEncoding(
            lengths=(2,),
            indices=np.array([1, 2], np.int32).tobytes(),
            values=np.array([0.5, 0.5], np.float32).tobytes(),
            value_dtype="fp32",
            bucket_counts=(2,),
        ),
        1,
        "proposal.bucket_counts",
        "has 1 counts, but int32 indices take none",
    ),
    (
        SparseEncoding(lengths=(2,), indices=b"\0" * 4, values=b"\0" * 8, value_dtype="fp32", index_format="u8"),  # type: ignore[arg-type]
        1,
        "proposal.index_format",
        "unsupported index format 'u8'",
    ),
]


@pytest.mark.parametrize("enc, steps, field, message", U16_BAD)
def test_u16_validation_errors_name_the_field(enc, steps, field, message):
    with pytest.raises(ValidationError) as e:
        sparse_law(enc, steps, V, request_id="bad")
    assert (e.value.field, e.value.request_id) == (field, "bad")
    assert message in str(e.value)


def test_u16_range_and_count_errors_in_a_multi_bucket_vocab():
    # The last bucket holds ids 131072..196607; only those below V exist.
    enc = u16([[1, BIG_V]], [[0.5, 0.5]], BIG_V)
    with pytest.raises(ValidationError, match=rf"index {BIG_V} is outside \[0, {BIG_V}\)") as e:
        sparse_law(enc, 1, BIG_V)
    assert e.value.field == "proposal.indices"
    enc = u16([[1, 70000, 65600]], [[0.5, 0.25, 0.25]], BIG_V)
    with pytest.raises(
        ValidationError, match=r"step 0: ids are not strictly ascending \(entry 2: id 65600 after 70000\)"
    ):
        sparse_law(enc, 1, BIG_V)
    # The counts are authoritative: moving an entry to another bucket changes its id (to
    # another valid, ascending set), which no check can see; the encoder derives both
    # from the same sorted ids, and the law X is drawn from is decoded from these bytes.
    assert sparse_law(u16([[1, 70000]], [[0.5, 0.5]], BIG_V, counts=[0, 2, 0]), 1, BIG_V).indices.tolist() == [
        65537,
        70000,
    ]
    enc = u16([[1, 70000], [5]], [[0.5, 0.5], [1.0]], BIG_V, counts=[1, 1, 0, 1, 0])
    with pytest.raises(ValidationError, match=r"has 5 counts, expected 2 steps x 3 buckets of 65536 tokens = 6"):
        sparse_law(enc, 2, BIG_V)
    # Negative control: the same entries with the right counts are valid.
    assert sparse_law(u16([[1, 70000], [5]], [[0.5, 0.5], [1.0]], BIG_V), 2, BIG_V).indices.tolist() == [1, 70000, 5]
