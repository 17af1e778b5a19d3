"""Bitwise-exact on-policy GRPO: Qwen3 on GSM8K, rollouts from vLLM, training on a TorchTitan-style Qwen3
that runs vLLM's own kernels. On every GPU the two take turns.

    VLLM_BATCH_INVARIANT=1 python simple_rl.py      # Qwen3-1.7B, GSM8K: the hub
    VLLM_BATCH_INVARIANT=1 python simple_rl.py --model DIR --dataset JSONL ...
    VLLM_BATCH_INVARIANT=1 torchrun --nproc-per-node N simple_rl.py ...
    VLLM_BATCH_INVARIANT=1 python simple_rl.py --resume checkpoints/RUN/step_N
    python simple_rl.py --no-assert-bitwise   # off: the mismatch is reported

Asserted on every sampled token unless --no-assert-bitwise: the trainer's fp32 logprob equals, bit for bit,
the one vLLM returned when it sampled the token, whatever either side's batch (the importance ratio is exactly
1, the k3 KL 0). It holds with VLLM_BATCH_INVARIANT=1 on vLLM 0.20.0 (FlashAttention 3, CUDA graphs, no
torch.compile), whose kernels are swapped in-process, in engine and trainer alike, where 0.20's are not
batch-invariant (fused add+RMSNorm, top-k/top-p) or slower than need be for the same bits (matmul, RMSNorm,
log-softmax); its sampler draws every request's seeded noise in one kernel, not one launch per request.

How this GRPO departs from the paper (Shao et al., 2024):
1. One optimizer step per batch of rollouts (on-policy); PPO-clip kept, to measure sampler/trainer mismatch.
2. The loss is averaged over all completion tokens of the step (token-level, as in DAPO).
3. k3 KL to the frozen reference in the loss (coefficient 0 by default: no reference model); entropy bonus.
4. Advantages (r - mean) / (std + 1e-4), unbiased group std; --no-std-normalize: r - mean (Dr. GRPO).
5. An optional supervised warm start (--sft-steps) on the train set's reference answers.
6. The policy trained is the one sampled: softmax(logits / T), restricted to what --top-k and --top-p keep.
"""

import array
import dataclasses
import errno
import gc
import io
import itertools
import json
import math
import os
import random
import re
import shutil
import sys
import textwrap
import time
import typing
from contextlib import contextmanager, nullcontext, redirect_stderr, suppress
from dataclasses import asdict, dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Literal, NamedTuple

import tyro

# ===== Config: every flag; a field's comment is its --help =====
FIXED = "fixed on resume"  # a flag a resume may not change: data order, seeds, batch shape, reference follow


def default_is(what: str):  # --help's "(default: ...)" for a flag whose None stands for something
    return tyro.conf.arg(help_behavior_hint=f"(default: {what})")


@dataclass
class Data:
    """The model, the data and the seed."""
    model: Annotated[str, FIXED] = "Qwen/Qwen3-1.7B"  # Qwen3 hub id, or local directory (config, safetensors)
    # local train jsonl (question, answer)
    dataset: Annotated[str | None, FIXED, default_is("openai/gsm8k 'main' train, from the hub")] = None
    eval_dataset: Annotated[str | None, default_is("openai/gsm8k 'main' test")] = None  # local test jsonl
    # 'chat': the tokenizer's chat template; 'plain': 'Question: ...', then 'Answer:'; 'auto': chat if any
    prompt_format: Annotated[Literal["auto", "chat", "plain"], FIXED] = "auto"
    thinking: Annotated[bool, FIXED] = False  # let Qwen3's chat template open a <think> block (long answers)
    max_prompt_tokens: Annotated[int, FIXED] = 512  # longer prompts are skipped (counted at start), never cut
    seed: Annotated[int, FIXED] = 0  # seed of the data order, the sampling and the trainer


@dataclass
class Sampling:
    """What vLLM samples each step: the policy trained is the distribution it samples from."""
    prompts_per_step: Annotated[int, FIXED] = 32  # GSM8K questions per step
    samples_per_prompt: Annotated[int, FIXED] = 8  # G: completions per question, advantages normalised over
    max_new_tokens: Annotated[int, FIXED] = 512  # completion length limit
    temperature: Annotated[float, FIXED] = 1.0  # the policy is softmax(logits / T), exact at any T
    top_k: Annotated[int, FIXED] = 0  # sample among the k likeliest tokens only (vLLM's top-k); 0 keeps all
    top_p: Annotated[float, FIXED] = 1.0  # sample among the likeliest tokens of probability p (vLLM's); 1 all


@dataclass
class Loss:
    """The GRPO loss, and the corrections for runs whose sampler and trainer differ."""
    clip_eps: float = 0.2  # PPO clip range of the token ratio
    kl_coef: Annotated[float, FIXED] = 0.0  # k3 KL-to-reference coefficient; 0 skips the reference model
    entropy_coef: float = 0.0  # entropy bonus coefficient
    std_normalize: bool = True  # divide group advantages by the group std
    # where sampler and trainer differ (batch invariance off): weight the policy gradient by w = trainer /
    # sampler probability, truncated at --correction-max ('tis') or zeroed outside [--correction-min,
    # --correction-max] ('mis'); 'none' clips the ratio to the sampler (PPO)
    correction: Literal["none", "tis", "mis"] = "none"
    correction_level: Literal["token", "sequence"] = "sequence"  # a weight per token, or per sequence (sums)
    correction_min: float = 0.5  # mis: the smallest weight kept
    correction_max: float = 2.0  # tis: where weights are truncated; mis: the largest weight kept
    correction_geometric_mean: bool = False  # sequence: exp(mean log-ratio), not exp(sum): fits any length


@dataclass
class Optimizer:
    """AdamW on fp32 master weights, and its schedule."""
    steps: int = 200  # optimizer steps (one batch of rollouts each)
    lr: float = 1e-6  # peak AdamW learning rate
    warmup_steps: int = 10  # linear warm-up, then cosine decay (a shorter run warms up over all its steps)
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping threshold (global L2 norm)


@dataclass
class WarmStart:
    """An optional supervised warm start before GRPO."""
    sft_steps: int = 0  # steps of teacher forcing on the train set's reference answers before GRPO; 0: none
    sft_lr: float = 1e-4  # constant AdamW learning rate of the warm start
    sft_batch_size: int = 64  # questions per warm-start step


@dataclass
class Parity:
    """The bitwise check of every sampled token."""
    assert_bitwise: bool = True  # abort at the first sampled token whose trainer logprob differs from vLLM's
    parity_report_tokens: int = 4  # first tokens of sample 0 printed each step, both logprobs; 0: summary
    locate_divergence: bool = False  # with --no-assert-bitwise: at each mismatch, the first op to differ


@dataclass
class Engine:
    """vLLM and the trainer share a GPU. On an H100 the 4B and 8B need --offload-optimizer (README)."""
    vllm_gpu_memory: float = 0.5  # share of the GPU vLLM holds while generating (weights, KV cache, graphs)
    vllm_cuda_graphs: bool = True  # decode steps as CUDA graphs (no torch.compile: same bits as eager)
    max_tokens_per_microbatch: int = 8192  # packed tokens per trainer forward + backward (activation memory)
    activation_checkpointing: bool = False  # recompute each layer in the backward: less memory, ~1/3 slower
    offload_optimizer: bool = False  # fp32 masters, AdamW (12 bytes a parameter) in host memory; AdamW on CPU


@dataclass
class Run:
    """Evaluation, TensorBoard, checkpoints and resuming."""
    eval_every: int = 20  # greedy GSM8K accuracy before training, every N steps and at the end; 0 disables
    eval_samples: int = 256  # test questions per evaluation
    # names runs/<run-name> and <output-dir>/<run-name>
    run_name: Annotated[str | None, default_is("grpo_<date>_<time>")] = None
    output_dir: str = "checkpoints"  # where checkpoints are written
    save_every: int = 0  # checkpoint every N steps and after the last; 0: after the last only; -1: never
    keep_last: int = 3  # checkpoints of the run kept on disk, the newest; 0 keeps all
    verbose: bool = False  # show vLLM's, torch's and DCP's logs live too (all go to runs/<run-name>/log.txt)
    # a checkpoint (<output-dir>/<run-name>/step_N) to continue its run from, with its saved flags; flags
    # given too may change what a resume may (learning rate, steps, logging, checkpoints). Bit for bit on
    # as many GPUs; on another count, the state is restored exactly but gradients sum in another order
    resume: Annotated[str | None, default_is("a new run")] = None


@dataclass
class Args:
    data: Data = field(default_factory=Data)
    sampling: Sampling = field(default_factory=Sampling)
    loss: Annotated[Loss, tyro.conf.arg(name="grpo_loss")] = field(default_factory=Loss)
    optimizer: Optimizer = field(default_factory=Optimizer)
    warm_start: WarmStart = field(default_factory=WarmStart)
    parity: Parity = field(default_factory=Parity)
    engine: Annotated[Engine, tyro.conf.arg(name="engine_and_memory")] = field(default_factory=Engine)
    run: Annotated[Run, tyro.conf.arg(name="evaluation_and_checkpoints")] = field(default_factory=Run)


# The range of every number, checked as the flags are parsed (the other checks follow the Plumbing banner).
RANGES = {"at least 1": ("steps", "prompts_per_step", "max_new_tokens", "max_prompt_tokens", "sft_batch_size",
                         "eval_samples"),
          ">= 0": ("seed", "top_k", "warmup_steps", "weight_decay", "kl_coef", "entropy_coef", "sft_steps",
                   "parity_report_tokens", "eval_every", "keep_last"),
          "> 0": ("temperature", "lr", "sft_lr", "max_grad_norm", "clip_eps")}
TERMINAL = sys.stderr  # the script's errors; others' logs go to runs/<run>/log.txt once training starts


class UsageError(Exception):
    """Bad flags, files or environment: reported as one line, exit status 2, before anything slow."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def torchrun_rank_and_size() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def saved_run(checkpoint: Path) -> tuple[Args, int]:
    """The flags a checkpoint's run was started with, and its step."""
    run_file = checkpoint / "training_state" / "run.json"
    if not run_file.is_file():
        what = ("not a checkpoint of this script (no training_state/run.json)" if checkpoint.is_dir()
                else "a file, not a checkpoint directory" if checkpoint.exists() else "no such directory")
        raise UsageError(f"--resume {checkpoint}: {what}")
    try:
        run = json.loads(run_file.read_text(encoding="utf-8"))
        groups = {f.name: f.default_factory(**run["args"][f.name]) for f in dataclasses.fields(Args)}
        step = run["step"]
    except ValueError as e:  # not JSON, not UTF-8
        raise UsageError(f"--resume {checkpoint}: {run_file} is broken ({e}); use an earlier one") from None
    except (KeyError, TypeError):
        raise UsageError(f"--resume {checkpoint}: written by another version of simple_rl.py (its flags "
                         "differ); resume it with that version") from None
    also = {float: (int, float), type(None): (str,)}  # a float saved as 1; a name or path (default None)
    typed = [flag(f.name) for g in groups.values() for f in dataclasses.fields(g) if not isinstance(
             getattr(g, f.name), (type(None), *also.get(type(f.default), [type(f.default)])))]
    if typed or type(step) is not int or step < 0:
        raise UsageError(f"--resume {checkpoint}: {run_file} holds a wrong value: {', '.join(typed) or step}")
    return Args(**groups), step


def tyro_cli(**options) -> Args:
    """tyro's parse; its boxed error (a mistyped flag or value) made one line, with the flags it names."""
    try:
        with redirect_stderr(boxed := io.StringIO()):
            return tyro.cli(Args, **options)
    except SystemExit as ended:  # status 0: --help printed its text
        rows = [re.sub("[\u2500-\u257f]", "", r).strip() for r in boxed.getvalue().splitlines()] + ["", ""]
        flags = ", ".join(row for row in rows if row.startswith("--")) or "--help"
        raise ended if not ended.code else UsageError(f"{' '.join(rows[1:rows.index('', 1)])} (see {flags})")


def parse_command_line(argv: list[str] | None = None) -> Args:
    """The flags, each number in its range; with --resume, the run's saved flags overridden by those given."""
    setting = ("Set VLLM_BATCH_INVARIANT=1 in the environment: vLLM reads it at import, and without it the "
               "logprobs cannot be bitwise equal.")
    about, setting = (textwrap.fill(" ".join(text.split()), 78, initial_indent="  ", subsequent_indent="  ")
                      for text in (__doc__.split("\n\n")[0], setting))
    options = dict(args=argv, config=(tyro.conf.OmitArgPrefixes, tyro.conf.DisallowNone),
                   description=f"{about}\n\n{__doc__.split(chr(10) * 2)[1]}\n\n{setting}")  # indented: kept
    args = tyro_cli(**options)
    if args.run.resume is not None:
        args = tyro_cli(default=saved_run(Path(args.run.resume))[0], **options)
    values = {name: value for group in asdict(args).values() for name, value in group.items()}
    for name, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag(name)} must be a finite number")
    holds = {"at least 1": lambda x: x >= 1, ">= 0": lambda x: x >= 0, "> 0": lambda x: x > 0}
    for rule, names in RANGES.items():
        for name in names:
            if not holds[rule](values[name]):
                raise UsageError(f"{flag(name)} must be {rule}")
    return args


def exit_on(error: Exception, status: int) -> None:
    """The one way out on an error: a line on stderr (from rank 0 alone under torchrun), and the status."""
    if torchrun_rank_and_size()[0] == 0:
        print(f"error: {error}", file=TERMINAL)
    if "TORCHELASTIC_ERROR_FILE" in os.environ:  # torchrun's summary then names this line as the root cause
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
        ErrorHandler().record_exception(SystemExit(f"error: {error}"))
    sys.exit(status)


if __name__ == "__main__":  # before torch and vLLM load (seconds): --help and a bad flag answer at once
    try:
        COMMAND_LINE = parse_command_line()
    except UsageError as e:
        exit_on(e, 2)

import torch  # noqa: E402  (after the flags: see above)
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from batch_invariant_backward import (  # noqa: E402
    CUDA_GRAPHS, EXACT, SAMPLED, Kernels, _num_sms, check_bitwise_head_dim, first_divergence,
    install_exact_kernels, matmul_tiles, micro_batch_bytes, qwen3_gemms, restore_block_table_pointers,
    rope_cos_sin_cache, trainer_trace, vllm_trace)


