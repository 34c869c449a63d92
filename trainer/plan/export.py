"""A run config as another trainer's job: a torchtitan TOML job file, or Megatron-LM arguments.

    to_torchtitan_toml(config)  ->  the text of a torchtitan `--job.config_file`
    to_megatron_args(config)    ->  ["--num-layers=80", "--hidden-size=8192", ...] for pretrain_gpt.py

Option names were checked against torchtitan's TOML job config as its `torchtitan/config/job_config.py`
and `torchtitan/models/llama3/train_configs/llama3_70b.toml` had them in the second half of 2025
([compile] enable/components, [training] local_batch_size, [parallelism]
pipeline_parallel_layers_per_stage and *_stage_less_layers, [lr_scheduler] min_lr_factor), and against
Megatron-LM's `megatron/training/arguments.py` and its data-parallel docs of the same time
(--num-layers-per-virtual-pipeline-stage, --use-distributed-optimizer with
--num-distributed-optimizer-instances, --use-torch-fsdp2, --use-megatron-fsdp with
--data-parallel-sharding-strategy).

A layout the other trainer cannot run as loom would is refused with ExportError, keyed by the field
to change, never exported as something else: a schedule Megatron-LM lacks, ZeRO-1/2 in torchtitan
(FSDP2 shards parameters too), tensor parallelism without sequence parallelism in torchtitan, …
What runs the same layout but differs in detail is said: in comments in the TOML, and here for
Megatron-LM, whose argument list has no room for comments:

- Megatron's selective recompute recomputes the core attention (softmax and the two batched
  matmuls); loom's recomputes the attention sub-block with its projections, so it keeps less.
- Megatron computes the loss on vocabulary-parallel logits whatever parallel.loss_parallel says
  (the same numbers); compute.compile and compute.kernels are loom's own and not carried over.
- The vocabulary travels as `--tokenizer-type=NullTokenizer --vocab-size=<model.vocab − 1>`: Megatron's
  NullTokenizer adds one end-of-document id to the size it is given, and
  `--make-vocab-size-divisible-by=1` keeps Megatron from padding the total, so the model gets exactly
  model.vocab rows. NullTokenizer reads pre-tokenized ids; for text, replace both with
  `--tokenizer-type=HuggingFaceTokenizer --tokenizer-model=<your tokenizer, with model.vocab tokens>`.
  torchtitan takes the vocabulary from the model flavor and reads the tokenizer from
  `[model] hf_assets_path`, exported as a placeholder to fill in.
- The data and checkpointing are left to the user's own arguments.

Both carry what the run config holds, the optimizer's learning rate included; `export_warnings` says
when that is loom's demo default rather than a rate chosen for the model.
"""

from __future__ import annotations

import math

from trainer.config import ConfigError, OptimizerConfig, RunConfig
from trainer.pipeline_split import evenly, stage_block_counts
from trainer.plan.parameters import total_parameters
from trainer.plan.terms import count

MEGATRON_SCHEDULES = ("1F1B", "Interleaved1F1B")
DEMO_LR = OptimizerConfig.model_fields["lr"].default
TOKENIZER_PLACEHOLDER = "FILL IN: the directory of a Hugging Face tokenizer with {vocab} tokens"


class ExportError(ConfigError):
    """The layout has no equivalent in the target trainer; `errors` maps the field to change to why."""


def export_job(config: RunConfig, export_format: str) -> dict:
    """{"format", "text", "warnings": [{field, message}]}: the job in `export_format` (a key of
    EXPORTERS) and what in it the user should look at before running it."""
    return {"format": export_format, "text": EXPORTERS[export_format](config), "warnings": export_warnings(config)}


def export_warnings(config: RunConfig) -> list[dict]:
    optimizer = config.optimizer
    if optimizer.lr != DEMO_LR:
        return []
    parameters = total_parameters(config.model)
    size = f"{parameters / 1e9:,.1f} billion" if parameters >= 1e9 else count(parameters)
    message = (
        f"lr {DEMO_LR:g} is loom's demo default, sized for its small CPU models, and is exported as is for "
        f"this model of {size} parameters; large models train at a few 1e-4 "
        "(Llama 3 8B: 3e-4, 70B: 1.5e-4, 405B: 8e-5): set optimizer.lr"
    )
    return [{"field": "optimizer.lr", "message": message}]


