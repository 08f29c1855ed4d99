"""Plain-torch stand-ins for the sgl-kernel CPU ops a tiny SGLang PD pair calls.

SGLang's CPU build of sgl-kernel is compiled from source only; the PyPI ``sglang-kernel``
wheel is CUDA-only, and its loader falls back to a plain ``import common_ops`` when its
compiled libraries do not load. ``common_ops.py`` beside this file registers the functions
below as ``torch.ops.sgl_kernel.<name>`` (CPU dispatch key), so ``import sgl_kernel`` works
and SGLang's ``intel_amx`` attention backend and EAGLE worker run on any CPU.

Each function follows the op's schema (the argument order SGLang calls with; outputs are
written in place where the schema marks them mutable). They favour clarity over speed:
a Python loop per request, never per vocabulary entry (the seeded samplers' hash,
``murmur_hash32_cpu``, is one tensor expression over the whole batch). Not covered, and
refused with a message: tree attention masks (``--speculative-eagle-topk > 1``), sliding
windows, attention sinks and cross-attention.

Each op logs its first call on stderr (``[sgl_kernel stand-in] first call: <name>``), so a
server log shows which stand-ins a run used. Tests: ``tests/server/test_cpu_ops.py``.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Any

import torch

#: name -> (schema, implementation), in registration order.
OPS: dict[str, tuple[str, Callable[..., Any]]] = {}
#: name -> calls so far in this process.
CALLS: dict[str, int] = {}


def _op(schema: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        name = schema.split("(", 1)[0]
        if fn.__name__ != name:
            raise ValueError(f"stand-in {fn.__name__} registered under schema {name}")
        OPS[name] = (schema, fn)
        return fn

    return deco


class StandInRefused(NotImplementedError):
    """An op was called with a case the stand-in does not implement (named in the message)."""


def _refuse(op: str, what: str) -> None:
    raise StandInRefused(f"sgl_kernel stand-in {op}: {what} is not implemented on this CPU stand-in")


# ---- KV cache and index bookkeeping ------------------------------------------------


@_op("copy_all_layer_kv_cache_cpu(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()")
def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For each layer buffer (raw address, row stride in bytes): ``row[tgt] = row[src]``.

    All sources are read before any target is written, so overlapping moves are safe.
    """
    if src_loc.numel() != tgt_loc.numel():
        raise ValueError(f"src_loc has {src_loc.numel()} entries, tgt_loc {tgt_loc.numel()}")
    if src_loc.numel() == 0:
        return
    src, tgt = src_loc.long(), tgt_loc.long()
    rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        buf = (ctypes.c_char * (rows * stride)).from_address(base)
        view = torch.frombuffer(buf, dtype=torch.uint8).view(rows, stride)
        view[tgt] = view[src].clone()


@_op(
    "assign_req_to_token_pool_cpu(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, "
    "Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()"
)
def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[r, s:e] = out_cache_loc[next e - s]`` for each request, in order."""
    pos = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[r, s:e] = out_cache_loc[pos : pos + e - s].to(req_to_token.dtype)
        pos += e - s


@_op(
    "assign_extend_cache_locs_cpu(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, "
    "Tensor end_offset, Tensor(a!) out_cache_loc, int pool_len) -> ()"
)
def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """The inverse gather: ``out_cache_loc[next e - s] = req_to_token[r, s:e]``."""
    pos = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        out_cache_loc[pos : pos + e - s] = req_to_token[r, s:e].to(out_cache_loc.dtype)
        pos += e - s


@_op(
    "assign_draft_cache_locs_contiguous_cpu(Tensor req_pool_indices, Tensor req_to_token, Tensor seq_lens, "
    "Tensor(a!) out_cache_loc, int pool_len, int topk, int num_steps) -> ()"
)
def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """Request b's ``topk * num_steps`` draft slots: ``req_to_token[r, L : L + topk * num_steps]``."""
    n = topk * num_steps
    for b, (r, length) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[b * n : (b + 1) * n] = req_to_token[r, length : length + n].to(out_cache_loc.dtype)


