"""Bitwise-exact on-policy GRPO: Qwen3 on GSM8K, rollouts from vLLM, training on a TorchTitan-style Qwen3
that runs vLLM's own kernels. On every GPU the two take turns.

    VLLM_BATCH_INVARIANT=1 python simple_rl.py            # Qwen3-1.7B and GSM8K from the hub
    VLLM_BATCH_INVARIANT=1 python simple_rl.py --model DIR --dataset train.jsonl --eval-dataset test.jsonl
    VLLM_BATCH_INVARIANT=1 torchrun --nproc-per-node 2 simple_rl.py ...   # data parallel, FSDP2 trainer
    VLLM_BATCH_INVARIANT=1 python simple_rl.py --resume checkpoints/RUN/step_000100   # continue a run
    python simple_rl.py --no-assert-bitwise                # batch invariance off: the mismatch is reported
    tensorboard --logdir runs

The guarantee, checked every step on every sampled token and asserted unless --no-assert-bitwise: the fp32
logprob the trainer computes for a sampled token equals, bit for bit, the logprob vLLM returned when it
sampled that token, whatever the batch either side ran it in. So the policy that generated the data is
exactly the policy being trained (the importance ratio is exactly 1), and k3 KL between them is exactly 0.
It holds with VLLM_BATCH_INVARIANT=1 on vLLM 0.20.0 (FlashAttention 3, CUDA graphs without torch.compile),
three of whose kernels this script swaps in-process, in the engine and the trainer
alike: the fused add+RMSNorm (not batch-invariant in 0.20), the matmul (re-tiled per batch size: the same
bits, sooner) and top-k/top-p (one implementation at every batch size).

How this GRPO departs from the paper (Shao et al., 2024):
1. One optimizer step per batch of rollouts: strictly on-policy. The PPO-clip surrogate is kept, so the
   ratio and clip statistics measure the only source of off-policyness left: numerical mismatch between
   sampler and trainer (zero with batch invariance on).
2. The loss is averaged over all completion tokens of the step (token-level, as in DAPO), not per
   sequence and then per group; long and short completions weigh the same per token.
3. KL to the frozen reference uses the k3 estimator, added to the loss (coefficient 0 by default, which
   skips the reference model entirely); an optional entropy bonus.
4. Advantages are group-normalised, (r - mean) / (std + 1e-4) with the unbiased std of the group;
   --no-std-normalize keeps only r - mean (as in Dr. GRPO).
5. An optional supervised warm start (--sft-steps) on the train set's reference answers.
6. The policy optimised is the one sampled from: softmax(logits / T) at --temperature T, restricted to the
   tokens --top-k and --top-p keep (vLLM's processed logprobs); with neither, at T = 1, the model itself.
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
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Literal, NamedTuple

import tyro

# =============================================================================================
# Args: every flag, checked before anything is loaded
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
    """'chat': the tokenizer's chat template; 'plain': 'Question: ...', then 'Answer:' on a new line;
    'auto': chat if the tokenizer has a template"""
    thinking: bool = False
    """let Qwen3's chat template open a <think> block (long completions)"""
    max_prompt_tokens: int = 512
    """longer prompts are skipped (and counted at start), never cut"""
    seed: int = 0
    """seed of the data order, the sampling and the trainer"""


@dataclass
class Sampling:
    """What vLLM samples each step: the policy trained is the distribution it samples from."""

    prompts_per_step: int = 32
    """GSM8K questions per step"""
    samples_per_prompt: int = 8
    """G: completions sampled per question, the group advantages are normalised over"""
    max_new_tokens: int = 512
    """completion length limit"""
    temperature: float = 1.0
    """sampling temperature: the policy is softmax(logits / T), exact at any T"""
    top_k: int = 0
    """sample among the k most likely tokens only (vLLM's top-k); 0 keeps them all"""
    top_p: float = 1.0
    """sample among the most likely tokens whose probabilities sum to p (vLLM's top-p); 1 keeps them all"""


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
    """steps of teacher forcing on the train set's reference answers, before GRPO"""
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
    """with --no-assert-bitwise: at every step with a mismatch, find the first op whose bits differ (as a
    parity abort always does): a prefill through vLLM and through the trainer, compared tensor by tensor"""


@dataclass
class Engine:
    """How vLLM and the trainer share the GPU."""

    vllm_gpu_memory: float = 0.5
    """share of the GPU's memory vLLM holds while it generates (its weights, KV cache and CUDA graphs);
    it gives all of it back while the trainer runs"""
    vllm_cuda_graphs: bool = True
    """replay decode steps as CUDA graphs (no torch.compile: same kernels, same bits as eager);
    --no-vllm-cuda-graphs runs vLLM eager, for debugging"""
    max_tokens_per_microbatch: int = 8192
    """tokens (prompts + completions, packed) in one trainer forward + backward; activation memory grows
    with it; gradients are accumulated over micro-batches"""
    activation_checkpointing: bool = False
    """keep only each layer's input in the forward and recompute the layer in the backward: a fraction
    of the activation memory for about a third more train time"""


@dataclass
class Run:
    """Evaluation, TensorBoard, checkpoints and resuming."""

    eval_every: int = 20
    """greedy GSM8K accuracy before training, every N steps and at the end; 0 disables"""
    eval_samples: int = 256
    """test questions per evaluation"""
    run_name: str | None = None
    """TensorBoard run runs/<run_name>, checkpoints <output_dir>/<run_name>; default: a timestamp"""
    output_dir: str = "checkpoints"
    """where checkpoints are written"""
    save_every: int = 0
    """checkpoint every N steps (one is always written at the end): Hugging Face weights that vLLM and
    transformers load, plus the training state that --resume continues from"""
    keep_last: int = 3
    """checkpoints of the run kept on disk, the newest; 0 keeps all"""
    resume: str | None = None
    """a checkpoint (<output_dir>/<run_name>/step_N) to continue its run from, with the run's saved flags;
    flags given too may change what a resume may (learning rate, steps, logging, checkpoints). Bit for bit
    on the same number of GPUs; on another, the state is restored exactly but gradients sum in another
    order"""


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


RUN_DEFINING = {"data": ("model", "dataset", "seed", "prompt_format", "thinking", "max_prompt_tokens"),
                "sampling": tuple(f.name for f in dataclasses.fields(Sampling)), "loss": ("kl_coef",)}
"""The flags a resumed run shares with the run it continues: the data order, the sampling seeds, the batch
shape and the reference model follow from them. The others (learning rate, --steps, ...) may change."""


class UsageError(Exception):
    """Bad flags, files or environment: reported as one line, exit status 2, before anything slow."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def args_from_dict(saved: dict) -> Args:
    return Args(**{f.name: f.default_factory(**saved[f.name]) for f in dataclasses.fields(Args)})


def saved_run(checkpoint: Path) -> tuple[Args, int]:
    """The flags a checkpoint's run was started with, and its step."""
    run_file = checkpoint / "training_state" / "run.json"
    if not checkpoint.is_dir():
        raise UsageError(f"--resume {checkpoint}: no such directory")
    if not run_file.is_file():
        raise UsageError(f"--resume {checkpoint}: not a checkpoint of this script (no {run_file.name} in "
                         f"{run_file.parent.name}/)")
    run = json.loads(run_file.read_text())
    try:
        return args_from_dict(run["args"]), run["step"]
    except (KeyError, TypeError):
        raise UsageError(f"--resume {checkpoint}: written by another version of simple_rl.py (its flags "
                         "differ); resume it with that version") from None


def parse_command_line(argv: list[str] | None = None) -> Args:
    """The flags. With --resume, the run's saved flags, overridden by those given."""
    setting = ("Set VLLM_BATCH_INVARIANT=1 in the environment: vLLM reads it at import, and without it the "
               "logprobs cannot be bitwise equal.")
    options = dict(args=argv, config=(tyro.conf.OmitArgPrefixes, tyro.conf.DisallowNone),
                   description=" ".join(__doc__.split("\n\n")[0].split()) + " " + setting)
    args = tyro.cli(Args, **options)
    if args.run.resume is None:
        return args
    return tyro.cli(Args, default=saved_run(Path(args.run.resume))[0], **options)


def same_value(a, b) -> bool:
    """Flag values compared as a resume compares them: paths after resolving them."""
    if isinstance(a, str) and isinstance(b, str) and Path(a).exists() and Path(b).exists():
        return Path(a).resolve() == Path(b).resolve()
    return a == b


