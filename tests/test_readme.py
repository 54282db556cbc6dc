"""The README's tutorial runs as written, and its checks are real; the docs name files that exist.

The tutorial (the first ```python block under "## Tutorial") is run in a fresh interpreter, as a
user pasting it into a file would run it: it must exit 0, print its final line (reached only after
its own asserts that losses, weights and optimizer states equal eager PyTorch's), and write the
MemGraph file it saves. The same code with one of its features broken must fail its own check, so
the check really compares something.
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


def test_files_the_readme_names_exist():
    text = README.read_text()
    assert "(docs/design.md)" in text and DESIGN.is_file()
    named = set(re.findall(r"bench/results/[\w./*-]+\.(?:json|png)", text))
    assert named, "the README names no result files"
    missing = sorted(p for p in named if not list(ROOT.glob(p)))
    assert not missing, f"README.md names result files that do not exist: {missing}"
    for path in re.findall(r"`((?:ir|memgraph|planners|engine|kernels|turnip|bench|tests)/[\w/]+\.(?:py|sh|md))`",
                           text):
        assert (ROOT / path).is_file(), f"README.md names {path}, which does not exist"


def package_modules() -> dict[str, list[str]]:
    """Every module file of the packages, by the repository folder that holds it."""
    found = {}
    for package in ("turnip.ir", "turnip.memgraph", "turnip.planners", "turnip.engine", "turnip.kernels", "turnip"):
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