def precision_of(config: RunConfig) -> str:
    """auto is bf16: an exported job runs on GPUs."""
    return "bf16" if config.compute.precision == "auto" else config.compute.precision


def total_stages(config: RunConfig) -> int:
    return config.parallel.pp * config.parallel.stages_per_rank


def uneven_split(config: RunConfig) -> bool:
    """Whether the embedding and the output count as a block each (trainer.pipeline_split)."""
    return not evenly(config.model.layers, total_stages(config))


def layers_per_stage(config: RunConfig) -> int:
    """Blocks of a middle stage: all of them where the split is even."""
    return max(stage_block_counts(config.model.layers, total_stages(config)))


def micro_seqs(config: RunConfig) -> int:
    """Sequences in one pipeline microbatch."""
    return config.data.micro_batch // config.parallel.microbatches


def global_batch(config: RunConfig) -> int:
    return config.global_batch


# ---- torchtitan ----


def to_torchtitan_toml(config: RunConfig) -> str:
    """The torchtitan job file (TOML) that runs this layout; raises ExportError where it cannot."""
    torchtitan_refusals(config)
    sections = [
        ("job", [], [("description", "exported from loom")]),
        ("model", *torchtitan_model(config)),
        (
            "optimizer",
            ["loom leaves norm weights out of weight decay; torchtitan decays every parameter"],
            torchtitan_optimizer(config),
        ),
        (
            "lr_scheduler",
            [],
            [
                ("warmup_steps", config.optimizer.warmup_steps),
                ("decay_type", "cosine"),
                ("min_lr_factor", config.optimizer.min_lr_ratio),
            ],
        ),
        (
            "training",
            [
                "loom trains on the Python standard library's sources (data.corpus): set dataset or "
                "dataset_path to yours"
            ],
            torchtitan_training(config),
        ),
        ("parallelism", torchtitan_parallelism_notes(config), torchtitan_parallelism(config)),
        ("activation_checkpoint", *torchtitan_recompute(config)),
        (
            "compile",
            ["loom compiles each transformer block, not the loss"],
            [("enable", config.compute.compile), ("components", ["model"])],
        ),
    ]
    return "".join(toml_section(name, notes, items) for name, notes, items in sections)


def torchtitan_model(config: RunConfig) -> tuple[list[str], list[tuple[str, object]]]:
    model = config.model
    note = (
        f'torchtitan builds models from registered flavors: register "loom" in torchtitan/models/llama3 as '
        f"TransformerModelArgs(dim={model.dim}, n_layers={model.layers}, n_heads={model.heads}, "
        f"n_kv_heads={model.kv_heads}, vocab_size={model.vocab}, rope_theta={model.rope_theta:g}, "
        f"norm_eps={model.norm_eps:g}) with ffn_dim_multiplier and multiple_of giving a feed-forward size of "
        f"{model.ffn}"
    )
    tokenizer_note = f"hf_assets_path: the tokenizer, which must have model.vocab = {model.vocab} tokens"
    items: list[tuple[str, object]] = [
        ("name", "llama3"),
        ("flavor", "loom"),
        ("hf_assets_path", TOKENIZER_PLACEHOLDER.format(vocab=model.vocab)),
    ]
    if precision_of(config) == "fp8":
        items.append(("converters", ["float8"]))
    return [note, tokenizer_note], items


def torchtitan_optimizer(config: RunConfig) -> list[tuple[str, object]]:
    optimizer = config.optimizer
    return [
        ("name", "AdamW"),
        ("lr", optimizer.lr),
        ("beta1", optimizer.beta1),
        ("beta2", optimizer.beta2),
        ("weight_decay", optimizer.weight_decay),
    ]