@_op(
    "build_draft_decode_metadata_cpu(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int topk, "
    "int num_steps, int pool_len) -> Tensor"
)
def build_draft_decode_metadata_cpu(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    pool_len: int,
) -> torch.Tensor:
    """A (b * topk, pool_len) req_to_token for the draft decode steps.

    Row ``b * topk + k``: request b's prefix, then candidate k's ``num_steps`` draft slots
    (laid out ``[topk, num_steps]`` from ``seq_len`` on, as
    :func:`assign_draft_cache_locs_contiguous_cpu` allocates them); zeros after.
    """
    out = torch.zeros((req_pool_indices.numel() * topk, pool_len), dtype=req_to_token.dtype)
    for b, (r, length) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        for k in range(topk):
            row = out[b * topk + k]
            row[:length] = req_to_token[r, :length]
            start = length + k * num_steps
            row[length : length + num_steps] = req_to_token[r, start : start + num_steps]
    return out


@_op(
    "fill_bonus_tokens_cpu(Tensor accept_tokens, Tensor accept_lens, Tensor(a!) bonus_tokens, int accept_stride) -> ()"
)
def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor, accept_stride: int
) -> None:
    """``bonus_tokens[b]`` = the last accepted token of request b (row stride ``accept_stride``)."""
    flat = accept_tokens.reshape(-1)
    for b, n in enumerate(accept_lens.tolist()):
        bonus_tokens[b] = flat[b * accept_stride + int(n) - 1]


@_op("fill_accept_out_cache_loc_cpu(Tensor accept_index, Tensor out_cache_loc, Tensor(a!) accept_out_cache_loc) -> ()")
def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor
) -> None:
    """The cache slots of the accepted tokens, packed in order (``-1`` entries skipped)."""
    picked = [out_cache_loc[int(i)] for i in accept_index.reshape(-1).tolist() if i != -1]
    for j, loc in enumerate(picked):
        accept_out_cache_loc[j] = loc


@_op(
    "rotate_input_ids_cpu(Tensor(a!) input_ids, Tensor extend_start_loc, Tensor extend_seq_lens, "
    "Tensor topk_index, Tensor? select_index) -> ()"
)
def rotate_input_ids_cpu(
    input_ids: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    topk_index: torch.Tensor,
    select_index: torch.Tensor | None,
) -> None:
    """The multi-layer EAGLE worker's rotation, per request ``i`` of the extend: its ids
    ``input_ids[s : s + n]`` shift left by one, and the new token ``topk_index[i]`` goes
    last (at ``select_index[i]`` when given, else at ``s + n - 1``). A request of length 0
    is left alone."""
    flat = topk_index.reshape(-1)
    for i, (s, n) in enumerate(zip(extend_start_loc.tolist(), extend_seq_lens.tolist())):
        if n <= 0:
            continue
        if n > 1:
            input_ids[s : s + n - 1] = input_ids[s + 1 : s + n].clone()
        last = int(select_index[i]) if select_index is not None else s + n - 1
        input_ids[last] = flat[i].to(input_ids.dtype)


# ---- EAGLE trees ---------------------------------------------------------------------


def _parent_positions(selected: list[int], parents: list[int], topk: int) -> list[int | None]:
    """Draft position (0 = the verified root) of each draft token's parent; None when not found.

    ``selected[i - 1]``: the flat candidate index of draft token i; its parent candidate is
    ``selected[i - 1] // topk`` in ``parents`` (0: the root).
    """
    n = len(selected) + 1
    out: list[int | None] = [None] * n
    for i in range(1, n):
        tb = selected[i - 1] // topk
        if tb == 0:
            out[i] = 0
            continue
        parent_token = parents[tb]
        out[i] = next((pp + 1 for pp in range(n - 1) if selected[pp] == parent_token), None)
    return out


