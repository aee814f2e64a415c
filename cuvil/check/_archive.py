"""Reading a wheel safely, once for every check: its name, members and the cuvil manifest.

A wheel comes from anywhere, so nothing in it is trusted: member names, types and modes are
checked before anything is decompressed, every member is streamed with its bytes counted
against `ArchiveLimits` (the sizes in the zip headers are only compared with the count), and
only what the checks read whole is kept in memory: the .dist-info files and the manifest
(up to `max_text_size`), and one native library at a time (`WheelArchive.libraries`).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import re
import stat
import struct
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from packaging.tags import Tag
from packaging.utils import InvalidWheelFilename, parse_wheel_filename

from cuvil.errors import CheckError, not_a_regular_file

__all__ = [
    "CHECKSUM_SIZE",
    "MANIFEST",
    "ArchiveLimits",
    "Library",
    "Member",
    "WheelArchive",
    "read_wheel",
]

MANIFEST = "_models.json"
CHECKSUM_SIZE = 65  # 64 hex digits and a NUL

_MiB = 1 << 20
_CHUNK = _MiB
_HEAD = 8  # bytes kept of every member: enough for the ELF and Mach-O magic numbers
_DRIVE = re.compile(r"^[A-Za-z]:")
_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate"}
_WEAK_HASHES = {"md5", "sha1"}
#: members that are native libraries (exempt from the compression-ratio rule)
NATIVE_SUFFIXES = (".so", ".dylib", ".dll", ".pyd")


@dataclass(frozen=True)
class ArchiveLimits:
    """What a wheel may hold. The defaults leave room for model wheels with a few hundred MB of
    weights (one library of up to 1 GiB, 2 GiB in all) and refuse zip bombs early: a member
    that inflates to more than `max_ratio` times its compressed size once past `ratio_floor`
    bytes (trained weights and machine code compress 1-4 times; a bomb of zeros about 1000
    times). Native libraries are exempt from the ratio: a model whose weights are all one
    constant (the onnx package's light models) compresses as well as a bomb of zeros, up to
    deflate's ceiling of about 1032 times, so only the size limits bound them."""

    max_members: int = 10_000
    max_member_size: int = 1 << 30
    max_total_size: int = 2 << 30
    max_ratio: int = 500
    ratio_floor: int = _MiB
    max_text_size: int = 16 * _MiB  # .dist-info files and the manifest, which are read whole


@dataclass(frozen=True)
class Member:
    """A regular file of the wheel, as streamed: its size and digests counted from its bytes."""

    name: str
    size: int
    digests: dict[str, str]  # hashlib algorithm -> urlsafe base64 without padding (as RECORD has it)
    head: bytes  # the first bytes, for telling native libraries apart


@dataclass(frozen=True)
class Library:
    """A native library of the wheel and the models the manifest says it holds."""

    path: str  # archive path
    data: bytes
    models: tuple[dict[str, Any], ...]

    @property
    def file_name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def model_names(self) -> list[str]:
        return [str(m.get("name")) for m in self.models]

    def expected_exports(self) -> set[str]:
        """The C ABI of its models, and nothing else: what the library must export."""
        from cuvil.runtime import EXPORTED_PARTS, exported_symbol

        return {exported_symbol(m, part) for m in self.model_names for part in EXPORTED_PARTS}

    def export_problems(self, found: set[str], fix: str, who: str = "") -> list[str]:
        """What is wrong with exporting `found`: symbols beyond the C ABI (with `fix`, how to
        hide them) and C ABI symbols missing. `who` names the slice in a fat file."""
        expected = self.expected_exports()
        extra, missing = sorted(found - expected), sorted(expected - found)
        problems = []
        if extra:
            problems.append(
                f"{who}exports {', '.join(extra)} besides the C ABI of model(s) "
                f"{', '.join(self.model_names)}: {fix}"
            )
        if missing:
            problems.append(f"{who}does not export {', '.join(missing)}")
        return problems


@dataclass
class WheelArchive:
    path: Path
    members: dict[str, Member]  # archive path -> member, directories left out
    texts: dict[str, bytes] = field(default_factory=dict)  # .dist-info files and manifest candidates
    limits: ArchiveLimits = field(default_factory=ArchiveLimits)
    name: str | None = None  # normalized distribution name from the file name
    version: str | None = None
    tags: frozenset[Tag] = frozenset()
    filename_error: str | None = None
    manifest_path: str | None = None
    manifest: dict[str, Any] | None = None
    manifest_error: str | None = None

    @property
    def platforms(self) -> list[str]:
        return sorted({t.platform for t in self.tags})

    @property
    def package(self) -> str | None:
        return self.manifest_path.split("/", 1)[0] if self.manifest_path else None

    def dist_info_dirs(self) -> list[str]:
        return sorted({p.split("/", 1)[0] for p in self.members if p.split("/", 1)[0].endswith(".dist-info")})

    def native_members(self) -> list[str]:
        """Members that are native libraries by their magic number (ELF, Mach-O), or by their
        name: a file named like an extension module shadows the Python module of its name
        whatever it holds."""
        from cuvil.check.manifest import native_kind

        return sorted(p for p, m in self.members.items()
                      if native_kind(m.head) is not None or p.endswith(NATIVE_SUFFIXES))

    def libraries(self) -> Iterator[Library]:
        """The libraries the manifest names, in manifest order (each once), that are in the wheel.

        Each is read when the iteration reaches it, so one at a time is in memory; CheckError
        if the file changed since `read_wheel` streamed it.
        """
        if not self.manifest or not self.package:
            return
        by_file: dict[str, list[dict[str, Any]]] = {}
        for model in self.manifest.get("models", []):
            if isinstance(model, dict) and isinstance(model.get("library"), str):
                by_file.setdefault(model["library"], []).append(model)
        for file_name, models in by_file.items():
            path = f"{self.package}/{file_name}"
            if path in self.members:
                yield Library(path, self._read_again(path), tuple(models))

    def _read_again(self, name: str) -> bytes:
        with _open(self.path) as archive:
            info = archive.getinfo(name)
            out = io.BytesIO()
            _stream(self.path, archive, info, self.limits, self.limits.max_member_size, [out.write])
        data = out.getvalue()
        if _digest("sha256", data) != self.members[name].digests["sha256"]:
            raise CheckError(f"{self.path}: member {name!r} changed while the wheel was being checked")
        return data


def read_wheel(path: str | Path, limits: ArchiveLimits | None = None) -> WheelArchive:
    """Read the wheel at `path` in bounded memory; CheckError if it is no zip archive, or one
    that breaks a rule of `_safety_problem` or exceeds `limits`."""
    path = Path(path)
    limits = limits or ArchiveLimits()
    with _open(path, limits) as archive:
        infos = [i for i in archive.infolist() if not i.is_dir()]
        with open(path, "rb") as raw:
            for info in archive.infolist():
                problem = _safety_problem(info, limits) or _local_header_problem(raw, info)
                if problem:
                    raise CheckError(f"{path}: member {info.filename!r} {problem}")
        seen: set[str] = set()
        for info in archive.infolist():
            if info.filename in seen:
                raise CheckError(
                    f"{path}: member {info.filename!r} is stored twice; installers would keep one "
                    "of the two unpredictably"
                )
            seen.add(info.filename)
        declared = sum(i.file_size for i in infos)
        if declared > limits.max_total_size:
            raise CheckError(
                f"{path}: its members claim {_size(declared)} in all, more than the limit of "
                f"{_size(limits.max_total_size)}"
            )
        texts = {i.filename: _read_text(path, archive, i, limits) for i in infos if _is_text(i.filename)}
        algorithms = {"sha256"} | _record_algorithms(texts)
        members, total = {}, 0
        for info in infos:
            member = _hash_member(path, archive, info, limits, algorithms)
            members[info.filename] = member
            total += member.size
            if total > limits.max_total_size:
                raise CheckError(
                    f"{path}: its members hold more than the limit of {_size(limits.max_total_size)} "
                    f"in all (reached at {info.filename!r})"
                )
    wheel = WheelArchive(path=path, members=members, texts=texts, limits=limits)
    try:
        name, version, _build, tags = parse_wheel_filename(path.name)
        wheel.name, wheel.version, wheel.tags = str(name), str(version), frozenset(tags)
    except InvalidWheelFilename as exc:
        wheel.filename_error = str(exc)
    _read_manifest(wheel)
    return wheel


def _open(path: Path, limits: ArchiveLimits | None = None) -> zipfile.ZipFile:
    kind = not_a_regular_file(path)
    if kind == "missing":
        raise CheckError(f"{path}: no such file")
    if kind is not None:
        raise CheckError(f"{path}: not a wheel: it is {kind}, not a file")
    try:
        if limits is not None:
            with open(path, "rb") as f:
                count = _declared_member_count(f)
            if count is not None and count > limits.max_members:
                raise CheckError(
                    f"{path}: the archive says it holds {count} members, more than the limit of "
                    f"{limits.max_members}"
                )
        return zipfile.ZipFile(path)
    except FileNotFoundError:
        raise CheckError(f"{path}: no such file") from None
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise CheckError(f"{path}: not a wheel (cannot read it as a zip archive: {exc})") from None


def _declared_member_count(f: IO[bytes]) -> int | None:
    """The member count the end of the central directory gives, before zipfile builds one object
    per member; None if there is no such record (zipfile then says why)."""
    size = f.seek(0, io.SEEK_END)
    tail_size = min(size, 22 + 0xFFFF)  # the record and the longest comment
    f.seek(size - tail_size)
    tail = f.read(tail_size)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + 22 > len(tail):
        return None
    (count,) = struct.unpack("<H", tail[at + 10 : at + 12])
    if count != 0xFFFF or at < 20 or tail[at - 20 : at - 16] != b"PK\x06\x07":
        return int(count)
    (zip64_end,) = struct.unpack("<Q", tail[at - 12 : at - 4])  # the zip64 record's offset
    if zip64_end + 56 > size:
        return None
    f.seek(zip64_end)
    record = f.read(56)
    if record[:4] != b"PK\x06\x06":
        return None
    return int(struct.unpack("<Q", record[32:40])[0])


def _safety_problem(info: zipfile.ZipInfo, limits: ArchiveLimits) -> str | None:
    """What makes the member unsafe to install or to read, as the end of a sentence; or None."""
    name = info.filename
    parts = name.rstrip("/").split("/") if info.is_dir() else name.split("/")
    if name.startswith("/") or _DRIVE.match(name):
        return "has an absolute path; wheel paths are relative to the install folder"
    if "\\" in name:
        return "has a backslash in its path; wheel paths separate folders with / only"
    if ".." in parts:
        return "has '..' in its path, which would escape the install folder"
    if any(part in ("", ".") for part in parts) or "\0" in name:
        return "has an empty, '.' or NUL part in its path"
    mode = info.external_attr >> 16
    kind = stat.S_IFMT(mode)
    if stat.S_ISLNK(mode):
        return "is a symbolic link; wheels hold regular files only"
    if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
        return f"is a special file (mode {mode:o}: device, FIFO or socket); wheels hold regular files only"
    if mode & (stat.S_ISUID | stat.S_ISGID):
        return f"has the setuid or setgid bit set (mode {mode & 0o7777:o}); no wheel file needs it"
    if info.flag_bits & 0x1:
        return "is encrypted"
    if info.compress_type not in _METHODS:
        return f"uses compression method {info.compress_type}; wheels use deflate or stored"
    if info.file_size > limits.max_member_size:
        return (
            f"claims {_size(info.file_size)}, more than the per-member limit of "
            f"{_size(limits.max_member_size)}"
        )
    return None


#: a local file header's fixed part: signature, version, flags, method, time, date, CRC-32,
#: compressed and uncompressed sizes, name and extra field lengths
_LOCAL_HEADER = struct.Struct("<4s5H3I2H")
_ZIP64_EXTRA = 0x0001
_DATA_DESCRIPTOR = 0x08  # flag: sizes and CRC follow the data instead


def _local_header_problem(raw: IO[bytes], info: zipfile.ZipInfo) -> str | None:
    """How the member's local header disagrees with the central directory, or None. Python
    and pip read sizes from the directory, streaming unzippers from the local header: a wheel
    whose two disagree unpacks differently depending on the tool."""
    raw.seek(info.header_offset)
    head = raw.read(_LOCAL_HEADER.size)
    if len(head) < _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
        return "has no local file header where the central directory points"
    _, _, flags, method, _, _, crc, csize, usize, name_len, extra_len = _LOCAL_HEADER.unpack(head)
    if method != info.compress_type:
        return (f"is stored with compression method {method} by its local header but "
                f"{info.compress_type} by the central directory")
    if flags & _DATA_DESCRIPTOR:
        return None  # sizes follow the data; the stream's byte count is checked when read
    if 0xFFFFFFFF in (csize, usize):
        raw.seek(info.header_offset + _LOCAL_HEADER.size + name_len)
        extra = raw.read(extra_len)
        while len(extra) >= 4:
            tag, size = struct.unpack("<HH", extra[:4])
            if tag == _ZIP64_EXTRA and size >= 16:
                usize, csize = struct.unpack("<QQ", extra[4:20])
                break
            extra = extra[4 + size:]
    if (usize, csize, crc) != (info.file_size, info.compress_size, info.CRC):
        return (f"has a local header that says {usize} bytes ({csize} compressed, CRC "
                f"{crc:08x}) where the central directory says {info.file_size} "
                f"({info.compress_size} compressed, CRC {info.CRC:08x}): tools that read one "
                "or the other would unpack different files")
    return None


def _is_text(name: str) -> bool:
    """Files the checks read whole: the .dist-info's (WHEEL, METADATA, RECORD...) and the manifest."""
    top, _, rest = name.partition("/")
    return (top.endswith(".dist-info") and "/" not in rest) or rest == MANIFEST


def _read_text(path: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo, limits: ArchiveLimits) -> bytes:
    out = io.BytesIO()
    _stream(path, archive, info, limits, limits.max_text_size, [out.write])
    return out.getvalue()


def _record_algorithms(texts: dict[str, bytes]) -> set[str]:
    """The hash algorithms RECORD files use, of those hashlib has and RECORD may use."""
    found = set()
    for name, data in texts.items():
        if name.endswith(".dist-info/RECORD"):
            try:
                rows = csv.reader(io.StringIO(data.decode("utf-8")))
                found |= {row[1].partition("=")[0] for row in rows if len(row) == 3}
            except (UnicodeDecodeError, csv.Error):
                pass  # the RECORD check says so
    return {
        a for a in found
        if a in hashlib.algorithms_guaranteed and a not in _WEAK_HASHES and not a.startswith("shake_")
    }


def _hash_member(
    path: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo, limits: ArchiveLimits, algorithms: set[str]
) -> Member:
    hashes = {a: hashlib.new(a) for a in sorted(algorithms)}
    head = bytearray()

    def keep_head(chunk: bytes) -> None:
        if len(head) < _HEAD:
            head.extend(chunk[: _HEAD - len(head)])

    sinks = [h.update for h in hashes.values()] + [keep_head]
    size = _stream(path, archive, info, limits, limits.max_member_size, sinks)
    digests = {a: _b64(h.digest()) for a, h in hashes.items()}
    return Member(info.filename, size, digests, bytes(head))


def _stream(
    path: Path,
    archive: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    limits: ArchiveLimits,
    max_size: int,
    sinks: list[Any],
) -> int:
    """Decompress the member chunk by chunk into `sinks`, counting its bytes against the limits
    (the compression ratio too, unless it is a native library); return its size, which must
    equal the header's."""
    where = f"{path}: member {info.filename!r}"
    ratio = not info.filename.endswith(NATIVE_SUFFIXES)
    # the compressed size bounds the ratio; it is a header field too, so at most the file's size
    compressed = max(1, min(info.compress_size, path.stat().st_size))
    count = 0
    try:
        with archive.open(info) as stream:
            while chunk := stream.read(_CHUNK):
                count += len(chunk)
                if count > max_size:
                    raise CheckError(f"{where} holds more than the limit of {_size(max_size)}")
                if ratio and count > limits.ratio_floor and count > limits.max_ratio * compressed:
                    raise CheckError(
                        f"{where} inflates to more than {limits.max_ratio} times its compressed size "
                        f"({_size(count)} from {_size(compressed)} so far): refused as a likely zip bomb"
                    )
                for sink in sinks:
                    sink(chunk)
    # zlib.error: a method or size field that lies about deflated bytes
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError,
            zlib.error) as exc:
        raise CheckError(f"{where} cannot be read: {exc}") from None
    if count != info.file_size:
        raise CheckError(
            f"{where}: its zip header says {info.file_size} bytes, but it holds {count}; "
            "the archive was tampered with or damaged"
        )
    return count


