"""simple_rl.py end to end on the GPU: a small random Qwen3 with a tokenizer trained on the spot and
the local GSM8K. With batch invariance on, every sampled token of every step is bitwise equal;
off, the run completes and reports the mismatch. The final checkpoint loads in vLLM (bitwise the
trainer's logprobs) and in transformers (the trainer's logits, fp32)."""

import functools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import free_dead_engines, gsm8k_jsonl, start_engine, write_chat_model, write_gsm8k_model
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint import FileSystemWriter

import plumbing
import simple_rl
from batch_invariant_backward import REFERENCE

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]
STEPS = 10
TAGS = ["train/loss", "train/pg_loss", "train/kl_div", "train/entropy", "reward/reward_mean", "reward/reward_std",
        "train/ratio_mean", "train/ratio_clipped_frac", "weight_delta/layer_00/magnitude",
        "weight_delta/layer_00/relative_change", "parity/mismatched_tokens", "parity/max_abs_logprob_diff",
        "parity/mean_abs_logprob_diff", "parity/vllm_kl", "perf/generate_tokens_per_s", "perf/train_tokens_per_s",
        "time/generate", "time/train", "time/push", "memory/generate_gib", "memory/train_gib", "eval/accuracy"]  # fmt: skip


def script_command(tmp_path, model_dir, name, batch_invariant: bool, extra=()) -> tuple[list[str], dict]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_BATCH_INVARIANT"}
    flags = ["--model", str(model_dir), "--dataset", str(gsm8k_jsonl("train")),
             "--eval-dataset", str(gsm8k_jsonl("test")), "--run-name", name, "--steps", str(STEPS),
             "--prompts-per-step", "8", "--samples-per-prompt", "8", "--max-new-tokens", "128",
             "--max-prompt-tokens", "256", "--lr", "1e-4", "--warmup-steps", "2", "--kl-coef", "0.01",
             "--entropy-coef", "0.001", "--eval-every", "5", "--eval-samples", "64", "--vllm-gpu-memory", "0.12",
             *extra]  # fmt: skip
    if batch_invariant:
        env["VLLM_BATCH_INVARIANT"] = "1"
    else:
        flags.append("--no-assert-bitwise")
    return [sys.executable, str(REPO / "simple_rl.py"), *flags], env


def run(tmp_path, model_dir, name, batch_invariant: bool, extra=()):
    command, env = script_command(tmp_path, model_dir, name, batch_invariant, extra)
    free_dead_engines()  # the script claims the GPU as on a machine of its own
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # A quiet terminal: vLLM's log, torch's and NCCL's warnings go to runs/<run>/log.txt (--verbose shows them).
    foreign = [line for line in (result.stdout + result.stderr).splitlines()
               if line.startswith(("INFO ", "WARNING ", "[rank", "[W")) or "Warning" in line]
    assert not foreign, foreign[:3]
    assert "WARNING" in (tmp_path / "runs" / name / "log.txt").read_text()  # vLLM's, kept
    return EventAccumulator(str(tmp_path / "runs" / name)).Reload()


def share_that_sleeps(command: list[str]) -> float:
    """The least --vllm-gpu-memory (of 0.90-0.96) at which this GPU's memory plan no longer fits vLLM's share
    beside the trainer's, so that `command`'s run puts vLLM to sleep while the trainer trains."""
    for share in (0.9, 0.92, 0.94, 0.95, 0.96):
        argv = [*command[2:], "--vllm-gpu-memory", str(share)]  # the last one given counts
        args = plumbing.check_args(plumbing.parse_command_line(simple_rl.Args, simple_rl.__doc__, argv), 1)
        config = plumbing.read_files(args, simple_rl.ANSWER_AFTER_HASHES).config
        shape = simple_rl.model_shape(simple_rl.model_args_from_hf_config(config))
        if not plumbing.check_memory(shape, args, 1, torch.cuda.mem_get_info()[1], None).vllm_awake:
            return share
    raise AssertionError("vLLM fits beside this trainer even with 96% of the GPU")


def values(events, tag):
    return [e.value for e in events.Scalars(tag)]


