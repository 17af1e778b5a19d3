"""Bitwise-exact on-policy GRPO: Qwen3 on GSM8K, rollouts from vLLM, training on a TorchTitan-style
Qwen3 that runs vLLM's own kernels.

    VLLM_BATCH_INVARIANT=1 python simple_rl.py                     # Qwen3-1.7B and GSM8K from the hub
    VLLM_BATCH_INVARIANT=1 python simple_rl.py --model DIR --dataset train.jsonl --eval-dataset test.jsonl
    python simple_rl.py --no-assert-bitwise                         # batch invariance off: mismatch reported
    tensorboard --logdir runs

The guarantee, checked every step on every sampled token and asserted unless --no-assert-bitwise:
the fp32 logprob the trainer computes for a sampled token equals, bit for bit, the logprob vLLM
returned when it sampled that token, whatever the batch either side ran it in. So the policy that
generated the data is exactly the policy being trained (the importance ratio is exactly 1), and
k3 KL between them is exactly 0. It holds with VLLM_BATCH_INVARIANT=1 on vLLM 0.20.0 (one GPU,
eager, FlashAttention 3), whose non-invariant fused add+RMSNorm this script replaces in-process.

How this GRPO departs from the paper (Shao et al., 2024):
1. One optimizer step per batch of rollouts: strictly on-policy. The PPO-clip surrogate is kept,
   so the ratio and clip statistics measure the only source of off-policyness left: numerical
   mismatch between sampler and trainer (zero with batch invariance on).
2. The loss is averaged over all completion tokens of the step (token-level, as in DAPO), not per
   sequence and then per group; long and short completions weigh the same per token.
3. KL to the frozen reference uses the k3 estimator, added to the loss (coefficient 0 by default,
   which skips the reference model entirely); an optional entropy bonus.
4. Advantages are group-normalised, (r - mean) / (std + 1e-4) with the unbiased std of the group;
   --no-std-normalize keeps only r - mean (as in Dr. GRPO).
5. An optional supervised warm start (--sft-steps) on the train set's reference answers.
"""

import copy
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

from batch_invariant_backward import EXACT, Kernels

# =============================================================================================
# Args
# =============================================================================================


@dataclass
class Args:
    model: str = "Qwen/Qwen3-1.7B"
    """Qwen3 checkpoint: a Hugging Face hub id, or a local directory (config.json + safetensors + tokenizer)"""
    dataset: str | None = None
    """local GSM8K-format jsonl (fields question, answer) to train on; default: openai/gsm8k 'main' train split"""
    eval_dataset: str | None = None
    """local GSM8K-format jsonl to evaluate on; default: openai/gsm8k 'main' test split (needed offline)"""
    prompt_format: Literal["auto", "chat", "plain"] = "auto"
    """'chat': the tokenizer's chat template; 'plain': 'Question: ...\\nAnswer:'; 'auto': chat if it has one"""
    thinking: bool = False
    """let Qwen3's chat template open a <think> block (long completions); off by default"""
    run_name: str | None = None
    """TensorBoard run under runs/<run_name> and checkpoints under <output_dir>/<run_name>; default: a timestamp"""
    output_dir: str = "checkpoints"
    """where Hugging Face checkpoints are written"""
    seed: int = 0
    """seed of the data order, the sampling and the trainer"""

    steps: int = 200
    """optimizer steps (one batch of rollouts each)"""
    prompts_per_step: int = 32
    """GSM8K questions per step"""
    samples_per_prompt: int = 8
    """G: completions sampled per question, the group advantages are normalised over"""
    max_new_tokens: int = 512
    """completion length limit"""
    max_prompt_tokens: int = 512
    """longer prompts are skipped (and counted at start), never cut"""
    temperature: float = 1.0
    """sampling temperature (logprobs are vLLM's raw ones, before temperature; keep 1.0 for exact ratios)"""

    lr: float = 1e-6
    """peak AdamW learning rate"""
    warmup_steps: int = 10
    """linear warm-up steps, then cosine decay"""
    min_lr_ratio: float = 0.1
    """the cosine decays to lr * min_lr_ratio"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold (global L2 norm)"""
    clip_eps: float = 0.2
    """PPO clip range of the token ratio"""
    kl_coef: float = 0.0
    """k3 KL-to-reference coefficient; 0 skips the reference model (no memory, no forward)"""
    entropy_coef: float = 0.0
    """entropy bonus coefficient"""
    std_normalize: bool = True
    """divide group advantages by the group std"""
    max_tokens_per_microbatch: int = 16384
    """trainer micro-batch size in packed tokens (gradients are accumulated)"""
    sft_steps: int = 0
    """supervised warm start before GRPO: steps of teacher forcing on the train set's reference answers"""
    sft_lr: float = 1e-4
    """constant AdamW learning rate of the warm start"""
    sft_batch_size: int = 64
    """questions per warm-start step"""

    assert_bitwise: bool = True
    """abort at the first sampled token whose trainer logprob differs from vLLM's"""
    parity_report_tokens: int = 4
    """first tokens of sample 0 printed every step with both logprobs; 0 prints only the summary"""
    vllm_gpu_memory: float = 0.3
    """fraction of GPU memory vLLM may take (weights + KV cache); the trainer uses the rest"""
    eval_every: int = 20
    """greedy GSM8K accuracy before training, every N steps and at the end; 0 disables"""
    eval_samples: int = 256
    """test questions per evaluation"""
    save_every: int = 0
    """Hugging Face checkpoint every N steps; one is always written at the end"""


def batch_invariant_enabled() -> bool:
    """vLLM reads VLLM_BATCH_INVARIANT at import: it must be in the environment before the run."""
    return os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1"