@_op(
    "build_tree_kernel_efficient_cpu(Tensor parent_list, Tensor selected_index, Tensor verified_seq_len, "
    "Tensor(a!) tree_mask, Tensor(b!) positions, Tensor(c!) retrive_index, Tensor(d!) retrive_next_token, "
    "Tensor(e!) retrive_next_sibling, int topk, int depth, int draft_token_num, int tree_mask_mode) -> ()"
)
def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """The EAGLE draft tree of each request: retrieval links, positions and attention mask.

    Per request b with n = ``draft_token_num`` tokens (position 0 the verified token):
    ``retrive_index[b, i] = b * n + i``; ``retrive_next_token[b, p]`` is p's last-listed
    child, chained to earlier children by ``retrive_next_sibling``; ``positions[b, i]`` is
    ``seq_len + depth(i)``; the mask row of token i opens the root, i and i's ancestors
    (``tree_mask_mode`` 0: rows ``seq_len + n`` wide after the request's prefix columns,
    which are left as given; 1: rows n wide). Mode 2 (bit-packed) is refused.
    """
    if tree_mask_mode not in (0, 1):
        _refuse("build_tree_kernel_efficient_cpu", f"tree_mask_mode {tree_mask_mode} (bit-packed)")
    n = draft_token_num
    prefix = 0
    flat_mask = tree_mask.view(-1)
    flat_pos = positions.view(-1)
    for b, seq_len in enumerate(verified_seq_len.tolist()):
        selected = selected_index[b].tolist()[: n - 1]
        parents = parent_list[b].tolist() if parent_list.dim() > 1 else parent_list.tolist()
        parent_of = _parent_positions(selected, parents, topk)
        for i in range(n - 1, 0, -1):
            retrive_index[b, i] = b * n + i
            p = parent_of[i]
            if p is None:
                continue
            first = int(retrive_next_token[b, p])
            retrive_next_token[b, p] = i
            if first != -1:
                retrive_next_sibling[b, i] = first
        retrive_index[b, 0] = b * n
        width, col0 = (seq_len + n, seq_len) if tree_mask_mode == 0 else (n, 0)
        block = n * n * b + prefix * n if tree_mask_mode == 0 else n * n * b
        for x in range(n):
            row = block + width * x
            flat_mask[row + col0 : row + col0 + n] = False
            flat_mask[row + col0] = True
            steps, cur = 0, x
            while cur != 0 and steps < depth:
                flat_mask[row + col0 + cur] = True
                steps += 1
                nxt = parent_of[cur]
                if nxt is None:
                    break
                cur = nxt
            flat_pos[b * n + x] = seq_len + steps
        prefix += seq_len


