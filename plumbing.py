"""The plumbing of simple_rl.py: the flags' parse and every input check, the memory plan, the processes'
set-up, checkpoints and resume, logging and the quiet terminal, and the one way out on an error. The RL story
is simple_rl.py's; this module never imports it (run as a script, simple_rl.py is `__main__`: importing it
again would load a second copy, with classes of its own). What it needs of the story (the flags' class, a
model's shapes, the dataset's encoding, the HF weights) it is given.

torch is imported where it is used: importing this module costs no more than tyro, so that --help, a bad flag
and the input checks answer before torch, vLLM and the model load (seconds).
"""

import dataclasses
import functools
import io
import json
import math
import os
import random
import re
import shutil
import struct
import sys
import textwrap
import time
import typing
from contextlib import contextmanager, redirect_stderr, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import tyro

# ===== Flags: the parse, each number's range, one line per error =====
FIXED = "fixed on resume"  # a flag a resume may not change: data order, seeds, batch shape, reference follow
GSM8K = "openai/gsm8k"  # the hub's, its 'main' config: the default train and test sets


def default_is(what: str):  # --help's "(default: ...)" for a flag whose None stands for something
    return tyro.conf.arg(help_behavior_hint=f"(default: {what})")


# The range of every number, checked as the flags are parsed (`check_args` checks the rest).
RANGES = {"at least 1": ("steps", "prompts_per_step", "max_new_tokens", "max_prompt_tokens", "sft_batch_size",
                         "eval_samples"),
          ">= 0": ("seed", "top_k", "warmup_steps", "weight_decay", "kl_coef", "entropy_coef", "sft_steps",
                   "parity_report_tokens", "eval_every", "keep_last"),
          "> 0": ("temperature", "lr", "sft_lr", "max_grad_norm", "clip_eps")}
TERMINAL = sys.stderr  # the script's errors; others' logs go to runs/<run>/log.txt once training starts


class UsageError(Exception):
    """Bad flags, files or environment: reported as one line, exit status 2, before anything slow."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def torchrun_rank_and_size() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def saved_run(checkpoint: Path, args_class: type) -> tuple:
    """The flags a checkpoint's run was started with (an `args_class`), and its step."""
    run_file = checkpoint / "training_state" / "run.json"
    if not run_file.is_file():
        what = ("not a checkpoint of this script (no training_state/run.json)" if checkpoint.is_dir()
                else "a file, not a checkpoint directory" if checkpoint.exists() else "no such directory")
        raise UsageError(f"--resume {checkpoint}: {what}")
    try:
        run = json.loads(run_file.read_text(encoding="utf-8"))
        groups = {f.name: f.default_factory(**run["args"][f.name]) for f in dataclasses.fields(args_class)}
        step = run["step"]
    except ValueError as e:  # not JSON, not UTF-8
        raise UsageError(f"--resume {checkpoint}: {run_file} is broken ({e}); use an earlier one") from None
    except (KeyError, TypeError):
        raise UsageError(f"--resume {checkpoint}: written by another version of simple_rl.py (its flags "
                         "differ); resume it with that version") from None
    also = {float: (int, float), type(None): (str,)}  # a float saved as 1; a name or path (default None)
    typed = [flag(f.name) for g in groups.values() for f in dataclasses.fields(g) if not isinstance(
             getattr(g, f.name), (type(None), *also.get(type(f.default), [type(f.default)])))]
    if typed or type(step) is not int or step < 0:
        wrong = f"the type of {', '.join(typed)}" if typed else f"step {step!r} (a count of steps)"
        raise UsageError(f"--resume {checkpoint}: {run_file} holds a wrong value: {wrong}; resume an earlier "
                         "checkpoint")
    return args_class(**groups), step


def switch_names(args_class: type) -> set[str]:
    """The flags (without their dashes) that are switches: the bool fields of the flag groups."""
    return {flag(f.name)[2:] for group in dataclasses.fields(args_class)
            for f in dataclasses.fields(group.default_factory) if isinstance(f.default, bool)}


def tyro_cli(args_class: type, **options):
    """tyro's parse; its boxed error (a mistyped flag or value) made one line, with the flags it names."""
    try:
        with redirect_stderr(boxed := io.StringIO()):
            return tyro.cli(args_class, **options)
    except BrokenPipeError:  # --help | head: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor a flush error at exit
        raise SystemExit(0) from None
    except SystemExit as ended:  # status 0: --help printed its text
        if not ended.code:
            raise
        rows = [re.sub("[\u2500-\u257f]", "", r).strip() for r in boxed.getvalue().splitlines()] + ["", ""]
        flags = ", ".join(row for row in rows if row.startswith("--")) or "--help"
        argv = options.get("args")
        argv = sys.argv[1:] if argv is None else argv
        switches = [f"; {given} is a switch: --{name} or --no-{name}, no value"
                    for given, value in zip(argv, argv[1:]) for name in [given[2:].removeprefix("no-")]
                    if given.startswith("--") and name in switch_names(args_class)
                    and value.lower() in ("true", "false", "1", "0", "yes", "no")]
        message = f"{' '.join(rows[1:rows.index('', 1)])} (see {flags})"
        raise UsageError(message + "".join(switches[:1])) from None


def parse_command_line(args_class: type, doc: str, argv: list[str] | None = None):
    """An `args_class` of the flags, each number in its range; with --resume, the run's saved flags overridden
    by those given. `doc`: the script's docstring, whose first two paragraphs open --help."""
    setting = ("Set VLLM_BATCH_INVARIANT=1 in the environment: vLLM reads it at import, and without it the "
               "logprobs cannot be bitwise equal. A run needs an NVIDIA GPU (one a process under torchrun).")
    about, setting = (textwrap.fill(" ".join(text.split()), 78, initial_indent="  ", subsequent_indent="  ")
                      for text in (doc.split("\n\n")[0], setting))
    options = dict(args=argv, config=(tyro.conf.OmitArgPrefixes, tyro.conf.DisallowNone),
                   description=f"{about}\n\n{doc.split(chr(10) * 2)[1]}\n\n{setting}")  # indented: kept
    args = tyro_cli(args_class, **options)
    if args.run.resume is not None and not args.run.resume.strip():
        raise UsageError("--resume is empty: give a path")
    if args.run.resume is not None:
        args = tyro_cli(args_class, default=saved_run(Path(args.run.resume), args_class)[0], **options)
    values = {name: value for group in asdict(args).values() for name, value in group.items()}
    for name, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag(name)} must be a finite number")
    holds = {"at least 1": lambda x: x >= 1, ">= 0": lambda x: x >= 0, "> 0": lambda x: x > 0}
    for rule, names in RANGES.items():
        for name in names:
            if not holds[rule](values[name]):
                raise UsageError(f"{flag(name)} must be {rule}")
    return args


def say_once(line: str) -> None:
    """A note of the checks every rank makes: printed by rank 0 alone under torchrun."""
    if torchrun_rank_and_size()[0] == 0:
        print(line)


def exit_on(error: Exception, status: int) -> None:
    """The one way out on an error: a line on stderr (from rank 0 alone under torchrun), and the status."""
    if torchrun_rank_and_size()[0] == 0:
        print(f"error: {error}", file=TERMINAL)
    if "TORCHELASTIC_ERROR_FILE" in os.environ:  # torchrun's summary then names this line as the root cause
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
        handled = sys.exc_info()[1]
        if handled is not None:  # the record keeps the handled error's stack: torchrun would print
            handled.__traceback__ = None  # every rank's; the line is the message
        ErrorHandler().record_exception(SystemExit(f"error: {error}"))
    sys.exit(status)


def exit_on_full_disk(error: OSError) -> None:
    """A disk full beneath TensorBoard, the log or a cache (a save's is a CheckpointError): one line, exit
    status 1. The log's copier then leaves fd 2 quiet (`log_to_file`): a thread dying as the process exits
    (TensorBoard's) goes unseen."""
    global DISK_FULL
    DISK_FULL, where = True, f": {error.filename}" if error.filename else ""
    exit_on(f"the disk is full ({error.strerror}{where}); any checkpoints written are whole: free some "
            "space, then --resume from the last one", 1)


# ===== Input checks: each fails in one line (UsageError), before anything slow =====
def existing_parent(path: Path) -> Path:
    return next(p for p in (path, *path.absolute().parents) if p.exists())


def check_resume(args) -> tuple:
    """The args of a resumed run (its name kept) and its step; names every flag contradicting the run."""
    saved, step = saved_run(Path(args.run.resume), type(args))
    if args.run.run_name not in (None, saved.run.run_name):
        raise UsageError(f"--run-name {args.run.run_name}: a resumed run keeps its name "
                         f"({saved.run.run_name}); leave --run-name out")
    values = [(name, getattr(given, name), getattr(had, name)) for group in dataclasses.fields(args)
              for given, had in [(getattr(args, group.name), getattr(saved, group.name))]
              for name, hint in typing.get_type_hints(type(given), include_extras=True).items()
              if FIXED in getattr(hint, "__metadata__", ())]
    clashes = [f"{flag(name)} {given!r} (the run has {had!r})" for name, given, had in values if given != had
               and not (isinstance(given, str) and isinstance(had, str) and os.path.exists(given)
                        and os.path.exists(had) and os.path.samefile(given, had))]  # a path, spelt otherwise
    if clashes:
        raise UsageError(f"--resume {args.run.resume}: {', '.join(clashes)} contradict the run it continues; "
                         "leave them out to continue it as it was")
    if step >= args.optimizer.steps:
        raise UsageError(f"--resume {args.run.resume}: the run is at step {step} already; pass a larger "
                         "--steps to train on")
    return dataclasses.replace(args, run=dataclasses.replace(args.run, run_name=saved.run.run_name)), step


def check_output(run) -> None:
    """runs/<run_name> and <output_dir>/<run_name> can be written, and a new run overwrites nothing."""
    if not re.fullmatch(r"[\w.-]+", run.run_name) or run.run_name in (".", ".."):
        raise UsageError(f"--run-name {run.run_name!r}: give a plain name (letters, digits, '.', '-', '_'): "
                         "it names the folders runs/<name> and <output-dir>/<name>")
    if len(run.run_name.encode()) > 200:  # a folder's name: 255 bytes at most, and a save's adds a suffix
        raise UsageError(f"--run-name: {len(run.run_name.encode())} bytes; give at most 200 (it names the "
                         "folders runs/<name> and <output-dir>/<name>)")
    for root, what in ((Path(run.output_dir), "--output-dir"), (Path("runs"), "TensorBoard's runs/")):
        existing = existing_parent(root)
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise UsageError(f"{what} {root}: {existing} is not a writable directory")
        if not run.resume and (root / run.run_name).exists():
            raise UsageError(f"--run-name {run.run_name}: {root / run.run_name} exists already; pick another "
                             "name, or --resume one of its checkpoints")


