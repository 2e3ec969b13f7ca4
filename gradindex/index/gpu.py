"""FAISS on GPUs when FAISS sees any: training, adding, and (sharded) search.

Every function is a no-op returning its input on a machine without GPUs, and falls back to the
CPU index (with a log line) for an index type FAISS cannot put on a GPU (e.g. HNSW).
"""

from __future__ import annotations

import logging

import faiss
import numpy as np

log = logging.getLogger("gradindex")
_RESOURCES: list = []


def num_gpus() -> int:
    return int(faiss.get_num_gpus()) if hasattr(faiss, "get_num_gpus") else 0


def _resources(i: int):
    while len(_RESOURCES) <= i:
        _RESOURCES.append(faiss.StandardGpuResources())
    return _RESOURCES[i]


def is_gpu(index: faiss.Index) -> bool:
    wrapped = isinstance(index, faiss.IndexShards | faiss.IndexReplicas)
    return num_gpus() > 0 and (wrapped or "Gpu" in type(faiss.downcast_index(index)).__name__)


def train(index: faiss.Index, x: np.ndarray, use_gpu: bool) -> None:
    """Train in place; IVF k-means runs on the GPUs when there are any."""
    if use_gpu and num_gpus() > 0:
        try:
            ivf = faiss.extract_index_ivf(index)
            ivf.clustering_index = faiss.index_cpu_to_all_gpus(faiss.IndexFlatL2(ivf.d))
        except RuntimeError:
            pass
    index.train(x)


def for_adding(index: faiss.Index, use_gpu: bool) -> faiss.Index:
    """The index to add to: a copy on GPU 0 when possible, else ``index`` itself."""
    if not use_gpu or num_gpus() == 0 or not is_ivf(index):  # a flat add is a copy: stay put
        return index
    try:
        co = faiss.GpuClonerOptions()
        co.useFloat16 = False  # exact codes and tables: the same results as on the CPU
        return faiss.index_cpu_to_gpu(_resources(0), 0, index, co)
    except RuntimeError as e:
        log.info("building %s on the CPU (%s)", type(faiss.downcast_index(index)).__name__, e)
        return index


def for_search(index: faiss.Index, use_gpu: bool) -> faiss.Index:
    """A copy sharded over all GPUs for search when possible, else ``index`` itself."""
    if not use_gpu or num_gpus() == 0:
        return index
    try:
        co = faiss.GpuMultipleClonerOptions()
        co.shard = True
        co.useFloat16 = False
        return faiss.index_cpu_to_all_gpus(index, co=co)
    except RuntimeError as e:
        log.info("searching %s on the CPU (%s)", type(faiss.downcast_index(index)).__name__, e)
        return index


def is_ivf(index: faiss.Index) -> bool:
    """Whether ``index`` has an inverted-file level (FAISS IVF)."""
    try:
        faiss.extract_index_ivf(index)
        return True
    except RuntimeError:
        return False


def to_cpu(index: faiss.Index) -> faiss.Index:
    return faiss.index_gpu_to_cpu(index) if is_gpu(index) else index
