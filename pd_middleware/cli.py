"""The ``pd-middleware`` command line.

Subcommands are thin: each parses its flags and calls the library. Errors from the
project's hierarchy print one clear line (with the key path for config errors) and
exit with status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from ._errors import ConfigError, PDMiddlewareError, PluginError

EPILOG = """\
Configs are TOML or YAML (by extension); see configs/ for commented examples.
Plugins come from the entry-point group 'pd_middleware.plugins' or from a
'package.module:ATTR' reference written in the config.
"""


def _cmd_plugins(args: argparse.Namespace) -> int:
    from .registry import default_registry

    reg = default_registry()
    rows = [(i.kind, i.name, i.origin, i.summary) for i in reg.plugins()]
    if args.kind:
        rows = [r for r in rows if r[0] == args.kind]
    if not rows:
        print("no plugins registered")
        return 0
    w_kind = max(len(r[0]) for r in rows)
    w_name = max(len(r[1]) for r in rows)
    print(f"{'KIND':<{w_kind}}  {'NAME':<{w_name}}  ORIGIN / SUMMARY")
    for kind, name, origin, summary in rows:
        print(f"{kind:<{w_kind}}  {name:<{w_name}}  {origin}")
        if summary and args.verbose:
            print(f"{'':<{w_kind}}  {'':<{w_name}}    {summary}")
    return 0


def _cmd_check_config(args: argparse.Namespace) -> int:
    from .config import load_config, resolve_plugins
    from .registry import default_registry

    cfg = load_config(args.file)
    resolved = resolve_plugins(cfg, default_registry(), source=args.file)
    print(f"{args.file}: OK")
    print(
        f"  model: vocab_size={cfg.model.declared_vocab_size or 'engine'} num_steps={cfg.model.declared_num_steps or 'engine'} "
        f"rejection_sampling={cfg.decode.rejection_sampling} max_batch={cfg.decode.max_batch} "
        f"device={cfg.decode.device}"
    )
    print(f"  hooks: {', '.join(h.spec.name for h in resolved.hooks) or '(none)'}")
    for arm, r in resolved.synthesizers.items():
        enc = resolved.encoders[arm]
        print(f"  arm {arm}: encoder={enc.spec.name} synthesizer={r.spec.name}")
    return 0


def _cmd_ab(args: argparse.Namespace) -> int:
    from .ab.job import run_ab_command

    return run_ab_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-middleware",
        description="Decode-side proposal middleware for PD-disaggregated speculative decoding.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"pd-middleware {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "plugins",
        help="list registered plugins",
        description="List every registered plugin: its kind (hook, synthesizer, encoder), "
        "its name (what a config writes) and where it came from (entry point and distribution).",
    )
    p.add_argument("--kind", choices=["hook", "synthesizer", "encoder"], help="only this kind")
    p.add_argument("-v", "--verbose", action="store_true", help="also print each plugin's summary")
    p.set_defaults(func=_cmd_plugins)

    p = sub.add_parser(
        "check-config",
        help="validate a config file",
        description="Load a config, resolve every plugin it names and check every option. "
        "Prints OK and a summary, or the offending key path and exits with status 2.",
    )
    p.add_argument("file", help="config file (.toml, .yaml or .yml)")
    p.set_defaults(func=_cmd_check_config)

    p = sub.add_parser(
        "ab",
        help="A/B-compare proposal strategies on the same seeded traffic (the main job)",
        description="Run every arm of CONFIG on the same seeded workload through an embedded "
        "loopback deployment (a prefill process running each arm's encoder; this process is the decode, "
        "running receiver, hooks, synthesizer, assembler and a reference verifier, talking over "
        "real ZMQ and Mooncake on TCP). Prints a table, writes DIR/report.json and DIR/report.png. "
        "Exits 1 when an arm fails the exactness check or a payload is unaccounted for, 2 on a "
        "config, plugin or run error.",
    )
    p.add_argument("config", help="config with [[arms]] and an [ab] section, e.g. configs/ab.toml")
    p.add_argument("--requests", type=int, default=None, metavar="N", help="requests per arm (default: [ab].requests)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="workload and sampler seed (default: [ab].seed)")
    p.add_argument("--out", default="out/ab", metavar="DIR", help="output directory (default: out/ab)")
    p.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    p.set_defaults(func=_cmd_ab)
    from .live_ab import add_parser as add_live_ab

    add_live_ab(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return func(args)
    except (ConfigError, PluginError) as exc:
        print(f"pd-middleware: {exc}", file=sys.stderr)
        return 2
    except PDMiddlewareError as exc:
        print(f"pd-middleware: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
