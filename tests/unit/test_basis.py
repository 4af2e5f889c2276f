"""basis/, the room below loaders and runtime: a tool's shell (basis.cli: exit statuses, the
one line, stop signals), the TF variable names held against a checkpoint real TensorFlow
wrote, and the staging's order of a whole directory. The converter's and the builders' own
use of them: tests/unit/test_convert_out.py, tests/integration/test_prepare_integration.py,
tests/unit/test_nvidia_shards.py."""
from __future__ import annotations

import signal
import threading

import numpy as np
import pytest

from basis import cli, staging, tf_names
from tests.support.tf_checkpoint import FIXTURE


def _signal(sig):
    """``sig`` to this process's main thread, where Python runs its handler at once (taken by
    another thread, a process-directed signal reaches the handler only milliseconds later)."""
    signal.pthread_kill(threading.main_thread().ident, sig)


class Bad(ValueError):
    pass


class Full(OSError):
    exit_code = 3


def _run(capsys, work, **kw):
    rc = cli.run("tool", work, {Bad: 2, Full: None, RuntimeError: 3}, **kw)
    return rc, capsys.readouterr().err


def _raise(e):
    def work():
        raise e
    return work


def test_a_declared_failure_is_one_line_and_its_exit_status(capsys):
    assert _run(capsys, lambda: None) == (0, "")
    assert _run(capsys, _raise(Bad("the file x is bad; fix it"))) == (
        2, "tool: error: the file x is bad; fix it\n")
    assert _run(capsys, _raise(Full("no room"))) == (3, "tool: error: no room\n")  # its own
    assert _run(capsys, _raise(RuntimeError("a worker died"))) == (3, "tool: error: a worker died\n")
    with pytest.raises(KeyError):                     # undeclared: a bug, its traceback wanted
        _run(capsys, _raise(KeyError("x")))


def _stopped_by(sig):
    def work():
        _signal(sig)
        raise AssertionError("the stop did not stop the tool")
    return work


@pytest.mark.parametrize("sig", cli.STOP_SIGNALS, ids=lambda s: s.name)
def test_each_stop_signal_exits_130_and_the_handlers_are_put_back(capsys, sig):
    old = {s: signal.getsignal(s) for s in cli.STOP_SIGNALS}
    try:
        # as from a terminal: a suite started in the background has INT and HUP ignored
        for s in cli.STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL if s != signal.SIGINT
                          else signal.default_int_handler)
        before = {s: signal.getsignal(s) for s in cli.STOP_SIGNALS}
        assert _run(capsys, _stopped_by(sig)) == (
            130, "tool: interrupted; nothing was written to --out\n")
        assert {s: signal.getsignal(s) for s in cli.STOP_SIGNALS} == before
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def test_a_signal_ignored_at_start_stays_ignored(capsys):
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)       # nohup
    try:
        assert _run(capsys, lambda: _signal(signal.SIGHUP)) == (0, "")
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)


def test_a_stop_waits_for_the_commit_or_is_left_to_the_pool(capsys):
    def committing():
        with cli.commit_window():
            _signal(signal.SIGTERM)      # ignored: the output moves into place
    assert _run(capsys, committing) == (0, "")
    noted = []

    def defer():
        noted.append(True)
        return True                                   # the pool's wait raises at its poll

    def pool_wait():
        _signal(signal.SIGTERM)
        assert noted
        raise KeyboardInterrupt("stopped by a signal")
    assert _run(capsys, pool_wait, defer=defer) == (
        130, "tool: interrupted; nothing was written to --out\n")


def test_the_tf_names_are_the_ones_tensorflow_wrote():
    """tests/fixtures/tf_bert_tiny: a checkpoint real TensorFlow wrote with Google BERT's
    variable names - every weight of ``variables`` is in it with its shape, and nothing else
    of it is a weight; each maps to an HF key of its own."""
    import json
    cfg = json.loads((FIXTURE / "bert_config.json").read_text())
    with np.load(FIXTURE / "tf_values.npz") as z:
        written = {k.replace("|", "/"): z[k].shape for k in z.files if k != "tf_version"}
    want = tf_names.variables(cfg)
    assert {n: written[n] for n, _ in want} == dict(want)
    rest = set(written) - {n for n, _ in want}
    assert rest and all(tf_names.SLOT.match(n) or n in tf_names.OPTIMIZER_STATE for n in rest)
    hf = [tf_names.map_name(n).hf for n, _ in want]
    assert len(set(hf)) == len(hf) and "bert.encoder.layer.2.output.dense.weight" in hf
    assert tf_names.map_name("bert/encoder/layer_2/output/dense/kernel").transpose
    assert tf_names.map_name("bert/encoder/layer_2/output/dense/kernel/adam_m") is None


def test_a_whole_directory_commits_its_manifest_last(tmp_path):
    out = tmp_path / "out"
    stage = staging.Staging(out, "build").open()
    for name in ("stats.json", "b.txt", "a"):
        (stage.dir / name).mkdir() if name == "a" else (stage.dir / name).write_text(name)
    assert stage.contents(last="stats.json") == ["a", "b.txt", "stats.json"]
    stage.commit(stage.contents(last="stats.json"))
    assert sorted(p.name for p in out.iterdir()) == ["a", "b.txt", "stats.json"]
    assert list(tmp_path.iterdir()) == [out]
