"""Which query rows see a key set: the rows a part of a path must run. The runtime builds
its metadata from it and the step-time model counts those rows with it (one definition,
in the plan contract)."""

from __future__ import annotations

import numpy as np


def rows_seeing(doc: np.ndarray, pos: np.ndarray, key_doc: np.ndarray, key_pos: np.ndarray) -> np.ndarray:
    """Query rows (doc, pos), ascending, that see at least one key (same doc, key position
    <= pos); keys of doc -1 (padding) are no keys. O((T + K) log K)."""
    real = key_doc >= 0
    key_doc, key_pos = key_doc[real], key_pos[real]
    if len(key_doc) == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((key_pos, key_doc))
    docs, first = np.unique(key_doc[order], return_index=True)
    first_pos = key_pos[order][first]
    at = np.minimum(np.searchsorted(docs, doc), len(docs) - 1)
    return np.flatnonzero((docs[at] == doc) & (first_pos[at] <= pos))
