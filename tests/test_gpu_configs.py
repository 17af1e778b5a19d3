"""On the GPU: bitwise parity across Qwen3 configurations that vLLM 0.20 serves with FlashAttention 3:
head dims of 64, 128 and 256, GQA ratios from 1 (no grouping) to 8, tied and untied embeddings,
narrow and wide layers, 2 to 28 layers, and the real Qwen3-0.6B shape. Each configuration gets its
own engine and the parity test's batch: 512 samples of 64-256 new tokens after prompts of 20-400
tokens, recomputed by the trainer in shuffled packed batches. Where the bits cannot agree (head_dim 64
beyond 128 tokens), the test measures that they do not, and that simple_rl.py refuses the shape."""

import os
import pytest
import torch
from conftest import qwen3_config, start_engine, write_checkpoint
from test_gpu import count_mismatches, grpo_sample, packed_logprobs, sample, trainer_logprobs

import plumbing
import simple_rl

pytestmark = pytest.mark.gpu

GRID = {
    "head-dim-64": qwen3_config(hidden=512, layers=2, heads=8, kv_heads=4, head_dim=64, intermediate=1024,
                                vocab=4096),
    "head-dim-64-short": qwen3_config(hidden=512, layers=2, heads=8, kv_heads=4, head_dim=64, intermediate=1024,
                                      vocab=4096),
    "head-dim-256": qwen3_config(hidden=512, layers=2, heads=4, kv_heads=2, head_dim=256, intermediate=1024,
                                 vocab=4096),
    "no-grouping": qwen3_config(hidden=512, layers=2, heads=4, kv_heads=4, head_dim=128, intermediate=1024,
                                vocab=4096),
    "gqa-8-wide": qwen3_config(hidden=2048, layers=2, heads=16, kv_heads=2, head_dim=128, intermediate=8192,
                               vocab=4096),
    "untied-deep": qwen3_config(hidden=512, layers=12, heads=4, kv_heads=2, head_dim=128, intermediate=1536,
                                vocab=8192, tie=False),
    "qwen3-0.6b-shape": qwen3_config(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072,
                                     vocab=151936, max_positions=40960),
}

REFUSED = {"head-dim-64"}  # decode steps sum over other key tiles than a prefill (see check_bitwise_head_dim)
SHORT = {"prompt_lens": (20, 64), "new_tokens": (32, 64)}  # at most 128 tokens: one key tile


@pytest.mark.parametrize("name", GRID)
def test_parity_holds_for_every_configuration(name, tmp_path):
    assert (os.environ.get("VLLM_BATCH_INVARIANT") == "1"), "run the GPU tests with VLLM_BATCH_INVARIANT=1"
    config = GRID[name]
    ckpt = write_checkpoint(tmp_path / name, config, seed=3, device="cuda")
    engine = start_engine(ckpt, 0.1, max_model_len=1024, seed=0, sleep_mode=False, kv_cache_gib=2)
    model = simple_rl.load_qwen3(ckpt, "cuda")
    lengths = SHORT if name.endswith("-short") else {}
    prompts, completions, vllm_logprobs = sample(engine, config["vocab_size"], 512, seed=11, **lengths)
    order = torch.randperm(512, generator=torch.Generator().manual_seed(12)).tolist()
    ours = trainer_logprobs(model, prompts, completions, order, 16384)
    mismatched = count_mismatches(ours, vllm_logprobs)
    print(f"\n[{name}] {sum(map(len, completions))} sampled tokens, {mismatched} differ")
    if mismatched:  # where the bits part, for the refusal's reason
        i = next(i for i, (a, b) in enumerate(zip(ours, vllm_logprobs)) if count_mismatches([a], [b]))
        print(f"[{name}] first divergence: " + simple_rl.find_first_divergence(engine, model, prompts[i] + completions[i]))
    longest = max(len(p) + len(c) for p, c in zip(prompts, completions))
    if name in REFUSED:
        assert mismatched > 0, "the bits agree: the refusal is no longer needed"
        with pytest.raises(plumbing.UsageError, match="head_dim is 64; "):
            plumbing.check_bitwise_head_dim(model.args.head_dim, longest, ckpt)
    else:
        plumbing.check_bitwise_head_dim(model.args.head_dim, longest, ckpt)
        assert mismatched == 0
        # GRPO's layout: 32 prompts x 8 samples, each prompt prefilled once by vLLM and laid once by the trainer
        prompts, completions, vllm_logprobs = grpo_sample(engine, config["vocab_size"], 13, questions=32,
                                                          **(lengths or {"prompt_lens": (20, 400)}))
        mismatched = count_mismatches(packed_logprobs(model, prompts, completions, 16384), vllm_logprobs)
        print(f"[{name}] GRPO's layout: {sum(map(len, completions))} sampled tokens, {mismatched} differ")
        assert mismatched == 0