def validate(args: Args) -> None:
    """Bad flag values and combinations fail here, before anything is loaded or written."""
    checks = [
        (args.steps >= 1, "--steps must be at least 1"),
        (args.prompts_per_step >= 1, "--prompts-per-step must be at least 1"),
        (args.samples_per_prompt >= 2, "--samples-per-prompt must be at least 2: GRPO normalises rewards within each group"),
        (args.max_new_tokens >= 1, "--max-new-tokens must be at least 1"),
        (args.max_prompt_tokens >= 1, "--max-prompt-tokens must be at least 1"),
        (args.temperature > 0, "--temperature must be > 0 (evaluation is greedy by itself)"),
        (args.lr > 0, "--lr must be > 0"),
        (0 <= args.warmup_steps <= args.steps, "--warmup-steps must be between 0 and --steps"),
        (0 <= args.min_lr_ratio <= 1, "--min-lr-ratio must be between 0 and 1"),
        (args.weight_decay >= 0, "--weight-decay must be >= 0"),
        (args.max_grad_norm > 0, "--max-grad-norm must be > 0"),
        (args.clip_eps > 0, "--clip-eps must be > 0"),
        (args.kl_coef >= 0, "--kl-coef must be >= 0"),
        (args.entropy_coef >= 0, "--entropy-coef must be >= 0"),
        (args.max_tokens_per_microbatch >= args.max_prompt_tokens + args.max_new_tokens,
         "--max-tokens-per-microbatch must hold one whole sequence (>= --max-prompt-tokens + --max-new-tokens)"),
        (args.sft_steps >= 0, "--sft-steps must be >= 0"),
        (args.sft_lr > 0, "--sft-lr must be > 0"),
        (args.sft_batch_size >= 1, "--sft-batch-size must be at least 1"),
        (args.parity_report_tokens >= 0, "--parity-report-tokens must be >= 0"),
        (0 < args.vllm_gpu_memory < 1, "--vllm-gpu-memory must be a fraction between 0 and 1"),
        (args.eval_every >= 0, "--eval-every must be >= 0"),
        (args.eval_samples >= 1, "--eval-samples must be at least 1"),
        (args.save_every >= 0, "--save-every must be >= 0"),
        (not (args.dataset and args.eval_every and not args.eval_dataset),
         "--dataset is local: pass --eval-dataset (a local test jsonl) too, or --eval-every 0"),
        (not args.assert_bitwise or batch_invariant_enabled(),
         "VLLM_BATCH_INVARIANT=1 is not set, so vLLM's logprobs cannot equal the trainer's: set it, "
         "or pass --no-assert-bitwise to run anyway and report the mismatch"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


# =============================================================================================
# Determinism setup
# =============================================================================================


def seed_everything(seed: int) -> None:
    # Sampling is seeded per request (see `rollout_seeds`) and the trainer has no dropout, so
    # this fixes the only other randomness: Python's data order and torch's default generators.
    random.seed(seed)
    torch.manual_seed(seed)


# =============================================================================================
# Data and reward
# =============================================================================================

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

ANSWER_AFTER_HASHES = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
ANSWER_IN_BOX = re.compile(r"\\boxed\{\s*\$?\s*(-?[\d,]*\.?\d+)\s*\}")
ANY_NUMBER = re.compile(r"-?[\d,]*\.?\d+")
"""GSM8K's reference format is '#### 72'. A completion's answer is the first '#### N', else the
first '\\boxed{N}', else its last number (the usual fallback). Numbers are then compared as
decimals, so '1,000', '1000.0' and '$1000' are all 1000."""


def extract_answer(text: str) -> str | None:
    for pattern in (ANSWER_AFTER_HASHES, ANSWER_IN_BOX):
        match = pattern.search(text)
        if match:
            return match.group(1)
    numbers = ANY_NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: str | None) -> Decimal | None:
    if text is None:
        return None
    try:
        return Decimal(text.replace(",", "").rstrip("."))
    except InvalidOperation:
        return None


def gsm8k_reward(completion: str, reference_answer: str) -> float:
    """1.0 when the completion's final number equals the reference's '#### N', else 0.0."""
    predicted, expected = parse_number(extract_answer(completion)), parse_number(extract_answer(reference_answer))
    return float(predicted is not None and expected is not None and predicted == expected)


def load_gsm8k(path: str | None, split: str) -> list[dict]:
    """[{question, answer}]: a local jsonl, or openai/gsm8k 'main' from `datasets`."""
    if path is None:
        from datasets import load_dataset

        try:
            rows = load_dataset("openai/gsm8k", "main", split=split)
        except Exception as e:
            raise ValueError(f"cannot load openai/gsm8k from the hub ({type(e).__name__}): pass --dataset/--eval-dataset with local jsonl files") from e
        return [{"question": r["question"], "answer": r["answer"]} for r in rows]
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file (expected a GSM8K-format jsonl)")
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path} line {n}: not valid JSON") from None
            if not (isinstance(row, dict) and isinstance(row.get("question"), str) and isinstance(row.get("answer"), str)):
                raise ValueError(f"{path} line {n}: need a JSON object with string fields 'question' and 'answer'")
            if parse_number(extract_answer(row["answer"])) is None:
                raise ValueError(f"{path} line {n}: the answer has no final number ('#### N')")
            rows.append({"question": row["question"], "answer": row["answer"]})
    if not rows:
        raise ValueError(f"{path}: no examples")
    return rows


def encode_prompt(tokenizer, question: str, use_chat: bool, thinking: bool) -> list[int]:
    content = f"{question}\n{INSTRUCTION}"
    if use_chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False,
                                             enable_thinking=thinking)  # fmt: skip
    return tokenizer.encode(f"Question: {content}\nAnswer:")


