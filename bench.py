"""What exactness costs: one GRPO step of simple_rl.py against a standard non-exact step, same run.

    python bench.py                     # Qwen3-1.7B shape, the script's default config
    python bench.py --shape 4b          # Qwen3-4B shape
    python bench.py --shape 30b-a3b --layers 4 --vllm-gpu-memory 0.2   # Qwen3-30B-A3B's, 4 of its 48 layers
    python bench.py --trainer-only      # the trainer's forward + backward against HF transformers
    python bench.py --gpus 2 --gsm8k train.jsonl            # simple_rl.py on 1 GPU against torchrun on 2
    python bench.py --write-model DIR --gsm8k train.jsonl   # a random model at --shape, to run the script
    python bench.py --fits "8b --offload-optimizer --activation-checkpointing" --gsm8k train.jsonl
                                        # simple_rl.py on one GPU: step time, peak GPU and host memory
    python bench.py --fits "8b --activation-checkpointing" --gpus 2 --gsm8k train.jsonl   # on 2 GPUs

Step benchmark. Both sides run the same GRPO step on the same random weights, the same prompts
(--prompts random token prompts of 80-200 tokens, --samples each) and the same lengths (every
completion --max-new-tokens long, or --lengths thinking: spread as a thinking model's are; `ignore_eos`),
and share one GPU at the same --vllm-gpu-memory (standard: in turns, with vLLM's sleep mode, as TRL and verl
run it; exact: as the script, vLLM awake beside the trainer where its memory plan fits both):
- exact: simple_rl.py's own step with VLLM_BATCH_INVARIANT=1: vLLM batch-invariant with CUDA
  graphs and no compile, the trainer on vLLM's kernels in packed micro-batches, every sampled
  token's logprob asserted bitwise equal, the in-process push verified by checksum;
- standard: vLLM's defaults (torch.compile + CUDA graphs, batch invariance off) and Hugging Face
  transformers' Qwen3 (SDPA, padded micro-batches of as many tokens), the same PPO-clip loss, AdamW
  on fp32 master weights, the in-process push (a mixture of experts' as Hugging Face names each expert).
Each side runs in its own process (vLLM reads VLLM_BATCH_INVARIANT at import), twice, in the order
standard, exact, exact, standard; each process runs one warm-up step and --iters timed steps, and a
side's figures are the medians over the timed steps of both its processes. Peak GPU memory is the
whole device's, as nvidia-smi reports it every 20 ms (vLLM, the trainer and the CUDA context: the
whole process; this one holds none). After its timed steps, each exact process goes on as the script does
with --save-every 4 (--save-every here): a checkpoint at the next step (the process's first save) and 4
steps later, their writes going on in the background beneath the steps after them (at 4, an H100 machine's
0.9 GB/s disk ends the 1.7B shape's 24 GB write before the next save; at 2 it does not). It reports each
step that saves (its phases and what its save held training: waiting for the previous write if it had not
ended, copying to host memory) and each step beneath a write against the median plain step (the timed
ones and --save-every more after the last write: an H200 at its power cap moves a step 0.3 s either way;
the plain steps' own spread printed beside), each write's seconds and rate (a disk slower than the saves
shows as waiting), the wait for the last write at the end, and the seconds the page-locked memory took to
make at the start.
Each timed step's median vLLM engine step is printed too, both sides, and the GPU time of the model's forward
in it (CUDA events): the rest is vLLM's host work, which bounds a step at 256 sequences (H100: 7.4 ms
of forward in steps of 9.5-15 ms, the host's speed moving by half between generations).

Scaling benchmark (--gpus N). simple_rl.py itself, end to end, on a random model of --shape with a
tokenizer trained on --gsm8k (also its questions): `python simple_rl.py` on one GPU, then `torchrun
--nproc-per-node N simple_rl.py` on N with the same flags (the step benchmark's, and --eval-every 0:
strong scaling), then on N with N times the prompts (weak scaling: as many tokens per GPU as the one
GPU's). The figures are the script's own phase times and mismatch counts, read from its TensorBoard
run, means of the steps after the first; peak memory is each GPU's, from nvidia-smi. The weak run's
train phase over the one GPU's is what the sharded trainer costs per token.
"""

import argparse
import collections
import contextlib
import functools
import gc
import itertools
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import batch_invariant_backward
import plumbing
import simple_rl
from offline_demo import qwen3_config, write_checkpoint, write_tokenizer

HERE = Path(__file__).resolve().parent
SHAPES = {
    "1.7b": dict(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=6144, tie=True),
    "4b": dict(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728, tie=True),
    "8b": dict(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288, tie=False),
    "30b-a3b": dict(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, intermediate=6144, tie=False,
                    experts=128, experts_per_token=8, moe_intermediate=768),  # with --layers: one GPU holds 8
}


def shape_config(shape: str, layers: int | None = None, eos_token_id: int = 1) -> dict:
    """The Hugging Face config.json of a Qwen3 shape (vocabulary 151936, 40960 positions)."""
    sizes = SHAPES[shape] | ({"layers": layers} if layers else {})
    return qwen3_config(**sizes, vocab=151936, max_positions=40960, eos_token_id=eos_token_id)


@contextmanager
def watch_gpus(out: dict, gpus: list[str] | None = None):
    """The devices as nvidia-smi reports them every 20 ms while the block runs (`gpu_samples`): each of
    `gpus`' (default: the first visible one) peak memory in use, in GiB, to out["peak_gib"], a list; and
    how fast the first ran while busy, to out["busy_gpu"]. nvidia-smi polls from its own process, so the
    polling takes no time from the processes measured."""
    gpus = gpus or visible_gpus()[:1]
    query = ["nvidia-smi", "-i", ",".join(gpus), "--format=csv,noheader,nounits", "-lms", "20",
             "--query-gpu=index,memory.used,utilization.gpu,clocks.sm,clocks_event_reasons.active"]
    with tempfile.TemporaryFile("w+") as log:
        smi = subprocess.Popen(query, stdout=log)
        try:
            yield
        finally:
            smi.terminate()
            smi.wait()
            log.seek(0)
            out |= gpu_samples(log.read())


# nvidia-smi's clocks_event_reasons bits that hold the SM clock down for power or heat: the software power
# cap (an H200 at 700 W meets it in most busy seconds), software and hardware thermal slowdown, power brake
HELD_BACK = 0x4 | 0x20 | 0x40 | 0x80


def gpu_samples(text: str) -> dict:
    """`watch_gpus`' nvidia-smi lines ("index, MiB, utilization %, SM MHz, 0x event reasons"): each GPU's
    peak memory in GiB ("peak_gib", by index) and, over the samples in which the first GPU was busy (50% or
    more utilization), its mean SM clock and the share of them in which power or heat held it back
    ("busy_gpu"): the same code runs slower on a GPU held back more, and hosts differ in it."""
    rows = [[f.strip() for f in line.split(",")] for line in text.splitlines()]
    rows = [r for r in rows if len(r) == 5 and r[0].isdigit() and r[1].isdigit()]
    peaks = {}
    for index, used, *_ in rows:
        peaks[int(index)] = max(peaks.get(int(index), 0), int(used) / 1024)
    first = min(peaks, default=None)
    busy = [(int(mhz), reasons.startswith("0x") and bool(int(reasons, 16) & HELD_BACK))
            for index, _, utilization, mhz, reasons in rows
            if int(index) == first and utilization.isdigit() and int(utilization) >= 50 and mhz.isdigit()]
    return {"peak_gib": [peaks[i] for i in sorted(peaks)],
            "busy_gpu": {"samples": len(busy), "sm_mhz": statistics.mean(m for m, _ in busy) if busy else 0.0,
                         "held_back": sum(h for _, h in busy) / len(busy) if busy else 0.0}}


def busy_gpu_text(busy: dict) -> str:
    return (f"SM {busy['sm_mhz']:,.0f} MHz while busy, held back by power or heat "
            f"{busy['held_back']:.0%} of it ({busy['samples']:,} samples)")


def layer_flags(args) -> list[str]:
    """--layers passed on to a process this one starts (a model written, a side measured)."""
    return ["--layers", str(args.layers)] if args.layers else []


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as nvidia-smi names them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]


def host_cpu() -> str:
    """The host's CPU model and the cores this process may use: a step's launches and Python run there, and
    the same GPUs on another host moved the 2-GPU ratios more than most changes did."""
    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")] if Path("/proc/cpuinfo").exists() else []
    return f"{names[0] if names else 'a CPU'}, {len(os.sched_getaffinity(0))} cores"


# --- the two sides of the step benchmark ------------------------------------------------------------


