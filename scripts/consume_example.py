#!/usr/bin/env python3
"""A consumer of a real topic: print what was delivered, from a queue offset on.

    python scripts/consume_example.py --warehouse ./warehouse/demo --topic ORDER

Consumers need no Spark: `txn_core.consumer.read_topic` reads the topic's
Delta table with delta-rs. Spark users read it as any Delta table:
`spark.read.format("delta").load(f"{warehouse}/topics/ORDER")`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from txn_core.consumer import read_topic


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--warehouse", default="./warehouse")
    p.add_argument("--topic", required=True)
    p.add_argument("--queue-id", type=int)
    p.add_argument("--from-offset", type=int, default=0)
    args = p.parse_args(argv)
    for row in read_topic(
        args.warehouse, args.topic, queue_id=args.queue_id, from_queue_offset=args.from_offset
    ):
        print(
            f"queue {row['queue_id']} offset {row['queue_offset']:>4}  "
            f"keys={row['keys']!s:<12} tags={row['tags']!s:<10} "
            f"body={row['body'][:40]!r}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