# ===== The processes: one, or torchrun's =====
@dataclass(frozen=True)
class World:
    """Rank and size under torchrun; alone, rank 0 of 1 (even in vLLM's group of one): collectives skip."""
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:  # logs, prints and writes what is written once
        return self.rank == 0

    def share(self, n: int) -> slice:  # this rank's consecutive share of n items (n a multiple of size)
        return slice(self.rank * n // self.size, (self.rank + 1) * n // self.size)

    def _device(self) -> str:
        return "cuda" if dist.get_backend() == "nccl" else "cpu"

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        dist.all_reduce(y := x.to(self._device(), copy=True))
        return y.to(x.device)

    def max(self, n: int) -> int:
        if self.size == 1:
            return n
        dist.all_reduce(x := torch.tensor(n, device=self._device()), op=dist.ReduceOp.MAX)
        return int(x)


def rollout_seeds(seed: int, step: int, n: int) -> list[int]:
    """One sampling seed per request, unique over the run: completions depend on nothing else."""
    return [seed * 1_000_000_000 + step * n + j for j in range(n)]


# ===== Data and reward =====
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# A completion's answer: the first '#### N' (GSM8K's format), else the first '\boxed{N}', else its last
# number; after a closed <think>, the one after it, else inside. Compared as decimals: '1,000' = '$1000.0'.
ANSWER_AFTER_HASHES = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
ANSWER_IN_BOX = re.compile(r"\\boxed\{\s*\$?\s*(-?[\d,]*\.?\d+)\s*\}")
ANY_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def extract_answer(text: str) -> str | None:
    thoughts, closed, answer = text.rpartition("</think>")
    if closed and (after := extract_answer(answer)) is not None:
        return after
    text = thoughts or text
    for pattern in (ANSWER_AFTER_HASHES, ANSWER_IN_BOX):
        if match := pattern.search(text):
            return match.group(1)
    numbers = ANY_NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: str | None) -> Decimal | None:
    try:
        return None if text is None else Decimal(text.replace(",", "").rstrip("."))
    except InvalidOperation:
        return None


def gsm8k_reward(completion: str, reference_answer: str) -> float:
    predicted, expected = (parse_number(extract_answer(text)) for text in (completion, reference_answer))
    return float(predicted is not None and expected is not None and predicted == expected)


def encode_prompt(tokenizer, question: str, use_chat: bool, thinking: bool) -> list[int]:
    content = f"{question}\n{INSTRUCTION}"
    if not use_chat:
        return tokenizer.encode(f"Question: {content}\nAnswer:")
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False, enable_thinking=thinking)


def encode_dataset(rows, tokenizer, data: Data) -> list[dict]:
    """Tokenise every question once; prompts over --max-prompt-tokens are skipped, never cut."""
    use_chat = data.prompt_format != "plain" and tokenizer.chat_template is not None
    encoded = [dict(r, prompt_ids=encode_prompt(tokenizer, r["question"], use_chat, data.thinking))
               for r in rows]
    return [r for r in encoded if len(r["prompt_ids"]) <= data.max_prompt_tokens]


def step_rows(rows: list[dict], order: list[int], step: int, n: int) -> list[dict]:
    return [rows[order[(step * n + i) % len(order)]] for i in range(n)]


# ===== Model: Qwen3 on vLLM's kernels, over packed sequences =====
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
    # The host's share of a step, before the GPU has work: one pass over Python's ints, then tensor ops.
    token_ids = itertools.chain.from_iterable(itertools.chain.from_iterable(zip(prompts, completions)))
    tokens = torch.frombuffer(array.array("q", token_ids), dtype=torch.long)
    prompt_lens, completion_lens = torch.tensor([len(p) for p in prompts]), [len(c) for c in completions]
    seqlens = prompt_lens + torch.tensor(completion_lens)
    positions = torch.arange(len(tokens)) - (seqlens.cumsum(0) - seqlens).repeat_interleave(seqlens)
    in_completion = positions >= prompt_lens.repeat_interleave(seqlens)
    return PackedBatch(tokens=tokens.to(device), positions=positions.to(device),
                       cu_seqlens=F.pad(seqlens.cumsum(0), (1, 0)).to(device, torch.int32),
                       max_seqlen=int(seqlens.max()),
                       # Row t's logits predict token t + 1: a completion token is read a row before its own.
                       target_rows=(in_completion.nonzero().squeeze(1) - 1).to(device),
                       targets=tokens[in_completion].to(device), completion_lens=completion_lens)


def bins(sizes, budget: int) -> list[list[int]]:
    """Consecutive items in bins of at most `budget` in all (an item larger than that alone)."""
    groups, size = [], 0
    for i, n in enumerate(sizes):
        if not groups or size + n > budget:
            groups, size = [*groups, []], 0
        groups[-1].append(i)
        size += n
    return groups


def packed_micro_batches(prompts, completions, token_budget: int, device, world: World = World()) -> list:
    """[(indices, PackedBatch)] of <= `token_budget` tokens in sample order, as many on every rank."""
    groups = bins([len(p) + len(c) for p, c in zip(prompts, completions)], token_budget)
    count = world.max(len(groups))
    while len(groups) < count:  # halve the group of most samples (the sums stay the same)
        i = max(range(len(groups)), key=lambda j: len(groups[j]))
        groups[i:i + 1] = [groups[i][: len(groups[i]) // 2], groups[i][len(groups[i]) // 2:]]
    return [(idx, pack_sequences([prompts[i] for i in idx], [completions[i] for i in idx], device))
            for idx in groups]


# Each forward runs the kernels vLLM 0.20 runs for the module in eager batch-invariant mode (CUDA graphs
# replay the same), in the same order and dtypes; KERNEL_CALLS names them in order for the locator.
class Attention(nn.Module):
    KERNEL_CALLS = ("qkv", "q_norm", "k_norm", "rotary", "attention", "o_proj")

    def __init__(self, args, kernels: Kernels):
        super().__init__()
        self.args, self.kernels = args, kernels
        # One merged [q; k; v] projection, as vLLM's QKVParallelLinear serves it.
        self.wqkv = nn.Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)

    def forward(self, x, positions, cos_sin_cache, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        ops, a = self.kernels, self.args
        T, H, Hk, D = x.shape[0], a.n_heads, a.n_kv_heads, a.head_dim
        q, k, v = ops.linear(x, self.wqkv.weight).split([H * D, Hk * D, Hk * D], dim=-1)
        q = ops.rms_norm(q.reshape(T, H, D), self.q_norm.weight, a.norm_eps)  # per-head norm (T, H, D)
        k = ops.rms_norm(k.reshape(T, Hk, D), self.k_norm.weight, a.norm_eps)  # (T, Hk, D)
        q, k = ops.rotary(q, k, positions, cos_sin_cache)
        out = ops.attention(q, k, v.reshape(T, Hk, D), cu_seqlens, max_seqlen, D**-0.5)  # (T, H, D)
        return ops.linear(out.reshape(T, H * D), self.wo.weight)


class FeedForward(nn.Module):
    KERNEL_CALLS = ("gate_up", "swiglu", "down")

    def __init__(self, args, kernels: Kernels):
        super().__init__()
        self.kernels = kernels
        self.w13 = nn.Linear(args.dim, 2 * args.hidden_dim, bias=False)  # merged [gate; up]
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x) -> torch.Tensor:
        ops = self.kernels
        return ops.linear(ops.silu_and_mul(ops.linear(x, self.w13.weight)), self.w2.weight)


class TransformerBlock(nn.Module):
    KERNEL_CALLS = ("attention_norm", "ffn_norm")

    def __init__(self, args, kernels: Kernels):
        super().__init__()
        self.eps, self.kernels = args.norm_eps, kernels
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args, kernels)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args, kernels)

    def forward(self, h, residual, positions, cos_sin_cache, cu_seqlens, max_seqlen: int):
        """(h, residual) of the layer below -> this layer's (h, residual), each (T, dim)."""
        ops = self.kernels
        # Layer 0's first norm has no add; every later norm adds the residual first: (norm, sum), one kernel.
        normed, residual = ((ops.rms_norm(h, self.attention_norm.weight, self.eps), h) if residual is None
                            else ops.rms_norm(h, self.attention_norm.weight, self.eps, residual))
        h = self.attention(normed, positions, cos_sin_cache, cu_seqlens, max_seqlen)
        normed, residual = ops.rms_norm(h, self.ffn_norm.weight, self.eps, residual)
        return self.feed_forward(normed), residual


class TokenLogprobs(NamedTuple):
    """Per completion token (C,) each, fp32, under the distribution vLLM samples from."""
    logprobs: torch.Tensor  # of the token
    entropy: torch.Tensor  # of the distribution it was drawn from
    kept: torch.Tensor  # tokens that distribution keeps (the vocabulary, without top-k/top-p)
    cut_mass: torch.Tensor  # probability that top-k/top-p cut from softmax(logits / T)


class Qwen3(nn.Module):
    """Qwen3 with torchtitan's parameter names, in the layout vLLM serves (merged q/k/v and gate/up,
    `output` absent when tied to `tok_embeddings`)."""
    KERNEL_CALLS = ("embedding", "final_norm", "lm_head")

    def __init__(self, args, kernels: Kernels = EXACT, dtype: torch.dtype = torch.bfloat16,
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
    def device(self) -> torch.device:
        return self.cos_sin_cache.device

    @property
    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(self, batch: PackedBatch, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0) -> TokenLogprobs:
        """Completion tokens' logprobs as vLLM's sampler computes them: lm_head (bf16 logits) on the rows
        that predict them, then its fp32 temperature, top-k/top-p and logprob kernels. lm_head is in the
        forward so that a sharded trainer gathers the (possibly tied) embedding once."""
        hidden = self.hidden_states(batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen)
        return TokenLogprobs(*self.kernels.lm_head_logprobs(hidden[batch.target_rows], self.output_weight,
                                                            batch.targets, temperature, top_k, top_p))

    def hidden_states(self, tokens, positions, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        h, residual = self.kernels.embedding(tokens, self.tok_embeddings.weight), None
        for layer in self.layers:
            inputs = (h, residual, positions, self.cos_sin_cache, cu_seqlens, max_seqlen)
            if self.activation_checkpointing and torch.is_grad_enabled():
                # The recomputation runs the same deterministic kernels: the same bits again.
                h, residual = torch.utils.checkpoint.checkpoint(layer, *inputs, use_reentrant=False)
            else:
                h, residual = layer(*inputs)
        return self.kernels.rms_norm(h, self.norm.weight, self.args.norm_eps, residual)[0]


# ===== Weights: Hugging Face checkpoints in and out =====
def from_hf_state_dict(hf_state: dict, args) -> dict:
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter
    state = Qwen3StateDictAdapter(args, None).from_hf(dict(hf_state))
    if args.enable_weight_tying:
        state.pop("output.weight")  # the adapter aliases it to the embedding; we keep one tensor
    for i in range(args.n_layers):
        attn, ffn = f"layers.{i}.attention.", f"layers.{i}.feed_forward."
        state[attn + "wqkv.weight"] = torch.cat([state.pop(attn + w + ".weight") for w in ("wq", "wk", "wv")])
        state[ffn + "w13.weight"] = torch.cat([state.pop(ffn + w + ".weight") for w in ("w1", "w3")])
    return state


def hf_weights(model: Qwen3):
    """(HF name, view) of each weight, gathered one at a time if sharded (so every rank must iterate)."""
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter
    a = model.args
    adapter, q, kv = Qwen3StateDictAdapter(a, None), a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    for name, p in model.named_parameters():
        p, prefix = gathered(p.detach()), name.rsplit(".", 2)[0] + "."  # layers.<i>.attention. etc.
        if name.endswith("attention.wqkv.weight"):
            parts = dict(zip([prefix + w + ".weight" for w in ("wq", "wk", "wv")], p.split([q, kv, kv])))
        elif name.endswith("feed_forward.w13.weight"):
            parts = dict(zip([prefix + "w1.weight", prefix + "w3.weight"], p.chunk(2)))
        else:
            parts = {name: p}
        yield from adapter.to_hf(parts).items()


def load_qwen3(model_dir: Path, device, kernels: Kernels = EXACT, dtype=torch.bfloat16,
               activation_checkpointing: bool = False) -> Qwen3:
    """A Hugging Face Qwen3 checkpoint (checked by `check_checkpoint`) as our Qwen3."""
    args = model_args_from_hf_config(read_config(model_dir))
    if torch.device(device) == torch.device("cuda"):  # safetensors reads a bare "cuda" as GPU 0
        device = torch.device("cuda", torch.cuda.current_device())  # this rank's GPU, under torchrun
    hf_state = {name: t.to(dtype) for f in sorted(model_dir.glob("*.safetensors"))
                for name, t in load_file(f, device=str(device)).items()}
    with torch.device("meta"):  # no memory: the loaded tensors become the parameters (assign)
        model = Qwen3(args, kernels, dtype, activation_checkpointing)
    model.load_state_dict(from_hf_state_dict(hf_state, args), strict=True, assign=True)
    with torch.device(device):  # the rotary table, computed where vLLM computes it
        model.cos_sin_cache = rope_cos_sin_cache(args, dtype)
    return model


def weights_checksum(params) -> int:
    """The sum of bf16 bit patterns: independent of layout and order; a stale or partial push changes it."""
    return int(torch.stack([p.detach().view(torch.int16).sum(dtype=torch.int64) for p in params]).sum())


def trainer_checksum(model: Qwen3, world: World) -> int:
    return int(world.sum(torch.tensor(weights_checksum(local_part(p) for p in model.parameters()))))


# ===== vLLM engine, and the weight push =====
class VLLMEngine:
    """vLLM in this process, on this GPU, token ids in and out; it knows the checksum of what it serves."""

    def __init__(self, model_dir: Path, gpu_memory_utilization: float, max_model_len: int, seed: int,
                 cuda_graphs: bool = True, sleep_mode: bool = True, max_num_seqs: int = 256, **vllm_args):
        self.exact = os.environ.get("VLLM_BATCH_INVARIANT") == "1"  # then V2's runner: less host work a step
        os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_V2_MODEL_RUNNER=str(int(self.exact)))
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # quiet; =INFO brings vLLM's log back
        import vllm
        if self.exact:
            install_exact_kernels()  # V2's sampler among them: the trainer's ops, logprobs kept on the GPU
        graphs = {"compilation_config": CUDA_GRAPHS} if cuda_graphs else {"enforce_eager": True}
        self.llm = vllm.LLM(
            model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", seed=seed,
            enable_prefix_caching=False, enable_sleep_mode=sleep_mode,  # the weights change every step
            logprobs_mode="processed_logprobs",  # of the distribution sampled from: after T, top-k/p
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
            attention_config={"backend": "FLASH_ATTN", "flash_attn_version": 3}, max_num_seqs=max_num_seqs,
            **graphs, **vllm_args,  # more vllm.LLM arguments (tests give a second engine a fixed KV cache)
        )  # fmt: skip
        self.served_checksum = self.weights_checksum()

    def generate(self, prompts: list[list[int]], max_tokens: list[int], temperature: float, seeds: list[int],
                 stop_token_ids=(), ignore_eos: bool = False, top_k: int = 0, top_p: float = 1.0):
        """One completion per prompt: token ids, the fp32 logprob of each (T < 1e-5: greedy, vLLM's own)."""
        from vllm import SamplingParams, TokensPrompt
        recorded = self.exact and temperature >= 1e-5  # the exact sampler keeps these on the GPU
        params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=n, seed=s,
                                 logprobs=None if recorded else 0, flat_logprobs=True, detokenize=False,
                                 stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
                  for n, s in zip(max_tokens, seeds)]
        collecting = gc.isenabled()  # vLLM's host work bounds a decode step: GC passes on its objects add ~5%
        gc.disable()
        try:
            with SAMPLED.recording(seeds, max(max_tokens, default=0), "cuda") if recorded else nullcontext():
                samples = [out.outputs[0] for out in self.llm.generate(
                    [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)]
                completions = [list(s.token_ids) for s in samples]
                return completions, SAMPLED.read(completions) if recorded else [  # fp32 in Python floats
                    torch.tensor(s.logprobs.logprobs, dtype=torch.float32) for s in samples]
        finally:
            if collecting:
                gc.enable()

    def sleep(self) -> None:
        self.llm.sleep(level=2)  # discards the weights, not copied to the host: the trainer pushes new ones

    def wake_up(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)  # the same addresses (CUDA graphs stay valid); contents not restored
        if self.exact and "kv_cache" in tags:
            self.llm.collective_rpc(restore_block_table_pointers)

    def push_weights(self, model: Qwen3) -> None:  # no disk: vLLM's `load_weights` fills its merged slots
        self.llm.apply_model(lambda served: served.load_weights(hf_weights(model)))

    def weights_checksum(self) -> int:
        return self.llm.apply_model(lambda served: weights_checksum(served.parameters()))[0]

    def sync_weights(self, model: Qwen3, world: World, changed: bool) -> None:
        torch.cuda.empty_cache()  # the trainer's freed blocks go back to the driver, for vLLM to map
        self.wake_up(["weights"])
        self.push_weights(model)
        self.wake_up(["kv_cache"])
        self.check_weights(model, world, changed)

    def check_weights(self, model: Qwen3, world: World, changed: bool = False) -> None:
        # The trainer's checksum is a collective: every rank computes it once, whatever its engine serves.
        checksum, trainer = self.weights_checksum(), trainer_checksum(model, world)
        if checksum != trainer or (changed and checksum == self.served_checksum):
            raise RuntimeError(f"vLLM does not serve the trainer's weights (checksum {self.served_checksum} "
                               f"-> {checksum}, trainer {trainer})")
        self.served_checksum = checksum


# ===== GRPO loss =====
def group_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool) -> torch.Tensor:
    groups = rewards.view(-1, group_size)  # (P, G): G consecutive samples per prompt
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if std_normalize:
        advantages = advantages / (groups.std(dim=1, keepdim=True) + 1e-4)
    return advantages.view(-1)


