"""The pyarrow and Spark schemas are derived from one definition and agree."""

import pytest
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.types import MapType, StructType

from schemas import ALL_TABLES, HALF, OP
from schemas.arrow import arrow_schema
from schemas.spark import spark_schema


def _shape(schema: StructType):
    """Name, type and nullability — map value nullability aside (Arrow has none to give)."""
    out = []
    for f in schema.fields:
        t = f.dataType
        if isinstance(t, MapType):
            t = MapType(t.keyType, t.valueType, True)
        out.append((f.name, t.simpleString(), f.nullable))
    return out


@pytest.mark.parametrize("table", ALL_TABLES, ids=lambda t: t.path)
def test_arrow_and_spark_schemas_agree(table):
    assert _shape(from_arrow_schema(arrow_schema(table))) == _shape(spark_schema(table))


def test_the_documented_column_names_are_fixed():  # docs/protocol.md §2
    assert HALF.names[:13] == [
        "half_offset",
        "transaction_id",
        "msg_id",
        "producer_group",
        "topic",
        "queue_id",
        "tags",
        "keys",
        "body",
        "properties",
        "born_ms",
        "store_ms",
        "check_immunity_s",
    ]
    assert OP.names == [
        "op_offset",
        "half_offset",
        "transaction_id",
        "producer_group",
        "action",
        "source",
        "store_ms",
        "remark",
    ]
