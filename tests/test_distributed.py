"""The data-parallel trainer (torchrun's environment, FSDP2) on the CPU: two processes over gloo, each
with half of the step's GRPO groups, make the update that one process makes with all of them, and
gather the same Hugging Face weights and checksum."""

import dataclasses
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import gsm8k_rows, qwen3_config, write_checkpoint, write_gsm8k_model, write_jsonl

import simple_rl

GROUPS, G = 4, 4


def step_rollouts(model) -> simple_rl.Rollouts:
    """GROUPS x G samples of random prompts and completions of unequal lengths, sampled (in this test)
    by the trainer itself, so every ratio is 1."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(GROUPS)]
    prompts = [p for p in prompts for _ in range(G)]
    completions = [torch.randint(0, 256, (int(torch.randint(2, 13, (1,), generator=g)),), generator=g).tolist()
                   for _ in prompts]
    with torch.no_grad():
        logprobs = model(simple_rl.pack_sequences(prompts, completions, "cpu"))[0]
    rewards = torch.randint(0, 2, (len(prompts),), generator=g).float()
    return simple_rl.Rollouts(prompts, completions, list(logprobs.split([len(c) for c in completions])),
                              rewards, simple_rl.group_advantages(rewards, G, True))


def one_update(model_dir, rank: int, world: int) -> dict:
    model = simple_rl.load_qwen3(model_dir, "cpu", dtype=torch.float32)
    rollouts = step_rollouts(model)
    if world > 1:  # this rank's whole groups, as the script deals them
        share = slice(rank * len(rollouts.prompts) // world, (rank + 1) * len(rollouts.prompts) // world)
        rollouts = simple_rl.Rollouts(*(getattr(rollouts, f.name)[share] for f in dataclasses.fields(rollouts)))
        simple_rl.shard_model(model)
    checksum = simple_rl.trainer_checksum(model)  # of the whole weights, from the shards
    # A checkpoint's tensors are gathered by every rank but kept on the host by rank 0 alone.
    kept = [simple_rl.whole(p) is not None for p in model.parameters()]  # all of them: each is a collective
    assert kept == [rank == 0] * len(kept)
    trace = simple_rl.trainer_trace(model, rollouts.prompts[0] + rollouts.completions[0])  # the locator's
    optimizer = simple_rl.MasterWeights(model, lr=1e-3, weight_decay=0.0)
    # Micro-batches of at most 40 tokens: the ranks cut their samples into different numbers of them.
    args = simple_rl.Args(max_tokens_per_microbatch=40)
    metrics, _ = simple_rl.train_on_rollouts(model, optimizer, rollouts, None, args)
    grads = {name: simple_rl.full(m.grad).clone() for m, (name, _) in zip(optimizer.masters, optimizer.named)}
    grad_norm, deltas = optimizer.step(1e-3, max_grad_norm=0.5)
    weights = {name: simple_rl.full(p).detach().clone() for name, p in model.named_parameters()}
    hf = {name: w.clone() for name, w in simple_rl.hf_weights(model)}  # gathered one by one
    return {"weights": weights, "metrics": metrics, "grad_norm": grad_norm, "deltas": deltas, "hf": hf,
            "grads": grads, "checksum": checksum, "trace": trace}


def worker(rank: int, world: int, port: int, model_dir, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    assert simple_rl.init_distributed("cpu") == world
    result = one_update(model_dir, rank, world)
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_make_the_update_of_one(tmp_path):
    model_dir = write_checkpoint(tmp_path / "model", qwen3_config(layers=3), seed=1)
    single = one_update(model_dir, 0, 1)
    mp.spawn(worker, args=(2, free_port(), model_dir, tmp_path / "two.pt"), nprocs=2)
    two = torch.load(tmp_path / "two.pt")

    assert two["checksum"] == single["checksum"]
    assert simple_rl.first_divergence(two["trace"], single["trace"], 3).startswith("no intermediate tensor differs")
    assert single["weights"].keys() == two["weights"].keys() and single["hf"].keys() == two["hf"].keys()
    # The step's fp32 gradients agree to fp32 rounding: the sums only ran in another order. AdamW's
    # first step moves a weight by about lr * g / (|g| + eps), which magnifies that rounding where
    # g nearly cancels: the weights agree to 1% of the step size (lr 1e-3).
    for name, g in single["grads"].items():
        torch.testing.assert_close(two["grads"][name], g, rtol=1e-5, atol=1e-6 * float(g.abs().max()), msg=name)
    for name, w in single["hf"].items():
        torch.testing.assert_close(two["hf"][name], w, rtol=1e-5, atol=1e-5, msg=name)
    moved = 0
    for name, w in single["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=1e-5, atol=1e-5, msg=name)
        moved += int((w != model_weight(model_dir, name)).sum())
    assert moved > 0.9 * sum(w.numel() for w in single["weights"].values())  # the update did something
    assert abs(two["grad_norm"] - single["grad_norm"]) <= 1e-5 * single["grad_norm"]
    assert single["grad_norm"] > 0.5  # so the clip acted, on the norm over both ranks' shards
    for name, value in single["metrics"].items():
        assert abs(two["metrics"][name] - value) <= 1e-5 * max(1.0, abs(value)), name
    for layer, (change, relative) in single["deltas"].items():
        assert abs(two["deltas"][layer][0] - change) <= 1e-4 * change, layer
        assert abs(two["deltas"][layer][1] - relative) <= 1e-4 * relative, layer


def model_weight(model_dir, name: str) -> torch.Tensor:
    return dict(simple_rl.load_qwen3(model_dir, "cpu", dtype=torch.float32).named_parameters())[name].detach()


def main_worker(rank: int, world: int, port: int, workdir, flags: dict) -> None:
    from test_rl import TrainerAsSampler

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    os.chdir(workdir)
    simple_rl.main(simple_rl.Args(**flags), device="cpu", engine_class=TrainerAsSampler)
    dist.destroy_process_group()


def test_the_script_under_torchrun_samples_what_one_process_samples(tmp_path, monkeypatch):
    """main() in 2 processes (each its own engine, half of each step's questions, a sharded trainer and
    a sharded reference policy) against one process: the same rollouts and rewards at step 0, the same
    losses and gradient norm within bf16 reduction tolerance; rank 0 alone logs and writes the
    checkpoint."""
    from test_rl import TrainerAsSampler, scalar_series

    model_dir = write_gsm8k_model(tmp_path / "model")
    train = write_jsonl(tmp_path / "train.jsonl", gsm8k_rows("train", 40))
    test = write_jsonl(tmp_path / "test.jsonl", gsm8k_rows("test", 10))
    flags = dict(model=str(model_dir), dataset=str(train), eval_dataset=str(test), steps=2, prompts_per_step=4,
                 samples_per_prompt=2, max_new_tokens=6, max_prompt_tokens=400, max_tokens_per_microbatch=500,
                 lr=1e-3, kl_coef=0.01, entropy_coef=0.01, eval_every=2, eval_samples=5, assert_bitwise=False,
                 run_name="run")
    for workdir in ("one", "two"):
        (tmp_path / workdir).mkdir()
    monkeypatch.chdir(tmp_path / "one")
    simple_rl.main(simple_rl.Args(**flags), device="cpu", engine_class=TrainerAsSampler)
    mp.spawn(main_worker, args=(2, free_port(), tmp_path / "two", flags), nprocs=2)

    one, two = (scalar_series(tmp_path / d / "runs" / "run") for d in ("one", "two"))
    assert one.keys() == two.keys()
    # Step 0: the same samples, with the same logprobs (the sampler's perplexity is of every token).
    for tag in ("reward/reward_mean", "reward/completion_tokens_mean", "parity/sampler_perplexity"):
        assert one[tag][0] == two[tag][0], tag
    assert one["eval/accuracy"][0] == two["eval/accuracy"][0]  # before training, 5 questions over 2 ranks
    for tag in ("train/loss", "train/kl_div", "train/entropy", "train/grad_norm"):
        (step, a), (_, b) = one[tag][0], two[tag][0]
        assert step == 0 and abs(a - b) <= 2e-2 * max(abs(a), 1e-3), (tag, a, b)
    assert one["train/grad_norm"][0][1] > 0 and one["train/grad_norm"][1][1] > 0
    checkpoint = tmp_path / "two" / "checkpoints" / "run" / "step_000002"
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / simple_rl.RESUME_DIR / "state.pt").is_file()
    assert simple_rl.load_qwen3(checkpoint, "cpu").args == simple_rl.load_qwen3(model_dir, "cpu").args


class Killed(Exception):
    pass


def resume_worker(rank: int, world: int, port: int, workdir, flags: dict, die_in_step_3: bool) -> None:
    from test_rl import TrainerAsSampler

    class DiesInStep3(TrainerAsSampler):
        """Generation calls: eval, steps 0 and 1, eval, step 2, then step 3's rollout, which dies."""

        def generate(self, *args, **kwargs):
            if self.calls.count("generate") == 5:
                raise Killed
            return super().generate(*args, **kwargs)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    os.chdir(workdir)
    try:
        simple_rl.main(simple_rl.Args(**flags), device="cpu",
                       engine_class=DiesInStep3 if die_in_step_3 else TrainerAsSampler)
    except Killed:
        pass
    dist.destroy_process_group()


