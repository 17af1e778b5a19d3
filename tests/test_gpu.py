"""On the GPU, against the real vLLM 0.20: the trainer's logprob of every sampled token equals
vLLM's bit for bit, whatever the batch, at any temperature, top-k and top-p, and so do its prompt and
greedy logprobs, and requests that share a seed draw as alone; the CUDA-graph engine gives
the eager engine's bits; weights pushed after a sleep are exact; gradients are right (our Triton backwards
too, past int32 offsets; the embedding's, the same bits on every call); the re-tiled matmul gives vLLM's
matmul's bits.
Run with VLLM_BATCH_INVARIANT=1 (the tests refuse to run without it). One engine per model for
this module (freed after it), configured as simple_rl.py configures it (CUDA graphs; sleep mode for the 1.7B
shape: vLLM allows one sleep-mode engine per process)."""

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import qwen3_config, start_engine, write_checkpoint

import batch_invariant_backward
import simple_rl
from batch_invariant_backward import REFERENCE, qk_norm_rotary

pytestmark = pytest.mark.gpu

TINY = qwen3_config(hidden=256, layers=3, heads=4, kv_heads=2, head_dim=128, intermediate=512,
                    vocab=4096, max_positions=2048)  # fmt: skip
QWEN3_1P7B = qwen3_config(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=6144,
                          vocab=151936, max_positions=40960)  # fmt: skip
MEMORY_FRACTION = {"tiny": 0.08, "qwen3-1.7b-shape": 0.40}


@pytest.fixture(scope="session", autouse=True)
def require_batch_invariance():
    assert (os.environ.get("VLLM_BATCH_INVARIANT") == "1"), "run the GPU tests with VLLM_BATCH_INVARIANT=1"


@pytest.fixture(scope="module", params=["qwen3-1.7b-shape", "tiny"])  # freed for the next modules
def served(request, tmp_path_factory):
    """(engine, trainer model, config): a random checkpoint on disk, loaded by both sides."""
    config = TINY if request.param == "tiny" else QWEN3_1P7B
    ckpt = write_checkpoint(tmp_path_factory.mktemp(request.param), config, seed=0, device="cuda")
    # The 1.7B shape's engine is this process's first: it sizes its KV cache as the script's does.
    tiny = request.param == "tiny"
    engine = start_engine(ckpt, MEMORY_FRACTION[request.param], max_model_len=1024, seed=0, sleep_mode=not tiny,
                          kv_cache_gib=2 if tiny else None)
    model = simple_rl.load_qwen3(ckpt, "cuda")
    return engine, model, config, request.param, ckpt


def sample(engine, vocab, n, seed, temperature=1.0, prompt_lens=(20, 400), new_tokens=(64, 256), top_k=0, top_p=1.0):
    """n completions of random prompts (20-400 tokens), 64-256 new tokens each."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(prompt_lens[0], prompt_lens[1] + 1, (n,), generator=g).tolist()
    new_tokens = torch.randint(new_tokens[0], new_tokens[1] + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (L,), generator=g).tolist() for L in prompt_lens]
    completions, logprobs = engine.generate(prompts, new_tokens, temperature=temperature,
                                            seeds=[seed * 100_000 + i for i in range(n)], ignore_eos=True, top_k=top_k,
                                            top_p=top_p)
    return prompts, completions, logprobs


@torch.no_grad()
def trainer_logprobs(model, prompts, completions, order, token_budget, temperature=1.0, top_k=0, top_p=1.0):
    """Recompute in micro-batches packed in `order` up to `token_budget` tokens: compositions
    that have nothing to do with vLLM's scheduling."""
    out, batch = [None] * len(prompts), []
    for i in order + [None]:
        size = sum(len(prompts[j]) + len(completions[j]) for j in batch)
        if batch and (i is None or size + len(prompts[i]) + len(completions[i]) > token_budget):
            packed = simple_rl.pack_sequences([prompts[j] for j in batch], [completions[j] for j in batch], "cuda")
            logprobs = model(packed, temperature, top_k, top_p).logprobs
            for j, lp in zip(batch, logprobs.split(packed.completion_lens)):
                out[j] = lp.cpu()
            batch = []
        if i is not None:
            batch.append(i)
    return out


def count_mismatches(a, b):
    return sum(int((x.view(torch.int32) != y.view(torch.int32)).sum()) for x, y in zip(a, b))


def grpo_sample(engine, vocab, seed, questions=64, group=8, prompt_lens=(20, 700), new_tokens=(64, 256)):
    """GRPO's layout: `group` samples of each of `questions` random prompts, each its own seed and length."""
    g = torch.Generator().manual_seed(seed)
    asked = [torch.randint(0, vocab, (int(n),), generator=g).tolist()
             for n in torch.randint(prompt_lens[0], prompt_lens[1] + 1, (questions,), generator=g)]
    prompts = [p for p in asked for _ in range(group)]
    lengths = torch.randint(new_tokens[0], new_tokens[1] + 1, (len(prompts),), generator=g).tolist()
    completions, logprobs = engine.generate(prompts, lengths, 1.0, [seed * 100_000 + i for i in range(len(prompts))],
                                            ignore_eos=True)
    return prompts, completions, logprobs


@torch.no_grad()
def packed_logprobs(model, prompts, completions, token_budget):
    """Recomputed as simple_rl.py packs a step: in sample order, a prompt's rows once for its samples."""
    out = [None] * len(prompts)
    batches = simple_rl.packed_micro_batches(prompts, completions, token_budget, "cuda")
    assert any(batch.spans.kv_rows is not None for _, batch in batches)  # the prompts laid once
    for idx, batch in batches:
        for j, lp in zip(idx, model(batch).logprobs.split(batch.completion_lens)):
            out[j] = lp.cpu()
    return out


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.6, 20, 0.95), (0.7, 20, 0.8), (1.0, 50, 1.0),
                                                       (1.0, 0, 0.9), (1.3, 0, 0.95)])
def test_logprobs_are_bitwise_vllms_under_top_k_and_top_p(served, temperature, top_k, top_p):
    """Qwen3's recommended sampling and others: vLLM samples from the tempered, truncated distribution and
    returns its logprobs; the trainer masks its fp32 logits with the very kernel the engine runs (pinned at
    every batch size), then takes the same logprob: the same bits. 512 samples of 64-512 new tokens."""
    engine, model, config, name, _ = served
    prompts, completions, vllm_lps = sample(engine, config["vocab_size"], 512, seed=21, temperature=temperature,
                                            new_tokens=(64, 512), top_k=top_k, top_p=top_p)
    order = torch.randperm(512, generator=torch.Generator().manual_seed(22)).tolist()
    ours = trainer_logprobs(model, prompts, completions, order, 16384, temperature, top_k, top_p)
    mismatched = count_mismatches(ours, vllm_lps)
    print(f"\n[{name}] T={temperature} top-k={top_k} top-p={top_p}: {sum(map(len, completions))} sampled tokens, "
          f"{mismatched} differ")
    assert mismatched == 0


