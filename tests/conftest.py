"""Shared fixtures. Tests marked `gpu` need CUDA (and vLLM 0.20); without a GPU they are skipped."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import save_file  # noqa: E402

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


def qwen3_config(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256,
                 tie=True, max_positions=2048):  # fmt: skip
    """A Hugging Face Qwen3 config.json of any size (Qwen3-1.7B: 2048, 28, 16, 8, 128, 6144, 151936)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "tie_word_embeddings": tie,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
        "use_cache": True,
    }


def random_hf_weights(config: dict, seed: int = 0, dtype=torch.bfloat16, device="cpu") -> dict:
    """Random Qwen3 weights under Hugging Face names, scaled like a trained model's (unit norms
    near 1, projections ~ 1/sqrt(fan_in)), so activations and logits have realistic ranges."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d, nh, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]

    def w(*shape, std=None):
        std = std if std is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, generator=g, device=device)).to(dtype)

    # Embedding std 3/sqrt(h): tied or not, logits then spread like a trained model's (std ~3).
    out = {"model.embed_tokens.weight": w(v, h, std=3 * h**-0.5), "model.norm.weight": norm(h)}
    if not config["tie_word_embeddings"]:
        out["lm_head.weight"] = w(v, h, std=3 * h**-0.5)
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({
            p + "self_attn.q_proj.weight": w(nh * d, h), p + "self_attn.k_proj.weight": w(nkv * d, h),
            p + "self_attn.v_proj.weight": w(nkv * d, h), p + "self_attn.o_proj.weight": w(h, nh * d),
            p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d),
            p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
            p + "mlp.down_proj.weight": w(h, i),
            p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
        })  # fmt: skip
    return out


def write_checkpoint(directory: Path, config: dict, seed: int = 0, device="cpu") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    weights = random_hf_weights(config, seed, device=device)
    save_file({k: t.contiguous().cpu() for k, t in weights.items()}, directory / "model.safetensors")
    return directory


@pytest.fixture
def tiny_checkpoint(tmp_path):
    return write_checkpoint(tmp_path / "tiny", qwen3_config())


def write_tokenizer(directory: Path, texts, vocab_size: int = 1024):
    """A byte-level BPE tokenizer trained on the spot (no hub here), saved in Hugging Face form with
    '<|endoftext|>' as end of sequence. Returns the transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    hf_tok.save_pretrained(directory)
    return hf_tok


def gsm8k_rows(split: str, n: int | None = None) -> list[dict]:
    with open(GSM8K_DIR / f"{split}.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return rows[:n] if n else rows


def write_gsm8k_model(directory: Path, seed: int = 0, device="cpu", **config_overrides) -> Path:
    """A random Qwen3 with a GSM8K-trained tokenizer: a complete, offline simple_rl.py --model."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = gsm8k_rows("train", 2000)
    tok = write_tokenizer(directory, [r["question"] + "\n" + r["answer"] for r in rows])
    vocab = -(-len(tok) // 64) * 64  # vLLM pads embeddings to multiples of 64: keep them equal
    config = qwen3_config(vocab=vocab, **config_overrides)
    config["eos_token_id"] = config["bos_token_id"] = tok.eos_token_id
    return write_checkpoint(directory, config, seed=seed, device=device)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
