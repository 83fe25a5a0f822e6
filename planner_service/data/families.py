"""Seeded parametric document-length families fitted to published corpus statistics.

Every family draws document lengths in tokens from a lognormal body spliced to a
(truncated) Pareto tail, or from a mixture of such components weighted by token share.
The source numbers are those collected in ``lengths/README.md`` beside this module:

* code: lognormal mu 7.1, sigma 1.5 with 10% of documents Pareto above 8K, alpha 1.23
  (matches the packaged ``code_doc_lengths.json``: median 1,102, 10.4% of docs above 8K).
* web: lognormal median 300-650, sigma 1.0-1.3.
* English Wikipedia: mean 692, median 305, p95 2,464 tokens.
* papers: median 6.5K-14K, sigma 0.8.
* books: median 80K-115K, sigma 0.6.
* The Pile (Gao et al. 2020, Table 1): per-subset mean document size in KiB and
  effective-size weight; ~4 bytes/token for prose, ~3 for code.
* RedPajama-V1: tokens per subset (CommonCrawl 878B, C4 175B, GitHub 59B, Books 26B,
  ArXiv 28B, Wikipedia 24B, StackExchange 20B); C4 ~480 tokens/doc.

Sampling uses only the supplied ``numpy.random.Generator`` so results are reproducible
for a given seed. All returned lengths are ``int64`` and ``>= 1``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "BOOKS",
    "C4",
    "CODE",
    "FAMILIES",
    "MAX_DOC_LENGTH",
    "PAPERS",
    "PILE",
    "REDPAJAMA",
    "WEB",
    "WIKIPEDIA",
    "DocLengthFamily",
    "LognormalPareto",
    "Mixture",
    "MixtureComponent",
    "family_names",
    "get_family",
]

# Upper bound on any generated document. The real code sample peaks at 3.93M tokens, and
# an unbounded alpha~1.2 Pareto would occasionally emit absurd (1e9-token) documents.
MAX_DOC_LENGTH = 1 << 22

# Below this probability of landing in the body, rejection sampling would be too slow.
_MIN_BODY_ACCEPTANCE = 0.01


def _norm_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def _norm_pdf(z: float) -> float:
    return math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def _require_count(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise ValueError(f"n must be an integer, got {n!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return int(n)


@runtime_checkable
class DocLengthFamily(Protocol):
    """Anything that draws document lengths (tokens) and knows its expected mean."""

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Return ``n`` int64 document lengths, each ``>= 1``."""
        ...

    def mean(self) -> float:
        """Expected document length in tokens (analytic, before integer rounding)."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class LognormalPareto:
    """Lognormal body below ``tail_threshold`` spliced to a truncated Pareto tail above it.

    With probability ``1 - tail_fraction`` a document comes from the lognormal
    (``median``, ``sigma``) conditioned to lie below the threshold; otherwise it comes
    from a Pareto(``tail_alpha``) on ``[tail_threshold, max_length]``. So exactly
    ``tail_fraction`` of documents lie above the threshold, which is how the published
    fits are stated ("10% Pareto above 8K"). With ``tail_fraction == 0`` this is a
    plain lognormal conditioned below ``max_length``.

    Raises:
        ValueError: on non-positive median/sigma, a tail fraction outside ``[0, 1)``, a
            tail without threshold/alpha, a threshold not below ``max_length``, or a body
            that would almost never fall below its bound.
    """

    median: float
    sigma: float
    tail_fraction: float = 0.0
    tail_threshold: float | None = None
    tail_alpha: float | None = None
    max_length: int = MAX_DOC_LENGTH

    def __post_init__(self) -> None:
        if not self.median > 0:
            raise ValueError(f"median must be > 0, got {self.median}")
        if not self.sigma > 0:
            raise ValueError(f"sigma must be > 0, got {self.sigma}")
        if not 0.0 <= self.tail_fraction < 1.0:
            raise ValueError(f"tail_fraction must be in [0, 1), got {self.tail_fraction}")
        if self.max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {self.max_length}")
        if self.tail_fraction > 0:
            if self.tail_threshold is None or self.tail_alpha is None:
                raise ValueError(
                    "tail_threshold and tail_alpha are required when tail_fraction > 0"
                )
            if not 1.0 <= self.tail_threshold < self.max_length:
                raise ValueError(
                    f"tail_threshold must be in [1, max_length={self.max_length}), "
                    f"got {self.tail_threshold}"
                )
            if not self.tail_alpha > 0:
                raise ValueError(f"tail_alpha must be > 0, got {self.tail_alpha}")
        if self._body_acceptance() < _MIN_BODY_ACCEPTANCE:
            raise ValueError(
                f"lognormal body (median {self.median}, sigma {self.sigma}) almost never "
                f"falls below its bound {self._body_bound()}"
            )

    # --- constructors -------------------------------------------------------------

    @classmethod
    def lognormal(
        cls, *, median: float, sigma: float, max_length: int = MAX_DOC_LENGTH
    ) -> LognormalPareto:
        """Plain lognormal (no Pareto tail), conditioned below ``max_length``."""
        return cls(median=median, sigma=sigma, max_length=max_length)

    @classmethod
    def from_mean(
        cls, *, mean: float, sigma: float, max_length: int = MAX_DOC_LENGTH
    ) -> LognormalPareto:
        """Plain lognormal with the given mean: median = mean * exp(-sigma^2 / 2).

        Used where a source publishes only a mean document size (Pile subsets, C4).
        """
        if not mean > 0:
            raise ValueError(f"mean must be > 0, got {mean}")
        return cls(median=mean * math.exp(-0.5 * sigma * sigma), sigma=sigma, max_length=max_length)

    @classmethod
    def spliced(
        cls,
        *,
        median: float,
        sigma: float,
        tail_threshold: float,
        max_length: int = MAX_DOC_LENGTH,
    ) -> LognormalPareto:
        """Lognormal whose upper tail beyond ``tail_threshold`` is replaced by a Pareto.

        For families where the sources give only a median and sigma, the tail keeps the
        lognormal's own mass above the threshold, and alpha is chosen so the density is
        continuous there: ``alpha = pdf(z) / (sigma * sf(z))`` with
        ``z = ln(threshold / median) / sigma``. (Applied to the code fit this gives 10.1%
        and alpha 1.17, close to the published 10% / 1.23.) The splice therefore keeps
        the body and only swaps the lognormal's fast-decaying far tail for a power law.
        """
        z = math.log(tail_threshold / median) / sigma
        survival = 1.0 - _norm_cdf(z)
        return cls(
            median=median,
            sigma=sigma,
            tail_fraction=survival,
            tail_threshold=tail_threshold,
            tail_alpha=_norm_pdf(z) / (sigma * survival),
            max_length=max_length,
        )

    # --- statistics ---------------------------------------------------------------

    def _mu(self) -> float:
        return math.log(self.median)

    def _body_bound(self) -> float:
        if self.tail_fraction > 0 and self.tail_threshold is not None:
            return float(self.tail_threshold)
        return float(self.max_length)

    def _body_acceptance(self) -> float:
        """P(lognormal < body bound): the rejection sampler's acceptance rate."""
        return _norm_cdf((math.log(self._body_bound()) - self._mu()) / self.sigma)

    def _body_mean(self) -> float:
        # E[X | X < b] for X ~ lognormal(mu, sigma).
        zb = (math.log(self._body_bound()) - self._mu()) / self.sigma
        full_mean = math.exp(self._mu() + 0.5 * self.sigma**2)
        return full_mean * _norm_cdf(zb - self.sigma) / _norm_cdf(zb)

    def _tail_mean(self) -> float:
        # Mean of a Pareto(alpha) on [t, m] (truncated at max_length, so always finite).
        t, m = float(self.tail_threshold or 1.0), float(self.max_length)
        a = float(self.tail_alpha or 1.0)
        norm = 1.0 - (t / m) ** a
        if math.isclose(a, 1.0):
            integral = t * math.log(m / t)
        else:
            integral = t * (1.0 - (m / t) ** (1.0 - a)) / (a - 1.0)
        return a * integral / norm

    def mean(self) -> float:
        """Expected document length in tokens (analytic, ignoring integer rounding)."""
        body = (1.0 - self.tail_fraction) * self._body_mean()
        if self.tail_fraction == 0:
            return body
        return body + self.tail_fraction * self._tail_mean()

    # --- sampling -----------------------------------------------------------------

    def _sample_body(self, rng: np.random.Generator, n: int) -> np.ndarray:
        # Rejection sampling is exact for the truncated lognormal and needs no inverse
        # normal CDF; acceptance is >= 1% by construction (see __post_init__).
        out = np.empty(n, dtype=np.float64)
        bound, acceptance = self._body_bound(), self._body_acceptance()
        filled = 0
        while filled < n:
            need = n - filled
            draws = rng.lognormal(
                mean=self._mu(), sigma=self.sigma, size=int(need / acceptance * 1.05) + 16
            )
            kept = draws[draws < bound][:need]
            out[filled : filled + kept.size] = kept
            filled += kept.size
        return out

    def _sample_tail(self, rng: np.random.Generator, n: int) -> np.ndarray:
        # Inverse CDF of the truncated Pareto: F(x) = (1 - (t/x)^a) / (1 - (t/m)^a).
        t, a = float(self.tail_threshold or 1.0), float(self.tail_alpha or 1.0)
        norm = 1.0 - (t / self.max_length) ** a
        u = rng.random(n)
        return t * (1.0 - u * norm) ** (-1.0 / a)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Draw ``n`` document lengths (int64, in ``[1, max_length]``).

        Raises:
            ValueError: if ``n`` is not an integer >= 0.
        """
        n = _require_count(n)
        values = np.empty(n, dtype=np.float64)
        if self.tail_fraction > 0:
            in_tail = rng.random(n) < self.tail_fraction
            n_tail = int(in_tail.sum())
            values[~in_tail] = self._sample_body(rng, n - n_tail)
            values[in_tail] = self._sample_tail(rng, n_tail)
        else:
            values[:] = self._sample_body(rng, n)
        return np.clip(np.rint(values), 1, self.max_length).astype(np.int64)


@dataclass(frozen=True, kw_only=True, slots=True)
class MixtureComponent:
    """One subset of a corpus: its length family and its share of the corpus' tokens."""

    name: str
    family: LognormalPareto
    token_share: float

    def __post_init__(self) -> None:
        if not self.token_share > 0:
            raise ValueError(f"token_share of {self.name!r} must be > 0, got {self.token_share}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Mixture:
    """A corpus as a mixture of subsets, weighted so each subset gets its token share.

    Sampling draws *documents*, so a subset's document probability is its token share
    divided by its mean document length (long-document subsets such as books hold many
    tokens in few documents). The token mix of a long sample then matches the shares.

    Raises:
        ValueError: if there are no components.
    """

    components: tuple[MixtureComponent, ...]

    def __post_init__(self) -> None:
        if not self.components:
            raise ValueError("a Mixture needs at least one component")

    def document_probabilities(self) -> np.ndarray:
        """Probability that a drawn document comes from each component (sums to 1)."""
        weights = np.array([c.token_share / c.family.mean() for c in self.components])
        return weights / weights.sum()

    def mean(self) -> float:
        """Expected document length in tokens (analytic, ignoring integer rounding)."""
        means = np.array([c.family.mean() for c in self.components])
        return float(self.document_probabilities() @ means)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Draw ``n`` document lengths (int64, ``>= 1``) from the mixture.

        Raises:
            ValueError: if ``n`` is not an integer >= 0.
        """
        n = _require_count(n)
        which = rng.choice(len(self.components), size=n, p=self.document_probabilities())
        out = np.empty(n, dtype=np.int64)
        for index, component in enumerate(self.components):
            mask = which == index
            out[mask] = component.family.sample(rng, int(mask.sum()))
        return out


# --- fitted single-source families -----------------------------------------------

CODE = LognormalPareto(
    median=math.exp(7.1), sigma=1.5, tail_fraction=0.10, tail_threshold=8192.0, tail_alpha=1.23
)
"""Source code (GitHub / The Stack-like): lognormal mu 7.1 (median ~1,212), sigma 1.5,
10% of documents Pareto above 8K with alpha 1.23 (README fit). The shared real-code
sample has median 1,102 and 10.4% of docs above 8K."""

WEB = LognormalPareto.spliced(median=450.0, sigma=1.15, tail_threshold=8192.0)
"""Web text (CommonCrawl-like): midpoint of the published lognormal fit, median 300-650
and sigma 1.0-1.3; power-law tail spliced above 8K (about 1% of documents)."""

WIKIPEDIA = LognormalPareto.spliced(median=305.0, sigma=1.28, tail_threshold=8192.0)
"""English Wikipedia: median 305 tokens; sigma 1.28 = sqrt(2 ln(692/305)) reproduces the
published mean 692, and then p95 ~2,500 matches the published 2,464."""

PAPERS = LognormalPareto.spliced(median=9000.0, sigma=0.8, tail_threshold=65536.0)
"""Scientific papers: published fit median 6.5K-14K, sigma 0.8. Median 9K gives mean
~12.4K, between Pile PubMed Central (30.55 KiB ~ 7.8K tokens) and ArXiv (46.61 KiB ~
11.9K tokens); power-law tail spliced above 64K."""

BOOKS = LognormalPareto.spliced(median=100_000.0, sigma=0.6, tail_threshold=524_288.0)
"""Books: published fit median 80K-115K, sigma 0.6; median 100K gives mean ~120K, between
Pile PG-19 (398.73 KiB ~ 100K tokens) and Books3 (538.36 KiB ~ 138K tokens)."""

C4 = LognormalPareto.from_mean(mean=480.0, sigma=1.0)
"""C4: 364.9M docs, ~480 tokens/doc (RedPajama-V1 numbers); sigma 1.0 is the low end of
the web fit since C4 is heavily filtered."""


# --- The Pile ------------------------------------------------------------------------

# (sigma, bytes per token) per kind of subset. Sigmas are the README fits for the
# matching genre; bytes/token is the README's ~4 for prose and ~3 for code.
_PILE_KINDS: dict[str, tuple[float, float]] = {
    "web": (1.15, 4.0),  # short-form prose: the web fit
    "long": (0.8, 4.0),  # articles, transcripts, legal opinions: the papers fit
    "book": (0.6, 4.0),  # the books fit
    "code": (1.5, 3.0),  # the code fit
}

# (subset, mean document size KiB, effective-size weight %, kind), Pile paper Table 1.
_PILE_SUBSETS: tuple[tuple[str, float, float, str], ...] = (
    ("pile_cc", 4.33, 18.11, "web"),
    ("pubmed_central", 30.55, 14.40, "long"),
    ("books3", 538.36, 12.07, "book"),
    ("openwebtext2", 3.85, 10.01, "web"),
    ("arxiv", 46.61, 8.96, "long"),
    ("github", 5.25, 7.59, "code"),
    ("freelaw", 15.06, 6.12, "long"),
    ("stackexchange", 2.16, 5.13, "web"),
    ("uspto_backgrounds", 4.08, 3.65, "web"),
    ("pubmed_abstracts", 1.30, 3.07, "web"),
    ("pg19", 398.73, 2.17, "book"),
    ("opensubtitles", 30.48, 1.55, "long"),
    ("wikipedia_en", 1.11, 1.53, "web"),
    ("dm_mathematics", 8.00, 1.24, "long"),
    ("ubuntu_irc", 545.48, 0.88, "long"),
    ("bookcorpus2", 369.87, 0.75, "book"),
    ("europarl", 68.87, 0.73, "long"),
    ("hackernews", 4.92, 0.62, "web"),
    ("youtube_subtitles", 22.55, 0.60, "long"),
    ("philpapers", 73.37, 0.38, "long"),
    ("nih_exporter", 2.11, 0.30, "web"),
    ("enron_emails", 1.78, 0.14, "web"),
)


def _pile_component(name: str, mean_kib: float, weight_pct: float, kind: str) -> MixtureComponent:
    sigma, bytes_per_token = _PILE_KINDS[kind]
    mean_tokens = mean_kib * 1024.0 / bytes_per_token
    # Table 1 weights are byte shares; convert to token shares with the same ratio.
    return MixtureComponent(
        name=name,
        family=LognormalPareto.from_mean(mean=mean_tokens, sigma=sigma),
        token_share=weight_pct / bytes_per_token,
    )


PILE = Mixture(components=tuple(_pile_component(*row) for row in _PILE_SUBSETS))
"""The Pile: 22 subsets (Pile paper Table 1), each a lognormal whose mean is the subset's
mean document size (KiB * 1024 / bytes-per-token, ~4 prose, ~3 code) and whose sigma is
the README fit for its genre; subsets weighted by their effective-size token share.
The heavy tail comes from the book-length subsets (Books3, PG-19, Ubuntu IRC)."""


# --- RedPajama-V1 ----------------------------------------------------------------------

REDPAJAMA = Mixture(
    components=(
        MixtureComponent(name="commoncrawl", family=WEB, token_share=878.0),
        MixtureComponent(name="c4", family=C4, token_share=175.0),
        MixtureComponent(name="github", family=CODE, token_share=59.0),
        MixtureComponent(name="books", family=BOOKS, token_share=26.0),
        MixtureComponent(name="arxiv", family=PAPERS, token_share=28.0),
        MixtureComponent(name="wikipedia", family=WIKIPEDIA, token_share=24.0),
        # Pile StackExchange mean 2.16 KiB / 4 bytes per token ~ 553 tokens, web sigma.
        MixtureComponent(
            name="stackexchange",
            family=LognormalPareto.from_mean(mean=2.16 * 1024.0 / 4.0, sigma=1.15),
            token_share=20.0,
        ),
    )
)
"""RedPajama-V1: subsets weighted by token count (CommonCrawl 878B, C4 175B, GitHub 59B,
Books 26B, ArXiv 28B, Wikipedia 24B, StackExchange 20B), each using the matching family
above (C4: ~480 tokens/doc)."""


FAMILIES: dict[str, DocLengthFamily] = {
    "pile": PILE,
    "redpajama": REDPAJAMA,
    "web": WEB,
    "wikipedia": WIKIPEDIA,
    "c4": C4,
    "code": CODE,
    "books": BOOKS,
    "papers": PAPERS,
}
"""Registry of named families; see :func:`get_family`."""


def family_names() -> tuple[str, ...]:
    """Sorted names of the registered families."""
    return tuple(sorted(FAMILIES))


def get_family(name: str, families: Mapping[str, DocLengthFamily] = FAMILIES) -> DocLengthFamily:
    """Look up a family by name.

    Raises:
        ValueError: if ``name`` is not registered; the message lists the valid names.
    """
    try:
        return families[name]
    except (KeyError, TypeError):
        valid = ", ".join(sorted(families))
        raise ValueError(f"unknown document-length family {name!r}; valid names: {valid}") from None
