"""The data-parallel trainer (torchrun's environment, FSDP2) on the CPU: two or four processes over gloo,
each with its share of the step's GRPO groups, make the update that one process makes with all of them,
and gather the same Hugging Face weights and checksum; a run killed on four resumes on two."""

import dataclasses
import functools
import json
import os
import shutil
import socket
import sys
import time
from contextlib import ExitStack
from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import gsm8k_jsonl, make_args, qwen3_config, trace, write_checkpoint, write_gsm8k_model

import batch_invariant_backward
import plumbing
import simple_rl
from batch_invariant_backward import first_divergence

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


def one_update(model_dir, rank: int, size: int, keep_gathered: bool = False, unit_blocks: int = 0) -> dict:
    # units of a few blocks: with activation checkpointing, whose recomputation runs FSDP2's hooks again
    model = simple_rl.load_qwen3(model_dir, "cpu", dtype=torch.float32,
                                 activation_checkpointing=unit_blocks > 0)
    rollouts = step_rollouts(model)
    world = simple_rl.World(rank, size)
    if size > 1:  # this rank's whole groups, as the script deals them
        share = world.share(len(rollouts.prompts))
        rollouts = dataclasses.replace(rollouts, **{f.name: getattr(rollouts, f.name)[share]
                                                    for f in dataclasses.fields(rollouts) if f.name != "sampler_experts"})
        if unit_blocks:  # kept gathered, FSDP2's units of this many blocks (else the tiny blocks in one)
            block = sum(p.numel() for p in model.layers[0].parameters())
            plumbing.KEPT_GATHERED_UNIT_BYTES = 4 * unit_blocks * block
        plumbing.shard_model(model, world, keep_gathered)
    checksum = simple_rl.trainer_checksum(model, world)  # of the whole weights, from the shards
    locator = trace(model, rollouts.prompts[0] + rollouts.completions[0])  # the locator's
    optimizer = simple_rl.MasterWeights(model, lr=1e-3, weight_decay=0.0)
    # Micro-batches of at most 20 rows (a prompt's once for its samples): the ranks cut their samples into
    # different numbers of them.
    args = make_args(max_tokens_per_microbatch=20)
    calls = {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 0}  # FSDP2's collectives, counted

    def counted(name, collective):
        def call(*args, **kwargs):
            calls[name] += 1
            return collective(*args, **kwargs)
        return call
    summed_in_place = []  # per weight-gradient GEMM: did it add into an fp32 sum (`main_grad`)?

    def weight_grad(weight, grad_out, x, original=batch_invariant_backward.weight_grad):
        summed_in_place.append(getattr(weight, "main_grad", None) is not None)
        return original(weight, grad_out, x)
    with ExitStack() as patches:
        for name in calls:
            patches.enter_context(patch.object(dist, name, counted(name, getattr(dist, name))))
        patches.enter_context(patch.object(batch_invariant_backward, "weight_grad", weight_grad))
        metrics, _ = simple_rl.train_on_rollouts(model, optimizer, rollouts, None, args, world)
        metrics |= plumbing.routing_metrics(model, world)  # as grpo_step adds them
    # The weights back in their shards after the step: a forward or a push sees the updated ones; no fp32
    # gradient sum outlives the step on a gathered weight.
    assert size == 1 or all(hasattr(p, "to_local") for p in model.parameters())
    assert size == 1 or all(getattr(p._unsharded_param, "main_grad", None) is None
                            for p in plumbing.fsdp_params(model) if hasattr(p, "_unsharded_param"))
    grads = {name: simple_rl.gathered(plumbing.shard_like(p.main_grad, p)).clone()
             for name, p in optimizer.named}
    grad_norm, changes = optimizer.step(1e-3, max_grad_norm=0.5, world=world)
    deltas = plumbing.weight_deltas(changes, world)
    weights = {name: simple_rl.gathered(p).detach().clone() for name, p in model.named_parameters()}
    hf = {name: w.clone() for name, w in simple_rl.hf_weights(model)}  # gathered one by one
    micro_batches = len(simple_rl.packed_micro_batches(rollouts.prompts, rollouts.completions, 20, "cpu", world))
    units = len(getattr(model, "fsdp_units", []))
    return {"units": units, "weights": weights, "metrics": metrics, "grad_norm": grad_norm, "deltas": deltas, "hf": hf,
            "grads": grads, "checksum": checksum, "trace": locator, "calls": calls, "micro_batches": micro_batches,
            "summed_in_place": summed_in_place}


