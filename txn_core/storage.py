"""Where a warehouse lives, and how each engine reaches it.

A warehouse is a local directory (the default) or a prefix of an S3 bucket
(any store that speaks S3 and enforces conditional writes), named once
(`warehouse = "s3://bucket/prefix"`, `txn_core.config`) and given to both
engines as the same `s3a://` URIs. This module turns the `s3_*` settings into
delta-rs' storage options for the broker core and Hadoop's per-bucket `fs.s3a.*`
settings for the job's Spark; credentials are never part of either (both take
them from the standard AWS chain). Producers on many hosts append to one table
safely only because the store refuses a second write of a log entry
(put-if-absent, `If-None-Match: *`); one that ignores it would silently lose
commits, so `Storage.check` proves it once per process and warehouse before
anything is written (`StorageError` otherwise).

>>> s = Storage(warehouse="s3a://bucket/wh", endpoint="http://127.0.0.1:9000",
...             region="us-east-1", path_style=True, allow_http=True)
>>> s.delta_rs_options()["AWS_ENDPOINT_URL"]
'http://127.0.0.1:9000'
>>> s.hadoop_options()["fs.s3a.bucket.bucket.path.style.access"]
'true'
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from txn_core.config import S3_SCHEMES, Config, ConfigError, absolute_warehouse

if TYPE_CHECKING:
    from txn_core.broker import Broker

#: where `check` writes (and deletes) its probe object under the warehouse
PROBE_PREFIX = "_sys/write_probe"
#: the environment variables through which the AWS chain finds credentials
#: without asking the network (an EC2 instance role: a profile whose
#: `credential_source` is `Ec2InstanceMetadata`)
CREDENTIAL_SOURCES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_PROFILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)
_DEFAULT_REGION = "us-east-1"


#: `Storage.s3_client`'s clients (thread-safe, unlike the sessions making them)
_CLIENTS: dict[tuple[Any, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _aws_environment() -> tuple[tuple[str, str], ...]:
    """The AWS_* environment variables: a client made before one of them
    changed may hold other credentials than the AWS chain finds now."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))


class StorageError(ConfigError):
    """The warehouse's store cannot be used as configured; nothing was written."""


