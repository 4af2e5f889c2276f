"""loaders.prepare's parts: corpus extraction (sentences, wiki XML, HTML paragraphs, Debian
packages), the eval split, tokenisation against a plain-Python reference, the vocab check,
masking and example creation with the reference semantics.

All on real text (Wikipedia lead sections and articles, the uncased BERT vocab), CPU only.
Building whole data sets: tests/integration/test_prepare_integration.py."""
from __future__ import annotations

import random
import unicodedata

import numpy as np
import pytest

from loaders import corpus, pretraining, tokenization
from loaders.shards import DataError
from tests.support.data import SOURCES

CLS, SEP, MASK = tokenization.CLS_ID, tokenization.SEP_ID, tokenization.MASK_ID


@pytest.fixture(scope="module")
def real_sentences() -> list[str]:
    """A few hundred real sentences: every 40th summary plus ones with non-ASCII text."""
    items = corpus.read_summaries(corpus.summaries_path())
    paras = [p for _, _, ps in items for p in ps]
    picked = paras[::40] + [p for p in paras if any(ord(c) > 127 for c in p)][::12]
    sents = [s for p in picked for s in corpus.split_sentences(p)]
    return sents[:900]


@pytest.fixture(scope="module")
def vocab():
    return tokenization.load_vocab(tokenization.default_vocab_path())


# ---------------------------------------------------------------------------------------

def test_split_sentences_rules():
    text = ("Dr. Smith moved to the U.S. Army base in 1950. He paid $3.50 for e.g. apples, "
            "i.e. fruit! J. R. R. Tolkien wrote it (see Fig. 3). Was it 2.5 km away? "
            "\"Yes.\" The end")
    assert corpus.split_sentences(text) == [
        "Dr. Smith moved to the U.S. Army base in 1950.",
        "He paid $3.50 for e.g. apples, i.e. fruit!",
        "J. R. R. Tolkien wrote it (see Fig. 3).",
        "Was it 2.5 km away?",
        "\"Yes.\"",
        "The end"]
    assert corpus.split_sentences("  \n ") == []


def test_wiki_xml_articles_are_clean_prose():
    pages = corpus.read_wiki_xml(SOURCES / corpus.WIKI_XML_NAME)
    titles = {t for _, t, _ in pages}
    assert len(pages) == 106 and "Anarchism" in titles
    assert "AccessibleComputing" not in titles            # a redirect
    by_title = {t: w for _, t, w in pages}
    paras = corpus.wikitext_to_paragraphs(by_title["Anarchism"])
    text = "\n".join(paras)
    assert text.startswith("Anarchism is a political philosophy")
    for junk in ("{{", "}}", "[[", "]]", "<ref", "Category:", "thumb|", "File:", "{|", "'''"):
        assert junk not in text, junk
    assert "References" not in paras and "External links" not in paras
    doc = corpus.paragraphs_to_document("enwiki:12", "Anarchism", paras)
    assert len(doc.sentences) > 100


def test_html_paragraphs():
    title, paras = corpus.html_to_paragraphs(
        "<html><head><title>Intro</title><script>var x = 1;</script></head><body>"
        "<p>First paragraph has <b>bold</b> text &amp; an entity in it.</p>"
        "<p>1.</p><pre>code block here that is long enough to count</pre>"
        "<p>Second one, with six or more words.</p></body></html>")
    assert title == "Intro"
    assert paras == ["First paragraph has bold text & an entity in it.",
                     "Second one, with six or more words."]


def test_eval_split_is_a_function_of_the_document():
    ids = [f"wiki-summaries:T{i}" for i in range(4000)]
    held = [i for i in ids if corpus.is_eval_document(i, 0.1)]
    assert 0.08 < len(held) / len(ids) < 0.12
    assert held == [i for i in ids if corpus.is_eval_document(i, 0.1)]
    # A lead section and the full article of the same title land on the same side.
    from loaders.corpus_source import _split_key
    a = corpus.Document("wiki-summaries:Autism", "Autism", ["x"])
    b = corpus.Document("enwiki:25", "Autism", ["y"])
    assert _split_key(a) == _split_key(b)


