"""The trainer model on the CPU: logits against Hugging Face transformers' Qwen3ForCausalLM, exact
HF -> trainer -> HF round trip, and a full forward + backward."""

import json
import math
from types import MethodType, SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import qwen3_config, random_hf_weights, write_checkpoint
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeForCausalLM

import batch_invariant_backward
import plumbing
import simple_rl
from batch_invariant_backward import EXACT, REFERENCE

CONFIGS = {
    "tied-gqa": qwen3_config(tie=True, heads=4, kv_heads=2),
    "untied-gqa": qwen3_config(tie=False, heads=8, kv_heads=2, head_dim=8, layers=3),
    "untied-mha": qwen3_config(tie=False, heads=4, kv_heads=4, hidden=48, head_dim=12),
}
# Qwen3-MoE: each token's 2 of 6 experts, renormalised (as Qwen3-30B-A3B's 8 of 128), or 3 of 5, not
MOE_CONFIGS = {
    "moe": qwen3_config(tie=False, layers=2, experts=6, experts_per_token=2, moe_intermediate=32),
    "moe-not-renormalised": qwen3_config(tie=True, layers=2, experts=5, experts_per_token=3, moe_intermediate=24,
                                         norm_topk_prob=False),
}
ALL_CONFIGS = CONFIGS | MOE_CONFIGS


