"""The FUSE kernel ABI: opcodes, flags and struct layouts (pure: no I/O).

Everything here mirrors the kernel's ``include/uapi/linux/fuse.h`` (protocol
7.x). Every struct is a `struct.Struct` in native byte order with standard
sizes and no implicit padding (``=``): the kernel pads its structs explicitly,
so the sizes here are the kernel's, and `SIZES` lists the ones the tests pin
against the numbers checked on the kernel (fuse_in_header 40, fuse_write_in 40,
fuse_attr 88, fuse_entry_out 128, ...).

Requests are typed in `requests.py` and parsed in `parse.py`, replies encoded in `replies.py`, INIT
negotiated in `negotiate.py`; this module only names numbers and layouts.

Flags above bit 31 (``FUSE_SECURITY_CTX`` and up) travel in the ``flags2``
word of INIT, enabled by ``FUSE_INIT_EXT``; here they are plain 64-bit masks
and `negotiate.py` splits them.
"""
from __future__ import annotations

import enum
import struct

KERNEL_VERSION = 7
# The minor version this codec speaks: 7.40 added fuse_open_out.backing_id
# (passthrough); nothing we parse changes layout after it.
KERNEL_MINOR = 40
ROOT_ID = 1
PAGE_SIZE = 4096
# The kernel's default request size without FUSE_MAX_PAGES: 32 pages.
DEFAULT_MAX_PAGES = 32
# A read of /dev/fuse must offer at least this many bytes (and max_write + 80).
MIN_READ_BUFFER = 8192
XATTR_SIZE_MAX = 65536
NAME_MAX = 255
PATH_MAX = 4096


class Op(enum.IntEnum):
    """Request opcodes (enum fuse_opcode)."""

    LOOKUP = 1
    FORGET = 2  # no reply
    GETATTR = 3
    SETATTR = 4
    READLINK = 5
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    SETXATTR = 21
    GETXATTR = 22
    LISTXATTR = 23
    REMOVEXATTR = 24
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    READDIR = 28
    RELEASEDIR = 29
    FSYNCDIR = 30
    GETLK = 31
    SETLK = 32
    SETLKW = 33
    ACCESS = 34
    CREATE = 35
    INTERRUPT = 36
    BMAP = 37
    DESTROY = 38
    IOCTL = 39
    POLL = 40
    NOTIFY_REPLY = 41
    BATCH_FORGET = 42  # no reply
    FALLOCATE = 43
    READDIRPLUS = 44
    RENAME2 = 45
    LSEEK = 46
    COPY_FILE_RANGE = 47
    SETUPMAPPING = 48
    REMOVEMAPPING = 49
    SYNCFS = 50
    TMPFILE = 51
    STATX = 52
    COPY_FILE_RANGE_64 = 53  # 7.45: the same request, a 64-bit count in the reply


# ---- INIT flags (fuse_init_in/out.flags; bits 32.. are flags2 << 32) ------------
FUSE_ASYNC_READ = 1 << 0
FUSE_POSIX_LOCKS = 1 << 1
FUSE_FILE_OPS = 1 << 2
FUSE_ATOMIC_O_TRUNC = 1 << 3
FUSE_EXPORT_SUPPORT = 1 << 4
FUSE_BIG_WRITES = 1 << 5
FUSE_DONT_MASK = 1 << 6
FUSE_SPLICE_WRITE = 1 << 7
FUSE_SPLICE_MOVE = 1 << 8
FUSE_SPLICE_READ = 1 << 9
FUSE_FLOCK_LOCKS = 1 << 10
FUSE_HAS_IOCTL_DIR = 1 << 11
FUSE_AUTO_INVAL_DATA = 1 << 12
FUSE_DO_READDIRPLUS = 1 << 13
FUSE_READDIRPLUS_AUTO = 1 << 14
FUSE_ASYNC_DIO = 1 << 15
FUSE_WRITEBACK_CACHE = 1 << 16
FUSE_NO_OPEN_SUPPORT = 1 << 17
FUSE_PARALLEL_DIROPS = 1 << 18
FUSE_HANDLE_KILLPRIV = 1 << 19
FUSE_POSIX_ACL = 1 << 20
FUSE_ABORT_ERROR = 1 << 21
FUSE_MAX_PAGES = 1 << 22
FUSE_CACHE_SYMLINKS = 1 << 23
FUSE_NO_OPENDIR_SUPPORT = 1 << 24
FUSE_EXPLICIT_INVAL_DATA = 1 << 25
FUSE_MAP_ALIGNMENT = 1 << 26
FUSE_SUBMOUNTS = 1 << 27
FUSE_HANDLE_KILLPRIV_V2 = 1 << 28
FUSE_SETXATTR_EXT = 1 << 29
FUSE_INIT_EXT = 1 << 30
FUSE_INIT_RESERVED = 1 << 31
FUSE_SECURITY_CTX = 1 << 32
FUSE_HAS_INODE_DAX = 1 << 33
FUSE_CREATE_SUPP_GROUP = 1 << 34
FUSE_HAS_EXPIRE_ONLY = 1 << 35
FUSE_DIRECT_IO_ALLOW_MMAP = 1 << 36
FUSE_PASSTHROUGH = 1 << 37
FUSE_NO_EXPORT_SUPPORT = 1 << 38
FUSE_HAS_RESEND = 1 << 39
FUSE_ALLOW_IDMAP = 1 << 40
FUSE_OVER_IO_URING = 1 << 41

