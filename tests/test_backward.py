"""Every backward of batch_invariant_backward.py against float64 finite differences (gradcheck) and
against PyTorch autograd of its plain reference, on the CPU path."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import batch_invariant_backward as bib

f64 = dict(dtype=torch.float64, requires_grad=True)
ROOT = Path(__file__).resolve().parents[1]


def packed(seqlens):
    cu = torch.tensor([0] + seqlens).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in seqlens])
    return cu, positions, max(seqlens)


# Three samples over 13 rows: the second reads the first's prompt (rows 0-2), then its own row 5.
SHARED = bib.AttentionSpans(torch.tensor([0, 5, 6, 13], dtype=torch.int32), 7,
                            torch.tensor([0, 5, 9, 16], dtype=torch.int32), 7,
                            torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 5, *range(6, 13)]))


def attention(q, k, v, spans, scale):
    return bib.attention_reference(q, k, v, spans, scale)[0]


def cases():
    torch.manual_seed(0)
    cu, positions, _ = packed([5, 1, 7])
    sequences = bib.AttentionSpans.sequences(torch.tensor([5, 1, 7]))
    T = int(cu[-1])
    angles = torch.rand(16, 3, dtype=torch.float64) * 6
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)  # (max positions, D/2 cos | D/2 sin)
    frozen = torch.randn(6, dtype=torch.float64)  # a norm weight that takes no gradient
    hidden, weight = torch.randn(T, 6, **f64), torch.randn(40, 6, **f64)
    top = (hidden @ weight.t()).argmax(-1)
    tokens = torch.tensor([3, 0, 3, 8, 3, 0, 1, 3, 2, 5, 3, 0, 7])  # T of them, repeats included
    # each token's 2 of 5 experts, expert 2 chosen by none (an empty group)
    expert_ids = torch.stack([torch.tensor([0, 1, 3, 4])[torch.randperm(4)[:2]] for _ in range(T)]).int()
    return {
        "embedding": (lambda w: bib.Embedding.apply(tokens, w), lambda w: F.embedding(tokens, w),
                      (torch.randn(9, 6, **f64),), ()),
        "linear": (bib.BatchInvariantLinear.apply, bib.linear_reference,
                   (torch.randn(T, 6, **f64), torch.randn(4, 6, **f64)), ()),
        "rms_norm": (bib.BatchInvariantRMSNorm.apply, bib.rms_norm_reference,
                     (torch.randn(T, 3, 8, **f64), torch.randn(8, **f64)), (1e-6,)),
        # with the residual added in front: (norm, sum), both used
        "add_rms_norm": (lambda x, w, r: bib.BatchInvariantRMSNorm.apply(x, w, 1e-6, r),
                         lambda x, w, r: bib.rms_norm_reference(x, w, 1e-6, r),
                         (torch.randn(T, 8, **f64), torch.randn(8, **f64), torch.randn(T, 8, **f64)), ()),
        "silu_and_mul": (bib.SiluAndMul.apply, bib.silu_and_mul_reference, (torch.randn(T, 10, **f64),), ()),
        "qk_norm_rotary": (bib.QKNormRotary.apply, bib.qk_norm_rotary_reference,
                           (torch.randn(T, 4, 6, **f64), torch.randn(T, 2, 6, **f64), torch.randn(6, **f64),
                            torch.randn(6, **f64)), (1e-6, positions, cache)),
        # k's norm weight frozen: q's weight still has its gradient, k's none
        "qk_norm_rotary_k_weight_frozen": (
            lambda q, k, wq: bib.QKNormRotary.apply(q, k, wq, frozen, 1e-6, positions, cache),
            lambda q, k, wq: bib.qk_norm_rotary_reference(q, k, wq, frozen, 1e-6, positions, cache),
            (torch.randn(T, 4, 6, **f64), torch.randn(T, 2, 6, **f64), torch.randn(6, **f64)), ()),
        "attention": (bib.FlashAttention.apply, attention, (torch.randn(T, 4, 3, **f64), torch.randn(T, 2, 3, **f64),
                                                            torch.randn(T, 2, 3, **f64)), (sequences, 0.6)),
        # rows 0-4 a prompt of 3 and a completion of 2; row 5 another sample's completion reading the prompt
        "attention_shared_prompt": (bib.FlashAttention.apply, attention,
                                    (torch.randn(T, 4, 3, **f64), torch.randn(T, 2, 3, **f64),
                                     torch.randn(T, 2, 3, **f64)), (SHARED, 0.6)),
        "lm_head_logprobs": (bib.LMHeadLogprobs.apply, bib.lm_head_logprobs_reference,
                             (torch.randn(T, 6, **f64), torch.randn(11, 6, **f64)), (torch.randint(0, 11, (T,)), 0.7)),
        # Top-k and top-p: the targets are each row's likeliest token, which every kept set holds.
        "lm_head_logprobs_top_k_top_p": (bib.LMHeadLogprobs.apply, bib.lm_head_logprobs_reference,
                                         (hidden, weight), (top, 0.6, 5, 0.9)),
        # a mixture of experts' router: the top 3 of 7 experts' weights, renormalised or not
        "route": (lambda z: bib.Route.apply(z, 3, True)[0], lambda z: bib.route_reference(z, 3, True)[0],
                  (torch.randn(T, 7, **f64),), ()),
        "route_not_renormalised": (lambda z: bib.Route.apply(z, 3, False)[0],
                                   lambda z: bib.route_reference(z, 3, False)[0], (torch.randn(T, 7, **f64),), ()),
        "experts": (bib.Experts.apply, bib.experts_reference,
                    (torch.randn(T, 6, **f64), torch.randn(5, 8, 6, **f64), torch.randn(5, 6, 4, **f64),
                     torch.rand(T, 2, **f64)), (expert_ids,)),
    }  # fmt: skip


@pytest.mark.parametrize("name", list(cases()))
def test_gradcheck(name):
    fn, _, inputs, extra = cases()[name]
    differentiable = 2 if name.startswith("lm_head") else None  # not the kept-set size and cut mass
    assert torch.autograd.gradcheck(lambda *x: fn(*x, *extra)[:differentiable], inputs)


@pytest.mark.parametrize("name", list(cases()))
def test_backward_equals_autograd_of_reference(name):
    fn, reference, inputs, extra = cases()[name]
    outs, ref_outs = fn(*inputs, *extra), reference(*inputs, *extra)
    outs = outs if isinstance(outs, tuple) else (outs,)
    ref_outs = ref_outs if isinstance(ref_outs, tuple) else (ref_outs,)
    for o, r in zip(outs[2:], ref_outs[2:]):  # lm_head's kept-set size and cut mass
        torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-12)
    outs, ref_outs = outs[:2], ref_outs[:2]
    torch.manual_seed(1)
    weights = [torch.randn_like(o) for o in outs]
    grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weights)), inputs)
    ref_grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(ref_outs, weights)), inputs)
    for o, r in zip(outs, ref_outs):
        torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_the_norm_with_the_add_fused_in_has_the_bits_of_the_add_then_the_norm():
    """In bf16, the norm given the residual (one pass: the layer's add and the next norm) returns the sum and
    the norm, and gives x and the residual the gradients, bit for bit, of a bf16 add then the norm under
    autograd: the norm's dx rounded, then added to the sum's gradient from above in one bf16 add. With both
    outputs used, and with only one (the last norm's sum is unused)."""
    torch.manual_seed(3)
    x, r = (4 * torch.randn(7, 64)).bfloat16(), torch.randn(7, 64).bfloat16()
    w, dy, ds = (1 + 0.1 * torch.randn(64)).bfloat16(), *torch.randn(2, 7, 64).bfloat16()
    bits = lambda t: None if t is None else t.view(torch.int16).tolist()

    def run(fused: bool, used: tuple):
        inputs = [t.clone().requires_grad_() for t in (x, r, w)]
        if fused:
            out, summed = bib.BatchInvariantRMSNorm.apply(inputs[0], inputs[2], 1e-6, inputs[1])
        else:
            summed = inputs[0] + inputs[1]
            out = bib.BatchInvariantRMSNorm.apply(summed, inputs[2], 1e-6)
        torch.autograd.backward([t for t, use in zip((out, summed), used) if use],
                                [g for g, use in zip((dy, ds), used) if use])
        return [bits(out), bits(summed)] + [bits(t.grad) for t in inputs]

    for used in ((True, True), (True, False), (False, True)):
        assert run(True, used) == run(False, used), used


def test_attention_reference_is_causal_per_sequence():
    """A token attends only to earlier tokens of its own sequence; a sample reading a shared prompt's rows gets
    what it gets laid whole."""
    torch.manual_seed(0)
    q, k, v = torch.randn(10, 2, 3), torch.randn(10, 1, 3), torch.randn(10, 1, 3)
    spans = bib.AttentionSpans.sequences(torch.tensor([4, 6]))
    out, _ = bib.attention_reference(q, k, v, spans, 0.5)
    k2, v2 = k.clone(), v.clone()
    k2[7:], v2[7:] = 5.0, -5.0  # change only the future of sequence 2's token 6 (row 6 + 4 = row 6)
    k2[:4], v2[:4] = 3.0, 3.0  # and all of sequence 1
    out2, _ = bib.attention_reference(q, k2, v2, spans, 0.5)
    assert torch.equal(out[4:7], out2[4:7])
    assert not torch.equal(out[:4], out2[:4])
    # SHARED's second sample (prompt rows 0-2, its row 5) laid whole as rows 0-3 of its own sequence
    q, k, v = torch.randn(13, 2, 3), torch.randn(13, 1, 3), torch.randn(13, 1, 3)
    alone = [0, 1, 2, 5]
    whole, _ = bib.attention_reference(q[alone], k[alone], v[alone], bib.AttentionSpans.sequences(torch.tensor([4])),
                                       0.5)
    torch.testing.assert_close(bib.attention_reference(q, k, v, SHARED, 0.5)[0][5], whole[3], rtol=1e-6, atol=1e-6)


def test_lm_head_logprobs_backward_without_entropy_and_over_chunks(monkeypatch):
    """When only the logprobs are used, the backward takes its entropy-free path; and rows split
    into several chunks (3 rows each here) give what one chunk gives."""
    torch.manual_seed(0)
    hidden, weight, targets = torch.randn(10, 5, **f64), torch.randn(13, 5, **f64), torch.randint(0, 13, (10,))
    monkeypatch.setattr(bib.LMHeadLogprobs, "ROWS_PER_CHUNK_TIMES_VOCAB", 3 * 13)
    assert torch.autograd.gradcheck(lambda h, w: bib.LMHeadLogprobs.apply(h, w, targets, 1.3)[0], (hidden, weight))
    grads = torch.autograd.grad(bib.LMHeadLogprobs.apply(hidden, weight, targets, 1.3)[0].sum(), (hidden, weight))
    refs = torch.autograd.grad(bib.lm_head_logprobs_reference(hidden, weight, targets, 1.3)[0].sum(),
                               (hidden, weight))
    for g, r in zip(grads, refs):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda h, w: bib.LMHeadLogprobs.apply(h, w, targets, 1.3)[:2], (hidden, weight))


def test_truncation_keeps_what_it_says_and_changes_nothing_when_off():
    """Top-k keeps k tokens, top-p the fewest likeliest whose mass reaches p, the cut mass is the rest; with
    k = 0 and p = 1 the logprobs are, bit for bit, log_softmax(z / T) of the fp32 logits."""
    torch.manual_seed(2)
    hidden, weight = torch.randn(6, 8), torch.randn(50, 8)
    targets = (hidden @ weight.t()).argmax(-1)
    logprobs, entropy, kept, cut = bib.LMHeadLogprobs.apply(hidden, weight, targets, 0.8, 0, 1.0)
    by_hand = torch.log_softmax((hidden @ weight.t()).float() / torch.tensor(0.8), dim=-1)
    assert torch.equal(logprobs, by_hand.gather(-1, targets[:, None]).squeeze(-1))
    assert kept.tolist() == [50] * 6 and cut.tolist() == [0.0] * 6
    _, _, kept, cut = bib.LMHeadLogprobs.apply(hidden, weight, targets, 0.8, 7, 1.0)
    probs = by_hand.exp().sort(-1, descending=True).values
    assert kept.tolist() == [7] * 6
    torch.testing.assert_close(cut, 1 - probs[:, :7].sum(-1))
    _, _, kept, cut = bib.LMHeadLogprobs.apply(hidden, weight, targets, 0.8, 0, 0.5)
    needed = (probs.cumsum(-1) < 0.5).sum(-1) + 1  # the fewest tokens whose mass reaches 0.5
    assert kept.tolist() == needed.tolist()
    torch.testing.assert_close(cut, 1 - torch.stack([p[:n].sum() for p, n in zip(probs, needed)]))


def test_the_norm_and_log_softmax_refuse_what_would_not_give_vllms_bits():
    """`split_log_softmax` takes fp32 rows only (vLLM's kernel sums other dtypes in them); `rms_norm_rows` a
    residual of x's shape and dtype (PyTorch's add would broadcast or promote) and a weight a value a column;
    `rms_norm_backward` an eps > 0 and the sum's gradient of x's shape and dtype; `embedding_grad` an fp32
    sum of the weight's shape to add to; `qk_norm_rotary` q and k as adjacent heads of one qkv row and the
    fp32 table (it reads them where they lie), 16-byte aligned, and no more warps than heads a program (a
    head in one warp)."""
    with pytest.raises(ValueError, match="fp32"):
        bib.split_log_softmax(torch.zeros(2, 8, dtype=torch.bfloat16))
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    for weight, residual in [(x[0], x[:1]), (x[0], x.float()), (x[0, :4], None)]:
        with pytest.raises(ValueError, match="rms_norm_rows"):
            bib.rms_norm_rows(x, weight, 1e-6, residual)
    with pytest.raises(ValueError, match="eps must be > 0"):  # a part tile's dw would be NaN
        bib.rms_norm_backward(x, x, x[0], 0.0)
    with pytest.raises(ValueError, match="grad_summed"):  # the sum's gradient: x's shape and dtype
        bib.rms_norm_backward(x, x, x[0], 1e-6, x.float())
    with pytest.raises(ValueError, match="main_grad must be a contiguous fp32"):
        bib.embedding_grad(x, torch.zeros(4, dtype=torch.long), 3, torch.zeros(3, 8, dtype=torch.bfloat16))
    qkv, table, positions = torch.zeros(5, 8 * 16, dtype=torch.bfloat16), torch.zeros(64, 16), torch.zeros(5).long()
    q, k, v = qkv.view(5, 8, 16).split([4, 2, 2], dim=1)
    q32, k32, _ = qkv.float().view(5, 8, 16).split([4, 2, 2], dim=1)  # fp32 products are not exact
    for args in [(q, v, table), (q[:, :3], k, table), (q, k, table.bfloat16()), (q, k, table[:, :8]),
                 (q.contiguous(), k, table), (q32, k32, table)]:  # k not next to q; a gap; a bf16 table; a
        with pytest.raises(ValueError, match="qk_norm_rotary"):  # half-width one; a copy; fp32 heads
            bib.qk_norm_rotary(args[0], args[1], qkv[0, :16], qkv[0, :16], 1e-6, positions, args[2])
    odd = torch.zeros(5 * 128 + 1, dtype=torch.bfloat16)[1:].view(5, 8, 16)  # 2 bytes off a 16-byte boundary
    narrow = torch.zeros(5, 8 * 8, dtype=torch.bfloat16).view(5, 8, 8)  # head_dim 8
    for qk, t in [(odd.split([4, 2, 2], dim=1), table), (narrow.split([4, 2, 2], dim=1), table[:, :8])]:
        with pytest.raises(ValueError, match="16-byte aligned"):  # Triton could spread a head over warps
            bib.qk_norm_rotary(qk[0], qk[1], qkv[0, : t.shape[1]], qkv[0, : t.shape[1]], 1e-6, positions, t)
    none = bib.qk_norm_rotary(q[:0], k[:0], qkv[0, :16], qkv[0, :16], 1e-6, positions, table, 4, 2)
    assert [t.shape for t in none] == [(0, 4, 16), (0, 2, 16)]  # a valid layout passes (no rows: no launch)
    for heads, warps in [(2, 4), (3, 1), (4, 3), (4, 0), (64, 64)]:  # a head over two warps; not powers of
        with pytest.raises(ValueError, match="heads a program"):  # two; no warp; more than a program holds
            bib.qk_norm_rotary(q, k, qkv[0, :16], qkv[0, :16], 1e-6, positions, table, heads, warps)


def test_tempered_logits_never_alias_the_logits():
    """Top-k/top-p masks the tempered logits in place (on CUDA): they are a copy even at T = 1 and in fp32, or
    the forward would mask the very logits its backward recomputes the distribution from."""
    logits = torch.randn(3, 5)
    assert bib.tempered_logits(logits, None).data_ptr() != logits.data_ptr()


def test_triton_kernels_under_tritons_interpreter():
    """Our Triton kernels, which run on CUDA, run on the CPU by Triton's interpreter against float64 PyTorch,
    over rows longer than one block: SwiGLU's backward, lm_head's logprob gradient, the embedding's gradient
    (a token at over 120 positions, others at none; and added to an fp32 sum), the RMSNorm (of rows, of a
    bf16 add, of heads read in place) and its backward (a program over several tiles in the last case; with
    the sum's gradient added) within one or two bf16 units in the last place (the interpreter rounds to bf16
    by truncation); the entropy of logprobs and the split
    log-softmax, with a top-k cut (-inf), within fp32 rounding, and a token's logprob and the row's entropy bit
    for bit the split log-softmax's; NaN for a row holding a NaN.
    (tests/test_gpu.py checks the bits of the norm and the log-softmax against vLLM's.)"""
    check = """
import torch, batch_invariant_backward as bib
torch.manual_seed(0)
gate_up, grad_out = torch.randn(37, 2 * 1500, dtype=torch.bfloat16), torch.randn(37, 1500, dtype=torch.bfloat16)
x = gate_up.double().requires_grad_()
(bib.silu_and_mul_reference(x) * grad_out.double()).sum().backward()
torch.testing.assert_close(bib.swiglu_backward(grad_out, gate_up).double(), x.grad, rtol=2**-7, atol=2**-10)

logits, targets, g = (3 * torch.randn(7, 5000)).bfloat16(), torch.randint(0, 5000, (7,)), torch.randn(7)
z = logits.double().requires_grad_()
(torch.log_softmax(z / 0.7, -1).gather(-1, targets[:, None]).squeeze(-1) * g.double()).sum().backward()
torch.testing.assert_close(bib.logprob_grad(logits, targets, g, 0.7).double(), z.grad, rtol=2**-7, atol=1e-9)

tokens = torch.cat([torch.full((120,), 4), torch.randint(0, 30, (200,))])[torch.randperm(320)]
grad_out = torch.randn(320, 1500, dtype=torch.bfloat16)
by_row = torch.zeros(40, 1500, dtype=torch.float64).index_add_(0, tokens, grad_out.double())
grad = bib.embedding_grad(grad_out, tokens, 40)
torch.testing.assert_close(grad.double(), by_row, rtol=2**-7, atol=1e-9)
assert grad[30:].eq(0).all() and grad[4].ne(0).all()
assert torch.equal(bib.embedding_grad(grad_out, tokens.int(), 40), grad)  # int32 tokens: the same
main_grad = torch.randn(40, 1500)
folded = main_grad.clone()
assert bib.embedding_grad(grad_out, tokens, 40, folded) is None  # added to the fp32 sum, as the fold adds it
assert torch.equal(folded, main_grad + grad.float())

logprobs = torch.log_softmax(torch.randn(7, 5000).double(), -1)
logprobs[:, 100:] = float("-inf")
torch.testing.assert_close(bib.row_entropy(logprobs.float()).double(), bib.entropy_of(logprobs))
logprobs[0, 3] = float("nan")
assert bib.row_entropy(logprobs.float()).isnan().tolist() == [True] + [False] * 6

x = torch.randn(37, 20000) * 5  # 20 blocks in 3 chunks a row
x[::3, ::7] = float("-inf")
torch.testing.assert_close(bib.split_log_softmax(x).double(), torch.log_softmax(x.double(), -1), rtol=1e-5, atol=1e-5)
off = torch.randn(3 * 20000 + 1)[1:].view(3, 20000)  # 4 bytes off a 16-byte boundary
torch.testing.assert_close(bib.split_log_softmax(off).double(), torch.log_softmax(off.double(), -1), rtol=1e-5, atol=1e-5)
for rows in (x, off):  # a token's logprob: the bits of the whole row's
    tokens = torch.randint(0, 20000, (len(rows),))
    want = bib.split_log_softmax(rows).gather(1, tokens[:, None])[:, 0]
    assert torch.equal(bib.split_token_logprobs(rows, tokens).view(torch.int32), want.view(torch.int32))
    logprobs, entropy = bib.split_token_logprobs_and_entropy(rows, tokens)  # and the entropy: the same bits
    assert torch.equal(logprobs.view(torch.int32), want.view(torch.int32))
    assert torch.equal(entropy.view(torch.int32), bib.row_entropy(bib.split_log_softmax(rows)).view(torch.int32))
x[0] = float("-inf")
assert bib.split_log_softmax(x)[0].isnan().all()  # as vLLM's: -inf - -inf

w, x, r = (1 + 0.1 * torch.randn(2100)).bfloat16(), torch.randn(9, 2100).bfloat16(), (10 * torch.randn(9, 2100)).bfloat16()
norm = lambda x, w: bib.rms_norm_reference(x.double(), w.double(), 1e-6)
torch.testing.assert_close(bib.rms_norm_rows(x, w, 1e-6).double(), norm(x, w), rtol=2**-7, atol=1e-9)
torch.testing.assert_close(bib.rms_norm_rows(x[3], w, 1e-6).double(), norm(x[3], w), rtol=2**-7, atol=1e-9)  # 1-D
out, summed = bib.rms_norm_rows(x, w, 1e-6, r)
torch.testing.assert_close(summed.double(), x.double() + r.double(), rtol=2**-7, atol=1e-9)
torch.testing.assert_close(out.double(), norm(x.double() + r.double(), w), rtol=2**-6, atol=1e-9)
q = torch.randn(9, 6 * 128).bfloat16()[:, : 4 * 128].view(9, 4, 128)  # 4 heads in a wider row
torch.testing.assert_close(bib.rms_norm_rows(q, w[:128], 1e-6).double(), norm(q, w[:128]), rtol=2**-7, atol=1e-9)

def norm_grads(x, w, dy):  # float64 autograd of the reference norm
    x, w = x.double().requires_grad_(), w.double().requires_grad_()
    (norm(x, w) * dy.double()).sum().backward()
    return x.grad, w.grad
k = torch.randn(9, 6 * 128).bfloat16()[:, 128: 3 * 128].view(9, 2, 128)  # heads at an offset in the row
wide = torch.randn(3, 5120).bfloat16()  # Qwen3-14B/32B's width: a tile is one row of 8,192 columns
for x_, w_ in ((x, w), (q, w[:128]), (k, w[:128]), (wide, (1 + 0.1 * torch.randn(5120)).bfloat16()),
               (torch.randn(530_000, 8).bfloat16(), w[:8])):  # the last: 2 tiles a program
    dy = torch.randn(x_.shape).bfloat16()
    (gx, gw), (rx, rw) = bib.rms_norm_backward(dy, x_, w_, 1e-6), norm_grads(x_, w_, dy)
    torch.testing.assert_close(gx.double(), rx, rtol=2**-6, atol=1e-6)
    torch.testing.assert_close(gw.double(), rw, rtol=2**-6, atol=1e-6)
ds = torch.randn(x.shape).bfloat16()  # the sum's gradient from above, added to dx (a bf16 add)
gx, gw = bib.rms_norm_backward(dy := torch.randn(x.shape).bfloat16(), x, w, 1e-6)
added, same_gw = bib.rms_norm_backward(dy, x, w, 1e-6, ds)
torch.testing.assert_close(added.double(), gx.double() + ds.double(), rtol=2**-7, atol=1e-6)
assert torch.equal(same_gw, gw)
gx, gw = bib.rms_norm_backward(x[:0], x[:0], w, 1e-6)  # no rows: dw is 0
assert gx.shape == (0, 2100) and gw.eq(0).all()
"""
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", check], env=env, check=True)