def random_sequences(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("kernels", [EXACT, REFERENCE], ids=["exact", "reference"])
def test_logits_match_transformers(name, kernels, tmp_path):
    config = CONFIGS[name]
    hf_weights = random_hf_weights(config, seed=1, dtype=torch.float32)
    hf = Qwen3ForCausalLM(Qwen3Config(**config)).float().eval()
    hf.load_state_dict(hf_weights, strict=False)  # strict=False: a tied lm_head is not in the dict
    if config["tie_word_embeddings"]:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()

    args = simple_rl.model_args_from_hf_config(config)
    model = simple_rl.Qwen3(args, kernels, dtype=torch.float32)
    model.load_state_dict(simple_rl.from_hf_state_dict(hf_weights, args))

    assert_logits_match(model, hf, random_sequences(config["vocab_size"], [9, 1, 23, 4]))


def assert_logits_match(model, hf, seqs) -> None:
    """The trainer's logits at every position of `seqs` (packed), each sequence's transformers' (one at a time)."""
    # Every token but each sequence's first as a "completion": logits at every position.
    batch = simple_rl.pack_sequences([s[:1] for s in seqs], [s[1:] for s in seqs], "cpu")
    with torch.no_grad():
        hidden = model.hidden_states(batch.tokens, batch.positions, batch.spans)
        logits = torch.nn.functional.linear(hidden, model.output_weight)
        bounds = batch.spans.cu_seqlens.tolist()
        for seq, start, end in zip(seqs, bounds, bounds[1:]):
            expected = hf(torch.tensor([seq])).logits[0]
            torch.testing.assert_close(logits[start:end], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
@pytest.mark.parametrize("kernels", [EXACT, REFERENCE], ids=["exact", "reference"])
def test_moe_logits_match_transformers(name, kernels, tmp_path):
    """A Qwen3-MoE checkpoint (Hugging Face's per-expert tensors) loaded by the trainer gives transformers'
    Qwen3MoeForCausalLM's logits: the router's top-k, its renormalisation, the experts' weighted sum."""
    src = write_checkpoint(tmp_path / "src", MOE_CONFIGS[name], seed=1)
    hf = Qwen3MoeForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model = simple_rl.load_qwen3(src, "cpu", kernels, dtype=torch.float32)
    assert_logits_match(model, hf, random_sequences(MOE_CONFIGS[name]["vocab_size"], [9, 1, 23], seed=2))


@pytest.mark.parametrize("name", list(ALL_CONFIGS))
def test_hf_round_trip_is_exact(name, tmp_path):
    src = write_checkpoint(tmp_path / "src", ALL_CONFIGS[name], seed=3)
    model = simple_rl.load_qwen3(src, "cpu")
    (tmp_path / "out").mkdir()
    plumbing.write_hf_checkpoint(dict(simple_rl.hf_weights(model)), src, tmp_path / "out")
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert before.keys() == after.keys()
    for key in before:
        assert before[key].dtype == after[key].dtype == torch.bfloat16
        assert torch.equal(before[key].view(torch.int16), after[key].view(torch.int16)), key
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == ALL_CONFIGS[name]


@pytest.mark.parametrize("name", ["untied-gqa", *MOE_CONFIGS])
def test_token_logprobs_and_gradients_match_reference(name):
    """EXACT (hand-written backwards) and REFERENCE (autograd) agree on the CPU in float64."""
    config = ALL_CONFIGS[name]
    args = simple_rl.model_args_from_hf_config(config)
    weights = simple_rl.from_hf_state_dict(random_hf_weights(config, seed=2, dtype=torch.float64), args)
    seqs = random_sequences(config["vocab_size"], [12, 30, 5], seed=4)
    results = []
    for kernels in (EXACT, REFERENCE):
        model = simple_rl.Qwen3(args, kernels, dtype=torch.float64)
        model.load_state_dict(weights)
        batch = simple_rl.pack_sequences([s[:4] for s in seqs], [s[4:] for s in seqs], "cpu")
        logprobs, entropy, *_ = model(batch)
        (logprobs.sum() + 0.1 * entropy.sum()).backward()
        results.append((logprobs, entropy, {n: p.grad for n, p in model.named_parameters()}))
    (lp, ent, grads), (lp_ref, ent_ref, grads_ref) = results
    assert lp.shape == (sum(len(s) - 4 for s in seqs),)
    torch.testing.assert_close(lp, lp_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-12, atol=1e-12)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("name", ["untied-gqa", "moe"])
@pytest.mark.parametrize("kernels", [EXACT, REFERENCE], ids=["exact", "reference"])
def test_samples_sharing_their_prompt_get_the_logprobs_and_gradients_they_get_alone(name, kernels):
    """GRPO's G samples of a prompt, packed together (the prompt's rows once), get the logprobs and entropies
    they get packed apart (interleaved with another prompt's, each laid whole), and the weights the same
    gradients: a prompt row's key and value gradients sum its readers'. float64."""
    config = ALL_CONFIGS[name]
    args = simple_rl.model_args_from_hf_config(config)
    weights = simple_rl.from_hf_state_dict(random_hf_weights(config, seed=2, dtype=torch.float64), args)
    a, b = random_sequences(config["vocab_size"], [9, 14], seed=6)
    completions = random_sequences(config["vocab_size"], [6, 1, 11, 3, 8, 2], seed=7)
    prompts = [a, a, a, b, b, b]
    results = []
    for order in ([0, 1, 2, 3, 4, 5], [0, 3, 1, 4, 2, 5]):  # together, then interleaved
        model = simple_rl.Qwen3(args, kernels, dtype=torch.float64)
        model.load_state_dict(weights)
        batch = simple_rl.pack_sequences([prompts[i] for i in order], [completions[i] for i in order], "cpu")
        assert len(batch.tokens) == (9 + 14 + 31 if order[1] == 1 else 3 * (9 + 14) + 31)
        logprobs, entropy, *_ = model(batch)
        scale = torch.cat([torch.linspace(-1, 1, len(completions[i]), dtype=torch.float64) + i for i in order])
        (logprobs * scale.sin() + 0.1 * entropy).sum().backward()
        per_sample = [logprobs.split(batch.completion_lens), entropy.split(batch.completion_lens)]
        results.append(([torch.cat([lp[order.index(i)] for i in range(6)]) for lp in per_sample],
                        {n: p.grad for n, p in model.named_parameters()},
                        plumbing.routing_metrics(model, simple_rl.World())))  # each sample's rows counted
    (together, grads, routing), (apart, grads_apart, routing_apart) = results
    assert routing.keys() == routing_apart.keys() and (name != "moe") == (routing == {})
    for key in routing:
        assert routing[key] == pytest.approx(routing_apart[key], rel=1e-12), key
    for x, y in zip(together, apart):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    for n in grads:
        torch.testing.assert_close(grads[n], grads_apart[n], rtol=1e-9, atol=1e-11, msg=n)


@pytest.mark.parametrize("name", ["tied-gqa", "untied-gqa", "moe"])
def test_a_steps_gradient_sums_are_the_same_with_recomputed_activations(name):
    """`MasterWeights`' fp32 sums over two bf16 micro-batches: a linear weight's products added to its sum in
    the matmul (`weight_grad`), the other weights' bf16 gradients added in (a norm's by its backward); each
    to bf16 rounding plain autograd's gradient (once each: none lost, none counted twice), a norm's bit for
    bit the fp32 sum of plain autograd's micro-batch gradients. Bit for bit the same with
    --activation-checkpointing, whose recomputation hands the backward detached copies of the weights."""
    config = ALL_CONFIGS[name]
    args = simple_rl.model_args_from_hf_config(config)
    weights = simple_rl.from_hf_state_dict(random_hf_weights(config, seed=3, dtype=torch.bfloat16), args)
    seqs = random_sequences(config["vocab_size"], [12, 30, 5, 20], seed=5)
    batches = [simple_rl.pack_sequences([s[:4] for s in part], [s[4:] for s in part], "cpu")
               for part in (seqs[:2], seqs[2:])]
    sums = []
    for checkpointing in (False, True):
        model = simple_rl.Qwen3(args, EXACT, torch.bfloat16, activation_checkpointing=checkpointing)
        model.load_state_dict(weights)
        optimizer = simple_rl.MasterWeights(model, lr=1e-3, weight_decay=0.0)
        optimizer.zero_grads()
        for batch in batches:
            model(batch).logprobs.sum().backward()
            optimizer.accumulate_grads()
        assert all(p.grad is None for p in model.parameters())
        sums.append({n: p.main_grad for n, p in optimizer.named})
    plain = simple_rl.Qwen3(args, EXACT, torch.bfloat16)  # no MasterWeights: autograd's bf16 .grad
    plain.load_state_dict(weights)
    folded = {}  # each micro-batch's bf16 gradient of a norm, added in fp32
    for batch in batches:
        plain.zero_grad()
        plain(batch).logprobs.sum().backward()
        for n, p in plain.named_parameters():
            if "norm" in n:
                folded[n] = folded.get(n, 0) + p.grad.float()
    assert folded and all(torch.equal(sums[0][n], total) for n, total in folded.items())
    plain.zero_grad()
    for batch in batches:
        plain(batch).logprobs.sum().backward()
    for n, p in plain.named_parameters():
        assert sums[0][n].dtype == torch.float32
        assert float((sums[0][n] - p.grad.float()).norm() / p.grad.float().norm()) < 2e-2, n
        assert torch.equal(sums[0][n], sums[1][n]), n


def test_bad_checkpoints_give_clear_errors(tmp_path):
    with pytest.raises(plumbing.UsageError, match="no config.json"):
        plumbing.resolve_model_dir(str(tmp_path))
    with pytest.raises(plumbing.UsageError, match="not a checkpoint directory"):
        plumbing.resolve_model_dir(str(tmp_path / "missing" / "dir"))
    ckpt = write_checkpoint(tmp_path / "c", qwen3_config())
    config = ckpt / "config.json"
    good = config.read_text()
    for text, message in [(json.dumps(dict(qwen3_config(), model_type="llama")), "model_type is 'llama'; "),
                          (json.dumps({k: v for k, v in qwen3_config().items() if k != "hidden_size"}), "no hidden_size"),
                          (json.dumps(dict(qwen3_config(), hidden_size="64")), "hidden_size is '64'; it must be an integer"),
                          (json.dumps(dict(qwen3_config(), head_dim="16")), "head_dim is '16'; it must be an integer > 0"),
                          (json.dumps(dict(qwen3_config(), num_hidden_layers=2.5)), "num_hidden_layers is 2.5; it must be an"),
                          (json.dumps(dict(qwen3_config(), rms_norm_eps=0)), "rms_norm_eps is 0; it must be a number > 0"),
                          ("[1, 2]", "a JSON object of the model's settings"), ("{not json", "not valid JSON"),
                          (json.dumps(qwen3_config(experts=4, experts_per_token=2) | {"num_experts_per_tok": 5}),
                           "num_experts_per_tok 5 is more than num_experts 4"),
                          (json.dumps(qwen3_config(experts=4, experts_per_token=2) | {"decoder_sparse_step": 2}),
                           "a dense layer among the sparse"),
                          (json.dumps(qwen3_config(experts=4, experts_per_token=2) | {"mlp_only_layers": [0]}), "a dense layer among"),
                          (json.dumps({k: v for k, v in qwen3_config(experts=4, experts_per_token=2).items() if k != "num_experts"}),
                           "no num_experts; this trainer needs a Hugging Face Qwen3 or Qwen3-MoE config")]:
        config.write_text(text)
        with pytest.raises(plumbing.UsageError, match=message) as error:
            plumbing.read_config(ckpt)
        assert str(config) in str(error.value)
    config.write_text(good)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(plumbing.UsageError, match="the weights do not match config.json"):
        plumbing.check_checkpoint(ckpt, cfg)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("experts", [0, 4])
def test_the_checkpoint_checks_expect_the_tensors_the_trainer_writes(tie, experts):
    """plumbing.checkpoint_shapes works out a checkpoint's tensors from config.json without torch (so that
    the weights are checked before it loads): the names and shapes the trainer's own hf_weights writes."""
    config = qwen3_config(hidden=64, layers=3, heads=4, kv_heads=2, head_dim=32, intermediate=96, vocab=300,
                          tie=tie, experts=experts, experts_per_token=2, moe_intermediate=40)
    with torch.device("meta"):
        model = simple_rl.Qwen3(simple_rl.model_args_from_hf_config(config))
    assert plumbing.checkpoint_shapes(config) == {name: tuple(t.shape) for name, t in simple_rl.hf_weights(model)}


def test_packing_lays_sequences_back_to_back_and_reads_each_completion_token_a_row_early():
    batch = simple_rl.pack_sequences([[1, 2, 3], [4], [10, 11]], [[5, 6], [7, 8, 9], []], "cpu")
    assert batch.tokens.tolist() == [1, 2, 3, 5, 6, 4, 7, 8, 9, 10, 11]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1]
    spans = batch.spans
    assert spans.cu_seqlens.dtype == torch.int32 and spans.cu_seqlens.tolist() == [0, 5, 9, 11]
    assert spans.cu_seqlens_k.tolist() == [0, 5, 9, 11] and spans.kv_rows is None
    assert spans.max_seqlen == spans.max_seqlen_k == 5 and batch.completion_lens == [2, 3, 0]
    assert batch.target_rows.tolist() == [2, 3, 5, 6, 7] and batch.targets.tolist() == [5, 6, 7, 8, 9]
    assert all(t.dtype == torch.long for t in (batch.tokens, batch.positions, batch.target_rows, batch.targets))


def test_samples_of_one_prompt_lay_it_once_and_each_reads_it():
    """GRPO's samples of a prompt follow each other: the prompt's rows come once, each later sample adds its
    completion's rows, at the positions after the prompt, and its attention span reads the prompt's rows,
    then its own; its first token is predicted by the prompt's last row. A sample without a completion, or
    of another prompt, lays its prompt again."""
    batch = simple_rl.pack_sequences([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3], [4], [1, 2, 3]],
                                     [[5, 6], [7, 8, 9], [], [10], [11], [12]], "cpu")
    assert batch.tokens.tolist() == [1, 2, 3, 5, 6, 7, 8, 9, 1, 2, 3, 10, 4, 11, 1, 2, 3, 12]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 0, 1, 2, 3, 0, 1, 0, 1, 2, 3]
    spans = batch.spans
    assert spans.cu_seqlens.tolist() == [0, 5, 8, 11, 12, 14, 18] and spans.max_seqlen == 5
    assert spans.cu_seqlens_k.tolist() == [0, 5, 11, 14, 18, 20, 24] and spans.max_seqlen_k == 6
    assert spans.kv_rows.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9, 10, 8, 9, 10, 11, 12, 13,
                                      14, 15, 16, 17]
    assert batch.target_rows.tolist() == [2, 3, 2, 5, 6, 10, 12, 16]
    assert batch.targets.tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    assert batch.completion_lens == [2, 3, 0, 1, 1, 1]


