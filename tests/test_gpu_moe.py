"""On the GPU, Qwen3-MoE against the real vLLM 0.20 (VLLM_BATCH_INVARIANT=1): the trainer's logprob of every
sampled token is vLLM's, bit for bit, for the Qwen3-30B-A3B shape at full width (8 of its 48 layers: 128
experts, 8 a token, renormalised) and a second shape (64 experts, 4 a token, not renormalised); 512 samples
of prompts up to 2,000 tokens (chunked prefill), trainer micro-batches of 4k and 32k tokens, T = 1 and
Qwen3's thinking sampling; each sample drawn alone gets its batch's bits; changed weights pushed are served
and exact. The experts' backward is right (against float64) and repeats bit for bit. simple_rl.py trains a
mixture of experts exactly, end to end, resumes after kill -9 bit for bit, and its checkpoint loads in vLLM
and transformers. Engines here run without sleep mode (vLLM allows one sleep-mode engine per process); the
script's runs (subprocesses) sleep and push every step."""

import pytest
import torch
from conftest import qwen3_config, start_engine, write_checkpoint, write_gsm8k_model
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_gpu import count_mismatches, relative_error, sample, trainer_logprobs
from test_gpu_rl import (STEPS, check_a_kill_and_resume, check_the_checkpoint_serves_the_trainers_bits,
                         locate_divergences, run, values)

import simple_rl
from batch_invariant_backward import EXACT, REFERENCE

pytestmark = pytest.mark.gpu

A3B_8_LAYERS = dict(hidden=2048, layers=8, heads=32, kv_heads=4, head_dim=128, intermediate=6144, tie=False,
                   experts=128, experts_per_token=8, moe_intermediate=768)  # Qwen3-30B-A3B's, 8 of 48 layers
SHAPES = {
    "qwen3-30b-a3b-shape-8-layers": qwen3_config(**A3B_8_LAYERS, vocab=151936, max_positions=40960),
    "64-experts-top-4": qwen3_config(
        hidden=1024, layers=4, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=32768, tie=True,
        max_positions=40960, experts=64, experts_per_token=4, moe_intermediate=512, norm_topk_prob=False),
}  # fmt: skip
SAMPLINGS = {"T=1": dict(temperature=1.0), "thinking (0.6, top-k 20, top-p 0.95)": dict(temperature=0.6, top_k=20,
                                                                                          top_p=0.95)}


# The script's runs first: each needs the GPU that the module's engines (`served`) would hold until the
# module ends.
MOE_RUN = dict(hidden=512, layers=4, heads=8, kv_heads=4, head_dim=128, intermediate=1536, experts=32,
               experts_per_token=4, moe_intermediate=256)


def test_an_moe_run_is_bitwise_every_step_repeats_and_its_checkpoint_loads(tmp_path):
    """simple_rl.py on a small mixture of experts: 0 mismatched tokens every step, the experts' load and the
    router's entropy logged; the same seed again (recomputed activations, an eager engine) gives the same
    curves; the checkpoint serves the trainer's bits in vLLM and loads in transformers."""
    model_dir = write_gsm8k_model(tmp_path / "model", device="cuda", **MOE_RUN)
    on = run(tmp_path, model_dir, "moe", batch_invariant=True)
    assert values(on, "parity/mismatched_tokens") == [0.0] * STEPS
    load = values(on, "train/expert_load_max_over_mean/layer_00")
    entropy = values(on, "train/router_entropy/layer_03")
    print(f"\n[moe run] expert load max/mean, layer 0: {[round(v, 2) for v in load]}; router entropy, layer 3: "
          f"{[round(v, 3) for v in entropy]} (uniform: {torch.log(torch.tensor(32.0)):.3f})")
    assert all(v >= 1 for v in load) and all(0 < v < 3.466 for v in entropy)
    check_the_checkpoint_serves_the_trainers_bits(tmp_path / "checkpoints" / "moe" / f"step_{STEPS:06d}")
    again = run(tmp_path, model_dir, "moe_again", batch_invariant=True,
                extra=["--no-vllm-cuda-graphs", "--activation-checkpointing"])
    for tag in ("reward/reward_mean", "train/loss", "train/grad_norm", "parity/mismatched_tokens"):
        assert values(again, tag) == values(on, tag), tag


