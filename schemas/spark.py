"""Spark StructTypes derived from `schemas.tables` (the job's side)."""

from __future__ import annotations

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DataType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

from schemas.tables import TableSchema

_SCALARS = {
    "bigint": LongType(),
    "int": IntegerType(),
    "string": StringType(),
    "binary": BinaryType(),
    "boolean": BooleanType(),
}


def spark_type(type_name: str) -> DataType:
    if type_name in _SCALARS:
        return _SCALARS[type_name]
    if type_name.startswith("map<") and type_name.endswith(">"):
        key, value = (t.strip() for t in type_name[4:-1].split(","))
        return MapType(spark_type(key), spark_type(value), valueContainsNull=True)
    if type_name.startswith("array<") and type_name.endswith(">"):
        return ArrayType(spark_type(type_name[6:-1].strip()), containsNull=True)
    raise ValueError(f"unsupported column type {type_name!r}")


def spark_schema(table: TableSchema) -> StructType:
    return StructType(
        [StructField(c.name, spark_type(c.type), nullable=c.nullable) for c in table.columns]
    )
