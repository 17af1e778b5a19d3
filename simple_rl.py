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
batch-invariant (fused add+RMSNorm, top-k/top-p) or slower than need be for the same bits (matmul, norms,
q/k norms + rotary, log-softmax); its sampler draws all requests' seeded noise in one launch, not one each.

How this GRPO departs from the paper (Shao et al., 2024):
1. One optimizer step per batch of rollouts (on-policy); PPO-clip kept, to measure sampler/trainer mismatch.
2. The loss is averaged over all completion tokens of the step (token-level, as in DAPO).
3. k3 KL to the frozen reference in the loss (coefficient 0 by default: no reference model); entropy bonus.
4. Advantages (r - mean) / (std + 1e-4), unbiased group std; --no-std-normalize: r - mean (Dr. GRPO).
5. An optional supervised warm start (--sft-steps) on the train set's reference answers.
6. The policy trained is the one sampled: softmax(logits / T), restricted to what --top-k and --top-p keep.
"""

import array
import errno
import functools
import gc
import itertools
import json
import math
import os
import random
import re
import sys
import weakref
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Literal, NamedTuple

import tyro

from plumbing import (
    FIXED, CheckpointError, Checkpoints, Fit, ModelShape, UsageError, agreed_run_name, check_args,
    check_gpu_memory, default_is, exit_on, exit_on_full_disk, gather_step, init_distributed, load_inputs,
    log_eval, log_line, log_parity, log_step, log_to_file, open_tensorboard, parity_record,
    parse_command_line, progress_bar, read_files, reshard, restore_training_state, routing_metrics,
    shard_model, step_line, step_scalars, timed_phase, torchrun_rank_and_size, weight_deltas, write_whole)

# ===== Flags: every flag; a field's comment is its --help =====
@dataclass
class Data:
    """The model, the data and the seed."""
    model: Annotated[str, FIXED] = "Qwen/Qwen3-1.7B"  # Qwen3 hub id, or local directory (config, safetensors)
    # local train jsonl or parquet (question, answer); pass --eval-dataset too, or --eval-every 0
    dataset: Annotated[str | None, FIXED, default_is("openai/gsm8k 'main' train, from the hub")] = None
    eval_dataset: Annotated[str | None, default_is("openai/gsm8k 'main' test")] = None  # local test file
    # 'chat': the tokenizer's chat template; 'plain': 'Question: ...', then 'Answer:'; 'auto': chat if any
    prompt_format: Annotated[Literal["auto", "chat", "plain"], FIXED] = "auto"
    thinking: Annotated[bool, FIXED] = False  # let Qwen3's chat template open a <think> block (long answers)
    max_prompt_tokens: Annotated[int, FIXED] = 512  # longer prompts are skipped (counted at start), never cut
    seed: Annotated[int, FIXED] = 0  # seed of the data order, the sampling and the trainer


@dataclass
class Sampling:
    """What vLLM samples each step: the policy trained is the distribution it samples from."""
    prompts_per_step: Annotated[int, FIXED] = 32  # GSM8K questions per step (a multiple of torchrun's N)
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


# ===== Data and reward =====
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# A completion's answer: the first '#### N' (GSM8K's format; words or markdown may come between on its line:
# '#### **18**'), else the first '\boxed{N ...}', else its last number; after a closed <think>, the one after
# it, else inside. Compared as decimals: '1,000' = '$1000.0', '-$5' = '$-5' = '-5'.
NUMBER = r"(-?\s*\\?\$?\s*-?[\d,]*\.?\d+)"
ANSWER_AFTER_HASHES = re.compile(r"####\s*[^\d\n$\\-]*" + NUMBER)
ANSWER_IN_BOX = re.compile(r"\\boxed\{\s*" + NUMBER + r"[^}]*\}")
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
        return None if text is None else Decimal(re.sub(r"[\s,$\\]", "", text).rstrip("."))
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


# Before torch and vLLM load (seconds): --help, a bad flag or a bad file answer at once.
if __name__ == "__main__":
    try:
        COMMAND_LINE = check_args(parse_command_line(Args, __doc__), torchrun_rank_and_size()[1])
        FILES = read_files(COMMAND_LINE, ANSWER_AFTER_HASHES)
    except UsageError as e:
        exit_on(e, 2)

import torch  # noqa: E402  (after the flags and files are checked: see above)
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from batch_invariant_backward import (  # noqa: E402
    CUDA_GRAPHS, EXACT, KEYS_PER_ROW, SAMPLED, AttentionSpans, Kernels, first_divergence,
    install_exact_kernels, restore_block_table_pointers, rope_cos_sin_cache, row_runs, tensor_checksum,
    trainer_trace, vllm_trace, vllm_weights_checksum)

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

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D tensor (lengths may differ) in rank order; not pickled: that took 0.4-0.8 s."""
        if self.size == 1:
            return x
        device = self._device()
        lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.size)]
        dist.all_gather(lengths, torch.tensor([len(x)], device=device))
        lengths = [int(n) for n in lengths]
        parts = [torch.empty(max(lengths), dtype=x.dtype, device=device) for _ in range(self.size)]
        dist.all_gather(parts, F.pad(x.to(device), (0, max(lengths) - len(x))))  # padded: equal sizes
        return torch.cat([part[:n] for part, n in zip(parts, lengths)]).to(x.device)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


# ===== Model: Qwen3 on vLLM's kernels, over packed sequences =====
@dataclass
class PackedBatch:
    """Samples (prompt + completion) back to back, no padding, and which logits to read."""
    tokens: torch.Tensor  # (T,) token ids
    positions: torch.Tensor  # (T,) position of each token in its own sequence
    spans: AttentionSpans  # which rows each row's attention reads
    target_rows: torch.Tensor  # (C,) rows whose logits predict a completion token
    targets: torch.Tensor  # (C,) those completion tokens
    completion_lens: list[int]


def prompt_shared(prompts: list[list[int]], completions: list[list[int]], i: int) -> bool:
    """Sample i reads the prompt rows of the sample before it (GRPO's G samples of a prompt lie together)."""
    return i > 0 and len(completions[i]) > 0 and prompts[i] == prompts[i - 1]