def test_top_k_top_p_is_the_same_in_small_and_large_decode_steps(served):
    """vLLM 0.20 masks top-k/top-p with a Triton kernel from 8 rows up and a sort below; simple_rl.py pins
    the Triton kernel at every size. 64 requests of 8 to 512 new tokens: the last decode steps hold fewer
    than 8 sequences. Each of the 8 longest, sampled alone (1-row steps), gets the bits it got in the batch.
    Also printed: how many rows of the batch the sort would mask otherwise (why the pin)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from batch_invariant_backward import tiled_linear, top_k_top_p

    engine, model, config, name, _ = served
    g = torch.Generator().manual_seed(31)
    prompts = [torch.randint(0, config["vocab_size"], (int(n),), generator=g).tolist()
               for n in torch.randint(20, 200, (64,), generator=g)]
    lengths = torch.linspace(8, 512, 64).long().tolist()
    settings = dict(temperature=0.6, top_k=20, top_p=0.95)
    completions, lps = engine.generate(prompts, lengths, seeds=list(range(64)), ignore_eos=True, **settings)
    for i in range(56, 64):
        alone_c, alone_lp = engine.generate([prompts[i]], [lengths[i]], seeds=[i], ignore_eos=True, **settings)
        assert alone_c[0] == completions[i] and torch.equal(alone_lp[0].view(torch.int32), lps[i].view(torch.int32))
    ours = trainer_logprobs(model, prompts, completions, list(range(64)), 16384, 0.6, 20, 0.95)
    assert count_mismatches(ours, lps) == 0
    with torch.no_grad():  # the two implementations on the same logits
        batch = simple_rl.pack_sequences(prompts[:8], completions[:8], "cuda")
        hidden = model.hidden_states(batch.tokens, batch.positions, batch.spans)
        logits = tiled_linear(hidden[batch.target_rows], model.output_weight).float() / 0.6
        k = torch.full((len(logits),), 20, device="cuda", dtype=torch.int32)
        p = torch.full((len(logits),), 0.95, device="cuda")
        triton = top_k_top_p(logits.clone(), k, p) == float("-inf")
        sort = apply_top_k_top_p_pytorch(logits.clone(), k, p) == float("-inf")
    print(f"\n[{name}] kept sets of the sort and the Triton kernel differ on {int((triton != sort).any(-1).sum())} "
          f"of {len(logits)} rows")


def prompt_logprobs(engine, sequences, top=0):
    """vLLM's prompt logprobs of each sequence's tokens after its first (`SamplingParams(prompt_logprobs)`),
    as a user scores sequences with the engine: fp32 (the token's own, also when the top `top` come too)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=top, flat_logprobs=True, detokenize=False)
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
    scored = []
    for sequence, out in zip(sequences, outs):
        flat = out.prompt_logprobs  # position 0: None; each later one its token first, then the top
        at = [flat.token_ids.index(t, a, b) for t, a, b in zip(sequence[1:], flat.start_indices[1:],
                                                                flat.end_indices[1:])]
        scored.append(torch.tensor([flat.logprobs[i] for i in at], dtype=torch.float32))
    return scored


def scored_by_trainer(model, sequences, budget=32768):
    """The trainer's logprob of each sequence's tokens after its first (T = 1), in shuffled batches."""
    order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(0)).tolist()
    return trainer_logprobs(model, [s[:1] for s in sequences], [s[1:] for s in sequences], order, budget)


def test_prompt_and_greedy_logprobs_are_the_trainers(served):
    """Every logprob the exact engine returns is the trainer's, not only those it samples with: prompt
    logprobs of 500 prompts of 20-1,000 tokens (chunked prefill), with the top 5 too; greedy decoding's
    (T = 0: logprobs at T = 1), kept on the GPU and through vLLM's own `logprobs=0`, equal to a second
    pass's prompt logprobs; all again after a changed push."""
    from vllm import SamplingParams, TokensPrompt

    engine, model, config, name, _ = served
    g, vocab = torch.Generator().manual_seed(71), config["vocab_size"]
    prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(20, 1001, (500,), generator=g)]
    short = [p[:700] for p in prompts]  # 500 x 256 new tokens fit the engine's 1,024
    for pushed in (False, True):
        if pushed:  # weights changed and pushed as the script pushes them (the tiny engine, without sleep
            with torch.no_grad():  # mode, stays awake: its sleep and wake do nothing)
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            engine.sleep()
            engine.sync_weights(model, simple_rl.World(), changed=True)
        ours = scored_by_trainer(model, prompts)
        for top in (0, 5):
            mismatched = count_mismatches(ours, prompt_logprobs(engine, prompts, top))
            print(f"\n[{name}{', pushed' if pushed else ''}] prompt logprobs (top {top}): "
                  f"{sum(map(len, ours))} tokens, {mismatched} differ")
            assert mismatched == 0
        completions, kept = engine.generate(short, [256] * len(short), 0.0, [None] * len(short), ignore_eos=True)
        params = SamplingParams(temperature=0.0, max_tokens=256, logprobs=0, flat_logprobs=True, detokenize=False,
                                ignore_eos=True)
        outs = [o.outputs[0] for o in engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in short], params,
                                                          use_tqdm=False)]
        assert [list(o.token_ids) for o in outs] == completions
        own = [torch.tensor(o.logprobs.logprobs, dtype=torch.float32) for o in outs]
        order = torch.randperm(len(short), generator=g).tolist()
        trainer = trainer_logprobs(model, short, completions, order, 16384)
        rescored = prompt_logprobs(engine, [p + c for p, c in zip(short, completions)])
        second = [lp[len(p) - 1:] for p, lp in zip(short, rescored)]  # the completions' tokens
        counts = [count_mismatches(kept, x) for x in (own, trainer, second)]
        print(f"[{name}{', pushed' if pushed else ''}] greedy: {sum(map(len, completions))} tokens; kept on the GPU "
              f"differ from vLLM's own, the trainer's, a second pass's on {counts}")
        assert counts == [0, 0, 0]


def test_requests_sharing_a_seed_each_draw_as_alone(served):
    """vLLM keys a request's noise by its seed and position: two requests with one seed and one prompt
    draw the same tokens (and logprobs); with other prompts, each draws what it draws alone. None draws
    from vLLM's own seed. The logprobs kept are each request's own, the trainer's."""
    engine, model, config, name, _ = served
    g = torch.Generator().manual_seed(81)
    prompts = [torch.randint(0, config["vocab_size"], (int(n),), generator=g).tolist()
               for n in torch.randint(20, 400, (128,), generator=g)]
    prompts, seeds = prompts + prompts[:64], [7] * 192  # requests 128-191 repeat 0-63
    completions, lps = engine.generate(prompts, [128] * 192, 1.0, seeds, ignore_eos=True)
    assert completions[128:] == completions[:64] and count_mismatches(lps[128:], lps[:64]) == 0
    assert len({tuple(c) for c in completions[:128]}) == 128
    for i in (0, 64, 127):
        alone, alone_lps = engine.generate([prompts[i]], [128], 1.0, [7], ignore_eos=True)
        assert alone == [completions[i]] and count_mismatches(alone_lps, [lps[i]]) == 0
    unseeded, unseeded_lps = engine.generate(prompts[:64], [128] * 64, 1.0, [None] * 64, ignore_eos=True)
    order = list(range(192))
    assert count_mismatches(trainer_logprobs(model, prompts, completions, order, 16384), lps) == 0
    assert count_mismatches(trainer_logprobs(model, prompts[:64], unseeded, order[:64], 16384), unseeded_lps) == 0


