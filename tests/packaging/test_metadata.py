"""Every distribution's pyproject.toml carries what a release to PyPI needs, without building anything.

The distributions are found by walking the repository for pyproject.toml files, so a new one is
checked the moment it exists. The building itself (wheels and sdists, installed from the wheels
alone, a training run from there) is the `wheels` tox env: tests/packaging/wheels.py.
"""

import subprocess
import textwrap
from pathlib import Path

import pytest
from packaging.version import Version
from pyprojects import (
    ROOT,
    Distribution,
    core_version,
    distributions,
    metadata_problems,
    package_data_problems,
    pin_problems,
    readme_problems,
    tomllib,
    unknown_classifiers,
)

DISTRIBUTIONS = distributions()
NAMES = {dist.name for dist in DISTRIBUTIONS}
VERSION = core_version(DISTRIBUTIONS)


def test_the_repository_has_its_distributions():
    # The walk finds the core and the first-party families, methods and plans (not the workspace file).
    labels = {dist.label for dist in DISTRIBUTIONS}
    assert {"core", "posttune_models/qwen", "posttune_methods/grpo", "posttune_parallel/fsdp2",
            "plugins/template"} <= labels
    assert "." not in labels


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=lambda dist: dist.label)
def test_metadata(dist):
    problems = metadata_problems(dist, VERSION, NAMES)
    assert not problems, f"{dist.label}/pyproject.toml:\n  " + "\n  ".join(problems)


def test_distribution_names_are_unique():
    names = [dist.name for dist in DISTRIBUTIONS]
    assert len(names) == len(set(names)), sorted(names)


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=lambda dist: dist.label)
def test_classifiers_are_known_to_pypi(dist):
    import trove_classifiers  # a test dependency (tox.ini): its absence must fail, not skip

    assert unknown_classifiers(dist, set(trove_classifiers.classifiers)) == []


def test_build_artefacts_are_ignored():
    # egg-info, build/ and dist/ appear next to every pyproject.toml after a build: never committed.
    ignore = (ROOT / ".gitignore").read_text().split()
    assert {"*.egg-info/", "build/", "dist/"} <= set(ignore)
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    outputs = ("build/", "dist/", *(f"{d.label}/{folder}/" for d in DISTRIBUTIONS for folder in ("build", "dist")))
    committed = [path for path in tracked.splitlines() if ".egg-info/" in path or path.startswith(outputs)]
    assert committed == []


# The checks themselves, on made-up distributions: each problem they exist for is reported.

def made_up(tmp_path: Path, project: str, files: dict[str, str] | None = None) -> Distribution:
    text = textwrap.dedent(project)
    (tmp_path / "pyproject.toml").write_text(text)
    for name, content in (files or {}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    return Distribution(tmp_path, tomllib.loads(text))


def test_a_pin_that_disagrees_with_the_version_is_reported(tmp_path):
    dist = made_up(tmp_path, """
        [project]
        name = "posttune-x"
        dependencies = ["posttune>=0.1", "posttune-qwen>=0.1,<0.2", "torch>=2.6"]
        [project.optional-dependencies]
        more = ["posttune-grpo==0.0.9", "posttune-nowhere>=0.1,<0.2"]
        """)
    problems = pin_problems(dist, Version("0.1.0"), {"posttune", "posttune-qwen", "posttune-grpo"})
    assert len(problems) == 3, problems
    assert "'posttune>=0.1' must admit 0.1.0 and exclude 0.2" in problems[0]
    assert problems[1].startswith("optional-dependencies.more: 'posttune-grpo==0.0.9'")
    assert "posttune-nowhere" in problems[2] and "not in the repository" in problems[2]
    assert pin_problems(dist, Version("0.1.0"), NAMES | {"posttune-nowhere"})[:1] == problems[:1]


def test_missing_fields_and_licence_are_reported(tmp_path):
    dist = made_up(tmp_path, """
        [build-system]
        requires = ["setuptools>=68"]
        [project]
        name = "posttune-x"
        version = "0.2.0"
        license = { text = "BSD-3-Clause" }
        classifiers = ["License :: OSI Approved :: BSD License"]
        """, {"README.md": "# posttune-x\n\nSee [the guide](../../docs/plugins.md).\n\nMore.\n"})
    problems = "\n".join(metadata_problems(dist, Version("0.1.0"), NAMES))
    for expected in ("project.description is missing", "project.version 0.2.0 differs", "project.authors",
                     "project.keywords", "no 'Development Status :: ...'", "project.urls.Issues",
                     "project.readme is missing", "SPDX expression 'BSD-3-Clause'", "license-files",
                     "LICENSE does not exist", "drop them", "setuptools>=77"):
        assert expected in problems, expected
    dist = made_up(tmp_path, '[project]\nreadme = "README.md"\n')
    assert readme_problems(dist) == ["README.md: relative link '../../docs/plugins.md' is broken on PyPI "
                                     "(use https://github.com/posttune/posttune/blob/main/...)"]
    (tmp_path / "README.md").write_text("# x\n\n[a](https://github.com/posttune/posttune/blob/main/docs/no.md)\n"
                                        "[b](https://github.com/posttune/posttune/tree/main/core)\n")
    assert readme_problems(dist) == ["README.md: link https://github.com/posttune/posttune/blob/main/docs/no.md "
                                     "names a path that does not exist in the repository"]


def test_data_files_missing_from_package_data_are_reported(tmp_path):
    dist = made_up(tmp_path, """
        [project]
        name = "posttune-x"
        [tool.setuptools.package-data]
        posttune_x = ["configs/*", "gone/*.json"]
        """, {"posttune_x/__init__.py": "", "posttune_x/configs/a.yaml": "a: 1\n", "posttune_x/configs/.b.j2": "",
              "posttune_x/example/train.jsonl": "{}\n", "posttune_x/example/__init__.py": ""})
    problems = package_data_problems(dist)
    assert problems == [
        "tool.setuptools.package-data 'posttune_x': 'gone/*.json' matches no file",
        f"{tmp_path}/posttune_x/configs/.b.j2 is not package data: the wheel would not ship it "
        "(add it to tool.setuptools.package-data)",
        f"{tmp_path}/posttune_x/example/train.jsonl is not package data: the wheel would not ship it "
        "(add it to tool.setuptools.package-data)",
    ]
