"""Shared fixtures. Tests marked `gpu` need CUDA (and vLLM 0.20); without a GPU they are skipped."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline_demo import qwen3_config, random_hf_weights, write_checkpoint, write_jsonl, write_model  # noqa: E402, F401

# The real GSM8K jsonl files: ../shared/data/gsm8k beside the checkout (CI), or GSM8K_DIR (GPU machine).
GSM8K_DIR = Path(os.environ.get("GSM8K_DIR", Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and vLLM 0.20 (skipped without CUDA)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def start_engine(*args, kv_cache_gib: float | None = None, **kwargs):
    """A simple_rl.VLLMEngine, one more in this process. vLLM keeps a process-global workspace that
    a new engine replaces right after its memory snapshot; the old workspace's memory then comes back
    during the new engine's profiling, which vLLM refuses. Drop it (and any dead engine) first. An
    engine that is not the process's first gets a fixed KV cache (`kv_cache_gib`): sizing it from a
    memory profile fails when the earlier engines' buffers move during the profile."""
    import gc

    import simple_rl
    from vllm.v1.worker import workspace

    workspace._manager = None
    gc.collect()
    torch.cuda.empty_cache()
    if kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    return simple_rl.VLLMEngine(*args, **kwargs)


def gsm8k_rows(split: str, n: int | None = None) -> list[dict]:
    with open(GSM8K_DIR / f"{split}.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return rows[:n] if n else rows


def write_gsm8k_model(directory: Path, seed: int = 0, device="cpu", **config) -> Path:
    """A random Qwen3 with a tokenizer trained on GSM8K: a complete, offline simple_rl.py --model."""
    return write_model(directory, [r["question"] + "\n" + r["answer"] for r in gsm8k_rows("train", 2000)], seed, device, **config)
