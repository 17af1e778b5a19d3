"""bench.py's arithmetic on the CPU (its runs need a GPU): a side's medians and spread over its processes,
the ratio line's word when the sides' spreads overlap, the decode table's ratios; the standard side's padded
micro-batches and its push's names."""

import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import qwen3_config, write_checkpoint

import bench
import plumbing


def process(*steps):
    return {"steps": [dict(generate=g, train=t, push=0.2) for g, t in steps], "peak_gib": [70.0],
            "mismatched_tokens": [0] * len(steps), "checkpoint_s": 20.0, "sampled_tokens": 131072, "device": "H100",
            "engine_step_ms": [8.0 + g for g, _ in steps], "forward_ms": [1.0 + g for g, _ in steps],
            "sample_ms": [g / 10 for g, _ in steps]}


def test_a_side_has_its_medians_and_the_spread_of_its_processes():
    side = bench.combine([process((6.0, 4.0), (6.4, 4.2)), process((7.0, 4.4), (7.2, 4.6))])
    assert (side["generate"], side["train"]) == pytest.approx((6.7, 4.3))  # over all four steps
    assert side["spread"]["generate"] == pytest.approx((6.2, 7.1))
    assert side["spread"]["step"] == pytest.approx((6.2 + 4.1 + 0.2, 7.1 + 4.5 + 0.2))


def test_each_timed_step_keeps_its_engine_steps_forwards_and_samplings_medians(monkeypatch):
    """`EngineSteps` times every step of vLLM's engine and the model forward and the sampling in it (CUDA
    events: a stand-in here), leaving what they return alone; `medians` gives those of the steps since its last
    call; a side keeps each timed step's medians, process after process."""
    class Event:  # a CUDA event whose elapsed time is the forward's input
        def __init__(self, enable_timing):
            assert enable_timing
        def record(self):
            self.at = clock[0]
        def elapsed_time(self, end):
            return end.at - self.at
    clock = [0.0]

    def forward(ms):
        clock[0] += ms
        return "hidden"

    def sample(ms):
        clock[0] += ms
        return "tokens"
    monkeypatch.setattr(bench.torch.cuda, "Event", Event)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    runner = SimpleNamespace(execute_model=forward, sample_tokens=sample)
    worker = SimpleNamespace(driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner)))
    core = SimpleNamespace(engine_core=SimpleNamespace(model_executor=worker))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(step=lambda: "outputs", engine_core=core))
    steps = bench.EngineSteps(llm)
    assert [llm.llm_engine.step() for _ in range(3)] == ["outputs"] * 3
    assert [runner.execute_model(ms) for ms in (7.0, 7.5, 9.0)] == ["hidden"] * 3
    assert [runner.sample_tokens(ms) for ms in (0.5, 0.25, 0.75)] == ["tokens"] * 3
    first = steps.medians()
    assert (first["forward_ms"], first["sample_ms"]) == (7.5, 0.5) and 0 <= first["engine_step_ms"] < 1e3
    runner.execute_model(6.0)
    runner.sample_tokens(1.0)
    llm.llm_engine.step()
    second = steps.medians()
    assert (second["forward_ms"], second["sample_ms"]) == (6.0, 1.0)  # the earlier steps were cleared
    side = bench.combine([process((6.0, 4.0), (6.4, 4.2)), process((7.0, 4.4))])
    assert side["engine_step_ms"] == pytest.approx([14.0, 14.4, 15.0])
    assert side["forward_ms"] == pytest.approx([7.0, 7.4, 8.0])
    assert side["sample_ms"] == pytest.approx([0.6, 0.64, 0.7])


def test_the_ratio_line_says_where_the_sides_spreads_overlap():
    exact = bench.combine([process((6.0, 4.0)), process((6.6, 4.1))])
    standard = bench.combine([process((6.4, 7.0)), process((7.0, 7.2))])
    assert bench.overlap_note(exact, standard) == " (the sides' spreads overlap: generate, push)"
    apart = bench.combine([process((9.0, 7.0)), process((9.5, 7.2))])
    assert bench.overlap_note(exact, apart) == " (the sides' spreads overlap: push)"


