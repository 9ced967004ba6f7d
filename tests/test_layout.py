"""The code's layers: the helpers (cegppo_utils/) sit below the scripts (rollout.py, train.py, evaluate.py) and the
research tools (tools/), and import nothing from them, at the top of a module or inside a function; loss.py and
reward.py are the floor every layer may import."""

import ast
import glob
import os

from conftest import ROOT

ABOVE = {"rollout", "train", "evaluate", "tools"}


def imported_modules(path):
    """The top-level names of every module `path` imports, wherever the import statement stands."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_helpers_import_nothing_from_the_scripts_or_the_tools_above_them():
    helpers = sorted(glob.glob(os.path.join(ROOT, "cegppo_utils", "**", "*.py"), recursive=True))
    assert len(helpers) > 10  # the folder was found
    found = {os.path.relpath(p, ROOT): sorted(imported_modules(p) & ABOVE) for p in helpers}
    assert {name: above for name, above in found.items() if above} == {}
    assert {"loss", "reward"} <= set().union(*(imported_modules(p) for p in helpers))  # the floor is seen: a live check


def test_ci_runs_the_readme_test_command():
    """CI must call the quick start's test command itself, whatever README says it is today."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    command = [line.split("#", 1)[0].strip() for line in block.strip().splitlines()][1]
    assert command.startswith("bash setup.sh && ") and "pytest" in command, command
    assert command in open(os.path.join(ROOT, ".ci", "run")).read()


def test_readme_fits_one_read():
    """README stays a page one reads through: at most 250 lines, its prose within 120 columns (tables and code blocks
    may run longer); detail belongs in docs/."""
    lines = open(os.path.join(ROOT, "README.md")).read().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/"
    fenced, long = False, []
    for number, line in enumerate(lines, 1):
        fenced ^= line.startswith("```")
        if not fenced and not line.startswith(("|", "```")) and len(line) > 120:
            long.append(number)
    assert long == [], f"README.md lines over 120 columns: {long}"
