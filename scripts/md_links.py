#!/usr/bin/env python3
"""Checks every relative link of the repository's Markdown files: the file or folder it names
exists, and an `#anchor` is a heading of the Markdown file it points into (anchors made the way
GitHub makes them). Links inside code spans and fenced code blocks are not links. Absolute URLs
are not fetched.

    python3 scripts/md_links.py [ROOT]

Prints one line per broken link and `links: N checked, N broken`; exits 1 when one is broken
or when no link was checked.
"""
import os
import re
import subprocess
import sys

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")


def blank_fences(text):
    """The text with fenced code blocks blanked out, lines kept."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def anchors(path, cache={}):
    if path not in cache:
        seen, found = {}, set()
        with open(path, encoding="utf-8") as f:
            text = blank_fences(f.read())
        for line in text.splitlines():
            m = HEADING.match(line)
            if not m:
                continue
            title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(2))
            slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
        found.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
        cache[path] = found
    return cache[path]


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    os.chdir(root)
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    checked = broken = 0
    for md in sorted(f for f in listed if os.path.isfile(f)):
        with open(md, encoding="utf-8") as f:
            text = blank_fences(f.read())
        for number, line in enumerate(text.splitlines(), 1):
            for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
                target = m.group(1)
                if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target):
                    continue  # https:, mailto:, ...
                checked += 1
                path, _, fragment = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(md), path)) if path else md
                problem = None
                if not os.path.exists(dest):
                    problem = f"{target}: no such file"
                elif fragment:
                    if os.path.isdir(dest):
                        dest = os.path.join(dest, "README.md")
                    if dest.endswith(".md") and fragment not in anchors(dest):
                        problem = f"{target}: no heading #{fragment} in {dest}"
                if problem:
                    broken += 1
                    print(f"{md}:{number}: {problem}")
    print(f"links: {checked} checked, {broken} broken")
    return 1 if broken or not checked else 0


if __name__ == "__main__":
    sys.exit(main())
