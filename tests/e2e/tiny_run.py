"""The new-run form's inputs for a run small enough to train in seconds on two CPU ranks."""

TINY_RUN_INPUTS = {
    "model.layers": "2",
    "model.dim": "64",
    "model.heads": "4",
    "model.kv_heads": "2",
    "model.ffn": "172",
    "model.seq_len": "64",
    "parallel.dp_replicate": "2",
    "data.micro_batch": "4",
    "data.corpus_bytes": "300000",
}
