"""The sgl-kernel CPU stand-ins (site/sgl_cpu_ops.py) against plain references, on random inputs.

Edge cases per op: an empty batch, one token, and the longest sequence the table holds.
Runs without SGLang (the tree ops are also checked against SGLang's own Triton reference
kernels, under Triton's interpreter, when SGLang is installed).

The seeded hash ``murmur_hash32_cpu`` is checked against a byte-level MurmurHash3_x86_32
(itself checked against the published test vectors), against SGLang's Triton kernel and
the values SGLang's CPU kernel test pins, with wrong variants as negative controls; then
SGLang's seeded ``fast_sample`` runs on it: deterministic per (seed, position), the draws'
law by a chi-square test, and the same draws as with the GPU kernel's hash.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

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


def _separate_kv_case(
    lens: list[int], ext: list[int], g: torch.Generator, *, heads: int, dk: int, dv: int, latent: bool
) -> dict[str, torch.Tensor]:
    """An extend whose new tokens' K/V are passed apart from the buffers.

    ``latent``: the MLA MHA prefill's shape: the pool holds one latent row per token (1 head,
    another width), K/V of the new tokens are per head, and there is no cached prefix. Else
    the buffers have the new tokens' shape and hold garbage at the new tokens' slots, so a
    kernel that read the new tokens from the buffer would be caught.
    """
    tokens, width = 64, 24
    buf_heads, buf_dk, buf_dv = (1, dk + 16, dv + 8) if latent else (heads, dk, dv)
    r2t = torch.stack([torch.randperm(tokens, generator=g)[:width] for _ in range(len(lens))]).to(torch.int32)
    total = sum(ext)
    return {
        "q": torch.randn(total, heads, dk, generator=g),
        "k": torch.randn(total, heads, dk, generator=g),
        "v": torch.randn(total, heads, dv, generator=g),
        "k_buf": torch.randn(tokens, buf_heads, buf_dk, generator=g) * 7,
        "v_buf": torch.randn(tokens, buf_heads, buf_dv, generator=g) * 7,
        "r2t": r2t,
        "reqs": torch.arange(len(lens), dtype=torch.int64),
        "seq": torch.tensor(lens, dtype=torch.int64),
        "ext": torch.tensor(ext, dtype=torch.int64),
        "starts": torch.tensor([sum(ext[:i]) for i in range(len(ext))], dtype=torch.int64),
    }


def _separate_kv_reference(c: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """The contract, written out: prefix keys from the buffer, the new tokens' from ``k``/``v``."""
    out = torch.zeros(c["q"].shape[0], c["q"].shape[1], c["v"].shape[2], dtype=torch.float64)
    for b, (n, e, s) in enumerate(zip(c["seq"].tolist(), c["ext"].tolist(), c["starts"].tolist())):
        k, v = c["k"][s : s + e], c["v"][s : s + e]
        if n > e:
            prefix = c["r2t"][b, : n - e].long()
            k, v = torch.cat([c["k_buf"][prefix], k]), torch.cat([c["v_buf"][prefix], v])
        out[s : s + e] = _sdpa(c["q"][s : s + e], k, v, scale, n - e)
    return out