def encode_dataset(rows, tokenizer, args: Args, name: str) -> list[dict]:
    """Tokenise every question once; report (never cut) prompts over --max-prompt-tokens."""
    use_chat = args.prompt_format == "chat" or (args.prompt_format == "auto" and tokenizer.chat_template is not None)
    if args.prompt_format == "chat" and tokenizer.chat_template is None:
        raise ValueError("--prompt-format chat: this tokenizer has no chat template; use plain or auto")
    encoded = [dict(r, prompt_ids=encode_prompt(tokenizer, r["question"], use_chat, args.thinking)) for r in rows]
    kept = [r for r in encoded if len(r["prompt_ids"]) <= args.max_prompt_tokens]
    if len(kept) < len(encoded):
        print(f"{name}: {len(encoded) - len(kept)} of {len(encoded)} prompts exceed --max-prompt-tokens "
              f"{args.max_prompt_tokens} and are skipped")  # fmt: skip
    if not kept:
        raise ValueError(f"{name}: every prompt exceeds --max-prompt-tokens {args.max_prompt_tokens}")
    return kept


# =============================================================================================
# Model and weight conversion
# =============================================================================================


def resolve_model_dir(model: str) -> Path:
    """A local checkpoint directory as is, else a Hugging Face hub id downloaded to the cache."""
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {model}: the directory has no config.json (need a Hugging Face Qwen3 checkpoint)")
        return path
    if path.exists() or model.startswith((".", "/")) or model.count("/") != 1:
        raise ValueError(f"--model {model}: not a checkpoint directory, nor a hub id like Qwen/Qwen3-1.7B")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as e:
        raise ValueError(f"--model {model}: cannot download it from the hub ({type(e).__name__}); pass a local checkpoint directory") from e


def model_args_from_hf_config(config: dict) -> Qwen3ModelArgs:
    """torchtitan's Qwen3 arguments from a Hugging Face `config.json`; refuses what vLLM's and
    this trainer's Qwen3 would compute differently (other activations, biases, rope scaling)."""
    if config.get("model_type") != "qwen3":
        raise ValueError(f"config.json: model_type is {config.get('model_type')!r}, this trainer needs 'qwen3'")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    unsupported = {
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(config.get("attention_bias", False)),
        "rope scaling": rope.get("rope_type", rope.get("type", "default")) != "default",
        "sliding window": bool(config.get("use_sliding_window", False)),
    }
    for name, bad in unsupported.items():
        if bad:
            raise ValueError(f"config.json: {name} is not supported by this trainer (plain Qwen3 only)")
    return Qwen3ModelArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config["num_key_value_heads"],
        vocab_size=config["vocab_size"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        hidden_dim=config["intermediate_size"],
        norm_eps=config["rms_norm_eps"],
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 1_000_000)),
        max_seq_len=config["max_position_embeddings"],
        enable_weight_tying=config.get("tie_word_embeddings", False),
    )


def rope_cos_sin_cache(args: Qwen3ModelArgs, dtype: torch.dtype) -> torch.Tensor:
    """(max_seq_len, head_dim) table [cos | sin] for neox rotary, built as vLLM builds it: fp32 on
    the current default device, then rounded to the model dtype (the kernel reads this table)."""
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float) / args.head_dim))
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)


class Attention(nn.Module):
    def __init__(self, args: Qwen3ModelArgs):
        super().__init__()
        # One merged [q; k; v] projection, as vLLM's QKVParallelLinear serves it.
        self.wqkv = nn.Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)


class FeedForward(nn.Module):
    def __init__(self, args: Qwen3ModelArgs):
        super().__init__()
        self.w13 = nn.Linear(args.dim, 2 * args.hidden_dim, bias=False)  # merged [gate; up]
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)


class TransformerBlock(nn.Module):
    def __init__(self, args: Qwen3ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)


