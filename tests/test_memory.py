"""The memory plan on the CPU: its arithmetic for Qwen3's shapes on an H100, the changes it names when a model
does not fit, the activations it counts against what the kernels' autograd Functions really keep, and a run
refused (one line, exit status 2) before vLLM starts. tests/test_gpu_memory.py holds it against the GPU."""

import itertools

import pytest
import torch
from conftest import gsm8k_jsonl, make_args, qwen3_config, write_checkpoint, write_gsm8k_model

import batch_invariant_backward
import plumbing
import simple_rl
from batch_invariant_backward import kept_bytes

H100, H200, GiB = 81559 * 2**20, 143771 * 2**20, 2**30
SHAPES = {  # Qwen3's, as torchtitan's Qwen3ModelArgs
    "1.7b": dict(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=6144, enable_weight_tying=True),
    "4b": dict(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=9728, enable_weight_tying=True),
    "8b": dict(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=12288, enable_weight_tying=False),
}


def shape(name: str):
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    return simple_rl.model_shape(Qwen3ModelArgs(**SHAPES[name], vocab_size=151936, head_dim=128))


def flags(**engine):
    return make_args(**engine)


def refusal(model_args, args, gpus=1, gpu=H100, host=None) -> str:
    with pytest.raises(plumbing.UsageError) as error:
        plumbing.check_memory(model_args, args, gpus, gpu, host)
    return str(error.value)


def test_the_plan_adds_up_what_each_phase_holds():
    model_args, args = shape("1.7b"), flags()
    n, block = plumbing.parameter_counts(model_args)
    assert n == 1_720_574_976 and block == 50_336_000  # Qwen3-1.7B (tied embedding)
    plan = plumbing.memory_plan(model_args, args, 1, H100)
    one_at_a_time = 2 * 151936 * 2048  # bf16 gradients, folded one by one into fp32: the embedding's the largest
    micro_batch = batch_invariant_backward.micro_batch_bytes(model_args.args, 8192, False, one_at_a_time)
    assert plan["generating"] == {"CUDA context": plumbing.CUDA_CONTEXT_BYTES,
                                  "vLLM": 0.5 * H100 + plumbing.VLLM_SAMPLER_BYTES,
                                  "bf16 weights": 2 * n, "fp32 masters": 4 * n, "AdamW moments": 8 * n,
                                  "PyTorch's cache": plumbing.CACHED_WHILE_GENERATING * micro_batch,
                                  "sampled tokens' record": 12 * (32 * 8 + 1) * (512 + 1)}
    assert plan["training"]["fp32 gradient sums"] == 4 * n
    assert plan["training"]["activations, bf16 gradients"] == micro_batch
    assert plan["the optimizer step"]["fp32 copies"] == 0  # fused AdamW: no temporary
    offloaded = plumbing.memory_plan(model_args, flags(offload_optimizer=True), 1, H100)
    assert offloaded["the optimizer step"]["fp32 copies"] == 22 * 151936 * 2048
    assert offloaded["generating"]["fp32 masters"] == offloaded["generating"]["AdamW moments"] == 0
    sharded = plumbing.memory_plan(model_args, args, 4, H100)
    assert sharded["generating"]["AdamW moments"] == 2 * n and "gathered by FSDP2" in sharded["training"]
    # Checkpointing keeps a fraction of the activations; a smaller micro-batch keeps fewer.
    full, checkpointed = (batch_invariant_backward.micro_batch_bytes(model_args.args, 8192, c, 2 * n)
                          for c in (False, True))
    assert checkpointed < full / 2 and batch_invariant_backward.micro_batch_bytes(model_args.args, 4096, False,
                                                                                  2 * n) < full