def check_resume(args: Args) -> tuple[Args, int]:
    """The args of a resumed run (its name kept) and the step it resumes after; every flag that
    contradicts the run it continues is named in one error."""
    saved, step = saved_run(Path(args.run.resume))
    clashes = [f"{flag(name)} {getattr(getattr(args, group), name)!r} (the run has "
               f"{getattr(getattr(saved, group), name)!r})"
               for group, names in RUN_DEFINING.items() for name in names
               if not same_value(getattr(getattr(args, group), name), getattr(getattr(saved, group), name))]
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
        existing = next(p for p in (root, *root.absolute().parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise UsageError(f"{what} {root}: {existing} is not a writable directory")
        if not run.resume and (root / run.run_name).exists():
            raise UsageError(f"--run-name {run.run_name}: {root / run.run_name} exists already; pick another "
                             "name, or --resume one of its checkpoints")


def check_args(args: Args, world_size: int) -> Args:
    """Bad flag values, combinations, environment and output paths fail here, before anything is loaded
    or written. Returns the args with what derives from them: the run name (a timestamp; a resumed run
    keeps its own) and a warm-up no longer than the run."""
    d, s, lo, o, w, p, e, r = (getattr(args, f.name) for f in dataclasses.fields(Args))
    invariant = os.environ.get("VLLM_BATCH_INVARIANT")
    checks = [
        (o.steps >= 1, "--steps must be at least 1"),
        (s.prompts_per_step >= 1, "--prompts-per-step must be at least 1"),
        (s.samples_per_prompt >= 2, "--samples-per-prompt must be at least 2: GRPO normalises rewards "
                                    "within each group"),
        (s.max_new_tokens >= 1, "--max-new-tokens must be at least 1"),
        (d.max_prompt_tokens >= 1, "--max-prompt-tokens must be at least 1"),
        (s.temperature > 0, "--temperature must be > 0 (evaluation is greedy by itself)"),
        (s.top_k >= 0, "--top-k must be >= 0 (0 keeps every token)"),
        (0 < s.top_p <= 1, "--top-p must be in (0, 1] (1 keeps every token)"),
        (lo.kl_coef == 0 or (s.top_k == 0 and s.top_p == 1),
         "--kl-coef must be 0 with --top-k or --top-p: a sampled token can lie outside the reference "
         "policy's kept set, where the KL is infinite"),
        (o.lr > 0, "--lr must be > 0"),
        (o.warmup_steps >= 0, "--warmup-steps must be >= 0"),
        (0 <= o.min_lr_ratio <= 1, "--min-lr-ratio must be between 0 and 1"),
        (o.weight_decay >= 0, "--weight-decay must be >= 0"),
        (o.max_grad_norm > 0, "--max-grad-norm must be > 0"),
        (lo.clip_eps > 0, "--clip-eps must be > 0"),
        (0 <= lo.correction_min < lo.correction_max, "need 0 <= --correction-min < --correction-max"),
        (lo.kl_coef >= 0, "--kl-coef must be >= 0"),
        (lo.entropy_coef >= 0, "--entropy-coef must be >= 0"),
        (e.max_tokens_per_microbatch >= d.max_prompt_tokens + s.max_new_tokens,
         "--max-tokens-per-microbatch must hold one whole sequence "
         "(>= --max-prompt-tokens + --max-new-tokens)"),
        (w.sft_steps >= 0, "--sft-steps must be >= 0"),
        (w.sft_lr > 0, "--sft-lr must be > 0"),
        (w.sft_batch_size >= 1, "--sft-batch-size must be at least 1"),
        (p.parity_report_tokens >= 0, "--parity-report-tokens must be >= 0"),
        (0 < e.vllm_gpu_memory < 1, "--vllm-gpu-memory must be a fraction between 0 and 1"),
        (r.eval_every >= 0, "--eval-every must be >= 0"),
        (r.eval_samples >= 1, "--eval-samples must be at least 1"),
        (r.save_every >= 0, "--save-every must be >= 0"),
        (r.keep_last >= 0, "--keep-last must be >= 0"),
        (not (d.dataset and r.eval_every and not d.eval_dataset),
         "--dataset is local: pass --eval-dataset (a local test jsonl) too, or --eval-every 0"),
        (invariant in (None, "0", "1"),
         f"VLLM_BATCH_INVARIANT is {invariant!r}, but vLLM reads it as an integer: "
         "set VLLM_BATCH_INVARIANT=1"),
        (not p.assert_bitwise or invariant == "1",
         f"VLLM_BATCH_INVARIANT is {invariant or 'not set'}, so vLLM's logprobs cannot equal the trainer's: "
         "set VLLM_BATCH_INVARIANT=1, or pass --no-assert-bitwise to run anyway and report the mismatch"),
        (s.prompts_per_step % world_size == 0,
         f"--prompts-per-step {s.prompts_per_step} must be a multiple of the {world_size} processes"),
        (w.sft_batch_size % world_size == 0,
         f"--sft-batch-size {w.sft_batch_size} must be a multiple of the {world_size} processes"),
    ]
    checks += [(math.isfinite(getattr(group, f.name)), f"{flag(f.name)} must be a finite number")
               for group in (s, lo, o, w, e) for f in dataclasses.fields(group) if f.type is float]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)
    if r.resume:
        args, _ = check_resume(args)
    elif r.run_name is None:
        args = dataclasses.replace(args, run=dataclasses.replace(
            r, run_name=time.strftime("grpo_%Y%m%d_%H%M%S")))
    check_output(args.run)
    if o.warmup_steps > o.steps:
        print(f"note: --warmup-steps {o.warmup_steps} is more than --steps {o.steps}: the learning rate "
              f"warms up over all {o.steps} steps")
        args = dataclasses.replace(args, optimizer=dataclasses.replace(o, warmup_steps=o.steps))
    return args


def command_line_or_exit() -> Args:
    """The checked flags, or one line on stderr (from rank 0 alone under torchrun) and exit status 2."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    try:
        if rank:  # tyro reports a mistyped flag itself: once, from rank 0
            sys.stderr = open(os.devnull, "w")
        args = check_args(parse_command_line(), world)
        sys.stderr = sys.__stderr__
        return args
    except UsageError as e:
        if not rank:
            print(f"error: {e}", file=sys.__stderr__)
        sys.exit(2)


if __name__ == "__main__":
    # Read and checked before torch and vLLM load (seconds): --help and a bad flag answer at once.
    COMMAND_LINE = command_line_or_exit()

import torch  # noqa: E402  (after the flags: see above)
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402

from batch_invariant_backward import EXACT, Kernels, tiled_linear, top_k_top_p  # noqa: E402

# =============================================================================================
# Setup: the processes, the seeds
# =============================================================================================


@dataclass(frozen=True)
class World:
    """This process's place in a torchrun job, read once: one process is rank 0 of 1 (even where vLLM
    has made a process group of one). The collectives below do nothing in a single process."""

    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:  # logs, prints and writes what is written once
        return self.rank == 0

    def share(self, n: int) -> slice:
        """This rank's consecutive share of n items (n a multiple of the number of ranks)."""
        return slice(self.rank * n // self.size, (self.rank + 1) * n // self.size)

    def _device(self) -> str:
        return "cuda" if dist.get_backend() == "nccl" else "cpu"

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks."""
        if self.size == 1:
            return x
        y = x.to(self._device(), copy=True)
        dist.all_reduce(y)
        return y.to(x.device)

    def max(self, n: int) -> int:
        if self.size == 1:
            return n
        x = torch.tensor(n, device=self._device())
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return int(x)

    def cat(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D tensor, concatenated in rank order (their lengths may differ). Tensors, not
        pickled objects: pickling a step's samples took 0.4-0.8 s."""
        if self.size == 1:
            return x
        device = self._device()
        lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.size)]
        dist.all_gather(lengths, torch.tensor([len(x)], device=device))
        lengths = [int(n) for n in lengths]
        parts = [torch.empty(max(lengths), dtype=x.dtype, device=device) for _ in range(self.size)]
        # all_gather needs equal sizes: padded to the longest
        dist.all_gather(parts, F.pad(x.to(device), (0, max(lengths) - len(x))))
        return torch.cat([part[:n] for part, n in zip(parts, lengths)]).to(x.device)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def seed_everything(seed: int) -> None:
    # Sampling is seeded per request (see `rollout_seeds`), the data order has its own seeded generator
    # and the trainer has no dropout: nothing in the loop draws from the global generators. Seeded anyway
    # (and saved in checkpoints), for whatever a researcher adds that does.
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
"""GSM8K's reference format is '#### 72'. A completion's answer is the first '#### N', else the first
'\\boxed{N}', else its last number (the usual fallback); after a closed <think> block, the answer given
after it, else the one inside it. Numbers are then compared as decimals, so '1,000', '1000.0' and '$1000'
are all 1000."""


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
            raise ValueError(f"cannot load openai/gsm8k from the hub ({type(e).__name__}): pass --dataset "
                             "and --eval-dataset with local jsonl files") from e
        return [{"question": r["question"], "answer": r["answer"]} for r in rows]
    if not Path(path).is_file():
        what = "a directory" if Path(path).is_dir() else "no such file"
        raise ValueError(f"{path}: {what} (expected a GSM8K-format jsonl file)")
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text (save the jsonl as UTF-8)") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path} line {n}: not valid JSON") from None
        if not (isinstance(row, dict) and isinstance(row.get("question"), str)
                and isinstance(row.get("answer"), str)):
            raise ValueError(f"{path} line {n}: need a JSON object with string fields 'question' and "
                             "'answer'")
        # GSM8K's answers end in '#### N': a bare last number would be a guess at the answer.
        final = ANSWER_AFTER_HASHES.search(row["answer"])
        if final is None or parse_number(final.group(1)) is None:
            raise ValueError(f"{path} line {n}: the answer does not end in '#### N' with N a number "
                             "(GSM8K's format)")
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


def encode_dataset(rows, tokenizer, data: Data, name: str) -> list[dict]:
    """Tokenise every question once; report (never cut) prompts over --max-prompt-tokens."""
    has_template = tokenizer.chat_template is not None
    if data.prompt_format == "chat" and not has_template:
        raise ValueError("--prompt-format chat: this tokenizer has no chat template; use plain or auto")
    use_chat = data.prompt_format == "chat" or (data.prompt_format == "auto" and has_template)
    encoded = [dict(r, prompt_ids=encode_prompt(tokenizer, r["question"], use_chat, data.thinking))
               for r in rows]
    kept = [r for r in encoded if len(r["prompt_ids"]) <= data.max_prompt_tokens]
    if len(kept) < len(encoded):
        print(f"{name}: {len(encoded) - len(kept)} of {len(encoded)} prompts exceed --max-prompt-tokens "
              f"{data.max_prompt_tokens} and are skipped")
    if not kept:
        raise ValueError(f"{name}: every prompt exceeds --max-prompt-tokens {data.max_prompt_tokens}")
    return kept


def step_rows(rows: list[dict], order: list[int], step: int, n: int) -> list[dict]:
    """The n rows of a step: the next n of the seeded shuffled order, wrapping around epochs."""
    return [rows[order[(step * n + i) % len(order)]] for i in range(n)]

# =============================================================================================
# Model: Qwen3 on vLLM's kernels, over packed sequences
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
        # The logit row of position t predicts token t + 1: completion token j is read at row
        # len(prompt) + j - 1 of its sequence.
        target_rows += range(start + len(prompt) - 1, start + len(prompt) + len(completion) - 1)
        seqlens.append(len(prompt) + len(completion))

    def as_tensor(x, dtype=torch.long):
        return torch.tensor(x, dtype=dtype, device=device)

    return PackedBatch(tokens=as_tensor(tokens), positions=as_tensor(positions),
                       cu_seqlens=as_tensor(seqlens, torch.int32).cumsum(0, dtype=torch.int32),
                       max_seqlen=max(seqlens), target_rows=as_tensor(target_rows),
                       targets=as_tensor([t for c in completions for t in c]),
                       completion_lens=[len(c) for c in completions])


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


