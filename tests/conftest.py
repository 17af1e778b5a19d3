"""Shared fixtures. Tests marked `gpu` need CUDA (and vLLM 0.20); without a GPU they are skipped.

GSM8K for the tests: the first 400 train and 100 test rows of the real data set ship with them (tests/data;
OpenAI's grade-school-math, MIT licence in tests/data/GSM8K_LICENSE), so every CPU test runs on a fresh
clone. Where a test wants all of it: GSM8K_DIR, ../shared/data/gsm8k beside the checkout, or the hub if it
answers at once."""

import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline_demo import (qwen3_config, random_hf_weights, write_checkpoint, write_jsonl, write_model,  # noqa: E402, F401
                          write_tokenizer)

SAMPLE_DIR = Path(__file__).resolve().parent / "data"
GSM8K_DIR = Path(os.environ.get("GSM8K_DIR", Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and vLLM 0.20 (skipped without CUDA)")
    # torch's own torch.utils.mkldnn, imported when torchtitan's import calls torch.compile, uses what torch
    # deprecates: nothing this project can change (python warns of it only under pytest).
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
    # DCP without a process group (a CPU run of one process) says it saves and loads in a single process: it does.
    config.addinivalue_line("filterwarnings", "ignore:torch.distributed is disabled, unavailable or uninitialized")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # In-process tests compare against an engine started in this process: its kernels are batch
        # invariant only if the variable was set before vLLM loaded (the tests' own runs set it themselves).
        if os.environ.get("VLLM_BATCH_INVARIANT") != "1" and any("gpu" in item.keywords for item in items):
            raise pytest.UsageError("the GPU tests need VLLM_BATCH_INVARIANT=1 (README: the test command)")
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def torch_threads():
    """Each test starts with this process's torch threads: a test that runs the script's `main` on a "cuda"
    device takes its one host thread (`plumbing.init_distributed`), and a later test's CPU matmuls would then
    sum in another order than its spawned workers' (a reference update one process made differed from two's)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def free_dead_engines() -> None:
    """The GPU memory of engines no test holds any more, back to the driver (for a new engine, or the script
    run in a subprocess). vLLM's engine start moves every live object into the collector's permanent
    generation (`gc.freeze`), where a dead engine is never collected: unfreeze, then collect."""
    import gc

    gc.unfreeze()
    gc.collect()
    torch.cuda.empty_cache()


def start_engine(*args, kv_cache_gib: float | None = None, **kwargs):
    """A simple_rl.VLLMEngine, one more in this process. vLLM keeps a process-global workspace that a new
    engine replaces right after its memory snapshot; the old workspace's memory then comes back during the
    new engine's profiling, which vLLM refuses. Drop it (and any dead engine) first. An engine that is not
    the process's first gets a fixed KV cache (`kv_cache_gib`): sizing it from a memory profile fails when
    the earlier engines' buffers move during the profile."""
    import simple_rl
    from vllm.v1.worker import workspace

    workspace._manager = None
    free_dead_engines()
    if kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    return simple_rl.VLLMEngine(*args, **kwargs)


def gsm8k_jsonl(split: str) -> Path:
    """The shipped sample of the split ('train' or 'test'), a jsonl file for --dataset / --eval-dataset."""
    return SAMPLE_DIR / f"gsm8k_{split}_sample.jsonl"


def gsm8k_rows(split: str, n: int | None = None) -> list[dict]:
    """The shipped sample's rows, the first n if n is given."""
    rows = [json.loads(line) for line in gsm8k_jsonl(split).read_text().splitlines()]
    return rows[:n] if n else rows


@functools.cache
def hub_reachable() -> bool:
    """Decided once, in at most two seconds: can the Hugging Face hub be reached?"""
    import socket

    try:
        socket.create_connection(("huggingface.co", 443), timeout=2).close()
        return True
    except OSError:
        return False


def full_gsm8k(split: str) -> list[dict] | None:
    """All of GSM8K's split, from GSM8K_DIR or the hub; None where neither is."""
    path = GSM8K_DIR / f"{split}.jsonl"
    if path.is_file():
        return [json.loads(line) for line in path.read_text().splitlines()]
    if not hub_reachable():
        return None
    from datasets import load_dataset

    return [{"question": r["question"], "answer": r["answer"]} for r in load_dataset("openai/gsm8k", "main", split=split)]


def make_args(**flags):
    """simple_rl.Args from flat flag names, each put in its group: make_args(model=M, steps=3) is
    Args(data=Data(model=M), optimizer=Optimizer(steps=3))."""
    import simple_rl

    groups = {f.name: f.default_factory for f in dataclasses.fields(simple_rl.Args)}
    values = {group: {} for group in groups}
    for name, value in flags.items():
        group = next(g for g, cls in groups.items() if name in {f.name for f in dataclasses.fields(cls)})
        values[group][name] = value
    return simple_rl.Args(**{group: cls(**values[group]) for group, cls in groups.items()})


def trace(model, tokens: list[int]) -> dict:
    """The divergence locator's trainer tensors for a prefill of `tokens`, as simple_rl.py makes them."""
    import simple_rl
    from batch_invariant_backward import trainer_trace

    return trainer_trace(model, simple_rl.pack_sequences([tokens[:-1]], [tokens[-1:]], model.cos_sin_cache.device))


def write_gsm8k_model(directory: Path, seed: int = 0, device="cpu", **config) -> Path:
    """A random Qwen3 with a tokenizer trained on GSM8K: a complete, offline simple_rl.py --model. Its
    head_dim is 128 unless given: simple_rl.py refuses head sizes whose attention vLLM computes otherwise."""
    texts = [r["question"] + "\n" + r["answer"] for r in gsm8k_rows("train")]
    return write_model(directory, texts, seed, device, **{"head_dim": 128} | config)


QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
"""Qwen3's chat format, written for the tests: <|im_start|>role ... <|im_end|> turns, and with
enable_thinking=False an empty think block opening the assistant's turn, as Qwen3's template does."""


def write_chat_model(directory: Path, device="cpu", **config) -> Path:
    """A random Qwen3 whose tokenizer (trained on GSM8K) has Qwen3's chat tokens and template: it ends
    a turn with <|im_end|>, its eos token, while config.json names <|endoftext|>, as Qwen3's do."""
    texts = [r["question"] + "\n" + r["answer"] for r in gsm8k_rows("train")]
    directory.mkdir(parents=True, exist_ok=True)
    hf_tok = write_tokenizer(directory, texts, special_tokens=("<|im_start|>", "<|im_end|>"), eos_token="<|im_end|>")
    hf_tok.add_tokens(["<think>", "</think>"])  # plain added tokens: they stay in decoded text, as in Qwen3
    hf_tok.chat_template = QWEN3_CHAT_TEMPLATE
    hf_tok.save_pretrained(directory)
    vocab = -(-len(hf_tok) // 64) * 64
    config = qwen3_config(vocab=vocab, eos_token_id=hf_tok.convert_tokens_to_ids("<|endoftext|>"),
                          **{"head_dim": 128} | config)
    return write_checkpoint(directory, config, device=device)


def checksums_of_shards(rows, ranks: int, device: str) -> list[int]:
    """`tensor_checksum` of each of `ranks` FSDP2 shards of `rows` (its rows split as torch.chunk splits them,
    some ranks empty) on `device`, a fake process group standing for each rank's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from batch_invariant_backward import tensor_checksum
    parts = []
    for rank in range(ranks):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ranks)
        try:
            chunks = rows.chunk(ranks) + (rows[:0],) * (ranks - len(rows.chunk(ranks)))
            shard = DTensor.from_local(chunks[rank].to(device), init_device_mesh(device, (ranks,)), [Shard(0)],
                                       run_check=False, shape=rows.shape, stride=rows.stride())
            parts.append(int(tensor_checksum("w", shard)))
        finally:
            dist.destroy_process_group()
    return parts
