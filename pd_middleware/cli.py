"""The ``pd-middleware`` command line.

Subcommands are thin: each parses its flags and calls the library. Errors from the
project's hierarchy print without a traceback; anything else is a bug and keeps its
traceback. Exit codes (also in ``pd-middleware --help``):

===  ===========================================================================
0    success
1    the job ran and its checks failed: an arm failed the exactness test, a payload
     was lost, or (with ``--fail-on-loss``) any payload failed
2    usage, config, plugin or run error (nothing ran, or the run could not finish)
130  interrupted (Ctrl-C); ``ab`` keeps the partial report
===  ===========================================================================
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .core._errors import ConfigError, PDMiddlewareError, PluginError

EXIT_OK, EXIT_CHECK_FAILED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130

EPILOG = """\
A CONFIG is a .toml, .yaml, .yml or .json file, inline JSON ('{"model": {...}}'), or
the name of a shipped example (see `pd-middleware config list`).
Plugins come from the entry-point group 'pd_middleware.plugins' or from a
'package.module:ATTR' reference written in the config; modules in the working
directory are imported only with --plugin-path.

exit codes:
  0    success
  1    the job ran and its checks failed (exactness, lost payloads, --fail-on-loss)
  2    usage, config, plugin or run error
  130  interrupted (Ctrl-C); `ab` keeps the partial report
