"""Every command in README.md's Quickstart and Command line sections runs as documented."""

import os
import re
import subprocess
import sys
from pathlib import Path



ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quickstart (offline)") : text.index("## Python API")]
    return [line for block in re.findall(r"```bash\n(.*?)```", section, re.S) for line in block.strip().splitlines()]


def run(command: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    return subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)


def test_readme_has_the_commands():
    commands = readme_commands()
    assert commands[0].startswith("python recipes/quickstart.py")
    assert any(command.startswith("hf-grow runs/quickstart/small-gpt2") for command in commands)
    assert any("--dataset wikitext" in command for command in commands)


def test_the_public_names_table_lists_every_export():
    """README's table of public names names every name hf_grow exports (the grown classes by their prefixes),
    and each submodule entry point it names exists."""
    import importlib

    import hf_grow

    readme = (ROOT / "README.md").read_text()
    start = readme.index("The public names, all importable from `hf_grow`:")
    table = readme[start:readme.index("How a model grows is", start)]
    listed = set(re.findall(r"`(\w+)\*?`", table))
    prefixes = tuple(name for name in listed if name.startswith("Grown"))
    missing = [name for name in hf_grow.__all__ if name != "__version__" and name not in listed
               and not name.startswith(prefixes)]
    assert missing == []
    for dotted in re.findall(r"`(hf_grow\.[\w.]+)`", table):
        module, _, name = dotted.rpartition(".")
        assert hasattr(importlib.import_module(module), name) or importlib.import_module(dotted)


def test_offline_quickstart_commands_run():
    """The recipe, then hf-grow on the model it trained (in order, as a reader would run them)."""
    for command in readme_commands():
        if command.startswith("hf-grow gpt2"):
            continue  # the online form: see the next test
        result = run(command)
        assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
        assert "held-out loss" in result.stdout
    assert (ROOT / "runs/quickstart/grown-again/growth_report.json").is_file()


def test_online_command_fails_offline_with_one_line():
    (online,) = [command for command in readme_commands() if command.startswith("hf-grow gpt2")]
    result = run(online)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("hf-grow: error:") and len(result.stderr.strip().splitlines()) == 1


def bash_blocks(heading: str) -> list[str]:
    """The command lines of the bash blocks under ``heading`` in README.md, up to the next section."""
    text = (ROOT / "README.md").read_text()
    start = text.index(heading)
    section = text[start : text.index("\n## ", start + len(heading))]
    return [line for block in re.findall(r"```bash\n(.*?)```", section, re.S) for line in block.strip().splitlines()]


def test_ci_runs_the_readme_install_and_test_commands_verbatim():
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line.startswith("python ")]
    assert ci == bash_blocks("## Install") + bash_blocks("## Test")
