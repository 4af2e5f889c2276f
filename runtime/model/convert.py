"""``python -m runtime.model.convert CKPT_PREFIX --out DIR``: a TensorFlow BERT checkpoint -
the MLPerf phase-1 ``model.ckpt-28252`` - to ``DIR/model.safetensors`` in Hugging Face's
``BertForPreTraining`` layout, which ``model.init = "DIR"`` loads. No TensorFlow needed.

Owns: classifying a checkpoint's names - BERT weights mapped to HF keys (the names, their
keys and transpositions are basis.tf_names's, one list with the fixture generator and the
benchmark; the MLM decoder is the word embedding, tied, and its bias
``cls/predictions/output_bias``: ``TIED``), optimizer state (the LAMB/Adam slots
``<var>/adam_m``, ``<var>/adam_v``, ``<var>/LAMB``..., ``global_step``, ...; skipped unless
``--keep-optimizer-state``), or unknown -, the checks against the model's config, the
manifest and the command line (exit 0 written or up to date; 2 bad input or an --out that
cannot be written; 3 a full disk; 130 stopped by TERM, INT or HUP - always with nothing
written; the shell is basis.cli's). Never: the bundle format (runtime.model.tf_bundle), where
and how DIR is written (basis.staging), loading weights into a model (runtime.model.hf), or
training.

Order of work: the index is parsed, every name classified (an unknown one is an error), every
shape checked against the config and every data shard's presence and length checked - all
before one tensor byte is read; then the place of the output is made ready (temporary
directories of killed runs removed, ours created and locked, the free space checked); then
each tensor is read with its CRC-32C checked; only then is DIR written, in a temporary
directory moved into place, so DIR is absent, untouched or complete (basis.staging:
an absent DIR is renamed into being; an existing empty one - a mount point - is written into).
Rerunning with the same inputs finds DIR up to date (its manifest's source hashes, options and
model config agree, and its files' hashes) and exits 0; with other files, options or config
content it refuses, as it refuses any DIR it did not write: it never overwrites.

    python -m runtime.model.convert phase1/model.ckpt-28252 --out /data/bert_large
    python -m runtime.model.convert phase1/model.ckpt-28252 --out DIR \\
        --config submission/configs/config_DGXA100_1x8x56x1.toml   # the run's shape

The config is ``--config`` (a ``bert_config.json`` - Google's or HF's - or a Presto run
config TOML), else ``bert_config.json`` beside the checkpoint (where MLPerf ships it). A
``--config`` must agree with that own ``bert_config.json`` on the fields no shape reveals
(``FUNCTION_FIELDS``: the heads, the LayerNorm epsilon). DIR gets ``model.safetensors``,
``config.json`` (HF's keys) and ``manifest.json`` (source files with sizes and sha256, every
variable's mapping, what was skipped and why, the CRC-32C implementation).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from basis import cli, staging
from basis.staging import OutputError, Staging
from basis.tf_names import OPTIMIZER_STATE, SLOT, Mapped, map_name
from runtime.model.config import BertConfig
from runtime.model.crc32c import IMPLEMENTATION as CRC32C_IMPLEMENTATION
from runtime.model.tf_bundle import DTYPES, Bundle, BundleError

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer_state.safetensors"
MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "config.json"
FORMAT = "presto-tf-bert-conversion-1"

TIED = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias"}
"""HF keys that are another key's tensor (the tied MLM decoder): written as copies, as the
runtime's own HF files are, so HF's from_pretrained and model.init both read them."""


class ConvertError(ValueError):
    """A checkpoint, config or output directory this command refuses; exit status 2."""


def classify(names) -> tuple[list[Mapped], list[tuple[str, str]], list[str]]:
    """(weights, optimizer state as (name, why), unknown names)."""
    weights, state, unknown = [], [], []
    for name in names:
        mapped = map_name(name)
        slot = SLOT.match(name)
        if mapped:
            weights.append(mapped)
        elif name in OPTIMIZER_STATE:
            state.append((name, "optimizer/trainer scalar"))
        elif slot and map_name(slot["var"]):
            state.append((name, f"optimizer slot {slot['slot']} of {slot['var']}"))
        else:
            unknown.append(name)
    return weights, state, unknown


def expected_shapes(cfg: BertConfig) -> dict[str, tuple[int, ...]]:
    """Every HF key of ``BertForPreTraining(cfg)`` (tied aliases excepted) and its shape, from
    the model itself, built on the meta device (no memory)."""
    from runtime.model.bert import BertForPreTraining
    with torch.device("meta"):
        model = BertForPreTraining(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in TIED}


def _field_of(hf_key: str, dim: int) -> str:
    from runtime.model.hf import _SHAPE_FIELDS
    fields_ = next((f for p, f in _SHAPE_FIELDS if re.search(p, hf_key)), None) or ()
    return (fields_[dim] if dim < len(fields_) else None) or "hidden_size"


def check_against_config(bundle: Bundle, weights: list[Mapped], cfg: BertConfig,
                         config_source: str) -> None:
    want = expected_shapes(cfg)
    index = bundle.index_path
    layers = {int(m.group(1)) for w in weights
              if (m := re.match(r"bert\.encoder\.layer\.(\d+)\.", w.hf))}
    if layers and max(layers) + 1 != cfg.num_hidden_layers:
        raise ConvertError(f"{index}: the checkpoint has {max(layers) + 1} encoder layers "
                           f"(layer_0 .. layer_{max(layers)}), the config {config_source} "
                           f"num_hidden_layers = {cfg.num_hidden_layers}; convert with the "
                           "checkpoint's own bert_config.json, or set the run config's [model] "
                           "keys to the checkpoint's shape")
    extra = [w for w in weights if w.hf not in want]
    if extra:
        raise ConvertError(f"{index}: {len(extra)} variable(s) the config {config_source} has no "
                           f"place for: {', '.join(w.tf for w in extra[:8])} - pass the "
                           "checkpoint's own bert_config.json with --config")
    have = {w.hf for w in weights}
    missing = [k for k in want if k not in have]
    if missing:
        raise ConvertError(f"{index}: no variable for {len(missing)} weight(s) of the model in "
                           f"{config_source}: {', '.join(missing[:8])} - is this a BERT "
                           "pre-training checkpoint (with the cls/ heads), of this size?")
    wrong = []
    for w in weights:
        e = bundle.entries[w.tf]
        ours = want[w.hf]
        theirs = tuple(reversed(e.shape)) if w.transpose else e.shape
        if len(e.shape) != len(ours) or theirs != ours:
            fix = [f"{_field_of(w.hf, d)} = {t}" for d, (t, o) in enumerate(zip(theirs, ours))
                   if t != o] if len(theirs) == len(ours) else []
            wrong.append(f"{w.tf} has shape {list(e.shape)}, the config's {w.hf} needs "
                         f"{list(reversed(ours)) if w.transpose else list(ours)}"
                         + (f" ({', '.join(dict.fromkeys(fix))} in the checkpoint)" if fix else ""))
    if wrong:
        raise ConvertError(f"{index}: {len(wrong)} variable(s) disagree with the config "
                           f"{config_source}:\n  " + "\n  ".join(wrong[:10])
                           + "\nconvert with the checkpoint's own bert_config.json, or set the "
                           "run config's [model] keys to the checkpoint's shape")
    for w in weights:
        dtype = bundle.entries[w.tf].dtype_name
        if dtype not in ("float32", "float16", "bfloat16", "float64"):
            raise ConvertError(f"{index}: {w.tf} is {dtype}, not a floating-point weight")


def load_config(path: Path | None, prefix: Path) -> tuple[BertConfig, str]:
    """The model config to check against: ``--config`` (JSON or a run config TOML), else
    bert_config.json beside the checkpoint."""
    if path is None:
        path = prefix.parent / "bert_config.json"
        if not path.is_file():
            raise ConvertError(f"{path}: not found, and no --config given; pass the checkpoint's "
                               "bert_config.json (MLPerf ships it beside model.ckpt-28252) or "
                               "the run config (--config submission/configs/config_<SYSTEM>"
                               "_....toml)")
    path = Path(path)
    if not path.is_file():
        raise ConvertError(f"--config {path}: no such file")
    try:
        if path.suffix == ".toml":
            return _model_of_run_config(path), str(path)
        return BertConfig.from_hf_json(path), str(path)
    except Exception as e:  # noqa: BLE001 - a config error of any kind is the user's to fix
        raise ConvertError(f"--config {path}: {str(e).splitlines()[0]}") from None


def _model_of_run_config(path: Path) -> BertConfig:
    """The model a run config TOML names (its ``[model]`` table: a named ``size`` and the
    keys it sets, by basis.model_shape.sized - the run config's own rule: a shape key beside
    ``size`` that disagrees with it is refused the same way), read here rather than through
    runtime.config: the model room never imports the config. The run's other keys (init,
    attention, fusions) are not the checkpoint's business."""
    import tomllib
    from basis.model_shape import sized
    table = tomllib.loads(path.read_text(encoding="utf-8-sig")).get("model", {})
    known = {f.name for f in dataclasses.fields(BertConfig)}
    given = {k: v for k, v in table.items() if k in known}
    shape = sized(table["size"], given) if table.get("size") else {}
    return BertConfig(**{**given, **shape})