def served_rotary_table(engine) -> torch.Tensor:
    return engine.llm.apply_model(lambda served: served.model.layers[0].self_attn.rotary_emb.cos_sin_cache.cpu())[0]


def test_rotary_table_matches_vllm(served):
    engine, model, *_ = served
    table = served_rotary_table(engine)  # both in fp32 (vLLM's op reads fp32), with bf16 values
    assert table.dtype == model.cos_sin_cache.dtype == torch.float32
    assert torch.equal(table, table.bfloat16().float())
    assert torch.equal(table.view(torch.int32), model.cos_sin_cache.cpu().view(torch.int32))


def test_the_engine_norms_and_rotates_q_and_k_in_one_kernel(served, monkeypatch):
    """vLLM's Qwen3 attention runs `qk_norm_rotary` (the installed forward, not vLLM's fallback), once per
    layer and call: a prefill (eager; the decode steps replay CUDA graphs captured through the same code)."""
    engine, _, config, *_ = served
    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return qk_norm_rotary(*args)
    monkeypatch.setattr(batch_invariant_backward, "qk_norm_rotary", counted)
    sample(engine, config["vocab_size"], 2, seed=7, prompt_lens=(300, 300), new_tokens=(2, 2))
    layers = config["num_hidden_layers"]
    assert len(calls) >= layers and len(calls) % layers == 0 and sum(calls) >= 600 * layers  # no layer skipped


def test_samples_sharing_a_prompt_are_bitwise_vllms(served):
    """GRPO's batch, 64 prompts of 20-700 tokens (chunked prefill) x 8 samples of 64-256 new tokens: vLLM
    prefills a prompt once for its samples (its prefix cache), the trainer lays it once for them (each
    sample's attention reads its rows): every sampled token's logprob the same bits, in micro-batches of 4,096
    and 32,768 tokens. Then the weights changed and pushed (the tiny engine awake, the 1.7B shape through a
    sleep) and the same prompts again: no sample reads the old weights' cached keys."""
    engine, model, config, name, _ = served
    for pushed in (False, True):
        if pushed:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            engine.sleep()
            engine.sync_weights(model, simple_rl.World(), changed=True)
        prompts, completions, vllm_lps = grpo_sample(engine, config["vocab_size"], seed=91)
        for budget in (4096, 32768):
            mismatched = count_mismatches(packed_logprobs(model, prompts, completions, budget), vllm_lps)
            print(f"\n[{name}{', pushed' if pushed else ''}] {len(prompts)} samples sharing prompts, budget {budget}: "
                  f"{sum(map(len, completions))} sampled tokens, {mismatched} differ")
            assert mismatched == 0


def test_every_sampled_token_logprob_is_bitwise_vllms(served):
    engine, model, config, name, _ = served
    n = 512
    prompts, completions, vllm_lps = sample(engine, config["vocab_size"], n, seed=1)
    total = sum(len(c) for c in completions)
    g = torch.Generator().manual_seed(2)
    for budget in (4096, 32768):
        order = torch.randperm(n, generator=g).tolist()
        ours = trainer_logprobs(model, prompts, completions, order, budget)
        mismatched = count_mismatches(ours, vllm_lps)
        print(f"\n[{name}] {n} samples, {total} sampled tokens, trainer batches of <= {budget} tokens "
              f"in shuffled order: {mismatched} tokens differ")  # fmt: skip
        assert mismatched == 0
    # The same sequence alone gives the very bits it gets inside a batch.
    for i in range(0, n, 64):
        alone = trainer_logprobs(model, prompts[i:i + 1], completions[i:i + 1], [0], 1 << 30)[0]
        assert torch.equal(alone.view(torch.int32), vllm_lps[i].view(torch.int32))


def test_logprobs_kept_on_the_gpu_are_the_trainers_and_vllms_tokens(served):
    """simple_rl.py takes the sampled tokens' logprobs off the GPU as the sampler draws them (`SAMPLED`), not
    from vLLM's per-request lists: the trainer's bits, and the same requests through vLLM's own path
    (`logprobs=0`) draw the same tokens. 300 requests, prompts of 20-700 tokens (chunked prefill: a prompt
    chunk's draw is discarded), up to 256 new tokens, T = 0.7 with top-k/p, a stop token in 500 (async
    scheduling may draw once past a stop)."""
    from vllm import SamplingParams, TokensPrompt

    engine, model, config, name, _ = served
    g, n, vocab = torch.Generator().manual_seed(41), 300, config["vocab_size"]
    prompts = [torch.randint(0, vocab, (int(length),), generator=g).tolist()
               for length in torch.randint(20, 701, (n,), generator=g)]
    stops, seeds = torch.randperm(vocab, generator=g)[: vocab // 500].tolist(), [41_000 + i for i in range(n)]
    settings = dict(temperature=0.7, top_k=20, top_p=0.95, stop_token_ids=stops)
    completions, kept = engine.generate(prompts, [256] * n, seeds=seeds, **settings)
    params = [SamplingParams(max_tokens=256, seed=s, logprobs=0, flat_logprobs=True, detokenize=False, **settings)
              for s in seeds]
    outs = [o.outputs[0] for o in engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                                      use_tqdm=False)]
    lengths = [len(c) for c in completions]
    print(f"\n[{name}] {sum(lengths)} tokens; {sum(x < 256 for x in lengths)} of {n} completions stopped early")
    assert [list(o.token_ids) for o in outs] == completions and 0 < sum(x < 256 for x in lengths) < n
    order = torch.randperm(n, generator=g).tolist()
    assert count_mismatches(trainer_logprobs(model, prompts, completions, order, 16384, 0.7, 20, 0.95), kept) == 0


def test_logprobs_kept_on_the_gpu_survive_preemption(tmp_path):
    """A KV cache of about 3,500 tokens for 64 requests of up to 656: vLLM preempts requests and recomputes
    them (a request's noise is keyed by its position, so a recompute draws where it left off).
    The tokens are those of vLLM's own path, the logprobs kept on the GPU the trainer's, bit for bit."""
    from vllm import SamplingParams, TokensPrompt

    ckpt = write_checkpoint(tmp_path, TINY, seed=3, device="cuda")
    engine = start_engine(ckpt, 0.05, max_model_len=1024, seed=0, sleep_mode=False, kv_cache_gib=0.01)
    scheduler, preempted = engine.llm.llm_engine.engine_core.engine_core.scheduler, []
    preempt = scheduler._preempt_request
    scheduler._preempt_request = lambda request, *args: preempted.append(request) or preempt(request, *args)
    g, n = torch.Generator().manual_seed(51), 64
    prompts = [torch.randint(0, TINY["vocab_size"], (int(length),), generator=g).tolist()
               for length in torch.randint(20, 401, (n,), generator=g)]
    seeds = [51_000 + i for i in range(n)]
    completions, kept = engine.generate(prompts, [256] * n, 1.0, seeds, ignore_eos=True)
    recorded_preemptions = len(preempted)
    params = [SamplingParams(temperature=1.0, max_tokens=256, seed=s, logprobs=0, flat_logprobs=True,
                             detokenize=False, ignore_eos=True) for s in seeds]
    outs = [o.outputs[0] for o in engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                                      use_tqdm=False)]
    print(f"\n[tiny, 0.01 GiB of KV cache] {recorded_preemptions} preemptions while recording, "
          f"{len(preempted) - recorded_preemptions} on vLLM's own path")
    assert recorded_preemptions > 0 and [list(o.token_ids) for o in outs] == completions
    model = simple_rl.load_qwen3(ckpt, "cuda")
    assert count_mismatches(trainer_logprobs(model, prompts, completions, list(range(n)), 16384), kept) == 0


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_logprobs_are_bitwise_vllms_at_other_temperatures(served, temperature):
    """vLLM samples from softmax(z / T) and returns that distribution's logprobs (processed logprobs);
    the trainer divides its fp32 logits by T the same way: the same bits."""
    engine, model, config, name, _ = served
    prompts, completions, vllm_lps = sample(engine, config["vocab_size"], 512, seed=7, temperature=temperature)
    order = torch.randperm(512, generator=torch.Generator().manual_seed(8)).tolist()
    ours = trainer_logprobs(model, prompts, completions, order, 16384, temperature)
    mismatched = count_mismatches(ours, vllm_lps)
    print(f"\n[{name}] T={temperature}: {sum(map(len, completions))} sampled tokens, {mismatched} differ")
    assert mismatched == 0


