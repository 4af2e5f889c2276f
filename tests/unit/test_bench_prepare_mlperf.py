"""bench.prepare_mlperf's input: text in the MLPerf reference's format, of the sizes asked,
that loaders.mlperf_text reads back document for document."""
from __future__ import annotations

from bench.prepare_mlperf import write_text
from loaders import mlperf_text


def test_written_text_is_the_reference_format_and_reads_back(tmp_path):
    docs = [[f"Sentence {d}.{s} of the document." for s in range(1 + d % 4)] for d in range(30)]
    total = write_text(docs, tmp_path, parts=2, part_mb=0.002, eval_mb=0.001)
    parts = mlperf_text.find_parts(tmp_path)
    assert [p.name for p in parts] == ["part-00000-of-00002", "part-00001-of-00002"]
    assert total == sum(p.stat().st_size for p in [*parts, tmp_path / "eval.txt"])
    assert all(p.stat().st_size >= 2000 for p in parts)
    read = [d for p in [*parts, tmp_path / "eval.txt"] for d in mlperf_text.read_documents(p)]
    assert all(d in docs for d in read) and len(read) >= len(docs)    # cycled past the end
