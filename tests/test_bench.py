"""bench.py: the step section's run order, aggregation, TRL-missing and failure paths and one real train.py run; the
update sections' arithmetic and bookkeeping."""

import contextlib
import importlib.util
import json
import math
import os
import sys

import pytest

from tools import bench


def fake_records(seconds):
    return [{"s": s, "sample_s": 0.5, "score_s": 0.1, "update_s": s - 0.7, "response_len": 20.0} for s in seconds]


def fake_spec(available):
    real = importlib.util.find_spec
    return lambda name, *a: (real("json") if name in available else None) if name in ("trl", "vllm") else real(name, *a)


def test_step_alternates_and_compares(monkeypatch):
    calls = []
    monkeypatch.setattr(importlib.util, "find_spec", fake_spec({"trl", "vllm"}))
    monkeypatch.setattr(bench, "ours_steps",
                        lambda engine, d, **k: calls.append(f"ours_{engine}") or fake_records([1.0, 1.2]))
    monkeypatch.setattr(bench, "trl_steps", lambda d, **k: calls.append("trl_hf") or fake_records([2.0, 3.0]))
    out = bench.bench_step(steps=3, repeats=2)
    assert calls == ["ours_hf", "trl_hf", "ours_vllm"] * 2  # alternating, so machine noise hits all alike
    assert out["ours_hf_s_median"] == pytest.approx(1.1) and out["ours_hf_s_max"] == 1.2
    assert out["trl_hf_s_median"] == pytest.approx(2.5) and out["trl_hf_s_min"] == 2.0
    assert out["speedup_same_engine"] == pytest.approx(2.5 / 1.1)
    assert out["speedup_best_engine"] == pytest.approx(2.5 / 1.1)
    assert out["ours_hf_other_s"] == pytest.approx(0.1)  # wall minus the three phases
    assert out["ours_hf_tokens_per_s"] == pytest.approx(256 * 20 / 1.1)
    assert len(out["raw_steps"]["trl_hf"]) == 4 and out["differences"]


def test_step_without_trl_reports_ours_and_survives_a_failure(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", fake_spec({"vllm"}))

    def ours(engine, d, **k):
        if engine == "vllm":
            raise RuntimeError("train.py ... exited with 1:\nboom")
        return fake_records([1.0])
    monkeypatch.setattr(bench, "ours_steps", ours)
    out = bench.bench_step(steps=2, repeats=2)
    assert "not installed" in out["trl"]
    assert out["ours_hf_s_median"] == 1.0
    assert "ours_vllm_error" in out and "ours_vllm_s_median" not in out
    assert not any(k.startswith(("trl_hf", "speedup")) for k in out)


def test_offpolicy_alternates_drops_the_warm_up_and_reports_steps_per_second(monkeypatch):
    calls = []

    def steps(workdir, name, extra, steps, model):  # step 1's interval is warm-up; then 2 s synchronous, 1.25 s stale
        calls.append((name, extra, steps))
        s = 2.0 if name == "synchronous" else 1.25
        return [{"s": 30.0, "wait_s": 9.0, "update_s": 1.0, "sampler_s": 9.0, "staleness": 1}] + \
            [{"s": s, "wait_s": 0.01, "update_s": 1.0, "sampler_s": 1.1, "staleness": 1} for _ in range(steps - 2)]
    monkeypatch.setattr(bench, "preset_steps", steps)
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {0, 1})
    out = bench.bench_offpolicy(steps=5, repeats=2)
    assert calls == [("synchronous", [], 5), ("off_policy", ["--off-policy-steps", "1"], 5)] * 2
    assert out["synchronous_s_median"] == 2.0 and out["off_policy_s_median"] == 1.25
    assert out["off_policy_steps_per_s"] == pytest.approx(0.8) and out["speedup"] == pytest.approx(1.6)
    assert len(out["raw_steps"]["off_policy"]) == 2 * 3 and out["off_policy_wait_s"] == 0.01
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert bench.bench_offpolicy(steps=5, repeats=1)["skipped"].endswith("one for the trainer; 1 here")


@pytest.mark.parametrize("flags, message", [(["--step-steps", "1"], "--step-steps must be >= 2"),
                                           (["--step-micro-batch", "5"], "--step-micro-batch (5) must divide")])
