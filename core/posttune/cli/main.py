"""Entry point of the `posttune` console script.

User errors (PosttuneError) print one line on stderr and exit with status 2; ``--debug``
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys

from posttune.errors import PosttuneError, one_line

USER_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    from posttune.version import __version__
    from posttune.plugins import get_registry

    parser = argparse.ArgumentParser(prog="posttune", description="LLM post-training as a core plus plugins.")
    parser.add_argument("--version", action="version", version=f"posttune {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for item in get_registry().items("command"):
        command = item.descriptor
        epilog = "examples:\n" + "\n".join(f"  {line}" for line in command.examples) if command.examples else None
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help, epilog=epilog,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        command.configure(sub)
        sub.set_defaults(_run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "_run", None):
            parser.print_help()
            return USER_ERROR
        return args._run(args)
    except PosttuneError as exc:
        if debug:
            raise
        print(f"posttune: error: {one_line(str(exc))}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        print("posttune: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `posttune config keys | head`: the reader left; nothing is wrong
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
        return 0


if __name__ == "__main__":
    sys.exit(main())
