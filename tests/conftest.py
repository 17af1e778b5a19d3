"""Shared fixtures. Tests marked `gpu` need CUDA (and vLLM 0.20); without a GPU they are skipped."""

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

# The real GSM8K jsonl files: ../shared/data/gsm8k beside the checkout (CI), or GSM8K_DIR; without
# either, openai/gsm8k from the hub through `datasets`.
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


@functools.cache
def _gsm8k(split: str) -> tuple[dict, ...]:
    path = GSM8K_DIR / f"{split}.jsonl"
    if path.is_file():
        return tuple(json.loads(line) for line in path.read_text().splitlines())
    try:
        from datasets import load_dataset

        rows = load_dataset("openai/gsm8k", "main", split=split)
    except Exception as e:
        pytest.skip(f"GSM8K is neither at {GSM8K_DIR} (set GSM8K_DIR) nor reachable on the hub "
                    f"({type(e).__name__})")
    return tuple({"question": r["question"], "answer": r["answer"]} for r in rows)


def gsm8k_rows(split: str, n: int | None = None) -> list[dict]:
    """The real GSM8K split ('train' or 'test'), the first n rows if n is given."""
    rows = list(_gsm8k(split))
    return rows[:n] if n else rows


def gsm8k_jsonl(split: str, directory: Path) -> Path:
    """A GSM8K jsonl file of the split: the local copy, else one written from the hub's rows."""
    local = GSM8K_DIR / f"{split}.jsonl"
    return local if local.is_file() else write_jsonl(directory / f"gsm8k_{split}.jsonl", gsm8k_rows(split))


def write_gsm8k_model(directory: Path, seed: int = 0, device="cpu", **config) -> Path:
    """A random Qwen3 with a tokenizer trained on GSM8K: a complete, offline simple_rl.py --model."""
    return write_model(directory, [r["question"] + "\n" + r["answer"] for r in gsm8k_rows("train", 2000)], seed, device, **config)


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
    texts = [r["question"] + "\n" + r["answer"] for r in gsm8k_rows("train", 2000)]
    directory.mkdir(parents=True, exist_ok=True)
    hf_tok = write_tokenizer(directory, texts, special_tokens=("<|im_start|>", "<|im_end|>"), eos_token="<|im_end|>")
    hf_tok.add_tokens(["<think>", "</think>"])  # plain added tokens: they stay in decoded text, as in Qwen3
    hf_tok.chat_template = QWEN3_CHAT_TEMPLATE
    hf_tok.save_pretrained(directory)
    vocab = -(-len(hf_tok) // 64) * 64
    config = qwen3_config(vocab=vocab, eos_token_id=hf_tok.convert_tokens_to_ids("<|endoftext|>"), **config)
    return write_checkpoint(directory, config, device=device)