def test_rl_run_is_bitwise_every_step_and_its_checkpoint_loads(tmp_path):
    model_dir = write_gsm8k_model(tmp_path / "model", device="cuda", hidden=256, layers=4, heads=4, kv_heads=2,
                                  head_dim=128, intermediate=768)  # fmt: skip
    on = run(tmp_path, model_dir, "on", batch_invariant=True)
    assert set(TAGS) <= set(on.Tags()["scalars"]), set(TAGS) - set(on.Tags()["scalars"])
    mismatches = values(on, "parity/mismatched_tokens")
    assert len(mismatches) == STEPS and all(m == 0 for m in mismatches)
    assert all(r == 1.0 for r in values(on, "train/ratio_mean")) and all(k == 0 for k in values(on, "parity/vllm_kl"))
    tokens = sum(values(on, "reward/completion_tokens_mean")) * 64
    print(f"\n[e2e on] {STEPS} steps x 64 samples, ~{tokens:.0f} sampled tokens: mismatched per step {mismatches}; "
          f"reward {[round(r, 3) for r in values(on, 'reward/reward_mean')]}")  # fmt: skip

    off = run(tmp_path, model_dir, "off", batch_invariant=False, extra=["--correction", "mis"])
    off_mismatches = values(off, "parity/mismatched_tokens")
    assert len(off_mismatches) == STEPS and all(m > 0 for m in off_mismatches)
    assert all(0 < w for w in values(off, "train/correction_ess")) and "parity/sampler_perplexity" in off.Tags()["scalars"]
    print(f"[e2e off, sequence-level MIS] weight mean {values(off, 'train/correction_weight_mean')}, "
          f"masked {values(off, 'train/correction_cut_frac')}")
    print(f"[e2e off] mismatched tokens per step {off_mismatches}; "
          f"vllm_kl {[f'{k:.2e}' for k in values(off, 'parity/vllm_kl')]}")  # fmt: skip

    check_the_checkpoint_serves_the_trainers_bits(tmp_path / "checkpoints" / "on" / f"step_{STEPS:06d}")

    # Same seed, same run: the reward and loss curves come out bit for bit the same, also with an
    # eager engine (CUDA graphs replay the eager kernels), recomputed activations, a correction
    # whose weights are all exactly 1, and vLLM asleep while the trainer trains: its share so large
    # that it no longer fits beside the trainer (at 12%, "on" kept it awake).
    extra = ["--no-vllm-cuda-graphs", "--activation-checkpointing", "--correction", "mis"]
    share = share_that_sleeps(script_command(tmp_path, model_dir, "on_again", True, extra)[0])
    again = run(tmp_path, model_dir, "on_again", batch_invariant=True,
                extra=[*extra, "--vllm-gpu-memory", str(share)])
    assert values(on, "memory/train_gib")[-1] > values(on, "memory/generate_gib")[-1] - 1  # awake: still there
    assert values(again, "memory/train_gib")[-1] < values(again, "memory/generate_gib")[-1] / 2  # asleep
    assert all(m == 0 for m in values(again, "parity/mismatched_tokens"))
    assert values(again, "train/correction_weight_mean") == [1.0] * STEPS
    assert values(again, "train/correction_cut_frac") == [0.0] * STEPS
    for tag in ("reward/reward_mean", "train/loss", "train/grad_norm"):
        assert values(again, tag) == values(on, tag), tag


