"""The memory plan against the GPU, at the Qwen3-1.7B shape: what a micro-batch of 8,192 packed tokens
allocates beyond the weights stays under the plan's activations and bf16 gradients, with and without
activation checkpointing, and the plan is not loose by more than a third. An offloaded optimizer step (AdamW
on the CPU) moves the weights as the GPU's step does, to the last bits of fp32 rounding."""

import pytest
import torch

import batch_invariant_backward
import simple_rl
from batch_invariant_backward import EXACT

pytestmark = pytest.mark.gpu
SHAPE = dict(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=6144, vocab_size=151936, head_dim=128,
             enable_weight_tying=True)


def random_model(checkpointing: bool = False, layers: int = 28) -> simple_rl.Qwen3:
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = simple_rl.Qwen3(Qwen3ModelArgs(**SHAPE | {"n_layers": layers}), EXACT,
                                activation_checkpointing=checkpointing)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return model


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_micro_batch_allocates_no_more_than_planned(checkpointing):
    """Beyond the weights, the masters, AdamW's moments and the step's fp32 gradient sums: the activations and
    the bf16 gradients, each added to its sum as it is made (by its kernel; the norms' by their backward)."""
    model = random_model(checkpointing)
    simple_rl.MasterWeights(model, 1e-6, 0.0).zero_grads()
    g = torch.Generator().manual_seed(0)
    # 16 sequences of 512 tokens, 448 of them sampled: a full micro-batch of the default budget
    prompts = [torch.randint(0, 151936, (64,), generator=g).tolist() for _ in range(16)]
    completions = [torch.randint(0, 151936, (448,), generator=g).tolist() for _ in range(16)]
    batch = simple_rl.pack_sequences(prompts, completions, "cuda")
    before = torch.cuda.memory_allocated()
    for _ in range(2):  # the second micro-batch's peak: the step's fp32 sums exist from its start
        torch.cuda.reset_peak_memory_stats()
        model(batch).logprobs.sum().backward()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before
    planned = batch_invariant_backward.micro_batch_bytes(model.args, 8192, checkpointing, 2 * 151936 * 2048)
    print(f"\n[1.7B shape, 8192 tokens, checkpointing {checkpointing}] allocated {measured / 2**30:.2f} GiB, "
          f"planned {planned / 2**30:.2f} GiB")
    assert measured <= planned
    assert planned <= 4 / 3 * measured


def test_an_offloaded_step_makes_the_gpus_update():
    """Both optimizers step the same 4-block model with the same gradients: the new bf16 weights are the GPU
    step's to within one bf16 rounding (the masters part in their last fp32 bits), and the deltas agree;
    the offloaded weights are their page-locked masters' rounding, bit for bit."""
    models = [random_model(layers=4) for _ in range(2)]
    optimizers = [simple_rl.MasterWeights(m, 1e-3, 0.01, offload=offload) for m, offload in zip(models, (0, 1))]
    assert optimizers[1].masters[0].device.type == "cpu"
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(2):  # two steps: the second reads AdamW's moments back
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grads()
            g.manual_seed(1)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype) * 1e-3
            optimizer.accumulate_grads()
        (norm_gpu, changes_gpu), (norm_host, changes_host) = (o.step(1e-3, 1.0) for o in optimizers)
        assert norm_gpu == norm_host
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        differ = (a.view(torch.int16) != b.view(torch.int16)).float().mean()
        assert differ < 1e-3, name
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-6)
    for name in changes_gpu:
        torch.testing.assert_close(changes_host[name], changes_gpu[name], rtol=1e-2, atol=0)
    # what came up (on its own stream, as AdamW stepped the next) is each host master's bf16 rounding
    assert all(torch.equal(p.cpu(), m.bfloat16()) for p, m in zip(models[1].parameters(), optimizers[1].masters))
