"""The RL script on the CPU: reward on all of GSM8K, the GRPO math against hand-computed values, bad input
(each a one-line error before anything slow), the file's reading order, and runs of main() with vLLM
replaced by a CPU test double: end to end, a parity abort, a killed run resumed."""

import ast
import dataclasses
import functools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch
from torch.distributed.checkpoint import FileSystemWriter
from conftest import (QWEN3_CHAT_TEMPLATE, full_gsm8k, gsm8k_jsonl, gsm8k_rows, make_args, qwen3_config, write_chat_model,
                      trace, write_gsm8k_model, write_jsonl)

import plumbing
import simple_rl
from batch_invariant_backward import first_divergence, truncated

REPO = Path(__file__).resolve().parents[1]


# --- reward -------------------------------------------------------------------------------------


def test_every_gsm8k_reference_answer_scores_as_correct():
    full = [full_gsm8k("train"), full_gsm8k("test")]
    if None in full:
        print("\nGSM8K is neither at GSM8K_DIR nor on the hub: checking the shipped sample only")
        rows = gsm8k_rows("train") + gsm8k_rows("test")
    else:
        rows = full[0] + full[1]
        assert len(rows) == 8792
    wrong = [r["answer"][-40:] for r in rows if simple_rl.gsm8k_reward(r["answer"], r["answer"]) != 1.0]
    assert wrong == []


@pytest.mark.parametrize("completion, reward", [
    ("<think>\n48 / 2 = 24, 48 + 24 = 72\n</think>\n\nShe sold 72 clips.", 1.0),  # after the block
    ("<think>\nfirst try: #### 70\n</think>\nchecking again: #### 72", 1.0),  # after wins over inside
    ("<think>\nso the answer is #### 72\n</think>\n", 1.0),  # nothing after: the block's answer
    ("<think>\n#### 72\n</think>\nno, it is 71", 0.0),
    ("<think>\n72\n</think>\n\\boxed{71}", 0.0),
    ("<think>\nthinking about 72 but never closing", 1.0),  # an unclosed block is plain text
])  # fmt: skip
def test_reward_reads_answers_inside_and_after_a_think_block(completion, reward):
    assert simple_rl.gsm8k_reward(completion, "#### 72") == reward


@pytest.mark.parametrize("thinking", [False, True])
def test_chat_prompts_are_what_qwen3s_template_renders(tmp_path, thinking):
    from transformers import AutoTokenizer

    model_dir = write_chat_model(tmp_path / "chat")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    question = gsm8k_rows("test", 1)[0]["question"]
    rendered = (f"<|im_start|>user\n{question}\n{simple_rl.INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
                + ("" if thinking else "<think>\n\n</think>\n\n"))
    ids = simple_rl.encode_prompt(tokenizer, question, use_chat=True, thinking=thinking)
    assert ids == tokenizer.encode(rendered, add_special_tokens=False)
    tokens = tokenizer.convert_ids_to_tokens(ids)  # the markers are single tokens, not spelled out
    assert tokens.count("<|im_start|>") == 2 and tokens.count("<|im_end|>") == 1
    assert tokens.count("<think>") == tokens.count("</think>") == (0 if thinking else 1)
    config = plumbing.read_config(model_dir)
    stop_ids = plumbing.end_of_sequence_ids(tokenizer, config, model_dir, chat=True)  # the tokenizer's, config's
    assert tokenizer.convert_ids_to_tokens(stop_ids) == ["<|im_end|>", "<|endoftext|>"]  # an answer ends: first
    tokenizer.eos_token = "<|endoftext|>"  # as a Qwen3-Base tokenizer's: a chat turn still ends at <|im_end|>
    stop_ids = plumbing.end_of_sequence_ids(tokenizer, config, model_dir, chat=True)
    assert tokenizer.convert_ids_to_tokens(stop_ids) == ["<|im_end|>", "<|endoftext|>"]
    plain = plumbing.end_of_sequence_ids(tokenizer, config, model_dir, chat=False)
    assert tokenizer.convert_ids_to_tokens(plain) == ["<|endoftext|>"]


@pytest.mark.parametrize("completion, reward", [
    ("So she has 72 clips.\n#### 72", 1.0),
    ("#### 72.0", 1.0),
    ("####72", 1.0),
    ("#### $72", 1.0),
    ("The answer is \\boxed{72}.", 1.0),
    ("she sold 48 + 24 = 72 clips", 1.0),  # last number fallback
    ("#### 72 apples, not 73", 1.0),  # '####' wins over later numbers
    ("#### 7", 0.0),
    ("#### 720", 0.0),
    ("#### -72", 0.0),
    ("72 is wrong, it is 71", 0.0),
    ("", 0.0),
    ("no number at all", 0.0),
    ("#### ", 0.0),
    ("\\boxed{72} but #### 71", 0.0),  # '####' before '\\boxed'
    ("#### **72**\n\n(Check: 48 + 24 = 72, so 2 left over.)", 1.0),  # markdown after '####'
    ("#### The answer is 72. Check: 72 / 3 = 24", 1.0),  # words after '####', on its line
    ("#### -$72", 0.0),  # the sign kept
    ("\\boxed{72 \\text{ clips}}. Note: 2 extra", 1.0),  # units inside the box
    ("\\boxed{\\$72}", 1.0),
])  # fmt: skip
def test_reward_on_adversarial_completions(completion, reward):
    assert simple_rl.gsm8k_reward(completion, "Natalia sold ... \n#### 72") == reward


@pytest.mark.parametrize("a, b", [("1,000", "1000"), ("1000.0", "1000"), ("$1000", "1000"), ("1,000.00", "1e3"),
                                  ("-$5", "-5"), ("$-5", "-5"), ("- 5", "-5")])
def test_numbers_compare_as_decimals(a, b):
    expected = simple_rl.parse_number(b) if b != "1e3" else simple_rl.parse_number("1000")
    assert simple_rl.gsm8k_reward(f"#### {a}", f"#### {b}" if b != "1e3" else "#### 1000") == 1.0
    assert simple_rl.parse_number(simple_rl.extract_answer(f"#### {a}")) == expected


# --- GRPO math ----------------------------------------------------------------------------------


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # two groups of 4
    adv = simple_rl.group_advantages(rewards, 4, std_normalize=True)
    std = math.sqrt((0.75**2 + 3 * 0.25**2) / 3)  # unbiased std of [1, 0, 0, 0]
    expected = [0.75 / (std + 1e-4)] + [-0.25 / (std + 1e-4)] * 3 + [0.0] * 4
    torch.testing.assert_close(adv, torch.tensor(expected))
    raw = simple_rl.group_advantages(rewards, 4, std_normalize=False)
    torch.testing.assert_close(raw, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]))


def test_ppo_clip_loss_by_hand():
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.0, 1.5, 0.5, 1.1]))  # ratios 1, 1.5, 0.5, 1.1
    adv = torch.tensor([2.0, 1.0, -1.0, -3.0])
    loss, ratio, clipped = simple_rl.ppo_clip_loss(new, old, adv, clip_eps=0.2)
    torch.testing.assert_close(ratio, torch.tensor([1.0, 1.5, 0.5, 1.1]))
    # -min(r A, clip(r) A): 1*2; min(1.5, 1.2)=1.2; min(-0.5, -0.8)=-0.8; min(-3.3, -3.3)=-3.3
    torch.testing.assert_close(loss, torch.tensor([-2.0, -1.2, 0.8, 3.3]))
    assert clipped.tolist() == [False, True, True, False]


def test_ppo_clip_gradient_vanishes_where_clipped():
    new = torch.log(torch.tensor([1.0, 1.5])).requires_grad_()
    loss, _, _ = simple_rl.ppo_clip_loss(new, torch.zeros(2), torch.tensor([1.0, 1.0]), 0.2)
    loss.sum().backward()
    torch.testing.assert_close(new.grad, torch.tensor([-1.0, 0.0]))


def test_k3_kl_by_hand():
    lp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.0, -1.0, -1.5])
    d = ref - lp  # 0, 1, -1
    torch.testing.assert_close(simple_rl.k3_kl(lp, ref), torch.exp(d) - d - 1)
    assert simple_rl.k3_kl(lp, lp).eq(0).all()
    assert (simple_rl.k3_kl(lp, ref) >= 0).all()


def test_micro_batches_respect_the_budget_and_keep_order():
    lengths = [5, 5, 5, 12, 2, 2]  # prompt + completion; 12 is over the budget: a micro-batch of its own
    prompts, completions = [[i] * (n - 1) for i, n in enumerate(lengths)], [[8] for _ in lengths]
    batches = list(simple_rl.packed_micro_batches(prompts, completions, 10, "cpu", simple_rl.World()))
    assert [idx for idx, _ in batches] == [[0, 1], [2], [3], [4, 5]]
    assert [len(batch.tokens) for _, batch in batches] == [10, 5, 12, 4]
    # Samples of one prompt hold its rows once (the rows bind: 4 + 2 x 3 = 10), and read them once each: the
    # keys stay within twice the budget (7 samples of 4 + 1 take 11 rows, but 4 samples' keys are 20).
    for prompt, completion, groups, rows in (([7] * 4, [8] * 3, [[0, 1], [2, 3]], [10, 10]),
                                             ([7] * 4, [8], [[0, 1, 2, 3], [4, 5, 6]], [8, 7])):
        count = 4 if len(completion) == 3 else 7
        batches = simple_rl.packed_micro_batches([prompt] * count, [completion] * count, 10, "cpu")
        assert [idx for idx, _ in batches] == groups
        assert [len(batch.tokens) for _, batch in batches] == rows


def test_learning_rate_schedule():
    cfg = simple_rl.Optimizer(lr=1.0, warmup_steps=4, steps=14, min_lr_ratio=0.1)
    lrs = [simple_rl.lr_at(s, cfg) for s in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and abs(lrs[9] - 0.55) < 1e-12 and lrs[-1] > 0.1
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    # A run shorter than its warm-up warms up over all its steps; the flag is kept, so that a resume with more
    # --steps warms up as the flag says (not over the first run's steps).
    short = plumbing.check_args(make_args(warmup_steps=10, steps=4, assert_bitwise=False), 1)
    assert short.optimizer.warmup_steps == 10
    assert [simple_rl.lr_at(s, short.optimizer) * 1e6 / short.optimizer.lr for s in range(4)] == [
        0.25e6, 0.5e6, 0.75e6, 1e6]
    longer = dataclasses.replace(short.optimizer, steps=200)
    assert simple_rl.lr_at(5, longer) == longer.lr * 6 / 10


def test_the_warm_start_batch_divides_by_the_processes_only_when_there_is_a_warm_start():
    args = make_args(prompts_per_step=33, assert_bitwise=False)  # --sft-batch-size 64, no --sft-steps
    assert plumbing.check_args(args, 3).sampling.prompts_per_step == 33


def test_the_checks_notes_are_printed_by_rank_0_alone(monkeypatch, capsys):
    for rank, printed in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        plumbing.check_args(make_args(warmup_steps=10, steps=4, assert_bitwise=False), 2)
        assert ("note: --warmup-steps 10 is more than --steps 4" in capsys.readouterr().out) == printed, rank


def test_a_hub_model_is_fetched_with_every_file_a_chat_checkpoint_holds(tmp_path, monkeypatch):
    """--model <hub id> downloads the files a checkpoint of transformers holds (its chat template is a file of
    its own, chat_template.jinja): none of the chat model's files is filtered out."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    model_dir = write_chat_model(tmp_path / "chat")
    assert (model_dir / "chat_template.jinja").is_file()
    asked = {}

    def snapshot_download(repo_id, allow_patterns):
        asked["files"] = set(filter_repo_objects([p.name for p in model_dir.iterdir()], allow_patterns=allow_patterns))
        return str(model_dir)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(plumbing, "offline_unless_hub_answers", lambda: False)
    assert plumbing.resolve_model_dir("Org/Chat") == model_dir
    assert asked["files"] == {p.name for p in model_dir.iterdir()}


def test_config_names_transformers_5_writes_and_a_missing_rope_theta(tmp_path):
    """A Qwen3-MoE config saved by transformers 5 names its experts num_local_experts: read as num_experts. A
    config without rope_theta is refused: transformers' default (10,000) is not Qwen3's (1,000,000)."""
    moe = qwen3_config(experts=4, experts_per_token=2)
    moe["num_local_experts"] = moe.pop("num_experts")
    (tmp_path / "config.json").write_text(json.dumps(moe))
    assert plumbing.read_config(tmp_path)["num_experts"] == 4
    no_theta = {k: v for k, v in qwen3_config().items() if k != "rope_theta"}
    (tmp_path / "config.json").write_text(json.dumps(no_theta))
    with pytest.raises(plumbing.UsageError, match="no rope_theta; this trainer needs a Hugging Face Qwen3"):
        plumbing.read_config(tmp_path)


def test_a_warm_start_cuts_answers_at_max_new_tokens(tmp_path, monkeypatch):
    """Reference answers longer than --max-new-tokens are cut there, as rollouts are: no sequence outgrows
    --max-prompt-tokens + --max-new-tokens (here a model of 160 positions; a longer one overran RoPE's table)."""
    model_dir = write_gsm8k_model(tmp_path / "model", max_positions=160)
    monkeypatch.chdir(tmp_path)
    args = small_run(model_dir, run_name="cut", steps=1, max_prompt_tokens=120, max_new_tokens=6, sft_steps=1,
                     sft_batch_size=8, eval_every=0, save_every=-1, assert_bitwise=False)
    simple_rl.main(args, device="cpu", engine_class=TrainerAsSampler)
    (step, loss), = scalar_series(tmp_path / "runs" / "cut" / "warm_start")["sft/loss"]
    assert step == 0 and math.isfinite(loss)


def test_a_number_flag_is_not_called_a_switch():
    """The hint that a switch takes no value is for switches alone (a number flag's 0 or 1 is a value)."""
    for argv, switch in ((["--seed", "1", "--stepz", "5"], None), (["--steps", "0", "--lr", "abc"], None),
                         (["--offload-optimizer", "yes"], "--offload-optimizer")):
        with pytest.raises(plumbing.UsageError) as error:
            plumbing.parse_command_line(simple_rl.Args, simple_rl.__doc__, argv)
        assert ("is a switch" in str(error.value)) == bool(switch), (argv, str(error.value))


def test_parity_compares_bits_and_names_the_first_mismatch():
    vllm = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5, -0.25, -3.0])]
    same = [t.clone() for t in vllm]
    metrics, first = simple_rl.compare_bits(vllm, same, [[5, 6], [7, 8, 9]])
    assert metrics["mismatched_tokens"] == 0 and metrics["vllm_kl"] == 0 and first is None
    report = plumbing.parity_report(vllm, same, [[5, 6], [7, 8, 9]], 2, 0)
    assert "Bitwise identical: True, different tokens 0 / 5" in report and "0xbf800000" in report
    off = [t.clone() for t in vllm]
    off[1][1] = torch.nextafter(off[1][1], torch.tensor(0.0))  # one ulp
    metrics, first = simple_rl.compare_bits(vllm, off, [[5, 6], [7, 8, 9]])
    assert metrics["mismatched_tokens"] == 1 and metrics["max_abs_logprob_diff"] > 0
    assert first.message.startswith("sample 1 token 1 (id 8)") and (first.sample, first.token) == (1, 1)
    assert "Bitwise identical: False" in plumbing.parity_report(vllm, off, [[5, 6], [7, 8, 9]], 0, 1)
    # The printed fp32 bits tell apart two logprobs one ulp apart, which bf16 rounds together.
    row = plumbing.parity_report(vllm[1:], off[1:], [[7, 8, 9]], 2, 1).splitlines()[2].split()
    assert row[3] == "0xbe800000" and row[4] == "0xbe7fffff"


