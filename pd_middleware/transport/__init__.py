"""The PD transfer layer: msgpack/ZMQ control plane, Mooncake data plane.

This package only re-exports; see ``docs/transport.md`` for the message flow.
"""

from __future__ import annotations

from .config import LimitsConfig, MooncakeConfig, SlotsConfig, TransportConfig
from .mooncake import MooncakeEngine, open_engine
from .receiver import DecodeReceiver, open_receiver
from .sender import PrefillSender, open_sender
from .wire import WIRE_VERSION

__all__ = [
    "WIRE_VERSION",
    "DecodeReceiver",
    "LimitsConfig",
    "MooncakeConfig",
    "MooncakeEngine",
    "PrefillSender",
    "SlotsConfig",
    "TransportConfig",
    "open_engine",
    "open_receiver",
    "open_sender",
]
