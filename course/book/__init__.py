"""The HTML book (Jupyter Book 1) and the README's chapter list, both made from book.toml.
Beside it: figures (the figures' alt text and captions), readme (the README's chapter
table) and static/ (the book's own CSS).

`build_source` lays out a Jupyter Book source folder: _config.yml and _toc.yml generated
from the manifest, an introduction page, each written chapter's executed .ipynb (outputs
kept, so nothing is executed while building) with the rest of its folder (figures), and a
short placeholder page for each planned chapter, which the table of contents marks as
planned. The .md side of each pair is left out: it holds the same cells, and two files
with one name would be two pages. The reference pages (REFERENCE_PAGES: the glossary) are
plain Markdown in chapters/, copied to the same place in the book so that a chapter's
relative link to them works on GitHub and in the book alike.

The book reads offline: MathJax is bundled (copied from jupyter-server-mathjax to the
site's root), widget state is dropped from the copied notebooks (each widget has a static
version beside it), and `offline_problems` checks the built HTML for anything fetched from
another host (`python run.py book --check`, run in CI).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import http.server
import json
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

from course import manifest as manifest_module
from course.book import figures
from course.manifest import ROOT, Chapter, Manifest

DEFAULT_OUT = ROOT / "build" / "book"
# The book's own CSS (and any other static file), copied to the source's _static folder.
STATIC_DIR = Path(__file__).resolve().parent / "static"
# Written beside the book source: {image file name: (alt text, caption)} of every figure.
FIGURE_TEXTS = "_figure_texts.json"
# sphinx-thebe's configuration, inlined in every page by Jupyter Book (twice: the second
# `const` is a SyntaxError in the console), and its loader. The book has no live kernel
# (launch_buttons.thebe is false), so both go.
THEBE_SCRIPTS = re.compile(r'[ \t]*<script>const THEBE_JS_URL = [^<]*</script>\n?'
                           r'|[ \t]*<script async="async" src="[^"]*sphinx-thebe\.js[^"]*"></script>\n?')
# The bundled MathJax (jupyter-server-mathjax, requirements-book.txt: MathJax 2 with the
# STIX web fonts only, hence the font settings). It goes to EXTRA_DIR/MATHJAX_DIR in the
# source, which Sphinx copies to MATHJAX_DIR at the site's root (html_extra_path): under
# _static, Jupyter Book would add every one of its scripts to every page. mathjax_path is
# relative to _static, hence the "../".
EXTRA_DIR = "_offline"
MATHJAX_DIR = "mathjax"
MATHJAX_PATH = f"../{MATHJAX_DIR}/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full"
MATHJAX2_CONFIG = {
    "tex2jax": {"inlineMath": [["\\(", "\\)"]], "displayMath": [["\\[", "\\]"]], "processEscapes": True,
                "processClass": "math|output_area", "ignoreClass": "document"},
    # matchFontHeight off: scaled to the body font's x-height, STIX formulas came out 30%
    # larger than the text around them.
    "HTML-CSS": {"availableFonts": [], "webFont": "STIX-Web", "imageFont": None, "matchFontHeight": False},
    "SVG": {"font": "STIX-Web"},
}
# Output types that need a live kernel (or a widget manager fetched from a CDN) to show.
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
# Pages that belong to no chapter: (path in the repository and in the book source, without
# the .md extension; title in the table of contents). They form the book's last part.
REFERENCE_PAGES = (("chapters/glossary", "Glossary"),)
REFERENCE_CAPTION = "Reference"


def chapter_table(manifest: Manifest, link=lambda chapter: chapter.notebook_md, with_status: bool = True) -> str:
    """A Markdown table of every chapter: part, number and title, plus (with_status) the
    status, a written chapter's title then linking to `link(chapter)`."""
    header = "| Part | # | Chapter |" + (" Status |" if with_status else "")
    lines = [header, "|---|---:|---|" + ("---|" if with_status else "")]
    for part in manifest.parts:
        for index, chapter in enumerate(manifest.in_part(part.id)):
            part_cell = f"{part.id}. {part.title}" if index == 0 else ""
            row = f"| {part_cell} | {chapter.number} | "
            if with_status:
                title = f"[{chapter.title}]({link(chapter)})" if chapter.written else chapter.title
                row += f"{title} | {chapter.status} |"
            else:
                row += f"{chapter.title} |"
            lines.append(row)
    return "\n".join(lines)


# --- the book source -----------------------------------------------------------------------

def _yaml(value) -> str:
    """A YAML scalar: JSON strings are valid YAML and escape everything that needs it."""
    return json.dumps(value)


def config_yml(manifest: Manifest) -> str:
    return "\n".join([
        "# Generated by `python run.py book` from book.toml; edits here are overwritten.",
        f"title: {_yaml(manifest.title)}",
        "author: The inference-engine-course contributors",
        "only_build_toc_files: true",
        "execute:",
        "  execute_notebooks: \"off\"      # the .ipynb files carry their outputs",
        "parse:",
        "  myst_enable_extensions: [amsmath, colon_fence, deflist, dollarmath, substitution]",
        "html:",
        "  use_edit_page_button: false",
        "  use_repository_button: false",
        "  use_issues_button: false",
        "launch_buttons:",
        "  notebook_interface: classic",
        "  binderhub_url: \"\"",
        "  thebe: false",
        "sphinx:",
        "  config:",
        "    # MathJax 2 from jupyter-server-mathjax, copied into _static: math renders offline.",
        f"    mathjax_path: {MATHJAX_PATH}",
        f"    html_extra_path: [{EXTRA_DIR}]",
        f"    mathjax2_config: {json.dumps(MATHJAX2_CONFIG)}",
        "    html_show_copyright: false",
        "    myst_heading_anchors: 2       # [term](#term) links to a heading, as on GitHub (the glossary)",
        "    suppress_warnings: [\"mystnb.unknown_mime_type\"]",
        "",
    ])