def test_the_divergence_locator_names_the_first_op_whose_bits_differ(tmp_path):
    """Trainer against trainer (vLLM's side of the locator needs a GPU: tests/test_gpu_rl.py): a
    divergence injected into one op is named, at its layer, and nothing before it is."""
    from conftest import qwen3_config, write_checkpoint

    model_dir = write_checkpoint(tmp_path / "m", qwen3_config(layers=3, head_dim=128), seed=4)
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    reference = trace(simple_rl.load_qwen3(model_dir, "cpu"), tokens)

    def nudged(fn):  # the same op, one bf16 ulp or so off (of a pair, the first: the norm, not the sum)
        def run(x, *args):
            out = fn(x, *args)
            return (out[0] * 1.01, *out[1:]) if isinstance(out, tuple) else out * 1.01
        return run

    def locate(inject) -> str:
        model = simple_rl.load_qwen3(model_dir, "cpu")
        inject(model)
        return first_divergence(trace(model, tokens), reference)

    def with_kernel(module, name):
        module.kernels = dataclasses.replace(module.kernels, **{name: nudged(getattr(module.kernels, name))})

    assert locate(lambda m: None).startswith("no intermediate tensor differs")
    assert locate(lambda m: with_kernel(m.layers[1].attention, "qk_norm_rotary")).startswith("layer 1 rotary: ")
    assert locate(lambda m: with_kernel(m.layers[2].feed_forward, "silu_and_mul")).startswith("layer 2 swiglu: ")
    assert locate(lambda m: with_kernel(m.layers[0].attention, "attention")).startswith("layer 0 attention: ")
    assert locate(lambda m: with_kernel(m, "rms_norm")).startswith("final_norm: ")

    def other_rotary_table(model):  # the angles computed in bf16 rather than fp32
        half = model.args.head_dim // 2
        inv_freq = (1.0 / model.args.rope_theta ** (torch.arange(0, half) / half)).to(torch.bfloat16)
        angles = torch.arange(len(model.cos_sin_cache)).to(torch.bfloat16)[:, None] * inv_freq
        model.cos_sin_cache.copy_(torch.cat([angles.cos(), angles.sin()], dim=-1))

    message = locate(other_rotary_table)
    assert message.startswith("layer 0 rotary: ") and "every tensor before it is bitwise equal" in message


# --- bad input ----------------------------------------------------------------------------------


def run_script(*flags, env_update=None, cwd=None):
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_BATCH_INVARIANT", "WORLD_SIZE", "RANK")}
    return subprocess.run([sys.executable, str(REPO / "simple_rl.py"), *flags], capture_output=True, text=True,
                          env=env | (env_update or {}), cwd=cwd, timeout=300)  # fmt: skip


def one_line_error(result):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@contextmanager
def small_disk(path: Path, size: int):
    """A real filesystem of `size` bytes at `path`, to fill (a tmpfs: mounting one needs root, else a skip)."""
    path.mkdir(exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


ON = {"VLLM_BATCH_INVARIANT": "1"}


def test_bad_flags_give_one_line_errors(tmp_path):
    (tmp_path / "a_file").write_text("")
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o500)
    cases = [
        (["--samples-per-prompt", "1"], ON, "at least 2"),
        (["--temperature", "0"], ON, "--temperature"),
        (["--temperature", "inf"], ON, "--temperature must be a finite number"),
        (["--lr", "nan"], ON, "--lr must be"),
        (["--lr", "inf"], ON, "--lr must be a finite number"),
        (["--top-k", "-1"], ON, "--top-k must be >= 0"),
        (["--top-p", "0"], ON, "--top-p must be in (0, 1]"),
        (["--top-k", "20", "--kl-coef", "0.1"], ON, "--kl-coef must be 0 with --top-k or --top-p"),
        (["--warmup-steps", "-1"], ON, "--warmup-steps must be >= 0"),
        (["--max-tokens-per-microbatch", "100"], ON, "must hold one whole sequence"),
        (["--vllm-gpu-memory", "1.5"], ON, "--vllm-gpu-memory"),
        (["--dataset", "x.jsonl"], ON, "--eval-dataset"),
        (["--run-name", ""], ON, "--run-name '': give a plain name"),
        (["--run-name", "../escape"], ON, "--run-name '../escape': give a plain name"),
        (["--output-dir", "a_file"], ON, "--output-dir a_file: "),
        (["--output-dir", "a_file/sub"], ON, "is not a writable directory"),
        (["--output-dir", str(read_only / "sub")], ON, "is not a writable directory"),
        (["--resume", "nowhere"], ON, "--resume nowhere: no such directory"),
        (["--resume", "."], ON, "not a checkpoint of this script"),
        ([], {}, "VLLM_BATCH_INVARIANT is not set, so vLLM's logprobs cannot equal the trainer's"),
        ([], {"VLLM_BATCH_INVARIANT": "0"}, "VLLM_BATCH_INVARIANT is 0, so"),
        ([], {"VLLM_BATCH_INVARIANT": "true"}, "VLLM_BATCH_INVARIANT is 'true', but vLLM reads it as an integer"),
        (["--prompts-per-step", "3"], ON | {"WORLD_SIZE": "2"}, "must be a multiple of the 2 processes"),
        (["--prompts-per-step", "3", "--sft-steps", "1"], ON | {"WORLD_SIZE": "3"},
         "--sft-batch-size 64 must be a multiple of the 3 processes"),
        (["--temperature", "nan"], ON, "--temperature must be a finite number"),
        (["--temperature", "1e-30"], ON, "is below 1e-5, where vLLM samples greedily"),
        (["--seed", "-1"], ON, "--seed must be >= 0"),
        (["--seed", "100000000000"], ON, "--seed must be below 9223372036"),
        (["--steps", "1000000000"], ON, "--steps must be at most 100,000,000"),
        (["--thinking", "--prompt-format", "plain"], ON, "--thinking opens a <think> block"),
        (["--locate-divergence"], ON, "--locate-divergence is for --no-assert-bitwise runs"),
        (["--resume", "a_file"], ON, "--resume a_file: a file, not a checkpoint directory"),
        # tyro's boxed parse errors, each made one line, with the flags the box names
        (["--step", "3"], ON, "error: Unrecognized options: --step, 3 (see --prompts-per-step INT, --sft-steps"),
        (["--temperature", "x"], ON, "could not convert string to float: 'x' (see --temperature FLOAT)"),
        (["--prompt-format", "xml"], ON, "invalid choice 'xml' for argument '--prompt-format'. Expected one of"),
        (["--steps"], ON, "Missing value for argument '--steps'. Expected 1 values. (see --help)"),
        # paths given empty, and values a user mistypes
        (["--model", ""], ON, "--model is empty: give a path"),
        (["--output-dir", " "], ON, "--output-dir is empty: give a path"),
        (["--resume", ""], ON, "--resume is empty: give a path"),
        (["--lr", "1e10"], ON, "--lr 1e+10: AdamW moves each weight by about lr a step; give a rate below 1"),
        (["--no-assert-bitwise", "false"], ON, "--no-assert-bitwise is a switch: --assert-bitwise or "
                                               "--no-assert-bitwise, no value"),
        (["--verbose", "1"], ON, "--verbose is a switch: --verbose or --no-verbose, no value"),
        (["--samples-per-prompt", "100000"], ON, "--prompts-per-step x --samples-per-prompt = 3,200,000 samples a "
                                                 "step; give at most 65,536"),
    ]
    if os.geteuid() == 0:  # root writes anywhere
        cases = [c for c in cases if not any(str(read_only) in f for f in c[0])]
    for flags, env, message in cases:
        assert message in one_line_error(run_script(*flags, env_update=env, cwd=tmp_path)), flags
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "read_only"]  # nothing written


def test_flags_are_checked_before_torch_loads(tmp_path):
    """--help and a bad flag answer before the heavy imports (torch alone takes seconds); under torchrun a
    bad flag is reported once, by rank 0, and every rank exits 2."""
    for flags in (["--help"], ["--steps", "0"]):
        result = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "simple_rl.py"), *flags],
                                capture_output=True, text=True, cwd=tmp_path, env={**os.environ, **ON}, timeout=60)
        imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if "import time:" in line}
        assert "torch" not in imported and "tyro" in imported, flags
    assert "--top-k INT" in run_script("--help", cwd=tmp_path).stdout
    for rank, lines in (("0", 1), ("1", 0)):
        for flags in (["--steps", "0"], ["--no-such-flag"]):
            result = run_script(*flags, env_update=ON | {"WORLD_SIZE": "2", "RANK": rank}, cwd=tmp_path)
            assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == lines, result.stderr


@pytest.mark.parametrize("flags, message", [(["--steps", "0"], "--steps must be at least 1"),
                                           (["--stesp", "3"], "Unrecognized options: --stesp, 3 (see ")])
def test_under_torchrun_a_bad_flag_is_the_root_cause_torchrun_names(tmp_path, flags, message):
    """torchrun prints its own banner, traceback and failure summary, which no script can suppress; each rank
    records the script's line in torchrun's error file, so the summary's root cause ends with it."""
    # --log-dir: torchrun's own log folders go there, not to a /tmp/torchelastic_* left behind
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--log-dir", str(tmp_path / "torchrun"), str(REPO / "simple_rl.py"), *flags],
                            capture_output=True, text=True,
                            cwd=tmp_path, env=os.environ | ON, timeout=300)
    lines = [line for line in result.stderr.splitlines() if line.strip(" =")]
    print(f"\n[torchrun, a bad flag] {len(result.stderr.splitlines())} lines on stderr")
    assert result.returncode != 0 and message in lines[-1]
    assert result.stderr.count(f"error: {message}") == 1  # rank 0's own line, once
    assert "simple_rl.py\", line" not in result.stderr  # each rank's record: the line, not the script's stack


