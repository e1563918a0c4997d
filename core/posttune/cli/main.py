"""Entry point of the `posttune` console script.

User errors (PosttuneError) print one line on stderr and exit with status 2; ``--debug``
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys

from posttune import allocator
from posttune.errors import PluginError, PosttuneError, one_line

USER_ERROR = 2
CORE = "posttune"  # the core's distribution: its own commands are never isolated or displaced


class _Parser(argparse.ArgumentParser):
    """The top-level parser: its help lists the commands, so it also warns (on stderr) about plugins
    that failed to load or clash, which may be why a command is missing."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.warnings: list[str] = []
        self.commands: set[str] = set()
        #: commands a plugin registered but whose arguments failed to set up: name -> why, in one line
        self.unavailable: dict[str, str] = {}

    def print_help(self, file=None) -> None:
        super().print_help(file)
        warn(self.warnings)


def warn(lines: list[str]) -> None:
    """``posttune: warning: LINE`` on stderr for each line, after what stdout already holds."""
    sys.stdout.flush()
    for line in lines:
        print(f"posttune: warning: {line}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    from posttune.plugins import describe, get_plugins, isolated, problems
    from posttune.version import __version__

    registry = get_plugins().registry
    parser = _Parser(prog="posttune", description="LLM post-training as a core plus plugins.")
    parser.add_argument("--version", action="version", version=f"posttune {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=argparse.ArgumentParser)
    for item in _commands(registry):
        command, provenance = item.descriptor, item.provenance
        epilog = "examples:\n" + "\n".join(f"  {line}" for line in command.examples) if command.examples else None
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help, epilog=epilog,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.commands.add(command.name)
        if provenance.distribution == CORE:
            command.configure(sub)
        else:  # a plugin's command: its failure costs that command only (main refuses to run it)
            _, crash = isolated(command.configure, sub)
            if crash is not None:
                parser.unavailable[command.name] = (
                    f"command '{command.name}' of plugin {provenance.plugin} from {provenance} failed to set up "
                    f"its arguments: {describe(crash)}")
        sub.set_defaults(_run=command.run)
    parser.warnings = problems(get_plugins()) + list(parser.unavailable.values())
    return parser


def _commands(registry) -> list:
    """The registered commands; where a plugin registers a name the core's own command has, the
    core's is kept, so `posttune plugins` and `posttune ls` can still say what clashes."""
    core = [holder for (kind, _name), holders in registry.duplicates.items() if kind == "command"
            for holder in holders if holder.provenance.distribution == CORE]
    return sorted([*registry.items("command"), *core], key=lambda item: item.descriptor.name)


def _asks_for_version(argv: list[str]) -> bool:
    """``--version`` (or an abbreviation argparse would take) among the options before the command,
    before any ``-h``: answered without loading a plugin, so no plugin can break it."""
    for arg in argv:
        if not arg.startswith("--") or arg == "--" or "--help".startswith(arg):
            return False
        if "--version".startswith(arg):
            return True
    return False


def _command_word(argv: list[str]) -> str | None:
    """The command argv names: its first word that is not an option, unless help was asked first."""
    for arg in argv:
        if arg in ("-h", "--") or (arg.startswith("--h") and "--help".startswith(arg)):
            return None
        if not arg.startswith("-"):
            return arg
    return None


def _refuse_unavailable(parser: _Parser, argv: list[str]) -> None:
    """A command that is not there gets one line, not argparse's usage message: the plugin that failed
    to provide it, the distribution to install (`posttune eval` without posttune-lmeval), or the
    command meant (a misspelling)."""
    from posttune.plugins import get_registry

    word = _command_word(argv)
    if word is None:
        return
    if word in parser.unavailable:
        raise PluginError(parser.unavailable[word])
    if word not in parser.commands:
        raise get_registry().unknown("command", word)


def _parse(parser: _Parser, argv: list[str]) -> argparse.Namespace:
    """argparse's parse, with a command's ``KEY=VALUE`` overrides also taken after its options (``preview CONFIG
    --rows 1 k=v``, ``train CONFIG --nproc-per-node 2 k=v``), where argparse alone refuses them."""
    args, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(args, "overrides", None), list) and not any(a.startswith("-") for a in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _out_of_memory(exc: BaseException) -> str | None:
    """The allocator's own words when ``exc`` is an allocation that failed (CPU or GPU), else None: a model or
    batch too large for the machine is not a bug to trace back, but a size to change."""
    text = str(exc)
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or "can't allocate memory" in text:
        return " ".join(text.replace("[enforce fail at", "[").split())[:300] or type(exc).__name__
    return None


def main(argv: list[str] | None = None) -> int:
    entry, argv = argv is None, sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    if _asks_for_version(argv):
        from posttune.version import __version__

        print(f"posttune {__version__}")
        return 0
    try:
        if entry and _command_word(argv) == "train":  # first thing: an allocator is chosen at process start
            allocator.preload(["-m", "posttune.cli.main", *argv])
        parser = build_parser()
        _refuse_unavailable(parser, argv)
        args = _parse(parser, argv)
        if not getattr(args, "_run", None):
            parser.print_help()
            return USER_ERROR
        return args._run(args)
    except PosttuneError as exc:
        if debug:
            raise
        print(f"posttune: error: {one_line(str(exc))}", file=sys.stderr)
        return exc.exit_status
    except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        said = _out_of_memory(exc)
        if debug or said is None:
            raise
        print(f"posttune: error: out of memory: {said} (`posttune plan` estimates a run's peak, docs/memory.md says "
              "what lowers it; --debug: the traceback)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("posttune: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `posttune config keys | head`: the reader left; nothing is wrong
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
        return 0


if __name__ == "__main__":
    sys.exit(main())