# What each planned chapter will teach, for its placeholder page (summarised from the course
# outline; a chapter's own notebook replaces it once written).
PLANNED_SYNOPSES = {
    32: "Replaces the reference attention of the engine core with fast kernels: a vectorised "
        "PyTorch backend, then Triton kernels that read the paged pool directly (prefill and "
        "decode rows in one launch), a kernel that stores new keys and values, and pools kept "
        "in 8 bits. `python run.py bench` then sets the engine beside transformers' batched "
        "generate on the same weights.",
    33: "Takes the remaining overhead out of every step: CUDA graphs captured for a few batch "
        "sizes with the batch padded up to the nearest, a fused add-and-norm, and asynchronous "
        "scheduling, where the CPU prepares step n + 1 while the GPU runs step n.",
    34: "Grows Chapter 8's sampler into a production one: repetition, frequency and presence "
        "penalties, logit bias, allowed tokens, a minimum length, log-probabilities of outputs "
        "and prompts, per-request seeds, and several samples per prompt, all in one batched pass.",
    35: "Makes the model's output match a regular expression or a JSON schema by masking, at "
        "every step, the tokens whose bytes would leave the grammar.",
    36: "Builds a real tokenizer: byte-level BPE trained, encoded and decoded, SmolLM2's "
        "vocabulary and chat template read from its GGUF file, incremental detokenization for "
        "streaming, and stop strings.",
    37: "Moves Chapter 26's speculative decoding into the engine core: drafters (n-gram lookup, "
        "a draft model, small heads on the target's last hidden state), verification rows in "
        "the flat batch, and trimming the blocks of rejected tokens.",
    38: "Puts the engine behind an OpenAI-compatible HTTP API: completions and chat, streamed "
        "tokens, cancellation when a client goes away, and back-pressure when the server is full.",
    39: "Reads the checkpoint formats found in the wild: sharded safetensors and GGUF, with its "
        "F16, Q8_0, Q4_0 and Q4_1 blocks dequantized or kept quantized in the engine; `python "
        "run.py fetch smollm2` gets a real model to run.",
    40: "Separates the engine from CUDA: a device abstraction for other accelerators and CPUs, "
        "and a model whose layers are placed on several devices.",
    41: "Spreads one model over several GPUs with torch.distributed: tensor parallelism inside "
        "each layer, pipeline parallelism across layers, and prefill handed to another worker "
        "than decode.",
    42: "Adds a registry of model families to the engine: Llama (SmolLM2-135M speaks real text), "
        "Mistral and Qwen2, with sliding-window attention, RoPE scaling and latent attention.",
    43: "Serves many LoRA adapters in one batch, and images: vision embeddings placed in the "
        "token stream, M-RoPE positions, and cache keys that include the image.",
}


def planned_page(chapter: Chapter) -> str:
    page = f"# {chapter.number}. {chapter.title}\n\n*Planned.* This chapter is not written yet."
    synopsis = PLANNED_SYNOPSES.get(chapter.number)
    if synopsis:
        page += f" What it will teach:\n\n{synopsis}"
    return page + "\n"


def page_path(chapter: Chapter) -> str:
    """The chapter's page inside the book source, without extension."""
    if chapter.written:
        return f"chapters/{chapter.dirname}/{chapter.dirname}"
    return f"planned/{chapter.dirname}"


def toc_yml(manifest: Manifest, pages: tuple[tuple[str, str], ...] | list[tuple[str, str]] = ()) -> str:
    """The table of contents: one part per part of book.toml, then `pages` (path, title)
    under REFERENCE_CAPTION when there are any."""
    lines = ["# Generated by `python run.py book` from book.toml; edits here are overwritten.",
             "format: jb-book", "root: intro", "parts:"]
    for part in manifest.parts:
        lines.append(f"  - caption: {_yaml(f'Part {part.id}: {part.title}')}")
        lines.append("    chapters:")
        for chapter in manifest.in_part(part.id):
            suffix = "" if chapter.written else " (planned)"
            lines.append(f"      - file: {page_path(chapter)}")
            lines.append(f"        title: {_yaml(f'{chapter.number}. {chapter.title}{suffix}')}")
    if pages:
        lines.append(f"  - caption: {_yaml(REFERENCE_CAPTION)}")
        lines.append("    chapters:")
        for path, title in pages:
            lines.append(f"      - file: {path}")
            lines.append(f"        title: {_yaml(title)}")
    return "\n".join(lines) + "\n"