def pack_sequences(prompts: list[list[int]], completions: list[list[int]], device) -> PackedBatch:
    """Samples back to back, a prompt's rows once for the samples after it with the same prompt: each adds its
    completion's rows only, whose attention reads the prompt's keys where they lie (as vLLM's decode reads a
    prompt's cached keys). Every other op is a row's alone: each sample's bits stay; G-1 of G prompts go."""
    # The host's share of a step, before the GPU has work: one pass over Python's ints, then tensor ops.
    shared = torch.tensor([prompt_shared(prompts, completions, i) for i in range(len(prompts))])
    own = ([] if share else p for p, share in zip(prompts, shared.tolist()))  # the prompt rows a sample adds
    tokens = torch.frombuffer(array.array("q", itertools.chain.from_iterable(
        itertools.chain.from_iterable(zip(own, completions)))), dtype=torch.long)
    prompt_lens, completion_lens = torch.tensor([len(p) for p in prompts]), [len(c) for c in completions]
    seqlens = prompt_lens + torch.tensor(completion_lens)
    added = seqlens - prompt_lens * shared  # each sample's rows: its span of queries
    starts, firsts = added.cumsum(0) - added, seqlens.cumsum(0) - seqlens  # in rows; in sequences' keys
    owner = torch.where(shared, 0, torch.arange(len(prompts))).cummax(0).values  # whose prompt rows it reads
    # A sample's sequence (its keys, in order): its prompt's rows, then its completion's.
    rows = row_runs(torch.stack([starts[owner], starts + added - seqlens + prompt_lens], 1).flatten(),
                    torch.stack([prompt_lens, seqlens - prompt_lens], 1).flatten())
    positions = torch.arange(len(tokens)) - (starts - (seqlens - added)).repeat_interleave(added)
    # Row t's logits predict the sequence's next token: a completion token is read a row before its own.
    predicting = row_runs(firsts + prompt_lens - 1, seqlens - prompt_lens)  # indices into `rows`
    spans = AttentionSpans.sequences(added, device)._replace(  # the keys: each sample's sequence
        cu_seqlens_k=F.pad(seqlens.cumsum(0), (1, 0)).to(device, torch.int32),
        max_seqlen_k=int(seqlens.max()), kv_rows=rows.to(device) if shared.any() else None)
    return PackedBatch(tokens=tokens.to(device), positions=positions.to(device), spans=spans,
                       target_rows=rows[predicting].to(device),
                       targets=tokens[rows[predicting + 1]].to(device), completion_lens=completion_lens)


