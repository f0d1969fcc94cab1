"""`ds-cobalt` command line: one argparse subcommand per verb, each in its own module.

To add a verb, append `(name, module)` to `VERBS`; the module defines `HELP: str`,
`add_arguments(parser)` and `run(args) -> int`. Modules are imported when the parser is built; they must
only import torch lazily inside `run` (the planning verbs never do).
User errors (ValueError) are printed as `ds-cobalt <verb>: error: ...` with exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

VERBS: list[tuple[str, str]] = [
    ("plan", "ds_cobalt.commands.plan"),
    ("simulate", "ds_cobalt.commands.simulate"),
    ("trace", "ds_cobalt.commands.trace"),
    ("calibrate", "ds_cobalt.commands.calibrate"),
    ("report", "ds_cobalt.commands.report"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds-cobalt", description="ds_cobalt planning and simulation tools")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name, module_name in VERBS:
        module = importlib.import_module(module_name)
        verb_parser = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(verb_parser)
        verb_parser.set_defaults(_run=module.run, _verb=name)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args._run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"ds-cobalt {args._verb}: error: {err}", file=sys.stderr)
        code = 2
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
