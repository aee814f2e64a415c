"""Hostile wheels: `cuvil check` and `cuvil publish` refuse each kind with exit status 1 and a
message naming the wheel and the member, in bounded memory, without a traceback.

The archives are written here: with zipfile for the ones it can express (modes, duplicate
names, odd paths), by hand (tests/ build the zip records with struct) for a 1 GiB zip bomb and
for headers whose sizes lie. Nothing here builds a model, so every test takes seconds.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import resource
import stat
import struct
import subprocess
import sys
import warnings
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from cuvil import cli
from cuvil.check import CHECK_KINDS, ArchiveLimits, CheckReport, check_wheel, read_wheel
from cuvil.errors import CheckError

ROOT = Path(__file__).resolve().parents[2]
WHEEL_NAME = "tiny-1.0-py3-none-manylinux_2_17_x86_64.whl"
DIST_INFO = "tiny-1.0.dist-info"
GOOD_FILES = {
    "tiny/__init__.py": b"",
    f"{DIST_INFO}/METADATA": b"Metadata-Version: 2.1\nName: tiny\nVersion: 1.0\n",
    f"{DIST_INFO}/WHEEL": (
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
        b"Tag: py3-none-manylinux_2_17_x86_64\n"
    ),
}
AS_LIMIT = 1_500_000_000  # bytes of address space for the zip bomb's `cuvil check`


def record(files: Mapping[str, bytes], algorithm: str = "sha256") -> bytes:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.new(algorithm, data).digest()).rstrip(b"=").decode()
        writer.writerow((name, f"{algorithm}={digest}", len(data)))
    writer.writerow((f"{DIST_INFO}/RECORD", "", ""))
    return out.getvalue().encode()


def write_zip(path: Path, entries: list[tuple[zipfile.ZipInfo | str, bytes]]) -> Path:
    """A zip of `entries` in this order, with a RECORD of the regular ones added at the end."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about duplicate names, which one test wants
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
            for info, data in entries:
                archive.writestr(info, data)
            names = {(i.filename if isinstance(i, zipfile.ZipInfo) else i): d for i, d in entries}
            archive.writestr(f"{DIST_INFO}/RECORD", record(names))
    return path


def good_entries() -> list[tuple[zipfile.ZipInfo | str, bytes]]:
    return list(GOOD_FILES.items())


def member(name: str, mode: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name)
    info.external_attr = mode << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def raw_zip(path: Path, entries: list[tuple[str, bytes, int, int]]) -> Path:
    """A zip written record by record: (name, deflated bytes, CRC-32, size the headers declare)."""
    out, central = bytearray(), bytearray()
    for name, data, crc, size in entries:
        encoded = name.encode()
        offset = len(out)
        out += struct.pack("<4s5H3I2H", b"PK\x03\x04", 20, 0, zipfile.ZIP_DEFLATED, 0, 0x21,
                           crc, len(data), size, len(encoded), 0) + encoded + data
        central += struct.pack("<4s6H3I5H2I", b"PK\x01\x02", 0x314, 20, 0, zipfile.ZIP_DEFLATED, 0,
                               0x21, crc, len(data), size, len(encoded), 0, 0, 0, 0,
                               (stat.S_IFREG | 0o644) << 16, offset) + encoded
    out += central + struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, len(entries), len(entries),
                                 len(central), len(out), 0)
    path.write_bytes(out)
    return path


def deflated_zeros(size: int) -> tuple[bytes, int]:
    """`size` zero bytes (a multiple of 1 MiB, at least 3 MiB) deflated, and their CRC-32.

    After a full flush deflate starts afresh, so every middle MiB compresses to the same bytes:
    the stream is built in milliseconds instead of deflating the whole size.
    """
    chunk = bytes(1 << 20)
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)
    middle = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)
    last = compressor.compress(chunk) + compressor.flush()
    crc = 0
    for _ in range(size >> 20):
        crc = zlib.crc32(chunk, crc)
    return first + middle * ((size >> 20) - 2) + last, crc


def archive_failure(report: CheckReport) -> str:
    assert [(r.name, r.ok) for r in report] == [("archive", False)], report.format()
    return report.results[0].message


