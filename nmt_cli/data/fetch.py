"""Getting a recipe's files: resumable download or a local mirror, sha256 check, safe extraction.

From the file on, a mirror and the network take the same path: verify, then extract.
"""

from __future__ import annotations

import errno
import os
import posixpath
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from nmt_cli import __version__, ui
from nmt_cli.errors import NmtError
from nmt_cli.files import sha256_file

CHUNK = 1 << 20
# A file whose size no recipe pins is still bounded: a server that never ends its body must not
# fill the disk.
MAX_UNSIZED = 8 << 30


# An HTTP(S) mirror of the pinned files, each under its own name (an organisation's cache, a
# machine without access to the origins): every download comes from there instead.
MIRROR_URL = "NMT_MIRROR_URL"


@dataclass(frozen=True)
class Source:
    """One file of a recipe: where it comes from and the sha256 it must have."""

    url: str
    sha256: str
    size: int | None = None

    @property
    def name(self) -> str:
        return posixpath.basename(self.url)

    @property
    def origin(self) -> str:
        """Where it is downloaded from: `url`, or its name under $NMT_MIRROR_URL."""
        mirror = os.environ.get(MIRROR_URL, "").strip()
        return f"{mirror.rstrip('/')}/{self.name}" if mirror else self.url


def fetch(
    source: Source, downloads: Path, mirror: Path | None = None, retries: int = 5, wait: float = 2.0
) -> Path:
    """A verified local copy of `source`: from `mirror` if given, else downloaded (resuming)."""
    if mirror is not None:
        path = Path(mirror) / source.name
        if not path.is_file():
            raise NmtError(
                f"{source.name} not found in mirror {mirror}: put the file from "
                f"{source.url} there, or drop --mirror to download it"
            )
        verify(path, source, keep_aside=False)
        return path
    path = Path(downloads) / source.name
    if not path.exists():
        download(source, path, retries=retries, wait=wait)
    verify(path, source, keep_aside=True)
    return path


def sha256_of(path: Path, label: str | None = None) -> str:
    with ui.progress("bytes") as bar:
        task = bar.add_task(label or f"verify {path.name}", total=path.stat().st_size)
        return sha256_file(path, lambda chunk: bar.advance(task, len(chunk)))


def verify(path: Path, source: Source, keep_aside: bool) -> None:
    """Refuse a file whose sha256 is not the pinned one; a downloaded one is moved aside."""
    got = sha256_of(path)
    if got == source.sha256:
        return
    where = f"{path}"
    if keep_aside:
        bad = path.with_name(path.name + ".bad")
        os.replace(path, bad)
        where = f"{path} (moved aside to {bad.name}, never used; rerun to download it again)"
    raise NmtError(f"checksum mismatch for {where}: sha256 {got}, expected {source.sha256}")


def download(source: Source, dest: Path, retries: int = 5, wait: float = 2.0) -> None:
    """Download to `dest` through `dest.part`, resuming with HTTP Range after a broken transfer."""
    # the network's modules, imported here: the commands that import this module for a recipe's
    # names (every `nmt` command: `nmt prep`'s choices) start without them
    import http.client
    import urllib.error
    import urllib.request

    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    last_error = ""
    for attempt in range(1, retries + 1):
        have = part.stat().st_size if part.exists() else 0
        if source.size is not None and have > source.size:
            part.unlink()
            have = 0
        _room_for(source, dest.parent, have)
        headers = {"User-Agent": f"nmt/{__version__}"}
        if have:
            headers["Range"] = f"bytes={have}-"
        try:
            with urllib.request.urlopen(
                urllib.request.Request(source.origin, headers=headers), timeout=60
            ) as response:
                resumed = have > 0 and response.status == 206
                if not resumed:
                    have = 0  # the server sent the whole file
                length = _length(response.headers.get("Content-Length"))
                total = (
                    source.size if source.size is not None else have + length if length is not None else None
                )
                limit = total if total is not None else MAX_UNSIZED
                with open(part, "ab" if resumed else "wb") as f, ui.progress("bytes") as bar:
                    task = bar.add_task(f"download {source.name}", total=total, completed=have)
                    while chunk := response.read(CHUNK):
                        have += len(chunk)
                        if have > limit:
                            raise _Oversized(limit)
                        f.write(chunk)
                        bar.advance(task, len(chunk))
            got = part.stat().st_size
            expected = total if total is not None else got
            if got < expected:
                raise http.client.IncompleteRead(b"", expected - got)
            os.replace(part, dest)
            return
        except _Oversized as e:
            part.unlink(missing_ok=True)
            raise NmtError(
                f"download of {source.origin} sent more than the {e.args[0]} bytes expected; "
                "refusing it (nothing kept)"
            ) from None
        except urllib.error.HTTPError as e:
            if e.code == 416 and source.size is not None and have == source.size:
                os.replace(part, dest)  # an earlier try had finished the transfer
                return
            if e.code not in (408, 429, 500, 502, 503, 504):
                raise NmtError(f"download of {source.origin} failed: HTTP {e.code} {e.reason}") from None
            last_error = f"HTTP {e.code} {e.reason}"
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                # a full disk or quota is the user's to fix, not a network error to retry
                raise NmtError(
                    f"{dest.parent} is full ({e.strerror}): free some space and rerun to resume"
                ) from None
            last_error = str(getattr(e, "reason", e)) or type(e).__name__
        if attempt < retries:
            ui.warn(
                f"download of {source.name} interrupted ({last_error}); "
                f"resuming in {wait * 2 ** (attempt - 1):.0f}s (try {attempt + 1}/{retries})"
            )
            time.sleep(wait * 2 ** (attempt - 1))
    raise NmtError(
        f"could not download {source.origin} after {retries} tries ({last_error}); "
        f"rerun to resume, or put the file in a folder and pass --mirror"
    )


