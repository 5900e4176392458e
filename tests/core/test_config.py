"""Configuration: flag > env > file > default, and refusal of bad values."""

import os
import re

import pytest

from txn_core.config import Config, ConfigError, as_config, load_config


def _toml(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_defaults_match_the_documented_ones():  # docs/protocol.md §6
    cfg = load_config(env={})
    assert (
        cfg.warehouse,
        cfg.transaction_timeout_ms,
        cfg.check_max,
        cfg.check_interval_ms,
        cfg.reserved_hours,
        cfg.max_checks_per_run,
        cfg.check_budget,
    ) == (os.path.abspath("./warehouse"), 6000, 15, 30000, 72, 0, "answered")


def test_a_relative_warehouse_becomes_absolute_and_an_s3_uri_one_for_both_engines(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    assert load_config(env={}, warehouse="./wh/demo").warehouse == str(tmp_path / "wh" / "demo")
    assert load_config(env={}, warehouse="s3://bucket/wh").warehouse == "s3a://bucket/wh"
    assert load_config(env={}, warehouse="s3a://bucket/wh/").warehouse == "s3a://bucket/wh"
    assert load_config(env={}, warehouse="file:///data/wh").warehouse == "file:///data/wh"
    assert (
        load_config(env={}, warehouse="abfss://c@acct.dfs.core.windows.net/wh").warehouse
        == "abfss://c@acct.dfs.core.windows.net/wh"
    )
    for odd, problem in [
        # `s3://bucket/$PREFIX/wh` with PREFIX empty: delta-rs' raw error at the first read
        ("s3://bucket//wh", "may not hold an empty, '.' or '..' part"),
        ("s3://bucket/a/./wh", "may not hold an empty, '.' or '..' part"),
        ("s3://bucket/a/..", "may not hold an empty, '.' or '..' part"),
        # `file://$WH` with WH empty was the path `file:`: the job's lease went to /_sys
        ("file://", "names no absolute path; expected file:///path"),
        ("file://tmp/wh", "names no absolute path"),
        ("gs://", "names no bucket or container; expected gs://bucket/prefix"),
        ("abfss://", "names no bucket or container"),
        # as Spark prints a location: it was a relative directory named `file:`
        ("file:/data/wh", "looks like a URI with one slash too few"),
        ("s3:/bucket/wh", "looks like a URI with one slash too few"),
        ("/data/wh ", "begins or ends with white space"),  # from `TXN_WAREHOUSE="$WH "`
    ]:
        with pytest.raises(ConfigError, match=re.escape(problem)):
            load_config(env={}, warehouse=odd)


def test_a_warehouse_under_home_is_the_users_home_as_in_a_shell(tmp_path, monkeypatch):
    """`warehouse = "~/wh"` in a TOML file was a directory named `~` under
    each process's working directory: producers and the job started in
    different places wrote to different warehouses."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    path = _toml(tmp_path, 'warehouse = "~/lakehouse/txn"\n')
    assert load_config(path, env={}).warehouse == str(tmp_path / "home" / "lakehouse" / "txn")
    with pytest.raises(ConfigError, match="home directory of a user this machine does not have"):
        load_config(env={}, warehouse="~no-such-user-here/wh")


def test_producers_and_consumers_find_a_warehouse_under_home_too(tmp_path, monkeypatch):
    from txn_core import Broker, Consumer
    from txn_core.consumer import read_topic

    from factories import deliver

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    with Broker.open("~/wh") as broker:
        assert broker.warehouse == str(tmp_path / "home" / "wh")
    deliver(str(tmp_path / "home" / "wh"), q0=range(2))
    assert [r["queue_offset"] for r in read_topic("~/wh", "ORDER")] == [0, 1]
    assert len(Consumer("~/wh", "billing", "ORDER").poll(10)) == 2
    assert not os.path.exists(tmp_path / "~")


def test_a_pathlib_path_names_a_warehouse_for_producers_and_consumers(tmp_path):
    from txn_core import Broker, Consumer
    from txn_core.consumer import read_topic

    from factories import deliver

    warehouse = tmp_path / "wh"
    with Broker.open(warehouse) as broker:  # was refused, and read_topic's a TypeError
        assert broker.warehouse == str(warehouse)
    deliver(str(warehouse), q0=range(2))
    assert [r["queue_offset"] for r in read_topic(warehouse, "ORDER")] == [0, 1]
    consumer = Consumer(warehouse, "billing", "ORDER")
    assert len(consumer.poll(10)) == 2
    consumer.commit()
    from txn_core.consumer_group import read_committed_offsets
    from txn_core.maintenance import maintain_consumer_tables

    assert read_committed_offsets(warehouse, "billing", "ORDER") == {0: 2}  # an AttributeError
    assert maintain_consumer_tables(warehouse, now_ms=0, vacuum=False).superseded_offset_rows == 0
    for config in (  # and so does every way of configuring one
        load_config(env={}, warehouse=warehouse),
        Config(warehouse=warehouse),
        as_config({"warehouse": warehouse}),
    ):
        assert config.warehouse == str(warehouse)


def test_a_file_with_a_byte_order_mark_loads_and_one_not_utf8_is_named(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbfcheck_max = 3\n")  # as some Windows editors save
    assert load_config(path, env={}).check_max == 3
    path.write_bytes(b"warehouse = '/caf\xe9'\n")  # Latin-1
    with pytest.raises(ConfigError, match="bom.toml' is not UTF-8 text"):
        load_config(path, env={})


def test_precedence_flag_over_env_over_file(tmp_path):
    path = _toml(tmp_path, 'check_max = 3\ncheck_interval_ms = 10\nwarehouse = "/f"\n')
    env = {"TXN_CHECK_MAX": "4", "TXN_CHECK_INTERVAL_MS": "20"}
    cfg = load_config(path, env=env, check_max=5, warehouse=None)
    assert cfg.check_max == 5  # flag
    assert cfg.check_interval_ms == 20  # env beats file
    assert cfg.warehouse == "/f"  # file beats default; a None flag is ignored


def test_repo_config_file_loads():
    assert load_config("conf/reconcile.toml", env={}) == Config()


@pytest.mark.parametrize(
    "text, words",
    [
        ("check_maxx = 3\n", ["check_maxx", "unknown"]),
        ('check_max = "3"\n', ["check_max", "str"]),
        ("check_max = true\n", ["check_max", "bool"]),
        ("check_max = -1\n", ["check_max", "out of range", "0 to 1000000"]),
        ('check_budget = "always"\n', ["check_budget", "'answered' or 'sent'"]),
        ("reserved_hours = 0\n", ["reserved_hours", "1 to 100000"]),
        ("max_batch_bytes = 0\n", ["max_batch_bytes", "1 to 1073741824"]),
        ("check_max = \n", ["not valid TOML"]),
    ],
)
def test_bad_file_values_name_the_key(tmp_path, text, words):
    with pytest.raises(ConfigError) as err:
        load_config(_toml(tmp_path, text), env={})
    for word in words:
        assert word in str(err.value)


def test_max_batch_bytes_follows_the_same_precedence(tmp_path):
    path = _toml(tmp_path, "max_batch_bytes = 1000\n")
    assert load_config(env={}).max_batch_bytes == 4 * 1024 * 1024  # RocketMQ's 4 MiB
    assert load_config(path, env={}).max_batch_bytes == 1000
    env = {"TXN_MAX_BATCH_BYTES": "2000"}
    assert load_config(path, env=env).max_batch_bytes == 2000
    assert load_config(path, env=env, max_batch_bytes=3000).max_batch_bytes == 3000
    with pytest.raises(ConfigError, match="TXN_MAX_BATCH_BYTES"):
        load_config(env={"TXN_MAX_BATCH_BYTES": "4MB"})


def test_bad_env_value_names_the_variable():
    with pytest.raises(ConfigError, match="TXN_CHECK_MAX"):
        load_config(env={"TXN_CHECK_MAX": "many"})


def test_a_misspelt_environment_variable_is_refused_with_the_key_it_nearly_names():
    """`TXN_WAREHOUS` was ignored, and the warehouse was ./warehouse instead."""
    for name, meant in [
        ("TXN_WAREHOUS", "TXN_WAREHOUSE"),
        ("TXN_WAREHOUSE_PATH", "TXN_WAREHOUSE"),
        ("TXN_S3_ENDPIONT", "TXN_S3_ENDPOINT"),
        ("TXN_SPARK_MASTR", "TXN_SPARK_MASTER"),  # the job ran on local[2] instead
    ]:
        with pytest.raises(ConfigError, match=f"{name} is not one .* did you mean {meant}\\?$"):
            load_config(env={name: "x"})
    others = {"TXN_SPARK_MASTER": "local[1]", "TXN_FAULT_AT": "x", "TXN_MY_OWN": "1"}
    assert load_config(env=others).check_max == Config().check_max  # not near any key


def test_a_file_with_keys_both_under_reconcile_and_beside_it_says_so(tmp_path):
    path = _toml(tmp_path, 'warehouse = "/f"\n[reconcile]\ncheck_max = 5\n')
    with pytest.raises(ConfigError, match=r"has a \[reconcile\] table and also warehouse: put"):
        load_config(path, env={})  # was: unknown configuration key 'reconcile'


def test_bad_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="transaction_timeout_ms"):
        load_config(env={}, transaction_timeout_ms=-5)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})
    with pytest.raises(ConfigError, match="cannot be read: Is a directory"):
        load_config(tmp_path, env={})  # was a raw IsADirectoryError
    with pytest.raises(ConfigError, match="bogus"):
        load_config(env={}, bogus=1)


def test_plain_dict_is_accepted_and_validated(tmp_path):
    assert as_config({"check_max": 2}).check_max == 2
    # a file's path, as operating.md passes one to reconcile_forever (was a raw ValueError)
    assert as_config(_toml(tmp_path, "check_max = 4\n")).check_max == 4
    with pytest.raises(ConfigError, match="a Config, a dict of its keys or a TOML file's path"):
        as_config(["check_max", 2])
    with pytest.raises(ConfigError, match="max_checks_per_run"):
        as_config({"max_checks_per_run": 1.5})
    assert Config()["check_budget"] == "answered"


def test_an_s3_client_is_made_once_per_store_settings_and_aws_environment(monkeypatch):
    """A run asks for an S3 client several times; making one costs tenths of
    a second, so the process keeps it, but a change of the AWS environment
    (other credentials) or of the store's settings gets a new one."""
    pytest.importorskip("boto3")
    from txn_core.storage import Storage

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "first")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    store = Storage(warehouse="s3a://bucket/wh", endpoint="http://127.0.0.1:9", path_style=True)
    client = store.s3_client()
    assert store.s3_client() is client
    assert (
        Storage(
            warehouse="s3a://bucket/other", endpoint="http://127.0.0.1:9", path_style=True
        ).s3_client()
        is client
    )
    assert (
        Storage(
            warehouse="s3a://bucket/wh", endpoint="http://127.0.0.1:8", path_style=True
        ).s3_client()
        is not client
    )
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "second")
    renewed = store.s3_client()
    assert renewed is not client
    assert renewed._request_signer._credentials.access_key == "second"
