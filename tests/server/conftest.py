"""Fixtures of the server tier: model directories, the log folder, and running servers.

The model directories come from ``PDM_SERVER_MODELS`` (a folder holding ``target/`` and
``eagle3/``, HF format, SGLang loads them), else from ``tests/server/models/build.py``
(``build_models(out_dir) -> {"target", "eagle3", "eagle1", "trained_target",
"trained_eagle3"}``) when it exists. Without SGLang's server packages
(requirements-server.txt) every ``server`` test is skipped, with the reason.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

SITE = Path(__file__).resolve().parent / "site"
sys.path.insert(0, str(SITE))

if importlib.util.find_spec("torchvision") is not None and "torchvision" not in sys.modules:
    # transformers (the model builder) imports torchvision, whose CUDA-linked ops do not
    # load on CPU torch: the servers' override of that gap serves this process too.
    import cpu_gaps

    cpu_gaps.install_from_env({cpu_gaps.ENV_GAPS: "torchvision_meta"})

SERVER_PACKAGES = ("sglang", "sglang_router", "sgl_kernel", "fastapi", "uvicorn", "mooncake")


def server_packages_missing() -> list[str]:
    return [m for m in SERVER_PACKAGES if importlib.util.find_spec(m) is None]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Servers take minutes: they run only when asked for (`-m server`, make test-server).
    missing = server_packages_missing()
    if missing:
        skip = pytest.mark.skip(reason=f"server packages absent ({', '.join(missing)}): run `make setup-server`")
    elif "server" not in (config.option.markexpr or ""):
        skip = pytest.mark.skip(
            reason="the server tier (starts SGLang servers or needs their packages): run with -m server (make test-server)"
        )
    else:
        return
    for item in items:
        if item.get_closest_marker("server") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def server_models() -> dict[str, Path]:
    """Model directories by role: ``target`` and ``eagle3`` (the trained pair, acceptance neither 0 nor 1)."""
    env = os.environ.get("PDM_SERVER_MODELS")
    if env:
        root = Path(env)
        found = {"target": root / "target", "eagle3": root / "eagle3"}
        if not found["eagle3"].is_dir() and (root / "eagle3-fullvocab").is_dir():
            found["eagle3"] = root / "eagle3-fullvocab"
        for k, p in found.items():
            if not (p / "config.json").is_file():
                pytest.fail(f"PDM_SERVER_MODELS={env}: {k} model not found at {p}")
        return found
    build = Path(__file__).resolve().parent / "models" / "build.py"
    if not build.is_file():
        pytest.skip(
            "no models: set PDM_SERVER_MODELS to a folder with target/ and eagle3/, or add tests/server/models/build.py"
        )
    import importlib

    # A package import: build.py imports its siblings relatively.
    mod = importlib.import_module(f"{__package__}.models.build")
    # The build folder keeps them between sessions (the script reuses a finished build).
    built = {k: Path(v) for k, v in mod.build_models(SITE.parents[2] / "build" / "server-models").items()}
    # The acceptance tests need the trained pair: "target"/"eagle3" name it here.
    return {**built, "target": built["trained_target"], "eagle3": built["trained_eagle3"]}


@pytest.fixture(scope="module")
def log_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One log folder per test module (the servers' logs are attached to failing reports)."""
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1] + "-logs")


_SERVER_LOGS: list[object] = []
_SHARED_LOGS: list[object] = []
# The shared references are stopped right after the last test that uses them: an idle
# SGLang PD server still polls (about 0.4 core each here), and the tests after the last
# user (the startup checks) start servers of their own.
_SHARED_STOP: list[Callable[[], None]] = []
_LAST_SHARED_USER: list[str] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    users = [it.nodeid for it in session.items if "shared" in getattr(it, "fixturenames", ())]
    _LAST_SHARED_USER[:] = users[-1:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield
    if _LAST_SHARED_USER and item.nodeid == _LAST_SHARED_USER[0]:
        while _SHARED_STOP:
            _SHARED_STOP.pop()()


def attach_logs(servers: list[object]) -> None:
    """Register running servers whose logs a failing test's report should carry (with the shared ones)."""
    _SERVER_LOGS[:] = [*_SHARED_LOGS, *servers]


class Shared:
    """The references every acceptance module compares with, started once per session:
    ``agg`` (aggregated serving) and ``onehot`` (a PD pair without the drop-in, SGLang's
    own one-hot proposal), both with ``--enable-metrics``."""

    def __init__(self, agg: object, onehot: object) -> None:
        self.agg, self.onehot = agg, onehot


@pytest.fixture(scope="session")
def shared(server_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    from . import harness as h

    models = h.Models(server_models["target"], server_models["eagle3"])
    logs = tmp_path_factory.mktemp("shared-logs")
    metrics = ["--enable-metrics"]
    # --sleep-on-idle: an idle reference blocks on its sockets instead of polling (about
    # 0.4 core each otherwise), while other modules' servers run beside it.
    starts = {
        "agg": lambda: h.start_server("aggregated", models, logs / "agg", extra_args=metrics, sleep_on_idle=True),
        "onehot": lambda: h.start_pair(models, logs / "onehot", extra_args=metrics, sleep_on_idle=True),
    }
    out, error = h.start_together(starts)
    agg, onehot = out.get("agg"), out.get("onehot")

    def stop_all() -> None:  # idempotent: after the last user, and again at session end
        _SHARED_LOGS.clear()
        h.stop_all([*(onehot.servers if onehot is not None else []), *([agg] if agg is not None else [])])  # type: ignore[attr-defined, list-item]

    _SHARED_STOP[:] = [stop_all]
    try:
        if error is not None:
            raise error
        _SHARED_LOGS[:] = [agg, *onehot.servers]  # type: ignore[union-attr]
        yield Shared(agg, onehot)
    finally:
        _SHARED_STOP.clear()
        stop_all()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and item.get_closest_marker("server") is not None:
        for s in _SERVER_LOGS:
            rep.sections.append((f"server log: {s.name}", s.log(2500)))  # type: ignore[attr-defined]


_TEST_TIMES: list[tuple[str, float]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # setup (where a module's servers start) + call + teardown, per server test
    if "tests/server/" in report.nodeid.replace("\\", "/") and report.when in ("setup", "call", "teardown"):
        if _TEST_TIMES and _TEST_TIMES[-1][0] == report.nodeid:
            _TEST_TIMES[-1] = (report.nodeid, _TEST_TIMES[-1][1] + report.duration)
        else:
            _TEST_TIMES.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The tier's time table (docs/server.md): each server's start to healthy, and each
    server test's time (its module's server starts fall in its first test's setup)."""
    from . import harness as h

    if not h.STARTS:
        return
    tr = terminalreporter
    tr.section("server tier: starts and tests")
    for name, folder, secs in h.STARTS:
        tr.write_line(f"start  {secs:7.1f} s  {folder}/{name}")
    for name, folder, secs in h.STOPS:
        tr.write_line(f"stop   {secs:7.1f} s  {folder}/{name}")
    total = 0.0
    for nodeid, secs in _TEST_TIMES:
        total += secs
        tr.write_line(f"test   {secs:7.1f} s  {nodeid.split('tests/server/', 1)[-1]}")
    tr.write_line(f"total  {total:7.1f} s  over {len(_TEST_TIMES)} tests")