def packed_micro_batches(prompts, completions, token_budget: int, device, world: World = World()) -> list:
    """[(indices, PackedBatch)] in sample order, as many on every rank, each of <= `token_budget` rows (a
    prompt's once for the samples that share it), KEYS_PER_ROW times as many keys (an item larger alone)."""
    groups, rows, keys = [], 0, 0
    for i, (p, c) in enumerate(zip(prompts, completions)):
        adds = len(c) if prompt_shared(prompts, completions, i) else len(p) + len(c)
        if not groups or rows + adds > token_budget or keys + len(p) + len(c) > KEYS_PER_ROW * token_budget:
            groups, rows, keys, adds = [*groups, []], 0, 0, len(p) + len(c)
        groups[-1].append(i)
        rows, keys = rows + adds, keys + len(p) + len(c)
    count = world.max(len(groups))
    while len(groups) < count:  # halve the group of most samples (the sums stay the same)
        i = max(range(len(groups)), key=lambda j: len(groups[j]))
        groups[i:i + 1] = [groups[i][: len(groups[i]) // 2], groups[i][len(groups[i]) // 2:]]
    return [(idx, pack_sequences([prompts[i] for i in idx], [completions[i] for i in idx], device))
            for idx in groups]


# Each forward runs the kernels the exact engine runs for the module (vLLM 0.20's batch-invariant ones, or
# ours with their bits), in the same order and dtypes; KERNEL_CALLS names them in order for the locator.
class Attention(nn.Module):
    KERNEL_CALLS = ("qkv", "rotary", "attention", "o_proj")

    def __init__(self, args, kernels: Kernels):
        super().__init__()
        self.args, self.kernels = args, kernels
        # One merged [q; k; v] projection, as vLLM's QKVParallelLinear serves it.
        self.wqkv = nn.Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)

    def forward(self, x, positions, cos_sin_cache, spans: AttentionSpans) -> torch.Tensor:
        ops, a = self.kernels, self.args
        T, H, Hk, D = x.shape[0], a.n_heads, a.n_kv_heads, a.head_dim
        q, k, v = ops.linear(x, self.wqkv.weight).split([H * D, Hk * D, Hk * D], dim=-1)
        # Each head RMS-normed, then rotated: one kernel, as the engine runs it (q (T, H, D), k (T, Hk, D)).
        q, k = ops.qk_norm_rotary(q.view(T, H, D), k.view(T, Hk, D), self.q_norm.weight, self.k_norm.weight,
                                  a.norm_eps, positions, cos_sin_cache)
        out = ops.attention(q, k, v.reshape(T, Hk, D), spans, D**-0.5)  # (T, H, D)
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


class MoE(nn.Module):
    """Qwen3-MoE's sparse block as vLLM's `FusedMoE` serves it: a router (bf16 logits), the top-k experts of
    its softmax, each a SwiGLU of its own, their outputs weighted and summed. torchtitan's names; `w13` holds
    each expert's [gate; up] as vLLM's `w13_weight` does."""
    KERNEL_CALLS = ("router", "route", "experts")

    def __init__(self, args, kernels: Kernels):
        super().__init__()
        self.kernels, m, I = kernels, args.moe_args, args.moe_inter_dim
        self.top_k, self.renormalize = m.top_k, m.route_norm
        self.router = nn.ModuleDict({"gate": nn.Linear(args.dim, m.num_experts, bias=False)})
        self.experts = nn.ParameterDict({"w13": nn.Parameter(torch.empty(m.num_experts, 2 * I, args.dim)),
                                         "w2": nn.Parameter(torch.empty(m.num_experts, args.dim, I))})
        self.routed = None  # the training forwards' tokens per expert, and their router entropy's sum
        self.chosen = None  # the last forward's experts of each token (T, k)

    def forward(self, x, spans: AttentionSpans) -> torch.Tensor:
        ops = self.kernels
        logits = ops.linear(x, self.router.gate.weight)  # (T, E)
        weights, ids = ops.route(logits, self.top_k, self.renormalize)  # (T, k) each
        self.chosen = ids.detach()
        # For `routing_metrics`, in training forwards (a recomputation with --activation-checkpointing counts
        # again: the ratios stay); a row once per sample it is part of (a shared prompt's: once each), so the
        # sums do not depend on the packing; counted in fp64: exact, whatever the order.
        if torch.is_grad_enabled():
            with torch.no_grad():
                uses = (torch.ones(len(x), dtype=torch.float64, device=x.device) if spans.kv_rows is None
                        else torch.bincount(spans.kv_rows, minlength=len(x)).double())
                routed = logits.new_zeros(logits.shape[1] + 1, dtype=torch.float64)
                routed.index_add_(0, ids.reshape(-1), uses.repeat_interleave(ids.shape[1]))
                routed[-1] = torch.special.entr(torch.softmax(logits.float(), dim=-1)).sum(-1).double() @ uses
                self.routed = routed if self.routed is None else self.routed + routed
        return ops.experts(x, self.experts.w13, self.experts.w2, weights, ids)


def expert_set_differences(model: nn.Module, batch, sampler_experts: list[torch.Tensor]) -> torch.Tensor:
    """For a run without batch invariance: of the (token, layer) routings of `batch` (a PackedBatch) in the
    trainer's last forward, how many chose another set of experts than vLLM's sampler (`sampler_experts`:
    each sequence's, (tokens but its last, layers, k), as vLLM returns them), and how many were compared."""
    ours = torch.stack([layer.moe.chosen for layer in model.layers], dim=1)  # (T, layers, k)
    spans = batch.spans  # a sample's rows: its span's keys (its prompt's rows may be another's)
    ours = ours if spans.kv_rows is None else ours[spans.kv_rows]
    fed = torch.ones(len(ours), dtype=torch.bool, device=ours.device)
    fed[spans.cu_seqlens_k[1:].long() - 1] = False  # a sequence's last token: vLLM never runs it
    theirs = torch.cat(sampler_experts).to(ours.device, torch.int64)
    if theirs.shape != ours[fed].shape:
        raise RuntimeError(f"vLLM returned experts of {tuple(theirs.shape)} (tokens, layers, k); the "
                           f"trainer routed {tuple(ours[fed].shape)}")
    differ = (ours[fed].long().sort(-1).values != theirs.sort(-1).values).any(-1)
    return torch.stack([differ.sum(), torch.tensor(differ.numel(), device=differ.device)]).double()


class TransformerBlock(nn.Module):
    KERNEL_CALLS = ("attention_norm", "ffn_norm")

    def __init__(self, args, kernels: Kernels):
        super().__init__()
        self.eps, self.kernels = args.norm_eps, kernels
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args, kernels)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if args.moe_enabled:  # torchtitan's names, which its Hugging Face adapter maps
            self.moe = MoE(args, kernels)
        else:
            self.feed_forward = FeedForward(args, kernels)

    def forward(self, h, residual, positions, cos_sin_cache, spans: AttentionSpans):
        """(h, residual) of the layer below -> this layer's (h, residual), each (T, dim)."""
        ops = self.kernels
        # Layer 0's first norm has no add; every later norm adds the residual first: (norm, sum), one kernel.
        normed, residual = ((ops.rms_norm(h, self.attention_norm.weight, self.eps), h) if residual is None
                            else ops.rms_norm(h, self.attention_norm.weight, self.eps, residual))
        h = self.attention(normed, positions, cos_sin_cache, spans)
        normed, residual = ops.rms_norm(h, self.ffn_norm.weight, self.eps, residual)
        return (self.moe(normed, spans) if hasattr(self, "moe") else self.feed_forward(normed)), residual


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
        hidden = self.hidden_states(batch.tokens, batch.positions, batch.spans)
        return TokenLogprobs(*self.kernels.lm_head_logprobs(hidden[batch.target_rows], self.output_weight,
                                                            batch.targets, temperature, top_k, top_p))

    def hidden_states(self, tokens, positions, spans: AttentionSpans) -> torch.Tensor:
        h, residual = self.kernels.embedding(tokens, self.tok_embeddings.weight), None
        for layer in self.layers:
            inputs = (h, residual, positions, self.cos_sin_cache, spans)
            if self.activation_checkpointing and torch.is_grad_enabled():
                # The recomputation runs the same deterministic kernels: the same bits again.
                h, residual = torch.utils.checkpoint.checkpoint(layer, *inputs, use_reentrant=False)
            else:
                h, residual = layer(*inputs)
        return self.kernels.rms_norm(h, self.norm.weight, self.args.norm_eps, residual)[0]