def test_help_groups_the_flags_and_keeps_their_names(tmp_path):
    result = run_script("--help", env_update={"COLUMNS": "80"}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert max(len(line) for line in result.stdout.splitlines()) <= 80  # wrapped, the commands included
    assert "torchrun --nproc-per-node N simple_rl.py" in result.stdout and "(default: None)" not in result.stdout
    assert "<output-dir>/<run-name>" in result.stdout and "output_dir" not in result.stdout
    text = " ".join(result.stdout.split())
    assert "Set VLLM_BATCH_INVARIANT=1 in the environment" in text and "\\n" not in text and "{None}" not in text
    titles = ["data", "sampling", "grpo-loss", "optimizer", "warm-start", "parity", "engine-and-memory",
              "evaluation-and-checkpoints"]
    positions = [text.index(f"{title} options") for title in titles]
    assert positions == sorted(positions)
    assert text.index("--temperature FLOAT") > text.index("sampling options")
    assert text.index("--kl-coef FLOAT") > text.index("grpo-loss options")
    args = plumbing.parse_command_line(simple_rl.Args, simple_rl.__doc__, ["--temperature", "0.7", "--no-assert-bitwise", "--keep-last", "5"])
    assert args == make_args(temperature=0.7, assert_bitwise=False, keep_last=5)
    assert plumbing.parse_command_line(simple_rl.Args, simple_rl.__doc__, []) == simple_rl.Args()


def test_a_run_name_in_use_is_refused(tmp_path):
    (tmp_path / "runs" / "taken").mkdir(parents=True)
    error = one_line_error(run_script("--run-name", "taken", env_update=ON, cwd=tmp_path))
    assert "--run-name taken: runs/taken exists already" in error


def test_bad_files_give_one_line_errors(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", gsm8k_rows("test", 3))
    missing_field = write_jsonl(tmp_path / "a.jsonl", [{"question": "q", "answer": "#### 1"}, {"question": "q"}])
    no_number = write_jsonl(tmp_path / "b.jsonl", [{"question": "q", "answer": "none"}])
    no_hashes = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "so 3 + 4 = 7"}])
    words = write_jsonl(tmp_path / "e.jsonl", [{"question": "q", "answer": "#### five"}])
    (tmp_path / "c.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{not json\n')
    (tmp_path / "null.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n\nnull\n')  # line 2 blank
    no_question = write_jsonl(tmp_path / "f.jsonl", [{"question": " ", "answer": "#### 1"}])
    (tmp_path / "utf16.jsonl").write_text(good.read_text(), encoding="utf-16")
    (tmp_path / "bom.jsonl").write_text(good.read_text(), encoding="utf-8-sig")  # as Windows editors save
    cases = [(tmp_path / "nope.jsonl", "no such file"), (tmp_path, "a directory"),
             (missing_field, "line 2: need a JSON object"), (no_number, "line 1: the answer holds no '#### N'"),
             (no_hashes, "line 1: the answer holds no '#### N'"), (words, "with N a number"),
             (tmp_path / "null.jsonl", "line 3: need a JSON object"), (no_question, "line 1: the question is empty"),
             (tmp_path / "c.jsonl", "line 2: not valid JSON"), (tmp_path / "utf16.jsonl", "not UTF-8 text")]
    # bytes that are no UTF-8 in the third line: the line is named
    lines = good.read_bytes().splitlines()
    (tmp_path / "latin1.jsonl").write_bytes(b"\n".join(lines[:2] + ["\u00e9".encode("latin-1") + lines[2]]))
    cases.append((tmp_path / "latin1.jsonl", "line 3: not UTF-8 text"))

    def read(path):
        return plumbing.read_gsm8k_file(str(path), simple_rl.ANSWER_AFTER_HASHES, "--dataset")
    for path, message in cases:
        with pytest.raises(plumbing.UsageError, match=message) as error:
            read(path)
        assert str(path) in str(error.value) and str(error.value).startswith("--dataset ")
    assert read(good) == read(tmp_path / "bom.jsonl")
    assert len(read(good)) == 3
    import pyarrow as pa  # the hub's own format for GSM8K: read through `datasets`
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(gsm8k_rows("test", 3)), tmp_path / "good.parquet")
    assert read(tmp_path / "good.parquet") == read(good)
    import gzip
    (tmp_path / "good.jsonl.gz").write_bytes(gzip.compress(good.read_bytes()))
    with pytest.raises(plumbing.UsageError, match="a gzip file; decompress it"):
        read(tmp_path / "good.jsonl.gz")
    err = one_line_error(run_script("--model", str(tmp_path / "no_model"), "--no-assert-bitwise",
                                    "--eval-every", "0", cwd=tmp_path))
    assert "--model" in err


def test_files_are_checked_before_torch_loads(tmp_path):
    """A bad file answers as a bad flag does, before torch (seconds) loads: config.json, the weights' headers
    (a sharded checkpoint missing a shard names the file), the datasets, a run name too long for a folder;
    a hub cache's folder of a model stands for its snapshot; switches given a value say so."""
    model_dir = write_gsm8k_model(tmp_path / "model")
    bad_heads = tmp_path / "heads"
    shutil.copytree(model_dir, bad_heads)
    config = json.loads((model_dir / "config.json").read_text())
    (bad_heads / "config.json").write_text(json.dumps(config | {"num_attention_heads": 4, "num_key_value_heads": 3}))
    sharded = tmp_path / "sharded"
    shutil.copytree(model_dir, sharded)
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model.safetensors",
                                           "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    cache = tmp_path / "models--Org--Name"  # as huggingface_hub lays a download out
    shutil.copytree(model_dir, cache / "snapshots" / "abc123")
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("abc123")
    data = ["--dataset", str(gsm8k_jsonl("train")), "--eval-dataset", str(gsm8k_jsonl("test"))]
    cases = [
        (["--model", str(bad_heads), *data], "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
        (["--model", str(sharded), *data], "model-00002-of-00002.safetensors is missing (model.safetensors"),
        (["--model", str(model_dir), "--dataset", str(tmp_path / "nope.jsonl"), "--eval-every", "0"],
         f"--dataset {tmp_path / 'nope.jsonl'}: no such file"),
        (["--model", str(model_dir), *data, "--run-name", "r" * 300], "--run-name: 300 bytes; give at most 200"),
        (["--model", str(model_dir), *data, "--prompts-per-step", "1000"], "more than the train set's 400"),
        (["--thinking", "true"], "Unrecognized options: true (see --help); --thinking is a switch: --thinking "
                                 "or --no-thinking, no value"),
    ]
    for flags, message in cases:
        result = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "simple_rl.py"), *flags],
                                capture_output=True, text=True, cwd=tmp_path, env={**os.environ, **ON}, timeout=120)
        imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if "import time:" in line}
        errors = [line for line in result.stderr.splitlines() if "import time:" not in line]
        assert result.returncode == 2 and len(errors) == 1 and message in errors[0], (flags, errors)
        assert "torch" not in imported, flags
    assert plumbing.resolve_model_dir(str(cache)) == cache / "snapshots" / "abc123"
    hub = make_args(dataset="openai/gsm8k", eval_dataset="openai/gsm8k", run_name="hub")  # the default's id
    assert plumbing.check_args(hub, 1).data == make_args().data
    local = make_args(dataset=str(gsm8k_jsonl("train")), eval_dataset="openai/gsm8k", run_name="local")
    assert plumbing.check_args(local, 1).data == make_args(dataset=str(gsm8k_jsonl("train"))).data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads", "model", "models--Org--Name", "sharded"]