def test_the_locator_names_each_injected_divergence(served):
    """With nothing injected, every intermediate tensor of a 300-token prefill, up to the logits, is
    bitwise vLLM's; each injected divergence is named at its layer and op."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import layernorm

    engine, model, config, name, _ = served
    tokens = torch.randint(0, config["vocab_size"], (300,), generator=torch.Generator().manual_seed(9)).tolist()

    def locate() -> str:
        return simple_rl.find_first_divergence(engine, model, tokens)

    assert locate().startswith("no intermediate tensor differs up to the logits")
    ffn = model.layers[1].feed_forward
    kernels = ffn.kernels
    # On Hopper both sides' linears are cuBLAS bf16 GEMMs; this one is cuBLAS's fp32 GEMM, rounded.
    fp32_linear = lambda x, w: torch.nn.functional.linear(x.float(), w.float()).to(x.dtype)  # noqa: E731
    ffn.kernels = dataclasses.replace(kernels, linear=fp32_linear)
    try:
        assert locate().startswith("layer 1 gate_up: ")
    finally:
        ffn.kernels = kernels
    table = model.cos_sin_cache.clone()
    half = model.args.head_dim // 2
    inv_freq = (1.0 / model.args.rope_theta ** (torch.arange(0, half, device="cuda") / half)).bfloat16()
    angles = torch.arange(len(table), device="cuda").bfloat16()[:, None] * inv_freq  # in bf16, not fp32
    model.cos_sin_cache.copy_(torch.cat([angles.cos(), angles.sin()], dim=-1))
    try:
        assert locate().startswith("layer 0 rotary: ")
    finally:
        model.cos_sin_cache.copy_(table)
    replacement = layernorm.fused_add_rms_norm

    def vllms_own_fused_add_rms_norm(x, residual, weight, eps):  # what simple_rl.py replaces
        ops.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual

    layernorm.fused_add_rms_norm = vllms_own_fused_add_rms_norm
    try:
        message = locate()
    finally:
        layernorm.fused_add_rms_norm = replacement
    print(f"\n[{name}] vLLM's own fused add+RMSNorm: {message}")
    # The first fused add+norm is layer 0's ffn_norm; where its bits first part depends on the data.
    assert re.match(r"layer \d+ (ffn_norm|attention_norm): ", message), message


def test_cuda_graph_engine_gives_the_eager_bits(served):
    """The same 512 requests through an eager engine: the same tokens and the same logprob bits."""
    engine, model, config, name, ckpt = served
    if name != "tiny":
        pytest.skip("one eager engine is enough: the parity test covers both shapes with graphs")
    eager = start_engine(ckpt, MEMORY_FRACTION[name], max_model_len=1024, seed=0, cuda_graphs=False,
                         sleep_mode=False, kv_cache_gib=2)
    eager.push_weights(model)  # the weights `engine` serves: earlier tests may have pushed changed ones
    eager.check_weights(model, simple_rl.World())
    assert eager.served_checksum == engine.weights_checksum()
    prompts, graph_completions, graph_lps = sample(engine, config["vocab_size"], 512, seed=6)
    _, eager_completions, eager_lps = sample(eager, config["vocab_size"], 512, seed=6)
    assert graph_completions == eager_completions
    assert count_mismatches(graph_lps, eager_lps) == 0
    print(f"\n[{name}] graphs vs eager: {sum(map(len, graph_completions))} sampled tokens, identical bits")


def test_sleep_then_push_is_exact_and_served(served):
    """The script's cycle: vLLM sleeps (weights and KV cache discarded), the trainer's weights
    change, `sync_weights` wakes vLLM and pushes them; vLLM then samples with exactly those weights."""
    engine, model, config, name, _ = served
    if name == "tiny":
        pytest.skip("the sleep-mode engine of this process is the 1.7B-shape one")
    before = engine.weights_checksum()
    assert before == simple_rl.trainer_checksum(model, simple_rl.World())
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    freed = (torch.cuda.mem_get_info()[0] - free_awake) / 2**30
    weights = sum(p.numel() * 2 for p in model.parameters()) / 2**30
    print(f"\n[{name}] sleep freed {freed:.1f} GiB ({MEMORY_FRACTION[name]} of the GPU requested, "
          f"weights {weights:.1f} GiB)")
    assert freed > weights + 1  # the weights and a KV cache
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    engine.sync_weights(model, simple_rl.World(), changed=True)
    after = engine.served_checksum
    assert after != before and after == simple_rl.trainer_checksum(model, simple_rl.World())
    table = served_rotary_table(engine)  # a buffer: vLLM saves and restores it around a level-2 sleep
    assert torch.equal(table.view(torch.int32), model.cos_sin_cache.cpu().view(torch.int32))
    prompts, completions, vllm_lps = sample(engine, config["vocab_size"], 512, seed=3)
    ours = trainer_logprobs(model, prompts, completions, list(range(512)), 16384)
    assert count_mismatches(ours, vllm_lps) == 0


def relative_error(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("entropy_coef", [0.01, 0.0])  # 0: lm_head's backward without the entropy term
def test_gradients_match_autograd_within_bf16_tolerance(served, entropy_coef):
    """Trainer (vLLM forward kernels, hand-written backwards, bf16) against plain-PyTorch autograd:
    its error to the fp32 reference is no worse than plain bf16 autograd's own error to it. Samples share
    their prompts' rows, as a GRPO step packs them."""
    _, model, config, name, _ = served
    args = model.args
    if name != "tiny":
        args = dataclasses.replace(args, n_layers=2)  # the 1.7B shape, 2 layers
    weights = {k: v for k, v in model.state_dict().items() if not k.startswith("layers.") or int(k.split(".")[1]) < args.n_layers}
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, args.vocab_size, (n,), generator=g).tolist() for n in (300, 17, 257, 120)]
    grads = {}
    for label, kernels, dtype in (("exact", model.kernels, torch.bfloat16), ("bf16", REFERENCE, torch.bfloat16),
                                  ("fp32", REFERENCE, torch.float32)):  # fmt: skip
        with torch.device("cuda"):
            m = simple_rl.Qwen3(args, kernels, dtype)
        m.load_state_dict(weights)
        # two prompts of two samples each, laid once (each later sample's attention reads them)
        prompts = [seqs[0][:200], seqs[0][:200], seqs[2][:100], seqs[2][:100]]
        batch = simple_rl.pack_sequences(prompts, [seqs[0][200:], seqs[1], seqs[2][100:], seqs[3]], "cuda")
        assert batch.spans.kv_rows is not None
        out = m(batch)
        loss = out.logprobs.sum() / len(out.logprobs)
        (loss + entropy_coef * out.entropy.mean() if entropy_coef else loss).backward()
        grads[label] = {n: p.grad for n, p in m.named_parameters()}
    for n in grads["fp32"]:
        err = relative_error(grads["exact"][n], grads["fp32"][n])
        baseline = relative_error(grads["bf16"][n], grads["fp32"][n])
        assert err <= 2 * baseline + 1e-3, f"{n}: {err:.2e} vs plain bf16 autograd {baseline:.2e}"
    worst = max(relative_error(grads["exact"][n], grads["fp32"][n]) for n in grads["fp32"])
    print(f"\n[{name}] worst gradient relative error vs fp32 autograd: {worst:.2e}")


