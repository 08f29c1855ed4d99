"""SGLang's real ``build_eagle_disagg_draft_input`` on a namespace batch, for tests marked ``sglang``.

The builder reads SGLang's speculative settings through ``get_spec`` and a handful of
``ScheduleBatch`` fields; outside a scheduler both are stand-ins: :func:`eagle_spec` (EAGLE,
top-k 1, rejection sampling) patched in for ``get_spec``, and :func:`namespace_batch` (the
fields the builder reads, plus whatever a test's path reads too).
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any
from unittest.mock import patch

import torch


def eagle_spec(steps: int = 1, *, multi_layer: bool = False) -> SimpleNamespace:
    """SGLang's speculative settings the builder reads: top-k 1, ``steps`` draft steps,
    rejection sampling, the multi-layer EAGLE flag as given."""
    return SimpleNamespace(
        speculative_eagle_topk=1,
        speculative_num_steps=steps,
        enable_multi_layer_eagle=multi_layer,
        speculative_use_rejection_sampling=True,
    )


def namespace_batch(reqs: list[Any], vocab: int, *, overlap: bool = False, **fields: Any) -> SimpleNamespace:
    """A ``ScheduleBatch`` stand-in over ``reqs`` on CPU (target vocabulary ``vocab``,
    under the overlap scheduler if ``overlap``); ``fields`` adds what else the path under
    test reads."""
    return SimpleNamespace(
        reqs=reqs,
        device="cpu",
        enable_overlap=overlap,
        model_config=SimpleNamespace(vocab_size=vocab, hf_config=SimpleNamespace()),
        **fields,
    )


def build_draft_input(
    builder: ModuleType,
    batch: Any,
    *,
    steps: int = 1,
    multi_layer: bool = False,
    future_map: Any = None,
) -> Any:
    """``builder.build_eagle_disagg_draft_input`` (``builder``: SGLang's
    ``eagle_disaggregation`` module) over ``batch`` under :func:`eagle_spec`, its last
    tokens B zeros (int64); returns the ``EagleDraftInput`` it builds."""
    with patch.object(builder, "get_spec", return_value=eagle_spec(steps, multi_layer=multi_layer)):
        return builder.build_eagle_disagg_draft_input(
            batch, torch.zeros(len(batch.reqs), dtype=torch.int64), future_map
        )
