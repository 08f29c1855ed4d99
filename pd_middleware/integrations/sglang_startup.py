"""What the SGLang drop-in checks when a scheduler starts, before SGLang allocates anything.

:class:`EngineFacts` is everything the drop-in needs to know about the running engine,
read once from the scheduler (:func:`facts_from_scheduler`: SGLang's runtime context
and the scheduler's model config) or built by hand in a harness that runs SGLang's
transfer classes without a scheduler. :func:`check` compares them with the config and
raises :class:`~pd_middleware.ConfigError` naming the flag or key to change, so a
misconfigured node stops at startup instead of failing on its first batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .._errors import ConfigError

#: SGLang speculative algorithms whose PD first draft input goes through
#: ``build_eagle_disagg_draft_input`` (EAGLE family; NEXTN is SGLang's alias for MTP).
EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """The engine as the drop-in sees it.

    ``role``: ``--disaggregation-mode`` (``prefill``, ``decode`` or ``null``);
    ``vocab_size``: the target model's V; ``num_steps``: draft tokens per request in
    the PD metadata (1 single-layer EAGLE, ``--speculative-num-steps`` multi-layer);
    ``algorithm``: ``--speculative-algorithm`` (None: off); ``topk``:
    ``--speculative-eagle-topk``; ``rejection_sampling``:
    ``--speculative-use-rejection-sampling``; ``backend``:
    ``--disaggregation-transfer-backend``; ``tp_rank``: this scheduler's TP rank.
    """

    role: Literal["prefill", "decode", "null"]
    vocab_size: int
    num_steps: int
    algorithm: str | None
    topk: int
    rejection_sampling: bool
    backend: str = "mooncake"
    tp_rank: int = 0


def facts_from_scheduler(scheduler: Any) -> EngineFacts:
    """Read :class:`EngineFacts` from a starting SGLang ``Scheduler`` (runtime context + model config)."""
    from sglang.srt.runtime_context import get_disagg, get_parallel, get_spec

    spec, disagg = get_spec(), get_disagg()
    multi = bool(getattr(spec, "enable_multi_layer_eagle", False))
    steps = int(spec.speculative_num_steps or 1) if multi else 1
    mode = disagg.disaggregation_mode
    return EngineFacts(
        role=str(getattr(mode, "value", mode)),  # type: ignore[arg-type]  # checked by check()
        vocab_size=int(scheduler.model_config.vocab_size),
        num_steps=steps,
        algorithm=spec.speculative_algorithm,
        topk=int(spec.speculative_eagle_topk or 1),
        rejection_sampling=bool(spec.speculative_use_rejection_sampling),
        backend=str(disagg.disaggregation_transfer_backend),
        tp_rank=int(get_parallel().tp_rank),
    )


def check(config: Any, facts: EngineFacts, channel: str) -> None:
    """Raise ConfigError unless ``config`` and ``channel`` can serve this engine.

    Checks: a PD role; an EAGLE-family algorithm with top-k 1; rejection sampling on
    in SGLang and in the config; V and S equal to any the config declares; the
    metadata channel on the Mooncake backend; the side channel at TP rank 0 only
    (its single receiver/publisher would not see other ranks' requests).
    """
    if facts.role not in ("prefill", "decode"):
        raise ConfigError(
            f"PD_MIDDLEWARE_CONFIG is set but this server runs --disaggregation-mode {facts.role}; "
            "the drop-in serves PD prefill and decode nodes only (unset it here)"
        )
    if facts.algorithm not in EAGLE_ALGORITHMS:
        raise ConfigError(
            f"--speculative-algorithm is {facts.algorithm}; the drop-in serves {'/'.join(EAGLE_ALGORITHMS)} "
            "(the PD first draft input of build_eagle_disagg_draft_input)"
        )
    if facts.topk != 1:
        raise ConfigError(f"--speculative-eagle-topk is {facts.topk}; rejection-sampling PD proposals need top-k 1")
    if not facts.rejection_sampling:
        raise ConfigError(
            "SGLang runs without --speculative-use-rejection-sampling: no draft_probs is ever built, "
            "so the middleware would do nothing; add the flag on both nodes or unset PD_MIDDLEWARE_CONFIG"
        )
    if not config.decode.rejection_sampling:
        raise ConfigError(
            "SGLang runs with --speculative-use-rejection-sampling but the config turns it off",
            path="decode.rejection_sampling",
        )
    config.model.with_shapes(facts.vocab_size, facts.num_steps, engine="SGLang")
    if channel == "metadata" and facts.backend != "mooncake":
        raise ConfigError(
            f'[sglang].channel = "metadata" is verified on the mooncake transfer backend only, this server runs '
            f'--disaggregation-transfer-backend {facts.backend}; use channel = "sidechannel"',
            path="sglang.channel",
        )
    if channel == "sidechannel" and facts.tp_rank != 0 and not _one_hot(config):
        raise ConfigError(
            f'[sglang].channel = "sidechannel" publishes through one receiver per node (TP rank 0); TP rank '
            f'{facts.tp_rank} would not see the payloads: use channel = "metadata" with TP > 1',
            path="sglang.channel",
        )


def _one_hot(config: Any) -> bool:
    names = {config.synthesizer.name, *(a.synthesizer.name for a in config.arms)}
    return names == {"one_hot"}