def _digest(algorithm: str, data: bytes) -> str:
    return _b64(hashlib.new(algorithm, data).digest())


def _b64(digest: bytes) -> str:
    """A digest as RECORD writes it: urlsafe base64 without padding."""
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", _MiB), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _read_manifest(wheel: WheelArchive) -> None:
    candidates = sorted(
        p
        for p in wheel.members
        if p.count("/") == 1 and p.endswith("/" + MANIFEST) and not p.split("/")[0].endswith(".dist-info")
    )
    if not candidates:
        wheel.manifest_error = (
            f"no <package>/{MANIFEST} in the wheel: it was not built by cuvil, or the package "
            "folder is missing; rebuild it with `cuvil build`"
        )
        return
    if len(candidates) > 1:
        wheel.manifest_error = f"several cuvil manifests in one wheel: {', '.join(candidates)}"
        return
    wheel.manifest_path = candidates[0]
    try:
        manifest = json.loads(wheel.texts[candidates[0]].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        wheel.manifest_error = f"{candidates[0]} is not valid JSON: {exc}"
        return
    except RecursionError:
        wheel.manifest_error = f"{candidates[0]} is not a cuvil manifest: its JSON nests too deeply"
        return
    if not isinstance(manifest, dict) or not isinstance(manifest.get("models"), list):
        wheel.manifest_error = f"{candidates[0]} has no list of models"
        return
    wheel.manifest = manifest
