"""Corpus for the shipped demo model: Jane Austen's six novels, from a Debian package.

Source: Debian package ``r-cran-janeaustenr`` version ``1.0.0-1`` (architecture ``all``),
the Debian build of the CRAN package *janeaustenr* 1.0.0 by Julia Silge. The package is
licensed MIT (``/usr/share/doc/r-cran-janeaustenr/copyright``); the novels themselves are
public domain (first published 1811-1818; the texts come from Project Gutenberg with the
Gutenberg header and licence already removed by the package author).

The package stores the books as R objects in a lazy-load database
(``data/Rdata.rdx`` + ``data/Rdata.rdb``). This module needs no R: it fetches the .deb with
``apt-get download`` into a cache folder, checks its SHA-256, unpacks it with the standard
library (``ar`` + ``tar``), and reads the R serialisation format (XDR, version 2/3) itself.

Run directly to print corpus statistics::

    python scripts/demo_corpus.py [--cache DIR]
"""

from __future__ import annotations

import argparse
import gzip
import io
import re
import struct
import subprocess
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

DEB_PACKAGE = "r-cran-janeaustenr"
DEB_VERSION = "1.0.0-1"
DEB_FILE = f"{DEB_PACKAGE}_{DEB_VERSION}_all.deb"
DEB_SHA256 = "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"
DATA_DIR = "./usr/lib/R/site-library/janeaustenr/data/"

# R object names in the package, in publication order.
BOOKS = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
# The book that is never trained on (tokenizer included) and is used for perplexity.
HELDOUT_BOOK = "persuasion"

DEFAULT_CACHE = Path.home() / ".cache" / "moeserve-demo"  # --cache DIR elsewhere (no MOESERVE_* variable: moeserve refuses unknown ones)


# ----------------------------------------------------------------------------- fetching


def fetch_deb(cache: Path) -> Path:
    """Download the pinned .deb into ``cache`` (once) and verify its checksum."""
    import hashlib

    cache.mkdir(parents=True, exist_ok=True)
    deb = cache / DEB_FILE
    if not deb.exists():
        cmd = ["apt-get", "download", f"{DEB_PACKAGE}={DEB_VERSION}"]
        try:
            subprocess.run(cmd, cwd=cache, check=True)
        except subprocess.CalledProcessError:
            # Package lists may be missing on a fresh machine.
            subprocess.run(["apt-get", "update"], check=True)
            subprocess.run(cmd, cwd=cache, check=True)
    digest = hashlib.sha256(deb.read_bytes()).hexdigest()
    if digest != DEB_SHA256:
        raise RuntimeError(f"{deb}: sha256 {digest} != pinned {DEB_SHA256}")
    return deb


