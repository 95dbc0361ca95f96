"""Names always found: every tool of the five development registries asked for by its name, in each spelling a
request may write it (as written, upper case, snake_case, camelCase, words, ``select:``), through the index admission
uses (``registry/named.py``): how often the tool comes first, and where it does not, why (another tool is written
exactly so, or shares the spelling, and comes first by the registry's order).

    .venv/bin/python bench/bench_names.py
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from _common import print_table, write_results
from _study import REGISTRIES, registry_of

from tooltrie.registry.named import SELECT, NameIndex, spellings

FORMS = ("as written", "upper case", "snake_case", "camelCase", "words", "select:")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    for name in REGISTRIES:
        registry = registry_of(name)
        index = NameIndex(registry)
        cells: dict[str, dict[str, Any]] = {form: {"first": 0, "another written so": 0, "shared spelling": 0,
                                                   "missed": []} for form in FORMS}
        for i, tool in enumerate(registry.names):
            written = {**spellings(tool), "upper case": tool.upper(), "select:": SELECT + tool}
            for form in FORMS:
                text = written[form]
                named = index.named(text)
                cell = cells[form]
                if named and named[0] == i:
                    cell["first"] += 1
                elif registry.by_name.get(text.removeprefix(SELECT)) not in (None, i):
                    cell["another written so"] += 1
                elif i in named:
                    cell["shared spelling"] += 1
                else:
                    cell["missed"].append(text)
        results[name] = {"tools": len(registry), **cells}
    rows = [{"registry": name, "tools": results[name]["tools"],
             **{form: f"{100 * results[name][form]['first'] / results[name]['tools']:.1f}" for form in FORMS},
             "not first (another tool's name or spelling)": sum(
                 results[name][form]["another written so"] + results[name][form]["shared spelling"] for form in FORMS),
             "missed": sum(len(results[name][form]["missed"]) for form in FORMS)} for name in REGISTRIES]
    print_table(rows, title="a tool's name as the query: the tool first (%), per spelling")
    path = write_results("names", settings={"forms": FORMS}, results=results, out=args.output, compact=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
