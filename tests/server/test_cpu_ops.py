"""The sgl-kernel CPU stand-ins (site/sgl_cpu_ops.py) against plain references, on random inputs.

Edge cases per op: an empty batch, one token, and the longest sequence the table holds.
Runs without SGLang (the tree ops are also checked against SGLang's own Triton reference
kernels, under Triton's interpreter, when SGLang is installed).
"""

from __future__ import annotations

import importlib.util

import pytest
import sgl_cpu_ops as ops  # tests/server/site is on sys.path (conftest.py)
import torch

SEED = 1234


def _gen(seed: int = SEED) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _table(pool: int, width: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 10_000, (pool, width), generator=g, dtype=torch.int32)


@pytest.mark.parametrize("lens", [[], [1], [5, 1, 16], [16, 16]], ids=["empty", "one", "mixed", "longest"])
def test_assign_req_to_token_pool_and_back(lens: list[int]) -> None:
    g = _gen()
    width = 16
    r2t = _table(4, width, g)
    before = r2t.clone()
    reqs = torch.tensor([3, 1, 0, 2][: len(lens)], dtype=torch.int64)
    start = torch.tensor(
        [0 if n == width else int(torch.randint(0, width - n + 1, (1,), generator=g)) for n in lens], dtype=torch.int64
    )
    end = start + torch.tensor(lens, dtype=torch.int64)
    locs = torch.randint(0, 10_000, (sum(lens),), generator=g, dtype=torch.int64)
    ops.assign_req_to_token_pool_cpu(reqs, r2t, start, end, locs, width)
    want = before.clone()
    offsets = [0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()]
    for i, (r, s, e) in enumerate(zip(reqs.tolist(), start.tolist(), end.tolist())):
        want[r, s:e] = locs[offsets[i] : offsets[i + 1]].to(torch.int32)
    assert torch.equal(r2t, want), f"seed {SEED}"
    back = torch.full((sum(lens),), -1, dtype=torch.int64)
    ops.assign_extend_cache_locs_cpu(reqs, r2t, start, end, back, width)
    assert torch.equal(back, locs), f"seed {SEED}"


@pytest.mark.parametrize(("bs", "topk", "steps"), [(0, 1, 3), (1, 1, 1), (3, 1, 3), (2, 2, 2)])
def test_draft_cache_locs_and_metadata(bs: int, topk: int, steps: int) -> None:
    g = _gen()
    width = 12
    r2t = _table(4, width, g)
    reqs = torch.randperm(4, generator=g)[:bs].to(torch.int64)
    longest = width - topk * steps
    seq = torch.randint(1, longest + 1, (bs,), generator=g, dtype=torch.int64)
    if bs:
        seq[0] = longest  # the longest prefix the table holds
    out = torch.full((bs * topk * steps,), -1, dtype=torch.int64)
    ops.assign_draft_cache_locs_contiguous_cpu(reqs, r2t, seq, out, width, topk, steps)
    meta = ops.build_draft_decode_metadata_cpu(r2t, reqs, seq, topk, steps, width)
    assert meta.shape == (bs * topk, width)
    for b in range(bs):
        r, n = int(reqs[b]), int(seq[b])
        slots = r2t[r, n : n + topk * steps].to(torch.int64)
        assert torch.equal(out[b * topk * steps : (b + 1) * topk * steps], slots)
        for k in range(topk):
            row = meta[b * topk + k]
            assert torch.equal(row[:n], r2t[r, :n])
            assert torch.equal(row[n : n + steps], r2t[r, n + k * steps : n + (k + 1) * steps])
            assert int(row[n + steps :].abs().sum()) == 0


@pytest.mark.parametrize("bs", [0, 1, 5])
def test_fill_bonus_tokens(bs: int) -> None:
    g = _gen()
    stride = 4
    tokens = torch.randint(0, 1000, (bs, stride), generator=g, dtype=torch.int32)
    lens = torch.randint(1, stride + 1, (bs,), generator=g, dtype=torch.int32)
    if bs:
        lens[0] = stride
    bonus = torch.full((bs + 2,), -7, dtype=torch.int64)
    ops.fill_bonus_tokens_cpu(tokens, lens, bonus, stride)
    want = [int(tokens[b, int(lens[b]) - 1]) for b in range(bs)]
    assert bonus[:bs].tolist() == want
    assert bonus[bs:].tolist() == [-7, -7]  # nothing past the batch is touched