def bench_prompts(args) -> tuple[list[list[int]], torch.Tensor]:
    """--prompts random prompts of 80-200 tokens, each repeated --samples times, and fixed 0/1
    rewards (a random model never answers a question: the rewards only make the gradient real)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(80, 201, (args.prompts,), generator=g).tolist()
    prompts = [torch.randint(0, 151936, (n,), generator=g).tolist() for n in lengths]
    rewards = torch.randint(0, 2, (args.prompts * args.samples,), generator=g).float()
    return [p for p in prompts for _ in range(args.samples)], rewards


def completion_lengths(args, step: int) -> list[int]:
    """Each request's new tokens in step `step`, the same on both sides: all --max-new-tokens (--lengths
    fixed), or (--lengths thinking) spread as a thinking model's completions are, long-tailed: log-normal
    with a median of 0.4 x --max-new-tokens (sigma 0.6, so about 6% reach the cap), at least 16."""
    n = args.prompts * args.samples
    if args.lengths == "fixed":
        return [args.max_new_tokens] * n
    g = torch.Generator().manual_seed(1000 + step)
    drawn = args.max_new_tokens * 0.4 * torch.exp(0.6 * torch.randn(n, generator=g))
    return drawn.round().clamp(16, args.max_new_tokens).long().tolist()


class EngineSteps:
    """Times vLLM's engine (of `vllm.LLM` `llm`) from now on: each step's seconds (a decode step of every
    running sequence, or a prefill chunk) and the GPU milliseconds of its model runner's two calls (CUDA
    events): `execute_model` (the inputs' copies and the forward; the V1 runner's logits too) and
    `sample_tokens` (the sampler; the V2 runner's logits too). What the GPU does not take of a step is vLLM's
    host work (scheduler, inputs, outputs): at 256 sequences on an H100 (V1 runner), 7.4 ms of forward in steps
    of 9.5-15 ms, the host's speed moving by half between generations."""

    def __init__(self, llm):
        self.seconds, self.gpu = [], {"forward_ms": [], "sample_ms": []}
        step = llm.llm_engine.step
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner

        def timed_step():
            start = time.perf_counter()
            out = step()
            self.seconds.append(time.perf_counter() - start)
            return out

        def timed(call, events: list):
            def on_the_gpu(*args, **kwargs):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = call(*args, **kwargs)
                end.record()
                events.append((start, end))
                return out
            return on_the_gpu
        llm.llm_engine.step = timed_step
        runner.execute_model = timed(runner.execute_model, self.gpu["forward_ms"])
        runner.sample_tokens = timed(runner.sample_tokens, self.gpu["sample_ms"])

    def medians(self) -> dict:
        """The median engine step, forward and sampling, in ms, of the steps since the last call."""
        torch.cuda.synchronize()  # every timed call has ended on the GPU
        out = {"engine_step_ms": 1e3 * statistics.median(self.seconds)} | {
            name: statistics.median(start.elapsed_time(end) for start, end in events)
            for name, events in self.gpu.items()}
        self.seconds.clear()
        for events in self.gpu.values():
            events.clear()
        return out


@contextmanager
def gc_off():
    """Python's cycle collector off, as simple_rl.VLLMEngine.generate has it while generating: both sides'
    generation does the same host work but for what exactness adds."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def exact_step_runner(ckpt: Path, args):
    """simple_rl.py's own GRPO step (`grpo_step`) on the bench's prompts: returns a function that runs one and
    returns its phase times, the script's checkpoint writer (its page-locked host memory made now, as the
    script makes it before its first step) and the seconds that took."""
    config = simple_rl.Args(
        sampling=simple_rl.Sampling(prompts_per_step=args.prompts, samples_per_prompt=args.samples,
                                    max_new_tokens=args.max_new_tokens),
        engine=simple_rl.Engine(vllm_gpu_memory=args.vllm_gpu_memory,
                                max_tokens_per_microbatch=args.max_tokens_per_microbatch,
                                activation_checkpointing=args.activation_checkpointing),
        parity=simple_rl.Parity(parity_report_tokens=0),  # the step's parity in one line
        run=simple_rl.Run(run_name="bench", output_dir=str(ckpt.parent / "checkpoints"), keep_last=1),
    )
    world = simple_rl.World(*plumbing.init_distributed("cuda"))  # as the script: torch's host threads too
    config_json = json.loads((ckpt / "config.json").read_text())
    shape = simple_rl.model_shape(simple_rl.model_args_from_hf_config(config_json))
    fit = plumbing.check_gpu_memory(shape, config, world)  # as the script: vLLM stays awake if it fits beside
    engine = simple_rl.VLLMEngine(ckpt, args.vllm_gpu_memory, config.data.max_prompt_tokens
                                  + args.max_new_tokens, seed=0, sleep_mode=not fit.vllm_awake)
    model = simple_rl.load_qwen3(ckpt, "cuda", activation_checkpointing=args.activation_checkpointing)
    optimizer = simple_rl.MasterWeights(model, config.optimizer.lr, config.optimizer.weight_decay)
    prompts, rewards = bench_prompts(args)
    advantages = simple_rl.group_advantages(rewards, args.samples, True)
    engine_steps = EngineSteps(engine.llm)

    def sample(i: int, after=lambda: None) -> simple_rl.Rollouts:  # each completion as long as --lengths says
        seeds = simple_rl.rollout_seeds(0, i, len(prompts))
        completions, logprobs = engine.generate(prompts, completion_lengths(args, i), 1.0, seeds,
                                                ignore_eos=True)
        after()
        return simple_rl.Rollouts(prompts, completions, logprobs, rewards, advantages)

    def step(i: int, after_sample=lambda: None) -> tuple[dict, dict]:
        before = host_counters()
        rollouts, scalars = simple_rl.grpo_step(i, functools.partial(sample, i, after_sample), engine, model,
                                                optimizer, None, config, world=world)
        times = {name: scalars[f"time/{name}"] for name in PHASES}
        return times, {name: scalars[f"memory/{name}_gib"] for name in PHASES} | engine_steps.medians() | {
            "mismatched_tokens": scalars["parity/mismatched_tokens"],
            "sampled_tokens": sum(len(c) for c in rollouts.completions),
            "host": {name: n - before[name] for name, n in host_counters().items()},
        }

    start = time.perf_counter()
    checkpoints = plumbing.Checkpoints(model, functools.partial(simple_rl.hf_weights, model), optimizer, None,
                                       ckpt, config, world)
    step.parts = {"vLLM sleeps": (engine, "sleep"), "micro-batches": (simple_rl, "train_on_rollouts"),
                  "parity": (simple_rl, "compare_bits"), "optimizer step": (optimizer, "step")}
    return step, checkpoints, time.perf_counter() - start


def host_counters() -> dict:
    """What this thread (the one that steps) spent and waited for on the host, and the machine's reclaim:
    where a step beneath a checkpoint write may lose its time. `waits`: voluntary context switches (a lock,
    the GIL, I/O); `preempted`: involuntary ones (another thread took the core); `reclaimed`: pages scanned
    by direct reclaim (an allocation that waited for memory), machine-wide (Linux's /proc/vmstat). CUDA's
    synchronize spins: a step that waits longer for the GPU counts more `user_s` without more host work."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    vmstat = Path("/proc/vmstat")
    counts = dict(line.split() for line in vmstat.read_text().splitlines()) if vmstat.exists() else {}
    return {"user_s": usage.ru_utime, "system_s": usage.ru_stime, "waits": usage.ru_nvcsw,
            "preempted": usage.ru_nivcsw, "page_faults": usage.ru_minflt + usage.ru_majflt,
            "reclaimed": int(counts.get("pgscan_direct", 0))}


def saving_steps(step, checkpoints, first: int, every: int) -> dict:
    """2 x `every` more steps, as the script runs them with --save-every `every`: every `every`-th step saves
    a checkpoint (the first the process's first), whose write goes on beneath the next steps. Each saving
    step's phase times and the seconds its save held training (waiting for the previous write if it had not
    ended, then copying to host memory), each other step's phase times and whether the write was still
    going when it ended, each write's seconds in the background, and the seconds the end waited for the last
    write; then `every` plain steps (`plain`), once the last write has ended."""
    out = {"saving": [], "beneath": [], "beneath_host": [], "writing": [], "writes": [], "plain": [],
           "plain_host": []}
    for i in range(first, first + 2 * every):
        times, metrics = step(i)
        if (i - first) % every:
            out["beneath"].append(times)
            out["beneath_host"].append(metrics["host"])
            out["writing"].append(not checkpoints.future.done())
            continue
        start = time.perf_counter()
        checkpoints.wait()  # the previous write: `save` would wait for it first too
        waited = time.perf_counter() - start
        if i > first:
            out["writes"].append(checkpoints.ended - checkpoints.begun)
        checkpoints.save(i + 1, {})
        out["saving"].append({"step": sum(times.values()), "held": waited + checkpoints.held,
                              "waited": waited})
    start = time.perf_counter()
    checkpoints.wait()
    out["end_wait"] = time.perf_counter() - start
    out["writes"].append(checkpoints.ended - checkpoints.begun)
    out["bytes"] = sum(f.stat().st_size for f in checkpoints.out_dir.rglob("*") if f.is_file())
    # `every` plain steps from the same stretch of the run, no write going: an H200 at its power cap moves
    # a step by 0.3 s either way (its clocks 1.5-2.0 GHz), so the early timed steps alone are no reference
    for i in range(first + 2 * every, first + 3 * every):
        times, metrics = step(i)
        out["plain"].append(times)
        out["plain_host"].append(metrics["host"])
    return out


def save_costs(run: dict) -> dict:
    """What saving costs the steps of a process, in seconds over the median step that neither saves nor runs
    beneath a write (the timed steps and those after the writes; `plain`: each of them over it, their own
    spread): each saving step (its phases and what its save held), each step beneath a write, and each of
    its phases over that phase's median (which phase the write slows), and its host counters
    (`host_counters`) beside their medians over the plain steps (what the write makes it wait for)."""
    saves = run["saves"]
    steps, hosts = run["steps"] + saves["plain"], run["host"] + saves["plain_host"]  # the timed, those after
    plain = statistics.median(sum(times.values()) for times in steps)
    median = {p: statistics.median(times[p] for times in steps) for p in PHASES}
    phases = {p: [t[p] - median[p] for t in saves["beneath"]] for p in PHASES}
    host = {name: (statistics.median(h[name] for h in hosts), [h[name] for h in saves["beneath_host"]])
            for name in hosts[0]}
    return {"host": host, "saving": [s["step"] + s["held"] - plain for s in saves["saving"]],
            "plain": [sum(t.values()) - plain for t in steps],
            "beneath": [sum(t.values()) - plain for t in saves["beneath"]], "beneath_phases": phases,
            "writing": saves["writing"], "held": [s["held"] for s in saves["saving"]],
            "waited": [s["waited"] for s in saves["saving"]], "bytes": saves["bytes"],
            "writes": saves["writes"], "end_wait": saves["end_wait"], "pinning": run["pinning"]}


def standard_engine(ckpt: Path, args):
    """vLLM as a standard RL run starts it: its defaults (torch.compile, CUDA graphs), in this process for the
    in-process push, asleep while the trainer trains."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm

    return vllm.LLM(model=str(ckpt), skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                    enable_sleep_mode=True,
                    gpu_memory_utilization=args.vllm_gpu_memory, max_model_len=512 + args.max_new_tokens,
                    max_num_seqs=256)


def padded_micro_batches(prompts, completions, token_budget: int):
    """Consecutive samples, right-padded to the longest, in micro-batches of at most `token_budget` tokens
    (padding included): (first, end, ids, mask, rows, targets), `rows` the (sample, position) pairs whose
    logits predict a completion token, `targets` those tokens."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    start = 0
    while start < len(prompts):
        end = start + 1
        while end < len(prompts) and (end + 1 - start) * max(lengths[start : end + 1]) <= token_budget:
            end += 1
        ids = torch.zeros(end - start, max(lengths[start:end]), dtype=torch.long)
        mask = torch.zeros_like(ids)
        rows, targets = [], []
        for b, i in enumerate(range(start, end)):
            seq = prompts[i] + completions[i]
            ids[b, : len(seq)], mask[b, : len(seq)] = torch.tensor(seq), 1
            rows += [(b, t) for t in range(len(prompts[i]) - 1, len(seq) - 1)]
            targets += completions[i]
        yield start, end, ids, mask, rows, targets
        start = end


def standard_train(model, masters: list, optimizer, prompts, completions, vllm_logprobs, advantages, args):
    """One standard GRPO update: HF transformers' forward and backward in padded micro-batches, the same
    PPO-clip loss over the step's tokens, fp32 gradient sums, clipping, AdamW on fp32 masters, rounded into
    the model."""
    params, n_tokens = list(model.parameters()), sum(len(c) for c in completions)
    for start, end, ids, mask, rows, targets in padded_micro_batches(prompts, completions,
                                                                     args.max_tokens_per_microbatch):
        hidden = model.model(input_ids=ids.cuda(), attention_mask=mask.cuda(),
                             use_cache=False).last_hidden_state
        b_idx, t_idx = torch.tensor(rows).cuda().unbind(1)
        logits = model.lm_head(hidden[b_idx, t_idx])  # (C, V): only the completion tokens' rows
        logprobs = logits.float().log_softmax(-1).gather(-1,
                                                         torch.tensor(targets).cuda()[:, None]).squeeze(-1)
        old = torch.cat(vllm_logprobs[start:end]).cuda()
        lengths = torch.tensor([len(c) for c in completions[start:end]]).cuda()
        loss, _, _ = simple_rl.ppo_clip_loss(logprobs, old,
                                             advantages[start:end].cuda().repeat_interleave(lengths), 0.2)
        (loss.sum() / n_tokens).backward()
        for master, p in zip(masters, params):  # fp32 gradient sums, as the exact side keeps them
            master.grad = p.grad.float() if master.grad is None else master.grad.add_(p.grad)
            p.grad = None
    torch.nn.utils.clip_grad_norm_(masters, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for master, p in zip(masters, params):
            p.copy_(master)


def checkpoint_named(model):
    """(checkpoint name, tensor) of a transformers Qwen3 or Qwen3-MoE, as vLLM's `load_weights` takes them:
    transformers 5 holds a layer's experts as two (E, ...) tensors, a checkpoint names each expert's."""
    for name, t in model.state_dict().items():
        prefix, _, kind = name.rpartition(".experts.")
        if kind == "gate_up_proj":  # (E, 2I, H): each expert's [gate; up]
            for e, expert in enumerate(t):
                gate, up = expert.chunk(2)
                yield f"{prefix}.experts.{e}.gate_proj.weight", gate
                yield f"{prefix}.experts.{e}.up_proj.weight", up
        elif kind == "down_proj":  # (E, H, I)
            yield from ((f"{prefix}.experts.{e}.down_proj.weight", expert) for e, expert in enumerate(t))
        else:
            yield name, t


def standard_step_runner(ckpt: Path, args):
    """A standard non-exact GRPO step on the same data: vLLM defaults, HF transformers' Qwen3 (or MoE)."""
    from transformers import AutoModelForCausalLM

    llm = standard_engine(ckpt, args)
    import vllm  # after standard_engine set its environment
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").cuda()
    model.train()  # Qwen3 has no dropout; transformers checkpoints activations only in train mode
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable()
    masters = [p.detach().float().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(masters, lr=1e-6, weight_decay=0.0)
    prompts, rewards = bench_prompts(args)
    advantages = simple_rl.group_advantages(rewards, args.samples, True)
    engine_steps = EngineSteps(llm)

    def step(i: int) -> tuple[dict, dict]:
        times, memory = {}, {}
        with plumbing.timed_phase("generate", times, memory):
            seeds = simple_rl.rollout_seeds(0, i, len(prompts))
            sampling = [vllm.SamplingParams(temperature=1.0, max_tokens=n,
                                            # a standard run: unseeded
                                            seed=s if args.seeded_standard else None,
                                            logprobs=0, flat_logprobs=True,  # the exact side's host work
                                            detokenize=False, ignore_eos=True)
                        for s, n in zip(seeds, completion_lengths(args, i))]
            with gc_off():
                outputs = llm.generate([vllm.TokensPrompt(prompt_token_ids=p) for p in prompts], sampling,
                                       use_tqdm=False)
            completions = [list(o.outputs[0].token_ids) for o in outputs]
            logprobs = [torch.tensor(o.outputs[0].logprobs.logprobs) for o in outputs]
        with plumbing.timed_phase("train", times, memory):
            llm.sleep(level=2)
            standard_train(model, masters, optimizer, prompts, completions, logprobs, advantages, args)
        with plumbing.timed_phase("push", times, memory):
            torch.cuda.empty_cache()
            llm.wake_up(tags=["weights"])
            llm.apply_model(lambda served: served.load_weights(checkpoint_named(model)))
            llm.wake_up(tags=["kv_cache"])
        return times, memory | engine_steps.medians() | {"sampled_tokens": sum(len(c) for c in completions)}

    return step


def run_side(side: str, ckpt: Path, args) -> dict:
    start = time.perf_counter()
    standard = side != "exact"
    runner = (standard_step_runner(ckpt, args), None, 0.0) if standard else exact_step_runner(ckpt, args)
    (step, checkpoints, pinning), startup = runner, time.perf_counter() - start
    results = [step(i) for i in range(1 + args.iters)][1:]  # the first step warms up
    # after the timed steps: saving steps, the steps beneath their writes and plain steps after, against them
    saves = None if standard or not args.save_every else saving_steps(step, checkpoints, 1 + args.iters,
                                                                       args.save_every)
    if args.profile and not standard:  # last: a profiled step runs slower, and no timed step comes after it
        profile_train_phase(step, 1 + args.iters + 3 * args.save_every, args.profile)
    return {
        "steps": [times for times, _ in results],
        "startup": startup,
        "phase_end_gib": {name: max(m[name] for _, m in results) for name in results[0][0]},
        "mismatched_tokens": [m.get("mismatched_tokens") for _, m in results],
        "engine_step_ms": [m["engine_step_ms"] for _, m in results],
        "forward_ms": [m["forward_ms"] for _, m in results],
        "sample_ms": [m["sample_ms"] for _, m in results],
        "host": [m.get("host") for _, m in results],  # the exact side's (`host_counters`)
        "sampled_tokens": results[0][1]["sampled_tokens"],
        "device": f"{torch.cuda.get_device_name()} (host: {host_cpu()})",
        "pinning": pinning,
        "saves": saves,
    }


PHASES = ("generate", "train", "push")
# --profile: the host's ops and the GPU's kernels; --profile kernels: the kernels alone, no CPU tracing to slow
# the host (the GPU's idle time is the run's own; no part's ranges; the host's lines are CUDA's own calls)
PROFILED = {"all": [ProfilerActivity.CPU, ProfilerActivity.CUDA], "kernels": [ProfilerActivity.CUDA]}


def profile_train_phase(step, i: int, what: str) -> None:
    """One more step, its train and push phases under torch.profiler (`profile_lines`), `what`: PROFILED's."""
    prof = profile(activities=PROFILED[what])

    def start() -> None:  # after generation; stopped once the GPU ran what the step launched
        prof.__enter__()
        stack.callback(lambda: (torch.cuda.synchronize(), prof.__exit__(None, None, None)))
    with contextlib.ExitStack() as stack:
        for name, (owner, attribute) in step.parts.items():
            stack.enter_context(in_range(owner, attribute, name))
        times, _ = step(i, after_sample=start)
    print("\n" + profile_lines(prof, step.parts, f"{times['train']:.2f} + {times['push']:.2f} s wall", what))


def profile_lines(prof, parts, wall: str, what: str) -> str:
    """Each part of the train and push phases (the script's own functions, each in a range of its name, and
    FSDP2's own ranges) its wall time against the GPU time of the kernels it launched, what the GPU was busy
    with in all, the kernels that took the most of it (NCCL's collectives among them), where the GPU
    waited for the host (`gpu_idle`) and what the host's time went to (`host_lines`). `what`: `PROFILED`'s
    (kernels alone: no ranges, and the host's lines are CUDA's own calls)."""
    events, cpu, gpu = prof.key_averages(), torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    # a part's range shows on the CPU (its wall time) and, as an annotation, on the GPU's timeline too
    ranges = [e for e in events if e.device_type == cpu and (e.key in parts or e.key.startswith("FSDP::"))]
    busy, table = top_kernels([e for e in events if e.device_type == gpu and not e.is_user_annotation], 25)
    lines = [f"train and push phases of one step, {torch.cuda.get_device_name()}: {wall}, the GPU's kernels "
             f"{busy:.2f} s"]
    for e in ranges:  # a part's wall time includes the waits for the GPU it ends with
        lines.append(f"  {e.key:<36}{e.count:>5} x{e.cpu_time_total / 1e6:>8.3f} s wall"
                     f"{e.device_time_total / 1e6:>8.3f} s of kernels")
    timeline = prof.profiler.kineto_results.events()
    kernels = [(e.start_ns(), e.end_ns()) for e in timeline
               if e.device_type() == gpu and not e.is_user_annotation()]
    named = [(e.name(), e.start_ns(), e.end_ns()) for e in timeline
             if e.device_type() == cpu and e.name() in parts]
    span, idle, gaps = gpu_idle(kernels, named)
    by_part = ", ".join(f"{name} {ns / 1e9:.3f}" for name, ns in gaps.most_common())
    lines.append(f"  the GPU idle {idle / 1e9:.3f} s of the {span / 1e9:.3f} s from its first kernel to its "
                 f"last; in gaps over 0.3 ms {sum(gaps.values()) / 1e9:.3f} s ({by_part}), the rest between "
                 "kernels" + (" (launches, which the profiler slows)" if what == "all" else ""))
    if what == "kernels":  # the host unslowed: whether it ran ahead of the GPU (GPU-bound) or not (host-bound)
        full = next((e for e in events if e.key == "Command Buffer Full"), None)
        n, blocked = (full.count, full.self_cpu_time_total / 1e6) if full else (0, 0.0)
        lines.append(f"  CUDA's launch queue full {n} times, the host blocked {blocked:.3f} s: "
                     + ("it ran ahead of the GPU" if n else "it never ran ahead of the GPU"))
    return "\n".join(lines + [host_lines(events)] * any(e.device_type == cpu for e in events) + [table])


def host_lines(events, rows: int = 12) -> str:
    """The host's CPU time in the profiled phases by what spent it, each event's own (self) time: a range's
    (a part's or FSDP2's: the Python inside it, the script's own, Triton's launchers', autograd's), aten's ops
    (their dispatch and allocations) and CUDA's launch calls; the main and autograd threads together. CUDA's
    "Command Buffer Full": the host blocked on a full queue of launches (it runs ahead of the GPU)."""
    cpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: -e.self_cpu_time_total)
    lines = [f"  the host's CPU time, each event's own: {sum(e.self_cpu_time_total for e in cpu) / 1e6:.3f} s "
             "in all (the profiler's own slows it); the most:"]
    return "\n".join(lines + [f"    {e.key[:60]:<60}{e.count:>7} x{e.self_cpu_time_total / 1e6:>8.3f} s"
                              for e in cpu[:rows]])


def gpu_idle(kernels: list[tuple[int, int]], ranges: list[tuple[str, int, int]], least: int = 300_000):
    """The time (ns) from the first of `kernels` (start, end) to the end of the last, the GPU's idle time in
    it, and the gaps of at least `least` ns summed by the innermost of `ranges` (name, start, end) holding
    each gap's middle: a gap is the host's work (or wait) before its next launch."""
    busy = []
    for start, end in sorted(kernels):
        if busy and start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end])
    span = busy[-1][1] - busy[0][0] if busy else 0
    gaps = collections.Counter()
    for (_, gap_start), (gap_end, _) in zip(busy, busy[1:]):
        if gap_end - gap_start >= least:
            middle = (gap_start + gap_end) / 2
            holding = [r for r in ranges if r[1] <= middle <= r[2]]
            part = min(holding, key=lambda r: r[2] - r[1])[0] if holding else "elsewhere"
            gaps[part] += gap_end - gap_start
    return span, span - sum(end - start for start, end in busy), gaps


