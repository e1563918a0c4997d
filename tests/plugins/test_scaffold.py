"""`posttune new plugin NAME --kind KIND`: the distribution it writes installs, registers and passes its own tests.

Two paths. The fast one, for every kind: the generated folder is made importable and "installed"
for importlib.metadata by a ``.dist-info`` with its ``posttune`` entry point on ``PYTHONPATH`` (no
pip, so the dev venv stays as it is), then its own tests run in a fresh interpreter and
``posttune ls`` finds the plugin through the entry point. The slow one, for ``--kind method``:
``pip install`` of the core, posttune-llama and the generated distribution into a brand-new venv,
where ``posttune ls`` lists it and its tests pass with nothing else installed. And for every
kind, the generated pyproject.toml passes the release checks of the first-party distributions
(tests/packaging/pyprojects.py) but for what only the plugin's author can fill in.
"""

from __future__ import annotations

import filecmp
import importlib.util
import os
import subprocess
import sys
import venv
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.version import Version
from posttune_scaffold.scaffold import KINDS, TEMPLATES, plugin_names
from posttune.testing import run_cli
from posttune import __version__

ROOT = Path(__file__).resolve().parents[2]
#: kind -> what `posttune ls` lists it under
LISTED = {"family": "families", "method": "methods", "preference": "methods", "online": "methods", "reward": "rewards",
          "dataset": "datasets", "command": None, "technique": "memory", "plan": "plans", "tracker": "loggers"}


def generate(kind: str, name: str, out: Path) -> Path:
    result = run_cli("new", "plugin", name, "--kind", kind, "-o", str(out))
    assert result.exit_code == 0, result.stderr
    return out / f"posttune-{name}"


def fake_install(root: Path, site: Path) -> dict[str, str]:
    """An environment in which ``root``'s package imports and its entry point is installed."""
    names = plugin_names(root.name[len("posttune-"):])
    info = site / f"{names.package}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {names.distribution}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[posttune]\n{names.name} = {names.package}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(root)]), "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def own_tests(tmp_path_factory) -> dict[str, tuple[Path, dict[str, str], Future]]:
    """Every kind's generated plugin, fake-installed, with its own tests running in a fresh interpreter, two
    at a time (each one process, mostly one core): kind -> (its folder, its environment, the pytest run)."""
    pool = ThreadPoolExecutor(2)
    runs = {}
    for kind in KINDS:  # generated here, one after the other: `posttune new` runs in this process
        tmp_path = tmp_path_factory.mktemp(f"plugin-{kind}")
        root = generate(kind, f"demo-{kind}", tmp_path)
        env = fake_install(root, tmp_path / "site")
        runs[kind] = (root, env, pool.submit(
            subprocess.run, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=root,
            env=env, capture_output=True, text=True, timeout=300))
    yield runs
    pool.shutdown(cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_generated_plugin_is_found_and_passes_its_own_tests(kind, own_tests):
    name = f"demo-{kind}"
    root, env, running = own_tests[kind]
    tests = running.result()
    summary = tests.stdout.strip().splitlines()[-1]
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    # every first-party plugin is installed here, so the tests that need one run too
    assert " passed" in summary and "skipped" not in summary, summary
    plugins = subprocess.run([sys.executable, "-m", "posttune.cli.main", "plugins"], env=env, capture_output=True,
                             text=True, timeout=120)
    assert f"posttune-{name} 0.1.0  (demo_{kind})" in plugins.stdout, plugins.stdout + plugins.stderr
    if LISTED[kind]:
        listed = subprocess.run([sys.executable, "-m", "posttune.cli.main", "ls", LISTED[kind]], env=env,
                                capture_output=True, text=True, timeout=120)
        rows = [line.split()[:3] for line in listed.stdout.splitlines()]
        assert [f"demo_{kind}", f"posttune-{name}", "0.1.0"] in rows, listed.stdout + listed.stderr


def test_help_names_every_kind_with_what_it_writes():
    shown = " ".join(run_cli("new", "--help").stdout.split())  # argparse wraps the lines
    assert f"--kind {{{','.join(KINDS)}}}" in shown
    for kind in KINDS.values():
        assert f"{kind.name}: {kind.about}" in shown


def test_the_docs_list_every_kind():
    """docs/plugins.md's table of kinds ("Start here") and the command table of docs/config.md."""
    start_here = (ROOT / "docs" / "plugins.md").read_text().split("## Start here")[1].split("\n## ")[0]
    assert [kind for kind in KINDS if f"\n| `{kind}` | " not in start_here] == []
    bar = "\\|"
    assert f"posttune new plugin NAME [--kind {bar.join(KINDS)}]" in (ROOT / "docs" / "config.md").read_text()


def test_it_writes_a_distribution_and_says_what_to_do_next(tmp_path):
    result = run_cli("new", "plugin", "my-loss", "--kind", "method", "-o", str(tmp_path))
    assert result.exit_code == 0, result.stderr
    root = tmp_path / "posttune-my-loss"
    written = sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())
    assert written == [".gitignore", "LICENSE", "README.md", "posttune_my_loss/__init__.py",
                       "posttune_my_loss/configs/my-loss-llama-tiny.yaml", "posttune_my_loss/data/train.jsonl",
                       "posttune_my_loss/data/validation.jsonl", "posttune_my_loss/method.py",
                       "posttune_my_loss/tokenizer/tokenizer.json", "posttune_my_loss/tokenizer/tokenizer_config.json",
                       "pyproject.toml", "tests/conftest.py", "tests/test_my_loss.py"]
    pyproject = (root / "pyproject.toml").read_text()
    assert 'name = "posttune-my-loss"' in pyproject
    assert '[project.entry-points.posttune]\nmy_loss = "posttune_my_loss"' in pyproject
    assert 'posttune>=0.1,<0.2' in pyproject
    assert f"wrote {root}/ (method 'my_loss', distribution posttune-my-loss):" in result.stdout
    assert f"  pytest {root / 'tests'}  " in result.stdout