def check_the_checkpoint_serves_the_trainers_bits(ckpt: Path) -> None:
    """A run's checkpoint: vLLM serves it and its logprobs are the trainer's, bit for bit; transformers loads
    it as the same model."""
    engine = start_engine(ckpt, 0.05, max_model_len=512, seed=0, sleep_mode=False, kv_cache_gib=1)
    model = simple_rl.load_qwen3(ckpt, "cuda")
    assert engine.weights_checksum() == simple_rl.trainer_checksum(model, simple_rl.World())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.args.vocab_size, (int(n),), generator=g).tolist() for n in torch.randint(20, 300, (300,), generator=g)]
    completions, vllm_lps = engine.generate(prompts, [128] * 300, 1.0, list(range(300)), ignore_eos=True)
    with torch.no_grad():
        batch = simple_rl.pack_sequences(prompts, completions, "cuda")
        ours = model(batch)[0].cpu()
    assert torch.equal(ours.view(torch.int32), torch.cat(vllm_lps).view(torch.int32))

    # ... and transformers loads it as the same model. Compared in fp32 on the CPU: in this process
    # vLLM's batch-invariant mode routes CUDA bmm/softmax through Triton kernels (TF32 dots).
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    reference = simple_rl.load_qwen3(ckpt, "cpu", kernels=REFERENCE, dtype=torch.float32)
    seq = prompts[0] + completions[0]
    batch = simple_rl.pack_sequences([seq[:1]], [seq[1:]], "cpu")
    with torch.no_grad():
        hidden = reference.hidden_states(batch.tokens, batch.positions, batch.spans)
        ours = torch.nn.functional.linear(hidden, reference.output_weight)
        torch.testing.assert_close(ours, hf(torch.tensor([seq])).logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("offload", [[], ["--offload-optimizer"]], ids=["", "offloaded optimizer"])
def test_a_run_killed_mid_step_resumes_bit_for_bit(tmp_path, offload):
    """kill -9 during step 5 of 6, after the step-4 checkpoint; --resume from it ends with the weights
    and TensorBoard scalars of the run that was never stopped, and 0 mismatched tokens throughout."""
    model_dir = write_gsm8k_model(tmp_path / "model", device="cuda", hidden=256, layers=4, heads=4, kv_heads=2,
                                  head_dim=128, intermediate=768)
    check_a_kill_and_resume(tmp_path, model_dir, offload)


def check_a_kill_and_resume(tmp_path, model_dir: Path, flags: list[str]) -> None:
    """kill -9 in step 5 of 6, after the step-4 checkpoint; --resume from it gives the uninterrupted run's
    weights and scalars, 0 mismatched tokens throughout."""
    from safetensors.torch import load_file

    extra = ["--steps", "6", "--save-every", "2", "--keep-last", "0", "--eval-every", "2", *flags]
    whole = run(tmp_path, model_dir, "whole", batch_invariant=True, extra=extra)

    command, env = script_command(tmp_path, model_dir, "killed", batch_invariant=True, extra=extra)
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = tmp_path / "checkpoints" / "killed" / "step_000004"
    deadline = time.time() + 600
    while not checkpoint.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)  # now in step 5's rollout
    process.wait()
    assert checkpoint.exists() and not (checkpoint.parent / "step_000006").exists()
    resumed = run(tmp_path, model_dir, "killed", batch_invariant=True, extra=[*extra, "--resume", str(checkpoint)])

    a = load_file(tmp_path / "checkpoints" / "whole" / "step_000006" / "model.safetensors")
    b = load_file(checkpoint.parent / "step_000006" / "model.safetensors")
    assert all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)
    tags = [t for t in whole.Tags()["scalars"] if not t.startswith(("time/", "perf/", "memory/"))]
    for tag in tags:
        assert [(e.step, e.value) for e in resumed.Scalars(tag)] == [(e.step, e.value) for e in whole.Scalars(tag)], tag
    assert values(resumed, "parity/mismatched_tokens") == [0.0] * 6


def test_chat_format_run_is_bitwise(tmp_path):
    """--prompt-format chat --thinking with Qwen3's chat template (stop at <|im_end|>, a warm start on
    answers that end with it): bitwise every step."""
    model_dir = write_chat_model(tmp_path / "chat", device="cuda", hidden=256, layers=2, heads=4, kv_heads=2,
                                 head_dim=128, intermediate=512)
    events = run(tmp_path, model_dir, "chat", batch_invariant=True,
                 extra=["--prompt-format", "chat", "--thinking", "--steps", "3", "--sft-steps", "20",
                        "--sft-lr", "1e-3", "--eval-every", "0"])
    assert values(events, "parity/mismatched_tokens") == [0.0] * 3


def test_an_inexact_run_locates_where_the_bits_part(tmp_path):
    """Batch invariance off and --locate-divergence: at every step the first mismatching sample is run
    through vLLM (hooks on its modules) and the trainer, the first op whose bits differ is printed, and
    the run goes on."""
    model_dir = write_gsm8k_model(tmp_path / "model", device="cuda", hidden=256, layers=4, heads=4, kv_heads=2,
                                  head_dim=128, intermediate=768)
    located = locate_divergences(tmp_path, model_dir, simple_rl.FeedForward.KERNEL_CALLS)
    print("\n[locator, batch invariance off] " + "\n".join(located))


def locate_divergences(tmp_path, model_dir: Path, ffn_ops) -> list[str]:
    """Two steps of a run without batch invariance, with --locate-divergence: its 'first divergence' lines.
    Which op parts first depends on the batch (vLLM's kernels without batch invariance); each line must name a
    layer and one of its ops (`ffn_ops`: the feed-forward's)."""
    command, env = script_command(tmp_path, model_dir, "located", batch_invariant=False,
                                  extra=["--locate-divergence"])
    command[command.index("--steps") + 1] = "2"
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    located = [line for line in result.stdout.splitlines() if "first divergence: " in line]
    ops = ("residual_in", "residual", *simple_rl.TransformerBlock.KERNEL_CALLS, *simple_rl.Attention.KERNEL_CALLS,
           *ffn_ops)
    named = re.compile(r"first divergence: layer \d+ (" + "|".join(ops) + "): ")
    assert len(located) == 2 and all(named.search(line) for line in located), located
    return located