def test_help_read_in_part_leaves_quietly(tmp_path):
    """`--help | head -3`: the reader leaves early; no BrokenPipeError traceback."""
    result = subprocess.run(f"{sys.executable} {REPO / 'simple_rl.py'} --help | head -3", shell=True,
                            capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert len(result.stdout.splitlines()) == 3 and result.stderr == "", result.stderr


def test_a_checkpoint_of_another_model_is_refused_before_anything_loads(tmp_path):
    """--resume of a checkpoint whose training state is another model's: one line naming a parameter."""
    checkpoints, _, _ = cpu_checkpoints(tmp_path, write_gsm8k_model(tmp_path / "model"))
    checkpoints.save(1, {"tokens_checked": 0, "mismatched_tokens": 0})
    checkpoints.wait()
    checkpoint = tmp_path / "checkpoints" / "r" / "step_000001"
    config = plumbing.read_config(checkpoint)
    other = simple_rl.model_shape(simple_rl.model_args_from_hf_config(config | {"num_hidden_layers": 3}))
    with pytest.raises(plumbing.UsageError, match=r"it is another model's: \d+ parameter\(s\) differ from "
                                                  r"config.json's, layers\.2\."):
        plumbing.check_training_state(checkpoint, other)


def local_inputs(model_dir) -> list[str]:
    return ["--model", str(model_dir), "--dataset", str(gsm8k_jsonl("train")),
            "--eval-dataset", str(gsm8k_jsonl("test"))]


def test_inputs_that_need_the_tokenizer_or_the_data_are_refused_before_torch(tmp_path):
    """Read without torch (`tokenizers`, the jsonl files, the training state's file names): a tokenizer with
    no chat template where the flags need one, or more tokens than the model's vocabulary; more warm-start
    questions a step than the train set holds; an eval file that does not exist though evaluation is off;
    a resumed training state without DCP's files. One line each, exit status 2, in about a second."""
    model = write_gsm8k_model(tmp_path / "model")
    big = tmp_path / "big_vocabulary"  # the model, with another model's larger tokenizer
    shutil.copytree(model, big)
    shutil.copy(write_gsm8k_model(tmp_path / "other", vocab_size=2048) / "tokenizer.json", big)
    state = tmp_path / "ckpt" / "training_state"
    shutil.copytree(model, state.parent)
    state.mkdir()
    good = {"args": dataclasses.asdict(make_args(model=str(state.parent), dataset=str(gsm8k_jsonl("train")),
                                                 eval_every=0, run_name="r")), "step": 1}
    (state / "run.json").write_text(json.dumps(good))
    (state / "parity.json").write_text("{}")
    (state / ".metadata").write_bytes(b"")
    local = ["--dataset", str(gsm8k_jsonl("train")), "--eval-dataset", str(gsm8k_jsonl("test"))]
    two = tmp_path / "two_copies"  # a checkpoint's weights, and a copy of them beside
    shutil.copytree(model, two)
    shutil.copy(two / "model.safetensors", two / "model-copy.safetensors")
    cases = [(["--model", str(two), *local], "model.embed_tokens.weight is in model-copy.safetensors and "
              "model.safetensors; keep one checkpoint's files in the directory"),
             (["--model", str(model), *local, "--prompt-format", "chat"], "--prompt-format chat: --model "
              f"{model}'s tokenizer has no chat template; use plain or auto"),
             (["--model", str(model), *local, "--thinking"], "--thinking: --model "
              f"{model}'s tokenizer has no chat template; use --no-thinking"),
             (["--model", str(big), *local], "for a vocabulary of 1024 (another model's?)"),
             (["--model", str(model), *local, "--sft-steps", "2", "--sft-batch-size", "1000"],
              "--sft-batch-size 1000 is more than the train set's 400 questions"),
             (["--model", str(model), "--dataset", str(gsm8k_jsonl("train")), "--eval-dataset", "nope.jsonl",
               "--eval-every", "0"], "--eval-dataset nope.jsonl: no such file"),
             (["--resume", str(state.parent), "--steps", "5"], "its training state is broken (its .distcp files "
              "missing); copy it again whole, or resume from an earlier checkpoint")]
    for flags, message in cases:
        start = time.perf_counter()
        result = run_script(*flags, env_update=ON, cwd=tmp_path)
        assert message in one_line_error(result), flags
        assert time.perf_counter() - start < 10, flags  # no torch: well under torch's import
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big_vocabulary", "ckpt", "model", "other", "two_copies"]


def test_the_hub_out_of_reach_is_one_line_at_once(tmp_path):
    """The hub's GSM8K or a hub model id with no hub in reach (here an endpoint no name server knows) and
    nothing cached: one line at once, not half a minute of `datasets`' retries."""
    model = write_gsm8k_model(tmp_path / "model")
    env = ON | {"HF_ENDPOINT": "https://hub.invalid", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": ""}
    for flags, message in [(["--model", str(model), "--eval-every", "0"], "cannot load openai/gsm8k from the hub"),
                           (["--model", "Org/Model"], "--model Org/Model: cannot download it from the hub")]:
        start = time.perf_counter()
        error = one_line_error(run_script(*flags, env_update=env, cwd=tmp_path))
        assert error == f"error: {message} (the hub is out of reach, and it is not in the local cache)" + (
            ": pass --dataset and --eval-dataset with local jsonl files" if "gsm8k" in message else
            "; pass a local checkpoint directory"), error
        assert time.perf_counter() - start < 10  # datasets' retries took 31 s
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_missing_gpu_is_reported_after_the_inputs_are_checked(tmp_path):
    """Good inputs get as far as the GPU check, and a run shorter than the default warm-up is fine."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = run_script(*local_inputs(write_gsm8k_model(tmp_path / "model")), "--steps", "4", env_update=ON,
                        cwd=tmp_path)
    assert "no CUDA GPU" in one_line_error(result)
    assert "--warmup-steps 10 is more than --steps 4: the learning rate warms up over all 4 steps" in result.stdout
    assert not (tmp_path / "runs").exists() and not (tmp_path / "checkpoints").exists()


def test_values_the_model_or_data_cannot_take_are_refused(tmp_path):
    """What the flags alone cannot tell: a top-k past the vocabulary, more questions a step than the train set
    holds. One line each, exit status 2, nothing written."""
    inputs = local_inputs(write_gsm8k_model(tmp_path / "model"))
    for flags, message in ((["--top-k", "1000000"], "--top-k 1000000 is more than the vocabulary's"),
                           (["--prompts-per-step", "1000"], "is more than the train set's 400 questions")):
        assert message in one_line_error(run_script(*inputs, *flags, env_update=ON, cwd=tmp_path)), flags
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_broken_checkpoint_to_resume_is_one_line(tmp_path):
    """--resume checks the checkpoint before anything loads: run.json's JSON and its values, the config and
    the weights; each problem in one line that names the checkpoint and the file, exit status 2."""
    from dataclasses import asdict

    ckpt = write_gsm8k_model(tmp_path / "ckpt")
    run_json = ckpt / "training_state" / "run.json"
    run_json.parent.mkdir()
    good = {"args": asdict(make_args(model=str(ckpt), eval_every=0, run_name="r")), "step": 1}
    wrong_flag = json.loads(json.dumps(good))
    wrong_flag["args"]["optimizer"]["steps"] = "200"
    cases = [('{"args": {', "is broken"), ("", "is broken"), (json.dumps(dict(good, step="1")), "wrong value: step '1'"),
             (json.dumps(wrong_flag), "wrong value: the type of --steps")]
    for text, message in cases:
        run_json.write_text(text)
        error = one_line_error(run_script("--resume", str(ckpt), env_update=ON, cwd=tmp_path))
        assert message in error and str(run_json) in error, (text, error)
    run_json.write_text(json.dumps(good), encoding="utf-16")
    assert "is broken" in one_line_error(run_script("--resume", str(ckpt), env_update=ON, cwd=tmp_path))
    run_json.write_text(json.dumps(good))
    for f, message in (("model.safetensors", f"--resume {ckpt}: no *.safetensors weights"),
                       ("config.json", "config.json: cannot read it")):
        (ckpt / f).rename(tmp_path / f)
        assert message in one_line_error(run_script("--resume", str(ckpt), "--steps", "3", env_update=ON,
                                                    cwd=tmp_path)), f
        (tmp_path / f).rename(ckpt / f)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_bad_checkpoints_stop_before_the_engine(tmp_path):
    """A truncated or incomplete safetensors file, fp32 weights, a malformed config.json, a checkpoint
    without tokenizer files, too few positions: one line naming the checkpoint, exit status 2, nothing
    written, before vLLM would start (so also on a machine without a GPU)."""
    from safetensors.torch import load_file, save_file

    good = write_gsm8k_model(tmp_path / "good")
    flags = local_inputs(good)[2:]

    def variant(name: str) -> Path:
        shutil.copytree(good, tmp_path / name)
        return tmp_path / name

    def edit_config(model_dir: Path, text: str) -> Path:
        (model_dir / "config.json").write_text(text)
        return model_dir

    cases = {}
    truncated = cases["is not a whole safetensors file"] = variant("truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    incomplete = cases["weights do not match config.json: missing model.layers.1.mlp.up_proj.weight"] = (
        variant("incomplete"))
    weights = load_file(incomplete / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, incomplete / "model.safetensors")
    dangling = cases[f"model.safetensors links to {tmp_path / 'blobs' / '0123abc'}, which does not exist; copy "
                     "the model with its files (cp -L)"] = variant("dangling")  # a hub snapshot without blobs
    (dangling / "model.safetensors").unlink()
    (dangling / "model.safetensors").symlink_to(tmp_path / "blobs" / "0123abc")
    fp32 = cases["the weights are F32; both sides run bf16 weights"] = variant("fp32")
    save_file({k: v.float() for k, v in load_file(fp32 / "model.safetensors").items()}, fp32 / "model.safetensors")
    config = json.loads((good / "config.json").read_text())
    cases["config.json: no hidden_size; this trainer needs a Hugging Face Qwen3 or Qwen3-MoE config"] = edit_config(
        variant("no_hidden"), json.dumps({k: v for k, v in config.items() if k != "hidden_size"}))
    cases["config.json: a JSON object of the model's settings was expected"] = edit_config(variant("list"), "[]")
    cases["config.json: not valid JSON"] = edit_config(variant("bad_json"), "{")
    cases["but the model has 512 positions"] = edit_config(variant("short"), json.dumps(config | {
        "max_position_embeddings": 512}))
    no_tokenizer = cases["no tokenizer files (tokenizer.json)"] = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(good / f, no_tokenizer / f)
    cases["head_dim is 64; vLLM's attention is bitwise the trainer's only at head_dim 128 or 256"] = (
        write_gsm8k_model(tmp_path / "head_dim_64", head_dim=64))
    with ThreadPoolExecutor(3) as pool:  # each run loads torch and transformers: a few seconds
        results = pool.map(lambda m: run_script("--model", str(m), *flags, env_update=ON, cwd=tmp_path), cases.values())
    for (message, model_dir), result in zip(cases.items(), results):
        error = one_line_error(result)
        assert message in error and str(model_dir) in error, error
    assert not (tmp_path / "runs").exists() and not (tmp_path / "checkpoints").exists()


def test_the_disk_is_checked_for_the_checkpoints_up_front(tmp_path, monkeypatch, capsys):
    """A save writes the new checkpoint before it prunes the oldest: room for --keep-last + 1 is needed. Less
    than one checkpoint is refused, less than all of them warned of, both in units that show the sizes."""
    model_args = simple_rl.model_args_from_hf_config(plumbing.read_config(write_gsm8k_model(tmp_path / "m")))
    with torch.device("meta"):
        one = 16 * sum(p.numel() for p in simple_rl.Qwen3(model_args).parameters())
    args = make_args(output_dir=str(tmp_path / "out"), steps=10, save_every=2, keep_last=3)
    for free, outcome in ((one - 1, "refused"), (4 * one - 1, "warned"), (4 * one, "")):
        monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12, free))
        if outcome == "refused":
            with pytest.raises(plumbing.UsageError, match=r"MiB free, but a checkpoint of this model takes about"):
                plumbing.check_disk(args, one // 16)
            continue
        plumbing.check_disk(args, one // 16)
        out = capsys.readouterr().out
        assert ("a later save will fail" in out) == (outcome == "warned") and "0.0 GiB" not in out, free


def test_a_full_disk_at_a_save_is_one_line_and_keeps_the_run(tmp_path, monkeypatch):
    """The second of three saves hits a full disk: one line naming the checkpoint, the free space against its
    size and the last whole checkpoint; no partial or empty folder; TensorBoard and parity.json hold the steps
    done. A first save that fails leaves no run folder, and its line stands though TensorBoard fails too."""
    import errno

    from torch.utils.tensorboard import SummaryWriter

    model_dir = write_gsm8k_model(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    save_file, saves = safetensors.torch.save_file, []

    def full_at(n):
        def save(*args, **kwargs):
            saves.append(1)
            if len(saves) == n:
                raise OSError(errno.ENOSPC, "No space left on device")
            return save_file(*args, **kwargs)
        return save
    monkeypatch.setattr(safetensors.torch, "save_file", full_at(2))
    args = small_run(model_dir, run_name="full", steps=3, save_every=1, keep_last=0, eval_every=0,
                     assert_bitwise=False)
    with pytest.raises(plumbing.CheckpointError) as error:
        simple_rl.main(args, device="cpu", engine_class=TrainerAsSampler)
    message = str(error.value)
    assert message.startswith("checkpoint checkpoints/full/step_000002 not written (No space left on device): ")
    assert message.endswith("the last whole checkpoint is checkpoints/full/step_000001") and "\n" not in message
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "full").iterdir()) == ["step_000001"]
    record = json.loads((tmp_path / "runs" / "full" / "parity.json").read_text())
    assert record["tokens_checked"] > 0 and scalar_series(tmp_path / "runs" / "full")["train/loss"][-1][0] == 1
    saves.clear()
    monkeypatch.setattr(safetensors.torch, "save_file", full_at(1))
    close = SummaryWriter.close

    def full_close(self):  # TensorBoard's last flush on a full disk (measured on a tmpfs): not over the line
        close(self)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(SummaryWriter, "close", full_close)
    with pytest.raises(plumbing.CheckpointError, match="the last whole checkpoint is none"):
        simple_rl.main(dataclasses.replace(args, run=dataclasses.replace(args.run, run_name="first")),
                       device="cpu", engine_class=TrainerAsSampler)
    assert not (tmp_path / "checkpoints" / "first").exists()


def test_head_sizes_whose_attention_vllm_computes_otherwise_are_refused():
    """FlashAttention 3 decodes with other key tiles than it prefills at head_dim 64 (measured on the GPU
    in tests/test_gpu_configs.py); a sequence within one 128-key tile is safe."""
    for d in plumbing.BITWISE_HEAD_DIMS:
        plumbing.check_bitwise_head_dim(d, 1024, Path("model"))
    for d in (16, 64, 96, 192):
        with pytest.raises(plumbing.UsageError, match=f"head_dim is {d}; "):
            plumbing.check_bitwise_head_dim(d, 1024, Path("model"))
    plumbing.check_bitwise_head_dim(64, 128, Path("model"))
    with pytest.raises(plumbing.UsageError, match=r"--max-new-tokens = 129\)"):
        plumbing.check_bitwise_head_dim(64, 129, Path("model"))


# The pieces of simple_rl.py that call into plumbing.py: the loop, main(), the error boundary, and the model's
# shape for the checks. Every other piece lifts out with what it names in simple_rl.py (and the kernels' file).
CALLS_PLUMBING = {"grpo_step", "grpo", "warm_start", "on_mismatch", "main", "run_as_script", "model_shape",
                  "reduce_gradients_after"}
FLAG_MARKERS = {"FIXED", "default_is"}  # plumbing's annotations of the flags: tyro's, no call at run time


def module_names(tree: ast.Module) -> dict:
    """Module-level name -> line of its definition (or import)."""
    defined = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign):
            names = [node.target.id]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [(alias.asname or alias.name).split(".")[0] for alias in node.names]
        else:
            names = []
        for name in names:
            defined.setdefault(name, node.lineno)
    return defined


def test_the_story_and_its_plumbing_import_one_way():
    """plumbing.py never imports simple_rl.py (run as a script, simple_rl.py is `__main__`: a reverse import
    would load a second copy) and imports no torch at its top (the flags answer before torch loads). In
    simple_rl.py only the loop, main(), the error boundary and the model's shape call into plumbing.py; every
    module-level name a definition uses is defined above it. simple_rl.py takes at most 1,250 lines, grpo() at
    most 45; no line of either file is over 110 characters."""
    plumbing_tree = ast.parse((REPO / "plumbing.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(plumbing_tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(plumbing_tree)
                 if isinstance(node, ast.ImportFrom)}
    assert "simple_rl" not in imported
    assert not {"torch", "vllm", "torchtitan", "transformers"} & set(module_names(plumbing_tree))
    text = (REPO / "simple_rl.py").read_text()
    lines, tree = text.splitlines(), ast.parse(text)
    from_plumbing = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                     and node.module == "plumbing" for alias in node.names} - FLAG_MARKERS
    callers = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
               for inner in ast.walk(node) if isinstance(inner, ast.Name) and inner.id in from_plumbing}
    assert callers <= CALLS_PLUMBING, callers - CALLS_PLUMBING
    defined = module_names(tree)
    late = [f"{node.name} (line {node.lineno}) uses {inner.id} (line {defined[inner.id]})"
            for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
            for inner in ast.walk(node)
            if isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Load) and defined.get(inner.id, 0) > node.lineno]
    assert not late, late
    grpo = next(node for node in tree.body if getattr(node, "name", None) == "grpo")
    assert grpo.end_lineno - grpo.lineno + 1 <= 45
    assert len(lines) <= 1250, f"simple_rl.py has {len(lines)} lines"
    for path in ("simple_rl.py", "plumbing.py"):
        assert [n for n, line in enumerate((REPO / path).read_text().splitlines(), 1) if len(line) > 110] == []


def test_every_name_a_file_uses_is_defined_in_it():
    """The GPU tests (and the GPU paths of the modules) run only on a GPU: a name a file uses but never
    imports, defines or binds anywhere (a NameError there, on scarce device time) is caught here."""
    import builtins
    for path in [*sorted((REPO / "tests").glob("*.py")), *sorted(REPO.glob("*.py"))]:
        tree, bound = ast.parse(path.read_text()), set(dir(builtins)) | {"__file__"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                bound.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.ExceptHandler)):
                bound.add(node.name)
            elif isinstance(node, ast.arg):
                bound.add(node.arg)
            elif isinstance(node, ast.alias):
                bound.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                bound.update(node.names)
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
        assert used <= bound, f"{path.name}: {sorted(used - bound)}"


# --- runs of main() with a CPU stand-in for vLLM ---------------------------------------------------


class TrainerAsSampler(simple_rl.VLLMEngine):
    """Test double for vLLM, which cannot run on a CPU: samples from the checkpoint with this project's own
    Qwen3 (CPU reference path) and returns its logprobs of the sampled tokens. It holds the script to vLLM's
    sleep-mode protocol: generate only when awake, push only into woken weights (their contents lost while
    asleep, as vLLM's level-2 sleep loses them); without sleep mode, as VLLMEngine, it never sleeps. The weight
    sync and check are VLLMEngine's own."""

    def __init__(self, model_dir, gpu_memory_utilization, max_model_len, seed, cuda_graphs,
                 return_routed_experts=False, sleep_mode=True, **vllm_args):
        self.model = simple_rl.load_qwen3(model_dir, "cpu")
        self.vllm_args, self.return_routed_experts, self.routed_experts = vllm_args, return_routed_experts, None
        self.asleep, self.calls, self.sleep_mode = set(), [], sleep_mode
        self.served_checksum = self.weights_checksum()

    def sleep(self):
        if not self.sleep_mode:
            return
        assert not self.asleep, "sleep() while already asleep"
        self.asleep = {"weights", "kv_cache"}
        self.calls.append("sleep")
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float("nan"))  # level 2 discards the weights

    def wake_up(self, tags):
        if not self.sleep_mode:
            return
        assert set(tags) <= self.asleep, f"wake_up({tags}) of tags not asleep"
        self.asleep -= set(tags)
        self.calls.append(f"wake_up {','.join(tags)}")

    @torch.no_grad()
    def generate(self, prompts, max_tokens, temperature, seeds, stop_token_ids=(), ignore_eos=False, top_k=0,
                 top_p=1.0):
        assert not self.asleep, "generate() while asleep"
        self.calls.append("generate")
        self.stop_token_ids = list(stop_token_ids)
        completions, logprobs = [], []
        for prompt, n, seed in zip(prompts, max_tokens, seeds):
            g = torch.Generator().manual_seed(seed)
            completion = []
            while len(completion) < n and not (completion and completion[-1] in stop_token_ids):
                batch = simple_rl.pack_sequences([prompt + completion], [[]], "cpu")
                hidden = self.model.hidden_states(batch.tokens, batch.positions, batch.spans)
                logits = hidden[-1:].float() @ self.model.output_weight.float().t()
                if not temperature:
                    completion.append(int(logits.argmax()))
                    continue
                logits = truncated(logits / temperature, top_k, top_p)
                completion.append(int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=g)))
            completions.append(completion)
            batch = simple_rl.pack_sequences([prompt], [completion], "cpu")
            # vLLM's processed logprobs: of the distribution sampled from (a greedy request's at T = 1).
            logprobs.append(self.model(batch, temperature or 1.0, top_k if temperature else 0,
                                       top_p if temperature else 1.0).logprobs)
        if self.return_routed_experts:  # as vLLM returns them: each token's experts but the last's
            self.routed_experts = []
            for prompt, completion in zip(prompts, completions):
                self.model(simple_rl.pack_sequences([prompt], [completion], "cpu"))
                self.routed_experts.append(torch.stack([layer.moe.chosen[:-1] for layer in self.model.layers], 1))
        return completions, logprobs

    def push_weights(self, model):
        assert "weights" not in self.asleep, "push into sleeping weights"
        self.calls.append("push")
        # What vLLM's load_weights receives: Hugging Face names, weights gathered from every rank.
        hf = dict(simple_rl.hf_weights(model))
        self.model.load_state_dict(simple_rl.from_hf_state_dict(hf, self.model.args))

    def weights_checksum(self):
        return simple_rl.trainer_checksum(self.model, simple_rl.World())


def recording(engines: list):
    def engine_class(*a, **kw):
        engines.append(TrainerAsSampler(*a, **kw))
        return engines[-1]
    return engine_class


def small_run(model_dir, **flags):
    """A run of a few questions x 2 samples x 6 tokens on the shipped GSM8K sample."""
    return make_args(**dict(model=str(model_dir), dataset=str(gsm8k_jsonl("train")),
                            eval_dataset=str(gsm8k_jsonl("test")), prompts_per_step=2, samples_per_prompt=2,
                            max_new_tokens=6, max_prompt_tokens=400, max_tokens_per_microbatch=500) | flags)