def intro_page(manifest: Manifest, pages: tuple[tuple[str, str], ...] | list[tuple[str, str]] = ()) -> str:
    """The landing page: how to use this book, then every chapter, then the reference pages."""
    written = len(manifest.written)
    first = manifest.chapters[0]
    reference = ", ".join(f"[{title}]({path}.md)" for path, title in pages)
    return (f"# {manifest.title}\n\n"
            "## What you will build\n\n"
            "An LLM inference engine, in Python and PyTorch, for the Qwen3 model family, written "
            "by you one function at a time. First the model itself (embeddings, RMSNorm, "
            "attention, rotary positions, the MLP), checked against Hugging Face transformers "
            "until the logits agree; then generation with a KV cache; then what makes a server "
            "fast (static and continuous batching, chunked prefill, a paged KV cache with "
            "prefix sharing, speculative decoding, quantization, FlashAttention and Triton "
            "kernels); then one engine core that schedules every request the way vLLM's does; "
            "and finally what makes it a server people use: fast kernels and CUDA graphs, a full "
            "sampler, grammars, speculation inside the core, a real tokenizer and real checkpoints "
            "(SmolLM2 answers in sentences, on any laptop), an OpenAI-compatible HTTP API, "
            "several devices and processes, LoRA adapters and images.\n\n"
            "## Before you start\n\n"
            "- **You need** Python you can read and write comfortably, the basics of PyTorch "
            "(tensors, shapes, `nn.Module`, matrix products) and of linear algebra (dot "
            "products, softmax). Nothing about transformers or serving is assumed: the book "
            "builds it.\n"
            "- **You do not need** a GPU. Every chapter runs on a laptop's CPU with a tiny Qwen3 "
            "whose weights are generated from a seed; with a GPU and a real checkpoint the same "
            "tests run unchanged.\n\n"
            "## Setup\n\n"
            "In a clone of the repository, with Python 3.11 or newer:\n\n"
            "```bash\n"
            "python -m venv .venv && source .venv/bin/activate\n"
            "pip install -r requirements.txt && python run.py core\n"
            "pytest\n"
            "```\n\n"
            "The first command makes a virtual environment. The second installs the pinned "
            "requirements and runs the course's main job (the finished engine core serving a "
            "batch of requests, one JSON line per engine); the third runs every test, which "
            "takes a few minutes on a CPU. The repository's README has the details (a CPU-only "
            "torch, a real Qwen3 checkpoint).\n\n"
            "## How the chapters work\n\n"
            "Each chapter is a notebook: read it, run its cells, and watch the reference engine "
            "do what the text explains. Then:\n\n"
            "1. **Stubs.** The chapter names a few functions in `engine/`, your copy of the "
            "engine, whose docstrings say `(Your engine: Chapter N)`. Each docstring is your "
            "brief: what to compute, the shapes, the traps. The notebook's hints (collapsed, "
            "from the idea to near-pseudocode) are there when you are stuck.\n"
            "2. **Check cells.** The notebook runs your function beside the reference and prints "
            "PASS, FAIL with the first difference, or NOT IMPLEMENTED YET for a stub you have not "
            "written.\n"
            "3. **Milestone.** `pytest --impl engine tests/test_chNN_<slug>.py` checks your "
            "functions against an oracle that shares none of your code (PyTorch's own "
            "operators, transformers, the reference's solo `generate`). When it passes, you "
            "have everything the next chapter needs.\n"
            "4. **Progress.** `python run.py progress` shows the stubs you have filled in, chapter "
            "by chapter, and the milestone to run next.\n\n"
            "A chapter takes, as a rough guide, an hour to read and run, and one to three hours "
            "to write its stubs and pass its milestone; Part VII's engine core is a few days' "
            "work. Go in order: each chapter stands on the ones before it.\n\n"
            "## The repository\n\n"
            "`chapters/` holds these notebooks (each as a `.md` text file and an executed "
            "`.ipynb`), `engine/` is yours to fill in, `solutions/` is the complete reference, "
            "`tests/` has one milestone file per chapter, `run.py` is the command line "
            "(`python run.py` lists its commands), and `book.toml` lists the chapters. The "
            "README is the learner's and instructor's guide; CONTRIBUTING.md is the "
            "maintainer's.\n\n"
            "## The chapters\n\n"
            f"Start with [Chapter {first.number}: {first.title}]({first.notebook_ipynb}). "
            + (f"All {written} chapters are written.\n\n" if written == len(manifest.chapters) else
               f"{written} of {len(manifest.chapters)} chapters are written; the others are listed "
               "as planned, each with a synopsis of what it will teach.\n\n")
            + chapter_table(manifest, link=lambda c: c.notebook_ipynb) + "\n"
            + (f"\nAlso in this book: {reference}, and an {{ref}}`index <genindex>` of the terms "
               "the glossary defines, with the chapter that builds each.\n" if pages else ""))


def build_source(target: Path, manifest: Manifest | None = None, root: Path = ROOT) -> Path:
    """Write the Jupyter Book source folder at `target` (replacing it) and return it."""
    manifest = manifest or manifest_module.load(root / "book.toml")
    target = Path(target)
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    pages = [(path, title) for path, title in REFERENCE_PAGES if (root / f"{path}.md").is_file()]
    (target / "_config.yml").write_text(config_yml(manifest), encoding="utf-8")
    (target / "_toc.yml").write_text(toc_yml(manifest, pages), encoding="utf-8")
    (target / "intro.md").write_text(intro_page(manifest, pages), encoding="utf-8")
    shutil.copytree(STATIC_DIR, target / "_static")
    for path, _ in pages:
        (target / f"{path}.md").parent.mkdir(parents=True, exist_ok=True)
        text = (root / f"{path}.md").read_text(encoding="utf-8")
        (target / f"{path}.md").write_text(indexed_glossary(text) if path == GLOSSARY else text, encoding="utf-8")
    glossary = root / f"{GLOSSARY}.md"
    terms_of = chapter_terms(glossary.read_text(encoding="utf-8")) if glossary.is_file() else {}
    figure_texts: dict[str, tuple[str, str]] = {}
    for chapter in manifest.chapters:
        if chapter.written:
            source = root / "chapters" / chapter.dirname
            shutil.copytree(source, target / "chapters" / chapter.dirname,
                            ignore=shutil.ignore_patterns(f"{chapter.dirname}.md", ".ipynb_checkpoints",
                                                          "__pycache__"))
            for notebook in (target / "chapters" / chapter.dirname).glob("*.ipynb"):
                prepare_notebook(notebook, terms_of.get(chapter.number, []))
                figure_texts |= figures.figure_texts(json.loads(notebook.read_text(encoding="utf-8")),
                                                          chapter.number, root)
        else:
            page = target / f"{page_path(chapter)}.md"
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(planned_page(chapter), encoding="utf-8")
    (target / FIGURE_TEXTS).write_text(json.dumps(figure_texts, indent=1, ensure_ascii=False), encoding="utf-8")
    return target