def torchtitan_training(config: RunConfig) -> list[tuple[str, object]]:
    clip = config.optimizer.grad_clip
    return [
        ("local_batch_size", config.data.micro_batch),
        ("global_batch_size", global_batch(config)),
        ("seq_len", config.model.seq_len),
        ("steps", config.steps),
        # loom's 0 turns clipping off; torchtitan always clips, and an infinite norm never does.
        ("max_norm", clip if clip > 0 else math.inf),
        ("mixed_precision_param", "float32" if precision_of(config) == "fp32" else "bfloat16"),
        ("mixed_precision_reduce", "float32"),
    ]


def torchtitan_recompute(config: RunConfig) -> tuple[list[str], list[tuple[str, object]]]:
    mode = config.compute.recompute
    if config.compute.recompute_every > 1:
        # torchtitan's "selective layer" checkpointing: every N-th block whole.
        return [], [("mode", "selective"), ("selective_ac_option", str(config.compute.recompute_every))]
    if mode != "selective":
        return [], [("mode", mode)]
    note = (
        "torchtitan's selective checkpointing works per operator and keeps matmul outputs; loom's "
        "recomputes the attention sub-block"
    )
    return [note], [("mode", mode), ("selective_ac_option", "op")]


def torchtitan_refusals(config: RunConfig) -> None:
    model, parallel = config.model, config.parallel
    reasons = {
        "model.experts": (
            model.experts > 1,
            "torchtitan's llama3 model is dense; its mixture-of-experts models "
            "(llama4, deepseek_v3) are other architectures",
        ),
        "model.mlp": (model.mlp != "swiglu", "torchtitan's llama3 model uses SwiGLU; use swiglu"),
        "model.tie_embeddings": (
            model.tie_embeddings,
            "torchtitan's llama3 model keeps the embedding and the output apart; use false",
        ),
        "model.parallel_blocks": (
            model.parallel_blocks,
            "torchtitan's llama3 model runs attention and the feed-forward block one after the other, each behind a "
            "norm of its own; use false",
        ),
        "parallel.sequence_parallel": (
            parallel.tp > 1 and not parallel.sequence_parallel,
            "torchtitan applies sequence parallelism with every tensor-parallel layout; use true",
        ),
        "parallel.zero_stage": (
            parallel.zero in (1, 2),
            "torchtitan shards with FSDP2, which shards parameters too (ZeRO-3); use 3, or 0 without sharding",
        ),
        "optimizer.offload": (
            config.optimizer.offload,
            "torchtitan's CPU offload moves parameters and gradients too, not only the optimizer states; use false",
        ),
        "model.rope_scaling": (
            model.rope_scaling is not None,
            "not mapped to the flavor a torchtitan job registers; export a model without it (null)",
        ),
        "compute.recompute_every": (
            config.compute.recompute_every > 1 and config.compute.recompute != "full",
            "torchtitan's per-layer checkpointing recomputes whole blocks; use recompute full, or recompute_every 1",
        ),
    }
    refuse(reasons)


def torchtitan_parallelism(config: RunConfig) -> list[tuple[str, object]]:
    parallel = config.parallel
    items: list[tuple[str, object]] = [
        ("data_parallel_replicate_degree", parallel.dp_replicate),
        ("data_parallel_shard_degree", parallel.dp_shard),
    ]
    if parallel.zero == 3:
        items.append(("fsdp_reshard_after_forward", "always" if parallel.reshard_after_forward else "never"))
    items += [
        ("tensor_parallel_degree", parallel.tp),
        ("disable_loss_parallel", not parallel.loss_parallel),
        ("enable_async_tensor_parallel", False),
        ("pipeline_parallel_degree", parallel.pp),
    ]
    if parallel.pp > 1:
        items += [
            ("pipeline_parallel_schedule", parallel.pp_schedule),
            ("pipeline_parallel_layers_per_stage", layers_per_stage(config)),
            ("pipeline_parallel_first_stage_less_layers", int(uneven_split(config))),
            ("pipeline_parallel_last_stage_less_layers", int(uneven_split(config))),
            ("pipeline_parallel_microbatch_size", micro_seqs(config)),
        ]
    items += [("context_parallel_degree", parallel.cp), ("expert_parallel_degree", parallel.ep)]
    return items


