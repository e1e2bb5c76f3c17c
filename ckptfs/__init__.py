"""ckptfs: a FUSE checkpoint filesystem that absorbs writes into memory and
stripes them to NVMe devices in the background (FastPersist for unchanged code).

Optional helpers for training code (see ckptfs/ops/api.py)::

    ckptfs.state(path)                       # 'memory', 'draining', 'durable' or 'failed:EIO'
    ckptfs.wait_durable(path, timeout=None)  # returns once durable; raises DrainFailed or WaitTimeout
    ckptfs.wait_replicated(path, timeout=None)  # ... once in the object store too (mount --replicate)
"""

__version__ = "0.1.0"
__all__ = ["state", "wait_durable", "wait_replicated", "DrainFailed", "WaitTimeout", "NotOnCkptfs"]


def __getattr__(name: str):
    # imported on first use, so `import ckptfs` stays cheap for code that never asks
    if name in __all__:
        from .ops import api
        return getattr(api, name)
    raise AttributeError(f"module 'ckptfs' has no attribute {name!r}")
