"""The rendezvous of a process-group push: the store view of one group (keys under a prefix
derived from the group's secret, every value signed with it) and the checks on what is read back.

A ``torch.distributed`` store answers any client that reaches its port and lists its keys to
anyone, so nothing read from it is trusted until its signature matches the group's secret, which
travels only over the trusted channel (``ProcessGroupSender.connection_info()``).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import re
from typing import Any

import torch.distributed as dist

from lmcollect.weights.buckets import BucketLayout, layout_from_json
from lmcollect.weights.tensors import raise_if_problems
from lmcollect.weights.version import PushVersion

SECRET_PATTERN = re.compile(r"[0-9a-f]{32}")  # secrets.token_hex(16)
_MAC_CHARS = 64  # hex SHA-256


def version_json(version: PushVersion) -> list:
    return [version.index, version.uuid]


def version_from_json(data: list) -> PushVersion:
    return PushVersion(int(data[0]), str(data[1]))


class GroupStore:
    """One push group's view of the rendezvous store: every key under a prefix derived from the
    group's secret, every value signed with it (HMAC-SHA256 over key and value).

    The prefix keeps lmcollect's keys apart from anything a stranger writes at the well-known
    names; the signature is what stops a forger, since any client of the store can list its keys
    (and so learn the prefix) but cannot learn the secret from them.
    """

    def __init__(self, store: Any, secret: str) -> None:
        self.store = store
        """The underlying ``torch.distributed`` store (unprefixed, unsigned)."""
        self._secret = secret.encode()
        digest = hashlib.sha256(b"lmcollect weight-sync store prefix\n" + self._secret).hexdigest()
        self.prefix = f"lmcollect/{digest[:32]}/"
        """Where this group's keys live (not the secret: store keys may show up in torch's errors)."""

    def set(self, key: str, value: str) -> None:
        data = value.encode()
        self.store.set(self.prefix + key, self._sign(key, data) + data)

    def get(self, key: str) -> str:
        """The value at ``key``; ValueError if a member of this group did not write it."""
        raw = self.store.get(self.prefix + key)
        mac, data = raw[:_MAC_CHARS], raw[_MAC_CHARS:]
        if not hmac.compare_digest(mac, self._sign(key, data)):
            raise ValueError(
                f"store value {key!r} is not signed with this group's secret: a host without it wrote it "
                "(a forgery); refused. Firewall the store's port (see ProcessGroupConfig)."
            )
        return data.decode()

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        self.store.wait([self.prefix + key for key in keys], timeout)

    def delete(self, key: str) -> None:
        self.store.delete_key(self.prefix + key)

    def backend_store(self) -> Any:
        """The store the gloo/NCCL group meets through: under this group's prefix (its values are
        the backend's own, unsigned)."""
        return dist.PrefixStore(self.prefix + "group/", self.store)

    def _sign(self, key: str, data: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + b"\n" + data, hashlib.sha256).hexdigest().encode()


def parse_header(text: str, key: str) -> dict:
    """A push header read from the store: JSON with a known kind, a version and a layout (which
    the receiver checks against its model); ValueError otherwise."""
    try:
        header = json.loads(text)
        kind, layout = header["kind"], header["layout"]
        version_from_json(header["version"])
    except (KeyError, TypeError, ValueError, IndexError) as exc:  # designed: an untrusted header
        raise ValueError(f"push header {key!r} is malformed ({exc!r:.200}); refused.") from None
    if kind not in ("full", "delta"):
        raise ValueError(f"push header {key!r} has kind {kind!r:.40}, neither 'full' nor 'delta'; refused.")
    if not isinstance(layout, str):
        raise ValueError(f"push header {key!r} has a layout of type {type(layout).__name__}, not JSON text; refused.")
    return header


def parse_layout(header: dict) -> BucketLayout:
    try:
        return layout_from_json(header["layout"])
    except (KeyError, TypeError, ValueError) as exc:  # designed: an untrusted header
        raise ValueError(f"push header refused: malformed layout ({exc!r:.200}).") from None


def raise_if_layout_problems(problems: list[str], rank: int) -> None:
    raise_if_problems([f"layout: {p}" for p in problems], where=f" by receiver {rank} before allocating anything")


def check_secret(secret: Any) -> None:
    if not isinstance(secret, str) or not SECRET_PATTERN.fullmatch(secret):
        state = "has no 'secret'" if secret is None else "has a malformed 'secret' (not 32 hex digits)"
        raise ValueError(
            f"connection_info {state}: it came from an older lmcollect sender or was forged. Pass the dict "
            "ProcessGroupSender.connection_info() returns, unchanged, over a trusted channel (driver, Ray, collective_rpc)."
        )