def test_what_fits_one_h100():
    plumbing.check_memory(shape("1.7b"), flags(), 1, H100, None)  # the defaults
    message = refusal(shape("4b"), flags())
    assert message.startswith("4.02B parameters do not fit: generating needs") and "--offload-optimizer" in message
    plumbing.check_memory(shape("4b"), flags(offload_optimizer=True), 1, H100, None)
    message = refusal(shape("8b"), flags())
    assert "AdamW moments 61.0" in message
    assert "--offload-optimizer --activation-checkpointing" in message and "torchrun --nproc-per-node" in message
    eight_b = flags(offload_optimizer=True, activation_checkpointing=True)
    plumbing.check_memory(shape("8b"), eight_b, 1, H100, None)
    # offloaded, the 8B's 98 GB of masters and moments must fit the host
    assert "of host memory" in refusal(shape("8b"), eight_b, host=(64 * GiB, 1))
    plumbing.check_memory(shape("8b"), eight_b, 1, H100, (120 * GiB, 1))
    # saves copy the GPU's training state to pinned host memory: 38 GiB for the 1.7B shape, none without saves
    assert refusal(shape("1.7b"), flags(), host=(30 * GiB, 1)).endswith("it would fit with --save-every -1")
    # vLLM's own share must hold its weights: the 8B's 15 GiB do not fit in 10% of the GPU
    assert refusal(shape("8b"), flags(offload_optimizer=True, activation_checkpointing=True, vllm_gpu_memory=0.1)
                   ).startswith("8.19B parameters do not fit: vLLM's share (--vllm-gpu-memory 0.1")
    # sharded over 4 GPUs, each with an engine of its own, the 8B's state fits; its activations need checkpointing
    assert "it would fit with --activation-checkpointing" in refusal(shape("8b"), flags(), 4)
    plumbing.check_memory(shape("8b"), flags(activation_checkpointing=True), 4, H100, None)
    # the exact sampler records every request's drawn tokens on the GPU: 100,000 samples of 32 prompts do not fit
    message = refusal(shape("1.7b"), flags(samples_per_prompt=100_000))
    assert message.startswith("1.72B parameters do not fit: generating needs") and "sampled tokens' record 18.3" in message


