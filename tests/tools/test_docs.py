"""The docs cannot drift: every performance figure is tied to the results JSON it came from, links stay inside
the repository, and no figure is left without a source (scripts/docs_figures.py)."""

import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import docs_figures  # noqa: E402


def test_every_figure_in_the_docs_matches_its_results_json():
    problems = docs_figures.check()
    assert not problems, "\n".join(map(str, problems[:40])) + f"\n... {len(problems)} in all"


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A docs tree of one page and one results file, for checking the checker."""
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "r.json").write_text(json.dumps(
        {"results": {"ours": {"ms": 10.0}, "peer": {"ms": 14.3}}, "rows": [{"tok/s": 1722.4}]}))
    monkeypatch.setattr(docs_figures, "ROOT", str(tmp_path))
    monkeypatch.setattr(docs_figures, "RESULTS", str(tmp_path / "docs" / "results"))
    docs_figures.load_results.cache_clear()
    yield tmp_path
    docs_figures.load_results.cache_clear()


def _problems(scratch, page: str) -> list[str]:
    (scratch / "docs" / "page.md").write_text(page)
    return [p.message for p in docs_figures.check(["docs/page.md"])]


def test_the_checker_accepts_figures_that_match(scratch):
    assert _problems(scratch, 'ours **1.43x**<!--fig r.json: v("results/peer/ms") / v("results/ours/ms")--> faster, '
                              '1,722 tok/s<!--fig r.json: v("rows", "0", "tok/s")-->; 10 ms<!--fig r.json: '
                              'v("results/ours/ms")-->\n') == []


@pytest.mark.parametrize("page, complaint", [
    ('ours 1.52x<!--fig r.json: v("results/peer/ms") / v("results/ours/ms")-->\n', "the doc says 1.52"),
    ('ours 1.4x<!--fig r.json: v("results/peer/ms") / v("results/nobody/ms")-->\n', "KeyError"),
    ('ours 1.4x<!--fig gone.json: v("results/peer/ms")-->\n', "No such file"),
    ("the layer runs 1.43x faster than the peer\n", "no source"),
    ("| config | ms |\n|---|---|\n| a | 14.30 |\n", "no source"),
    ("<!--fig r.json: 1-->\n", "no number"),
])
def test_the_checker_catches_a_stale_or_unsourced_figure(scratch, page, complaint):
    problems = _problems(scratch, page)
    assert problems and complaint in problems[0], problems


def test_generated_tables_must_equal_what_their_json_renders(scratch):
    block = "<!-- generated: json:dumps r.json -->\n{}\n<!-- /generated -->\n"
    (scratch / "docs" / "page.md").write_text(block.format('{"old": 1}'))
    assert "is stale" in docs_figures.check(["docs/page.md"])[0].message
    assert docs_figures.update(["docs/page.md"]) == 1
    assert docs_figures.check(["docs/page.md"]) == []
    assert json.loads((scratch / "docs" / "page.md").read_text().split("\n")[1]) == docs_figures.load_results("r.json")


def test_docs_stand_alone_no_links_out_of_the_repository_and_no_issue_numbers():
    for doc in docs_figures.DOCS:
        text = open(os.path.join(ROOT, doc)).read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            local = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), target.split("#")[0]))
            assert local.startswith(ROOT + os.sep), f"{doc}: link {target} leaves the repository"
            assert os.path.exists(local), f"{doc}: link {target} points at nothing"
        assert "../shared" not in text and "ANCHORS.md" not in text, f"{doc} refers to files outside the repository"
        found = re.findall(r"\b[Ii]ssues? #?\d+|(?<![\w&])#\d+\b", text)
        assert not found, f"{doc} refers to issue numbers: {found}"


def test_the_readme_is_short_and_its_results_table_is_generated_from_the_index():
    """A newcomer's page: under 150 lines, no line over 200 characters outside code blocks, and the results table
    one generated block whose rows each say the GPU, the command and which direction is better."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    lines = text.splitlines()
    prose = re.sub(r"```.*?```", "", text, flags=re.S).splitlines()
    assert len(lines) < 150 and max(map(len, prose)) <= 200
    opening = "<!-- generated: docs_figures:headlines index.json -->"
    assert opening in text and "<!-- /generated -->" in text[text.index(opening):]
    index = docs_figures.load_results("index.json")
    table = docs_figures.headlines(index)
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| what")]
    assert len(rows) == len(index["headlines"])
    for row, headline in zip(rows, index["headlines"]):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[2] in ("higher", "lower") and cells[3] and headline["command"] in cells[4]
    assert all(f"docs/results/{f}" in table for h in index["headlines"] for f in h["files"])
    assert all(os.path.isfile(os.path.join(ROOT, "docs", "results", f)) for h in index["headlines"] for f in h["files"])