def copy_mathjax(destination: Path) -> None:
    """Copy the MathJax bundle that jupyter-server-mathjax ships to `destination`, without
    importing that package (it would import jupyter_server)."""
    from importlib.util import find_spec
    spec = find_spec("jupyter_server_mathjax")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("jupyter-server-mathjax is not installed (the book's offline math): "
                                "pip install -r requirements-book.txt")
    shutil.copytree(Path(list(spec.submodule_search_locations)[0]) / "static", destination)


def prepare_notebook(notebook: Path, index_terms: list[str] | tuple[str, ...] = ()) -> None:
    """Make a copied notebook ready for its page, in place.

    The glossary terms this chapter builds (`index_terms`) become entries of the book's
    index pointing at the chapter: an index directive after the title.

    Widget state and widget views are dropped: in a page without a kernel they would only
    make Sphinx load a widget manager from a CDN and show nothing (cells that use a widget
    carry the remove-cell tag and a static version beside them). Consecutive stream outputs
    of one stream are merged: a kernel flushes stdout when it likes, and each piece would
    be a box of its own on the page, one printout shown as two."""
    data = json.loads(notebook.read_text(encoding="utf-8"))
    data.get("metadata", {}).pop("widgets", None)
    first_text = next((cell for cell in data.get("cells", []) if cell.get("cell_type") == "markdown"), None)
    if index_terms and first_text is not None:
        title, _, rest = "".join(first_text["source"]).partition("\n")
        first_text["source"] = f"{title}\n\n```{{index}} {', '.join(index_terms)}\n```\n{rest}"
    for cell in data.get("cells", []):
        outputs = cell.get("outputs", [])
        for output in outputs:
            output.get("data", {}).pop(WIDGET_MIME, None)
        outputs = [o for o in outputs if o.get("output_type") not in ("display_data", "execute_result")
                   or o.get("data")]
        cell["outputs"] = merged_streams(outputs)
    notebook.write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")


# The glossary (a REFERENCE_PAGES path): one table of terms per part of the book, each row
# `| term | [chapter number](its notebook) | `module.name` | what it is |`.
GLOSSARY = "chapters/glossary"
GLOSSARY_PART = re.compile(r"^## Part ([IVX]+): ")
GLOSSARY_ROW = re.compile(r"^\| ([^|]+?) \| \[(\d+)\]\(([^)]+)\) \| `([^`]+)` \| [^|]+ \|$")


@dataclasses.dataclass(frozen=True)
class GlossaryRow:
    part: str          # the part's id, "I" to "VIII"
    term: str
    chapter: int       # the chapter that builds it
    link: str          # the chapter's notebook, relative to the glossary
    name: str          # its name in the reference engine: module.name


def glossary_rows(text: str) -> list[GlossaryRow | str]:
    """The rows of the glossary's part tables ('## Part N: ...' sections), in order; a line
    of such a table that is not in the row's form comes back as that line, unparsed."""
    rows: list[GlossaryRow | str] = []
    part = None
    for line in text.splitlines():
        heading = GLOSSARY_PART.match(line)
        if heading or line.startswith("## "):
            part = heading.group(1) if heading else None
        elif part is not None and line.startswith("| ") and not line.startswith("| Term "):
            row = GLOSSARY_ROW.match(line)
            rows.append(GlossaryRow(part, row.group(1), int(row.group(2)), row.group(3), row.group(4))
                        if row else line)
    return rows


def chapter_terms(text: str) -> dict[int, list[str]]:
    """{chapter number: the glossary terms that chapter builds}."""
    terms: dict[int, list[str]] = {}
    for row in glossary_rows(text):
        if isinstance(row, GlossaryRow):
            terms.setdefault(row.chapter, []).append(row.term)
    return terms


def indexed_glossary(text: str) -> str:
    """The glossary as the book shows it: each term of a part table, and each heading of a
    longer entry, is also an entry of the book's index (genindex) pointing at it."""
    lines = []
    for line in text.splitlines():
        row = GLOSSARY_ROW.match(line)
        if row:
            line = f"| {{index}}`{row.group(1)}` |" + line[len(row.group(1)) + 4:]
        elif line.startswith("## ") and not line.startswith(("## Part ", "## Paging")):
            lines += [f"```{{index}} {line[3:]}", "```", ""]
        lines.append(line)
    return "\n".join(lines) + "\n"


def merged_streams(outputs: list[dict]) -> list[dict]:
    """`outputs` with every run of consecutive stream outputs of the same stream (stdout,
    stderr) joined into one."""
    merged: list[dict] = []
    for output in outputs:
        previous = merged[-1] if merged else None
        if (previous is not None and output.get("output_type") == previous.get("output_type") == "stream"
                and output.get("name") == previous.get("name")):
            text = "".join(previous["text"]) + "".join(output["text"])
            merged[-1] = {**previous, "text": text}
        else:
            merged.append(output)
    return merged