@pytest.mark.parametrize("n", [0, 1, 9])
def test_fill_accept_out_cache_loc(n: int) -> None:
    g = _gen()
    loc = torch.randint(0, 10_000, (12,), generator=g, dtype=torch.int64)
    idx = torch.randint(0, 12, (n,), generator=g, dtype=torch.int32)
    if n > 2:
        idx[1] = -1
    out = torch.full((n,), -5, dtype=torch.int64)
    ops.fill_accept_out_cache_loc_cpu(idx, loc, out)
    picked = [int(loc[i]) for i in idx.tolist() if i != -1]
    assert out[: len(picked)].tolist() == picked
    assert out[len(picked) :].tolist() == [-5] * (n - len(picked))


@pytest.mark.parametrize("rows", [[], [3], [0, 7, 2]], ids=["empty", "one", "some"])
def test_copy_all_layer_kv_cache(rows: list[int]) -> None:
    g = _gen()
    layers = [torch.randn(8, 6, generator=g) for _ in range(2)]
    before = [t.clone() for t in layers]
    src = torch.tensor(rows, dtype=torch.int64)
    tgt = torch.tensor([(r + 1) % 8 for r in rows], dtype=torch.int64)  # overlapping moves
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    strides = torch.tensor([t.stride(0) * t.element_size() for t in layers], dtype=torch.int64)
    ops.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for t, b in zip(layers, before):
        want = b.clone()
        want[tgt] = b[src]
        assert torch.equal(t, want)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_from: int | None) -> torch.Tensor:
    heads, kv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv, 1)
    v = v.repeat_interleave(heads // kv, 1)
    mask = None
    if causal_from is not None:
        mask = torch.arange(k.shape[0]).unsqueeze(0) <= (torch.arange(q.shape[0]).unsqueeze(1) + causal_from)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).double(), k.transpose(0, 1).double(), v.transpose(0, 1).double(), attn_mask=mask, scale=scale
    )
    return o.transpose(0, 1)