def leave() -> None:
    """A spawned worker's end, its results written: its process group destroyed, then the process gone at
    once. torch 2.11's gloo (CPU) now and then aborts in its C++ teardown after Python has ended ("terminate
    called without an active exception", faulthandler: no Python frame), failing a test whose work passed:
    in 2 of 4 CPU suite runs one day (a restore on 2 processes, the script on 2)."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def torchrun_env(rank: int, world: int, port: int) -> None:
    """The environment torchrun gives rank `rank` of `world` processes on this host."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))


def worker(rank: int, world: int, port: int, model_dir, out, keep_gathered: bool, unit_blocks: int = 0) -> None:
    torchrun_env(rank, world, port)
    assert plumbing.init_distributed("cpu") == (rank, world)
    result = one_update(model_dir, rank, world, keep_gathered, unit_blocks)
    if rank == 0:
        torch.save(result, out)
    leave()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_name_worker(rank: int, world: int, port: int, out) -> None:
    torchrun_env(rank, world, port)
    place = simple_rl.World(*plumbing.init_distributed("cpu"))
    args = plumbing.agreed_run_name(make_args(run_name=f"grpo_clock_of_rank_{rank}"), place)
    (out / f"rank{rank}").write_text(args.run.run_name)
    leave()


def threads_worker(rank: int, world: int, port: int, out) -> None:
    torchrun_env(rank, world, port)
    os.environ["OMP_NUM_THREADS"] = "1"  # torchrun's, unless set (the other workers keep the test's threads)
    threads = [torch.get_num_threads()]
    with patch.object(os, "sched_getaffinity", return_value=set(range(12))):  # a host of 12 cores
        for host_adamw in (False, True):  # the second call finds the process group made
            plumbing.init_distributed("cpu", host_adamw)
            threads.append(torch.get_num_threads())
    (out / f"rank{rank}").write_text(json.dumps(threads))
    leave()


def test_with_the_optimizer_on_the_host_each_rank_takes_its_share_of_the_cores(tmp_path):
    """torchrun sets OMP_NUM_THREADS=1 for several ranks: the host's AdamW (--offload-optimizer) ran on one
    thread a rank (8B on 2 H200s: 16.9 s a train phase, 9.0 s on 16 threads). With it each rank takes its
    share; without it the count stays (a CPU-run trainer's matmuls sum otherwise on other counts)."""
    mp.spawn(threads_worker, args=(2, free_port(), tmp_path), nprocs=2)
    for r in range(2):
        before, without, with_host_adamw = json.loads((tmp_path / f"rank{r}").read_text())
        assert without == before and with_host_adamw == 6