def test_an_moe_run_killed_mid_step_resumes_bit_for_bit(tmp_path):
    check_a_kill_and_resume(tmp_path, write_gsm8k_model(tmp_path / "model", device="cuda", **MOE_RUN),
                            ["--offload-optimizer"])


def test_the_qwen3_30b_a3b_shape_trains_exactly(tmp_path):
    """simple_rl.py on the Qwen3-30B-A3B shape at full width, 8 layers (4.8B parameters with the test's
    vocabulary): 10 steps, 0 mismatched tokens every step. No checkpoint: its training state (77 GB) does
    not fit this machine's disk beside the rest."""
    model_dir = write_gsm8k_model(tmp_path / "model", device="cuda", **A3B_8_LAYERS)
    events = run(tmp_path, model_dir, "a3b", batch_invariant=True,
                 extra=["--save-every", "-1", "--vllm-gpu-memory", "0.2", "--eval-every", "0"])
    assert values(events, "parity/mismatched_tokens") == [0.0] * STEPS
    print(f"\n[Qwen3-30B-A3B shape, 8 layers] step times {[round(v, 2) for v in values(events, 'time/train')]} s "
          f"(train), peak GPU {max(values(events, 'memory/train_gib')):.1f} GiB")


def test_an_inexact_moe_run_locates_where_the_bits_part(tmp_path):
    """Batch invariance off and --locate-divergence on a mixture of experts: each step's first mismatching
    sample is traced through vLLM's modules (its router and experts among them) and the trainer's, and the
    first op whose bits differ is named; vLLM returns each token's experts, and the share of routings to
    another set than the trainer's is logged."""
    model_dir = write_gsm8k_model(tmp_path / "model", device="cuda", **MOE_RUN)
    located = locate_divergences(tmp_path, model_dir, ("router", "experts"))
    print("\n[MoE locator, batch invariance off] " + "\n".join(located))
    # vLLM (V1 runner, enable_return_routed_experts) returned each token's experts: the share routed otherwise
    differs = values(EventAccumulator(str(tmp_path / "runs" / "located")).Reload(), "train/expert_set_differs")
    print(f"[MoE, batch invariance off] share of (token, layer) routings to other experts: {differs}")
    assert len(differs) == 2 and all(0 <= v <= 1 for v in differs)


@pytest.fixture(scope="module", params=list(SHAPES))
def served(request, tmp_path_factory):
    """(engine, trainer model, config, name): a random checkpoint on disk, loaded by both sides."""
    config = SHAPES[request.param]
    ckpt = write_checkpoint(tmp_path_factory.mktemp(request.param), config, seed=0, device="cuda")
    engine = start_engine(ckpt, 0.5, max_model_len=2304, seed=0, sleep_mode=False, kv_cache_gib=16)
    return engine, simple_rl.load_qwen3(ckpt, "cuda"), config, request.param


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_every_sampled_token_is_bitwise_vllms(served, sampling):
    engine, model, config, name = served
    settings = SAMPLINGS[sampling]
    prompts, completions, vllm_lps = sample(engine, config["vocab_size"], 512, seed=7, prompt_lens=(20, 2000),
                                            new_tokens=(64, 256), **settings)
    order = torch.randperm(512, generator=torch.Generator().manual_seed(8)).tolist()
    for budget in (4096, 32768):
        ours = trainer_logprobs(model, prompts, completions, order, budget, **settings)
        mismatched = count_mismatches(ours, vllm_lps)
        print(f"\n[{name}, {sampling}] 512 samples, {sum(map(len, prompts))} prompt and "
              f"{sum(map(len, completions))} sampled tokens, trainer micro-batches of {budget} tokens: "
              f"{mismatched} differ")
        assert mismatched == 0
    for i in (0, 137, 300, 511):  # alone, each decode step routes one token: its batch's bits
        alone, alone_lps = engine.generate([prompts[i]], [len(completions[i])], seeds=[7 * 100_000 + i],
                                           ignore_eos=True, **settings)
        assert alone[0] == completions[i] and count_mismatches(alone_lps, vllm_lps[i:i + 1]) == 0


