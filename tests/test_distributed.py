"""train.py under torchrun: FSDP2 over 2 CPU ranks (gloo) must train exactly as one process does. The ranks start warm
(tests/warm.py: forked with torchrun's variables, 10-20 s of imports fewer a launch);
test_more_ranks_than_held_out_problems launches train.py under torchrun itself."""

import json
import math
import os
import sys

import pytest
import torch
import warm
from conftest import ROOT, few_problems, vllm_or_skip

# One update on a fixed batch, run by a worker that is either a plain process or a torchrun rank. 6 groups of 4,
# mini-batches of 3 groups, micro-batches of 2 sequences: in each mini-batch one rank holds 2 groups and the other 1,
# so that rank pads with empty micro-batches. SGD (no momentum), so the parameter change is -lr x gradient and a
# wrong gradient scale (averaged instead of summed over ranks, a per-rank token mean) would show.
WORKER = r'''
import json, random, sys
import torch
import train
from cegppo_utils import distributed as D, flags
from transformers import AutoModelForCausalLM
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

rank, world, device = D.init()
# old log-probs come from the model before the update, as in train.py; make the ratios leave the clip range
real = train.response_logprobs
def shifted(policy, mb, grad=False, truncation=False, model=None):  # the reference's too: a KL gradient from step 1
    logp, entropy, kept = real(policy, mb, grad=grad, truncation=truncation, model=model)
    # a shift by token and place in its response, not by place in the micro-batch: padded and packed layouts agree.
    # log d = -shift in {{-0.5, 0, 0.5}}: at least 0.18 from log(1 - 0.2) and log(1 + 0.2), so a token's clip region
    # is the same in every layout and on every CPU's kernels, never a matter of rounding
    shift = 0.5 * ((mb.response_ids + torch.arange(logp.shape[1])) % 3 - 1).float()
    return (logp + shift if not grad else logp), entropy, kept
train.response_logprobs = shifted
results = {{}}
for variant, budget in [(a, b) for a in {algos!r} for b in (0, 40)]:  # padded, then packed rows of <= 40 tokens
    algo, _, extra = variant.partition("+")
    # k2: with k3's e^x at SGD lr 1 one float32 element of 70400 drifts to 5e-5 (k3 is exact in float64: test_train)
    kl = ["--kl-coef", "0.1", "--kl-estimator", "k2"] if extra == "kl" else []
    precision = "bf16" if extra == "bf16" else "fp32"  # bf16: FSDP2's mixed precision, one process included
    args = flags.parse_args(["--preset", "tiny", "--algo", algo, *kl, "--n", "4", "--mini-batch-prompts", "3",
                             "--train-prompts", "6", "--gen-prompts", "6",
                             *(["--micro-batch-size", "2"] if not budget else []),  # read only when padded
                             "--positive-lm-coef", "0.1", "--grad-clip", "1e9", "--max-prompt-len", "9",
                             "--max-response-len", "12", "--micro-batch-tokens", str(budget), "--precision", precision])
    args.region_grad_norms = "off"  # measured by one fp32 process only (flags.py): off, so both sides log the same
    torch.manual_seed(0)
    model = D.place_model(AutoModelForCausalLM.from_pretrained({model!r}, dtype=torch.float32), precision, device)
    assert world > 1 or precision == "bf16" or next(model.parameters()).device == device  # one process, fp32: moved
    computed_in = set()  # the dtype every linear layer computes in, through FSDP2's casts
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda m, inputs, out: computed_in.add(str(out.dtype)))
    # bf16: lr 1e-4. The second step's d is taken where the first step moved the weights: at lr 3e-3 that move
    # carried a token across a clip boundary in one layout and not in the other in 16 of 20 seeds (AVX-512 BF16 and
    # AVX2 kernels), a whole token's gradient apart; at lr 1e-4 in none of 18, so what is left is rounding
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0 if precision == "fp32" else 1e-4)
    rng = random.Random(0)
    groups = []
    for g in range(6):
        prompt = [rng.randrange(5, 270) for _ in range(rng.randint(3, 9))]
        groups.append([{{"prompt_ids": prompt,
                        "response_ids": [rng.randrange(5, 270) for _ in range(rng.randint(1, 12))],
                        "advantage": rng.gauss(0, 1), "correct": rng.random() < 0.5}} for _ in range(4)])
    mini_batches = [[s for i in range(m, m + 3) if i % world == rank for s in groups[i]] for m in (0, 3)]
    policy = train.make_policy(args, model, optimizer, 0, device)
    if args.loss.kl_coef:  # the frozen reference, sharded like the policy (as train.load_policy)
        ref = AutoModelForCausalLM.from_pretrained({model!r}, dtype=torch.float32).requires_grad_(False).eval()
        policy.ref_model = D.place_model(ref, precision, device)
    minis = train.make_mini_batches(policy, mini_batches, args.loss)
    train.old_logprobs(policy, minis)
    metrics = train.update_policy(policy, minis, args.loss)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    results[f"{{variant}}/{{budget}}"] = {{"params": full, "metrics": metrics, "lr": optimizer.param_groups[0]["lr"],
                                         "tokens": sum(len(s["response_ids"]) for g in groups for s in g),
                                         "adv_max": max(abs(s["advantage"]) for g in groups for s in g),
                                         "computed_in": sorted(computed_in)}}
if D.is_main():
    torch.save(results, {out!r})
D.end_process()
'''


