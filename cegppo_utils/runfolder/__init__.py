"""A run's output folder: what train.py keeps, and the rules that keep it whole.

    OUTPUT_DIR/config.json              the resolved flags, preset, library versions, git commit (written at start)
    OUTPUT_DIR/metrics.jsonl            one JSON object per step, appended (rank 0); the row of step 0 (the
                                        evaluation before training) holds only step, eval_acc, eval_seed and
                                        time_eval_s: a training field (reward_mean, ...) is in every row but that one
    OUTPUT_DIR/samples.jsonl            a few prompts with their completions, rewards and advantages, appended
    OUTPUT_DIR/checkpoints/step_N/      model + optimizer (torch.distributed.checkpoint), trainer_state.pt, tokenizer
    OUTPUT_DIR/final/                   the policy in HF format, and FINAL_RECORD: the step whose policy it is
    OUTPUT_DIR/curves.png               the main metrics, drawn at the end (plot.py)
    OUTPUT_DIR/.ce-gppo-run             the marker: this folder was created by a run (RUN_MARKER)

Rules:
  - One rule says a folder holds a run (holds_run), for --resume, the finished-run answer, evaluate.py --seed-of and
    the tools: its marker, final/'s step record, or a checkpoint whose manifest verifies. Nothing else: a
    checkpoints/ and a metrics.jsonl of unknown origin are not a run, and are never resumed into.
  - A run folder is created, never adopted: a new run writes only into a missing or empty folder, or its own run
    folder (its marker and a run's config.json, one with `flags`, agree: a marker alone proves nothing); never into
    the root, a model folder, a checkpoint folder, or a folder inside a run. It refuses a folder that holds a run:
    pass --resume, or another folder. A damaged config.json is refused, not rewritten (it holds the run's launch
    record). The output path is checked whole before torch loads (paths.py: a name too long, a file in the way, a
    folder that cannot be made); a run refused before it wrote anything leaves no folder or file it created, the
    probe of its folder included (removed with SIGINT and SIGTERM held).
  - A run's files are read by one rule (reading.py): only regular files are opened (a FIFO never blocks), a row is a
    UTF-8 JSON object with an integer step, and anything else is one line naming the file and line.
  - Nothing is written through a link, in a run folder, a cache or a tool's output: a file written in place (a
    lock, the marker, a log) is opened by open_for_writing alone (O_NOFOLLOW, a regular file of its own), any other
    is written to a fresh temporary name (O_EXCL) in the same folder and renamed over the old one
    (write_file_atomically); a run folder holds no symbolic links (refused at start), and a folder written whole (an
    export) is checked where the kernel resolves it, not as typed.
  - A checkpoint records its shards' sizes and SHA-256, and its run's flags (shards.json) when it is written; a
    resume, an export or an evaluation verifies them (and that each shard holds every byte its .metadata places in
    it) before loading.
  - --resume continues from the newest checkpoint, with the run's own settings read from its config.json
    (flags.parse_args; a flag typed beside it may restate the run's value, and differ only where RESUMABLE allows),
    after checking that the checkpoint was written by a run with the same flags (its manifest's, before torch loads:
    a config.json edited by hand is named); with no checkpoint it starts again from step 0. A folder that holds no
    run (check_resumable), a damaged row or record, a finished run (finished_step: final/ holds step max_steps or
    later, and no checkpoint is newer) and a folder a live run holds (check_not_in_use) are answered before anything
    loads, and every stop names the command that goes on (resume_command, or the command as typed before the run
    began).
  - Rows logged after the checkpoint being resumed (a crash came between), and a torn last line (a crash or a
    full disk in the middle of an append), move to metrics.discarded.jsonl: metrics.jsonl never holds a step twice.
  - Folders (checkpoints, final/) are written to a temporary folder and renamed into place: a crash leaves the old
    folder or the new one, never half of one. A failed write (a full disk) removes its partial folder and keeps the
    last good checkpoint.

The folder's rooms, one concern each (the names below are all importable from here):
  process.py       this process: its messages in one line, the command that started it and the one that goes on
  files.py         files and folders written whole, never through a link (the run's, and the research tools')
  reading.py       a run's JSON and JSON-lines files, read by one rule
  paths.py         one check of an output path, for train.py, evaluate.py and the tools; the probe of a folder
  metrics.py       metrics.jsonl and the other logs: appended, and cut back on resume
  start.py         which folder a run may write into, which holds a run, the answers before anything loads
  lock.py          one run per folder
  model_folder.py  an HF model folder, whole before it loads
  checkpoints.py   checkpoints, their manifest and DCP metadata; final/ and its step
  export.py        a checkpoint's policy exported (`python -m cegppo_utils.runfolder export CHECKPOINT OUT`)
"""

