"""Every distribution in the repository, found by its pyproject.toml, and the checks its metadata must pass.

Shared by ``test_metadata.py`` (fast, no build) and ``wheels.py`` (the `wheels` tox env). A new
distribution is picked up as soon as its ``pyproject.toml`` exists: nothing here lists them by name.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
CORE = "posttune"
LICENSE = "BSD-3-Clause"
REPOSITORY = "https://github.com/posttune/posttune"
URL_KEYS = ("Homepage", "Documentation", "Source", "Issues")
#: Each distribution's classifiers carry at least one of each kind.
CLASSIFIER_KINDS = ("Development Status :: ", "Intended Audience :: ", "Programming Language :: Python :: 3",
                    "Topic :: ")
#: setuptools reads `license = "SPDX"` and `license-files` (PEP 639) from this release on.
SETUPTOOLS_FOR_PEP639 = Version("77.0")
#: Folders never searched for distributions: tool and build folders, and tests/ (tests/third_party is a
#: test-only plugin that its tests install as pip would; it is never built or published)
SKIP_DIRS = {".git", ".venv", ".ci-venv", ".tox", "build", "dist", "node_modules", "__pycache__", "outputs", "tests"}
#: Files in a package folder that are code (built into the wheel without package-data).
CODE_SUFFIXES = {".py"}


@dataclass(frozen=True)
class Distribution:
    """One distribution's folder and its parsed pyproject.toml."""

    folder: Path
    pyproject: dict

    @property
    def project(self) -> dict:
        return self.pyproject.get("project", {})

    @property
    def name(self) -> str:
        return str(canonicalize_name(self.project.get("name", self.folder.name)))

    @property
    def label(self) -> str:
        return shown(self.folder)