class Qwen3(nn.Module):
    """Qwen3 with torchtitan's parameter names, in the layout vLLM serves (merged q/k/v and
    gate/up, `output` absent when tied to `tok_embeddings`). The modules only hold parameters:
    `forward` is written out below so that it reads as the sequence of kernels vLLM 0.20 runs
    for `Qwen3ForCausalLM` in eager batch-invariant mode, in the same order and dtypes."""

    def __init__(self, args: Qwen3ModelArgs, kernels: Kernels = EXACT, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.args, self.kernels = args, kernels
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = None if args.enable_weight_tying else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.to(dtype)
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(args, dtype), persistent=False)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(self, tokens, positions, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        """Packed sequences (T,) -> final hidden states (T, dim)."""
        k, eps = self.kernels, self.args.norm_eps
        h = F.embedding(tokens, self.tok_embeddings.weight)
        residual = None
        for layer in self.layers:
            # vLLM normalises layer 0's input alone; every later norm first adds the residual
            # (a bf16 add, then the norm: see `make_fused_add_rms_norm_batch_invariant`).
            residual = h if residual is None else h + residual
            h = self.attention(layer.attention, k.rms_norm(residual, layer.attention_norm.weight, eps),
                               positions, cu_seqlens, max_seqlen)  # fmt: skip
            residual = h + residual
            x = k.rms_norm(residual, layer.ffn_norm.weight, eps)
            h = k.linear(k.silu_and_mul(k.linear(x, layer.feed_forward.w13.weight)), layer.feed_forward.w2.weight)
        return k.rms_norm(h + residual, self.norm.weight, eps)

    def attention(self, attn: Attention, x, positions, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        k, a = self.kernels, self.args
        T, H, Hk, D = x.shape[0], a.n_heads, a.n_kv_heads, a.head_dim
        q, key, v = k.linear(x, attn.wqkv.weight).split([H * D, Hk * D, Hk * D], dim=-1)
        q = k.rms_norm(q.reshape(T, H, D), attn.q_norm.weight, a.norm_eps)  # per-head norm (T, H, D)
        key = k.rms_norm(key.reshape(T, Hk, D), attn.k_norm.weight, a.norm_eps)  # (T, Hk, D)
        q, key = k.rotary(q, key, positions, self.cos_sin_cache)
        out = k.attention(q, key, v.reshape(T, Hk, D), cu_seqlens, max_seqlen, D**-0.5)  # (T, H, D)
        return k.linear(out.reshape(T, H * D), attn.wo.weight)


def from_hf_state_dict(hf_state: dict, args: Qwen3ModelArgs) -> dict:
    """Hugging Face names -> torchtitan names (its adapter) -> merged q/k/v and gate/up."""
    state = Qwen3StateDictAdapter(args, None).from_hf(dict(hf_state))
    if args.enable_weight_tying:
        state.pop("output.weight")  # the adapter aliases it to the embedding; we keep one tensor
    for i in range(args.n_layers):
        p = f"layers.{i}."
        qkv = [state.pop(f"{p}attention.{w}.weight") for w in ("wq", "wk", "wv")]
        state[f"{p}attention.wqkv.weight"] = torch.cat(qkv)
        gate_up = [state.pop(f"{p}feed_forward.{w}.weight") for w in ("w1", "w3")]
        state[f"{p}feed_forward.w13.weight"] = torch.cat(gate_up)
    return state


def hf_state_dict(model: Qwen3) -> dict:
    """The trainer's weights under Hugging Face names, as views (no copy): what vLLM's
    `load_weights` and `save_file` take."""
    a = model.args
    state = {name: p.detach() for name, p in model.named_parameters()}
    for i in range(a.n_layers):
        p = f"layers.{i}."
        q, k, v = state.pop(f"{p}attention.wqkv.weight").split(
            [a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim]
        )
        state.update({f"{p}attention.wq.weight": q, f"{p}attention.wk.weight": k, f"{p}attention.wv.weight": v})
        w1, w3 = state.pop(f"{p}feed_forward.w13.weight").chunk(2)
        state.update({f"{p}feed_forward.w1.weight": w1, f"{p}feed_forward.w3.weight": w3})
    return Qwen3StateDictAdapter(a, None).to_hf(state)


def load_qwen3(model_dir: Path, device, kernels: Kernels = EXACT, dtype=torch.bfloat16) -> Qwen3:
    """A Hugging Face Qwen3 checkpoint directory -> trainer model on `device`."""
    args = model_args_from_hf_config(json.loads((model_dir / "config.json").read_text()))
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"--model {model_dir}: no *.safetensors weights in the directory")
    hf_state = {}
    for f in files:
        hf_state.update(load_file(f, device=str(device)))
    # Built under the device so the rotary table is computed where vLLM computes it.
    with torch.device(device):
        model = Qwen3(args, kernels, dtype)
    try:
        model.load_state_dict(from_hf_state_dict(hf_state, args), strict=True)
    except (KeyError, RuntimeError) as e:
        raise ValueError(f"--model {model_dir}: weights do not match config.json ({str(e).splitlines()[0]})") from e
    return model


def save_hf_checkpoint(model: Qwen3, source_dir: Path, out_dir: Path) -> None:
    """Write config, safetensors and tokenizer files that transformers and vLLM load as they are.
    Written to a temporary directory first, so a crash never leaves a half-written checkpoint."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    config = json.loads((source_dir / "config.json").read_text())
    config["torch_dtype"] = str(model.tok_embeddings.weight.dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    weights = {k: v.contiguous().cpu() for k, v in hf_state_dict(model).items()}
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    for f in source_dir.iterdir():
        if f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "generation_config")):
            shutil.copy(f, tmp / f.name)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


# =============================================================================================
# vLLM engine
# =============================================================================================


def make_fused_add_rms_norm_batch_invariant() -> None:
    """vLLM 0.20's fused add+RMSNorm CUDA kernel chooses its block size from the number of tokens
    in the step (under 256 or not), so its reduction order, and its bits, change with the batch:
    it is not batch-invariant (fixed upstream after 0.20). Replace it in this process (the engine
    runs here: V1 multiprocessing is off) by a bf16 add and vLLM's Triton `rms_norm_batch_invariant`,
    the pre-0.20 behaviour and exactly what the trainer runs."""
    from vllm.model_executor.layers import layernorm
    from vllm.model_executor.layers.batch_invariant import rms_norm_batch_invariant

    def fused_add_rms_norm(x, residual, weight, variance_epsilon):
        residual = x + residual
        return rms_norm_batch_invariant(residual, weight, variance_epsilon), residual

    layernorm.fused_add_rms_norm = fused_add_rms_norm


def weights_checksum(params) -> int:
    """Order-independent exact checksum of bf16 weights: the sum of their bit patterns. The
    trainer's and vLLM's layouts hold the same elements, so the sums agree iff nothing is stale."""
    return int(torch.stack([p.detach().view(torch.int16).sum(dtype=torch.int64) for p in params]).sum())


class VLLMEngine:
    """vLLM in this process, on this GPU, serving the checkpoint the trainer loaded: eager (compiled
    kernels give other bits than the ops the trainer calls), FlashAttention 3, no prefix caching
    (weights change every step), prompts in and completions out as token ids."""

    def __init__(self, model_dir: Path, gpu_memory_utilization: float, max_model_len: int, seed: int,
                 max_num_seqs: int = 256):  # fmt: skip
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine must run in this process
        import vllm

        if vllm.__version__ != "0.20.0":
            raise ValueError(f"vLLM {vllm.__version__} is installed; this script mirrors vLLM 0.20.0's kernels: pip install vllm==0.20.0")
        if batch_invariant_enabled():
            make_fused_add_rms_norm_batch_invariant()
        self.llm = vllm.LLM(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            seed=seed,
            enforce_eager=True,
            enable_prefix_caching=False,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            attention_config={"backend": "FLASH_ATTN", "flash_attn_version": 3},
        )

    def generate(self, prompts: list[list[int]], max_tokens: list[int], temperature: float, seeds: list[int],
                 stop_token_ids=(), ignore_eos: bool = False):  # fmt: skip
        """One completion per prompt. Returns the completion token ids and vLLM's logprob of each
        sampled token (raw: before temperature) as fp32 tensors. Temperature 0 is greedy."""
        from vllm import SamplingParams, TokensPrompt

        params = [
            SamplingParams(temperature=temperature, max_tokens=n, seed=s, logprobs=0, detokenize=False,
                           stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)  # fmt: skip
            for n, s in zip(max_tokens, seeds)
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        completions, logprobs = [], []
        for out in outputs:
            sample = out.outputs[0]
            completions.append(list(sample.token_ids))
            # A Python float holds an fp32 value exactly: this round trip is lossless.
            logprobs.append(torch.tensor([lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs)],
                                         dtype=torch.float32))  # fmt: skip
        return completions, logprobs

    def push_weights(self, model: Qwen3) -> None:
        """Copy the trainer's bf16 weights into the served model in-process, no disk: vLLM's own
        `load_weights` copies each HF-named tensor into its merged q/k/v and gate/up slots."""
        weights = hf_state_dict(model)
        self.llm.apply_model(lambda served: served.load_weights(iter(weights.items())))

    def weights_checksum(self) -> int:
        return self.llm.apply_model(lambda served: weights_checksum(served.parameters()))[0]

    def rotary_table(self) -> torch.Tensor:
        return self.llm.apply_model(lambda served: served.model.layers[0].self_attn.rotary_emb.cos_sin_cache.cpu())[0]


# =============================================================================================
# Logprobs and loss
# =============================================================================================


@dataclass
class PackedBatch:
    """Sequences (prompt + completion) back to back, no padding, and which logits to read."""

    tokens: torch.Tensor  # (T,) token ids
    positions: torch.Tensor  # (T,) position of each token in its own sequence
    cu_seqlens: torch.Tensor  # (N + 1,) int32 sequence boundaries, as flash attention takes them
    max_seqlen: int
    target_rows: torch.Tensor  # (C,) rows whose logits predict a completion token
    targets: torch.Tensor  # (C,) those completion tokens
    completion_lens: list[int]


def pack_sequences(prompts: list[list[int]], completions: list[list[int]], device) -> PackedBatch:
    tokens, positions, target_rows, seqlens = [], [], [], [0]
    for prompt, completion in zip(prompts, completions):
        start = len(tokens)
        tokens += prompt + completion
        positions += range(len(prompt) + len(completion))
        # The logit row of position t predicts token t + 1: completion token j is read at
        # row len(prompt) + j - 1 of its sequence.
        target_rows += range(start + len(prompt) - 1, start + len(prompt) + len(completion) - 1)
        seqlens.append(len(prompt) + len(completion))

    def as_tensor(x, dtype=torch.long):
        return torch.tensor(x, dtype=dtype, device=device)

    return PackedBatch(
        tokens=as_tensor(tokens),
        positions=as_tensor(positions),
        cu_seqlens=as_tensor(seqlens, torch.int32).cumsum(0, dtype=torch.int32),
        max_seqlen=max(seqlens),
        target_rows=as_tensor(target_rows),
        targets=as_tensor([t for c in completions for t in c]),
        completion_lens=[len(c) for c in completions],
    )


def token_logprobs(model: Qwen3, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logprob (C,) and entropy (C,) of every completion token, computed as vLLM's sampler
    does: lm_head on the rows that predict them (bf16 logits), log_softmax of the fp32 logits."""
    hidden = model(batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen)
    logits = model.kernels.linear(hidden[batch.target_rows], model.output_weight)  # (C, V)
    return model.kernels.token_logprobs(logits, batch.targets)



def micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Consecutive sample indices grouped so each group's total length fits `token_budget`."""
    groups, current, size = [], [], 0
    for i, n in enumerate(lengths):
        if current and size + n > token_budget:
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    return groups + [current] if current else groups


def group_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool) -> torch.Tensor:
    """rewards (P * G,) in groups of G consecutive samples -> advantages (P * G,)."""
    groups = rewards.view(-1, group_size)  # (P, G)
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if std_normalize:
        advantages = advantages / (groups.std(dim=1, keepdim=True) + 1e-4)
    return advantages.view(-1)


