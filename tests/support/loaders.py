"""Training loaders as the loader tests build them: a balance mode's ``BalanceSpec`` at pack
length 128 (``spec``), a ``TrainLoader`` with it (``loader``), a batch's sequences as
fingerprints comparable with a stored sample's (``sequences_of``), and a loader of static
shapes (``static_loader``; ``OFFLINE`` is the offline-pack specification of the static-shape
tests)."""
from __future__ import annotations

import torch

from loaders.balance import BalanceSpec
from loaders.collate import IGNORE_INDEX, Batch
from loaders.dataset import TrainLoader


def spec(mode: str, group_size: int = 2, **kw) -> BalanceSpec:
    return BalanceSpec(mode, group_size=group_size, pack_length=128, **kw)


def sequences_of(batch: Batch) -> list[tuple]:
    """Per *sequence* (packed or not), in the row-major order of next_sentence_labels:
    the fingerprint ``raw_fingerprint`` gives a stored sample."""
    out = []
    nsp = batch.next_sentence_labels.tolist()
    for r in range(batch.size):
        mask = batch.attention_mask[r]
        for k in range(1, int(mask.max()) + 1):
            where = torch.nonzero(mask == k).flatten()
            start = int(where[0])
            labels = batch.masked_lm_labels[r, where]
            masked = torch.nonzero(labels != IGNORE_INDEX).flatten().tolist()
            out.append((tuple(batch.input_ids[r, where].tolist()),
                        tuple(batch.token_type_ids[r, where].tolist()),
                        tuple((p, int(labels[p])) for p in masked)))
            assert int(where[-1]) - start + 1 == len(where)  # contiguous in its row
    assert len(out) == len(nsp)
    return [fp + (label,) for fp, label in zip(out, nsp)]


def loader(root, rank, world, b, mode, seed=7, **kw) -> TrainLoader:
    return TrainLoader(root, rank, world, b, seed, verify=False, balance=spec(mode, **kw))


OFFLINE = dict(mode="offline_pack", pack_length=128, max_seqs_per_row=3, static_rows=0)


def static_loader(data, rank=0, world=2, b=8, **spec):
    return TrainLoader(data, rank, world, b, 5, verify=False, shapes="static",
                       balance=BalanceSpec(**(spec or {"mode": "random"})),
                       max_predictions_per_seq=20)
