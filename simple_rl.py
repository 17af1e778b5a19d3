"""Bitwise-exact on-policy GRPO: Qwen3 on GSM8K, rollouts from vLLM, training on a TorchTitan-style
Qwen3 that runs vLLM's own kernels; the two share one GPU in turns.

    VLLM_BATCH_INVARIANT=1 python simple_rl.py            # Qwen3-1.7B and GSM8K from the hub
    VLLM_BATCH_INVARIANT=1 python simple_rl.py --model DIR --dataset train.jsonl --eval-dataset test.jsonl
    python simple_rl.py --no-assert-bitwise                # batch invariance off: mismatch reported
    VLLM_BATCH_INVARIANT=1 python simple_rl.py ... --resume checkpoints/RUN/step_000100   # continue a run
    tensorboard --logdir runs

The guarantee, checked every step on every sampled token and asserted unless --no-assert-bitwise:
the fp32 logprob the trainer computes for a sampled token equals, bit for bit, the logprob vLLM
returned when it sampled that token, whatever the batch either side ran it in. So the policy that
generated the data is exactly the policy being trained (the importance ratio is exactly 1), and
k3 KL between them is exactly 0. It holds with VLLM_BATCH_INVARIANT=1 on vLLM 0.20.0 (one GPU,
FlashAttention 3, CUDA graphs without torch.compile), whose non-invariant fused add+RMSNorm this
script replaces in-process.

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
6. The policy optimised is the one sampled from: softmax(logits / T) at --temperature T (the same for
   the reference policy's KL); at T = 1, the model's own distribution.
"""

import dataclasses
import itertools
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Literal

import torch
import torch.nn as nn
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

from batch_invariant_backward import EXACT, Kernels

# =============================================================================================
# Args
# =============================================================================================


@dataclass
class Data:
    """The model, the data and the seed."""

    model: str = "Qwen/Qwen3-1.7B"
    """Qwen3 checkpoint: a Hugging Face hub id, or a local directory (config.json, safetensors, tokenizer)"""
    dataset: str | None = None
    """local GSM8K-format jsonl (question, answer) to train on; default: openai/gsm8k 'main' train split"""
    eval_dataset: str | None = None
    """local GSM8K-format jsonl to evaluate on; default: openai/gsm8k 'main' test split"""
    prompt_format: Literal["auto", "chat", "plain"] = "auto"
    """'chat': the tokenizer's chat template; 'plain': 'Question: ...\\nAnswer:';
    'auto': chat if the tokenizer has a template"""
    thinking: bool = False
    """let Qwen3's chat template open a <think> block (long completions); off by default"""
    max_prompt_tokens: int = 512
    """longer prompts are skipped (and counted at start), never cut"""
    seed: int = 0
    """seed of the data order, the sampling and the trainer"""


@dataclass
class Sampling:
    """What vLLM samples each step."""

    prompts_per_step: int = 32
    """GSM8K questions per step"""
    samples_per_prompt: int = 8
    """G: completions sampled per question, the group advantages are normalised over"""
    max_new_tokens: int = 512
    """completion length limit"""
    temperature: float = 1.0
    """sampling temperature; the policy trained is the tempered one, softmax(logits / T), whose logprobs
    vLLM returns (its processed logprobs): ratios stay exact at any T. Top-k and top-p are not offered:
    their masking would have to be mirrored too"""


@dataclass
class Loss:
    """The GRPO loss, and the corrections for runs whose sampler and trainer differ."""

    clip_eps: float = 0.2
    """PPO clip range of the token ratio"""
    kl_coef: float = 0.0
    """k3 KL-to-reference coefficient; 0 skips the reference model (no memory, no forward)"""
    entropy_coef: float = 0.0
    """entropy bonus coefficient"""
    std_normalize: bool = True
    """divide group advantages by the group std"""
    correction: Literal["none", "tis", "mis"] = "none"
    """for runs whose sampler and trainer differ (batch invariance off): weight the policy-gradient term by
    w = trainer / sampler probability, truncated at --correction-max ('tis') or zeroed outside
    [--correction-min, --correction-max] ('mis'); 'none' clips the ratio to the sampler, as PPO does"""
    correction_level: Literal["token", "sequence"] = "sequence"
    """a weight per token, or one per sequence from its summed log-ratios (token-level corrections have
    been seen to collapse on long-horizon tasks, sequence-level MIS not)"""
    correction_min: float = 0.5
    """mis: the smallest weight kept"""
    correction_max: float = 2.0
    """tis: where weights are truncated; mis: the largest weight kept"""
    correction_geometric_mean: bool = False
    """sequence level: the per-token geometric mean exp(mean log-ratio) instead of exp(sum), so that the
    bounds mean the same for short and long completions"""


@dataclass
class Optimizer:
    """AdamW on fp32 master weights, and its schedule."""

    steps: int = 200
    """optimizer steps (one batch of rollouts each)"""
    lr: float = 1e-6
    """peak AdamW learning rate"""
    warmup_steps: int = 10
    """linear warm-up steps, then cosine decay (a run shorter than this warms up over all its steps)"""
    min_lr_ratio: float = 0.1
    """the cosine decays to lr * min_lr_ratio"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold (global L2 norm)"""


@dataclass
class WarmStart:
    """An optional supervised warm start before GRPO."""

    sft_steps: int = 0
    """supervised warm start before GRPO: steps of teacher forcing on the train set's reference answers"""
    sft_lr: float = 1e-4
    """constant AdamW learning rate of the warm start"""
    sft_batch_size: int = 64
    """questions per warm-start step"""


@dataclass
class Parity:
    """The bitwise check of every sampled token."""

    assert_bitwise: bool = True
    """abort at the first sampled token whose trainer logprob differs from vLLM's"""
    parity_report_tokens: int = 4
    """first tokens of sample 0 printed every step with both logprobs; 0 prints only the summary"""
    locate_divergence: bool = False
    """with --no-assert-bitwise: at every step with a mismatch, find the first op whose bits differ for the
    first mismatching sample (as a parity abort always does): a prefill through vLLM with hooks on its
    modules and through the trainer, compared tensor by tensor"""


@dataclass
class EngineAndMemory:
    """How vLLM and the trainer share the GPU."""

    vllm_gpu_memory: float = 0.5
    """share of the GPU's memory vLLM holds while it generates (its weights, KV cache and CUDA graphs);
    it gives all of it back while the trainer runs"""
    vllm_cuda_graphs: bool = True
    """replay decode steps as CUDA graphs (no torch.compile: same kernels, same bits as eager);
    --no-vllm-cuda-graphs runs vLLM eager, for debugging"""
    max_tokens_per_microbatch: int = 8192
    """tokens (prompts + completions, packed) in one trainer forward + backward; activation memory
    grows with it; gradients are accumulated over micro-batches"""
    activation_checkpointing: bool = False
    """keep only each layer's input in the forward and recompute the layer in the backward: a fraction
    of the activation memory for about a third more train time (for models that do not fit otherwise)"""


@dataclass
class EvalAndCheckpoints:
    """Evaluation, TensorBoard, checkpoints and resuming."""

    eval_every: int = 20
    """greedy GSM8K accuracy before training, every N steps and at the end; 0 disables"""
    eval_samples: int = 256
    """test questions per evaluation"""
    run_name: str | None = None
    """TensorBoard run runs/<run_name>, checkpoints <output_dir>/<run_name>; default: a timestamp"""
    output_dir: str = "checkpoints"
    """where Hugging Face checkpoints are written"""
    save_every: int = 0
    """checkpoint every N steps (one is always written at the end): Hugging Face weights that vLLM and
    transformers load, plus the training state that --resume continues from"""
    keep_last: int = 3
    """checkpoints of the run kept on disk, the newest; 0 keeps all"""
    resume: str | None = None
    """a checkpoint directory (<output_dir>/<run_name>/step_N) to continue the run from, bit for bit;
    the flags that define the run must be those it was started with"""


# --help shows the flags under these titles; the code reads one flat Args (args.temperature).
FLAG_GROUPS = {"data": Data, "sampling": Sampling, "grpo_loss": Loss, "optimizer": Optimizer,
               "warm_start": WarmStart, "parity": Parity, "engine_and_memory": EngineAndMemory,
               "evaluation_and_checkpoints": EvalAndCheckpoints}
Args = dataclasses.make_dataclass("Args", [
    (f.name, f.type, dataclasses.field(default=f.default))
    for group in FLAG_GROUPS.values() for f in dataclasses.fields(group)])


def parse_command_line(argv: list[str] | None = None) -> Args:
    import tyro

    grouped = dataclasses.make_dataclass("CommandLine", [
        (title, tyro.conf.OmitArgPrefixes[group], dataclasses.field(default_factory=group))
        for title, group in FLAG_GROUPS.items()])
    summary = __doc__.split("\n\n")[0].replace("\n", " ")
    setting = ("Set VLLM_BATCH_INVARIANT=1 in the environment: vLLM reads it at import, and without it "
               "the logprobs cannot be bitwise equal.")
    parsed = tyro.cli(grouped, args=argv, description=f"{summary} {setting}")
    flags = {name: value for title in FLAG_GROUPS for name, value in asdict(getattr(parsed, title)).items()}
    return Args(**flags)


def batch_invariant_enabled() -> bool:
    """vLLM reads VLLM_BATCH_INVARIANT at import, as an integer: it must be 1 before the run starts."""
    return os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1"