SCRIPT_PARTS = {"vLLM sleeps": ("VLLMEngine", "sleep"), "reference logprobs": (None, "reference_logprobs"),
                "micro-batches": (None, "train_on_rollouts"), "forwards": ("Qwen3", "forward"),
                "gather the step": (None, "gather_step"), "parity": (None, "compare_bits"),
                "optimizer step": ("MasterWeights", "step"),
                "vLLM wakes (cache emptied first)": ("VLLMEngine", "wake_up"),
                "push weights": ("VLLMEngine", "push_weights"), "checksums": ("VLLMEngine", "check_weights"),
                "empty PyTorch's cache": (torch.cuda, "empty_cache")}


def profiled_script(step: int, what: str, argv: list[str]) -> None:
    """simple_rl.py run by its command line `argv` (under torchrun too), its step `step`'s train and push
    phases under torch.profiler (`what`: `PROFILED`'s): each rank writes runs/<run>/profile_rank<r>.txt
    (`profile_lines`; each step's cudaMalloc calls and retries, its seconds in Python's garbage collector, and
    its forwards' wall and CPU seconds) and trace_rank<r>.json.gz (a timeline for Perfetto)."""
    rank, size = plumbing.torchrun_rank_and_size()
    args = plumbing.check_args(plumbing.parse_command_line(simple_rl.Args, simple_rl.__doc__, argv), size)
    files = plumbing.read_files(args, simple_rl.ANSWER_AFTER_HASHES)
    run = Path("runs") / args.run.run_name  # bench names the run (--run-name): one folder for every rank
    parts = {name: (simple_rl if owner is None else getattr(simple_rl, owner) if isinstance(owner, str)
                    else owner, attribute) for name, (owner, attribute) in SCRIPT_PARTS.items()}
    grpo_step, allocator, collector = simple_rl.grpo_step, [], []  # each step's counts
    collecting = {"since": 0.0, "seconds": 0.0, "full": 0}

    def timed_collection(phase: str, info: dict) -> None:  # Python's collector calls it around a collection
        if phase == "start":
            collecting["since"] = time.perf_counter()
        else:
            collecting["seconds"] += time.perf_counter() - collecting["since"]
            collecting["full"] += info["generation"] == 2
    gc.callbacks.append(timed_collection)
    forward, launching, host = simple_rl.Qwen3.forward, [], {"wall": 0.0, "cpu": 0.0}

    def timed_forward(model, *forward_args, **named):  # no sync inside: the host's launching alone
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return forward(model, *forward_args, **named)
        finally:
            host["wall"] += time.perf_counter() - wall
            host["cpu"] += time.thread_time() - cpu
    simple_rl.Qwen3.forward = timed_forward

    def counted_step(i: int, *step_args, **named):
        # A retry: PyTorch's allocator found no memory, freed its cache (a device sync) and allocated again.
        # A collection stops this rank alone: under torchrun the others wait for it at the next collective.
        # A host that launches slower than another rank's makes it wait; a wall above the CPU time is this
        # thread waiting for a core.
        before, collecting["seconds"], collecting["full"] = torch.cuda.memory_stats(), 0.0, 0
        host["wall"] = host["cpu"] = 0.0
        out = (profiled_step if i == step else grpo_step)(i, *step_args, **named)
        after, keys = torch.cuda.memory_stats(), ("num_device_alloc", "num_alloc_retries")
        allocator.append("/".join(str(after.get(k, 0) - before.get(k, 0)) for k in keys))
        collector.append(f"{collecting['seconds']:.3f} ({collecting['full']})")
        launching.append(f"{host['wall']:.3f}/{host['cpu']:.3f}")
        if i == step:
            with open(run / f"profile_rank{rank}.txt", "a") as f:
                f.write(f"PyTorch's allocator, each step: cudaMalloc calls / retries {' '.join(allocator)}\n"
                        "Python's garbage collector, each step: seconds (full collections) "
                        f"{', '.join(collector)}\n"
                        f"the forwards, each step: wall / this thread's CPU seconds {' '.join(launching)}\n")
        return out

    def profiled_step(i: int, sample, *rest, **named):
        prof = profile(activities=PROFILED[what])

        def sampled():  # generation is not profiled
            rollouts = sample()
            torch.cuda.synchronize()
            prof.__enter__()
            return rollouts
        with contextlib.ExitStack() as stack:
            for name, (owner, attribute) in parts.items():
                stack.enter_context(in_range(owner, attribute, name))
            rollouts, scalars = grpo_step(i, sampled, *rest, **named)
            torch.cuda.synchronize()
        # The profiler's events become Python objects by the hundred thousand: collections (3-5 s, 12-16 full
        # ones) that are the profiler's, not the step's, and would be counted as the step's.
        gc.disable()
        try:
            prof.__exit__(None, None, None)
            wall = f"{scalars['time/train']:.2f} + {scalars['time/push']:.2f} s wall, rank {rank} of {size}"
            (run / f"profile_rank{rank}.txt").write_text(profile_lines(prof, parts, wall, what) + "\n")
            prof.export_chrome_trace(str(run / f"trace_rank{rank}.json.gz"))
        finally:
            gc.enable()
        return rollouts, scalars
    simple_rl.grpo_step = counted_step  # grpo() calls it by this name
    try:
        simple_rl.run_as_script(args, files=files)
    finally:
        gc.callbacks.remove(timed_collection)
        simple_rl.Qwen3.forward = forward


