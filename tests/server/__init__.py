"""The real-server tier: SGLang PD servers on CPU, and the tiny models they serve."""