def ppo_clip_loss(logprobs, rollout_logprobs, advantages, clip_eps: float):
    """Per-token PPO-clip surrogate (to minimise), the ratio and where the clip is active; all (C,)."""
    ratio = torch.exp(logprobs - rollout_logprobs)
    unclipped, clipped = ratio * advantages, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages
    return -torch.minimum(unclipped, clipped), ratio, clipped < unclipped


def k3_kl(logprobs, other_logprobs) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || other) from the policy's own samples:
    exp(d) - d - 1 with d = other - policy; >= 0, and 0 exactly where the logprobs are equal."""
    d = other_logprobs - logprobs
    return torch.exp(d) - d - 1


def bf16_hex(x: float) -> str:
    return f"0x{int(torch.tensor(x).to(torch.bfloat16).view(torch.int16)) & 0xFFFF:04x}"


def parity_report(vllm_logprobs: list[torch.Tensor], trainer_logprobs: list[torch.Tensor], tokens: list[list[int]],
                  show: int) -> tuple[dict, str, str | None]:  # fmt: skip
    """Compare every sampled token's logprob, exactly (fp32 bit patterns). Returns the metrics, a
    printable report and, on a mismatch, a message naming the first mismatching sample and token."""
    v, t = torch.cat(vllm_logprobs), torch.cat(trainer_logprobs)
    differ = v.view(torch.int32) != t.view(torch.int32)
    mismatched = int(differ.sum())
    metrics = {
        "mismatched_tokens": mismatched,
        "max_abs_logprob_diff": float((v - t).abs().max()),
        "mean_abs_logprob_diff": float((v - t).abs().mean()),
        "vllm_kl": float(k3_kl(v, t).mean()),  # KL(sampler || trainer), from the sampler's tokens
    }
    lines = [f"  {'token':>8} {'vllm logprob':>16} {'trainer logprob':>16} {'vllm bf16':>10} {'trainer bf16':>12} {'diff':>10}"]
    for tok, a, b in list(zip(tokens[0], vllm_logprobs[0].tolist(), trainer_logprobs[0].tolist()))[:show]:
        lines.append(f"  {tok:>8} {a:>16.9f} {b:>16.9f} {bf16_hex(a):>10} {bf16_hex(b):>12} {b - a:>10.3g}")
    lines.append(f"  Bitwise identical: {mismatched == 0}, different tokens {mismatched} / {len(v)}")
    first = None
    if mismatched:
        flat = int(differ.nonzero()[0])
        lens = torch.tensor([len(x) for x in vllm_logprobs]).cumsum(0)
        sample = int((lens <= flat).sum())
        token = flat - (int(lens[sample - 1]) if sample else 0)
        first = (f"sample {sample} token {token} (id {tokens[sample][token]}): vLLM logprob {float(v[flat])!r} "
                 f"but trainer {float(t[flat])!r}; {mismatched} of {len(v)} sampled tokens differ")  # fmt: skip
    return metrics, "\n".join(lines if show else lines[-1:]), first


# =============================================================================================
# Train step
# =============================================================================================


def lr_at(step: int, args: Args) -> float:
    """Linear warm-up to --lr over --warmup-steps, then cosine decay to lr * --min-lr-ratio."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def layer_of(name: str) -> str:
    """Parameter name -> the layer its weight-delta statistics are grouped under."""
    if name.startswith("layers."):
        return f"layer_{int(name.split('.')[1]):02d}"
    return {"tok_embeddings": "embeddings", "norm": "final_norm", "output": "lm_head"}[name.split(".")[0]]