def packed_micro_batches(prompts, completions, token_budget: int, device, world: World):
    """Yields (sample indices, PackedBatch) over consecutive samples, each of at most `token_budget` tokens;
    as many on every rank: a sharded forward is a collective that all ranks run together."""
    groups = micro_batches([len(p) + len(c) for p, c in zip(prompts, completions)], token_budget)
    count = world.max(len(groups))
    while len(groups) < count:  # halve the group of most samples (the sums stay the same)
        i = max(range(len(groups)), key=lambda j: len(groups[j]))
        groups[i:i + 1] = [groups[i][: len(groups[i]) // 2], groups[i][len(groups[i]) // 2:]]
    for idx in groups:
        yield idx, pack_sequences([prompts[i] for i in idx], [completions[i] for i in idx], device)


CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
               "intermediate_size", "rms_norm_eps", "max_position_embeddings")


def read_config(model_dir: Path) -> dict:
    """A checkpoint's config.json, refused in one line (naming the file) if it cannot describe a Qwen3."""
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a JSON object of the model's settings was expected")
    missing = [key for key in CONFIG_KEYS if not isinstance(config.get(key), (int, float))]
    if config.get("model_type") != "qwen3" or missing:
        what = f"model_type is {config.get('model_type')!r}" if missing == [] else f"no {', '.join(missing)}"
        raise ValueError(f"{path}: {what}; this trainer needs a Hugging Face Qwen3 config")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    unsupported = {"hidden_act": config.get("hidden_act", "silu") != "silu",
                   "attention_bias": bool(config.get("attention_bias", False)),
                   "rope scaling": rope.get("rope_type", rope.get("type", "default")) != "default",
                   "sliding window": bool(config.get("use_sliding_window", False))}
    for name, bad in unsupported.items():
        if bad:
            raise ValueError(f"{path}: {name} is not supported by this trainer (plain Qwen3 only)")
    return config


def model_args_from_hf_config(config: dict):
    """torchtitan's Qwen3ModelArgs from a Hugging Face `config.json` (checked by `read_config`)."""
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return Qwen3ModelArgs(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config["num_key_value_heads"], vocab_size=config["vocab_size"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        hidden_dim=config["intermediate_size"], norm_eps=config["rms_norm_eps"],
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 1_000_000)),
        max_seq_len=config["max_position_embeddings"],
        enable_weight_tying=config.get("tie_word_embeddings", False),
    )  # fmt: skip


BITWISE_HEAD_DIMS = (128, 256)
"""Head sizes where vLLM's attention is the trainer's bit for bit at any length (tests/test_gpu_configs.py)"""


def check_bitwise_head_dim(head_dim: int, longest: int, model_dir: Path) -> None:
    """Refuses head sizes where vLLM 0.20's attention cannot be reproduced bit for bit. FlashAttention 3
    sizes its key tiles by head size and causality, and runs a step of decodes only (one query per
    sequence) as non-causal. At head_dim 64 such a step sums over the keys in tiles of 192 where a prefill,
    and the trainer, use tiles of 128: the locator, run over an eager engine's decode steps, finds every
    decode row parting at layer 0's attention while every prefill row is equal. A sequence of at most 128
    tokens fits one tile either way. Other head sizes are untested."""
    if head_dim in BITWISE_HEAD_DIMS or (head_dim == 64 and longest <= 128):
        return
    raise ValueError(f"--model {model_dir}: head_dim is {head_dim}; vLLM's attention is bitwise the "
                     "trainer's only at head_dim 128 or 256, or 64 with sequences of at most 128 tokens "
                     "(here "
                     f"--max-prompt-tokens + --max-new-tokens = {longest})")


def rope_cos_sin_cache(args, dtype: torch.dtype) -> torch.Tensor:
    """(max_seq_len, head_dim) table [cos | sin] for neox rotary, built as vLLM builds it: fp32 on the
    current default device, then rounded to the model dtype (the kernel reads this table)."""
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.float) / args.head_dim
    inv_freq = 1.0 / (args.rope_theta**exponents)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)


# Each module's forward is the sequence of kernels vLLM 0.20 runs for it in eager batch-invariant mode
# (CUDA graphs replay the same kernels), in the same order and dtypes, over packed sequences. Each
# module names its kernel calls, in order, in KERNEL_CALLS: the divergence locator reports them by name.


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
        # vLLM normalises layer 0's input alone; every later norm first adds the residual (a bf16 add,
        # then the norm: see `make_fused_add_rms_norm_batch_invariant`).
        residual = h if residual is None else h + residual
        h = self.attention(ops.rms_norm(residual, self.attention_norm.weight, self.eps), positions,
                           cos_sin_cache, cu_seqlens, max_seqlen)
        residual = h + residual
        return self.feed_forward(ops.rms_norm(residual, self.ffn_norm.weight, self.eps)), residual


class TokenLogprobs(NamedTuple):
    """Per completion token (C,) each, fp32, under the distribution vLLM samples from."""

    logprobs: torch.Tensor  # of the token
    entropy: torch.Tensor  # of the distribution it was drawn from
    kept: torch.Tensor  # tokens that distribution keeps (the vocabulary, without top-k/top-p)
    cut_mass: torch.Tensor  # probability that top-k/top-p cut from softmax(logits / T)


