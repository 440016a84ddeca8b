"""Weight sync from trainer to inference engines: bit-exact, verified deltas and snapshots."""

from furlong.sync.delta import (
    WeightReceiver,
    apply_delta,
    apply_full,
    apply_update,
    encode_delta,
    encode_full,
    read_update,
)
from furlong.sync.entropy import EntropyBound, delta_entropy_bound
from furlong.sync.errors import (
    BaseVersionMismatch,
    ChecksumMismatch,
    CorruptUpdate,
    IncompatibleBase,
    StaleUpdate,
    SyncError,
)
from furlong.sync.publish import PublishedUpdate, Publisher
from furlong.sync.reference import xor_zstd_apply, xor_zstd_encode
from furlong.sync.relay import Relay, SyncFailed, SyncReport
from furlong.sync.transport import (
    DirectoryTransport,
    HttpTransport,
    InProcessTransport,
    Transport,
    TransportError,
    UpdateNotFound,
    UpdateServer,
)
from furlong.sync.update import TensorDelta, WeightUpdate

__all__ = [
    "BaseVersionMismatch",
    "ChecksumMismatch",
    "CorruptUpdate",
    "DirectoryTransport",
    "EntropyBound",
    "HttpTransport",
    "InProcessTransport",
    "IncompatibleBase",
    "PublishedUpdate",
    "Publisher",
    "Relay",
    "StaleUpdate",
    "SyncError",
    "SyncFailed",
    "SyncReport",
    "TensorDelta",
    "Transport",
    "TransportError",
    "UpdateNotFound",
    "UpdateServer",
    "WeightReceiver",
    "WeightUpdate",
    "apply_delta",
    "apply_full",
    "apply_update",
    "delta_entropy_bound",
    "encode_delta",
    "encode_full",
    "read_update",
    "xor_zstd_apply",
    "xor_zstd_encode",
]