@pytest.mark.parametrize("experts, renormalised", [(0, True), (6, True), (6, False)])
def test_the_activations_planned_are_what_the_kernels_keep(tmp_path, experts, renormalised):
    """What the plan counts as kept for a micro-batch without checkpointing equals, byte for byte, what the
    trainer's autograd Functions save for the backward (each storage once, the weights aside), in a model
    whose every size differs; dense, or a mixture of experts (its routing weights and ids, and its router's
    logits if not renormalised)."""
    config = qwen3_config(hidden=96, layers=3, heads=6, kv_heads=2, head_dim=16, intermediate=160, vocab=320,
                          experts=experts, experts_per_token=3, moe_intermediate=40, norm_topk_prob=renormalised)
    model = simple_rl.load_qwen3(write_checkpoint(tmp_path / "m", config), "cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (5, 2, 9)]
    completions = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (40, 23, 30)]
    batch = simple_rl.pack_sequences(prompts, completions, "cpu")
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved = {}

    def keep(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(batch)
    assert sum(saved.values()) == kept_bytes(model.args, len(batch.tokens), 93)


def test_what_fits_eight_h200s():
    """The plan for one node of 8 H200s (560 GiB of host memory): Qwen3-14B fits as it is; Qwen3-32B needs
    --activation-checkpointing; Qwen3-30B-A3B's optimizer state, copied to pinned host memory by each save,
    needs --offload-optimizer (or no saves). Planned here; #60 measures them when 8 GPUs are lent."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    def qwen3(dim, layers, heads, kv_heads, hidden, **moe):
        return simple_rl.model_shape(Qwen3ModelArgs(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                                                    hidden_dim=hidden, vocab_size=151936, head_dim=128,
                                                    enable_weight_tying=False, **moe))
    a3b = dict(moe_enabled=True, moe_inter_dim=768, moe_args=MoEArgs(
        num_experts=128, num_shared_experts=0, score_func="softmax", route_norm=True, top_k=8, load_balance_coeff=None))
    node = dict(gpus=8, gpu=H200, host=(560 * GiB, 8))
    plumbing.check_memory(qwen3(5120, 40, 40, 8, 17408), flags(), node["gpus"], H200, node["host"])  # 14B
    message = refusal(qwen3(5120, 64, 64, 8, 25600), flags(), **node)  # 32B
    assert message.startswith("32.76B parameters do not fit: generating needs 145.2 of the GPU's 140.4 GiB")
    assert message.endswith("it would fit with --activation-checkpointing or --max-tokens-per-microbatch 2048 or "
                            "--offload-optimizer --activation-checkpointing")
    plumbing.check_memory(qwen3(5120, 64, 64, 8, 25600), flags(activation_checkpointing=True), 8, H200, node["host"])
    message = refusal(qwen3(2048, 48, 32, 4, 6144, **a3b), flags(), **node)
    assert "needs 597.4 GiB of host memory" in message
    assert message.endswith("it would fit with --offload-optimizer or --save-every -1")
    plumbing.check_memory(qwen3(2048, 48, 32, 4, 6144, **a3b), flags(offload_optimizer=True), 8, H200, node["host"])


def test_what_fits_one_h200_of_qwen3_30b_a3b():
    """Qwen3-30B-A3B (48 layers of 128 experts, 30.5B parameters) is refused on one H200, naming the GPUs it
    needs; its shape cut to 8 layers fits one, as tests/test_gpu_moe.py runs it."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    def a3b(layers):
        moe = MoEArgs(num_experts=128, num_shared_experts=0, score_func="softmax", route_norm=True, top_k=8,
                      load_balance_coeff=None)
        return simple_rl.model_shape(Qwen3ModelArgs(
            dim=2048, n_layers=layers, n_heads=32, n_kv_heads=4, hidden_dim=6144, vocab_size=151936, head_dim=128,
            enable_weight_tying=False, moe_enabled=True, moe_inter_dim=768, moe_args=moe))
    assert plumbing.parameter_counts(a3b(48))[0] == 30_532_122_624
    message = refusal(a3b(48), flags(), gpu=H200)
    assert message.startswith("30.53B parameters do not fit: generating needs 473.3 of the GPU's 140.4 GiB")
    assert message.endswith("it would fit with torchrun --nproc-per-node 8")
    assert refusal(a3b(48), flags(offload_optimizer=True, activation_checkpointing=True), gpu=H200).endswith(
        "it would fit with torchrun --nproc-per-node 4")
    plumbing.check_memory(a3b(8), flags(vllm_gpu_memory=0.3), 1, H200, None)


def test_a_model_that_cannot_fit_is_refused_before_vllm_starts(tmp_path, monkeypatch):
    """simple_rl.main on a 'GPU' of 3 GiB: a usage error (one line, exit status 2 from the script) naming what
    does not fit, before any engine is made, and nothing written."""
    class NoEngine:
        def __init__(self, *args, **kwargs):
            raise AssertionError("the engine started")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *device: (3 * GiB, 3 * GiB))
    args = make_args(model=str(write_gsm8k_model(tmp_path / "model")), dataset=str(gsm8k_jsonl("train")),
                     eval_every=0)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(plumbing.UsageError, match="do not fit: vLLM's share"):
        simple_rl.main(args, "cuda", engine_class=NoEngine)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_offloaded_masters_step_as_separate_ones(tmp_path):
    """On a CPU-run trainer an offloaded optimizer's masters (`host_masters`: parts of one host allocation)
    step as separate masters do, bit for bit over two steps; its AdamW a parameter at a time
    (`adamw_on_host`) is a GPU's: tests/test_gpu_memory.py."""
    model_dir = write_checkpoint(tmp_path / "m", qwen3_config(layers=2))
    models = [simple_rl.load_qwen3(model_dir, "cpu", dtype=torch.float32) for _ in range(2)]
    optimizers = [simple_rl.MasterWeights(m, 1e-2, 0.1, offload=offload) for m, offload in zip(models, (False, True))]
    masters = optimizers[1].masters  # back to back in one allocation, each a storage of its own size
    starts = itertools.accumulate((m.nbytes for m in masters), initial=masters[0].data_ptr())
    assert all(m.data_ptr() == start and m.untyped_storage().nbytes() == m.nbytes for m, start in zip(masters, starts))
    for step in range(2):
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grads()
            g = torch.Generator().manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            optimizer.accumulate_grads()
        (norm, changes), (offloaded_norm, offloaded_changes) = (o.step(1e-2, 1.0) for o in optimizers)
        assert norm == offloaded_norm > 1  # clipped, by the same norm
        assert all(torch.equal(offloaded_changes[name], changes[name]) for name in changes)
    start = simple_rl.load_qwen3(model_dir, "cpu", dtype=torch.float32).parameters()
    for a, b, before in zip(*(m.parameters() for m in models), start):
        assert torch.equal(a, b) and not torch.equal(a, before)