# ---------------------------------------------------------------------------------------

def _ref_is_whitespace(c):
    return c in " \t\n\r" or unicodedata.category(c) == "Zs"


def _ref_is_control(c):
    return c not in "\t\n\r" and unicodedata.category(c).startswith("C")


def _ref_is_punctuation(c):
    cp = ord(c)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(c).startswith("P")


def _ref_is_cjk(cp):
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def _ref_basic_tokenize(text):
    """Google BERT's BasicTokenizer(do_lower_case=True)."""
    text = "".join(" " if _ref_is_whitespace(c) else c for c in text
                   if not (ord(c) == 0 or ord(c) == 0xFFFD or _ref_is_control(c)))
    text = "".join(f" {c} " if _ref_is_cjk(ord(c)) else c for c in text)
    out = []
    for tok in text.strip().split():
        tok = tok.lower()
        tok = "".join(c for c in unicodedata.normalize("NFD", tok)
                      if unicodedata.category(c) != "Mn")
        cur = []
        for c in tok:
            if _ref_is_punctuation(c):
                if cur:
                    out.append("".join(cur))
                out.append(c)
                cur = []
            else:
                cur.append(c)
        if cur:
            out.append("".join(cur))
    return " ".join(out).split()


def _ref_wordpiece(word, vocab_map, max_chars=100):
    if len(word) > max_chars:
        return ["[UNK]"]
    pieces, start = [], 0
    while start < len(word):
        end, cur = len(word), None
        while start < end:
            sub = ("##" if start > 0 else "") + word[start:end]
            if sub in vocab_map:
                cur = sub
                break
            end -= 1
        if cur is None:
            return ["[UNK]"]
        pieces.append(cur)
        start = end
    return pieces


def test_tokenizer_matches_plain_python_reference(real_sentences, vocab):
    vmap = vocab.to_dict()
    extra = ["Café naïve façade – Ångström, résumé; Œuvre", "東京は日本の首都です。漢字",
             "ctrl\x00chars\u200b\x07 and\ttabs\nnewlines\u00a0nbsp", "x" * 101,
             "y" * 100, "C++ e-mail user@host.com (a)[b]{c} $5 ½ ™ ©", "İstanbul ǅ ﬁ",
             "", "   ", "don't \"quote\" — dash…"]
    sents = real_sentences + extra
    assert len(real_sentences) >= 300
    fast = tokenization.encode_sentences(tokenization.build_tokenizer(vocab), sents)
    for s, ids in zip(sents, fast):
        ref = [vmap[p] for w in _ref_basic_tokenize(s) for p in _ref_wordpiece(w, vmap)]
        assert ids.tolist() == ref, s
        assert ids.dtype == np.int16


def test_vocab_validation(tmp_path, vocab):
    assert len(vocab) == 30522 and vocab.tokens[103] == "[MASK]"
    good = tokenization.default_vocab_path().read_text().splitlines()

    no_mask = tmp_path / "no_mask.txt"
    no_mask.write_text("\n".join(t if t != "[MASK]" else "[MASKX]" for t in good) + "\n")
    with pytest.raises(DataError, match=r"no_mask.txt: \[MASK\] is missing"):
        tokenization.load_vocab(no_mask)

    spm = tmp_path / "sentencepiece.txt"   # specials in place, but "▁" pieces, no "##"
    spm.write_text("\n".join("▁" + t[2:] if t.startswith("##") else t for t in good) + "\n")
    with pytest.raises(DataError, match=r"sentencepiece.txt: .*'##'.*not a WordPiece vocab"):
        tokenization.load_vocab(spm)

    scored = tmp_path / "scored.txt"       # "token<TAB>score" lines
    scored.write_text("\n".join(f"{t}\t-1.0" for t in good) + "\n")
    with pytest.raises(DataError, match="scored.txt:1: .*not a single token"):
        tokenization.load_vocab(scored)

    big = tmp_path / "big.txt"
    big.write_text("\n".join(good + [f"extra{i}" for i in range(3000)]) + "\n")
    with pytest.raises(DataError, match="int16"):
        tokenization.load_vocab(big)


# ---------------------------------------------------------------------------------------

