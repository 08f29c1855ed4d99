"""pd-middleware: decode-side proposal middleware for PD-disaggregated speculative decoding.

This module only re-exports; each concept lives in its own module.
"""

from __future__ import annotations

from .core._errors import (
    ConfigError,
    ConfigIssue,
    ExactnessError,
    IntegrityError,
    NoSlotError,
    OptionValueError,
    PDMiddlewareError,
    PluginError,
    TransferAbandoned,
    TransferError,
    ValidationError,
    WireError,
)
from .core.contracts import (
    EncodedBatch,
    NoOptions,
    PluginContext,
    PluginSpec,
    ProposalEncoder,
    ReceiveContext,
    ReceiveHook,
    Synthesizer,
)
from .core.draft_head import DraftHead
from .core.metrics import Metrics
from .core.payload import DenseEncoding, Payload, Provenance, SparseEncoding
from .core.proposal import DenseProposal, OneHotProposal, Proposal, RecomputedProposal, SparseProposal

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "ConfigIssue",
    "DenseEncoding",
    "DenseProposal",
    "DraftHead",
    "EncodedBatch",
    "ExactnessError",
    "IntegrityError",
    "Metrics",
    "NoOptions",
    "NoSlotError",
    "OneHotProposal",
    "OptionValueError",
    "PDMiddlewareError",
    "Payload",
    "PluginContext",
    "PluginError",
    "PluginSpec",
    "Proposal",
    "ProposalEncoder",
    "Provenance",
    "ReceiveContext",
    "ReceiveHook",
    "RecomputedProposal",
    "SparseEncoding",
    "SparseProposal",
    "Synthesizer",
    "TransferAbandoned",
    "TransferError",
    "ValidationError",
    "WireError",
    "__version__",
]