def test_a_save_is_costed_against_the_steps_that_neither_save_nor_run_beneath_a_write():
    """A saving step costs its phases and what its save held training, over the process's median plain step:
    the timed steps and those after the last write (10.8 s here, of 10.2, 10.8 and 11.1), whose own spread
    the line gives; a step beneath a write its phases over theirs (which phase the write slows); the report's
    last line is the slowest saving step, the process's first save included. The stepping thread's host
    counters of each step beneath a write stand beside their median over the plain steps."""
    def host(system_s, waits):
        return dict(user_s=2.0, system_s=system_s, waits=waits, preempted=3, page_faults=100, reclaimed=0)
    run = process((6.0, 4.0), (6.4, 4.2)) | {"pinning": 12.0, "host": [host(0.1, 10), host(0.3, 30)], "saves": {
        "saving": [{"step": 10.6, "held": 1.5, "waited": 0.0}, {"step": 10.8, "held": 2.0, "waited": 1.5}],
        "beneath": [dict(generate=6.7, train=4.1, push=0.2), dict(generate=6.2, train=4.1, push=0.2)],
        "beneath_host": [host(1.25, 5000), host(0.2, 20)],
        "writing": [True, False], "writes": [9.0, 9.5], "end_wait": 4.0, "bytes": 19_000_000_000,
        "plain": [dict(generate=6.6, train=4.3, push=0.2)], "plain_host": [host(0.4, 40)]}}
    cost = bench.save_costs(run)
    assert cost["host"]["system_s"] == (pytest.approx(0.3), [1.25, 0.2]) and cost["host"]["waits"] == (30, [5000, 20])
    assert cost["saving"] == pytest.approx([1.3, 2.0]) and cost["beneath"] == pytest.approx([0.2, -0.3])
    assert cost["plain"] == pytest.approx([-0.6, 0.0, 0.3])
    assert cost["beneath_phases"]["generate"] == pytest.approx([0.3, -0.2])  # over the median 6.4 s
    assert cost["beneath_phases"]["train"] == pytest.approx([-0.1, -0.1])
    assert bench.combine([run, process((6.0, 4.0))])["saves"] == [cost]  # the standard side saves nothing
    lines = bench.save_lines([cost], 2).splitlines()
    assert "a step that saves +1.30, +2.00 s" in lines[0] and "waiting for the previous write 0.00, 1.50 s" in lines[0]
    assert "writes of 19.0 GB in 9.0, 9.5 s (2.11, 2.00 GB/s)" in lines[0]
    assert lines[1] == ("  process 1, its stepping thread on the host (`host_counters`), a plain step's median -> "
                        "each step beneath a write: user_s 2.00 -> 2.00, 2.00; system_s 0.30 -> 1.25, 0.20; waits 30 -> "
                        "5,000, 20; preempted 3 -> 3, 3; page_faults 100 -> 100, 100; reclaimed 0 -> 0, 0")
    assert ("a step beneath a write +0.20, -0.30 s (generate +0.30, -0.20 s; train -0.10, -0.10 s; push +0.00, "
            "+0.00 s; the write still going at the end of 1 of them), over the median of the 3 steps that do "
            "neither (timed, and after the writes: themselves -0.60 to +0.30 s around it)") in lines[0]
    assert lines[-1] == ("  the slowest step that saves: +2.00 s over one that does not (1.50 s of it waiting for "
                         "the previous write: this disk writes a checkpoint more slowly than 2 steps run)")
    run["saves"]["saving"][1]["waited"] = 0.0  # the previous write had ended: nothing to explain
    assert bench.save_lines([bench.save_costs(run)], 2).splitlines()[-1].endswith("over one that does not")


