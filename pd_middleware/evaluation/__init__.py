"""Evaluation: the reference verifier, its exact mode, shared statistics and live A/B.

``verify`` (the chain verifier with SGLang's semantics), ``verify_exact`` (Fractions, for
enumeration), ``stats`` (intervals, chi-square tail, percentiles) and ``live_ab`` (the
report from a decode's metrics). Imports the core and sampling.
"""
