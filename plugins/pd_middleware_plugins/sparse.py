"""The ``sparse`` pair: truncated proposals, optionally with a uniform floor.

Prefill (encoder ``sparse``) keeps L entries per step, chosen by ``mode``:

- ``topk``: the k largest;
- ``topp``: the smallest prefix of the sorted row holding mass >= 1 - epsilon, capped
  at ``k_max``;
- ``tv``: the smallest prefix whose *encoded* law (listed entries plus the uniform
  floor) lies within total variation ``epsilon`` of q, capped at ``k_max``. Without a
  floor this is exactly ``topp``; with one it lists fewer tokens where the floor
  already covers the tail well (peaked rows) and more where it does not.

It sends the token ids as int32 (4 B each, default) or, with ``index_format = "u16"``,
sorted by id within each step as their low 16 bits (2 B each) plus per-step counts of
the 65536-token blocks they fall in (a few header bytes per step); the law is the same
either way. Values are fp16 or fp32. Without a floor the values are
renormalised to sum to 1; with ``floor = true`` they are q itself and the dropped mass
travels as ``tail_mass``, spread uniformly over the unlisted tokens. Either way the
prefill then draws X from :func:`pd_middleware.sampling.encodings.sparse_law_tensor` of what it
sends, the same function the decode uses, so the pair is exact by construction.

Decode (synthesizer ``sparse``) validates the encoding with
:func:`pd_middleware.sampling.encodings.sparse_law` (width, finiteness, signs, sums, index
range and uniqueness) and returns a :class:`~pd_middleware.SparseProposal`, which the
assembler scatters: cost grows with the number of entries, not with V, except that a
step with a positive floor needs one whole-row fill (its content is a whole row).
"""

from __future__ import annotations

from typing import Literal

import msgspec
import torch

from pd_middleware import (
    DenseEncoding,
    EncodedBatch,
    OptionValueError,
    PluginContext,
    PluginSpec,
    Provenance,
    SparseEncoding,
    SparseProposal,
    ValidationError,
)
from pd_middleware.core.payload import u16_buckets
from pd_middleware.decode.guard import GuardedSynthesizer
from pd_middleware.sampling.encodings import encoder_input, sample_sparse_law, sparse_law, torch_dtype

SPARSE_ENCODINGS: tuple[str, ...] = ("sparse-fp16", "sparse-fp32")


class SparseEncoderOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Options of the ``sparse`` encoder (``[encoder.options]``)."""

    # How entries are chosen per step: "topk" (k largest), "topp" (smallest prefix
    # with mass >= 1 - epsilon, at most k_max) or "tv" (smallest prefix whose floored
    # law is within TV epsilon of q, at most k_max; needs floor = true).
    mode: Literal["topk", "topp", "tv"] = "topk"
    # topk: entries per step (clamped to V).
    k: int = 64
    # topp: dropped mass allowed; tv: total-variation budget. In [0, 1).
    epsilon: float = 0.02
    # topp/tv: cap on entries per step (clamped to V); bounds the bytes per request.
    k_max: int = 2048
    # Wire dtype of the values: "fp16" (2 bytes) or "fp32" (4 bytes).
    value_dtype: Literal["fp16", "fp32"] = "fp16"
    # Wire format of the token ids: "int32" (4 bytes each; the default, which every
    # decode reads) or "u16" (2 bytes each: entries sorted by id per step, low 16 bits
    # plus per-step counts of the 65536-token blocks). Same law, same encoding id;
    # "u16" needs a decode that knows the format (older ones reject it, naming the field).
    index_format: Literal["int32", "u16"] = "int32"
    # Spend the dropped mass as a uniform floor over the unlisted tokens (part of the
    # law X is drawn from, so still exact); false renormalises the kept entries.
    floor: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.k <= 1 << 24:
            raise OptionValueError("k", f"must be in [1, 16777216], got {self.k}")
        if not 1 <= self.k_max <= 1 << 24:
            raise OptionValueError("k_max", f"must be in [1, 16777216], got {self.k_max}")
        if not 0.0 <= self.epsilon < 1.0:
            raise OptionValueError("epsilon", f"must be in [0, 1), got {self.epsilon}")
        if self.mode == "tv" and not self.floor:
            raise OptionValueError("mode", "'tv' needs floor = true (without a floor it is 'topp')")


def _floored_tv(sorted_desc: torch.Tensor, k_max: int) -> torch.Tensor:
    """TV(q, floored top-L law) for L = 1..k_max, per row.

    ``sorted_desc``: float64 (N, V) rows of q sorted descending, each summing to 1.
    With f = tail mass / (V - L), TV = sum over the tail of max(q_r - f, 0); the tail
    entries above f are a prefix of the sorted tail, found by ``searchsorted``.
    Returns float64 (N, k_max).
    """
    n, v = sorted_desc.shape
    cs = torch.cat([sorted_desc.new_zeros(n, 1), sorted_desc.cumsum(dim=1)], dim=1)
    ls = torch.arange(1, k_max + 1, device=sorted_desc.device).expand(n, -1)
    tail = (cs[:, -1:] - cs.gather(1, ls)).clamp_min(0.0)
    f = tail / (v - ls).clamp_min(1)
    m = torch.searchsorted(-sorted_desc.contiguous(), -f.contiguous(), right=True)
    m = torch.maximum(m, ls)
    tv = (cs.gather(1, m) - cs.gather(1, ls)) - (m - ls) * f
    return torch.where(ls >= v, torch.zeros_like(tv), tv.clamp_min(0.0))


def _sort_by_id(
    vals: torch.Tensor, idx: torch.Tensor, lengths: torch.Tensor, v: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reorder each row's listed entries by token id, ascending, for the u16 format.

    ``vals`` float64 (N, K), ``idx`` int64 (N, K), ``lengths`` int64 (N,): row i lists
    its first ``lengths[i]`` candidates. Returns (vals, idx) with each row's listed
    entries first, ascending by id (candidates past the length pushed behind them), and
    the per-row bucket counts int64 (N, ceil(V / 65536)).
    """
    n, k = idx.shape
    listed = torch.arange(k).view(1, k) < lengths.view(n, 1)
    # Unlisted candidates sort after every id (ids < V).
    order = torch.where(listed, idx, idx + v).argsort(dim=1)
    idx = idx.gather(1, order)
    vals = vals.gather(1, order)
    blocks = torch.where(listed, idx >> 16, torch.zeros_like(idx))
    counts = torch.zeros(n, u16_buckets(v), dtype=torch.int64).scatter_add_(1, blocks, listed.to(torch.int64))
    return vals, idx, counts