def test_vllm_holds_the_rotary_table_in_fp32_with_the_trainers_values():
    """vLLM 0.20's rotary op casts its table to fp32 at every call (a 20 MB copy per layer at Qwen3's 40,960
    positions); with the exact kernels installed vLLM holds it in fp32 once, equal to the trainer's table."""
    from types import SimpleNamespace

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from batch_invariant_backward import install_exact_kernels, rope_cos_sin_cache

    install_exact_kernels()
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):  # read by CustomOps
        rope = get_rope(64, 4096, rope_parameters={"rope_theta": 1_000_000}, dtype=torch.bfloat16)
    assert rope.cos_sin_cache.dtype == torch.bfloat16  # as vLLM builds it
    table = rope._match_cos_sin_cache_dtype(torch.zeros(1, 64, dtype=torch.bfloat16))
    assert table.dtype == torch.float32 and rope.cos_sin_cache is table  # kept: no cast at the next call
    assert rope._match_cos_sin_cache_dtype(torch.zeros(1, 64, dtype=torch.bfloat16)) is table
    args = SimpleNamespace(head_dim=64, rope_theta=1_000_000, max_seq_len=4096)
    trainers = rope_cos_sin_cache(args, torch.bfloat16)
    assert trainers.dtype == torch.float32 and torch.equal(table.view(torch.int32), trainers.view(torch.int32))