class _Oversized(Exception):
    pass


def _length(header: str | None) -> int | None:
    """A Content-Length header's value, None where it is missing or not a number."""
    try:
        value = int(header) if header is not None else None
    except ValueError:
        return None
    return value if value is not None and value >= 0 else None


def _room_for(source: Source, folder: Path, have: int) -> None:
    """Refuse to start a download that cannot fit in `folder`'s free space."""
    if source.size is None:
        return
    free = shutil.disk_usage(folder).free
    if free < source.size - have:
        raise NmtError(
            f"{folder} has {free / 2**30:.1f} GiB free; {source.name} needs "
            f"{(source.size - have) / 2**30:.1f} GiB more: free some space or pass another folder"
        )


# -- extraction -------------------------------------------------------------------------------


def _unsafe(name: str, link: str | None, archive: Path) -> NmtError | None:
    """Why a member may not be extracted: absolute, climbing out with `..`, or a link out."""
    if name.startswith(("/", "\\")) or posixpath.isabs(name) or (len(name) > 1 and name[1] == ":"):
        return NmtError(f"{archive} has a member with an absolute path ({name!r}); refusing it")
    if ".." in name.replace("\\", "/").split("/"):
        return NmtError(f"{archive} has a member that climbs out with '..' ({name!r}); refusing it")
    if link is not None:
        target = posixpath.normpath(posixpath.join(posixpath.dirname(name), link))
        if posixpath.isabs(link) or target == ".." or target.startswith("../"):
            return NmtError(
                f"{archive} has a link {name!r} pointing outside the folder ({link!r}); refusing it"
            )
    return None


def extract(archive: Path, members: list[str], dest: Path) -> dict[str, Path]:
    """Extract `members` of a tar or zip archive into `dest`, checking every member on the way.

    An archive with any unsafe member is refused whole, and nothing of it is kept. A marker
    holding the archive's sha256 lets a rerun skip the work.
    """
    import zipfile

    archive = Path(archive)
    out = {m: dest / m for m in members}
    marker = dest / f".{archive.name}.done"
    fingerprint = f"{archive.stat().st_size}:{archive.stat().st_mtime_ns}"
    if marker.exists() and marker.read_text() == fingerprint and all(p.exists() for p in out.values()):
        return out
    staging = dest / f".{archive.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        if zipfile.is_zipfile(archive):
            found = _extract_zip(archive, set(members), staging)
        else:
            found = _extract_tar(archive, set(members), staging)
        missing = sorted(set(members) - found)
        if missing:
            raise NmtError(f"{archive} lacks {', '.join(missing)}: is it the right archive?")
        for m in members:
            (dest / m).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / m, dest / m)
        marker.write_text(fingerprint)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _extract_tar(archive: Path, wanted: set[str], staging: Path) -> set[str]:
    import gzip
    import tarfile
    import zlib

    found: set[str] = set()
    try:
        # Streaming mode reads the (possibly GB-sized) archive once, front to back.
        with tarfile.open(archive, "r|*") as tar, ui.progress("items") as bar:
            task = bar.add_task(f"extract {archive.name}", total=len(wanted))
            for member in tar:
                name = member.name
                link = member.linkname if (member.issym() or member.islnk()) else None
                if (problem := _unsafe(name, link, archive)) is not None:
                    raise problem
                if member.isdev():
                    raise NmtError(f"{archive} has a device member {name!r}; refusing it")
                if name not in wanted:
                    continue
                if not member.isfile():
                    raise NmtError(f"{archive}: {name} is not a regular file; refusing it")
                src = tar.extractfile(member)
                assert src is not None
                target = staging / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with src, open(target, "wb") as f:
                    shutil.copyfileobj(src, f, CHUNK)
                found.add(name)
                bar.advance(task)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise NmtError(f"{archive} is truncated or corrupt ({e}); delete it and rerun") from None
    return found


def _extract_zip(archive: Path, wanted: set[str], staging: Path) -> set[str]:
    import zipfile
    import zlib

    found: set[str] = set()
    try:
        with zipfile.ZipFile(archive) as z:
            for info in z.infolist():
                is_link = stat.S_ISLNK(info.external_attr >> 16)
                link = z.read(info).decode("utf-8", "replace") if is_link else None
                if (problem := _unsafe(info.filename, link, archive)) is not None:
                    raise problem
                if info.filename not in wanted:
                    continue
                if is_link or info.is_dir():
                    raise NmtError(f"{archive}: {info.filename} is not a regular file; refusing it")
                target = staging / info.filename
                target.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, open(target, "wb") as f:
                    shutil.copyfileobj(src, f, CHUNK)
                found.add(info.filename)
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:
        raise NmtError(f"{archive} is truncated or corrupt ({e}); delete it and rerun") from None
    return found