def check_args(args, world_size: int):
    """Fails on flags that contradict each other, the environment or the output paths (each number's range is
    checked as it is parsed); sets the run name (a timestamp) and warm-up <= steps."""
    given = args.data
    hub = {name: None for name in ("dataset", "eval_dataset") if getattr(given, name) == GSM8K}
    if hub:  # the default's own hub id, given: the hub's GSM8K, as by default
        args = dataclasses.replace(args, data=dataclasses.replace(given, **hub))
    data, sampling, loss, optimizer, engine, run = (args.data, args.sampling, args.loss, args.optimizer,
                                                     args.engine, args.run)
    invariant = os.environ.get("VLLM_BATCH_INVARIANT")
    sequence = data.max_prompt_tokens + sampling.max_new_tokens
    paths = (("--model", data.model), ("--dataset", data.dataset), ("--eval-dataset", data.eval_dataset),
             ("--output-dir", run.output_dir), ("--resume", run.resume))
    samples = sampling.prompts_per_step * sampling.samples_per_prompt
    checks = [
        *[(value is None or value.strip(), f"{name} is empty: give a path") for name, value in paths],
        (samples <= 2**16, f"--prompts-per-step x --samples-per-prompt = {samples:,} samples a step; give "
                           "at most 65,536 (a step's completions and logprobs are held in memory at once)"),
        (optimizer.lr < 1, f"--lr {optimizer.lr:g}: AdamW moves each weight by about lr a step; give "
                           "a rate below 1 (the default is 1e-6)"),
        (sampling.samples_per_prompt >= 2, "--samples-per-prompt must be at least 2: GRPO normalises rewards "
                                           "within each group"),
        (0 < sampling.top_p <= 1, "--top-p must be in (0, 1] (1 keeps every token)"),
        (sampling.temperature >= 1e-5, f"--temperature {sampling.temperature:g} is below 1e-5, where vLLM "
         "samples greedily (and the trainer would divide by it)"),
        (data.seed < 2**63 // 10**9, f"--seed must be below {2**63 // 10**9}: a step's sampling seeds, "
         "seed * 1e9 + i, are 64-bit"),
        (optimizer.steps <= 10**8, "--steps must be at most 100,000,000 (a step takes seconds)"),
        (not (data.thinking and data.prompt_format == "plain"), "--thinking opens a <think> block in Qwen3's "
         "chat template: use --prompt-format chat or auto"),
        (not (args.parity.locate_divergence and args.parity.assert_bitwise), "--locate-divergence is for "
         "--no-assert-bitwise runs: a parity abort always locates the divergence"),
        (loss.kl_coef == 0 or (sampling.top_k == 0 and sampling.top_p == 1), "--kl-coef must be 0 with "
         "--top-k or --top-p: a sampled token can lie outside the reference policy's kept set, where the KL "
         "is infinite"),
        (0 <= optimizer.min_lr_ratio <= 1, "--min-lr-ratio must be between 0 and 1"),
        (run.save_every >= -1, "--save-every must be >= -1 (0: a checkpoint after the last step only; "
         "-1: no)"),
        (0 <= loss.correction_min < loss.correction_max, "need 0 <= --correction-min < --correction-max"),
        (engine.max_tokens_per_microbatch >= sequence, f"--max-tokens-per-microbatch "
         f"{engine.max_tokens_per_microbatch} must hold one whole sequence: --max-prompt-tokens + "
         f"--max-new-tokens = {sequence}"),
        (0 < engine.vllm_gpu_memory < 1, "--vllm-gpu-memory must be a fraction between 0 and 1"),
        (not (data.dataset and run.eval_every and not given.eval_dataset),
         "--dataset is local: pass --eval-dataset (a local test jsonl) too, or --eval-every 0"),
        (invariant in (None, "0", "1"), f"VLLM_BATCH_INVARIANT is {invariant!r}, but vLLM reads it as an "
         "integer: set VLLM_BATCH_INVARIANT=1"),
        (not args.parity.assert_bitwise or invariant == "1",
         f"VLLM_BATCH_INVARIANT is {invariant or 'not set'}, so vLLM's logprobs cannot equal the trainer's: "
         "set VLLM_BATCH_INVARIANT=1, or pass --no-assert-bitwise to run anyway and report the mismatch"),
        *[(n % world_size == 0, f"{name} {n} must be a multiple of the {world_size} processes")
          for name, n in (("--prompts-per-step", sampling.prompts_per_step),
                          ("--sft-batch-size", args.warm_start.sft_batch_size if args.warm_start.sft_steps
                           and not run.resume else 0))],  # a resume never warm-starts
    ]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)
    if run.resume:
        args, _ = check_resume(args)
    elif run.run_name is None:
        name = time.strftime("grpo_%Y%m%d_%H%M%S")
        args = dataclasses.replace(args, run=dataclasses.replace(run, run_name=name))
    check_output(args.run)
    if optimizer.warmup_steps > optimizer.steps:  # `lr_at` shortens it; the flag stays, for a resume
        say_once(f"note: --warmup-steps {optimizer.warmup_steps} is more than --steps {optimizer.steps}: the "
                 f"learning rate warms up over all {optimizer.steps} steps")
    return args

def rope_parameters(config: dict) -> dict:
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def read_config(model_dir: Path) -> dict:
    """A checkpoint's config.json, refused in one line (naming the file) if it cannot describe a Qwen3."""
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot read it ({e.strerror})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path}: a JSON object of the model's settings was expected")
    if "num_local_experts" in config:  # transformers 5 saves Qwen3-MoE's num_experts by this name
        config.setdefault("num_experts", config["num_local_experts"])
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "intermediate_size", "rms_norm_eps", "max_position_embeddings")
    if config.get("model_type") == "qwen3_moe":
        keys += ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    missing = [key for key in keys if key not in config]
    missing += [] if "rope_theta" in rope_parameters(config) | config else ["rope_theta"]  # defaults differ
    if config.get("model_type") not in ("qwen3", "qwen3_moe") or missing:
        what = f"no {', '.join(missing)}" if missing else f"model_type is {config.get('model_type')!r}"
        raise UsageError(f"{path}: {what}; this trainer needs a Hugging Face Qwen3 or Qwen3-MoE config")
    counts = [key for key in keys if key != "rms_norm_eps"]  # and head_dim, where given
    counts += [] if config.get("head_dim") is None else ["head_dim"]
    for key in ["rms_norm_eps", *counts]:
        kind, what = ((int,), "an integer") if key in counts else ((int, float), "a number")
        if not isinstance(config[key], kind) or isinstance(config[key], bool) or not config[key] > 0:
            raise UsageError(f"{path}: {key} is {config[key]!r}; it must be {what} > 0")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise UsageError(f"{path}: num_attention_heads {config['num_attention_heads']} is not a multiple of "
                         f"num_key_value_heads {config['num_key_value_heads']} (each KV head serves a group "
                         "of query heads)")
    if config["model_type"] == "qwen3_moe" and config["num_experts_per_tok"] > config["num_experts"]:
        raise UsageError(f"{path}: num_experts_per_tok {config['num_experts_per_tok']} is more than "
                         f"num_experts {config['num_experts']}")
    rope = rope_parameters(config)
    unsupported = {"hidden_act": config.get("hidden_act", "silu") != "silu",
                   # Qwen3-MoE's released models make every layer sparse; torchtitan's Qwen3-MoE does
                   "a dense layer among the sparse (decoder_sparse_step, mlp_only_layers)":
                       config["model_type"] == "qwen3_moe"
                       and (config.get("decoder_sparse_step", 1) != 1 or bool(config.get("mlp_only_layers"))),
                   "a shared expert": bool(config.get("shared_expert_intermediate_size")),
                   "attention_bias": bool(config.get("attention_bias", False)),
                   "rope scaling": rope.get("rope_type", rope.get("type", "default")) != "default",
                   "sliding window": bool(config.get("use_sliding_window", False))}
    for name, bad in unsupported.items():
        if bad:
            raise UsageError(f"{path}: {name} is not supported by this trainer (plain Qwen3 and Qwen3-MoE "
                             "only)")
    return config


def checkpoint_shapes(config: dict) -> dict[str, tuple]:
    """The tensors a Hugging Face Qwen3 checkpoint of this (checked) config.json holds, by name, and their
    shapes: worked out without torch, so that the weights are checked at once (tests/test_model.py holds them
    against the trainer's own `hf_weights`)."""
    d, v, f = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    h, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or d // h
    layer = {"self_attn.q_proj.weight": (h * hd, d), "self_attn.k_proj.weight": (kv * hd, d),
             "self_attn.v_proj.weight": (kv * hd, d), "self_attn.o_proj.weight": (d, h * hd),
             "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
             "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,)}
    if config["model_type"] == "qwen3_moe":  # every layer sparse: a router and each expert's SwiGLU
        f, experts = config["moe_intermediate_size"], range(config["num_experts"])
        layer |= {"mlp.gate.weight": (len(experts), d)}
        layer |= {f"mlp.experts.{e}.{proj}.weight": dims for e in experts
                  for proj, dims in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f)))}
    else:
        layer |= {"mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
                  "mlp.down_proj.weight": (d, f)}
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    shapes |= {f"model.layers.{i}.{name}": dims for i in range(config["num_hidden_layers"])
               for name, dims in layer.items()}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, d)
    return shapes


class ModelShape(NamedTuple):
    """What the checks and the memory plan count of a model, without building it (simple_rl.model_shape)."""
    args: object  # torchtitan's Qwen3ModelArgs: the config's sizes
    parameters: dict[str, tuple]  # the trainer's parameters' shapes, by name
    checkpoint: dict[str, tuple]  # the Hugging Face checkpoint's tensors' shapes, by name


def check_checkpoint(model_dir: Path, config: dict, source: str = "--model") -> None:
    """Its weights' names, shapes and dtype against config.json (`source`: the flag that named it)."""
    from safetensors import SafetensorError, safe_open  # headers only: fail before anything slow starts
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UsageError(f"{source} {model_dir}: no *.safetensors weights in the directory")
    index = model_dir / "model.safetensors.index.json"  # a sharded checkpoint's: which file holds what
    if index.is_file():
        try:
            named = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UsageError(f"{source} {model_dir}: {index.name} is broken; download or save it "
                             "again") from None
        missing = sorted(named - {f.name for f in files})
        if missing:
            raise UsageError(f"{source} {model_dir}: {missing[0]} is missing ({index.name} names it among "
                             f"{len(named)} files); download or copy it again")
    found, where = {}, {}  # name -> (shape, dtype), name -> file
    for f in files:
        try:
            with safe_open(f, "numpy") as weights:  # the header is all that is read: no torch needed
                twice = sorted(name for name in weights.keys() if name in where)
                if twice:  # which one would load is the order of the files
                    raise UsageError(f"{source} {model_dir}: {twice[0]} is in {where[twice[0]]} and "
                                     f"{f.name}; keep one checkpoint's files in the directory")
                found |= {name: (tuple(weights.get_slice(name).get_shape()),
                                 weights.get_slice(name).get_dtype()) for name in weights.keys()}
                where |= dict.fromkeys(weights.keys(), f.name)
        except SafetensorError as e:
            raise UsageError(f"{source} {model_dir}: {f.name} is not a whole safetensors file ({e}); "
                             "download or save it again") from None
        except OSError as e:
            why = (f"links to {os.readlink(f)}, which does not exist" if f.is_symlink() and not f.exists()
                   else f"cannot be read ({e.strerror or e})")  # the first: a hub cache copied without blobs
            raise UsageError(f"{source} {model_dir}: {f.name} {why}; copy the model with its files (cp -L) "
                             "or download it again") from None
    expected = checkpoint_shapes(config)
    if config.get("tie_word_embeddings", False):
        found.pop("lm_head.weight", None)  # some tied checkpoints store the head too; it is the embedding
    problems = [f"missing {name}" for name in sorted(expected.keys() - found.keys())]
    problems += [f"unexpected {name}" for name in sorted(found.keys() - expected.keys())]
    problems += [f"{name} is {list(found[name][0])}, config.json needs {list(shape)}"
                 for name, shape in expected.items() if name in found and found[name][0] != shape]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise UsageError(f"{source} {model_dir}: the weights do not match config.json: "
                         + "; ".join(problems[:3]) + more)
    other = sorted({dtype for _, dtype in found.values()} - {"BF16"})
    if other:  # vLLM would serve them rounded to bf16, the trainer would train other weights
        raise UsageError(f"{source} {model_dir}: the weights are {', '.join(other)}; both sides run bf16 "
                         "weights: save the checkpoint in bfloat16")