def fresh_python(code: str, cwd: Path, *paths: Path) -> subprocess.CompletedProcess:
    """`code` run by a Python of its own in `cwd`, its stderr its own, as the script's is (not a torchrun
    rank); `paths`, then the repository and tests/, importable."""
    path = [str(p) for p in (*paths, REPO, REPO / "tests")]
    return subprocess.run([sys.executable, "-c", f"import sys\nsys.path[:0] = {path!r}\n{code}"],
                          capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")})


@pytest.mark.parametrize("verbose", [False, True])
def test_others_logs_go_to_the_run_log_not_the_terminal(tmp_path, verbose):
    """The script's run: from the engine's start, what others write to stderr, from Python (a warning) or C++
    (fd 2 itself), goes to runs/<run>/log.txt, each line timestamped; the terminal keeps the script's own
    lines. --verbose shows them live too."""
    model_dir = write_gsm8k_model(tmp_path / "model")
    code = f"""
import os, warnings
import simple_rl, test_rl
class Noisy(test_rl.TrainerAsSampler):
    def __init__(self, *args, **kwargs):
        warnings.warn("a library's warning")
        os.write(2, b"a C++ warning\\n")
        super().__init__(*args, **kwargs)
args = test_rl.small_run({str(model_dir)!r}, run_name="quiet", steps=2, eval_every=0, assert_bitwise=False,
                         verbose={verbose})
simple_rl.main(args, device="cpu", engine_class=Noisy, quiet=True)
"""
    result = fresh_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "step 1: reward" in result.stdout
    log = (tmp_path / "runs" / "quiet" / "log.txt").read_text()
    for noise in ("a library's warning", "a C++ warning"):
        assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d .*" + re.escape(noise), log, re.M), log
        assert (noise in result.stderr) == verbose and noise not in result.stdout


def test_an_abort_mid_run_leaves_its_reason_in_the_log_and_its_stacks_on_the_terminal(tmp_path):
    """A C++ abort mid-run (NCCL's watchdog, an exception in a C++ thread) writes its reason to fd 2, then
    SIGABRT ends the process at once: the reason still reaches runs/<run>/log.txt (the copier is a process of
    its own), and the terminal shows where Python was (faulthandler), not nothing."""
    model_dir = write_gsm8k_model(tmp_path / "model")
    code = f"""
import os
import simple_rl, test_rl
class Aborting(test_rl.TrainerAsSampler):
    def generate(self, *args, **kwargs):
        os.write(2, b"terminate called after throwing: a C++ reason\\n")
        os.abort()
args = test_rl.small_run({str(model_dir)!r}, run_name="aborted", steps=2, eval_every=0, assert_bitwise=False)
simple_rl.run_as_script(args, device="cpu", engine_class=Aborting)
"""
    result = fresh_python(code, tmp_path)
    assert result.returncode == -signal.SIGABRT, result.stderr
    assert "Fatal Python error: Aborted" in result.stderr and "in generate" in result.stderr, result.stderr
    assert "a C++ reason" in (tmp_path / "runs" / "aborted" / "log.txt").read_text()


def test_the_log_copier_runs_the_code_imported_even_if_the_file_changed_since(tmp_path):
    """The copier (a process of its own) is given the compiled code of the imported script: a simple_rl.py
    edited or checked out after the run started must not take its log, nor the run's stderr, with it."""
    script = tmp_path / "simple_rl.py"
    shutil.copy(REPO / "simple_rl.py", script)
    code = f"""
import os, pathlib
import plumbing, simple_rl, sys
script = pathlib.Path({str(script)!r})
script.write_text("# a line added after the import\\n" + script.read_text())
plumbing.log_to_file("edited", False, simple_rl.World())
print("a warning after the edit", file=sys.stderr)
os.write(2, b"a C++ line after the edit\\n")
"""
    result = fresh_python(code, tmp_path, tmp_path)  # its copy of simple_rl.py first
    assert result.returncode == 0 and result.stderr == "", result.stderr
    log = (tmp_path / "runs" / "edited" / "log.txt").read_text()
    assert "a warning after the edit" in log and "a C++ line after the edit" in log, log


def test_with_vllm_awake_beside_the_trainer_the_run_is_the_same(tmp_path, monkeypatch):
    """Where the plan fits vLLM's share beside the trainer (`Fit.vllm_awake`), the engine runs without sleep
    mode: it neither sleeps nor wakes, each push overwrites the weights it serves, and the run is the sleeping
    engine's, scalar for scalar."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model_dir = write_gsm8k_model(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    runs, engines = {}, []
    for awake in (False, True):
        def engine_class(*a, **kw):
            assert kw["sleep_mode"] is True  # main's: the CPU is not planned, so vLLM's protocol is kept
            engines.append(TrainerAsSampler(*a, **kw | {"sleep_mode": not awake}))
            return engines[-1]
        args = small_run(model_dir, run_name=f"awake_{awake}", steps=2, lr=1e-3, sft_steps=1, sft_batch_size=2,
                         eval_every=0, save_every=-1)
        runs[awake] = EventAccumulator(str(simple_rl.main(args, device="cpu", engine_class=engine_class))).Reload()
    assert "sleep" in engines[0].calls
    assert engines[1].calls == ["push", "generate", "push", "generate", "push"]  # warm start, two steps
    for tag in ("train/loss", "train/grad_norm", "reward/reward_mean", "parity/mismatched_tokens"):
        assert [e.value for e in runs[True].Scalars(tag)] == [e.value for e in runs[False].Scalars(tag)], tag


def test_main_runs_end_to_end_on_cpu(tmp_path, monkeypatch, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM

    model_dir = write_gsm8k_model(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    args = small_run(model_dir, run_name="smoke", steps=3, lr=1e-3, kl_coef=0.01, entropy_coef=0.01, sft_steps=1,
                     sft_batch_size=2, activation_checkpointing=True, eval_every=2, eval_samples=3,
                     assert_bitwise=False)
    engines = []
    run_dir = simple_rl.main(args, device="cpu", engine_class=recording(engines))
    assert "the learning rate warms up over all 3 steps" in capsys.readouterr().out  # default --warmup-steps 10

    # vLLM and the trainer take turns: sleep for the warm start and every train step; weights woken, pushed,
    # then the KV cache woken before anything is generated again.
    sync = ["wake_up weights", "push", "wake_up kv_cache"]
    step = ["generate", "sleep", *sync]
    evaluation = ["generate"]
    assert engines[0].calls == ["sleep", *sync, *evaluation, *step, *step, *evaluation, *step, *evaluation]

    events = EventAccumulator(str(run_dir)).Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ["train/loss", "train/pg_loss", "train/kl_div", "train/entropy", "reward/reward_mean",
                "reward/reward_std", "train/ratio_mean", "train/ratio_clipped_frac",
                "weight_delta/layer_00/magnitude", "weight_delta/embeddings/relative_change",
                "parity/mismatched_tokens", "parity/max_abs_logprob_diff", "parity/mean_abs_logprob_diff",
                "parity/vllm_kl", "perf/generate_tokens_per_s", "perf/train_tokens_per_s", "time/generate",
                "time/train", "time/push", "eval/accuracy"]:  # fmt: skip
        assert tag in tags, tag
    assert "train/kept_tokens" not in tags  # every token kept: no top-k, no top-p
    assert len(events.Scalars("train/loss")) == 3
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 2, 3]  # before, every 2, at the end
    assert all(e.value > 0 for e in events.Scalars("weight_delta/layer_01/magnitude"))
    assert "config" in "".join(events.Tags()["tensors"])

    ckpt = tmp_path / "checkpoints" / "smoke" / "step_000003"
    hf = AutoModelForCausalLM.from_pretrained(ckpt)
    trained = simple_rl.load_qwen3(ckpt, "cpu")
    assert torch.equal(hf.model.embed_tokens.weight, trained.tok_embeddings.weight)
    assert not torch.equal(trained.tok_embeddings.weight, simple_rl.load_qwen3(model_dir, "cpu").tok_embeddings.weight)
    # The parity record: in the checkpoint and, at the end, beside the run's TensorBoard events.
    record = json.loads((run_dir / "parity.json").read_text())
    assert record == json.loads((ckpt / "training_state" / "parity.json").read_text())
    assert record["tokens_checked"] == sum(e.value for e in events.Scalars("reward/completion_tokens_mean")) * 4
    assert record["stack"]["torch"] == torch.__version__ and record["sampling"]["temperature"] == 1.0
    assert "qkv rows=32" in record["kernels"]["matmul_tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)"]
    assert record["kernels"]["model_runner"] == ("V2" if record["kernels"]["batch_invariant"] else "V1")


def test_top_k_top_p_run_reports_the_kept_set(tmp_path, monkeypatch):
    """Qwen3's thinking-mode sampling (T 0.6, top-k 20, top-p 0.95) end to end with the test engine, which
    samples from the truncated distribution as vLLM does: every ratio 1, and the kept set logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)
    args = small_run(write_gsm8k_model(tmp_path / "model"), run_name="topk", steps=2, temperature=0.6, top_k=20,
                     top_p=0.95, eval_every=0, assert_bitwise=False)
    events = EventAccumulator(str(simple_rl.main(args, device="cpu", engine_class=TrainerAsSampler))).Reload()
    kept = [e.value for e in events.Scalars("train/kept_tokens")]
    assert all(1 <= k <= 20 for k in kept) and all(0 <= e.value < 1 for e in events.Scalars("train/cut_mass"))
    assert [e.value for e in events.Scalars("parity/mismatched_tokens")] == [0.0, 0.0]


def test_a_stale_or_unchanged_push_is_refused(tmp_path):
    """The served weights must equal the trainer's, and must have changed when the update changed any."""
    model_dir = write_gsm8k_model(tmp_path / "model")
    engine, model = TrainerAsSampler(model_dir, 0.5, 64, 0, True), simple_rl.load_qwen3(model_dir, "cpu")
    world = simple_rl.World()
    engine.check_weights(model, world)
    with pytest.raises(RuntimeError, match="vLLM does not serve the trainer's weights"):
        engine.check_weights(model, world, changed=True)  # nothing changed, yet an update said it did
    with torch.no_grad():
        model.layers[0].attention.wqkv.weight.add_(1.0)
    with pytest.raises(RuntimeError, match=r"-> (-?\d+), trainer (?!\1)-?\d+\)"):
        engine.check_weights(model, world)  # the trainer moved on; vLLM still serves the old weights
    engine.push_weights(model)
    engine.check_weights(model, world, changed=True)


def vllm_names(layers: int, moe: bool, tied: bool) -> list[str]:
    """vLLM 0.20's parameter names of a Qwen3 (Qwen3-MoE) it serves (`named_parameters()` of its model; a
    tied lm_head is the embedding's one parameter). The GPU tests compare the checksum with vLLM's own."""
    mlp = ["mlp.gate.weight", "mlp.experts.w13_weight", "mlp.experts.w2_weight"] if moe else [
        "mlp.gate_up_proj.weight", "mlp.down_proj.weight"]
    per_layer = ["input_layernorm.weight", "self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight", "post_attention_layernorm.weight", *mlp]
    return (["model.embed_tokens.weight"] + [f"model.layers.{i}.{n}" for i in range(layers) for n in per_layer]
            + ["model.norm.weight"] + ([] if tied else ["lm_head.weight"]))


@pytest.mark.parametrize("moe, tied", [(False, True), (False, False), (True, False)])
def test_the_checksum_sees_where_each_weight_lies(tmp_path, moe, tied):
    """The served weights' checksum (vLLM's names, mapped to the trainer's) equals the trainer's for the
    same tensors, and changes when two tensors' contents swap, a row moves, or two values in a row swap: a
    sum of bit patterns saw none of these."""
    from batch_invariant_backward import trainer_name, vllm_weights_checksum

    experts = dict(experts=4, experts_per_token=2, moe_intermediate=32) if moe else {}
    model = simple_rl.load_qwen3(write_gsm8k_model(tmp_path, tie=tied, **experts), "cpu")
    ours = dict(model.named_parameters())
    names = vllm_names(model.args.n_layers, moe, tied)
    assert sorted(map(trainer_name, names)) == sorted(ours)  # one served tensor per trainer tensor
    served = SimpleNamespace(named_parameters=lambda: ((n, ours[trainer_name(n)]) for n in names))
    checksum = simple_rl.trainer_checksum(model, simple_rl.World())
    assert vllm_weights_checksum(served) == checksum
    layer, bit_sum = model.layers[0], sum(int(p.view(torch.int16).sum()) for p in model.parameters())
    changes = [(layer.attention_norm.weight, layer.ffn_norm.weight),  # two tensors' contents swap
               (layer.attention.wqkv.weight,),  # its rows move down by one
               (layer.attention.wo.weight[3, 5:7],)]  # two values in a row swap
    with torch.no_grad():
        for change in changes:
            saved = [t.clone() for t in change]
            if len(change) == 2:
                change[0].copy_(saved[1]), change[1].copy_(saved[0])
            else:
                change[0].copy_(saved[0].roll(1, 0))
            assert not all(torch.equal(a, b) for a, b in zip(change, saved))
            assert sum(int(p.view(torch.int16).sum()) for p in model.parameters()) == bit_sum
            assert simple_rl.trainer_checksum(model, simple_rl.World()) != checksum
            for t, s in zip(change, saved):
                t.copy_(s)
    assert simple_rl.trainer_checksum(model, simple_rl.World()) == checksum


def test_the_checksum_of_a_tensor_sees_any_swap_and_adds_up_over_shards():
    """`tensor_checksum` weights each value by its place: a square weight transposed, two values on an
    anti-diagonal swapped, or any two unequal values swapped change it. FSDP2's shards of a tensor (its rows
    split as torch.chunk splits them; some ranks empty) give parts that add up to the whole's, modulo 2^64
    as the ranks' int64 sum wraps (one process standing for each rank of a fake process group)."""
    from conftest import checksums_of_shards

    from batch_invariant_backward import tensor_checksum

    g = torch.Generator().manual_seed(0)
    square = torch.randn(64, 64, generator=g).bfloat16()
    whole = int(tensor_checksum("w", square))
    assert int(tensor_checksum("w", square.t().contiguous())) != whole
    for (a, b), (c, d) in [((3, 6), (4, 5)), ((0, 0), (63, 63)), ((10, 2), (11, 1))]:
        swapped = square.clone()
        swapped[a, b], swapped[c, d] = square[c, d], square[a, b]
        assert int(tensor_checksum("w", swapped)) != whole
    assert int(tensor_checksum("v", square)) != whole
    rows = torch.randn(7, 5, generator=g).bfloat16()
    for ranks in (2, 3, 8):
        assert sum(checksums_of_shards(rows, ranks, "cpu")) % 2**64 == int(tensor_checksum("w", rows)) % 2**64


