"""The server tier: a real SGLang PD pair on this CPU machine (docs/server.md, harness.py) and the tiny models it serves (models/)."""
