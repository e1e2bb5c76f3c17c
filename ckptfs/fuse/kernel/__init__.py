"""A native FUSE engine: the kernel protocol spoken directly over /dev/fuse.

    abi.py        opcodes, flags, struct layouts of include/uapi/linux/fuse.h (pure)
    requests.py   the typed requests, one dataclass per opcode (pure)
    parse.py      bytes -> typed requests; RequestDecoder for byte streams (pure)
    replies.py    typed replies and their encoding; dirent packing (pure)
    negotiate.py  the INIT answer: flags, max_write / max_pages (pure)
    mount.py      mount(2) / fusermount3, unmount, FUSE_DEV_IOC_CLONE, the max_pages sysctl
    session.py    the server: worker threads on cloned descriptors, readv in, writev out,
                  dispatch to a handler object

docs/ENGINE.md describes the layers and the threading model.
"""
