"""The README's chapter list and the book's configuration both come from book.toml."""
import dataclasses
import json
import re
from pathlib import Path

import yaml

from course import book, manifest
from course.book import readme
from course.manifest import ROOT


def test_readme_chapter_list_matches_book_toml():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.render(text) == text, "README.md is stale: run `python run.py readme`"


def test_readme_names_the_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "pip install -r requirements.txt && python run.py core" in text
    assert "\npytest\n" in text


def written_at(numbers):
    """The real manifest with exactly the chapters in `numbers` marked written."""
    real = manifest.load()
    chapters = tuple(dataclasses.replace(c, status="written" if c.number in numbers else "planned")
                     for c in real.chapters)
    return dataclasses.replace(real, chapters=chapters)


def test_book_source_lists_every_chapter_and_marks_planned_ones(tmp_path):
    book_ = written_at({5})
    folder = tmp_path / "chapters" / "05-attention"
    folder.mkdir(parents=True)
    (folder / "05-attention.md").write_text("# md side\n")
    (folder / "05-attention.ipynb").write_text("{}")
    (folder / "mask.png").write_bytes(b"png")
    (tmp_path / "book.toml").write_text("")
    source = book.build_source(tmp_path / "out" / "src", book_, root=tmp_path)

    config = yaml.safe_load((source / "_config.yml").read_text())
    assert config["title"] == book_.title and config["execute"]["execute_notebooks"] == "off"
    toc = yaml.safe_load((source / "_toc.yml").read_text())
    assert toc["format"] == "jb-book" and toc["root"] == "intro"
    assert [p["caption"] for p in toc["parts"]] == [f"Part {p.id}: {p.title}" for p in book_.parts]
    entries = [entry for part in toc["parts"] for entry in part["chapters"]]
    assert len(entries) == 43
    assert entries[4] == {"file": "chapters/05-attention/05-attention", "title": "5. Attention"}
    assert entries[5] == {"file": "planned/06-rope", "title": "6. Rotary position embeddings (planned)"}
    # Each TOC entry has its page; the written chapter brings its notebook and figures, not the .md.
    for entry in entries:
        assert list(source.glob(entry["file"] + ".*")), entry
    assert sorted(p.name for p in (source / "chapters/05-attention").iterdir()) == ["05-attention.ipynb", "mask.png"]
    assert "*Planned.*" in (source / "planned/06-rope.md").read_text()
    assert "[Attention](chapters/05-attention/05-attention.ipynb)" in (source / "intro.md").read_text()


def test_reference_pages_close_the_book_where_chapters_link_to_them(tmp_path):
    (tmp_path / "chapters").mkdir()
    (tmp_path / "chapters" / "glossary.md").write_text("# Glossary\n")
    source = book.build_source(tmp_path / "out" / "src", written_at(set()), root=tmp_path)
    toc = yaml.safe_load((source / "_toc.yml").read_text())
    assert toc["parts"][-1] == {"caption": "Reference",
                                "chapters": [{"file": "chapters/glossary", "title": "Glossary"}]}
    assert (source / "chapters" / "glossary.md").read_text() == "# Glossary\n"
    assert "[Glossary](chapters/glossary.md)" in (source / "intro.md").read_text()


def test_book_notebooks_lose_widget_state_but_keep_other_outputs(tmp_path):
    import json
    notebook = tmp_path / "n.ipynb"
    view = {"application/vnd.jupyter.widget-view+json": {"model_id": "x"}, "text/plain": "VBox()"}
    notebook.write_text(json.dumps({"metadata": {"widgets": {"state": {}}, "kernelspec": {}}, "cells": [
        {"cell_type": "code", "outputs": [{"output_type": "display_data", "data": view},
                                          {"output_type": "stream", "text": "kept"}]},
        {"cell_type": "code", "outputs": [{"output_type": "display_data",
                                           "data": {"application/vnd.jupyter.widget-view+json": {}}}]}]}))
    book.prepare_notebook(notebook)
    data = json.loads(notebook.read_text())
    assert "widgets" not in data["metadata"] and "kernelspec" in data["metadata"]
    first, second = (cell["outputs"] for cell in data["cells"])
    assert first == [{"output_type": "display_data", "data": {"text/plain": "VBox()"}},
                     {"output_type": "stream", "text": "kept"}]
    assert second == [], "an output that was only a widget view disappears"