@dataclass(frozen=True)
class Storage:
    """A warehouse and the settings that reach its store.

    `Storage.from_config(config)`; `delta_rs_options()` for delta-rs,
    `hadoop_options()` for Spark; `check()` before the first write.
    """

    warehouse: str
    endpoint: str = ""
    region: str = ""
    path_style: bool = False
    allow_http: bool = False

    @classmethod
    def from_config(cls, config: Config) -> Storage:
        return cls(
            warehouse=config.warehouse,
            endpoint=config.s3_endpoint,
            region=config.s3_region,
            path_style=config.s3_path_style,
            allow_http=config.s3_allow_http,
        )

    @property
    def is_s3(self) -> bool:
        return is_s3(self.warehouse)

    @property
    def bucket(self) -> str:
        return self.warehouse.split("://", 1)[1].split("/", 1)[0] if self.is_s3 else ""

    @property
    def resolved_region(self) -> str:
        return (
            self.region
            or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION")
            or _DEFAULT_REGION
        )

    def describe(self) -> str:
        """Where the warehouse is, for messages (never a credential)."""
        if not self.is_s3:
            return self.warehouse
        return (
            f"{self.warehouse} (endpoint {self.endpoint or 'AWS S3'}, region "
            f"{self.resolved_region})"
        )

    def delta_rs_options(self) -> dict[str, str] | None:
        """delta-rs storage options; None for a local or non-S3 warehouse,
        which delta-rs reaches with its defaults and the environment."""
        if not self.is_s3:
            return None
        options = {
            "AWS_REGION": self.resolved_region,
            # delta-rs' default on S3; said here so that a change of
            # default could never make commits unsafe
            "AWS_CONDITIONAL_PUT": "etag",
        }
        if self.endpoint:
            options["AWS_ENDPOINT_URL"] = (
                self.endpoint if self.path_style else _with_bucket_host(self.endpoint, self.bucket)
            )
        options["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] = "false" if self.path_style else "true"
        if self.allow_http:
            options["AWS_ALLOW_HTTP"] = "true"
        return options

    def hadoop_options(self) -> dict[str, str]:
        """Hadoop `fs.s3a.*` settings for this warehouse's bucket; {} when
        the warehouse is not on S3."""
        if not self.is_s3:
            return {}
        prefix = f"fs.s3a.bucket.{self.bucket}."
        credentials = "software.amazon.awssdk.auth.credentials.DefaultCredentialsProvider"
        options = {
            prefix + "endpoint.region": self.resolved_region,
            prefix + "path.style.access": str(self.path_style).lower(),
            # the same chain delta-rs uses: environment, profile, web identity, container
            prefix + "aws.credentials.provider": credentials,
        }
        if self.endpoint:
            options[prefix + "endpoint"] = self.endpoint
            options[prefix + "connection.ssl.enabled"] = str(
                self.endpoint.startswith("https://")
            ).lower()
        return options

    def s3_client(self) -> Any:  # a botocore S3 client: boto3 has no annotations
        """A boto3 S3 client for this store (boto3 is the `s3` extra), one per
        process for these settings and the AWS environment variables as they
        are now: a new session loads its service models again, and a run
        asks for a client several times."""
        key = (self.endpoint, self.resolved_region, self.path_style, _aws_environment())
        with _CLIENTS_LOCK:
            client = _CLIENTS.get(key)
            if client is None:
                client = _CLIENTS[key] = self._new_s3_client()
        return client

    def _new_s3_client(self) -> Any:
        try:
            import boto3
            from botocore.config import Config as BotoConfig
        except ImportError:
            raise StorageError(
                "an S3 warehouse needs boto3 to check the store before "
                "writing: pip install 'lakehouse-txn[s3]'"
            ) from None
        # A session of its own: boto3's default one keeps the credentials it
        # first found, and this client must see those delta-rs will use now.
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint or None,
            region_name=self.resolved_region,
            config=BotoConfig(
                s3={"addressing_style": "path" if self.path_style else "virtual"},
                retries={"max_attempts": 2, "mode": "standard"},
                connect_timeout=5,
                read_timeout=20,
                request_checksum_calculation="when_required",
            ),
        )

    def check(self) -> None:
        """Prove the store usable for concurrent commits: credentials are
        there, the bucket answers, and a stale second commit of the same log
        version is refused. Raises StorageError naming what is wrong."""
        if not self.is_s3:
            return
        if not _credentials_in_environment():
            raise StorageError(
                f"no AWS credentials for {self.describe()}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE (a profile of ~/.aws/credentials or "
                "~/.aws/config; for an EC2 instance role, credential_source = "
                "Ec2InstanceMetadata), or AWS_WEB_IDENTITY_TOKEN_FILE, or the container "
                "credential variables"
            )
        try:
            enforced = _conditional_put_enforced(self)
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001 - botocore's errors carry the store's answer
            raise StorageError(self._explain(exc)) from None
        if not enforced:
            raise StorageError(
                f"the store at {self.describe()} does not enforce conditional writes "
                "(put-if-absent, If-None-Match: *): a second write of the same object "
                "succeeded, so concurrent producers would lose commits. Use a store that "
                "enforces them (AWS S3, MinIO, Cloudflare R2) or check s3_endpoint; "
                "nothing was written to the warehouse"
            )

    def _explain(self, exc: BaseException) -> str:
        text = str(exc)
        where = self.describe()
        if "NoSuchBucket" in text or "does not exist" in text:
            return f"bucket {self.bucket!r} does not exist at {where}"
        if any(
            s in text
            for s in (
                "InvalidAccessKeyId",
                "SignatureDoesNotMatch",
                "AccessDenied",
                "403 Forbidden",
                "ExpiredToken",
            )
        ):
            return (
                f"the store at {where} refused the credentials (check AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY or AWS_PROFILE, and the bucket's policy)"
            )
        if any(
            s in text
            for s in (
                "error sending request",
                "Connection refused",
                "connection error",
                "dns error",
                "timed out",
                "tcp connect",
                "Could not connect",
            )
        ):
            return (
                f"cannot reach the store at {where}: check s3_endpoint, s3_region and the network"
            )
        first_line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        return f"cannot use the store at {where}: {first_line}"


def is_s3(uri: str) -> bool:
    return uri.split("://", 1)[0].lower() in S3_SCHEMES if "://" in uri else False


def _with_bucket_host(endpoint: str, bucket: str) -> str:
    """`https://host` as `https://bucket.host`: delta-rs' virtual-hosted
    requests go to the endpoint as given."""
    scheme, rest = endpoint.split("://", 1)
    return endpoint if rest.startswith(bucket + ".") else f"{scheme}://{bucket}.{rest}"


def _credentials_in_environment() -> bool:
    if any(os.environ.get(name) for name in CREDENTIAL_SOURCES):
        return True
    shared = os.environ.get(
        "AWS_SHARED_CREDENTIALS_FILE", os.path.join(os.path.expanduser("~"), ".aws", "credentials")
    )
    return os.path.isfile(shared)