def test_a_sidecar_table_renders_its_figures_and_goes_stale_when_they_move(scratch):
    """A table of figures lives in its page's sidecar (docs/tables/PAGE.json): the page shows plain rows, and a
    changed measurement makes the block stale, as an inline figure would be."""
    (scratch / "docs" / "tables").mkdir()
    spec = {"speed": {"rows": ["| impl | ms | vs peer |", "|---|---|---|",
                                {"text": "| ours | {a:.1f} | {b:.2f}x |",
                                 "figures": {"a": ["r.json", 'v("results/ours/ms")'],
                                             "b": ["r.json", 'v("results/peer/ms") / v("results/ours/ms")']}}]}}
    (scratch / "docs" / "tables" / "page.json").write_text(json.dumps(spec))
    rows = "| impl | ms | vs peer |\n|---|---|---|\n| ours | 10.0 | 1.43x |\n"
    assert docs_figures.table(spec["speed"]) == rows
    _assert_block_goes_stale(scratch, f"<!-- generated: docs_figures:table tables/page.json#speed -->\n"
                                      f"{rows}<!-- /generated -->\n", ours_ms=11.0, peer_ms=14.3)


def _assert_block_goes_stale(scratch, page: str, ours_ms: float, peer_ms: float) -> None:
    """``page`` (a generated block over the scratch r.json) checks clean; once r.json holds other measurements,
    the check calls the block stale."""
    (scratch / "docs" / "page.md").write_text(page)
    assert docs_figures.check(["docs/page.md"]) == []
    (scratch / "docs" / "results" / "r.json").write_text(json.dumps({"results": {"ours": {"ms": ours_ms},
                                                                                  "peer": {"ms": peer_ms}}}))
    docs_figures.load_results.cache_clear()
    assert "stale" in docs_figures.check(["docs/page.md"])[0].message


def test_table_rows_carry_no_inline_figures_and_every_sidecar_table_is_shown():
    """A table row with inline figure comments runs to a thousand characters in the page's source: tables of
    figures come from sidecars, and a sidecar table no page shows is a stale leftover."""
    inline, shown = [], set()
    for doc in docs_figures.DOCS:
        text = open(os.path.join(ROOT, doc)).read()
        inline += [f"{doc}:{n}" for n, line in enumerate(text.splitlines(), 1)
                   if line.lstrip().startswith("|") and "<!--fig" in line]
        shown |= set(re.findall(r"<!-- generated: docs_figures:table (tables/\S+) -->", text))
    assert not inline, inline
    tables = os.path.join(ROOT, "docs", "tables")
    kept = {f"tables/{f}#{name}" for f in os.listdir(tables) for name in json.load(open(os.path.join(tables, f)))}
    assert kept == shown


def test_a_headline_figure_that_moves_in_its_json_changes_the_readme_table(scratch):
    """The table's figures are evaluated, not copied: a changed measurement makes the block stale."""
    index = {"headlines": [{"what": "w", "result": "{a:.2f}x", "better": "lower", "gpu": "H100", "command": "c",
                            "figures": {"a": ["r.json", 'v("results/peer/ms") / v("results/ours/ms")']},
                            "files": ["r.json"]}]}
    assert "| w | 1.43x | lower | H100 | `c` [json][1a] |" in docs_figures.headlines(index)
    (scratch / "docs" / "results" / "index.json").write_text(json.dumps(index))
    _assert_block_goes_stale(scratch, "<!-- generated: docs_figures:headlines index.json -->\n"
                                      f"{docs_figures.headlines(index)}<!-- /generated -->\n",
                             ours_ms=10.0, peer_ms=15.0)


def test_results_keep_the_current_files_on_top_each_with_the_command_that_made_it():
    """docs/results holds at most 30 current files, and its index says what each holds and which command wrote it;
    earlier rounds live in history/."""
    results = os.path.join(ROOT, "docs", "results")
    top = sorted(f for f in os.listdir(results) if os.path.isfile(os.path.join(results, f)))
    assert len(top) <= 30
    files = docs_figures.load_results("index.json")["files"]
    assert sorted(files) == top
    assert all(entry["what"] and entry["command"] for entry in files.values())


def test_every_docs_page_stays_readable_in_one_sitting():
    """No page a user opens runs past 350 lines: a longer topic is split into pages that link each other."""
    long = {doc: n for doc in docs_figures.DOCS if (n := open(os.path.join(ROOT, doc)).read().count("\n")) > 350}
    assert not long, long


def _anchor(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_to_a_heading_finds_it():
    """A page split or a heading renamed must not leave links to headings that are gone."""
    anchors = {}
    for doc in docs_figures.DOCS:
        text = re.sub(r"```.*?```", "", open(os.path.join(ROOT, doc)).read(), flags=re.S)
        anchors[doc] = {_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}
    missing = []
    for doc in docs_figures.DOCS:
        for page, anchor in re.findall(r"\]\(([^)\s#]*)#([\w-]+)\)", open(os.path.join(ROOT, doc)).read()):
            target = os.path.normpath(os.path.join(os.path.dirname(doc), page)) if page else doc
            if target in anchors and anchor not in anchors[target]:
                missing.append(f"{doc}: {page}#{anchor}")
    assert not missing, missing
