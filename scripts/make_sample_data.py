"""Rebuild data/sample/: a few MB of real, freely licensed English text in the formats real corpora come in.

Run by hand only (it downloads three Debian packages with `apt-get download`; nothing is installed); CI uses the
committed files. Build-time tool: the PyPI package `rdata` (reads the R data of janeaustenr), not a runtime
dependency of flame.

    pip install rdata && python scripts/make_sample_data.py

Sources (see data/sample/README.md for the licenses):
- r-cran-janeaustenr: Jane Austen's six novels (public domain text; package MIT). One document per chapter.
- fortunes-min, fortunes: the BSD fortune-mod cookie files (a selection of topics). One document per fortune.
- jargon-text: the Jargon File 4.4.7 (public domain). One document per glossary entry.

Layout:
- pile/pile-0{0,1}.jsonl.zst: Pile-style lines {"text", "meta": {"pile_set_name"}}: five novels + fortunes.
- webtext/webtext-0{0,1}.parquet: OpenWebText-style rows with a `text` column: the Jargon File's entries.
- eval/eval-00.jsonl: held out: Persuasion (the sixth novel) and every 20th Jargon File entry.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

OUT = Path(__file__).resolve().parents[1] / "data" / "sample"
PACKAGES = ["r-cran-janeaustenr", "fortunes-min", "fortunes", "jargon-text"]
EVAL_NOVEL = "persuasion"
FORTUNE_TOPICS = ["art", "computers", "education", "food", "goedel", "humorists", "kids", "law", "linux",
                  "literature", "magic", "miscellaneous", "paradoxum", "people", "pets", "platitudes", "riddles",
                  "science", "sports", "startrek", "tao", "wisdom", "work", "zippy"]
CHAPTER_HEADING = re.compile(r"^(CHAPTER|Chapter) [0-9IVXLC]+\.?$")


def unpack_debian_packages(workdir: Path) -> Path:
    subprocess.run(["apt-get", "download", *PACKAGES], cwd=workdir, check=True)
    root = workdir / "root"
    for deb in sorted(workdir.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


def austen_novels(root: Path) -> dict[str, list[str]]:
    """janeaustenr keeps each novel as an R character vector (one line per element) in a lazy-load database:
    Rdata.rdx (gzip'd index: name -> offset, length) and Rdata.rdb (4-byte length + zlib'd serialized object)."""
    import rdata

    folder = root / "usr/lib/R/site-library/janeaustenr/data"
    index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress((folder / "Rdata.rdx").read_bytes())))
    db = (folder / "Rdata.rdb").read_bytes()
    novels = {}
    for name, (offset, length) in index["variables"].items():
        blob = db[int(offset): int(offset) + int(length)]
        assert struct.unpack(">i", blob[:4])[0] > 0
        lines = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(blob[4:])))
        novels[str(name)] = [str(line) for line in lines]
    return novels


def paragraphs(lines: list[str]) -> str:
    """Hard-wrapped lines -> paragraphs separated by blank lines."""
    out, current = [], []
    for line in lines:
        if line.strip():
            current.append(line.strip())
        elif current:
            out.append(" ".join(current))
            current = []
    if current:
        out.append(" ".join(current))
    return "\n\n".join(out)


def chapters(lines: list[str]) -> list[str]:
    starts = [i for i, line in enumerate(lines) if CHAPTER_HEADING.match(line.strip())]
    assert starts, "no chapter headings found"
    ends = starts[1:] + [len(lines)]
    return [paragraphs(lines[a:b]) for a, b in zip(starts, ends)]


def fortunes(root: Path) -> list[str]:
    out = []
    for topic in FORTUNE_TOPICS:
        text = (root / "usr/share/games/fortunes" / topic).read_text(encoding="utf-8", errors="strict")
        out += [f.strip("\n") for f in text.split("\n%\n") if f.strip()]
    return out


def jargon_entries(root: Path) -> list[str]:
    text = gzip.decompress((root / "usr/share/doc/jargon-text/jargon.txt.gz").read_bytes()).decode("utf-8")
    glossary = text[text.index("\nGlossary\n"): text.index("\nAppendix\u00a0A.\u00a0Hacker Folklore\n")]
    entries = re.split(r"\n(?=   :[^\n]+:)", glossary)[1:]  # an entry starts with "   :term: ..."
    return [re.sub(r"(?m)^   ", "", e).strip() for e in entries]


def write_jsonl_zst(path: Path, rows: list[dict]) -> None:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    path.write_bytes(zstandard.ZstdCompressor(level=19).compress(data))


def main() -> None:
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = unpack_debian_packages(Path(tmp))
        novels = austen_novels(root)
        cookies = fortunes(root)
        jargon = jargon_entries(root)

    austen_set, fortune_set, jargon_set = "Jane Austen (janeaustenr)", "Fortunes (fortune-mod)", "Jargon File"
    pile = [{"text": c, "meta": {"pile_set_name": austen_set}}
            for name, lines in sorted(novels.items()) if name != EVAL_NOVEL for c in chapters(lines)]
    pile += [{"text": c, "meta": {"pile_set_name": fortune_set}} for c in cookies]
    rng.shuffle(pile)
    eval_rows = [{"text": c, "meta": {"pile_set_name": austen_set}} for c in chapters(novels[EVAL_NOVEL])]
    eval_rows += [{"text": e, "meta": {"pile_set_name": jargon_set}} for e in jargon[::20]]
    webtext = [e for i, e in enumerate(jargon) if i % 20]
    rng.shuffle(webtext)

    for sub in ("pile", "webtext", "eval"):
        (OUT / sub).mkdir(parents=True, exist_ok=True)
    for shard in range(2):
        write_jsonl_zst(OUT / "pile" / f"pile-{shard:02d}.jsonl.zst", pile[shard::2])
        pq.write_table(pa.table({"text": webtext[shard::2]}), OUT / "webtext" / f"webtext-{shard:02d}.parquet",
                       compression="zstd", row_group_size=256)
    with open(OUT / "eval" / "eval-00.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in eval_rows)
    print(f"pile: {len(pile)} documents, webtext: {len(webtext)}, eval: {len(eval_rows)} -> {OUT}")


if __name__ == "__main__":
    main()