def ppo_clip_loss(logprobs, old_logprobs, advantages, clip_eps: float):
    """Per-token PPO-clip surrogate (to minimise), the ratio and where the clip is active; all (C,)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped, clipped = ratio * advantages, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages
    return -torch.minimum(unclipped, clipped), ratio, clipped < unclipped


def correction_weights(log_ratio: torch.Tensor, lengths: list[int], cfg: Loss):
    """Importance weights (C,) from log(trainer / sampler) and where they cut (C,); equal logprobs: all 1."""
    if cfg.correction == "none":
        return torch.ones_like(log_ratio), torch.zeros_like(log_ratio, dtype=torch.bool)
    if cfg.correction_level == "sequence":
        # Summed one sequence at a time: a scatter-add would sum in a nondeterministic order on CUDA.
        per_sequence = torch.stack([x.sum() for x in log_ratio.split(lengths)])  # (N,)
        n = torch.tensor(lengths, device=log_ratio.device)
        log_ratio = (per_sequence / n if cfg.correction_geometric_mean else per_sequence).repeat_interleave(n)
    weight = torch.exp(log_ratio)
    if cfg.correction == "tis":
        return weight.clamp(max=cfg.correction_max), weight > cfg.correction_max
    cut = (weight < cfg.correction_min) | (weight > cfg.correction_max)
    return torch.where(cut, 0.0, weight), cut


def k3_kl(logprobs, other_logprobs) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || other): exp(d) - d - 1, d = other - policy; 0 where equal."""
    d = other_logprobs - logprobs
    return torch.exp(d) - d - 1


def grpo_loss(policy: TokenLogprobs, sampler_logprobs, advantages, *, lengths: list[int], ref_logprobs=None,
              n_tokens: int, cfg: Loss) -> tuple[torch.Tensor, dict]:
    """Loss summed / `n_tokens` (the step's: micro-batches add up to its gradient), per-token term sums."""
    # With a correction, the sampler mismatch goes into the weight; PPO's ratio is to the trainer's own: 1.
    old = sampler_logprobs if cfg.correction == "none" else policy.logprobs.detach()
    pg_loss, ratio, clipped = ppo_clip_loss(policy.logprobs, old, advantages, cfg.clip_eps)
    weight, cut = correction_weights(policy.logprobs.detach() - sampler_logprobs, lengths, cfg)
    pg_loss = weight * pg_loss
    loss, terms = pg_loss, {"pg_loss": pg_loss, "entropy": policy.entropy, "ratio_mean": ratio,
                            "ratio_clipped_frac": clipped.float(), "correction_weight_mean": weight,
                            "correction_cut_frac": cut.float(), "correction_weight_sq_mean": weight**2,
                            "kept_tokens": policy.kept.float(), "cut_mass": policy.cut_mass}
    if ref_logprobs is not None:
        terms["kl_div"] = k3_kl(policy.logprobs, ref_logprobs)
        loss = loss + cfg.kl_coef * terms["kl_div"]
    if cfg.entropy_coef:  # else the entropy stays out of the backward
        loss = loss - cfg.entropy_coef * policy.entropy
    terms["loss"] = loss
    return loss.sum() / n_tokens, {name: t.detach().sum() for name, t in terms.items()}


# ===== Train step =====
def lr_at(step: int, cfg: Optimizer) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class MasterWeights:
    """AdamW on fp32 masters of this rank's bf16 parameters (its FSDP2 shards); their bf16 rounding is what
    the trainer and vLLM run. A step's gradients are summed in fp32 on each parameter (`main_grad`, as in
    Megatron-LM) as each is made (one GPU: by the matmul or embedding kernel making it): never all at once.
    With `offload`, the masters and AdamW's moments (12 bytes a parameter) live in host memory and AdamW
    steps on the CPU, one parameter at a time: only its gradient (4 bytes a parameter) and its new bf16
    weight (2) cross PCIe. The CPU's arithmetic rounds otherwise than the GPU's: another run, as exact."""

    def __init__(self, model: Qwen3, lr: float, weight_decay: float, offload: bool = False):
        self.named, self.offload = list(model.named_parameters()), offload
        if torch.cuda.is_available():  # the state lives as long as the run: in segments of its own, so that
            torch.cuda.empty_cache()  # what training frees between steps can go back to vLLM
        self.masters = [local_part(p).detach().to("cpu" if offload else p.device, torch.float32, copy=True)
                        for _, p in self.named]
        # fused: one pass over a parameter's state, not one per operation
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay, fused=True)
        for master in self.masters:  # AdamW's state, made now as its first (fused) step would make it
            self.optimizer.state[master] = {"step": master.new_zeros(()), "exp_avg": torch.zeros_like(master),
                                            "exp_avg_sq": torch.zeros_like(master)}
        for _, p in self.named:
            if not hasattr(p, "main_grad"):  # once per parameter, whichever optimizer comes first
                p.main_grad = None
                if not hasattr(p, "to_local"):  # FSDP2 sets its shards' gradients on its own stream
                    p.register_post_accumulate_grad_hook(lambda p: MasterWeights.fold(p))

    @staticmethod
    @torch.no_grad()
    def fold(p: torch.Tensor) -> None:
        """Add a parameter's bf16 gradient into its fp32 sum, and free it (none: a kernel added it)."""
        if p.grad is not None:
            p.main_grad.add_(local_part(p.grad))
            p.grad = None

    def zero_grads(self) -> None:
        """Before a step's first micro-batch: its fp32 sums, made at once, so that they lie together in memory
        and not in the holes the micro-batches' activations leave."""
        for _, p in self.named:
            p.main_grad = torch.zeros_like(local_part(p), dtype=torch.float32)

    def accumulate_grads(self) -> None:
        """After a micro-batch's backward: the gradients FSDP2 reduce-scattered into the sums."""
        for _, p in self.named:
            self.fold(p)

    @torch.no_grad()
    def step(self, lr: float, max_grad_norm: float, world: World = World()) -> tuple[float, dict]:
        """Clip the gradients by their norm over all ranks, step AdamW and round the masters into the bf16
        weights. Returns the pre-clip norm and, per parameter, the squared L2 norms of its change and of its
        old value (this rank's part: see `weight_deltas`)."""
        grads = [p.main_grad for _, p in self.named]
        for _, p in self.named:
            p.main_grad = None
        norm = torch.nn.utils.get_total_norm(grads)
        if world.size > 1:  # each rank's norm is of its shards
            norm = world.sum(norm.pow(2)).sqrt()
        scale = torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)  # as clip_grads_with_norm_ computes it
        for grad in grads:
            grad.mul_(scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.offload:
            masters = stepped_on_host(self.optimizer, self.masters, grads)
        else:
            for master, grad in zip(self.masters, grads):
                master.grad = grad
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)  # the fp32 gradients free their memory until next step
            masters = iter(self.masters)
        del grads
        changes = {}
        for (name, p), master in zip(self.named, masters):
            new, old = to_device(master.to(p.dtype), p), local_part(p)
            changes[name] = torch.stack([(new.float() - old.float()).pow(2).sum(), old.float().pow(2).sum()])
            old.copy_(new)
        return float(norm), changes


@dataclass
class Rollouts:
    """G samples of each of P prompts, sample j of prompt i at index i * G + j."""
    prompts: list[list[int]]
    completions: list[list[int]]
    vllm_logprobs: list[torch.Tensor]  # (len(completion),) fp32 each
    rewards: torch.Tensor  # (P * G,)
    advantages: torch.Tensor  # (P * G,)


