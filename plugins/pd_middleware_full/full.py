"""The full-distribution pair: ``full`` (prefill encoder) and ``full_distribution`` (decode).

Prefill: each step's row is cast to ``dtype`` (fp32 is the upstream wire format,
608,256 B per step at V = 152064; bf16/fp16 halve it) and sent as is. The law it stands
for is :func:`pd_middleware.sampling.encodings.dense_law`: widen to fp32, renormalise. The
encoder computes that law with the decode's own function on the very bytes it sends,
then draws X from it, so quantisation never biases the verifier.

Decode: ``full_distribution`` checks the provenance (:class:`ProvenanceGuard`), then
validates the row with :func:`~pd_middleware.sampling.encodings.dense_law` (width equals vocab,
finite, non-negative, sum 1 within ``SUM_TOLERANCE``) and returns a
:class:`~pd_middleware.DenseProposal` viewing the received bytes; the assembler copies
it into its buffer (a whole-row write, V values per step).
"""

from __future__ import annotations

from typing import Literal

import msgspec
import torch

from pd_middleware import (
    DenseEncoding,
    EncodedBatch,
    PluginContext,
    PluginSpec,
    Provenance,
    SparseEncoding,
    ValidationError,
)
from pd_middleware.decode.guard import GuardedSynthesizer
from pd_middleware.sampling.encodings import dense_law, dense_law_tensor, encoder_input, sample_law, torch_dtype

DENSE_ENCODINGS: tuple[str, ...] = ("dense-fp32", "dense-bf16", "dense-fp16")


class FullEncoderOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Options of the ``full`` encoder (``[encoder.options]``)."""

    # Wire dtype of each row: "fp32" (4 B/value, upstream), "bf16" or "fp16" (2 B/value).
    # The row is quantised first and X drawn from the dequantised, renormalised row.
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"


def _row_bytes(rows: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a contiguous CPU tensor (bf16 goes through int16)."""
    if rows.dtype == torch.bfloat16:
        rows = rows.view(torch.int16)
    return rows.contiguous().numpy().tobytes()


class FullEncoder:
    """Prefill side: send the whole row in ``options.dtype``; X ~ its canonical law."""

    def __init__(self, options: FullEncoderOptions, context: PluginContext) -> None:
        self.options = options
        self.vocab_size = context.vocab_size
        self.encoding_id = f"dense-{options.dtype}"

    def encode(
        self,
        probs: torch.Tensor,
        *,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        uniforms: torch.Tensor | None = None,
    ) -> EncodedBatch:
        """``probs``: float (B, [S,] V) after temperature. Returns X int64 (B, S), q'(X)
        float32 (B, S) and one :class:`DenseEncoding` per request. The rows it sends are
        copied to the host (this encoder's payload is V-wide)."""
        rows3 = encoder_input(probs)
        b, s, v = rows3.shape
        if v != self.vocab_size:
            raise ValidationError(f"width {v} != vocab {self.vocab_size}", field="probs")
        wire = rows3.to(device="cpu", dtype=torch_dtype(self.options.dtype))
        proposals: list[DenseEncoding | SparseEncoding | None] = []  # EncodedBatch.proposals' type
        laws: list[torch.Tensor] = []
        for i in range(b):
            enc = DenseEncoding(dtype=self.options.dtype, data=_row_bytes(wire[i]))
            proposals.append(enc)
            # The decode's own function on the very bytes sent: X ~ exactly what it rebuilds.
            laws.append(dense_law_tensor(enc, s, v))
        law = torch.cat(laws)
        tokens = sample_law(law, generator, uniforms)
        token_probs = law.gather(1, tokens.view(-1, 1)).view(b, s)
        return EncodedBatch(
            tokens=tokens.view(b, s),
            token_probs=token_probs,
            proposals=proposals,
            provenance=Provenance(rule="sampled", temperature=temperature, sampled_from=self.encoding_id),
        )


class FullDistributionSynthesizer(GuardedSynthesizer):
    """Decode side: validated :class:`DenseProposal` of the received row, or one-hot.

    Everything but the law is :class:`~pd_middleware.decode.guard.GuardedSynthesizer`: fit
    checks, the provenance guard, the support check and the one-hot fallbacks.
    """

    name = "full_distribution"
    accepts = DENSE_ENCODINGS
    decode_law = staticmethod(dense_law)


ENCODER = PluginSpec(
    name="full",
    kind="encoder",
    factory=FullEncoder,
    options=FullEncoderOptions,
    summary="prefill: whole row in fp32/bf16/fp16, X drawn from the dequantised row sent",
)

SYNTHESIZER = PluginSpec(
    name="full_distribution",
    kind="synthesizer",
    factory=FullDistributionSynthesizer,
    summary="decode: validated full-row proposal (copied into the assembler), one-hot fallback",
)
