"""Journal records as typed values: one schema for the namespace, the store and the codec. Pure.

Every change the journal can hold is one record type below: the namespace
reports each mutation as one (`Namespace.observer`), the store keeps them in
order and adds a `Content` at each close or fsync, the codec (journal.py)
turns them into bytes and back, and replay applies them (durable.py).

Each record is a NamedTuple whose first field is its op name, filled in by
the constructor: ``Make(parent, name, ...)`` builds
``("make", parent, name, ...)``. So fields are read by name
(``rec.ino``), and a record is equal to the plain tuple of the same values
(which the codec's tests write by hand).

`SCHEMA` lists, per type: its type byte on the device, its op name, its
class, and its fields with their codec kinds (docs/FORMAT.md, "Records"):
``Q q I`` struct codes, ``s`` bytes with a u16 length, ``S`` bytes with a u32
length, ``u`` an optional u32, ``t`` an optional i64, ``X`` a list of
``(chunk index, Extent)``, ``D`` a list of ``(Extent, digest)`` (32-byte digests).
"""
from __future__ import annotations

from typing import NamedTuple


class Extent(NamedTuple):
    """Where one chunk of a file is stored: `length` valid bytes in data unit `unit` of device
    `dev`, whose crc32c is `crc`."""
    dev: int
    unit: int
    length: int
    crc: int


# type byte, op, class name, "field:kind ..."
_TABLE = [
    (1, "make", "Make", "parent:Q name:s mode:I uid:I gid:I rdev:Q target:s ino:Q time:q"),
    (2, "link", "Link", "ino:Q parent:Q name:s time:q"),
    (3, "unlink", "Unlink", "parent:Q name:s time:q"),
    (4, "rmdir", "Rmdir", "parent:Q name:s time:q"),
    (5, "rename", "Rename", "old_parent:Q old_name:s new_parent:Q new_name:s flags:I time:q"),
    (6, "setattr", "Setattr", "ino:Q mode:u uid:u gid:u atime:t mtime:t ctime:q"),
    (7, "setxattr", "Setxattr", "ino:Q name:s value:S"),
    (8, "removexattr", "Removexattr", "ino:Q name:s"),
    (9, "content", "Content", "ino:Q size:Q mtime:q ctime:q extents:X"),
    (10, "attrs", "Attrs", "ino:Q mode:I uid:I gid:I atime:q mtime:q ctime:q"),
    (11, "begin", "Begin", "epoch:Q next_ino:Q"),
    (12, "snapend", "Snapend", ""),
    (13, "stamp", "Stamp", "time:q"),
    (14, "digests", "Digests", "items:D"),
]


class RecordType(NamedTuple):
    """One record type of `SCHEMA`: its type byte, op name, class, field names and their codec
    kinds. Built once from the table above."""
    type: int  # the type byte on the device
    op: str
    cls: type
    fields: tuple[str, ...]
    kinds: str  # one codec kind per field


def _record_class(op: str, name: str, fields: list[str]) -> type:
    base = NamedTuple(f"_{name}", [("op", str)] + [(f, object) for f in fields])

    def __new__(cls, *args, **kwargs):
        return base.__new__(cls, op, *args, **kwargs)

    return type(name, (base,), {"__slots__": (), "__new__": __new__, "OP": op,
                                "__doc__": f"The `{op}` record: ({', '.join(fields)})."})


SCHEMA: dict[str, RecordType] = {}
for _type, _op, _name, _spec in _TABLE:
    _pairs = [f.split(":") for f in _spec.split()]
    _cls = _record_class(_op, _name, [p[0] for p in _pairs])
    SCHEMA[_op] = RecordType(_type, _op, _cls, tuple(p[0] for p in _pairs), "".join(p[1] for p in _pairs))
BY_TYPE: dict[int, RecordType] = {t.type: t for t in SCHEMA.values()}

# the classes, by name
Make: type = SCHEMA["make"].cls
Link: type = SCHEMA["link"].cls
Unlink: type = SCHEMA["unlink"].cls
Rmdir: type = SCHEMA["rmdir"].cls
Rename: type = SCHEMA["rename"].cls
Setattr: type = SCHEMA["setattr"].cls
Setxattr: type = SCHEMA["setxattr"].cls
Removexattr: type = SCHEMA["removexattr"].cls
Content: type = SCHEMA["content"].cls
Attrs: type = SCHEMA["attrs"].cls
Begin: type = SCHEMA["begin"].cls
Snapend: type = SCHEMA["snapend"].cls
Stamp: type = SCHEMA["stamp"].cls
Digests: type = SCHEMA["digests"].cls


def typed(rec: tuple) -> tuple:
    """The typed record for a plain tuple ``(op, *fields)`` (a typed record is returned as it is)."""
    if type(rec) is not tuple:
        return rec
    try:
        rt = SCHEMA[rec[0]]
    except (KeyError, IndexError):
        raise ValueError(f"not a journal record: {rec[:2]!r}") from None
    if len(rec) - 1 != len(rt.fields):
        raise ValueError(f"{rt.op} takes {len(rt.fields)} fields, got {len(rec) - 1}")
    return rt.cls(*rec[1:])
