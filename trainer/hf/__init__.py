"""Pretrained weights in and out: Hugging Face Llama directories ⇄ loom's committed DCP checkpoints.

`python -m trainer.hf import HF_DIR --out CHECKPOINT_DIR` converts a local Llama (config.json and *.safetensors)
once into a checkpoint that `checkpoint.init_from` starts a run from, in any layout; `python -m trainer.hf export
CHECKPOINT_DIR --out HF_DIR` writes any committed checkpoint back out for transformers' from_pretrained.
"""