FUNCTION_FIELDS = ("num_attention_heads", "layer_norm_eps")
"""Fields that change what the weights compute but no weight's shape: a ``--config`` must
agree on them with the checkpoint's own bert_config.json (beside it), which trained them."""


def check_against_own_config(config: Path | None, prefix: Path, cfg: BertConfig,
                             config_source: str) -> None:
    """ConvertError when ``--config`` disagrees with the checkpoint's own bert_config.json on
    a ``FUNCTION_FIELDS`` field (with no --config, or no own config, nothing to compare)."""
    own = prefix.parent / "bert_config.json"
    if config is None or not own.is_file() or own.resolve() == Path(config).resolve():
        return
    try:
        theirs = BertConfig.from_hf_json(own)
    except Exception:  # noqa: BLE001 - --config was given instead of it: it is not needed
        return
    for name in FUNCTION_FIELDS:
        ours, trained = getattr(cfg, name), getattr(theirs, name)
        if ours != trained:
            raise ConvertError(
                f"--config {config_source}: {name} = {ours}, but the checkpoint's own {own} "
                f"says {name} = {trained}; no weight's shape shows it, so the converted model "
                f"would compute something other than what was trained - convert with {own} "
                f"(or without --config), or set {name} = {trained} in {config_source}")


def _tensor(bundle: Bundle, name: str, transpose: bool) -> torch.Tensor:
    array = bundle.read(name)
    if bundle.entries[name].dtype_name == "bfloat16":
        t = torch.from_numpy(array.copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(array.copy())
    return t.t().contiguous() if transpose else t


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _sources(bundle: Bundle) -> list[dict]:
    files = [bundle.index_path, *bundle.shard_paths()]
    return [{"file": p.name, "bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files]


def _differences(old: dict, sources: list[dict], options: dict, config: dict) -> list[str]:
    """What differs between a manifest and this conversion, in the user's words."""
    out = []
    if old.get("sources") != sources:
        out.append("the checkpoint's files (their sizes or sha256)")
    for key in sorted(set(options) | set(old.get("options", {}))):
        if old.get("options", {}).get(key) != options.get(key):
            out.append(f"--{key.replace('_', '-')}: {old.get('options', {}).get(key)} there, "
                       f"{options.get(key)} now")
    theirs = {k: v for k, v in old.get("config", {}).items() if k != "from"}
    for key in sorted(set(config) | set(theirs)):
        if theirs.get(key) != config.get(key):
            out.append(f"the model config's {key}: {theirs.get(key)} there, "
                       f"{config.get(key)} now")
    return out


def _entries(out: Path) -> list[Path]:
    """What ``out`` holds, less the empty ``lost+found`` of a freshly made filesystem mounted
    there (a volume's mount point)."""
    return [p for p in out.iterdir()
            if not (p.name == "lost+found" and os.path.ismount(out) and p.is_dir()
                    and not any(p.iterdir()))]


def _up_to_date(out: Path, sources: list[dict], options: dict, config: dict) -> bool:
    """True: ``out`` holds this very conversion, intact. False: ``out`` is absent or an empty
    directory. ConvertError: it holds anything else - another conversion included (other
    files, options or config content: config.json would differ) - which is never replaced."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise ConvertError(f"--out {out}: exists and is not a directory; pick another --out")
    if not _entries(out):
        return False
    try:
        old = json.loads((out / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        raise ConvertError(f"--out {out}: not empty and holds no {MANIFEST_FILE} of a "
                           "conversion; pick another --out or delete it") from None
    differ = _differences(old, sources, options, config)
    if differ:
        raise ConvertError(f"--out {out}: holds the conversion of other files or options "
                           f"({'; '.join(differ[:4])}; see its {MANIFEST_FILE}); pick another "
                           "--out or delete it")
    for name, facts in old.get("outputs", {}).items():
        path = out / name
        if not path.is_file() or _sha256(path) != facts.get("sha256"):
            raise ConvertError(f"{path}: missing or changed since it was written (its sha256 "
                               f"disagrees with {MANIFEST_FILE}); delete {out} and convert again")
    return True


def convert(prefix: str | os.PathLike, out: str | os.PathLike, config: Path | None = None,
            keep_optimizer_state: bool = False, log=print) -> dict:
    """Convert (see the module docstring); returns the manifest. ConvertError/BundleError on
    bad input, OutputError when --out cannot be written - each with nothing written."""
    prefix, out = Path(prefix), Path(out).resolve()
    bundle = Bundle(prefix)
    weights, state, unknown = classify(bundle.entries)
    if unknown:
        tf2 = any(".ATTRIBUTES/" in n for n in unknown)
        raise ConvertError(
            f"{bundle.index_path}: {len(unknown)} variable(s) that are neither BERT weights nor "
            f"optimizer state: {', '.join(unknown[:8])}" + (" ..." if len(unknown) > 8 else "")
            + (" - this is a TF2 object-graph checkpoint; convert MLPerf's tf1_ckpt "
               "(model.ckpt-28252 with bert/... names)" if tf2 else
               " - not a Google BERT pre-training checkpoint this converter knows"))
    cfg, config_source = load_config(config, prefix)
    check_against_config(bundle, weights, cfg, config_source)
    check_against_own_config(config, prefix, cfg, config_source)
    kept = [name for name, _ in state                  # numeric ones (not a TF2 object graph)
            if bundle.entries[name].dtype in DTYPES] if keep_optimizer_state else []
    bundle.check_layout([w.tf for w in weights] + kept)
    options = {"keep_optimizer_state": keep_optimizer_state}
    staging.refuse_live(out, log, "conversion")
    sources = _sources(bundle)
    if _up_to_date(out, sources, options, asdict(cfg)):
        log(f"{out} is up to date (the same checkpoint, options and config; files verified)")
        return json.loads((out / MANIFEST_FILE).read_text())

    by_hf = {w.hf: bundle.entries[w.tf].size for w in weights}
    need = (sum(by_hf.values()) + sum(by_hf[k] for k in TIED.values())
            + sum(bundle.entries[n].size for n in kept))
    stage = Staging(out).open(need)
    try:
        tensors = {w.hf: _tensor(bundle, w.tf, w.transpose) for w in weights}
        for alias, key in TIED.items():
            tensors[alias] = tensors[key].clone()
        slots = {}
        for name in kept:
            m = SLOT.match(name)
            mapped = map_name(m["var"]) if m else None
            key = f"{mapped.hf}.{m['slot']}" if mapped else name
            slots[key] = _tensor(bundle, name, bool(mapped and mapped.transpose))
        bad = [k for k, v in tensors.items() if not torch.isfinite(v).all()]
        if bad:
            raise ConvertError(f"{bundle.index_path}: {len(bad)} weight(s) hold NaN or inf: "
                               f"{', '.join(bad[:8])}; the checkpoint comes from a diverged "
                               "run")
        manifest = {
            "format": FORMAT, "created_by": "python -m runtime.model.convert",
            "source_prefix": prefix.name, "sources": sources, "options": options,
            "config": {"from": config_source, **asdict(cfg)},
            "mapping": [{"tf": w.tf, "hf": w.hf, "transpose": w.transpose,
                         "tf_shape": list(bundle.entries[w.tf].shape),
                         "dtype": bundle.entries[w.tf].dtype_name} for w in weights],
            "tied": TIED,
            "skipped": [] if keep_optimizer_state else [{"tf": n, "why": why}
                                                        for n, why in state],
            "optimizer_state": sorted(slots),
            "crc32c": CRC32C_IMPLEMENTATION,
        }
        _write(stage, tensors, slots, cfg, manifest)
    except BaseException:
        stage.discard()
        raise
    log(f"wrote {out}: {len(weights)} weights from {bundle.index_path.name} "
        f"({len(state)} optimizer variables {'kept' if kept else 'skipped'}; CRC-32C by "
        f"{CRC32C_IMPLEMENTATION})")
    return manifest


def _write(stage: Staging, tensors: dict, slots: dict, cfg: BertConfig, manifest: dict) -> None:
    """The files into ``stage.dir``, then moved into --out; an OSError of writing (a full
    disk, a read-only or busy place) becomes the user's OutputError."""
    from safetensors.torch import save_file

    tmp, path = stage.dir, stage.dir
    try:
        path = tmp / MODEL_FILE
        save_file(tensors, str(path), metadata={"format": "pt"})
        outputs = [MODEL_FILE]
        if slots:
            path = tmp / OPTIMIZER_FILE
            save_file(slots, str(path), metadata={"format": "pt"})
            outputs.append(OPTIMIZER_FILE)
        hf_config = {"architectures": ["BertForPreTraining"], "model_type": "bert",
                     "hidden_act": "gelu", "position_embedding_type": "absolute",
                     "tie_word_embeddings": True, **asdict(cfg)}
        path = tmp / CONFIG_FILE
        path.write_text(json.dumps(hf_config, indent=2) + "\n")
        manifest["outputs"] = {name: {"bytes": (tmp / name).stat().st_size,
                                      "sha256": _sha256(tmp / name)}
                               for name in outputs + [CONFIG_FILE]}
        path = tmp / MANIFEST_FILE
        path.write_text(json.dumps(manifest, indent=1) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        for name in outputs + [CONFIG_FILE, MANIFEST_FILE]:
            path = tmp / name     # safetensors writes 0600; the ranks of other hosts read it
            path.chmod(0o666 & ~umask)
        path = stage.out
        with cli.commit_window():
            stage.commit(outputs + [CONFIG_FILE, MANIFEST_FILE])
    except Exception as e:  # noqa: BLE001 - an OS error of any layer (safetensors' included)
        err = stage.error(e, path)
        if err is None:
            raise
        raise err from None


# ------------------------------------------------------------------------- command line

def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m runtime.model.convert",
        description="Convert a TensorFlow BERT checkpoint (the MLPerf phase-1 model.ckpt-28252) "
                    "to DIR/model.safetensors in Hugging Face's BertForPreTraining layout, "
                    "without TensorFlow.")
    p.add_argument("prefix", type=Path, help="checkpoint prefix (e.g. phase1/model.ckpt-28252: "
                   "the .index and .data-* files share it)")
    p.add_argument("--out", type=Path, required=True, help="output directory: absent, or an "
                   "empty directory (a mount point) that is written into")
    p.add_argument("--config", type=Path, help="bert_config.json or a run config .toml "
                   "(default: bert_config.json beside the checkpoint)")
    p.add_argument("--keep-optimizer-state", action="store_true",
                   help=f"also write the optimizer slots to {OPTIMIZER_FILE} (HF key + "
                        "'.adam_m' ...; transposed like their weights)")
    a = p.parse_args(argv)
    return cli.run("convert", lambda: convert(a.prefix, a.out, a.config,
                                              a.keep_optimizer_state),
                   {ConvertError: 2, BundleError: 2, OutputError: None})


if __name__ == "__main__":
    sys.exit(main())