class Qwen3(nn.Module):
    """Qwen3 with torchtitan's parameter names, in the layout vLLM serves (merged q/k/v and gate/up,
    `output` absent when tied to `tok_embeddings`)."""

    KERNEL_CALLS = ("final_norm", "lm_head")

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
    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(self, batch: PackedBatch, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0) -> TokenLogprobs:
        """Every completion token's logprob under vLLM's sampling distribution at (temperature, top_k,
        top_p), computed as vLLM's sampler computes its processed logprobs: lm_head on the rows that predict
        them (bf16 logits), then its fp32 temperature, top-k/top-p and logprob kernels. lm_head is part of
        the forward so that a sharded trainer gathers the (possibly tied) embedding once."""
        hidden = self.hidden_states(batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen)
        return TokenLogprobs(*self.kernels.lm_head_logprobs(hidden[batch.target_rows], self.output_weight,
                                                            batch.targets, temperature, top_k, top_p))

    def hidden_states(self, tokens, positions, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        """Packed sequences (T,) -> final hidden states (T, dim)."""
        h, residual = F.embedding(tokens, self.tok_embeddings.weight), None
        for layer in self.layers:
            inputs = (h, residual, positions, self.cos_sin_cache, cu_seqlens, max_seqlen)
            if self.activation_checkpointing and torch.is_grad_enabled():
                # The recomputation runs the same deterministic kernels: the same bits again.
                h, residual = torch.utils.checkpoint.checkpoint(layer, *inputs, use_reentrant=False)
            else:
                h, residual = layer(*inputs)
        return self.kernels.rms_norm(h + residual, self.norm.weight, self.args.norm_eps)


# =============================================================================================
# Weights: Hugging Face checkpoints in and out
# =============================================================================================


def gathered(t: torch.Tensor) -> torch.Tensor:
    """The whole of a tensor sharded over ranks (a DTensor; every rank must call this), else the tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor, else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_dict_adapter(args):
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter(args, None)


def from_hf_state_dict(hf_state: dict, args) -> dict:
    """Hugging Face names -> torchtitan names (its adapter) -> merged q/k/v and gate/up."""
    state = state_dict_adapter(args).from_hf(dict(hf_state))
    if args.enable_weight_tying:
        state.pop("output.weight")  # the adapter aliases it to the embedding; we keep one tensor
    for i in range(args.n_layers):
        p = f"layers.{i}."
        state[f"{p}attention.wqkv.weight"] = torch.cat([state.pop(f"{p}attention.{w}.weight")
                                                        for w in ("wq", "wk", "wv")])
        state[f"{p}feed_forward.w13.weight"] = torch.cat([state.pop(f"{p}feed_forward.{w}.weight")
                                                         for w in ("w1", "w3")])
    return state


def hf_weights(model: Qwen3):
    """Yields (Hugging Face name, tensor) for every weight of the trainer, one parameter at a time, as views
    (no copy): what vLLM's `load_weights` and the checkpoint writer take. A sharded weight is gathered from
    all ranks first (so every rank must iterate, in the same order): one gathered weight at a time, never a
    second whole copy of the model."""
    a = model.args
    adapter = state_dict_adapter(a)
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    for name, p in model.named_parameters():
        p = gathered(p.detach())
        prefix = name.rsplit(".", 2)[0] + "."  # layers.<i>.attention. / layers.<i>.feed_forward.
        if name.endswith("attention.wqkv.weight"):
            parts = dict(zip([prefix + w + ".weight" for w in ("wq", "wk", "wv")], p.split([q, kv, kv])))
        elif name.endswith("feed_forward.w13.weight"):
            parts = dict(zip([prefix + "w1.weight", prefix + "w3.weight"], p.chunk(2)))
        else:
            parts = {name: p}
        yield from adapter.to_hf(parts).items()


def check_checkpoint(model_dir: Path, args) -> None:
    """The safetensors files hold every tensor the trainer needs, at its shape, in bf16, and nothing else:
    read from their headers only, so a bad checkpoint fails before anything slow starts."""
    from safetensors import SafetensorError, safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"--model {model_dir}: no *.safetensors weights in the directory")
    found = {}
    for f in files:
        try:
            with safe_open(f, "pt") as weights:
                found |= {name: (tuple(weights.get_slice(name).get_shape()),
                                 weights.get_slice(name).get_dtype()) for name in weights.keys()}
        except SafetensorError as e:
            raise ValueError(f"--model {model_dir}: {f.name} is not a whole safetensors file ({e}); download "
                             "or save it again") from None
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
        raise ValueError(f"--model {model_dir}: the weights do not match config.json: "
                         + "; ".join(problems[:3]) + more)
    other = sorted({dtype for _, dtype in found.values()} - {"BF16"})
    if other:  # vLLM would serve them rounded to bf16, the trainer would train other weights
        raise ValueError(f"--model {model_dir}: the weights are {', '.join(other)}; both sides run bf16 "
                         "weights: save the checkpoint in bfloat16")


def load_qwen3(model_dir: Path, device, kernels: Kernels = EXACT, dtype=torch.bfloat16,
               activation_checkpointing: bool = False) -> Qwen3:
    """A Hugging Face Qwen3 checkpoint directory -> trainer model on `device`."""
    args = model_args_from_hf_config(read_config(model_dir))
    if torch.device(device) == torch.device("cuda"):  # safetensors reads a bare "cuda" as GPU 0
        device = torch.device("cuda", torch.cuda.current_device())  # this rank's GPU, under torchrun
    hf_state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        hf_state.update(load_file(f, device=str(device)))
    with torch.device(device):  # so the rotary table is computed where vLLM computes it
        model = Qwen3(args, kernels, dtype, activation_checkpointing)
    try:
        model.load_state_dict(from_hf_state_dict(hf_state, args), strict=True)
    except (KeyError, RuntimeError) as e:
        raise ValueError(f"--model {model_dir}: weights do not match config.json "
                         f"({str(e).splitlines()[0]})") from e
    return model


def weights_checksum(params) -> int:
    """Order-independent checksum of bf16 weights: the sum of their bit patterns. The trainer's and vLLM's
    layouts hold the same elements, so equal weights give equal sums, and a stale or partial push almost
    surely does not (a sum can collide, but not by the accident of one stale tensor)."""
    return int(torch.stack([p.detach().view(torch.int16).sum(dtype=torch.int64) for p in params]).sum())


def trainer_checksum(model: Qwen3, world: World) -> int:
    """`weights_checksum` of the trainer's whole weights: a sum, so the sum of its shards' over all ranks."""
    return int(world.sum(torch.tensor(weights_checksum(local_part(p) for p in model.parameters()))))


# =============================================================================================
# vLLM engine, and the weight push
# =============================================================================================


def install_exact_kernels() -> None:
    """Swap three of vLLM 0.20's kernels in this process (the engine runs here: V1 multiprocessing is off)
    for ones the trainer runs too:
    - its fused add+RMSNorm CUDA kernel chooses its block size from the number of tokens in the step
      (under 256 or not), so its bits change with the batch (fixed upstream after 0.20): a bf16 add and
      vLLM's Triton `rms_norm_batch_invariant` instead, the pre-0.20 behaviour;
    - its batch-invariant matmul uses 128 x 128 tiles for any number of rows, which leaves most SMs idle
      in a decode step: `tiled_linear`, the same kernel tiled for the rows, the same bits; each CUDA graph
      captured for a batch size replays that size's tiles;
    - its top-k/top-p runs a Triton kernel from 8 rows up and a sort below: `top_k_top_p`, the Triton
      kernel at any number of rows, so a kept set does not depend on how many sequences a step decodes."""
    from vllm.model_executor.layers import layernorm, linear, vocab_parallel_embedding
    from vllm.model_executor.layers.batch_invariant import rms_norm_batch_invariant
    from vllm.v1.sample.ops import topk_topp_sampler

    def fused_add_rms_norm(x, residual, weight, variance_epsilon):
        residual = x + residual
        return rms_norm_batch_invariant(residual, weight, variance_epsilon), residual

    layernorm.fused_add_rms_norm = fused_add_rms_norm
    linear.linear_batch_invariant = vocab_parallel_embedding.linear_batch_invariant = tiled_linear
    topk_topp_sampler.apply_top_k_top_p = top_k_top_p


# CUDA graphs without torch.compile: the graphs replay the very kernels eager mode launches, so the bits
# stay those the trainer reproduces, while a decode step (most of a rollout) loses its launch overhead.
# Compiling would fuse norms, SiLU and rotary into Inductor kernels with other bits.
CUDA_GRAPHS = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}  # mode 0: CompilationMode.NONE


class VLLMEngine:
    """vLLM in this process, on this GPU, serving the checkpoint the trainer loaded: FlashAttention 3, CUDA
    graphs without compile (or eager), no prefix caching (weights change every step), token ids in and out.
    With sleep mode it gives its GPU memory back while the trainer runs. It knows the checksum of the
    weights it serves."""

    def __init__(self, model_dir: Path, gpu_memory_utilization: float, max_model_len: int, seed: int,
                 cuda_graphs: bool = True, sleep_mode: bool = True, max_num_seqs: int = 256, **vllm_args):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine runs in this process
        # 0.20's V2 model runner draws every seeded request's noise in one kernel (V1 loops over them in
        # Python), but loses state in a level-2 sleep: its first generation after a wake-up failed with an
        # illegal memory access (H100). The V1 runner, then.
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # quiet; =INFO brings vLLM's log back
        import vllm

        if vllm.__version__ != "0.20.0":
            raise ValueError(f"vLLM {vllm.__version__} is installed; this script mirrors vLLM 0.20.0's "
                             "kernels: pip install vllm==0.20.0")
        if os.environ.get("VLLM_BATCH_INVARIANT") == "1":
            install_exact_kernels()
        graphs = {"compilation_config": CUDA_GRAPHS} if cuda_graphs else {"enforce_eager": True}
        self.llm = vllm.LLM(
            model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", seed=seed,
            enable_prefix_caching=False, enable_sleep_mode=sleep_mode,
            logprobs_mode="processed_logprobs",  # of the distribution sampled from: after T, top-k/p
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            attention_config={"backend": "FLASH_ATTN", "flash_attn_version": 3},
            **graphs, **vllm_args,  # more vllm.LLM arguments (tests give a second engine a fixed KV cache)
        )  # fmt: skip
        self.served_checksum = self.weights_checksum()

    def generate(self, prompts: list[list[int]], max_tokens: list[int], temperature: float, seeds: list[int],
                 stop_token_ids=(), ignore_eos: bool = False, top_k: int = 0, top_p: float = 1.0):
        """One completion per prompt. Returns the completion token ids and vLLM's logprob of each sampled
        token under the distribution it was sampled from, as fp32 tensors. Temperature 0 is greedy."""
        from vllm import SamplingParams, TokensPrompt

        params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=n, seed=s,
                                 logprobs=0, detokenize=False, stop_token_ids=list(stop_token_ids),
                                 ignore_eos=ignore_eos) for n, s in zip(max_tokens, seeds)]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                    use_tqdm=False)
        completions, logprobs = [], []
        for out in outputs:
            sample = out.outputs[0]
            completions.append(list(sample.token_ids))
            # A Python float holds an fp32 value exactly: this round trip is lossless.
            sampled = [lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs)]
            logprobs.append(torch.tensor(sampled, dtype=torch.float32))
        return completions, logprobs

    def sleep(self) -> None:
        """Give back the GPU memory of the weights and the KV cache. Level 2 discards the weights rather
        than copying them to the host: the trainer pushes new ones before the next rollout."""
        self.llm.sleep(level=2)

    def wake_up(self, tags: list[str]) -> None:
        """Map GPU memory again for "weights" and/or "kv_cache" (at the same addresses, so the captured
        CUDA graphs stay valid); the contents are not restored."""
        self.llm.wake_up(tags=tags)

    def push_weights(self, model: Qwen3) -> None:
        """Copy the trainer's bf16 weights into the served model in-process, no disk: vLLM's own
        `load_weights` copies each HF-named tensor into its merged q/k/v and gate/up slots."""
        self.llm.apply_model(lambda served: served.load_weights(hf_weights(model)))

    def weights_checksum(self) -> int:
        return self.llm.apply_model(lambda served: weights_checksum(served.parameters()))[0]

    def sync_weights(self, model: Qwen3, world: World, changed: bool) -> None:
        """The one way weights reach vLLM: give the trainer's cached GPU memory back, wake vLLM's weights,
        push the trainer's, wake the KV cache, and check them."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the trainer's freed blocks go back to the driver, for vLLM to map
        self.wake_up(["weights"])
        self.push_weights(model)
        self.wake_up(["kv_cache"])
        self.check_weights(model, world, changed)

    def check_weights(self, model: Qwen3, world: World, changed: bool = False) -> None:
        """The served weights equal the trainer's, and have changed if the update changed any."""
        # The trainer's checksum is a collective: every rank computes it once, whatever its engine serves.
        checksum, trainer = self.weights_checksum(), trainer_checksum(model, world)
        if checksum != trainer or (changed and checksum == self.served_checksum):
            raise RuntimeError(f"vLLM does not serve the trainer's weights (checksum {self.served_checksum} "
                               f"-> {checksum}, trainer {trainer})")
        self.served_checksum = checksum


# =============================================================================================
# GRPO loss
# =============================================================================================


def group_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool) -> torch.Tensor:
    """rewards (P * G,) in groups of G consecutive samples -> advantages (P * G,)."""
    groups = rewards.view(-1, group_size)  # (P, G)
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
    """Importance weights (C,) for the policy-gradient term from log(trainer / sampler) of each token (C,),
    sequences of `lengths` tokens back to back, and where the correction cut (C,): truncated (tis) or
    masked (mis). Equal logprobs give weights of exactly 1 and cut nothing."""
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
    """Per-token k3 estimate of KL(policy || other) from the policy's own samples: exp(d) - d - 1 with
    d = other - policy; >= 0, and 0 exactly where the logprobs are equal."""
    d = other_logprobs - logprobs
    return torch.exp(d) - d - 1


def grpo_loss(policy: TokenLogprobs, sampler_logprobs, advantages, lengths: list[int], ref_logprobs,
              n_tokens: int, cfg: Loss) -> tuple[torch.Tensor, dict]:
    """The GRPO loss of a micro-batch of sequences of `lengths` tokens, back to back: the trainer's
    `policy` (C,) of each sampled token, the sampler's logprobs (C,), each token's sequence advantage (C,),
    the reference policy's logprobs (C,) or None. Returns the loss to backpropagate (a sum over the tokens
    divided by `n_tokens`, the step's count: accumulated micro-batches make the gradient of the whole step)
    and per-token sums of its terms, to add over micro-batches and divide by n_tokens once, on the host."""
    # With a correction, PPO's ratio is to the trainer's own logprobs at rollout time (one update per batch:
    # exactly 1), and the sampler/trainer mismatch goes into the weight instead.
    old = sampler_logprobs if cfg.correction == "none" else policy.logprobs.detach()
    pg_loss, ratio, clipped = ppo_clip_loss(policy.logprobs, old, advantages, cfg.clip_eps)
    weight, cut = correction_weights(policy.logprobs.detach() - sampler_logprobs, lengths, cfg)
    pg_loss = weight * pg_loss
    loss, terms = pg_loss, {"pg_loss": pg_loss, "entropy": policy.entropy, "ratio_mean": ratio,
                            "ratio_clipped_frac": clipped.float(), "correction_weight_mean": weight,
                            "correction_cut_frac": cut.float(), "correction_weight_sq": weight**2,
                            "kept_tokens": policy.kept.float(), "cut_mass": policy.cut_mass}
    if ref_logprobs is not None:
        terms["kl_div"] = k3_kl(policy.logprobs, ref_logprobs)
        loss = loss + cfg.kl_coef * terms["kl_div"]
    if cfg.entropy_coef:  # else the entropy stays out of the backward
        loss = loss - cfg.entropy_coef * policy.entropy
    terms["loss"] = loss
    return loss.sum() / n_tokens, {name: t.detach().sum() for name, t in terms.items()}