def packaging_checks():
    """tests/packaging/pyprojects.py, the release checks of the first-party distributions (loaded by path:
    tests/ is not a package)."""
    if "pyprojects" not in sys.modules:
        spec = importlib.util.spec_from_file_location("pyprojects", ROOT / "tests" / "packaging" / "pyprojects.py")
        sys.modules["pyprojects"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["pyprojects"]


#: what the release checks demand of first-party distributions only: URLs into posttune's repository,
#: posttune's own LICENSE (copyright line included) and the core's version
FIRST_PARTY_ONLY = ("project.urls.", "LICENSE differs from the repository's LICENSE", "differs from the core's")


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_generated_pyproject_is_ready_to_publish_once_the_placeholders_are_filled(kind, tmp_path):
    import trove_classifiers  # a test dependency (tox.ini), as for tests/packaging

    checks = packaging_checks()
    root = generate(kind, f"demo-{kind}", tmp_path)
    dist = checks.Distribution(root, checks.tomllib.loads((root / "pyproject.toml").read_text()))
    problems = checks.metadata_problems(dist, Version(__version__), {"posttune", "posttune-grpo"})
    assert [p for p in problems if not any(mark in p for mark in FIRST_PARTY_ONLY)] == []
    assert checks.unknown_classifiers(dist, set(trove_classifiers.classifiers)) == []
    assert set(checks.URL_KEYS) <= set(dist.project["urls"])
    # the licence text is the repository's BSD-3-Clause but for the copyright holder: the plugin's author
    license_lines = (root / "LICENSE").read_text().splitlines()
    assert license_lines[3:] == (ROOT / "LICENSE").read_text().splitlines()[3:]
    # what only the author knows is marked TODO, where the pyproject's header says to look
    todo = [line.strip() for path in ("pyproject.toml", "LICENSE") for line in (root / path).read_text().splitlines()
            if "TODO" in line and not line.startswith("#")]
    assert todo == ['authors = [{ name = "TODO: your name" }]',
                    *(f'{key} = "https://github.com/TODO-your-account/posttune-demo-{kind}{tail}"'
                      for key, tail in (("Homepage", ""), ("Documentation", "#readme"), ("Source", ""),
                                        ("Issues", "/issues"))),
                    f"Copyright (c) {license_lines[2].split()[2]} TODO: your name"]


#: what `--kind online` may import: posttune's public surface and posttune-grpo's reward-scoring API
#: (docs/plugins.md, "Scoring rewards in a method of your own")
ONLINE_IMPORTS = {"posttune.plugin": None, "posttune_grpo.scoring": {"RewardSpec", "check_rewards", "resolve_rewards",
                                                                    "score_batch"},
                  "posttune_grpo.reward_workers": {"close_shared_pool"}}


def test_the_online_method_is_short_and_uses_only_documented_names(tmp_path):
    import ast

    root = generate("online", "demo-online", tmp_path)
    package = root / "posttune_demo_online"
    assert sum(len(path.read_text().splitlines()) for path in package.glob("*.py")) <= 250
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not any(alias.name.startswith("posttune") for alias in node.names), (path.name, node.names)
            elif isinstance(node, ast.ImportFrom) and node.module.startswith("posttune"):
                if node.module == "posttune_demo_online":
                    continue
                assert node.module in ONLINE_IMPORTS, (path.name, node.module)
                allowed = ONLINE_IMPORTS[node.module]
                assert allowed is None or {alias.name for alias in node.names} <= allowed, (path.name, node.module)
    assert '"posttune-grpo>=' in (root / "pyproject.toml").read_text()


def test_the_shipped_tokenizer_is_the_tiny_chatml_tokenizer(tmp_path):
    """The template's tokenizer files are what posttune.testing builds (rebuild them if this fails)."""
    from posttune.tiny_tokenizer import save_tiny_tokenizer

    fresh = save_tiny_tokenizer(tmp_path / "tok", template="chatml")
    files = sorted(path.name for path in (TEMPLATES / "tokenizer").iterdir())
    assert files == ["tokenizer.json", "tokenizer_config.json"]
    match, mismatch, errors = filecmp.cmpfiles(TEMPLATES / "tokenizer", fresh, files, shallow=False)
    assert (mismatch, errors) == ([], [])


@pytest.mark.parametrize("name, problem", [
    ("9lives", "expected lowercase letters, digits, '-' or '_', starting with a letter"),
    ("MyPlugin", "expected lowercase letters, digits, '-' or '_', starting with a letter"),
    ("my.plugin", "expected lowercase letters, digits, '-' or '_', starting with a letter"),
    ("class", "a Python keyword cannot name a package; choose another name"),
    ("posttune-foo", "give it without the 'posttune-' prefix (the distribution becomes posttune-foo)"),
])
def test_a_name_that_cannot_name_a_package_is_refused_in_one_line(name, problem, tmp_path):
    result = run_cli("new", "plugin", name, "-o", str(tmp_path))
    assert result.exit_code == 2
    assert result.stderr.startswith(f"posttune: error: plugin name '{name}': ") and problem in result.stderr
    assert result.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_an_existing_folder_is_never_overwritten(tmp_path):
    (tmp_path / "posttune-demo").mkdir()
    (tmp_path / "posttune-demo" / "mine.txt").write_text("keep")
    result = run_cli("new", "plugin", "demo", "-o", str(tmp_path))
    assert result.exit_code == 2
    assert result.stderr == (f"posttune: error: {tmp_path / 'posttune-demo'} exists; remove it or choose another "
                             f"name or -o DIR (nothing was written)\n")
    assert [p.name for p in (tmp_path / "posttune-demo").iterdir()] == ["mine.txt"]


@pytest.fixture
def scaffold_cli(posttune_cli, register_plugin):
    """The CLI against the isolated plugin set (the core's built-ins) plus posttune-scaffold."""
    import posttune_scaffold

    register_plugin(posttune_scaffold, name="scaffold", distribution="posttune-scaffold")
    return posttune_cli


def test_without_posttune_scaffold_the_command_names_its_distribution(posttune_cli, tmp_path):
    result = posttune_cli("new", "plugin", "demo", "-o", str(tmp_path))
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("posttune: error: no command 'new' is installed (installed: ")
    assert result.stderr.endswith(" — pip install posttune-scaffold\n")
    assert list(tmp_path.iterdir()) == []


def test_a_name_another_plugin_registers_is_refused(scaffold_cli, tmp_path):
    result = scaffold_cli("new", "plugin", "chat", "--kind", "dataset", "-o", str(tmp_path))  # a built-in format
    assert result.exit_code == 2
    assert result.stderr.startswith("posttune: error: dataset format 'chat' is already registered by posttune ")
    assert list(tmp_path.iterdir()) == []


def test_the_name_of_an_installed_distribution_is_refused(scaffold_cli, tmp_path):
    """posttune-sft registers no reward named 'sft', but a reward scaffold named so would be posttune-sft itself."""
    result = scaffold_cli("new", "plugin", "sft", "--kind", "reward", "-o", str(tmp_path))
    assert (result.exit_code, result.stderr) == (2, "posttune: error: posttune-sft (package posttune_sft) is installed "
                                                    "already; installing the new plugin would replace it (choose "
                                                    "another name)\n")
    assert list(tmp_path.iterdir()) == []


def test_a_missing_output_folder_is_made_and_a_file_there_is_an_error(tmp_path):
    made = run_cli("new", "plugin", "demo", "-o", str(tmp_path / "new" / "folder"))
    assert made.exit_code == 0, made.stderr
    assert (tmp_path / "new" / "folder" / "posttune-demo" / "pyproject.toml").is_file()
    (tmp_path / "file").write_text("")
    for under in (tmp_path / "file", tmp_path / "file" / "sub"):  # the second: a traceback before
        result = run_cli("new", "plugin", "demo", "-o", str(under))
        assert (result.exit_code, result.stderr) == (2, f"posttune: error: {tmp_path / 'file'}: not a directory\n")


@pytest.mark.slow
@pytest.mark.extended  # a venv and pip: minutes; tox -e isolation does the same for the first-party ones
def test_pip_install_into_a_fresh_venv_then_its_tests_pass(tmp_path):
    """What a plugin author does: generate, pip install next to posttune, run the plugin's tests."""
    root = generate("method", "demo", tmp_path)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"),
                              str(ROOT / "core"), str(ROOT / "posttune_models" / "llama"), f"{root}[test]"],
                             env=env, capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    listed = subprocess.run([str(env_dir / "bin" / "posttune"), "ls", "methods"], env=env, capture_output=True,
                            text=True, cwd=tmp_path, timeout=120)
    assert listed.stdout.split() == ["demo", "posttune-demo", "0.1.0", "token", "cross-entropy", "with", "label",
                                     "smoothing", "and", "z-loss", "(posttune-demo)"], listed.stdout + listed.stderr
    tests = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=root, env=env,
                           capture_output=True, text=True, timeout=600)
    summary = tests.stdout.strip().splitlines()[-1]
    assert tests.returncode == 0 and "skipped" not in summary, tests.stdout[-4000:] + tests.stderr[-2000:]