def test_book_notebooks_show_one_printout_as_one_box():
    out = {"output_type": "stream", "name": "stdout"}
    err = {"output_type": "stream", "name": "stderr"}
    figure = {"output_type": "display_data", "data": {"image/png": "x"}}
    outputs = [{**out, "text": ["True"]}, {**out, "text": " True\n"}, {**err, "text": "warn\n"},
               {**out, "text": "a\n"}, figure, {**out, "text": "b\n"}, {**out, "text": ["c\n", "d\n"]}]
    assert book.merged_streams(outputs) == [{**out, "text": "True True\n"}, {**err, "text": "warn\n"},
                                            {**out, "text": "a\n"}, figure, {**out, "text": "b\nc\nd\n"}]


def test_offline_check_names_every_page_that_needs_the_network(tmp_path):
    book_ = written_at({5, 6})
    html = tmp_path / "html"
    (html / "mathjax").mkdir(parents=True)
    (html / "mathjax" / "MathJax.js").write_text("")
    (html / "_static").mkdir()
    (html / "_static" / "course.css").write_text("a { background: url('missing.svg') } b { src: url(data:x) }")
    five = html / "chapters" / "05-attention"
    five.mkdir(parents=True)
    (five / "a.png").write_bytes(b"")
    (five / "05-attention.html").write_text(
        '<script src="../../_static/../mathjax/MathJax.js"></script><span class="math">x</span><img src="a.png">'
        '<a href="https://arxiv.org/abs/1706.03762">a link is fine</a>')
    (html / "index.html").write_text('<script src="https://cdn.example.org/require.js"></script>'
                                     '<link rel="stylesheet" href="//fonts.example.org/a.css">'
                                     '<div class="math notranslate">y</div>')
    problems = book.offline_problems(html, book_)
    assert any("index.html: fetches <script src=\"https://cdn.example.org" in p for p in problems), problems
    assert any("index.html: fetches <link" in p for p in problems), problems
    assert any("index.html: has math" in p for p in problems), problems
    assert any(p.startswith("Chapter 6: no page") for p in problems), problems
    assert not any("05-attention" in p for p in problems), problems
    assert "_static/course.css: refers to missing.svg, which is not in the book" in problems
    (five / "a.png").unlink()
    assert ("chapters/05-attention/05-attention.html: refers to a.png, which is not in the book"
            in book.offline_problems(html, book_)), "a missing local file is a problem"
    (five / "05-attention.html").write_text("<p>text only</p>")
    assert "Chapter 5: its page has no figure" in book.offline_problems(html, book_)


GLOSSARY = ROOT / "chapters" / "glossary.md"


def test_the_glossary_names_what_the_code_defines():
    """Every Chapter 25 and Chapter 31 name in the glossary's table exists in that chapter's
    code, so a rename cannot leave the glossary behind."""
    code = {25: (ROOT / "solutions" / "paged.py").read_text(),
            31: "".join(p.read_text() for p in sorted((ROOT / "solutions" / "serve").glob("*.py")))}
    rows = [line.split("|")[2:5] for line in GLOSSARY.read_text().splitlines()
            if line.startswith("| [")]
    assert len(rows) >= 15
    missing = []
    for chapter, column in ((25, 0), (31, 1)):
        for row in rows:
            for name in re.findall(r"`([^`]+)`", row[column]):
                for part in name.split("."):
                    if not re.search(rf"\b{re.escape(part)}\b", code[chapter]):
                        missing.append(f"Chapter {chapter}: {name}")
    assert not missing, f"the glossary names what the code does not define: {missing}"


