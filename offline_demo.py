"""Watch bitwise-exact GRPO learn, offline, in minutes on one GPU: batch invariance on, off, and off
with sequence-level masked importance sampling.

    python offline_demo.py                  # build demo/, train the three runs, write demo/on_vs_off.png
    python offline_demo.py --plot-only      # redraw the figure from runs/demo_*
    python offline_demo.py --runs demo_on   # redo one run (each takes about 4 minutes); plot all there are

No pretrained weights can be fetched here, so the demo makes everything it needs: a small Qwen3
with random weights, a byte-level BPE tokenizer trained on the spot, and an arithmetic task in
GSM8K's format ("What is 23 + 45?" -> "23 + 45 = 68\\n#### 68"), scored by simple_rl.py's own GSM8K
reward. simple_rl.py then runs a short supervised warm start (--sft-steps: the model learns the
format and some sums, but samples at temperature 1 are still mostly wrong) followed by GRPO, which
sharpens what the warm start half-learned: the sampled reward rises within tens of steps. The same
command runs three times: with VLLM_BATCH_INVARIANT=1 (every sampled token's logprob asserted
bitwise equal), without it (--no-assert-bitwise: the mismatch is measured and logged), and without
it but corrected by sequence-level MIS (--correction mis). The TensorBoard runs become one PNG of
reward and vLLM-vs-trainer KL over steps.
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from simple_rl import INSTRUCTION

HERE = Path(__file__).resolve().parent


def qwen3_config(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256,
                 tie=True, max_positions=2048, eos_token_id=1, experts=0, experts_per_token=8,
                 moe_intermediate=768, norm_topk_prob=True) -> dict:  # fmt: skip
    """A Hugging Face Qwen3 config.json of any size (Qwen3-1.7B: 2048, 28, 16, 8, 128, 6144, 151936); with
    `experts`, a Qwen3-MoE's, every layer sparse (Qwen3-30B-A3B: 2048, 48, 32, 4, 128, 6144, 151936, untied,
    128 experts, 8 a token, 768 wide)."""
    moe = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": experts,
           "num_experts_per_tok": experts_per_token, "moe_intermediate_size": moe_intermediate,
           "norm_topk_prob": norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": [],
           "router_aux_loss_coef": 0.001, "output_router_logits": False} if experts else {}
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "intermediate_size": intermediate, "vocab_size": vocab, "tie_word_embeddings": tie,
        "max_position_embeddings": max_positions, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": layers, "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id, "torch_dtype": "bfloat16", "initializer_range": 0.02, "use_cache": True,
    } | moe  # fmt: skip


def random_hf_weights(config: dict, seed: int = 0, dtype=torch.bfloat16, device="cpu") -> dict:
    """Random Qwen3 weights under Hugging Face names, scaled like a trained model's: norm weights
    near 1, projections ~ 1/sqrt(fan_in), embeddings 3/sqrt(hidden) so that logits spread with a
    std near 3 whether or not the head is tied to them."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d, nh, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]

    def w(*shape, std=None):
        std = std if std is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, generator=g, device=device)).to(dtype)

    out = {"model.embed_tokens.weight": w(v, h, std=3 * h**-0.5), "model.norm.weight": norm(h)}
    if not config["tie_word_embeddings"]:
        out["lm_head.weight"] = w(v, h, std=3 * h**-0.5)
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({
            p + "self_attn.q_proj.weight": w(nh * d, h), p + "self_attn.k_proj.weight": w(nkv * d, h),
            p + "self_attn.v_proj.weight": w(nkv * d, h), p + "self_attn.o_proj.weight": w(h, nh * d),
            p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d),
        })  # fmt: skip
        if config.get("num_experts"):  # the router's logits spread like a trained one's (std ~1)
            e, i = config["num_experts"], config["moe_intermediate_size"]
            out[p + "mlp.gate.weight"] = w(e, h)
            for x in range(e):
                out.update({p + f"mlp.experts.{x}.gate_proj.weight": w(i, h),
                            p + f"mlp.experts.{x}.up_proj.weight": w(i, h),
                            p + f"mlp.experts.{x}.down_proj.weight": w(h, i)})
        else:
            out.update({p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                        p + "mlp.down_proj.weight": w(h, i)})
        # drawn after the MLP's, as before experts came: the demo's model and its README row stay the same
        out.update({p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h)})
    return out


def write_checkpoint(directory: Path, config: dict, seed: int = 0, device="cpu") -> Path:
    """config.json + model.safetensors of a random Qwen3: a checkpoint vLLM and the trainer load."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    weights = random_hf_weights(config, seed, device=device)
    save_file({k: t.contiguous().cpu() for k, t in weights.items()}, directory / "model.safetensors")
    return directory


def write_tokenizer(directory: Path, texts, vocab_size: int = 1024, special_tokens: tuple[str, ...] = (),
                    eos_token: str = "<|endoftext|>"):
    """A byte-level BPE tokenizer trained on `texts`, saved in Hugging Face form with '<|endoftext|>'
    (then `special_tokens`) as its first tokens and `eos_token` as end of sequence. Returns the
    transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", *special_tokens],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, pad_token="<|endoftext|>")
    hf_tok.save_pretrained(directory)
    return hf_tok