def rollout(engine, tokenizer, rows: list[dict], args: Args, step: int, stop_ids,
            world: World = World()) -> Rollouts:
    """G seeded samples per question, GSM8K-scored; under torchrun, this rank's share (step-wide seeds)."""
    s, G = args.sampling, args.sampling.samples_per_prompt
    seeds, share = rollout_seeds(args.data.seed, step, len(rows) * G), world.share(len(rows))
    rows, seeds = rows[share], seeds[share.start * G: share.stop * G]
    prompts = [r["prompt_ids"] for r in rows for _ in range(G)]
    completions, logprobs = engine.generate(prompts, [s.max_new_tokens] * len(prompts), s.temperature, seeds,
                                            stop_ids, top_k=s.top_k, top_p=s.top_p)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    rewards = torch.tensor([gsm8k_reward(text, rows[i // G]["answer"]) for i, text in enumerate(texts)])
    advantages = group_advantages(rewards, G, args.loss.std_normalize)
    return Rollouts(prompts, completions, logprobs, rewards, advantages)


def evaluate(engine, tokenizer, rows: list[dict], max_new_tokens: int, stop_ids,
             world: World = World()) -> float:
    """Greedy accuracy of the served policy on GSM8K test questions (each rank answers its share)."""
    mine = rows[world.share(len(rows))]
    completions, _ = engine.generate([r["prompt_ids"] for r in mine], [max_new_tokens] * len(mine), 0.0,
                                     [0] * len(mine), stop_ids)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    correct = sum(gsm8k_reward(text, r["answer"]) for text, r in zip(texts, mine))
    return float(world.sum(torch.tensor(correct, dtype=torch.float64))) / len(rows)


@torch.no_grad()
def reference_logprobs(ref_model: Qwen3, rollouts: Rollouts, args: Args,
                       world: World = World()) -> list[torch.Tensor]:
    """Reference policy logprobs of the sampled tokens for k3 KL (temperature only: KL refuses top-k/p)."""
    out = []
    for _, batch in packed_micro_batches(rollouts.prompts, rollouts.completions,
                                         args.engine.max_tokens_per_microbatch, ref_model.device, world):
        out += ref_model(batch, args.sampling.temperature).logprobs.split(batch.completion_lens)
    return out


def train_on_rollouts(model: Qwen3, optimizer: MasterWeights, rollouts: Rollouts, ref_logprobs, args: Args,
                      world: World = World()):
    """Forward + backward in micro-batches. Returns the loss terms' per-token means and the logprobs per
    sample, which parity checks against vLLM (no extra forward)."""
    device, s, budget = model.device, args.sampling, args.engine.max_tokens_per_microbatch
    n_tokens = int(world.sum(torch.tensor(sum(len(c) for c in rollouts.completions), device=device)))
    sums, logprobs = [], []  # per micro-batch, kept on the GPU
    optimizer.zero_grads()
    batches = packed_micro_batches(rollouts.prompts, rollouts.completions, budget, device, world)
    # Copied to the GPU before the loop: a copy from host memory waits for the GPU to run all it was given.
    per_token = [(rollouts.advantages[idx].repeat_interleave(torch.tensor(batch.completion_lens)).to(device),
                  torch.cat([rollouts.vllm_logprobs[i] for i in idx]).to(device)) for idx, batch in batches]
    for i, ((idx, batch), (advantages, sampler)) in enumerate(zip(batches, per_token)):
        reduce_gradients_after(model, last=i == len(batches) - 1)  # several GPUs: once a step, if it fits
        policy = model(batch, s.temperature, s.top_k, s.top_p)
        ref = None if ref_logprobs is None else torch.cat([ref_logprobs[i] for i in idx])
        loss, terms = grpo_loss(policy, sampler, advantages, lengths=batch.completion_lens, ref_logprobs=ref,
                                n_tokens=n_tokens, cfg=args.loss)
        loss.backward()
        optimizer.accumulate_grads()
        sums.append(terms)
        logprobs.append(policy.logprobs.detach())
    # One host copy per step (no sync per micro-batch). Divide on the host: CUDA divides by a scalar via its
    # reciprocal, turning a ratio sum of exactly n_tokens into a mean one ulp below 1.
    totals = world.sum(torch.stack([torch.stack(list(t.values())) for t in sums]).sum(0)).tolist()
    metrics = {name: total / n_tokens for name, total in zip(sums[0], totals)}
    weight, weight_sq = metrics["correction_weight_mean"], metrics["correction_weight_sq_mean"]
    metrics["correction_ess"] = weight**2 / weight_sq if weight_sq else 0.0  # Kish's: 1 if all weights equal
    if s.top_k == 0 and s.top_p == 1:  # every token kept: nothing to report
        del metrics["kept_tokens"], metrics["cut_mass"]
    return metrics, list(torch.cat(logprobs).cpu().split([len(c) for c in rollouts.completions]))


def sft_step(model: Qwen3, optimizer: MasterWeights, rows: list[dict], args: Args,
             world: World = World()) -> float:
    """One SFT warm-start step on the reference answers (GRPO's forward). Returns the mean token loss."""
    rows = rows[world.share(len(rows))]
    prompts, answers = [r["prompt_ids"] for r in rows], [r["answer_ids"] for r in rows]
    n_tokens = int(world.sum(torch.tensor(sum(len(a) for a in answers))))
    total, budget = 0.0, args.engine.max_tokens_per_microbatch
    optimizer.zero_grads()
    batches = packed_micro_batches(prompts, answers, budget, model.device, world)
    for i, (_, batch) in enumerate(batches):
        reduce_gradients_after(model, last=i == len(batches) - 1)
        loss = -model(batch).logprobs.sum() / n_tokens
        loss.backward()
        optimizer.accumulate_grads()
        total += float(loss.detach())
    optimizer.step(args.warm_start.sft_lr, args.optimizer.max_grad_norm, world)
    return float(world.sum(torch.tensor(total, dtype=torch.float64)))


# ===== Parity: every sampled token's logprob, compared bit for bit =====
class ParityError(Exception):
    """A sampled token whose trainer logprob is not bitwise vLLM's (exit status 1)."""


Mismatch = NamedTuple("Mismatch", [("message", str), ("sample", int), ("token", int)])
def compare_bits(vllm_logprobs: list[torch.Tensor], trainer_logprobs: list[torch.Tensor],
                 tokens: list[list[int]], world: World = World()) -> tuple[dict, Mismatch | None]:
    """Compare logprobs by fp32 bits. Returns metrics and the first Mismatch, or None."""
    v, t = torch.cat(vllm_logprobs), torch.cat(trainer_logprobs)
    differ = v.view(torch.int32) != t.view(torch.int32)
    mismatched = int(differ.sum())
    metrics = {"mismatched_tokens": mismatched, "max_abs_logprob_diff": float((v - t).abs().max()),
               "mean_abs_logprob_diff": float((v - t).abs().mean()),
               "vllm_kl": float(k3_kl(v, t).mean()),  # KL(sampler || trainer), from the sampler's tokens
               "sampler_perplexity": math.exp(-float(v.mean())),
               "trainer_perplexity": math.exp(-float(t.mean()))} | mismatch_by_probability(v, t)
    if not mismatched:
        return metrics, None
    flat = int(differ.nonzero()[0])
    ends = torch.tensor([len(x) for x in vllm_logprobs]).cumsum(0)
    sample = int((ends <= flat).sum())
    token = flat - (int(ends[sample - 1]) if sample else 0)
    where = f" (sampled on rank {sample * world.size // len(tokens)})" if world.size > 1 else ""
    message = (f"sample {sample}{where} token {token} (id {tokens[sample][token]}): vLLM logprob "
               f"{float(v[flat])!r} but trainer {float(t[flat])!r}; {mismatched} of {len(v)} sampled tokens "
               "differ")
    return metrics, Mismatch(message, sample, token)


def on_mismatch(first: Mismatch, engine, model: Qwen3, rollouts: Rollouts, parity: dict, step: int,
                args: Args, writer, world: World) -> None:
    """Where the bits part: the first mismatching sample run through both sides with the weights that sampled
    it (none updated yet), op by op. With --assert-bitwise, the run stops there (exit status 1)."""
    engine.sync_weights(model, world, changed=False)
    seq = rollouts.prompts[first.sample] + rollouts.completions[first.sample][: first.token]
    message = f"step {step}: {first.message}; first divergence: {find_first_divergence(engine, model, seq)}"
    if args.parity.assert_bitwise:
        log_step(writer, step, {f"parity/{k}": v for k, v in parity.items()}, "parity broken", world)
        raise ParityError(message)
    log_line(message, world)
    engine.sleep()  # the trainer goes on


# ===== The loop, and main() =====
def warm_start(model: Qwen3, inputs, order: list[int], args: Args, world: World = World()) -> None:
    """--sft-steps of SFT on reference answers (own optimizer); TensorBoard run <run_name>/warm_start."""
    from torch.utils.tensorboard import SummaryWriter
    # Answers as the model should write them after the prompt, then an end of sequence (<|im_end|> in chat).
    plain = args.data.prompt_format == "plain" or inputs.tokenizer.chat_template is None
    for r in inputs.train_rows:
        answer = inputs.tokenizer.encode((" " if plain else "") + r["answer"], add_special_tokens=False)
        r["answer_ids"] = answer + [inputs.tokenizer.eos_token_id or inputs.stop_ids[0]]
    optimizer = MasterWeights(model, args.warm_start.sft_lr, args.optimizer.weight_decay,
                              args.engine.offload_optimizer)
    writer = SummaryWriter(str(Path("runs") / args.run.run_name / "warm_start")) if world.is_main else None
    for step in progress_bar(range(args.warm_start.sft_steps), "warm start", world):
        rows = step_rows(inputs.train_rows, order, step, args.warm_start.sft_batch_size)
        loss = sft_step(model, optimizer, rows, args, world)
        if world.is_main:
            writer.add_scalar("sft/loss", loss, step)
    if world.is_main:
        writer.close()


def grpo(args: Args, engine, model: Qwen3, inputs, order: list[int], writer, world: World = World()) -> None:
    """vLLM samples (the trainer's state waits in memory), sleeps while the trainer trains, wakes updated."""
    s, o, run = args.sampling, args.optimizer, args.run
    ref_model = reference_policy(model, world) if args.loss.kl_coef > 0 else None  # KL to GRPO's start
    optimizer = MasterWeights(model, o.lr, o.weight_decay, args.engine.offload_optimizer)
    checkpoints = Checkpoints(model, optimizer, ref_model, inputs, args, world)  # host memory to save from
    totals = (restore_training_state(inputs.model_dir, optimizer, ref_model, args, world) if inputs.start_step
              else {"tokens_checked": 0, "mismatched_tokens": 0})
    if run.eval_every and inputs.start_step % run.eval_every == 0:  # before training, or a resume when due
        log_eval(engine, inputs, args, inputs.start_step, writer, world)
    for step in progress_bar(range(inputs.start_step, o.steps), "GRPO", world):
        times, memory = {}, {}
        with phase("generate", times, memory):
            rows = step_rows(inputs.train_rows, order, step, s.prompts_per_step)
            rollouts = rollout(engine, inputs.tokenizer, rows, args, step, inputs.stop_ids, world)
        with phase("train", times, memory):
            engine.sleep()
            ref_logprobs = None if ref_model is None else reference_logprobs(ref_model, rollouts, args, world)
            metrics, logprobs = train_on_rollouts(model, optimizer, rollouts, ref_logprobs, args, world)
            rollouts, logprobs = whole_step(rollouts, logprobs, world)  # every rank's samples
            parity, first = compare_bits(rollouts.vllm_logprobs, logprobs, rollouts.completions, world)
            log_parity(step, rollouts, logprobs, parity, args.parity.parity_report_tokens, world)
            if first and (args.parity.assert_bitwise or args.parity.locate_divergence):
                on_mismatch(first, engine, model, rollouts, parity, step, args, writer, world)
            grad_norm, changes = optimizer.step(lr := lr_at(step, o), o.max_grad_norm, world)
            deltas = weight_deltas(changes, world)
        with phase("push", times, memory):
            engine.sync_weights(model, world, changed=any(magnitude for magnitude, _ in deltas.values()))
        totals["tokens_checked"] += sum(len(c) for c in rollouts.completions)
        totals["mismatched_tokens"] += parity["mismatched_tokens"]
        scalars = step_scalars(rollouts, metrics, parity, grad_norm, lr, deltas, times, memory)
        log_step(writer, step, scalars, step_line(step, scalars, times, memory), world)
        last = step == o.steps - 1
        if run.eval_every and ((step + 1) % run.eval_every == 0 or last):
            log_eval(engine, inputs, args, step + 1, writer, world)
        if run.save_every >= 0 and (last or run.save_every and (step + 1) % run.save_every == 0):
            checkpoints.save(step + 1, totals, writer)  # written as the next step runs; the last waited for
    if world.is_main:  # the run's certificate of exactness
        record = json.dumps(parity_record(args, model, totals), indent=2)
        write_whole(Path(writer.log_dir) / "parity.json", record)


def main(args: Args, device: str = "cuda", engine_class=VLLMEngine, quiet: bool = False) -> Path:
    """Train; returns runs/<run>. Tests give a CPU stand-in `engine_class`; the script runs `quiet`."""
    args = check_args(args, torchrun_rank_and_size()[1])
    inputs = load_inputs(args)
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("no CUDA GPU found: simple_rl.py runs vLLM and the trainer on a GPU")
    world = init_distributed(device)
    # Before vLLM starts: a model that cannot fit is refused, not run out of memory (the CPU is not planned).
    keep_gathered = check_gpu_memory(inputs.model_args, args, world) if device == "cuda" else True
    if quiet:
        log_to_file(args.run.run_name, args.run.verbose, world)
    random.seed(args.data.seed)  # the loop draws from no global generator: seeded (and saved) for additions
    torch.manual_seed(args.data.seed)
    # torchrun: an engine a rank (vLLM's external launcher, no vLLM data parallelism) samples alone.
    parallel = {"distributed_executor_backend": "external_launcher"} if world.size > 1 else {}
    engine = engine_class(inputs.model_dir, args.engine.vllm_gpu_memory,  # first: claims an empty GPU
                          args.data.max_prompt_tokens + args.sampling.max_new_tokens, args.data.seed,
                          cuda_graphs=args.engine.vllm_cuda_graphs, **parallel)
    model = load_qwen3(inputs.model_dir, device,
                       activation_checkpointing=args.engine.activation_checkpointing)
    if world.size > 1:
        shard_model(model, world, keep_gathered)
    engine.check_weights(model, world)
    writer = open_tensorboard(args, inputs.start_step) if world.is_main else None
    order = list(range(len(inputs.train_rows)))
    random.Random(args.data.seed).shuffle(order)
    if args.warm_start.sft_steps and not args.run.resume:  # a resumed run's weights are warm already
        engine.sleep()
        warm_start(model, inputs, order, args, world)
        engine.sync_weights(model, world, changed=True)
    try:
        grpo(args, engine, model, inputs, order, writer, world)
    finally:  # also on an error: a save under way ends, the failing step's parity scalars reach the disk
        Checkpoints.end_write(quietly=True)
        if world.is_main:  # on a full disk TensorBoard's last write fails too: not over the run's own error
            with suppress(OSError) if sys.exc_info()[0] else nullcontext():
                writer.close()
    return Path("runs") / args.run.run_name


# ===== Plumbing: flag and input checks, memory plan, several GPUs, checkpoints, logging, the locator =====
# ----- Flag and input checks: each fails in one line (UsageError), before anything slow -----
def meta_qwen3(args) -> Qwen3:
    """A Qwen3 of this shape that takes no memory: its parameters' names and sizes."""
    with torch.device("meta"):
        return Qwen3(args)


def existing_parent(path: Path) -> Path:
    return next(p for p in (path, *path.absolute().parents) if p.exists())


def check_resume(args: Args) -> tuple[Args, int]:
    """The args of a resumed run (its name kept) and its step; names every flag contradicting the run."""
    saved, step = saved_run(Path(args.run.resume))
    if args.run.run_name not in (None, saved.run.run_name):
        raise UsageError(f"--run-name {args.run.run_name}: a resumed run keeps its name "
                         f"({saved.run.run_name}); leave --run-name out")
    values = [(name, getattr(given, name), getattr(had, name)) for group in dataclasses.fields(Args)
              for given, had in [(getattr(args, group.name), getattr(saved, group.name))]
              for name, hint in typing.get_type_hints(type(given), include_extras=True).items()
              if FIXED in getattr(hint, "__metadata__", ())]
    clashes = [f"{flag(name)} {given!r} (the run has {had!r})" for name, given, had in values if given != had
               and not (isinstance(given, str) and isinstance(had, str) and os.path.exists(given)
                        and os.path.exists(had) and os.path.samefile(given, had))]  # a path, spelt otherwise
    if clashes:
        raise UsageError(f"--resume {args.run.resume}: {', '.join(clashes)} contradict the run it continues; "
                         "leave them out to continue it as it was")
    if step >= args.optimizer.steps:
        raise UsageError(f"--resume {args.run.resume}: the run is at step {step} already; pass a larger "
                         "--steps to train on")
    return dataclasses.replace(args, run=dataclasses.replace(args.run, run_name=saved.run.run_name)), step


def check_output(run: Run) -> None:
    """runs/<run_name> and <output_dir>/<run_name> can be written, and a new run overwrites nothing."""
    if not re.fullmatch(r"[\w.-]+", run.run_name) or run.run_name in (".", ".."):
        raise UsageError(f"--run-name {run.run_name!r}: give a plain name (letters, digits, '.', '-', '_'): "
                         "it names the folders runs/<name> and <output-dir>/<name>")
    for root, what in ((Path(run.output_dir), "--output-dir"), (Path("runs"), "TensorBoard's runs/")):
        existing = existing_parent(root)
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise UsageError(f"{what} {root}: {existing} is not a writable directory")
        if not run.resume and (root / run.run_name).exists():
            raise UsageError(f"--run-name {run.run_name}: {root / run.run_name} exists already; pick another "
                             "name, or --resume one of its checkpoints")


def check_args(args: Args, world_size: int) -> Args:
    """Fails on flags that contradict each other, the environment or the output paths (each number's range is
    checked as it is parsed); sets the run name (a timestamp) and warm-up <= steps."""
    data, s, loss, o, e, r = args.data, args.sampling, args.loss, args.optimizer, args.engine, args.run
    invariant, sequence = os.environ.get("VLLM_BATCH_INVARIANT"), data.max_prompt_tokens + s.max_new_tokens
    checks = [
        (s.samples_per_prompt >= 2, "--samples-per-prompt must be at least 2: GRPO normalises rewards "
                                    "within each group"),
        (0 < s.top_p <= 1, "--top-p must be in (0, 1] (1 keeps every token)"),
        (s.temperature >= 1e-5, f"--temperature {s.temperature:g} is below 1e-5, where vLLM samples greedily "
         "(and the trainer would divide by it)"),
        (data.seed < 2**63 // 10**9, f"--seed must be below {2**63 // 10**9}: a step's sampling seeds, "
         "seed * 1e9 + i, are 64-bit"),
        (o.steps <= 10**8, "--steps must be at most 100,000,000 (a step takes seconds)"),
        (not (data.thinking and data.prompt_format == "plain"), "--thinking opens a <think> block in Qwen3's "
         "chat template: use --prompt-format chat or auto"),
        (not (args.parity.locate_divergence and args.parity.assert_bitwise), "--locate-divergence is for "
         "--no-assert-bitwise runs: a parity abort always locates the divergence"),
        (loss.kl_coef == 0 or (s.top_k == 0 and s.top_p == 1), "--kl-coef must be 0 with --top-k or --top-p: "
         "a sampled token can lie outside the reference policy's kept set, where the KL is infinite"),
        (0 <= o.min_lr_ratio <= 1, "--min-lr-ratio must be between 0 and 1"),
        (r.save_every >= -1, "--save-every must be >= -1 (0: a checkpoint after the last step only; -1: no)"),
        (0 <= loss.correction_min < loss.correction_max, "need 0 <= --correction-min < --correction-max"),
        (e.max_tokens_per_microbatch >= sequence, "--max-tokens-per-microbatch must hold one whole sequence "
         "(>= --max-prompt-tokens + --max-new-tokens)"),
        (0 < e.vllm_gpu_memory < 1, "--vllm-gpu-memory must be a fraction between 0 and 1"),
        (not (data.dataset and r.eval_every and not data.eval_dataset),
         "--dataset is local: pass --eval-dataset (a local test jsonl) too, or --eval-every 0"),
        (invariant in (None, "0", "1"), f"VLLM_BATCH_INVARIANT is {invariant!r}, but vLLM reads it as an "
         "integer: set VLLM_BATCH_INVARIANT=1"),
        (not args.parity.assert_bitwise or invariant == "1",
         f"VLLM_BATCH_INVARIANT is {invariant or 'not set'}, so vLLM's logprobs cannot equal the trainer's: "
         "set VLLM_BATCH_INVARIANT=1, or pass --no-assert-bitwise to run anyway and report the mismatch"),
        *[(n % world_size == 0, f"{name} {n} must be a multiple of the {world_size} processes")
          for name, n in (("--prompts-per-step", s.prompts_per_step),
                          ("--sft-batch-size", args.warm_start.sft_batch_size))],
    ]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)
    if r.resume:
        args, _ = check_resume(args)
    elif r.run_name is None:
        name = time.strftime("grpo_%Y%m%d_%H%M%S")
        args = dataclasses.replace(args, run=dataclasses.replace(r, run_name=name))
    check_output(args.run)
    if o.warmup_steps > o.steps:
        print(f"note: --warmup-steps {o.warmup_steps} is more than --steps {o.steps}: the learning rate "
              f"warms up over all {o.steps} steps")
        args = dataclasses.replace(args, optimizer=dataclasses.replace(o, warmup_steps=o.steps))
    return args


def rope_parameters(config: dict) -> dict:
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def model_args_from_hf_config(config: dict):
    """torchtitan's Qwen3ModelArgs from a Hugging Face `config.json` (checked by `read_config`)."""
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    return Qwen3ModelArgs(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"], n_kv_heads=config["num_key_value_heads"],
        vocab_size=config["vocab_size"], hidden_dim=config["intermediate_size"],
        norm_eps=config["rms_norm_eps"], max_seq_len=config["max_position_embeddings"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        rope_theta=rope_parameters(config).get("rope_theta", config.get("rope_theta", 1_000_000)),
        enable_weight_tying=config.get("tie_word_embeddings", False))


def read_config(model_dir: Path) -> dict:
    """A checkpoint's config.json, refused in one line (naming the file) if it cannot describe a Qwen3."""
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot read it ({e.strerror})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path}: a JSON object of the model's settings was expected")
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "intermediate_size", "rms_norm_eps", "max_position_embeddings")
    missing = [key for key in keys if key not in config]
    if config.get("model_type") != "qwen3" or missing:
        what = f"no {', '.join(missing)}" if missing else f"model_type is {config.get('model_type')!r}"
        raise UsageError(f"{path}: {what}; this trainer needs a Hugging Face Qwen3 config")
    for key in keys:
        if not isinstance(config[key], (int, float)) or isinstance(config[key], bool) or not config[key] > 0:
            raise UsageError(f"{path}: {key} is {config[key]!r}; it must be a number > 0")
    rope = rope_parameters(config)
    unsupported = {"hidden_act": config.get("hidden_act", "silu") != "silu",
                   "attention_bias": bool(config.get("attention_bias", False)),
                   "rope scaling": rope.get("rope_type", rope.get("type", "default")) != "default",
                   "sliding window": bool(config.get("use_sliding_window", False))}
    for name, bad in unsupported.items():
        if bad:
            raise UsageError(f"{path}: {name} is not supported by this trainer (plain Qwen3 only)")
    return config


def check_checkpoint(model_dir: Path, args, source: str = "--model") -> None:
    """Its weights' names, shapes and dtype against config.json (`source`: the flag that named it)."""
    from safetensors import SafetensorError, safe_open  # headers only: fail before anything slow starts
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UsageError(f"{source} {model_dir}: no *.safetensors weights in the directory")
    found = {}  # name -> (shape, dtype)
    for f in files:
        try:
            with safe_open(f, "pt") as weights:
                found |= {name: (tuple(weights.get_slice(name).get_shape()),
                                 weights.get_slice(name).get_dtype()) for name in weights.keys()}
        except SafetensorError as e:
            raise UsageError(f"{source} {model_dir}: {f.name} is not a whole safetensors file ({e}); "
                             "download or save it again") from None
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in hf_weights(Qwen3(args))}
    if args.enable_weight_tying:
        found.pop("lm_head.weight", None)  # some tied checkpoints store the head too; it is the embedding
    problems = [f"missing {name}" for name in sorted(expected.keys() - found.keys())]
    problems += [f"unexpected {name}" for name in sorted(found.keys() - expected.keys())]
    problems += [f"{name} is {list(found[name][0])}, config.json needs {list(shape)}"
                 for name, shape in expected.items() if name in found and found[name][0] != shape]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise UsageError(f"{source} {model_dir}: the weights do not match config.json: "
                         + "; ".join(problems[:3]) + more)
    other = sorted({dtype for _, dtype in found.values()} - {"BF16"})
    if other:  # vLLM would serve them rounded to bf16, the trainer would train other weights
        raise UsageError(f"{source} {model_dir}: the weights are {', '.join(other)}; both sides run bf16 "
                         "weights: save the checkpoint in bfloat16")


def check_training_state(checkpoint: Path) -> None:
    """--resume: DCP's index of the training state, every file it names as long as it says, parity.json; a
    checkpoint copied in part fails here, not in `dcp.load` once vLLM has started."""
    state, problem = checkpoint / "training_state", None
    try:
        ends = {}
        for item in dcp.FileSystemReader(state).read_metadata().storage_data.values():
            ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
        for name, end in sorted(ends.items()):
            size = (state / name).stat().st_size if (state / name).is_file() else None
            if problem is None and (size is None or size < end):
                cut = "missing" if size is None else f"cut short: {size:,} of {end:,} bytes"
                problem = f"{name} is {cut}"
        parity = json.loads((state / "parity.json").read_text())
        lacks = {"stack", "tokens_checked", "mismatched_tokens"} - parity.keys()  # what resuming reads of it
        problem = problem or (f"parity.json lacks {', '.join(sorted(lacks))}" if lacks else None)
    except Exception as e:  # the index or parity.json missing or unreadable (not DCP's, not JSON, not ours)
        problem = f"{type(e).__name__}: {e}".splitlines()[0]
    if problem:
        raise UsageError(f"--resume {checkpoint}: its training state is broken ({problem}); copy it again "
                         "whole, or resume from an earlier checkpoint")


def load_gsm8k(split: str) -> list[dict]:
    """[{question, answer}] of openai/gsm8k 'main' from `datasets` (a local jsonl: `read_gsm8k_jsonl`)."""
    from datasets import load_dataset
    return [{"question": r["question"], "answer": r["answer"]} for r in load_dataset("openai/gsm8k", "main",
                                                                                     split=split)]


def read_gsm8k_jsonl(path: str) -> list[dict]:
    """[{question, answer}] of a local GSM8K-format jsonl, each line checked."""
    if not Path(path).is_file():
        raise UsageError(f"{path}: {'a directory' if Path(path).is_dir() else 'no such file'} (expected a "
                         "GSM8K-format jsonl file)")
    try:
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()  # a BOM, as Windows editors write
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text (save the jsonl as UTF-8)") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UsageError(f"{path} line {n}: not valid JSON") from None
        if not (isinstance(row, dict) and all(isinstance(row.get(k), str) for k in ("question", "answer"))):
            raise UsageError(f"{path} line {n}: need a JSON object with string fields 'question', 'answer'")
        # GSM8K's answers end in '#### N': a bare last number would be a guess at the answer.
        if not ANSWER_AFTER_HASHES.search(row["answer"]):
            raise UsageError(f"{path} line {n}: the answer does not end in '#### N' with N a number "
                             "(GSM8K's format)")
        rows.append({"question": row["question"], "answer": row["answer"]})
    if not rows:
        raise UsageError(f"{path}: no examples")
    return rows


def encoded_split(path: str | None, split: str, name: str, tokenizer, data: Data) -> list[dict]:
    """A split's questions tokenised (`encode_dataset`), saying how many prompts were too long."""
    if path is None:
        try:
            rows = load_gsm8k(split)
        except Exception as e:
            raise UsageError(f"cannot load openai/gsm8k from the hub ({type(e).__name__}): pass --dataset "
                             "and --eval-dataset with local jsonl files") from e
    else:
        rows = read_gsm8k_jsonl(path)
    kept = encode_dataset(rows, tokenizer, data)
    if not kept:
        raise UsageError(f"{name}: every prompt exceeds --max-prompt-tokens {data.max_prompt_tokens}")
    if len(kept) < len(rows):
        print(f"{name}: {len(rows) - len(kept)} of {len(rows)} prompts exceed --max-prompt-tokens "
              f"{data.max_prompt_tokens} and are skipped")
    return kept


def resolve_model_dir(model: str) -> Path:
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"--model {model}: the directory has no config.json (need a Hugging Face Qwen3 "
                             "checkpoint)")
        return path
    if path.exists() or model.startswith((".", "/")) or model.count("/") != 1:
        raise UsageError(f"--model {model}: not a checkpoint directory, nor a hub id like Qwen/Qwen3-1.7B")
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as e:
        raise UsageError(f"--model {model}: cannot download it from the hub ({type(e).__name__}); pass a "
                         "local checkpoint directory") from e