# =============================================================================================
# Train step
# =============================================================================================


def lr_at(step: int, cfg: Optimizer) -> float:
    """Linear warm-up to --lr over --warmup-steps, then cosine decay to lr * --min-lr-ratio."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def layer_of(name: str) -> str:
    """Parameter name -> the layer its weight-delta statistics are grouped under."""
    if name.startswith("layers."):
        return f"layer_{int(name.split('.')[1]):02d}"
    return {"tok_embeddings": "embeddings", "norm": "final_norm", "output": "lm_head"}[name.split(".")[0]]


class MasterWeights:
    """AdamW on fp32 master copies of the model's bf16 parameters. After each step the masters' bf16
    rounding is written into the model: that bf16 tensor is what both the trainer's forward and vLLM run
    (the push copies it as is)."""

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
    def update(self, lr: float, max_grad_norm: float) -> float:
        """Clip the accumulated gradients and step AdamW on the masters. Returns the pre-clip norm."""
        # Sharded, the norm comes back as this rank's part; gathered, it is the norm over all ranks.
        grad_norm = gathered(torch.nn.utils.get_total_norm([master.grad for master in self.masters]))
        torch.nn.utils.clip_grads_with_norm_(self.masters, max_grad_norm, grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # the fp32 gradients free their memory until next step
        return float(grad_norm)

    @torch.no_grad()
    def write_back(self, world: World) -> dict:
        """Round the masters into the model's bf16 weights. Returns, per layer, the L2 norm of the bf16
        weight change and that norm relative to the layer's weights."""
        squares = {}  # per layer: (squared norm of the change, squared norm of the weights), this rank's
        for master, (name, p) in zip(self.masters, self.named):
            new, old = local_part(master).to(p.dtype).float(), local_part(p).float()
            layer = layer_of(name)
            squares[layer] = squares.get(layer, 0) + torch.stack([(new - old).pow(2).sum(), old.pow(2).sum()])
            p.copy_(master.to(p.dtype))
        totals = world.sum(torch.stack(list(squares.values()))).sqrt().tolist()
        return {layer: (change, change / size) for layer, (change, size) in zip(squares, totals)}


@dataclass
class Rollouts:
    """G samples of each of P prompts, sample j of prompt i at index i * G + j."""

    prompts: list[list[int]]
    completions: list[list[int]]
    vllm_logprobs: list[torch.Tensor]  # (len(completion),) fp32 each
    rewards: torch.Tensor  # (P * G,)
    advantages: torch.Tensor  # (P * G,)