def _ar_members(blob: bytes) -> dict[str, bytes]:
    if not blob.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive")
    pos, out = 8, {}
    while pos + 60 <= len(blob):
        header = blob[pos : pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        out[name] = blob[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)
    return out


def read_deb_data(deb: Path) -> dict[str, bytes]:
    """Return {file name: bytes} of the package's R data folder."""
    members = _ar_members(deb.read_bytes())
    name = next(n for n in members if n.startswith("data.tar"))
    out = {}
    with tarfile.open(fileobj=io.BytesIO(members[name]), mode="r:*") as tar:
        for info in tar.getmembers():
            if info.isfile() and info.name.startswith(DATA_DIR):
                f = tar.extractfile(info)
                assert f is not None
                out[info.name[len(DATA_DIR) :]] = f.read()
    return out


# ----------------------------------------------------------------------------- R serialisation


@dataclass
class RObj:
    """A deserialised R value: ``value`` is a Python list / str / number, ``attrs`` a dict."""

    type: int
    value: object
    attrs: dict


class _RReader:
    """Minimal reader of R's XDR serialisation (enough for vectors, lists, attributes)."""

    NILVALUE, REFSXP, GLOBALENV, EMPTYENV, BASEENV = 254, 255, 253, 242, 241
    UNBOUND, MISSINGARG, BASENAMESPACE = 252, 251, 250

    def __init__(self, data: bytes) -> None:
        self.buf, self.pos, self.refs = data, 0, []
        if data[:2] != b"X\n":
            raise ValueError("only XDR-format R serialisation is supported")
        self.pos = 2
        version = self.int()
        self.int()  # writer's R version
        self.int()  # minimal reader version
        if version == 3:
            n = self.int()
            self.pos += n  # skip the native encoding name

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return v

    def length(self) -> int:
        n = self.int()
        if n == -1:
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def item(self):  # noqa: C901 - a flat dispatch reads best here
        flags = self.int()
        typ = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if typ == self.NILVALUE:
            return None
        if typ in (self.GLOBALENV, self.EMPTYENV, self.BASEENV, self.UNBOUND, self.MISSINGARG):
            return RObj(typ, None, {})
        if typ == self.BASENAMESPACE:
            return RObj(typ, None, {})
        if typ == self.REFSXP:
            idx = flags >> 8
            if idx == 0:
                idx = self.int()
            return self.refs[idx - 1]
        if typ == 1:  # SYMSXP
            name = self.item()
            self.refs.append(name)
            return name
        if typ in (2, 3, 5, 6, 17):  # pairlist-like: attr, tag, car, cdr
            items: list = []
            node_attrs: dict = {}
            while True:
                if has_attr:
                    node_attrs = self._attrs_from(self.item())
                tag = self.item() if has_tag else None
                car = self.item()
                items.append((tag, car))
                nxt = self.int()
                ntyp = nxt & 0xFF
                if ntyp != typ:
                    self.pos -= 4
                    cdr = self.item()
                    if cdr is not None:
                        items.append((None, cdr))
                    break
                has_attr, has_tag = bool(nxt & (1 << 9)), bool(nxt & (1 << 10))
            return RObj(typ, items, node_attrs)
        if typ == 4:  # ENVSXP
            env = RObj(typ, None, {})
            self.refs.append(env)
            self.int()  # locked
            self.item()  # enclosure
            env.value = self.item()  # frame
            self.item()  # hash table
            self.item()  # attributes
            return env
        if typ == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return None
            s = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace")
            self.pos += n
            return s
        if typ in (10, 13):  # LGLSXP, INTSXP
            n = self.length()
            vals = list(struct.unpack_from(f">{n}i", self.buf, self.pos))
            self.pos += 4 * n
            value: object = vals
        elif typ == 14:  # REALSXP
            n = self.length()
            value = list(struct.unpack_from(f">{n}d", self.buf, self.pos))
            self.pos += 8 * n
        elif typ == 16:  # STRSXP
            n = self.length()
            value = [self.item() for _ in range(n)]
        elif typ in (19, 20):  # VECSXP, EXPRSXP
            n = self.length()
            value = [self.item() for _ in range(n)]
        else:
            raise ValueError(f"unsupported R SEXP type {typ} at byte {self.pos}")
        attrs = self._attrs_from(self.item()) if has_attr else {}
        return RObj(typ, value, attrs)

    @staticmethod
    def _attrs_from(plist) -> dict:
        if not isinstance(plist, RObj) or not isinstance(plist.value, list):
            return {}
        return {tag: val for tag, val in plist.value if isinstance(tag, str)}


def unserialize(data: bytes):
    return _RReader(data).item()


def _names(obj: RObj) -> list[str]:
    names = obj.attrs.get("names")
    return names.value if isinstance(names, RObj) else []


def read_lazyload_db(rdx: bytes, rdb: bytes) -> dict[str, list[str]]:
    """Read every character vector of an R lazy-load database (``.rdx`` index + ``.rdb`` data)."""
    index = unserialize(gzip.decompress(rdx))
    fields = dict(zip(_names(index), index.value))
    variables = fields["variables"]
    out = {}
    for name, loc in zip(_names(variables), variables.value):
        offset, length = loc.value
        chunk = rdb[offset : offset + length]
        (raw_len,) = struct.unpack(">I", chunk[:4])
        body = zlib.decompress(chunk[4:])
        assert len(body) == raw_len, (name, len(body), raw_len)
        obj = unserialize(body)
        if isinstance(obj, RObj) and obj.type == 16:
            out[name] = obj.value
    return out


# ----------------------------------------------------------------------------- cleaning


def clean_book(lines: list[str | None]) -> str:
    """Join wrapped lines into paragraphs separated by blank lines; drop italics markers."""
    paragraphs, cur = [], []
    for line in lines:
        line = (line or "").strip()
        if not line:
            if cur:
                paragraphs.append(" ".join(cur))
                cur = []
            continue
        cur.append(line)
    if cur:
        paragraphs.append(" ".join(cur))
    text = "\n\n".join(paragraphs)
    text = text.replace("_", "")
    text = re.sub(r"[ \t]+", " ", text)
    # Stray Gutenberg markers, should any survive in the package's text.
    text = re.sub(r"(?im)^.*(project gutenberg|\*\*\* ?(start|end) of).*$\n?", "", text)
    return text.strip() + "\n"


def load_books(cache: Path = DEFAULT_CACHE) -> dict[str, str]:
    """Return {R object name: cleaned text} for the six novels (fetching the .deb if needed)."""
    files = read_deb_data(fetch_deb(cache))
    raw = read_lazyload_db(files["Rdata.rdx"], files["Rdata.rdb"])
    missing = set(BOOKS) - set(raw)
    if missing:
        raise RuntimeError(f"books missing from the package: {sorted(missing)}")
    return {name: clean_book(raw[name]) for name in BOOKS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--dump", type=Path, help="write each cleaned book to DIR/<name>.txt")
    args = ap.parse_args()
    books = load_books(args.cache)
    for name, text in books.items():
        tag = " (held out)" if name == HELDOUT_BOOK else ""
        print(f"{BOOKS[name]:24s} {len(text):>9,d} chars {len(text.split()):>8,d} words{tag}")
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{name}.txt").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