def end_of_sequence_ids(tokenizer, model_dir: Path) -> list[int]:
    eos = read_config(model_dir).get("eos_token_id")
    ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
    if not ids:
        raise UsageError(f"{model_dir}: neither the tokenizer nor config.json names an end-of-sequence token")
    return sorted(ids)


def in_units(n: float) -> str:
    return next(f"{n / 2**k:.1f} {unit}" for k, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "B"))
                if n >= 2**k or k == 0)


def checkpoint_bytes(args: Args, model_args) -> int:
    """16 bytes a parameter (18 with a reference): the bf16 weights, fp32 master and 2 AdamW moments (14),
    and a margin for the files' own bytes."""
    return sum(p.numel() for p in meta_qwen3(model_args).parameters()) * (18 if args.loss.kl_coef else 16)


def check_disk(args: Args, model_args) -> None:
    """A save writes the new checkpoint before it removes the oldest: --keep-last + 1 of them at once.
    Refuses a run whose first checkpoint cannot fit; warns of one whose later ones will not."""
    one, root = checkpoint_bytes(args, model_args), Path(args.run.output_dir)
    saves = args.optimizer.steps // args.run.save_every + 1 if args.run.save_every else 1
    most = one * min(saves, args.run.keep_last + 1 if args.run.keep_last else saves)
    free = shutil.disk_usage(existing_parent(root)).free
    if free < one:
        raise UsageError(f"--output-dir {root}: {in_units(free)} free, but a checkpoint of this model takes "
                         f"about {in_units(one)}; free some, give another --output-dir, or --save-every -1")
    if free < most:
        print(f"warning: {root} has {in_units(free)} free; the run's checkpoints take up to {in_units(most)} "
              "at once (--keep-last + 1): a later save will fail")