def test_a_gpu_trainer_runs_torchs_host_work_on_one_thread(monkeypatch):
    """Torch's host threads spin between parallel regions, and beside another busy thread (a checkpoint
    write) a region waits for one the kernel put off (1.7B train phase on one H200: 3.7 s, 5.4-6.5 s beside
    one busy process; one thread: 3.7-4.0 s). A GPU trainer alone takes one thread unless OMP_NUM_THREADS
    says otherwise; a host AdamW's process keeps its cores. No GPU is touched: one process joins nothing."""
    host = 4  # a host of several threads, whatever this one has (conftest's `torch_threads` restores it)
    for name in ("OMP_NUM_THREADS", "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    torch.set_num_threads(host)
    assert plumbing.init_distributed("cuda", host_adamw=True) == (0, 1) and torch.get_num_threads() == host
    assert plumbing.init_distributed("cuda") == (0, 1) and torch.get_num_threads() == 1
    torch.set_num_threads(host)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stands
    plumbing.init_distributed("cuda")
    assert torch.get_num_threads() == host


def interrupted_worker(rank: int, world: int, port: int, model_dir, out) -> None:
    """A step whose micro-batch loop fails, and a push whose reader stops at the first block, each caught."""
    torchrun_env(rank, world, port)
    place = simple_rl.World(*plumbing.init_distributed("cpu"))
    model = simple_rl.load_qwen3(model_dir, "cpu", dtype=torch.float32)
    rollouts = step_rollouts(model)
    share = place.share(len(rollouts.prompts))
    rollouts = dataclasses.replace(rollouts, **{f.name: getattr(rollouts, f.name)[share]
                                                for f in dataclasses.fields(rollouts) if f.name != "sampler_experts"})
    plumbing.shard_model(model, place, keep_gathered=True)
    optimizer = simple_rl.MasterWeights(model, lr=1e-3, weight_decay=0.0)

    def fails():
        raise RuntimeError("in the loop")
    optimizer.accumulate_grads = fails
    sharded = {}
    with pytest.raises(RuntimeError, match="in the loop"):
        simple_rl.train_on_rollouts(model, optimizer, rollouts, None, make_args(max_tokens_per_microbatch=40), place)
    sharded["after a failed step"] = all(hasattr(p, "to_local") for p in model.parameters()) and not any(
        p.unsharded_accumulated_grad is not None or getattr(p._unsharded_param, "grad", None) is not None
        or getattr(p._unsharded_param, "main_grad", None) is not None  # nothing the next step would add to
        for p in plumbing.fsdp_params(model) if hasattr(p, "_unsharded_param"))
    for name, _ in simple_rl.hf_weights(model):
        if name.startswith("model.layers.0."):
            break
    sharded["after a stopped push"] = all(hasattr(p, "to_local") for p in model.parameters())
    ref_model = plumbing.shard_model(simple_rl.load_qwen3(model_dir, "cpu", dtype=torch.float32), place)
    simple_rl.reference_logprobs(ref_model, rollouts, make_args(max_tokens_per_microbatch=40), place)
    sharded["after the reference's logprobs"] = all(hasattr(p, "to_local") for p in ref_model.parameters())
    if rank == 0:
        torch.save(sharded, out)
    leave()


def phases_worker(rank: int, world: int, port: int, out) -> None:
    torchrun_env(rank, world, port)
    place = simple_rl.World(*plumbing.init_distributed("cpu"))
    times = {}
    place.barrier()  # both clocks start together (gloo's init does not line the ranks up)
    with plumbing.timed_phase("generate", times, {}, place):
        time.sleep(1.0 * rank)  # rank 1's share takes a second longer to generate
    with plumbing.timed_phase("train", times, {}, place):
        place.sum(torch.ones(1))  # the train phase's first collective
    if rank == 0:
        torch.save(times, out)
    leave()


def test_a_phase_ends_on_every_rank_when_the_slowest_rank_ends_it(tmp_path):
    """Rank 0 generates its share a second before rank 1: the second is its generate phase's, not its train
    phase's (whose first collective it would otherwise wait in)."""
    mp.spawn(phases_worker, args=(2, free_port(), tmp_path / "times.pt"), nprocs=2)
    times = torch.load(tmp_path / "times.pt")
    # rank 0 may leave the barrier a little after rank 1 (measured: 2 ms under load), so a little under 1 s
    assert times["generate"] >= 0.9 and times["train"] < 0.5


def test_an_error_mid_step_or_mid_push_leaves_every_weight_sharded(tmp_path):
    """Kept gathered for a step, the weights are resharded even if the micro-batch loop fails (no gathered
    gradient or fp32 sum left for the next step to add to), and a push's reader that stops leaves no unit
    gathered: caught, no gathered copy outlives AdamW's update of the shards.
    The reference policy's forwards (no backward) leave its root sharded too: its memory is planned so."""
    model_dir = write_checkpoint(tmp_path / "model", qwen3_config(layers=2), seed=1)
    mp.spawn(interrupted_worker, args=(2, free_port(), model_dir, tmp_path / "out.pt"), nprocs=2)
    assert torch.load(tmp_path / "out.pt") == {"after a failed step": True, "after a stopped push": True,
                                               "after the reference's logprobs": True}


def test_every_rank_takes_rank_0s_run_name(tmp_path):
    """Each rank names a run by its own clock (`check_args`); two clocks can read different seconds, and a
    rank's logs and checkpoint shards would go to another folder: every rank takes rank 0's name."""
    mp.spawn(run_name_worker, args=(2, free_port(), tmp_path), nprocs=2)
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["grpo_clock_of_rank_0"] * 2


@pytest.mark.parametrize("processes, keep_gathered, experts", [(2, False, 0), (2, True, 0), (2, False, 4),
                                                                 (4, False, 0), (4, True, 2)],
                         ids=["", "kept gathered", "mixture of experts", "4 processes",
                              "4 processes, kept gathered, 2 experts"])
def test_processes_make_the_update_of_one(tmp_path, processes, keep_gathered, experts):
    """FSDP2 gathering the weights at every micro-batch, or once a step (its gradients then reduce-scattered
    once, after the last micro-batch): the update of one process. A mixture of experts too (its (E, ...)
    expert tensors sharded by expert; its routing metrics summed over the ranks). Four processes: a GRPO
    group each; with 2 experts, two ranks hold none of the experts' weights (empty shards); kept gathered,
    FSDP2 units of 2 blocks and of 1 (the push's names and weights gathered a unit at a time), with activation
    checkpointing."""
    config = qwen3_config(layers=3, experts=experts, experts_per_token=2, moe_intermediate=32)
    model_dir = write_checkpoint(tmp_path / "model", config, seed=1)
    single = one_update(model_dir, 0, 1)
    unit_blocks = 2 if keep_gathered and processes == 4 else 0  # units of 2 blocks and 1, then the root's
    mp.spawn(worker, args=(processes, free_port(), model_dir, tmp_path / "two.pt", keep_gathered, unit_blocks),
             nprocs=processes)
    two = torch.load(tmp_path / "two.pt")

    assert two["checksum"] == single["checksum"]
    # FSDP2's units: a block each, or kept gathered the 3 tiny blocks together; and the root
    units, micro_batches = two["units"], two["micro_batches"]
    assert units == (3 if unit_blocks else 2 if keep_gathered else 3 + 1)
    assert micro_batches >= 6 // processes and two["calls"]["reduce_scatter_tensor"] == units * (
        1 if keep_gathered else micro_batches)
    gathers = two["calls"]["all_gather_into_tensor"]  # kept gathered: from the first forward to the last backward
    assert gathers == units if keep_gathered else gathers <= 2 * units * micro_batches
    # Kept gathered, every weight-gradient GEMM adds into its fp32 sum, as one process's do.
    assert all(single["summed_in_place"]) and set(two["summed_in_place"]) == {keep_gathered}
    assert first_divergence(two["trace"], single["trace"]).startswith("no intermediate tensor differs")
    assert single["weights"].keys() == two["weights"].keys() and single["hf"].keys() == two["hf"].keys()
    # The step's fp32 gradients agree to fp32 rounding: the sums only ran in another order. AdamW's
    # first step moves a weight by about lr * g / (|g| + eps), which magnifies that rounding where
    # g nearly cancels: the weights agree to 2% of the step size (lr 1e-3; one element in 4,096 of a q
    # projection moved 1.5% of it apart once the packing laid a prompt once for its samples).
    for name, g in single["grads"].items():
        torch.testing.assert_close(two["grads"][name], g, rtol=1e-5, atol=2e-6 * float(g.abs().max()), msg=name)
    for name, w in single["hf"].items():
        torch.testing.assert_close(two["hf"][name], w, rtol=1e-5, atol=2e-5, msg=name)
    moved = 0
    for name, w in single["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=1e-5, atol=2e-5, msg=name)
        moved += int((w != model_weight(model_dir, name)).sum())
    assert moved > 0.9 * sum(w.numel() for w in single["weights"].values())  # the update did something
    assert abs(two["grad_norm"] - single["grad_norm"]) <= 1e-5 * single["grad_norm"]
    assert single["grad_norm"] > 0.5  # so the clip acted, on the norm over both ranks' shards
    assert experts == 0 or "expert_load_max_over_mean/layer_02" in single["metrics"]
    for name, value in single["metrics"].items():
        assert abs(two["metrics"][name] - value) <= 1e-5 * max(1.0, abs(value)), name
    for layer, (change, relative) in single["deltas"].items():
        assert abs(two["deltas"][layer][0] - change) <= 1e-4 * change, layer
        assert abs(two["deltas"][layer][1] - relative) <= 1e-4 * relative, layer


def model_weight(model_dir, name: str) -> torch.Tensor:
    return dict(simple_rl.load_qwen3(model_dir, "cpu", dtype=torch.float32).named_parameters())[name].detach()


def main_worker(rank: int, world: int, port: int, workdir, flags: dict, dies: bool = False) -> None:
    """simple_rl.main() as rank `rank` of `world` torchrun processes (with the test engine)."""
    from test_rl import DiesInStep3, Killed, TrainerAsSampler

    torchrun_env(rank, world, port)
    os.chdir(workdir)
    try:
        simple_rl.main(make_args(**flags), device="cpu", engine_class=DiesInStep3 if dies else TrainerAsSampler)
    except Killed:
        pass
    leave()


def run(world: int, workdir, flags: dict, dies: bool = False) -> None:
    """main() in `world` processes (torchrun's environment, gloo), or in this one."""
    if world == 1:
        from test_rl import DiesInStep3, Killed, TrainerAsSampler

        cwd = os.getcwd()
        os.chdir(workdir)
        try:
            simple_rl.main(make_args(**flags), device="cpu", engine_class=DiesInStep3 if dies else TrainerAsSampler)
        except Killed:
            pass
        finally:
            os.chdir(cwd)
    else:
        mp.spawn(main_worker, args=(world, free_port(), workdir, flags, dies), nprocs=world)


def small_flags(model_dir, **flags) -> dict:
    return dict(model=str(model_dir), dataset=str(gsm8k_jsonl("train")), eval_dataset=str(gsm8k_jsonl("test")),
                samples_per_prompt=2, max_new_tokens=6, max_prompt_tokens=400, max_tokens_per_microbatch=500,
                lr=1e-3, kl_coef=0.01, entropy_coef=0.01, assert_bitwise=False) | flags


def test_the_script_under_torchrun_samples_what_one_process_samples(tmp_path):
    """main() in 2 processes (each its own engine, half of each step's questions, a sharded trainer and a
    sharded reference policy) against one process: the same rollouts and rewards at step 0, the same losses
    and gradient norm within bf16 reduction tolerance; rank 0 alone logs, and the checkpoint is written."""
    from test_rl import scalar_series

    flags = small_flags(write_gsm8k_model(tmp_path / "model"), steps=2, prompts_per_step=4, eval_every=2,
                        eval_samples=5, run_name="run")
    for workdir in ("one", "two"):
        (tmp_path / workdir).mkdir()
    run(1, tmp_path / "one", flags)
    run(2, tmp_path / "two", flags)

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
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "training_state" / ".metadata").is_file()
    assert simple_rl.load_qwen3(checkpoint, "cpu").args == simple_rl.load_qwen3(tmp_path / "model", "cpu").args


