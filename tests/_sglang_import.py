"""Import SGLang modules on a CPU-only machine, for tests marked ``sglang``.

The one stand-in this tier allows is torchvision's. Why: importing SGLang's scheduler
modules imports every model config, and two of them import torchvision at module level.
Every reachable torchvision wheel links to the CUDA libraries and fails to import on CPU
torch, and installing one would pull a CUDA torch. Nothing on the paths these tests
call uses torchvision; the stand-in only answers imports. (Shared from here by every
SGLang test, through conftest's ``sglang_importable`` fixture or ``import_sglang``.)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from pathlib import Path
from typing import Any


def install_torchvision_stand_in() -> None:
    """Answer ``import torchvision...`` with inert modules (only if torchvision is absent).

    With the server tier's torchvision installed (requirements-server.txt), its CUDA-linked
    ops do not load on CPU torch: the server harness's override of that gap (skip
    ``_meta_registrations``, tests/server/site/cpu_gaps.py) serves this process too.
    """
    if "torchvision" in sys.modules:
        return
    if importlib.util.find_spec("torchvision") is not None:
        site = str(Path(__file__).resolve().parent / "server" / "site")
        if site not in sys.path:
            sys.path.insert(0, site)
        import cpu_gaps

        cpu_gaps.install_from_env({cpu_gaps.ENV_GAPS: "torchvision_meta"})
        return

    class Meta(type):
        def __getattr__(cls, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return Meta(name, (), {"__init__": lambda self, *a, **k: None, "__call__": _call})

        def __or__(cls, other):
            return cls

        __ror__ = __or__

        def __getitem__(cls, item):
            return cls

    def _call(self, *a, **k):
        return a[0] if len(a) == 1 and callable(a[0]) and not k else self

    class Mod(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            obj = Meta(name, (), {"__init__": lambda self, *a, **k: None, "__call__": _call})
            setattr(self, name, obj)
            return obj

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path, target=None):
            if fullname.split(".")[0] == "torchvision":
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            return Mod(spec.name)

        def exec_module(self, module):
            module.__path__ = []
            module.__version__ = "0.0.0+stand-in"

    sys.meta_path.insert(0, Finder())


def import_sglang(name: str) -> Any:
    """Import an SGLang module (with the torchvision stand-in; SGLang's import warnings muted)."""
    install_torchvision_stand_in()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def tiny_llama_config(vocab: int, hidden: int, **extra: Any) -> Any:
    """The tests' one-layer Llama config for SGLang's draft models (4 heads, 2 KV heads)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        **extra,
    )