def test_step_flags_are_checked(monkeypatch, capsys, flags, message):
    monkeypatch.setattr(sys, "argv", ["bench.py", "--only", "step", *flags])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--only", "bogus"], f"--only: unknown section(s) ['bogus']; choose from {list(bench.SECTIONS)}"),  # was 12 lines
    (["--only", ""], "argument --only: an empty value (an unset shell variable?): give one, or leave the flag out"),
    (["--only", ","], f"--only ',': no section given; choose from {list(bench.SECTIONS)}"),
    (["--only", "reward", "--step-model", ""], "argument --step-model: an empty value (an unset shell variable?): "
                                               "give one, or leave the flag out"),
    (["--only", "logprobs", "--device", "cuda"], "--device cuda: no CUDA device here (torch "),  # was torch's assert
    (["--only", "update_levers", "--device", "cuda"], "--device cuda: no CUDA device here (torch "),
    (["--only", "reward", "--update-repeats", "0"], "--update-repeats must be >= 1, got 0"),
    (["--only", "loss", "--logprobs-tokens", "0"], "--logprobs-tokens 0: must be >= 1"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu' (choose from 'cpu', 'cuda')"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--only", "update_throughput", "--update-attn", "bogus"],  # was transformers' ValueError, the model being built
     "argument --update-attn: invalid choice: 'bogus' (choose from 'preset', 'sdpa', 'eager', 'flash_attention_2')"),
    (["--only", "update_throughput", "--update-attn", "flash_attention_2"],
     "--update-attn flash_attention_2 runs on CUDA only: give --device cuda, or another attention (preset, sdpa, "
     "eager)"),
])
def test_bad_flags_are_one_line_and_exit_2_before_any_section_runs(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    for name in bench.SECTIONS:
        monkeypatch.setitem(bench.SECTIONS, name, lambda **kwargs: pytest.fail("a section ran"))
    monkeypatch.setattr(sys, "argv", ["bench.py", *argv])
    with pytest.raises(SystemExit) as e:
        bench.main()
    captured = capsys.readouterr()
    assert e.value.code == 2 and captured.err.startswith(f"bench.py: error: {message}") and captured.out == ""
    assert captured.err.count("\n") == 1


def test_the_output_is_checked_before_the_sections_run_and_its_folder_made(monkeypatch, capsys, tmp_path):
    """Issue 59: --output nodir/x.json ended in FileNotFoundError after 40-118 s of work; a path that cannot take the
    results (under a file, a folder, a link: bench writes it in place) is refused first."""
    ran = []
    monkeypatch.setitem(bench.SECTIONS, "reward", lambda **kwargs: ran.append("reward") or {"pairs_per_s": 1.0})
    (tmp_path / "a_file").write_text("mine\n")
    os.symlink(tmp_path / "a_file", tmp_path / "link.json")
    for output, message in ((tmp_path / "a_file" / "x.json", f"its folder {tmp_path}/a_file is a file, not a folder"),
                            (tmp_path, "is a folder; name a file in it"),
                            (tmp_path / "link.json", "is a symbolic link; refusing to write through it (remove it)")):
        monkeypatch.setattr(sys, "argv", ["bench.py", "--only", "reward", "--output", str(output)])
        with pytest.raises(SystemExit) as e:
            bench.main()
        assert e.value.code == 2 and capsys.readouterr().err == f"bench.py: error: --output {output}" + (
            ": " if "its folder" in message else " ") + f"{message}\n"
    assert ran == [] and (tmp_path / "a_file").read_text() == "mine\n"
    output = tmp_path / "nodir" / "x.json"
    monkeypatch.setattr(sys, "argv", ["bench.py", "--only", "reward", "--output", str(output)])
    bench.main()
    assert ran == ["reward"] and json.loads(output.read_text())["reward"] == {"pairs_per_s": 1.0}


@pytest.mark.slow
def test_ours_steps_times_a_real_run(tiny_model_path, tmp_path):
    # 2 steps of train.py at a toy shape: one measured step, whose wall time covers train.py's own phase times
    records = bench.ours_steps("hf", str(tmp_path), steps=2, prompts=2, n=2, max_tokens=8, micro_batch=4, lr=1e-4)
    assert len(records) == 1
    r = records[0]
    assert r["s"] > 0 and r["response_len"] > 0
    assert r["sample_s"] + r["score_s"] + r["update_s"] <= r["s"] + 0.01


def test_update_memory_says_why_it_did_not_run_without_a_gpu(monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert "needs a CUDA GPU" in bench.bench_update_memory()["skipped"]


@pytest.mark.slow
def test_logprob_probe_on_cpu_reports_peaks_and_times():
    # the probe's bookkeeping at a toy shape: the fused path holds less than the full-logits one
    # fresh processes (in this one, freed heap would hide the peaks), at a vocabulary where the logits dominate
    # fixed costs: bf16 logits 50 MiB, the fused kernel's fp32 tile 16 MiB
    shape = dict(vocab=100_000, tokens=256, repeats=1, hidden=32)
    naive, fused = bench.logprob_peak("naive", **shape), bench.logprob_peak("fused", **shape)
    assert len(naive["runs_s"]) == 2 and naive["grads_bytes"] == fused["grads_bytes"] == (256 * 32 + 100_000 * 32) * 2
    assert naive["forward_peak_bytes"] > 3 * naive["logits_bytes"]  # fp32 log_softmax and its exp
    assert fused["total_peak_bytes"] < 0.5 * naive["total_peak_bytes"], (fused, naive)


def test_update_flops_counts_layers_head_and_causal_attention():
    config = dict(hidden_size=4, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=8,
                  vocab_size=10)
    layer = 4 * 4 + 2 * 4 * 2 + 4 * 4 + 3 * 4 * 8  # q, k and v (2 of 4 heads' width), o; gate, up, down
    lengths = [(3, 2), (1, 4)]  # (prompt, response)
    assert bench.update_flops(config, lengths) == 6 * 2 * layer * 10 + 6 * 40 * 6 + 6 * 2 * 4 * (5**2 + 5**2)
    # full-square (torchtitan, PaLM): the whole l x l square of each sequence, twice the causal-halved attention
    assert bench.update_flops(config, lengths, convention="full_square") == (
        6 * 2 * layer * 10 + 6 * 40 * 6 + 12 * 2 * 4 * (5**2 + 5**2))
    # the old log-probs' forward of the second sequence: a third of its forward-and-backward
    assert bench.update_flops(config, lengths, forward_only=lengths[1:]) == bench.update_flops(config, lengths) + (
        2 * 2 * layer * 5 + 2 * 40 * 4 + 2 * 2 * 4 * 5**2)
    assert bench.mini_batch_split([(1, 1), (2, 2), (3, 3), (4, 4)], 2) == ([(1, 1), (2, 2), (3, 3), (4, 4)],
                                                                          [(3, 3), (4, 4)])


def test_update_throughput_says_why_it_did_not_run_without_a_gpu(monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert "no CUDA GPU" in bench.bench_update_throughput(device="cuda")["skipped"]


def test_update_throughput_measures_both_draws_through_the_preset_attention(monkeypatch):
    """The section's bookkeeping at a toy shape: packed and padded on each draw, the attention train.py runs named,
    the draws as documented (the long-tailed one capped, the short one 4x as many sequences, alike)."""
    monkeypatch.setattr(bench, "matmul_rate", lambda device: 1e9)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=64, tie_word_embeddings=False, max_position_embeddings=512)
    out = bench.bench_update_throughput("cpu", sequences=3, median=40, cap=60, budget=300, repeats=1, config=shape)
    assert out["attention"] == "per_sequence" and set(out["attention_kernel_calls"]) == {"sdpa_per_sequence"}
    assert out["attention_kernel_calls"]["sdpa_per_sequence"] > 0  # counted as they ran, not inferred
    draws = bench.update_draws(False, 3, 40, 60, (16, 128))
    assert len(draws["long_tailed"]) == 3 and max(r for _, r in draws["long_tailed"]) <= 60
    assert len(draws["short_uniform"]) == 12 and all(16 <= p <= 32 and 48 <= r <= 64 for p, r in draws["short_uniform"])
    assert out["kernels"]["rope"].startswith("transformers.") and out["liger"] is False  # read from the model
    assert out["kernels"]["checkpointing"] == "full, 1 of 1 layers" and out["mini_batches"] == 1
    for draw, lengths in draws.items():
        assert out[f"{draw}_tokens"] == sum(p + r for p, r in lengths)
        assert out[f"{draw}_model_flops"] == bench.update_flops(shape, lengths)
        assert out[f"{draw}_model_flops_full_square"] == bench.update_flops(shape, lengths, convention="full_square")
        assert out[f"{draw}_padded_micro_batches"] == math.ceil(len(lengths) / 4)  # the preset's micro-batch of 4
        assert math.ceil(out[f"{draw}_tokens"] / 300) <= out[f"{draw}_packed_micro_batches"] < len(lengths)
        for side in ("padded", "packed"):
            assert out[f"{draw}_{side}_tokens_per_s"] == pytest.approx(out[f"{draw}_tokens"] / out[f"{draw}_{side}_s"])
            seconds = out[f"{draw}_{side}_s"]
            assert out[f"{draw}_{side}_mfu"] == pytest.approx(out[f"{draw}_model_flops"] / seconds / 1e9)
            assert out[f"{draw}_{side}_mfu_full_square"] == pytest.approx(
                out[f"{draw}_model_flops_full_square"] / seconds / 1e9)
        assert out[f"{draw}_packed_speedup"] == pytest.approx(out[f"{draw}_padded_s"] / out[f"{draw}_packed_s"])


def test_update_levers_measure_what_they_name(monkeypatch):
    """The lever rows: bf16 weights are train.py's FSDP2 mixed precision (fp32 masters, bf16 q/k/v reach attention),
    the card's dense peak is looked up by name (None for an unnamed card: the GEMM rate stands in), and each lever's
    row comes from its own model."""
    import torch.distributed as dist
    assert (bench.dense_bf16_peak("NVIDIA H100 PCIe") == 756e12
            and bench.dense_bf16_peak("NVIDIA H100 80GB HBM3") == 989e12)
    assert bench.dense_bf16_peak("NVIDIA H200") == 989e12 and bench.dense_bf16_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert bench.dense_bf16_peak("NVIDIA H200 NVL") == 835e12  # "H200" is in its name too
    assert bench.dense_bf16_peak("NVIDIA GeForce RTX 4090") is None
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert "no CUDA GPU" in bench.bench_update_levers()["skipped"]
    assert "GPU only (--device cuda)" in bench.bench_update_levers(device="cpu")["skipped"]
    monkeypatch.setattr(bench, "matmul_rate", lambda device: 1e9)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=64, tie_word_embeddings=False, max_position_embeddings=512)
    seen = []
    real = bench.counting_kernels

    @contextlib.contextmanager
    def recording():
        with real() as counts:
            from cegppo_utils import attention
            kernel = attention.KERNELS["sdpa_per_sequence"]
            attention.KERNELS["sdpa_per_sequence"] = (lambda q, k, v, *a: seen.append((q.dtype, k.dtype, v.dtype))
                                                      or kernel(q, k, v, *a))
            yield counts
    monkeypatch.setattr(bench, "counting_kernels", recording)
    try:
        out = bench.bench_update_throughput("cpu", sequences=2, median=20, cap=30, budget=200, repeats=1, config=shape,
                                            draws=("long_tailed",), weights="bf16", layouts=("packed",))
        selective = bench.bench_update_throughput("cpu", sequences=2, median=20, cap=30, budget=200, repeats=1,
                                                  config=shape, draws=("long_tailed",), weights="bf16",
                                                  checkpointing="selective", layouts=("packed",))
    finally:
        if dist.is_initialized():  # the group of one FSDP2 needed in this process
            dist.destroy_process_group()
    assert out["precision"].startswith("bf16: FSDP2") and "long_tailed_padded_s" not in out
    assert selective["gradient_checkpointing"] == "selective, 1 of 1 layers"
    assert selective["long_tailed_packed_tokens_per_s"] > 0
    assert [name for name, _ in bench.UPDATE_LEVERS if "selective" in name]  # measured beside full and none on a GPU
    assert seen and set(seen) == {(bench.torch.bfloat16,) * 3}


def test_the_kernels_are_put_back_however_the_counted_block_ends():
    """bench_update_levers catches an out-of-memory error in one lever and runs the next: the kernels must not stay
    wrapped (the next lever's calls would be counted into the failed one's counts)."""
    from cegppo_utils import attention
    before = dict(attention.KERNELS)
    with pytest.raises(bench.torch.OutOfMemoryError):
        with bench.counting_kernels() as counts:
            assert attention.KERNELS != before
            raise bench.torch.OutOfMemoryError("CUDA out of memory")
    assert attention.KERNELS == before and counts == {}


def test_the_sections_get_the_command_lines_values_and_update_levers_runs_only_when_named(monkeypatch, capsys):
    """update_levers times nine update stages at the 1.5B shape: not in the default set, and given --device,
    --update-sequences and --update-repeats when named (its own single repeat when --update-repeats is left out)."""
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    calls = {}
    for name in bench.SECTIONS:
        monkeypatch.setitem(bench.SECTIONS, name, lambda name=name, **kwargs: calls.update({name: kwargs}) or {})
    monkeypatch.setattr(sys, "argv", ["bench.py"])
    bench.main()
    assert list(calls) == [n for n in bench.SECTIONS if n != "update_levers"]
    assert calls["update_throughput"] == dict(device="cpu", sequences=16, budget=0, attn="preset")
    calls.clear()
    monkeypatch.setattr(sys, "argv", ["bench.py", "--only", "update_levers,update_levers", "--device", "cuda",
                                      "--update-sequences", "32", "--update-repeats", "2"])
    bench.main()
    assert calls == {"update_levers": dict(device="cuda", sequences=32, repeats=2)}
    calls.clear()
    monkeypatch.setattr(sys, "argv", ["bench.py", "--only", "update_levers", "--device", "cuda"])
    bench.main()
    assert calls == {"update_levers": dict(device="cuda", sequences=16)}
    capsys.readouterr()


SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=64, tie_word_embeddings=False, max_position_embeddings=512)