def test_the_fused_ops_give_the_unfused_ops_gradient_sums_bit_for_bit():
    """The residual adds fused into the norms (both passes), the embedding's gradient added to its fp32 sum
    in its kernel, and q's and k's norms and rotation in one kernel give the logprobs, the entropies and every
    parameter's fp32 gradient sum (`main_grad`, as `MasterWeights` keeps it) bit for bit as a bf16 add before
    each norm, the embedding's bf16 gradient folded after the backward, and the two norms and vLLM's rotary op
    apart give them: the 1.7B shape (4 layers, tied), 3 micro-batches of ~8k tokens."""
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    from batch_invariant_backward import EXACT, BatchInvariantRMSNorm, Embedding

    def vllms_rotary(q, k, positions, table):  # on copies, viewed (T, heads * D) as vLLM's layer hands them
        (T, _, D), (q, k) = q.shape, (t.clone(memory_format=torch.contiguous_format) for t in (q, k))
        torch.ops._C.rotary_embedding(positions, q.view(T, -1), k.view(T, -1), D, table, True)
        return q, k

    class Rotary(torch.autograd.Function):  # vLLM's rotary op; backward: the op with the sines negated
        @staticmethod
        def forward(ctx, q, k, positions, table):
            ctx.save_for_backward(positions, table)
            return vllms_rotary(q, k, positions, table)

        @staticmethod
        def backward(ctx, grad_q, grad_k):
            positions, table = ctx.saved_tensors
            cos, sin = table.chunk(2, dim=-1)
            return *vllms_rotary(grad_q, grad_k, positions, torch.cat((cos, -sin), dim=-1)), None, None

    def unfused_qk_norm_rotary(q, k, q_weight, k_weight, eps, positions, table):
        q, k = BatchInvariantRMSNorm.apply(q, q_weight, eps), BatchInvariantRMSNorm.apply(k, k_weight, eps)
        return Rotary.apply(q, k, positions, table)

    def unfused_norm(x, weight, eps, residual=None):
        if residual is None:
            return BatchInvariantRMSNorm.apply(x, weight, eps)
        summed = x + residual
        return BatchInvariantRMSNorm.apply(summed, weight, eps), summed

    def unfused_embedding(tokens, weight):  # a view has no main_grad: the bf16 gradient, folded after it
        return Embedding.apply(tokens, weight.view_as(weight))

    args = simple_rl.model_args_from_hf_config(dict(QWEN3_1P7B, num_hidden_layers=4))
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, args.vocab_size, (int(n),), generator=g).tolist()
            for n in torch.randint(100, 900, (48,), generator=g)]
    batches = [simple_rl.pack_sequences([s[:60] for s in part], [s[60:] for s in part], "cuda")
               for part in (seqs[:16], seqs[16:32], seqs[32:])]
    weights, results = None, []
    unfused = dataclasses.replace(EXACT, rms_norm=unfused_norm, embedding=unfused_embedding,
                                  qk_norm_rotary=unfused_qk_norm_rotary)
    for kernels in (EXACT, unfused):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = simple_rl.Qwen3(args, kernels)
        if weights is None:
            for p in model.parameters():
                p.data.normal_(0, 0.02) if p.dim() == 2 else p.data.normal_(1, 0.1)
            weights = model.state_dict()
        model.load_state_dict(weights)
        masters = simple_rl.MasterWeights(model, lr=1e-6, weight_decay=0.0)
        masters.zero_grads()
        outputs = []
        for batch in batches:
            out = model(batch, 0.7)
            (out.logprobs.sum() / 1000 + 0.01 * out.entropy.mean()).backward()
            masters.accumulate_grads()
            outputs += [out.logprobs.detach(), out.entropy.detach()]
        results.append(outputs + [p.main_grad for _, p in masters.named])
        del model, masters
    for a, b in zip(*results):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    print(f"\n[fused ops] {len(results[0]) - 6} gradient sums and 3 micro-batches' logprobs bit for bit")


def test_triton_backwards_round_once_and_reach_past_int32_offsets():
    """Our Triton backwards on the GPU against float64 PyTorch, each within one bf16 unit in the last place:
    SwiGLU's at the 1.7B shape's width, and lm_head's logprob gradient over 14,200 rows of the whole vocabulary
    (2.16e9 elements), checked on its last rows, whose offsets pass 2^31."""
    from batch_invariant_backward import logprob_grad, silu_and_mul_reference, swiglu_backward

    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(4096, 2 * 6144, device="cuda", generator=g, dtype=torch.bfloat16)
    grad_out = torch.randn(4096, 6144, device="cuda", generator=g, dtype=torch.bfloat16)
    x = gate_up.double().requires_grad_()
    (silu_and_mul_reference(x) * grad_out.double()).sum().backward()
    torch.testing.assert_close(swiglu_backward(grad_out, gate_up).double(), x.grad, rtol=2**-7, atol=1e-5)
    rows, vocab = 14_200, 151_936
    logits = torch.randn(rows, vocab, device="cuda", generator=g, dtype=torch.bfloat16).mul_(3)
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    weights = torch.randn(rows, device="cuda", generator=g)
    grad = logprob_grad(logits, targets, weights, 0.7)
    last = slice(rows - 4, rows)
    assert (rows - 4) * vocab > 2**31
    # The reference runs on the CPU: once an engine is up, vLLM's batch-invariant log_softmax (fp32 only)
    # serves aten's on CUDA.
    z = logits[last].double().cpu().requires_grad_()
    logprobs = torch.log_softmax(z / 0.7, -1).gather(-1, targets[last, None].cpu()).squeeze(-1)
    (logprobs * weights[last].double().cpu()).sum().backward()
    torch.testing.assert_close(grad[last].double().cpu(), z.grad, rtol=2**-7, atol=1e-9)