def assert_refused(wheel: Path, capsys: pytest.CaptureFixture[str], *words: str) -> None:
    """`cuvil check` and `cuvil publish --dry-run` exit 1 naming the wheel, and `words`;
    `cuvil inspect` exits 1 too, with the same reason."""
    code = cli.main(["check", str(wheel)])
    out, err = capsys.readouterr()
    assert code == 1 and "FAIL archive" in out and "Traceback" not in out + err, out + err
    for word in (str(wheel), *words):
        assert word in out, out
    code = cli.main(["publish", "--dry-run", str(wheel)])
    out, err = capsys.readouterr()
    assert code == 1 and "refusing to upload" in err and "would run" not in out
    code = cli.main(["inspect", str(wheel)])
    out, err = capsys.readouterr()
    assert code == 1 and err.startswith("cuvil: error: ") and "Traceback" not in out + err, err
    for word in (str(wheel), *words):
        assert word in err, err


# ------------------------------------------------------------------------------- zip bomb


def test_a_1_gib_zip_bomb_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    data, crc = deflated_zeros(1 << 30)
    wheel = raw_zip(tmp_path / WHEEL_NAME, [("tiny/zeros.bin", data, crc, 1 << 30)])
    assert wheel.stat().st_size < 2 << 20
    with zipfile.ZipFile(wheel) as archive:  # a valid archive, as far as its headers go
        assert archive.getinfo("tiny/zeros.bin").file_size == 1 << 30

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # the child's own high-water mark (VmHWM starts afresh at exec; ru_maxrss would carry the
    # test worker's over)
    peak_file = tmp_path / "peak"
    check = ("import atexit, runpy, sys\n"
             f"def peak():\n    open({str(peak_file)!r}, 'w').write(next(l for l in "
             "open('/proc/self/status') if l.startswith('VmHWM')))\n"
             "atexit.register(peak)\n"
             f"sys.argv = ['cuvil', 'check', {str(wheel)!r}]\n"
             "runpy.run_module('cuvil', run_name='__main__')\n")
    with open(tmp_path / "out", "w+b") as out:
        proc = subprocess.Popen([sys.executable, "-c", check], stdout=out,
                                stderr=subprocess.STDOUT, preexec_fn=limit_memory, env=env)
        status = proc.wait()
        out.seek(0)
        text = out.read().decode()
    peak_mib = int(peak_file.read_text().split()[1]) / 1024  # kB
    print(f"peak RSS of cuvil check on the 1 GiB zip bomb: {peak_mib:.0f} MiB")
    assert status == 1, text
    assert "Traceback" not in text and "MemoryError" not in text, text
    assert "tiny/zeros.bin" in text and "zip bomb" in text and wheel.name in text
    assert peak_mib < 300, f"cuvil check used {peak_mib:.0f} MiB on a 1 MiB wheel"


def test_a_bomb_within_the_ratio_is_stopped_at_the_size_limit(tmp_path: Path) -> None:
    data, crc = deflated_zeros(8 << 20)
    wheel = raw_zip(tmp_path / WHEEL_NAME, [("tiny/zeros.bin", data, crc, 8 << 20)])
    with pytest.raises(CheckError, match=r"'tiny/zeros.bin' claims 8.0 MiB, more than the per-member limit"):
        read_wheel(wheel, ArchiveLimits(max_member_size=4 << 20, max_ratio=10**9))
    # the total counts every member
    (tmp_path / "two").mkdir()
    two = raw_zip(tmp_path / "two" / WHEEL_NAME,
                  [("tiny/a.bin", data, crc, 8 << 20), ("tiny/b.bin", data, crc, 8 << 20)])
    with pytest.raises(CheckError, match=r"claim 16.0 MiB in all, more than the limit of 12.0 MiB"):
        read_wheel(two, ArchiveLimits(max_total_size=12 << 20, max_ratio=10**9))


# ------------------------------------------------------------------------ lying headers