def offline_problems(html: Path, manifest: Manifest) -> list[str]:
    """What keeps the built book from being read offline, page by page: scripts or styles
    fetched from another host, a written chapter missing or without a figure, math on a
    page that does not load the bundled MathJax. Empty when the book is fine."""
    import re
    remote = re.compile(r"""<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=["'](?:https?:)?//[^"']*""", re.IGNORECASE)
    problems = []
    for page in sorted(html.rglob("*.html")):
        text = page.read_text(encoding="utf-8", errors="replace")
        name = page.relative_to(html)
        for match in remote.finditer(text):
            problems.append(f"{name}: fetches {match.group(0)[:120]}")
        if 'class="math' in text and f"{MATHJAX_DIR}/MathJax.js" not in text:
            problems.append(f"{name}: has math but does not load the bundled MathJax")
    for chapter in manifest.chapters:
        if not chapter.written:
            continue
        page = html / "chapters" / chapter.dirname / f"{chapter.dirname}.html"
        if not page.is_file():
            problems.append(f"Chapter {chapter.number}: no page {page.relative_to(html)}")
            continue
        text = page.read_text(encoding="utf-8", errors="replace")
        if "<img" not in text and "<svg" not in text:
            problems.append(f"Chapter {chapter.number}: its page has no figure")
    if not (html / MATHJAX_DIR / "MathJax.js").is_file():
        problems.append(f"{MATHJAX_DIR}/MathJax.js is missing: the bundled MathJax was not copied")
    return problems + missing_local_files(html)


# A file a page or a style sheet refers to: src= and href= in HTML, url() in CSS.
HTML_REFERENCE = re.compile(r"""\b(?:src|href)=["']([^"'#?]+)""", re.IGNORECASE)
CSS_REFERENCE = re.compile(r"""url\(\s*["']?([^"')#?]+)""")


def missing_local_files(html: Path) -> list[str]:
    """Every file of the book that a page (src=, href=) or a style sheet (url()) refers to
    and that is not there, as 'referrer: target'. Remote addresses, data: URLs and anchors
    are not files of the book. (MathJax builds some font addresses in its scripts: only
    the page check in a browser sees those.)"""
    problems = []
    for path in sorted(list(html.rglob("*.html")) + list(html.rglob("*.css"))):
        name = path.relative_to(html).as_posix()
        if name.startswith(MATHJAX_DIR + "/") or (name.startswith("_static/") and path.suffix == ".html"):
            continue                                 # MathJax's own, and the theme's page templates
        pattern = CSS_REFERENCE if path.suffix == ".css" else HTML_REFERENCE
        for target in dict.fromkeys(pattern.findall(path.read_text(encoding="utf-8", errors="replace"))):
            if re.match(r"[a-z][a-z0-9+.-]*:|//", target, re.IGNORECASE) or not target.strip():
                continue
            if not (path.parent / urllib.parse.unquote(target)).exists():
                problems.append(f"{name}: refers to {target}, which is not in the book")
    return problems


def jupyter_book_command() -> list[str]:
    """How to invoke Jupyter Book 1 from this interpreter's environment."""
    beside = Path(sys.executable).parent / "jupyter-book"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("jupyter-book")
    if found:
        return [found]
    raise FileNotFoundError("jupyter-book is not installed: pip install -r requirements-book.txt")


def build(out: Path = DEFAULT_OUT, manifest: Manifest | None = None, quiet: bool = True) -> Path:
    """Build the HTML book under `out`; returns the folder holding index.html."""
    # Absolute, because jupyter-book runs with `out` as its working directory: a relative
    # source path (the default, build/book) would be looked up inside itself.
    out = Path(out).resolve()
    source = build_source(out / "src", manifest)
    copy_mathjax(source / EXTRA_DIR / MATHJAX_DIR)
    command = jupyter_book_command() + ["build", str(source), "--path-output", str(out), "--builder", "html"]
    if quiet:
        command.append("--quiet")
    subprocess.run(command, check=True, cwd=out)
    html = out / "_build" / "html"
    finish_pages(html, json.loads((source / FIGURE_TEXTS).read_text(encoding="utf-8")))
    return html


TABLE = re.compile(r"<table\b.*?</table>", re.DOTALL)
CODE_IN_TABLE = re.compile(r'(<span class="pre">)([^<]*)(</span>)')


def breakable(code: re.Match) -> str:
    """A code name in a table, with a line-break opportunity after each dot and underscore."""
    name = re.sub(r"([._])(?=\w)", r"\1<wbr>", code.group(2))
    return code.group(1) + name + code.group(3)


CODE_BLOCK = re.compile(r'(<div class="highlight"><pre>)(.*?)(</pre>)', re.DOTALL)
# A wrapped code line continues this much further in than the line itself starts.
HANGING_INDENT_CH = 4


def hanging_lines(block: re.Match) -> str:
    """A highlighted code block with each line in its own span, so that a line too long for
    the column wraps with a hanging indent and a bar beside its continuation (course.css:
    span.code-line) instead of starting again at the left edge, where it would read as a
    new line of Python. A block whose
    highlighting spans a line break (a string over several lines) is left as it is."""
    lines = block.group(2).split("\n")
    if any(line.count("<span") != line.count("</span>") for line in lines):
        return block.group(0)
    wrapped = []
    for number, line in enumerate(lines):
        if number == len(lines) - 1 and not line:
            break                                # the newline that ends the block
        text = re.sub(r"<[^>]*>", "", line)
        indent = len(text) - len(text.lstrip(" ")) + HANGING_INDENT_CH
        wrapped.append(f'<span class="code-line" style="--hang:{indent}ch;padding-left:{indent}ch;'
                       f'text-indent:-{indent}ch">{line}\n</span>')
    return block.group(1) + "".join(wrapped) + block.group(3)


def finish_pages(html: Path, figure_texts: dict[str, tuple[str, str]]) -> None:
    """What Sphinx cannot be told, done to the built pages in place: every figure gets its
    alt text and caption (book_figures), code names in tables may break after a dot or an
    underscore (so a table of names fits the column), a wrapped code line keeps a hanging
    indent, and sphinx-thebe's unused scripts are removed."""
    for page in html.rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        finished = figures.describe_figures(THEBE_SCRIPTS.sub("", text), figure_texts)
        finished = TABLE.sub(lambda table: CODE_IN_TABLE.sub(breakable, table.group(0)), finished)
        finished = CODE_BLOCK.sub(hanging_lines, finished)
        if finished != text:
            page.write_text(finished, encoding="utf-8")


