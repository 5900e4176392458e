"""What the broker core writes through delta-rs, Spark + Delta reads the same."""

from deltalake import DeltaTable

from txn_core import (
    Broker,
    LocalTransactionState,
    Message,
    TransactionListener,
    TransactionProducer,
)


class Commit(TransactionListener):
    def execute_local_transaction(self, msg, arg):
        return LocalTransactionState.COMMIT_MESSAGE

    def check_local_transaction(self, msg):
        return LocalTransactionState.COMMIT_MESSAGE


# Writer features delta-rs 1.6 can write; anything else on a producer table would
# lock the producers out (docs/protocol.md §2).
DELTA_RS_WRITABLE = {
    "appendOnly",
    "invariants",
    "checkConstraints",
    "changeDataFeed",
    "generatedColumns",
    "timestampNtz",
    "deletionVectors",
}


def _normalise(rows):
    return sorted(
        (
            {k: (dict(v) if k == "properties" and v is not None else v) for k, v in r.items()}
            for r in rows
        ),
        key=lambda r: (r["half_offset"], r.get("op_offset", 0)),
    )


def test_spark_reads_the_producer_tables_identically(spark, warehouse):
    with Broker.open(warehouse) as broker:
        producer = TransactionProducer(broker, "g", Commit())
        for i in range(3):
            producer.send_message_in_transaction(
                Message(
                    topic="ORDER",
                    body=bytes([0, i, 255]),
                    keys=f"k{i}",
                    properties={"a": str(i)},
                    check_immunity_s=i or None,
                )
            )
    for path in ("_sys/half", "_sys/op"):
        uri = f"{warehouse}/{path}"
        by_rs = DeltaTable(uri).to_pyarrow_table().to_pylist()
        by_spark = [r.asDict() for r in spark.read.format("delta").load(uri).collect()]
        for r in by_spark:
            if "body" in r:
                r["body"] = bytes(r["body"])
        assert len(by_rs) == 3
        assert _normalise(by_spark) == _normalise(by_rs)


def test_producer_tables_use_only_features_delta_rs_writes(spark, warehouse):
    Broker.open(warehouse).close()
    for path in ("_sys/half", "_sys/op", "_sys/check_answers"):
        protocol = DeltaTable(f"{warehouse}/{path}").protocol()
        assert set(protocol.writer_features or ()) <= DELTA_RS_WRITABLE
        assert protocol.min_writer_version <= 7
        detail = spark.sql(f"DESCRIBE DETAIL delta.`{warehouse}/{path}`").first()
        assert detail["properties"]["delta.enableChangeDataFeed"] == "true"
    # and delta-rs still writes them after Spark has read them
    with Broker.open(warehouse) as broker:
        TransactionProducer(broker, "g", Commit()).send_message_in_transaction(
            Message(topic="ORDER", body=b"x")
        )