def validate(args: Args) -> Args:
    """Bad flag values and combinations fail here, before anything is loaded or written. Returns the
    args with what derives from them filled in: the run name (a timestamp; a resumed run keeps its
    own), and a warm-up no longer than the run."""
    sequence = args.max_prompt_tokens + args.max_new_tokens
    invariant = os.environ.get("VLLM_BATCH_INVARIANT")
    checks = [
        (args.steps >= 1, "--steps must be at least 1"),
        (args.prompts_per_step >= 1, "--prompts-per-step must be at least 1"),
        (args.samples_per_prompt >= 2,
         "--samples-per-prompt must be at least 2: GRPO normalises rewards within each group"),
        (args.max_new_tokens >= 1, "--max-new-tokens must be at least 1"),
        (args.max_prompt_tokens >= 1, "--max-prompt-tokens must be at least 1"),
        (args.temperature > 0, "--temperature must be > 0 (evaluation is greedy by itself)"),
        (args.lr > 0, "--lr must be > 0"),
        (args.warmup_steps >= 0, "--warmup-steps must be >= 0"),
        (0 <= args.min_lr_ratio <= 1, "--min-lr-ratio must be between 0 and 1"),
        (args.weight_decay >= 0, "--weight-decay must be >= 0"),
        (args.max_grad_norm > 0, "--max-grad-norm must be > 0"),
        (args.clip_eps > 0, "--clip-eps must be > 0"),
        (0 <= args.correction_min < args.correction_max, "need 0 <= --correction-min < --correction-max"),
        (args.kl_coef >= 0, "--kl-coef must be >= 0"),
        (args.entropy_coef >= 0, "--entropy-coef must be >= 0"),
        (args.max_tokens_per_microbatch >= sequence,
         "--max-tokens-per-microbatch must hold one whole sequence "
         "(>= --max-prompt-tokens + --max-new-tokens)"),
        (args.sft_steps >= 0, "--sft-steps must be >= 0"),
        (args.sft_lr > 0, "--sft-lr must be > 0"),
        (args.sft_batch_size >= 1, "--sft-batch-size must be at least 1"),
        (args.parity_report_tokens >= 0, "--parity-report-tokens must be >= 0"),
        (0 < args.vllm_gpu_memory < 1, "--vllm-gpu-memory must be a fraction between 0 and 1"),
        (args.eval_every >= 0, "--eval-every must be >= 0"),
        (args.eval_samples >= 1, "--eval-samples must be at least 1"),
        (args.save_every >= 0, "--save-every must be >= 0"),
        (args.keep_last >= 0, "--keep-last must be >= 0"),
        (args.resume is None or Path(args.resume).is_dir(), f"--resume {args.resume}: no such directory"),
        (not (args.dataset and args.eval_every and not args.eval_dataset),
         "--dataset is local: pass --eval-dataset (a local test jsonl) too, or --eval-every 0"),
        (invariant in (None, "0", "1"),
         f"VLLM_BATCH_INVARIANT is {invariant!r}, but vLLM reads it as an integer: "
         "set VLLM_BATCH_INVARIANT=1"),
        (not args.assert_bitwise or batch_invariant_enabled(),
         f"VLLM_BATCH_INVARIANT is {invariant or 'not set'}, so vLLM's logprobs cannot equal the trainer's: "
         "set VLLM_BATCH_INVARIANT=1, or pass --no-assert-bitwise to run anyway and report the mismatch"),
    ]
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's
    if world > 1:
        checks += [
            (args.prompts_per_step % world == 0,
             f"--prompts-per-step {args.prompts_per_step} must be a multiple of the {world} processes"),
            (args.sft_batch_size % world == 0,
             f"--sft-batch-size {args.sft_batch_size} must be a multiple of the {world} processes"),
        ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    if args.run_name and not args.resume:
        for used in (Path("runs") / args.run_name, Path(args.output_dir) / args.run_name):
            if used.exists():
                raise ValueError(f"--run-name {args.run_name}: {used} exists already; pick another name, "
                                 "or --resume one of its checkpoints")
    if args.run_name is None and args.resume is None:  # a resumed run keeps its name
        args = dataclasses.replace(args, run_name=time.strftime("grpo_%Y%m%d_%H%M%S"))
    if args.warmup_steps > args.steps:
        print(f"note: --warmup-steps {args.warmup_steps} is more than --steps {args.steps}: "
              f"the learning rate warms up over all {args.steps} steps")
        args = dataclasses.replace(args, warmup_steps=args.steps)
    return args


# =============================================================================================
# Determinism setup
# =============================================================================================


def seed_everything(seed: int) -> None:
    # Sampling is seeded per request (see `rollout_seeds`), the data order has its own seeded
    # generator and the trainer has no dropout: nothing in the loop draws from the global generators.
    # Seeded anyway (and saved in checkpoints), for whatever a researcher adds that does.
    random.seed(seed)
    torch.manual_seed(seed)


def rollout_seeds(seed: int, step: int, n: int) -> list[int]:
    """One sampling seed per request, unique over the run: completions depend on nothing else."""
    return [seed * 1_000_000_000 + step * n + j for j in range(n)]


# =============================================================================================
# Data and reward
# =============================================================================================

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

ANSWER_AFTER_HASHES = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
ANSWER_IN_BOX = re.compile(r"\\boxed\{\s*\$?\s*(-?[\d,]*\.?\d+)\s*\}")
ANY_NUMBER = re.compile(r"-?[\d,]*\.?\d+")
"""GSM8K's reference format is '#### 72'. A completion's answer is the first '#### N', else the
first '\\boxed{N}', else its last number (the usual fallback); after a closed <think> block, the
answer given after it, else the one inside it. Numbers are then compared as decimals, so '1,000',
'1000.0' and '$1000' are all 1000."""


def extract_answer(text: str) -> str | None:
    thoughts, closed, answer = text.rpartition("</think>")
    if closed and (after := extract_answer(answer)) is not None:
        return after
    text = thoughts or text
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
    predicted = parse_number(extract_answer(completion))
    expected = parse_number(extract_answer(reference_answer))
    return float(predicted is not None and expected is not None and predicted == expected)


def load_gsm8k(path: str | None, split: str) -> list[dict]:
    """[{question, answer}]: a local jsonl, or openai/gsm8k 'main' from `datasets`."""
    if path is None:
        from datasets import load_dataset

        try:
            rows = load_dataset("openai/gsm8k", "main", split=split)
        except Exception as e:
            raise ValueError(f"cannot load openai/gsm8k from the hub ({type(e).__name__}): "
                             "pass --dataset/--eval-dataset with local jsonl files") from e
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
            if not (isinstance(row, dict) and isinstance(row.get("question"), str)
                    and isinstance(row.get("answer"), str)):
                raise ValueError(f"{path} line {n}: need a JSON object with string fields "
                                 "'question' and 'answer'")
            # GSM8K's answers end in '#### N': a bare last number would be a guess at the answer.
            final = ANSWER_AFTER_HASHES.search(row["answer"])
            if final is None or parse_number(final.group(1)) is None:
                raise ValueError(f"{path} line {n}: the answer has no final '#### N' (GSM8K's format)")
            rows.append({"question": row["question"], "answer": row["answer"]})
    if not rows:
        raise ValueError(f"{path}: no examples")
    return rows


def encode_prompt(tokenizer, question: str, use_chat: bool, thinking: bool) -> list[int]:
    content = f"{question}\n{INSTRUCTION}"
    if use_chat:
        messages = [{"role": "user", "content": content}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False, enable_thinking=thinking)
    return tokenizer.encode(f"Question: {content}\nAnswer:")


def encode_dataset(rows, tokenizer, args: Args, name: str) -> list[dict]:
    """Tokenise every question once; report (never cut) prompts over --max-prompt-tokens."""
    has_template = tokenizer.chat_template is not None
    if args.prompt_format == "chat" and not has_template:
        raise ValueError("--prompt-format chat: this tokenizer has no chat template; use plain or auto")
    use_chat = args.prompt_format == "chat" or (args.prompt_format == "auto" and has_template)
    encoded = [dict(r, prompt_ids=encode_prompt(tokenizer, r["question"], use_chat, args.thinking))
               for r in rows]
    kept = [r for r in encoded if len(r["prompt_ids"]) <= args.max_prompt_tokens]
    if len(kept) < len(encoded):
        print(f"{name}: {len(encoded) - len(kept)} of {len(encoded)} prompts exceed --max-prompt-tokens "
              f"{args.max_prompt_tokens} and are skipped")
    if not kept:
        raise ValueError(f"{name}: every prompt exceeds --max-prompt-tokens {args.max_prompt_tokens}")
    return kept


def step_rows(rows: list[dict], order: list[int], step: int, n: int) -> list[dict]:
    """The n rows of a step: the next n of the seeded shuffled order, wrapping around epochs."""
    return [rows[order[(step * n + i) % len(order)]] for i in range(n)]


# =============================================================================================
# Model and weight conversion
# =============================================================================================


def resolve_model_dir(model: str) -> Path:
    """A local checkpoint directory as is, else a Hugging Face hub id downloaded to the cache."""
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {model}: the directory has no config.json "
                             "(need a Hugging Face Qwen3 checkpoint)")
        return path
    if path.exists() or model.startswith((".", "/")) or model.count("/") != 1:
        raise ValueError(f"--model {model}: not a checkpoint directory, nor a hub id like Qwen/Qwen3-1.7B")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as e:
        raise ValueError(f"--model {model}: cannot download it from the hub ({type(e).__name__}); "
                         "pass a local checkpoint directory") from e


def model_args_from_hf_config(config: dict) -> Qwen3ModelArgs:
    """torchtitan's Qwen3 arguments from a Hugging Face `config.json`; refuses what vLLM's and
    this trainer's Qwen3 would compute differently (other activations, biases, rope scaling)."""
    if config.get("model_type") != "qwen3":
        raise ValueError(f"config.json: model_type is {config.get('model_type')!r}, "
                         "this trainer needs 'qwen3'")
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


BITWISE_HEAD_DIMS = (128, 256)
"""Head sizes where vLLM's attention is the trainer's bit for bit at any length (tests/test_gpu_configs.py)"""


def check_bitwise_head_dim(model: Qwen3ModelArgs, args: Args, model_dir: Path) -> None:
    """Refuses head sizes where vLLM 0.20's attention cannot be reproduced bit for bit. FlashAttention 3
    sizes its key tiles by head size and causality, and runs a step of decodes only (one query per
    sequence) as non-causal. At head_dim 64 such a step sums over the keys in tiles of 192 where a prefill,
    and the trainer, use tiles of 128: the locator, run over an eager engine's decode steps, finds every
    decode row parting at layer 0's attention while every prefill row is equal. A sequence of at most 128
    tokens fits one tile either way. Other head sizes are untested."""
    d, longest = model.head_dim, args.max_prompt_tokens + args.max_new_tokens
    if d in BITWISE_HEAD_DIMS or (d == 64 and longest <= 128):
        return
    raise ValueError(f"--model {model_dir}: head_dim is {d}; vLLM's attention is bitwise the trainer's "
                     f"only at head_dim 128 or 256, or 64 with sequences of at most 128 tokens (here "
                     f"--max-prompt-tokens + --max-new-tokens = {longest})")


