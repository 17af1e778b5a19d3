"""Backward passes for the forward-only kernels vLLM 0.20 runs for Qwen3 in batch-invariant mode.

vLLM's kernels compute forward passes only. Each `torch.autograd.Function` below runs, on CUDA, the very
kernel vLLM runs, or one of ours proven to give its bits (`tiled_linear`, `rms_norm_rows`,
`split_log_softmax`: faster, tests/test_gpu.py compares them), so the trainer's forward bits are vLLM's
bits; and, on the CPU, a plain-PyTorch reference of the same math (so the whole model also trains without
a GPU). Every backward is written in plain PyTorch (cuBLAS and PyTorch's fused flash-attention backward
on the GPU), or for SwiGLU, the RMSNorm, lm_head's logprobs and the embedding in a small Triton kernel of
ours on the GPU (as is the entropy, in the forward): gradients must be correct and deterministic, not
batch-invariant.

A model picks its kernels explicitly: `EXACT` (these Functions) or `REFERENCE` (the plain-PyTorch
functions under ordinary autograd, the ground truth in tests).

The last section is vLLM's side: the kernels simple_rl.py installs in the engine (`install_exact_kernels`,
the one function that changes global state: it patches vLLM's modules in the calling process), and where
its sampler keeps the logprobs it drew (`SAMPLED`); then the divergence locator, which records both sides'
tensors over one sequence and names the first op whose bits differ.

Shapes: T tokens packed back to back (no padding), H query heads, Hk key/value heads, D head dim.
"""

import dataclasses
import functools
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32 for bf16/fp16/fp32 tensors, fp64 for fp64 ones (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------------------------------------
# Plain-PyTorch references (CPU forward of each Function, and ground truth under autograd)
# ---------------------------------------------------------------------------------------------


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)  # (T, K) @ (N, K)^T -> (T, N)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None):
    # vLLM's Triton kernel: fp32 sum of squares per row, x * rsqrt(mean + eps) * w in fp32,
    # one rounding to the input dtype at the end. With `residual`: (the norm of x + residual, the sum).
    if residual is not None:
        summed = x + residual
        return rms_norm_reference(summed, weight, eps), summed
    xf = x.to(_acc(x.dtype))
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.to(xf.dtype)).to(x.dtype)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.to(_acc(gate_up.dtype)).chunk(2, dim=-1)  # (T, 2I) -> 2 x (T, I)
    return (F.silu(gate) * up).to(gate_up.dtype)


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool):
    """A mixture-of-experts router's choice, as vLLM's `topk_softmax` kernel makes it: a softmax over all
    experts in fp32, the `top_k` most probable in descending order (ties to the lower expert), renormalised to
    sum to 1 if `renormalize` (Qwen3's `norm_topk_prob`). (T, E) logits -> (T, k) weights, (T, k) int32
    ids."""
    probs = torch.softmax(logits.to(_acc(logits.dtype)), dim=-1)
    ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(-1, ids)
    return (weights / weights.sum(-1, keepdim=True) if renormalize else weights), ids.to(torch.int32)


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
    """Each token through its k experts, a SwiGLU each (w13 (E, 2I, H) = [gate; up], w2 (E, H, I)), whose
    fp32 output is scaled by its routing weight before its one rounding, as vLLM's second grouped GEMM does;
    the k outputs summed in fp32. x (T, H) -> (T, H)."""
    acc, k = _acc(x.dtype), ids.shape[1]
    out, pair_ids, pair_weights = x.new_zeros(x.shape, dtype=acc), ids.reshape(-1), weights.reshape(-1)
    for e in pair_ids.unique().tolist():
        pairs = (pair_ids == e).nonzero().squeeze(1)  # the (token, k) pairs routed to expert e
        tokens = pairs // k
        act = silu_and_mul_reference(linear_reference(x[tokens], w13[e]))
        y = F.linear(act.to(acc), w2[e].to(acc)) * pair_weights[pairs, None].to(acc)
        out = out.index_add(0, tokens, y.to(x.dtype).to(acc))
    return out.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Neox-style rotary: the first and second halves of each head are the pairs rotated.
    x1, x2 = x.to(cos.dtype).chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype):
    cos, sin = cos_sin_cache[positions].to(_acc(dtype)).chunk(2, dim=-1)  # 2 x (T, D/2)
    return cos[:, None, :], sin[:, None, :]  # broadcast over heads