@_op(
    "verify_tree_greedy_cpu(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, "
    "Tensor candidates, Tensor retrive_index, Tensor retrive_next_token, Tensor retrive_next_sibling, "
    "Tensor target_predict) -> ()"
)
def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy tree verify: walk down the tree while a child equals the target's argmax.

    ``target_predict`` (b, n): the target's argmax at each draft position. Writes the
    accepted path's flat indices into ``accept_index[b, :1 + accepted]``, the accepted
    count into ``accept_token_num[b]``, and each accepted position's target token, plus
    the bonus token at the last one, into ``predicts`` (flat over b * n).
    """

    steps = accept_index.shape[1]
    target = target_predict.reshape(-1)
    for b in range(candidates.shape[0]):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, steps):
            child = int(retrive_next_token[b, cur])
            want = target[last]
            while child != -1 and candidates[b, child] != want:
                child = int(retrive_next_sibling[b, child])
            if child == -1:
                break
            predicts[last] = want
            accepted += 1
            last = int(retrive_index[b, child])
            accept_index[b, accepted] = last
            cur = child
        accept_token_num[b] = accepted
        predicts[last] = target[last]


# ---- attention (the intel_amx backend) ------------------------------------------------


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, causal_from: int | None, logit_cap: float
) -> torch.Tensor:
    """Softmax attention in fp32. q (Lq, H, D), k (Lk, Hkv, D), v (Lk, Hkv, Dv) -> (Lq, H, Dv).

    ``causal_from``: query row i sees keys ``0 .. causal_from + i`` (None: all keys).
    Grouped-query heads: each of the H query heads reads KV head ``h // (H / Hkv)``.
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    k = k.float().repeat_interleave(heads // kv_heads, dim=1)
    v = v.float().repeat_interleave(heads // kv_heads, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    if causal_from is not None:
        qi = torch.arange(q.shape[0]).unsqueeze(1) + causal_from
        s = s.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > qi, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


@_op(
    "decode_attention_cpu(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, float k_scale, float v_scale, "
    "Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor(d!) attn_logits, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross, int window_plus_1, "
    "Tensor? encoder_lens, Tensor? sinks) -> ()"
)
def decode_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: float,
    v_scale: float,
    output: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    loc: torch.Tensor,
    attn_logits: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    logit_cap: float,
    is_cross: bool,
    window_plus_1: int,
    encoder_lens: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> None:
    """One query token per request over its ``seq_lens[b]`` cached tokens.

    With ``key``/``value`` given, the new token's K/V are stored at ``loc`` first (the CPU
    kernel writes them itself). ``attn_logits`` is scratch the real kernel uses; untouched.
    """
    if is_cross or sinks is not None or window_plus_1 > 0:
        _refuse("decode_attention_cpu", "cross-attention, sinks or a sliding window")
    if key is not None and value is not None:
        k_cache[loc.long()] = key.to(k_cache.dtype)
        v_cache[loc.long()] = value.to(v_cache.dtype)
    for b, (r, length) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        idx = req_to_token[r, :length].long()
        o = attend(
            query[b : b + 1],
            k_cache[idx] * k_scale,
            v_cache[idx] * v_scale,
            sm_scale,
            causal_from=None,
            logit_cap=logit_cap,
        )
        output[b] = o[0].to(output.dtype)


@_op(
    "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
    "Tensor k_buffer, Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, Tensor req_pool_indices, "
    "Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, int? max_len_extend, float sm_scale, "
    "float logit_cap, bool is_cross, int window_plus_1, Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, "
    "bool is_causal) -> ()"
)
def extend_attention_cpu(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor | None,
    v_extend: torch.Tensor | None,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    k_scale: float,
    v_scale: float,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_len_extend: int | None,
    sm_scale: float,
    logit_cap: float,
    is_cross: bool,
    window_plus_1: int,
    encoder_lens: torch.Tensor | None,
    sinks: torch.Tensor | None,
    tree_mask: torch.Tensor | None,
    is_causal: bool,
) -> None:
    """Request b's ``extend_seq_lens[b]`` new tokens over all its ``seq_lens[b]`` tokens.

    The kernel's contract (sgl-kernel's CPU ``extend_attention`` and SGLang's Triton
    ``extend_attention_fwd``): the prefix (the first ``seq_lens[b] - extend_seq_lens[b]``
    tokens) is read from ``k_buffer``/``v_buffer`` through ``req_to_token``, the new tokens
    from ``k_extend``/``v_extend`` at rows ``extend_start_loc[b] ..``. Those may have another
    head count and width than the buffers: the MHA prefill of an MLA model passes per-head K/V
    while the pool holds one latent row per token (``save_kv_cache=False``). With no
    ``k_extend`` (a KV-shared layer) the new tokens are read from the buffers too.
    Causal: new token i sees the prefix and new tokens ``0 .. i``.
    """
    if is_cross or sinks is not None or window_plus_1 > 0:
        _refuse("extend_attention_cpu", "cross-attention, sinks or a sliding window")
    if tree_mask is not None:
        _refuse("extend_attention_cpu", "a tree mask (--speculative-eagle-topk > 1)")
    separate = k_extend is not None and v_extend is not None
    for r, length, ext, start in zip(
        req_pool_indices.tolist(), seq_lens.tolist(), extend_seq_lens.tolist(), extend_start_loc.tolist()
    ):
        if separate:
            assert k_extend is not None and v_extend is not None  # narrowed for the type checker
            prefix = req_to_token[r, : length - ext].long()
            k_new, v_new = k_extend[start : start + ext].float(), v_extend[start : start + ext].float()
            if prefix.numel() and (k_buffer.shape[1:] != k_new.shape[1:] or v_buffer.shape[1:] != v_new.shape[1:]):
                _refuse("extend_attention_cpu", "a cached prefix whose K/V shape differs from the new tokens'")
            keys, values = k_new, v_new
            if prefix.numel():
                keys = torch.cat([k_buffer[prefix].float() * k_scale, k_new])
                values = torch.cat([v_buffer[prefix].float() * v_scale, v_new])
        else:
            idx = req_to_token[r, :length].long()
            keys, values = k_buffer[idx] * k_scale, v_buffer[idx] * v_scale
        o = attend(
            q_extend[start : start + ext],
            keys,
            values,
            sm_scale,
            causal_from=(length - ext) if is_causal else None,
            logit_cap=logit_cap,
        )
        o_extend[start : start + ext] = o.to(o_extend.dtype)


# ---- seeded sampling ---------------------------------------------------------------------
#
# SGLang's seeded samplers (``spec_utils.fast_sample`` with ``sampling_seed``, the verify's
# ``_seeded_verify_coins``, ``sampler.multinomial_with_seed``) hash through
# ``kernels/ops/sampling/murmur_hash.py: murmur_hash32``, which on a CPU tensor calls
# ``torch.ops.sgl_kernel.murmur_hash32_cpu``. The hash is MurmurHash3 (x86, 32-bit, seed 0)
# of a 16-byte message: the four little-endian 32-bit words seed_low, seed_high,
# position and column. The constants below are the algorithm's; they are module globals
# so that a test can break one and see its reference check fail.

_MASK32 = 0xFFFFFFFF
_C1, _C2 = 0xCC9E2D51, 0x1B873593
_R1, _R2 = 15, 13
_M, _N = 5, 0xE6546B64
_F1, _F2 = 0x85EBCA6B, 0xC2B2AE35
_MESSAGE_BYTES = 16


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for int64 ``a`` in [0, 2**32) and a 32-bit constant, with no int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (a * lo + (((a * hi) & 0xFFFF) << 16)) & _MASK32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & _MASK32) | (x >> (32 - r))


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One 32-bit block into the hash state (both int64 in [0, 2**32), broadcast)."""
    k = _mul32(_rotl32(_mul32(k, _C1), _R1), _C2)
    return (_mul32(_rotl32(h ^ k, _R2), _M) + _N) & _MASK32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, _F1)
    h = h ^ (h >> 13)
    h = _mul32(h, _F2)
    return h ^ (h >> 16)


def _low_words(x: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of each entry, as int64 (a C cast to uint32; uint64 read bit for bit)."""
    if x.dtype == torch.uint64:
        x = x.view(torch.int64)
    return x.to(torch.int64) & _MASK32


@_op("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """uint32 (n, m): MurmurHash3_x86_32 of (seed[i] low, seed[i] high, positions[i], col_indices[j]).

    ``seed``: uint64 (n,); ``positions``: int64 or uint64 (n,), its low 32 bits hashed;
    ``col_indices``: int64 (m,), low 32 bits. The dtypes the CPU kernel accepts; anything
    else raises, as the kernel does. Vectorised: the three per-row blocks are mixed once
    per row, the column block over the whole (n, m) grid at once.
    """
    for name, t in (("seed", seed), ("positions", positions), ("col_indices", col_indices)):
        if t.dim() != 1:
            raise RuntimeError(f"murmur_hash32_cpu: {name} must be 1-D, got shape {tuple(t.shape)}")
    if seed.shape[0] != positions.shape[0]:
        raise RuntimeError("murmur_hash32_cpu: seed and positions must have the same length")
    if seed.dtype != torch.uint64:
        raise RuntimeError(f"murmur_hash32_cpu: seed must have dtype torch.uint64, got {seed.dtype}")
    if positions.dtype not in (torch.int64, torch.uint64):
        raise RuntimeError(
            f"murmur_hash32_cpu: positions must have dtype torch.int64 or torch.uint64, got {positions.dtype}"
        )
    if col_indices.dtype != torch.int64:
        raise RuntimeError(f"murmur_hash32_cpu: col_indices must have dtype torch.int64, got {col_indices.dtype}")
    s = seed.view(torch.int64)
    h = torch.zeros_like(s)
    h = _mix(h, s & _MASK32)
    h = _mix(h, (s >> 32) & _MASK32)  # arithmetic shift: the mask keeps the 32 high bits
    h = _mix(h, _low_words(positions))
    grid = _mix(h.unsqueeze(1), _low_words(col_indices).unsqueeze(0))
    return _fmix(grid ^ _MESSAGE_BYTES).to(torch.uint32)


def register(namespace: str = "sgl_kernel", log: Callable[[str], None] | None = None) -> torch.library.Library:
    """Define every op in ``torch.ops.<namespace>`` with its CPU implementation; returns the Library.

    Each op logs its first call through ``log`` (default: a line on stderr).
    """
    say = log if log is not None else (lambda m: print(m, file=sys.stderr, flush=True))
    lib = torch.library.Library(namespace, "DEF")
    for name, (schema, fn) in OPS.items():
        lib.define(schema)
        lib.impl(name, _counted(name, fn, say), "CPU")
    return lib


def _counted(name: str, fn: Callable[..., Any], say: Callable[[str], None]) -> Callable[..., Any]:
    # Opaque to torch.compile, as a compiled kernel is: SGLang compiles some callers
    # (sampler.multinomial_with_seed calls murmur_hash32_cpu), and dynamo would otherwise
    # trace this wrapper and recompile it on every call (its guards read CALLS).
    @torch.compiler.disable
    def call(*args: Any) -> Any:
        n = CALLS.get(name, 0) + 1
        CALLS[name] = n
        if n == 1:
            say(f"[sgl_kernel stand-in] first call: {name}")
        return fn(*args)

    call.__name__ = name
    return call