def test_scaling_reports_strong_and_weak_scaling_and_the_trainers_cost_per_token():
    def run(generate, train, generated):  # `generated`: the tokens a step sampled, on all its ranks
        return {"generate": generate, "train": train, "push": 0.2, "step": generate + train + 0.2,
                "tokens_per_s": generated / (generate + train + 0.2), "generated": generated,
                "peak_gib": [60.0], "mismatched_tokens": [0, 0],
                "steps": {"generate": [generate + 1, generate - 1], "train": [train] * 2, "push": [0.2] * 2}}
    runs = {"1 GPU": run(6.0, 4.0, 102_000), "2 GPUs": run(4.0, 2.2, 102_400), "2 GPUs, 2x": run(6.2, 4.4, 205_200)}
    ratios = bench.scaling_ratios(runs, 2)
    assert ratios["strong"] == pytest.approx(10.2 / 6.4) and ratios["strong_train"] == pytest.approx(4.0 / 2.2)
    assert ratios["weak"] == pytest.approx(1.9)  # 19,000 tokens/s against 10,000
    # each rank's 102,600 tokens (not the one GPU's 102,000) in 4.4 s against 4.0
    assert ratios["train_per_token"] == pytest.approx((4.4 / 102_600) / (4.0 / 102_000))
    args = SimpleNamespace(layers=None, shape="1.7b", prompts=32, samples=8, max_new_tokens=512, iters=3)
    lines = bench.scaling_lines(runs, 2, args, "H100").splitlines()
    assert lines[-5] == "  strong scaling (2 GPUs, the same step): 1.59x (generate 1.50x, train 1.82x)"
    assert lines[-4] == ("  weak scaling (2 GPUs, 2x the prompts): throughput 1.90x; the sharded trainer's cost per "
                         "token 1.09x one GPU's")
    assert lines[-1] == ("  per step, 2 GPUs, 2x: generate 7.20 5.20; train 4.40 4.40; push 0.20 0.20; "
                         "mismatched tokens [0, 0]")


def test_a_benchmark_names_the_host_it_ran_on(monkeypatch):
    """The CPU's model (its first "model name") and the cores this process may use."""
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {0, 3, 5})
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (
        "processor\t: 0\nmodel name\t: AMD EPYC 9654 96-Core Processor\nmodel name\t: other\n"
        if str(self) == "/proc/cpuinfo" else real(self, *a, **k)))
    assert bench.host_cpu() == "AMD EPYC 9654 96-Core Processor, 3 cores"


def test_the_gpus_peak_memory_and_how_fast_the_first_ran_while_busy():
    """nvidia-smi's samples: each GPU's peak memory; the first GPU's mean SM clock over the samples in which
    it was at least 50% busy, and the share of those in which its power cap (0x4) or heat (0x20, 0x40, 0x80)
    held it back (an idle-clock reason, 0x1, does not count); lines nvidia-smi could not fill are skipped."""
    text = "\n".join(["0, 1024, 0, 345, 0x0000000000000001",  # idle: not counted
                       "1, 4096, 99, 1980, 0x0000000000000004",  # the second GPU: memory only
                       "0, 2048, 90, 1500, 0x0000000000000004",  # power-capped
                       "0, 3072, 60, 1800, 0x0000000000000000",
                       "0, 2560, 100, 1980, 0x0000000000000040",  # hardware thermal slowdown
                       "0, [N/A], 100, 1980, 0x0",
                       "1, 512, 99, 1980, 0x0"])
    samples = bench.gpu_samples(text)
    assert samples["peak_gib"] == [3.0, 4.0]
    assert samples["busy_gpu"] == {"samples": 3, "sm_mhz": pytest.approx((1500 + 1800 + 1980) / 3),
                                   "held_back": pytest.approx(2 / 3)}
    assert bench.gpu_samples("")["busy_gpu"] == {"samples": 0, "sm_mhz": 0.0, "held_back": 0.0}
    assert bench.busy_gpu_text(samples["busy_gpu"]) == ("SM 1,760 MHz while busy, held back by power or heat "
                                                         "67% of it (3 samples)")