def restore_worker(rank: int, world: int, port: int, checkpoint, model_dir, out) -> None:
    """Restore a checkpoint's training state into a fresh trainer on `world` processes, and write what was
    restored, gathered into whole tensors, to `out`."""
    from test_rl import flat_tensors

    if world > 1:
        torchrun_env(rank, world, port)
    place = simple_rl.World(*plumbing.init_distributed("cpu"))
    model = simple_rl.load_qwen3(checkpoint, "cpu")
    if world > 1:
        plumbing.shard_model(model, place)
    optimizer, ref_model = simple_rl.MasterWeights(model, 1e-3, 0.0), simple_rl.reference_policy(model)
    if world > 1:
        plumbing.shard_model(ref_model, place)
    plumbing.restore_training_state(checkpoint, optimizer, ref_model, make_args(), place)
    state = {k: simple_rl.gathered(v).clone() for k, v in flat_tensors(plumbing.training_state(optimizer, ref_model)).items()}
    if rank == 0:
        torch.save(state, out)
    if world > 1:
        leave()


@pytest.mark.parametrize("saved_on, resumed_on", [(2, 2), (2, 1), (1, 2), (4, 2)])
def test_a_killed_run_resumes_on_any_number_of_processes(tmp_path, saved_on, resumed_on):
    """A run that dies in step 3 of 4 resumes from its step-2 checkpoint, whose training state each rank
    wrote as its own shards. On as many processes it ends with the weights, training state and TensorBoard
    scalars of the run that was never stopped; on another number, every restored tensor equals the saved one
    bit for bit (the gradients are then summed in another order), and the run goes on to its last step."""
    from safetensors.torch import load_file
    from test_rl import flat_tensors, scalar_series, training_state

    flags = small_flags(write_gsm8k_model(tmp_path / "model"), steps=4, prompts_per_step=max(2, saved_on),
                        eval_every=2, eval_samples=4, save_every=2, keep_last=0)
    if saved_on == resumed_on:
        run(saved_on, tmp_path, flags | {"run_name": "whole"})
    run(saved_on, tmp_path, flags | {"run_name": "killed"}, dies=True)
    checkpoints = tmp_path / "checkpoints" / "killed"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002"]
    saved = flat_tensors(training_state(checkpoints / "step_000002"))
    if resumed_on == 1:
        restore_worker(0, 1, 0, checkpoints / "step_000002", tmp_path / "model", tmp_path / "restored.pt")
    else:
        mp.spawn(restore_worker, args=(resumed_on, free_port(), checkpoints / "step_000002", tmp_path / "model",
                                       tmp_path / "restored.pt"), nprocs=resumed_on)
    restored = torch.load(tmp_path / "restored.pt")
    assert restored.keys() == saved.keys() and all(torch.equal(restored[k], saved[k]) for k in saved)

    run(resumed_on, tmp_path, flags | {"resume": str(checkpoints / "step_000002")})
    resumed = checkpoints / "step_000004"
    assert (resumed / "model.safetensors").is_file()
    assert [step for step, _ in scalar_series(tmp_path / "runs" / "killed")["train/loss"]] == [0, 1, 2, 3]
    if saved_on == resumed_on:
        whole = tmp_path / "checkpoints" / "whole" / "step_000004"
        a, b = load_file(whole / "model.safetensors"), load_file(resumed / "model.safetensors")
        assert all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)
        x, y = flat_tensors(training_state(whole)), flat_tensors(training_state(resumed))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        assert scalar_series(tmp_path / "runs" / "whole") == scalar_series(tmp_path / "runs" / "killed")