def test_masking_80_10_10_against_recorded_originals(real_sentences, vocab):
    tok = tokenization.build_tokenizer(vocab)
    segs = [a.tolist() for a in tokenization.encode_sentences(tok, real_sentences) if len(a)]
    params = pretraining.InstanceParams()
    rng = random.Random(7)
    n = {"mask": 0, "kept": 0, "random": 0}
    flat = [t for seg in segs for t in seg]
    for _ in range(4000):
        n_body = rng.randint(2, 125)
        lo = rng.randint(0, len(flat) - n_body)
        body, cut = flat[lo:lo + n_body], rng.randint(1, n_body - 1)
        tokens = [CLS, *body[:cut], SEP, *body[cut:], SEP]
        out, pos, labels = pretraining.create_masked_lm_predictions(tokens, params, rng)
        assert pos == sorted(set(pos)) and labels == [tokens[p] for p in pos]
        assert len(pos) == min(20, max(1, round(len(tokens) * 0.15)))
        assert all(tokens[p] not in (CLS, SEP) for p in pos)
        assert all(out[i] == t for i, t in enumerate(tokens) if i not in set(pos))
        for p in pos:
            n["mask" if out[p] == MASK else "kept" if out[p] == tokens[p] else "random"] += 1
    total = sum(n.values())
    assert total > 35000
    assert abs(n["mask"] / total - 0.8) < 0.01
    assert abs(n["kept"] / total - 0.1) < 0.01
    assert abs(n["random"] / total - 0.1) < 0.01


def test_truncate_seq_pair_trims_the_longer_side():
    rng = random.Random(0)
    a, b = list(range(100)), list(range(1000, 1010))
    pretraining.truncate_seq_pair(a, b, 50, rng)
    assert len(a) + len(b) == 50 and len(b) == 10
    assert a[0] > 0 and a[-1] < 99    # trimmed from both ends


def test_instances_follow_the_reference_semantics(real_sentences, vocab):
    tok = tokenization.build_tokenizer(vocab)
    segs = [a.tolist() for a in tokenization.encode_sentences(tok, real_sentences) if len(a)]
    docs = [segs[i:i + 9] for i in range(0, len(segs) - 9, 9)]
    params = pretraining.InstanceParams(max_seq_length=64, max_predictions_per_seq=10)
    rng = random.Random(3)
    made = [x for d in range(len(docs))
            for x in pretraining.create_instances_from_document(docs, d, params, rng)]
    assert len(made) > 100
    random_next = 0
    for ids, len_a, pos, labels, is_random, b_doc in made:
        assert len(ids) <= 64 and ids[0] == CLS and ids[len_a + 1] == SEP and ids[-1] == SEP
        assert len(ids) - len_a - 3 >= 1
        assert len(pos) == min(10, max(1, round(len(ids) * 0.15)))
        random_next += is_random
    assert 0.4 < random_next / len(made) < 0.8


# ---------------------------------------------------------------------------------------


def test_debian_deb_reader_on_a_small_package(tmp_path):
    import io
    import tarfile

    # A minimal .deb (ar archive with data.tar.gz) to exercise the reader without apt.
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:gz") as tar:
        page = (b"<html><head><title>Guide</title></head><body><p>The kernel schedules "
                b"tasks on every available processor core.</p></body></html>")
        info = tarfile.TarInfo("./usr/share/doc/x/guide.html")
        info.size = len(page)
        tar.addfile(info, io.BytesIO(page))
    blob = data.getvalue()

    def member(name, payload):
        h = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(payload):<10}`\n".encode()
        return h + payload + (b"\n" if len(payload) % 2 else b"")

    deb = tmp_path / "linux-doc-6.1_1.0_all.deb"
    deb.write_bytes(b"!<arch>\n" + member("debian-binary", b"2.0\n") + member("data.tar.gz", blob))
    items = corpus.read_debian_html(deb)
    assert [i[0] for i in items] == ["debian:linux-doc-6.1:usr/share/doc/x/guide.html"]
    title, paras = corpus.html_to_paragraphs(items[0][2])
    assert title == "Guide" and paras[0].startswith("The kernel schedules")