def defines(dotted: str) -> bool:
    """Whether solutions/ defines `dotted`: its longest leading run of names that is a module
    file (serve.scheduler -> solutions/serve/scheduler.py), then a top-level name of that
    module, then each further name (a method, an attribute) somewhere in it."""
    names = dotted.split(".")
    for split in range(len(names) - 1, 0, -1):
        module = ROOT / "solutions" / Path(*names[:split]).with_suffix(".py")
        if module.is_file():
            code = module.read_text(encoding="utf-8")
            first, *rest = names[split:]
            if not re.search(rf"^(?:class |def ){first}\b|^{first}\s*[:=]", code, re.MULTILINE):
                return False
            return all(re.search(rf"\b{re.escape(name)}\b", code) for name in rest)
    return False


def test_the_glossary_covers_every_part_with_names_the_code_defines():
    """Every part of the book has its table of terms, each row naming a chapter of that part
    (linked to its notebook) and a name the reference engine defines, so a rename cannot
    leave the glossary behind."""
    book_ = manifest.load()
    rows = book.glossary_rows(GLOSSARY.read_text(encoding="utf-8"))
    malformed = [row for row in rows if isinstance(row, str)]
    assert not malformed, f"glossary rows not in the form | term | [N](chapter) | `module.name` | text |: {malformed}"
    wrong = []
    for part in book_.parts:
        chapters = {chapter.number: chapter for chapter in book_.in_part(part.id)}
        terms = [row for row in rows if isinstance(row, book.GlossaryRow) and row.part == part.id]
        assert len(terms) >= 5, f"Part {part.id} has fewer than 5 terms in the glossary (a '## Part N: ' table)"
        for row in terms:
            chapter = chapters.get(row.chapter)
            if chapter is None or row.link != f"{chapter.dirname}/{chapter.dirname}.ipynb":
                wrong.append(f"{row.term}: Chapter {row.chapter} ({row.link}) is not a chapter of Part {part.id}")
            if not defines(row.name):
                wrong.append(f"{row.term}: solutions/ does not define {row.name}")
            if "," in row.term or ";" in row.term:
                wrong.append(f"{row.term}: a comma or semicolon would split its index entry")
    assert not wrong, "\n".join(wrong)


def test_glossary_terms_become_index_entries():
    text = ("## Part I: Start\n\n| Term | Ch. | In the code | What it is |\n|---|---|---|---|\n"
            "| RMSNorm | [4](04-rmsnorm/04-rmsnorm.ipynb) | `layers.rms_norm` | A norm. |\n\n"
            "## Paging and scheduling: side by side\n\n## Block\nA block.\n")
    assert book.chapter_terms(text) == {4: ["RMSNorm"]}
    assert book.indexed_glossary(text) == (
        "## Part I: Start\n\n| Term | Ch. | In the code | What it is |\n|---|---|---|---|\n"
        "| {index}`RMSNorm` | [4](04-rmsnorm/04-rmsnorm.ipynb) | `layers.rms_norm` | A norm. |\n\n"
        "## Paging and scheduling: side by side\n\n```{index} Block\n```\n\n## Block\nA block.\n")


def test_the_glossary_check_tells_a_missing_name():
    assert defines("serve.scheduler.Scheduler") and defines("layers.rms_norm")
    assert defines("workloads.RequestRecord.ttft")
    assert not defines("layers.rms_normalise"), "a function the module does not define"
    assert not defines("serve.scheduler.Scheduler.no_such_method_anywhere")
    assert not defines("no_such_module.thing")


def test_the_serving_chapters_link_to_the_glossary():
    for dirname in ("24-continuous-batching", "25-paged-kv-cache", "31-engine-v2"):
        text = (ROOT / "chapters" / dirname / f"{dirname}.md").read_text()
        assert "](../glossary.md)" in text, f"{dirname} does not link to the glossary"