def check_training_state(checkpoint: Path, shape: ModelShape) -> None:
    """--resume: DCP's index of the training state, every file it names as long as it says, parity.json, and
    the state's parameters those of `shape`; a checkpoint copied in part, or another model's state, fails
    here, not in `dcp.load` once vLLM has started."""
    import torch.distributed.checkpoint as dcp
    state, problem = checkpoint / TRAINING_STATE, None
    try:
        ends, metadata = {}, dcp.FileSystemReader(state).read_metadata()
        saved = {key.removeprefix("masters."): tuple(item.size)
                 for key, item in metadata.state_dict_metadata.items() if key.startswith("masters.")}
        differ = sorted(saved.keys() ^ shape.parameters.keys()) or sorted(
            name for name in saved if saved[name] != shape.parameters[name])
        if differ:
            problem = (f"it is another model's: {len(differ)} parameter(s) differ from config.json's, "
                       f"{differ[0]} first")
        for item in metadata.storage_data.values():
            ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
        for name, end in sorted(ends.items()):
            size = (state / name).stat().st_size if (state / name).is_file() else None
            if problem is None and (size is None or size < end):
                cut = "missing" if size is None else f"cut short: {size:,} of {end:,} bytes"
                problem = f"{name} is {cut}"
        parity = json.loads((state / "parity.json").read_text())
        lacks = {"stack", "tokens_checked", "mismatched_tokens"} - parity.keys()  # what resuming reads of it
        problem = problem or (f"parity.json lacks {', '.join(sorted(lacks))}" if lacks else None)
    except Exception as e:  # the index or parity.json missing or unreadable (not DCP's, not JSON, not ours)
        problem = f"{type(e).__name__}: {e}".splitlines()[0]
    if problem:
        raise UsageError(f"--resume {checkpoint}: its training state is broken ({problem}); copy it again "
                         "whole, or resume from an earlier checkpoint")


@functools.cache  # asked once a run (the model, the train and the test set may each come from the hub)
def offline_unless_hub_answers() -> bool:
    """Whether the hub is out of reach (no connection within 3 s): then `datasets` and `huggingface_hub` read
    only their local caches (HF_HUB_OFFLINE, read as they are imported), where they would retry for half a
    minute before failing."""
    import socket
    from urllib.parse import urlparse
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        return True
    try:
        host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname
        socket.create_connection((host, 443), timeout=3).close()
        return False
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = "1"
        return True


def load_gsm8k(split: str) -> list[dict]:
    """[{question, answer}] of openai/gsm8k 'main' from `datasets` (a local file: `read_gsm8k_file`)."""
    offline = offline_unless_hub_answers()
    from datasets import load_dataset
    try:
        rows = load_dataset(GSM8K, "main", split=split)
    except Exception as e:
        why = "the hub is out of reach, and it is not in the local cache" if offline else type(e).__name__
        raise UsageError(f"cannot load {GSM8K} from the hub ({why}): pass --dataset and --eval-dataset with "
                         "local jsonl files") from e
    return [{"question": r["question"], "answer": r["answer"]} for r in rows]


BLANK = object()  # a jsonl's empty line: skipped (a JSON null is a row, and refused)


def read_gsm8k_file(path: str, answer_format: re.Pattern, flag: str) -> list[dict]:
    """[{question, answer}] of a local GSM8K-format jsonl (or parquet, the hub's format), each row checked: an
    answer holds `answer_format` (the reward's: GSM8K's '#### N'). `flag` names where the path came from."""
    if not Path(path).is_file():
        what = "a directory" if Path(path).is_dir() else "no such file"
        raise UsageError(f"{flag} {path}: {what} (expected a GSM8K-format jsonl file)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic[:2] == b"\x1f\x8b":
        raise UsageError(f"{flag} {path}: a gzip file; decompress it (gunzip) and pass the jsonl")
    parquet = magic == b"PAR1"
    if parquet:  # through `datasets`, as the hub's own copy of GSM8K is stored
        import datasets
        datasets.disable_progress_bars()  # the script's line is the one the user reads, not datasets' own
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)
        try:
            rows = list(datasets.load_dataset("parquet", data_files=path, split="train"))
        except Exception as e:
            raise UsageError(f"{flag} {path}: not a readable parquet file ({type(e).__name__})") from None
        where = "row"
    else:
        rows, where = [], "line"
        for n, raw in enumerate(Path(path).read_bytes().splitlines(), 1):
            try:  # a BOM on the first line, as Windows editors write
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError:
                raise UsageError(f"{flag} {path} line {n}: not UTF-8 text (save the jsonl as "
                                 "UTF-8)") from None
            try:
                rows.append(json.loads(line) if line.strip() else BLANK)
            except json.JSONDecodeError:
                raise UsageError(f"{flag} {path} line {n}: not valid JSON") from None
    checked = []
    for n, row in enumerate(rows, 1):
        if row is BLANK:
            continue
        if not (isinstance(row, dict) and all(isinstance(row.get(k), str) for k in ("question", "answer"))):
            raise UsageError(f"{flag} {path} {where} {n}: need a JSON object with string fields 'question', "
                             "'answer'")
        if not row["question"].strip():  # the prompt would be the instruction alone
            raise UsageError(f"{flag} {path} {where} {n}: the question is empty")
        # GSM8K's answers end in '#### N': a bare last number would be a guess at the answer.
        if not answer_format.search(row["answer"]):
            raise UsageError(f"{flag} {path} {where} {n}: the answer holds no '#### N' with N a number "
                             "(GSM8K's answers end in it: the reward's label is its first)")
        checked.append({"question": row["question"], "answer": row["answer"]})
    if not checked:
        raise UsageError(f"{flag} {path}: no examples")
    return checked


def encoded_split(rows: list[dict], name: str, encode: Callable, data) -> list[dict]:
    """A split's questions tokenised by `encode`, saying how many prompts were too long."""
    kept = encode(rows)
    if not kept:
        raise UsageError(f"{name}: every prompt exceeds --max-prompt-tokens {data.max_prompt_tokens}")
    if len(kept) < len(rows):
        print(f"{name}: {len(rows) - len(kept)} of {len(rows)} prompts exceed --max-prompt-tokens "
              f"{data.max_prompt_tokens} and are skipped")
    return kept


HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]  # what --model fetches from the hub:
# config, weights, tokenizer (transformers 5 saves a chat template only as chat_template.jinja)


def resolve_model_dir(model: str) -> Path:
    """--model's checkpoint directory: a local one (the hub cache's folder of a model: its snapshot), or a
    hub id's, downloaded."""
    path = Path(model)
    if path.is_dir() and not (path / "config.json").is_file() and (path / "snapshots").is_dir():
        ref = path / "refs" / "main"  # the hub cache: models--Org--Name/snapshots/<commit>/
        snapshots = sorted((path / "snapshots").iterdir())
        if ref.is_file() and (path / "snapshots" / ref.read_text().strip()).is_dir():
            return resolve_model_dir(str(path / "snapshots" / ref.read_text().strip()))
        if len(snapshots) == 1:
            return resolve_model_dir(str(snapshots[0]))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"--model {model}: the directory has no config.json (need a Hugging Face Qwen3 "
                             "checkpoint)")
        return path
    if path.exists() or model.startswith((".", "/")) or model.count("/") != 1:
        raise UsageError(f"--model {model}: not a checkpoint directory, nor a hub id like Qwen/Qwen3-1.7B")
    offline = offline_unless_hub_answers()
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(model, allow_patterns=HUB_FILES))
    except Exception as e:
        why = "the hub is out of reach, and it is not in the local cache" if offline else type(e).__name__
        raise UsageError(f"--model {model}: cannot download it from the hub ({why}); pass a local checkpoint "
                         "directory") from e


def end_of_sequence_ids(tokenizer, config: dict, model_dir: Path, chat: bool) -> list[int]:
    """The tokens that end a completion, the one an answer ends with first: in chat, the end of a turn
    (<|im_end|>: a Qwen3-Base tokenizer's eos is <|endoftext|>), else the tokenizer's eos."""
    eos = config.get("eos_token_id")
    ends = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
    turn_end = tokenizer.get_vocab().get("<|im_end|>") if chat else None
    first = [i for i in (turn_end, tokenizer.eos_token_id) if i is not None][:1]
    ids = [*first, *sorted(ends - {None, *first})]
    if not ids:
        raise UsageError(f"{model_dir}: neither the tokenizer nor config.json names an end-of-sequence token")
    return ids


def in_units(n: float) -> str:
    return next(f"{n / 2**k:.1f} {unit}" for k, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "B"))
                if n >= 2**k or k == 0)


def checkpoint_bytes(args, parameters: int) -> int:
    """16 bytes a parameter (18 with a reference): the bf16 weights, fp32 master and 2 AdamW moments (14),
    and a margin for the files' own bytes."""
    return parameters * (18 if args.loss.kl_coef else 16)


def check_disk(args, parameters: int) -> None:
    """A save writes the new checkpoint before it removes the oldest: --keep-last + 1 of them at once.
    Refuses a run whose first checkpoint cannot fit; warns of one whose later ones will not."""
    one, root = checkpoint_bytes(args, parameters), Path(args.run.output_dir)
    saves = args.optimizer.steps // args.run.save_every + 1 if args.run.save_every else 1
    most = one * min(saves, args.run.keep_last + 1 if args.run.keep_last else saves)
    free = shutil.disk_usage(existing_parent(root)).free
    if free < one:
        raise UsageError(f"--output-dir {root}: {in_units(free)} free, but a checkpoint of this model takes "
                         f"about {in_units(one)}; free some, give another --output-dir, or --save-every -1")
    if free < most:
        say_once(f"warning: {root} has {in_units(free)} free; the run's checkpoints take up to "
                 f"{in_units(most)} at once (--keep-last + 1): a later save will fail")


