"""Tensor pools by id (the seeds' allocate_tensor / return_to_pool /
clear_pool) on top of the device's caching pool.

A named pool keeps tensors handed back with return_to_pool and gives them out
again to the next allocate_tensor of the same shape, dtype and device, without
touching the device pool. Each named pool is bounded: it caches at most
`max_cached_bytes` and `max_cached_tensors` (set_pool_limits; defaults
POOL_MAX_CACHED_BYTES / POOL_MAX_CACHED_TENSORS, or a TensorOpsConfig's memory
section); returning a tensor past the bound evicts the least recently returned
ones, whose memory goes back to the device pool. Tensors given out and never
returned are not held by the pool: when the caller drops them, their memory
goes back to the device pool as with any Tensor.

A torch dtype (torch.float16, ...) gives a torch tensor (a zero-copy DLPack
view of the pool's memory, on the host or a CUDA/ROCm device); any other
dtype (a name, a numpy dtype) gives a tensor_ops.Tensor.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from typing import Any, Dict, Optional, Sequence, Tuple

from . import _checks, memory
from .errors import InvalidArgumentError, MemoryAllocationError

POOL_MAX_CACHED_BYTES = 1 << 30  # per named pool
POOL_MAX_CACHED_TENSORS = 64

_GB = float(1 << 30)


@dataclasses.dataclass
class _Pool:
    max_cached_bytes: int
    max_cached_tensors: int
    # (shape, dtype, device, torch?) -> cached tensors, and the cache's LRU order
    free: Dict[Tuple, list] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    order: "collections.OrderedDict[int, Tuple]" = dataclasses.field(default_factory=collections.OrderedDict)
    cached_bytes: int = 0
    # given-out tensors by id(), weakly: a dropped tensor leaves the map by itself
    out: "weakref.WeakValueDictionary[int, Any]" = dataclasses.field(default_factory=weakref.WeakValueDictionary)
    keys: Dict[int, Tuple] = dataclasses.field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    returns: int = 0
    evictions: int = 0


_lock = threading.Lock()
_pools: Dict[str, _Pool] = {}


def _pool(pool_id: str) -> _Pool:
    if not isinstance(pool_id, str) or not pool_id:
        raise InvalidArgumentError(f"pool_id must be a non-empty string, got {pool_id!r}")
    p = _pools.get(pool_id)
    if p is None:
        p = _pools[pool_id] = _Pool(POOL_MAX_CACHED_BYTES, POOL_MAX_CACHED_TENSORS)
    return p


def _is_torch_dtype(dtype) -> bool:
    return type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype"


def _default_device() -> Optional[str]:
    from . import config  # the applied config may name a device (opencl platform / device choice)

    return config.default_device()


def _nbytes(t) -> int:
    return t.nbytes if isinstance(t, memory.Tensor) else t.numel() * t.element_size()


def allocate_tensor(shape: Sequence[int], dtype="float32", pool_id: str = "default", device=None):
    """An uninitialised tensor of `shape` and `dtype` on `device` (default:
    the applied TensorOpsConfig's device, else the active backend's), reused
    from pool `pool_id` when one of the same shape, dtype and device was
    returned there, else allocated from the device's caching pool."""
    dev = memory._device(device if device is not None else _default_device())
    dev = memory._C.parse_device(dev) if dev else memory._C.parse_device("")
    shape_t = _checks.shape("shape", shape)
    as_torch = _is_torch_dtype(dtype)
    key = (shape_t, memory.dtype_name(dtype), dev, as_torch)
    with _lock:
        p = _pool(pool_id)
        cached = p.free.get(key)
        if cached:
            t = cached.pop()
            del p.order[id(t)]
            p.cached_bytes -= _nbytes(t)
            p.hits += 1
        else:
            t = None
            p.misses += 1
    if t is None:
        t = memory.empty(shape_t, key[1], dev)
        if as_torch:
            import torch

            t = torch.from_dlpack(t)
    with _lock:
        p.out[id(t)] = t
        p.keys[id(t)] = key
        # ids of dropped tensors: their keys entries are pruned as the map turns over
        if len(p.keys) > 2 * len(p.out) + 64:
            p.keys = {i: k for i, k in p.keys.items() if i in p.out}
    return t