# ---- fuse_open_out.open_flags -----------------------------------------------------
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NONSEEKABLE = 1 << 2
FOPEN_CACHE_DIR = 1 << 3
FOPEN_STREAM = 1 << 4
FOPEN_NOFLUSH = 1 << 5
FOPEN_PARALLEL_DIRECT_WRITES = 1 << 6
FOPEN_PASSTHROUGH = 1 << 7

# ---- fuse_setattr_in.valid ---------------------------------------------------------
FATTR_MODE = 1 << 0
FATTR_UID = 1 << 1
FATTR_GID = 1 << 2
FATTR_SIZE = 1 << 3
FATTR_ATIME = 1 << 4
FATTR_MTIME = 1 << 5
FATTR_FH = 1 << 6
FATTR_ATIME_NOW = 1 << 7
FATTR_MTIME_NOW = 1 << 8
FATTR_LOCKOWNER = 1 << 9
FATTR_CTIME = 1 << 10
FATTR_KILL_SUIDGID = 1 << 11

# ---- per-request flags ---------------------------------------------------------------
FUSE_GETATTR_FH = 1 << 0           # fuse_getattr_in.getattr_flags: fh is valid
FUSE_RELEASE_FLUSH = 1 << 0        # fuse_release_in.release_flags
FUSE_RELEASE_FLOCK_UNLOCK = 1 << 1
FUSE_WRITE_CACHE = 1 << 0          # fuse_write_in.write_flags
FUSE_WRITE_LOCKOWNER = 1 << 1
FUSE_WRITE_KILL_SUIDGID = 1 << 2   # (alias FUSE_WRITE_KILL_PRIV) kill suid/sgid on this write
FUSE_READ_LOCKOWNER = 1 << 1       # fuse_read_in.read_flags
FUSE_FSYNC_FDATASYNC = 1 << 0      # fuse_fsync_in.fsync_flags
FUSE_OPEN_KILL_SUIDGID = 1 << 0    # fuse_open_in / fuse_create_in .open_flags
FUSE_SETXATTR_ACL_KILL_SGID = 1 << 0
FUSE_ATTR_SUBMOUNT = 1 << 0        # fuse_attr.flags
FUSE_ATTR_DAX = 1 << 1
# The high bit of fuse_in_header.unique marks a resent request (FUSE_HAS_RESEND only).
FUSE_UNIQUE_RESEND = 1 << 63
# INTERRUPT requests carry the interrupted request's unique with this bit set.
FUSE_INT_REQ_BIT = 1 << 0


# ---- /dev/fuse ioctls (_IOR/_IOW with magic 229) --------------------------------------
def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (229 << 8) | nr


_IOC_WRITE, _IOC_READ = 1, 2
FUSE_DEV_IOC_CLONE = _ioc(_IOC_READ, 0, 4)               # 0x8004E500, arg: u32 session fd
FUSE_DEV_IOC_BACKING_OPEN = _ioc(_IOC_WRITE, 1, 16)      # 0x4010E501, arg: fuse_backing_map
FUSE_DEV_IOC_BACKING_CLOSE = _ioc(_IOC_WRITE, 2, 4)      # 0x4004E502, arg: u32 backing id