"""


def _registry(args: argparse.Namespace) -> Any:
    from .registry import default_registry

    return default_registry(plugin_paths=args.plugin_path)


def _cmd_plugins(args: argparse.Namespace) -> int:
    reg = _registry(args)
    rows = [(i.kind, i.name, i.origin, i.summary) for i in reg.plugins()]
    if args.kind:
        rows = [r for r in rows if r[0] == args.kind]
    if rows:
        w_kind = max(len(r[0]) for r in rows)
        w_name = max(len(r[1]) for r in rows)
        print(f"{'KIND':<{w_kind}}  {'NAME':<{w_name}}  ORIGIN / SUMMARY")
        for kind, name, origin, summary in rows:
            print(f"{kind:<{w_kind}}  {name:<{w_name}}  {origin}")
            if summary and args.verbose:
                print(f"{'':<{w_kind}}  {'':<{w_name}}    {summary}")
    else:
        print("no plugins registered")
    broken = reg.broken()
    if broken:
        print(f"\nBROKEN ({len(broken)}): these entry points failed to load; configs that use them will fail")
        for b in broken:
            print(f"  {b.entry_point}\n    {b.error.detail}")
    return EXIT_OK


def _defaults_note(cfg: Any, data: Any) -> list[str]:
    """Model facts the document left to defaults: say which values apply."""
    import msgspec

    given = data.get("model", {}) if isinstance(data, dict) else {}
    out = []
    for f in msgspec.structs.fields(type(cfg.model)):
        if f.encode_name in given:
            continue
        value = getattr(cfg.model, f.name)
        if value is None:  # left to the engine (SGLang); tools without one use a stand-in
            shown = f"left out: the engine's value at start-up (tools without an engine use {getattr(cfg.model, f.encode_name, '?')!r})"
        else:
            shown = f"default {value!r}"
        out.append(f"model.{f.encode_name}: {shown}")
    return out


class _FormOnlyRegistry:
    """A registry for ``check-config`` that never imports a ``module:attr`` reference.

    Registered names (and installed entry points) resolve as usual; a ``module:attr``
    reference is checked for form and then refused as *not imported*: importing it would
    run its module's code, and a config checker must not run what it checks. ``--import``
    or ``--plugin-path`` lifts this.
    """

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    def __getattr__(self, name: str) -> Any:
        return getattr(self._registry, name)

    def resolve(self, kind: str, ref: str, key: str | None = None) -> Any:
        if ":" not in ref:
            return self._registry.resolve(kind, ref, key)
        from .registry import is_module_reference

        if not is_module_reference(ref):
            return self._registry.resolve(kind, ref, key)  # refused for its form, before any import
        raise PluginError(
            f"{ref!r} is a module reference (form OK), not imported: importing runs its code; "
            "pass --import, or --plugin-path DIR to allow plugins from DIR",
            plugin=ref,
            key=key,
        )


def _row_name(target: str) -> str:
    """A table row's short name: its function, with its class where it has one
    (``DecodeTransferQueue.__init__``, ``fast_sample``)."""
    parts = target.split(".")
    return ".".join(parts[-2:]) if len(parts) > 1 and parts[-2][:1].isupper() else parts[-1]


def _cmd_sglang(args: argparse.Namespace) -> int:
    import json

    from .integrations.sglang import SUPPORTED_SGLANG_VERSIONS, version_problem
    from .integrations.sglang.installation import ENV_ALLOW_UNSUPPORTED
    from .integrations.sglang.patching import detect_version
    from .integrations.sglang.releases import release_report

    if args.release is not None:
        version, source = args.release, "--release"
    else:
        try:
            version, source = detect_version(), "installed"  # package metadata: SGLang is not imported
        except PluginError:
            print(
                "pd-middleware: SGLang is not installed here (no 'sglang' distribution); pass --release X.Y.Z "
                f"to see what a release gets (supported: {', '.join(SUPPORTED_SGLANG_VERSIONS)})",
                file=sys.stderr,
            )
            return EXIT_ERROR
    allow = args.allow_unsupported or os.environ.get(ENV_ALLOW_UNSUPPORTED, "") == "1"
    problem = version_problem(version, allow_unsupported=allow)
    if problem is not None:
        print(f"pd-middleware: {problem}", file=sys.stderr)
        return EXIT_ERROR
    rep = release_report(version)
    rep["source"] = source
    rep["supported"] = version in SUPPORTED_SGLANG_VERSIONS
    if args.json:
        print(json.dumps(rep, indent=2))
        return EXIT_OK
    state = (
        "supported"
        if rep["supported"]
        else f"not in the table: tried on the rows of {rep['rows_of']}, every signature checked at install"
    )
    print(f"SGLang {version} ({source}): {state}")
    print("\nfeatures:")
    width = max(len(n) for n in rep["features"])
    for name, f in rep["features"].items():
        if f["available"]:
            changed = [f"{_row_name(r['target'])} ({r['releases']})" for r in f["rows"] if r["releases"] != "all"]
            note = f"  [release rows: {', '.join(changed)}]" if changed else ""
            print(f"  {name:<{width}}  supported: {f['summary']}{note}")
        else:
            print(f"  {name:<{width}}  refused: {f['refused']}")
    print("\nconfig per draft kind:")
    for kind, text in rep["configs"].items():
        print(f"  {kind}: {text}")
    print(f"\nCUDA-graph path: {rep['graph_path']}")
    print("\ndecode-only recompute:")
    print(f"  X' drawn by: {rep['recompute']['draw']}")
    print(f"  under the overlap scheduler: {rep['recompute']['overlap']}")
    return EXIT_OK


def _cmd_check_config(args: argparse.Namespace) -> int:
    import msgspec

    from .config import parse_config, raw_plugin_issues, resolve_plugins
    from .config_loader import find_config, read_document
    from .preflight import preflight

    data, src = read_document(find_config(args.config))
    reg = _registry(args)
    if not (args.import_refs or args.plugin_path):
        reg = _FormOnlyRegistry(reg)
    try:
        cfg = parse_config(data, src)
    except ConfigError as exc:
        # Report plugin-option mistakes in the same run as the schema's.
        extra = [i for i in raw_plugin_issues(data, reg, src) if i not in exc.issues]
        if not extra:
            raise
        raise ConfigError.from_issues([*exc.issues, *extra], source=src) from None
    resolved = resolve_plugins(cfg, reg, source=src)
    findings = preflight(cfg, resolved, reg, probe=not args.no_probe)
    errors = [f for f in findings if f.level == "error"]
    if args.show:
        print(msgspec.json.format(msgspec.json.encode(cfg), indent=2).decode())
    if errors:
        print(
            f"pd-middleware: {src}: would not start ({len(errors)} problem{'s' * (len(errors) > 1)}):", file=sys.stderr
        )
        for f in errors:
            print(f"  {f.path}: {f.message}", file=sys.stderr)
        return EXIT_ERROR
    print(f"{src}: OK")
    if not data:
        print("  note: the config is empty: every value below is a default")
    for line in _defaults_note(cfg, data):
        print(f"  note: {line}")
    m = cfg.model
    print(
        f"  model: vocab_size={m.declared_vocab_size or 'engine'} num_steps={m.declared_num_steps or 'engine'} "
        f"rejection_sampling={cfg.decode.rejection_sampling} max_batch={cfg.decode.max_batch} "
        f"device={cfg.decode.device}"
    )
    print(f"  hooks: {', '.join(h.spec.name for h in resolved.hooks) or '(none)'}")
    for arm, r in resolved.synthesizers.items():
        enc = resolved.encoders[arm]
        print(f"  arm {arm}: encoder={enc.spec.name} synthesizer={r.spec.name}")
    for f in findings:
        print(f"  {f}")
    return EXIT_OK


def _cmd_config_list(args: argparse.Namespace) -> int:
    from .config_loader import shipped_configs

    files = shipped_configs()
    if not files:
        print("no shipped configs found (a broken install?)", file=sys.stderr)
        return EXIT_ERROR
    for p in files:
        first = next(
            (ln.lstrip("# ").strip() for ln in p.read_text(encoding="utf-8").splitlines() if ln.startswith("#")), ""
        )
        print(f"{p.name:<22} {first}")
    print("\n`pd-middleware config show NAME > my.toml` copies one to start from.")
    return EXIT_OK


def _cmd_config_show(args: argparse.Namespace) -> int:
    from .config_loader import shipped_configs

    for p in shipped_configs():
        if args.name in (p.name, p.stem):
            sys.stdout.write(p.read_text(encoding="utf-8"))
            return EXIT_OK
    names = [p.stem for p in shipped_configs()]
    from .config_loader import did_you_mean

    raise ConfigError(
        f"no shipped config named {args.name!r}{did_you_mean(args.name, names)}; shipped: {', '.join(names)}"
    )


def _cmd_keys_new(args: argparse.Namespace) -> int:
    import re

    import zmq.auth

    from .transport.auth import write_keypair

    name = args.name
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
        print(
            f"pd-middleware: keys new: NAME {name!r} must be letters, digits, '_', '.', '-' (at most 64)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    d = Path(args.dir)
    pub_path, sec_path = d / f"{name}.key", d / f"{name}.key_secret"
    if (pub_path.exists() or sec_path.exists()) and not args.force:
        print(f"pd-middleware: keys new: {pub_path} or {sec_path} exists (--force replaces them)", file=sys.stderr)
        return EXIT_ERROR
    old = os.umask(0o077)  # the secret is never readable by others, not even for a moment
    try:
        pub, sec = write_keypair(d, name)
    finally:
        os.umask(old)
    os.chmod(pub, 0o644)
    public, _ = zmq.auth.load_certificate(pub)
    print(f"public key  {pub}  (Z85 {public.decode()})")
    print(f"secret key  {sec}  (mode 600: keep it on this node only)")
    print("use it (docs/transport.md, 'CURVE'):")
    print(f'  on this node:   [transport.curve] enabled = true, secret_key_file = "{sec}"')
    print(
        f"  on the decode:  copy {pub.rsplit('/', 1)[-1]} into curve.clients_dir (the allowlist; {name!r} is the identity)"
    )
    print(f'  on a prefill:   curve.server_key = "{public.decode()}" when this is the decode\'s key')
    return EXIT_OK


def check_out_dir(out: str) -> Path:
    """Fail before the run if ``out`` cannot hold the report (a file, unwritable...)."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"--out {out!r} exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".pd-middleware-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--out {out!r} is not a writable directory: {exc.strerror or exc}") from None
    return p


