"""What every front end answers alike (pyfuse3_ops.py, native_ops.py).

ATTR_TIMEOUT: how long the kernel may cache an inode's attributes, in seconds. Both
front ends give the same value, so the kernel asks ckptfs as often with either engine.

ENTRY_TIMEOUT: how long the kernel may keep a name -> inode entry (a dentry) without asking
again: long, for the same reason as below (every namespace change comes through the kernel,
which updates its dentries itself); with 1 s, removing a checkpoint saved a few steps ago
cost a LOOKUP per file before each UNLINK.

A lookup of a name that does not exist answers a negative entry (nodeid 0) with the entry
timeout rather than ENOENT, so the kernel caches "no such name" too: Lightning's save path
stats its destination four times before creating it, each a round trip otherwise. Safe
because every change of the namespace reaches ckptfs through this kernel mount, which
drops a negative entry itself when it creates the name; ckptfs never adds a name behind
its back (a restore shows its tree before the first request).
"""
ATTR_TIMEOUT = 1.0
ENTRY_TIMEOUT = 60.0
