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
    load_fusion_file        a fusion set saved as .pt / .npz -> (x, y or None)
    write_fusion_set_file   a run's fusion set, preprocessed as the loader does, to .npz / .pt (fusion-set-path)
    write_test_set_file     the dataset's test split in the same format (test-set-path)
    load_node_data          a SuperNode's own train/val file (node-config data-path) -> (train, val)
    write_node_data, write_partition_files   write node-local data files
    check_fusion_inputs     shape / dtype / finite / value-scale checks of given fusion inputs
    SOURCE_INFO, source_info  input shape, classes and value scale of a source, known without loading
    FederatedData           everything above, built deterministically from a config

The allowed names (datasets, partitionings, fusion-set sources) are declared in ``fedfuse.config``.

Heavy dependencies (sklearn, torchvision, datasets, flwr_datasets, mnist1d) are imported lazily
inside the functions that need them, so ``import fedfuse.data`` stays cheap.
"""

from fedfuse.data.fusion_set import (FederatedData, check_fusion_inputs, fusion_set, load_fusion_file,
                                     write_fusion_set_file, write_test_set_file)
from fedfuse.data.partition import PARTITIONERS, partition_indices, split_train_val
from fedfuse.data.sources import SOURCE_INFO, SOURCES, ArrayDataset, SourceInfo, load_source, source_info

__all__ = [
    "ArrayDataset",
    "load_source",
    "SOURCES",
    "partition_indices",
    "PARTITIONERS",
    "split_train_val",
    "fusion_set",
    "load_fusion_file",
    "check_fusion_inputs",
    "write_fusion_set_file",
    "write_test_set_file",
    "load_node_data",
    "write_node_data",
    "write_partition_files",
    "FederatedData",
    "SOURCE_INFO",
    "SourceInfo",
    "source_info",
]

# node_data is also a script (`python -m fedfuse.data.node_data`): imported on first use, so that runpy does not
# find it in sys.modules already (RuntimeWarning "found in sys.modules after import of package")
_NODE_DATA = ("load_node_data", "write_node_data", "write_partition_files")


def __getattr__(name: str):
    if name in _NODE_DATA:
        from fedfuse.data import node_data  # deferred: a script too (runpy, see above)

        return getattr(node_data, name)
    raise AttributeError(f"module 'fedfuse.data' has no attribute {name!r}")