def test_experts_backward_is_right_and_repeats_bit_for_bit(served):
    """The router, its top-k and the experts of layer 0 over 3,000 tokens: the trainer's gradients (vLLM's
    forward, the hand-written backward, bf16) are no further from float64 autograd than plain bf16 autograd
    is, and two backwards give the same bits. The float64 reference routes as the trainer does (its logits
    carry the bf16 logits' values) so that a near-tie in the router cannot send a token elsewhere."""
    _, model, config, name = served
    moe, g = model.layers[0].moe, torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(3000, config["hidden_size"], device="cuda", generator=g).bfloat16()
    grad_out = torch.randn(3000, config["hidden_size"], device="cuda", generator=g)
    params = [moe.router.gate.weight, moe.experts.w13, moe.experts.w2]

    def gradients(kernels, dtype):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (x, *params)]
        x_, router, w13, w2 = inputs
        logits = kernels.linear(x_, router)
        bf16_logits = EXACT.linear(x, params[0]).detach()
        logits = logits + (bf16_logits.to(dtype) - logits).detach()  # the trainer's values, this dtype's gradient
        weights, ids = kernels.route(logits, moe.top_k, moe.renormalize)
        out = kernels.experts(x_, w13, w2, weights, ids)
        return torch.autograd.grad((out.double() * grad_out.double()).sum(), inputs)
    exact, again = gradients(EXACT, torch.bfloat16), gradients(EXACT, torch.bfloat16)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(exact, again))
    plain, truth = gradients(REFERENCE, torch.bfloat16), gradients(REFERENCE, torch.float64)
    for label, e, p, t in zip(("x", "router", "w13", "w2"), exact, plain, truth):
        err, baseline = relative_error(e, t), relative_error(p, t)
        print(f"\n[{name}] d{label}: relative error {err:.2e} (plain bf16 autograd {baseline:.2e})")
        assert err <= 1.5 * baseline, label


def test_an_expert_no_token_chose_gets_no_gradient():
    """Experts 0 and 1 of 8 chosen by no token: their weight gradients are 0 (PyTorch's grouped GEMM over an
    empty group: pytorch#172439 saw other values on Blackwell), and the others' are float32 autograd's."""
    from batch_invariant_backward import Experts, experts_reference

    g = torch.Generator().manual_seed(0)
    T, H, I, E, k = 512, 256, 128, 8, 2
    ids = torch.stack([torch.randperm(E - 2, generator=g)[:k] + 2 for _ in range(T)]).int().cuda()
    inputs = [torch.randn(T, H, generator=g), torch.randn(E, 2 * I, H, generator=g) * H**-0.5,
              torch.randn(E, H, I, generator=g) * I**-0.5, torch.rand(T, k, generator=g)]
    grads = {}
    for label, fn, dtypes in (("exact", Experts.apply, (torch.bfloat16,) * 3 + (torch.float32,)),
                              ("fp32", experts_reference, (torch.float32,) * 4)):
        leaves = [t.to("cuda", dtype).requires_grad_() for t, dtype in zip(inputs, dtypes)]
        fn(*leaves, ids).float().pow(2).sum().backward()
        grads[label] = [t.grad for t in leaves]
    (_, w13, w2, _), truth = grads["exact"], grads["fp32"]
    assert not w13[:2].any() and not w2[:2].any()
    for label, e, t in zip(("x", "w13", "w2", "weights"), grads["exact"], truth):
        assert relative_error(e, t) < 2e-2, label


def test_changed_weights_pushed_are_served_and_exact(served):
    """Every weight changed, pushed through vLLM's `load_weights` (per-expert tensors into its merged
    `w13`/`w2`): the served checksum follows, and 256 samples are bitwise the trainer's."""
    engine, model, config, name = served
    before = engine.weights_checksum()
    assert before == simple_rl.trainer_checksum(model, simple_rl.World())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    engine.push_weights(model)
    engine.check_weights(model, simple_rl.World(), changed=True)
    prompts, completions, vllm_lps = sample(engine, config["vocab_size"], 256, seed=9, prompt_lens=(20, 1000))
    ours = trainer_logprobs(model, prompts, completions, list(range(256)), 16384)
    assert count_mismatches(ours, vllm_lps) == 0
