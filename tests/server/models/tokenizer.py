"""The models' tokenizer: byte-level BPE with 1024 ids, trained on the stdlib sources.

Byte-level, so any text round-trips. Ids 0, 1, 2 are ``<s>``, ``</s>``, ``<pad>``; encoding
a prompt prepends ``<s>``, as SGLang's tokenization of a prompt does with this tokenizer.
The trained weights depend on the ids, so the tokenizer ships with them under
``trained/tokenizer/`` and every model directory gets a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from . import corpus
from .spec import BOS, SPECIAL_TOKENS, VOCAB

# A plain template, so that chat endpoints have one; the tier sends raw prompts.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def train_tokenizer(files: Sequence[Path], vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """Train the BPE on ``files`` (deterministic for the same files and version of ``tokenizers``)."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(f) for f in files], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    bos, eos, pad = SPECIAL_TOKENS
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path))


def encode_files(tok: PreTrainedTokenizerBase, files: Sequence[Path]) -> torch.Tensor:
    """All of ``files`` as one int64 stream, each file's tokens followed by ``</s>``."""
    ids: list[int] = []
    for f in files:
        ids += tok(corpus.read(f), add_special_tokens=False)["input_ids"]
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)
