"""Published training runs the planner's estimates are checked against: each run's layout as its source states
it, as a loom run config, with the step time (and peak memory, where given) the source measured.

Every figure was read from the source named in the case. Megatron-LM, NeMo and Megatron-Bridge runs use the
planner's "megatron" runtime; torchtitan runs (PyTorch-native FSDP2/DTensor) its "torchtitan"
runtime. What a source leaves unsaid and the case had to assume is listed in the case's `assumed`.

How Megatron's batch terms map to loom's (trainer/config.py, trainer/plan/layout.py): Megatron's data-parallel
size is GPUs / (TP × PP × CP); with pipeline parallelism one optimizer step runs m = GBS / (DP × MBS)
microbatches of MBS sequences, so loom's `data.micro_batch` (sequences per data-parallel rank per pass) is
MBS × m and `parallel.microbatches` is m, one pass per step; without pipeline parallelism `data.micro_batch` is MBS
and loom accumulates GBS / (DP × MBS) passes. `data.global_batch` is GBS either way. Megatron's virtual pipeline
size VP is loom's `stages_per_rank` under Interleaved1F1B. Its distributed optimizer (ZeRO-1 over the
data-parallel ranks) is `dp_shard` = DP with `zero_stage` 1; plain DDP is `dp_replicate` = DP; Megatron FSDP
is `dp_shard` = DP with `zero_stage` 3.

Throughput becomes step time as: tokens/s/GPU → GBS × seq_len / (tokens/s/GPU × GPUs); Narayanan et al.'s
TFLOP/s per GPU → their FLOPs per iteration, 96·B·s·l·h²·(1 + s/6h + V/16lh) (eq. 3 of arXiv 2104.04473, which
counts the recomputed forward of full activation recompute), / (TFLOP/s × GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.plan.layout import Attention, Runtime

Fitting = Literal["calibration", "held-out"]

# Sources, pinned to the version read.
NARAYANAN_TABLE = (
    "Narayanan et al. 2021 (arXiv 2104.04473) Table 1, as NVIDIA/Megatron-LM's README reproduces it "
    "(images/cases_april2021.png at commit fd5cfec0ba60); layouts from the paper's own launch script "
    "examples/academic_paper_scripts/sc21/run_table_1.sh (Megatron-LM commit d98e8a64ddf3)"
)
KORTHIKANTI_TABLE = (
    "Korthikanti et al. 2022 (arXiv 2205.05198) Table 5, as transcribed with the runs' layouts in "
    "calculon-ai/calculon calculon/llm/validation.py and validation/seqsel/tab5/*.json, models/*.json "
    "(commit caa4b11f8fe1)"
)
NEMO_2407 = (
    "NVIDIA/NeMo docs/source/performance/performance_summary.md, NeMo 24.07 container, DGX-H100, FP8 "
    "pre-training table (commit 8e3d65dcfe, 2024-09-09)"
)
BRIDGE_ARCHIVE = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md (commit 4ab94dfad366, 2026-08-11)"
BRIDGE_ARCHIVE_2602 = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md (commit 4da7335ff4b7)"
TORCHTITAN_2412 = (
    "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (was docs/performance.md; commit 820504e20d11, "
    "measured with torchtitan 9dec370, 2024-12-26)"
)
TORCHTITAN_2506 = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (commit 820504e20d11)"

GPT_VOCAB = 51_200
"""Megatron-LM's README for the Table 1 runs: every model uses a vocabulary of 51,200."""
LLAMA3_VOCAB = 128_256
LLAMA2_VOCAB = 32_000
TORCHTITAN_GPU = (
    "cluster: H100-HBM2e, the source's H100s with 96 GB HBM2e at 2.4 TB/s on a 500 W power limit; the source puts "
    "their peak between the H100 SXM's and the H100 NVL's without knowing it: priced linear in the power limit "
    "between the two datasheets (886 TFLOP/s bf16)"
)
TORCHTITAN_ATTENTION = (
    "attention: FlashAttention-2, what PyTorch's SDPA ran on Hopper then (cuDNN attention was opt-in: "
    "pytorch/pytorch#138649; torchtitan 9dec370 calls F.scaled_dot_product_attention)"
)
TORCHTITAN_MEMORY = (
    "memory: torchtitan's train.py logs torch.cuda's peak reserved bytes (max_reserved_gib), the maximum over "
    "ranks (the table's footnote)"
)


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    """Paper and table and row, or repository, path, version and row."""
    fitting: Fitting
    """calibration: may be used to fit the planner's constants; held-out: never."""
    runtime: Runtime
    cluster: dict
    document: dict
    """The loom run config, from the fields the source states (plus loom's defaults and `assumed`)."""
    published_step_s: float
    step_from: str
    """The published figure and how it became seconds per optimizer step."""
    published_reserved_gib: float | None = None
    """Peak memory the source reports, as torch.cuda's reserved bytes of the fullest rank."""
    assumed: tuple[str, ...] = ()
    attention: Attention = "flash"
    """unfused for Megatron-LM's runs of 2021–2022, before flash attention."""

    @property
    def gpus(self) -> int:
        return self.cluster["nodes"] * self.cluster["gpus_per_node"]