def rope_cos_sin_cache(args: Qwen3ModelArgs, dtype: torch.dtype) -> torch.Tensor:
    """(max_seq_len, head_dim) table [cos | sin] for neox rotary, built as vLLM builds it: fp32 on
    the current default device, then rounded to the model dtype (the kernel reads this table)."""
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.float) / args.head_dim
    inv_freq = 1.0 / (args.rope_theta**exponents)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)


# Each module's forward is the sequence of kernels vLLM 0.20 runs for it in eager batch-invariant
# mode (CUDA graphs replay the same kernels), in the same order and dtypes, over packed sequences.


class Attention(nn.Module):
    def __init__(self, args: Qwen3ModelArgs, kernels: Kernels):
        super().__init__()
        self.args, self.kernels = args, kernels
        # One merged [q; k; v] projection, as vLLM's QKVParallelLinear serves it.
        self.wqkv = nn.Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)

    def forward(self, x, positions, cos_sin_cache, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        k, a = self.kernels, self.args
        T, H, Hk, D = x.shape[0], a.n_heads, a.n_kv_heads, a.head_dim
        q, key, v = k.linear(x, self.wqkv.weight).split([H * D, Hk * D, Hk * D], dim=-1)
        q = k.rms_norm(q.reshape(T, H, D), self.q_norm.weight, a.norm_eps)  # per-head norm (T, H, D)
        key = k.rms_norm(key.reshape(T, Hk, D), self.k_norm.weight, a.norm_eps)  # (T, Hk, D)
        q, key = k.rotary(q, key, positions, cos_sin_cache)
        out = k.attention(q, key, v.reshape(T, Hk, D), cu_seqlens, max_seqlen, D**-0.5)  # (T, H, D)
        return k.linear(out.reshape(T, H * D), self.wo.weight)


class FeedForward(nn.Module):
    def __init__(self, args: Qwen3ModelArgs, kernels: Kernels):
        super().__init__()
        self.kernels = kernels
        self.w13 = nn.Linear(args.dim, 2 * args.hidden_dim, bias=False)  # merged [gate; up]
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x) -> torch.Tensor:
        k = self.kernels
        return k.linear(k.silu_and_mul(k.linear(x, self.w13.weight)), self.w2.weight)


class TransformerBlock(nn.Module):
    def __init__(self, args: Qwen3ModelArgs, kernels: Kernels):
        super().__init__()
        self.eps, self.kernels = args.norm_eps, kernels
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args, kernels)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args, kernels)

    def forward(self, h, residual, positions, cos_sin_cache, cu_seqlens, max_seqlen: int):
        """(h, residual) of the layer below -> this layer's (h, residual), each (T, dim)."""
        k = self.kernels
        # vLLM normalises layer 0's input alone; every later norm first adds the residual (a bf16
        # add, then the norm: see `make_fused_add_rms_norm_batch_invariant`).
        residual = h if residual is None else h + residual
        x = k.rms_norm(residual, self.attention_norm.weight, self.eps)
        h = self.attention(x, positions, cos_sin_cache, cu_seqlens, max_seqlen)
        residual = h + residual
        return self.feed_forward(k.rms_norm(residual, self.ffn_norm.weight, self.eps)), residual


class Qwen3(nn.Module):
    """Qwen3 with torchtitan's parameter names, in the layout vLLM serves (merged q/k/v and
    gate/up, `output` absent when tied to `tok_embeddings`)."""

    def __init__(self, args: Qwen3ModelArgs, kernels: Kernels = EXACT, dtype: torch.dtype = torch.bfloat16,
                 activation_checkpointing: bool = False):
        super().__init__()
        self.args, self.kernels, self.activation_checkpointing = args, kernels, activation_checkpointing
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, kernels) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = None if args.enable_weight_tying else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.to(dtype)
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(args, dtype), persistent=False)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(self, batch: "PackedBatch", temperature: float = 1.0):
        """(logprob (C,), entropy (C,)) in fp32 of every completion token of the packed batch under
        softmax(z / temperature), computed as vLLM's sampler computes its processed logprobs: lm_head
        on the rows that predict them (bf16 logits z), the fp32 logits divided by the temperature,
        log_softmax. lm_head is part of the forward so that a sharded trainer gathers the (possibly
        tied) embedding once, for the whole model."""
        hidden = self.hidden_states(batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen)
        return self.kernels.lm_head_logprobs(hidden[batch.target_rows], self.output_weight, batch.targets,
                                             temperature)

    def hidden_states(self, tokens, positions, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        """Packed sequences (T,) -> final hidden states (T, dim)."""
        h, residual = F.embedding(tokens, self.tok_embeddings.weight), None
        for layer in self.layers:
            inputs = (h, residual, positions, self.cos_sin_cache, cu_seqlens, max_seqlen)
            if self.activation_checkpointing and torch.is_grad_enabled():
                # The recomputation runs the same deterministic kernels: the same bits again.
                h, residual = checkpoint(layer, *inputs, use_reentrant=False)
            else:
                h, residual = layer(*inputs)
        return self.kernels.rms_norm(h + residual, self.norm.weight, self.args.norm_eps)


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


def hf_weights(model: Qwen3):
    """Yields (Hugging Face name, tensor) for every weight of the trainer, one parameter at a time, as
    views (no copy): what vLLM's `load_weights` and `save_file` take. A sharded weight is gathered from
    all ranks first (so every rank must iterate, in the same order): one gathered weight at a time,
    never a second whole copy of the model."""
    a = model.args
    adapter = Qwen3StateDictAdapter(a, None)
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    for name, p in model.named_parameters():
        p = full(p.detach())
        prefix = name.rsplit(".", 2)[0] + "."  # layers.<i>.attention. / layers.<i>.feed_forward.
        if name.endswith("attention.wqkv.weight"):
            names = [prefix + "wq.weight", prefix + "wk.weight", prefix + "wv.weight"]
            parts = dict(zip(names, p.split([q, kv, kv])))
        elif name.endswith("feed_forward.w13.weight"):
            parts = dict(zip([prefix + "w1.weight", prefix + "w3.weight"], p.chunk(2)))
        else:
            parts = {name: p}
        yield from adapter.to_hf(parts).items()


def check_checkpoint(model_dir: Path, args: Qwen3ModelArgs) -> None:
    """The safetensors files hold every tensor the trainer needs, at its shape, and nothing else:
    read from their headers only, so a bad checkpoint fails before anything slow starts."""
    from safetensors import SafetensorError, safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"--model {model_dir}: no *.safetensors weights in the directory")
    shapes = {}
    for f in files:
        try:
            with safe_open(f, "pt") as weights:
                shapes |= {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
        except SafetensorError as e:
            raise ValueError(f"--model {model_dir}: {f.name} is not a whole safetensors file ({e}); "
                             "download or save it again") from None
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in hf_weights(Qwen3(args))}
    if args.enable_weight_tying:
        shapes.pop("lm_head.weight", None)  # some tied checkpoints store the head too; it is the embedding
    problems = [f"missing {name}" for name in sorted(expected.keys() - shapes.keys())]
    problems += [f"unexpected {name}" for name in sorted(shapes.keys() - expected.keys())]
    problems += [f"{name} is {list(shapes[name])}, config.json needs {list(shape)}"
                 for name, shape in expected.items() if name in shapes and shapes[name] != shape]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(f"--model {model_dir}: the weights do not match config.json: "
                         + "; ".join(problems[:3]) + more)


def load_qwen3(model_dir: Path, device, kernels: Kernels = EXACT, dtype=torch.bfloat16,
               activation_checkpointing: bool = False) -> Qwen3:
    """A Hugging Face Qwen3 checkpoint directory -> trainer model on `device`."""
    args = model_args_from_hf_config(json.loads((model_dir / "config.json").read_text()))
    if torch.device(device) == torch.device("cuda"):  # safetensors reads a bare "cuda" as GPU 0
        device = torch.device("cuda", torch.cuda.current_device())  # this rank's GPU, under torchrun
    hf_state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        hf_state.update(load_file(f, device=str(device)))
    # Built under the device so the rotary table is computed where vLLM computes it.
    with torch.device(device):
        model = Qwen3(args, kernels, dtype, activation_checkpointing)
    try:
        model.load_state_dict(from_hf_state_dict(hf_state, args), strict=True)
    except (KeyError, RuntimeError) as e:
        raise ValueError(f"--model {model_dir}: weights do not match config.json "
                         f"({str(e).splitlines()[0]})") from e
    return model


