"""On 2 GPUs, under torchrun: simple_rl.py data-parallel end to end. Every rank's engine samples its
share of the step, every token of the whole step is checked, two runs with one seed end with the same
weights, the step-0 rollouts equal one GPU's, and a killed rank takes the others down quickly.
Skipped on a machine with fewer than 2 GPUs."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import write_gsm8k_model
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_gpu_rl import script_command, values

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 GPUs")]
STEPS = 3


def two_gpu_command(tmp_path, model_dir, name, extra=()) -> tuple[list[str], dict]:
    command, env = script_command(tmp_path, model_dir, name, batch_invariant=True,
                                  extra=["--steps", str(STEPS), "--eval-every", "0", *extra])
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--log-dir", str(tmp_path / f"torchrun_{name}"), *command[1:]], env


def finish(command, env, tmp_path, name):
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    events = EventAccumulator(str(tmp_path / "runs" / name)).Reload()
    weights = load_file(tmp_path / "checkpoints" / name / f"step_{STEPS:06d}" / "model.safetensors")
    return events, weights


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_gsm8k_model(tmp_path_factory.mktemp("model"), device="cuda", hidden=256, layers=4, heads=4,
                             kv_heads=2, head_dim=128, intermediate=768)


def test_two_gpus_are_bitwise_repeat_and_start_as_one_gpu(model_dir, tmp_path):
    runs = [finish(*two_gpu_command(tmp_path, model_dir, name), tmp_path, name) for name in ("a", "b")]
    for events, _ in runs:
        assert values(events, "parity/mismatched_tokens") == [0.0] * STEPS
    (a, weights_a), (b, weights_b) = runs
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k].view(torch.int16), weights_b[k].view(torch.int16)) for k in weights_a)
    for tag in ("reward/reward_mean", "train/loss", "train/grad_norm"):
        assert values(a, tag) == values(b, tag), tag

    # One GPU, same flags: the same samples at step 0 (seeded per request, batch-invariant), so the
    # same rewards; the loss and gradient norm differ only by the order of the sums over ranks.
    command, env = script_command(tmp_path, model_dir, "one", batch_invariant=True,
                                  extra=["--steps", str(STEPS), "--eval-every", "0"])
    one, _ = finish(command, env | {"CUDA_VISIBLE_DEVICES": "0"}, tmp_path, "one")
    print(f"\n[2 GPUs vs 1] reward {values(a, 'reward/reward_mean')} vs {values(one, 'reward/reward_mean')}; "
          f"grad norm {values(a, 'train/grad_norm')} vs {values(one, 'train/grad_norm')}")
    assert values(a, "reward/reward_mean")[0] == values(one, "reward/reward_mean")[0]
    assert values(a, "train/grad_norm")[0] == pytest.approx(values(one, "train/grad_norm")[0], rel=1e-2)
    assert values(a, "train/loss")[0] == pytest.approx(values(one, "train/loss")[0], rel=1e-2, abs=1e-6)


def test_two_nodes_give_the_bits_of_one_node_and_resume(model_dir, tmp_path):
    """torchrun's multi-node path on one host: two agents (--nnodes 2, --node-rank 0 and 1), one GPU each
    (CUDA_VISIBLE_DEVICES), rendezvous on 127.0.0.1, NCCL forced onto sockets. Every TensorBoard scalar but the
    timings and the final weights equal one node of 2 GPUs bit for bit; the checkpoint both nodes wrote into
    (one filesystem here) resumes, bit for bit, to the end."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    command, env = two_gpu_command(tmp_path, model_dir, "run", extra=["--save-every", "1"])
    one, weights_one = finish(command, env, tmp_path / "one", "run")
    script = command[command.index("--log-dir") + 2:]  # simple_rl.py and its flags
    port = str(29500 + os.getpid() % 1000)
    sockets = env | {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                                str(node), "--nproc-per-node", "1", "--log-dir", str(tmp_path / f"torchrun{node}"),
                                "--master-addr", "127.0.0.1", "--master-port",
                                port, *script], cwd=tmp_path / "two", env=sockets | {"CUDA_VISIBLE_DEVICES": str(node)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outputs = [agent.communicate(timeout=900)[0] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), [out[-3000:] for out in outputs]
    two = EventAccumulator(str(tmp_path / "two" / "runs" / "run")).Reload()
    tags = [t for t in one.Tags()["scalars"] if not t.startswith(("time/", "perf/", "memory/"))]
    for tag in tags:
        assert values(one, tag) == values(two, tag), tag
    weights_two = load_file(tmp_path / "two" / "checkpoints" / "run" / f"step_{STEPS:06d}" / "model.safetensors")
    assert all(torch.equal(weights_one[k].view(torch.int16), weights_two[k].view(torch.int16)) for k in weights_one)
    resume = ["--resume", str(tmp_path / "two" / "checkpoints" / "run" / "step_000001")]
    resumed, weights_resumed = finish(*two_gpu_command(tmp_path, model_dir, "run", extra=resume), tmp_path / "two",
                                      "run")
    assert all(torch.equal(weights_one[k].view(torch.int16), weights_resumed[k].view(torch.int16))
               for k in weights_one)


def test_a_killed_rank_stops_the_others_within_a_minute(model_dir, tmp_path):
    command, env = two_gpu_command(tmp_path, model_dir, "killed", extra=["--steps", "50"])
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        launcher = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while "step 1:" not in log.read_text() and launcher.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert launcher.poll() is None, log.read_text()[-3000:]
        workers = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and parent_of(int(pid)) == launcher.pid]
        rank_1 = next(pid for pid in workers if b"RANK=1" in environment_of(pid))
        os.kill(rank_1, signal.SIGKILL)  # in the middle of a step
        killed_at = time.time()
        launcher.wait(timeout=300)
        while any(alive(pid) for pid in workers) and time.time() < killed_at + 300:
            time.sleep(0.2)
    took = time.time() - killed_at
    text = log.read_text()
    print(f"\n[killed rank 1] every process gone {took:.1f} s later; torchrun's exit status {launcher.returncode}")
    assert launcher.returncode != 0 and took < 60
    assert re.search(r"rank\s*:\s*1 ", text) and "SIGKILL" in text, text[-3000:]  # torchrun's summary


def parent_of(pid: int) -> int | None:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def environment_of(pid: int) -> list[bytes]:
    return open(f"/proc/{pid}/environ", "rb").read().split(b"\0")


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is gone
    except OSError:
        return False
