"""offline_demo.py on the CPU: its task is scored by simple_rl's reward, its model loads in the
trainer, and its figure and summary come from TensorBoard runs."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

import offline_demo
import simple_rl


def test_arithmetic_task_is_scored_by_the_gsm8k_reward():
    rows = offline_demo.arithmetic_rows(500, seed=3, max_operand=50)
    assert all(simple_rl.gsm8k_reward(r["answer"], r["answer"]) == 1.0 for r in rows)
    a, b = map(int, rows[0]["question"].removeprefix("What is ").removesuffix("?").split(" + "))
    assert simple_rl.gsm8k_reward(f"{a} + {b} = {a + b + 1}\n#### {a + b + 1}", rows[0]["answer"]) == 0.0


def test_demo_model_is_a_trainer_checkpoint(tmp_path):
    texts = [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in offline_demo.arithmetic_rows(300, 0, 50)]
    model_dir = offline_demo.write_model(tmp_path, texts, vocab_size=300, hidden=32, head_dim=8)
    model = simple_rl.load_qwen3(model_dir, "cpu")
    assert model.args.vocab_size % 64 == 0 and model.args.vocab_size >= 300


def test_summary_and_plot_from_two_runs(tmp_path):
    for name, rewards, kl in (("demo_on", [0.1] * 10 + [0.4] * 10, 0.0), ("demo_off", [0.1] * 20, 1e-5),
                              ("demo_off_mis", [0.1] * 20, 2e-5)):
        writer = SummaryWriter(str(tmp_path / name))
        for step, r in enumerate(rewards):
            writer.add_scalar("reward/reward_mean", r, step)
            writer.add_scalar("parity/vllm_kl", kl, step)
            writer.add_scalar("parity/mismatched_tokens", 0 if kl == 0 else 7, step)
        writer.close()
    line = offline_demo.summary(tmp_path / "demo_on")
    assert "first 10 0.100 -> last 10 0.400 (4.00x, +0.300)" in line and "total 0" in line
    offline_demo.plot({name: tmp_path / name for name in offline_demo.RUNS}, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_only_takes_short_and_failed_runs(tmp_path):
    """--plot-only over runs/ as runs leave it: one of 4 steps (means over 4, not 10), one that failed before its
    first step (a log, no scalars: said, not plotted), and one never started."""
    writer = SummaryWriter(str(tmp_path / "runs" / "demo_on"))
    for step, r in enumerate([0.2, 0.2, 0.6, 0.6]):
        writer.add_scalar("reward/reward_mean", r, step)
        writer.add_scalar("parity/vllm_kl", 0.0, step)
        writer.add_scalar("parity/mismatched_tokens", 0, step)
    writer.close()
    (tmp_path / "runs" / "demo_off").mkdir()
    (tmp_path / "runs" / "demo_off" / "log.txt").write_text("error: out of memory\n")
    demo = Path(__file__).resolve().parents[1] / "offline_demo.py"
    result = subprocess.run([sys.executable, str(demo), "--plot-only"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "demo_on: 4 steps, mean reward first 4 0.400 -> last 4 0.400 (1.00x, +0.000); mismatched tokens per "
        "step: max 0, total 0", "demo_off: no step logged (runs/demo_off/log.txt says why)"]
    assert not (tmp_path / "demo").exists()  # one run with steps: no figure to compare


def test_without_a_gpu_the_demo_says_so_and_builds_nothing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    demo = Path(__file__).resolve().parents[1] / "offline_demo.py"
    result = subprocess.run([sys.executable, str(demo)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        "error: offline_demo.py trains with vLLM on a GPU, and this machine has none (--plot-only redraws the figure "
        "of existing runs)"]
    assert list(tmp_path.iterdir()) == []