def shown(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it (messages name repository paths)."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def distributions(root: Path = ROOT) -> list[Distribution]:
    """Every folder under ``root`` whose pyproject.toml has a ``[project]`` table, sorted by path.

    The workspace's own pyproject.toml (tool settings only, no ``[project]``) is not a distribution.
    """
    found = []
    for current, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        if "pyproject.toml" in files:
            folder = Path(current)
            data = tomllib.loads((folder / "pyproject.toml").read_text())
            if "project" in data:
                found.append(Distribution(folder, data))
    return sorted(found, key=lambda dist: dist.label)


def core_version(dists: list[Distribution]) -> Version:
    """The core's version: every first-party pin must admit it."""
    for dist in dists:
        if dist.name == CORE:
            return Version(dist.project["version"])
    raise LookupError("no distribution named posttune (core/pyproject.toml)")


def first_party(requirement: Requirement, names: set[str]) -> bool:
    """A requirement on one of ours: a distribution in this repository, or any `posttune*` name."""
    name = canonicalize_name(requirement.name)
    return name in names or name == CORE or name.startswith(f"{CORE}-")


def next_minor(version: Version) -> Version:
    return Version(f"{version.major}.{version.minor + 1}")


def pin_problems(dist: Distribution, version: Version, names: set[str]) -> list[str]:
    """First-party requirements that do not admit ``version`` or admit the next minor release."""
    problems = []
    project = dist.project
    groups = {"dependencies": project.get("dependencies", [])}
    groups.update({f"optional-dependencies.{extra}": reqs
                   for extra, reqs in project.get("optional-dependencies", {}).items()})
    for where, requirements in groups.items():
        for text in requirements:
            requirement = Requirement(text)
            if not first_party(requirement, names):
                continue
            if canonicalize_name(requirement.name) not in names:
                problems.append(f"{where}: {text!r} names a distribution that is not in the repository")
            spec = requirement.specifier
            if not spec.contains(version, prereleases=True) or spec.contains(next_minor(version), prereleases=True):
                problems.append(f"{where}: {text!r} must admit {version} and exclude {next_minor(version)} "
                                f"(write '{requirement.name}>={version.major}.{version.minor},"
                                f"<{next_minor(version)}')")
    return problems


def repository_path(url: str) -> str | None:
    """The repository path a `.../blob/main/PATH` or `.../tree/main/PATH` URL names, else None."""
    match = re.match(rf"{re.escape(REPOSITORY)}/(?:blob|tree)/main/([^#?]+)", url)
    return match.group(1).rstrip("/") if match else None


def missing_targets(urls: list[str]) -> list[str]:
    """URLs into this repository's main branch whose file or folder does not exist here."""
    return [url for url in urls if (path := repository_path(url)) is not None and not (ROOT / path).exists()]


def readme_problems(dist: Distribution) -> list[str]:
    """The long description exists, has a content type PyPI renders, and links nothing relative."""
    readme = dist.project.get("readme")
    if readme is None:
        return ["project.readme is missing (PyPI shows an empty page)"]
    if isinstance(readme, dict):
        path, content_type = readme.get("file"), readme.get("content-type")
    else:
        path = readme
        content_type = {".md": "text/markdown", ".rst": "text/x-rst"}.get(Path(readme).suffix.lower())
    if content_type not in ("text/markdown", "text/x-rst"):
        return [f"project.readme {readme!r}: content type {content_type!r} is not markdown or reStructuredText"]
    file = dist.folder / str(path)
    if not file.is_file():
        return [f"project.readme: {shown(file)} does not exist"]
    text = file.read_text()
    problems = []
    if content_type == "text/markdown" and not text.startswith("# "):
        problems.append(f"{path}: does not start with a '# title' line")
    if len(text.strip().splitlines()) < 3:
        problems.append(f"{path}: fewer than three lines: say what the distribution is and how to use it")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not target.startswith(("https://", "http://", "#", "mailto:")):
            problems.append(f"{path}: relative link {target!r} is broken on PyPI (use {REPOSITORY}/blob/main/...)")
    problems += [f"{path}: link {url} names a path that does not exist in the repository"
                 for url in missing_targets(re.findall(r"\]\(([^)\s]+)\)", text))]
    return problems


def license_problems(dist: Distribution) -> list[str]:
    project = dist.project
    problems = []
    if project.get("license") != LICENSE:
        problems.append(f"project.license must be the SPDX expression {LICENSE!r}, not {project.get('license')!r}")
    files = project.get("license-files")
    if not files or "LICENSE" not in files:
        problems.append("project.license-files must list 'LICENSE'")
    license_file = dist.folder / "LICENSE"
    if not license_file.is_file():
        problems.append(f"{dist.label}/LICENSE does not exist")
    elif license_file.read_text() != (ROOT / "LICENSE").read_text():
        problems.append(f"{dist.label}/LICENSE differs from the repository's LICENSE")
    licence_classifiers = [c for c in project.get("classifiers", []) if c.startswith("License ::")]
    if licence_classifiers:
        problems.append(f"classifiers {licence_classifiers}: drop them, project.license is the SPDX expression "
                        "(setuptools refuses both)")
    requires = dist.pyproject.get("build-system", {}).get("requires", [])
    setuptools = [Requirement(r) for r in requires if canonicalize_name(Requirement(r).name) == "setuptools"]
    if not setuptools or any(s.specifier.contains(Version("76.99"), prereleases=True) for s in setuptools):
        problems.append(f"build-system.requires must ask for setuptools>={SETUPTOOLS_FOR_PEP639} "
                        f"(the SPDX license field), got {requires}")
    return problems


def package_data_problems(dist: Distribution) -> list[str]:
    """Every non-code file inside a package folder is declared as package data (so the wheel ships it),
    and every package-data pattern still matches something."""
    setuptools = dist.pyproject.get("tool", {}).get("setuptools", {})
    where = dist.folder / (setuptools.get("packages", {}).get("find", {}).get("where", ["."])[0])
    includes = setuptools.get("packages", {}).get("find", {}).get("include", [])
    package_data = setuptools.get("package-data", {})
    top = sorted(p.name for p in where.iterdir() if (p / "__init__.py").is_file()
                 and (not includes or any(fnmatch.fnmatch(p.name, pattern) for pattern in includes)))
    problems = []
    covered: set[Path] = set()
    for package, patterns in package_data.items():
        bases = [where / name for name in top] if package in ("", "*") else [where / package.replace(".", "/")]
        for pattern in patterns:
            # glob.glob as setuptools does: `*` skips dot-files (`.gitignore.j2` needs its own pattern)
            matched = {Path(f) for base in bases for f in glob.glob(str(base / pattern), recursive=True)
                       if Path(f).is_file()}
            if not matched:
                problems.append(f"tool.setuptools.package-data {package!r}: {pattern!r} matches no file")
            covered |= matched
    for name in top:
        for file in sorted((where / name).rglob("*")):
            if not file.is_file() or "__pycache__" in file.parts or file.suffix in CODE_SUFFIXES | {".pyc"}:
                continue
            if file not in covered:
                problems.append(f"{shown(file)} is not package data: the wheel would not ship it "
                                "(add it to tool.setuptools.package-data)")
    return problems


def version_literal_problems(dist: Distribution) -> list[str]:
    """A ``__version__ = "..."`` written in a package's ``__init__.py`` or ``version.py`` agrees with
    project.version (a release bumps both)."""
    problems = []
    version = dist.project.get("version")
    for file in sorted(dist.folder.glob("*/__init__.py")) + sorted(dist.folder.glob("*/version.py")):
        for found in re.findall(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", file.read_text(), re.MULTILINE):
            if found != version:
                problems.append(f"{shown(file)}: __version__ = {found!r} differs from project.version {version!r}")
    return problems


def metadata_problems(dist: Distribution, version: Version, names: set[str]) -> list[str]:
    """Everything a release needs from one distribution's [project] table, as one message per problem."""
    project = dist.project
    problems = []
    if not dist.name.startswith(CORE):
        problems.append(f"project.name {project.get('name')!r} does not start with 'posttune'")
    for field in ("name", "version", "description", "requires-python"):
        if not project.get(field):
            problems.append(f"project.{field} is missing")
    if project.get("version") and Version(project["version"]) != version:
        problems.append(f"project.version {project['version']} differs from the core's {version} "
                        "(first-party distributions are released together)")
    if not any(author.get("name") for author in project.get("authors", [])):
        problems.append("project.authors is missing (a list of {name = ...})")
    if not project.get("keywords"):
        problems.append("project.keywords is missing")
    classifiers = project.get("classifiers", [])
    for kind in CLASSIFIER_KINDS:
        if not any(c.startswith(kind) for c in classifiers):
            problems.append(f"project.classifiers has no '{kind}...'")
    urls = project.get("urls", {})
    for key in URL_KEYS:
        if not str(urls.get(key, "")).startswith(REPOSITORY):
            problems.append(f"project.urls.{key} is missing or not under {REPOSITORY}")
    problems += [f"project.urls: {url} names a path that does not exist in the repository"
                 for url in missing_targets([str(url) for url in urls.values()])]
    problems += readme_problems(dist)
    problems += license_problems(dist)
    problems += pin_problems(dist, version, names)
    problems += package_data_problems(dist)
    problems += version_literal_problems(dist)
    return problems


def unknown_classifiers(dist: Distribution, known: set[str]) -> list[str]:
    """Classifiers PyPI would refuse on upload (``known``: trove_classifiers.classifiers)."""
    return [c for c in dist.project.get("classifiers", []) if c not in known]