def _kv_setup(
    lens: list[int], g: torch.Generator, width: int = 24
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = 64
    k_buf = torch.randn(tokens, 2, 8, generator=g)
    v_buf = torch.randn(tokens, 2, 8, generator=g)
    r2t = torch.stack([torch.randperm(tokens, generator=g)[:width] for _ in range(max(1, len(lens)))]).to(torch.int32)
    reqs = torch.arange(len(lens), dtype=torch.int64)
    return k_buf, v_buf, r2t, reqs


@pytest.mark.parametrize("lens", [[], [1], [3, 24, 9]], ids=["empty", "one", "longest"])
def test_decode_attention(lens: list[int]) -> None:
    g = _gen()
    k_buf, v_buf, r2t, reqs = _kv_setup(lens, g)
    bs = len(lens)
    q = torch.randn(bs, 4, 8, generator=g)
    key, value = torch.randn(bs, 2, 8, generator=g), torch.randn(bs, 2, 8, generator=g)
    seq = torch.tensor(lens, dtype=torch.int64)
    loc = torch.tensor([int(r2t[b, n - 1]) for b, n in enumerate(lens)], dtype=torch.int64)  # the new token's slot
    out = torch.zeros(bs, 4, 8)
    ops.decode_attention_cpu(
        q, k_buf, v_buf, 1.0, 1.0, out, key, value, loc, torch.empty(0), r2t, reqs, seq, 0.35, 0.0, False, 0, None, None
    )
    for b, n in enumerate(lens):
        assert torch.equal(k_buf[loc[b]], key[b])
        idx = r2t[b, :n].long()
        want = _sdpa(q[b : b + 1], k_buf[idx], v_buf[idx], 0.35, None)
        torch.testing.assert_close(out[b : b + 1].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("lens", "ext"), [([], []), ([1], [1]), ([24, 7], [4, 7])], ids=["empty", "one", "longest"])
def test_extend_attention(lens: list[int], ext: list[int]) -> None:
    g = _gen()
    k_buf, v_buf, r2t, reqs = _kv_setup(lens, g)
    total = sum(ext)
    q = torch.randn(total, 4, 8, generator=g)
    out = torch.zeros(total, 4, 8)
    starts = [0, *torch.tensor(ext, dtype=torch.int64).cumsum(0).tolist()][: len(ext)]
    ops.extend_attention_cpu(
        q, None, None, out, k_buf, v_buf, 1.0, 1.0, r2t, reqs,
        torch.tensor(lens, dtype=torch.int64), torch.tensor(ext, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64),
        max(ext, default=0), 0.35, 0.0, False, 0, None, None, None, True,
    )  # fmt: skip
    for b, (n, e, s) in enumerate(zip(lens, ext, starts)):
        idx = r2t[b, :n].long()
        want = _sdpa(q[s : s + e], k_buf[idx], v_buf[idx], 0.35, n - e)
        torch.testing.assert_close(out[s : s + e].double(), want, atol=1e-5, rtol=1e-5)


def test_extend_attention_refuses_a_tree_mask() -> None:
    with pytest.raises(ops.StandInRefused, match="tree mask"):
        ops.extend_attention_cpu(
            *[torch.empty(0)] * 13, None, 1.0, 0.0, False, 0, None, None, torch.ones(1, dtype=torch.bool), True
        )


def _tree_inputs(bs: int, topk: int, steps: int, n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    # EAGLE's layout: parent_list (bs, topk * (steps - 1) + 1) of candidate ids, selected_index
    # (bs, n - 1) of candidate ids whose parent is parent_list[sel // topk] (0: the root).
    plist = topk * (steps - 1) + 1
    parent = torch.full((bs, plist), -1, dtype=torch.int64)
    sel = torch.zeros(bs, n - 1, dtype=torch.int64)
    for b in range(bs):
        if topk == 1:
            sel[b] = torch.arange(n - 1)
            parent[b, 1:] = torch.arange(plist - 1)
            continue
        sel[b] = torch.randperm(topk * plist, generator=g)[: n - 1].sort().values
        for tb in range(1, plist):
            # Mostly an earlier selected candidate; sometimes one that was not selected.
            pick = int(torch.randint(0, n - 1, (1,), generator=g))
            parent[b, tb] = sel[b, pick] if torch.rand(1, generator=g) < 0.8 else 10_000 + tb
    return {"parent": parent, "sel": sel}


def _run_build(
    impl: object, bs: int, topk: int, steps: int, n: int, mode: int, seq: torch.Tensor, inp: dict[str, torch.Tensor]
) -> list[torch.Tensor]:
    mask_len = int((seq + n).sum()) * n if mode == 0 else bs * n * n
    mask = torch.ones(mask_len, dtype=torch.bool)
    pos = torch.zeros(bs * n, dtype=torch.int64)
    ri = torch.full((bs, n), -1, dtype=torch.int64)
    nt = torch.full((bs, n), -1, dtype=torch.int64)
    ns = torch.full((bs, n), -1, dtype=torch.int64)
    impl(inp["parent"], inp["sel"], seq, mask, pos, ri, nt, ns, topk, steps, n, mode)  # type: ignore[operator]
    return [mask, pos, ri, nt, ns]


def test_build_tree_chain_by_hand() -> None:
    # top-k 1, 3 steps, 4 draft tokens: a chain root -> 1 -> 2 -> 3.
    seq = torch.tensor([5], dtype=torch.int64)
    inp = _tree_inputs(1, 1, 3, 4, _gen())
    mask, pos, ri, nt, ns = _run_build(ops.build_tree_kernel_efficient_cpu, 1, 1, 3, 4, 1, seq, inp)
    assert ri.tolist() == [[0, 1, 2, 3]]
    assert nt.tolist() == [[1, 2, 3, -1]]
    assert ns.tolist() == [[-1, -1, -1, -1]]
    assert pos.tolist() == [5, 6, 7, 8]
    assert mask.view(4, 4).tolist() == [[j <= i for j in range(4)] for i in range(4)]


def test_verify_tree_greedy_chain_by_hand() -> None:
    # Chain of 4; target argmax agrees with drafts 1 and 2, not 3.
    cand = torch.tensor([[9, 4, 5, 6]])
    target = torch.tensor([[4, 5, 7, 1]])
    ri, nt, ns = torch.tensor([[0, 1, 2, 3]]), torch.tensor([[1, 2, 3, -1]]), torch.full((1, 4), -1)
    pred = torch.full((4,), -1, dtype=torch.int64)
    acc = torch.full((1, 4), -1, dtype=torch.int64)
    num = torch.zeros(1, dtype=torch.int64)
    ops.verify_tree_greedy_cpu(pred, acc, num, cand, ri, nt, ns, target)
    assert num.tolist() == [2]
    assert acc.tolist() == [[0, 1, 2, -1]]
    assert pred.tolist() == [4, 5, 7, -1]  # accepted 4, 5, then the bonus 7


def _sglang_tree_kernels() -> object:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (make setup-sglang): no Triton reference to compare with")
    from _sglang_import import import_sglang

    import_sglang("sglang.kernels.ops.speculative.spec_tree")
    import sys

    return sys.modules["sglang.kernels.ops.speculative.spec_tree"]


@pytest.mark.sglang
@pytest.mark.parametrize(
    ("bs", "topk", "steps", "n", "mode"),
    [(0, 1, 3, 4, 1), (1, 1, 1, 2, 0), (3, 1, 3, 4, 1), (2, 2, 3, 5, 0), (2, 4, 3, 8, 1)],
)
def test_tree_ops_match_sglang_triton_reference(bs: int, topk: int, steps: int, n: int, mode: int) -> None:
    """Both tree ops equal SGLang's own Triton kernels (its XPU path) run by Triton's interpreter."""
    st = _sglang_tree_kernels()
    from triton.runtime.interpreter import InterpretedFunction

    g = _gen()
    seq = torch.randint(1, 30, (bs,), generator=g, dtype=torch.int64)
    inp = _tree_inputs(bs, topk, steps, n, g)
    build_k = InterpretedFunction(st.sgl_build_tree_kernel_efficient_triton.fn)  # type: ignore[attr-defined]

    def ref_build(parent, sel, seq, mask, pos, ri, nt, ns, topk, depth, n, mode):  # type: ignore[no-untyped-def]
        if seq.shape[0] == 0:
            return
        prefix = torch.cumsum(seq, 0) - seq
        build_k[(seq.shape[0],)](parent, sel, seq, prefix, mask, pos, ri, nt, ns, topk=topk, depth=depth,
                                 draft_token_num=n, tree_mask_mode=mode, batch_size=seq.shape[0],
                                 parent_list_stride=parent.stride(0), selected_index_stride=sel.stride(0))  # fmt: skip

    ours = _run_build(ops.build_tree_kernel_efficient_cpu, bs, topk, steps, n, mode, seq, inp)
    theirs = _run_build(ref_build, bs, topk, steps, n, mode, seq, inp)
    for name, a, b in zip(("tree_mask", "positions", "retrive_index", "next_token", "next_sibling"), ours, theirs):
        assert torch.equal(a, b), f"{name} differs (seed {SEED}, bs={bs} topk={topk} n={n} mode={mode})"

    _, _, ri, nt, ns = ours
    verify_k = InterpretedFunction(st.verify_tree_greedy_kernel_triton.fn)  # type: ignore[attr-defined]
    for trial in range(5):
        cand = torch.randint(0, 3, (bs, n), generator=g)
        target = torch.randint(0, 3, (bs, n), generator=g)
        res = []
        for impl in ("ours", "theirs"):
            pred = torch.full((bs * n,), -1, dtype=torch.int64)
            acc = torch.full((bs, steps + 1), -1, dtype=torch.int64)
            num = torch.zeros(bs, dtype=torch.int64)
            if impl == "ours":
                ops.verify_tree_greedy_cpu(pred, acc, num, cand, ri, nt, ns, target)
            elif bs:
                verify_k[(bs,)](pred, acc, num, cand, ri, nt, ns, target, batch_size=bs,
                                num_speculative_tokens=steps + 1, num_draft_tokens=n)  # fmt: skip
            res.append((pred, acc, num))
        for a, b in zip(*res):
            assert torch.equal(a, b), f"verify differs (seed {SEED}, trial {trial})"