def test_the_engines_qwen3_attention_keeps_vllms_forward_where_its_rotary_is_not_the_neox_kernel():
    """`install_exact_kernels` gives vLLM's Qwen3 and Qwen3-MoE attention one kernel for q and k's norms and
    rotation (`exact_qwen3_attention`), once however often it is called; a rotary not dispatched to vLLM's
    CUDA kernel (here the CPU's) goes to vLLM's own forward."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope
    from vllm.model_executor.models import qwen3, qwen3_moe

    from batch_invariant_backward import exact_qwen3_attention, install_exact_kernels

    install_exact_kernels()
    installed = [vars(attention)["forward"] for attention in (qwen3.Qwen3Attention, qwen3_moe.Qwen3MoeAttention)]
    install_exact_kernels()
    assert [vars(attention)["forward"] for attention in (qwen3.Qwen3Attention, qwen3_moe.Qwen3MoeAttention)] == installed
    assert all(forward.func is exact_qwen3_attention for forward in installed)  # functools.partialmethod
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        rope = get_rope(64, 4096, rope_parameters={"rope_theta": 1_000_000}, dtype=torch.bfloat16)
    cuda = SimpleNamespace(is_neox_style=True, rotary_dim=64, use_flashinfer=False)
    cuda._forward_method = MethodType(RotaryEmbedding.forward_cuda, cuda)  # as a CUDA process dispatches
    for other in [rope, SimpleNamespace(**vars(cuda) | {"is_neox_style": False}),  # GPT-J's pairs
                  SimpleNamespace(**vars(cuda) | {"rotary_dim": 32}),  # a partial rotation
                  SimpleNamespace(**vars(cuda) | {"use_flashinfer": True})]:
        attention = SimpleNamespace(rotary_emb=other, head_dim=64)
        assert exact_qwen3_attention(attention, "positions", "hidden", vllm_forward=lambda *a: a) == (
            attention, "positions", "hidden")


class Uva:
    """A UvaBackedTensor of vLLM's V2 runner (host numpy and device views of one buffer; CUDA only): a CPU
    tensor and its numpy view."""

    def __init__(self, values, dtype):
        self.gpu = torch.tensor(values, dtype=dtype)
        self.np = self.gpu.numpy()


def test_the_exact_sampler_keeps_each_drawn_tokens_logprob_where_its_request_and_draw_say(monkeypatch):
    """vLLM 0.20's V2 `Sampler.add_request` and `Sampler.sample`, as `install_exact_kernels` wraps them
    (`exact_add_request`, `exact_sample`), on the CPU: the request state is GPU-only (a stand-in here, as is the
    Triton Gumbel-max: a plain one keyed the same way, by each request's seed and position). The tokens are
    vLLM's draw from the logits divided by T as the trainer divides; the logprob kept is their log-softmax at
    the token, bit for bit, in the row its request's `extra_args` names, at its draw's column (position + 1 -
    prompt), whatever the seeds (shared, or None); a prompt chunk's draw is not kept, nor that of a
    recompute's chunk before its last. Refused: tokens the sampler did not draw, a request not recorded."""
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample import sampler as v2_sampler

    from batch_invariant_backward import SAMPLED, divide_by_temperature, install_exact_kernels

    keys = []

    def keyed_gumbel_max(logits, mapping, temperature, seed, pos, apply_temperature):
        assert not apply_temperature  # the logits come divided
        keys.append(list(zip(seed[mapping].tolist(), pos.tolist())))
        noise = torch.stack([torch.rand(logits.shape[1], generator=torch.Generator().manual_seed(
            hash((s, p)) % 2**63)) for s, p in keys[-1]])
        return (logits - noise.log().neg().log()).argmax(-1)

    monkeypatch.setattr(v2_sampler, "gumbel_sample", keyed_gumbel_max)
    install_exact_kernels()
    # Five requests in state slots 0-4, recorded in rows 4, 2, 0, 1, 3; two share a seed, one has none.
    seeds, rows, prompt_lens, vocab = [11, 11, 5, None, 7], [4, 2, 0, 1, 3], [3, 10, 4, 6, 2], 64
    ignored = SimpleNamespace(add_request=lambda *args: None)  # vLLM's add_request fills them too
    drawn = [s if s is not None else 2**62 + 3 for s in seeds]  # None: vLLM's add_request draws one
    states = SimpleNamespace(temperature=Uva([0.7] * 5, torch.float32), add_request=ignored.add_request,
                             seeds=Uva(drawn, torch.int64))

    def apply_sampling_params(logits, mapping, mapping_np, *_):  # vLLM's V2 order: fp32 copy, then T
        logits = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
        divide_by_temperature(states, logits, mapping, mapping_np)
        return logits
    requests = SimpleNamespace(prompt_len=Uva(prompt_lens, torch.int32), prefill_len=Uva(prompt_lens, torch.int32))
    sampler = SimpleNamespace(sampling_states=states, apply_sampling_params=apply_sampling_params,
                              penalties_state=SimpleNamespace(req_states=requests, add_request=ignored.add_request),
                              logit_bias_state=ignored, bad_words_state=ignored)
    for slot, row in enumerate(rows):
        v2_sampler.Sampler.add_request(sampler, slot, prompt_lens[slot],
                                       SamplingParams(seed=seeds[slot], extra_args={"recorded_row": row}))
    assert sampler.recorded_rows.tolist() == rows
    g = torch.Generator().manual_seed(0)

    def step(slots: list[int], drawn: list[int]):  # requests (state slots) whose draw counts are `drawn`
        logits = torch.randn(len(slots), vocab, generator=g).bfloat16()
        pos = torch.tensor([prompt_lens[r] + d - 1 for r, d in zip(slots, drawn)])
        tokens, processed = v2_sampler.Sampler.sample(sampler, logits, torch.tensor(slots, dtype=torch.int32),
                                                      np.array(slots), pos, None, None)
        assert keys[-1] == [(states.seeds.np[r], p) for r, p in zip(slots, pos.tolist())]  # seed and position
        t = states.temperature.gpu[slots]
        divided = logits.float().div_(t[:, None])  # the trainer's division
        assert torch.equal(processed.view(torch.int32), divided.view(torch.int32))
        return tokens.tolist(), divided.log_softmax(-1).gather(1, tokens[:, None])[:, 0]

    expected = {r: {} for r in range(5)}  # per request slot and draw: (token, logprob)

    def steps(*batches):
        for slots, drawn in batches:
            for r, d, t, lp in zip(slots, drawn, *step(slots, drawn)):
                expected[r][d] = (t, lp)
    with SAMPLED.recording(5, 3, "cpu"):
        steps(([0, 1, 2, 3, 4], [0, 0, 0, 0, 0]), ([3, 1, 0], [1, 1, 1]), ([4, 2], [1, 1]), ([1, 0], [2, 2]))
        step([3], [-2])  # a prompt chunk before the last: vLLM discards its draw; not kept
        requests.prefill_len.np[2] += 2  # request 2, preempted after 2 tokens, recomputes them too
        step([2], [0])  # a chunk of that before its last (position prompt - 1): discarded, not kept
        steps(([2, 4], [2, 2]), ([4, 4], [3, 4]))  # its last chunk draws its third token; 4's past the end
        completions = [[expected[r][d][0] for d in sorted(expected[r]) if d < 3] for r in range(5)]
        by_row = [completions[rows.index(row)] for row in range(5)]
        recorded = SAMPLED.read(by_row)
        assert [len(x) for x in recorded] == [3, 2, 3, 3, 3]
        for row, slot in ((row, rows.index(row)) for row in range(5)):
            kept = torch.stack([expected[slot][d][1] for d in range(len(completions[slot]))])
            assert torch.equal(recorded[row].view(torch.int32), kept.view(torch.int32))
        with pytest.raises(RuntimeError, match="request 1: vLLM's tokens are not those its sampler drew"):
            SAMPLED.read(by_row[:1] + [[by_row[1][0] + 1]] + by_row[2:])
    assert SAMPLED.tokens is None
    step([0, 1], [5, 5])  # not recording: nothing kept, nothing fails
    v2_sampler.Sampler.add_request(sampler, 4, prompt_lens[4], SamplingParams(seed=7))  # no row: not recorded
    with SAMPLED.recording(5, 3, "cpu"):
        step([0, 4, 1], [0, 0, 0])
        with pytest.raises(RuntimeError, match="a request not being recorded"):
            SAMPLED.read([[]] * 5)


def test_every_logprob_vllms_v2_runner_returns_is_the_log_softmaxs():
    """vLLM 0.20's V2 runner computes its sampled, greedy and prompt logprobs in `compute_token_logprobs`
    (one token a row, or the top-k too); installed, it is the trainer's log-softmax at those tokens, for bf16
    (prompt) and fp32 (sampler) logits. On the GPU these are the split kernels' bits (tests/test_gpu.py)."""
    from vllm.v1.worker.gpu.sample import logprob, prompt_logprob, sampler

    from batch_invariant_backward import exact_token_logprobs, install_exact_kernels

    install_exact_kernels()
    for caller in (sampler, prompt_logprob):  # the name each calls resolves to the installed function
        assert caller.compute_topk_logprobs.__globals__["compute_token_logprobs"] is exact_token_logprobs
    g = torch.Generator().manual_seed(0)
    for logits in (torch.randn(7, 300, generator=g).bfloat16(), torch.randn(7, 300, generator=g)):
        ids = torch.randint(0, 300, (7, 3), generator=g)
        expected = logits.float().log_softmax(-1).gather(1, ids)
        for n in (1, 3):
            got = logprob.compute_token_logprobs(logits, ids[:, :n])
            assert got.dtype == torch.float32 and torch.equal(got, expected[:, :n])


def test_the_temperature_divides_as_vllms_v1_sampler_and_the_trainer():
    """`divide_by_temperature`, in place of the V2 runner's Triton kernel: each row divided by its request's
    T as an fp32 tensor (bit for bit `torch.div`, which the trainer runs), a greedy row by 1; a step of T 0 and
    1 only is left alone."""
    from batch_invariant_backward import divide_by_temperature

    states = SimpleNamespace(temperature=Uva([0.7, 0.0, 1.3, 1.0], torch.float32))
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))
    mapping = [0, 1, 2, 3, 0]
    divided = logits.clone()
    divide_by_temperature(states, divided, torch.tensor(mapping), np.array(mapping))
    by = torch.tensor([[0.7], [1.0], [1.3], [1.0], [0.7]])
    assert torch.equal(divided.view(torch.int32), (logits / by).view(torch.int32))
    untouched = logits.clone()
    divide_by_temperature(states, untouched, torch.tensor([1, 3]), np.array([1, 3]))
    assert torch.equal(untouched, logits)


