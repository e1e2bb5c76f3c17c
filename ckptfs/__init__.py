"""ckptfs: a FUSE checkpoint filesystem that absorbs writes into memory and
stripes them to NVMe devices in the background (FastPersist for unchanged code)."""

__version__ = "0.1.0"