@contextmanager
def in_range(owner, attribute: str, name: str):
    """`owner.attribute`, a function, called in a profiler range named `name` while the block runs."""
    function = getattr(owner, attribute)

    def ranged(*args, **kwargs):
        with record_function(name):
            return function(*args, **kwargs)
    setattr(owner, attribute, ranged)
    try:
        yield
    finally:
        setattr(owner, attribute, function)


def top_kernels(events, rows: int) -> tuple[float, str]:
    """The seconds the GPU ran these profiler events' kernels, and a table of the `rows` that took the
    most."""
    kernels = sorted((e for e in events if e.self_device_time_total), key=lambda e: -e.self_device_time_total)
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    lines = [f"  {'kernel':<80}{'calls':>7}{'GPU s':>9}{'share':>7}"]
    lines += [f"  {e.key[:80]:<80}{e.count:>7}{e.self_device_time_total / 1e6:>9.4f}"
              f"{e.self_device_time_total / 1e6 / busy:>7.1%}" for e in kernels[:rows]]
    return busy, "\n".join(lines)


def combine(runs: list[dict]) -> dict:
    """One side's figures over the timed steps of all its processes: median phase and step times, their
    spread (the lowest and highest of the processes' own medians), the highest peak memory, every step's
    mismatch count."""
    steps = [times for run in runs for times in run["steps"]]
    out = {name: statistics.median(times[name] for times in steps) for name in steps[0]}
    out["step"] = statistics.median(sum(times.values()) for times in steps)
    medians = [{name: statistics.median(t[name] for t in run["steps"]) for name in steps[0]}
               | {"step": statistics.median(sum(t.values()) for t in run["steps"])} for run in runs]
    out["spread"] = {name: (min(m[name] for m in medians), max(m[name] for m in medians))
                     for name in medians[0]}
    out["steps"] = [sum(times.values()) for times in steps]
    out["peak_gib"] = max(max(run["peak_gib"]) for run in runs)
    out["mismatched_tokens"] = [n for run in runs for n in run["mismatched_tokens"]]
    out["engine_step_ms"] = [ms for run in runs for ms in run.get("engine_step_ms", [])]
    out["forward_ms"] = [ms for run in runs for ms in run.get("forward_ms", [])]
    out["sample_ms"] = [ms for run in runs for ms in run.get("sample_ms", [])]
    out["saves"] = [save_costs(run) for run in runs if run.get("saves")]
    out |= {key: runs[0][key] for key in ("sampled_tokens", "device")}
    return out


def save_lines(saves: list[dict], every: int) -> str:
    """Each exact process's save costs (`save_costs`) in a line, its host counters in another, and the worst
    step that saves, first saves included: the figure held against issue #37's 3 s."""
    def seconds(values, sign="+"):
        return ", ".join(f"{v:{sign}.2f}" for v in values) + " s"
    lines = [f"  process {i + 1}, a checkpoint every {every} steps: a step that saves {seconds(c['saving'])} "
             f"(the process's first save first; its save held training {seconds(c['held'], '')}, waiting for "
             f"the previous write {seconds(c['waited'], '')} of it), a step beneath a write "
             f"{seconds(c['beneath'])} (" + "; ".join(f"{p} {seconds(c['beneath_phases'][p])}" for p in PHASES)
             + f"; the write still going at the end of {sum(c['writing'])} of them), over the median of "
             f"the {len(c['plain'])} steps that do neither (timed, and after the writes: themselves "
             f"{min(c['plain']):+.2f} to {max(c['plain']):+.2f} s around it); writes of "
             f"{c['bytes'] / 1e9:.1f} GB in "
             + ", ".join(f"{w:.1f}" for w in c["writes"]) + " s ("
             + ", ".join(f"{c['bytes'] / 1e9 / w:.2f}" for w in c["writes"]) + " GB/s) in the background, "
             f"the end waited {c['end_wait']:.1f} s; page-locked memory made at the start in "
             f"{c['pinning']:.1f} s"
             for i, c in enumerate(saves)]
    for i, c in enumerate(saves):
        form = {name: ".2f" if name.endswith("_s") else ",.0f" for name in c["host"]}  # seconds, counts
        counts = "; ".join(f"{name} {plain:{form[name]}} -> " + ", ".join(f"{n:{form[name]}}" for n in after)
                           for name, (plain, after) in c["host"].items())
        lines.append(f"  process {i + 1}, its stepping thread on the host (`host_counters`), a plain step's "
                     f"median -> each step beneath a write: {counts}")
    worst, waited = max((extra, w) for c in saves for extra, w in zip(c["saving"], c["waited"]))
    # simple_rl.py's `save` says so from 1 s too
    why = (f" ({waited:.2f} s of it waiting for the previous write: this disk writes a checkpoint more "
           f"slowly than {every} steps run)" if waited > 1 else "")
    return "\n".join(lines + [f"  the slowest step that saves: {worst:+.2f} s over one that does not{why}"])