@contextmanager
def atomic_directory(out_dir: Path):
    """Yields a temporary directory beside `out_dir` that becomes `out_dir` only once the block has
    written it whole: a crash, or a kill -9, mid-write leaves no half-written `out_dir`."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp)
        raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


TOKENIZER_FILES = ("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template",
                   "generation_config")
"""Files of a checkpoint that belong to its tokenizer (and generation defaults): copied as they are."""


def write_hf_checkpoint(weights: dict, source_dir: Path, directory: Path) -> None:
    """Config, safetensors and tokenizer files that transformers and vLLM load as they are."""
    config = json.loads((source_dir / "config.json").read_text())
    config["torch_dtype"] = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    for f in source_dir.iterdir():
        if f.name.startswith(TOKENIZER_FILES):
            shutil.copy(f, directory / f.name)


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
    """Order-independent checksum of bf16 weights: the sum of their bit patterns. The trainer's and
    vLLM's layouts hold the same elements, so equal weights give equal sums, and a stale or partial
    push almost surely does not (a sum can collide, but not by the accident of one stale tensor)."""
    return int(torch.stack([p.detach().view(torch.int16).sum(dtype=torch.int64) for p in params]).sum())


# CUDA graphs without torch.compile: the graphs replay the very kernels eager mode launches, so
# the bits stay those the trainer reproduces, while a decode step (most of a rollout) loses its
# kernel-launch overhead. Compiling would fuse norms, SiLU and rotary into Inductor kernels with
# other bits. Prefills and mixed steps run eager.
CUDA_GRAPHS = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}  # mode 0: CompilationMode.NONE


class VLLMEngine:
    """vLLM in this process, on this GPU, serving the checkpoint the trainer loaded: FlashAttention 3,
    CUDA graphs without compile (or eager), no prefix caching (weights change every step), prompts
    in and completions out as token ids. With sleep mode, it gives its GPU memory back while the
    trainer runs (`sleep`) and takes it again before generating (`wake_up`)."""

    def __init__(self, model_dir: Path, gpu_memory_utilization: float, max_model_len: int, seed: int,
                 cuda_graphs: bool = True, sleep_mode: bool = True, max_num_seqs: int = 256, **vllm_args):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine must run in this process
        import vllm

        if vllm.__version__ != "0.20.0":
            raise ValueError(f"vLLM {vllm.__version__} is installed; this script mirrors vLLM 0.20.0's "
                             "kernels: pip install vllm==0.20.0")
        if batch_invariant_enabled():
            make_fused_add_rms_norm_batch_invariant()
        graphs = {"compilation_config": CUDA_GRAPHS} if cuda_graphs else {"enforce_eager": True}
        self.llm = vllm.LLM(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            seed=seed,
            enable_prefix_caching=False,
            enable_sleep_mode=sleep_mode,
            logprobs_mode="processed_logprobs",  # of the distribution sampled from: after temperature
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            attention_config={"backend": "FLASH_ATTN", "flash_attn_version": 3},
            **graphs,
            **vllm_args,  # more vllm.LLM arguments (the tests give a second engine a fixed KV cache)
        )

    def generate(self, prompts: list[list[int]], max_tokens: list[int], temperature: float, seeds: list[int],
                 stop_token_ids=(), ignore_eos: bool = False):
        """One completion per prompt. Returns the completion token ids and vLLM's logprob of each
        sampled token under the distribution it was sampled from, softmax(logits / temperature), as
        fp32 tensors. Temperature 0 is greedy (its logprobs are then those at temperature 1)."""
        from vllm import SamplingParams, TokensPrompt

        params = [
            SamplingParams(temperature=temperature, max_tokens=n, seed=s, logprobs=0, detokenize=False,
                           stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
            for n, s in zip(max_tokens, seeds)
        ]
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        completions, logprobs = [], []
        for out in outputs:
            sample = out.outputs[0]
            completions.append(list(sample.token_ids))
            # A Python float holds an fp32 value exactly: this round trip is lossless.
            sampled = [lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs)]
            logprobs.append(torch.tensor(sampled, dtype=torch.float32))
        return completions, logprobs

    def sleep(self) -> None:
        """Give back the GPU memory of the weights and the KV cache. Level 2 discards the weights
        rather than copying them to the host: the trainer pushes new ones before the next rollout."""
        self.llm.sleep(level=2)

    def wake_up(self, tags: list[str]) -> None:
        """Map GPU memory again for "weights" and/or "kv_cache" (at the same addresses, so the
        captured CUDA graphs stay valid); the contents are not restored."""
        self.llm.wake_up(tags=tags)

    def push_weights(self, model: Qwen3) -> None:
        """Copy the trainer's bf16 weights into the served model in-process, no disk: vLLM's own
        `load_weights` copies each HF-named tensor into its merged q/k/v and gate/up slots."""
        self.llm.apply_model(lambda served: served.load_weights(hf_weights(model)))

    def weights_checksum(self) -> int:
        return self.llm.apply_model(lambda served: weights_checksum(served.parameters()))[0]

    def rotary_table(self) -> torch.Tensor:
        def table(served):
            return served.model.layers[0].self_attn.rotary_emb.cos_sin_cache.cpu()

        return self.llm.apply_model(table)[0]


def sync_weights(engine, model: Qwen3, served_checksum: int, changed: bool) -> int:
    """The one way weights reach vLLM: give the trainer's cached GPU memory back, wake vLLM's weights,
    push the trainer's, wake the KV cache, and verify that the served weights now equal the trainer's
    and have changed if the update changed any. Returns the new served checksum."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the trainer's freed blocks go back to the driver, for vLLM to map
    engine.wake_up(["weights"])
    engine.push_weights(model)
    engine.wake_up(["kv_cache"])
    checksum = engine.weights_checksum()
    if checksum != trainer_checksum(model) or (changed and checksum == served_checksum):
        raise RuntimeError(f"the weight push did not reach vLLM (checksum {served_checksum} -> {checksum})")
    return checksum


# =============================================================================================
# Several GPUs (torchrun): data parallel, FSDP2-sharded trainer
# =============================================================================================


def init_distributed(device: str) -> int:
    """Under torchrun (WORLD_SIZE > 1): join the process group (NCCL on GPUs, gloo on the CPU) and take
    this rank's GPU. Returns the number of processes; with one, nothing is set up."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        if device == "cuda":
            gpu = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(gpu)
            # device_id makes NCCL connect now, before vLLM starts: in batch-invariant mode vLLM sets
            # NCCL_MAX_NCHANNELS=1 and NCCL_NTHREADS=1 for its own reductions, and NCCL reads them when
            # it connects. Connected after that, FSDP's gathers and reduce-scatters ran on one channel,
            # at about a tenth of the link's speed, and 2 GPUs trained no faster than one (2 x H200).
            dist.init_process_group("nccl", device_id=gpu)
        else:
            dist.init_process_group("gloo")
    return world


def shard_model(model: Qwen3) -> Qwen3:
    """FSDP2 over all ranks: one unit per transformer block, and the root (embedding, final norm,
    lm_head, which may share the embedding's weight). Each rank keeps 1/N of every weight; a unit's
    weights are all-gathered for its forward and its backward, and its gradients reduce-scattered,
    summed in fp32 (not averaged: the loss is divided by the token count of all ranks' samples)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = model.cos_sin_cache.device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for unit in (*model.layers, model):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no pre-multiplied one
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) weight or gradient; a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded (DTensor) tensor, gathered from all ranks (every rank must call it); a
    plain tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def rank_share(n: int) -> slice:
    """This rank's consecutive share of n items (n a multiple of the number of ranks)."""
    rank, world = rank_and_world()
    return slice(rank * n // world, (rank + 1) * n // world)


def all_ranks_sum(x: torch.Tensor) -> torch.Tensor:
    """x summed over the ranks of a torchrun job; x itself in a single process."""
    if not dist.is_initialized():
        return x
    y = x.to("cuda" if dist.get_backend() == "nccl" else "cpu", copy=True)
    dist.all_reduce(y)
    return y.to(x.device)


def all_ranks_cat(x: torch.Tensor) -> torch.Tensor:
    """The concatenation, in rank order, of every rank's 1-D tensor (their lengths may differ); x itself
    in a single process. Tensors, not pickled objects: pickling a step's samples took 0.4-0.8 s."""
    world = rank_and_world()[1]
    if world == 1:  # also a one-GPU run, where vLLM has set up a process group of one
        return x
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([len(x)], device=device))
    lengths = [int(n) for n in lengths]
    parts = [torch.empty(max(lengths), dtype=x.dtype, device=device) for _ in range(world)]
    dist.all_gather(parts, torch.nn.functional.pad(x.to(device), (0, max(lengths) - len(x))))  # equal sizes
    return torch.cat([part[:n] for part, n in zip(parts, lengths)]).to(x.device)


def trainer_checksum(model: Qwen3) -> int:
    """`weights_checksum` of the trainer's whole weights: a sum, so the sum of its shards' over all ranks."""
    return int(all_ranks_sum(torch.tensor(weights_checksum(local(p) for p in model.parameters()))))


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


def packed_micro_batches(prompts: list[list[int]], completions: list[list[int]], token_budget: int, device):
    """Yields (sample indices, PackedBatch) over consecutive samples, each at most `token_budget` tokens;
    under torchrun, as many on every rank: a sharded forward is a collective that all ranks run together."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    groups = micro_batches(lengths, token_budget)
    if dist.is_initialized():
        count = torch.tensor(len(groups), device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        while len(groups) < count:  # halve the group of most samples (the sums stay the same)
            i = max(range(len(groups)), key=lambda j: len(groups[j]))
            groups[i:i + 1] = [groups[i][: len(groups[i]) // 2], groups[i][len(groups[i]) // 2:]]
    for idx in groups:
        yield idx, pack_sequences([prompts[i] for i in idx], [completions[i] for i in idx], device)


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


def correction_weights(log_ratio: torch.Tensor, lengths: list[int], args: Args):
    """Importance weights (C,) for the policy-gradient term from log(trainer / sampler) of each token
    (C,), sequences of `lengths` tokens back to back, and where the correction cut (C,): truncated
    (tis) or masked (mis). Equal logprobs give weights of exactly 1 and cut nothing."""
    if args.correction == "none":
        return torch.ones_like(log_ratio), torch.zeros_like(log_ratio, dtype=torch.bool)
    if args.correction_level == "sequence":
        # Summed one sequence at a time: a scatter-add would sum in a nondeterministic order on CUDA.
        per_sequence = torch.stack([x.sum() for x in log_ratio.split(lengths)])  # (N,)
        if args.correction_geometric_mean:
            per_sequence = per_sequence / torch.tensor(lengths, device=log_ratio.device)
        log_ratio = per_sequence.repeat_interleave(torch.tensor(lengths, device=log_ratio.device))
    weight = torch.exp(log_ratio)
    if args.correction == "tis":
        return weight.clamp(max=args.correction_max), weight > args.correction_max
    cut = (weight < args.correction_min) | (weight > args.correction_max)
    return torch.where(cut, 0.0, weight), cut


def k3_kl(logprobs, other_logprobs) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || other) from the policy's own samples:
    exp(d) - d - 1 with d = other - policy; >= 0, and 0 exactly where the logprobs are equal."""
    d = other_logprobs - logprobs
    return torch.exp(d) - d - 1


def fp32_hex(x: float) -> str:
    """The fp32 bit pattern: two logprobs one ulp apart print differently (bf16 would hide it)."""
    return f"0x{int(torch.tensor(x, dtype=torch.float32).view(torch.int32)) & 0xFFFFFFFF:08x}"


SAMPLER_PROBABILITY_BUCKETS = (0.0, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0)
"""Edges of the buckets of the sampled token's probability that the mismatch is also reported by: it
grows as the probability goes to 0."""


def mismatch_by_probability(v: torch.Tensor, t: torch.Tensor) -> dict:
    """Mean |trainer - sampler| logprob and k3 KL per bucket of the sampler's probability of the token,
    and the bucket's share of the tokens; empty buckets are left out."""
    p, metrics = v.exp(), {}
    edges = SAMPLER_PROBABILITY_BUCKETS
    for low, high in zip(edges, edges[1:]):
        tokens = (p >= low) & ((p < high) if high < 1 else (p <= high))
        if tokens.any():
            name = f"p_{low:g}-{high:g}"
            metrics[f"{name}/mean_abs_logprob_diff"] = float((v[tokens] - t[tokens]).abs().mean())
            metrics[f"{name}/vllm_kl"] = float(k3_kl(v[tokens], t[tokens]).mean())
            metrics[f"{name}/token_frac"] = float(tokens.float().mean())
    return metrics


def parity_report(vllm_logprobs: list[torch.Tensor], trainer_logprobs: list[torch.Tensor],
                  tokens: list[list[int]], show: int) -> tuple[dict, str, str | None]:
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
        "sampler_perplexity": math.exp(-float(v.mean())),
        "trainer_perplexity": math.exp(-float(t.mean())),
    } | mismatch_by_probability(v, t)
    header = ("token", "vllm logprob", "trainer logprob", "vllm fp32 bits", "trainer fp32 bits", "diff")
    lines = ["  {:>8} {:>16} {:>16} {:>14} {:>17} {:>10}".format(*header)]
    for tok, a, b in list(zip(tokens[0], vllm_logprobs[0].tolist(), trainer_logprobs[0].tolist()))[:show]:
        lines.append(f"  {tok:>8} {a:>16.9f} {b:>16.9f} {fp32_hex(a):>14} {fp32_hex(b):>17} {b - a:>10.3g}")
    lines.append(f"  Bitwise identical: {mismatched == 0}, different tokens {mismatched} / {len(v)}")
    first = None  # (message, sample, token)
    if mismatched:
        flat = int(differ.nonzero()[0])
        lens = torch.tensor([len(x) for x in vllm_logprobs]).cumsum(0)
        sample = int((lens <= flat).sum())
        token = flat - (int(lens[sample - 1]) if sample else 0)
        world = rank_and_world()[1]  # under torchrun the samples are every rank's, in rank order
        where = f" (sampled on rank {sample * world // len(tokens)})" if world > 1 else ""
        first = (f"sample {sample}{where} token {token} (id {tokens[sample][token]}): "
                 f"vLLM logprob {float(v[flat])!r} but trainer {float(t[flat])!r}; "
                 f"{mismatched} of {len(v)} sampled tokens differ", sample, token)
    return metrics, "\n".join(lines if show else lines[-1:]), first