def test_the_profile_tables_rank_kernels_by_gpu_time():
    def event(key, count, us):
        return SimpleNamespace(key=key, count=count, self_device_time_total=us)
    busy, table = bench.top_kernels([event("norm", 10, 1_000_000), event("cpu op", 3, 0),
                                     event("matmul", 20, 3_000_000), event("add", 5, 500)], 2)
    assert busy == pytest.approx(4.0005)
    lines = table.splitlines()
    assert len(lines) == 3 and lines[1].split() == ["matmul", "20", "3.0000", "75.0%"]
    assert lines[2].split() == ["norm", "10", "1.0000", "25.0%"]


def test_the_hosts_time_goes_to_each_event_by_its_own_cpu_time():
    """A range's own time is the Python inside it (not its ops'): a part whose Python loops ranks above the
    matmul it launches, which ranks above a cheap op; the lines sum every event's own time."""
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(512, 512)  # each ~20x the next (loops ~0.2 s, the matmul ~10 ms): a busy host keeps the order
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("python loops"):
            sum(i * i for i in range(3_000_000))
            (x @ x).neg_()
    events = prof.key_averages()
    lines = bench.host_lines(events, rows=3).splitlines()
    own = {e.key: e.self_cpu_time_total for e in events}
    assert lines[0].split()[7] == f"{sum(own.values()) / 1e6:.3f}"
    names = [line.split()[0] for line in lines[1:]]
    assert names[0] == "python" and own["python loops"] > own["aten::mm"] > own["aten::neg_"], lines


def test_the_gpus_idle_time_is_between_its_kernels_and_its_long_gaps_go_to_the_innermost_part():
    us = 1_000  # ns
    kernels = [(0, 100 * us), (50 * us, 200 * us),  # overlapping (two streams): busy 0-200 us
               (210 * us, 300 * us),  # a 10 us gap: a launch, not counted as a long gap
               (1_300 * us, 1_400 * us),  # 1 ms gap: inside "parity", itself inside "step"
               (1_900 * us, 2_000 * us)]  # 0.5 ms: inside "step" alone
    ranges = [("step", 0, 2_000 * us), ("parity", 500 * us, 1_600 * us)]  # the 1 ms gap's middle: 800 us
    span, idle, gaps = bench.gpu_idle(kernels, ranges)
    assert span == 2_000 * us and idle == (10 + 1_000 + 500) * us
    assert gaps == {"parity": 1_000 * us, "step": 500 * us}
    assert bench.gpu_idle(kernels, [])[2] == {"elsewhere": 1_500 * us}
    assert bench.gpu_idle([], ranges) == (0, 0, {})


def test_the_decode_table_gives_the_ratio_of_whichever_exact_sides_ran(monkeypatch, capsys):
    """`--decode decode-exact decode-standard` (the two sides the acceptance compares) prints exact / standard;
    with all three sides, vLLM's tiles too. Each side's process is replaced by its JSON (3 timings in ms at
    32 and at 256 sequences): the medians' ratio, and where the sides' lowest-highest ranges overlap, it says so."""
    import json

    ms = {"decode-standard": ([3.0, 2.9, 3.4], [8.0, 7.9, 8.1]), "decode-exact": ([3.6, 3.3, 3.7], [10.0, 9.0, 11]),
          "decode-exact-vllm-tiles": ([4.5, 4.5, 4.5], [12.0, 12.0, 12.0])}

    def side(cmd, env, check):  # the side's process: its JSON
        times = ms[cmd[cmd.index("--side") + 1]]
        bench.Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(dict(zip((32, 256), times))))
    monkeypatch.setattr(bench.subprocess, "run", side)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "H200")
    args = SimpleNamespace(shape="1.7b", layers=None, vllm_gpu_memory=0.5, profile=False, decode_context=128,
                           decode_seqs=[32, 256])
    bench.decode_benchmark(SimpleNamespace(**vars(args), decode=["decode-exact", "decode-standard"]))
    out = capsys.readouterr().out
    assert "exact / standard at 32: 1.20x (the sides' spreads overlap)\n" in out  # 3.3-3.7 against 2.9-3.4
    assert "exact / standard at 256: 1.25x\n" in out and "    3.00 (2.90-3.40)    8.00 (7.90-8.10)" in out
    bench.decode_benchmark(SimpleNamespace(**vars(args), decode=None))
    assert "exact / standard at 256: 1.25x (with vLLM's tiles: 1.50x)" in capsys.readouterr().out