def torchtitan_parallelism_notes(config: RunConfig) -> list[str]:
    parallel = config.parallel
    notes = []
    if parallel.pp > 1:
        notes.append(
            f"{parallel.pp_schedule}, {parallel.stages_per_rank} stage(s) per rank of "
            f"{layers_per_stage(config)} layers each"
            + (
                ", the first and last one fewer: the embedding and output count as a layer each, as in loom's split"
                if uneven_split(config)
                else ": the embedding and output take no layers' place, as in loom's even split"
            )
        )
    if parallel.zero == 0 and parallel.dp_replicate > 1 and parallel.world_size > parallel.dp_replicate:
        notes.append(
            "DDP with other parallelism: torchtitan versions before late 2025 refuse it "
            '("DDP has not supported > 1D parallelism")'
        )
    return notes


def toml_section(name: str, notes: list[str], items: list[tuple[str, object]]) -> str:
    lines = [f"[{name}]"] + [f"# {note}" for note in notes] + [f"{key} = {toml_value(value)}" for key, value in items]
    return "\n".join(lines) + "\n\n"


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "inf" if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


# ---- Megatron-LM ----


def to_megatron_args(config: RunConfig) -> list[str]:
    """Megatron-LM `pretrain_gpt.py` arguments, one "--name=value" (or "--flag") each, for this
    layout's model, parallelism, batch, precision, recompute and optimizer; raises ExportError
    where Megatron-LM cannot run it."""
    megatron_refusals(config)
    return megatron_model(config) + megatron_parallelism(config) + megatron_training(config)


def megatron_refusals(config: RunConfig) -> None:
    parallel = config.parallel
    reasons = {
        "parallel.pp_schedule": (
            parallel.pp > 1 and parallel.pp_schedule not in MEGATRON_SCHEDULES,
            f"Megatron-LM runs 1F1B and interleaved 1F1B only, not {parallel.pp_schedule}; use 1F1B or Interleaved1F1B",
        ),
        "parallel.dp_replicate": (
            parallel.zero in (2, 3) and parallel.dp_replicate > 1,
            "Megatron-LM's FSDP shards over the whole data-parallel group; use dp_replicate 1, "
            "or ZeRO-1 (its distributed optimizer shards per replica)",
        ),
        "optimizer.offload": (config.optimizer.offload, "not mapped to Megatron-LM's optimizer offload; use false"),
        "compute.recompute_every": (
            config.compute.recompute_every > 1,
            "Megatron-LM recomputes uniform groups or the first blocks of each stage, not every N-th block; use 1",
        ),
        "model.rope_scaling": (
            config.model.rope_scaling is not None,
            "not mapped to Megatron-LM's RoPE scaling flags; export a model without it (null)",
        ),
        "model.parallel_blocks": (
            config.model.parallel_blocks,
            "Megatron-LM's GPT model runs attention and the MLP one after the other, each behind a norm of its own; "
            "use false",
        ),
    }
    refuse(reasons)


def megatron_model(config: RunConfig) -> list[str]:
    model = config.model
    args = [
        f"--num-layers={model.layers}",
        f"--hidden-size={model.dim}",
        f"--num-attention-heads={model.heads}",
    ]
    if model.kv_heads < model.heads:
        args += ["--group-query-attention", f"--num-query-groups={model.kv_heads}"]
    args += [
        f"--ffn-hidden-size={model.dense_blocks.ffn}",
        f"--seq-length={model.seq_len}",
        f"--max-position-embeddings={model.seq_len}",
        "--tokenizer-type=NullTokenizer",
        f"--vocab-size={model.vocab - 1}",
        "--make-vocab-size-divisible-by=1",
        "--normalization=RMSNorm",
        f"--norm-epsilon={config.model.norm_eps:g}",
        "--position-embedding-type=rope",
        f"--rotary-base={model.rope_theta:g}",
        "--disable-bias-linear",
        "--attention-dropout=0.0",
        "--hidden-dropout=0.0",
    ]
    if model.mlp == "swiglu":
        args.append("--swiglu")
    if not model.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if model.experts > 1:
        args += [f"--num-experts={model.experts}", f"--moe-router-topk={model.top_k}"]
        if model.dense_blocks.ffn != model.ffn:
            args.append(f"--moe-ffn-hidden-size={model.ffn}")
        if model.moe.dense_layers:
            dense = model.moe.dense_layers
            args.append(f"--moe-layer-freq=([0]*{dense}+[1]*{model.layers - dense})")
    return args


