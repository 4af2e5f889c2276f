"""Pre-training example creation: sentence pairs for NSP and masked-LM predictions.

Owns: the semantics of Google's reference ``create_pretraining_data.py`` as MLPerf uses it
(``create_instances_from_document``, ``truncate_seq_pair``, ``create_masked_lm_predictions``),
ported to token ids, and a compact packed form of the resulting instances. Never: reading
text, tokenising, writing files, multiprocessing (prepare.py).

Randomness: every function takes an explicit ``random.Random``; nothing touches global RNG
state. The reference threads one RNG through all documents in order; here the documents are
cut into fixed chunks of ``CHUNK_DOCS`` and each (split, dupe pass, chunk) gets its own RNG
seeded by ``derive_seed`` - so the output depends only on the seed and the inputs, never on
how many worker processes ran the chunks or in which order they finished.

Differences from the reference, all deliberate:
- per-chunk RNGs instead of one sequential RNG (above);
- the random "next" segment is drawn from documents of the same split only, so held-out
  eval text never appears in training pairs;
- token ids instead of token strings; the 10% random replacement draws an id uniformly from
  the whole vocab, as the reference draws from ``vocab_words`` (specials and [unused]
  included).
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import numpy as np

CHUNK_DOCS = 64


@dataclass(frozen=True)
class InstanceParams:
    max_seq_length: int = 128
    short_seq_prob: float = 0.1
    masked_lm_prob: float = 0.15
    max_predictions_per_seq: int = 20
    vocab_size: int = 30522
    cls_id: int = 101
    sep_id: int = 102
    mask_id: int = 103


def derive_seed(*keys) -> int:
    """A 64-bit seed from a tuple of keys, e.g. (seed, "train", dupe, chunk)."""
    text = "\x1f".join(str(k) for k in keys)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def truncate_seq_pair(tokens_a: list, tokens_b: list, max_num_tokens: int,
                      rng: random.Random) -> None:
    """Trim the longer list, from the front or back at random, until the pair fits."""
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        trunc = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        assert len(trunc) >= 1
        # Front or back at random, to add randomness and avoid biases (reference comment).
        if rng.random() < 0.5:
            del trunc[0]
        else:
            trunc.pop()


def create_masked_lm_predictions(tokens: list[int], params: InstanceParams,
                                 rng: random.Random):
    """Mask a copy of ``tokens`` (which include [CLS]/[SEP]).

    Returns ``(output_tokens, positions, labels)``: positions sorted ascending, labels the
    original ids there. Per chosen position: 80% [MASK], 10% kept, 10% a random vocab id.
    """
    cand = [i for i, t in enumerate(tokens) if t != params.cls_id and t != params.sep_id]
    rng.shuffle(cand)
    output = list(tokens)
    num_to_predict = min(params.max_predictions_per_seq,
                         max(1, int(round(len(tokens) * params.masked_lm_prob))))
    chosen = []
    for index in cand[:num_to_predict]:
        if rng.random() < 0.8:
            masked = params.mask_id
        elif rng.random() < 0.5:
            masked = tokens[index]
        else:
            masked = rng.randint(0, params.vocab_size - 1)
        output[index] = masked
        chosen.append(index)
    chosen.sort()
    return output, chosen, [tokens[i] for i in chosen]


def create_instances_from_document(all_documents: list, document_index: int,
                                   params: InstanceParams, rng: random.Random) -> list[tuple]:
    """Instances of one document; ``all_documents[i]`` is a list of segments (token-id lists).

    Each instance is ``(input_ids, len_a, positions, labels, is_random_next, random_doc)``
    where ``input_ids`` = [CLS] A [SEP] B [SEP] after masking, and ``random_doc`` is the
    index of the document B came from (``document_index`` when B is the true next).
    """
    document = all_documents[document_index]
    max_num_tokens = params.max_seq_length - 3
    # Mostly fill the whole sequence; sometimes (short_seq_prob) use a shorter target to
    # reduce the mismatch between pre-training and fine-tuning on short inputs.
    target_seq_length = max_num_tokens
    if rng.random() < params.short_seq_prob:
        target_seq_length = rng.randint(2, max_num_tokens)

    instances = []
    current_chunk: list = []
    current_length = 0
    i = 0
    while i < len(document):
        segment = document[i]
        current_chunk.append(segment)
        current_length += len(segment)
        if i == len(document) - 1 or current_length >= target_seq_length:
            if current_chunk:
                a_end = 1
                if len(current_chunk) >= 2:
                    a_end = rng.randint(1, len(current_chunk) - 1)
                tokens_a: list = []
                for j in range(a_end):
                    tokens_a.extend(current_chunk[j])
                tokens_b: list = []
                if len(current_chunk) == 1 or rng.random() < 0.5:
                    is_random_next = True
                    target_b_length = target_seq_length - len(tokens_a)
                    for _ in range(10):
                        random_document_index = rng.randint(0, len(all_documents) - 1)
                        if random_document_index != document_index:
                            break
                    random_document = all_documents[random_document_index]
                    random_start = rng.randint(0, len(random_document) - 1)
                    for j in range(random_start, len(random_document)):
                        tokens_b.extend(random_document[j])
                        if len(tokens_b) >= target_b_length:
                            break
                    # The segments after A were not used: "put them back" for the next chunk.
                    num_unused_segments = len(current_chunk) - a_end
                    i -= num_unused_segments
                    b_doc = random_document_index
                else:
                    is_random_next = False
                    for j in range(a_end, len(current_chunk)):
                        tokens_b.extend(current_chunk[j])
                    b_doc = document_index
                truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
                assert len(tokens_a) >= 1 and len(tokens_b) >= 1
                tokens = [params.cls_id, *tokens_a, params.sep_id, *tokens_b, params.sep_id]
                output, positions, labels = create_masked_lm_predictions(tokens, params, rng)
                instances.append((output, len(tokens_a), positions, labels,
                                  is_random_next, b_doc))
            current_chunk = []
            current_length = 0
        i += 1
    return instances


@dataclass
class PackedInstances:
    """Many instances as flat arrays (cheap to pickle between processes and to slice).

    Row r: ``input_ids[id_off[r]:id_off[r+1]]``, masked positions/labels
    ``[pred_off[r]:pred_off[r+1]]``; segment ids are 0 up to and including the first [SEP]
    (index ``len_a[r] + 1``) and 1 after it.
    """

    input_ids: np.ndarray      # int16, all rows concatenated
    id_off: np.ndarray         # int64, n+1
    len_a: np.ndarray          # int32
    positions: np.ndarray      # int16
    labels: np.ndarray         # int16
    pred_off: np.ndarray       # int64, n+1
    nsp: np.ndarray            # int8, 1 = random next (the reference's is_random_next)
    doc_a: np.ndarray          # int32, document index of segment A (within its split)
    doc_b: np.ndarray          # int32, document index of segment B
    n_mask: int = 0            # masked positions holding [MASK]
    n_kept: int = 0            # masked positions holding the original id
    n_random: int = 0          # masked positions holding another id

    def __len__(self) -> int:
        return len(self.nsp)

    @staticmethod
    def from_instances(instances: list[tuple], doc_a: list[int], mask_id: int):
        lens = [len(t[0]) for t in instances]
        npred = [len(t[2]) for t in instances]
        ids = np.fromiter((x for t in instances for x in t[0]), dtype=np.int16,
                          count=sum(lens))
        pos = np.fromiter((x for t in instances for x in t[2]), dtype=np.int16,
                          count=sum(npred))
        lab = np.fromiter((x for t in instances for x in t[3]), dtype=np.int16,
                          count=sum(npred))
        id_off = np.zeros(len(instances) + 1, np.int64)
        np.cumsum(lens, out=id_off[1:])
        pred_off = np.zeros(len(instances) + 1, np.int64)
        np.cumsum(npred, out=pred_off[1:])
        # What each masked position holds: [MASK], the original, or something else.
        row = np.repeat(np.arange(len(instances)), npred)
        held = ids[id_off[:-1][row] + pos] if len(pos) else np.zeros(0, np.int16)
        n_mask = int(np.count_nonzero(held == mask_id))
        n_kept = int(np.count_nonzero((held == lab) & (held != mask_id)))
        return PackedInstances(
            input_ids=ids, id_off=id_off,
            len_a=np.asarray([t[1] for t in instances], np.int32),
            positions=pos, labels=lab, pred_off=pred_off,
            nsp=np.asarray([1 if t[4] else 0 for t in instances], np.int8),
            doc_a=np.asarray(doc_a, np.int32),
            doc_b=np.asarray([t[5] for t in instances], np.int32),
            n_mask=n_mask, n_kept=n_kept, n_random=len(pos) - n_mask - n_kept)

    @staticmethod
    def concat(parts: list["PackedInstances"]) -> "PackedInstances":
        def offsets(key):
            out = [np.zeros(1, np.int64)]
            base = 0
            for p in parts:
                off = getattr(p, key)
                out.append(off[1:] + base)
                base += int(off[-1])
            return np.concatenate(out)

        cat = lambda key, dt: (np.concatenate([getattr(p, key) for p in parts])  # noqa: E731
                               if parts else np.zeros(0, dt))
        return PackedInstances(
            input_ids=cat("input_ids", np.int16), id_off=offsets("id_off"),
            len_a=cat("len_a", np.int32), positions=cat("positions", np.int16),
            labels=cat("labels", np.int16), pred_off=offsets("pred_off"),
            nsp=cat("nsp", np.int8), doc_a=cat("doc_a", np.int32),
            doc_b=cat("doc_b", np.int32),
            n_mask=sum(p.n_mask for p in parts), n_kept=sum(p.n_kept for p in parts),
            n_random=sum(p.n_random for p in parts))

    def lengths(self) -> np.ndarray:
        return np.diff(self.id_off)

    def row(self, r: int):
        """(input_ids, segment_ids, positions, labels, nsp) of row ``r`` as int16 arrays."""
        ids = self.input_ids[self.id_off[r]:self.id_off[r + 1]]
        seg = np.zeros(len(ids), np.int16)
        seg[int(self.len_a[r]) + 2:] = 1
        p0, p1 = self.pred_off[r], self.pred_off[r + 1]
        return ids, seg, self.positions[p0:p1], self.labels[p0:p1], int(self.nsp[r])


def create_chunk(all_documents: list, doc_indices: range, params: InstanceParams,
                 rng: random.Random) -> PackedInstances:
    """All instances of documents ``doc_indices`` (one dupe pass), with one RNG, packed."""
    instances, doc_a = [], []
    for d in doc_indices:
        made = create_instances_from_document(all_documents, d, params, rng)
        instances.extend(made)
        doc_a.extend([d] * len(made))
    return PackedInstances.from_instances(instances, doc_a, params.mask_id)