BITWISE_HEAD_DIMS = (128, 256)
"""Head sizes where vLLM's attention is bitwise the trainer's at any length (tests/test_gpu_configs.py)"""


def check_bitwise_head_dim(head_dim: int, longest: int, model_dir) -> None:
    """vLLM 0.20's FlashAttention 3 sizes key tiles by head size and causality, and runs a decode-only step
    as non-causal: at head_dim 64 it sums keys in tiles of 192 where a prefill (and the trainer) uses 128,
    so decode rows part at layer 0's attention unless a sequence fits one tile (<= 128 tokens). Other
    head sizes are untested."""
    if head_dim in BITWISE_HEAD_DIMS or (head_dim == 64 and longest <= 128):
        return
    raise UsageError(f"--model {model_dir}: head_dim is {head_dim}; vLLM's attention is bitwise the "
                     "trainer's only at head_dim 128 or 256, or 64 with sequences of at most 128 tokens "
                     f"(here --max-prompt-tokens + --max-new-tokens = {longest})")


@dataclass
class Files:
    """The run's files, read and checked before torch loads (seconds): a bad flag or file answers at once."""
    model_dir: Path  # the checkpoint both sides load: --model, or the one --resume continues from
    config: dict  # its config.json
    start_step: int  # GRPO steps already made: 0, or the resumed checkpoint's step
    train_rows: list[dict]  # --dataset's questions, or the hub's GSM8K train split
    eval_rows: list[dict]  # --eval-dataset's, or the hub's test split; [] without evaluations


def check_tokenizer(model_dir: Path, config: dict, source: str, data) -> None:
    """The tokenizer's files, read without transformers (which imports torch): `tokenizers` loads
    tokenizer.json in milliseconds; its vocabulary fits the model's; a chat template where the flags need
    one (transformers 5 keeps it in tokenizer_config.json or chat_template.jinja). `load_inputs` loads the
    tokenizer for use."""
    files = {name: (model_dir / name).is_file()
             for name in ("tokenizer.json", "vocab.json", "tokenizer.model")}
    if not any(files.values()):
        raise UsageError(f"{source} {model_dir}: no tokenizer files (tokenizer.json); copy the model's "
                         "tokenizer with its weights")
    if files["tokenizer.json"]:
        from tokenizers import Tokenizer
        try:
            size = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size(
                with_added_tokens=True)
        except Exception as e:
            raise UsageError(f"{source} {model_dir}: cannot load its tokenizer (tokenizer.json: "
                             f"{str(e).splitlines()[0][:200]})") from None
        if not 1 < size <= config["vocab_size"]:
            raise UsageError(f"{source} {model_dir}: its tokenizer has {size} token(s) for a vocabulary of "
                             f"{config['vocab_size']} (another model's?)")
    try:
        settings = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        settings = {}
    template = "chat_template" in settings or any((model_dir / name).is_file()
                                                  for name in ("chat_template.jinja", "chat_template.json"))
    if not template and (data.prompt_format == "chat" or data.thinking):
        wanted = "--prompt-format chat" if data.prompt_format == "chat" else "--thinking"
        raise UsageError(f"{wanted}: {source} {model_dir}'s tokenizer has no chat template; use "
                         f"{'plain or auto' if data.prompt_format == 'chat' else '--no-thinking'}")


def check_state_files(checkpoint: Path) -> None:
    """--resume: the training state's files that need no torch to find (`check_training_state` reads
    DCP's index once torch has loaded)."""
    state = checkpoint / TRAINING_STATE
    lacks = [name for name in (".metadata", "parity.json") if not (state / name).is_file()]
    lacks += [] if any(state.glob("*.distcp")) else ["its .distcp files"]
    if lacks:
        raise UsageError(f"--resume {checkpoint}: its training state is broken ({', '.join(lacks)} "
                         "missing); copy it again whole, or resume from an earlier checkpoint")


def read_files(args, answer_format: re.Pattern) -> Files:
    """Every file the run reads, checked without torch: the checkpoint's config.json and its weights' names,
    shapes and dtype (headers only), the disk for the checkpoints, the local datasets (each answer holds
    `answer_format`). A path from --resume's checkpoint says so."""
    from importlib.metadata import version
    if version("vllm") != "0.20.0":
        raise UsageError(f"vLLM {version('vllm')} is installed; this script mirrors vLLM 0.20.0's kernels: "
                         "pip install vllm==0.20.0")
    resume = args.run.resume
    model_dir = Path(resume) if resume else resolve_model_dir(args.data.model)
    config = read_config(model_dir)
    longest = args.data.max_prompt_tokens + args.sampling.max_new_tokens
    if longest > config["max_position_embeddings"]:
        raise UsageError(f"--max-prompt-tokens + --max-new-tokens = {longest}, but the model has "
                         f"{config['max_position_embeddings']} positions ({model_dir}/config.json: "
                         "max_position_embeddings)")
    check_bitwise_head_dim(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                           longest, model_dir)
    if args.sampling.top_k > config["vocab_size"]:
        raise UsageError(f"--top-k {args.sampling.top_k} is more than the vocabulary's "
                         f"{config['vocab_size']} tokens (0 keeps them all)")
    check_checkpoint(model_dir, config, "--resume" if resume else "--model")  # named as the flag did
    check_tokenizer(model_dir, config, "--resume" if resume else "--model", args.data)
    if resume:
        check_state_files(model_dir)
    if args.run.save_every >= 0:
        check_disk(args, sum(math.prod(dims) for dims in checkpoint_shapes(config).values()))
    saved = " (the run's, saved in its checkpoint)" if resume else ""  # --dataset may not change on resume
    train = load_gsm8k("train") if args.data.dataset is None else read_gsm8k_file(
        args.data.dataset, answer_format, "--dataset" + saved)
    for name, n in (("--prompts-per-step", args.sampling.prompts_per_step),
                    ("--sft-batch-size", args.warm_start.sft_batch_size if args.warm_start.sft_steps else 0)):
        if n > len(train):
            raise UsageError(f"{name} {n} is more than the train set's {len(train)} questions")
    evaluation = None if args.data.eval_dataset is None else (  # read even if unused: a wrong path fails
        read_gsm8k_file(args.data.eval_dataset, answer_format, "--eval-dataset"))
    evaluation = (load_gsm8k("test") if evaluation is None else evaluation) if args.run.eval_every else []
    return Files(model_dir, config, saved_run(model_dir, type(args))[1] if resume else 0, train, evaluation)


@dataclass
class Inputs:
    """Everything read before the engine starts: a bad input fails before anything slow."""
    model_dir: Path  # the checkpoint both sides load: --model, or the one --resume continues from
    shape: ModelShape  # its sizes, its parameters' and its checkpoint's tensors' shapes
    start_step: int  # GRPO steps already made: 0, or the resumed checkpoint's step
    tokenizer: object
    stop_ids: list[int]
    train_rows: list[dict]
    eval_rows: list[dict]


def load_inputs(args, files: Files, shape: ModelShape, encode_dataset: Callable) -> Inputs:
    """The inputs that need torch, transformers or the hub, checked: the model's `shape` (of its config.json)
    against a resumed training state, the tokenizer, the datasets encoded by
    `encode_dataset(rows, tokenizer, data)`."""
    from transformers import AutoTokenizer
    model_dir, source = files.model_dir, "--resume" if args.run.resume else "--model"
    if args.run.resume:
        check_training_state(model_dir, shape)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:
        raise UsageError(f"{source} {model_dir}: cannot load its tokenizer ({type(e).__name__}: "
                         f"{str(e).splitlines()[0]})") from e
    vocabulary = files.config["vocab_size"]
    if not 1 < len(tokenizer) <= vocabulary:  # transformers makes a 1-token one with no files
        raise UsageError(f"{source} {model_dir}: its tokenizer has {len(tokenizer)} token(s) for a "
                         f"vocabulary of {vocabulary} (its files missing, or another model's)")
    if args.data.prompt_format == "chat" and tokenizer.chat_template is None:
        raise UsageError("--prompt-format chat: this tokenizer has no chat template; use plain or auto")

    def encoded(rows: list[dict], name: str) -> list[dict]:
        return encoded_split(rows, name, lambda rows: encode_dataset(rows, tokenizer, args.data), args.data)
    train_rows = encoded(files.train_rows, "train set")
    if args.sampling.prompts_per_step > len(train_rows):
        raise UsageError(f"--prompts-per-step {args.sampling.prompts_per_step} is more than the train set's "
                         f"{len(train_rows)} questions")
    eval_rows = encoded(files.eval_rows, "eval set") if args.run.eval_every else []
    return Inputs(model_dir, shape, files.start_step, tokenizer,
                  end_of_sequence_ids(tokenizer, files.config, model_dir, args.data.prompt_format != "plain"
                                      and tokenizer.chat_template is not None), train_rows,
                  eval_rows[: args.run.eval_samples])


# ===== The memory plan: what each GPU holds, checked before vLLM starts =====
GiB = 2**30
# Besides the tensors counted below (measured on an H100, tests/test_gpu_memory.py): the CUDA context with its
# kernels' workspaces; what a sleeping engine keeps (its CUDA graphs' pool, sampler buffers); what vLLM needs
# to start besides its weights and a sequence's KV cache (activations while it profiles, graphs); a process's
# host memory besides an offloaded optimizer and saves' copies (torch, vLLM, an offloaded step's staging).
CUDA_CONTEXT_BYTES = 0.75 * GiB
VLLM_ASLEEP_BYTES = 1.0 * GiB
VLLM_SAMPLER_BYTES = 1.0 * GiB  # outside vLLM's share: its sampler's temporaries over the vocabulary
VLLM_WORKING_BYTES = 3.0 * GiB
HOST_BYTES_PER_PROCESS = 8.0 * GiB
USABLE = 0.97  # of the GPU's memory
# PyTorch's caching allocator keeps blocks that micro-batches freed but split (measured: a third of a
# micro-batch's bytes while training, a tenth to a seventh of them beside vLLM).
CACHED_WHILE_TRAINING, CACHED_WHILE_GENERATING = 0.35, 0.15
CACHED_BESIDE_GRADIENTS = 0.25  # and a quarter of the fp32 gradient sums' size while training (8B shape)


def parameter_counts(shape: ModelShape) -> tuple[int, int]:
    """(parameters in all, in one transformer block)."""
    sizes = {name: math.prod(dims) for name, dims in shape.parameters.items()}
    return sum(sizes.values()), sum(n for name, n in sizes.items() if name.startswith("layers.0."))