def _with_declared_size(tmp_path: Path, size: int) -> Path:
    """A good wheel whose tiny/data.bin (1000 bytes) the headers say is `size` bytes long."""
    payload = bytes(range(250)) * 4
    wheel = write_zip(tmp_path / WHEEL_NAME, [*good_entries(), ("tiny/data.bin", payload)])
    raw = bytearray(wheel.read_bytes())
    with zipfile.ZipFile(wheel) as archive:
        local = archive.getinfo("tiny/data.bin").header_offset
    struct.pack_into("<I", raw, local + 22, size)
    (central,) = struct.unpack("<I", raw[-6:-2])  # the end record gives the directory's offset
    while raw[central + 46 : central + 46 + 13] != b"tiny/data.bin":
        name_length, extra_length, comment_length = struct.unpack("<3H", raw[central + 28 : central + 34])
        central += 46 + name_length + extra_length + comment_length
    struct.pack_into("<I", raw, central + 24, size)
    wheel.write_bytes(raw)
    return wheel


def test_a_header_claiming_4_gib_for_1000_bytes_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = _with_declared_size(tmp_path, 0xFFFF_FFF0)
    assert_refused(wheel, capsys, "'tiny/data.bin' claims 4.0 GiB")
    # within the limits, the bytes counted while reading give the lie away
    wheel = _with_declared_size(tmp_path, 5000)
    assert_refused(wheel, capsys, "'tiny/data.bin'", "header says 5000 bytes, but it holds 1000")


def test_a_header_claiming_less_than_the_member_holds_is_refused(tmp_path: Path) -> None:
    message = archive_failure(check_wheel(_with_declared_size(tmp_path, 500), auditwheel=False))
    assert "'tiny/data.bin' cannot be read" in message


def test_a_member_whose_deflated_bytes_are_damaged_is_refused(tmp_path: Path) -> None:
    """zlib's own error (the wheel fuzzer found it: a raw zlib.error from `cuvil check`)."""
    data = bytes(range(256)) * 64  # deflates to a stream whose middle is not all literals
    wheel = write_zip(tmp_path / "tiny-1.0-py3-none-manylinux_2_17_x86_64.whl",
                      [*good_entries(), ("tiny/data.bin", data)])
    raw = bytearray(wheel.read_bytes())
    with zipfile.ZipFile(wheel) as archive:
        info = archive.getinfo("tiny/data.bin")
    start = info.header_offset + 30 + len(info.filename.encode())
    for at in range(start, start + min(info.compress_size, 40)):
        raw[at] ^= 0xFF
    wheel.write_bytes(bytes(raw))
    message = archive_failure(check_wheel(wheel, auditwheel=False))
    assert "'tiny/data.bin' cannot be read" in message


# ------------------------------------------------------------ what a wheel must not hold


