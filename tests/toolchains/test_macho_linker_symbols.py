"""What zig's Mach-O linker adds to a dylib beyond ld64's output, pinned down (docs/cibuildwheel.md).

zig 0.17 exports `__mh_dylib_header` and `___dso_handle` from a dylib, both at an address in
its own __DATA segment (not at the Mach-O header, where ld64 puts them), and writes an
LC_LOAD_DYLINKER; ld64 and lld give both symbols linkage-unit scope in a dylib and write
LC_LOAD_DYLINKER only into executables (the kernel reads it from the main executable alone).
For cuvil's libraries this is harmless, in the form asserted here: the image is an MH_DYLIB with
no entry point and a two-level namespace (no other image binds to its symbols unless it links
against it, which nothing does: the package dlopens it and looks up cuvil_<model>_* only), and
the dylinker it names is dyld itself. The one reader of the misplaced `___dso_handle` is
`__cxa_atexit`, which clang's Mach-O lowering of the thread pool's
`__attribute__((destructor))` calls with it: libSystem runs every such handler at exit
whatever its DSO key, and on dlclose dyld picks the handlers to run by their code address in
the closing image, not by that key, so the value is never dereferenced. No other libSystem
function that reads a DSO handle as a Mach-O header (os_log, __cxa_thread_atexit, ...) may be
called. zig offers no
switch to drop them: -exported_symbol and -unexported_symbol are refused, and
-exported_symbols_list is accepted but changes nothing (checked below). If zig ever exports
anything else, or the runtime starts calling such a function, this test fails.

The load commands and header are read with macholib (delocate's Mach-O reader), the export trie
and the symbol table with cuvil's reader (macholib has no trie reader).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cuvil.check._macho import parse_macho
from cuvil.check.macho import LINKER_SYMBOLS
from cuvil.runtime import CLOCK_SOURCE, THREADPOOL_SOURCE
from cuvil.toolchains import get_target, zig

macholib = pytest.importorskip("macholib.MachO")
from macholib.mach_o import (  # noqa: E402
    LC_LOAD_DYLINKER,
    LC_MAIN,
    LC_SEGMENT_64,
    LC_UNIXTHREAD,
    MH_DYLDLINK,
    MH_DYLIB,
    MH_TWOLEVEL,
)

SOURCE = """
__attribute__((visibility("default"))) int cuvil_tiny_run(int x) { return x + helper(x); }
"""
# libSystem functions that take a DSO handle (&__dso_handle) and read the image's header there
# (__cxa_atexit only keys its handler with it: allowed, see above)
DSO_HANDLE_READERS = {"___cxa_thread_atexit", "__tlv_atexit", "__os_log_impl",
                    "__os_log_error_impl", "__os_log_debug_impl", "__os_signpost_emit_with_name_impl",
                    "__os_activity_create", "__os_activity_initiate"}


def link(tmp_path: Path, arch_name: str, extra: tuple[str, ...] = ()) -> Path:
    """A library linked as cuvil links a model's: with the C runtime (thread pool, clock)."""
    arch = get_target("universal2-macos").arch(arch_name)
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = tmp_path / "tiny.c"
    source.write_text("static int helper(int x) { return 2 * x; }\n" + SOURCE)
    objects = [zig.compile_c(source, tmp_path / f"tiny.{arch_name}.o", arch),
               zig.compile_c(THREADPOOL_SOURCE, tmp_path / f"threadpool.{arch_name}.o", arch),
               zig.compile_c(CLOCK_SOURCE, tmp_path / f"clock.{arch_name}.o", arch)]
    return zig.link_shared(objects, tmp_path / arch_name / "_tiny.dylib", arch, "macho", "_tiny.dylib",
                           libs=("m", "pthread"), strip=True, extra_args=extra)


@pytest.mark.parametrize("arch_name", ["x86_64", "aarch64"])
def test_zigs_extra_dylib_symbols_and_dylinker_are_the_images_own_header(
    tmp_path: Path, arch_name: str
) -> None:
    path = link(tmp_path, arch_name)
    (header,) = macholib.MachO(str(path)).headers
    assert header.header.filetype == MH_DYLIB
    assert header.header.flags & MH_TWOLEVEL and header.header.flags & MH_DYLDLINK
    commands = {lc.cmd for lc, _, _ in header.commands}
    assert not commands & {LC_MAIN, LC_UNIXTHREAD}  # no entry point: never run as a program
    for lc, _cmd, data in header.commands:
        if lc.cmd == LC_LOAD_DYLINKER:
            assert data.rstrip(b"\0") == b"/usr/lib/dyld"

    segments = [(cmd.vmaddr, cmd.vmaddr + cmd.vmsize) for lc, cmd, _ in header.commands
                if lc.cmd == LC_SEGMENT_64]

    (image,) = parse_macho(path.read_bytes(), path.name)[1]
    exports = image.trie_exports()
    extra = set(exports) - {"_cuvil_tiny_run", "_cuvil_tiny_thread_pool", "_cuvil_tiny_use_thread_pool",
                            "_cuvil_tiny_set_thread_limit"}
    assert extra <= {"_" + name for name in LINKER_SYMBOLS}, extra
    for name in extra:  # each names an address of this image, whatever lies there
        address = exports[name]
        assert address is not None and any(lo <= address < hi for lo, hi in segments), name
    imported = {s.name for s in image.symbols() if s.type & 0x0E == 0 and s.type & 0x01}
    assert imported and not imported & DSO_HANDLE_READERS, imported


def test_exported_symbols_list_does_not_change_zigs_output(tmp_path: Path) -> None:
    plain = link(tmp_path / "plain", "aarch64")
    listed = tmp_path / "exports.txt"
    listed.write_text("_cuvil_tiny_run\n")
    with_list = link(tmp_path / "listed", "aarch64", (f"-Wl,-exported_symbols_list,{listed}",))
    names = [set(parse_macho(p.read_bytes(), p.name)[1][0].trie_exports()) for p in (plain, with_list)]
    assert names[0] == names[1]