class MasterWeights:
    """AdamW on fp32 master copies of the model's bf16 parameters. After each step the masters'
    bf16 rounding is written into the model: that bf16 tensor is what both the trainer's forward
    and vLLM run (the push copies it as is)."""

    def __init__(self, model: Qwen3, lr: float, weight_decay: float):
        self.named = list(model.named_parameters())
        self.masters = [p.detach().float().clone() for _, p in self.named]
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay)

    def accumulate_grads(self) -> None:
        """Move the bf16 gradients of a micro-batch into fp32 sums, so accumulation loses nothing."""
        for master, (_, p) in zip(self.masters, self.named):
            if p.grad is not None:
                master.grad = p.grad.float() if master.grad is None else master.grad.add_(p.grad)
                p.grad = None

    @torch.no_grad()
    def step(self, lr: float, max_grad_norm: float) -> tuple[float, dict]:
        """Clip, step, write back. Returns the pre-clip gradient norm and, per layer, the L2 norm
        of the bf16 weight change and that norm relative to the layer's weights."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.masters, max_grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        change, size = {}, {}
        for master, (name, p) in zip(self.masters, self.named):
            new = master.to(p.dtype)
            layer = layer_of(name)
            change[layer] = change.get(layer, 0) + (new.float() - p.float()).pow(2).sum()
            size[layer] = size.get(layer, 0) + p.float().pow(2).sum()
            p.copy_(new)
        deltas = {layer: (float(change[layer].sqrt()), float(change[layer].sqrt() / size[layer].sqrt())) for layer in change}
        return float(grad_norm), deltas


@dataclass
class Rollouts:
    """G samples of each of P prompts, sample j of prompt i at index i * G + j."""

    prompts: list[list[int]]
    completions: list[list[int]]
    vllm_logprobs: list[torch.Tensor]  # (len(completion),) fp32 each
    rewards: torch.Tensor  # (P * G,)
    advantages: torch.Tensor  # (P * G,)


@torch.no_grad()
def reference_logprobs(ref_model: Qwen3, rollouts: Rollouts, token_budget: int) -> list[torch.Tensor]:
    """The frozen reference policy's logprob of every sampled token (for the k3 KL term)."""
    out = []
    lengths = [len(p) + len(c) for p, c in zip(rollouts.prompts, rollouts.completions)]
    for idx in micro_batches(lengths, token_budget):
        batch = pack_sequences([rollouts.prompts[i] for i in idx], [rollouts.completions[i] for i in idx],
                               ref_model.tok_embeddings.weight.device)  # fmt: skip
        out += token_logprobs(ref_model, batch)[0].split(batch.completion_lens)
    return out


def train_on_rollouts(model: Qwen3, optimizer: MasterWeights, rollouts: Rollouts, ref_logprobs, args: Args):
    """Forward + backward over all rollouts in micro-batches (gradients accumulated in fp32).
    The training forward's logprobs are also the ones checked against vLLM: parity costs no extra
    forward. Returns per-token means of the loss terms and the trainer's logprobs per sample."""
    device = model.tok_embeddings.weight.device
    completion_lens = [len(c) for c in rollouts.completions]
    n_tokens = sum(completion_lens)
    names = ("loss", "pg_loss", "kl_div", "entropy", "ratio_mean", "ratio_clipped_frac")
    sums, logprobs_all = [], []  # per micro-batch, kept on the GPU
    lengths = [len(p) + n for p, n in zip(rollouts.prompts, completion_lens)]
    for idx in micro_batches(lengths, args.max_tokens_per_microbatch):
        batch = pack_sequences([rollouts.prompts[i] for i in idx], [rollouts.completions[i] for i in idx], device)
        logprobs, entropy = token_logprobs(model, batch)  # (C,), (C,)
        lens = torch.tensor(batch.completion_lens, device=device)
        advantages = rollouts.advantages[idx].to(device).repeat_interleave(lens)  # a sample's advantage on each token
        rollout_lp = torch.cat([rollouts.vllm_logprobs[i] for i in idx]).to(device)
        pg_loss, ratio, clipped = ppo_clip_loss(logprobs, rollout_lp, advantages, args.clip_eps)
        loss, kl = pg_loss, torch.zeros_like(pg_loss)
        if ref_logprobs is not None:
            kl = k3_kl(logprobs, torch.cat([ref_logprobs[i] for i in idx]))
            loss = loss + args.kl_coef * kl
        if args.entropy_coef:
            loss = loss - args.entropy_coef * entropy  # else the entropy stays out of the backward
        # Dividing by the step's token count (not the micro-batch's) makes the accumulated
        # gradient that of one big batch.
        (loss.sum() / n_tokens).backward()
        optimizer.accumulate_grads()
        sums.append(torch.stack([t.detach().sum() for t in (loss, pg_loss, kl, entropy, ratio, clipped.float())]))
        logprobs_all.append(logprobs.detach())
    # One copy to the host for the whole step (a sync per micro-batch would stall the GPU); the
    # division happens there, exactly: CUDA divides by a scalar through its reciprocal, which would
    # turn a ratio sum of exactly n_tokens into a mean one ulp below 1.
    metrics = {name: total / n_tokens for name, total in zip(names, torch.stack(sums).sum(0).tolist())}
    if ref_logprobs is None:
        del metrics["kl_div"]  # not measured: no reference model
    return metrics, list(torch.cat(logprobs_all).cpu().split(completion_lens))


