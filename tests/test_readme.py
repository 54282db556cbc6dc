"""The README's tutorial runs as written, and its checks are real; the docs name files that exist.

The tutorial (the first ```python block under "## Tutorial") is run in a fresh interpreter, as a
user pasting it into a file would run it: it must exit 0, print its final line (reached only after
its own asserts that losses, weights and optimizer states equal eager PyTorch's), and write the
MemGraph file it saves. The same code with one of its features broken must fail its own check, so
the check really compares something.

The README stays short (under 300 lines: the reference is docs/guide.md, the measurements are the
dated files of bench/results/, each linked from bench/results/README.md), and every file or link
the README, the guide and the results files name exists.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from turnip.ir import serialize

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DESIGN = ROOT / "docs" / "design.md"
GUIDE = ROOT / "docs" / "guide.md"
RESULTS = ROOT / "bench" / "results"
RESULTS_INDEX = RESULTS / "README.md"
README_MAX_LINES = 300
MODULE_PATH = r"`((?:ir|trace|memgraph|planners|engine|kernels|turnip|bench|tests)/[\w/]+\.(?:py|sh|md))`"
TUTORIAL_HEADING = "## Tutorial"
FINAL_LINE = "losses, weights and optimizer states bitwise equal to eager PyTorch"
SCHEDULER_WARNING = re.escape("Detected call of `lr_scheduler.step()` before `optimizer.step()`")


def tutorial_code(text: str | None = None) -> str:
    """The first ```python block after the tutorial heading."""
    text = README.read_text() if text is None else text
    start = text.find(f"\n{TUTORIAL_HEADING}")
    assert start >= 0, f"README.md has no '{TUTORIAL_HEADING}' heading"
    match = re.search(r"^```python\n(.*?)^```$", text[start:], flags=re.DOTALL | re.MULTILINE)
    assert match, f"no ```python block under '{TUTORIAL_HEADING}' in README.md"
    return match.group(1)


def test_the_tutorial_runs_as_written_and_matches_eager(tmp_path):
    script = tmp_path / "tutorial.py"
    script.write_text(tutorial_code())
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          check=False, timeout=300)
    assert done.returncode == 0, f"the README's tutorial failed:\n{done.stdout}\n{done.stderr}"
    lines = done.stdout.splitlines()
    assert lines and lines[-1] == FINAL_LINE, done.stdout
    steps = re.search(r"^(\d+) steps of (\d+) batches: loss ([0-9.]+) -> ([0-9.]+)$", done.stdout,
                      flags=re.MULTILINE)
    assert steps, done.stdout
    k = int(steps.group(2))
    assert k > 1, "the tutorial no longer accumulates gradients over micro-batches"
    assert int(steps.group(1)) == 2 * (1024 // 64) // k  # two epochs of full batches (drop_last), k per step
    assert float(steps.group(4)) < float(steps.group(3)), "the tutorial's loss did not fall"
    assert (tmp_path / "step.mg").is_file()
    # nothing on stderr: no library warning, no planner complaint, and no "lr_scheduler.step() before
    # optimizer.step()" from torch (engine.run marks the optimizer as its step() would)
    assert not done.stderr.strip(), f"the tutorial printed on stderr:\n{done.stderr}"


BROKEN = {  # what to break -> (the text in the tutorial, what it becomes)
    "no clipping in the compiled step": ("max_grad_norm=0.25, accumulation_steps=K", "accumulation_steps=K"),
    "no scheduler step": ("        sched.step()\n", "        pass\n"),
    "the last micro-batch's loss counted twice": ('out["loss"].item()', '(out["loss"] + out["losses"][-1]).item()'),
}


@pytest.mark.filterwarnings(f"error:{SCHEDULER_WARNING}:UserWarning")
@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_the_tutorials_check_fails_when_the_compiled_step_differs(broken, tmp_path, monkeypatch):
    """Each feature the tutorial shows changes the numbers, and its own assert sees the change."""
    old, new = BROKEN[broken]
    code = tutorial_code()
    assert code.count(old) == 1, f"the tutorial no longer holds {old!r}: update BROKEN"
    monkeypatch.chdir(tmp_path)
    broken_code = compile(code.replace(old, new), "tutorial.py", "exec")
    with pytest.raises(AssertionError) as failed:
        exec(broken_code, {"__name__": "__main__"})  # noqa: S102 - the README's own code
    assert failed.traceback[-1].frame.code.raw.co_filename == "tutorial.py", "failed inside turnip, not the check"


def test_the_cpu_torch_note_comes_before_the_first_command():
    text = README.read_text()
    first_command = text.index("pip install -e")
    note = text.find("pip install torch==")
    assert 0 <= note < first_command, "the CPU-only torch install must come before the first pip install -e"
    assert "python -m turnip.demo" in text or "python -m turnip demo" in text
    assert 'pip install -e ".[dev]" && python -m pytest' in text


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"^```.*?^```$", "", text, flags=re.DOTALL | re.MULTILINE)  # a "# comment" in code is no heading
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, flags=re.MULTILINE)}