def overlap_note(a: dict, b: dict) -> str:
    """Names the phases whose spreads overlap between the sides: there the ratio is within the runs' noise."""
    overlapping = [p for p in (*PHASES, "step") if a["spread"][p][0] <= b["spread"][p][1]
                   and b["spread"][p][0] <= a["spread"][p][1]]
    return f" (the sides' spreads overlap: {', '.join(overlapping)})" if overlapping else ""


def step_benchmark(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        # Made on the CPU: this process holds no GPU memory while the sides are measured.
        ckpt = write_checkpoint(Path(tmp) / "model", shape_config(args.shape, args.layers), seed=0)
        runs = {"standard": [], "exact": []}
        # ABBA: a side measured second could run on a hotter, slower-clocked GPU; each side goes once
        # first and once second, and its figures are over the steps of both its processes.
        for run, side in enumerate(("standard", "exact", "exact", "standard")[: 2 * args.repeats]):
            env = {k: v for k, v in os.environ.items() if k != "VLLM_BATCH_INVARIANT"}
            if side == "exact":
                env["VLLM_BATCH_INVARIANT"] = "1"
            out = Path(tmp) / f"{run}.json"
            cmd = [sys.executable, __file__, *sys.argv[1:], "--side", side, "--ckpt", str(ckpt)]
            cmd += ["--json", str(out)]
            peak = {}
            with watch_gpus(peak):
                subprocess.run(cmd, env=env, check=True)
            runs[side].append(json.loads(out.read_text()) | peak)
            one = combine(runs[side][-1:])  # printed as it ends: a benchmark cut short still reports
            # the same code is slower on a GPU its power cap holds back more: each process says how much
            print(f"  process {run + 1} ({side}): " + ", ".join(f"{p} {one[p]:.2f} s" for p in PHASES)
                  + f", step {one['step']:.2f} s, peak {one['peak_gib']:.1f} GiB; "
                  + busy_gpu_text(peak["busy_gpu"]), flush=True)
        results = {side: combine(measured) for side, measured in runs.items()}
    exact, standard = results["exact"], results["standard"]
    print(
        f"\nOne GRPO step, Qwen3-{args.shape} shape ({args.layers or SHAPES[args.shape]['layers']} layers), "
        f"{args.prompts} prompts x {args.samples} samples x {args.max_new_tokens} new tokens"
        f"{' at most (thinking-like lengths)' if args.lengths == 'thinking' else ''}, "
        f"{exact['device']}; median of {args.repeats} x {args.iters} steps "
        f"(sides run {'ABBA'[:2 * args.repeats]})"
    )
    print(
        f"  {'':<10}" + "".join(f"{name:>13}" for name in ("generate", "train", "push", "step", "peak GPU"))
    )
    for name, r in results.items():
        print(
            f"  {name:<10}"
            + "".join(f"{r[p]:>12.2f}s" for p in (*PHASES, "step"))
            + f"{r['peak_gib']:>9.1f} GiB"
        )
        print(f"  {'':<10}" + "".join(f"{'%.2f-%.2f' % r['spread'][p]:>13}" for p in (*PHASES, "step"))
              + "   (its processes' medians)")
    print(
        f"  exact / standard: step {exact['step'] / standard['step']:.3f}x, generate "
        f"{exact['generate'] / standard['generate']:.2f}x, train {exact['train'] / standard['train']:.2f}x, "
        f"peak memory {exact['peak_gib'] / standard['peak_gib']:.2f}x" + overlap_note(exact, standard)
    )
    print(f"  exact side: mismatched tokens per step {exact['mismatched_tokens']} of "
          f"{exact['sampled_tokens']}")
    for name, r in results.items():  # a slow generation: slow in every engine step? on the GPU or the host?
        print(f"  {name}: a vLLM engine step's median, timed step by step: "
              + ", ".join(f"{ms:.1f}" for ms in r["engine_step_ms"]) + " ms; on the GPU its model forward "
              + ", ".join(f"{ms:.1f}" for ms in r["forward_ms"]) + " ms, its sampling "
              + ", ".join(f"{ms:.2f}" for ms in r["sample_ms"]) + " ms")
    if exact["saves"]:
        print(save_lines(exact["saves"], args.save_every))
    results["step_ratio"] = exact["step"] / standard["step"]
    return results


# --- simple_rl.py on 1 GPU against torchrun on N ------------------------------------------------------


def script_run(gpus: int, model: Path, workdir: Path, args, flags=(), name: str | None = None,
               prompts: int | None = None) -> dict:
    """simple_rl.py on the first `gpus` visible GPUs (torchrun for more than one), with the step benchmark's
    flags (--prompts, or `prompts`) and `flags`: its per-step phase times and mismatch counts from
    TensorBoard, each GPU's peak memory, the process's peak host memory (its largest process's, under
    torchrun) and its planned GPU memory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    name, prompts = name or f"{gpus}_gpus", prompts or args.prompts
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(gpus)] if gpus > 1 else []
    # --profile: one more step, profiled (`profiled_script`), out of the means
    script = ([__file__, "--profiled-script", str(1 + args.iters), args.profile, "--"] if args.profile
              else [HERE / "simple_rl.py"])
    flags = ["--model", str(model), "--dataset", str(args.gsm8k.resolve()), "--eval-every", "0",
             "--steps", str(1 + args.iters + bool(args.profile)), "--run-name", name, "--save-every", "-1",
             "--prompts-per-step", str(prompts), "--samples-per-prompt", str(args.samples),
             "--max-new-tokens", str(args.max_new_tokens), "--vllm-gpu-memory", str(args.vllm_gpu_memory),
             "--max-tokens-per-microbatch", str(args.max_tokens_per_microbatch), *flags]
    flags += ["--activation-checkpointing"] if args.activation_checkpointing else []
    gpu_ids = visible_gpus()[:gpus]
    env = os.environ | {"VLLM_BATCH_INVARIANT": "1", "CUDA_VISIBLE_DEVICES": ",".join(gpu_ids)}
    peak = {}
    with watch_gpus(peak, gpu_ids), tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen([sys.executable, *launcher, *map(str, script), *flags], cwd=workdir, env=env,
                                 stdout=log, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(child.pid, 0)  # the child's own peak resident memory (ru_maxrss, KiB)
        log.seek(0)
        output = log.read()
    print(output[-3000:])
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"simple_rl.py {' '.join(flags)} failed")
    run = workdir / "runs" / name
    for profiled in sorted(run.glob("profile_rank*.txt")):
        print(f"\n{name}: {profiled.read_text()}")
    if args.profile_dir:
        shutil.copytree(run, args.profile_dir / name, ignore=shutil.ignore_patterns("events.*"),
                        dirs_exist_ok=True)
    events = EventAccumulator(str(run)).Reload()
    tags = [f"time/{p}" for p in PHASES] + ["parity/mismatched_tokens", "reward/completion_tokens_mean"]
    # the first step warms up, a profiled one is slower
    series = {tag: [e.value for e in events.Scalars(tag)][1: 1 + args.iters] for tag in tags}
    out = {p: statistics.mean(series[f"time/{p}"]) for p in PHASES}
    out["step"] = sum(out[p] for p in PHASES)
    out["generated"] = statistics.mean(series["reward/completion_tokens_mean"]) * prompts * args.samples
    out["tokens_per_s"] = out["generated"] / out["step"]
    out["mismatched_tokens"] = [int(n) for n in series["parity/mismatched_tokens"]]
    out["steps"] = {p: series[f"time/{p}"] for p in PHASES}  # each timed step's: the means hide a slow one
    out["host_peak_gib"] = usage.ru_maxrss / 2**20
    planned = [line for line in output.splitlines() if line.startswith("GPU memory planned")]
    out["planned"] = planned[0] if planned else None
    return out | peak


def fits_benchmark(args) -> dict:
    """simple_rl.py on one GPU (on --gpus N: torchrun on N) for each of --fits' configurations ("SHAPE
    [FLAG ...]"): what fits where, with its step time, the highest GPU's peak, the host's peak (its largest
    process's) and the plan it printed."""
    if args.gsm8k is None:
        raise SystemExit("--fits needs --gsm8k: the GSM8K train jsonl "
                         "(the questions and the tokenizer's text)")
    results, gpus, visible = {}, args.gpus or 1, len(visible_gpus())
    if gpus > visible:
        raise SystemExit(f"--gpus {gpus}: at most the {visible} GPUs visible")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for i, config in enumerate(args.fits):
            shape, *flags = config.split()
            model = workdir / f"model_{shape}"
            if not model.exists():  # written by another process: this one holds no GPU memory
                subprocess.run([sys.executable, __file__, "--shape", shape, *layer_flags(args), "--write-model",
                                str(model), "--gsm8k", str(args.gsm8k)], check=True)
            results[config] = script_run(gpus, model, workdir, args, flags, name=f"fits_{i}")
            if all(c.split()[0] != shape for c in args.fits[i + 1:]):  # disk: an 8B model is 16 GB
                shutil.rmtree(model)
    print(f"\nsimple_rl.py on {gpus} x {torch.cuda.get_device_name()}, {args.prompts} prompts x "
          f"{args.samples} samples x {args.max_new_tokens} new tokens; means of {args.iters} steps after the "
          "first")
    print(f"  {'configuration':<58}{'step':>8}{'train':>8}{'GPU peak':>10}{'host peak':>11}"
          "  mismatched / plan")
    for config, r in results.items():
        print(f"  {config:<58}{r['step']:>7.2f}s{r['train']:>7.2f}s{max(r['peak_gib']):>6.1f} GiB"
              f"{r['host_peak_gib']:>7.1f} GiB  {sum(r['mismatched_tokens'])} / {r['planned']}")
    return results


def scaling_benchmark(args) -> dict:
    if args.gsm8k is None:
        raise SystemExit("--gpus needs --gsm8k: the GSM8K train jsonl "
                         "(the questions and the tokenizer's text)")
    visible, n = len(visible_gpus()), args.gpus
    if not 2 <= n <= visible:
        raise SystemExit(f"--gpus {n}: give 2 or more, at most the {visible} GPUs visible")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        # Written by another process: this one holds no GPU memory while the runs are measured.
        model = workdir / "model"
        subprocess.run([sys.executable, __file__, "--shape", args.shape, *layer_flags(args), "--write-model",
                        str(model), "--gsm8k", str(args.gsm8k)], check=True)
        runs = {"1 GPU": script_run(1, model, workdir, args),
                f"{n} GPUs": script_run(n, model, workdir, args, name="strong"),
                f"{n} GPUs, {n}x": script_run(n, model, workdir, args, name="weak", prompts=n * args.prompts)}
    device = f"{torch.cuda.get_device_name()} (host: {host_cpu()})"
    print(scaling_lines(runs, n, args, device))
    return runs | scaling_ratios(runs, n) | {"device": device}


def scaling_ratios(runs: dict, n: int) -> dict:
    """Strong scaling (the same step on n GPUs), weak (n times the step on n), the trainer's cost per
    token."""
    one, strong, weak = runs["1 GPU"], runs[f"{n} GPUs"], runs[f"{n} GPUs, {n}x"]
    # The trainer's cost per token: a rank's train seconds over the tokens it sampled, against one GPU's.
    return {"strong": one["step"] / strong["step"], "strong_generate": one["generate"] / strong["generate"],
            "strong_train": one["train"] / strong["train"], "weak": weak["tokens_per_s"] / one["tokens_per_s"],
            "train_per_token": (weak["train"] * n / weak["generated"]) / (one["train"] / one["generated"])}


def scaling_lines(runs: dict, n: int, args, device: str) -> str:
    n_layers = args.layers or SHAPES[args.shape]["layers"]
    r = scaling_ratios(runs, n)
    lines = [f"simple_rl.py, Qwen3-{args.shape} shape ({n_layers} layers), {args.prompts} prompts x "
             f"{args.samples} samples, up to {args.max_new_tokens} new tokens, {device}; "
             f"means of {args.iters} steps after the first",
             f"  {'':<14}" + "".join(f"{p:>11}" for p in (*PHASES, "step"))
             + f"{'tokens/s':>11}   peak GPU memory"]
    for label, run in runs.items():
        lines.append(f"  {label:<14}" + "".join(f"{run[p]:>10.2f}s" for p in (*PHASES, "step"))
                     + f"{run['tokens_per_s']:>11,.0f}   " + " / ".join(f"{g:.1f}" for g in run["peak_gib"])
                     + " GiB")
    lines += [f"  strong scaling ({n} GPUs, the same step): {r['strong']:.2f}x "
              f"(generate {r['strong_generate']:.2f}x, train {r['strong_train']:.2f}x)",
              f"  weak scaling ({n} GPUs, {n}x the prompts): throughput {r['weak']:.2f}x; "
              f"the sharded trainer's cost per token {r['train_per_token']:.2f}x one GPU's"]
    for label, run in runs.items():
        phases = "; ".join(f"{p} " + " ".join(f"{t:.2f}" for t in run["steps"][p]) for p in PHASES)
        lines.append(f"  per step, {label}: {phases}; mismatched tokens {run['mismatched_tokens']}")
    return "\n".join(lines)


# --- the trainer-only comparison ---------------------------------------------------------------


def measure(step, iters: int, warmup: int = 2) -> tuple[float, float]:
    """Seconds per step (mean over `iters` after `warmup`) and peak GiB a step allocates beyond
    what was allocated before it (both models' weights), i.e. activations, logits and gradients."""
    resident = torch.cuda.memory_allocated()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters, (torch.cuda.max_memory_allocated() - resident) / 2**30


def trainer_benchmark(args) -> dict:
    """The trainer's forward + backward (vLLM's kernels) against HF transformers' Qwen3 (SDPA, bf16),
    both computing the fp32 logprob of every next token and back-propagating their sum."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config_dict = shape_config(args.shape, args.layers)
    config = Qwen3Config(**config_dict, attn_implementation="sdpa")
    reference = Qwen3ForCausalLM(config).to("cuda", torch.bfloat16)
    model_args = simple_rl.model_args_from_hf_config(config_dict)
    with torch.device("cuda"):
        trainer = simple_rl.Qwen3(model_args)
    trainer.load_state_dict(simple_rl.from_hf_state_dict(reference.state_dict(), model_args))
    tokens = torch.randint(0, config.vocab_size, (args.seqs, args.seqlen), device="cuda")
    seqs = tokens.tolist()
    batch = simple_rl.pack_sequences([s[:1] for s in seqs], [s[1:] for s in seqs], "cuda")

    def reference_step():
        logits = reference(tokens).logits[:, :-1]  # (B, L - 1, V) bf16
        logprobs = logits.float().log_softmax(-1).gather(-1, tokens[:, 1:, None])
        logprobs.sum().backward()
        reference.zero_grad(set_to_none=True)

    def trainer_step():
        trainer(batch).logprobs.sum().backward()
        trainer.zero_grad(set_to_none=True)

    n_tokens = args.seqs * args.seqlen
    results = {}
    for name, step in (("reference", reference_step), ("trainer", trainer_step)):
        seconds, peak = measure(step, args.iters)
        results[name] = {"tokens_per_s": n_tokens / seconds, "peak_gib": peak}
    results["speed_ratio"] = results["trainer"]["tokens_per_s"] / results["reference"]["tokens_per_s"]
    results["memory_ratio"] = results["trainer"]["peak_gib"] / results["reference"]["peak_gib"]
    print(
        f"Qwen3-{args.shape} shape ({model_args.n_layers} layers), {args.seqs} x {args.seqlen} tokens, "
        f"forward + backward, {torch.cuda.get_device_name()}"
    )
    for name in ("reference", "trainer"):
        r = results[name]
        print(
            f"  {name:<10} {r['tokens_per_s']:>10,.0f} tokens/s   peak {r['peak_gib']:6.1f} GiB above weights"
        )
    print(
        f"  trainer / reference: speed {results['speed_ratio']:.2f}x, "
        f"peak memory {results['memory_ratio']:.2f}x"
    )
    if args.profile:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            trainer_step()
            torch.cuda.synchronize()
        busy, table = top_kernels(prof.key_averages(), 25)
        print(f"[the trainer's forward + backward: the GPU's kernels {busy:.3f} s]\n{table}")
    return results


# --- the batch-invariant matmul: vLLM's tiles, tiled_linear's, cuBLAS ------------------------------


def gemm_shapes(shape: str) -> dict:
    """(N, K) of every linear of a Qwen3 shape: merged q/k/v, o_proj, merged gate/up, down_proj, lm_head."""
    c = shape_config(shape)
    return batch_invariant_backward.qwen3_gemms(
        c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"],
        c["head_dim"], c["vocab_size"])


def gemm_methods():
    from vllm.model_executor.layers.batch_invariant import matmul_persistent

    from batch_invariant_backward import tiled_linear

    return {"vllm tiles": lambda x, w: matmul_persistent(x, w.t()), "tiled_linear": tiled_linear,
            "cuBLAS": torch.nn.functional.linear}


def graph_ms(run, replays: int = 20) -> float:
    """Milliseconds of `run()` replayed as one CUDA graph, as vLLM replays a decode step: no launch gaps."""
    run()  # compiles each kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def decode_gemms_ms(weights: list, m: int, method) -> float:
    """Milliseconds of one decode step's GEMMs (every layer's, then lm_head's) at m rows, as one CUDA graph
    (each weight read from memory: the layers' weights do not fit in L2)."""
    inputs = {w.shape[1]: torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16) for w in weights}
    return graph_ms(lambda: [method(inputs[w.shape[1]], w) for w in weights])


def vllm_norm(x, weight, eps, residual=None):
    """The norms vLLM 0.20 runs in batch-invariant mode, with `rms_norm_rows`'s arguments: the Triton RMSNorm
    (which copies a strided input first), after a bf16 add where there is a residual (the fused add+norm
    simple_rl.py replaced before `rms_norm_rows`)."""
    from vllm.model_executor.layers.batch_invariant import rms_norm_batch_invariant

    if residual is None:
        return rms_norm_batch_invariant(x, weight, eps)
    residual = x + residual
    return rms_norm_batch_invariant(residual, weight, eps), residual


def vllms_qk_norm_rotary(q, k, weight, eps, positions, cos_sin_cache):
    """What vLLM 0.20's Qwen3 attention runs before attending: q's and k's per-head norms, then its rotary op."""
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    (T, _, D), (q, k) = q.shape, (vllm_norm(q, weight, eps), vllm_norm(k, weight, eps))
    torch.ops._C.rotary_embedding(positions, q.view(T, -1), k.view(T, -1), D, cos_sin_cache, True)
    return q, k


def exact_qk_norm_rotary(q, k, weight, eps, positions, cos_sin_cache):
    """The same in one kernel, as the exact engine and the trainer run it."""
    from batch_invariant_backward import qk_norm_rotary

    return qk_norm_rotary(q, k, weight, weight, eps, positions, cos_sin_cache)


def decode_norms_ms(shape: str, layers: int, m: int, norm, qk_norm_rotary) -> float:
    """Milliseconds of one decode step's RMSNorms at m rows, as one CUDA graph: each layer's input norm (after
    the residual add from layer 1 on), q and k heads normed and rotated (views into the qkv projection's
    output) and post-attention add + norm, then the final add + norm."""
    from types import SimpleNamespace

    from batch_invariant_backward import rope_cos_sin_cache

    c = shape_config(shape)
    d, h, kv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    x, residual = (torch.randn(m, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    qkv = torch.randn(m, (h + 2 * kv) * hd, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, : h * hd].view(m, h, hd), qkv[:, h * hd : (h + kv) * hd].view(m, kv, hd)
    w, w_head = (torch.ones(d, device="cuda", dtype=torch.bfloat16),
                 torch.ones(hd, device="cuda", dtype=torch.bfloat16))
    table = rope_cos_sin_cache(SimpleNamespace(head_dim=hd, rope_theta=1e6, max_seq_len=4096), torch.bfloat16)
    table, positions = table.cuda(), torch.randint(0, 4096, (m,), device="cuda")

    def step():
        for i in range(layers):
            norm(x, w, 1e-6, residual if i else None)
            qk_norm_rotary(q, k, w_head, 1e-6, positions, table)
            norm(x, w, 1e-6, residual)
        norm(x, w, 1e-6, residual)
    return graph_ms(step)


def kernel_benchmark(args) -> dict:
    """vLLM 0.20's batch-invariant matmul with its fixed tiles, with tiled_linear's tiles, and cuBLAS: a
    decode step's GEMMs (--shape, all its layers) at 1-256 rows, TFLOP/s at training sizes, and the bits
    of tiled_linear against vLLM's, which must be equal. Then the norms and the log-softmax, vLLM's against
    ours (`norm_and_log_softmax_benchmark`)."""
    import triton

    from batch_invariant_backward import matmul_tiles

    methods, shapes = gemm_methods(), gemm_shapes(args.shape)
    n_layers = args.layers or SHAPES[args.shape]["layers"]
    g = torch.Generator(device="cuda").manual_seed(0)

    def weight(n, k):
        return (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()

    layers = [weight(*shapes[name]) for _ in range(n_layers) for name in ("qkv", "o_proj", "gate_up", "down")]
    step = layers + [weight(*shapes["lm_head"])]
    results = {"decode_ms": {}, "tflops": {}, "device": torch.cuda.get_device_name()}
    print(f"\nOne decode step's GEMMs, Qwen3-{args.shape} shape ({n_layers} layers + lm_head), "
          f"{results['device']}, CUDA graph replays")
    print(f"  {'rows':>6}" + "".join(f"{name:>14}" for name in methods) + "   tiled / cuBLAS   tiled / vllm")
    for m in (1, 8, 32, 64, 128, 256):
        ms = {name: decode_gemms_ms(step, m, method) for name, method in methods.items()}
        results["decode_ms"][m] = ms
        print(f"  {m:>6}" + "".join(f"{t:>11.2f} ms" for t in ms.values())
              + f"{ms['tiled_linear'] / ms['cuBLAS']:>15.2f}x{ms['tiled_linear'] / ms['vllm tiles']:>14.2f}x")
    del layers, step
    m = 8192
    print(f"\nTFLOP/s at {m} rows (a training micro-batch)")
    for name, (n, k) in shapes.items():
        x, w = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), weight(n, k)
        tflops = {label: 2 * m * n * k / triton.testing.do_bench(lambda: method(x, w)) / 1e9
                  for label, method in methods.items()}
        results["tflops"][name] = tflops
        print(f"  {name:<8} N={n:<6} K={k:<5}"
              + "".join(f"{label:>14} {t:5.0f}" for label, t in tflops.items()))
    # The same bits: every product tiled_linear computes equals vLLM's, over M from 1 to 32k.
    differ, checked = 0, 0
    for name, (n, k) in shapes.items():
        w = weight(n, k)
        for m in (1, 3, 16, 31, 33, 100, 128, 255, 257, 1000, 2049, 4097, 8192, 32768):
            if name == "lm_head" and m > 8192:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ours, theirs = methods["tiled_linear"](x, w), methods["vllm tiles"](x, w)
            differ += int((ours.view(torch.int16) != theirs.view(torch.int16)).sum())
            checked += ours.numel()
    results["differing_elements"] = differ
    tiles = sorted({tuple(matmul_tiles(m, n, k, 132).values()) for m in (1, 32, 256, 8192)
                    for n, k in shapes.values()})
    print(f"\ntiled_linear against vLLM's tiles: {differ} of {checked:,} output elements differ "
          f"(tiles {tiles})")
    results |= norm_and_log_softmax_benchmark(args.shape, n_layers)
    if args.sweep is not None:
        results["sweep"] = tile_sweep(shapes, weight, n_layers, args.sweep or SWEEP_ROWS)
    return results


def norm_and_log_softmax_benchmark(shape: str, n_layers: int) -> dict:
    """The kernels simple_rl.py swaps for faster ones with the same bits (tests/test_gpu.py checks them): a
    decode step's RMSNorms, vLLM's against `rms_norm_rows`; the log-softmax over the vocabulary (eager
    launches), vLLM's against `split_log_softmax`; and each row's drawn token's logprob, vLLM V2's
    (`compute_token_logprobs`, its `logprobs=0` path) against the exact sampler's `split_token_logprobs`."""
    import triton
    from vllm.model_executor.layers.batch_invariant import log_softmax
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    from batch_invariant_backward import rms_norm_rows, split_log_softmax, split_token_logprobs

    out = {"norms_ms": {}, "log_softmax_ms": {}, "token_logprobs_ms": {}}
    sides = ((vllm_norm, vllms_qk_norm_rotary), (rms_norm_rows, exact_qk_norm_rotary))
    vocab = shape_config(shape)["vocab_size"]
    print(f"\nOne decode step's RMSNorms and q and k's rotation ({n_layers} layers; CUDA graph replays), the "
          f"log-softmax over {vocab:,} columns, and the drawn tokens' logprobs: vLLM's against simple_rl.py's")
    print(f"  {'rows':>6}{'norms, vLLM':>14}{'ours':>15}{'ratio':>8}{'log-softmax, vLLM':>20}"
          f"{'split':>10}{'ratio':>8}{'token logprobs, vLLM':>23}{'split':>10}{'ratio':>8}")
    for m in (32, 256):
        norms = [decode_norms_ms(shape, n_layers, m, *side) for side in sides]
        logits = torch.randn(m, vocab, device="cuda")
        softmaxes = [triton.testing.do_bench(lambda: fn(logits)) for fn in (log_softmax, split_log_softmax)]
        tokens = torch.randint(0, vocab, (m,), device="cuda")
        tokens_ms = [triton.testing.do_bench(lambda: compute_token_logprobs(logits, tokens[:, None])),
                     triton.testing.do_bench(lambda: split_token_logprobs(logits, tokens))]
        out["norms_ms"][m], out["log_softmax_ms"][m] = norms, softmaxes
        out["token_logprobs_ms"][m] = tokens_ms
        print(f"  {m:>6}{norms[0]:>11.3f} ms{norms[1]:>12.3f} ms{norms[1] / norms[0]:>7.2f}x"
              f"{softmaxes[0]:>17.3f} ms{softmaxes[1]:>7.3f} ms{softmaxes[1] / softmaxes[0]:>7.2f}x"
              f"{tokens_ms[0]:>20.3f} ms{tokens_ms[1]:>7.3f} ms{tokens_ms[1] / tokens_ms[0]:>7.2f}x")
    m = 8192  # a training micro-batch's tokens: its forward runs these norms too
    out["norms_ms"][m] = norms = [decode_norms_ms(shape, n_layers, m, *side) for side in sides]
    print(f"  {m:>6}{norms[0]:>11.3f} ms{norms[1]:>12.3f} ms{norms[1] / norms[0]:>7.2f}x"
          "  (a micro-batch's forward)")
    return out


SWEEP_ROWS = (1, 32, 64, 128, 256, 1024, 8192)  # decode steps' sequences, then training micro-batches'


def tile_sweep(shapes: dict, weight, n_layers: int, rows) -> dict:
    """Every tile shape worth trying (pipelines up to 24 stages), at each GEMM and row count, timed as a
    decode step runs it: the GEMM's layers (distinct weights, read from memory) as one CUDA graph; a single
    timed call of a few microseconds would time its launch. Prints the current pick, cuBLAS, the fastest 3,
    a decode step's total with each, and whether every tile's bits are vLLM's."""
    from batch_invariant_backward import matmul_tiles, tiled_linear
    from vllm.model_executor.layers.batch_invariant import matmul_persistent

    out, differ, sms = {}, 0, torch.cuda.get_device_properties(0).multi_processor_count
    for m in rows:
        totals = {"picks": 0.0, "best": 0.0, "cuBLAS": 0.0}
        for name, (n, k) in shapes.items():
            ws = [weight(n, k) for _ in range(1 if name == "lm_head" else n_layers)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            reference = matmul_persistent(x, ws[0].t())
            pick = matmul_tiles(m, n, k, sms)
            picked = graph_ms(lambda: [tiled_linear(x, w, tiles=pick) for w in ws])
            cublas = graph_ms(lambda: [torch.nn.functional.linear(x, w) for w in ws])
            timed = []
            for bm in (16, 32, 64, 128):
                if bm > max(16, 2 * m) or (m >= 2048 and bm < 64):
                    continue
                candidates = itertools.product((16, 32, 64, 128, 256), (64, 128, 256), (2, 4, 8),
                                               (3, 4, 6, 8, 12, 16, 24))
                for bn, bk, warps, stages in candidates:
                    if ((bm + bn) * bk * 2 * stages > 220_000 or (warps == 8 and bm * bn < 4096)
                            or (warps == 2 and bm * bn > 2048) or k % bk):
                        continue
                    tiles = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, num_warps=warps,
                                 num_stages=stages)
                    try:
                        y = tiled_linear(x, ws[0], tiles=tiles)  # compiled here, before a capture
                    except Exception:  # out of shared memory or registers
                        continue
                    differ += int((y.view(torch.int16) != reference.view(torch.int16)).sum())
                    timed.append((graph_ms(lambda: [tiled_linear(x, w, tiles=tiles) for w in ws]),
                                  tuple(tiles.values())))
            timed.sort()
            totals["picks"] += picked
            totals["best"] += min(picked, timed[0][0])
            totals["cuBLAS"] += cublas
            out[f"{name} m={m}"] = {"pick": picked, "cublas": cublas, "best": timed[:3]}
            print(f"  {name:<8} x{len(ws):<3} m={m:<5} pick {tuple(pick.values())} {picked:.3f} ms  cuBLAS "
                  f"{cublas:.3f} ms  best " + "  ".join(f"{t:.3f} ms {c}" for t, c in timed[:3]), flush=True)
            del ws
        print(f"  m={m}: the GEMMs of a step, ms: " + ", ".join(f"{k} {v:.3f}" for k, v in totals.items()),
              flush=True)
    print(f"  sweep: {differ} differing elements over all tiles tried")
    return out | {"differing_elements": differ}


# --- a decode step of the engines ----------------------------------------------------------------

DECODE_SIDES = ("decode-standard", "decode-exact-vllm-tiles", "decode-exact")


def decode_side(side: str, args) -> dict:
    """Milliseconds per decode step of one engine (random weights of --shape): `standard` is vLLM's
    defaults (torch.compile and CUDA graphs) sampling from its own generator, the sampled tokens' logprobs
    in vLLM's lists; the exact sides are simple_rl.VLLMEngine.generate (batch-invariant, V2 runner, CUDA
    graphs, a seed per request, the logprobs kept on the GPU), with vLLM's tiles or tiled_linear's, at
    --decode-seqs sequences of --decode-context prompt tokens each (the KV cache a long generation's tail
    reads). A step's time is that of 16 + 512 new tokens less that of 16, over 512 steps: 3 such pairs,
    their median the figure and their lowest and highest its spread."""
    from vllm import SamplingParams, TokensPrompt

    directory = Path(tempfile.mkdtemp())
    (directory / "config.json").write_text(json.dumps(shape_config(args.shape, args.layers)))
    longest = max(1024, args.decode_context + 528)
    common = dict(gpu_memory_utilization=args.vllm_gpu_memory, max_model_len=longest, load_format="dummy")
    if side == "decode-standard":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm

        llm = vllm.LLM(model=str(directory), skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                       max_num_seqs=256, **common)
    else:
        plumbing.init_distributed("cuda")  # as the script: torch's host work on one thread
        if side == "decode-exact-vllm-tiles":  # the engine then serves its linears with vLLM's own tiles
            from vllm.model_executor.layers.batch_invariant import linear_batch_invariant

            batch_invariant_backward.tiled_linear = linear_batch_invariant
        engine = simple_rl.VLLMEngine(directory, seed=0, sleep_mode=False, **common)
    g = torch.Generator().manual_seed(0)
    out = {}
    for n in args.decode_seqs:
        prompts = [torch.randint(0, 151936, (args.decode_context,), generator=g).tolist() for _ in range(n)]

        def generate(tokens: int) -> float:
            start = time.perf_counter()
            if side != "decode-standard":  # as simple_rl.py generates: its logprobs kept on the GPU
                engine.generate(prompts, [tokens] * n, 1.0, seeds=list(range(n)), ignore_eos=True)
                return time.perf_counter() - start
            params = [SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, logprobs=0,
                                     flat_logprobs=True, detokenize=False) for _ in range(n)]
            with gc_off():  # as simple_rl.VLLMEngine.generate runs
                llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            return time.perf_counter() - start

        generate(16)
        # 3 (long - short) pairs: single pairs moved by up to 1.5x between runs (H100).
        out[n] = [(generate(528) - generate(16)) / 512 * 1e3 for _ in range(3)]
        if args.profile and side in ("decode-exact", "decode-standard"):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                wall = generate(64)
            busy, table = top_kernels(prof.key_averages(), 20)
            print(f"[{side}, {n} sequences, 64 new tokens: {wall:.3f} s wall, the GPU's kernels {busy:.3f} s]"
                  f"\n{table}")
    return out


def decode_benchmark(args) -> dict:
    results, spreads = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in args.decode or DECODE_SIDES:
            env = {k: v for k, v in os.environ.items() if k != "VLLM_BATCH_INVARIANT"}
            if side != "decode-standard":
                env["VLLM_BATCH_INVARIANT"] = "1"
            out = Path(tmp) / "side.json"
            cmd = [sys.executable, __file__, "--shape", args.shape, *layer_flags(args),
                   "--vllm-gpu-memory", str(args.vllm_gpu_memory),
                   *(["--profile", args.profile] if args.profile else []),
                   "--decode-context", str(args.decode_context), "--decode-seqs", *map(str, args.decode_seqs),
                   "--side", side, "--json", str(out)]
            subprocess.run(cmd, env=env, check=True)
            pairs = {int(n): sorted(t) for n, t in json.loads(out.read_text()).items()}
            name = side.removeprefix("decode-")
            ms = results[name] = {n: statistics.median(t) for n, t in pairs.items()}
            spreads[name] = {n: (t[0], t[-1]) for n, t in pairs.items()}
            # printed now too: a run cut short (a timeout, a failing side) still reports the sides it ran
            print(f"  {side}: " + ", ".join(f"{t:.2f} ms at {n} sequences" for n, t in ms.items()),
                  flush=True)
    print(f"\nA decode step, Qwen3-{args.shape} shape, {args.decode_context} prompt tokens, "
          f"{torch.cuda.get_device_name()}: ms per step, the median of 3 (lowest-highest)")
    print(f"  {'':<20}" + "".join(f"{f'{n} sequences':>22}" for n in args.decode_seqs))
    for side, ms in results.items():
        print(f"  {side:<20}" + "".join(f"{ms[n]:>8.2f} ({spreads[side][n][0]:.2f}-{spreads[side][n][1]:.2f})"
                                       for n in args.decode_seqs))
    for n in args.decode_seqs if {"exact", "standard"} <= results.keys() else ():
        tiles = results.get("exact-vllm-tiles", {}).get(n)
        (lo, hi), (lo_std, hi_std) = spreads["exact"][n], spreads["standard"][n]
        print(f"  exact / standard at {n}: {results['exact'][n] / results['standard'][n]:.2f}x"
              + (f" (with vLLM's tiles: {tiles / results['standard'][n]:.2f}x)" if tiles else "")
              + (" (the sides' spreads overlap)" if lo <= hi_std and lo_std <= hi else ""))
    return results | {"spreads": spreads}


def write_model(directory: Path, shape: str, gsm8k: Path, layers: int | None = None) -> None:
    """A random Qwen3 of a real shape with a tokenizer trained on GSM8K: `simple_rl.py --model` offline.
    Token ids past the tokenizer's 1,024 decode to nothing, so the random model's rewards are 0."""
    rows = [json.loads(line) for line in gsm8k.read_text().splitlines()[:2000]]
    directory.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(directory, [r["question"] + "\n" + r["answer"] for r in rows])
    write_checkpoint(directory, shape_config(shape, layers, eos_token_id=tok.eos_token_id), seed=0,
                     device="cuda")
    print(f"wrote {directory}: random Qwen3-{shape} shape, tokenizer of {len(tok)} tokens")


def parse_flags() -> argparse.Namespace:
    """bench.py's command line: which benchmark to run, and its settings."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=list(SHAPES), default="1.7b")
    parser.add_argument("--layers", type=int, help="fewer layers than the shape has (quick checks)")
    parser.add_argument("--iters", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--json", help="also write the results to this file")
    step = parser.add_argument_group("step benchmark (defaults: simple_rl.py's)")
    sampling, engine = simple_rl.Sampling(), simple_rl.Engine()
    step.add_argument("--prompts", type=int, default=sampling.prompts_per_step)
    step.add_argument("--samples", type=int, default=sampling.samples_per_prompt)
    step.add_argument("--max-new-tokens", type=int, default=sampling.max_new_tokens)
    step.add_argument("--lengths", choices=["fixed", "thinking"], default="fixed",
                      help="fixed: every completion --max-new-tokens long; thinking: long-tailed, a median "
                      "of 0.4 x --max-new-tokens, about 6%% at the cap (the same on both sides)")
    step.add_argument("--vllm-gpu-memory", type=float, default=engine.vllm_gpu_memory)
    step.add_argument("--max-tokens-per-microbatch", type=int, default=engine.max_tokens_per_microbatch)
    step.add_argument("--activation-checkpointing", action="store_true")
    step.add_argument("--repeats", type=int, choices=[1, 2], default=2,
                      help="2: the sides run standard, exact, exact, standard; 1: standard, exact")
    step.add_argument("--save-every", type=int, default=4,
                      help="the exact side's 2 saves after its timed steps: this many steps apart "
                      "(0: none, for a model whose two checkpoints do not fit the disk)")
    step.add_argument("--seeded-standard", action="store_true",
                      help="the standard side seeds each request too "
                      "(vLLM 0.20 then draws noise per request)")
    step.add_argument("--side", choices=["exact", "standard", *DECODE_SIDES], help=argparse.SUPPRESS)
    step.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    trainer = parser.add_argument_group("trainer-only benchmark")
    trainer.add_argument("--trainer-only", action="store_true")
    trainer.add_argument("--seqs", type=int, default=8)
    trainer.add_argument("--seqlen", type=int, default=1024)
    trainer.add_argument(
        "--profile", nargs="?", const="all", choices=list(PROFILED),
        help="also print the top CUDA kernels: of the trainer (--trainer-only), of decoding (--decode), "
        "of the exact side's train phase (the step benchmark), or of each run's train phase, every rank's "
        "(--gpus: one more step, profiled); `--profile kernels`: the kernels alone, no CPU tracing to slow "
        "the host (the GPU's idle time is the run's own; whether the host ran ahead of it)"
    )
    trainer.add_argument("--profile-dir", type=Path,
                         help="with --gpus --profile: where each run's profiles and timelines are copied")
    kernels = parser.add_argument_group("kernel benchmarks")
    kernels.add_argument("--kernels", action="store_true",
                         help="decode-step GEMMs and training-size TFLOP/s (vLLM's tiles, tiled_linear's, "
                         "cuBLAS); a decode step's norms and the sampler's log-softmax (vLLM's, ours)")
    kernels.add_argument("--sweep", type=int, nargs="*", metavar="ROWS",
                         help="with --kernels: time every tile shape at these row counts (default: "
                         f"{' '.join(map(str, SWEEP_ROWS))})")
    kernels.add_argument("--decode", nargs="*", choices=DECODE_SIDES, metavar="SIDE",
                         help="ms per decode step: the standard engine, the exact one with vLLM's and with "
                         f"our tiles (default: all of {', '.join(DECODE_SIDES)})")
    kernels.add_argument("--decode-context", type=int, default=128,
                         help="with --decode: each sequence's prompt tokens (4096-16384: a long "
                         "generation's tail)")
    kernels.add_argument("--decode-seqs", type=int, nargs="+", default=[32, 256],
                         help="with --decode: the sequences decoding together, a case each")
    parser.add_argument("--gpus", type=int,
                        help="the scaling benchmark: simple_rl.py on 1 GPU, then on this many (with --fits: "
                        "each configuration on this many)")
    parser.add_argument("--fits", nargs="+", metavar="'SHAPE [FLAG ...]'",
                        help="simple_rl.py on one GPU (--gpus N: on N) in each configuration: step time, "
                        "peak GPU and host memory")
    parser.add_argument("--write-model", type=Path, metavar="DIR")
    parser.add_argument("--gsm8k", type=Path,
                        help="GSM8K train jsonl for --write-model's tokenizer (and --gpus)")
    return parser.parse_args()


def main():
    if sys.argv[1:2] == ["--profiled-script"]:  # script_run's: bench.py --profiled-script STEP WHAT -- FLAGS
        return profiled_script(int(sys.argv[2]), sys.argv[3], sys.argv[5:])
    args = parse_flags()
    if not torch.cuda.is_available():
        raise SystemExit("bench.py needs a CUDA GPU")
    random.seed(0)
    if args.write_model:
        return write_model(args.write_model, args.shape, args.gsm8k, args.layers)
    if args.side in DECODE_SIDES:
        results = decode_side(args.side, args)
    elif args.side:
        results = run_side(args.side, args.ckpt, args)
    elif args.kernels:
        results = kernel_benchmark(args)
    elif args.decode is not None:
        results = decode_benchmark(args)
    elif args.fits:
        results = fits_benchmark(args)
    elif args.gpus:
        results = scaling_benchmark(args)
    elif args.trainer_only:
        results = trainer_benchmark(args)
    else:
        results = step_benchmark(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
