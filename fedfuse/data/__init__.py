"""Data layer of fedfuse: sources, federated partitions and the server's fusion set.

Pure PyTorch / numpy (+ flwr-datasets partitioners and Hugging Face ``datasets``); this package
never imports ``flwr`` so it can be used by the ServerApp, the ClientApps and plain scripts alike.

Public API::

    ArrayDataset            in-memory labelled tensors (x [N, *input_shape] float32, y [N] int64)
    load_source, SOURCES    named data sources -> (train, test) ArrayDatasets
    partition_indices       label-based client partitions (flwr-datasets partitioners)
    PARTITIONERS            the valid partitioning method names
    split_train_val         stratified (train, val) split of an index array
    fusion_set              class-balanced server fusion inputs ("public" or "client0")
    FederatedData           everything above, built deterministically from a config

Heavy dependencies (sklearn, torchvision, datasets, flwr_datasets, mnist1d) are imported lazily
inside the functions that need them, so ``import fedfuse.data`` stays cheap.
"""

from fedfuse.data.fusion_set import FederatedData, fusion_set
from fedfuse.data.partition import PARTITIONERS, partition_indices, split_train_val
from fedfuse.data.sources import SOURCES, ArrayDataset, load_source

__all__ = [
    "ArrayDataset",
    "load_source",
    "SOURCES",
    "partition_indices",
    "PARTITIONERS",
    "split_train_val",
    "fusion_set",
    "FederatedData",
]