def test_every_figure_gets_alt_text_and_a_caption_that_say_what_it_shows(tmp_path):
    import base64
    import hashlib

    from course.book import figures
    png = base64.b64encode(b"\x89PNG fake bytes").decode()
    svg = ["<svg>\n", "</svg>\n"]
    notebook = {"cells": [
        {"cell_type": "markdown", "source": "## A heading\n\nThe pool, block by block:"},
        {"cell_type": "code", "metadata": {}, "source": "diagrams.show(diagrams.block_states())",
         "outputs": [{"output_type": "display_data", "data": {"image/svg+xml": svg}}]},
        {"cell_type": "code", "metadata": {},
         "source": 'ax.set_title("Decode step time vs batch")\nax.set_xlabel("batch")',
         "outputs": [{"output_type": "display_data", "data": {"image/png": png}}]},
        {"cell_type": "code", "metadata": {"figure": {"caption": "Written by the chapter"}},
         "source": "plt.show()",
         "outputs": [{"output_type": "display_data", "data": {"image/png": base64.b64encode(b"another").decode()}}]},
    ]}
    texts = figures.figure_texts(notebook, 7)
    png_name = hashlib.sha256(b"\x89PNG fake bytes").hexdigest() + ".png"
    svg_name = hashlib.sha256(os_lines(svg)).hexdigest() + ".svg"
    assert texts[svg_name][1].startswith("Figure 7.1: The three states of a pool block"), texts
    assert texts[png_name] == ("Plot: Decode step time vs batch (horizontal axis: batch)",
                               "Figure 7.2: Decode step time vs batch")
    assert [caption for _, caption in texts.values()][2] == "Figure 7.3: Written by the chapter"
    both = {"image/svg+xml": ["<svg/>"], "image/png": base64.b64encode(b"same figure").decode()}
    notebook["cells"].append({"cell_type": "code", "metadata": {}, "source": "diagrams.show(diagrams.gqa())",
                              "outputs": [{"output_type": "display_data", "data": both}]})
    captions = [caption for _, caption in figures.figure_texts(notebook, 7).values()]
    assert len(captions) == 5 and captions[3] == captions[4] and captions[4].startswith("Figure 7.4: Which"), \
        "one output in two formats is one figure"

    page = f'<p>x</p><img alt="../../_images/{png_name}" src="../../_images/{png_name}" />'
    described = figures.describe_figures(page, texts)
    assert described == (f'<p>x</p><figure class="course-figure"><img alt="Plot: Decode step time vs batch '
                         f'(horizontal axis: batch)" src="../../_images/{png_name}" />'
                         "<figcaption>Figure 7.2: Decode step time vs batch</figcaption></figure>")


def os_lines(lines):
    import os
    return os.linesep.join("".join(lines).splitlines()).encode()


def test_finished_pages_lose_the_thebe_scripts_and_let_table_names_break(tmp_path):
    page = tmp_path / "p.html"
    page.write_text('<head>\n    <script>const THEBE_JS_URL = "https://unpkg.com/thebe"; const a = 1</script>\n'
                    '    <script async="async" src="../_static/sphinx-thebe.js?v=1"></script>\n</head>'
                    '<table><td><code><span class="pre">BlockManager.find_cached_prefix</span></code></td></table>'
                    '<p><code><span class="pre">a.b</span></code></p>')
    book.finish_pages(tmp_path, {})
    assert page.read_text() == ('<head>\n</head><table><td><code><span class="pre">BlockManager.<wbr>find_<wbr>'
                                'cached_<wbr>prefix</span></code></td></table><p><code><span class="pre">a.b</span>'
                                '</code></p>')


