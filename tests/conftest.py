
# ---- transport fixtures (owner: transport helper; append other sections, do not rewrite) ----
import os as _transport_os

import pytest as _transport_pytest


@_transport_pytest.fixture(scope="session")
def mooncake_pair():
    """Two real Mooncake engines (TCP, loopback) shared by the session: (decode, prefill)."""
    _transport_os.environ.setdefault("MC_FORCE_TCP", "1")
    _transport_os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    from pd_middleware.transport import MooncakeEngine

    decode, prefill = MooncakeEngine.open(), MooncakeEngine.open()
    yield decode, prefill
    decode.close()
    prefill.close()


# ---- end transport fixtures ----


# ---- sglang fixtures (owner: sglang helper) ----
import importlib as _sg_importlib
import importlib.util as _sg_importlib_util
import sys as _sg_sys
import types as _sg_types
import warnings as _sg_warnings


def _sg_install_torchvision_stand_in() -> None:
    """Answer ``import torchvision`` with an inert module tree.

    Why: importing SGLang's eagle_disaggregation (and the disaggregation modules) imports
    every model config, and two of them import torchvision at module level. Every
    reachable torchvision wheel links to the CUDA libraries and fails to import on CPU
    torch, and installing one would pull a CUDA torch. Nothing on the paths these tests
    run calls torchvision; the stand-in only answers imports.
    """
    import importlib.abc
    import importlib.machinery

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

    class Mod(_sg_types.ModuleType):
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

    _sg_sys.meta_path.insert(0, Finder())


@_transport_pytest.fixture(scope="session")
def sglang_importable():
    """Make SGLang's speculative and disaggregation modules importable on this CPU tier."""
    if _sg_importlib_util.find_spec("sglang") is None:
        _transport_pytest.skip("SGLang is not installed; run `make setup-sglang` (requirements-sglang.txt)")
    if _sg_importlib_util.find_spec("torchvision") is None and "torchvision" not in _sg_sys.modules:
        _sg_install_torchvision_stand_in()
    with _sg_warnings.catch_warnings():
        _sg_warnings.simplefilter("ignore")
        for name in (
            "sglang.srt.speculative.eagle_disaggregation",
            "sglang.srt.disaggregation.utils",
            "sglang.srt.disaggregation.decode",
            "sglang.srt.disaggregation.mooncake.conn",
        ):
            _sg_importlib.import_module(name)
    return True


# ---- end sglang fixtures ----