@dataclass
class Inputs:
    """Everything read before the engine starts: a bad input fails before anything slow."""
    model_dir: Path  # the checkpoint both sides load: --model, or the one --resume continues from
    model_args: object  # its shape (torchtitan's Qwen3ModelArgs)
    start_step: int  # GRPO steps already made: 0, or the resumed checkpoint's step
    tokenizer: object
    stop_ids: list[int]
    train_rows: list[dict]
    eval_rows: list[dict]


def load_inputs(args: Args) -> Inputs:
    from importlib.metadata import version
    from transformers import AutoTokenizer
    if version("vllm") != "0.20.0":
        raise UsageError(f"vLLM {version('vllm')} is installed; this script mirrors vLLM 0.20.0's kernels: "
                         "pip install vllm==0.20.0")
    model_dir = Path(args.run.resume) if args.run.resume else resolve_model_dir(args.data.model)
    model_args = model_args_from_hf_config(read_config(model_dir))
    longest = args.data.max_prompt_tokens + args.sampling.max_new_tokens
    if longest > model_args.max_seq_len:
        raise UsageError(f"--max-prompt-tokens + --max-new-tokens = {longest}, but the model has "
                         f"{model_args.max_seq_len} positions ({model_dir}/config.json: "
                         "max_position_embeddings)")
    try:
        check_bitwise_head_dim(model_args.head_dim, longest, model_dir)
    except ValueError as e:
        raise UsageError(str(e)) from None
    source = "--resume" if args.run.resume else "--model"  # a checkpoint's weights are named as such
    check_checkpoint(model_dir, model_args, source)
    if args.run.resume:
        check_training_state(model_dir)
    if args.run.save_every >= 0:
        check_disk(args, model_args)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:
        raise UsageError(f"{source} {model_dir}: cannot load its tokenizer ({type(e).__name__}: "
                         f"{str(e).splitlines()[0]})") from e
    if not 1 < len(tokenizer) <= model_args.vocab_size:  # transformers makes a 1-token one with no files
        raise UsageError(f"{source} {model_dir}: its tokenizer has {len(tokenizer)} token(s) for a "
                         f"vocabulary of {model_args.vocab_size} (its files missing, or another model's)")
    if args.data.prompt_format == "chat" and tokenizer.chat_template is None:
        raise UsageError("--prompt-format chat: this tokenizer has no chat template; use plain or auto")
    if args.sampling.top_k > model_args.vocab_size:
        raise UsageError(f"--top-k {args.sampling.top_k} is more than the vocabulary's "
                         f"{model_args.vocab_size} tokens (0 keeps them all)")
    train_rows = encoded_split(args.data.dataset, "train", "train set", tokenizer, args.data)
    if args.sampling.prompts_per_step > len(train_rows):
        raise UsageError(f"--prompts-per-step {args.sampling.prompts_per_step} is more than the train set's "
                         f"{len(train_rows)} questions")
    eval_rows = encoded_split(args.data.eval_dataset, "test", "eval set", tokenizer, args.data) \
        if args.run.eval_every else []
    return Inputs(model_dir, model_args, saved_run(model_dir)[1] if args.run.resume else 0, tokenizer,
                  end_of_sequence_ids(tokenizer, model_dir), train_rows, eval_rows[: args.run.eval_samples])


# ----- The memory plan: what each GPU holds, checked before vLLM starts -----
GiB = 2**30
# Besides the tensors counted below (measured on an H100, tests/test_gpu_memory.py): the CUDA context with its
# kernels' workspaces; what a sleeping engine keeps (its CUDA graphs' pool, sampler buffers); what vLLM needs
# to start besides its weights and a sequence's KV cache (activations while it profiles, graphs); a process's
# host memory besides an offloaded optimizer and saves' copies (torch, vLLM, an offloaded step's staging).
CUDA_CONTEXT_BYTES = 0.75 * GiB
VLLM_ASLEEP_BYTES = 1.0 * GiB
VLLM_SAMPLER_BYTES = 1.0 * GiB  # outside vLLM's share: its sampler's temporaries over the vocabulary
VLLM_WORKING_BYTES = 3.0 * GiB
HOST_BYTES_PER_PROCESS = 8.0 * GiB
USABLE = 0.97  # of the GPU's memory
# PyTorch's caching allocator keeps blocks that micro-batches freed but split (measured: a third of a
# micro-batch's bytes while training, a tenth to a seventh of them beside vLLM).
CACHED_WHILE_TRAINING, CACHED_WHILE_GENERATING = 0.35, 0.15
CACHED_BESIDE_GRADIENTS = 0.25  # and a quarter of the fp32 gradient sums' size while training (8B shape)


def parameter_counts(model_args) -> tuple[int, int]:
    """(parameters in all, in one transformer block)."""
    model = meta_qwen3(model_args)
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.layers[0].parameters())


def memory_plan(model_args, args: Args, gpus: int, gpu_bytes: int,
                keep_gathered: bool = False) -> dict[str, dict[str, float]]:
    """Bytes one GPU holds at the peak of each phase, by what holds them: while vLLM generates (the trainer's
    state waits), while the trainer runs a micro-batch (vLLM asleep), and while AdamW steps. FSDP2 shards the
    trainer over torchrun's `gpus` processes (`keep_gathered`: see `shard_model`); each runs a vLLM engine."""
    e, (n, block) = args.engine, parameter_counts(model_args)
    shard, on_gpu = n / gpus, 0 if e.offload_optimizer else 1
    state = {"bf16 weights": 2 * shard, "fp32 masters": 4 * shard * on_gpu,
             "AdamW moments": 8 * shard * on_gpu}
    if args.loss.kl_coef:
        state["reference policy"] = 2 * shard
    fsdp = {}  # FSDP2: the root (embedding, lm_head), two blocks, a block's gradient reduced in fp32
    if gpus > 1 and keep_gathered:  # the whole bf16 weights, their gradients summed whole in fp32
        fsdp = {"weights gathered": 2 * n, "unsharded fp32 gradients": 4 * n + 4 * block}
    elif gpus > 1:
        fsdp["gathered by FSDP2"] = 2 * (n - model_args.n_layers * block) + 4 * block + 6 * block
    context, asleep = {"CUDA context": CUDA_CONTEXT_BYTES}, {"vLLM asleep": VLLM_ASLEEP_BYTES}
    grads = {"fp32 gradient sums": 4 * shard}
    # bf16 gradients: one at a time (the embedding's the largest), under FSDP2 this rank's shards of them all
    embedding, offloaded = model_args.vocab_size * model_args.dim, (1 - on_gpu) / gpus  # the largest weight
    bf16_grads = 2 * (shard if gpus > 1 and not keep_gathered else embedding)
    micro_batch = micro_batch_bytes(model_args, e.max_tokens_per_microbatch, e.activation_checkpointing,
                                    bf16_grads)
    return {
        "generating": context | {"vLLM": e.vllm_gpu_memory * gpu_bytes + VLLM_SAMPLER_BYTES} | state
        | {"PyTorch's cache": CACHED_WHILE_GENERATING * micro_batch},
        "training": context | asleep | state | fsdp | grads | {
            "activations, bf16 gradients": micro_batch,
            "PyTorch's cache": CACHED_WHILE_TRAINING * micro_batch + CACHED_BESIDE_GRADIENTS * 4 * shard},
        # fused AdamW: no temporary; offloaded, a weight's copies that measure its change lie beside the sums
        "the optimizer step": context | asleep | state | grads | {"fp32 copies": 14 * embedding * offloaded},
    }


def memory_problem(model_args, args: Args, gpus: int, gpu_bytes: int, host: tuple[int, int] | None,
                   keep_gathered: bool = False):
    """What does not fit in the GPU's `gpu_bytes`, or in `host` = (bytes available, processes sharing them);
    None if everything fits."""
    a, e, (n, _) = model_args, args.engine, parameter_counts(model_args)
    sequence = args.data.max_prompt_tokens + args.sampling.max_new_tokens
    vllm = 2 * n + 2 * 2 * a.n_layers * a.n_kv_heads * a.head_dim * sequence + VLLM_WORKING_BYTES
    if vllm > e.vllm_gpu_memory * gpu_bytes:
        return (f"vLLM's share (--vllm-gpu-memory {e.vllm_gpu_memory:g}: "
                f"{e.vllm_gpu_memory * gpu_bytes / GiB:.1f} GiB) cannot hold its weights, a sequence's KV "
                f"cache and its workspace ({vllm / GiB:.1f} GiB)")
    for stage, parts in memory_plan(model_args, args, gpus, gpu_bytes, keep_gathered).items():
        if sum(parts.values()) > USABLE * gpu_bytes:
            largest = sorted(parts.items(), key=lambda part: -part[1])[:4]
            return (f"{stage} needs {sum(parts.values()) / GiB:.1f} of the GPU's {gpu_bytes / GiB:.1f} GiB ("
                    + ", ".join(f"{what} {size / GiB:.1f}" for what, size in largest) + ")")
    saves, meta = args.run.save_every >= 0, meta_qwen3(model_args)  # saves copy the GPU's tensors to the host
    pinned = lambda nbytes: saves * sum(1 << (int(b) - 1).bit_length() for b in nbytes)  # as PyTorch rounds
    fp32 = pinned(4 * p.numel() / gpus for p in meta.parameters())  # bf16: half, as a power of two is
    state = (12 * n / gpus if e.offload_optimizer else 3 * fp32) + bool(args.loss.kl_coef) * fp32 / 2  # + ref
    if host is not None and state:
        available, processes = host
        needs = processes * (state + HOST_BYTES_PER_PROCESS) + pinned(t.nbytes for _, t in hf_weights(meta))
        if needs > available:
            return (f"the optimizer's state, offloaded or copied by saves, needs {needs / GiB:.1f} GiB of "
                    f"host memory, {available / GiB:.1f} GiB are available")
    return None


