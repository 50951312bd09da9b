"""A chapter reads in JupyterLab (and in Notebook 7, the classic notebook's successor) as it
reads in the book: every hint and answer is a collapsed dropdown until its title is clicked,
math is typeset, the diagrams are drawn the moment a learner opens the notebook, the code of
a cell the book hides (tagged `remove-input`: the code that draws a diagram) is hidden, and
opening the notebook does not mark it modified.

The notebook is opened the way a learner first meets it: a copy nobody has run, so untrusted.
JupyterLab refuses to draw an untrusted notebook's SVG outputs (it shows the text
`<IPython.core.display.SVG object>`), which is why every diagram carries a PNG twin
(course.diagrams `show`). The MyST dropdowns (```{admonition} ... :class: dropdown```)
are rendered by jupyterlab-myst (requirements.txt); without it JupyterLab shows them as open
text. JupyterLab hides a cell's code when its metadata says `"jupyter": {"source_hidden":
true}`, which every `remove-input` cell carries (set in the .md, jupytext carries it over). A
real JupyterLab server and headless Chromium check this (about 20 s on an idle machine); the
test skips with one line where no browser is installed. Cheap checks over every chapter's
saved notebook run always."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from course import book, manifest
from course.manifest import ROOT

# The chapter opened in the browser: it has hints, answers, a diagram and display math.
CHAPTER = 6
DROPDOWN = re.compile(r"```\{admonition\} ([^\n]*)\n\s*:class: dropdown")
SVG_TEXT = "SVG object>"
# Where the learner opens a notebook: JupyterLab, and Notebook 7 (`jupyter notebook`).
VIEWS = {"JupyterLab": "/lab/tree/{name}?reset", "Notebook 7": "/notebooks/{name}"}
KERNEL_DISPLAY_NAME = "Python 3 (ipykernel)"        # what ipykernel's kernelspec calls itself


def chapter_notebooks() -> list[Path]:
    return [ROOT / chapter.notebook_ipynb for chapter in manifest.load().chapters if chapter.written]


def test_every_diagram_has_a_picture_an_untrusted_notebook_shows():
    """JupyterLab draws an untrusted notebook's PNG but not its SVG: an SVG output alone is a
    line of text to a learner who has not run the notebook."""
    svg_only = []
    for path in chapter_notebooks():
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        for number, cell in enumerate(cells):
            for output in cell.get("outputs", []):
                data = output.get("data", {})
                if "image/svg+xml" in data and "image/png" not in data:
                    svg_only.append(f"{path.name} cell {number}")
    assert not svg_only, ("these outputs are SVG without a PNG twin, so JupyterLab shows "
                          "'<IPython.core.display.SVG object>' until the learner runs them (draw them with "
                          "course.diagrams.show and re-execute the notebook): " + ", ".join(svg_only))


def test_every_cell_the_book_hides_hides_its_code_in_jupyter():
    """A `remove-input` cell's code is hidden in the book; JupyterLab and Notebook 7 hide it
    only where the cell's metadata says so (jupyter.source_hidden). And every chapter names
    ipykernel's own kernelspec display name, so opening it does not rewrite (and dirty) it."""
    shown, renamed = [], []
    for path in chapter_notebooks():
        notebook = json.loads(path.read_text(encoding="utf-8"))
        if notebook["metadata"].get("kernelspec", {}).get("display_name") != KERNEL_DISPLAY_NAME:
            renamed.append(path.name)
        for number, cell in enumerate(notebook["cells"], 1):
            metadata = cell.get("metadata", {})
            if "remove-input" in metadata.get("tags", []) and not metadata.get("jupyter", {}).get("source_hidden"):
                shown.append(f"{path.name} cell {number}")
    assert not shown, ("these cells are tagged remove-input but show their code in JupyterLab: give them "
                       "`jupyter: {source_hidden: true}` in the .md's cell options and run `jupytext --sync`: "
                       + ", ".join(shown))
    assert not renamed, (f"these chapters' kernelspec display_name is not {KERNEL_DISPLAY_NAME!r}, so JupyterLab "
                         "marks them modified on opening: " + ", ".join(renamed))


def _browser_or_skip() -> None:
    """Skip in one line, saying how to get them, where Chromium or its driver is missing."""
    pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    if not ((shutil.which("chromium") or shutil.which("chromium-browser")) and shutil.which("chromedriver")):
        pytest.skip("no browser here: `apt-get install chromium chromium-driver` (Debian) runs this test")


