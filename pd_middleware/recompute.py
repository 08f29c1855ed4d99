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

Sampler semantics (an engine may inject its own draw; the SGLang drop-in injects
SGLang's seeded ``fast_sample``, the exponential race argmax q'/E, E ~ Exp(1)):

- the default, :func:`inverse_cdf`, draws X' ~ q' with one uniform a request against the
  row's running sum (:func:`exponential_race` is the fast_sample-style alternative, V
  random numbers a request);
- seeded per request by its sampling seed and position; without a seed, the engine
  derives one from the request's room (:func:`seed_from_room`), so every TP rank draws
  the same X';
- a greedy request (SGLang: ``top_k == 1``) proposes its argmax.

Fallbacks to one-hot at the prefill's X (always exact), counted by reason
(:data:`REASONS`): ``no_hidden``, ``unknown_head``, ``shape`` (vocab or hidden size),
``multi_layer`` (steps 1..S-1 were drawn on the prefill given X, so they cannot be kept
once X changes), ``rejection_off`` (no proposal is used at all: nothing attached),
``invalid_row`` (q' not finite, or q'(X') not in (0, 1]).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._errors import ExactnessError
from .contracts import NoOptions, PluginContext, PluginSpec
from .draft_head import DRAFT_HEAD, DraftHead
from .proposal import OneHotProposal, RecomputedProposal

if TYPE_CHECKING:
    import torch

    from .metrics import Metrics
    from .payload import Payload

logger = logging.getLogger("pd_middleware.recompute")

#: Fallback reasons, as counted (``Metrics.fallbacks``: ``recompute:<reason>``).
REASONS: tuple[str, ...] = ("no_hidden", "unknown_head", "shape", "multi_layer", "rejection_off", "invalid_row")

#: A sampler: (probs (B, V), seeds int64 (B,), positions int64 (B,)) -> (q'(X') (B, 1), X' int64 (B, 1)).
Draw = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor"], tuple["torch.Tensor", "torch.Tensor"]]

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seed_from_room(rooms: Sequence[int]) -> torch.Tensor:
    """int64 (B,) sampling seeds derived from each request's room (or any integer id).

    Deterministic and the same on every rank, so ranks that hold the same batch draw the
    same X' without a sampling seed; non-negative (63 bits), as SGLang's seeds are.
    """
    import torch

    return torch.tensor([_mix64(int(r) & _MASK64) >> 1 for r in rooms], dtype=torch.int64)


def proposal_probs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """q' = softmax(logits / T) in fp32, per row: SGLang's ``sampling_softmax`` semantics.

    ``logits``: float32 (B, V); ``temperatures``: (B,) or (B, 1), > 0 (SGLang rewrites a
    greedy request's T = 0 to 1 with top_k = 1).
    """
    import torch

    t = temperatures.reshape(-1, 1).to(device=logits.device, dtype=torch.float32)
    return torch.softmax(logits.float() / t, dim=-1)


def exponential_race(
    probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """X ~ probs by the exponential race (argmax probs / E, E ~ Exp(1), in float64), one
    generator per row seeded by (seed, position): a loop over requests, never the vocab.

    Returns (q(X) (B, 1), X int64 (B, 1)), like SGLang's ``fast_sample``.
    """
    import torch

    b, v = probs.shape
    e = torch.empty(b, v, dtype=torch.float64, device=probs.device)
    gen = torch.Generator(device=probs.device)
    for i, (s, p) in enumerate(zip(seeds.tolist(), positions.tolist())):
        gen.manual_seed(_mix64((int(s) & _MASK64) ^ _mix64(int(p) & _MASK64)) >> 1)
        e[i].exponential_(1.0, generator=gen)
    e.clamp_min_(torch.finfo(torch.float64).tiny)
    x = (probs.double() / e).argmax(dim=-1, keepdim=True)
    return probs.gather(1, x), x


def inverse_cdf(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """X ~ probs by inversion: one uniform per row, from a generator seeded by (seed,
    position), against the float64 running sum of the row (a zero-probability token is
    never the first entry past the uniform). One random number a request instead of V:
    the cheap seeded draw where SGLang's seeded ``fast_sample`` is unavailable.

    Returns (q(X) (B, 1), X int64 (B, 1)), like SGLang's ``fast_sample``.
    """
    import torch

    b, v = probs.shape
    u = torch.empty(b, dtype=torch.float64)
    gen = torch.Generator()
    for i, (s, p) in enumerate(zip(seeds.tolist(), positions.tolist())):
        gen.manual_seed(_mix64((int(s) & _MASK64) ^ _mix64(int(p) & _MASK64)) >> 1)
        u[i] = torch.rand((), generator=gen, dtype=torch.float64)
    c = probs.double().cumsum(dim=-1)
    t = (u.to(probs.device) * c[:, -1]).unsqueeze(1)
    x = torch.searchsorted(c, t, right=True).clamp_max_(v - 1)
    return probs.gather(1, x), x


class Fallbacks:
    """Fallbacks of the recompute path by reason (``counts``), also into
    ``Metrics.fallbacks`` as ``recompute:<reason>`` once :meth:`attach_metrics` ran;
    logged once per reason."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.metrics: Metrics | None = None
        self._logged: set[str] = set()

    def attach_metrics(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def count(self, reason: str, n: int = 1) -> None:
        self.counts[reason] += n
        if self.metrics is not None:
            self.metrics.fallbacks[f"recompute:{reason}"] += n
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning("recompute falls back to one-hot (%s); further fallbacks are counted, not logged", reason)


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
    ``greedy``: bool (B,) or None. q'(X') is read back from ``probs`` after the draw,
    never taken from the sampler, so the pair handed over is always (X', q'(X')) of the
    q' kept.
    """
    import torch

    _, x = draw(probs, seeds, positions)
    tokens = x.reshape(-1).to(torch.int64)
    if greedy is not None and bool(greedy.any()):
        tokens = torch.where(greedy.to(probs.device), probs.argmax(dim=-1), tokens)
    token_probs = probs.gather(1, tokens.view(-1, 1)).view(-1)
    # A non-finite logit makes its whole softmax row NaN, and NaN fails both comparisons:
    # no V-wide isfinite pass is needed.
    valid = (token_probs > 0) & (token_probs <= 1)
    return Recomputed(_MINT, probs, tokens, token_probs, valid)


class RecomputeSynthesizer:
    """Decode side: recompute q' from the shipped hidden state and redraw X' from it.

    Needs the ``draft_head`` capability (:class:`~pd_middleware.draft_head.DraftHead`).
    Engines call :meth:`recompute` once per batch (the SGLang drop-in, from the batch's
    fields); :meth:`synthesize` is the per-payload form the receive pipeline runs (the
    ``pd-middleware ab`` job), a batch of one, seeded from the request id.
    ``unusable`` says, once per batch, whether the deployment allows it at all.
    """

    name = "recompute"

    def __init__(self, options: NoOptions, context: PluginContext, *, draw: Draw = inverse_cdf) -> None:
        head = context.capabilities.get(DRAFT_HEAD)
        self.head: DraftHead | None = head if isinstance(head, DraftHead) else None
        self.vocab_size = context.vocab_size
        self.num_steps = context.num_steps
        self.enabled = context.rejection_sampling
        self.draw = draw
        # Counts (and logs once) every fallback by reason; DecodeMiddleware attaches its
        # Metrics here, as it does to the shipped-law synthesizers' provenance guard.
        self.guard = Fallbacks()
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
        """Count ``n`` fallbacks for ``reason`` (an engine falling back a whole batch)."""
        self.guard.count(reason, n)

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
        Call only when :meth:`unusable` returned None."""
        assert self.head is not None
        probs = proposal_probs(self.head.logits(hidden), temperatures)
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
            seeds=seed_from_room([_request_key(payload.request_id)]),
            positions=torch.zeros(1, dtype=torch.int64),
            greedy=torch.tensor([greedy]),
        )
        if not bool(out.valid[0]):
            self.count("invalid_row")
            return OneHotProposal(payload.draft_tokens)
        return out.proposal(0)


def _request_key(request_id: str) -> int:
    """A 64-bit integer for a request id: the room itself when it is one, else a hash."""
    if request_id.isdigit():
        return int(request_id)
    import hashlib

    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")


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
