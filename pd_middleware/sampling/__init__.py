"""Sampling: the laws the wire encodings stand for and the draws from them.

``encodings`` (the law of every wire encoding, shared by prefill and decode),
``sparse_law`` (the sparse law, vectorised) and ``draws`` (the counter-based per-request
uniforms, the one categorical sampler and the one per-request digest). Imports the core only.
"""