def _run_separate_kv(c: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    out = torch.zeros(c["q"].shape[0], c["q"].shape[1], c["v"].shape[2])
    ops.extend_attention_cpu(
        c["q"], c["k"], c["v"], out, c["k_buf"], c["v_buf"], 1.0, 1.0, c["r2t"], c["reqs"], c["seq"], c["ext"],
        c["starts"], int(c["ext"].max()), scale, 0.0, False, 0, None, None, None, True,
    )  # fmt: skip
    return out


@pytest.mark.parametrize(
    ("lens", "ext", "latent"),
    [([5], [5], True), ([3, 9, 1], [3, 9, 1], True), ([24, 7], [4, 7], False), ([9, 2], [1, 2], False)],
    ids=["mla-one", "mla-three", "prefix-longest", "prefix-decode-like"],
)
def test_extend_attention_reads_the_new_tokens_kv_passed_apart(lens: list[int], ext: list[int], latent: bool) -> None:
    """MLA's MHA prefill (``save_kv_cache=False``, per-head K/V, a latent pool) and a cached prefix."""
    c = _separate_kv_case(lens, ext, _gen(), heads=4, dk=48, dv=32, latent=latent)
    torch.testing.assert_close(_run_separate_kv(c, 0.3).double(), _separate_kv_reference(c, 0.3), atol=1e-5, rtol=1e-5)


def test_reading_the_new_tokens_from_the_buffer_is_caught() -> None:
    """Negative control: the buffers' garbage at the new tokens' slots is not what the contract reads."""
    c = _separate_kv_case([24, 7], [4, 7], _gen(), heads=4, dk=48, dv=32, latent=False)
    wrong = torch.zeros(c["q"].shape[0], 4, 32)
    ops.extend_attention_cpu(
        c["q"], None, None, wrong, c["k_buf"], c["v_buf"], 1.0, 1.0, c["r2t"], c["reqs"], c["seq"], c["ext"],
        c["starts"], 7, 0.3, 0.0, False, 0, None, None, None, True,
    )  # fmt: skip
    assert (wrong.double() - _separate_kv_reference(c, 0.3)).abs().max() > 0.1


def test_extend_attention_refuses_a_latent_prefix_beside_per_head_new_tokens() -> None:
    c = _separate_kv_case([9], [4], _gen(), heads=4, dk=48, dv=32, latent=True)
    with pytest.raises(ops.StandInRefused, match="K/V shape differs"):
        _run_separate_kv(c, 0.3)


@pytest.mark.sglang
@pytest.mark.server  # SGLang's attention kernels import sgl-kernel's package on CPU: make setup-server
@pytest.mark.parametrize(("lens", "ext", "latent"), [([3, 9], [3, 9], True), ([24, 7], [4, 7], False)])
def test_extend_attention_matches_sglang_triton_extend_attention(
    lens: list[int], ext: list[int], latent: bool, request: pytest.FixtureRequest
) -> None:
    """The stand-in equals SGLang's Triton ``extend_attention_fwd`` (interpreted) on the same separate K/V.

    The kernel uses ``tl.zeros`` and other jitted parts of ``triton.language``, which only
    ``TRITON_INTERPRET=1`` set before Triton is imported makes callable (the tier's servers
    run so): without it the test reruns itself in a fresh interpreter that has it.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        node = f"{__file__}::{request.node.name}"
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "server", node]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
        return
    ea = _sglang_module("sglang.kernels.ops.attention.extend_attention")
    c = _separate_kv_case(lens, ext, _gen(), heads=4, dk=48, dv=32, latent=latent)
    qo = torch.tensor([0, *c["ext"].cumsum(0).tolist()], dtype=torch.int32)
    prefix_lens = c["seq"] - c["ext"]
    kv_indptr = torch.tensor([0, *prefix_lens.cumsum(0).tolist()], dtype=torch.int32)
    kv_indices = torch.cat([c["r2t"][b, : int(n)].long() for b, n in enumerate(prefix_lens)]).to(torch.int64)
    theirs = torch.zeros(c["q"].shape[0], 4, 32)
    ea.extend_attention_fwd(
        c["q"], c["k"], c["v"], theirs, c["k_buf"], c["v_buf"], qo, kv_indptr, kv_indices, None, True, None,
        int(c["ext"].max()), 1.0, 1.0, sm_scale=0.3,
    )  # fmt: skip
    torch.testing.assert_close(_run_separate_kv(c, 0.3), theirs, atol=1e-4, rtol=1e-4)


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


# ---- seeded sampling: murmur_hash32_cpu and SGLang's fast_sample on it ----------------------


def _murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3_x86_32 of ``data`` (plain Python ints, byte level, with the tail): the reference.

    Written from the algorithm's description, independently of the stand-in, and checked
    against the published test vectors below before it is trusted.
    """
    mask = 0xFFFFFFFF

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & mask

    h = seed & mask
    nblocks = len(data) // 4
    for i in range(nblocks):
        k = int.from_bytes(data[4 * i : 4 * i + 4], "little")
        k = rotl((k * 0xCC9E2D51) & mask, 15) * 0x1B873593 & mask
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & mask
    tail = data[4 * nblocks :]
    if tail:
        k = int.from_bytes(tail, "little")
        k = rotl((k * 0xCC9E2D51) & mask, 15) * 0x1B873593 & mask
        h ^= k
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & mask
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & mask
    return h ^ (h >> 16)


# Published MurmurHash3_x86_32 test vectors (as widely reproduced from SMHasher's
# implementation): (message, seed, hash).
_MURMUR3_VECTORS = [
    (b"", 0, 0),
    (b"", 1, 0x514E28B7),
    (b"", 0xFFFFFFFF, 0x81F16F39),
    (b"\xff\xff\xff\xff", 0, 0x76293B50),
    (b"\x21\x43\x65\x87", 0, 0xF55B516B),
    (b"\x21\x43\x65\x87", 0x5082EDEE, 0x2362F9DE),
    (b"\x21\x43\x65", 0, 0x7E4A8634),
    (b"\x21\x43", 0, 0xA0F7B07A),
    (b"\x21", 0, 0x72661CF4),
    (b"\x00\x00\x00\x00", 0, 0x2362F9DE),
    (b"\x00\x00\x00", 0, 0x85F0B427),
    (b"\x00\x00", 0, 0x30F4C306),
    (b"\x00", 0, 0x514E28B7),
    (b"aaaa", 0x9747B28C, 0x5A97808A),
    (b"abcd", 0x9747B28C, 0xF0478627),
    (b"abc", 0x9747B28C, 0xC84A62DD),
    (b"ab", 0x9747B28C, 0x74875592),
    (b"a", 0x9747B28C, 0x7FA09EA6),
    (b"Hello, world!", 0x9747B28C, 0x24884CBA),
    (b"a" * 256, 0x9747B28C, 0x37405BDC),
    (b"The quick brown fox jumps over the lazy dog", 0x9747B28C, 0x2FA826CD),
]


@pytest.mark.parametrize(
    ("data", "seed", "want"), _MURMUR3_VECTORS, ids=[f"v{i}" for i in range(len(_MURMUR3_VECTORS))]
)
def test_the_murmur3_reference_matches_the_published_vectors(data: bytes, seed: int, want: int) -> None:
    assert _murmur3_x86_32(data, seed) == want, f"{data[:16]!r} seed {seed:#x}"


def _hash_inputs(seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeds over all 64 bits (0, 2**64 - 1, SGLang's salted range), positions past 2**32, columns past 2**32."""
    g = _gen(seed)
    seeds = [0, 1, 2**64 - 1, 2**63, 0x44524146545F0000 + 7, *torch.randint(0, 2**62, (5,), generator=g).tolist()]
    pos = [0, 1, 2**32 - 1, 2**32 + 5, 2**40 + 9, *torch.randint(0, 10_000, (5,), generator=g).tolist()]
    cols = [0, 1, 2**32 - 1, 2**32 + 3, *torch.randint(0, 200_000, (8,), generator=g).tolist()]
    return (
        torch.tensor([s - 2**64 if s >= 2**63 else s for s in seeds], dtype=torch.int64).view(torch.uint64),
        torch.tensor(pos, dtype=torch.int64),
        torch.tensor(cols, dtype=torch.int64),
    )


def _reference_grid(seeds: torch.Tensor, pos: torch.Tensor, cols: torch.Tensor) -> list[list[int]]:
    """The reference on each 16-byte message: seed low, seed high, position, column (low 32 bits, LE)."""
    rows = []
    for s, p in zip(seeds.view(torch.int64).tolist(), pos.tolist()):
        head = (s & 2**64 - 1).to_bytes(8, "little") + (p & 0xFFFFFFFF).to_bytes(4, "little")
        rows.append([_murmur3_x86_32(head + (c & 0xFFFFFFFF).to_bytes(4, "little")) for c in cols.tolist()])
    return rows


def _mismatches(impl: object) -> int:
    """Entries where ``impl(seed, positions, cols)`` differs from the reference, over :func:`_hash_inputs`."""
    seeds, pos, cols = _hash_inputs()
    got = impl(seeds, pos, cols)  # type: ignore[operator]
    assert got.dtype == torch.uint32 and got.shape == (seeds.numel(), cols.numel())
    want = _reference_grid(seeds, pos, cols)
    return sum(a != b for ra, rb in zip(got.to(torch.int64).tolist(), want) for a, b in zip(ra, rb))


@pytest.mark.parametrize("positions_dtype", [torch.int64, torch.uint64])
def test_murmur_hash32_cpu_matches_murmur3_of_the_16_byte_message(positions_dtype: torch.dtype) -> None:
    def impl(s: torch.Tensor, p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return ops.murmur_hash32_cpu(s, p.view(positions_dtype), c)

    assert _mismatches(impl) == 0, f"seed {SEED}"


def _swapped_seed_words(s: torch.Tensor, p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    w = s.view(torch.int64)
    swapped = ((w << 32) | ((w >> 32) & 0xFFFFFFFF)).view(torch.uint64)  # high word first
    return ops.murmur_hash32_cpu(swapped, p, c)


@pytest.mark.parametrize(
    ("variant", "constant", "value"),
    [("rotation 13 in the block mix", "_R1", 13), ("length 12 bytes", "_MESSAGE_BYTES", 12),
     ("a wrong finaliser constant", "_F2", 0xC2B2AE36), ("seed words swapped", None, None)],
)  # fmt: skip
def test_a_wrong_murmur_variant_fails_the_reference_check(
    monkeypatch: pytest.MonkeyPatch, variant: str, constant: str | None, value: int | None
) -> None:
    """The negative control: each deliberately wrong variant differs from the reference almost everywhere."""
    impl = _swapped_seed_words if constant is None else ops.murmur_hash32_cpu
    if constant is not None:
        monkeypatch.setattr(ops, constant, value)
    seeds, _, cols = _hash_inputs()
    assert _mismatches(impl) > seeds.numel() * cols.numel() // 2, variant


def test_murmur_hash32_cpu_sglang_known_values() -> None:
    """The values SGLang's own CPU kernel test pins (upstream ``test_murmur_hash32_cpu_known_values``)."""
    seed = torch.tensor([0, 1, 42, 0x123456789ABCDEF0], dtype=torch.uint64)
    pos = torch.tensor([0, 7, 123, 456], dtype=torch.int64)
    cols = torch.tensor([0, 1, 2, 17], dtype=torch.int64)
    want = [
        [2167721464, 10027521, 2423355346, 2203067026],
        [3755322398, 4196701286, 1002451629, 183234019],
        [772287619, 548237471, 2740678348, 3656549299],
        [3746406971, 2891010872, 104055988, 3372550890],
    ]
    assert ops.murmur_hash32_cpu(seed, pos, cols).to(torch.int64).tolist() == want


def test_murmur_hash32_cpu_shapes_and_refusals() -> None:
    u64 = torch.zeros(0, dtype=torch.uint64)
    assert ops.murmur_hash32_cpu(u64, torch.zeros(0, dtype=torch.int64), torch.arange(5)).shape == (0, 5)
    one = torch.ones(2, dtype=torch.uint64)
    assert ops.murmur_hash32_cpu(one, torch.ones(2, dtype=torch.int64), torch.arange(0)).shape == (2, 0)
    with pytest.raises(RuntimeError, match="seed must have dtype torch.uint64, got torch.int64"):
        ops.murmur_hash32_cpu(torch.ones(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64), torch.arange(3))
    with pytest.raises(RuntimeError, match="positions must have dtype torch.int64 or torch.uint64, got torch.int32"):
        ops.murmur_hash32_cpu(one, torch.ones(2, dtype=torch.int32), torch.arange(3))
    with pytest.raises(RuntimeError, match="seed and positions must have the same length"):
        ops.murmur_hash32_cpu(one, torch.ones(3, dtype=torch.int64), torch.arange(3))
    with pytest.raises(RuntimeError, match=r"col_indices must be 1-D, got shape \(1, 3\)"):
        ops.murmur_hash32_cpu(one, torch.ones(2, dtype=torch.int64), torch.arange(3).view(1, 3))


def _sglang_module(name: str) -> object:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (make setup-sglang): no reference to compare with")
    from _sglang_import import import_sglang

    return import_sglang(name)


@pytest.fixture
def interpreted_murmur(monkeypatch: pytest.MonkeyPatch) -> object:
    """SGLang's Triton ``murmur_hash32_kernel`` run by Triton's interpreter, as ``f(seed, positions, cols)``.

    Its nested ``@triton.jit`` helpers are interpreted too (swapped in the module for the
    test only): without ``TRITON_INTERPRET=1`` at import, Triton refuses to call them.
    """
    mh = _sglang_module("sglang.kernels.ops.sampling.murmur_hash")
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    for helper in ("rotl32", "fmix32", "murmur3_mix"):
        monkeypatch.setattr(mh, helper, InterpretedFunction(getattr(mh, helper).fn))
    kernel = InterpretedFunction(mh.murmur_hash32_kernel.fn)  # type: ignore[attr-defined]

    def run(seed: torch.Tensor, positions: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        n, m = seed.numel(), cols.numel()
        out = torch.empty((n, m), dtype=torch.uint32)
        if n and m:
            kernel[(n, triton.cdiv(m, 1024))](seed, positions, cols, out, n, m, BLOCK_SIZE=1024)
        return out

    return run


@pytest.mark.sglang
def test_murmur_hash32_cpu_matches_sglang_triton_kernel(interpreted_murmur: object) -> None:
    """The stand-in equals SGLang's GPU hash (its Triton kernel, interpreted) bit for bit."""
    seeds, pos, cols = _hash_inputs()
    theirs = interpreted_murmur(seeds, pos, cols)  # type: ignore[operator]
    assert torch.equal(ops.murmur_hash32_cpu(seeds, pos, cols), theirs), f"seed {SEED}"
    assert _mismatches(interpreted_murmur) == 0  # and SGLang's kernel is the 16-byte MurmurHash3


def _fast_sample() -> object:
    """SGLang's ``spec_utils.fast_sample``, its CPU hash served by this stand-in (checked by call count)."""
    spec = _sglang_module("sglang.srt.speculative.spec_utils")
    import sgl_kernel  # noqa: F401  (its CPU fallback imports common_ops: the stand-ins, registered once)

    if not hasattr(torch.ops.sgl_kernel, "murmur_hash32_cpu"):
        pytest.fail("torch.ops.sgl_kernel.murmur_hash32_cpu is not registered after import sgl_kernel")

    def draw(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        before = ops.CALLS.get("murmur_hash32_cpu", 0)
        _, x = spec.fast_sample(probs, 1, sampling_seed=seeds, positions=positions)  # type: ignore[attr-defined]
        assert ops.CALLS.get("murmur_hash32_cpu", 0) == before + 1, "fast_sample did not hash with the stand-in"
        return x.view(-1)

    return draw


def _law(v: int = 16) -> torch.Tensor:
    return torch.softmax(torch.linspace(-1.5, 1.5, v, dtype=torch.float64), dim=0).float()


@pytest.mark.sglang
@pytest.mark.server  # sgl-kernel's Python package: make setup-server
def test_seeded_fast_sample_runs_on_cpu_and_is_deterministic_per_seed_and_position() -> None:
    draw = _fast_sample()
    g = _gen()
    b, v = 64, 50
    probs = torch.softmax(torch.randn(b, v, generator=g) * 2, dim=-1)
    seeds = torch.randint(0, 2**62, (b,), generator=g)
    pos = torch.randint(0, 4096, (b,), generator=g)
    x = draw(probs, seeds, pos)  # type: ignore[operator]
    assert x.dtype == torch.int64 and x.shape == (b,)
    assert torch.equal(draw(probs, seeds, pos), x)  # type: ignore[operator]
    perm = torch.randperm(b, generator=g)
    assert torch.equal(draw(probs[perm], seeds[perm], pos[perm]), x[perm])  # type: ignore[operator]
    # A request's draw does not depend on the rest of its batch.
    other = torch.softmax(torch.randn(b, v, generator=g), dim=-1)
    mixed = torch.where((torch.arange(b) % 2 == 0).view(-1, 1), probs, other)
    assert torch.equal(draw(mixed, seeds, pos)[::2], x[::2])  # type: ignore[operator]
    # Another position (or seed) of the same request is another draw: not all equal.
    row = probs[:1].expand(256, v).contiguous()
    at_positions = draw(row, seeds[:1].expand(256).contiguous(), torch.arange(256))  # type: ignore[operator]
    at_seeds = draw(row, torch.arange(256), pos[:1].expand(256).contiguous())  # type: ignore[operator]
    assert at_positions.unique().numel() > 10 and at_seeds.unique().numel() > 10


CHI2_DF15_ALPHA_1E6 = 56.49  # Pearson chi-square critical value, 15 degrees of freedom, alpha = 1e-6


def _chi2(counts: torch.Tensor, law: torch.Tensor) -> float:
    expected = law.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


@pytest.mark.sglang
@pytest.mark.server  # sgl-kernel's Python package: make setup-server
@pytest.mark.parametrize("over", ["positions", "seeds"])
def test_seeded_fast_sample_draws_from_probs(over: str) -> None:
    """Pearson chi-square over 16 outcomes (df 15): a sampler drawing from probs fails with
    probability at most 1e-6 (critical value 56.49; fixed seeds, so the run is deterministic).
    Power: the same draws fail against a law with two entries swapped."""
    draw = _fast_sample()
    n = 40_000
    law = _law()
    probs = law.view(1, -1).expand(n, -1).contiguous()
    base = torch.full((n,), 987_654_321, dtype=torch.int64)
    idx = torch.arange(n, dtype=torch.int64)
    x = draw(probs, base, idx + 17) if over == "positions" else draw(probs, idx * 7919 + 3, base % 4096)  # type: ignore[operator]
    counts = torch.bincount(x, minlength=16)
    stat = _chi2(counts, law)
    assert stat < CHI2_DF15_ALPHA_1E6, f"chi2 {stat:.1f} over {over} (n={n}, seed base 987654321)"
    wrong = law.clone()
    wrong[[2, 13]] = wrong[[13, 2]]
    assert _chi2(counts, wrong) > CHI2_DF15_ALPHA_1E6, "the test cannot tell a swapped law apart"


@pytest.mark.sglang
@pytest.mark.server  # sgl-kernel's Python package: make setup-server
def test_seeded_fast_sample_on_cpu_equals_the_gpu_hash_path(
    interpreted_murmur: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fast_sample with the stand-in draws exactly what it draws with SGLang's Triton hash."""
    draw = _fast_sample()
    g = _gen()
    probs = torch.softmax(torch.randn(12, 300, generator=g), dim=-1)
    seeds = torch.randint(0, 2**62, (12,), generator=g)
    pos = torch.randint(0, 4096, (12,), generator=g)
    ours = draw(probs, seeds, pos)  # type: ignore[operator]
    mh = _sglang_module("sglang.kernels.ops.sampling.murmur_hash")
    monkeypatch.setattr(mh, "murmur_hash32", interpreted_murmur)
    spec = _sglang_module("sglang.srt.speculative.spec_utils")
    _, theirs = spec.fast_sample(probs, 1, sampling_seed=seeds, positions=pos)  # type: ignore[attr-defined]
    assert torch.equal(ours, theirs.view(-1)), f"seed {SEED}"


def test_a_compiled_caller_neither_traces_nor_recompiles_the_stand_ins() -> None:
    """SGLang compiles some callers of the ops (``sampler.multinomial_with_seed`` hashes through
    murmur_hash32_cpu): the stand-ins stay opaque, as compiled kernels are, so the caller
    compiles once however often the ops run (their call counts change between calls)."""
    from torch._dynamo.testing import CompileCounter

    lib = ops.register("pdm_compile_probe", log=lambda message: None)  # kept: the ops live as long as it does
    op = getattr(torch.ops, lib.ns).murmur_hash32_cpu
    counter = CompileCounter()

    @torch.compile(backend=counter, dynamic=True)
    def hashed_plus_one(seed: torch.Tensor, pos: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return op(seed, pos, cols).to(torch.int64) + 1

    seeds, pos, cols = _hash_inputs()
    want = ops.murmur_hash32_cpu(seeds, pos, cols).to(torch.int64) + 1
    for _ in range(6):
        assert torch.equal(hashed_plus_one(seeds, pos, cols), want)
        ops.CALLS["decode_attention_cpu"] = ops.CALLS.get("decode_attention_cpu", 0) + 1  # other ops ran
    assert counter.frame_count <= 2, f"{counter.frame_count} frames compiled over 6 calls"


CHI2_DF9_ALPHA_1E6 = 44.81  # Pearson chi-square critical value, 9 degrees of freedom, alpha = 1e-6


def _independence_chi2(a: torch.Tensor, b: torch.Tensor, k: int) -> float:
    """Pearson's chi-square of independence of two outcomes in [0, k) (a k x k table)."""
    table = torch.zeros(k, k, dtype=torch.float64)
    table.index_put_((a, b), torch.ones(a.shape[0], dtype=torch.float64), accumulate=True)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum())


@pytest.mark.sglang
@pytest.mark.server  # sgl-kernel's Python package: make setup-server
@pytest.mark.parametrize("keyed", ["as SGLang draws X", "like the coins (negative control)"])
def test_the_draft_draw_shares_no_randomness_with_the_verify_coins(keyed: str) -> None:
    """X' = fast_sample(q', seed, positions=L), the decode's redraw keyed as SGLang's prefill
    keys X (eagle_worker_v2 ``_draft_extend_for_prefill``), against the first verify's coins
    from SGLang's own ``_seeded_verify_coins(seed, seq_lens=L)``: the same request and the same
    position (the decode's prebuilt seq_lens is the first verify's). Each coin is independent
    of X' by a 4 x 4 chi-square (df 9; a sampler with independent streams fails with
    probability at most 1e-6 per table). Negative control: a draw keyed with the coins'
    own seed (SGLang's draft salt taken off) shares their hashes, and the test sees it."""
    draw = _fast_sample()
    spec = _sglang_module("sglang.srt.speculative.spec_utils")
    verify = _sglang_module("sglang.srt.speculative.eagle_utils")
    n = 20_000
    seeds = torch.arange(n, dtype=torch.int64) * 104_729 + 11
    at = torch.full((n,), 57, dtype=torch.int64)
    q = torch.tensor([0.4, 0.3, 0.2, 0.1]).expand(n, 4).contiguous()
    salt = int(spec._DRAFT_GUMBEL_SEED_SALT)  # type: ignore[attr-defined]
    x = draw(q, seeds if keyed.startswith("as") else seeds - salt, at)  # type: ignore[operator]
    coins, final = verify._seeded_verify_coins(sampling_seed=seeds, seq_lens=at, draft_token_num=4, device="cpu")  # type: ignore[attr-defined]
    stats = [_independence_chi2(x, (c * 4).long().clamp_max(3), 4) for c in (*coins.T, final)]
    if keyed.startswith("as"):
        assert max(stats) < CHI2_DF9_ALPHA_1E6, f"chi2 per coin {[round(s, 1) for s in stats]} (n={n})"
    else:
        assert stats[0] > CHI2_DF9_ALPHA_1E6, f"the shared stream went unseen: chi2 {stats[0]:.1f}"


def _rotate_cases() -> list[tuple[list[int], list[int], list[int] | None]]:
    """(extend_seq_lens, new tokens, select_index offsets within each request or None)."""
    return [
        ([5], [900], None),
        ([3, 1, 4], [7, 8, 9], None),
        ([4, 0, 2], [11, 12, 13], None),  # an empty request is left alone
        ([6, 3], [21, 22], [2, 0]),  # select_index: the new token at a chosen slot
        ([1, 19, 11], [31, 32, 33], None),  # longer than one block of SGLang's kernel (8)
    ]


@pytest.mark.parametrize("case", range(5))
def test_rotate_input_ids_cpu_shifts_each_request_and_appends_its_token(case: int) -> None:
    lens, new, select = _rotate_cases()[case]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    ids = torch.arange(100, 100 + sum(lens), dtype=torch.int64)
    want = ids.clone()
    for i, (s, n) in enumerate(zip(starts, lens)):
        if n:
            want[s : s + n - 1] = ids[s + 1 : s + n]
            want[s + (select[i] if select else n - 1)] = new[i]
    sel = torch.tensor([s + o for s, o in zip(starts, select)], dtype=torch.int64) if select else None
    ops.rotate_input_ids_cpu(ids, torch.tensor(starts), torch.tensor(lens), torch.tensor(new, dtype=torch.int64), sel)
    assert torch.equal(ids, want), (ids.tolist(), want.tolist())


@pytest.mark.sglang
@pytest.mark.server  # SGLang's multi-layer module imports sgl-kernel's package on CPU: make setup-server
@pytest.mark.parametrize("case", range(5))
def test_rotate_input_ids_cpu_matches_sglang_triton_kernel(case: int) -> None:
    """The stand-in equals SGLang's ``rotate_input_ids_kernel`` (interpreted) on the same input."""
    mle = _sglang_module("sglang.kernels.ops.speculative.multi_layer_eagle")
    from triton.runtime.interpreter import InterpretedFunction

    kernel = InterpretedFunction(mle.rotate_input_ids_kernel.fn)  # type: ignore[attr-defined]
    lens, new, select = _rotate_cases()[case]
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))], dtype=torch.int64)
    sel = torch.tensor([int(s) + o for s, o in zip(starts, select)], dtype=torch.int64) if select else None
    ids = torch.arange(100, 100 + sum(lens), dtype=torch.int64)
    theirs, ours = ids.clone(), ids.clone()
    args = (starts, torch.tensor(lens, dtype=torch.int64), torch.tensor(new, dtype=torch.int64), sel)
    kernel[(len(lens),)](theirs, *args, BLOCK_SIZE=4096 if sel is not None else 8)
    ops.rotate_input_ids_cpu(ours, *args)
    assert torch.equal(ours, theirs), (ours.tolist(), theirs.tolist())