def _browser():
    """The headless Chromium the book's page check drives (course.book.browser_driver)."""
    _browser_or_skip()
    browser = book.browser_driver(1400, 1000)
    if browser is None:
        pytest.skip("headless Chromium did not start")
    return browser


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _quiet_settings(folder: Path) -> None:
    """User settings for this server only: every cell rendered at once (no windowing, so all
    of the chapter's dropdowns and figures are in the page), and no news pop-up."""
    for plugin, values in {"notebook-extension/tracker": {"windowingMode": "none"},
                           "apputils-extension/notification": {"fetchNews": "false"}}.items():
        path = folder / f"@jupyterlab/{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values), encoding="utf-8")


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    """A JupyterLab server (no token, no browser) on a folder holding a fresh copy of the
    chapter's notebook, which it does not trust (an empty, in-memory signature database)."""
    _browser_or_skip()  # before starting a server nobody could look at
    folder = tmp_path_factory.mktemp("jupyterlab")
    chapter = manifest.load().chapter(CHAPTER)
    notebook = ROOT / chapter.notebook_ipynb
    shutil.copy(notebook, folder / notebook.name)
    _quiet_settings(folder / "settings")
    port = _free_port()
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(folder / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(folder / "workspaces"), JUPYTER_RUNTIME_DIR=str(folder / "runtime"))
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={port}",
               "--ServerApp.ip=127.0.0.1", "--ServerApp.token=", "--ServerApp.password=",
               f"--ServerApp.root_dir={folder}", "--NotebookNotary.db_file=:memory:",
               # window.jupyterapp, through which the test asks whether the open notebook is modified
               "--LabServerApp.expose_app_in_browser=True"]
    log = (folder / "server.log").open("wb")
    server = subprocess.Popen(command, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2):
                    break
            except OSError as error:
                if server.poll() is not None or time.monotonic() > deadline:
                    log_tail = (folder / "server.log").read_text()[-2000:]
                    raise AssertionError(f"JupyterLab did not start:\n{log_tail}") from error
                time.sleep(0.3)
        yield url, notebook
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


# What the page shows, read in one pass (JupyterLab re-renders Markdown cells while a
# notebook opens, so element handles go stale; a script sees one consistent moment).
PAGE_STATE = """
const notebook = document.querySelector('.jp-Notebook');
if (!notebook) return null;
const dropdowns = [...notebook.querySelectorAll('.jp-MarkdownCell details')].map(d => ({
    title: d.querySelector('summary').innerText.trim(), open: d.open,
    bodyShown: [...d.children].some(c => c.tagName !== 'SUMMARY' && c.checkVisibility())}));
const images = [...notebook.querySelectorAll('.jp-OutputArea-output img')];
const current = window.jupyterapp && window.jupyterapp.shell.currentWidget;
return {
    cells: notebook.querySelectorAll('.jp-Cell').length,
    rawDirectives: [...notebook.querySelectorAll('.jp-MarkdownCell .jp-RenderedMarkdown, .jp-MarkdownCell .myst')]
        .filter(m => m.innerText.includes(':class: dropdown')).length,
    dropdowns: dropdowns,
    svgAsText: [...notebook.querySelectorAll('.jp-OutputArea-output')].filter(o => o.innerText.includes('%s')).length,
    drawnImages: images.filter(i => i.complete && i.naturalWidth > 0 && i.checkVisibility()).length,
    math: notebook.querySelectorAll('.jp-MarkdownCell mjx-container, .jp-MarkdownCell .katex').length,
    // each printed table (course.notebook.table): its cells' smallest side padding and its header's rule
    tables: [...notebook.querySelectorAll('.jp-OutputArea-output table')].map(t => ({
        padding: Math.min(...[...t.querySelectorAll('td, th')].map(c => parseFloat(getComputedStyle(c).paddingLeft))),
        headerRule: parseFloat(getComputedStyle(t.querySelector('thead')).borderBottomWidth)})),
    shownCode: [...notebook.querySelectorAll('.jp-CodeCell .jp-InputArea')].filter(a => a.checkVisibility())
        .map(a => a.innerText),
    hiddenInputs: notebook.querySelectorAll('.jp-CodeCell .jp-InputPlaceholder').length,
    // the document's own flag (the dot on JupyterLab's tab, the prompt before leaving Notebook 7)
    modified: current && current.context ? current.context.model.dirty : null,
    dirtyTabs: document.querySelectorAll('.lm-TabBar-tab.jp-mod-dirty').length,
};
""" % SVG_TEXT


def _wait_for(browser, condition, what, seconds=60):
    from selenium.webdriver.support.ui import WebDriverWait
    try:
        return WebDriverWait(browser, seconds, poll_frequency=0.25).until(condition)
    except Exception as error:
        raise AssertionError(f"{what} (waited {seconds} s)") from error