# =============================================================================================
# Divergence locator: where the bits part, when parity breaks
# =============================================================================================

LAYER_OPS = ("residual_in", "attention_norm", "qkv", "q_norm", "k_norm", "rotary", "attention", "o_proj",
             "residual", "ffn_norm", "gate_up", "swiglu", "down")
"""A transformer block's tensors in forward order. 'residual_in' is the block's input sum (layer 0: the
embedding) and 'residual' the sum after attention: the adds vLLM fuses into the norms that follow."""
BLOCK_KERNELS = ("attention_norm", "qkv", "q_norm", "k_norm", "rotary", "attention", "o_proj", "ffn_norm",
                 "gate_up", "swiglu", "down")
"""The block's kernel calls in the trainer, in order (see `TransformerBlock.forward` and `Attention`)."""


def as_rows(x) -> torch.Tensor:
    """(T, ...) tensor, or a (q, k) pair, as (T, n) fp32 (a bf16 value and its fp32 copy have equal bits)."""
    if isinstance(x, tuple):
        return torch.cat([as_rows(t) for t in x], dim=1)
    return x.reshape(x.shape[0], -1).float()


@torch.no_grad()
def trainer_trace(model: Qwen3, tokens: list[int]) -> dict:
    """Every intermediate tensor of the trainer's forward over one sequence, and the last row's logits,
    by (layer, op): each kernel of the model records its input and output as it runs."""
    calls = []

    def recorded(fn):
        def run(x, *args, **kwargs):
            out = fn(x, *args, **kwargs)
            calls.append((x, out))
            return out
        return run

    originals = {m: m.kernels for m in model.modules() if hasattr(m, "kernels")}
    for m, kernels in originals.items():
        m.kernels = Kernels(*(recorded(getattr(kernels, k.name)) for k in dataclasses.fields(Kernels)))
    try:
        # The model's own forward (a sharded model gathers its weights for it), over all the tokens.
        model(pack_sequences([tokens[:-1]], [tokens[-1:]], model.cos_sin_cache.device))
    finally:
        for m, kernels in originals.items():
            m.kernels = kernels
    if hasattr(model, "reshard"):  # FSDP keeps the root's weights gathered for a backward; none follows
        model.reshard()
    trace, n = {}, len(BLOCK_KERNELS)
    for layer in range(model.args.n_layers):
        block = calls[layer * n: (layer + 1) * n]
        trace |= {(layer, op): as_rows(out) for op, (_, out) in zip(BLOCK_KERNELS, block)}
        trace[layer, "residual_in"], trace[layer, "residual"] = as_rows(block[0][0]), as_rows(block[7][0])
    final_residual, final_norm = calls[model.args.n_layers * n]
    trace[None, "final_residual"], trace[None, "final_norm"] = as_rows(final_residual), as_rows(final_norm)
    trace[None, "logits"] = as_rows(model.kernels.linear(final_norm[-1:], full(model.output_weight)))
    return trace


def vllm_trace(engine, tokens: list[int]) -> dict:
    """The same tensors from vLLM's served model: forward hooks on its modules during a prefill of the
    sequence (one more token sampled, which computes the last row's logits)."""
    trace, handles = {}, []

    def hook(keys, pick):  # one hook per module: a module shared by several layers fires once per layer
        keys = itertools.cycle(keys)

        def record(module, inputs, output):
            trace.setdefault(next(keys), []).append(as_rows(pick(output)).clone())
        return record

    def first(output):  # vLLM's linear layers return (output, bias), its fused add+norms (output, residual)
        return output[0] if isinstance(output, tuple) else output

    def second(output):
        return output[1]

    def register(served):
        hooks = [(served.model.embed_tokens, (0, "residual_in"), first),
                 (served.model.norm, (None, "final_norm"), first),
                 (served.model.norm, (None, "final_residual"), second),
                 (served.logits_processor, (None, "logits"), first)]
        for i, layer in enumerate(served.model.layers):
            att, mlp, post = layer.self_attn, layer.mlp, layer.post_attention_layernorm
            modules = {"attention_norm": layer.input_layernorm, "qkv": att.qkv_proj, "q_norm": att.q_norm,
                       "k_norm": att.k_norm, "attention": att.attn, "o_proj": att.o_proj, "ffn_norm": post,
                       "gate_up": mlp.gate_up_proj, "swiglu": mlp.act_fn, "down": mlp.down_proj}
            hooks += [(module, (i, op), first) for op, module in modules.items()]
            hooks += [(att.rotary_emb, (i, "rotary"), tuple), (post, (i, "residual"), second)]
            if i:
                hooks.append((layer.input_layernorm, (i, "residual_in"), second))
        # vLLM builds one rotary module and shares it among all layers, which call it in layer order.
        keys = {}
        for module, key, pick in hooks:
            keys.setdefault((module, pick), []).append(key)
        handles.extend(module.register_forward_hook(hook(k, pick)) for (module, pick), k in keys.items())

    engine.llm.apply_model(register)
    try:
        engine.generate([tokens], [1], 1.0, [0])
    finally:
        engine.llm.apply_model(lambda served: [h.remove() for h in handles])
    return {key: torch.cat(parts) for key, parts in trace.items()}  # a chunked prefill: a call per chunk


def first_divergence(trainer: dict, served: dict, n_layers: int) -> str:
    """The first tensor, in forward order, whose bits differ between the two traces."""
    keys = [(layer, op) for layer in range(n_layers) for op in LAYER_OPS]
    for key in keys + [(None, "final_residual"), (None, "final_norm"), (None, "logits")]:
        a, b = trainer[key], served[key].to(trainer[key].device)
        where = key[1] if key[0] is None else f"layer {key[0]} {key[1]}"
        if a.shape != b.shape:
            return f"{where}: shapes {tuple(a.shape)} (trainer) and {tuple(b.shape)} (vLLM)"
        differ = a.view(torch.int32) != b.view(torch.int32)
        if differ.any():
            return (f"{where}: {int(differ.sum())} of {differ.numel()} elements differ, max |delta| "
                    f"{float((a - b).abs().max()):.3g}; every tensor before it is bitwise equal")
    # The traces are of a prefill; vLLM's decode steps run their own attention (see check_bitwise_head_dim).
    return ("no intermediate tensor differs up to the logits of a prefill: the difference is in the "
            "log-softmax or in vLLM's decode steps")


