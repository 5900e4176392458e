"""pyarrow schemas derived from `schemas.tables` (the broker core's side)."""

from __future__ import annotations

import pyarrow as pa

from schemas.tables import TableSchema

_SCALARS = {
    "bigint": pa.int64(),
    "int": pa.int32(),
    "string": pa.string(),
    "binary": pa.binary(),
    "boolean": pa.bool_(),
}


def arrow_type(type_name: str) -> pa.DataType:
    if type_name in _SCALARS:
        return _SCALARS[type_name]
    if type_name.startswith("map<") and type_name.endswith(">"):
        key, value = (t.strip() for t in type_name[4:-1].split(","))
        return pa.map_(arrow_type(key), arrow_type(value))
    if type_name.startswith("array<") and type_name.endswith(">"):
        return pa.list_(arrow_type(type_name[6:-1].strip()))
    raise ValueError(f"unsupported column type {type_name!r}")


def arrow_schema(table: TableSchema) -> pa.Schema:
    return pa.schema(
        [pa.field(c.name, arrow_type(c.type), nullable=c.nullable) for c in table.columns]
    )
