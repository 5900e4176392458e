"""Configuration: one TOML format for every entry point (docs/protocol.md §6).

Precedence, highest first: explicit overrides (CLI flags, keyword arguments) >
environment variables `TXN_<KEY>` > the TOML file > defaults. Every value is
validated before anything touches a table; an error names the key, where the
value came from, and what is accepted.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

ENV_PREFIX = "TXN_"


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or out of range."""


def int_in_range(name: str, value: object, low: int, high: int) -> int:
    """`value`, an integer from `low` to `high`, else ConfigError naming `name`."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer from {low} to {high}; got {value!r}")
    return value


#: URI schemes a warehouse may have: S3 (both spellings are one store), and
#: the stores both engines reach with the user's own settings (ADLS, GCS)
S3_SCHEMES = ("s3", "s3a")
OTHER_SCHEMES = ("file", "abfss", "abfs", "gs")


#: characters a warehouse's path may not hold: delta-rs cannot open a path
#: with `|`, `[`, `]`, `^` or a backslash (it panics or looks elsewhere),
#: reads `%41` as an escape and, on S3, the rest of a path after `#` as a
#: URI's fragment (every table one and the same); Spark reads `{`, `}`, `*`,
#: `?` in a path as a pattern of file names
WAREHOUSE_FORBIDDEN_CHARACTERS = "%|[]^\\{}*?#"
#: an S3 prefix: the characters AWS calls safe in an object key but `*`;
#: delta-rs gives back an S3 table's URI with any other escaped (a space as
#: `%20`), and the job names the table's objects by that URI
_S3_PREFIX_RE = re.compile(r"^[A-Za-z0-9/!_.'()-]*\Z")


def absolute_warehouse(warehouse: str) -> str:
    """The warehouse in the one form both engines are given.

    A local path becomes absolute (and `~` its user's home): Spark's Delta
    table builder reads a relative location such as `./warehouse/_sys/runs`
    as a table name, and a relative path would mean another place for every
    process started elsewhere (a literal `~` directory too). An S3
    URI becomes `s3a://bucket/prefix`, which delta-rs and Spark's s3a
    connector both read. Any other scheme is refused, and so is a path with
    one of `WAREHOUSE_FORBIDDEN_CHARACTERS` (spaces and other characters
    are fine).

    >>> absolute_warehouse("s3://bucket/wh/")
    's3a://bucket/wh'
    """
    if not isinstance(warehouse, str) or not warehouse:
        # "" would be the current directory: an unset variable, not a choice
        raise ConfigError(f"warehouse must be a non-empty path or URI, got {warehouse!r}")
    if warehouse != warehouse.strip():
        raise ConfigError(
            f"warehouse {warehouse!r} begins or ends with white space, which would name "
            "another directory than the one meant"
        )
    forbidden = sorted({c for c in warehouse if c in WAREHOUSE_FORBIDDEN_CHARACTERS})
    if forbidden:
        raise ConfigError(
            f"warehouse {warehouse!r} holds {' '.join(forbidden)}, which delta-rs or Spark "
            "cannot read in a path; choose a path without any of "
            + " ".join(WAREHOUSE_FORBIDDEN_CHARACTERS)
        )
    if "://" not in warehouse and _SCHEME_RE.match(warehouse):
        raise ConfigError(
            f"warehouse {warehouse!r} looks like a URI with one slash too few (Spark "
            "prints file:/path); write file:///path, s3://bucket/prefix, or a plain path"
        )
    if "://" not in warehouse:
        # `~/wh` in a TOML file or a quoted variable: a shell would have expanded it
        local = os.path.expanduser(warehouse)
        if local.startswith("~"):
            raise ConfigError(
                f"warehouse {warehouse!r} names the home directory of a user this "
                "machine does not have"
            )
        return os.path.abspath(local)
    scheme, rest = warehouse.split("://", 1)
    if scheme.lower() in S3_SCHEMES:
        bucket = rest.split("/", 1)[0]
        if not bucket:
            raise ConfigError(
                f"warehouse {warehouse!r} names no bucket; expected s3://bucket/prefix"
            )
        prefix = rest.split("/", 1)[1] if "/" in rest else ""
        if not _S3_PREFIX_RE.match(prefix):
            raise ConfigError(
                f"warehouse {warehouse!r}: an S3 warehouse's prefix may hold only letters, "
                "digits and / ! - _ . ' ( ) (the characters AWS calls safe in an object key)"
            )
        parts = prefix.rstrip("/").split("/") if prefix.rstrip("/") else []
        if any(part in ("", ".", "..") for part in parts):
            raise ConfigError(
                f"warehouse {warehouse!r}: an S3 warehouse's prefix may not hold an empty, "
                "'.' or '..' part (an empty variable in `s3://bucket/$PREFIX/wh`?)"
            )
        return "s3a://" + rest.rstrip("/")
    if scheme.lower() not in OTHER_SCHEMES:
        raise ConfigError(
            f"warehouse {warehouse!r} has an unsupported scheme {scheme!r}; "
            "accepted: a local path, file://, s3://, s3a://, abfss://, gs://"
        )
    # file:///abs/path has an empty host; gs:// and abfss:// name a bucket or container
    named = rest.startswith("/") and rest.strip("/") if scheme.lower() == "file" else rest
    if not named or not named.split("/", 1)[0]:
        raise ConfigError(
            f"warehouse {warehouse!r} names no "
            + (
                "absolute path; expected file:///path"
                if scheme.lower() == "file"
                else "bucket or container; expected " + scheme + "://bucket/prefix"
            )
            + " (an empty variable in it?)"
        )
    return warehouse.rstrip("/")


#: `file:/path`, `s3:/bucket`: a URI's scheme with one slash too few
_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/")


#: RocketMQ's default `messageDelayLevel`
DEFAULT_DELAY_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_DURATION_RE = re.compile(r"^([0-9]{1,9})(ms|s|m|h|d)\Z")


def parse_delay_levels(text: str) -> tuple[int, ...]:
    """RocketMQ's `messageDelayLevel` format: durations separated by spaces,
    each a positive integer and a unit (ms, s, m, h, d), non-decreasing;
    ValueError otherwise.

    >>> parse_delay_levels("1s 5s 2m")
    (1000, 5000, 120000)
    """
    if not isinstance(text, str):
        raise ValueError(f"must be a string, got {type(text).__name__}")
    levels = []
    for word in text.split():
        match = _DURATION_RE.match(word)
        if match is None or int(match.group(1)) == 0:
            raise ValueError(f"{word!r} is not a positive duration such as 5s, 2m or 1h")
        levels.append(int(match.group(1)) * _UNIT_MS[match.group(2)])
    if not levels:
        raise ValueError("no level is given")
    if len(levels) > 1000:
        raise ValueError(f"{len(levels)} levels; at most 1000 are allowed")
    if any(b < a for a, b in zip(levels, levels[1:], strict=False)):
        raise ValueError("the levels must not decrease")
    return tuple(levels)


def _valid_levels(text: str) -> bool:
    try:
        parse_delay_levels(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Config:
    """Validated settings shared by the broker core and the job.

    >>> cfg = load_config(warehouse="/tmp/wh", check_max=3)
    >>> cfg.check_max, cfg["check_budget"]
    (3, 'answered')
    """

    warehouse: str = "./warehouse"
    transaction_timeout_ms: int = 6000
    check_max: int = 15
    check_interval_ms: int = 30000
    reserved_hours: int = 72
    max_checks_per_run: int = 0
    check_budget: str = "answered"
    #: largest message body accepted by the broker core (RocketMQ's 4 MiB default)
    max_body_bytes: int = 4 * 1024 * 1024
    #: largest plain batch (`Producer.send_batch`) the broker core accepts: the
    #: sum of its messages' sizes (`txn_core.message.message_size`), RocketMQ's 4 MiB
    max_batch_bytes: int = 4 * 1024 * 1024
    #: the least time between two commits of a producer's group-commit writer
    #: to one table: under load a commit carries that long's rows (fewer files
    #: and log entries for the job to read); 0 commits as soon as rows arrive
    group_commit_interval_ms: int = 10
    #: RocketMQ 4's delay levels (its `messageDelayLevel`): level n of
    #: `Message(delay_level=n)` is the n-th duration; a level above the last
    #: is the last (`delay_level_ms`)
    delay_levels: str = DEFAULT_DELAY_LEVELS
    #: the longest delay a message may ask for, by level, `delay_ms` or
    #: `deliver_at_ms` (RocketMQ 5's timerMaxDelaySec: 3 days)
    max_delay_ms: int = 3 * 24 * 3600 * 1000
    #: how long a topic table's log keeps an entry (its `delta.logRetentionDuration`,
    #: set by the job): how far behind a Spark stream or change-feed reader of a
    #: topic may fall (RocketMQ keeps its commit log 72 hours, `fileReservedTime`)
    topic_log_retention_hours: int = 72
    #: how long a job run's lease lasts without renewal (crashed runs free it after this)
    lease_ttl_s: int = 600
    #: an S3 warehouse's endpoint ("" = AWS's own), e.g. "http://127.0.0.1:9000" for MinIO
    s3_endpoint: str = ""
    #: an S3 warehouse's region ("" = AWS_REGION / AWS_DEFAULT_REGION, else us-east-1)
    s3_region: str = ""
    #: address buckets as endpoint/bucket/key instead of bucket.endpoint/key
    s3_path_style: bool = False
    #: allow a plain-HTTP endpoint (a store on loopback); refused otherwise
    s3_allow_http: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.warehouse, os.PathLike):
            object.__setattr__(self, "warehouse", os.fspath(self.warehouse))
        for f in fields(self):
            _check(f.name, getattr(self, f.name), "value")
        object.__setattr__(self, "warehouse", absolute_warehouse(self.warehouse))
        if self.s3_endpoint.startswith("http://") and not self.s3_allow_http:
            raise ConfigError(
                f"s3_endpoint {self.s3_endpoint!r} is plain HTTP; set "
                "s3_allow_http = true to allow it (a store on loopback)"
            )

    @property
    def delay_level_ms(self) -> tuple[int, ...]:
        """`delay_levels` in milliseconds, level 1 first.

        >>> Config(warehouse="/tmp/wh").delay_level_ms[:5]
        (1000, 5000, 10000, 30000, 60000)
        """
        return parse_delay_levels(self.delay_levels)

    def __getitem__(self, key: str) -> Any:  # dict-style access for notebooks
        if key not in _SPECS:
            raise KeyError(key)
        return getattr(self, key)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], origin: str = "mapping") -> Config:
        """Build from a plain dict of configuration keys (missing keys take defaults)."""
        _check_all(values, origin)
        return cls(**dict(values))


# key -> (type, validator, description of the accepted range)
_SPECS: dict[str, tuple[type, Callable[[Any], bool], str]] = {
    "warehouse": (str, lambda v: bool(v.strip()), "a non-empty path or URI"),
    "transaction_timeout_ms": (int, lambda v: 0 <= v <= 2**40, "an integer from 0 to 2^40 (ms)"),
    "check_max": (int, lambda v: 0 <= v <= 1_000_000, "an integer from 0 to 1000000"),
    "check_interval_ms": (int, lambda v: 0 <= v <= 2**40, "an integer from 0 to 2^40 (ms)"),
    "reserved_hours": (int, lambda v: 1 <= v <= 100_000, "an integer from 1 to 100000 (hours)"),
    "max_checks_per_run": (
        int,
        lambda v: 0 <= v <= 2**31 - 1,
        "an integer from 0 (no cap) to 2147483647",
    ),
    "check_budget": (str, lambda v: v in ("answered", "sent"), "'answered' or 'sent'"),
    "max_body_bytes": (
        int,
        lambda v: 1 <= v <= 256 * 1024 * 1024,
        "an integer from 1 to 268435456 (bytes)",
    ),
    "max_batch_bytes": (
        int,
        lambda v: 1 <= v <= 1024 * 1024 * 1024,
        "an integer from 1 to 1073741824 (bytes)",
    ),
    "group_commit_interval_ms": (int, lambda v: 0 <= v <= 1000, "an integer from 0 to 1000 (ms)"),
    "delay_levels": (
        str,
        _valid_levels,
        "durations separated by spaces, each a positive integer and a unit "
        '(ms, s, m, h, d), not decreasing, e.g. "1s 5s 10s 30s 1m"',
    ),
    "max_delay_ms": (int, lambda v: 1 <= v <= 2**40, "an integer from 1 to 2^40 (ms)"),
    "topic_log_retention_hours": (
        int,
        lambda v: 1 <= v <= 100_000,
        "an integer from 1 to 100000 (hours)",
    ),
    "lease_ttl_s": (int, lambda v: 1 <= v <= 7 * 24 * 3600, "an integer from 1 to 604800 (s)"),
    "s3_endpoint": (
        str,
        lambda v: v == "" or v.startswith(("http://", "https://")),
        '"" (AWS) or an http:// or https:// URL',
    ),
    "s3_region": (
        str,
        lambda v: v == "" or v.replace("-", "").isalnum(),
        '"" (from the environment) or a region name such as eu-west-1',
    ),
    "s3_path_style": (bool, lambda v: True, "true or false"),
    "s3_allow_http": (bool, lambda v: True, "true or false"),
}

_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _check_all(values: Mapping[str, Any], origin: str) -> None:
    """Refuse unknown keys and bad values, naming where they came from."""
    unknown = sorted(set(values) - set(_SPECS))
    if unknown:
        raise ConfigError(
            f"unknown configuration key(s) {', '.join(map(repr, unknown))} "
            f"in {origin}; known keys: {', '.join(_SPECS)}"
        )
    for key, value in values.items():
        _check(key, value, origin)


def _check(key: str, value: Any, origin: str) -> None:
    kind, ok, accepted = _SPECS[key]
    if key == "warehouse" and isinstance(value, os.PathLike):
        value = os.fspath(value)  # as Broker.open and the consumers take one
    # bool is an int in Python; `check_max = true` is still a mistake.
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ConfigError(
            f"{key} from {origin} must be {accepted}; got {type(value).__name__} {value!r}"
        )
    if not ok(value):
        why = ""
        if key == "delay_levels":
            try:
                parse_delay_levels(str(value))
            except ValueError as exc:
                why = f" ({exc})"
        raise ConfigError(
            f"{key} from {origin} is out of range: {value!r}{why}; accepted: {accepted}"
        )


#: the project's `TXN_*` environment variables that are not configuration keys
OTHER_ENV = frozenset(
    {"TXN_SPARK_MASTER", "TXN_SPARK_LOG_LEVEL", "TXN_SUBMIT_ARGS", "TXN_FAULT_AT", "TXN_FAULT_MODE"}
)


def _refuse_misspelt_env(env: Mapping[str, str]) -> None:
    """A `TXN_*` variable that is no key but nearly one, or a key's name
    extended (`TXN_WAREHOUSE_PATH`), is a typo that would leave its key at
    the default (`TXN_WAREHOUS`: another warehouse)."""
    names = [ENV_PREFIX + key.upper() for key in _SPECS]
    for name in env:
        if not name.startswith(ENV_PREFIX) or name in names or name in OTHER_ENV:
            continue
        near = difflib.get_close_matches(name, [*names, *OTHER_ENV], n=1, cutoff=0.85)
        near = near or [known for known in names if name.startswith(known + "_")]
        if near:
            raise ConfigError(
                f"environment variable {name} is not one this project reads; did you mean "
                f"{near[0]}?"
            )


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    _refuse_misspelt_env(env)
    values: dict[str, Any] = {}
    for key, (kind, _, accepted) in _SPECS.items():
        name = ENV_PREFIX + key.upper()
        if name not in env:
            continue
        raw = env[name]
        if kind is bool:
            if raw.strip().lower() not in _BOOLEANS:
                raise ConfigError(
                    f"{key} from environment variable {name} must be {accepted}; got {raw!r}"
                )
            values[key] = _BOOLEANS[raw.strip().lower()]
        elif kind is int:
            try:
                values[key] = int(raw.strip())
            except ValueError:
                raise ConfigError(
                    f"{key} from environment variable {name} must be {accepted}; got {raw!r}"
                ) from None
        else:
            values[key] = raw
    return values


def _from_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            # a byte-order mark, as some Windows editors write, is no TOML
            data = tomllib.loads(fh.read().decode("utf-8-sig"))
    except FileNotFoundError:
        raise ConfigError(f"configuration file {os.fspath(path)!r} does not exist") from None
    except OSError as exc:  # a directory, no permission to read, ...
        raise ConfigError(
            f"configuration file {os.fspath(path)!r} cannot be read: {exc.strerror or exc}"
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"configuration file {os.fspath(path)!r} is not UTF-8 text (TOML must be): {exc}"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            f"configuration file {os.fspath(path)!r} is not valid TOML: {exc}"
        ) from None
    # Accept a flat file, or one with the keys under a [reconcile] table.
    if set(data) == {"reconcile"} and isinstance(data["reconcile"], dict):
        data = data["reconcile"]
    elif isinstance(data.get("reconcile"), dict):
        others = ", ".join(sorted(k for k in data if k != "reconcile"))
        raise ConfigError(
            f"configuration file {os.fspath(path)!r} has a [reconcile] table and also {others}: "
            "put every key under [reconcile], or none"
        )
    return data


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Config:
    """Read the configuration: overrides > `TXN_*` environment > TOML file > defaults.

    Overrides whose value is None are ignored, so CLI flags that were not given
    can be passed straight through.

    >>> load_config(None, env={"TXN_CHECK_MAX": "4"}, check_max=None).check_max
    4
    """
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}
    layers = []
    if path is not None:
        layers.append((_from_file(path), f"file {os.fspath(path)!r}"))
    layers.append((_from_env(env), "the environment"))
    layers.append(({k: v for k, v in overrides.items() if v is not None}, "arguments"))
    for values, origin in layers:
        _check_all(values, origin)
        merged.update(values)
        origins.update(dict.fromkeys(values, origin))
    return Config(**merged)


def as_config(config: Config | Mapping[str, Any] | str | os.PathLike[str]) -> Config:
    """Accept a `Config`, a plain dict of configuration keys (notebooks pass
    dicts), or the path of a TOML file, read as `load_config(path)` reads it."""
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, os.PathLike)):
        return load_config(config)
    if not isinstance(config, Mapping):
        raise ConfigError(
            "the configuration must be a Config, a dict of its keys or a TOML file's path; "
            f"got {type(config).__name__}"
        )
    return Config.from_mapping(config)