def open_chapter(browser, url: str, notebook: Path, view: str, expected_dropdowns: int) -> dict:
    """Open the notebook in `view`; wait until every cell and every dropdown has rendered."""
    browser.get(url + VIEWS[view].format(name=notebook.name))
    cells = len(json.loads(notebook.read_text(encoding="utf-8"))["cells"])
    _wait_for(browser, lambda d: (d.execute_script(PAGE_STATE) or {}).get("cells", 0) >= cells,
              f"{view}: the notebook's {cells} cells did not appear")

    def settled(driver):
        state = driver.execute_script(PAGE_STATE)
        return state if state and len(state["dropdowns"]) >= expected_dropdowns else False

    return _wait_for(browser, settled, f"{view}: the notebook did not show its {expected_dropdowns} dropdowns "
                                       "as dropdowns (is jupyterlab-myst from requirements.txt installed?)", seconds=30)


def click_title(browser, title: str) -> dict:
    """Click the dropdown whose title is `title`, as a reader would; the page state after it."""
    from selenium.webdriver.common.by import By

    def clicked(driver):
        for summary in driver.find_elements(By.CSS_SELECTOR, ".jp-MarkdownCell details > summary"):
            try:
                if summary.text.strip() == title:
                    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", summary)
                    summary.click()
                    return True
            except Exception:  # re-rendered under us: look again
                return False
        return False

    def shown(driver):
        state = driver.execute_script(PAGE_STATE)
        return state if any(d["title"] == title and d["bodyShown"] for d in state["dropdowns"]) else False

    _wait_for(browser, clicked, f"no dropdown titled {title!r} to click", seconds=20)
    return _wait_for(browser, shown, f"clicking {title!r} did not show the hint's text", seconds=20)


@pytest.mark.parametrize("view", list(VIEWS))
def test_a_chapter_reads_in_jupyter_as_in_the_book(jupyterlab, view):
    url, notebook = jupyterlab
    text = notebook.with_suffix(".md").read_text(encoding="utf-8")
    titles = [title.strip() for title in DROPDOWN.findall(text)]
    hints = [title for title in titles if title.startswith("Hint")]
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    figures = sum("image/png" in output.get("data", {}) for cell in cells for output in cell.get("outputs", []))
    hidden = ["".join(cell["source"]).strip().splitlines()[-1] for cell in cells
              if "remove-input" in cell.get("metadata", {}).get("tags", [])]
    tables = sum("<table>" in "".join(output.get("data", {}).get("text/html", "")) for cell in cells
                 for output in cell.get("outputs", []))
    assert hints and figures and hidden and tables and "$$" in text, \
        (f"Chapter {CHAPTER} no longer has hints, figures, hidden code, a printed table and display math: point "
         "CHAPTER at one that does")
    browser = _browser()
    try:
        state = open_chapter(browser, url, notebook, view, len(titles))
        assert sorted(d["title"] for d in state["dropdowns"]) == sorted(titles), \
            f"{view}: the dropdowns shown are not the chapter's: {[d['title'] for d in state['dropdowns']]}"
        opened = [d["title"] for d in state["dropdowns"] if d["open"] or d["bodyShown"]]
        assert not opened, f"{view}: hints and answers must be collapsed until clicked, but these are open: {opened}"
        assert state["rawDirectives"] == 0, f"{view}: a Markdown cell shows the raw ':class: dropdown' directive"
        assert state["math"] > 0, f"{view}: the chapter's math is shown as LaTeX source, not typeset"
        cramped = [table for table in state["tables"] if table["padding"] < 4 or table["headerRule"] < 1]
        assert len(state["tables"]) == tables and not cramped, \
            f"{view}: printed tables without cell padding or a rule under the header: {cramped} of {state['tables']}"
        assert state["svgAsText"] == 0, \
            f"{view}: {state['svgAsText']} figure(s) shown as the text '<IPython.core.display.SVG object>'"
        state = _wait_for(browser, lambda d: (s := d.execute_script(PAGE_STATE))["drawnImages"] >= figures and s,
                          f"{view}: the chapter's {figures} figures are not all drawn on opening")
        shown = [line for line in hidden if any(line in code for code in state["shownCode"])]
        assert not shown and state["hiddenInputs"] == len(hidden), \
            f"{view}: the code of cells the book hides (remove-input) is shown: {shown}"
        assert state["modified"] is False and state["dirtyTabs"] == 0, \
            f"{view}: opening the chapter marked it modified (document dirty: {state['modified']})"
        after = click_title(browser, hints[0])
        others_open = [d["title"] for d in after["dropdowns"] if d["title"] != hints[0] and d["bodyShown"]]
        assert not others_open, f"{view}: clicking {hints[0]!r} opened other dropdowns too: {others_open}"
        assert after["modified"] is False, f"{view}: opening a hint marked the notebook modified"
    finally:
        browser.quit()