def test_a_parity_abort_names_the_first_mismatch_before_any_update(tmp_path, monkeypatch):
    """One sampled logprob one ulp off: the run stops in step 0 before the optimizer step, naming the
    sample and token, with the parity scalars logged. The locator needs vLLM's modules, which the test
    engine lacks: its failure is reported in the message and does not hide the parity error."""
    from safetensors.torch import load_file

    pushed = []

    class OneUlpOff(TrainerAsSampler):
        def generate(self, *args, **kwargs):
            completions, logprobs = super().generate(*args, **kwargs)
            logprobs[1][0] = torch.nextafter(logprobs[1][0], torch.tensor(0.0))
            return completions, logprobs

        def push_weights(self, model):
            super().push_weights(model)
            pushed.append({name: w.clone() for name, w in simple_rl.hf_weights(model)})

    model_dir = write_gsm8k_model(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    before = load_file(model_dir / "model.safetensors")
    with pytest.raises(simple_rl.ParityError) as error:
        simple_rl.main(small_run(model_dir, run_name="abort", steps=2, eval_every=0), device="cpu",
                       engine_class=OneUlpOff)
    message = str(error.value)
    assert message.startswith("step 0: sample 1 token 0 (id ") and "; 1 of " in message
    assert "first divergence: not found, the locator failed (AttributeError" in message
    assert pushed and all(torch.equal(w[k], before[k]) for w in pushed for k in before)  # no update was made
    assert scalar_series(tmp_path / "runs" / "abort")["parity/mismatched_tokens"] == [(0, 1.0)]


# --- checkpoints and resume -----------------------------------------------------------------------


def scalar_series(run_dir) -> dict:
    """Every scalar TensorBoard shows for a run (after purges), except wall-clock times and memory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir)).Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
            if not tag.startswith(("time/", "perf/", "memory/"))}


def training_state(checkpoint: Path) -> dict:
    """A checkpoint's training state (torch.distributed.checkpoint's files) as one flat dict of tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint / "training_state", checkpoint.parent / f"{checkpoint.name}.pt")
    return torch.load(checkpoint.parent / f"{checkpoint.name}.pt", weights_only=False)


def flat_tensors(state: dict, prefix="") -> dict:
    out = {}
    for key, value in state.items():
        out |= flat_tensors(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value}
    return out


def assert_same_state(a: Path, b: Path) -> None:
    x, y = flat_tensors(training_state(a)), flat_tensors(training_state(b))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), [k for k in x if not torch.equal(x[k], y[k])]


class Killed(Exception):
    pass


class DiesInStep3(TrainerAsSampler):
    """Generation calls: eval, steps 0 and 1, eval, step 2, then step 3's rollout, which dies."""

    def generate(self, *args, **kwargs):
        if self.calls.count("generate") == 5:
            raise Killed
        return super().generate(*args, **kwargs)


@pytest.mark.parametrize("offload", [False, True], ids=["", "offloaded optimizer"])
def test_a_killed_run_resumes_bit_for_bit(tmp_path, monkeypatch, capsys, offload):
    """A run that dies during step 3 of 4, resumed from its step-2 checkpoint with --resume alone, ends
    with the weights, optimizer state and TensorBoard scalars of the run that was never interrupted."""
    from safetensors.torch import load_file

    model_dir = write_gsm8k_model(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    flags = dict(steps=4, lr=1e-3, kl_coef=0.01, entropy_coef=0.01, sft_steps=1, sft_batch_size=2, eval_every=2,
                 eval_samples=3, save_every=2, keep_last=1, assert_bitwise=False, offload_optimizer=offload)
    simple_rl.main(small_run(model_dir, **flags, run_name="whole"), device="cpu", engine_class=TrainerAsSampler)
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "whole").iterdir()) == ["step_000004"]
    with pytest.raises(Killed):
        simple_rl.main(small_run(model_dir, **flags, run_name="killed"), device="cpu", engine_class=DiesInStep3)
    checkpoint = tmp_path / "checkpoints" / "killed" / "step_000002"
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["step_000002"]

    # Every flag that contradicts the run is named, in one error; a path written otherwise is the same path.
    clashing = ["--seed", "1", "--max-new-tokens", "7", "--dataset", str(gsm8k_jsonl("test")),
                "--model", f"{model_dir}/../model/"]
    with pytest.raises(plumbing.UsageError) as error:
        plumbing.check_args(plumbing.parse_command_line(simple_rl.Args, simple_rl.__doc__, ["--resume", str(checkpoint), *clashing]), 1)
    message = str(error.value)
    assert "--seed 1 (the run has 0)" in message and "--max-new-tokens 7 (the run has 6)" in message
    assert f"--dataset '{gsm8k_jsonl('test')}' (the run has '{gsm8k_jsonl('train')}')" in message
    assert "--model" not in message
    with pytest.raises(plumbing.UsageError, match="a resumed run keeps its name"):
        plumbing.check_args(plumbing.parse_command_line(simple_rl.Args, simple_rl.__doc__, ["--resume", str(checkpoint), "--run-name", "other"]), 1)
    # --resume alone: the run's own flags and name.
    args = plumbing.parse_command_line(simple_rl.Args, simple_rl.__doc__, ["--resume", str(checkpoint)])
    started = small_run(model_dir, **flags)
    assert (args.data, args.sampling, args.loss, args.run.run_name) == (started.data, started.sampling,
                                                                         started.loss, "killed")
    simple_rl.main(args, device="cpu", engine_class=TrainerAsSampler)

    whole, resumed = tmp_path / "checkpoints" / "whole" / "step_000004", checkpoint.parent / "step_000004"
    a, b = load_file(whole / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)
    assert_same_state(whole, resumed)  # masters, AdamW's moments and steps, reference, RNG states
    series = scalar_series(tmp_path / "runs" / "whole")
    assert [step for step, _ in series["train/loss"]] == [0, 1, 2, 3]
    assert scalar_series(tmp_path / "runs" / "killed") == series  # step 2, logged twice, is shown once