# --- what a reader sees: checked in a browser -----------------------------------------------

# The window the layout is checked in: a laptop screen, both sidebars shown, so the article
# column is as narrow as a desktop reader gets it (about 780 px).
CHECK_WINDOW = (1440, 1000)
# Measured on each page: the article column's width, every table wider than it, every code
# block or printout whose lines run past its box (it scrolls sideways), every figure without
# alt text. Console errors are read from the browser's log.
MEASURE_PAGE_JS = """
const column = document.querySelector('article.bd-article');
if (!column) return null;
const style = getComputedStyle(column);
const width = column.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
const label = (el) => Array.from((el.textContent || '').trim().replace(/\\s+/g, ' ')).slice(0, 60).join('');
const tables = [...column.querySelectorAll('table')]
  .filter(t => t.getBoundingClientRect().width > width + 1)
  .map(t => [Math.round(t.getBoundingClientRect().width), label(t)]);
const code = [...column.querySelectorAll('pre')]
  .filter(p => p.scrollWidth > p.clientWidth + 1)
  .map(p => [p.scrollWidth, label(p)]);
const images = [...column.querySelectorAll('img')]
  .filter(i => !i.alt || i.alt === i.getAttribute('src'))
  .map(i => i.getAttribute('src'));
return {width: Math.round(width), tables, code, images};
"""
# Measured on each page once MathJax has typeset it and its fonts have loaded (an async
# script: the last argument is the callback): for every inline formula, how far its
# baseline sits above the text's baseline, and its size over the text's. A zero-size
# inline-block's bottom is the baseline where it stands: one goes before the formula,
# one into each of its first symbols.
MEASURE_MATH_JS = """
const done = arguments[arguments.length - 1];
const baselineOf = (parent, before) => {
  const mark = document.createElement('span');
  mark.style.cssText = 'display:inline-block;width:0;height:0';
  parent.insertBefore(mark, before);
  const bottom = mark.getBoundingClientRect().bottom;
  mark.remove();
  return bottom;
};
const measure = () => {
  try { done(measured()); } catch (error) { done([['the check failed: ' + error, 0, 1]]); }
};
const measured = () => {
  const found = [];
  for (const math of document.querySelectorAll('article.bd-article span.math')) {
    if (math.parentNode.closest('.MathJax')) continue;     // MathJax's own span of that class
    const symbols = [...math.querySelectorAll('.MathJax .mi, .MathJax .mn, .MathJax .mo')].slice(0, 8);
    if (!symbols.length) continue;
    const line = baselineOf(math.parentNode, math);
    const box = (math.querySelector('.MathJax span.math') || math).getBoundingClientRect();
    if (line < box.top - 2 || line > box.bottom + 2) continue;   // the formula starts a line: no text beside it
    // A fraction's numerator or an exponent sits off the baseline by design, smaller: the
    // symbol nearest the baseline and the largest one stand for the formula.
    const raised = symbols.map((symbol) => line - baselineOf(symbol, null))
      .reduce((a, b) => (Math.abs(b) < Math.abs(a) ? b : a));
    const size = (element) => parseFloat(getComputedStyle(element).fontSize);
    const scale = Math.max(...symbols.map(size)) / size(math.parentNode);
    if (Number.isFinite(raised) && Number.isFinite(scale))   // a hidden formula has no size
      found.push([Array.from((math.textContent || '').trim()).slice(0, 40).join(''), raised, scale]);
  }
  return found;
};
const fontsThenMeasure = () => document.fonts.ready.then(measure);
if (window.MathJax && MathJax.Hub && MathJax.Hub.Queue) MathJax.Hub.Queue(fontsThenMeasure); else fontsThenMeasure();
"""
# How far inline math may sit off the text's baseline (CSS px), and how much larger or
# smaller than the text it may be.
MATH_BASELINE_PX = 1.0
MATH_SCALE = (0.9, 1.15)
# Console messages that are not the book's fault: the theme complains once, on a reader's
# first visit, that no light/dark mode is stored yet; a page opened from file:// may not
# fetch MathJax's web fonts (origin 'null'), which a served book does.
IGNORED_CONSOLE = ("Got invalid theme mode", "blocked by CORS policy", "about:blank", "Failed to load resource")
# Requests that fail without the book being at fault: the icon a browser asks every site for,
# and the about:blank font MathJax 2 loads to test whether web fonts work.
IGNORED_REQUESTS = ("/favicon.ico", "about:blank")


def browser_driver(width: int, height: int):
    """A headless Chromium driven by selenium, or None when either is missing or the browser
    does not start."""
    chromedriver = shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return None
    if chromedriver is None:
        return None
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    try:
        return webdriver.Chrome(service=Service(chromedriver), options=options)
    except WebDriverException:
        return None