def test_the_layout_check_sees_what_a_reader_would_trip_over(tmp_path):
    import pytest
    if book.browser_driver(400, 300) is None:
        pytest.skip("the layout check needs headless Chromium: apt-get install chromium chromium-driver")
    page = tmp_path / "chapters" / "p.html"
    page.parent.mkdir()
    for name in ("a.svg", "b.svg"):
        (page.parent / name).write_text('<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>')
    page.write_text('<html><body><article class="bd-article" style="width:600px;padding:0 20px">'
                    '<table style="width:900px"><tr><td>wide table</td></tr></table>'
                    '<pre style="overflow:auto">' + "x" * 400 + '</pre>'
                    '<img src="a.svg" alt="a.svg"><img src="b.svg" alt="the pool after step 3">'
                    '<table><tr><td>narrow</td></tr></table><pre>short</pre>'
                    '<img src="gone.png" alt="a file that is not there">'
                    '<p style="font-size:16px">raised <span class="math"><span class="MathJax"><span class="math" '
                    'style="display:inline-block"><span class="mi" style="font-size:21px;vertical-align:4px">R</span>'
                    '</span></span></span> and level <span class="math"><span class="MathJax"><span class="mi">V'
                    '</span></span></span></p>'
                    '<script>const A = 1;</script><script>const A = 2;</script></article></body></html>')
    problems = book.page_problems(tmp_path)
    assert len(problems) == 6, problems
    assert "chapters/p.html: did not load chapters/gone.png (status 404)" in problems
    assert any(p.startswith("chapters/p.html: 1 of 2 inline formulas sit off the text's baseline") and "'R'" in p
               and "+4.0 px above it, 1.31 times" in p for p in problems), problems
    assert "chapters/p.html: a table 900 px wide in the 600 px column ('wide table')" in problems
    assert any("a code block or printout scrolls sideways" in p for p in problems), problems
    assert "chapters/p.html: a figure without alt text (a.svg)" in problems
    assert any("console error" in p and "already been declared" in p for p in problems), problems


def test_a_wrapped_code_line_keeps_a_hanging_indent():
    block = ('<div class="highlight"><pre><span class="k">def</span> f():\n'
             '    <span class="k">return</span> 1\n</pre>')
    assert book.CODE_BLOCK.sub(book.hanging_lines, block) == (
        '<div class="highlight"><pre>'
        '<span class="code-line" style="--hang:4ch;padding-left:4ch;text-indent:-4ch">'
        '<span class="k">def</span> f():\n</span>'
        '<span class="code-line" style="--hang:8ch;padding-left:8ch;text-indent:-8ch">'
        '    <span class="k">return</span> 1\n</span>'
        '</pre>')
    across = '<div class="highlight"><pre><span class="s">"""two\nlines"""</span>\n</pre>'
    assert book.CODE_BLOCK.sub(book.hanging_lines, across) == across, "a span across lines stays whole"


def test_a_quoted_figure_must_be_one_its_named_output_shows(tmp_path):
    from course.book import measured
    assert measured.matches("1.8", "1.79") and measured.matches("3", "3.4") and measured.matches("2.8e-05", "2.84e-05")
    assert measured.matches("1,008", "1008") and not measured.matches("1.8", "1.86") and not measured.matches("4", "3")
    book_ = written_at({5, 6})
    for dirname, text, outputs in (
            ("05-attention", 'Core 1.8x<!-- measured: bench "core" --> ahead, 3<!-- measured: bench --> rows, '
                             'a rate of 0.601<!-- measured: 6:accept -->.\n'
                             'Stale: 2.0x<!-- measured: bench "core" -->; 7<!-- measured: nothing -->; '
                             'a lone <!-- measured: bench --> marker.\n',
             {"bench": "core  1.79 tok/s\nref   2.04 tok/s\n3 rows\n"}),
            ("06-rope", "No quotes here.\n", {"accept": "acceptance 0.6012\n"})):
        folder = tmp_path / "chapters" / dirname
        folder.mkdir(parents=True)
        (folder / f"{dirname}.md").write_text(text)
        cells = [{"cell_type": "code", "metadata": {"measured": name}, "source": "",
                  "outputs": [{"output_type": "stream", "name": "stdout", "text": printed}]}
                 for name, printed in outputs.items()]
        (folder / f"{dirname}.ipynb").write_text(json.dumps({"cells": cells}))
    problems = measured.quoted_figure_problems(book_, tmp_path)
    where = "chapters/05-attention/05-attention.md:2"
    assert problems == [f"{where}: a `measured:` marker not right after a number",
                        f"{where}: the text quotes 2.0 but the saved output of Chapter 5's 'bench' in its lines "
                        "with 'core' shows no such number",
                        f"{where}: no code cell of Chapter 5 is named 'nothing' (`measured: nothing` in its options)"]