def test_the_checksum_kernel_gives_the_cpus_checksum():
    """`tensor_checksum` on the GPU (a Triton kernel a tensor) is the CPU's, bit for bit: any bit patterns, bf16
    and fp32, an embedding's 151,936 x 2,048 (past 2^31 weighted places), odd widths, a norm's 1-D weight, an
    empty tensor; and FSDP2's shards of a weight on the GPU (a fake process group standing for each rank's)
    add up to the whole's, modulo 2^64."""
    from batch_invariant_backward import tensor_checksum

    g = torch.Generator().manual_seed(0)

    def bits(*shape, dtype=torch.bfloat16):  # every int16 pattern possible, NaNs and infinities too
        return torch.randint(-2**15, 2**15, shape, generator=g, dtype=torch.int16).view(dtype)
    weights = {"tok_embeddings.weight": bits(151_936, 2048), "w13": bits(3, 24, 777),
               "norm.weight": bits(2048), "fp32": bits(130, 2 * 33, dtype=torch.int16).view(torch.float32),
               "empty": bits(0, 5)}
    for name, w in weights.items():
        assert int(tensor_checksum(name, w.cuda())) == int(tensor_checksum(name, w)), name
    # The shards in a process of their own: an engine test before this one leaves vLLM's default process group
    # in this process, and the fake group of each rank would be a second.
    shards = textwrap.dedent("""
        import torch
        from conftest import checksums_of_shards
        from batch_invariant_backward import tensor_checksum
        g = torch.Generator().manual_seed(0)
        rows = torch.randint(-2**15, 2**15, (7, 5), generator=g, dtype=torch.int16).view(torch.bfloat16)
        for ranks in (2, 3, 8):
            whole = int(tensor_checksum("w", rows)) % 2**64
            assert sum(checksums_of_shards(rows, ranks, "cuda")) % 2**64 == whole, f"{ranks} shards"
        """)
    subprocess.run([sys.executable, "-c", shards], cwd=Path(__file__).parent, check=True)


def test_weight_grad_adds_each_product_to_the_fp32_sum_where_it_lies():
    """`weight_grad` given a weight's fp32 sum (`MasterWeights.main_grad`, one GPU): cuBLAS adds dy^T @ x of
    each micro-batch to it in place (its out= is the sum itself), to fp32 rounding of float64 (on the CPU),
    the same bits on every call, and returns nothing; without a sum, the bf16 product."""
    from batch_invariant_backward import weight_grad

    g = torch.Generator(device="cuda").manual_seed(0)
    dys = [torch.randn(4096, 1024, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2)]
    xs = [torch.randn(4096, 2048, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2)]
    weight, sums = torch.empty(1024, 2048, device="cuda", dtype=torch.bfloat16), []
    for _ in range(3):
        weight.main_grad = torch.zeros(1024, 2048, device="cuda")
        address = weight.main_grad.data_ptr()
        assert all(weight_grad(weight, dy, x) is None for dy, x in zip(dys, xs))
        assert weight.main_grad.data_ptr() == address
        sums.append(weight.main_grad)
    expected = sum(dy.cpu().double().t() @ x.cpu().double() for dy, x in zip(dys, xs))
    assert relative_error(sums[0].cpu().double(), expected) < 1e-5  # bf16 products rounded: ~1e-3
    assert torch.equal(sums[0], sums[1]) and torch.equal(sums[0], sums[2])
    weight.main_grad = None
    assert weight_grad(weight, dys[0], xs[0]).dtype == torch.bfloat16


def test_rms_norm_backward_has_the_same_bits_on_every_call():
    """`rms_norm_backward` on the GPU at the 1.7B shape's micro-batch (8,192 tokens of 2,048, and its q heads
    read in place from the q/k/v projection's output): dx and dw within one bf16 unit in the last place of
    float64 autograd, and the same bits on 5 calls; with the sum's gradient from above given, dx the bits of
    PyTorch's bf16 add of it to the dx without, and dw unchanged."""
    from batch_invariant_backward import rms_norm_backward, rms_norm_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(8192, 32 * 128, device="cuda", generator=g, dtype=torch.bfloat16)
    for x in (torch.randn(8192, 2048, device="cuda", generator=g, dtype=torch.bfloat16) * 3,
              qkv[:, : 16 * 128].view(8192, 16, 128)):
        w = 1 + 0.1 * torch.randn(x.shape[-1], device="cuda", generator=g, dtype=torch.bfloat16)
        dy = torch.randn(x.shape, device="cuda", generator=g, dtype=torch.bfloat16)
        grad_x, grad_w = rms_norm_backward(dy, x, w, 1e-6)
        for _ in range(5):
            again = rms_norm_backward(dy, x, w, 1e-6)
            assert torch.equal(again[0], grad_x) and torch.equal(again[1], grad_w)
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        (rms_norm_reference(x64, w64, 1e-6) * dy.double()).sum().backward()
        torch.testing.assert_close(grad_x.double(), x64.grad, rtol=2**-7, atol=1e-5)
        torch.testing.assert_close(grad_w.double(), w64.grad, rtol=2**-7, atol=1e-3)
        if x.dim() == 2:  # a residual sum's norm
            ds = torch.randn(x.shape, device="cuda", generator=g, dtype=torch.bfloat16)
            added, same_w = rms_norm_backward(dy, x, w, 1e-6, ds)
            assert torch.equal(added.view(torch.int16), (grad_x + ds).view(torch.int16))
            assert torch.equal(same_w, grad_w)


def test_embedding_gradient_has_the_same_bits_on_every_call():
    """The embedding's gradient (`embedding_grad`) at Qwen3-1.7B's size over a micro-batch of 16,384 positions
    whose tokens follow a Zipf law (the likeliest at over a thousand positions, most of the vocabulary at none):
    the same bits on 20 calls, within one bf16 unit in the last place (or 1e-4) of a float64 sum; added in its
    kernel to an fp32 sum, the bits of PyTorch's fp32 + bf16 add. It prints how many of 20 calls of PyTorch's
    own kernel gave other bits than its first."""
    from batch_invariant_backward import embedding_grad

    g = torch.Generator().manual_seed(0)
    vocab, dim, positions = 151_936, 2048, 16_384
    zipf = torch.arange(1, vocab + 1, dtype=torch.float64) ** -1.1
    tokens = torch.multinomial(zipf, positions, replacement=True, generator=g)
    grad_out = torch.randn(positions, dim, generator=g).bfloat16()
    assert tokens.bincount().max() > 1000
    exact = torch.zeros(vocab, dim, dtype=torch.float64).index_add_(0, tokens, grad_out.double())
    grad_out, tokens = grad_out.cuda(), tokens.cuda()
    first = embedding_grad(grad_out, tokens, vocab)
    assert all(torch.equal(embedding_grad(grad_out, tokens, vocab), first) for _ in range(20))
    torch.testing.assert_close(first.double().cpu(), exact, rtol=2**-8, atol=1e-4)
    main_grad = torch.randn(vocab, dim, device="cuda")
    folded = main_grad.clone()
    assert embedding_grad(grad_out, tokens, vocab, folded) is None
    assert torch.equal(folded.view(torch.int32), (main_grad + first).view(torch.int32))
    pytorchs = lambda: torch.ops.aten.embedding_dense_backward(grad_out, tokens, vocab, -1, False)
    first = pytorchs()
    differ = sum(not torch.equal(pytorchs(), first) for _ in range(20))
    print(f"\n[embedding] PyTorch's embedding_dense_backward: {differ} of 20 repeats gave other bits")


