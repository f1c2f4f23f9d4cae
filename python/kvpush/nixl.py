"""Finding NIXL's C API library in the installed NIXL wheel.

kvpush's native writer calls NIXL through ``libnixl_capi.so``, the C API that NIXL's pip wheels
(``nixl-cu12``, ``nixl-cu13``) ship next to their Python bindings. No headers or build step are
needed: the library is loaded at run time from the wheel Python would import. When NIXL's Python
module is already imported in this process, its copy is used, so both share one UCX.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

#: Overrides the discovery with an absolute path to ``libnixl_capi.so``.
ENV_OVERRIDE = "KVPUSH_NIXL_CAPI"

#: The wheels' module names, in order of preference.
WHEEL_MODULES = ("nixl_cu13", "nixl_cu12")


def _capi_of(module: str) -> Path | None:
    loaded = sys.modules.get(module)
    origin = getattr(loaded, "__file__", None)
    if origin is None:
        spec = importlib.util.find_spec(module)
        origin = spec.origin if spec is not None else None
    if origin is None:
        return None
    candidate = Path(origin).parent.parent / f".{module}.mesonpy.libs" / "libnixl_capi.so"
    return candidate if candidate.is_file() else None


def library_path() -> str:
    """Absolute path of the ``libnixl_capi.so`` to load.

    Order: ``$KVPUSH_NIXL_CAPI``; a NIXL wheel already imported in this process; the first
    installed of ``nixl_cu13``, ``nixl_cu12``.
    """
    override = os.environ.get(ENV_OVERRIDE)
    if override:
        return override
    imported = [m for m in WHEEL_MODULES if m in sys.modules]
    for module in imported + [m for m in WHEEL_MODULES if m not in imported]:
        found = _capi_of(module)
        if found is not None:
            return str(found)
    from kvpush.exceptions import NixlUnavailableError

    raise NixlUnavailableError(
        "no NIXL C API found: install NIXL's wheel (pip install nixl-cu12 on CPU or CUDA 12, "
        f"nixl-cu13 on CUDA 13), or set {ENV_OVERRIDE} to the path of libnixl_capi.so"
    )


def library_version(path: str | None = None) -> str | None:
    """The NIXL release that ships ``path`` (default: :func:`library_path`), read from its
    wheel's metadata: NIXL's C API has no version call. None when it cannot be told."""
    from kvpush.exceptions import NixlUnavailableError

    try:
        path = path or library_path()
    except NixlUnavailableError:
        return None
    for module in WHEEL_MODULES:
        if f"/.{module}.mesonpy.libs/" in path:
            try:
                return importlib.metadata.version(module.replace("_", "-"))
            except importlib.metadata.PackageNotFoundError:
                return None
    return None