@dataclass(frozen=True)
class NotExpressible:
    name: str
    source: str
    reason: str


def cluster(gpu: str, gpus: int) -> dict:
    nodes = max(1, gpus // 8)
    return {"gpu": gpu, "nodes": nodes, "gpus_per_node": gpus // nodes}


def gpt(layers: int, dim: int, heads: int, seq_len: int, vocab: int = GPT_VOCAB) -> dict:
    """A GPT-3-style model as Megatron-LM builds it: GELU MLP of 4h, multi-head attention, tied embeddings."""
    return {
        "layers": layers, "dim": dim, "heads": heads, "kv_heads": heads, "ffn": 4 * dim, "vocab": vocab,
        "seq_len": seq_len, "mlp": "gelu", "tie_embeddings": True,
    }  # fmt: skip


def llama(layers: int, dim: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq_len: int) -> dict:
    return {
        "layers": layers, "dim": dim, "heads": heads, "kv_heads": kv_heads, "ffn": ffn, "vocab": vocab,
        "seq_len": seq_len,
    }  # fmt: skip


def torchtitan_ffn(dim: int, multiplier: float, multiple_of: int) -> int:
    """torchtitan's FeedForward width (torchtitan/models/llama/model.py at 9dec370): 2/3 of 4·dim, scaled by
    ffn_dim_multiplier, rounded up to multiple_of."""
    hidden = int(multiplier * int(2 * 4 * dim / 3))
    return multiple_of * -(-hidden // multiple_of)


def torchtitan_llama3(flavor: str, seq_len: int) -> dict:
    """torchtitan's llama3_configs (torchtitan/models/llama/__init__.py at 9dec370)."""
    layers, dim, heads, multiplier, multiple_of = {
        "8B": (32, 4096, 32, 1.3, 1024),
        "70B": (80, 8192, 64, 1.3, 4096),
    }[flavor]
    return llama(layers, dim, heads, 8, torchtitan_ffn(dim, multiplier, multiple_of), LLAMA3_VOCAB, seq_len)


def megatron_document(
    model: dict,
    gpus: int,
    *,
    mbs: int,
    gbs: int,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    vp: int = 1,
    data_parallel: Literal["ddp", "distributed-optimizer", "fsdp"] = "distributed-optimizer",
    recompute: str = "none",
    sequence_parallel: bool = True,
    precision: str = "bf16",
) -> dict:
    """A Megatron run's layout as a loom run config (the mapping the module docstring describes)."""
    dp, left = divmod(gpus, tp * pp * cp)
    if left:
        raise ValueError(f"{gpus} GPUs do not divide into tp={tp} × pp={pp} × cp={cp}")
    parallel: dict = {"tp": tp, "pp": pp, "cp": cp, "sequence_parallel": sequence_parallel and tp > 1}
    if data_parallel == "ddp":
        parallel["dp_replicate"] = dp
    else:
        parallel["dp_shard"] = dp
        if dp * cp > 1:
            parallel["zero_stage"] = 1 if data_parallel == "distributed-optimizer" else 3
    micro_batch = mbs
    if pp > 1:
        microbatches, left = divmod(gbs, dp * mbs)
        if left:
            raise ValueError(f"GBS {gbs} is not a whole number of microbatches of {mbs} over {dp} replicas")
        micro_batch = mbs * microbatches
        parallel |= {
            "microbatches": microbatches,
            "pp_schedule": "Interleaved1F1B" if vp > 1 else "1F1B",
            "stages_per_rank": vp,
        }
    return {
        "model": model,
        "parallel": parallel,
        "compute": {"precision": precision, "recompute": recompute},
        "data": {"micro_batch": micro_batch, "global_batch": gbs},
    }


def torchtitan_document(
    model: dict,
    *,
    local_batch: int,
    dp_shard: int,
    tp: int = 1,
    cp: int = 1,
    recompute: str,
    compile: bool,
    precision: str,
) -> dict:
    """torchtitan's layout: FSDP2 over dp_shard (× cp), local batch per data-parallel rank, no accumulation."""
    return {
        "model": model,
        "parallel": {"dp_shard": dp_shard, "tp": tp, "cp": cp},
        "compute": {"precision": precision, "recompute": recompute, "compile": compile},
        "data": {"micro_batch": local_batch, "global_batch": local_batch * dp_shard},
    }


def step_from_tokens(tokens_per_gpu_s: float, gbs: int, seq_len: int, gpus: int) -> tuple[float, str]:
    step = gbs * seq_len / (tokens_per_gpu_s * gpus)
    return step, f"{tokens_per_gpu_s:g} tokens/s/GPU → {gbs} × {seq_len} tokens / ({tokens_per_gpu_s:g} × {gpus})"


def narayanan_flops(batch: int, seq_len: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one iteration with full activation recompute, eq. 3 of arXiv 2104.04473."""
    return 96 * batch * seq_len * layers * hidden**2 * (1 + seq_len / (6 * hidden) + vocab / (16 * layers * hidden))


# The paper's Table 1 (README image): hidden size, layers, GPUs, batch, achieved TFLOP/s per GPU; with
# run_table_1.sh's heads, tensor and pipeline degrees, micro-batch size, layers per virtual stage and DDP.
NARAYANAN_ROWS = (
    # name, hidden, layers, heads, tp, pp, mbs, gbs, layers per virtual stage, gpus, TFLOP/s per GPU
    ("1.7B", 2304, 24, 24, 1, 1, 16, 512, None, 32, 137),
    ("3.6B", 3072, 30, 32, 2, 1, 16, 512, None, 64, 138),
    ("7.5B", 4096, 36, 32, 4, 1, 16, 512, None, 128, 142),
    ("18B", 6144, 40, 48, 8, 1, 8, 1024, None, 256, 135),
    ("39B", 8192, 48, 64, 8, 2, 4, 1536, None, 512, 138),
    ("76B", 10240, 60, 80, 8, 4, 2, 1792, 5, 1024, 140),
    ("145B", 12288, 80, 96, 8, 8, 2, 2304, 5, 1536, 148),
    ("310B", 16384, 96, 128, 8, 16, 1, 2160, 3, 1920, 155),
    ("530B", 20480, 105, 128, 8, 35, 1, 2520, 1, 2520, 163),
    ("1T", 25600, 128, 160, 8, 64, 1, 3072, None, 3072, 163),
)
NARAYANAN_SEQ = 2048


def narayanan_runs() -> list[PublishedRun]:
    runs = []
    for name, hidden, layers, heads, tp, pp, mbs, gbs, per_virtual, gpus, tflops in NARAYANAN_ROWS:
        vp = layers // pp // per_virtual if per_virtual else 1
        # The script's --DDP-impl is torch or local: both plain data parallel, no distributed optimizer.
        document = megatron_document(
            gpt(layers, hidden, heads, NARAYANAN_SEQ),
            gpus,
            mbs=mbs,
            gbs=gbs,
            tp=tp,
            pp=pp,
            vp=vp,
            data_parallel="ddp",
            recompute="full",
            sequence_parallel=False,
        )
        flops = narayanan_flops(gbs, NARAYANAN_SEQ, layers, hidden, GPT_VOCAB)
        runs.append(
            PublishedRun(
                name=f"narayanan-gpt-{name}",
                source=f"{NARAYANAN_TABLE}; row {name}",
                fitting="calibration",
                runtime="megatron",
                attention="unfused",
                cluster=cluster("A100-80GB", gpus),
                document=document,
                published_step_s=flops / (tflops * 1e12 * gpus),
                step_from=(
                    f"{tflops} TFLOP/s/GPU → 96·B·s·l·h²·(1 + s/6h + V/16lh) with B={gbs}, s={NARAYANAN_SEQ}, "
                    f"l={layers}, h={hidden}, V={GPT_VOCAB} / ({tflops} TFLOP/s × {gpus})"
                ),
                assumed=(
                    "precision: bf16 (the runs used fp16, CONFIG.sh --fp16; the same tensor-core rate)",
                    "model: Megatron's GPT of the time: GELU MLP of 4h (arguments.py default), tied embeddings",
                    "recompute: full (the script's --activations-checkpoint-method uniform)",
                ),
            )
        )
    return runs


# Table 5 in seconds per iteration, with each run's layout (Calculon's validation/seqsel/tab5 files and
# models/*.json): A100 80GB, sequence 2048, data-parallel size 1, micro-batch 1 (4 for 22B).
KORTHIKANTI_ROWS = (
    # name, layers, hidden, heads, tp, pp, vp, gbs, mbs, full recompute s, sequence parallel + selective s
    ("22B", 48, 6144, 64, 8, 1, 1, 4, 4, 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 8, 3, 64, 1, 18.13, 13.75),
    ("530B", 105, 20480, 128, 8, 35, 3, 280, 1, 49.05, 37.83),
    ("1T", 128, 25600, 160, 8, 64, 1, 512, 1, 94.42, 71.49),
)


def korthikanti_runs() -> list[PublishedRun]:
    runs = []
    for name, layers, hidden, heads, tp, pp, vp, gbs, mbs, full_s, present_s in KORTHIKANTI_ROWS:
        gpus = tp * pp
        for mode, seconds, recompute, sequence_parallel in (
            ("full recompute", full_s, "full", False),
            ("sequence parallel + selective recompute", present_s, "selective", True),
        ):
            runs.append(
                PublishedRun(
                    name=f"korthikanti-{name}-{recompute}",
                    source=f"{KORTHIKANTI_TABLE}; row {name}, {mode}",
                    fitting="held-out",
                    runtime="megatron",
                    attention="unfused",
                    cluster=cluster("A100-80GB", gpus),
                    document=megatron_document(
                        gpt(layers, hidden, heads, 2048),
                        gpus,
                        mbs=mbs,
                        gbs=gbs,
                        tp=tp,
                        pp=pp,
                        vp=vp,
                        data_parallel="ddp",
                        recompute=recompute,
                        sequence_parallel=sequence_parallel,
                    ),
                    published_step_s=seconds,
                    step_from=f"{seconds} s per iteration, as published",
                    assumed=(
                        f"vocab: {GPT_VOCAB} (the Megatron papers' GPT vocabulary; the transcription omits it)",
                        "precision: bf16 (16-bit; the transcription says float16)",
                        "model: GELU MLP of 4h, tied embeddings (Megatron's GPT)",
                    ),
                )
            )
    return runs


# NeMo 24.07's FP8 table on DGX-H100: model, GPUs, GBS, MBS, sequence, TP, PP, CP, VP, tokens/s/GPU.
NEMO_ROWS = (
    ("GPT3-175B", 128, 256, 1, 2048, 4, 8, 1, 6, 726),
    ("GPT3-175B", 512, 2048, 2, 2048, 4, 8, 1, 6, 782),
    ("LLAMA2-7B", 8, 128, 1, 4096, 1, 1, 1, 1, 16847),
    ("LLAMA2-13B", 16, 128, 1, 4096, 1, 4, 1, 10, 8646),
    ("LLAMA2-70B", 64, 128, 1, 4096, 4, 4, 1, 20, 1707),
    ("LLAMA3-8B", 8, 128, 1, 8192, 1, 1, 2, 1, 12036),
    ("LLAMA3-70B", 64, 128, 1, 8192, 4, 4, 2, 5, 1533),
)
# Model shapes from NeMo's nemo/collections/llm/gpt/model/llama.py and base.py (GPTConfig175B).
NEMO_MODELS = {
    "GPT3-175B": lambda seq: gpt(96, 12288, 96, seq),
    "LLAMA2-7B": lambda seq: llama(32, 4096, 32, 32, 11008, LLAMA2_VOCAB, seq),
    "LLAMA2-13B": lambda seq: llama(40, 5120, 40, 40, 13824, LLAMA2_VOCAB, seq),
    "LLAMA2-70B": lambda seq: llama(80, 8192, 64, 8, 28672, LLAMA2_VOCAB, seq),
    "LLAMA3-8B": lambda seq: llama(32, 4096, 32, 8, 14336, LLAMA3_VOCAB, seq),
    "LLAMA3-70B": lambda seq: llama(80, 8192, 64, 8, 28672, LLAMA3_VOCAB, seq),
    "LLAMA3.1-405B": lambda seq: llama(126, 16384, 128, 8, 53248, LLAMA3_VOCAB, seq),
}
NEMO_VOCAB_ASSUMED = {
    "GPT3-175B": f"vocab: {GPT_VOCAB} (GPT-2's BPE padded to a multiple of 128 × tp; not stated)",
    "LLAMA2-7B": f"vocab: {LLAMA2_VOCAB} (Llama 2's tokenizer; not stated)",
    "LLAMA2-13B": f"vocab: {LLAMA2_VOCAB} (Llama 2's tokenizer; not stated)",
    "LLAMA2-70B": f"vocab: {LLAMA2_VOCAB} (Llama 2's tokenizer; not stated)",
    "LLAMA3-8B": f"vocab: {LLAMA3_VOCAB} (Llama 3's tokenizer, as Megatron-Bridge's H100 recipes set it)",
    "LLAMA3-70B": f"vocab: {LLAMA3_VOCAB} (Llama 3's tokenizer, as Megatron-Bridge's H100 recipes set it)",
}
MEGATRON_H100_ASSUMED = (
    "recompute: none (the table does not say)",
    "data parallel: Megatron's distributed optimizer (ZeRO-1), as the Megatron-Bridge Llama recipes set it",
    "sequence_parallel: true wherever tp > 1",
)


def nemo_runs() -> list[PublishedRun]:
    runs = []
    for model, gpus, gbs, mbs, seq, tp, pp, cp, vp, tokens in NEMO_ROWS:
        step, how = step_from_tokens(tokens, gbs, seq, gpus)
        runs.append(
            PublishedRun(
                name=f"nemo-24.07-{model.lower()}-{gpus}gpu",
                source=f"{NEMO_2407}; row {model}, {gpus} GPUs",
                fitting="calibration",
                runtime="megatron",
                cluster=cluster("H100-SXM", gpus),
                document=megatron_document(
                    NEMO_MODELS[model](seq), gpus, mbs=mbs, gbs=gbs, tp=tp, pp=pp, cp=cp, vp=vp, precision="fp8"
                ),
                published_step_s=step,
                step_from=how,
                assumed=(NEMO_VOCAB_ASSUMED[model], *MEGATRON_H100_ASSUMED),
            )
        )
    return runs


# Megatron-Bridge's archive, dense Llama 3 pre-training on DGX-H100 in FP8 (current scaling):
# release, GPUs, GBS, MBS, sequence, Megatron FSDP, TP, PP, CP, VP, tokens/s/GPU.
BRIDGE_ROWS = (
    ("25.11", "LLAMA3_8B", 8, 128, 1, 8192, True, 1, 1, 1, 1, 14451),
    ("25.11", "LLAMA3_70B", 64, 128, 1, 8192, False, 4, 8, 1, 5, 1602),
    ("26.04.01", "LLAMA3_70B", 64, 256, 1, 8192, False, 4, 8, 1, 5, 1664),
    # 126 blocks on PP 8 × VP 8 = 64 stages: the embedding and the loss count as a block each (1, 2, …, 2, 1).
    ("25.11", "LLAMA3.1_405B", 1024, 512, 1, 8192, False, 8, 8, 2, 8, 292),
    ("26.02", "LLAMA3.1_405B", 1024, 1536, 1, 8192, False, 8, 8, 2, 8, 311),
)


def bridge_runs() -> list[PublishedRun]:
    runs = []
    for release, model, gpus, gbs, mbs, seq, fsdp, tp, pp, cp, vp, tokens in BRIDGE_ROWS:
        step, how = step_from_tokens(tokens, gbs, seq, gpus)
        shape = NEMO_MODELS[model.replace("_", "-")](seq)
        runs.append(
            PublishedRun(
                name=f"bridge-{release}-{model.lower()}-gbs{gbs}",
                source=(
                    f"{BRIDGE_ARCHIVE_2602 if release == '26.02' else BRIDGE_ARCHIVE}; {release} NeMo container, "
                    f"DGX-H100 pre-training, row {model} GBS {gbs}"
                ),
                fitting="calibration",
                runtime="megatron",
                cluster=cluster("H100-SXM", gpus),
                document=megatron_document(
                    shape,
                    gpus,
                    mbs=mbs,
                    gbs=gbs,
                    tp=tp,
                    pp=pp,
                    cp=cp,
                    vp=vp,
                    data_parallel="fsdp" if fsdp else "distributed-optimizer",
                    precision="fp8",
                ),
                published_step_s=step,
                step_from=how,
                assumed=(
                    f"vocab: {LLAMA3_VOCAB} and the Llama 3 shape of NeMo's Llama3Config (the table names the model)",
                    *MEGATRON_H100_ASSUMED,
                ),
            )
        )
    return runs


TORCHTITAN_SEQ = "seq_len: 8192, the llama3 train_configs' value at the measured commit (the tables do not state it)"
TORCHTITAN_VOCAB = f"vocab: {LLAMA3_VOCAB} (Llama 3's tokenizer: torchtitan's tiktoken.py adds 256 reserved tokens)"
TORCHTITAN_ASSUMED = (TORCHTITAN_GPU, TORCHTITAN_ATTENTION, TORCHTITAN_SEQ, TORCHTITAN_VOCAB)
# Table 1 and 3 (Llama 3.1 8B, FSDP, local batch 2, selective AC) and Table 4 (70B, FSDP 32 × TP 8, local batch
# 16, full AC, torch.compile + Float8): GPUs, technique, tokens/s/GPU, memory GiB.
TORCHTITAN_FSDP_ROWS = (
    (8, "FSDP", 5762, 82.4),
    (8, "FSDP + torch.compile", 6667, 77.0),
    (8, "FSDP + torch.compile + Float8", 8532, 76.8),
    (128, "FSDP", 5605, 67.0),
    (128, "FSDP + torch.compile", 6514, 62.0),
    (128, "FSDP + torch.compile + Float8", 8380, 61.8),
)
# Table 2: Llama 3.1 8B on 8 GPUs, FSDP + CP + torch.compile + Float8, local batch 1, full AC.
TORCHTITAN_CP_ROWS = (
    (8, 1, 32768, 3890, 83.9),
    (4, 2, 65536, 2540, 84.2),
    (2, 4, 131072, 1071, 84.0),
    (1, 8, 262144, 548, 84.5),
)
# The async-TP page's vanilla-TP columns for 70B (its async-TP and float8 rowwise columns, and the 8B table, are in
# NOT_EXPRESSIBLE).
TORCHTITAN_TP_ROWS = (
    # flavor, GPUs, FSDP, TP, local batch, recompute, precision, tokens/s/GPU
    ("70B", 256, 32, 8, 16, "full", "bf16", 597.3),
    ("70B", 256, 32, 8, 16, "full", "fp8", 809.8),
)


def torchtitan_runs() -> list[PublishedRun]:
    runs = []
    for gpus, technique, tokens, memory in TORCHTITAN_FSDP_ROWS:
        table = 1 if gpus == 8 else 3
        step, how = step_from_tokens(tokens, 2 * gpus, 8192, gpus)
        runs.append(
            PublishedRun(
                name=f"torchtitan-8b-fsdp{gpus}-{technique.replace(' + ', '-').replace('torch.', '').lower()}",
                source=f"{TORCHTITAN_2412}; Table {table}, row {technique}",
                fitting="held-out",
                runtime="torchtitan",
                attention="flash2",
                cluster=cluster("H100-HBM2e", gpus),
                document=torchtitan_document(
                    torchtitan_llama3("8B", 8192),
                    local_batch=2,
                    dp_shard=gpus,
                    recompute="selective",
                    compile="compile" in technique,
                    precision="fp8" if "Float8" in technique else "bf16",
                ),
                published_step_s=step,
                step_from=how,
                published_reserved_gib=memory,
                assumed=(
                    *TORCHTITAN_ASSUMED,
                    "recompute: selective (torchtitan's per-op selective AC, selective_ac_option 'op', which "
                    "keeps every other matmul's output; loom's selective recomputes the attention sub-block)",
                    TORCHTITAN_MEMORY,
                ),
            )
        )
    for dp_shard, cp, seq_len, tokens, memory in TORCHTITAN_CP_ROWS:
        step, how = step_from_tokens(tokens, dp_shard, seq_len, 8)
        runs.append(
            PublishedRun(
                name=f"torchtitan-8b-fsdp{dp_shard}-cp{cp}-seq{seq_len}",
                source=f"{TORCHTITAN_2412}; Table 2, row FSDP {dp_shard}, CP {cp}",
                fitting="held-out",
                runtime="torchtitan",
                attention="flash2",
                cluster=cluster("H100-HBM2e", 8),
                document=torchtitan_document(
                    torchtitan_llama3("8B", seq_len),
                    local_batch=1,
                    dp_shard=dp_shard,
                    cp=cp,
                    recompute="full",
                    compile=True,
                    precision="fp8",
                ),
                published_step_s=step,
                step_from=how,
                published_reserved_gib=memory,
                assumed=(TORCHTITAN_GPU, TORCHTITAN_ATTENTION, TORCHTITAN_VOCAB, TORCHTITAN_MEMORY),
            )
        )
    step, how = step_from_tokens(829, 512, 8192, 256)
    runs.append(
        PublishedRun(
            name="torchtitan-70b-fsdp32-tp8",
            source=f"{TORCHTITAN_2412}; Table 4, row 2D",
            fitting="held-out",
            runtime="torchtitan",
            attention="flash2",
            cluster=cluster("H100-HBM2e", 256),
            document=torchtitan_document(
                torchtitan_llama3("70B", 8192),
                local_batch=16,
                dp_shard=32,
                tp=8,
                recompute="full",
                compile=True,
                precision="fp8",
            ),
            published_step_s=step,
            step_from=how,
            published_reserved_gib=71.9,
            assumed=(*TORCHTITAN_ASSUMED, TORCHTITAN_MEMORY),
        )
    )
    for flavor, gpus, dp_shard, tp, local_batch, recompute, precision, tokens in TORCHTITAN_TP_ROWS:
        step, how = step_from_tokens(tokens, local_batch * dp_shard, 8192, gpus)
        runs.append(
            PublishedRun(
                name=f"torchtitan-2506-{flavor.lower()}-fsdp{dp_shard}-tp{tp}-{precision}",
                source=(
                    f"{TORCHTITAN_2506}; Llama3 {flavor.lower()} on {gpus} H100s, row "
                    f"{'None (bfloat16)' if precision == 'bf16' else 'float8 tensorwise'}, vanilla TP"
                ),
                fitting="held-out",
                runtime="torchtitan",
                attention="flash2",
                cluster=cluster("H100-HBM2e", gpus),
                document=torchtitan_document(
                    torchtitan_llama3(flavor, 8192),
                    local_batch=local_batch,
                    dp_shard=dp_shard,
                    tp=tp,
                    recompute=recompute,
                    compile=True,
                    precision=precision,
                ),
                published_step_s=step,
                step_from=how,
                assumed=(
                    *TORCHTITAN_ASSUMED,
                    "global batch: local batch × FSDP degree (the page states the local batch only)",
                ),
            )
        )
    return runs


PUBLISHED_RUNS: tuple[PublishedRun, ...] = tuple(
    narayanan_runs() + nemo_runs() + bridge_runs() + korthikanti_runs() + torchtitan_runs()
)

NOT_EXPRESSIBLE: tuple[NotExpressible, ...] = (
    NotExpressible(
        "torchtitan-70b-fsdp32-tp8-asynctp",
        f"{TORCHTITAN_2412}; Table 4, row 2D + AsyncTP",
        "async tensor parallel (collectives decomposed and overlapped with the matmuls); loom has no such option",
    ),
    *(
        NotExpressible(
            f"torchtitan-405b-{schedule}",
            f"{TORCHTITAN_2412}; Table 5, row {schedule}",
            "async tensor parallel (the 405B rows all run it); loom has no such option",
        )
        for schedule in ("1F1B", "Interleaved 1F1B")
    ),
    *(
        NotExpressible(
            f"torchtitan-405b-fsdp{fsdp}-cp{cp}",
            f"{TORCHTITAN_2412}; Table 6, row FSDP {fsdp}, CP {cp}",
            "async tensor parallel (the 405B rows all run it); loom has no such option",
        )
        for fsdp, cp in ((8, 1), (4, 2), (2, 4), (1, 8))
    ),
    *(
        NotExpressible(
            f"torchtitan-2506-{flavor}-{column}",
            f"{TORCHTITAN_2506}; Llama3 {flavor}, {column}",
            reason,
        )
        for flavor in ("70b", "8b")
        for column, reason in (
            ("async TP columns", "async tensor parallel; loom has no such option"),
            ("float8 rowwise rows", "float8 with row-wise scales; loom's fp8 prices one (tensor-wise) recipe"),
        )
    ),
    *(
        NotExpressible(
            f"torchtitan-2506-8b-fsdp8-tp8-{precision}",
            f"{TORCHTITAN_2506}; Llama3 8b on 64 H100s, row {row}, vanilla TP",
            "torch.compile with tp > 1 and selective recompute: loom's config refuses the combination "
            "(compute.compile)",
        )
        for precision, row in (("bf16", "None (bfloat16)"), ("fp8", "float8 tensorwise"))
    ),
)
