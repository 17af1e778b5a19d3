"""Trainer forward + backward speed and peak memory against a plain PyTorch reference, same run.

    python bench.py                      # Qwen3-1.7B shape, random weights, 8 sequences x 1024 tokens

The reference is Hugging Face transformers' Qwen3ForCausalLM (SDPA attention, bf16), the trainer is
simple_rl.Qwen3 with vLLM's batch-invariant kernels. Both compute the fp32 log-probability of every
next token from full-vocabulary logits and back-propagate their sum; printed: tokens/s, peak GiB,
and the trainer/reference ratios. Peak memory is what a step adds to the resident weights.
"""

import argparse
import json
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import simple_rl

QWEN3_1P7B = dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=6144, vocab_size=151936, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, rope_theta=1000000, tie_word_embeddings=True, model_type="qwen3")  # fmt: skip


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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--profile", action="store_true", help="also print the trainer step's top CUDA kernels")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.py needs a CUDA GPU")

    torch.manual_seed(0)
    config = Qwen3Config(**{**QWEN3_1P7B, "num_hidden_layers": args.layers}, attn_implementation="sdpa")
    reference = Qwen3ForCausalLM(config).to("cuda", torch.bfloat16)
    model_args = simple_rl.model_args_from_hf_config(config.to_dict() | {"model_type": "qwen3"})
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
        logprobs, _ = simple_rl.token_logprobs(trainer, batch)
        logprobs.sum().backward()
        trainer.zero_grad(set_to_none=True)

    n_tokens = args.seqs * args.seqlen
    results = {}
    for name, step in (("reference", reference_step), ("trainer", trainer_step)):
        seconds, peak = measure(step, args.iters)
        results[name] = {"tokens_per_s": n_tokens / seconds, "peak_gib": peak}
    results["speed_ratio"] = results["trainer"]["tokens_per_s"] / results["reference"]["tokens_per_s"]
    results["memory_ratio"] = results["trainer"]["peak_gib"] / results["reference"]["peak_gib"]

    print(f"Qwen3-1.7B shape ({args.layers} layers), {args.seqs} x {args.seqlen} tokens, forward + backward, "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    for name in ("reference", "trainer"):
        r = results[name]
        print(f"  {name:<10} {r['tokens_per_s']:>10,.0f} tokens/s   peak {r['peak_gib']:6.1f} GiB above weights")
    print(f"  trainer / reference: speed {results['speed_ratio']:.2f}x, peak memory {results['memory_ratio']:.2f}x")
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            trainer_step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
