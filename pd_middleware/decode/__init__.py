"""The decode's receive path: hooks, one synthesizer per arm, the guard and the assembler.

``pipeline`` (``ReceivePipeline``), ``guard`` (the provenance policy), ``assembler`` (the
verifier's FP32 batch tensor) and ``recompute`` (the synthesizer that redraws the first
draft token from the decode's own draft head). Imports the core and sampling.
"""