def test_matmul_tiles_fit_in_shared_memory_and_spread_over_the_sms():
    """The tiles tiled_linear picks (their bits are checked on the GPU) for every GEMM of every Qwen3 size,
    at 1 to 32k rows: a tile is a power of 2 of 16 to 256 on a side, its pipeline stages fit an H100 SM's
    shared memory (227 KB, of which Triton's kernel takes up to 32 KB besides the stages: measured by
    compiling it), up to 512 rows it is the power of 2 that holds them, at most 128 (64 for a narrow output),
    its shape gives at least half of the SMs a tile whenever tiles as narrow as 16 columns can, and its
    depth divides K (64 above 512 rows, as vLLM's)."""
    from batch_invariant_backward import matmul_tiles, qwen3_gemms
    from test_gpu import QWEN3_SHAPES

    sms, smem = 132, 227 * 1024
    for dim, hidden_dim, heads, kv_heads in QWEN3_SHAPES.values():
        for n, k in qwen3_gemms(dim, hidden_dim, heads, kv_heads, 128, 151936).values():
            for m in (1, 2, 7, 16, 17, 31, 32, 33, 64, 100, 128, 129, 255, 256, 257, 511, 512, 513, 8192,
                      32768):
                t = matmul_tiles(m, n, k, sms)
                bm, bn, bk, stages = t["BLOCK_SIZE_M"], t["BLOCK_SIZE_N"], t["BLOCK_SIZE_K"], t["num_stages"]
                assert {bm, bn} <= {16, 32, 64, 128, 256} and t["num_warps"] in (4, 8), (m, n, t)
                assert bk in (64, 128, 256) and k % bk == 0 and (m <= 512 or bk == 64), (m, n, k, t)
                # bf16 tiles of A and B, bk deep, one per stage, and Triton's own scratch
                assert (bm + bn) * bk * 2 * stages + 32 * 1024 <= smem, (m, n, t)
                if m <= 512:  # the power of 2 that holds the rows (at most 128); 64 where the rows of
                    # 128 x 128 tiles would not fill half the SMs (and 128 x 256 tiles would not either)
                    power = min(128, max(16, 1 << (m - 1).bit_length()))
                    wide = power == 128 and -(-m // 128) * -(-n // 256) >= sms // 2
                    narrow = power == 128 and not wide and -(-m // 128) * -(-n // 128) < sms // 2
                    assert bm == (64 if narrow else power), (m, n, t)
                if m <= 512 and bn > 16:
                    assert -(-m // bm) * -(-n // bn) >= sms // 2, (m, n, t)


def test_routing_metrics_count_the_training_forwards_tokens():
    """The experts' load and the router's entropy, per layer, over a step's training forwards (not the
    reference policy's or the locator's, which run without gradients); read once, they restart."""
    config = MOE_CONFIGS["moe"]
    args = simple_rl.model_args_from_hf_config(config)
    model = simple_rl.Qwen3(args, EXACT, torch.float32)
    model.load_state_dict(simple_rl.from_hf_state_dict(random_hf_weights(config, seed=2, dtype=torch.float32), args))
    seqs = random_sequences(config["vocab_size"], [12, 30, 5], seed=4)
    batch = simple_rl.pack_sequences([s[:4] for s in seqs], [s[4:] for s in seqs], "cpu")
    with torch.no_grad():
        model(batch)
    assert plumbing.routing_metrics(model, simple_rl.World()) == {}
    model(batch).logprobs.sum().backward()
    model(batch).logprobs.sum().backward()
    assert [int(layer.moe.routed[:-1].sum()) for layer in model.layers] == [2 * 47 * 2] * 2  # tokens x k
    metrics = plumbing.routing_metrics(model, simple_rl.World())
    assert sorted(metrics) == ["expert_load_max_over_mean/layer_00", "expert_load_max_over_mean/layer_01",
                               "router_entropy/layer_00", "router_entropy/layer_01"]
    assert all(1 <= metrics[f"expert_load_max_over_mean/layer_{i:02d}"] <= 6 / 2 for i in range(2))
    assert all(0 < metrics[f"router_entropy/layer_{i:02d}"] <= math.log(6) for i in range(2))
    assert plumbing.routing_metrics(model, simple_rl.World()) == {}


def test_the_tokens_routed_to_other_experts_than_the_samplers_are_counted():
    """`expert_set_differences`: a (token, layer) routing counts when its set of experts differs from the
    sampler's, whatever their order; each sequence's last token, which vLLM never runs, is not compared."""
    config = MOE_CONFIGS["moe"]
    args = simple_rl.model_args_from_hf_config(config)
    model = simple_rl.Qwen3(args, EXACT, torch.float32)
    model.load_state_dict(simple_rl.from_hf_state_dict(random_hf_weights(config, seed=2, dtype=torch.float32), args))
    seqs = random_sequences(config["vocab_size"], [7, 12], seed=4)
    batch = simple_rl.pack_sequences([s[:3] for s in seqs], [s[3:] for s in seqs], "cpu")
    with torch.no_grad():
        model(batch)
    chosen = torch.stack([layer.moe.chosen for layer in model.layers], 1)  # (19, 2 layers, 2)
    sampler = [chosen[:6].flip(-1), chosen[7:18].clone()]  # the same sets, in another order
    assert simple_rl.expert_set_differences(model, batch, sampler).tolist() == [0, 17 * 2]
    sampler[1][4, 1] = torch.tensor([e for e in range(6) if e not in chosen[11, 1].tolist()][:2])  # token 11
    assert simple_rl.expert_set_differences(model, batch, sampler).tolist() == [1, 17 * 2]
    with pytest.raises(RuntimeError, match=r"vLLM returned experts of \(16, 2, 2\)"):
        simple_rl.expert_set_differences(model, batch, [chosen[:5], chosen[7:18]])
