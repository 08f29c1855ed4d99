"""The core: what every other part stands on, and what plugins see.

The error root and its families (``_errors``), raw wire buffers as tensors (``_buffers``),
the payload a prefill sends (``payload``), the proposal descriptors a synthesizer returns
(``proposal``), the plugin protocols (``contracts``), the ``draft_head`` capability
(``draft_head``), the decode's counters (``metrics``) and one part's event counters
(``events``). It imports nothing else of the package.
"""
