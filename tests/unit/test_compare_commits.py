"""``python -m bench.compare_commits``'s refusals (the runs themselves are two real
run_and_time.sh launches: docs/DEVELOPING.md records the check run with it)."""
from __future__ import annotations

import pytest

from bench import compare_commits


@pytest.mark.parametrize("argv,words", [
    (["no-such-commit-xyz"], "'no-such-commit-xyz' is no commit"),
    (["HEAD", "--steps", "0"], "--steps 0: give a positive number"),
])
def test_bad_arguments_are_refused_naming_them(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        compare_commits.main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_a_checkout_without_its_data_is_told_what_to_build(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(compare_commits, "LINKED", (".venv", "no_such_dir_here"))
    with pytest.raises(SystemExit) as e:
        compare_commits.main(["HEAD", "--work", str(tmp_path)])
    assert e.value.code == 2
    assert "no_such_dir_here missing" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())          # nothing made before the refusal