# ===== Weights: Hugging Face checkpoints in and out =====
def model_args_from_hf_config(config: dict):
    """torchtitan's Qwen3ModelArgs from a Hugging Face `config.json` (checked by plumbing's `read_config`):
    Qwen3, or Qwen3-MoE (every layer sparse, softmax top-k routing, no shared expert)."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    moe = config["model_type"] == "qwen3_moe"
    return Qwen3ModelArgs(
        moe_enabled=moe, moe_inter_dim=config.get("moe_intermediate_size", 0),
        moe_args=MoEArgs(num_experts=config["num_experts"], num_shared_experts=0, score_func="softmax",
                         route_norm=config.get("norm_topk_prob", False), top_k=config["num_experts_per_tok"],
                         load_balance_coeff=None) if moe else MoEArgs(),
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"], n_kv_heads=config["num_key_value_heads"],
        vocab_size=config["vocab_size"], hidden_dim=config["intermediate_size"],
        norm_eps=config["rms_norm_eps"], max_seq_len=config["max_position_embeddings"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        rope_theta=rope.get("rope_theta", config.get("rope_theta")),
        enable_weight_tying=config.get("tie_word_embeddings", False))


def from_hf_state_dict(hf_state: dict, args) -> dict:
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter
    state = Qwen3StateDictAdapter(args, None).from_hf(dict(hf_state))
    if args.enable_weight_tying:
        state.pop("output.weight")  # the adapter aliases it to the embedding; we keep one tensor
    for i in range(args.n_layers):
        attn, ffn = f"layers.{i}.attention.", f"layers.{i}.feed_forward."
        state[attn + "wqkv.weight"] = torch.cat([state.pop(attn + w + ".weight") for w in ("wq", "wk", "wv")])
        if args.moe_enabled:
            experts = f"layers.{i}.moe.experts."
            state[experts + "w13"] = torch.cat([state.pop(experts + w) for w in ("w1", "w3")], dim=1)
        else:
            state[ffn + "w13.weight"] = torch.cat([state.pop(ffn + w + ".weight") for w in ("w1", "w3")])
    return state


def gathered(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # a whole DTensor: every rank must call this


def local_part(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # this rank's shard of a sharded tensor


def whole_parameters(model: Qwen3):
    """(name, weight) of each weight, whole. FSDP2-sharded: a unit's (a few blocks', the root's) gathered
    in one collective and copied out (FSDP2 frees them, also if the reader stops); every rank reads all."""
    if not hasattr(model, "unshard"):
        yield from model.named_parameters()
        return
    names = {module: name for name, module in model.named_modules()}
    for unit in model.fsdp_units:  # a few blocks at a time, then the root: a unit's modules gathered together
        unit[0].unshard()
        try:
            yield from ((name, p.detach().clone()) for m in unit for name, p in m.named_parameters(names[m])
                        if not (m is model and name.startswith("layers.")))  # the root's own
        finally:
            unit[0].reshard()


def hf_weights(model: Qwen3):
    """(HF name, view) of each weight, gathered a unit at a time if sharded (`whole_parameters`)."""
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter
    a = model.args
    adapter, q, kv = Qwen3StateDictAdapter(a, None), a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    for name, p in whole_parameters(model):
        p, prefix = p.detach(), name.rsplit(".", 2)[0] + "."  # layers.<i>.attention. etc.
        if name.endswith("attention.wqkv.weight"):
            parts = dict(zip([prefix + w + ".weight" for w in ("wq", "wk", "wv")], p.split([q, kv, kv])))
        elif name.endswith("feed_forward.w13.weight"):
            parts = dict(zip([prefix + "w1.weight", prefix + "w3.weight"], p.chunk(2)))
        elif name.endswith("moe.experts.w13"):  # (E, 2I, H): each expert's gate and up rows
            parts = dict(zip([prefix + "experts.w1", prefix + "experts.w3"], p.chunk(2, dim=1)))
        else:
            parts = {name: p}
        yield from adapter.to_hf(parts).items()


def load_qwen3(model_dir: Path, device, kernels: Kernels = EXACT, dtype=torch.bfloat16,
               activation_checkpointing: bool = False) -> Qwen3:
    """A Hugging Face Qwen3 checkpoint (checked by plumbing's `check_checkpoint`) as our Qwen3."""
    args = model_args_from_hf_config(json.loads((model_dir / "config.json").read_text()))
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


def model_shape(args) -> ModelShape:
    """What plumbing's checks and memory plan count of a Qwen3 of these (torchtitan's) args, on no memory."""
    with torch.device("meta"):
        model = Qwen3(args)
    return ModelShape(args, {name: tuple(p.shape) for name, p in model.named_parameters()},
                      {name: tuple(t.shape) for name, t in hf_weights(model)})


def trainer_checksum(model: Qwen3, world: World) -> int:
    """The whole weights' `tensor_checksum`s, summed over each rank's shards."""
    return int(world.sum(torch.stack([tensor_checksum(n, p) for n, p in model.named_parameters()]).sum()))


# ===== vLLM engine, and the weight push =====
class VLLMEngine:
    """vLLM in this process, on this GPU, token ids in and out; it knows the checksum of what it serves."""

    def __init__(self, model_dir: Path, gpu_memory_utilization: float, max_model_len: int, seed: int,
                 cuda_graphs: bool = True, sleep_mode: bool = True,
                 return_routed_experts: bool = False, **vllm_args):
        self.exact = os.environ.get("VLLM_BATCH_INVARIANT") == "1"  # then V2's runner: less host work a step
        os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_V2_MODEL_RUNNER=str(int(self.exact)))
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # quiet; =INFO brings vLLM's log back
        import vllm
        if self.exact:
            install_exact_kernels()  # V2's sampler among them: the trainer's ops, logprobs kept on the GPU
        graphs = {"compilation_config": CUDA_GRAPHS} if cuda_graphs else {"enforce_eager": True}
        self.llm = vllm.LLM(
            model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", seed=seed,
            enable_sleep_mode=sleep_mode, enable_prefix_caching=not return_routed_experts,  # a prompt's G
            # samples prefill it once (a cached token is not routed again: its experts would be missing)
            logprobs_mode="processed_logprobs",  # of the distribution sampled from: after T, top-k/p
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
            attention_config={"backend": "FLASH_ATTN", "flash_attn_version": 3}, max_num_seqs=256,
            enable_return_routed_experts=return_routed_experts,  # a mixture of experts' choices, each token's
            **graphs, **vllm_args,  # more of vllm.LLM's: main's torchrun launcher, tests' fixed KV cache
        )  # fmt: skip
        self.served_checksum, self.sleep_mode = self.weights_checksum(), sleep_mode
        self.return_routed_experts, self.routed_experts = return_routed_experts, None  # the last generate's

    def generate(self, prompts: list[list[int]], max_tokens: list[int], temperature: float, seeds: list,
                 stop_token_ids=(), ignore_eos: bool = False, top_k: int = 0, top_p: float = 1.0):
        """One completion per prompt: token ids, the fp32 logprob of each (T < 1e-5: greedy, logprobs at
        T = 1). A seed per request, as vLLM takes them: requests may share one, or have None."""
        from vllm import SamplingParams, TokensPrompt
        params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=n, seed=s,
                                 logprobs=None if self.exact else 0, flat_logprobs=True, detokenize=False,
                                 stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                                 extra_args={"recorded_row": row})  # where the exact sampler keeps its draws
                  for row, (n, s) in enumerate(zip(max_tokens, seeds))]
        collecting = gc.isenabled()  # vLLM's host work bounds a decode step: GC passes on its objects add ~5%
        gc.disable()
        try:
            with (SAMPLED.recording(len(prompts), max(max_tokens, default=0), "cuda") if self.exact
                  else nullcontext()):
                samples = [out.outputs[0] for out in self.llm.generate(
                    [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)]
                completions = [list(s.token_ids) for s in samples]
                if self.return_routed_experts:  # a sample's: (its tokens but the last, layers, k)
                    self.routed_experts = [torch.from_numpy(s.routed_experts) for s in samples]
                return completions, SAMPLED.read(completions) if self.exact else [  # fp32 in Python floats
                    torch.tensor(s.logprobs.logprobs, dtype=torch.float32) for s in samples]
        finally:
            if collecting:
                gc.enable()

    def sleep(self) -> None:  # level 2 discards the weights, not copied to the host (new ones are pushed)
        if self.sleep_mode:  # else vLLM stays awake beside the trainer (the plan fits both)
            self.llm.sleep(level=2)

    def wake_up(self, tags: list[str]) -> None:
        if self.sleep_mode:  # first the trainer's freed blocks (and a push's) go back, for vLLM to map
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=tags)  # the same addresses (CUDA graphs stay valid); contents not restored
            if self.exact and "kv_cache" in tags:
                self.llm.collective_rpc(restore_block_table_pointers)

    def push_weights(self, model: Qwen3) -> None:  # no disk: vLLM's `load_weights` fills its merged slots
        self.llm.apply_model(lambda served: served.load_weights(hf_weights(model)))
        self.llm.reset_prefix_cache()  # the cached prompts' keys are the old weights'

    def weights_checksum(self) -> int:
        return self.llm.apply_model(vllm_weights_checksum)[0]

    def sync_weights(self, model: Qwen3, world: World, changed: bool) -> None:
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
    warmup = min(cfg.warmup_steps, cfg.steps)  # a run shorter than its warm-up warms up over all its steps
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def adamw_on_host(optimizer: torch.optim.AdamW, masters: list, grads: list, weights: list, streams: tuple):
    """AdamW on the CPU a parameter at a time; yields each master rounded on its weight's GPU. Gradients come
    down and masters go up on `streams` (made once: memory is cached per stream) as AdamW runs."""
    compute, (down, up) = torch.cuda.current_stream(), streams
    down.wait_stream(compute)  # the clipped gradients
    def fetch(i: int) -> tuple[torch.Tensor, torch.cuda.Event]:  # into PyTorch's cache of pinned host memory
        with torch.cuda.stream(down):
            return grads[i].to("cpu", non_blocking=True), down.record_event()
    pending = fetch(0)
    for i, (master, weight) in enumerate(zip(masters, weights)):
        pending[1].synchronize()  # gradient i is down: its GPU memory (a view of the sums) may go
        (master.grad, _), grads[i] = pending, None
        pending = fetch(i + 1) if i + 1 < len(grads) else None
        optimizer.step()  # only this master has a gradient
        master.grad = None
        with torch.cuda.stream(up):
            wide = master.to(weight.device, non_blocking=True)
        compute.wait_stream(up)
        wide.record_stream(compute)  # up's memory: not reused before the compute stream has read it
        yield wide.to(weight.dtype)