def peak_rss_worker(rank: int, world: int, port: int, model_dir, out) -> None:
    """Save a checkpoint from `world` processes; write what this rank's resident memory grew by while saving."""
    torchrun_env(rank, world, port)
    place = simple_rl.World(*plumbing.init_distributed("cpu"))
    model = plumbing.shard_model(simple_rl.load_qwen3(model_dir, "cpu"), place)
    optimizer = simple_rl.MasterWeights(model, 1e-3, 0.0)
    plumbing.training_state(optimizer, None)  # AdamW's moments, as after a step
    args = make_args(run_name="r", output_dir=str(out.parent / "checkpoints"), keep_last=0)
    checkpoints = plumbing.Checkpoints(model, functools.partial(simple_rl.hf_weights, model), optimizer, None,
                                      model_dir, args, place)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set (VmHWM) starts again from here
    before = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
    checkpoints.save(1, {})
    checkpoints.wait()  # the write, in the background, ends
    peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
    (out.parent / f"rss_{rank}").write_text(str((peak - before) * 1024))
    leave()


def test_saving_holds_no_more_than_a_shard_and_a_tensor(tmp_path):
    """2 processes save a model whose training state (fp32 masters and AdamW's moments: 12 bytes a parameter,
    6 a rank) dwarfs the rest: neither rank's resident memory grows by more than a third of the state while
    saving. Gathering the state on rank 0 grew it by all of it."""
    config = qwen3_config(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=128, intermediate=512, vocab=65536,
                          tie=False)
    model_dir = write_checkpoint(tmp_path / "model", config)
    params = sum(p.numel() for p in simple_rl.load_qwen3(model_dir, "cpu").parameters())
    mp.spawn(peak_rss_worker, args=(2, free_port(), model_dir, tmp_path / "out"), nprocs=2)
    grown = [int((tmp_path / f"rss_{rank}").read_text()) for rank in (0, 1)]
    state, largest = 12 * params, 2 * 65536 * 256  # bytes: the training state, and the largest bf16 weight
    print(f"\n[save, 2 processes] training state {state / 2**20:.0f} MiB; resident memory grew by "
          f"{grown[0] / 2**20:.0f} / {grown[1] / 2**20:.0f} MiB")
    assert max(grown) < state / 3 + largest
    assert (tmp_path / "checkpoints" / "r" / "step_000001" / "training_state" / ".metadata").is_file()