def broken_links(doc: Path) -> list[str]:
    """The relative links of a markdown file (``[text](path)``, images too) whose file, or whose #anchor in a
    markdown file, does not exist; web links are not followed."""
    broken = []
    for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in heading_anchors(file.read_text())):
            broken.append(target)
    return broken


@pytest.mark.parametrize("doc", [README, GUIDE], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_files_the_docs_name_exist(doc):
    text = doc.read_text()
    named = set(re.findall(r"bench/results/[\w./*-]+\.(?:json|png)", text))
    assert named, f"{doc.name} names no result files"
    missing = sorted(p for p in named if not list(ROOT.glob(p)))
    assert not missing, f"{doc.name} names result files that do not exist: {missing}"
    for path in re.findall(MODULE_PATH, text):
        assert (ROOT / path).is_file(), f"{doc.name} names {path}, which does not exist"
    assert not broken_links(doc), f"{doc.relative_to(ROOT)} links to what does not exist: {broken_links(doc)}"


def test_the_readme_links_the_guide_the_design_and_the_results():
    text = README.read_text()
    for target in ("docs/guide.md", "docs/design.md", "bench/README.md", "bench/results/README.md"):
        assert f"]({target})" in text, f"README.md does not link {target}"
        assert (ROOT / target).is_file()
    for result in sorted(RESULTS.glob("2*.md")):
        assert f"](bench/results/{result.name})" in text, f"README.md does not link bench/results/{result.name}"


def test_the_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines: move reference to docs/guide.md, results to " \
                                     f"bench/results/<date>_<device>_<topic>.md"


def test_every_results_file_is_in_the_index_and_its_links_resolve():
    """Each dated results file is named <yyyy-mm-dd>_<device>_<topic>.md, linked from bench/results/README.md,
    and its own links (to the JSON and PNG beside it, the test logs, the other results files) resolve."""
    index = RESULTS_INDEX.read_text()
    files = sorted(f for f in RESULTS.glob("*.md") if f != RESULTS_INDEX)
    assert files, "no results files under bench/results/"
    for file in files:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_[a-z0-9]+_[\w.-]+\.md", file.name), \
            f"bench/results/{file.name} is not named <yyyy-mm-dd>_<device>_<topic>.md"
        assert f"]({file.name})" in index, f"bench/results/README.md does not link {file.name}"
    listed = re.findall(r"^- \[[^\]]*\]\((\d{4}-\d{2}-\d{2})_", index, flags=re.MULTILINE)
    assert listed == sorted(listed, reverse=True), "bench/results/README.md lists its files newest first"
    for doc in [RESULTS_INDEX, *files]:
        assert not broken_links(doc), f"{doc.relative_to(ROOT)} links to what does not exist: {broken_links(doc)}"


def test_no_test_reads_a_test_log():
    """The CUDA test logs sit in bench/results/test_logs/, which no test reads: a test that needs a fact
    states it, not a log of a run."""
    logs = RESULTS / "test_logs"
    assert sorted(logs.glob("cuda_tests_*.txt")), "no CUDA test logs in bench/results/test_logs/"
    elsewhere = [p.relative_to(ROOT).as_posix() for p in RESULTS.rglob("cuda_tests_*") if p.parent != logs]
    assert not elsewhere, f"CUDA test logs outside bench/results/test_logs/: {elsewhere}"
    for test in sorted((ROOT / "tests").glob("*.py")):
        if test.name == Path(__file__).name:  # this test names the folder to check it
            continue
        code = re.sub(r'"""(?:.|\n)*?"""', "", test.read_text())  # docstrings may say where a log is
        assert "test_logs" not in code and "cuda_tests_" not in code, f"{test.name} reads a test log"


def package_modules() -> dict[str, list[str]]:
    """Every module file of the packages, by the repository folder that holds it."""
    found = {}
    for package in ("turnip.ir", "turnip.trace", "turnip.memgraph", "turnip.planners", "turnip.engine",
                    "turnip.kernels", "turnip"):
        folder = Path(importlib.util.find_spec(package).submodule_search_locations[0])
        found[folder.name] = [f.name for f in sorted(folder.glob("*.py")) if f.name != "__init__.py"]
    return found


def design_layout() -> dict[str, str]:
    """The layout block of docs/design.md (the first ``` block under "## Layout"), cut into one text
    per folder: a line starting with "name/" opens the folder's part."""
    text = DESIGN.read_text()
    start = text.find("\n## Layout")
    assert start >= 0, "docs/design.md has no '## Layout' section"
    block = re.search(r"^```\n(.*?)^```$", text[start:], flags=re.DOTALL | re.MULTILINE)
    assert block, "no ``` block under '## Layout' in docs/design.md"
    parts: dict[str, str] = {}
    folder = None
    for line in block.group(1).splitlines():
        opened = re.match(r"^(\w+)/\s", line)
        if opened:
            folder = opened.group(1)
        if folder is not None:
            parts[folder] = parts.get(folder, "") + line + "\n"
    return parts


def test_the_design_doc_names_every_module_in_its_folder():
    """docs/design.md stays true to the code: a module added without a line in its folder's part of
    the layout fails here, and so does a file named there that does not exist."""
    layout = design_layout()
    modules = package_modules()
    assert "segments.py" in modules["memgraph"] and "cli.py" in modules["turnip"]  # the walk sees the folders
    missing = [f"{folder}/{name}" for folder, names in modules.items() for name in names
               if not re.search(rf"(?<![\w.]){re.escape(name)}\b", layout.get(folder, ""))]
    assert not missing, f"docs/design.md's layout does not list {missing}"
    for folder, part in layout.items():
        for name in re.findall(r"^\s+(\w+\.py)\b", part, flags=re.MULTILINE):
            assert (ROOT / folder / name).is_file(), f"docs/design.md lists {folder}/{name}, which does not exist"
    text = DESIGN.read_text()
    for path in re.findall(r"`((?:ir|memgraph|planners|engine|kernels|turnip|bench|tests)/[\w/]+\.py)`", text):
        assert (ROOT / path).is_file(), f"docs/design.md names {path}, which does not exist"


def test_the_documented_file_version_is_the_one_written():
    """The .mg format version the docs state (ir/serialize.py's docstrings, docs/design.md) is VERSION."""
    texts = {"ir/serialize.py": serialize.__doc__ + "\n".join(
                 f.__doc__ for f in (serialize.save, serialize.load, serialize.Codec)),
             "docs/design.md": DESIGN.read_text()}
    for where, text in texts.items():
        stated = {int(v) for v in re.findall(r'"version": (\d+)', text)}
        stated |= {int(v) for v in re.findall(r"`VERSION` \((\d+)\)", text)}
        assert stated == {serialize.VERSION}, f"{where} states format version {sorted(stated)}, " \
                                              f"files are written as version {serialize.VERSION}"