def write_model(directory: Path, texts, seed: int = 0, device="cpu", vocab_size: int = 1024, **config) -> Path:
    """A random Qwen3 with a tokenizer trained on `texts`: a complete offline `simple_rl.py --model`."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(directory, texts, vocab_size)
    vocab = -(-len(tok) // 64) * 64  # vLLM pads embeddings to multiples of 64: keep both sides equal
    return write_checkpoint(directory, qwen3_config(vocab=vocab, eos_token_id=tok.eos_token_id, **config), seed, device)


def arithmetic_rows(n: int, seed: int, max_operand: int) -> list[dict]:
    """GSM8K-format sums: {"question": "What is a + b?", "answer": "a + b = c\\n#### c"}."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(max_operand), rng.randrange(max_operand)
        rows.append({"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
    return rows


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build(out: Path, max_operand: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    train, test = arithmetic_rows(20000, 0, max_operand), arithmetic_rows(500, 1, max_operand)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "test.jsonl", test)
    # Trained on the prompts exactly as simple_rl.py --prompt-format plain writes them.
    texts = [f"Question: {r['question']}\n{INSTRUCTION}\nAnswer: {r['answer']}" for r in train]
    write_model(out / "model", texts, vocab_size=512, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64,
                intermediate=768, max_positions=512)  # fmt: skip


def scalars(run_dir: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir)).Reload()
    return [e.value for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []  # none: it failed


RUNS = {  # run name: (label, colour, what it adds to the demo's flags, VLLM_BATCH_INVARIANT)
    "demo_on": ("batch invariance ON", "tab:blue", [], "1"),
    "demo_off": ("batch invariance OFF", "tab:red", ["--no-assert-bitwise"], None),
    "demo_off_mis": ("OFF + sequence-level MIS", "tab:green",
                     ["--no-assert-bitwise", "--correction", "mis", "--correction-level", "sequence"], None),
}


def plot(run_dirs: dict[str, Path], png: Path) -> None:
    """Reward and vLLM-vs-trainer KL over steps of each run (named as in RUNS), in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (reward, kl) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in run_dirs.items():
        label, color = RUNS[name][:2]
        reward.plot(scalars(run, "reward/reward_mean"), label=label, color=color)
        kl.plot(scalars(run, "parity/vllm_kl"), label=label, color=color)
    reward.set(title="Mean reward (sampled, T=1)", xlabel="GRPO step", ylabel="reward")
    kl.set(title="k3 KL(vLLM sampler || trainer) per token", xlabel="GRPO step", ylabel="KL")
    kl.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    for ax in (reward, kl):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def summary(run_dir: Path) -> str:
    rewards, mismatched = scalars(run_dir, "reward/reward_mean"), scalars(run_dir, "parity/mismatched_tokens")
    if not rewards:
        return f"{run_dir.name}: no step logged (runs/{run_dir.name}/log.txt says why)"
    n = min(10, len(rewards))
    first, last = sum(rewards[:n]) / n, sum(rewards[-n:]) / n
    return (f"{run_dir.name}: {len(rewards)} steps, mean reward first {n} {first:.3f} -> last {n} {last:.3f} "
            f"({last / max(first, 1e-9):.2f}x, {last - first:+.3f}); mismatched tokens per step: "
            f"max {max(mismatched):.0f}, total {sum(mismatched):.0f}")  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("demo"), help="where the model, data and figure go")
    parser.add_argument("--max-operand", type=int, default=50, help="sums of two numbers below this")
    parser.add_argument("--plot-only", action="store_true", help="only redraw the figure from existing runs")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), metavar="RUN",
                        help=f"the runs to (re)do, of {', '.join(RUNS)}; the figure shows every run there is")
    parser.add_argument("extra", nargs="*", help="more simple_rl.py flags, after --")
    args = parser.parse_args()
    runs = {name: Path("runs") / name for name in RUNS}
    if not args.plot_only and not torch.cuda.is_available():
        sys.exit("error: offline_demo.py trains with vLLM on a GPU, and this machine has none (--plot-only redraws "
                 "the figure of existing runs)")
    if not args.plot_only:
        if not (args.out / "model" / "model.safetensors").exists():
            build(args.out, args.max_operand)
        flags = ["--model", str(args.out / "model"), "--dataset", str(args.out / "train.jsonl"),
                 "--eval-dataset", str(args.out / "test.jsonl"), "--prompt-format", "plain",
                 "--sft-steps", "110", "--sft-lr", "1e-3", "--sft-batch-size", "128",
                 "--steps", "300", "--prompts-per-step", "64", "--samples-per-prompt", "8",
                 "--max-new-tokens", "16", "--max-prompt-tokens", "64", "--lr", "1e-4", "--warmup-steps", "10",
                 "--eval-every", "25", "--eval-samples", "500", "--vllm-gpu-memory", "0.2",
                 "--max-tokens-per-microbatch", "16384",
                 "--parity-report-tokens", "0", *args.extra]  # fmt: skip
        for name in args.runs:
            for previous in (runs[name], Path("checkpoints") / name):  # the demo's own runs: redone
                shutil.rmtree(previous, ignore_errors=True)
            *_, extra, invariant = RUNS[name]
            env = {k: v for k, v in os.environ.items() if k != "VLLM_BATCH_INVARIANT"}
            env |= {"VLLM_BATCH_INVARIANT": invariant} if invariant else {}
            command = [sys.executable, str(HERE / "simple_rl.py"), *flags, "--run-name", name, *extra]
            if subprocess.run(command, env=env).returncode:
                sys.exit(f"error: the {name} run failed (its output is above)")
    for run in (run for run in runs.values() if run.exists()):
        print(summary(run))
    existing = {name: run for name, run in runs.items() if run.exists() and scalars(run, "reward/reward_mean")}
    if len(existing) > 1:
        plot(existing, args.out / "on_vs_off.png")
        print(f"figure: {args.out / 'on_vs_off.png'}")


if __name__ == "__main__":
    main()
