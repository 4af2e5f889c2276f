"""bench.hpo_batch's pieces: its search space is one `python -m submission hpo` accepts with
the study's default as the first trial, the first trial that beat that default, and the
answer read from the confirmation table."""
from __future__ import annotations

from bench.batch_scaling import CONFIG, PROXY, reusable
import json
import types

import pytest

from bench.hpo_batch import answer, confirm, first_beating, plan, space_text, study_runs
from runtime.config import load_config
from submission.hpo import load_space


def test_the_space_is_valid_and_holds_the_scaled_default(tmp_path):
    for opt in ("lamb", "adamw"):
        space = tmp_path / f"{opt}.toml"
        space.write_text(space_text(opt))
        over = ["data.data_dir=data/scaling64", *PROXY, *plan(opt, "sqrt", 1024, 0.1)]
        params = load_space(space, CONFIG, over)
        cfg = load_config(CONFIG, over)
        for p in params:   # the baseline trial is the √-rule default: inside the space
            section, key = p.key.split(".")
            assert p.contains(getattr(getattr(cfg, section), key)), p


def test_first_beating_and_the_answer():
    rows = [{"number": 0, "origin": "baseline", "value": 100.0, "state": "COMPLETE"},
            {"number": 1, "origin": "sampled", "value": 120.0, "state": "COMPLETE"},
            {"number": 2, "origin": "sampled", "value": None, "state": "PRUNED"},
            {"number": 3, "origin": "sampled", "value": 90.0, "state": "COMPLETE"}]
    assert first_beating(rows) == 3
    assert first_beating(rows[:3]) is None
    row = lambda o, s, reached, mean: {"optimizer": o, "setting": s, "runs": 3,
                                       "reached": reached, "mean_samples": mean}
    assert answer([row("adamw", "searched", 3, 5e4), row("lamb", "searched", 3, 6e4)]) \
        .startswith("yes")
    assert answer([row("adamw", "searched", 3, 7e4), row("lamb", "searched", 3, 6e4)]) \
        .startswith("no:")
    assert answer([row("adamw", "searched", 3, 7e4), row("lamb", "searched", 1, 6e4)]) \
        .startswith("yes")
    assert answer([row("adamw", "searched", 0, None), row("lamb", "searched", 2, 6e4)]) \
        .startswith("neither")
    # a search whose best trial is censored has no searched row (nothing to confirm)
    assert answer([row("lamb", "searched", 3, 6e4)]).startswith("only the LAMB search")
    assert answer([row("adamw", "searched", 3, 6e4)]).endswith("yes for this batch and trial "
                                                                "budget")
    assert answer([row("adamw", "sqrt", 0, None)]).startswith("no answer: neither search")


def test_the_studys_default_runs_are_taken_only_with_the_same_overrides_and_seed(tmp_path):
    over = plan("lamb", "sqrt", 1024, 0.1)
    row = lambda seed, o: {"optimizer": "lamb", "rule": "sqrt", "batch": 1024, "seed": seed,
                           "overrides": o, "status": "aborted", "wall_s": 300.0,
                           "samples_to_target": None, "steps_to_target": None}
    rec = {"target": 0.1, "proxy": PROXY, "base_batch": 32,
           "runs": [row(1, over), row(2, over), {**row(1, over), "batch": 512}]}
    path = tmp_path / "study.json"
    path.write_text(json.dumps(rec))
    earlier = study_runs(path, 1024, 0.1)
    assert [r["seed"] for r in earlier] == [1, 2]
    args = types.SimpleNamespace(seeds=[1, 2], batch=1024, target=0.1)
    out = confirm("lamb", "sqrt", over, args, tmp_path, earlier)   # nothing is launched
    assert [r["reused_from_study"] for r in out] == [True, True]
    other = [o if not o.startswith("optim.lr=") else "optim.lr=0.5" for o in over]
    assert not any(reusable(r, other) for r in earlier)   # another lr is another run
    path.write_text(json.dumps({**rec, "target": 0.2}))
    with pytest.raises(SystemExit, match="target, proxy or base batch"):
        study_runs(path, 1024, 0.1)