def test_the_standard_side_pads_consecutive_samples_within_the_budget():
    """The standard trainer's micro-batches: consecutive samples right-padded to the longest, at most the
    budget's tokens with the padding, and each completion token read from the row before it."""
    prompts, completions = [[1, 2], [3], [4, 5, 6], [7]], [[8, 9], [10, 11, 12], [], [13]]
    batches = list(bench.padded_micro_batches(prompts, completions, token_budget=8))
    assert [(first, end) for first, end, *_ in batches] == [(0, 2), (2, 4)]
    first, end, ids, mask, rows, targets = batches[0]
    assert ids.tolist() == [[1, 2, 8, 9], [3, 10, 11, 12]] and mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert rows == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2)] and targets == [8, 9, 10, 11, 12]
    _, _, ids, mask, rows, targets = batches[1]
    assert ids.tolist() == [[4, 5, 6], [7, 13, 0]] and mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert rows == [(1, 0)] and targets == [13]


@pytest.mark.parametrize("experts", [0, 4])
def test_the_standard_side_pushes_what_a_checkpoint_holds(tmp_path, experts):
    """transformers 5 keeps a Qwen3-MoE layer's experts in two (E, ...) tensors; the standard side pushes them
    to vLLM by a checkpoint's names, each expert's, with its values: the tensors the checkpoint holds."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = qwen3_config(layers=2, experts=experts, experts_per_token=2, moe_intermediate=24, tie=False)
    src = write_checkpoint(tmp_path / "m", config)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    pushed, saved = dict(bench.checkpoint_named(model)), load_file(src / "model.safetensors")
    assert pushed.keys() == saved.keys() == plumbing.checkpoint_shapes(config).keys()
    assert all(torch.equal(pushed[k].view(torch.int16), saved[k].view(torch.int16)) for k in saved)


def test_thinking_lengths_are_long_tailed_and_the_same_for_both_sides():
    """--lengths thinking: each request's new tokens drawn per step from a fixed seed (both sides read the
    same), a median near 0.4 of the cap, a few at the cap, none under 16; --lengths fixed: all at the cap."""
    import statistics

    args = SimpleNamespace(prompts=32, samples=8, max_new_tokens=8192, lengths="thinking")
    lengths = bench.completion_lengths(args, 3)
    assert lengths == bench.completion_lengths(args, 3) and lengths != bench.completion_lengths(args, 4)
    assert len(lengths) == 256 and min(lengths) >= 16 and max(lengths) == 8192
    assert 0.3 < statistics.median(lengths) / 8192 < 0.5 and 0.01 < lengths.count(8192) / 256 < 0.15
    assert bench.completion_lengths(SimpleNamespace(**vars(args) | {"lengths": "fixed"}), 3) == [8192] * 256


def test_fits_writes_each_shape_with_the_layers_asked_for(monkeypatch, tmp_path):
    """--fits with --layers: the model written for each configuration has those layers (its run is simple_rl.py
    on a GPU: here, what it returned); with --gpus N each runs on N."""
    written = []

    def write(command, check):
        written.append(command)
        Path(command[command.index("--write-model") + 1]).mkdir()
    monkeypatch.setattr(bench.subprocess, "run", write)
    gpus = []
    monkeypatch.setattr(bench, "script_run", lambda n, *a, **k: gpus.append(n) or {
        "step": 1.0, "train": 0.5, "peak_gib": [2.0, 2.5], "host_peak_gib": 3.0, "mismatched_tokens": [0],
        "planned": "plan"})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: "a GPU")
    monkeypatch.setattr(bench, "visible_gpus", lambda: ["0", "1"])
    args = SimpleNamespace(fits=["30b-a3b --vllm-gpu-memory 0.2", "1.7b"], layers=4, gsm8k=tmp_path / "t.jsonl",
                           prompts=32, samples=8, max_new_tokens=512, iters=2, gpus=None)
    bench.fits_benchmark(args)
    assert [command[command.index("--shape") + 1: command.index("--write-model")] for command in written] == [
        ["30b-a3b", "--layers", "4"], ["1.7b", "--layers", "4"]]
    bench.fits_benchmark(SimpleNamespace(**vars(args) | {"gpus": 2}))  # --gpus 2: each configuration on 2
    assert gpus == [1, 1, 2, 2]
    with pytest.raises(SystemExit, match="--gpus 3: at most the 2 GPUs visible"):
        bench.fits_benchmark(SimpleNamespace(**vars(args) | {"gpus": 3}))


def test_a_profiled_script_run_writes_its_steps_profile(tmp_path, monkeypatch):
    """`bench.py --gpus N --profile` runs the script through `profiled_script`: the script's own run (here on the
    CPU, a stand-in for vLLM), its step 1's train and push phases profiled, the parts named, steps 0 and 2 not;
    the allocator's counts of steps 0 and 1 (none on the CPU), their garbage collections and their forwards'
    wall and CPU seconds."""
    import simple_rl
    from conftest import gsm8k_jsonl, write_gsm8k_model
    from test_rl import TrainerAsSampler

    model_dir = write_gsm8k_model(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "CPU")
    monkeypatch.setattr(simple_rl, "run_as_script", lambda args, files: simple_rl.main(
        args, device="cpu", engine_class=TrainerAsSampler, files=files))
    monkeypatch.setattr(simple_rl, "grpo_step", simple_rl.grpo_step)  # restored after the test
    profiled = []
    monkeypatch.setattr(bench, "profile_lines", lambda prof, parts, wall, what: profiled.append(wall) or
                        bench.top_kernels([], 1)[1] + "\n" + "\n".join(
                            e.key for e in prof.key_averages() if e.key in parts))
    bench.profiled_script(1, "all", ["--model", str(model_dir), "--dataset", str(gsm8k_jsonl("train")),
                              "--eval-dataset", str(gsm8k_jsonl("test")), "--prompts-per-step", "2",
                              "--samples-per-prompt", "2", "--max-new-tokens", "6", "--max-prompt-tokens", "400",
                              "--max-tokens-per-microbatch", "500", "--steps", "3", "--eval-every", "0",
                              "--save-every", "-1", "--run-name", "prof"])
    assert len(profiled) == 1 and profiled[0].endswith("s wall, rank 0 of 1")
    text = (tmp_path / "runs" / "prof" / "profile_rank0.txt").read_text()
    assert {"micro-batches", "forwards", "parity", "optimizer step", "gather the step", "checksums"} <= set(
        text.splitlines()[1:]), text
    allocator, collector, forwards = text.splitlines()[-3:]
    assert allocator == "PyTorch's allocator, each step: cudaMalloc calls / retries 0/0 0/0", text
    assert re.fullmatch(r"Python's garbage collector, each step: seconds \(full collections\) "
                        r"\d+\.\d{3} \(\d+\), \d+\.\d{3} \(\d+\)", collector), text
    steps = forwards.removeprefix("the forwards, each step: wall / this thread's CPU seconds ").split()
    walls, cpus = zip(*(map(float, step.split("/")) for step in steps))
    assert len(walls) == 2 and all(0 < cpu <= wall * 1.05 + 0.01 for wall, cpu in zip(walls, cpus)), text
    assert simple_rl.Qwen3.forward.__name__ == "forward"  # the script's own again
    assert (tmp_path / "runs" / "prof" / "trace_rank0.json.gz").stat().st_size > 0


def test_a_kernels_only_profile_has_cudas_calls_for_host_lines_and_no_launches_slowed(monkeypatch):
    """`--profile kernels` traces the GPU's kernels alone (no CPU tracing slows the host): its lines give the
    kernels, the GPU's idle time and CUDA's own calls (a full queue: the host ahead), not the profiler's slowed
    launches; `--profile` alone traces the host's ops too."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "H200")
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    kernel = SimpleNamespace(key="matmul", count=2, self_device_time_total=3_000, device_type=cuda,
                             is_user_annotation=False, self_cpu_time_total=0)

    def host(key):
        return SimpleNamespace(key=key, count=2, self_device_time_total=0, device_type=cpu,
                               is_user_annotation=False, self_cpu_time_total=500, cpu_time_total=500)
    timeline = [SimpleNamespace(device_type=lambda: cuda, is_user_annotation=lambda: False,
                                name=lambda: "matmul", start_ns=lambda a=a: a,
                                end_ns=lambda a=a: a + 1_500_000_000) for a in (0, 2 * 10**9)]  # 0.5 s apart

    def lines(events, what):
        prof = SimpleNamespace(key_averages=lambda: events,
                               profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: timeline)))
        return bench.profile_lines(prof, {}, "1.00 + 0.10 s wall", what)
    kernels_only = lines([kernel], "kernels")
    assert "kernels 0.00 s" in kernels_only.splitlines()[0] and "the GPU idle 0.500 s" in kernels_only
    assert "host's CPU time" not in kernels_only and "profiler slows" not in kernels_only, kernels_only
    assert "queue full 0 times, the host blocked 0.000 s: it never ran ahead" in kernels_only, kernels_only
    cuda_calls = lines([kernel, host("Command Buffer Full")], "kernels")
    assert "Command Buffer Full" in cuda_calls and "profiler slows" not in cuda_calls, cuda_calls
    assert "queue full 2 times, the host blocked 0.001 s: it ran ahead" in cuda_calls, cuda_calls
    both = lines([kernel, host("aten::mm")], "all")
    assert "aten::mm" in both and "profiler slows" in both and "queue full" not in both, both
    for argv, what in (([], None), (["--profile"], "all"), (["--profile", "kernels"], "kernels")):
        monkeypatch.setattr(bench.sys, "argv", ["bench.py", *argv])
        assert bench.parse_flags().profile == what


def test_the_sweep_takes_its_row_counts_or_sweeps_them_all(monkeypatch):
    """`--kernels --sweep 128 256` sweeps the tiles at those rows alone (a sweep of every row count outlasts a
    device call); `--sweep` alone, an empty list (every row count), and no sweep without it."""
    for argv, rows in ((["--sweep", "128", "256"], [128, 256]), (["--sweep"], []), ([], None)):
        monkeypatch.setattr(bench.sys, "argv", ["bench.py", "--kernels", *argv])
        assert bench.parse_flags().sweep == rows


def test_host_counters_see_the_thread_wait_and_touch_new_pages():
    """The counters are this thread's: a sleep is a voluntary switch, a first touch of fresh memory faults."""
    before = bench.host_counters()
    time.sleep(0.01)
    touched = bytearray(64 * 1024 * 1024)  # zeroed: every page written once
    after = bench.host_counters()
    # 16,384 pages of 4 KiB, or 32 of 2 MiB where the kernel backs it with huge pages
    assert after["waits"] > before["waits"] and after["page_faults"] - before["page_faults"] >= 16
    assert after.keys() == {"user_s", "system_s", "waits", "preempted", "page_faults", "reclaimed"}
    del touched