HOSTILE = {
    "symlink": ([(member("tiny/link.py", stat.S_IFLNK | 0o777), b"/etc/passwd")], "symbolic link"),
    "setuid": ([(member("tiny/run.py", stat.S_IFREG | stat.S_ISUID | 0o755), b"")], "setuid or setgid"),
    "setgid": ([(member("tiny/run.py", stat.S_IFREG | stat.S_ISGID | 0o755), b"")], "setuid or setgid"),
    "character device": ([(member("tiny/tty", stat.S_IFCHR | 0o666), b"")], "special file"),
    "fifo": ([(member("tiny/pipe", stat.S_IFIFO | 0o666), b"")], "special file"),
    "absolute path": ([("/etc/cron.d/tiny", b"")], "absolute path"),
    "drive letter": ([("C:/tiny/x.py", b"")], "absolute path"),
    "dot-dot": ([("tiny/../../escape.py", b"")], "'..'"),
    "backslash": ([("tiny\\x.py", b"")], "backslash"),
    "duplicate": ([("tiny/__init__.py", b"import os\n")], "stored twice"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_members_are_refused(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    extra, words = HOSTILE[case]
    wheel = write_zip(tmp_path / WHEEL_NAME, [*good_entries(), *extra])
    name = extra[0][0].filename if isinstance(extra[0][0], zipfile.ZipInfo) else extra[0][0]
    assert_refused(wheel, capsys, repr(name), words)


def test_encrypted_and_unusual_compression_are_refused(tmp_path: Path) -> None:
    bzip = member("tiny/data.bin", stat.S_IFREG | 0o644)
    bzip.compress_type = zipfile.ZIP_BZIP2
    wheel = write_zip(tmp_path / WHEEL_NAME, [*good_entries(), (bzip, b"x" * 100)])
    assert "compression method 12" in archive_failure(check_wheel(wheel, auditwheel=False))
    raw = bytearray(write_zip(tmp_path / WHEEL_NAME, good_entries()).read_bytes())
    central = raw.find(b"PK\x01\x02")
    struct.pack_into("<H", raw, central + 8, 1)  # the "encrypted" flag
    wheel.write_bytes(raw)
    assert "is encrypted" in archive_failure(check_wheel(wheel, auditwheel=False))


def test_member_count_is_limited_before_the_directory_is_parsed(tmp_path: Path) -> None:
    entries = good_entries() + [(f"tiny/m{i}.py", b"") for i in range(20)]
    wheel = write_zip(tmp_path / WHEEL_NAME, entries)
    with pytest.raises(CheckError, match="holds 24 members, more than the limit of 10"):
        read_wheel(wheel, ArchiveLimits(max_members=10))
    assert len(read_wheel(wheel).members) == 24


def test_files_read_whole_are_limited_while_reading(tmp_path: Path) -> None:
    metadata = GOOD_FILES[f"{DIST_INFO}/METADATA"] + b"\n" + os.urandom(3 << 19)  # 1.5 MiB
    wheel = write_zip(tmp_path / WHEEL_NAME, [*good_entries()[:1], (f"{DIST_INFO}/METADATA", metadata),
                                              good_entries()[2]])
    with pytest.raises(CheckError, match=rf"'{DIST_INFO}/METADATA' holds more than the limit of 1.0 MiB"):
        read_wheel(wheel, ArchiveLimits(max_text_size=1 << 20))


# ------------------------------------------------------------------ what still passes


def test_a_plain_wheel_passes_the_archive_check_and_record_hashes_are_streamed(tmp_path: Path) -> None:
    big = os.urandom(3 << 20)  # more than one read chunk, incompressible
    zeros = bytes(900 << 10)  # compresses 1000 times, but stays under the ratio's floor
    files = {**GOOD_FILES, "tiny/weights.bin": big, "tiny/zeros.bin": zeros}
    for algorithm in ("sha256", "sha512"):
        wheel = tmp_path / algorithm / WHEEL_NAME
        wheel.parent.mkdir()
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
            for name, data in files.items():
                archive.writestr(name, data)
            archive.writestr(f"{DIST_INFO}/RECORD", record(files, algorithm))
        report = check_wheel(wheel, auditwheel=False)
        assert report["archive"].ok and "6 regular files" in report["archive"].message, report.format()
        assert report["RECORD"].ok, report.format()
        assert read_wheel(wheel).members["tiny/weights.bin"].size == len(big)
    # one changed byte in the big member is found by the streamed hash
    changed = big[:-1] + bytes([big[-1] ^ 1])
    with zipfile.ZipFile(tmp_path / "sha256" / WHEEL_NAME) as src:
        entries = [(i.filename, src.read(i)) for i in src.infolist()]
    bad = tmp_path / "bad" / WHEEL_NAME
    bad.parent.mkdir()
    with zipfile.ZipFile(bad, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries:
            archive.writestr(name, changed if name == "tiny/weights.bin" else data)
    message = check_wheel(bad, auditwheel=False)["RECORD"].message
    assert "tiny/weights.bin: the sha256 hash in RECORD" in message


def test_a_wheel_without_libraries_is_not_said_to_hold_some(tmp_path: Path) -> None:
    files = {**GOOD_FILES, f"{DIST_INFO}/WHEEL": GOOD_FILES[f"{DIST_INFO}/WHEEL"].replace(
        b"manylinux_2_17_x86_64", b"any")}
    wheel = tmp_path / "tiny-1.0-py3-none-any.whl"
    write_zip(wheel, list(files.items()))
    message = check_wheel(wheel, auditwheel=False)["wheel file name"].message
    assert "holds none" in message and "holds native libraries" not in message


def test_every_check_name_is_documented() -> None:
    text = (ROOT / "docs" / "check.md").read_text(encoding="utf-8")
    assert not [kind for kind in CHECK_KINDS if f"`{kind}`" not in text]


def test_a_library_of_constant_weights_is_not_taken_for_a_bomb(tmp_path: Path) -> None:
    # the libraries of the onnx package's light models (all weights one constant) compress
    # about 100 times: a real build of light_resnet50 was refused at a limit of 100
    rng = np.random.default_rng(0)
    library = np.full((24 << 20) // 4, 0.01, np.float32)
    library[:: 1024] = rng.standard_normal(library[:: 1024].size)  # some code and headers
    data = library.tobytes()
    compressed = len(zlib.compress(data, 9))
    assert 100 < len(data) / compressed < 500
    files = {**GOOD_FILES, "tiny/_tiny.so": data}
    wheel = tmp_path / WHEEL_NAME
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, payload in files.items():
            archive.writestr(name, payload)
        archive.writestr(f"{DIST_INFO}/RECORD", record(files, "sha256"))
    assert read_wheel(wheel).members["tiny/_tiny.so"].size == len(data)


def test_a_library_of_one_constant_passes_but_the_same_bytes_elsewhere_are_a_bomb(tmp_path: Path) -> None:
    # light_bvlc_alexnet's library: 88 MiB of one repeated float inflate from 179 KiB (about
    # 1000 times, deflate's ceiling); only the size limits bound a native library
    data = np.full((32 << 20) // 4, 0.01, np.float32).tobytes()
    assert len(data) / len(zlib.compress(data, 9)) > 900
    manifest = json.dumps({"models": [{"name": "m", "library": "_tiny.so"}]}).encode()
    library = _wheel_with(tmp_path / "library", "tiny/_tiny.so", data, {"tiny/_models.json": manifest})
    wheel = read_wheel(library)
    assert wheel.members["tiny/_tiny.so"].size == len(data)
    # the checks that read the library again (ELF, ABI) take it whole too
    (again,) = wheel.libraries()
    assert again.data == data
    with pytest.raises(CheckError, match=r"claims 32\.0 MiB, more than the per-member limit of 16\.0 MiB"):
        read_wheel(library, ArchiveLimits(max_member_size=16 << 20))
    with pytest.raises(CheckError, match="likely zip bomb"):
        read_wheel(_wheel_with(tmp_path / "data", "tiny/weights.bin", data))


def _wheel_with(folder: Path, name: str, data: bytes, more: Mapping[str, bytes] | None = None) -> Path:
    files = {**GOOD_FILES, **(more or {}), name: data}
    folder.mkdir()
    wheel = folder / WHEEL_NAME
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for member, payload in files.items():
            archive.writestr(member, payload)
        archive.writestr(f"{DIST_INFO}/RECORD", record(files, "sha256"))
    return wheel


def test_a_fifo_named_like_a_wheel_is_refused_without_opening_it(
        tmp_path: Path, fifo, capsys: pytest.CaptureFixture[str]) -> None:
    wheel = fifo(tmp_path / "digits_cuvil-1.0.0-py3-none-any.whl")
    # inspect: status 2, as for any path that is not a model or wheel file
    for argv, status in ((["check", str(wheel)], 1), (["publish", "--dry-run", str(wheel)], 1),
                         (["inspect", str(wheel)], 2), (["doctor", str(wheel)], 1)):
        code = cli.main(argv)
        out = "".join(capsys.readouterr())
        assert code == status and "Traceback" not in out, (argv, out)
        assert str(wheel) in out and "a FIFO (named pipe)" in out, (argv, out)


def test_a_local_header_that_disagrees_with_the_central_directory_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The central directory is right (Python's zipfile and pip read it); only the local
    header, which streaming unzippers read, lies about the size."""
    payload = bytes(range(250)) * 4
    wheel = write_zip(tmp_path / WHEEL_NAME, [*good_entries(), ("tiny/data.bin", payload)])
    raw = bytearray(wheel.read_bytes())
    with zipfile.ZipFile(wheel) as archive:
        local = archive.getinfo("tiny/data.bin").header_offset
    struct.pack_into("<I", raw, local + 22, 5000)
    wheel.write_bytes(raw)
    assert_refused(wheel, capsys, "'tiny/data.bin' has a local header that says 5000 bytes",
                   "where the central directory says 1000")