def test_a_killed_torchrun_run_resumes_bit_for_bit(tmp_path):
    """2 processes: a run that dies in step 3 of 4, resumed from its step-2 checkpoint (whose training
    state is whole tensors, gathered from the shards), ends with the weights, masters and TensorBoard
    scalars of the run that was never stopped."""
    from safetensors.torch import load_file
    from test_rl import scalar_series

    model_dir = write_gsm8k_model(tmp_path / "model")
    train = write_jsonl(tmp_path / "train.jsonl", gsm8k_rows("train", 40))
    test = write_jsonl(tmp_path / "test.jsonl", gsm8k_rows("test", 10))
    flags = dict(model=str(model_dir), dataset=str(train), eval_dataset=str(test), steps=4, prompts_per_step=2,
                 samples_per_prompt=2, max_new_tokens=6, max_prompt_tokens=400, max_tokens_per_microbatch=500,
                 lr=1e-3, kl_coef=0.01, entropy_coef=0.01, eval_every=2, eval_samples=4, save_every=2,
                 keep_last=0, assert_bitwise=False)
    mp.spawn(resume_worker, args=(2, free_port(), tmp_path, flags | {"run_name": "whole"}, False), nprocs=2)
    mp.spawn(resume_worker, args=(2, free_port(), tmp_path, flags | {"run_name": "killed"}, True), nprocs=2)
    checkpoints = tmp_path / "checkpoints" / "killed"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002"]
    resume = flags | {"resume": str(checkpoints / "step_000002")}
    mp.spawn(resume_worker, args=(2, free_port(), tmp_path, resume, False), nprocs=2)

    whole = tmp_path / "checkpoints" / "whole" / "step_000004"
    for f in ("model.safetensors", "training_state/reference.safetensors"):
        a, b = load_file(whole / f), load_file(checkpoints / "step_000004" / f)
        assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)
    a, b = (torch.load(d / "training_state" / "state.pt", weights_only=True)
            for d in (whole, checkpoints / "step_000004"))
    assert all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"], strict=True))
    assert scalar_series(tmp_path / "runs" / "whole") == scalar_series(tmp_path / "runs" / "killed")
