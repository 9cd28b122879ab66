"""Turn the Python 3.11 documentation sources (reStructuredText) into a plain-prose corpus.

The corpus is the training text of the bundled demo checkpoint. Its source is the Debian package
``python3.11-doc`` (Python Software Foundation License), which ships the reST sources of the docs as
``usr/share/doc/python3.11/html/_sources/**/*.rst.txt``. Get and unpack it (no root needed)::

    apt-get download python3.11-doc && dpkg -x python3.11-doc_*.deb x
    python demo/build_corpus.py x --out demo/data

Output, in ``--out``:
    train.txt  the training documents, one per source file, separated by a line ``<|endoftext|>``
    val.txt    the held-out documents (every 50th source file, sorted by path), same format

What the cleaner keeps and drops, so that the model learns English prose rather than markup or code:
    dropped  labels (``.. _foo:``), comments, substitution definitions, heading over/underlines,
             tables, directives that are not prose (index, toctree, code-block, module, only, ...),
             literal blocks (the indented block after a paragraph ending in ``::``), ``>>>`` sessions,
             the signature lines of object directives (``.. function:: len(s)``)
    kept     paragraphs, headings, list items, definition lists, block quotes, and the prose bodies of
             admonitions (note, warning, seealso, ...), version notes (versionadded, versionchanged,
             deprecated) and object descriptions (the text under ``.. function::``)
    inline   roles become their visible text (``:func:`len``` -> ``len()``, ``:class:`~foo.Bar``` ->
             ``Bar``, ``:ref:`text <label>``` -> ``text``), inline literals, emphasis and strong lose
             their markers, hyperlinks ``\\`text <url>\\`_`` become ``text``
Each paragraph is unwrapped into one line; paragraphs are separated by a blank line.

Reference: the reStructuredText specification, https://docutils.sourceforge.io/docs/ref/rst/restructuredtext.html
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

EOT = "<|endoftext|>"
SOURCES_SUBDIR = "usr/share/doc/python3.11/html/_sources"
VAL_EVERY = 50  # every 50th document (sorted by path) is held out for validation

# Directives whose body is prose that a reader sees. The value says what to do with the arguments:
#   "prose"     the arguments and the body are text (note, seealso, ...)
#   "signature" the argument line(s) are an API signature: drop them, keep the description below
#   a string with "{}" a version note: "{}" is filled with the arguments (e.g. "Changed in version 3.2")
PROSE_DIRECTIVES: dict[str, str] = {
    **{
        name: "prose"
        for name in (
            "note",
            "warning",
            "seealso",
            "impl-detail",
            "important",
            "caution",
            "attention",
            "danger",
            "error",
            "hint",
            "tip",
            "admonition",
            "topic",
            "sidebar",
            "epigraph",
            "glossary",
            "rubric",
        )
    },
    **{
        name: "signature"
        for name in (
            "function",
            "method",
            "class",
            "attribute",
            "data",
            "exception",
            "decorator",
            "decoratormethod",
            "classmethod",
            "staticmethod",
            "abstractmethod",
            "coroutinefunction",
            "coroutinemethod",
            "awaitablefunction",
            "awaitablemethod",
            "object",
            "describe",
            "cmdoption",
            "option",
            "envvar",
            "opcode",
            "pdbcommand",
            "c:function",
            "c:member",
            "c:type",
            "c:var",
            "c:macro",
            "c:struct",
        )
    },
    "versionadded": "New in version {}.",
    "versionchanged": "Changed in version {}:",
    "deprecated": "Deprecated since version {}:",
    "deprecated-removed": "Deprecated since version {0}, will be removed in version {1}:",
    "availability": "Availability: {}.",
}
# Every other directive (index, toctree, only, code-block, doctest, module, productionlist, tables,
# images, include, ...) is dropped together with its indented block.

LABEL_RE = re.compile(r"^\.\.\s+_[^:]*:")  # .. _foo:   and   .. _foo: https://...
DIRECTIVE_RE = re.compile(r"^\.\.\s+([\w:-]+)::\s*(.*)$")  # .. name:: arguments
FOOTNOTE_RE = re.compile(r"^\.\.\s+\[[^\]]+\]\s*(.*)$")  # .. [#] text   /   .. [1] text
OPTION_RE = re.compile(r"^:[\w-]+:(\s|$)")  # :maxdepth: 2   (a directive option)
ADORNMENT_RE = re.compile(r"^([=\-~*^\"'`#+:._<>])\1{2,}\s*$")  # ====  ----  ****  heading lines
SIMPLE_TABLE_RE = re.compile(r"^=+( +=+)+\s*$")  # ===== =====   (simple table border)
GRID_TABLE_RE = re.compile(r"^\+[-=+]+\+?\s*$")  # +-----+-----+ (grid table border)
BULLET_RE = re.compile(r"^([-*+•]|#\.|\d+\.|[a-zA-Z]\.|\(?\d+\)|\(?[a-z]\))\s+")

# Inline markup.
ROLE_RE = re.compile(r"(?::[\w-]+)?:([\w-]+):`((?:[^`\\]|\\.)+?)`")
LITERAL_RE = re.compile(r"``(.+?)``")
LINK_RE = re.compile(r"`([^`<]*?)\s*<[^`>]*>`__?")  # `text <url>`_   `text <url>`__
REF_RE = re.compile(r"`([^`]+)`(?:__?)?")  # `text`_   or the default role `text`
STRONG_RE = re.compile(r"\*\*(\S(?:.*?\S)?)\*\*")
EMPHASIS_RE = re.compile(r"(?<![\w*\\])\*(\S(?:[^*]*?\S)?)\*(?![\w*])")
FOOTNOTE_REF_RE = re.compile(r"\s*\[(?:#\w*|\d+|\*)\]_")
SUBSTITUTION_RE = re.compile(r"\|([\w-]+)\|")
SUBSTITUTIONS = {"version": "3.11", "release": "3.11"}
LABEL_NAME_RE = re.compile(r"^\.\.\s+_([^:`]+):\s*$")  # a label without a URL: a cross-reference target

# What :ref:`label` and :doc:`page` show when they carry no explicit title: the title of the section
# or page they point at. Filled by collect_titles() before any file is converted.
REF_TITLES: dict[str, str] = {}
DOC_TITLES: dict[str, str] = {}
PLACEHOLDER_RE = re.compile("\x00(\\d+)\x00")


def indent_of(line: str) -> int:
    """Number of leading spaces of ``line`` (tabs count as 8, as docutils expands them)."""
    expanded = line.expandtabs(8)
    return len(expanded) - len(expanded.lstrip(" "))


def dedent(lines: list[str]) -> list[str]:
    """Remove the common leading indentation of the non-blank ``lines``; blank lines become ''."""
    lines = [line.expandtabs(8).rstrip() for line in lines]
    depth = min((indent_of(line) for line in lines if line), default=0)
    return [line[depth:] for line in lines]


def role_text(role: str, content: str) -> str:
    """The visible text of an interpreted-text role: ``role_text("func", "~os.path.join")`` -> ``join()``.

    Follows Sphinx's display rules: an explicit title ``text <target>`` wins; ``~`` keeps only the last
    dotted component; ``!`` is dropped; function and method roles get ``()`` appended (Sphinx's default
    ``add_function_parentheses``); :pep: and :rfc: become "PEP 8" / "RFC 2822"; :samp: loses ``{}``.
    """
    content = content.replace("\\", "")
    titled = re.match(r"^(.*?)\s*<([^<>]+)>$", content, flags=re.S)
    if titled and titled.group(1):
        return titled.group(1)
    if role == "ref":
        return REF_TITLES.get(content.lower(), content.replace("-", " ").replace("_", " "))
    if role == "doc":
        name = content.rstrip("/").split("/")[-1]
        return DOC_TITLES.get(name, name)
    if role in ("pep", "rfc"):
        return f"{role.upper()} {content.split('#')[0]}"
    if role == "samp":
        return content.replace("{", "").replace("}", "")
    if role == "menuselection":
        return content.replace("-->", ">")
    content = content.lstrip("!")
    if content.startswith("~"):
        content = content[1:].split(".")[-1]
    if role in ("func", "meth") and not content.endswith(")"):
        content += "()"
    return content


def clean_inline(text: str) -> str:
    """Rewrite reST inline markup in one paragraph to the text a reader of the HTML docs sees.

    Roles and ``literals`` are replaced first by numbered placeholders so that the emphasis rules below
    cannot match the stars inside them (``*args``, ``**kwargs``), then restored.
    """
    protected: list[str] = []

    def protect(value: str) -> str:
        protected.append(value)
        return f"\x00{len(protected) - 1}\x00"

    text = ROLE_RE.sub(lambda m: protect(role_text(m.group(1), m.group(2))), text)
    text = LITERAL_RE.sub(lambda m: protect(m.group(1)), text)
    text = LINK_RE.sub(lambda m: m.group(1), text)
    text = REF_RE.sub(lambda m: m.group(1), text)
    text = STRONG_RE.sub(lambda m: m.group(1), text)
    text = EMPHASIS_RE.sub(lambda m: m.group(1), text)
    text = FOOTNOTE_REF_RE.sub("", text)
    text = SUBSTITUTION_RE.sub(lambda m: SUBSTITUTIONS.get(m.group(1), m.group(1)), text)
    text = text.replace("\\ ", "")
    text = re.sub(r"\\(.)", r"\1", text)
    text = PLACEHOLDER_RE.sub(lambda m: protected[int(m.group(1))], text)
    return " ".join(text.split())


def block_end(lines: list[str], start: int) -> int:
    """Index one past the indented block that begins at ``lines[start]``.

    The block runs over blank lines and indented lines; it ends before the first non-blank line that
    starts at column 0. Trailing blank lines are not part of it.
    """
    end = start
    while end < len(lines) and (not lines[end].strip() or indent_of(lines[end]) > 0):
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    return end


def convert(lines: list[str]) -> list[str]:
    """Convert a block of reST lines (already dedented) into a list of prose paragraphs.

    Args:
        lines: source lines without newlines; the block's own indentation is column 0.
    Returns:
        paragraphs, each one line of plain text with inline markup resolved.
    Nested blocks (directive bodies, list items, block quotes) are converted recursively.
    """
    out: list[str] = []
    paragraph: list[str] = []
    literal_next = False  # the previous paragraph ended in "::": the next indented block is code

    def flush() -> None:
        nonlocal literal_next
        if not paragraph:
            return
        text = " ".join(line.strip() for line in paragraph)
        paragraph.clear()
        if text.endswith("::"):
            literal_next = True
            text = text[:-2].rstrip() if (text == "::" or text[-3].isspace()) else text[:-1]
        text = clean_inline(text)
        if re.search(r"[A-Za-z]{2}", text):  # skip what has no word left, e.g. a table note "(1)"
            out.append(text)

    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if not stripped:  # a blank line ends a paragraph
            flush()
            i += 1
            continue

        if indent_of(line) > 0:  # an indented block: literal code, definition, or block quote
            end = block_end(lines, i)
            flush()  # a paragraph directly above is a definition-list term: keep it as its own line
            if literal_next:
                literal_next = False
            else:
                out.extend(convert(dedent(lines[i:end])))
            i = end
            continue

        literal_next = False
        if stripped.startswith(".. ") or stripped == "..":  # explicit markup: directive, label, comment
            flush()
            end = block_end(lines, i + 1)
            out.extend(convert_explicit(lines[i], lines[i + 1 : end]))
            i = end
            continue
        if stripped.startswith(">>>"):  # a doctest session runs to the next blank line
            flush()
            while i < len(lines) and lines[i].strip():
                i += 1
            continue
        if SIMPLE_TABLE_RE.match(stripped):  # a simple table ends at a border line before a blank
            flush()
            i += 1
            while i < len(lines):
                closing = SIMPLE_TABLE_RE.match(lines[i].strip())
                i += 1
                if closing and (i >= len(lines) or not lines[i].strip()):
                    break
            continue
        if GRID_TABLE_RE.match(stripped):  # a grid table runs to the next blank line
            flush()
            while i < len(lines) and lines[i].strip():
                i += 1
            continue
        if ADORNMENT_RE.match(stripped):  # heading over/underline: end the title paragraph
            flush()
            i += 1
            continue
        bullet = BULLET_RE.match(line)
        if bullet and (not paragraph or bullet.group(1) in "-*+•"):  # a list item and its continuation
            flush()
            end = block_end(lines, i + 1)
            item = [" " * bullet.end() + line[bullet.end() :]] + lines[i + 1 : end]
            out.extend(convert(dedent(item)))
            i = end
            continue
        if line.startswith("| "):  # line block
            line = line[2:]
        paragraph.append(line)
        i += 1
    flush()
    return out


def convert_explicit(first: str, body: list[str]) -> list[str]:
    """Convert one explicit-markup construct (``.. `` line plus its indented block) into paragraphs.

    Labels, comments and substitution definitions give nothing; directives follow ``PROSE_DIRECTIVES``;
    footnotes keep their text.
    """
    first = first.strip()
    if LABEL_RE.match(first) or first.startswith(".. |"):
        return []
    footnote = FOOTNOTE_RE.match(first)
    if footnote:
        return convert([footnote.group(1)] + dedent(body))
    directive = DIRECTIVE_RE.match(first)
    if not directive:  # a comment
        return []
    name, arguments = directive.group(1).lower(), directive.group(2).strip()
    kind = PROSE_DIRECTIVES.get(name)
    if kind is None:
        return []
    body = dedent(body)
    if kind == "signature":  # drop continuation signature lines and options up to the first blank
        while body and body[0].strip():
            body = body[1:]
        return convert(body)
    while body and OPTION_RE.match(body[0]):  # options such as :class: or :noindex:
        body = body[1:]
    if kind == "prose":
        return convert(([arguments] if arguments else []) + body)
    # a version note: the first argument(s) are versions, the rest (and the body) the explanation
    n_versions = kind.count("{")
    words = arguments.split()
    prefix = kind.format(*(words[:n_versions] + ["?"] * n_versions))
    explanation = " ".join(words[n_versions:])
    paragraphs = convert(([explanation] if explanation else []) + body)
    if kind.endswith("."):  # "New in version 3.2." stands alone
        return [prefix] + paragraphs
    if paragraphs:
        return [f"{prefix} {paragraphs[0]}"] + paragraphs[1:]
    return [prefix.rstrip(":") + "."]


def heading_after(lines: list[str], start: int) -> str | None:
    """The section title that starts at the first non-blank, non-label line at or after ``start``.

    A title is a text line with an adornment line under it (and optionally one above it). Returns None
    when the next construct is not a section title (labels also mark figures, tables, paragraphs).
    """
    j = start
    while j < len(lines) and (not lines[j].strip() or LABEL_NAME_RE.match(lines[j])):
        j += 1
    if j + 1 < len(lines) and ADORNMENT_RE.match(lines[j].strip()) and lines[j + 1].strip():
        j += 1  # an overline: the title is the next line
    if j + 1 < len(lines) and lines[j].strip() and ADORNMENT_RE.match(lines[j + 1].strip()):
        return clean_inline(lines[j])
    return None


def collect_titles(paths: list[Path]) -> None:
    """Fill ``REF_TITLES`` (label -> section title) and ``DOC_TITLES`` (page name -> first title).

    Sphinx resolves a title-less :ref:`label` to the title of the section after ``.. _label:``, and a
    title-less :doc:`page` to the page's first title; this pre-pass over all sources does the same.
    """
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines()
        first = heading_after([line for line in lines if not line.startswith(".. ")], 0)
        name = path.name.removesuffix(".rst.txt")
        if first and name not in DOC_TITLES:
            DOC_TITLES[name] = first
        for i, line in enumerate(lines):
            label = LABEL_NAME_RE.match(line)
            if label:
                title = heading_after(lines, i + 1)
                if title:
                    REF_TITLES[label.group(1).strip().lower()] = title


def convert_file(path: Path) -> str:
    """One reST source file as plain prose: its paragraphs separated by blank lines."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return "\n\n".join(convert(dedent(lines)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "folder", type=Path, help="the unpacked python3.11-doc package (dpkg -x python3.11-doc_*.deb FOLDER)"
    )
    parser.add_argument("--out", type=Path, default=Path("demo/data"), help="output folder")
    args = parser.parse_args()

    sources = args.folder / SOURCES_SUBDIR
    if not sources.is_dir():
        sources = args.folder  # also accept the _sources folder itself
    paths = sorted(sources.rglob("*.rst.txt"), key=lambda p: p.relative_to(sources).as_posix())
    if not paths:
        raise SystemExit(f"no *.rst.txt files under {sources}")

    collect_titles(paths)
    train: list[str] = []
    val: list[str] = []
    for index, path in enumerate(paths):
        text = convert_file(path)
        if len(text) < 200:  # index pages that hold only a toctree
            continue
        (val if index % VAL_EVERY == VAL_EVERY - 1 else train).append(text)

    args.out.mkdir(parents=True, exist_ok=True)
    for name, documents in (("train.txt", train), ("val.txt", val)):
        (args.out / name).write_text(f"\n{EOT}\n".join(documents) + "\n", encoding="utf-8")
        n_chars = sum(len(d) for d in documents)
        print(f"{name}: {len(documents)} documents, {n_chars / 1e6:.2f} M characters")


if __name__ == "__main__":
    main()
