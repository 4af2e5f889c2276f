"""bench.optim plumbing: the BERT shapes it times and the goals comparing the fastest Presto
backend with its peers. One worker record (a compiled step):
tests/integration/test_bench_optim_integration.py."""

from bench import optim as bench


def test_bert_shapes_are_the_real_models_with_the_tied_decoder_once():
    base = bench.bert_named_shapes("base")
    large = bench.bert_named_shapes("large")
    count = lambda shapes: sum(__import__("math").prod(s) for _, s in shapes)  # noqa: E731
    assert count(base) == 110_106_428 and len(base) == 206
    assert count(large) == 336_226_108 and len(large) == 398
    names = [n for n, _ in base]
    assert "bert.embeddings.word_embeddings.weight" in names
    assert "cls.predictions.decoder.weight" not in names  # tied: counted once


def test_goals_compare_fastest_presto_against_peers():
    recs = [dict(model="m", optimizer="lamb", impl="presto:fused", step_min_s=1.0,
                 ratio_to_limit=1.4),
            dict(model="m", optimizer="lamb", impl="presto:reference", step_min_s=5.0,
                 ratio_to_limit=7.0),
            dict(model="m", optimizer="lamb", impl="timm", step_min_s=2.5, ratio_to_limit=3.5),
            dict(model="m", optimizer="lamb", impl="torch-optimizer", step_min_s=1.5,
                 ratio_to_limit=2.1),
            dict(model="m", optimizer="lamb", impl="pytorch-lamb", error="ImportError: x"),
            dict(model="m", optimizer="adamw", impl="presto:fused", step_min_s=0.9),
            dict(model="m", optimizer="adamw", impl="torch:fused", step_min_s=1.0)]
    g = bench.goals(recs)["m"]
    assert g["fastest_lamb"] == "presto:fused" and g["lamb_within_1.5x_limit"]
    assert g["lamb_speedup_over_peers"] == {"timm": 2.5, "torch-optimizer": 1.5}
    assert g["lamb_2x_faster_than_every_peer"] is False
    assert g["adamw_at_least_as_fast_as_torch_fused"] and g["adamw_vs_torch_fused"] == 1.111