def rollout(engine, tokenizer, rows: list[dict], args: Args, step: int, stop_ids, world: World) -> Rollouts:
    """G samples of each question, each request with its own seed, scored by the GSM8K reward. Under
    torchrun, this rank's share of the questions, with the seeds they have in the whole step."""
    s, G = args.sampling, args.sampling.samples_per_prompt
    seeds = rollout_seeds(args.data.seed, step, len(rows) * G)
    share = world.share(len(rows))
    rows, seeds = rows[share], seeds[share.start * G: share.stop * G]
    prompts = [r["prompt_ids"] for r in rows for _ in range(G)]
    completions, logprobs = engine.generate(prompts, [s.max_new_tokens] * len(prompts), s.temperature, seeds,
                                            stop_ids, top_k=s.top_k, top_p=s.top_p)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    rewards = torch.tensor([gsm8k_reward(text, rows[i // G]["answer"]) for i, text in enumerate(texts)])
    advantages = group_advantages(rewards, G, args.loss.std_normalize)
    return Rollouts(prompts, completions, logprobs, rewards, advantages)


def evaluate(engine, tokenizer, rows: list[dict], max_new_tokens: int, stop_ids, world: World) -> float:
    """Greedy accuracy of the served policy on GSM8K test questions (each rank answers its share)."""
    mine = rows[world.share(len(rows))]
    completions, _ = engine.generate([r["prompt_ids"] for r in mine], [max_new_tokens] * len(mine), 0.0,
                                     [0] * len(mine), stop_ids)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    correct = sum(gsm8k_reward(text, r["answer"]) for text, r in zip(texts, mine))
    return float(world.sum(torch.tensor(correct, dtype=torch.float64))) / len(rows)


@torch.no_grad()
def reference_logprobs(ref_model: Qwen3, rollouts: Rollouts, args: Args, world: World) -> list[torch.Tensor]:
    """The frozen reference policy's logprob of every sampled token (for the k3 KL term), at the same
    temperature as the policy's (no top-k/top-p: KL is refused with them)."""
    out, device = [], ref_model.cos_sin_cache.device
    for _, batch in packed_micro_batches(rollouts.prompts, rollouts.completions,
                                         args.engine.max_tokens_per_microbatch, device, world):
        out += ref_model(batch, args.sampling.temperature).logprobs.split(batch.completion_lens)
    return out


def train_on_rollouts(model: Qwen3, optimizer: MasterWeights, rollouts: Rollouts, ref_logprobs, args: Args,
                      world: World):
    """Forward + backward over all rollouts in micro-batches (gradients accumulated in fp32). The training
    forward's logprobs are also the ones checked against vLLM: parity costs no extra forward. Returns the
    per-token means of the loss terms and the trainer's logprobs per sample."""
    device, s = model.cos_sin_cache.device, args.sampling
    n_tokens = int(world.sum(torch.tensor(sum(len(c) for c in rollouts.completions), device=device)))
    sums, logprobs = [], []  # per micro-batch, kept on the GPU
    for idx, batch in packed_micro_batches(rollouts.prompts, rollouts.completions,
                                           args.engine.max_tokens_per_microbatch, device, world):
        policy = model(batch, s.temperature, s.top_k, s.top_p)
        lens = torch.tensor(batch.completion_lens, device=device)
        advantages = rollouts.advantages[idx].to(device).repeat_interleave(lens)  # a sample's on each token
        sampler = torch.cat([rollouts.vllm_logprobs[i] for i in idx]).to(device)
        ref = None if ref_logprobs is None else torch.cat([ref_logprobs[i] for i in idx])
        loss, terms = grpo_loss(policy, sampler, advantages, batch.completion_lens, ref, n_tokens, args.loss)
        loss.backward()
        optimizer.accumulate_grads()
        sums.append(terms)
        logprobs.append(policy.logprobs.detach())
    # One copy to the host for the whole step (a sync per micro-batch would stall the GPU); the division
    # happens there, exactly: CUDA divides by a scalar through its reciprocal, which would turn a ratio sum
    # of exactly n_tokens into a mean one ulp below 1.
    totals = world.sum(torch.stack([torch.stack(list(t.values())) for t in sums]).sum(0)).tolist()
    metrics = {name: total / n_tokens for name, total in zip(sums[0], totals)}
    # Effective sample size of the weights, as a fraction of the tokens: 1 when all are equal.
    weight_sq = metrics.pop("correction_weight_sq")
    metrics["correction_ess"] = metrics["correction_weight_mean"] ** 2 / weight_sq if weight_sq else 0.0
    if s.top_k == 0 and s.top_p == 1:  # every token kept: nothing to report
        del metrics["kept_tokens"], metrics["cut_mass"]
    return metrics, list(torch.cat(logprobs).cpu().split([len(c) for c in rollouts.completions]))


def sft_step(model: Qwen3, optimizer: MasterWeights, rows: list[dict], args: Args, world: World) -> float:
    """One supervised warm-start step: maximise the logprob of each reference answer after its prompt
    (teacher forcing, the very forward GRPO uses). Returns the mean token loss."""
    device = model.cos_sin_cache.device
    rows = rows[world.share(len(rows))]
    prompts, answers = [r["prompt_ids"] for r in rows], [r["answer_ids"] for r in rows]
    n_tokens = int(world.sum(torch.tensor(sum(len(a) for a in answers))))
    total = 0.0
    for _, batch in packed_micro_batches(prompts, answers, args.engine.max_tokens_per_microbatch, device,
                                         world):
        loss = -model(batch).logprobs.sum() / n_tokens
        loss.backward()
        optimizer.accumulate_grads()
        total += float(loss.detach())
    optimizer.update(args.warm_start.sft_lr, args.optimizer.max_grad_norm)
    optimizer.write_back(world)
    return float(world.sum(torch.tensor(total, dtype=torch.float64)))


# =============================================================================================
# Parity: every sampled token's logprob, compared bit for bit
# =============================================================================================


class ParityError(Exception):
    """A sampled token whose trainer logprob is not bitwise vLLM's (exit status 1)."""


class Mismatch(NamedTuple):
    message: str
    sample: int
    token: int


def fp32_hex(x: float) -> str:
    """The fp32 bit pattern: two logprobs one ulp apart print differently (bf16 would hide it)."""
    return f"0x{int(torch.tensor(x, dtype=torch.float32).view(torch.int32)) & 0xFFFFFFFF:08x}"


SAMPLER_PROBABILITY_BUCKETS = (0.0, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0)
"""Edges of the buckets of the sampled token's probability that the mismatch is also reported by: it grows
as the probability goes to 0."""


def mismatch_by_probability(v: torch.Tensor, t: torch.Tensor) -> dict:
    """Mean |trainer - sampler| logprob and k3 KL per bucket of the sampler's probability of the token, and
    the bucket's share of the tokens; empty buckets are left out."""
    p, metrics, edges = v.exp(), {}, SAMPLER_PROBABILITY_BUCKETS
    for low, high in zip(edges, edges[1:]):
        tokens = (p >= low) & ((p < high) if high < 1 else (p <= high))
        if tokens.any():
            name = f"p_{low:g}-{high:g}"
            metrics[f"{name}/mean_abs_logprob_diff"] = float((v[tokens] - t[tokens]).abs().mean())
            metrics[f"{name}/vllm_kl"] = float(k3_kl(v[tokens], t[tokens]).mean())
            metrics[f"{name}/token_frac"] = float(tokens.float().mean())
    return metrics


def parity_report(vllm_logprobs: list[torch.Tensor], trainer_logprobs: list[torch.Tensor],
                  tokens: list[list[int]], show: int, world: World) -> tuple[dict, str, Mismatch | None]:
    """Compare every sampled token's logprob, exactly (fp32 bit patterns). Returns the metrics, a printable
    report and, on a mismatch, the first mismatching sample and token."""
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
    if not mismatched:
        return metrics, "\n".join(lines if show else lines[-1:]), None
    flat = int(differ.nonzero()[0])
    ends = torch.tensor([len(x) for x in vllm_logprobs]).cumsum(0)
    sample = int((ends <= flat).sum())
    token = flat - (int(ends[sample - 1]) if sample else 0)
    where = f" (sampled on rank {sample * world.size // len(tokens)})" if world.size > 1 else ""
    first = Mismatch(f"sample {sample}{where} token {token} (id {tokens[sample][token]}): vLLM logprob "
                     f"{float(v[flat])!r} but trainer {float(t[flat])!r}; {mismatched} of {len(v)} sampled "
                     "tokens differ", sample, token)
    return metrics, "\n".join(lines if show else lines[-1:]), first


# =============================================================================================
# Several GPUs (torchrun): data parallel, FSDP2-sharded trainer
# =============================================================================================


def init_distributed(device: str) -> World:
    """Under torchrun (WORLD_SIZE > 1): join the process group (NCCL on GPUs, gloo on the CPU) and take
    this rank's GPU. Returns this process's place: with one process, nothing is set up."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1 and not dist.is_initialized():
        if device == "cuda":
            gpu = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(gpu)
            # device_id makes NCCL connect now, before vLLM starts: in batch-invariant mode vLLM sets
            # NCCL_MAX_NCHANNELS=1 and NCCL_NTHREADS=1 for its own reductions, and NCCL reads them when it
            # connects. Connected after that, FSDP's gathers and reduce-scatters ran on one channel, at
            # about a tenth of the link's speed, and 2 GPUs trained no faster than one (2 x H200).
            dist.init_process_group("nccl", device_id=gpu)
        else:
            dist.init_process_group("gloo")
    return World(dist.get_rank(), size) if size > 1 else World()


def shard_model(model: Qwen3, world: World) -> Qwen3:
    """FSDP2 over all ranks: one unit per transformer block, and the root (embedding, final norm, lm_head,
    which may share the embedding's weight). Each rank keeps 1/N of every weight; a unit's weights are
    all-gathered for its forward and its backward, and its gradients reduce-scattered, summed in fp32 (not
    averaged: the loss is divided by the token count of all ranks' samples)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(model.cos_sin_cache.device.type, (world.size,))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for unit in (*model.layers, model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    for unit in (*model.layers, model):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no pre-multiplied one
    return model


def whole_step(rollouts: Rollouts, trainer_logprobs: list, world: World) -> tuple[Rollouts, list]:
    """Every rank's samples of the step and their trainer logprobs, in rank order, which is the step's
    sample order: the parity check and the metrics see the whole step, as on one GPU."""
    if world.size == 1:
        return rollouts, trainer_logprobs
    r = rollouts
    prompt_lens, completion_lens = (world.cat(torch.tensor([len(s) for s in seqs])).tolist()
                                    for seqs in (r.prompts, r.completions))

    def gathered_list(pieces: list, dtype: torch.dtype, lengths: list[int]) -> list[torch.Tensor]:
        return list(world.cat(torch.cat([torch.as_tensor(p, dtype=dtype) for p in pieces])).split(lengths))

    prompts = [t.tolist() for t in gathered_list(r.prompts, torch.int64, prompt_lens)]
    completions = [t.tolist() for t in gathered_list(r.completions, torch.int64, completion_lens)]
    step = Rollouts(prompts, completions, gathered_list(r.vllm_logprobs, torch.float32, completion_lens),
                    world.cat(r.rewards), world.cat(r.advantages))
    return step, gathered_list(trainer_logprobs, torch.float32, completion_lens)


# =============================================================================================
# Checkpoints: Hugging Face weights, sharded training state, the parity record
# =============================================================================================

TRAINING_STATE = "training_state"
"""The checkpoint folder of what --resume needs beyond the weights; vLLM and transformers read only the
top level, so a checkpoint stays a plain Hugging Face one for them."""
SHARD_BYTES = 4 * 2**30
"""Weights past this size are written in shards, model-0000i-of-0000n.safetensors, as the hub's are."""
TOKENIZER_FILES = ("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template",
                   "generation_config")


@contextmanager
def atomic_directory(out_dir: Path, world: World = World()):
    """Yields a temporary directory beside `out_dir` (the same on every rank) that becomes `out_dir` only
    once every rank has written its part: a crash or a kill -9 mid-write leaves no half-written `out_dir`."""
    tmp = out_dir.parent / f".{out_dir.name}.partial"
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    world.barrier()
    try:
        yield tmp
    except BaseException:
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    world.barrier()
    if world.is_main:
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A GPU tensor copied into page-locked host memory, which PyTorch recycles from save to save: copies
    into fresh pageable memory ran at 1.3 GB/s on an H100 machine, a checkpoint's largest cost."""
    if not t.is_cuda:
        return t
    host = t.to("cpu", non_blocking=True)  # into pinned memory
    torch.cuda.current_stream().synchronize()
    return host


def write_hf_checkpoint(model: Qwen3, source_dir: Path, directory: Path, world: World) -> None:
    """Config, tokenizer files and safetensors weights, as vLLM and transformers load them. The weights
    stream through rank 0 one gathered tensor at a time, into shards of at most SHARD_BYTES: no second
    copy of the model is ever held."""
    with torch.device("meta"):
        sizes = [(name, t.numel() * t.element_size()) for name, t in hf_weights(Qwen3(model.args))]
    shards, size = [[]], 0
    for name, n in sizes:
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    files = ([f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
             if len(shards) > 1 else ["model.safetensors"])
    weights = hf_weights(model)  # every rank gathers each weight; rank 0 keeps it
    for file, names in zip(files, shards):
        shard = {name: to_host(tensor) for name, tensor in itertools.islice(weights, len(names))}
        if world.is_main:
            save_file(shard, directory / file, metadata={"format": "pt"})
    if not world.is_main:
        return
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(n for _, n in sizes)},
                 "weight_map": {name: file for file, names in zip(files, shards) for name in names}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = read_config(source_dir) | {"torch_dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    for f in source_dir.iterdir():
        if f.name.startswith(TOKENIZER_FILES):
            shutil.copy(f, directory / f.name)


def training_state(optimizer: MasterWeights, ref_model) -> dict:
    """What --resume needs beyond the weights, as torch.distributed.checkpoint saves it (each rank its
    shards): the fp32 masters, AdamW's moments and step counts, the reference policy when KL is on, and the
    RNG states. Before the first AdamW step its state is made as AdamW makes it, to load into."""
    for master in optimizer.masters:
        optimizer.optimizer.state[master] = optimizer.optimizer.state[master] or {
            "step": torch.tensor(0.0), "exp_avg": torch.zeros_like(master),
            "exp_avg_sq": torch.zeros_like(master)}
    names = [name for name, _ in optimizer.named]
    state = {"masters": dict(zip(names, optimizer.masters)),
             "adam": {name: optimizer.optimizer.state[m] for name, m in zip(names, optimizer.masters)},
             "rng": {"python": torch.tensor(random.getstate()[1]), "torch": torch.get_rng_state()}}
    if torch.cuda.is_available():
        state["rng"]["cuda"] = torch.cuda.get_rng_state()
    if ref_model is not None:
        state["reference"] = dict(ref_model.named_parameters())
    return state


def stack_versions() -> dict:
    """The software and GPU a run's bits depend on."""
    from importlib.metadata import version

    smi = shutil.which("nvidia-smi")
    driver = smi and os.popen(f"{smi} --query-gpu=driver_version --format=csv,noheader").read().split("\n")[0]
    return {"torch": torch.__version__, "vllm": version("vllm"), "triton": version("triton"),
            "cuda": torch.version.cuda, "driver": driver or None,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def parity_record(args: Args, model: Qwen3, totals: dict) -> dict:
    """A run's certificate of exactness: the stack, the kernels' configuration, the sampling settings, and
    the sampled tokens checked so far, and how many of them mismatched."""
    from batch_invariant_backward import matmul_tiles

    a, sms = model.args, (torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
                          if torch.cuda.is_available() else 132)
    gemms = {"qkv": ((a.n_heads + 2 * a.n_kv_heads) * a.head_dim, a.dim),
             "o_proj": (a.dim, a.n_heads * a.head_dim), "gate_up": (2 * a.hidden_dim, a.dim),
             "down": (a.dim, a.hidden_dim), "lm_head": (a.vocab_size, a.dim)}
    tiles = {f"{name} rows={m}": list(matmul_tiles(m, n, k, sms).values())
             for name, (n, k) in gemms.items() for m in (1, 32, 256, 8192)}
    kernels = {"batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT") == "1", "model_runner": "V1",
               "cuda_graphs": CUDA_GRAPHS if args.engine.vllm_cuda_graphs else "eager",
               "matmul_tiles (BLOCK_M, BLOCK_N, warps, stages)": tiles}
    return {"stack": stack_versions(), "kernels": kernels, "sampling": asdict(args.sampling), **totals}


class HostStaging(DefaultSavePlanner):
    """DCP's own planner, each tensor staged through `to_host` (DCP's writer threads copy to pageable memory)."""

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        return to_host(data) if isinstance(data, torch.Tensor) else data


def save_checkpoint(model: Qwen3, optimizer: MasterWeights, ref_model, inputs, args: Args, step: int,
                    record: dict, world: World) -> None:
    """<output_dir>/<run_name>/step_N after N GRPO steps: the Hugging Face checkpoint, and the training
    state beside it, with the flags, the step and the parity record. Then only the newest --keep-last
    checkpoints are kept (and the one this run resumed from)."""
    import torch.distributed.checkpoint as dcp

    start = time.perf_counter()
    out_dir = Path(args.run.output_dir) / args.run.run_name / f"step_{step:06d}"
    with atomic_directory(out_dir, world) as tmp:
        write_hf_checkpoint(model, inputs.model_dir, tmp, world)
        # Written to the OS's page cache, not synced: a killed run keeps every checkpoint, and a machine that
        # loses power right after a save keeps the ones before it. Syncing doubled the save time.
        dcp.save(training_state(optimizer, ref_model), no_dist=world.size == 1, planner=HostStaging(),
                 storage_writer=dcp.FileSystemWriter(tmp / TRAINING_STATE, thread_count=8, sync_files=False))
        if world.is_main:
            run = {"args": asdict(args), "step": step, "world_size": world.size}
            (tmp / TRAINING_STATE / "run.json").write_text(json.dumps(run, indent=2))
            (tmp / TRAINING_STATE / "parity.json").write_text(json.dumps(record, indent=2))
    if world.is_main:
        print(f"checkpoint {out_dir} written in {time.perf_counter() - start:.1f} s")
        for stale in out_dir.parent.glob(".step_*"):  # what a run killed mid-save left
            shutil.rmtree(stale)
        if args.run.keep_last:
            for old in sorted(out_dir.parent.glob("step_[0-9]*"))[: -args.run.keep_last]:
                if old.resolve() != inputs.model_dir.resolve():  # a resumed run's tokenizer files are there
                    shutil.rmtree(old)


def restore_training_state(checkpoint_dir: Path, optimizer: MasterWeights, ref_model, args: Args,
                           world: World) -> dict:
    """Put back what `save_checkpoint` saved beside the weights (which the model loaded already), into this
    run's shards whatever the number of ranks that saved it. Returns the checkpoint's parity record."""
    import torch.distributed.checkpoint as dcp

    state = training_state(optimizer, ref_model)
    dcp.load(state, checkpoint_id=checkpoint_dir / TRAINING_STATE, no_dist=world.size == 1)
    for group in optimizer.optimizer.param_groups:
        group["weight_decay"] = args.optimizer.weight_decay  # may change on resume; the lr is set every step
    random.setstate((3, tuple(state["rng"]["python"].tolist()), None))
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"]:
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    return json.loads((checkpoint_dir / TRAINING_STATE / "parity.json").read_text())


def warn_if_another_stack(saved: dict, checkpoint_dir: Path) -> None:
    changed = [f"{key} {saved['stack'].get(key)} -> {now}" for key, now in stack_versions().items()
               if saved["stack"].get(key) != now]
    if changed:
        print(f"warning: --resume {checkpoint_dir} was saved on another stack ({', '.join(changed)}): the "
              "run continues bit for bit only on the same one")


# =============================================================================================
# Logging: the terminal and TensorBoard
# =============================================================================================


def gpu_memory_in_use_gib() -> float:
    """GPU memory in use on the whole device (what nvidia-smi shows): vLLM's, the trainer's and the CUDA
    context's. At the end of a phase it is that phase's peak: PyTorch's caching allocator keeps what it
    reserved until `torch.cuda.empty_cache()`."""
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
    """runs/<run_name>, in one event file. A resumed run first copies what the run logged before its
    checkpoint into a new file, in step order, and deletes the old one: TensorBoard reads event files in
    the order of their names, which need not be the order they were written in."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    run_dir = Path("runs") / args.run.run_name
    old = list(run_dir.glob("events.out.tfevents.*"))
    kept = []
    if old:
        events = EventAccumulator(str(run_dir), size_guidance={SCALARS: 0}).Reload()
        kept = sorted((e.step, tag, e.value, e.wall_time) for tag in events.Tags()["scalars"]
                      for e in events.Scalars(tag) if e.step < start_step)
    writer = SummaryWriter(str(run_dir))
    for step, tag, value, wall_time in kept:
        writer.add_scalar(tag, value, step, walltime=wall_time)
    writer.flush()
    for f in old:
        f.unlink()
    rows = [f"| {group}.{k} | {v} |" for group, values in asdict(args).items() for k, v in values.items()]
    rows.append(f"| VLLM_BATCH_INVARIANT | {os.environ.get('VLLM_BATCH_INVARIANT')} |")
    writer.add_text("config", "| flag | value |\n|---|---|\n" + "\n".join(rows), start_step)
    return writer


def log_step(writer, step: int, scalars: dict, line: str) -> None:
    """The one place a GRPO step is logged: TensorBoard scalars, and one line on the terminal (rank 0's:
    the other ranks have no writer)."""
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
    }  # fmt: skip
    scalars |= {f"parity/{k}": v for k, v in parity.items()}
    scalars |= {f"time/{k}": v for k, v in times.items()} | {f"memory/{k}_gib": v for k, v in memory.items()}
    for layer, (magnitude, relative) in deltas.items():
        scalars[f"weight_delta/{layer}/magnitude"] = magnitude
        scalars[f"weight_delta/{layer}/relative_change"] = relative
    return scalars


# =============================================================================================
# Divergence locator: where the bits part, when parity breaks
# =============================================================================================

LAYER_OPS = ("residual_in", "attention_norm", *Attention.KERNEL_CALLS, "residual", "ffn_norm",
             *FeedForward.KERNEL_CALLS)
"""A transformer block's tensors in forward order. 'residual_in' is the block's input sum (layer 0: the
embedding) and 'residual' the sum after attention: the adds vLLM fuses into the norms that follow."""


def as_rows(x) -> torch.Tensor:
    """(T, ...) tensor, or a (q, k) pair, as (T, n) fp32 (a bf16 value and its fp32 copy have equal bits)."""
    if isinstance(x, tuple):
        return torch.cat([as_rows(t) for t in x], dim=1)
    return x.reshape(x.shape[0], -1).float()


@torch.no_grad()
def trainer_trace(model: Qwen3, tokens: list[int]) -> dict:
    """Every intermediate tensor of the trainer's forward over one sequence, and the last row's logits,
    by (layer, op): each module's kernels record their inputs and outputs under the names the module
    gives its kernel calls (KERNEL_CALLS)."""
    calls = {}  # module -> [(name, input, output)], in call order

    def recorder(module):
        names, kernels = iter(module.KERNEL_CALLS), module.kernels

        def recorded(fn):
            def run(x, *args, **kwargs):
                out = fn(x, *args, **kwargs)
                calls.setdefault(module, []).append((next(names), x, out))
                return out
            return run
        return Kernels(*(recorded(getattr(kernels, f.name)) for f in dataclasses.fields(Kernels)))

    modules = [m for m in model.modules() if hasattr(m, "KERNEL_CALLS")]
    originals = {m: m.kernels for m in modules}
    for m in modules:
        m.kernels = recorder(m)
    try:
        # The model's own forward (a sharded model gathers its weights for it), over all the tokens.
        model(pack_sequences([tokens[:-1]], [tokens[-1:]], model.cos_sin_cache.device))
    finally:
        for m, kernels in originals.items():
            m.kernels = kernels
    if hasattr(model, "reshard"):  # FSDP keeps the root's weights gathered for a backward; none follows
        model.reshard()
    trace = {}
    for i, layer in enumerate(model.layers):
        for module in (layer, layer.attention, layer.feed_forward):
            trace |= {(i, name): as_rows(out) for name, _, out in calls[module]}
        (_, residual_in, _), (_, residual, _) = calls[layer]  # the norms' inputs: the sums before them
        trace[i, "residual_in"], trace[i, "residual"] = as_rows(residual_in), as_rows(residual)
    (_, final_residual, final_norm), _ = calls[model]
    trace[None, "final_residual"], trace[None, "final_norm"] = as_rows(final_residual), as_rows(final_norm)
    trace[None, "logits"] = as_rows(model.kernels.linear(final_norm[-1:], gathered(model.output_weight)))
    return trace


def vllm_trace(engine: VLLMEngine, tokens: list[int]) -> dict:
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
            "sampler's logprob or in vLLM's decode steps")


def find_first_divergence(engine: VLLMEngine, model: Qwen3, tokens: list[int]) -> str:
    """Runs a sequence through vLLM (hooks on its modules) and the trainer, and names the first op whose
    output bits differ."""
    return first_divergence(trainer_trace(model, tokens), vllm_trace(engine, tokens), model.args.n_layers)


# =============================================================================================
# The loop, and main()
# =============================================================================================


def end_of_sequence_ids(tokenizer, model_dir: Path) -> list[int]:
    eos = read_config(model_dir).get("eos_token_id")
    ids = {tokenizer.eos_token_id} | set(eos if isinstance(eos, list) else [eos])
    ids.discard(None)
    if not ids:
        raise ValueError(f"{model_dir}: neither the tokenizer nor config.json names an end-of-sequence token")
    return sorted(ids)


def resolve_model_dir(model: str) -> Path:
    """A local checkpoint directory as is, else a Hugging Face hub id downloaded to the cache."""
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {model}: the directory has no config.json (need a Hugging Face Qwen3 "
                             "checkpoint)")
        return path
    if path.exists() or model.startswith((".", "/")) or model.count("/") != 1:
        raise ValueError(f"--model {model}: not a checkpoint directory, nor a hub id like Qwen/Qwen3-1.7B")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as e:
        raise ValueError(f"--model {model}: cannot download it from the hub ({type(e).__name__}); pass a "
                         "local checkpoint directory") from e


def warn_if_short_of_disk(args: Args, model_args) -> None:
    """A checkpoint holds 16 bytes a parameter (bf16 weights, fp32 masters, two fp32 AdamW moments), and 2
    more with the reference policy: warn now rather than fail at the first save."""
    with torch.device("meta"):
        params = sum(p.numel() for p in Qwen3(model_args).parameters())
    need = params * (18 if args.loss.kl_coef else 16)
    root = Path(args.run.output_dir)
    free = shutil.disk_usage(next(p for p in (root, *root.absolute().parents) if p.exists())).free
    if free < need:
        print(f"warning: {root} has {free / 2**30:.1f} GiB free; a checkpoint of this model needs about "
              f"{need / 2**30:.1f} GiB")


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
    """The checkpoint checked, the tokenizer and the data loaded."""
    from transformers import AutoTokenizer

    model_dir = Path(args.run.resume) if args.run.resume else resolve_model_dir(args.data.model)
    config = read_config(model_dir)
    model_args = model_args_from_hf_config(config)
    longest = args.data.max_prompt_tokens + args.sampling.max_new_tokens
    if longest > model_args.max_seq_len:
        raise ValueError(f"--max-prompt-tokens + --max-new-tokens = {longest}, but the model has "
                         f"{model_args.max_seq_len} positions ({model_dir}/config.json: "
                         "max_position_embeddings)")
    check_bitwise_head_dim(model_args.head_dim, longest, model_dir)
    check_checkpoint(model_dir, model_args)
    warn_if_short_of_disk(args, model_args)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:
        raise ValueError(f"--model {model_dir}: cannot load its tokenizer ({type(e).__name__}: "
                         f"{str(e).splitlines()[0]})") from e
    # transformers makes a 1-token tokenizer from a directory without tokenizer files.
    if not 1 < len(tokenizer) <= model_args.vocab_size:
        raise ValueError(f"--model {model_dir}: its tokenizer has {len(tokenizer)} token(s) for a "
                         f"vocabulary of {model_args.vocab_size} (tokenizer files missing, or from another "
                         "model)")
    train_rows = encode_dataset(load_gsm8k(args.data.dataset, "train"), tokenizer, args.data, "train set")
    eval_rows = []
    if args.run.eval_every:
        eval_rows = encode_dataset(load_gsm8k(args.data.eval_dataset, "test"), tokenizer, args.data,
                                   "eval set")
    start_step = saved_run(model_dir)[1] if args.run.resume else 0
    return Inputs(model_dir, model_args, start_step, tokenizer, end_of_sequence_ids(tokenizer, model_dir),
                  train_rows, eval_rows[: args.run.eval_samples])


def reference_policy(model: Qwen3, world: World) -> Qwen3:
    """A frozen copy of the policy (for the KL term), sharded as the policy is."""
    with torch.device(model.cos_sin_cache.device):
        ref_model = Qwen3(model.args, model.kernels, model.tok_embeddings.weight.dtype).requires_grad_(False)
    with torch.no_grad():
        for p, ref in zip(model.parameters(), ref_model.parameters(), strict=True):
            ref.copy_(gathered(p))  # one gathered weight at a time
    return shard_model(ref_model, world) if world.size > 1 else ref_model


def warm_start(model: Qwen3, inputs: Inputs, order: list[int], args: Args, world: World) -> None:
    """--sft-steps of teacher forcing on reference answers (with their own optimizer state). Logged as
    TensorBoard run <run_name>/warm_start: its steps are not GRPO's."""
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    # Answers follow the prompt as the model should write them, then the tokenizer's end of sequence (Qwen3's
    # chat format ends a turn with <|im_end|>).
    plain = args.data.prompt_format == "plain" or inputs.tokenizer.chat_template is None
    for r in inputs.train_rows:
        answer = inputs.tokenizer.encode((" " if plain else "") + r["answer"], add_special_tokens=False)
        r["answer_ids"] = answer + [inputs.tokenizer.eos_token_id or inputs.stop_ids[0]]
    optimizer = MasterWeights(model, args.warm_start.sft_lr, args.optimizer.weight_decay)
    writer = SummaryWriter(str(Path("runs") / args.run.run_name / "warm_start")) if world.is_main else None
    for step in tqdm(range(args.warm_start.sft_steps), desc="warm start", unit="step", file=sys.stdout,
                     disable=not world.is_main):
        loss = sft_step(model, optimizer,
                        step_rows(inputs.train_rows, order, step, args.warm_start.sft_batch_size), args,
                        world)
        if writer:
            writer.add_scalar("sft/loss", loss, step)
    if writer:
        writer.close()


def explain_mismatch(engine: VLLMEngine, model: Qwen3, rollouts: Rollouts, first: Mismatch,
                     world: World) -> str:
    """Wake vLLM with the weights that sampled (no update has been made) and find where the first
    mismatching sample's computation parts: the sequence up to the token, whose last row predicts it."""
    engine.sync_weights(model, world, changed=False)
    try:
        return find_first_divergence(engine, model, rollouts.prompts[first.sample]
                                     + rollouts.completions[first.sample][: first.token])
    except Exception as e:  # a diagnostic must not hide the error it diagnoses
        return f"not found, the locator failed ({type(e).__name__}: {e})"


def grpo(args: Args, engine: VLLMEngine, model: Qwen3, inputs: Inputs, order: list[int], writer,
         world: World):
    """The GRPO loop: vLLM samples while the trainer's weights wait in memory; vLLM sleeps while the trainer
    trains; then the new weights wake vLLM up."""
    from tqdm import tqdm

    s, p, run = args.sampling, args.parity, args.run

    def log_eval(updates: int) -> None:  # logged at the number of GRPO updates made so far
        accuracy = evaluate(engine, inputs.tokenizer, inputs.eval_rows, s.max_new_tokens, inputs.stop_ids,
                            world)
        if writer:
            writer.add_scalar("eval/accuracy", accuracy, updates)
            tqdm.write(f"after {updates} GRPO steps: greedy accuracy {accuracy:.3f} on "
                       f"{len(inputs.eval_rows)} test questions")

    # The reference policy (for KL) is the policy GRPO starts from.
    ref_model = reference_policy(model, world) if args.loss.kl_coef > 0 else None
    optimizer = MasterWeights(model, args.optimizer.lr, args.optimizer.weight_decay)
    totals = {"tokens_checked": 0, "mismatched_tokens": 0}
    if inputs.start_step:
        saved = restore_training_state(inputs.model_dir, optimizer, ref_model, args, world)
        totals = {key: saved[key] for key in totals}
        if world.is_main:
            warn_if_another_stack(saved, inputs.model_dir)
    # Before training; and where a resumed run starts, if an evaluation was due there.
    if run.eval_every and inputs.start_step % run.eval_every == 0:
        log_eval(inputs.start_step)
    steps = range(inputs.start_step, args.optimizer.steps)
    for step in tqdm(steps, desc="GRPO", unit="step", file=sys.stdout, initial=steps.start, total=steps.stop,
                     disable=not world.is_main):
        times, memory = {}, {}
        with phase("generate", times, memory):
            rows = step_rows(inputs.train_rows, order, step, s.prompts_per_step)
            rollouts = rollout(engine, inputs.tokenizer, rows, args, step, inputs.stop_ids, world)
        with phase("train", times, memory):
            engine.sleep()
            ref_logprobs = None if ref_model is None else reference_logprobs(ref_model, rollouts, args, world)
            loss_metrics, trainer_logprobs = train_on_rollouts(model, optimizer, rollouts, ref_logprobs, args,
                                                               world)
            rollouts, trainer_logprobs = whole_step(rollouts, trainer_logprobs, world)  # every rank's samples
            parity, report, first = parity_report(rollouts.vllm_logprobs, trainer_logprobs,
                                                  rollouts.completions, p.parity_report_tokens, world)
            if writer:  # every rank sees the whole step: all locate and stop together
                tqdm.write((f"step {step} parity (first tokens of sample 0):\n"
                            if p.parity_report_tokens else "") + report)
            if first and (p.assert_bitwise or p.locate_divergence):
                message = f"step {step}: {first.message}; first divergence: " + explain_mismatch(
                    engine, model, rollouts, first, world)
                if p.assert_bitwise:
                    log_step(writer, step, {f"parity/{k}": v for k, v in parity.items()}, "parity broken")
                    raise ParityError(message)
                if writer:
                    tqdm.write(message)
                engine.sleep()  # the trainer goes on
            lr = lr_at(step, args.optimizer)
            grad_norm = optimizer.update(lr, args.optimizer.max_grad_norm)
            deltas = optimizer.write_back(world)
        with phase("push", times, memory):
            engine.sync_weights(model, world, changed=any(magnitude for magnitude, _ in deltas.values()))
        totals["tokens_checked"] += sum(len(c) for c in rollouts.completions)
        totals["mismatched_tokens"] += parity["mismatched_tokens"]
        scalars = step_scalars(rollouts, loss_metrics, parity, grad_norm, lr, deltas, times, memory)
        line = (f"step {step}: reward {scalars['reward/reward_mean']:.3f} loss {loss_metrics['loss']:+.5f} "
                f"ratio {loss_metrics['ratio_mean']:.6f} grad {grad_norm:.3f} | "
                + " ".join(f"{k} {v:.2f}s" for k, v in times.items()))
        log_step(writer, step, scalars, line + (f" | GPU {max(memory.values()):.1f} GiB" if memory else ""))
        last = step == args.optimizer.steps - 1
        if run.eval_every and ((step + 1) % run.eval_every == 0 or last):
            log_eval(step + 1)
        if (run.save_every and (step + 1) % run.save_every == 0) or last:
            if writer:  # TensorBoard holds every step up to the checkpoint, should the run die after it
                writer.flush()
            save_checkpoint(model, optimizer, ref_model, inputs, args, step + 1,
                            parity_record(args, model, totals), world)
    if writer:  # the run's certificate of exactness
        (Path(writer.log_dir) / "parity.json").write_text(json.dumps(parity_record(args, model, totals),
                                                                     indent=2))


def main(args: Args, device: str = "cuda", engine_class=VLLMEngine) -> Path:
    """Train; returns the run's TensorBoard directory. Tests give another `engine_class` (a CPU stand-in)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        args = check_args(args, world_size)
        inputs = load_inputs(args)
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("no CUDA GPU found: simple_rl.py runs vLLM and the trainer on a GPU")
        world = init_distributed(device)
        seed_everything(args.data.seed)
        # Under torchrun every rank runs its own engine on its own GPU, in its process: vLLM's external
        # launcher with no data parallelism of vLLM's own (its "external data-parallel" ranks): each engine
        # samples alone and never waits for another's.
        parallel = {"distributed_executor_backend": "external_launcher"} if world.size > 1 else {}
        # vLLM first: it claims --vllm-gpu-memory of a GPU that is still empty.
        engine = engine_class(inputs.model_dir, args.engine.vllm_gpu_memory,
                              args.data.max_prompt_tokens + args.sampling.max_new_tokens, args.data.seed,
                              cuda_graphs=args.engine.vllm_cuda_graphs, **parallel)
        model = load_qwen3(inputs.model_dir, device,
                           activation_checkpointing=args.engine.activation_checkpointing)
        if world.size > 1:
            shard_model(model, world)
    except ValueError as e:
        raise UsageError(str(e)) from e
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
    finally:
        if writer:
            writer.close()  # also on a parity error: the failing step's parity scalars reach the disk
    return Path("runs") / args.run.run_name


if __name__ == "__main__":
    try:
        main(COMMAND_LINE)
    except UsageError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except ParityError as e:
        print(f"error: bitwise parity broken at {e}", file=sys.stderr)
        sys.exit(1)
