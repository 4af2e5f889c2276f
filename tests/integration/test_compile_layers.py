"""Whole encoder layers compiled (model.compile = 'layers', runtime/model/compile.py) against the
eager layers on CPU: one graph serves every layer and every batch layout - the widths
constants and only the batch's dimensions symbolic in the generated code -, the compiled
encoder equal to the eager one in value and every gradient (fp32, dropout off: Inductor's
dropout draws its own masks), a short trainer run of real batches whose losses follow the
eager run's step by step with no compile after its first step and its first evaluation, for
each precision the CPU takes, and the refusal beside the compiled fusions through the real
entry point. The config's rows and refusals: tests/unit/test_configs.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kernels.attention import Varlen
from runtime.choices import PRECISIONS
from runtime.config import ConfigError
from runtime.events import CallbackList, Event
from runtime.model.bert import BertForPreTraining, Unpadded, additive_mask
from runtime.model.compile import CompiledLayer, compile_layers, compiled_layers
from runtime.model.config import BertConfig
from tests.support.inductor import frames_compiled, generated_code, input_sizes, is_constant
from tests.support.launch import ROOT
from tests.support.runs import CPU_CONFIG
from tests.support.tiny import tiny_config

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32: the generated kernels sum in another order
LOSS_RTOL = {"fp32": 1e-4}
"""Losses of 30 steps, compiled against eager: fp32's summation orders; a 16-bit precision
(where the CPU takes one) rounds differently where Inductor fuses: 2 % (the CUDA tests')."""


def config():
    return BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=128, max_position_embeddings=128,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def twins(attention: str, static_shapes: bool = False):
    """(eager, compiled): two models of the same weights, the second's layers compiled."""
    torch.manual_seed(0)
    eager = BertForPreTraining(config(), attention=attention)
    fast = BertForPreTraining(config(), attention=attention)
    fast.load_state_dict(eager.state_dict())
    assert compile_layers(fast, static_shapes) == 2
    return eager, fast


def layouts(attention: str, n: int, seed: int = 0):
    """``n`` random batch layouts of changing sizes: (x, key mask) for the encoder - unpadded:
    2-8 sequences of 2-60 tokens (the tokens, the sequences and the longest one change);
    padded: 2-6 rows of 3-40 columns. The first - the one a layer compiles at - has as many
    tokens (unpadded) or columns (padded) as the hidden size: torch's duck sizing would give
    the two one symbol and specialise the batch's with the width."""
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        if attention == "unpadded":
            lengths = torch.randint(2, 61, (int(torch.randint(2, 9, (1,), generator=g)),),
                                    generator=g) if i else torch.tensor([30, 20, 14])
            varlen = Varlen.from_lengths(lengths)
            yield torch.randn(varlen.num_tokens, 64, generator=g), Unpadded(varlen, "auto")
        else:
            b, width = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in
                        ((2, 7), (3, 41)))
            width = width if i else 64
            lengths = torch.randint(1, width + 1, (b,), generator=g)
            mask = torch.arange(width)[None, :] < lengths[:, None]
            x = torch.randn(b, width, 64, generator=g)
            yield x, additive_mask(mask[:, None, None, :], x)


def encoder_grads(model, x, key_mask):
    """The encoder's output, and the gradients of its input and every layer parameter."""
    x = x.clone().requires_grad_()
    model.zero_grad()
    out = model.bert.encoder(x, key_mask)
    out.backward(torch.ones_like(out).mul_(0.37))
    return [out.detach(), x.grad] + [p.grad for p in model.bert.encoder.parameters()]


@pytest.mark.parametrize("attention", ["unpadded", "padded"])
def test_one_graph_serves_every_layer_and_layout_and_equals_the_eager_layers(attention):
    eager, fast = twins(attention)
    assert all(isinstance(c, CompiledLayer) for c in compiled_layers(fast)) and \
        len(compiled_layers(fast)) == 2 and not compiled_layers(eager)
    batches = list(layouts(attention, 6))
    first = {}
    code = generated_code(lambda: first.update(got=encoder_grads(fast, *batches[0])))
    sizes = input_sizes(code)
    rows = [s for s in sizes if len(s) == 2]  # [T, H], [T, I], [H, H], [I, H], ...
    assert len(rows) >= 8 and {s[1] for s in rows} <= {"1", "64", "128"}, sizes
    assert {("64", "64"), ("128", "64"), ("64", "128")} <= set(rows), sizes  # the weights
    assert any(not is_constant(s[0]) for s in rows), sizes   # the tokens: a symbol
    compiled = frames_compiled()   # the first layer's graph (the second layer reuses it)
    for i, (x, key_mask) in enumerate(batches):
        got = first["got"] if i == 0 else encoder_grads(fast, x, key_mask)
        want = encoder_grads(eager, x, key_mask)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOL)
    assert frames_compiled() == compiled, "a batch layout was recompiled"


