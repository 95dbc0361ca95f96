"""The README's examples run as written (docs that drift from the code are worse than none).

- ```python blocks run as they are;
- ```sh runnable blocks: every ``tooltrie`` command parses with the real command line, and the cheap ones (compile,
  inspect, decode, grammar) run, in a folder holding the files the README writes out (a ```yaml block whose first
  line is ``# <file name>``);
- every ``make`` target the README names exists (``make -n``);
- the README stays for users: 300 lines at most (measurements go to docs/, history to CHANGELOG.md).
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tooltrie.cli import main

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
TEXT = README.read_text(encoding="utf-8")
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
BLOCKS = [(info.strip(), body) for info, body in FENCE.findall(TEXT)]
PYTHON = [body for info, body in BLOCKS if info == "python"]
RUNNABLE = [line for info, body in BLOCKS if info == "sh runnable" for line in body.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
CHEAP = ("compile", "inspect", "decode", "grammar")


def readme_files() -> dict[str, str]:
    """{file name: text} of the blocks the README writes out (a first line ``# NAME`` with a dot in NAME)."""
    files = {}
    for _info, body in BLOCKS:
        first, _, rest = body.partition("\n")
        match = re.fullmatch(r"# ([\w.-]+\.\w+)", first.strip())
        if match:
            files[match.group(1)] = rest
    return files


def tooltrie_commands(lines: list[str]) -> list[list[str]]:
    commands = [shlex.split(line, comments=True) for line in lines]
    assert all(words and words[0] == "tooltrie" for words in commands), commands
    return [words[1:] for words in commands]


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__()
        self.namespace = namespace


def parsed(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """What ``tooltrie ARGV`` parses to, without running it (argparse exits on an unknown option)."""
    original = argparse.ArgumentParser.parse_args

    def stop_after_parsing(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> argparse.Namespace:
        raise _Parsed(original(self, *args, **kwargs))  # type: ignore[arg-type]

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", stop_after_parsing)
        with pytest.raises(_Parsed) as stopped:
            main(argv)
    return stopped.value.namespace


def test_readme_is_for_users() -> None:
    lines = TEXT.count("\n")
    assert lines <= 300, f"README.md has {lines} lines: measurements go to docs/, history to CHANGELOG.md"


def test_readme_has_examples() -> None:
    assert PYTHON and RUNNABLE
    assert any(words[0] in CHEAP for words in tooltrie_commands(RUNNABLE))


@pytest.mark.parametrize("source", PYTHON, ids=[f"block{i}" for i in range(len(PYTHON))])
def test_readme_python_example_runs(source: str) -> None:
    exec(compile(source, str(README), "exec"), {})


@pytest.mark.parametrize("argv", tooltrie_commands(RUNNABLE), ids=lambda argv: " ".join(argv[:2]))
def test_readme_command_parses(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert parsed(argv, monkeypatch).command == argv[0]


def test_readme_cheap_commands_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    for name, text in readme_files().items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    ran = 0
    for argv in tooltrie_commands(RUNNABLE):
        if argv[0] in CHEAP:
            code = main(argv)
            assert code == 0, (argv, capsys.readouterr().err)
            ran += 1
    assert ran >= 2


def test_readme_make_targets_exist() -> None:
    if shutil.which("make") is None:
        pytest.skip("no make")
    targets = set()
    for info, body in BLOCKS:
        if info.startswith("sh"):
            for line in body.splitlines():
                if not line.startswith("make ") or any(c in line.split("#")[0] for c in "[|"):
                    continue  # not make, or a synopsis
                words = shlex.split(line, comments=True)
                if words[:1] == ["make"]:
                    targets.update(w for w in words[1:] if "=" not in w)
    assert {"demo", "test"} <= targets
    for target in sorted(targets):
        done = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (target, done.stderr)