def return_to_pool(tensor, pool_id: str = "default") -> None:
    """Hands `tensor` (from allocate_tensor(..., pool_id)) back for reuse.
    The caller must not use it afterwards. A tensor the pool did not give out
    raises MemoryAllocationError; past the pool's bound the least recently
    returned tensors are released to the device pool."""
    with _lock:
        p = _pool(pool_id)
        if p.out.get(id(tensor)) is not tensor:
            owner = next((n for n, q in _pools.items() if q.out.get(id(tensor)) is tensor), None)
            where = f"; it came from pool {owner!r}" if owner else ""
            raise MemoryAllocationError(
                f"return_to_pool: this {type(tensor).__name__} was not given out by pool {pool_id!r} "
                f"(or was already returned){where}")
        del p.out[id(tensor)]
        key = p.keys.pop(id(tensor))
        n = _nbytes(tensor)
        p.returns += 1
        if n > p.max_cached_bytes or p.max_cached_tensors == 0:
            p.evictions += 1  # larger than the whole pool: straight back to the device pool
            return
        p.free[key].append(tensor)
        p.order[id(tensor)] = key
        p.cached_bytes += n
        while p.cached_bytes > p.max_cached_bytes or len(p.order) > p.max_cached_tensors:
            _evict_oldest(p)


def _evict_oldest(p: _Pool) -> None:
    tid, key = p.order.popitem(last=False)
    bucket = p.free[key]
    i = next(i for i, t in enumerate(bucket) if id(t) == tid)
    t = bucket.pop(i)
    if not bucket:
        del p.free[key]
    p.cached_bytes -= _nbytes(t)
    p.evictions += 1


def clear_pool(pool_id: Optional[str] = None) -> None:
    """Releases the cached tensors of `pool_id` (None: of every pool) to the
    device pools; tensors still given out are unaffected."""
    with _lock:
        for name in list(_pools) if pool_id is None else [pool_id]:
            p = _pools.get(name)
            if p is None:
                continue
            p.free.clear()
            p.order.clear()
            p.cached_bytes = 0


def set_pool_limits(pool_id: str, max_cached_bytes: Optional[int] = None,
                    max_cached_tensors: Optional[int] = None) -> None:
    """Bounds what pool `pool_id` caches (evicting at once if it is over)."""
    with _lock:
        p = _pool(pool_id)
        if max_cached_bytes is not None:
            max_cached_bytes = _checks.integer("max_cached_bytes", max_cached_bytes)  # no int(1.7), no int("3")
            if max_cached_bytes < 0:
                raise InvalidArgumentError(f"max_cached_bytes must be >= 0, got {max_cached_bytes}")
            p.max_cached_bytes = int(max_cached_bytes)
        if max_cached_tensors is not None:
            max_cached_tensors = _checks.integer("max_cached_tensors", max_cached_tensors)
            if max_cached_tensors < 0:
                raise InvalidArgumentError(f"max_cached_tensors must be >= 0, got {max_cached_tensors}")
            p.max_cached_tensors = int(max_cached_tensors)
        while p.order and (p.cached_bytes > p.max_cached_bytes or len(p.order) > p.max_cached_tensors):
            _evict_oldest(p)


def pool_stats(pool_id: Optional[str] = None) -> Dict[str, Any]:
    """Per named pool: hits, misses, returns, evictions, cached_tensors,
    cached_bytes, outstanding (given out, not returned, still alive) and the
    bounds. With pool_id, that pool's dict alone."""
    with _lock:
        out = {}
        for name, p in _pools.items():
            out[name] = {"hits": p.hits, "misses": p.misses, "returns": p.returns, "evictions": p.evictions,
                         "cached_tensors": len(p.order), "cached_bytes": p.cached_bytes,
                         "outstanding": len(p.out), "max_cached_bytes": p.max_cached_bytes,
                         "max_cached_tensors": p.max_cached_tensors}
    if pool_id is not None:
        if pool_id not in out:
            raise InvalidArgumentError(f"no pool {pool_id!r}; pools: {sorted(out) or 'none'}")
        return out[pool_id]
    return out


def get_memory_stats(device=None) -> Dict[str, Any]:
    """memory_stats(device) plus allocated_gb / reserved_gb (current, GiB),
    peak_allocated_gb and the named pools' pool_stats() under "pools"."""
    stats: Dict[str, Any] = memory.memory_stats(device)
    stats["allocated_gb"] = stats["allocated_bytes.all.current"] / _GB
    stats["reserved_gb"] = stats["reserved_bytes.all.current"] / _GB
    stats["peak_allocated_gb"] = stats["allocated_bytes.all.peak"] / _GB
    stats["pools"] = pool_stats()
    return stats


__all__ = ["allocate_tensor", "return_to_pool", "clear_pool", "set_pool_limits", "pool_stats", "get_memory_stats",
           "POOL_MAX_CACHED_BYTES", "POOL_MAX_CACHED_TENSORS"]
