"""The attention-mask flags of ``planner plan`` and ``planner compare``: ``--window``,
``--layers`` and ``--hf-config`` (exclusive), read into a core ``AttentionMask``.

``--hf-config`` takes a local model directory or ``config.json`` file and reads it with
transformers' ``AutoConfig`` (``local_files_only``: never a download), imported only
here and only when the flag is given, so the CLI does not need transformers otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from planner_service.core.errors import FieldError
from planner_service.core.mask import CAUSAL, AttentionMask, from_hf_config, parse_mask

Window = Annotated[
    str | None,
    typer.Option(help="Sliding window of every layer (tokens), or full (causal)"),
]
Layers = Annotated[
    str | None,
    typer.Option(help="Layer mix COUNTxWINDOW,...: 5x1024,1xfull is 5 layers of window "
                 "1,024 per causal layer"),
]
HfConfig = Annotated[
    str | None,
    typer.Option(help="The mask of a transformers model: its local directory or config.json "
                 "(never downloaded)"),
]


def mask_of(window: str | None, layers: str | None, hf_config: str | None) -> AttentionMask:
    """The mask the flags give (CAUSAL for none). FieldError naming ``window``, ``layers``
    or ``hf_config`` (the CLI's one-line error names the flag)."""
    given = [name for name, value in (("--window", window), ("--layers", layers),
                                      ("--hf-config", hf_config)) if value is not None]
    if len(given) > 1:
        raise FieldError("layers", f"{' and '.join(given)} are exclusive: give one")
    if hf_config is not None:
        return _hf_mask(hf_config)
    if layers is not None:
        return parse_mask(layers=layers)
    if window is None or window.strip().lower() == "full":
        return CAUSAL
    if not window.strip().isdigit():
        raise FieldError("window", f"window must be an integer in [1, 2147483647] or full, "
                         f"got {window!r}")
    return parse_mask(window=int(window))


def _hf_mask(where: str) -> AttentionMask:
    path = Path(where)
    if not path.exists():
        raise FieldError("hf_config", f"hf_config {where!r} is not a local directory or "
                         "config.json file (models are never downloaded)")
    try:
        from transformers import AutoConfig
    except ModuleNotFoundError:
        raise FieldError("hf_config", "hf_config needs transformers: pip install "
                         "transformers (or give --layers)") from None
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise FieldError("hf_config", f"hf_config {where!r}: {exc}"[:300]) from None
    try:
        return from_hf_config(config)
    except FieldError as exc:
        raise FieldError("hf_config", f"hf_config {where!r}: {exc}") from None