from cegppo_utils.data import UserError
from cegppo_utils.runfolder.checkpoints import (
    CHECKPOINT_NAME,
    FINAL_RECORD,
    MANIFEST,
    check_checkpoint,
    check_dcp_metadata,
    check_finished,
    checkpoint_dirs,
    checkpoint_flags,
    final_step,
    is_checkpoint,
    load_checkpoint,
    manifest_holds,
    read_trainer_state,
    save_checkpoint,
    save_final,
    step_of,
    verify_checkpoint,
    write_manifest,
)
from cegppo_utils.runfolder.export import (
    EXPORT_CACHE_KEEP,
    EXPORT_RECORD,
    check_export_target,
    export_cache,
    export_hf,
    exported,
    main,
    show_export_cache,
)
from cegppo_utils.runfolder.files import (
    append_line,
    open_for_writing,
    save_figure,
    writable,
    write_file_atomically,
    write_folder_atomically,
    write_json_atomically,
    write_text_atomically,
)
from cegppo_utils.runfolder.lock import OutputLock, check_not_in_use, lock_output_dir
from cegppo_utils.runfolder.metrics import append_jsonl, keep_rows_up_to, restore_row, write_jsonl
from cegppo_utils.runfolder.model_folder import check_model_folder
from cegppo_utils.runfolder.paths import (
    folder_problem,
    length_problem,
    output_problem,
    outputs_problem,
    probe,
    replace_problem,
    signals_held,
)
from cegppo_utils.runfolder.process import LIMIT, crash_point, escape, one_line, resume_command, short, start_command
from cegppo_utils.runfolder.reading import (
    MAX_BYTES,
    jsonl_lines,
    read_bytes,
    read_json_object,
    read_jsonl,
    read_run_record,
    row_problem,
)
from cegppo_utils.runfolder.start import (
    NO_RUN,
    RESUMABLE,
    RUN_MARKER,
    RUN_RECORD_KEYS,
    begin,
    check,
    check_loggers,
    check_output_folder,
    check_resumable,
    config_against_checkpoint,
    finished_step,
    holds_run,
    interrupted,
    kept_note,
    lost_row,
    on_rank_0,
    open_loggers,
    run_config_file,
    run_info,
)

__all__ = [
    'UserError', 'crash_point', 'one_line', 'resume_command', 'start_command', 'LIMIT', 'escape', 'short',
    'write_json_atomically', 'write_text_atomically', 'write_folder_atomically', 'writable',
    'write_file_atomically', 'save_figure', 'append_line', 'open_for_writing',
    'MAX_BYTES', 'read_bytes', 'row_problem', 'jsonl_lines',
    'read_jsonl', 'read_json_object', 'read_run_record', 'append_jsonl', 'write_jsonl', 'keep_rows_up_to',
    'restore_row', 'OutputLock', 'lock_output_dir', 'check_not_in_use', 'RESUMABLE', 'RUN_MARKER', 'check',
    'on_rank_0', 'check_resumable', 'NO_RUN', 'holds_run', 'check_output_folder', 'finished_step',
    'run_config_file', 'begin', 'config_against_checkpoint', 'RUN_RECORD_KEYS', 'run_info', 'lost_row',
    'interrupted', 'kept_note', 'check_loggers', 'open_loggers', 'check_model_folder', 'CHECKPOINT_NAME',
    'FINAL_RECORD', 'final_step', 'checkpoint_dirs', 'step_of', 'save_checkpoint', 'load_checkpoint',
    'is_checkpoint', 'read_trainer_state', 'check_dcp_metadata', 'check_checkpoint', 'MANIFEST', 'write_manifest',
    'checkpoint_flags', 'manifest_holds', 'verify_checkpoint', 'check_finished', 'save_final', 'export_hf',
    'EXPORT_CACHE_KEEP', 'EXPORT_RECORD', 'exported', 'export_cache', 'check_export_target', 'main',
    'show_export_cache', 'signals_held', 'probe', 'length_problem', 'folder_problem', 'output_problem',
    'outputs_problem', 'replace_problem',
]