def locate_divergence(engine, model: Qwen3, tokens: list[int]) -> str:
    """Runs a sequence through vLLM (hooks on its modules) and the trainer, and names the first op whose
    output bits differ."""
    return first_divergence(trainer_trace(model, tokens), vllm_trace(engine, tokens), model.args.n_layers)


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
        # Sharded, the norm comes back as this rank's part; full() makes it the norm over all ranks.
        grad_norm = full(torch.nn.utils.get_total_norm([master.grad for master in self.masters]))
        torch.nn.utils.clip_grads_with_norm_(self.masters, max_grad_norm, grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # the fp32 gradients free their memory until next step
        squares = {}  # per layer: (squared norm of the change, squared norm of the weights), this rank's
        for master, (name, p) in zip(self.masters, self.named):
            new, old = local(master).to(p.dtype).float(), local(p).float()
            layer = layer_of(name)
            squares[layer] = squares.get(layer, 0) + torch.stack([(new - old).pow(2).sum(), old.pow(2).sum()])
            p.copy_(master.to(p.dtype))
        totals = all_ranks_sum(torch.stack(list(squares.values()))).sqrt().tolist()
        deltas = {layer: (change, change / size) for layer, (change, size) in zip(squares, totals)}
        return float(grad_norm), deltas


@dataclass
class Rollouts:
    """G samples of each of P prompts, sample j of prompt i at index i * G + j."""

    prompts: list[list[int]]
    completions: list[list[int]]
    vllm_logprobs: list[torch.Tensor]  # (len(completion),) fp32 each
    rewards: torch.Tensor  # (P * G,)
    advantages: torch.Tensor  # (P * G,)


def rollout(engine, tokenizer, rows: list[dict], args: Args, step: int, stop_ids) -> Rollouts:
    """G samples of each question, each request with its own seed, scored by the GSM8K reward. Under
    torchrun, this rank's share of the questions, with the seeds they have in the whole step."""
    G = args.samples_per_prompt
    seeds = rollout_seeds(args.seed, step, len(rows) * G)
    share = rank_share(len(rows))
    rows, seeds = rows[share], seeds[share.start * G: share.stop * G]
    prompts = [r["prompt_ids"] for r in rows for _ in range(G)]
    completions, logprobs = engine.generate(prompts, [args.max_new_tokens] * len(prompts), args.temperature,
                                            seeds, stop_ids)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    rewards = torch.tensor([gsm8k_reward(text, rows[i // G]["answer"]) for i, text in enumerate(texts)])
    return Rollouts(prompts, completions, logprobs, rewards, group_advantages(rewards, G, args.std_normalize))


def reference_policy(model: Qwen3) -> Qwen3:
    """A frozen copy of the policy (for the KL term), sharded as the policy is."""
    with torch.device(model.cos_sin_cache.device):
        ref_model = Qwen3(model.args, model.kernels, model.tok_embeddings.weight.dtype).requires_grad_(False)
    with torch.no_grad():
        for p, ref in zip(model.parameters(), ref_model.parameters(), strict=True):
            ref.copy_(full(p))  # one gathered weight at a time
    return shard_model(ref_model) if dist.is_initialized() else ref_model


def whole_step(rollouts: Rollouts, trainer_logprobs: list) -> tuple[Rollouts, list]:
    """Every rank's samples of the step and their trainer logprobs, in rank order, which is the step's
    sample order: under torchrun the parity check and the metrics see the whole step, as on one GPU."""
    r = rollouts
    prompt_lens, completion_lens = (all_ranks_cat(torch.tensor([len(s) for s in seqs], dtype=torch.int64)).tolist()
                                    for seqs in (r.prompts, r.completions))

    def gathered(pieces: list, dtype: torch.dtype, lengths: list[int]) -> list[torch.Tensor]:
        return list(all_ranks_cat(torch.cat([torch.as_tensor(p, dtype=dtype) for p in pieces])).split(lengths))

    prompts = [t.tolist() for t in gathered(r.prompts, torch.int64, prompt_lens)]
    completions = [t.tolist() for t in gathered(r.completions, torch.int64, completion_lens)]
    step = Rollouts(prompts, completions, gathered(r.vllm_logprobs, torch.float32, completion_lens),
                    all_ranks_cat(r.rewards), all_ranks_cat(r.advantages))
    return step, gathered(trainer_logprobs, torch.float32, completion_lens)


@torch.no_grad()
def reference_logprobs(ref_model: Qwen3, rollouts: Rollouts, args: Args) -> list[torch.Tensor]:
    """The frozen reference policy's logprob of every sampled token (for the k3 KL term), at the same
    temperature as the policy's."""
    out = []
    device = ref_model.tok_embeddings.weight.device
    token_budget = args.max_tokens_per_microbatch
    for _, batch in packed_micro_batches(rollouts.prompts, rollouts.completions, token_budget, device):
        out += ref_model(batch, args.temperature)[0].split(batch.completion_lens)
    return out


def train_on_rollouts(model: Qwen3, optimizer: MasterWeights, rollouts: Rollouts, ref_logprobs, args: Args):
    """Forward + backward over all rollouts in micro-batches (gradients accumulated in fp32).
    The training forward's logprobs are also the ones checked against vLLM: parity costs no extra
    forward. Returns per-token means of the loss terms and the trainer's logprobs per sample."""
    device = model.cos_sin_cache.device
    n_tokens = int(all_ranks_sum(torch.tensor(sum(len(c) for c in rollouts.completions), device=device)))
    names = ("loss", "pg_loss", "kl_div", "entropy", "ratio_mean", "ratio_clipped_frac",
             "correction_weight_mean", "correction_cut_frac", "correction_weight_sq")
    sums, logprobs_all = [], []  # per micro-batch, kept on the GPU
    token_budget = args.max_tokens_per_microbatch
    for idx, batch in packed_micro_batches(rollouts.prompts, rollouts.completions, token_budget, device):
        logprobs, entropy = model(batch, args.temperature)  # (C,), (C,)
        lens = torch.tensor(batch.completion_lens, device=device)
        advantages = rollouts.advantages[idx].to(device).repeat_interleave(lens)  # a sample's on each token
        rollout_lp = torch.cat([rollouts.vllm_logprobs[i] for i in idx]).to(device)
        # With a correction, PPO's ratio is to the trainer's own logprobs at rollout time (one update per
        # batch: exactly 1), and the sampler/trainer mismatch goes into the weight instead.
        old_lp = rollout_lp if args.correction == "none" else logprobs.detach()
        pg_loss, ratio, clipped = ppo_clip_loss(logprobs, old_lp, advantages, args.clip_eps)
        weight, cut = correction_weights(logprobs.detach() - rollout_lp, batch.completion_lens, args)
        pg_loss = weight * pg_loss
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
        terms = (loss, pg_loss, kl, entropy, ratio, clipped.float(), weight, cut.float(), weight**2)
        sums.append(torch.stack([t.detach().sum() for t in terms]))
        logprobs_all.append(logprobs.detach())
    # One copy to the host for the whole step (a sync per micro-batch would stall the GPU); the
    # division happens there, exactly: CUDA divides by a scalar through its reciprocal, which would
    # turn a ratio sum of exactly n_tokens into a mean one ulp below 1.
    totals = all_ranks_sum(torch.stack(sums).sum(0)).tolist()
    metrics = {name: total / n_tokens for name, total in zip(names, totals)}
    # Effective sample size of the weights, as a fraction of the tokens: 1 when all are equal.
    weight_sq = metrics.pop("correction_weight_sq")
    metrics["correction_ess"] = metrics["correction_weight_mean"] ** 2 / weight_sq if weight_sq else 0.0
    if ref_logprobs is None:
        del metrics["kl_div"]  # not measured: no reference model
    return metrics, list(torch.cat(logprobs_all).cpu().split([len(c) for c in rollouts.completions]))


def sft_step(model: Qwen3, optimizer: MasterWeights, rows: list[dict], args: Args) -> float:
    """One supervised warm-start step: maximise the logprob of each reference answer after its
    prompt (teacher forcing, the very forward GRPO uses). Returns the mean token loss."""
    device = model.cos_sin_cache.device
    rows = rows[rank_share(len(rows))]
    prompts, answers = [r["prompt_ids"] for r in rows], [r["answer_ids"] for r in rows]
    n_tokens = int(all_ranks_sum(torch.tensor(sum(len(a) for a in answers))))
    total = 0.0
    for _, batch in packed_micro_batches(prompts, answers, args.max_tokens_per_microbatch, device):
        loss = -model(batch)[0].sum() / n_tokens
        loss.backward()
        optimizer.accumulate_grads()
        total += float(loss.detach())
    optimizer.step(args.sft_lr, args.max_grad_norm)
    return float(all_ranks_sum(torch.tensor(total, dtype=torch.float64)))


# =============================================================================================
# Evaluation
# =============================================================================================


def evaluate(engine, tokenizer, rows: list[dict], max_new_tokens: int, stop_token_ids) -> float:
    """Greedy accuracy of the served policy on GSM8K test questions (under torchrun, each rank answers
    its share)."""
    n = len(rows)
    rows = rows[rank_share(n)]
    completions, _ = engine.generate([r["prompt_ids"] for r in rows], [max_new_tokens] * len(rows), 0.0,
                                     [0] * len(rows), stop_token_ids)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    correct = sum(gsm8k_reward(text, r["answer"]) for text, r in zip(texts, rows))
    return float(all_ranks_sum(torch.tensor(correct, dtype=torch.float64))) / n


# =============================================================================================
# Checkpoints and resume
# =============================================================================================

RESUME_DIR = "training_state"
"""The checkpoint subdirectory holding what --resume needs beyond the Hugging Face files; vLLM and
transformers read only the top level, so the checkpoint stays a plain one for them."""

RUN_DEFINING_FLAGS = ("model", "dataset", "seed", "prompts_per_step", "samples_per_prompt", "max_new_tokens",
                      "max_prompt_tokens", "prompt_format", "thinking", "temperature", "kl_coef")
"""What a resumed run must share with the run it continues: the data order, the sampling seeds and
the batch shape follow from them. Other flags (learning rate, --steps, ...) may change."""


def whole(x):
    """For rank 0, which writes checkpoints: a tensor on the host, gathered from all ranks if it is
    sharded (every rank takes part; the others keep no copy, so the host holds one whatever the
    number of GPUs); anything else as it is."""
    if not torch.is_tensor(x):
        return x
    x = full(x)
    return x.contiguous().cpu() if rank_and_world()[0] == 0 else None


def like(saved: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A whole saved tensor as `target` holds it: this rank's shard when `target` is sharded."""
    if not hasattr(target, "device_mesh"):
        return saved
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(saved.to(target.device_mesh.device_type), target.device_mesh, target.placements)


def training_state(optimizer: MasterWeights, ref_model) -> tuple[dict, dict | None]:
    """What --resume needs beyond the weights, as whole tensors on rank 0's host whatever the number of
    processes (every rank of a sharded run takes part in gathering them): fp32 masters, AdamW's state,
    RNG states, and the reference policy's weights when KL is on."""
    adam = optimizer.optimizer.state_dict()
    adam["state"] = {i: {k: whole(v) for k, v in s.items()} for i, s in adam["state"].items()}
    state = {"masters": [whole(m) for m in optimizer.masters], "optimizer": adam,
             "python_rng": random.getstate(), "torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state()
    reference = None if ref_model is None else {k: whole(v) for k, v in hf_weights(ref_model)}
    return state, reference


def write_training_state(directory: Path, state: dict, reference: dict | None, args: Args, step: int) -> None:
    directory.mkdir()
    torch.save(state, directory / "state.pt")
    if reference is not None:
        save_file(reference, directory / "reference.safetensors")
    (directory / "run.json").write_text(json.dumps({"args": asdict(args), "step": step}, indent=2))


def save_checkpoint(model: Qwen3, optimizer: MasterWeights, ref_model, source_dir: Path, args: Args,
                    step: int) -> None:
    """<output_dir>/<run_name>/step_N after N GRPO steps: the Hugging Face checkpoint plus the training
    state (fp32 masters, AdamW state, RNG states, the reference policy when KL is on, the flags and the
    step, from which the data order and the sampling seeds follow). Then only the newest --keep-last
    checkpoints are kept (and the one this run resumed from)."""
    out_dir = Path(args.output_dir) / args.run_name / f"step_{step:06d}"
    # Under torchrun every rank takes part in gathering the checkpoint, and rank 0 writes it.
    weights = {k: whole(v) for k, v in hf_weights(model)}
    state, reference = training_state(optimizer, ref_model)
    if dist.is_initialized():
        # The other ranks queued their part of the gathers without waiting for them: wait until every
        # rank's have finished, so that none goes on (or exits, killing its communicator) mid-gather.
        dist.barrier()
    if rank_and_world()[0] != 0:
        return
    with atomic_directory(out_dir) as tmp:
        write_hf_checkpoint(weights, source_dir, tmp)
        write_training_state(tmp / RESUME_DIR, state, reference, args, step)
    for stale in out_dir.parent.glob(".step_*"):  # what a run killed mid-save left
        shutil.rmtree(stale)
    if args.keep_last:
        for old in sorted(out_dir.parent.glob("step_[0-9]*"))[: -args.keep_last]:
            if old.resolve() != source_dir.resolve():  # a resumed run's tokenizer files come from there
                shutil.rmtree(old)


def resume_point(args: Args) -> tuple[Args, int]:
    """The args of a resumed run (its name kept) and the step it resumes after; refuses flags that
    contradict the run it continues, naming the flag."""
    run_file = Path(args.resume) / RESUME_DIR / "run.json"
    if not run_file.is_file():
        raise ValueError(f"--resume {args.resume}: not a checkpoint of this script "
                         f"(no {RESUME_DIR}/run.json in it)")
    run = json.loads(run_file.read_text())
    for flag in RUN_DEFINING_FLAGS:
        if getattr(args, flag) != run["args"][flag]:
            name, value = flag.replace("_", "-"), getattr(args, flag)
            raise ValueError(f"--resume {args.resume}: --{name} is {value!r}, "
                             f"but the run was started with {run['args'][flag]!r}")
    if run["step"] >= args.steps:
        raise ValueError(f"--resume {args.resume}: the run is at step {run['step']} already; "
                         "pass a larger --steps to train on")
    return dataclasses.replace(args, run_name=args.run_name or run["args"]["run_name"]), run["step"]


def restore_training_state(checkpoint: Path, optimizer: MasterWeights, ref_model, args: Args) -> None:
    """Put back what `save_checkpoint` saved beside the weights (which the model loaded already)."""
    # Loaded to the host: AdamW moves its moments to the masters' device, and keeps its step counts on
    # the host, as in a run that never stopped.
    state = torch.load(checkpoint / RESUME_DIR / "state.pt", map_location="cpu", weights_only=True)
    with torch.no_grad():
        for master, saved in zip(optimizer.masters, state["masters"], strict=True):
            master.copy_(like(saved, master))
    adam = state["optimizer"]  # whole tensors: a run may resume on another number of GPUs
    adam["state"] = {i: {k: like(v, optimizer.masters[i]) if torch.is_tensor(v) and v.dim() else v
                         for k, v in s.items()} for i, s in adam["state"].items()}
    optimizer.optimizer.load_state_dict(adam)
    for group in optimizer.optimizer.param_groups:
        group["weight_decay"] = args.weight_decay  # may change on resume; the lr is set every step
    random.setstate(state["python_rng"])
    torch.set_rng_state(state["torch_rng"].cpu())
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng"].cpu())
    if ref_model is not None:
        device = str(ref_model.cos_sin_cache.device)
        reference = load_file(checkpoint / RESUME_DIR / "reference.safetensors", device=device)
        saved = from_hf_state_dict(reference, ref_model.args)
        with torch.no_grad():
            for name, p in ref_model.named_parameters():
                p.copy_(like(saved[name], p))


# =============================================================================================
# main
# =============================================================================================


class UsageError(Exception):
    """Bad flags, files or environment: reported as one line, exit status 2."""


class ParityError(Exception):
    """A sampled token whose trainer logprob is not bitwise vLLM's (exit status 1)."""


def stop_token_ids(tokenizer, model_dir: Path) -> list[int]:
    eos = json.loads((model_dir / "config.json").read_text()).get("eos_token_id")
    ids = {tokenizer.eos_token_id} | set(eos if isinstance(eos, list) else [eos])
    ids.discard(None)
    if not ids:
        raise ValueError(f"{model_dir}: neither the tokenizer nor config.json names an end-of-sequence token")
    return sorted(ids)


@dataclass
class Inputs:
    """Everything read before the engine starts: a bad input fails before anything slow."""

    model_dir: Path  # the checkpoint both sides load: --model, or the one --resume continues from
    model_args: Qwen3ModelArgs  # its shape
    start_step: int  # GRPO steps already made: 0, or the resumed checkpoint's step
    tokenizer: object
    stop_ids: list[int]
    train_rows: list[dict]
    eval_rows: list[dict]


def load_inputs(args: Args) -> tuple[Args, Inputs]:
    """The checkpoint checked, the tokenizer and the data loaded; with --resume, the args of the run it
    continues. Returns the args and the inputs."""
    from transformers import AutoTokenizer

    start_step = 0
    if args.resume:
        args, start_step = resume_point(args)
    model_dir = Path(args.resume) if args.resume else resolve_model_dir(args.model)
    model_args = model_args_from_hf_config(json.loads((model_dir / "config.json").read_text()))
    check_checkpoint(model_dir, model_args)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:
        raise ValueError(f"--model {model_dir}: cannot load its tokenizer "
                         f"({type(e).__name__}: {str(e).splitlines()[0]})") from e
    # transformers makes a 1-token tokenizer from a directory without tokenizer files.
    if not 1 < len(tokenizer) <= model_args.vocab_size:
        raise ValueError(f"--model {model_dir}: its tokenizer has {len(tokenizer)} tokens for a vocabulary "
                         f"of {model_args.vocab_size} (tokenizer files missing, or from another model)")
    train_rows = encode_dataset(load_gsm8k(args.dataset, "train"), tokenizer, args, "train set")
    eval_rows = []
    if args.eval_every:
        eval_rows = encode_dataset(load_gsm8k(args.eval_dataset, "test"), tokenizer, args, "eval set")
    return args, Inputs(model_dir, model_args, start_step, tokenizer, stop_token_ids(tokenizer, model_dir),
                        train_rows, eval_rows[: args.eval_samples])


def gpu_memory_in_use_gib() -> float:
    """GPU memory in use on the whole device (what nvidia-smi shows): vLLM's, the trainer's and the
    CUDA context's. At the end of a phase it is that phase's peak: PyTorch's caching allocator
    keeps what it reserved until `torch.cuda.empty_cache()`."""
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


@contextmanager
def phase(name: str, times: dict, memory: dict):
    """Time a phase of the step, its queued GPU work included, and record the memory in use at its end."""
    start = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        memory[name] = gpu_memory_in_use_gib()
    times[name] = time.perf_counter() - start


def open_tensorboard(args: Args, start_step: int):
    """runs/<run_name>. A resumed run continues it: events a killed run logged after its checkpoint
    are purged, so no step appears twice."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(Path("runs") / args.run_name), purge_step=start_step or None)
    rows = [f"| {k} | {v} |" for k, v in asdict(args).items()]
    rows.append(f"| VLLM_BATCH_INVARIANT | {int(batch_invariant_enabled())} |")
    writer.add_text("config", "| flag | value |\n|---|---|\n" + "\n".join(rows), start_step)
    return writer


def warm_start(model: Qwen3, inputs: Inputs, order: list[int], args: Args) -> None:
    """--sft-steps of teacher forcing on reference answers (with their own optimizer state). Logged
    as TensorBoard run <run_name>/warm_start: its steps are not GRPO's, and a resumed run, which
    skips the warm start, must not purge them."""
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    # Answers follow the prompt as the model should write them, then the tokenizer's end of sequence
    # (Qwen3's chat format ends a turn with <|im_end|>).
    prefix = " " if args.prompt_format == "plain" or inputs.tokenizer.chat_template is None else ""
    for r in inputs.train_rows:
        answer = inputs.tokenizer.encode(prefix + r["answer"], add_special_tokens=False)
        r["answer_ids"] = answer + [inputs.tokenizer.eos_token_id or inputs.stop_ids[0]]
    optimizer = MasterWeights(model, args.sft_lr, args.weight_decay)
    first = rank_and_world()[0] == 0  # logs for all ranks
    writer = SummaryWriter(str(Path("runs") / args.run_name / "warm_start")) if first else None
    for step in tqdm(range(args.sft_steps), desc="warm start", unit="step", file=sys.stdout,
                     disable=not first):
        rows = step_rows(inputs.train_rows, order, step, args.sft_batch_size)
        loss = sft_step(model, optimizer, rows, args)
        if writer:
            writer.add_scalar("sft/loss", loss, step)
    if writer:
        writer.close()


def log_step(writer, step: int, scalars: dict, line: str) -> None:
    """The one place a GRPO step is logged: TensorBoard scalars, and one line on the terminal (by rank 0
    alone under torchrun: the other ranks have no writer)."""
    from tqdm import tqdm

    if writer is None:
        return
    for key, value in scalars.items():
        writer.add_scalar(key, value, step)
    tqdm.write(line)


def step_scalars(rollouts: Rollouts, loss_metrics: dict, parity: dict, grad_norm: float, lr: float,
                 deltas: dict, times: dict, memory: dict) -> dict:
    n_generated = sum(len(c) for c in rollouts.completions)
    scalars = {f"train/{k}": v for k, v in loss_metrics.items()} | {
        "train/grad_norm": grad_norm, "train/lr": lr,
        "reward/reward_mean": float(rollouts.rewards.mean()),
        "reward/reward_std": float(rollouts.rewards.std()),
        "reward/completion_tokens_mean": n_generated / len(rollouts.completions),
        "perf/generate_tokens_per_s": n_generated / times["generate"],
        "perf/train_tokens_per_s": n_generated / times["train"],
    }
    scalars |= {f"parity/{k}": v for k, v in parity.items()}
    scalars |= {f"time/{k}": v for k, v in times.items()} | {f"memory/{k}_gib": v for k, v in memory.items()}
    for layer, (magnitude, relative) in deltas.items():
        scalars[f"weight_delta/{layer}/magnitude"] = magnitude
        scalars[f"weight_delta/{layer}/relative_change"] = relative
    return scalars


def check_parity(engine, model: Qwen3, rollouts: Rollouts, trainer_logprobs: list, served_checksum: int,
                 args: Args, step: int, writer) -> tuple[dict, int]:
    """The step's parity report. On a mismatch, with --assert-bitwise or --locate-divergence, vLLM is
    woken with the weights that sampled (the update has not happened) and the first diverging op of
    the first mismatching sample is found; --assert-bitwise then stops the run. Returns the parity
    metrics and the served checksum."""
    from tqdm import tqdm

    parity, report, first = parity_report(rollouts.vllm_logprobs, trainer_logprobs, rollouts.completions,
                                          args.parity_report_tokens)
    heading = f"step {step} parity (first tokens of sample 0):\n" if args.parity_report_tokens else ""
    if writer:  # rank 0 prints; every rank sees the same whole step, so all locate and stop together
        tqdm.write(heading + report)
    if first and (args.assert_bitwise or args.locate_divergence):
        message, sample, token = first
        served_checksum = sync_weights(engine, model, served_checksum, changed=False)
        # The sequence up to the mismatching token: its last row's logits predict that token.
        tokens = rollouts.prompts[sample] + rollouts.completions[sample][:token]
        try:
            where = locate_divergence(engine, model, tokens)
        except Exception as e:  # a diagnostic must not hide the error it diagnoses
            where = f"not found, the locator failed ({type(e).__name__}: {e})"
        message = f"step {step}: {message}; first divergence: {where}"
        if args.assert_bitwise:
            log_step(writer, step, {f"parity/{k}": v for k, v in parity.items()}, "parity broken")
            raise ParityError(message)
        if writer:
            tqdm.write(message)
        engine.sleep()  # the trainer goes on
    return parity, served_checksum


def grpo(args: Args, engine, model: Qwen3, inputs: Inputs, order: list[int], writer, served_checksum: int):
    """The GRPO loop: vLLM samples while the trainer's weights wait in memory; vLLM sleeps while the
    trainer trains; then the new weights wake vLLM up."""
    from tqdm import tqdm

    def log_eval(updates: int) -> None:  # logged at the number of GRPO updates made so far
        accuracy = evaluate(engine, inputs.tokenizer, inputs.eval_rows, args.max_new_tokens, inputs.stop_ids)
        if writer:
            writer.add_scalar("eval/accuracy", accuracy, updates)
            tqdm.write(f"after {updates} GRPO steps: greedy accuracy {accuracy:.3f} "
                       f"on {len(inputs.eval_rows)} test questions")

    # The reference policy (for KL) is the policy GRPO starts from.
    ref_model = reference_policy(model) if args.kl_coef > 0 else None
    optimizer = MasterWeights(model, args.lr, args.weight_decay)
    if inputs.start_step:
        restore_training_state(inputs.model_dir, optimizer, ref_model, args)
    # Before training; and where a resumed run starts, if an evaluation was due there: TensorBoard
    # drops whatever the interrupted run logged from its checkpoint's step on.
    if args.eval_every and inputs.start_step % args.eval_every == 0:
        log_eval(inputs.start_step)
    steps = range(inputs.start_step, args.steps)
    for step in tqdm(steps, desc="GRPO", unit="step", file=sys.stdout, initial=steps.start, total=args.steps,
                     disable=writer is None):
        times, memory = {}, {}
        with phase("generate", times, memory):
            rows = step_rows(inputs.train_rows, order, step, args.prompts_per_step)
            rollouts = rollout(engine, inputs.tokenizer, rows, args, step, inputs.stop_ids)
        with phase("train", times, memory):
            engine.sleep()
            ref_lps = None
            if ref_model is not None:
                ref_lps = reference_logprobs(ref_model, rollouts, args)
            loss_metrics, trainer_logprobs = train_on_rollouts(model, optimizer, rollouts, ref_lps, args)
            rollouts, trainer_logprobs = whole_step(rollouts, trainer_logprobs)  # every rank's samples
            parity, served_checksum = check_parity(engine, model, rollouts, trainer_logprobs, served_checksum,
                                                   args, step, writer)
            lr = lr_at(step, args)
            grad_norm, deltas = optimizer.step(lr, args.max_grad_norm)
        with phase("push", times, memory):
            changed = any(magnitude for magnitude, _ in deltas.values())
            served_checksum = sync_weights(engine, model, served_checksum, changed)
        scalars = step_scalars(rollouts, loss_metrics, parity, grad_norm, lr, deltas, times, memory)
        line = (f"step {step}: reward {scalars['reward/reward_mean']:.3f} loss {loss_metrics['loss']:+.5f} "
                f"ratio {loss_metrics['ratio_mean']:.6f} grad {grad_norm:.3f} | "
                + " ".join(f"{k} {v:.2f}s" for k, v in times.items()))
        log_step(writer, step, scalars, line + (f" | GPU {max(memory.values()):.1f} GiB" if memory else ""))
        last = step == args.steps - 1
        if args.eval_every and ((step + 1) % args.eval_every == 0 or last):
            log_eval(step + 1)
        if (args.save_every and (step + 1) % args.save_every == 0) or last:
            if writer:  # TensorBoard holds every step up to the checkpoint, should the run die after it
                writer.flush()
            save_checkpoint(model, optimizer, ref_model, inputs.model_dir, args, step + 1)


def main(args: Args, device: str = "cuda", engine_class=None) -> Path:
    """Train; returns the run's TensorBoard directory. `engine_class` replaces vLLM in CPU tests."""
    try:
        args, inputs = load_inputs(validate(args))
        if engine_class is None:  # vLLM's attention kernels (the CPU tests' stand-in engine has none)
            check_bitwise_head_dim(inputs.model_args, args, inputs.model_dir)
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("no CUDA GPU found: simple_rl.py runs vLLM and the trainer on a GPU")
        world = init_distributed(device)
        seed_everything(args.seed)
        # Under torchrun, every rank runs its own engine on its own GPU, in its process: vLLM's external
        # launcher with no data parallelism of vLLM's own. Each rank is then one of what vLLM calls its
        # external data-parallel ranks: its engine samples alone and never waits for the others'.
        parallel = {"distributed_executor_backend": "external_launcher"}
        # vLLM first: it claims --vllm-gpu-memory of a GPU that is still empty.
        engine = (engine_class or VLLMEngine)(inputs.model_dir, args.vllm_gpu_memory,
                                              args.max_prompt_tokens + args.max_new_tokens, args.seed,
                                              cuda_graphs=args.vllm_cuda_graphs,
                                              **(parallel if world > 1 else {}))
        model = load_qwen3(inputs.model_dir, device, activation_checkpointing=args.activation_checkpointing)
        if world > 1:
            shard_model(model)
    except ValueError as e:
        raise UsageError(str(e)) from e
    served_checksum = engine.weights_checksum()
    if served_checksum != trainer_checksum(model):
        raise UsageError(f"vLLM serves other weights than the trainer loaded from {inputs.model_dir} "
                         "(is it a bf16 Qwen3 checkpoint?)")
    writer = open_tensorboard(args, inputs.start_step) if rank_and_world()[0] == 0 else None  # rank 0 logs
    order = list(range(len(inputs.train_rows)))
    random.Random(args.seed).shuffle(order)
    if args.sft_steps and not args.resume:  # a resumed run's weights are warm already
        engine.sleep()
        warm_start(model, inputs, order, args)
        served_checksum = sync_weights(engine, model, served_checksum, changed=True)
    try:
        grpo(args, engine, model, inputs, order, writer, served_checksum)
    finally:
        if writer:
            writer.close()  # also on a parity error: the failing step's parity scalars reach the disk
    return Path("runs") / args.run_name


if __name__ == "__main__":
    try:
        main(parse_command_line())
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except ParityError as e:
        print(f"error: bitwise parity broken at {e}", file=sys.stderr)
        sys.exit(1)