QWEN3_SHAPES = {  # hidden, intermediate, query heads, key/value heads (head_dim 128, vocabulary 151936)
    "0.6b": (1024, 3072, 16, 8), "1.7b": (2048, 6144, 16, 8), "4b": (2560, 9728, 32, 8),
    "8b": (4096, 12288, 32, 8), "14b": (5120, 17408, 40, 8), "32b": (5120, 25600, 64, 8),
}
ROWS = (1, 2, 3, 7, 16, 17, 31, 32, 33, 64, 100, 127, 128, 129, 255, 256, 257, 511, 1000, 2047, 2049, 4097,
        8191, 8192, 16383, 32768)


def test_tiled_linear_is_bitwise_vllms_matmul():
    """Every linear of the Qwen3 sizes the script serves (merged q/k/v, o_proj, merged gate/up, down_proj,
    lm_head), at row counts from 1 to 32k, odd ones included: `tiled_linear`, with the tiles it picks for
    each, gives exactly the bits of vLLM 0.20's `matmul_persistent` (its fixed 128 x 128 tiles)."""
    from vllm.model_executor.layers.batch_invariant import matmul_persistent

    from batch_invariant_backward import _num_sms, matmul_tiles, qwen3_gemms, tiled_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    tiles_used, products = set(), 0
    for name, (d, i, h, kv) in QWEN3_SHAPES.items():
        for gemm, (n, k) in qwen3_gemms(d, i, h, kv, 128, 151936).items():
            w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
            for m in ROWS if gemm != "lm_head" else [m for m in ROWS if m <= 8192]:
                x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
                ours, vllms = tiled_linear(x, w), matmul_persistent(x, w.t())
                differ = int((ours.view(torch.int16) != vllms.view(torch.int16)).sum())
                assert differ == 0, f"Qwen3-{name} {gemm} (N={n}, K={k}) at M={m}: {differ} elements differ"
                tiles_used.add(tuple(matmul_tiles(m, n, k, _num_sms(x.device)).values()))
                products += 1
    print(f"\n[tiled_linear] {products} products, bitwise vLLM's, with {len(tiles_used)} tile shapes: "
          f"{sorted(tiles_used)}")


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of two same-dtype tensors differ in a bit (NaN payloads included)."""
    as_int = {2: torch.int16, 4: torch.int32}[a.element_size()]
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    return int((a.contiguous().view(as_int) != b.contiguous().view(as_int)).sum())


def test_rms_norm_rows_is_bitwise_vllms_norm_and_the_add_before_it():
    """`rms_norm_rows`, which simple_rl.py installs in the engine for every norm: for every Qwen3 width and
    the demo model's, at row counts from 1 to 32k, its norm of a row, its fused add + norm, and its norm of
    the q and k heads read in place in the qkv projection's output give exactly the bits of vLLM 0.20's
    `rms_norm_batch_invariant` after a bf16 add, and of the add itself."""
    from vllm.model_executor.layers.batch_invariant import rms_norm_batch_invariant

    from batch_invariant_backward import rms_norm_rows

    g, eps, checked = torch.Generator(device="cuda").manual_seed(0), 1e-6, 0
    shapes = {name: (d, h, kv, 128) for name, (d, _, h, kv) in QWEN3_SHAPES.items()} | {"demo": (256, 4, 2, 64)}
    for name, (d, h, kv, hd) in shapes.items():  # offline_demo.py's model: 256 wide, heads of 64
        w, w_head = (1 + 0.1 * torch.randn(d + hd, device="cuda", generator=g)).bfloat16().split([d, hd])
        for m in ROWS:
            x = (torch.randn(m, d, device="cuda", generator=g) * 4).bfloat16()
            r = (torch.randn(m, d, device="cuda", generator=g) * 40).bfloat16()  # a residual stream grows
            assert bits_differ(rms_norm_rows(x, w, eps), rms_norm_batch_invariant(x, w, eps)) == 0, (name, m)
            out, summed = rms_norm_rows(x, w, eps, r)
            assert bits_differ(summed, x + r) == 0, (name, m)
            assert bits_differ(out, rms_norm_batch_invariant(x + r, w, eps)) == 0, (name, m)
            qkv = torch.randn(m, (h + 2 * kv) * hd, device="cuda", generator=g).bfloat16()
            q, k, _ = qkv.split([h * hd, kv * hd, kv * hd], dim=-1)
            for heads in (q.view(m, h, hd), k.view(m, kv, hd)):  # strided views, as vLLM's Qwen3 norms them
                assert bits_differ(rms_norm_rows(heads, w_head, eps),
                                   rms_norm_batch_invariant(heads, w_head, eps)) == 0, (name, m)
            checked += 1
        assert bits_differ(rms_norm_rows(x[0], w, eps), rms_norm_batch_invariant(x[0], w, eps)) == 0, name  # 1-D
    print(f"\n[rms_norm_rows] {checked} (shape, rows) pairs, norm, add + norm and q/k heads bitwise vLLM's")


def test_qk_norm_rotary_is_bitwise_the_norms_and_vllms_rotary_it_replaces():
    """`qk_norm_rotary`, which the engine runs for Qwen3's q and k: for the heads of every Qwen3 (30B-A3B's
    32/4 and the demo model's heads of 64 among them), at row counts from 1 to 32k and positions anywhere in
    40,960, exactly the bits of `rms_norm_rows` on q's and k's heads (vLLM's norm) and then vLLM's
    `rotary_embedding` op on them (the three launches it replaces, in the engine and the trainer); the
    defaults and each of 12 ways to lay a program's heads over its warps."""
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    from batch_invariant_backward import rms_norm_rows, rope_cos_sin_cache

    g, eps, checked = torch.Generator(device="cuda").manual_seed(0), 1e-6, 0
    heads = {name: (h, kv, 128) for name, (_, _, h, kv) in QWEN3_SHAPES.items()}
    for name, (h, kv, hd) in (heads | {"30b-a3b": (32, 4, 128), "demo": (4, 2, 64)}).items():
        table = rope_cos_sin_cache(SimpleNamespace(head_dim=hd, rope_theta=1e6, max_seq_len=40960), torch.bfloat16)
        table = table.cuda()
        wq, wk = (1 + 0.1 * torch.randn(2, hd, device="cuda", generator=g)).bfloat16()
        for m in ROWS:
            qkv = (torch.randn(m, (h + 2 * kv) * hd, device="cuda", generator=g) * 3).bfloat16()
            q, k, _ = qkv.split([h * hd, kv * hd, kv * hd], dim=-1)
            q, k = q.view(m, h, hd), k.view(m, kv, hd)
            positions = torch.randint(0, 40960, (m,), device="cuda", generator=g)
            q_ref, k_ref = rms_norm_rows(q, wq, eps), rms_norm_rows(k, wk, eps)
            torch.ops._C.rotary_embedding(positions, q_ref.view(m, -1), k_ref.view(m, -1), hd, table, True)
            for heads, warps in ((0, 0), (1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4), (8, 8),
                                 (16, 4), (16, 8), (32, 8)):
                ours = qk_norm_rotary(q, k, wq, wk, eps, positions, table, heads, warps)
                assert bits_differ(ours[0], q_ref) == bits_differ(ours[1], k_ref) == 0, (name, m, heads, warps)
            checked += 1
    print(f"\n[qk_norm_rotary] {checked} (heads, rows) pairs bitwise the two norms and vLLM's rotary, "
          "each by the defaults and 12 layouts of a program's heads over its warps")


def test_qk_norm_rotary_rounds_vanishing_products_as_vllms_rotary():
    """Heads with values some 2^-120 of their row's (normed, still bf16 normals) at positions whose last
    pairs' sines are ~1e-6: products below fp32's normal range, which only the FMA form vLLM's compiled op
    uses rounds as it does; and the trainer's backward turns such gradients back as the op does."""
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    from batch_invariant_backward import rms_norm_backward, rms_norm_rows, rope_cos_sin_cache

    g, eps, hd, h, kv, m = torch.Generator(device="cuda").manual_seed(3), 1e-6, 128, 16, 8, 4096
    table = rope_cos_sin_cache(SimpleNamespace(head_dim=hd, rope_theta=1e6, max_seq_len=40960), torch.bfloat16)
    table = table.cuda()
    qkv = torch.randn(m, (h + 2 * kv) * hd, device="cuda", generator=g)
    tiny = torch.rand(qkv.shape, device="cuda", generator=g) < 0.3
    qkv = torch.where(tiny, qkv * 2.0**-120, qkv).bfloat16()
    q, k, _ = qkv.split([h * hd, kv * hd, kv * hd], dim=-1)
    q, k = q.view(m, h, hd), k.view(m, kv, hd)
    positions = torch.randint(1, 8, (m,), device="cuda", generator=g)  # small angles: sines ~1e-6 at the end
    w = torch.ones(hd, device="cuda", dtype=torch.bfloat16)
    q_ref, k_ref = rms_norm_rows(q, w, eps), rms_norm_rows(k, w, eps)
    torch.ops._C.rotary_embedding(positions, q_ref.view(m, -1), k_ref.view(m, -1), hd, table, True)
    ours = qk_norm_rotary(q, k, w, w, eps, positions, table)
    assert bits_differ(ours[0], q_ref) == bits_differ(ours[1], k_ref) == 0
    scale = torch.where(tiny[:, : h * hd].view(m, h, hd), 2.0**-120, 1.0)
    grad = (scale * torch.randn(m, h, hd, device="cuda", generator=g)).bfloat16()
    cos, sin = table.chunk(2, dim=-1)
    back = grad.clone()  # vLLM's op with the sines negated: the gradient turned back, as the three apart do
    torch.ops._C.rotary_embedding(positions, back.view(m, -1), None, hd, torch.cat((cos, -sin), dim=-1), True)
    in_pass = rms_norm_backward(grad, q, w, eps, rotated=(positions, table))
    apart = rms_norm_backward(back, q, w, eps)
    assert all(bits_differ(a, b) == 0 for a, b in zip(in_pass, apart))


def vllms_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """vLLM 0.20's batch-invariant log-softmax of fp32 (rows, V), its kernel launched as its `log_softmax` launches
    it: called directly, as simple_rl.py's engine (which other tests start) puts ours in that function's place."""
    from vllm.model_executor.layers.batch_invariant import _log_softmax_kernel

    out = torch.empty_like(x)
    _log_softmax_kernel[(x.shape[0],)](x, out, x.stride(0), out.stride(0), x.shape[1], BLOCK_SIZE=1024)
    return out


def test_split_log_softmax_is_bitwise_vllms_log_softmax():
    """`split_log_softmax`, which simple_rl.py installs for vLLM's sampler and the trainer runs: at row counts
    from 1 to 4k, Qwen3's vocabulary and other widths (odd ones, one block, less), logits of any scale, rows
    with tokens cut by top-k (-inf), a row all -inf, rows that start off a 16-byte boundary, it gives exactly
    the bits of vLLM 0.20's batch-invariant log-softmax; it refuses other dtypes (vLLM's runs them)."""
    from batch_invariant_backward import split_log_softmax

    g, checked = torch.Generator(device="cuda").manual_seed(0), 0
    for vocab in (151936, 151669, 32000, 8193, 1024, 1000, 512, 7):  # 512: offline_demo.py's
        for m in (m for m in ROWS if m * vocab <= 4097 * 151936):
            for scale in (1.0, 30.0):
                x = torch.randn(m, vocab, device="cuda", generator=g) * scale
                if vocab > 100:
                    x[::3, ::7] = float("-inf")
                if m > 2:
                    x[-1] = float("-inf")  # NaN throughout, in both
                differ = bits_differ(split_log_softmax(x), vllms_log_softmax(x))
                assert differ == 0, f"vocabulary {vocab}, {m} rows, scale {scale}: {differ} elements differ"
                checked += 1
        off = torch.randn(7 * vocab + 1, device="cuda", generator=g)[1:].view(7, vocab)  # 4 bytes off
        assert bits_differ(split_log_softmax(off), vllms_log_softmax(off)) == 0, f"vocabulary {vocab}, offset"
    with pytest.raises(ValueError):
        split_log_softmax(torch.zeros(2, 8, device="cuda", dtype=torch.bfloat16))
    print(f"\n[split_log_softmax] {checked} (vocabulary, rows, scale) cases bitwise vLLM's")


def test_a_drawn_tokens_logprob_is_the_log_softmaxs_bits():
    """`split_token_logprobs`, which the engine's sampler runs for each token it draws, gives the bits of the
    split log-softmax (vLLM's, by the test above) at that token, writing no (rows, V) tensor: 1 to 300 rows
    of 151,936 columns and rows of 1,000 and 8,197, all but the first half of them cut to a random tenth (-inf,
    as top-k/p cut), tokens drawn from them; the same rows 4 bytes off a 16-byte boundary. The trainer's
    forward, which also sums the entropy in those programs, gives the same logprobs and `row_entropy`'s bits."""
    from batch_invariant_backward import (row_entropy, split_log_softmax, split_token_logprobs,
                                          split_token_logprobs_and_entropy)

    g = torch.Generator(device="cuda").manual_seed(61)
    for rows, vocab in [(r, v) for r in (1, 7, 32, 256, 300) for v in (151936, 1000, 8197)]:
        logits = 4 * torch.randn(rows, vocab, device="cuda", generator=g)
        cut = torch.rand(rows, vocab, device="cuda", generator=g) < 0.9
        cut[: rows // 2] = False
        logits[cut] = float("-inf")
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)[:, 0]
        want = split_log_softmax(logits).gather(1, tokens[:, None])[:, 0].view(torch.int32)
        entropy = row_entropy(split_log_softmax(logits)).view(torch.int32)
        off = torch.empty(rows * vocab + 1, device="cuda")[1:].view(rows, vocab).copy_(logits)
        for x in (logits, off):
            assert torch.equal(split_token_logprobs(x, tokens).view(torch.int32), want)
            both = split_token_logprobs_and_entropy(x, tokens)
            assert torch.equal(both[0].view(torch.int32), want) and torch.equal(both[1].view(torch.int32), entropy)
