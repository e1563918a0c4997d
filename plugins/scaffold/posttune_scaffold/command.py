"""`posttune new plugin NAME --kind KIND`: start a third-party plugin from a working example.

It writes ``posttune-NAME/`` (a distribution: pyproject.toml with the ``posttune`` entry point,
README, the package with the hook implementation, a bundled config where the kind trains, and
tests written with ``posttune.testing`` that pass as generated). The templates live in
``posttune_scaffold.scaffold``; this module is the command around them. No torch is imported.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from posttune.plugin import Command, PosttuneError

EXAMPLES = ("posttune new plugin my-method --kind method",
            "posttune new plugin my-model --kind family -o plugins/")


def configure(parser: argparse.ArgumentParser) -> None:
    from posttune_scaffold.scaffold import KINDS

    parser.add_argument("what", choices=["plugin"], help="what to create (a plugin distribution)")
    parser.add_argument("name", help="the plugin's name: registered under it, distribution posttune-NAME, "
                                     "package posttune_NAME")
    kinds = "; ".join(f"{kind.name}: {kind.about}" for kind in KINDS.values())
    parser.add_argument("--kind", choices=list(KINDS), default="method",
                        help=f"what the plugin registers (default: %(default)s). {kinds}")
    parser.add_argument("-o", "--output", default=".", metavar="DIR",
                        help="the folder to write posttune-NAME/ into, made if missing (default: here)")


def run(args: argparse.Namespace) -> int:
    from posttune_scaffold.scaffold import KINDS, plugin_names, scaffold

    kind = KINDS[args.kind]
    names = plugin_names(args.name)
    _refuse_a_taken_name(kind.registry_kind, names.name)
    _refuse_an_installed_distribution(names.distribution, names.package)
    root, files = scaffold(args.kind, args.name, Path(args.output))
    print(f"wrote {root}/ ({args.kind} '{names.name}', distribution {names.distribution}):")
    for file in files:
        print(f"  {file}")
    steps = [(f"pip install -e '{root}[test]'", "add -c constraints.txt if you pin torch"),
             ("posttune plugins", f"lists {names.distribution} and what it registers"),
             (f"pytest {root / 'tests'}", "its tests pass as written"),
             (f"cat {root / 'README.md'}", "what it is and how to make it yours")]
    width = max(len(command) for command, _ in steps)
    print("next:")
    for command, why in steps:
        print(f"  {command:<{width}}  # {why}")
    return 0


def _refuse_a_taken_name(registry_kind: str, name: str) -> None:
    """Two distributions registering one name are both kept out of the registry: refuse it now."""
    from posttune.plugin import provenance, registered

    if name in registered(registry_kind):
        label = registry_kind.replace("_", " ")
        raise PosttuneError(f"{label} '{name}' is already registered by {provenance(registry_kind, name)}; two plugins "
                            f"registering one name are both refused at run time (choose another name)")


def _refuse_an_installed_distribution(distribution: str, package: str) -> None:
    """A scaffold named after an installed distribution (``posttune new plugin sft --kind reward`` writes
    posttune-sft) would replace it when installed: refuse it now, whatever it registers."""
    import importlib.util
    from importlib import metadata

    try:
        metadata.distribution(distribution)
        taken = True
    except metadata.PackageNotFoundError:
        taken = importlib.util.find_spec(package) is not None
    if taken:
        raise PosttuneError(f"{distribution} (package {package}) is installed already; installing the new plugin "
                            "would replace it (choose another name)")


COMMAND = Command("new", "start a plugin distribution from a working example (family, method, reward, ...)",
                  configure, run, examples=EXAMPLES)
