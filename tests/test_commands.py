"""Every command README and the scripts' docstrings show parses as written: the flags exist, the values pass the
checks, and derived defaults fill the rest (`--gen-prompts 8` alone is a valid quick run). Parsing only: nothing is
loaded or sampled. Files a command names (a user's data) are created empty in a scratch folder first."""

import json
import os
import re

import pytest
from conftest import ROOT

import evaluate
import train
from cegppo_utils import data, flags

SCRIPTS = {"train": "train.py", "evaluate": "evaluate.py", "mechanism": "tools/mechanism.py"}


def documented_commands():
    texts = [open(os.path.join(ROOT, "README.md")).read()]
    texts += [open(os.path.join(ROOT, path)).read().split('"""')[1] for path in SCRIPTS.values()]
    found = []
    for text in texts:
        text = text.replace("\\\\\n", " ").replace("\\\n", " ")
        for line in text.splitlines():
            line = line.split("  #")[0].strip()
            for match in re.finditer(r"(?<![\w/])(train\.py|evaluate\.py|-m tools\.mechanism)([^`|(#;]*)", line):
                args = match.group(2).split()
                if "$" not in line and "--help" not in args and args and args[0].startswith("--"):
                    found.append((match.group(1).removesuffix(".py").removeprefix("-m tools."), tuple(args)))
    return sorted(set(found))


COMMANDS = documented_commands()


def test_the_documented_commands_were_found():
    scripts = {script for script, _ in COMMANDS}
    assert scripts == set(SCRIPTS) and len(COMMANDS) >= 15, COMMANDS


@pytest.mark.parametrize("script, argv", COMMANDS, ids=[f"{s} {' '.join(a)}"[:80] for s, a in COMMANDS])
def test_documented_command_parses(script, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for flag, value in zip(argv, argv[1:]):
        for path in value.split(",") if flag in ("--train-data", "--eval-data", "--benchmarks") else []:
            if path.endswith(data.FILE_TYPES):
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                open(path, "w").close()
    if script == "train":
        if "--resume" in argv:  # the run it names: a folder a run recorded itself in (its marker, its config.json)
            folder = argv[argv.index("--resume") + 1]
            os.makedirs(folder)
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump({"preset": "tiny", "flags": {"max_steps": 100}}, f)
            open(os.path.join(folder, ".ce-gppo-run"), "w").close()
        flags.parse_args(list(argv), train.__doc__)
    elif script == "evaluate":
        evaluate.parse_args(list(argv))
    else:
        own = {"--preset", "--start", "--batches", "--midrun-steps", "--probe-prompts", "--fresh-prompts", "--configs",
               "--root", "--output"}
        rest, i = [], 0
        while i < len(argv):
            if argv[i] in own:
                i += 2
                continue
            rest.append(argv[i])
            i += 1
        preset = argv[argv.index("--preset") + 1] if "--preset" in argv else "tiny"
        flags.parse_args(["--preset", preset, *rest], prog="mechanism.py")


def test_documented_training_commands_never_share_a_default_folder(tmp_path, monkeypatch):
    """Two documented train.py commands that run different settings never land in one default folder (`--preset
    r1-distill-1.5b --algo grpo` was refused as runs/r1-distill-1.5b, the CE-GPPO run's): what a run computes with
    names its folder (flags.default_output_dir)."""
    from cegppo_utils import runfolder
    monkeypatch.chdir(tmp_path)
    folders = {}
    for script, argv in COMMANDS:
        if script == "train" and "--resume" not in argv and "--output-dir" not in argv:
            args = flags.parse_args(list(argv), train.__doc__)
            computes = {k: v for k, v in flags.flat_flags(args).items()
                        if k not in runfolder.RESUMABLE | {"run_name"}}
            folders.setdefault(args.output_dir, []).append((argv, computes))
    assert len(folders) >= 5, folders
    for folder, runs in folders.items():
        assert all(computes == runs[0][1] for _, computes in runs), (folder, [argv for argv, _ in runs])
