"""Bitwise-exact on-policy GRPO for Qwen3 on GSM8K, with vLLM rollouts and a TorchTitan-style trainer.

    VLLM_BATCH_INVARIANT=1 python simple_rl.py                       # Qwen3-1.7B, GSM8K, hub
    VLLM_BATCH_INVARIANT=1 python simple_rl.py --model /path/to/qwen3 --dataset train.jsonl

PHASE-1 PLACEHOLDER DOCSTRING (rewritten with the RL loop).
"""

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

from batch_invariant_backward import EXACT, Kernels

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
# Logprobs
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


def start_vllm(model_dir: Path, gpu_memory_utilization: float, max_model_len: int, seed: int,
               max_num_seqs: int = 256):  # fmt: skip
    """vLLM in this process, on this GPU: eager (compiled kernels give other bits than the ops the
    trainer calls), FlashAttention 3, no prefix caching (weights change every step)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm import LLM

    if vllm.__version__ != "0.20.0":
        raise RuntimeError(f"vLLM {vllm.__version__} is installed; this script mirrors vLLM 0.20.0's kernels: pip install vllm==0.20.0")
    if batch_invariant_enabled():
        make_fused_add_rms_norm_batch_invariant()
    return LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,  # prompts go in as token ids and come back as token ids
        dtype="bfloat16",
        seed=seed,
        enforce_eager=True,
        enable_prefix_caching=False,
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        attention_config={"backend": "FLASH_ATTN", "flash_attn_version": 3},
    )


def batch_invariant_enabled() -> bool:
    return os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1"


def generate(llm, prompts: list[list[int]], max_tokens: list[int], temperature: float, seeds: list[int],
             stop_token_ids: list[int] = (), ignore_eos: bool = False):  # fmt: skip
    """Sample one completion per prompt. Returns the completion token ids and, for each sampled
    token, vLLM's logprob of it (fp32, raw: before temperature) as an fp32 tensor."""
    from vllm import SamplingParams, TokensPrompt

    params = [
        SamplingParams(temperature=temperature, max_tokens=n, seed=s, logprobs=0, detokenize=False,
                       stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)  # fmt: skip
        for n, s in zip(max_tokens, seeds)
    ]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    completions, logprobs = [], []
    for out in outputs:
        sample = out.outputs[0]
        completions.append(list(sample.token_ids))
        # A Python float holds the fp32 value exactly, so this round trip is lossless.
        logprobs.append(torch.tensor([lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs)],
                                     dtype=torch.float32))  # fmt: skip
    return completions, logprobs


def push_weights_to_vllm(llm, model: Qwen3) -> None:
    """Copy the trainer's bf16 weights into the served model in-process, no disk: vLLM's own
    `load_weights` copies each HF-named tensor into its merged q/k/v and gate/up slots, bit for bit."""
    weights = hf_state_dict(model)
    llm.apply_model(lambda served: served.load_weights(iter(weights.items())))


def weights_checksum(params) -> int:
    """Order-independent exact checksum of bf16 weights: the sum of their bit patterns. The
    trainer's and vLLM's layouts hold the same elements, so the sums agree iff nothing is stale."""
    return sum(int(p.detach().view(torch.int16).sum(dtype=torch.int64)) for p in params)


def served_weights_checksum(llm) -> int:
    return llm.apply_model(lambda served: weights_checksum(served.parameters()))[0]