class SparseEncoder:
    """Prefill side of the sparse pair; see the module docstring."""

    def __init__(self, options: SparseEncoderOptions, context: PluginContext) -> None:
        self.options = options
        self.vocab_size = context.vocab_size
        self.encoding_id = f"sparse-{options.value_dtype}"

    def select(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Choose the listed entries of each row.

        ``rows``: float (N, V) probabilities. Returns (values float64 (N, K) normalised
        by the row total, indices int64 (N, K), lengths int64 (N,)): row i lists the
        first ``lengths[i]`` of its K candidates, largest first.
        """
        o = self.options
        n, v = rows.shape
        total = rows.float().sum(dim=1, keepdim=True).double()
        if o.mode == "topk":
            k = min(o.k, v)
            vals, idx = rows.topk(k, dim=1)
            return vals.double() / total, idx, torch.full((n,), k, dtype=torch.int64, device=rows.device)
        k = min(o.k_max, v)
        if o.mode == "topp":
            vals, idx = rows.topk(k, dim=1)
            vals = vals.double() / total
            short = (vals.cumsum(dim=1) < 1.0 - o.epsilon).sum(dim=1)
            return vals, idx, (short + 1).clamp_max(k)
        vals, idx = rows.sort(dim=1, descending=True)
        vals = vals.double() / total
        ok = _floored_tv(vals, k) <= o.epsilon
        # First L meeting the budget (argmax finds the first True); k_max when none does.
        first = ok.to(torch.int8).argmax(dim=1) + 1
        lengths = torch.where(ok.any(dim=1), first, torch.full_like(first, k))
        return vals[:, :k], idx[:, :k], lengths

    def encode(
        self,
        probs: torch.Tensor,
        *,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        uniforms: torch.Tensor | None = None,
    ) -> EncodedBatch:
        """``probs``: float (B, [S,] V) after temperature. Returns X int64 (B, S), q'(X)
        float32 (B, S) and one :class:`SparseEncoding` per request. The entries are
        chosen where ``probs`` lives; only the listed ones are copied to the host."""
        rows3 = encoder_input(probs)
        b, s, v = rows3.shape
        if v != self.vocab_size:
            raise ValidationError(f"width {v} != vocab {self.vocab_size}", field="probs")
        flat = rows3.reshape(b * s, v)
        vals, idx, lengths = (t.cpu() for t in self.select(flat))
        floor = self.options.floor
        vdt = torch_dtype(self.options.value_dtype)
        u16 = self.options.index_format == "u16"
        if u16:
            vals, idx, counts = _sort_by_id(vals, idx, lengths, v)
            count_list = counts.tolist()
        len_list = lengths.tolist()
        proposals: list[DenseEncoding | SparseEncoding | None] = []  # EncodedBatch.proposals' type
        laws: list[SparseProposal] = []
        for i in range(b):
            ls = tuple(len_list[i * s : (i + 1) * s])
            kept_v = [vals[i * s + j, :n] for j, n in enumerate(ls)]
            kept_i = [idx[i * s + j, :n] for j, n in enumerate(ls)]
            if floor:
                # The top entry holds >= 1/V, so the tail stays below 1.
                tails = tuple(0.0 if n == v else max(1.0 - float(kv.sum()), 0.0) for kv, n in zip(kept_v, ls))
                out_v = torch.cat(kept_v)
            else:
                tails = ()
                out_v = torch.cat([kv / kv.sum() for kv in kept_v])
            ids = torch.cat(kept_i)
            if u16:
                enc = SparseEncoding(
                    lengths=ls,
                    indices=(ids & 0xFFFF).to(torch.uint16).numpy().tobytes(),
                    values=out_v.to(vdt).numpy().tobytes(),
                    value_dtype=self.options.value_dtype,
                    tail_mass=tails,
                    index_format="u16",
                    bucket_counts=tuple(c for row in count_list[i * s : (i + 1) * s] for c in row),
                )
            else:
                enc = SparseEncoding(
                    lengths=ls,
                    indices=ids.to(torch.int32).numpy().tobytes(),
                    values=out_v.to(vdt).numpy().tobytes(),
                    value_dtype=self.options.value_dtype,
                    tail_mass=tails,
                )
            proposals.append(enc)
            # The decode's own function: X is drawn from exactly what it will rebuild.
            laws.append(sparse_law(enc, s, v))
        tokens, token_probs = sample_sparse_law(laws, v, generator, uniforms)
        return EncodedBatch(
            tokens=tokens.view(b, s),
            token_probs=token_probs.view(b, s),
            proposals=proposals,
            provenance=Provenance(rule="sampled", temperature=temperature, sampled_from=self.encoding_id),
        )


class SparseSynthesizer(GuardedSynthesizer):
    """Decode side of the sparse pair: validated :class:`SparseProposal` or one-hot fallback.

    Everything but the law is :class:`~pd_middleware.decode.guard.GuardedSynthesizer`: fit
    checks, the provenance guard, the support check and the one-hot fallbacks.
    """

    name = "sparse"
    accepts = SPARSE_ENCODINGS
    decode_law = staticmethod(sparse_law)


ENCODER = PluginSpec(
    name="sparse",
    kind="encoder",
    factory=SparseEncoder,
    options=SparseEncoderOptions,
    summary="prefill: top-k / top-p / TV-budget truncation (+ optional uniform floor), X drawn from what is sent",
)

SYNTHESIZER = PluginSpec(
    name="sparse",
    kind="synthesizer",
    factory=SparseSynthesizer,
    summary="decode: validated sparse proposal (scatter; cost grows with entries, not V), one-hot fallback",
)