def test_static_shapes_compile_every_size_as_a_constant():
    """data.shapes = 'static' (what CUDA graphs replay): dynamic=False, no symbol at all."""
    eager, fast = twins("unpadded", static_shapes=True)
    x, key_mask = next(layouts("unpadded", 1, seed=3))
    got = {}
    sizes = input_sizes(generated_code(lambda: got.update(g=encoder_grads(fast, x, key_mask))))
    assert sizes and all(is_constant(d) for s in sizes for d in s), sizes
    for a, b in zip(got["g"], encoder_grads(eager, x, key_mask)):
        torch.testing.assert_close(a, b, **TOL)


def test_each_model_compiles_into_a_list_of_graphs_of_its_own():
    """Dynamo keeps graphs per code object and fails a fullgraph compile past its recompile
    limit (8): CI's bf16 trainer run failed so, its layer's code already holding the graphs
    of the models earlier tests had built in that process. Each model compiles its layers'
    own copy of the code: here, under a limit of one graph, two models of two static
    layouts compile one graph each (with one shared code object the second would fail)."""
    name = ("recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit")
            else "cache_size_limit")
    codes = []
    with torch._dynamo.config.patch(**{name: 1}), torch.no_grad():
        for seed in (1, 2):
            eager, fast = twins("unpadded", static_shapes=True)
            x, key_mask = list(layouts("unpadded", 2, seed=seed))[1]
            torch.testing.assert_close(fast.bert.encoder(x, key_mask),
                                       eager.bert.encoder(x, key_mask), **TOL)
            one, two = compiled_layers(fast)
            assert one.eager.__code__ is two.eager.__code__   # one graph serves both layers
            codes.append(one.eager.__code__)
    assert codes[0] is not codes[1] and not {id(c) for c in codes} & {
        id(type(fast.bert.encoder.layer[0]).forward.__code__)}


class Recorder:
    """Each step's loss, the graphs compiled so far at each step and evaluation, and what
    the trainer said."""

    def __init__(self):
        self.losses, self.compiled, self.said = [], [], []

    def on_event(self, event, state):
        if event is Event.LOG:
            self.losses += [m.loss for m in state.logged_steps]
        if event in (Event.STEP, Event.EVAL_STOP):
            self.compiled.append((event.value, state.step, frames_compiled()))


def fit(data, single_ctx, *extra):
    from runtime.train.trainer import Trainer
    rec = Recorder()
    cfg = tiny_config(data, "model.num_hidden_layers=2", "train.max_steps=30",
                      "train.log_every_steps=1", "train.eval_iter_start_samples=160",
                      "train.eval_iter_samples=160", "train.target_mlm_accuracy=0.99",
                      "data.eval_batch_size=32", *extra)
    trainer = Trainer(cfg, single_ctx, CallbackList([rec]), log=rec.said.append)
    try:
        state = trainer.fit()
        layers = len(compiled_layers(trainer.model))
    finally:
        trainer.close()
    assert state.step == 30 and len(rec.losses) == 30
    return rec, layers


CASES = {
    "fp32-unpadded": ("fp32", ["model.attention=unpadded"]),
    "fp32-padded": ("fp32", ["model.attention=padded"]),
    # static shapes (what CUDA graphs replay) in the 16-bit precision a CPU runs: the path
    # the GPU configs take. Each case is two compiles and two runs; the static compile's
    # fp32 numerics are test_static_shapes_compile_every_size_as_a_constant's (the layers,
    # forward and backward, at TOL), so no fp32 static run repeats them here.
    "bf16_master-unpadded-static": ("bf16_master", ["model.attention=unpadded",
                                                    "data.shapes=static"]),
}
"""The compiled-vs-eager cases: (train.precision, overrides)."""


def case_overrides(precision: str, case: list) -> list:
    extra = [f"train.precision={precision}", *case]
    if PRECISIONS[precision].master:   # (the fused optimizer keeps the masters)
        extra.append("optim.backend=auto")
    return extra


