"""Every tool's bad input (issue 59): one line on stderr and exit code 2, before any work (here: before torch loads,
each in a fresh process), the value shown escaped and cut; and the writers every tool uses, which never write
through a link planted at a file's name. tools.bench and tools.gpu_check load torch first: their cases are in
test_bench.py and test_gpu_check.py, in this process."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from cegppo_utils import cli, runfolder
from cegppo_utils.data import UserError


def one_line(argv, tmp_path, code=2):
    """Run `python -m <argv>` from the repository; its stderr as one line, having checked the exit code, that
    nothing else was printed there and that nothing was printed on stdout."""
    done = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == code and done.stdout == "" and done.stderr.count("\n") == 1, (argv, done)
    return done.stderr.rstrip("\n")


@pytest.fixture
def files(tmp_path):
    """What the cases name: a file, a folder, a FIFO, text that is not JSON, truncated JSON, a JSON list, a good study
    (block A) beside a truncated block B."""
    run = {"steps_done": 200, "steps": [{"step": 0, "eval_acc": 0.5}, {"step": 1, "reward_mean": 0.0}]}
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "garbage.json").write_text("not json")
    (tmp_path / "torn.json").write_text('{"grpo": {"0": {"steps_done": 2, "st')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "good.json").write_text(json.dumps({"grpo": {"0": run}}))
    (tmp_path / "blocks").mkdir()
    (tmp_path / "blocks" / "study.json").write_text(json.dumps({"grpo": {"0": run}}))
    (tmp_path / "blocks" / "study-b.json").write_text('{"grpo": {"1": {"steps_do')
    runfolder.write_text_atomically(str(tmp_path / "good.json.gz"), json.dumps({"grpo": {"0": run}}))
    (tmp_path / "torn.json.gz").write_bytes((tmp_path / "good.json.gz").read_bytes()[:-9])  # a partial copy
    (tmp_path / "plain.json.gz").write_text(json.dumps({"grpo": {"0": run}}))  # named .gz, never packed
    return tmp_path


def test_study_active_refuses_each_bad_json_in_one_line(files):
    t = str(files)
    figures = ["--figures", f"{t}/figures"]
    cases = [
        (f"{t}/missing.json", f"--json {t}/missing.json: no such file"),
        (f"{t}/a_folder", f"--json {t}/a_folder is a folder; name a file"),
        (f"{t}/fifo", f"--json {t}/fifo is a FIFO, not a regular file"),
        (f"{t}/garbage.json", f"--json {t}/garbage.json: not a study's JSON (JSONDecodeError: Expecting value: line 1 "
                              "column 1 (char 0))"),
        (f"{t}/torn.json", f"--json {t}/torn.json: not a study's JSON (JSONDecodeError: Unterminated string starting "
                           "at: line 1 column 34 (char 33))"),
        (f"{t}/list.json", f"--json {t}/list.json: not a study's JSON (it holds a list)"),
        (f"{t}/torn.json.gz", f"--json {t}/torn.json.gz: not a study's JSON (ValueError: its gzip stream ends early "
                              "(a torn or partly copied file))"),
        (f"{t}/plain.json.gz", f"--json {t}/plain.json.gz: not a study's JSON (ValueError: not gzip: Error -3 while "
                               "decompressing data: incorrect header check)"),
        (f"{t}/blocks/study.json", f"--json's block B {t}/blocks/study-b.json: not a study's JSON (JSONDecodeError: "
                                   "Unterminated string starting at: line 1 column 17 (char 16))"),
        ("", "argument --json: an empty value (an unset shell variable?): give one, or leave the flag out"),
        (f"{t}/no\nsuch.json", f"--json {t}/no\\nsuch.json: no such file"),  # the newline escaped: one line
    ]
    for path, message in cases:
        assert one_line(["tools.study_active", "--json", path, *figures], files) == f"study_active.py: error: {message}"
    assert one_line(["tools.study_active", "--json", f"{t}/good.json", "--figures", f"{t}/a_file/sub"], files) == (
        f"study_active.py: error: --figures {t}/a_file/sub cannot be created ({t}/a_file is a file)")
    assert not (files / "figures").exists()  # refused before anything was written


def test_a_huge_value_and_many_unknown_flags_are_cut_to_a_readable_line(tmp_path):
    line = one_line(["tools.study_active", "--json", "x" * 100_000], tmp_path)
    assert line == (f"study_active.py: error: --json {'x' * cli.LIMIT}... (100000 characters): cannot read it (File "
                    "name too long)")
    line = one_line(["tools.configs"] + [f"--flag{i}" for i in range(10_000)], tmp_path)
    assert line == "configs.py: error: unrecognized arguments: --flag0 --flag1 --flag2 and 9997 more"


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    ([""], "argument names: an empty value (an unset shell variable?): give one, or leave the flag out"),
    (["grpo", "nope"], "unknown configuration(s) ['nope']; choose from ['grpo', "),
])
def test_configs_refuses_what_it_does_not_know(argv, message, tmp_path):
    assert one_line(["tools.configs", *argv], tmp_path).startswith(f"configs.py: error: {message}")


def test_configs_shows_the_flags_of_the_named_configurations():
    done = subprocess.run([sys.executable, "-m", "tools.configs", "grpo", "ce_gppo_0.5_1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == (
        "grpo: --algo grpo\nce_gppo_0.5_1: --algo ce_gppo --beta1 0.5 --beta2 1\n")


def test_study_refuses_an_empty_value_a_fifo_and_a_record_it_cannot_read(files):
    t = str(files)
    base = ["tools.study", "--preset", "tiny", "--plot-only", "--root", f"{t}/runs", "--figures", f"{t}/figures"]
    (files / "lacking.json").write_text(json.dumps({"grpo": {"0": {"steps_done": 2, "steps": []}}}))
    cases = [
        (["--json", ""], "argument --json: an empty value (an unset shell variable?): give one, or leave the flag out"),
        (["--json", f"{t}/good.json", "--figures", ""], "argument --figures: an empty value"),
        (["--json", f"{t}/good.json", "--preset", ""], "argument --preset: an empty value"),
        (["--json", f"{t}/fifo"], f"--json {t}/fifo is a FIFO, not a regular file"),
        (["--json", f"{t}/good.json", "--mechanism", f"{t}/fifo"], f"--mechanism {t}/fifo is a FIFO, not a regular"),
        (["--json", f"{t}/lacking.json"], f"--json {t}/lacking.json: not a study's JSON (grpo seed 0 lacks best_acc, "
                                          "entropy_first10, entropy_last10, final_acc, start_acc, of what run_record"),
        (["--json", f"{t}/a_file/study.json"], f"--json {t}/a_file/study.json: its folder {t}/a_file is a file, not "
                                               "a folder"),
    ]
    for argv, message in cases:
        assert one_line(base + argv, files).startswith(f"study.py: error: {message}"), argv
    assert sorted(os.listdir(files)) == ["a_file", "a_folder", "blocks", "fifo", "garbage.json", "good.json",
                                         "good.json.gz", "lacking.json", "list.json", "plain.json.gz", "torn.json",
                                         "torn.json.gz"]


def test_mechanism_refuses_before_torch_loads(files):
    t = str(files)
    cases = [
        (["--batches", "1"], "--batches 1: must be >= 2 (a confidence interval needs them)"),
        (["--probe-prompts", "0"], "--probe-prompts 0: must be >= 1"),
        (["--configs", ","], "--configs ',': no config given; choose from ['grpo', "),
        (["--configs", "grpo"], "--configs must include ppo_clip: every config is paired with it"),
        (["--output", f"{t}/a_folder"], f"--output {t}/a_folder is a folder; name a file in it"),
        (["--output", f"{t}/a_file/m.json"], f"--output {t}/a_file/m.json: its folder {t}/a_file is a file, not a "
                                             "folder"),
        (["--output", ""], "argument --output: an empty value"),
    ]
    for argv, message in cases:
        line = one_line(["tools.mechanism", "--output", f"{t}/new/m.json", *argv], files)
        assert line.startswith(f"mechanism.py: error: {message}"), (argv, line)
    assert not (files / "new").exists()


def test_plot_refuses_a_fifo_an_empty_value_and_a_window_below_1(files):
    t = str(files)
    run = files / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.0}) + "\n")
    (files / "fifo_run").mkdir()
    os.mkfifo(files / "fifo_run" / "metrics.jsonl")
    cases = [
        ([f"{t}/fifo_run"], f"run {t}/fifo_run/metrics.jsonl is a FIFO, not a regular file"),
        ([""], "argument runs: an empty value"),
        ([f"a={t}/run,"], f"'a={t}/run,': a run folder or a name is empty"),
        ([f"{t}/run", "--out", ""], "argument --out: an empty value"),
        ([f"{t}/run", "--out", f"{t}/a_file/plots"],
         f"--out {t}/a_file/plots cannot be created ({t}/a_file is a file)"),
        ([f"{t}/run", "--window", "0"], "--window 0: must be >= 1"),
    ]
    for argv, message in cases:
        assert one_line(["cegppo_utils.plot", *argv], files).startswith(f"plot.py: error: {message}"), argv
    assert sorted(os.listdir(run)) == ["metrics.jsonl"]


# --- the helpers every tool uses ----------------------------------------------------------------------------------

def test_messages_are_escaped_and_cut():
    assert cli.short("a\nb\x1b[31m\u2028") == "a\\nb\\x1b[31m\\u2028"
    assert cli.short("y" * 300, 10) == "yyyyyyyyyy... (300 characters)"
    line = cli.one_line("path /a\nb: " + "z" * 5000 + " and more")
    assert "\n" not in line and line.startswith("path /a\\nb: " + "z" * 80 + "... (5000 characters) and more")
    assert cli.one_line is runfolder.one_line  # the tools' messages follow train.py's and evaluate.py's rule


def test_the_writers_replace_a_link_at_a_files_name_and_keep_its_target(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    mine = tmp_path / "mine.txt"
    mine.write_text("a user's file\n")
    os.symlink(mine, tmp_path / "figure.png")
    fig = plt.figure()
    runfolder.save_figure(fig, str(tmp_path / "figure.png"), dpi=20)
    plt.close(fig)
    assert mine.read_text() == "a user's file\n" and not (tmp_path / "figure.png").is_symlink()
    assert (tmp_path / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["figure.png", "mine.txt"]  # no temporary file left
    os.symlink(mine, tmp_path / "hardware.jsonl")  # an append is refused at a link, as train.py refuses one
    with pytest.raises(UserError, match="hardware.jsonl is a symbolic link; refusing to follow it"):
        runfolder.append_line(str(tmp_path / "hardware.jsonl"), "{}")
    assert mine.read_text() == "a user's file\n"
    runfolder.append_line(str(tmp_path / "own.jsonl"), '{"a": 1}')
    assert (tmp_path / "own.jsonl").read_text() == '{"a": 1}\n'


def test_output_and_folder_checks_say_what_stands_in_the_way(tmp_path):
    (tmp_path / "a_file").write_text("x")
    os.symlink(tmp_path / "a_file", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    t = str(tmp_path)
    assert cli.output_problem(f"{t}/link", "--output") == f"--output {t}/link is a symbolic link; refusing to write " \
                                                          "through it (remove it)"
    assert cli.output_problem(f"{t}/fifo", "--output") == f"--output {t}/fifo is a FIFO, not a regular file"
    assert cli.output_problem(t, "--output") == f"--output {t} is a folder; name a file in it"
    assert cli.output_problem(f"{t}/new/deeper/x.json", "--output") is None and not (tmp_path / "new").exists()
    assert cli.output_problem(f"{t}/new/x.json", "--output", create=True) is None and (tmp_path / "new").is_dir()
    assert cli.folder_problem(f"{t}/a_file", "--figures") == f"--figures {t}/a_file is a file, not a folder"
    assert cli.input_problem(f"{t}/link", "--json") is None  # a link to a file is read as the file


def test_an_output_path_naming_a_folder_is_refused_made_or_not(tmp_path):
    """--output newdir/ passed the check, and the tool's work ended in FileNotFoundError when it wrote: a path ending
    in a separator (or in . or ..) names a folder, made or not."""
    t = str(tmp_path)
    for path in (f"{t}/newdir/", f"{t}/newdir/.", f"{t}/newdir/.."):
        assert cli.output_problem(path, "--output") == f"--output {path} names a folder; name a file", path
    assert cli.output_problem(f"{t}/newdir/", "--output", create=True) and not (tmp_path / "newdir").exists()
    assert cli.output_problem(f"{t}/newdir/x.json", "--output") is None


def test_a_name_given_twice_is_taken_once_in_the_order_first_given():
    """study.py --configs grpo,grpo --parallel 2 ran two trainers on one run folder."""
    parser = cli.Parser("tool.py")
    known = ["grpo", "dapo", "ppo_clip"]
    assert cli.choices(parser, "dapo,grpo,dapo, grpo,ppo_clip", known, "--configs") == ["dapo", "grpo", "ppo_clip"]


def test_a_folder_at_an_outputs_name_is_found_before_the_work(tmp_path):
    """A file is written whole by replacing its name, which a folder there stops only once the work is done; a link
    there is replaced, so it does not stand in the way."""
    (tmp_path / "table.md").mkdir()
    os.symlink(tmp_path / "table.md", tmp_path / "link.md")
    t = str(tmp_path)
    assert cli.outputs_problem(t, ["a.md", "table.md"], "--figures") == (f"--figures {t}: table.md in it is a folder; "
                                                                         "move it aside")
    assert cli.outputs_problem(t, ["a.md", "link.md"], "--figures") is None
