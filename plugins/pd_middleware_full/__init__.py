"""The full-distribution proposal pair, shipped in the pd-middleware distribution.

``full`` (encoder) sends each step's whole row in fp32, bf16 or fp16 and draws X from
exactly the dequantised, renormalised row it sends; ``full_distribution``
(synthesizer) validates that row and hands it to the assembler. It ships in the core's
wheel, so one ``pip install pd-middleware`` runs the main job with all its arms, yet the
core still finds both only through the ``pd_middleware.plugins`` entry-point group (a
separately packaged third-party plugin: examples/pd-middleware-example-plugin).
"""
