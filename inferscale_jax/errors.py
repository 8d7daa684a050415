"""The engine's public exceptions (docs/architecture.md): each message names the value, the limit and the fix."""


class InferScaleError(Exception):
    """Base class of the engine's errors."""


class SegmentNotFound(InferScaleError, KeyError):
    """No segment with this id is visible to this tenant (missing and foreign look the same)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "segment not found"


class SegmentExists(InferScaleError, ValueError):
    """A segment with this id already exists in the tenant's namespace."""


class RequestTooLong(InferScaleError, ValueError):
    """The request's tokens exceed the model's context or what the page pool can ever hold."""


class SnapshotMismatch(InferScaleError, ValueError):
    """A snapshot was written by another model fingerprint, dtype or page size."""


class SnapshotCorrupt(InferScaleError, RuntimeError):
    """A snapshot's files are missing, truncated or fail their checksums; nothing was restored."""


class SnapshotInUse(InferScaleError, RuntimeError):
    """Another engine (another process) holds the snapshot folder: two engines writing one
    registry and one set of snapshots would corrupt both; the message names its pid."""


class PoolExhausted(InferScaleError, RuntimeError):
    """Not enough free KV pages right now (held by segments and running requests); requests
    wait for pages rather than fail, so this only escapes when nothing else can free any."""


class StorageError(InferScaleError, OSError):
    """A write to the snapshot, registry or disk-tier folder failed because the storage is full
    or read-only (ENOSPC, EROFS, EDQUOT); the message names the folder and what to free or fix."""


class EngineFault(InferScaleError, RuntimeError):
    """An engine-wide failure (a device error, a broken invariant) that was not caused by one
    request: the requests running at that moment fail with it; retrying later can succeed."""