@pytest.fixture(scope="module")
def compiled_runs(small_dataset) -> dict:
    """Every case the CPU takes, its eager and its compiled run, in one child process with two
    threads (one start-up and one Inductor import for the three, not three; each model compiles
    its own graphs, so the cases share nothing compiled): {case id: result or refusal}."""
    cases, refused = {}, {}
    for name, (precision, case) in CASES.items():
        extra = case_overrides(precision, case)
        try:
            tiny_config(small_dataset, *extra, "model.compile=layers")
            cases[name] = extra
        except ConfigError as e:
            refused[name] = str(e)
    proc = subprocess.run([sys.executable, "-c", TWO_RUNS, str(small_dataset),
                           json.dumps(cases)], cwd=ROOT, capture_output=True, text=True,
                          timeout=1400, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**got, **{name: {"refused": why} for name, why in refused.items()}}


@pytest.mark.slow  # three cases, each two compiles and two 30-step runs, in one child: minutes
@pytest.mark.timeout(1500)   # (the first case's setup runs all three)
@pytest.mark.parametrize("name", list(CASES))
def test_a_compiled_run_follows_the_eager_run_and_compiles_only_at_its_start(
        compiled_runs, name):
    """30 steps of real batches (their token counts change every step), evaluated every 10:
    the losses of the compiled layers follow the eager run's step by step, and after the
    first step (the training graph) and the first evaluation (the evaluation graph) nothing
    is compiled again. Dropout is off: Inductor draws its own masks. The runs are made in a
    process of their own with two threads: at one thread (what conftest gives each of the
    suite's two workers) the dynamic-shape fp32 cases hit the known, unfixed Inductor bug
    runtime/model/compile.py describes; the static and bf16 cases and the encoder-only tests
    above pass at one thread."""
    got = compiled_runs[name]
    if "refused" in got:
        pytest.skip(f"refused on CPU: {got['refused']}")
    assert "error" not in got, got.get("error")
    eager, fast = got["eager"], got["fast"]
    assert eager["layers"] == 0 and fast["layers"] == 2
    precision = CASES[name][0]
    torch.testing.assert_close(torch.tensor(fast["losses"]), torch.tensor(eager["losses"]),
                               rtol=LOSS_RTOL.get(precision, 2e-2), atol=1e-5)
    assert eager["losses"][0] != eager["losses"][-1]  # it trained
    # The compile is said before it starts, and the first step's time after it.
    said = [x for x in fast["said"] if x.startswith(("compiling", "step 1 done"))]
    assert said[0].startswith("compiling model.compile='layers'"), fast["said"]
    assert said[1].startswith("step 1 done") and "compiling included" in said[1], said
    assert not any(x.startswith("compiling") for x in eager["said"])
    compiled = fast["compiled"]
    after_step_1 = next(c for e, s, c in compiled if e == "step" and s == 1)
    evals = [(s, c) for e, s, c in compiled if e == "eval_stop"]
    assert [s for s, _ in evals] == [10, 20, 30]
    steps_before_eval = [c for e, s, c in compiled if e == "step" and 1 <= s <= 10]
    assert set(steps_before_eval) == {after_step_1}, compiled
    assert {c for _, c in evals} == {evals[0][1]} and \
        {c for e, s, c in compiled if e == "step" and s > 10} == {evals[0][1]}, compiled


TWO_RUNS = """
import json, sys, traceback
from pathlib import Path
from runtime.launch import dist
from runtime.launch.env import discover
from tests.integration.test_compile_layers import fit
data, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
ctx = dist.init_distributed(discover({}), device="cpu")
out = {}
try:
    for case, extra in cases.items():
        try:
            runs = {}
            for name, more in (("eager", []), ("fast", ["model.compile=layers"])):
                rec, layers = fit(data, ctx, *extra, *more)
                runs[name] = {"losses": rec.losses, "compiled": rec.compiled, "layers": layers,
                              "said": rec.said}
            out[case] = runs
        except Exception:
            out[case] = {"error": traceback.format_exc()[-4000:]}
finally:
    dist.shutdown()
print(json.dumps(out))
"""
"""Each case's eager and compiled run, in one process of their own (JSON on stdout); a case
that fails is recorded with its traceback and the next one still runs."""


def test_compiled_layers_beside_the_compiled_fusions_are_refused_before_launch():
    """Exit 2 from the config check, naming both keys (a compiled layer fuses what they do)."""
    proc = subprocess.run([sys.executable, "-m", "runtime.config", str(CPU_CONFIG), "--set",
                           'model.compile="layers"', "--set",
                           'model.fusions=["pad_vocab","dropout_add_norm"]'], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "model.compile='layers'" in proc.stderr and "model.fusions" in proc.stderr and \
        "'dropout_add_norm'" in proc.stderr and "Traceback" not in proc.stderr
