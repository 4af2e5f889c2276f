"""What run_and_time.sh checks before anything starts (submission/preflight.py): the device a
config asks for, Inductor's cache for a run that compiles, the launcher's row, the memory -
each one sentence and exit 2. run_and_time.sh's use of it, row by row of the README's exit
table: tests/e2e/test_run_and_time.py."""
from __future__ import annotations

import os

import pytest

from runtime.config import load_config
from runtime.model import inductor_cache
from submission import preflight
from tests.support.tiny import as_overrides, TINY

CPU_ONLY = ("2.13.0+cpu", None)


def test_torch_build_is_read_without_importing_torch():
    import torch
    assert preflight.torch_build() == (torch.__version__, torch.version.cuda)


def test_inductors_default_cache_is_found_without_torch():
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    assert inductor_cache.default_location() == default_cache_dir()
    assert inductor_cache.locations({}) == [
        (default_cache_dir(), "Inductor's default cache directory (unset "
                              "TORCHINDUCTOR_CACHE_DIR)")]
    mine = inductor_cache.locations({"TORCHINDUCTOR_CACHE_DIR": "rel"})
    # the variable's, then the default's: Inductor keeps its precompiled headers there
    assert [p for p, _ in mine] == [os.path.abspath("rel"), default_cache_dir()]


def test_an_unusable_inductor_cache_is_one_sentence_naming_the_variable(tmp_path):
    afile = tmp_path / "a_file"
    afile.write_text("x")
    env = {"TORCHINDUCTOR_CACHE_DIR": str(afile)}
    assert inductor_cache.problem(env, "model.compile='layers'") == (
        f"TORCHINDUCTOR_CACHE_DIR={afile}: it exists and is not a directory, and this run "
        f"compiles (model.compile='layers'): Inductor keeps the kernels it builds there - set "
        f"TORCHINDUCTOR_CACHE_DIR to a writable directory (or unset it: Inductor's default is "
        f"{inductor_cache.default_location()})")
    under = afile / "cache"   # not creatable
    why = inductor_cache.problem({"TORCHINDUCTOR_CACHE_DIR": str(under)})
    assert why.startswith(f"TORCHINDUCTOR_CACHE_DIR={under}: it cannot be created ({afile} is "
                          f"not a directory): Inductor"), why
    # A directory this process cannot write (sysfs refuses even root; a read-only mount reads
    # the same, with its own reason)
    if inductor_cache._unwritable("/sys/presto-cache") is None:
        pytest.skip("/sys is writable here")
    why = inductor_cache.problem({"TORCHINDUCTOR_CACHE_DIR": "/sys/presto-cache"})
    assert why.startswith("TORCHINDUCTOR_CACHE_DIR=/sys/presto-cache: it does not exist and "
                          "cannot be created in /sys ("), why
    # Inductor's g++ command lines are split on blanks: "input file ... is the same as output"
    why = inductor_cache.problem({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "my cache")})
    assert why.startswith(f"TORCHINDUCTOR_CACHE_DIR={tmp_path / 'my cache'}: its path holds a "
                          f"blank, which Inductor's compiler command lines do not quote"), why
    # usable: a missing directory in a writable one (Inductor makes it), or a writable one
    assert inductor_cache.problem({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "new")}) is None
    assert not (tmp_path / "new").exists() and sorted(tmp_path.iterdir()) == [afile]
    assert inductor_cache.problem({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}) is None


def test_what_a_config_compiles():
    assert load_config(None, as_overrides(TINY)).compiles() == []   # foreach: nothing
    assert load_config(None, []).compiles() == [
        "optim.backend='auto', whose fused step is compiled"]
    assert load_config(None, [*as_overrides(TINY), "model.compile='layers'",
                              "data.shapes='static'"]).compiles() == [
        "model.compile='layers' (each encoder layer's forward and backward)"]
    assert load_config(None, [*as_overrides(TINY), "model.fusions=['bias_gelu', 'qkv']"]
                       ).compiles() == ["model.fusions bias_gelu"]


def test_a_cuda_device_on_a_torch_without_cuda_is_refused_naming_the_key(monkeypatch):
    monkeypatch.setattr(preflight, "torch_build", lambda: CPU_ONLY)
    sets = [*as_overrides(TINY), "system.device='cuda'"]
    why = preflight.device_problem(load_config(None, sets), None, sets)
    assert why.startswith("system.device='cuda', but torch 2.13.0+cpu (") and why.endswith(
        ") is built without CUDA: set system.device='cpu' (or 'auto'), or run where a CUDA "
        "build of torch sees a GPU"), why
    # 'auto' falls back to the CPU: refused only for what the CPU cannot run
    sets = [*as_overrides(TINY), "system.device='auto'"]
    assert preflight.device_problem(load_config(None, sets), None, sets) is None
    sets.append("train.precision='bf16'")
    why = preflight.device_problem(load_config(None, sets), None, sets)
    assert why.startswith("system.device='auto' is the CPU here - torch 2.13.0+cpu (") and \
        "and on the CPU: train.precision='bf16' needs a CUDA device" in why, why
    sets = [*as_overrides(TINY), "system.device='cpu'"]
    assert preflight.device_problem(load_config(None, sets), None, sets) is None


def test_the_first_problem_is_said_with_run_and_time_sh_s_prefix(tmp_path, monkeypatch,
                                                                 capsys):
    config = tmp_path / "config_T_1x2x8x1.toml"
    config.write_text('[system]\nlauncher = "torchrun"\ndevice = "cpu"\n[train]\n'
                      'global_batch_size = 16\n[model]\nhidden_size = 64\n'
                      'num_hidden_layers = 1\nnum_attention_heads = 2\n'
                      'intermediate_size = 128\n')
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(config / "x"))
    assert preflight.main([str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"run_and_time.sh: TORCHINDUCTOR_CACHE_DIR={config / 'x'}: ") and \
        err.count("\n") == 1, err
    monkeypatch.setenv("TORCHRUN", "/no/torchrun")   # the launcher's is said first
    assert preflight.main([str(config)]) == 2
    assert capsys.readouterr().err == ("run_and_time.sh: TORCHRUN '/no/torchrun' not found (set "
                                       "TORCHRUN)\n")
    # srun: its ranks run on the allocation's nodes, whose cache is not this host's
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setenv("SRUN", "true")
    assert preflight.main([str(config), "--set", "system.launcher='srun'"]) == 0
