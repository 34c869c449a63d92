"""The tokenizer `prepare` turns text into ids with: a Hugging Face `tokenizers` file, a byte-level BPE trained on
the corpus itself, or plain bytes (256 byte values and one end-of-text token)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data.format import BYTE_VOCAB_WITH_EOT, TOKENIZER_FILE, token_dtype
from trainer.data.sources import PrepareError

EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
"""End-of-text spellings looked for in a tokenizer file, in this order (GPT-2, Llama 3, Llama 2/T5, Gemma)."""
TRAINED_EOT = "<|endoftext|>"
MIN_TRAINED_VOCAB = BYTE_VOCAB_WITH_EOT
"""A trained byte-level BPE starts from all 256 bytes and the end-of-text token; merges come on top."""
MAX_VOCAB = 1_000_000


@dataclass(frozen=True)
class TokenizerChoice:
    kind: str
    """"file", "trained" or "bytes", as the manifest records it."""
    text: str | None
    """The tokenizer file's contents (None for bytes): what the dataset directory's tokenizer.json will hold."""
    vocab_size: int
    eot_id: int
    eot_token: str

    @property
    def sha256(self) -> str | None:
        return None if self.text is None else hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab_size)

    def manifest_entry(self) -> dict:
        return {
            "kind": self.kind,
            "file": None if self.text is None else TOKENIZER_FILE,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eot_id": self.eot_id,
            "eot_token": self.eot_token,
        }


def byte_level() -> TokenizerChoice:
    return TokenizerChoice("bytes", None, BYTE_VOCAB_WITH_EOT, BYTE_VOCAB_WITH_EOT - 1, TRAINED_EOT)


def from_file(path: str | Path, eot_token: str | None = None) -> TokenizerChoice:
    """A `tokenizers` file (or a model directory holding tokenizer.json); its end-of-text token is `eot_token`, or
    else the first of EOT_CANDIDATES it has."""
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise PrepareError("tokenizer", f"{path}: no such file; give a Hugging Face tokenizer.json")
    try:
        text = path.read_text()
        tokenizer = Tokenizer.from_str(text)
    except Exception as error:  # tokenizers raises a bare Exception for a file it cannot parse
        raise PrepareError("tokenizer", f"{path}: not a Hugging Face tokenizers file ({error})") from None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if eot_token is not None:
        if eot_token not in vocab:
            raise PrepareError("eot_token", f"{path} has no token {eot_token!r}; name one of its tokens")
        chosen = eot_token
    else:
        chosen = next((candidate for candidate in EOT_CANDIDATES if candidate in vocab), None)
        if chosen is None:
            raise PrepareError(
                "tokenizer",
                f"{path} has none of the end-of-text tokens {list(EOT_CANDIDATES)}; name its own with --eot-token",
            )
    return TokenizerChoice("file", text, _vocab_size(tokenizer), vocab[chosen], chosen)


def train_bpe(texts: Iterable[str], vocab_size: int) -> TokenizerChoice:
    """A byte-level BPE (GPT-2's pre-tokenization, so any text round-trips) with `vocab_size` tokens at most, fewer
    when the corpus has fewer merges to offer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[TRAINED_EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return TokenizerChoice(
        "trained", tokenizer.to_str(), _vocab_size(tokenizer), tokenizer.token_to_id(TRAINED_EOT), TRAINED_EOT
    )


def _vocab_size(tokenizer) -> int:
    # Ids may leave gaps; every id must fit the embedding (and the shard dtype).
    return max(tokenizer.get_vocab_size(with_added_tokens=True), max(tokenizer.get_vocab().values()) + 1)


class DocumentEncoder:
    """Turns documents into token ids, as `choice` says; special tokens spelled out in a document's text are
    encoded as the text they are, so the only end-of-text tokens in a shard are the ones that end documents."""

    def __init__(self, choice: TokenizerChoice):
        self.dtype = choice.dtype
        self.eot = np.array([choice.eot_id], dtype=self.dtype)
        self._tokenizer = None
        if choice.text is not None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_str(choice.text)
            self._tokenizer.encode_special_tokens = True

    def encode(self, documents: list[str]) -> list[np.ndarray]:
        """Each document's ids, without the end-of-text token."""
        if self._tokenizer is None:
            return [np.frombuffer(text.encode(), dtype=np.uint8).astype(self.dtype) for text in documents]
        encodings = self._tokenizer.encode_batch_fast(documents, add_special_tokens=False)
        return [np.asarray(encoding.ids, dtype=self.dtype) for encoding in encodings]
