"""Where a run is read from: a local path, or an fsspec URL (``file://``, ``memory://``, ``s3://``,
``gcs://``, ``hf://`` ...) when the filesystem's package is installed.

A *location* is a :class:`~pathlib.Path` (a plain path: read with the standard library, fsspec is
never imported) or a URL string (``scheme://...``: read through ``fsspec.core.url_to_fs``). The
helpers here take either, so the readers have one code path. Shard tasks carry the location as a
string and every process (a ``--workers`` pool, a Dask worker) re-opens it here: no open file or
filesystem object is ever pickled. ``memory://`` filesystems live in one process only.

Whatever keeps fsspec from making a URL's filesystem (an unknown scheme, a package not installed, a
malformed URL, a server that cannot be reached: ``ftp://`` connects as its filesystem is made) and
whatever a filesystem raises while it is used is one InputError line naming the URL. A missing
package is named from fsspec's registry, which keeps for each protocol the text that says what it
needs (``http://``: aiohttp; ``sftp://``: paramiko; ``smb://``: smbprotocol), not the module the
implementation lives in (fsspec itself, for those three). A server may keep a connection or a read
waiting at most :data:`NETWORK_TIMEOUT_S` per socket operation where the filesystem takes a timeout
(:func:`timeout_options`: ``ftp://``, ``sftp://``, ``smb://``, ``http(s)://``, ``s3://``); the
others wait as their own settings say (``hf://``: huggingface_hub's 10 s, ``HF_HUB_DOWNLOAD_TIMEOUT``).
"""

from __future__ import annotations

import io
import posixpath
import re
from pathlib import Path, PurePath

from geomscope.errors import InputError, first_line, first_line_of
from geomscope.fileio import MAX_JSON_BYTES, JSONLimitError, read_regular_bytes

URL_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*)://")
#: the first part of a Path made from a URL (``Path("s3://b/k")`` is ``s3:/b/k``): two letters or
#: more, so that a Windows drive (``C:``) is never taken for a scheme
_COLLAPSED_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]+):")
_LOCAL_PROTOCOLS = ("file", "local")


def is_url(loc) -> bool:
    """Whether ``loc`` is a URL string with a scheme (``scheme://...``)."""
    return isinstance(loc, str) and URL_RE.match(loc) is not None


def location(loc) -> str | Path:
    """``loc`` as a location: a URL string stays as given, anything else is a Path.

    A Path made from a URL (a command-line argument typed as a path turns ``memory://runs/x`` into
    ``memory:/runs/x``) that is not a local file is turned back into its URL.
    """
    if is_url(loc):
        return loc
    if isinstance(loc, PurePath):
        parts = loc.parts
        m = _COLLAPSED_RE.fullmatch(parts[0]) if parts else None
        if m and len(parts) > 1 and not Path(loc).exists():
            scheme = m.group(1)
            root = "/" if scheme.lower() in _LOCAL_PROTOCOLS else ""
            return f"{scheme}://{root}{'/'.join(parts[1:])}"
    return Path(loc)


#: seconds a network filesystem may keep one connection, handshake or read waiting (per socket
#: operation, not per file: a large shard read in many blocks is not cut short). A server that
#: answers at all answers within it; one that does not is said in one line instead of a hang.
NETWORK_TIMEOUT_S = 30


def timeout_options(scheme: str) -> dict:
    """The storage options that bound ``scheme``'s waits by :data:`NETWORK_TIMEOUT_S`, for the
    filesystems that take one (fsspec's ``ftp://``, ``smb://``, ``sftp://`` through paramiko,
    ``http(s)://`` through aiohttp, s3fs's ``s3://`` through botocore); what the user's fsspec
    configuration sets for the protocol is left to it."""
    t = NETWORK_TIMEOUT_S
    scheme = scheme.lower()
    if scheme in ("ftp", "smb"):
        options = {"timeout": t}
    elif scheme in ("sftp", "ssh"):
        options = {"timeout": t, "banner_timeout": t, "auth_timeout": t}
    elif scheme in ("s3", "s3a"):
        options = {"config_kwargs": {"connect_timeout": t, "read_timeout": t}}
    elif scheme in ("http", "https"):
        try:
            import aiohttp
        except ImportError:  # (the filesystem then says what to install)
            return {}
        options = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(sock_connect=t, sock_read=t)}}
    else:
        return {}
    try:
        from fsspec.config import conf

        configured = conf.get(scheme) or {}
    except ImportError:
        configured = {}
    return {k: v for k, v in options.items() if k not in configured}


def _missing_package(scheme: str, e: ImportError) -> str:
    """What to install for ``scheme`` (fsspec's ImportError ``e`` on making its filesystem), in one
    line. fsspec raises the registry's ``err`` text for the protocol from the ImportError of the
    module that was missing: that module is named, with ``pip install``, where the text names it
    (aiohttp for http://, s3fs for s3://); else the text is quoted (smb:// needs smbprotocol, whose
    module is smbclient). Without a missing module, the package the implementation lives in, where
    that is not fsspec itself."""
    from fsspec.registry import known_implementations

    impl = known_implementations.get(scheme.lower()) or {}
    needs = first_line_of(impl.get("err") or "", first_line(e), 200)
    missing = next((c.name for c in (e, e.__cause__) if isinstance(c, ImportError) and c.name), None)
    module = missing.split(".")[0] if missing else None
    if module and re.search(rf"\b{re.escape(module)}\b", needs):
        return f"reading {scheme}:// URLs needs {module}, which is not installed: pip install {module}"
    home = impl.get("class", "").split(".")[0]
    if not module and home and home != "fsspec":
        return f"reading {scheme}:// URLs needs {home}: pip install {home}"
    return f"reading {scheme}:// URLs needs a package that is not installed ({needs})"