def host_masters(owner, shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 copies of `shards` in one host allocation, page-locked on a GPU while `owner` lives (PyTorch's
    pinned memory would round 33 GB up to 64), each its own storage (DCP copies a view to save it)."""
    flat = torch.empty(sum(sizes := [shard.numel() for shard in shards]), dtype=torch.float32)
    if shards[0].is_cuda:  # portable (1): pinned for every device's context
        if error := int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.nbytes, 1)):
            raise RuntimeError(f"cudaHostRegister of the fp32 masters failed: CUDA error {error}")
        weakref.finalize(owner, torch.cuda.cudart().cudaHostUnregister, flat.data_ptr())
    return [torch.from_numpy(p.numpy()).view(s.shape).copy_(s) for p, s in zip(flat.split(sizes), shards)]


class MasterWeights:
    """AdamW on fp32 masters of this rank's bf16 parameters (FSDP2 shards), whose bf16 rounding the trainer
    and vLLM run. A step's gradients are summed in fp32 on each parameter (`main_grad`, as in Megatron-LM) as
    each is made (one GPU: by its kernel), never all at once. `offload`: the masters and AdamW's moments (12
    bytes a parameter) on the host, AdamW on its CPU (`adamw_on_host`): another run, as exact."""

    def __init__(self, model: Qwen3, lr: float, weight_decay: float, offload: bool = False):
        self.named = list(model.named_parameters())
        if torch.cuda.is_available():  # the state lives as long as the run: in segments of its own, so that
            torch.cuda.empty_cache()  # what training frees between steps can go back to vLLM
        shards = [local_part(p).detach() for _, p in self.named]
        self.masters = (host_masters(self, shards) if offload
                        else [shard.to(torch.float32, copy=True) for shard in shards])
        self.streams = (torch.cuda.Stream(), torch.cuda.Stream()) if offload and shards[0].is_cuda else None
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay, fused=True)
        for master in self.masters:  # its state, made now as its first step would (fused: one pass over it)
            self.optimizer.state[master] = {"step": master.new_zeros(()), "exp_avg": torch.zeros_like(master),
                                            "exp_avg_sq": torch.zeros_like(master)}
        self.ends = list(itertools.accumulate(-(-local_part(p).numel() // 128) * 128 for _, p in self.named))
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
        """Before a step's first micro-batch: its fp32 sums, views of one allocation at 512-byte starts as
        cudaMalloc's (one a parameter cost ~0.1 s a step), together, not in the holes activations leave."""
        sums = torch.zeros(self.ends[-1], dtype=torch.float32, device=self.named[0][1].device)
        for (_, p), start in zip(self.named, [0, *self.ends]):
            p.main_grad = sums[start:start + local_part(p).numel()].view(local_part(p).shape)

    def accumulate_grads(self) -> None:
        """After a micro-batch's backward: the gradients FSDP2 reduce-scattered into the sums."""
        for _, p in self.named:
            self.fold(p)

    @torch.no_grad()
    def step(self, lr: float, max_grad_norm: float, world: World = World()) -> tuple[float, dict]:
        """Clip the gradients by their norm over all ranks, step AdamW and round the masters into the bf16
        weights. Returns the pre-clip norm and, per parameter, the squared L2 norms of its change and of its
        old value (this rank's part; plumbing's `weight_deltas` sums them over ranks)."""
        grads = [p.main_grad for _, p in self.named]
        for _, p in self.named:
            p.main_grad = None
        norm = torch.nn.utils.get_total_norm(grads)
        if world.size > 1:  # each rank's norm is of its shards
            norm = world.sum(norm.pow(2)).sqrt()
        scale = torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)  # as clip_grads_with_norm_ computes it
        torch._foreach_mul_(grads, scale)
        self.optimizer.param_groups[0]["lr"] = lr  # one group
        olds = [local_part(p) for _, p in self.named]
        if self.streams:  # offloaded from a GPU (a CPU-run trainer's masters are where its weights are)
            news = adamw_on_host(self.optimizer, self.masters, grads, olds, self.streams)
        else:
            for master, grad in zip(self.masters, grads):
                master.grad = grad
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)  # the fp32 gradients free their memory until next step
            news = (master.to(old.dtype) for master, old in zip(self.masters, olds))
        del grads
        changes = {}
        for (name, _), new, old in zip(self.named, news, olds):
            changes[name] = torch.stack([(new.float() - old.float()).pow(2).sum(), old.float().pow(2).sum()])
            old.copy_(new)
        return float(norm), changes