def test_a_mixture_of_experts_run_logs_its_routing_saves_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    """A Qwen3-MoE (4 experts, 2 a token) through main(): its routing in TensorBoard each step (warm start
    too), its checkpoint a Hugging Face Qwen3-MoE's (each expert's tensors, loaded by transformers), its
    certificate naming the router's GEMM; killed in step 3, resumed bit for bit."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_dir = write_gsm8k_model(tmp_path / "model", experts=4, experts_per_token=2, moe_intermediate=32)
    monkeypatch.chdir(tmp_path)
    flags = dict(steps=4, lr=1e-3, sft_steps=1, sft_batch_size=2, eval_every=2, eval_samples=3, save_every=2, keep_last=1,
                 assert_bitwise=False)
    run_dir = simple_rl.main(small_run(model_dir, **flags, run_name="whole"), device="cpu",
                             engine_class=TrainerAsSampler)
    series = scalar_series(run_dir)
    for layer in ("00", "01"):
        assert all(v >= 1 for _, v in series[f"train/expert_load_max_over_mean/layer_{layer}"])
        assert all(0 < v <= math.log(4) for _, v in series[f"train/router_entropy/layer_{layer}"])
    assert len(series["train/router_entropy/layer_00"]) == 4
    assert len(scalar_series(run_dir / "warm_start")["sft/router_entropy/layer_01"]) == 1
    whole = tmp_path / "checkpoints" / "whole" / "step_000004"
    assert type(AutoModelForCausalLM.from_pretrained(whole)).__name__ == "Qwen3MoeForCausalLM"
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in load_file(whole / "model.safetensors")
    record = json.loads((run_dir / "parity.json").read_text())
    assert "router rows=32" in record["kernels"]["matmul_tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)"]

    with pytest.raises(Killed):
        simple_rl.main(small_run(model_dir, **flags, run_name="killed"), device="cpu", engine_class=DiesInStep3)
    checkpoint = tmp_path / "checkpoints" / "killed" / "step_000002"
    args = plumbing.parse_command_line(simple_rl.Args, simple_rl.__doc__, ["--resume", str(checkpoint)])
    simple_rl.main(args, device="cpu", engine_class=TrainerAsSampler)
    a, b = load_file(whole / "model.safetensors"), load_file(checkpoint.parent / "step_000004" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)
    assert_same_state(whole, checkpoint.parent / "step_000004")
    assert scalar_series(tmp_path / "runs" / "killed") == series
    assert "train/expert_set_differs" not in series  # batch-invariant: the bits, and so the experts, are vLLM's

    # Without batch invariance, vLLM returns each token's experts and the share routed otherwise is logged.
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    engines = []
    run_dir = simple_rl.main(small_run(model_dir, **flags | dict(steps=2, save_every=-1), run_name="inexact"),
                             device="cpu", engine_class=recording(engines))
    assert engines[0].return_routed_experts
    assert [v for _, v in scalar_series(run_dir)["train/expert_set_differs"]] == [0.0, 0.0]  # one model samples


def test_a_branch_from_an_earlier_checkpoint_keeps_its_own_newest(tmp_path, monkeypatch):
    """A run of 4 saved steps, resumed from step 1 with another --lr for 3 steps and --keep-last 2: the branch
    replaces steps 2 and 3 and prunes by step number up to its own (not the old run's step 4, which stays)."""
    model_dir = write_gsm8k_model(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    simple_rl.main(small_run(model_dir, run_name="r", steps=4, lr=1e-3, eval_every=0, save_every=1, keep_last=0,
                             assert_bitwise=False), device="cpu", engine_class=TrainerAsSampler)
    run = tmp_path / "checkpoints" / "r"
    assert sorted(p.name for p in run.iterdir()) == [f"step_00000{n}" for n in (1, 2, 3, 4)]
    args = plumbing.parse_command_line(simple_rl.Args, simple_rl.__doc__, [
        "--resume", str(run / "step_000001"), "--steps", "3", "--keep-last", "2", "--lr", "5e-4"])
    simple_rl.main(args, device="cpu", engine_class=TrainerAsSampler)
    # step 1 is where the branch began (its tokenizer serves the branch); 2 and 3 the branch's; 4 the old run's
    assert sorted(p.name for p in run.iterdir()) == [f"step_00000{n}" for n in (1, 2, 3, 4)]
    lrs = {n: json.loads((run / f"step_00000{n}" / "training_state" / "run.json").read_text())["args"]
           ["optimizer"]["lr"] for n in (1, 2, 3, 4)}
    assert lrs == {1: 1e-3, 2: 5e-4, 3: 5e-4, 4: 1e-3}
    assert [d.name for d in plumbing.checkpoints_before(run, 10**7)] == [f"step_00000{n}" for n in (1, 2, 3, 4)]
    (run / "step_1000000").mkdir()  # past six digits: by number, not by name
    assert plumbing.checkpoints_before(run, 10**7)[-1].name == "step_1000000"


def test_a_resume_on_another_stack_warns(tmp_path, monkeypatch, capsys):
    """A checkpoint saved on another vLLM: the resume says, in one line, that bitwise continuation holds only
    on the same stack, and names what changed. A checkpoint of the older format is refused in one line."""
    model_dir = write_gsm8k_model(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    args = small_run(model_dir, run_name="r", steps=1, eval_every=0, assert_bitwise=False)
    simple_rl.main(args, device="cpu", engine_class=TrainerAsSampler)
    checkpoint = tmp_path / "checkpoints" / "r" / "step_000001"
    record = json.loads((checkpoint / "training_state" / "parity.json").read_text())
    real = plumbing.stack_versions()
    monkeypatch.setattr(plumbing, "stack_versions", lambda: real | {"vllm": "0.21.0"})
    capsys.readouterr()
    simple_rl.main(dataclasses.replace(args, optimizer=dataclasses.replace(args.optimizer, steps=2),
                                       run=dataclasses.replace(args.run, resume=str(checkpoint))),
                   device="cpu", engine_class=TrainerAsSampler)
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: --resume {checkpoint} was saved on another stack (vllm {record['stack']['vllm']} "
                        "-> 0.21.0): the run continues bit for bit only on the same one"]
    old = tmp_path / "old"
    (old / "training_state").mkdir(parents=True)
    (old / "training_state" / "run.json").write_text(json.dumps({"args": {"model": "m", "steps": 3}, "step": 1}))
    error = one_line_error(run_script("--resume", str(old), env_update=ON, cwd=tmp_path))
    assert "written by another version of simple_rl.py" in error


def cpu_checkpoints(tmp_path: Path, model_dir: Path):
    """A CPU trainer and its checkpoint writer: the optimizer's state lies in host memory, so it is written
    where it lies and AdamW's next step waits for the write (as with --offload-optimizer)."""
    model = simple_rl.load_qwen3(model_dir, "cpu")
    optimizer = simple_rl.MasterWeights(model, 1e-3, 0.0)
    args = make_args(run_name="r", output_dir=str(tmp_path / "checkpoints"), keep_last=0,
                     dataset=str(gsm8k_jsonl("train")), eval_dataset=str(gsm8k_jsonl("test")))
    return plumbing.Checkpoints(model, functools.partial(simple_rl.hf_weights, model), optimizer, None, model_dir,
                                args, simple_rl.World()), model, optimizer


def adam_step(optimizer: simple_rl.MasterWeights, seed: int) -> None:
    optimizer.zero_grads()
    for _, p in optimizer.named:
        p.main_grad.copy_(torch.randn(p.main_grad.shape, generator=torch.Generator().manual_seed(seed)))
    optimizer.step(1e-3, 1.0)


def test_a_save_returns_as_its_write_goes_on_and_holds_the_state_of_its_step(tmp_path, monkeypatch):
    """The write goes on in a thread (held here): `save` returns with only the partial folder there. AdamW's
    next step waits for the write (its state is written where it lies); once the write ends, step_N is in
    place and holds, bit for bit, the weights and training state of the step that saved, though AdamW has
    changed them since."""
    from safetensors.torch import load_file

    checkpoints, model, optimizer = cpu_checkpoints(tmp_path, write_gsm8k_model(tmp_path / "model"))
    adam_step(optimizer, 0)
    state = {k: v.clone() for k, v in flat_tensors(plumbing.training_state(optimizer, None)).items()}
    weights = {name: w.clone() for name, w in simple_rl.hf_weights(model)}
    writing, release, write_data = threading.Event(), threading.Event(), FileSystemWriter.write_data

    def held(*args):
        writing.set()
        release.wait(60)
        return write_data(*args)
    monkeypatch.setattr(FileSystemWriter, "write_data", held)
    start = time.perf_counter()
    checkpoints.save(1, {"tokens_checked": 0, "mismatched_tokens": 0})
    out = tmp_path / "checkpoints" / "r" / "step_000001"
    assert time.perf_counter() - start < 30 and not release.is_set() and writing.wait(60)
    assert not out.exists() and (out.parent / ".step_000001.partial").is_dir()
    stepped = threading.Thread(target=adam_step, args=(optimizer, 1))
    stepped.start()
    stepped.join(timeout=2)
    assert stepped.is_alive() and not out.exists()  # AdamW waits for the write
    release.set()
    stepped.join(timeout=60)
    assert not stepped.is_alive() and sorted(p.name for p in out.parent.iterdir()) == ["step_000001"]
    saved, now = flat_tensors(training_state(out)), flat_tensors(plumbing.training_state(optimizer, None))
    assert saved.keys() == state.keys() and all(torch.equal(saved[k], state[k]) for k in state)
    assert not any(torch.equal(now[k], state[k]) for k in state if k.startswith("masters."))  # AdamW stepped
    hf = load_file(out / "model.safetensors")
    assert hf.keys() == weights.keys() and all(torch.equal(hf[k].view(torch.int16), w.view(torch.int16))
                                               for k, w in weights.items())
    assert json.loads((out / "training_state" / "run.json").read_text())["step"] == 1


def test_a_save_that_waits_for_the_last_write_says_the_disk_is_slower_than_the_saves(tmp_path, monkeypatch,
                                                                                     capsys):
    """Saves come faster than the disk writes them: the save that waits for the write before it says so in
    one line, with the write's and the steps' seconds and what to change; one whose last write ended, not."""
    checkpoints, _, _ = cpu_checkpoints(tmp_path, write_gsm8k_model(tmp_path / "model"))
    totals, write_data = {"tokens_checked": 0, "mismatched_tokens": 0}, FileSystemWriter.write_data

    def slow(*args):
        time.sleep(1.5)
        return write_data(*args)
    monkeypatch.setattr(FileSystemWriter, "write_data", slow)
    checkpoints.save(1, totals)
    checkpoints.save(2, totals)  # step_000001 is still being written
    checkpoints.wait()
    waited = [line for line in capsys.readouterr().out.splitlines() if "waited" in line]
    assert len(waited) == 1 and waited[0].startswith("checkpoint step_000002 waited ")
    assert " s for step_000001's write (" in waited[0]
    assert waited[0].endswith(" s of steps between the saves): save less often (--save-every) or to a faster disk")
    checkpoints.save(3, totals)  # step_000002's write has ended
    checkpoints.wait()
    assert "waited" not in capsys.readouterr().out


@pytest.mark.parametrize("full_at", ["create_stream", "mkdir"])
def test_a_full_disk_in_the_background_write_is_one_line_at_the_wait(tmp_path, monkeypatch, full_at):
    """A write that fails in its thread (the training state's file or folder: No space left on device) fails
    the save when it is waited for: the one-line CheckpointError, the partial folder removed, the previous
    checkpoint whole and as it was."""
    import errno

    from torch.distributed.checkpoint.filesystem import FileSystem

    checkpoints, _, optimizer = cpu_checkpoints(tmp_path, write_gsm8k_model(tmp_path / "model"))
    totals = {"tokens_checked": 0, "mismatched_tokens": 0}
    checkpoints.save(1, totals)
    checkpoints.wait()
    first = tmp_path / "checkpoints" / "r" / "step_000001"
    before = {f.name: f.read_bytes() for f in first.rglob("*") if f.is_file()}
    adam_step(optimizer, 0)
    create = getattr(FileSystem, full_at)

    def full(self, path, *mode):
        if "w" in "".join(mode) or full_at == "mkdir":
            raise OSError(errno.ENOSPC, "No space left on device")
        return create(self, path, *mode)
    monkeypatch.setattr(FileSystem, full_at, full)
    checkpoints.save(2, totals)  # returns: the error is the thread's
    with pytest.raises(plumbing.CheckpointError) as error:
        checkpoints.wait()
    message = str(error.value)
    assert message.startswith(f"checkpoint {first.parent / 'step_000002'} not written (No space left on device): ")
    assert message.endswith(f"the last whole checkpoint is {first}") and "\n" not in message
    assert sorted(p.name for p in first.parent.iterdir()) == ["step_000001"]
    assert {f.name: f.read_bytes() for f in first.rglob("*") if f.is_file()} == before
    assert plumbing.Checkpoints.under_way is None


@pytest.mark.parametrize("fails", ["torch.save", "safetensors", "a bug"])
def test_a_disk_that_fills_mid_save_is_one_line_at_the_wait(tmp_path, monkeypatch, fails):
    """A real filesystem (a tmpfs) too small for the checkpoint: torch.save's zip writer fails mid-file with
    "unexpected pos" (a short write), or, with room for the training state only, safetensors with its own
    error; neither is an OSError (measured; the tests above raise one). Both are the one-line CheckpointError
    naming the error, no partial folder left. On a disk with room once the partial folder is gone, an error
    (here after DCP wrote the state) is a bug, not the disk's: its own traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    checkpoints, model, _ = cpu_checkpoints(tmp_path / "disk", write_gsm8k_model(tmp_path / "model"))
    need, params = (plumbing.checkpoint_bytes(checkpoints.args, sum(p.numel() for p in model.parameters())),
                    sum(p.numel() for p in model.parameters()))
    size = {"torch.save": 2**20, "safetensors": 13 * params, "a bug": need + 2**20}[fails]  # state: 12.4 B/param
    def bug(*_):
        raise IndexError("a bug in the write")
    if fails == "a bug":
        monkeypatch.setattr(plumbing, "write_hf_checkpoint", bug)
    with small_disk(tmp_path / "disk", size) as disk:
        checkpoints.save(1, {"tokens_checked": 0, "mismatched_tokens": 0})
        with pytest.raises(CheckpointException if fails == "a bug" else plumbing.CheckpointError) as error:
            checkpoints.wait()
        assert not list(disk.rglob("*step_000001*"))  # neither the partial folder nor step_000001
    if fails == "a bug":
        assert [type(cause) for cause, _ in error.value.failures.values()] == [IndexError]
        return
    why = {"torch.save": "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos ",
           "safetensors": "SafetensorError: Error while serializing: I/O error: No space left on device"}[fails]
    assert str(error.value).startswith(f"checkpoint {disk / 'checkpoints' / 'r' / 'step_000001'} not written "
                                       f"({why}"), str(error.value)
    assert str(error.value).endswith("the last whole checkpoint is none") and "\n" not in str(error.value)


def test_a_certificate_on_a_full_disk_is_left_as_it_was(tmp_path):
    """parity.json rewritten on a real full disk (a tmpfs): the error, and the file as it was, whole; nothing
    partial left beside it. Written in place, the file was left empty."""
    with small_disk(tmp_path / "disk", 2**20) as disk:
        certificate = disk / "parity.json"
        certificate.write_text('{"tokens_checked": 1}')
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        (disk / "filler").write_bytes(bytes(free))
        with pytest.raises(OSError, match="No space left on device"):
            plumbing.write_whole(certificate, json.dumps({"tokens_checked": 2, "padding": "x" * 8192}))
        assert certificate.read_text() == '{"tokens_checked": 1}' and sorted(p.name for p in disk.iterdir()) == [
            "filler", "parity.json"]


def test_a_disk_that_fills_beneath_tensorboard_is_one_line(tmp_path):
    """The run's disk (a real tmpfs) fills a few steps in, with no checkpoint to blame: TensorBoard's writer
    fails with an OSError; the script's error boundary makes it one line, exit status 1, and TensorBoard
    keeps the steps before it."""
    model_dir = write_gsm8k_model(tmp_path / "model")
    code = f"""
import os, sys
sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
import simple_rl, test_rl
disk = os.statvfs(".")
with open("filler", "wb") as f:  # all but 16 KiB
    f.write(bytes(disk.f_bavail * disk.f_frsize - 16 * 1024))
args = test_rl.small_run({str(model_dir)!r}, run_name="full", steps=50, eval_every=0, assert_bitwise=False,
                         save_every=-1)
simple_rl.run_as_script(args, device="cpu", engine_class=test_rl.TrainerAsSampler)
"""
    with small_disk(tmp_path / "disk", 2**20) as disk:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=disk,
                                env=os.environ | ON, timeout=300)
        (disk / "filler").unlink()
        assert result.returncode == 1, result.stderr
        assert result.stderr.strip() == ("error: the disk is full (No space left on device); any checkpoints "
                                         "written are whole: free some space, then --resume from the last one")
        steps = [step for step, _ in scalar_series(disk / "runs" / "full")["train/loss"]]
        assert steps == list(range(len(steps))) and 1 < len(steps) < 50, steps


def test_a_save_that_fails_with_room_on_the_disk_keeps_its_traceback(tmp_path, monkeypatch):
    """Not the disk's (room for the checkpoint, no OSError): the error itself, the partial folder removed."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystem

    checkpoints, _, _ = cpu_checkpoints(tmp_path, write_gsm8k_model(tmp_path / "model"))

    def broken(self, path, mode):
        raise RuntimeError("a bug in the write")
    monkeypatch.setattr(FileSystem, "create_stream", broken)
    checkpoints.save(1, {"tokens_checked": 0, "mismatched_tokens": 0})
    with pytest.raises(CheckpointException) as error:  # DCP's, around each rank's error
        checkpoints.wait()
    assert [str(cause) for cause, _ in error.value.failures.values()] == ["a bug in the write"]
    assert not any((tmp_path / "checkpoints" / "r").iterdir())


def test_a_checkpoint_copied_in_part_is_one_line_before_anything_loads(tmp_path):
    """--resume of a real checkpoint whose training state was cut short (a byte off its DCP file) or lost its
    index: one line naming it, exit status 2, before vLLM or the data load (dcp.load failed once they had)."""
    checkpoints, _, _ = cpu_checkpoints(tmp_path, write_gsm8k_model(tmp_path / "model"))
    checkpoints.save(1, {"tokens_checked": 0, "mismatched_tokens": 0})
    checkpoints.wait()
    state = tmp_path / "checkpoints" / "r" / "step_000001" / "training_state"
    shape = simple_rl.model_shape(simple_rl.model_args_from_hf_config(plumbing.read_config(state.parent)))
    plumbing.check_training_state(state.parent, shape)  # whole: passes
    shard = next(state.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    error = one_line_error(run_script("--resume", str(state.parent), env_update=ON, cwd=tmp_path))
    assert error.endswith(f"its training state is broken ({shard.name} is cut short: {shard.stat().st_size:,} "
                          f"of {shard.stat().st_size + 1:,} bytes); copy it again whole, or resume from an "
                          "earlier checkpoint"), error
    shard.write_bytes(shard.read_bytes() + b"?")  # the size is all it checks of the shards
    index = (state / ".metadata").read_bytes()
    (state / ".metadata").unlink()
    with pytest.raises(plumbing.UsageError, match=r"broken \(FileNotFoundError: .*\.metadata'\)"):
        plumbing.check_training_state(state.parent, shape)
    (state / ".metadata").write_bytes(index)
    plumbing.check_training_state(state.parent, shape)
    (state / "parity.json").write_text('{"stack": {}}')
    with pytest.raises(plumbing.UsageError, match=r"\(parity.json lacks mismatched_tokens, tokens_checked\)"):
        plumbing.check_training_state(state.parent, shape)
    (state / "parity.json").write_text("{")
    with pytest.raises(plumbing.UsageError, match=r"broken \(JSONDecodeError: "):
        plumbing.check_training_state(state.parent, shape)


def test_a_run_stopped_by_an_error_first_finishes_the_save_under_way(tmp_path, monkeypatch):
    """An error in the step after a save (here in its sampling, before AdamW would wait for the write): the
    save under way is waited for on the way out, and is in place whole, the error still the run's."""
    class DiesInStep1(TrainerAsSampler):
        def generate(self, *args, **kwargs):
            if self.calls.count("generate") == 1:
                raise Killed
            return super().generate(*args, **kwargs)

    monkeypatch.chdir(tmp_path)
    args = small_run(write_gsm8k_model(tmp_path / "model"), run_name="stopped", steps=3, save_every=1,
                     eval_every=0, assert_bitwise=False)
    with pytest.raises(Killed):
        simple_rl.main(args, device="cpu", engine_class=DiesInStep1)
    checkpoints = tmp_path / "checkpoints" / "stopped"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000001"]
    assert plumbing.Checkpoints.under_way is None
    assert plumbing.saved_run(checkpoints / "step_000001", simple_rl.Args)[1] == 1 and training_state(checkpoints / "step_000001")


def test_a_save_killed_midway_leaves_the_previous_checkpoints_whole(tmp_path):
    """kill -9 while a checkpoint is being written in the background: no half-written step_N, the previous one
    as it was; the next save removes what the killed one left."""
    model_dir, run = write_gsm8k_model(tmp_path / "model"), tmp_path / "checkpoints" / "r"
    code = f"""
import pathlib, shutil, sys, time
sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
import plumbing, simple_rl, test_rl
tmp = pathlib.Path({str(tmp_path)!r})
checkpoints, _, optimizer = test_rl.cpu_checkpoints(tmp, pathlib.Path({str(model_dir)!r}))
checkpoints.save(1, {{"tokens_checked": 0, "mismatched_tokens": 0}})
checkpoints.wait()
shutil.copytree(tmp / "checkpoints" / "r" / "step_000001", tmp / "as_it_was")
test_rl.adam_step(optimizer, 0)
def half(weights, source_dir, directory):  # the training state is written: the weights, half, never end
    (directory / "model.safetensors").write_bytes(b"half")
    (tmp / "cut").touch()
    time.sleep(600)
plumbing.write_hf_checkpoint = half
checkpoints.save(2, {{"tokens_checked": 0, "mismatched_tokens": 0}})
time.sleep(600)
"""
    process = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path)
    deadline = time.time() + 300
    while not (tmp_path / "cut").exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert (tmp_path / "cut").exists()
    first = run / "step_000001"
    assert [p.name for p in run.glob("step_[0-9]*")] == ["step_000001"]  # what pruning and --resume see
    assert (run / ".step_000002.partial" / "training_state" / ".metadata").is_file()  # cut off midway
    files = sorted(f.relative_to(first) for f in first.rglob("*") if f.is_file())
    assert files == sorted(f.relative_to(tmp_path / "as_it_was") for f in (tmp_path / "as_it_was").rglob("*")
                           if f.is_file())
    assert all((first / f).read_bytes() == (tmp_path / "as_it_was" / f).read_bytes() for f in files)
    restored = simple_rl.MasterWeights(simple_rl.load_qwen3(first, "cpu"), 1e-3, 0.0)
    plumbing.restore_training_state(first, restored, None, make_args(), simple_rl.World())  # whole: it resumes
    checkpoints, _, _ = cpu_checkpoints(tmp_path, model_dir)
    checkpoints.save(3, {"tokens_checked": 0, "mismatched_tokens": 0})
    checkpoints.wait()
    assert sorted(p.name for p in run.glob("*step_*") if p.is_dir()) == ["step_000001", "step_000003"]


def test_large_weights_are_written_in_shards_that_load(tmp_path, monkeypatch):
    """Past SHARD_BYTES the weights go into model-0000i-of-0000n.safetensors files with an index, as the
    hub's large checkpoints: transformers and the trainer load them as they are."""
    from transformers import AutoModelForCausalLM

    model_dir = write_gsm8k_model(tmp_path / "model")
    model = simple_rl.load_qwen3(model_dir, "cpu")
    monkeypatch.setattr(plumbing, "SHARD_BYTES", sum(p.numel() * 2 for p in model.parameters()) // 3)
    out = tmp_path / "out"
    out.mkdir()
    plumbing.write_hf_checkpoint(dict(simple_rl.hf_weights(model)), model_dir, out)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {name for name, _ in simple_rl.hf_weights(model)}
    reloaded = simple_rl.load_qwen3(out, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reloaded.parameters()))
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(hf.model.embed_tokens.weight, model.tok_embeddings.weight.float())


def test_chat_format_run_stops_at_im_end_and_warm_starts_to_it(tmp_path, monkeypatch):
    """--prompt-format chat end to end with Qwen3's template: the engine is told to stop at <|im_end|>,
    and the warm start teaches answers that end with it."""
    from transformers import AutoTokenizer

    model_dir = write_chat_model(tmp_path / "chat")
    monkeypatch.chdir(tmp_path)
    args = plumbing.check_args(small_run(model_dir, run_name="chat", prompt_format="chat", thinking=True, steps=1,
                                          max_new_tokens=4, max_tokens_per_microbatch=800, sft_steps=1,
                                          sft_batch_size=2, eval_every=0, assert_bitwise=False), 1)
    engines = []
    simple_rl.main(args, device="cpu", engine_class=recording(engines))
    im_end = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<|im_end|>")
    assert im_end in engines[0].stop_token_ids
    # The checkpoint keeps the chat template: a resumed run and vLLM users render the same prompts.
    saved = AutoTokenizer.from_pretrained(tmp_path / "checkpoints" / "chat" / "step_000001")
    assert saved.chat_template == QWEN3_CHAT_TEMPLATE and len(saved) == len(AutoTokenizer.from_pretrained(model_dir))

    files = plumbing.read_files(args, simple_rl.ANSWER_AFTER_HASHES)
    inputs = plumbing.load_inputs(args, files, simple_rl.model_shape(simple_rl.model_args_from_hf_config(files.config)),
                                  simple_rl.encode_dataset)
    order = list(range(len(inputs.train_rows)))
    longer = dataclasses.replace(args, sampling=dataclasses.replace(args.sampling, max_new_tokens=500))
    simple_rl.warm_start(simple_rl.load_qwen3(model_dir, "cpu"), inputs, order, longer, simple_rl.World())
    assert all(r["answer_ids"][-1] == im_end for r in inputs.train_rows)  # each whole within 500 tokens


# --- the GRPO loss, and corrections for a sampler that differs from the trainer --------------------


def policy(logprobs, entropy=None):
    n = len(logprobs)
    return simple_rl.TokenLogprobs(logprobs, torch.zeros(n) if entropy is None else entropy, torch.full((n,), 9),
                                   torch.zeros(n))


def test_grpo_loss_by_hand():
    """Two sequences of 2 and 1 tokens, the step has 4 tokens: PPO-clip, k3 KL and the entropy bonus."""
    lp = torch.log(torch.tensor([0.5, 0.25, 0.8]))
    sampler = torch.log(torch.tensor([0.5, 0.2, 0.8]))  # ratios 1, 1.25, 1
    ref = torch.log(torch.tensor([0.25, 0.25, 0.4]))  # d = ref - lp: log 0.5, 0, log 0.5
    adv, entropy = torch.tensor([1.0, 1.0, -2.0]), torch.tensor([0.1, 0.2, 0.3])
    cfg = simple_rl.Loss(clip_eps=0.2, kl_coef=0.5, entropy_coef=0.1)
    loss, sums = simple_rl.grpo_loss(policy(lp, entropy), sampler, adv, lengths=[2, 1], ref_logprobs=ref, n_tokens=4,
                                     cfg=cfg)
    pg = [-1.0, -1.2, 2.0]  # -min(r A, clip(r) A): 1; min(1.25, 1.2); min(-2, -2)
    kl = [math.exp(math.log(0.5)) - math.log(0.5) - 1, 0.0, 0.5 - math.log(0.5) - 1]
    per_token = [p + 0.5 * k - 0.1 * e for p, k, e in zip(pg, kl, [0.1, 0.2, 0.3])]
    assert float(loss) == pytest.approx(sum(per_token) / 4, abs=1e-6)
    assert float(sums["pg_loss"]) == pytest.approx(sum(pg), abs=1e-6)
    assert float(sums["kl_div"]) == pytest.approx(sum(kl), abs=1e-6)
    assert float(sums["ratio_clipped_frac"]) == 1 and float(sums["ratio_mean"]) == pytest.approx(3.25)
    assert float(sums["kept_tokens"]) == 27 and float(sums["correction_weight_mean"]) == 3
    _, plain = simple_rl.grpo_loss(policy(lp), sampler, adv, lengths=[2, 1], n_tokens=4, cfg=simple_rl.Loss())
    assert "kl_div" not in plain and float(plain["loss"]) == pytest.approx(sum(pg), abs=1e-6)


def correction_cfg(correction, level, geometric=False):
    return simple_rl.Loss(correction=correction, correction_level=level, correction_min=0.5, correction_max=2.0,
                          correction_geometric_mean=geometric)


def test_correction_weights_by_hand():
    log_ratio = torch.log(torch.tensor([1.0, 3.0, 0.25, 1.5, 0.5]))  # sequences of 2 and 3 tokens
    lengths = [2, 3]

    def weights(*config):
        w, cut = simple_rl.correction_weights(log_ratio, lengths, correction_cfg(*config))
        return [round(x, 6) for x in w.tolist()], cut.tolist()

    assert weights("tis", "token") == ([1.0, 2.0, 0.25, 1.5, 0.5], [False, True, False, False, False])
    assert weights("mis", "token") == ([1.0, 0.0, 0.0, 1.5, 0.5], [False, True, True, False, False])
    # Sequence ratios: 1 * 3 = 3 and 0.25 * 1.5 * 0.5 = 0.1875; geometric means 3^(1/2) and 0.1875^(1/3).
    assert weights("tis", "sequence") == ([2.0, 2.0, 0.1875, 0.1875, 0.1875], [True, True, False, False, False])
    assert weights("mis", "sequence") == ([0.0] * 5, [True] * 5)
    g1, g2 = round(3**0.5, 6), round(0.1875 ** (1 / 3), 6)
    assert weights("mis", "sequence", True) == ([g1, g1, g2, g2, g2], [False] * 5)  # both inside [0.5, 2]
    assert weights("none", "sequence") == ([1.0] * 5, [False] * 5)


@pytest.mark.parametrize("correction", ["none", "tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_equal_logprobs_make_every_correction_a_no_op(correction, level):
    """Batch invariance on: the trainer's logprobs are the sampler's, so every weight is exactly 1."""
    log_ratio = torch.zeros(7)
    for geometric in (False, True):
        w, cut = simple_rl.correction_weights(log_ratio, [3, 4], correction_cfg(correction, level, geometric))
        assert torch.equal(w, torch.ones(7)) and not cut.any()


def test_corrections_weight_the_policy_gradient(tmp_path):
    """In a real train step: with the sampler's logprobs equal to the trainer's, every correction gives
    the loss and gradients of none, bit for bit; with the sampler e times less likely on every token,
    tis doubles the policy-gradient term (w = e truncated at 2) and mis masks it out."""
    from conftest import qwen3_config, write_checkpoint

    model = simple_rl.load_qwen3(write_checkpoint(tmp_path / "m", qwen3_config()), "cpu", dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    completions = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (4, 6, 2, 5)]
    with torch.no_grad():  # the sampler's logprobs, from one micro-batch as the trainer packs them
        batch = simple_rl.pack_sequences(prompts, completions, "cpu")
        same = list(model(batch).logprobs.split(batch.completion_lens))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])

    def step(cfg, sampler_logprobs):
        args = dataclasses.replace(make_args(max_tokens_per_microbatch=1000), loss=cfg)
        rollouts = simple_rl.Rollouts(prompts, completions, sampler_logprobs, rewards,
                                      simple_rl.group_advantages(rewards, 2, True))
        optimizer = simple_rl.MasterWeights(model, 1e-3, 0.0)
        metrics, _ = simple_rl.train_on_rollouts(model, optimizer, rollouts, None, args, simple_rl.World())
        return metrics, [p.main_grad for _, p in optimizer.named]

    baseline, grads = step(correction_cfg("none", "token"), same)
    for correction, level in [("tis", "token"), ("mis", "token"), ("tis", "sequence"), ("mis", "sequence")]:
        metrics, corrected = step(correction_cfg(correction, level), same)
        assert metrics["loss"] == baseline["loss"] and all(torch.equal(a, b) for a, b in zip(grads, corrected))
        assert metrics["correction_weight_mean"] == 1 and metrics["correction_cut_frac"] == 0
        assert metrics["correction_ess"] == 1
    unlikely = [lp - 1 for lp in same]  # log(trainer / sampler) = 1 on every token
    tis, tis_grads = step(correction_cfg("tis", "token"), unlikely)
    assert tis["correction_weight_mean"] == 2 and tis["correction_cut_frac"] == 1
    assert tis["pg_loss"] == pytest.approx(2 * baseline["pg_loss"], abs=1e-12)  # the baseline's ratio is 1 too
    mis, mis_grads = step(correction_cfg("mis", "token"), unlikely)
    assert mis["pg_loss"] == 0 and mis["correction_cut_frac"] == 1
    assert all(not g.any() for g in mis_grads if g is not None)


def test_mismatch_is_reported_by_sampler_probability_and_perplexity():
    v = torch.log(torch.tensor([0.0005, 0.05, 0.95, 1.0]))
    t = v + torch.tensor([0.5, 0.0, 0.0, 0.0])
    metrics, _ = simple_rl.compare_bits([v], [t], [[1, 2, 3, 4]])
    assert metrics["p_0-0.001/mean_abs_logprob_diff"] == pytest.approx(0.5)
    assert metrics["p_0-0.001/vllm_kl"] == pytest.approx(math.exp(0.5) - 0.5 - 1)  # k3 with d = trainer - vLLM
    assert metrics["p_0.01-0.1/mean_abs_logprob_diff"] == 0 and metrics["p_0.9-1/token_frac"] == 0.5
    assert not any(k.startswith(("p_0.001-", "p_0.1-", "p_0.5-")) for k in metrics)  # empty buckets
    assert metrics["sampler_perplexity"] == pytest.approx(math.exp(-float(v.mean())))
    assert metrics["trainer_perplexity"] == pytest.approx(math.exp(-float(t.mean())))


def test_the_trainer_optimises_the_sampled_policy(tmp_path):
    """At --temperature T the trainer's logprobs, which the loss and the parity check use, are those of
    softmax(z / T), z the fp32 logits; with --top-k and --top-p, those of the truncated distribution: what
    vLLM samples from and returns as processed logprobs."""
    from conftest import qwen3_config, write_checkpoint

    model = simple_rl.load_qwen3(write_checkpoint(tmp_path / "m", qwen3_config()), "cpu", dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (6, 4)]
    completions = [[], []]  # greedy: each token its row's likeliest, which any top-k/top-p keeps
    with torch.no_grad():
        for _ in range(5):
            batch = simple_rl.pack_sequences([p + c for p, c in zip(prompts, completions)], [[]] * 2, "cpu")
            hidden = model.hidden_states(batch.tokens, batch.positions, batch.spans)
            last = hidden[batch.spans.cu_seqlens[1:].long() - 1]
            completions = [c + [int(t)] for c, t in zip(completions, (last @ model.output_weight.t()).argmax(-1))]
        batch = simple_rl.pack_sequences(prompts, completions, "cpu")
        hidden = model.hidden_states(batch.tokens, batch.positions, batch.spans)[batch.target_rows]
        z = torch.nn.functional.linear(hidden, model.output_weight)
    for top_k, top_p in ((0, 1.0), (3, 1.0), (0, 0.5), (3, 0.5)):
        scaled = z / 0.7
        keep = scaled >= scaled.topk(top_k or 256, dim=-1).values[:, -1:]
        probs = scaled.masked_fill(~keep, -torch.inf).softmax(-1).sort(-1, descending=True)
        mass = (probs.values.cumsum(-1) - probs.values < top_p) | (top_p == 1)  # the likeliest until p is reached
        keep &= torch.zeros_like(keep).scatter(-1, probs.indices, mass)
        by_hand = torch.log_softmax(scaled.masked_fill(~keep, -torch.inf), -1).gather(-1, batch.targets[:, None])[:, 0]
        with torch.no_grad():
            out = model(batch, 0.7, top_k, top_p)
        torch.testing.assert_close(out.logprobs, by_hand, rtol=0, atol=1e-12)
        assert out.kept.tolist() == keep.sum(-1).tolist()
        rewards = torch.tensor([1.0, 0.0])
        rollouts = simple_rl.Rollouts(prompts, completions, list(by_hand.split(batch.completion_lens)), rewards,
                                      simple_rl.group_advantages(rewards, 2, True))
        args = make_args(temperature=0.7, top_k=top_k, top_p=top_p, max_tokens_per_microbatch=1000)
        metrics, trained = simple_rl.train_on_rollouts(model, simple_rl.MasterWeights(model, 1e-3, 0.0), rollouts,
                                                       None, args, simple_rl.World())
        torch.testing.assert_close(torch.cat(trained), by_hand, rtol=0, atol=1e-12)
        assert metrics["ratio_mean"] == pytest.approx(1, abs=1e-12)  # against the sampler: on-policy
