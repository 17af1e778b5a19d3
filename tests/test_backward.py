"""Every backward of batch_invariant_backward.py against float64 finite differences (gradcheck) and
against PyTorch autograd of its plain reference, on the CPU path."""

import pytest
import torch

import batch_invariant_backward as bib

f64 = dict(dtype=torch.float64, requires_grad=True)


def packed(seqlens):
    cu = torch.tensor([0] + seqlens).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in seqlens])
    return cu, positions, max(seqlens)


def cases():
    torch.manual_seed(0)
    cu, positions, max_len = packed([5, 1, 7])
    T = int(cu[-1])
    angles = torch.rand(16, 3, dtype=torch.float64) * 6
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)  # (max positions, D/2 cos | D/2 sin)
    return {
        "linear": (bib.BatchInvariantLinear.apply, bib.linear_reference,
                   (torch.randn(T, 6, **f64), torch.randn(4, 6, **f64)), ()),
        "rms_norm": (bib.BatchInvariantRMSNorm.apply, bib.rms_norm_reference,
                     (torch.randn(T, 3, 8, **f64), torch.randn(8, **f64)), (1e-6,)),
        "silu_and_mul": (bib.SiluAndMul.apply, bib.silu_and_mul_reference, (torch.randn(T, 10, **f64),), ()),
        "rotary": (bib.Rotary.apply, bib.rotary_reference,
                   (torch.randn(T, 4, 6, **f64), torch.randn(T, 2, 6, **f64)), (positions, cache)),
        "attention": (bib.FlashAttention.apply, lambda q, k, v, cu, m, s: bib.attention_reference(q, k, v, cu, s)[0],
                      (torch.randn(T, 4, 3, **f64), torch.randn(T, 2, 3, **f64), torch.randn(T, 2, 3, **f64)),
                      (cu, max_len, 0.6)),
        "lm_head_logprobs": (bib.LMHeadLogprobs.apply, bib.lm_head_logprobs_reference,
                             (torch.randn(T, 6, **f64), torch.randn(11, 6, **f64)), (torch.randint(0, 11, (T,)), 0.7)),
    }  # fmt: skip


@pytest.mark.parametrize("name", list(cases()))
def test_gradcheck(name):
    fn, _, inputs, extra = cases()[name]
    assert torch.autograd.gradcheck(lambda *x: fn(*x, *extra), inputs)


@pytest.mark.parametrize("name", list(cases()))
def test_backward_equals_autograd_of_reference(name):
    fn, reference, inputs, extra = cases()[name]
    outs, ref_outs = fn(*inputs, *extra), reference(*inputs, *extra)
    outs = outs if isinstance(outs, tuple) else (outs,)
    ref_outs = ref_outs if isinstance(ref_outs, tuple) else (ref_outs,)
    torch.manual_seed(1)
    weights = [torch.randn_like(o) for o in outs]
    grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weights)), inputs)
    ref_grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(ref_outs, weights)), inputs)
    for o, r in zip(outs, ref_outs):
        torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_attention_reference_is_causal_per_sequence():
    """A token attends only to earlier tokens of its own sequence."""
    torch.manual_seed(0)
    cu, _, _ = packed([4, 6])
    q, k, v = torch.randn(10, 2, 3), torch.randn(10, 1, 3), torch.randn(10, 1, 3)
    out, _ = bib.attention_reference(q, k, v, cu, 0.5)
    k2, v2 = k.clone(), v.clone()
    k2[7:], v2[7:] = 5.0, -5.0  # change only the future of sequence 2's token 6 (row 6 + 4 = row 6)
    k2[:4], v2[:4] = 3.0, 3.0  # and all of sequence 1
    out2, _ = bib.attention_reference(q, k2, v2, cu, 0.5)
    assert torch.equal(out[4:7], out2[4:7])
    assert not torch.equal(out[:4], out2[:4])


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
    assert torch.autograd.gradcheck(lambda h, w: bib.LMHeadLogprobs.apply(h, w, targets, 1.3), (hidden, weight))
