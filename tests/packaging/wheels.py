"""The `wheels` tox env: every distribution builds, and posttune trains from the wheels alone.

0. The metadata checks of ``test_metadata.py`` (fields, license, pins, package data), and
   classifiers known to PyPI (``trove-classifiers``).
1. ``python -m build`` each distribution found in the tree (an sdist, then the wheel built from
   that sdist, so the sdist is proven complete) into one temporary folder.
2. Each artefact is checked: ``twine check --strict`` (the README renders as PyPI's long
   description), the version, the license expression and LICENSE file, and every file of the
   package folders (code, bundled configs, demo and example data) inside the wheel.
3. A fresh venv gets the third-party requirements of posttune, posttune-qwen, posttune-grpo and
   posttune-generate (grpo's engine) from the index, then those four from the wheel folder alone
   (``--no-index``): the first-party
   pins must resolve among the wheels. Imports must come from the venv's site-packages.
4. From a folder outside the repository, the GRPO example runs as a user would: its warm start
   (``python -m posttune_grpo.example prepare``), then a shortened
   ``posttune train grpo-tiny-reverse``, whose data and tokenizer are package data.

    tox -e wheels [-- --keep DIR]   # DIR (empty or new) keeps the checked wheels and sdists
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import venv
import zipfile
from concurrent.futures import ThreadPoolExecutor
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from pyprojects import (
    LICENSE,
    ROOT,
    Distribution,
    core_version,
    distributions,
    metadata_problems,
    unknown_classifiers,
)

CONSTRAINTS = ROOT / "constraints.txt"
INSTALLED = ["posttune", "posttune-qwen", "posttune-generate", "posttune-grpo"]
PACKAGES = ["posttune", "posttune_qwen", "posttune_generate", "posttune_grpo"]
PREPARE_STEPS = 20
TRAIN = ["train.max_steps=2", "train.eval_every=2", "train.log_every=1"]


def step(message: str) -> None:
    print(f"== {message}", flush=True)


def metadata(dists: list[Distribution]) -> list[str]:
    """test_metadata.py's checks, and classifiers PyPI knows, before spending minutes on builds."""
    import trove_classifiers

    version, names = core_version(dists), {dist.name for dist in dists}
    return [f"{dist.label}/pyproject.toml: {problem}" for dist in dists
            for problem in metadata_problems(dist, version, names)
            + [f"unknown classifier {c!r}" for c in unknown_classifiers(dist, set(trove_classifiers.classifiers))]]


def build(dist: Distribution, outdir: Path) -> tuple[Distribution, subprocess.CompletedProcess]:
    """sdist, then the wheel from the unpacked sdist (build's default), into ``outdir``."""
    run = subprocess.run([sys.executable, "-m", "build", "--outdir", str(outdir), str(dist.folder)],
                         capture_output=True, text=True)
    return dist, run


def build_all(dists: list[Distribution], outdir: Path) -> list[str]:
    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda dist: build(dist, outdir), dists))
    problems = []
    for dist, run in results:
        if run.returncode != 0:
            problems.append(f"{dist.label}: python -m build failed ({run.returncode}):\n{run.stdout[-3000:]}"
                            f"{run.stderr[-3000:]}")
    return problems


def artefact_stem(dist: Distribution) -> str:
    """The file-name stem build gives both artefacts: the name normalised with underscores, and the version."""
    return f"{dist.name.replace('-', '_')}-{dist.project['version']}"