CHAPTER_32 = ROOT / "chapters" / "32-fast-kernels"


def test_a_changed_bench_figure_of_chapter_32_fails_the_quote_check(tmp_path):
    """Chapter 32's text quotes its saved bench runs through the cells that print them: the
    real text passes, and the same text with every such figure changed (a digit added, so the
    figure claims a precision no printed number has) fails once per figure, on its line."""
    from course.book import measured
    book_ = written_at({32})
    folder = tmp_path / "chapters" / "32-fast-kernels"
    folder.mkdir(parents=True)
    (folder / "32-fast-kernels.ipynb").write_bytes((CHAPTER_32 / "32-fast-kernels.ipynb").read_bytes())
    text = (CHAPTER_32 / "32-fast-kernels.md").read_text(encoding="utf-8")
    quoted = [m for m in measured.MARKER.finditer(text) if m["name"].startswith("bench-")]
    assert len(quoted) >= 20, "Chapter 32 marks its bench figures"
    (folder / "32-fast-kernels.md").write_text(text, encoding="utf-8")
    assert measured.quoted_figure_problems(book_, tmp_path) == []

    def changed(number: str) -> str:
        return number + "9" if "." in number else number + ".9"
    edited, end = [], 0
    for m in quoted:
        edited += [text[end:m.start("number")], changed(m["number"])]
        end = m.end("number")
    (folder / "32-fast-kernels.md").write_text("".join(edited) + text[end:], encoding="utf-8")
    problems = measured.quoted_figure_problems(book_, tmp_path)
    assert [re.search(r"quotes (\S+) but", p)[1] for p in problems] == [changed(m["number"]) for m in quoted]


def test_chapter_32s_bench_cells_show_its_saved_runs():
    """The cells that Chapter 32's sentences quote print the saved JSON lines beside the
    chapter (bench-runs/): their saved outputs are what those files give now, so a line
    changed in a file without re-executing the notebook fails here."""
    import importlib.util

    from course.book import measured
    spec = importlib.util.spec_from_file_location("ch32_runs", CHAPTER_32 / "ch32_runs.py")
    runs_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runs_module)
    outputs = measured.named_outputs(CHAPTER_32 / "32-fast-kernels.ipynb")
    runs = sorted((CHAPTER_32 / "bench-runs").glob("*.jsonl"))
    assert runs, "Chapter 32 keeps its bench runs in bench-runs/"
    for run in runs:
        shown = [str(piece) if isinstance(piece, str) else repr(piece) for piece in runs_module.bench_run_tables(run)]
        expected = [line.rstrip() for piece in shown for line in piece.splitlines()]
        assert [line.rstrip() for line in outputs[f"bench-{run.stem}"].rstrip().splitlines()] == expected, run.name


def test_every_figure_the_chapters_mark_as_measured_is_in_its_saved_output():
    from course.book import measured
    assert not measured.quoted_figure_problems(manifest.load())


def test_alt_text_leaves_out_words_the_code_computes():
    from course.book import figures
    cell = {"cell_type": "code", "metadata": {},
            "source": 'ax.set_title(f"T = {t}: top p {p}")\nax.set_xlabel(f"{n} positions")\nax.set_ylabel("error")'}
    alt, caption = figures.described(cell, "The error grows with the context. More text.")
    assert (alt, caption) == ("Plot: The error grows with the context. (vertical axis: error)",
                              "The error grows with the context."), "no '...' read out for a computed part"
