"""What every front end answers alike (pyfuse3_ops.py, native_ops.py).

ATTR_TIMEOUT: how long the kernel may cache an entry or its attributes, in seconds. Both
front ends give the same value, so the kernel asks ckptfs as often with either engine.
"""
ATTR_TIMEOUT = 1.0