# ---- struct layouts --------------------------------------------------------------------
IN_HEADER = struct.Struct("=IIQQIIIHH")   # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, pad
OUT_HEADER = struct.Struct("=IiQ")        # len, error (-errno), unique
# ino size blocks atime mtime ctime, atimensec mtimensec ctimensec, mode nlink uid gid rdev blksize flags
ATTR = struct.Struct("=QQQQQQIIIIIIIIII")
ENTRY_OUT_HEAD = struct.Struct("=QQQQII")  # nodeid generation entry_valid attr_valid entry_nsec attr_nsec
ATTR_OUT_HEAD = struct.Struct("=QII")      # attr_valid attr_valid_nsec dummy
OPEN_OUT = struct.Struct("=QIi")          # fh open_flags backing_id
WRITE_OUT = struct.Struct("=II")          # size padding
GETXATTR_OUT = struct.Struct("=II")       # size padding
KSTATFS = struct.Struct("=QQQQQIIII6I")   # blocks bfree bavail files ffree bsize namelen frsize pad spare[6]
LSEEK_OUT = struct.Struct("=Q")
COPY_FILE_RANGE_OUT = struct.Struct("=Q")  # bytes_copied (COPY_FILE_RANGE_64)
INIT_IN = struct.Struct("=IIIII")         # major minor max_readahead flags flags2 (then unused[11])
INIT_IN_V1 = struct.Struct("=IIII")       # before 7.36 the kernel sent only these 16 bytes
INIT_IN_SIZE = 64
INIT_OUT = struct.Struct("=IIIIHHIIHHII24x")  # ... max_pages map_alignment flags2 max_stack_depth unused[6]
FORGET_IN = struct.Struct("=Q")
BATCH_FORGET_IN = struct.Struct("=II")    # count dummy
FORGET_ONE = struct.Struct("=QQ")         # nodeid nlookup
GETATTR_IN = struct.Struct("=IIQ")        # getattr_flags dummy fh
SETATTR_IN = struct.Struct("=IIQQQQQQIIIIIIII")  # valid pad fh size lock_owner atime mtime ctime
#                                                 atimensec mtimensec ctimensec mode unused4 uid gid unused5
MKNOD_IN = struct.Struct("=IIII")         # mode rdev umask padding
MKDIR_IN = struct.Struct("=II")           # mode umask
RENAME_IN = struct.Struct("=Q")           # newdir
RENAME2_IN = struct.Struct("=QII")        # newdir flags padding
LINK_IN = struct.Struct("=Q")             # oldnodeid
OPEN_IN = struct.Struct("=II")            # flags open_flags
CREATE_IN = struct.Struct("=IIII")        # flags mode umask open_flags
RELEASE_IN = struct.Struct("=QIIQ")       # fh flags release_flags lock_owner
FLUSH_IN = struct.Struct("=QIIQ")         # fh unused padding lock_owner
READ_IN = struct.Struct("=QQIIQII")       # fh offset size read_flags lock_owner flags padding
WRITE_IN = struct.Struct("=QQIIQII")      # fh offset size write_flags lock_owner flags padding
FSYNC_IN = struct.Struct("=QII")          # fh fsync_flags padding
SETXATTR_IN = struct.Struct("=II")        # size flags
SETXATTR_IN_EXT = struct.Struct("=IIII")  # size flags setxattr_flags padding (FUSE_SETXATTR_EXT)
GETXATTR_IN = struct.Struct("=II")        # size padding (GETXATTR and LISTXATTR)
ACCESS_IN = struct.Struct("=II")          # mask padding
INTERRUPT_IN = struct.Struct("=Q")        # unique
LSEEK_IN = struct.Struct("=QQII")         # fh offset whence padding
FALLOCATE_IN = struct.Struct("=QQQII")    # fh offset length mode padding
COPY_FILE_RANGE_IN = struct.Struct("=QQQQQQQ")  # fh_in off_in nodeid_out fh_out off_out len flags
SYNCFS_IN = struct.Struct("=Q")           # padding
DIRENT = struct.Struct("=QQII")           # ino off namelen type, then the name, padded to 8
BACKING_MAP = struct.Struct("=iIQ")       # fd flags padding

ATTR_SIZE = ATTR.size
ENTRY_OUT_SIZE = ENTRY_OUT_HEAD.size + ATTR.size
ATTR_OUT_SIZE = ATTR_OUT_HEAD.size + ATTR.size
STATFS_OUT_SIZE = KSTATFS.size
# The header room a WRITE needs before its payload: fuse_in_header + fuse_write_in.
WRITE_HEADER_SIZE = IN_HEADER.size + WRITE_IN.size

# Sizes checked on the kernel (field notes); tests assert every layout against them.
SIZES = {
    "fuse_in_header": 40, "fuse_out_header": 16, "fuse_write_in": 40, "fuse_read_in": 40,
    "fuse_attr": 88, "fuse_entry_out": 128, "fuse_attr_out": 104, "fuse_open_out": 16,
    "fuse_init_out": 64, "fuse_kstatfs": 80, "fuse_setattr_in": 88, "fuse_dirent": 24,
    "fuse_release_in": 24, "fuse_flush_in": 24, "fuse_create_in": 16, "fuse_mknod_in": 16,
    "fuse_rename2_in": 16, "fuse_fallocate_in": 32, "fuse_lseek_in": 24, "fuse_backing_map": 16,
    "fuse_copy_file_range_in": 56, "fuse_copy_file_range_out": 8,
}


def align8(n: int) -> int:
    """`n` rounded up to the next multiple of 8 (FUSE_REC_ALIGN / FUSE_DIRENT_ALIGN)."""
    return (n + 7) & ~7