def memory_plan(shape: ModelShape, args, gpus: int, gpu_bytes: int, keep_gathered: bool = False,
                vllm_awake: bool = False) -> dict[str, dict[str, float]]:
    """Bytes one GPU holds at the peak of each phase, by what holds them: while vLLM generates (the trainer's
    state waits), while the trainer runs a micro-batch (vLLM asleep, or `vllm_awake` beside it), and while
    AdamW steps. FSDP2 shards the trainer over torchrun's `gpus` processes (`keep_gathered`: see
    `shard_model`); each runs a vLLM engine."""
    from batch_invariant_backward import micro_batch_bytes  # torch's: imported when the plan is made
    e, (n, block), model_args = args.engine, parameter_counts(shape), shape.args
    shard, on_gpu = n / gpus, 0 if e.offload_optimizer else 1
    state = {"bf16 weights": 2 * shard, "fp32 masters": 4 * shard * on_gpu,
             "AdamW moments": 8 * shard * on_gpu}
    if args.loss.kl_coef:
        state["reference policy"] = 2 * shard
    fsdp = {}  # FSDP2: the root (embedding, lm_head), two blocks, a block's gradient reduced in fp32
    if gpus > 1 and keep_gathered:  # the whole bf16 weights, their gradients summed whole in fp32
        # and a unit's sums copied to be reduce-scattered (gathered, in the first forward: no sums yet)
        fsdp = {"weights gathered": 2 * n,
                "unsharded fp32 gradients": 4 * n + 4 * blocks_per_unit(block) * block}
    elif gpus > 1:
        fsdp["gathered by FSDP2"] = 2 * (n - model_args.n_layers * block) + 4 * block + 6 * block
    context = {"CUDA context": CUDA_CONTEXT_BYTES}
    vllm = {"vLLM": e.vllm_gpu_memory * gpu_bytes + VLLM_SAMPLER_BYTES}
    beside = vllm if vllm_awake else {"vLLM asleep": VLLM_ASLEEP_BYTES}  # vLLM's while the trainer works
    grads = {"fp32 gradient sums": 4 * shard}
    # bf16 gradients: one at a time (the embedding's the largest), under FSDP2 this rank's shards of them all
    embedding, offloaded = model_args.vocab_size * model_args.dim, (1 - on_gpu) / gpus  # the largest weight
    bf16_grads = 2 * (shard if gpus > 1 and not keep_gathered else embedding)
    micro_batch = micro_batch_bytes(model_args, e.max_tokens_per_microbatch, e.activation_checkpointing,
                                    bf16_grads)
    # the exact sampler's record of each drawn token and its logprob (int64 + fp32), a row a request and a
    # column a draw, a spare of each (batch_invariant_backward.SampledLogprobs)
    requests = args.sampling.prompts_per_step * args.sampling.samples_per_prompt / gpus
    recorded = 12 * (requests + 1) * (args.sampling.max_new_tokens + 1)
    return {
        "generating": context | vllm | state
        | {"PyTorch's cache": CACHED_WHILE_GENERATING * micro_batch, "sampled tokens' record": recorded},
        "training": context | beside | state | fsdp | grads | {
            "activations, bf16 gradients": micro_batch,
            "PyTorch's cache": CACHED_WHILE_TRAINING * micro_batch + CACHED_BESIDE_GRADIENTS * 4 * shard},
        # fused AdamW: no temporary; offloaded, beside the sums: two weights' masters come up (4 bytes a value
        # each), a bf16 rounding (2) and the copies that measure its change (12)
        "the optimizer step": context | beside | state | grads | {"fp32 copies": 22 * embedding * offloaded},
    }


def memory_problem(shape: ModelShape, args, gpus: int, gpu_bytes: int, host: tuple[int, int] | None,
                   keep_gathered: bool = False, vllm_awake: bool = False):
    """What does not fit in the GPU's `gpu_bytes`, or in `host` = (bytes available, processes sharing them);
    None if everything fits."""
    a, e, (n, _) = shape.args, args.engine, parameter_counts(shape)
    sequence = args.data.max_prompt_tokens + args.sampling.max_new_tokens
    vllm = 2 * n + 2 * 2 * a.n_layers * a.n_kv_heads * a.head_dim * sequence + VLLM_WORKING_BYTES
    if vllm > e.vllm_gpu_memory * gpu_bytes:
        return (f"vLLM's share (--vllm-gpu-memory {e.vllm_gpu_memory:g}: "
                f"{e.vllm_gpu_memory * gpu_bytes / GiB:.1f} GiB) cannot hold its weights, a sequence's KV "
                f"cache and its workspace ({vllm / GiB:.1f} GiB)")
    for stage, parts in memory_plan(shape, args, gpus, gpu_bytes, keep_gathered, vllm_awake).items():
        if sum(parts.values()) > USABLE * gpu_bytes:
            largest = sorted(parts.items(), key=lambda part: -part[1])[:4]
            return (f"{stage} needs {sum(parts.values()) / GiB:.1f} of the GPU's {gpu_bytes / GiB:.1f} GiB ("
                    + ", ".join(f"{what} {size / GiB:.1f}" for what, size in largest) + ")")
    saves = args.run.save_every >= 0  # saves copy the GPU's tensors to the host
    pinned = lambda nbytes: saves * sum(1 << (int(b) - 1).bit_length() for b in nbytes)  # as PyTorch rounds
    # a rank's fp32 shards; its bf16 ones take half of that, as powers of two do
    fp32 = pinned(4 * math.prod(dims) / gpus for dims in shape.parameters.values())
    state = (12 * n / gpus if e.offload_optimizer else 3 * fp32) + bool(args.loss.kl_coef) * fp32 / 2  # + ref
    if host is not None and state:
        available, processes = host
        bf16_weights = pinned(2 * math.prod(dims) for dims in shape.checkpoint.values())  # a save's copies
        needs = processes * (state + HOST_BYTES_PER_PROCESS) + bf16_weights
        if needs > available:
            return (f"the optimizer's state, offloaded or copied by saves, needs {needs / GiB:.1f} GiB of "
                    f"host memory, {available / GiB:.1f} GiB are available")
    return None


class Fit(NamedTuple):
    """What else fits, besides the run itself (`check_memory`)."""
    keep_gathered: bool  # a sharded trainer keeps a step's weights gathered (`shard_model`)
    vllm_awake: bool  # vLLM stays awake beside the trainer: no memory handed over twice a step