def check_memory(model_args, args: Args, gpus: int, gpu_bytes: int, host: tuple[int, int] | None) -> bool:
    """Refuses a run that would run out of GPU (or host) memory, naming changes with which it would fit.
    Returns whether a sharded trainer fits with a step's weights kept gathered (`shard_model`)."""
    problem = memory_problem(model_args, args, gpus, gpu_bytes, host)
    if problem is None:
        return gpus > 1 and not memory_problem(model_args, args, gpus, gpu_bytes, host, keep_gathered=True)
    e = args.engine

    def engine(**changes) -> Args:
        return dataclasses.replace(args, engine=dataclasses.replace(e, **changes))
    shortest, tokens = args.data.max_prompt_tokens + args.sampling.max_new_tokens, e.max_tokens_per_microbatch
    kinds = [  # each kind of change, from the least to the most
        [("--activation-checkpointing", engine(activation_checkpointing=True), gpus)],
        [(f"--max-tokens-per-microbatch {t}", engine(max_tokens_per_microbatch=t), gpus)
         for t in (tokens // 2, tokens // 4) if t >= shortest],
        [("--offload-optimizer", engine(offload_optimizer=True), gpus),
         ("--offload-optimizer --activation-checkpointing",
          engine(offload_optimizer=True, activation_checkpointing=True), gpus)],
        [(f"--vllm-gpu-memory {share:g}", engine(vllm_gpu_memory=share), gpus)
         for share in (0.4, 0.3) if share < e.vllm_gpu_memory],
        [(f"torchrun --nproc-per-node {n}{flag}", changed, n) for n in (2, 4, 8) if n > gpus
         for flag, changed in (("", args), (" --activation-checkpointing",
                                            engine(activation_checkpointing=True)))],
        [("--save-every -1", dataclasses.replace(args, run=dataclasses.replace(args.run, save_every=-1)),
          gpus)],  # host memory: no saves, no copies
    ]
    fits = [next((what for what, changed, n in kind if not memory_problem(
        model_args, changed, n, gpu_bytes, host and (host[0], host[1] * n // gpus))), None) for kind in kinds]
    fits = [what for what in fits if what][:3]
    raise UsageError(f"{parameter_counts(model_args)[0] / 1e9:.2f}B parameters do not fit: {problem}; "
                     + (f"it would fit with {' or '.join(fits)}" if fits else "no one change makes it fit"))


def check_gpu_memory(model_args, args: Args, world: World) -> bool:
    """`check_memory` on this rank's GPU and host; prints the plan once."""
    gpu_bytes = torch.cuda.mem_get_info()[1]
    try:
        available = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo")
                         if line.startswith("MemAvailable"))
        host = (available, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except (OSError, StopIteration):  # not Linux: the host is not checked
        host = None
    keep_gathered = check_memory(model_args, args, world.size, gpu_bytes, host)
    if world.is_main:
        peaks = [f"{stage} {sum(parts.values()) / GiB:.1f}" for stage, parts
                 in memory_plan(model_args, args, world.size, gpu_bytes, keep_gathered).items()]
        fsdp = "; FSDP2 keeps a step's weights gathered" if keep_gathered else ""
        print(f"GPU memory planned, GiB of {gpu_bytes / GiB:.1f}: {', '.join(peaks)}{fsdp}")
    return keep_gathered


# ----- Several GPUs (torchrun): data parallel, FSDP2-sharded trainer -----
def gathered(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # a whole DTensor: every rank must call this


def local_part(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # this rank's shard of a sharded tensor


def gather(x: torch.Tensor, world: World) -> torch.Tensor:
    """Every rank's 1-D tensor (lengths may differ) in rank order; not pickled: that took 0.4-0.8 s."""
    if world.size == 1:
        return x
    device = world._device()
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world.size)]
    dist.all_gather(lengths, torch.tensor([len(x)], device=device))
    lengths = [int(n) for n in lengths]
    parts = [torch.empty(max(lengths), dtype=x.dtype, device=device) for _ in range(world.size)]
    dist.all_gather(parts, F.pad(x.to(device), (0, max(lengths) - len(x))))  # padded: equal sizes
    return torch.cat([part[:n] for part, n in zip(parts, lengths)]).to(x.device)


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()


def init_distributed(device: str) -> World:
    """Under torchrun (WORLD_SIZE > 1) join the process group (NCCL, or gloo on CPU) on this rank's GPU."""
    size = torchrun_rank_and_size()[1]
    if size > 1 and not dist.is_initialized():
        if device == "cuda":
            gpu = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(gpu)
            # device_id connects NCCL now: vLLM's batch-invariant mode later sets NCCL_MAX_NCHANNELS=1 and
            # NCCL_NTHREADS=1, read at connect, and FSDP would run on one channel (~1/10 speed, 2 GPUs = 1).
            dist.init_process_group("nccl", device_id=gpu)
        else:
            dist.init_process_group("gloo")
    return World(dist.get_rank(), size) if size > 1 else World()


def shard_model(model: Qwen3, world: World, keep_gathered: bool = False) -> Qwen3:
    """FSDP2, a unit per block plus the root (embedding, final norm, maybe-tied lm_head). Gradients
    reduce-scatter as fp32 sums, not means: the loss is already divided by all ranks' token count.
    `keep_gathered`: a step gathers the weights and reduce-scatters once (`reduce_gradients_after`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(model.device.type, (world.size,))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for unit in (*model.layers, model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no pre-multiplied one
    model.keep_gathered = keep_gathered
    return model


def reduce_gradients_after(model: Qwen3, last: bool) -> None:
    """Before a micro-batch. FSDP2's default gathers each block's weights in every micro-batch's forward and
    backward, and reduce-scatters its gradients after it. With `keep_gathered` the weights stay gathered and
    the gradients are summed whole in fp32 until the step's last micro-batch, which reduce-scatters them:
    two all-gathers and one reduce-scatter a step. A forward outside a step reshards (no stale copy)."""
    if getattr(model, "keep_gathered", False):
        model.set_reshard_after_forward(last)
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)


def reference_policy(model: Qwen3, world: World = World()) -> Qwen3:
    """A frozen copy of the policy (KL's reference), sharded as the policy is."""
    with torch.device(model.device):
        ref_model = Qwen3(model.args, model.kernels, model.tok_embeddings.weight.dtype).requires_grad_(False)
    with torch.no_grad():
        for p, ref in zip(model.parameters(), ref_model.parameters(), strict=True):
            ref.copy_(gathered(p))  # one gathered weight at a time
    return shard_model(ref_model, world) if world.size > 1 else ref_model


def shard_like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor sharded as `param` is (an FSDP2 DTensor), as a DTensor DCP can save and
    reshard, without a copy: it loads into `local`, on the host too (FSDP2 builds its offloaded shards so)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    if not isinstance(param, DTensor):
        return local
    meta = TensorMeta(param.shape, param.stride(), local.dtype)
    spec = DTensorSpec(param.device_mesh, param.placements, meta)
    return DTensor(local, spec, requires_grad=False)


def whole_step(rollouts: Rollouts, trainer_logprobs: list, world: World) -> tuple[Rollouts, list]:
    """Every rank's samples and trainer logprobs in rank (= sample) order: parity sees the whole step."""
    if world.size == 1:
        return rollouts, trainer_logprobs

    def gathered_list(pieces: list, dtype: torch.dtype, lengths: list[int]) -> list[torch.Tensor]:
        flat = torch.cat([torch.as_tensor(p, dtype=dtype) for p in pieces])
        return list(gather(flat, world).split(lengths))
    r = rollouts
    prompt_lens, completion_lens = (gather(torch.tensor([len(s) for s in seqs]), world).tolist()
                                    for seqs in (r.prompts, r.completions))
    prompts = [t.tolist() for t in gathered_list(r.prompts, torch.int64, prompt_lens)]
    completions = [t.tolist() for t in gathered_list(r.completions, torch.int64, completion_lens)]
    step = Rollouts(prompts, completions, gathered_list(r.vllm_logprobs, torch.float32, completion_lens),
                    gather(r.rewards, world), gather(r.advantages, world))
    return step, gathered_list(trainer_logprobs, torch.float32, completion_lens)


# ----- Checkpoints and resume: Hugging Face weights, sharded training state, the parity record -----
def to_host(t: torch.Tensor, wait: bool = True) -> torch.Tensor:
    """Into pinned memory, reused from copy to copy (fresh pageable memory copied at 1.3 GB/s on an H100).
    wait=False: the copy is queued on the stream; synchronize before reading it."""
    if t.is_cuda:
        t = t.to("cpu", non_blocking=True)  # non_blocking: into PyTorch's cache of pinned host memory
        if wait:
            torch.cuda.current_stream().synchronize()
    return t


def to_device(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A host tensor onto `like`'s GPU, through pinned memory (queued: a pageable copy would block)."""
    if t.device == like.device:
        return t
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
    return staged.to(like.device, non_blocking=True)


def stepped_on_host(optimizer: torch.optim.Optimizer, masters: list[torch.Tensor], grads: list[torch.Tensor]):
    """Offload (`MasterWeights`): each master after its AdamW step on the CPU; the next gradient is copied
    meanwhile."""
    pending = to_host(grads[0], wait=False)
    for i, master in enumerate(masters):
        if pending.is_pinned():
            torch.cuda.current_stream().synchronize()  # gradient i has arrived
        master.grad, pending = pending, to_host(grads[i + 1], wait=False) if i + 1 < len(grads) else None
        grads[i] = None
        optimizer.step()  # only this master has a gradient
        master.grad = None
        yield master


TRAINING_STATE = "training_state"  # vLLM and transformers read only the top level: a plain HF checkpoint
SHARD_BYTES = 4 * 2**30  # weights past this go in model-0000i-of-0000n.safetensors shards, as the hub's do
TOKENIZER_FILES = ("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template",
                   "generation_config")


def write_hf_checkpoint(weights: dict, source_dir: Path, directory: Path) -> None:
    """Host `weights` (HF names) as the hub's safetensors files, with the source's config and tokenizer."""
    names, sizes = list(weights), [t.nbytes for t in weights.values()]
    shards = [[names[i] for i in shard] for shard in bins(sizes, SHARD_BYTES)]
    files = ([f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
             if len(shards) > 1 else ["model.safetensors"])
    for file, shard in zip(files, shards):
        save_file({name: weights[name] for name in shard}, directory / file, metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(sizes)},
                 "weight_map": {name: file for file, shard in zip(files, shards) for name in shard}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = json.dumps(read_config(source_dir) | {"torch_dtype": "bfloat16"}, indent=2)
    (directory / "config.json").write_text(config)
    for f in source_dir.iterdir():
        if f.name.startswith(TOKENIZER_FILES):
            shutil.copy(f, directory / f.name)


def training_state(optimizer: MasterWeights, ref_model) -> dict:
    """What --resume needs beyond the weights, for DCP."""
    adam = optimizer.optimizer.state
    named = [(name, p, master) for (name, p), master in zip(optimizer.named, optimizer.masters)]
    rng = {"python": torch.tensor(random.getstate()[1]), "torch": torch.get_rng_state()}
    state = {"masters": {name: shard_like(master, p) for name, p, master in named},
             "adam": {name: {key: shard_like(t, p) if t.dim() else t for key, t in adam[master].items()}
                      for name, p, master in named},
             "rng": rng | ({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})}
    if ref_model is not None:
        state["reference"] = dict(ref_model.named_parameters())
    return state


def stack_versions() -> dict:
    from importlib.metadata import version
    smi = shutil.which("nvidia-smi")
    driver = smi and os.popen(f"{smi} --query-gpu=driver_version --format=csv,noheader").read().split("\n")[0]
    return {"torch": torch.__version__, "vllm": version("vllm"), "triton": version("triton"),
            "cuda": torch.version.cuda, "driver": driver or None,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def parity_record(args: Args, model: Qwen3, totals: dict) -> dict:
    a, device, exact = model.args, model.device, os.environ.get("VLLM_BATCH_INVARIANT") == "1"
    sms = _num_sms(device) if device.type == "cuda" else 132  # an H100's, for a run on the CPU
    gemms = qwen3_gemms(a.dim, a.hidden_dim, a.n_heads, a.n_kv_heads, a.head_dim, a.vocab_size)
    tiles = {f"{name} rows={m}": list(matmul_tiles(m, n, sms).values())
             for name, (n, _) in gemms.items() for m in (1, 32, 256, 8192)}
    kernels = {"batch_invariant": exact, "model_runner": "V2" if exact else "V1",  # as VLLMEngine runs
               "cuda_graphs": CUDA_GRAPHS if args.engine.vllm_cuda_graphs else "eager",
               "matmul_tiles (BLOCK_M, BLOCK_N, warps, stages)": tiles}
    return {"stack": stack_versions(), "kernels": kernels, "sampling": asdict(args.sampling), **totals}


def write_whole(path: Path, text: str) -> None:
    """All of `text`, or on a full disk the file as it was: a certificate is never left cut short."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_text(text)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


class CheckpointError(Exception):
    """A save that failed (a full disk): one line, exit status 1; the earlier checkpoints stand."""


class Checkpoints(dcp.FileSystemWriter):
    """<output_dir>/<run_name>/step_N, written as training goes on: `save` copies what the step left to host
    memory, which dcp.async_save's thread (not a process: it writes the copies where they lie) writes; `wait`
    (before the next save, at the last step, on an error) renames it once whole, keeping --keep-last. To DCP
    this is a rank's stager and writer, in one thread (DCP drops a writer thread's error)."""
    under_way = None  # the instance whose save is being written: one at a time in a process

    def __init__(self, model: Qwen3, optimizer: MasterWeights, ref_model, inputs, args: Args,
                 world: World = World()):
        # Page cache only (syncing doubled the save time): a kill keeps every save, a power cut earlier ones.
        # Host tensors only: no copy ahead, so no CUDA stream in DCP's thread (on GPU 0, whatever the rank).
        super().__init__(args.run.output_dir, sync_files=False, per_thread_copy_ahead=0)  # folder: per save
        self.model, self.optimizer, self.ref_model, self.inputs, self.args, self.world = (
            model, optimizer, ref_model, inputs, args, world)
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None  # `save`; vLLM's NCCL
        if not optimizer.masters[0].is_cuda:  # its state is written where it lies (`stage`): AdamW waits
            optimizer.optimizer.register_step_pre_hook(lambda *_: Checkpoints.end_write())  # no cycle to self
        if args.run.save_every >= 0:  # pinned memory is slow to make: now, not in the first save
            self.stage({"state": training_state(optimizer, ref_model),
                        "weights": {name: self.stage(t) for name, t in hf_weights(model) if world.is_main}})

    def stage(self, t):
        """In host memory training leaves alone: GPU tensors in PyTorch's pinned memory (`to_host`; freed, it
        serves the next save), host scalars cloned, other host tensors (offloaded: not copied) as they lie."""
        if isinstance(t, dict):
            return {k: self.stage(v) for k, v in t.items()}
        local = local_part(t)
        return shard_like(to_host(local), t) if local.is_cuda else t.clone() if t.dim() == 0 else t

    def save(self, step: int, totals: dict, tensorboard=None) -> None:
        """Starts writing step_N; `held`: the seconds training waited (the last step waits for the write)."""
        begun, args, world, writing = time.perf_counter(), self.args, self.world, Checkpoints.under_way
        self.wait()
        if writing is self and world.is_main and (waited := time.perf_counter() - begun) > 1:  # a slow disk
            print(f"checkpoint step_{step:06d} waited {waited:.1f} s for {self.out_dir.name}'s write "
                  f"({self.ended - self.begun:.1f} s, against {begun - self.begun:.1f} s of steps between "
                  "the saves): save less often (--save-every) or to a faster disk")
        self.out_dir = Path(args.run.output_dir) / args.run.run_name / f"step_{step:06d}"
        self.tmp = self.out_dir.with_name(f".{self.out_dir.name}.partial")
        if world.is_main:  # a partial folder a killed run left goes (DCP makes the new one, in its thread)
            shutil.rmtree(self.tmp, ignore_errors=True)
            if tensorboard is not None:  # it holds every step up to here: should the run die
                tensorboard.flush()
        barrier(world)
        self.totals, self.saved, self.tensorboard = totals, dict(totals), tensorboard
        self.run = {"args": asdict(args), "step": step, "world_size": world.size}
        self.hf = {n: self.stage(t) for n, t in hf_weights(self.model) if world.is_main}  # all ranks gather
        # DCP's collectives run in its thread: on a group of their own (gloo: async_save wants a CPU one)
        self.future = dcp.async_save(training_state(self.optimizer, self.ref_model), storage_writer=self,
                                     checkpoint_id=self.tmp / TRAINING_STATE, process_group=self.group,
                                     no_dist=world.size == 1)
        Checkpoints.under_way, self.begun, self.held = self, begun, time.perf_counter() - begun
        if step == args.optimizer.steps:  # the run ends with it: nothing to overlap
            self.wait()

    def finish(self, metadata, results) -> None:  # rank 0's, once all ranks' parts are: its error reaches all
        super().finish(metadata, results)
        write_hf_checkpoint(self.hf, self.inputs.model_dir, self.tmp)
        records = {"run.json": self.run, "parity.json": parity_record(self.args, self.model, self.saved)}
        for name, record in records.items():
            (self.tmp / TRAINING_STATE / name).write_text(json.dumps(record, indent=2))
        self.ended = time.perf_counter()

    @staticmethod
    def end_write(quietly: bool = False) -> None:
        """Until the save under way, if any, is written (`wait`): before AdamW's step, or at the end."""
        if Checkpoints.under_way is not None:
            Checkpoints.under_way.wait(quietly)

    def wait(self, quietly: bool = False) -> None:
        """Until the save under way is written (rank 0's DCP ends once every rank's part is); then renames it,
        or removes it and raises a CheckpointError on every rank (`quietly`, leaving on an error: not)."""
        if Checkpoints.under_way is not self:
            return
        Checkpoints.under_way, out, args, main = None, self.out_dir, self.args, self.world.is_main
        error, self.hf = self.future.exception(), None  # waits; DCP's error holds every rank's; weights freed
        if main:  # the partial folder, or the step_N it replaces
            shutil.rmtree(self.tmp if error else out, ignore_errors=True)
        if error and not quietly:
            causes = [*(cause for cause, _ in getattr(error, "failures", {}).values()), error]  # ranks' first
            disk = next((cause.strerror or cause for cause in causes if isinstance(cause, OSError)), None)
            barrier(self.world)  # every rank measures the disk once rank 0 removed the partial folder
            free, need = shutil.disk_usage(existing_parent(out)).free, checkpoint_bytes(args, self.model.args)
            # A disk that fills mid-file is no OSError to torch.save ("unexpected pos": a short write) nor to
            # safetensors: the disk's too if the checkpoint no longer fits; the line names the error.
            if disk is None and free >= need:  # not the disk's
                raise error
            first_line = str(causes[0]).partition("\n")[0]
            why = disk or f"{type(causes[0]).__name__}: {first_line}"
            if main and self.tensorboard is not None:  # the steps done keep their certificate, if it fits
                record = json.dumps(parity_record(args, self.model, self.totals), indent=2)
                with suppress(OSError):  # else the last one stands, and the line is still this error's
                    write_whole(Path(self.tensorboard.log_dir) / "parity.json", record)
            if main and out.parent.is_dir() and not any(out.parent.iterdir()):
                out.parent.rmdir()  # the run's first save: nothing of it stays
            last = sorted(out.parent.glob("step_[0-9]*")) if out.parent.exists() else []
            raise CheckpointError(f"checkpoint {out} not written ({why}): "
                                  f"{in_units(free)} free, it takes about {in_units(need)}; the last whole "
                                  f"checkpoint is {last[-1] if last else 'none'}") from None
        if main and not error:  # every rank's part written: renamed into place
            self.tmp.rename(out)
            print(f"checkpoint {out} written in {self.ended - self.begun:.1f} s, a {self.held:.1f} s stall")
            oldest = sorted(out.parent.glob("step_[0-9]*"))[: -args.run.keep_last]
            for old in [*out.parent.glob(".step_*"), *oldest]:  # and what a run killed mid-save left
                if old.resolve() != self.inputs.model_dir.resolve():  # a resumed run's tokenizer is there
                    shutil.rmtree(old)


def restore_training_state(checkpoint_dir: Path, optimizer: MasterWeights, ref_model, args: Args,
                           world: World = World()) -> dict:
    """Into this run's shards whatever the number of ranks that saved it; returns the tokens checked and
    mismatched so far, and warns if another stack (torch, vLLM, GPU...) wrote it."""
    state = training_state(optimizer, ref_model)
    dcp.load(state, checkpoint_id=checkpoint_dir / TRAINING_STATE, no_dist=world.size == 1)
    for group in optimizer.optimizer.param_groups:
        group["weight_decay"] = args.optimizer.weight_decay  # may change on resume; the lr is set every step
    random.setstate((3, tuple(state["rng"]["python"].tolist()), None))
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"]:
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    saved = json.loads((checkpoint_dir / TRAINING_STATE / "parity.json").read_text())
    changed = [f"{key} {saved['stack'].get(key)} -> {now}" for key, now in stack_versions().items()
               if saved["stack"].get(key) != now]
    if changed and world.is_main:
        print(f"warning: --resume {checkpoint_dir} was saved on another stack ({', '.join(changed)}): the "
              "run continues bit for bit only on the same one")
    return {key: saved[key] for key in ("tokens_checked", "mismatched_tokens")}


# ----- Logging: the terminal and TensorBoard -----
@contextmanager
def phase(name: str, times: dict, memory: dict):
    """Seconds, and the whole GPU's memory in use at the end: the peak, as PyTorch keeps what it reserved."""
    start = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        memory[name] = (total - free) / 2**30
    times[name] = time.perf_counter() - start


DISK_FULL = False  # a run leaving on a full disk: a thread dying as it exits (TensorBoard's) goes unseen


def copy_lines(path: str, verbose: bool) -> None:  # `log_to_file`'s copier, run in a Python of its own
    import contextlib, sys, time
    with open(path, "ab", buffering=0) as log:  # unbuffered: on a full disk a line is lost, not a buffer
        for line in sys.stdin.buffer:  # to the end: when no process writes to the pipe any more
            with contextlib.suppress(OSError):  # a full disk: still drain the pipe, or stderr's writers block
                log.write(time.strftime("%Y-%m-%d %H:%M:%S ").encode() + line)
            if verbose:
                print(line.decode(errors="replace"), end="", flush=True)


def log_to_file(run_name: str, verbose: bool, world: World) -> None:
    """From here on, all that reaches stderr, from Python or C++ (vLLM's log and progress bars, torch's and
    DCP's warnings), goes to runs/<run>/log.txt a line at a time, timestamped (log.rank<r>.txt on other
    ranks); with `verbose` (or VLLM_LOGGING_LEVEL=INFO) to the terminal too. The script's own lines are on
    stdout, its errors and any traceback on the terminal's stderr; an abort's Python stacks too."""
    import atexit, faulthandler, marshal, subprocess, traceback
    global TERMINAL
    verbose = verbose or os.environ.get("VLLM_LOGGING_LEVEL", "").upper() == "INFO"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")  # all of vLLM's log: it goes to the file
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    path = Path("runs") / run_name / ("log.txt" if world.is_main else f"log.rank{world.rank}.txt")
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    terminal, (read, write) = os.dup(2), os.pipe()
    # A process, not a thread, so that it outlives an abort of this one (NCCL's watchdog, C++) to log why;
    # it runs copy_lines' compiled code, not the file's text, which may have changed since it was read.
    call = f"types.FunctionType(marshal.loads({marshal.dumps(copy_lines.__code__)!r}), globals())"
    code = f"import marshal, types; {call}({str(path)!r}, {verbose})"
    copier = subprocess.Popen([sys.executable, "-c", code], stdin=read, stdout=terminal,
                              start_new_session=True)  # Ctrl-C: it still copies the last lines
    os.close(read)
    os.dup2(write, 2)  # fd 2 itself: C++ writes there too
    os.close(write)
    TERMINAL = os.fdopen(terminal, "w", buffering=1)
    faulthandler.enable(TERMINAL)  # a fatal signal: where each thread was, on the terminal
    sys.excepthook = lambda *exc: [traceback.print_exception(*exc, file=to) for to in (TERMINAL, sys.stderr)]

    def close() -> None:  # at exit: the pipe's last lines reach the file
        if dist.is_initialized():  # vLLM's group, or torchrun's: else NCCL warns on the terminal as it exits
            dist.destroy_process_group()
        sys.stderr.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY) if DISK_FULL else terminal, 2)  # a crash at exit: shown
        with suppress(subprocess.TimeoutExpired):  # the pipe ends when a child holding it ends too
            copier.wait(timeout=5)
    atexit.register(close)


def progress_bar(steps: range, name: str, world: World):
    """The steps, with a progress bar on the main rank."""
    from tqdm import tqdm
    return tqdm(steps, desc=name, unit="step", file=sys.stdout, initial=steps.start, total=steps.stop,
                disable=not world.is_main)


def log_line(line: str, world: World) -> None:
    from tqdm import tqdm
    if world.is_main:
        tqdm.write(line)  # above the progress bar


def open_tensorboard(args: Args, start_step: int):
    """runs/<run_name>; a resumed run purges the steps it logged after its checkpoint: each shows once."""
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(str(Path("runs") / args.run.run_name), purge_step=start_step or None)
    rows = [f"| {group}.{k} | {v} |" for group, values in asdict(args).items() for k, v in values.items()]
    rows.append(f"| VLLM_BATCH_INVARIANT | {os.environ.get('VLLM_BATCH_INVARIANT')} |")
    writer.add_text("config", "| flag | value |\n|---|---|\n" + "\n".join(rows), start_step)
    return writer


def log_step(writer, step: int, scalars: dict, line: str, world: World) -> None:
    if world.is_main:
        for key, value in scalars.items():
            writer.add_scalar(key, value, step)
    log_line(line, world)


def step_scalars(rollouts: Rollouts, loss_metrics: dict, parity: dict, grad_norm: float, lr: float,
                 deltas: dict, times: dict, memory: dict) -> dict:
    n_generated = sum(len(c) for c in rollouts.completions)
    scalars = {f"train/{k}": v for k, v in loss_metrics.items()} | {
        "train/grad_norm": grad_norm, "train/lr": lr, "reward/reward_mean": float(rollouts.rewards.mean()),
        "reward/reward_std": float(rollouts.rewards.std()),
        "reward/completion_tokens_mean": n_generated / len(rollouts.completions),
        "perf/generate_tokens_per_s": n_generated / times["generate"],
        "perf/train_tokens_per_s": n_generated / times["train"]}
    scalars |= {f"parity/{k}": v for k, v in parity.items()}
    scalars |= {f"time/{k}": v for k, v in times.items()} | {f"memory/{k}_gib": v for k, v in memory.items()}
    scalars |= {f"weight_delta/{layer}/{name}": value for layer, pair in deltas.items()
                for name, value in zip(("magnitude", "relative_change"), pair)}
    return scalars


def step_line(step: int, scalars: dict, times: dict, memory: dict) -> str:
    return (f"step {step}: reward {scalars['reward/reward_mean']:.3f} loss {scalars['train/loss']:+.5f} "
            f"ratio {scalars['train/ratio_mean']:.6f} grad {scalars['train/grad_norm']:.3f} | "
            + " ".join(f"{k} {v:.2f}s" for k, v in times.items())
            + (f" | GPU {max(memory.values()):.1f} GiB" if memory else ""))


def log_eval(engine, inputs, args: Args, updates: int, writer, world: World) -> None:
    """Greedy accuracy, logged at the number of GRPO updates made so far."""
    accuracy = evaluate(engine, inputs.tokenizer, inputs.eval_rows, args.sampling.max_new_tokens,
                        inputs.stop_ids, world)
    if world.is_main:
        writer.add_scalar("eval/accuracy", accuracy, updates)
    log_line(f"after {updates} GRPO steps: greedy accuracy {accuracy:.3f} on {len(inputs.eval_rows)} test "
             "questions", world)


def weight_deltas(changes: dict, world: World = World()) -> dict:
    """Per layer, over all ranks: the L2 norm of a step's weight change, and that relative to the weights."""
    squares = {}
    for name, square in changes.items():
        parts = name.split(".")
        layer = (f"layer_{int(parts[1]):02d}" if parts[0] == "layers" else
                 {"tok_embeddings": "embeddings", "norm": "final_norm", "output": "lm_head"}[parts[0]])
        squares[layer] = squares.get(layer, 0) + square
    totals = world.sum(torch.stack(list(squares.values()))).sqrt().tolist()
    return {layer: (change, change / size) for layer, (change, size) in zip(squares, totals)}


SAMPLER_PROBABILITY_BUCKETS = (0.0, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0)


def mismatch_by_probability(v: torch.Tensor, t: torch.Tensor) -> dict:
    """Per non-empty bucket of sampler probability (mismatch grows as it goes to 0): mean |logprob diff|,
    k3 KL and token share."""
    p, metrics, edges = v.exp(), {}, SAMPLER_PROBABILITY_BUCKETS
    for low, high in zip(edges, edges[1:]):
        tokens = (p >= low) & ((p < high) if high < 1 else (p <= high))
        if tokens.any():
            name = f"p_{low:g}-{high:g}"
            metrics[f"{name}/mean_abs_logprob_diff"] = float((v[tokens] - t[tokens]).abs().mean())
            metrics[f"{name}/vllm_kl"] = float(k3_kl(v[tokens], t[tokens]).mean())
            metrics[f"{name}/token_frac"] = float(tokens.float().mean())
    return metrics


def fp32_hex(x: float) -> str:
    """The fp32 bit pattern: two logprobs one ulp apart print differently (bf16 would hide it)."""
    return f"0x{int(torch.tensor(x, dtype=torch.float32).view(torch.int32)) & 0xFFFFFFFF:08x}"


def parity_report(vllm_logprobs: list[torch.Tensor], trainer_logprobs: list[torch.Tensor],
                  tokens: list[list[int]], show: int, mismatched: int) -> str:
    """The first `show` tokens of sample 0 with both logprobs and their fp32 bits; the count."""
    header = ("token", "vllm logprob", "trainer logprob", "vllm fp32 bits", "trainer fp32 bits", "diff")
    lines = ["  {:>8} {:>16} {:>16} {:>14} {:>17} {:>10}".format(*header)]
    for tok, a, b in list(zip(tokens[0], vllm_logprobs[0].tolist(), trainer_logprobs[0].tolist()))[:show]:
        lines.append(f"  {tok:>8} {a:>16.9f} {b:>16.9f} {fp32_hex(a):>14} {fp32_hex(b):>17} {b - a:>10.3g}")
    lines.append(f"  Bitwise identical: {mismatched == 0}, different tokens {mismatched} / "
                 f"{sum(len(x) for x in vllm_logprobs)}")
    return "\n".join(lines if show else lines[-1:])


def log_parity(step: int, rollouts, trainer_logprobs, parity: dict, show: int, world: World) -> None:
    report = parity_report(rollouts.vllm_logprobs, trainer_logprobs, rollouts.completions, show,
                           parity["mismatched_tokens"])
    log_line((f"step {step} parity (first tokens of sample 0):\n" if show else "") + report, world)


# ----- The divergence locator's glue (batch_invariant_backward.py holds it) -----
def find_first_divergence(engine: VLLMEngine, model: Qwen3, tokens: list[int]) -> str:
    """Both sides' tensors of a prefill of `tokens`, compared in forward order (batch_invariant_backward)."""
    batch = pack_sequences([tokens[:-1]], [tokens[-1:]], model.device)
    try:
        return first_divergence(trainer_trace(model, batch), vllm_trace(engine.llm, tokens))
    except Exception as e:  # a diagnostic must not hide the error it diagnoses
        return f"not found, the locator failed ({type(e).__name__}: {e})"


def run_as_script(args: Args, **stand_ins) -> None:
    """The error boundary, one line: a usage error exits 2; broken parity, a failed save, a full disk 1."""
    try:
        main(args, quiet=True, **stand_ins)
    except UsageError as e:
        exit_on(e, 2)
    except ParityError as e:
        exit_on(f"bitwise parity broken at {e}", 1)
    except CheckpointError as e:
        exit_on(e, 1)
    except OSError as e:  # a disk full beneath TensorBoard, the log or a cache (a save's: a CheckpointError)
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        global DISK_FULL
        DISK_FULL, where = True, f": {e.filename}" if e.filename else ""
        exit_on(f"the disk is full ({e.strerror}{where}); any checkpoints written are whole: free some "
                "space, then --resume from the last one", 1)


if __name__ == "__main__":
    run_as_script(COMMAND_LINE)
