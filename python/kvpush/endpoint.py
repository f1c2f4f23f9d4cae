"""``kvpush.Endpoint``: the native endpoint, with what needs Python around it.

The native class (``kvpush._native.Endpoint``) takes its settings as one
:class:`~kvpush.EndpointOptions` and never calls back into Python. This subclass adds the two
things that do: finding NIXL's C API library in the installed wheel (:mod:`kvpush.nixl`) when the
options do not name it, and logging, at the end of a ``with`` block, a writer left running.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from kvpush import _native, nixl

if TYPE_CHECKING:
    from typing_extensions import Self

logger = logging.getLogger("kvpush")


class Endpoint(_native.Endpoint):
    """A worker's push endpoint: side channel, rendezvous table and native writer thread.

    ``Endpoint(engine_id, layout, memory=[(address, length), ...], options=EndpointOptions(...))``;
    the options' keywords may be given here instead (``transport="loopback", secret=...``), or
    as changes to ``options``. ``memory`` must stay allocated until :meth:`close` (for good, if
    close reports the writer thread stuck).
    """

    __slots__ = ()

    def __new__(
        cls,
        engine_id: str,
        layout: _native.KvLayout,
        *,
        memory: Sequence[tuple[int, int]],
        options: _native.EndpointOptions | None = None,
        **settings: Any,
    ) -> Self:
        if options is None:
            options = _native.EndpointOptions(**settings)
        elif settings:
            options = options.replace(**settings)
        if options.transport == "nixl" and options.nixl_library is None:
            options = options.replace(nixl_library=nixl.library_path())
        return super().__new__(cls, engine_id, layout, memory=memory, options=options)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> Literal[False]:
        stuck = self.close()
        if stuck is not None:
            logger.warning("kvpush: closing the endpoint: %s", stuck)
        return False
