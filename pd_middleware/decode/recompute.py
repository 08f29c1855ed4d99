"""The ``recompute`` synthesizer: the decode recomputes the first proposal itself.

The prefill ships the draft model's hidden state h at each request's last position
(SGLang does, for the decode's own draft steps). The decode holds the same draft model,
so it can compute the proposal itself: q' = softmax(head(h) / T), the semantics of
SGLang's ``renorm_draft_probs`` (``sampling_softmax``). It then **redraws** X' ~ q' and
hands the verifier X', q'(X') and q'. That verify is exact by construction, whatever the
prefill did, and its acceptance is sum(min(p, q')): aggregated serving's, at 0 proposal
bytes and with no middleware on the prefill (``docs/strategies.md``).

Keeping the prefill's X with the recomputed q' would be exact only if q' equalled the
prefill's q bit for bit, which no one can promise across batch shapes, kernels and
precisions (measured: never bit-exact on CPU). So the one way out of this module is
:class:`Recomputed`, which only :func:`draw_proposal` makes: it draws X' from the q' it
keeps, and reads q'(X') back from that same tensor.

Sampler semantics (an engine may offer its own seeded draw, the :data:`SEEDED_DRAW`
capability; the SGLang drop-in offers SGLang's seeded ``fast_sample``, the exponential
race argmax q'/E, E ~ Exp(1), where it runs):

- the default, :func:`inverse_cdf`, draws X' ~ q' with one uniform a request
  (:func:`~pd_middleware.sampling.draws.seeded_uniforms`, the project's one per-request digest)
  inverted against the row's running sum (:func:`~pd_middleware.sampling.draws.sample_categorical`,
  the project's one categorical draw);
- seeded per request by its sampling seed and position; without a seed, the engine
  derives one from the request's room (:func:`seed_from_room`, the same digest), so every
  TP rank draws the same X';
- a greedy request (SGLang: ``top_k == 1``) proposes its argmax.

Memory: q' is the one (B, V) tensor a batch allocates (it is what the verifier reads);
the head's logits, logits / T and the draw's temporaries exist for :data:`CHUNK_ROWS` rows
at a time (:func:`head_probs`, :func:`draw_proposal`). Every step is per row, so the
chunks give the batch's result bit for bit.

Fallbacks to one-hot at the prefill's X (always exact), counted by reason
(:data:`REASONS`): ``no_hidden``, ``unknown_head``, ``shape`` (vocab or hidden size),
``multi_layer`` (steps 1..S-1 were drawn on the prefill given X, so they cannot be kept
once X changes), ``rejection_off`` (no proposal is used at all: nothing attached),
``invalid_row`` (q' not finite, or q'(X') not in (0, 1]).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..core._errors import ExactnessError, ValidationError
from ..core.contracts import NoOptions, PluginContext, PluginSpec
from ..core.draft_head import DRAFT_HEAD, DraftHead
from ..core.events import Events
from ..core.proposal import OneHotProposal, RecomputedProposal

if TYPE_CHECKING:
    import torch

    from ..core.payload import Payload

logger = logging.getLogger("pd_middleware.decode.recompute")

#: Fallback reasons, as counted (``Metrics.fallbacks``: ``recompute:<reason>``).
REASONS: tuple[str, ...] = ("no_hidden", "unknown_head", "shape", "multi_layer", "rejection_off", "invalid_row")

#: Rows of a batch recomputed at once. At V = 152064 one fp32 row is 0.6 MB, so a chunk's
#: temporaries (the head's fp32 logits, logits / T, the draw's float64 running sum on a GPU:
#: 9.7, 9.7 and 19.5 MB) stay near 20-30 MB whatever B is, beside q' itself (B x V fp32,
#: 156 MB at B = 256). Each chunk is one head call: its lm_head reads its weight once a
#: chunk, and under TP > 1 every rank gathers once a chunk (ranks hold the same B, so the
#: same number of times). A constant, not a setting: it bounds memory, it changes no result.
CHUNK_ROWS = 16

#: A sampler: (probs (B, V), seeds int64 (B,), positions int64 (B,)) -> (q'(X') (B, 1), X' int64 (B, 1)).
Draw = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor"], tuple["torch.Tensor", "torch.Tensor"]]

#: The capability under which an engine offers its own seeded sampler (a :data:`Draw`),
#: e.g. SGLang's ``fast_sample``; without it the synthesizer draws with :func:`inverse_cdf`.
SEEDED_DRAW = "seeded_draw"


def seed_from_room(rooms: Sequence[int]) -> torch.Tensor:
    """int64 (B,) sampling seeds derived from each request's room (or any integer id).

    Deterministic and the same on every rank (the project's one per-request digest,
    :func:`~pd_middleware.sampling.draws.room_seed`), so ranks that hold the same batch draw the
    same X' without a sampling seed; non-negative (63 bits), as SGLang's seeds are.
    """
    import torch

    from ..sampling.draws import room_seed

    return torch.tensor([room_seed(0, int(r), "decode-seed") for r in rooms], dtype=torch.int64)


def proposal_probs(logits: torch.Tensor, temperatures: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """q' = softmax(logits / T) in fp32, per row: SGLang's ``sampling_softmax`` semantics.

    ``logits``: float32 (B, V); ``temperatures``: (B,) or (B, 1), > 0 (SGLang rewrites a
    greedy request's T = 0 to 1 with top_k = 1); ``out``: float32 (B, V) to write q' into
    (returned), or None for a new tensor.
    """
    import torch

    t = temperatures.reshape(-1, 1).to(device=logits.device, dtype=torch.float32)
    return torch.softmax(logits.float() / t, dim=-1, out=out)


def head_probs(head: DraftHead, hidden: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """q' = softmax(head(hidden) / T): float32 (B, V), the one (B, V) tensor this allocates,
    filled :data:`CHUNK_ROWS` rows at a time (:func:`proposal_probs` per chunk).

    ``hidden``: (B, H) on the head's device; ``temperatures``: (B,) or (B, 1). **Every
    chunk's head call runs, whatever failed before it**: a head with a collective (SGLang's
    vocab-parallel gather under TP > 1) is entered by every rank once a chunk. The first
    failure of this rank's (a head call, q''s allocation, a softmax) is remembered, the
    later chunks call the head alone, and it is raised after the last call.
    """
    import torch

    b = int(hidden.shape[0])
    t = temperatures.reshape(-1, 1)
    probs: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    failed: BaseException | None = None
    for a in range(0, b, CHUNK_ROWS):
        z = min(a + CHUNK_ROWS, b)
        try:
            logits = head.logits(hidden[a:z])
            if failed is None:
                if probs is None:
                    probs = torch.empty((b, logits.shape[1]), dtype=torch.float32, device=logits.device)
                if tuple(logits.shape) != (z - a, probs.shape[1]):
                    # Checked here: softmax(out=) would resize the chunk's view of q', not refuse.
                    raise ValidationError(
                        f"the draft head's logits for rows {a}:{z} are {tuple(logits.shape)}, "
                        f"q' is {tuple(probs.shape)}",
                        field="logits",
                    )
                proposal_probs(logits, t[a:z], out=probs[a:z])
        except Exception as exc:  # this rank's failure: the later chunks' head calls still run
            if failed is None:
                failed = exc
        logits = None  # freed before the next chunk's head call: never two chunks' at once
    if failed is not None:
        raise failed
    if probs is None:  # an empty batch: no head call at all, on any rank
        probs = torch.empty((0, head.vocab_size), dtype=torch.float32, device=hidden.device)
    return probs


def _seeds_of_id(request_id: str) -> torch.Tensor:
    import torch

    from ..sampling.draws import room_seed

    return torch.tensor([room_seed(0, request_id, "decode-seed")], dtype=torch.int64)


def inverse_cdf(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """X ~ probs by inversion: one uniform a row, the digest of (seed, position)
    (:func:`~pd_middleware.sampling.draws.seeded_uniforms`), against the float64 running sum of the
    row (:func:`~pd_middleware.sampling.draws.sample_categorical`: the first token whose running
    sum exceeds the uniform's share of the row's mass, which always has positive mass).
    One random number a request instead of V: the seeded draw where the engine offers
    none of its own.

    Returns (q(X) (B, 1), X int64 (B, 1)), like SGLang's ``fast_sample``.
    """
    from ..sampling.draws import sample_categorical, seeded_uniforms

    u = seeded_uniforms(seeds, positions).to(probs.device)
    x = sample_categorical(probs, u).view(-1, 1)
    return probs.gather(1, x), x


_MINT = object()


class Recomputed:
    """q' and X' of one batch, X' drawn from exactly q'. Only :func:`draw_proposal` makes one.

    ``probs``: float32 (B, V) q'; ``tokens``: int64 (B,) X'; ``token_probs``: float32
    (B,) q'(X'), gathered from ``probs``; ``valid``: bool (B,), rows that may be handed
    over (0 < q'(X') <= 1, which a NaN row fails). All on the head's device.
    """

    __slots__ = ("probs", "token_probs", "tokens", "valid")

    def __init__(
        self, mint: object, probs: torch.Tensor, tokens: torch.Tensor, token_probs: torch.Tensor, valid: torch.Tensor
    ) -> None:
        if mint is not _MINT:
            raise ExactnessError(
                "a Recomputed proposal is made only by draw_proposal(), which draws X' from the q' it keeps",
                reason="recompute_guard",
            )
        self.probs = probs
        self.tokens = tokens
        self.token_probs = token_probs
        self.valid = valid

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def proposal(self, row: int) -> RecomputedProposal:
        """Row ``row`` as a one-step :class:`RecomputedProposal` (fp32 (1, V), CPU)."""
        import torch

        probs = self.probs[row : row + 1].float().cpu()
        return RecomputedProposal(probs, torch.ones(1, dtype=torch.float32), tokens=(int(self.tokens[row]),))


def draw_proposal(
    probs: torch.Tensor,
    *,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    greedy: torch.Tensor | None = None,
    draw: Draw = inverse_cdf,
) -> Recomputed:
    """Draw X' ~ ``probs`` (greedy rows: argmax) and bind it to ``probs``.

    ``probs``: float32 (B, V) q' on any device; ``seeds``/``positions``: int64 (B,);
    ``greedy``: bool (B,) or None. ``draw`` runs on :data:`CHUNK_ROWS` rows at a time (its
    temporaries, a float64 running sum or the engine's, are a chunk's; its draws are per
    row, seeded by the row's seed and position, so the same as on the whole batch). q'(X')
    is read back from ``probs`` after the draw, never taken from the sampler, so the pair
    handed over is always (X', q'(X')) of the q' kept.
    """
    import torch

    b = int(probs.shape[0])
    tokens = torch.empty(b, dtype=torch.int64, device=probs.device)
    for a in range(0, b, CHUNK_ROWS):
        z = min(a + CHUNK_ROWS, b)
        tokens[a:z] = draw(probs[a:z], seeds[a:z], positions[a:z])[1].reshape(-1)
    if greedy is not None and bool(greedy.any()):
        tokens = torch.where(greedy.to(probs.device), probs.argmax(dim=-1), tokens)
    token_probs = probs.gather(1, tokens.view(-1, 1)).view(-1)
    # A non-finite logit makes its whole softmax row NaN, and NaN fails both comparisons:
    # no V-wide isfinite pass is needed.
    valid = (token_probs > 0) & (token_probs <= 1)
    return Recomputed(_MINT, probs, tokens, token_probs, valid)


class RecomputeSynthesizer:
    """Decode side: recompute q' from the shipped hidden state and redraw X' from it.

    Needs the ``draft_head`` capability (:class:`~pd_middleware.core.draft_head.DraftHead`).
    Engines call :meth:`recompute` once per batch (the SGLang drop-in, from the batch's
    fields); :meth:`synthesize` is the per-payload form the receive pipeline runs (the
    ``pd-middleware ab`` job), a batch of one, seeded from the request id.
    ``unusable`` says, once per batch, whether the deployment allows it at all.
    """

    name = "recompute"

    def __init__(self, options: NoOptions, context: PluginContext, *, draw: Draw | None = None) -> None:
        head = context.capabilities.get(DRAFT_HEAD)
        self.head: DraftHead | None = head if isinstance(head, DraftHead) else None
        self.vocab_size = context.vocab_size
        self.num_steps = context.num_steps
        self.enabled = context.rejection_sampling
        offered = context.capabilities.get(SEEDED_DRAW)
        self.draw: Draw = draw if draw is not None else offered if callable(offered) else inverse_cdf
        # Counts (and logs once) every fallback by reason, mirrored as recompute:<reason>;
        # DecodeMiddleware attaches its Metrics here, as it does to the provenance guard.
        self.guard = Events("recompute", source="recompute", logger=logger)
        self.counts = self.guard.counts

    def unusable(self, *, num_steps: int, vocab_size: int, hidden_size: int | None = None) -> str | None:
        """The batch-wide fallback reason (see :data:`REASONS`), or None when it can recompute."""
        if not self.enabled:
            return "rejection_off"
        if self.head is None:
            return "unknown_head"
        if num_steps != 1:
            return "multi_layer"
        if vocab_size != self.head.vocab_size or (hidden_size is not None and hidden_size != self.head.hidden_size):
            return "shape"
        return None

    def count(self, reason: str, n: int = 1) -> None:
        """Count ``n`` fallbacks for ``reason`` (an engine falling back a whole batch), logged once."""
        self.guard.count(
            reason,
            n,
            fallback=True,
            log=f"recompute falls back to one-hot ({reason}); further fallbacks are counted, not logged",
        )

    def recompute(
        self,
        hidden: torch.Tensor,
        *,
        temperatures: torch.Tensor,
        seeds: torch.Tensor,
        positions: torch.Tensor,
        greedy: torch.Tensor | None = None,
    ) -> Recomputed:
        """q' and X' for a batch: ``hidden`` (B, H) on the head's device; ``temperatures``
        (B,) or (B, 1); ``seeds``/``positions`` int64 (B,); ``greedy`` bool (B,) or None.
        Call only when :meth:`unusable` returned None. The extra memory is q' (B, V) fp32
        and one chunk's temporaries (:func:`head_probs`)."""
        assert self.head is not None
        probs = head_probs(self.head, hidden, temperatures)
        return draw_proposal(probs, seeds=seeds, positions=positions, greedy=greedy, draw=self.draw)

    def synthesize(self, payload: Payload) -> RecomputedProposal | OneHotProposal | None:
        """q' and X' for one payload, or one-hot at its X (counted), or None with rejection
        sampling off. Raises ValidationError naming the bad field."""
        import torch

        payload.check_fits(self.vocab_size, self.num_steps)
        reason = self.unusable(
            num_steps=payload.num_steps, vocab_size=payload.vocab_size, hidden_size=payload.hidden_size or None
        )
        if reason is None and payload.hidden_size == 0:
            reason = "no_hidden"
        if reason == "rejection_off":
            self.count(reason)
            return None
        if reason is not None:
            self.count(reason)
            return OneHotProposal(payload.draft_tokens)
        assert self.head is not None
        dev = getattr(self.head, "device", "cpu")
        hidden = payload.hidden_tensor().to(dev).view(1, -1)
        prov = payload.provenance
        greedy = prov.rule == "greedy"
        out = self.recompute(
            hidden,
            temperatures=torch.tensor([prov.temperature if prov.temperature > 0 else 1.0]),
            # The request id itself: a room's decimal id digests as the room does (seed_from_room).
            seeds=_seeds_of_id(payload.request_id),
            positions=torch.zeros(1, dtype=torch.int64),
            greedy=torch.tensor([greedy]),
        )
        if not bool(out.valid[0]):
            self.count("invalid_row")
            return OneHotProposal(payload.draft_tokens)
        return out.proposal(0)


def _factory(options: Any, context: PluginContext) -> RecomputeSynthesizer:
    return RecomputeSynthesizer(options, context)


SYNTHESIZER = PluginSpec(
    name="recompute",
    kind="synthesizer",
    factory=_factory,
    needs=(DRAFT_HEAD,),
    summary="decode recomputes q' from the shipped hidden state with its own draft head and redraws X' ~ q' "
    "(exact; aggregated acceptance at 0 proposal bytes; needs the engine's draft_head)",
)
