"""pd-middleware-full: the full-distribution proposal pair, as its own distribution.

``full`` (encoder) sends each step's whole row in fp32, bf16 or fp16 and draws X from
exactly the dequantised, renormalised row it sends; ``full_distribution``
(synthesizer) validates that row and hands it to the assembler. The core finds both
through the ``pd_middleware.plugins`` entry-point group only.
"""
