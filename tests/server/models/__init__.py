"""Tiny models for the real-server tier, in the formats SGLang 0.5.23 loads (README.md here).

``build_models(out_dir)`` returns the model directories by name; ``train.py`` remakes the
shipped trained weights under ``trained/``.
"""

from __future__ import annotations

from .build import MODEL_NAMES, build_models, default_build_dir, token_map_path

__all__ = ["MODEL_NAMES", "build_models", "default_build_dir", "token_map_path"]