@contextmanager
def interrupt_to_cancel(cancel: threading.Event, grace_s: float = 1.8) -> Iterator[None]:
    """First Ctrl-C sets ``cancel`` (the job stops and keeps a partial report); a second
    one, or the job not returning within ``grace_s``, raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum: int, frame: Any) -> None:
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()
        print(
            "\npd-middleware: interrupted; stopping and writing a partial report (Ctrl-C again to abort)",
            file=sys.stderr,
        )
        signal.signal(signal.SIGALRM, lambda *_: _raise_interrupt())
        signal.setitimer(signal.ITIMER_REAL, grace_s)

    old = signal.signal(signal.SIGINT, on_sigint)
    old_alarm = signal.getsignal(signal.SIGALRM)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGINT, old)
        signal.signal(signal.SIGALRM, old_alarm)


def _raise_interrupt() -> None:
    raise KeyboardInterrupt


def _cmd_ab(args: argparse.Namespace) -> int:
    from .ab.job import run_ab_command
    from .config_loader import find_config

    # Everything a user can get wrong is checked before the deployment starts.
    args.config = find_config(args.config)
    from .config import load_config

    load_config(args.config)
    check_out_dir(args.out)
    cancel = threading.Event()
    with interrupt_to_cancel(cancel):
        return run_ab_command(args, cancel=cancel)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (``pd-middleware --help`` shows the exit codes)."""
    parser = argparse.ArgumentParser(
        prog="pd-middleware",
        description="Decode-side proposal middleware for PD-disaggregated speculative decoding.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"pd-middleware {__version__}")
    parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="warning",
        help="log level (default: warning); debug also shows the Mooncake engine's own start-up lines",
    )
    parser.add_argument(
        "--plugin-path",
        action="append",
        default=[],
        metavar="DIR",
        help="allow 'module:ATTR' plugins from DIR (repeatable); the working directory is never used implicitly",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (_add_plugins, _add_check_config, _add_keys, _add_config, _add_ab, _add_sglang):
        add(sub)
    from .evaluation.live_ab import add_parser as add_live_ab

    add_live_ab(sub)
    return parser


# One function per subcommand: its flags, its help, and the handler it runs. ``sub`` is
# the parser's subparsers action (as live_ab.add_parser takes it).


def _add_plugins(sub: Any) -> None:
    p = sub.add_parser(
        "plugins",
        help="list registered plugins (and broken entry points)",
        description="List every registered plugin: its kind (hook, synthesizer, encoder), "
        "its name (what a config writes) and where it came from (entry point and distribution). "
        "Entry points that fail to load are listed with their error.",
    )
    p.add_argument("--kind", choices=["hook", "synthesizer", "encoder"], help="only this kind")
    p.add_argument("-v", "--verbose", action="store_true", help="also print each plugin's summary")
    p.set_defaults(func=_cmd_plugins)


def _add_check_config(sub: Any) -> None:
    p = sub.add_parser(
        "check-config",
        help="validate a config: would it start?",
        description="Load a config, resolve every plugin it names and check every option, then check "
        "that it would start: environment variables it names are set, hosts parse, the slot pool fits "
        "in memory; warn about an encoder/synthesizer pair whose proposal never reaches the verifier. "
        "Prints OK and a summary, or every problem with its key path and exits with status 2. "
        "A 'module:ATTR' plugin reference is checked for form only and reported as not imported "
        "(importing runs its code) unless --import or --plugin-path DIR is given. YAML aliases "
        "may expand to at most 100,000 values.",
    )
    p.add_argument("config", metavar="CONFIG", help="config file, inline JSON or shipped name")
    p.add_argument(
        "--import",
        dest="import_refs",
        action="store_true",
        help="import 'module:ATTR' plugin references to check them (runs their module's code)",
    )
    p.add_argument("--show", action="store_true", help="print the resolved config (defaults filled in) as JSON")
    p.add_argument("--no-probe", action="store_true", help="skip running each encoder/synthesizer pair on random rows")
    p.set_defaults(func=_cmd_check_config)


def _add_keys(sub: Any) -> None:
    p = sub.add_parser(
        "keys",
        help="CURVE key pairs for the side channel",
        description="Generate the CURVE key files that the decode's ZAP allowlist reads "
        "(zmq.auth certificates: NAME.key public, NAME.key_secret secret).",
    )
    ksub = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    k = ksub.add_parser(
        "new",
        help="create NAME.key and NAME.key_secret",
        description="Create a Curve25519 key pair as NAME.key (public: goes into the decode's "
        "curve.clients_dir, or its Z85 text into a prefill's curve.server_key) and NAME.key_secret "
        "(this node's curve.secret_key_file, written mode 600). NAME is the identity the "
        "decode's allowlist gives the holder.",
    )
    k.add_argument("name", metavar="NAME", help="the key's identity, e.g. prefill-a or decode")
    k.add_argument("--dir", default="keys", metavar="DIR", help="where to write the files (default: ./keys)")
    k.add_argument("--force", action="store_true", help="replace existing files of that name")
    k.set_defaults(func=_cmd_keys_new)


def _add_config(sub: Any) -> None:
    p = sub.add_parser(
        "config", help="the shipped example configs", description="List or print the shipped example configs."
    )
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    c = csub.add_parser("list", help="list the shipped configs")
    c.set_defaults(func=_cmd_config_list)
    c = csub.add_parser("show", help="print a shipped config (to copy and edit)")
    c.add_argument("name", metavar="NAME", help="e.g. ab or sparse_topk.toml")
    c.set_defaults(func=_cmd_config_show)


def _add_ab(sub: Any) -> None:
    p = sub.add_parser(
        "ab",
        help="A/B-compare proposal strategies on the same seeded traffic (the main job)",
        description="Run every arm of CONFIG on the same seeded workload through an embedded "
        "loopback deployment (a prefill process running each arm's encoder; this process is the decode, "
        "running receiver, hooks, synthesizer, assembler and a reference verifier, talking over "
        "real ZMQ and Mooncake on TCP). Prints a table, writes DIR/report.json and DIR/report.png. "
        "The summary lists each hook's and each arm's failed payloads with the first error. "
        "Exit codes as below; Ctrl-C stops within 2 s, writes the partial report and exits 130.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "config",
        nargs="?",
        default="ab",
        metavar="CONFIG",
        help="config with [[arms]] and an [ab] section (default: the shipped 'ab' comparison)",
    )
    p.add_argument("--requests", type=int, default=None, metavar="N", help="requests per arm (default: [ab].requests)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="workload and sampler seed (default: [ab].seed)")
    p.add_argument(
        "--out", default="out/ab", metavar="DIR", help="output directory, checked before the run (default: out/ab)"
    )
    p.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    p.add_argument(
        "--format",
        choices=["table", "markdown", "json", "csv"],
        default="table",
        help="what is printed on stdout (the report files are written in every case; default: table)",
    )
    p.add_argument(
        "--fail-on-loss", action="store_true", help="exit 1 when any payload failed (not only when one was lost)"
    )
    p.set_defaults(func=_cmd_ab)


def _add_sglang(sub: Any) -> None:
    p = sub.add_parser(
        "sglang",
        help="what the SGLang drop-in does on an SGLang release (the installed one by default)",
        description="Read the installed SGLang release from its package metadata (SGLang is not imported and "
        "nothing starts), or take --release, and print per feature of the drop-in whether that release gets it "
        "(supported, with the table rows that differ by release) or refuses it (the line install prints, with what "
        "to run instead), the config to run per draft kind (single-layer EAGLE/EAGLE3, DeepSeek NextN, multi-layer "
        "MTP chain), and how the proposal reaches the first verify under CUDA-graph replay. Exit 2 with one line "
        "when SGLang is not installed and no --release is given, or the release is not supported (older than the "
        "table; newer without --allow-unsupported).",
    )
    p.add_argument("--release", metavar="X.Y.Z", help="report on this SGLang release instead of the installed one")
    p.add_argument(
        "--allow-unsupported",
        action="store_true",
        help="a release newer than the table: report on the newest rows (as PD_MIDDLEWARE_ALLOW_UNSUPPORTED_SGLANG=1)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_sglang)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(levelname)s %(name)s: %(message)s")
    # The Mooncake engine reads its own level when it is imported (the prefill process
    # inherits it): INFO shows its start-up lines; otherwise the config's
    # transport.mooncake.log_level applies and they stay hidden.
    if level == "debug":
        os.environ["MC_LOG_LEVEL"] = "INFO"


def _drop_implicit_cwd() -> None:
    """Remove the working directory that ``python -m`` put first on ``sys.path`` (as ``-P``)."""
    if sys.path and not sys.flags.safe_path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return EXIT_ERROR
    _setup_logging(args.log_level)
    for d in reversed(args.plugin_path):  # asked for explicitly: importable by every command
        d = os.path.abspath(d)
        if d not in sys.path:
            sys.path.insert(0, d)
    try:
        return func(args)
    except KeyboardInterrupt:
        print("\npd-middleware: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ConfigError, PluginError) as exc:
        print(f"pd-middleware: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except PDMiddlewareError as exc:
        print(f"pd-middleware: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ERROR


def console_main() -> None:
    """Entry point of the ``pd-middleware`` script: :func:`main`, then exit.

    After Ctrl-C the partial report is written and the prefill process reaped; tearing
    down torch, ZMQ and the Mooncake engine at interpreter exit can then take longer than
    the 2 s a user waits (measured 1-2 s on a loaded 2-core host), so that path exits at
    once.
    """
    rc = main()
    if rc == EXIT_INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":  # pragma: no cover - `python -m pd_middleware.cli`
    _drop_implicit_cwd()
    console_main()