def test_the_update_row_times_the_whole_stage_through_train_pys_own_functions(monkeypatch):
    """mini_batches=4 (a GPU takes the preset's 8): train.old_logprobs and train.update_policy run on all four
    mini-batches, as train.main calls them, inside the timed stage; the model FLOPs count the old log-probs' forward
    of the three after the first."""
    import train
    calls = []
    for name in ("old_logprobs", "update_policy"):
        real = getattr(train, name)
        monkeypatch.setattr(train, name, lambda policy, minis, *a, real=real, name=name, **k:
                            calls.append((name, len(minis))) or real(policy, minis, *a, **k))
    monkeypatch.setattr(bench, "matmul_rate", lambda device: 1e9)
    out = bench.bench_update_throughput("cpu", sequences=8, median=20, cap=30, budget=200, repeats=1, config=SHAPE,
                                        draws=("long_tailed",), layouts=("packed",), mini_batches=4)
    assert calls == [("old_logprobs", 4), ("update_policy", 4)] * 2  # the warm-up and the timed round
    lengths = bench.update_draws(False, 8, 20, 30, (16, 128))["long_tailed"]
    assert out["long_tailed_model_flops"] == bench.update_flops(SHAPE, lengths, lengths[2:])
    assert out["mini_batches"] == 4 and out["long_tailed_packed_micro_batches"] >= 4  # rows never span mini-batches


