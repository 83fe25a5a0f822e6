"""Document-length sources and seeded sequence packing for planner benchmarks and tests.

A *length source* yields document lengths (tokens): either a JSON lengths file, sampled
uniformly with replacement, or a parametric family from :mod:`.families`. Packing turns
a document stream into per-sequence lists of document lengths, which is all the planner
needs to know about a batch.

All randomness comes from ``numpy.random.default_rng(seed)``, so a given set of
arguments yields identical output on every machine (for a given numpy version).
The two data sets (``wlbllm``, ``code``) ship with the package in ``lengths/`` (their
provenance and licence: ``lengths/NOTICE``); ``$PLANNER_DATA_DIR`` overrides the folder.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from planner_service.data.families import FAMILIES, DocLengthFamily, get_family

__all__ = [
    "CONTEXT_128K",
    "CONTEXT_64K",
    "SHARED_FILES",
    "FamilySource",
    "FileSource",
    "LengthSource",
    "default_data_dir",
    "packaged_data_dir",
    "load_lengths",
    "make_source",
    "pack_sequences",
    "pack_sequences_variable",
    "sample_batch",
]

CONTEXT_64K = 65536
CONTEXT_128K = 131072

SHARED_FILES: dict[str, str] = {
    "wlbllm": "wlbllm_doc_lengths.json",
    "code": "code_doc_lengths.json",
}
"""Data set names -> file names inside :func:`default_data_dir`."""

# Bounds on one vectorised draw: big enough that a typical pack needs one draw, small
# enough (32 MiB of int64) that a huge request cannot exhaust memory in one go.
_MIN_CHUNK = 1024
_MAX_CHUNK = 1 << 22


def packaged_data_dir() -> Path:
    """The folder of length files installed with the package (``planner_service/data/lengths``).

    Found with :mod:`importlib.resources`, so it is the same from a clone, a wheel and an
    sdist. The package is installed unzipped (pip's wheels always are), so it is a path.
    """
    folder = resources.files(__package__ or "planner_service.data").joinpath("lengths")
    if not isinstance(folder, Path):  # a zipped install: the files have no path to read
        raise RuntimeError(f"planner_service is installed zipped ({folder}); install it "
                           f"unzipped or set PLANNER_DATA_DIR to a folder of length files")
    return folder


def default_data_dir() -> Path:
    """Folder holding the length files of the named data sets (:data:`SHARED_FILES`).

    ``$PLANNER_DATA_DIR`` if set, else :func:`packaged_data_dir`.
    """
    override = os.environ.get("PLANNER_DATA_DIR")
    return Path(override) if override else packaged_data_dir()


def _require_int(name: str, value: object, minimum: int) -> int:
    """Return ``value`` as an int, or raise ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def load_lengths(path: str | os.PathLike[str]) -> np.ndarray:
    """Read a JSON list of positive integer document lengths into an int64 array.

    Raises:
        ValueError: naming ``path`` if the file is missing or unreadable, is not valid
            JSON, is not a non-empty list, or holds an entry that is not an integer >= 1.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"lengths file {path} does not exist or is not a file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"lengths file {path} is not readable JSON: {exc}") from exc
    if not isinstance(data, list) or not data:
        raise ValueError(
            f"lengths file {path} must hold a non-empty JSON list of positive integers"
        )
    for index, value in enumerate(data):
        # type() rather than isinstance(): JSON true/false load as bool, a subclass of int.
        if type(value) is not int or value < 1:
            raise ValueError(
                f"lengths file {path}: entry {index} is {value!r}; expected an integer >= 1"
            )
    try:
        return np.asarray(data, dtype=np.int64)
    except OverflowError as exc:
        raise ValueError(f"lengths file {path}: a length does not fit in int64") from exc


@runtime_checkable
class LengthSource(Protocol):
    """A seeded stream of document lengths (tokens)."""

    @property
    def name(self) -> str:
        """The spec this source was made from, for reports."""
        ...

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Return ``n`` int64 document lengths, each ``>= 1``."""
        ...

    def mean_length(self) -> float:
        """Expected document length, used only to size vectorised draws."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class FileSource:
    """Documents drawn uniformly at random, with replacement, from a lengths file.

    Build with :meth:`from_path`. Equality and hashing use ``name`` and ``path`` only.
    """

    name: str
    path: Path
    lengths: np.ndarray = field(repr=False, compare=False)

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], *, name: str | None = None) -> FileSource:
        """Load ``path`` with :func:`load_lengths` (raises its ValueError)."""
        lengths = load_lengths(path)
        lengths.setflags(write=False)  # shared by every draw; keep it immutable
        return cls(name=name or f"file:{path}", path=Path(path), lengths=lengths)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Return ``n`` lengths picked uniformly with replacement from the file."""
        n = _require_int("n", n, 0)
        return self.lengths[rng.integers(0, self.lengths.size, size=n)]

    def mean_length(self) -> float:
        """Mean document length in the file."""
        return float(self.lengths.mean())


@dataclass(frozen=True, kw_only=True, slots=True)
class FamilySource:
    """Documents drawn from a parametric family (see :mod:`.families`)."""

    name: str
    family: DocLengthFamily

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Return ``n`` lengths sampled from the family."""
        return self.family.sample(rng, _require_int("n", n, 0))

    def mean_length(self) -> float:
        """The family's analytic mean document length."""
        return self.family.mean()


def make_source(spec: str) -> LengthSource:
    """Build a length source from a spec string.

    Accepted forms, checked in this order:

    * ``wlbllm`` or ``code``: the packaged files in :func:`default_data_dir`
      (``code`` is the real code sample; use ``family:code`` for the parametric fit);
    * ``file:PATH``: any JSON lengths file;
    * ``family:NAME`` or a bare family name (``pile``, ``redpajama``, ``web``, ...).

    Raises:
        ValueError: if the spec matches no form (the message lists the valid ones), or if
            the file is missing or malformed (see :func:`load_lengths`).
    """
    if not isinstance(spec, str):
        raise ValueError(f"spec must be a string, got {spec!r}")
    if spec in SHARED_FILES:
        folder = default_data_dir()
        if not (folder / SHARED_FILES[spec]).is_file():
            raise ValueError(
                f"data set {spec!r} is the file {SHARED_FILES[spec]} in the data folder {folder}, "
                f"which has no such file; set PLANNER_DATA_DIR to the folder that holds it (unset: "
                f"the files installed with the package), or "
                f"use a family (e.g. family:{'code' if spec == 'code' else 'pile'}) or file:PATH"
            )
        return FileSource.from_path(folder / SHARED_FILES[spec], name=spec)
    if spec.startswith("file:") and len(spec) > len("file:"):
        return FileSource.from_path(spec.removeprefix("file:"), name=spec)
    name = spec.removeprefix("family:")
    if name in FAMILIES:
        return FamilySource(name=spec, family=get_family(name))
    raise ValueError(
        f"invalid length source spec {spec!r}; expected one of: "
        f"{', '.join(sorted(SHARED_FILES))} (length files in {default_data_dir()}), "
        f"a family name ({', '.join(sorted(FAMILIES))}), 'family:NAME', or 'file:PATH'"
    )


def _chunk_size(source: LengthSource, total_tokens: int, num_sequences: int) -> int:
    # Expected docs: one per full mean length plus the truncated last doc per sequence.
    expected = total_tokens / max(source.mean_length(), 1.0) + num_sequences
    return int(min(max(math.ceil(expected * 1.1), _MIN_CHUNK), _MAX_CHUNK))


def _pack_to_targets(
    source: LengthSource, rng: np.random.Generator, targets: np.ndarray
) -> list[list[int]]:
    """Fill one sequence per target: docs in stream order, last one cut at the target.

    The remainder of a cut document is dropped (each sequence starts on a fresh
    document), so every sequence sums exactly to its target.
    """
    if targets.size == 0:
        return []
    chunk = _chunk_size(source, int(targets.sum()), targets.size)
    docs = source.draw(rng, chunk)
    cum = np.cumsum(docs)  # cum[i] = tokens in docs[0..i]
    start = 0  # first unused document
    base = 0  # tokens before docs[start]
    sequences: list[list[int]] = []
    for target in targets.tolist():
        end = base + target
        last = int(np.searchsorted(cum, end, side="left"))  # first doc reaching `end`
        while last == cum.size:
            # Stream ran dry: keep the unused documents, append a fresh chunk, rebase.
            docs = np.concatenate((docs[start:], source.draw(rng, chunk)))
            cum = np.cumsum(docs)
            end -= base
            start, base = 0, 0
            last = int(np.searchsorted(cum, end, side="left"))
        sequence = docs[start : last + 1].tolist()
        tokens_before_last = int(cum[last - 1]) if last > 0 else 0
        sequence[-1] = end - tokens_before_last  # in [1, docs[last]] by searchsorted
        sequences.append(sequence)
        start, base = last + 1, int(cum[last])
    return sequences


def pack_sequences(
    source: LengthSource, *, context_length: int, num_sequences: int, seed: int
) -> list[list[int]]:
    """Pack documents into ``num_sequences`` windows of exactly ``context_length`` tokens.

    Each window takes documents in stream order; the last one is truncated at the window
    (its remainder is dropped), so every returned list sums to ``context_length``.

    Raises:
        ValueError: naming the field if ``context_length < 1``, ``num_sequences < 0`` or
            ``seed < 0`` (or any of them is not an integer).
    """
    context_length = _require_int("context_length", context_length, 1)
    num_sequences = _require_int("num_sequences", num_sequences, 0)
    rng = np.random.default_rng(_require_int("seed", seed, 0))
    targets = np.full(num_sequences, context_length, dtype=np.int64)
    return _pack_to_targets(source, rng, targets)


def pack_sequences_variable(
    source: LengthSource, *, max_tokens: int, num_sequences: int, seed: int
) -> list[list[int]]:
    """Pack documents into sequences of varying length, each at most ``max_tokens``.

    Each sequence gets a fill target drawn uniformly from the integers in
    ``[ceil(max_tokens / 8), max_tokens]`` and is then packed like
    :func:`pack_sequences` with that target as its window, so sequence lengths vary as
    in FCP-style batches. The targets are drawn before any document.

    Raises:
        ValueError: naming the field if ``max_tokens < 1``, ``num_sequences < 0`` or
            ``seed < 0`` (or any of them is not an integer).
    """
    max_tokens = _require_int("max_tokens", max_tokens, 1)
    num_sequences = _require_int("num_sequences", num_sequences, 0)
    rng = np.random.default_rng(_require_int("seed", seed, 0))
    low = max(1, math.ceil(max_tokens / 8))
    targets = rng.integers(low, max_tokens, size=num_sequences, endpoint=True, dtype=np.int64)
    return _pack_to_targets(source, rng, targets)


def sample_batch(
    source: LengthSource, *, num_sequences: int, max_tokens: int, seed: int
) -> list[list[int]]:
    """Unpacked batch: ``num_sequences`` sequences of one document each, cut at ``max_tokens``.

    Raises:
        ValueError: naming the field if ``num_sequences < 0``, ``max_tokens < 1`` or
            ``seed < 0`` (or any of them is not an integer).
    """
    num_sequences = _require_int("num_sequences", num_sequences, 0)
    max_tokens = _require_int("max_tokens", max_tokens, 1)
    rng = np.random.default_rng(_require_int("seed", seed, 0))
    docs = np.minimum(source.draw(rng, num_sequences), max_tokens)
    return [[length] for length in docs.tolist()]