def package_files(dist: Distribution) -> list[str]:
    """Every file of the distribution's top-level packages, relative to where the packages live."""
    find = dist.pyproject.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {})
    where = dist.folder / find.get("where", ["."])[0]
    includes = [pattern.rstrip("*") for pattern in find.get("include", [])]
    files = []
    for package in sorted(p for p in where.iterdir() if (p / "__init__.py").is_file()):
        if includes and not any(package.name.startswith(prefix) for prefix in includes):
            continue
        for file in sorted(package.rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts and file.suffix != ".pyc":
                files.append(file.relative_to(where).as_posix())
    return files


def wheel_problems(dist: Distribution, wheel: Path) -> list[str]:
    version = dist.project["version"]
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"{artefact_stem(dist)}.dist-info"
        metadata = Parser().parsestr(archive.read(f"{info}/METADATA").decode())
    problems = []
    if metadata["Version"] != version:
        problems.append(f"{wheel.name}: METADATA Version {metadata['Version']} != {version}")
    if metadata["License-Expression"] != LICENSE:
        problems.append(f"{wheel.name}: METADATA License-Expression {metadata['License-Expression']!r}")
    if f"{info}/licenses/LICENSE" not in names:
        problems.append(f"{wheel.name}: no {info}/licenses/LICENSE")
    missing = [path for path in package_files(dist) if path not in names]
    if missing:
        problems.append(f"{wheel.name}: missing {len(missing)} file(s) of the source tree: {missing[:10]}")
    return problems


def sdist_problems(dist: Distribution, sdist: Path) -> list[str]:
    with tarfile.open(sdist) as archive:
        names = set(archive.getnames())
    top = artefact_stem(dist)
    readme = dist.project.get("readme")
    readme = readme.get("file") if isinstance(readme, dict) else readme
    wanted = ["pyproject.toml", "LICENSE", str(readme)]
    return [f"{sdist.name}: no {name}" for name in wanted if f"{top}/{name}" not in names]


def artefact_problems(dists: list[Distribution], outdir: Path) -> list[str]:
    problems = []
    for dist in dists:
        stem = artefact_stem(dist)
        wheels = sorted(outdir.glob(f"{stem}-*.whl"))
        sdist = outdir / f"{stem}.tar.gz"
        if len(wheels) != 1 or not sdist.is_file():
            problems.append(f"{dist.label}: expected one {stem}-*.whl and {stem}.tar.gz, found "
                            f"{[w.name for w in wheels]} and sdist={sdist.is_file()}")
            continue
        if not wheels[0].name.endswith("-py3-none-any.whl"):
            problems.append(f"{wheels[0].name}: not a pure-Python wheel")
        problems += wheel_problems(dist, wheels[0]) + sdist_problems(dist, sdist)
    twine = subprocess.run([sys.executable, "-m", "twine", "check", "--strict",
                            *sorted(str(p) for p in outdir.iterdir())], capture_output=True, text=True)
    if twine.returncode != 0:
        problems.append(f"twine check --strict failed:\n{twine.stdout}{twine.stderr}")
    return problems


def wheel_metadata(outdir: Path, name: str) -> dict:
    wheel = next(outdir.glob(f"{canonicalize_name(name).replace('-', '_')}-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        info = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(archive.read(info).decode())


def third_party_requirements(outdir: Path, names: list[str], ours: set[str]) -> list[str]:
    """The requirements outside ours of ``names`` and of the first-party distributions they pull in."""
    found, todo, seen = [], list(names), set()
    while todo:
        name = str(canonicalize_name(todo.pop()))
        if name in seen:
            continue
        seen.add(name)
        for text in wheel_metadata(outdir, name).get_all("Requires-Dist") or []:
            requirement = Requirement(text)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            if canonicalize_name(requirement.name) in ours:
                todo.append(requirement.name)
            elif text not in found:
                found.append(str(requirement))
    return found


def clean_env(venv_dir: Path) -> dict[str, str]:
    """The environment of a user's shell with the venv activated: nothing points into the repository."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(VIRTUAL_ENV=str(venv_dir), PYTHONNOUSERSITE="1", PATH=f"{venv_dir / 'bin'}{os.pathsep}{env['PATH']}")
    return env


def run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    start = time.monotonic()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    print(f"   ({time.monotonic() - start:.0f} s, exit {done.returncode})", flush=True)
    return done


def install(outdir: Path, venv_dir: Path, ours: set[str], work: Path) -> list[str]:
    venv.create(venv_dir, with_pip=True)
    env, python = clean_env(venv_dir), str(venv_dir / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS)]
    third_party = third_party_requirements(outdir, INSTALLED, ours)
    step(f"pip install (index) {' '.join(third_party)}")
    done = run([*pip, *third_party], work, env)
    if done.returncode != 0:
        return [f"installing the third-party requirements failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"]
    step(f"pip install --no-index --find-links WHEELS {' '.join(INSTALLED)}")
    done = run([*pip, "--no-index", "--find-links", str(outdir), *INSTALLED], work, env)
    if done.returncode != 0:
        return [f"installing from the wheels alone failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"]
    return installed_problems(python, venv_dir, work, env)


WHERE = """
import importlib, importlib.metadata as md, json, sys
packages, dists = sys.argv[1].split(","), sys.argv[2].split(",")
print(json.dumps({"files": {p: importlib.import_module(p).__file__ for p in packages},
                  "direct_url": {d: md.distribution(d).read_text("direct_url.json") for d in dists},
                  "versions": {d: md.version(d) for d in dists}}))
"""


def installed_problems(python: str, venv_dir: Path, work: Path, env: dict[str, str]) -> list[str]:
    """Our packages import from the venv (not the source tree) and were installed from wheel files."""
    where = run([python, "-c", WHERE, ",".join(PACKAGES), ",".join(INSTALLED)], work, env)
    if where.returncode != 0:
        return [f"importing {PACKAGES} failed: {where.stderr[-2000:]}"]
    report = json.loads(where.stdout)
    print(json.dumps(report["versions"]))
    problems = []
    for package, file in report["files"].items():
        path = Path(file).resolve()
        if not path.is_relative_to(venv_dir.resolve()) or path.is_relative_to(ROOT):
            problems.append(f"{package} imports from {path}, not from the venv's site-packages")
    problems += [f"{dist} was installed from {url} (editable or a folder), not from a wheel"
                 for dist, url in report["direct_url"].items() if url is not None]
    check = run([python, str(ROOT / "tests/isolation/check_plugins.py"), *INSTALLED], work, env)
    print(check.stdout, end="")
    if check.returncode != 0:
        problems.append(f"posttune plugins: {check.stderr.strip()}")
    return problems


def train(venv_dir: Path, work: Path) -> list[str]:
    env, bin_dir = clean_env(venv_dir), venv_dir / "bin"
    step(f"python -m posttune_grpo.example prepare --steps {PREPARE_STEPS}   (cwd {work})")
    prepare = run([str(bin_dir / "python"), "-m", "posttune_grpo.example", "prepare", "--steps",
                   str(PREPARE_STEPS)], work, env)
    if prepare.returncode != 0:
        return [f"prepare -> {prepare.returncode}: {prepare.stdout[-2000:]}{prepare.stderr[-2000:]}"]
    step(f"posttune train grpo-tiny-reverse {' '.join(TRAIN)}")
    trained = run([str(bin_dir / "posttune"), "train", "grpo-tiny-reverse", *TRAIN], work, env)
    print(trained.stdout[-1500:], end="")
    output = work / "outputs" / "grpo-tiny-reverse"
    if trained.returncode != 0:
        return [f"posttune train grpo-tiny-reverse -> {trained.returncode}: {trained.stderr[-3000:]}"]
    if not (output / "model" / "config.json").is_file():
        return [f"posttune train grpo-tiny-reverse left no {output}/model/config.json"]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="keep the wheels and sdists in this folder (empty or new)")
    args = parser.parse_args(argv)
    dists = distributions()
    ours = {dist.name for dist in dists}
    step(f"{len(dists)} distributions, version {core_version(dists)}: {', '.join(d.label for d in dists)}")
    with tempfile.TemporaryDirectory(prefix="posttune-wheels-") as tmp:
        tmp = Path(tmp)
        outdir = args.keep.resolve() if args.keep else tmp / "dist"
        outdir.mkdir(parents=True, exist_ok=True)
        if any(outdir.iterdir()):
            print(f"FAIL: {outdir} is not empty", file=sys.stderr)
            return 1
        work = tmp / "work"
        work.mkdir()
        stages = [("metadata", lambda: metadata(dists)),
                  ("build", lambda: build_all(dists, outdir)),
                  ("check the wheels and sdists", lambda: artefact_problems(dists, outdir)),
                  ("install from the wheels", lambda: install(outdir, tmp / "venv", ours, work)),
                  ("train from the installed wheels", lambda: train(tmp / "venv", work))]
        for title, stage in stages:
            start = time.monotonic()
            step(title)
            problems = stage()
            step(f"{title}: {time.monotonic() - start:.0f} s")
            for problem in problems:
                print(f"FAIL: {problem}", file=sys.stderr)
            if problems:
                return 1
    print("wheels: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