def filesystem(url: str):
    """``(fs, path)`` of a URL; InputError (one line, the URL named) for whatever keeps fsspec from
    making its filesystem: an unknown scheme, a package not installed, a malformed URL (or one
    without what its filesystem needs: ``zip://`` without its archive), a server that cannot be
    reached."""
    scheme = URL_RE.match(url).group(1)
    try:
        import fsspec.core
    except ImportError:
        raise InputError(f"{url} is a URL; reading runs from URLs needs fsspec: pip install fsspec") from None
    try:
        return fsspec.core.url_to_fs(url, **timeout_options(scheme))
    except ImportError as e:
        raise InputError(f"cannot open {url}: {_missing_package(scheme, e)}") from None
    except ValueError as e:
        if "Protocol not known" in str(e):
            raise InputError(
                f"{scheme}:// is not a filesystem fsspec knows; give a local path or a URL such as "
                "file://, s3://, gcs:// or hf:// (its package installed)"
            ) from None
        raise InputError(f"{url} is not a usable URL ({first_line(e, 200)})") from None
    except OSError as e:  # refused, no such host, timed out (ftp:// connects here), a local path that is none
        raise InputError(
            f"cannot open {url} ({first_line(e, 200)}); check the URL, and that its server can be reached"
        ) from None
    except Exception as e:  # a filesystem's own check of its arguments (TypeError), a server's junk reply
        raise InputError(f"cannot use {url} ({first_line(e, 200)}); check the URL") from None


def _fs_call(url: str, what: str, fn, *args):
    """``fn(fs, path, *args)`` on a URL; a failure of the filesystem (network, permission) is one line."""
    fs, path = filesystem(url)
    try:
        return fn(fs, path, *args)
    except FileNotFoundError:
        raise
    except Exception as e:  # each filesystem raises its own (botocore, aiohttp, HTTP errors, ...)
        raise InputError(f"cannot {what} {url} ({first_line(e, 200)})") from e


def join(loc, name: str) -> str | Path:
    """``loc`` / ``name``: ``name`` is a plain file name (the caller has checked it)."""
    loc = location(loc)
    return f"{loc.rstrip('/')}/{name}" if is_url(loc) else loc / name


def name(loc) -> str:
    """The last component of a location."""
    loc = location(loc)
    return posixpath.basename(loc.rstrip("/")) if is_url(loc) else loc.name


def exists(loc) -> bool:
    return _holds(loc, Path.exists, lambda fs, p: fs.exists(p))


def isdir(loc) -> bool:
    return _holds(loc, Path.is_dir, lambda fs, p: fs.isdir(p))


def _holds(loc, local, remote) -> bool:
    """Whether a location passes a check: ``local(path)`` on this machine, ``remote(fs, path)`` on a
    URL's file system (False where the answer is that nothing is there)."""
    loc = location(loc)
    if not is_url(loc):
        return local(loc)
    try:
        return bool(_fs_call(loc, "check", remote))
    except FileNotFoundError:
        return False


def size(loc) -> int:
    """Size in bytes; FileNotFoundError when absent."""
    loc = location(loc)
    if not is_url(loc):
        return loc.stat().st_size
    return int(_fs_call(loc, "read the size of", lambda fs, p: fs.size(p)))


def listdir(loc) -> list[str]:
    """The names in a directory (sorted); empty when it does not exist."""
    loc = location(loc)
    if not is_url(loc):
        return sorted(p.name for p in loc.iterdir()) if loc.is_dir() else []
    try:
        found = _fs_call(loc, "list", lambda fs, p: fs.ls(p, detail=False))
    except FileNotFoundError:
        return []
    return sorted({posixpath.basename(str(p).rstrip("/")) for p in found} - {""})


def local_path(loc) -> Path | None:
    """The local path of a plain path or a ``file://`` URL; None on any other filesystem."""
    loc = location(loc)
    if not is_url(loc):
        return loc
    fs, path = filesystem(loc)
    return (
        Path(path) if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)) else None
    )


def _open(fs, path: str):
    f = fs.open(path, "rb")
    if "memory" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        # memory:// hands every reader the one stored buffer, position included: a checksum read
        # beside an h5py read would interleave. Each reader gets its own (copy-free) view.
        return io.BytesIO(f.getvalue())
    return f


def open_binary(loc):
    """A binary file object for reading (a plain ``open`` for a path); FileNotFoundError when absent."""
    loc = location(loc)
    if not is_url(loc):
        return open(loc, "rb")
    return _fs_call(loc, "open", _open)


def read_text(loc, max_bytes: int | None = MAX_JSON_BYTES) -> str:
    """The UTF-8 text of a file (UnicodeDecodeError where it is not UTF-8) of at most ``max_bytes``
    (fileio.MAX_JSON_BYTES: what is read whole is JSON; None: no bound), else JSONLimitError, after
    at most ``max_bytes + 1`` bytes are read. A file on this machine (a path, a ``file://`` URL) must
    be a regular file (fileio.read_regular_bytes: a named pipe is refused, not waited on); another
    URL's read that fails is one InputError line, FileNotFoundError where nothing is there."""
    local = local_path(loc)
    if local is not None:
        return read_regular_bytes(local, max_bytes).decode("utf-8")

    def read(fs, path):
        with _open(fs, path) as f:
            return f.read() if max_bytes is None else f.read(max_bytes + 1)

    data = _fs_call(location(loc), "read", read)
    if max_bytes is not None and len(data) > max_bytes:
        raise JSONLimitError(f"larger than {max_bytes} bytes")
    return data.decode("utf-8")