def sft_step(model: Qwen3, optimizer: MasterWeights, rows: list[dict], args: Args) -> float:
    """One supervised warm-start step: maximise the logprob of each reference answer after its
    prompt (teacher forcing, the very forward GRPO uses). Returns the mean token loss."""
    device = model.tok_embeddings.weight.device
    n_tokens = sum(len(r["answer_ids"]) for r in rows)
    total = 0.0
    for idx in micro_batches([len(r["prompt_ids"]) + len(r["answer_ids"]) for r in rows], args.max_tokens_per_microbatch):
        batch = pack_sequences([rows[i]["prompt_ids"] for i in idx], [rows[i]["answer_ids"] for i in idx], device)
        loss = -token_logprobs(model, batch)[0].sum() / n_tokens
        loss.backward()
        optimizer.accumulate_grads()
        total += float(loss.detach())
    optimizer.step(args.sft_lr, args.max_grad_norm)
    return total


# =============================================================================================
# Evaluation
# =============================================================================================


def evaluate(engine, tokenizer, rows: list[dict], max_new_tokens: int, stop_token_ids) -> float:
    """Greedy accuracy of the served policy on GSM8K test questions."""
    completions, _ = engine.generate([r["prompt_ids"] for r in rows], [max_new_tokens] * len(rows), temperature=0.0,
                                     seeds=[0] * len(rows), stop_token_ids=stop_token_ids)  # fmt: skip
    rewards = [gsm8k_reward(tokenizer.decode(c, skip_special_tokens=True), r["answer"]) for c, r in zip(completions, rows)]
    return sum(rewards) / len(rows)


# =============================================================================================
# main
# =============================================================================================


class UsageError(Exception):
    """Bad flags, files or environment: reported as one line, exit status 2."""


class ParityError(Exception):
    """A sampled token whose trainer logprob is not bitwise vLLM's (exit status 1)."""


def rollout_seeds(seed: int, step: int, n: int) -> list[int]:
    """One sampling seed per request, unique over the run: completions depend on nothing else."""
    return [seed * 1_000_000_000 + step * n + j for j in range(n)]


def stop_token_ids(tokenizer, model_dir: Path) -> list[int]:
    eos = json.loads((model_dir / "config.json").read_text()).get("eos_token_id")
    ids = {tokenizer.eos_token_id} | set(eos if isinstance(eos, list) else [eos])
    ids.discard(None)
    if not ids:
        raise UsageError(f"{model_dir}: neither the tokenizer nor config.json names an end-of-sequence token")
    return sorted(ids)


