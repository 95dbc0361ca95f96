"""Every tracked text file speaks of the software: no talk of how it was developed, no paths of the machine a result
was produced on.

Process talk (the patterns below; the planted examples show each): sessions and issues by number, helpers and
engineers of the development, the development machine called "this" one, a machine on loan, results kept "ad hoc".
Hardware is named as hardware ("a 2-core Xeon VM", "one H200"). Absolute paths: a home, root, work,
tmp or mount folder with a name below it: a committed result or document names files relative to the repository.
Third-party data (tokenizers, labelled query sets, the BFCL registry, licences) is kept verbatim and not checked.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
THIRD_PARTY = ("compiler/tokenizers/", "eval/data/", "registry/bfcl.jsonl", "registry/licenses/")

# Case-insensitive; written so that this file's own source does not match them.
PROCESS_TALK = re.compile("|".join((
    r"\bsessions?[ ]?#?[0-9]+",
    r"\bissues?[ ]?#[0-9]+|\bissues?[ ][0-9]+",
    r"\b(helper|development|dev|coding)[ ](sessions?|engineers?|agents?)\b",
    r"\b(this|previous|earlier|next|later|last)[ ]session\b(?![- ]scoped)",
    r"\bthis[ ]VM\b",
    r"\bthis[ ]shared\b",
    r"\bthis[ ]project'?s[ ](shared[ ])?([0-9]+-core|cpu|xeon|machine|gpu|vm)\b",
    r"\blent[ ](a[ ]|the[ ])?(gpu[ ]|device[ ])?machines?\b",
    r"\bad[- ]hoc,[ ]not[ ]committed\b",
)), re.IGNORECASE)
# The narrowest of them, which third-party text must pass too (a query that mentions "my next gym session" is data).
CORE_TALK = re.compile(r"\bsession[ ][0-9]|\bissue[ ][0-9]|this[ ]VM\b|lent[ ](gpu[ ]|device[ ])?machine"
                       r"|helper[ ]session|ad[- ]hoc,[ ]not[ ]committed", re.IGNORECASE)
ENGINEER = re.compile(r"\bEngineer[ ][A-Z]\b")
ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])/(home|root|work|tmp|Users|mnt|scratch)/[A-Za-z0-9_.-]+/")


def findings(path: Path, *, name: str | None = None, third_party: bool = False) -> list[str]:
    """``file:line: phrase`` for each line of ``path`` that talks of the process or holds an absolute path (in
    third-party text: the core phrases only)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return []  # binary (weights, images)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return []
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in (CORE_TALK,) if third_party else (PROCESS_TALK, ENGINEER, ABSOLUTE_PATH):
            match = pattern.search(line)
            if match:
                found.append(f"{name or path}:{number}: {match.group(0)!r}")
    return found


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: no list of tracked files")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [name for name in listed.decode().split("\0") if name]


@pytest.mark.parametrize(("text", "caught"), [
    ("Measured in sess" "ion 3 on the GPU.", True),
    ("See iss" "ue #8 and iss" "ue 12.", True),
    ("a lent " "GPU machine", True),
    ("27 minutes on this " "VM", True),
    ("ad hoc, " "not committed", True),
    ("written by a helper " "session", True),
    ('"path": "/ho' 'me/alice/tooltrie/build/eval/results.json"', True),
    ("cached in /ro" "ot/.cache/tooltrie/models", True),
    ("an MCP session, a session-scoped fixture, the issue tracker", False),
    ("bench/results/eval/tuned-single/report.md (a 2-core Xeon VM, one H200)", False),
])
def test_planted_phrases_are_found(tmp_path: Path, text: str, caught: bool) -> None:
    planted = tmp_path / "planted.md"
    planted.write_text(f"# Results\n\n{text}\n", encoding="utf-8")
    assert bool(findings(planted)) == caught, findings(planted)


def test_third_party_text_is_held_to_the_core_phrases(tmp_path: Path) -> None:
    data = tmp_path / "queries.jsonl"
    data.write_text('{"query": "When is my next gym session? Files in /ho' 'me/user/docs/"}\n', encoding="utf-8")
    assert findings(data, third_party=True) == []
    data.write_text('{"query": "measured in sess' 'ion 3"}\n', encoding="utf-8")
    assert findings(data, third_party=True)


def test_no_tracked_file_talks_of_the_process_or_holds_a_machine_path() -> None:
    files = tracked_files()
    assert "README.md" in files
    found = [line for name in files if (REPO / name).is_file()
             for line in findings(REPO / name, name=name, third_party=name.startswith(THIRD_PARTY))]
    assert not found, f"{len(found)} line(s) to rewrite:\n" + "\n".join(found[:60])


def test_benchmark_results_name_repository_files_relative(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import _common

    inside = str(REPO / "registry" / "catalog.yaml")
    written = _common.write_results("relative", settings={"registry": inside}, out=tmp_path / "relative.json",
                                    results=[{"source": inside, "other": "/elsewhere/file"}])
    text = written.read_text(encoding="utf-8")
    assert not findings(written), text
    assert '"registry/catalog.yaml"' in text and '"/elsewhere/file"' in text


def test_evaluation_results_name_files_relative_to_where_they_ran(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from tooltrie.eval.report import write_results
    from tooltrie.eval.results import read_results

    results = read_results(REPO / "bench/results/eval/tuned-single/results.json")
    results["settings"]["adapter"] = str(REPO / "serve" / "default_adapter")
    results["answers"] = [{"query": "q", "gold": ["WeatherTool"], "where": f"{REPO}/eval/data/q.jsonl:7"}]
    monkeypatch.chdir(REPO)
    written = write_results(results, tmp_path / "eval", plots=False)
    assert not findings(written["results"]) and not findings(written["answers"])
    again = read_results(written["results"])
    assert again["settings"]["adapter"] == "serve/default_adapter"
    assert again["answers"][0]["where"] == "eval/data/q.jsonl:7"