@contextlib.contextmanager
def served(folder: Path):
    """An HTTP server for `folder` on a free local port, in a thread: its base URL. The page
    check reads the book served, as a reader's browser or a docs host gets it (a page opened
    from file:// may not load MathJax's web fonts at all)."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format, *args):       # noqa: A002 (the base class's name)
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def failed_requests(performance_log: list[dict]) -> list[str]:
    """'URL (why)' for every request of a page load that failed, from Chromium's performance
    log: an HTTP error status, or a load that never completed (a missing file, a refused
    font)."""
    urls: dict[str, str] = {}
    failed = []
    for entry in performance_log:
        message = json.loads(entry["message"])["message"]
        params = message.get("params", {})
        if message["method"] == "Network.requestWillBeSent":
            urls[params["requestId"]] = params["request"]["url"]
        elif message["method"] == "Network.responseReceived" and params["response"]["status"] >= 400:
            failed.append(f"{params['response']['url']} (status {params['response']['status']})")
        elif (message["method"] == "Network.loadingFailed" and not params.get("canceled")
              and params.get("requestId") in urls and params.get("errorText") != "net::ERR_ABORTED"):
            failed.append(f"{urls[params['requestId']]} ({params.get('errorText')})")
    return [f for f in dict.fromkeys(failed) if not any(known in f for known in IGNORED_REQUESTS)]


def page_problems(html: Path) -> list[str] | None:
    """Open every page of the built book, served from a local port, in headless Chromium at
    CHECK_WINDOW and list what a reader would trip over: a table wider than the column (its
    last columns hidden), a code block or printout that scrolls sideways, a figure without
    alt text, an error in the browser's console, a file the page asked for that did not
    load (read once MathJax has typeset the page and loaded its fonts), inline math off the
    text's baseline or out of scale with it. None when no browser is available (selenium
    and chromedriver)."""
    driver = browser_driver(*CHECK_WINDOW)
    if driver is None:
        return None
    driver.set_script_timeout(60)
    problems = []
    try:
        with served(html) as base:
            for page in sorted(html.rglob("*.html")):
                name = page.relative_to(html).as_posix()
                if name.startswith(("_static/", MATHJAX_DIR + "/")) or name in ("genindex.html", "search.html"):
                    continue
                problems += _problems_of(driver, base + name, name)
    finally:
        driver.quit()
    return problems


def _problems_of(driver, url: str, name: str) -> list[str]:
    """page_problems for one page, at `url`, called `name` in what it reports."""
    problems = []
    driver.get(url)
    found = driver.execute_script(MEASURE_PAGE_JS)
    formulas = driver.execute_async_script(MEASURE_MATH_JS)
    for entry in driver.get_log("browser"):
        message = entry.get("message", "")
        if entry.get("level") == "SEVERE" and not any(known in message for known in IGNORED_CONSOLE):
            message = message.replace(url.rsplit("/", 1)[0] + "/", "")   # the server's address says nothing
            problems.append(f"{name}: console error: {message[:160]}")
    base = url[:len(url) - len(name)]
    for request in failed_requests(driver.get_log("performance")):
        problems.append(f"{name}: did not load {request.replace(base, '')}")
    off = [(text, raised, scale) for text, raised, scale in formulas
           if abs(raised) > MATH_BASELINE_PX or not MATH_SCALE[0] <= scale <= MATH_SCALE[1]]
    if off:
        text, raised, scale = off[0]
        problems.append(f"{name}: {len(off)} of {len(formulas)} inline formulas sit off the text's baseline or "
                        f"out of scale with it ({text!r}: {raised:+.1f} px above it, {scale:.2f} times the "
                        f"text's size)")
    if not found:
        return problems
    for table_width, text in found["tables"]:
        problems.append(f"{name}: a table {table_width} px wide in the {found['width']} px column ({text!r})")
    for code_width, text in found["code"]:
        problems.append(f"{name}: a code block or printout scrolls sideways ({code_width} px "
                        f"in the {found['width']} px column: {text!r})")
    for source in found["images"]:
        problems.append(f"{name}: a figure without alt text ({source})")
    return problems


# --- figures and tables on the page ----------------------------------------------------------

# The width of the book's text column in CSS pixels, as the book's review measured it: a
# figure wider than this is scaled down to it, and its labels with it. (A narrower window
# narrows the column further: 676 px at 1280 px, measured in Chromium.)
COLUMN_PX = 784
# The smallest label a reader can read without zooming, in CSS pixels as shown on the page.
MIN_LABEL_PX = 9.0
# CSS pixels per point: a browser draws an SVG whose width is in points at 96 px to 72 pt.
_PX_PER_PT = 96 / 72


@dataclasses.dataclass(frozen=True)
class FigureSize:
    """One figure of a chapter as the book shows it: its width on the page and its smallest
    label there, both in CSS pixels. `measured` is False for a raster figure, whose label
    size is estimated (png_figure_size)."""
    where: str
    width_px: float
    smallest_label_px: float
    measured: bool


def _svg_length_px(value: str) -> float:
    number = re.match(r"[\d.eE+-]+", value)
    if number is None:
        raise ValueError(f"an SVG length this check cannot read: {value!r}")
    return float(number.group(0)) * _PX_PER_PT if value.endswith("pt") else float(number.group(0))


def svg_figure_size(svg: str, where: str = "", column_px: float = COLUMN_PX) -> FigureSize:
    """Measure an SVG as an <img> in the column: it is drawn at its own width, or scaled down
    to `column_px`. Text is found as matplotlib writes it, glyph paths under a
    `scale(s -s)` transform (font size 100 s user units) or, with svg.fonttype none, a
    `font`/`font-size` style in px."""
    head = re.search(r"<svg\b[^>]*>", svg)
    width = re.search(r'\bwidth="([^"]+)"', head.group(0)) if head else None
    if head is None or width is None:
        raise ValueError(f"{where}: an SVG without a width, which the book cannot size")
    width_px = _svg_length_px(width.group(1))
    view_box = re.search(r'\bviewBox="([^"]+)"', head.group(0))
    user_width = float(view_box.group(1).split()[2]) if view_box else width_px
    px_per_unit = min(width_px, column_px) / user_width
    sizes = [100 * float(s) for s in re.findall(r"scale\(([\d.eE+-]+) -\1\)", svg)]
    sizes += [float(s) for s in re.findall(r"font(?:-size)?:[^;\"]*?([\d.]+)px", svg)]
    smallest = min(sizes) * px_per_unit if sizes else float("inf")
    return FigureSize(where, min(width_px, column_px), smallest, True)


def png_figure_size(png_base64: str, display_width: float | None, code: str = "", where: str = "",
                    column_px: float = COLUMN_PX) -> FigureSize:
    """Measure a PNG as an <img> in the column: drawn at its display width (the output's
    `width` metadata, else one CSS pixel per image pixel), scaled down to `column_px`. Its
    text cannot be read back, so the label is taken to be the smallest `fontsize=`,
    `size=` or `labelsize=` that `code` (the cell that drew it) names, or matplotlib's
    default text size, at the PNG's resolution (its pHYs chunk; 100 dpi without one). Text
    sized in a module the cell calls is not seen: draw such figures as SVG (course.diagrams.show)."""
    import base64
    import io

    import matplotlib
    from PIL import Image
    image = Image.open(io.BytesIO(base64.b64decode(png_base64)))
    dpi = float(image.info.get("dpi", (100, 100))[0])
    width_px = float(display_width or image.size[0])
    px_per_pt = dpi / 72 * (width_px / image.size[0]) * min(1.0, column_px / width_px)
    named = [float(size) for size in re.findall(r"\b(?:fontsize|labelsize|size)\s*=\s*(\d+(?:\.\d+)?)\b", code)]
    label_pt = min([float(matplotlib.rcParams["font.size"])] + named)
    return FigureSize(where, min(width_px, column_px), label_pt * px_per_pt, False)


def notebook_figure_sizes(notebook: Path, column_px: float = COLUMN_PX) -> list[FigureSize]:
    """Every figure a notebook's saved outputs put on its page, in the book's order of
    preference (the SVG of an output that also carries a PNG)."""
    data = json.loads(notebook.read_text(encoding="utf-8"))
    sizes = []
    for index, cell in enumerate(data.get("cells", [])):
        for output in cell.get("outputs", []):
            bundle = output.get("data", {})
            where = f"{notebook.stem} cell {index}"
            if "image/svg+xml" in bundle:
                svg = bundle["image/svg+xml"]
                sizes.append(svg_figure_size("".join(svg) if isinstance(svg, list) else svg, where, column_px))
            elif "image/png" in bundle:
                width = output.get("metadata", {}).get("image/png", {}).get("width")
                png = bundle["image/png"]
                code = "".join(cell.get("source", ""))
                sizes.append(png_figure_size("".join(png) if isinstance(png, list) else png, width, code, where,
                                             column_px))
    return sizes


def markdown_table_min_width_px(rows: list[str]) -> float:
    """A lower bound on a Markdown table's width on the page: a browser wraps a cell only
    at spaces, so each column is at least as wide as its longest word, plus the cell's
    padding. Inline code also breaks after a dot or an underscore (finish_pages puts a
    <wbr> there), so its longest piece between those counts."""
    text_px, code_px, padding_px = 8.0, 8.4, 24.0   # body 16 px, code 14 px monospace
    cells = [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows
             if not re.fullmatch(r"\|?[\s:|-]+\|?", row.strip())]
    widths: dict[int, float] = {}
    for row in cells:
        for column, cell in enumerate(row):
            words = [(piece, code_px) for code in re.findall(r"`([^`]+)`", cell)
                     for piece in re.split(r"(?<=[._])(?=\w)", code)]
            prose = re.sub(r"`[^`]+`|\[([^\]]*)\]\([^)]*\)", lambda m: f" {m.group(1) or ''} ", cell)
            words += [(w, text_px) for w in prose.split()]
            longest = max((len(w.strip("`")) * px for w, px in words), default=0.0)
            widths[column] = max(widths.get(column, 0.0), longest + padding_px)
    return sum(widths.values())


def markdown_tables(text: str) -> list[tuple[int, list[str]]]:
    """The pipe tables of a Markdown or MyST text: (line number of the header, rows)."""
    tables: list[tuple[int, list[str]]] = []
    rows: list[str] = []
    start, fenced = 0, False
    for number, line in enumerate(text.splitlines() + [""], start=1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if not fenced and line.lstrip().startswith("|"):
            if not rows:
                start = number
            rows.append(line)
        else:
            if len(rows) >= 2:
                tables.append((start, rows))
            rows = []
    return tables


def figure_and_table_problems(manifest: Manifest, root: Path = ROOT, column_px: float = COLUMN_PX) -> list[str]:
    """What does not fit the book's column: a figure whose smallest label, scaled to the
    column, is under MIN_LABEL_PX, and a Markdown table that cannot be narrower than the
    column. Empty when everything fits."""
    problems = []
    sources = [root / f"{path}.md" for path, _ in REFERENCE_PAGES if (root / f"{path}.md").is_file()]
    for chapter in manifest.written:
        folder = root / "chapters" / chapter.dirname
        sources.append(folder / f"{chapter.dirname}.md")
        for size in notebook_figure_sizes(folder / f"{chapter.dirname}.ipynb", column_px):
            if size.smallest_label_px < MIN_LABEL_PX:
                kind = "labels" if size.measured else "labels (estimated: a PNG)"
                problems.append(f"Chapter {chapter.number}, {size.where}: {kind} {size.smallest_label_px:.1f} px "
                                f"at {size.width_px:.0f} px wide (at least {MIN_LABEL_PX:g} px in the "
                                f"{column_px} px column)")
    for source in sources:
        if not source.is_file():
            continue
        for line, rows in markdown_tables(source.read_text(encoding="utf-8")):
            width = markdown_table_min_width_px(rows)
            if width > column_px:
                problems.append(f"{source.relative_to(root)}:{line}: a table at least {width:.0f} px wide "
                                f"(the column is {column_px} px)")
    return problems