def _conditional_put_enforced(storage: Storage) -> bool:
    """Write a probe object twice with `If-None-Match: *`: the store must
    refuse the second write. The probe is deleted afterwards.

    Through boto3 (the `s3` extra), not delta-rs: delta-rs looks for the
    next log entry before it writes one, so only a true race of two commits
    would show a store that ignores the condition.
    """
    client = storage.s3_client()
    from botocore.exceptions import ClientError

    prefix = object_key(storage.warehouse)
    key = "/".join(p for p in (prefix, PROBE_PREFIX, uuid.uuid4().hex) if p)
    client.put_object(Bucket=storage.bucket, Key=key, Body=b"probe", IfNoneMatch="*")
    try:
        client.put_object(Bucket=storage.bucket, Key=key, Body=b"again", IfNoneMatch="*")
        enforced = False
    except ClientError as exc:
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status not in (409, 412):
            raise
        enforced = True
    try:
        client.delete_object(Bucket=storage.bucket, Key=key)
    except ClientError:
        pass  # a store may forbid deletes; the probe is a few bytes
    return enforced


# --- the process's warehouses -------------------------------------------------------
# Many functions reach a table by its URI alone; the settings of the warehouse it
# lies in are registered once per process by whoever opens it (`use`).

_lock = threading.Lock()
_registered: dict[str, Storage] = {}
_checked: set[Storage] = set()


def use(storage: Storage, *, check: bool = True) -> Storage:
    """Register `storage` for the URIs under its warehouse and, once per
    process, `check` it. Returns it."""
    with _lock:
        _registered[storage.warehouse] = storage
        done = storage in _checked
    if check and not done:
        storage.check()
        with _lock:
            _checked.add(storage)
    return storage


def resolve_warehouse(
    warehouse: str | os.PathLike[str] | Config | Broker,
    storage_options: Mapping[str, str] | None,
    *,
    check: bool,
) -> tuple[str, dict[str, str] | None]:
    """The URI of a warehouse given as a path, a URI, a Config or a Broker,
    and the delta-rs options the caller gave for it (None: its registered
    settings'), for the broker core's readers and consumers.

    Its settings are registered (`use`); with `check` (a caller that
    writes) an object store is checked first, once per process, as
    `Broker.open` checks it, unless the caller gave options of their own, as
    there. A Broker was checked when it opened, and lends its options.

    >>> resolve_warehouse("./wh", None, check=False)[0] == os.path.abspath("wh")
    True
    """
    from txn_core.broker import Broker  # it imports this module

    if isinstance(warehouse, Broker):
        given = storage_options if storage_options is not None else warehouse.storage_options
        return warehouse.warehouse, None if given is None else dict(given)
    if isinstance(warehouse, os.PathLike):
        warehouse = os.fspath(warehouse)
    if isinstance(warehouse, Config):
        storage = Storage.from_config(warehouse)
    elif isinstance(warehouse, str):
        uri = absolute_warehouse(warehouse)
        storage = replace(storage_for(uri), warehouse=uri)
    else:
        raise ConfigError(
            f"warehouse must be a path, a URI, a Config or a Broker, got {type(warehouse).__name__}"
        )
    use(storage, check=check and storage_options is None)
    return storage.warehouse, None if storage_options is None else dict(storage_options)


def object_key(uri: str) -> str:
    """The object key of an S3 URI's path, without the bucket or a trailing `/`.

    >>> object_key("s3a://bucket/wh/_sys/half/")
    'wh/_sys/half'
    """
    return uri.split("://", 1)[1].partition("/")[2].rstrip("/")


def registered(uri: str) -> Storage | None:
    """The registered storage of the warehouse holding `uri`, if any."""
    key = _canonical(uri)
    with _lock:
        matches = [s for w, s in _registered.items() if key == w or key.startswith(w + "/")]
    return max(matches, key=lambda s: len(s.warehouse)) if matches else None


def storage_for(uri: str) -> Storage:
    """The registered storage of the warehouse holding `uri`, else one with
    the default settings (AWS S3 for an S3 URI)."""
    found = registered(uri)
    if found is not None:
        return found
    if is_s3(uri):
        bucket = _canonical(uri).split("://", 1)[1].split("/", 1)[0]
        return Storage(warehouse="s3a://" + bucket)
    return Storage(warehouse=uri)


def options_for(uri: str, given: Mapping[str, Any] | None = None) -> dict[str, str] | None:
    """delta-rs storage options for a table at `uri`: `given` when the
    caller has its own, else those of its registered warehouse."""
    if given is not None:
        return dict(given)
    return storage_for(uri).delta_rs_options()


def _canonical(uri: str) -> str:
    if is_s3(uri):
        return "s3a://" + uri.split("://", 1)[1].rstrip("/")
    return uri.rstrip("/")
