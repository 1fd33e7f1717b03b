"""docs/results/: the index lists exactly the files present, evidence is cited, archive is not.

A result file is evidence when a page of docs/ (or the README) links it as `results/NAME`; the index
(docs/results/README.md) names the pages citing each, and files no page cites live in archive/.
`python tests/test_docs_results.py` writes the index the test expects.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
HEAD = """# Result files

The JSON every benchmark table in docs/ was read from, one file per run (`--json` of the command
the citing page names). Where a page cites a file, that page says what produced it, on which CPU
or GPU, and what it shows; this index only finds it. [archive/](archive/) keeps the runs no page
cites any more (earlier sessions' tries, superseded tables), for the record.
"""


def pages() -> dict[str, str]:
    found = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}
    found["README.md"] = (ROOT / "README.md").read_text()
    return found


def citers(name: str, texts: dict[str, str]) -> list[str]:
    pattern = re.compile(r"results/" + re.escape(name) + r"\b")
    return [page for page, text in texts.items() if pattern.search(text)]


def expected_index() -> str:
    texts = pages()
    rows = ["| file | cited by |", "| --- | --- |"]
    for path in sorted(RESULTS.glob("*.json")):
        rows.append(f"| [{path.name}]({path.name}) | {', '.join(citers(path.name, texts))} |")
    rows += ["", "## archive/", "", "| file |", "| --- |"]
    rows += [f"| [{p.name}](archive/{p.name}) |" for p in sorted((RESULTS / "archive").glob("*.json"))]
    return HEAD + "\n" + "\n".join(rows) + "\n"


def test_the_index_lists_exactly_the_result_files_and_who_cites_them():
    assert (RESULTS / "README.md").read_text() == expected_index(), \
        "docs/results/README.md is stale: `python tests/test_docs_results.py` rewrites it"


def test_every_evidence_file_is_cited_and_no_archived_file_is():
    texts = pages()
    uncited = [p.name for p in RESULTS.glob("*.json") if not citers(p.name, texts)]
    assert not uncited, f"move to docs/results/archive/ or cite from a page: {uncited}"
    archived_but_cited = [p.name for p in (RESULTS / "archive").glob("*.json") if citers(p.name, texts)]
    assert not archived_but_cited, f"cited, so evidence (move back to docs/results/): {archived_but_cited}"


def test_every_results_link_in_the_docs_names_a_file_that_exists():
    missing = []
    for page, text in pages().items():
        base = ROOT if page == "README.md" else ROOT / "docs"
        for target in re.findall(r"\]\(((?:docs/)?results/[^)#\s]+)\)", text):
            if not (base / target).exists():
                missing.append(f"{page}: {target}")
    assert not missing, missing


if __name__ == "__main__":
    (RESULTS / "README.md").write_text(expected_index())