@dataclass
class Rollouts:
    """G samples of each of P prompts, sample j of prompt i at index i * G + j."""
    prompts: list[list[int]]  # (P * G,): each sample's prompt
    completions: list[list[int]]
    vllm_logprobs: list[torch.Tensor]  # (len(completion),) fp32 each
    rewards: torch.Tensor  # (P * G,)
    advantages: torch.Tensor  # (P * G,)
    sampler_experts: list[torch.Tensor] | None = None  # a mixture of experts' choices in vLLM, if returned


def rollout_seeds(seed: int, step: int, n: int) -> list[int]:
    """One sampling seed per request, unique over the run: completions depend on nothing else."""
    return [seed * 1_000_000_000 + step * n + j for j in range(n)]


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
    return Rollouts(prompts, completions, logprobs, rewards, advantages, engine.routed_experts)


def evaluate(engine, tokenizer, rows: list[dict], max_new_tokens: int, stop_ids,
             world: World = World()) -> float:
    """Greedy accuracy of the served policy on GSM8K test questions (each rank answers its share)."""
    mine = rows[world.share(len(rows))]
    completions, _ = engine.generate([r["prompt_ids"] for r in mine], [max_new_tokens] * len(mine), 0.0,
                                     [0] * len(mine), stop_ids)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    correct = sum(gsm8k_reward(text, r["answer"]) for text, r in zip(texts, mine))
    return float(world.sum(torch.tensor(correct, dtype=torch.float64))) / len(rows)


def reference_policy(model: Qwen3) -> Qwen3:
    """A frozen copy of the policy (KL's reference), whole: shard it as the policy is."""
    with torch.device(model.device):
        ref_model = Qwen3(model.args, model.kernels, model.tok_embeddings.weight.dtype).requires_grad_(False)
    with torch.no_grad():
        for p, ref in zip(model.parameters(), ref_model.parameters(), strict=True):
            ref.copy_(gathered(p))  # one gathered weight at a time
    return ref_model


@torch.no_grad()
def reference_logprobs(ref_model: Qwen3, rollouts: Rollouts, args: Args,
                       world: World = World()) -> list[torch.Tensor]:
    """Reference policy logprobs of the sampled tokens for k3 KL (temperature only: KL refuses top-k/p)."""
    out = []
    for _, batch in packed_micro_batches(rollouts.prompts, rollouts.completions,
                                         args.engine.max_tokens_per_microbatch, ref_model.device, world):
        out += ref_model(batch, args.sampling.temperature).logprobs.split(batch.completion_lens)
    if hasattr(ref_model, "reshard"):  # FSDP2 keeps the root gathered for a backward; none follows
        ref_model.reshard()
    return out


def reduce_gradients_after(model: Qwen3, i: int, count: int) -> None:
    """Before micro-batch i of `count`, and after the last (i = count). With `keep_gathered`, FSDP2 gathers
    in the first forward and keeps the weights to the last backward, which reduce-scatters the fp32 gradient
    sums (by default: both every micro-batch); then its defaults: a later forward keeps no stale copy."""
    if getattr(model, "keep_gathered", False) and i in (0, count - 1, count):  # each set walks every module
        model.set_reshard_after_forward(i >= count)
        model.set_requires_gradient_sync(i >= count - 1)
        model.set_reshard_after_backward(i >= count - 1)
        if i >= count:  # after an error too: none left gathered
            reshard(model)


def train_on_rollouts(model: Qwen3, optimizer: MasterWeights, rollouts: Rollouts, ref_logprobs, args: Args,
                      world: World = World()):
    """Forward + backward in micro-batches. Returns the step's scalars (loss terms' per-token means, ESS,
    routing) and the logprobs per sample, which parity checks against vLLM (no extra forward)."""
    device, s, budget = model.device, args.sampling, args.engine.max_tokens_per_microbatch
    n_tokens = int(world.sum(torch.tensor(sum(len(c) for c in rollouts.completions), device=device)))
    sums, logprobs, routings = [], [], []  # per micro-batch, kept on the GPU
    experts = rollouts.sampler_experts  # a mixture of experts' choices in vLLM, when not batch-invariant
    optimizer.zero_grads()
    batches = packed_micro_batches(rollouts.prompts, rollouts.completions, budget, device, world)
    # Copied to the GPU before the loop: a copy from host memory waits for the GPU to run all it was given.
    per_token = [(rollouts.advantages[idx].repeat_interleave(torch.tensor(batch.completion_lens)).to(device),
                  torch.cat([rollouts.vllm_logprobs[i] for i in idx]).to(device)) for idx, batch in batches]
    try:
        for i, ((idx, batch), (advantages, sampler_logprobs)) in enumerate(zip(batches, per_token)):
            reduce_gradients_after(model, i, len(batches))  # several GPUs: once a step, if it fits
            policy = model(batch, s.temperature, s.top_k, s.top_p)
            if experts is not None:
                routings.append(expert_set_differences(model, batch, [experts[j] for j in idx]))
            ref = None if ref_logprobs is None else torch.cat([ref_logprobs[j] for j in idx])
            loss, terms = grpo_loss(policy, sampler_logprobs, advantages, lengths=batch.completion_lens,
                                    ref_logprobs=ref, n_tokens=n_tokens, cfg=args.loss)
            loss.backward()
            optimizer.accumulate_grads()
            sums.append(terms)
            logprobs.append(policy.logprobs.detach())
    finally:  # also on an error: no gathered copy outlives the step
        reduce_gradients_after(model, len(batches), len(batches))
    # One host copy per step (no sync per micro-batch). Divide on the host: CUDA divides by a scalar via its
    # reciprocal, turning a ratio sum of exactly n_tokens into a mean one ulp below 1.
    totals = world.sum(torch.stack([torch.stack(list(t.values())) for t in sums]).sum(0)).tolist()
    metrics = {name: total / n_tokens for name, total in zip(sums[0], totals)}
    weight, weight_sq = metrics["correction_weight_mean"], metrics["correction_weight_sq_mean"]
    metrics["correction_ess"] = weight**2 / weight_sq if weight_sq else 0.0  # Kish's: 1 if all weights equal
    if s.top_k == 0 and s.top_p == 1:  # every token kept: nothing to report
        del metrics["kept_tokens"], metrics["cut_mass"]
    if routings:  # the share of tokens' routings (token, layer) to another set of experts than the sampler's
        differ, compared = world.sum(torch.stack(routings).sum(0)).tolist()
        metrics["expert_set_differs"] = differ / compared
    return metrics, list(torch.cat(logprobs).cpu().split([len(c) for c in rollouts.completions]))


