"""The core's own subcommands, registered as a built-in plugin through ``posttune_register_commands``."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

from posttune.cli import config_keys, launch, merge, preview
from posttune.cli.main import warn
from posttune.descriptors import Command
from posttune.errors import ConfigError, PosttuneError, did_you_mean, first_line
from posttune.plugins import PLUGIN_API, get_plugins, get_registry, hookimpl, problems
from posttune.registry import KINDS

POSTTUNE_PLUGIN_API = PLUGIN_API


# ---- posttune plugins ----------------------------------------------------------------------

def plugins_report() -> list[dict]:
    """Installed plugins with their distribution, hooks, registered names and load errors."""
    plugins, registry = get_plugins(), get_registry()
    report = []
    for info in plugins.plugins.values():
        registered: dict[str, list[str]] = {}
        for kind in KINDS.values():
            names = [r.descriptor.name for r in registry.items(kind.key) if r.provenance.plugin == info.name]
            names += [name for (k, name), holders in registry.duplicates.items()
                      if k == kind.key and any(h.provenance.plugin == info.name for h in holders)]
            if names:
                registered[kind.plural] = sorted(names)
        report.append({
            "name": info.name,
            "distribution": info.provenance.distribution,
            "version": info.provenance.version,
            "module": info.module,
            "hooks": info.hooks,
            "registers": registered,
            "error": info.error,
            "warnings": info.warnings,
        })
    return report


def _configure_plugins(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")


def _run_plugins(args: argparse.Namespace) -> int:
    """The report itself names what is wrong (a plugin's FAILED TO LOAD line, then one `problem:` line
    each, the same as `"problems"` in JSON), and exits 0: listing broken plugins is this command's job."""
    report = plugins_report()
    found = problems(get_plugins())
    if args.json:
        print(json.dumps({"plugins": report, "problems": found}, indent=2))
        return 0
    for plugin in report:
        print(f"{plugin['distribution']} {plugin['version']}  ({plugin['name']})")
        if plugin["error"]:
            print(f"  FAILED TO LOAD: {plugin['error']}")
        for warning in plugin["warnings"]:
            print(f"  warning: {warning}")
        for kind, names in plugin["registers"].items():
            print(f"  {kind}: {', '.join(names)}")
    for line in found:
        print(f"problem: {line}")
    return 0


# ---- posttune ls -----------------------------------------------------------------------------

LS_KINDS = {kind.plural: kind for kind in KINDS.values() if kind.key != "command"}


