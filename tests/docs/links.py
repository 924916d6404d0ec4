#!/usr/bin/env python3
"""Checks every relative link in every Markdown file of the repository.

A link is relative when it has no scheme (`http:`, `mailto:`, ...). Each
must name a file or folder that exists inside the repository (never a path
outside it), and its `#anchor`, if any, must be a heading (or an explicit
`id`/`name` anchor) of the target Markdown file, slugged as GitHub does:
the heading's text, lower-cased, with everything but letters, marks,
numbers, `_`, `-` and spaces removed, spaces turned into `-`, and `-1`,
`-2`, ... added to repeated slugs. Links inside code (fenced blocks and
inline spans) are not links and are skipped.

Usage: python3 tests/docs/links.py [ROOT]   (default: the repository root)
Exit status 1, with one line per broken link, when any link is broken.
Standard library only.
"""

import os
import re
import subprocess
import sys
import unicodedata
import urllib.parse

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
INLINE = re.compile(r"\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFDEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_ANCHOR = re.compile(r"<a\s[^>]*?(?:name|id)\s*=\s*\"([^\"]+)\"", re.IGNORECASE)
HTML_TAG = re.compile(r"<[^>]+>")
LINK_TEXT = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
LINE_ANCHOR = re.compile(r"^L\d+(-L\d+)?$")


def markdown_files(root):
    """Tracked and untracked-but-not-ignored Markdown files (git), else a walk."""
    try:
        out = subprocess.run(
            ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "*.md"],
            check=True,
            capture_output=True,
        ).stdout.decode()
        files = sorted({f for f in out.split("\0") if f and os.path.isfile(os.path.join(root, f))})
        if files:
            return files
    except (OSError, subprocess.CalledProcessError):
        pass
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in (".git", "target", "node_modules")]
        files += [os.path.relpath(os.path.join(d, n), root) for n in names if n.endswith(".md")]
    return sorted(files)


def prose_lines(text):
    """(line number, line) of every line outside fenced code blocks."""
    fence = None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None:
            if m:
                fence = m.group(1)
                continue
            yield n, line
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip()[len(m.group(1)):].strip():
            fence = None


def slug(heading):
    """GitHub's anchor for a heading's Markdown text."""
    text = re.sub(r"[ \t]+#+$", "", heading)  # closing hashes
    parts = []
    for i, piece in enumerate(CODE_SPAN.split(text)):
        # split() yields text, fence, code, text, fence, code, ...: code is kept
        # as written, markup is dropped from the rest.
        if i % 3 == 2:
            parts.append(piece.strip())
        elif i % 3 == 0:
            parts.append(HTML_TAG.sub("", LINK_TEXT.sub(lambda m: m.group(1), piece)))
    text = "".join(parts)
    out = []
    for ch in text.lower():
        cat = unicodedata.category(ch)
        if ch in " -" or cat[0] in "LMN" or cat == "Pc":
            out.append("-" if ch == " " else ch)
    return "".join(out)


def anchors(path, cache):
    """Every anchor a Markdown file defines."""
    if path not in cache:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        seen, found = {}, set()
        for _, line in prose_lines(text):
            m = ATX.match(line)
            if m:
                s = slug(m.group(2))
                n = seen.get(s, 0)
                seen[s] = n + 1
                found.add(s if n == 0 else "%s-%d" % (s, n))
            found.update(HTML_ANCHOR.findall(line))
        cache[path] = found
    return cache[path]


def links(text):
    """(line number, target) of every link outside code."""
    for n, line in prose_lines(text):
        bare = CODE_SPAN.sub("``", line)
        m = REFDEF.match(bare)
        if m:
            yield n, m.group(1)
        for m in INLINE.finditer(bare):
            yield n, m.group(1)


def check(root):
    root = os.path.realpath(root)
    cache, broken, count = {}, [], 0
    files = markdown_files(root)
    for rel in files:
        src = os.path.join(root, rel)
        with open(src, encoding="utf-8") as f:
            text = f.read()
        for n, target in links(text):
            target = target.strip("<>")
            if not target or SCHEME.match(target):
                continue
            count += 1
            path, _, anchor = target.partition("#")
            path, anchor = urllib.parse.unquote(path), urllib.parse.unquote(anchor)
            if path:
                base = root if path.startswith("/") else os.path.dirname(src)
                dest = os.path.realpath(os.path.join(base, path.lstrip("/")))
            else:
                dest = src
            where = "%s:%d: %s" % (rel, n, target)
            if dest != root and not dest.startswith(root + os.sep):
                broken.append("%s: points outside the repository" % where)
                continue
            if not os.path.exists(dest):
                broken.append("%s: %s does not exist" % (where, os.path.relpath(dest, root)))
                continue
            if not anchor:
                continue
            if dest.endswith(".md") and os.path.isfile(dest):
                if anchor not in anchors(dest, cache):
                    broken.append("%s: no heading #%s in %s" % (where, anchor, os.path.relpath(dest, root)))
            elif not (os.path.isfile(dest) and LINE_ANCHOR.match(anchor)):
                broken.append("%s: #%s is not an anchor of %s" % (where, anchor, os.path.relpath(dest, root)))
    return files, count, broken


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    files, count, broken = check(root)
    for b in broken:
        print(b)
    if broken:
        print("links: %d broken of %d relative links in %d Markdown files" % (len(broken), count, len(files)))
        return 1
    print("links: all %d relative links in %d Markdown files resolve" % (count, len(files)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