def test_qwen3_thinking_mode_sampling_is_bitwise(tmp_path):
    """Qwen3's recommended thinking-mode sampling (temperature 0.6, top-k 20, top-p 0.95) end to end: 0
    mismatched tokens at every step, the sampler-vs-trainer KL exactly 0, and the kept set logged."""
    model_dir = write_gsm8k_model(tmp_path / "model", device="cuda", hidden=256, layers=4, heads=4, kv_heads=2,
                                  head_dim=128, intermediate=768)
    events = run(tmp_path, model_dir, "thinking", batch_invariant=True,
                 extra=["--temperature", "0.6", "--top-k", "20", "--top-p", "0.95", "--kl-coef", "0", "--steps", "4",
                        "--eval-every", "0"])
    assert values(events, "parity/mismatched_tokens") == [0.0] * 4 and values(events, "parity/vllm_kl") == [0.0] * 4
    kept, cut = values(events, "train/kept_tokens"), values(events, "train/cut_mass")
    print(f"\n[thinking-mode sampling] kept tokens per step {[round(k, 1) for k in kept]}, cut mass {cut}")
    assert all(1 <= k <= 20 for k in kept) and all(0 <= c < 1 for c in cut)


def test_a_save_copies_the_gpu_state_and_adamw_goes_on_beneath_its_write(tmp_path, monkeypatch):
    """On the GPU a save queues copies of the weights and training state to host memory and returns before
    they land (held here behind a sleep on their stream). AdamW's next step is queued at once, while the write
    is held: it waits for the copies on the GPU, not for the write. A save whose write is not held: DCP's
    thread waits for the copies. Each checkpoint holds the state of the step that saved it, bit for bit."""
    import threading

    from safetensors.torch import load_file
    from test_rl import adam_step, flat_tensors, training_state

    model_dir = write_gsm8k_model(tmp_path / "model")
    model = simple_rl.load_qwen3(model_dir, "cuda")
    optimizer = simple_rl.MasterWeights(model, 1e-3, 0.0)
    args = simple_rl.Args(run=simple_rl.Run(run_name="r", output_dir=str(tmp_path / "checkpoints"), keep_last=0))
    checkpoints = plumbing.Checkpoints(model, functools.partial(simple_rl.hf_weights, model), optimizer, None,
                                      model_dir, args, simple_rl.World())
    release, write_data = threading.Event(), FileSystemWriter.write_data
    monkeypatch.setattr(FileSystemWriter, "write_data", lambda *a: release.wait(60) and write_data(*a))

    def snapshot():  # copied: .cpu() of a host tensor is that tensor, which the next step would change
        state = flat_tensors(plumbing.training_state(optimizer, None))
        return ({k: v.to("cpu", copy=True) for k, v in state.items()},
                {name: w.cpu() for name, w in simple_rl.hf_weights(model)})

    def delayed_save(step: int) -> None:
        torch.cuda.synchronize()
        with torch.cuda.stream(checkpoints.copies):
            torch.cuda._sleep(2_000_000_000)  # about a second
        checkpoints.save(step, {"tokens_checked": 0, "mismatched_tokens": 0})
        assert not checkpoints.copies.query()  # returned before its copies landed

    adam_step(optimizer, 0)
    states = [snapshot()]
    delayed_save(1)
    adam_step(optimizer, 1)  # its gradient norm's read waits for AdamW, which waited for the copies
    assert not release.is_set()  # the write still held
    release.set()
    checkpoints.wait()
    states.append(snapshot())
    delayed_save(2)  # the write goes at once: without its wait it would write what the buffers held before
    checkpoints.wait()
    masters = [k for k in states[0][0] if k.startswith("masters.")]
    assert not any(torch.equal(states[0][0][k], states[1][0][k]) for k in masters)  # AdamW stepped
    for step, (state, weights) in enumerate(states, start=1):
        out = tmp_path / "checkpoints" / "r" / f"step_{step:06d}"
        saved = flat_tensors(training_state(out))
        assert saved.keys() == state.keys() and [k for k in state if not torch.equal(saved[k], state[k])] == []
        hf = load_file(out / "model.safetensors")
        assert all(torch.equal(hf[k].view(torch.int16), w.view(torch.int16)) for k, w in weights.items())