def main(args: Args, device: str = "cuda", engine_class=None) -> Path:
    """Train; returns the run's TensorBoard directory. `engine_class` replaces vLLM in CPU tests."""
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm
    from transformers import AutoTokenizer

    try:
        validate(args)
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("no CUDA GPU found: simple_rl.py runs vLLM and the trainer on one GPU")
        model_dir = resolve_model_dir(args.model)
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except Exception as e:
            raise ValueError(f"--model {args.model}: cannot load its tokenizer ({type(e).__name__}: {str(e).splitlines()[0]})") from e
        stop_ids = stop_token_ids(tokenizer, model_dir)
        train_rows = encode_dataset(load_gsm8k(args.dataset, "train"), tokenizer, args, "train set")
        eval_rows = encode_dataset(load_gsm8k(args.eval_dataset, "test"), tokenizer, args, "eval set")[: args.eval_samples] if args.eval_every else []  # fmt: skip
        seed_everything(args.seed)
        engine = (engine_class or VLLMEngine)(model_dir, args.vllm_gpu_memory, args.max_prompt_tokens + args.max_new_tokens, args.seed)
        model = load_qwen3(model_dir, device)
    except ValueError as e:
        raise UsageError(str(e)) from e
    served_checksum = engine.weights_checksum()
    if served_checksum != weights_checksum(model.parameters()):
        raise UsageError(f"vLLM serves other weights than the trainer loaded from {model_dir} (is it a bf16 Qwen3 checkpoint?)")

    run_name = args.run_name or time.strftime("grpo_%Y%m%d_%H%M%S")
    run_dir, ckpt_dir = Path("runs") / run_name, Path(args.output_dir) / run_name
    writer = SummaryWriter(str(run_dir))
    writer.add_text("config", "| flag | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in asdict(args).items())
                    + f"\n| VLLM_BATCH_INVARIANT | {int(batch_invariant_enabled())} |")  # fmt: skip
    order = list(range(len(train_rows)))
    random.Random(args.seed).shuffle(order)

    if args.sft_steps:
        # Answers follow the prompt as the model should write them, then end of sequence.
        prefix = " " if args.prompt_format == "plain" or tokenizer.chat_template is None else ""
        for r in train_rows:
            r["answer_ids"] = tokenizer.encode(prefix + r["answer"], add_special_tokens=False) + [stop_ids[0]]
        sft_optimizer = MasterWeights(model, args.sft_lr, args.weight_decay)
        B = args.sft_batch_size
        for step in tqdm(range(args.sft_steps), desc="warm start", unit="step", file=sys.stdout):
            loss = sft_step(model, sft_optimizer, [train_rows[order[(step * B + i) % len(order)]] for i in range(B)], args)
            writer.add_scalar("sft/loss", loss, step)
        del sft_optimizer
        engine.push_weights(model)
        served_checksum = engine.weights_checksum()
        if served_checksum != weights_checksum(model.parameters()):
            raise RuntimeError("the warm-started weights did not reach vLLM")

    def log_eval(updates: int) -> None:  # logged at the number of GRPO updates made so far
        accuracy = evaluate(engine, tokenizer, eval_rows, args.max_new_tokens, stop_ids)
        writer.add_scalar("eval/accuracy", accuracy, updates)
        tqdm.write(f"after {updates} GRPO steps: greedy accuracy {accuracy:.3f} on {len(eval_rows)} test questions")

    if args.eval_every:
        log_eval(0)

    # GRPO from here: the reference policy (for KL) is the policy it starts from.
    ref_model = copy.deepcopy(model).requires_grad_(False) if args.kl_coef > 0 else None
    optimizer = MasterWeights(model, args.lr, args.weight_decay)
    P, G = args.prompts_per_step, args.samples_per_prompt

    for step in tqdm(range(args.steps), desc="GRPO", unit="step", file=sys.stdout):
        # Rollouts: G samples of each of P questions, each request with its own seed.
        t0 = time.perf_counter()
        rows = [train_rows[order[(step * P + i) % len(order)]] for i in range(P)]
        prompts = [r["prompt_ids"] for r in rows for _ in range(G)]
        completions, vllm_logprobs = engine.generate(prompts, [args.max_new_tokens] * len(prompts), args.temperature,
                                                     rollout_seeds(args.seed, step, len(prompts)), stop_ids)  # fmt: skip
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        rewards = torch.tensor([gsm8k_reward(text, rows[i // G]["answer"]) for i, text in enumerate(texts)])
        rollouts = Rollouts(prompts, completions, vllm_logprobs, rewards, group_advantages(rewards, G, args.std_normalize))
        n_generated = sum(len(c) for c in completions)

        t1 = time.perf_counter()
        ref_lps = reference_logprobs(ref_model, rollouts, args.max_tokens_per_microbatch) if ref_model else None

        t2 = time.perf_counter()
        loss_metrics, trainer_logprobs = train_on_rollouts(model, optimizer, rollouts, ref_lps, args)
        parity, report, first_mismatch = parity_report(vllm_logprobs, trainer_logprobs, completions, args.parity_report_tokens)
        for key, value in parity.items():
            writer.add_scalar(f"parity/{key}", value, step)
        tqdm.write(f"step {step} parity (first tokens of sample 0):\n{report}" if args.parity_report_tokens else report)
        if first_mismatch and args.assert_bitwise:
            writer.close()
            raise ParityError(f"step {step}: {first_mismatch}")  # before the update: the weights stay as sampled
        lr = lr_at(step, args)
        grad_norm, deltas = optimizer.step(lr, args.max_grad_norm)
        if device == "cuda":
            torch.cuda.synchronize()  # so that the train time includes the GPU's work

        t3 = time.perf_counter()
        engine.push_weights(model)
        # The served weights must now equal the trainer's, and have changed if the step changed any.
        before, served_checksum = served_checksum, engine.weights_checksum()
        if served_checksum != weights_checksum(model.parameters()) or (
            served_checksum == before and any(magnitude for magnitude, _ in deltas.values())
        ):
            raise RuntimeError(f"step {step}: the weight push did not reach vLLM (checksum {before} -> {served_checksum})")
        t4 = time.perf_counter()

        scalars = {f"train/{k}": v for k, v in loss_metrics.items()} | {
            "train/grad_norm": grad_norm, "train/lr": lr,
            "reward/reward_mean": float(rewards.mean()), "reward/reward_std": float(rewards.std()),
            "reward/completion_tokens_mean": n_generated / len(completions),
            "perf/generate_tokens_per_s": n_generated / (t1 - t0), "perf/train_tokens_per_s": n_generated / (t3 - t2),
            "time/generate": t1 - t0, "time/logprobs": t2 - t1, "time/train": t3 - t2, "time/push": t4 - t3,
        }  # fmt: skip
        for layer, (magnitude, relative) in deltas.items():
            scalars[f"weight_delta/{layer}/magnitude"] = magnitude
            scalars[f"weight_delta/{layer}/relative_change"] = relative
        for key, value in scalars.items():
            writer.add_scalar(key, value, step)
        tqdm.write(f"step {step}: reward {scalars['reward/reward_mean']:.3f} loss {loss_metrics['loss']:+.5f} "
                   f"ratio {loss_metrics['ratio_mean']:.6f} grad {grad_norm:.3f} | generate {t1 - t0:.1f}s "
                   f"logprobs {t2 - t1:.1f}s train {t3 - t2:.1f}s push {t4 - t3:.2f}s")  # fmt: skip

        last = step == args.steps - 1
        if args.eval_every and ((step + 1) % args.eval_every == 0 or last):
            log_eval(step + 1)
        if (args.save_every and (step + 1) % args.save_every == 0) or last:
            save_hf_checkpoint(model, model_dir, ckpt_dir / f"step_{step + 1:06d}")
    writer.close()
    return run_dir


if __name__ == "__main__":
    import tyro

    try:
        main(tyro.cli(Args, description=__doc__.split("\n")[0]))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except ParityError as e:
        print(f"error: bitwise parity broken at {e}", file=sys.stderr)
        sys.exit(1)