def megatron_parallelism(config: RunConfig) -> list[str]:
    parallel = config.parallel
    args = [f"--tensor-model-parallel-size={parallel.tp}"]
    if parallel.tp > 1 and parallel.sequence_parallel:
        args.append("--sequence-parallel")
    args.append(f"--pipeline-model-parallel-size={parallel.pp}")
    if parallel.pp > 1 and uneven_split(config):
        args += ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
        if parallel.pp_schedule == "Interleaved1F1B":
            args.append(f"--virtual-pipeline-model-parallel-size={parallel.stages_per_rank}")
    elif parallel.pp > 1 and parallel.pp_schedule == "Interleaved1F1B":
        args.append(f"--num-layers-per-virtual-pipeline-stage={layers_per_stage(config)}")
    args.append(f"--context-parallel-size={parallel.cp}")
    if config.model.experts > 1:
        args.append(f"--expert-model-parallel-size={parallel.ep}")
    return args + megatron_sharding(config)


def megatron_sharding(config: RunConfig) -> list[str]:
    """ZeRO-1 is Megatron's distributed optimizer (one instance per replica); ZeRO-2 its own FSDP
    sharding gradients and optimizer states; ZeRO-3 PyTorch's FSDP2, as loom runs it."""
    parallel = config.parallel
    if parallel.zero == 1:
        args = ["--use-distributed-optimizer"]
        if parallel.dp_replicate > 1:
            args.append(f"--num-distributed-optimizer-instances={parallel.dp_replicate}")
        return args
    if parallel.zero == 2:
        return ["--use-megatron-fsdp", "--data-parallel-sharding-strategy=optim_grads"]
    if parallel.zero == 3:
        args = ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion", "--ckpt-format=torch_dist"]
        if not parallel.reshard_after_forward:
            args.append("--torch-fsdp2-no-reshard-after-forward")
        return args
    return []


def megatron_training(config: RunConfig) -> list[str]:
    optimizer, recompute = config.optimizer, config.compute.recompute
    args = [
        f"--micro-batch-size={micro_seqs(config)}",
        f"--global-batch-size={global_batch(config)}",
        f"--train-iters={config.steps}",
    ]
    precision = precision_of(config)
    if precision in ("bf16", "fp8"):
        args.append("--bf16")
    if precision == "fp8":
        args.append("--fp8-format=hybrid")
    if recompute == "selective":
        args.append("--recompute-granularity=selective")
    elif recompute == "full":
        args += ["--recompute-granularity=full", "--recompute-method=uniform", "--recompute-num-layers=1"]
    return args + [
        f"--lr={optimizer.lr:g}",
        f"--min-lr={optimizer.lr * optimizer.min_lr_ratio:g}",
        "--lr-decay-style=cosine",
        f"--lr-warmup-iters={optimizer.warmup_steps}",
        f"--weight-decay={optimizer.weight_decay:g}",
        f"--adam-beta1={optimizer.beta1:g}",
        f"--adam-beta2={optimizer.beta2:g}",
        f"--clip-grad={optimizer.grad_clip:g}",
        f"--seed={config.data.seed}",
    ]


def refuse(reasons: dict[str, tuple[bool, str]]) -> None:
    errors = {field: message for field, (refused, message) in reasons.items() if refused}
    if errors:
        raise ExportError(errors)


EXPORTERS = {
    "torchtitan": to_torchtitan_toml,
    # One argument per line, ready to paste after `torchrun pretrain_gpt.py \`.
    "megatron": lambda config: " \\\n".join(to_megatron_args(config)),
}