def check_memory(shape: ModelShape, args, gpus: int, gpu_bytes: int, host: tuple[int, int] | None) -> Fit:
    """Refuses a run that would run out of GPU (or host) memory, naming changes with which it would fit.
    Where it fits, says whether a sharded trainer fits with a step's weights kept gathered, and then whether
    vLLM's share fits beside the training phase: its sleep and wake (~0.2 s a step on an H200) and the
    trainer's allocations made anew each step (emptied for vLLM's wake) are then saved."""
    problem = memory_problem(shape, args, gpus, gpu_bytes, host)
    if problem is None:
        kept = gpus > 1 and not memory_problem(shape, args, gpus, gpu_bytes, host, keep_gathered=True)
        return Fit(kept, not memory_problem(shape, args, gpus, gpu_bytes, host, kept, vllm_awake=True))
    e = args.engine

    def engine(**changes):
        return dataclasses.replace(args, engine=dataclasses.replace(e, **changes))
    shortest, tokens = args.data.max_prompt_tokens + args.sampling.max_new_tokens, e.max_tokens_per_microbatch
    kinds = [  # each kind of change, from the least to the most
        [("--activation-checkpointing", engine(activation_checkpointing=True), gpus)],
        [(f"--max-tokens-per-microbatch {t}", engine(max_tokens_per_microbatch=t), gpus)
         for t in (tokens // 2, tokens // 4) if t >= shortest],
        [("--offload-optimizer", engine(offload_optimizer=True), gpus),
         ("--offload-optimizer --activation-checkpointing",
          engine(offload_optimizer=True, activation_checkpointing=True), gpus)],
        [(f"--vllm-gpu-memory {share:g}", engine(vllm_gpu_memory=share), gpus)
         for share in (0.4, 0.3) if share < e.vllm_gpu_memory],
        [(f"torchrun --nproc-per-node {n}{flag}", changed, n) for n in (2, 4, 8) if n > gpus
         for flag, changed in (("", args), (" --activation-checkpointing",
                                            engine(activation_checkpointing=True)))],
        [("--save-every -1", dataclasses.replace(args, run=dataclasses.replace(args.run, save_every=-1)),
          gpus)],  # host memory: no saves, no copies
    ]
    fits = [next((what for what, changed, n in kind if not memory_problem(
        shape, changed, n, gpu_bytes, host and (host[0], host[1] * n // gpus))), None) for kind in kinds]
    fits = [what for what in fits if what][:3]
    raise UsageError(f"{parameter_counts(shape)[0] / 1e9:.2f}B parameters do not fit: {problem}; "
                     + (f"it would fit with {' or '.join(fits)}" if fits else "no one change makes it fit"))


def check_gpu_memory(shape: ModelShape, args, world) -> Fit:
    """`check_memory` on this rank's GPU and host; prints the plan once."""
    import torch
    gpu_bytes = torch.cuda.mem_get_info()[1]
    try:
        available = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo")
                         if line.startswith("MemAvailable"))
        host = (available, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except (OSError, StopIteration):  # not Linux: the host is not checked
        host = None
    fit = check_memory(shape, args, world.size, gpu_bytes, host)
    if world.is_main:
        peaks = [f"{stage} {sum(parts.values()) / GiB:.1f}" for stage, parts
                 in memory_plan(shape, args, world.size, gpu_bytes, *fit).items()]
        fsdp = "; FSDP2 keeps a step's weights gathered" if fit.keep_gathered else ""
        awake = "; vLLM stays awake beside the trainer" if fit.vllm_awake else ""
        print(f"GPU memory planned, GiB of {gpu_bytes / GiB:.1f}: {', '.join(peaks)}{fsdp}{awake}")
    return fit


# ===== Several GPUs (torchrun): data parallel, an FSDP2-sharded trainer =====
def init_distributed(device: str, host_adamw: bool = False) -> tuple[int, int]:
    """Under torchrun (WORLD_SIZE > 1) join the process group (NCCL, or gloo on CPU) on this rank's GPU.
    Torch's host threads (OpenMP's, one a core by default) spin between parallel regions, and beside any other
    busy thread (DCP's checkpoint writer, another process) a region waits for a worker the kernel put off: a
    1.7B train phase on one H200 took 5.4-6.5 s beside one busy process, 3.7 s alone, 3.7-4.0 s either way on
    one thread. A GPU trainer's host work is launches and small tensors: one thread, as torchrun gives each of
    several ranks (OMP_NUM_THREADS=1, unless set; another value set stands). With `host_adamw`
    (--offload-optimizer) a rank that has one takes its share of the host's cores instead: AdamW on one thread
    made the 8B's train phase on 2 H200s 16.9 s, 9.0 s on 16. A CPU-run trainer keeps its count: its matmuls
    sum otherwise on another (AdamW's elementwise update does not). Returns (rank, size): (0, 1) alone."""
    import torch
    import torch.distributed as dist
    size = torchrun_rank_and_size()[1]
    if os.environ.get("OMP_NUM_THREADS", "1") == "1":
        if host_adamw and size > 1:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            torch.set_num_threads(max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", size))))
        elif device == "cuda" and not host_adamw:
            torch.set_num_threads(1)
    if size > 1 and not dist.is_initialized():
        if device == "cuda":
            gpu = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(gpu)
            # device_id connects NCCL now: vLLM's batch-invariant mode later sets NCCL_MAX_NCHANNELS=1 and
            # NCCL_NTHREADS=1, read at connect, and FSDP would run on one channel (~1/10 speed, 2 GPUs = 1).
            dist.init_process_group("nccl", device_id=gpu)
        else:
            dist.init_process_group("gloo")
    return (dist.get_rank(), size) if size > 1 else (0, 1)


def agreed_run_name(args, world):
    """`args` with rank 0's run name: under torchrun each rank named the run by its own clock (`check_args`),
    and two ranks' seconds can differ."""
    if world.size == 1:
        return args
    import torch.distributed as dist
    name = [args.run.run_name]
    dist.broadcast_object_list(name, src=0)
    return dataclasses.replace(args, run=dataclasses.replace(args.run, run_name=name[0]))


KEPT_GATHERED_UNIT_BYTES = 1 * GiB


def blocks_per_unit(block: int) -> int:
    """Kept gathered, an FSDP2 unit's blocks (of `block` parameters each): as many as hold
    `KEPT_GATHERED_UNIT_BYTES` of fp32 gradient sums, which its reduce-scatter copies; at least one. The
    0.6B shape 17, 1.7B 5, 4B 2, 8B and 30B-A3B 1."""
    return max(1, int(KEPT_GATHERED_UNIT_BYTES // (4 * block)))


def shard_model(model, world, keep_gathered: bool = False):
    """FSDP2, a unit per block (kept gathered, a few) plus the root (embedding, final norm, maybe-tied
    lm_head). Gradients reduce-scatter as fp32 sums, not means: the loss is already divided by all ranks'
    token count.
    `keep_gathered`: a step gathers the weights and reduce-scatters once (simple_rl's
    `reduce_gradients_after`); its weight-gradient GEMMs add into FSDP2's fp32 sums
    (`gradient_sums_in_place`), in units of `blocks_per_unit` blocks: FSDP2's hooks run a unit
    at a time each micro-batch, on the host that launches the GPU's work (a 1.7B step's 16 forwards on a
    2-GPU rank, a unit a block: +0.15-0.22 s of host time; on a CPU, 28 blocks: +8.7-9.3 ms a micro-batch over
    an unsharded trainer, +3.1-4.3 ms at 5 a unit), and kept gathered a unit's size sets only its
    collectives' buffers. `model.fsdp_units`: each unit's modules, the root last."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(model.device.type, (world.size,))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    blocks = list(model.layers)
    size = blocks_per_unit(sum(p.numel() for p in blocks[0].parameters())) if keep_gathered else 1
    # blocks before the root, whose unit takes the parameters no other unit took
    model.fsdp_units = [blocks[i: i + size] for i in range(0, len(blocks), size)] + [[model]]
    for unit in model.fsdp_units:
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, mp_policy=policy)
        unit[0].set_gradient_divide_factor(1.0)  # a unit's modules share its settings
        unit[0].set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no pre-multiplied one
    model.keep_gathered = keep_gathered
    if keep_gathered:
        model.register_forward_hook(gradient_sums_in_place)
    return model


def fsdp_params(model) -> list:
    """FSDP2's record of each of its units' parameters (torch 2.11's `FSDPParam`s)."""
    return [p for unit in model.fsdp_units for p in unit[0]._get_fsdp_state()._fsdp_param_group.fsdp_params]


def gradient_sums_in_place(model, args, output) -> None:
    """Kept gathered, after a step's first forward: each gathered weight's fp32 gradient sum (FSDP2's, which
    its last backward reduce-scatters) made now and named its `main_grad`, so the weight-gradient GEMMs add
    into it as on one GPU. Else each writes a bf16 dW that FSDP2 copies or adds into the sum: 2,486 adds and
    337 copies, ~0.1 s of a 2.05 s train phase (1.7B, 2 H200s), and a bf16 rounding per micro-batch (FSDP2
    still rounds the reduce-scattered sum to the weights' dtype, once a step)."""
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
    if not torch.is_grad_enabled():
        return
    for p in fsdp_params(model):  # gathered (a forward that reshards leaves none) and not summing yet
        if p.sharded_state == ShardedState.UNSHARDED and p.unsharded_accumulated_grad is None:
            p.unsharded_accumulated_grad = torch.zeros_like(p.unsharded_param, dtype=p.reduce_dtype)
            p.unsharded_param.main_grad = p.unsharded_accumulated_grad


def reshard(model) -> None:
    """Every unit's weights back in their shards, and no gathered gradient or sum left: the step's
    reduce-scatter has read them, or the step failed and the next must not add to them (nor a full fp32 copy
    outlive the step)."""
    for unit in model.fsdp_units:
        unit[0].reshard()
    for p in fsdp_params(model):
        p.unsharded_accumulated_grad = None
        if hasattr(p, "_unsharded_param"):  # made at a unit's first gather
            p._unsharded_param.grad = p._unsharded_param.main_grad = None


def gather_step(rollouts, trainer_logprobs: list, world):
    """Every rank's `Rollouts` and trainer logprobs in rank (= sample) order: parity sees the whole step. One
    gather, each rank's lengths, tokens and fp32 values' bits in one int64 tensor (a gather a field, each with
    its sizes first, took 0.07 s of a 2-GPU step)."""
    if world.size == 1:
        return rollouts, trainer_logprobs
    import array
    import itertools
    import torch
    r, n = rollouts, len(rollouts.prompts)  # as many samples on every rank
    ints = itertools.chain(map(len, r.prompts), map(len, r.completions), *r.prompts, *r.completions)
    values = torch.cat([*r.vllm_logprobs, *trainer_logprobs, r.rewards, r.advantages]).float()
    everyone = world.gather(torch.cat([torch.frombuffer(array.array("q", ints), dtype=torch.int64),
                                       values.view(torch.int32).long()]))
    fields, at = [[] for _ in range(6)], 0  # prompts, completions, vLLM's and the trainer's logprobs, ...
    for _ in range(world.size):  # each rank's part in the order it was written
        lengths = everyone[at: (at := at + 2 * n)].tolist()
        tokens = iter(everyone[at: (at := at + sum(lengths))].tolist())
        sequences = [list(itertools.islice(tokens, k)) for k in lengths]
        completion_lens = lengths[n:]
        bits = everyone[at: (at := at + 2 * sum(completion_lens) + 2 * n)]
        floats = bits.int().view(torch.float32).split([*completion_lens, *completion_lens, n, n])
        for field, part in zip(fields, (sequences[:n], sequences[n:], floats[:n], floats[n: 2 * n],
                                        floats[2 * n: 2 * n + 1], floats[2 * n + 1:])):
            field += part
    prompts, completions, vllm_logprobs, logprobs, rewards, advantages = fields
    return dataclasses.replace(r, prompts=prompts, completions=completions, vllm_logprobs=vllm_logprobs,
                               rewards=torch.cat(rewards), advantages=torch.cat(advantages),
                               sampler_experts=None), logprobs


def shard_like(local, param):
    """This rank's part of a tensor sharded as `param` is (an FSDP2 DTensor), as a DTensor DCP can save and
    reshard, without a copy: it loads into `local`, on the host too (FSDP2 builds its offloaded shards so)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    if not isinstance(param, DTensor):
        return local
    meta = TensorMeta(param.shape, param.stride(), local.dtype)
    spec = DTensorSpec(param.device_mesh, param.placements, meta)
    return DTensor(local, spec, requires_grad=False)


# ===== Checkpoints and resume: Hugging Face weights, sharded training state, the parity record =====
TRAINING_STATE = "training_state"  # vLLM and transformers read only the top level: a plain HF checkpoint
SHARD_BYTES = 4 * 2**30  # weights past this go in model-0000i-of-0000n.safetensors shards, as the hub's do
TOKENIZER_FILES = ("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template",
                   "generation_config")


def write_hf_checkpoint(weights: dict, source_dir: Path, directory: Path) -> None:
    """Host `weights` (HF names) as the hub's safetensors files (sharded as huggingface_hub shards them),
    with the source's config and tokenizer."""
    import safetensors.torch
    from huggingface_hub import split_torch_state_dict_into_shards
    split = split_torch_state_dict_into_shards(weights, max_shard_size=SHARD_BYTES)
    for file, names in split.filename_to_tensors.items():
        safetensors.torch.save_file({name: weights[name] for name in names}, directory / file,
                                    metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = json.dumps(read_config(source_dir) | {"torch_dtype": "bfloat16"}, indent=2)
    (directory / "config.json").write_text(config)
    for f in source_dir.iterdir():
        if f.name.startswith(TOKENIZER_FILES):
            shutil.copy(f, directory / f.name)


def training_state(optimizer, ref_model) -> dict:
    """What --resume needs beyond the weights, for DCP: the fp32 masters and AdamW's moments of `optimizer`
    (simple_rl.MasterWeights), this rank's shards of them; the reference policy; the random generators."""
    import torch
    adam = optimizer.optimizer.state
    named = [(name, p, master) for (name, p), master in zip(optimizer.named, optimizer.masters)]
    # One copy of the generators (DCP keeps one of a key): every rank seeds alike, the loop draws from none
    # (an addition that draws differently per rank would need them per rank to resume bit for bit).
    rng = {"python": torch.tensor(random.getstate()[1]), "torch": torch.get_rng_state()}
    state = {"masters": {name: shard_like(master, p) for name, p, master in named},
             "adam": {name: {key: shard_like(t, p) if t.dim() else t for key, t in adam[master].items()}
                      for name, p, master in named},
             "rng": rng | ({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})}
    if ref_model is not None:
        state["reference"] = dict(ref_model.named_parameters())
    return state


def stack_versions() -> dict:
    from importlib.metadata import version
    import torch
    smi = shutil.which("nvidia-smi")
    driver = smi and os.popen(f"{smi} --query-gpu=driver_version --format=csv,noheader").read().split("\n")[0]
    return {"torch": torch.__version__, "vllm": version("vllm"), "triton": version("triton"),
            "cuda": torch.version.cuda, "driver": driver or None,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def parity_record(args, model, totals: dict) -> dict:
    """The run's certificate of exactness: the tokens checked and mismatched (`totals`), with what computed
    them: the stack, vLLM's settings, the matmul tiles of the model's GEMMs."""
    from batch_invariant_backward import CUDA_GRAPHS, _num_sms, matmul_tiles, qwen3_gemms
    a, device, exact = model.args, model.device, os.environ.get("VLLM_BATCH_INVARIANT") == "1"
    sms = _num_sms(device) if device.type == "cuda" else 132  # an H100's, for a run on the CPU
    gemms = qwen3_gemms(a.dim, a.hidden_dim, a.n_heads, a.n_kv_heads, a.head_dim, a.vocab_size)
    if a.moe_enabled:  # the experts run in vLLM's fused MoE kernels (one tile configuration), the router here
        gemms = {name: nk for name, nk in gemms.items() if name not in ("gate_up", "down")}
        gemms["router"] = (a.moe_args.num_experts, a.dim)
    tiles = {f"{name} rows={m}": list(matmul_tiles(m, n, k, sms).values())
             for name, (n, k) in gemms.items() for m in (1, 32, 256, 8192)}
    kernels = {"batch_invariant": exact, "model_runner": "V2" if exact else "V1",  # as VLLMEngine runs
               "cuda_graphs": CUDA_GRAPHS if args.engine.vllm_cuda_graphs else "eager",
               "matmul_tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)": tiles}
    return {"stack": stack_versions(), "kernels": kernels, "sampling": asdict(args.sampling), **totals}


def write_whole(path: Path, text: str) -> None:
    """All of `text`, or on a full disk the file as it was: a certificate is never left cut short."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_text(text)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


class CheckpointError(Exception):
    """A save that failed (a full disk): one line, exit status 1; the earlier checkpoints stand."""


def checkpoints_before(run_dir: Path, step: int) -> list[Path]:
    """A run's whole checkpoints (step_N) before `step`, oldest first. Later ones are those of the run that a
    run resumed from an earlier checkpoint branched from: each is replaced as the branch reaches its step."""
    found = [(int(d.name[5:]), d) for d in run_dir.glob("step_*") if d.name[5:].isdigit()]
    return [d for n, d in sorted(found) if n < step]


class Checkpoints:
    """<output_dir>/<run_name>/step_N, written as training goes on: `save` queues copies of what the step left
    to host memory and returns; dcp.async_save's thread (not a process: it writes the copies where they lie)
    writes them once they landed; `wait` (before the next save, at the last step, on an error) renames it once
    whole, keeping --keep-last. DCP's writer stages with `stage`, writes with `write_data` and finishes with
    `finish`, in one thread (DCP drops a writer thread's error).
    `hf_weights()`: the model's (HF name, tensor) pairs, gathered if sharded (every rank iterates them);
    `model_dir`: the checkpoint whose config and tokenizer a save copies."""
    under_way = None  # the instance whose save is being written: one at a time in a process

    def __init__(self, model, hf_weights: Callable, optimizer, ref_model, model_dir: Path, args, world):
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        # Page cache only (syncing doubled the save time): a kill keeps every save, a power cut earlier ones.
        # Host tensors only: no copy ahead (its CUDA stream, made in DCP's thread, would be on GPU 0).
        self.writer = dcp.FileSystemWriter(args.run.output_dir, sync_files=False, per_thread_copy_ahead=0)
        self.write_metadata = self.writer.finish  # DCP's own finish, which ours calls first
        self.writer.finish, self.writer.stage = self.finish, self.stage
        self.writer.write_data = self.write_data
        # The GPU's state goes to the host on a stream of its own, beside the next step's generation; AdamW,
        # the one writer of what a save copies, waits for those copies on the GPU (no cycle to self).
        device = next(model.parameters()).device
        self.copies = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self.copies is not None:
            optimizer.optimizer.register_step_pre_hook(
                lambda *_, copies=self.copies: torch.cuda.current_stream().wait_stream(copies))
        self.model, self.hf_weights, self.optimizer, self.ref_model, self.model_dir, self.args, self.world = (
            model, hf_weights, optimizer, ref_model, model_dir, args, world)
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None  # `save`; vLLM's NCCL
        if not optimizer.masters[0].is_cuda:  # its state is written where it lies (`stage`): AdamW waits
            optimizer.optimizer.register_step_pre_hook(lambda *_: Checkpoints.end_write())  # no cycle to self
        if args.run.save_every >= 0:  # pinned memory is slow to make: now, not in the first save
            # DCP writes each tensor with torch.save, whose CRC32 of every record took 60% of a write (1.7B
            # shape, 24 GB: 19 s against 7.5 s, H200 host) and slowed the steps beneath it. Off for every
            # later torch.save of the process (DCP's thread saves as training runs); torch.load never checks.
            torch.serialization.set_crc32_options(False)
            self.stage({"state": training_state(optimizer, ref_model),
                        "weights": {name: self.stage(t, wait=world.size > 1) for name, t in hf_weights()
                                    if world.is_main}})

    def stage(self, t, wait: bool = False):
        """In host memory training leaves alone: GPU tensors copied into PyTorch's pinned memory (freed, it
        serves the next save) on the stream `copies`, which `write_data` waits for (`wait`: this one now);
        host scalars cloned, other host tensors (offloaded: not copied) as they lie."""
        import torch
        if isinstance(t, dict):
            return {k: self.stage(v) for k, v in t.items()}
        local = t.to_local() if hasattr(t, "to_local") else t  # this rank's shard
        if not local.is_cuda:
            return t.clone() if t.dim() == 0 else t
        self.copies.wait_stream(torch.cuda.current_stream())  # the tensor as the step left it
        with torch.cuda.stream(self.copies):  # non_blocking: into PyTorch's cache of pinned host memory
            staged = shard_like(local.to("cpu", non_blocking=True), t)
        if wait:
            self.copies.synchronize()
        return staged

    def write_data(self, plan, planner):
        """DCP's thread: writes this rank's part once `stage`'s copies landed (on this rank's GPU, not GPU 0,
        the thread's default)."""
        import torch
        if self.copies is not None:
            with torch.cuda.device(self.copies.device):
                self.copies.synchronize()
        return type(self.writer).write_data(self.writer, plan, planner)

    def save(self, step: int, totals: dict, tensorboard=None) -> None:
        """Starts writing step_N; `held`: the seconds training waited (the last step waits for the write)."""
        begun, args, world, writing = time.perf_counter(), self.args, self.world, Checkpoints.under_way
        self.wait()
        if writing is self and world.is_main and (waited := time.perf_counter() - begun) > 1:  # a slow disk
            print(f"checkpoint step_{step:06d} waited {waited:.1f} s for {self.out_dir.name}'s write "
                  f"({self.ended - self.begun:.1f} s, against {begun - self.begun:.1f} s of steps between "
                  "the saves): save less often (--save-every) or to a faster disk")
        self.step, self.out_dir = step, Path(args.run.output_dir) / args.run.run_name / f"step_{step:06d}"
        self.tmp = self.out_dir.with_name(f".{self.out_dir.name}.partial")
        if world.is_main:  # a partial folder a killed run left goes (DCP makes the new one, in its thread)
            shutil.rmtree(self.tmp, ignore_errors=True)
            if tensorboard is not None:  # it holds every step up to here: should the run die
                tensorboard.flush()
        world.barrier()
        self.totals, self.saved, self.tensorboard = totals, dict(totals), tensorboard
        self.run = {"args": asdict(args), "step": step, "world_size": world.size}
        # All ranks gather. Gathered (sharded), a weight is a copy, freed next: its copy to the host ends
        # first, else the whole model's could pile up on the GPU, the copies behind the gathers.
        self.hf = {n: self.stage(t, wait=world.size > 1) for n, t in self.hf_weights() if world.is_main}
        # DCP's collectives run in its thread: on a group of their own (gloo: async_save wants a CPU one)
        import torch.distributed.checkpoint as dcp
        state = training_state(self.optimizer, self.ref_model)
        self.future = dcp.async_save(state, storage_writer=self.writer,
                                     checkpoint_id=self.tmp / TRAINING_STATE, process_group=self.group,
                                     no_dist=world.size == 1)
        Checkpoints.under_way, self.begun, self.held = self, begun, time.perf_counter() - begun
        if step == args.optimizer.steps:  # the run ends with it: nothing to overlap
            self.wait()

    def finish(self, metadata, results) -> None:  # rank 0's, once all ranks' parts are: its error reaches all
        self.write_metadata(metadata, results)
        write_hf_checkpoint(self.hf, self.model_dir, self.tmp)
        records = {"run.json": self.run, "parity.json": parity_record(self.args, self.model, self.saved)}
        for name, record in records.items():
            (self.tmp / TRAINING_STATE / name).write_text(json.dumps(record, indent=2))
        self.ended = time.perf_counter()

    @staticmethod
    def end_write(quietly: bool = False) -> None:
        """Until the save under way, if any, is written (`wait`): before AdamW's step, or at the end."""
        if Checkpoints.under_way is not None:
            Checkpoints.under_way.wait(quietly)

    def wait(self, quietly: bool = False) -> None:
        """Until the save under way is written (rank 0's DCP ends once every rank's part is); then renames it,
        or removes it and raises a CheckpointError on every rank (`quietly`, leaving on an error: not)."""
        if Checkpoints.under_way is not self:
            return
        Checkpoints.under_way, out, args, main = None, self.out_dir, self.args, self.world.is_main
        error, self.hf = self.future.exception(), None  # waits; DCP's error holds every rank's; weights freed
        if main:  # the partial folder, or the step_N it replaces
            shutil.rmtree(self.tmp if error else out, ignore_errors=True)
        if error and not quietly:
            causes = [*(cause for cause, _ in getattr(error, "failures", {}).values()), error]  # ranks' first
            disk = next((cause.strerror or cause for cause in causes if isinstance(cause, OSError)), None)
            self.world.barrier()  # every rank measures the disk once rank 0 removed the partial folder
            free = shutil.disk_usage(existing_parent(out)).free
            need = checkpoint_bytes(args, sum(p.numel() for p in self.model.parameters()))
            # A disk that fills mid-file is no OSError to torch.save ("unexpected pos": a short write) nor to
            # safetensors: the disk's too if the checkpoint no longer fits; the line names the error.
            if disk is None and free >= need:  # not the disk's
                raise error
            first_line = str(causes[0]).partition("\n")[0]
            why = disk or f"{type(causes[0]).__name__}: {first_line}"
            if main and self.tensorboard is not None:  # the steps done keep their certificate, if it fits
                record = json.dumps(parity_record(args, self.model, self.totals), indent=2)
                with suppress(OSError):  # else the last one stands, and the line is still this error's
                    write_whole(Path(self.tensorboard.log_dir) / "parity.json", record)
            if main and out.parent.is_dir() and not any(out.parent.iterdir()):
                out.parent.rmdir()  # the run's first save: nothing of it stays
            last = checkpoints_before(out.parent, self.step)
            raise CheckpointError(f"checkpoint {out} not written ({why}): "
                                  f"{in_units(free)} free, it takes about {in_units(need)}; the last whole "
                                  f"checkpoint is {last[-1] if last else 'none'}") from None
        if main and not error:  # every rank's part written: renamed into place
            self.tmp.rename(out)
            print(f"checkpoint {out} written in {self.ended - self.begun:.1f} s, a {self.held:.1f} s stall")
            oldest = checkpoints_before(out.parent, self.step + 1)[: -args.run.keep_last]
            for old in [*out.parent.glob(".step_*"), *oldest]:  # and what a run killed mid-save left
                if old.resolve() != self.model_dir.resolve():  # a resumed run's tokenizer is there
                    shutil.rmtree(old)


def restore_training_state(checkpoint_dir: Path, optimizer, ref_model, args, world) -> dict:
    """Into this run's shards whatever the number of ranks that saved it; returns the tokens checked and
    mismatched so far, and warns if another stack (torch, vLLM, GPU...) wrote it."""
    import torch
    import torch.distributed.checkpoint as dcp
    state = training_state(optimizer, ref_model)
    dcp.load(state, checkpoint_id=checkpoint_dir / TRAINING_STATE, no_dist=world.size == 1)
    for group in optimizer.optimizer.param_groups:
        group["weight_decay"] = args.optimizer.weight_decay  # may change on resume; the lr is set every step
    random.setstate((3, tuple(state["rng"]["python"].tolist()), None))
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"]:
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    saved = json.loads((checkpoint_dir / TRAINING_STATE / "parity.json").read_text())
    changed = [f"{key} {saved['stack'].get(key)} -> {now}" for key, now in stack_versions().items()
               if saved["stack"].get(key) != now]
    if changed and world.is_main:
        print(f"warning: --resume {checkpoint_dir} was saved on another stack ({', '.join(changed)}): the "
              "run continues bit for bit only on the same one")
    return {key: saved[key] for key in ("tokens_checked", "mismatched_tokens")}


# ===== Logging: the terminal and TensorBoard =====
@contextmanager
def timed_phase(name: str, times: dict, memory: dict, world=None):
    """Seconds, and the whole GPU's memory in use at the end: the peak, as PyTorch keeps what it reserved.
    Given the `world`, the phase ends on every rank when the slowest rank ends it: a rank that generated its
    share first would otherwise count its wait for the others (in the next phase's first collective) as its
    training."""
    import torch
    start = time.perf_counter()
    yield
    if world is not None:
        world.barrier()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        memory[name] = (total - free) / 2**30
    times[name] = time.perf_counter() - start


DISK_FULL = False  # a run leaving on a full disk: a thread dying as it exits (TensorBoard's) goes unseen


def copy_lines(path: str, verbose: bool) -> None:  # `log_to_file`'s copier, run in a Python of its own
    import contextlib, sys, time
    with open(path, "ab", buffering=0) as log:  # unbuffered: on a full disk a line is lost, not a buffer
        for line in sys.stdin.buffer:  # to the end: when no process writes to the pipe any more
            with contextlib.suppress(OSError):  # a full disk: still drain the pipe, or stderr's writers block
                log.write(time.strftime("%Y-%m-%d %H:%M:%S ").encode() + line)
            if verbose:
                print(line.decode(errors="replace"), end="", flush=True)


def log_to_file(run_name: str, verbose: bool, world) -> None:
    """From here on, all that reaches stderr, from Python or C++ (vLLM's log and progress bars, torch's and
    DCP's warnings), goes to runs/<run>/log.txt a line at a time, timestamped (log.rank<r>.txt on other
    ranks); with `verbose` (or VLLM_LOGGING_LEVEL=INFO) to the terminal too. The script's own lines are on
    stdout, its errors and any traceback on the terminal's stderr; an abort's Python stacks too."""
    import atexit, faulthandler, marshal, subprocess, traceback
    global TERMINAL
    verbose = verbose or os.environ.get("VLLM_LOGGING_LEVEL", "").upper() == "INFO"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")  # all of vLLM's log: it goes to the file
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    path = Path("runs") / run_name / ("log.txt" if world.is_main else f"log.rank{world.rank}.txt")
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    terminal, (read, write) = os.dup(2), os.pipe()
    # A process, not a thread, so that it outlives an abort of this one (NCCL's watchdog, C++) to log why;
    # it runs copy_lines' compiled code, not the file's text, which may have changed since it was read.
    call = f"types.FunctionType(marshal.loads({marshal.dumps(copy_lines.__code__)!r}), globals())"
    code = f"import marshal, types; {call}({str(path)!r}, {verbose})"
    copier = subprocess.Popen([sys.executable, "-c", code], stdin=read, stdout=terminal,
                              start_new_session=True)  # Ctrl-C: it still copies the last lines
    os.close(read)
    os.dup2(write, 2)  # fd 2 itself: C++ writes there too
    os.close(write)
    TERMINAL = os.fdopen(terminal, "w", buffering=1)
    faulthandler.enable(TERMINAL)  # a fatal signal: where each thread was, on the terminal
    sys.excepthook = lambda *exc: [traceback.print_exception(*exc, file=to) for to in (TERMINAL, sys.stderr)]

    def close() -> None:  # at exit: the pipe's last lines reach the file
        import torch.distributed as dist
        if dist.is_initialized():  # vLLM's group, or torchrun's: else NCCL warns on the terminal as it exits
            dist.destroy_process_group()
        sys.stderr.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY) if DISK_FULL else terminal, 2)  # a crash at exit: shown
        with suppress(subprocess.TimeoutExpired):  # the pipe ends when a child holding it ends too
            copier.wait(timeout=5)
    atexit.register(close)


def progress_bar(steps: range, name: str, world):
    """The steps, with a progress bar on the main rank."""
    from tqdm import tqdm
    return tqdm(steps, desc=name, unit="step", file=sys.stdout, initial=steps.start, total=steps.stop,
                disable=not world.is_main)


def log_line(line: str, world) -> None:
    from tqdm import tqdm
    if world.is_main:
        tqdm.write(line)  # above the progress bar


def open_tensorboard(args, start_step: int):
    """runs/<run_name>; a resumed run purges the steps it logged after its checkpoint: each shows once."""
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(str(Path("runs") / args.run.run_name), purge_step=start_step or None)
    rows = [f"| {group}.{k} | {v} |" for group, values in asdict(args).items() for k, v in values.items()]
    rows.append(f"| VLLM_BATCH_INVARIANT | {os.environ.get('VLLM_BATCH_INVARIANT')} |")
    writer.add_text("config", "| flag | value |\n|---|---|\n" + "\n".join(rows), start_step)
    return writer


def log_step(writer, step: int, scalars: dict, line: str, world) -> None:
    if world.is_main and writer is not None:  # None: a step run outside a run (bench.py)
        for key, value in scalars.items():
            writer.add_scalar(key, value, step)
    log_line(line, world)


def step_scalars(rollouts, loss_metrics: dict, parity: dict, grad_norm: float, lr: float,
                 deltas: dict, times: dict, memory: dict) -> dict:
    n_generated = sum(len(c) for c in rollouts.completions)
    scalars = {f"train/{k}": v for k, v in loss_metrics.items()} | {
        "train/grad_norm": grad_norm, "train/lr": lr, "reward/reward_mean": float(rollouts.rewards.mean()),
        "reward/reward_std": float(rollouts.rewards.std()),
        "reward/completion_tokens_mean": n_generated / len(rollouts.completions),
        "perf/generate_tokens_per_s": n_generated / times["generate"],
        "perf/train_tokens_per_s": n_generated / times["train"]}
    scalars |= {f"parity/{k}": v for k, v in parity.items()}
    scalars |= {f"time/{k}": v for k, v in times.items()} | {f"memory/{k}_gib": v for k, v in memory.items()}
    scalars |= {f"weight_delta/{layer}/{name}": value for layer, pair in deltas.items()
                for name, value in zip(("magnitude", "relative_change"), pair)}
    return scalars


def step_line(step: int, scalars: dict, times: dict, memory: dict) -> str:
    return (f"step {step}: reward {scalars['reward/reward_mean']:.3f} loss {scalars['train/loss']:+.5f} "
            f"ratio {scalars['train/ratio_mean']:.6f} grad {scalars['train/grad_norm']:.3f} | "
            + " ".join(f"{k} {v:.2f}s" for k, v in times.items())
            + (f" | GPU {max(memory.values()):.1f} GiB" if memory else ""))


def log_eval(writer, updates: int, accuracy: float, questions: int, world) -> None:
    """Greedy accuracy, logged at the number of GRPO updates made so far."""
    if world.is_main:
        writer.add_scalar("eval/accuracy", accuracy, updates)
    log_line(f"after {updates} GRPO steps: greedy accuracy {accuracy:.3f} on {questions} test questions",
             world)


def routing_metrics(model, world) -> dict:
    """A mixture of experts' routing over the step's training forwards, per layer: how unevenly the tokens
    spread (the busiest expert's over the mean; 1 is even) and the router's entropy (nats a token; ln E is
    uniform). Read once a step: the sums restart."""
    moes = [layer.moe for layer in model.layers if hasattr(layer, "moe") and layer.moe.routed is not None]
    if not moes:
        return {}
    import torch
    routed = world.sum(torch.stack([moe.routed for moe in moes])).cpu()  # (layers, E + 1)
    for moe in moes:
        moe.routed = None
    load, entropy = routed[:, :-1], routed[:, -1] * moes[0].top_k / routed[:, :-1].sum(-1)
    return {name: float(value) for i, (row, e) in enumerate(zip(load, entropy))
            for name, value in ((f"expert_load_max_over_mean/layer_{i:02d}", row.max() / row.mean()),
                                (f"router_entropy/layer_{i:02d}", e))}


def weight_deltas(changes: dict, world) -> dict:
    """Per layer, over all ranks: the L2 norm of a step's weight change, and that relative to the weights."""
    import torch
    squares = {}
    for name, square in changes.items():
        parts = name.split(".")
        layer = (f"layer_{int(parts[1]):02d}" if parts[0] == "layers" else
                 {"tok_embeddings": "embeddings", "norm": "final_norm", "output": "lm_head"}[parts[0]])
        squares[layer] = squares.get(layer, 0) + square
    totals = world.sum(torch.stack(list(squares.values()))).sqrt().tolist()
    return {layer: (change, change / size) for layer, (change, size) in zip(squares, totals)}


def fp32_hex(x: float) -> str:
    """The fp32 bit pattern: two logprobs one ulp apart print differently (bf16 would hide it)."""
    return f"0x{struct.unpack('<I', struct.pack('<f', x))[0]:08x}"


def parity_report(vllm_logprobs: list, trainer_logprobs: list, tokens: list[list[int]], show: int,
                  mismatched: int) -> str:
    """The first `show` tokens of sample 0 with both logprobs and their fp32 bits; the count."""
    header = ("token", "vllm logprob", "trainer logprob", "vllm fp32 bits", "trainer fp32 bits", "diff")
    lines = ["  {:>8} {:>16} {:>16} {:>14} {:>17} {:>10}".format(*header)]
    for tok, a, b in list(zip(tokens[0], vllm_logprobs[0].tolist(), trainer_logprobs[0].tolist()))[:show]:
        lines.append(f"  {tok:>8} {a:>16.9f} {b:>16.9f} {fp32_hex(a):>14} {fp32_hex(b):>17} {b - a:>10.3g}")
    lines.append(f"  Bitwise identical: {mismatched == 0}, different tokens {mismatched} / "
                 f"{sum(len(x) for x in vllm_logprobs)}")
    return "\n".join(lines if show else lines[-1:])


def log_parity(step: int, rollouts, trainer_logprobs, parity: dict, show: int, world) -> None:
    report = parity_report(rollouts.vllm_logprobs, trainer_logprobs, rollouts.completions, show,
                           parity["mismatched_tokens"])
    log_line((f"step {step} parity (first tokens of sample 0):\n" if show else "") + report, world)