def enough_devices(nproc):
    """Ranks run on CPUs with gloo, or one GPU each with NCCL: where a GPU answers, a test with more ranks than GPUs
    skips (a rank would ask for a device that is not there)."""
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        pytest.skip(f"{nproc} ranks need {nproc} GPUs here; {torch.cuda.device_count()} answer")


def torchrun(nproc, *argv, timeout=600, launcher=warm.torchrun):
    """The ranks' launch, warm (tests/warm.py) unless launcher is warm.real_torchrun; a failure's output in the
    message."""
    enough_devices(nproc)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}  # the worker scripts import the root's
    out = launcher(nproc, argv, cwd=ROOT, env=env, timeout=timeout)
    if out.returncode != 0:  # pytest.fail keeps the text whole (an assertion message's repr is cut short)
        pytest.fail(f"torchrun exited {out.returncode}\n--- stdout (tail)\n{out.stdout[-2000:]}\n--- stderr (tail)\n"
                    f"{out.stderr[-6000:]}", pytrace=False)
    return out


def run_worker(tmp_path, model, world):
    out = tmp_path / f"update-{world}.pt"
    script = tmp_path / f"worker-{world}.py"
    script.write_text(WORKER.format(root=ROOT, model=model, algos=ALGOS, out=str(out)))
    if world == 1:
        done = warm.run([sys.executable, str(script)], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                        capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
    else:
        torchrun(world, str(script))
    return torch.load(out, weights_only=False)


# token-mean and seq-mean-token-mean; the KL penalty's reference model sharded too; CE-GPPO in bf16 (FSDP2's mixed
# precision in one process as on two ranks)
ALGOS = ("ce_gppo", "grpo", "grpo+kl", "ce_gppo+bf16")


SHARES = ("clip_frac_", "dual_clip_frac", "entropy_region_", "beta1_dose")  # shares of the step's tokens


def tokens_of(key, metrics, tokens):
    """The tokens a share is taken over: a region's for loss.evidence_row's (low_neg_..., high_pos_..., inside_...:
    inside is neither below 1 - eps nor above 1 + eps), else the step's."""
    m = metrics
    share = {"low_neg": m["clip_frac_low_neg"], "high_pos": m["clip_frac_high_pos"],
             "inside": 1 - sum(m[f"clip_frac_{r}"] for r in ("low_neg", "low_pos", "high_pos", "high_neg"))}
    region = next((r for r in share if key.startswith(r + "_")), None)
    return tokens if region is None else max(round(share[region] * tokens), 1)


def distance(a, b, keys):
    """The Euclidean distance between two models' parameters (state dicts), over keys, in float64."""
    return math.sqrt(sum(((a[k] - b[k]).double() ** 2).sum().item() for k in keys))


def bf16_tolerance(key, one, two):
    """(rel, abs) within which a metric of the bf16 update (on 2 ranks, or packed) equals one process's padded one,
    from what the metric is. bf16 keeps 8 significant bits: a log pi through bf16 logits carries 2^-8 of its size,
    which another layout rounds otherwise."""
    m, tokens = one["metrics"], one["tokens"]
    if key == "optimizer_steps":
        return 0, 0
    if key.startswith(SHARES) or key.endswith(("_eos_share", "_late_share")):
        # whole tokens counted, summed in fp32 (rel 1e-6); a token changes region only where its d (against 1 -+ eps)
        # or its -log pi (against H, entropy_region_*) lies within bf16's rounding of the boundary: one token's worth
        return 1e-6, 1 / tokens_of(key, m, tokens)
    if key == "entropy" or key.endswith("_old_logp_mean"):  # of pi_old: the start's weights, the same everywhere
        return 2.0 ** -8, 0
    if key == "grad_norm":
        # the mean of the two steps' gradient norms. SGD without clipping (grad clip 1e9) ends at start - lr (g1 + g2):
        # the second gradients differ by at most |the weights' difference| / lr plus the first's, and the first (at
        # the start's weights) by its bf16 rounding, 2^-8 of it (measured 0.87 x 2^-8 alone), |g1| <= 2 grad_norm
        gap = distance(two["params"], one["params"], one["params"])
        return 0, gap / (2 * one["lr"]) + 2.0 ** -7 * 2 * m["grad_norm"]
    # After the first step: log d = log pi(after) - log pi_old - shift, each log pi within 2^-8 of its size (that of
    # the regions' mean log pi_old) and the step's change (|log d|) with it: |error of log d| <= 2^-8 (2 |log pi_old|
    # + |log d|), where |log d| of a token is at most log(tokens x ratio_mean) for the largest d (every d > 0)
    log_pi = max(abs(v) for k, v in m.items() if k.endswith("_old_logp_mean"))
    if "_ratio_p" in key:  # a percentile of d: within that bound on the log scale, at its own d
        return math.exp(2.0 ** -8 * (2 * log_pi + abs(math.log(m[key])))) - 1, 0
    worst = math.expm1(2.0 ** -8 * (2 * log_pi + math.log(tokens * max(m["ratio_mean"], 1.0))))  # of any one d
    if key == "ratio_mean":  # the token mean of d
        return worst, 0
    if key == "approx_kl":  # the token mean of k3 = d - log d - 1, which moves by (d - 1) x the error of log d
        return 0, (m["ratio_mean"] + 1) * worst
    if key == "pg_loss":  # the token mean of -d A (inside and the pessimistic sides; the clipped regions' value has
        return 0, one["adv_max"] * m["ratio_mean"] * worst  # no d), |A| at most the largest advantage
    if key == "positive_lm_loss":  # the mean -log pi of the correct responses: 2^-8 of itself and of the change
        return 0, 2.0 ** -8 * (abs(m[key]) + math.log(tokens * max(m["ratio_mean"], 1.0)))
    raise AssertionError(f"{key}: a bf16 metric with no tolerance of its own; say what it is")


@pytest.mark.slow
def test_two_ranks_update_like_one_process(tmp_path, tiny_model_path):
    """Padded or packed (--micro-batch-tokens) micro-batches, on two ranks or one: each update is one process's
    padded update. Where a GPU answers each rank needs its own: checked before anything runs."""
    enough_devices(2)
    ones, twos = run_worker(tmp_path, tiny_model_path, 1), run_worker(tmp_path, tiny_model_path, 2)
    from safetensors.torch import load_file
    start = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    for algo, one, two, packed in [(f"{a} {name}", ones[f"{a}/0"], other[f"{a}/{b}"], b > 0) for a in ALGOS
                                   for name, other, b in (("2 ranks", twos, 0), ("2 ranks packed", twos, 40),
                                                          ("packed", ones, 40))]:
        moved = max((one["params"][k] - start[k]).abs().max().item() for k in start)
        assert moved > 1e-3 * one["lr"], algo  # the update did something
        bf16 = algo.startswith("ce_gppo+bf16")
        if bf16:
            # bf16 compute: every activation's gradient rounded to bf16's 8 significant bits, layer after layer, in
            # another layout (packed rows, each rank packing its own sequences), then summed in fp32 in another
            # order. An element whose tokens' terms cancel keeps their rounding, not its own, so the update is
            # compared as a whole: measured 0.6-4.5% of its norm in 18 seeds, the largest element 0.4-9.1% of the
            # largest move (AVX-512 BF16 and AVX2 kernels). A mean over ranks instead of a sum is off by 50%, and
            # computed_in below tells bf16 from fp32.
            gap, update = distance(two["params"], one["params"], start), distance(one["params"], start, start)
            assert gap <= 2.0 ** -3 * update, (algo, gap / update)
        else:
            # float32 rounding in another summation order, grown through two SGD steps at lr 1 (moves of 1-6):
            # measured at most 1.7e-6 x the largest move across ranks and 3.2e-5 x with packed rows, varying from
            # seed to seed (AVX-512 BF16 and AVX2 kernels). A wrong reduction (a mean over ranks, a per-rank token
            # mean) is off by a sizeable part of the move.
            atol = (2e-4 if packed else 2e-5) * moved
            for k in start:
                torch.testing.assert_close(two["params"][k], one["params"][k], rtol=1e-4, atol=atol,
                                           msg=lambda m: f"{algo} {k}: {m}")
        assert one["metrics"].keys() == two["metrics"].keys()
        for k, v in one["metrics"].items():
            rel, abs_ = bf16_tolerance(k, one, two) if bf16 else (1e-4, 1e-6)
            assert two["metrics"][k] == pytest.approx(v, rel=rel, abs=abs_), (algo, k, rel, abs_)
        assert one["metrics"]["clip_frac_high_pos"] + one["metrics"]["clip_frac_low_neg"] > 0  # clipped tokens present
        assert one["metrics"]["optimizer_steps"] == 2
    assert ones["ce_gppo/0"]["params"].keys() == ones["grpo/0"]["params"].keys()
    assert any(not torch.equal(ones["ce_gppo/0"]["params"][k], ones["grpo/0"]["params"][k])
               for k in start)  # two losses ran
    assert (twos["grpo+kl/0"]["metrics"]["kl_loss"] > 0
            and "kl_loss" not in twos["grpo/0"]["metrics"])  # the KL term ran on 2 ranks
    assert any(not torch.equal(ones["grpo+kl/0"]["params"][k], ones["grpo/0"]["params"][k]) for k in start)
    # bf16 computes in bf16, not fp32 under another name: every linear layer, on one rank and on two. (Its numbers'
    # distance from fp32 is no test of that: under ATEN_CPU_CAPABILITY=default pi_old's mean entropy differed by 6e-6.)
    for results, ranks in ((ones, 1), (twos, 2)):
        assert results["ce_gppo+bf16/0"]["computed_in"] == ["torch.bfloat16"], ranks
        assert results["ce_gppo/0"]["computed_in"] == ["torch.float32"], ranks


def test_the_worker_places_its_model_on_the_device_init_returns():
    """One process: the model moves to init()'s device (on a GPU machine, cuda; a device other than the CPU's default
    here, meta, shows the move); under torchrun FSDP2 shards it onto each rank's device instead."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cegppo_utils import distributed as D
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    placed = D.place_model(model, "fp32", torch.device("meta"))
    assert {p.device.type for p in placed.parameters()} == {"meta"}
    assert WORKER.count("D.place_model(") == 2  # the policy and the KL reference


def test_two_ranks_skips_on_a_one_gpu_machine_before_running_anything(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(sys.modules[__name__], "run_worker", lambda *a: ran.append(a))
    with pytest.raises(pytest.skip.Exception, match="2 ranks need 2 GPUs here; 1 answer"):
        test_two_ranks_update_like_one_process(tmp_path, "unused")
    assert ran == []


@pytest.mark.slow
def test_two_rank_run_logs_once_and_resumes_on_one_rank(tmp_path, tiny_model_path):
    """2 ranks, each sampling with its own engine (vLLM where it imports), then --resume of that run by a single
    process: DCP reshards the checkpoint to the new world size."""
    import rollout
    sampler = "vllm" if rollout.vllm_available() else "hf"
    if os.environ.get("REQUIRE_VLLM") == "1":
        vllm_or_skip()
    run = tmp_path / "run"
    flags = ["--preset", "tiny", "--gen-prompts", "8", "--train-prompts", "8", "--mini-batch-prompts", "4",
             "--group-size", "4", "--micro-batch-size", "8", "--eval-every", "2",
             "--no-eval-before-train", "--save-every", "1",
             "--eval-data", str(few_problems(tmp_path, 8)), "--output-dir", str(run)]  # 4 held-out problems a rank
    out = torchrun(2, "train.py", *flags, "--max-steps", "2", "--sampler", sampler)
    assert "ranks: 2" in out.stdout
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]  # written once, by rank 0
    assert "eval_acc" in rows[1] and 0 <= rows[1]["eval_acc"] <= 1
    assert sorted(f for f in os.listdir(run / "checkpoints" / "step_000002") if f.endswith(".distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]  # each rank wrote its shards
    # the sharded checkpoint loads whole into one process, equal to the gathered HF-format policy of the same step
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from cegppo_utils import runfolder
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters())
    state = runfolder.load_checkpoint(str(run / "checkpoints" / "step_000002"), model, optimizer)
    assert state["step"] == 2 and state["world_size"] == 2
    final = load_file(run / "final" / "model.safetensors")
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), final[name], rtol=0, atol=0)
    assert len(optimizer.state) == len(list(model.parameters()))  # AdamW moments came back too
    exported = load_file(os.path.join(runfolder.export_hf(str(run / "checkpoints" / "step_000002"),
                                                          str(tmp_path / "hf")),
                                      "model.safetensors"))
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)

    done = warm.run([sys.executable, "train.py", *flags, "--max-steps", "3", "--sampler", "hf", "--resume"],
                    cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout and "saved by 2 rank(s), now 1" in done.stdout
    assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")] == [1, 2, 3]
    final = AutoModelForCausalLM.from_pretrained(run / "final")  # HF format, whole
    assert final.config.architectures == ["Qwen2ForCausalLM"]
    assert sum(p.numel() for p in final.parameters()) > 1_000_000


SAMPLER_WORKER = r'''
import json, sys
import torch
import rollout, train
from cegppo_utils import distributed as D, tiny
from transformers import AutoModelForCausalLM, AutoTokenizer

rank, world, device = D.init()
tokenizer = AutoTokenizer.from_pretrained({model!r})
model = D.shard_model(AutoModelForCausalLM.from_pretrained({model!r}, dtype=torch.float32), "fp32")
engine = rollout.make_sampler("vllm", {model!r}, tokenizer=tokenizer, dtype="float32", max_model_len=256)
problems = [r["problem"] for r in tiny.arithmetic_split("test", 6)][rank::world][:2 - rank]  # 2 prompts and 1

def greedy(sampler):
    return [g[0].token_ids for g in rollout.sample(sampler, tokenizer, problems, n=1, temperature=0.0, max_tokens=40)]

with torch.no_grad():
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.05)
want = greedy(rollout.HFSampler(model, tokenizer))  # HF generate on the sharded model, ranks in lockstep
stale = greedy(engine)
engine.load_weights(D.full_named_parameters(model))
with open({out!r} + str(rank), "w") as f:
    json.dump({{"want": want, "stale": stale, "synced": greedy(engine)}}, f)
engine.close()
D.end_process()
'''


@pytest.mark.slow
def test_each_rank_engine_samples_from_the_sharded_policy_after_sync(tmp_path, tiny_model_path):
    """Per-rank vLLM engines get the FSDP-sharded weights, gathered one parameter at a time: after a weight change
    and a sync, each rank's vLLM greedy output equals HF greedy output of the sharded model itself."""
    vllm_or_skip()
    script, out = tmp_path / "sampler_worker.py", tmp_path / "greedy"
    script.write_text(SAMPLER_WORKER.format(root=ROOT, model=tiny_model_path, out=str(out)))
    torchrun(2, str(script))
    for rank, prompts in ((0, 2), (1, 1)):
        result = json.loads((tmp_path / f"greedy{rank}").read_text())
        assert len(result["want"]) == prompts
        assert result["stale"] != result["want"]  # the engine had the old weights
        assert result["synced"] == result["want"]


@pytest.mark.slow
def test_more_ranks_than_held_out_problems(tmp_path, tiny_model_path):
    """2 ranks evaluating a 1-problem file before training: rank 1's share is empty; it samples nothing, adds (0, 0)
    to the reduction and keeps FSDP's collectives in step (HF generate on the sharded model decodes a stand-in), so
    eval_acc is rank 0's one problem."""
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"problem": "Compute 2 + 3.", "answer": "5"}) + "\n")
    run = tmp_path / "run"
    out = torchrun(2, "train.py", "--preset", "tiny", "--gen-prompts", "2", "--train-prompts", "2", "--group-size", "2",
                   "--mini-batch-prompts", "2", "--micro-batch-size", "4", "--max-steps", "1", "--eval-data", str(one),
                   "--eval-before-train", "--eval-every", "1", "--sampler", "hf", "--log-samples-every", "0",
                   "--output-dir", str(run),
                   launcher=warm.real_torchrun)  # the suite's one train.py under torchrun itself
    assert "ranks: 2" in out.stdout
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1] and all("eval_acc" in r for r in rows)
    for step, row in zip((0, 1), rows):
        records = [json.loads(line) for line in open(run / "eval" / f"step_{step:06d}.rank0.jsonl")]
        assert len(records) == 1 and row["eval_acc"] == pytest.approx(sum(records[0]["correct"])
                                                                      / len(records[0]["correct"]))
        assert (run / "eval" / f"step_{step:06d}.rank1.jsonl").read_text() == ""  # rank 1 held no problem


