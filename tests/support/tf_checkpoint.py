"""The converter tests' checkpoint: the fixture TensorFlow wrote (tests/fixtures/tf_bert_tiny/,
see its make_fixture.py), its config, and a copy of it to damage."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tf_bert_tiny"
PREFIX = FIXTURE / "model.ckpt-3"
CONFIG = json.loads((FIXTURE / "bert_config.json").read_text())


def copy_checkpoint(dst: Path, prefix: Path = PREFIX) -> Path:
    """The checkpoint ``prefix`` and the fixture's bert_config.json copied into ``dst``;
    returns the copy's prefix."""
    for f in prefix.parent.glob(prefix.name + ".*"):
        shutil.copy(f, dst / f.name)
    shutil.copy(FIXTURE / "bert_config.json", dst / "bert_config.json")
    return dst / prefix.name