@pytest.mark.parametrize("host_syncs", [False, True])
def test_the_host_sync_lever_takes_the_packed_rows_layout_away(monkeypatch, host_syncs):
    """host_syncs=True (the lever's off side): every forward searches the position ids for the sequences, as before
    pack() gave them; False (train.py's): none does."""
    from cegppo_utils import attention
    searched, real = [], attention.layout
    monkeypatch.setattr(attention, "layout", lambda *a: searched.append(1) or real(*a))
    monkeypatch.setattr(bench, "matmul_rate", lambda device: 1e9)
    bench.bench_update_throughput("cpu", sequences=2, median=20, cap=30, budget=200, repeats=1, config=SHAPE,
                                  draws=("long_tailed",), layouts=("packed",), host_syncs=host_syncs)
    assert bool(searched) == host_syncs


def test_a_lever_measured_after_liger_finds_the_model_family_as_it_was():
    """Liger (and the selective policy's rotary on copies) replace names in the model family's module for every model
    built later in the process: each lever runs inside family_restored, which puts them back."""
    from transformers.models.qwen2 import modeling_qwen2 as Q
    rotary, norm = Q.apply_rotary_pos_emb, Q.Qwen2RMSNorm
    with bench.family_restored():
        Q.apply_rotary_pos_emb, Q.Qwen2RMSNorm, Q.added_by_a_patch = len, int, 1
    assert Q.apply_rotary_pos_emb is rotary and Q.Qwen2RMSNorm is norm and not hasattr(Q, "added_by_a_patch")


def test_every_lever_is_a_setting_of_the_update_section():
    import inspect
    takes = inspect.signature(bench.bench_update_throughput).parameters
    assert all(set(lever) <= set(takes) for _, lever in bench.UPDATE_LEVERS)
    assert len({name for name, _ in bench.UPDATE_LEVERS}) == len(bench.UPDATE_LEVERS)
    failed = "OutOfMemoryError: CUDA out of memory"
    assert bench.lever_line({"failed": failed}) == failed  # a lever that failed is named with its error


@pytest.mark.parametrize("path", ["tools/bench.py", "tools/gpu_check.py"])
def test_every_function_ends_within_60_lines(path):
    import ast

    from conftest import ROOT
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    long = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60}
    assert long == {}