def sft_step(model: Qwen3, optimizer: MasterWeights, rows: list[dict], args: Args,
             world: World = World()) -> float:
    """One SFT warm-start step on the reference answers (the policy at T = 1). Returns the mean token loss."""
    rows = rows[world.share(len(rows))]
    prompts, answers = [r["prompt_ids"] for r in rows], [r["answer_ids"] for r in rows]
    n_tokens = int(world.sum(torch.tensor(sum(len(a) for a in answers))))
    total, budget = 0.0, args.engine.max_tokens_per_microbatch
    optimizer.zero_grads()
    batches = packed_micro_batches(prompts, answers, budget, model.device, world)
    try:
        for i, (_, batch) in enumerate(batches):
            reduce_gradients_after(model, i, len(batches))
            loss = -model(batch).logprobs.sum() / n_tokens
            loss.backward()
            optimizer.accumulate_grads()
            total += float(loss.detach())
    finally:
        reduce_gradients_after(model, len(batches), len(batches))
    optimizer.step(args.warm_start.sft_lr, args.optimizer.max_grad_norm, world)
    return float(world.sum(torch.tensor(total, dtype=torch.float64)))


# ===== Parity: every sampled token's logprob, compared bit for bit =====

class ParityError(Exception):
    """A sampled token whose trainer logprob is not bitwise vLLM's (exit status 1)."""


SAMPLER_PROBABILITY_BUCKETS = (0.0, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0)


def mismatch_by_probability(v: torch.Tensor, t: torch.Tensor) -> dict:
    """Per non-empty bucket of sampler probability (mismatch grows toward 0): mean |diff|, k3 KL, share."""
    p, metrics, edges = v.exp(), {}, SAMPLER_PROBABILITY_BUCKETS
    for low, high in zip(edges, edges[1:]):
        tokens = (p >= low) & ((p < high) if high < 1 else (p <= high))
        if tokens.any():
            name = f"p_{low:g}-{high:g}"
            metrics[f"{name}/mean_abs_logprob_diff"] = float((v[tokens] - t[tokens]).abs().mean())
            metrics[f"{name}/vllm_kl"] = float(k3_kl(v[tokens], t[tokens]).mean())
            metrics[f"{name}/token_frac"] = float(tokens.float().mean())
    return metrics


Mismatch = NamedTuple("Mismatch", [("message", str), ("sample", int), ("token", int)])
def compare_bits(vllm_logprobs: list[torch.Tensor], trainer_logprobs: list[torch.Tensor],
                 completions: list[list[int]], world: World = World()) -> tuple[dict, Mismatch | None]:
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
    where = f" (sampled on rank {sample * world.size // len(completions)})" if world.size > 1 else ""
    message = (f"sample {sample}{where} token {token} (id {completions[sample][token]}): vLLM logprob "
               f"{float(v[flat])!r} but trainer {float(t[flat])!r}; {mismatched} of {len(v)} tokens differ")
    return metrics, Mismatch(message, sample, token)


def find_first_divergence(engine: VLLMEngine, model: Qwen3, tokens: list[int]) -> str:
    """Both sides' tensors of a prefill of `tokens`, compared in forward order (batch_invariant_backward)."""
    batch = pack_sequences([tokens[:-1]], [tokens[-1:]], model.device)
    try:
        return first_divergence(trainer_trace(model, batch), vllm_trace(engine.llm, tokens))
    except Exception as e:  # a diagnostic must not hide the error it diagnoses
        return f"not found, the locator failed ({type(e).__name__}: {e})"


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
    # Answers as the model should write them after the prompt, then the end of an answer (<|im_end|> in chat),
    # cut as a rollout is at --max-new-tokens: RoPE's table and the memory plan hold no longer sequence.
    plain = args.data.prompt_format == "plain" or inputs.tokenizer.chat_template is None
    for r in inputs.train_rows:
        answer = inputs.tokenizer.encode((" " if plain else "") + r["answer"], add_special_tokens=False)
        r["answer_ids"] = (answer + inputs.stop_ids[:1])[: args.sampling.max_new_tokens]
    optimizer = MasterWeights(model, args.warm_start.sft_lr, args.optimizer.weight_decay,
                              args.engine.offload_optimizer)
    writer = SummaryWriter(str(Path("runs") / args.run.run_name / "warm_start")) if world.is_main else None
    for step in progress_bar(range(args.warm_start.sft_steps), "warm start", world):
        rows = step_rows(inputs.train_rows, order, step, args.warm_start.sft_batch_size)
        loss = sft_step(model, optimizer, rows, args, world)
        routing = routing_metrics(model, world)  # a mixture of experts': the step's (and the sums restart)
        if world.is_main:
            writer.add_scalar("sft/loss", loss, step)
            for name, value in routing.items():
                writer.add_scalar(f"sft/{name}", value, step)
    if world.is_main:
        writer.close()


def grpo_step(step: int, sample, engine, model: Qwen3, optimizer: MasterWeights, ref_model, args: Args,
              writer=None, world: World = World()) -> tuple[Rollouts, dict]:
    """One GRPO step. vLLM generates the step's rollouts (`sample()`) as the trainer's state waits in memory,
    sleeps (unless it fits beside) as the trainer trains on them (each sampled token's logprob checked bit for
    bit against vLLM's), then serves the new weights. Logs the step; returns all ranks' rollouts, scalars."""
    times, memory, o = {}, {}, args.optimizer
    with timed_phase("generate", times, memory, world):
        rollouts = sample()
    with timed_phase("train", times, memory, world):
        engine.sleep()
        ref_logprobs = None if ref_model is None else reference_logprobs(ref_model, rollouts, args, world)
        metrics, logprobs = train_on_rollouts(model, optimizer, rollouts, ref_logprobs, args, world)
        metrics |= routing_metrics(model, world)  # a mixture of experts': its training forwards' routing
        rollouts, logprobs = gather_step(rollouts, logprobs, world)  # every rank's samples
        parity, first = compare_bits(rollouts.vllm_logprobs, logprobs, rollouts.completions, world)
        log_parity(step, rollouts, logprobs, parity, args.parity.parity_report_tokens, world)
        if first and (args.parity.assert_bitwise or args.parity.locate_divergence):
            on_mismatch(first, engine, model, rollouts, parity, step, args, writer, world)
        grad_norm, changes = optimizer.step(lr := lr_at(step, o), o.max_grad_norm, world)
    deltas = weight_deltas(changes, world)  # per layer, over the ranks: a change must change what vLLM serves
    with timed_phase("push", times, memory, world):
        engine.sync_weights(model, world, changed=any(change > 0 for change, _ in deltas.values()))
    scalars = step_scalars(rollouts, metrics, parity, grad_norm, lr, deltas, times, memory)
    log_step(writer, step, scalars, step_line(step, scalars, times, memory), world)
    return rollouts, scalars