def rotary_reference(q, k, positions, cos_sin_cache):
    """q (T, H, D), k (T, Hk, D) rotated by the angles of `positions` in `cos_sin_cache`."""
    cos, sin = _cos_sin(positions, cos_sin_cache, q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def qk_norm_rotary_reference(q, k, q_weight, k_weight, eps, positions, cos_sin_cache):
    """Qwen3's q and k heads each RMS-normed, then rotated."""
    q, k = rms_norm_reference(q, q_weight, eps), rms_norm_reference(k, k_weight, eps)
    return rotary_reference(q, k, positions, cos_sin_cache)


class AttentionSpans(NamedTuple):
    """Causal attention over packed rows, in spans: span i's queries are rows `cu_seqlens[i]:cu_seqlens[i+1]`,
    its keys and values rows `kv_rows[cu_seqlens_k[i]:cu_seqlens_k[i+1]]` (its own rows where `kv_rows` is
    None), its last query reading up to its last key: causal from the bottom right, as FlashAttention aligns a
    span of fewer queries than keys (a sample's completion reading its prompt's rows where they lie, as vLLM's
    decode reads a sequence's cached keys)."""
    cu_seqlens: torch.Tensor  # (N + 1,) int32
    max_seqlen: int
    cu_seqlens_k: torch.Tensor  # (N + 1,) int32, over kv_rows
    max_seqlen_k: int
    kv_rows: torch.Tensor | None = None  # (keys,) int64

    @staticmethod
    def sequences(seqlens: torch.Tensor, device=None) -> "AttentionSpans":
        """Each sequence its own span: its rows its queries and keys."""
        cu = F.pad(seqlens.cumsum(0), (1, 0)).to(device, torch.int32)
        return AttentionSpans(cu, int(seqlens.max()), cu, int(seqlens.max()))


# A micro-batch's keys at most this many times its rows (simple_rl's packing; micro_batch_bytes counts them):
# its samples' shared prompt rows are read once a sample.
KEYS_PER_ROW = 2


def row_runs(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The rows `start, start + 1, ...` of each (start, length) run, runs back to back."""
    offsets = starts - (lengths.cumsum(0) - lengths)
    return torch.arange(int(lengths.sum())) + offsets.repeat_interleave(lengths)


def _spans(spans: AttentionSpans, device):
    """(query rows as a slice, key rows) of each span."""
    q_bounds, k_bounds = spans.cu_seqlens.tolist(), spans.cu_seqlens_k.tolist()
    for i in range(len(q_bounds) - 1):
        keys = (torch.arange(q_bounds[i], q_bounds[i + 1]) if spans.kv_rows is None
                else spans.kv_rows[k_bounds[i]:k_bounds[i + 1]])
        yield slice(q_bounds[i], q_bounds[i + 1]), keys.to(device)


def _causal_attention_one_span(q, k, v, scale):
    """q (Lq, H, D), k and v (Lk, Hk, D), Lq <= Lk, causal from the bottom right -> out (Lq, H, D),
    lse (H, Lq), probabilities (H, Lq, Lk)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~_causal_mask(len(q), len(k), q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (H, Lq)
    probs = torch.exp(scores - lse[..., None])
    return torch.einsum("hqk,khd->qhd", probs, v), lse, probs


def _causal_mask(n_q: int, n_k: int, device) -> torch.Tensor:
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(n_k - n_q)


def attention_reference(q, k, v, spans: AttentionSpans, scale):
    """Causal attention over packed spans, one span at a time (Lq x Lk per span: the CPU reference only).
    Returns out (T, H, D) in q's dtype and lse (H, T) in fp32/fp64."""
    acc = _acc(q.dtype)
    outs, lses = [], []
    for rows, keys in _spans(spans, q.device):
        out, lse, _ = _causal_attention_one_span(q[rows].to(acc), k[keys].to(acc), v[keys].to(acc), scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1)


def tempered_logits(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """The bf16 logits (rows, V) in fp32 divided by the temperature, a tensor, as vLLM 0.20's sampler divides
    them (`logits.div_(temp)`): dividing by a Python float would multiply by its reciprocal, other bits.
    None stands for T = 1, where dividing changes no bit: the pass over (rows, V) is skipped."""
    x = logits.to(_acc(logits.dtype), copy=True)  # fp32 (fp64 in gradchecks); a copy: top-k/p masks in place
    return x if temperature is None else x / temperature


def temperature_tensor(temperature: float, dtype: torch.dtype, device=None) -> torch.Tensor | None:
    """What `tempered_logits` divides by: T as a tensor, or None at T = 1."""
    # filled on the device: torch.tensor would copy from the host, which waits for the GPU
    return None if temperature == 1 else torch.full((), temperature, dtype=dtype, device=device)


def truncated(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The tempered logits (rows, V) with the tokens outside the top-k and the top-p set at -inf, as vLLM's
    sampler masks them: `top_k_top_p`, in place, on CUDA; elsewhere, and under autograd, vLLM's sort-based
    version of the same math. top_k 0 and top_p 1 keep every token."""
    k = torch.full((len(x),), top_k, dtype=torch.int32, device=x.device) if top_k else None
    p = torch.full((len(x),), top_p, dtype=torch.float32, device=x.device) if top_p < 1 else None
    if k is None and p is None:
        return x
    if x.is_cuda and not x.requires_grad:
        return top_k_top_p(x, k, p)
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    # The sort runs outside autograd; the mask it finds is applied under it.
    dropped = apply_top_k_top_p_pytorch(x.detach().clone(), k, p) == float("-inf")
    return x.masked_fill(dropped, float("-inf"))


def top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM 0.20's Triton top-k/top-p (`apply_top_k_top_p_triton`, one row at a time), for any number of
    rows. vLLM's own `apply_top_k_top_p` runs it from 8 rows up and a sort below, so a sequence's kept set
    could depend on how many sequences shared its decode step; simple_rl.py installs this in the engine,
    and the trainer runs it too. Masks (rows, V) fp32 logits in place, and returns them."""
    if k is None and p is None:
        return logits
    from vllm.v1.sample.ops.topk_topp_triton import apply_top_k_top_p_triton

    return apply_top_k_top_p_triton(logits, k, p)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise log-softmax (rows, V) fp32: on CUDA the bits of vLLM's batch-invariant Triton kernel
    (`split_log_softmax`, faster), which the engine's sampler keeps at each drawn token (`token_logprobs`)."""
    if x.is_cuda:
        return split_log_softmax(x)
    return torch.log_softmax(x, dim=-1)


def token_logprobs(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 (rows, V) logits, a token per row -> each token's `log_softmax` (its bits on CUDA, where
    `split_token_logprobs` computes no other token's)."""
    if x.is_cuda:
        return split_token_logprobs(x, tokens)
    return torch.log_softmax(x, dim=-1).gather(1, tokens[:, None])[:, 0]


# vLLM's batch-invariant log-softmax runs a program per row: 32 rows of a 32-sequence decode step keep 32 of
# an H100's 132 SMs busy. The kernels below split each row in chunks of 8 blocks and give its bits: a
# row's max (exact in any order), each block's sum of exp (vLLM's `tl.sum` over the same 1,024-wide block, the
# same ops), then those sums added one after another in block order, as vLLM's loop adds them.
SOFTMAX_BLOCK, SOFTMAX_CHUNK = 1024, 8
ENTROPY_BLOCK = 2048  # both entropy kernels': each lane adds its columns in row order, then the lanes add


@triton.jit
def _chunk_max_kernel(x, row_stride, n_cols, chunk_max, n_chunks,
                      BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr):
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    x += row * row_stride
    max_val = -float("inf")
    for b in range(CHUNK):
        cols = (chunk * CHUNK + b) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        vals = tl.load(x + cols, mask=cols < n_cols, other=-float("inf"))
        max_val = tl.max(tl.maximum(vals, max_val))
    tl.store(chunk_max + row * n_chunks + chunk, max_val)


@triton.jit
def _row_max(chunk_max, row, n_chunks, CHUNKS: tl.constexpr):
    i = tl.arange(0, CHUNKS)
    return tl.max(tl.load(chunk_max + row * n_chunks + i, mask=i < n_chunks, other=-float("inf")))


@triton.jit
def _block_sums_kernel(x, row_stride, n_cols, chunk_max, n_chunks, block_sums, n_blocks,
                       BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    x += row * row_stride
    max_val = _row_max(chunk_max, row, n_chunks, CHUNKS)
    for b in range(CHUNK):
        block = chunk * CHUNK + b
        cols = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = cols < n_cols
        vals = tl.load(x + cols, mask=mask, other=0.0)
        exp_vals = tl.exp(vals - max_val)
        block_sum = tl.sum(tl.where(mask, exp_vals, 0.0))
        tl.store(block_sums + row * n_blocks + block, block_sum, mask=block < n_blocks)


@triton.jit
def _row_max_and_log_sum_exp(chunk_max, row, n_chunks, block_sums,
                             CHUNKS: tl.constexpr, BLOCKS: tl.constexpr):
    sum_exp = 0.0
    for b in tl.static_range(BLOCKS):  # unrolled (no loop to run); the adds go one after another, as vLLM's
        sum_exp += tl.load(block_sums + row * BLOCKS + b)
    return _row_max(chunk_max, row, n_chunks, CHUNKS), tl.log(sum_exp)


@triton.jit
def _log_softmax_out_kernel(x, row_stride, out, out_row_stride, n_cols, chunk_max, n_chunks, block_sums,
                            BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                            BLOCKS: tl.constexpr):
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    max_val, log_sum_exp = _row_max_and_log_sum_exp(chunk_max, row, n_chunks, block_sums, CHUNKS, BLOCKS)
    x += row * row_stride
    out += row * out_row_stride
    for b in range(CHUNK):
        cols = (chunk * CHUNK + b) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = cols < n_cols
        vals = tl.load(x + cols, mask=mask)
        tl.store(out + cols, vals - max_val - log_sum_exp, mask=mask)


@triton.jit
def _token_logprob_kernel(x, row_stride, n_cols, tokens, out, entropy, chunk_max, n_chunks, block_sums,
                          CHUNKS: tl.constexpr, BLOCKS: tl.constexpr, ENTROPY: tl.constexpr,
                          ENTROPY_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # `_log_softmax_out_kernel`'s ops, for one column
    max_val, log_sum_exp = _row_max_and_log_sum_exp(chunk_max, row, n_chunks, block_sums, CHUNKS, BLOCKS)
    x += row * row_stride
    tl.store(out + row, tl.load(x + tl.load(tokens + row)) - max_val - log_sum_exp)
    if ENTROPY:  # `_row_entropy_kernel`'s sum over the values `_log_softmax_out_kernel` would write
        acc = tl.zeros([ENTROPY_BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, ENTROPY_BLOCK):
            cols = start + tl.arange(0, ENTROPY_BLOCK)
            lp = tl.load(x + cols, mask=cols < n_cols, other=float("-inf")) - max_val - log_sum_exp
            acc += tl.where(lp == float("-inf"), 0.0, -tl.exp(lp) * lp)
        tl.store(entropy + row, tl.sum(acc, axis=0))


def _row_sums(x: torch.Tensor):
    """fp32 (..., V) -> its rows (aligned as vLLM's kernel reads them), each chunk's max, each block's sum."""
    if x.dtype != torch.float32:
        raise ValueError("the split log-softmax takes fp32 rows")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if rows.data_ptr() % 16:  # vLLM's layout of a block follows its aligned output; ours, the input
        rows = rows.clone()
    n_rows, n_cols = rows.shape
    n_blocks = triton.cdiv(n_cols, SOFTMAX_BLOCK)
    n_chunks = triton.cdiv(n_blocks, SOFTMAX_CHUNK)
    chunk_max = rows.new_empty(n_rows, n_chunks)
    block_sums = rows.new_empty(n_rows, n_blocks)
    if n_rows and n_cols:
        grid, sizes = (n_rows, n_chunks), dict(BLOCK_SIZE=SOFTMAX_BLOCK, CHUNK=SOFTMAX_CHUNK)
        _chunk_max_kernel[grid](rows, rows.stride(0), n_cols, chunk_max, n_chunks, **sizes)
        _block_sums_kernel[grid](rows, rows.stride(0), n_cols, chunk_max, n_chunks, block_sums, n_blocks,
                                 **sizes, CHUNKS=triton.next_power_of_2(n_chunks))
    return rows, chunk_max, block_sums


def split_log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """vLLM 0.20's batch-invariant `log_softmax` of fp32 `x` over its last dim, with its bits, each row split
    over many programs (see the kernels above), for the trainer, and for aten's in vLLM's process;
    tests/test_gpu.py checks the bits against vLLM's kernel."""
    if dim not in (-1, x.dim() - 1):
        raise ValueError("split_log_softmax normalises fp32 rows over the last dimension only")
    rows, chunk_max, block_sums = _row_sums(x)
    out = torch.empty_like(rows)
    if out.numel():
        (n_rows, n_chunks), n_blocks = chunk_max.shape, block_sums.shape[1]
        _log_softmax_out_kernel[n_rows, n_chunks](
            rows, rows.stride(0), out, out.stride(0), rows.shape[1], chunk_max, n_chunks, block_sums,
            BLOCK_SIZE=SOFTMAX_BLOCK, CHUNK=SOFTMAX_CHUNK, CHUNKS=triton.next_power_of_2(n_chunks),
            BLOCKS=n_blocks)
    return out.reshape(x.shape)


def split_token_logprobs(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 (rows, V) logits, a token per row -> each token's log-softmax, the bits of
    `split_log_softmax(x).gather(1, tokens[:, None])[:, 0]` without writing the (rows, V) result: the
    sampler's processed logprob of each token drawn, for the cost of reading the logits twice."""
    return _split_token_logprobs(x, tokens, with_entropy=False)[0]


def split_token_logprobs_and_entropy(x: torch.Tensor, tokens: torch.Tensor):
    """`split_token_logprobs` and, in the same programs, a third read of the logits: each row's entropy, the
    bits of `row_entropy(split_log_softmax(x))`, the (rows, V) logprobs never written (the trainer's
    forward: one pass over the logits where writing and reading them back took three)."""
    return _split_token_logprobs(x, tokens, with_entropy=True)


def _split_token_logprobs(x: torch.Tensor, tokens: torch.Tensor, with_entropy: bool):
    rows, chunk_max, block_sums = _row_sums(x)
    out = rows.new_empty(len(rows))
    entropy = rows.new_empty(len(rows)) if with_entropy else out  # unwritten without: no null pointer
    if block_sums.numel():
        (n_rows, n_chunks), n_blocks = chunk_max.shape, block_sums.shape[1]
        _token_logprob_kernel[(n_rows,)](rows, rows.stride(0), rows.shape[1], tokens.contiguous(), out,
                                         entropy, chunk_max, n_chunks, block_sums,
                                         CHUNKS=triton.next_power_of_2(n_chunks), BLOCKS=n_blocks,
                                         ENTROPY=with_entropy, ENTROPY_BLOCK=ENTROPY_BLOCK)
    return out, entropy


def entropy_of(logprobs: torch.Tensor) -> torch.Tensor:
    """-sum p log p per row of (rows, V) logprobs; the tokens outside a top-k/top-p set (log p = -inf, p = 0)
    add 0. On CUDA outside autograd, `row_entropy`: one read of the logprobs, where these ops take four."""
    if logprobs.is_cuda and not logprobs.requires_grad:
        return row_entropy(logprobs)
    return -(logprobs.exp() * logprobs.nan_to_num(neginf=0.0)).sum(-1)


@triton.jit
def _row_entropy_kernel(logprobs, entropy, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        lp = tl.load(logprobs + row * V + cols, mask=cols < V, other=float("-inf"))
        acc += tl.where(lp == float("-inf"), 0.0, -tl.exp(lp) * lp)  # a NaN stays NaN, as in PyTorch
    tl.store(entropy + row, tl.sum(acc, axis=0))


def row_entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """`entropy_of` of fp32 (rows, V) logprobs in a Triton kernel of ours, a program per row (fp32 sums in a
    fixed order: deterministic)."""
    logprobs = logprobs.contiguous()
    entropy = logprobs.new_empty(logprobs.shape[0])
    _row_entropy_kernel[(len(entropy),)](logprobs, entropy, logprobs.shape[1], BLOCK=ENTROPY_BLOCK)
    return entropy


def sampled_distribution(logits, targets, temperature: torch.Tensor | None, top_k: int, top_p: float):
    """For a chunk of bf16 logits (rows, V) and the tokens sampled from them (rows,): the tokens' logprobs,
    the entropy, the number of tokens kept and the probability top-k/top-p cut from softmax(logits / T),
    each (rows,), under the distribution vLLM samples from. With every token kept, the last two are V and
    0 without a pass over the logits."""
    x = tempered_logits(logits, temperature)
    kept, cut = torch.full_like(targets, x.shape[1]), torch.zeros_like(x[:, 0])
    if top_k or top_p < 1:
        before = torch.logsumexp(x, dim=-1)
        x = truncated(x, top_k, top_p)
        kept, cut = (x > float("-inf")).sum(-1), 1 - torch.exp(torch.logsumexp(x, dim=-1) - before)
    if x.is_cuda and not x.requires_grad:  # the (rows, V) logprobs never written
        return *split_token_logprobs_and_entropy(x, targets), kept, cut
    logprobs = log_softmax(x)
    return logprobs.gather(-1, targets[:, None]).squeeze(-1), entropy_of(logprobs), kept, cut


def lm_head_logprobs_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """hidden (C, dim), lm_head weight (V, dim), targets (C,) -> what `sampled_distribution` gives for their
    logits, in plain PyTorch under autograd on any device."""
    x = tempered_logits(linear_reference(hidden, weight), temperature_tensor(temperature, _acc(hidden.dtype)))
    before = torch.logsumexp(x.detach(), dim=-1)
    x = truncated(x, top_k, top_p)
    logprobs = torch.log_softmax(x, dim=-1)
    cut = 1 - torch.exp(torch.logsumexp(x.detach(), dim=-1) - before)
    return (logprobs.gather(-1, targets[:, None]).squeeze(-1), entropy_of(logprobs),
            (x > float("-inf")).sum(-1), cut)


# ---------------------------------------------------------------------------------------------
# The batch-invariant matmul, tiled for the number of rows
# ---------------------------------------------------------------------------------------------


def matmul_tiles(M: int, N: int, K: int, num_sms: int) -> dict:
    """The tiles `tiled_linear` launches vLLM's persistent matmul with, for (M, K) @ (K, N) in bf16.
    vLLM 0.20 uses 128 x 128 x 64 tiles and 3 pipeline stages for every M: a decode step's projections (M =
    the sequences decoding) then get N / 128 tiles, 16 for a 2048-wide output, and leave most SMs idle. Here,
    at up to 512 rows, a tile is as tall as the rows need and as wide as keeps at least half the SMs busy,
    128 or 256 deep (fewer, larger steps through K: a narrow tile's 64-deep step is too little work a
    load), and its pipeline has up to 8 stages: a decode GEMM is a read of the weights, and narrow tiles need
    deep pipelines to read at full speed; a narrow output gets tiles of at most 64 rows. Above 512 rows,
    128 x 256 x 64 tiles run near cuBLAS's speed. Chosen from sweeps over the Qwen3-1.7B projections on an
    H100 and an H200 (`bench.py --kernels --sweep`). No choice moves a bit: each output is an fp32 sum of
    16-wide MMAs in K's order from zero, however many a step issues (a step deeper than 64 only where it
    divides K: a zero-padded step would add +0.0 to a -0.0 sum); tests/test_gpu.py checks it."""
    if M > 512:
        return dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, num_warps=8, num_stages=3)
    block_m = min(128, max(16, 1 << (M - 1).bit_length()))  # the power of 2 that holds M rows
    if block_m == 128 and -(-M // 128) * -(-N // 256) >= num_sms // 2:  # gate/up, lm_head
        return dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, num_warps=8, num_stages=4)
    if block_m == 128 and -(-M // 128) * -(-N // 128) < num_sms // 2:
        block_m = 64  # narrow outputs (q/k/v, o_proj, down): twice the tiles, each half as tall
    rows = -(-M // block_m)
    block_n = 128
    while block_n > 16 and rows * -(-N // block_n) < num_sms // 2:
        block_n //= 2
    block_k = next((k for k in (256 if block_n <= 32 else 128, 128) if K % k == 0), 64)
    # As many stages as ~200 KB of shared memory holds (Triton adds up to 32 KB; an H100 SM has 227 KB).
    stages = min(8, 200_000 // ((block_m + block_n) * block_k * 2))
    return dict(BLOCK_SIZE_M=block_m, BLOCK_SIZE_N=block_n, BLOCK_SIZE_K=block_k,
                num_warps=8 if block_m * block_n >= 128 * 128 else 4, num_stages=stages)


def qwen3_gemms(dim: int, hidden_dim: int, n_heads: int, n_kv_heads: int, head_dim: int,
                vocab_size: int) -> dict:
    """(N, K) of every linear of a Qwen3: merged q/k/v, o_proj, merged gate/up, down_proj, lm_head."""
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    return {"qkv": (q + 2 * kv, dim), "o_proj": (dim, q), "gate_up": (2 * hidden_dim, dim),
            "down": (dim, hidden_dim), "lm_head": (vocab_size, dim)}


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 tiles: dict | None = None) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T -> (..., N): vLLM 0.20's batch-invariant linear
    (`linear_batch_invariant`, Triton `matmul_kernel_persistent`: fp32 sums of 16-wide MMAs in K's order,
    one rounding) with its tiles chosen by `matmul_tiles` (or given), so the same bits, sooner. The
    engine serves every linear layer with it (simple_rl.py installs it) and the trainer's forward
    runs it. Other dtypes go to vLLM's own launch."""
    from vllm.model_executor.layers.batch_invariant import matmul_kernel_persistent, matmul_persistent

    if x.dtype != torch.bfloat16:
        out = matmul_persistent(x.reshape(-1, x.shape[-1]), weight.t())
    else:
        a, b = x.reshape(-1, x.shape[-1]), weight.t()  # (M, K), (K, N)
        (M, K), N = a.shape, b.shape[1]
        out = torch.empty((M, N), device=a.device, dtype=a.dtype)
        num_sms = _num_sms(a.device)
        config = tiles or matmul_tiles(M, N, K, num_sms)
        grid = (min(num_sms, -(-M // config["BLOCK_SIZE_M"]) * -(-N // config["BLOCK_SIZE_N"])),)
        matmul_kernel_persistent[grid](
            a, b, out, None, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            out.stride(0), out.stride(1), GROUP_SIZE_M=8, NUM_SMS=num_sms,
            A_LARGE=a.numel() > 2**31, B_LARGE=b.numel() > 2**31, C_LARGE=out.numel() > 2**31,
            HAS_BIAS=False, **config)  # fmt: skip
    out = out.reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias  # as vLLM adds a bias: after the matmul


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _linear_forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return tiled_linear(x, weight) if x.is_cuda else linear_reference(x, weight)


class Embedding(torch.autograd.Function):
    """`F.embedding`, the row gather vLLM's embedding layer runs. Backward: a vocabulary row's gradient is the
    sum of the output gradients at the positions holding its token. PyTorch's CUDA kernel for it
    (`embedding_dense_backward`) rests on CUB algorithms that are not deterministic (pytorch/pytorch#101890,
    #102628): in the offline demo's GRPO steps, repeats on the same input gave other last bits. So on CUDA,
    `embedding_grad` sums each row in a fixed order (and if the weight has an fp32 sum of its gradient,
    `main_grad`, adds each row's bf16 rounding to it in the same kernel, as `weight_grad` does for a
    linear's); on the CPU, `index_add_`."""

    @staticmethod
    def forward(ctx, tokens, weight):
        ctx.save_for_backward(tokens)
        ctx.weight = weight  # the parameter, for its `main_grad`
        return F.embedding(tokens, weight)

    @staticmethod
    def backward(ctx, grad_out):
        (tokens,) = ctx.saved_tensors
        if grad_out.is_cuda:
            main_grad = getattr(ctx.weight, "main_grad", None)
            return None, embedding_grad(grad_out, tokens, ctx.weight.shape[0], main_grad)
        acc, dim = _acc(grad_out.dtype), grad_out.shape[-1]
        grad = grad_out.new_zeros(ctx.weight.shape[0], dim, dtype=acc)
        grad.index_add_(0, tokens.reshape(-1), grad_out.reshape(-1, dim).to(acc))
        return None, grad.to(grad_out.dtype)


@triton.jit
def _embedding_grad_kernel(grad_out, order, bounds, grad, D, BLOCK: tl.constexpr, ADD: tl.constexpr):
    # One vocabulary row's block of BLOCK columns: the sum over the positions of its token, in their order;
    # with ADD, `grad` is the weight's fp32 sum, and the sum's bf16 rounding is added to it.
    row, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    start, end = tl.load(bounds + row), tl.load(bounds + row + 1)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(start, end):
        acc += tl.load(grad_out + tl.load(order + i) * D + cols, mask=cols < D).to(tl.float32)
    rounded = acc.to(grad_out.dtype.element_ty)
    if ADD:  # an absent token's row would add +0, which changes no sum of adds begun at +0: skipped
        if end > start:
            total = tl.load(grad + row * D + cols, mask=cols < D) + rounded.to(tl.float32)
            tl.store(grad + row * D + cols, total, mask=cols < D)
    else:
        tl.store(grad + row * D + cols, rounded, mask=cols < D)


def embedding_grad(grad_out: torch.Tensor, tokens: torch.Tensor, rows: int,
                   main_grad: torch.Tensor | None = None) -> torch.Tensor | None:
    """The embedding's (rows, D) weight gradient on CUDA, the same bits on every run: a stable sort lists each
    token's positions in order, then a program per (vocabulary row, block of columns) sums them in fp32 and
    rounds once (a row whose token is absent gets 0). With `main_grad` (the weight's fp32 gradient sum), each
    rounded row is added to it, what `MasterWeights.fold` would add, and None returned: no (rows, D) gradient
    is written and read back."""
    D = grad_out.shape[-1]
    if main_grad is not None and (main_grad.shape != (rows, D) or main_grad.dtype != torch.float32
                                  or not main_grad.is_contiguous() or main_grad.device != grad_out.device):
        raise ValueError(f"embedding_grad: main_grad must be a contiguous fp32 ({rows}, {D}) on "
                         f"{grad_out.device}, not {tuple(main_grad.shape)} {main_grad.dtype} on "
                         f"{main_grad.device}")
    grad_out = grad_out.reshape(-1, D).contiguous()
    sorted_tokens, order = torch.sort(tokens.reshape(-1), stable=True)
    ids = torch.arange(rows + 1, dtype=tokens.dtype, device=tokens.device)
    bounds = torch.searchsorted(sorted_tokens, ids)  # row r's positions: order[bounds[r]:bounds[r + 1]]
    add = main_grad is not None
    grad = main_grad if add else grad_out.new_empty(rows, D)
    block = min(1024, triton.next_power_of_2(D))
    _embedding_grad_kernel[(rows, triton.cdiv(D, block))](grad_out, order, bounds, grad, D, BLOCK=block,
                                                          ADD=add)
    return None if add else grad


def weight_grad(weight: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor):
    """dW = dy^T @ x for a (N, K) weight, dy (..., N), x (..., K). If the weight has an fp32 sum of its
    gradient (`main_grad`: simple_rl.py's `MasterWeights`, on one GPU), the product is added to it and None
    returned: cuBLAS sums in fp32 and adds to the sum in the same kernel (as Megatron-LM's gradient
    accumulation fusion), so no bf16 dW is rounded, written and read again by a separate add. `weight` is
    the parameter the forward was given (`ctx.weight`): under activation checkpointing, the saved one comes
    back to the backward as a detached copy, without `main_grad`."""
    grad_out, x = grad_out.reshape(-1, grad_out.shape[-1]).t(), x.reshape(-1, x.shape[-1])
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return grad_out @ x
    if grad_out.is_cuda:
        torch.addmm(main_grad, grad_out, x, out_dtype=main_grad.dtype, out=main_grad)
    else:  # no bf16 -> fp32 matmul on the CPU; a product of two bf16 is exact in fp32
        main_grad.addmm_(grad_out.to(main_grad.dtype), x.to(main_grad.dtype))
    return None


def into_gradient_sum(weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
    """A weight's bf16 gradient added to its fp32 sum (`main_grad`) if it has one, the add
    `MasterWeights.fold` makes once autograd has stored it, and None returned: autograd then neither stores
    it nor calls a hook, host work saved for each of a 1.7B micro-batch's 113 norms. Else the gradient, for
    autograd. `weight`: the parameter the forward was given (`ctx.weight`, as for `weight_grad`)."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return grad
    main_grad.add_(grad)
    return None


class BatchInvariantLinear(torch.autograd.Function):
    """`tiled_linear`: vLLM's Triton persistent matmul (fp32 accumulation in a fixed order whatever the
    number of rows), the op behind every linear layer of vLLM in batch-invariant mode.
    Backward: dx = dy @ W and dW = dy^T @ x (cuBLAS; `weight_grad`)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        ctx.weight = weight  # the parameter, for `weight_grad`
        return _linear_forward(x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_w = weight_grad(ctx.weight, grad_out, x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def head_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` (..., D) as the (T, heads, D) rows the RMSNorm kernels read: q/k heads where they lie (a view into
    the qkv projection's output), other inputs a row a token; columns contiguous."""
    rows = x if x.dim() == 3 else x.reshape(-1, 1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


@triton.jit
def _rms_norm_rows_kernel(x, x_row_stride, x_head_stride, residual, summed, weight, out, heads, n_cols, eps,
                          BLOCK_SIZE: tl.constexpr, CHUNKS: tl.constexpr, ADD: tl.constexpr):
    """vLLM's `_rms_norm_kernel`, the same ops in the same order (its bits), for the row (token, head) of a
    strided (T, heads, D) `x`; with ADD, of bf16(x + residual), which it also stores in `summed`. vLLM loops
    over the row's BLOCK_SIZE-wide chunks twice (the sum of squares, then the output); here the row is read
    once, as a (CHUNKS, BLOCK_SIZE) tile: each chunk summed across the block's lanes as vLLM sums it, the
    chunks' sums then added in vLLM's order, first to last."""
    row = tl.program_id(0).to(tl.int64)
    x += (row // heads) * x_row_stride + (row % heads) * x_head_stride
    chunk = tl.arange(0, CHUNKS)
    cols = chunk[:, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]
    mask = cols < n_cols
    vals = tl.load(x + cols, mask=mask, other=0.0)
    if ADD:  # fp32 sum, one rounding to bf16: what PyTorch's bf16 add computes
        vals = (vals.to(tl.float32) + tl.load(residual + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32))
        vals = vals.to(out.dtype.element_ty)
        tl.store(summed + row * n_cols + cols, vals, mask=mask)
    vals_f32 = vals.to(tl.float32)
    chunk_sums = tl.sum(tl.where(mask, vals_f32 * vals_f32, 0.0), axis=1)  # (CHUNKS,): a chunk's sum a row
    sum_sq = tl.zeros([1], dtype=tl.float32)
    for c in tl.static_range(CHUNKS):  # in order; a sum of one chunk's value and zeros is that value exactly
        sum_sq += tl.sum(tl.where(chunk == c, chunk_sums, 0.0), axis=0)
    mean_sq = sum_sq / n_cols
    rms = tl.sqrt(mean_sq + eps)
    inv_rms = 1.0 / rms
    w = tl.load(weight + cols, mask=mask, other=1.0)
    output_f32 = vals_f32 * inv_rms * w.to(tl.float32)
    tl.store(out + row * n_cols + cols, output_f32.to(out.dtype.element_ty), mask=mask)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """vLLM 0.20's `rms_norm_batch_invariant` of `x` (..., D), with its bits, in one launch where vLLM takes
    two or three: rows read where they lie (vLLM first copies a strided input whole, as Qwen3's q and k
    heads are, views into the qkv projection), and with `residual` given the bf16 add `x + residual` fused in
    front: then (norm(x + residual), x + residual), each as the add and the norm apart would give them.
    tests/test_gpu.py checks the bits against vLLM's own kernels."""
    D = x.shape[-1]
    like_x = residual is None or (residual.shape, residual.dtype) == (x.shape, x.dtype)
    if weight.shape != (D,) or not like_x:
        raise ValueError(f"rms_norm_rows: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)}, "
                         f"residual {None if residual is None else (tuple(residual.shape), residual.dtype)}")
    rows = head_rows(x)
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else out
    residual = residual.contiguous() if residual is not None else out  # unread without the add
    T, heads = rows.shape[0], rows.shape[1]
    # vLLM's block: 1,024 columns over 4 warps, 8 a thread. A row of D <= 256 (a q/k head) lies in the first
    # warp's lanes, and the other warps add zeros to its sum: one warp of 256 columns holds the same lanes
    # and sums them in the same order (the same bits), at a quarter of the threads of T x heads programs.
    block, warps = (256, 1) if D <= 256 else (1024, 4)
    if T * heads:
        _rms_norm_rows_kernel[(T * heads,)](rows, rows.stride(0), rows.stride(1), residual, summed, weight,
                                            out, heads, D, eps, BLOCK_SIZE=block,
                                            CHUNKS=triton.next_power_of_2(triton.cdiv(D, block)),
                                            ADD=summed is not out, num_warps=warps)
    return out if summed is out else (out, summed)


@triton.jit
def _qk_norm_rotary_kernel(qkv, qkv_row_stride, q_weight, k_weight, q_out, k_out, positions, cos_sin,
                           cos_sin_stride, n_heads, n_kv_heads, head_dim, eps, HEADS: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr):
    """HEADS q or k heads of one token, read in the qkv projection's output, each head a row within one warp:
    `_rms_norm_rows_kernel`'s norm (the same sum of one 256-wide block across a warp's 32 lanes: its bits),
    rounded to bf16, then vLLM's neox rotary (`rotary_embedding_kernel`: the pair of columns i and
    i + head_dim / 2 in fp32, rotated by the table's cos and sin at the token's position, rounded to bf16).
    The fp32 table holds bf16 values, so each product of two bf16 (or fp16) values is exact in fp32 unless it
    falls below fp32's normal range (some 2^-133); the rotation takes the FMAs vLLM's compiled op forms, so
    those round as its do too."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]  # k's heads follow q's in the row
    is_q, is_k = head < n_heads, (head >= n_heads) & (head < n_heads + n_kv_heads)
    x = qkv + token * qkv_row_stride + head * head_dim
    cols = tl.arange(0, BLOCK_SIZE)[None, :]
    vals = tl.load(x + cols, mask=(is_q | is_k) & (cols < head_dim), other=0.0).to(tl.float32)
    sum_sq = tl.sum(tl.where(cols < head_dim, vals * vals, 0.0), axis=1, keep_dims=True)
    inv_rms = 1.0 / tl.sqrt(sum_sq / head_dim + eps)
    half = head_dim // 2
    i = tl.arange(0, HALF)[None, :]
    m = (is_q | is_k) & (i < half)
    w_lo = tl.where(is_q, tl.load(q_weight + i, mask=i < half), tl.load(k_weight + i, mask=i < half))
    w_hi = tl.where(is_q, tl.load(q_weight + half + i, mask=i < half), tl.load(k_weight + half + i, mask=i < half))
    a = tl.load(x + i, mask=m, other=0.0).to(tl.float32) * inv_rms * w_lo.to(tl.float32)
    b = tl.load(x + half + i, mask=m, other=0.0).to(tl.float32) * inv_rms * w_hi.to(tl.float32)
    a, b = a.to(q_out.dtype.element_ty).to(tl.float32), b.to(q_out.dtype.element_ty).to(tl.float32)  # normed
    table = cos_sin + tl.load(positions + token) * cos_sin_stride
    cos, sin = tl.load(table + i, mask=i < half), tl.load(table + half + i, mask=i < half)
    # The FMAs vLLM's compiled op forms: where both products are exact (any bf16 value times a table value but
    # the tiniest) any form gives these bits; below ~2^-133 only vLLM's form does.
    lo = tl.fma(a, cos, -(b * sin)).to(q_out.dtype.element_ty)
    hi = tl.fma(sin, a, b * cos).to(q_out.dtype.element_ty)
    q = q_out + (token * n_heads + head) * head_dim
    k = k_out + (token * n_kv_heads + head - n_heads) * head_dim
    tl.store(q + i, lo, mask=m & is_q)
    tl.store(q + half + i, hi, mask=m & is_q)
    tl.store(k + i, lo, mask=m & is_k)
    tl.store(k + half + i, hi, mask=m & is_k)


def qk_norm_rotary(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                   eps: float, positions: torch.Tensor, cos_sin_cache: torch.Tensor, heads: int = 0,
                   warps: int = 0):
    """Qwen3's q and k heads (T, H, D) and (T, Hk, D), views into the qkv projection's output, each head
    RMS-normed and rotated (neox, the fp32 table of `rope_cos_sin_cache`'s values): the bits of
    `rms_norm_rows` on each, then vLLM's `rotary_embedding`, in one launch where vLLM takes three;
    a program `heads` heads of a token over `warps` <= `heads` warps (powers of two: each head's row within one
    warp, so no choice moves a bit). -> new (q, k). tests/test_gpu.py checks the bits."""
    (T, H, D), Hk = q.shape, k.shape[1]
    # Each head's 256-wide row lies in one warp, 8 columns a lane, only where Triton sees 16-byte alignment
    # (Qwen3's head_dim is 64, 128 or 256, the qkv row a fresh tensor): elsewhere it could spread a row.
    adjacent = (q.stride(-1) == k.stride(-1) == 1 and q.stride(1) == k.stride(1) == D and q.dtype == k.dtype
                and (T == 1 or q.stride(0) == k.stride(0)) and q.stride(0) % 16 == q.data_ptr() % 16 == 0
                and k.data_ptr() == q.data_ptr() + H * D * q.element_size())
    if not (T == 0 or adjacent) or not (D % 16 == 0 and D <= 256 and q.dtype in (torch.bfloat16, torch.float16)
                                        and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[1] == D):
        raise ValueError(f"qk_norm_rotary: q {tuple(q.shape)} and k {tuple(k.shape)} must be adjacent heads "
                         f"of one 16-byte aligned bf16 or fp16 qkv row (head_dim a multiple of 16, <= 256), the "
                         f"table fp32 of width head_dim")
    # Measured on an H200 over 28-36 layers: a decode step's rows run fastest as 8 heads over 8 warps, a
    # prefill's as 4 heads in one warp (2.3-5x the three launches' speed).
    heads, warps = (heads, warps) if heads else (8, 8) if T <= 512 else (4, 1)
    if not (0 < warps <= min(heads, 32) and heads & (heads - 1) == warps & (warps - 1) == 0):
        raise ValueError(f"qk_norm_rotary: {warps} warps over {heads} heads a program: powers of two, a head "
                         f"a row within one warp (no more warps than heads, 32 at most)")
    q_out, k_out = q.new_empty(T, H, D), k.new_empty(T, Hk, D)
    if T:
        _qk_norm_rotary_kernel[(T, triton.cdiv(H + Hk, heads))](
            q, q.stride(0), q_weight.contiguous(), k_weight.contiguous(), q_out, k_out, positions,
            cos_sin_cache, cos_sin_cache.stride(0), H, Hk, D, eps, HEADS=heads, BLOCK_SIZE=256,
            HALF=triton.next_power_of_2(D // 2), num_warps=warps)
    return q_out, k_out


class BatchInvariantRMSNorm(torch.autograd.Function):
    """`rms_norm_batch_invariant`: vLLM's Triton RMSNorm, one program per row (`rms_norm_rows`: its bits).
    With the fused add+norm replaced by this kernel with the add in front (`install_exact_kernels`), it is
    every norm of the model but q's and k's (`QKNormRotary`). With `residual`: (norm(x + residual),
    x + residual), the bf16 add fused in. Backward, with r = rsqrt(mean(x^2) + eps) and gw = dy * w:
    dx = r * (gw - x * r^2 * mean(gw * x)), dw = sum over rows of dy * x * r; on CUDA in one Triton pass
    (`rms_norm_backward`), on the CPU in plain PyTorch. With the add, the sum's own gradient (from the layers
    above) is added to dx as autograd's bf16 add would, and the total is the gradient of x and of residual.
    dw goes into the weight's fp32 sum if it has one (`into_gradient_sum`)."""

    @staticmethod
    def forward(ctx, x, weight, eps, residual=None):
        ctx.eps, ctx.add = eps, residual is not None
        ctx.weight = weight  # the parameter, for its `main_grad`
        ctx.set_materialize_grads(False)  # an unused output's gradient is None, not zeros to add
        if x.is_cuda:
            out = rms_norm_rows(x, weight, eps, residual)  # vLLM's add and norm, their bits
        else:
            out = rms_norm_reference(x, weight, eps, residual)
        ctx.save_for_backward(out[1] if ctx.add else x, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out, grad_summed=None):
        x, weight = ctx.saved_tensors
        if grad_out is None:  # only the sum is used (or nothing): its gradient goes on to x and residual
            return grad_summed, None, None, grad_summed
        grad_x, grad_w = rms_norm_grads(grad_out, x, weight, ctx.eps, grad_summed)
        grad_w = into_gradient_sum(ctx.weight, grad_w) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, grad_x if ctx.add else None


def rms_norm_grads(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                   grad_summed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of the RMSNorm of `x`: on CUDA `rms_norm_backward`, on the CPU the same formula in PyTorch."""
    if x.is_cuda:
        return rms_norm_backward(grad_out, x, weight, eps, grad_summed)
    acc = _acc(x.dtype)
    xf, g = x.to(acc), grad_out.to(acc)
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    gw = g * weight.to(acc)
    grad_x = (inv_rms * (gw - xf * inv_rms.pow(2) * (gw * xf).mean(-1, keepdim=True))).to(x.dtype)
    grad_w = (g * xf * inv_rms).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return (grad_x if grad_summed is None else grad_x + grad_summed), grad_w


# Triton compiles a variant the first time an integer argument is 1 or a multiple of 16; the row count and
# tiles a program vary with a micro-batch's tokens, so a new variant (0.3 s each) could compile in any step.
@triton.jit(do_not_specialize=["n_rows", "tiles_per_program"])
def _rms_norm_backward_kernel(grad_out, x, x_row_stride, x_head_stride, weight, grad_summed, grad_x,
                              partial_grad_w, positions, cos_sin, cos_sin_stride, heads, n_rows, n_cols, eps,
                              tiles_per_program, ROWS: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr,
                              ROTATED: tl.constexpr):
    """Tiles of ROWS whole rows (row = a (token, head) of a strided (T, heads, D) `x`), `tiles_per_program`
    consecutive ones a program: each row's dx in fp32, rounded once (with ADD, then added to `grad_summed`'s
    row in fp32 and rounded again: a bf16 add); the program's fp32 sum of dy * x * r over its rows, stored as
    its row of `partial_grad_w`. With ROTATED, `grad_out` is the gradient after a neox rotation by the
    angles of the row's token: dy is it rotated back, rounded as vLLM's rotary op with the sines negated
    rounds it (the pair i, i + D/2 in fp32: products of bf16 values exact, so one rounding, then to bf16)."""
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    w = tl.load(weight + cols, mask=col_mask, other=0.0).to(tl.float32)
    grad_w = tl.zeros([BLOCK], dtype=tl.float32)
    first = tl.program_id(0).to(tl.int64) * tiles_per_program * ROWS
    for tile in range(tiles_per_program):
        rows = first + tile * ROWS + tl.arange(0, ROWS)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        x_rows = (rows // heads) * x_row_stride + (rows % heads) * x_head_stride
        xf = tl.load(x + x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(grad_out + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if ROTATED:
            half = n_cols // 2
            low = cols < half
            pair, other_half = tl.where(low, cols, cols - half), tl.where(low, cols + half, cols - half)
            dy_pair = tl.load(grad_out + rows[:, None] * n_cols + other_half[None, :], mask=mask, other=0.0)
            token = tl.load(positions + rows // heads, mask=rows < n_rows, other=0)
            table = cos_sin + token[:, None] * cos_sin_stride + pair[None, :]
            cos, sin = tl.load(table, mask=mask, other=0.0), tl.load(table + half, mask=mask, other=0.0)
            dy_pair = dy_pair.to(tl.float32)
            # The FMAs vLLM's compiled op forms: where both products are exact (any bf16 value times a table
            # value but the tiniest) any form gives these bits; below ~2^-133 only vLLM's form does.
            dy = tl.where(low[None, :], tl.fma(dy, cos, dy_pair * sin), tl.fma(-sin, dy_pair, dy * cos))
            dy = dy.to(grad_x.dtype.element_ty).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)
        gw = dy * w[None, :]
        mean_gw_x = tl.sum(gw * xf, axis=1) / n_cols
        dx = (r[:, None] * (gw - xf * (r * r * mean_gw_x)[:, None])).to(grad_x.dtype.element_ty)
        if ADD:
            other = tl.load(grad_summed + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
            dx = (dx.to(tl.float32) + other.to(tl.float32)).to(grad_x.dtype.element_ty)
        tl.store(grad_x + rows[:, None] * n_cols + cols[None, :], dx, mask=mask)
        grad_w += tl.sum(dy * xf * r[:, None], axis=0)
    tl.store(partial_grad_w + tl.program_id(0).to(tl.int64) * n_cols + cols, grad_w, mask=col_mask)


def rms_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                      grad_summed: torch.Tensor | None = None, rotated: tuple | None = None):
    """(dx, dw) of the RMSNorm of `x` (..., D) (q/k heads: a strided (T, heads, D) view, read in place) in
    one pass over x and dy: r recomputed in fp32, dx rounded once; with `grad_summed` (x's gradient from its
    other uses, when x is a residual sum), dx + grad_summed, the bf16 add autograd would make; with `rotated`
    (positions, the fp32 neox table), `grad_out` is the gradient of the norm's output rotated by those
    angles (q's and k's), rotated back in the same pass. Each program sums dw over a fixed run of rows; the
    runs' sums are then added by `torch.sum` (a fixed order): the same bits on every call of a shape. It replaced PyTorch's fused RMSNorm backward (its norm forward again for
    r, then two kernels)."""
    if not eps > 0:  # a tile's rows past the last have x = 0: r would be inf there, and dw NaN
        raise ValueError(f"rms_norm_backward: eps must be > 0, not {eps}")
    D, rows_view = x.shape[-1], head_rows(x)
    if grad_summed is not None and (grad_summed.shape, grad_summed.dtype) != (x.shape, x.dtype):
        raise ValueError(f"rms_norm_backward: grad_summed {tuple(grad_summed.shape)} {grad_summed.dtype}, "
                         f"x {tuple(x.shape)} {x.dtype}")
    grad_out, add = grad_out.contiguous(), grad_summed is not None
    grad_summed = grad_summed.contiguous() if add else grad_out  # unread without the add
    n_rows, heads = rows_view.shape[0] * rows_view.shape[1], rows_view.shape[1]
    block = triton.next_power_of_2(D)
    tile = max(1, 4096 // block)  # rows a tile: ~4k elements, whole rows
    tiles = triton.cdiv(n_rows, tile)
    tiles_per_program = max(1, triton.cdiv(tiles, 1024))  # at most 1,024 programs: few partial sums
    programs = triton.cdiv(tiles, tiles_per_program)
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    partial = torch.empty(programs, D, dtype=torch.float32, device=x.device)
    positions, table = rotated or (grad_out, grad_out)  # unread unless rotated
    if n_rows:
        _rms_norm_backward_kernel[(programs,)](grad_out, rows_view, rows_view.stride(0), rows_view.stride(1),
                                               weight.contiguous(), grad_summed, grad_x, partial, positions,
                                               table, table.stride(0), heads, n_rows, D, eps, tiles_per_program,
                                               ROWS=tile, BLOCK=block, ADD=add, ROTATED=rotated is not None,
                                               num_warps=8 if block >= 2048 else 4)
    return grad_x, partial.sum(0).to(weight.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over [gate; up]: vLLM's kernel (`torch.ops._C.silu_and_mul`) on CUDA."""
    if not gate_up.is_cuda:
        return silu_and_mul_reference(gate_up)
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    out = gate_up.new_empty(gate_up.shape[:-1] + (gate_up.shape[-1] // 2,))
    torch.ops._C.silu_and_mul(out, gate_up)
    return out


def silu_and_mul_backward(grad_out: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """d up = dy * silu(gate), d gate = silu'(gate) * dy * up: on CUDA in one Triton pass (`swiglu_backward`),
    elsewhere with PyTorch's `silu_backward` in the input dtype."""
    if gate_up.is_cuda:
        return swiglu_backward(grad_out, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    grad = torch.empty_like(gate_up)
    grad_gate, grad_up = grad.chunk(2, dim=-1)
    torch.mul(grad_out, F.silu(gate), out=grad_up)
    grad_gate.copy_(torch.ops.aten.silu_backward(grad_out * up, gate))
    return grad


class SiluAndMul(torch.autograd.Function):
    """`silu_and_mul`: vLLM's SwiGLU kernel. Backward: `silu_and_mul_backward`."""

    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return silu_and_mul(gate_up)

    @staticmethod
    def backward(ctx, grad_out):
        (gate_up,) = ctx.saved_tensors
        return silu_and_mul_backward(grad_out, gate_up)


@triton.jit
def _swiglu_backward_kernel(grad_out, gate_up, grad, I, BLOCK: tl.constexpr):
    # One row's block of BLOCK columns: reads dy, gate and up once, writes d gate and d up once.
    row, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    dy = tl.load(grad_out + row * I + cols, mask=mask).to(tl.float32)
    gate = tl.load(gate_up + row * 2 * I + cols, mask=mask).to(tl.float32)
    up = tl.load(gate_up + row * 2 * I + I + cols, mask=mask).to(tl.float32)
    s = tl.sigmoid(gate)
    d_gate = dy * up * s * (1 + gate * (1 - s))  # silu'(g) = s (1 + g (1 - s))
    tl.store(grad + row * 2 * I + cols, d_gate.to(grad.dtype.element_ty), mask=mask)
    tl.store(grad + row * 2 * I + I + cols, (dy * gate * s).to(grad.dtype.element_ty), mask=mask)


def swiglu_backward(grad_out: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """SiluAndMul's backward on CUDA in one pass: fp32 math, one rounding of each gradient. The same math in
    PyTorch ops takes five passes over (T, I) activations, the widest of the layer."""
    I = grad_out.shape[-1]
    grad_out, gate_up = grad_out.contiguous(), gate_up.contiguous()
    grad = torch.empty_like(gate_up)
    rows = gate_up.numel() // (2 * I)
    _swiglu_backward_kernel[(rows, triton.cdiv(I, 1024))](grad_out, gate_up, grad, I, BLOCK=1024)
    return grad


class Route(torch.autograd.Function):
    """A mixture-of-experts router's choice: vLLM's `fused_topk` (its `topk_softmax` kernel) on CUDA, the
    same math as `route_reference`. (T, E) bf16 logits -> (T, k) fp32 weights, (T, k) int32 expert ids.
    Backward: renormalised, the weights are a softmax over the chosen experts' logits, so a chosen logit's
    gradient is w_j (dw_j - sum_k w_k dw_k) and the others' 0; not renormalised, they are the softmax p over
    all experts at the chosen ones, and the logits' gradient is p (g - sum p g), g the weights' gradient at
    the chosen experts and 0 elsewhere."""

    @staticmethod
    def forward(ctx, logits, top_k: int, renormalize: bool):
        if logits.is_cuda:
            from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk

            weights, ids, _ = fused_topk(logits, logits, top_k, renormalize)  # (hidden states: for T only)
        else:
            weights, ids = route_reference(logits, top_k, renormalize)
        # Renormalised, the weights are all the backward needs; else it needs the softmax over all experts.
        ctx.save_for_backward(weights, ids, *(() if renormalize else (logits,)))
        ctx.renormalize, ctx.logits_shape, ctx.logits_dtype = renormalize, logits.shape, logits.dtype
        ctx.mark_non_differentiable(ids)
        return weights, ids

    @staticmethod
    def backward(ctx, grad_weights, _):
        weights, ids, *logits = ctx.saved_tensors
        ids, g = ids.long(), grad_weights.to(weights.dtype)
        grad = weights.new_zeros(ctx.logits_shape)
        if ctx.renormalize:
            grad.scatter_(-1, ids, weights * (g - (weights * g).sum(-1, keepdim=True)))
        else:
            p, g = torch.softmax(logits[0].to(weights.dtype), dim=-1), grad.scatter_(-1, ids, g)
            grad = p * (g - (p * g).sum(-1, keepdim=True))
        return grad.to(ctx.logits_dtype), None, None


def grouped_matmul(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """A matmul a group at a time, group e ending at `ends[e]` (int32, cumulative): a (N, K) by b (E, K, M)
    -> (N, M), group e's rows times b[e]; or a (K, N) by b (N, M), both cut along N -> (E, K, M), the
    weight gradients' form. On CUDA one launch of PyTorch's grouped GEMM (`F.grouped_mm`: fp32 sums, no
    split over K, so the same bits every run); elsewhere a matmul a group."""
    if a.is_cuda:
        return F.grouped_mm(a, b, offs=ends)
    bounds = list(zip([0, *ends.tolist()], ends.tolist()))
    if b.dim() == 3:
        return torch.cat([a[start:end] @ b[e] for e, (start, end) in enumerate(bounds)])
    return torch.stack([a[:, start:end] @ b[start:end] for start, end in bounds])


class Experts(torch.autograd.Function):
    """A token's k experts, weighted and summed: vLLM's `fused_experts` on CUDA (Triton GEMMs over the (token,
    k) pairs sorted by expert, in its one batch-invariant tile configuration; `silu_and_mul` between; the
    routing weight multiplied into the second GEMM's fp32 sums before their rounding; the sum over k,
    `moe_sum`), the same math as `experts_reference` elsewhere. x (T, H), w13 (E, 2I, H) = [gate; up],
    w2 (E, H, I), the router's weights and ids (T, k) -> (T, H).
    Backward, over the pairs in expert order (a stable sort: the same order every run), in `grouped_matmul`s:
    the first GEMM and the SwiGLU recomputed (the forward keeps nothing of the pairs' size); dY W2 per pair
    (before its routing weight w); w's gradient dY . (A W2^T) = (dY W2) . A, in fp32; dW2 = dY^T (w A); the
    SwiGLU's backward of w dY W2 gives dG; dW13 = dG^T X and each pair's dX = dG W13, summed over the token's
    k pairs in fp32. Each temporary is freed after its last use (`experts_backward_bytes` counts the peak).
    The weights' gradients are bf16, folded into their fp32 sums by `MasterWeights` (a linear's product is
    added to its sum in the matmul instead: `weight_grad`)."""

    @staticmethod
    def forward(ctx, x, w13, w2, weights, ids):
        ctx.save_for_backward(x, w13, w2, weights, ids)
        if x.is_cuda:
            from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

            return fused_experts(x.contiguous(), w13, w2, weights, ids)
        return experts_reference(x, w13, w2, weights, ids)

    @staticmethod
    def backward(ctx, grad_out):
        x, w13, w2, weights, ids = ctx.saved_tensors
        (T, k), acc = ids.shape, _acc(x.dtype)
        expert, order = torch.sort(ids.reshape(-1), stable=True)  # pair t * k + j, grouped by expert
        experts = torch.arange(w13.shape[0], device=ids.device, dtype=ids.dtype)
        ends = torch.searchsorted(expert, experts, right=True).to(torch.int32)  # no wait for the host
        xs, dy = x[order // k], grad_out.contiguous()[order // k]  # (N, H) each, N = T k
        gate_up = grouped_matmul(xs, w13.transpose(1, 2), ends)  # (N, 2I)
        act, d_act = silu_and_mul(gate_up), grouped_matmul(dy, w2, ends)  # (N, I) each; d_act = dY W2
        w = weights.reshape(-1)[order, None].to(acc)
        grad_weights = torch.empty_like(weights).view(-1).index_copy_(
            0, order, (d_act.to(acc) * act).sum(-1).to(weights.dtype)).view(T, k)
        grad_w2 = grouped_matmul(dy.t(), (act * w).to(x.dtype), ends)  # (E, H, I)
        del dy, act
        d_gate_up = silu_and_mul_backward((d_act * w).to(x.dtype), gate_up)  # (N, 2I)
        del d_act, gate_up
        grad_w13 = grouped_matmul(d_gate_up.t(), xs, ends)  # (E, 2I, H)
        del xs
        grad_pairs = grouped_matmul(d_gate_up, w13, ends)  # (N, H), in expert order
        del d_gate_up
        grad_x = torch.empty_like(grad_pairs).index_copy_(0, order, grad_pairs).view(T, k, -1)
        return grad_x.sum(1, dtype=acc).to(x.dtype), grad_w13, grad_w2, grad_weights, None


class QKNormRotary(torch.autograd.Function):
    """Qwen3's q (T, H, D) and k (T, Hk, D) heads, adjacent views into the qkv projection's output, each
    RMS-normed and then rotated (neox): on CUDA `qk_norm_rotary`, the engine's one kernel, with the bits of the
    three vLLM launches it replaces (q's norm, k's norm, `torch.ops._C.rotary_embedding`); on the CPU the
    references. Backward: the inverse rotation (a rotation is orthogonal: angle -> -angle), then each norm's;
    on CUDA both in one pass a norm (`rms_norm_backward`, with the bits of vLLM's rotary op with the sines
    negated, then the norm's backward)."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, eps, positions, cos_sin_cache):
        ctx.eps, ctx.weights = eps, (q_weight, k_weight)  # the parameters, for their `main_grad`
        ctx.save_for_backward(q, k, q_weight, k_weight, positions, cos_sin_cache)
        if q.is_cuda:
            return qk_norm_rotary(q, k, q_weight, k_weight, eps, positions, cos_sin_cache)
        return qk_norm_rotary_reference(q, k, q_weight, k_weight, eps, positions, cos_sin_cache)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        q, k, q_weight, k_weight, positions, cos_sin_cache = ctx.saved_tensors
        pairs = ((grad_q, q, q_weight), (grad_k, k, k_weight))
        if grad_q.is_cuda:  # each norm's backward pass reads its gradient rotated back
            (grad_q, grad_wq), (grad_k, grad_wk) = (
                rms_norm_backward(grad, x, w, ctx.eps, rotated=(positions, cos_sin_cache)) for grad, x, w in pairs)
        else:
            cos, sin = _cos_sin(positions, cos_sin_cache, grad_q.dtype)
            (grad_q, grad_wq), (grad_k, grad_wk) = (rms_norm_grads(_rotate(grad, cos, -sin), x, w, ctx.eps)
                                                    for grad, x, w in pairs)
        grad_wq = into_gradient_sum(ctx.weights[0], grad_wq) if ctx.needs_input_grad[2] else None
        grad_wk = into_gradient_sum(ctx.weights[1], grad_wk) if ctx.needs_input_grad[3] else None
        return grad_q, grad_k, grad_wq, grad_wk, None, None, None


@contextmanager
def _deterministic_algorithms():
    """PyTorch's flash-attention backward accumulates dQ with atomics unless deterministic
    algorithms are strictly on; switch them on for that one call and restore the caller's mode."""
    previous = (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


class FlashAttention(torch.autograd.Function):
    """`vllm.vllm_flash_attn.flash_attn_varlen_func` with FlashAttention 3, causal, `num_splits=1`
    (vLLM's batch-invariant setting), GQA without repeating k/v, over `AttentionSpans` (k and v gathered to
    the spans' key rows where spans share rows). Backward: PyTorch's fused flash-attention backward from the
    forward's output and log-sum-exp (memory O(T), no T x T), in its deterministic mode so that two runs
    give the same gradients bit for bit; a shared row's key and value gradients summed in fp32."""

    @staticmethod
    def forward(ctx, q, k, v, spans: AttentionSpans, scale):
        if q.is_cuda:
            from vllm.vllm_flash_attn import flash_attn_varlen_func

            keys, values = _gathered(k, spans), _gathered(v, spans)
            out, lse = flash_attn_varlen_func(
                q, keys, values,
                max_seqlen_q=spans.max_seqlen, cu_seqlens_q=spans.cu_seqlens,
                max_seqlen_k=spans.max_seqlen_k, cu_seqlens_k=spans.cu_seqlens_k,
                softmax_scale=scale, causal=True, return_softmax_lse=True,
                num_splits=1, fa_version=3,
            )  # fmt: skip
        else:
            out, lse = attention_reference(q, k, v, spans, scale)
        ctx.save_for_backward(q, k, v, out, lse)  # k and v gathered again in the backward: no copy kept
        ctx.spans, ctx.scale = spans, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        spans = ctx.spans
        if not q.is_cuda:
            return *_attention_backward_reference(grad_out, q, k, v, out, lse, spans, ctx.scale), None, None
        no_dropout_rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
        with _deterministic_algorithms():
            grad_q, grad_k, grad_v = torch.ops.aten._flash_attention_backward(
                grad_out.contiguous(), q, _gathered(k, spans), _gathered(v, spans), out, lse,
                spans.cu_seqlens, spans.cu_seqlens_k, spans.max_seqlen, spans.max_seqlen_k,
                0.0, True, no_dropout_rng, torch.empty(0, device=q.device), scale=ctx.scale,
            )  # fmt: skip
            if spans.kv_rows is not None:  # each read of a row adds its gradient, in deterministic mode
                grad_k, grad_v = (torch.zeros_like(t, dtype=torch.float32).index_add_(0, spans.kv_rows, grad)
                                  .to(t.dtype) for t, grad in ((k, grad_k.float()), (v, grad_v.float())))
        return grad_q, grad_k, grad_v, None, None


def _gathered(x: torch.Tensor, spans: AttentionSpans) -> torch.Tensor:
    return x if spans.kv_rows is None else x.index_select(0, spans.kv_rows)


def _attention_backward_reference(grad_out, q, k, v, out, lse, spans: AttentionSpans, scale):
    """The flash-attention backward, one span at a time: P = exp(scale q k^T - lse),
    dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = scale dS K, dK = scale dS^T Q."""
    acc = _acc(q.dtype)
    group = q.shape[1] // k.shape[1]
    grads = [torch.zeros_like(t, dtype=acc) for t in (q, k, v)]
    for rows, keys in _spans(spans, q.device):
        qs, dO, O = q[rows].to(acc), grad_out[rows].to(acc), out[rows].to(acc)
        ks = k[keys].to(acc).repeat_interleave(group, dim=1)
        vs = v[keys].to(acc).repeat_interleave(group, dim=1)
        causal = _causal_mask(len(qs), len(ks), q.device)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        probs = torch.exp(scores - lse[:, rows, None].to(acc)).masked_fill(~causal, 0.0)
        dv = torch.einsum("hqk,qhd->khd", probs, dO)
        dp = torch.einsum("qhd,khd->hqk", dO, vs)
        ds = probs * (dp - (dO * O).sum(-1).t()[..., None])
        dq = torch.einsum("hqk,khd->qhd", ds, ks) * scale
        dk = torch.einsum("hqk,qhd->khd", ds, qs) * scale
        # GQA: a key/value head's gradient sums over the query heads of its group; a shared row's over spans.
        grads[0][rows] = dq
        grads[1].index_add_(0, keys, dk.unflatten(1, (-1, group)).sum(2))
        grads[2].index_add_(0, keys, dv.unflatten(1, (-1, group)).sum(2))
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


@triton.jit
def _logprob_grad_kernel(logits, targets, grad_logprobs, grad, V, temperature, BLOCK: tl.constexpr):
    # One row: a pass for max z, one for the sum of exp(z / T - max z / T), one that writes the gradient.
    row = tl.program_id(0).to(tl.int64)
    peak = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(logits + row * V + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        peak = tl.maximum(peak, z)
    top = tl.max(peak, axis=0) / temperature
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(logits + row * V + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        total += tl.exp(z / temperature - top)
    total = tl.sum(total, axis=0)
    g, target = tl.load(grad_logprobs + row), tl.load(targets + row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(logits + row * V + cols, mask=cols < V, other=0.0).to(tl.float32)
        p = tl.exp(z / temperature - top) / total
        d = g * (tl.where(cols == target, 1.0, 0.0) - p) / temperature
        tl.store(grad + row * V + cols, d.to(grad.dtype.element_ty), mask=cols < V)


def logprob_grad(logits: torch.Tensor, targets: torch.Tensor, grad_logprobs: torch.Tensor,
                 temperature: float) -> torch.Tensor:
    """d(sum g * log softmax(z / T)[t]) / dz = g (onehot(t) - softmax(z / T)) / T for bf16 logits z (rows, V),
    in a Triton kernel of ours: fp32 math, three reads of z and one write of the bf16 gradient per row, where
    PyTorch ops make and pass over fp32 (rows, V) temporaries."""
    logits = logits.contiguous()
    grad = torch.empty_like(logits)
    targets, grad_logprobs = targets.contiguous(), grad_logprobs.contiguous()
    _logprob_grad_kernel[(len(logits),)](logits, targets, grad_logprobs, grad, logits.shape[1], temperature,
                                         BLOCK=2048)
    return grad


class LMHeadLogprobs(torch.autograd.Function):
    """lm_head and the sampler's logprobs, fused. `tiled_linear` gives the bf16 logits z of all rows
    (vLLM's lm_head). Then, a chunk of rows at a time, `sampled_distribution` makes them what vLLM's sampler
    samples from (divided by the temperature, top-k/top-p masked), and vLLM's batch-invariant log-softmax (its
    bits; on CUDA `split_token_logprobs_and_entropy`, which writes no (rows, V) logprobs) gives each target's
    logprob under that distribution (vLLM's processed logprobs), and the entropy.
    The kernels compute a row the same way whatever the other rows, so chunking changes no bit. Only the
    bf16 (C, V) logits are kept for the backward: the fp32 (rows, V) temporaries exist for one chunk at
    a time, never for the whole micro-batch.
    Backward, per chunk: with p the sampled distribution recomputed from the kept logits (0 outside the
    kept set, whose tokens so get no gradient), dz = (g_lp * (onehot(t) - p) - g_H * p * (log p + H)) / T,
    rounded to bf16; then dh = dz @ W and dW = dz^T @ h, one cuBLAS matmul each over all rows (fp32
    accumulation; dW `weight_grad`'s). The entropy term is skipped when nothing depends on the entropy; then,
    with nothing truncated (RL's usual case), `logprob_grad` computes dz of all rows in one kernel on CUDA."""

    ROWS_PER_CHUNK_TIMES_VOCAB = 2**27  # 0.5 GiB per fp32 temporary

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, top_k: int = 0, top_p: float = 1.0):
        rows = max(1, LMHeadLogprobs.ROWS_PER_CHUNK_TIMES_VOCAB // weight.shape[0])
        # Dividing by a Python float would multiply by its reciprocal: other bits than vLLM's division.
        temp = temperature_tensor(temperature, _acc(hidden.dtype), hidden.device)
        logits = _linear_forward(hidden, weight)  # (C, V)
        chunks = [sampled_distribution(z, t, temp, top_k, top_p)
                  for z, t in zip(logits.split(rows), targets.split(rows))]
        logprobs, entropy, kept, cut = (torch.cat(parts) for parts in zip(*chunks))
        ctx.save_for_backward(hidden, weight, targets, entropy, logits)
        ctx.temperature, ctx.rows, ctx.top_k, ctx.top_p = temperature, rows, top_k, top_p
        ctx.weight = weight  # the parameter, for `weight_grad`
        ctx.mark_non_differentiable(kept, cut)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        return logprobs, entropy, kept, cut

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_):
        hidden, weight, targets, entropy, logits = ctx.saved_tensors
        n = hidden.shape[0]
        g_lp = grad_logprobs if grad_logprobs is not None else hidden.new_zeros(n, dtype=entropy.dtype)
        if logits.is_cuda and grad_entropy is None and not (ctx.top_k or ctx.top_p < 1):
            grad_logits = logprob_grad(logits, targets, g_lp, ctx.temperature)  # RL's usual case: one kernel
        else:
            temp = temperature_tensor(ctx.temperature, entropy.dtype, logits.device)
            grad_logits = torch.empty_like(logits)
            for i in range(0, n, ctx.rows):
                rows = slice(i, i + ctx.rows)
                x = truncated(tempered_logits(logits[rows], temp), ctx.top_k, ctx.top_p)
                if grad_entropy is None:
                    grad = torch.softmax(x, dim=-1).mul_(-g_lp[rows, None])  # -p * g_lp
                else:
                    lp = torch.log_softmax(x, dim=-1)
                    p = lp.exp()
                    lp.masked_fill_(p == 0, 0)  # -inf outside the kept set, where p is 0
                    grad = ((lp + entropy[rows, None]).mul_(grad_entropy[rows, None]).add_(g_lp[rows, None])
                            .mul_(-p))
                grad = grad.scatter_add_(-1, targets[rows, None], g_lp[rows, None])
                grad_logits[rows] = grad if temp is None else grad.div_(temp)
        grad_weight = weight_grad(ctx.weight, grad_logits, hidden) if ctx.needs_input_grad[1] else None
        return grad_logits @ weight, grad_weight, None, None, None, None


# ---------------------------------------------------------------------------------------------
# What the kernels keep for the backward: the bytes of a micro-batch (simple_rl.py's memory plan)
# ---------------------------------------------------------------------------------------------


def block_bytes_per_token(a) -> int:
    """What a transformer block's autograd Functions keep for the backward, per token: both norms' inputs and
    outputs (4 dim), q/k/v, rotated q/k and attention's output (3 (q + kv)), all bf16; attention's
    log-sum-exp, fp32 a head; and SwiGLU's input and output (3 hidden_dim, bf16), or a mixture of experts'
    k routing weights and ids (fp32 and int32), and its router logits if not renormalised (bf16 an expert)."""
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    m = a.moe_args
    ffn = 8 * m.top_k + (0 if m.route_norm else 2 * m.num_experts) if a.moe_enabled else 6 * a.hidden_dim
    return 2 * (4 * a.dim + 3 * (q + kv)) + ffn + 4 * a.n_heads


def experts_backward_bytes(a, tokens: int) -> int:
    """The peak of `Experts.backward` beyond its inputs, per (token, k) pair, where the routing weights'
    gradient is made: the pair's input and its output's gradient (H each, bf16), its first GEMM's output
    (2 I), SwiGLU's output and dY W2 (I each, bf16), dY W2 in fp32 and its fp32 product with SwiGLU's
    output (2 I each, in bf16's size); and the experts' bf16 weight gradients."""
    m = a.moe_args
    weights = 3 * m.num_experts * a.moe_inter_dim * a.dim
    return 2 * tokens * m.top_k * (2 * a.dim + 8 * a.moe_inter_dim) + 2 * weights


def kept_bytes(model_args, tokens: int, completion_tokens: int) -> int:
    """What the trainer keeps for the backward of a micro-batch without checkpointing: the blocks'; per token
    the ids and positions (int64) and the final norm's input; per completion token lm_head's row, its bf16
    logits, the entropy, the target and the row's index."""
    a = model_args
    return (tokens * (a.n_layers * block_bytes_per_token(a) + 16 + 2 * a.dim)
            + completion_tokens * (2 * a.dim + 2 * a.vocab_size + 4 + 8 + 8))


def attention_backward_bytes(a, tokens: int) -> int:
    """What attention's backward adds for a micro-batch's keys beyond its rows (KEYS_PER_ROW of them a row):
    k and v gathered (bf16), PyTorch's dK and dV over every query head (bf16) and in fp32 to be summed, and
    the rows' fp32 sums."""
    keys, kv = (KEYS_PER_ROW - 1) * tokens, a.n_kv_heads * a.head_dim
    return keys * (2 * 2 * kv + 2 * 2 * a.n_heads * a.head_dim + 2 * 4 * kv) + tokens * 2 * 4 * kv


def micro_batch_bytes(model_args, tokens: int, checkpointing: bool, gradients: float) -> float:
    """Peak memory of a micro-batch's forward and backward besides the weights, every token a completion token
    (the most lm_head sees): what is kept, and the larger of the backward's two peaks: at lm_head (the logits'
    and rows' gradients, the weight's) or in the blocks (every bf16 gradient, `gradients` bytes, and a block's
    gradients, with checkpointing also its recomputed activations)."""
    a, block = model_args, block_bytes_per_token(model_args)
    blocks = tokens * ((a.n_layers * 4 * a.dim if checkpointing else a.n_layers * block) + 16 + 2 * a.dim)
    head = kept_bytes(a, tokens, tokens) - tokens * (a.n_layers * block + 16 + 2 * a.dim)
    sampler = 3 * 4 * LMHeadLogprobs.ROWS_PER_CHUNK_TIMES_VOCAB  # a chunk's fp32 temporaries, in the forward
    at_head = tokens * (2 * a.vocab_size + 2 * a.dim) + 2 * a.vocab_size * a.dim
    in_blocks = (gradients + tokens * block * (2 if checkpointing else 1) - head
                 + attention_backward_bytes(a, tokens))
    if a.moe_enabled:
        in_blocks += experts_backward_bytes(a, tokens)
    return blocks + head + max(sampler, at_head, in_blocks)


# ---------------------------------------------------------------------------------------------
# Kernel sets a model is built with
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernels:
    embedding: Callable
    linear: Callable
    rms_norm: Callable
    silu_and_mul: Callable
    qk_norm_rotary: Callable  # q's and k's heads normed, then rotated
    attention: Callable
    lm_head_logprobs: Callable
    route: Callable  # a mixture-of-experts router's top-k
    experts: Callable  # the chosen experts, weighted and summed


# vLLM's kernels forward on CUDA (bitwise vLLM), references on the CPU; hand-written backwards.
EXACT = Kernels(
    embedding=Embedding.apply,
    linear=BatchInvariantLinear.apply,
    rms_norm=BatchInvariantRMSNorm.apply,
    silu_and_mul=SiluAndMul.apply,
    qk_norm_rotary=QKNormRotary.apply,
    attention=FlashAttention.apply,
    lm_head_logprobs=LMHeadLogprobs.apply,
    route=Route.apply,
    experts=Experts.apply,
)

# Plain PyTorch under ordinary autograd: the ground truth the tests compare EXACT against.
REFERENCE = Kernels(
    embedding=F.embedding,
    linear=linear_reference,
    rms_norm=rms_norm_reference,
    silu_and_mul=silu_and_mul_reference,
    qk_norm_rotary=qk_norm_rotary_reference,
    attention=lambda q, k, v, spans, scale: attention_reference(q, k, v, spans, scale)[0],
    lm_head_logprobs=lm_head_logprobs_reference,
    route=route_reference,
    experts=experts_reference,
)


# ---------------------------------------------------------------------------------------------
# vLLM's side: the kernels installed in the engine; the divergence locator
# ---------------------------------------------------------------------------------------------

# CUDA graphs without torch.compile replay eager mode's kernels (the bits the trainer reproduces) without the
# launch overhead; compiling would fuse norms, SiLU and rotary into Inductor kernels with other bits.
CUDA_GRAPHS = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}  # mode 0: CompilationMode.NONE


def exact_qwen3_attention(self, positions, hidden_states, *, vllm_forward: Callable):
    """vLLM 0.20's `Qwen3Attention.forward` (Qwen3-MoE's is the same), with q and k's norms and their
    rotation in one kernel (`qk_norm_rotary`: the bits of the three vLLM launches). A rotary other than
    vLLM's neox kernel over whole heads (another class's forward, a partial rotation) keeps vLLM's forward."""
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    rope = self.rotary_emb
    if (getattr(getattr(rope, "_forward_method", None), "__func__", None) is not RotaryEmbedding.forward_cuda
            or not rope.is_neox_style or rope.rotary_dim != self.head_dim or rope.use_flashinfer):
        return vllm_forward(self, positions, hidden_states)
    qkv, _ = self.qkv_proj(hidden_states)
    q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
    T, H, Hk, D = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
    q, k = qk_norm_rotary(q.view(T, H, D), k.view(T, Hk, D), self.q_norm.weight, self.k_norm.weight,
                          self.q_norm.variance_epsilon,  # vLLM builds both norms with the config's one eps
                          positions, rope._match_cos_sin_cache_dtype(q))
    output, _ = self.o_proj(self.attn(q.view(T, H * D), k.view(T, Hk * D), v))
    return output


def exact_sample(self, logits, expanded_idx_mapping, idx_mapping_np, pos, input_ids, expanded_local_pos, *,
                 vllm_sample: Callable):
    """vLLM 0.20's V2 `Sampler.sample` (logits (rows, V) -> the tokens drawn, the processed logits): its own
    Gumbel-max draw, keyed by each request's seed and position, from the logits processed by the ops the
    trainer mirrors (`divide_by_temperature`, `top_k_top_p`). While `SAMPLED` records, each drawn token's
    processed logprob (`token_logprobs`: the log-softmax's bits at that token, the trainer's) is kept in its
    request's row (`exact_add_request`), at its draw count (the tokens it drew before: position + 1 - prompt).
    vLLM discards the draw of a prefill chunk before its last (a prompt's, or a recompute's after
    preemption), and `SAMPLED` does not keep it."""
    sampled, processed = vllm_sample(self, logits, expanded_idx_mapping, idx_mapping_np, pos, input_ids,
                                     expanded_local_pos)
    if SAMPLED.tokens is not None:
        at, requests = expanded_idx_mapping, self.penalties_state.req_states  # a row's request state slot
        draws = pos - requests.prompt_len.gpu[at] + 1
        kept = pos >= requests.prefill_len.gpu[at] - 1  # else a prefill chunk before its last
        SAMPLED.record(self.recorded_rows[at], torch.where(kept, draws, -1), sampled,
                       token_logprobs(processed, sampled))
    return sampled, processed


def exact_add_request(self, req_idx: int, prompt_len: int, sampling_params, *, vllm_add_request: Callable):
    """vLLM 0.20's V2 `Sampler.add_request`, which also notes in the request's state slot the row `SAMPLED`
    keeps its draws in: `SamplingParams.extra_args["recorded_row"]` (-1 without: a row not recorded). A row
    names a request, whatever its seed: requests may share one, or have none, as vLLM allows."""
    vllm_add_request(self, req_idx, prompt_len, sampling_params)
    if not hasattr(self, "recorded_rows"):
        self.recorded_rows = torch.full_like(self.sampling_states.seeds.gpu, -1)
    self.recorded_rows[req_idx] = (sampling_params.extra_args or {}).get("recorded_row", -1)


def exact_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """vLLM 0.20's V2 `compute_token_logprobs` ((rows, V) logits, (rows, n) token ids -> their fp32
    logprobs), through which its sampled, greedy and prompt logprobs all pass, with the trainer's bits
    (`token_logprobs`; for more than one token a row, top-k logprobs, `log_softmax`, which writes the fp32
    (rows, V) logprobs where vLLM's kernel writes the n). vLLM's own Triton kernel sums a row's exponentials
    in another order, compiled apart for bf16 (prompt) and fp32 (sampler) logits: a prompt token's logprob
    was one ulp off the trainer's for 3% of tokens, a greedy one's off its prompt logprob's for a fifth."""
    x = logits.float()
    if token_ids.shape[1] == 1:
        return token_logprobs(x, token_ids[:, 0].long())[:, None]
    return log_softmax(x).gather(1, token_ids.long())


def divide_by_temperature(self, logits, expanded_idx_mapping, idx_mapping_np) -> None:
    """vLLM 0.20's V1 temperature, in place of its V2 runner's Triton kernel: the fp32 logits divided by a
    per-row fp32 tensor (greedy rows by 1), as `torch.div` rounds and the trainer divides."""
    temperature = self.temperature.np[idx_mapping_np]
    if ((temperature == 0.0) | (temperature == 1.0)).all():  # nothing to divide, as vLLM's V2 skips
        return
    t = self.temperature.gpu[expanded_idx_mapping]
    logits.div_(torch.where(t < 1e-5, 1.0, t).unsqueeze(1))


class SampledLogprobs:
    """The processed logprob of each token the exact sampler (`exact_sample`) draws, kept on the GPU (a row
    per request, a column per draw) inside `recording(requests, ...)`; a request's row is given by its
    `SamplingParams(extra_args={"recorded_row": row})`. vLLM's own way to the same values
    (`SamplingParams(logprobs=0)`) makes Python objects of each, request by request at every step, in the host
    work that bounds a decode step: on an H100, 256 sequences of 512 tokens took 6.8-8.5 s with it and
    5.7-6.5 s without."""

    def __init__(self):
        self.tokens = self.logprobs = None  # set while recording

    @contextmanager
    def recording(self, requests: int, draws: int, device):
        # A row more, for a draw of a request that names no row (not one of `VLLMEngine.generate`'s): `read`
        # refuses. A column more, for what no completion keeps: a prompt chunk's draw, which vLLM discards,
        # and one past the last (async scheduling may draw once past a stop token).
        self.tokens = torch.full((requests + 1, draws + 1), -1, dtype=torch.int64, device=device)
        self.logprobs = torch.full((requests + 1, draws + 1), float("nan"), device=device)
        try:
            yield self
        finally:
            self.tokens = self.logprobs = None

    def record(self, rows: torch.Tensor, draws: torch.Tensor, sampled: torch.Tensor,
               logprobs: torch.Tensor) -> None:
        """A step's draws: each one's request row (not in 0..requests-1: a request not recorded) and draw
        count (negative: a draw vLLM discards), the token drawn and its processed logprob. A request's draw
        count names its column."""
        if self.tokens is None:
            return
        spare_row, spare = self.tokens.shape[0] - 1, self.tokens.shape[1] - 1
        rows = torch.where((rows >= 0) & (rows < spare_row), rows, spare_row)
        columns, sampled = torch.where(draws < 0, spare, draws.clamp(max=spare)), sampled.long()
        self.tokens[rows, columns] = sampled
        self.logprobs[rows, columns] = logprobs

    def read(self, completions: list[list[int]]) -> list[torch.Tensor]:
        """Each completion's logprobs (fp32, CPU), once its tokens are checked against those recorded."""
        tokens, logprobs = self.tokens.cpu(), self.logprobs.cpu()
        if (tokens[-1] != -1).any():
            raise RuntimeError("vLLM's sampler drew for a request not being recorded")
        for row, completion in enumerate(completions):
            if tokens[row, : len(completion)].tolist() != completion:
                raise RuntimeError(f"request {row}: vLLM's tokens are not those its sampler drew")
        return [logprobs[row, : len(completion)] for row, completion in enumerate(completions)]


SAMPLED = SampledLogprobs()


def install_exact_kernels() -> None:
    """Swap vLLM 0.20's kernels (in this process: V1 multiprocessing is off) for the trainer's own: fused
    add+RMSNorm's block size (< 256 tokens or not) and top-k/p's kernel (a sort below 8 rows) change the bits
    with the batch; with the same bits, the matmul's 128 x 128 tiles idle most SMs in decode (`tiled_linear`),
    as does the log-softmax's program a row (`split_log_softmax`, fp32 rows), and the RMSNorm copies q and k
    before it runs (`rms_norm_rows`, the residual add fused in; Qwen3's attention norms and rotates q and k
    in one launch, `exact_qwen3_attention`). The V2 model runner's sampler
    (`exact_sample`) divides by T as the trainer does and keeps each drawn token's logprob on the GPU
    (`SAMPLED`, in the row its request names: `exact_add_request`); every logprob vLLM returns (sampled,
    greedy, prompt) is the trainer's log-softmax's (`exact_token_logprobs`). And hold the rotary table in
    fp32, like the trainer (`rope_cos_sin_cache`)."""
    from vllm.model_executor.layers import batch_invariant, layernorm, linear, vocab_parallel_embedding
    from vllm.model_executor.layers.rotary_embedding import base as rotary
    from vllm.model_executor.models import qwen3, qwen3_moe
    from vllm.v1.worker.gpu.sample import logprob, sampler, states

    def fused_add_rms_norm(x, residual, weight, variance_epsilon):  # a bf16 add, then the Triton norm
        return rms_norm_rows(x, weight, variance_epsilon, residual)

    def fp32_rotary_table(self, query):  # vLLM casts its table to the query's dtype, the op then back to fp32
        if self.cos_sin_cache.dtype != torch.float32:  # once, at the first forward (before graph capture)
            self.cos_sin_cache = self.cos_sin_cache.to(query.device, torch.float32)
        return self.cos_sin_cache

    layernorm.fused_add_rms_norm = fused_add_rms_norm
    layernorm.rms_norm_batch_invariant = rms_norm_rows
    vllm_log_softmax = batch_invariant.log_softmax  # what aten's log-softmax runs on CUDA in this mode
    if getattr(vllm_log_softmax, "__module__", None) == batch_invariant.__name__:  # not installed yet
        def log_softmax(x, dim=-1):  # fp32, as the trainer's are (its entropy backward): ours; else vLLM's
            return (split_log_softmax if x.dtype == torch.float32 else vllm_log_softmax)(x, dim)
        batch_invariant.log_softmax = log_softmax
    rotary.RotaryEmbeddingBase._match_cos_sin_cache_dtype = fp32_rotary_table
    linear.linear_batch_invariant = vocab_parallel_embedding.linear_batch_invariant = tiled_linear
    states.apply_top_k_top_p = top_k_top_p  # bound at import: V2's sampler calls this name
    states.SamplingStates.apply_temperature = divide_by_temperature
    logprob.compute_token_logprobs = exact_token_logprobs  # a global of compute_topk_logprobs
    vllm_sample, vllm_add_request = sampler.Sampler.sample, sampler.Sampler.add_request
    if vllm_sample.__module__ == sampler.__name__:  # not installed yet
        def sample(self, *args):
            return exact_sample(self, *args, vllm_sample=vllm_sample)

        def add_request(self, *args):
            exact_add_request(self, *args, vllm_add_request=vllm_add_request)
        sampler.Sampler.sample, sampler.Sampler.add_request = sample, add_request
    for attention in (qwen3.Qwen3Attention, qwen3_moe.Qwen3MoeAttention):
        vllm_forward = attention.forward
        if vllm_forward.__module__ == attention.__module__:  # not installed yet
            attention.forward = functools.partialmethod(exact_qwen3_attention, vllm_forward=vllm_forward)


def restore_block_table_pointers(worker) -> None:
    """vLLM 0.20's V2 runner writes its block tables' addresses, strides and block sizes into GPU tensors
    once, in the KV cache's sleep-mode pool (`BlockTables.__init__`): a sleep discards them, and the next step
    reads garbage addresses (an illegal memory access; fixed in later vLLM). Written again in place after
    wake-up (`worker`: the engine's, through `collective_rpc`), at the addresses the CUDA graphs hold."""
    tables = worker.model_runner.block_tables
    for tensor, values in ((tables.block_table_ptrs, [t.gpu.data_ptr() for t in tables.block_tables]),
                           (tables.input_block_table_ptrs, [t.data_ptr() for t in tables.input_block_tables]),
                           (tables.block_table_strides, [t.gpu.stride(0) for t in tables.block_tables]),
                           (tables.block_sizes_tensor, tables.block_sizes)):
        tensor.copy_(torch.tensor(values, dtype=tensor.dtype))


# vLLM 0.20's Qwen3 and Qwen3-MoE parameter names, rewritten in this order, are the trainer's: torchtitan's
# names, in the merged layout vLLM serves (q/k/v, gate/up, each expert's gate/up), tensor for tensor.
SERVED_NAMES = (("model.embed_tokens.", "tok_embeddings."), ("model.norm.", "norm."), ("lm_head.", "output."),
                ("model.layers.", "layers."), (".input_layernorm.", ".attention_norm."),
                (".post_attention_layernorm.", ".ffn_norm."), (".self_attn.qkv_proj.", ".attention.wqkv."),
                (".self_attn.o_proj.", ".attention.wo."), (".self_attn.", ".attention."),
                (".mlp.gate_up_proj.", ".feed_forward.w13."), (".mlp.down_proj.", ".feed_forward.w2."),
                (".mlp.gate.", ".moe.router.gate."), (".mlp.experts.w13_weight", ".moe.experts.w13"),
                (".mlp.experts.w2_weight", ".moe.experts.w2"))


def trainer_name(served: str) -> str:
    for theirs, ours in SERVED_NAMES:
        served = served.replace(theirs, ours)
    return served


def tensor_checksum(name: str, t: torch.Tensor) -> torch.Tensor:
    """A weight's checksum (an int64 on its device): its bit patterns (int16s) each weighted by its place in
    the whole tensor (1 + its row-major index), summed, times an odd number drawn from the name. Any two
    unequal values swapped change it (the change, below 2^48, times an odd number is not 0 modulo 2^64), as
    does a tensor's contents in another's place. Integer sums wrap in int64 and are exact in any order: an
    FSDP2 shard (a DTensor: its rows of the whole, as torch.chunk splits them) gives its part, and the
    ranks' parts add up to the whole's. On a GPU one kernel (`_checksum_kernel`); on the CPU summed a few
    million values at a time (the int64 copy a sum makes stays small)."""
    t, first_row = t.detach(), 0
    if hasattr(t, "to_local"):
        if len(t.placements) != 1 or not t.placements[0].is_shard(0):
            raise ValueError(f"{name}: the checksum takes tensors split by rows (FSDP2), not {t.placements}")
        mesh = t.device_mesh
        first_row, t = min(mesh.get_local_rank() * -(-len(t) // mesh.size()), len(t)), t.to_local()
    bits = (t.flatten(1) if t.dim() > 1 else t.reshape(-1, 1)).view(torch.int16)  # (rows, columns)
    width, multiplier = bits.shape[1], 2 * zlib.crc32(name.encode()) + 1
    if bits.is_cuda:
        sums = bits.new_empty(triton.cdiv(bits.numel(), CHECKSUM_BLOCK), dtype=torch.int64)
        _checksum_kernel[(len(sums),)](bits.contiguous(), bits.numel(), first_row * width, multiplier, sums,
                                       BLOCK=CHECKSUM_BLOCK)
        return sums.sum()
    columns, total = torch.arange(1, width + 1, device=bits.device), bits.new_zeros((), dtype=torch.int64)
    rows_at_once = max(1, 2**24 // width)
    for start in range(0, len(bits), rows_at_once):
        part = bits[start:start + rows_at_once]
        rows = torch.arange(first_row + start, first_row + start + len(part), device=bits.device)
        total += width * (rows * part.sum(1, dtype=torch.int64)).sum()  # Σ b (row * width + column + 1)
        total += (columns * part.sum(0, dtype=torch.int64)).sum()
    return total * multiplier


CHECKSUM_BLOCK = 8192


@triton.jit(do_not_specialize=["n", "first_index"])
def _checksum_kernel(bits, n, first_index, multiplier, sums, BLOCK: tl.constexpr):
    """`tensor_checksum` of a block of a weight's n int16s (`first_index`: the first's place in the whole):
    Σ bits * (place + 1) * multiplier, in int64 (wrapping, as torch's)."""
    block = tl.program_id(0).to(tl.int64)
    i = block * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(bits + i, mask=i < n, other=0).to(tl.int64)
    tl.store(sums + block, tl.sum(values * (first_index + i + 1)) * multiplier)


def vllm_weights_checksum(served: torch.nn.Module) -> int:
    """The checksum of the weights vLLM serves (its model, through `LLM.apply_model`), by the trainer's names:
    equal to the trainer's own (`tensor_checksum` of each parameter) when it serves the same tensors."""
    sums = [tensor_checksum(trainer_name(name), p) for name, p in served.named_parameters()]
    return int(torch.stack(sums).sum())


def rope_cos_sin_cache(args, dtype: torch.dtype) -> torch.Tensor:
    """neox rotary's (max_seq_len, head_dim) [cos | sin] table, built as vLLM builds it (the kernel reads
    it): fp32 on the current default device, then rounded to the model dtype. Held in fp32 (the same values):
    vLLM 0.20's rotary op casts any other table to fp32 at every call, a 20 MB copy per layer for Qwen3's
    40,960 positions (0.46 ms of a 32-sequence decode step on an H100)."""
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.float) / args.head_dim
    inv_freq = 1.0 / (args.rope_theta**exponents)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype).float()


def as_rows(x) -> torch.Tensor:
    """(T, ...) tensor, or a (q, k) pair, as (T, n) fp32 (a bf16 value and its fp32 copy have equal bits)."""
    if isinstance(x, tuple):
        return torch.cat([as_rows(t) for t in x], dim=1)
    return x.reshape(x.shape[0], -1).float()


def vllm_trace(llm, tokens: list[int]) -> dict:
    """The divergence locator's tensors from vLLM's served Qwen3 (a `vllm.LLM`), by (layer, op) as the
    trainer names them: hooks on its modules during a prefill of `tokens` (one token sampled, which computes
    the last row's logits)."""
    from vllm import SamplingParams, TokensPrompt

    trace, handles = {}, []

    def hook(key, pick):  # fires at each call: a prefill in chunks calls each module once a chunk
        def record(module, inputs, output):
            trace.setdefault(key, []).append(as_rows(pick(output)).clone())
        return record

    def rotated(key):  # a pre-hook on the attention layer: its q and k inputs, normed and rotated
        def record(module, inputs):
            trace.setdefault(key, []).append(as_rows(inputs[:2]).clone())
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
            modules = {"attention_norm": layer.input_layernorm, "qkv": att.qkv_proj, "attention": att.attn,
                       "o_proj": att.o_proj, "ffn_norm": post}
            if hasattr(mlp, "experts"):  # Qwen3-MoE's sparse block: the router's logits, the experts' sum
                modules |= {"router": mlp.gate, "experts": mlp.experts}
            else:
                modules |= {"gate_up": mlp.gate_up_proj, "swiglu": mlp.act_fn, "down": mlp.down_proj}
            hooks += [(module, (i, op), first) for op, module in modules.items()]
            hooks.append((post, (i, "residual"), second))
            if i:
                hooks.append((layer.input_layernorm, (i, "residual_in"), second))
            # q and k normed and rotated (by the exact engine in one kernel, as by the trainer): what the
            # attention layer is given.
            handles.append(att.attn.register_forward_pre_hook(rotated((i, "rotary"))))
        handles.extend(module.register_forward_hook(hook(key, pick)) for module, key, pick in hooks)

    llm.apply_model(register)
    llm.reset_prefix_cache()  # a cached prefix would not run again: every row's ops recorded
    try:
        llm.generate([TokensPrompt(prompt_token_ids=tokens)],
                     SamplingParams(max_tokens=1, seed=0, detokenize=False), use_tqdm=False)
    finally:
        llm.apply_model(lambda served: [h.remove() for h in handles])
    return {key: torch.cat(parts) for key, parts in trace.items()}  # a chunked prefill: a call per chunk


@torch.no_grad()
def trainer_trace(model, batch) -> dict:
    """The locator's tensors from simple_rl's Qwen3 over a one-sequence `batch`, by (layer, op) in forward
    order: its kernel calls, recorded by wrapping the kernels of each module that names its calls in
    KERNEL_CALLS, and before each block's two norms the sums they normalise: 'residual_in' (layer 0: the
    embedding) and 'residual' (after attention), the adds vLLM fuses into its norms."""
    calls = {}  # module -> [(name, input, output)], in call order

    def recorded(module, names, fn):
        def run(x, *args, **kwargs):
            out = fn(x, *args, **kwargs)
            name = next(names)
            if name.endswith("norm") and isinstance(out, tuple):  # the residual added in: (norm, sum)
                calls.setdefault(module, []).append((name, out[1], out[0]))
            else:
                calls.setdefault(module, []).append((name, x, out))
            return out
        return run
    originals = {m: m.kernels for m in model.modules() if hasattr(m, "KERNEL_CALLS")}
    for m, kernels in originals.items():
        names = iter(m.KERNEL_CALLS)
        m.kernels = Kernels(*(recorded(m, names, getattr(kernels, f.name))
                              for f in dataclasses.fields(Kernels)))
    try:  # the model's own forward (a sharded model gathers its weights for it)
        model(batch)
    finally:
        for m, kernels in originals.items():
            m.kernels = kernels
    if hasattr(model, "reshard"):  # FSDP keeps the root's weights gathered for a backward; none follows
        model.reshard()
    trace = {}
    for i, layer in enumerate(model.layers):
        (first_norm, residual_in, normed_in), (second_norm, residual, normed) = calls[layer]
        trace[i, "residual_in"], trace[i, first_norm] = as_rows(residual_in), as_rows(normed_in)
        trace |= {(i, name): as_rows(out) for name, _, out in calls[layer.attention]}
        trace[i, "residual"], trace[i, second_norm] = as_rows(residual), as_rows(normed)
        ffn = layer.moe if hasattr(layer, "moe") else layer.feed_forward
        trace |= {(i, name): as_rows(out) for name, _, out in calls[ffn]}
    _, (_, final_residual, final_norm), _ = calls[model]
    trace[None, "final_residual"], trace[None, "final_norm"] = as_rows(final_residual), as_rows(final_norm)
    head = model.output_weight  # a sharded model's is a DTensor: the whole of it, for one row
    head = head.full_tensor() if hasattr(head, "full_tensor") else head
    trace[None, "logits"] = as_rows(model.kernels.linear(final_norm[-1:], head))
    return trace


def first_divergence(trainer: dict, served: dict) -> str:
    """The first (layer, op) in `trainer_trace`'s forward order whose tensors differ in a bit; by how much."""
    for key, a in trainer.items():
        if key[1] == "route":
            continue  # inside vLLM's FusedMoE: compared by the experts' output
        b = served[key].to(a.device)
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