def test_two_nodes_run_as_one_node_of_two_processes(tmp_path):
    """torchrun's multi-node path, two agents on this host (--nnodes 2, --node-rank 0 and 1, one process each,
    rendezvous on 127.0.0.1): the same TensorBoard scalars, bit for bit, as one node of two processes, and a
    checkpoint both nodes wrote into (one filesystem) that resumes."""
    import json
    import subprocess
    import sys

    from pathlib import Path

    from test_rl import scalar_series

    REPO = Path(__file__).resolve().parents[1]
    flags = small_flags(write_gsm8k_model(tmp_path / "model"), steps=2, prompts_per_step=4, eval_every=0,
                        run_name="run", save_every=1)
    for workdir in ("one_node", "two_nodes"):
        (tmp_path / workdir).mkdir()
    run(2, tmp_path / "one_node", flags)
    script = tmp_path / "node.py"
    script.write_text(f"import json, sys\nsys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]\n"
                      "import simple_rl, test_rl\nfrom conftest import make_args\n"
                      "simple_rl.main(make_args(**json.loads(sys.argv[1])), device='cpu', "
                      "engine_class=test_rl.TrainerAsSampler)\n")
    def launch() -> list[str] | None:  # the two agents' output if either failed
        port = str(free_port())
        agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                                    str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                                    "--log-dir", str(tmp_path / f"torchrun{node}"),
                                    "--master-port", port, str(script), json.dumps(flags)], cwd=tmp_path / "two_nodes",
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
        outputs = [agent.communicate(timeout=600)[0] for agent in agents]
        return None if all(agent.returncode == 0 for agent in agents) else outputs
    # Two launchers racing for a port on a busy machine failed once in seven runs here: a second launch,
    # with the first one's output shown; the bits are compared after either.
    if (failed := launch()) is not None:
        print("the first launch of two agents failed:\n" + "\n".join(out[-2000:] for out in failed))
        shutil.rmtree(tmp_path / "two_nodes")
        (tmp_path / "two_nodes").mkdir()
        assert (failed := launch()) is None, [out[-3000:] for out in failed]
    one, two = (scalar_series(tmp_path / d / "runs" / "run") for d in ("one_node", "two_nodes"))
    times = ("time/", "perf/", "memory/")
    assert {k: v for k, v in one.items() if not k.startswith(times)} == \
        {k: v for k, v in two.items() if not k.startswith(times)}
    checkpoint = tmp_path / "two_nodes" / "checkpoints" / "run" / "step_000001"
    assert (checkpoint / "training_state" / ".metadata").is_file()
    run(2, tmp_path / "two_nodes", flags | {"resume": str(checkpoint), "steps": 3, "run_name": None})
    assert (checkpoint.parent / "step_000003" / "model.safetensors").is_file()