# Every rank checks the run folder at start (runfolder.check) while rank 0 creates and removes a probe file in it. Here
# rank 0 holds its probe for 3 s while the other ranks ask 1 s in: a rank that looked itself would see the probe, a
# file no run keeps, and refuse the folder (exit 2; rank 0 then died at its next barrier). Then a folder that holds
# a run: every rank gets rank 0's refusal, word for word.
RACE_WORKER = r'''
import json, tempfile, time
from cegppo_utils import distributed as D, runfolder as RF
from cegppo_utils.data import UserError

rank, world, device = D.init()
if rank == 0:
    lock = RF.lock_output_dir({folder!r})  # as train.run does before main: the folder, its .lock and marker
    made = tempfile.mkstemp

    def held(*args, **kwargs):
        probe = made(*args, **kwargs)
        time.sleep(3)
        return probe
    tempfile.mkstemp = held
else:
    time.sleep(1)
said = {{}}
for name, path in (("new", {folder!r}), ("busy", {busy!r})):
    try:
        RF.check(path, False, {{}})
        said[name] = "ok"
    except UserError as e:
        said[name] = str(e)
with open({out!r} + str(rank), "w") as f:
    json.dump(said, f)
D.end_process()
'''


@pytest.mark.slow
def test_only_rank_0_looks_at_the_run_folder_and_every_rank_gets_its_verdict(tmp_path):
    """The two-rank flake of issue 59, made certain: three ranks, rank 0's probe held while the others check."""
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "metrics.jsonl").write_text('{"step": 1}\n')
    (busy / ".ce-gppo-run").write_text("")  # a run's own folder (the marker), not a foreign one
    script, out = tmp_path / "race_worker.py", tmp_path / "said"
    script.write_text(RACE_WORKER.format(folder=str(tmp_path / "run"), busy=str(busy), out=str(out)))
    torchrun(3, str(script), timeout=300)
    said = [json.loads((tmp_path / f"said{rank}").read_text()) for rank in range(3)]
    assert [s["new"] for s in said] == ["ok"] * 3, said
    assert said[0]["busy"].startswith(f"{busy} holds a run (metrics.jsonl): pass --resume") and \
        [s["busy"] for s in said] == [said[0]["busy"]] * 3
    assert sorted(os.listdir(tmp_path / "run")) == [".ce-gppo-run", ".lock"]  # the probe came and went