def _configure_ls(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", nargs="?", choices=sorted(LS_KINDS), help="what to list (default: all)")
    parser.add_argument("--json", action="store_true", help="print JSON: kind -> name -> distribution, version, "
                                                             "description")


def _run_ls(args: argparse.Namespace) -> int:
    """Usable names on stdout (text or JSON); a plugin that failed to load, and a name two plugins
    registered, as a `posttune: warning:` line each on stderr, so a name missing here says why."""
    registry = get_registry()
    shown = [LS_KINDS[args.kind]] if args.kind else list(LS_KINDS.values())
    _print_ls(args, registry)
    warn(problems(get_plugins(), [kind.key for kind in shown]))
    return 0


def _print_ls(args: argparse.Namespace, registry) -> None:
    if args.json:
        listing = {plural: {item.descriptor.name: {"distribution": item.provenance.distribution,
                                                   "version": item.provenance.version,
                                                   "description": getattr(item.descriptor, "description", "")}
                            for item in registry.items(kind.key)}
                   for plural, kind in LS_KINDS.items() if args.kind in (None, plural)}
        print(json.dumps(listing, indent=2))
        return
    for plural in [args.kind] if args.kind else list(LS_KINDS):
        kind = LS_KINDS[plural]
        if not args.kind:
            print(f"{plural}:")
        items = list(registry.items(kind.key))
        if not items and args.kind:
            print(f"(no {kind.label} installed)")
        width = max((len(r.descriptor.name) for r in items), default=0)
        for item in items:
            about = first_line(getattr(item.descriptor, "description", "") or "")
            indent = "  " if not args.kind else ""
            print(f"{indent}{item.descriptor.name:<{width}}  {item.provenance}  {about}".rstrip())


# ---- posttune cp -----------------------------------------------------------------------------

def cannot_write(path: Path, exc: OSError) -> PosttuneError:
    """The one-line error for a file a command could not write, naming it (not an OSError's traceback)."""
    return PosttuneError(f"cannot write {path}: {exc.strerror or exc}")


def _configure_cp(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a bundled config name (see `posttune ls configs`)")
    parser.add_argument("dest", help="file or directory to copy it to")
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")


def _run_cp(args: argparse.Namespace) -> int:
    registry = get_registry()
    found = registry.entries["config"].get(args.config)
    if found is None:
        raise PosttuneError(f"no bundled config '{args.config}'"
                            f"{did_you_mean(args.config, registry.names('config'))} (see `posttune ls configs`)")
    source = found.descriptor.path
    dest = Path(args.dest).expanduser()
    if args.dest.endswith(("/", os.sep)) and not dest.exists():  # `cp NAME newdir/`: a folder meant, not a file
        try:
            dest.mkdir(parents=True)
        except OSError as exc:
            raise cannot_write(dest, exc) from None
    if dest.is_dir():
        dest = dest / source.name
    if dest.exists() and not args.force:
        raise PosttuneError(f"{dest} exists; pass --force to overwrite it")
    if not dest.parent.exists():
        raise PosttuneError(f"{dest.parent}: no such directory")
    try:
        shutil.copyfile(source, dest)
    except OSError as exc:  # a parent that is a file, a read-only or virtual file system (/proc)
        raise cannot_write(dest, exc) from None
    print(f"copied {args.config} to {dest}")
    return 0


# ---- posttune validate / plan / train ---------------------------------------------------------

def _configure_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a YAML file or a bundled config name")
    parser.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides: a.b.c=value sets, ~a.b deletes")


def resolve(args: argparse.Namespace, world_size: int | None = 1):
    """Config file + overrides -> validated RunConfig -> Plan (no weights touched)."""
    return resolve_run(args.config, args.overrides, world_size=world_size,
                       runs=getattr(args, "command", None) in ("validate", "train"))


def resolve_run(source: Any, overrides: list[str], *, world_size: int | None = 1, runs: bool = True) -> Any:
    """A config (a file, a bundled name or a mapping) and overrides -> the checked Plan: every check `validate`
    makes before any weight loads; ``runs``: those of a run too (its data read, its output directory's state)."""
    from posttune.config import load_config, validate
    from posttune.checkpoint.peft_config import warn_of_init_from_base
    from posttune.config.data_checks import check_data
    from posttune.plan import resolve_plan

    config = validate(load_config(source, overrides))
    plan = resolve_plan(config, get_registry(), world_size=world_size)
    check_data(plan, runs=runs)  # a missing data file, or a format that cannot read it: refused before any weight loads
    if os.environ.get("RANK", "0") == "0":
        warn_of_init_from_base(config)  # one on another base: allowed, said
    if config.adapter is not None and config.adapter.targets:  # a listed target that matches no linear layer
        from posttune.training.compose import check_adapter_targets  # (torch: the model is built on meta)

        check_adapter_targets(plan)
    # validate sees what train would refuse about the output directory (torchrun: rank 0 checks)
    if runs and os.environ.get("RANK", "0") == "0":
        from posttune.training import resume_identity
        from posttune.training.output_dir import check_output_dir, resume_candidate

        check_output_dir(config)
        candidate = resume_candidate(config)
        resume_identity.check(plan, candidate)  # a resume that would misread its checkpoint
        resume_identity.check_global_batch(plan, candidate)
    return plan


class _TrustComponents(argparse.Action):
    """``--trust-components``: set the variable the ``_component_`` gate reads, in this process and so
    in every process it starts (torchrun's workers re-enter `posttune train` with it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from posttune.config.components import TRUST_ENV

        os.environ[TRUST_ENV] = "1"
        setattr(namespace, self.dest, True)


def _configure_validate(parser: argparse.ArgumentParser) -> None:
    _configure_config(parser)
    parser.add_argument("--trust-components", action=_TrustComponents, nargs=0, default=False,
                        help="allow any _component_, not only optimizer and LR scheduler classes of torch, "
                             "torchao, posttune and the installed plugins (a config's _component_ runs code; "
                             "also POSTTUNE_TRUST_COMPONENTS=1)")
    launch.add_torchrun_options(parser)


def _print_components(plan) -> None:
    """Every callable the config will call, so a reader sees what a shared YAML runs."""
    if plan.components:
        print("components: " + ", ".join(f"{where} -> {target}" for where, target in plan.components))


def _configure_plan(parser: argparse.ArgumentParser) -> None:
    _configure_validate(parser)
    parser.add_argument("--no-estimate", action="store_true",
                        help="skip the memory estimate (it reads the checkpoint's config.json)")


def _run_validate(args: argparse.Namespace) -> int:
    plan = resolve(args, launch.world_size(args))
    _warn_unlaunched(plan, "validate")
    _warn_absent_checkpoints(plan)
    print(f"{args.config}: valid ({plan.method.descriptor.name} on {plan.family.descriptor.name}, "
          f"{plan.world_size} process(es))")
    _print_components(plan)
    return 0


def _warn_absent_checkpoints(plan: Any) -> None:
    """A local model path with no folder yet (an earlier step writes it: a warm start) leaves the config valid,
    but `train` needs it; a named family let the check skip reading its config.json."""
    from posttune.checkpoint.source import is_hub_id

    sections = [("model", plan.config.model), *((role.section, role.config) for role in plan.roles.values())]
    absent = {(section, str(model.path)) for section, model in sections if model.path is not None
              and not Path(str(model.path)).expanduser().is_dir() and not is_hub_id(str(model.path))}
    warn([f"{section}.path: no checkpoint at {path} yet: train needs it (an earlier step writes it?)"
          for section, path in sorted(absent)])


def _warn_unlaunched(plan: Any, command: str) -> None:
    """A config sized for several processes, resolved for one: its parallel plans were not checked for them."""
    sized = math.prod(degree for degree in plan.config.parallel.dims.values() if degree > 0)
    if plan.world_size == 1 and sized > 1:  # the config is for a launch this command is not checking
        warn([f"parallel.dims asks for {sized} processes; this {command} is for 1 (its parallel plans inactive and "
              f"unchecked): posttune {command} --nproc-per-node {sized} ... checks that launch"])


def _run_plan(args: argparse.Namespace) -> int:
    plan = resolve(args, launch.world_size(args))
    _warn_unlaunched(plan, "plan")
    _warn_absent_checkpoints(plan)
    width = max(len(step.stage) for step in plan.steps)
    what = max(len(step.what) for step in plan.steps)
    for step in plan.steps:
        print(f"{step.stage:<{width}}  {step.what:<{what}}  [{step.provider}]")
    _print_components(plan)
    if not args.no_estimate:
        from posttune.estimate import estimate

        try:
            print("\n".join(estimate(plan).lines()))
        except ConfigError:  # the model cannot be built as configured: train would refuse it too
            raise
        except PosttuneError as exc:  # e.g. a hub checkpoint while offline: the plan itself is fine
            print(f"memory estimate: not available ({exc})")
    return 0


def _run_train(args: argparse.Namespace) -> int:
    launch.check_slurm_tasks(args)
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else launch.world_size(args)
    plan = resolve(args, world)
    from posttune import training

    if launch.torchrun_args(args) and "LOCAL_RANK" not in os.environ:
        return launch.run_torchrun(args, training.WORKER_MODULE, [args.config, *args.overrides],
                                   Path(plan.config.checkpoint.output_dir))
    return training.run(plan)


# ---- posttune config keys / show (posttune/cli/config_keys.py) ---------------------------------

def _configure_config_command(parser: argparse.ArgumentParser) -> None:
    config_keys.configure(parser, show_arguments=_configure_validate)


def _run_config_command(args: argparse.Namespace) -> int:
    return config_keys.run(args, resolve=lambda args: resolve(args, launch.world_size(args)))


# ---- posttune download -----------------------------------------------------------------------

#: What `download` fetches: weights, config and tokenizer files; not original/*.pth duplicates.
DOWNLOAD_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.json", "tokenizer.model",
                     "*.tiktoken", "*.txt", "*.jinja"]
DOWNLOAD_EXCLUDES = ["original/*", "*.pth", "*.bin", "*.pt", "*.msgpack", "*.h5", "*.onnx"]


def _configure_download(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("repo_id", help="hub repository, e.g. Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--output", "-o", help="directory to write to (default: the hub cache)")
    parser.add_argument("--revision", help="branch, tag or commit")


def _run_download(args: argparse.Namespace) -> int:
    from huggingface_hub import snapshot_download

    from posttune import hub

    if not hub.offline_requested() and not hub.reachable():  # fail in seconds, not after a minute of retries
        raise PosttuneError(f"download of {args.repo_id} failed: the Hugging Face hub is unreachable (no answer "
                            f"from {hub.endpoint()} within {hub.PROBE_TIMEOUT:g} s); download on a machine with "
                            f"network and pass that local directory to model.path / tokenizer.path")
    try:
        path = snapshot_download(args.repo_id, revision=args.revision, local_dir=args.output,
                                 allow_patterns=DOWNLOAD_PATTERNS, ignore_patterns=DOWNLOAD_EXCLUDES)
    except Exception as exc:  # noqa: BLE001 - not found, gated, offline: one line each
        detail = first_line(str(exc))
        raise PosttuneError(f"download of {args.repo_id} failed: {type(exc).__name__}: {detail}") from None
    print(path)
    return 0


# ---- posttune plot ---------------------------------------------------------------------------

def _configure_plot(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output_dir", help="a run's output directory (holds metrics.jsonl)")
    parser.add_argument("-o", "--output", dest="out", metavar="PATH",
                        help="the image to write: a file (no suffix: .png added) or a directory (DIR/loss.png); "
                             "default: OUTPUT_DIR/loss.png")
    parser.add_argument("--out", dest="out", help=argparse.SUPPRESS)  # its first spelling, kept working


def plot_path(output_dir: str | Path, out: str | Path | None) -> Path:
    """The file `plot` writes, as it will be printed. matplotlib itself would write ``foo.png`` for ``foo`` and
    ``adir.png`` beside an existing directory ``adir``: both are settled here, so the path shown is the file."""
    if out is None:
        return Path(output_dir) / "loss.png"
    path = Path(out).expanduser()
    if path.is_dir() or str(out).endswith(("/", os.sep)):  # a trailing /: a folder meant, made by the writer
        return path / "loss.png"
    if path.suffix.lower().lstrip(".") not in _image_formats():
        return path.with_name(f"{path.name}.png")
    return path


def _image_formats() -> set[str]:
    """The suffixes matplotlib writes (png, svg, pdf, ...); just png where matplotlib is missing (plot says so)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return {"png"}
    return set(FigureCanvasBase.get_supported_filetypes())


def _run_plot(args: argparse.Namespace) -> int:
    from posttune.training.plot import plot_losses

    path = plot_path(args.output_dir, args.out)
    try:
        if args.out is not None and str(args.out).endswith(("/", os.sep)):
            path.parent.mkdir(parents=True, exist_ok=True)
        print(plot_losses(args.output_dir, path))
    except OSError as exc:  # a missing folder, a parent that is a file, no permission
        if exc.filename is not None and Path(exc.filename) != path:  # metrics.jsonl unreadable, say
            raise PosttuneError(f"{exc.filename}: {exc.strerror or exc}") from None
        raise cannot_write(path, exc) from None
    return 0


#: two command lines per command, shown under "examples:" in its --help
EXAMPLES = {
    "plugins": ("posttune plugins", "posttune plugins --json"),
    "ls": ("posttune ls", "posttune ls memory --json"),
    "cp": ("posttune cp llama-demo-reverse my-run.yaml", "posttune cp llama3.2-1b-lora configs/ --force"),
    "config": ("posttune config keys train", "posttune config show llama-demo-reverse train.lr=1e-3"),
    "validate": ("posttune validate my-run.yaml", "posttune validate llama-demo-reverse train.max_steps=10"),
    "plan": ("posttune plan my-run.yaml", "posttune plan --nproc-per-node 8 my-run.yaml train.batch_size=4"),
    "train": ("posttune train llama-demo-reverse", "posttune train --nproc-per-node 2 my-run.yaml train.lr=1e-4"),
    "plot": ("posttune plot runs/demo", "posttune plot runs/demo -o loss.png"),
    "download": ("posttune download Qwen/Qwen2.5-0.5B-Instruct",
                 "posttune download meta-llama/Llama-3.2-1B --output models/llama-1b  # gated: HF_TOKEN"),
}


def _command(name: str, help: str, configure: Any, run: Any) -> Command:
    return Command(name, help, configure, run, examples=EXAMPLES.get(name, ()))


@hookimpl
def posttune_register_commands(cli):
    cli(_command("plugins", "list installed plugins and what they register", _configure_plugins, _run_plugins))
    cli(_command("ls", f"list what the installed plugins register: {', '.join(LS_KINDS)}", _configure_ls,
                _run_ls))
    cli(_command("cp", "copy a bundled config to edit", _configure_cp, _run_cp))
    cli(_command("config", "list every config key with its default (keys), or print a resolved config (show)",
                _configure_config_command, _run_config_command))
    cli(_command("validate", "check a config against the installed plugins", _configure_validate, _run_validate))
    cli(_command("plan", "print the resolved plan in composition order, with a memory estimate",
                _configure_plan, _run_plan))
    cli(_command("train", "train from a config (torchrun options launch many processes)",
                _configure_validate, _run_train))
    cli(merge.COMMAND)
    cli(_command("plot", "plot a run's train and validation loss to a PNG", _configure_plot, _run_plot))
    cli(_command("download", "download a checkpoint's weights, config and tokenizer", _configure_download,
                _run_download))
    cli(Command("preview", preview.HELP, preview.configure, lambda args: preview.run(args, resolve),
                examples=preview.EXAMPLES))
