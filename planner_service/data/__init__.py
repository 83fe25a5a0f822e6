"""Document-length data: the packaged length files, parametric families and sequence packing."""

from planner_service.data.datasets import (
    CONTEXT_64K,
    CONTEXT_128K,
    SHARED_FILES,
    FamilySource,
    FileSource,
    LengthSource,
    default_data_dir,
    load_lengths,
    make_source,
    pack_sequences,
    pack_sequences_variable,
    packaged_data_dir,
    sample_batch,
)
from planner_service.data.families import (
    FAMILIES,
    DocLengthFamily,
    LognormalPareto,
    Mixture,
    MixtureComponent,
    family_names,
    get_family,
)

__all__ = [
    "CONTEXT_128K",
    "CONTEXT_64K",
    "FAMILIES",
    "SHARED_FILES",
    "DocLengthFamily",
    "FamilySource",
    "FileSource",
    "LengthSource",
    "LognormalPareto",
    "Mixture",
    "MixtureComponent",
    "default_data_dir",
    "family_names",
    "get_family",
    "load_lengths",
    "make_source",
    "pack_sequences",
    "pack_sequences_variable",
    "packaged_data_dir",
    "sample_batch",
]