def grpo(args: Args, engine, model: Qwen3, ref_model, inputs, order: list[int], writer,
         world: World = World()) -> None:
    """GRPO's steps from `inputs.start_step` on, with greedy evaluations, checkpoints and the run's
    certificate of exactness (parity.json): the tokens checked, and mismatched."""
    s, o, run = args.sampling, args.optimizer, args.run
    optimizer = MasterWeights(model, o.lr, o.weight_decay, args.engine.offload_optimizer)
    checkpoints = Checkpoints(model, functools.partial(hf_weights, model), optimizer, ref_model,
                              inputs.model_dir, args, world)  # its host memory, made now
    totals = (restore_training_state(inputs.model_dir, optimizer, ref_model, args, world) if inputs.start_step
              else {"tokens_checked": 0, "mismatched_tokens": 0})

    def evaluation(updates: int) -> None:  # greedy accuracy after `updates` GRPO steps
        accuracy = evaluate(engine, inputs.tokenizer, inputs.eval_rows, s.max_new_tokens, inputs.stop_ids,
                            world)
        log_eval(writer, updates, accuracy, len(inputs.eval_rows), world)
    if run.eval_every and inputs.start_step % run.eval_every == 0:  # before training, or a resume when due
        evaluation(inputs.start_step)
    for step in progress_bar(range(inputs.start_step, o.steps), "GRPO", world):
        rows = step_rows(inputs.train_rows, order, step, s.prompts_per_step)
        sample = functools.partial(rollout, engine, inputs.tokenizer, rows, args, step, inputs.stop_ids,
                                   world)
        rollouts, scalars = grpo_step(step, sample, engine, model, optimizer, ref_model, args, writer, world)
        totals["tokens_checked"] += sum(len(c) for c in rollouts.completions)
        totals["mismatched_tokens"] += scalars["parity/mismatched_tokens"]
        last = step == o.steps - 1
        if run.eval_every and ((step + 1) % run.eval_every == 0 or last):
            evaluation(step + 1)
        if run.save_every >= 0 and (last or run.save_every and (step + 1) % run.save_every == 0):
            checkpoints.save(step + 1, totals, writer)  # written as the next step runs; the last waited for
    if world.is_main:
        record = json.dumps(parity_record(args, model, totals), indent=2)
        write_whole(Path(writer.log_dir) / "parity.json", record)


def main(args: Args, device: str = "cuda", engine_class=VLLMEngine, quiet: bool = False, files=None) -> Path:
    """Train; returns runs/<run>. Tests give a CPU stand-in `engine_class`; the script runs `quiet`, with its
    flags and `files` checked before torch loaded."""
    if files is None:
        args = check_args(args, torchrun_rank_and_size()[1])
        files = read_files(args, ANSWER_AFTER_HASHES)
    inputs = load_inputs(args, files, model_shape(model_args_from_hf_config(files.config)), encode_dataset)
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("no CUDA GPU found: simple_rl.py runs vLLM and the trainer on a GPU")
    world = World(*init_distributed(device, args.engine.offload_optimizer))
    args = agreed_run_name(args, world)  # runs/<name> and the checkpoints: one folder for every rank
    # Before vLLM starts: a model that cannot fit is refused, not run out of memory (the CPU is not planned).
    fit = check_gpu_memory(inputs.shape, args, world) if device == "cuda" else Fit(True, vllm_awake=False)
    if quiet:
        log_to_file(args.run.run_name, args.run.verbose, world)
    random.seed(args.data.seed)  # the loop draws from no global generator: seeded (and saved) for additions
    torch.manual_seed(args.data.seed)
    # torchrun: an engine a rank (vLLM's external launcher, no vLLM data parallelism) samples alone.
    parallel = {"distributed_executor_backend": "external_launcher"} if world.size > 1 else {}
    # Without batch invariance, a mixture of experts' sampler and trainer can route a token otherwise: logged.
    inexact_moe = inputs.shape.args.moe_enabled and os.environ.get("VLLM_BATCH_INVARIANT") != "1"
    engine = engine_class(inputs.model_dir, args.engine.vllm_gpu_memory,  # first: claims an empty GPU
                          args.data.max_prompt_tokens + args.sampling.max_new_tokens, args.data.seed,
                          cuda_graphs=args.engine.vllm_cuda_graphs, return_routed_experts=inexact_moe,
                          sleep_mode=not fit.vllm_awake, **parallel)
    model = load_qwen3(inputs.model_dir, device,
                       activation_checkpointing=args.engine.activation_checkpointing)
    if world.size > 1:
        shard_model(model, world, fit.keep_gathered)
    engine.check_weights(model, world)
    writer = open_tensorboard(args, inputs.start_step) if world.is_main else None
    order = list(range(len(inputs.train_rows)))
    random.Random(args.data.seed).shuffle(order)
    if args.warm_start.sft_steps and not args.run.resume:  # a resumed run's weights are warm already
        engine.sleep()
        warm_start(model, inputs, order, args, world)
        engine.sync_weights(model, world, changed=True)
    try:
        ref_model = reference_policy(model) if args.loss.kl_coef > 0 else None  # KL to GRPO's start
        if ref_model is not None and world.size > 1:
            shard_model(ref_model, world)
        grpo(args, engine, model, ref_model, inputs, order, writer, world)
    finally:  # also on an error: a save under way ends, the failing step's parity scalars reach the disk
        Checkpoints.end_write(quietly=True)
        if world.is_main:  # on a full disk TensorBoard's last write fails too: not over the run's own error
            with suppress(OSError) if sys.exc_info()[0] else nullcontext():
                writer.close()
    return Path("runs") / args.run.run_name


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
        exit_on_full_disk(e)


if __name__ == "__main__":
    run_as_script(COMMAND_LINE, files=FILES)