def test_a_sharded_trainer_keeps_a_steps_weights_gathered_where_they_fit():
    """On several GPUs the plan also says if FSDP2 may keep the whole bf16 weights and the unsharded fp32
    gradient sums through a step (one reduce-scatter a step): for the 1.7B shape on 2 H100s; not for the 8B on
    4, whose sharded state fits only re-gathered at every micro-batch. One GPU shards nothing."""
    n = plumbing.parameter_counts(shape("1.7b"))[0]
    assert plumbing.check_memory(shape("1.7b"), flags(), 2, H100, None).keep_gathered is True
    kept = plumbing.memory_plan(shape("1.7b"), flags(), 2, H100, keep_gathered=True)["training"]
    assert kept["weights gathered"] == 2 * n and kept["unsharded fp32 gradients"] > 4 * n
    assert "gathered by FSDP2" not in kept and kept["fp32 gradient sums"] == 2 * n
    assert plumbing.check_memory(shape("8b"), flags(activation_checkpointing=True), 4, H100, None).keep_gathered is False
    assert plumbing.check_memory(shape("1.7b"), flags(), 1, H100, None).keep_gathered is False


def test_kept_gathered_a_units_reduce_scatter_copies_at_most_a_gib_of_sums():
    """FSDP2's hooks run a unit at a time, each micro-batch, on the host that launches the GPU's work: kept
    gathered, a unit is as many blocks as hold 1 GiB of fp32 gradient sums (its reduce-scatter's copy, which the
    plan counts); a larger block is a unit alone."""
    units = {name: plumbing.blocks_per_unit(plumbing.parameter_counts(shape(name))[1]) for name in SHAPES}
    assert units == {"1.7b": 5, "4b": 2, "8b": 1}
    for name, blocks in units.items():
        block = plumbing.parameter_counts(shape(name))[1]
        assert 4 * blocks * block <= GiB or blocks == 1
        kept = plumbing.memory_plan(shape(name), flags(), 2, H200, keep_gathered=True)["training"]
        assert kept["unsharded fp32 gradients"] == 4 * plumbing.parameter_counts(shape(name))[0] + 4 * blocks * block


def test_vllm_stays_awake_where_its_share_fits_beside_the_training_phase():
    """Then the engine runs without sleep mode: no sleep or wake, no allocations made anew each step. The
    1.7B shape on one or two H200s (its training phase planned at 130 of 136 usable GiB beside vLLM's half of
    the GPU); not on an H100, nor the 8B on two H200s."""
    assert plumbing.check_memory(shape("1.7b"), flags(), 1, H200, None) == (False, True)
    assert plumbing.check_memory(shape("1.7b"), flags(), 2, H200, None) == (True, True)
    assert plumbing.check_memory(shape("1.7b"), flags(), 1, H100, None) == (False, False)
    assert plumbing.check_memory(shape("8b"), flags(offload_optimizer=True), 2, H200, None) == (True, False)
    awake, asleep = (plumbing.memory_plan(shape("1.7b"), flags(), 1, H200, vllm_awake=v) for v in (True, False))
    assert awake["training"]["vLLM"] == awake["generating"]["vLLM"] and "vLLM asleep" not in awake["training"]
    assert awake["generating"] == asleep["generating"]
    assert sum(awake["training"].values()) - sum(asleep["training"].values()) == pytest.approx(
        awake["training"]["vLLM"] - plumbing.VLLM_ASLEEP_BYTES)
